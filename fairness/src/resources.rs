//! Weighted GPU-equivalents (GPUe): how much of a GPU each Kubernetes resource is
//! worth, and how many GPUe a pod asks for, counted the way Kubernetes counts a pod's
//! requests.
//!
//! All numbers are integers in thousandths (milli-GPUe, quantity thousandths);
//! arithmetic saturates instead of overflowing, and no function here panics.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::units::{parse_quantity_milli, QuantityError};
use crate::MilliGpue;

/// The resource name of a whole NVIDIA GPU; weighs one GPUe (1000 milli) by default.
pub const NVIDIA_GPU: &str = "nvidia.com/gpu";

/// The resource name of a whole AMD GPU; weighs one GPUe (1000 milli) by default.
pub const AMD_GPU: &str = "amd.com/gpu";

/// The prefix of NVIDIA MIG slice resources (`nvidia.com/mig-<G>g.<memory>`, the
/// device plugin's "mixed" strategy).
pub const NVIDIA_MIG_PREFIX: &str = "nvidia.com/mig-";

/// The number of compute slices in a whole MIG-capable GPU: a `<G>g` profile weighs
/// `G / 7` of a GPU by default.
pub const MIG_SLICES_PER_GPU: u64 = 7;

/// Milli-GPUe per ONE unit of each resource.
///
/// Explicit weights (set with [`ResourceWeights::set`]) win; otherwise the built-in
/// defaults of [`ResourceWeights::weight_milli`] apply. A resource with no weight, or
/// weight 0, is not a GPU resource and contributes no GPUe.
#[derive(Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ResourceWeights {
    /// Resource name -> milli-GPUe per one unit, overriding the defaults.
    #[serde(default)]
    explicit: BTreeMap<String, u64>,
}

impl ResourceWeights {
    /// Weights with no explicit entries: only the built-in defaults apply.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the weight of `resource` to `milli_gpue_per_unit` milli-GPUe per one unit,
    /// replacing any earlier explicit weight and overriding the default. A weight of 0
    /// marks the resource as not a GPU resource.
    pub fn set(&mut self, resource: &str, milli_gpue_per_unit: u64) {
        self.explicit.insert(resource.to_owned(), milli_gpue_per_unit);
    }

    /// The explicitly set weights (milli-GPUe per one unit), by resource name. Defaults
    /// are not included.
    #[must_use]
    pub fn explicit(&self) -> &BTreeMap<String, u64> {
        &self.explicit
    }

    /// Milli-GPUe per one unit of `resource`, or `None` if it is not a GPU resource.
    ///
    /// The explicit weight if one is set; otherwise the defaults: `nvidia.com/gpu` and
    /// `amd.com/gpu` weigh 1000; a MIG slice `nvidia.com/mig-<G>g.<memory>` with
    /// `G` in 1..=7 (e.g. `nvidia.com/mig-1g.5gb`, `nvidia.com/mig-3g.40gb`,
    /// `nvidia.com/mig-1g.10gb+me`) weighs `G` sevenths of a GPU rounded to the
    /// nearest milli (1g -> 143, 2g -> 286, 3g -> 429, 4g -> 571, 7g -> 1000); every
    /// other name (cpu, memory, ephemeral-storage, other vendors) gives `None`.
    #[must_use]
    pub fn weight_milli(&self, resource: &str) -> Option<MilliGpue> {
        if let Some(&weight) = self.explicit.get(resource) {
            return Some(weight);
        }
        default_weight_milli(resource)
    }

    /// Whether `resource` counts towards GPUe: its weight is known and above zero.
    #[must_use]
    pub fn is_gpu_resource(&self, resource: &str) -> bool {
        self.weight_milli(resource).is_some_and(|w| w > 0)
    }

    /// The milli-GPUe of `quantity_milli` thousandths of a unit of `resource`:
    /// `ceil(quantity_milli * weight / 1000)`, computed in 128 bits and saturating at
    /// `u64::MAX`; 0 for a resource that is not a GPU resource.
    ///
    /// E.g. two `nvidia.com/mig-1g.5gb` (quantity_milli 2000) -> 286.
    #[must_use]
    pub fn gpue_milli(&self, resource: &str, quantity_milli: u64) -> MilliGpue {
        match self.weight_milli(resource) {
            Some(weight) if weight > 0 => {
                let product = u128::from(quantity_milli) * u128::from(weight);
                u64::try_from(product.div_ceil(1000)).unwrap_or(u64::MAX)
            }
            _ => 0,
        }
    }

    /// The milli-GPUe of a node's or cluster's capacity: the saturating sum of
    /// [`gpue_milli`](Self::gpue_milli) over its resources, whose values are quantity
    /// thousandths (as returned by [`parse_quantity_milli`]). Non-GPU resources add 0.
    #[must_use]
    pub fn capacity_gpue_milli(&self, capacity: &BTreeMap<String, u64>) -> MilliGpue {
        capacity
            .iter()
            .map(|(resource, &quantity_milli)| self.gpue_milli(resource, quantity_milli))
            .fold(0u64, u64::saturating_add)
    }
}

/// The built-in weight of `resource`, if it has one.
fn default_weight_milli(resource: &str) -> Option<MilliGpue> {
    if resource == NVIDIA_GPU || resource == AMD_GPU {
        return Some(1000);
    }
    let slices = mig_compute_slices(resource)?;
    // Round slices * 1000 / 7 to the nearest integer (halves cannot occur).
    Some((slices * 1000 * 2 + MIG_SLICES_PER_GPU) / (2 * MIG_SLICES_PER_GPU))
}

/// `G` from `nvidia.com/mig-<G>g.<memory>` when `G` is 1..=7 and `<memory>` is not
/// empty; `None` for any other name.
fn mig_compute_slices(resource: &str) -> Option<u64> {
    let profile = resource.strip_prefix(NVIDIA_MIG_PREFIX)?;
    let digits_len = profile.bytes().take_while(u8::is_ascii_digit).count();
    // ASCII digits, so this split is on a char boundary.
    let (digits, rest) = profile.split_at(digits_len);
    let memory = rest.strip_prefix("g.")?;
    if digits.is_empty() || digits.len() > 2 || memory.is_empty() {
        return None;
    }
    let slices: u64 = digits.parse().ok()?;
    (1..=MIG_SLICES_PER_GPU).contains(&slices).then_some(slices)
}

/// The resources of one container of a pod, as written in its spec (quantity strings).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerResources {
    /// The container's name.
    pub name: String,
    /// `resources.requests`: resource name -> quantity string.
    pub requests: BTreeMap<String, String>,
    /// `resources.limits`: resource name -> quantity string.
    pub limits: BTreeMap<String, String>,
    /// init container with restartPolicy: Always (a sidecar)
    pub restartable: bool,
}

/// The resource-related parts of a pod spec, without Kubernetes types.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodResources {
    /// `spec.initContainers`, in declaration order (sidecars have `restartable`).
    pub init_containers: Vec<ContainerResources>,
    /// `spec.containers`, the app containers.
    pub containers: Vec<ContainerResources>,
    /// `spec.overhead` (from the RuntimeClass): resource name -> quantity string.
    pub overhead: BTreeMap<String, String>,
}

/// Which map of a pod spec a quantity came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum QuantityField {
    /// A container's `resources.requests`.
    Requests,
    /// A container's `resources.limits`.
    Limits,
    /// The pod's `spec.overhead`.
    Overhead,
}

impl fmt::Display for QuantityField {
    /// Writes the field's name as in a pod spec: `requests`, `limits` or `overhead`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Requests => "requests",
            Self::Limits => "limits",
            Self::Overhead => "overhead",
        })
    }
}

/// Why a pod's resources could not be counted.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ResourceError {
    /// A quantity string in the pod spec is not a valid Kubernetes quantity.
    #[error("{location}: {field}[{resource:?}] is not a valid quantity: {error}")]
    BadQuantity {
        /// Where in the pod spec: `spec.containers[1] "trainer"`,
        /// `spec.initContainers[0] "setup"`, or `spec` for the pod overhead.
        location: String,
        /// The map the quantity is in.
        field: QuantityField,
        /// The resource name the quantity is given for.
        resource: String,
        /// What is wrong with the quantity, and what is accepted.
        error: QuantityError,
    },
}

/// Parses every quantity of `map`, naming `location` and `field` on failure.
fn parse_map(
    map: &BTreeMap<String, String>,
    location: &dyn Fn() -> String,
    field: QuantityField,
) -> Result<BTreeMap<String, u64>, ResourceError> {
    map.iter()
        .map(|(resource, quantity)| {
            parse_quantity_milli(quantity)
                .map(|milli| (resource.clone(), milli))
                .map_err(|error| ResourceError::BadQuantity {
                    location: location(),
                    field,
                    resource: resource.clone(),
                    error,
                })
        })
        .collect()
}

/// One container's request per resource: `requests[r]` if present, else `limits[r]`
/// (Kubernetes defaults a missing request to the limit).
fn container_requests_milli(
    container: &ContainerResources,
    list: &str,
    index: usize,
) -> Result<BTreeMap<String, u64>, ResourceError> {
    let location = || format!("spec.{list}[{index}] {:?}", container.name);
    let requests = parse_map(&container.requests, &location, QuantityField::Requests)?;
    let mut effective = parse_map(&container.limits, &location, QuantityField::Limits)?;
    effective.extend(requests);
    Ok(effective)
}

/// The pod's request per resource name (quantity thousandths), as the scheduler and
/// ResourceQuota count it.
///
/// For each container, the request of resource `r` is `requests[r]` if present, else
/// `limits[r]` (extended resources such as GPUs are usually given only as limits).
/// Sidecars (restartable init containers) run alongside the app, so per resource:
/// `max(sum(app containers) + sum(all sidecars), max over each non-restartable init
/// container i of (its request + sum of sidecars declared before i))`, plus
/// `overhead[r]`. Every resource named by any container or the overhead is in the
/// result (possibly with 0). Sums saturate at `u64::MAX`.
///
/// # Errors
/// [`ResourceError::BadQuantity`] for the first quantity string (containers in spec
/// order: init containers, app containers, then overhead) that
/// [`parse_quantity_milli`] rejects, naming the container, the map and the resource.
pub fn effective_requests_milli(pod: &PodResources) -> Result<BTreeMap<String, u64>, ResourceError> {
    let init = pod
        .init_containers
        .iter()
        .enumerate()
        .map(|(i, c)| Ok((c.restartable, container_requests_milli(c, "initContainers", i)?)))
        .collect::<Result<Vec<_>, ResourceError>>()?;
    let app = pod
        .containers
        .iter()
        .enumerate()
        .map(|(i, c)| container_requests_milli(c, "containers", i))
        .collect::<Result<Vec<_>, ResourceError>>()?;
    let overhead = parse_map(&pod.overhead, &|| "spec".to_owned(), QuantityField::Overhead)?;

    let names: BTreeSet<&String> = init
        .iter()
        .flat_map(|(_, m)| m.keys())
        .chain(app.iter().flat_map(BTreeMap::keys))
        .chain(overhead.keys())
        .collect();

    let get = |m: &BTreeMap<String, u64>, r: &str| m.get(r).copied().unwrap_or(0);
    let mut result = BTreeMap::new();
    for name in names {
        let total = pod_request_milli(
            app.iter().map(|m| get(m, name)),
            init.iter().map(|(restartable, m)| (*restartable, get(m, name))),
            get(&overhead, name),
        );
        result.insert(name.clone(), total);
    }
    Ok(result)
}

/// One container's request of a resource, from its `requests` and `limits` entries for
/// it (quantity thousandths, `None` where absent): the request if given, else the limit
/// (Kubernetes defaults a missing request to the limit), else 0.
#[must_use]
pub fn container_request_milli(request: Option<u64>, limit: Option<u64>) -> u64 {
    request.or(limit).unwrap_or(0)
}

/// The pod's request of one resource, as [`effective_requests_milli`] counts it, from
/// each container's request of it ([`container_request_milli`]): `app` over the app
/// containers, `init` over the init containers in declaration order (with whether each
/// is restartable, a sidecar), and the pod's overhead. That is
/// `max(sum(app) + sum(sidecars), max over each non-restartable init container i of
/// (its request + sum of sidecars declared before i)) + overhead`, sums saturating.
#[must_use]
pub fn pod_request_milli(
    app: impl IntoIterator<Item = u64>,
    init: impl IntoIterator<Item = (bool, u64)>,
    overhead_milli: u64,
) -> u64 {
    let app_sum = app.into_iter().fold(0u64, u64::saturating_add);
    let mut sidecars = 0u64;
    let mut init_peak = 0u64;
    for (restartable, request) in init {
        if restartable {
            sidecars = sidecars.saturating_add(request);
        } else {
            init_peak = init_peak.max(request.saturating_add(sidecars));
        }
    }
    app_sum
        .saturating_add(sidecars)
        .max(init_peak)
        .saturating_add(overhead_milli)
}

/// A pod's GPU-equivalents.
#[derive(Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PodGpue {
    /// The saturating sum of `per_resource_milli`.
    pub total_milli: MilliGpue,
    /// Milli-GPUe of each GPU resource (weight > 0) the pod requests, by resource name.
    pub per_resource_milli: BTreeMap<String, MilliGpue>,
}

/// The GPUe a pod asks for: its [`effective_requests_milli`], keeping only GPU
/// resources (weight > 0 in `weights`), each converted with
/// [`ResourceWeights::gpue_milli`]; `total_milli` is their saturating sum.
///
/// # Errors
/// [`ResourceError::BadQuantity`] when a quantity string in the pod is invalid (any
/// resource, GPU or not: Kubernetes would reject the pod).
pub fn pod_gpue(pod: &PodResources, weights: &ResourceWeights) -> Result<PodGpue, ResourceError> {
    let per_resource_milli: BTreeMap<String, MilliGpue> = effective_requests_milli(pod)?
        .into_iter()
        .filter(|(resource, _)| weights.is_gpu_resource(resource))
        .map(|(resource, quantity_milli)| {
            let gpue = weights.gpue_milli(&resource, quantity_milli);
            (resource, gpue)
        })
        .collect();
    let total_milli = per_resource_milli.values().fold(0u64, |sum, &v| sum.saturating_add(v));
    Ok(PodGpue {
        total_milli,
        per_resource_milli,
    })
}

/// [`pod_gpue`]'s `total_milli` for a pod whose [`effective_requests_milli`] are
/// `requests` (resource name, quantity thousandths): for a caller that counts a pod's
/// requests once, without the weights (e.g. outside a lock), and weighs them later.
#[must_use]
pub fn total_gpue_milli<'a>(
    requests: impl IntoIterator<Item = (&'a str, u64)>,
    weights: &ResourceWeights,
) -> MilliGpue {
    requests
        .into_iter()
        .filter(|(resource, _)| weights.is_gpu_resource(resource))
        .map(|(resource, quantity_milli)| weights.gpue_milli(resource, quantity_milli))
        .fold(0u64, u64::saturating_add)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIG_1G: &str = "nvidia.com/mig-1g.5gb";

    fn map(entries: &[(&str, &str)]) -> BTreeMap<String, String> {
        entries.iter().map(|&(k, v)| (k.to_owned(), v.to_owned())).collect()
    }

    fn container(name: &str, requests: &[(&str, &str)], limits: &[(&str, &str)]) -> ContainerResources {
        ContainerResources {
            name: name.to_owned(),
            requests: map(requests),
            limits: map(limits),
            restartable: false,
        }
    }

    fn sidecar(name: &str, requests: &[(&str, &str)]) -> ContainerResources {
        ContainerResources {
            restartable: true,
            ..container(name, requests, &[])
        }
    }

    fn app_pod(containers: Vec<ContainerResources>) -> PodResources {
        PodResources {
            containers,
            ..PodResources::default()
        }
    }

    fn total(pod: &PodResources) -> Result<u64, ResourceError> {
        pod_gpue(pod, &ResourceWeights::new()).map(|g| g.total_milli)
    }

    #[test]
    fn default_weights() {
        let w = ResourceWeights::new();
        let cases: &[(&str, Option<u64>)] = &[
            ("nvidia.com/gpu", Some(1000)),
            ("amd.com/gpu", Some(1000)),
            ("nvidia.com/mig-1g.5gb", Some(143)),
            ("nvidia.com/mig-1g.10gb", Some(143)),
            ("nvidia.com/mig-1g.10gb+me", Some(143)),
            ("nvidia.com/mig-2g.10gb", Some(286)),
            ("nvidia.com/mig-3g.40gb", Some(429)),
            ("nvidia.com/mig-4g.20gb", Some(571)),
            ("nvidia.com/mig-5g.40gb", Some(714)),
            ("nvidia.com/mig-6g.48gb", Some(857)),
            ("nvidia.com/mig-7g.80gb", Some(1000)),
            ("nvidia.com/mig-0g.5gb", None),
            ("nvidia.com/mig-8g.5gb", None),
            ("nvidia.com/mig-1g.", None),
            ("nvidia.com/mig-1g", None),
            ("nvidia.com/mig-g.5gb", None),
            ("nvidia.com/mig-01g.5gb", Some(143)),
            ("nvidia.com/mig-", None),
            ("cpu", None),
            ("memory", None),
            ("ephemeral-storage", None),
            ("nvidia.com/GPU", None),
            ("intel.com/gpu", None),
            ("example.com/foo", None),
            ("", None),
        ];
        for &(resource, want) in cases {
            assert_eq!(w.weight_milli(resource), want, "resource {resource:?}");
            assert_eq!(w.is_gpu_resource(resource), want.is_some(), "resource {resource:?}");
        }
    }

    #[test]
    fn explicit_weights_override_defaults() {
        let mut w = ResourceWeights::new();
        w.set(MIG_1G, 200);
        w.set("example.com/tpu", 2500);
        w.set("nvidia.com/gpu", 0);
        assert_eq!(w.weight_milli(MIG_1G), Some(200));
        assert_eq!(w.gpue_milli(MIG_1G, 2000), 400);
        assert_eq!(w.weight_milli("example.com/tpu"), Some(2500));
        assert!(w.is_gpu_resource("example.com/tpu"));
        assert_eq!(w.weight_milli("nvidia.com/gpu"), Some(0));
        assert!(!w.is_gpu_resource("nvidia.com/gpu"));
        assert_eq!(w.gpue_milli("nvidia.com/gpu", 8000), 0);
        assert_eq!(w.explicit().len(), 3);
        assert_eq!(ResourceWeights::new().explicit().len(), 0);

        let pod = app_pod(vec![container("trainer", &[], &[(MIG_1G, "2")])]);
        let gpue = pod_gpue(&pod, &w);
        assert_eq!(gpue.map(|g| g.total_milli), Ok(400));
    }

    #[test]
    fn gpue_rounds_up_and_saturates() {
        let w = ResourceWeights::new();
        assert_eq!(w.gpue_milli(MIG_1G, 2000), 286);
        assert_eq!(w.gpue_milli(MIG_1G, 1), 1);
        assert_eq!(w.gpue_milli(MIG_1G, 0), 0);
        assert_eq!(w.gpue_milli("nvidia.com/gpu", 1500), 1500);
        assert_eq!(w.gpue_milli("cpu", 64_000), 0);
        assert_eq!(w.gpue_milli("nvidia.com/gpu", u64::MAX), u64::MAX);
        let mut heavy = ResourceWeights::new();
        heavy.set("x", u64::MAX);
        assert_eq!(heavy.gpue_milli("x", u64::MAX), u64::MAX);
        assert_eq!(heavy.gpue_milli("x", 1), u64::MAX.div_ceil(1000));
    }

    #[test]
    fn capacity_sums_gpu_resources() {
        let w = ResourceWeights::new();
        let capacity: BTreeMap<String, u64> = [
            ("nvidia.com/gpu", 32_000),
            (MIG_1G, 14_000),
            ("cpu", 256_000),
            ("memory", 1_099_511_627_776_000),
        ]
        .iter()
        .map(|&(k, v)| (k.to_owned(), v))
        .collect();
        assert_eq!(w.capacity_gpue_milli(&capacity), 32_000 + 14 * 143);
        assert_eq!(w.capacity_gpue_milli(&BTreeMap::new()), 0);

        let huge: BTreeMap<String, u64> = [("nvidia.com/gpu", u64::MAX), ("amd.com/gpu", u64::MAX)]
            .iter()
            .map(|&(k, v)| (k.to_owned(), v))
            .collect();
        assert_eq!(w.capacity_gpue_milli(&huge), u64::MAX);
    }

    #[test]
    fn limits_only_gpu_counts_as_request() {
        let pod = app_pod(vec![container("trainer", &[], &[("nvidia.com/gpu", "2")])]);
        assert_eq!(total(&pod), Ok(2000));
        let requests = effective_requests_milli(&pod);
        assert_eq!(
            requests,
            Ok([("nvidia.com/gpu".to_owned(), 2000)].into_iter().collect())
        );
    }

    #[test]
    fn requests_beat_limits_when_both_present() {
        let pod = app_pod(vec![container(
            "trainer",
            &[("nvidia.com/gpu", "1"), ("cpu", "500m")],
            &[("nvidia.com/gpu", "2"), ("cpu", "2")],
        )]);
        assert_eq!(total(&pod), Ok(1000));
        let requests = effective_requests_milli(&pod);
        assert_eq!(
            requests,
            Ok([("cpu".to_owned(), 500), ("nvidia.com/gpu".to_owned(), 1000)]
                .into_iter()
                .collect())
        );
    }

    #[test]
    fn app_containers_sum() {
        let pod = app_pod(vec![
            container("a", &[], &[("nvidia.com/gpu", "1")]),
            container("b", &[("nvidia.com/gpu", "3")], &[("nvidia.com/gpu", "3")]),
        ]);
        assert_eq!(total(&pod), Ok(4000));
    }

    #[test]
    fn larger_init_container_wins() {
        let pod = PodResources {
            init_containers: vec![container("warmup", &[], &[("nvidia.com/gpu", "4")])],
            containers: vec![container("trainer", &[], &[("nvidia.com/gpu", "2")])],
            overhead: BTreeMap::new(),
        };
        assert_eq!(total(&pod), Ok(4000));

        let smaller_init = PodResources {
            init_containers: vec![container("warmup", &[], &[("nvidia.com/gpu", "1")])],
            ..pod
        };
        assert_eq!(total(&smaller_init), Ok(2000));
    }

    #[test]
    fn sidecars_add_to_app_and_to_later_init_containers() {
        // Sidecar (1 GPU) runs with the app (2 GPUs): 3.
        let pod = PodResources {
            init_containers: vec![sidecar("proxy", &[("nvidia.com/gpu", "1")])],
            containers: vec![container("trainer", &[("nvidia.com/gpu", "2")], &[])],
            overhead: BTreeMap::new(),
        };
        assert_eq!(total(&pod), Ok(3000));

        // Init "prep" (4) after sidecar "proxy" (1) peaks at 5 > app 2 + sidecars 1 + 1.
        // Init "early" (4) runs before any sidecar: 4. Sidecar "late" comes after both.
        let pod = PodResources {
            init_containers: vec![
                container("early", &[("nvidia.com/gpu", "4")], &[]),
                sidecar("proxy", &[("nvidia.com/gpu", "1")]),
                container("prep", &[("nvidia.com/gpu", "4")], &[]),
                sidecar("late", &[("nvidia.com/gpu", "1")]),
            ],
            containers: vec![container("trainer", &[("nvidia.com/gpu", "2")], &[])],
            overhead: BTreeMap::new(),
        };
        assert_eq!(total(&pod), Ok(5000));

        // With a bigger app, app + all sidecars wins: 6 + 1 + 1 = 8.
        let mut bigger_app = pod.clone();
        bigger_app.containers[0] = container("trainer", &[("nvidia.com/gpu", "6")], &[]);
        assert_eq!(total(&bigger_app), Ok(8000));

        // A sidecar that only gives limits counts them as its request.
        let mut limits_sidecar = pod;
        limits_sidecar.init_containers[1] = ContainerResources {
            restartable: true,
            ..container("proxy", &[], &[("nvidia.com/gpu", "2")])
        };
        // prep: 4 + 2 = 6 > app 2 + sidecars 2 + 1 = 5.
        assert_eq!(total(&limits_sidecar), Ok(6000));
    }

    #[test]
    fn overhead_adds() {
        let pod = PodResources {
            init_containers: vec![container("warmup", &[], &[("nvidia.com/gpu", "3")])],
            containers: vec![container("trainer", &[], &[("nvidia.com/gpu", "2"), ("cpu", "1")])],
            overhead: map(&[("nvidia.com/gpu", "500m"), ("cpu", "250m")]),
        };
        assert_eq!(total(&pod), Ok(3500));
        let requests = effective_requests_milli(&pod);
        assert_eq!(
            requests,
            Ok([("cpu".to_owned(), 1250), ("nvidia.com/gpu".to_owned(), 3500)]
                .into_iter()
                .collect())
        );
    }

    #[test]
    fn mig_slices_are_sevenths() {
        let pod = app_pod(vec![container("inference", &[], &[(MIG_1G, "2")])]);
        let gpue = pod_gpue(&pod, &ResourceWeights::new());
        assert_eq!(
            gpue,
            Ok(PodGpue {
                total_milli: 286,
                per_resource_milli: [(MIG_1G.to_owned(), 286)].into_iter().collect(),
            })
        );

        let mixed = app_pod(vec![
            container("a", &[], &[(MIG_1G, "1"), ("nvidia.com/mig-3g.40gb", "1")]),
            container("b", &[], &[("nvidia.com/gpu", "1")]),
        ]);
        let gpue = pod_gpue(&mixed, &ResourceWeights::new());
        assert_eq!(gpue.map(|g| g.total_milli), Ok(143 + 429 + 1000));
    }

    #[test]
    fn cpu_and_memory_are_ignored() {
        let pod = app_pod(vec![container(
            "web",
            &[("cpu", "4"), ("memory", "16Gi"), ("ephemeral-storage", "10Gi")],
            &[("cpu", "8"), ("memory", "32Gi"), ("example.com/fpga", "1")],
        )]);
        assert_eq!(pod_gpue(&pod, &ResourceWeights::new()), Ok(PodGpue::default()));

        let with_gpu = app_pod(vec![container(
            "trainer",
            &[("cpu", "4"), ("memory", "16Gi")],
            &[("nvidia.com/gpu", "1"), ("memory", "32Gi")],
        )]);
        let gpue = pod_gpue(&with_gpu, &ResourceWeights::new());
        assert_eq!(
            gpue.map(|g| g.per_resource_milli.into_keys().collect::<Vec<_>>()),
            Ok(vec!["nvidia.com/gpu".to_owned()])
        );
    }

    #[test]
    fn malformed_quantity_names_the_container() {
        let pod = app_pod(vec![
            container("loader", &[], &[("nvidia.com/gpu", "1")]),
            container("trainer", &[], &[("nvidia.com/gpu", "two")]),
        ]);
        let err = pod_gpue(&pod, &ResourceWeights::new());
        assert_eq!(
            err,
            Err(ResourceError::BadQuantity {
                location: "spec.containers[1] \"trainer\"".to_owned(),
                field: QuantityField::Limits,
                resource: "nvidia.com/gpu".to_owned(),
                error: QuantityError::BadNumber {
                    input: "two".to_owned(),
                    reason: "no digits before the suffix",
                },
            })
        );
        let msg = err.map_err(|e| e.to_string());
        assert!(
            msg.as_ref().is_err_and(|m| m.starts_with(
                "spec.containers[1] \"trainer\": limits[\"nvidia.com/gpu\"] is not a valid quantity: quantity \"two\""
            )),
            "{msg:?}"
        );

        let init = PodResources {
            init_containers: vec![container("setup", &[("cpu", "1 ")], &[])],
            ..PodResources::default()
        };
        let err = effective_requests_milli(&init);
        assert!(
            matches!(
                &err,
                Err(ResourceError::BadQuantity { location, field: QuantityField::Requests, resource, error: QuantityError::Whitespace { .. } })
                    if location == "spec.initContainers[0] \"setup\"" && resource == "cpu"
            ),
            "{err:?}"
        );

        let overhead = PodResources {
            overhead: map(&[("nvidia.com/gpu", "-1")]),
            ..PodResources::default()
        };
        let err = effective_requests_milli(&overhead);
        assert!(
            matches!(
                &err,
                Err(ResourceError::BadQuantity { location, field: QuantityField::Overhead, error: QuantityError::Negative { .. }, .. })
                    if location == "spec"
            ),
            "{err:?}"
        );
    }

    #[test]
    fn empty_pod_has_no_gpue() {
        assert_eq!(effective_requests_milli(&PodResources::default()), Ok(BTreeMap::new()));
        assert_eq!(
            pod_gpue(&PodResources::default(), &ResourceWeights::new()),
            Ok(PodGpue::default())
        );
    }

    #[test]
    fn sums_saturate() {
        let pod = app_pod(vec![
            container("a", &[], &[("nvidia.com/gpu", "18446744073709551615m")]),
            container("b", &[], &[("nvidia.com/gpu", "18446744073709551615m")]),
        ]);
        let requests = effective_requests_milli(&pod);
        assert_eq!(requests.map(|r| r.get("nvidia.com/gpu").copied()), Ok(Some(u64::MAX)));
        let mut w = ResourceWeights::new();
        w.set("amd.com/gpu", u64::MAX);
        let mut both = pod;
        both.containers.push(container("c", &[], &[("amd.com/gpu", "1")]));
        assert_eq!(pod_gpue(&both, &w).map(|g| g.total_milli), Ok(u64::MAX));
    }

    #[test]
    fn weights_serialize_as_explicit_map() {
        let mut w = ResourceWeights::new();
        w.set(MIG_1G, 200);
        w.set(MIG_1G, 150);
        assert_eq!(w.weight_milli(MIG_1G), Some(150));
        let json = serde_json::to_string(&w).map_err(|e| e.to_string());
        assert_eq!(json.as_deref(), Ok(r#"{"explicit":{"nvidia.com/mig-1g.5gb":150}}"#));
        let back: Result<ResourceWeights, _> = serde_json::from_str(r#"{"explicit":{"nvidia.com/mig-1g.5gb":150}}"#);
        assert_eq!(back.map_err(|e| e.to_string()), Ok(w));
        let empty: Result<ResourceWeights, _> = serde_json::from_str("{}");
        assert_eq!(empty.map_err(|e| e.to_string()), Ok(ResourceWeights::new()));
    }

    const NAMES: &[&str] = &[
        "nvidia.com/gpu",
        "amd.com/gpu",
        "nvidia.com/mig-1g.5gb",
        "nvidia.com/mig-3g.40gb",
        "cpu",
        "memory",
    ];

    fn any_quantity() -> impl Strategy<Value = String> {
        prop_oneof![
            "[0-9]{1,3}",
            "[0-9]{1,2}\\.[0-9]{1,3}",
            "[0-9]{1,4}m",
            "[0-9]{1,20}[kMGTPE]?",
            "[0-9]{1,3}(Ki|Mi|Gi|Ei)",
            "[0-9.eEkKmMuinGTPi+-]{0,8}",
            ".{0,6}",
        ]
    }

    fn valid_quantity() -> impl Strategy<Value = String> {
        prop_oneof!["[0-9]{1,3}", "[0-9]{1,2}\\.[0-9]{1,3}", "[0-9]{1,4}m"]
    }

    fn resource_map(q: BoxedStrategy<String>) -> impl Strategy<Value = BTreeMap<String, String>> {
        prop::collection::btree_map(prop::sample::select(NAMES).prop_map(str::to_owned), q, 0..3)
    }

    fn containers(q: BoxedStrategy<String>) -> impl Strategy<Value = Vec<ContainerResources>> {
        prop::collection::vec(
            ("[a-z]{0,5}", resource_map(q.clone()), resource_map(q), any::<bool>()).prop_map(
                |(name, requests, limits, restartable)| ContainerResources {
                    name,
                    requests,
                    limits,
                    restartable,
                },
            ),
            0..4,
        )
    }

    fn pods(q: BoxedStrategy<String>) -> impl Strategy<Value = PodResources> {
        (containers(q.clone()), containers(q.clone()), resource_map(q)).prop_map(
            |(init_containers, containers, overhead)| PodResources {
                init_containers,
                containers,
                overhead,
            },
        )
    }

    proptest! {
        #[test]
        fn pod_gpue_never_panics_and_total_is_sum(
            pod in pods(any_quantity().boxed()),
            mig_weight in 0u64..3000,
        ) {
            let mut weights = ResourceWeights::new();
            weights.set(MIG_1G, mig_weight);
            if let Ok(gpue) = pod_gpue(&pod, &weights) {
                let sum = gpue.per_resource_milli.values().fold(0u64, |s, &v| s.saturating_add(v));
                prop_assert_eq!(gpue.total_milli, sum);
                for resource in gpue.per_resource_milli.keys() {
                    prop_assert!(weights.is_gpu_resource(resource));
                }
            }
        }

        #[test]
        fn total_of_counted_requests_is_pod_gpue(
            pod in pods(valid_quantity().boxed()),
            mig_weight in 0u64..3000,
        ) {
            let mut weights = ResourceWeights::new();
            weights.set(MIG_1G, mig_weight);
            let requests = effective_requests_milli(&pod);
            prop_assert!(requests.is_ok());
            if let (Ok(requests), Ok(gpue)) = (requests, pod_gpue(&pod, &weights)) {
                let total = total_gpue_milli(requests.iter().map(|(r, &q)| (r.as_str(), q)), &weights);
                prop_assert_eq!(total, gpue.total_milli);
            }
        }

        #[test]
        fn valid_pods_always_parse_and_total_is_sum(pod in pods(valid_quantity().boxed())) {
            let gpue = pod_gpue(&pod, &ResourceWeights::new());
            prop_assert!(gpue.is_ok(), "{:?}", gpue);
            if let Ok(gpue) = gpue {
                prop_assert_eq!(gpue.total_milli, gpue.per_resource_milli.values().sum::<u64>());
            }
        }

        #[test]
        fn adding_a_gpu_container_never_decreases_total(
            pod in pods(valid_quantity().boxed()),
            gpu in "[1-9][0-9]{0,2}",
            resource in prop::sample::select(&NAMES[..4]),
            as_limit in any::<bool>(),
        ) {
            let weights = ResourceWeights::new();
            let before = pod_gpue(&pod, &weights);
            let entry = [(resource, gpu.as_str())];
            let extra = if as_limit {
                container("extra", &[], &entry)
            } else {
                container("extra", &entry, &[])
            };
            let mut bigger = pod;
            bigger.containers.push(extra);
            let after = pod_gpue(&bigger, &weights);
            match (before, after) {
                (Ok(before), Ok(after)) => {
                    prop_assert!(after.total_milli >= before.total_milli);
                    prop_assert!(after.per_resource_milli.get(resource).copied().unwrap_or(0) > 0);
                }
                (before, after) => prop_assert!(false, "valid pod failed: {:?} {:?}", before, after),
            }
        }
    }
}
