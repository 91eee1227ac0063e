//! The invariants, one module each; every module's doc comment states its invariant.
//!
//! Checked continuously (after every 100 ms step): [`partition_safety`], [`admission`]
//! and [`lending`] (at every admission, and lent GPUs taken back in time), [`epochs`],
//! [`takeover`] (at every agent restart), and the at-most-once part of [`conservation`].
//! Checked once all faults have healed and the federation settled: [`conservation`],
//! [`liveness`], [`replicas`].

pub mod admission;
pub mod conservation;
pub mod epochs;
pub mod lending;
pub mod liveness;
pub mod partition_safety;
pub mod replicas;
pub mod takeover;

use std::fmt;

/// A broken invariant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// Which invariant (module name).
    pub invariant: &'static str,
    /// Real (simulated) time, ms.
    pub at_ms: u64,
    /// What was seen.
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invariant `{}` broken at t={} ms: {}",
            self.invariant, self.at_ms, self.detail
        )
    }
}

/// Shorthand for an `Err(Violation)`.
pub(crate) fn fail<T>(invariant: &'static str, at_ms: u64, detail: String) -> Result<T, Violation> {
    Err(Violation {
        invariant,
        at_ms,
        detail,
    })
}
