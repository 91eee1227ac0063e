//! The enforcement state an agent keeps for the next process (`persist.rs`): kept in a
//! ConfigMap with the resourceVersion as a fence, restored by a new process with the
//! lease's remaining life measured conservatively, and never used when it is corrupt,
//! newer, of another cluster, or older than what the process holds.
//!
//! No API server can run here: the ConfigMap lives in the fake API server of
//! `support/fake_apiserver.rs` (get, create, replace with resourceVersion conflicts).

#[path = "support/fake_apiserver.rs"]
mod fake_apiserver;

use kvota_fairness::names::ClusterName;
use kvota_fairness::names::TenantName;
use std::sync::Arc;

use fake_apiserver::{FakeApi, Kind};
use kvota_fairness::lease::{Lease, LeaseStatus, TenantBudget};
use kvota_fairness::policy::Policy;
use kvota_member_agent::agent::Agent;
use kvota_member_agent::kube::{ConfigMapStore, STATE_KEY};
use kvota_member_agent::persist::{self, FileStore, PersistError, StateStore};
use serde_json::json;

const POLICY: &str = "apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: persist-test}
spec:
  lease: {duration: 60s, clockSkewMargin: 2s}
  tenants:
  - {name: training, weight: 40, minShare: 20, maxShare: 60, namespaces: [ml]}
";

fn lease(epoch: u64, budget: u64, fallback: u64) -> Lease {
    Lease {
        cluster: ClusterName::from_static("east"),
        epoch,
        duration_ms: 60_000,
        margin_ms: 2_000,
        issued_at_ms: 1,
        budgets: [(
            TenantName::from_static("training"),
            TenantBudget {
                budget,
                fallback,
                entitlement: budget,
                borrow: 0,
                ceiling: 0,
            },
        )]
        .into(),
    }
}

/// An agent of cluster `east` that cannot reach any control plane.
fn agent(dir: &std::path::Path) -> Agent {
    Agent::open(
        &ClusterName::from_static("east"),
        [("nvidia.com/gpu".to_string(), 8_000)].into(),
        dir,
        &["127.0.0.1:1".to_string()],
    )
    .expect("agent")
}

/// An agent of cluster `east` (no control plane) keeping its state in `store`.
fn agent_on(dir: &std::path::Path, store: &Arc<dyn StateStore>, replica: &str) -> Agent {
    let a = agent(dir);
    a.set_state_store(store.clone(), replica);
    a
}

/// An agent that holds the policy and `l`, received just now.
/// An agent holding `l`, written to its journal first as adopting a lease does (a
/// report acknowledges no epoch its journal lacks).
fn holding(dir: &std::path::Path, l: Lease) -> Agent {
    kvota_member_agent::journal::Journal::open(dir)
        .expect("journal")
        .save_lease(&l)
        .expect("journal the lease");
    let a = agent(dir);
    let mut st = a.state();
    st.set_policy(Policy::from_yaml(POLICY).expect("policy"));
    let now = st.now_ms();
    st.lease.on_lease(l, now);
    drop(st);
    a
}

#[tokio::test]
async fn a_config_map_keeps_the_state_and_fences_a_writer_that_lost_the_race() {
    let api = FakeApi::start().await;
    let leader = ConfigMapStore::new(api.client(), "kvota-system", "kvota-agent-state");
    assert_eq!(leader.load().await.expect("load"), None, "nothing kept yet");
    leader.save(b"{\"one\":1}".to_vec()).await.expect("create");
    let kept = api
        .get(Kind::ConfigMap, "kvota-system/kvota-agent-state")
        .expect("made");
    assert_eq!(kept["data"][STATE_KEY], "{\"one\":1}");
    assert_eq!(
        kept["metadata"]["annotations"]["kvota.dev/state-format"],
        persist::FORMAT_VERSION.to_string()
    );
    leader.save(b"{\"two\":2}".to_vec()).await.expect("replace");

    // A new leader reads it and writes; the old one, writing late with the version it
    // last saw, is refused and overwrites nothing.
    let next = ConfigMapStore::new(api.client(), "kvota-system", "kvota-agent-state");
    assert_eq!(next.load().await.expect("load"), Some(b"{\"two\":2}".to_vec()));
    next.save(b"{\"three\":3}".to_vec()).await.expect("new leader");
    let e = leader
        .save(b"{\"stale\":0}".to_vec())
        .await
        .expect_err("a stale writer");
    assert!(
        matches!(e, PersistError::Store { .. }) && e.to_string().contains("ConfigMap kvota-system/kvota-agent-state"),
        "{e}"
    );
    assert_eq!(next.load().await.expect("load"), Some(b"{\"three\":3}".to_vec()));

    // Another replica that never read it (its create conflicts) takes the version and
    // writes, as a leader that just won the Lease must.
    let third = ConfigMapStore::new(api.client(), "kvota-system", "kvota-agent-state");
    third
        .save(b"{\"four\":4}".to_vec())
        .await
        .expect("create conflicts, then replace");
    assert_eq!(next.load().await.expect("load"), Some(b"{\"four\":4}".to_vec()));
}

#[tokio::test]
async fn a_new_process_enforces_the_kept_lease_for_what_is_left_of_it_and_no_longer() {
    let dir = tempfile::tempdir().expect("tmp");
    let first = holding(&dir.path().join("a"), lease(7, 5_000, 1_000));
    let store: Arc<dyn StateStore> = Arc::new(FileStore::in_dir(&dir.path().join("shared")));
    first.set_state_store(store.clone(), "replica-a");
    first.persist().await.expect("persist");
    let kept = persist::decode(&store.load().await.expect("load").expect("kept"), "file", "east").expect("decode");
    let left = kept.lease_usable_until_unix_ms.saturating_sub(kept.written_unix_ms);
    assert!(
        (55_000..=58_000).contains(&left),
        "usable for duration minus margin from the request: {left} ms"
    );

    // A new process with an empty data directory: the policy and the lease at once,
    // for the kept life minus the margin once more.
    let second = agent_on(&dir.path().join("b"), &store, "replica-b");
    assert!(second.state().ready().is_err(), "nothing to judge with yet");
    second.restore().await.expect("restore").expect("something kept");
    {
        let st = second.state();
        let now = st.now_ms();
        assert_eq!(st.ready(), Ok(()), "it can judge");
        assert_eq!(st.lease.held_epoch(), 7);
        assert!(
            matches!(st.lease.status(now), LeaseStatus::Fresh { .. }),
            "{:?}",
            st.lease.status(now)
        );
        assert_eq!(st.lease.budget("training", now), 5_000);
        let until = st.lease.valid_until().expect("known");
        assert!(
            until <= now + left - 2_000,
            "never longer than the first process could have: {until} > {now} + {left} - 2000"
        );
        assert_eq!(st.lease.budget("training", until), 1_000, "then its fallback");
    }

    // A kept lease whose life is over: its fallback at once.
    let mut expired = kept.clone();
    expired.lease_usable_until_unix_ms = kept.written_unix_ms.saturating_sub(1);
    store
        .save(persist::encode(&expired).expect("encode"))
        .await
        .expect("save");
    let third = agent_on(&dir.path().join("c"), &store, "replica-c");
    third.restore().await.expect("restore");
    let st = third.state();
    assert_eq!(st.lease.status(st.now_ms()), LeaseStatus::Safe);
    assert_eq!(st.lease.budget("training", st.now_ms()), 1_000);
}

#[tokio::test]
async fn a_kept_state_that_is_older_corrupt_newer_or_another_clusters_changes_nothing() {
    let dir = tempfile::tempdir().expect("tmp");
    let store: Arc<dyn StateStore> = Arc::new(FileStore::in_dir(&dir.path().join("shared")));
    let old = holding(&dir.path().join("old"), lease(3, 9_000, 9_000));
    old.set_state_store(store.clone(), "old");
    old.persist().await.expect("persist");
    let good = store.load().await.expect("load").expect("kept");

    // This process already holds a newer epoch: the kept (older) lease is not taken.
    let newer = holding(&dir.path().join("new"), lease(4, 2_000, 500));
    newer.set_state_store(store.clone(), "new");
    newer.restore().await.expect("restore");
    assert_eq!(newer.state().lease.held_epoch(), 4, "epochs never go back");
    assert_eq!(newer.state().lease.budget("training", newer.now_ms()), 2_000);

    let mut v: serde_json::Value = serde_json::from_slice(&good).expect("json");
    v["format"] = json!(persist::FORMAT_VERSION + 1);
    let newer_format = serde_json::to_vec(&v).expect("json");
    let mut v: serde_json::Value = serde_json::from_slice(&good).expect("json");
    v["cluster"] = json!("west");
    let other_cluster = serde_json::to_vec(&v).expect("json");
    let mut torn = good.clone();
    torn.truncate(good.len() / 2);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("torn", torn, "corrupt"),
        ("garbage", b"\x00\xffnot json".to_vec(), "corrupt"),
        ("newer", newer_format, "newer than this agent reads"),
        ("west", other_cluster, "belongs to cluster `west`"),
    ];
    for (what, bytes, says) in cases {
        store.save(bytes.clone()).await.expect("save");
        let fresh = agent_on(&dir.path().join(what), &store, what);
        let e = fresh.restore().await.expect_err(what);
        assert!(e.to_string().contains(says), "{what}: {e}");
        let taken = {
            let st = fresh.state();
            (st.lease.held_epoch(), st.ready().is_err())
        };
        assert_eq!(taken, (0, true), "{what}: nothing taken from it");
        assert_eq!(
            store.load().await.expect("load"),
            Some(bytes),
            "{what}: left as it was for a person to look at"
        );
    }
}

/// A store that refuses every write (an API server that cannot be reached).
#[derive(Debug)]
struct Refusing;

impl StateStore for Refusing {
    fn load(&self) -> persist::StoreFuture<'_, Option<Vec<u8>>> {
        Box::pin(async { Ok(None) })
    }
    fn save(&self, _: Vec<u8>) -> persist::StoreFuture<'_, ()> {
        Box::pin(async {
            Err(PersistError::Store {
                store: "nowhere".into(),
                why: "refused".into(),
            })
        })
    }
    fn describe(&self) -> String {
        "nowhere".into()
    }
}

/// The control plane stops counting older leases once a report acknowledges a newer
/// epoch; a next process restores whatever the store holds. So a report acknowledges
/// only an epoch the store holds: while saving fails, the older one.
#[tokio::test]
async fn a_lease_is_acknowledged_only_once_the_store_holds_it() {
    let dir = tempfile::tempdir().expect("tmp");
    let journal_dir = dir.path().join("agent");
    {
        let a = holding(&journal_dir, lease(7, 5_000, 1_000));
        a.set_state_store(Arc::new(Refusing), "a");
        assert!(a.persist().await.is_err());
        let _ = a.report_once().await; // no control plane: the report stays in the journal
        a.set_state_store(Arc::new(FileStore::in_dir(&dir.path().join("shared"))), "a");
        a.persist().await.expect("persist");
        let _ = a.report_once().await;
    }
    let journal = kvota_member_agent::journal::Journal::open(&journal_dir).expect("journal");
    let held: Vec<u64> = journal
        .unacked(10)
        .expect("unacked")
        .iter()
        .map(|r| r.held_epoch)
        .collect();
    assert_eq!(held, vec![0, 7], "epoch 7 acknowledged only after it was kept");
}

/// An edited state cannot stretch a lease: its life is capped at what a process could
/// hold from a request sent now, and a lease that would be refused from the control
/// plane (here a margin above half its duration) is refused from the store as well.
#[tokio::test]
async fn an_edited_state_cannot_stretch_a_lease_or_smuggle_in_a_bad_one() {
    let dir = tempfile::tempdir().expect("tmp");
    let store: Arc<dyn StateStore> = Arc::new(FileStore::in_dir(&dir.path().join("shared")));
    let first = holding(&dir.path().join("a"), lease(7, 5_000, 1_000));
    first.set_state_store(store.clone(), "a");
    first.persist().await.expect("persist");
    let mut kept = persist::decode(&store.load().await.expect("load").expect("kept"), "file", "east").expect("decode");
    kept.lease_usable_until_unix_ms = u64::MAX;
    store.save(persist::encode(&kept).expect("encode")).await.expect("save");
    let second = agent_on(&dir.path().join("b"), &store, "b");
    second.restore().await.expect("restore");
    let (until, now) = {
        let st = second.state();
        (st.lease.valid_until().expect("valid"), st.now_ms())
    };
    assert!(
        until <= now + 60_000 - 2 * 2_000,
        "capped at duration minus twice the margin: {until}"
    );

    let mut bad = kept.clone();
    if let Some(l) = bad.lease.as_mut() {
        l.margin_ms = 40_000;
    }
    store.save(persist::encode(&bad).expect("encode")).await.expect("save");
    let third = agent_on(&dir.path().join("c"), &store, "c");
    let e = third.restore().await.expect_err("refused");
    assert!(e.to_string().contains("margin"), "{e}");
    assert_eq!(third.state().lease.held_epoch(), 0);
}

/// A replica that lost the Lease and writes late is refused once, and then writes
/// nothing (not even by re-reading the object) until it leads again; a state deleted by
/// a person is made again.
#[tokio::test]
async fn a_fenced_writer_stays_fenced_until_it_leads_again_and_a_deleted_state_is_remade() {
    let api = FakeApi::start().await;
    let old = ConfigMapStore::new(api.client(), "kvota-system", "kvota-agent-state");
    old.save(b"{\"old\":1}".to_vec()).await.expect("create");
    let new = ConfigMapStore::new(api.client(), "kvota-system", "kvota-agent-state");
    new.save(b"{\"new\":1}".to_vec()).await.expect("new leader writes");
    assert!(old.save(b"{\"old\":2}".to_vec()).await.is_err(), "409");
    let e = old.save(b"{\"old\":3}".to_vec()).await.expect_err("still fenced");
    assert!(e.to_string().contains("wins the leader Lease"), "{e}");
    assert_eq!(new.load().await.expect("load"), Some(b"{\"new\":1}".to_vec()));
    old.rearm();
    old.save(b"{\"old\":4}".to_vec()).await.expect("leads again");
    assert_eq!(new.load().await.expect("load"), Some(b"{\"old\":4}".to_vec()));

    assert!(api.delete(Kind::ConfigMap, "kvota-system/kvota-agent-state"));
    assert!(old.save(b"{\"x\":5}".to_vec()).await.is_err(), "404 once");
    old.save(b"{\"x\":6}".to_vec()).await.expect("made again");
    assert_eq!(new.load().await.expect("load"), Some(b"{\"x\":6}".to_vec()));
}

/// A new process's first report covers the gap since the cluster's usage was counted,
/// rebuilt from the pods' run times up to where its own meter starts. Until it knows
/// where that is (its first listing of the pods) and has a policy to map the pods to
/// tenants, it writes no report (one would overlap the gap, and the control plane would
/// cut the overlap out of the rebuilt usage).
#[tokio::test]
async fn the_first_report_waits_until_the_gap_before_it_can_be_sized() {
    let dir = tempfile::tempdir().expect("tmp");
    let journal_dir = dir.path().join("agent");
    {
        let a = agent(&journal_dir);
        a.set_history(kvota_member_agent::agent::History(Arc::new(|_, _| Default::default())));
        a.starts_reporting();
        let e = a.report_once().await.expect_err("no listing yet");
        assert!(e.to_string().contains("first listing"), "{e}");
        a.meter_started(1_000);
        let e = a.report_once().await.expect_err("no policy yet");
        assert!(e.to_string().contains("policy"), "{e}");
        a.state().set_policy(Policy::from_yaml(POLICY).expect("policy"));
        let _ = a.report_once().await; // no control plane: written, not delivered
    }
    let journal = kvota_member_agent::journal::Journal::open(&journal_dir).expect("journal");
    assert_eq!(
        journal.unacked(10).expect("unacked").len(),
        1,
        "one report, written once the gap could be sized"
    );
}

/// A store that never answers (an API server that accepted the connection and hangs).
#[derive(Debug)]
struct Hanging;

impl StateStore for Hanging {
    fn load(&self) -> persist::StoreFuture<'_, Option<Vec<u8>>> {
        Box::pin(std::future::pending())
    }
    fn save(&self, _: Vec<u8>) -> persist::StoreFuture<'_, ()> {
        Box::pin(std::future::pending())
    }
    fn describe(&self) -> String {
        "a hanging API server".into()
    }
}

/// A hung store holds up neither the start of enforcement nor a report round for long:
/// reading and writing the kept state give up after `STATE_STORE_TIMEOUT`, with an
/// error that says so, and a failed write is counted.
#[tokio::test]
async fn a_store_that_never_answers_costs_a_bounded_wait() {
    let dir = tempfile::tempdir().expect("tmp");
    let a = holding(&dir.path().join("a"), lease(7, 5_000, 1_000));
    a.set_state_store(Arc::new(Hanging), "a");
    let started = std::time::Instant::now();
    let e = a.restore().await.expect_err("no answer");
    assert!(e.to_string().contains("no answer within"), "{e}");
    let e = a.persist().await.expect_err("no answer");
    assert!(e.to_string().contains("a hanging API server"), "{e}");
    let limit = kvota_member_agent::agent::STATE_STORE_TIMEOUT;
    assert!(started.elapsed() < limit * 3, "{:?}", started.elapsed());
    assert_eq!(a.state_save_failures(), 1);
}
