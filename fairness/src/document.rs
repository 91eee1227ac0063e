//! The `FairnessPolicy` document as written: the types serde parses a policy file (or a
//! Kubernetes `FairnessPolicy` resource's `spec`) into, before
//! [`crate::policy::Policy::from_yaml`] checks its meaning.
//!
//! These types are the one description of the format: the YAML parser uses them, and
//! (with this crate's `schema` feature) so does the CustomResourceDefinition's schema,
//! generated from them by schemars. A field exists in the schema exactly when the
//! parser knows it.
//!
//! Two choices keep "every problem at once" while serde does the parsing:
//!
//! - every scalar is read as a [`Scalar`], whatever its YAML type, and checked later
//!   with its field path, so one mistyped field does not hide the next;
//! - every mapping keeps the keys it does not know in `unknown` (not part of the
//!   schema); validation reports each of them as an unknown field with a "did you mean"
//!   hint, so a misspelt `minshare` is refused, never silently defaulted. (As a
//!   Kubernetes resource the schema is closed: with strict field validation, kubectl's
//!   default, the API server refuses such a field; without it the server drops it, so
//!   docs/operations.md asks for strict validation.)
//!
//! Only a mapping where a list belongs (or the like) stops the parse at the first such
//! mistake, with its path.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use serde_yaml_ng::Value;

/// Keys of a mapping that its type does not know, kept for validation to report.
pub type Unknown = BTreeMap<String, Value>;

/// One scalar as written, of whatever YAML type; validation decides if it fits.
#[derive(Clone, Debug, PartialEq)]
pub enum Scalar {
    /// A string.
    Str(String),
    /// An integer.
    Int(i128),
    /// A number with a fraction or an exponent.
    Float(f64),
    /// `true` / `false`.
    Bool(bool),
    /// `null`, `~` or nothing.
    Null,
    /// Not a scalar at all: what was found instead ("a list", "a mapping").
    Other(&'static str),
}

impl Scalar {
    /// What this is, for messages ("a string", "a number"...).
    pub fn kind(&self) -> &'static str {
        match self {
            Scalar::Str(_) => "a string",
            Scalar::Int(_) | Scalar::Float(_) => "a number",
            Scalar::Bool(_) => "a boolean",
            Scalar::Null => "nothing (null)",
            Scalar::Other(what) => what,
        }
    }

    /// A number's exact decimal text (`1.0` is `1`, `0.15` is `0.15`); `None` for
    /// anything else.
    pub fn number_text(&self) -> Option<String> {
        match self {
            Scalar::Int(i) => Some(i.to_string()),
            // Rust prints the shortest text that reads back as the same f64, so a
            // decimal written in YAML comes back as written.
            Scalar::Float(f) => Some(f.to_string()),
            _ => None,
        }
    }
}

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Scalar;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any YAML value")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Scalar, E> {
                Ok(Scalar::Bool(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Scalar, E> {
                Ok(Scalar::Int(i128::from(v)))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Scalar, E> {
                Ok(Scalar::Int(i128::from(v)))
            }
            fn visit_i128<E: de::Error>(self, v: i128) -> Result<Scalar, E> {
                Ok(Scalar::Int(v))
            }
            fn visit_u128<E: de::Error>(self, v: u128) -> Result<Scalar, E> {
                Ok(i128::try_from(v).map_or(Scalar::Float(v as f64), Scalar::Int))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Scalar, E> {
                Ok(Scalar::Float(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Scalar, E> {
                Ok(Scalar::Str(v.to_string()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Scalar, E> {
                Ok(Scalar::Str(v))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Scalar, E> {
                Ok(Scalar::Null)
            }
            fn visit_none<E: de::Error>(self) -> Result<Scalar, E> {
                Ok(Scalar::Null)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Scalar, D::Error> {
                Scalar::deserialize(d)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Scalar, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Scalar::Other("a list"))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Scalar, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Scalar::Other("a mapping"))
            }
            fn visit_enum<A: de::EnumAccess<'de>>(self, data: A) -> Result<Scalar, A::Error> {
                // A YAML `!tag value`: read and drop the value.
                let (_, v) = data.variant::<IgnoredAny>()?;
                de::VariantAccess::newtype_variant::<IgnoredAny>(v)?;
                Ok(Scalar::Other("a tagged value"))
            }
        }
        d.deserialize_any(V)
    }
}

impl Serialize for Scalar {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Scalar::Str(v) => s.serialize_str(v),
            Scalar::Int(v) => match i64::try_from(*v) {
                Ok(i) => s.serialize_i64(i),
                Err(_) => s.serialize_i128(*v),
            },
            Scalar::Float(v) => s.serialize_f64(*v),
            Scalar::Bool(v) => s.serialize_bool(*v),
            Scalar::Null | Scalar::Other(_) => s.serialize_unit(),
        }
    }
}

/// Declares a scalar field type: serde reads any [`Scalar`]; the schema says which type
/// belongs there.
macro_rules! scalar_field {
    ($(#[$doc:meta])* $name:ident, $schema:tt) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub Scalar);

        #[cfg(feature = "schema")]
        impl schemars::JsonSchema for $name {
            fn schema_name() -> std::borrow::Cow<'static, str> {
                stringify!($name).into()
            }
            fn inline_schema() -> bool {
                true
            }
            fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
                schemars::json_schema!($schema)
            }
        }
    };
}

scalar_field!(
    /// A string.
    Text,
    {"type": "string"}
);
scalar_field!(
    /// `true` or `false`.
    Flag,
    {"type": "boolean"}
);
scalar_field!(
    /// A decimal number, unquoted (`40`, `12.5`).
    Number,
    {"type": "number"}
);
scalar_field!(
    /// A whole number.
    Count,
    {"type": "integer"}
);
scalar_field!(
    /// A duration with its unit: `250ms`, `30s`, `90m`, `24h`, `7d`, `1h30m`.
    Duration,
    {"type": "string"}
);
scalar_field!(
    /// GPUe per unit as a Kubernetes quantity: a whole number, or a string such as
    /// `"0.15"` or `"150m"` (as for every quantity in a Kubernetes resource).
    Quantity,
    {"x-kubernetes-int-or-string": true}
);

/// What the webhook does with a pod over budget: `reject` (default) or `queue`.
pub type Admission = Text;

/// A whole `FairnessPolicy` document (a file, or a resource as `kubectl get -o yaml`
/// prints it).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PolicyDocument {
    /// `kvota.dev/v1alpha1` (or the article's `kvitej.io/v1alpha1`).
    #[serde(rename = "apiVersion", default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<Text>,
    /// `FairnessPolicy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<Text>,
    /// `name` is required; the rest of Kubernetes' metadata (labels, annotations,
    /// resourceVersion...) is allowed and ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Metadata>,
    /// The policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<PolicySpec>,
    /// A resource's status, written by the sync controller: allowed, never read.
    #[serde(default, skip_serializing)]
    pub status: Option<Value>,
    /// Keys the format does not have.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// A document's metadata.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Metadata {
    /// The policy's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<Text>,
    /// Everything else Kubernetes keeps in metadata.
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

/// The `spec` of a `FairnessPolicy`: what the federation enforces.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct PolicySpec {
    /// Half-life of decayed usage for every tenant that sets none (default 24h).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decay_half_life: Option<Duration>,
    /// Tenant owning pods in namespaces that no tenant claims; unset: such pods are
    /// not governed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_tenant: Option<Text>,
    /// `reject` (default) or `queue`: what happens to a pod over its tenant's budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(extend("enum" = ["reject", "queue"])))]
    pub admission: Option<Admission>,
    /// Pods waiting behind the gate per tenant and cluster, 0 to 100000 (default 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_queued: Option<Count>,
    /// Demand headroom, 1.0 (none, default) to 10.0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst_factor: Option<Number>,
    /// Lease timing for every member cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<LeaseSpec>,
    /// Showback (hourly undecayed usage) settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub showback: Option<ShowbackSpec>,
    /// Evictions for a tenant below its guarantee.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reclaim: Option<ReclaimSpec>,
    /// How long and how much of the audit log is kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit: Option<AuditSpec>,
    /// GPUe per unit of an extended resource, e.g. `nvidia.com/mig-1g.5gb: "0.15"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_weights: Option<BTreeMap<String, Quantity>>,
    /// The tenants (at least one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenants: Option<Vec<TenantSpec>>,
    /// Keys the format does not have.
    #[serde(flatten)]
    #[cfg_attr(feature = "schema", schemars(skip))]
    pub unknown: Unknown,
}

/// `spec.lease`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct LeaseSpec {
    /// How long a cluster may enforce its budgets without news (default 30s, at least 1s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration: Option<Duration>,
    /// Taken off each lease for clock-rate drift (default a tenth of the duration).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_skew_margin: Option<Duration>,
    /// Keys the format does not have.
    #[serde(flatten)]
    #[cfg_attr(feature = "schema", schemars(skip))]
    pub unknown: Unknown,
}

/// `spec.showback`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ShowbackSpec {
    /// How long hourly buckets are kept, 1h to 3 years (default 100d).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention: Option<Duration>,
    /// Keys the format does not have.
    #[serde(flatten)]
    #[cfg_attr(feature = "schema", schemars(skip))]
    pub unknown: Unknown,
}

/// `spec.audit`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct AuditSpec {
    /// How long audit records are kept, 1h to 366d (default 14d).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention: Option<Duration>,
    /// The most the audit log may hold, as a quantity of bytes, 1Mi to 256Mi (default
    /// 16Mi); budget changes are dropped before other events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_size: Option<Quantity>,
    /// Keys the format does not have.
    #[serde(flatten)]
    #[cfg_attr(feature = "schema", schemars(skip))]
    pub unknown: Unknown,
}

/// `spec.reclaim`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ReclaimSpec {
    /// Off: never evict (default on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<Flag>,
    /// Starved this long before anything is evicted (default 30s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub starved_for: Option<Duration>,
    /// Evictions per minute per cluster, 0 to 1000 (default 10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_evictions_per_minute: Option<Count>,
    /// Evictions per minute per victim tenant and cluster, 0 to 1000 (default 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_evictions_per_minute_per_tenant: Option<Count>,
    /// Younger pods are evicted only if nothing else frees enough (default 5m).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_runtime: Option<Duration>,
    /// Lend idle GPUs to preemptible tenants' pods over their budgets, evicted first when
    /// a pod within its budget needs the room (default on; needs reclaim on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lend_idle: Option<Flag>,
    /// When to lend: `always` (default), or `cutOff`: only while the cluster is cut off
    /// from the control plane and enforces fallback budgets (needs lending on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(extend("enum" = ["always", "cutOff"])))]
    pub lend_when: Option<Text>,
    /// Keys the format does not have.
    #[serde(flatten)]
    #[cfg_attr(feature = "schema", schemars(skip))]
    pub unknown: Unknown,
}

/// One tenant in `spec.tenants`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct TenantSpec {
    /// DNS label, unique in the policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<Text>,
    /// Relative weight, greater than 0 (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<Number>,
    /// Guaranteed share of federation capacity, percent (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_share: Option<Number>,
    /// Largest share of federation capacity, percent (default 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_share: Option<Number>,
    /// Whether this tenant's pods may be preempted (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preemptible: Option<Flag>,
    /// This tenant's half-life of decayed usage (default: the spec's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decay_half_life: Option<Duration>,
    /// Namespaces that belong to this tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<Vec<Text>>,
    /// Namespaces whose labels match belong to this tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<SelectorSpec>,
    /// `reject` or `queue` (default: the spec's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(extend("enum" = ["reject", "queue"])))]
    pub admission: Option<Admission>,
    /// Pods waiting behind the gate per cluster (default: the spec's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_queued: Option<Count>,
    /// Demand headroom (default: the spec's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst_factor: Option<Number>,
    /// Keys the format does not have.
    #[serde(flatten)]
    #[cfg_attr(feature = "schema", schemars(skip))]
    pub unknown: Unknown,
}

/// A tenant's `namespaceSelector`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct SelectorSpec {
    /// Labels a namespace must all carry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub match_labels: Option<BTreeMap<String, Text>>,
    /// Keys the format does not have.
    #[serde(flatten)]
    #[cfg_attr(feature = "schema", schemars(skip))]
    pub unknown: Unknown,
}

/// The fields each mapping of the format has, by path pattern (`spec`,
/// `spec.tenants[]`...): the names validation accepts and suggests.
pub fn known_fields(at: &str) -> &'static [&'static str] {
    match at {
        "" => &["apiVersion", "kind", "metadata", "spec", "status"],
        "spec" => &[
            "decayHalfLife",
            "defaultTenant",
            "admission",
            "maxQueued",
            "burstFactor",
            "lease",
            "showback",
            "audit",
            "reclaim",
            "resourceWeights",
            "tenants",
        ],
        "spec.lease" => &["duration", "clockSkewMargin"],
        "spec.showback" => &["retention"],
        "spec.audit" => &["retention", "maxSize"],
        "spec.reclaim" => &[
            "enabled",
            "starvedFor",
            "maxEvictionsPerMinute",
            "maxEvictionsPerMinutePerTenant",
            "minRuntime",
            "lendIdle",
            "lendWhen",
        ],
        "spec.tenants[]" => &[
            "name",
            "weight",
            "minShare",
            "maxShare",
            "preemptible",
            "decayHalfLife",
            "namespaces",
            "namespaceSelector",
            "admission",
            "maxQueued",
            "burstFactor",
        ],
        "spec.tenants[].namespaceSelector" => &["matchLabels"],
        _ => &[],
    }
}
