//! The kvota member agent (`kvota agent`): cluster inventory, usage journal, lease
//! enforcement and the admission webhook.
//!
//! Built so far (issue #4 in progress):
//! - [`review`]: the AdmissionReview handling the webhook serves (pure: parse, map to
//!   tenant, decide, record the effect atomically);
//! - [`state`]: the agent's admission state (lease, pods, reservations, gate queue,
//!   recent denials, usage meter);
//! - [`journal`]: the durable usage journal;
//! - [`agent`]: registration, policy fetch, journaled reporting and lease adoption;
//! - [`sim`]: a simulated cluster whose pods go through `review`;
//! - [`netfault`]: a TCP proxy whose link can be cut (tests and the demo);
//! - [`webhook`]: the HTTPS admission webhook (rustls, certificate reload, limits);
//! - [`metrics`]: the agent's Prometheus metrics.
//!
//! Not written yet: the Kubernetes inventory (kube-rs), the gate controller against the
//! API, replica leader election.

pub mod agent;
pub mod inventory;
pub mod kube;
pub mod journal;
pub mod metrics;
pub mod netfault;
pub mod review;
pub mod sim;
pub mod state;
pub mod webhook;
