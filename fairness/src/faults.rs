//! Fault switches: deliberate bugs in the core and the control plane's apply path, for
//! the deterministic chaos world's tests that show its checker catches each one.
//!
//! The switches live on the thread that runs a simulation (one world per thread), so
//! seeds run in parallel do not see each other's. Only the `fault-injection` feature
//! can turn one on; no release build enables it (the test command checks the `kvota`
//! binary's features), and without it [`on`] is a constant `false`.

/// Which bugs are on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Leases carry the budgets the split wants before the break-before-make clip
    /// (increases granted before the decreases elsewhere are acknowledged).
    pub make_before_break: bool,
    /// An agent's lease never expires: it keeps enforcing its budget, not its fallback.
    pub ignore_expiry: bool,
    /// A report whose sequence number was applied before is counted again.
    pub double_apply_resent: bool,
    /// Reclaim never picks a pod admitted on borrowed GPUs as a victim.
    pub borrowed_not_evictable: bool,
    /// Borrowing ignores the lease's borrow limit (only the idle GPUs bound it).
    pub borrow_past_limit: bool,
    /// The state machine applies a log entry at or below the last one it applied (a
    /// replica replaying its log after a snapshot counts entries twice).
    pub apply_replayed_entry: bool,
}

#[cfg(feature = "fault-injection")]
thread_local! {
    static ON: std::cell::Cell<Faults> = const { std::cell::Cell::new(Faults {
        make_before_break: false,
        ignore_expiry: false,
        double_apply_resent: false,
        borrowed_not_evictable: false,
        borrow_past_limit: false,
        apply_replayed_entry: false,
    }) };
}

/// Turns these bugs on for the calling thread (all off: `Faults::default()`).
#[cfg(feature = "fault-injection")]
pub fn set(faults: Faults) {
    ON.with(|c| c.set(faults));
}

/// Whether the bug `pick` selects is on for the calling thread.
#[inline]
pub fn on(pick: impl Fn(&Faults) -> bool) -> bool {
    #[cfg(feature = "fault-injection")]
    {
        ON.with(|c| pick(&c.get()))
    }
    #[cfg(not(feature = "fault-injection"))]
    {
        let _ = pick;
        false
    }
}
