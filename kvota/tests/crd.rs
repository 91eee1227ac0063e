//! The FairnessPolicy CustomResourceDefinitions against the policy parser: one format.
//!
//! - `deploy/kubernetes/base/crd/fairnesspolicies.yaml` is what `kvota policy crd`
//!   generates from the Rust types (so it cannot drift from them);
//! - the schema has exactly the fields the parser knows, mapping by mapping;
//! - every policy in `deploy/policies/` is a valid resource (the article's in its own
//!   API group, unchanged), and so is what `kvota policy get` prints;
//! - what the schema refuses (an unknown field at any level, a quoted number, an
//!   unquoted fractional quantity, an unknown admission mode), the parser refuses too.
//!
//! No API server runs here. [`validate`] applies a CRD's `openAPIV3Schema` as the API
//! server does for a create with strict field validation (kubectl's default): types,
//! enums, `nullable`, `required`, `x-kubernetes-int-or-string` (an integral number is an
//! integer), and an unknown field is an error. It covers the schema keywords that
//! `kvota policy crd` emits, and fails on any other keyword rather than ignore it.

use std::collections::BTreeSet;
use std::process::Command;

use kvota_fairness::document::known_fields;
use kvota_fairness::policy::Policy;
use serde_json::{json, Value};

fn repo(path: &str) -> String {
    format!("{}/../{path}", env!("CARGO_MANIFEST_DIR"))
}

const CRD_FILE: &str = "deploy/kubernetes/base/crd/fairnesspolicies.yaml";

fn yaml_docs(text: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|d| serde::Deserialize::deserialize(d).expect("YAML document"))
        .filter(|v: &Value| !v.is_null())
        .collect()
}

/// The CRDs as committed, by group.
fn crds() -> Vec<Value> {
    yaml_docs(&std::fs::read_to_string(repo(CRD_FILE)).expect("read the CRD file"))
}

fn schema_of(group: &str) -> Value {
    let crd = crds()
        .into_iter()
        .find(|c| c["spec"]["group"] == json!(group))
        .unwrap_or_else(|| panic!("no CRD for {group}"));
    assert_eq!(crd["spec"]["scope"], "Cluster");
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
}

/// Keywords [`validate`] understands; any other in the schema fails the test.
const KEYWORDS: &[&str] = &[
    "type",
    "properties",
    "additionalProperties",
    "items",
    "required",
    "nullable",
    "enum",
    "description",
    "title",
    "format",
    "default",
    "x-kubernetes-int-or-string",
];

/// Checks `v` at `path` against `schema` as the API server would with strict field
/// validation; appends each violation.
fn validate(schema: &Value, v: &Value, path: &str, errs: &mut Vec<String>) {
    let obj = schema.as_object().expect("a schema is an object");
    for k in obj.keys() {
        assert!(
            KEYWORDS.contains(&k.as_str()),
            "schema keyword `{k}` at {path} is not understood by this test's validator"
        );
    }
    if v.is_null() {
        if schema["nullable"] != json!(true) {
            errs.push(format!("{path}: null is not allowed"));
        }
        return;
    }
    let integral = |v: &Value| v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|f| f.fract() == 0.0);
    if schema["x-kubernetes-int-or-string"] == json!(true) {
        if !(integral(v) || v.is_string()) {
            errs.push(format!("{path}: must be an integer or a string"));
        }
        return;
    }
    let ok = match schema["type"].as_str() {
        Some("string") => v.is_string(),
        Some("number") => v.is_number(),
        Some("integer") => v.is_number() && integral(v),
        Some("boolean") => v.is_boolean(),
        Some("object") => v.is_object(),
        Some("array") => v.is_array(),
        other => panic!("{path}: schema without a structural type: {other:?}"),
    };
    if !ok {
        errs.push(format!("{path}: must be of type {}", schema["type"]));
        return;
    }
    if let Some(allowed) = schema["enum"].as_array() {
        if !allowed.contains(v) {
            errs.push(format!("{path}: {v} is not one of {allowed:?}"));
        }
    }
    if let (Some(items), Some(list)) = (schema.get("items"), v.as_array()) {
        for (i, item) in list.iter().enumerate() {
            validate(items, item, &format!("{path}[{i}]"), errs);
        }
    }
    if let Some(map) = v.as_object() {
        for req in schema["required"].as_array().into_iter().flatten() {
            if !map.contains_key(req.as_str().unwrap_or("")) {
                errs.push(format!("{path}.{}: required", req.as_str().unwrap_or("")));
            }
        }
        for (k, val) in map {
            let at = format!("{path}.{k}");
            match (schema["properties"].get(k), schema.get("additionalProperties")) {
                (Some(s), _) => validate(s, val, &at, errs),
                (None, Some(s)) if s.is_object() => validate(s, val, &at, errs),
                _ => errs.push(format!("{at}: unknown field \"{k}\"")),
            }
        }
    }
}

/// A document as the API server would take it: its group's CRD, then the object's
/// fields other than apiVersion/kind/metadata (the server's own) against the schema.
fn server_accepts(doc: &Value) -> Result<(), Vec<String>> {
    let group = doc["apiVersion"]
        .as_str()
        .and_then(|a| a.split_once('/'))
        .map(|(g, _)| g.to_string())
        .unwrap_or_default();
    assert!(
        matches!(group.as_str(), "kvota.dev" | "kvitej.io"),
        "apiVersion {}",
        doc["apiVersion"]
    );
    let mut body = doc.clone();
    for k in ["apiVersion", "kind", "metadata"] {
        body.as_object_mut().expect("object").remove(k);
    }
    let mut errs = Vec::new();
    validate(&schema_of(&group), &body, "", &mut errs);
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs)
    }
}

#[test]
fn the_committed_crds_are_what_kvota_generates() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvota"))
        .args(["policy", "crd"])
        .output()
        .expect("run kvota policy crd");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let generated = String::from_utf8(out.stdout).expect("utf8");
    let committed = std::fs::read_to_string(repo(CRD_FILE)).expect("read");
    assert!(
        generated.trim_end() == committed.trim_end(),
        "{CRD_FILE} is stale: regenerate it with `kvota policy crd > {CRD_FILE}`"
    );
    let crds = crds();
    let names: Vec<&str> = crds.iter().filter_map(|c| c["metadata"]["name"].as_str()).collect();
    assert_eq!(names, ["fairnesspolicies.kvota.dev", "fairnesspolicies.kvitej.io"]);
    for c in &crds {
        let v = &c["spec"]["versions"][0];
        assert_eq!(
            v["subresources"]["status"],
            json!({}),
            "status is a subresource (the controller writes it alone)"
        );
        assert_eq!((v["served"].clone(), v["storage"].clone()), (json!(true), json!(true)));
    }
}

/// Every mapping of the schema has exactly the fields the parser knows there, and the
/// parser knows no mapping the schema lacks.
#[test]
fn the_schema_has_exactly_the_fields_the_parser_knows() {
    let schema = schema_of("kvota.dev");
    let mut seen = BTreeSet::new();
    fn walk(s: &Value, path: &str, seen: &mut BTreeSet<String>) {
        if let Some(props) = s["properties"].as_object() {
            let names: BTreeSet<&str> = props.keys().map(String::as_str).collect();
            let known: BTreeSet<&str> = known_fields(path).iter().copied().collect();
            assert_eq!(names, known, "fields at `{path}`: schema vs parser");
            seen.insert(path.to_string());
            for (k, sub) in props {
                walk(sub, &format!("{path}.{k}"), seen);
            }
        }
        if let Some(items) = s.get("items") {
            walk(items, &format!("{path}[]"), seen);
        }
    }
    walk(&schema["properties"]["spec"], "spec", &mut seen);
    for path in [
        "spec",
        "spec.lease",
        "spec.showback",
        "spec.reclaim",
        "spec.tenants[]",
        "spec.tenants[].namespaceSelector",
    ] {
        assert!(
            seen.contains(path),
            "the schema has no mapping at `{path}`, which the parser reads"
        );
    }
    // The top level: the server's fields, spec and status.
    let top: BTreeSet<&str> = schema["properties"]
        .as_object()
        .expect("props")
        .keys()
        .map(String::as_str)
        .collect();
    let parser_top: BTreeSet<&str> = known_fields("")
        .iter()
        .copied()
        .filter(|k| !matches!(*k, "apiVersion" | "kind" | "metadata"))
        .collect();
    assert_eq!(top, parser_top);
}

#[test]
fn every_shipped_policy_is_a_valid_resource_and_so_is_what_policy_get_prints() {
    let dir = repo("deploy/policies");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("deploy/policies") {
        let path = entry.expect("entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("read");
        let policy = Policy::from_yaml(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for doc in [yaml_docs(&text).remove(0), yaml_docs(&policy.to_yaml()).remove(0)] {
            if let Err(errs) = server_accepts(&doc) {
                panic!("{}: the CRD refuses it: {errs:#?}", path.display());
            }
        }
        n += 1;
    }
    assert!(n >= 3, "only {n} policies in {dir}");
    // The article's document, unchanged, is in the article's group.
    let article = yaml_docs(&std::fs::read_to_string(repo("deploy/policies/article.yaml")).expect("read")).remove(0);
    assert_eq!(article["apiVersion"], "kvitej.io/v1alpha1");
}

/// Each change below is refused by the API server (the CRD's schema) and by the parser.
#[test]
fn what_the_schema_refuses_the_parser_refuses() {
    let base = yaml_docs(&std::fs::read_to_string(repo("deploy/policies/extended.yaml")).expect("read")).remove(0);
    type Change = fn(&mut Value);
    let changes: [(&str, Change); 9] = [
        ("unknown field in spec", |d| d["spec"]["minshare"] = json!(3)),
        ("unknown field in a tenant", |d| {
            d["spec"]["tenants"][0]["minshare"] = json!(3)
        }),
        ("unknown field in lease", |d| {
            d["spec"]["lease"]["duraton"] = json!("30s")
        }),
        ("unknown field in reclaim", |d| {
            d["spec"]["reclaim"]["evictAll"] = json!(true)
        }),
        ("unknown field in a selector", |d| {
            d["spec"]["tenants"][1]["namespaceSelector"]["matchExpressions"] = json!([])
        }),
        ("unknown top-level field", |d| d["specs"] = json!({})),
        ("a quoted number", |d| d["spec"]["tenants"][0]["weight"] = json!("50")),
        ("an unquoted fractional quantity", |d| {
            d["spec"]["resourceWeights"]["nvidia.com/mig-1g.5gb"] = json!(0.15)
        }),
        ("an unknown admission mode", |d| d["spec"]["admission"] = json!("drop")),
    ];
    for (what, change) in changes {
        let mut doc = base.clone();
        change(&mut doc);
        assert!(server_accepts(&doc).is_err(), "{what}: the CRD accepts it");
        let text = serde_json::to_string(&doc).expect("json");
        assert!(Policy::from_yaml(&text).is_err(), "{what}: the parser accepts it");
    }
    // And the unchanged document passes both (the changes above are what fails).
    assert!(server_accepts(&base).is_ok());
    assert!(Policy::from_yaml(&serde_json::to_string(&base).expect("json")).is_ok());
}
