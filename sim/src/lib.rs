//! `kvota sim`: a trace-driven, discrete-event comparison of GPU fairness policies.
//!
//! A trace ([`trace`]) is replayed on one or several clusters ([`engine`]) under each of
//! five schedulers ([`sched`]); the engine measures the seed article's outcomes for every
//! tenant ([`engine::RunResult`]) and [`report`] writes them as markdown, CSV and SVG.
//!
//! kvota's own policy, `wfq-decay`, runs the real fairness core: the control plane's
//! [`kvota_fairness::federation::Federation`] state machine issues leases, each cluster
//! holds them with [`kvota_fairness::lease::AgentLease`] and admits with
//! [`kvota_fairness::admission::decide`], the same calls the server and the webhook make.
//!
//! ## Model (what is simulated, and how)
//! - A cluster is a set of nodes of `SimConfig::node_gpue` GPUe each (1000 = one GPU,
//!   fractions allowed). A pod no larger than a node must fit on one node (best fit); a
//!   larger one (distributed training) takes whole free nodes. GPU types and MIG
//!   profiles are not modelled; a fractional pod takes its share of a node's GPUe.
//! - Training jobs run for their duration; a preempted one goes back to its queue and
//!   loses the work since its last checkpoint (`SimConfig::checkpoint_ms`).
//! - Inference jobs are replicas of long-running services. A tenant's services are
//!   provisioned with the GPUe of its running inference replicas against the GPUe all of
//!   its submitted, unfinished replicas ask for; latency relative to the fully
//!   provisioned latency is [`engine::latency_factor`] (an M/M/1-style `(1-r0)/(1-r)`
//!   with the load scaled by the shortfall, capped at 20x). The SLO holds while that
//!   factor is at most `SimConfig::slo_factor`; *SLA achievement* is the fraction of
//!   time with demand that it held.
//! - Every scheduler is judged against the same fair target: kvota's fairness model
//!   ([`kvota_fairness::entitlement::compute`]) over the tenants' current demand and
//!   decayed usage. Demand is what kvota counts as demand: a waiting job larger than its
//!   tenant may ever hold in its cluster ([`engine::JobRt::beyond_policy`]) is none. *Share violation* is time above the target, *starved* time below
//!   `min(demand, guarantee)`, the *fairness score* is the article's (1 within 20 % of
//!   the target), an *unfair episode* is a stretch with the mean score below 0.8 and
//!   its length is the *recovery time*.
//! - Randomness (which cluster a job is submitted to, when there are several) comes
//!   from one seed; a run is a pure function of its inputs.

pub mod engine;
pub mod report;
pub mod sched;
pub mod synth;
pub mod trace;
pub mod waits;

use std::time::{Duration, Instant};

use kvota_fairness::policy::Policy;

pub use engine::{run, run_with_progress, Partition, Progress, RunResult, SimConfig, SimError};
pub use trace::{Job, Kind, Trace, TraceError};

/// One scheduler's result and how long it took to compute.
#[derive(Debug)]
pub struct Timed {
    /// The result.
    pub result: RunResult,
    /// Wall-clock time of the run.
    pub wall: Duration,
}

/// Runs every named scheduler over the same trace and configuration.
pub fn compare(trace: &Trace, policy: &Policy, cfg: &SimConfig, schedulers: &[String]) -> Result<Vec<Timed>, SimError> {
    compare_with_progress(trace, policy, cfg, schedulers, &mut |_, _| {})
}

/// [`compare`], calling `progress` with the index of the scheduler running and where
/// its run has got to, at every tick of trace time.
pub fn compare_with_progress(
    trace: &Trace,
    policy: &Policy,
    cfg: &SimConfig,
    schedulers: &[String],
    progress: &mut dyn FnMut(usize, Progress),
) -> Result<Vec<Timed>, SimError> {
    let mut out = Vec::new();
    for (i, name) in schedulers.iter().enumerate() {
        let Some(mut s) = sched::by_name(name, policy, cfg.tick_ms, cfg.partition.clone()) else {
            return Err(SimError::Config(format!(
                "unknown scheduler `{name}`; known: {}",
                sched::ALL.join(", ")
            )));
        };
        let t0 = Instant::now();
        let result = run_with_progress(trace, policy, cfg, s.as_mut(), &mut |p| progress(i, p))?;
        out.push(Timed {
            result,
            wall: t0.elapsed(),
        });
    }
    Ok(out)
}
