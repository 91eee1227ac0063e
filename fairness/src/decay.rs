//! Deterministic exponential decay and the decayed usage ledger.
//!
//! `U(now) = U(then) * 2^(-(now - then) / h) + used since`. The factor `2^(-x)` is
//! computed in integer fixed point (Q0.62) with a Taylor series of `e^(-x ln 2)` on the
//! fractional part of `x` and a shift for the integer part, so every node on every
//! platform gets the same bits. No floating point and no `libm` are involved.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::names::TenantName;
use crate::Millis;

/// Fixed-point scale of decay factors: `ONE` represents 1.0.
pub const FACTOR_BITS: u32 = 62;
/// 1.0 in the decay factor's fixed point.
pub const ONE: u64 = 1 << FACTOR_BITS;
/// `ln 2` in Q0.62, rounded to nearest: 0.6931471805599453 * 2^62.
const LN2_Q62: u128 = 3_196_577_161_300_663_915;

/// `2^(-elapsed/half_life)` in Q0.62 fixed point ([`ONE`] = 1.0).
///
/// Holds: the result is in `0..=ONE`; `elapsed = 0` gives exactly `ONE`;
/// `elapsed = half_life` gives `ONE / 2` exactly; it never increases with `elapsed`.
/// A zero `half_life_ms` decays everything at once (returns 0 unless `elapsed` is 0).
pub fn decay_factor_q62(elapsed_ms: Millis, half_life_ms: Millis) -> u64 {
    if elapsed_ms == 0 {
        return ONE;
    }
    if half_life_ms == 0 {
        return 0;
    }
    let whole = elapsed_ms / half_life_ms;
    if whole >= u64::from(FACTOR_BITS) {
        return 0;
    }
    let rem = elapsed_ms % half_life_ms;
    // frac = rem / half_life in Q0.62 (rem < half_life, so frac < ONE).
    let frac_q62 = ((u128::from(rem)) << FACTOR_BITS) / u128::from(half_life_ms);
    let y = (frac_q62 * LN2_Q62) >> FACTOR_BITS; // y = frac * ln2 < 0.7, Q0.62
    let base = exp_neg_q62(y);
    // `whole < 62`, so the shift is in range.
    let out = base >> whole;
    u64::try_from(out).unwrap_or(u64::MAX)
}

/// `e^(-y)` for `0 <= y < 1` in Q0.62, by the alternating Taylor series (terms shrink
/// below one unit of the last place after about 25 steps for y < 0.7).
fn exp_neg_q62(y_q62: u128) -> u128 {
    let one = u128::from(ONE);
    let mut sum: i128 = i128::try_from(one).unwrap_or(i128::MAX);
    let mut term: u128 = one; // y^k / k!, Q0.62
    let mut k: u128 = 1;
    loop {
        term = ((term * y_q62) >> FACTOR_BITS) / k;
        if term == 0 || k > 40 {
            break;
        }
        let t = i128::try_from(term).unwrap_or(0);
        if k % 2 == 1 {
            sum -= t;
        } else {
            sum += t;
        }
        k += 1;
    }
    u128::try_from(sum.clamp(0, i128::try_from(one).unwrap_or(i128::MAX))).unwrap_or(0)
}

/// `value * 2^(-elapsed/half_life)`, rounded down.
pub fn decay(value: u64, elapsed_ms: Millis, half_life_ms: Millis) -> u64 {
    let f = decay_factor_q62(elapsed_ms, half_life_ms);
    let out = (u128::from(value) * u128::from(f)) >> FACTOR_BITS;
    u64::try_from(out).unwrap_or(u64::MAX)
}

/// One tenant's decayed usage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct DecayedUsage {
    /// Decayed usage in milli-GPUe x milliseconds, as of `as_of_ms`.
    pub value_milli_gpue_ms: u64,
    /// The time `value` refers to.
    pub as_of_ms: Millis,
}

impl DecayedUsage {
    /// Decays to `now_ms` (never backwards) and adds `used`.
    fn add(&mut self, used_milli_gpue_ms: u64, now_ms: Millis, half_life_ms: Millis) {
        let now = now_ms.max(self.as_of_ms);
        let decayed = self.at(now, half_life_ms);
        *self = DecayedUsage {
            value_milli_gpue_ms: decayed.saturating_add(used_milli_gpue_ms),
            as_of_ms: now,
        };
    }

    /// The value decayed forward to `now_ms` (a `now` before `as_of` is treated as `as_of`:
    /// time in the ledger never runs backwards).
    pub fn at(&self, now_ms: Millis, half_life_ms: Millis) -> u64 {
        decay(
            self.value_milli_gpue_ms,
            now_ms.saturating_sub(self.as_of_ms),
            half_life_ms,
        )
    }
}

/// The federation's decayed GPU-usage ledger: one [`DecayedUsage`] per tenant.
///
/// Usage reported for a window is added, undecayed, at the time the report is applied
/// (the control plane's leader-stamped time): the ledger is then a pure function of the
/// sequence of `(now, tenant, amount)` it was given, on every node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Ledger {
    tenants: BTreeMap<TenantName, DecayedUsage>,
}

impl Ledger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `used_milli_gpue_ms` to `tenant` at `now_ms`, decaying what was there first.
    pub fn add(&mut self, tenant: &TenantName, used_milli_gpue_ms: u64, now_ms: Millis, half_life_ms: Millis) {
        match self.tenants.get_mut(tenant) {
            Some(entry) => entry.add(used_milli_gpue_ms, now_ms, half_life_ms),
            None => self
                .tenants
                .entry(tenant.clone())
                .or_default()
                .add(used_milli_gpue_ms, now_ms, half_life_ms),
        }
    }

    /// [`Ledger::add`] for many tenants at once: `(tenant, (used, half-life))` with the
    /// tenants in ascending name order, applied in one walk of the ledger instead of a
    /// lookup each. The result is the same as adding them one by one.
    pub fn add_ascending<'a>(&mut self, items: impl Iterator<Item = (&'a TenantName, (u64, Millis))>, now_ms: Millis) {
        let mut missing = Vec::new();
        let mut entries = self.tenants.iter_mut().peekable();
        for (tenant, (used, half_life_ms)) in items {
            while entries.next_if(|(k, _)| *k < tenant).is_some() {}
            match entries.next_if(|(k, _)| *k == tenant) {
                Some((_, entry)) => entry.add(used, now_ms, half_life_ms),
                None => missing.push((tenant, used, half_life_ms)),
            }
        }
        for (tenant, used, half_life_ms) in missing {
            self.add(tenant, used, now_ms, half_life_ms);
        }
    }

    /// Decayed usage of `tenant` at `now_ms` (0 for an unknown tenant).
    pub fn usage_at(&self, tenant: &str, now_ms: Millis, half_life_ms: Millis) -> u64 {
        self.tenants.get(tenant).map_or(0, |u| u.at(now_ms, half_life_ms))
    }

    /// The raw entries, by tenant name.
    pub fn entries(&self) -> &BTreeMap<TenantName, DecayedUsage> {
        &self.tenants
    }

    /// Forgets tenants that are no longer in the policy.
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.tenants.retain(|k, _| keep(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn as_f64(q: u64) -> f64 {
        q as f64 / ONE as f64
    }

    #[test]
    fn factor_anchors_are_exact() {
        assert_eq!(decay_factor_q62(0, 1000), ONE);
        assert_eq!(decay_factor_q62(1000, 1000), ONE / 2);
        assert_eq!(decay_factor_q62(3000, 1000), ONE / 8);
        assert_eq!(decay_factor_q62(62_000, 1000), 0);
        assert_eq!(decay_factor_q62(5, 0), 0);
    }

    #[test]
    fn a_day_of_a_24h_half_life_halves_usage() {
        let day = 24 * 3600 * 1000;
        assert_eq!(decay(1_000_000, day, day), 500_000);
        // 6 hours of a 6 h half-life, then 18 hours more: a quarter of a quarter... checks
        // that the split of time does not matter beyond rounding.
        let h6 = 6 * 3600 * 1000;
        let v = decay(decay(1 << 40, h6, h6), 3 * h6, h6);
        assert!((v as i64 - (1i64 << 36)).abs() <= 2, "{v}");
    }

    #[test]
    fn ledger_adds_and_decays() {
        let mut l = Ledger::new();
        let h = 1000;
        l.add(&TenantName::from_static("a"), 800, 0, h);
        l.add(&TenantName::from_static("a"), 100, 1000, h); // 800 halves to 400, plus 100
        assert_eq!(l.usage_at("a", 1000, h), 500);
        assert_eq!(l.usage_at("a", 2000, h), 250);
        assert_eq!(l.usage_at("missing", 2000, h), 0);
        // A command stamped earlier than the entry does not rewind time.
        l.add(&TenantName::from_static("a"), 10, 500, h);
        assert_eq!(l.entries()["a"].as_of_ms, 1000);
        assert_eq!(l.usage_at("a", 1000, h), 510);
    }

    proptest! {
        #[test]
        fn factor_matches_the_real_function(elapsed in 0u64..10_000_000, half in 1u64..5_000_000) {
            let got = as_f64(decay_factor_q62(elapsed, half));
            let want = (-(elapsed as f64) / half as f64).exp2();
            prop_assert!((got - want).abs() < 1e-12, "got {got} want {want}");
        }

        #[test]
        fn factor_is_monotone(a in 0u64..10_000_000, b in 0u64..10_000_000, half in 1u64..5_000_000) {
            let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
            prop_assert!(decay_factor_q62(lo, half) >= decay_factor_q62(hi, half));
        }

        /// Adding many tenants in one walk leaves the ledger exactly as adding them one
        /// by one does, for tenants already there and new ones, zero usage included.
        #[test]
        fn adding_in_one_walk_equals_adding_one_by_one(
            before in prop::collection::btree_map("[a-f]{1,2}", (0u64..1_000_000, 0u64..5_000), 0..12),
            adds in prop::collection::btree_map("[a-f]{1,2}", (0u64..1_000_000, 1u64..100_000), 0..12),
            now in 0u64..10_000,
        ) {
            let name = |t: &String| TenantName::parse(t.as_str()).expect("a label");
            let mut one = Ledger::default();
            for (t, (v, at)) in &before {
                one.add(&name(t), *v, *at, 1_000);
            }
            let mut walk = one.clone();
            for (t, (used, half)) in &adds {
                one.add(&name(t), *used, now, *half);
            }
            let adds: Vec<(TenantName, (u64, u64))> = adds.iter().map(|(t, x)| (name(t), *x)).collect();
            walk.add_ascending(adds.iter().map(|(t, x)| (t, *x)), now);
            prop_assert_eq!(walk, one);
        }

        #[test]
        fn decaying_in_steps_matches_one_step(v in 0u64..(1u64 << 50), a in 0u64..1_000_000, b in 0u64..1_000_000, half in 1u64..1_000_000) {
            let two = decay(decay(v, a, half), b, half);
            let one = decay(v, a + b, half);
            // Each step rounds down once: the two paths differ by a few units at most.
            let tol = 2 + (one >> 40);
            prop_assert!(two <= one + tol && one <= two + tol, "one {one} two {two}");
        }
    }
}
