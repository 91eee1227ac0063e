//! One log entry's way through the replicated state machine, as pure functions: what
//! the leader proposes for a batch of commands ([`prepare`]) and what every replica does
//! when it applies the entry ([`apply`]).
//!
//! The log store (`store/mod.rs`), the leader's batcher (`node.rs`) and the
//! deterministic chaos world (`chaos-tests`) all call these, so the simulation runs the
//! application code the control plane ships. Nothing here reads a clock, a disk or the
//! network: time enters only as the leader's stamp in the entry.

use std::collections::BTreeMap;

use kvota_fairness::federation::{Applied, AuditEvent, Command, CommandError, Federation};
use openraft::Membership;

use crate::feature::FeatureLevel;
use crate::types::{Node, NodeId, Request};

/// What the leader proposes for one batch of `commands`, stamped `now_ms`, in a group at
/// feature level `level`: the commands without what a member at that level does not
/// read ([`FeatureLevel::strip`]), the entry format the level writes, who asked for
/// each command (`actors`, by index; kept only from [`FeatureLevel::RECORDS`], since an
/// older node refuses an entry carrying them), and a raise to `support` when every
/// member supports a level above the group's.
pub fn prepare(
    level: FeatureLevel,
    now_ms: u64,
    mut commands: Vec<Command>,
    actors: BTreeMap<u32, String>,
    support: Option<FeatureLevel>,
) -> Request {
    level.strip(&mut commands);
    let mut req = Request::new(now_ms, commands);
    req.format = level.entry_format();
    if level.keeps_records() {
        req.actors = actors;
    }
    req.raise_feature_level = support.filter(|s| *s > level).map(FeatureLevel::get);
    req
}

/// Why a replica cannot apply an entry: it raises the group to a feature level this
/// build does not support. The replica's state is untouched by the entry.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", newer_feature_level(*.level, *.supported))]
pub struct TooNew {
    /// The level the entry raises to.
    pub level: FeatureLevel,
    /// The newest level this node supports.
    pub supported: FeatureLevel,
}

/// Why a node cannot follow the group (the text a stopped node logs).
pub fn newer_feature_level(level: FeatureLevel, supported: FeatureLevel) -> String {
    format!(
        "the federation runs at feature level {level}, and this node supports up to {supported}: \
         upgrade this node's kvota (every voter must support a level before the leader raises it; \
         a node added later must be as new)"
    )
}

/// Whether the entry at log index `index` comes next after `last_applied` (the index of
/// the last entry applied, `None` before the first). Applying an entry twice would not
/// be idempotent (a second registration issues another lease, a report counts again),
/// and replicas would diverge: a replica refuses rather than corrupt its state.
pub fn check_next(last_applied: Option<u64>, index: u64) -> Result<(), Replayed> {
    if last_applied.is_some_and(|l| index <= l) && !kvota_fairness::faults::on(|f| f.apply_replayed_entry) {
        return Err(Replayed {
            index,
            last_applied: last_applied.unwrap_or(0),
        });
    }
    Ok(())
}

/// An entry at or below the last one applied was handed to the state machine again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("log entry {index} handed to the state machine after entry {last_applied} was applied")]
pub struct Replayed {
    /// The entry's index.
    pub index: u64,
    /// The last applied.
    pub last_applied: u64,
}

/// Applies one normal log entry to the replicated state: `federation` at feature level
/// `level`, on a node that supports levels up to `supported`.
///
/// Holds: a raise above `supported` is refused before anything of the entry is applied
/// (openraft applies it again after an upgrade); otherwise every command is applied in
/// order, stamped with the entry's time and attributed to its actor, and a raise takes
/// effect after the entry's own commands. The answers are one per command, in order.
/// The same entry on the same state gives the same state on every node.
pub fn apply(
    federation: &mut Federation,
    level: &mut FeatureLevel,
    req: Request,
    supported: FeatureLevel,
) -> Result<Vec<Result<Applied, CommandError>>, TooNew> {
    let raise = req.raise_feature_level.map(FeatureLevel::new);
    if let Some(to) = raise.filter(|to| *to > supported) {
        return Err(TooNew { level: to, supported });
    }
    let Request {
        now_ms,
        commands,
        actors,
        ..
    } = req;
    let answers = commands
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let actor = u32::try_from(i).ok().and_then(|i| actors.get(&i)).cloned();
            #[cfg(debug_assertions)]
            let what = describe(&c);
            let answer = federation.apply_as(now_ms, c, actor);
            #[cfg(debug_assertions)]
            assert_safe(federation, now_ms, &what);
            answer
        })
        .collect();
    if let Some(to) = raise {
        if to > *level {
            tracing::info!(from = level.get(), to = to.get(), "feature level raised");
            *level = to;
        }
        level.enable_in(federation);
    }
    Ok(answers)
}

/// The command in a few words, for a failed check.
#[cfg(debug_assertions)]
fn describe(c: &Command) -> String {
    match c {
        Command::ApplyPolicy(p) => format!("apply policy {}", p.name),
        Command::RegisterCluster { cluster, .. } => format!("register {cluster}"),
        Command::RemoveCluster { cluster } => format!("remove {cluster}"),
        Command::Report(r) => format!("report {} seq {}", r.cluster, r.seq),
        Command::Tick => "tick".to_string(),
    }
}

/// In debug and test builds, the state machine's own partition-safety check
/// (`Federation::check_safety`: what the clusters may hold within budgets, borrowed pods
/// left out, never exceeds what the committed entitlements allow, and the committed
/// entitlements fit the capacity) runs after every applied command, so a violation stops
/// with the command that caused it. Release builds leave it out (it walks every tenant
/// and cluster).
#[cfg(debug_assertions)]
fn assert_safe(federation: &Federation, now_ms: u64, what: &str) {
    let v = federation.check_safety();
    assert!(
        v.is_empty(),
        "the state machine's partition-safety check failed after `{what}` at {now_ms} ms: {v:?}"
    );
}

/// Applies a new leader's first entry (openraft's blank entry, written by the leader of
/// `term`, node `node`): from the operator view on, the audit log names the new leader.
/// The same on every node: the entry's log id says who wrote it.
pub fn apply_blank(federation: &mut Federation, term: u64, node: u64) {
    federation.note(AuditEvent::LeaderChanged { node, term });
}

/// Applies a membership entry going from `old` to `new`: from the operator view on, the
/// audit log records each node added or removed and each change between voter and
/// learner (a joint change shows at both of its entries, each with what it changed).
pub fn apply_membership(federation: &mut Federation, old: &Membership<NodeId, Node>, new: &Membership<NodeId, Node>) {
    let voters = |m: &Membership<NodeId, Node>| m.voter_ids().collect::<std::collections::BTreeSet<NodeId>>();
    let (was, is) = (voters(old), voters(new));
    for (id, n) in new.nodes() {
        match old.get_node(id) {
            None => federation.note(AuditEvent::NodeAdded {
                node: *id,
                voter: is.contains(id),
                rpc_addr: n.rpc_addr.clone(),
            }),
            Some(_) if was.contains(id) != is.contains(id) => federation.note(AuditEvent::NodeRole {
                node: *id,
                voter: is.contains(id),
            }),
            Some(_) => {}
        }
    }
    for (id, _) in old.nodes() {
        if new.get_node(id).is_none() {
            federation.note(AuditEvent::NodeRemoved { node: *id });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvota_fairness::federation::{TenantReport, UsageReport};

    fn report(largest: u64) -> Command {
        let mut tenants = BTreeMap::new();
        tenants.insert(
            "a".parse().expect("name"),
            TenantReport {
                largest,
                pending: largest,
                inuse: largest,
                borrowed: largest,
                ..TenantReport::default()
            },
        );
        Command::Report(UsageReport {
            cluster: "c".parse().expect("name"),
            seq: 1,
            held_epoch: 0,
            capacity: None,
            tenants,
            evictions: Vec::new(),
            decisions: Vec::new(),
            window: None,
            status: None,
        })
    }

    fn largest(req: &Request) -> u64 {
        match &req.commands[0] {
            Command::Report(r) => r.tenants.values().map(|t| t.largest).sum(),
            _ => 0,
        }
    }

    fn borrowed(req: &Request) -> u64 {
        match &req.commands[0] {
            Command::Report(r) => r.tenants.values().map(|t| t.borrowed).sum(),
            _ => 0,
        }
    }

    #[test]
    fn prepare_writes_what_the_level_reads() {
        let actors: BTreeMap<u32, String> = [(0, "operator/ops".to_string())].into();
        let base = prepare(FeatureLevel::BASE, 7, vec![report(4_000)], actors.clone(), None);
        assert_eq!(base.format, 1);
        assert!(base.actors.is_empty(), "no actors below the records level");
        assert_eq!(largest(&base), 0, "no largest waiting pod below the sized level");
        let sized = prepare(FeatureLevel::SIZED, 7, vec![report(4_000)], actors, None);
        assert_eq!(sized.actors.len(), 1);
        assert_eq!(largest(&sized), 4_000);
        assert_eq!(borrowed(&sized), 0, "no borrowed usage below its level");
        let newest = prepare(FeatureLevel::NEWEST, 7, vec![report(4_000)], BTreeMap::new(), None);
        assert_eq!(borrowed(&newest), 4_000);
        let raise = prepare(
            FeatureLevel::RECORDS,
            7,
            vec![],
            BTreeMap::new(),
            Some(FeatureLevel::SIZED),
        );
        assert_eq!(raise.raise_feature_level, Some(4));
        let same = prepare(
            FeatureLevel::SIZED,
            7,
            vec![],
            BTreeMap::new(),
            Some(FeatureLevel::SIZED),
        );
        assert_eq!(
            same.raise_feature_level, None,
            "no raise to the level the group runs at"
        );
    }

    #[test]
    fn a_raise_past_what_the_node_supports_changes_nothing() {
        let mut fed = Federation::new();
        let mut level = FeatureLevel::RECORDS;
        let mut req = Request::new(5, vec![Command::Tick]);
        req.raise_feature_level = Some(FeatureLevel::NEWEST.get() + 1);
        let before = fed.clone();
        let e = apply(&mut fed, &mut level, req, FeatureLevel::NEWEST).expect_err("too new");
        assert_eq!(e.level.get(), FeatureLevel::NEWEST.get() + 1);
        assert!(e.to_string().contains("upgrade this node"), "{e}");
        assert_eq!(fed, before);
        assert_eq!(level, FeatureLevel::RECORDS);
    }

    fn membership(voters: &[u64], learners: &[u64]) -> Membership<NodeId, Node> {
        let node = |id: &u64| {
            (
                *id,
                Node {
                    rpc_addr: format!("10.0.0.{id}:7401"),
                    ..Node::default()
                },
            )
        };
        let nodes: BTreeMap<NodeId, Node> = voters.iter().chain(learners).map(node).collect();
        Membership::new(vec![voters.iter().copied().collect()], nodes)
    }

    #[test]
    fn leaders_and_members_are_audited_from_the_operator_view_on() {
        let mut fed = Federation::new();
        apply_blank(&mut fed, 3, 2);
        apply_membership(&mut fed, &membership(&[1], &[]), &membership(&[1], &[2]));
        assert_eq!(fed.audit().count(), 0, "nothing below level 6");
        FeatureLevel::OPERATOR_VIEW.enable_in(&mut fed);
        apply_blank(&mut fed, 3, 2);
        apply_membership(&mut fed, &membership(&[1, 3], &[]), &membership(&[1], &[2, 3]));
        apply_membership(&mut fed, &membership(&[1], &[2, 3]), &membership(&[1, 2], &[]));
        let events: Vec<AuditEvent> = fed.audit().map(|r| r.event.clone()).collect();
        assert_eq!(
            events,
            vec![
                AuditEvent::LeaderChanged { node: 2, term: 3 },
                AuditEvent::NodeAdded {
                    node: 2,
                    voter: false,
                    rpc_addr: "10.0.0.2:7401".into()
                },
                AuditEvent::NodeRole { node: 3, voter: false },
                AuditEvent::NodeRole { node: 2, voter: true },
                AuditEvent::NodeRemoved { node: 3 },
            ]
        );
    }

    #[test]
    fn a_raise_takes_effect_after_the_entrys_commands() {
        let mut fed = Federation::new();
        let mut level = FeatureLevel::BASE;
        let mut req = Request::new(5, vec![Command::Tick, Command::Tick]);
        req.raise_feature_level = Some(FeatureLevel::SIZED.get());
        let answers = apply(&mut fed, &mut level, req, FeatureLevel::NEWEST).expect("applies");
        assert_eq!(answers.len(), 2);
        assert_eq!(level, FeatureLevel::SIZED);
        assert!(fed.sizes_budgets() && fed.lends() && fed.keeps_records());
    }
}
