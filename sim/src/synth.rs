//! Synthetic traces of shapes the public traces lack, generated from a seed.
//!
//! `synth:KIND[:seed=N][:days=D]`, wherever a trace spec is taken:
//! - **`many-tenants`**: 150 small tenants. 120 services (`svc-000`..`svc-119`) each keep
//!   8 to 20 long-lived one-GPU inference replicas (each lives 1 to 5 days and is
//!   replaced when it ends, as a rolling update does) and add up to 4 to 16 more
//!   one-GPU replicas by day, following a diurnal profile (a trough at night, a peak
//!   in the afternoon, each service's day shifted by up to three hours); each extra
//!   replica lives 2 to 6 hours. 30 batch teams (`batch-00`..`batch-29`) submit about
//!   one training job an hour each, of 1, 2, 4 or 8 GPUs, running 1 to 12 hours.
//!   Offered load (seed 7) is about 2,700 GPUs on average and up to 3,800 at the daily
//!   peak, sized for 3,072 GPUs (one cluster, or three of 1,024). The trace carries its policy
//!   ([`Trace::policy_yaml`]): weight 1 per service and 3 per batch team, guarantees of
//!   half the weight share, services non-preemptible.
//! - **`many-services`**: 150 inference services (`svc-000`..`svc-149`), no batch. Each
//!   service has a size `N` (replicas it keeps), Zipf over a seeded ranking: the
//!   service of rank `r` (1..=150) keeps `600 / r` one-GPU replicas (600, 300, 200, ...,
//!   down to 4; 3,294 in all, 7 % above 3,072 GPUs, so the largest services are held
//!   below their demand while most services' demand is below their fair share). Each service starts with a backlog of `N` pods submitted at time 0 (pods
//!   already running, or waiting, when the trace starts), then a stream of new pods at
//!   a rate that keeps about `N` running, drifting day by day between half and one and a
//!   half times that. Every pod is one GPU and lives 1 hour to 4 days (log-uniform by
//!   octave, mean about 25 hours). Its policy: every service
//!   non-preemptible, minShare 0, maxShare 100 (no cap), weight the square root of its
//!   size (to a thousandth), half-life 6 h. Sized for 3,072 GPUs (one cluster, or three
//!   of 1,024).
//! - **`mixed-sizes`**: the seed article's three tenants (its policy is `kvota sim`'s
//!   default) with pod sizes from a quarter of a GPU to 32 GPUs: `inference` replicas of
//!   0.25, 0.5, 1 or 2 GPUs living hours to days, `training` jobs of 1 to 32 GPUs (powers
//!   of two) running 1 to 48 hours, `research` jobs of 0.5 to 8 GPUs running 10 minutes
//!   to 6 hours. Offered load (seed 7) is about 315 GPUs on average and up to 500, sized
//!   for 384 (three clusters of 128).
//!
//! Default: 14 days (`many-tenants`, `many-services`) or 30 days (`mixed-sizes`), seed 1. A trace is a
//! pure function of (kind, seed, days): the generator draws only from
//! [`kvota_fairness::rng::Rng`] and integer arithmetic (no floating-point functions
//! whose last bit could differ between platforms), one forked stream per tenant so a
//! change to one tenant's model does not move the others' draws.

use std::fmt::Write as _;

use kvota_fairness::rng::Rng;

use crate::trace::{Job, Kind, Trace, TraceError};

const HOUR_MS: u64 = 3_600_000;
const DAY_MS: u64 = 24 * HOUR_MS;

/// Longest trace the generator writes: a bound on its size (about 3,000 jobs a day for
/// `many-tenants`), well past any comparison run.
pub const MAX_DAYS: u64 = 365;

/// Services of `many-tenants`.
pub const SERVICES: usize = 120;
/// Batch teams of `many-tenants`.
pub const BATCH_TEAMS: usize = 30;

/// Share of a service's diurnal peak wanted at each hour of its day, percent: night
/// trough, morning ramp, afternoon peak, evening fall.
const DIURNAL_PCT: [u64; 24] = [
    5, 0, 0, 0, 0, 5, 15, 35, 55, 70, 80, 90, 95, 100, 100, 95, 85, 70, 55, 40, 30, 20, 15, 10,
];

/// The kinds `synth:` knows.
pub const KINDS: [&str; 3] = ["many-tenants", "mixed-sizes", "many-services"];

/// Services of `many-services`.
pub const MANY_SERVICES: usize = 150;
/// Replicas of the largest `many-services` service; the one of rank `r` keeps
/// `LARGEST_SERVICE / r`.
pub const LARGEST_SERVICE: u64 = 600;
/// Mean life of a `many-services` pod, hours (log-uniform by octave, 1 h to 4 d).
const MEAN_LIFE_H: u64 = 25;

/// Parses `KIND[:seed=N][:days=D]` (the part after `synth:`) and generates the trace.
pub fn load(spec: &str) -> Result<Trace, TraceError> {
    let bad = |why: String| {
        TraceError::Spec(format!(
            "synth:{spec}: {why}; expected synth:KIND[:seed=N][:days=D], KIND one of {}",
            KINDS.join(", ")
        ))
    };
    let mut parts = spec.split(':');
    let kind = parts.next().unwrap_or("");
    let (mut seed, mut days) = (1u64, None);
    for p in parts {
        let (k, v) = p
            .split_once('=')
            .ok_or_else(|| bad(format!("`{p}` is not KEY=VALUE")))?;
        let n: u64 = v.parse().map_err(|_| bad(format!("{k} `{v}` is not a whole number")))?;
        match k {
            "seed" => seed = n,
            "days" if (1..=MAX_DAYS).contains(&n) => days = Some(n),
            "days" => return Err(bad(format!("days {n} is out of range 1..={MAX_DAYS}"))),
            other => return Err(bad(format!("unknown key `{other}`"))),
        }
    }
    match kind {
        "many-tenants" => Ok(many_tenants(seed, days.unwrap_or(14))),
        "mixed-sizes" => Ok(mixed_sizes(seed, days.unwrap_or(30))),
        "many-services" => Ok(many_services(seed, days.unwrap_or(14))),
        other => Err(bad(format!("unknown kind `{other}`"))),
    }
}

/// Uniform in `lo..=hi` ms.
fn between(rng: &mut Rng, lo: u64, hi: u64) -> u64 {
    rng.range(lo, hi)
}

/// Log-uniform-ish duration: pick an octave of `lo..hi` uniformly, then a point in it,
/// so short jobs are as common as long ones per octave (as in real job-length data).
fn log_between(rng: &mut Rng, lo: u64, hi: u64) -> u64 {
    let mut octaves = 0;
    while lo << (octaves + 1) <= hi && octaves < 40 {
        octaves += 1;
    }
    let o = rng.range(0, octaves);
    let a = lo << o;
    rng.range(a, (a * 2).min(hi)).max(1)
}

fn pick<T: Copy>(rng: &mut Rng, xs: &[T]) -> T {
    xs[rng.index(xs.len())]
}

/// The `many-tenants` trace (see the module docs).
pub fn many_tenants(seed: u64, days: u64) -> Trace {
    let horizon = days.min(MAX_DAYS) * DAY_MS;
    let mut root = Rng::new(seed);
    let mut jobs = Vec::new();
    for s in 0..SERVICES {
        let mut rng = root.fork();
        let tenant = format!("svc-{s:03}");
        let replica = |submit_ms: u64, duration_ms: u64| Job {
            tenant: tenant.clone(),
            kind: Kind::Inference,
            submit_ms,
            gpue: 1000,
            duration_ms,
        };
        // Long-lived base replicas, each replaced when it ends (first ones within the
        // first hour, so the services come up together as after a cluster rebuild).
        for _ in 0..rng.range(8, 20) {
            let mut at = rng.below(HOUR_MS);
            while at < horizon {
                let life = between(&mut rng, DAY_MS, 5 * DAY_MS);
                // Services end with the trace (a replay should not idle on for days).
                jobs.push(replica(at, life.min(horizon - at)));
                at += life;
            }
        }
        // Diurnal extra replicas: about peak * profile(hour) running at any time; each
        // lives 2 to 6 hours (4 on average), so a quarter of that is submitted per hour.
        let peak = rng.range(4, 16);
        let shift = rng.below(4);
        let mut owed_pct = 0; // carried fraction of a replica, in percent of one
        for h in 0..horizon / HOUR_MS {
            let hour_of_day = usize::try_from((h + 24 - shift) % 24).unwrap_or(0);
            owed_pct += peak * DIURNAL_PCT[hour_of_day] / 4;
            while owed_pct >= 100 {
                owed_pct -= 100;
                let at = h * HOUR_MS + rng.below(HOUR_MS);
                let life = between(&mut rng, 2 * HOUR_MS, 6 * HOUR_MS);
                jobs.push(replica(at, life.min(horizon.saturating_sub(at)).max(1)));
            }
        }
    }
    for b in 0..BATCH_TEAMS {
        let mut rng = root.fork();
        let tenant = format!("batch-{b:02}");
        // About one job an hour: gaps uniform in 0..2 h.
        let mut at = rng.below(2 * HOUR_MS);
        while at < horizon {
            jobs.push(Job {
                tenant: tenant.clone(),
                kind: Kind::Training,
                submit_ms: at,
                gpue: 1000 * pick(&mut rng, &[1, 1, 2, 4, 8]),
                duration_ms: log_between(&mut rng, HOUR_MS, 12 * HOUR_MS),
            });
            at += rng.below(2 * HOUR_MS);
        }
    }
    let mut trace = Trace {
        source: format!("synth:many-tenants:seed={seed}:days={days}"),
        jobs,
        notes: vec![format!(
            "synthetic (seed {seed}, {days} days): {SERVICES} inference services of one-GPU replicas, long-lived plus a diurnal extra; \
             {BATCH_TEAMS} batch teams of 1-8 GPU training jobs; its own policy (services weight 1, batch teams 3, guarantees half the weight share)"
        )],
        policy_yaml: Some(many_tenants_policy()),
    };
    trace.sort();
    trace
}

/// The policy of `many-tenants`: weights 1 (services) and 3 (batch teams); guarantees
/// half the weight share; caps at 5 % (services) and 10 % (batch); services are never
/// preempted.
pub fn many_tenants_policy() -> String {
    let total_weight = SERVICES + 3 * BATCH_TEAMS;
    // Half the weight share, in hundredths of a percent (basis points), rounded down.
    let min_bp = |w: usize| 10_000 * w / total_weight / 2;
    let pct = |bp: usize| format!("{}.{:02}", bp / 100, bp % 100);
    let mut y = String::from(
        "# Generated by kvota sim for synth:many-tenants.\napiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata:\n  name: synth-many-tenants\nspec:\n  decayHalfLife: 24h\n  tenants:\n",
    );
    for s in 0..SERVICES {
        let _ = writeln!(
            y,
            "  - {{name: svc-{s:03}, weight: 1, minShare: {}, maxShare: 5, preemptible: false}}",
            pct(min_bp(1))
        );
    }
    for b in 0..BATCH_TEAMS {
        let _ = writeln!(
            y,
            "  - {{name: batch-{b:02}, weight: 3, minShare: {}, maxShare: 10, preemptible: true}}",
            pct(min_bp(3))
        );
    }
    y
}

/// Replicas each `many-services` service keeps, in service order (`svc-000` first):
/// `LARGEST_SERVICE / r` for the rank `r` a seeded shuffle gives it.
pub fn many_services_sizes(seed: u64) -> Vec<u64> {
    let mut rng = Rng::new(seed ^ 0x5e5_1ce5);
    let mut rank: Vec<u64> = (1u64..).take(MANY_SERVICES).collect();
    for i in (1..rank.len()).rev() {
        rank.swap(i, rng.index(i + 1));
    }
    rank.iter().map(|&r| (LARGEST_SERVICE / r).max(1)).collect()
}

/// The `many-services` trace (see the module docs).
pub fn many_services(seed: u64, days: u64) -> Trace {
    let horizon = days.min(MAX_DAYS) * DAY_MS;
    let sizes = many_services_sizes(seed);
    let mut root = Rng::new(seed);
    let mut jobs = Vec::new();
    for (s, &n) in sizes.iter().enumerate() {
        let mut rng = root.fork();
        let tenant = format!("svc-{s:03}");
        let pod = |rng: &mut Rng, at: u64| Job {
            tenant: tenant.clone(),
            kind: Kind::Inference,
            submit_ms: at,
            gpue: 1000,
            duration_ms: log_between(rng, HOUR_MS, 4 * DAY_MS).min(horizon - at),
        };
        // The backlog: as many pods as the service keeps, there when the trace starts.
        for _ in 0..n {
            jobs.push(pod(&mut rng, 0));
        }
        // Then a stream of new pods, about `n` running on average (a pod lives about
        // MEAN_LIFE_H hours), at a rate that drifts day by day between half and one and
        // a half times the mean.
        let mut owed_milli = 0;
        let mut rate_pct = 100;
        for h in 0..horizon / HOUR_MS {
            if h % 24 == 0 {
                rate_pct = rng.range(50, 150);
            }
            owed_milli += n * 1000 * rate_pct / 100 / MEAN_LIFE_H;
            while owed_milli >= 1000 {
                owed_milli -= 1000;
                let at = h * HOUR_MS + rng.below(HOUR_MS);
                jobs.push(pod(&mut rng, at));
            }
        }
    }
    let total: u64 = sizes.iter().sum();
    let mut trace = Trace {
        source: format!("synth:many-services:seed={seed}:days={days}"),
        jobs,
        notes: vec![format!(
            "synthetic (seed {seed}, {days} days): {MANY_SERVICES} inference services of one-GPU pods living 1 h to 4 d, \
             {total} replicas in all (Zipf sizes, largest {LARGEST_SERVICE}), all submitted at time 0 as a backlog and replaced as they end; \
             its own policy (non-preemptible, minShare 0, no cap, weight sqrt(size), half-life 6 h)"
        )],
        policy_yaml: Some(many_services_policy(&sizes)),
    };
    trace.sort();
    trace
}

/// The policy of `many-services` for the given sizes: weight `sqrt(size)` to a
/// thousandth, minShare 0, maxShare 100, non-preemptible, half-life 6 h.
pub fn many_services_policy(sizes: &[u64]) -> String {
    let mut y = String::from(
        "# Generated by kvota sim for synth:many-services.\napiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata:\n  name: synth-many-services\nspec:\n  decayHalfLife: 6h\n  tenants:\n",
    );
    for (s, &n) in sizes.iter().enumerate() {
        let w = (n * 1_000_000).isqrt();
        let _ = writeln!(
            y,
            "  - {{name: svc-{s:03}, weight: {}.{:03}, minShare: 0, maxShare: 100, preemptible: false}}",
            w / 1000,
            w % 1000
        );
    }
    y
}

/// The `mixed-sizes` trace (see the module docs).
pub fn mixed_sizes(seed: u64, days: u64) -> Trace {
    let horizon = days.min(MAX_DAYS) * DAY_MS;
    let mut root = Rng::new(seed);
    let mut jobs = Vec::new();
    // Inference: replicas of 0.25 to 2 GPUs, arriving about every 8 minutes, living 2 h
    // to 4 days (mean about 20 h): about 110 GPUs held on average.
    let mut rng = root.fork();
    let mut at = 0;
    while at < horizon {
        let gpue = pick(&mut rng, &[250, 500, 500, 1000, 1000, 2000]);
        let life = log_between(&mut rng, 2 * HOUR_MS, 96 * HOUR_MS);
        jobs.push(Job {
            tenant: "inference".into(),
            kind: Kind::Inference,
            submit_ms: at,
            gpue,
            duration_ms: life.min(horizon - at),
        });
        at += rng.below(16 * 60_000);
    }
    // Training: 1 to 32 GPUs, one job every 1.5 hours, running 1 to 48 hours.
    let mut rng = root.fork();
    let mut at = rng.below(3 * HOUR_MS);
    while at < horizon {
        jobs.push(Job {
            tenant: "training".into(),
            kind: Kind::Training,
            submit_ms: at,
            gpue: 1000 * pick(&mut rng, &[1, 1, 2, 4, 8, 8, 16, 32]),
            duration_ms: log_between(&mut rng, HOUR_MS, 48 * HOUR_MS),
        });
        at += rng.below(3 * HOUR_MS);
    }
    // Research: 0.5 to 8 GPUs, every 10 minutes, running 10 minutes to 6 hours.
    let mut rng = root.fork();
    let mut at = rng.below(20 * 60_000);
    while at < horizon {
        jobs.push(Job {
            tenant: "research".into(),
            kind: Kind::Training,
            submit_ms: at,
            gpue: pick(&mut rng, &[500, 1000, 1000, 2000, 4000, 8000]),
            duration_ms: log_between(&mut rng, 10 * 60_000, 6 * HOUR_MS),
        });
        at += rng.below(20 * 60_000);
    }
    let mut trace = Trace {
        source: format!("synth:mixed-sizes:seed={seed}:days={days}"),
        jobs,
        notes: vec![format!(
            "synthetic (seed {seed}, {days} days): the article's tenants with pods of 0.25 to 2 GPUs (inference), 1 to 32 GPUs (training) and 0.5 to 8 GPUs (research)"
        )],
        policy_yaml: None,
    };
    trace.sort();
    trace
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvota_fairness::policy::Policy;

    #[test]
    fn same_seed_same_trace_and_another_seed_another() {
        for kind in KINDS {
            let a = load(&format!("{kind}:seed=7:days=3")).expect("a");
            let b = load(&format!("{kind}:seed=7:days=3")).expect("b");
            let c = load(&format!("{kind}:seed=8:days=3")).expect("c");
            assert_eq!(a.jobs, b.jobs, "{kind}");
            assert_ne!(a.jobs, c.jobs, "{kind}");
            assert!(
                a.jobs.windows(2).all(|w| w[0].submit_ms <= w[1].submit_ms),
                "{kind}: sorted"
            );
            assert!(
                a.jobs.iter().all(|j| j.submit_ms < 3 * DAY_MS && j.duration_ms > 0),
                "{kind}"
            );
        }
    }

    #[test]
    fn many_tenants_has_150_tenants_of_one_gpu_replicas_and_its_policy_names_them() {
        let t = many_tenants(7, 14);
        let names = t.tenants();
        assert_eq!(names.len(), SERVICES + BATCH_TEAMS);
        for j in &t.jobs {
            match j.kind {
                Kind::Inference => assert!(j.tenant.starts_with("svc-") && j.gpue == 1000, "{j:?}"),
                Kind::Training => assert!(
                    j.tenant.starts_with("batch-") && [1000, 2000, 4000, 8000].contains(&j.gpue),
                    "{j:?}"
                ),
            }
        }
        // Diurnal: more replicas start in the afternoon than at night (day 3, all services).
        let starts = |h: u64| {
            t.jobs
                .iter()
                .filter(|j| j.kind == Kind::Inference && j.submit_ms / HOUR_MS == 72 + h)
                .count()
        };
        assert!(
            starts(14) > 3 * starts(2).max(1),
            "afternoon {} night {}",
            starts(14),
            starts(2)
        );
        // Long-lived: the base replicas live at least a day.
        assert!(t.jobs.iter().filter(|j| j.duration_ms >= DAY_MS).count() > 1000);
        let policy = Policy::from_yaml(t.policy_yaml.as_deref().expect("policy")).expect("valid policy");
        for n in &names {
            assert!(policy.tenant_index(n).is_some(), "{n}");
        }
        let min_total: u32 = policy.tenants.iter().map(|t| t.min_share_bp).sum();
        assert!(min_total <= 10_000);
    }

    #[test]
    fn many_services_is_150_non_preemptible_services_with_a_backlog_and_sqrt_weights() {
        let t = many_services(7, 14);
        let names = t.tenants();
        assert_eq!(names.len(), MANY_SERVICES);
        assert!(t
            .jobs
            .iter()
            .all(|j| j.kind == Kind::Inference && j.gpue == 1000 && j.tenant.starts_with("svc-")));
        let sizes = many_services_sizes(7);
        let total: u64 = sizes.iter().sum();
        let backlog = t.jobs.iter().filter(|j| j.submit_ms == 0).count();
        assert_eq!(u64::try_from(backlog).ok(), Some(total));
        assert!((3_072..4_000).contains(&total), "{total}");
        assert_eq!(sizes.iter().max(), Some(&LARGEST_SERVICE));
        assert_eq!(sizes.iter().min(), Some(&4));
        // Hours to days.
        assert!(t.jobs.iter().all(|j| j.duration_ms <= 4 * DAY_MS));
        assert!(t.jobs.iter().filter(|j| j.duration_ms >= DAY_MS).count() > 5_000);
        assert!(t.jobs.iter().filter(|j| j.duration_ms < 4 * HOUR_MS).count() > 5_000);
        let policy = Policy::from_yaml(t.policy_yaml.as_deref().expect("policy")).expect("valid policy");
        for (s, &n) in sizes.iter().enumerate() {
            let tp = &policy.tenants[policy.tenant_index(&format!("svc-{s:03}")).expect("named")];
            assert!(!tp.preemptible && tp.min_share_bp == 0 && tp.max_share_bp == 10_000);
            assert_eq!(tp.decay_half_life_ms, 6 * HOUR_MS);
            let w = tp.weight_milli;
            assert!(w * w <= n * 1_000_000 && (w + 1) * (w + 1) > n * 1_000_000, "{n}: {w}");
        }
        assert_ne!(many_services_sizes(7), many_services_sizes(8));
    }

    #[test]
    fn mixed_sizes_spans_a_quarter_gpu_to_32_gpus() {
        let t = mixed_sizes(7, 30);
        assert_eq!(t.tenants(), ["inference", "research", "training"]);
        let min = t.jobs.iter().map(|j| j.gpue).min();
        let max = t.jobs.iter().map(|j| j.gpue).max();
        assert_eq!((min, max), (Some(250), Some(32_000)));
        assert!(t.jobs.iter().any(|j| j.gpue < 1000 && j.kind == Kind::Inference));
        assert!(t.jobs.iter().filter(|j| j.gpue >= 16_000).count() > 20);
        assert!(
            t.policy_yaml.is_none(),
            "uses the article's policy, kvota sim's default"
        );
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        assert!(load("nope")
            .expect_err("kind")
            .to_string()
            .contains("unknown kind `nope`"));
        assert!(load("many-tenants:seed=x")
            .expect_err("seed")
            .to_string()
            .contains("seed `x`"));
        assert!(load("many-tenants:days=0")
            .expect_err("days")
            .to_string()
            .contains("out of range"));
        assert!(load("many-tenants:colour=3")
            .expect_err("key")
            .to_string()
            .contains("unknown key"));
    }
}
