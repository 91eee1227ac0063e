//! The demo's terminal output: a live table redrawn in place on a terminal, periodic
//! lines otherwise (CI logs, pipes), and the final summary.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;

use kvota_fairness::lease::LeaseStatus;
use kvota_fairness::MilliGpue;

use super::{CpView, Summary, TENANTS};

/// GPUe as people read it.
pub fn gpue(milli: MilliGpue) -> String {
    format!("{:.1} GPUe", milli as f64 / 1000.0)
}

fn g(milli: MilliGpue) -> String {
    format!("{:.1}", milli as f64 / 1000.0)
}

/// A cluster's row.
pub struct ClusterRow {
    /// Id.
    pub name: String,
    /// GPUe.
    pub capacity: MilliGpue,
    /// Pods running.
    pub running: usize,
    /// Pods behind the gate.
    pub gated: usize,
    /// Lease standing.
    pub lease: LeaseStatus,
    /// Epoch held.
    pub epoch: u64,
    /// Unacknowledged reports.
    pub backlog: usize,
    /// Cut off from the control plane.
    pub cut: bool,
}

/// Everything one frame shows.
pub struct Frame<'a> {
    /// Seed.
    pub seed: u64,
    /// Speed.
    pub speed: f64,
    /// Wall ms since start.
    pub now_ms: u64,
    /// Wall ms at the end.
    pub end_ms: u64,
    /// Phase name.
    pub phase: &'a str,
    /// Control plane.
    pub cp: &'a CpView,
    /// Leader's HTTP address.
    pub http: Option<String>,
    /// In use per tenant (ground truth).
    pub inuse: &'a BTreeMap<String, MilliGpue>,
    /// Of in use: on a node, per tenant.
    pub running: &'a BTreeMap<String, MilliGpue>,
    /// Pods waiting per tenant.
    pub waiting: &'a BTreeMap<String, usize>,
    /// Federation capacity.
    pub capacity: MilliGpue,
    /// Clusters.
    pub clusters: &'a [ClusterRow],
    /// Bound / capacity.
    pub utilization: f64,
}

/// Where output goes.
pub struct Out {
    tty: bool,
    events: Vec<String>,
    drawn: bool,
    /// The dashboard's address last printed (plain output says it once, and again when
    /// the leader moves).
    said_dashboard: Option<String>,
}

impl Out {
    /// Live table on a terminal, lines otherwise.
    pub fn new(tty: bool) -> Out {
        Out {
            tty,
            events: Vec::new(),
            drawn: false,
            said_dashboard: None,
        }
    }

    fn print(&self, s: &str) {
        let mut o = std::io::stdout();
        if o.write_all(s.as_bytes()).and_then(|()| o.flush()).is_err() {
            // Stdout is gone (a closed pipe): keep running quietly; the JSON still lands.
        }
    }

    /// A line outside the live table.
    pub fn line(&mut self, s: &str) {
        self.print(&format!("{s}\n"));
    }

    /// Something happened.
    pub fn event(&mut self, now_ms: u64, text: &str) {
        let e = format!("{:>6.1}s  {text}", now_ms as f64 / 1000.0);
        if !self.tty {
            self.print(&format!("{e}\n"));
        }
        self.events.push(e);
    }

    /// Draws a frame (terminal) or a status line (otherwise).
    pub fn frame(&mut self, f: &Frame<'_>) {
        if !self.tty {
            self.plain_frame(f);
            return;
        }
        let mut s = String::new();
        s.push_str(if self.drawn { "\x1b[H\x1b[J" } else { "\x1b[2J\x1b[H" });
        self.drawn = true;
        let _ = writeln!(
            s,
            "kvota demo  seed {}  speed {}x  {:>5.1}s / {:.0}s  phase: {}",
            f.seed,
            f.speed,
            f.now_ms as f64 / 1000.0,
            f.end_ms as f64 / 1000.0,
            f.phase
        );
        let leader = f.cp.leader.map_or("none (election)".to_string(), |l| {
            format!("node {l} (term {})", f.cp.term)
        });
        let _ = writeln!(
            s,
            "control plane: leader {leader}   GPU utilization {:.0}%",
            f.utilization * 100.0
        );
        if let Some(h) = &f.http {
            let _ = writeln!(
                s,
                "  dashboard: http://{h}/ui/   API: http://{h}/api/v1/tenants   metrics: http://{h}/metrics"
            );
        }
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "{:<10} {:>9} {:>9} {:>8} {:>8} {:>8} {:>7} {:>6}",
            "TENANT", "ENTITLED", "COMMITTED", "RUNNING", "ADMITTED", "WAITING", "DRIFT", "SCORE"
        );
        for t in TENANTS {
            let inuse = f.inuse.get(t).copied().unwrap_or(0);
            let running = f.running.get(t).copied().unwrap_or(0).min(inuse);
            let info = f.cp.tenants.get(t);
            let target = info.map_or(0, |i| i.target_milli_gpue);
            let committed = info.map_or(0, |i| i.entitlement_milli_gpue);
            let drift = (inuse as f64 - target as f64) / f.capacity.max(1) as f64 * 100.0;
            let _ = writeln!(
                s,
                "{:<10} {:>9} {:>9} {:>8} {:>8} {:>8} {:>+6.1}% {:>6.2}",
                t,
                g(target),
                g(committed),
                g(running),
                g(inuse - running),
                f.waiting.get(t).copied().unwrap_or(0),
                drift,
                info.map_or(1.0, |i| i.fairness_score)
            );
        }
        let _ = writeln!(
            s,
            "RUNNING: GPUe on a node. ADMITTED: admitted, not yet on a node. WAITING: pods waiting. SCORE: as `kvota tenants`."
        );
        self.clusters_and_events(f, s);
    }

    /// The status line of plain output, with the dashboard's address when it is new.
    fn plain_frame(&mut self, f: &Frame<'_>) {
        if f.http.is_some() && f.http != self.said_dashboard {
            if let Some(h) = &f.http {
                self.print(&format!(
                    "{:>6.1}s  dashboard: http://{h}/ui/ (the leader's; any node serves it)\n",
                    f.now_ms as f64 / 1000.0
                ));
            }
            self.said_dashboard.clone_from(&f.http);
        }
        let mut s = format!(
            "{:>6.1}s  [{}] util {:>3.0}%",
            f.now_ms as f64 / 1000.0,
            f.phase,
            f.utilization * 100.0
        );
        for t in TENANTS {
            let inuse = f.inuse.get(t).copied().unwrap_or(0);
            let target = f.cp.tenants.get(t).map_or(0, |i| i.target_milli_gpue);
            let _ = write!(s, " | {t} {}/{}", g(inuse), g(target));
        }
        for c in f.clusters {
            let _ = write!(s, " | {} {}", c.name, short_lease(c.lease));
        }
        self.print(&format!("{s}\n"));
    }

    /// The live table's clusters and the latest events, after `s` (the header and the
    /// tenants), drawn at once.
    fn clusters_and_events(&self, f: &Frame<'_>, mut s: String) {
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "{:<8} {:>7} {:>8} {:>6}  {:<34} {:>7}",
            "CLUSTER", "GPUe", "RUNNING", "GATED", "LEASE", "BACKLOG"
        );
        for c in f.clusters {
            let lease = format!("{}{} e{}", if c.cut { "CUT OFF, " } else { "" }, c.lease, c.epoch);
            let _ = writeln!(
                s,
                "{:<8} {:>7} {:>8} {:>6}  {:<34} {:>7}",
                c.name,
                g(c.capacity),
                c.running,
                c.gated,
                lease,
                c.backlog
            );
        }
        let _ = writeln!(s, "\nEVENTS");
        let skip = self.events.len().saturating_sub(10);
        for e in &self.events[skip..] {
            let _ = writeln!(s, "{e}");
        }
        self.print(&s);
    }

    /// Ends the live part (the table stays on screen).
    pub fn finish(&mut self) {
        if self.tty && self.drawn {
            self.print("\n");
        }
    }
}

fn short_lease(l: LeaseStatus) -> &'static str {
    match l {
        LeaseStatus::None => "no lease",
        LeaseStatus::Fresh { .. } => "fresh",
        LeaseStatus::Expiring { .. } => "expiring",
        LeaseStatus::Safe => "SAFE BUDGETS",
    }
}

fn ms(v: Option<u64>) -> String {
    v.map_or("-".to_string(), |v| format!("{v} ms"))
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "ok"
    } else {
        "FAILED"
    }
}

/// The final summary as text.
pub fn summary_text(s: &Summary) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "\n=== kvota demo summary (seed {}, speed {}x, {:.1} s, {:.1} GPUe) ===",
        s.seed, s.speed, s.duration_s, s.capacity_gpue
    );
    let _ = writeln!(o, "Times are wall-clock on this machine.\n");
    let _ = writeln!(
        o,
        "{:<10} {:>6} {:>7} {:>10} {:>10} {:>10} {:>10} {:>6} {:>6} {:>7}",
        "TENANT", "PODS", "WAITING", "DELAY p50", "DELAY p99", "OVER SHARE", "STARVED", "SCORE", "AT END", "DENIED"
    );
    tenant_rows(&mut o, s);
    let _ = writeln!(o);
    health_lines(&mut o, s);
    footnote(&mut o);
    o
}

/// One row per tenant under the summary's header.
fn tenant_rows(o: &mut String, s: &Summary) {
    for (t, v) in &s.tenants {
        let _ = writeln!(
            o,
            "{:<10} {:>6} {:>7} {:>10} {:>10} {:>9.1}% {:>9.1}s {:>6.2} {:>6.2} {:>7}",
            t,
            v.pods_started,
            v.pods_waiting_at_end,
            ms(v.delay_p50_ms),
            ms(v.delay_p99_ms),
            v.share_violation_fraction * 100.0,
            v.starved_below_guarantee_ms as f64 / 1000.0,
            v.mean_fairness_score,
            v.fairness_score_at_end,
            v.pods_denied
        );
    }
}

/// The run's checks, each with its verdict or its measured time.
fn health_lines(o: &mut String, s: &Summary) {
    let _ = writeln!(
        o,
        "GPU utilization (mean)            {:.1}% (GPUe running on a node, over capacity)",
        s.gpu_utilization * 100.0
    );
    let _ = writeln!(
        o,
        "over-admission beyond entitlement {} times, {:.1} GPUe (checked after each of {} admission rounds)  [{}]",
        s.over_admissions,
        s.over_admitted_gpue,
        s.admissions_checked,
        verdict(s.over_admissions == 0)
    );
    let _ = writeln!(
        o,
        "admissions beyond maxShare        {}  [{}]",
        s.over_max_share,
        verdict(s.over_max_share == 0)
    );
    let _ = writeln!(
        o,
        "usage: measured {:.1} GPUe-s, ledger {:.1} GPUe-s (decay allows {:.2}); lost {:.2}, double-counted {:.2}, unacknowledged reports {}  [{}]",
        s.usage.produced_gpue_s,
        s.usage.ledger_gpue_s,
        s.usage.decay_allowance_gpue_s,
        s.usage.lost_gpue_s,
        s.usage.double_counted_gpue_s,
        s.usage.unacknowledged_reports,
        verdict(s.usage.lost_gpue_s == 0.0 && s.usage.double_counted_gpue_s == 0.0 && s.usage.unacknowledged_reports == 0)
    );
    recovery_lines(o, s);
}

/// How the run recovered: from the burst, the partition, the failover; what reclaim did.
fn recovery_lines(o: &mut String, s: &Summary) {
    let secs = |v: Option<f64>| v.map_or("not within the run".to_string(), |v| format!("{v:.1} s"));
    let _ = writeln!(
        o,
        "fair shares again after the burst {}",
        secs(s.recovery_after_burst_s)
    );
    let _ = writeln!(
        o,
        "fair shares again after healing   {}",
        secs(s.recovery_after_partition_s)
    );
    let _ = writeln!(
        o,
        "partitioned cluster               {}",
        if s.partition_lease_expired {
            "lease expired while cut off; enforced safe budgets"
        } else {
            "lease did not expire while cut off"
        }
    );
    let _ = writeln!(o, "leader failover                   {}", secs(s.failover_s));
    let _ = writeln!(
        o,
        "killed node rejoined              {}",
        if s.killed_node_rejoined { "yes" } else { "no" }
    );
    let evicted: u64 = s.evictions.values().sum();
    let _ = writeln!(
        o,
        "reclaim                           {}",
        if evicted == 0 {
            "no evictions (no tenant was starved below its guarantee long enough)".to_string()
        } else {
            format!(
                "{evicted} pods evicted ({}), {:.1} GPUe-s of work lost to checkpoints",
                s.evictions
                    .iter()
                    .map(|(t, n)| format!("{t} {n}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                s.eviction_lost_gpue_s
            )
        }
    );
}

/// What each column of the tenant table means.
fn footnote(o: &mut String) {
    let _ = writeln!(
        o,
        "\nOVER SHARE: time above the entitlement (pods admitted earlier keep running when it falls; \
         kvota throttles, it does not kill). STARVED: time below min(demand waiting > 2 s, minShare).\n\
         SCORE: the control plane's {}; mean of one sample a second over the run, and AT END as \
         `kvota tenants` and the dashboard show it now.\n\
         DENIED: pods denied at least once (a pod's retries are not counted again; --json has every answer).",
        kvota_control_plane::view::SCORE_DEFINITION
    );
}
