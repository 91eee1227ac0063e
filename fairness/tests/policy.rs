//! Policy loading: the article's policy, the shipped examples, and malformed policies
//! rejected whole with every problem listed by field path.

use kvota_fairness::policy::{AdmissionMode, Policy};
use proptest::prelude::*;

fn load(path: &str) -> String {
    let p = format!("{}/../{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {p}: {e}"))
}

#[test]
fn shipped_policies_load() {
    let article = Policy::from_yaml(&load("deploy/policies/article.yaml")).expect("article");
    assert_eq!(
        article,
        Policy::from_yaml(Policy::article_example_yaml()).expect("built-in")
    );
    let ext = Policy::from_yaml(&load("deploy/policies/extended.yaml")).expect("extended");
    assert_eq!(ext.tenant("training").map(|t| t.admission), Some(AdmissionMode::Queue));
    assert_eq!(ext.default_tenant.as_deref(), Some("research"));
    assert_eq!(
        ext.reclaim,
        kvota_fairness::policy::ReclaimConfig::default(),
        "extended.yaml shows the defaults"
    );
    assert_eq!(
        ext.showback,
        kvota_fairness::policy::ShowbackConfig::default(),
        "extended.yaml shows the defaults"
    );
    assert!(article.reclaim.enabled, "reclaim is on by default");
}

#[test]
fn reclaim_settings_are_validated_with_paths() {
    let head =
        "apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: r}\nspec:\n  tenants: [{name: a}]\n";
    let p = Policy::from_yaml(&format!(
        "{head}  reclaim: {{enabled: false, starvedFor: 1m, maxEvictionsPerMinute: 0, minRuntime: 0s}}\n"
    ))
    .expect("valid");
    assert!(!p.reclaim.enabled);
    assert_eq!(
        (
            p.reclaim.starved_for_ms,
            p.reclaim.max_evictions_per_minute,
            p.reclaim.min_runtime_ms
        ),
        (60_000, 0, 0)
    );
    assert_eq!(
        p.reclaim.max_evictions_per_minute_per_tenant, 5,
        "unset keys keep their defaults"
    );
    let e = Policy::from_yaml(&format!(
        "{head}  reclaim: {{enabled: yes please, maxEvictionsPerMinute: -3, starvedFor: soon, evictAll: true}}\n"
    ))
    .expect_err("invalid");
    let paths: Vec<&str> = e.issues.iter().map(|i| i.path.as_str()).collect();
    for want in [
        "spec.reclaim.enabled",
        "spec.reclaim.maxEvictionsPerMinute",
        "spec.reclaim.starvedFor",
        "spec.reclaim.evictAll",
    ] {
        assert!(paths.contains(&want), "no issue at {want}: {e}");
    }
}

/// The issue's list: negative weight, minShare > maxShare, shares over 100 %, duplicate
/// tenant, unknown unit -- all in one document, all reported at once, with paths.
#[test]
fn every_problem_in_one_error() {
    let yaml = r#"
apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: broken}
spec:
  decayHalfLife: 3fortnights
  tenants:
  - {name: training, weight: -1, minShare: 50, maxShare: 40}
  - {name: inference, weight: 50, minShare: 60, maxShare: 80}
  - {name: inference, weight: 10, minShare: 45}
"#;
    let err = Policy::from_yaml(yaml).expect_err("broken policy must be rejected");
    let got: Vec<(&str, &str)> = err
        .issues
        .iter()
        .map(|i| (i.path.as_str(), i.message.as_str()))
        .collect();
    let expect = [
        ("spec.decayHalfLife", "unknown unit"),
        ("spec.tenants[0].weight", "greater than 0"),
        ("spec.tenants[0].minShare", "greater than maxShare"),
        ("spec.tenants[2].name", "duplicate tenant `inference`"),
        ("spec.tenants", "add up to 105%"),
    ];
    for (path, needle) in expect {
        assert!(
            got.iter().any(|(p, m)| *p == path && m.contains(needle)),
            "missing {path}: {needle}\n{err}"
        );
    }
    assert_eq!(got.len(), expect.len(), "{err}");
}

#[test]
fn bad_yaml_and_wrong_shapes() {
    for (doc, path) in [
        ("{", "line "),
        ("- just\n- a list\n", "(document)"),
        ("apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec: {tenants: [{name: a}]}\n", "apiVersion"),
        ("apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: x}\nspec: {tenants: []}\n", "spec.tenants"),
        ("apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: x}\nspec: {tenants: [{name: A_B}]}\n", "spec.tenants[0].name"),
        ("apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: x}\nspec: {tenants: [{name: a, maxShare: 101}]}\n", "spec.tenants[0].maxShare"),
        ("apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: x}\nspec: {decayHalfLife: 86400, tenants: [{name: a}]}\n", "spec.decayHalfLife"),
        ("apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: x}\nspec: {tenants: [{name: a, preemptible: maybe}]}\n", "spec.tenants[0].preemptible"),
        ("apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: x}\nspec: {resourceWeights: {gpu: 1}, tenants: [{name: a}]}\n", "spec.resourceWeights[gpu]"),
    ] {
        let err = Policy::from_yaml(doc).expect_err(doc);
        assert!(err.issues.iter().any(|i| i.path.starts_with(path)), "{doc:?}: expected a problem at {path}, got {err}");
    }
}

proptest! {
    /// Arbitrary text never panics the loader; it either loads or explains.
    #[test]
    fn never_panics_on_text(s in ".{0,400}") {
        if let Err(e) = Policy::from_yaml(&s) {
            prop_assert!(!e.issues.is_empty());
        }
    }

    /// Mutations of the article's policy: replace one value with another YAML scalar.
    #[test]
    fn never_panics_on_mutated_policies(line in 0usize..24, value in prop_oneof![
        Just("-1".to_string()), Just("1e309".to_string()), Just("~".to_string()), Just("[]".to_string()),
        Just("{a: b}".to_string()), Just("\"\"".to_string()), Just("99999999999999999999999".to_string()),
        "[a-z0-9.%-]{0,12}",
    ]) {
        let text: String = Policy::article_example_yaml()
            .lines()
            .enumerate()
            .map(|(i, l)| match (i == line, l.split_once(": ")) {
                (true, Some((k, _))) => format!("{k}: {value}\n"),
                _ => format!("{l}\n"),
            })
            .collect();
        let _ = Policy::from_yaml(&text);
    }
}

/// `Policy::to_yaml` writes a document that loads back to the same policy: the shipped
/// examples, and (below) any valid policy.
#[test]
fn a_policy_written_out_loads_back_unchanged() {
    for file in [
        "deploy/policies/article.yaml",
        "deploy/policies/extended.yaml",
        "deploy/policies/philly-vc.yaml",
    ] {
        let p = Policy::from_yaml(&load(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        let text = p.to_yaml();
        let back = Policy::from_yaml(&text).unwrap_or_else(|e| panic!("{file} written out does not load: {e}\n{text}"));
        assert_eq!(back, p, "{file}:\n{text}");
        assert_eq!(back.to_yaml(), text, "{file}: writing is stable");
    }
}

/// One tenant of a generated policy, each field as the test varies it.
#[allow(clippy::too_many_arguments)]
fn tenant_yaml(
    i: usize,
    weight_milli: u64,
    min_bp: u32,
    extra_bp: u32,
    half_life_ms: u64,
    queue: bool,
    max_queued: u32,
    burst: u32,
    label: &str,
) -> String {
    format!(
        "  - name: t{i}\n    weight: {}.{:03}\n    minShare: {}.{:02}\n    maxShare: {}.{:02}\n    preemptible: {}\n    decayHalfLife: {}ms\n    admission: {}\n    maxQueued: {max_queued}\n    burstFactor: {}.{:03}\n    namespaces: [\"ns-{i}\", \"{i}{i}\"]\n    namespaceSelector: {{matchLabels: {{\"team\": {label:?}}}}}\n",
        weight_milli / 1000,
        weight_milli % 1000,
        min_bp / 100,
        min_bp % 100,
        (min_bp + extra_bp).min(10_000) / 100,
        (min_bp + extra_bp).min(10_000) % 100,
        i % 2 == 0,
        half_life_ms,
        if queue { "queue" } else { "reject" },
        burst / 1000,
        burst % 1000,
    )
}

proptest! {
    #[test]
    fn any_valid_policy_round_trips(
        tenants in prop::collection::vec((1u64..1_000_000_000, 0u32..2_000, 0u32..10_000, 1u64..10_000_000_000, any::<bool>(), 0u32..100_000, 1_000u32..10_000, "[ -~]{0,12}"), 1..5),
        lease_s in 1u64..600,
        margin_pct in 0u64..50,
        reclaim in (any::<bool>(), 0u64..10_000_000, 0u32..1_000, 0u32..1_000, 0u64..10_000_000),
        weight in prop::option::of(1u64..1_000_000),
        name in "[a-z0-9][a-z0-9 ._\"'\\\\-]{0,20}",
    ) {
        let mut doc = format!("apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {{name: {name:?}}}\nspec:\n  defaultTenant: t0\n");
        let lease_ms = lease_s * 1000;
        doc.push_str(&format!("  lease: {{duration: {lease_ms}ms, clockSkewMargin: {}ms}}\n", lease_ms * margin_pct / 100));
        doc.push_str(&format!(
            "  reclaim: {{enabled: {}, starvedFor: {}ms, maxEvictionsPerMinute: {}, maxEvictionsPerMinutePerTenant: {}, minRuntime: {}ms}}\n",
            reclaim.0, reclaim.1, reclaim.2, reclaim.3, reclaim.4
        ));
        if let Some(w) = weight {
            doc.push_str(&format!("  resourceWeights: {{\"example.com/mig-1g\": \"{w}m\"}}\n"));
        }
        doc.push_str("  tenants:\n");
        for (i, (w, min, extra, hl, queue, mq, burst, label)) in tenants.iter().enumerate() {
            doc.push_str(&tenant_yaml(i, *w, *min, *extra, *hl, *queue, *mq, *burst, label));
        }
        let p = match Policy::from_yaml(&doc) {
            Ok(p) => p,
            Err(e) => panic!("the generator wrote an invalid policy: {e}\n{doc}"),
        };
        let text = p.to_yaml();
        let back = Policy::from_yaml(&text).map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        prop_assert_eq!(back, p);
    }
}

/// The file format and the `FairnessPolicy` resource's schema are one: numbers are
/// unquoted (`type: number`), resource weights are Kubernetes quantities (an integer or
/// a string), and what a resource carries besides (labels, a status written by the sync
/// controller) is allowed.
#[test]
fn types_follow_the_resource_schema() {
    let head = "apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: r}\nspec:\n";
    for (spec, path, needle) in [
        (
            "  tenants: [{name: a, weight: \"40\"}]\n",
            "spec.tenants[0].weight",
            "without quotes",
        ),
        (
            "  tenants: [{name: a, minShare: \"20\"}]\n",
            "spec.tenants[0].minShare",
            "without quotes",
        ),
        (
            "  burstFactor: \"2\"\n  tenants: [{name: a}]\n",
            "spec.burstFactor",
            "without quotes",
        ),
        (
            "  resourceWeights: {example.com/mig: 0.15}\n  tenants: [{name: a}]\n",
            "spec.resourceWeights[example.com/mig]",
            "quantity string",
        ),
        (
            "  maxQueued: 1.5\n  tenants: [{name: a}]\n",
            "spec.maxQueued",
            "whole number",
        ),
        (
            "  tenants: [{name: a, namespaces: [ok, 7]}]\n",
            "spec.tenants[0].namespaces[1]",
            "expected a string",
        ),
        (
            "  tenants: [{name: a, namespaceSelector: {matchLabels: {team: x}, matchExpressions: []}}]\n",
            "spec.tenants[0].namespaceSelector.matchExpressions",
            "unknown field",
        ),
        (
            "  tenants: [{name: a}]\n  lease: {duraton: 30s}\n",
            "spec.lease.duraton",
            "did you mean `duration`",
        ),
        (
            "  tenants: [{name: a, weight: 99999999999999999999999}]\n",
            "spec.tenants[0].weight",
            "number out of range",
        ),
        (
            "  tenants: [{name: a, weight: 1e400}]\n",
            "spec.tenants[0].weight",
            "too large",
        ),
    ] {
        let err = Policy::from_yaml(&format!("{head}{spec}")).expect_err(spec);
        assert!(
            err.issues.iter().any(|i| i.path == path && i.message.contains(needle)),
            "{spec:?}: expected `{needle}` at {path}, got {err}"
        );
    }
    // Quantities as strings or whole numbers; integral floats are whole numbers.
    let p = Policy::from_yaml(&format!(
        "{head}  burstFactor: 2.0\n  resourceWeights: {{example.com/a: \"0.15\", example.com/b: 2, example.com/c: 150m}}\n  tenants: [{{name: a, weight: 0.5}}]\n"
    ))
    .expect("valid");
    assert_eq!(p.tenants[0].weight_milli, 500);
    assert_eq!(p.tenants[0].burst_factor_milli, 2_000);
    // What `kubectl get fairnesspolicy -o yaml` prints loads as the policy it holds.
    let from_cluster = "apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata:\n  name: r\n  generation: 3\n  labels: {team: platform}\n  resourceVersion: \"812\"\nspec:\n  tenants: [{name: a}]\nstatus:\n  observedGeneration: 3\n  conditions: [{type: Accepted, status: \"True\"}]\n";
    let q = Policy::from_yaml(from_cluster).expect("a resource as the cluster returns it");
    assert_eq!(
        q,
        Policy::from_yaml(&format!("{head}  tenants: [{{name: a}}]\n")).expect("valid")
    );
    // Still refused: anything else at the top.
    let err = Policy::from_yaml(&format!("{head}  tenants: [{{name: a}}]\nstats: {{}}\n")).expect_err("unknown");
    assert!(
        err.issues
            .iter()
            .any(|i| i.path == "stats" && i.message.contains("did you mean `status`")),
        "{err}"
    );
}

/// minShare above maxShare does not hide the tenant's other problems.
#[test]
fn a_share_conflict_does_not_hide_the_rest_of_the_tenant() {
    let err = Policy::from_yaml("apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: r}\nspec:\n  tenants: [{name: a, minShare: 50, maxShare: 10, preemptible: maybe, maxQueued: -1}]\n")
        .expect_err("invalid");
    let paths: Vec<&str> = err.issues.iter().map(|i| i.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "spec.tenants[0].minShare",
            "spec.tenants[0].preemptible",
            "spec.tenants[0].maxQueued"
        ],
        "{err}"
    );
}

/// A shape mistake (a mapping where a list belongs) is reported with its path and line.
#[test]
fn shape_mistakes_name_their_path() {
    let err = Policy::from_yaml(
        "apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: r}\nspec:\n  tenants: {name: a}\n",
    )
    .expect_err("shape");
    assert_eq!(err.issues.len(), 1, "{err}");
    assert_eq!(err.issues[0].path, "spec.tenants");
    assert!(
        err.issues[0].message.contains("expected a list, found a mapping") && err.issues[0].message.contains("line 5"),
        "{err}"
    );
}
