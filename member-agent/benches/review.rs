//! The review work alone, without HTTP or TLS: `review::parse` (outside the agent's
//! lock), `review::judge` (under it, given a parsed review), and the whole `review`
//! (parse, judge, write the answer), on the
//! webhook benchmark's pod (an init container, two containers, one GPU, dry run) and
//! on a real AdmissionRequest from the fixtures with a GPU added.
//!
//! Run: `cargo bench -p kvota-member-agent --bench review`

use std::collections::BTreeMap;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use kvota_fairness::lease::{Lease, TenantBudget};
use kvota_fairness::policy::Policy;
use kvota_member_agent::agent::Agent;
use kvota_member_agent::review::{judge, parse, review, Endpoint};
use serde_json::{json, Value};

const POLICY: &str = "
apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: bench}
spec:
  tenants:
  - {name: training, weight: 40, minShare: 20, maxShare: 60, namespaces: [ml, default]}
  - {name: inference, weight: 50, minShare: 40, maxShare: 80, namespaces: [serving]}
";

/// The body `benches/webhook.rs` sends.
fn webhook_body() -> Vec<u8> {
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

/// A real AdmissionRequest (pretty-printed as the API server's fixtures are), one GPU
/// added to its second container, dry run.
fn fixture_body() -> Vec<u8> {
    let p = format!("{}/tests/fixtures/admission/pod_within_range.json", env!("CARGO_MANIFEST_DIR"));
    let mut req: Value = serde_json::from_str(&std::fs::read_to_string(p).expect("fixture")).expect("json");
    req["object"]["spec"]["containers"][1]["resources"]["limits"]["nvidia.com/gpu"] = json!("1");
    req["dryRun"] = json!(true);
    serde_json::to_vec_pretty(&json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}))
        .unwrap_or_default()
}

fn agent(dir: &std::path::Path) -> Agent {
    let agent = Agent::open("east", [("nvidia.com/gpu".to_string(), 64_000)].into(), &dir.join("j"), &["127.0.0.1:9".to_string()])
        .expect("agent");
    {
        let mut st = agent.state();
        st.set_policy(Policy::from_yaml(POLICY).expect("policy"));
        let budgets: BTreeMap<String, TenantBudget> =
            [("training".to_string(), TenantBudget { budget: 32_000, fallback: 8_000, entitlement: 40_000 })].into();
        let now = st.now_ms();
        st.lease.on_lease(Lease { cluster: "east".into(), epoch: 1, duration_ms: 3_600_000, margin_ms: 1_000, issued_at_ms: 0, budgets }, now);
    }
    agent
}

fn bench(c: &mut Criterion) {
    let tmp = tempfile::tempdir().expect("tmp");
    let agent = agent(tmp.path());
    for (name, body) in [("webhook-pod", webhook_body()), ("fixture-pod", fixture_body())] {
        let r = review(&body, Endpoint::Validate, &mut *agent.state());
        assert_eq!(r.outcome, "allowed", "{name}: {}", String::from_utf8_lossy(&r.body));
        c.bench_function(&format!("parse/{name} ({} bytes)", body.len()), |b| b.iter(|| parse(std::hint::black_box(&body))));
        c.bench_function(&format!("judge/{name}"), |b| {
            b.iter_batched(|| parse(&body), |p| judge(p, Endpoint::Validate, &mut *agent.state()), BatchSize::SmallInput)
        });
        c.bench_function(&format!("review/{name}"), |b| {
            b.iter(|| review(std::hint::black_box(&body), Endpoint::Validate, &mut *agent.state()))
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
