//! The fairness model: how much GPU each tenant may hold federation-wide right now.
//!
//! For capacity `G` and each tenant `t` with weight `w`, shares `m <= M` (basis points),
//! demand `D` and decayed usage `U` (all integers):
//!
//! 1. guarantee `g_t = min(D_t, floor(m_t * G / 10^4))`;
//! 2. cap `c_t = min(D_t, floor(M_t * G / 10^4))`;
//! 3. surplus `S = G - sum g`, shared by *weighted max-min* (water-filling) among the
//!    tenants below their cap, each tenant taking at most `c_t - g_t`, with effective
//!    weight `w'_t = w_t / max(1, r_t)` where `r_t = (U_t / sum U) / (w_t / sum w)` is how
//!    far the tenant's recent usage exceeded its weight share; `w'_t >= w_t / 16` so no
//!    tenant's surplus share is ever cut to nothing;
//! 4. `E_t = g_t + surplus_t`.
//!
//! That gives docs/guarantees.md G1-G5 directly; G6 (determinism) because every
//! step is integer arithmetic in a fixed order (ties broken by input index, and inputs
//! are sorted by tenant name); G7 is the admission and reclaim layers' to keep.
//! Cost: one sort, `O(T log T)`.

use serde::{Deserialize, Serialize};

use crate::policy::FULL_SHARE_BP;
use crate::MilliGpue;

/// Fixed-point bits of effective weights (`w'` is in milli-weight units times 2^20).
pub const EFF_WEIGHT_BITS: u32 = 20;
/// Largest factor by which decay bias can shrink a weight.
pub const MAX_USAGE_PENALTY: u64 = 16;

/// One tenant's inputs to [`compute`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantInput {
    /// Weight in thousandths; must be > 0.
    pub weight_milli: u64,
    /// Guaranteed share, basis points.
    pub min_share_bp: u32,
    /// Largest share, basis points (`>= min_share_bp`).
    pub max_share_bp: u32,
    /// Demand: bound + pending (+ burst headroom, see [`effective_demand`]).
    pub demand: MilliGpue,
    /// Decayed usage (any consistent unit; only ratios matter).
    pub usage: u64,
}

/// One tenant's entitlement and the numbers that produced it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Entitlement {
    /// `min(D, minShare * G)`.
    pub guarantee: MilliGpue,
    /// `min(D, maxShare * G)`.
    pub cap: MilliGpue,
    /// Effective weight after decay bias, milli-weight x 2^20.
    pub effective_weight_q20: u64,
    /// What the tenant got of the surplus above guarantees.
    pub surplus: MilliGpue,
    /// `guarantee + surplus`: the entitlement.
    pub total: MilliGpue,
    /// Usage share in parts per million of the federation's decayed usage.
    pub usage_share_ppm: u32,
    /// Weight share in parts per million.
    pub weight_share_ppm: u32,
}

/// Demand as the entitlement sees it: what is bound or waiting, or `burst_factor` times
/// what is bound, whichever is larger. A factor of 1.0 (`1000`) adds no headroom; the
/// article's "2x your steady-state need" is `2000`.
pub fn effective_demand(inuse: MilliGpue, pending: MilliGpue, burst_factor_milli: u32) -> MilliGpue {
    let burst = (u128::from(inuse) * u128::from(burst_factor_milli)).div_ceil(1000);
    let burst = u64::try_from(burst).unwrap_or(u64::MAX);
    inuse.saturating_add(pending).max(burst)
}

/// `floor(share_bp * capacity / 10^4)`.
pub fn share_of(capacity: MilliGpue, share_bp: u32) -> MilliGpue {
    let v = u128::from(capacity) * u128::from(share_bp) / u128::from(FULL_SHARE_BP);
    u64::try_from(v).unwrap_or(u64::MAX)
}

/// Computes every tenant's entitlement out of `capacity` (see the module docs).
///
/// Holds for every output `E` (docs/guarantees.md G1-G5):
/// `E_t >= min(D_t, m_t G)`, `E_t <= min(D_t, M_t G)`, `sum E <= G`, and if any
/// `E_t < min(D_t, M_t G)` then `sum E = G`. Same inputs, same bits. If the guarantees
/// of an invalid policy exceed the capacity, guarantees are honoured in input order
/// until capacity runs out (a validated policy never gets there).
pub fn compute(capacity: MilliGpue, tenants: &[TenantInput]) -> Vec<Entitlement> {
    let n = tenants.len();
    let mut out = vec![Entitlement::default(); n];
    if n == 0 {
        return out;
    }

    // Guarantees and caps.
    let mut left = capacity;
    for (t, o) in tenants.iter().zip(out.iter_mut()) {
        let cap = t.demand.min(share_of(capacity, t.max_share_bp));
        let g = t.demand.min(share_of(capacity, t.min_share_bp)).min(cap).min(left);
        left -= g;
        o.guarantee = g;
        o.cap = cap;
        o.total = g;
    }

    effective_weights(tenants, &mut out);

    // Water-fill the surplus `left` over room `cap - guarantee`, by effective weight.
    let room: Vec<u64> = out.iter().map(|o| o.cap - o.guarantee).collect();
    let total_room: u128 = room.iter().map(|&r| u128::from(r)).sum();
    if total_room <= u128::from(left) {
        for (o, r) in out.iter_mut().zip(&room) {
            o.surplus = *r;
        }
    } else {
        let weights: Vec<u64> = out.iter().map(|o| o.effective_weight_q20).collect();
        let surplus = water_fill(left, &room, &weights);
        for (o, s) in out.iter_mut().zip(surplus) {
            o.surplus = s;
        }
    }
    for o in &mut out {
        o.total = o.guarantee + o.surplus;
    }
    out
}

/// Decay bias: `w' = w / max(1, r)` with `r = usage share / weight share`, floored at
/// `w / 16`. Shares are taken in Q32 so the arithmetic is exact and bounded.
fn effective_weights(tenants: &[TenantInput], out: &mut [Entitlement]) {
    let sum_w: u128 = tenants.iter().map(|t| u128::from(t.weight_milli)).sum();
    let sum_u: u128 = tenants.iter().map(|t| u128::from(t.usage)).sum();
    for (t, o) in tenants.iter().zip(out.iter_mut()) {
        let w = u128::from(t.weight_milli.min(1 << 40)) << EFF_WEIGHT_BITS;
        let w_share = (u128::from(t.weight_milli) << 32).checked_div(sum_w).unwrap_or(0);
        let u_share = (u128::from(t.usage) << 32).checked_div(sum_u).unwrap_or(0);
        o.weight_share_ppm = u32::try_from((w_share * 1_000_000) >> 32).unwrap_or(u32::MAX);
        o.usage_share_ppm = u32::try_from((u_share * 1_000_000) >> 32).unwrap_or(u32::MAX);
        let eff = if u_share <= w_share || u_share == 0 {
            w
        } else {
            (w * w_share / u_share).max(w / u128::from(MAX_USAGE_PENALTY))
        };
        o.effective_weight_q20 = u64::try_from(eff.max(1)).unwrap_or(u64::MAX);
    }
}

/// Weighted max-min fair division of `amount` among claimants with `room` (upper bounds)
/// and positive `weights`: find the level `L` with `sum min(room_i, L * w_i) = amount`,
/// then round down and hand the few leftover units, one each, to the claimants with the
/// largest fractional parts (ties to the lower index). Requires `amount < sum room`.
///
/// Holds: each result `<= room_i`; results sum to exactly `amount`; deterministic.
pub fn water_fill(amount: u64, room: &[u64], weights: &[u64]) -> Vec<u64> {
    let n = room.len();
    let mut out = vec![0u64; n];
    // Saturation level of i is room_i / w_i; visit in increasing order.
    let mut order: Vec<usize> = (0..n).filter(|&i| room[i] > 0).collect();
    order.sort_by(|&a, &b| {
        let lhs = u128::from(room[a]) * u128::from(weights[b].max(1));
        let rhs = u128::from(room[b]) * u128::from(weights[a].max(1));
        lhs.cmp(&rhs).then(a.cmp(&b))
    });
    let mut left = u128::from(amount);
    let mut w_left: u128 = order.iter().map(|&i| u128::from(weights[i].max(1))).sum();
    let mut k = 0;
    while k < order.len() {
        let i = order[k];
        let wi = u128::from(weights[i].max(1));
        // Saturates if room_i <= left * w_i / w_left.
        if u128::from(room[i]) * w_left <= left * wi {
            out[i] = room[i];
            left -= u128::from(room[i]);
            w_left -= wi;
            k += 1;
        } else {
            break;
        }
    }
    let rest = &order[k..];
    if rest.is_empty() || left == 0 {
        return out;
    }
    let mut remainders: Vec<(u128, usize)> = Vec::with_capacity(rest.len());
    let mut given: u128 = 0;
    for &i in rest {
        let wi = u128::from(weights[i].max(1));
        let share = left * wi / w_left;
        given += share;
        out[i] = u64::try_from(share).unwrap_or(u64::MAX);
        remainders.push((left * wi % w_left, i));
    }
    let mut extra = left - given;
    if extra > 0 {
        remainders.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        for &(_, i) in &remainders {
            if extra == 0 {
                break;
            }
            if out[i] < room[i] {
                out[i] += 1;
                extra -= 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn article(demand: [u64; 3], usage: [u64; 3]) -> Vec<TenantInput> {
        // Sorted by name: inference, research, training.
        let spec = [(50_000, 4_000, 8_000), (10_000, 500, 2_500), (40_000, 2_000, 6_000)];
        spec.iter()
            .zip(demand)
            .zip(usage)
            .map(|((&(w, m, mx), d), u)| TenantInput {
                weight_milli: w,
                min_share_bp: m,
                max_share_bp: mx,
                demand: d,
                usage: u,
            })
            .collect()
    }

    #[test]
    fn article_tenants_all_saturated_on_96_gpus() {
        // Everyone wants everything: guarantees 38.4 / 4.8 / 19.2, surplus 33.6 split
        // 50:10:40 = 16.8 / 3.36 / 13.44.
        let e = compute(96_000, &article([96_000; 3], [0; 3]));
        let totals: Vec<u64> = e.iter().map(|x| x.total).collect();
        assert_eq!(totals, [55_200, 8_160, 32_640]);
        assert_eq!(e[0].guarantee, 38_400);
        assert_eq!(e[2].surplus, 13_440);
        assert_eq!(totals.iter().sum::<u64>(), 96_000);
    }

    #[test]
    fn monday_morning_training_burst() {
        // Training wants 200 GPUs, inference 30, research 4. Inference and research get
        // all they ask; training stops at maxShare (60% of 96 = 57.6). 4.4 GPUs stay
        // unassigned: every tenant is at its cap, so work conservation does not apply.
        let e = compute(96_000, &article([30_000, 4_000, 200_000], [0; 3]));
        let totals: Vec<u64> = e.iter().map(|x| x.total).collect();
        assert_eq!(totals, [30_000, 4_000, 57_600]);
    }

    #[test]
    fn decay_bias_shifts_surplus_from_heavy_users() {
        // Training used 4x its weight share's worth recently: its surplus weight is cut.
        let fresh = compute(96_000, &article([96_000; 3], [0; 3]));
        let heavy = compute(96_000, &article([96_000; 3], [100, 0, 900]));
        assert!(heavy[2].total < fresh[2].total, "{heavy:?}");
        assert!(heavy[0].total > fresh[0].total);
        assert!(heavy[2].total >= heavy[2].guarantee);
        assert_eq!(heavy.iter().map(|x| x.total).sum::<u64>(), 96_000);
    }

    #[test]
    fn water_fill_exact() {
        // 10 units, rooms 2/100/100, equal weights: 2 + 4 + 4.
        assert_eq!(water_fill(10, &[2, 100, 100], &[1, 1, 1]), [2, 4, 4]);
        // Leftover unit goes to the larger remainder, then the lower index.
        assert_eq!(water_fill(10, &[100, 100, 100], &[1, 1, 1]), [4, 3, 3]);
        assert_eq!(water_fill(7, &[100, 100], &[1, 2]), [2, 5]);
    }

    #[test]
    fn burst_factor_adds_headroom() {
        assert_eq!(effective_demand(10_000, 0, 1_000), 10_000);
        assert_eq!(effective_demand(10_000, 0, 2_000), 20_000);
        assert_eq!(effective_demand(10_000, 15_000, 2_000), 25_000);
        assert_eq!(effective_demand(1, 0, 1_500), 2);
    }
}
