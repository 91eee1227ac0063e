//! The fast path against the reference: wherever [`read`] answers, its answer must be
//! [`read_value`]'s, byte for byte; and [`parse`] (fast path, then reference, then the
//! pod's requests counted) must always equal the reference's, counted. Checked on every real AdmissionRequest in the fixtures,
//! in every operation, then on random variations of them: fields replaced, removed or
//! given odd types, keys duplicated in the text, invalid bytes.

use proptest::prelude::*;
use proptest::strategy::ValueTree as _;
use serde_json::{json, Value};

use super::read;
use crate::review::{counted, parse, read_value, ParsedKind, PodRequests};
use kvota_fairness::names::PodKey;

const FIXTURES: [&str; 9] = [
    "deployment_with_limits_admission_request.json",
    "deployment_with_requests_no_limit_resources_admission_request.json",
    "deployment_with_requests_resources_admission_request.json",
    "deployment_without_resources_admission_request.json",
    "pod_exceeding_cpu_range.json",
    "pod_exceeding_memory_range.json",
    "pod_exceeding_range.json",
    "pod_within_range.json",
    "pod_without_resources.json",
];

/// A fixture AdmissionRequest wrapped in its AdmissionReview.
fn review(name: &str) -> Value {
    let p = format!("{}/tests/fixtures/admission/{name}", env!("CARGO_MANIFEST_DIR"));
    let req: Value = serde_json::from_str(&std::fs::read_to_string(&p).expect("fixture")).expect("fixture is JSON");
    json!({ "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req })
}

/// Whether the fast path took `body`; fails the test if it answered differently from the
/// reference, or if `parse` differs from the reference.
fn same(body: &[u8]) -> bool {
    let reference = read_value(body);
    match read(body) {
        Some(fast) => {
            // The fast path counts the pod's requests as it reads; the reference counts
            // them from the pod it read.
            assert_eq!(
                counted(fast),
                counted(read_value(body)),
                "fast path differs from the reference on {}",
                String::from_utf8_lossy(body)
            );
            assert_eq!(
                parse(body),
                counted(reference),
                "parse differs from the reference on {}",
                String::from_utf8_lossy(body)
            );
            true
        }
        None => {
            assert_eq!(
                parse(body),
                counted(reference),
                "parse differs from the reference on {}",
                String::from_utf8_lossy(body)
            );
            false
        }
    }
}

fn set(doc: &mut Value, pointer: &str, v: Value) {
    *doc.pointer_mut(pointer).expect("path") = v;
}

#[test]
fn real_requests_take_the_fast_path_with_the_same_answer() {
    for name in FIXTURES {
        let base = review(name);
        let pod = base["request"]["resource"]["resource"] == "pods";
        for op in ["CREATE", "DELETE", "UPDATE", "CONNECT"] {
            for dry in [json!(true), json!(false), json!(null)] {
                let mut doc = base.clone();
                set(&mut doc, "/request/operation", json!(op));
                doc["request"]["dryRun"] = dry;
                if pod {
                    // A GPU on the last container, and an init container asking for more.
                    let n = doc["request"]["object"]["spec"]["containers"]
                        .as_array()
                        .map_or(0, Vec::len);
                    doc["request"]["object"]["spec"]["containers"][n - 1]["resources"]["limits"]["nvidia.com/gpu"] =
                        json!("1");
                }
                let compact = serde_json::to_vec(&doc).expect("encode");
                let pretty = serde_json::to_vec_pretty(&doc).expect("encode");
                assert!(same(&compact), "{name} {op}: fast path not taken");
                assert!(same(&pretty), "{name} {op} (pretty): fast path not taken");
            }
        }
        // The file as the API server wrote it (tabs, key order), in its envelope.
        let raw = std::fs::read_to_string(format!(
            "{}/tests/fixtures/admission/{name}",
            env!("CARGO_MANIFEST_DIR")
        ))
        .expect("fixture");
        let body =
            format!("{{\"apiVersion\": \"admission.k8s.io/v1\", \"kind\": \"AdmissionReview\", \"request\": {raw}}}");
        assert!(same(body.as_bytes()), "{name} as written: fast path not taken");
    }
}

#[test]
fn pods_are_read_as_the_reference_reads_them() {
    let mut doc = review("pod_within_range.json");
    let spec = &mut doc["request"]["object"]["spec"];
    spec["initContainers"] = json!([
        { "name": "warm", "resources": { "limits": { "nvidia.com/gpu": "4" } } },
        { "name": "side", "restartPolicy": "Always", "resources": { "requests": { "nvidia.com/mig-1g.5gb": 2, "cpu": 0.5 } } },
        { "resources": null },
        {}
    ]);
    spec["overhead"] = json!({ "cpu": "250m", "nvidia.com/gpu": "1", "memory": 1e3 });
    spec["priority"] = json!(7);
    spec["schedulingGates"] = json!([{ "name": "other" }]);
    doc["request"]["name"] = json!("");
    doc["request"]["object"]["metadata"]["name"] = json!("");
    // A generated name outside Kubernetes' rule (the API server refuses such a pod
    // after admission) makes no pod key; both paths read it so.
    doc["request"]["object"]["metadata"]["generateName"] = json!("job-\u{e9}-");
    assert!(same(&serde_json::to_vec(&doc).expect("enc")));
    let ParsedKind::Create(c) = read(&serde_json::to_vec(&doc).expect("enc")).expect("fast") else {
        panic!("not a create")
    };
    assert_eq!(c.key, None);
    doc["request"]["object"]["metadata"]["generateName"] = json!("job-7-");
    assert!(same(&serde_json::to_vec(&doc).expect("enc")));
    let ParsedKind::Create(c) = read(&serde_json::to_vec(&doc).expect("enc")).expect("fast") else {
        panic!("not a create")
    };
    let PodRequests::Counted(Ok(requests)) = &c.pod else {
        panic!("not counted: {:?}", c.pod)
    };
    assert_eq!((c.priority, c.has_gates), (7, true));
    // GPUs: max(init 4, app 0 + sidecar 0) + overhead 1; MIG: the sidecar's 2;
    // memory: app 1Gi + 2Gi + overhead 1000 (a JSON number, read as "1000.0").
    let get = |r: &str| requests.iter().find(|(n, _)| n == r).map(|&(_, m)| m);
    assert_eq!(
        (get("nvidia.com/gpu"), get("nvidia.com/mig-1g.5gb")),
        (Some(5_000), Some(2_000))
    );
    assert_eq!(get("memory"), Some((3 << 30) * 1000 + 1_000_000));
    assert_eq!(
        c.key.as_ref().map(PodKey::as_str),
        Some("default/job-7-*1299d386-525b-4032-98ae-1949f69f9cfc")
    );
    // Priorities the reference reads as 0, and null fields it reads as missing.
    for p in [
        json!(1e3),
        json!(u64::MAX),
        json!(-3_000_000_000_i64),
        json!(null),
        json!(-5),
    ] {
        doc["request"]["object"]["spec"]["priority"] = p;
        doc["request"]["object"]["spec"]["schedulingGates"] = json!(null);
        doc["request"]["subResource"] = json!(null);
        doc["request"]["object"]["metadata"] = json!(null);
        assert!(same(&serde_json::to_vec(&doc).expect("enc")));
        // Without a namespace anywhere there is no pod key; both paths read it so.
        let namespace = doc["request"]["namespace"].take();
        assert!(same(&serde_json::to_vec(&doc).expect("enc")));
        doc["request"]["namespace"] = namespace;
    }
    // An empty request name falls back to the object's; a container's restart policy
    // makes it a sidecar only when it is `Always`.
    doc["request"]["object"]["metadata"] = json!({ "name": "from-object" });
    for policy in ["Always", "Never", "OnFailure", "", "always"] {
        doc["request"]["object"]["spec"]["initContainers"][0]["restartPolicy"] = json!(policy);
        doc["request"]["object"]["spec"]["containers"][0]["restartPolicy"] = json!(policy);
        assert!(same(&serde_json::to_vec(&doc).expect("enc")));
    }
    doc["request"]["object"]["spec"] = json!(null);
    assert!(same(&serde_json::to_vec(&doc).expect("enc")), "null spec: an empty pod");
}

#[test]
fn odd_bodies_go_the_reference_way() {
    let base = String::from_utf8(serde_json::to_vec(&review("pod_within_range.json")).expect("enc")).expect("utf8");
    let in_user_info = |v: &str| base.replacen("\"userInfo\":{", &format!("\"userInfo\":{{\"extra\":{v},"), 1);
    let deep = format!("{}1{}", "[".repeat(130), "]".repeat(130));
    let cases: Vec<Vec<u8>> = vec![
        // Skipped values the reference path rejects.
        in_user_info(&deep).into_bytes(),
        in_user_info("1e400").into_bytes(),
        in_user_info("\"\\ud800\"").into_bytes(),
        in_user_info("\"\\x\"").into_bytes(),
        [
            in_user_info("\"").as_bytes().split_last().map_or(&[][..], |(_, b)| b),
            b"\xff\"}",
        ]
        .concat(),
        in_user_info("\"a\u{1}b\"").into_bytes(),
        [base
            .replacen("\"userInfo\":{", "\"userInfo\":{\"\u{e9}\":1,", 1)
            .as_bytes()]
        .concat()
        .iter()
        .map(|&b| if b == 0xa9 { 0xff } else { b })
        .collect(),
        // serde_json's private token, which changes what a Value is.
        in_user_info("{\"$serde_json::private::RawValue\":\"not json\"}").into_bytes(),
        in_user_info("{\"$serde_json::private::RawValue\":\"[1]\"}").into_bytes(),
        in_user_info("{\"\\u0024serde_json::private::RawValue\":\"not json\"}").into_bytes(),
        in_user_info("{\"a\":1,\"$serde_json::private::RawValue\":\"[1]\"}").into_bytes(),
        base.replacen(
            "\"limits\":{",
            "\"limits\":{\"$serde_json::private::RawValue\":\"1\",",
            1,
        )
        .into_bytes(),
        // Duplicates: the last wins in both.
        base.replacen("\"request\":{", "\"request\":{\"uid\":7,", 1)
            .into_bytes(),
        base.replacen("\"request\":{", "\"request\":{\"operation\":\"DELETE\",", 1)
            .into_bytes(),
        base.replacen("\"limits\":{", "\"limits\":{\"cpu\":[],", 1).into_bytes(),
        base.replacen("\"limits\":{", "\"limits\":{\"nvidia.com/gpu\":\"3\",", 1)
            .into_bytes(),
        base.replacen("\"requests\":{", "\"requests\":{\"cpu\":\"3\",", 1)
            .into_bytes(),
        base.replacen("\"requests\":{", "\"requests\":{\"cpu\":\"x\",", 1)
            .into_bytes(),
        format!("{},\"request\":{{\"uid\":\"x\"}}}}", base.trim_end_matches('}')).into_bytes(),
        // Escaped keys name the same fields.
        base.replacen("\"uid\"", "\"ui\\u0064\"", 1).into_bytes(),
        base.replacen("\"operation\"", "\"op\\u0065ration\"", 1).into_bytes(),
        // Trailing bytes, other top levels, truncation.
        format!("{base} x").into_bytes(),
        format!("{base}\n\t ").into_bytes(),
        b"[]".to_vec(),
        b"null".to_vec(),
        base.as_bytes()[..base.len() / 2].to_vec(),
        Vec::new(),
    ];
    for body in cases {
        same(&body);
    }
    // The rejected ones are rejected by both; the duplicates and escapes are read by both.
    assert!(read(in_user_info(&deep).as_bytes()).is_none());
    assert!(read(in_user_info("1e400").as_bytes()).is_none());
    assert!(read(in_user_info("{\"$serde_json::private::RawValue\":\"not json\"}").as_bytes()).is_none());
    assert!(read(in_user_info("{\"\\u0024serde_json::private::RawValue\":\"not json\"}").as_bytes()).is_none());
    assert!(read(
        base.replacen("\"limits\":{", "\"limits\":{\"nvidia.com/gpu\":\"3\",", 1)
            .as_bytes()
    )
    .is_some());
    assert!(read(
        base.replacen("\"requests\":{", "\"requests\":{\"cpu\":\"3\",", 1)
            .as_bytes()
    )
    .is_some());
}

/// Keys the fast path reads, and some it does not.
const KEYS: &[&str] = &[
    "apiVersion",
    "kind",
    "request",
    "uid",
    "resource",
    "group",
    "subResource",
    "namespace",
    "name",
    "generateName",
    "operation",
    "dryRun",
    "object",
    "oldObject",
    "metadata",
    "spec",
    "priority",
    "schedulingGates",
    "initContainers",
    "containers",
    "overhead",
    "resources",
    "requests",
    "limits",
    "restartPolicy",
    "nvidia.com/gpu",
    "nvidia.com/mig-1g.5gb",
    "cpu",
    "labels",
    "other",
    "$serde_json::private::RawValue",
];

/// Strings that mean something to the fast path, and some that do not.
const STRINGS: &[&str] = &[
    "",
    "pods",
    "apps",
    "status",
    "CREATE",
    "DELETE",
    "UPDATE",
    "CONNECT",
    "create",
    "Always",
    "Never",
    "admission.k8s.io/v1",
    "AdmissionReview",
    "1",
    "500m",
    "2Gi",
    "0.5",
    "nvidia.com/gpu",
    "two",
    "x\"y\\z",
    "caf\u{e9}",
    "default",
    "lab",
];

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        (-1e6f64..1e6).prop_map(|f| json!(f)),
        prop::sample::select(STRINGS).prop_map(|s| json!(s)),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(KEYS), inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
        ]
    })
}

/// Objects of a fixture review that a mutation may touch.
const PARENTS: &[&str] = &[
    "",
    "/request",
    "/request/resource",
    "/request/object",
    "/request/object/metadata",
    "/request/object/spec",
    "/request/object/spec/containers/0",
    "/request/object/spec/containers/1",
    "/request/object/spec/containers/0/resources",
    "/request/object/spec/containers/1/resources/limits",
    "/request/object/spec/containers/0/resources/requests",
    "/request/userInfo",
];

#[derive(Clone, Debug)]
enum Edit {
    /// Sets `parent[key] = value` (when `parent` is an object).
    Set(&'static str, &'static str, Value),
    /// Removes `parent[key]`.
    Remove(&'static str, &'static str),
    /// Writes `"key":value,` right after the `n`th `{` of the text (a duplicate when the
    /// object has that key already; the original, later, wins).
    Insert(usize, &'static str, Value),
}

/// The fields the fast path reads, where they are.
const TARGETS: &[(&str, &str)] = &[
    ("", "apiVersion"),
    ("", "kind"),
    ("", "request"),
    ("/request", "uid"),
    ("/request", "resource"),
    ("/request", "subResource"),
    ("/request", "namespace"),
    ("/request", "name"),
    ("/request", "operation"),
    ("/request", "dryRun"),
    ("/request", "object"),
    ("/request/resource", "group"),
    ("/request/resource", "resource"),
    ("/request/object", "metadata"),
    ("/request/object", "spec"),
    ("/request/object/metadata", "name"),
    ("/request/object/metadata", "namespace"),
    ("/request/object/metadata", "generateName"),
    ("/request/object/spec", "priority"),
    ("/request/object/spec", "schedulingGates"),
    ("/request/object/spec", "initContainers"),
    ("/request/object/spec", "containers"),
    ("/request/object/spec", "overhead"),
    ("/request/object/spec/containers/0", "name"),
    ("/request/object/spec/containers/0", "restartPolicy"),
    ("/request/object/spec/containers/0", "resources"),
    ("/request/object/spec/containers/0/resources", "requests"),
    ("/request/object/spec/containers/1/resources", "limits"),
    ("/request/object/spec/containers/1/resources/limits", "nvidia.com/gpu"),
    ("/request/object/spec/containers/0/resources/requests", "cpu"),
];

fn edit() -> impl Strategy<Value = Edit> {
    let parent = || prop::sample::select(PARENTS);
    let key = || prop::sample::select(KEYS);
    prop_oneof![
        3 => (prop::sample::select(TARGETS), prop_oneof![2 => leaf(), 1 => value()]).prop_map(|((p, k), v)| Edit::Set(p, k, v)),
        2 => (parent(), key(), value()).prop_map(|(p, k, v)| Edit::Set(p, k, v)),
        1 => (parent(), key()).prop_map(|(p, k)| Edit::Remove(p, k)),
        2 => (0usize..40, key(), value()).prop_map(|(n, k, v)| Edit::Insert(n, k, v)),
    ]
}

fn apply(name: &str, gpu: bool, edits: &[Edit], pretty: bool) -> Vec<u8> {
    let mut doc = review(name);
    if gpu && doc["request"]["resource"]["resource"] == "pods" {
        doc["request"]["object"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = json!("2");
    }
    let mut inserts = Vec::new();
    for e in edits {
        match e {
            Edit::Set(p, k, v) => {
                if let Some(Value::Object(m)) = doc.pointer_mut(p) {
                    m.insert((*k).to_string(), v.clone());
                }
            }
            Edit::Remove(p, k) => {
                if let Some(Value::Object(m)) = doc.pointer_mut(p) {
                    m.remove(*k);
                }
            }
            Edit::Insert(n, k, v) => inserts.push((*n, *k, v.clone())),
        }
    }
    let mut text = if pretty {
        serde_json::to_string_pretty(&doc)
    } else {
        serde_json::to_string(&doc)
    }
    .expect("encode");
    for (n, k, v) in inserts {
        if let Some((at, _)) = text.match_indices('{').nth(n) {
            let entry = format!("{}:{},", json!(k), v);
            text.insert_str(at + 1, &entry);
        }
    }
    text.into_bytes()
}

/// The random edits are not vacuous: the fast path answers for a good share of them
/// (and agrees, as `same` checks), and declines for another.
#[test]
fn edited_reviews_often_take_the_fast_path() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = (
        prop::sample::select(&FIXTURES[..]),
        any::<bool>(),
        prop::collection::vec(edit(), 1..5),
    );
    let (mut fast, mut total) = (0, 0);
    for _ in 0..2000 {
        let (name, gpu, edits) = strategy.new_tree(&mut runner).expect("tree").current();
        total += 1;
        if same(&apply(name, gpu, &edits, false)) {
            fast += 1;
        }
    }
    assert!(
        fast * 4 >= total && fast * 4 <= total * 3,
        "fast path taken for {fast} of {total}"
    );
}

const RESOURCES: &[&str] = &[
    "nvidia.com/gpu",
    "nvidia.com/mig-1g.5gb",
    "amd.com/gpu",
    "cpu",
    "memory",
];

/// Quantities: mostly valid, some not, some JSON numbers, some near the limits.
fn quantity() -> impl Strategy<Value = Value> {
    prop_oneof![
        6 => prop::sample::select(&["0", "1", "2", "3", "8", "500m", "1.5", "100u", "1Ki", "2Gi", "1e3", "1E", "-0", "18446744073709551"][..]).prop_map(|q| json!(q)),
        1 => prop::sample::select(&["two", "-1", "", " 1", "1x", "99999999999999999999"][..]).prop_map(|q| json!(q)),
        1 => prop_oneof![Just(json!(1)), Just(json!(2.5)), Just(json!(1e3)), Just(json!(-1)), Just(json!(u64::MAX)), Just(json!(0.0001))],
    ]
}

fn quantities() -> impl Strategy<Value = Value> {
    prop::collection::btree_map(prop::sample::select(RESOURCES), quantity(), 0..4)
        .prop_map(|m| Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()))
}

/// A container with random requests and limits, and sometimes a restart policy.
fn container() -> impl Strategy<Value = Value> {
    (
        prop::option::of(quantities()),
        prop::option::of(quantities()),
        prop::option::of(prop::sample::select(&["Always", "Never", "OnFailure"][..])),
    )
        .prop_map(|(requests, limits, policy)| {
            let mut c = json!({ "name": "c", "image": "i" });
            let mut res = json!({});
            if let Some(r) = requests {
                res["requests"] = r;
            }
            if let Some(l) = limits {
                res["limits"] = l;
            }
            c["resources"] = res;
            if let Some(p) = policy {
                c["restartPolicy"] = json!(p);
            }
            c
        })
}

/// Random pods (app and init containers, sidecars, overhead) counted the same way.
#[test]
fn random_pods_count_the_same() {
    let strategy = (
        prop::collection::vec(container(), 0..4),
        prop::option::of(prop::collection::vec(container(), 0..4)),
        prop::option::of(quantities()),
    );
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 3000,
        ..ProptestConfig::default()
    });
    let (fast, total) = (std::cell::Cell::new(0u32), std::cell::Cell::new(0u32));
    let result = runner.run(&strategy, |(app, init, overhead)| {
        let mut doc = review("pod_within_range.json");
        doc["request"]["object"]["spec"]["containers"] = Value::Array(app);
        if let Some(init) = init {
            doc["request"]["object"]["spec"]["initContainers"] = Value::Array(init);
        }
        if let Some(o) = overhead {
            doc["request"]["object"]["spec"]["overhead"] = o;
        }
        total.set(total.get() + 1);
        if same(&serde_json::to_vec(&doc).expect("encode")) {
            fast.set(fast.get() + 1);
        }
        Ok(())
    });
    result.expect("same counts");
    let (fast, total) = (fast.get(), total.get());
    assert!(fast * 3 >= total, "fast path taken for {fast} of {total}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    /// Random edits of real reviews: the fast path, when it answers, answers as the
    /// reference does.
    #[test]
    fn edited_reviews_read_the_same(
        name in prop::sample::select(&FIXTURES[..]),
        gpu in any::<bool>(),
        edits in prop::collection::vec(edit(), 1..5),
        pretty in any::<bool>(),
    ) {
        same(&apply(name, gpu, &edits, pretty));
    }

    /// Random bytes changed in a real review (most no longer JSON, some still are).
    #[test]
    fn byte_edits_read_the_same(
        name in prop::sample::select(&FIXTURES[..]),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..4),
    ) {
        let mut body = serde_json::to_vec(&review(name)).expect("encode");
        for (at, byte, how) in edits {
            let i = at.index(body.len());
            match how {
                0 => body[i] = byte,
                1 => body.insert(i, byte),
                _ => { body.remove(i); }
            }
        }
        same(&body);
    }
}

/// Pieces of JSON text, valid and not, for the scanner's grammar checks.
const TOKENS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "\"a\"",
    "\"\\u00e9\"",
    "\"\\ud83d\\ude00\"",
    "\"\\ud83d\"",
    "\"\\udc00\"",
    "\"\\udfff\"",
    "\"\\udbff\\udfff\"",
    "\"\\ud800\\ud800\"",
    "\"\\uD83D\\uDE00\"",
    "\"\\ud83d\\u0041\"",
    "\"\\x\"",
    "\"\\/\\b\\f\\n\\r\\t\\\"\\\\\"",
    "\"\\u00G0\"",
    "\"\u{1}\"",
    "\"\u{7f}\u{e9}\"",
    "0",
    "-0",
    "01",
    "1.",
    ".5",
    "1.5",
    "-1.25",
    "1e5",
    "1E-2",
    "-",
    "+1",
    "true",
    "tru",
    "null",
    "nul",
    "false",
    " ",
    "\t",
    "\n",
    "\r",
    "\u{b}",
    "\u{a0}",
    "123456789012345678901234567890",
    "\"$serde_json::private::RawValue\"",
    "\"k:{\\\"name\\\":\\\"x\\\"}\"",
    "\"\\u0024serde_json::private::RawValue\"",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    /// Random token sequences where a review has a value kvota steps over, and as the
    /// value of a field it reads: the scanner accepts only what serde_json accepts, and
    /// reads it the same.
    #[test]
    fn random_json_text_reads_the_same(
        tokens in prop::collection::vec(prop::sample::select(TOKENS), 1..10),
        field in prop::sample::select(&["\"userInfo\":", "\"uid\":", "\"dryRun\":", "\"metadata\":", "\"priority\":", "\"schedulingGates\":", "\"limits\":", "\"x\\\"y\":"][..]),
    ) {
        let base = String::from_utf8(serde_json::to_vec(&review("pod_within_range.json")).expect("enc")).expect("utf8");
        let value: String = tokens.concat();
        for text in [
            base.replacen("\"userInfo\":{", &format!("{field}{value},\"userInfo\":{{"), 1),
            base.replacen("\"resources\":{", &format!("\"resources\":{{{field}{value},"), 1),
            base.replacen("\"spec\":{", &format!("\"spec\":{{{field}{value},"), 1),
        ] {
            same(text.as_bytes());
        }
    }
}

proptest! {
    /// The eight-bytes-at-a-time scan finds the first byte a JSON string must escape,
    /// exactly as a byte-by-byte scan does.
    #[test]
    fn plain_len_finds_the_first_special_byte(
        b in prop::collection::vec(prop_oneof![4 => 0x20u8..0x7f, 1 => Just(b'"'), 1 => Just(b'\\'), 1 => 0u8..0x20, 2 => 0x80u8..=0xff], 0..40),
    ) {
        let naive = b.iter().position(|&c| c == b'"' || c == b'\\' || c < 0x20).unwrap_or(b.len());
        prop_assert_eq!(super::plain_len(&b), naive);
    }
}
