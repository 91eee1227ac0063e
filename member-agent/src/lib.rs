//! The kvota member agent (`kvota agent`): cluster inventory, usage journal, lease
//! enforcement, the admission webhook and reclaim.
//!
//! - [`review`]: the AdmissionReview handling the webhook serves (pure: parse, map to
//!   tenant, decide, record the effect atomically);
//! - [`state`]: the agent's admission state (lease, pods, reservations, gate queue,
//!   recent denials, usage meter, reclaim book);
//! - [`journal`]: the durable usage journal;
//! - [`agent`]: registration, policy fetch, journaled reporting and lease adoption;
//! - [`inventory`]: the inventory trait and what is shared by its sources (state sync,
//!   reclaim view, eviction records);
//! - [`kube`]: the Kubernetes side, one file per job: conversion of objects, the
//!   inventory's watchers, actions (gates, Eviction API, Events), leader election
//!   through a Lease, the controller round, the kept state's ConfigMap;
//! - [`placement`]: which nodes a pod may run on (selectors, affinity, taints);
//! - [`sim`]: a simulated cluster whose pods go through `review`;
//! - [`https`]: a small HTTPS client for the agent's port (`kvota explain pod --agent`);
//! - [`webhook`]: the HTTPS admission webhook (rustls, certificate reload, limits);
//! - [`metrics`]: the agent's Prometheus metrics;
//! - [`runtime`]: what `kvota agent` runs: the webhook, the report and policy loops, and
//!   on Kubernetes the watchers, the controller and the leader election, as tasks.

pub mod agent;
pub mod https;
pub mod inventory;
pub mod journal;
pub mod kube;
pub mod metrics;
pub mod persist;
pub mod placement;
pub mod review;
pub mod revision;
pub mod round;
pub mod runtime;
pub mod sim;
pub mod state;
pub mod webhook;
