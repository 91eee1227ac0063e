//! Conversions of the admin service's read answers: a tenant's explanation and the
//! audit log, between the fairness core's types and their wire messages. Core to wire is
//! infallible `From`; wire to core is `TryFrom` with an [`Invalid`] naming the field
//! (a record without its event, a number that does not fit), so a client never shows a
//! half-read answer.

use kvota_fairness::explain::{ClusterPart, EvictionSeen, TenantExplanation};
use kvota_fairness::federation::{AuditEvent, AuditRecord, BudgetChange, EvictionNote, EvictionOutcome};

use crate::convert::Invalid;
use crate::v1;

fn invalid(field: impl Into<String>, why: impl Into<String>) -> Invalid {
    Invalid {
        field: field.into(),
        why: why.into(),
    }
}

impl From<&EvictionNote> for v1::Eviction {
    fn from(e: &EvictionNote) -> Self {
        v1::Eviction {
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

impl From<v1::Eviction> for EvictionNote {
    fn from(e: v1::Eviction) -> Self {
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

impl From<&TenantExplanation> for v1::TenantExplanation {
    fn from(e: &TenantExplanation) -> Self {
        v1::TenantExplanation {
            tenant: e.tenant.to_string(),
            weight_milli: e.weight_milli,
            min_share_bp: e.min_share_bp,
            max_share_bp: e.max_share_bp,
            half_life_ms: e.half_life_ms,
            preemptible: e.preemptible,
            capacity_milli_gpue: e.capacity,
            demand_milli_gpue: e.demand,
            inuse_milli_gpue: e.inuse,
            usage_share_ppm: e.usage_share_ppm,
            weight_share_ppm: e.weight_share_ppm,
            weight_kept_ppm: e.weight_kept_ppm,
            guarantee_milli_gpue: e.guarantee,
            cap_milli_gpue: e.cap,
            surplus_milli_gpue: e.surplus,
            target_milli_gpue: e.target,
            committed_milli_gpue: e.committed,
            held_milli_gpue: e.held,
            drift_ppm: e.drift_ppm,
            fairness_score: e.fairness_score,
            clusters: e
                .clusters
                .iter()
                .map(|c| v1::ClusterPart {
                    cluster: c.cluster.to_string(),
                    inuse_milli_gpue: c.inuse,
                    pending_milli_gpue: c.pending,
                    budget_milli_gpue: c.budget,
                    fallback_milli_gpue: c.fallback,
                    enforceable_milli_gpue: c.enforceable,
                    last_epoch: c.epoch.0,
                    acked_epoch: c.epoch.1,
                    unreachable: c.unreachable,
                })
                .collect(),
            evictions: e
                .evictions
                .iter()
                .map(|s| v1::EvictionSeen {
                    at_ms: s.at_ms,
                    ago_ms: s.ago_ms,
                    cluster: s.cluster.clone(),
                    note: Some((&s.note).into()),
                })
                .collect(),
        }
    }
}

impl TryFrom<v1::TenantExplanation> for TenantExplanation {
    type Error = Invalid;

    fn try_from(e: v1::TenantExplanation) -> Result<Self, Invalid> {
        if !e.fairness_score.is_finite() {
            return Err(invalid(
                "fairness_score",
                format!("{} is not a number", e.fairness_score),
            ));
        }
        let evictions = e
            .evictions
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                let note = s
                    .note
                    .ok_or_else(|| invalid(format!("evictions[{i}].note"), "missing"))?;
                Ok(EvictionSeen {
                    at_ms: s.at_ms,
                    ago_ms: s.ago_ms,
                    cluster: s.cluster,
                    note: note.into(),
                })
            })
            .collect::<Result<Vec<_>, Invalid>>()?;
        Ok(TenantExplanation {
            tenant: crate::convert::tenant_name("tenant", &e.tenant)?,
            weight_milli: e.weight_milli,
            min_share_bp: e.min_share_bp,
            max_share_bp: e.max_share_bp,
            half_life_ms: e.half_life_ms,
            preemptible: e.preemptible,
            capacity: e.capacity_milli_gpue,
            demand: e.demand_milli_gpue,
            inuse: e.inuse_milli_gpue,
            usage_share_ppm: e.usage_share_ppm,
            weight_share_ppm: e.weight_share_ppm,
            weight_kept_ppm: e.weight_kept_ppm,
            guarantee: e.guarantee_milli_gpue,
            cap: e.cap_milli_gpue,
            surplus: e.surplus_milli_gpue,
            target: e.target_milli_gpue,
            committed: e.committed_milli_gpue,
            held: e.held_milli_gpue,
            drift_ppm: e.drift_ppm,
            fairness_score: e.fairness_score,
            clusters: e
                .clusters
                .into_iter()
                .enumerate()
                .map(|(i, c)| {
                    Ok(ClusterPart {
                        cluster: crate::convert::cluster_id(&format!("clusters[{i}].cluster"), &c.cluster)?,
                        inuse: c.inuse_milli_gpue,
                        pending: c.pending_milli_gpue,
                        budget: c.budget_milli_gpue,
                        fallback: c.fallback_milli_gpue,
                        enforceable: c.enforceable_milli_gpue,
                        epoch: (c.last_epoch, c.acked_epoch),
                        unreachable: c.unreachable,
                    })
                })
                .collect::<Result<Vec<_>, Invalid>>()?,
            evictions,
        })
    }
}

impl From<&AuditRecord> for v1::AuditRecord {
    fn from(r: &AuditRecord) -> Self {
        v1::AuditRecord {
            seq: r.seq,
            at_ms: r.at_ms,
            event: Some(event_to(&r.event)),
            actor: r.actor.clone().unwrap_or_default(),
        }
    }
}

fn budget_change_to(c: BudgetChange) -> v1::BudgetChange {
    v1::BudgetChange {
        tenant: c.tenant,
        from_milli_gpue: c.from,
        to_milli_gpue: c.to,
        why: c.why,
    }
}

fn event_to(e: &AuditEvent) -> v1::audit_record::Event {
    use v1::audit_record::Event;
    match e.clone() {
        AuditEvent::PolicyApplied {
            name,
            tenants,
            revision,
            changes,
        } => Event::PolicyApplied(v1::PolicyApplied {
            name,
            tenants: u32::try_from(tenants).unwrap_or(u32::MAX),
            revision,
            changes,
        }),
        AuditEvent::ClusterRegistered {
            cluster,
            capacity_gpue,
            joined,
        } => Event::ClusterRegistered(v1::ClusterRegistered {
            cluster,
            capacity_milli_gpue: capacity_gpue,
            joined,
        }),
        AuditEvent::ClusterRemoved { cluster } => Event::ClusterRemoved(v1::ClusterRemoved { cluster }),
        AuditEvent::Eviction { cluster, note } => Event::Eviction(v1::ClusterEviction {
            cluster,
            note: Some((&note).into()),
        }),
        AuditEvent::BudgetsChanged {
            cluster,
            epoch,
            changes,
            until_ms,
        } => Event::BudgetsChanged(v1::BudgetsChanged {
            cluster,
            epoch,
            changes: changes.into_iter().map(budget_change_to).collect(),
            until_ms: until_ms.unwrap_or(0),
        }),
        AuditEvent::LeaseExpired {
            cluster,
            last_report_ms,
        } => Event::LeaseExpired(v1::LeaseExpired {
            cluster,
            last_report_ms: last_report_ms.unwrap_or(0),
        }),
        AuditEvent::LeaseRenewed { cluster, cut_off_ms } => {
            Event::LeaseRenewed(v1::LeaseRenewed { cluster, cut_off_ms })
        }
        AuditEvent::LeaderChanged { node, term } => Event::LeaderChanged(v1::LeaderChanged { node, term }),
        AuditEvent::NodeAdded { node, voter, rpc_addr } => Event::NodeAdded(v1::NodeAdded { node, voter, rpc_addr }),
        AuditEvent::NodeRemoved { node } => Event::NodeRemoved(v1::NodeRemoved { node }),
        AuditEvent::NodeRole { node, voter } => Event::NodeRole(v1::NodeRole { node, voter }),
        AuditEvent::SnapshotRestored {
            applied_index,
            taken_at_ms,
            taken_by,
        } => Event::SnapshotRestored(v1::SnapshotRestored {
            applied_index,
            taken_at_ms,
            taken_by,
        }),
    }
}

fn event_from(e: v1::audit_record::Event) -> Result<AuditEvent, Invalid> {
    use v1::audit_record::Event;
    Ok(match e {
        Event::PolicyApplied(p) => AuditEvent::PolicyApplied {
            name: p.name,
            tenants: p.tenants as usize,
            revision: p.revision,
            changes: p.changes,
        },
        Event::ClusterRegistered(c) => AuditEvent::ClusterRegistered {
            cluster: c.cluster,
            capacity_gpue: c.capacity_milli_gpue,
            joined: c.joined,
        },
        Event::ClusterRemoved(c) => AuditEvent::ClusterRemoved { cluster: c.cluster },
        Event::Eviction(e) => AuditEvent::Eviction {
            cluster: e.cluster,
            note: e.note.ok_or_else(|| invalid("eviction.note", "missing"))?.into(),
        },
        Event::BudgetsChanged(b) => AuditEvent::BudgetsChanged {
            cluster: b.cluster,
            epoch: b.epoch,
            changes: b
                .changes
                .into_iter()
                .map(|c| BudgetChange {
                    tenant: c.tenant,
                    from: c.from_milli_gpue,
                    to: c.to_milli_gpue,
                    why: c.why,
                })
                .collect(),
            until_ms: (b.until_ms != 0).then_some(b.until_ms),
        },
        Event::LeaseExpired(l) => AuditEvent::LeaseExpired {
            cluster: l.cluster,
            last_report_ms: (l.last_report_ms != 0).then_some(l.last_report_ms),
        },
        Event::LeaseRenewed(l) => AuditEvent::LeaseRenewed {
            cluster: l.cluster,
            cut_off_ms: l.cut_off_ms,
        },
        Event::LeaderChanged(l) => AuditEvent::LeaderChanged {
            node: l.node,
            term: l.term,
        },
        Event::NodeAdded(n) => AuditEvent::NodeAdded {
            node: n.node,
            voter: n.voter,
            rpc_addr: n.rpc_addr,
        },
        Event::NodeRemoved(n) => AuditEvent::NodeRemoved { node: n.node },
        Event::NodeRole(n) => AuditEvent::NodeRole {
            node: n.node,
            voter: n.voter,
        },
        Event::SnapshotRestored(r) => AuditEvent::SnapshotRestored {
            applied_index: r.applied_index,
            taken_at_ms: r.taken_at_ms,
            taken_by: r.taken_by,
        },
    })
}

impl TryFrom<v1::AuditRecord> for AuditRecord {
    type Error = Invalid;

    fn try_from(r: v1::AuditRecord) -> Result<Self, Invalid> {
        let event = event_from(
            r.event
                .ok_or_else(|| invalid("event", "missing (written by a newer kvota?)"))?,
        )?;
        Ok(AuditRecord {
            seq: r.seq,
            at_ms: r.at_ms,
            event,
            actor: (!r.actor.is_empty()).then_some(r.actor),
        })
    }
}

#[cfg(test)]
mod tests {
    use kvota_fairness::names::{ClusterName, TenantName};
    use proptest::prelude::*;
    use prost::Message as _;

    use super::*;

    fn note() -> impl Strategy<Value = EvictionNote> {
        (
            "[a-z/-]{0,12}",
            "[a-z-]{0,8}",
            "[a-z-]{0,8}",
            "[a-z/-]{0,12}",
            any::<u64>(),
            "evicted|blocked|[a-z]{0,8}",
            ".{0,20}",
        )
            .prop_map(
                |(victim, victim_tenant, for_tenant, for_pod, milli_gpue, outcome, why)| EvictionNote {
                    victim,
                    victim_tenant,
                    for_tenant,
                    for_pod,
                    milli_gpue,
                    outcome: EvictionOutcome::parse(&outcome),
                    why,
                },
            )
    }

    fn event() -> impl Strategy<Value = AuditEvent> {
        let nonzero = || prop::option::of(1..u64::MAX);
        prop_oneof![
            (
                "[a-z-]{0,10}",
                0usize..10_000,
                any::<u64>(),
                prop::collection::vec(".{0,30}", 0..4)
            )
                .prop_map(|(name, tenants, revision, changes)| AuditEvent::PolicyApplied {
                    name,
                    tenants,
                    revision,
                    changes
                }),
            ("[a-z-]{0,10}", any::<u64>(), any::<bool>()).prop_map(|(cluster, capacity_gpue, joined)| {
                AuditEvent::ClusterRegistered {
                    cluster,
                    capacity_gpue,
                    joined,
                }
            }),
            "[a-z-]{0,10}".prop_map(|cluster| AuditEvent::ClusterRemoved { cluster }),
            ("[a-z-]{0,10}", note()).prop_map(|(cluster, note)| AuditEvent::Eviction { cluster, note }),
            (
                "[a-z-]{0,10}",
                any::<u64>(),
                prop::collection::vec(("[a-z-]{0,8}", any::<u64>(), any::<u64>(), ".{0,20}"), 0..4),
                nonzero(),
            )
                .prop_map(|(cluster, epoch, changes, until_ms)| AuditEvent::BudgetsChanged {
                    cluster,
                    epoch,
                    changes: changes
                        .into_iter()
                        .map(|(tenant, from, to, why)| BudgetChange { tenant, from, to, why })
                        .collect(),
                    until_ms,
                }),
            ("[a-z-]{0,10}", nonzero()).prop_map(|(cluster, last_report_ms)| AuditEvent::LeaseExpired {
                cluster,
                last_report_ms
            }),
            ("[a-z-]{0,10}", any::<u64>())
                .prop_map(|(cluster, cut_off_ms)| AuditEvent::LeaseRenewed { cluster, cut_off_ms }),
            (any::<u64>(), any::<u64>()).prop_map(|(node, term)| AuditEvent::LeaderChanged { node, term }),
            (any::<u64>(), any::<bool>(), ".{0,20}").prop_map(|(node, voter, rpc_addr)| AuditEvent::NodeAdded {
                node,
                voter,
                rpc_addr
            }),
            any::<u64>().prop_map(|node| AuditEvent::NodeRemoved { node }),
            (any::<u64>(), any::<bool>()).prop_map(|(node, voter)| AuditEvent::NodeRole { node, voter }),
            (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(applied_index, taken_at_ms, taken_by)| {
                AuditEvent::SnapshotRestored {
                    applied_index,
                    taken_at_ms,
                    taken_by,
                }
            }),
        ]
    }

    fn explanation() -> impl Strategy<Value = TenantExplanation> {
        let part = (
            "[a-z]([a-z0-9-]{0,8}[a-z0-9])?",
            any::<[u64; 5]>(),
            any::<(u64, u64)>(),
            any::<bool>(),
        )
            .prop_map(|(cluster, n, epoch, unreachable)| ClusterPart {
                cluster: ClusterName::parse(cluster).expect("the pattern makes labels"),
                inuse: n[0],
                pending: n[1],
                budget: n[2],
                fallback: n[3],
                enforceable: n[4],
                epoch,
                unreachable,
            });
        let seen = (any::<u64>(), any::<u64>(), "[a-z-]{1,10}", note()).prop_map(|(at_ms, ago_ms, cluster, note)| {
            EvictionSeen {
                at_ms,
                ago_ms,
                cluster,
                note,
            }
        });
        (
            (
                "[a-z]([a-z0-9-]{0,8}[a-z0-9])?",
                any::<u64>(),
                any::<u32>(),
                any::<u32>(),
                any::<u64>(),
                any::<bool>(),
            ),
            any::<[u64; 10]>(),
            (any::<u32>(), any::<u32>(), any::<i64>(), -1.0e9f64..1.0e9),
            prop::collection::vec(part, 0..4),
            prop::collection::vec(seen, 0..3),
        )
            .prop_map(
                |(
                    (tenant, weight_milli, min_share_bp, max_share_bp, half_life_ms, preemptible),
                    n,
                    (usage_share_ppm, weight_share_ppm, drift_ppm, fairness_score),
                    clusters,
                    evictions,
                )| {
                    TenantExplanation {
                        tenant: TenantName::parse(tenant).expect("the pattern makes labels"),
                        weight_milli,
                        min_share_bp,
                        max_share_bp,
                        half_life_ms,
                        preemptible,
                        capacity: n[0],
                        demand: n[1],
                        inuse: n[2],
                        usage_share_ppm,
                        weight_share_ppm,
                        weight_kept_ppm: n[3],
                        guarantee: n[4],
                        cap: n[5],
                        surplus: n[6],
                        target: n[7],
                        committed: n[8],
                        held: n[9],
                        drift_ppm,
                        fairness_score,
                        clusters,
                        evictions,
                    }
                },
            )
    }

    proptest! {
        /// An audit record reads back as it was written, through the bytes on the wire.
        #[test]
        fn audit_records_round_trip(seq in any::<u64>(), at_ms in any::<u64>(), event in event()) {
            let r = AuditRecord { seq, at_ms, event, actor: (seq % 2 == 0).then(|| format!("operator/n{at_ms}")) };
            let bytes = v1::AuditRecord::from(&r).encode_to_vec();
            let back = AuditRecord::try_from(v1::AuditRecord::decode(bytes.as_slice()).expect("decode")).expect("valid");
            prop_assert_eq!(back, r);
        }

        /// So does an explanation, every number of it.
        #[test]
        fn explanations_round_trip(e in explanation()) {
            let bytes = v1::TenantExplanation::from(&e).encode_to_vec();
            let back = TenantExplanation::try_from(v1::TenantExplanation::decode(bytes.as_slice()).expect("decode")).expect("valid");
            prop_assert_eq!(back, e);
        }

        /// Whatever bytes arrive, decoding and converting answers or refuses; it never
        /// panics.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            if let Ok(m) = v1::AuditRecord::decode(bytes.as_slice()) {
                let _ = AuditRecord::try_from(m);
            }
            if let Ok(m) = v1::TenantExplanation::decode(bytes.as_slice()) {
                let _ = TenantExplanation::try_from(m);
            }
        }
    }

    #[test]
    fn a_record_without_its_event_or_a_score_that_is_no_number_is_refused() {
        let e = AuditRecord::try_from(v1::AuditRecord {
            seq: 1,
            at_ms: 2,
            event: None,
            actor: String::new(),
        })
        .expect_err("no event");
        assert_eq!(e.field, "event");
        let x = v1::TenantExplanation {
            fairness_score: f64::NAN,
            ..Default::default()
        };
        assert_eq!(TenantExplanation::try_from(x).expect_err("NaN").field, "fairness_score");
        let seen = v1::EvictionSeen {
            at_ms: 1,
            ago_ms: 1,
            cluster: "c".into(),
            note: None,
        };
        let x = v1::TenantExplanation {
            evictions: vec![seen],
            ..Default::default()
        };
        assert_eq!(
            TenantExplanation::try_from(x).expect_err("no note").field,
            "evictions[0].note"
        );
        // Names are parsed here too: a tenant or cluster that is no DNS label is refused.
        let x = v1::TenantExplanation {
            tenant: "Training".into(),
            ..Default::default()
        };
        assert_eq!(TenantExplanation::try_from(x).expect_err("bad tenant").field, "tenant");
        let part = v1::ClusterPart {
            cluster: "east_1".into(),
            ..Default::default()
        };
        let good = v1::ClusterPart {
            cluster: "east".into(),
            ..Default::default()
        };
        let x = v1::TenantExplanation {
            tenant: "training".into(),
            clusters: vec![good, part],
            ..Default::default()
        };
        assert_eq!(
            TenantExplanation::try_from(x).expect_err("bad cluster").field,
            "clusters[1].cluster"
        );
    }
}
