//! The cluster inventory: what the agent knows about its cluster's nodes, GPU pods and
//! namespaces, whichever source it comes from.
//!
//! Two sources implement [`Inventory`]: the Kubernetes API ([`crate::kube::KubeInventory`],
//! kube-rs watchers) and the simulated cluster ([`crate::sim::SimCluster`]). Everything
//! downstream is shared and pure: [`sync_state`] turns an inventory into the agent's
//! admission state (bound pods are in use, admitted-unbound pods hold reservations,
//! gated pods wait in the queue), [`reclaim_view`] builds what reclaim plans over, and
//! [`eviction_record`] explains each eviction the same way for both.

use std::collections::{BTreeMap, BTreeSet};

use kvota_fairness::federation::EvictionOutcome;
use kvota_fairness::names::{PodKey, TenantName};
use kvota_fairness::reclaim::{Decision, RunningPod, TenantHere, Victim, WaitingPod};
use kvota_fairness::resources::ResourceWeights;
use kvota_fairness::{MilliGpue, Millis};

use crate::placement::{Placement, Taint};
use crate::state::{AgentState, PodRec, ReclaimRecord};

/// A node and the GPU devices it offers to pods.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInfo {
    /// Node name.
    pub name: String,
    /// Allocatable GPU devices (whole GPUs, MIG slices, ...) by resource name, in
    /// units (not thousandths).
    pub devices: BTreeMap<String, u64>,
    /// False when the node is cordoned (`spec.unschedulable`) or not Ready: its GPUs are
    /// not offered to new pods and do not count as capacity.
    pub schedulable: bool,
    /// Labels (for node selectors and affinity).
    pub labels: BTreeMap<String, String>,
    /// Taints.
    pub taints: Vec<Taint>,
}

/// Where a pod stands, as far as GPU accounting goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodStage {
    /// Waiting behind kvota's scheduling gate (queued by the mutating webhook).
    Gated,
    /// Admitted, not yet on a node (or gated by someone else after kvota admitted it).
    Unbound,
    /// On a node and not finished: it holds its GPUs.
    Bound,
    /// Succeeded or failed: it holds nothing.
    Finished,
}

/// A pod that asks for GPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodInfo {
    /// `namespace/name`, the key the webhook knows it by.
    pub key: PodKey,
    /// Namespace (maps to a tenant through the policy).
    pub namespace: String,
    /// Where it stands.
    pub stage: PodStage,
    /// Node it is bound to (index into [`Inventory::nodes`] order is resolved later).
    pub node: Option<String>,
    /// GPUe it requests, as Kubernetes computes pod requests.
    pub gpue: MilliGpue,
    /// GPU devices it requests by resource name, in units.
    pub devices: BTreeMap<String, u64>,
    /// `spec.priority` (0 when unset).
    pub priority: i32,
    /// Agent-clock time it started running (bound) or started waiting (otherwise).
    pub since_ms: Millis,
    /// Which nodes it may run on (node selector, required affinity, tolerations).
    pub placement: Placement,
    /// `metadata.generateName`, if the name was generated: the mutating webhook judged
    /// it before it had a name, under a provisional key (`namespace/prefix*uid`).
    pub generate_name: Option<String>,
    /// When it held its GPUs, on the wall clock (Unix ms): from being scheduled to a
    /// node until it finished (`None` while running). `None` for a pod never bound, or
    /// when the source does not know.
    pub ran: Option<(u64, Option<u64>)>,
}

/// Usage per tenant (milli-GPUe x ms) of `pods` between wall-clock instants `from_ms`
/// and `to_ms`: each pod's GPUe times the part of its run time inside the interval.
/// `tenant_of` maps a namespace to its tenant (pods of no tenant count for nobody).
pub fn usage_between(
    pods: &[PodInfo],
    from_ms: u64,
    to_ms: u64,
    tenant_of: impl Fn(&str) -> Option<TenantName>,
) -> BTreeMap<TenantName, u64> {
    let mut out = BTreeMap::new();
    if to_ms <= from_ms {
        return out;
    }
    for p in pods {
        let Some((start, end)) = p.ran else { continue };
        let (a, b) = (start.max(from_ms), end.unwrap_or(to_ms).min(to_ms));
        if b <= a {
            continue;
        }
        let Some(t) = tenant_of(&p.namespace) else { continue };
        let e: &mut u64 = out.entry(t).or_insert(0);
        *e = e.saturating_add(p.gpue.saturating_mul(b - a));
    }
    out
}

impl PodInfo {
    /// The device the pod needs most of, for fit checks: `(resource, count)`.
    pub fn main_device(&self) -> (String, u64) {
        self.devices
            .iter()
            .max_by_key(|(_, c)| **c)
            .map(|(r, c)| (r.clone(), *c))
            .unwrap_or_else(|| {
                (
                    kvota_fairness::resources::NVIDIA_GPU.to_string(),
                    self.gpue.div_ceil(1000),
                )
            })
    }
}

/// What an inventory source offers. Both implementations keep only GPU pods.
pub trait Inventory {
    /// Whether the first complete listing of nodes, pods and namespaces has arrived.
    /// Before that the agent must not judge pods: it does not know what is in use.
    fn synced(&self) -> bool;
    /// Nodes, in a stable order.
    fn nodes(&self) -> Vec<NodeInfo>;
    /// Pods asking for GPUs.
    fn gpu_pods(&self) -> Vec<PodInfo>;
    /// Namespace labels by namespace name.
    fn namespaces(&self) -> BTreeMap<String, BTreeMap<String, String>>;
}

/// Capacity per resource in thousandths (as registered with the control plane): the
/// allocatable GPU devices of schedulable nodes.
pub fn capacity_milli(inv: &dyn Inventory) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for n in inv.nodes().iter().filter(|n| n.schedulable) {
        for (r, c) in &n.devices {
            *out.entry(r.clone()).or_insert(0u64) += c.saturating_mul(1000);
        }
    }
    out
}

/// Capacity in GPUe.
pub fn capacity_gpue(inv: &dyn Inventory) -> MilliGpue {
    ResourceWeights::new().capacity_gpue_milli(&capacity_milli(inv))
}

/// Brings the agent's admission state in line with the inventory. `known` is the set
/// of pod keys the previous call saw (the caller keeps it between calls); a pod that
/// was known and is now missing or finished is gone. Pods the webhook admitted but the
/// inventory has not shown yet keep their webhook reservation.
///
/// - bound, unfinished pods are in use;
/// - unbound pods without kvota's gate were admitted: they hold a reservation for as
///   long as they exist (refreshed on every call), so a pod that waits long for a node
///   is never forgotten and cannot let another one past its tenant's budget;
/// - gated pods are queued (again, after a restart or a change of leader).
///
/// Returns how many pods are now known.
pub fn sync_state(inv: &dyn Inventory, state: &mut AgentState, known: &mut BTreeSet<PodKey>) -> usize {
    for (ns, labels) in inv.namespaces() {
        state.set_namespace(&ns, labels);
    }
    state.set_capacity_gpue(capacity_gpue(inv));
    let mut seen = BTreeSet::new();
    for p in inv.gpu_pods() {
        let tenant = state.tenant_of_namespace(&p.namespace);
        // A pod judged before it had a name: its reservation or queue place moves to its
        // real name, so it is not counted twice.
        if let Some(prefix) = p
            .generate_name
            .as_deref()
            .filter(|_| p.stage != PodStage::Finished && !state.knows(&p.key))
        {
            state.adopt_provisional(
                &format!("{}/{prefix}*", p.namespace),
                &p.key,
                p.gpue,
                p.stage == PodStage::Gated,
            );
        }
        match p.stage {
            PodStage::Finished => continue,
            PodStage::Bound => state.pod_bound(&p.key, PodRec { tenant, gpue: p.gpue }),
            PodStage::Unbound => {
                if let Some(t) = tenant {
                    state.hold(&p.key, &t, p.gpue);
                }
            }
            PodStage::Gated => {
                if let Some(t) = tenant {
                    state.requeue(&p.key, &t, p.gpue, p.priority, p.since_ms);
                }
            }
        }
        seen.insert(p.key);
    }
    for gone in known.difference(&seen) {
        state.pod_gone(gone);
    }
    state.reclassify_once();
    *known = seen;
    known.len()
}

/// What reclaim plans over: node free/total devices, running and waiting pods with
/// their tenants, from the inventory and the agent's recent denials.
#[derive(Clone, Debug, Default)]
pub struct ReclaimInputs {
    /// Free devices per node.
    pub node_free: Vec<BTreeMap<String, u64>>,
    /// Total devices per node.
    pub node_total: Vec<BTreeMap<String, u64>>,
    /// Running pods of tenants.
    pub running: Vec<RunningPod>,
    /// Waiting pods of tenants.
    pub waiting: Vec<WaitingPod>,
    /// Policy tenants here.
    pub tenants: Vec<TenantHere>,
}

/// Builds [`ReclaimInputs`] from an inventory and the agent's state.
pub fn reclaim_view(inv: &dyn Inventory, state: &AgentState) -> ReclaimInputs {
    let nodes: Vec<NodeInfo> = inv.nodes().into_iter().filter(|n| n.schedulable).collect();
    let index: BTreeMap<&str, usize> = nodes.iter().enumerate().map(|(i, n)| (n.name.as_str(), i)).collect();
    let node_total: Vec<BTreeMap<String, u64>> = nodes.iter().map(|n| n.devices.clone()).collect();
    let mut node_free = node_total.clone();
    let mut running = Vec::new();
    let mut waiting = Vec::new();
    for p in inv.gpu_pods() {
        let tenant = state.tenant_of_namespace(&p.namespace);
        match p.stage {
            PodStage::Bound => {
                let Some(&i) = p.node.as_deref().and_then(|n| index.get(n)) else {
                    continue;
                };
                if let Some(free) = node_free.get_mut(i) {
                    for (r, c) in &p.devices {
                        let f = free.entry(r.clone()).or_insert(0);
                        *f = f.saturating_sub(*c);
                    }
                }
                let Some(tenant) = tenant else { continue };
                let (resource, count) = p.main_device();
                running.push(RunningPod {
                    borrowed: state.is_borrowed(&p.key),
                    key: p.key,
                    tenant,
                    gpue: p.gpue,
                    priority: p.priority,
                    started_ms: p.since_ms,
                    node: i,
                    resource,
                    count,
                });
            }
            PodStage::Unbound | PodStage::Gated => {
                let Some(tenant) = tenant else { continue };
                let (resource, count) = p.main_device();
                let eligible: Vec<usize> = nodes
                    .iter()
                    .enumerate()
                    .filter(|(_, n)| p.placement.allows(&n.name, &n.labels, &n.taints))
                    .map(|(i, _)| i)
                    .collect();
                waiting.push(WaitingPod {
                    key: p.key,
                    tenant,
                    gpue: p.gpue,
                    priority: p.priority,
                    since_ms: p.since_ms,
                    resource,
                    count,
                    nodes: (eligible.len() < nodes.len()).then_some(eligible),
                });
            }
            PodStage::Finished => {}
        }
    }
    add_denied_pods(&mut waiting, state);
    ReclaimInputs {
        node_free,
        node_total,
        running,
        waiting,
        tenants: state.reclaim_tenants(),
    }
}

/// A denied pod is demand too (in `reject` mode it does not exist in the API); its
/// device is taken as whole GPUs, the agent keeps only its GPUe.
fn add_denied_pods(waiting: &mut Vec<WaitingPod>, state: &AgentState) {
    for (key, tenant, gpue) in state.denied_pods() {
        if !waiting.iter().any(|w| w.key == key) {
            waiting.push(WaitingPod {
                key,
                tenant,
                gpue,
                priority: 0,
                since_ms: state.now_ms(),
                resource: kvota_fairness::resources::NVIDIA_GPU.to_string(),
                count: gpue.div_ceil(1000).max(1),
                // Not known: the agent keeps no spec of a denied pod.
                nodes: None,
            });
        }
    }
}

/// How an eviction request ended (the Eviction API's answers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvictOutcome {
    /// The pod is being evicted; its owner will recreate it.
    Evicted,
    /// A PodDisruptionBudget forbids it now (HTTP 429): retried later, never forced.
    Blocked,
    /// No such pod (it finished meanwhile).
    NotFound,
}

/// The Kubernetes Event reason, message and audit record for one eviction attempt of
/// a [`Decision::Evict`]. `None` for [`EvictOutcome::NotFound`] (nothing happened).
pub fn eviction_record(
    now_ms: Millis,
    for_tenant: &TenantName,
    for_pod: &PodKey,
    summary: &str,
    victim: &Victim,
    outcome: EvictOutcome,
) -> Option<(&'static str, String, ReclaimRecord)> {
    let (reason, word, message) = match outcome {
        EvictOutcome::Evicted => (
            "Evicted",
            EvictionOutcome::Evicted,
            format!("kvota: evicted to give tenant `{for_tenant}` GPUs it is owed here. {summary}. This pod: {}", victim.why),
        ),
        EvictOutcome::Blocked => (
            "EvictionBlocked",
            EvictionOutcome::Blocked,
            format!(
                "kvota: eviction refused by the PodDisruptionBudget of namespace `{}`; not forced, retried later. {summary}. This pod: {}",
                victim.key.split('/').next().unwrap_or(""),
                victim.why
            ),
        ),
        EvictOutcome::NotFound => return None,
    };
    let record = ReclaimRecord {
        at_ms: now_ms,
        for_tenant: for_tenant.clone(),
        for_pod: for_pod.clone(),
        victim: victim.key.clone(),
        victim_tenant: victim.tenant.clone(),
        gpue: victim.gpue,
        outcome: word,
        why: format!("{summary}. This pod: {}", victim.why),
    };
    Some((reason, message, record))
}

/// The victims of a decision with its context, or nothing for other decisions.
pub fn victims(decision: &Decision) -> Option<(&TenantName, &PodKey, &str, &[Victim])> {
    match decision {
        Decision::Evict {
            for_tenant,
            for_pod,
            victims,
            summary,
            ..
        } => Some((for_tenant, for_pod, summary.as_str(), victims.as_slice())),
        _ => None,
    }
}
