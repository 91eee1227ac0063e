//! The one seeded generator of the workspace: SplitMix64, the only source of randomness
//! of a chaos run, a simulation and the demo's script, so each replays from its seed.
//!
//! Hand-written (a dozen lines) so a seed replays bit-identically whatever version of a
//! random-number crate the workspace pins next year. No IO, no clock: it belongs to the
//! pure core as much as the arithmetic does.

/// SplitMix64 (Steele, Lea, Flood 2014): full 2^64 period, passes BigCrush, one add and
/// three multiply-xorshifts per number.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed` (every seed, 0 included, is fine).
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when `n` is 0). The modulo bias is below 2^-40 for the
    /// small ranges used here.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    /// Uniform in `lo..=hi` (`lo` when `hi < lo`).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo).saturating_add(1))
    }

    /// True with probability `pct` percent.
    pub fn chance(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }

    /// True with probability `per_mille` / 1000.
    pub fn chance_per_mille(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }

    /// An index into a collection of `len` items (0 when empty).
    pub fn index(&mut self, len: usize) -> usize {
        usize::try_from(self.below(u64::try_from(len).unwrap_or(u64::MAX))).unwrap_or(0)
    }

    /// A signed value uniform in `-bound..=bound`.
    pub fn signed(&mut self, bound: u64) -> i64 {
        let b = i64::try_from(bound).unwrap_or(i64::MAX / 2);
        let span = u64::try_from(b).unwrap_or(0).saturating_mul(2).saturating_add(1);
        i64::try_from(self.below(span)).unwrap_or(0) - b
    }

    /// A new generator for a sub-stream (so adding draws in one part of the harness does
    /// not shift every other part's numbers).
    pub fn fork(&mut self) -> Rng {
        Rng::new(self.next_u64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_ranges_hold() {
        let mut a = Rng::new(42);
        let mut b = Rng::new(42);
        for _ in 0..1000 {
            let x = a.range(3, 9);
            assert_eq!(x, b.range(3, 9));
            assert!((3..=9).contains(&x));
            let s = a.signed(5);
            assert_eq!(s, b.signed(5));
            assert!((-5..=5).contains(&s));
        }
        assert_ne!(Rng::new(1).next_u64(), Rng::new(2).next_u64());
    }
}
