//! The `FairnessPolicy` custom resource: its Rust type, from which kube's derive makes
//! the CustomResourceDefinition (`kvota policy crd`), and its status.
//!
//! The spec is the policy document's own type ([`kvota_fairness::document::PolicySpec`]):
//! the YAML parser and the resource's schema come from the same definition, so a field
//! exists in one exactly when it exists in the other. The resource is cluster-scoped
//! (one policy governs the whole federation, and the article's document names no
//! namespace). Two groups carry it: `kvota.dev` and the seed article's `kvitej.io`, so
//! the article's document applies to a cluster unchanged.

// clippy reads the repeated `type_ = ...` of several `printcolumn(...)` as one
// attribute given twice.
#![allow(clippy::duplicated_attributes)]

use kube::CustomResource;
use kvota_fairness::document::PolicySpec;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Declares the FairnessPolicy resource of one API group: kube's derive over a spec
/// that is the policy document's own type, the same printer columns and status in
/// every group; `$extra` adds kube attributes (a short name).
macro_rules! fairness_policy_resource {
    ($(#[$meta:meta])* group = $group:literal, doc = $crd_doc:literal $(, $extra:ident = $val:literal)*) => {
        $(#[$meta])*
        #[derive(CustomResource, Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
        #[kube(
            group = $group,
            version = "v1alpha1",
            kind = "FairnessPolicy",
            plural = "fairnesspolicies",
            $($extra = $val,)*
            category = "kvota",
            status = "FairnessPolicyStatus",
            doc = $crd_doc,
            printcolumn(name = "Accepted", type_ = "string", json_path = ".status.conditions[?(@.type==\"Accepted\")].status"),
            printcolumn(name = "Reason", type_ = "string", json_path = ".status.conditions[?(@.type==\"Accepted\")].reason"),
            printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
        )]
        #[serde(transparent)]
        #[schemars(transparent)]
        pub struct FairnessPolicySpec {
            /// The policy.
            pub policy: PolicySpec,
        }
    };
}

fairness_policy_resource!(
    /// The spec of a `kvota.dev/v1alpha1` FairnessPolicy: the policy document's `spec`.
    group = "kvota.dev",
    doc = "The federation's fairness policy (kvota). The policy sync controller (`kvota policy sync`) applies it to the control plane and reports the outcome in status.",
    shortname = "fairpol"
);

/// The same resource in the seed article's API group, `kvitej.io/v1alpha1`.
pub mod article {
    use super::*;

    fairness_policy_resource!(
        /// The spec of a `kvitej.io/v1alpha1` FairnessPolicy (the article's group).
        group = "kvitej.io",
        doc = "The federation's fairness policy in the seed article's API group (an alias of fairnesspolicies.kvota.dev; kvota's sync controller reads both)."
    );
}

/// What the sync controller last made of a FairnessPolicy.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FairnessPolicyStatus {
    /// The `metadata.generation` this status is about.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Accepted`: True once the federation enforces this policy; False with a reason
    /// (`Invalid`, `NotSelected`, `Ambiguous`, `Refused`, `Unreachable`) otherwise.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub conditions: Vec<Condition>,
    /// Every problem of an invalid policy, with its field path.
    #[serde(default, skip_serializing_if = "Vec::is_empty", deserialize_with = "null_as_empty")]
    pub problems: Vec<Problem>,
}

/// A list written as `null` (a merge patch clears a list so) reads as empty.
fn null_as_empty<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Vec<T>, D::Error> {
    Ok(Option::<Vec<T>>::deserialize(d)?.unwrap_or_default())
}

/// A status condition, as Kubernetes' own resources write them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// The condition's name (`Accepted`).
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// One CamelCase word for machines.
    pub reason: String,
    /// Sentences for people.
    pub message: String,
    /// The generation this condition was set for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// When `status` last changed (RFC 3339).
    pub last_transition_time: String,
}

/// One problem of a policy.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Problem {
    /// Field path, e.g. `spec.tenants[1].minShare`.
    pub path: String,
    /// What is wrong and what would be accepted.
    pub message: String,
}

/// Both CustomResourceDefinitions as one YAML stream (what `kvota policy crd` prints
/// and `deploy/kubernetes/` installs).
pub fn crds_yaml() -> anyhow::Result<String> {
    use kube::CustomResourceExt;
    let mut out = String::from(
        "# Generated by `kvota policy crd` from the Rust types (policy-sync/src/crd.rs,\n\
         # fairness/src/document.rs); do not edit. kvota/tests/crd.rs checks it is current.\n",
    );
    for crd in [FairnessPolicy::crd(), article::FairnessPolicy::crd()] {
        out.push_str("---\n");
        out.push_str(&serde_yaml_ng::to_string(&crd)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    /// What the controller wrote reads back, a cleared (`null`) list included.
    fn status_reads_back() {
        let v = serde_json::json!({"conditions": [{"lastTransitionTime": "2026-12-04T21:55:48Z", "message": "m", "observedGeneration": 1, "reason": "Applied", "status": "True", "type": "Accepted"}], "observedGeneration": 1, "problems": null});
        let s: FairnessPolicyStatus = serde_json::from_value(v).expect("status");
        assert_eq!(s.conditions[0].type_, "Accepted");
    }
}
