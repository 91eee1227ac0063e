//! The kvota control plane (`kvota server`): a Raft group (openraft on a log store of its own) whose state
//! machine is [`kvota_fairness::federation::Federation`].
//!
//! The adapter stays thin: a log entry carries a leader-stamped
//! [`kvota_fairness::federation::Command`]; applying it calls `Federation::apply`.
//!
//! Map: [`types`] (Raft type config), [`store`] (the log segments, snapshots and state machine),
//! [`network`] (Raft over gRPC), [`guard`] (what a peer's Raft messages and replies may make this node do), [`wire`] (the Raft port's protobuf to and from openraft's types), [`node`] (write path, forwarding, readiness),
//! [`service`] (Member and Admin gRPC), [`metrics`], [`view`] (the federation in base
//! units, shared by the metrics and the dashboard), [`http`] (health, readiness,
//! metrics, JSON, the dashboard), [`server`] (configuration and startup), [`auth`] (who may call what), [`clock`] (the federation's time: the
//! median of the voters' clocks), [`backup`] (`kvota snapshot save` and `restore`), [`saved`] (a data directory's vote and log ids checked before Raft starts, and `kvota repair-vote`). The client and its TLS set-up live in `kvota-client`,
//! which the agent and the CLI use without this crate.

pub mod auth;
pub mod backup;
pub mod browse;
pub mod clock;
pub mod entry;
pub mod feature;
pub mod guard;
pub mod http;
pub mod metrics;
pub mod network;
pub mod node;
pub mod options;
pub mod saved;
pub mod server;
pub mod service;
pub mod store;
pub mod types;
pub mod view;
pub mod watchdog;
pub mod wire;
