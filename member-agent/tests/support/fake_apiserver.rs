//! A small fake Kubernetes API server over plain HTTP on loopback, for the agent's
//! Kubernetes tests (no real API server can run on this machine). It speaks the parts
//! of the API the agent uses, with the semantics that matter:
//!
//! - list and watch of Pods (all namespaces), Nodes and Namespaces, with resource
//!   versions; a watch from a version older than the retained history gets `410 Gone`
//!   (an `ERROR` event carrying an `Expired` Status), as after etcd compaction;
//! - GET and merge-PATCH of a pod, honouring a `metadata.resourceVersion` precondition
//!   (409 Conflict when stale);
//! - the Eviction subresource: 429 while a namespace's "PodDisruptionBudget" forbids it,
//!   otherwise the pod is deleted;
//! - Event creation; Lease and ConfigMap get/create/replace with optimistic concurrency;
//! - cluster-scoped `FairnessPolicy` resources in both API groups (`kvota.dev` and the
//!   article's `kvitej.io`): list, get, and merge-PATCH of the `status` subresource
//!   (which, as in Kubernetes, changes status only, never spec or generation).
//!
//! Tests change the cluster through [`FakeApi`]'s methods, compact history, and cut
//! every open watch to force reconnects.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde_json::{json, Value};
use tokio::sync::broadcast;

/// Object kinds the fake serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Pod,
    Node,
    Namespace,
    Event,
    Lease,
    ConfigMap,
    /// `fairnesspolicies.kvota.dev`
    FairnessPolicy,
    /// `fairnesspolicies.kvitej.io`
    ArticlePolicy,
}

impl Kind {
    fn api_version(self) -> &'static str {
        match self {
            Kind::Lease => "coordination.k8s.io/v1",
            Kind::FairnessPolicy => "kvota.dev/v1alpha1",
            Kind::ArticlePolicy => "kvitej.io/v1alpha1",
            _ => "v1",
        }
    }
    fn name(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::Node => "Node",
            Kind::Namespace => "Namespace",
            Kind::Event => "Event",
            Kind::Lease => "Lease",
            Kind::ConfigMap => "ConfigMap",
            Kind::FairnessPolicy | Kind::ArticlePolicy => "FairnessPolicy",
        }
    }
}

#[derive(Default)]
struct Store {
    rv: u64,
    objects: BTreeMap<(Kind, String), Value>,
    /// (rv, kind, type, object) since `compacted`.
    history: Vec<(u64, Kind, &'static str, Value)>,
    compacted: u64,
    pdb_blocked: BTreeSet<String>,
    requests: Vec<String>,
    generated: u64,
    hold_watches: bool,
    gone_served: u64,
    status_patches: u64,
    unserved: BTreeSet<Kind>,
}

#[derive(Clone)]
pub struct FakeApi {
    store: Arc<Mutex<Store>>,
    events: broadcast::Sender<(u64, Kind, &'static str, Value)>,
    cut: broadcast::Sender<()>,
    pub url: String,
}

fn key_of(v: &Value) -> String {
    let meta = &v["metadata"];
    let name = meta["name"].as_str().unwrap_or("");
    match meta["namespace"].as_str() {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_string(),
    }
}

fn status(code: u16, reason: &str, message: &str) -> Response {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                      "message": message, "reason": reason, "code": code});
    (
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        axum::Json(body),
    )
        .into_response()
}

fn merge_patch(target: &mut Value, patch: &Value) {
    match (target.as_object_mut(), patch.as_object()) {
        (Some(t), Some(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        // RFC 7386: a mapping merged over anything else starts from an empty one (so
        // its nulls are dropped, not stored).
        (_, Some(_)) => {
            *target = json!({});
            merge_patch(target, patch);
        }
        _ => *target = patch.clone(),
    }
}

impl FakeApi {
    /// Starts the server on an ephemeral loopback port.
    pub async fn start() -> FakeApi {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind fake API server");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let (events, _) = broadcast::channel(4096);
        let (cut, _) = broadcast::channel(16);
        let api = FakeApi {
            store: Arc::new(Mutex::new(Store::default())),
            events,
            cut,
            url,
        };
        let app = Router::new().fallback(handle).with_state(api.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        api
    }

    /// A kube client for this server, configured as the agent's actions client (no
    /// automatic retries).
    pub fn client(&self) -> kube::Client {
        let config = kvota_member_agent::kube::actions_config(kube::Config::new(self.url.parse().expect("url")));
        kube::Client::try_from(config).expect("kube client")
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn emit(&self, s: &mut Store, kind: Kind, ty: &'static str, obj: Value) {
        s.history.push((s.rv, kind, ty, obj.clone()));
        let _ = self.events.send((s.rv, kind, ty, obj));
    }

    /// Creates or replaces an object (test side); returns its new resourceVersion.
    pub fn put(&self, kind: Kind, mut obj: Value) -> u64 {
        let mut s = self.lock();
        s.rv += 1;
        let rv = s.rv;
        obj["apiVersion"] = json!(kind.api_version());
        obj["kind"] = json!(kind.name());
        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
        if obj["metadata"]["uid"].is_null() {
            obj["metadata"]["uid"] = json!(format!("uid-{rv}"));
        }
        let key = (kind, key_of(&obj));
        let ty = if s.objects.contains_key(&key) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        s.objects.insert(key, obj.clone());
        self.emit(&mut s, kind, ty, obj);
        rv
    }

    /// Deletes an object (test side).
    pub fn delete(&self, kind: Kind, key: &str) -> bool {
        let mut s = self.lock();
        let Some(mut obj) = s.objects.remove(&(kind, key.to_string())) else {
            return false;
        };
        s.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(s.rv.to_string());
        self.emit(&mut s, kind, "DELETED", obj);
        true
    }

    /// An object as stored.
    pub fn get(&self, kind: Kind, key: &str) -> Option<Value> {
        self.lock().objects.get(&(kind, key.to_string())).cloned()
    }

    /// Every object of a kind.
    pub fn all(&self, kind: Kind) -> Vec<Value> {
        self.lock()
            .objects
            .iter()
            .filter(|((k, _), _)| *k == kind)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Forgets the watch history (as etcd compaction does): watches from older versions
    /// get 410 Gone.
    pub fn compact(&self) {
        let mut s = self.lock();
        s.history.clear();
        s.compacted = s.rv;
    }

    /// Ends every open watch stream (clients reconnect from their last version).
    pub fn cut_watches(&self) {
        let _ = self.cut.send(());
    }

    /// While held, watch requests get 503 (the client backs off and retries), as when the
    /// agent cannot reach the API server.
    pub fn hold_watches(&self, hold: bool) {
        self.lock().hold_watches = hold;
    }

    /// Watches answered with 410 Gone so far.
    pub fn gone_served(&self) -> u64 {
        self.lock().gone_served
    }

    /// Makes evictions in `namespace` fail with 429 (a PodDisruptionBudget) or succeed.
    pub fn set_pdb_blocked(&self, namespace: &str, blocked: bool) {
        let mut s = self.lock();
        if blocked {
            s.pdb_blocked.insert(namespace.to_string());
        } else {
            s.pdb_blocked.remove(namespace);
        }
    }

    /// Stops (or resumes) serving a kind, as when its CRD is not installed: 404.
    pub fn set_served(&self, kind: Kind, served: bool) {
        let mut s = self.lock();
        if served {
            s.unserved.remove(&kind);
        } else {
            s.unserved.insert(kind);
        }
    }

    /// Status-subresource patches served so far.
    pub fn status_patches(&self) -> u64 {
        self.lock().status_patches
    }

    /// Requests served so far, as `METHOD path?query`.
    pub fn requests(&self) -> Vec<String> {
        self.lock().requests.clone()
    }
}

/// What a path names.
enum Target {
    Collection(Kind, Option<String>),
    Object(Kind, String),
    Eviction(String),
    Status(Kind, String),
}

fn route(path: &str) -> Option<Target> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    match parts.as_slice() {
        ["api", "v1", "pods"] => Some(Target::Collection(Kind::Pod, None)),
        ["api", "v1", "nodes"] => Some(Target::Collection(Kind::Node, None)),
        ["api", "v1", "nodes", n] => Some(Target::Object(Kind::Node, (*n).to_string())),
        ["api", "v1", "namespaces"] => Some(Target::Collection(Kind::Namespace, None)),
        ["api", "v1", "namespaces", n] => Some(Target::Object(Kind::Namespace, (*n).to_string())),
        ["api", "v1", "namespaces", ns, "pods"] => Some(Target::Collection(Kind::Pod, Some((*ns).to_string()))),
        ["api", "v1", "namespaces", ns, "pods", n] => Some(Target::Object(Kind::Pod, format!("{ns}/{n}"))),
        ["api", "v1", "namespaces", ns, "pods", n, "eviction"] => Some(Target::Eviction(format!("{ns}/{n}"))),
        ["api", "v1", "namespaces", ns, "events"] => Some(Target::Collection(Kind::Event, Some((*ns).to_string()))),
        ["api", "v1", "namespaces", ns, "configmaps"] => {
            Some(Target::Collection(Kind::ConfigMap, Some((*ns).to_string())))
        }
        ["api", "v1", "namespaces", ns, "configmaps", n] => Some(Target::Object(Kind::ConfigMap, format!("{ns}/{n}"))),
        ["apis", "coordination.k8s.io", "v1", "namespaces", ns, "leases"] => {
            Some(Target::Collection(Kind::Lease, Some((*ns).to_string())))
        }
        ["apis", "coordination.k8s.io", "v1", "namespaces", ns, "leases", n] => {
            Some(Target::Object(Kind::Lease, format!("{ns}/{n}")))
        }
        ["apis", group @ ("kvota.dev" | "kvitej.io"), "v1alpha1", "fairnesspolicies", rest @ ..] => {
            let kind = if *group == "kvota.dev" {
                Kind::FairnessPolicy
            } else {
                Kind::ArticlePolicy
            };
            match rest {
                [] => Some(Target::Collection(kind, None)),
                [n] => Some(Target::Object(kind, (*n).to_string())),
                [n, "status"] => Some(Target::Status(kind, (*n).to_string())),
                _ => None,
            }
        }
        _ => None,
    }
}

fn query_map(q: Option<&str>) -> BTreeMap<String, String> {
    q.unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
        .collect()
}

async fn handle(State(api): State<FakeApi>, req: Request) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = query_map(req.uri().query());
    api.lock().requests.push(format!("{method} {}", req.uri()));
    let body = match axum::body::to_bytes(req.into_body(), 8 << 20).await {
        Ok(b) => b,
        Err(_) => return status(400, "BadRequest", "body unreadable"),
    };
    let Some(target) = route(&path) else {
        return status(404, "NotFound", &format!("no route {path}"));
    };
    let kind_of_target = match &target {
        Target::Collection(k, _) | Target::Object(k, _) | Target::Status(k, _) => Some(*k),
        Target::Eviction(_) => None,
    };
    if kind_of_target.is_some_and(|k| api.lock().unserved.contains(&k)) {
        return status(404, "NotFound", "the server could not find the requested resource");
    }
    match (method, target) {
        (Method::GET, Target::Collection(kind, ns)) => {
            if query.get("watch").is_some_and(|w| w == "true" || w == "1") {
                let from: u64 = query.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
                let timeout = query
                    .get("timeoutSeconds")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(290u64);
                watch(api, kind, ns, from, timeout)
            } else {
                list(&api, kind, ns.as_deref())
            }
        }
        (Method::GET, Target::Object(kind, key)) => match api.get(kind, &key) {
            Some(v) => axum::Json(v).into_response(),
            None => status(404, "NotFound", &format!("{} \"{key}\" not found", kind.name())),
        },
        (Method::PATCH, Target::Object(Kind::Pod, key)) => {
            let Ok(patch) = serde_json::from_slice::<Value>(&body) else {
                return status(400, "BadRequest", "patch not JSON");
            };
            let Some(mut pod) = api.get(Kind::Pod, &key) else {
                return status(404, "NotFound", "pod not found");
            };
            if let Some(want) = patch["metadata"]["resourceVersion"].as_str() {
                if pod["metadata"]["resourceVersion"].as_str() != Some(want) {
                    return status(
                        409,
                        "Conflict",
                        "the object has been modified; please apply your changes to the latest version and try again",
                    );
                }
            }
            let mut patch = patch;
            if let Some(m) = patch["metadata"].as_object_mut() {
                m.remove("resourceVersion");
            }
            merge_patch(&mut pod, &patch);
            api.put(Kind::Pod, pod);
            axum::Json(api.get(Kind::Pod, &key)).into_response()
        }
        (Method::POST, Target::Eviction(key)) => {
            let ns = key.split('/').next().unwrap_or("").to_string();
            if api.get(Kind::Pod, &key).is_none() {
                return status(404, "NotFound", "pod not found");
            }
            if api.lock().pdb_blocked.contains(&ns) {
                return status(
                    429,
                    "TooManyRequests",
                    "Cannot evict pod as it would violate the pod's disruption budget.",
                );
            }
            api.delete(Kind::Pod, &key);
            let ok = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201});
            (StatusCode::CREATED, axum::Json(ok)).into_response()
        }
        (Method::POST, Target::Collection(kind @ (Kind::Event | Kind::Lease | Kind::ConfigMap), Some(ns))) => {
            let Ok(mut obj) = serde_json::from_slice::<Value>(&body) else {
                return status(400, "BadRequest", "not JSON");
            };
            obj["metadata"]["namespace"] = json!(ns);
            if obj["metadata"]["name"].is_null() {
                let n = {
                    let mut s = api.lock();
                    s.generated += 1;
                    s.generated
                };
                let base = obj["metadata"]["generateName"].as_str().unwrap_or("obj-").to_string();
                obj["metadata"]["name"] = json!(format!("{base}{n}"));
            }
            let key = key_of(&obj);
            if api.get(kind, &key).is_some() {
                return status(
                    409,
                    "AlreadyExists",
                    &format!("{} \"{key}\" already exists", kind.name()),
                );
            }
            api.put(kind, obj);
            (StatusCode::CREATED, axum::Json(api.get(kind, &key))).into_response()
        }
        (Method::PUT, Target::Object(kind @ (Kind::Lease | Kind::ConfigMap), key)) => {
            let Ok(obj) = serde_json::from_slice::<Value>(&body) else {
                return status(400, "BadRequest", "not JSON");
            };
            let Some(cur) = api.get(kind, &key) else {
                return status(404, "NotFound", &format!("{} not found", kind.name()));
            };
            if obj["metadata"]["resourceVersion"] != cur["metadata"]["resourceVersion"] {
                return status(
                    409,
                    "Conflict",
                    "the object has been modified; please apply your changes to the latest version and try again",
                );
            }
            api.put(kind, obj);
            axum::Json(api.get(kind, &key)).into_response()
        }
        (Method::PATCH, Target::Status(kind, key)) => {
            let Ok(patch) = serde_json::from_slice::<Value>(&body) else {
                return status(400, "BadRequest", "patch not JSON");
            };
            let Some(mut obj) = api.get(kind, &key) else {
                return status(404, "NotFound", &format!("{} \"{key}\" not found", kind.name()));
            };
            // A resourceVersion in the patch is a precondition, as in Kubernetes.
            if let Some(want) = patch["metadata"]["resourceVersion"].as_str() {
                if obj["metadata"]["resourceVersion"].as_str() != Some(want) {
                    return status(
                        409,
                        "Conflict",
                        "the object has been modified; please apply your changes to the latest version and try again",
                    );
                }
            }
            // The status subresource takes status only.
            let mut only = json!({});
            if let Some(st) = patch.get("status") {
                only["status"] = st.clone();
            }
            merge_patch(&mut obj, &only);
            api.put(kind, obj);
            api.lock().status_patches += 1;
            axum::Json(api.get(kind, &key)).into_response()
        }
        (m, _) => status(
            405,
            "MethodNotAllowed",
            &format!("{m} {path} is not served by the fake"),
        ),
    }
}

fn in_scope(v: &Value, ns: Option<&str>) -> bool {
    ns.is_none_or(|ns| v["metadata"]["namespace"].as_str() == Some(ns))
}

fn list(api: &FakeApi, kind: Kind, ns: Option<&str>) -> Response {
    let s = api.lock();
    let items: Vec<Value> = s
        .objects
        .iter()
        .filter(|((k, _), v)| *k == kind && in_scope(v, ns))
        .map(|(_, v)| v.clone())
        .collect();
    let body = json!({"kind": format!("{}List", kind.name()), "apiVersion": kind.api_version(),
                      "metadata": {"resourceVersion": s.rv.to_string()}, "items": items});
    axum::Json(body).into_response()
}

fn line(ty: &str, obj: &Value) -> Result<Bytes, Infallible> {
    let mut b = serde_json::to_vec(&json!({"type": ty, "object": obj})).unwrap_or_default();
    b.push(b'\n');
    Ok(Bytes::from(b))
}

fn watch(api: FakeApi, kind: Kind, ns: Option<String>, from: u64, timeout_s: u64) -> Response {
    let (backlog, live, cut) = {
        let mut s = api.lock();
        // Checked under the same lock as the subscription to `cut` below: a watch either
        // started before `hold_watches(true)` (and is ended by a later `cut_watches`) or
        // is refused; none slips in between and sees events a test meant to hide.
        if s.hold_watches {
            return status(503, "ServiceUnavailable", "the fake API server holds watches");
        }
        if from < s.compacted {
            s.gone_served += 1;
            let gone = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                              "message": format!("too old resource version: {from} ({})", s.compacted),
                              "reason": "Expired", "code": 410});
            let body = Body::from_stream(futures::stream::iter([line("ERROR", &gone)]));
            return (StatusCode::OK, body).into_response();
        }
        let backlog: Vec<Result<Bytes, Infallible>> = s
            .history
            .iter()
            .filter(|(rv, k, _, v)| *rv > from && *k == kind && in_scope(v, ns.as_deref()))
            .map(|(_, _, ty, v)| line(ty, v))
            .collect();
        (backlog, api.events.subscribe(), api.cut.subscribe())
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout_s.max(1));
    let live = futures::stream::unfold((live, cut, ns, from), move |(mut live, mut cut, ns, from)| async move {
        loop {
            tokio::select! {
                // A cut comes first: a test cuts watches and then changes the cluster,
                // and under load both are ready by the time this stream is polled; an
                // unbiased select sometimes delivered the changes before ending the watch
                // (1 run in 15 with both cores busy), so the 410 test saw no relist.
                biased;
                _ = cut.recv() => return None,
                _ = tokio::time::sleep_until(deadline) => return None,
                ev = live.recv() => match ev {
                    Ok((rv, k, ty, v)) if rv > from && k == kind && in_scope(&v, ns.as_deref()) => {
                        return Some((line(ty, &v), (live, cut, ns, from)));
                    }
                    Ok(_) => continue,
                    Err(_) => return None,
                },
            }
        }
    });
    let body = Body::from_stream(futures::StreamExt::chain(futures::stream::iter(backlog), live));
    (StatusCode::OK, body).into_response()
}
