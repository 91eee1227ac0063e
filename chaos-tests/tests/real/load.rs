//! The load: the test plays each member cluster's API server, sending AdmissionReviews
//! for one-GPU pods of every tenant to every agent's webhook, and a sampler reads every
//! agent's metrics a few times a second. Both check as they go and write what they saw
//! into a [`Book`] that the scenario reads.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::http::{Metrics, Webhook};

/// The tenants of the test policy and the namespace each owns.
pub const TENANTS: [(&str, &str); 3] = [("inference", "serving"), ("research", "lab"), ("training", "ml")];

/// One review per tenant per agent this often: about 23 reviews a second in all, enough
/// to keep every tenant's demand above its share (denied pods count as demand) without
/// loading two shared cores.
const ROUND: Duration = Duration::from_millis(400);
/// The sampler's period: well under one report round (300 ms) plus a lease round trip,
/// the fastest any budget can move from one cluster to another.
const SAMPLE: Duration = Duration::from_millis(250);
/// Most messages of one kind kept for the failure output.
const KEEP: usize = 20;

/// One admission the webhook allowed, with the numbers its answer states.
#[derive(Clone, Debug)]
pub struct Admission {
    /// When the answer arrived.
    pub at: Instant,
    /// Cluster (agent) name.
    pub cluster: String,
    /// Tenant.
    pub tenant: String,
    /// The tenant's in-use in that cluster with this pod, milli-GPUe.
    pub after: u64,
    /// The budget the agent judged it against, milli-GPUe.
    pub budget: u64,
}

/// One metrics sample of one agent.
#[derive(Clone, Debug)]
pub struct Sample {
    /// When it was read.
    pub at: Instant,
    /// Cluster.
    pub cluster: String,
    /// The metrics.
    pub metrics: Metrics,
}

/// What the load and the sampler saw.
#[derive(Debug, Default)]
pub struct Book {
    /// Every allowed admission.
    pub admissions: Vec<Admission>,
    /// Reviews denied.
    pub denied: u64,
    /// Reviews that got no well-formed answer (the first few).
    pub errors: Vec<String>,
    /// Count of those.
    pub error_count: u64,
    /// Invariant violations seen while running (the first few).
    pub violations: Vec<String>,
    /// Metrics samples, every agent, in order.
    pub samples: Vec<Sample>,
    /// Largest federation-wide in-use seen per tenant, milli-GPUe.
    pub peak_inuse: BTreeMap<String, u64>,
}

impl Book {
    fn violation(&mut self, v: String) {
        if self.violations.len() < KEEP {
            self.violations.push(v);
        }
    }
}

/// `"1.25"` GPUe -> 1250 milli.
fn milli(s: &str) -> Option<u64> {
    let (whole, frac) = s.split_once('.').unwrap_or((s, ""));
    if frac.len() > 3 {
        return None;
    }
    let whole: u64 = whole.parse().ok()?;
    let frac: u64 = if frac.is_empty() {
        0
    } else {
        format!("{frac:0<3}").parse().ok()?
    };
    Some(whole * 1000 + frac)
}

/// From an admission message "... holds 1 + 1 = 2 of its 3.5 GPUe budget in cluster ...":
/// (in use after, budget) in milli-GPUe.
pub fn admitted_numbers(message: &str) -> Option<(u64, u64)> {
    let rest = message.split(" holds ").nth(1)?;
    let after = rest.split(" = ").nth(1)?.split(' ').next()?;
    let budget = rest.split(" of its ").nth(1)?.split(' ').next()?;
    Some((milli(after)?, milli(budget)?))
}

fn review(uid: &str, ns: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": ns, "name": uid, "operation": "CREATE",
            "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": uid, "namespace": ns},
                "spec": {"containers": [{"name": "main", "image": "trainer", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}
    }))
    .unwrap_or_default()
}

/// The running load; stops on drop.
#[derive(Debug)]
pub struct Load {
    book: Arc<Mutex<Book>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    /// Starts reviews to every agent in `agents` (cluster name, webhook) and the sampler,
    /// which checks every tenant's federation-wide in-use against `caps` (milli-GPUe).
    pub fn start(agents: &[(String, Webhook)], caps: BTreeMap<String, u64>) -> Load {
        let book = Arc::new(Mutex::new(Book::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for (cluster, hook) in agents {
            let (cluster, hook, book, stop) = (cluster.clone(), hook.clone(), book.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    let round = Instant::now();
                    for (tenant, ns) in TENANTS {
                        n += 1;
                        let uid = format!("{cluster}-{tenant}-{n}");
                        let answer = hook.request("POST", "/validate", review(&uid, ns)).await;
                        let mut b = lock(&book);
                        match answer.and_then(|(status, body)| {
                            let v: Value =
                                serde_json::from_slice(&body).map_err(|e| format!("HTTP {status}, not JSON: {e}"))?;
                            if status != 200 || v["response"]["uid"] != uid.as_str() {
                                return Err(format!("HTTP {status}: {v}"));
                            }
                            Ok(v)
                        }) {
                            Ok(v) if v["response"]["allowed"] == true => {
                                let msg = v["response"]["status"]["message"].as_str().unwrap_or_default();
                                match admitted_numbers(msg) {
                                    Some((after, budget)) => {
                                        if after > budget {
                                            b.violation(format!(
                                                "{cluster}: {uid} admitted above the budget it was judged by: {msg}"
                                            ));
                                        }
                                        b.admissions.push(Admission {
                                            at: Instant::now(),
                                            cluster: cluster.clone(),
                                            tenant: tenant.to_string(),
                                            after,
                                            budget,
                                        });
                                    }
                                    None => {
                                        b.violation(format!("{cluster}: {uid} admitted without the numbers: {msg}"))
                                    }
                                }
                            }
                            Ok(_) => b.denied += 1,
                            Err(e) => {
                                b.error_count += 1;
                                if b.errors.len() < KEEP {
                                    b.errors.push(format!("{cluster}: {uid}: {e}"));
                                }
                            }
                        }
                    }
                    tokio::time::sleep(ROUND.saturating_sub(round.elapsed())).await;
                }
            }));
        }
        let (b2, s2) = (book.clone(), stop.clone());
        let agents: Vec<(String, Webhook)> = agents.to_vec();
        tasks.push(tokio::spawn(async move {
            while !s2.load(Ordering::SeqCst) {
                let t0 = Instant::now();
                let reads: Vec<_> = agents.iter().map(|(c, h)| (c.clone(), tokio::spawn({
                    let h = h.clone();
                    async move { h.metrics().await }
                }))).collect();
                let mut got = Vec::new();
                for (c, r) in reads {
                    if let Ok(Ok(m)) = r.await {
                        got.push(Sample { at: Instant::now(), cluster: c, metrics: m });
                    }
                }
                {
                    let mut b = lock(&b2);
                    // The federation-wide check needs every agent read within one short
                    // window: a budget moves between clusters in no less than a report round
                    // plus a round trip to the control plane.
                    if got.len() == agents.len() && t0.elapsed() < Duration::from_millis(150) {
                        for (tenant, cap) in &caps {
                            let sum: u64 = got.iter().map(|s| s.metrics.tenant_scaled("kvota_agent_inuse_gpus", tenant, 1000.0)).sum();
                            let peak = b.peak_inuse.entry(tenant.clone()).or_default();
                            *peak = (*peak).max(sum);
                            if sum > *cap {
                                let per: Vec<String> = got.iter().map(|s| format!("{} {}", s.cluster, s.metrics.tenant_scaled("kvota_agent_inuse_gpus", tenant, 1000.0))).collect();
                                b.violation(format!("{tenant} holds {sum} milli-GPUe federation-wide, above maxShare x capacity = {cap} ({})", per.join(", ")));
                            }
                        }
                    }
                    b.samples.extend(got);
                    // Bounded: the last minute or so is all a scenario looks back at.
                    if b.samples.len() > 800 {
                        b.samples.drain(..400);
                    }
                }
                tokio::time::sleep(SAMPLE.saturating_sub(t0.elapsed())).await;
            }
        }));
        Load { book, stop, tasks }
    }

    /// What was seen so far.
    pub fn book(&self) -> MutexGuard<'_, Book> {
        lock(&self.book)
    }

    /// Stops sending and sampling, and waits for the tasks.
    pub async fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.tasks.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
        }
    }
}

fn lock(b: &Mutex<Book>) -> MutexGuard<'_, Book> {
    b.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in &self.tasks {
            t.abort();
        }
    }
}

#[test]
fn admission_messages_give_their_numbers() {
    let m = "kvota: admitted: tenant `training` holds 1.5 + 1 = 2.5 of its 3.25 GPUe budget in cluster `east`";
    assert_eq!(admitted_numbers(m), Some((2500, 3250)));
    assert_eq!(
        admitted_numbers("kvota: admitted: tenant `t` holds 0 + 1 = 1 of its 1 GPUe budget in cluster `c`"),
        Some((1000, 1000))
    );
    assert_eq!(admitted_numbers("kvota: pod requests no GPUs; not judged"), None);
}
