//! The `FairnessPolicy` custom resource ([`crd`]) and `kvota policy sync`, the
//! controller that applies the resource to the federation through the control plane's
//! admin API and reports the verdict in the resource's status ([`run`]).
//!
//! It talks to two systems, the member cluster's API server and the control plane, and
//! keeps nothing of its own: a restarted or newly elected replica reads both again.

mod controller;
pub mod crd;

pub use controller::{run, Selector, SyncArgs};
