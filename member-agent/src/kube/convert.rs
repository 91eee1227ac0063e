//! Kubernetes objects (as JSON) into what the inventory keeps: pods with their stage,
//! GPUe and run times, nodes with their allocatable devices, namespaces with their
//! labels; RFC 3339 times.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use kvota_fairness::admission::SCHEDULING_GATE;
use kvota_fairness::names::PodKey;
use kvota_fairness::resources::{effective_requests_milli, pod_gpue, ResourceWeights};
use kvota_fairness::Millis;
use serde_json::Value;

use crate::inventory::{NodeInfo, PodInfo, PodStage};

/// Seconds since the Unix epoch now.
pub(super) fn wall_now_s() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// Parses an RFC 3339 UTC timestamp as Kubernetes writes them (`2026-12-03T10:00:00Z`,
/// optionally with fractional seconds) into Unix seconds.
pub fn parse_time(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || b[13] != b':' || b[16] != b':' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
    let (y, mo, d, h, mi, se) = (
        num(0..4)?,
        num(5..7)?,
        num(8..10)?,
        num(11..13)?,
        num(14..16)?,
        num(17..19)?,
    );
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || se > 60 {
        return None;
    }
    if !s.ends_with('Z') {
        return None;
    }
    // Days from the civil date (proleptic Gregorian), 1970-01-01 = 0.
    let yy = if mo <= 2 { y - 1 } else { y };
    let era = yy.div_euclid(400);
    let yoe = yy - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + h * 3600 + mi * 60 + se)
}

/// Formats Unix seconds as RFC 3339 UTC (`2026-12-03T10:00:00Z`).
pub fn format_time(t: i64) -> String {
    let days = t.div_euclid(86_400);
    let secs = t.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

/// Agent-clock time of a wall-clock timestamp `at_s`, given both clocks now.
pub(super) fn to_agent_clock(at_s: Option<i64>, wall_now_s: i64, agent_now_ms: Millis) -> Millis {
    let Some(at) = at_s else { return agent_now_ms };
    let ago_ms = u64::try_from(wall_now_s.saturating_sub(at))
        .unwrap_or(0)
        .saturating_mul(1000);
    agent_now_ms.saturating_sub(ago_ms)
}

/// A pod object (JSON) as the inventory keeps it; `None` when it asks for no GPU or
/// cannot be read (a pod with a quantity Kubernetes would reject asks for nothing we
/// can count; the webhook judged it already).
pub fn pod_info(pod: &Value, wall_now_s: i64, agent_now_ms: Millis) -> Option<PodInfo> {
    let meta = pod.get("metadata")?;
    let namespace = meta.get("namespace")?.as_str()?.to_string();
    let name = meta.get("name")?.as_str()?;
    let resources = crate::review::pod_resources(pod).ok()?;
    let weights = ResourceWeights::new();
    let gpue = pod_gpue(&resources, &weights).ok()?;
    if gpue.total_milli == 0 {
        return None;
    }
    let devices: BTreeMap<String, u64> = effective_requests_milli(&resources)
        .ok()?
        .into_iter()
        .filter(|(r, _)| weights.is_gpu_resource(r))
        .map(|(r, q)| (r, q.div_ceil(1000)))
        .collect();
    let spec = pod.get("spec");
    let status = pod.get("status");
    let node = spec
        .and_then(|s| s.get("nodeName"))
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .map(str::to_string);
    let stage = pod_stage(spec, status, node.is_some());
    let created = meta
        .get("creationTimestamp")
        .and_then(Value::as_str)
        .and_then(parse_time);
    let started = status
        .and_then(|s| s.get("startTime"))
        .and_then(Value::as_str)
        .and_then(parse_time);
    let since = if stage == PodStage::Bound {
        started.or(created)
    } else {
        created
    };
    let ran = run_interval(status, &node, stage, started);
    // Kubernetes names follow the rule; a pod that does not is no pod the webhook saw,
    // and no real API server lists one.
    let key = match PodKey::new(&namespace, name) {
        Ok(k) => k,
        Err(e) => {
            tracing::warn!(error = %e, "a GPU pod whose name Kubernetes does not accept is left out of the inventory");
            return None;
        }
    };
    Some(PodInfo {
        key,
        namespace,
        stage,
        node,
        gpue: gpue.total_milli,
        devices,
        priority: spec
            .and_then(|s| s.get("priority"))
            .and_then(Value::as_i64)
            .and_then(|p| i32::try_from(p).ok())
            .unwrap_or(0),
        since_ms: to_agent_clock(since, wall_now_s, agent_now_ms),
        placement: crate::placement::Placement::from_pod_spec(spec),
        generate_name: meta
            .get("generateName")
            .and_then(Value::as_str)
            .filter(|g| !g.is_empty())
            .map(str::to_string),
        ran,
    })
}

/// Where a pod is in its life: finished (by its phase), bound to a node (`bound`),
/// held at kvota's scheduling gate, or waiting to be scheduled.
fn pod_stage(spec: Option<&Value>, status: Option<&Value>, bound: bool) -> PodStage {
    let phase = status
        .and_then(|s| s.get("phase"))
        .and_then(Value::as_str)
        .unwrap_or("Pending");
    let gated = spec
        .and_then(|s| s.get("schedulingGates"))
        .and_then(Value::as_array)
        .is_some_and(|g| {
            g.iter()
                .any(|x| x.get("name").and_then(Value::as_str) == Some(SCHEDULING_GATE))
        });
    match (phase, bound) {
        ("Succeeded" | "Failed", _) => PodStage::Finished,
        (_, true) => PodStage::Bound,
        _ if gated => PodStage::Gated,
        _ => PodStage::Unbound,
    }
}

/// When a bound pod held its GPUs (Unix ms): from its `PodScheduled` condition (the
/// binding) or else `status.startTime`, until the last of its containers' `finishedAt`
/// once it succeeded or failed (`None` while it runs). Kubernetes keeps these times in
/// seconds, so each end is known to a second.
pub(super) fn run_interval(
    status: Option<&Value>,
    node: &Option<String>,
    stage: PodStage,
    started: Option<i64>,
) -> Option<(u64, Option<u64>)> {
    node.as_ref()?;
    let status = status?;
    let scheduled = status
        .get("conditions")
        .and_then(Value::as_array)
        .and_then(|c| {
            c.iter().find(|c| {
                c.get("type").and_then(Value::as_str) == Some("PodScheduled")
                    && c.get("status").and_then(Value::as_str) == Some("True")
            })
        })
        .and_then(|c| c.get("lastTransitionTime"))
        .and_then(Value::as_str)
        .and_then(parse_time);
    let start = scheduled.or(started)?;
    let end = if stage == PodStage::Finished {
        let finished = ["containerStatuses", "initContainerStatuses"]
            .iter()
            .filter_map(|k| status.get(*k).and_then(Value::as_array))
            .flatten()
            .filter_map(|c| {
                c.pointer("/state/terminated/finishedAt")
                    .and_then(Value::as_str)
                    .and_then(parse_time)
            })
            .max();
        // A finished pod without a finish time (unusual): counted up to its start, not
        // beyond (nothing is invented).
        Some(finished.unwrap_or(start).max(start))
    } else {
        None
    };
    let ms = |s: i64| u64::try_from(s).unwrap_or(0).saturating_mul(1000);
    Some((ms(start), end.map(ms)))
}
/// A node object (JSON) as the inventory keeps it: its allocatable GPU devices.
pub fn node_info(node: &Value) -> Option<NodeInfo> {
    let name = node.get("metadata")?.get("name")?.as_str()?.to_string();
    let weights = ResourceWeights::new();
    let mut devices = BTreeMap::new();
    if let Some(alloc) = node
        .get("status")
        .and_then(|s| s.get("allocatable"))
        .and_then(Value::as_object)
    {
        for (r, q) in alloc {
            if !weights.is_gpu_resource(r) {
                continue;
            }
            let Some(q) = q
                .as_str()
                .and_then(|q| kvota_fairness::units::parse_quantity_milli(q).ok())
            else {
                continue;
            };
            if q >= 1000 {
                devices.insert(r.clone(), q / 1000);
            }
        }
    }
    let cordoned = node
        .get("spec")
        .and_then(|s| s.get("unschedulable"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    // A node whose Ready condition is False or Unknown takes no new pods (the node
    // lifecycle controller taints it); a node that reports no conditions yet counts.
    let not_ready = node
        .get("status")
        .and_then(|s| s.get("conditions"))
        .and_then(Value::as_array)
        .and_then(|cs| {
            cs.iter()
                .find(|c| c.get("type").and_then(Value::as_str) == Some("Ready"))
        })
        .is_some_and(|c| c.get("status").and_then(Value::as_str) != Some("True"));
    let schedulable = !cordoned && !not_ready;
    let labels = node.get("metadata").map(labels_of).unwrap_or_default();
    let taints = crate::placement::node_taints(node.get("spec"));
    Some(NodeInfo {
        name,
        devices,
        schedulable,
        labels,
        taints,
    })
}

/// The string labels of an object's `metadata` (others are skipped).
pub(super) fn labels_of(meta: &Value) -> BTreeMap<String, String> {
    meta.get("labels")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

pub(super) fn namespace_labels(ns: &Value) -> Option<(String, BTreeMap<String, String>)> {
    let meta = ns.get("metadata")?;
    let name = meta.get("name")?.as_str()?.to_string();
    Some((name, labels_of(meta)))
}

/// A typed object as the JSON the conversions read.
pub(super) fn to_json<K: serde::Serialize>(o: &K) -> Value {
    serde_json::to_value(o).unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn times_round_trip_and_match_known_dates() {
        assert_eq!(parse_time("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_time("2026-12-03T10:00:00Z"), Some(1_796_292_000));
        assert_eq!(parse_time("2024-02-29T23:59:59.123456Z"), Some(1_709_251_199));
        for t in [0, 951_782_400, 1_709_251_199, 1_796_292_000, 4_102_444_800] {
            assert_eq!(parse_time(&format_time(t)), Some(t), "{}", format_time(t));
        }
        for bad in [
            "",
            "yesterday",
            "2026-13-01T00:00:00Z",
            "2026-12-03 10:00:00Z",
            "2026-12-03T10:00:00+01:00",
        ] {
            assert_eq!(parse_time(bad), None, "{bad}");
        }
    }

    #[test]
    fn pods_are_classified_like_the_scheduler_sees_them() {
        let pod = |extra_spec: Value, status: Value| {
            let mut spec =
                json!({"containers": [{"name": "m", "resources": {"limits": {"nvidia.com/gpu": "2"}}}], "priority": 7});
            if let (Some(s), Some(e)) = (spec.as_object_mut(), extra_spec.as_object()) {
                s.extend(e.clone());
            }
            json!({"metadata": {"name": "p", "namespace": "ml", "creationTimestamp": "2026-12-03T10:00:00Z"},
                   "spec": spec, "status": status})
        };
        let now_s = 1_796_292_060; // 60 s after creation
        let p = pod_info(&pod(json!({}), json!({"phase": "Pending"})), now_s, 100_000).expect("gpu pod");
        assert_eq!(
            (p.stage, p.gpue, p.priority, p.since_ms),
            (PodStage::Unbound, 2000, 7, 40_000)
        );
        assert_eq!(p.devices, [("nvidia.com/gpu".to_string(), 2)].into());
        let gated = pod(
            json!({"schedulingGates": [{"name": "other"}, {"name": SCHEDULING_GATE}]}),
            json!({}),
        );
        assert_eq!(pod_info(&gated, now_s, 100_000).map(|p| p.stage), Some(PodStage::Gated));
        let bound = pod(
            json!({"nodeName": "n1"}),
            json!({"phase": "Running", "startTime": "2026-12-03T10:00:30Z"}),
        );
        let b = pod_info(&bound, now_s, 100_000).expect("bound");
        assert_eq!(
            (b.stage, b.node.as_deref(), b.since_ms),
            (PodStage::Bound, Some("n1"), 70_000)
        );
        let done = pod(json!({"nodeName": "n1"}), json!({"phase": "Succeeded"}));
        assert_eq!(
            pod_info(&done, now_s, 100_000).map(|p| p.stage),
            Some(PodStage::Finished)
        );
        let cpu = json!({"metadata": {"name": "c", "namespace": "ml"}, "spec": {"containers": [{"name": "m"}]}});
        assert_eq!(pod_info(&cpu, now_s, 0), None, "pods without GPUs are not kept");
    }

    #[test]
    fn nodes_offer_their_allocatable_gpus_unless_cordoned() {
        let n = json!({"metadata": {"name": "n1"}, "status": {"allocatable": {"cpu": "96", "nvidia.com/gpu": "8", "nvidia.com/mig-1g.10gb": "7"}}});
        let info = node_info(&n).expect("node");
        assert_eq!(
            info.devices,
            [
                ("nvidia.com/gpu".to_string(), 8),
                ("nvidia.com/mig-1g.10gb".to_string(), 7)
            ]
            .into()
        );
        assert!(info.schedulable);
        let c = json!({"metadata": {"name": "n2"}, "spec": {"unschedulable": true}, "status": {"allocatable": {"nvidia.com/gpu": "4"}}});
        assert!(!node_info(&c).expect("node").schedulable);
        let ready = |status: &str| {
            json!({"metadata": {"name": "n3"}, "status": {"allocatable": {"nvidia.com/gpu": "4"},
                "conditions": [{"type": "MemoryPressure", "status": "False"}, {"type": "Ready", "status": status}]}})
        };
        assert!(node_info(&ready("True")).expect("node").schedulable);
        assert!(
            !node_info(&ready("False")).expect("node").schedulable,
            "NotReady takes no new pods"
        );
        assert!(
            !node_info(&ready("Unknown")).expect("node").schedulable,
            "a node that stopped reporting"
        );
    }
}
