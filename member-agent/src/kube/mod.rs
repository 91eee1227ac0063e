//! The agent's Kubernetes side (kube-rs).
//!
//! - [`KubeInventory`]: Nodes, Pods and Namespaces from watchers (list, then watch; a
//!   relist after `410 Gone` or a broken stream, with backoff), turned into the
//!   [`Inventory`] every other part of the agent reads.
//! - [`KubeActions`]: what the agent does to the cluster: remove kvota's scheduling gate
//!   (the gate controller), evict through the Eviction API (PodDisruptionBudgets are
//!   honoured by the API server: a `429` is "blocked, retry later"), and record a
//!   Kubernetes Event on a pod.
//! - [`Election`]: which of several agent replicas in one cluster is the leader, through
//!   a `coordination.k8s.io/v1` Lease. Only the leader admits, reports usage, releases
//!   gates and reclaims; a standby answers reviews with a retryable denial and is not
//!   ready (so a Service sends it nothing). See `docs/operations.md`, "The agent's
//!   replicas, its kept state and its report rounds".
//!
//! Objects are read as JSON through the same code the webhook uses for pods
//! ([`crate::review::pod_resources`]), so a pod's GPUe is computed one way everywhere.
//!
//! One file per job: [`convert`] (objects to inventory records), [`watch`] (the
//! inventory's watchers), [`actions`] (gates, evictions, Events), [`election`] (the
//! leader Lease and the pods' role label), [`controller`] (one round of the leader's
//! duties), [`state_store`] (the kept state's ConfigMap).

pub mod actions;
pub mod controller;
pub mod convert;
pub mod election;
pub mod state_store;
pub mod watch;

pub use actions::KubeActions;
pub use controller::{Controller, Released};
pub use convert::{format_time, node_info, parse_time, pod_info};
pub use election::{Election, RoleMarker, ROLE_LABEL};
pub use state_store::{ConfigMapStore, STATE_KEY};
pub use watch::KubeInventory;

/// The HTTP status of an API error, if the API server answered one.
pub fn api_status(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(r) => Some(r.code),
        _ => None,
    }
}

/// `config` for the actions client: no automatic retries (see [`KubeActions::new`]).
pub fn actions_config(mut config: kube::Config) -> kube::Config {
    config.default_retry = false;
    config
}
