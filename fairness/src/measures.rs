//! The seed article's fairness measures.
//!
//! These describe outcomes for people (dashboards, the demo's summary, the simulator's
//! tables); they never feed back into decisions, so they use `f64` where a ratio reads
//! best. Only `+ - * /` and comparisons are used (IEEE 754 makes those identical on
//! every platform); no `libm`.

use serde::{Deserialize, Serialize};

use crate::{MilliGpue, Millis};

/// Deviation within which the score is a perfect 1.0 (the article's 20 %).
pub const SCORE_THRESHOLD: f64 = 0.2;

/// The article's fairness score: 1.0 while `current` is within 20 % (relative) of
/// `target`, falling linearly to 0.0 at 40 % deviation.
///
/// A zero target scores 1.0 if the current share is also zero, else 0.0 (any use of
/// a zero entitlement is entirely unfair).
pub fn fairness_score(current_share: f64, target_share: f64) -> f64 {
    if !(current_share.is_finite() && target_share.is_finite()) {
        return 0.0;
    }
    if target_share <= 0.0 {
        return if current_share <= 0.0 { 1.0 } else { 0.0 };
    }
    let deviation = (current_share - target_share).abs() / target_share;
    if deviation <= SCORE_THRESHOLD {
        1.0
    } else {
        (1.0 - (deviation - SCORE_THRESHOLD) / SCORE_THRESHOLD).max(0.0)
    }
}

/// Score of a tenant from GPUe numbers: in-use share against entitled share.
pub fn tenant_score(inuse: MilliGpue, entitlement: MilliGpue, capacity: MilliGpue) -> f64 {
    if capacity == 0 {
        return 1.0;
    }
    let cap = capacity as f64;
    fairness_score(inuse as f64 / cap, entitlement as f64 / cap)
}

/// Drift: usage share minus entitled share (positive: over its share), in
/// parts per million of capacity. Integer, so it can go into metrics and state as is.
pub fn drift_ppm(inuse: MilliGpue, entitlement: MilliGpue, capacity: MilliGpue) -> i64 {
    if capacity == 0 {
        return 0;
    }
    let d = i128::from(inuse) - i128::from(entitlement);
    let ppm = d * 1_000_000 / i128::from(capacity);
    i64::try_from(ppm).unwrap_or(if ppm < 0 { i64::MIN } else { i64::MAX })
}

/// Accumulates share-violation time ("how often does a tenant exceed its assigned
/// share?") and starvation time (below its guarantee while it had demand) from samples.
///
/// Each sample's state is held until the next sample: call [`ShareClock::observe`] at
/// every change or on a regular tick.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShareClock {
    last: Option<(Millis, bool, bool)>,
    /// Time spent above the entitlement.
    pub violation_ms: Millis,
    /// Time spent below `min(demand, guarantee)`.
    pub starved_ms: Millis,
    /// Total observed time.
    pub observed_ms: Millis,
}

impl ShareClock {
    /// Records the state at `now_ms`. Samples must not go back in time (older ones are
    /// ignored).
    pub fn observe(
        &mut self,
        now_ms: Millis,
        inuse: MilliGpue,
        entitlement: MilliGpue,
        demand: MilliGpue,
        guarantee: MilliGpue,
    ) {
        if let Some((t, over, starved)) = self.last {
            if now_ms < t {
                return;
            }
            let dt = now_ms - t;
            self.observed_ms += dt;
            if over {
                self.violation_ms += dt;
            }
            if starved {
                self.starved_ms += dt;
            }
        }
        let over = inuse > entitlement;
        let starved = inuse < demand.min(guarantee);
        self.last = Some((now_ms, over, starved));
    }

    /// Fraction of observed time in violation (0 when nothing was observed).
    pub fn violation_fraction(&self) -> f64 {
        if self.observed_ms == 0 {
            0.0
        } else {
            self.violation_ms as f64 / self.observed_ms as f64
        }
    }
}

/// Nearest-rank percentile of `samples` (`p` in 0..=100); `None` when empty.
pub fn percentile(samples: &mut [u64], p: u32) -> Option<u64> {
    if samples.is_empty() {
        return None;
    }
    samples.sort_unstable();
    let n = samples.len();
    let rank = (usize::try_from(p.min(100)).unwrap_or(100) * n).div_ceil(100).max(1);
    samples.get(rank - 1).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn score_follows_the_article() {
        assert_eq!(fairness_score(0.5, 0.5), 1.0);
        assert_eq!(fairness_score(0.6, 0.5), 1.0); // 20 % over: still 1.0
        assert!((fairness_score(0.65, 0.5) - 0.5).abs() < 1e-12); // 30 %: halfway
        assert!(fairness_score(0.7, 0.5) < 1e-9); // 40 %: zero (up to rounding)
        assert_eq!(fairness_score(0.75, 0.5), 0.0); // beyond: clamped
        assert_eq!(fairness_score(0.2, 0.5), 0.0); // 60 % under
        assert_eq!(fairness_score(0.0, 0.0), 1.0);
        assert_eq!(fairness_score(0.1, 0.0), 0.0);
        assert_eq!(fairness_score(f64::NAN, 0.5), 0.0);
    }

    #[test]
    fn drift_and_share_clock() {
        assert_eq!(drift_ppm(30_000, 20_000, 100_000), 100_000);
        assert_eq!(drift_ppm(10_000, 20_000, 100_000), -100_000);
        let mut c = ShareClock::default();
        c.observe(0, 10, 5, 10, 0); // over
        c.observe(1_000, 2, 5, 10, 4); // starved (2 < min(10, 4))
        c.observe(3_000, 5, 5, 5, 5); // fine
        c.observe(4_000, 5, 5, 5, 5);
        assert_eq!((c.violation_ms, c.starved_ms, c.observed_ms), (1_000, 2_000, 4_000));
        assert!((c.violation_fraction() - 0.25).abs() < 1e-12);
    }

    #[test]
    fn percentiles() {
        let mut v = vec![5, 1, 4, 2, 3];
        assert_eq!(percentile(&mut v, 50), Some(3));
        assert_eq!(percentile(&mut v, 99), Some(5));
        assert_eq!(percentile(&mut v, 0), Some(1));
        assert_eq!(percentile(&mut [], 50), None);
    }
}
