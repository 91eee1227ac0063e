//! A compromised member against the Raft port, over real processes and TLS: node 3's
//! process is gone and its certificate is the attacker's. As a client it sends Raft
//! requests no correct node sends (terms at, below and above the accepted bound and
//! `u64::MAX`, inconsistent votes and log ids, snapshot chunks out of range, entries of
//! an unknown format, elections won with large term jumps); as a fake node 3 it answers
//! the others' Raft calls with replies no correct node gives. After each attack: no
//! node exited or panicked, and once the attacker stops a leader is elected and
//! `policy apply` works within 10 s. A node whose data directory holds a vote out of
//! range (as an earlier build could save) stays up and not ready, and is repaired.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use kvota_control_plane::guard::{term_ceiling, unix_ms, MAX_FREE_INDEX, MAX_FREE_TERM, MAX_TERM};
use kvota_proto::raft::v1 as pb;
use pb::raft_client::RaftClient;
use tonic::transport::Channel;

use super::*;

fn vote(term: u64, node: u64, committed: bool) -> Option<pb::RaftVote> {
    Some(pb::RaftVote {
        term,
        node_id: node,
        committed,
    })
}

fn log_id(term: u64, node: u64, index: u64) -> pb::RaftLogId {
    pb::RaftLogId {
        term,
        node_id: node,
        index,
    }
}

/// A leader's AppendEntries as node 3.
fn ae(term: u64, prev: Option<pb::RaftLogId>, entries: Vec<pb::RaftEntry>) -> pb::AppendEntriesRequest {
    pb::AppendEntriesRequest {
        vote: vote(term, 3, true),
        prev_log_id: prev,
        entries,
        leader_commit: None,
    }
}

/// A log entry of `format` (an empty command: a newer build's kind, unknown here).
fn entry(id: pb::RaftLogId, format: u32) -> pb::RaftEntry {
    pb::RaftEntry {
        log_id: Some(id),
        payload: Some(pb::raft_entry::Payload::Normal(pb::LogBatch {
            format,
            now_ms: 1,
            commands: vec![pb::LogCommand::default()],
            raise_feature_level: None,
            actors: Default::default(),
        })),
    }
}

/// A candidate's Vote as node 3.
fn vote_req(term: u64, last: Option<pb::RaftLogId>) -> pb::VoteRequest {
    pb::VoteRequest {
        vote: vote(term, 3, false),
        last_log_id: last,
    }
}

/// A snapshot chunk as node 3, leader in `term`.
fn chunk(term: u64, id: &str, last_index: u64, offset: u64, data: Vec<u8>, done: bool) -> pb::InstallSnapshotRequest {
    pb::InstallSnapshotRequest {
        vote: vote(term, 3, true),
        meta: Some(pb::RaftSnapshotMeta {
            last_log_id: Some(log_id(term, 3, last_index)),
            membership_log_id: None,
            membership: Some(pb::RaftMembership::default()),
            snapshot_id: id.to_string(),
        }),
        offset,
        data,
        done,
    }
}

fn refused(r: Result<impl std::fmt::Debug, tonic::Status>, code: Code, words: &str, what: &str) {
    let e = r.expect_err(what);
    assert!(
        e.code() == code && e.message().contains(words),
        "{what}: expected {code:?} saying {words:?}, got {e:?}"
    );
}

fn mismatch(r: Result<tonic::Response<pb::InstallSnapshotReply>, tonic::Status>, expect: u64, what: &str) {
    match r.map(|r| r.into_inner().result) {
        Ok(Some(pb::install_snapshot_reply::Result::Mismatch(m))) => {
            assert_eq!(m.expect_offset, expect, "{what}: {m:?}")
        }
        other => panic!("{what}: expected a mismatch expecting offset {expect}, got {other:?}"),
    }
}

impl Fed {
    /// A Raft client to node `to` holding node `as_node`'s certificate.
    fn raft_as(&self, as_node: u64, to: u64) -> RaftClient<Channel> {
        let spec = &self.specs[usize::try_from(to - 1).expect("id")];
        kvota_control_plane::network::raft_client(
            &spec.raft,
            to,
            Some(&self.party(Role::Node, &as_node.to_string())),
            Duration::from_secs(2),
        )
        .expect("client")
    }

    /// Every server process the test did not stop still runs, and none has logged a
    /// panic.
    fn all_running(&mut self, what: &str) {
        let mut gone = Vec::new();
        for (i, c) in self.procs.0.iter_mut().enumerate() {
            if let Some(c) = c {
                if let Ok(Some(status)) = c.try_wait() {
                    gone.push(format!("node {} exited: {status}", i + 1));
                }
            }
        }
        for s in &self.specs {
            if std::fs::read_to_string(s.log())
                .unwrap_or_default()
                .contains("panicked")
            {
                gone.push(format!("node {} panicked", s.id));
            }
        }
        assert!(gone.is_empty(), "{what}: {gone:?}\n{}", self.logs());
    }

    /// Node `id`'s `/readyz`.
    async fn readyz(&self, id: u64) -> (u16, String) {
        let s = &self.specs[usize::try_from(id - 1).expect("id")];
        kvota_testkit::http_get(
            &kvota_testkit::anonymous(&self.party(Role::Viewer, "v")),
            &s.http,
            "/readyz",
        )
        .await
        .unwrap_or((0, String::new()))
    }

    /// The sum of node `id`'s samples of `series` (a counter family) whose labels contain
    /// `label`.
    async fn counter(&self, id: u64, series: &str, label: &str) -> f64 {
        let s = &self.specs[usize::try_from(id - 1).expect("id")];
        let viewer = self.party(Role::Viewer, "v").connector(Expect::AnyNode);
        let Ok((200, m)) = kvota_testkit::http_get(&viewer, &s.http, "/metrics").await else {
            return 0.0;
        };
        m.lines()
            .filter(|l| l.starts_with(&format!("{series}{{")) && l.contains(label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// The highest term a running node reports.
    async fn term(&self) -> u64 {
        self.statuses().await.iter().map(|s| s.2).max().unwrap_or(0)
    }
}

/// After an attack stopped: every server process still runs and none panicked; a leader
/// is elected and `policy apply` works, within 10 s. The leader's term.
async fn recovers(fed: &mut Fed, what: &str) -> u64 {
    let t0 = Instant::now();
    fed.all_running(what);
    let op = fed.client(Role::Operator, "alice");
    while apply_policy(&op).await.is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{what}: no policy applied within 10 s of the attack's end\n{}",
            fed.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took = t0.elapsed();
    let (leader, term) = fed.one_leader().await;
    fed.all_running(what);
    eprintln!("{what}: a policy applied {took:?} after the attack; leader {leader}, term {term}");
    term
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_certificate_cannot_strand_stop_or_panic_the_others() {
    let mut fed = Fed::start().await;
    // A node whose data directory holds a vote out of range (an earlier build saved a
    // forged reply's): up and healthy, not ready, saying how to recover; repaired, it
    // rejoins.
    fed.procs.kill(0);
    let meta = fed.specs[0].dir.join("raft").join("meta.json");
    let mut m: Value = serde_json::from_slice(&std::fs::read(&meta).expect("meta.json")).expect("json");
    m["vote"]["leader_id"]["term"] = json!(u64::MAX);
    std::fs::write(&meta, serde_json::to_vec(&m).expect("json")).expect("write meta.json");
    let c = fed.spawn(0, false);
    fed.procs.0[0] = Some(c);
    let deadline = Instant::now() + Duration::from_secs(15);
    let (code, body) = loop {
        let r = fed.readyz(1).await;
        if r.0 == 503 || Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let data_dir = fed.specs[0].dir.display().to_string();
    assert!(
        code == 503 && body.contains(&format!("kvota repair-vote --id 1 --data-dir {data_dir}")),
        "{code} {body}\n{}",
        fed.logs()
    );
    let spec = &fed.specs[0];
    let (code, _) = kvota_testkit::http_get(
        &kvota_testkit::anonymous(&fed.party(Role::Viewer, "v")),
        &spec.http,
        "/healthz",
    )
    .await
    .expect("healthz");
    assert_eq!(code, 200, "a parked node is healthy: restarting it changes nothing");
    recovers(&mut fed, "node 1 kept from starting its Raft core").await;
    fed.procs.kill(0);
    let out = Command::new(bin())
        .args(["repair-vote", "--id", "1", "--data-dir", &data_dir])
        .output()
        .expect("kvota repair-vote");
    let said = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && said.contains("it is now"), "{said}");
    let c = fed.spawn(0, false);
    fed.procs.0[0] = Some(c);
    let deadline = Instant::now() + Duration::from_secs(15);
    while fed.readyz(1).await.0 != 200 {
        assert!(
            Instant::now() < deadline,
            "node 1 did not rejoin: {:?}\n{}",
            fed.readyz(1).await,
            fed.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    recovers(&mut fed, "node 1 repaired").await;

    // Node 3's key is in the attacker's hands: its process is gone, the test speaks as it.
    fed.procs.kill(2);
    let t = recovers(&mut fed, "node 3 stopped").await;

    // Terms no peer may bring: the top of the range, and past the part of the headroom
    // open now (by 1,000 terms: 100 s).
    for term in [u64::MAX, MAX_TERM + 1, term_ceiling(unix_ms()) + 1_000] {
        for n in [1, 2] {
            let mut c = fed.raft_as(3, n);
            refused(
                c.append_entries(ae(term, None, vec![])).await,
                Code::InvalidArgument,
                "term",
                "AE",
            );
            refused(
                c.vote(vote_req(term, None)).await,
                Code::InvalidArgument,
                "term",
                "Vote",
            );
            let r = c.install_snapshot(chunk(term, "s", 10, 0, vec![1], false)).await;
            refused(r, Code::InvalidArgument, "term", "InstallSnapshot");
        }
    }
    assert_eq!(recovers(&mut fed, "terms out of range").await, t, "the term moved");

    // Votes and log ids no correct node sends: refused before openraft sees them.
    let mut c = fed.raft_as(3, 1);
    let mut uncommitted = ae(t + 1, None, vec![]);
    uncommitted.vote = vote(t + 1, 3, false);
    refused(
        c.append_entries(uncommitted).await,
        Code::InvalidArgument,
        "uncommitted",
        "AE",
    );
    let mut committed = vote_req(t + 1, None);
    committed.vote = vote(t + 1, 3, true);
    refused(c.vote(committed).await, Code::InvalidArgument, "committed", "Vote");
    let rewrite = ae(t + 1, Some(log_id(t + 1, 3, 1)), vec![]);
    refused(
        c.append_entries(rewrite).await,
        Code::InvalidArgument,
        "committed log",
        "AE rewriting",
    );
    let mut late = chunk(t + 1, "s", 10_000, 0, vec![1], false);
    late.meta.as_mut().expect("meta").membership_log_id = Some(log_id(t + 1, 3, 10_001));
    refused(
        c.install_snapshot(late).await,
        Code::InvalidArgument,
        "membership",
        "snapshot",
    );
    let far = chunk(t + 1, "s", MAX_FREE_INDEX + 1, 0, vec![1], false);
    refused(
        c.install_snapshot(far).await,
        Code::InvalidArgument,
        "index",
        "snapshot index",
    );

    // Snapshot chunks out of range, out of order, of another snapshot, and one that does
    // not read: refused or answered with the offset expected; nothing reaches openraft.
    let s = |id: &str, offset: u64, len: usize, done: bool| chunk(t + 1, id, 10_000, offset, vec![7; len], done);
    refused(
        c.install_snapshot(s("a", 1 << 40, 1, false)).await,
        Code::InvalidArgument,
        "largest snapshot",
        "offset",
    );
    refused(
        c.install_snapshot(s("a", u64::MAX, 1, false)).await,
        Code::InvalidArgument,
        "largest snapshot",
        "u64::MAX",
    );
    mismatch(
        c.install_snapshot(s("a", 5, 10, false)).await,
        0,
        "a first chunk not at 0",
    );
    c.install_snapshot(s("a", 0, 10, false)).await.expect("a first chunk");
    mismatch(c.install_snapshot(s("a", 30, 10, false)).await, 10, "a gap");
    mismatch(
        c.install_snapshot(s("b", 10, 10, false)).await,
        0,
        "another snapshot's second chunk",
    );
    refused(
        c.install_snapshot(s("b", 0, 64, true)).await,
        Code::InvalidArgument,
        "does not read",
        "garbage",
    );
    assert_eq!(recovers(&mut fed, "inconsistent requests").await, t, "the term moved");

    // A prev_log_id and a commit index past the log: a conflict, and nothing committed.
    let past = ae(t + 1, Some(log_id(t + 1, 3, 1 << 40)), vec![]);
    let r = c.append_entries(past).await.expect("answered").into_inner();
    assert!(
        matches!(r.result, Some(pb::append_entries_reply::Result::Conflict(_))),
        "{r:?}"
    );
    let mut commit = ae(t + 1, None, vec![]);
    commit.leader_commit = Some(log_id(t + 1, 3, 1 << 40));
    c.append_entries(commit).await.expect("a heartbeat");
    let t = recovers(&mut fed, "prev_log_id and commit index past the log").await;

    // Entries of an unknown format: from a stale leader only refused; from the leader
    // of a newer term refused, and the node is unready saying why until entries it
    // reads arrive.
    let stale = ae(t - 1, None, vec![entry(log_id(t - 1, 3, 1 << 20), 99)]);
    refused(
        c.append_entries(stale).await,
        Code::FailedPrecondition,
        "format 99",
        "from a stale leader",
    );
    assert_eq!(fed.readyz(1).await.0, 200, "{}", fed.readyz(1).await.1);
    c.append_entries(ae(t + 1, None, vec![]))
        .await
        .expect("node 3 takes the lead");
    let newer = ae(t + 1, None, vec![entry(log_id(t + 1, 3, 0), 99)]);
    refused(
        c.append_entries(newer).await,
        Code::FailedPrecondition,
        "format 99",
        "from a leader",
    );
    let (code, body) = fed.readyz(1).await;
    assert!(
        code == 503
            && body.contains(&format!("node 3, leader in term {}", t + 1))
            && body.contains("log entries of format 99")
            && body.contains("upgrade this node's kvota, or remove node 3"),
        "{code} {body}"
    );
    recovers(&mut fed, "entries of an unknown format").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while fed.readyz(1).await.0 != 200 {
        assert!(
            Instant::now() < deadline,
            "node 1 not ready again: {:?}",
            fed.readyz(1).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A voter that keeps winning elections with large term jumps, and leads each term.
    let mut term = fed.term().await;
    let (mut granted, mut led) = (0, 0);
    for _ in 0..20 {
        term += 100_000;
        for n in [1, 2] {
            let mut c = fed.raft_as(3, n);
            let last = Some(log_id(term, 3, 1 << 40));
            if c.vote(vote_req(term, last))
                .await
                .is_ok_and(|r| r.into_inner().vote_granted)
            {
                granted += 1;
            }
            if let Ok(r) = c.append_entries(ae(term, None, vec![])).await {
                led += u32::from(matches!(
                    r.into_inner().result,
                    Some(pb::append_entries_reply::Result::Success(_))
                ));
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(led > 0, "the attacker never led (granted {granted})");
    let after = recovers(&mut fed, "elections won with large term jumps").await;
    assert!(after > term, "{after} <= {term}");

    // The bounds: just below and at the last term accepted whatever the time, and at the
    // last term open now; then within the headroom, a term not open yet refused and the
    // next one taken. The group goes on electing past each.
    for (term, what) in [
        (MAX_FREE_TERM - 1, "just below the bound"),
        (MAX_FREE_TERM, "at the bound"),
        (term_ceiling(unix_ms()), "at the last term open now"),
    ] {
        for n in [1, 2] {
            fed.raft_as(3, n)
                .append_entries(ae(term, None, vec![]))
                .await
                .expect(what);
        }
        let after = recovers(&mut fed, what).await;
        assert!(after > term, "{what}: {after}");
    }
    let cur = fed.term().await;
    refused(
        fed.raft_as(3, 1).append_entries(ae(cur + 1_000, None, vec![])).await,
        Code::InvalidArgument,
        "opens in",
        "a term of the headroom not open yet",
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    fed.raft_as(3, 1)
        .append_entries(ae(cur + 1, None, vec![]))
        .await
        .expect("one step");
    let after = recovers(&mut fed, "a step within the headroom").await;
    assert!(after > cur + 1, "{after} <= {cur} + 1");
    refused(
        fed.raft_as(3, 2).append_entries(ae(u64::MAX, None, vec![])).await,
        Code::InvalidArgument,
        "term",
        "u64::MAX in the headroom",
    );
}

/// How the fake node 3 answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    /// `UNAVAILABLE` to everything (a node that is down).
    Down,
    /// A higher vote of this term to every call (not granted to a Vote).
    HigherVote(u64),
    /// AppendEntries: a "higher" vote equal to the sender's; Vote: granted, to another
    /// node; InstallSnapshot: the sender's vote.
    NotHigher,
    /// AppendEntries: a conflict, also where no prev_log_id was sent; Vote: a last log id
    /// past any index.
    Conflict,
    /// AppendEntries: a partial success past what was sent; Vote: granted, as the
    /// candidate asked.
    PastSent,
    /// AppendEntries: a conflict; InstallSnapshot: a mismatch about another snapshot and
    /// offset.
    SnapshotMismatch,
}

/// A fake node 3 on node 3's Raft address, with node 3's certificate.
#[derive(Clone)]
struct FakeNode {
    answer: Arc<Mutex<Answer>>,
    calls: Arc<[AtomicU64; 3]>,
}

impl FakeNode {
    fn answer(&self) -> Answer {
        *self.answer.lock().expect("lock")
    }

    fn set(&self, a: Answer) {
        *self.answer.lock().expect("lock") = a;
    }

    fn count(&self, i: usize) {
        self.calls[i].fetch_add(1, Ordering::Relaxed);
    }

    async fn serve(fed: &Fed) -> (FakeNode, tokio::sync::watch::Sender<bool>) {
        let fake = FakeNode {
            answer: Arc::new(Mutex::new(Answer::Down)),
            calls: Arc::new(Default::default()),
        };
        let stop =
            kvota_testkit::fake_raft::serve(&fed.specs[2].raft, &fed.party(Role::Node, "3"), Arc::new(fake.clone()))
                .await;
        (fake, stop)
    }
}

fn fake_vote(term: u64) -> Option<pb::RaftVote> {
    vote(term, 3, false)
}

impl kvota_testkit::fake_raft::Answers for FakeNode {
    fn append_entries(&self, r: pb::AppendEntriesRequest) -> Result<pb::AppendEntriesReply, tonic::Status> {
        use pb::append_entries_reply::Result as R;
        self.count(0);
        let last = r
            .entries
            .last()
            .and_then(|e| e.log_id)
            .or(r.prev_log_id)
            .unwrap_or_default();
        let result = match self.answer() {
            Answer::Down => return Err(tonic::Status::unavailable("down")),
            Answer::HigherVote(t) => R::HigherVote(fake_vote(t).expect("vote")),
            Answer::NotHigher => R::HigherVote(r.vote.unwrap_or_default()),
            Answer::Conflict | Answer::SnapshotMismatch => R::Conflict(pb::Empty {}),
            Answer::PastSent => R::PartialSuccess(pb::RaftPartialSuccess {
                matching: Some(log_id(last.term, last.node_id, last.index + 1_000)),
            }),
        };
        Ok(pb::AppendEntriesReply { result: Some(result) })
    }

    fn vote(&self, r: pb::VoteRequest) -> Result<pb::VoteReply, tonic::Status> {
        self.count(1);
        let asked = r.vote.unwrap_or_default();
        let (v, granted, last) = match self.answer() {
            Answer::Down => return Err(tonic::Status::unavailable("down")),
            Answer::HigherVote(t) => (fake_vote(t), false, None),
            Answer::NotHigher => (vote(asked.term, 3, false), true, None),
            Answer::Conflict | Answer::SnapshotMismatch => {
                (vote(asked.term, 3, false), false, Some(log_id(asked.term, 3, u64::MAX)))
            }
            Answer::PastSent => (Some(asked), true, Some(log_id(u64::MAX, 3, 1))),
        };
        Ok(pb::VoteReply {
            vote: v,
            vote_granted: granted,
            last_log_id: last,
        })
    }

    fn install_snapshot(&self, r: pb::InstallSnapshotRequest) -> Result<pb::InstallSnapshotReply, tonic::Status> {
        use pb::install_snapshot_reply::Result as R;
        self.count(2);
        let id = r.meta.map(|m| m.snapshot_id).unwrap_or_default();
        let result = match self.answer() {
            Answer::Down => return Err(tonic::Status::unavailable("down")),
            Answer::HigherVote(t) => R::Vote(fake_vote(t).expect("vote")),
            Answer::SnapshotMismatch => R::Mismatch(pb::RaftSnapshotMismatch {
                expect_id: format!("{id}-other"),
                expect_offset: u64::MAX,
                got_id: id,
                got_offset: r.offset + 7,
            }),
            _ => R::Vote(r.vote.unwrap_or_default()),
        };
        Ok(pb::InstallSnapshotReply { result: Some(result) })
    }
}

/// Replies refused by nodes 1 and 2 so far (`kvota_raft_replies_refused_total`).
async fn replies_refused(fed: &Fed, method: &str) -> f64 {
    fed.counter(1, "kvota_raft_replies_refused_total", method).await
        + fed.counter(2, "kvota_raft_replies_refused_total", method).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fake_nodes_replies_cannot_strand_stop_or_panic_the_others() {
    // Snapshots often, and no log kept behind them: the leader soon sends node 3 one.
    let mut fed = Fed::start_with(&["--snapshot-every", "40", "--snapshot-catchup-entries", "0"]).await;
    fed.procs.kill(2);
    let (fake, stop) = FakeNode::serve(&fed).await;
    let t = recovers(&mut fed, "node 3 replaced by a fake").await;
    // The cases, each with the method whose replies must be refused: a higher vote at
    // the top, past the bound, not higher; a conflict where no prev_log_id was sent (the
    // fake's log is empty, so the leader soon sends from the start); a partial success
    // past what was sent; then (below) the bound itself, and snapshots.
    let cases = [
        (
            Answer::Conflict,
            "AppendEntries",
            "a conflict with no prev_log_id; last log ids past any index",
        ),
        (
            Answer::HigherVote(u64::MAX),
            "AppendEntries",
            "a higher vote of term u64::MAX",
        ),
        (
            Answer::HigherVote(term_ceiling(unix_ms()) + 1_000),
            "AppendEntries",
            "a higher vote past the part of the headroom open now",
        ),
        (
            Answer::NotHigher,
            "AppendEntries",
            "a higher vote that is not higher; a vote granted to another",
        ),
        (
            Answer::PastSent,
            "AppendEntries",
            "a partial success past what was sent; a last log id of term u64::MAX",
        ),
    ];
    for (answer, method, what) in cases {
        let before = replies_refused(&fed, method).await;
        fake.set(answer);
        // An election, so the others ask the fake for its vote too: node 3's
        // certificate claims a term, then stays silent.
        let term = fed.term().await + 1;
        for n in [1, 2] {
            let _ = fed.raft_as(3, n).append_entries(ae(term, None, vec![])).await;
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while replies_refused(&fed, method).await <= before {
            assert!(Instant::now() < deadline, "{what}: no reply refused\n{}", fed.logs());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        fake.set(Answer::Down);
        let after = recovers(&mut fed, what).await;
        assert!(after < MAX_FREE_TERM, "{what}: the term moved to {after}");
        assert!(after > t, "an election followed");
    }
    assert!(replies_refused(&fed, "Vote").await > 0.0, "no vote reply refused");

    // Higher votes just below and at the bounds are taken: the group moves there, and
    // elects past them one term at a time.
    for (term, what) in [
        (MAX_FREE_TERM - 1, "a higher vote just below the bound"),
        (MAX_FREE_TERM, "a higher vote at the bound"),
        (term_ceiling(unix_ms()), "a higher vote at the last term open now"),
    ] {
        fake.set(Answer::HigherVote(term));
        let deadline = Instant::now() + Duration::from_secs(10);
        while fed.term().await < term {
            assert!(Instant::now() < deadline, "{what}: not taken\n{}", fed.logs());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        fake.set(Answer::Down);
        let after = recovers(&mut fed, what).await;
        assert!(after >= term, "{what}: {after}");
    }

    // Snapshots: enough entries for the leader to snapshot and drop its log, so it must
    // send the fake one; the fake answers with mismatches about other snapshots.
    let op = fed.client(Role::Operator, "alice");
    for _ in 0..50 {
        apply_policy(&op).await.expect("policy");
    }
    let before = replies_refused(&fed, "InstallSnapshot").await;
    let sent = fake.calls[2].load(Ordering::Relaxed);
    fake.set(Answer::SnapshotMismatch);
    let deadline = Instant::now() + Duration::from_secs(20);
    while replies_refused(&fed, "InstallSnapshot").await <= before {
        assert!(
            Instant::now() < deadline,
            "no snapshot reply refused ({} chunks sent to the fake)\n{}",
            fake.calls[2].load(Ordering::Relaxed) - sent,
            fed.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    fake.set(Answer::HigherVote(u64::MAX));
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    fake.set(Answer::Down);
    recovers(&mut fed, "snapshot replies about other snapshots, and of term u64::MAX").await;

    // The fake stops; the real node 3 comes back and follows.
    let _ = stop.send(true);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let c = fed.spawn(2, false);
    fed.procs.0[2] = Some(c);
    let deadline = Instant::now() + Duration::from_secs(15);
    while fed.readyz(3).await.0 != 200 {
        assert!(
            Instant::now() < deadline,
            "node 3 did not rejoin: {:?}\n{}",
            fed.readyz(3).await,
            fed.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    recovers(&mut fed, "the fake gone, node 3 back").await;
}
