//! gRPC handlers: `kvota.v1.Member` and `kvota.v1.Admin`.
//!
//! Each handler validates its message (the `proto` crate's `TryFrom`), then either
//! proposes a command through Raft (writes) or reads this node's applied state (reads).
//! A follower forwards writes to the leader once; a forwarded write that lands on a
//! non-leader is answered `UNAVAILABLE` with the leader's address in `kvota-leader`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use kvota_fairness::federation::{Applied, Command, UsageReport};
use kvota_fairness::names::TenantName;
use kvota_fairness::policy::Policy;
use kvota_proto::convert::{self, Registration};
use kvota_proto::v1::{self, admin_client::AdminClient, member_client::MemberClient};
use openraft::error::{ClientWriteError, RaftError};
use tonic::{Request, Response, Status};

use crate::auth::{MEMBER, OPERATE, READ, READ_POLICY};
use tracing::Instrument as _;

use crate::node::{no_leader, refusal, NodeCtx, Proposed, FORWARDED_HEADER, LEADER_HEADER};
use crate::types::Node as NodeAddr;

/// The Member service.
#[derive(Clone, Debug)]
pub struct MemberSvc {
    ctx: Arc<NodeCtx>,
}

/// The Admin service.
#[derive(Clone, Debug)]
pub struct AdminSvc {
    ctx: Arc<NodeCtx>,
}

impl MemberSvc {
    /// Handlers over `ctx`.
    pub fn new(ctx: Arc<NodeCtx>) -> Self {
        MemberSvc { ctx }
    }
}

impl AdminSvc {
    /// Handlers over `ctx`.
    pub fn new(ctx: Arc<NodeCtx>) -> Self {
        AdminSvc { ctx }
    }
}

fn invalid(e: convert::Invalid) -> Status {
    Status::invalid_argument(e.to_string())
}

fn was_forwarded<T>(req: &Request<T>) -> bool {
    req.metadata().contains_key(FORWARDED_HEADER)
}

/// `UNAVAILABLE` naming the leader, for a request that must not be forwarded again.
fn not_leader(addr: &str) -> Status {
    let mut s = Status::unavailable(format!("not the leader; the leader is at {addr}"));
    if let Ok(v) = addr.parse() {
        s.metadata_mut().insert(LEADER_HEADER, v);
    }
    s
}

fn forwarded<T>(msg: T) -> Request<T> {
    let mut r = Request::new(msg);
    r.metadata_mut()
        .insert(FORWARDED_HEADER, tonic::metadata::MetadataValue::from_static("1"));
    r
}

/// Names the party a forwarded write is from (the leader's audit log records it).
const ACTOR_HEADER: &str = "kvota-actor";

/// Who the audit log names for a write: `role/name` of the caller's certificate; for a
/// call a follower forwarded (nodes forward only what they authorized), the party it
/// names; none without TLS.
fn actor_of<T>(caller: &crate::auth::Caller, req: &Request<T>) -> Option<String> {
    let crate::auth::Caller::Party(id) = caller else {
        return None;
    };
    if id.role() == kvota_tls::Role::Node {
        return req
            .metadata()
            .get(ACTOR_HEADER)
            .and_then(|v| v.to_str().ok())
            .filter(|a| a.len() <= kvota_fairness::federation::MAX_ACTOR_LEN)
            .map(str::to_string);
    }
    Some(format!("{}/{}", id.role().as_str(), id.name()))
}

fn unexpected(what: &str, got: &Applied) -> Status {
    Status::internal(format!("state machine answered {what} with {got:?}"))
}

impl NodeCtx {
    /// The policy revision a member's call is answered with: the leader's answer when
    /// the call was forwarded (`leaders`, 0 if not), else this node's state, which has
    /// applied the call.
    async fn revision_answered(&self, leaders: &std::sync::atomic::AtomicU64) -> u64 {
        match leaders.load(std::sync::atomic::Ordering::Relaxed) {
            0 => self.state.read().await.federation.policy_revision().0,
            r => r,
        }
    }

    /// Proposes, or forwards to the leader through `via` (once).
    async fn write_or_forward<M: Clone>(
        self: &Arc<Self>,
        command: Command,
        actor: Option<String>,
        already_forwarded: bool,
        msg: M,
        via: impl AsyncFnOnce(tonic::transport::Channel, Request<M>) -> Result<Response<Applied>, Status>,
    ) -> Result<Applied, Status> {
        match self.propose_as(command, actor.clone()).await? {
            Proposed::Done(Ok(a)) => Ok(a),
            Proposed::Done(Err(e)) => Err(refusal(e)),
            Proposed::Forward(addr) if already_forwarded => Err(not_leader(&addr)),
            Proposed::Forward(addr) => {
                let ch = self.channel(&addr).await?;
                let mut req = forwarded(msg);
                if let Some(v) = actor.and_then(|a| a.parse().ok()) {
                    req.metadata_mut().insert(ACTOR_HEADER, v);
                }
                match via(ch, req).await {
                    Ok(r) => Ok(r.into_inner()),
                    Err(s) => {
                        if s.code() == tonic::Code::Unavailable {
                            self.drop_channel(&addr).await;
                        }
                        Err(s)
                    }
                }
            }
        }
    }
}

/// What the leader answered a forwarded report, as this node's own write would.
fn leaders_report_answer(r: v1::ReportReply) -> Result<Response<Applied>, Status> {
    if r.expected_seq > 0 {
        // The leader answered a gap in the reply form: carry it back as
        // the error form, which the end of this handler turns back.
        return Err(crate::node::sequence_gap(
            r.expected_seq,
            format!("sequence gap: the control plane expects report {}", r.expected_seq),
        ));
    }
    let lease = r
        .lease
        .ok_or_else(|| Status::internal("leader answered without a lease"))?;
    let lease = kvota_fairness::lease::Lease::try_from(lease).map_err(invalid)?;
    Ok(Response::new(Applied::Reported {
        applied: r.applied,
        lease,
    }))
}

#[tonic::async_trait]
impl v1::member_server::Member for MemberSvc {
    async fn register(&self, request: Request<v1::RegisterRequest>) -> Result<Response<v1::LeaseReply>, Status> {
        let caller = self.ctx.authz.check(&request, "member", "Register", MEMBER)?;
        let fwd = was_forwarded(&request);
        let msg = request.into_inner();
        let reg = Registration::try_from(msg.clone()).map_err(invalid)?;
        self.ctx.authz.for_cluster(&caller, "Register", &reg.cluster)?;
        let cmd = Command::RegisterCluster {
            cluster: reg.cluster,
            capacity: reg.capacity,
            labels: reg.labels,
        };
        let leaders_revision = std::sync::atomic::AtomicU64::new(0);
        let applied = self
            .ctx
            .write_or_forward(cmd, None, fwd, msg, async |ch, req| {
                let reply = MemberClient::new(ch).register(req).await?.into_inner();
                leaders_revision.store(reply.policy_revision, std::sync::atomic::Ordering::Relaxed);
                let lease = reply
                    .lease
                    .ok_or_else(|| Status::internal("leader answered without a lease"))?;
                let lease = kvota_fairness::lease::Lease::try_from(lease).map_err(invalid)?;
                Ok(Response::new(Applied::Registered(lease)))
            })
            .await?;
        let policy_revision = self.ctx.revision_answered(&leaders_revision).await;
        match applied {
            Applied::Registered(lease) => Ok(Response::new(v1::LeaseReply {
                lease: Some(v1::Lease::from(&lease)),
                policy_revision,
            })),
            other => Err(unexpected("a registration", &other)),
        }
    }

    async fn report(&self, request: Request<v1::ReportRequest>) -> Result<Response<v1::ReportReply>, Status> {
        let caller = self.ctx.authz.check(&request, "member", "Report", MEMBER)?;
        let fwd = was_forwarded(&request);
        let msg = request.into_inner();
        let gap_in_reply = msg.gap_in_reply;
        let report = match UsageReport::try_from(msg.clone()) {
            Ok(r) => r,
            Err(e) => {
                self.ctx.metrics.report("rejected");
                return Err(invalid(e));
            }
        };
        self.ctx.authz.for_cluster(&caller, "Report", &report.cluster)?;
        let span = tracing::info_span!("report", cluster = %report.cluster, seq = report.seq, tenants = report.tenants.len(), forwarded = fwd);
        let leaders_revision = std::sync::atomic::AtomicU64::new(0);
        let result = self
            .ctx
            .write_or_forward(Command::Report(report), None, fwd, msg, async |ch, req| {
                let r = MemberClient::new(ch).report(req).await?.into_inner();
                leaders_revision.store(r.policy_revision, std::sync::atomic::Ordering::Relaxed);
                leaders_report_answer(r)
            })
            .instrument(span.clone())
            .await;
        let policy_revision = self.ctx.revision_answered(&leaders_revision).await;
        let _entered = span.enter();
        match result {
            Ok(Applied::Reported { applied, lease }) => {
                self.ctx.metrics.report(if applied { "applied" } else { "duplicate" });
                tracing::debug!(
                    applied,
                    epoch = lease.epoch,
                    budgets = lease.budgets.len(),
                    "lease sent"
                );
                Ok(Response::new(v1::ReportReply {
                    applied,
                    lease: Some(v1::Lease::from(&lease)),
                    expected_seq: 0,
                    policy_revision,
                }))
            }
            Ok(other) => Err(unexpected("a report", &other)),
            Err(s) => {
                self.ctx.metrics.report("rejected");
                match crate::node::gap_of(&s).filter(|_| gap_in_reply) {
                    Some(expected) => Ok(Response::new(v1::ReportReply {
                        applied: false,
                        lease: None,
                        expected_seq: expected,
                        policy_revision,
                    })),
                    None => Err(s),
                }
            }
        }
    }

    async fn describe_cluster(
        &self,
        request: Request<v1::DescribeClusterRequest>,
    ) -> Result<Response<v1::ClusterInfo>, Status> {
        let caller = self.ctx.authz.check(&request, "member", "DescribeCluster", MEMBER)?;
        let id = convert::cluster_id("cluster", &request.into_inner().cluster).map_err(invalid)?;
        self.ctx.authz.for_cluster(&caller, "DescribeCluster", &id)?;
        let state = self.ctx.state.read().await;
        cluster_info(&state.federation, &id)
            .map(Response::new)
            .ok_or_else(|| Status::not_found(format!("cluster `{id}` is not registered")))
    }
}

/// A cluster as the wire shows it.
pub fn cluster_info(fed: &kvota_fairness::federation::Federation, id: &str) -> Option<v1::ClusterInfo> {
    let rec = fed.clusters().get(id)?;
    let now = fed.now_ms();
    let newest = rec.leases.latest();
    let mut names: BTreeSet<&TenantName> = rec.usage.keys().collect();
    if let Some(l) = newest {
        names.extend(l.budgets.keys());
    }
    let tenants = names
        .into_iter()
        .map(|t| {
            let u = rec.usage.get(t).copied().unwrap_or_default();
            let b = newest.and_then(|l| l.budgets.get(t)).copied().unwrap_or_default();
            v1::ClusterTenant {
                tenant: t.to_string(),
                running_milli_gpue: rec.running(t),
                inuse_milli_gpue: u.inuse,
                pending_milli_gpue: u.pending,
                budget_milli_gpue: b.budget,
                fallback_milli_gpue: b.fallback,
                enforceable_milli_gpue: rec.leases.enforceable(t, now),
            }
        })
        .collect();
    Some(v1::ClusterInfo {
        cluster: id.to_string(),
        capacity: convert::resources(&rec.capacity),
        labels: rec.labels.clone().into_iter().collect(),
        capacity_milli_gpue: rec.capacity_gpue,
        last_seq: rec.last_seq,
        last_report_ms: rec.last_report_ms.unwrap_or(0),
        reported_through_ms: rec.reported_through_ms.unwrap_or(0),
        last_epoch: rec.leases.last_epoch,
        acked_epoch: rec.leases.acked_epoch,
        unreachable: rec.leases.last_epoch > 0 && rec.leases.all_expired(now),
        tenants,
        status: rec.status.as_ref().map(v1::ClusterStatus::from),
        cut_off_since_ms: fed.cut_off().get(id).copied().unwrap_or(0),
    })
}

/// The kept decisions about `req.pod` (the gRPC `ExplainPod` call and the HTTP
/// `/api/v1/decisions` both answer with it).
pub fn explain_pod_reply(
    fed: &kvota_fairness::federation::Federation,
    req: &v1::ExplainPodRequest,
) -> Result<v1::ExplainPodReply, Status> {
    let shown = |s: &str| s.chars().take(64).collect::<String>();
    let ok = req.pod.len() <= 317
        && req
            .pod
            .split_once('/')
            .is_some_and(|(ns, name)| !ns.is_empty() && !name.is_empty());
    if !ok {
        return Err(Status::invalid_argument(format!(
            "pod: `{}` is not namespace/name",
            shown(&req.pod)
        )));
    }
    if !req.cluster.is_empty() && !kvota_fairness::names::is_dns_label(&req.cluster) {
        return Err(Status::invalid_argument(format!(
            "cluster: `{}` is not a cluster name",
            shown(&req.cluster)
        )));
    }
    let cluster = (!req.cluster.is_empty()).then_some(req.cluster.as_str());
    Ok(v1::ExplainPodReply {
        kept: fed.keeps_records(),
        decisions: fed
            .pod_decisions(&req.pod, cluster)
            .into_iter()
            .map(|(c, d)| v1::ClusterDecision {
                cluster: c.to_string(),
                decision: Some(d.into()),
            })
            .collect(),
    })
}

/// A node's view of itself and the group (the gRPC `Status` call and the HTTP
/// `/api/v1/status` both answer with it).
pub async fn status_reply(ctx: &NodeCtx) -> v1::StatusReply {
    let ready = ctx.ready_checked().await.is_ok();
    let m = ctx.raft.metrics().borrow().clone();
    let state = ctx.state.read().await;
    let membership = m.membership_config.membership();
    let voters: BTreeSet<u64> = membership.voter_ids().collect();
    let members = membership
        .nodes()
        .map(|(id, n)| node_info(*id, n, voters.contains(id)))
        .collect();
    let leader_addr = m
        .current_leader
        .and_then(|id| membership.get_node(&id).map(|n| n.rpc_addr.clone()))
        .unwrap_or_default();
    v1::StatusReply {
        node_id: ctx.id,
        role: crate::metrics::role_name(&m).to_string(),
        term: m.current_term,
        leader_id: m.current_leader.unwrap_or(0),
        leader_rpc_addr: leader_addr,
        last_log_index: m.last_log_index.unwrap_or(0),
        last_applied_index: m.last_applied.map_or(0, |l| l.index),
        committed_index: state.last_applied.map_or(0, |l| l.index),
        members,
        state_time_ms: state.federation.now_ms(),
        policy: state.federation.policy().map(|p| p.name.clone()).unwrap_or_default(),
        clusters: u32::try_from(state.federation.clusters().len()).unwrap_or(u32::MAX),
        feature_level: state.feature_level.get(),
        feature_level_max: ctx.clock.own_feature_max().get(),
        ready,
        policy_revision: state.federation.policy_revision().0,
    }
}

/// The policy's tenants with their numbers (the gRPC `ListTenants` call and the HTTP
/// `/api/v1/tenants` both answer with it).
pub fn tenants_reply(fed: &kvota_fairness::federation::Federation) -> v1::ListTenantsReply {
    let Some(policy) = fed.policy() else {
        return v1::ListTenantsReply::default();
    };
    let plan = fed.plan();
    let split = crate::view::in_use_split(fed, &plan.tenants);
    let tenants = policy
        .tenants
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let committed = fed.committed().get(&t.name).copied().unwrap_or(0);
            let inuse = plan.inuse.get(i).copied().unwrap_or(0);
            let (running, waiting) = split.get(i).copied().unwrap_or_default();
            v1::TenantInfo {
                running_milli_gpue: running.min(inuse),
                admitted_milli_gpue: inuse.saturating_sub(running),
                waiting_milli_gpue: waiting,
                tenant: t.name.to_string(),
                weight_milli: t.weight_milli,
                min_share_bp: t.min_share_bp,
                max_share_bp: t.max_share_bp,
                preemptible: t.preemptible,
                demand_milli_gpue: plan.demand.get(i).copied().unwrap_or(0),
                inuse_milli_gpue: inuse,
                target_milli_gpue: plan.entitlements.get(i).map_or(0, |e| e.total),
                entitlement_milli_gpue: committed,
                drift_ppm: kvota_fairness::measures::drift_ppm(inuse, committed, plan.capacity),
                fairness_score: kvota_fairness::measures::tenant_score(inuse, committed, plan.capacity),
                decayed_usage: plan.usage.get(i).copied().unwrap_or(0),
            }
        })
        .collect();
    v1::ListTenantsReply {
        capacity_milli_gpue: plan.capacity,
        tenants,
    }
}

/// Every registered cluster (the gRPC `ListClusters` call and the HTTP
/// `/api/v1/clusters` both answer with it).
pub fn clusters_reply(fed: &kvota_fairness::federation::Federation) -> v1::ListClustersReply {
    let (policy_revision, policy_since_ms) = fed.policy_revision();
    v1::ListClustersReply {
        clusters: fed.clusters().keys().filter_map(|id| cluster_info(fed, id)).collect(),
        policy_revision,
        policy_since_ms,
        state_time_ms: fed.now_ms(),
    }
}

/// The audit records `req` asks for, oldest first: those about its tenant, by its
/// actor, from its time on (each only when given), the newest `limit` of them (0: all
/// kept). The gRPC `AuditLog` call and the HTTP `/api/v1/audit` both answer with it.
pub fn audit_records<'a>(
    fed: &'a kvota_fairness::federation::Federation,
    req: &'a v1::AuditLogRequest,
) -> Result<Vec<&'a kvota_fairness::federation::AuditRecord>, Status> {
    let shown = |s: &str| s.chars().take(64).collect::<String>();
    if !req.tenant.is_empty() && !kvota_fairness::names::is_dns_label(&req.tenant) {
        return Err(Status::invalid_argument(format!(
            "tenant: `{}` is not a tenant name",
            shown(&req.tenant)
        )));
    }
    if req.actor.len() > kvota_fairness::federation::MAX_ACTOR_LEN {
        return Err(Status::invalid_argument("actor: too long"));
    }
    if req.kinds.len() > kvota_fairness::federation::KINDS.len() {
        return Err(Status::invalid_argument("kinds: too many"));
    }
    let kinds = kvota_fairness::federation::parse_kinds(&req.kinds.join(","))
        .map_err(|e| Status::invalid_argument(format!("kinds: {e}")))?;
    let text = |s: &'a str| (!s.is_empty()).then_some(s);
    let all: Vec<_> = fed
        .audit_filtered(
            text(&req.tenant),
            text(&req.actor),
            (req.since_ms > 0).then_some(req.since_ms),
        )
        .filter(|r| kinds.contains(&r.event.kind()))
        .collect();
    let skip = if req.limit == 0 {
        0
    } else {
        all.len().saturating_sub(req.limit as usize)
    };
    Ok(all.into_iter().skip(skip).collect())
}

/// Showback over `req`'s period (see [`kvota_fairness::showback`]); the gRPC `Usage`
/// call and the HTTP `/api/v1/usage` both answer with it.
pub fn usage_reply(
    fed: &kvota_fairness::federation::Federation,
    req: &v1::UsageRequest,
) -> Result<v1::UsageReply, Status> {
    use kvota_fairness::showback::{GroupBy, HOUR_MS};
    let until = if req.until_ms == 0 { fed.now_ms() } else { req.until_ms };
    if req.since_ms >= until {
        return Err(Status::invalid_argument(format!(
            "since ({} ms) must be before until ({until} ms)",
            req.since_ms
        )));
    }
    let Some(sb) = fed.showback() else {
        return Ok(v1::UsageReply {
            kept: false,
            ..Default::default()
        });
    };
    let by = GroupBy {
        tenant: req.by_tenant,
        cluster: req.by_cluster,
    };
    let rows = sb
        .query(req.since_ms, until, by)
        .into_iter()
        .map(|r| v1::UsageRow {
            tenant: r.tenant.unwrap_or_default(),
            cluster: r.cluster.unwrap_or_default(),
            // milli-GPUe x ms per GPU-hour: 1,000 x 3,600,000.
            gpu_hours: r.milli_gpue_ms as f64 / 3.6e9,
            milli_gpue_ms: u64::try_from(r.milli_gpue_ms).unwrap_or(u64::MAX),
        })
        .collect();
    Ok(v1::UsageReply {
        kept: true,
        since_ms: req.since_ms / HOUR_MS * HOUR_MS,
        until_ms: (until - 1) / HOUR_MS * HOUR_MS + HOUR_MS,
        kept_from_ms: sb.oldest_ms().unwrap_or(0),
        rows,
    })
}

fn policy_reply(p: &Policy, (revision, since_ms): (u64, u64)) -> v1::PolicyReply {
    v1::PolicyReply {
        name: p.name.clone(),
        tenants: u32::try_from(p.tenants.len()).unwrap_or(u32::MAX),
        problems: Vec::new(),
        yaml: p.to_yaml(),
        revision,
        since_ms,
    }
}

fn problems(e: &kvota_fairness::policy::PolicyError) -> Vec<v1::PolicyProblem> {
    e.issues
        .iter()
        .map(|i| v1::PolicyProblem {
            path: i.path.clone(),
            message: i.message.clone(),
        })
        .collect()
}

fn node_info(id: u64, n: &NodeAddr, voter: bool) -> v1::NodeInfo {
    v1::NodeInfo {
        id,
        rpc_addr: n.rpc_addr.clone(),
        http_addr: n.http_addr.clone(),
        voter,
        raft_addr: n.raft_addr.clone(),
    }
}

/// Most members of a group: Raft groups of more than 7 voters only slow commits down.
pub const MAX_MEMBERS: usize = 9;

/// Longest member address accepted (`host:port`).
const MAX_ADDR: usize = 255;

/// A member's addresses from the wire, checked: an id > 0, a gRPC and a Raft address.
fn member_addr(m: &v1::NodeInfo) -> Result<NodeAddr, Status> {
    if m.id == 0 || m.rpc_addr.is_empty() || m.raft_addr.is_empty() {
        return Err(Status::invalid_argument(format!(
            "node {}: every member needs an id > 0, a gRPC address and a Raft address",
            m.id
        )));
    }
    for a in [&m.rpc_addr, &m.http_addr, &m.raft_addr] {
        if a.len() > MAX_ADDR || a.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(Status::invalid_argument(format!(
                "node {}: `{}` is not a host:port address",
                m.id,
                a.chars().take(64).collect::<String>()
            )));
        }
    }
    Ok(NodeAddr {
        rpc_addr: m.rpc_addr.clone(),
        http_addr: m.http_addr.clone(),
        raft_addr: m.raft_addr.clone(),
    })
}

impl AdminSvc {
    /// With TLS, checks that `raft_addr` is node `id`: it completes a handshake with a
    /// node certificate naming that id. A leader told to add a member must not be sent
    /// to dial (and stream the federation's log to) whatever address it is given.
    async fn verify_member(&self, id: u64, raft_addr: &str) -> Result<(), Status> {
        let Some(tls) = self.ctx.tls() else { return Ok(()) };
        kvota_tls::connect::probe(
            raft_addr,
            tls.source().clone(),
            kvota_tls::Expect::Node(id),
            std::time::Duration::from_secs(5),
        )
        .await
        .map(|_| ())
        .map_err(|e| Status::failed_precondition(format!("node {id} at {raft_addr} is not verified: {e}")))
    }

    /// Runs a membership call on the leader, forwarding once if needed.
    async fn leader_only<T>(
        &self,
        fwd: bool,
        result: Result<T, RaftError<u64, ClientWriteError<u64, NodeAddr>>>,
        forward: impl AsyncFnOnce(AdminClient<tonic::transport::Channel>) -> Result<Response<v1::StatusReply>, Status>,
    ) -> Result<Response<v1::StatusReply>, Status> {
        match result {
            Ok(_) => Ok(Response::new(status_reply(&self.ctx).await)),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => {
                let addr = f.leader_node.map(|n| n.rpc_addr).ok_or_else(no_leader)?;
                if fwd {
                    return Err(not_leader(&addr));
                }
                let ch = self.ctx.channel(&addr).await?;
                forward(AdminClient::new(ch)).await
            }
            Err(RaftError::APIError(ClientWriteError::ChangeMembershipError(e))) => {
                Err(Status::failed_precondition(format!("membership change refused: {e}")))
            }
            Err(e) => Err(Status::unavailable(format!("membership change failed: {e}"))),
        }
    }
}

#[tonic::async_trait]
impl v1::admin_server::Admin for AdminSvc {
    async fn apply_policy(&self, request: Request<v1::PolicyRequest>) -> Result<Response<v1::PolicyReply>, Status> {
        let caller = self.ctx.authz.check(&request, "admin", "ApplyPolicy", OPERATE)?;
        let actor = actor_of(&caller, &request);
        let fwd = was_forwarded(&request);
        let msg = request.into_inner();
        let policy = Policy::from_yaml(&msg.yaml).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let level = self.ctx.state.read().await.feature_level;
        // A setting a node below its feature level would drop from the replicated policy.
        if let Some((what, needs)) = level.policy_refusal(&policy) {
            return Err(Status::failed_precondition(format!(
                "{what} needs feature level {needs} and the group runs at {level}: every node must run a kvota that \
                 supports it first (see docs/operations.md, \"Upgrades\"); nothing was changed"
            )));
        }
        let mut reply = policy_reply(&policy, (0, 0));
        let leaders = std::sync::Mutex::new(None);
        let applied = self
            .ctx
            .write_or_forward(Command::ApplyPolicy(policy), actor, fwd, msg, async |ch, req| {
                let r = AdminClient::new(ch).apply_policy(req).await?.into_inner();
                *leaders.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some((r.revision, r.since_ms));
                Ok(Response::new(Applied::PolicyApplied))
            })
            .await?;
        // The revision in force once applied: the leader's answer when forwarded, else
        // this node's state, which has applied it.
        let forwarded = *leaders.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        (reply.revision, reply.since_ms) = match forwarded {
            Some(r) => r,
            None => self.ctx.state.read().await.federation.policy_revision(),
        };
        match applied {
            Applied::PolicyApplied => Ok(Response::new(reply)),
            other => Err(unexpected("a policy", &other)),
        }
    }

    async fn validate_policy(&self, request: Request<v1::PolicyRequest>) -> Result<Response<v1::PolicyReply>, Status> {
        self.ctx.authz.check(&request, "admin", "ValidatePolicy", READ)?;
        Ok(Response::new(match Policy::from_yaml(&request.into_inner().yaml) {
            Ok(p) => policy_reply(&p, (0, 0)),
            Err(e) => v1::PolicyReply {
                problems: problems(&e),
                ..Default::default()
            },
        }))
    }

    async fn get_policy(&self, request: Request<v1::Empty>) -> Result<Response<v1::PolicyReply>, Status> {
        self.ctx.authz.check(&request, "admin", "GetPolicy", READ_POLICY)?;
        let state = self.ctx.state.read().await;
        let revision = state.federation.policy_revision();
        Ok(Response::new(
            state
                .federation
                .policy()
                .map(|p| policy_reply(p, revision))
                .unwrap_or_default(),
        ))
    }

    async fn status(&self, request: Request<v1::Empty>) -> Result<Response<v1::StatusReply>, Status> {
        self.ctx.authz.check(&request, "admin", "Status", READ)?;
        Ok(Response::new(status_reply(&self.ctx).await))
    }

    async fn list_tenants(&self, request: Request<v1::Empty>) -> Result<Response<v1::ListTenantsReply>, Status> {
        self.ctx.authz.check(&request, "admin", "ListTenants", READ)?;
        let state = self.ctx.state.read().await;
        Ok(Response::new(tenants_reply(&state.federation)))
    }

    async fn list_clusters(&self, request: Request<v1::Empty>) -> Result<Response<v1::ListClustersReply>, Status> {
        self.ctx.authz.check(&request, "admin", "ListClusters", READ)?;
        let state = self.ctx.state.read().await;
        Ok(Response::new(clusters_reply(&state.federation)))
    }

    async fn explain_tenant(
        &self,
        request: Request<v1::ExplainTenantRequest>,
    ) -> Result<Response<v1::ExplainTenantReply>, Status> {
        self.ctx.authz.check(&request, "admin", "ExplainTenant", READ)?;
        let name = request.into_inner().tenant;
        let state = self.ctx.state.read().await;
        let e = state.federation.explain_tenant(&name).ok_or_else(|| {
            Status::not_found(format!(
                "the policy in force has no tenant `{}`",
                name.chars().take(64).collect::<String>()
            ))
        })?;
        Ok(Response::new(v1::ExplainTenantReply {
            text: e.to_string(),
            explanation: Some((&e).into()),
        }))
    }

    async fn explain_pod(
        &self,
        request: Request<v1::ExplainPodRequest>,
    ) -> Result<Response<v1::ExplainPodReply>, Status> {
        self.ctx.authz.check(&request, "admin", "ExplainPod", READ)?;
        let req = request.into_inner();
        let state = self.ctx.state.read().await;
        explain_pod_reply(&state.federation, &req).map(Response::new)
    }

    async fn save_snapshot(&self, request: Request<v1::Empty>) -> Result<Response<v1::SnapshotReply>, Status> {
        self.ctx.authz.check(&request, "admin", "SaveSnapshot", OPERATE)?;
        let read = self.ctx.read_barrier().await;
        let backup = {
            let state = self.ctx.state.read().await;
            crate::backup::encode(&state, self.ctx.id, self.ctx.clock.wall_ms()).map_err(Status::internal)?
        };
        tracing::info!(
            bytes = backup.len(),
            follows_leader = read.follows_leader,
            "backup taken"
        );
        Ok(Response::new(v1::SnapshotReply {
            backup,
            follows_leader: read.follows_leader,
            note: read.note.unwrap_or_default(),
        }))
    }

    async fn usage(&self, request: Request<v1::UsageRequest>) -> Result<Response<v1::UsageReply>, Status> {
        self.ctx.authz.check(&request, "admin", "Usage", READ)?;
        let req = request.into_inner();
        let state = self.ctx.state.read().await;
        usage_reply(&state.federation, &req).map(Response::new)
    }

    async fn audit_log(&self, request: Request<v1::AuditLogRequest>) -> Result<Response<v1::AuditLogReply>, Status> {
        self.ctx.authz.check(&request, "admin", "AuditLog", READ)?;
        let req = request.into_inner();
        let state = self.ctx.state.read().await;
        let entries = audit_records(&state.federation, &req)?
            .into_iter()
            .map(v1::AuditRecord::from)
            .collect();
        Ok(Response::new(v1::AuditLogReply { entries }))
    }

    async fn remove_cluster(
        &self,
        request: Request<v1::DescribeClusterRequest>,
    ) -> Result<Response<v1::Empty>, Status> {
        let caller = self.ctx.authz.check(&request, "admin", "RemoveCluster", OPERATE)?;
        let actor = actor_of(&caller, &request);
        let fwd = was_forwarded(&request);
        let msg = request.into_inner();
        let id = convert::cluster_id("cluster", &msg.cluster).map_err(invalid)?;
        self.ctx
            .write_or_forward(
                Command::RemoveCluster { cluster: id },
                actor,
                fwd,
                msg,
                async |ch, req| {
                    AdminClient::new(ch).remove_cluster(req).await?;
                    Ok(Response::new(Applied::Removed))
                },
            )
            .await?;
        Ok(Response::new(v1::Empty {}))
    }

    async fn browse(&self, request: Request<v1::BrowseRequest>) -> Result<Response<v1::BrowseReply>, Status> {
        self.ctx.authz.check(&request, "admin", "Browse", READ)?;
        crate::browse::answer(&self.ctx, request).await.map(Response::new)
    }

    async fn initialize(&self, request: Request<v1::InitializeRequest>) -> Result<Response<v1::StatusReply>, Status> {
        self.ctx.authz.check(&request, "admin", "Initialize", OPERATE)?;
        let msg = request.into_inner();
        if msg.members.is_empty() {
            return Err(Status::invalid_argument(
                "initialize needs at least this node as a member",
            ));
        }
        if msg.members.len() > MAX_MEMBERS {
            return Err(Status::invalid_argument(format!("at most {MAX_MEMBERS} members")));
        }
        let mut members = BTreeMap::new();
        for m in msg.members {
            let node = member_addr(&m)?;
            if m.id != self.ctx.id {
                self.verify_member(m.id, &node.raft_addr).await?;
            }
            members.insert(m.id, node);
        }
        if !members.contains_key(&self.ctx.id) {
            return Err(Status::invalid_argument(format!(
                "the members must include this node (id {})",
                self.ctx.id
            )));
        }
        self.ctx
            .raft
            .initialize(members)
            .await
            .map_err(|e| Status::failed_precondition(format!("cannot initialize: {e}")))?;
        Ok(Response::new(status_reply(&self.ctx).await))
    }

    async fn add_learner(&self, request: Request<v1::AddLearnerRequest>) -> Result<Response<v1::StatusReply>, Status> {
        self.ctx.authz.check(&request, "admin", "AddLearner", OPERATE)?;
        let fwd = was_forwarded(&request);
        let msg = request.into_inner();
        let node = msg
            .node
            .clone()
            .ok_or_else(|| Status::invalid_argument("node is required"))?;
        let addr = member_addr(&node)?;
        // Only the leader dials the learner; a follower forwards first.
        if self.ctx.raft.metrics().borrow().state == openraft::ServerState::Leader {
            self.verify_member(node.id, &addr.raft_addr).await?;
        }
        // `blocking = true`: openraft answers once the learner is within its
        // `replication_lag_threshold` (5,000 entries) of the leader, which for a new
        // node is at once; `kvota members add-learner` then waits for the node itself to
        // say it has caught up (its status' `ready`), on a deadline of its own, since
        // one call may not outlast the client's.
        let result = tokio::time::timeout(
            std::time::Duration::from_secs(60),
            self.ctx.raft.add_learner(node.id, addr, true),
        )
        .await
        .map_err(|_| {
            Status::deadline_exceeded("the learner did not catch up within 60 s; is it running and reachable?")
        })?;
        self.leader_only(fwd, result, async |mut c| c.add_learner(forwarded(msg)).await)
            .await
    }

    async fn change_membership(
        &self,
        request: Request<v1::ChangeMembershipRequest>,
    ) -> Result<Response<v1::StatusReply>, Status> {
        self.ctx.authz.check(&request, "admin", "ChangeMembership", OPERATE)?;
        let fwd = was_forwarded(&request);
        let msg = request.into_inner();
        if msg.voters.len() > MAX_MEMBERS {
            return Err(Status::invalid_argument(format!("at most {MAX_MEMBERS} voters")));
        }
        if msg.voters.is_empty() {
            return Err(Status::invalid_argument("a group needs at least one voter"));
        }
        let voters: BTreeSet<u64> = msg.voters.iter().copied().collect();
        let result = self.ctx.raft.change_membership(voters, msg.retain).await;
        self.leader_only(fwd, result, async |mut c| c.change_membership(forwarded(msg)).await)
            .await
    }
}
