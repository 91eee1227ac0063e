//! # kvota chaos tests
//!
//! Deterministic simulation of a whole federation in one process, from one seed: 3 or 5
//! control-plane replicas of the real state machine behind a modelled Raft log
//! ([`raft`]), 3 to 6 member clusters each with the real agent state, admission and
//! simulated cluster ([`member`]), a seeded network ([`net`]), a nemesis that partitions,
//! crashes, delays, slows disks, drifts clocks and changes policy and demand
//! ([`world`]), and invariants checked after every step ([`invariants`]).
//!
//! A failing run prints its seed and the one command that replays it
//! ([`world::Failure`]). See `docs/testing.md` for what is real and what is modelled.

pub mod disk;
pub mod invariants;
pub mod member;
pub mod msg;
pub mod net;
pub mod raft;
/// The seeded generator (kvota_fairness::rng), under the name the harness uses.
pub mod rng {
    pub use kvota_fairness::rng::Rng;
}
pub mod world;

pub use world::{replay_command, run, Bugs, Failure, Summary, BUG_NAMES};
