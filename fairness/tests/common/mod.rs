//! Setup shared by the federation's integration tests.

use kvota_fairness::names::ClusterName;
use std::collections::BTreeMap;

use kvota_fairness::federation::{Applied, Command, Federation};
use kvota_fairness::policy::Policy;

/// A federation under the article's example policy with one cluster, `east` (32 GPUs),
/// registered; and the epoch of the lease its registration was answered with.
pub fn east_federation() -> (Federation, u64) {
    let mut fed = Federation::new();
    fed.apply(
        0,
        Command::ApplyPolicy(Policy::from_yaml(Policy::article_example_yaml()).expect("policy")),
    )
    .expect("policy");
    let capacity = [("nvidia.com/gpu".to_string(), 32_000)].into();
    let epoch = match fed.apply(
        0,
        Command::RegisterCluster {
            cluster: ClusterName::from_static("east"),
            capacity,
            labels: BTreeMap::new(),
        },
    ) {
        Ok(Applied::Registered(l)) => l.epoch,
        other => panic!("{other:?}"),
    };
    (fed, epoch)
}
