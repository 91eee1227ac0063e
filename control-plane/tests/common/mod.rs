//! A realistic sample log and helpers shared by the store tests.

#![allow(dead_code, clippy::unwrap_used)]

use kvota_fairness::names::ClusterName;
use kvota_fairness::names::TenantName;
use std::collections::BTreeMap;

use kvota_control_plane::types::{Node, Request, TypeConfig};
use kvota_fairness::federation::{Command, EvictionNote, Federation, TenantReport, UsageReport, UsageWindow};
use kvota_fairness::policy::Policy;
use openraft::testing::log_id;
use openraft::{Entry, EntryPayload, Membership};

pub fn entry(term: u64, index: u64, payload: EntryPayload<TypeConfig>) -> Entry<TypeConfig> {
    Entry {
        log_id: log_id(term, 1, index),
        payload,
    }
}

pub fn normal(now_ms: u64, command: Command) -> EntryPayload<TypeConfig> {
    EntryPayload::Normal(Request::new(now_ms, vec![command]))
}

pub fn register(cluster: &str, gpus: u64) -> Command {
    Command::RegisterCluster {
        cluster: ClusterName::parse(cluster).expect("name"),
        capacity: [("nvidia.com/gpu".to_string(), gpus * 1000)].into(),
        labels: BTreeMap::new(),
    }
}

pub fn report(cluster: &str, seq: u64, inuse: u64) -> Command {
    Command::Report(UsageReport {
        cluster: ClusterName::parse(cluster).expect("name"),
        seq,
        held_epoch: 0,
        capacity: None,
        tenants: [(
            TenantName::from_static("training"),
            TenantReport {
                used_milli_gpue_ms: inuse * 30_000,
                inuse,
                pending: 2_000,
                largest: 0,
                borrowed: 0,
            },
        )]
        .into(),
        evictions: Vec::new(),
        decisions: Vec::new(),
        window: None,
        status: None,
    })
}

pub fn policy() -> Command {
    Command::ApplyPolicy(Policy::from_yaml(Policy::article_example_yaml()).unwrap())
}

/// A realistic log: membership, blank, then commands including a refused one.
pub fn sample_log() -> Vec<Entry<TypeConfig>> {
    let membership = Membership::new(
        vec![[1u64].into()],
        BTreeMap::from([(
            1u64,
            Node {
                rpc_addr: "127.0.0.1:7000".into(),
                http_addr: "127.0.0.1:7001".into(),
                raft_addr: "127.0.0.1:7002".into(),
            },
        )]),
    );
    vec![
        entry(1, 1, EntryPayload::Membership(membership)),
        entry(1, 2, EntryPayload::Blank),
        entry(1, 3, normal(1_000, policy())),
        entry(1, 4, normal(2_000, register("east", 32))),
        entry(2, 5, normal(3_000, register("west", 16))),
        entry(2, 6, normal(4_000, report("east", 1, 5_000))),
        // Refused (sequence gap): answered with an error, changes nothing.
        entry(2, 7, normal(5_000, report("west", 9, 1_000))),
        entry(2, 8, normal(6_000, Command::Tick)),
    ]
}

/// The Federation obtained by applying the normal entries of `log` directly.
pub fn replay(log: &[Entry<TypeConfig>]) -> Federation {
    let mut fed = Federation::new();
    for e in log {
        if let EntryPayload::Normal(Request { now_ms, commands, .. }) = &e.payload {
            for command in commands {
                let _ = fed.apply(*now_ms, command.clone());
            }
        }
    }
    fed
}

/// [`sample_log`] and two more entries that use every command and every report field:
/// what the golden files under `tests/golden/` hold.
pub fn full_log() -> Vec<Entry<TypeConfig>> {
    let mut log = sample_log();
    let Command::Report(mut r) = report("east", 2, 6_000) else {
        unreachable!()
    };
    r.held_epoch = 1;
    r.window = Some(UsageWindow {
        start_ms: 6_500,
        end_ms: 7_000,
    });
    r.evictions.push(EvictionNote {
        victim: "research/job-7".into(),
        victim_tenant: "research".into(),
        for_tenant: "training".into(),
        for_pod: "training/train-1".into(),
        milli_gpue: 2_000,
        outcome: kvota_fairness::federation::EvictionOutcome::Evicted,
        why: "training below its entitlement for 30 s".into(),
    });
    log.push(entry(2, 9, normal(7_000, Command::Report(r))));
    log.push(entry(
        2,
        10,
        EntryPayload::Normal(Request::new(
            8_000,
            vec![
                register("gone", 8),
                Command::RemoveCluster {
                    cluster: ClusterName::from_static("gone"),
                },
            ],
        )),
    ));
    log
}
