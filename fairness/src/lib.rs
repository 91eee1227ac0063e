//! # kvota-fairness — the pure fairness core
//!
//! Everything that decides *how much* GPU a tenant may hold, and *why*, lives here and
//! nowhere else. The control plane's Raft state machine, the member agent's admission
//! webhook, the simulator and the chaos tests all call this crate.
//!
//! The crate does no IO, reads no clock and spawns nothing: time and state come in as
//! arguments, results come out as values. That is what makes the replicated state
//! machine bit-identical on every node and lets the simulator replay from a seed.
//! Arithmetic on quantities that reach replicated state is integer (milli-GPUe,
//! milliseconds, fixed point); no platform `libm` is called.
//!
//! Map of the crate:
//! - [`units`]: Kubernetes quantities, durations, milli-GPUe formatting.
//! - [`resources`]: resource weights (GPUe per resource name) and a pod's GPUe as
//!   Kubernetes computes its requests.
//! - [`policy`]: the `FairnessPolicy` YAML, validated with every problem reported.
//! - [`decay`]: deterministic `2^(-t/h)` and the decayed usage ledger.
//! - [`entitlement`]: the fairness model (docs/guarantees.md G1-G7).
//! - [`split`]: an entitlement split into per-cluster budgets.
//! - [`lease`]: leases, the agent-side lease rules and the control plane's lease book.
//! - [`federation`]: the control plane's state machine (commands in, leases and audit
//!   records out) built from the pieces above.
//! - [`admission`]: the pure admission decision `decide`.
//! - [`reclaim`]: which pods an agent evicts for a tenant below its guarantee.
//! - [`measures`]: fairness score, drift, share-violation time.
//! - [`explain`]: human-readable accounts of entitlements, budgets and decisions.

pub mod admission;
pub mod decay;
pub mod document;
pub mod entitlement;
pub mod explain;
pub mod faults;
pub mod federation;
pub mod lease;
pub mod measures;
pub mod names;
pub mod policy;
pub mod reclaim;
pub mod resources;
pub mod rng;
pub mod showback;
pub mod split;
pub mod stamped;
pub mod units;

/// Milli-GPU-equivalents: the accounting unit on the wire and in state.
/// `1000` is one full `nvidia.com/gpu`.
pub type MilliGpue = u64;

/// Milliseconds on whatever clock the caller supplies (the control plane's leader-stamped
/// time, or an agent's monotonic clock). The core never reads a clock itself.
pub type Millis = u64;
