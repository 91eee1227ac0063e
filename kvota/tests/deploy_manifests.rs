//! The Kubernetes install in `deploy/kubernetes/` against the code it deploys, so it
//! cannot rot unnoticed. The install is kustomize overlays (`overlays/control-plane`,
//! `bootstrap`, `agent`, `observability`, `dev`); every check runs on what `kubectl
//! kustomize` renders from them, i.e. what `kubectl apply -k` would create: once on the
//! production overlays together (with the webhook configurations as
//! `make-webhook-cert` renders them), once on `overlays/dev` (certificates from its
//! `make-dev-certs`). No API server runs here; kubectl renders offline. Checked:
//!
//! - every rendered object validates strictly (unknown fields fail) against the
//!   Kubernetes schemas of [`KUBERNETES_VERSIONS`] (`kubernetes-validate`); custom
//!   resources, which have no schema there, are in one allow-list
//!   ([`CUSTOM_RESOURCES`]) and checked against the schema stated in this file;
//! - every object parses into its typed k8s-openapi object (chosen by `kind`) and
//!   serializes back to the same document, so a misspelt or misplaced field fails too;
//! - every argument of every kvota container is accepted by the real binary's parser,
//!   every required option is given, and every environment variable is one the binary
//!   reads or one its arguments expand; the image is named once (`components/image`);
//! - RBAC grants exactly the API calls the agent makes ([`AGENT_CALLS`], each with the
//!   code that makes it): each call is allowed, nothing else is;
//! - the webhook configurations call the agent's Service, on the port it listens on,
//!   for pod CREATE only, and select neither kube-system nor the agent's namespace;
//! - the control plane's node ids, peer names and bootstrap members agree;
//! - every pod meets the `restricted` Pod Security Standard (non-root, read-only root,
//!   no capabilities, no privilege escalation, RuntimeDefault seccomp); every port a
//!   container listens on is declared and covered by a NetworkPolicy; the agent and the
//!   control plane have PodDisruptionBudgets; the PrometheusRule holds
//!   `deploy/prometheus/alerts.yaml` and the dashboard ConfigMap the Grafana JSON;
//! - `make-webhook-cert` makes a Secret the agent mounts and a CA bundle that verifies
//!   the certificate the real agent serves, under the name the API server calls; the
//!   webhook and probe paths of the manifests answer on the real agent and server;
//!   renewing the certificate and rotating its CA never leave a moment where the served
//!   certificate fails the caBundle the API server holds.
//!
//! Needs `kubectl` (kustomize 5) and `kubernetes-validate` (scripts/test installs the
//! latter with pip); without them the tests fail saying what to install.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, RuleWithOperations, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::batch::v1::{CronJob, Job};
use k8s_openapi::api::core::v1::SecretKeySelector;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, PersistentVolumeClaim, PodSpec, Secret, Service, ServiceAccount,
};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, Subject};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// The caBundle placeholder of `agent/webhooks/webhooks.yaml`; `make-webhook-cert`
/// replaces the same string.
const CA_PLACEHOLDER: &str = "@CA_BUNDLE-FILLED-IN-BY-make-webhook-cert@";

/// The namespace label that opts a namespace into enforcement (docs/operations and
/// agent/webhooks/webhooks.yaml).
const ENFORCE_LABEL: &str = "kvota.dev/enforce";
/// What the test puts in its place before parsing: base64, as the script writes.
const CA_SAMPLE_BASE64: &str = "LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCg==";
/// The API server's addresses (`overlays/agent/values.yaml`), set by the operator.
const APISERVER_CIDR_PLACEHOLDER: &str = "@APISERVER_CIDR@";
const APISERVER_CIDR_SAMPLE: &str = "10.0.0.10/32";

/// The overlays under `deploy/kubernetes/overlays`, each what `kubectl apply -k` creates.
const OVERLAYS: &[&str] = &["control-plane", "bootstrap", "agent", "observability", "dev"];
/// The webhook configurations' template, a kustomization of its own: `make-webhook-cert`
/// renders it with caBundle filled in, `overlays/dev` includes it.
const WEBHOOK_TEMPLATE: &str = "base/agent/webhooks";

/// The Kubernetes versions whose schemas every rendered object must meet, strictly
/// (deploy/README.md: 1.30 or later; kubectl here is 1.32).
const KUBERNETES_VERSIONS: &[&str] = &["1.30.0", "1.32.0"];
/// What scripts/test installs; it ships the schemas of 1.25 to 1.37 (offline).
const KUBERNETES_VALIDATE: &str = "kubernetes-validate==1.37.0";

/// Custom resources, which `kubernetes-validate` has no schema for: (apiVersion, kind,
/// how it is checked instead). Every other object must validate against the Kubernetes
/// schemas; an object of a kind neither knows fails. A new custom resource (e.g. a
/// FairnessPolicy) needs a line here and an arm in [`check_typed`] with its schema.
const CUSTOM_RESOURCES: &[(&str, &str, &str)] = &[
    (
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        "check_typed: struct ServiceMonitor (the Prometheus Operator CRD's fields kvota uses; any other refused)",
    ),
    (
        "monitoring.coreos.com/v1",
        "PrometheusRule",
        "check_typed: struct PrometheusRule, and its groups equal deploy/prometheus/alerts.yaml",
    ),
];

/// Where the agent's API calls apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scope {
    /// Objects in any namespace, or cluster-scoped ones.
    Cluster,
    /// The leader Lease: in the agent's Lease namespace, by the `--leader-lease` name
    /// (except `create`, which names no object).
    LeaderLease,
    /// The state ConfigMap: in the same namespace, by the `--state-configmap` name
    /// (except `create`).
    StateConfigMap,
}

/// Every Kubernetes API call `kvota agent` makes: (API group, resource, verb, scope,
/// the code that makes it). RBAC must allow each and nothing more; a new call in the
/// code belongs here and in `deploy/kubernetes/base/agent/10-rbac.yaml`.
const AGENT_CALLS: &[(&str, &str, &str, Scope, &str)] = &[
    (
        "",
        "pods",
        "list",
        Scope::Cluster,
        "member-agent/src/kube.rs KubeInventory::run: watcher(Api::<Pod>::all)",
    ),
    (
        "",
        "pods",
        "watch",
        Scope::Cluster,
        "member-agent/src/kube.rs KubeInventory::run: watcher(Api::<Pod>::all)",
    ),
    (
        "",
        "nodes",
        "list",
        Scope::Cluster,
        "member-agent/src/kube.rs KubeInventory::run: watcher(Api::<Node>::all)",
    ),
    (
        "",
        "nodes",
        "watch",
        Scope::Cluster,
        "member-agent/src/kube.rs KubeInventory::run: watcher(Api::<Node>::all)",
    ),
    (
        "",
        "namespaces",
        "list",
        Scope::Cluster,
        "member-agent/src/kube.rs KubeInventory::run: watcher(Api::<Namespace>::all)",
    ),
    (
        "",
        "namespaces",
        "watch",
        Scope::Cluster,
        "member-agent/src/kube.rs KubeInventory::run: watcher(Api::<Namespace>::all)",
    ),
    (
        "",
        "pods",
        "get",
        Scope::Cluster,
        "member-agent/src/kube.rs KubeActions::ungate: api.get_opt",
    ),
    (
        "",
        "pods",
        "patch",
        Scope::Cluster,
        "member-agent/src/kube.rs KubeActions::ungate: Patch::Merge of schedulingGates",
    ),
    (
        "",
        "pods/eviction",
        "create",
        Scope::Cluster,
        "member-agent/src/kube.rs KubeActions::evict: api.evict",
    ),
    (
        "",
        "events",
        "create",
        Scope::Cluster,
        "member-agent/src/kube.rs KubeActions::event: Api::<core::v1::Event>::create",
    ),
    (
        "coordination.k8s.io",
        "leases",
        "get",
        Scope::LeaderLease,
        "member-agent/src/kube.rs Election::step, Election::release: get_opt",
    ),
    (
        "coordination.k8s.io",
        "leases",
        "create",
        Scope::LeaderLease,
        "member-agent/src/kube.rs Election::step: create when missing",
    ),
    (
        "coordination.k8s.io",
        "leases",
        "update",
        Scope::LeaderLease,
        "member-agent/src/kube.rs Election::step, Election::release: replace",
    ),
    (
        "",
        "configmaps",
        "get",
        Scope::StateConfigMap,
        "member-agent/src/kube.rs ConfigMapStore::load, save: get_opt, get after a 409",
    ),
    (
        "",
        "configmaps",
        "create",
        Scope::StateConfigMap,
        "member-agent/src/kube.rs ConfigMapStore::save: create when missing",
    ),
    (
        "",
        "configmaps",
        "update",
        Scope::StateConfigMap,
        "member-agent/src/kube.rs ConfigMapStore::save: replace with the resourceVersion",
    ),
];

/// Objects the install consists of; removing one fails the test.
const EXPECTED: &[(&str, &str)] = &[
    ("Namespace", "kvota-system"),
    ("ServiceAccount", "kvota-agent"),
    ("ClusterRole", "kvota-agent"),
    ("ClusterRoleBinding", "kvota-agent"),
    ("Role", "kvota-agent-leader"),
    ("RoleBinding", "kvota-agent-leader"),
    ("ConfigMap", "kvota-agent"),
    ("Deployment", "kvota-agent"),
    ("Service", "kvota-agent"),
    ("MutatingWebhookConfiguration", "kvota-agent"),
    ("ValidatingWebhookConfiguration", "kvota-agent"),
    ("Service", "kvota-server-peers"),
    ("Service", "kvota-server"),
    ("StatefulSet", "kvota-server"),
    ("PodDisruptionBudget", "kvota-server"),
    ("PodDisruptionBudget", "kvota-agent"),
    ("Job", "kvota-bootstrap"),
    ("NetworkPolicy", "kvota-server-raft"),
    ("NetworkPolicy", "kvota-server-grpc"),
    ("NetworkPolicy", "kvota-server-http"),
    ("NetworkPolicy", "kvota-agent-webhook"),
    ("NetworkPolicy", "kvota-server-metrics"),
    ("NetworkPolicy", "kvota-agent-metrics"),
    ("Service", "kvota-agent-metrics"),
    ("ServiceMonitor", "kvota-server"),
    ("ServiceMonitor", "kvota-agent"),
    ("PrometheusRule", "kvota"),
    ("ConfigMap", "kvota-grafana-dashboard"),
];

/// Kinds without a namespace; every other object must name its namespace, or it lands
/// in whatever namespace kubectl's context has.
const CLUSTER_SCOPED: &[&str] = &[
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    "CustomResourceDefinition",
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn deploy_dir() -> PathBuf {
    repo().join("deploy/kubernetes")
}

fn kvota() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvota"))
}

/// One YAML document of one manifest file.
#[derive(Debug)]
struct Doc {
    file: String,
    value: Value,
}

impl Doc {
    fn str_at(&self, pointer: &str) -> &str {
        self.value.pointer(pointer).and_then(Value::as_str).unwrap_or("")
    }
    fn kind(&self) -> &str {
        self.str_at("/kind")
    }
    fn name(&self) -> &str {
        self.str_at("/metadata/name")
    }
    fn namespace(&self) -> &str {
        self.str_at("/metadata/namespace")
    }
    fn typed<T: DeserializeOwned>(&self) -> T {
        serde_json::from_value(self.value.clone())
            .unwrap_or_else(|e| panic!("{}: {} {} does not parse: {e}", self.file, self.kind(), self.name()))
    }
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            yaml_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            out.push(p);
        }
    }
}

/// The documents of one YAML text, the placeholders replaced as `make-webhook-cert`
/// and the operator (`overlays/agent/values.yaml`) replace them.
fn parse_docs(file: &str, text: &str) -> Vec<Doc> {
    let text = text
        .replace(CA_PLACEHOLDER, CA_SAMPLE_BASE64)
        .replace(APISERVER_CIDR_PLACEHOLDER, APISERVER_CIDR_SAMPLE);
    let mut docs = Vec::new();
    for d in serde_yaml_ng::Deserializer::from_str(&text) {
        let mut value = Value::deserialize(d).unwrap_or_else(|e| panic!("{file}: not YAML: {e}"));
        if !value.is_null() {
            unwrap_base64(&mut value);
            docs.push(Doc {
                file: file.to_string(),
                value,
            });
        }
    }
    docs
}

/// kustomize writes generated base64 (a Secret's data, what replacements copy from it)
/// in lines of 76; the API server's decoder skips the line breaks, k8s-openapi's does
/// not: join them as the API server reads them.
fn unwrap_base64(value: &mut Value) {
    let join = |v: &mut Value| {
        if let Some(text) = v.as_str() {
            *v = Value::String(text.split_whitespace().collect());
        }
    };
    if value["kind"] == "Secret" {
        if let Some(data) = value.get_mut("data").and_then(Value::as_object_mut) {
            data.values_mut().for_each(join);
        }
    }
    if let Some(hooks) = value.get_mut("webhooks").and_then(Value::as_array_mut) {
        for h in hooks {
            if let Some(ca) = h.pointer_mut("/clientConfig/caBundle") {
                join(ca);
            }
        }
    }
}

/// Every document of every YAML file under `dir` (what `make-webhook-cert` writes).
fn documents_under(dir: &Path) -> Vec<Doc> {
    let mut files = Vec::new();
    yaml_files(dir, &mut files);
    let mut docs = Vec::new();
    for path in files {
        let file = path.strip_prefix(repo()).unwrap_or(&path).display().to_string();
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {file}: {e}"));
        docs.extend(parse_docs(&file, &text));
    }
    docs
}

const NEED_KUBECTL: &str = "the deploy tests render deploy/kubernetes/overlays with `kubectl kustomize`: \
     install kubectl 1.27 or later (kustomize 5), e.g. from the Kubernetes apt repository; CI has it";

/// `kubectl kustomize DIR`: what `kubectl apply -k DIR` would create.
fn kustomize(dir: &Path) -> String {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .unwrap_or_else(|e| panic!("run kubectl: {e}; {NEED_KUBECTL}"));
    assert!(
        out.status.success(),
        "kubectl kustomize {} failed: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("kustomize writes UTF-8")
}

/// Every overlay (and the webhook template) rendered, once per test binary: its path
/// under deploy/kubernetes and its YAML. `overlays/dev` is rendered from a copy of
/// deploy/ with the certificates its `make-dev-certs` makes (with the real kvota and
/// make-webhook-cert).
fn rendered() -> &'static BTreeMap<String, String> {
    static RENDERED: OnceLock<BTreeMap<String, String>> = OnceLock::new();
    RENDERED.get_or_init(|| {
        let mut out = BTreeMap::new();
        for o in OVERLAYS.iter().filter(|o| **o != "dev") {
            out.insert(
                format!("overlays/{o}"),
                kustomize(&deploy_dir().join("overlays").join(o)),
            );
        }
        out.insert(
            WEBHOOK_TEMPLATE.to_string(),
            kustomize(&deploy_dir().join(WEBHOOK_TEMPLATE)),
        );
        let tmp = tempfile::tempdir().expect("tmp");
        let copy = tmp.path().join("deploy");
        let cp = Command::new("cp")
            .arg("-r")
            .arg(repo().join("deploy"))
            .arg(&copy)
            .status()
            .expect("run cp");
        assert!(cp.success(), "copy deploy/");
        let dev = copy.join("kubernetes/overlays/dev");
        let certs = Command::new("bash")
            .arg(dev.join("make-dev-certs"))
            .arg("--force")
            .env("KVOTA", env!("CARGO_BIN_EXE_kvota"))
            .output()
            .expect("run make-dev-certs");
        assert!(
            certs.status.success(),
            "overlays/dev/make-dev-certs failed: {}",
            String::from_utf8_lossy(&certs.stderr)
        );
        out.insert("overlays/dev".to_string(), kustomize(&dev));
        out
    })
}

/// The installs the checks run on: (what, its objects).
fn installs() -> Vec<(String, Vec<Doc>)> {
    let r = rendered();
    // The production overlays, as applied to clusters; the namespace comes from two.
    let mut production: Vec<Doc> = Vec::new();
    for name in [
        "overlays/control-plane",
        "overlays/bootstrap",
        "overlays/agent",
        "overlays/observability",
        WEBHOOK_TEMPLATE,
    ] {
        for d in parse_docs(name, &r[name]) {
            match production
                .iter()
                .find(|p| p.kind() == d.kind() && p.name() == d.name() && p.namespace() == d.namespace())
            {
                Some(p) => assert_eq!(
                    p.value,
                    d.value,
                    "{} and {} render {} {} differently",
                    p.file,
                    d.file,
                    d.kind(),
                    d.name()
                ),
                None => production.push(d),
            }
        }
    }
    vec![
        (
            "the production overlays with make-webhook-cert's webhooks".to_string(),
            production,
        ),
        (
            "overlays/dev".to_string(),
            parse_docs("overlays/dev", &r["overlays/dev"]),
        ),
    ]
}

/// The production install (every overlay but dev, and the webhooks).
fn manifests() -> Vec<Doc> {
    installs().swap_remove(0).1
}

fn find<'a>(docs: &'a [Doc], kind: &str, name: &str) -> &'a Doc {
    docs.iter()
        .find(|d| d.kind() == kind && d.name() == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in the rendered overlays"))
}

fn all_of<'a, T: DeserializeOwned>(docs: &'a [Doc], kind: &str) -> Vec<(T, &'a Doc)> {
    docs.iter()
        .filter(|d| d.kind() == kind)
        .map(|d| (d.typed::<T>(), d))
        .collect()
}

/// The first path where `written` is not kept in `typed` (`written` parsed as its
/// typed object and serialized again): a field dropped or a value changed. Fields only
/// in `typed` are not differences: k8s-openapi writes `apiVersion` and `kind` into
/// embedded objects (a StatefulSet's volumeClaimTemplates) that need not say them.
fn difference(written: &Value, typed: &Value, path: &str) -> Option<String> {
    match (written, typed) {
        (Value::Object(x), Value::Object(y)) => x.iter().find_map(|(k, u)| {
            let p = format!("{path}.{k}");
            match y.get(k) {
                Some(v) => difference(u, v, &p),
                None => Some(p),
            }
        }),
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (u, v))| difference(u, v, &format!("{path}[{i}]"))),
        _ => (written != typed).then(|| path.to_string()),
    }
}

fn round_trip<T: DeserializeOwned + Serialize>(doc: &Doc) -> Result<(), String> {
    let typed: T = serde_json::from_value(doc.value.clone()).map_err(|e| format!("does not parse: {e}"))?;
    let back = serde_json::to_value(&typed).map_err(|e| format!("does not serialize: {e}"))?;
    match difference(&doc.value, &back, "") {
        None => Ok(()),
        Some(path) => Err(format!(
            "`{path}` is not kept by k8s-openapi's {}: a misspelt or misplaced field, or a value of the wrong type",
            doc.kind()
        )),
    }
}

/// Parses a document as the typed object of its kind and back.
fn check_typed(doc: &Doc) -> Result<(), String> {
    match doc.kind() {
        "Namespace" => round_trip::<Namespace>(doc),
        "ServiceAccount" => round_trip::<ServiceAccount>(doc),
        "ClusterRole" => round_trip::<ClusterRole>(doc),
        "ClusterRoleBinding" => round_trip::<ClusterRoleBinding>(doc),
        "Role" => round_trip::<Role>(doc),
        "RoleBinding" => round_trip::<RoleBinding>(doc),
        "ConfigMap" => round_trip::<ConfigMap>(doc),
        "Secret" => round_trip::<Secret>(doc),
        "Service" => round_trip::<Service>(doc),
        "Deployment" => round_trip::<Deployment>(doc),
        "StatefulSet" => round_trip::<StatefulSet>(doc),
        "Job" => round_trip::<Job>(doc),
        "CronJob" => round_trip::<CronJob>(doc),
        "PersistentVolumeClaim" => round_trip::<PersistentVolumeClaim>(doc),
        "PodDisruptionBudget" => round_trip::<PodDisruptionBudget>(doc),
        "NetworkPolicy" => round_trip::<NetworkPolicy>(doc),
        "MutatingWebhookConfiguration" => round_trip::<MutatingWebhookConfiguration>(doc),
        "ValidatingWebhookConfiguration" => round_trip::<ValidatingWebhookConfiguration>(doc),
        "CustomResourceDefinition" => round_trip::<CustomResourceDefinition>(doc),
        "ServiceMonitor" => custom::<ServiceMonitor>(doc),
        "PrometheusRule" => custom::<PrometheusRule>(doc),
        other => Err(format!(
            "kind `{other}` is not one this test knows: add it to check_typed"
        )),
    }
}

/// A custom resource: its apiVersion is the allow-listed one, and it parses into the
/// schema stated below (unknown fields refused) and back.
fn custom<T: DeserializeOwned + Serialize>(doc: &Doc) -> Result<(), String> {
    let api_version = doc.str_at("/apiVersion");
    if !CUSTOM_RESOURCES
        .iter()
        .any(|(v, k, _)| *v == api_version && *k == doc.kind())
    {
        return Err(format!("{api_version} {} is not in CUSTOM_RESOURCES", doc.kind()));
    }
    round_trip::<T>(doc)
}

// The schemas of the custom resources in CUSTOM_RESOURCES: the fields of the Prometheus
// Operator's CRDs (monitoring.coreos.com/v1) that kvota's manifests use, spelled as
// there; any other field fails (deny_unknown_fields, and the round trip below them).

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ServiceMonitor {
    api_version: String,
    kind: String,
    metadata: ObjectMeta,
    spec: ServiceMonitorSpec,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ServiceMonitorSpec {
    selector: LabelSelector,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    namespace_selector: Option<MonitorNamespaceSelector>,
    endpoints: Vec<MonitorEndpoint>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct MonitorNamespaceSelector {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    any: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    match_names: Option<Vec<String>>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct MonitorEndpoint {
    /// The name of a Service port.
    port: String,
    scheme: MonitorScheme,
    path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    interval: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    scrape_timeout: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tls_config: Option<MonitorTls>,
}

#[derive(Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "lowercase")]
enum MonitorScheme {
    Http,
    Https,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct MonitorTls {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    server_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ca: Option<MonitorSecretOrConfigMap>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cert: Option<MonitorSecretOrConfigMap>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    key_secret: Option<SecretKeySelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    insecure_skip_verify: Option<bool>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct MonitorSecretOrConfigMap {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    secret: Option<SecretKeySelector>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PrometheusRule {
    api_version: String,
    kind: String,
    metadata: ObjectMeta,
    spec: PrometheusRuleSpec,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PrometheusRuleSpec {
    groups: Vec<RuleGroup>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleGroup {
    name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    interval: Option<String>,
    rules: Vec<PromRule>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PromRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    alert: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    record: Option<String>,
    expr: String,
    #[serde(default, rename = "for", skip_serializing_if = "Option::is_none")]
    for_: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    annotations: Option<BTreeMap<String, String>>,
}

#[test]
fn every_manifest_is_a_well_typed_kubernetes_object() {
    for (install, docs) in installs() {
        eprintln!("checking {install}");
        every_manifest_is_a_well_typed_kubernetes_object_in(docs);
    }
}

fn every_manifest_is_a_well_typed_kubernetes_object_in(docs: Vec<Doc>) {
    let mut problems = Vec::new();
    for d in &docs {
        if let Err(e) = check_typed(d) {
            problems.push(format!("{}: {} {}: {e}", d.file, d.kind(), d.name()));
        }
        if d.name().is_empty() {
            problems.push(format!("{}: a {} without metadata.name", d.file, d.kind()));
        }
        let namespaced = !CLUSTER_SCOPED.contains(&d.kind());
        if namespaced
            && !docs
                .iter()
                .any(|n| n.kind() == "Namespace" && n.name() == d.namespace())
        {
            problems.push(format!(
                "{}: {} {} is in namespace `{}`, which no manifest creates (an empty one means kubectl's default)",
                d.file,
                d.kind(),
                d.name(),
                d.namespace()
            ));
        }
        if !namespaced && !d.namespace().is_empty() {
            problems.push(format!(
                "{}: {} {} is cluster-scoped but names a namespace",
                d.file,
                d.kind(),
                d.name()
            ));
        }
    }
    for (kind, name) in EXPECTED {
        if !docs.iter().any(|d| d.kind() == *kind && d.name() == *name) {
            problems.push(format!("no {kind} {name} in the rendered overlays"));
        }
    }
    assert!(
        problems.is_empty(),
        "{} problems in deploy/kubernetes:\n  {}",
        problems.len(),
        problems.join("\n  ")
    );
}

#[test]
fn a_misspelt_or_mistyped_field_is_caught() {
    // The checker itself: k8s-openapi ignores unknown fields, the round trip does not.
    let doc = |v: Value| Doc {
        file: "test".into(),
        value: v,
    };
    let good = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": "n"},
        "spec": {"ports": [{"port": 443, "targetPort": "webhook"}]}});
    assert_eq!(check_typed(&doc(good)), Ok(()));
    let misspelt = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"},
        "spec": {"ports": [{"port": 443, "tragetPort": "webhook"}]}});
    assert!(check_typed(&doc(misspelt)).is_err_and(|e| e.contains("tragetPort")));
    let mistyped =
        json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}, "spec": {"ports": [{"port": "443"}]}});
    assert!(check_typed(&doc(mistyped)).is_err());
    // The v1 field is `sideEffects`; `sideEffectClass` (the Go type's name) would be
    // dropped by the typed parse and refused by the API server as missing.
    let hook = |field: &str| {
        json!({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": "w"}, "webhooks": [{"name": "w.kvota.dev", "admissionReviewVersions": ["v1"],
            "clientConfig": {"service": {"name": "s", "namespace": "n"}}, field: "NoneOnDryRun"}]})
    };
    assert_eq!(check_typed(&doc(hook("sideEffects"))), Ok(()));
    assert!(check_typed(&doc(hook("sideEffectClass"))).is_err_and(|e| e.contains("sideEffectClass")));
    let wrong_group = json!({"apiVersion": "apps/v1beta1", "kind": "Deployment", "metadata": {"name": "d"}});
    assert!(check_typed(&doc(wrong_group)).is_err());
}

/// A workload's pod as the test resolves it: sample values for what Kubernetes fills in.
struct Pod<'a> {
    doc: &'a Doc,
    spec: PodSpec,
    labels: BTreeMap<String, String>,
    /// A name Kubernetes could give the pod, for `metadata.name` references.
    name: String,
    /// The StatefulSet pod index, for the `apps.kubernetes.io/pod-index` label.
    index: Option<i32>,
}

fn pods(docs: &[Doc]) -> Vec<Pod<'_>> {
    let mut out = Vec::new();
    for (d, doc) in all_of::<Deployment>(docs, "Deployment") {
        let t = d.spec.expect("Deployment spec").template;
        let labels = t.metadata.and_then(|m| m.labels).unwrap_or_default();
        let name = format!("{}-5c9b8d7f6d-x2x7q", doc.name());
        out.push(Pod {
            doc,
            spec: t.spec.expect("pod spec"),
            labels,
            name,
            index: None,
        });
    }
    for (s, doc) in all_of::<StatefulSet>(docs, "StatefulSet") {
        let spec = s.spec.expect("StatefulSet spec");
        let start = spec.ordinals.and_then(|o| o.start).unwrap_or(0);
        let labels = spec.template.metadata.and_then(|m| m.labels).unwrap_or_default();
        let name = format!("{}-{start}", doc.name());
        out.push(Pod {
            doc,
            spec: spec.template.spec.expect("pod spec"),
            labels,
            name,
            index: Some(start),
        });
    }
    for (c, doc) in all_of::<CronJob>(docs, "CronJob") {
        let t = c
            .spec
            .expect("CronJob spec")
            .job_template
            .spec
            .expect("job template spec")
            .template;
        let labels = t.metadata.and_then(|m| m.labels).unwrap_or_default();
        let name = format!("{}-29436017-7xk2p", doc.name());
        out.push(Pod {
            doc,
            spec: t.spec.expect("pod spec"),
            labels,
            name,
            index: None,
        });
    }
    for (j, doc) in all_of::<Job>(docs, "Job") {
        let t = j.spec.expect("Job spec").template;
        let labels = t.metadata.and_then(|m| m.labels).unwrap_or_default();
        let name = format!("{}-7xk2p", doc.name());
        out.push(Pod {
            doc,
            spec: t.spec.expect("pod spec"),
            labels,
            name,
            index: None,
        });
    }
    out
}

fn is_kvota(c: &Container) -> bool {
    let image = c.image.as_deref().unwrap_or("");
    let repo = image.rsplit('/').next().unwrap_or(image);
    repo == "kvota" || repo.starts_with("kvota:") || repo.starts_with("kvota@")
}

/// The container's environment as the kubelet would set it (envFrom ConfigMaps from the
/// manifests, downward API fields with the pod's sample values).
fn container_env(docs: &[Doc], pod: &Pod<'_>, c: &Container) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for from in c.env_from.iter().flatten() {
        let cm = from.config_map_ref.as_ref().expect("envFrom: only ConfigMaps are used");
        let cm: ConfigMap = find(docs, "ConfigMap", &cm.name).typed();
        let prefix = from.prefix.clone().unwrap_or_default();
        for (k, v) in cm.data.unwrap_or_default() {
            env.insert(format!("{prefix}{k}"), v);
        }
    }
    for e in c.env.iter().flatten() {
        let value = match (&e.value, &e.value_from) {
            (Some(v), _) => v.clone(),
            (None, Some(from)) => {
                let field = from
                    .field_ref
                    .as_ref()
                    .map(|f| f.field_path.as_str())
                    .unwrap_or_else(|| {
                        panic!(
                            "{}: env {}: only values and fieldRefs are understood here",
                            pod.doc.file, e.name
                        )
                    });
                match field {
                    "metadata.name" => pod.name.clone(),
                    "metadata.namespace" => pod.doc.namespace().to_string(),
                    "metadata.labels['apps.kubernetes.io/pod-index']" => pod
                        .index
                        .unwrap_or_else(|| {
                            panic!(
                                "{}: env {}: only StatefulSet pods have a pod-index label",
                                pod.doc.file, e.name
                            )
                        })
                        .to_string(),
                    other => panic!(
                        "{}: env {}: fieldRef {other} is not one this test knows",
                        pod.doc.file, e.name
                    ),
                }
            }
            (None, None) => String::new(),
        };
        env.insert(e.name.clone(), value);
    }
    env
}

/// `$(NAME)` references expanded as the kubelet does; a reference to a variable the
/// container does not define is an error here (Kubernetes would pass it on verbatim).
fn expand(file: &str, arg: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = arg;
    while let Some(i) = rest.find("$(") {
        out.push_str(&rest[..i]);
        let end = rest[i..]
            .find(')')
            .map(|e| i + e)
            .unwrap_or_else(|| panic!("{file}: unclosed $( in `{arg}`"));
        let name = &rest[i + 2..end];
        let value = env
            .get(name)
            .unwrap_or_else(|| panic!("{file}: `{arg}` uses $({name}), which the container does not define"));
        out.push_str(value);
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

/// A kvota container: its pod, its arguments (expanded), environment and subcommand.
struct KvotaContainer<'a> {
    pod: &'a Pod<'a>,
    container: Container,
    raw_args: Vec<String>,
    args: Vec<String>,
    env: BTreeMap<String, String>,
}

impl KvotaContainer<'_> {
    fn subcommand(&self) -> Vec<String> {
        self.args.iter().take_while(|a| !a.starts_with('-')).cloned().collect()
    }
    /// The value of `--flag=V` or `--flag V` in the arguments.
    fn flag(&self, flag: &str) -> Option<String> {
        let mut it = self.args.iter();
        while let Some(a) = it.next() {
            if let Some(v) = a.strip_prefix(&format!("{flag}=")) {
                return Some(v.to_string());
            }
            if a == flag {
                return it.next().cloned();
            }
        }
        None
    }
}

fn kvota_containers<'a>(docs: &[Doc], pods: &'a [Pod<'a>]) -> Vec<KvotaContainer<'a>> {
    let mut out = Vec::new();
    for pod in pods {
        let ours: Vec<&Container> = pod.spec.containers.iter().filter(|c| is_kvota(c)).collect();
        assert!(
            !ours.is_empty(),
            "{}: {} runs no kvota container",
            pod.doc.file,
            pod.doc.name()
        );
        for c in ours {
            assert!(
                c.command.is_none(),
                "{}: the image's entrypoint is kvota; give `args`, not `command`",
                pod.doc.file
            );
            let env = container_env(docs, pod, c);
            let raw_args = c.args.clone().unwrap_or_default();
            let args = raw_args.iter().map(|a| expand(&pod.doc.file, a, &env)).collect();
            out.push(KvotaContainer {
                pod,
                container: c.clone(),
                raw_args,
                args,
                env,
            });
        }
    }
    out
}

/// What `kvota SUBCOMMAND --help` says: each option's environment variable, and the
/// options the usage line requires.
struct Help {
    env_of: BTreeMap<String, Option<String>>,
    required: Vec<String>,
}

fn help(subcommand: &[String]) -> Help {
    let out = kvota()
        .args(subcommand)
        .arg("--help")
        .output()
        .expect("run kvota --help");
    assert!(
        out.status.success(),
        "kvota {} --help failed: {}",
        subcommand.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let usage: String = text
        .split("Usage:")
        .nth(1)
        .expect("a usage line")
        .split("\n\n")
        .next()
        .unwrap_or("")
        .to_string();
    let required = usage
        .split_whitespace()
        .filter(|t| t.starts_with("--"))
        .map(str::to_string)
        .collect();
    let mut blocks: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        let t = line.trim_start();
        let is_option = line.starts_with(' ') && t.starts_with('-');
        if is_option {
            let flag = t
                .split_whitespace()
                .find(|w| w.starts_with("--"))
                .unwrap_or("")
                .trim_end_matches(',')
                .to_string();
            blocks.push((flag, t.to_string()));
        } else if let Some(last) = blocks.last_mut() {
            last.1.push(' ');
            last.1.push_str(t);
        }
    }
    let env_of = blocks
        .into_iter()
        .map(|(flag, block)| {
            let block = block.split_whitespace().collect::<Vec<_>>().join(" ");
            let env = block
                .split("[env: ")
                .nth(1)
                .and_then(|r| r.split('=').next())
                .map(str::to_string);
            (flag, env)
        })
        .collect();
    Help { env_of, required }
}

#[test]
fn container_arguments_and_environment_are_what_kvota_accepts() {
    // The method: clap acts on `--help` where it meets it, after parsing everything
    // before it, so `kvota SUB ARGS... --help` exits 0 only if every argument exists
    // and every value parses (requirements are checked apart, below).
    let ok = |args: &[&str]| {
        kvota()
            .args(args)
            .arg("--help")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("run")
            .success()
    };
    assert!(ok(&["agent", "--leader-lease=x"]));
    assert!(
        !ok(&["agent", "--no-such-flag"]),
        "an unknown flag before --help must fail"
    );
    assert!(
        !ok(&["agent", "--report-interval-ms=soon"]),
        "a bad value before --help must fail"
    );
    assert!(!ok(&["server", "--id=x"]), "a bad value before --help must fail");

    for (install, docs) in installs() {
        eprintln!("checking {install}");
        container_arguments_and_environment_are_what_kvota_accepts_in(docs);
    }
}

fn container_arguments_and_environment_are_what_kvota_accepts_in(docs: Vec<Doc>) {
    let pods = pods(&docs);
    let containers = kvota_containers(&docs, &pods);
    let mut problems = Vec::new();
    for k in &containers {
        let what = format!(
            "{} ({} {}, container {})",
            k.pod.doc.file,
            k.pod.doc.kind(),
            k.pod.doc.name(),
            k.container.name
        );
        let sub = k.subcommand();
        if sub.is_empty() {
            problems.push(format!("{what}: args name no kvota subcommand"));
            continue;
        }
        let out = kvota().args(&k.args).arg("--help").output().expect("run kvota");
        if !out.status.success() {
            problems.push(format!(
                "{what}: `kvota {}` is refused: {}",
                k.args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let h = help(&sub);
        for flag in &h.required {
            let given = k.args.iter().any(|a| a == flag || a.starts_with(&format!("{flag}=")));
            let from_env = h
                .env_of
                .get(flag)
                .cloned()
                .flatten()
                .is_some_and(|e| k.env.contains_key(&e));
            if !given && !from_env {
                problems.push(format!(
                    "{what}: `kvota {}` requires {flag}, given neither as an argument nor by its variable",
                    sub.join(" ")
                ));
            }
        }
        let read: BTreeSet<String> = h.env_of.values().flatten().cloned().collect();
        for name in k.env.keys() {
            let expanded = k.raw_args.iter().any(|a| a.contains(&format!("$({name})")));
            if !read.contains(name) && !expanded && name != "RUST_LOG" {
                problems.push(format!(
                    "{what}: environment variable {name} is read by nothing (not in `kvota {} --help`)",
                    sub.join(" ")
                ));
            }
        }
    }
    assert!(
        containers.len() >= 3,
        "the agent, the server and the bootstrap Job run kvota"
    );
    assert!(
        problems.is_empty(),
        "{} problems:\n  {}",
        problems.len(),
        problems.join("\n  ")
    );
}

fn agent<'a>(containers: &'a [KvotaContainer<'a>]) -> &'a KvotaContainer<'a> {
    containers
        .iter()
        .find(|k| k.subcommand() == ["agent"])
        .expect("a container runs `kvota agent`")
}

fn server<'a>(containers: &'a [KvotaContainer<'a>]) -> &'a KvotaContainer<'a> {
    containers
        .iter()
        .find(|k| k.subcommand() == ["server"])
        .expect("a container runs `kvota server`")
}

/// A permission granted to the agent: a rule, and the namespace it is limited to
/// (None: cluster-wide, from a ClusterRoleBinding).
struct Grant {
    from: String,
    namespace: Option<String>,
    rule: PolicyRule,
}

fn binds(subjects: &Option<Vec<Subject>>, sa: &str, ns: &str) -> bool {
    subjects
        .iter()
        .flatten()
        .any(|s| s.kind == "ServiceAccount" && s.name == sa && s.namespace.as_deref() == Some(ns))
}

fn grants(docs: &[Doc], sa: &str, ns: &str) -> Vec<Grant> {
    let mut out = Vec::new();
    let cluster_roles: Vec<(ClusterRole, &Doc)> = all_of(docs, "ClusterRole");
    let cluster_role = |name: &str| -> Vec<PolicyRule> {
        cluster_roles
            .iter()
            .find(|(_, d)| d.name() == name)
            .unwrap_or_else(|| panic!("a binding refers to ClusterRole {name}, which no manifest defines"))
            .0
            .rules
            .clone()
            .unwrap_or_default()
    };
    for (b, d) in all_of::<ClusterRoleBinding>(docs, "ClusterRoleBinding") {
        if binds(&b.subjects, sa, ns) {
            assert_eq!(b.role_ref.kind, "ClusterRole", "{}", d.file);
            for rule in cluster_role(&b.role_ref.name) {
                out.push(Grant {
                    from: format!("ClusterRole {}", b.role_ref.name),
                    namespace: None,
                    rule,
                });
            }
        }
    }
    for (b, d) in all_of::<RoleBinding>(docs, "RoleBinding") {
        if binds(&b.subjects, sa, ns) {
            let rules = match b.role_ref.kind.as_str() {
                "ClusterRole" => cluster_role(&b.role_ref.name),
                _ => {
                    let r: Role = docs
                        .iter()
                        .find(|r| r.kind() == "Role" && r.name() == b.role_ref.name && r.namespace() == d.namespace())
                        .unwrap_or_else(|| {
                            panic!(
                                "{}: Role {} is not defined in {}",
                                d.file,
                                b.role_ref.name,
                                d.namespace()
                            )
                        })
                        .typed();
                    r.rules.unwrap_or_default()
                }
            };
            for rule in rules {
                out.push(Grant {
                    from: format!("{} {} in {}", b.role_ref.kind, b.role_ref.name, d.namespace()),
                    namespace: Some(d.namespace().to_string()),
                    rule,
                });
            }
        }
    }
    out
}

fn list(v: &Option<Vec<String>>) -> Vec<String> {
    v.clone().unwrap_or_default()
}

/// Whether `g` allows `verb` on `group/resource` in namespace `ns` (None: across all
/// namespaces) for object `name` (None: a request that names none, like create or list).
fn allows(g: &Grant, group: &str, resource: &str, verb: &str, ns: Option<&str>, name: Option<&str>) -> bool {
    let r = &g.rule;
    let names = list(&r.resource_names);
    list(&r.api_groups).iter().any(|x| x == group)
        && list(&r.resources).iter().any(|x| x == resource)
        && r.verbs.iter().any(|x| x == verb)
        && (g.namespace.is_none() || g.namespace.as_deref() == ns)
        && (names.is_empty() || name.is_some_and(|n| names.iter().any(|x| x == n)))
}

#[test]
fn rbac_grants_exactly_the_calls_the_agent_makes() {
    for (install, docs) in installs() {
        eprintln!("checking {install}");
        rbac_grants_exactly_the_calls_the_agent_makes_in(docs);
    }
}

fn rbac_grants_exactly_the_calls_the_agent_makes_in(docs: Vec<Doc>) {
    let pods = pods(&docs);
    let containers = kvota_containers(&docs, &pods);
    let agent = agent(&containers);
    let ns = agent.pod.doc.namespace();
    let sa = agent
        .pod
        .spec
        .service_account_name
        .clone()
        .expect("the agent's pod names its ServiceAccount");
    assert!(
        docs.iter()
            .any(|d| d.kind() == "ServiceAccount" && d.name() == sa && d.namespace() == ns),
        "ServiceAccount {ns}/{sa} is defined"
    );
    let lease = agent
        .flag("--leader-lease")
        .or_else(|| agent.env.get("KVOTA_LEADER_LEASE").cloned())
        .expect("the agent runs with --leader-lease");
    let lease_ns = agent
        .flag("--leader-lease-namespace")
        .or_else(|| agent.env.get("POD_NAMESPACE").cloned())
        .unwrap_or_else(|| "kvota-system".to_string());
    let grants = grants(&docs, &sa, ns);
    let state_cm = agent
        .flag("--state-configmap")
        .unwrap_or_else(|| "kvota-agent-state".to_string());

    let mut problems = Vec::new();
    for (group, resource, verb, scope, code) in AGENT_CALLS {
        let (in_ns, name) = match scope {
            Scope::Cluster => (None, None),
            Scope::LeaderLease => (Some(lease_ns.as_str()), (*verb != "create").then_some(lease.as_str())),
            Scope::StateConfigMap => (
                Some(lease_ns.as_str()),
                (*verb != "create").then_some(state_cm.as_str()),
            ),
        };
        if !grants.iter().any(|g| allows(g, group, resource, verb, in_ns, name)) {
            let group = if group.is_empty() { "core" } else { group };
            let place = in_ns.map_or("in every namespace".to_string(), |n| format!("in {n}"));
            problems.push(format!(
                "{verb} {group}/{resource} {place} is not allowed; the agent needs it for {code}"
            ));
        }
    }
    for g in &grants {
        let r = &g.rule;
        if !list(&r.non_resource_urls).is_empty() {
            problems.push(format!("{}: grants non-resource URLs; the agent calls none", g.from));
        }
        for group in list(&r.api_groups) {
            for resource in list(&r.resources) {
                for verb in &r.verbs {
                    let needed = AGENT_CALLS.iter().any(|(cg, cr, cv, scope, _)| {
                        *cg == group
                            && *cr == resource
                            && cv == verb
                            && (g.namespace.is_some() || *scope == Scope::Cluster)
                    });
                    if !needed {
                        let place = g
                            .namespace
                            .as_deref()
                            .map_or("cluster-wide".to_string(), |n| format!("in {n}"));
                        problems.push(format!(
                            "{}: grants {verb} {group}/{resource} {place}, which the agent never calls (AGENT_CALLS)",
                            g.from
                        ));
                    }
                }
            }
        }
    }
    assert!(problems.is_empty(), "RBAC of {ns}/{sa}:\n  {}", problems.join("\n  "));
}

/// Whether a label selector selects an object with these labels.
fn selects(sel: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let by_labels = sel.match_labels.iter().flatten().all(|(k, v)| labels.get(k) == Some(v));
    let by_expressions = sel.match_expressions.iter().flatten().all(|e| {
        let values = list(&e.values);
        let has = labels.get(&e.key);
        match e.operator.as_str() {
            "In" => has.is_some_and(|v| values.contains(v)),
            "NotIn" => has.is_none_or(|v| !values.contains(v)),
            "Exists" => has.is_some(),
            "DoesNotExist" => has.is_none(),
            other => panic!("unknown label selector operator {other}"),
        }
    });
    by_labels && by_expressions
}

fn namespace_labels(name: &str) -> BTreeMap<String, String> {
    // Kubernetes puts this label on every namespace.
    [("kubernetes.io/metadata.name".to_string(), name.to_string())].into()
}

/// The port a container listens on for `--flag HOST:PORT`.
fn listen_port(k: &KvotaContainer<'_>, flag: &str, default: &str) -> i32 {
    let addr = k.flag(flag).unwrap_or_else(|| default.to_string());
    addr.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("{flag} {addr}: no port"))
}

/// The container port `p` (a number or a port name) stands for.
fn container_port(c: &Container, p: &IntOrString) -> Option<i32> {
    let ports = c.ports.clone().unwrap_or_default();
    match p {
        IntOrString::Int(n) => ports.iter().any(|cp| cp.container_port == *n).then_some(*n),
        IntOrString::String(name) => ports
            .iter()
            .find(|cp| cp.name.as_deref() == Some(name))
            .map(|cp| cp.container_port),
    }
}

/// The Service `ns/name` and the container port its `port` reaches.
fn service_target(docs: &[Doc], ns: &str, name: &str, port: i32, k: &KvotaContainer<'_>) -> Result<i32, String> {
    let doc = docs
        .iter()
        .find(|d| d.kind() == "Service" && d.name() == name && d.namespace() == ns)
        .ok_or_else(|| format!("Service {ns}/{name} is not defined"))?;
    let svc: Service = doc.typed();
    let spec = svc.spec.ok_or("no spec")?;
    let selector = LabelSelector {
        match_labels: spec.selector.clone(),
        match_expressions: None,
    };
    // Agent replicas label their own pods with their role at run time
    // (member-agent/src/kube.rs, ROLE_LABEL): the Service must reach the leader only.
    let agent = k.subcommand().first().map(String::as_str) == Some("agent");
    let with_role = |role: &str| {
        let mut l = k.pod.labels.clone();
        if agent {
            l.insert("kvota.dev/agent-role".to_string(), role.to_string());
        }
        l
    };
    if spec.selector.as_ref().is_none_or(BTreeMap::is_empty) || !selects(&selector, &with_role("leader")) {
        return Err(format!(
            "Service {ns}/{name} does not select the pods of {} {}",
            k.pod.doc.kind(),
            k.pod.doc.name()
        ));
    }
    if agent && selects(&selector, &with_role("standby")) {
        return Err(format!(
            "Service {ns}/{name} also selects standby agent replicas (select kvota.dev/agent-role: leader)"
        ));
    }
    if k.pod.doc.namespace() != ns {
        return Err(format!(
            "Service {ns}/{name} is not in the namespace of {}",
            k.pod.doc.name()
        ));
    }
    let sp = spec
        .ports
        .iter()
        .flatten()
        .find(|sp| sp.port == port)
        .ok_or_else(|| format!("Service {ns}/{name} has no port {port}"))?;
    let target = sp.target_port.clone().unwrap_or(IntOrString::Int(sp.port));
    container_port(&k.container, &target).ok_or_else(|| {
        format!("Service {ns}/{name} port {port} targets {target:?}, which the container does not expose")
    })
}

struct Hook {
    kind: &'static str,
    name: String,
    client: WebhookClientConfig,
    rules: Vec<RuleWithOperations>,
    versions: Vec<String>,
    side_effects: String,
    timeout: Option<i32>,
    failure_policy: Option<String>,
    namespace_selector: Option<LabelSelector>,
    conditions: Option<Vec<(String, String)>>,
}

fn hooks(docs: &[Doc]) -> Vec<Hook> {
    let mut out = Vec::new();
    for (m, _) in all_of::<MutatingWebhookConfiguration>(docs, "MutatingWebhookConfiguration") {
        for w in m.webhooks.unwrap_or_default() {
            out.push(Hook {
                kind: "MutatingWebhookConfiguration",
                name: w.name,
                client: w.client_config,
                rules: w.rules.unwrap_or_default(),
                versions: w.admission_review_versions,
                side_effects: w.side_effects,
                timeout: w.timeout_seconds,
                failure_policy: w.failure_policy,
                namespace_selector: w.namespace_selector,
                conditions: w
                    .match_conditions
                    .map(|c| c.into_iter().map(|c| (c.name, c.expression)).collect()),
            });
        }
    }
    for (v, _) in all_of::<ValidatingWebhookConfiguration>(docs, "ValidatingWebhookConfiguration") {
        for w in v.webhooks.unwrap_or_default() {
            out.push(Hook {
                kind: "ValidatingWebhookConfiguration",
                name: w.name,
                client: w.client_config,
                rules: w.rules.unwrap_or_default(),
                versions: w.admission_review_versions,
                side_effects: w.side_effects,
                timeout: w.timeout_seconds,
                failure_policy: w.failure_policy,
                namespace_selector: w.namespace_selector,
                conditions: w
                    .match_conditions
                    .map(|c| c.into_iter().map(|c| (c.name, c.expression)).collect()),
            });
        }
    }
    out
}

#[test]
fn webhooks_call_the_agent_where_it_listens_and_spare_system_namespaces() {
    for (install, docs) in installs() {
        eprintln!("checking {install}");
        webhooks_call_the_agent_where_it_listens_and_spare_system_namespaces_in(docs);
    }
}

fn webhooks_call_the_agent_where_it_listens_and_spare_system_namespaces_in(docs: Vec<Doc>) {
    let pods = pods(&docs);
    let containers = kvota_containers(&docs, &pods);
    let agent = agent(&containers);
    let agent_ns = agent.pod.doc.namespace();
    let listen = listen_port(agent, "--webhook-listen", "0.0.0.0:8443");
    let hooks = hooks(&docs);
    let mut problems = Vec::new();
    for kind in ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"] {
        if !hooks.iter().any(|h| h.kind == kind) {
            problems.push(format!("no webhook in any {kind}"));
        }
    }
    for h in &hooks {
        let what = format!("{} webhook {}", h.kind, h.name);
        // The agent judges queue-mode tenants at /mutate and reject-mode ones at
        // /validate (member-agent/src/review.rs, webhook.rs).
        let path = if h.kind.starts_with("Mutating") {
            "/mutate"
        } else {
            "/validate"
        };
        match &h.client.service {
            None => problems.push(format!("{what}: calls a URL, not the agent's Service")),
            Some(s) => {
                if s.path.as_deref() != Some(path) {
                    problems.push(format!(
                        "{what}: path {:?}, the agent serves this kind at {path}",
                        s.path
                    ));
                }
                match service_target(&docs, &s.namespace, &s.name, s.port.unwrap_or(443), agent) {
                    Ok(p) if p == listen => {}
                    Ok(p) => problems.push(format!(
                        "{what}: reaches container port {p}, the agent listens on {listen}"
                    )),
                    Err(e) => problems.push(format!("{what}: {e}")),
                }
            }
        }
        if h.client.ca_bundle.is_none() {
            problems.push(format!(
                "{what}: no caBundle (placeholder) for make-webhook-cert to fill in"
            ));
        }
        if h.rules.is_empty() {
            problems.push(format!("{what}: no rules"));
        }
        for r in &h.rules {
            let (groups, versions, ops, res) = (
                list(&r.api_groups),
                list(&r.api_versions),
                list(&r.operations),
                list(&r.resources),
            );
            if groups != [""] || versions != ["v1"] || res != ["pods"] || ops != ["CREATE"] {
                problems.push(format!(
                    "{what}: a rule for {groups:?} {versions:?} {res:?} {ops:?}; the agent judges core/v1 pods at CREATE only \
                     (UPDATE passes untouched; deletions come from its watch)"
                ));
            }
        }
        if h.versions != ["v1"] {
            problems.push(format!(
                "{what}: admissionReviewVersions {:?}; the agent speaks admission.k8s.io/v1 only",
                h.versions
            ));
        }
        if h.side_effects != "NoneOnDryRun" {
            problems.push(format!(
                "{what}: sideEffects {}; the agent records reservations, except for dry runs",
                h.side_effects
            ));
        }
        if !h.timeout.is_some_and(|t| (1..=30).contains(&t)) {
            problems.push(format!(
                "{what}: timeoutSeconds {:?}, expected one set between 1 and 30",
                h.timeout
            ));
        }
        if !matches!(h.failure_policy.as_deref(), Some("Fail" | "Ignore")) {
            problems.push(format!(
                "{what}: failurePolicy {:?} must be set, with its trade-off said",
                h.failure_policy
            ));
        }
        let selector = h.namespace_selector.clone().unwrap_or_default();
        for spared in ["kube-system", agent_ns] {
            if selects(&selector, &namespace_labels(spared)) {
                problems.push(format!("{what}: its namespaceSelector selects {spared}; the agent must never judge its own pods or the system's"));
            }
        }
        // Opt-in: an ordinary namespace is judged once labelled, not before.
        let mut opted_in = namespace_labels("ml-training");
        if selects(&selector, &opted_in) {
            problems.push(format!("{what}: its namespaceSelector selects a namespace that did not opt in; installing the agent must change nothing until one is labelled {ENFORCE_LABEL}=true"));
        }
        opted_in.insert(ENFORCE_LABEL.to_string(), "true".to_string());
        if !selects(&selector, &opted_in) {
            problems.push(format!(
                "{what}: its namespaceSelector does not select a namespace labelled {ENFORCE_LABEL}=true"
            ));
        }
        if h.failure_policy.as_deref() != Some("Fail") {
            problems.push(format!(
                "{what}: the template fails closed (failurePolicy Fail); make-webhook-cert --fail-open renders Ignore"
            ));
        }
    }
    let conditions: BTreeSet<String> = hooks.iter().map(|h| format!("{:?}", h.conditions)).collect();
    if conditions.len() > 1 {
        problems
            .push("the webhooks' matchConditions differ: a pod would be judged by one and not the other".to_string());
    }
    // Real CA bundles are made at install time, never committed.
    let template = deploy_dir().join(WEBHOOK_TEMPLATE).join("webhooks.yaml");
    let text = std::fs::read_to_string(&template).expect("base/agent/webhooks/webhooks.yaml");
    let placeholders = text.matches(&format!("caBundle: \"{CA_PLACEHOLDER}\"")).count();
    if placeholders != hooks.len() {
        problems.push(format!(
            "{}: {placeholders} caBundle placeholders for {} webhooks",
            template.display(),
            hooks.len()
        ));
    }
    let script = std::fs::read_to_string(deploy_dir().join("make-webhook-cert")).expect("make-webhook-cert");
    if !script.contains(CA_PLACEHOLDER) {
        problems.push("make-webhook-cert does not replace the placeholder of webhooks.yaml".to_string());
    }
    // The probes ask the agent itself, over its TLS port.
    for (probe, path) in [
        (&agent.container.liveness_probe, "/healthz"),
        (&agent.container.readiness_probe, "/readyz"),
    ] {
        let get = probe.as_ref().and_then(|p| p.http_get.clone());
        match get {
            Some(g)
                if g.path.as_deref() == Some(path)
                    && g.scheme.as_deref() == Some("HTTPS")
                    && container_port(&agent.container, &g.port) == Some(listen) => {}
            other => problems.push(format!(
                "agent probe for {path}: {other:?}; expected HTTPS GET {path} on port {listen}"
            )),
        }
    }
    assert!(
        problems.is_empty(),
        "{} problems:\n  {}",
        problems.len(),
        problems.join("\n  ")
    );
}

fn mount_of<'a>(c: &'a Container, volume: &str) -> Option<&'a str> {
    c.volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == volume)
        .map(|m| m.mount_path.as_str())
}

#[test]
fn pods_run_unprivileged_with_their_data_on_a_volume() {
    for (install, docs) in installs() {
        eprintln!("checking {install}");
        pods_run_unprivileged_with_their_data_on_a_volume_in(docs);
    }
}

fn pods_run_unprivileged_with_their_data_on_a_volume_in(docs: Vec<Doc>) {
    let pods = pods(&docs);
    let containers = kvota_containers(&docs, &pods);
    let mut problems = Vec::new();
    for k in &containers {
        let what = format!("{} {}", k.pod.doc.kind(), k.pod.doc.name());
        let psc = k.pod.spec.security_context.clone().unwrap_or_default();
        let sc = k.container.security_context.clone().unwrap_or_default();
        if psc.run_as_non_root != Some(true) && sc.run_as_non_root != Some(true) {
            problems.push(format!("{what}: runAsNonRoot is not set"));
        }
        if sc.read_only_root_filesystem != Some(true) {
            problems.push(format!("{what}: the root filesystem is writable"));
        }
        if sc.allow_privilege_escalation != Some(false) {
            problems.push(format!("{what}: allowPrivilegeEscalation is not false"));
        }
        let caps = sc.capabilities.clone().unwrap_or_default();
        if !list(&caps.drop).iter().any(|c| c == "ALL") || !list(&caps.add).is_empty() {
            problems.push(format!("{what}: capabilities are not `drop: [ALL]` with none added"));
        }
        let seccomp = sc
            .seccomp_profile
            .as_ref()
            .or(psc.seccomp_profile.as_ref())
            .map(|p| p.type_.as_str());
        if !matches!(seccomp, Some("RuntimeDefault" | "Localhost")) {
            problems.push(format!("{what}: seccompProfile is {seccomp:?}, not RuntimeDefault"));
        }
        if k.container
            .resources
            .as_ref()
            .and_then(|r| r.requests.as_ref())
            .is_none()
        {
            problems.push(format!("{what}: no resource requests"));
        }
        // With a read-only root, the data directory must be a mounted volume.
        if let Some(dir) = k.flag("--data-dir") {
            let mounted = k
                .container
                .volume_mounts
                .iter()
                .flatten()
                .any(|m| m.mount_path == dir && m.read_only != Some(true));
            if !mounted {
                problems.push(format!("{what}: --data-dir {dir} is not a writable mounted volume"));
            }
        } else if matches!(k.subcommand().first().map(String::as_str), Some("agent" | "server")) {
            problems.push(format!(
                "{what}: no --data-dir (the default is relative to a read-only root)"
            ));
        }
    }
    // The agent's certificate and key come from the webhook Secret's volume.
    let agent = agent(&containers);
    let tls = agent
        .pod
        .spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.secret.as_ref().and_then(|s| s.secret_name.as_deref()) == Some("kvota-agent-tls"))
        .map(|v| v.name.clone());
    match tls.as_deref().and_then(|v| mount_of(&agent.container, v)) {
        Some(dir) => {
            for (flag, file) in [("--tls-cert", "tls.crt"), ("--tls-key", "tls.key")] {
                if agent.flag(flag) != Some(format!("{dir}/{file}")) {
                    problems.push(format!(
                        "agent {flag} is {:?}, not {dir}/{file} of the mounted Secret",
                        agent.flag(flag)
                    ));
                }
            }
        }
        None => {
            problems.push("the agent does not mount Secret kvota-agent-tls (made by make-webhook-cert)".to_string())
        }
    }
    let pod_ns = agent.env.get("POD_NAMESPACE");
    let pod_name = agent.env.get("POD_NAME");
    if pod_ns.map(String::as_str) != Some(agent.pod.doc.namespace()) || pod_name != Some(&agent.pod.name) {
        problems.push("the agent's POD_NAMESPACE and POD_NAME do not come from the downward API".to_string());
    }
    assert!(
        problems.is_empty(),
        "{} problems:\n  {}",
        problems.len(),
        problems.join("\n  ")
    );
}

#[test]
fn control_plane_ids_peers_and_bootstrap_agree() {
    for (install, docs) in installs() {
        eprintln!("checking {install}");
        control_plane_ids_peers_and_bootstrap_agree_in(docs);
    }
}

fn control_plane_ids_peers_and_bootstrap_agree_in(docs: Vec<Doc>) {
    let pods = pods(&docs);
    let containers = kvota_containers(&docs, &pods);
    let server = server(&containers);
    let doc = server.pod.doc;
    let ns = doc.namespace();
    let sts: StatefulSet = doc.typed();
    let spec = sts.spec.expect("spec");
    let replicas = spec.replicas.unwrap_or(1);
    let start = spec.ordinals.as_ref().and_then(|o| o.start).unwrap_or(0);
    assert!(
        start >= 1,
        "node ids are pod ordinals and must be > 0: set spec.ordinals.start to 1"
    );
    assert!(replicas == 3 || replicas == 5, "a Raft group of 3 or 5, not {replicas}");
    assert_eq!(
        spec.pod_management_policy.as_deref(),
        Some("Parallel"),
        "OrderedReady would wait for a ready node 1, and none is ready before a quorum"
    );
    assert_eq!(
        server.env.get("KVOTA_NODE_ID"),
        Some(&start.to_string()),
        "KVOTA_NODE_ID must come from the pod-index label (kvota server defaults to node 1)"
    );

    // The headless Service gives every pod its peer name, ready or not.
    let peers_name = spec.service_name.clone().expect("serviceName");
    let peers: Service = find(&docs, "Service", &peers_name).typed();
    let peers_spec = peers.spec.expect("spec");
    assert_eq!(
        peers_spec.cluster_ip.as_deref(),
        Some("None"),
        "{peers_name} must be headless"
    );
    assert_eq!(
        peers_spec.publish_not_ready_addresses,
        Some(true),
        "nodes must find each other before any is ready"
    );
    let grpc = listen_port(server, "--listen", "127.0.0.1:7401");
    let raft = listen_port(server, "--raft-listen", "127.0.0.1:7601");
    let http = listen_port(server, "--http", "127.0.0.1:7501");
    for flag in ["--listen", "--raft-listen", "--http"] {
        let host = server.flag(flag).unwrap_or_default();
        assert!(
            host.starts_with("0.0.0.0:") || host.starts_with("[::]:"),
            "{flag} {host}: other pods cannot reach a loopback address"
        );
    }
    for port in [grpc, raft, http] {
        service_target(&docs, ns, &peers_name, port, server).unwrap_or_else(|e| panic!("{e}"));
    }
    let peer = |ordinal: i32| format!("{}-{ordinal}.{peers_name}.{ns}.svc", doc.name());
    assert_eq!(
        server.flag("--advertise"),
        Some(format!("{}:{grpc}", peer(start))),
        "--advertise is the pod's peer name"
    );
    assert_eq!(server.flag("--advertise-http"), Some(format!("{}:{http}", peer(start))));
    assert_eq!(server.flag("--advertise-raft"), Some(format!("{}:{raft}", peer(start))));
    // Off loopback the server refuses plain text: the manifests give it TLS (its own
    // node certificate, by the id) rather than --insecure.
    assert!(
        server.flag("--insecure").is_none(),
        "the control plane runs with TLS, not --insecure"
    );
    assert_eq!(
        server.flag("--tls-cert"),
        Some(format!("/etc/kvota/tls/node-{start}.crt")),
        "each node presents its own certificate"
    );

    // The one-time bootstrap names exactly these nodes, at these addresses, and asks
    // the first of them.
    let job = containers
        .iter()
        .find(|k| k.subcommand() == ["members", "init"])
        .expect("a Job runs `kvota members init`");
    let members: BTreeSet<String> = job
        .args
        .iter()
        .filter_map(|a| a.strip_prefix("--member=").map(str::to_string))
        .collect();
    let expected: BTreeSet<String> = (start..start + replicas)
        .map(|i| format!("{i}={}:{grpc},{}:{http},{}:{raft}", peer(i), peer(i), peer(i)))
        .collect();
    assert_eq!(members, expected, "the bootstrap's members are the StatefulSet's pods");
    assert_eq!(
        job.flag("--cp"),
        Some(format!("{}:{grpc}", peer(start))),
        "the bootstrap asks node {start} through its peer name"
    );
    assert_eq!(job.pod.doc.namespace(), ns);

    // Readiness is the node's quorum check, on its HTTP port.
    let ready = server
        .container
        .readiness_probe
        .as_ref()
        .and_then(|p| p.http_get.clone())
        .expect("a readiness probe");
    assert_eq!(ready.path.as_deref(), Some("/readyz"));
    assert_eq!(container_port(&server.container, &ready.port), Some(http));

    // Agents and the CLI use the client Service; the agent's default points at it.
    service_target(&docs, ns, "kvota-server", grpc, server).unwrap_or_else(|e| panic!("{e}"));
    let agent = agent(&containers);
    assert_eq!(
        agent.env.get("KVOTA_CONTROL_PLANE"),
        Some(&format!("kvota-server.{ns}.svc:{grpc}")),
        "the agent's default control-plane address is the client Service"
    );
    // The data directory is a claim of each pod.
    let data = server.flag("--data-dir").expect("--data-dir");
    let claim = server
        .container
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == data)
        .map(|m| m.name.clone());
    let claims: Vec<String> = spec
        .volume_claim_templates
        .iter()
        .flatten()
        .filter_map(|c| c.metadata.name.clone())
        .collect();
    assert!(
        claim.is_some_and(|c| claims.contains(&c)),
        "--data-dir {data} is on a volumeClaimTemplate ({claims:?})"
    );
}

// ---- The real binaries on the manifests' paths, with make-webhook-cert's certificate.

use kvota_testkit::procs::{free_ports, Procs};

/// One HTTP/1.1 request to 127.0.0.1:`port`; over TLS, trusting only `ca`, to
/// `server_name`, when `tls` is given.
async fn request(
    port: u16,
    tls: Option<(&Path, &str)>,
    method: &str,
    path: &str,
    body: Vec<u8>,
) -> Result<(u16, Vec<u8>), String> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", tls.map_or("localhost", |t| t.1))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let resp = match tls {
        Some((ca, name)) => {
            let stream = tls_connect(tcp, ca, name).await?;
            let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .map_err(|e| e.to_string())?;
            tokio::spawn(conn);
            send.send_request(req).await.map_err(|e| e.to_string())?
        }
        None => {
            let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
                .await
                .map_err(|e| e.to_string())?;
            tokio::spawn(conn);
            send.send_request(req).await.map_err(|e| e.to_string())?
        }
    };
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes()
        .to_vec();
    Ok((status, body))
}

/// A TLS connection as the API server makes it to a webhook: trusting every CA in the
/// bundle `ca` (caBundle) and nothing else, for DNS name `name`.
async fn tls_connect(
    tcp: tokio::net::TcpStream,
    ca: &Path,
    name: &str,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).map_err(|e| format!("{}: {e}", ca.display()))? {
        roots
            .add(cert.map_err(|e| format!("{}: {e}", ca.display()))?)
            .map_err(|e| e.to_string())?;
    }
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let server_name = ServerName::try_from(name.to_string()).map_err(|e| e.to_string())?;
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(server_name, tcp)
        .await
        .map_err(|e| e.to_string())
}

async fn until_answers(what: &str, port: u16, tls: Option<(&Path, &str)>, path: &str, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match request(port, tls, "GET", path, Vec::new()).await {
            Ok(_) => return,
            Err(e) if Instant::now() > deadline => {
                panic!(
                    "{what} does not answer {path}: {e}\nlog:\n{}",
                    std::fs::read_to_string(log).unwrap_or_default()
                )
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

fn gpu_pod_review(uid: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "ml", "name": uid, "operation": "CREATE",
            "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": uid, "namespace": "ml"},
                "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}
    }))
    .expect("json")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn make_webhook_cert_and_the_manifests_paths_work_with_the_real_binaries() {
    if Command::new("openssl").arg("version").output().is_err() {
        panic!("openssl is needed by deploy/kubernetes/make-webhook-cert and this test: apt-get install openssl");
    }
    let tmp = tempfile::tempdir().expect("tmp");
    let out = tmp.path().join("cert");
    let run = Command::new("bash")
        .arg(deploy_dir().join("make-webhook-cert"))
        .args(["--days", "2", "--out"])
        .arg(&out)
        .output()
        .expect("run make-webhook-cert");
    assert!(
        run.status.success(),
        "make-webhook-cert failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let again = Command::new("bash")
        .arg(deploy_dir().join("make-webhook-cert"))
        .arg("--out")
        .arg(&out)
        .output()
        .expect("run");
    assert!(
        !again.status.success(),
        "make-webhook-cert must not overwrite a certificate without --force"
    );

    // What it wrote parses as the manifests do, and fits them.
    let written = documents_under(&out);
    for d in &written {
        check_typed(d).unwrap_or_else(|e| panic!("{}: {e}", d.file));
    }
    let docs = manifests();
    let pods = pods(&docs);
    let containers = kvota_containers(&docs, &pods);
    let agent = agent(&containers);
    let secret: Secret = find(&written, "Secret", "kvota-agent-tls").typed();
    assert_eq!(secret.metadata.namespace.as_deref(), Some(agent.pod.doc.namespace()));
    assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
    let data = secret.data.expect("data");
    let ca_pem = std::fs::read(out.join("ca.crt")).expect("ca.crt");
    assert_eq!(
        data.get("tls.crt").map(|b| b.0.clone()),
        Some(std::fs::read(out.join("tls.crt")).expect("tls.crt"))
    );
    let rendered = hooks(&written);
    assert_eq!(rendered.len(), hooks(&docs).len(), "webhooks.yaml has every webhook");
    for h in &rendered {
        assert_eq!(
            h.client.ca_bundle.as_ref().map(|b| b.0.clone()),
            Some(ca_pem.clone()),
            "{}: caBundle is the CA",
            h.name
        );
        assert_eq!(
            h.failure_policy.as_deref(),
            Some("Fail"),
            "{}: fails closed by default",
            h.name
        );
    }
    // --fail-open: the same webhooks, failing open, and nothing else changed.
    let open_out = tmp.path().join("cert-open");
    let run = Command::new("bash")
        .arg(deploy_dir().join("make-webhook-cert"))
        .arg("--fail-open")
        .arg("--out")
        .arg(&open_out)
        .output()
        .expect("run");
    assert!(
        run.status.success(),
        "make-webhook-cert --fail-open failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let open_hooks = hooks(&documents_under(&open_out));
    assert_eq!(open_hooks.len(), rendered.len());
    for (o, c) in open_hooks.iter().zip(&rendered) {
        assert_eq!(o.failure_policy.as_deref(), Some("Ignore"), "{}: --fail-open", o.name);
        assert_eq!(
            (
                &o.name,
                format!("{:?}", o.namespace_selector),
                format!("{:?}", o.conditions)
            ),
            (
                &c.name,
                format!("{:?}", c.namespace_selector),
                format!("{:?}", c.conditions)
            )
        );
    }

    // The real agent serves that certificate; the API server's view: the Service's DNS
    // name, trusting only caBundle.
    let service = rendered[0].client.service.clone().expect("service");
    let dns = format!("{}.{}.svc", service.name, service.namespace);
    let ports = free_ports(3);
    let hook = ports[0];
    let log = |name: &str| Stdio::from(std::fs::File::create(tmp.path().join(name)).expect("log"));
    let agent_proc = kvota()
        .args(["agent", "--cluster", "east", "--simulate", "1x8", "--cp", "127.0.0.1:1"])
        .arg(format!("--webhook-listen=127.0.0.1:{hook}"))
        .arg("--tls-cert")
        .arg(out.join("tls.crt"))
        .arg("--tls-key")
        .arg(out.join("tls.key"))
        .arg("--data-dir")
        .arg(tmp.path().join("agent"))
        .stdout(Stdio::null())
        .stderr(log("agent.log"))
        .spawn()
        .expect("spawn agent");
    let server_proc = kvota()
        .args([
            "server",
            "--id",
            "1",
            "--listen",
            &format!("127.0.0.1:{}", ports[1]),
            "--http",
            &format!("127.0.0.1:{}", ports[2]),
            "--raft-listen",
            "127.0.0.1:0",
        ])
        .arg("--data-dir")
        .arg(tmp.path().join("server"))
        .stdout(Stdio::null())
        .stderr(log("server.log"))
        .spawn()
        .expect("spawn server");
    let _procs = Procs::of([agent_proc, server_proc]);
    let ca = out.join("ca.crt");
    let tls = Some((ca.as_path(), dns.as_str()));
    until_answers("the agent", hook, tls, "/healthz", &tmp.path().join("agent.log")).await;

    for h in &rendered {
        let path = h.client.service.as_ref().and_then(|s| s.path.clone()).expect("path");
        let (status, body) = request(hook, tls, "POST", &path, gpu_pod_review("p1"))
            .await
            .expect("review");
        let review: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        assert!(
            status == 200 && review["response"]["uid"] == "p1",
            "{}: POST {path} answered {status}: {review}",
            h.name
        );
    }
    for probe in [&agent.container.liveness_probe, &agent.container.readiness_probe] {
        let path = probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
            .and_then(|g| g.path.clone())
            .expect("probe path");
        let (status, _) = request(hook, tls, "GET", &path, Vec::new()).await.expect("probe");
        assert!(status == 200 || status == 503, "agent probe {path} answered {status}");
    }

    let server = server(&containers);
    until_answers("the server", ports[2], None, "/healthz", &tmp.path().join("server.log")).await;
    for probe in [&server.container.liveness_probe, &server.container.readiness_probe] {
        let path = probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
            .and_then(|g| g.path.clone())
            .expect("probe path");
        let (status, _) = request(ports[2], None, "GET", &path, Vec::new()).await.expect("probe");
        assert!(status == 200 || status == 503, "server probe {path} answered {status}");
    }
}

/// The image's Dockerfile (checked as text: building it needs a static release build,
/// which `deploy/build-image` makes): FROM scratch, the binary on PATH so `kubectl exec
/// POD -- kvota status` finds it, a numeric non-root USER (what the manifests'
/// runAsNonRoot checks), the OCI version and revision labels filled from build
/// arguments that `build-image` passes, and the entrypoint the manifests' args follow.
#[test]
fn the_image_puts_kvota_on_path_runs_as_non_root_and_carries_its_version() {
    let text = std::fs::read_to_string(repo().join("deploy/Dockerfile")).expect("Dockerfile");
    // Instructions, with continuation lines joined and comments dropped.
    let joined = text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n")
        .replace("\\\n", " ");
    let instr: Vec<(String, String)> = joined
        .lines()
        .filter_map(|l| {
            l.trim()
                .split_once(' ')
                .map(|(k, v)| (k.to_ascii_uppercase(), v.trim().to_string()))
        })
        .collect();
    let all = |k: &str| {
        instr
            .iter()
            .filter(|(i, _)| i == k)
            .map(|(_, v)| v.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(all("FROM"), ["scratch"]);
    assert_eq!(all("COPY"), ["kvota /usr/local/bin/kvota"]);
    assert!(
        all("ENV")
            .iter()
            .any(|e| e.starts_with("PATH=") && e["PATH=".len()..].split(':').any(|d| d == "/usr/local/bin")),
        "{:?}",
        all("ENV")
    );
    assert_eq!(all("ENTRYPOINT"), [r#"["/usr/local/bin/kvota"]"#]);
    let user = all("USER");
    let uid: u32 = user
        .last()
        .and_then(|u| u.split(':').next())
        .and_then(|u| u.parse().ok())
        .expect("a numeric USER");
    assert!(uid != 0, "runs as root");
    let labels = all("LABEL").join(" ");
    for key in [
        "org.opencontainers.image.version=\"${VERSION}\"",
        "org.opencontainers.image.revision=\"${REVISION}\"",
        "org.opencontainers.image.title=",
    ] {
        assert!(labels.contains(key), "label {key} missing: {labels}");
    }
    let args = all("ARG");
    assert!(
        args.iter().any(|a| a.starts_with("VERSION")) && args.iter().any(|a| a.starts_with("REVISION")),
        "{args:?}"
    );
    let build = std::fs::read_to_string(repo().join("deploy/build-image")).expect("build-image");
    assert!(
        build.contains("--build-arg \"VERSION=") && build.contains("--build-arg \"REVISION="),
        "build-image passes the version and revision"
    );
    // The manifests run the uid the image declares.
    let mut checked = 0;
    for doc in installs().into_iter().flat_map(|(_, docs)| docs) {
        if let Some(spec) = doc.value.pointer("/spec/template/spec") {
            let ours = |c: &&Value| serde_json::from_value::<Container>((*c).clone()).is_ok_and(|c| is_kvota(&c));
            for c in spec["containers"].as_array().into_iter().flatten().filter(ours) {
                checked += 1;
                let run_as = c
                    .pointer("/securityContext/runAsUser")
                    .or_else(|| spec.pointer("/securityContext/runAsUser"))
                    .and_then(Value::as_u64);
                assert_eq!(run_as, Some(u64::from(uid)), "{} runs as the image's uid", doc.name());
            }
        }
    }
    assert!(
        checked >= 6,
        "the agent, the server and the bootstrap Job, in both installs"
    );
}

// ---- Strict schemas, pod security, network policies, disruption budgets, monitoring.

const NEED_VALIDATE: &str = "the deploy tests validate the rendered overlays with kubernetes-validate: \
     pip install kubernetes-validate==1.37.0 (scripts/test installs it; CI has it)";

/// `kubernetes-validate --strict --quiet -k VERSION FILES`: (success, what it printed).
fn kubernetes_validate(version: &str, files: &[PathBuf]) -> (bool, String) {
    let out = Command::new("kubernetes-validate")
        .args(["--strict", "--quiet", "-k", version])
        .args(files)
        .output()
        .unwrap_or_else(|e| panic!("run kubernetes-validate: {e}; {NEED_VALIDATE}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn every_rendered_object_validates_strictly_against_the_kubernetes_schemas() {
    let version = Command::new("kubernetes-validate").arg("--version").output();
    let version = version.unwrap_or_else(|e| panic!("run kubernetes-validate: {e}; {NEED_VALIDATE}"));
    let have = String::from_utf8_lossy(&version.stdout).trim().to_string();
    let want = KUBERNETES_VALIDATE.rsplit('=').next().unwrap_or("");
    assert!(
        have.contains(want),
        "kubernetes-validate --version says `{have}`, this test is pinned to {want}: {NEED_VALIDATE}"
    );
    let tmp = tempfile::tempdir().expect("tmp");

    // The validator itself: strict, so a misspelt field fails (as does an unknown kind).
    let bad = tmp.path().join("misspelt.yaml");
    std::fs::write(
        &bad,
        "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec:\n  ports:\n  - port: 443\n    tragetPort: x\n",
    )
    .expect("write");
    for v in KUBERNETES_VERSIONS {
        let (ok, text) = kubernetes_validate(v, std::slice::from_ref(&bad));
        assert!(
            !ok && text.contains("tragetPort"),
            "kubernetes-validate {v} let a misspelt field through: {text}"
        );
    }

    // Every rendered object: custom resources against their stated schema, everything
    // else against Kubernetes'.
    let mut problems = Vec::new();
    let mut files = Vec::new();
    let mut custom_seen = BTreeSet::new();
    for (name, text) in rendered() {
        let mut kept = Vec::new();
        for d in parse_docs(name, text) {
            let api_version = d.str_at("/apiVersion").to_string();
            if CUSTOM_RESOURCES
                .iter()
                .any(|(v, k, _)| *v == api_version && *k == d.kind())
            {
                custom_seen.insert(d.kind().to_string());
                if let Err(e) = check_typed(&d) {
                    problems.push(format!("{name}: {} {}: {e}", d.kind(), d.name()));
                }
                continue;
            }
            kept.push(serde_yaml_ng::to_string(&d.value).expect("yaml"));
        }
        let file = tmp.path().join(format!("{}.yaml", name.replace('/', "_")));
        std::fs::write(&file, kept.join("---\n")).expect("write");
        files.push(file);
    }
    for v in KUBERNETES_VERSIONS {
        let (ok, text) = kubernetes_validate(v, &files);
        // --quiet prints only failures and warnings; a kind without a schema is a
        // warning there, and a failure here (CUSTOM_RESOURCES lists the known ones).
        if !ok || !text.trim().is_empty() {
            problems.push(format!("Kubernetes {v}:\n{}", text.trim()));
        }
    }
    for (_, kind, _) in CUSTOM_RESOURCES {
        if !custom_seen.contains(*kind) {
            problems.push(format!(
                "CUSTOM_RESOURCES lists {kind}, which no overlay renders: drop it"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "{} problems (temporary files named after the overlays):\n  {}",
        problems.len(),
        problems.join("\n  ")
    );
}

/// Every container of every pod template (init containers too) with its pod.
fn all_containers<'a>(pods: &'a [Pod<'a>]) -> Vec<(&'a Pod<'a>, &'a Container)> {
    pods.iter()
        .flat_map(|p| {
            p.spec
                .containers
                .iter()
                .chain(p.spec.init_containers.iter().flatten())
                .map(move |c| (p, c))
        })
        .collect()
}

#[test]
fn every_pod_meets_the_restricted_pod_security_standard() {
    for (install, docs) in installs() {
        let pods = pods(&docs);
        let mut problems = Vec::new();
        for (pod, c) in all_containers(&pods) {
            let what = format!("{install}: {} {} container {}", pod.doc.kind(), pod.doc.name(), c.name);
            let psc = pod.spec.security_context.clone().unwrap_or_default();
            let sc = c.security_context.clone().unwrap_or_default();
            if sc.run_as_non_root.or(psc.run_as_non_root) != Some(true) {
                problems.push(format!("{what}: runAsNonRoot is not true"));
            }
            if sc.run_as_user.or(psc.run_as_user) == Some(0) {
                problems.push(format!("{what}: runs as uid 0"));
            }
            if sc.read_only_root_filesystem != Some(true) {
                problems.push(format!("{what}: readOnlyRootFilesystem is not true"));
            }
            if sc.allow_privilege_escalation != Some(false) {
                problems.push(format!("{what}: allowPrivilegeEscalation is not false"));
            }
            if sc.privileged == Some(true) {
                problems.push(format!("{what}: privileged"));
            }
            let caps = sc.capabilities.clone().unwrap_or_default();
            if list(&caps.drop) != ["ALL"] || !list(&caps.add).is_empty() {
                problems.push(format!("{what}: capabilities are not `drop: [ALL]` with none added"));
            }
            let seccomp = sc
                .seccomp_profile
                .as_ref()
                .or(psc.seccomp_profile.as_ref())
                .map(|p| p.type_.clone());
            if seccomp.as_deref() != Some("RuntimeDefault") {
                problems.push(format!("{what}: seccompProfile {seccomp:?}, not RuntimeDefault"));
            }
        }
        for pod in &pods {
            let what = format!("{install}: {} {}", pod.doc.kind(), pod.doc.name());
            let s = &pod.spec;
            if s.host_network == Some(true) || s.host_pid == Some(true) || s.host_ipc == Some(true) {
                problems.push(format!("{what}: shares a host namespace"));
            }
            for v in s.volumes.iter().flatten() {
                let allowed = v.secret.is_some()
                    || v.empty_dir.is_some()
                    || v.config_map.is_some()
                    || v.persistent_volume_claim.is_some()
                    || v.projected.is_some()
                    || v.downward_api.is_some();
                if !allowed {
                    problems.push(format!(
                        "{what}: volume {} is of a kind the restricted standard refuses",
                        v.name
                    ));
                }
            }
            // Admission enforces it too: the namespace says `restricted`.
            let ns: Namespace = find(&docs, "Namespace", pod.doc.namespace()).typed();
            let labels = ns.metadata.labels.unwrap_or_default();
            if labels.get("pod-security.kubernetes.io/enforce").map(String::as_str) != Some("restricted") {
                problems.push(format!(
                    "{what}: namespace {} does not enforce the restricted Pod Security Standard",
                    pod.doc.namespace()
                ));
            }
        }
        assert!(
            pods.len() >= 3,
            "{install}: the agent, the server and the bootstrap Job"
        );
        assert!(
            problems.is_empty(),
            "{} problems:\n  {}",
            problems.len(),
            problems.join("\n  ")
        );
    }
}

/// Whether the NetworkPolicy rule port `p` names container port `cp`.
fn names_port(
    p: &k8s_openapi::api::networking::v1::NetworkPolicyPort,
    cp: &k8s_openapi::api::core::v1::ContainerPort,
) -> bool {
    let protocol_ok = p.protocol.as_deref().unwrap_or("TCP") == cp.protocol.as_deref().unwrap_or("TCP");
    let port_ok = match &p.port {
        None => true,
        Some(IntOrString::Int(n)) => {
            *n == cp.container_port || p.end_port.is_some_and(|e| (*n..=e).contains(&cp.container_port))
        }
        Some(IntOrString::String(name)) => cp.name.as_deref() == Some(name.as_str()),
    };
    protocol_ok && port_ok
}

#[test]
fn every_port_a_container_listens_on_is_covered_by_a_network_policy() {
    for (install, docs) in installs() {
        let pods = pods(&docs);
        let containers = kvota_containers(&docs, &pods);
        let policies: Vec<(NetworkPolicy, &Doc)> = all_of(&docs, "NetworkPolicy");
        let mut problems = Vec::new();
        // What kvota listens on is declared: a port no containerPort names is one no
        // NetworkPolicy can name either.
        for k in &containers {
            let flags: &[(&str, &str)] = match k.subcommand().first().map(String::as_str) {
                Some("server") => &[
                    ("--listen", "127.0.0.1:7401"),
                    ("--raft-listen", "127.0.0.1:7601"),
                    ("--http", "127.0.0.1:7501"),
                ],
                Some("agent") => &[("--webhook-listen", "0.0.0.0:8443")],
                _ => &[],
            };
            for (flag, default) in flags {
                let port = listen_port(k, flag, default);
                if !k.container.ports.iter().flatten().any(|p| p.container_port == port) {
                    problems.push(format!(
                        "{install}: {} listens on {port} ({flag}), which no containerPort declares",
                        k.pod.doc.name()
                    ));
                }
            }
        }
        for (pod, c) in all_containers(&pods) {
            for cp in c.ports.iter().flatten() {
                let covered = policies.iter().any(|(np, d)| {
                    let spec = np.spec.clone().unwrap_or_default();
                    let ingress_policy = spec
                        .policy_types
                        .as_ref()
                        .map_or(spec.ingress.is_some(), |t| t.iter().any(|t| t == "Ingress"));
                    d.namespace() == pod.doc.namespace()
                        && ingress_policy
                        && selects(&spec.pod_selector.clone().unwrap_or_default(), &pod.labels)
                        && spec.ingress.iter().flatten().any(|rule| {
                            rule.ports
                                .as_ref()
                                .is_none_or(|ps| ps.is_empty() || ps.iter().any(|p| names_port(p, cp)))
                        })
                });
                if !covered {
                    problems.push(format!(
                        "{install}: {} {} port {} ({:?}) is reached by anyone: no NetworkPolicy names it",
                        pod.doc.kind(),
                        pod.doc.name(),
                        cp.container_port,
                        cp.name
                    ));
                }
            }
        }
        // Raft only from the control-plane pods; the webhook from the API server's CIDR.
        let server = server(&containers);
        let raft = listen_port(server, "--raft-listen", "127.0.0.1:7601");
        let raft_port = server
            .container
            .ports
            .iter()
            .flatten()
            .find(|p| p.container_port == raft)
            .cloned()
            .expect("raft port");
        for (np, d) in &policies {
            let spec = np.spec.clone().unwrap_or_default();
            if d.namespace() != server.pod.doc.namespace()
                || !selects(&spec.pod_selector.clone().unwrap_or_default(), &server.pod.labels)
            {
                continue;
            }
            for rule in spec.ingress.iter().flatten() {
                if rule
                    .ports
                    .as_ref()
                    .is_none_or(|ps| ps.is_empty() || ps.iter().any(|p| names_port(p, &raft_port)))
                {
                    let only_peers = rule.from.as_ref().is_some_and(|from| {
                        !from.is_empty()
                            && from.iter().all(|peer| {
                                peer.namespace_selector.is_none()
                                    && peer.ip_block.is_none()
                                    && peer
                                        .pod_selector
                                        .as_ref()
                                        .is_some_and(|s| selects(s, &server.pod.labels))
                            })
                    });
                    if !only_peers {
                        problems.push(format!(
                            "{install}: NetworkPolicy {} lets more than the control-plane pods reach Raft",
                            d.name()
                        ));
                    }
                }
            }
        }
        let agent = agent(&containers);
        let hook: NetworkPolicy = find(&docs, "NetworkPolicy", "kvota-agent-webhook").typed();
        let cidrs: Vec<String> = hook
            .spec
            .unwrap_or_default()
            .ingress
            .iter()
            .flatten()
            .flat_map(|r| {
                r.from
                    .iter()
                    .flatten()
                    .filter_map(|p| p.ip_block.as_ref().map(|b| b.cidr.clone()))
            })
            .collect();
        if cidrs.is_empty() {
            problems.push(format!(
                "{install}: the agent's webhook port is not limited to the API server's addresses"
            ));
        }
        assert!(!agent.container.ports.clone().unwrap_or_default().is_empty());
        assert!(
            problems.is_empty(),
            "{} problems:\n  {}",
            problems.len(),
            problems.join("\n  ")
        );
    }
}

#[test]
fn the_agent_and_the_control_plane_have_disruption_budgets() {
    for (install, docs) in installs() {
        let pods = pods(&docs);
        let containers = kvota_containers(&docs, &pods);
        let budgets: Vec<(PodDisruptionBudget, &Doc)> = all_of(&docs, "PodDisruptionBudget");
        for k in [agent(&containers), server(&containers)] {
            let replicas = k
                .pod
                .doc
                .value
                .pointer("/spec/replicas")
                .and_then(Value::as_i64)
                .unwrap_or(1);
            let what = format!(
                "{install}: {} {} ({replicas} replicas)",
                k.pod.doc.kind(),
                k.pod.doc.name()
            );
            assert!(
                replicas >= 2,
                "{what}: one replica cannot have a disruption budget that lets a drain through"
            );
            let mine: Vec<_> = budgets
                .iter()
                .filter(|(b, d)| {
                    d.namespace() == k.pod.doc.namespace()
                        && b.spec
                            .as_ref()
                            .and_then(|s| s.selector.as_ref())
                            .is_some_and(|s| selects(s, &k.pod.labels))
                })
                .collect();
            assert_eq!(
                mine.len(),
                1,
                "{what}: exactly one PodDisruptionBudget selects its pods"
            );
            let spec = mine[0].0.spec.clone().expect("spec");
            // At most one pod evicted at a time, and one may be: a quorum of three stays,
            // one agent replica keeps answering, and drains are never blocked.
            let allowed_down = match (&spec.max_unavailable, &spec.min_available) {
                (Some(IntOrString::Int(n)), None) => i64::from(*n),
                (None, Some(IntOrString::Int(n))) => replicas - i64::from(*n),
                other => panic!("{what}: give maxUnavailable or minAvailable as a number, not {other:?}"),
            };
            assert_eq!(allowed_down, 1, "{what}: its budget must allow exactly one pod down");
            assert_eq!(
                spec.unhealthy_pod_eviction_policy.as_deref(),
                Some("AlwaysAllow"),
                "{what}: a pod that is not ready must never block a drain"
            );
        }
    }
}

#[test]
fn the_image_is_named_once_and_monitoring_holds_the_alerts_and_the_dashboard() {
    // The image: `kvota` in base/, name and tag only in components/image.
    let mut files = Vec::new();
    yaml_files(&deploy_dir().join("base"), &mut files);
    for f in &files {
        let text = std::fs::read_to_string(f).expect("read");
        for line in text.lines().filter(|l| l.trim_start().starts_with("image:")) {
            assert_eq!(
                line.trim(),
                "image: kvota",
                "{}: the image's name and tag are set in components/image only",
                f.display()
            );
        }
    }
    let mut images = BTreeSet::new();
    for (_, docs) in installs() {
        let pods = pods(&docs);
        for (_, c) in all_containers(&pods) {
            images.insert(c.image.clone().unwrap_or_default());
        }
    }
    assert_eq!(images.len(), 1, "every pod runs the one kvota image: {images:?}");
    let component: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(deploy_dir().join("components/image/kustomization.yaml")).expect("components/image"),
    )
    .expect("yaml");
    let image = &component["images"][0];
    let expected = format!(
        "{}:{}",
        image["newName"].as_str().unwrap_or(""),
        image["newTag"].as_str().unwrap_or("")
    );
    assert!(
        images.contains(&expected),
        "{images:?} is not components/image's {expected}"
    );

    // The PrometheusRule is deploy/prometheus/alerts.yaml (overlays/observability/sync-alerts).
    let alerts: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(repo().join("deploy/prometheus/alerts.yaml")).expect("alerts.yaml"),
    )
    .expect("alerts.yaml");
    let docs = parse_docs("overlays/observability", &rendered()["overlays/observability"]);
    let rule = find(&docs, "PrometheusRule", "kvota");
    assert_eq!(
        rule.value["spec"], alerts,
        "PrometheusRule kvota differs from deploy/prometheus/alerts.yaml: run deploy/kubernetes/overlays/observability/sync-alerts"
    );
    // The dashboard ConfigMap is deploy/grafana/kvota-dashboard.json, for Grafana's sidecar.
    let dashboard: ConfigMap = find(&docs, "ConfigMap", "kvota-grafana-dashboard").typed();
    let json = std::fs::read_to_string(repo().join("deploy/grafana/kvota-dashboard.json")).expect("dashboard");
    assert_eq!(
        dashboard.data.unwrap_or_default().get("kvota-dashboard.json"),
        Some(&json)
    );
    assert_eq!(
        dashboard
            .metadata
            .labels
            .unwrap_or_default()
            .get("grafana_dashboard")
            .map(String::as_str),
        Some("1")
    );

    // The ServiceMonitors scrape every node and agent replica on the port that serves
    // /metrics, with a client certificate (/metrics answers viewers only).
    for (_, docs) in installs() {
        let pods = pods(&docs);
        let containers = kvota_containers(&docs, &pods);
        for (monitor, k, listen) in [
            (
                "kvota-server",
                server(&containers),
                listen_port(server(&containers), "--http", "127.0.0.1:7501"),
            ),
            (
                "kvota-agent",
                agent(&containers),
                listen_port(agent(&containers), "--webhook-listen", "0.0.0.0:8443"),
            ),
        ] {
            let sm: ServiceMonitor = find(&docs, "ServiceMonitor", monitor).typed();
            let ns = find(&docs, "ServiceMonitor", monitor).namespace().to_string();
            let services: Vec<(Service, &Doc)> = all_of(&docs, "Service");
            let picked: Vec<&(Service, &Doc)> = services
                .iter()
                .filter(|(_, d)| {
                    d.namespace() == ns
                        && selects(
                            &sm.spec.selector,
                            &d.value["metadata"]["labels"]
                                .as_object()
                                .map(|m| {
                                    m.iter()
                                        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string()))
                                        .collect()
                                })
                                .unwrap_or_default(),
                        )
                })
                .collect();
            assert_eq!(
                picked.len(),
                1,
                "ServiceMonitor {monitor} selects one Service, not {}",
                picked.len()
            );
            let (svc, svc_doc) = picked[0];
            let spec = svc.spec.clone().expect("spec");
            assert_eq!(
                spec.publish_not_ready_addresses,
                Some(true),
                "Service {}: nodes and replicas that are not ready are scraped too",
                svc_doc.name()
            );
            assert_eq!(sm.spec.endpoints.len(), 1);
            let e = &sm.spec.endpoints[0];
            assert!(
                e.scheme == MonitorScheme::Https && e.path == "/metrics",
                "ServiceMonitor {monitor}: https /metrics"
            );
            let sp = spec
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(e.port.as_str()))
                .expect("the endpoint's port is a port of the Service");
            let target = sp.target_port.clone().unwrap_or(IntOrString::Int(sp.port));
            let selector = LabelSelector {
                match_labels: spec.selector.clone(),
                match_expressions: None,
            };
            assert!(
                selects(&selector, &k.pod.labels),
                "Service {}: selects every pod of {}",
                svc_doc.name(),
                k.pod.doc.name()
            );
            assert_eq!(
                container_port(&k.container, &target),
                Some(listen),
                "ServiceMonitor {monitor}: {target:?} is where /metrics is served"
            );
            let tls = e.tls_config.as_ref().expect("tlsConfig");
            assert!(
                tls.cert.is_some()
                    && tls.key_secret.is_some()
                    && tls.ca.is_some()
                    && tls.insecure_skip_verify.is_none(),
                "ServiceMonitor {monitor}: mutual TLS, verified"
            );
        }
    }
}

// ---- Renewing the webhook certificate and rotating its CA, with the real agent.

/// The certificate (DER) the agent on `port` serves, if it verifies against the bundle
/// `ca` for `name`, as the API server holding that caBundle would verify it.
async fn served_certificate(port: u16, ca: &Path, name: &str) -> Result<Vec<u8>, String> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let stream = tls_connect(tcp, ca, name).await?;
    let (_, conn) = stream.get_ref();
    conn.peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .ok_or_else(|| "no certificate".to_string())
}

fn certificate_of(pem: &Path) -> Vec<u8> {
    CertificateDer::from_pem_file(pem)
        .unwrap_or_else(|e| panic!("{}: {e}", pem.display()))
        .to_vec()
}

/// Waits until the agent serves the certificate in `expected` (it rereads its files
/// every 2 s), checking on every connection meanwhile, old certificate or new, that
/// what it serves verifies against each of `bundles`: each caBundle the API server may
/// hold at that moment.
async fn until_serves(port: u16, expected: &Path, bundles: &[&Path], name: &str, log: &Path) {
    let want = certificate_of(expected);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut connections = 0;
    loop {
        let mut served = Vec::new();
        for b in bundles {
            served = served_certificate(port, b, name).await.unwrap_or_else(|e| {
                panic!(
                    "after {connections} good connections, the agent's certificate fails caBundle {}: {e}\nagent log:\n{}",
                    b.display(),
                    std::fs::read_to_string(log).unwrap_or_default()
                )
            });
            connections += 1;
        }
        if served == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the agent did not load {} within 30 s",
            expected.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn make_webhook_cert(args: &[&str], ca_dir: &Path, out: &Path) -> std::process::Output {
    Command::new("bash")
        .arg(deploy_dir().join("make-webhook-cert"))
        .args(args)
        .arg("--ca-dir")
        .arg(ca_dir)
        .arg("--out")
        .arg(out)
        .output()
        .expect("run make-webhook-cert")
}

fn certificates_in(pem: &Path) -> usize {
    CertificateDer::pem_file_iter(pem).map(|i| i.count()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewing_the_webhook_certificate_and_rotating_its_ca_never_break_the_api_servers_trust() {
    use std::os::unix::fs::PermissionsExt;
    if Command::new("openssl").arg("version").output().is_err() {
        panic!("openssl is needed by deploy/kubernetes/make-webhook-cert and this test: apt-get install openssl");
    }
    let tmp = tempfile::tempdir().expect("tmp");
    let (ca_dir, out) = (tmp.path().join("webhook-ca"), tmp.path().join("cert"));
    let run = |args: &[&str]| {
        let r = make_webhook_cert(args, &ca_dir, &out);
        assert!(
            r.status.success(),
            "make-webhook-cert {args:?} failed: {}",
            String::from_utf8_lossy(&r.stderr)
        );
    };
    // A copy of each caBundle the API server is given, step by step.
    let keep = |name: &str| {
        let p = tmp.path().join(name);
        std::fs::copy(out.join("ca.crt"), &p).expect("copy the bundle");
        p
    };
    // webhooks.yaml always carries the bundle of ca.crt.
    let check_rendered = |step: &str| {
        let bundle = std::fs::read(out.join("ca.crt")).expect("ca.crt");
        for h in hooks(&documents_under(&out)) {
            assert_eq!(
                h.client.ca_bundle.as_ref().map(|b| b.0.clone()),
                Some(bundle.clone()),
                "{step}: {} caBundle",
                h.name
            );
        }
    };

    run(&["--days", "2"]);
    // The CA key stays where the operator said, private; never beside the outputs.
    assert_eq!(
        std::fs::metadata(&ca_dir).expect("ca dir").permissions().mode() & 0o777,
        0o700
    );
    assert_eq!(
        std::fs::metadata(ca_dir.join("ca.key"))
            .expect("ca.key")
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    assert!(
        !out.join("ca.key").exists() && !out.join("ca").exists(),
        "no CA key in --out"
    );
    let b0 = keep("bundle-0.crt");
    assert_eq!(certificates_in(&b0), 1);
    check_rendered("first run");

    let dns = "kvota-agent.kvota-system.svc";
    let port = free_ports(1)[0];
    let log = tmp.path().join("agent.log");
    let agent_proc = kvota()
        .args(["agent", "--cluster", "east", "--simulate", "1x8", "--cp", "127.0.0.1:1"])
        .arg(format!("--webhook-listen=127.0.0.1:{port}"))
        .arg("--tls-cert")
        .arg(out.join("tls.crt"))
        .arg("--tls-key")
        .arg(out.join("tls.key"))
        .arg("--data-dir")
        .arg(tmp.path().join("agent"))
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(&log).expect("log")))
        .spawn()
        .expect("spawn agent");
    let _procs = Procs::of([agent_proc]);
    until_answers("the agent", port, Some((b0.as_path(), dns)), "/healthz", &log).await;
    until_serves(port, &out.join("tls.crt"), &[&b0], dns, &log).await;

    // Renewal: a new certificate from the same CA; caBundle does not change, so the API
    // server trusts the old certificate and the new one alike.
    let before = certificate_of(&out.join("tls.crt"));
    run(&["--days", "2", "--force"]);
    assert_ne!(
        certificate_of(&out.join("tls.crt")),
        before,
        "--force issues a new certificate"
    );
    assert_eq!(
        std::fs::read(out.join("ca.crt")).expect("ca.crt"),
        std::fs::read(&b0).expect("b0"),
        "renewal keeps caBundle"
    );
    check_rendered("renewal");
    until_serves(port, &out.join("tls.crt"), &[&b0], dns, &log).await;

    // Dropping an old CA is refused while no rotation is under way.
    assert!(!make_webhook_cert(&["--drop-old-ca"], &ca_dir, &out).status.success());

    // CA rotation, step 1: a new CA; caBundle holds old and new; the served certificate
    // is untouched, so it verifies against the caBundle before and after the change.
    let served = certificate_of(&out.join("tls.crt"));
    run(&["--rotate-ca"]);
    let b1 = keep("bundle-1.crt");
    assert_eq!(certificates_in(&b1), 2, "the bundle holds the old and the new CA");
    assert!(
        std::fs::read_to_string(&b1)
            .expect("b1")
            .starts_with(&std::fs::read_to_string(&b0).expect("b0")),
        "the old CA stays in the bundle"
    );
    assert_eq!(
        certificate_of(&out.join("tls.crt")),
        served,
        "--rotate-ca leaves the served certificate alone"
    );
    check_rendered("rotation step 1");
    until_serves(port, &out.join("tls.crt"), &[&b0, &b1], dns, &log).await;
    // A second rotation, or dropping the old CA before the certificate is the new CA's,
    // is refused (the latter would leave the agent with a certificate caBundle refuses).
    assert!(
        !make_webhook_cert(&["--rotate-ca"], &ca_dir, &out).status.success(),
        "one rotation at a time"
    );
    let early = make_webhook_cert(&["--drop-old-ca"], &ca_dir, &out);
    assert!(
        !early.status.success(),
        "--drop-old-ca before a certificate of the new CA must fail"
    );
    assert_eq!(
        std::fs::read(out.join("ca.crt")).expect("ca.crt"),
        std::fs::read(&b1).expect("b1"),
        "a refused step changes nothing"
    );

    // Step 2: the certificate from the new CA, caBundle unchanged (both CAs).
    run(&["--days", "2", "--force"]);
    assert_eq!(
        std::fs::read(out.join("ca.crt")).expect("ca.crt"),
        std::fs::read(&b1).expect("b1"),
        "step 2 keeps caBundle"
    );
    check_rendered("rotation step 2");
    until_serves(port, &out.join("tls.crt"), &[&b1], dns, &log).await;
    // (Why step 2 waits until the API server has the bundle of step 1: the old one
    // refuses the new certificate.)
    assert!(
        served_certificate(port, &b0, dns).await.is_err(),
        "a certificate of the new CA fails the old caBundle"
    );

    // Step 3: the old CA leaves the bundle; the served certificate verifies against the
    // bundle of step 1 and of step 3.
    run(&["--drop-old-ca"]);
    let b2 = keep("bundle-2.crt");
    assert_eq!(certificates_in(&b2), 1);
    assert_eq!(
        std::fs::read(&b2).expect("b2"),
        std::fs::read(ca_dir.join("ca.crt")).expect("new CA"),
        "the bundle is the new CA"
    );
    check_rendered("rotation step 3");
    until_serves(port, &out.join("tls.crt"), &[&b1, &b2], dns, &log).await;

    // And the next renewal comes from the new CA under the same caBundle.
    run(&["--days", "2", "--force"]);
    assert_eq!(
        std::fs::read(out.join("ca.crt")).expect("ca.crt"),
        std::fs::read(&b2).expect("b2")
    );
    until_serves(port, &out.join("tls.crt"), &[&b2], dns, &log).await;
    let secret: Secret = find(&documents_under(&out), "Secret", "kvota-agent-tls").typed();
    let data = secret.data.expect("data");
    assert_eq!(
        data.get("tls.crt").map(|b| b.0.clone()),
        Some(std::fs::read(out.join("tls.crt")).expect("tls.crt"))
    );
    assert_eq!(
        data.get("ca.crt").map(|b| b.0.clone()),
        Some(std::fs::read(&b2).expect("b2"))
    );
}
