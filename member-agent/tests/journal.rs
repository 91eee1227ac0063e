//! The usage journal against real crashes and its previous format: a writer process
//! killed with SIGKILL in the middle of writing, many times, never loses a report whose
//! write returned (the journal syncs before returning), and reopening cuts a torn last
//! record cleanly. (A journal of the earliest, sled, format is migrated by the `kvota`
//! binary: see its journal_v0.rs.)

use kvota_fairness::names::ClusterName;
use kvota_fairness::names::TenantName;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use kvota_fairness::federation::{TenantReport, UsageReport};
use kvota_member_agent::journal::Journal;

fn report(seq: u64) -> UsageReport {
    // Some reports are large (hundreds of KB), so a kill often lands mid-write.
    let tenants = if seq % 7 == 0 { 3_000 } else { 3 };
    UsageReport {
        cluster: ClusterName::from_static("east"),
        seq,
        held_epoch: 1,
        capacity: None,
        tenants: (0..tenants)
            .map(|i| {
                (
                    TenantName::parse(format!("tenant-{i:05}")).expect("name"),
                    TenantReport {
                        used_milli_gpue_ms: seq * 1_000 + i,
                        inuse: i,
                        pending: 0,
                        largest: 0,
                        borrowed: 0,
                    },
                )
            })
            .collect(),
        evictions: Vec::new(),
        decisions: Vec::new(),
        window: None,
        status: None,
    }
}

/// The child: writes reports until killed, printing each sequence number once its write
/// has returned (so the parent knows it was acknowledged).
#[test]
fn journal_writer_child() {
    let Ok(dir) = std::env::var("KVOTA_JOURNAL_CHILD_DIR") else {
        return;
    };
    let j = Journal::open(std::path::Path::new(&dir)).expect("open");
    loop {
        let r = j.write(report).expect("write");
        println!("{}", r.seq);
        // Now and then acknowledge a prefix, as the agent does after a send.
        if r.seq % 11 == 0 {
            j.ack_through(r.seq - 5).expect("ack");
        }
    }
}

#[test]
fn sigkill_mid_write_loses_no_acknowledged_report_and_cuts_the_torn_tail() {
    let dir = tempfile::tempdir().expect("tmp");
    let exe = std::env::current_exe().expect("test binary");
    let mut acked_max = 0u64;
    let mut acknowledged_through = 0u64;
    let mut torn_seen = 0;
    for round in 0..20u64 {
        let mut child = Command::new(&exe)
            .args(["--exact", "journal_writer_child", "--nocapture", "--test-threads", "1"])
            .env("KVOTA_JOURNAL_CHILD_DIR", dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the writer");
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Ok(n) = line.trim().parse::<u64>() {
                    let _ = tx.send(n);
                }
            }
        });
        // Once it writes, kill it at a different moment each round (5-80 ms later).
        let first = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the writer wrote nothing");
        std::thread::sleep(Duration::from_millis(5 + (round * 37) % 75));
        child.kill().expect("SIGKILL");
        let _ = child.wait();
        let mut printed: Vec<u64> = rx.try_iter().collect();
        printed.push(first);
        if let Some(&m) = printed.iter().max() {
            acked_max = acked_max.max(m);
        }
        let j = Journal::open(dir.path()).expect("reopen after SIGKILL");
        torn_seen += usize::from(j.opened().torn_bytes > 0);
        let last = j.last_seq();
        assert!(
            last >= acked_max,
            "round {round}: report {acked_max} was acknowledged but the journal ends at {last}"
        );
        // Every acknowledged report past the acknowledgements the file may have lost is
        // there, unchanged, in order.
        let kept: Vec<UsageReport> = j.unacked(usize::MAX).expect("read");
        let seqs: Vec<u64> = kept.iter().map(|r| r.seq).collect();
        assert!(
            seqs.windows(2).all(|w| w[1] == w[0] + 1),
            "round {round}: not consecutive: {seqs:?}"
        );
        // The most the writer or this test may have acknowledged: nothing after it may
        // be missing.
        let child_ack = if acked_max >= 11 { (acked_max / 11) * 11 - 5 } else { 0 };
        let max_ack = acknowledged_through.max(child_ack);
        if let Some(first) = seqs.first() {
            assert!(
                *first <= max_ack + 1,
                "round {round}: starts at {first}, but only reports through {max_ack} were acknowledged"
            );
        } else {
            assert!(
                last <= max_ack,
                "round {round}: reports {}..={last} are missing",
                max_ack + 1
            );
        }
        for r in &kept {
            assert_eq!(r, &report(r.seq), "round {round}: report {} changed", r.seq);
        }
        assert_eq!(seqs.last().copied().unwrap_or(last), last);
        // Acknowledge most of it before the next round, so the file keeps compacting.
        if last > 3 {
            j.ack_through(last - 3).expect("ack");
            acknowledged_through = last - 3;
        }
    }
    assert!(
        acked_max > 100,
        "the writer wrote too little to mean anything: {acked_max}"
    );
    eprintln!("20 kills, {acked_max} reports acknowledged, {torn_seen} torn tails cut");
}
