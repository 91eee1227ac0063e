//! Where kvota's waiting goes: replays a trace under `wfq-decay` and charges every
//! waiting pod, at every tick, to what holds it (`kvota_sim::waits`).
//!
//! ```sh
//! cargo run --release -p kvota-sim --example wait_causes -- synth:many-services:seed=7 3x1024
//! ```
//! Arguments: a trace spec (as `kvota sim --trace`; its own policy, else the article's)
//! and the clusters, `N` or `KxN` GPUs; with `KVOTA_LEVEL7=1` in the environment, the
//! control plane as at feature level 7. Prints the pod-hours per cause, in all and for
//! the tenants that waited longest.

use std::process::ExitCode;

use kvota_fairness::names::ClusterName;
use kvota_fairness::policy::Policy;
use kvota_sim::sched::WfqDecay;
use kvota_sim::waits::Cause;
use kvota_sim::{run, SimConfig, Trace};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(spec), Some(layout)) = (args.first(), args.get(1)) else {
        eprintln!("usage: wait_causes TRACE CLUSTERS (e.g. synth:many-services:seed=7 3x1024)");
        return ExitCode::from(2);
    };
    let (k, gpus) = layout.split_once('x').unwrap_or(("1", layout));
    let (Ok(k), Ok(gpus)) = (k.parse::<usize>(), gpus.parse::<u64>()) else {
        eprintln!("clusters: `{layout}` is not N or KxN");
        return ExitCode::from(2);
    };
    let trace = match Trace::load(spec) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let yaml = trace.policy_yaml.clone();
    let policy = match Policy::from_yaml(yaml.as_deref().unwrap_or(Policy::article_example_yaml())) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("policy: {e}");
            return ExitCode::from(2);
        }
    };
    let cfg = SimConfig {
        clusters: (1..=k)
            .filter_map(|i| ClusterName::parse(format!("c{i}")).ok().map(|c| (c, gpus * 1000)))
            .collect(),
        ..SimConfig::default()
    };
    let mut s = WfqDecay::new(&policy, cfg.tick_ms, None);
    s.wait_causes = Some(Default::default());
    // `KVOTA_LEVEL7=1`: the control plane as at feature level 7 (committed entitlement
    // rises in proportion to the shortfall), for before-and-after figures.
    s.small_first = std::env::var_os("KVOTA_LEVEL7").is_none();
    let r = match run(&trace, &policy, &cfg, &mut s) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let wc = s.wait_causes.unwrap_or_default();
    let hours = |pod_ticks: u64| pod_ticks as f64 * cfg.tick_ms as f64 / 3.6e6;
    let all: u64 = wc.total.iter().sum();
    println!(
        "{spec} on {layout}: utilization {:.1} %, fairness {:.3}; {} ticks, {:.0} pod-hours waiting",
        r.utilization * 100.0,
        r.mean_score,
        wc.ticks,
        hours(all)
    );
    for (k, c) in Cause::ALL.iter().enumerate() {
        println!(
            "  {:<18} {:>10.0} pod-h  {:>5.1} %",
            c.name(),
            hours(wc.total[k]),
            100.0 * wc.total[k] as f64 / all.max(1) as f64
        );
    }
    let mut worst: Vec<(u64, usize)> = wc
        .per_tenant
        .iter()
        .enumerate()
        .map(|(t, v)| (v.iter().sum(), t))
        .collect();
    worst.sort_unstable_by(|a, b| b.cmp(a));
    println!("  tenants waiting longest (pod-hours per cause, in the order above):");
    for &(sum, t) in worst.iter().take(12) {
        let per: Vec<String> = wc.per_tenant[t].iter().map(|&x| format!("{:.0}", hours(x))).collect();
        println!(
            "  {:<10} weight {:>7.3} {:>8.0} pod-h: {}",
            policy.tenants[t].name.as_str(),
            policy.tenants[t].weight_milli as f64 / 1000.0,
            hours(sum),
            per.join(" / ")
        );
    }
    // The same trace under the baselines that never preempt a non-preemptible tenant.
    println!("{}", summary(&r));
    for name in ["drf-elastic-np", "round-robin"] {
        let Some(mut b) = kvota_sim::sched::by_name(name, &policy, cfg.tick_ms, None) else {
            continue;
        };
        match run(&trace, &policy, &cfg, b.as_mut()) {
            Ok(r) => println!("{}", summary(&r)),
            Err(e) => eprintln!("{name}: {e}"),
        }
    }
    ExitCode::SUCCESS
}

/// Utilization, fairness, the median over tenants of each one's p99 admission delay and
/// the worst tenant's.
fn summary(r: &kvota_sim::RunResult) -> String {
    let mut p99: Vec<u64> = r
        .tenants
        .iter()
        .filter(|t| t.jobs > 0)
        .map(|t| t.delay_p99_ms)
        .collect();
    p99.sort_unstable();
    let median = match p99.len() {
        0 => 0,
        n if n % 2 == 1 => p99[n / 2],
        n => (p99[n / 2 - 1] + p99[n / 2]) / 2,
    };
    format!(
        "{:<16} utilization {:.1} %, fairness {:.3}, median tenant's p99 {}, worst {}",
        r.scheduler,
        r.utilization * 100.0,
        r.mean_score,
        kvota_sim::report::human_ms(median),
        kvota_sim::report::human_ms(p99.last().copied().unwrap_or(0))
    )
}
