//! Metrics in Prometheus conventions, checked by Prometheus's own tools: a real node (in
//! this process, real HTTP) and an agent with a simulated cluster that made a pod wait;
//! `promtool check metrics` passes on both expositions; every series either exports is
//! listed in docs/metrics.md and every series listed there is exported; the alert rules
//! in deploy/prometheus pass `promtool check rules` and their unit tests (`promtool test
//! rules`); a real Prometheus server scrapes the node and answers a query for the
//! per-tenant series with the node's numbers, and the Grafana dashboard's queries; the
//! dashboard reads only documented series, with queries that parse.
//!
//! `promtool` and `prometheus` come from Debian's `prometheus` package, which
//! `scripts/test` installs when missing.

use kvota_fairness::names::ClusterName;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvota_client::client::Client;
use kvota_member_agent::agent::Agent;
use kvota_member_agent::metrics::AgentMetrics;
use kvota_member_agent::review::Outcome;
use kvota_member_agent::sim::{SimCluster, SimPod};
use kvota_proto::v1;

const POLICY: &str = "
apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: metrics}
spec:
  lease: {duration: 3s, clockSkewMargin: 300ms}
  # No lending: the test needs a first pod that waits for its budget (a preemptible
  # tenant's pod would otherwise start at once on idle GPUs).
  reclaim: {lendIdle: false}
  tenants:
  - {name: training, weight: 40, minShare: 20, maxShare: 60, preemptible: true, namespaces: [ml]}
  - {name: inference, weight: 50, minShare: 40, maxShare: 80, namespaces: [serving]}
  - {name: research, weight: 10, minShare: 5, maxShare: 25, preemptible: true, namespaces: [lab]}
";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn tool(name: &str) -> PathBuf {
    let found =
        std::env::var_os("PATH").and_then(|p| std::env::split_paths(&p).map(|d| d.join(name)).find(|f| f.is_file()));
    found.unwrap_or_else(|| {
        panic!("`{name}` not found on PATH: install Debian's `prometheus` package (scripts/test does)")
    })
}

/// `promtool` with `args`, `stdin` fed to it: (success, stdout and stderr).
fn promtool(args: &[&str], dir: &Path, stdin: &str) -> (bool, String) {
    let mut child = Command::new(tool("promtool"))
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("feed promtool");
    let out = child.wait_with_output().expect("promtool ends");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

async fn http_get(addr: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect http");
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
        .await
        .expect("answered in time")
        .expect("read");
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

/// An OpenMetrics exposition (what both binaries serve) in the classic Prometheus text
/// format that `promtool check metrics` (2.42) lints: a counter's family is named with
/// its `_total` in `# HELP` and `# TYPE`, and there is no `# EOF`. Names, help texts,
/// types and samples are otherwise as served.
fn classic(openmetrics: &str) -> String {
    let counters: BTreeSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::new();
    for line in openmetrics.lines() {
        if line == "# EOF" {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ')?;
            counters.contains(name).then(|| format!("{p}{name}_total {tail}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

/// The metric families an exposition declares (`# TYPE name kind`), with `_total` of
/// counters and `_bucket` etc. of histograms as written in the samples.
fn families(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let (name, kind) = (it.next()?, it.next()?);
            Some(if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_string()
            })
        })
        .collect()
}

/// The series docs/metrics.md lists (the first backticked word of each table row), with
/// their type (the second column).
fn documented() -> BTreeMap<String, String> {
    let doc = std::fs::read_to_string(repo().join("docs/metrics.md")).expect("docs/metrics.md");
    doc.lines()
        .filter_map(|l| {
            let mut cols = l.strip_prefix("| `")?.split('|');
            let name = cols.next()?.split('`').next()?.to_string();
            let kind = cols.next()?.trim().to_string();
            name.starts_with("kvota_").then_some((name, kind))
        })
        .collect()
}

/// Every query of the Grafana dashboard in deploy/grafana, with its panel's title.
fn dashboard_queries() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo().join("deploy/grafana/kvota-dashboard.json")).expect("the dashboard");
    let d: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut out = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        let title = p["title"].as_str().expect("a title").to_string();
        for t in p["targets"].as_array().expect("targets") {
            out.push((title.clone(), t["expr"].as_str().expect("an expr").to_string()));
        }
    }
    out
}

/// The kvota series a PromQL expression reads (histogram samples by their family).
fn series_in(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = expr;
    while let Some(i) = rest.find("kvota_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        out.insert(family.to_string());
        rest = &tail[end..];
    }
    out
}

/// The dashboard: its panels are laid out on Grafana's 24 columns with distinct ids,
/// every query parses as PromQL (`promtool check rules` on them as recording rules),
/// and every series it reads is one docs/metrics.md lists.
#[test]
fn the_grafana_dashboard_reads_only_documented_series_with_valid_queries() {
    let text = std::fs::read_to_string(repo().join("deploy/grafana/kvota-dashboard.json")).expect("the dashboard");
    let d: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let mut ids = BTreeSet::new();
    for p in d["panels"].as_array().expect("panels") {
        assert!(ids.insert(p["id"].as_u64().expect("id")), "panel id repeated: {p}");
        let g = &p["gridPos"];
        let (x, w) = (g["x"].as_u64().expect("x"), g["w"].as_u64().expect("w"));
        assert!(w > 0 && x + w <= 24, "{}: beyond 24 columns", p["title"]);
    }
    let queries = dashboard_queries();
    assert!(queries.len() >= 15, "{queries:?}");
    let doc = documented();
    for (title, expr) in &queries {
        let read = series_in(expr);
        assert!(!read.is_empty(), "{title}: reads no kvota series: {expr}");
        for s in read {
            assert!(doc.contains_key(&s), "{title}: {s} is not in docs/metrics.md");
        }
    }
    let dir = tempfile::tempdir().expect("tmp");
    let mut rules = String::from("groups:\n- name: dashboard\n  rules:\n");
    for (i, (_, expr)) in queries.iter().enumerate() {
        rules.push_str(&format!(
            "  - record: kvota:dashboard:{i}\n    expr: {}\n",
            serde_json::to_string(expr).expect("quoted")
        ));
    }
    std::fs::write(dir.path().join("dashboard.rules.yaml"), rules).expect("write");
    let (ok, out) = promtool(&["check", "rules", "dashboard.rules.yaml"], dir.path(), "");
    assert!(ok, "{out}");
}

fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_pass_promtool_are_documented_and_a_real_prometheus_scrapes_them() {
    let cl = kvota_testkit::Cluster::start(1).await;
    cl.leader(Duration::from_secs(15)).await;
    cl.feature_level(
        kvota_control_plane::feature::FeatureLevel::OPERATOR_VIEW,
        Duration::from_secs(20),
    )
    .await; // lendIdle needs level 3, policy revisions 6
    let endpoints = cl.endpoints();
    let admin = Client::new(&endpoints).expect("client");
    let y = POLICY.to_string();
    admin
        .call(|ch| {
            let y = y.clone();
            async move {
                Ok(Client::admin(ch)
                    .apply_policy(v1::PolicyRequest { yaml: y })
                    .await?
                    .into_inner())
            }
        })
        .await
        .expect("policy");

    // An agent on a simulated 8-GPU cluster: a 4-GPU training pod is denied until
    // reports raise training's budget, then admitted: one admission wait.
    let tmp = tempfile::tempdir().expect("tmp");
    let agent = Agent::open(
        &ClusterName::from_static("east"),
        [("nvidia.com/gpu".to_string(), 8_000)].into(),
        &tmp.path().join("agent"),
        &endpoints,
    )
    .expect("agent");
    agent.register().await.expect("register");
    agent.fetch_policy().await.expect("policy");
    let mut sim = SimCluster::new(&[8]);
    let metrics = AgentMetrics::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut denied = 0;
    loop {
        let outcome = {
            let mut st = agent.state();
            sim.submit(&mut st, &SimPod::gpus("ml", "big", 4, 600_000, 0))
        };
        if outcome == Outcome::Allowed {
            break;
        }
        denied += 1;
        assert!(Instant::now() < deadline, "the pod was never admitted");
        let _ = agent.report_once().await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    {
        let mut st = agent.state();
        let now = st.now_ms();
        sim.step(&mut st, now);
    }
    let _ = agent.report_once().await;
    let agent_text = metrics.render(&agent);
    // Before any report training's budget here is its share of nothing asked for: the
    // first try is denied.
    assert!(denied > 0, "the pod was admitted at once");
    let waited = sample(
        &agent_text,
        r#"kvota_agent_admission_wait_seconds_count{tenant="training"}"#,
    );
    assert_eq!(
        waited,
        Some(1.0),
        "one pod waited (denied {denied} times):\n{agent_text}"
    );
    let sum = sample(
        &agent_text,
        r#"kvota_agent_admission_wait_seconds_sum{tenant="training"}"#,
    )
    .expect("sum");
    assert!(sum > 0.0 && sum < 30.0, "waited {sum} s");
    assert_eq!(
        sample(&agent_text, r#"kvota_agent_inuse_gpus{tenant="training"}"#),
        Some(4.0),
        "{agent_text}"
    );

    // The node's exposition, once it has applied the agent's report.
    let http = cl.members[&1].http_addr.clone();
    let node_text = loop {
        let (code, text) = http_get(&http, "/metrics").await;
        assert_eq!(code, 200);
        if sample(&text, r#"kvota_tenant_inuse_gpus{tenant="training"}"#) == Some(4.0) {
            break text;
        }
        assert!(
            Instant::now() < deadline + Duration::from_secs(10),
            "the node never showed training's 4 GPUs:\n{text}"
        );
        let _ = agent.report_once().await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        sample(&node_text, r#"kvota_cluster_capacity_gpus{cluster="east"}"#),
        Some(8.0),
        "{node_text}"
    );
    assert_eq!(sample(&node_text, "kvota_federation_capacity_gpus"), Some(8.0));
    assert_eq!(
        sample(&node_text, r#"kvota_cluster_unreachable{cluster="east"}"#),
        Some(0.0)
    );
    // The operator view: training's pod runs (bound), the agent enforces revision 1.
    assert_eq!(
        sample(&node_text, r#"kvota_tenant_running_gpus{tenant="training"}"#),
        Some(4.0),
        "{node_text}"
    );
    assert_eq!(
        sample(&node_text, r#"kvota_tenant_admitted_gpus{tenant="training"}"#),
        Some(0.0)
    );
    assert_eq!(sample(&node_text, "kvota_policy_revision"), Some(1.0));
    assert_eq!(
        sample(&node_text, r#"kvota_cluster_policy_revision{cluster="east"}"#),
        Some(1.0),
        "{node_text}"
    );
    assert_eq!(
        sample(&node_text, r#"kvota_cluster_policy_lag_seconds{cluster="east"}"#),
        Some(0.0)
    );
    let agent = format!(
        r#"kvota_cluster_agent{{cluster="east",version="{}",feature_level="{}"}}"#,
        env!("CARGO_PKG_VERSION"),
        kvota_member_agent::revision::FEATURE_LEVEL
    );
    assert_eq!(sample(&node_text, &agent), Some(1.0), "{node_text}");
    assert_eq!(sample(&node_text, "kvota_federation_utilization_ratio"), Some(0.5));
    let score = sample(&node_text, "kvota_fairness_score").expect("fairness score");
    assert!((0.0..=1.0).contains(&score), "{score}");
    assert!(
        node_text.contains(&format!("kvota_build_info{{version=\"{}\"", env!("CARGO_PKG_VERSION"))),
        "{node_text}"
    );

    // Prometheus's linter on both.
    for (who, text) in [("node", &node_text), ("agent", &agent_text)] {
        let (ok, out) = promtool(&["check", "metrics"], &repo(), &classic(text));
        assert!(ok, "promtool check metrics on the {who}'s exposition:\n{out}");
    }

    // docs/metrics.md lists exactly what is exported (histograms by their family name).
    let exported: BTreeSet<String> = families(&node_text).union(&families(&agent_text)).cloned().collect();
    let doc = documented();
    let missing: Vec<_> = exported.iter().filter(|n| !doc.contains_key(*n)).collect();
    assert!(missing.is_empty(), "exported but not in docs/metrics.md: {missing:?}");
    // Counters of events (refusals, reloads, evictions) appear after the first event;
    // certificates' expiry with TLS only (this node and agent run without:
    // control-plane/tests/tls.rs and the agent's metrics tests read them).
    let stale: Vec<_> = doc
        .iter()
        .filter(|(n, kind)| {
            !exported.contains(*n) && kind.as_str() != "counter" && !n.ends_with("certificate_expiry_timestamp_seconds")
        })
        .collect();
    assert!(stale.is_empty(), "in docs/metrics.md but not exported: {stale:?}");
    for (n, kind) in &doc {
        assert!(
            ["gauge", "counter", "histogram"].contains(&kind.as_str()),
            "{n}: type `{kind}`"
        );
        assert_eq!(
            kind == "counter",
            n.ends_with("_total"),
            "{n} is a {kind}: counters and only counters end in _total"
        );
    }

    // The alert rules: valid, and their unit tests pass.
    let rules = repo().join("deploy/prometheus");
    let (ok, out) = promtool(&["check", "rules", "alerts.yaml"], &rules, "");
    assert!(ok, "{out}");
    let (ok, out) = promtool(&["test", "rules", "alerts.test.yaml"], &rules, "");
    assert!(ok, "{out}");

    // A real Prometheus scrapes the node every second; a query returns the per-tenant
    // series with the node's numbers.
    let port = kvota_testkit::procs::free_ports(1)[0];
    let dir = tmp.path().join("prometheus");
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(
        dir.join("prometheus.yml"),
        format!("global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nscrape_configs:\n- job_name: kvota\n  static_configs:\n  - targets: ['{http}']\n"),
    )
    .expect("config");
    let mut prom = Command::new(tool("prometheus"))
        .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("prometheus.log")).expect("log"))
        .spawn()
        .expect("start prometheus");
    let addr = format!("127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let got: BTreeMap<String, f64> = loop {
        let found = match tokio::net::TcpStream::connect(&addr).await {
            Ok(_) => {
                let (code, body) = http_get(&addr, "/api/v1/query?query=kvota_tenant_inuse_gpus").await;
                let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                let series: BTreeMap<String, f64> = v["data"]["result"]
                    .as_array()
                    .map(|r| {
                        r.iter()
                            .filter_map(|s| {
                                Some((
                                    s["metric"]["tenant"].as_str()?.to_string(),
                                    s["value"][1].as_str()?.parse().ok()?,
                                ))
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                (code == 200 && series.len() == 3).then_some(series)
            }
            Err(_) => None,
        };
        if let Some(s) = found {
            break s;
        }
        if Instant::now() > deadline {
            let _ = prom.kill();
            panic!(
                "Prometheus never returned the three tenants' series; its log:\n{}",
                std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    // The dashboard's control-plane panels, against the same Prometheus: every query is
    // answered, and the per-tenant one has the three tenants.
    for (title, expr) in dashboard_queries().iter().filter(|(_, e)| !e.contains("kvota_agent_")) {
        let q: String = expr
            .bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect();
        let (code, body) = http_get(&addr, &format!("/api/v1/query?query={q}")).await;
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        assert!(
            code == 200 && v["status"] == "success",
            "{title}: {expr}: {code} {body}"
        );
        if title.starts_with("Entitlement vs in use") {
            assert_eq!(v["data"]["result"].as_array().map(Vec::len), Some(3), "{title}: {body}");
        }
    }
    let _ = prom.kill();
    let _ = prom.wait();
    assert_eq!(
        got.keys().map(String::as_str).collect::<Vec<_>>(),
        ["inference", "research", "training"]
    );
    assert_eq!(got["training"], 4.0, "{got:?}");
    assert_eq!(got["inference"], 0.0, "{got:?}");
    drop(agent);
    cl.shutdown().await;
}
