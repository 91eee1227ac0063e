//! The agent's persistent formats as earlier builds wrote them: the usage journal
//! (`journal.kvj`, formats 1 and 2) and the state kept for the next process
//! (`MemberState`, format 1), checked in under `tests/golden/` as bytes. This code must go on reading
//! them: a change that breaks a format fails here, and then needs a new format version
//! and a migration (the upgrade rule in docs/operations.md).

use kvota_fairness::names::ClusterName;
use kvota_fairness::names::TenantName;
use std::path::PathBuf;

use kvota_fairness::federation::{TenantReport, UsageReport, UsageWindow};
use kvota_fairness::lease::{Lease, TenantBudget};
use kvota_fairness::policy::Policy;
use kvota_member_agent::journal::Journal;
use kvota_member_agent::persist::{self, MemberState};

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

/// What the golden journal's writer wrote: reports 1 to 3 (1 acknowledged), then this lease.
fn report(seq: u64) -> UsageReport {
    UsageReport {
        cluster: ClusterName::from_static("east"),
        seq,
        held_epoch: 1,
        capacity: None,
        tenants: (0..2)
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
        window: Some(UsageWindow {
            start_ms: 1_000 * seq,
            end_ms: 1_000 * seq + 1_000,
        }),
        status: None,
    }
}

fn lease() -> Lease {
    Lease {
        cluster: ClusterName::from_static("east"),
        epoch: 4,
        duration_ms: 30_000,
        margin_ms: 3_000,
        issued_at_ms: 10,
        budgets: [(
            TenantName::from_static("training"),
            TenantBudget {
                budget: 2_000,
                fallback: 1_000,
                entitlement: 3_000,
                borrow: 0,
                ceiling: 0,
            },
        )]
        .into_iter()
        .collect(),
    }
}

#[test]
fn the_journal_of_format_1_reads_back_whole() {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::copy(golden("journal.format-1.kvj"), dir.path().join("journal.kvj")).expect("copy");
    let j = Journal::open(dir.path()).expect("a format-1 journal opens");
    assert_eq!(j.opened().torn_bytes, 0);
    assert_eq!(
        j.unacked(10).expect("read"),
        vec![report(2), report(3)],
        "report 1 was acknowledged"
    );
    assert_eq!(j.last_seq(), 3);
    assert_eq!(j.load_lease(), Some(lease()));
    assert_eq!(j.opened().migrated_from, Some(1), "rewritten in the current format");
    // And goes on from there in the current format.
    assert_eq!(j.write(report).expect("write").seq, 4);
}

/// The same journal as written in format 2 (reports and the lease as protobuf) by the
/// first build that wrote it.
#[test]
fn the_journal_of_format_2_reads_back_whole() {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::copy(golden("journal.format-2.kvj"), dir.path().join("journal.kvj")).expect("copy");
    let j = Journal::open(dir.path()).expect("a format-2 journal opens");
    assert_eq!((j.opened().torn_bytes, j.opened().migrated_from), (0, None));
    assert_eq!(
        j.unacked(10).expect("read"),
        vec![report(2), report(3)],
        "report 1 was acknowledged"
    );
    assert_eq!(j.last_seq(), 3);
    assert_eq!(j.load_lease(), Some(lease()));
    assert_eq!(j.write(report).expect("write").seq, 4);
}

#[test]
fn the_kept_state_of_format_1_reads_back_whole() {
    let bytes = std::fs::read(golden("member-state.format-1.json")).expect("golden");
    let got = persist::decode(&bytes, "golden", "east").expect("a format-1 state decodes");
    let want = MemberState {
        format: 1,
        cluster: ClusterName::from_static("east"),
        writer: "kvota-agent-7d9f-abcde".into(),
        written_unix_ms: 1_764_000_000_000,
        policy: Some(Policy::from_yaml(Policy::article_example_yaml()).expect("policy")),
        lease: Some(lease()),
        lease_usable_until_unix_ms: 1_764_000_027_000,
        acked_seq: 1,
        counted_through_unix_ms: 2_000,
    };
    assert_eq!(got, want);
    // The same state written today reads back the same.
    let again = persist::encode(&want).expect("encode");
    assert_eq!(persist::decode(&again, "memory", "east").expect("decode"), want);
}

#[test]
fn a_newer_format_is_refused_not_misread() {
    let mut bytes = std::fs::read(golden("journal.format-1.kvj")).expect("golden");
    let dir = tempfile::tempdir().expect("tmp");
    // The header's version field: the 4 bytes after the 4-byte magic, little-endian.
    bytes[4..8].copy_from_slice(&3u32.to_le_bytes());
    std::fs::write(dir.path().join("journal.kvj"), &bytes).expect("write");
    let e = Journal::open(dir.path()).expect_err("format 3 is newer than this agent");
    assert!(e.to_string().contains("format version 3"), "{e}");
    let text = String::from_utf8(std::fs::read(golden("member-state.format-1.json")).expect("golden")).expect("utf8");
    let newer = text.replacen("\"format\":1", "\"format\":2", 1);
    assert_ne!(newer, text);
    let e = persist::decode(newer.as_bytes(), "golden", "east").expect_err("newer");
    assert!(matches!(e, persist::PersistError::Newer { found: 2, .. }), "{e}");
}
