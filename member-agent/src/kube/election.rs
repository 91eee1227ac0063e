//! [`Election`]: which of several agent replicas in one cluster is the leader, through
//! a `coordination.k8s.io/v1` Lease; [`RoleMarker`]: the label on each replica's pod
//! that steers the webhook Service to the leader.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease as KubeLease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::{json, Value};

use super::api_status;
use super::convert::{format_time, to_json, wall_now_s};

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

    /// Until when this replica may act as the leader without renewing (`None`: it does
    /// not lead). Work that must not outlive leadership ends by then.
    pub fn leading_until(&self) -> Option<Instant> {
        self.leading_until.filter(|t| Instant::now() < *t)
    }

    /// The holder last seen (this replica's identity when it leads).
    pub fn holder(&self) -> Option<&str> {
        self.holder.as_deref()
    }

    /// How often to call [`Election::step`]: a third of the duration.
    pub fn period(&self) -> Duration {
        self.duration / 3
    }

    /// The Lease's name.
    pub fn lease_name(&self) -> &str {
        &self.name
    }

    /// One round: take the Lease if it is free or expired, renew it if held. Returns
    /// whether this replica leads afterwards. Runs in an `election_step` span (the
    /// Lease, this replica's identity; the holder seen and whether this replica leads
    /// are filled in at the end).
    pub async fn step(&mut self) -> Result<bool, kube::Error> {
        use tracing::Instrument as _;
        let span = tracing::info_span!(
            "election_step",
            lease = %self.name,
            identity = %self.identity,
            holder = tracing::field::Empty,
            leading = tracing::field::Empty,
        );
        let result = self.try_step().instrument(span.clone()).await;
        span.record("holder", self.holder.as_deref().unwrap_or(""));
        if let Ok(leading) = result {
            span.record("leading", leading);
        }
        result
    }

    async fn try_step(&mut self) -> Result<bool, kube::Error> {
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
        let holder = spec
            .get("holderIdentity")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let renew = spec.get("renewTime").and_then(Value::as_str).unwrap_or("").to_string();
        let transitions = spec.get("leaseTransitions").and_then(Value::as_i64).unwrap_or(0);
        let record = format!("{holder}@{renew}");
        if self.observed.as_ref().is_none_or(|(r, _)| *r != record) {
            self.observed = Some((record, started));
        }
        self.holder = Some(holder.clone()).filter(|h| !h.is_empty());
        let mine = holder == self.identity;
        let expired = holder.is_empty()
            || self
                .observed
                .as_ref()
                .is_some_and(|(_, at)| started.duration_since(*at) >= self.duration);
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
        RoleMarker {
            api: Api::namespaced(client, namespace),
            pod: pod.to_string(),
        }
    }

    async fn set(&self, pod: &str, role: &str) -> Result<(), kube::Error> {
        let patch = json!({ "metadata": { "labels": { ROLE_LABEL: role } } });
        match self
            .api
            .patch(pod, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
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
            let leader = p
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(ROLE_LABEL))
                .is_some_and(|r| r == "leader");
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
