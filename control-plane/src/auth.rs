//! Who may call what. Every gRPC method and HTTP route names the roles it admits; the
//! caller's role comes from its certificate (`kvota_tls::PeerInfo`, filled in when the
//! connection was accepted). Without TLS (loopback development, or `--insecure`) there
//! are no identities and everything is allowed: that mode is for trusted networks only.
//!
//! | what | roles |
//! |---|---|
//! | `Member.*` | cluster (for its own cluster only); node (forwarded by a follower) |
//! | `Admin.ApplyPolicy`, `RemoveCluster`, `Initialize`, `AddLearner`, `ChangeMembership` | operator; node (forwarded) |
//! | `Admin.GetPolicy` | viewer, operator, node, cluster (agents enforce the policy) |
//! | other `Admin` reads, `ValidatePolicy` | viewer, operator, node |
//! | `Raft.*` (own port) | node, and only for itself as sender |
//! | HTTP `/healthz`, `/readyz` | anyone (probes carry no certificate) |
//! | HTTP `/metrics`, `/api/...` | viewer, operator, node |
//!
//! A refusal is `UNAUTHENTICATED` (no identity) or `PERMISSION_DENIED` (the wrong one),
//! logged with the caller and counted in `kvota_auth_denied_total`.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvota_tls::{Identity, PeerInfo, Role};
use tonic::{Request, Status};

use crate::metrics::Metrics;
use crate::node::FORWARDED_HEADER;

/// Roles of state-changing admin calls.
pub const OPERATE: &[Role] = &[Role::Operator];
/// Roles of reads.
pub const READ: &[Role] = &[Role::Viewer, Role::Operator, Role::Node];
/// Roles that may read the policy: readers and the agents that enforce it.
pub const READ_POLICY: &[Role] = &[Role::Viewer, Role::Operator, Role::Node, Role::Cluster];
/// Roles of member calls.
pub const MEMBER: &[Role] = &[Role::Cluster];

/// Who is calling, as far as authorization is concerned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    /// TLS is off: no identities, everything allowed.
    Anyone,
    /// A party with a verified identity.
    Party(Identity),
}

impl Caller {
    /// The identity, if any.
    pub fn identity(&self) -> Option<&Identity> {
        match self {
            Caller::Anyone => None,
            Caller::Party(i) => Some(i),
        }
    }
}

/// Decides and records refusals.
#[derive(Debug)]
pub struct Authz {
    enabled: bool,
    metrics: Metrics,
    log: Mutex<(Option<Instant>, u64)>,
}

/// Refusals are logged at most this often (each counted in the metric).
const LOG_EVERY: Duration = Duration::from_secs(5);

impl Authz {
    /// `enabled`: TLS is on and identities are checked.
    pub fn new(enabled: bool, metrics: Metrics) -> Self {
        Authz {
            enabled,
            metrics,
            log: Mutex::new((None, 0)),
        }
    }

    /// Whether identities are checked.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Records a refusal and returns its status.
    pub fn deny(&self, service: &str, method: &str, reason: &str, who: &str, status: Status) -> Status {
        self.note(service, method, reason, who, status.message());
        status
    }

    /// Records a refusal: counted always, logged at most every few seconds (with how many
    /// were not), so a flood of refused calls cannot flood the log.
    pub fn note(&self, service: &str, method: &str, reason: &str, who: &str, message: &str) {
        self.metrics.denied(service, method, reason);
        let mut g = self.log.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        if g.0.is_some_and(|t| now.duration_since(t) < LOG_EVERY) {
            g.1 += 1;
        } else {
            let suppressed = std::mem::take(&mut g.1);
            g.0 = Some(now);
            drop(g);
            tracing::warn!(
                service,
                method,
                reason,
                caller = who,
                suppressed,
                message,
                "call refused"
            );
        }
    }

    /// The caller of `req` if it may call `service.method` as one of `roles`. A node
    /// may also make any call a follower forwards to the leader (writes it authorized
    /// already); it must mark it forwarded.
    pub fn check<T>(&self, req: &Request<T>, service: &str, method: &str, roles: &[Role]) -> Result<Caller, Status> {
        if !self.enabled {
            return Ok(Caller::Anyone);
        }
        let peer = req.extensions().get::<PeerInfo>();
        let Some(id) = peer.and_then(|p| p.identity.clone()) else {
            let who = peer.map_or_else(|| "unknown".to_string(), |p| p.addr.to_string());
            return Err(self.deny(
                service,
                method,
                "unauthenticated",
                &who,
                Status::unauthenticated("a client certificate naming a kvota identity is required"),
            ));
        };
        if kvota_tls::verify::admits(&id, roles) {
            return Ok(Caller::Party(id));
        }
        if id.role() == Role::Node {
            if req.metadata().contains_key(FORWARDED_HEADER) {
                return Ok(Caller::Party(id));
            }
            return Err(self.deny(
                service,
                method,
                "not_forwarded",
                &id.to_string(),
                Status::permission_denied(format!("{id} may make {service}.{method} only as a forwarded call")),
            ));
        }
        let allowed: Vec<&str> = roles.iter().map(|r| r.as_str()).collect();
        Err(self.deny(
            service,
            method,
            "role",
            &id.to_string(),
            Status::permission_denied(format!(
                "{id} may not call {service}.{method} (allowed: {})",
                allowed.join(", ")
            )),
        ))
    }

    /// A member call for `cluster`: a cluster identity may act only for its own name.
    pub fn for_cluster(&self, caller: &Caller, method: &str, cluster: &str) -> Result<(), Status> {
        match caller {
            Caller::Party(id) if id.role() == Role::Cluster && id.name() != cluster => Err(self.deny(
                "member",
                method,
                "cluster_mismatch",
                &id.to_string(),
                Status::permission_denied(format!(
                    "{id} may act only for cluster `{}`, not `{}`",
                    id.name(),
                    cluster.chars().take(64).collect::<String>()
                )),
            )),
            _ => Ok(()),
        }
    }
}
