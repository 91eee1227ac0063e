//! A simulated member cluster: nodes with GPUs, a first-fit scheduler that binds admitted
//! pods to nodes with free GPUs, and pods that run for a while and finish.
//!
//! Pods enter exactly as real ones do: as an `admission.k8s.io/v1` AdmissionReview
//! handed to [`crate::review::review`] (the same `decide`), against the agent's state.

use std::collections::BTreeMap;

use kvota_fairness::{MilliGpue, Millis};
use serde_json::json;

use crate::review::{review, Endpoint};
use crate::state::{AgentState, PodRec};

/// A pod to submit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimPod {
    /// Namespace (maps to a tenant through the policy).
    pub namespace: String,
    /// Pod name (unique in the namespace).
    pub name: String,
    /// Whole GPUs requested (`nvidia.com/gpu` limit).
    pub gpus: u32,
    /// How long it runs once bound.
    pub duration_ms: Millis,
    /// Pod priority.
    pub priority: i32,
}

#[derive(Clone, Debug)]
struct Waiting {
    pod: SimPod,
    tenant: Option<String>,
    gpue: MilliGpue,
}

#[derive(Clone, Debug)]
struct Running {
    node: usize,
    gpue: MilliGpue,
    ends_at_ms: Millis,
}

/// The simulated cluster.
#[derive(Debug, Default)]
pub struct SimCluster {
    free: Vec<MilliGpue>,
    unbound: BTreeMap<String, Waiting>,
    gated: BTreeMap<String, Waiting>,
    running: BTreeMap<String, Running>,
    uid: u64,
}

impl SimCluster {
    /// A cluster with these nodes (GPUs per node).
    pub fn new(node_gpus: &[u32]) -> Self {
        SimCluster { free: node_gpus.iter().map(|&g| u64::from(g) * 1000).collect(), ..Default::default() }
    }

    /// GPUe of all nodes.
    pub fn capacity_gpue(&self) -> MilliGpue {
        let used: u64 = self.running.values().map(|r| r.gpue).sum();
        self.free.iter().sum::<u64>() + used
    }

    /// Pods running.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Submits a pod through admission: `allowed`, `queued`, `denied`, `passed` or
    /// `error` (as the webhook judged it). Reject-mode tenants go through the validating
    /// endpoint, queue-mode ones through the mutating one, as an API server would call
    /// both.
    pub fn submit(&mut self, state: &mut AgentState, pod: &SimPod) -> &'static str {
        self.uid += 1;
        let body = json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": format!("sim-{}", self.uid),
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": pod.namespace,
                "name": pod.name,
                "operation": "CREATE",
                "object": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": pod.name, "namespace": pod.namespace},
                    "spec": {
                        "priority": pod.priority,
                        "containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": pod.gpus.to_string()}}}]
                    }
                }
            }
        });
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        let mutate = review(&bytes, Endpoint::Mutate, state);
        let verdict = if mutate.outcome == "passed" { review(&bytes, Endpoint::Validate, state) } else { mutate };
        let key = format!("{}/{}", pod.namespace, pod.name);
        let w = Waiting { pod: pod.clone(), tenant: verdict.tenant.clone(), gpue: u64::from(pod.gpus) * 1000 };
        match verdict.outcome {
            "allowed" | "passed" => {
                self.unbound.insert(key, w);
            }
            "queued" => {
                self.gated.insert(key, w);
            }
            _ => {}
        }
        verdict.outcome
    }

    /// Advances to `now_ms`: finishes pods, ungates what the agent releases, binds what
    /// fits (first fit, oldest first).
    pub fn step(&mut self, state: &mut AgentState, now_ms: Millis) {
        let done: Vec<String> = self.running.iter().filter(|(_, r)| r.ends_at_ms <= now_ms).map(|(k, _)| k.clone()).collect();
        for k in done {
            if let Some(r) = self.running.remove(&k) {
                self.free[r.node] += r.gpue;
            }
            state.pod_gone(&k);
        }
        for k in state.release_queue() {
            if let Some(w) = self.gated.remove(&k) {
                self.unbound.insert(k, w);
            }
        }
        let keys: Vec<String> = self.unbound.keys().cloned().collect();
        for k in keys {
            let Some(w) = self.unbound.get(&k) else { continue };
            if let Some(node) = self.free.iter().position(|&f| f >= w.gpue) {
                self.free[node] -= w.gpue;
                let Some(w) = self.unbound.remove(&k) else { continue };
                state.pod_bound(&k, PodRec { tenant: w.tenant.clone(), gpue: w.gpue });
                self.running.insert(k, Running { node, gpue: w.gpue, ends_at_ms: now_ms + w.pod.duration_ms });
            }
        }
    }
}
