//! [`KubeActions`]: what the agent does to the cluster: remove kvota's scheduling gate
//! (the gate controller), evict through the Eviction API (PodDisruptionBudgets are
//! honoured by the API server: a `429` is "blocked, retry later"), and record a
//! Kubernetes Event on a pod.

use k8s_openapi::api::core::v1::{Event as KubeEvent, Pod};
use kube::api::{Api, EvictParams, Patch, PatchParams, PostParams};
use kube::Client;
use kvota_fairness::admission::SCHEDULING_GATE;
use serde_json::{json, Value};

use super::api_status;
use super::convert::{format_time, to_json, wall_now_s};
use crate::inventory::EvictOutcome;

/// What the agent does to its cluster through the API.
#[derive(Clone)]
pub struct KubeActions {
    client: Client,
    component: String,
}

impl std::fmt::Debug for KubeActions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeActions")
            .field("component", &self.component)
            .finish()
    }
}

impl KubeActions {
    /// Actions through `client`; events are signed by `component` (e.g. `kvota-agent`).
    /// Build the client with [`actions_config`]: kube's default retry layer would retry
    /// an eviction refused with 429 by a PodDisruptionBudget for minutes, stalling
    /// reclaim; here a refusal is an answer, and the next round retries.
    pub fn new(client: Client, component: &str) -> Self {
        KubeActions {
            client,
            component: component.to_string(),
        }
    }

    /// Removes kvota's scheduling gate from pod `namespace/name`, keeping any other gate.
    /// The patch carries the pod's resourceVersion, so a concurrent change makes it fail
    /// (409) rather than drop someone else's gate; the next round retries. `Ok(false)`:
    /// the pod is gone or has no kvota gate.
    pub async fn ungate(&self, key: &str) -> Result<bool, kube::Error> {
        let Some((ns, name)) = key.split_once('/') else {
            return Ok(false);
        };
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let pod = match api.get_opt(name).await? {
            Some(p) => p,
            None => return Ok(false),
        };
        let v = to_json(&pod);
        let gates: Vec<Value> = v
            .get("spec")
            .and_then(|s| s.get("schedulingGates"))
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let rest: Vec<Value> = gates
            .iter()
            .filter(|g| g.get("name").and_then(Value::as_str) != Some(SCHEDULING_GATE))
            .cloned()
            .collect();
        if rest.len() == gates.len() {
            return Ok(false);
        }
        let rv = v
            .get("metadata")
            .and_then(|m| m.get("resourceVersion"))
            .cloned()
            .unwrap_or(Value::Null);
        let gates_value = if rest.is_empty() {
            Value::Null
        } else {
            Value::Array(rest)
        };
        let patch = json!({ "metadata": { "resourceVersion": rv }, "spec": { "schedulingGates": gates_value } });
        api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        Ok(true)
    }

    /// Evicts pod `namespace/name` through the Eviction API.
    pub async fn evict(&self, key: &str) -> Result<EvictOutcome, kube::Error> {
        let Some((ns, name)) = key.split_once('/') else {
            return Ok(EvictOutcome::NotFound);
        };
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        match api.evict(name, &EvictParams::default()).await {
            Ok(_) => Ok(EvictOutcome::Evicted),
            Err(e) => match api_status(&e) {
                Some(429) => Ok(EvictOutcome::Blocked),
                Some(404) => Ok(EvictOutcome::NotFound),
                _ => Err(e),
            },
        }
    }

    /// Records a Kubernetes Event (`Warning` for evictions, `Normal` otherwise) on pod
    /// `namespace/name`.
    pub async fn event(&self, key: &str, reason: &str, message: &str) -> Result<(), kube::Error> {
        let Some((ns, name)) = key.split_once('/') else {
            return Ok(());
        };
        self.post_event(
            ns,
            json!({ "apiVersion": "v1", "kind": "Pod", "namespace": ns, "name": name }),
            name,
            reason,
            message,
        )
        .await
    }

    /// Records a `Warning` Event on namespace `ns` (for a pod that was never created:
    /// denied at admission).
    pub async fn namespace_event(&self, ns: &str, reason: &str, message: &str) -> Result<(), kube::Error> {
        self.post_event(
            ns,
            json!({ "apiVersion": "v1", "kind": "Namespace", "name": ns }),
            ns,
            reason,
            message,
        )
        .await
    }

    async fn post_event(
        &self,
        ns: &str,
        involved: Value,
        name: &str,
        reason: &str,
        message: &str,
    ) -> Result<(), kube::Error> {
        let now = format_time(wall_now_s());
        let kind = if matches!(reason, "Evicted" | "EvictionBlocked" | "AdmissionDenied") {
            "Warning"
        } else {
            "Normal"
        };
        let ev = json!({
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": { "generateName": format!("{name}.kvota-"), "namespace": ns },
            "involvedObject": involved,
            "reason": reason,
            "message": message,
            "type": kind,
            "source": { "component": self.component },
            "reportingComponent": self.component,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        });
        let ev: KubeEvent = serde_json::from_value(ev).map_err(kube::Error::SerdeError)?;
        Api::<KubeEvent>::namespaced(self.client.clone(), ns)
            .create(&PostParams::default(), &ev)
            .await?;
        Ok(())
    }
}
