//! Conversions between wire messages and the fairness core's types.
//!
//! Wire to core is `TryFrom` with validation: names are checked, duplicates refused,
//! sizes bounded. A message that fails gets an [`Invalid`] naming the field, which the
//! server turns into `INVALID_ARGUMENT`. Core to wire is infallible `From`.

use std::collections::BTreeMap;

use kvota_fairness::admission::Verdict;
use kvota_fairness::federation::{
    ClusterStatus, EvictionNote, PodDecision, TenantReport, UsageReport, UsageWindow, MAX_CAPACITY_RESOURCES,
    MAX_REPORT_DECISIONS, MAX_REPORT_EVICTIONS, MAX_REPORT_TENANTS, MAX_VERSION_LEN,
};
use kvota_fairness::lease::{Lease, TenantBudget};
use kvota_fairness::names::{ClusterName, TenantName};

use crate::v1;

/// Most labels a cluster may carry (Kubernetes objects rarely carry more than a few dozen).
pub const MAX_LABELS: usize = 64;

/// A wire message that does not describe anything valid.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid {field}: {why}")]
pub struct Invalid {
    /// Which field.
    pub field: String,
    /// What is wrong with it.
    pub why: String,
}

pub(crate) fn invalid(field: impl Into<String>, why: impl Into<String>) -> Invalid {
    Invalid {
        field: field.into(),
        why: why.into(),
    }
}

/// Parses a cluster id (DNS label).
pub fn cluster_id(field: &str, id: &str) -> Result<ClusterName, Invalid> {
    ClusterName::parse(id).map_err(|_| {
        invalid(
            field,
            format!(
                "`{}` is not a cluster id ({})",
                truncate(id),
                kvota_fairness::names::DNS_LABEL_RULE
            ),
        )
    })
}

fn truncate(s: &str) -> String {
    if s.chars().count() > 70 {
        format!("{}...", s.chars().take(64).collect::<String>())
    } else {
        s.to_string()
    }
}

/// Parses a tenant name (DNS label).
pub fn tenant_name(field: &str, name: &str) -> Result<TenantName, Invalid> {
    TenantName::parse(name).map_err(|_| {
        invalid(
            field,
            format!(
                "`{}` is not a tenant name ({})",
                truncate(name),
                kvota_fairness::names::DNS_LABEL_RULE
            ),
        )
    })
}

/// A list of resources as a map, refusing duplicates and empty names.
pub fn capacity(field: &str, list: &[v1::Resource]) -> Result<BTreeMap<String, u64>, Invalid> {
    if list.len() > MAX_CAPACITY_RESOURCES {
        return Err(invalid(
            field,
            format!("{} resources; at most {MAX_CAPACITY_RESOURCES}", list.len()),
        ));
    }
    let mut out = BTreeMap::new();
    for (i, r) in list.iter().enumerate() {
        if r.name.is_empty() || r.name.len() > 253 {
            return Err(invalid(format!("{field}[{i}].name"), "must be 1-253 characters"));
        }
        if out.insert(r.name.clone(), r.quantity_milli).is_some() {
            return Err(invalid(
                format!("{field}[{i}].name"),
                format!("`{}` appears twice", r.name),
            ));
        }
    }
    Ok(out)
}

/// The wire form of a capacity map.
pub fn resources(map: &BTreeMap<String, u64>) -> Vec<v1::Resource> {
    map.iter()
        .map(|(name, &quantity_milli)| v1::Resource {
            name: name.clone(),
            quantity_milli,
        })
        .collect()
}

/// A validated registration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    /// Cluster id.
    pub cluster: ClusterName,
    /// Capacity per resource, thousandths.
    pub capacity: BTreeMap<String, u64>,
    /// Labels.
    pub labels: BTreeMap<String, String>,
}

impl TryFrom<v1::RegisterRequest> for Registration {
    type Error = Invalid;
    fn try_from(r: v1::RegisterRequest) -> Result<Self, Invalid> {
        if r.labels.len() > MAX_LABELS {
            return Err(invalid(
                "labels",
                format!("{} labels; at most {MAX_LABELS}", r.labels.len()),
            ));
        }
        if let Some((k, _)) = r.labels.iter().find(|(k, v)| k.len() > 317 || v.len() > 63) {
            return Err(invalid("labels", format!("label `{}` is too long", truncate(k))));
        }
        Ok(Registration {
            cluster: cluster_id("cluster", &r.cluster)?,
            capacity: capacity("capacity", &r.capacity)?,
            labels: r.labels.into_iter().collect(),
        })
    }
}

impl TryFrom<v1::ReportRequest> for UsageReport {
    type Error = Invalid;
    fn try_from(r: v1::ReportRequest) -> Result<Self, Invalid> {
        let cluster = cluster_id("cluster", &r.cluster)?;
        if r.seq == 0 {
            return Err(invalid("seq", "sequence numbers start at 1"));
        }
        if r.tenants.len() > MAX_REPORT_TENANTS {
            return Err(invalid(
                "tenants",
                format!("{} entries; at most {MAX_REPORT_TENANTS}", r.tenants.len()),
            ));
        }
        let mut tenants = BTreeMap::new();
        for (i, t) in r.tenants.iter().enumerate() {
            let name = tenant_name(&format!("tenants[{i}].tenant"), &t.tenant)?;
            if t.largest_pending_milli_gpue > t.pending_milli_gpue {
                return Err(invalid(
                    format!("tenants[{i}].largest_pending_milli_gpue"),
                    format!(
                        "{} is more than the {} pending in all (the largest waiting pod is part of what waits)",
                        t.largest_pending_milli_gpue, t.pending_milli_gpue
                    ),
                ));
            }
            if t.borrowed_milli_gpue > t.inuse_milli_gpue {
                return Err(invalid(
                    format!("tenants[{i}].borrowed_milli_gpue"),
                    format!(
                        "{} is more than the {} in use (borrowed pods are part of what is in use)",
                        t.borrowed_milli_gpue, t.inuse_milli_gpue
                    ),
                ));
            }
            let row = TenantReport {
                used_milli_gpue_ms: t.used_milli_gpue_ms,
                inuse: t.inuse_milli_gpue,
                pending: t.pending_milli_gpue,
                largest: t.largest_pending_milli_gpue,
                borrowed: t.borrowed_milli_gpue,
            };
            if tenants.insert(name, row).is_some() {
                return Err(invalid(
                    format!("tenants[{i}].tenant"),
                    format!("`{}` appears twice", t.tenant),
                ));
            }
        }
        let capacity = if r.capacity.is_empty() {
            None
        } else {
            Some(capacity("capacity", &r.capacity)?)
        };
        if r.evictions.len() > MAX_REPORT_EVICTIONS {
            return Err(invalid(
                "evictions",
                format!("{} entries; at most {MAX_REPORT_EVICTIONS}", r.evictions.len()),
            ));
        }
        // Text sizes and outcomes are checked where the report is applied (one rule
        // for every way a report arrives).
        let evictions = r.evictions.into_iter().map(EvictionNote::from).collect();
        if r.decisions.len() > MAX_REPORT_DECISIONS {
            return Err(invalid(
                "decisions",
                format!("{} entries; at most {MAX_REPORT_DECISIONS}", r.decisions.len()),
            ));
        }
        let decisions = r
            .decisions
            .into_iter()
            .enumerate()
            .map(|(i, d)| PodDecision::try_from(d).map_err(|e| invalid(format!("decisions[{i}].{}", e.field), e.why)))
            .collect::<Result<Vec<_>, _>>()?;
        let status = r.status.map(ClusterStatus::try_from).transpose()?;
        Ok(UsageReport {
            cluster,
            seq: r.seq,
            held_epoch: r.held_epoch,
            capacity,
            tenants,
            evictions,
            decisions,
            window: (r.window_start_ms != 0 || r.window_end_ms != 0).then_some(UsageWindow {
                start_ms: r.window_start_ms,
                end_ms: r.window_end_ms,
            }),
            status,
        })
    }
}

impl TryFrom<v1::ClusterStatus> for ClusterStatus {
    type Error = Invalid;
    /// Checks the version's length and characters and each tenant's name; what runs is
    /// capped at in-use where the report is applied.
    fn try_from(s: v1::ClusterStatus) -> Result<Self, Invalid> {
        if s.agent_version.len() > MAX_VERSION_LEN || !s.agent_version.chars().all(|c| c.is_ascii_graphic()) {
            return Err(invalid(
                "status.agent_version",
                format!(
                    "`{}`: at most {MAX_VERSION_LEN} printable ASCII characters",
                    truncate(&s.agent_version)
                ),
            ));
        }
        if s.running_milli_gpue.len() > MAX_REPORT_TENANTS {
            return Err(invalid(
                "status.running_milli_gpue",
                format!("{} tenants; at most {MAX_REPORT_TENANTS}", s.running_milli_gpue.len()),
            ));
        }
        let mut running = BTreeMap::new();
        for (t, g) in s.running_milli_gpue {
            running.insert(tenant_name(&format!("status.running_milli_gpue[{t}]"), &t)?, g);
        }
        Ok(ClusterStatus {
            agent_version: s.agent_version,
            feature_level: s.feature_level,
            policy_revision: s.policy_revision,
            report_interval_ms: s.report_interval_ms,
            running,
        })
    }
}

impl From<&ClusterStatus> for v1::ClusterStatus {
    fn from(s: &ClusterStatus) -> Self {
        v1::ClusterStatus {
            agent_version: s.agent_version.clone(),
            feature_level: s.feature_level,
            policy_revision: s.policy_revision,
            report_interval_ms: s.report_interval_ms,
            running_milli_gpue: s.running.iter().map(|(t, g)| (t.to_string(), *g)).collect(),
        }
    }
}

impl From<&UsageReport> for v1::ReportRequest {
    fn from(r: &UsageReport) -> Self {
        v1::ReportRequest {
            cluster: r.cluster.to_string(),
            seq: r.seq,
            held_epoch: r.held_epoch,
            tenants: r
                .tenants
                .iter()
                .map(|(t, u)| v1::TenantUsage {
                    tenant: t.to_string(),
                    used_milli_gpue_ms: u.used_milli_gpue_ms,
                    inuse_milli_gpue: u.inuse,
                    pending_milli_gpue: u.pending,
                    largest_pending_milli_gpue: u.largest,
                    borrowed_milli_gpue: u.borrowed,
                })
                .collect(),
            capacity: r.capacity.as_ref().map(resources).unwrap_or_default(),
            evictions: r.evictions.iter().map(v1::Eviction::from).collect(),
            window_start_ms: r.window.map_or(0, |w| w.start_ms),
            window_end_ms: r.window.map_or(0, |w| w.end_ms),
            decisions: r.decisions.iter().map(v1::PodDecision::from).collect(),
            gap_in_reply: false,
            status: r.status.as_ref().map(v1::ClusterStatus::from),
        }
    }
}

impl TryFrom<v1::PodDecision> for PodDecision {
    type Error = Invalid;
    fn try_from(d: v1::PodDecision) -> Result<Self, Invalid> {
        let verdict = Verdict::parse(&d.verdict)
            .ok_or_else(|| invalid("verdict", format!("`{}`: allow, queue or deny", truncate(&d.verdict))))?;
        let out = PodDecision {
            pod: d.pod,
            tenant: d.tenant,
            verdict,
            milli_gpue: d.milli_gpue,
            at_ms: d.at_ms,
            text: d.text,
        };
        if out.text.len() > kvota_fairness::federation::MAX_DECISION_TEXT {
            return Err(invalid(
                "text",
                format!(
                    "{} bytes; at most {}",
                    out.text.len(),
                    kvota_fairness::federation::MAX_DECISION_TEXT
                ),
            ));
        }
        if !out.is_valid() {
            return Err(invalid(
                "pod",
                format!(
                    "`{}` of tenant `{}`: not a namespace/name of DNS names and a tenant name",
                    truncate(&out.pod),
                    truncate(&out.tenant)
                ),
            ));
        }
        Ok(out)
    }
}

impl From<&PodDecision> for v1::PodDecision {
    fn from(d: &PodDecision) -> Self {
        v1::PodDecision {
            pod: d.pod.clone(),
            tenant: d.tenant.clone(),
            verdict: d.verdict.as_str().to_string(),
            milli_gpue: d.milli_gpue,
            at_ms: d.at_ms,
            text: d.text.clone(),
        }
    }
}

impl From<&Lease> for v1::Lease {
    fn from(l: &Lease) -> Self {
        v1::Lease {
            cluster: l.cluster.to_string(),
            epoch: l.epoch,
            duration_ms: l.duration_ms,
            margin_ms: l.margin_ms,
            issued_at_ms: l.issued_at_ms,
            budgets: l
                .budgets
                .iter()
                .map(|(t, b)| v1::TenantBudget {
                    tenant: t.to_string(),
                    budget_milli_gpue: b.budget,
                    fallback_milli_gpue: b.fallback,
                    entitlement_milli_gpue: b.entitlement,
                    borrow_milli_gpue: b.borrow,
                    ceiling_milli_gpue: b.ceiling,
                })
                .collect(),
        }
    }
}

impl TryFrom<v1::Lease> for Lease {
    type Error = Invalid;
    fn try_from(l: v1::Lease) -> Result<Self, Invalid> {
        let cluster = cluster_id("lease.cluster", &l.cluster)?;
        let mut budgets = BTreeMap::new();
        for (i, b) in l.budgets.iter().enumerate() {
            let name = tenant_name(&format!("lease.budgets[{i}].tenant"), &b.tenant)?;
            let v = TenantBudget {
                budget: b.budget_milli_gpue,
                fallback: b.fallback_milli_gpue,
                entitlement: b.entitlement_milli_gpue,
                borrow: b.borrow_milli_gpue,
                ceiling: b.ceiling_milli_gpue,
            };
            if budgets.insert(name, v).is_some() {
                return Err(invalid(format!("lease.budgets[{i}].tenant"), "appears twice"));
            }
        }
        let lease = Lease {
            cluster,
            epoch: l.epoch,
            duration_ms: l.duration_ms,
            margin_ms: l.margin_ms,
            issued_at_ms: l.issued_at_ms,
            budgets,
        };
        lease
            .validate()
            .map_err(|e| invalid(format!("lease.{}", e.field), e.why))?;
        Ok(lease)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> v1::ReportRequest {
        v1::ReportRequest {
            cluster: "east".into(),
            seq: 3,
            held_epoch: 2,
            tenants: vec![v1::TenantUsage {
                tenant: "training".into(),
                used_milli_gpue_ms: 10,
                inuse_milli_gpue: 2000,
                pending_milli_gpue: 1000,
                largest_pending_milli_gpue: 1000,
                borrowed_milli_gpue: 0,
            }],
            capacity: vec![],
            evictions: vec![v1::Eviction {
                victim: "train/job-7".into(),
                victim_tenant: "training".into(),
                for_tenant: "inference".into(),
                for_pod: "serve/api-0".into(),
                milli_gpue: 1000,
                outcome: "evicted".into(),
                why: "youngest pod of the most over-entitled tenant".into(),
            }],
            decisions: vec![],
            window_start_ms: 0,
            window_end_ms: 0,
            gap_in_reply: false,
            status: Some(v1::ClusterStatus {
                agent_version: "0.9.0".into(),
                feature_level: 6,
                policy_revision: 4,
                report_interval_ms: 5_000,
                running_milli_gpue: [("training".to_string(), 1_500)].into(),
            }),
        }
    }

    #[test]
    fn report_round_trips() {
        let core = UsageReport::try_from(report()).expect("valid");
        assert_eq!(core.tenants["training"].inuse, 2000);
        assert_eq!(core.capacity, None);
        assert_eq!(core.evictions.len(), 1);
        assert_eq!(core.evictions[0].victim, "train/job-7");
        assert_eq!(core.tenants["training"].largest, 1000);
        assert_eq!(v1::ReportRequest::from(&core), report());
    }

    #[test]
    fn a_largest_waiting_pod_above_all_that_waits_is_refused() {
        let mut r = report();
        r.tenants[0].largest_pending_milli_gpue = 1001;
        let e = UsageReport::try_from(r).expect_err("largest > pending");
        assert_eq!(e.field, "tenants[0].largest_pending_milli_gpue");
        assert!(e.why.contains("more than the 1000 pending"), "{}", e.why);
    }

    #[test]
    fn decisions_round_trip_and_bad_ones_name_their_field() {
        let mut r = report();
        let d = v1::PodDecision {
            pod: "ml/job-1".into(),
            tenant: "training".into(),
            verdict: "queue".into(),
            milli_gpue: 2_000,
            at_ms: 7,
            text: "why".into(),
        };
        r.decisions = vec![d.clone()];
        let core = UsageReport::try_from(r.clone()).expect("valid");
        assert_eq!(core.decisions[0].verdict, kvota_fairness::admission::Verdict::Queue);
        assert_eq!(v1::ReportRequest::from(&core), r);
        for (field, edit) in [
            (
                "decisions[0].verdict",
                v1::PodDecision {
                    verdict: "maybe".into(),
                    ..d.clone()
                },
            ),
            (
                "decisions[0].pod",
                v1::PodDecision {
                    pod: "no-slash".into(),
                    ..d.clone()
                },
            ),
            (
                "decisions[0].pod",
                v1::PodDecision {
                    tenant: "T".into(),
                    ..d.clone()
                },
            ),
            (
                "decisions[0].text",
                v1::PodDecision {
                    text: "x".repeat(kvota_fairness::federation::MAX_DECISION_TEXT + 1),
                    ..d.clone()
                },
            ),
        ] {
            let mut bad = report();
            bad.decisions = vec![edit];
            assert_eq!(UsageReport::try_from(bad).map_err(|e| e.field), Err(field.to_string()));
        }
        let mut many = report();
        many.decisions = vec![d; MAX_REPORT_DECISIONS + 1];
        assert_eq!(
            UsageReport::try_from(many).map_err(|e| e.field),
            Err("decisions".to_string())
        );
    }

    #[test]
    fn too_many_evictions_are_refused() {
        let mut r = report();
        r.evictions = vec![r.evictions[0].clone(); MAX_REPORT_EVICTIONS + 1];
        assert_eq!(
            UsageReport::try_from(r).map_err(|e| e.field),
            Err("evictions".to_string())
        );
    }

    #[test]
    fn bad_reports_name_the_field() {
        let mut r = report();
        r.cluster = "East_1".into();
        assert_eq!(
            UsageReport::try_from(r).map_err(|e| e.field),
            Err("cluster".to_string())
        );
        let mut r = report();
        r.seq = 0;
        assert_eq!(UsageReport::try_from(r).map_err(|e| e.field), Err("seq".to_string()));
        let mut r = report();
        r.tenants.push(r.tenants[0].clone());
        let e = UsageReport::try_from(r).expect_err("duplicate");
        assert_eq!(e.field, "tenants[1].tenant");
        let mut r = report();
        r.tenants[0].tenant = String::new();
        assert!(UsageReport::try_from(r).is_err());
        let mut r = report();
        r.capacity = vec![
            v1::Resource {
                name: "nvidia.com/gpu".into(),
                quantity_milli: 1,
            },
            v1::Resource {
                name: "nvidia.com/gpu".into(),
                quantity_milli: 2,
            },
        ];
        assert_eq!(
            UsageReport::try_from(r).map_err(|e| e.field),
            Err("capacity[1].name".to_string())
        );
    }

    #[test]
    fn lease_round_trips_and_rejects_nonsense() {
        let lease = Lease {
            cluster: ClusterName::from_static("east"),
            epoch: 4,
            duration_ms: 30_000,
            margin_ms: 3_000,
            issued_at_ms: 99,
            budgets: [(
                TenantName::from_static("training"),
                TenantBudget {
                    budget: 5,
                    fallback: 2,
                    entitlement: 9,
                    borrow: 0,
                    ceiling: 0,
                },
            )]
            .into(),
        };
        let wire = v1::Lease::from(&lease);
        assert_eq!(Lease::try_from(wire.clone()), Ok(lease));
        let mut bad = wire.clone();
        bad.budgets[0].fallback_milli_gpue = 6;
        assert!(Lease::try_from(bad).is_err());
        let mut bad = wire;
        bad.epoch = 0;
        assert!(Lease::try_from(bad).is_err());
    }

    mod fuzz {
        use super::super::*;
        use proptest::prelude::*;
        use prost::Message;

        fn name() -> impl Strategy<Value = String> {
            prop_oneof![
                Just("east".to_string()),
                Just("training".to_string()),
                Just(String::new()),
                "[a-z0-9-]{1,70}",
                ".{0,80}",
            ]
        }

        fn number() -> impl Strategy<Value = u64> {
            prop_oneof![0u64..5_000, Just(u64::MAX), Just(u64::MAX / 2), any::<u64>()]
        }

        prop_compose! {
            fn wire_report()(
                cluster in name(),
                seq in number(),
                held in number(),
                tenants in proptest::collection::vec((name(), number(), number(), number(), number()), 0..6),
                capacity in proptest::collection::vec((name(), number()), 0..3),
                window in (number(), number()),
                decisions in proptest::collection::vec((prop_oneof![Just("ml/a".to_string()), name()], name(), prop_oneof![Just("deny".to_string()), name()], number(), ".{0,40}"), 0..3),
                status in proptest::option::of((".{0,70}", any::<u32>(), number(), number(), proptest::collection::btree_map(name(), number(), 0..4))),
            ) -> v1::ReportRequest {
                v1::ReportRequest {
                    cluster,
                    seq,
                    held_epoch: held,
                    tenants: tenants.into_iter().map(|(tenant, u, i, p, l)| v1::TenantUsage { tenant, used_milli_gpue_ms: u, inuse_milli_gpue: i, pending_milli_gpue: p, largest_pending_milli_gpue: l, borrowed_milli_gpue: 0 }).collect(),
                    capacity: capacity.into_iter().map(|(name, q)| v1::Resource { name, quantity_milli: q }).collect(),
                    evictions: vec![],
                    decisions: decisions.into_iter().map(|(pod, tenant, verdict, n, text)| v1::PodDecision { pod, tenant, verdict, milli_gpue: n, at_ms: n, text }).collect(),
                    window_start_ms: window.0,
                    window_end_ms: window.1,
                    gap_in_reply: false,
                    status: status.map(|(agent_version, feature_level, policy_revision, report_interval_ms, running_milli_gpue)| v1::ClusterStatus { agent_version, feature_level, policy_revision, report_interval_ms, running_milli_gpue }),
                }
            }
        }

        proptest! {
            /// Any field values: the conversion answers (a report, or an error naming a
            /// field); what converts converts back to the same message.
            #[test]
            fn reports_convert_or_name_the_bad_field(r in wire_report()) {
                match UsageReport::try_from(r.clone()) {
                    Ok(core) => {
                        let back = v1::ReportRequest::from(&core);
                        prop_assert_eq!(UsageReport::try_from(back), Ok(core));
                    }
                    Err(e) => prop_assert!(!e.field.is_empty()),
                }
            }

            /// Arbitrary bytes as any message of the member API, then converted: decoding
            /// and conversion answer, never panic.
            #[test]
            fn arbitrary_bytes_decode_and_convert_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
                if let Ok(r) = v1::ReportRequest::decode(bytes.as_slice()) {
                    let _ = UsageReport::try_from(r);
                }
                if let Ok(r) = v1::RegisterRequest::decode(bytes.as_slice()) {
                    let _ = Registration::try_from(r);
                }
                if let Ok(l) = v1::Lease::decode(bytes.as_slice()) {
                    let _ = Lease::try_from(l);
                }
            }

            /// A valid report's encoding with bytes changed: it decodes to something that
            /// converts or is refused, never panics.
            #[test]
            fn mutated_reports_are_refused_or_converted(
                edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
            ) {
                let mut bytes = super::report().encode_to_vec();
                for (i, b) in edits {
                    let i = i.index(bytes.len());
                    bytes[i] = b;
                }
                if let Ok(r) = v1::ReportRequest::decode(bytes.as_slice()) {
                    let _ = UsageReport::try_from(r);
                }
            }
        }
    }
}
