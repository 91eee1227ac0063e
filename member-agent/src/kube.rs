//! The agent's Kubernetes side (kube-rs).
//!
//! - [`KubeInventory`]: Nodes, Pods and Namespaces from watchers (list, then watch; a
//!   relist after `410 Gone` or a broken stream, with backoff), turned into the
//!   [`Inventory`] every other part of the agent reads.
//! - [`KubeActions`]: what the agent does to the cluster: remove kvota's scheduling gate
//!   (the gate controller), evict through the Eviction API (PodDisruptionBudgets are
//!   honoured by the API server: a `429` is "blocked, retry later"), and record a
//!   Kubernetes Event on a pod.
//! - [`Election`]: which of several agent replicas in one cluster is the leader, through
//!   a `coordination.k8s.io/v1` Lease. Only the leader admits, reports usage, releases
//!   gates and reclaims; a standby answers reviews with a retryable denial and is not
//!   ready (so a Service sends it nothing). See `docs/ARCHITECTURE.md`.
//!
//! Objects are read as JSON through the same code the webhook uses for pods
//! ([`crate::review::pod_resources`]), so a pod's GPUe is computed one way everywhere.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease as KubeLease;
use k8s_openapi::api::core::v1::{Event as KubeEvent, Namespace, Node, Pod};
use kube::api::{Api, EvictParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Client;
use kvota_fairness::admission::SCHEDULING_GATE;
use kvota_fairness::resources::{effective_requests_milli, pod_gpue, ResourceWeights};
use kvota_fairness::Millis;
use serde_json::{json, Value};
use tokio::sync::watch as tokio_watch;

use crate::inventory::{EvictOutcome, Inventory, NodeInfo, PodInfo, PodStage};

/// Seconds since the Unix epoch now.
fn wall_now_s() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// Parses an RFC 3339 UTC timestamp as Kubernetes writes them (`2026-12-03T10:00:00Z`,
/// optionally with fractional seconds) into Unix seconds.
pub fn parse_time(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || b[13] != b':' || b[16] != b':' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
    let (y, mo, d, h, mi, se) = (num(0..4)?, num(5..7)?, num(8..10)?, num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || se > 60 {
        return None;
    }
    if !s.ends_with('Z') {
        return None;
    }
    // Days from the civil date (proleptic Gregorian), 1970-01-01 = 0.
    let yy = if mo <= 2 { y - 1 } else { y };
    let era = yy.div_euclid(400);
    let yoe = yy - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + h * 3600 + mi * 60 + se)
}

/// Formats Unix seconds as RFC 3339 UTC (`2026-12-03T10:00:00Z`).
pub fn format_time(t: i64) -> String {
    let days = t.div_euclid(86_400);
    let secs = t.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", secs / 3600, secs % 3600 / 60, secs % 60)
}

/// Agent-clock time of a wall-clock timestamp `at_s`, given both clocks now.
fn to_agent_clock(at_s: Option<i64>, wall_now_s: i64, agent_now_ms: Millis) -> Millis {
    let Some(at) = at_s else { return agent_now_ms };
    let ago_ms = u64::try_from(wall_now_s.saturating_sub(at)).unwrap_or(0).saturating_mul(1000);
    agent_now_ms.saturating_sub(ago_ms)
}

/// A pod object (JSON) as the inventory keeps it; `None` when it asks for no GPU or
/// cannot be read (a pod with a quantity Kubernetes would reject asks for nothing we
/// can count; the webhook judged it already).
pub fn pod_info(pod: &Value, wall_now_s: i64, agent_now_ms: Millis) -> Option<PodInfo> {
    let meta = pod.get("metadata")?;
    let namespace = meta.get("namespace")?.as_str()?.to_string();
    let name = meta.get("name")?.as_str()?;
    let resources = crate::review::pod_resources(pod).ok()?;
    let weights = ResourceWeights::new();
    let gpue = pod_gpue(&resources, &weights).ok()?;
    if gpue.total_milli == 0 {
        return None;
    }
    let devices: BTreeMap<String, u64> = effective_requests_milli(&resources)
        .ok()?
        .into_iter()
        .filter(|(r, _)| weights.is_gpu_resource(r))
        .map(|(r, q)| (r, q.div_ceil(1000)))
        .collect();
    let spec = pod.get("spec");
    let status = pod.get("status");
    let phase = status.and_then(|s| s.get("phase")).and_then(Value::as_str).unwrap_or("Pending");
    let node = spec.and_then(|s| s.get("nodeName")).and_then(Value::as_str).filter(|n| !n.is_empty()).map(str::to_string);
    let gated = spec
        .and_then(|s| s.get("schedulingGates"))
        .and_then(Value::as_array)
        .is_some_and(|g| g.iter().any(|x| x.get("name").and_then(Value::as_str) == Some(SCHEDULING_GATE)));
    let stage = match (phase, &node) {
        ("Succeeded" | "Failed", _) => PodStage::Finished,
        (_, Some(_)) => PodStage::Bound,
        _ if gated => PodStage::Gated,
        _ => PodStage::Unbound,
    };
    let created = meta.get("creationTimestamp").and_then(Value::as_str).and_then(parse_time);
    let started = status.and_then(|s| s.get("startTime")).and_then(Value::as_str).and_then(parse_time);
    let since = if stage == PodStage::Bound { started.or(created) } else { created };
    let ran = run_interval(status, &node, stage, started);
    Some(PodInfo {
        key: format!("{namespace}/{name}"),
        namespace,
        stage,
        node,
        gpue: gpue.total_milli,
        devices,
        priority: spec.and_then(|s| s.get("priority")).and_then(Value::as_i64).and_then(|p| i32::try_from(p).ok()).unwrap_or(0),
        since_ms: to_agent_clock(since, wall_now_s, agent_now_ms),
        placement: crate::placement::Placement::from_pod_spec(spec),
        generate_name: meta.get("generateName").and_then(Value::as_str).filter(|g| !g.is_empty()).map(str::to_string),
        ran,
    })
}

/// When a bound pod held its GPUs (Unix ms): from its `PodScheduled` condition (the
/// binding) or else `status.startTime`, until the last of its containers' `finishedAt`
/// once it succeeded or failed (`None` while it runs). Kubernetes keeps these times in
/// seconds, so each end is known to a second.
fn run_interval(status: Option<&Value>, node: &Option<String>, stage: PodStage, started: Option<i64>) -> Option<(u64, Option<u64>)> {
    node.as_ref()?;
    let status = status?;
    let scheduled = status
        .get("conditions")
        .and_then(Value::as_array)
        .and_then(|c| {
            c.iter().find(|c| c.get("type").and_then(Value::as_str) == Some("PodScheduled") && c.get("status").and_then(Value::as_str) == Some("True"))
        })
        .and_then(|c| c.get("lastTransitionTime"))
        .and_then(Value::as_str)
        .and_then(parse_time);
    let start = scheduled.or(started)?;
    let end = if stage == PodStage::Finished {
        let finished = ["containerStatuses", "initContainerStatuses"]
            .iter()
            .filter_map(|k| status.get(*k).and_then(Value::as_array))
            .flatten()
            .filter_map(|c| c.pointer("/state/terminated/finishedAt").and_then(Value::as_str).and_then(parse_time))
            .max();
        // A finished pod without a finish time (unusual): counted up to its start, not
        // beyond (nothing is invented).
        Some(finished.unwrap_or(start).max(start))
    } else {
        None
    };
    let ms = |s: i64| u64::try_from(s).unwrap_or(0).saturating_mul(1000);
    Some((ms(start), end.map(ms)))
}

impl KubeInventory {
    /// Usage per tenant between two wall-clock instants from the pods' run times (see
    /// [`crate::inventory::usage_between`]).
    pub fn usage_between(&self, from_ms: u64, to_ms: u64, tenant_of: impl Fn(&str) -> Option<String>) -> BTreeMap<String, u64> {
        crate::inventory::usage_between(&self.gpu_pods(), from_ms, to_ms, tenant_of)
    }
}

/// A node object (JSON) as the inventory keeps it: its allocatable GPU devices.
pub fn node_info(node: &Value) -> Option<NodeInfo> {
    let name = node.get("metadata")?.get("name")?.as_str()?.to_string();
    let weights = ResourceWeights::new();
    let mut devices = BTreeMap::new();
    if let Some(alloc) = node.get("status").and_then(|s| s.get("allocatable")).and_then(Value::as_object) {
        for (r, q) in alloc {
            if !weights.is_gpu_resource(r) {
                continue;
            }
            let Some(q) = q.as_str().and_then(|q| kvota_fairness::units::parse_quantity_milli(q).ok()) else { continue };
            if q >= 1000 {
                devices.insert(r.clone(), q / 1000);
            }
        }
    }
    let cordoned = node.get("spec").and_then(|s| s.get("unschedulable")).and_then(Value::as_bool).unwrap_or(false);
    // A node whose Ready condition is False or Unknown takes no new pods (the node
    // lifecycle controller taints it); a node that reports no conditions yet counts.
    let not_ready = node
        .get("status")
        .and_then(|s| s.get("conditions"))
        .and_then(Value::as_array)
        .and_then(|cs| cs.iter().find(|c| c.get("type").and_then(Value::as_str) == Some("Ready")))
        .is_some_and(|c| c.get("status").and_then(Value::as_str) != Some("True"));
    let schedulable = !cordoned && !not_ready;
    let labels = node.get("metadata").map(labels_of).unwrap_or_default();
    let taints = crate::placement::node_taints(node.get("spec"));
    Some(NodeInfo { name, devices, schedulable, labels, taints })
}

/// The string labels of an object's `metadata` (others are skipped).
fn labels_of(meta: &Value) -> BTreeMap<String, String> {
    meta.get("labels")
        .and_then(Value::as_object)
        .map(|m| m.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))).collect())
        .unwrap_or_default()
}

fn namespace_labels(ns: &Value) -> Option<(String, BTreeMap<String, String>)> {
    let meta = ns.get("metadata")?;
    let name = meta.get("name")?.as_str()?.to_string();
    Some((name, labels_of(meta)))
}

/// One kind's objects, with the buffer of a relist in progress.
#[derive(Debug)]
struct Kind<T> {
    items: BTreeMap<String, T>,
    relist: Option<BTreeMap<String, T>>,
    synced: bool,
}

impl<T> Default for Kind<T> {
    fn default() -> Self {
        Kind { items: BTreeMap::new(), relist: None, synced: false }
    }
}

impl<T> Kind<T> {
    /// Applies one watcher event; `parsed` is the object's key and value (None: not
    /// kept, e.g. a pod without GPUs, which also removes an earlier version).
    fn apply<K>(&mut self, ev: &Event<K>, parse: impl Fn(&K) -> (String, Option<T>)) {
        match ev {
            Event::Init => self.relist = Some(BTreeMap::new()),
            Event::InitApply(o) => {
                let (k, v) = parse(o);
                if let (Some(buf), Some(v)) = (self.relist.as_mut(), v) {
                    buf.insert(k, v);
                }
            }
            Event::InitDone => {
                if let Some(buf) = self.relist.take() {
                    self.items = buf;
                }
                self.synced = true;
            }
            Event::Apply(o) => match parse(o) {
                (k, Some(v)) => {
                    self.items.insert(k, v);
                }
                (k, None) => {
                    self.items.remove(&k);
                }
            },
            Event::Delete(o) => {
                let (k, _) = parse(o);
                self.items.remove(&k);
            }
        }
    }
}

#[derive(Debug, Default)]
struct Snapshot {
    nodes: Kind<NodeInfo>,
    pods: Kind<PodInfo>,
    namespaces: Kind<BTreeMap<String, String>>,
    relists: u64,
}

/// The cluster as the watchers last saw it. Cheap to read; written by [`KubeInventory::run`].
pub struct KubeInventory {
    snap: Mutex<Snapshot>,
    clock: Arc<dyn Fn() -> Millis + Send + Sync>,
}

impl std::fmt::Debug for KubeInventory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeInventory").field("snapshot", &*self.snap()).finish()
    }
}

fn to_json<K: serde::Serialize>(o: &K) -> Value {
    serde_json::to_value(o).unwrap_or(Value::Null)
}

fn object_key(v: &Value) -> String {
    let meta = v.get("metadata");
    let name = meta.and_then(|m| m.get("name")).and_then(Value::as_str).unwrap_or("");
    match meta.and_then(|m| m.get("namespace")).and_then(Value::as_str) {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_string(),
    }
}

impl KubeInventory {
    /// An empty inventory; `clock` is the agent's monotonic clock (ms), used to place pod
    /// start times on it.
    pub fn new(clock: Arc<dyn Fn() -> Millis + Send + Sync>) -> Arc<KubeInventory> {
        Arc::new(KubeInventory { snap: Mutex::new(Snapshot::default()), clock })
    }

    fn snap(&self) -> std::sync::MutexGuard<'_, Snapshot> {
        self.snap.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Full relists seen so far (initial lists included), for logs and tests.
    pub fn relists(&self) -> u64 {
        self.snap().relists
    }

    fn on_pod(&self, ev: &Event<Pod>) {
        let (wall, now) = (wall_now_s(), (self.clock)());
        let mut s = self.snap();
        if matches!(ev, Event::Init) {
            s.relists += 1;
        }
        s.pods.apply(ev, |p| {
            let v = to_json(p);
            (object_key(&v), pod_info(&v, wall, now))
        });
    }

    fn on_node(&self, ev: &Event<Node>) {
        self.snap().nodes.apply(ev, |n| {
            let v = to_json(n);
            (object_key(&v), node_info(&v))
        });
    }

    fn on_namespace(&self, ev: &Event<Namespace>) {
        self.snap().namespaces.apply(ev, |n| {
            let v = to_json(n);
            match namespace_labels(&v) {
                Some((k, l)) => (k, Some(l)),
                None => (object_key(&v), None),
            }
        });
    }

    /// Watches Nodes, Pods and Namespaces until `stop` turns true. Errors (the API
    /// server unreachable, a watch expired) are logged; the watchers back off and relist
    /// by themselves.
    pub async fn run(self: Arc<Self>, client: Client, mut stop: tokio_watch::Receiver<bool>) {
        enum Change {
            Pod(Box<Event<Pod>>),
            Node(Box<Event<Node>>),
            Ns(Box<Event<Namespace>>),
        }
        let cfg = watcher::Config::default;
        let pods = watcher::watcher(Api::<Pod>::all(client.clone()), cfg()).default_backoff().map(|r| r.map(|e| Change::Pod(Box::new(e))));
        let nodes = watcher::watcher(Api::<Node>::all(client.clone()), cfg()).default_backoff().map(|r| r.map(|e| Change::Node(Box::new(e))));
        let nss = watcher::watcher(Api::<Namespace>::all(client), cfg()).default_backoff().map(|r| r.map(|e| Change::Ns(Box::new(e))));
        let mut all = futures::stream::select_all([pods.boxed(), nodes.boxed(), nss.boxed()]);
        loop {
            tokio::select! {
                item = all.next() => match item {
                    Some(Ok(Change::Pod(e))) => self.on_pod(&e),
                    Some(Ok(Change::Node(e))) => self.on_node(&e),
                    Some(Ok(Change::Ns(e))) => self.on_namespace(&e),
                    Some(Err(e)) => tracing::warn!(error = %e, "Kubernetes watch failed; retrying with backoff"),
                    None => return,
                },
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    }
}

impl Inventory for KubeInventory {
    fn synced(&self) -> bool {
        let s = self.snap();
        s.nodes.synced && s.pods.synced && s.namespaces.synced
    }

    fn nodes(&self) -> Vec<NodeInfo> {
        self.snap().nodes.items.values().cloned().collect()
    }

    fn gpu_pods(&self) -> Vec<PodInfo> {
        self.snap().pods.items.values().cloned().collect()
    }

    fn namespaces(&self) -> BTreeMap<String, BTreeMap<String, String>> {
        self.snap().namespaces.items.clone()
    }
}

/// The HTTP status of an API error, if the API server answered one.
pub fn api_status(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(r) => Some(r.code),
        _ => None,
    }
}

/// `config` for the actions client: no automatic retries (see [`KubeActions::new`]).
pub fn actions_config(mut config: kube::Config) -> kube::Config {
    config.default_retry = false;
    config
}

/// What the agent does to its cluster through the API.
#[derive(Clone)]
pub struct KubeActions {
    client: Client,
    component: String,
}

impl std::fmt::Debug for KubeActions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeActions").field("component", &self.component).finish()
    }
}

impl KubeActions {
    /// Actions through `client`; events are signed by `component` (e.g. `kvota-agent`).
    /// Build the client with [`actions_config`]: kube's default retry layer would retry
    /// an eviction refused with 429 by a PodDisruptionBudget for minutes, stalling
    /// reclaim; here a refusal is an answer, and the next round retries.
    pub fn new(client: Client, component: &str) -> Self {
        KubeActions { client, component: component.to_string() }
    }

    /// Removes kvota's scheduling gate from pod `namespace/name`, keeping any other gate.
    /// The patch carries the pod's resourceVersion, so a concurrent change makes it fail
    /// (409) rather than drop someone else's gate; the next round retries. `Ok(false)`:
    /// the pod is gone or has no kvota gate.
    pub async fn ungate(&self, key: &str) -> Result<bool, kube::Error> {
        let Some((ns, name)) = key.split_once('/') else { return Ok(false) };
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
        let rest: Vec<Value> =
            gates.iter().filter(|g| g.get("name").and_then(Value::as_str) != Some(SCHEDULING_GATE)).cloned().collect();
        if rest.len() == gates.len() {
            return Ok(false);
        }
        let rv = v.get("metadata").and_then(|m| m.get("resourceVersion")).cloned().unwrap_or(Value::Null);
        let gates_value = if rest.is_empty() { Value::Null } else { Value::Array(rest) };
        let patch = json!({ "metadata": { "resourceVersion": rv }, "spec": { "schedulingGates": gates_value } });
        api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        Ok(true)
    }

    /// Evicts pod `namespace/name` through the Eviction API.
    pub async fn evict(&self, key: &str) -> Result<EvictOutcome, kube::Error> {
        let Some((ns, name)) = key.split_once('/') else { return Ok(EvictOutcome::NotFound) };
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
        let Some((ns, name)) = key.split_once('/') else { return Ok(()) };
        let now = format_time(wall_now_s());
        let kind = if reason == "Evicted" || reason == "EvictionBlocked" { "Warning" } else { "Normal" };
        let ev = json!({
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": { "generateName": format!("{name}.kvota-"), "namespace": ns },
            "involvedObject": { "apiVersion": "v1", "kind": "Pod", "namespace": ns, "name": name },
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
        Api::<KubeEvent>::namespaced(self.client.clone(), ns).create(&PostParams::default(), &ev).await?;
        Ok(())
    }
}

/// Leader election among agent replicas of one cluster, through a Lease object.
///
/// The rule (as client-go's): a replica takes the Lease only after it has seen the same
/// holder and renew time unchanged for a whole lease duration *on its own clock*; the
/// holder stops acting `margin` before its own last successful renew plus the duration
/// runs out. So the old leader has stopped before a new one can start, whatever the
/// clocks' offsets (their rates must agree within `margin / duration`). Writes carry the
/// object's resourceVersion: of two replicas racing for it, one gets a 409 and stays
/// standby.
#[derive(Debug)]
pub struct Election {
    api: Api<KubeLease>,
    name: String,
    identity: String,
    duration: Duration,
    margin: Duration,
    observed: Option<(String, Instant)>,
    leading_until: Option<Instant>,
    holder: Option<String>,
}

impl Election {
    /// Election on Lease `namespace/name` as `identity` (unique per replica, e.g. the pod
    /// name), with a lease of `duration` (at least 3 s).
    pub fn new(client: Client, namespace: &str, name: &str, identity: &str, duration: Duration) -> Self {
        let duration = duration.max(Duration::from_secs(3));
        Election {
            api: Api::namespaced(client, namespace),
            name: name.to_string(),
            identity: identity.to_string(),
            duration,
            margin: duration / 5,
            observed: None,
            leading_until: None,
            holder: None,
        }
    }

    /// Whether this replica leads now.
    pub fn is_leader(&self) -> bool {
        self.leading_until.is_some_and(|t| Instant::now() < t)
    }

    /// The holder last seen (this replica's identity when it leads).
    pub fn holder(&self) -> Option<&str> {
        self.holder.as_deref()
    }

    /// How often to call [`Election::step`]: a third of the duration.
    pub fn period(&self) -> Duration {
        self.duration / 3
    }

    /// One round: take the Lease if it is free or expired, renew it if held. Returns
    /// whether this replica leads afterwards.
    pub async fn step(&mut self) -> Result<bool, kube::Error> {
        let started = Instant::now();
        let secs = i32::try_from(self.duration.as_secs()).unwrap_or(i32::MAX);
        let now = format_time(wall_now_s());
        let current = self.api.get_opt(&self.name).await?;
        let Some(current) = current else {
            let lease = json!({
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": { "name": self.name },
                "spec": { "holderIdentity": self.identity, "leaseDurationSeconds": secs,
                          "acquireTime": format!("{}", now.replace('Z', ".000000Z")),
                          "renewTime": format!("{}", now.replace('Z', ".000000Z")), "leaseTransitions": 0 }
            });
            let lease: KubeLease = serde_json::from_value(lease).map_err(kube::Error::SerdeError)?;
            return self.write(self.api.create(&PostParams::default(), &lease).await, started);
        };
        let v = to_json(&current);
        let spec = v.get("spec").cloned().unwrap_or(Value::Null);
        let holder = spec.get("holderIdentity").and_then(Value::as_str).unwrap_or("").to_string();
        let renew = spec.get("renewTime").and_then(Value::as_str).unwrap_or("").to_string();
        let transitions = spec.get("leaseTransitions").and_then(Value::as_i64).unwrap_or(0);
        let record = format!("{holder}@{renew}");
        if self.observed.as_ref().is_none_or(|(r, _)| *r != record) {
            self.observed = Some((record, started));
        }
        self.holder = Some(holder.clone()).filter(|h| !h.is_empty());
        let mine = holder == self.identity;
        let expired = holder.is_empty() || self.observed.as_ref().is_some_and(|(_, at)| started.duration_since(*at) >= self.duration);
        if !mine && !expired {
            self.leading_until = None;
            return Ok(false);
        }
        let mut next = v.clone();
        let micro = now.replace('Z', ".000000Z");
        next["spec"]["holderIdentity"] = json!(self.identity);
        next["spec"]["leaseDurationSeconds"] = json!(secs);
        next["spec"]["renewTime"] = json!(micro);
        if !mine {
            next["spec"]["acquireTime"] = json!(micro);
            next["spec"]["leaseTransitions"] = json!(transitions + 1);
        }
        let next: KubeLease = serde_json::from_value(next).map_err(kube::Error::SerdeError)?;
        let result = self.api.replace(&self.name, &PostParams::default(), &next).await;
        self.write(result, started)
    }

    fn write(&mut self, result: Result<KubeLease, kube::Error>, started: Instant) -> Result<bool, kube::Error> {
        match result {
            Ok(_) => {
                self.holder = Some(self.identity.clone());
                self.leading_until = Some(started + self.duration - self.margin);
                Ok(true)
            }
            // Someone else wrote first.
            Err(e) if matches!(api_status(&e), Some(409)) => {
                self.leading_until = None;
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Gives the Lease up (on shutdown), so a standby takes over at once.
    pub async fn release(&mut self) -> Result<(), kube::Error> {
        if !self.is_leader() {
            return Ok(());
        }
        self.leading_until = None;
        if let Some(current) = self.api.get_opt(&self.name).await? {
            let mut v = to_json(&current);
            if v["spec"]["holderIdentity"] == json!(self.identity) {
                v["spec"]["holderIdentity"] = json!("");
                let next: KubeLease = serde_json::from_value(v).map_err(kube::Error::SerdeError)?;
                self.api.replace(&self.name, &PostParams::default(), &next).await?;
            }
        }
        Ok(())
    }
}

/// Label the replicas put on their own pods: `leader` on the one that admits, `standby`
/// on the others. The webhook Service selects `leader`, so reviews reach only the
/// replica that admits while every healthy replica is Ready.
pub const ROLE_LABEL: &str = "kvota.dev/agent-role";

/// Sets [`ROLE_LABEL`] on the replicas' pods (namespace `namespace`, this one `pod`).
#[derive(Clone)]
pub struct RoleMarker {
    api: Api<Pod>,
    pod: String,
}

impl std::fmt::Debug for RoleMarker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoleMarker").field("pod", &self.pod).finish()
    }
}

impl RoleMarker {
    /// Marks pod `namespace/pod` (this replica's own).
    pub fn new(client: Client, namespace: &str, pod: &str) -> Self {
        RoleMarker { api: Api::namespaced(client, namespace), pod: pod.to_string() }
    }

    async fn set(&self, pod: &str, role: &str) -> Result<(), kube::Error> {
        let patch = json!({ "metadata": { "labels": { ROLE_LABEL: role } } });
        match self.api.patch(pod, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => Ok(()),
            Err(e) if api_status(&e) == Some(404) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// This replica leads: every other pod still marked `leader` (a replica that lost
    /// the Lease without saying so: crashed, or cut off) becomes `standby` first, then
    /// this pod becomes `leader`.
    pub async fn lead(&self) -> Result<(), kube::Error> {
        let marked = self
            .api
            .list(&kube::api::ListParams::default().labels(&format!("{ROLE_LABEL}=leader")))
            .await?;
        for p in marked.items {
            let name = p.metadata.name.clone().unwrap_or_default();
            let leader = p.metadata.labels.as_ref().and_then(|l| l.get(ROLE_LABEL)).is_some_and(|r| r == "leader");
            if leader && !name.is_empty() && name != self.pod {
                self.set(&name, "standby").await?;
            }
        }
        self.set(&self.pod, "leader").await
    }

    /// This replica stands by.
    pub async fn stand_by(&self) -> Result<(), kube::Error> {
        self.set(&self.pod, "standby").await
    }
}

/// The leader's duties in a Kubernetes cluster, one round at a time: bring the agent's
/// state in line with the inventory, release gated pods that fit their budget now (the
/// gate controller), and reclaim for starved tenants through the Eviction API.
#[derive(Debug)]
pub struct Controller {
    inventory: Arc<KubeInventory>,
    actions: KubeActions,
    known: std::collections::BTreeSet<String>,
    metering: bool,
}

/// What one [`Controller::release_gates`] round did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// Pods whose kvota gate was removed.
    pub ungated: Vec<String>,
    /// Pods the gate could not be removed from (API errors); retried next round.
    pub failed: Vec<String>,
}

impl Controller {
    /// A controller over `inventory` acting through `actions`.
    pub fn new(inventory: Arc<KubeInventory>, actions: KubeActions) -> Self {
        Controller { inventory, actions, known: Default::default(), metering: false }
    }

    /// The inventory it reads.
    pub fn inventory(&self) -> &Arc<KubeInventory> {
        &self.inventory
    }

    /// Syncs the agent's state and capacity from the inventory. Admission stays held
    /// until the first complete listing (the agent cannot know what is in use before).
    /// Returns whether the inventory is synced.
    pub fn sync(&mut self, agent: &crate::agent::Agent) -> bool {
        if !self.inventory.synced() {
            agent.state().set_held(Some("the agent has not listed the cluster's nodes and pods yet".into()));
            return false;
        }
        agent.set_capacity(crate::inventory::capacity_milli(&*self.inventory));
        let mut st = agent.state();
        crate::inventory::sync_state(&*self.inventory, &mut st, &mut self.known);
        // Pods map to tenants through the policy: before it arrives, nothing listed is
        // counted for anyone, so admission stays held until a sync with the policy.
        let counted = crate::review::AdmissionState::policy(&*st).is_some();
        if counted && st.held_reason().is_some_and(|w| w.contains("not listed")) {
            st.set_held(None);
        }
        drop(st);
        if counted && !self.metering {
            // From here on the meter counts the bound pods: usage before this instant
            // that no process metered is recovered from the pods' run times.
            self.metering = true;
            let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            agent.meter_started(now_ms);
        }
        true
    }

    /// Removes the gate from the pods the agent releases (priority, then age, as budget
    /// allows). A pod whose patch fails goes back to the queue for the next round.
    pub async fn release_gates(&mut self, agent: &crate::agent::Agent) -> Released {
        let keys = agent.state().release_queue();
        let mut out = Released::default();
        for key in keys {
            match self.actions.ungate(&key).await {
                Ok(_) => out.ungated.push(key),
                Err(e) => {
                    tracing::warn!(pod = %key, error = %e, "could not remove the scheduling gate; retrying next round");
                    agent.state().pod_gone(&key);
                    self.known.remove(&key);
                    out.failed.push(key);
                }
            }
        }
        out
    }

    /// One reclaim round: plan over the inventory, evict through the Eviction API, put an
    /// Event on every victim and a record in the agent's audit log.
    pub async fn reclaim(&self, agent: &crate::agent::Agent) -> kvota_fairness::reclaim::Decision {
        use kvota_fairness::reclaim::ClusterView;
        let (decision, now) = {
            let mut st = agent.state();
            let inputs = crate::inventory::reclaim_view(&*self.inventory, &st);
            let now = st.now_ms();
            let view = ClusterView {
                now_ms: now,
                capacity: st.capacity_gpue(),
                node_free: &inputs.node_free,
                node_total: &inputs.node_total,
                tenants: &inputs.tenants,
                running: &inputs.running,
                waiting: &inputs.waiting,
            };
            (st.plan_reclaim(&view), now)
        };
        if let Some((for_tenant, for_pod, summary, victims)) = crate::inventory::victims(&decision) {
            for v in victims {
                let outcome = match self.actions.evict(&v.key).await {
                    Ok(o) => o,
                    Err(e) => {
                        tracing::warn!(pod = %v.key, error = %e, "eviction request failed; reclaim retries next round");
                        continue;
                    }
                };
                let Some((reason, message, record)) =
                    crate::inventory::eviction_record(now, for_tenant, for_pod, summary, v, outcome)
                else {
                    continue;
                };
                tracing::warn!(pod = %v.key, for_tenant, outcome = %record.outcome, "{message}");
                if let Err(e) = self.actions.event(&v.key, reason, &message).await {
                    tracing::warn!(pod = %v.key, error = %e, "could not record the eviction Event (the audit log has it)");
                }
                agent.state().record_eviction(record);
            }
        }
        decision
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_round_trip_and_match_known_dates() {
        assert_eq!(parse_time("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_time("2026-12-03T10:00:00Z"), Some(1_796_292_000));
        assert_eq!(parse_time("2024-02-29T23:59:59.123456Z"), Some(1_709_251_199));
        for t in [0, 951_782_400, 1_709_251_199, 1_796_292_000, 4_102_444_800] {
            assert_eq!(parse_time(&format_time(t)), Some(t), "{}", format_time(t));
        }
        for bad in ["", "yesterday", "2026-13-01T00:00:00Z", "2026-12-03 10:00:00Z", "2026-12-03T10:00:00+01:00"] {
            assert_eq!(parse_time(bad), None, "{bad}");
        }
    }

    #[test]
    fn pods_are_classified_like_the_scheduler_sees_them() {
        let pod = |extra_spec: Value, status: Value| {
            let mut spec = json!({"containers": [{"name": "m", "resources": {"limits": {"nvidia.com/gpu": "2"}}}], "priority": 7});
            if let (Some(s), Some(e)) = (spec.as_object_mut(), extra_spec.as_object()) {
                s.extend(e.clone());
            }
            json!({"metadata": {"name": "p", "namespace": "ml", "creationTimestamp": "2026-12-03T10:00:00Z"},
                   "spec": spec, "status": status})
        };
        let now_s = 1_796_292_060; // 60 s after creation
        let p = pod_info(&pod(json!({}), json!({"phase": "Pending"})), now_s, 100_000).expect("gpu pod");
        assert_eq!((p.stage, p.gpue, p.priority, p.since_ms), (PodStage::Unbound, 2000, 7, 40_000));
        assert_eq!(p.devices, [("nvidia.com/gpu".to_string(), 2)].into());
        let gated = pod(json!({"schedulingGates": [{"name": "other"}, {"name": SCHEDULING_GATE}]}), json!({}));
        assert_eq!(pod_info(&gated, now_s, 100_000).map(|p| p.stage), Some(PodStage::Gated));
        let bound = pod(json!({"nodeName": "n1"}), json!({"phase": "Running", "startTime": "2026-12-03T10:00:30Z"}));
        let b = pod_info(&bound, now_s, 100_000).expect("bound");
        assert_eq!((b.stage, b.node.as_deref(), b.since_ms), (PodStage::Bound, Some("n1"), 70_000));
        let done = pod(json!({"nodeName": "n1"}), json!({"phase": "Succeeded"}));
        assert_eq!(pod_info(&done, now_s, 100_000).map(|p| p.stage), Some(PodStage::Finished));
        let cpu = json!({"metadata": {"name": "c", "namespace": "ml"}, "spec": {"containers": [{"name": "m"}]}});
        assert_eq!(pod_info(&cpu, now_s, 0), None, "pods without GPUs are not kept");
    }

    #[test]
    fn nodes_offer_their_allocatable_gpus_unless_cordoned() {
        let n = json!({"metadata": {"name": "n1"}, "status": {"allocatable": {"cpu": "96", "nvidia.com/gpu": "8", "nvidia.com/mig-1g.10gb": "7"}}});
        let info = node_info(&n).expect("node");
        assert_eq!(info.devices, [("nvidia.com/gpu".to_string(), 8), ("nvidia.com/mig-1g.10gb".to_string(), 7)].into());
        assert!(info.schedulable);
        let c = json!({"metadata": {"name": "n2"}, "spec": {"unschedulable": true}, "status": {"allocatable": {"nvidia.com/gpu": "4"}}});
        assert!(!node_info(&c).expect("node").schedulable);
        let ready = |status: &str| {
            json!({"metadata": {"name": "n3"}, "status": {"allocatable": {"nvidia.com/gpu": "4"},
                "conditions": [{"type": "MemoryPressure", "status": "False"}, {"type": "Ready", "status": status}]}})
        };
        assert!(node_info(&ready("True")).expect("node").schedulable);
        assert!(!node_info(&ready("False")).expect("node").schedulable, "NotReady takes no new pods");
        assert!(!node_info(&ready("Unknown")).expect("node").schedulable, "a node that stopped reporting");
    }
}

/// The agent's persisted state (`crate::persist`) in a ConfigMap of the agent's
/// namespace, key `state.json`. Writes carry the resourceVersion last seen: a replica
/// that lost the leader Lease and wakes up late gets 409 instead of overwriting what
/// the new leader wrote, and from then on writes nothing until it wins the Lease again
/// ([`ConfigMapStore::rearm`]). Its namespace, name and size limit are in the RBAC of
/// `deploy/kubernetes/agent/10-rbac.yaml` (get, create, update on this one name).
#[derive(Debug)]
pub struct ConfigMapStore {
    api: Api<k8s_openapi::api::core::v1::ConfigMap>,
    namespace: String,
    name: String,
    version: Mutex<Option<String>>,
    /// Another writer got there first (409): saves are refused until [`ConfigMapStore::rearm`].
    fenced: std::sync::atomic::AtomicBool,
}

/// The key of the state in the ConfigMap.
pub const STATE_KEY: &str = "state.json";

impl ConfigMapStore {
    /// The state in ConfigMap `namespace/name`.
    pub fn new(client: Client, namespace: &str, name: &str) -> ConfigMapStore {
        ConfigMapStore {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_string(),
            name: name.to_string(),
            version: Mutex::new(None),
            fenced: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn err(&self, e: impl std::fmt::Display) -> crate::persist::PersistError {
        crate::persist::PersistError::Store { store: crate::persist::StateStore::describe(self), why: e.to_string() }
    }

    fn remember(&self, cm: &k8s_openapi::api::core::v1::ConfigMap) {
        *self.version.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = cm.metadata.resource_version.clone();
    }
}

impl crate::persist::StateStore for ConfigMapStore {
    fn load(&self) -> crate::persist::StoreFuture<'_, Option<Vec<u8>>> {
        Box::pin(async move {
            let cm = self.api.get_opt(&self.name).await.map_err(|e| self.err(e))?;
            let Some(cm) = cm else { return Ok(None) };
            self.remember(&cm);
            Ok(cm.data.and_then(|d| d.get(STATE_KEY).map(|s| s.as_bytes().to_vec())))
        })
    }

    fn save(&self, bytes: Vec<u8>) -> crate::persist::StoreFuture<'_, ()> {
        Box::pin(async move {
            if self.fenced.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(self.err("another replica wrote it since this one last did; this replica writes again only once it wins the leader Lease"));
            }
            let text = String::from_utf8(bytes).map_err(|e| self.err(e))?;
            let rv = self.version.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
            let mut cm = k8s_openapi::api::core::v1::ConfigMap {
                metadata: kube::api::ObjectMeta {
                    name: Some(self.name.clone()),
                    namespace: Some(self.namespace.clone()),
                    labels: Some([("app.kubernetes.io/name".to_string(), "kvota-agent".to_string())].into()),
                    annotations: Some([("kvota.dev/state-format".to_string(), crate::persist::FORMAT_VERSION.to_string())].into()),
                    resource_version: rv.clone(),
                    ..Default::default()
                },
                data: Some([(STATE_KEY.to_string(), text)].into()),
                ..Default::default()
            };
            let result = match rv {
                Some(_) => self.api.replace(&self.name, &PostParams::default(), &cm).await,
                None => match self.api.create(&PostParams::default(), &cm).await {
                    // It exists (another replica made it): take its version, then replace.
                    Err(e) if matches!(api_status(&e), Some(409)) => {
                        let cur = self.api.get(&self.name).await.map_err(|e| self.err(e))?;
                        cm.metadata.resource_version = cur.metadata.resource_version.clone();
                        self.api.replace(&self.name, &PostParams::default(), &cm).await
                    }
                    other => other,
                },
            };
            match result {
                Ok(saved) => {
                    self.remember(&saved);
                    Ok(())
                }
                Err(e) => {
                    match api_status(&e) {
                        // Someone wrote since we did: the new leader. Stop writing.
                        Some(409) => self.fenced.store(true, std::sync::atomic::Ordering::SeqCst),
                        // Deleted (by a person): the next save makes it again.
                        Some(404) => *self.version.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None,
                        _ => {}
                    }
                    Err(self.err(e))
                }
            }
        })
    }

    fn describe(&self) -> String {
        format!("ConfigMap {}/{}", self.namespace, self.name)
    }

    fn rearm(&self) {
        self.fenced.store(false, std::sync::atomic::Ordering::SeqCst);
        *self.version.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}
