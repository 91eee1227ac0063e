//! What both agent benchmarks (`review`, `webhook`) review: the policy, the pod and an
//! agent with a lease in force, so that the two measure the same work.

use kvota_fairness::names::{ClusterName, TenantName};
use std::collections::BTreeMap;
use std::path::Path;

use kvota_fairness::lease::{Lease, TenantBudget};
use kvota_fairness::policy::Policy;
use kvota_member_agent::agent::Agent;
use serde_json::json;

const POLICY: &str = "
apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: bench}
spec:
  tenants:
  - {name: training, weight: 40, minShare: 20, maxShare: 60, namespaces: [ml, default]}
  - {name: inference, weight: 50, minShare: 40, maxShare: 80, namespaces: [serving]}
";

/// A real pod shape (an init container, two containers, one asking for a GPU) in a
/// governed namespace, sent with `dryRun: true` so that every request runs the whole
/// decision without piling up reservations.
pub fn webhook_body() -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "ml", "name": "trainer-0", "operation": "CREATE", "dryRun": true,
            "userInfo": {"username": "system:serviceaccount:kube-system:job-controller"},
            "object": {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "trainer-0", "namespace": "ml", "labels": {"job-name": "trainer"}},
                "spec": {
                    "priority": 0,
                    "initContainers": [{"name": "fetch", "image": "busybox", "resources": {"requests": {"cpu": "100m"}}}],
                    "containers": [
                        {"name": "main", "image": "trainer:1", "resources": {"limits": {"nvidia.com/gpu": "1", "memory": "32Gi"}, "requests": {"cpu": "4"}}},
                        {"name": "sidecar", "image": "logger:1", "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}
                    ]}}
        }
    }))
    .unwrap_or_default()
}

/// An agent for cluster `east` (64 GPUs) with the policy and an hour-long lease giving
/// `training` a 32-GPUe budget; its journal lives in `dir`.
pub fn agent(dir: &Path) -> Agent {
    let agent = Agent::open(
        &ClusterName::from_static("east"),
        [("nvidia.com/gpu".to_string(), 64_000)].into(),
        &dir.join("j"),
        &["127.0.0.1:9".to_string()],
    )
    .expect("agent");
    {
        let mut st = agent.state();
        st.set_policy(Policy::from_yaml(POLICY).expect("policy"));
        let budgets: BTreeMap<TenantName, TenantBudget> = [(
            TenantName::from_static("training"),
            TenantBudget {
                budget: 32_000,
                fallback: 8_000,
                entitlement: 40_000,
                borrow: 0,
                ceiling: 0,
            },
        )]
        .into();
        let now = st.now_ms();
        st.lease.on_lease(
            Lease {
                cluster: ClusterName::from_static("east"),
                epoch: 1,
                duration_ms: 3_600_000,
                margin_ms: 1_000,
                issued_at_ms: 0,
                budgets,
            },
            now,
        );
    }
    agent
}
