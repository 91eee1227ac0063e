//! Which nodes a pod may run on, as far as the scheduler's hard rules go: `spec.nodeName`,
//! `spec.nodeSelector`, required node affinity, and taints with effect `NoSchedule` or
//! `NoExecute` that the pod does not tolerate.
//!
//! Reclaim uses it so that it never evicts anyone on behalf of a pod that could not run
//! on the room it makes (a node selector no node satisfies, a taint nobody tolerates),
//! and so that it makes room only on nodes the pod may use. Soft rules (preferred
//! affinity, `PreferNoSchedule`) do not restrict where a pod may go, so they are ignored.
//! What kvota cannot read (an unknown operator, a malformed term) makes the rule match
//! nothing: the pod is then treated as unschedulable, and reclaim does nothing for it,
//! which is the safe side.

use std::collections::BTreeMap;

use serde_json::Value;

/// A node taint that can keep pods off it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Taint {
    /// Key.
    pub key: String,
    /// Value (may be empty).
    pub value: String,
    /// `NoSchedule`, `NoExecute` or `PreferNoSchedule`.
    pub effect: String,
}

/// A pod's toleration.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Toleration {
    /// Key; empty with `Exists` tolerates every taint.
    pub key: String,
    /// `Exists`, or `Equal` (the default).
    pub exists: bool,
    /// Value compared under `Equal`.
    pub value: String,
    /// Effect it tolerates; empty: all.
    pub effect: String,
}

impl Toleration {
    fn tolerates(&self, t: &Taint) -> bool {
        if !self.effect.is_empty() && self.effect != t.effect {
            return false;
        }
        if self.key.is_empty() {
            return self.exists;
        }
        self.key == t.key && (self.exists || self.value == t.value)
    }
}

/// One requirement of a node selector term.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Requirement {
    /// `matchExpressions` on node labels: key, operator, values.
    Label { key: String, op: Op, values: Vec<String> },
    /// `matchFields` on `metadata.name` (the only field Kubernetes supports): In or NotIn.
    Name { op: Op, values: Vec<String> },
    /// Something kvota cannot evaluate: matches no node.
    Unknown,
}

/// Node selector operators.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Label present with one of the values.
    In,
    /// Label absent, or present with none of the values.
    NotIn,
    /// Label present.
    Exists,
    /// Label absent.
    DoesNotExist,
    /// Label an integer greater than the value.
    Gt,
    /// Label an integer less than the value.
    Lt,
}

/// Where a pod may run.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Placement {
    /// `spec.nodeName` of a pod not yet bound (set by a user, it bypasses the scheduler).
    pub node_name: Option<String>,
    /// `spec.nodeSelector`.
    pub node_selector: BTreeMap<String, String>,
    /// Required node affinity: any term matches (OR), each term's requirements all (AND).
    /// `None`: no required affinity.
    pub required_terms: Option<Vec<Vec<Requirement>>>,
    /// Tolerations.
    pub tolerations: Vec<Toleration>,
}

fn strings(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_string)).collect())
        .unwrap_or_default()
}

fn op(s: Option<&str>) -> Option<Op> {
    Some(match s? {
        "In" => Op::In,
        "NotIn" => Op::NotIn,
        "Exists" => Op::Exists,
        "DoesNotExist" => Op::DoesNotExist,
        "Gt" => Op::Gt,
        "Lt" => Op::Lt,
        _ => return None,
    })
}

fn term(t: &Value) -> Vec<Requirement> {
    let mut out = Vec::new();
    for e in t
        .get("matchExpressions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        match (
            e.get("key").and_then(Value::as_str),
            op(e.get("operator").and_then(Value::as_str)),
        ) {
            (Some(k), Some(o)) => out.push(Requirement::Label {
                key: k.to_string(),
                op: o,
                values: strings(e.get("values")),
            }),
            _ => out.push(Requirement::Unknown),
        }
    }
    for e in t.get("matchFields").and_then(Value::as_array).into_iter().flatten() {
        match (
            e.get("key").and_then(Value::as_str),
            op(e.get("operator").and_then(Value::as_str)),
        ) {
            (Some("metadata.name"), Some(o @ (Op::In | Op::NotIn))) => out.push(Requirement::Name {
                op: o,
                values: strings(e.get("values")),
            }),
            _ => out.push(Requirement::Unknown),
        }
    }
    out
}

impl Placement {
    /// Reads a pod's placement rules from its `spec` (JSON as the API serves it).
    pub fn from_pod_spec(spec: Option<&Value>) -> Placement {
        let Some(spec) = spec else { return Placement::default() };
        let node_selector = spec
            .get("nodeSelector")
            .and_then(Value::as_object)
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                    .collect()
            })
            .unwrap_or_default();
        let required_terms = spec
            .get("affinity")
            .and_then(|a| a.get("nodeAffinity"))
            .and_then(|a| a.get("requiredDuringSchedulingIgnoredDuringExecution"))
            .map(|r| {
                r.get("nodeSelectorTerms")
                    .and_then(Value::as_array)
                    .map(|ts| ts.iter().map(term).collect())
                    .unwrap_or_default()
            });
        let tolerations = spec
            .get("tolerations")
            .and_then(Value::as_array)
            .map(|ts| {
                ts.iter()
                    .map(|t| {
                        let s = |k: &str| t.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
                        Toleration {
                            key: s("key"),
                            exists: s("operator") == "Exists",
                            value: s("value"),
                            effect: s("effect"),
                        }
                    })
                    .collect()
            })
            .unwrap_or_default();
        let node_name = spec
            .get("nodeName")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .map(str::to_string);
        Placement {
            node_name,
            node_selector,
            required_terms,
            tolerations,
        }
    }

    /// Whether the scheduler's hard rules let the pod run on a node with this name,
    /// labels and taints.
    pub fn allows(&self, name: &str, labels: &BTreeMap<String, String>, taints: &[Taint]) -> bool {
        if self.node_name.as_deref().is_some_and(|n| n != name) {
            return false;
        }
        if self.node_selector.iter().any(|(k, v)| labels.get(k) != Some(v)) {
            return false;
        }
        if let Some(terms) = &self.required_terms {
            // An empty term matches nothing; so does an empty list of terms.
            let any = terms
                .iter()
                .any(|t| !t.is_empty() && t.iter().all(|r| requirement(r, name, labels)));
            if !any {
                return false;
            }
        }
        taints
            .iter()
            .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
            .all(|t| self.tolerations.iter().any(|tol| tol.tolerates(t)))
    }
}

fn requirement(r: &Requirement, name: &str, labels: &BTreeMap<String, String>) -> bool {
    match r {
        Requirement::Unknown => false,
        Requirement::Name { op, values } => {
            let has = values.iter().any(|v| v == name);
            if *op == Op::In {
                has
            } else {
                !has
            }
        }
        Requirement::Label { key, op, values } => {
            let l = labels.get(key);
            let int = |v: Option<&String>| v.and_then(|s| s.parse::<i64>().ok());
            match op {
                Op::In => l.is_some_and(|l| values.contains(l)),
                Op::NotIn => l.is_none_or(|l| !values.contains(l)),
                Op::Exists => l.is_some(),
                Op::DoesNotExist => l.is_none(),
                // Gt/Lt take exactly one integer value; anything else matches nothing.
                Op::Gt => values.len() == 1 && matches!((int(l), int(values.first())), (Some(a), Some(b)) if a > b),
                Op::Lt => values.len() == 1 && matches!((int(l), int(values.first())), (Some(a), Some(b)) if a < b),
            }
        }
    }
}

/// A node's taints from its `spec` (JSON).
pub fn node_taints(spec: Option<&Value>) -> Vec<Taint> {
    spec.and_then(|s| s.get("taints"))
        .and_then(Value::as_array)
        .map(|ts| {
            ts.iter()
                .filter_map(|t| {
                    Some(Taint {
                        key: t.get("key")?.as_str()?.to_string(),
                        value: t.get("value").and_then(Value::as_str).unwrap_or_default().to_string(),
                        effect: t.get("effect")?.as_str()?.to_string(),
                    })
                })
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn labels(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter().map(|(k, v)| ((*k).to_string(), (*v).to_string())).collect()
    }

    #[test]
    fn node_selector_and_node_name() {
        let p = Placement::from_pod_spec(Some(&json!({"nodeSelector": {"gpu": "a100"}})));
        assert!(p.allows("n1", &labels(&[("gpu", "a100"), ("zone", "a")]), &[]));
        assert!(!p.allows("n1", &labels(&[("gpu", "h100")]), &[]));
        assert!(!p.allows("n1", &labels(&[]), &[]));
        let p = Placement::from_pod_spec(Some(&json!({"nodeName": "n2"})));
        assert!(p.allows("n2", &labels(&[]), &[]));
        assert!(!p.allows("n1", &labels(&[]), &[]));
        assert!(Placement::from_pod_spec(None).allows("any", &labels(&[]), &[]));
    }

    #[test]
    fn required_affinity_terms_or_of_ands() {
        let spec = json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100", "h100"]}, {"key": "spot", "operator": "DoesNotExist"}]},
            {"matchExpressions": [{"key": "mem", "operator": "Gt", "values": ["80"]}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["special"]}]}
        ]}}}});
        let p = Placement::from_pod_spec(Some(&spec));
        assert!(p.allows("n", &labels(&[("gpu", "h100")]), &[]));
        assert!(
            !p.allows("n", &labels(&[("gpu", "h100"), ("spot", "true")]), &[]),
            "second requirement of the term fails"
        );
        assert!(p.allows("n", &labels(&[("mem", "96")]), &[]), "second term");
        assert!(!p.allows("n", &labels(&[("mem", "64")]), &[]));
        assert!(
            !p.allows("n", &labels(&[("mem", "lots")]), &[]),
            "Gt on a non-integer label matches nothing"
        );
        assert!(p.allows("special", &labels(&[]), &[]), "matchFields on the node name");
        let p = Placement::from_pod_spec(Some(
            &json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "gpu", "operator": "NotIn", "values": ["t4"]}, {"key": "x", "operator": "Exists"}]}
            ]}}}}),
        ));
        assert!(p.allows("n", &labels(&[("x", "")]), &[]));
        assert!(!p.allows("n", &labels(&[("x", ""), ("gpu", "t4")]), &[]));
    }

    #[test]
    fn what_cannot_be_read_matches_nothing() {
        for spec in [
            json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "gpu", "operator": "Near", "values": ["a100"]}]}]}}}}),
            json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{}]}}}}),
            json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.uid", "operator": "In", "values": ["x"]}]}]}}}}),
            json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "n", "operator": "Gt", "values": ["1", "2"]}]}]}}}}),
        ] {
            let p = Placement::from_pod_spec(Some(&spec));
            assert!(!p.allows("n", &labels(&[("gpu", "a100"), ("n", "5")]), &[]), "{spec}");
        }
    }

    #[test]
    fn taints_keep_off_pods_that_do_not_tolerate_them() {
        let node = json!({"taints": [
            {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
            {"key": "soft", "effect": "PreferNoSchedule"}
        ]});
        let taints = node_taints(Some(&node));
        assert_eq!(taints.len(), 2);
        let none = Placement::default();
        assert!(!none.allows("n", &labels(&[]), &taints));
        let equal = Placement::from_pod_spec(Some(
            &json!({"tolerations": [{"key": "nvidia.com/gpu", "operator": "Equal", "value": "present", "effect": "NoSchedule"}]}),
        ));
        assert!(
            equal.allows("n", &labels(&[]), &taints),
            "PreferNoSchedule does not restrict"
        );
        let wrong = Placement::from_pod_spec(Some(
            &json!({"tolerations": [{"key": "nvidia.com/gpu", "value": "absent"}]}),
        ));
        assert!(!wrong.allows("n", &labels(&[]), &taints));
        let exists = Placement::from_pod_spec(Some(
            &json!({"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]}),
        ));
        assert!(exists.allows("n", &labels(&[]), &taints));
        let all = Placement::from_pod_spec(Some(&json!({"tolerations": [{"operator": "Exists"}]})));
        assert!(all.allows("n", &labels(&[]), &taints));
        let other_effect = Placement::from_pod_spec(Some(
            &json!({"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}]}),
        ));
        assert!(!other_effect.allows("n", &labels(&[]), &taints));
    }
}
