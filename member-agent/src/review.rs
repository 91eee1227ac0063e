//! AdmissionReview handling (`admission.k8s.io/v1`), without the HTTP server around it.
//!
//! [`review`] takes the raw request body and the agent's admission state, and returns
//! the response body: always a well-formed AdmissionReview (the request's `uid` echoed
//! whenever it could be read), never a panic, whatever the input. The decision itself is
//! the fairness core's [`decide`]; this module parses, maps the namespace to its tenant,
//! computes the pod's GPUe as Kubernetes computes pod requests, and records the effect
//! (a reservation or a queue entry) through [`AdmissionState`] in the same call, so the
//! caller can make decide-and-reserve atomic by holding one lock around it.
//!
//! Two endpoints: the **validating** one judges tenants in `reject` mode; the
//! **mutating** one judges tenants in `queue` mode and gates pods over budget with
//! `kvota.dev/admission`. Each lets the other mode's pods through untouched, so a pod is
//! judged exactly once.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::io::Write as _;
use std::sync::LazyLock;

use base64::Engine as _;
use kvota_fairness::admission::{decide, Decision, LocalView, PodRequest, Reason, Verdict, SCHEDULING_GATE};
use kvota_fairness::lease::LeaseStatus;
use kvota_fairness::names::{PodKey, TenantName};
use kvota_fairness::policy::{AdmissionMode, Policy};
use kvota_fairness::resources::{
    effective_requests_milli, total_gpue_milli, ContainerResources, PodResources, ResourceError,
};
use kvota_fairness::MilliGpue;
use serde_json::{json, Value};

mod wire;

/// Largest review body accepted. The API server caps objects near 3 MiB; a bigger body
/// is not a real AdmissionReview.
pub const MAX_REVIEW_BYTES: usize = 4 << 20;

/// The most GPUe one pod may request: a million (in thousandths). Far beyond any
/// node, and small enough that sums over a cluster's pods stay far from `u64::MAX`.
pub const MAX_POD_GPUE_MILLI: kvota_fairness::MilliGpue = 1_000_000_000;

/// Which webhook endpoint received the review.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/validate`: judges `reject`-mode tenants.
    Validate,
    /// `/mutate`: judges `queue`-mode tenants (adds the scheduling gate).
    Mutate,
}

/// A side effect of an admission, applied by the agent under the same lock as the
/// decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Hold `gpue` for the pod until it binds, is deleted, or the reservation expires.
    Reserve {
        /// Tenant.
        tenant: TenantName,
        /// `namespace/name` (or `namespace/generateName*uid` before a name exists).
        pod: PodKey,
        /// GPUe reserved.
        gpue: MilliGpue,
    },
    /// The pod waits behind the gate; release it when budget frees.
    Enqueue {
        /// Tenant.
        tenant: TenantName,
        /// Pod key as above.
        pod: PodKey,
        /// GPUe it requests.
        gpue: MilliGpue,
        /// Pod priority (`spec.priority`, 0 if unset).
        priority: i32,
    },
    /// The pod was denied: it still counts as this tenant's demand for a while, or a
    /// tenant in `reject` mode could never show the control plane it needs more.
    Denied {
        /// Tenant.
        tenant: TenantName,
        /// Pod key.
        pod: PodKey,
        /// GPUe it requested.
        gpue: MilliGpue,
    },
}

/// What the webhook needs from the agent.
pub trait AdmissionState {
    /// This cluster's id.
    fn cluster(&self) -> &str;
    /// The policy in force (from the last lease's control plane).
    fn policy(&self) -> Option<&Policy>;
    /// Labels of a namespace, from the inventory (empty if unknown).
    fn namespace_labels(&self, namespace: &str) -> BTreeMap<String, String>;
    /// The tenant's local view now: budget, in use (bound + reserved), queue, lease.
    fn view(&self, tenant: &str) -> LocalView;
    /// Records an effect (not called for dry-run requests).
    fn record(&mut self, effect: Effect);
    /// Why this agent must not admit anything right now (a standby replica, an
    /// inventory not listed yet), or None. Governed GPU pods are then held: gated in
    /// `queue` mode (the leader releases them later), denied with a retryable 503 in
    /// `reject` mode.
    fn held(&self) -> Option<String> {
        None
    }
    /// Remembers a decision (not called for dry-run requests) for `kvota explain pod`.
    fn remember(&mut self, _key: &PodKey, _pod: &PodRequest, _view: &LocalView, _decision: &Decision) {}
    /// Why pod `key` cannot be taken in now because the agent's own books are full
    /// (counted as shed), or None. Checked before a pod would be reserved or queued.
    fn at_limit(&mut self, _key: &str) -> Option<String> {
        None
    }
    /// Whether pod `key` was denied here recently (its denial still counts as demand).
    fn denied_recently(&self, _key: &str) -> bool {
        false
    }
}

/// What a review decided, for logs and metrics (label values: [`Outcome::as_str`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Admitted under the tenant's budget.
    Allowed,
    /// Refused: over budget, or a pod kvota cannot admit.
    Denied,
    /// Admitted behind kvota's scheduling gate until budget frees.
    Queued,
    /// Not judged here (no GPUs, another endpoint's tenant, a dry run).
    Passed,
    /// This agent admits nothing now (a standby, or before its first listing): gated,
    /// or denied for a retry.
    Held,
    /// Not a review the agent could read (answered 400).
    Error,
    /// Too many reviews at once (answered 429 or a retryable denial).
    Busy,
}

impl Outcome {
    /// Every outcome, in a fixed order (metrics index their counters by it).
    pub const ALL: [Outcome; 7] = [
        Outcome::Allowed,
        Outcome::Denied,
        Outcome::Queued,
        Outcome::Passed,
        Outcome::Held,
        Outcome::Error,
        Outcome::Busy,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Allowed => "allowed",
            Outcome::Denied => "denied",
            Outcome::Queued => "queued",
            Outcome::Passed => "passed",
            Outcome::Held => "held",
            Outcome::Error => "error",
            Outcome::Busy => "busy",
        }
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Outcome of one review, for logs and metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reviewed {
    /// The response body (JSON AdmissionReview).
    pub body: Vec<u8>,
    /// Tenant judged, if any.
    pub tenant: Option<TenantName>,
    /// What was decided.
    pub outcome: Outcome,
    /// GPUe the pod requests (0 if not computed).
    pub gpue: MilliGpue,
    /// A first denial for lack of budget while the control plane answers: the denial
    /// has made the agent report early, and a server may hold the answer for that report
    /// round and judge the pod once more (see [`Answer::may_wait`]).
    pub may_wait: bool,
}

/// A problem with the request itself (answered as a 400 review).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Malformed(pub String);

/// The JSON patch a gated pod gets: its scheduling gates are a new list, or ours is
/// appended to the ones it has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gate {
    /// `add /spec/schedulingGates` with a list of one: the pod had no gates.
    New,
    /// `add /spec/schedulingGates/-`: the pod has gates already.
    Append,
}

impl Gate {
    /// The patch, base64 as the response carries it; the same two every time, so
    /// written once.
    fn base64(self) -> &'static str {
        static PATCHES: LazyLock<[String; 2]> = LazyLock::new(|| {
            let b64 =
                |p: Value| base64::engine::general_purpose::STANDARD.encode(serde_json::to_vec(&p).unwrap_or_default());
            [
                b64(json!([{ "op": "add", "path": "/spec/schedulingGates", "value": [{ "name": SCHEDULING_GATE }] }])),
                b64(json!([{ "op": "add", "path": "/spec/schedulingGates/-", "value": { "name": SCHEDULING_GATE } }])),
            ]
        });
        &PATCHES[self as usize]
    }
}

/// Writes the AdmissionReview response straight into bytes: the same bytes serde_json
/// writes for the `Value` (keys in its sorted order, strings escaped by serde_json),
/// without building the `Value`.
fn response(uid: &str, allowed: bool, code: u16, message: &str, patch: Option<Gate>) -> Vec<u8> {
    // The fixed parts take about 140 bytes with a status.
    let mut out = Vec::with_capacity(192 + uid.len() + message.len() + patch.map_or(0, |p| p.base64().len()));
    out.extend_from_slice(br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{"allowed":"#);
    out.extend_from_slice(if allowed { b"true" } else { b"false" });
    if let Some(p) = patch {
        out.extend_from_slice(br#","patch":""#);
        out.extend_from_slice(p.base64().as_bytes());
        out.extend_from_slice(br#"","patchType":"JSONPatch""#);
    }
    if !message.is_empty() || !allowed {
        out.extend_from_slice(br#","status":{"code":"#);
        // Writing into a Vec cannot fail.
        let _ = write!(out, "{code}");
        out.extend_from_slice(br#","message":"#);
        json_string(&mut out, message);
        out.push(b'}');
    }
    out.extend_from_slice(br#","uid":"#);
    json_string(&mut out, uid);
    out.extend_from_slice(b"}}");
    out
}

/// Appends `s` as a JSON string, escaped as serde_json escapes it.
fn json_string(out: &mut Vec<u8>, s: &str) {
    // serde_json escapes `"`, `\` and control characters only; most messages have none.
    if wire::plain_len(s.as_bytes()) == s.len() {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        // Writing a str into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, s);
    }
}

/// A well-formed AdmissionReview that answers a request the webhook could not judge
/// (code 400, not allowed), with `why` as the message.
pub fn error_reply(uid: &str, why: &str) -> Reviewed {
    Reviewed {
        body: response(
            uid,
            false,
            400,
            &format!("kvota: malformed AdmissionReview: {why}"),
            None,
        ),
        tenant: None,
        outcome: Outcome::Error,
        gpue: 0,
        may_wait: false,
    }
}

fn pass(uid: &str, message: &str) -> Reviewed {
    Reviewed {
        body: response(uid, true, 200, message, None),
        tenant: None,
        outcome: Outcome::Passed,
        gpue: 0,
        may_wait: false,
    }
}

/// Handles one AdmissionReview body. Never panics; always returns a well-formed review.
/// The same as [`parse`], [`judge`] and [`Answer::render`]; a server calls them apart so
/// that only [`judge`] runs under the state's lock.
pub fn review(body: &[u8], endpoint: Endpoint, state: &mut dyn AdmissionState) -> Reviewed {
    judge(parse(body), endpoint, state).render()
}

/// A review judged, its response not yet written: [`judge`] decides under the agent's
/// lock, [`Answer::render`] writes the body after the lock is released.
#[derive(Debug)]
pub struct Answer(AnswerKind);

#[derive(Debug)]
enum AnswerKind {
    /// Written already (by [`parse`]).
    Written(Reviewed),
    /// A verdict to write.
    Verdict {
        uid: String,
        allowed: bool,
        code: u16,
        message: Cow<'static, str>,
        patch: Option<Gate>,
        tenant: Option<TenantName>,
        outcome: Outcome,
        gpue: MilliGpue,
        may_wait: bool,
    },
}

impl Answer {
    #[allow(clippy::too_many_arguments)]
    fn verdict(
        uid: String,
        allowed: bool,
        code: u16,
        message: impl Into<Cow<'static, str>>,
        patch: Option<Gate>,
        tenant: Option<TenantName>,
        outcome: Outcome,
        gpue: MilliGpue,
    ) -> Answer {
        Answer(AnswerKind::Verdict {
            uid,
            allowed,
            code,
            message: message.into(),
            patch,
            tenant,
            outcome,
            gpue,
            may_wait: false,
        })
    }

    /// Whether the answer is a pod's first denial for lack of budget, given while the
    /// lease is fresh (the control plane answers). Such a denial makes the agent report
    /// early, and the report's lease may well give the tenant budget here (a tenant new
    /// to a cluster has none until its demand is seen). A server may then hold the
    /// answer until a report round that started after the denial completes (about one
    /// round trip to the control plane, bounded by its own limit), and judge the same
    /// request once more: the pod is then admitted instead of denied and retried. The
    /// second judgement is never waitable (the pod counts as denied by then).
    pub fn may_wait(&self) -> bool {
        matches!(self.0, AnswerKind::Verdict { may_wait: true, .. })
    }

    fn waitable(mut self, yes: bool) -> Answer {
        if let AnswerKind::Verdict { may_wait, .. } = &mut self.0 {
            *may_wait = yes;
        }
        self
    }

    /// Allowed without being judged here.
    fn pass(uid: String, message: impl Into<Cow<'static, str>>) -> Answer {
        Answer::verdict(uid, true, 200, message, None, None, Outcome::Passed, 0)
    }

    /// Writes the response body.
    pub fn render(self) -> Reviewed {
        match self.0 {
            AnswerKind::Written(r) => r,
            AnswerKind::Verdict {
                uid,
                allowed,
                code,
                message,
                patch,
                tenant,
                outcome,
                gpue,
                may_wait,
            } => Reviewed {
                body: response(&uid, allowed, code, &message, patch),
                tenant,
                outcome,
                gpue,
                may_wait,
            },
        }
    }
}

/// A review read and checked, not yet judged.
#[derive(Debug, PartialEq)]
pub struct Parsed(ParsedKind);

#[derive(Debug, PartialEq)]
enum ParsedKind {
    /// Answered without the agent's state (malformed, not a pod, subresource, update).
    Done(Reviewed),
    /// A pod is being deleted (answered without a change: pod lifecycle comes from the
    /// inventory's watch).
    Delete { uid: String },
    /// A pod is being created.
    Create(Box<Create>),
}

#[derive(Debug, PartialEq)]
struct Create {
    uid: String,
    namespace: String,
    name: String,
    /// `None`: the pod's name (or its `generateName` and the review's uid) makes no key
    /// (see [`pod_key`]).
    key: Option<PodKey>,
    dry_run: bool,
    pod: PodRequests,
    priority: i32,
    has_gates: bool,
}

/// A created pod's requests: as read from the spec, then counted by [`parse`] (the fast
/// path counts them as it reads).
#[derive(Debug, PartialEq)]
enum PodRequests {
    /// The containers' and overhead's quantities, as written.
    Read(PodResources),
    /// Their [`effective_requests_milli`], sorted by resource name (or why they could
    /// not be counted).
    Counted(Result<Vec<(String, u64)>, ResourceError>),
}

impl PodRequests {
    fn counted(self) -> Result<Vec<(String, u64)>, ResourceError> {
        match self {
            PodRequests::Read(pod) => effective_requests_milli(&pod).map(|m| m.into_iter().collect()),
            PodRequests::Counted(r) => r,
        }
    }
}

/// Reads and checks a review body: everything that needs no agent state (JSON parsing,
/// shape checks, counting the pod's requests). Cheap to call outside any lock.
///
/// Reads only the fields it needs, borrowing from `body` ([`wire`]); a body that does
/// not have the usual shape (or is malformed) is read again through a
/// `serde_json::Value` ([`read_value`], the reference), which words every error.
pub fn parse(body: &[u8]) -> Parsed {
    let read = if body.len() > MAX_REVIEW_BYTES {
        None
    } else {
        wire::read(body)
    };
    counted(read.unwrap_or_else(|| read_value(body)))
}

/// Counts a created pod's requests ([`effective_requests_milli`]): the quantity parsing
/// and per-resource sums need no agent state, so they happen here rather than under the
/// lock; the policy's weights are applied in [`judge`].
fn counted(mut kind: ParsedKind) -> Parsed {
    if let ParsedKind::Create(c) = &mut kind {
        let pod = std::mem::replace(&mut c.pod, PodRequests::Counted(Ok(Vec::new())));
        c.pod = PodRequests::Counted(pod.counted());
    }
    Parsed(kind)
}

/// Reads a review through a `serde_json::Value`: the reference the fast path ([`wire`])
/// is held to, and the path for every body the fast path does not take.
fn read_value(body: &[u8]) -> ParsedKind {
    if body.len() > MAX_REVIEW_BYTES {
        return ParsedKind::Done(error_reply(
            "",
            &format!("body of {} bytes exceeds {MAX_REVIEW_BYTES}", body.len()),
        ));
    }
    let doc: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return ParsedKind::Done(error_reply("", &format!("not JSON: {e}"))),
    };
    let uid = doc
        .pointer("/request/uid")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    match parse_doc(&doc, &uid) {
        Ok(p) => p,
        Err(Malformed(why)) => ParsedKind::Done(error_reply(&uid, &why)),
    }
}

fn parse_doc(doc: &Value, uid: &str) -> Result<ParsedKind, Malformed> {
    let api = doc.get("apiVersion").and_then(Value::as_str).unwrap_or_default();
    let kind = doc.get("kind").and_then(Value::as_str).unwrap_or_default();
    if api != "admission.k8s.io/v1" || kind != "AdmissionReview" {
        return Err(Malformed(format!(
            "expected apiVersion admission.k8s.io/v1 and kind AdmissionReview, got `{api}` `{kind}`"
        )));
    }
    let req = doc.get("request").ok_or_else(|| Malformed("no `request`".into()))?;
    if uid.is_empty() {
        return Err(Malformed("request.uid is missing".into()));
    }
    // Only pods are judged; the webhook configuration should route nothing else here.
    let res = req
        .pointer("/resource/resource")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let group = req
        .pointer("/resource/group")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if res != "pods" || !group.is_empty() {
        return Ok(ParsedKind::Done(pass(
            uid,
            &format!("kvota: {group}/{res} is not judged (only pods)"),
        )));
    }
    if req
        .get("subResource")
        .and_then(Value::as_str)
        .is_some_and(|s| !s.is_empty())
    {
        return Ok(ParsedKind::Done(pass(uid, "kvota: pod subresources are not judged")));
    }
    let namespace = req
        .get("namespace")
        .and_then(Value::as_str)
        .or_else(|| req.pointer("/object/metadata/namespace").and_then(Value::as_str))
        .unwrap_or_default()
        .to_string();
    let name = req
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .or_else(|| req.pointer("/object/metadata/name").and_then(Value::as_str))
        .unwrap_or_default()
        .to_string();
    let dry_run = req.get("dryRun").and_then(Value::as_bool).unwrap_or(false);
    match req.get("operation").and_then(Value::as_str).unwrap_or_default() {
        "CREATE" => {}
        "DELETE" => return Ok(ParsedKind::Delete { uid: uid.to_string() }),
        // Pod resource requests are immutable (and scheduling gates can only be
        // removed), so an update cannot take a tenant over budget.
        "UPDATE" | "CONNECT" => return Ok(ParsedKind::Done(pass(uid, ""))),
        other => return Err(Malformed(format!("unknown operation `{other}`"))),
    }
    let object = req
        .get("object")
        .ok_or_else(|| Malformed("CREATE without `object`".into()))?;
    let prefix = object
        .pointer("/metadata/generateName")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let key = pod_key(&namespace, &name, prefix, uid);
    let pod = PodRequests::Read(pod_resources(object)?);
    let priority = object
        .pointer("/spec/priority")
        .and_then(Value::as_i64)
        .and_then(|p| i32::try_from(p).ok())
        .unwrap_or(0);
    let has_gates = object.pointer("/spec/schedulingGates").is_some_and(Value::is_array);
    Ok(ParsedKind::Create(Box::new(Create {
        uid: uid.to_string(),
        namespace,
        name,
        key,
        dry_run,
        pod,
        priority,
        has_gates,
    })))
}

/// The key of the pod a CREATE review is about: `namespace/name`, or, before the API
/// server has named it (`generateName`), the provisional `namespace/prefix*uid`. `None`
/// for a name Kubernetes does not accept: mutating admission runs before the API server
/// validates the object, which then refuses the pod with its own clear message, so such
/// a review is passed unjudged ([`judge`]), not answered as an error.
fn pod_key(namespace: &str, name: &str, prefix: &str, uid: &str) -> Option<PodKey> {
    let key = if name.is_empty() {
        PodKey::provisional(namespace, prefix, uid)
    } else {
        PodKey::new(namespace, name)
    };
    key.ok()
}

/// Judges a parsed review against the agent's state and records its effect (a
/// reservation, a queue entry, a denial, a deletion) in the same call: hold the state's
/// lock around this call, and only this one. The answer's body is written by
/// [`Answer::render`], after the lock is released.
pub fn judge(parsed: Parsed, endpoint: Endpoint, state: &mut dyn AdmissionState) -> Answer {
    let c = match parsed.0 {
        ParsedKind::Done(r) => return Answer(AnswerKind::Written(r)),
        // Pod lifecycle comes from the inventory's watch, never from a review: a DELETE
        // review (the webhook is not registered for them; anyone could send one) changes
        // nothing, or a forged one could drop a running pod's accounting.
        ParsedKind::Delete { uid, .. } => return Answer::pass(uid, ""),
        ParsedKind::Create(c) => *c,
    };
    let Create {
        uid,
        namespace,
        name,
        key,
        dry_run,
        pod,
        priority,
        has_gates,
    } = c;
    let Some(policy) = state.policy() else {
        // No policy yet: the agent enforces its (zero) budgets through `view`; without a
        // policy there are no tenants, so nothing is governed.
        return Answer::pass(uid, "kvota: no policy received yet; not judged");
    };
    let shown = shown_pod(&namespace, &name);
    let gpue = match pod_gpue(pod, policy, &uid, &shown) {
        Ok(gpue) => gpue,
        Err(answer) => return answer,
    };
    let (tenant, mode) = match governing_tenant(state, endpoint, &uid, &namespace, &name, gpue) {
        Ok(t) => t,
        Err(answer) => return answer,
    };
    let Some(key) = key else {
        // A governed GPU pod kvota cannot account for. The API server would refuse its
        // name after admission; should something rename it first (a later mutating
        // webhook), it must not be let in unjudged.
        let msg = format!(
            "kvota: pod {shown} has a name Kubernetes does not accept (pod names: {}); refused",
            kvota_fairness::names::POD_KEY_RULE
        );
        return Answer::verdict(uid, false, 403, msg, None, Some(tenant), Outcome::Denied, gpue);
    };
    let gate = if has_gates { Gate::Append } else { Gate::New };
    let j = Governed {
        uid,
        tenant,
        key,
        gate,
        dry_run,
        priority,
        gpue,
    };
    if let Some(why) = state.held() {
        return j.held(mode, &why);
    }
    if !dry_run {
        if let Some(why) = state.at_limit(&j.key) {
            let msg = format!("kvota: {why}; pod {} was not judged, retry later", j.key);
            return Answer::verdict(j.uid, false, 503, msg, None, Some(j.tenant), Outcome::Busy, gpue);
        }
    }
    let view = state.view(&j.tenant);
    let req = PodRequest { namespace, name, gpue };
    let d: Decision = decide(&req, &view);
    if !dry_run {
        state.remember(&j.key, &req, &view, &d);
    }
    j.settle(d, &view, state)
}

/// The pod as messages name it (each part cut to 80 characters).
fn shown_pod(namespace: &str, name: &str) -> String {
    let cut = |s: &str| s.chars().take(80).collect::<String>();
    if name.is_empty() {
        format!("in namespace `{}` with a generated name", cut(namespace))
    } else {
        format!("{}/{}", cut(namespace), cut(name))
    }
}

/// The pod's GPUe under the policy's resource weights, or the answer refusing it (its
/// resources cannot be counted, or it asks for more than one pod may hold).
fn pod_gpue(pod: PodRequests, policy: &Policy, uid: &str, shown: &str) -> Result<MilliGpue, Answer> {
    let gpue = match pod.counted() {
        Ok(r) => total_gpue_milli(
            r.iter().map(|(name, milli)| (name.as_str(), *milli)),
            &policy.resource_weights,
        ),
        // Rare (Kubernetes validates quantities first): written here, under the lock.
        Err(e) => {
            return Err(Answer(AnswerKind::Written(error_reply(
                uid,
                &format!("pod resources: {e}"),
            ))))
        }
    };
    if gpue > MAX_POD_GPUE_MILLI {
        let msg = format!(
            "kvota: pod {shown} requests {} GPUe; kvota accounts for at most {} GPUe in one pod",
            kvota_fairness::units::format_gpue(gpue),
            kvota_fairness::units::format_gpue(MAX_POD_GPUE_MILLI)
        );
        return Err(Answer::verdict(
            uid.to_owned(),
            false,
            403,
            msg,
            None,
            None,
            Outcome::Denied,
            gpue,
        ));
    }
    Ok(gpue)
}

/// The tenant that governs the pod's namespace and its admission mode, or the passing
/// answer when this endpoint does not judge it (no tenant, the other mode's tenant, no
/// GPUs).
fn governing_tenant(
    state: &dyn AdmissionState,
    endpoint: Endpoint,
    uid: &str,
    namespace: &str,
    name: &str,
    gpue: MilliGpue,
) -> Result<(TenantName, AdmissionMode), Answer> {
    let labels = state.namespace_labels(namespace);
    let tenant = state
        .policy()
        .and_then(|policy| policy.tenant_for_namespace(namespace, &labels))
        .map(|t| (t.name.clone(), t.admission));
    let Some((tenant, mode)) = tenant else {
        let v = LocalView {
            tenant: None,
            ..state.view("")
        };
        let req = PodRequest {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            gpue,
        };
        let d = decide(&req, &v);
        return Err(Answer::verdict(
            uid.to_owned(),
            true,
            200,
            d.message,
            None,
            None,
            Outcome::Passed,
            gpue,
        ));
    };
    // Each endpoint judges only its mode's tenants.
    let mine = matches!(
        (endpoint, mode),
        (Endpoint::Validate, AdmissionMode::Reject) | (Endpoint::Mutate, AdmissionMode::Queue)
    );
    if !mine || gpue == 0 {
        let msg = if gpue == 0 {
            "kvota: pod requests no GPUs; not judged"
        } else {
            ""
        };
        return Err(Answer::verdict(
            uid.to_owned(),
            true,
            200,
            msg,
            None,
            Some(tenant),
            Outcome::Passed,
            gpue,
        ));
    }
    Ok((tenant, mode))
}

/// A governed GPU pod with a key, on its way to a verdict.
struct Governed {
    uid: String,
    tenant: TenantName,
    key: PodKey,
    gate: Gate,
    dry_run: bool,
    priority: i32,
    gpue: MilliGpue,
}

impl Governed {
    /// The answer while the agent holds admissions (`why`): a queued pod waits behind
    /// its gate, a rejecting tenant's pod is told to retry.
    fn held(self, mode: AdmissionMode, why: &str) -> Answer {
        let Governed {
            uid,
            tenant,
            key,
            gate,
            gpue,
            ..
        } = self;
        match mode {
            AdmissionMode::Queue => {
                let msg = format!(
                    "kvota: {why}; pod {key} waits behind the {SCHEDULING_GATE} gate for the leader to release it"
                );
                Answer::verdict(uid, true, 200, msg, Some(gate), Some(tenant), Outcome::Held, gpue)
            }
            AdmissionMode::Reject => {
                let msg = format!("kvota: {why}; pod {key} was not judged, retry in a few seconds");
                Answer::verdict(uid, false, 503, msg, None, Some(tenant), Outcome::Held, gpue)
            }
        }
    }

    /// Records the decision's effect (unless a dry run) and writes its answer.
    fn settle(self, d: Decision, view: &LocalView, state: &mut dyn AdmissionState) -> Answer {
        let Governed {
            uid,
            tenant,
            key,
            gate,
            dry_run,
            priority,
            gpue,
        } = self;
        match d.verdict {
            Verdict::Allow => {
                if !dry_run {
                    state.record(Effect::Reserve {
                        tenant: tenant.clone(),
                        pod: key,
                        gpue,
                    });
                }
                Answer::verdict(uid, true, 200, d.message, None, Some(tenant), Outcome::Allowed, gpue)
            }
            Verdict::Deny => {
                let waitable = !dry_run
                    && d.reason == Reason::OverBudget
                    && matches!(view.lease, LeaseStatus::Fresh { .. })
                    && !state.denied_recently(&key);
                // A pod that can never fit here is not demand: counting it would raise the
                // tenant's entitlement and size its budgets for GPUs it can never use.
                if !dry_run && d.reason != Reason::NeverFits {
                    state.record(Effect::Denied {
                        tenant: tenant.clone(),
                        pod: key,
                        gpue,
                    });
                }
                Answer::verdict(uid, false, 403, d.message, None, Some(tenant), Outcome::Denied, gpue)
                    .waitable(waitable)
            }
            Verdict::Queue => {
                if !dry_run {
                    state.record(Effect::Enqueue {
                        tenant: tenant.clone(),
                        pod: key,
                        gpue,
                        priority,
                    });
                }
                Answer::verdict(
                    uid,
                    true,
                    200,
                    d.message,
                    Some(gate),
                    Some(tenant),
                    Outcome::Queued,
                    gpue,
                )
            }
        }
    }
}

fn quantity_map(v: Option<&Value>, path: &str) -> Result<BTreeMap<String, String>, Malformed> {
    let mut out = BTreeMap::new();
    let Some(v) = v else { return Ok(out) };
    let m = v.as_object().ok_or_else(|| Malformed(format!("{path} is not a map")))?;
    for (k, q) in m {
        let s = match q {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            _ => return Err(Malformed(format!("{path}[{k}] is not a quantity"))),
        };
        out.insert(k.clone(), s);
    }
    Ok(out)
}

fn containers(spec: &Value, field: &str) -> Result<Vec<ContainerResources>, Malformed> {
    let Some(list) = spec.get(field) else {
        return Ok(Vec::new());
    };
    let list = list
        .as_array()
        .ok_or_else(|| Malformed(format!("spec.{field} is not a list")))?;
    list.iter()
        .enumerate()
        .map(|(i, c)| {
            let path = format!("spec.{field}[{i}]");
            let res = c.get("resources");
            Ok(ContainerResources {
                name: c.get("name").and_then(Value::as_str).unwrap_or_default().to_string(),
                requests: quantity_map(
                    res.and_then(|r| r.get("requests")),
                    &format!("{path}.resources.requests"),
                )?,
                limits: quantity_map(res.and_then(|r| r.get("limits")), &format!("{path}.resources.limits"))?,
                restartable: c.get("restartPolicy").and_then(Value::as_str) == Some("Always"),
            })
        })
        .collect()
}

/// A pod's resources as the core models them, from the pod object's JSON.
pub fn pod_resources(object: &Value) -> Result<PodResources, Malformed> {
    let spec = object.get("spec").ok_or_else(|| Malformed("pod has no spec".into()))?;
    Ok(PodResources {
        init_containers: containers(spec, "initContainers")?,
        containers: containers(spec, "containers")?,
        overhead: quantity_map(spec.get("overhead"), "spec.overhead")?,
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The response as it was written before [`response`] wrote bytes directly: through
    /// a `Value`. The reference for [`response`].
    fn response_value(uid: &str, allowed: bool, code: u16, message: &str, patch: Option<&Value>) -> Vec<u8> {
        let mut resp = json!({ "uid": uid, "allowed": allowed });
        if !message.is_empty() || !allowed {
            resp["status"] = json!({ "code": code, "message": message });
        }
        if let Some(p) = patch {
            let bytes = serde_json::to_vec(p).unwrap_or_default();
            resp["patchType"] = json!("JSONPatch");
            resp["patch"] = json!(base64::engine::general_purpose::STANDARD.encode(bytes));
        }
        let review = json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": resp,
        });
        serde_json::to_vec(&review).unwrap_or_default()
    }

    fn patch_value(gate: Gate) -> Value {
        match gate {
            Gate::New => {
                json!([{ "op": "add", "path": "/spec/schedulingGates", "value": [{ "name": SCHEDULING_GATE }] }])
            }
            Gate::Append => {
                json!([{ "op": "add", "path": "/spec/schedulingGates/-", "value": { "name": SCHEDULING_GATE } }])
            }
        }
    }

    #[test]
    fn responses_are_the_bytes_serde_json_wrote() {
        for (uid, allowed, code, message, gate) in [
            ("u1", true, 200, "", None),
            ("u1", false, 400, "", None),
            (
                "",
                false,
                400,
                "kvota: malformed AdmissionReview: not JSON: expected value at line 1 column 1",
                None,
            ),
            (
                "705ab4f5",
                true,
                200,
                "kvota: admitted: tenant `training` holds 0 + 1 = 1 of its 32 GPUe budget",
                None,
            ),
            (
                "q",
                true,
                200,
                "queued \"behind\" the gate\n\u{1}\u{7f}\u{e9}\u{2028}",
                Some(Gate::New),
            ),
            ("q", true, 200, "", Some(Gate::Append)),
        ] {
            assert_eq!(
                String::from_utf8(response(uid, allowed, code, message, gate)).expect("utf8"),
                String::from_utf8(response_value(
                    uid,
                    allowed,
                    code,
                    message,
                    gate.map(patch_value).as_ref()
                ))
                .expect("utf8"),
            );
        }
    }

    proptest! {
        #[test]
        fn responses_match_for_any_text(
            uid in any::<String>(), message in any::<String>(), allowed in any::<bool>(), code in any::<u16>(),
            gate in prop::option::of(prop_oneof![Just(Gate::New), Just(Gate::Append)]),
        ) {
            prop_assert_eq!(
                response(&uid, allowed, code, &message, gate),
                response_value(&uid, allowed, code, &message, gate.map(patch_value).as_ref())
            );
        }
    }
}
