//! [`Controller`]: the leader's duties, one round at a time: sync the agent's state with
//! the inventory, release gated pods that fit, reclaim for starved tenants.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use super::{KubeActions, KubeInventory};
use crate::inventory::Inventory;
use kvota_fairness::names::PodKey;

/// The leader's duties in a Kubernetes cluster, one round at a time: bring the agent's
/// state in line with the inventory, release gated pods that fit their budget now (the
/// gate controller), and reclaim for starved tenants through the Eviction API.
#[derive(Debug)]
pub struct Controller {
    inventory: Arc<KubeInventory>,
    actions: KubeActions,
    known: std::collections::BTreeSet<PodKey>,
    metering: bool,
}

/// What one [`Controller::release_gates`] round did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// Pods whose kvota gate was removed.
    pub ungated: Vec<PodKey>,
    /// Pods the gate could not be removed from (API errors); retried next round.
    pub failed: Vec<PodKey>,
}

impl Controller {
    /// A controller over `inventory` acting through `actions`.
    pub fn new(inventory: Arc<KubeInventory>, actions: KubeActions) -> Self {
        Controller {
            inventory,
            actions,
            known: Default::default(),
            metering: false,
        }
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
            agent
                .state()
                .set_held(Some("the agent has not listed the cluster's nodes and pods yet".into()));
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
            let now_ms = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            agent.meter_started(now_ms);
        }
        true
    }

    /// Removes the gate from the pods the agent releases (priority, then age, as budget
    /// allows). A pod whose patch fails goes back to the queue for the next round.
    pub async fn release_gates(&mut self, agent: &crate::agent::Agent) -> Released {
        let released = agent.state().release_queue();
        let mut out = Released::default();
        for crate::state::ReleasedPod {
            key,
            tenant,
            queued_at_ms,
        } in released
        {
            match self.actions.ungate(&key).await {
                Ok(lifted) => {
                    let waited_ms = {
                        let mut st = agent.state();
                        st.note_wait(&tenant, queued_at_ms);
                        st.now_ms().saturating_sub(queued_at_ms)
                    };
                    let message = format!(
                        "kvota removed its scheduling gate: tenant `{tenant}`'s budget in this cluster has room for it now (queued {})",
                        kvota_fairness::units::format_duration_ms(waited_ms)
                    );
                    if lifted {
                        if let Err(e) = self.actions.event(&key, "Released", &message).await {
                            tracing::debug!(pod = %key, error = %e, "could not record the Released Event");
                        }
                    }
                    out.ungated.push(key);
                }
                Err(e) => {
                    tracing::warn!(pod = %key, error = %e, "could not remove the scheduling gate; retrying next round");
                    agent.state().pod_gone(&key);
                    self.known.remove(&key);
                    out.failed.push(key);
                }
            }
        }
        // Pods still waiting behind the gate, announced once each: `kubectl describe pod`
        // says why it is not scheduled.
        let notices = agent.state().queue_notices();
        for (key, message) in notices {
            if let Err(e) = self.actions.event(&key, "Queued", &message).await {
                tracing::debug!(pod = %key, error = %e, "could not record the Queued Event");
            }
        }
        // Denied pods were never created: the Event goes on their namespace, so
        // `kubectl get events -n NS` shows why.
        let denials = agent.state().denial_notices();
        for (key, message) in denials {
            let ns = key.split_once('/').map_or(key.as_str(), |(ns, _)| ns);
            if let Err(e) = self.actions.namespace_event(ns, "AdmissionDenied", &message).await {
                tracing::debug!(pod = %key, error = %e, "could not record the AdmissionDenied Event");
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
                tracing::warn!(pod = %v.key, for_tenant = %for_tenant, outcome = %record.outcome, "{message}");
                if let Err(e) = self.actions.event(&v.key, reason, &message).await {
                    tracing::warn!(pod = %v.key, error = %e, "could not record the eviction Event (the audit log has it)");
                }
                agent.state().record_eviction(record);
            }
        }
        decision
    }
}
