//! The review work alone, without HTTP or TLS: `review::parse` (outside the agent's
//! lock), `review::judge` (under it, given a parsed review), and the whole `review`
//! (parse, judge, write the answer), on the
//! webhook benchmark's pod (an init container, two containers, one GPU, dry run) and
//! on a real AdmissionRequest from the fixtures with a GPU added.
//!
//! Run: `cargo bench -p kvota-member-agent --bench review`

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use kvota_member_agent::review::Outcome;
use kvota_member_agent::review::{judge, parse, review, Endpoint};
use serde_json::{json, Value};

mod common;
use common::{agent, webhook_body};

/// A real AdmissionRequest (pretty-printed as the API server's fixtures are), one GPU
/// added to its second container, dry run.
fn fixture_body() -> Vec<u8> {
    let p = format!(
        "{}/tests/fixtures/admission/pod_within_range.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let mut req: Value = serde_json::from_str(&std::fs::read_to_string(p).expect("fixture")).expect("json");
    req["object"]["spec"]["containers"][1]["resources"]["limits"]["nvidia.com/gpu"] = json!("1");
    req["dryRun"] = json!(true);
    serde_json::to_vec_pretty(&json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}))
        .unwrap_or_default()
}

fn bench(c: &mut Criterion) {
    let tmp = tempfile::tempdir().expect("tmp");
    let agent = agent(tmp.path());
    for (name, body) in [("webhook-pod", webhook_body()), ("fixture-pod", fixture_body())] {
        let r = review(&body, Endpoint::Validate, &mut *agent.state());
        assert_eq!(
            r.outcome,
            Outcome::Allowed,
            "{name}: {}",
            String::from_utf8_lossy(&r.body)
        );
        c.bench_function(&format!("parse/{name} ({} bytes)", body.len()), |b| {
            b.iter(|| parse(std::hint::black_box(&body)))
        });
        c.bench_function(&format!("judge/{name}"), |b| {
            b.iter_batched(
                || parse(&body),
                |p| judge(p, Endpoint::Validate, &mut *agent.state()),
                BatchSize::SmallInput,
            )
        });
        c.bench_function(&format!("review/{name}"), |b| {
            b.iter(|| review(std::hint::black_box(&body), Endpoint::Validate, &mut *agent.state()))
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
