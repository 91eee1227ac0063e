//! The webhook's review handling on real AdmissionRequest shapes (fixtures copied from
//! the shared data, Apache-2.0), wrapped in AdmissionReview and given GPU and MIG
//! requests; responses checked field by field.

use kvota_fairness::names::PodKey;
use kvota_fairness::names::{ClusterName, TenantName};
use std::collections::BTreeMap;

use base64::Engine as _;
use kvota_fairness::admission::LocalView;
use kvota_fairness::lease::LeaseStatus;
use kvota_fairness::policy::Policy;
use kvota_member_agent::review::Outcome;
use kvota_member_agent::review::{review, AdmissionState, Effect, Endpoint, MAX_REVIEW_BYTES};
use proptest::prelude::*;
use serde_json::{json, Value};

const POLICY: &str = "
apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: t}
spec:
  tenants:
  - {name: training, weight: 40, minShare: 20, maxShare: 60, preemptible: true, namespaces: [default]}
  - {name: research, weight: 10, admission: queue, maxQueued: 2, namespaces: [lab]}
";

struct State {
    policy: Policy,
    budget: u64,
    inuse: u64,
    queued: u32,
    effects: Vec<Effect>,
}

impl AdmissionState for State {
    fn cluster(&self) -> &str {
        "east"
    }
    fn policy(&self) -> Option<&Policy> {
        Some(&self.policy)
    }
    fn namespace_labels(&self, _: &str) -> BTreeMap<String, String> {
        BTreeMap::new()
    }
    fn view(&self, tenant: &str) -> LocalView {
        let t = self.policy.tenant(tenant);
        LocalView {
            cluster: ClusterName::from_static("east"),
            tenant: t.map(|t| t.name.clone()),
            mode: t.map(|t| t.admission).unwrap_or_default(),
            max_queued: t.map_or(0, |t| t.max_queued),
            budget: self.budget,
            inuse: self.inuse,
            queued: self.queued,
            entitlement: 40_000,
            ceiling: Some(32_000),
            lease: LeaseStatus::Fresh { remaining_ms: 20_000 },
            borrow: 0,
        }
    }
    fn record(&mut self, effect: Effect) {
        match &effect {
            Effect::Reserve { gpue, .. } => self.inuse += gpue,
            Effect::Enqueue { .. } => self.queued += 1,
            Effect::Denied { .. } => {}
        }
        self.effects.push(effect);
    }
}

fn state(budget: u64, inuse: u64) -> State {
    State {
        policy: Policy::from_yaml(POLICY).expect("policy"),
        budget,
        inuse,
        queued: 0,
        effects: Vec::new(),
    }
}

fn fixture(name: &str) -> Value {
    let p = format!("{}/tests/fixtures/admission/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&p).expect("fixture")).expect("json")
}

/// The real pod request with `gpus` of `resource` added to its second container's limits.
fn gpu_review(resource: &str, gpus: &str) -> Value {
    let mut req = fixture("pod_within_range.json");
    req["object"]["spec"]["containers"][1]["resources"]["limits"][resource] = json!(gpus);
    json!({ "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req })
}

fn run(doc: &Value, ep: Endpoint, st: &mut State) -> (Value, Outcome) {
    let r = review(&serde_json::to_vec(doc).expect("encode"), ep, st);
    let v: Value = serde_json::from_slice(&r.body).expect("response is JSON");
    assert_eq!(v["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(v["kind"], "AdmissionReview");
    (v["response"].clone(), r.outcome)
}

#[test]
fn gpu_pod_within_budget_is_allowed_and_reserved() {
    let mut st = state(4_000, 1_000);
    let (resp, outcome) = run(&gpu_review("nvidia.com/gpu", "2"), Endpoint::Validate, &mut st);
    assert_eq!(resp["uid"], "1299d386-525b-4032-98ae-1949f69f9cfc");
    assert_eq!(resp["allowed"], true);
    assert_eq!(outcome, Outcome::Allowed);
    assert_eq!(
        st.effects,
        [Effect::Reserve {
            tenant: TenantName::from_static("training"),
            pod: PodKey::from_static("default/nginx"),
            gpue: 2_000
        }]
    );
}

#[test]
fn gpu_pod_over_budget_is_denied_with_an_actionable_message() {
    let mut st = state(4_000, 3_000);
    let (resp, outcome) = run(&gpu_review("nvidia.com/gpu", "2"), Endpoint::Validate, &mut st);
    assert_eq!(resp["uid"], "1299d386-525b-4032-98ae-1949f69f9cfc");
    assert_eq!(resp["allowed"], false);
    assert_eq!(resp["status"]["code"], 403);
    let msg = resp["status"]["message"].as_str().expect("message");
    for needle in [
        "`training`",
        "5 GPUe",
        "in use 3",
        "this pod 2",
        "budget of 4",
        "entitlement 40",
        "kvota explain pod default/nginx",
    ] {
        assert!(msg.contains(needle), "{needle:?} missing: {msg}");
    }
    assert_eq!(outcome, Outcome::Denied);
    assert_eq!(
        st.effects,
        [Effect::Denied {
            tenant: TenantName::from_static("training"),
            pod: PodKey::from_static("default/nginx"),
            gpue: 2_000
        }]
    );
}

/// A pod above the most the tenant may ever hold here (ceiling 32 GPUe) is denied at
/// once and not counted as demand: it would raise the tenant's entitlement, and size its
/// budgets, for GPUs it can never use.
#[test]
fn a_pod_that_never_fits_is_denied_and_not_counted_as_demand() {
    let mut st = state(4_000, 0);
    let (resp, outcome) = run(&gpu_review("nvidia.com/gpu", "33"), Endpoint::Validate, &mut st);
    assert_eq!(resp["allowed"], false);
    assert_eq!(outcome, Outcome::Denied);
    let msg = resp["status"]["message"].as_str().expect("message");
    assert!(msg.contains("can never hold more than 32 GPUe"), "{msg}");
    assert!(st.effects.is_empty(), "{:?}", st.effects);
}

#[test]
fn mig_slices_count_by_weight() {
    let mut st = state(4_000, 0);
    let r = review(
        &serde_json::to_vec(&gpu_review("nvidia.com/mig-1g.5gb", "2")).expect("enc"),
        Endpoint::Validate,
        &mut st,
    );
    assert_eq!(r.gpue, 286);
    assert_eq!(r.outcome, Outcome::Allowed);
}

#[test]
fn pods_without_gpus_and_other_kinds_pass_untouched() {
    let mut st = state(0, 0);
    let no_res = json!({ "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": fixture("pod_without_resources.json") });
    let (resp, outcome) = run(&no_res, Endpoint::Validate, &mut st);
    assert_eq!(resp["allowed"], true);
    assert_eq!(outcome, Outcome::Passed);
    let deploy = json!({ "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": fixture("deployment_with_limits_admission_request.json") });
    let (resp, outcome) = run(&deploy, Endpoint::Validate, &mut st);
    assert_eq!(resp["allowed"], true);
    assert_eq!(outcome, Outcome::Passed);
    assert!(resp["uid"].as_str().is_some_and(|u| !u.is_empty()));
    assert!(st.effects.is_empty());
}

/// A pod whose name Kubernetes does not accept (mutating admission runs before the API
/// server validates the object, which then refuses it with its own message) makes no
/// pod key: outside governed namespaces it passes as any pod there does; a governed GPU
/// pod kvota cannot account for is refused on its tenant's endpoint, never let in
/// unjudged, and nothing is reserved or counted for it.
#[test]
fn a_pod_whose_name_kubernetes_refuses_is_never_let_in_unjudged() {
    let review_of = |namespace: &str, name: &str| {
        let mut doc = gpu_review("nvidia.com/gpu", "2");
        doc["request"]["namespace"] = json!(namespace);
        doc["request"]["name"] = json!(name);
        doc["request"]["object"]["metadata"]["namespace"] = json!(namespace);
        doc["request"]["object"]["metadata"]["name"] = json!(name);
        doc
    };
    // Ungoverned namespaces (one not even a valid name): passed, untouched.
    for (namespace, name) in [("kube-system", "Foo"), ("Default", "nginx")] {
        for ep in [Endpoint::Validate, Endpoint::Mutate] {
            let mut st = state(4_000, 0);
            let (resp, outcome) = run(&review_of(namespace, name), ep, &mut st);
            assert_eq!(
                (resp["allowed"].as_bool(), outcome),
                (Some(true), Outcome::Passed),
                "{namespace}/{name}: {resp}"
            );
            assert!(
                resp.get("patch").is_none() && st.effects.is_empty(),
                "{namespace}/{name}: nothing gated or reserved"
            );
        }
    }
    // Training's namespace, within its budget: refused on its endpoint, not judged on the other.
    let mut st = state(4_000, 0);
    let (resp, outcome) = run(&review_of("default", "Train_0"), Endpoint::Validate, &mut st);
    assert_eq!(
        (resp["allowed"].as_bool(), outcome),
        (Some(false), Outcome::Denied),
        "{resp}"
    );
    let msg = resp["status"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("default/Train_0 has a name Kubernetes does not accept") && msg.contains("NAMESPACE/NAME"),
        "{msg}"
    );
    assert!(
        st.effects.is_empty(),
        "nothing reserved or counted as demand: {:?}",
        st.effects
    );
    let (resp, outcome) = run(&review_of("default", "Train_0"), Endpoint::Mutate, &mut st);
    assert_eq!(
        (resp["allowed"].as_bool(), outcome),
        (Some(true), Outcome::Passed),
        "{resp}"
    );
    assert!(resp.get("patch").is_none() && st.effects.is_empty());
}

#[test]
fn queue_mode_gates_the_pod_with_a_json_patch() {
    let mut st = state(1_000, 1_000);
    let mut doc = gpu_review("nvidia.com/gpu", "1");
    doc["request"]["namespace"] = json!("lab");
    doc["request"]["object"]["spec"]["priority"] = json!(7);
    // The validating endpoint leaves queue-mode tenants to the mutating one.
    let (_, outcome) = run(&doc, Endpoint::Validate, &mut st);
    assert_eq!(outcome, Outcome::Passed);
    let (resp, outcome) = run(&doc, Endpoint::Mutate, &mut st);
    assert_eq!(outcome, Outcome::Queued);
    assert_eq!(resp["allowed"], true);
    assert_eq!(resp["patchType"], "JSONPatch");
    let patch = base64::engine::general_purpose::STANDARD
        .decode(resp["patch"].as_str().expect("patch"))
        .expect("b64");
    let patch: Value = serde_json::from_slice(&patch).expect("patch json");
    assert_eq!(
        patch,
        json!([{ "op": "add", "path": "/spec/schedulingGates", "value": [{ "name": "kvota.dev/admission" }] }])
    );
    assert!(matches!(
        &st.effects[..],
        [Effect::Enqueue {
            priority: 7,
            gpue: 1_000,
            ..
        }]
    ));
    // A pod that already has gates gets ours appended; the queue bound (2) holds.
    doc["request"]["object"]["spec"]["schedulingGates"] = json!([{ "name": "other" }]);
    let (resp, _) = run(&doc, Endpoint::Mutate, &mut st);
    let patch = base64::engine::general_purpose::STANDARD
        .decode(resp["patch"].as_str().expect("patch"))
        .expect("b64");
    assert_eq!(
        serde_json::from_slice::<Value>(&patch).expect("json")[0]["path"],
        "/spec/schedulingGates/-"
    );
    let (resp, outcome) = run(&doc, Endpoint::Mutate, &mut st);
    assert_eq!((resp["allowed"].clone(), outcome), (json!(false), Outcome::Denied));
    assert!(resp["status"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("maxQueued 2")));
}

#[test]
fn dry_run_decides_without_side_effects_and_a_delete_review_changes_nothing() {
    let mut st = state(4_000, 0);
    let mut doc = gpu_review("nvidia.com/gpu", "2");
    doc["request"]["dryRun"] = json!(true);
    let (resp, _) = run(&doc, Endpoint::Validate, &mut st);
    assert_eq!(resp["allowed"], true);
    assert!(st.effects.is_empty(), "dry run recorded {:?}", st.effects);
    doc["request"]["dryRun"] = json!(false);
    doc["request"]["operation"] = json!("DELETE");
    let (resp, _) = run(&doc, Endpoint::Validate, &mut st);
    assert_eq!(resp["allowed"], true);
    // Lifecycle comes from the watch only: a (possibly forged) DELETE review records nothing.
    assert!(st.effects.is_empty(), "a DELETE review recorded {:?}", st.effects);
}

#[test]
fn init_containers_count_as_kubernetes_counts_them() {
    let mut st = state(10_000, 0);
    let mut doc = gpu_review("nvidia.com/gpu", "1");
    doc["request"]["object"]["spec"]["initContainers"] =
        json!([{ "name": "warmup", "resources": { "limits": { "nvidia.com/gpu": "4" } } }]);
    let r = review(&serde_json::to_vec(&doc).expect("enc"), Endpoint::Validate, &mut st);
    assert_eq!(r.gpue, 4_000, "max(init 4, app 1)");
}

#[test]
fn malformed_requests_get_a_well_formed_error() {
    let mut st = state(4_000, 0);
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (b"{not json".to_vec(), ""),
        (b"[]".to_vec(), ""),
        (
            serde_json::to_vec(
                &json!({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {"uid": "u1"}}),
            )
            .expect("enc"),
            "u1",
        ),
        (
            serde_json::to_vec(&json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}))
                .expect("enc"),
            "",
        ),
        (vec![b' '; MAX_REVIEW_BYTES + 1], ""),
    ];
    for (body, uid) in cases {
        let r = review(&body, Endpoint::Validate, &mut st);
        let v: Value = serde_json::from_slice(&r.body).expect("JSON");
        assert_eq!(v["kind"], "AdmissionReview");
        assert_eq!(v["response"]["uid"], uid);
        assert_eq!(v["response"]["allowed"], false);
        assert_eq!(v["response"]["status"]["code"], 400);
        assert_eq!(r.outcome, Outcome::Error);
    }
    // A garbage quantity in a real pod: 400, uid echoed, nothing reserved.
    let doc = gpu_review("nvidia.com/gpu", "two");
    let (resp, outcome) = run(&doc, Endpoint::Validate, &mut st);
    assert_eq!(
        (resp["allowed"].clone(), resp["status"]["code"].clone(), outcome),
        (json!(false), json!(400), Outcome::Error)
    );
    assert_eq!(resp["uid"], "1299d386-525b-4032-98ae-1949f69f9cfc");
    assert!(st.effects.is_empty());
}

proptest! {
    /// Whatever arrives, the answer is a well-formed AdmissionReview; nothing panics.
    #[test]
    fn never_panics(body in prop::collection::vec(any::<u8>(), 0..512), mutate in any::<bool>()) {
        let mut st = state(4_000, 0);
        let r = review(&body, if mutate { Endpoint::Mutate } else { Endpoint::Validate }, &mut st);
        let v: Value = serde_json::from_slice(&r.body).expect("JSON");
        prop_assert_eq!(&v["kind"], "AdmissionReview");
        prop_assert!(v["response"]["uid"].is_string());
    }

    /// Structured mutations of a real review: any field replaced by any JSON scalar.
    #[test]
    fn never_panics_on_mutated_reviews(path in prop::sample::select(vec![
        "/request/object/spec/containers", "/request/object/spec", "/request/operation", "/request/namespace",
        "/request/object/spec/containers/1/resources", "/request/object/spec/containers/1/resources/limits",
        "/request/resource", "/request/uid", "/request/object", "/request/object/spec/priority",
    ]), value in prop_oneof![Just(json!(null)), Just(json!(1)), Just(json!("x")), Just(json!([])), Just(json!({})), Just(json!(-1e300))]) {
        let mut doc = gpu_review("nvidia.com/gpu", "1");
        if let Some(slot) = doc.pointer_mut(path) {
            *slot = value;
        }
        let mut st = state(4_000, 0);
        let r = review(&serde_json::to_vec(&doc).expect("enc"), Endpoint::Validate, &mut st);
        let v: Value = serde_json::from_slice(&r.body).expect("JSON");
        prop_assert_eq!(&v["kind"], "AdmissionReview");
    }
}
