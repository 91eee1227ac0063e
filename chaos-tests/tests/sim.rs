//! Deterministic simulation: the fixed seed set, replay, and proof that the checker
//! catches broken lease, lending, journal and accounting rules. The world runs the
//! agent's real report round and journal and the control plane's real apply path; every
//! bug switch below turns on a bug in that real code (`fault-injection`).
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
        "chaos: {} seeds, {} failed, {:.1} s; elections {}, agent crashes {} (standby takeovers {}), admissions {} (on borrowed GPUs {}, borrowed pods reclaimed {}), reports {} (refused at a journal's backlog limit {}), journal writes refused {} torn {}, runs lending only when cut off {}, messages lost {} cut {}; faults {kinds:?}",
        SEEDS.end - SEEDS.start,
        failures.len(),
        start.elapsed().as_secs_f64(),
        total(|s| s.elections),
        total(|s| s.agent_crashes),
        total(|s| s.takeovers),
        total(|s| s.admissions),
        total(|s| s.borrowed_admissions),
        total(|s| s.borrowed_reclaimed),
        total(|s| s.reports as u64),
        total(|s| s.backlog_refusals),
        total(|s| s.refused_writes),
        total(|s| s.torn_writes),
        total(|s| u64::from(s.lend_when_cut_off)),
        total(|s| s.net.lost),
        total(|s| s.net.cut),
    );
    assert!(
        failures.is_empty(),
        "{} of {} seeds failed; first: {}",
        failures.len(),
        SEEDS.end - SEEDS.start,
        failures[0]
    );
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
        "upgrade",
        "lend-when-cut-off",
        "agent-disk-flaky",
    ] {
        assert!(
            kinds.get(k).copied().unwrap_or(0) >= 10,
            "fault {k} ran only {:?} times",
            kinds.get(k)
        );
    }
    assert!(total(|s| s.elections) >= 100, "leader changes");
    assert!(
        total(|s| s.takeovers) >= 50,
        "standby takeovers: {}",
        total(|s| s.takeovers)
    );
    assert!(
        total(|s| s.backlog_refusals) >= 20,
        "reports refused at a journal's backlog limit: {}",
        total(|s| s.backlog_refusals)
    );
    assert!(total(|s| s.unmetered_gpue_ms) > 0, "agent downtime with running pods");
    // Lending runs under both `lendWhen` values, lends, and takes borrowed pods back.
    let cut_off = total(|s| u64::from(s.lend_when_cut_off));
    assert!(
        (20..=180).contains(&cut_off),
        "runs lending only when cut off: {cut_off} of {}",
        passed.len()
    );
    assert!(
        passed.iter().all(|s| s.feature_level >= 7),
        "every run ends at the newest feature level (lending on)"
    );
    assert!(
        total(|s| s.borrowed_admissions) >= 200,
        "pods admitted on borrowed GPUs: {}",
        total(|s| s.borrowed_admissions)
    );
    assert!(
        total(|s| s.borrowed_reclaimed) >= 20,
        "borrowed pods reclaimed: {}",
        total(|s| s.borrowed_reclaimed)
    );
    assert!(
        total(|s| s.torn_writes) >= 10 && total(|s| s.refused_writes) >= 50,
        "journal writes torn by a crash {} and refused by a disk {}",
        total(|s| s.torn_writes),
        total(|s| s.refused_writes)
    );
    assert!(
        total(|s| s.net.lost) > 0 && total(|s| s.net.cut) > 0,
        "lost and cut messages"
    );
}

/// Seeds outside the fixed set that `scripts/chaos-soak` once failed, each with what it
/// caught; they run with every `cargo test`, so a fixed gap stays fixed.
const FOUND: &[(u64, &str)] = &[
    (
        196_064_186_370_987,
        "borrowed pods admitted under a lease that has since expired count against maxShare until the cluster reports",
    ),
    (
        218_159_301_589_036,
        "an agent that starts with an empty journal and cannot ask where the count ends renumbers on a duplicate",
    ),
    (
        85_559_312_332_661,
        "an agent that starts with an empty journal and cannot ask where the count ends renumbers on a duplicate",
    ),
    (
        115_159_292_831_527,
        "an agent that starts with an empty journal and is told where the count ends by a node behind renumbers on a duplicate",
    ),
    (
        128_764_911_200_570,
        "after a restart, only pods above the held lease's live budget are taken for borrowed, not all above its fallback",
    ),
    (
        203_255_342_143_234,
        "a cluster cut off since before a policy change lowered maxShare admits under its old lease's cap (the check knows it)",
    ),
    (
        136_832_661_433_890,
        "the same, admitting within the old lease's budget",
    ),
    (
        190_966_787_523_356,
        "the same, lending under the old lease's borrow limit",
    ),
];

#[test]
fn seeds_the_soak_found_hold_every_invariant() {
    for (seed, caught) in FOUND {
        if let Err(f) = run(*seed, Bugs::default()) {
            panic!("seed {seed} ({caught}) fails again: {f}");
        }
    }
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
    caught_by(bugs, &[invariant])
}

/// The first failure in the fixed set with `bugs` switched on; it must break one of
/// `invariants`.
fn caught_by(bugs: Bugs, invariants: &[&str]) -> Failure {
    let (failures, _) = run_all(SEEDS, bugs, true);
    let Some(first) = failures.into_iter().next() else {
        panic!("no seed of the fixed set caught the fault switch {bugs:?}");
    };
    eprintln!("caught as expected: {first}");
    assert!(
        invariants.contains(&first.violation.invariant),
        "caught by the wrong invariant: {first}"
    );
    assert!(first
        .replay_command()
        .contains(&format!("--seed {} --bug {}", first.seed, bugs.name())));
    first
}

/// Break before make, broken (in the core's grant): leases carry the split's budgets
/// without waiting for other clusters to acknowledge decreases. The clusters together
/// may then hold more than the tenant's entitlement.
#[test]
fn checker_catches_increases_before_decreases_are_acknowledged() {
    let b = Bugs {
        make_before_break: true,
        ..Bugs::default()
    };
    let f = caught(b, "partition_safety");
    assert!(
        ["may hold", "own check", "partition-safety check failed"]
            .iter()
            .any(|s| f.violation.detail.contains(s)),
        "{f}"
    );
}

/// An agent that ignores lease expiry keeps admitting under its budget while cut off.
#[test]
fn checker_catches_an_agent_that_ignores_expiry() {
    let b = Bugs {
        ignore_expiry: true,
        ..Bugs::default()
    };
    let f = caught(b, "partition_safety");
    assert!(f.violation.detail.contains("enforces"), "{f}");
}

/// A clock running 40 % slow (the margin covers 10 %) holds leases past their end.
#[test]
fn checker_catches_a_clock_drifting_beyond_the_margin() {
    let b = Bugs {
        clock_beyond_margin: true,
        ..Bugs::default()
    };
    caught(b, "partition_safety");
}

/// The state machine counts a report whose sequence number it applied before (a resent
/// report): usage counted twice.
#[test]
fn checker_catches_a_double_applied_resent_report() {
    let b = Bugs {
        double_apply_resent: true,
        ..Bugs::default()
    };
    caught(b, "conservation");
}

/// An agent that forgets reports once sent (not once acknowledged) loses usage.
#[test]
fn checker_catches_reports_dropped_before_acknowledgement() {
    let b = Bugs {
        ack_on_send: true,
        ..Bugs::default()
    };
    caught(b, "conservation");
}

/// An agent that acknowledges a lease before the state it keeps in the cluster holds it
/// (its writes failing for a while): the control plane stops counting the older lease,
/// and a standby that takes over would restore exactly that one.
#[test]
fn checker_catches_a_lease_acknowledged_before_the_cluster_keeps_it() {
    let b = Bugs {
        ack_unkept: true,
        ..Bugs::default()
    };
    let f = caught(b, "epochs");
    assert!(f.violation.detail.contains("the standby starts from kept epoch"), "{f}");
}

/// An agent that enforces a lease while its journal write is still on the way (a slow
/// disk), then dies before the write lands: restarted from that journal, it goes back
/// to the older epoch.
#[test]
fn checker_catches_a_lease_enforced_before_the_journal_holds_it() {
    let b = Bugs {
        enforce_unjournaled: true,
        ..Bugs::default()
    };
    let f = caught(b, "epochs");
    assert!(f.violation.detail.contains("went back from epoch"), "{f}");
}

/// A full disk, handled wrong: the usage a report round took is dropped when the
/// journal refuses the report. The cluster produced more than the agent metered.
#[test]
fn checker_catches_usage_dropped_with_a_refused_report() {
    let b = Bugs {
        drop_refused_report: true,
        ..Bugs::default()
    };
    let f = caught(b, "conservation");
    assert!(
        f.violation.detail.contains("the cluster produced") || f.violation.detail.contains("(lost)"),
        "{f}"
    );
}

/// A journal at its backlog limit, handled wrong: a round whose report is refused ends
/// without sending the reports the journal holds, so nothing is acknowledged and the
/// journal never drains; the usage it holds never reaches the ledger.
#[test]
fn checker_catches_a_full_journal_that_never_drains() {
    let b = Bugs {
        stop_on_refused_report: true,
        ..Bugs::default()
    };
    let f = caught(b, "conservation");
    assert!(
        f.violation.detail.contains("the cluster produced") || f.violation.detail.contains("(lost)"),
        "{f}"
    );
}

/// Reclaim that never evicts a pod admitted on borrowed GPUs: a pod within its tenant's
/// budget waits for GPUs lent to others that are never taken back.
#[test]
fn checker_catches_borrowed_pods_that_reclaim_cannot_take_back() {
    let b = Bugs {
        borrowed_not_evictable: true,
        ..Bugs::default()
    };
    let f = caught(b, "lending");
    assert!(f.violation.detail.contains("borrowed pods"), "{f}");
}

/// Borrowing past the lease's borrow limit: a preemptible tenant takes idle GPUs beyond
/// what its budget plus its limit allow.
#[test]
fn checker_catches_borrowing_past_the_limit() {
    let b = Bugs {
        borrow_past_limit: true,
        ..Bugs::default()
    };
    let f = caught(b, "admission");
    assert!(
        f.violation.detail.contains("borrow limit") || f.violation.detail.contains("maxShare"),
        "{f}"
    );
}

/// A replica that applies log entries again when it replays its log over a snapshot
/// (the store's order check gone): its usage counted twice trips the state machine's own
/// check after the command (debug builds), or its state differs from the log applied
/// once.
#[test]
fn checker_catches_log_entries_applied_twice() {
    let b = Bugs {
        apply_replayed_entry: true,
        ..Bugs::default()
    };
    caught_by(b, &["partition_safety", "replicas"]);
}

/// Every bug switch has a test here (the list in the world and this file agree).
#[test]
fn every_bug_switch_is_tested() {
    let tests = include_str!("sim.rs");
    for name in kvota_chaos_tests::world::BUG_NAMES {
        let field = name.replace('-', "_");
        assert!(
            tests.contains(&format!("{field}: true")),
            "no test turns on the bug switch {name}"
        );
    }
}
