//! The replicated log's commands (`kvota.raft.v1`'s `Log*` messages) to and from the
//! fairness core's types.
//!
//! Core to wire is infallible `From`. Wire to core is [`command_from`], which names the
//! field it could not read (an [`Invalid`] whose `field` is the path from the caller's
//! `field` down, e.g. `entries[2].normal.commands[0].report.cluster`).
//!
//! Decoding is structural: names must parse and enumerations hold known values; names
//! or numbers a command carries are not re-validated. They were validated when the
//! command was proposed, and a log entry must read the same on every node, whatever a
//! later build's validation rules. Which format a batch of commands is in, and the batch
//! itself, is the control plane's (`wire.rs`).

use kvota_fairness::admission::Verdict;
use kvota_fairness::federation::{
    ClusterStatus, Command, EvictionNote, EvictionOutcome, PodDecision, TenantReport, UsageReport, UsageWindow,
};
use kvota_fairness::names::{ClusterName, TenantName};
use kvota_fairness::policy::{
    AdmissionMode, AuditConfig, LeaseConfig, LendWhen, Policy, ReclaimConfig, ShowbackConfig, TenantPolicy,
};
use kvota_fairness::resources::ResourceWeights;

use crate::convert::{invalid, Invalid};
use crate::raft::v1 as pb;

/// A cluster's name in a log entry: every writer parsed it before proposing, so
/// another is a damaged or foreign entry.
fn cluster_name(name: String, field: &str) -> Result<ClusterName, Invalid> {
    ClusterName::parse(name).map_err(|e| invalid(field, e.to_string()))
}

/// A tenant's name in a log entry (see [`cluster_name`]).
fn tenant_name(name: String, field: &str) -> Result<TenantName, Invalid> {
    TenantName::parse(name).map_err(|e| invalid(field, e.to_string()))
}

impl From<&Command> for pb::LogCommand {
    fn from(c: &Command) -> Self {
        use pb::log_command::Command as C;
        let command = match c {
            Command::ApplyPolicy(p) => C::ApplyPolicy(p.into()),
            Command::RegisterCluster {
                cluster,
                capacity,
                labels,
            } => C::RegisterCluster(pb::LogRegister {
                cluster: cluster.to_string(),
                capacity_milli: capacity.clone().into_iter().collect(),
                labels: labels.clone().into_iter().collect(),
            }),
            Command::RemoveCluster { cluster } => C::RemoveCluster(pb::LogRemove {
                cluster: cluster.to_string(),
            }),
            Command::Report(r) => C::Report(r.into()),
            Command::Tick => C::Tick(pb::Empty {}),
        };
        pb::LogCommand { command: Some(command) }
    }
}

/// One command from its wire form; `field` is its path in the message, which errors
/// extend.
pub fn command_from(c: pb::LogCommand, field: &str) -> Result<Command, Invalid> {
    use pb::log_command::Command as C;
    Ok(match c.command {
        None => return Err(invalid(field, "absent, or a command this build does not know")),
        Some(C::ApplyPolicy(p)) => Command::ApplyPolicy(policy_from(p, &format!("{field}.apply_policy"))?),
        Some(C::RegisterCluster(r)) => Command::RegisterCluster {
            cluster: cluster_name(r.cluster, &format!("{field}.register_cluster.cluster"))?,
            capacity: r.capacity_milli.into_iter().collect(),
            labels: r.labels.into_iter().collect(),
        },
        Some(C::RemoveCluster(r)) => Command::RemoveCluster {
            cluster: cluster_name(r.cluster, &format!("{field}.remove_cluster.cluster"))?,
        },
        Some(C::Report(r)) => Command::Report(report_from(r, &format!("{field}.report"))?),
        Some(C::Tick(_)) => Command::Tick,
    })
}

impl From<&Policy> for pb::LogPolicy {
    fn from(p: &Policy) -> Self {
        pb::LogPolicy {
            name: p.name.clone(),
            api_version: p.api_version.clone(),
            default_tenant: p.default_tenant.as_ref().map(ToString::to_string),
            lease_duration_ms: p.lease.duration_ms,
            lease_clock_skew_margin_ms: p.lease.clock_skew_margin_ms,
            reclaim: Some(pb::LogReclaim {
                enabled: p.reclaim.enabled,
                starved_for_ms: p.reclaim.starved_for_ms,
                max_evictions_per_minute: p.reclaim.max_evictions_per_minute,
                max_evictions_per_minute_per_tenant: p.reclaim.max_evictions_per_minute_per_tenant,
                min_runtime_ms: p.reclaim.min_runtime_ms,
                no_lend_idle: !p.reclaim.lend_idle,
                lend_only_cut_off: p.reclaim.lend_when == LendWhen::CutOff,
            }),
            resource_weights_milli: p.resource_weights.explicit().clone().into_iter().collect(),
            tenants: p.tenants.iter().map(pb::LogTenant::from).collect(),
            // Absent when default: an entry is then the same bytes as before the field existed.
            showback_retention_ms: (p.showback != ShowbackConfig::default()).then_some(p.showback.retention_ms),
            audit_retention_ms: (!p.audit.is_default()).then_some(p.audit.retention_ms),
            audit_max_bytes: (!p.audit.is_default()).then_some(p.audit.max_bytes),
        }
    }
}

fn policy_from(p: pb::LogPolicy, field: &str) -> Result<Policy, Invalid> {
    let reclaim = p.reclaim.map_or_else(ReclaimConfig::default, |r| ReclaimConfig {
        enabled: r.enabled,
        starved_for_ms: r.starved_for_ms,
        max_evictions_per_minute: r.max_evictions_per_minute,
        max_evictions_per_minute_per_tenant: r.max_evictions_per_minute_per_tenant,
        min_runtime_ms: r.min_runtime_ms,
        lend_idle: !r.no_lend_idle,
        lend_when: if r.lend_only_cut_off {
            LendWhen::CutOff
        } else {
            LendWhen::Always
        },
    });
    let mut resource_weights = ResourceWeights::new();
    for (name, w) in p.resource_weights_milli {
        resource_weights.set(&name, w);
    }
    let tenants = p
        .tenants
        .into_iter()
        .enumerate()
        .map(|(i, t)| tenant_from(t, &format!("{field}.tenants[{i}]")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Policy {
        name: p.name,
        api_version: p.api_version,
        default_tenant: p
            .default_tenant
            .map(|t| tenant_name(t, &format!("{field}.default_tenant")))
            .transpose()?,
        lease: LeaseConfig {
            duration_ms: p.lease_duration_ms,
            clock_skew_margin_ms: p.lease_clock_skew_margin_ms,
        },
        reclaim,
        showback: p
            .showback_retention_ms
            .map_or_else(ShowbackConfig::default, |retention_ms| ShowbackConfig { retention_ms }),
        audit: {
            let d = AuditConfig::default();
            AuditConfig {
                retention_ms: p.audit_retention_ms.unwrap_or(d.retention_ms),
                max_bytes: p.audit_max_bytes.unwrap_or(d.max_bytes),
            }
        },
        resource_weights,
        tenants,
    })
}

impl From<&TenantPolicy> for pb::LogTenant {
    fn from(t: &TenantPolicy) -> Self {
        pb::LogTenant {
            name: t.name.to_string(),
            weight_milli: t.weight_milli,
            min_share_bp: t.min_share_bp,
            max_share_bp: t.max_share_bp,
            preemptible: t.preemptible,
            decay_half_life_ms: t.decay_half_life_ms,
            namespaces: t.namespaces.clone(),
            namespace_selector: t.namespace_selector.clone().into_iter().collect(),
            admission: match t.admission {
                AdmissionMode::Reject => pb::LogAdmission::Reject,
                AdmissionMode::Queue => pb::LogAdmission::Queue,
            }
            .into(),
            max_queued: t.max_queued,
            burst_factor_milli: t.burst_factor_milli,
        }
    }
}

fn tenant_from(t: pb::LogTenant, field: &str) -> Result<TenantPolicy, Invalid> {
    let admission = match pb::LogAdmission::try_from(t.admission) {
        Ok(pb::LogAdmission::Reject) => AdmissionMode::Reject,
        Ok(pb::LogAdmission::Queue) => AdmissionMode::Queue,
        Err(_) => {
            return Err(invalid(
                format!("{field}.admission"),
                format!("admission mode {} is not one this build knows", t.admission),
            ))
        }
    };
    Ok(TenantPolicy {
        name: tenant_name(t.name, &format!("{field}.name"))?,
        weight_milli: t.weight_milli,
        min_share_bp: t.min_share_bp,
        max_share_bp: t.max_share_bp,
        preemptible: t.preemptible,
        decay_half_life_ms: t.decay_half_life_ms,
        namespaces: t.namespaces,
        namespace_selector: t.namespace_selector.into_iter().collect(),
        admission,
        max_queued: t.max_queued,
        burst_factor_milli: t.burst_factor_milli,
    })
}

impl From<&UsageReport> for pb::LogReport {
    fn from(r: &UsageReport) -> Self {
        pb::LogReport {
            cluster: r.cluster.to_string(),
            seq: r.seq,
            held_epoch: r.held_epoch,
            capacity: r.capacity.as_ref().map(|c| pb::LogCapacity {
                milli: c.clone().into_iter().collect(),
            }),
            tenants: r
                .tenants
                .iter()
                .map(|(name, t)| {
                    (
                        name.to_string(),
                        pb::LogTenantUsage {
                            used_milli_gpue_ms: t.used_milli_gpue_ms,
                            inuse_milli_gpue: t.inuse,
                            pending_milli_gpue: t.pending,
                            largest_pending_milli_gpue: t.largest,
                            borrowed_milli_gpue: t.borrowed,
                        },
                    )
                })
                .collect(),
            evictions: r.evictions.iter().map(pb::LogEviction::from).collect(),
            window: r.window.map(|w| pb::LogWindow {
                start_ms: w.start_ms,
                end_ms: w.end_ms,
            }),
            decisions: r.decisions.iter().map(pb::LogDecision::from).collect(),
            status: r.status.as_ref().map(pb::LogClusterStatus::from),
        }
    }
}

fn report_from(r: pb::LogReport, field: &str) -> Result<UsageReport, Invalid> {
    Ok(UsageReport {
        cluster: cluster_name(r.cluster, &format!("{field}.cluster"))?,
        seq: r.seq,
        held_epoch: r.held_epoch,
        capacity: r.capacity.map(|c| c.milli.into_iter().collect()),
        tenants: r
            .tenants
            .into_iter()
            // A tenant that is no DNS label is dropped, as the log's JSON reader drops it
            // (see `federation::tenants_that_are_labels`): applying the report ignored it anyway.
            .filter_map(|(name, t)| {
                let name = TenantName::parse(name).ok()?;
                Some((
                    name,
                    TenantReport {
                        used_milli_gpue_ms: t.used_milli_gpue_ms,
                        inuse: t.inuse_milli_gpue,
                        pending: t.pending_milli_gpue,
                        largest: t.largest_pending_milli_gpue,
                        borrowed: t.borrowed_milli_gpue,
                    },
                ))
            })
            .collect(),
        evictions: r.evictions.into_iter().map(EvictionNote::from).collect(),
        window: r.window.map(|w| UsageWindow {
            start_ms: w.start_ms,
            end_ms: w.end_ms,
        }),
        // A verdict word this build does not know is dropped here, the same way on every
        // node (decisions are a record, not a fact the plan depends on).
        decisions: r.decisions.into_iter().filter_map(decision_from).collect(),
        status: r.status.map(ClusterStatus::from),
    })
}

impl From<&EvictionNote> for pb::LogEviction {
    fn from(e: &EvictionNote) -> Self {
        pb::LogEviction {
            victim: e.victim.clone(),
            victim_tenant: e.victim_tenant.clone(),
            for_tenant: e.for_tenant.clone(),
            for_pod: e.for_pod.clone(),
            milli_gpue: e.milli_gpue,
            outcome: e.outcome.to_string(),
            why: e.why.clone(),
        }
    }
}

impl From<pb::LogEviction> for EvictionNote {
    fn from(e: pb::LogEviction) -> Self {
        EvictionNote {
            victim: e.victim,
            victim_tenant: e.victim_tenant,
            for_tenant: e.for_tenant,
            for_pod: e.for_pod,
            milli_gpue: e.milli_gpue,
            outcome: EvictionOutcome::parse(&e.outcome),
            why: e.why,
        }
    }
}

impl From<&PodDecision> for pb::LogDecision {
    fn from(d: &PodDecision) -> Self {
        pb::LogDecision {
            pod: d.pod.clone(),
            tenant: d.tenant.clone(),
            verdict: d.verdict.as_str().to_string(),
            milli_gpue: d.milli_gpue,
            at_ms: d.at_ms,
            text: d.text.clone(),
        }
    }
}

/// A decision, or `None` for a verdict word this build does not know.
fn decision_from(d: pb::LogDecision) -> Option<PodDecision> {
    Some(PodDecision {
        verdict: Verdict::parse(&d.verdict)?,
        pod: d.pod,
        tenant: d.tenant,
        milli_gpue: d.milli_gpue,
        at_ms: d.at_ms,
        text: d.text,
    })
}

impl From<&ClusterStatus> for pb::LogClusterStatus {
    fn from(s: &ClusterStatus) -> Self {
        pb::LogClusterStatus {
            agent_version: s.agent_version.clone(),
            feature_level: s.feature_level,
            policy_revision: s.policy_revision,
            report_interval_ms: s.report_interval_ms,
            running_milli_gpue: s.running.iter().map(|(t, g)| (t.to_string(), *g)).collect(),
        }
    }
}

impl From<pb::LogClusterStatus> for ClusterStatus {
    /// Names that are no DNS label are dropped, as for the report's tenants.
    fn from(s: pb::LogClusterStatus) -> Self {
        ClusterStatus {
            agent_version: s.agent_version,
            feature_level: s.feature_level,
            policy_revision: s.policy_revision,
            report_interval_ms: s.report_interval_ms,
            running: s
                .running_milli_gpue
                .into_iter()
                .filter_map(|(t, g)| Some((TenantName::parse(t).ok()?, g)))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Policy {
        Policy::from_yaml(&Policy::article_example_yaml().replacen(
            "spec:\n",
            "spec:\n  defaultTenant: training\n  resourceWeights: {example.com/tpu: 250}\n  \
             reclaim: {lendWhen: cutOff}\n  audit: {retention: 30d, maxSize: 64Mi}\n",
            1,
        ))
        .expect("the example with every option set is a policy")
    }

    fn report() -> UsageReport {
        UsageReport {
            cluster: ClusterName::from_static("east"),
            seq: 3,
            held_epoch: 2,
            capacity: Some([("nvidia.com/gpu".to_string(), 8_000)].into()),
            tenants: [(
                TenantName::from_static("training"),
                TenantReport {
                    used_milli_gpue_ms: 10,
                    inuse: 2_000,
                    pending: 1_000,
                    largest: 1_000,
                    borrowed: 500,
                },
            )]
            .into(),
            evictions: vec![EvictionNote {
                victim: "train/job-7".into(),
                victim_tenant: "training".into(),
                for_tenant: "inference".into(),
                for_pod: "serve/api-0".into(),
                milli_gpue: 1_000,
                outcome: EvictionOutcome::Blocked,
                why: "a PodDisruptionBudget".into(),
            }],
            window: Some(UsageWindow { start_ms: 5, end_ms: 9 }),
            decisions: vec![PodDecision {
                pod: "ml/job-1".into(),
                tenant: "training".into(),
                verdict: Verdict::Queue,
                milli_gpue: 2_000,
                at_ms: 7,
                text: "why".into(),
            }],
            status: Some(ClusterStatus {
                agent_version: "0.9.0".into(),
                feature_level: 6,
                policy_revision: 4,
                report_interval_ms: 5_000,
                running: [(TenantName::from_static("training"), 1_500)].into(),
            }),
        }
    }

    fn commands() -> Vec<Command> {
        vec![
            Command::ApplyPolicy(policy()),
            Command::ApplyPolicy(Policy::from_yaml(Policy::article_example_yaml()).expect("the example")),
            Command::ApplyPolicy(
                Policy::from_yaml(&Policy::article_example_yaml().replacen(
                    "spec:\n",
                    "spec:\n  reclaim: {lendIdle: false}\n",
                    1,
                ))
                .expect("the example, lending nothing"),
            ),
            Command::RegisterCluster {
                cluster: ClusterName::from_static("east"),
                capacity: [("nvidia.com/gpu".to_string(), 8_000)].into(),
                labels: [("region".to_string(), "eu".to_string())].into(),
            },
            Command::RemoveCluster {
                cluster: ClusterName::from_static("east"),
            },
            Command::Report(report()),
            Command::Report(UsageReport {
                capacity: Some(Default::default()),
                window: None,
                status: None,
                ..report()
            }),
            Command::Tick,
        ]
    }

    #[test]
    fn every_command_crosses_unchanged() {
        for c in commands() {
            assert_eq!(command_from(pb::LogCommand::from(&c), "c"), Ok(c));
        }
    }

    #[test]
    fn what_cannot_be_read_names_the_field_from_the_callers_path() {
        let field = |c: pb::LogCommand| command_from(c, "commands[2]").map_err(|e| e.field);
        assert_eq!(field(pb::LogCommand { command: None }), Err("commands[2]".to_string()));
        let mut p = pb::LogPolicy::from(&policy());
        p.tenants[1].admission = 7;
        let e = command_from(
            pb::LogCommand {
                command: Some(pb::log_command::Command::ApplyPolicy(p.clone())),
            },
            "commands[2]",
        )
        .expect_err("an unknown admission mode");
        assert_eq!(e.field, "commands[2].apply_policy.tenants[1].admission");
        assert!(e.why.starts_with("admission mode 7 is not one"), "{}", e.why);
        p.tenants[1].admission = 0;
        p.default_tenant = Some("Lab".into());
        assert_eq!(
            field(pb::LogCommand {
                command: Some(pb::log_command::Command::ApplyPolicy(p)),
            }),
            Err("commands[2].apply_policy.default_tenant".to_string())
        );
        let mut r = pb::LogReport::from(&report());
        r.cluster = "east.example".into();
        assert_eq!(
            field(pb::LogCommand {
                command: Some(pb::log_command::Command::Report(r)),
            }),
            Err("commands[2].report.cluster".to_string())
        );
        for (c, at) in [
            (
                pb::log_command::Command::RegisterCluster(pb::LogRegister::default()),
                "register_cluster",
            ),
            (
                pb::log_command::Command::RemoveCluster(pb::LogRemove::default()),
                "remove_cluster",
            ),
        ] {
            assert_eq!(
                field(pb::LogCommand { command: Some(c) }),
                Err(format!("commands[2].{at}.cluster"))
            );
        }
    }

    /// What the report's own rules leave out of the core is dropped, not refused: a
    /// tenant or running tenant that is no DNS label, a verdict word this build does
    /// not know.
    #[test]
    fn a_reports_unreadable_rows_are_dropped() {
        let mut r = pb::LogReport::from(&report());
        let usage = r.tenants["training"];
        r.tenants.insert("training-".into(), usage);
        r.decisions[0].verdict = "maybe".into();
        if let Some(s) = &mut r.status {
            s.running_milli_gpue.insert("Not_A_Label".into(), 1);
        }
        let Ok(Command::Report(read)) = command_from(
            pb::LogCommand {
                command: Some(pb::log_command::Command::Report(r)),
            },
            "c",
        ) else {
            panic!("the report is read")
        };
        assert_eq!(
            read,
            UsageReport {
                decisions: Vec::new(),
                ..report()
            }
        );
    }

    mod fuzz {
        use super::super::*;
        use proptest::prelude::*;
        use prost::Message;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(1024))]

            /// Arbitrary bytes as a log command: refused naming a field under the
            /// caller's path, or read; what is read encodes to a command that reads the
            /// same again. Never a panic.
            #[test]
            fn arbitrary_commands_are_refused_or_read_stably(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
                if let Ok(m) = pb::LogCommand::decode(bytes.as_slice()) {
                    match command_from(m, "c") {
                        Ok(c) => prop_assert_eq!(command_from(pb::LogCommand::from(&c), "c"), Ok(c)),
                        Err(e) => prop_assert!(e.field.starts_with('c'), "{}", e.field),
                    }
                }
            }

            /// A command's encoding with bytes changed or cut short: the same.
            #[test]
            fn garbled_commands_are_refused_or_read_stably(
                which in any::<prop::sample::Index>(),
                at in any::<prop::sample::Index>(),
                byte in any::<u8>(),
                cut in any::<bool>(),
            ) {
                let mut bytes = pb::LogCommand::from(which.get(&super::commands())).encode_to_vec();
                if !bytes.is_empty() {
                    let i = at.index(bytes.len());
                    if cut { bytes.truncate(i) } else { bytes[i] = byte }
                }
                if let Ok(m) = pb::LogCommand::decode(bytes.as_slice()) {
                    if let Ok(c) = command_from(m, "c") {
                        prop_assert_eq!(command_from(pb::LogCommand::from(&c), "c"), Ok(c));
                    }
                }
            }
        }
    }
}
