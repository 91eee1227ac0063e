//! The `FairnessPolicy`: loading, validation and lookups.
//!
//! The seed article's policy loads unchanged (its `apiVersion: kvitej.io/v1alpha1` is an
//! alias of `kvota.dev/v1alpha1`). serde parses the document into the types of
//! [`crate::document`] (the same types the CustomResourceDefinition's schema is generated
//! from), then this module checks what it means, reporting *every* problem at once with
//! its field path, unknown fields included (a misspelt `minshare` must not silently
//! default). A policy with any problem is rejected whole: [`Policy::from_yaml`] returns either a
//! complete, valid [`Policy`] or a [`PolicyError`] listing all [`PolicyIssue`]s.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::document::{
    known_fields, AuditSpec, Count, Duration, Flag, LeaseSpec, Metadata, Number, PolicyDocument, PolicySpec, Quantity,
    ReclaimSpec, Scalar, SelectorSpec, ShowbackSpec, TenantSpec, Text, Unknown,
};
use serde::{Deserialize, Serialize};

use crate::names::TenantName;
use crate::resources::ResourceWeights;
use crate::units::{parse_duration_ms, parse_quantity_milli};
use crate::Millis;

/// The API version kvota writes.
pub const API_VERSION: &str = "kvota.dev/v1alpha1";
/// The seed article's API version, accepted as an alias of [`API_VERSION`].
pub const API_VERSION_ALIAS: &str = "kvitej.io/v1alpha1";
/// The only accepted `kind`.
pub const KIND: &str = "FairnessPolicy";
/// Namespace label that names a namespace's tenant; it wins over every selector.
pub const TENANT_LABEL: &str = "kvota.dev/tenant";

/// Largest policy document accepted, in bytes. A policy for 10,000 tenants is about
/// 1.5 MB; anything much larger is a mistake or an attack on the parser.
pub const MAX_POLICY_BYTES: usize = 4 << 20;
/// Most tenants one policy may name (the entitlement benchmark's size).
pub const MAX_TENANTS: usize = 10_000;

/// Shares are stored in basis points: 10,000 = 100 % of federation capacity.
pub const FULL_SHARE_BP: u32 = 10_000;

/// Defaults for the optional fields, chosen to be safe rather than clever.
pub mod defaults {
    use crate::Millis;
    /// The article's half-life.
    pub const DECAY_HALF_LIFE_MS: Millis = 24 * 3600 * 1000;
    /// Long enough to ride out a control-plane failover (seconds) several times over,
    /// short enough that a partitioned cluster falls back to its safe budget quickly.
    pub const LEASE_DURATION_MS: Millis = 30_000;
    /// 10 % of the lease: covers clock-rate drift of up to 10 % (crystal drift is ppm).
    pub const CLOCK_SKEW_MARGIN_MS: Millis = 3_000;
    /// The article's lesson "bound the queue per namespace".
    pub const MAX_QUEUED: u32 = 100;
    /// No burst headroom beyond measured demand unless the operator asks for it.
    pub const BURST_FACTOR_MILLI: u32 = 1_000;
    /// Weight of a tenant that gives none.
    pub const WEIGHT_MILLI: u64 = 1_000;
    /// A tenant must be starved this long before anything is evicted for it: longer
    /// than a scheduling round and a report, so transient gaps never evict.
    pub const RECLAIM_STARVED_FOR_MS: Millis = 30_000;
    /// Evictions per minute per cluster.
    pub const RECLAIM_PER_MINUTE: u32 = 10;
    /// How long hourly showback buckets are kept: a quarter and then some.
    pub const SHOWBACK_RETENTION_MS: Millis = 100 * 24 * 3_600_000;
    /// Evictions per minute per victim tenant.
    pub const RECLAIM_PER_MINUTE_PER_TENANT: u32 = 5;
    /// Pods younger than this are evicted only if nothing else frees enough.
    pub const RECLAIM_MIN_RUNTIME_MS: Millis = 5 * 60_000;
    /// How long audit records are kept: two weeks covers "what happened last week" and
    /// a holiday; a longer record belongs in a log pipeline.
    pub const AUDIT_RETENTION_MS: Millis = 14 * 24 * 3_600_000;
    /// Most bytes the audit log may take in the replicated state (every snapshot carries
    /// it): 16 MiB is tens of thousands of events beside the rest of the state.
    pub const AUDIT_MAX_BYTES: u64 = 16 << 20;
}

/// How an agent reclaims GPUs from preemptible tenants over their entitlement for a
/// tenant below its guarantee (see [`crate::reclaim`]). Every knob damps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReclaimConfig {
    /// Off: never evict.
    pub enabled: bool,
    /// How long a tenant must have been starved before reclaim starts.
    pub starved_for_ms: Millis,
    /// Most evictions in any minute, per cluster.
    pub max_evictions_per_minute: u32,
    /// Most evictions in any minute, per victim tenant and cluster.
    pub max_evictions_per_minute_per_tenant: u32,
    /// Pods younger than this are spared unless nothing else frees enough.
    pub min_runtime_ms: Millis,
    /// Lend idle GPUs: a preemptible tenant's pod over its budget is admitted into GPUs
    /// no budget of the cluster needs now, and evicted first when a pod within its
    /// budget needs them (see [`crate::admission::borrow_room`]). Needs reclaim on.
    #[serde(default = "lend_idle_default", skip_serializing_if = "is_true")]
    pub lend_idle: bool,
    /// When a cluster lends (with `lend_idle` on): always, or only while it is cut off
    /// from the control plane (its agent enforcing fallback budgets). Absent from the
    /// encoding when `Always` (the default), so such a policy is the same bytes as before
    /// the field existed.
    #[serde(default, skip_serializing_if = "LendWhen::is_always")]
    pub lend_when: LendWhen,
}

/// When a cluster lends idle GPUs (`spec.reclaim.lendWhen`); encoded with the YAML's
/// words, `always` and `cutOff`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub enum LendWhen {
    /// Whenever GPUs are idle and a preemptible tenant's pod waits over its budget.
    #[default]
    Always,
    /// Only while the cluster's lease has expired (the agent enforces fallback budgets):
    /// while the control plane is reachable, its budgets alone decide. Lending then keeps
    /// a cut-off cluster's GPUs in use without the eviction churn lending causes among
    /// multi-node jobs (docs/policy-comparison.md).
    CutOff,
}

impl LendWhen {
    /// The default, left out of encodings.
    pub fn is_always(&self) -> bool {
        *self == LendWhen::Always
    }
}

impl fmt::Display for LendWhen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LendWhen::Always => "always",
            LendWhen::CutOff => "cutOff",
        })
    }
}

fn lend_idle_default() -> bool {
    true
}

/// Left out of the encoding when on (the default): a policy that does not turn lending
/// off is the same bytes as before the field existed.
fn is_true(v: &bool) -> bool {
    *v
}

impl Default for ReclaimConfig {
    fn default() -> Self {
        ReclaimConfig {
            enabled: true,
            starved_for_ms: defaults::RECLAIM_STARVED_FOR_MS,
            max_evictions_per_minute: defaults::RECLAIM_PER_MINUTE,
            max_evictions_per_minute_per_tenant: defaults::RECLAIM_PER_MINUTE_PER_TENANT,
            min_runtime_ms: defaults::RECLAIM_MIN_RUNTIME_MS,
            lend_idle: true,
            lend_when: LendWhen::Always,
        }
    }
}

/// The showback's settings (see [`crate::showback`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShowbackConfig {
    /// How long hourly buckets are kept.
    pub retention_ms: Millis,
}

impl ShowbackConfig {
    /// The defaults.
    pub fn is_default(&self) -> bool {
        *self == ShowbackConfig::default()
    }
}

impl Default for ShowbackConfig {
    fn default() -> Self {
        ShowbackConfig {
            retention_ms: defaults::SHOWBACK_RETENTION_MS,
        }
    }
}

/// How long and how much of the audit log is kept (`spec.audit`); records past either
/// bound are dropped oldest first (budget changes before other events, see
/// [`crate::federation`]). Kept in the replicated state from feature level 6.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditConfig {
    /// Records older than this are dropped.
    pub retention_ms: Millis,
    /// The records' size bound, in bytes as [`crate::federation::AuditRecord::size`]
    /// counts them.
    pub max_bytes: u64,
}

impl AuditConfig {
    /// The defaults.
    pub fn is_default(&self) -> bool {
        *self == AuditConfig::default()
    }
}

impl Default for AuditConfig {
    fn default() -> Self {
        AuditConfig {
            retention_ms: defaults::AUDIT_RETENTION_MS,
            max_bytes: defaults::AUDIT_MAX_BYTES,
        }
    }
}

/// Shortest and longest audit retention a policy may ask for.
pub const AUDIT_RETENTION_RANGE_MS: (Millis, Millis) = (3_600_000, 366 * 24 * 3_600_000);
/// Smallest and largest audit size bound a policy may ask for (bytes): below 1 MiB a
/// burst of budget changes would push out the events an operator looks for; above
/// 256 MiB every snapshot drags the history along.
pub const AUDIT_SIZE_RANGE: (u64, u64) = (1 << 20, 256 << 20);

/// Shortest and longest showback retention a policy may ask for.
pub const SHOWBACK_RETENTION_RANGE_MS: (Millis, Millis) = (3_600_000, 3 * 366 * 24 * 3_600_000);

/// What the admission webhook does with a pod that does not fit its tenant's budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum AdmissionMode {
    /// Deny the pod with an explanation (validating webhook).
    #[default]
    Reject,
    /// Hold the pod behind the scheduling gate `kvota.dev/admission` until budget frees.
    Queue,
}

impl fmt::Display for AdmissionMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AdmissionMode::Reject => "reject",
            AdmissionMode::Queue => "queue",
        })
    }
}

/// Lease timing, shared by every cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseConfig {
    /// How long a lease may be enforced, counted from the agent's request.
    pub duration_ms: Millis,
    /// Subtracted by the agent from `duration_ms`; must cover clock-rate drift between the
    /// agent and the control plane over one lease (`margin >= duration * drift`).
    pub clock_skew_margin_ms: Millis,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        LeaseConfig {
            duration_ms: defaults::LEASE_DURATION_MS,
            clock_skew_margin_ms: defaults::CLOCK_SKEW_MARGIN_MS,
        }
    }
}

/// One tenant (team) of the federation, validated.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantPolicy {
    /// DNS-label name, unique in the policy.
    pub name: TenantName,
    /// Weight in thousandths (the article's `weight: 40` is 40,000). Always > 0.
    pub weight_milli: u64,
    /// Guaranteed share of federation capacity, basis points. `min <= max`.
    pub min_share_bp: u32,
    /// Largest share of federation capacity, basis points.
    pub max_share_bp: u32,
    /// Whether this tenant's pods may ever be preempted (never for inference).
    pub preemptible: bool,
    /// Half-life of this tenant's decayed usage. Always > 0.
    pub decay_half_life_ms: Millis,
    /// Namespaces named explicitly as this tenant's.
    pub namespaces: Vec<String>,
    /// Namespaces whose labels contain all of these belong to this tenant.
    pub namespace_selector: BTreeMap<String, String>,
    /// What happens to pods over budget.
    pub admission: AdmissionMode,
    /// Bound on pods waiting behind the gate in `queue` mode, per cluster.
    pub max_queued: u32,
    /// Demand headroom in thousandths (1,000 = none, 2,000 = the article's "2x"):
    /// see [`crate::entitlement::effective_demand`].
    pub burst_factor_milli: u32,
}

/// A complete, valid policy. Tenants are sorted by name, so index order is the same on
/// every node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// `metadata.name`.
    pub name: String,
    /// The `apiVersion` as written (either [`API_VERSION`] or its alias).
    pub api_version: String,
    /// Tenant that owns pods in namespaces no tenant claims; `None`: such pods are ignored.
    pub default_tenant: Option<TenantName>,
    /// Lease timing.
    pub lease: LeaseConfig,
    /// Reclaim damping (absent from policies replicated before it existed: defaults).
    #[serde(default)]
    pub reclaim: ReclaimConfig,
    /// Showback retention (absent from policies replicated before it existed: defaults;
    /// written only when set, so a state without it is the same bytes as before).
    #[serde(default, skip_serializing_if = "ShowbackConfig::is_default")]
    pub showback: ShowbackConfig,
    /// Audit log retention (absent from policies replicated before it existed: defaults;
    /// written only when set, as `showback`).
    #[serde(default, skip_serializing_if = "AuditConfig::is_default")]
    pub audit: AuditConfig,
    /// GPUe per resource name (explicit ones; built-in defaults apply to the rest).
    pub resource_weights: ResourceWeights,
    /// Tenants, sorted by name.
    pub tenants: Vec<TenantPolicy>,
}

/// One problem found in a policy document.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyIssue {
    /// Field path, e.g. `spec.tenants[1].minShare`; `(document)` for YAML syntax errors.
    pub path: String,
    /// What is wrong and what would be accepted.
    pub message: String,
}

impl fmt::Display for PolicyIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// A rejected policy: every problem found, in document order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub struct PolicyError {
    /// Never empty.
    pub issues: Vec<PolicyIssue>,
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.issues.len();
        write!(
            f,
            "policy rejected ({n} problem{}); nothing was changed:",
            if n == 1 { "" } else { "s" }
        )?;
        for issue in &self.issues {
            write!(f, "\n  - {issue}")?;
        }
        Ok(())
    }
}

/// One tenant of [`Policy::to_yaml`]'s `spec.tenants`, every field written out.
fn write_tenant_yaml(y: &mut String, t: &TenantPolicy) {
    use std::fmt::Write as _;
    let q = yaml_quote;
    let _ = writeln!(y, "  - name: {}", q(&t.name));
    let _ = writeln!(y, "    weight: {}", fmt_scaled(i128::from(t.weight_milli), 3));
    let _ = writeln!(y, "    minShare: {}", fmt_scaled(i128::from(t.min_share_bp), 2));
    let _ = writeln!(y, "    maxShare: {}", fmt_scaled(i128::from(t.max_share_bp), 2));
    let _ = writeln!(y, "    preemptible: {}", t.preemptible);
    let _ = writeln!(y, "    decayHalfLife: {}", q(&duration_text(t.decay_half_life_ms)));
    let _ = writeln!(y, "    admission: {}", q(&t.admission.to_string()));
    let _ = writeln!(y, "    maxQueued: {}", t.max_queued);
    let _ = writeln!(
        y,
        "    burstFactor: {}",
        fmt_scaled(i128::from(t.burst_factor_milli), 3)
    );
    let list: Vec<String> = t.namespaces.iter().map(|n| q(n)).collect();
    let _ = writeln!(y, "    namespaces: [{}]", list.join(", "));
    if !t.namespace_selector.is_empty() {
        let _ = writeln!(y, "    namespaceSelector:\n      matchLabels:");
        for (k, v) in &t.namespace_selector {
            let _ = writeln!(y, "        {}: {}", q(k), q(v));
        }
    }
}

impl Policy {
    /// Parse and validate a `FairnessPolicy` YAML document.
    ///
    /// Either every field is valid and the whole policy is returned, or the error lists
    /// every problem with its path. Never panics, whatever the input.
    pub fn from_yaml(text: &str) -> Result<Policy, PolicyError> {
        if text.len() > MAX_POLICY_BYTES {
            return Err(PolicyError {
                issues: vec![issue(
                    "(document)",
                    format!("document is {} bytes; the limit is {MAX_POLICY_BYTES}", text.len()),
                )],
            });
        }
        // Syntax first (serde would meet a shape mistake before a syntax error later on
        // the same line), then the shape, with paths.
        if let Err(e) = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(text) {
            return Err(PolicyError {
                issues: vec![parse_issue(&e)],
            });
        }
        let doc: PolicyDocument = match serde_yaml_ng::from_str(text) {
            Ok(d) => d,
            Err(e) => {
                return Err(PolicyError {
                    issues: vec![parse_issue(&e)],
                })
            }
        };
        Policy::from_document(&doc)
    }

    /// Check a parsed document (a file, or a `FairnessPolicy` resource as the sync
    /// controller reads it): the whole policy, or every problem with its path.
    pub fn from_document(doc: &PolicyDocument) -> Result<Policy, PolicyError> {
        let mut cx = Checker::default();
        let policy = cx.policy(doc);
        match policy {
            Some(p) if cx.issues.is_empty() => Ok(p),
            _ => {
                if cx.issues.is_empty() {
                    cx.push("(document)", "policy could not be read".to_string());
                }
                Err(PolicyError { issues: cx.issues })
            }
        }
    }

    /// The policy as a FairnessPolicy document that [`Policy::from_yaml`] reads back to
    /// this very policy: every field written out (each tenant's own, not inherited), so
    /// `kvota policy get` prints what `kvota policy apply` takes, and a diff of two of
    /// them shows every difference. Strings are double-quoted (a namespace such as
    /// `123` stays a string), numbers exact.
    pub fn to_yaml(&self) -> String {
        use std::fmt::Write as _;
        let q = yaml_quote;
        let mut y = String::new();
        let _ = writeln!(y, "apiVersion: {}", q(&self.api_version));
        let _ = writeln!(y, "kind: FairnessPolicy");
        let _ = writeln!(y, "metadata:\n  name: {}", q(&self.name));
        let _ = writeln!(y, "spec:");
        if let Some(d) = &self.default_tenant {
            let _ = writeln!(y, "  defaultTenant: {}", q(d));
        }
        let _ = writeln!(
            y,
            "  lease:\n    duration: {}\n    clockSkewMargin: {}",
            q(&duration_text(self.lease.duration_ms)),
            q(&duration_text(self.lease.clock_skew_margin_ms))
        );
        let r = &self.reclaim;
        let _ = writeln!(
            y,
            "  reclaim:\n    enabled: {}\n    starvedFor: {}\n    maxEvictionsPerMinute: {}\n    maxEvictionsPerMinutePerTenant: {}\n    minRuntime: {}",
            r.enabled,
            q(&duration_text(r.starved_for_ms)),
            r.max_evictions_per_minute,
            r.max_evictions_per_minute_per_tenant,
            q(&duration_text(r.min_runtime_ms))
        );
        if !r.lend_idle {
            let _ = writeln!(y, "    lendIdle: false");
        }
        if !r.lend_when.is_always() {
            let _ = writeln!(y, "    lendWhen: {}", r.lend_when);
        }
        // Written only when set: a build that predates it reads the document unchanged.
        if self.showback != ShowbackConfig::default() {
            let _ = writeln!(
                y,
                "  showback:\n    retention: {}",
                q(&duration_text(self.showback.retention_ms))
            );
        }
        if !self.audit.is_default() {
            let _ = writeln!(
                y,
                "  audit:\n    retention: {}\n    maxSize: {}",
                q(&duration_text(self.audit.retention_ms)),
                q(&bytes_text(self.audit.max_bytes))
            );
        }
        if !self.resource_weights.explicit().is_empty() {
            let _ = writeln!(y, "  resourceWeights:");
            for (name, milli) in self.resource_weights.explicit() {
                let _ = writeln!(y, "    {}: {}", q(name), q(&format!("{milli}m")));
            }
        }
        let _ = writeln!(y, "  tenants:");
        for t in &self.tenants {
            write_tenant_yaml(&mut y, t);
        }
        y
    }

    /// Whether no namespace can belong to a tenant but through its label: no tenant lists
    /// a namespace or a selector, and there is no default tenant. Then only pods in
    /// namespaces labelled `kvota.dev/tenant=<tenant>` are governed (the article's policy
    /// is such a one), which a newcomer does not expect.
    pub fn maps_no_namespace(&self) -> bool {
        self.default_tenant.is_none()
            && self
                .tenants
                .iter()
                .all(|t| t.namespaces.is_empty() && t.namespace_selector.is_empty())
    }

    /// The article's three-tenant policy (training / inference / research), as YAML.
    pub fn article_example_yaml() -> &'static str {
        ARTICLE_POLICY
    }

    /// Index of a tenant by name (tenants are sorted, so this is a binary search).
    pub fn tenant_index(&self, name: &str) -> Option<usize> {
        self.tenants.binary_search_by(|t| t.name.as_str().cmp(name)).ok()
    }

    /// A tenant by name.
    pub fn tenant(&self, name: &str) -> Option<&TenantPolicy> {
        self.tenant_index(name).map(|i| &self.tenants[i])
    }

    /// Which tenant owns a namespace, given the namespace's labels.
    ///
    /// Order: the `kvota.dev/tenant` label (if it names a known tenant), an explicit
    /// `namespaces` entry, the first tenant (by name) whose selector matches, then the
    /// default tenant. `None`: the namespace's pods are not governed by kvota.
    pub fn tenant_for_namespace(&self, namespace: &str, labels: &BTreeMap<String, String>) -> Option<&TenantPolicy> {
        if let Some(t) = labels.get(TENANT_LABEL).and_then(|n| self.tenant(n)) {
            return Some(t);
        }
        if let Some(t) = self
            .tenants
            .iter()
            .find(|t| t.namespaces.iter().any(|n| n == namespace))
        {
            return Some(t);
        }
        if let Some(t) = self.tenants.iter().find(|t| {
            !t.namespace_selector.is_empty() && t.namespace_selector.iter().all(|(k, v)| labels.get(k) == Some(v))
        }) {
            return Some(t);
        }
        self.default_tenant.as_deref().and_then(|n| self.tenant(n))
    }

    /// Sum of all tenants' weights, thousandths.
    pub fn total_weight_milli(&self) -> u64 {
        self.tenants
            .iter()
            .fold(0u64, |acc, t| acc.saturating_add(t.weight_milli))
    }
}

const ARTICLE_POLICY: &str = "\
# SIVARO's scheduler config for fair queuing with decay
apiVersion: kvitej.io/v1alpha1
kind: FairnessPolicy
metadata:
  name: myfair-cluster
spec:
  decayHalfLife: \"24h\"
  tenants:
  - name: training
    weight: 40
    minShare: 20
    maxShare: 60
    preemptible: true
  - name: inference
    weight: 50
    minShare: 40
    maxShare: 80
    preemptible: false
  - name: research
    weight: 10
    minShare: 5
    maxShare: 25
    preemptible: true
";

fn issue(path: impl Into<String>, message: impl Into<String>) -> PolicyIssue {
    PolicyIssue {
        path: path.into(),
        message: message.into(),
    }
}

/// Checks a parsed document, collecting every problem instead of stopping at the first.
#[derive(Default)]
struct Checker {
    issues: Vec<PolicyIssue>,
}

/// Spec-level defaults that tenants inherit.
struct SpecDefaults {
    half_life_ms: Millis,
    admission: AdmissionMode,
    max_queued: u32,
    burst_factor_milli: u32,
}

/// The first problem serde met (only the shape of a mapping or a list stops it: see
/// [`crate::document`]), with the path serde_yaml_ng puts in front of its message.
fn parse_issue(e: &serde_yaml_ng::Error) -> PolicyIssue {
    let text = e.to_string();
    let at = e.location().map(|l| format!("line {} column {}", l.line(), l.column()));
    let body = match &at {
        Some(a) => text.strip_suffix(&format!(" at {a}")).unwrap_or(&text).to_string(),
        None => text.clone(),
    };
    let is_path = |p: &str| !p.is_empty() && p.bytes().all(|c| c.is_ascii_alphanumeric() || b"._[]-/".contains(&c));
    if let Some((path, what)) = body.split_once(": ").filter(|(p, _)| is_path(p)) {
        // An integer beyond 64 bits (serde buffers flattened mappings without u128).
        let what = if what.contains("u128") || what.contains("i128") {
            "number out of range".to_string()
        } else {
            plain_types(what)
        };
        return issue(path, at.map_or(what.clone(), |a| format!("{what} ({a})")));
    }
    if body.starts_with("invalid type") {
        let body = plain_types(&body);
        let found = body.rsplit(", found ").next().unwrap_or(&body);
        return issue(
            "(document)",
            format!("expected a FairnessPolicy mapping, found {found}"),
        );
    }
    issue(
        at.unwrap_or_else(|| "(document)".to_string()),
        format!("not valid YAML: {body}"),
    )
}

/// serde's type names in the words of a policy's author.
fn plain_types(what: &str) -> String {
    let mut out = what
        .replace("sequence", "a list")
        .replace("a a list", "a list")
        .replace("map,", "a mapping,");
    // "expected struct TenantSpec" -> "expected a mapping"
    while let Some(i) = out.find("struct ") {
        let end = out[i + 7..]
            .find(|c: char| !c.is_ascii_alphanumeric())
            .map_or(out.len(), |e| i + 7 + e);
        out.replace_range(i..end, "a mapping");
    }
    // "invalid type: X, expected Y" -> "expected Y, found X"
    if let Some((found, expected)) = out
        .strip_prefix("invalid type: ")
        .and_then(|r| r.split_once(", expected "))
    {
        out = format!("expected {expected}, found {found}");
    }
    out
}

impl Checker {
    fn push(&mut self, path: &str, message: String) {
        self.issues.push(issue(path, message));
    }

    /// Reports every key the format does not have at `path` (whose field list is
    /// [`known_fields`]`(pattern)`), suggesting a near match.
    fn unknown_keys(&mut self, path: &str, pattern: &str, unknown: &Unknown) {
        let known = known_fields(pattern);
        for k in unknown.keys() {
            let hint = known
                .iter()
                .find(|c| c.eq_ignore_ascii_case(k) || edit_distance(c, k) <= 2)
                .map(|c| format!("; did you mean `{c}`?"))
                .unwrap_or_else(|| format!("; known fields: {}", known.join(", ")));
            self.push(&join(path, k), format!("unknown field `{k}`{hint}"));
        }
    }

    fn string(&mut self, path: &str, v: &Text) -> Option<String> {
        match &v.0 {
            Scalar::Str(s) => Some(s.clone()),
            other => {
                self.push(path, format!("expected a string, found {}", other.kind()));
                None
            }
        }
    }

    fn boolean(&mut self, path: &str, v: &Flag) -> Option<bool> {
        match &v.0 {
            Scalar::Bool(b) => Some(*b),
            other => {
                self.push(path, format!("expected true or false, found {}", other.kind()));
                None
            }
        }
    }

    /// An unquoted YAML number, scaled to an integer with `decimals` digits after the
    /// point (exactly: more digits are an error). A quoted one is refused, as the
    /// resource's schema refuses it (`type: number`).
    fn decimal(&mut self, path: &str, v: &Scalar, decimals: u32) -> Option<i128> {
        let text = match v {
            Scalar::Str(s) => {
                let why = if s.trim().parse::<f64>().is_ok_and(f64::is_infinite) {
                    "too large for a number".to_string()
                } else {
                    "write the number without quotes".to_string()
                };
                self.push(path, format!("expected a number, found a string (\"{s}\"): {why}"));
                return None;
            }
            other => match other.number_text() {
                Some(t) => t,
                None => {
                    self.push(path, format!("expected a number, found {}", other.kind()));
                    return None;
                }
            },
        };
        match parse_scaled_decimal(&text, decimals) {
            Ok(x) => Some(x),
            Err(why) => {
                self.push(path, format!("`{text}` {why}"));
                None
            }
        }
    }

    fn duration(&mut self, path: &str, v: &Duration) -> Option<Millis> {
        let s = match &v.0 {
            Scalar::Str(s) => s,
            n @ (Scalar::Int(_) | Scalar::Float(_)) => {
                let n = n.number_text().unwrap_or_default();
                self.push(
                    path,
                    format!("`{n}` has no unit; write a duration such as \"24h\", \"90m\" or \"30s\""),
                );
                return None;
            }
            other => {
                self.push(
                    path,
                    format!("expected a duration such as \"24h\", found {}", other.kind()),
                );
                return None;
            }
        };
        match parse_duration_ms(s) {
            Ok(ms) => Some(ms),
            Err(e) => {
                self.push(path, e.to_string());
                None
            }
        }
    }

    fn share(&mut self, path: &str, v: Option<&Number>, default_bp: u32) -> Option<u32> {
        let Some(v) = v else { return Some(default_bp) };
        let bp = self.decimal(path, &v.0, 2)?;
        if !(0..=i128::from(FULL_SHARE_BP)).contains(&bp) {
            self.push(
                path,
                format!("must be a percentage between 0 and 100, found {}", fmt_scaled(bp, 2)),
            );
            return None;
        }
        u32::try_from(bp).ok()
    }

    fn positive_duration(&mut self, path: &str, v: &Duration) -> Option<Millis> {
        let ms = self.duration(path, v)?;
        if ms == 0 {
            self.push(path, "must be longer than zero".to_string());
            return None;
        }
        Some(ms)
    }

    fn admission_mode(&mut self, path: &str, v: &Text) -> Option<AdmissionMode> {
        match self.string(path, v)?.as_str() {
            "reject" => Some(AdmissionMode::Reject),
            "queue" => Some(AdmissionMode::Queue),
            other => {
                self.push(path, format!("`{other}` is not a mode; use `reject` or `queue`"));
                None
            }
        }
    }

    fn lend_when(&mut self, path: &str, v: &Text) -> Option<LendWhen> {
        match self.string(path, v)?.as_str() {
            "always" => Some(LendWhen::Always),
            "cutOff" => Some(LendWhen::CutOff),
            other => {
                self.push(path, format!("`{other}` is not a choice; use `always` (default) or `cutOff` (lend only while the cluster is cut off from the control plane)"));
                None
            }
        }
    }

    /// A whole number from 0 to `max`; `what` says what 0 means, if anything.
    fn count(&mut self, path: &str, v: &Count, max: u32, zero: &str) -> Option<u32> {
        let n = self.decimal(path, &v.0, 0)?;
        match u32::try_from(n) {
            Ok(n) if n <= max => Some(n),
            _ => {
                self.push(path, format!("must be a whole number from 0{zero} to {max}, found {n}"));
                None
            }
        }
    }

    fn burst_factor(&mut self, path: &str, v: &Number) -> Option<u32> {
        let milli = self.decimal(path, &v.0, 3)?;
        if !(1_000..=10_000).contains(&milli) {
            self.push(
                path,
                format!(
                    "must be between 1.0 (no headroom) and 10.0, found {}",
                    fmt_scaled(milli, 3)
                ),
            );
            return None;
        }
        u32::try_from(milli).ok()
    }

    fn policy(&mut self, doc: &PolicyDocument) -> Option<Policy> {
        self.unknown_keys("", "", &doc.unknown);
        let api_version = match &doc.api_version {
            None => {
                self.push("apiVersion", format!("missing; use `{API_VERSION}`"));
                None
            }
            Some(v) => self.string("apiVersion", v).and_then(|s| {
                if s == API_VERSION || s == API_VERSION_ALIAS {
                    Some(s)
                } else {
                    self.push(
                        "apiVersion",
                        format!("`{s}` is not supported; use `{API_VERSION}` (or its alias `{API_VERSION_ALIAS}`)"),
                    );
                    None
                }
            }),
        };
        match &doc.kind {
            None => self.push("kind", format!("missing; use `{KIND}`")),
            Some(v) => {
                if let Some(k) = self.string("kind", v) {
                    if k != KIND {
                        self.push("kind", format!("`{k}` is not supported; use `{KIND}`"));
                    }
                }
            }
        }
        let name = self.metadata(doc.metadata.as_ref());
        let spec = match &doc.spec {
            None => {
                self.push("spec", "missing; a policy needs `spec.tenants`".to_string());
                None
            }
            Some(s) => self.spec(s),
        };
        let (default_tenant, lease, reclaim, (showback, audit), resource_weights, tenants) = spec?;
        Some(Policy {
            name: name?,
            api_version: api_version?,
            default_tenant,
            lease,
            reclaim,
            showback,
            audit,
            resource_weights,
            tenants,
        })
    }

    fn metadata(&mut self, m: Option<&Metadata>) -> Option<String> {
        // Kubernetes metadata carries much more (labels, annotations...): allowed.
        let Some(n) = m.and_then(|m| m.name.as_ref()) else {
            self.push("metadata.name", "missing; every policy needs a name".to_string());
            return None;
        };
        let s = self.string("metadata.name", n)?;
        if s.is_empty() || s.len() > 253 {
            self.push("metadata.name", "must be 1 to 253 characters".to_string());
            return None;
        }
        Some(s)
    }

    #[allow(clippy::type_complexity)]
    fn spec(
        &mut self,
        s: &PolicySpec,
    ) -> Option<(
        Option<TenantName>,
        LeaseConfig,
        ReclaimConfig,
        (ShowbackConfig, AuditConfig),
        ResourceWeights,
        Vec<TenantPolicy>,
    )> {
        self.unknown_keys("spec", "spec", &s.unknown);
        let (defaults, defaults_ok) = self.spec_defaults(s);
        let lease = match &s.lease {
            None => Some(LeaseConfig::default()),
            Some(v) => self.lease(v),
        };
        let reclaim = match &s.reclaim {
            None => Some(ReclaimConfig::default()),
            Some(v) => self.reclaim(v),
        };
        let showback = match &s.showback {
            None => Some(ShowbackConfig::default()),
            Some(v) => self.showback(v),
        };
        let audit = match &s.audit {
            None => Some(AuditConfig::default()),
            Some(v) => self.audit(v),
        };
        let weights = match &s.resource_weights {
            None => Some(ResourceWeights::new()),
            Some(v) => self.resource_weights(v),
        };
        let tenants = match &s.tenants {
            None => {
                self.push("spec.tenants", "missing; list at least one tenant".to_string());
                None
            }
            Some(v) => self.tenants(v, &defaults),
        };
        let default_tenant = self.default_tenant(s, tenants.as_deref());
        // Every piece must be valid for the policy to exist at all.
        defaults_ok.then_some(())?;
        Some((
            default_tenant?,
            lease?,
            reclaim?,
            (showback?, audit?),
            weights?,
            tenants?,
        ))
    }

    /// The spec-wide defaults of tenant fields (each invalid one reported and replaced
    /// by the built-in default), and whether all were valid.
    fn spec_defaults(&mut self, s: &PolicySpec) -> (SpecDefaults, bool) {
        let half_life_ms = match &s.decay_half_life {
            None => Some(defaults::DECAY_HALF_LIFE_MS),
            Some(v) => self.positive_duration("spec.decayHalfLife", v),
        };
        let admission = match &s.admission {
            None => Some(AdmissionMode::default()),
            Some(v) => self.admission_mode("spec.admission", v),
        };
        let max_queued = match &s.max_queued {
            None => Some(defaults::MAX_QUEUED),
            Some(v) => self.count("spec.maxQueued", v, 100_000, ""),
        };
        let burst = match &s.burst_factor {
            None => Some(defaults::BURST_FACTOR_MILLI),
            Some(v) => self.burst_factor("spec.burstFactor", v),
        };
        let ok = half_life_ms.is_some() && admission.is_some() && max_queued.is_some() && burst.is_some();
        let defaults = SpecDefaults {
            half_life_ms: half_life_ms.unwrap_or(defaults::DECAY_HALF_LIFE_MS),
            admission: admission.unwrap_or_default(),
            max_queued: max_queued.unwrap_or(defaults::MAX_QUEUED),
            burst_factor_milli: burst.unwrap_or(defaults::BURST_FACTOR_MILLI),
        };
        (defaults, ok)
    }

    /// `spec.defaultTenant`, which must name one of the (valid) tenants.
    fn default_tenant(&mut self, s: &PolicySpec, tenants: Option<&[TenantPolicy]>) -> Option<Option<TenantName>> {
        match &s.default_tenant {
            None => Some(None),
            Some(v) => {
                // Only a tenant's own name is taken: it was parsed with the tenant.
                let name = self.string("spec.defaultTenant", v);
                match (&name, tenants) {
                    (Some(n), Some(ts)) => match ts.iter().find(|t| t.name == *n) {
                        Some(t) => Some(Some(t.name.clone())),
                        None => {
                            self.push(
                                "spec.defaultTenant",
                                format!("`{n}` is not one of the tenants in spec.tenants"),
                            );
                            None
                        }
                    },
                    // Reported where the name or the tenants failed.
                    _ => None,
                }
            }
        }
    }

    fn lease(&mut self, l: &LeaseSpec) -> Option<LeaseConfig> {
        self.unknown_keys("spec.lease", "spec.lease", &l.unknown);
        let duration = match &l.duration {
            None => Some(defaults::LEASE_DURATION_MS),
            Some(v) => self.positive_duration("spec.lease.duration", v),
        };
        let margin = match &l.clock_skew_margin {
            None => duration.map(|d| d / 10),
            Some(v) => self.duration("spec.lease.clockSkewMargin", v),
        };
        let (d, mg) = (duration?, margin?);
        if d < 1_000 {
            self.push("spec.lease.duration", "must be at least 1s".to_string());
            return None;
        }
        if mg.saturating_mul(2) > d {
            self.push(
                "spec.lease.clockSkewMargin",
                format!(
                    "{} is more than half the lease duration {}; a lease would be usable for less than half its life",
                    crate::units::format_duration_ms(mg),
                    crate::units::format_duration_ms(d)
                ),
            );
            return None;
        }
        Some(LeaseConfig {
            duration_ms: d,
            clock_skew_margin_ms: mg,
        })
    }

    fn showback(&mut self, s: &ShowbackSpec) -> Option<ShowbackConfig> {
        self.unknown_keys("spec.showback", "spec.showback", &s.unknown);
        let Some(v) = &s.retention else {
            return Some(ShowbackConfig::default());
        };
        let ms = self.duration("spec.showback.retention", v)?;
        let (lo, hi) = SHOWBACK_RETENTION_RANGE_MS;
        if !(lo..=hi).contains(&ms) {
            self.push(
                "spec.showback.retention",
                format!(
                    "must be from {} to {}, found {}",
                    crate::units::format_duration_ms(lo),
                    crate::units::format_duration_ms(hi),
                    crate::units::format_duration_ms(ms)
                ),
            );
            return None;
        }
        Some(ShowbackConfig { retention_ms: ms })
    }

    fn audit(&mut self, a: &AuditSpec) -> Option<AuditConfig> {
        self.unknown_keys("spec.audit", "spec.audit", &a.unknown);
        let d = AuditConfig::default();
        let retention = match &a.retention {
            None => Some(d.retention_ms),
            Some(v) => self.duration("spec.audit.retention", v).and_then(|ms| {
                let (lo, hi) = AUDIT_RETENTION_RANGE_MS;
                if (lo..=hi).contains(&ms) {
                    return Some(ms);
                }
                let f = crate::units::format_duration_ms;
                self.push(
                    "spec.audit.retention",
                    format!("must be from {} to {}, found {}", f(lo), f(hi), f(ms)),
                );
                None
            }),
        };
        let max_bytes = match &a.max_size {
            None => Some(d.max_bytes),
            Some(v) => self.byte_size("spec.audit.maxSize", v, AUDIT_SIZE_RANGE),
        };
        Some(AuditConfig {
            retention_ms: retention?,
            max_bytes: max_bytes?,
        })
    }

    /// A size in bytes written as a Kubernetes quantity (`64Mi`, `100M`, or a whole
    /// number of bytes), within `range`.
    fn byte_size(&mut self, path: &str, v: &Quantity, range: (u64, u64)) -> Option<u64> {
        let text = match &v.0 {
            Scalar::Str(s) => s.clone(),
            Scalar::Int(i) => i.to_string(),
            other => {
                self.push(
                    path,
                    format!("expected a size such as \"64Mi\", found {}", other.kind()),
                );
                return None;
            }
        };
        let bytes = match parse_quantity_milli(&text) {
            Ok(milli) => milli / 1000,
            Err(e) => {
                self.push(path, format!("`{text}`: {e}; write a size such as \"64Mi\""));
                return None;
            }
        };
        if !(range.0..=range.1).contains(&bytes) {
            self.push(
                path,
                format!(
                    "must be from {} to {}, found {}",
                    bytes_text(range.0),
                    bytes_text(range.1),
                    bytes_text(bytes)
                ),
            );
            return None;
        }
        Some(bytes)
    }

    fn reclaim(&mut self, r: &ReclaimSpec) -> Option<ReclaimConfig> {
        self.unknown_keys("spec.reclaim", "spec.reclaim", &r.unknown);
        let d = ReclaimConfig::default();
        let enabled = r
            .enabled
            .as_ref()
            .map_or(Some(d.enabled), |v| self.boolean("spec.reclaim.enabled", v));
        let starved = r
            .starved_for
            .as_ref()
            .map_or(Some(d.starved_for_ms), |v| self.duration("spec.reclaim.starvedFor", v));
        let per_minute = r
            .max_evictions_per_minute
            .as_ref()
            .map_or(Some(d.max_evictions_per_minute), |v| {
                self.count("spec.reclaim.maxEvictionsPerMinute", v, 1_000, " (never evict)")
            });
        let per_tenant =
            r.max_evictions_per_minute_per_tenant
                .as_ref()
                .map_or(Some(d.max_evictions_per_minute_per_tenant), |v| {
                    self.count(
                        "spec.reclaim.maxEvictionsPerMinutePerTenant",
                        v,
                        1_000,
                        " (never evict)",
                    )
                });
        let min_runtime = r
            .min_runtime
            .as_ref()
            .map_or(Some(d.min_runtime_ms), |v| self.duration("spec.reclaim.minRuntime", v));
        let lend_idle = r
            .lend_idle
            .as_ref()
            .map_or(Some(d.lend_idle), |v| self.boolean("spec.reclaim.lendIdle", v));
        let lend_when = r
            .lend_when
            .as_ref()
            .map_or(Some(d.lend_when), |v| self.lend_when("spec.reclaim.lendWhen", v));
        // A setting that could do nothing is refused rather than kept silently.
        if lend_when == Some(LendWhen::CutOff) && (enabled == Some(false) || lend_idle == Some(false)) {
            let why = if enabled == Some(false) {
                "spec.reclaim.enabled is false"
            } else {
                "spec.reclaim.lendIdle is false"
            };
            self.push(
                "spec.reclaim.lendWhen",
                format!(
                    "`cutOff` says when to lend, but {why}, so nothing is lent; remove lendWhen or turn lending on"
                ),
            );
            return None;
        }
        Some(ReclaimConfig {
            enabled: enabled?,
            starved_for_ms: starved?,
            max_evictions_per_minute: per_minute?,
            max_evictions_per_minute_per_tenant: per_tenant?,
            min_runtime_ms: min_runtime?,
            lend_idle: lend_idle?,
            lend_when: lend_when?,
        })
    }

    fn resource_weights(&mut self, m: &BTreeMap<String, Quantity>) -> Option<ResourceWeights> {
        let mut w = ResourceWeights::new();
        let mut ok = true;
        for (name, val) in m {
            let path = format!("spec.resourceWeights[{name}]");
            if !valid_resource_name(name) {
                self.push(
                    &path,
                    "not a Kubernetes extended resource name (expected `vendor.domain/name`, e.g. `nvidia.com/mig-1g.5gb`)".to_string(),
                );
                ok = false;
                continue;
            }
            // GPUe per unit, written as a Kubernetes quantity: a whole number, or a
            // string ("0.143", "500m"); an unquoted fraction is refused, as the
            // resource's schema (integer or string) refuses it.
            let text = match &val.0 {
                Scalar::Str(s) => s.clone(),
                Scalar::Int(i) => i.to_string(),
                Scalar::Float(f) if f.fract() == 0.0 && f.is_finite() => format!("{f}"),
                Scalar::Float(f) => {
                    self.push(&path, format!("write a fractional weight as a quantity string, e.g. \"{f}\" (an unquoted fraction is not a Kubernetes quantity)"));
                    ok = false;
                    continue;
                }
                other => {
                    self.push(
                        &path,
                        format!("expected a number of GPUe per unit, found {}", other.kind()),
                    );
                    ok = false;
                    continue;
                }
            };
            match parse_quantity_milli(&text) {
                Ok(milli) if milli <= 1_000_000 => w.set(name, milli),
                Ok(_) => {
                    self.push(
                        &path,
                        format!("`{text}` GPUe per unit is implausibly large (limit 1000)"),
                    );
                    ok = false;
                }
                Err(e) => {
                    self.push(&path, format!("`{text}`: {e}"));
                    ok = false;
                }
            }
        }
        ok.then_some(w)
    }

    fn tenants(&mut self, seq: &[TenantSpec], defaults: &SpecDefaults) -> Option<Vec<TenantPolicy>> {
        if seq.is_empty() {
            self.push("spec.tenants", "is empty; list at least one tenant".to_string());
            return None;
        }
        if seq.len() > MAX_TENANTS {
            self.push(
                "spec.tenants",
                format!("{} tenants; at most {MAX_TENANTS} are supported", seq.len()),
            );
            return None;
        }
        let mut out = Vec::with_capacity(seq.len());
        let mut all_ok = true;
        let mut seen: BTreeMap<String, usize> = BTreeMap::new();
        let mut claimed: BTreeMap<String, TenantName> = BTreeMap::new();
        let mut min_sum_bp: u64 = 0;
        for (i, tv) in seq.iter().enumerate() {
            let path = format!("spec.tenants[{i}]");
            // Duplicates are found from the raw names, so a tenant with other problems
            // still counts as the first holder of its name.
            if let Some(Text(Scalar::Str(name))) = &tv.name {
                if let Some(first) = seen.insert(name.clone(), i) {
                    self.push(
                        &format!("{path}.name"),
                        format!("duplicate tenant `{name}` (first at spec.tenants[{first}])"),
                    );
                    all_ok = false;
                    seen.insert(name.clone(), first);
                }
            }
            match self.tenant(&path, tv, defaults) {
                Some(t) => {
                    for (j, ns) in t.namespaces.iter().enumerate() {
                        if let Some(owner) = claimed.insert(ns.clone(), t.name.clone()) {
                            if owner != t.name {
                                self.push(
                                    &format!("{path}.namespaces[{j}]"),
                                    format!("namespace `{ns}` is already claimed by tenant `{owner}`"),
                                );
                                all_ok = false;
                            }
                        }
                    }
                    min_sum_bp += u64::from(t.min_share_bp);
                    out.push(t);
                }
                None => all_ok = false,
            }
        }
        if min_sum_bp > u64::from(FULL_SHARE_BP) {
            self.push(
                "spec.tenants",
                format!(
                    "minShare values add up to {}%; guarantees cannot exceed 100% of capacity",
                    fmt_scaled(i128::from(min_sum_bp), 2)
                ),
            );
            all_ok = false;
        }
        if !all_ok {
            return None;
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Some(out)
    }

    fn tenant(&mut self, path: &str, t: &TenantSpec, d: &SpecDefaults) -> Option<TenantPolicy> {
        self.unknown_keys(path, "spec.tenants[]", &t.unknown);
        let name = self.tenant_name(path, t);
        let weight = self.tenant_weight(path, t);
        let min = self.share(&join(path, "minShare"), t.min_share.as_ref(), 0);
        let max = self.share(&join(path, "maxShare"), t.max_share.as_ref(), FULL_SHARE_BP);
        // Reported, and the tenant's other fields are still checked.
        let shares_ordered = self.shares_ordered(path, min, max);
        let preemptible = match &t.preemptible {
            None => Some(false),
            Some(v) => self.boolean(&join(path, "preemptible"), v),
        };
        let half_life = match &t.decay_half_life {
            None => Some(d.half_life_ms),
            Some(v) => self.positive_duration(&join(path, "decayHalfLife"), v),
        };
        let namespaces = match &t.namespaces {
            None => Some(Vec::new()),
            Some(v) => self.namespaces(&join(path, "namespaces"), v),
        };
        let selector = match &t.namespace_selector {
            None => Some(BTreeMap::new()),
            Some(v) => self.selector(&join(path, "namespaceSelector"), v),
        };
        let admission = match &t.admission {
            None => Some(d.admission),
            Some(v) => self.admission_mode(&join(path, "admission"), v),
        };
        let max_queued = match &t.max_queued {
            None => Some(d.max_queued),
            Some(v) => self.count(&join(path, "maxQueued"), v, 100_000, ""),
        };
        let burst = match &t.burst_factor {
            None => Some(d.burst_factor_milli),
            Some(v) => self.burst_factor(&join(path, "burstFactor"), v),
        };
        shares_ordered?;
        Some(TenantPolicy {
            name: name?,
            weight_milli: weight?,
            min_share_bp: min?,
            max_share_bp: max?,
            preemptible: preemptible?,
            decay_half_life_ms: half_life?,
            namespaces: namespaces?,
            namespace_selector: selector?,
            admission: admission?,
            max_queued: max_queued?,
            burst_factor_milli: burst?,
        })
    }

    fn tenant_name(&mut self, path: &str, t: &TenantSpec) -> Option<TenantName> {
        match &t.name {
            None => {
                self.push(&join(path, "name"), "missing".to_string());
                None
            }
            Some(v) => self
                .string(&join(path, "name"), v)
                .and_then(|n| match TenantName::parse(n.as_str()) {
                    Ok(name) => Some(name),
                    Err(_) => {
                        self.push(
                            &join(path, "name"),
                            format!("`{n}` is not a valid tenant name ({})", crate::names::DNS_LABEL_RULE),
                        );
                        None
                    }
                }),
        }
    }

    fn tenant_weight(&mut self, path: &str, t: &TenantSpec) -> Option<u64> {
        match &t.weight {
            None => Some(defaults::WEIGHT_MILLI),
            Some(v) => self.decimal(&join(path, "weight"), &v.0, 3).and_then(|w| {
                if w <= 0 {
                    self.push(
                        &join(path, "weight"),
                        format!("must be greater than 0, found {}", fmt_scaled(w, 3)),
                    );
                    None
                } else if w > 1_000_000_000 {
                    self.push(&join(path, "weight"), "must be at most 1000000".to_string());
                    None
                } else {
                    u64::try_from(w).ok()
                }
            }),
        }
    }

    /// `Some` unless minShare is above maxShare (then reported).
    fn shares_ordered(&mut self, path: &str, min: Option<u32>, max: Option<u32>) -> Option<()> {
        match (min, max) {
            (Some(lo), Some(hi)) if lo > hi => {
                self.push(
                    &join(path, "minShare"),
                    format!(
                        "minShare {}% is greater than maxShare {}%",
                        fmt_scaled(i128::from(lo), 2),
                        fmt_scaled(i128::from(hi), 2)
                    ),
                );
                None
            }
            _ => Some(()),
        }
    }

    fn namespaces(&mut self, path: &str, seq: &[Text]) -> Option<Vec<String>> {
        let mut out = Vec::new();
        let mut ok = true;
        for (i, item) in seq.iter().enumerate() {
            let p = format!("{path}[{i}]");
            match self.string(&p, item) {
                Some(s) if crate::names::is_dns_label(&s) => out.push(s),
                Some(s) => {
                    self.push(&p, format!("`{s}` is not a valid namespace name"));
                    ok = false;
                }
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    fn selector(&mut self, path: &str, s: &SelectorSpec) -> Option<BTreeMap<String, String>> {
        self.unknown_keys(path, "spec.tenants[].namespaceSelector", &s.unknown);
        let Some(labels) = &s.match_labels else {
            self.push(&join(path, "matchLabels"), "missing".to_string());
            return None;
        };
        let mut out = BTreeMap::new();
        let mut ok = true;
        for (k, val) in labels {
            match &val.0 {
                Scalar::Str(s) => {
                    out.insert(k.clone(), s.clone());
                }
                other => {
                    self.push(
                        &format!("{path}.matchLabels[{k}]"),
                        format!("label values must be strings, found {}", other.kind()),
                    );
                    ok = false;
                }
            }
        }
        if out.is_empty() && ok {
            self.push(
                &join(path, "matchLabels"),
                "is empty; it would match every namespace".to_string(),
            );
            return None;
        }
        ok.then_some(out)
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// Parses `-12.34` style decimals into an integer scaled by `10^decimals`, exactly.
fn parse_scaled_decimal(text: &str, decimals: u32) -> Result<i128, String> {
    let (neg, body) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text.strip_prefix('+').unwrap_or(text)),
    };
    let (int_part, frac_part) = match body.split_once('.') {
        Some((i, f)) => (i, f),
        None => (body, ""),
    };
    let digits_ok = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if (int_part.is_empty() && frac_part.is_empty()) || !digits_ok(int_part) || !digits_ok(frac_part) {
        return Err("is not a plain decimal number".to_string());
    }
    if int_part.len() > 18 {
        return Err("is too large".to_string());
    }
    let frac_trimmed = frac_part.trim_end_matches('0');
    if frac_trimmed.len() > decimals as usize {
        return Err(if decimals == 0 {
            "must be a whole number".to_string()
        } else {
            format!("has more than {decimals} digits after the decimal point")
        });
    }
    let mut value: i128 = 0;
    for b in int_part.bytes() {
        value = value * 10 + i128::from(b - b'0');
    }
    for i in 0..decimals as usize {
        let digit = frac_trimmed.as_bytes().get(i).map_or(0, |b| b - b'0');
        value = value * 10 + i128::from(digit);
    }
    Ok(if neg { -value } else { value })
}

/// `s` as a YAML double-quoted scalar (quotes, backslashes and control characters
/// escaped), which reads back as exactly `s`, whatever it looks like.
fn yaml_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() || c == '\u{2028}' || c == '\u{2029}' || c == '\u{feff}' => {
                let _ = std::fmt::Write::write_fmt(&mut out, format_args!("\\u{:04X}", u32::from(c)));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A duration in the largest unit that writes it exactly (`24h`, `90m`, `30s`, `250ms`).
fn duration_text(ms: Millis) -> String {
    for (unit, size) in [("h", 3_600_000), ("m", 60_000), ("s", 1_000)] {
        if ms != 0 && ms % size == 0 {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

/// What changes from `old` to `new`, in the policy's own words and units: one line per
/// field of the document [`Policy::to_yaml`] writes, `path: old -> new`
/// (`spec.lease.duration: 30s -> 10s`, `spec.tenants[research].weight: 10 -> 20`), tenants
/// by name (`spec.tenants[ops]: added`), at most `max_lines` lines (the rest counted in a
/// last line). Empty when nothing changes. Deterministic: the audit log keeps it.
pub fn describe_changes(old: &Policy, new: &Policy, max_lines: usize) -> Vec<String> {
    use serde_yaml_ng::Value;
    fn doc(p: &Policy) -> Value {
        let mut v: Value = serde_yaml_ng::from_str(&p.to_yaml()).unwrap_or(Value::Null);
        // Tenants by name rather than by place in the list.
        if let Some(list) = v.get_mut("spec").and_then(|s| s.get_mut("tenants")) {
            let by_name: serde_yaml_ng::Mapping = list
                .as_sequence()
                .into_iter()
                .flatten()
                .filter_map(|t| Some((t.get("name")?.clone(), t.clone())))
                .collect();
            *list = Value::Mapping(by_name);
        }
        v
    }
    fn text(v: &Value) -> String {
        match v {
            Value::Null => "(unset)".to_string(),
            Value::Bool(b) => b.to_string(),
            Value::Number(n) => n.to_string(),
            Value::String(s) => s.clone(),
            Value::Sequence(items) => format!("[{}]", items.iter().map(text).collect::<Vec<_>>().join(", ")),
            Value::Mapping(m) => format!(
                "{{{}}}",
                m.iter()
                    .map(|(k, v)| format!("{}: {}", text(k), text(v)))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Value::Tagged(t) => text(&t.value),
        }
    }
    fn walk(path: &str, a: &Value, b: &Value, out: &mut Vec<String>) {
        match (a, b) {
            (Value::Mapping(x), Value::Mapping(y)) => {
                let tenants = path.ends_with(".tenants");
                let keys = x.keys().chain(y.keys().filter(|k| !x.contains_key(*k)));
                for k in keys {
                    let child = if tenants {
                        format!("{path}[{}]", text(k))
                    } else if path.is_empty() {
                        text(k)
                    } else {
                        format!("{path}.{}", text(k))
                    };
                    match (x.get(k), y.get(k)) {
                        (Some(p), Some(q)) => walk(&child, p, q, out),
                        (None, Some(_)) if tenants => out.push(format!("{child}: added")),
                        (Some(_), None) if tenants => out.push(format!("{child}: removed")),
                        (p, q) => walk(&child, p.unwrap_or(&Value::Null), q.unwrap_or(&Value::Null), out),
                    }
                }
            }
            _ if a != b => out.push(format!("{path}: {} -> {}", text(a), text(b))),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk("", &doc(old), &doc(new), &mut out);
    if out.len() > max_lines {
        let more = out.len() - max_lines.saturating_sub(1);
        out.truncate(max_lines.saturating_sub(1));
        out.push(format!("and {more} more changes"));
    }
    out
}

/// A byte count as the largest binary unit that divides it (`16Mi`), as a policy writes it.
fn bytes_text(bytes: u64) -> String {
    for (unit, size) in [("Gi", 1u64 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)] {
        if bytes != 0 && bytes % size == 0 {
            return format!("{}{unit}", bytes / size);
        }
    }
    bytes.to_string()
}

fn fmt_scaled(v: i128, decimals: u32) -> String {
    let scale = 10i128.pow(decimals);
    let sign = if v < 0 { "-" } else { "" };
    let a = v.abs();
    let (i, f) = (a / scale, a % scale);
    if f == 0 {
        format!("{sign}{i}")
    } else {
        let fs = format!("{f:0width$}", width = decimals as usize);
        format!("{sign}{i}.{}", fs.trim_end_matches('0'))
    }
}

fn valid_resource_name(s: &str) -> bool {
    let Some((domain, name)) = s.split_once('/') else {
        return false;
    };
    let ok = |p: &str| {
        !p.is_empty()
            && p.len() <= 253
            && p.bytes()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'+'))
    };
    ok(domain) && domain.contains('.') && ok(name)
}

/// Levenshtein distance, for "did you mean" hints on short field names.
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    if a.len() > 64 || b.len() > 64 {
        return usize::MAX;
    }
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != cb);
            cur[j + 1] = (prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Every distinct namespace explicitly claimed in the policy (for diagnostics).
pub fn claimed_namespaces(p: &Policy) -> BTreeSet<&str> {
    p.tenants
        .iter()
        .flat_map(|t| t.namespaces.iter().map(String::as_str))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn article_policy_loads_unchanged() {
        let p = Policy::from_yaml(ARTICLE_POLICY).expect("article policy must load");
        assert_eq!(p.name, "myfair-cluster");
        assert_eq!(p.api_version, API_VERSION_ALIAS);
        let names: Vec<_> = p.tenants.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["inference", "research", "training"]);
        let inf = p.tenant("inference").expect("inference");
        assert_eq!(inf.weight_milli, 50_000);
        assert_eq!((inf.min_share_bp, inf.max_share_bp), (4_000, 8_000));
        assert!(!inf.preemptible);
        assert_eq!(inf.decay_half_life_ms, 24 * 3600 * 1000);
        let tr = p.tenant("training").expect("training");
        assert!(tr.preemptible);
        assert_eq!((tr.min_share_bp, tr.max_share_bp), (2_000, 6_000));
        assert_eq!(p.lease, LeaseConfig::default());
        assert_eq!(inf.admission, AdmissionMode::Reject);
    }

    #[test]
    fn every_problem_is_reported_with_its_path() {
        let yaml = r#"
apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: bad}
spec:
  decayHalfLife: "24 parsecs"
  tenants:
  - name: training
    weight: -5
    minShare: 70
    maxShare: 60
  - name: inference
    weight: 50
    minShare: 60
    maxShare: 80
  - name: training
    weight: 1
    minshare: 5
"#;
        let err = Policy::from_yaml(yaml).expect_err("must be rejected");
        let paths: Vec<&str> = err.issues.iter().map(|i| i.path.as_str()).collect();
        assert!(paths.contains(&"spec.decayHalfLife"), "{err}");
        assert!(paths.contains(&"spec.tenants[0].weight"), "{err}");
        assert!(paths.contains(&"spec.tenants[0].minShare"), "{err}");
        assert!(paths.contains(&"spec.tenants[2].minshare"), "{err}");
        let typo = err
            .issues
            .iter()
            .find(|i| i.path == "spec.tenants[2].minshare")
            .expect("typo");
        assert!(typo.message.contains("did you mean `minShare`"), "{typo}");
        assert!(paths.contains(&"spec.tenants[2].name"), "duplicate: {err}");
        assert!(err.to_string().contains("nothing was changed"));
    }

    #[test]
    fn shares_over_100_percent_are_rejected() {
        let yaml = "apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: x}\nspec:\n  tenants:\n  - {name: a, minShare: 60}\n  - {name: b, minShare: 50.5}\n";
        let err = Policy::from_yaml(yaml).expect_err("reject");
        assert_eq!(err.issues.len(), 1, "{err}");
        assert_eq!(err.issues[0].path, "spec.tenants");
        assert!(err.issues[0].message.contains("110.5%"), "{err}");
    }

    #[test]
    fn bad_yaml_is_one_issue_with_a_location() {
        let err = Policy::from_yaml("spec: [unclosed").expect_err("reject");
        assert_eq!(err.issues.len(), 1);
        assert!(err.issues[0].path.starts_with("line "), "{err}");
    }

    #[test]
    fn extensions_load() {
        let yaml = r#"
apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: ext}
spec:
  decayHalfLife: 12h
  defaultTenant: research
  admission: queue
  maxQueued: 20
  burstFactor: 2
  lease: {duration: 20s, clockSkewMargin: 2s}
  resourceWeights:
    nvidia.com/mig-1g.5gb: "0.15"
  tenants:
  - name: inference
    decayHalfLife: 6h
    admission: reject
    namespaces: [serving, serving-canary]
  - name: research
    namespaceSelector: {matchLabels: {team: research}}
    maxQueued: 5
    burstFactor: 1.5
"#;
        let p = Policy::from_yaml(yaml).expect("valid");
        let inf = p.tenant("inference").expect("inference");
        assert_eq!(inf.decay_half_life_ms, 6 * 3600 * 1000);
        assert_eq!(inf.admission, AdmissionMode::Reject);
        assert_eq!(inf.max_queued, 20);
        assert_eq!(inf.burst_factor_milli, 2_000);
        let res = p.tenant("research").expect("research");
        assert_eq!(res.decay_half_life_ms, 12 * 3600 * 1000);
        assert_eq!(res.admission, AdmissionMode::Queue);
        assert_eq!((res.max_queued, res.burst_factor_milli), (5, 1_500));
        assert_eq!(p.lease.duration_ms, 20_000);
        assert_eq!(p.resource_weights.weight_milli("nvidia.com/mig-1g.5gb"), Some(150));

        let none = BTreeMap::new();
        let labelled: BTreeMap<String, String> = [("team".to_string(), "research".to_string())].into();
        let by_label: BTreeMap<String, String> = [(TENANT_LABEL.to_string(), "inference".to_string())].into();
        assert_eq!(
            p.tenant_for_namespace("serving", &none).map(|t| t.name.as_str()),
            Some("inference")
        );
        assert_eq!(
            p.tenant_for_namespace("x", &labelled).map(|t| t.name.as_str()),
            Some("research")
        );
        assert_eq!(
            p.tenant_for_namespace("x", &by_label).map(|t| t.name.as_str()),
            Some("inference")
        );
        assert_eq!(
            p.tenant_for_namespace("other", &none).map(|t| t.name.as_str()),
            Some("research")
        );
    }

    #[test]
    fn lease_margin_and_modes_are_checked() {
        let yaml = "apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: x}\nspec:\n  admission: drop\n  lease: {duration: 10s, clockSkewMargin: 6s}\n  defaultTenant: nobody\n  tenants:\n  - {name: a}\n";
        let err = Policy::from_yaml(yaml).expect_err("reject");
        let paths: Vec<&str> = err.issues.iter().map(|i| i.path.as_str()).collect();
        assert_eq!(
            paths,
            ["spec.admission", "spec.lease.clockSkewMargin", "spec.defaultTenant"],
            "{err}"
        );
    }

    #[test]
    fn showback_retention_is_optional_bounded_and_round_trips() {
        let base = "apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: x}\nspec:\n  tenants:\n  - {name: a}\n";
        let p = Policy::from_yaml(base).expect("valid");
        assert_eq!(p.showback, ShowbackConfig::default());
        assert!(
            !p.to_yaml().contains("showback"),
            "the default is not written: older builds read the document"
        );
        let set = base.replace("spec:\n", "spec:\n  showback: {retention: 30d}\n");
        let p = Policy::from_yaml(&set).expect("valid");
        assert_eq!(p.showback.retention_ms, 30 * 24 * 3_600_000);
        assert_eq!(Policy::from_yaml(&p.to_yaml()).expect("round trip"), p);
        for (bad, want) in [
            ("{retention: 10m}", "must be from 1h"),
            ("{retention: 9999d}", "must be from 1h"),
            ("{keep: 1d}", "keep"),
        ] {
            let err =
                Policy::from_yaml(&base.replace("spec:\n", &format!("spec:\n  showback: {bad}\n"))).expect_err(bad);
            assert!(err.issues.iter().any(|i| i.path.starts_with("spec.showback") && (i.message.contains(want) || i.path.contains(want))), "{bad}: {err}");
        }
    }

    #[test]
    fn scaled_decimals_are_exact() {
        assert_eq!(parse_scaled_decimal("40", 3), Ok(40_000));
        assert_eq!(parse_scaled_decimal("2.5", 2), Ok(250));
        assert_eq!(parse_scaled_decimal("33.30", 2), Ok(3_330));
        assert!(parse_scaled_decimal("33.333", 2).is_err());
        assert!(parse_scaled_decimal("1e3", 2).is_err());
        assert_eq!(parse_scaled_decimal("-1", 0), Ok(-1));
    }
}
