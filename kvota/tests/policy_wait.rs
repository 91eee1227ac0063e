//! A policy change that visibly arrives: `kvota policy apply --wait` against a control
//! plane with two member clusters, each a real `kvota agent` process on a simulated
//! cluster (no Kubernetes API server runs here).
//!
//! One federation, three changes in a row:
//! - both agents connected: `--wait` returns once both enforce the new revision, within
//!   two report intervals of the commit, and exits 0;
//! - one agent merely slow (stopped with SIGSTOP, its lease still in force): `--wait`
//!   waits for it and times out naming it (exit 4);
//! - the same agent cut off past its lease: `--wait` names it, does not wait for it,
//!   and exits 3; resumed, the agent fetches the revision in force at its next report.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvota_client::client::Client;
use kvota_proto::v1;

/// How often the agents report: the measure of "two report intervals".
const INTERVAL_MS: u64 = 1_500;

fn kvota() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvota"))
}

/// The policy with the research tenant's weight `w` (each weight a new revision).
fn policy(w: u32) -> String {
    format!(
        "apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {{name: waiting}}
spec:
  lease: {{duration: 6s, clockSkewMargin: 500ms}}
  tenants:
  - {{name: training, weight: 40, minShare: 20, maxShare: 60, namespaces: [ml]}}
  - {{name: research, weight: {w}, minShare: 5, maxShare: 25, namespaces: [lab]}}
"
    )
}

/// A `kvota agent` for `cluster` on one simulated 8-GPU node, reporting every
/// [`INTERVAL_MS`], its webhook on `port` with a self-signed certificate in `dir`.
fn agent(dir: &std::path::Path, cluster: &str, cp: &str, port: u16) -> std::process::Child {
    kvota()
        .args(["agent", "--cluster", cluster, "--cp", cp, "--simulate", "1x8"])
        .args(["--report-interval-ms", &INTERVAL_MS.to_string()])
        .args(["--webhook-listen", &format!("127.0.0.1:{port}")])
        .arg("--tls-cert")
        .arg(dir.join("tls.crt"))
        .arg("--tls-key")
        .arg(dir.join("tls.key"))
        .arg("--data-dir")
        .arg(dir.join(cluster))
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::from(
            std::fs::File::create(dir.join(format!("{cluster}.log"))).expect("log"),
        ))
        .spawn()
        .expect("spawn agent")
}

/// `kvota policy apply FILE --wait --timeout T`: exit code, stdout, stderr.
fn apply_and_wait(cp: &str, file: &std::path::Path, timeout: &str) -> (i32, String, String) {
    let out = kvota()
        .args(["policy", "apply"])
        .arg(file)
        .args(["--wait", "--timeout", timeout, "--cp", cp])
        .output()
        .expect("run kvota policy apply");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn signal(child: &std::process::Child, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(ok.success(), "kill {sig}");
}

async fn clusters(c: &Client) -> v1::ListClustersReply {
    c.call(|ch| async move { Ok(Client::admin(ch).list_clusters(v1::Empty {}).await?.into_inner()) })
        .await
        .expect("list clusters")
}

/// The policy revision each cluster's agent enforces, and whether it is cut off.
async fn standing(c: &Client) -> Vec<(String, Option<u64>, bool)> {
    clusters(c)
        .await
        .clusters
        .into_iter()
        .map(|x| (x.cluster, x.status.map(|s| s.policy_revision), x.unreachable))
        .collect()
}

async fn wait_until<F, Fut>(what: &str, within: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Seconds `policy apply --wait` took from the commit, as it says.
fn took(out: &str) -> f64 {
    out.rsplit_once(" s after the commit")
        .and_then(|(before, _)| before.rsplit(['(', ' ']).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no time in: {out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_apply_waits_for_connected_clusters_and_names_cut_off_ones() {
    let started = Instant::now();
    let cl = kvota_testkit::Cluster::start(1).await;
    cl.leader(Duration::from_secs(10)).await;
    cl.feature_level(
        kvota_control_plane::feature::FeatureLevel::OPERATOR_VIEW,
        Duration::from_secs(20),
    )
    .await;
    let cp = cl.endpoints()[0].clone();
    let admin = Client::new(&cl.endpoints()).expect("client");
    let tmp = tempfile::tempdir().expect("tmp");
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("rcgen");
    std::fs::write(tmp.path().join("tls.crt"), cert.cert.pem()).expect("w");
    std::fs::write(tmp.path().join("tls.key"), cert.key_pair.serialize_pem()).expect("w");
    let file = tmp.path().join("policy.yaml");
    std::fs::write(&file, policy(10)).expect("w");
    let (code, out, err) = apply_and_wait(&cp, &file, "10s");
    assert_eq!(code, 0, "the first policy, no clusters yet: {out}{err}");
    assert!(out.contains("as revision 1"), "{out}");

    let ports = kvota_testkit::procs::free_ports(2);
    let mut procs = kvota_testkit::procs::Procs(Vec::new());
    procs.push(agent(tmp.path(), "east", &cp, ports[0]));
    procs.push(agent(tmp.path(), "west", &cp, ports[1]));
    wait_until("both agents on revision 1", Duration::from_secs(30), || async {
        standing(&admin).await.iter().filter(|(_, r, _)| *r == Some(1)).count() == 2
    })
    .await;

    // Both connected: --wait returns when both enforce revision 2, within two report
    // intervals of the commit.
    std::fs::write(&file, policy(20)).expect("w");
    let (code, out, err) = apply_and_wait(&cp, &file, "20s");
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("committed policy `waiting` with 2 tenants as revision 2")
            && out.contains("spec.tenants[research].weight: 10 -> 20"),
        "what was committed: {out}"
    );
    assert!(out.contains("every member cluster enforces revision 2"), "{out}");
    let secs = took(&out);
    eprintln!("both clusters on revision 2 {secs} s after the commit");
    assert!(
        secs <= 2.0 * INTERVAL_MS as f64 / 1000.0,
        "both clusters enforced it {secs} s after the commit: more than two report intervals\n{out}"
    );
    assert!(standing(&admin).await.iter().all(|(_, r, _)| *r == Some(2)));

    // West merely slow: stopped, its lease still in force. --wait waits, and times out
    // naming it.
    let west = procs.0[1].as_ref().expect("west");
    signal(west, "-STOP");
    std::fs::write(&file, policy(30)).expect("w");
    let (code, out, err) = apply_and_wait(&cp, &file, "3s");
    assert_eq!(code, 4, "a slow cluster times the wait out: {out}{err}");
    assert!(err.contains("still not on revision 3: west"), "{err}");
    assert!(!err.contains("cut off"), "west is connected: {err}");
    assert!(out.contains("east") && out.contains("enforces revision 3"), "{out}");

    // West cut off: its lease expires while it stays stopped. --wait names it and
    // returns once every connected cluster (east) enforces the revision.
    wait_until("west cut off", Duration::from_secs(15), || async {
        standing(&admin).await.iter().any(|(c, _, cut)| c == "west" && *cut)
    })
    .await;
    std::fs::write(&file, policy(40)).expect("w");
    let t = Instant::now();
    let (code, out, err) = apply_and_wait(&cp, &file, "30s");
    assert_eq!(code, 3, "a cut-off cluster is named, not waited for: {out}{err}");
    assert!(
        out.contains("west") && out.contains("cut off since") && out.contains("not waited for"),
        "{out}"
    );
    assert!(
        out.contains("every connected cluster enforces revision 4") && out.contains("cut off, not waited for: west"),
        "{out}"
    );
    assert!(t.elapsed() < Duration::from_secs(15), "it did not wait for west");

    // Resumed, west reports, learns of revision 4 in the answer and fetches it.
    let west = procs.0[1].as_ref().expect("west");
    signal(west, "-CONT");
    wait_until("west on revision 4", Duration::from_secs(20), || async {
        standing(&admin)
            .await
            .iter()
            .any(|(c, r, cut)| c == "west" && *r == Some(4) && !*cut)
    })
    .await;
    let audit = admin
        .call(|ch| async move {
            Ok(Client::admin(ch)
                .audit_log(v1::AuditLogRequest {
                    kinds: vec!["lease".into()],
                    ..Default::default()
                })
                .await?
                .into_inner())
        })
        .await
        .expect("audit");
    let events: Vec<String> = audit
        .entries
        .into_iter()
        .filter_map(|r| kvota_fairness::federation::AuditRecord::try_from(r).ok())
        .map(|r| format!("{:?}", r.event))
        .collect();
    assert!(
        events
            .iter()
            .any(|e| e.starts_with("LeaseExpired") && e.contains("west"))
            && events
                .iter()
                .any(|e| e.starts_with("LeaseRenewed") && e.contains("west")),
        "the partition is in the audit log: {events:?}"
    );
    drop(procs);
    cl.shutdown().await;
    eprintln!("policy_wait took {:.1} s", started.elapsed().as_secs_f64());
}
