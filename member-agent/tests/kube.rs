//! The agent's Kubernetes side against a fake API server.
//!
//! No real Kubernetes API server can run on this machine, so these tests use
//! `support/fake_apiserver.rs`: a small HTTP server on loopback that speaks the parts
//! of the API the agent uses (list/watch with resource versions and `410 Gone` after
//! compaction, merge patches with resourceVersion preconditions, the Eviction
//! subresource with PodDisruptionBudget refusals, Events, Leases). Everything on the
//! agent's side is real: kube-rs watchers and client, the agent's state, the fairness
//! core's reclaim planner.

#[path = "support/fake_apiserver.rs"]
mod fake_apiserver;

use kvota_fairness::names::{ClusterName, TenantName};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fake_apiserver::{FakeApi, Kind};
use kvota_fairness::lease::{Lease, TenantBudget};
use kvota_fairness::policy::Policy;
use kvota_fairness::reclaim::Decision;
use kvota_member_agent::agent::Agent;
use kvota_member_agent::inventory::{capacity_milli, Inventory, PodStage};
use kvota_member_agent::kube::{format_time, Controller, Election, KubeActions, KubeInventory, RoleMarker, ROLE_LABEL};
use kvota_member_agent::review::Outcome;
use kvota_member_agent::review::{review, Endpoint};
use serde_json::{json, Value};
use tokio::sync::watch;

const POLICY: &str = "apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: kube-test}
spec:
  reclaim: {starvedFor: 0s, minRuntime: 1m}
  tenants:
  - {name: inference, weight: 50, minShare: 40, maxShare: 80, preemptible: false, admission: queue, namespaces: [serve]}
  - {name: training, weight: 40, minShare: 10, maxShare: 60, preemptible: true}
";

fn wall_now() -> i64 {
    i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs(),
    )
    .expect("seconds")
}

fn node(name: &str, gpus: u32, cordoned: bool) -> Value {
    json!({"metadata": {"name": name}, "spec": {"unschedulable": cordoned},
           "status": {"allocatable": {"cpu": "64", "nvidia.com/gpu": gpus.to_string()}}})
}

fn namespace(name: &str, tenant: Option<&str>) -> Value {
    let labels = tenant.map_or(json!({}), |t| json!({"kvota.dev/tenant": t}));
    json!({"metadata": {"name": name, "labels": labels}})
}

/// A pod asking for `gpus`; `node` binds it (Running, started `age_s` ago); `gates`
/// are its scheduling gates.
fn pod(ns: &str, name: &str, gpus: u32, node: Option<&str>, gates: &[&str], priority: i32, age_s: i64) -> Value {
    let mut spec = json!({"priority": priority, "containers": [{"name": "main", "image": "x",
        "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}}}]});
    if let Some(n) = node {
        spec["nodeName"] = json!(n);
    }
    if !gates.is_empty() {
        spec["schedulingGates"] = json!(gates.iter().map(|g| json!({"name": g})).collect::<Vec<_>>());
    }
    let t = format_time(wall_now() - age_s);
    let status = if node.is_some() {
        json!({"phase": "Running", "startTime": t})
    } else {
        json!({"phase": "Pending"})
    };
    json!({"metadata": {"name": name, "namespace": ns, "creationTimestamp": t}, "spec": spec, "status": status})
}

fn lease(epoch: u64, budgets: &[(&str, u64)]) -> Lease {
    Lease {
        cluster: ClusterName::from_static("c"),
        epoch,
        duration_ms: 3_600_000,
        margin_ms: 60_000,
        issued_at_ms: 0,
        budgets: budgets
            .iter()
            .map(|&(t, g)| {
                (
                    TenantName::parse(t).expect("name"),
                    TenantBudget {
                        budget: g * 1000,
                        fallback: g * 1000,
                        entitlement: g * 1000,
                        borrow: 0,
                        ceiling: 0,
                    },
                )
            })
            .collect::<BTreeMap<_, _>>(),
    }
}

struct Setup {
    api: FakeApi,
    agent: Arc<Agent>,
    inventory: Arc<KubeInventory>,
    controller: Controller,
    _stop: watch::Sender<bool>,
    _dir: tempfile::TempDir,
}

/// An agent (its control plane never contacted) with the policy and a lease, and the
/// inventory watching the fake API server.
async fn setup(api: FakeApi, budgets: &[(&str, u64)]) -> Setup {
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = Arc::new(
        Agent::open(
            &ClusterName::from_static("c"),
            BTreeMap::new(),
            dir.path(),
            &["http://127.0.0.1:9".to_string()],
        )
        .expect("agent"),
    );
    {
        let mut st = agent.state();
        st.set_policy(Policy::from_yaml(POLICY).expect("policy"));
        let now = st.now_ms();
        st.lease.on_lease(lease(1, budgets), now);
    }
    let clock_agent = agent.clone();
    let inventory = KubeInventory::new(Arc::new(move || clock_agent.now_ms()));
    let (stop_tx, stop) = watch::channel(false);
    tokio::spawn(inventory.clone().run(api.client(), stop));
    let controller = Controller::new(inventory.clone(), KubeActions::new(api.client(), "kvota-agent"));
    Setup {
        api,
        agent,
        inventory,
        controller,
        _stop: stop_tx,
        _dir: dir,
    }
}

/// Polls `f` (syncing the controller first) until it holds, or fails after 10 s.
async fn eventually(s: &mut Setup, what: &str, mut f: impl FnMut(&Setup) -> bool) {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        s.controller.sync(&s.agent);
        if f(s) {
            return;
        }
        assert!(Instant::now() < until, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn base_cluster(api: &FakeApi) {
    api.put(Kind::Namespace, namespace("ml", Some("training")));
    api.put(Kind::Namespace, namespace("serve", None));
    api.put(Kind::Namespace, namespace("web", None));
    api.put(Kind::Node, node("n1", 8, false));
    api.put(Kind::Node, node("n2", 8, false));
    api.put(Kind::Node, node("n3", 4, true));
    api.put(Kind::Pod, pod("ml", "a", 2, Some("n1"), &[], 0, 600));
    api.put(Kind::Pod, pod("ml", "b", 1, None, &[], 0, 10));
    api.put(Kind::Pod, pod("serve", "c", 4, None, &["kvota.dev/admission"], 0, 10));
    api.put(
        Kind::Pod,
        json!({"metadata": {"name": "cpu", "namespace": "web"}, "spec": {"containers": [{"name": "m"}]}}),
    );
    let mut done = pod("ml", "done", 8, Some("n2"), &[], 0, 900);
    done["status"]["phase"] = json!("Succeeded");
    api.put(Kind::Pod, done);
}

#[tokio::test]
async fn lists_then_follows_watch_events_for_pods_nodes_and_namespaces() {
    let api = FakeApi::start().await;
    base_cluster(&api);
    let mut s = setup(api, &[("training", 6), ("inference", 4)]).await;
    eventually(&mut s, "first listing", |s| s.inventory.synced()).await;

    // Listing: cordoned n3 offers nothing; the CPU pod is not kept; the finished pod
    // holds nothing.
    assert_eq!(capacity_milli(&*s.inventory).get("nvidia.com/gpu"), Some(&16_000));
    assert_eq!(
        s.agent.capacity().get("nvidia.com/gpu"),
        Some(&16_000),
        "capacity goes to the next report"
    );
    let stages: BTreeMap<String, PodStage> = s
        .inventory
        .gpu_pods()
        .into_iter()
        .map(|p| (p.key.into_string(), p.stage))
        .collect();
    let want: BTreeMap<String, PodStage> = [
        ("ml/a".to_string(), PodStage::Bound),
        ("ml/b".to_string(), PodStage::Unbound),
        ("ml/done".to_string(), PodStage::Finished),
        ("serve/c".to_string(), PodStage::Gated),
    ]
    .into();
    assert_eq!(stages, want);
    {
        let st = s.agent.state();
        assert_eq!(
            st.bound("training"),
            2000,
            "ml/a is bound (namespace label names the tenant)"
        );
        assert_eq!(
            st.inuse("training"),
            3000,
            "ml/b was admitted and waits for a node: it holds its GPU"
        );
        assert_eq!(
            st.queued("inference"),
            1,
            "serve/c waits behind the gate (after a restart too)"
        );
        assert_eq!(st.inuse("inference"), 0);
    }

    // Watch events: a pod binds, another is deleted.
    s.api.put(Kind::Pod, pod("ml", "b", 1, Some("n2"), &[], 0, 10));
    eventually(&mut s, "ml/b bound", |s| s.agent.state().bound("training") == 3000).await;
    s.api.delete(Kind::Pod, "ml/a");
    eventually(&mut s, "ml/a deleted", |s| s.agent.state().inuse("training") == 1000).await;

    // Node changes: uncordon n3, remove n2, add n4 with MIG slices.
    s.api.put(Kind::Node, node("n3", 4, false));
    eventually(&mut s, "n3 uncordoned", |s| {
        s.agent.capacity().get("nvidia.com/gpu") == Some(&20_000)
    })
    .await;
    s.api.delete(Kind::Node, "n2");
    eventually(&mut s, "n2 removed", |s| {
        s.agent.capacity().get("nvidia.com/gpu") == Some(&12_000)
    })
    .await;
    s.api.put(
        Kind::Node,
        json!({"metadata": {"name": "n4"}, "status": {"allocatable": {"nvidia.com/mig-1g.10gb": "7"}}}),
    );
    eventually(&mut s, "n4 added", |s| {
        s.agent.capacity().get("nvidia.com/mig-1g.10gb") == Some(&7_000)
    })
    .await;

    // A namespace relabelled to another tenant moves its pods' usage.
    s.api.put(Kind::Namespace, namespace("ml", Some("inference")));
    eventually(&mut s, "ml now inference", |s| {
        let st = s.agent.state();
        st.bound("inference") == 1000 && st.bound("training") == 0
    })
    .await;
}

#[tokio::test]
async fn a_watch_older_than_the_history_gets_410_and_the_agent_relists() {
    let api = FakeApi::start().await;
    base_cluster(&api);
    let mut s = setup(api, &[("training", 6), ("inference", 4)]).await;
    eventually(&mut s, "first listing", |s| s.inventory.synced()).await;
    let relists = s.inventory.relists();
    assert_eq!(s.agent.state().bound("training"), 2000);

    // The agent is cut off while ml/a is deleted and history is compacted: the deletion
    // is never delivered as an event. Its next watch starts from a version that is gone.
    s.api.hold_watches(true);
    s.api.cut_watches();
    s.api.delete(Kind::Pod, "ml/a");
    s.api.put(Kind::Pod, pod("ml", "e", 2, Some("n1"), &[], 0, 5));
    s.api.compact();
    s.api.hold_watches(false);

    eventually(&mut s, "relisted after 410", |s| {
        let keys: Vec<String> = s
            .inventory
            .gpu_pods()
            .into_iter()
            .map(|p| p.key.into_string())
            .collect();
        !keys.contains(&"ml/a".to_string()) && keys.contains(&"ml/e".to_string())
    })
    .await;
    // Usually the watcher's next watch from the compacted version gets 410 Gone and it
    // relists; kube's watcher may also start over with a list after the refused watches
    // (it did once in ~20 runs), which misses nothing either. Either way it listed again.
    assert!(
        s.inventory.relists() > relists,
        "the pod watcher listed again (410s served: {})",
        s.api.gone_served()
    );
    let st = s.agent.state();
    assert_eq!(
        st.bound("training"),
        2000,
        "ml/a's GPUs freed, ml/e's counted: {}",
        st.bound("training")
    );
}

#[tokio::test]
async fn the_gate_controller_releases_by_priority_then_age_and_keeps_other_gates() {
    let api = FakeApi::start().await;
    api.put(Kind::Namespace, namespace("serve", None));
    api.put(Kind::Node, node("n1", 8, false));
    api.put(
        Kind::Pod,
        pod("serve", "old", 4, None, &["kvota.dev/admission"], 0, 300),
    );
    api.put(
        Kind::Pod,
        pod(
            "serve",
            "urgent",
            4,
            None,
            &["other.io/gate", "kvota.dev/admission"],
            100,
            10,
        ),
    );
    let mut s = setup(api, &[("inference", 4)]).await;
    eventually(&mut s, "both gated pods queued", |s| {
        s.agent.state().queued("inference") == 2
    })
    .await;

    let r = s.controller.release_gates(&s.agent).await;
    assert_eq!(
        r.ungated,
        vec!["serve/urgent".to_string()],
        "budget for one: the higher priority goes first"
    );
    let gates = |s: &Setup, key: &str| -> Vec<String> {
        s.api.get(Kind::Pod, key).expect("pod")["spec"]["schedulingGates"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|g| g["name"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(
        gates(&s, "serve/urgent"),
        vec!["other.io/gate".to_string()],
        "only kvota's gate is removed"
    );
    assert_eq!(gates(&s, "serve/old"), vec!["kvota.dev/admission".to_string()]);
    assert_eq!(
        s.agent.state().inuse("inference"),
        4000,
        "the released pod holds its GPUs until it binds"
    );

    // Budget frees: the other pod goes too, and nothing is released twice.
    {
        let mut st = s.agent.state();
        let now = st.now_ms();
        st.lease.on_lease(lease(2, &[("inference", 8)]), now);
    }
    eventually(&mut s, "urgent seen ungated", |s| {
        s.inventory
            .gpu_pods()
            .iter()
            .any(|p| p.key == "serve/urgent" && p.stage == PodStage::Unbound)
    })
    .await;
    let r = s.controller.release_gates(&s.agent).await;
    assert_eq!(r.ungated, vec!["serve/old".to_string()]);
    assert!(gates(&s, "serve/old").is_empty());
    let patches = s.api.requests().iter().filter(|r| r.starts_with("PATCH")).count();
    assert_eq!(patches, 2, "one patch per released pod");

    // Events on the pods: `Queued` once for the pod that waited (not again each round),
    // `Released` for each pod whose gate kvota lifted.
    let events: Vec<(String, String, String)> = s
        .api
        .all(Kind::Event)
        .iter()
        .map(|e| {
            let pod = format!(
                "{}/{}",
                e["involvedObject"]["namespace"].as_str().unwrap_or(""),
                e["involvedObject"]["name"].as_str().unwrap_or("")
            );
            (
                pod,
                e["reason"].as_str().unwrap_or("").to_string(),
                e["message"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    let of = |pod: &str, reason: &str| {
        events
            .iter()
            .filter(|(p, r, _)| p == pod && r == reason)
            .collect::<Vec<_>>()
    };
    assert_eq!(of("serve/old", "Queued").len(), 1, "announced once: {events:?}");
    assert!(
        of("serve/old", "Queued")[0].2.contains("kvota explain pod serve/old")
            && of("serve/old", "Queued")[0].2.contains("inference"),
        "{events:?}"
    );
    assert_eq!(of("serve/urgent", "Released").len(), 1, "{events:?}");
    assert_eq!(of("serve/old", "Released").len(), 1, "{events:?}");
    assert!(
        of("serve/old", "Released")[0]
            .2
            .contains("budget in this cluster has room"),
        "{events:?}"
    );
    assert!(s
        .api
        .all(Kind::Event)
        .iter()
        .all(|e| e["type"] == "Normal" && e["involvedObject"]["kind"] == "Pod"));
}

/// 8 GPUs full of training pods started 1-8 minutes ago; inference waits for 2.
async fn starved_inference() -> Setup {
    let api = FakeApi::start().await;
    api.put(Kind::Namespace, namespace("ml", Some("training")));
    api.put(Kind::Namespace, namespace("serve", None));
    api.put(Kind::Node, node("n1", 8, false));
    for i in 0..8 {
        api.put(
            Kind::Pod,
            pod("ml", &format!("t{i}"), 1, Some("n1"), &[], 0, 60 * (8 - i)),
        );
    }
    api.put(Kind::Pod, pod("serve", "w", 2, None, &["kvota.dev/admission"], 0, 30));
    let mut s = setup(api, &[("training", 6), ("inference", 2)]).await;
    eventually(&mut s, "listed", |s| {
        s.agent.state().bound("training") == 8000 && s.agent.state().queued("inference") == 1
    })
    .await;
    s
}

#[tokio::test]
async fn reclaim_evicts_the_youngest_training_pods_through_the_eviction_api_with_events() {
    let mut s = starved_inference().await;
    let d = s.controller.reclaim(&s.agent).await;
    let Decision::Evict {
        victims, for_tenant, ..
    } = &d
    else {
        panic!("expected evictions, got {d:?}")
    };
    assert_eq!(for_tenant, "inference");
    let keys: Vec<&str> = victims.iter().map(|v| v.key.as_str()).collect();
    assert_eq!(
        keys,
        ["ml/t7", "ml/t6"],
        "just enough, youngest first (t6 ran 2 min, past minRuntime 1m)"
    );
    for k in keys {
        assert!(s.api.get(Kind::Pod, k).is_none(), "{k} evicted");
    }
    let events = s.api.all(Kind::Event);
    assert_eq!(events.len(), 2);
    for e in &events {
        assert_eq!(e["reason"], "Evicted");
        assert_eq!(e["type"], "Warning");
        assert_eq!(e["involvedObject"]["kind"], "Pod");
        let msg = e["message"].as_str().expect("message");
        assert!(msg.contains("inference") && msg.contains("guarantee"), "{msg}");
    }
    let audit: Vec<(String, String)> = s
        .agent
        .state()
        .reclaim_audit()
        .map(|r| (r.victim.to_string(), r.outcome.to_string()))
        .collect();
    assert_eq!(
        audit,
        [
            ("ml/t7".to_string(), "evicted".to_string()),
            ("ml/t6".to_string(), "evicted".to_string())
        ]
    );
    // Once the deletions are seen the guarantee is within reach: nothing more to evict.
    eventually(&mut s, "evictions seen", |s| s.agent.state().bound("training") == 6000).await;
    assert!(matches!(s.controller.reclaim(&s.agent).await, Decision::Idle(_)));
}

/// A denied pod was never created: the controller puts one `AdmissionDenied` Warning
/// Event on its namespace (not again while the denial is remembered), with the message
/// the denial gave.
#[tokio::test]
async fn a_denial_is_announced_once_on_the_pods_namespace() {
    let api = FakeApi::start().await;
    api.put(Kind::Namespace, namespace("ml", Some("training")));
    api.put(Kind::Node, node("n1", 8, false));
    let mut s = setup(api, &[("training", 1)]).await;
    eventually(&mut s, "listed", |s| s.inventory.synced()).await;
    let body = serde_json::to_vec(&json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "d1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"}, "namespace": "ml", "operation": "CREATE",
            "object": {"metadata": {"name": "big", "namespace": "ml"},
                "spec": {"containers": [{"name": "m", "resources": {"limits": {"nvidia.com/gpu": "4"}}}]}}}}))
    .expect("json");
    let r = review(&body, Endpoint::Validate, &mut *s.agent.state());
    assert_eq!(r.outcome, Outcome::Denied, "{}", String::from_utf8_lossy(&r.body));
    for _ in 0..2 {
        s.controller.release_gates(&s.agent).await;
    }
    let events = s.api.all(Kind::Event);
    assert_eq!(events.len(), 1, "once: {events:?}");
    let e = &events[0];
    assert_eq!(
        (e["reason"].as_str(), e["type"].as_str()),
        (Some("AdmissionDenied"), Some("Warning"))
    );
    assert_eq!(
        (
            e["involvedObject"]["kind"].as_str(),
            e["involvedObject"]["name"].as_str()
        ),
        (Some("Namespace"), Some("ml"))
    );
    let msg = e["message"].as_str().expect("message");
    assert!(
        msg.starts_with("pod ml/big: ") && msg.contains("training") && msg.contains("kvota explain pod ml/big"),
        "{msg}"
    );
}

/// A pod created with generateName is judged by the mutating webhook before it has a
/// name; when it shows up under its generated name it takes over that reservation (and
/// the queue place of a second one) instead of being counted twice.
#[tokio::test]
async fn a_generated_name_takes_over_the_provisional_reservation() {
    let api = FakeApi::start().await;
    api.put(Kind::Namespace, namespace("serve", None));
    api.put(Kind::Node, node("n1", 8, false));
    let mut s = setup(api, &[("inference", 2)]).await;
    eventually(&mut s, "listed", |s| s.inventory.synced()).await;
    let review_of = |uid: &str| {
        serde_json::to_vec(&json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"}, "namespace": "serve", "operation": "CREATE",
                "object": {"metadata": {"generateName": "api-", "namespace": "serve"},
                    "spec": {"containers": [{"name": "m", "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}}}))
        .expect("json")
    };
    let r = review(&review_of("u1"), Endpoint::Mutate, &mut *s.agent.state());
    assert_eq!(r.outcome, Outcome::Allowed, "{}", String::from_utf8_lossy(&r.body));
    let r = review(&review_of("u2"), Endpoint::Mutate, &mut *s.agent.state());
    assert_eq!(
        r.outcome,
        Outcome::Queued,
        "the budget of 2 GPUs is reserved for the first"
    );
    {
        let st = s.agent.state();
        assert_eq!((st.inuse("inference"), st.queued("inference")), (2000, 1));
    }

    // The API server names them; the first is admitted and not yet bound, the second gated.
    let mut p1 = pod("serve", "api-x7k2p", 2, None, &[], 0, 1);
    p1["metadata"]["generateName"] = json!("api-");
    let mut p2 = pod("serve", "api-q9z4m", 2, None, &["kvota.dev/admission"], 0, 1);
    p2["metadata"]["generateName"] = json!("api-");
    s.api.put(Kind::Pod, p1);
    s.api.put(Kind::Pod, p2);
    eventually(&mut s, "pods seen", |s| s.inventory.gpu_pods().len() == 2).await;
    let st = s.agent.state();
    assert_eq!(
        st.inuse("inference"),
        2000,
        "one reservation, under the real name: {:?} {:?}",
        st.reservations(),
        s.inventory.gpu_pods()
    );
    assert_eq!(st.queued("inference"), 1, "one queue place, under the real name");
    assert!(st.knows("serve/api-x7k2p") && st.knows("serve/api-q9z4m"));
    assert!(
        st.explain_pod("serve/api-x7k2p").is_some_and(|e| e.verdict == "Allow"),
        "the decision follows the name"
    );
}

/// No eviction on behalf of a pod that could not use the room: a node selector no node
/// satisfies, a taint it does not tolerate. Once a node admits it, reclaim acts.
#[tokio::test]
async fn reclaim_never_evicts_for_a_pod_no_node_admits() {
    let mut s = starved_inference().await;
    let mut w = s.api.get(Kind::Pod, "serve/w").expect("pod");
    w["spec"]["nodeSelector"] = json!({"gpu": "h100"});
    s.api.put(Kind::Pod, w);
    eventually(&mut s, "selector seen", |s| {
        s.inventory
            .gpu_pods()
            .iter()
            .any(|p| p.key == "serve/w" && !p.placement.node_selector.is_empty())
    })
    .await;
    let d = s.controller.reclaim(&s.agent).await;
    assert!(matches!(d, Decision::Idle(_)), "{d:?}");
    assert_eq!(s.api.all(Kind::Pod).len(), 9, "nobody evicted");

    // The node gets the label, and a taint the pod does not tolerate: still nothing.
    let mut n1 = node("n1", 8, false);
    n1["metadata"]["labels"] = json!({"gpu": "h100"});
    n1["spec"]["taints"] = json!([{"key": "dedicated", "value": "batch", "effect": "NoSchedule"}]);
    s.api.put(Kind::Node, n1.clone());
    eventually(&mut s, "node labels seen", |s| {
        s.inventory.nodes().iter().any(|n| n.labels.contains_key("gpu"))
    })
    .await;
    let d = s.controller.reclaim(&s.agent).await;
    assert!(matches!(d, Decision::Idle(_)), "{d:?}");
    assert_eq!(s.api.all(Kind::Pod).len(), 9, "nobody evicted");

    // Untainted: the pod may run there, and reclaim makes room.
    n1["spec"]["taints"] = json!([]);
    s.api.put(Kind::Node, n1);
    eventually(&mut s, "taint gone", |s| {
        s.inventory.nodes().iter().all(|n| n.taints.is_empty())
    })
    .await;
    let d = s.controller.reclaim(&s.agent).await;
    assert!(matches!(d, Decision::Evict { .. }), "{d:?}");
    assert!(s.api.all(Kind::Pod).len() < 9);
}

#[tokio::test]
async fn a_pod_disruption_budget_refusal_is_reported_and_not_forced() {
    let s = starved_inference().await;
    s.api.set_pdb_blocked("ml", true);
    let _ = s.controller.reclaim(&s.agent).await;
    assert_eq!(s.api.all(Kind::Pod).len(), 9, "no pod deleted");
    let reasons: Vec<String> = s
        .api
        .all(Kind::Event)
        .iter()
        .map(|e| e["reason"].as_str().unwrap_or("").to_string())
        .collect();
    assert!(
        !reasons.is_empty() && reasons.iter().all(|r| r == "EvictionBlocked"),
        "{reasons:?}"
    );
    assert!(s.agent.state().reclaim_audit().all(|r| r.outcome.as_str() == "blocked"));
    // The budget lets go: the next round evicts.
    s.api.set_pdb_blocked("ml", false);
    let d = s.controller.reclaim(&s.agent).await;
    assert!(matches!(d, Decision::Evict { .. }), "{d:?}");
    assert!(s.api.all(Kind::Pod).len() < 9);
}

/// The leading replica labels its pod `leader` (the webhook Service selects it) after
/// demoting any other pod still labelled so (a replica that lost the Lease without
/// saying so); a standby labels itself `standby` and is Ready once it has the policy.
#[tokio::test]
async fn the_leader_labels_its_pod_and_demotes_a_stale_leader_label() {
    let api = FakeApi::start().await;
    let agent_pod = |name: &str, role: Option<&str>| {
        let labels = role.map_or(
            json!({"app": "kvota-agent"}),
            |r| json!({"app": "kvota-agent", ROLE_LABEL: r}),
        );
        json!({"metadata": {"name": name, "namespace": "kvota-system", "labels": labels}, "spec": {"containers": [{"name": "agent"}]}})
    };
    api.put(Kind::Pod, agent_pod("agent-a", Some("leader")));
    api.put(Kind::Pod, agent_pod("agent-b", None));
    let role = |api: &FakeApi, pod: &str| {
        api.get(Kind::Pod, &format!("kvota-system/{pod}"))
            .and_then(|p| p["metadata"]["labels"][ROLE_LABEL].as_str().map(str::to_string))
    };

    let b = RoleMarker::new(api.client(), "kvota-system", "agent-b");
    b.stand_by().await.expect("standby label");
    assert_eq!(role(&api, "agent-b").as_deref(), Some("standby"));
    // a crashed without relabelling; b takes over.
    b.lead().await.expect("lead");
    assert_eq!(
        (role(&api, "agent-a").as_deref(), role(&api, "agent-b").as_deref()),
        (Some("standby"), Some("leader"))
    );
    // A pod that is gone is no error.
    RoleMarker::new(api.client(), "kvota-system", "agent-gone")
        .stand_by()
        .await
        .expect("gone pod");

    // Readiness: a standby with the policy is Ready (it is sent nothing), the leader
    // needs its lease too.
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = Agent::open(
        &ClusterName::from_static("c"),
        BTreeMap::new(),
        dir.path(),
        &["http://127.0.0.1:9".to_string()],
    )
    .expect("agent");
    let mut st = agent.state();
    st.set_standby(true);
    st.set_held(Some("this agent replica is a standby".into()));
    assert!(st.ready().is_err(), "no policy yet");
    st.set_policy(Policy::from_yaml(POLICY).expect("policy"));
    assert_eq!(st.ready(), Ok(()));
    st.set_standby(false);
    st.set_held(None);
    assert!(
        st.ready().is_err_and(|e| e.contains("no lease")),
        "a leader without a lease is not ready"
    );
}

#[tokio::test]
async fn two_replicas_never_lead_at_once_and_a_standby_takes_over_after_the_lease_lapses() {
    let api = FakeApi::start().await;
    let d = Duration::from_secs(3);
    let mut a = Election::new(api.client(), "kvota", "kvota-agent-c", "replica-a", d);
    let mut b = Election::new(api.client(), "kvota", "kvota-agent-c", "replica-b", d);
    assert!(
        a.step().await.expect("a"),
        "the first replica creates the Lease and leads"
    );
    assert!(!b.step().await.expect("b"), "the Lease is held");
    assert_eq!(b.holder(), Some("replica-a"));

    // a keeps renewing for a while: b never leads.
    for _ in 0..5 {
        tokio::time::sleep(a.period()).await;
        assert!(a.step().await.expect("a renews"));
        assert!(!b.step().await.expect("b"));
        assert!(a.is_leader() && !b.is_leader());
    }
    // a stops (crashed): b takes over only after a whole lease duration, by which time a
    // (were it still running and merely cut off) has stopped acting.
    let stopped = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if b.step().await.expect("b") {
            break;
        }
        assert!(stopped.elapsed() < Duration::from_secs(10), "b never took over");
    }
    assert!(
        stopped.elapsed() >= d,
        "took over after {:?}, before the lease lapsed",
        stopped.elapsed()
    );
    assert!(
        !a.is_leader(),
        "the old leader had stopped acting before the new one started"
    );
    assert!(!a.step().await.expect("a"), "a comes back as standby");
    let l = api.get(Kind::Lease, "kvota/kvota-agent-c").expect("lease");
    assert_eq!(l["spec"]["holderIdentity"], "replica-b");
    assert_eq!(l["spec"]["leaseTransitions"], 1);

    // A clean shutdown hands over at once.
    b.release().await.expect("release");
    assert!(a.step().await.expect("a"), "released Lease taken at once");
}
