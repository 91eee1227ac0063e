//! The admission decision, pure: what the webhook (and the simulated cluster) asks.
//!
//! The webhook parses an AdmissionReview, computes the pod's GPUe
//! ([`crate::resources::pod_gpue`]), builds a [`LocalView`] from the agent's state and
//! calls [`decide`]; then it writes the response. Everything that decides lives here.

use serde::{Deserialize, Serialize};

use crate::lease::LeaseStatus;
use crate::names::{ClusterName, PodKey, TenantName};
use crate::policy::AdmissionMode;
use crate::units::Gpue;
use crate::MilliGpue;

/// GPUe as messages write them ([`format_gpue`](crate::units::format_gpue)'s text).
fn g(milli: MilliGpue) -> Gpue {
    Gpue(milli)
}

/// The scheduling gate kvota adds to pods it queues.
pub const SCHEDULING_GATE: &str = "kvota.dev/admission";

/// The pod being judged.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodRequest {
    /// Namespace.
    pub namespace: String,
    /// Pod name (or `generateName` prefix, or empty when the API server has not named it).
    pub name: String,
    /// GPUe the pod requests, as Kubernetes computes pod requests.
    pub gpue: MilliGpue,
}

/// The agent's local view of the pod's tenant in this cluster.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalView {
    /// This cluster's id.
    pub cluster: ClusterName,
    /// The tenant owning the namespace; `None`: kvota does not govern it.
    pub tenant: Option<TenantName>,
    /// What the tenant's pods over budget get.
    pub mode: AdmissionMode,
    /// Queue bound (per tenant, this cluster).
    pub max_queued: u32,
    /// Budget enforced now (lease budget, or fallback after expiry).
    pub budget: MilliGpue,
    /// Bound plus reserved GPUe of the tenant here.
    pub inuse: MilliGpue,
    /// Pods of the tenant waiting behind the gate here.
    pub queued: u32,
    /// Federation-wide committed entitlement from the lease (informational).
    pub entitlement: MilliGpue,
    /// Most the tenant could ever hold here (e.g. cluster capacity); a pod larger than
    /// this can never be admitted, so it is not queued. `None`: unknown.
    pub ceiling: Option<MilliGpue>,
    /// Lease standing (for the message).
    pub lease: LeaseStatus,
    /// GPUe the tenant may add here beyond its budget now as borrowed capacity (see
    /// [`borrow_room`]); 0: no borrowing. Absent from older encodings: 0.
    #[serde(default)]
    pub borrow: MilliGpue,
}

/// The outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verdict {
    /// Admit now (and reserve its GPUe until it binds).
    Allow,
    /// Admit behind the scheduling gate; released when budget frees.
    Queue,
    /// Refuse.
    Deny,
}

impl Verdict {
    /// Its word on the wire: `allow`, `queue`, `deny`.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Allow => "allow",
            Verdict::Queue => "queue",
            Verdict::Deny => "deny",
        }
    }

    /// The verdict named by `word`, if any.
    pub fn parse(word: &str) -> Option<Verdict> {
        [Verdict::Allow, Verdict::Queue, Verdict::Deny]
            .into_iter()
            .find(|v| v.as_str() == word)
    }
}

/// Why, in one word.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reason {
    /// The pod requests no GPU resources.
    NoGpu,
    /// The namespace belongs to no tenant and there is no default tenant.
    Ungoverned,
    /// The pod fits in the tenant's budget.
    WithinBudget,
    /// Over budget.
    OverBudget,
    /// Over budget and the tenant's queue is full.
    QueueFull,
    /// Larger than the tenant could ever hold here.
    NeverFits,
    /// Over budget, admitted into idle GPUs lent to the tenant (evicted first when a
    /// tenant within its budget needs the room).
    Borrowed,
}

/// A decision with the numbers behind it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// Allow, queue or deny.
    pub verdict: Verdict,
    /// Why.
    pub reason: Reason,
    /// A message a person can act on (goes into the AdmissionReview status).
    pub message: String,
    /// Tenant's GPUe here if the pod were admitted now.
    pub after: MilliGpue,
}

/// The verdict of [`decide`] and its reason, without the message: what a caller that
/// only acts on the outcome (the simulator, pod after pod) needs, at none of the cost of
/// writing sentences. `decide` renders its message from exactly this.
pub fn judge(pod: &PodRequest, view: &LocalView) -> (Verdict, Reason) {
    if pod.gpue == 0 {
        return (Verdict::Allow, Reason::NoGpu);
    }
    if view.tenant.is_none() {
        return (Verdict::Allow, Reason::Ungoverned);
    }
    if view.inuse.saturating_add(pod.gpue) <= view.budget {
        return (Verdict::Allow, Reason::WithinBudget);
    }
    if view.ceiling.is_some_and(|ceiling| pod.gpue > ceiling) {
        return (Verdict::Deny, Reason::NeverFits);
    }
    // Never past the tenant's own pods waiting behind the gate (they are released
    // within its budget, in order).
    if pod.gpue <= view.borrow && view.queued == 0 {
        return (Verdict::Allow, Reason::Borrowed);
    }
    match view.mode {
        AdmissionMode::Reject => (Verdict::Deny, Reason::OverBudget),
        AdmissionMode::Queue if view.queued >= view.max_queued => (Verdict::Deny, Reason::QueueFull),
        AdmissionMode::Queue => (Verdict::Queue, Reason::OverBudget),
    }
}

/// Decides one pod. Pure and total: any input gives a decision.
///
/// Holds: a pod with GPUe is allowed only if `inuse + gpue <= budget`; pods without
/// GPUe and pods of ungoverned namespaces are always allowed; in `queue` mode the
/// queue never grows past `max_queued`.
pub fn decide(pod: &PodRequest, view: &LocalView) -> Decision {
    let (verdict, reason) = judge(pod, view);
    let after = view.inuse.saturating_add(pod.gpue);
    let message = decision_message(pod, view, verdict, reason, after);
    // A pod without GPUs adds nothing.
    let after = if reason == Reason::NoGpu { view.inuse } else { after };
    Decision {
        verdict,
        reason,
        message,
        after,
    }
}

/// What the answer to the pod says: the verdict, why, and the numbers behind it
/// (`after`: what the tenant would hold with the pod).
fn decision_message(pod: &PodRequest, view: &LocalView, verdict: Verdict, reason: Reason, after: MilliGpue) -> String {
    let target = pod_ref(pod);
    let tenant = view.tenant.as_deref().unwrap_or_default();
    let numbers = || {
        format!(
            "tenant `{tenant}` would hold {} GPUe in cluster `{}` (in use {} + this pod {}), above its budget of {} GPUe here (federation-wide entitlement {} GPUe; lease {})",
            g(after),
            view.cluster,
            g(view.inuse),
            g(pod.gpue),
            g(view.budget),
            g(view.entitlement),
            view.lease
        )
    };
    match (reason, verdict) {
        (Reason::NoGpu, _) => "kvota: pod requests no GPUs; not judged".to_string(),
        (Reason::Ungoverned, _) => format!(
            "kvota: namespace `{}` belongs to no tenant and the policy has no defaultTenant; not judged",
            pod.namespace
        ),
        (Reason::WithinBudget, _) => format!(
            "kvota: admitted: tenant `{tenant}` holds {} + {} = {} of its {} GPUe budget in cluster `{}`",
            g(view.inuse),
            g(pod.gpue),
            g(after),
            g(view.budget),
            view.cluster
        ),
        (Reason::Borrowed, _) => format!(
            "kvota: admitted on borrowed GPUs: tenant `{tenant}` holds {} + {} = {} GPUe in cluster `{}`, above its budget of {} GPUe, on GPUs no budget here needs now (borrowable {} GPUe); a tenant within its budget may take them back by evicting this pod",
            g(view.inuse),
            g(pod.gpue),
            g(after),
            view.cluster,
            g(view.budget),
            g(view.borrow)
        ),
        (Reason::NeverFits, _) => format!(
            "kvota: denied: the pod requests {} GPUe but tenant `{tenant}` can never hold more than {} GPUe in cluster `{}` (the cluster's capacity or the tenant's maxShare of the federation, whichever is less). Request fewer GPUs, use a larger cluster, or ask for a larger maxShare. Details: kvota explain pod {target}",
            g(pod.gpue),
            g(view.ceiling.unwrap_or_default()),
            view.cluster
        ),
        (Reason::OverBudget, Verdict::Queue) => format!(
            "kvota: queued behind scheduling gate {SCHEDULING_GATE}: {}. It starts when budget frees (position {} in the tenant's queue). Details: kvota explain pod {target}",
            numbers(),
            view.queued + 1
        ),
        (Reason::QueueFull, _) => format!(
            "kvota: denied: {}, and {} of its pods already wait for budget here (maxQueued {}). Retry later. Details: kvota explain pod {target}",
            numbers(),
            view.queued,
            view.max_queued
        ),
        (Reason::OverBudget, _) => format!(
            "kvota: denied: {}. Retry when the tenant's running pods finish, or ask the platform team for a larger share. Details: kvota explain pod {target}",
            numbers()
        ),
    }
}

/// GPUe of a cluster that no budget needs now, so they may be lent: capacity minus, for
/// every tenant, what it holds plus the part of its waiting demand its budget covers
/// (`inuse + min(pending, budget - inuse)`). A tenant's unused budget is lendable while
/// nothing of it waits; the room a waiting pod within its budget needs is not, even when
/// it is smaller than any of its pods (lending such slivers too was measured: it lent
/// more and lost utilization on the Philly trace, docs/policy-comparison.md). Each item
/// of `tenants` is `(inuse, pending, budget)` of one tenant in this cluster.
pub fn lendable(
    capacity: MilliGpue,
    tenants: impl IntoIterator<Item = (MilliGpue, MilliGpue, MilliGpue)>,
) -> MilliGpue {
    let claimed = tenants.into_iter().fold(0u64, |sum, (inuse, pending, budget)| {
        sum.saturating_add(inuse.saturating_add(pending.min(budget.saturating_sub(inuse))))
    });
    capacity.saturating_sub(claimed)
}

/// What a tenant may add beyond its budget now as borrowed capacity: at most the
/// cluster's `lendable` GPUe, and never past `budget + limit` (the lease's borrow
/// limit, [`crate::lease::TenantBudget::borrow`]), which keeps budgets plus borrowing
/// within the tenant's maxShare of the federation. 0 when `limit` is 0.
///
/// What borrowing may and may not do, also during a partition: it admits only into GPUs
/// no budget of this cluster needs now; the admitted pods count as the tenant's in-use
/// (reported, charged to its decayed usage, throttling its budgets like any usage above
/// entitlement); they are the first victims of reclaim when a tenant with a pod within
/// its budget finds no room. It never admits a non-preemptible tenant's pod (its limit is
/// 0), never takes anyone's budget or guarantee, and a cut-off cluster lends only its
/// own idle GPUs under the limits of the last lease it holds.
pub fn borrow_room(limit: MilliGpue, budget: MilliGpue, inuse: MilliGpue, lendable: MilliGpue) -> MilliGpue {
    if limit == 0 {
        return 0;
    }
    if crate::faults::on(|f| f.borrow_past_limit) {
        return lendable;
    }
    lendable.min(budget.saturating_add(limit).saturating_sub(inuse))
}

/// Whether a cluster whose lease stands at `lease` lends now under the policy's
/// `reclaim`: lending on (and reclaim, which takes lent GPUs back), and either
/// `lendWhen: always` or the lease expired (`cutOff`: the agent enforces fallback
/// budgets, so the control plane cannot move idle GPUs to where pods wait). A cluster
/// that does not lend gives every tenant a borrow room of 0; pods it lent before stay
/// borrowed, first in line for reclaim.
pub fn lends_now(reclaim: &crate::policy::ReclaimConfig, lease: LeaseStatus) -> bool {
    reclaim.enabled
        && reclaim.lend_idle
        && match reclaim.lend_when {
            crate::policy::LendWhen::Always => true,
            crate::policy::LendWhen::CutOff => lease == LeaseStatus::Safe,
        }
}

fn pod_ref(pod: &PodRequest) -> String {
    if pod.name.is_empty() {
        format!("{}/<unnamed>", pod.namespace)
    } else {
        format!("{}/{}", pod.namespace, pod.name)
    }
}

/// A pod waiting behind the gate.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueuedPod {
    /// Namespace/name.
    pub key: PodKey,
    /// Pod priority (higher first).
    pub priority: i32,
    /// When it was queued (any monotonic clock).
    pub queued_at_ms: u64,
    /// GPUe it requests.
    pub gpue: MilliGpue,
}

/// Which queued pods to release now, in order: by priority (highest first), then age
/// (oldest first), then key; each released only if it fits in what is left of
/// `budget - inuse`. A pod that does not fit blocks those behind it of equal or lower
/// priority only if `strict` (no overtaking); otherwise smaller pods may pass it.
pub fn release_order(queue: &[QueuedPod], budget: MilliGpue, inuse: MilliGpue, strict: bool) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..queue.len()).collect();
    idx.sort_by(|&a, &b| {
        let (x, y) = (&queue[a], &queue[b]);
        y.priority
            .cmp(&x.priority)
            .then(x.queued_at_ms.cmp(&y.queued_at_ms))
            .then(x.key.cmp(&y.key))
    });
    let mut free = budget.saturating_sub(inuse);
    let mut out = Vec::new();
    for i in idx {
        if queue[i].gpue <= free {
            free -= queue[i].gpue;
            out.push(i);
        } else if strict {
            break;
        }
    }
    out
}

/// How much of its budget a tenant uses, in millionths (more than a million when it
/// holds more than its budget; `u64::MAX` for a budget of 0).
pub fn budget_use_ppm(inuse: MilliGpue, budget: MilliGpue) -> u64 {
    if budget == 0 {
        return u64::MAX;
    }
    u64::try_from(u128::from(inuse) * 1_000_000 / u128::from(budget)).unwrap_or(u64::MAX)
}

/// Whether a tenant is *urgent* in a cluster of `capacity` ([`release_rank`]):
/// non-preemptible and using less than its guarantee there, `min(inuse + pending,
/// minShare x capacity)`.
pub fn urgent(preemptible: bool, min_share_bp: u32, capacity: MilliGpue, inuse: MilliGpue, pending: MilliGpue) -> bool {
    let guarantee = inuse
        .saturating_add(pending)
        .min(crate::entitlement::share_of(capacity, min_share_bp));
    !preemptible && inuse < guarantee
}

/// A tenant's place in line for GPUs that free in a cluster whose budgets let more
/// start than it has free (lower first; [`share_room`], and the simulator's pass).
///
/// 1. `urgent` tenants (non-preemptible, below their guarantee here), furthest under
///    budget first;
/// 2. non-preemptible tenants with no guarantee (`minShare` 0) below their budget, the
///    one using the smallest fraction of it first, as max-min fair sharing serves the
///    tenant furthest below its share: nothing lifts them (no guarantee), they may not
///    borrow, and their pods are never evicted, so the room they wait for comes only
///    from GPUs that free. Ranked by the amount under budget, a large service with 50
///    GPUs left of 350 took every freed GPU before a small one with 3 left of 3, and the
///    median service waited hours where max-min sharing serves it in minutes;
/// 3. everyone else, furthest under budget first (reclaim makes room for a preemptible
///    tenant's pod within its budget). Ranking these by fraction too, or every
///    non-preemptible tenant, made other runs of the simulator's comparison worse
///    (`docs/policy-comparison.md`).
pub fn release_rank(
    urgent: bool,
    preemptible: bool,
    min_share_bp: u32,
    inuse: MilliGpue,
    budget: MilliGpue,
) -> (u8, i128) {
    let deficit = i128::from(inuse) - i128::from(budget);
    if urgent {
        (0, deficit)
    } else if !preemptible && min_share_bp == 0 && inuse < budget {
        (1, i128::from(budget_use_ppm(inuse, budget)))
    } else {
        (2, deficit)
    }
}

/// One tenant's claim on the room free in a cluster, for [`share_room`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RoomClaim {
    /// Whether the tenant is non-preemptible and below its guarantee here when the
    /// round starts ([`release_rank`]).
    pub urgent: bool,
    /// Whether the tenant is preemptible.
    pub preemptible: bool,
    /// Its guarantee, basis points of the cluster.
    pub min_share_bp: u32,
    /// What it uses in the cluster (bound plus reserved).
    pub inuse: MilliGpue,
    /// Its budget in the cluster.
    pub budget: MilliGpue,
    /// Its pods that fit its budget now, in its own release order ([`release_order`]).
    pub pods: Vec<MilliGpue>,
}

/// Shares `room` (GPUe free in the cluster) among the claims: over and over, the tenant
/// first in line ([`release_rank`], counting what it was given here; ties to the lower
/// index) gets its next pod, if the pod fits what is left
/// of the room; a tenant whose next pod does not fit gets nothing more. Returns
/// `(claim, pod)` pairs in the order given. Each claim gets a prefix of its pods, the
/// pods given add up to at most `room`, and when every pod fits, every pod is given.
/// Cost `O(P log T)`.
pub fn share_room(claims: &[RoomClaim], room: MilliGpue) -> Vec<(usize, usize)> {
    use std::cmp::Reverse;
    let rank = |c: &RoomClaim, given: MilliGpue| {
        release_rank(
            c.urgent,
            c.preemptible,
            c.min_share_bp,
            c.inuse.saturating_add(given),
            c.budget,
        )
    };
    let mut heap: std::collections::BinaryHeap<Reverse<((u8, i128), usize)>> = claims
        .iter()
        .enumerate()
        .filter(|(_, c)| !c.pods.is_empty())
        .map(|(i, c)| Reverse((rank(c, 0), i)))
        .collect();
    let mut given = vec![(0usize, 0 as MilliGpue); claims.len()];
    let mut left = room;
    let mut out = Vec::new();
    while let Some(Reverse((_, i))) = heap.pop() {
        let (next, taken) = &mut given[i];
        let g = claims[i].pods[*next];
        if g > left {
            continue;
        }
        left -= g;
        *taken = taken.saturating_add(g);
        out.push((i, *next));
        *next += 1;
        if *next < claims[i].pods.len() {
            heap.push(Reverse((rank(&claims[i], *taken), i)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_room_goes_to_the_smallest_fraction_of_budget_first() {
        // A large tenant with 50 GPUs left of 350, a small one with 3 of 3, room for 4.
        let claims = [
            RoomClaim {
                inuse: 300_000,
                budget: 350_000,
                pods: vec![1000; 50],
                ..RoomClaim::default()
            },
            RoomClaim {
                inuse: 0,
                budget: 3000,
                pods: vec![1000; 3],
                ..RoomClaim::default()
            },
        ];
        let got = share_room(&claims, 4000);
        assert_eq!(got, vec![(1, 0), (1, 1), (1, 2), (0, 0)]);
        // Room for all: all, and a pod too big for what is left is passed over.
        assert_eq!(share_room(&claims, 100_000).len(), 53);
        let big_first = [RoomClaim {
            budget: 10_000,
            pods: vec![8000, 1000],
            ..RoomClaim::default()
        }];
        assert_eq!(share_room(&big_first, 4000), Vec::<(usize, usize)>::new());
        assert_eq!(budget_use_ppm(5, 0), u64::MAX);
        assert_eq!(budget_use_ppm(1500, 1000), 1_500_000);
        // Urgent first; then non-preemptible tenants with no guarantee below budget; then
        // everyone else furthest under budget first (a non-preemptible tenant at its
        // budget, or with a guarantee it holds, among them).
        assert!(release_rank(true, false, 2_000, 9_000, 10_000) < release_rank(false, false, 0, 0, 10_000));
        assert!(release_rank(false, false, 0, 9_000, 10_000) < release_rank(false, true, 0, 0, 10_000));
        assert!(release_rank(false, true, 0, 0, 10_000) < release_rank(false, true, 0, 0, 2_000));
        assert_eq!(release_rank(false, false, 0, 10_000, 10_000), (2, 0));
        assert_eq!(release_rank(false, false, 2_000, 0, 10_000), (2, -10_000));
    }

    #[test]
    fn judge_is_decide_without_the_words() {
        for mode in [AdmissionMode::Reject, AdmissionMode::Queue] {
            for (budget, inuse, queued, gpue, ceiling, tenant) in [
                (4000, 1000, 0, 0, None, true),
                (4000, 1000, 0, 1000, None, false),
                (4000, 1000, 0, 3000, None, true),
                (4000, 1000, 0, 3001, Some(8000), true),
                (4000, 1000, 0, 9000, Some(8000), true),
                (4000, 1000, 2, 3001, None, true),
                (4000, 1000, 1, 3001, None, true),
            ] {
                let mut v = view(mode, budget, inuse, queued);
                v.ceiling = ceiling;
                if !tenant {
                    v.tenant = None;
                }
                let pod = PodRequest {
                    namespace: "ns".into(),
                    name: "p".into(),
                    gpue,
                };
                let d = decide(&pod, &v);
                assert_eq!(judge(&pod, &v), (d.verdict, d.reason), "{v:?} {gpue}: {}", d.message);
            }
        }
    }

    fn view(mode: AdmissionMode, budget: u64, inuse: u64, queued: u32) -> LocalView {
        LocalView {
            cluster: ClusterName::from_static("east"),
            tenant: Some(TenantName::from_static("training")),
            mode,
            max_queued: 2,
            budget,
            inuse,
            queued,
            entitlement: 40_000,
            ceiling: Some(32_000),
            lease: LeaseStatus::Fresh { remaining_ms: 21_000 },
            borrow: 0,
        }
    }

    fn pod(gpue: u64) -> PodRequest {
        PodRequest {
            namespace: "ml".into(),
            name: "trainer-0".into(),
            gpue,
        }
    }

    #[test]
    fn within_budget_is_allowed_up_to_the_last_milli() {
        let d = decide(&pod(2_000), &view(AdmissionMode::Reject, 32_000, 30_000, 0));
        assert_eq!(
            (d.verdict, d.reason, d.after),
            (Verdict::Allow, Reason::WithinBudget, 32_000)
        );
        let d = decide(&pod(2_001), &view(AdmissionMode::Reject, 32_000, 30_000, 0));
        assert_eq!(d.verdict, Verdict::Deny);
    }

    #[test]
    fn denial_message_names_every_number() {
        let d = decide(&pod(4_000), &view(AdmissionMode::Reject, 32_000, 30_000, 0));
        assert_eq!((d.verdict, d.reason), (Verdict::Deny, Reason::OverBudget));
        for needle in [
            "`training`",
            "34 GPUe",
            "in use 30",
            "this pod 4",
            "budget of 32",
            "entitlement 40",
            "fresh (21s left)",
            "kvota explain pod ml/trainer-0",
            "`east`",
        ] {
            assert!(d.message.contains(needle), "missing {needle:?} in {}", d.message);
        }
    }

    #[test]
    fn queue_mode_queues_until_full() {
        let d = decide(&pod(4_000), &view(AdmissionMode::Queue, 32_000, 30_000, 1));
        assert_eq!(d.verdict, Verdict::Queue);
        assert!(d.message.contains("position 2"), "{}", d.message);
        let d = decide(&pod(4_000), &view(AdmissionMode::Queue, 32_000, 30_000, 2));
        assert_eq!((d.verdict, d.reason), (Verdict::Deny, Reason::QueueFull));
        let d = decide(&pod(64_000), &view(AdmissionMode::Queue, 32_000, 0, 0));
        assert_eq!((d.verdict, d.reason), (Verdict::Deny, Reason::NeverFits));
    }

    #[test]
    fn no_gpu_and_ungoverned_pods_pass() {
        let d = decide(&pod(0), &view(AdmissionMode::Reject, 0, 99_000, 0));
        assert_eq!((d.verdict, d.reason), (Verdict::Allow, Reason::NoGpu));
        let mut v = view(AdmissionMode::Reject, 0, 0, 0);
        v.tenant = None;
        let d = decide(&pod(8_000), &v);
        assert_eq!((d.verdict, d.reason), (Verdict::Allow, Reason::Ungoverned));
    }

    #[test]
    fn release_by_priority_then_age() {
        let q = vec![
            QueuedPod {
                key: PodKey::from_static("ns/a"),
                priority: 0,
                queued_at_ms: 1,
                gpue: 2_000,
            },
            QueuedPod {
                key: PodKey::from_static("ns/b"),
                priority: 10,
                queued_at_ms: 5,
                gpue: 2_000,
            },
            QueuedPod {
                key: PodKey::from_static("ns/c"),
                priority: 0,
                queued_at_ms: 0,
                gpue: 4_000,
            },
            QueuedPod {
                key: PodKey::from_static("ns/d"),
                priority: 0,
                queued_at_ms: 2,
                gpue: 1_000,
            },
        ];
        // 5 GPUe free: b (prio), then c (oldest) does not fit, a fits, d fits? 5-2-2=1 -> d.
        assert_eq!(release_order(&q, 5_000, 0, false), [1, 0, 3]);
        assert_eq!(release_order(&q, 5_000, 0, true), [1]);
    }
}
