//! A simulated member cluster: nodes with GPUs (whole or MIG slices), a first-fit
//! scheduler that binds admitted pods to nodes with free devices, and pods that run for a
//! while and finish.
//!
//! Pods enter exactly as real ones do: as an `admission.k8s.io/v1` AdmissionReview
//! handed to [`crate::review::review`] (the same `decide`), against the agent's state.

use std::collections::BTreeMap;

use kvota_fairness::names::{PodKey, TenantName};
use kvota_fairness::resources::NVIDIA_GPU;
use kvota_fairness::{MilliGpue, Millis};
use serde_json::json;

use kvota_fairness::reclaim::{ClusterView, Decision};

use crate::inventory::{self, Inventory, NodeInfo, PodInfo, PodStage};
use crate::review::{review, Endpoint, Outcome};
use crate::state::{AgentState, PodRec};

/// A pod to submit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimPod {
    /// Namespace (maps to a tenant through the policy).
    pub namespace: String,
    /// Pod name (unique in the namespace).
    pub name: String,
    /// Device resource requested (`nvidia.com/gpu`, `nvidia.com/mig-3g.40gb`, ...).
    pub resource: String,
    /// How many of `resource` (a limit on its one container).
    pub count: u32,
    /// How long it runs once bound.
    pub duration_ms: Millis,
    /// Pod priority.
    pub priority: i32,
}

impl SimPod {
    /// A pod asking for `gpus` whole `nvidia.com/gpu`.
    pub fn gpus(namespace: &str, name: &str, gpus: u32, duration_ms: Millis, priority: i32) -> SimPod {
        SimPod {
            namespace: namespace.to_string(),
            name: name.to_string(),
            resource: NVIDIA_GPU.to_string(),
            count: gpus,
            duration_ms,
            priority,
        }
    }

    /// `namespace/name`, the key the agent knows the pod by, as text.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// The key the agent knows the pod by (an error for names Kubernetes would refuse).
    pub fn pod_key(&self) -> Result<PodKey, kvota_fairness::names::NameError> {
        PodKey::new(&self.namespace, &self.name)
    }
}

#[derive(Clone, Debug)]
struct Waiting {
    pod: SimPod,
    tenant: Option<TenantName>,
    gpue: MilliGpue,
    since_ms: Millis,
}

#[derive(Clone, Debug)]
struct Running {
    node: usize,
    pod: SimPod,
    tenant: Option<TenantName>,
    gpue: MilliGpue,
    started_ms: Millis,
    ends_at_ms: Millis,
}

pub use crate::inventory::EvictOutcome;

/// A Kubernetes Event on a pod (the simulated cluster keeps them in a list).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimEvent {
    /// When (agent clock).
    pub at_ms: Millis,
    /// `namespace/name` of the pod the event is about.
    pub pod: String,
    /// `Evicted` or `EvictionBlocked`.
    pub reason: String,
    /// The explanation.
    pub message: String,
}

/// Work lost to evictions, per tenant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EvictionCost {
    /// Pods evicted.
    pub pods: u64,
    /// GPUe x ms of work lost (since each pod's last checkpoint).
    pub lost_gpue_ms: u64,
}

/// A pod the scheduler bound in a [`SimCluster::bind`] call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bound {
    /// `namespace/name`.
    pub key: PodKey,
    /// Tenant the webhook mapped it to.
    pub tenant: Option<TenantName>,
    /// GPUe it holds.
    pub gpue: MilliGpue,
}

/// Where a pod stands in the simulated cluster (what an inventory would list).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodPhase {
    /// Bound to a node and running.
    Running,
    /// Admitted (or released from the gate) but not yet bound.
    Unbound,
    /// Waiting behind the scheduling gate.
    Gated,
}

/// One pod as an inventory lists it: what a restarted agent rebuilds its state from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListedPod {
    /// `namespace/name`.
    pub key: PodKey,
    /// Tenant the webhook mapped it to.
    pub tenant: Option<TenantName>,
    /// GPUe it requests.
    pub gpue: MilliGpue,
    /// Pod priority.
    pub priority: i32,
    /// Where it stands.
    pub phase: PodPhase,
}

/// The simulated cluster.
#[derive(Debug, Default)]
pub struct SimCluster {
    /// Free devices per node: resource name -> count.
    free: Vec<BTreeMap<String, u64>>,
    capacity: BTreeMap<String, u64>,
    unbound: BTreeMap<PodKey, Waiting>,
    gated: BTreeMap<PodKey, Waiting>,
    running: BTreeMap<PodKey, Running>,
    uid: u64,
    total: Vec<BTreeMap<String, u64>>,
    pdb_min_available: BTreeMap<String, usize>,
    checkpoint_ms: Millis,
    evicted: Vec<SimPod>,
    events: Vec<SimEvent>,
    cost: BTreeMap<TenantName, EvictionCost>,
    /// Pods that held GPUs and are gone (finished or evicted), newest last: what a real
    /// cluster still lists for a while (completed pods stay until deleted).
    finished: std::collections::VecDeque<Finished>,
}

/// A pod that ran and is gone, for [`SimCluster::usage_between`].
#[derive(Clone, Debug)]
struct Finished {
    key: PodKey,
    namespace: String,
    gpue: MilliGpue,
    started_ms: Millis,
    ended_ms: Millis,
}

/// Gone pods kept for [`SimCluster::usage_between`] at most (a real cluster's garbage
/// collector deletes completed pods too).
pub const FINISHED_KEPT: usize = 100_000;

/// How often simulated training checkpoints by default.
pub const DEFAULT_CHECKPOINT_MS: Millis = 10 * 60_000;

impl SimCluster {
    /// A cluster of nodes with this many whole GPUs each.
    pub fn new(node_gpus: &[u32]) -> Self {
        let nodes: Vec<BTreeMap<String, u64>> = node_gpus
            .iter()
            .map(|&g| [(NVIDIA_GPU.to_string(), u64::from(g))].into())
            .collect();
        Self::with_nodes(nodes)
    }

    /// A cluster of nodes given as device counts per resource name (e.g. one node with
    /// 14 `nvidia.com/mig-3g.40gb` slices).
    pub fn with_nodes(nodes: Vec<BTreeMap<String, u64>>) -> Self {
        let mut capacity = BTreeMap::new();
        for n in &nodes {
            for (r, c) in n {
                *capacity.entry(r.clone()).or_insert(0) += c;
            }
        }
        SimCluster {
            total: nodes.clone(),
            free: nodes,
            capacity,
            checkpoint_ms: DEFAULT_CHECKPOINT_MS,
            ..Default::default()
        }
    }

    /// Capacity per resource in quantity thousandths, as the agent registers it.
    pub fn capacity_milli(&self) -> BTreeMap<String, u64> {
        self.capacity.iter().map(|(r, c)| (r.clone(), c * 1000)).collect()
    }

    /// Pods running.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// GPUe held by running pods.
    pub fn running_gpue(&self) -> MilliGpue {
        self.running.values().map(|r| r.gpue).sum()
    }

    /// Pods admitted (or released from the gate) but not yet bound.
    pub fn unbound(&self) -> usize {
        self.unbound.len()
    }

    /// Pods waiting behind the scheduling gate.
    pub fn gated(&self) -> usize {
        self.gated.len()
    }

    /// Submits a pod through admission: `allowed`, `queued`, `denied`, `passed` or
    /// `error` (as the webhook judged it). Reject-mode tenants go through the validating
    /// endpoint, queue-mode ones through the mutating one, as an API server would call
    /// both.
    pub fn submit(&mut self, state: &mut AgentState, pod: &SimPod) -> Outcome {
        self.submit_reviewed(state, pod).0
    }

    /// [`SimCluster::submit`], also saying whether the answer is a first denial a
    /// webhook would hold for the report round it triggers
    /// ([`crate::review::Reviewed::may_wait`]).
    pub fn submit_reviewed(&mut self, state: &mut AgentState, pod: &SimPod) -> (Outcome, bool) {
        self.uid += 1;
        let body = json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": format!("sim-{}", self.uid),
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": pod.namespace,
                "name": pod.name,
                "operation": "CREATE",
                "object": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": pod.name, "namespace": pod.namespace},
                    "spec": {
                        "priority": pod.priority,
                        "containers": [{"name": "main", "resources": {"limits": {pod.resource.clone(): pod.count.to_string()}}}]
                    }
                }
            }
        });
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        let mutate = review(&bytes, Endpoint::Mutate, state);
        let verdict = if mutate.outcome == Outcome::Passed {
            review(&bytes, Endpoint::Validate, state)
        } else {
            mutate
        };
        let w = Waiting {
            pod: pod.clone(),
            tenant: verdict.tenant.clone(),
            gpue: verdict.gpue,
            since_ms: state.now_ms(),
        };
        // A key that breaks the rule was a malformed review: never admitted.
        match (verdict.outcome, pod.pod_key()) {
            (Outcome::Allowed | Outcome::Passed, Ok(key)) => {
                self.unbound.insert(key, w);
            }
            (Outcome::Queued, Ok(key)) => {
                self.gated.insert(key, w);
            }
            _ => {}
        }
        (verdict.outcome, verdict.may_wait)
    }

    /// Finishes the pods whose time is up (their devices free, the agent forgets them).
    /// Returns the keys of the finished pods.
    pub fn finish(&mut self, state: &mut AgentState, now_ms: Millis) -> Vec<PodKey> {
        let done: Vec<PodKey> = self
            .running
            .iter()
            .filter(|(_, r)| r.ends_at_ms <= now_ms)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &done {
            if let Some(r) = self.running.remove(k) {
                if let Some(node) = self.free.get_mut(r.node) {
                    *node.entry(r.pod.resource.clone()).or_insert(0) += u64::from(r.pod.count);
                }
                self.keep_finished(k, &r, now_ms);
            }
            state.pod_gone(k);
        }
        done
    }

    fn keep_finished(&mut self, key: &PodKey, r: &Running, ended_ms: Millis) {
        if self.finished.len() >= FINISHED_KEPT {
            self.finished.pop_front();
        }
        self.finished.push_back(Finished {
            key: key.clone(),
            namespace: r.pod.namespace.clone(),
            gpue: r.gpue,
            started_ms: r.started_ms,
            ended_ms,
        });
    }

    /// Usage per tenant between `from_ms` and `to_ms` (this cluster's clock: the one its
    /// callers drive it with) from the pods' run times, running and gone, as the agent
    /// recovers usage no process metered (`crate::agent::History`).
    pub fn usage_between(
        &self,
        from_ms: Millis,
        to_ms: Millis,
        tenant_of: impl Fn(&str) -> Option<TenantName>,
    ) -> BTreeMap<TenantName, u64> {
        let mut pods: Vec<PodInfo> = self
            .gpu_pods()
            .into_iter()
            .filter(|p| p.stage == PodStage::Bound)
            .collect();
        pods.extend(self.finished.iter().map(|f| PodInfo {
            key: f.key.clone(),
            namespace: f.namespace.clone(),
            stage: PodStage::Finished,
            node: None,
            gpue: f.gpue,
            devices: BTreeMap::new(),
            priority: 0,
            since_ms: f.started_ms,
            placement: Default::default(),
            generate_name: None,
            ran: Some((f.started_ms, Some(f.ended_ms))),
        }));
        crate::inventory::usage_between(&pods, from_ms, to_ms, tenant_of)
    }

    /// Removes the scheduling gate from the pods the agent releases (they hold a
    /// reservation from now on). Returns their keys.
    pub fn release(&mut self, state: &mut AgentState) -> Vec<PodKey> {
        let released = state.release_queue();
        let mut keys = Vec::with_capacity(released.len());
        for r in released {
            if let Some(w) = self.gated.remove(&r.key) {
                self.unbound.insert(r.key.clone(), w);
            }
            state.note_wait(&r.tenant, r.queued_at_ms);
            keys.push(r.key);
        }
        keys
    }

    /// Binds what fits (first fit, in key order) and returns what was bound.
    pub fn bind(&mut self, state: &mut AgentState, now_ms: Millis) -> Vec<Bound> {
        let mut out = Vec::new();
        let keys: Vec<PodKey> = self.unbound.keys().cloned().collect();
        for k in keys {
            let Some(w) = self.unbound.get(&k) else { continue };
            let need = u64::from(w.pod.count);
            let res = w.pod.resource.clone();
            let Some(node) = self.free.iter().position(|f| f.get(&res).copied().unwrap_or(0) >= need) else {
                continue;
            };
            let Some(w) = self.unbound.remove(&k) else { continue };
            if let Some(f) = self.free.get_mut(node).and_then(|f| f.get_mut(&res)) {
                *f -= need;
            }
            state.pod_bound(
                &k,
                PodRec {
                    tenant: w.tenant.clone(),
                    gpue: w.gpue,
                },
            );
            out.push(Bound {
                key: k.clone(),
                tenant: w.tenant.clone(),
                gpue: w.gpue,
            });
            self.running.insert(
                k,
                Running {
                    node,
                    started_ms: now_ms,
                    ends_at_ms: now_ms + w.pod.duration_ms,
                    pod: w.pod,
                    tenant: w.tenant,
                    gpue: w.gpue,
                },
            );
        }
        // What is left exists and waits for a node: the inventory shows it, as a real
        // cluster's watch does, and its reservation lasts while it does.
        for (k, w) in &self.unbound {
            if let Some(t) = &w.tenant {
                state.hold(k, t, w.gpue);
            }
        }
        out
    }

    /// Every pod the cluster knows, as an inventory would list them after an agent
    /// restart (running, admitted-unbound, gated), in key order within each phase.
    pub fn list_pods(&self) -> Vec<ListedPod> {
        let running = self.running.iter().map(|(k, r)| ListedPod {
            key: k.clone(),
            tenant: r.tenant.clone(),
            gpue: r.gpue,
            priority: r.pod.priority,
            phase: PodPhase::Running,
        });
        let waiting = |phase: PodPhase| {
            move |(k, w): (&PodKey, &Waiting)| ListedPod {
                key: k.clone(),
                tenant: w.tenant.clone(),
                gpue: w.gpue,
                priority: w.pod.priority,
                phase,
            }
        };
        running
            .chain(self.unbound.iter().map(waiting(PodPhase::Unbound)))
            .chain(self.gated.iter().map(waiting(PodPhase::Gated)))
            .collect()
    }

    /// Whether some node has `count` free devices of `resource` right now.
    pub fn fits(&self, resource: &str, count: u32) -> bool {
        self.free
            .iter()
            .any(|f| f.get(resource).copied().unwrap_or(0) >= u64::from(count))
    }

    /// Per node: its free devices of `resource`, and the running pods on it holding
    /// that resource with how many devices each holds and since when it runs.
    #[allow(clippy::type_complexity)]
    pub fn layout(&self, resource: &str) -> Vec<(u64, Vec<(PodKey, u64, Millis)>)> {
        let mut nodes: Vec<(u64, Vec<(PodKey, u64, Millis)>)> = self
            .free
            .iter()
            .map(|f| (f.get(resource).copied().unwrap_or(0), Vec::new()))
            .collect();
        for (k, r) in &self.running {
            if r.pod.resource == resource {
                if let Some(n) = nodes.get_mut(r.node) {
                    n.1.push((k.clone(), u64::from(r.pod.count), r.started_ms));
                }
            }
        }
        nodes
    }

    /// GPUe running per tenant.
    pub fn running_by_tenant(&self) -> BTreeMap<TenantName, MilliGpue> {
        let mut m = BTreeMap::new();
        for r in self.running.values() {
            if let Some(t) = &r.tenant {
                *m.entry(t.clone()).or_insert(0) += r.gpue;
            }
        }
        m
    }

    /// Training checkpoints every `ms`: an evicted pod loses the work since its last one.
    pub fn set_checkpoint_interval(&mut self, ms: Millis) {
        self.checkpoint_ms = ms.max(1);
    }

    /// A PodDisruptionBudget for every pod of `namespace`: evictions must leave at least
    /// `min_available` of its pods running.
    pub fn set_pdb(&mut self, namespace: &str, min_available: usize) {
        self.pdb_min_available.insert(namespace.to_string(), min_available);
    }

    /// Evicts a running pod through the (simulated) Eviction API: refused while its
    /// namespace's PodDisruptionBudget would be violated. An evicted pod loses the work
    /// since its last checkpoint and is handed to its owner for recreation
    /// ([`SimCluster::take_evicted`]) with the work it has left.
    pub fn evict(&mut self, state: &mut AgentState, key: &str, now_ms: Millis) -> EvictOutcome {
        let Some(r) = self.running.get(key) else {
            return EvictOutcome::NotFound;
        };
        if let Some(&min) = self.pdb_min_available.get(&r.pod.namespace) {
            let running_here = self
                .running
                .values()
                .filter(|x| x.pod.namespace == r.pod.namespace)
                .count();
            if running_here <= min {
                return EvictOutcome::Blocked;
            }
        }
        let Some((k, r)) = self.running.remove_entry(key) else {
            return EvictOutcome::NotFound;
        };
        if let Some(node) = self.free.get_mut(r.node) {
            *node.entry(r.pod.resource.clone()).or_insert(0) += u64::from(r.pod.count);
        }
        self.keep_finished(&k, &r, now_ms);
        state.pod_gone(key);
        let ran = now_ms.saturating_sub(r.started_ms);
        let lost = ran % self.checkpoint_ms.max(1);
        let left = r.ends_at_ms.saturating_sub(now_ms) + lost;
        if let Some(t) = &r.tenant {
            let c = self.cost.entry(t.clone()).or_default();
            c.pods += 1;
            c.lost_gpue_ms += r.gpue.saturating_mul(lost);
        }
        let mut again = r.pod;
        again.duration_ms = left.max(1);
        self.evicted.push(again);
        EvictOutcome::Evicted
    }

    /// Pods evicted since the last call, with the work they have left, for their owners
    /// to recreate (under new names, as controllers do).
    pub fn take_evicted(&mut self) -> Vec<SimPod> {
        std::mem::take(&mut self.evicted)
    }

    /// Events recorded on pods (evictions and refused evictions), oldest first.
    pub fn events(&self) -> &[SimEvent] {
        &self.events
    }

    /// Evictions and lost work per tenant.
    pub fn eviction_cost(&self) -> &BTreeMap<TenantName, EvictionCost> {
        &self.cost
    }

    /// One reclaim step: the agent plans over this cluster's pods and budgets, the
    /// cluster evicts through its Eviction API, every attempt becomes an Event on the
    /// victim pod and a record in the agent's reclaim audit.
    pub fn reclaim(&mut self, state: &mut AgentState, now_ms: Millis) -> Decision {
        let inputs = inventory::reclaim_view(self, state);
        let view = ClusterView {
            now_ms,
            capacity: state.capacity_gpue(),
            node_free: &inputs.node_free,
            node_total: &inputs.node_total,
            tenants: &inputs.tenants,
            running: &inputs.running,
            waiting: &inputs.waiting,
        };
        let decision = state.plan_reclaim(&view);
        if let Some((for_tenant, for_pod, summary, victims)) = inventory::victims(&decision) {
            for v in victims {
                let outcome = self.evict(state, &v.key, now_ms);
                let Some((reason, message, record)) =
                    inventory::eviction_record(now_ms, for_tenant, for_pod, summary, v, outcome)
                else {
                    continue;
                };
                self.events.push(SimEvent {
                    at_ms: now_ms,
                    pod: v.key.to_string(),
                    reason: reason.to_string(),
                    message,
                });
                state.record_eviction(record);
            }
        }
        decision
    }

    /// Advances to `now_ms`: finishes pods, ungates what the agent releases, binds what
    /// fits.
    pub fn step(&mut self, state: &mut AgentState, now_ms: Millis) {
        self.finish(state, now_ms);
        self.release(state);
        self.bind(state, now_ms);
    }
}

/// The simulated cluster as an inventory source: the same view the Kubernetes inventory
/// gives (nodes `node-0`, `node-1`, ...; namespaces are not modelled).
impl Inventory for SimCluster {
    fn synced(&self) -> bool {
        true
    }

    fn nodes(&self) -> Vec<NodeInfo> {
        self.total
            .iter()
            .enumerate()
            .map(|(i, d)| NodeInfo {
                name: format!("node-{i}"),
                devices: d.clone(),
                schedulable: true,
                labels: BTreeMap::new(),
                taints: Vec::new(),
            })
            .collect()
    }

    fn gpu_pods(&self) -> Vec<PodInfo> {
        let waiting = |k: &PodKey, w: &Waiting, stage| PodInfo {
            key: k.clone(),
            namespace: w.pod.namespace.clone(),
            stage,
            node: None,
            gpue: w.gpue,
            devices: [(w.pod.resource.clone(), u64::from(w.pod.count))].into(),
            priority: w.pod.priority,
            since_ms: w.since_ms,
            placement: Default::default(),
            generate_name: None,
            ran: None,
        };
        let mut out: Vec<PodInfo> = self
            .running
            .iter()
            .map(|(k, r)| PodInfo {
                key: k.clone(),
                namespace: r.pod.namespace.clone(),
                stage: PodStage::Bound,
                node: Some(format!("node-{}", r.node)),
                gpue: r.gpue,
                devices: [(r.pod.resource.clone(), u64::from(r.pod.count))].into(),
                priority: r.pod.priority,
                since_ms: r.started_ms,
                placement: Default::default(),
                generate_name: None,
                // On the clock callers drive this cluster with.
                ran: Some((r.started_ms, None)),
            })
            .collect();
        out.extend(self.unbound.iter().map(|(k, w)| waiting(k, w, PodStage::Unbound)));
        out.extend(self.gated.iter().map(|(k, w)| waiting(k, w, PodStage::Gated)));
        out
    }

    fn namespaces(&self) -> BTreeMap<String, BTreeMap<String, String>> {
        BTreeMap::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvota_fairness::lease::AgentLease;
    use kvota_fairness::names::ClusterName;

    #[test]
    fn mig_slices_bind_only_where_that_slice_is_free() {
        let mut c = SimCluster::with_nodes(vec![
            [(NVIDIA_GPU.to_string(), 1)].into(),
            [("nvidia.com/mig-3g.40gb".to_string(), 2)].into(),
        ]);
        assert_eq!(c.capacity_milli().get("nvidia.com/mig-3g.40gb"), Some(&2000));
        let mut st = AgentState::new(
            ClusterName::from_static("c"),
            1858,
            AgentLease::new(ClusterName::from_static("c")),
        );
        // No policy: pods are not governed, so they pass and bind by fit alone.
        let mut p = SimPod::gpus("ns", "a", 1, 1_000, 0);
        p.resource = "nvidia.com/mig-3g.40gb".into();
        assert_eq!(c.submit(&mut st, &p), Outcome::Passed);
        p.name = "b".into();
        c.submit(&mut st, &p);
        p.name = "c".into();
        c.submit(&mut st, &p);
        let bound = c.bind(&mut st, 0);
        assert_eq!(bound.len(), 2, "two slices, three pods: {bound:?}");
        assert_eq!(c.unbound(), 1);
        assert_eq!(c.finish(&mut st, 1_000).len(), 2);
        assert_eq!(c.bind(&mut st, 1_000).len(), 1);
    }
}
