//! [`KubeInventory`]: Nodes, Pods and Namespaces from watchers (list, then watch; a
//! relist after `410 Gone` or a broken stream, with backoff), turned into the
//! [`Inventory`] every other part of the agent reads.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::Api;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Client;
use kvota_fairness::Millis;
use serde_json::Value;
use tokio::sync::watch as tokio_watch;

use super::convert::{namespace_labels, node_info, pod_info, to_json, wall_now_s};
use crate::inventory::{Inventory, NodeInfo, PodInfo};

impl KubeInventory {
    /// Usage per tenant between two wall-clock instants from the pods' run times (see
    /// [`crate::inventory::usage_between`]).
    pub fn usage_between(
        &self,
        from_ms: u64,
        to_ms: u64,
        tenant_of: impl Fn(&str) -> Option<kvota_fairness::names::TenantName>,
    ) -> BTreeMap<kvota_fairness::names::TenantName, u64> {
        crate::inventory::usage_between(&self.gpu_pods(), from_ms, to_ms, tenant_of)
    }
}

/// One kind's objects, with the buffer of a relist in progress.
#[derive(Debug)]
pub(super) struct Kind<T> {
    items: BTreeMap<String, T>,
    relist: Option<BTreeMap<String, T>>,
    synced: bool,
}

impl<T> Default for Kind<T> {
    fn default() -> Self {
        Kind {
            items: BTreeMap::new(),
            relist: None,
            synced: false,
        }
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
pub(super) struct Snapshot {
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
        f.debug_struct("KubeInventory")
            .field("snapshot", &*self.snap())
            .finish()
    }
}

pub(super) fn object_key(v: &Value) -> String {
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
        Arc::new(KubeInventory {
            snap: Mutex::new(Snapshot::default()),
            clock,
        })
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
        let pods = watcher::watcher(Api::<Pod>::all(client.clone()), cfg())
            .default_backoff()
            .map(|r| r.map(|e| Change::Pod(Box::new(e))));
        let nodes = watcher::watcher(Api::<Node>::all(client.clone()), cfg())
            .default_backoff()
            .map(|r| r.map(|e| Change::Node(Box::new(e))));
        let nss = watcher::watcher(Api::<Namespace>::all(client), cfg())
            .default_backoff()
            .map(|r| r.map(|e| Change::Ns(Box::new(e))));
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
