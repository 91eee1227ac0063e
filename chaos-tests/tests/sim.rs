//! Deterministic simulation: the fixed seed set, replay, and proof that the checker
//! catches broken lease and accounting rules.
//!
//! Replay one seed exactly (what a failure prints):
//! `cargo run -p kvota-chaos-tests --bin chaos-sim -- --seed N`, or through this test:
//! `KVOTA_CHAOS_SEED=N cargo test -p kvota-chaos-tests --test sim replay -- --nocapture`
//! (add `KVOTA_CHAOS_BUG=make-before-break` etc. to replay with a fault switch).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use kvota_chaos_tests::{run, Bugs, Failure, Summary};

/// The fixed seed set every `cargo test` runs.
const SEEDS: std::ops::Range<u64> = 0..200;
/// Worker threads for the seed set (CI machines have 2 cores).
const THREADS: u64 = 2;

/// Runs `seeds` on [`THREADS`] threads; returns the failures (seed order) and the
/// summaries of the runs that passed.
fn run_all(seeds: std::ops::Range<u64>, bugs: Bugs, stop_at_first: bool) -> (Vec<Failure>, Vec<Summary>) {
    let next = AtomicU64::new(seeds.start);
    let failures = Mutex::new(Vec::new());
    let passed = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            s.spawn(|| loop {
                let seed = next.fetch_add(1, Ordering::SeqCst);
                if seed >= seeds.end {
                    break;
                }
                match run(seed, bugs) {
                    Ok(sum) => passed.lock().expect("lock").push(sum),
                    Err(f) => {
                        failures.lock().expect("lock").push(f);
                        if stop_at_first {
                            next.store(seeds.end, Ordering::SeqCst);
                        }
                    }
                }
            });
        }
    });
    let mut f = failures.into_inner().expect("lock");
    f.sort_by_key(|f| f.seed);
    (f, passed.into_inner().expect("lock"))
}

#[test]
fn fixed_seed_set_holds_every_invariant() {
    let start = Instant::now();
    let (failures, passed) = run_all(SEEDS, Bugs::default(), false);
    for f in &failures {
        eprintln!("{f}");
    }
    let mut kinds: BTreeMap<&str, u64> = BTreeMap::new();
    for s in &passed {
        for (k, n) in &s.fault_kinds {
            *kinds.entry(k).or_insert(0) += n;
        }
    }
    let total = |f: fn(&Summary) -> u64| passed.iter().map(f).sum::<u64>();
    eprintln!(
        "chaos: {} seeds, {} failed, {:.1} s; elections {}, agent crashes {} (standby takeovers {}), admissions {}, reports {} (refused at a journal's backlog limit {}), messages lost {} cut {}; faults {kinds:?}",
        SEEDS.end - SEEDS.start,
        failures.len(),
        start.elapsed().as_secs_f64(),
        total(|s| s.elections),
        total(|s| s.agent_crashes),
        total(|s| s.takeovers),
        total(|s| s.admissions),
        total(|s| s.reports as u64),
        total(|s| s.backlog_refusals),
        total(|s| s.net.lost),
        total(|s| s.net.cut),
    );
    assert!(failures.is_empty(), "{} of {} seeds failed; first: {}", failures.len(), SEEDS.end - SEEDS.start, failures[0]);
    // The set really exercises every nemesis and the paths they open.
    for k in [
        "cp-isolate-one",
        "cp-isolate-group",
        "leader-isolate",
        "agent-cut",
        "agent-cut-one-way",
        "cp-crash",
        "agent-crash",
        "agent-restart-in-partition",
        "standby-takeover-in-partition",
        "agent-kept-state-stale",
        "agent-disk-full",
        "net-loss-delay",
        "cp-slow-disk",
        "agent-slow-disk",
        "policy-change",
        "demand-shift",
        "upgrade-to-sized-budgets",
    ] {
        assert!(kinds.get(k).copied().unwrap_or(0) >= 10, "fault {k} ran only {:?} times", kinds.get(k));
    }
    assert!(total(|s| s.elections) >= 100, "leader changes");
    assert!(total(|s| s.takeovers) >= 50, "standby takeovers: {}", total(|s| s.takeovers));
    assert!(total(|s| s.backlog_refusals) >= 50, "reports refused at a journal's backlog limit: {}", total(|s| s.backlog_refusals));
    assert!(total(|s| s.unmetered_gpue_ms) > 0, "agent downtime with running pods");
    assert!(total(|s| s.net.lost) > 0 && total(|s| s.net.cut) > 0, "lost and cut messages");
}

/// Replays `KVOTA_CHAOS_SEED` (with `KVOTA_CHAOS_BUG`); without it, checks that a run
/// is deterministic: the same seed twice gives the same summary.
#[test]
fn replay() {
    let bugs = std::env::var("KVOTA_CHAOS_BUG")
        .ok()
        .map(|b| Bugs::parse(&b).expect("KVOTA_CHAOS_BUG: unknown fault switch"))
        .unwrap_or_default();
    match std::env::var("KVOTA_CHAOS_SEED") {
        Ok(s) => {
            let seed: u64 = s.parse().expect("KVOTA_CHAOS_SEED must be a number");
            match run(seed, bugs) {
                Ok(sum) => eprintln!("seed {seed} passed: {sum:?}"),
                Err(f) => panic!("{f}"),
            }
        }
        Err(_) => {
            let a = run(7, bugs).map_err(|f| f.to_string());
            let b = run(7, bugs).map_err(|f| f.to_string());
            assert_eq!(a, b, "the same seed must replay identically");
        }
    }
}

/// The first failure in the fixed set with `bugs` switched on; it must break `invariant`.
fn caught(bugs: Bugs, invariant: &str) -> Failure {
    let (failures, _) = run_all(SEEDS, bugs, true);
    let Some(first) = failures.into_iter().next() else {
        panic!("no seed of the fixed set caught the fault switch {bugs:?}");
    };
    eprintln!("caught as expected: {first}");
    assert_eq!(first.violation.invariant, invariant, "caught by the wrong invariant: {first}");
    assert!(first.replay_command().contains(&format!("--seed {} --bug {}", first.seed, bugs.name())));
    first
}

/// Break before make, broken: the leader hands out the split's budgets without waiting
/// for other clusters to acknowledge decreases. Some cluster then enforces more than the
/// control plane accounts for.
#[test]
fn checker_catches_increases_before_decreases_are_acknowledged() {
    let b = Bugs { make_before_break: true, ..Bugs::default() };
    let f = caught(b, "partition_safety");
    assert!(f.violation.detail.contains("enforces") || f.violation.detail.contains("may hold"), "{f}");
}

/// An agent that ignores lease expiry keeps admitting under its budget while cut off.
#[test]
fn checker_catches_an_agent_that_ignores_expiry() {
    let b = Bugs { ignore_expiry: true, ..Bugs::default() };
    let f = caught(b, "partition_safety");
    assert!(f.violation.detail.contains("enforces"), "{f}");
}

/// A clock running 40 % slow (the margin covers 10 %) holds leases past their end.
#[test]
fn checker_catches_a_clock_drifting_beyond_the_margin() {
    let b = Bugs { clock_beyond_margin: true, ..Bugs::default() };
    caught(b, "partition_safety");
}

/// A leader adapter that re-applies a resent report under a fresh sequence number counts
/// usage twice.
#[test]
fn checker_catches_a_double_applied_resent_report() {
    let b = Bugs { double_apply_resent: true, ..Bugs::default() };
    caught(b, "conservation");
}

/// An agent that forgets reports once sent (not once acknowledged) loses usage.
#[test]
fn checker_catches_reports_dropped_before_acknowledgement() {
    let b = Bugs { ack_on_send: true, ..Bugs::default() };
    caught(b, "conservation");
}

/// An agent that acknowledges a lease before the state it keeps in the cluster holds it
/// (its writes failing for a while): the control plane stops counting the older lease,
/// and a standby that takes over would restore exactly that one.
#[test]
fn checker_catches_a_lease_acknowledged_before_the_cluster_keeps_it() {
    let b = Bugs { ack_unkept: true, ..Bugs::default() };
    let f = caught(b, "epochs");
    assert!(f.violation.detail.contains("the standby starts from kept epoch"), "{f}");
}

/// An agent that enforces a lease while its journal write is still on the way (a slow
/// disk), then dies before the write lands: restarted from that journal, it goes back
/// to the older epoch.
#[test]
fn checker_catches_a_lease_enforced_before_the_journal_holds_it() {
    let b = Bugs { enforce_unjournaled: true, ..Bugs::default() };
    let f = caught(b, "epochs");
    assert!(f.violation.detail.contains("went back from epoch"), "{f}");
}

/// A full disk, handled wrong: the usage a report round took is dropped when the
/// journal refuses the report. The cluster produced more than the agent metered.
#[test]
fn checker_catches_usage_dropped_with_a_refused_report() {
    let b = Bugs { drop_refused_report: true, ..Bugs::default() };
    let f = caught(b, "conservation");
    assert!(f.violation.detail.contains("the cluster produced"), "{f}");
}

/// A journal at its backlog limit, handled wrong: a round whose report is refused ends
/// without sending the reports the journal holds, so nothing is acknowledged and the
/// journal never drains; the usage it holds never reaches the ledger.
#[test]
fn checker_catches_a_full_journal_that_never_drains() {
    let b = Bugs { stop_on_refused_report: true, ..Bugs::default() };
    let f = caught(b, "conservation");
    assert!(f.violation.detail.contains("the cluster produced"), "{f}");
}
