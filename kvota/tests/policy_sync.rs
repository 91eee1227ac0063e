//! The FairnessPolicy sync controller (`kvota policy sync`) as a real process, against a
//! real one-node control plane over mutual TLS (an operator certificate) and a fake
//! Kubernetes API server (`member-agent/tests/support/fake_apiserver.rs`: no real API
//! server can run on this machine; the fake serves the FairnessPolicy list, get and
//! status-subresource patch, and the Lease used for leader election, with Kubernetes'
//! semantics for resource versions and the status subresource).
//!
//! What a platform team does, step by step: a resource is created (applied to the
//! federation, `Accepted=True`), broken (`Accepted=False, Invalid`, every problem with
//! its path, the federation keeps its policy), fixed; the federation's policy changed by
//! hand is put back; a second resource without `--name` is ambiguous and nothing is
//! applied; of two leader-elected replicas only the leader acts, and the standby takes
//! over when the leader is killed.

#[path = "../../member-agent/tests/support/fake_apiserver.rs"]
mod fake_apiserver;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fake_apiserver::{FakeApi, Kind};
use kvota_client::client::Client;
use kvota_fairness::policy::Policy;
use kvota_proto::v1;
use kvota_testkit::{Cluster, Files, Pki};
use kvota_tls::Role;
use serde_json::{json, Value};

fn repo(path: &str) -> String {
    format!("{}/../{path}", env!("CARGO_MANIFEST_DIR"))
}

/// A policy file as the resource `kubectl apply -f` would create (generation `gen`).
fn resource(file: &str, gen: i64) -> Value {
    let text = std::fs::read_to_string(repo(file)).expect("read policy");
    let mut v: Value = serde_yaml_ng::from_str(&text).expect("policy file is YAML");
    v["metadata"]["generation"] = json!(gen);
    v
}

fn kubeconfig(dir: &Path, api: &FakeApi) -> String {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster: {{server: \"{}\"}}\nusers:\n- name: u\n  user: {{token: t}}\ncontexts:\n- name: c\n  context: {{cluster: fake, user: u}}\ncurrent-context: c\n",
            api.url
        ),
    )
    .expect("write kubeconfig");
    path.to_string_lossy().into_owned()
}

struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn sync(cp: &str, op: &Files, kubeconfig: &str, extra: &[&str], log: &Path) -> Proc {
    let log = std::fs::File::create(log).expect("log file");
    let child = Command::new(env!("CARGO_BIN_EXE_kvota"))
        .args([
            "policy",
            "sync",
            "--kubeconfig",
            kubeconfig,
            "--interval",
            "1s",
            "--cp",
            cp,
        ])
        .args([
            "--cp-ca",
            &op.ca.to_string_lossy(),
            "--cp-cert",
            &op.cert.to_string_lossy(),
            "--cp-key",
            &op.key.to_string_lossy(),
        ])
        .args(extra)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start kvota policy sync");
    Proc(child)
}

fn accepted(obj: &Value) -> Option<(String, String)> {
    obj["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Accepted")
        .map(|c| {
            (
                c["status"].as_str().unwrap_or("").to_string(),
                c["reason"].as_str().unwrap_or("").to_string(),
            )
        })
}

/// Waits until the resource's Accepted condition is `(status, reason)` for generation `gen`.
async fn until_condition(api: &FakeApi, kind: Kind, name: &str, gen: i64, want: (&str, &str), log: &Path) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(obj) = api.get(kind, name) {
            let c = accepted(&obj);
            if c.as_ref().is_some_and(|(s, r)| s == want.0 && r == want.1)
                && obj["status"]["observedGeneration"] == json!(gen)
            {
                return obj;
            }
            if Instant::now() > deadline {
                panic!(
                    "{name}: condition {c:?}, wanted {want:?} at generation {gen}: {obj:#}\nlog:\n{}",
                    std::fs::read_to_string(log).unwrap_or_default()
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn in_force(c: &Client) -> Option<Policy> {
    let r = c
        .call(|ch| async move { Ok(Client::admin(ch).get_policy(v1::Empty {}).await?.into_inner()) })
        .await
        .expect("get policy");
    Policy::from_yaml(&r.yaml).ok()
}

async fn until_in_force(c: &Client, want: &Policy, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while in_force(c).await.as_ref() != Some(want) {
        assert!(
            Instant::now() < deadline,
            "policy `{}` not in force within 30 s\nlog:\n{}",
            want.name,
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn apply_by_hand(c: &Client, file: &str) {
    let yaml = std::fs::read_to_string(repo(file)).expect("read");
    c.call(|ch| {
        let yaml = yaml.clone();
        async move {
            Ok(Client::admin(ch)
                .apply_policy(v1::PolicyRequest { yaml })
                .await?
                .into_inner())
        }
    })
    .await
    .expect("apply by hand");
}

fn policy(file: &str) -> Policy {
    Policy::from_yaml(&std::fs::read_to_string(repo(file)).expect("read")).expect("valid")
}

/// A one-node control plane over mTLS, an operator certificate for the controller, a
/// fake API server and a kubeconfig for it.
struct World {
    pki: Pki,
    cluster: Cluster,
    cp: String,
    admin: Client,
    op: Files,
    api: FakeApi,
    tmp: tempfile::TempDir,
    kc: String,
}

impl World {
    async fn start() -> World {
        let pki = Pki::new("sync.test");
        let cluster = Cluster::start_with(1, Some(&pki), |_| {}).await;
        cluster.leader(Duration::from_secs(20)).await;
        let cp = cluster.endpoints()[0].clone();
        let admin = Client::with_tls(&cluster.endpoints(), Some(pki.party(Role::Operator, "tester"))).expect("client");
        let op = pki.files(Role::Operator, "policy-sync");
        let api = FakeApi::start().await;
        let tmp = tempfile::tempdir().expect("tmp");
        let kc = kubeconfig(tmp.path(), &api);
        World {
            pki,
            cluster,
            cp,
            admin,
            op,
            api,
            tmp,
            kc,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fairness_policy_resource_becomes_the_federations_policy() {
    let World {
        pki: _pki,
        cluster,
        cp,
        admin,
        op,
        api,
        tmp,
        kc,
    } = World::start().await;
    // extended.yaml sets showback, which needs feature level 2.
    cluster
        .feature_level(
            kvota_control_plane::feature::FeatureLevel::RECORDS,
            Duration::from_secs(20),
        )
        .await;
    let log = tmp.path().join("sync.log");

    // Created: applied, Accepted=True (Applied), observed generation 1.
    api.put(Kind::FairnessPolicy, resource("deploy/policies/extended.yaml", 1));
    let proc = sync(&cp, &op, &kc, &[], &log);
    until_condition(
        &api,
        Kind::FairnessPolicy,
        "platform-gpus",
        1,
        ("True", "Applied"),
        &log,
    )
    .await;
    let extended = policy("deploy/policies/extended.yaml");
    assert_eq!(in_force(&admin).await.as_ref(), Some(&extended));
    // The audit log names the controller's identity.
    let fed = cluster.federation(1).await;
    assert!(
        fed.audit_filtered(None, Some("operator/policy-sync"), None).count() >= 1,
        "no audit record by operator/policy-sync: {:?}",
        fed.audit().map(|r| r.actor.clone()).collect::<Vec<_>>()
    );
    // Nothing changes: status is not rewritten every round.
    let patches = api.status_patches();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        api.status_patches(),
        patches,
        "status rewritten although nothing changed: {:#}\n{}",
        api.get(Kind::FairnessPolicy, "platform-gpus").unwrap_or_default(),
        std::fs::read_to_string(&log).unwrap_or_default()
    );

    // Broken: minShare above maxShare and a misspelt field. Invalid, every problem with
    // its path; the federation keeps the policy it has.
    let mut broken = resource("deploy/policies/extended.yaml", 2);
    broken["spec"]["tenants"][0]["minShare"] = json!(90);
    broken["spec"]["tenants"][1]["maxQeued"] = json!(5);
    api.put(Kind::FairnessPolicy, broken);
    let obj = until_condition(
        &api,
        Kind::FairnessPolicy,
        "platform-gpus",
        2,
        ("False", "Invalid"),
        &log,
    )
    .await;
    let paths: Vec<&str> = obj["status"]["problems"]
        .as_array()
        .expect("problems")
        .iter()
        .filter_map(|p| p["path"].as_str())
        .collect();
    assert!(paths.contains(&"spec.tenants[0].minShare"), "{paths:?}");
    assert!(paths.contains(&"spec.tenants[1].maxQeued"), "{paths:?}");
    assert!(
        obj["status"]["problems"]
            .to_string()
            .contains("did you mean `maxQueued`"),
        "{obj:#}"
    );
    assert_eq!(
        in_force(&admin).await.as_ref(),
        Some(&extended),
        "an invalid resource changed the federation"
    );

    // Very broken: 150 tenants with shares over 100 %. Status stays small: the first
    // 100 problems and a count of the rest.
    let mut huge = resource("deploy/policies/extended.yaml", 3);
    huge["spec"]["tenants"] = json!((0..150)
        .map(|i| json!({"name": format!("t{i}"), "minShare": 101}))
        .collect::<Vec<_>>());
    api.put(Kind::FairnessPolicy, huge);
    let obj = until_condition(
        &api,
        Kind::FairnessPolicy,
        "platform-gpus",
        3,
        ("False", "Invalid"),
        &log,
    )
    .await;
    let problems = obj["status"]["problems"].as_array().expect("problems");
    assert_eq!(problems.len(), 101, "{}", problems.len());
    assert_eq!(problems[100]["path"], "(more)");
    assert!(
        problems[100]["message"]
            .as_str()
            .unwrap_or("")
            .contains("more problems"),
        "{:#}",
        problems[100]
    );

    // Fixed (now the article's policy, the article's document unchanged as a resource):
    // applied, the problems are gone.
    let mut fixed = resource("deploy/policies/article.yaml", 4);
    fixed["metadata"]["name"] = json!("platform-gpus");
    fixed["apiVersion"] = json!("kvota.dev/v1alpha1");
    api.put(Kind::FairnessPolicy, fixed);
    let obj = until_condition(
        &api,
        Kind::FairnessPolicy,
        "platform-gpus",
        4,
        ("True", "Applied"),
        &log,
    )
    .await;
    assert!(
        obj["status"].get("problems").is_none_or(Value::is_null),
        "problems left behind: {obj:#}"
    );
    let mut article = policy("deploy/policies/article.yaml");
    article.name = "platform-gpus".to_string();
    article.api_version = "kvota.dev/v1alpha1".to_string();
    until_in_force(&admin, &article, &log).await;

    // Changed by hand: the resource is the source of truth, and is put back.
    apply_by_hand(&admin, "deploy/policies/philly-vc.yaml").await;
    until_in_force(&admin, &article, &log).await;

    // A second resource (the article's group) and no --name: ambiguous, nothing applied.
    api.put(Kind::ArticlePolicy, resource("deploy/policies/article.yaml", 1));
    let obj = until_condition(
        &api,
        Kind::ArticlePolicy,
        "myfair-cluster",
        1,
        ("False", "Ambiguous"),
        &log,
    )
    .await;
    assert!(
        obj["status"]["conditions"][0]["message"]
            .as_str()
            .unwrap_or("")
            .contains("--name"),
        "{obj:#}"
    );
    until_condition(
        &api,
        Kind::FairnessPolicy,
        "platform-gpus",
        4,
        ("False", "Ambiguous"),
        &log,
    )
    .await;
    drop(proc);

    // With --name, the named one is followed (the article's group: its own document,
    // untouched) and the other says so.
    let proc = sync(&cp, &op, &kc, &["--name", "myfair-cluster"], &log);
    until_condition(
        &api,
        Kind::ArticlePolicy,
        "myfair-cluster",
        1,
        ("True", "Applied"),
        &log,
    )
    .await;
    until_condition(
        &api,
        Kind::FairnessPolicy,
        "platform-gpus",
        4,
        ("False", "NotSelected"),
        &log,
    )
    .await;
    until_in_force(&admin, &policy("deploy/policies/article.yaml"), &log).await;
    drop(proc);

    // The same name in both groups: --name NAME is ambiguous and says how to pick one;
    // --name GROUP/NAME picks.
    let mut twin = resource("deploy/policies/philly-vc.yaml", 1);
    twin["metadata"]["name"] = json!("myfair-cluster");
    api.put(Kind::FairnessPolicy, twin);
    let proc = sync(&cp, &op, &kc, &["--name", "myfair-cluster"], &log);
    let obj = until_condition(
        &api,
        Kind::FairnessPolicy,
        "myfair-cluster",
        1,
        ("False", "Ambiguous"),
        &log,
    )
    .await;
    assert!(obj.to_string().contains("--name GROUP/NAME"), "{obj:#}");
    drop(proc);
    let proc = sync(&cp, &op, &kc, &["--name", "kvota.dev/myfair-cluster"], &log);
    until_condition(
        &api,
        Kind::FairnessPolicy,
        "myfair-cluster",
        1,
        ("True", "Applied"),
        &log,
    )
    .await;
    until_condition(
        &api,
        Kind::ArticlePolicy,
        "myfair-cluster",
        1,
        ("False", "NotSelected"),
        &log,
    )
    .await;
    let mut philly = policy("deploy/policies/philly-vc.yaml");
    philly.name = "myfair-cluster".to_string();
    until_in_force(&admin, &philly, &log).await;
    drop(proc);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_elected_replica_acts_and_a_standby_takes_over() {
    let World {
        pki: _pki,
        cluster,
        cp,
        admin,
        op,
        api,
        tmp,
        kc,
    } = World::start().await;
    let logs = [tmp.path().join("a.log"), tmp.path().join("b.log")];
    api.put(Kind::ArticlePolicy, resource("deploy/policies/article.yaml", 1));
    let lease = ["--leader-lease", "kvota-policy-sync", "--namespace", "kvota-system"];
    let mut procs: Vec<Option<Proc>> = ["a", "b"]
        .iter()
        .zip(&logs)
        .map(|(id, log)| Some(sync(&cp, &op, &kc, &[&lease[..], &["--identity", id]].concat(), log)))
        .collect();
    until_condition(
        &api,
        Kind::ArticlePolicy,
        "myfair-cluster",
        1,
        ("True", "Applied"),
        &logs[0],
    )
    .await;
    let holder = api.get(Kind::Lease, "kvota-system/kvota-policy-sync").expect("lease")["spec"]["holderIdentity"]
        .as_str()
        .expect("holder")
        .to_string();
    let (leader, standby) = if holder == "a" { (0, 1) } else { (1, 0) };
    // Only a leader talks to the control plane: every apply in either log comes while
    // that replica holds the Lease by its own account. (Which one leads may change
    // before this point: on a busy machine a leader can miss a renewal.)
    for log in &logs {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let mut leading = false;
        for line in text.lines() {
            if line.contains("policy sync leadership changed") {
                leading = line.contains("leader=true");
            }
            assert!(
                !line.contains("applied to the federation") || leading,
                "applied while not leading:\n{text}"
            );
        }
    }

    // The leader dies without giving the Lease up; the standby takes over after the
    // Lease runs out and follows the next change.
    procs[leader] = None;
    api.put(Kind::ArticlePolicy, {
        let mut r = resource("deploy/policies/article.yaml", 2);
        r["spec"]["tenants"][2]["weight"] = json!(20);
        r
    });
    let obj = until_condition(
        &api,
        Kind::ArticlePolicy,
        "myfair-cluster",
        2,
        ("True", "Applied"),
        &logs[standby],
    )
    .await;
    assert_eq!(accepted(&obj).map(|c| c.1), Some("Applied".to_string()));
    let holder =
        api.get(Kind::Lease, "kvota-system/kvota-policy-sync").expect("lease")["spec"]["holderIdentity"].clone();
    assert_eq!(holder, json!(["a", "b"][standby]));
    let p = in_force(&admin).await.expect("a policy");
    assert_eq!(p.tenant("research").map(|t| t.weight_milli), Some(20_000));

    // SIGTERM: the leader stops at once and gives the Lease up for the next replica.
    let pid = procs[standby].as_ref().expect("running").0.id();
    let killed = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let code = loop {
        if let Some(code) = procs[standby].as_mut().expect("running").0.try_wait().expect("wait") {
            break code;
        }
        assert!(Instant::now() < deadline, "still running 10 s after SIGTERM");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(code.success(), "{code:?}");
    let holder =
        api.get(Kind::Lease, "kvota-system/kvota-policy-sync").expect("lease")["spec"]["holderIdentity"].clone();
    assert_eq!(holder, json!(""), "the Lease was not given up");
    drop(procs);
    cluster.shutdown().await;
}

/// Refusals a user meets first: no operator certificate for a remote control plane, no
/// Kubernetes to talk to, a bad interval.
#[test]
fn refuses_to_start_without_what_it_needs() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_kvota"))
            .args(args)
            .env_remove("KUBECONFIG")
            .env("HOME", "/nonexistent")
            .output()
            .expect("run");
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, err) = run(&["policy", "sync", "--cp", "10.1.2.3:7401", "--once"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("operator certificate"), "{err}");
    let (code, err) = run(&["policy", "sync", "--cp", "127.0.0.1:1", "--once"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--kubeconfig"), "{err}");
    let (code, err) = run(&["policy", "sync", "--interval", "0s"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("1s to 1h"), "{err}");
    let (code, err) = run(&["policy", "sync", "--name", "example.com/x"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("not a FairnessPolicy group"), "{err}");
}

/// Without the CRDs, `--once` says so (exit 1), not "unreachable" in general.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_without_the_crds_is_told_to_install_them() {
    let api = FakeApi::start().await;
    api.set_served(Kind::FairnessPolicy, false);
    api.set_served(Kind::ArticlePolicy, false);
    let tmp = tempfile::tempdir().expect("tmp");
    let kc = kubeconfig(tmp.path(), &api);
    let out = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_kvota"))
            .args(["policy", "sync", "--once", "--cp", "127.0.0.1:1", "--kubeconfig", &kc])
            .output()
            .expect("run")
    })
    .await
    .expect("join");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("fairnesspolicies.kvota.dev and fairnesspolicies.kvitej.io is not installed"),
        "{err}"
    );
    assert!(err.contains("kvota policy crd"), "{err}");
}
