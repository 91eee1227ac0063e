//! The control plane: N replicas of the real state machine behind a modelled Raft log.
//!
//! **Real**: the log entry type ([`kvota_control_plane::types::Request`]: leader-stamped
//! time and a batch of commands, i.e. group commit), and the state machine
//! ([`Federation::apply`], called per command in entry order through
//! `kvota_control_plane::entry::apply`, as `control-plane/src/store/mod.rs` calls it).
//! Every replica applies every committed entry through it, so leases, budgets and the
//! ledger are computed by production code on every node, and a new leader continues
//! from the leases in its replicated state.
//!
//! **Modelled** (openraft is not run here): terms, elections with the up-to-date-log
//! vote rule, log matching and truncation of conflicting suffixes, commit by a majority
//! of *durable* copies of an entry of the leader's term, followers learning the commit
//! index, snapshots every [`SNAPSHOT_EVERY`] entries, restart = snapshot + replay of the
//! durable log. A slow disk delays durability (so commit); a crash loses the non-durable
//! tail. Replication between nodes is synchronous per step over links that are up both
//! ways; agent traffic goes through the seeded [`crate::net::Net`]. Each node has a
//! clock offset; the leader stamps entries with its clock.
//!
//! The model checks itself: a committed entry that any leader would overwrite, or a
//! replica that would truncate below what it applied, is reported as a harness error.

use std::collections::{BTreeMap, VecDeque};

use kvota_control_plane::entry;
use kvota_control_plane::feature::FeatureLevel;
use kvota_control_plane::types::Request;
use kvota_fairness::federation::{Applied, Command, CommandError, Federation};

use crate::msg::{AgentAnswer, AgentRequest, AnswerOutcome, Msg};
use crate::net::{Addr, Net};
use crate::rng::Rng;

/// A replica snapshots its applied state this often (entries), as openraft's snapshot
/// policy would; restart replays the log after the snapshot.
pub const SNAPSHOT_EVERY: usize = 128;
/// The leader proposes a `Tick` this often (ms of its clock), as the server's recompute
/// tick does (`ServerConfig::tick_ms`).
pub const TICK_MS: u64 = 1_000;
/// Election timeout range: a follower that heard no leader for this long stands.
pub const ELECTION_TIMEOUT_MS: (u64, u64) = (800, 1_600);

/// One log entry: a term and the real `Request`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogEntry {
    /// Term of the leader that created it.
    pub term: u64,
    /// Leader-stamped commands.
    pub req: Request,
}

/// Where to send the answer to a command once it is applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    /// Agent.
    pub agent: usize,
    /// Anchor copied into the answer.
    pub sent_agent_ms: u64,
}

/// An answer owed for one command of an entry: its route and the report's sequence.
type Waiting = (Route, Option<u64>);

/// A replicated state: the state machine, the group's feature level, and the index of
/// the last entry applied (as the store's `StateMachineData` holds them).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Machine {
    /// The state machine.
    pub fed: Federation,
    /// The group's feature level.
    pub level: FeatureLevel,
    /// The last entry applied (1-based log index), `None` before the first.
    pub last: Option<u64>,
}

impl Machine {
    /// Applies the entry at log index `index` as the log store does: refused if it is
    /// not after the last one applied (`None`: skipped, nothing changes), else applied
    /// by the control plane's own `entry::apply`. This build supports every level, so a
    /// raise is never too new here.
    pub fn apply(&mut self, index: u64, req: &Request) -> Option<Vec<Result<Applied, CommandError>>> {
        entry::check_next(self.last, index).ok()?;
        self.last = Some(index);
        entry::apply(&mut self.fed, &mut self.level, req.clone(), FeatureLevel::NEWEST).ok()
    }
}

/// One control-plane node.
#[derive(Debug)]
pub struct Replica {
    /// Running (false: crashed).
    pub up: bool,
    /// Current term.
    pub term: u64,
    /// Whether it believes it is the leader of `term`.
    pub leader: bool,
    /// Its log (durable prefix, then entries not yet on disk).
    pub log: Vec<LogEntry>,
    /// Entries that survive a crash.
    pub durable_len: usize,
    pending_durable: VecDeque<(usize, u64)>,
    /// Commit index it knows.
    pub commit: usize,
    /// Entries applied to `state`.
    pub applied: usize,
    /// The state machine.
    pub state: Federation,
    /// The replicated feature level and last applied index beside it.
    level: FeatureLevel,
    last_index: Option<u64>,
    snapshot: (usize, Machine),
    /// Clock offset from real time (ms).
    pub clock_offset_ms: i64,
    /// Disk latency: an appended entry is durable this much later.
    pub disk_delay_ms: u64,
    last_heard_ms: u64,
    timeout_ms: u64,
    known_leader: Option<usize>,
    match_idx: Vec<usize>,
    batch: Vec<(Command, Option<Route>)>,
    /// Per uncommitted entry index, per command: where to answer and the report's seq.
    waiting: BTreeMap<usize, Vec<Option<Waiting>>>,
    last_tick_ms: u64,
}

/// The state every replica starts from: an empty federation at feature level 1. The
/// leader raises the level from its first entry to [`Cp::start_level`], and from
/// [`Cp::upgrade_at_ms`] on to [`Cp::target_level`] (an upgrade finished while agents
/// report and faults strike); it proposes what the group's level reads
/// ([`entry::prepare`]), as the control plane's leader does.
pub fn initial_state() -> Federation {
    Federation::new()
}

impl Replica {
    fn new(n: usize, offset: i64, timeout_ms: u64) -> Replica {
        Replica {
            up: true,
            term: 0,
            leader: false,
            log: Vec::new(),
            durable_len: 0,
            pending_durable: VecDeque::new(),
            commit: 0,
            applied: 0,
            state: initial_state(),
            level: FeatureLevel::BASE,
            last_index: None,
            snapshot: (0, Machine::default()),
            clock_offset_ms: offset,
            disk_delay_ms: 0,
            last_heard_ms: 0,
            timeout_ms,
            known_leader: None,
            match_idx: vec![0; n],
            batch: Vec::new(),
            waiting: BTreeMap::new(),
            last_tick_ms: 0,
        }
    }

    /// This node's clock at real time `real_ms`.
    pub fn clock(&self, real_ms: u64) -> u64 {
        u64::try_from(i128::from(real_ms) + i128::from(self.clock_offset_ms)).unwrap_or(0)
    }

    fn last_term(&self) -> u64 {
        self.log.last().map_or(0, |e| e.term)
    }

    fn step_down(&mut self) {
        self.leader = false;
        self.batch.clear();
        self.waiting.clear();
    }

    fn append(&mut self, entry: LogEntry, now_ms: u64) {
        self.log.push(entry);
        self.pending_durable
            .push_back((self.log.len(), now_ms + self.disk_delay_ms));
    }

    fn make_durable(&mut self, now_ms: u64) {
        while let Some(&(len, at)) = self.pending_durable.front() {
            if at > now_ms {
                break;
            }
            self.pending_durable.pop_front();
            if len <= self.log.len() {
                self.durable_len = self.durable_len.max(len);
            }
        }
    }

    /// Applies committed entries through the store's own functions; returns each
    /// applied entry's results with its index. Entries at or below the last one the
    /// state holds (a restart replays its whole log over the snapshot) are skipped by
    /// `entry::check_next`.
    fn apply_committed(&mut self) -> Vec<(usize, Vec<Result<Applied, CommandError>>)> {
        let mut out = Vec::new();
        while self.applied < self.commit.min(self.log.len()) {
            let idx = self.applied;
            let Some(e) = self.log.get(idx) else { break };
            let mut m = Machine {
                fed: std::mem::take(&mut self.state),
                level: self.level,
                last: self.last_index,
            };
            let results = m.apply(u64::try_from(idx + 1).unwrap_or(u64::MAX), &e.req);
            (self.state, self.level, self.last_index) = (m.fed, m.level, m.last);
            self.applied += 1;
            if self.applied % SNAPSHOT_EVERY == 0 {
                self.snapshot = (self.applied, self.machine());
            }
            if let Some(results) = results {
                out.push((self.applied, results));
            }
        }
        out
    }

    /// The replicated state as one value.
    pub fn machine(&self) -> Machine {
        Machine {
            fed: self.state.clone(),
            level: self.level,
            last: self.last_index,
        }
    }

    /// The group's feature level as this replica applied it.
    pub fn level(&self) -> FeatureLevel {
        self.level
    }
}

/// The control-plane group.
#[derive(Debug)]
pub struct Cp {
    /// The nodes.
    pub replicas: Vec<Replica>,
    /// Every committed entry, in order (what any future leader must have).
    pub committed: Vec<LogEntry>,
    rng: Rng,
    /// Elections won (for the summary).
    pub elections: u64,
    /// The level the group starts at (raised to by the first entry).
    pub start_level: FeatureLevel,
    /// The level the group is upgraded to, from [`Cp::upgrade_at_ms`] on (world time).
    pub target_level: FeatureLevel,
    /// When every member supports [`Cp::target_level`] (0: from the first entry).
    pub upgrade_at_ms: u64,
}

impl Cp {
    /// `n` nodes with clock offsets `offsets`; node 0 starts as leader of term 1.
    pub fn new(n: usize, offsets: &[i64], mut rng: Rng) -> Cp {
        let mut replicas: Vec<Replica> = (0..n)
            .map(|i| {
                let t = rng.range(ELECTION_TIMEOUT_MS.0, ELECTION_TIMEOUT_MS.1);
                Replica::new(n, offsets.get(i).copied().unwrap_or(0), t)
            })
            .collect();
        for r in &mut replicas {
            r.term = 1;
            r.known_leader = Some(0);
        }
        if let Some(r) = replicas.first_mut() {
            r.leader = true;
        }
        Cp {
            replicas,
            committed: Vec::new(),
            rng,
            elections: 0,
            start_level: FeatureLevel::NEWEST,
            target_level: FeatureLevel::NEWEST,
            upgrade_at_ms: 0,
        }
    }

    fn majority(&self) -> usize {
        self.replicas.len() / 2 + 1
    }

    /// The leader of the highest term among running nodes that believe they lead.
    pub fn leader(&self) -> Option<usize> {
        self.replicas
            .iter()
            .enumerate()
            .filter(|(_, r)| r.up && r.leader)
            .max_by_key(|(_, r)| r.term)
            .map(|(i, _)| i)
    }

    /// Queues an operator command (policy change) at the current leader. False when
    /// there is none (the caller retries later).
    pub fn propose_admin(&mut self, cmd: Command) -> bool {
        match self.leader().and_then(|l| self.replicas.get_mut(l)) {
            Some(r) => {
                r.batch.push((cmd, None));
                true
            }
            None => false,
        }
    }

    /// A request arrives at node `node`: the leader queues it for the next entry; a
    /// follower forwards it once to the leader it knows; otherwise it is dropped (the
    /// agent times out and retries).
    pub fn deliver(&mut self, node: usize, req: AgentRequest, now_ms: u64, net: &mut Net<Msg>) {
        let Some(r) = self.replicas.get_mut(node) else { return };
        if !r.up {
            return;
        }
        if r.leader {
            r.batch.push((
                req.command,
                Some(Route {
                    agent: req.agent,
                    sent_agent_ms: req.sent_agent_ms,
                }),
            ));
            return;
        }
        if req.forwarded {
            return;
        }
        if let Some(l) = r.known_leader.filter(|&l| l != node) {
            let fwd = AgentRequest { forwarded: true, ..req };
            net.send(&mut self.rng, now_ms, Addr::Cp(node), Addr::Cp(l), Msg::Request(fwd));
        }
    }

    /// A `DescribeCluster` arrives at node `node` from agent `agent`: any node that is
    /// up answers at once from its own applied state (which may lag the leader's).
    pub fn describe(&mut self, node: usize, agent: usize, sent_agent_ms: u64, now_ms: u64, net: &mut Net<Msg>) {
        let Some(r) = self.replicas.get(node).filter(|r| r.up) else {
            return;
        };
        let cluster = format!("c{agent}");
        let (last_seq, reported_through_ms) = r
            .state
            .clusters()
            .get(cluster.as_str())
            .map_or((0, 0), |c| (c.last_seq, c.reported_through_ms.unwrap_or(0)));
        let ans = AgentAnswer {
            from_node: node,
            sent_agent_ms,
            outcome: AnswerOutcome::Described {
                last_seq,
                reported_through_ms,
            },
        };
        net.send(
            &mut self.rng,
            now_ms,
            Addr::Cp(node),
            Addr::Agent(agent),
            Msg::Answer(ans),
        );
    }

    /// Crashes node `i`: it loses its memory and every non-durable log entry.
    pub fn crash(&mut self, i: usize) {
        if let Some(r) = self.replicas.get_mut(i) {
            r.up = false;
            r.step_down();
            r.log.truncate(r.durable_len);
            r.pending_durable.clear();
        }
    }

    /// Restarts node `i` from its disk: snapshot, then replay of the durable log up to
    /// the snapshot (the rest is applied once a leader tells it the commit index).
    pub fn restart(&mut self, i: usize, now_ms: u64) {
        if let Some(r) = self.replicas.get_mut(i) {
            if r.up {
                return;
            }
            r.up = true;
            let m = r.snapshot.1.clone();
            (r.state, r.level, r.last_index) = (m.fed, m.level, m.last);
            // The log is replayed from its start over the snapshot, as the store may be
            // handed entries it already holds: `entry::check_next` skips them.
            r.applied = 0;
            r.commit = r.snapshot.0;
            r.known_leader = None;
            r.last_heard_ms = now_ms;
        }
    }

    /// One step at real time `now_ms`: durability, elections, proposals, replication,
    /// commit, apply, answers. Returns the entries newly committed (in order), or a
    /// description of a broken Raft-model invariant.
    pub fn step(&mut self, now_ms: u64, net: &mut Net<Msg>) -> Result<Vec<LogEntry>, String> {
        for r in &mut self.replicas {
            if r.up {
                r.make_durable(now_ms);
            }
        }
        self.elections(now_ms, net);
        let n = self.replicas.len();
        let mut newly = Vec::new();
        let support = if now_ms >= self.upgrade_at_ms {
            self.target_level
        } else {
            self.start_level
        };
        for l in 0..n {
            let Some(r) = self.replicas.get_mut(l) else { continue };
            if !(r.up && r.leader) {
                continue;
            }
            // Propose: the tick, and everything queued, as one entry (group commit).
            let clock = r.clock(now_ms);
            if clock >= r.last_tick_ms + TICK_MS {
                r.last_tick_ms = clock;
                r.batch.push((Command::Tick, None));
            }
            if !r.batch.is_empty() {
                let batch = std::mem::take(&mut r.batch);
                let routes = batch
                    .iter()
                    .map(|(c, route)| {
                        let seq = match c {
                            Command::Report(rep) => Some(rep.seq),
                            _ => None,
                        };
                        route.map(|r| (r, seq))
                    })
                    .collect();
                let commands: Vec<Command> = batch.into_iter().map(|(c, _)| c).collect();
                // What the control plane's batcher proposes at the group's level.
                let req = entry::prepare(r.level, clock, commands, BTreeMap::new(), Some(support));
                let term = r.term;
                r.append(LogEntry { term, req }, now_ms);
                r.waiting.insert(r.log.len(), routes);
                if r.disk_delay_ms == 0 {
                    r.make_durable(now_ms);
                }
            }
            for f in 0..n {
                if f != l {
                    self.replicate(l, f, now_ms, net)?;
                }
            }
            newly.extend(self.advance_commit(l, now_ms, net)?);
        }
        Ok(newly)
    }

    fn elections(&mut self, now_ms: u64, net: &Net<Msg>) {
        let n = self.replicas.len();
        for c in 0..n {
            let Some(r) = self.replicas.get(c) else { continue };
            if !r.up || r.leader || now_ms < r.last_heard_ms + r.timeout_ms {
                continue;
            }
            let term = r.term + 1;
            let (last_term, last_len) = (r.last_term(), r.log.len());
            let mut votes = 1;
            for v in 0..n {
                if v == c || !net.both_up(Addr::Cp(c), Addr::Cp(v)) {
                    continue;
                }
                let Some(voter) = self.replicas.get_mut(v) else {
                    continue;
                };
                if !voter.up || voter.term >= term {
                    continue;
                }
                // A higher term makes a leader step down, vote or not.
                voter.term = term;
                if voter.leader {
                    voter.step_down();
                }
                voter.known_leader = None;
                let up_to_date = (last_term, last_len) >= (voter.last_term(), voter.log.len());
                if up_to_date {
                    votes += 1;
                    voter.last_heard_ms = now_ms;
                }
            }
            let majority = self.majority();
            let timeout = self.rng.range(ELECTION_TIMEOUT_MS.0, ELECTION_TIMEOUT_MS.1);
            let Some(r) = self.replicas.get_mut(c) else { continue };
            r.term = term;
            r.last_heard_ms = now_ms;
            r.timeout_ms = timeout;
            if votes >= majority {
                self.elections += 1;
                r.leader = true;
                r.known_leader = Some(c);
                r.match_idx = vec![0; n];
                r.last_tick_ms = 0;
                // openraft commits a blank entry of the new term; a Tick is the same
                // for the state machine's lease book and moves the clock.
                r.batch.push((Command::Tick, None));
            }
        }
    }

    fn replicate(&mut self, l: usize, f: usize, now_ms: u64, net: &Net<Msg>) -> Result<(), String> {
        if !net.both_up(Addr::Cp(l), Addr::Cp(f)) {
            return Ok(());
        }
        // A leader that stepped down earlier in this step (it met a higher term) stops.
        let (lterm, lcommit, llen) = match self.replicas.get(l) {
            Some(r) if r.up && r.leader => (r.term, r.commit, r.log.len()),
            _ => return Ok(()),
        };
        let Some(fr) = self.replicas.get(f) else { return Ok(()) };
        if !fr.up {
            return Ok(());
        }
        if fr.term > lterm {
            let fterm = fr.term;
            if let Some(lr) = self.replicas.get_mut(l) {
                lr.term = lr.term.max(fterm);
                lr.step_down();
            }
            return Ok(());
        }
        // Log matching: the longest prefix whose last entry has the same term.
        let mut k = fr.log.len().min(llen);
        while k > 0 {
            let ft = fr.log.get(k - 1).map(|e| e.term);
            let lt = self.replicas.get(l).and_then(|r| r.log.get(k - 1)).map(|e| e.term);
            if ft == lt {
                break;
            }
            k -= 1;
        }
        if k < fr.applied {
            return Err(format!(
                "raft model: node {f} would truncate to {k} below its applied index {}",
                fr.applied
            ));
        }
        let tail: Vec<LogEntry> = self.replicas.get(l).map(|r| r.log[k..].to_vec()).unwrap_or_default();
        let Some(fr) = self.replicas.get_mut(f) else {
            return Ok(());
        };
        fr.term = lterm;
        if fr.leader {
            fr.step_down();
        }
        fr.known_leader = Some(l);
        fr.last_heard_ms = now_ms;
        if fr.log.len() > k || !tail.is_empty() {
            fr.log.truncate(k);
            fr.durable_len = fr.durable_len.min(k);
            fr.pending_durable.retain(|&(len, _)| len <= k);
            for e in tail {
                fr.append(e, now_ms);
            }
            if fr.disk_delay_ms == 0 {
                fr.make_durable(now_ms);
            }
        }
        let durable = fr.durable_len;
        fr.commit = fr.commit.max(lcommit.min(durable));
        fr.apply_committed();
        if let Some(lr) = self.replicas.get_mut(l) {
            if let Some(m) = lr.match_idx.get_mut(f) {
                *m = (*m).max(durable);
            }
        }
        Ok(())
    }

    fn advance_commit(&mut self, l: usize, now_ms: u64, net: &mut Net<Msg>) -> Result<Vec<LogEntry>, String> {
        let majority = self.majority();
        let Some(r) = self.replicas.get_mut(l) else {
            return Ok(Vec::new());
        };
        if !r.leader {
            return Ok(Vec::new());
        }
        let mut acks: Vec<usize> = r.match_idx.clone();
        if let Some(own) = acks.get_mut(l) {
            *own = r.durable_len;
        }
        acks.sort_unstable_by(|a, b| b.cmp(a));
        let n = acks.get(majority - 1).copied().unwrap_or(0);
        // Only an entry of the leader's own term commits by counting (Raft section 5.4.2).
        if n > r.commit && r.log.get(n - 1).is_some_and(|e| e.term == r.term) {
            r.commit = n;
        }
        // The global committed log must only grow, never change.
        let mut newly = Vec::new();
        let known = self.committed.len();
        if r.commit > known {
            if let (Some(a), Some(b)) = (
                known.checked_sub(1).and_then(|i| self.committed.get(i)),
                known.checked_sub(1).and_then(|i| r.log.get(i)),
            ) {
                if a != b {
                    return Err(format!(
                        "raft model: leader {l} committed over a different entry at index {known}"
                    ));
                }
            }
            newly = r.log[known..r.commit].to_vec();
            self.committed.extend(newly.iter().cloned());
        }
        let results = r.apply_committed();
        let from_node = l;
        for (idx, res) in results {
            let Some(routes) = r.waiting.remove(&idx) else { continue };
            for (route, outcome) in routes.into_iter().zip(res) {
                let Some((route, seq)) = route else { continue };
                let applied = !matches!(&outcome, Ok(Applied::Reported { applied: false, .. }));
                let outcome = match outcome {
                    Ok(Applied::Registered(lease)) | Ok(Applied::Reported { lease, .. }) => {
                        let (last_seq, reported_through_ms) = r
                            .state
                            .clusters()
                            .get(&lease.cluster)
                            .map_or((0, 0), |c| (c.last_seq, c.reported_through_ms.unwrap_or(0)));
                        AnswerOutcome::Lease {
                            lease,
                            seq,
                            policy: r.state.policy().cloned().map(Box::new),
                            applied,
                            last_seq,
                            reported_through_ms,
                        }
                    }
                    Err(CommandError::SequenceGap { expected, got, .. }) => {
                        AnswerOutcome::SequenceGap { seq: got, expected }
                    }
                    Ok(other) => AnswerOutcome::Refused(format!("unexpected answer {other:?}")),
                    Err(e) => AnswerOutcome::Refused(e.to_string()),
                };
                let ans = AgentAnswer {
                    from_node,
                    sent_agent_ms: route.sent_agent_ms,
                    outcome,
                };
                net.send(
                    &mut self.rng,
                    now_ms,
                    Addr::Cp(l),
                    Addr::Agent(route.agent),
                    Msg::Answer(ans),
                );
            }
        }
        Ok(newly)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvota_fairness::policy::Policy;

    fn policy() -> Policy {
        Policy::from_yaml(crate::world::POLICY_A).expect("policy")
    }

    fn run_until(cp: &mut Cp, net: &mut Net<Msg>, now: &mut u64, until: u64) -> Vec<LogEntry> {
        let mut out = Vec::new();
        while *now < until {
            *now += 100;
            out.extend(cp.step(*now, net).expect("raft model"));
        }
        out
    }

    fn isolate(net: &mut Net<Msg>, node: usize, n: usize) {
        for o in (0..n).filter(|&o| o != node) {
            net.cut(Addr::Cp(node), Addr::Cp(o));
            net.cut(Addr::Cp(o), Addr::Cp(node));
        }
    }

    #[test]
    fn an_isolated_leader_commits_nothing_and_the_majority_moves_on() {
        let mut cp = Cp::new(3, &[0, 0, 0], Rng::new(1));
        let mut net: Net<Msg> = Net::new();
        let mut now = 0;
        assert!(cp.propose_admin(Command::ApplyPolicy(policy())));
        run_until(&mut cp, &mut net, &mut now, 1_000);
        let before = cp.committed.len();
        assert!(before >= 1, "the policy entry commits with all nodes up");
        isolate(&mut net, 0, 3);
        // The old leader keeps proposing (ticks) but cannot reach a majority.
        run_until(&mut cp, &mut net, &mut now, 6_000);
        let old = cp.replicas.first().expect("node 0");
        assert!(old.leader, "an isolated leader does not know it was deposed");
        assert!(old.log.len() > old.commit, "its new entries stay uncommitted");
        let new = cp.leader().expect("a new leader");
        assert_ne!(new, 0);
        assert!(cp.committed.len() > before, "the majority commits under the new leader");
        // Heal: the old leader steps down, its uncommitted suffix is replaced, and every
        // node ends with the same state machine.
        net.heal_all();
        run_until(&mut cp, &mut net, &mut now, 9_000);
        assert!(!cp.replicas.first().expect("node 0").leader);
        let mut m = Machine::default();
        for (i, e) in cp.committed.iter().enumerate() {
            m.apply(u64::try_from(i + 1).expect("index"), &e.req);
        }
        for r in &cp.replicas {
            assert_eq!(r.applied, cp.committed.len());
            assert_eq!(r.machine(), m);
        }
    }

    #[test]
    fn a_slow_majority_disk_delays_commit_and_a_crash_loses_only_what_was_not_durable() {
        let mut cp = Cp::new(3, &[0, 0, 0], Rng::new(2));
        let mut net: Net<Msg> = Net::new();
        let mut now = 0;
        for r in &mut cp.replicas {
            r.disk_delay_ms = 1_000;
        }
        assert!(cp.propose_admin(Command::ApplyPolicy(policy())));
        run_until(&mut cp, &mut net, &mut now, 500);
        assert!(cp.committed.is_empty(), "nothing is durable on a majority yet");
        cp.crash(1);
        assert_eq!(
            cp.replicas.get(1).map(|r| r.log.len()),
            Some(0),
            "the unsynced entry is gone"
        );
        cp.restart(1, now);
        run_until(&mut cp, &mut net, &mut now, 3_000);
        assert!(!cp.committed.is_empty(), "commits once the disks caught up");
        assert!(cp.replicas.iter().all(|r| r.state.policy().is_some()));
    }
}
