//! `kvota sim`: replay a GPU trace under kvota's policy and four baselines, offline.

use std::io::{IsTerminal as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use clap::Args;
use kvota_fairness::names::ClusterName;
use kvota_fairness::policy::Policy;
use kvota_fairness::units::parse_duration_ms;
use kvota_sim::{report, sched, Partition, SimConfig, Trace};

/// Options of `kvota sim`.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// The trace: `philly:DIR[:GPU]` (the Philly per-VC files and throughputs.json;
    /// GPU type for durations, default v100), `alibaba:FILE` (openb_pod_list_*.csv),
    /// `csv:FILE` (header `tenant,submit_s,gpus,duration_s[,kind]`), a bare path, or a
    /// synthetic trace generated from a seed, `synth:KIND[:seed=N][:days=D]`:
    /// `synth:many-tenants` (150 small tenants: 120 services of long-lived one-GPU
    /// inference replicas with a diurnal extra, 30 batch teams of 1-8 GPU training jobs;
    /// 14 days, sized for 3,072 GPUs; brings its own policy), `synth:mixed-sizes` (the
    /// article's three tenants with pods of 0.25 to 32 GPUs; 30 days, sized for 384 GPUs)
    /// or `synth:many-services` (150 non-preemptible inference services of one-GPU pods
    /// living hours to days, Zipf sizes, a backlog at time 0; no guarantees, no caps,
    /// weights sqrt(size), half-life 6 h; 14 days, sized for 3,072 GPUs; brings its own
    /// policy).
    #[arg(long, value_name = "SPEC")]
    trace: String,
    /// FairnessPolicy YAML; its tenants must include every tenant of the trace.
    /// Default: the trace's own policy if it brings one (synth:many-tenants,
    /// synth:many-services), else the
    /// seed article's policy (training / inference / research), which fits the Alibaba
    /// trace and synth:mixed-sizes. For Philly use deploy/policies/philly-vc.yaml.
    #[arg(long, value_name = "FILE")]
    policy: Option<PathBuf>,
    /// Clusters and their GPUs: `64` (one cluster), `3x64`, or `east=64,west=64,edge=32`.
    /// Jobs are spread over clusters at random (seeded), in proportion to capacity.
    #[arg(long, default_value = "64", value_name = "SPEC")]
    clusters: String,
    /// GPUs per node (the last node of a cluster takes the remainder). A pod no larger
    /// than a node must fit on one node; a larger one takes whole free nodes. 0 treats
    /// each cluster as one pool of GPUs.
    #[arg(long, default_value_t = 8, value_name = "N")]
    node_gpus: u32,
    /// Schedulers to compare, comma-separated. Also known: `drf-elastic-np`, elastic DRF
    /// that never preempts a pod of a non-preemptible tenant (docs/guarantees.md D3).
    #[arg(
        long,
        default_value = "wfq-decay,round-robin,strict-priority,static-reservation,drf-elastic",
        value_name = "LIST"
    )]
    scheduler: String,
    /// Cut one cluster off the control plane: `CLUSTER@FROM..TO` in trace time, e.g.
    /// `west@10d..12d` (units ms, s, m, h, d). Affects kvota only: the baselines have no
    /// control plane.
    #[arg(long, value_name = "CLUSTER@FROM..TO")]
    partition: Option<String>,
    /// Multiply all trace times by this (0.1 = ten times faster arrivals and shorter jobs).
    #[arg(long, default_value_t = 1.0, value_name = "FACTOR")]
    time_scale: f64,
    /// Replay only the first N jobs (by submission time).
    #[arg(long, value_name = "N")]
    max_jobs: Option<usize>,
    /// Period of usage reports, leases, rebalancing and measurement (trace time).
    #[arg(long, default_value = "60s", value_name = "DURATION")]
    tick: String,
    /// Training checkpoint interval: a preempted job loses the work since its last one.
    #[arg(long, default_value = "30m", value_name = "DURATION")]
    checkpoint: String,
    /// Seed for everything random (job-to-cluster placement).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where to write report.md, results.csv, series.csv and the SVG charts.
    #[arg(long, default_value = "sim-out", value_name = "DIR")]
    out: PathBuf,
}

fn parse_clusters(spec: &str) -> Result<Vec<(ClusterName, u64)>> {
    let gpus = |s: &str| -> Result<u64> {
        let n: f64 = s
            .trim()
            .parse()
            .with_context(|| format!("`{s}` is not a GPU count (in --clusters {spec})"))?;
        if !(n > 0.0 && n <= 1_000_000.0) {
            bail!("cluster size {n} is out of range (0, 1000000] (in --clusters {spec})");
        }
        // Bounded above: exact.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let milli = (n * 1000.0).round() as u64;
        Ok(milli)
    };
    if let Some((n, size)) = spec.split_once('x') {
        if let Ok(n) = n.trim().parse::<usize>() {
            if n == 0 || n > 64 {
                bail!("--clusters {spec}: between 1 and 64 clusters");
            }
            let g = gpus(size)?;
            return (1..=n)
                .map(|i| {
                    ClusterName::parse(format!("c{i}"))
                        .map(|c| (c, g))
                        .map_err(anyhow::Error::from)
                })
                .collect();
        }
    }
    if !spec.contains('=') {
        return Ok(vec![(ClusterName::from_static("cluster"), gpus(spec)?)]);
    }
    let mut out: Vec<(ClusterName, u64)> = Vec::new();
    for part in spec.split(',') {
        let Some((name, size)) = part.split_once('=') else {
            bail!("--clusters {spec}: `{part}` is not NAME=GPUS");
        };
        let name = name.trim();
        let Ok(name) = ClusterName::parse(name) else {
            bail!(
                "--clusters {spec}: `{name}` is not a valid cluster name ({})",
                kvota_fairness::names::DNS_LABEL_RULE
            );
        };
        if out.iter().any(|c| c.0 == name) {
            bail!("--clusters {spec}: cluster `{name}` appears twice");
        }
        out.push((name, gpus(size)?));
    }
    Ok(out)
}

fn parse_partition(spec: &str, clusters: &[(ClusterName, u64)]) -> Result<Partition> {
    let err = || format!("--partition {spec}: expected CLUSTER@FROM..TO, e.g. c2@10d..12d");
    let (name, span) = spec.split_once('@').with_context(err)?;
    let (from, to) = span.split_once("..").with_context(err)?;
    let cluster = clusters.iter().position(|c| c.0 == name).with_context(|| {
        format!(
            "--partition {spec}: no cluster `{name}` (clusters: {})",
            clusters.iter().map(|c| c.0.as_str()).collect::<Vec<_>>().join(", ")
        )
    })?;
    let from_ms = parse_duration_ms(from).map_err(|e| anyhow::anyhow!("--partition {spec}: {e}"))?;
    let to_ms = parse_duration_ms(to).map_err(|e| anyhow::anyhow!("--partition {spec}: {e}"))?;
    if to_ms <= from_ms {
        bail!("--partition {spec}: the end must come after the start");
    }
    Ok(Partition {
        cluster,
        from_ms,
        to_ms,
    })
}

fn load_policy(path: Option<&Path>, trace: &Trace) -> Result<Policy> {
    let Some(path) = path else {
        if let Some(yaml) = &trace.policy_yaml {
            return Policy::from_yaml(yaml).map_err(|e| anyhow::anyhow!("the policy of {}: {e}", trace.source));
        }
        return Policy::from_yaml(Policy::article_example_yaml()).map_err(|e| anyhow::anyhow!("built-in policy: {e}"));
    };
    let text = std::fs::read_to_string(path).with_context(|| format!("read --policy {}", path.display()))?;
    Policy::from_yaml(&text).map_err(|e| {
        anyhow::anyhow!(
            "{} is not a valid FairnessPolicy (`kvota policy validate {}` lists every problem): {e}",
            path.display(),
            path.display()
        )
    })
}

/// Progress of a comparison on stderr, per scheduler: trace time reached and an
/// estimate of the wall time left. On a terminal one line is redrawn in place a few
/// times a second; otherwise (a log, CI) a plain line every few seconds, so the record
/// stays readable and short.
struct ProgressLine<'a> {
    names: &'a [String],
    tty: bool,
    current: Option<usize>,
    run_started: Instant,
    last_shown: Option<Instant>,
}

impl<'a> ProgressLine<'a> {
    /// Redraw period on a terminal: fast enough to look alive, slow enough to cost nothing.
    const TTY_EVERY: Duration = Duration::from_millis(250);
    /// Line period otherwise: a 10-minute run writes about 120 lines.
    const PLAIN_EVERY: Duration = Duration::from_secs(5);

    fn new(names: &'a [String], tty: bool) -> Self {
        ProgressLine {
            names,
            tty,
            current: None,
            run_started: Instant::now(),
            last_shown: None,
        }
    }

    fn update(&mut self, i: usize, p: kvota_sim::Progress) {
        let now = Instant::now();
        if self.current != Some(i) {
            self.current = Some(i);
            self.run_started = now;
        }
        let every = if self.tty { Self::TTY_EVERY } else { Self::PLAIN_EVERY };
        if self.last_shown.is_some_and(|t| now.duration_since(t) < every) {
            return;
        }
        // Nothing for the first second of each run: short runs stay quiet.
        let elapsed = now.duration_since(self.run_started);
        if self.last_shown.is_none() && elapsed < Duration::from_secs(1) {
            return;
        }
        self.last_shown = Some(now);
        let name = self.names.get(i).map_or("?", String::as_str);
        let pct = if p.end_ms == 0 {
            100.0
        } else {
            100.0 * p.reached_ms as f64 / p.end_ms as f64
        };
        let left = if p.reached_ms == 0 {
            "time left unknown".to_string()
        } else {
            // Trace time still to go at the wall-clock rate so far (capped at a year).
            let secs = elapsed.as_secs_f64() * (p.end_ms - p.reached_ms) as f64 / p.reached_ms as f64;
            let left = Duration::from_secs_f64(secs.clamp(0.0, 365.0 * 86_400.0));
            format!(
                "about {} left",
                report::human_ms(left.as_millis().try_into().unwrap_or(u64::MAX))
            )
        };
        let line = format!(
            "sim [{}/{}] {name}: trace time {} of {} ({pct:.0} %), {} elapsed, {left}",
            i + 1,
            self.names.len(),
            report::human_ms(p.reached_ms),
            report::human_ms(p.end_ms),
            report::human_ms(elapsed.as_millis().try_into().unwrap_or(u64::MAX)),
        );
        let mut err = std::io::stderr().lock();
        // Progress is a courtesy: a closed stderr must not stop the run.
        let _ = if self.tty {
            write!(err, "\r\x1b[K{line}")
        } else {
            writeln!(err, "{line}")
        };
        let _ = err.flush();
    }

    /// Removes the redrawn line (the results follow on stdout).
    fn clear(&self) {
        if self.tty && self.last_shown.is_some() {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[K");
            let _ = err.flush();
        }
    }
}

/// Runs `kvota sim`.
pub fn run(args: SimArgs) -> Result<ExitCode> {
    let clusters = parse_clusters(&args.clusters)?;
    let partition = args
        .partition
        .as_deref()
        .map(|p| parse_partition(p, &clusters))
        .transpose()?;
    let tick_ms = parse_duration_ms(&args.tick).map_err(|e| anyhow::anyhow!("--tick: {e}"))?;
    if tick_ms == 0 {
        bail!("--tick must be longer than 0");
    }
    let checkpoint_ms = parse_duration_ms(&args.checkpoint).map_err(|e| anyhow::anyhow!("--checkpoint: {e}"))?;
    if !(args.time_scale > 0.0 && args.time_scale.is_finite()) {
        bail!("--time-scale must be a positive number");
    }
    let schedulers = parse_schedulers(&args.scheduler)?;
    let t0 = Instant::now();
    let trace = load_trace(&args)?;
    let load_s = t0.elapsed().as_secs_f64();
    let policy = load_policy(args.policy.as_deref(), &trace)?;
    let cfg = SimConfig {
        clusters,
        node_gpue: u64::from(args.node_gpus) * 1000,
        tick_ms,
        checkpoint_ms,
        seed: args.seed,
        partition,
        ..SimConfig::default()
    };
    let t1 = Instant::now();
    let mut shown = ProgressLine::new(&schedulers, std::io::stderr().is_terminal());
    let runs = kvota_sim::compare_with_progress(&trace, &policy, &cfg, &schedulers, &mut |i, p| shown.update(i, p));
    shown.clear();
    let runs = runs.map_err(|e| {
        let hint = if args.policy.is_none() && trace.source.starts_with("philly:") {
            " (for the Philly trace: --policy deploy/policies/philly-vc.yaml)"
        } else {
            ""
        };
        anyhow::anyhow!("{e}{hint}")
    })?;
    let sim_s = t1.elapsed().as_secs_f64();
    let results: Vec<kvota_sim::RunResult> = runs.iter().map(|r| r.result.clone()).collect();

    let md = report_markdown(&args, &trace, &policy, &cfg, &results, (load_s, sim_s));
    write_report(&args.out, &trace, &md, &results)?;
    out!("{}", report::markdown(&results));
    for r in &runs {
        out!("{:<20} {:>8.2} s", r.result.scheduler, r.wall.as_secs_f64());
    }
    out!(
        "replayed {} jobs x {} schedulers in {sim_s:.1} s (trace loaded in {load_s:.1} s); report in {}",
        trace.jobs.len(),
        results.len(),
        args.out.join("report.md").display()
    );
    Ok(ExitCode::SUCCESS)
}

/// The scheduler names of `--scheduler` (comma-separated), each one kvota knows.
fn parse_schedulers(list: &str) -> Result<Vec<String>> {
    let schedulers: Vec<String> = list
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    if let Some(bad) = schedulers.iter().find(|s| !sched::ALL.contains(&s.as_str())) {
        bail!("--scheduler: unknown `{bad}`; choose from {}", sched::ALL.join(", "));
    }
    if schedulers.is_empty() {
        bail!("--scheduler: name at least one of {}", sched::ALL.join(", "));
    }
    Ok(schedulers)
}

/// The trace of `--trace`, cut to `--max-jobs` and scaled by `--time-scale`.
fn load_trace(args: &SimArgs) -> Result<Trace> {
    let mut trace = Trace::load(&args.trace).with_context(|| format!("load --trace {}", args.trace))?;
    if let Some(n) = args.max_jobs {
        trace.truncate(n);
    }
    if (args.time_scale - 1.0).abs() > f64::EPSILON {
        trace.scale_time(args.time_scale);
    }
    if trace.jobs.is_empty() {
        bail!("the trace {} has no jobs to replay", args.trace);
    }
    Ok(trace)
}

/// `report.md`: what was replayed, how long it took (`(load_s, sim_s)`), the results
/// table and the charts.
fn report_markdown(
    args: &SimArgs,
    trace: &Trace,
    policy: &Policy,
    cfg: &SimConfig,
    results: &[kvota_sim::RunResult],
    (load_s, sim_s): (f64, f64),
) -> String {
    let (clusters, tick_ms, checkpoint_ms) = (&cfg.clusters, cfg.tick_ms, cfg.checkpoint_ms);
    let total_gpus: u64 = clusters.iter().map(|c| c.1).sum();
    let cluster_desc = clusters
        .iter()
        .map(|(n, g)| format!("{n}={}", kvota_fairness::units::format_gpue(*g)))
        .collect::<Vec<_>>()
        .join(", ");
    let mut md = format!(
        "# kvota sim: {}\n\n- policy: `{}` ({} tenants)\n- clusters: {cluster_desc} ({} GPUs in all; {})\n- jobs: {} over {} of trace time; tick {}, checkpoints every {}, seed {}\n",
        trace.source,
        policy.name,
        policy.tenants.len(),
        kvota_fairness::units::format_gpue(total_gpus),
        if args.node_gpus == 0 { "each one pool".to_string() } else { format!("nodes of {} GPUs", args.node_gpus) },
        trace.jobs.len(),
        report::human_ms(results.iter().map(|r| r.span_ms).max().unwrap_or(0)),
        report::human_ms(tick_ms),
        report::human_ms(checkpoint_ms),
        args.seed
    );
    if let Some(p) = &cfg.partition {
        md += &format!(
            "- partition: cluster `{}` cut off the control plane from {} to {}\n",
            clusters[p.cluster].0,
            report::human_ms(p.from_ms),
            report::human_ms(p.to_ms)
        );
    }
    for n in &trace.notes {
        md += &format!("- {n}\n");
    }
    md += &format!(
        "- computed in {sim_s:.1} s ({} events; trace loaded in {load_s:.1} s)\n\n",
        results.iter().map(|r| r.events).sum::<u64>()
    );
    md += &report::markdown(results);
    md += "\n![fairness score over time](fairness.svg)\n";
    for r in results {
        md += &format!("\n![{0}: share of GPUs per tenant](share-{0}.svg)\n", r.scheduler);
    }
    md
}

/// Writes the report, the CSV files and the charts into `out`.
fn write_report(out: &Path, trace: &Trace, md: &str, results: &[kvota_sim::RunResult]) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("create --out {}", out.display()))?;
    let write = |name: &str, body: &str| -> Result<()> {
        let p = out.join(name);
        std::fs::write(&p, body).with_context(|| format!("write {}", p.display()))
    };
    write("report.md", md)?;
    write("results.csv", &report::results_csv(results))?;
    write("series.csv", &report::series_csv(results))?;
    write(
        "fairness.svg",
        &report::fairness_chart(
            &format!("Mean fairness score, {}", trace.source.rsplit('/').next().unwrap_or("")),
            results,
        ),
    )?;
    for r in results {
        write(
            &format!("share-{}.svg", r.scheduler),
            &report::share_chart(&format!("{}: share of GPUs held per tenant", r.scheduler), r),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_specs() {
        assert_eq!(
            parse_clusters("64").expect("one"),
            [(ClusterName::from_static("cluster"), 64_000)]
        );
        assert_eq!(
            parse_clusters("2x8").expect("two"),
            [
                (ClusterName::from_static("c1"), 8000),
                (ClusterName::from_static("c2"), 8000)
            ]
        );
        assert_eq!(
            parse_clusters("east=4,edge=0.5").expect("named"),
            [
                (ClusterName::from_static("east"), 4000),
                (ClusterName::from_static("edge"), 500)
            ]
        );
        assert!(parse_clusters("east=4,east=2").is_err());
        assert!(parse_clusters("x").is_err());
        assert!(parse_clusters("0").is_err());
        assert!(parse_clusters("Bad_Name=3").is_err());
    }

    #[test]
    fn partition_specs() {
        let c = parse_clusters("2x8").expect("two");
        assert_eq!(
            parse_partition("c2@1h..2h", &c).expect("ok"),
            Partition {
                cluster: 1,
                from_ms: 3_600_000,
                to_ms: 7_200_000
            }
        );
        assert!(parse_partition("c3@1h..2h", &c)
            .expect_err("no c3")
            .to_string()
            .contains("no cluster `c3`"));
        assert!(parse_partition("c1@2h..1h", &c).is_err());
        assert!(parse_partition("c1", &c).is_err());
    }
}
