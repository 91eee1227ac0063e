//! The dashboard in a real browser: a 3-node control plane (real nodes in this process,
//! real HTTP) with three simulated member clusters (real agents, simulated clusters; no
//! Kubernetes API server can run here); headless Chromium (Debian's `chromium`, which
//! `scripts/test` installs) loads the dashboard from a follower, and the page it built
//! must show the API's numbers: every tenant's row, the tenant x cluster budget matrix,
//! the lease states (one cluster stopped reporting and is on its safe budgets) and the
//! chart's current values. A screenshot is saved as `target/dashboard.png`.
//!
//! The test is slow (a browser), so `cargo test` skips it and `scripts/test` runs it as
//! its own step: `cargo test -p kvota --test dashboard -- --ignored`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kvota_client::client::Client;
use kvota_member_agent::agent::Agent;
use kvota_member_agent::review::Outcome;
use kvota_member_agent::sim::{SimCluster, SimPod};
use kvota_proto::v1;
use serde_json::Value;

const POLICY: &str = "
apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: dashboard}
spec:
  lease: {duration: 6s, clockSkewMargin: 500ms}
  tenants:
  - {name: training, weight: 40, minShare: 20, maxShare: 60, preemptible: true, namespaces: [ml]}
  - {name: inference, weight: 50, minShare: 40, maxShare: 80, namespaces: [serving]}
  - {name: research, weight: 10, minShare: 5, maxShare: 25, preemptible: true, namespaces: [lab]}
";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn chromium() -> PathBuf {
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .find_map(|name| {
            std::env::var_os("PATH").and_then(|p| std::env::split_paths(&p).map(|d| d.join(name)).find(|f| f.is_file()))
        })
        .unwrap_or_else(|| panic!("no Chromium on PATH: install Debian's `chromium` package (scripts/test does)"))
}

/// Runs headless Chromium on `url` with `extra` flags; its stdout.
fn browse(url: &str, extra: &[&str], profile: &Path) -> String {
    let out = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        // Timers run on virtual time: the page's 2 s refresh fires several times
        // within this budget, while fetches to the node take the real time they take.
        .arg("--virtual-time-budget=9000")
        .arg("--window-size=1400,2200")
        .args(extra)
        .arg(url)
        .output()
        .expect("run chromium");
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// GET over plain HTTP: status, head, body.
async fn get(addr: &str, path: &str) -> (u16, String, String) {
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
    let (head, body) = text
        .split_once("\r\n\r\n")
        .map(|(h, b)| (h.to_string(), b.to_string()))
        .unwrap_or_default();
    (code, head.to_ascii_lowercase(), body)
}

async fn get_json(addr: &str, path: &str) -> Value {
    let (code, _, body) = get(addr, path).await;
    assert_eq!(code, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"))
}

/// The part of `html` from the element with `id` to the end of that table or list.
fn section<'a>(html: &'a str, id: &str, end: &str) -> &'a str {
    let start = html
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no #{id} in the page:\n{html}"));
    let rest = &html[start..];
    &rest[..rest.find(end).unwrap_or(rest.len())]
}

/// The `<tr …>` … `</tr>` whose opening tag carries `attr`.
fn row<'a>(html: &'a str, attr: &str) -> Option<&'a str> {
    let at = html.find(&format!("<tr {attr}"))?;
    let rest = &html[at..];
    Some(&rest[..rest.find("</tr>")?])
}

/// In `html`, the element carrying `attr`: its `data-value` and its text.
fn cell(html: &str, attr: &str) -> Option<(String, String)> {
    let at = html.find(attr)?;
    let tag_end = at + html[at..].find('>')?;
    let tag = &html[at..tag_end];
    let value = tag
        .split_once("data-value=\"")
        .map(|(_, v)| v[..v.find('"').unwrap_or(0)].to_string())
        .unwrap_or_default();
    let text_end = tag_end + 1 + html[tag_end + 1..].find('<')?;
    Some((value, html[tag_end + 1..text_end].to_string()))
}

/// `milli` GPUe as the page writes it.
fn shown(milli: u64) -> String {
    format!("{:.2}", milli as f64 / 1000.0)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 0.011
}

/// A member: an agent on a simulated cluster of `gpus` per node, with pods submitted
/// and bound.
struct Member {
    agent: Agent,
    sim: SimCluster,
}

impl Member {
    async fn start(name: &str, nodes: &[u32], dir: &Path, endpoints: &[String]) -> Member {
        let total: u64 = nodes.iter().map(|g| u64::from(*g) * 1000).sum();
        let agent = Agent::open(
            &kvota_fairness::names::ClusterName::parse(name).expect("name"),
            [("nvidia.com/gpu".to_string(), total)].into(),
            &dir.join(name),
            endpoints,
        )
        .expect("agent");
        agent.register().await.expect("register");
        agent.fetch_policy().await.expect("policy");
        Member {
            agent,
            sim: SimCluster::new(nodes),
        }
    }

    /// Submits `pod` until admitted (reports in between raise budgets), then binds it.
    async fn run(&mut self, pod: SimPod) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let outcome = {
                let mut st = self.agent.state();
                self.sim.submit(&mut st, &pod)
            };
            if outcome == Outcome::Allowed {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{} was never admitted ({outcome:?})",
                pod.name
            );
            let _ = self.agent.report_once().await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let mut st = self.agent.state();
        let now = st.now_ms();
        self.sim.step(&mut st, now);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "starts a browser: scripts/test runs it as its own step"]
async fn the_dashboard_shows_the_apis_numbers_in_a_real_browser() {
    let cl = kvota_testkit::Cluster::start(3).await;
    let leader = cl.leader(Duration::from_secs(20)).await;
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

    let tmp = tempfile::tempdir().expect("tmp");
    let hour = 3_600_000;
    let mut east = Member::start("east", &[8, 8], tmp.path(), &endpoints).await;
    let mut west = Member::start("west", &[4], tmp.path(), &endpoints).await;
    let mut north = Member::start("north", &[4], tmp.path(), &endpoints).await;
    east.run(SimPod::gpus("ml", "train-1", 4, hour, 0)).await;
    east.run(SimPod::gpus("serving", "serve-1", 2, hour, 0)).await;
    west.run(SimPod::gpus("serving", "serve-2", 1, hour, 0)).await;
    north.run(SimPod::gpus("lab", "explore-1", 1, hour, 0)).await;
    let _ = north.agent.report_once().await;

    // east and west keep reporting; north goes silent and falls back once its 6 s lease
    // has run out.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut reporters = Vec::new();
    for m in [east, west] {
        let stop = stop.clone();
        reporters.push(tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = m.agent.report_once().await;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }));
    }
    let follower = (1..=3).find(|id| *id != leader).expect("a follower");
    let http = cl.members[&follower].http_addr.clone();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let o = get_json(&http, "/api/v1/overview").await;
        let lease = |c: &str| {
            o["federation"]["clusters"]
                .as_array()
                .and_then(|a| a.iter().find(|x| x["cluster"] == c))
                .map(|x| x["lease"].clone())
        };
        let inuse = o["federation"]["inuse_gpus"].as_f64().unwrap_or(0.0);
        if lease("north") == Some(Value::from("fallback"))
            && lease("east") == Some(Value::from("fresh"))
            && close(inuse, 8.0)
        {
            assert_eq!(
                o["read"]["follows_leader"], true,
                "a follower's read follows the leader: {o}"
            );
            assert_eq!(o["node"]["node_id"], follower);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the federation never showed north on safe budgets and 8 GPUs in use: {o}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    // The page and its assets: embedded, typed, not cached, scripts only from the node.
    for (path, kind) in [
        ("/ui/", "text/html"),
        ("/ui/app.js", "text/javascript"),
        ("/ui/app.css", "text/css"),
    ] {
        let (code, head, body) = get(&http, path).await;
        assert_eq!(code, 200, "{path}");
        assert!(head.contains(&format!("content-type: {kind}")), "{path}: {head}");
        assert!(
            head.contains("content-security-policy: default-src 'none'; script-src 'self'"),
            "{path}: {head}"
        );
        assert!(
            head.contains("cache-control: no-store") && head.contains("x-content-type-options: nosniff"),
            "{path}: {head}"
        );
        // (SVG's namespace is a name, not something fetched.)
        let body = body.replace("http://www.w3.org/2000/svg", "");
        assert!(
            !body.contains("http://") && !body.contains("https://"),
            "{path} loads nothing from elsewhere"
        );
    }
    let (code, head, _) = get(&http, "/").await;
    assert!(
        code == 303 && head.contains("location: /ui/"),
        "/ sends the browser to the dashboard: {code} {head}"
    );
    let (code, _, body) = get(&http, "/api/v1/history?tenant=Not%20A%20Name").await;
    assert_eq!(code, 400, "{body}");

    // The browser.
    let profile = tmp.path().join("chromium");
    let url = format!("http://{http}/ui/");
    let dom = browse(&url, &["--dump-dom"], &profile);
    let api_tenants = get_json(&http, "/api/v1/tenants").await;
    let api_clusters = get_json(&http, "/api/v1/clusters").await;
    // A pod's decision, searched from the page (a link carries the search).
    let deadline = Instant::now() + Duration::from_secs(15);
    let decisions = loop {
        let v = get_json(&http, "/api/v1/decisions?pod=ml/train-1").await;
        if v["decisions"].as_array().is_some_and(|d| !d.is_empty()) {
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "the agent's decision never reached the control plane: {v}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(decisions["decisions"][0]["cluster"], "east", "{decisions}");
    let searched = browse(&format!("{url}#pod=ml/train-1&cluster=east"), &["--dump-dom"], &profile);
    let found = section(&searched, "pod-result", "</section>");
    assert!(
        found.contains("data-pod-cluster=\"east\"") && found.contains("data-verdict=\"allow\""),
        "{found}"
    );
    assert!(
        found.contains("pod ml/train-1 requests 4 GPUe"),
        "the explanation in sentences: {found}"
    );
    let (code, _, body) = get(&http, "/api/v1/decisions?pod=no-slash").await;
    assert_eq!(code, 400, "{body}");
    let shot = repo().join("target/dashboard.png");
    let _ = std::fs::remove_file(&shot);
    browse(&url, &[&format!("--screenshot={}", shot.display())], &profile);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for r in reporters {
        let _ = r.await;
    }

    assert!(
        dom.contains("data-loaded=\"true\""),
        "the page never loaded its data:\n{dom}"
    );
    assert!(
        !dom.contains("Could not read the federation"),
        "the page reported an error:\n{dom}"
    );
    assert!(dom.contains("follows leader"), "the freshness badge:\n{dom}");
    assert!(dom.contains("policy dashboard"), "the policy's name:\n{dom}");

    // Tenants: every row shows the API's numbers.
    let table = section(&dom, "tenants", "</table>");
    let tenants = api_tenants["tenants"].as_array().expect("tenants");
    assert_eq!(tenants.len(), 3);
    let mut total_inuse = 0u64;
    for t in tenants {
        let name = t["tenant"].as_str().expect("name");
        let r = row(table, &format!("data-tenant=\"{name}\"")).unwrap_or_else(|| panic!("no row for {name}:\n{table}"));
        let inuse = t["inuse_milli_gpue"].as_u64().expect("inuse");
        total_inuse += inuse;
        // In use is running plus admitted, each its own column.
        for (field, api) in [
            ("running_gpus", "running_milli_gpue"),
            ("admitted_gpus", "admitted_milli_gpue"),
            ("pending_gpus", "waiting_milli_gpue"),
        ] {
            let want = t[api].as_u64().expect(api);
            let (v, text) = cell(r, &format!("data-field=\"{field}\"")).unwrap_or_else(|| panic!("{name}: no {field}"));
            assert_eq!(text, shown(want), "{name} {field}: {r}");
            assert!(
                close(v.parse().expect("number"), want as f64 / 1000.0),
                "{name} {field}: {v}"
            );
        }
        assert_eq!(
            t["running_milli_gpue"].as_u64().unwrap_or(0) + t["admitted_milli_gpue"].as_u64().unwrap_or(0),
            inuse,
            "{name}: running + admitted = in use"
        );
        for (field, api) in [
            ("entitlement_gpus", "entitlement_milli_gpue"),
            ("target_gpus", "target_milli_gpue"),
        ] {
            let (v, text) = cell(r, &format!("data-field=\"{field}\"")).unwrap_or_else(|| panic!("{name}: no {field}"));
            let want = t[api].as_u64().expect(api) as f64 / 1000.0;
            let got: f64 = v.parse().expect("number");
            assert!(close(got, want), "{name} {field}: page {got}, API {want}");
            assert!(
                close(text.parse().expect("shown"), want),
                "{name} {field}: shows {text}, API {want}"
            );
        }
        let (w, _) = cell(r, "data-field=\"weight\"").expect("weight");
        assert!(
            close(
                w.parse().expect("weight"),
                t["weight_milli"].as_u64().expect("weight") as f64 / 1000.0
            ),
            "{name} weight {w}"
        );
    }
    assert_eq!(total_inuse, 8_000, "{api_tenants}");

    // The budget matrix: every cell is the cluster's newest lease's budget.
    let matrix = section(&dom, "matrix", "</table>");
    assert!(
        matrix.contains("north (safe budgets)"),
        "north stands out as on safe budgets:\n{matrix}"
    );
    let mut cells = 0;
    let api_cluster = |name: &str| {
        api_clusters
            .as_array()
            .and_then(|a| a.iter().find(|c| c["cluster"] == name))
            .cloned()
            .unwrap_or_else(|| panic!("no cluster {name}"))
    };
    for rec in api_clusters.as_array().expect("clusters") {
        let cluster = rec["cluster"].as_str().expect("name");
        for t in tenants {
            let name = t["tenant"].as_str().expect("name");
            let r =
                row(matrix, &format!("data-tenant=\"{name}\"")).unwrap_or_else(|| panic!("no matrix row for {name}"));
            let budget = rec["tenants"]
                .as_array()
                .and_then(|a| a.iter().find(|x| x["tenant"] == name))
                .map_or(0, |x| x["budget_milli_gpue"].as_u64().expect("budget"));
            let want = budget as f64 / 1000.0;
            let (v, text) =
                cell(r, &format!("data-cluster=\"{cluster}\"")).unwrap_or_else(|| panic!("no cell {name} x {cluster}"));
            assert!(
                close(v.parse().expect("budget"), want),
                "{name} in {cluster}: page {v}, API {want}"
            );
            assert!(
                close(text.parse().expect("shown"), want),
                "{name} in {cluster}: shows {text}"
            );
            cells += 1;
        }
    }
    assert_eq!(cells, 9, "3 tenants x 3 clusters");

    // Clusters: lease states.
    let clusters = section(&dom, "clusters", "</table>");
    for (c, state) in [("north", "fallback"), ("east", "fresh"), ("west", "fresh")] {
        let r = row(clusters, &format!("data-cluster=\"{c}\"")).unwrap_or_else(|| panic!("no row for {c}"));
        let (v, _) = cell(r, "data-field=\"lease\"").expect("lease");
        assert_eq!(v, state, "{c}: {r}");
        let (cap, _) = cell(r, "data-field=\"capacity_gpus\"").expect("capacity");
        let want = api_cluster(c)["capacity_milli_gpue"].as_u64().expect("capacity") as f64 / 1000.0;
        assert!(
            close(cap.parse().expect("capacity"), want),
            "{c} capacity {cap} vs {want}"
        );
    }
    assert!(
        section(&dom, "ov-fallback", "</div>").contains("on safe budgets: north"),
        "the overview names north"
    );

    // The chart: a line per series, ending at the federation's current numbers.
    let chart = section(&dom, "chart", "id=\"legend\"");
    assert!(chart.contains("<polyline"), "a drawn chart:\n{chart}");
    let legend = section(&dom, "legend", "</div>");
    let (v, text) = cell(legend, "data-series=\"inuse_gpus\"").expect("in use key");
    assert!(
        close(v.parse().expect("in use"), 8.0) && text.ends_with("8.00"),
        "chart's in use: {v} {text}"
    );
    let (v, _) = cell(legend, "data-series=\"capacity_gpus\"").expect("capacity key");
    assert!(close(v.parse().expect("capacity"), 24.0), "chart's capacity: {v}");

    // The audit timeline, in sentences.
    let audit = section(&dom, "audit", "</ol>");
    assert!(
        audit.contains("Policy dashboard came into force") && audit.contains("(3 tenants)."),
        "{audit}"
    );
    assert!(audit.contains("Cluster north joined with 4.00 GPUs."), "{audit}");

    let png = std::fs::read(&shot).expect("the screenshot was written");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 20_000,
        "a real screenshot ({} bytes)",
        png.len()
    );
    cl.shutdown().await;
}

/// The Kubernetes path of docs/operations.md ("The dashboard"), followed on this
/// machine: the dev overlay's certificates (`make-dev-certs`, on a copy of deploy/), a
/// node started with the TLS flags the rendered StatefulSet gives it (its gRPC port on
/// 127.0.0.1 stands in for `kubectl port-forward`), two member clusters (in-process
/// agents with cluster certificates on simulated clusters; no API server runs here),
/// then `kvota dashboard` with the viewer certificate `dev` through the same
/// environment variables every command reads, and headless Chromium on the URL it
/// prints. The page must show running, admitted and waiting GPUs as the API does, each
/// cluster's policy revision (edge behind, cut off), and the partition as an audit
/// event; at 820 px it fits the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "starts a browser: scripts/test runs it as its own step"]
async fn kvota_dashboard_with_a_viewer_certificate_on_the_kubernetes_path() {
    let started = Instant::now();
    let tmp = tempfile::tempdir().expect("tmp");
    let (certs, args) = dev_overlay(tmp.path());
    let fed = certs.join("federation");
    let ports = kvota_testkit::procs::free_ports(3);
    let grpc = format!("127.0.0.1:{}", ports[0]);
    let mut server = Command::new(env!("CARGO_BIN_EXE_kvota"));
    server
        .args(["server", "--id", "1", "--init", "--tick-ms", "200"])
        .args(["--listen", &grpc, "--http", &format!("127.0.0.1:{}", ports[1])])
        .args(["--raft-listen", &format!("127.0.0.1:{}", ports[2])])
        .arg("--data-dir")
        .arg(tmp.path().join("data"))
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(tmp.path().join("server.log")).expect("log"));
    // The StatefulSet's TLS flags, with the Secret's files.
    for (flag, file) in &args {
        server.arg(format!("{flag}={}", fed.join(file).display()));
    }
    let mut procs = kvota_testkit::procs::Procs::of([server.spawn().expect("spawn the node")]);
    let tls = |role: &str| {
        kvota_client::tls::GrpcTls::from_files(
            &fed.join("ca.crt"),
            &fed.join(format!("{role}.crt")),
            &fed.join(format!("{role}.key")),
        )
        .expect("certificate")
    };
    let operator = Client::with_tls(std::slice::from_ref(&grpc), Some(tls("operator-dev"))).expect("client");
    apply(&operator, KUBE_POLICY).await;
    let issued = Command::new(env!("CARGO_BIN_EXE_kvota"))
        .args(["certs", "issue", "--role", "cluster", "--name", "edge", "--dir"])
        .arg(&fed)
        .output()
        .expect("issue edge's certificate");
    assert!(issued.status.success(), "{}", String::from_utf8_lossy(&issued.stderr));

    // dev: a training pod running, an inference pod admitted that fits no node, a
    // training pod over its maxShare waiting. edge: a training pod running.
    let mut dev = TlsMember::start("dev", &[4, 4], tmp.path(), &grpc, tls("cluster-dev")).await;
    let mut edge = TlsMember::start("edge", &[4], tmp.path(), &grpc, tls("cluster-edge")).await;
    dev.run(SimPod::gpus("ml", "train-1", 4, 3_600_000, 0), true).await;
    dev.run(SimPod::gpus("serving", "big-1", 6, 3_600_000, 0), false).await;
    edge.run(SimPod::gpus("ml", "train-2", 1, 3_600_000, 0), true).await;
    let denied = {
        let mut st = dev.agent.state();
        dev.sim.submit(&mut st, &SimPod::gpus("ml", "train-3", 4, 3_600_000, 0))
    };
    assert_eq!(denied, Outcome::Denied, "training's third pod is over its maxShare");
    // A new revision; dev enforces it, edge goes silent (partitioned) on the old one.
    apply(&operator, &KUBE_POLICY.replace("weight: 10", "weight: 20")).await;
    let _ = edge.agent.report_once().await;
    dev.agent.fetch_policy().await.expect("dev fetches revision 2");
    let dev = std::sync::Arc::new(dev);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reporter = {
        let (dev, stop) = (dev.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = dev.agent.report_once().await;
                tokio::time::sleep(Duration::from_millis(400)).await;
            }
        })
    };

    // `kvota dashboard --open` with the viewer certificate, through the environment;
    // `$BROWSER` is a script that notes the URL it is given.
    let opened = tmp.path().join("opened");
    let browser = tmp.path().join("browser.sh");
    std::fs::write(&browser, format!("#!/bin/sh\necho \"$1\" > {}\n", opened.display())).expect("browser");
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&browser, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let mut proxy = std::process::Command::new(env!("CARGO_BIN_EXE_kvota"))
        .args(["dashboard", "--listen", "127.0.0.1:0", "--open"])
        .env("BROWSER", &browser)
        .env("KVOTA_CONTROL_PLANE", &grpc)
        .env("KVOTA_CP_CA", fed.join("ca.crt"))
        .env("KVOTA_CP_CERT", fed.join("viewer-dev.crt"))
        .env("KVOTA_CP_KEY", fed.join("viewer-dev.key"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(tmp.path().join("dashboard.log")).expect("log"))
        .spawn()
        .expect("spawn kvota dashboard");
    let url = {
        use std::io::BufRead as _;
        let out = proxy.stdout.take().expect("stdout");
        let mut line = String::new();
        std::io::BufReader::new(out).read_line(&mut line).expect("the URL line");
        line.trim()
            .strip_prefix("kvota dashboard: ")
            .unwrap_or_else(|| panic!("no URL: {line}"))
            .to_string()
    };
    procs.push(proxy);
    let base = url.trim_start_matches("http://").trim_end_matches("/ui/").to_string();
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::fs::read_to_string(&opened).map_or(true, |o| o.trim() != url) {
        assert!(Instant::now() < deadline, "--open did not hand {url} to $BROWSER");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Edge's lease (4 s) runs out: a partition, recorded as an audit event.
    let deadline = Instant::now() + Duration::from_secs(20);
    let o = loop {
        let o = get_json(&base, "/api/v1/overview").await;
        let edge_cut = o["federation"]["clusters"]
            .as_array()
            .and_then(|a| a.iter().find(|c| c["cluster"] == "edge"))
            .is_some_and(|c| c["lease"] == "fallback");
        let dev_rev = o["federation"]["clusters"]
            .as_array()
            .and_then(|a| a.iter().find(|c| c["cluster"] == "dev"))
            .and_then(|c| c["policy_revision"].as_u64());
        if edge_cut && dev_rev == Some(2) {
            break o;
        }
        assert!(
            Instant::now() < deadline,
            "edge never cut off or dev never on revision 2: {o}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    // The proxy answers loopback names only, and reads only.
    let (code, _, _) = get_host(&base, "/ui/", "evil.example").await;
    assert_eq!(code, 403, "another host name (DNS rebinding) is refused");

    let profile = tmp.path().join("chromium");
    let dom = browse(&url, &["--dump-dom"], &profile);
    let narrow = browse(&url, &["--dump-dom", "--window-size=820,2200"], &profile);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = reporter.await;
    assert!(
        dom.contains("data-loaded=\"true\"") && !dom.contains("Could not read the federation"),
        "{dom}"
    );

    // Running, admitted and waiting, as the API says.
    let f = &o["federation"];
    for (id, field) in [
        ("ov-running", "running_gpus"),
        ("ov-admitted", "admitted_gpus"),
        ("ov-waiting", "pending_gpus"),
    ] {
        let want = f[field].as_f64().expect(field);
        let (_, text) = cell(&dom, &format!("id=\"{id}\"")).unwrap_or_else(|| panic!("no #{id}"));
        assert!(
            close(text.parse().expect("number"), want),
            "{id}: page {text}, API {want}"
        );
    }
    assert!(
        close(f["running_gpus"].as_f64().unwrap_or(0.0), 5.0),
        "train-1 and train-2 run: {f}"
    );
    assert!(
        close(f["admitted_gpus"].as_f64().unwrap_or(0.0), 6.0),
        "big-1 is admitted, on no node: {f}"
    );
    assert!(
        f["pending_gpus"].as_f64().unwrap_or(0.0) >= 4.0 - 0.011,
        "train-3 waits: {f}"
    );
    let tenants = section(&dom, "tenants", "</table>");
    let serving = row(tenants, "data-tenant=\"inference\"").expect("inference row");
    assert_eq!(
        cell(serving, "data-field=\"admitted_gpus\"").map(|c| c.1),
        Some("6.00".into()),
        "{serving}"
    );
    assert_eq!(
        cell(serving, "data-field=\"running_gpus\"").map(|c| c.1),
        Some("0.00".into()),
        "{serving}"
    );
    // Each cluster's policy revision: dev on the one in force, edge behind (and cut off).
    let clusters = section(&dom, "clusters", "</table>");
    let dev_row = row(clusters, "data-cluster=\"dev\"").expect("dev row");
    assert_eq!(
        cell(dev_row, "data-field=\"policy_revision\"").map(|c| c.0),
        Some("2".into()),
        "{dev_row}"
    );
    let edge_row = row(clusters, "data-cluster=\"edge\"").expect("edge row");
    let (rev, text) = cell(edge_row, "data-field=\"policy_revision\"").expect("edge revision");
    assert!(rev == "1" && text.contains("behind"), "{edge_row}");
    assert!(
        dev_row.contains(env!("CARGO_PKG_VERSION")),
        "the agent's version: {dev_row}"
    );
    assert!(
        section(&dom, "policy", "</span>").contains("(revision 2)"),
        "the header names the revision"
    );
    // The partition, as an audit event.
    let audit = section(&dom, "audit", "</ol>");
    assert!(
        audit.contains("data-kind=\"LeaseExpired\"") && audit.contains("Cluster edge is cut off"),
        "{audit}"
    );
    assert!(
        section(&dom, "score-note", "</p>").contains("within 20 %"),
        "the score's definition"
    );
    // At 820 px the page fits the window.
    assert!(narrow.contains("data-overflow-x=\"false\""), "wider than 820 px");
    drop(procs);
    eprintln!("the Kubernetes path took {:.1} s", started.elapsed().as_secs_f64());
}

const KUBE_POLICY: &str = "
apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: monday}
spec:
  lease: {duration: 4s, clockSkewMargin: 400ms}
  tenants:
  - {name: training, weight: 40, minShare: 20, maxShare: 50, preemptible: true, namespaces: [ml]}
  - {name: inference, weight: 50, minShare: 40, maxShare: 80, namespaces: [serving]}
  - {name: research, weight: 10, minShare: 5, maxShare: 25, preemptible: true, namespaces: [lab]}
";

async fn apply(c: &Client, yaml: &str) {
    let y = yaml.to_string();
    c.call(|ch| {
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
}

/// docs/operations.md's first steps on a copy of deploy/: `make-dev-certs`, then the
/// overlay rendered (`kubectl kustomize`, what `kubectl apply -k` would create). Returns
/// the certificates' directory and the control plane's TLS flags as the StatefulSet
/// gives them, with the files node 1 mounts (`--tls-ca` and `ca.crt`, ...).
fn dev_overlay(dir: &Path) -> (PathBuf, Vec<(String, String)>) {
    let copy = dir.join("deploy");
    assert!(Command::new("cp")
        .arg("-r")
        .arg(repo().join("deploy"))
        .arg(&copy)
        .status()
        .expect("cp")
        .success());
    let dev = copy.join("kubernetes/overlays/dev");
    let out = Command::new("bash")
        .arg(dev.join("make-dev-certs"))
        .env("KVOTA", env!("CARGO_BIN_EXE_kvota"))
        .output()
        .expect("make-dev-certs");
    assert!(
        out.status.success(),
        "make-dev-certs: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rendered = Command::new("kubectl")
        .arg("kustomize")
        .arg(&dev)
        .output()
        .expect("kubectl kustomize (kubectl is the machine's)");
    assert!(
        rendered.status.success(),
        "{}",
        String::from_utf8_lossy(&rendered.stderr)
    );
    let text = String::from_utf8(rendered.stdout).expect("utf8");
    let mut args = Vec::new();
    for doc in text.split("\n---\n") {
        let v: serde_yaml_ng::Value = serde_yaml_ng::from_str(doc).expect("a rendered object");
        if v["kind"] != "StatefulSet" || v["metadata"]["name"] != "kvota-server" {
            continue;
        }
        for a in v["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_sequence()
            .expect("args")
        {
            let a = a.as_str().expect("an argument");
            if let Some((flag, path)) = a.split_once('=').filter(|(f, _)| f.starts_with("--tls-")) {
                let file = path
                    .rsplit('/')
                    .next()
                    .expect("a file")
                    .replace("$(KVOTA_NODE_ID)", "1");
                args.push((flag.to_string(), file));
            }
        }
    }
    assert_eq!(
        args.len(),
        3,
        "the StatefulSet's --tls-ca, --tls-cert and --tls-key: {args:?}"
    );
    (dev.join("certs"), args)
}

/// A GET naming `host` in the Host header: status, head, body.
async fn get_host(addr: &str, path: &str, host: &str) -> (u16, String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or_default();
    (code, head.to_string(), body.to_string())
}

/// A member over mutual TLS: an agent with its cluster certificate on a simulated
/// cluster.
struct TlsMember {
    agent: Agent,
    sim: SimCluster,
}

impl TlsMember {
    async fn start(name: &str, nodes: &[u32], dir: &Path, grpc: &str, tls: kvota_client::tls::GrpcTls) -> TlsMember {
        let total: u64 = nodes.iter().map(|g| u64::from(*g) * 1000).sum();
        let agent = Agent::open_with_tls(
            &kvota_fairness::names::ClusterName::parse(name).expect("name"),
            [("nvidia.com/gpu".to_string(), total)].into(),
            &dir.join(name),
            &[grpc.to_string()],
            Some(tls),
        )
        .expect("agent");
        agent.register().await.expect("register");
        agent.fetch_policy().await.expect("policy");
        TlsMember {
            agent,
            sim: SimCluster::new(nodes),
        }
    }

    /// Submits `pod` until admitted (reports raise budgets), then binds what fits
    /// (`bind`), or leaves it admitted and not yet on a node.
    async fn run(&mut self, pod: SimPod, bind: bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let outcome = {
                let mut st = self.agent.state();
                self.sim.submit(&mut st, &pod)
            };
            if outcome == Outcome::Allowed {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{} was never admitted ({outcome:?})",
                pod.name
            );
            let _ = self.agent.report_once().await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if bind {
            let mut st = self.agent.state();
            let now = st.now_ms();
            self.sim.step(&mut st, now);
        }
        let _ = self.agent.report_once().await;
    }
}
