//! The demo's script: three clusters, the article's three teams, and a morning that
//! puts fairness under stress. Everything here is generated from the seed, so a run
//! replays exactly (the workload; timings on a busy machine vary a little).
//!
//! Times are *scenario* milliseconds; the driver divides them by `--speed`.

use std::collections::BTreeMap;

use kvota_fairness::resources::NVIDIA_GPU;

/// The MIG profile of the edge cluster's sliced node (an A100 80GB gives two).
pub const MIG_SLICE: &str = "nvidia.com/mig-3g.40gb";

/// Quiet night until the burst.
pub const BURST_AT_MS: u64 = 15_000;
/// Training's jobs arrive within this window after [`BURST_AT_MS`].
pub const BURST_SPREAD_MS: u64 = 4_000;
/// Training jobs in the burst.
pub const BURST_JOBS: usize = 240;
/// Inference load rises over this window ("toward noon").
pub const NOON_FROM_MS: u64 = 35_000;
/// End of the rise.
pub const NOON_TO_MS: u64 = 50_000;
/// The partition of [`PARTITIONED`] starts.
pub const PARTITION_FROM_MS: u64 = 55_000;
/// And heals.
pub const PARTITION_TO_MS: u64 = 70_000;
/// Index of the cluster that is cut off.
pub const PARTITIONED: usize = 1;
/// The control-plane leader is killed.
pub const KILL_LEADER_AT_MS: u64 = 84_000;
/// And its node restarted from its data directory.
pub const RESTART_AT_MS: u64 = 94_000;
/// Workload stops; the summary follows.
pub const END_MS: u64 = 106_000;
/// A denied pod's owner (a job controller) retries after this long.
pub const RETRY_MS: u64 = 1_000;

/// One member cluster.
#[derive(Clone, Debug)]
pub struct ClusterSpec {
    /// Cluster id.
    pub name: &'static str,
    /// Devices per node.
    pub nodes: Vec<BTreeMap<String, u64>>,
    /// For people.
    pub description: &'static str,
}

fn node(resource: &str, count: u64) -> BTreeMap<String, u64> {
    [(resource.to_string(), count)].into()
}

/// East and west have 32 GPUs each; edge has 16, half of them split into MIG slices.
pub fn clusters() -> Vec<ClusterSpec> {
    vec![
        ClusterSpec {
            name: "east",
            nodes: vec![node(NVIDIA_GPU, 8); 4],
            description: "4 nodes x 8 GPUs",
        },
        ClusterSpec {
            name: "west",
            nodes: vec![node(NVIDIA_GPU, 8); 4],
            description: "4 nodes x 8 GPUs",
        },
        ClusterSpec {
            name: "edge",
            nodes: vec![node(NVIDIA_GPU, 8), node(MIG_SLICE, 16)],
            description: "8 GPUs + 8 GPUs as 16 MIG 3g.40gb slices",
        },
    ]
}

/// A pod the workload submits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arrival {
    /// When it is first submitted (scenario ms).
    pub at_ms: u64,
    /// Index into [`clusters`].
    pub cluster: usize,
    /// Namespace = tenant name (labelled `kvota.dev/tenant`).
    pub tenant: &'static str,
    /// Pod name, unique.
    pub name: String,
    /// Device resource.
    pub resource: &'static str,
    /// How many.
    pub count: u32,
    /// Run time once bound (scenario ms).
    pub duration_ms: u64,
    /// Pod priority.
    pub priority: i32,
}

/// A labelled moment of the script.
#[derive(Clone, Debug)]
pub struct Phase {
    /// Scenario ms.
    pub at_ms: u64,
    /// Short name shown in the header.
    pub name: &'static str,
    /// Event text.
    pub text: String,
}

/// The whole script.
#[derive(Clone, Debug)]
pub struct Script {
    /// Sorted by `at_ms`.
    pub arrivals: Vec<Arrival>,
    /// Sorted by `at_ms`.
    pub phases: Vec<Phase>,
}

/// The demo's generator: the workspace's seeded one (`kvota_fairness::rng`), salted so
/// the demo's streams differ from a simulation's of the same seed.
struct Rng(kvota_fairness::rng::Rng);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(kvota_fairness::rng::Rng::new(seed ^ 0x6b76_6f74_6164_656d))
    }

    /// Uniform in `lo..=hi`; `lo`, drawing nothing, when `hi <= lo` (the script's
    /// numbers for every seed depend on it).
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        self.0.range(lo, hi)
    }
}

/// Builds the script for `seed`.
pub fn script(seed: u64) -> Script {
    let mut rng = Rng::new(seed);
    let mut arrivals = Vec::new();
    let forever = END_MS + 120_000;
    // Night: inference serves steady load in every cluster; MIG slices at the edge.
    for (cluster, n, resource) in [(0, 5, NVIDIA_GPU), (1, 5, NVIDIA_GPU), (2, 6, MIG_SLICE)] {
        for i in 0..n {
            arrivals.push(Arrival {
                at_ms: rng.range(0, 2_000),
                cluster,
                tenant: "inference",
                name: format!("serve-{cluster}-{i}"),
                resource,
                count: 1,
                duration_ms: forever,
                priority: 1000,
            });
        }
    }
    // Research trickles all day: one-GPU experiments.
    let mut t = rng.range(0, 1_500);
    let mut i = 0;
    while t < END_MS {
        arrivals.push(Arrival {
            at_ms: t,
            cluster: usize::try_from(rng.range(0, 2)).unwrap_or(0),
            tenant: "research",
            name: format!("exp-{i}"),
            resource: NVIDIA_GPU,
            count: 1,
            duration_ms: rng.range(8_000, 16_000),
            priority: 0,
        });
        i += 1;
        t += rng.range(1_500, 3_500);
    }
    training_burst(&mut rng, &mut arrivals);
    // Toward noon inference scales out.
    let mut k = 0;
    for (cluster, n, resource) in [(0, 5, NVIDIA_GPU), (1, 5, NVIDIA_GPU), (2, 10, MIG_SLICE)] {
        for _ in 0..n {
            arrivals.push(Arrival {
                at_ms: rng.range(NOON_FROM_MS, NOON_TO_MS),
                cluster,
                tenant: "inference",
                name: format!("serve-noon-{k}"),
                resource,
                count: 1,
                duration_ms: forever,
                priority: 1000,
            });
            k += 1;
        }
    }
    arrivals.sort_by(|a, b| a.at_ms.cmp(&b.at_ms).then_with(|| a.name.cmp(&b.name)));
    let phases = phases();
    Script { arrivals, phases }
}

/// Monday 8 AM: training submits a burst across all clusters.
fn training_burst(rng: &mut Rng, arrivals: &mut Vec<Arrival>) {
    for j in 0..BURST_JOBS {
        let cluster = match rng.range(0, 99) {
            0..=44 => 0,
            45..=84 => 1,
            _ => 2,
        };
        let count = match rng.range(0, 9) {
            0..=5 => 1,
            6..=8 => 2,
            _ => 4,
        };
        arrivals.push(Arrival {
            at_ms: BURST_AT_MS + rng.range(0, BURST_SPREAD_MS),
            cluster,
            tenant: "training",
            name: format!("train-{j}"),
            resource: NVIDIA_GPU,
            count,
            duration_ms: rng.range(4_000, 12_000),
            priority: 0,
        });
    }
}

/// The day's phases, as the demo announces them.
fn phases() -> Vec<Phase> {
    let west = clusters().get(PARTITIONED).map_or("west", |c| c.name);
    vec![
        Phase {
            at_ms: 0,
            name: "quiet night",
            text: "quiet night: inference serves steady load, research trickles".into(),
        },
        Phase {
            at_ms: BURST_AT_MS,
            name: "Monday 8 AM",
            text: format!("Monday 8 AM: training submits {BURST_JOBS} GPU jobs across all clusters"),
        },
        Phase {
            at_ms: NOON_FROM_MS,
            name: "toward noon",
            text: "toward noon: inference load rises".into(),
        },
        Phase {
            at_ms: PARTITION_FROM_MS,
            name: "partition",
            text: format!("partition: {west} is cut off from the control plane"),
        },
        Phase {
            at_ms: PARTITION_TO_MS,
            name: "healed",
            text: format!("healed: {west} reaches the control plane again"),
        },
        Phase {
            at_ms: KILL_LEADER_AT_MS,
            name: "leader killed",
            text: "killing the control-plane leader (SIGKILL)".into(),
        },
        Phase {
            at_ms: RESTART_AT_MS,
            name: "afternoon",
            text: "restarting the killed node from its data directory".into(),
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_replays_from_its_seed() {
        assert_eq!(script(7).arrivals, script(7).arrivals);
        assert_ne!(script(7).arrivals, script(8).arrivals);
        let s = script(1);
        let training = s.arrivals.iter().filter(|a| a.tenant == "training").count();
        assert_eq!(training, BURST_JOBS);
        assert!(s.arrivals.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
        assert!(s.arrivals.iter().all(|a| a.cluster < clusters().len()));
        let mut names: Vec<&str> = s.arrivals.iter().map(|a| a.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), s.arrivals.len(), "pod names are unique");
    }
}
