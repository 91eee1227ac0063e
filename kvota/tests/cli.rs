//! The `kvota` binary as a user runs it: exit codes, messages, and what it prints.

use std::process::Command;

fn kvota(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvota"))
        .args(args)
        .output()
        .expect("run kvota");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn repo(path: &str) -> String {
    format!("{}/../{path}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn validate_accepts_the_article_policy() {
    let (code, out, _) = kvota(&["policy", "validate", &repo("deploy/policies/article.yaml")]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("valid policy `myfair-cluster` with 3 tenants"), "{out}");
}

#[test]
fn validate_lists_every_problem_and_exits_2() {
    let dir = std::env::temp_dir().join(format!("kvota-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let f = dir.join("bad.yaml");
    std::fs::write(
        &f,
        "apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: x}\nspec:\n  tenants:\n  - {name: a, weight: 0}\n  - {name: b, minShare: 90, maxShare: 10}\n",
    )
    .expect("write");
    let (code, _, err) = kvota(&["policy", "validate", f.to_str().expect("utf8")]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("spec.tenants[0].weight") && err.contains("spec.tenants[1].minShare"),
        "{err}"
    );
    assert!(err.contains("2 problems"), "{err}");
    let (code, out, _) = kvota(&["policy", "validate", "--json", f.to_str().expect("utf8")]);
    assert_eq!(code, 2);
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v.as_array().map(Vec::len), Some(2));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn missing_file_is_a_one_line_error() {
    let (code, _, err) = kvota(&["policy", "validate", "/nonexistent/policy.yaml"]);
    assert_eq!(code, 1);
    assert!(err.contains("read policy file /nonexistent/policy.yaml"), "{err}");
}

#[test]
fn whatif_prints_entitlements_and_budgets() {
    let (code, out, err) = kvota(&[
        "whatif",
        "--cluster",
        "c1=32",
        "--cluster",
        "c2=32",
        "--cluster",
        "c3=32",
        "--pending",
        "training@c1=64",
        "--pending",
        "training@c2=64",
        "--pending",
        "training@c3=64",
        "--inuse",
        "inference@c1=20",
        "--pending",
        "inference@c2=10",
        "--inuse",
        "research@c3=4",
        "--explain",
        "training",
    ]);
    assert_eq!(code, 0, "{err}");
    let row = out.lines().find(|l| l.starts_with("training")).expect("training row");
    let cols: Vec<&str> = row.split_whitespace().collect();
    // TENANT IN-USE DEMAND GUARANTEE CAP ENTITLED c1 c2 c3
    assert_eq!(
        cols,
        ["training", "0", "192", "19.2", "57.6", "57.6", "19.2", "19.2", "19.2"],
        "{out}"
    );
    assert!(out.contains("guarantee 19.2 + surplus 38.4 = 57.6"), "{out}");
}

#[test]
fn whatif_rejects_unknown_names_clearly() {
    let (code, _, err) = kvota(&["whatif", "--cluster", "c1=8", "--pending", "nobody@c1=1"]);
    assert_eq!(code, 1);
    assert!(err.contains("the policy has no tenant `nobody`"), "{err}");
    let (code, _, err) = kvota(&["whatif", "--cluster", "c1=eight"]);
    assert_eq!(code, 1);
    assert!(err.contains("not a GPU count"), "{err}");
}

#[test]
fn demo_help_names_the_knobs_a_newcomer_needs() {
    let (code, out, err) = kvota(&["demo", "--help"]);
    assert_eq!(code, 0, "{err}");
    for flag in ["--speed", "--seed", "--json", "--policy", "--data-dir"] {
        assert!(
            out.contains(flag),
            "`kvota demo --help` does not mention {flag}:\n{out}"
        );
    }
}

#[test]
fn operator_commands_explain_an_unreachable_control_plane() {
    let start = std::time::Instant::now();
    let (code, _, err) = kvota(&["status", "--cp", "127.0.0.1:1"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("control plane at 127.0.0.1:1 is unavailable"), "{err}");
    assert!(err.contains("is `kvota server` running there?"), "{err}");
    assert!(
        start.elapsed() < std::time::Duration::from_secs(30),
        "gave up only after {:?}",
        start.elapsed()
    );
}

#[test]
fn server_refuses_a_port_in_use_with_a_hint() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = busy.local_addr().expect("addr").to_string();
    let dir = tempfile::tempdir().expect("tmp");
    let (code, _, err) = kvota(&[
        "server",
        "--id",
        "1",
        "--listen",
        &addr,
        "--http",
        "127.0.0.1:0",
        "--raft-listen",
        "127.0.0.1:0",
        "--data-dir",
        dir.path().to_str().expect("utf8"),
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!("listen for gRPC on {addr}")) && err.contains("pick another --listen"),
        "{err}"
    );
}

/// `kvota server` needs `--id` (a default made every node without one node 1), and a
/// data directory started by one node refuses to start under another id, saying which.
#[test]
fn a_server_needs_its_id_and_keeps_its_data_directory() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().expect("tmp");
    let data = dir.path().to_str().expect("utf8");
    let out = Command::new(env!("CARGO_BIN_EXE_kvota"))
        .args([
            "server",
            "--data-dir",
            data,
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--raft-listen",
            "127.0.0.1:0",
        ])
        .env_remove("KVOTA_NODE_ID")
        .output()
        .expect("run kvota");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--id"), "{err}");
    assert!(!dir.path().join("raft").exists(), "nothing written without an id");

    // Node 1 takes the directory; once it serves, stop it.
    let mut node1 = Command::new(env!("CARGO_BIN_EXE_kvota"))
        .args([
            "server",
            "--id",
            "1",
            "--init",
            "--data-dir",
            data,
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--raft-listen",
            "127.0.0.1:0",
        ])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start node 1");
    let stderr = node1.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let serving = BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .any(|l| l.contains("node 1 serving"));
        let _ = tx.send(serving);
    });
    // Bounded: a node that never serves fails the test instead of hanging it.
    let serving = rx.recv_timeout(std::time::Duration::from_secs(60)).unwrap_or(false);
    let _ = node1.kill();
    let _ = node1.wait();
    assert!(serving, "node 1 never said it was serving");

    let (code, _, err) = kvota(&[
        "server",
        "--id",
        "2",
        "--data-dir",
        data,
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
        "--raft-listen",
        "127.0.0.1:0",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("belongs to node 1, not node 2"), "{err}");
    assert!(err.contains(data), "the message names the directory: {err}");
}

/// `kvota certs` makes a CA and certificates; `kvota server --tls-*` serves over mutual
/// TLS with them: the operator's CLI gets in and may change the policy, a viewer's may
/// read but not change it, the plain CLI gets nothing; half the flags is an error
/// naming the missing ones; a second `certs init` refuses to replace the CA.
#[test]
fn a_server_with_mutual_tls_answers_each_certificate_as_its_role() {
    let dir = tempfile::tempdir().expect("tmp");
    let certs = dir.path().join("certs");
    let certs_s = certs.to_str().expect("utf8");
    let (code, out, err) = kvota(&["certs", "init", "--dir", certs_s, "--trust-domain", "cli.test"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("trust domain `cli.test`"), "{out}");
    for (role, name) in [("node", "1"), ("operator", "alice"), ("viewer", "bob")] {
        let (code, out, err) = kvota(&["certs", "issue", "--dir", certs_s, "--role", role, "--name", name]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains(&format!("spiffe://cli.test/{role}/{name}")), "{out}");
    }
    let (code, _, err) = kvota(&["certs", "init", "--dir", certs_s]);
    assert_eq!(code, 1);
    assert!(err.contains("already holds a CA"), "{err}");
    let (code, _, err) = kvota(&[
        "certs",
        "issue",
        "--dir",
        certs_s,
        "--role",
        "cluster",
        "--name",
        "Not_A_Cluster",
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("cluster name `Not_A_Cluster`"), "{err}");
    let (code, out, _) = kvota(&["certs", "show", &format!("{certs_s}/viewer-bob.crt")]);
    assert_eq!(code, 0);
    assert!(
        out.contains("identity:  spiffe://cli.test/viewer/bob") && out.contains("days left"),
        "{out}"
    );
    let p = |f: &str| certs.join(f).to_str().expect("utf8").to_string();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let listen = format!("127.0.0.1:{port}");
    let data = dir.path().join("data").to_str().expect("utf8").to_string();

    let (code, _, err) = kvota(&[
        "server",
        "--id",
        "1",
        "--data-dir",
        &data,
        "--listen",
        &listen,
        "--http",
        "127.0.0.1:0",
        "--raft-listen",
        "127.0.0.1:0",
        "--tls-ca",
        &p("ca.crt"),
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("missing: --tls-cert, --tls-key"), "{err}");
    assert!(!dir.path().join("data").exists(), "nothing written");

    let mut server = Command::new(env!("CARGO_BIN_EXE_kvota"))
        .args([
            "server",
            "--id",
            "1",
            "--init",
            "--data-dir",
            &data,
            "--listen",
            &listen,
            "--http",
            "127.0.0.1:0",
            "--raft-listen",
            "127.0.0.1:0",
        ])
        .args([
            "--tls-ca",
            &p("ca.crt"),
            "--tls-cert",
            &p("node-1.crt"),
            "--tls-key",
            &p("node-1.key"),
        ])
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start the server");
    let with_cert = [
        "--cp",
        listen.as_str(),
        "--cp-ca",
        &p("ca.crt"),
        "--cp-cert",
        &p("operator-alice.crt"),
        "--cp-key",
        &p("operator-alice.key"),
    ];
    let viewer = [
        "--cp",
        listen.as_str(),
        "--cp-ca",
        &p("ca.crt"),
        "--cp-cert",
        &p("viewer-bob.crt"),
        "--cp-key",
        &p("viewer-bob.key"),
    ];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut last = String::new();
    let served = loop {
        let mut args = vec!["status"];
        args.extend(with_cert);
        let (code, out, err) = kvota(&args);
        if code == 0 && out.contains("leader") {
            break true;
        }
        last = format!("{code}: {out}{err}");
        if std::time::Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let policy = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/policies/article.yaml");
    let mut args = vec!["policy", "apply", policy];
    args.extend(viewer);
    let (viewer_apply, _, viewer_apply_err) = kvota(&args);
    let mut args = vec!["tenants"];
    args.extend(viewer);
    let (viewer_read, _, viewer_read_err) = kvota(&args);
    let mut args = vec!["policy", "apply", policy];
    args.extend(with_cert);
    let (operator_apply, _, operator_apply_err) = kvota(&args);
    let (plain_code, _, plain_err) = kvota(&["status", "--cp", &listen]);
    let (half_code, _, half_err) = kvota(&["status", "--cp", &listen, "--cp-ca", &p("ca.crt")]);
    let _ = server.kill();
    let _ = server.wait();
    assert!(served, "the CLI with a certificate never got a status: {last}");
    assert_ne!(viewer_apply, 0, "a viewer applied a policy");
    assert!(
        viewer_apply_err.contains("spiffe://cli.test/viewer/bob may not call admin.ApplyPolicy"),
        "{viewer_apply_err}"
    );
    assert_eq!(viewer_read, 0, "{viewer_read_err}");
    assert_eq!(operator_apply, 0, "{operator_apply_err}");
    assert_ne!(plain_code, 0, "plain text got an answer");
    assert!(plain_err.contains("unavailable"), "{plain_err}");
    assert_ne!(half_code, 0);
    assert!(half_err.contains("missing: --cp-cert, --cp-key"), "{half_err}");
}

/// `kvota completions SHELL` prints a script the shell accepts: bash loads it and then
/// completes `kvota mem` to `members` and `kvota members l` to `list`; the other shells
/// get a script that names the subcommands; an unknown shell is a usage error.
#[test]
fn completions_load_in_bash_and_complete_subcommands() {
    let (code, script, err) = kvota(&["completions", "bash"]);
    assert_eq!(code, 0, "{err}");
    let dir = std::env::temp_dir().join(format!("kvota-completions-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let file = dir.join("kvota.bash");
    std::fs::write(&file, &script).expect("write");
    // What bash's programmable completion does on TAB: call the function `complete -p`
    // names, with the words typed so far.
    let complete = |words: &str, cword: usize| {
        let probe = format!(
            "source {}; f=$(complete -p kvota | sed -E 's/.*-F ([^ ]+).*/\\1/'); COMP_WORDS=({words}); COMP_CWORD={cword}; COMP_LINE='{words}'; COMP_POINT=${{#COMP_LINE}}; $f kvota \"${{COMP_WORDS[$COMP_CWORD]}}\" \"${{COMP_WORDS[$COMP_CWORD-1]}}\"; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
            file.display()
        );
        let out = Command::new("bash")
            .args(["--norc", "-c", &probe])
            .output()
            .expect("run bash");
        assert!(out.status.success(), "bash: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(complete("kvota mem", 1), ["members"]);
    let sub = complete("kvota members l", 2);
    assert!(sub.contains(&"list".to_string()), "{sub:?}");
    for shell in ["zsh", "fish"] {
        let (code, script, err) = kvota(&["completions", shell]);
        assert_eq!(code, 0, "{err}");
        assert!(
            script.contains("members") && script.contains("add-learner"),
            "{shell}: {script}"
        );
    }
    let (code, _, err) = kvota(&["completions", "tcsh"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("invalid value 'tcsh'"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kvota policy diff FILE` against a real control plane (one node in this process, real
/// gRPC; the CLI as a process): it lists the fields that change, and its "after"
/// entitlements are what the control plane computes once the file is applied; its "now"
/// ones are what it computes before. Applying is the oracle, not a number written here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_diff_predicts_what_applying_the_file_gives() {
    use kvota_client::client::Client;
    use kvota_proto::v1;
    use std::collections::BTreeMap;

    let cl = kvota_testkit::Cluster::start(1).await;
    cl.leader(std::time::Duration::from_secs(15)).await;
    let cp = cl.endpoints()[0].clone();
    let c = Client::new(&cl.endpoints()).expect("client");
    let (code, _, err) = tokio::task::spawn_blocking({
        let cp = cp.clone();
        move || kvota(&["policy", "apply", &repo("deploy/policies/article.yaml"), "--cp", &cp])
    })
    .await
    .expect("join");
    assert_eq!(code, 0, "{err}");
    let reg = v1::RegisterRequest {
        cluster: "east".into(),
        capacity: vec![v1::Resource {
            name: "nvidia.com/gpu".into(),
            quantity_milli: 32_000,
        }],
        labels: Default::default(),
    };
    let epoch = c
        .call(|ch| {
            let reg = reg.clone();
            async move { Ok(Client::member(ch).register(reg).await?.into_inner()) }
        })
        .await
        .expect("register")
        .lease
        .expect("lease")
        .epoch;
    let usage = |t: &str, inuse: u64, pending: u64, used: u64| v1::TenantUsage {
        tenant: t.into(),
        used_milli_gpue_ms: used,
        inuse_milli_gpue: inuse,
        pending_milli_gpue: pending,
        largest_pending_milli_gpue: 0,
        borrowed_milli_gpue: 0,
    };
    let report = v1::ReportRequest {
        cluster: "east".into(),
        seq: 1,
        held_epoch: epoch,
        tenants: vec![
            usage("training", 8_000, 20_000, 3_600_000_000),
            usage("inference", 6_000, 4_000, 900_000_000),
            usage("research", 0, 6_000, 0),
        ],
        capacity: vec![],
        evictions: vec![],
        decisions: vec![],
        window_start_ms: 0,
        window_end_ms: 0,
        gap_in_reply: false,
        status: None,
    };
    c.call(|ch| {
        let r = report.clone();
        async move { Ok(Client::member(ch).report(r).await?.into_inner()) }
    })
    .await
    .expect("report");
    let live = || async {
        let r = c
            .call(|ch| async move { Ok(Client::admin(ch).list_tenants(v1::Empty {}).await?.into_inner()) })
            .await
            .expect("tenants");
        r.tenants
            .into_iter()
            .map(|t| (t.tenant, t.target_milli_gpue))
            .collect::<BTreeMap<String, u64>>()
    };
    let before = live().await;

    // Training's guarantee from 20 % to 50 %, research's cap from 25 % to 10 %.
    let text = std::fs::read_to_string(repo("deploy/policies/article.yaml"))
        .expect("read")
        .replace("    minShare: 20\n", "    minShare: 50\n")
        .replace("    maxShare: 25\n", "    maxShare: 10\n");
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("new.yaml");
    std::fs::write(&file, text).expect("write");
    let file = file.display().to_string();
    let (code, out, err) = tokio::task::spawn_blocking({
        let (cp, file) = (cp.clone(), file.clone());
        move || kvota(&["policy", "diff", &file, "--json", "--cp", &cp])
    })
    .await
    .expect("join");
    assert_eq!(code, 0, "{err}");
    let d: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let changes: Vec<&str> = d["changes"]
        .as_array()
        .expect("changes")
        .iter()
        .filter_map(|c| c.as_str())
        .collect();
    assert_eq!(
        changes,
        [
            "spec.tenants[research].maxShare: 25 -> 10",
            "spec.tenants[training].minShare: 20 -> 50"
        ],
        "{out}"
    );
    let predicted = |key: &str| -> BTreeMap<String, u64> {
        d["entitlements"]
            .as_array()
            .expect("rows")
            .iter()
            .map(|r| {
                (
                    r["tenant"].as_str().expect("tenant").to_string(),
                    r[key].as_u64().expect("target"),
                )
            })
            .collect()
    };
    let (now, after) = (predicted("target_milli_gpue_now"), predicted("target_milli_gpue_after"));
    // The ledger decays between the readings (24 h half-life, milliseconds apart): equal
    // within 0.1 GPUe.
    let close = |a: &BTreeMap<String, u64>, b: &BTreeMap<String, u64>| {
        a.len() == b.len() && a.iter().all(|(k, v)| b.get(k).is_some_and(|w| v.abs_diff(*w) <= 100))
    };
    assert!(close(&now, &before), "now {now:?} vs the control plane's {before:?}");
    assert!(
        after["training"] > now["training"] && after["research"] <= 3_200,
        "{after:?}"
    );

    // The table form says the same in words.
    let (code, table, err) = tokio::task::spawn_blocking({
        let (cp, file) = (cp.clone(), file.clone());
        move || kvota(&["policy", "diff", &file, "--cp", &cp])
    })
    .await
    .expect("join");
    assert_eq!(code, 0, "{err}");
    assert!(
        table.contains("spec.tenants[training].minShare: 20 -> 50") && table.contains("TENANT"),
        "{table}"
    );

    // Apply it: the control plane's targets are the predicted ones.
    let (code, _, err) = tokio::task::spawn_blocking({
        let (cp, file) = (cp.clone(), file.clone());
        move || kvota(&["policy", "apply", &file, "--cp", &cp])
    })
    .await
    .expect("join");
    assert_eq!(code, 0, "{err}");
    let applied = live().await;
    assert!(close(&after, &applied), "predicted {after:?}, applied {applied:?}");

    // An invalid file: exit 2 with the problems, nothing read from the control plane.
    std::fs::write(
        dir.path().join("bad.yaml"),
        "apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: x}\nspec: {tenants: []}\n",
    )
    .expect("write");
    let bad = dir.path().join("bad.yaml").display().to_string();
    let (code, _, err) = tokio::task::spawn_blocking(move || kvota(&["policy", "diff", &bad, "--cp", "127.0.0.1:1"]))
        .await
        .expect("join");
    assert_eq!(code, 2, "{err}");
    cl.shutdown().await;
}

/// Showback against a real 3-node control plane (nodes in this process): two clusters
/// report known GPU time over windows that cross an hour boundary; `kvota usage` prints
/// exactly those amounts by tenant and cluster (the totals are what the ledger was
/// given), its JSON is the HTTP API's `/api/v1/usage` answer byte for byte, and the CSV
/// and table forms carry the same numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_shows_what_the_clusters_reported_in_every_form() {
    use kvota_client::client::Client;
    use std::time::Duration;

    let cl = kvota_testkit::Cluster::start(3).await;
    let leader = cl.leader(Duration::from_secs(20)).await;
    let cp = cl.members[&leader].rpc_addr.clone();
    let http = cl.members[&leader].http_addr.clone();
    let c = Client::new(&cl.endpoints()).expect("client");
    // Showback is kept from feature level 2, which the leader raises once every voter
    // has said it supports it.
    cl.feature_level(
        kvota_control_plane::feature::FeatureLevel::RECORDS,
        Duration::from_secs(20),
    )
    .await;
    let (code, _, err) = tokio::task::spawn_blocking({
        let cp = cp.clone();
        move || kvota(&["policy", "apply", &repo("deploy/policies/article.yaml"), "--cp", &cp])
    })
    .await
    .expect("join");
    assert_eq!(code, 0, "{err}");

    let now = u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis(),
    )
    .expect("ms");
    const GPU_HOUR: u64 = 3_600_000_000;
    // (cluster, [(tenant, used)], window): east reports 1 GPU-hour of training and a
    // quarter of inference over the last 90 to 30 minutes; west 2 GPU-hours of training
    // in two reports.
    let east = kvota_testkit::register_gpus(&c, "east", 8_000).await;
    let west = kvota_testkit::register_gpus(&c, "west", 8_000).await;
    kvota_testkit::report_usage(
        &c,
        "east",
        1,
        east,
        &[("training", GPU_HOUR, 0, 0), ("inference", GPU_HOUR / 4, 0, 0)],
        (now - 90 * 60_000, now - 30 * 60_000),
    )
    .await;
    kvota_testkit::report_usage(
        &c,
        "west",
        1,
        west,
        &[("training", GPU_HOUR, 0, 0)],
        (now - 100 * 60_000, now - 40 * 60_000),
    )
    .await;
    kvota_testkit::report_usage(
        &c,
        "west",
        2,
        west,
        &[("training", GPU_HOUR, 0, 0)],
        (now - 40 * 60_000, now - 10 * 60_000),
    )
    .await;

    let run = |args: Vec<String>| {
        let cp = cp.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
                all.extend(["--cp", &cp]);
                kvota(&all)
            })
            .await
            .expect("join")
        }
    };
    let (code, out, err) = run(["usage", "--since", "3h", "--by", "tenant,cluster", "-o", "json"]
        .map(String::from)
        .to_vec())
    .await;
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(v["kept"], true, "{out}");
    let rows: Vec<(String, String, u64)> = v["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| {
            (
                r["tenant"].as_str().expect("tenant").into(),
                r["cluster"].as_str().expect("cluster").into(),
                r["milli_gpue_ms"].as_u64().expect("amount"),
            )
        })
        .collect();
    let want = vec![
        ("inference".to_string(), "east".to_string(), GPU_HOUR / 4),
        ("training".to_string(), "east".to_string(), GPU_HOUR),
        ("training".to_string(), "west".to_string(), 2 * GPU_HOUR),
    ];
    assert_eq!(rows, want, "{out}");
    let total = v["total_gpu_hours"].as_f64().expect("total");
    assert!((total - 3.25).abs() < 3.25e-3, "total {total} GPU-hours, reported 3.25");

    // The ledger was given the same amounts: its decayed usage (24 h half-life, counted
    // minutes ago) is at most that and within the decay of a few minutes of it.
    let st = cl.node(leader).ctx.state.read().await;
    let decayed: u64 = st
        .federation
        .ledger()
        .entries()
        .values()
        .map(|u| u.value_milli_gpue_ms)
        .sum();
    drop(st);
    let given = 13 * GPU_HOUR / 4;
    assert!(
        decayed <= given && decayed as f64 >= given as f64 * 0.999,
        "ledger {decayed}, reported {given}"
    );

    // The HTTP API answers the same period with the same JSON.
    let url = format!(
        "/api/v1/usage?since_ms={}&until_ms={}&by=tenant,cluster",
        v["since_ms"], v["until_ms"]
    );
    let (code, body) = kvota_testkit::http_get(&kvota_tls::connect::Connector::new(None), &http, &url)
        .await
        .expect("http");
    assert_eq!(code, 200, "{body}");
    let h: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(h, v, "CLI and HTTP differ");
    let (code, body) = kvota_testkit::http_get(
        &kvota_tls::connect::Connector::new(None),
        &http,
        "/api/v1/usage?by=team",
    )
    .await
    .expect("http");
    assert!(code == 400 && body.contains("team"), "{code} {body}");

    // By tenant, as CSV and as a table.
    let (code, csv, err) = run(["usage", "--since", "3h", "-o", "csv"].map(String::from).to_vec()).await;
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines[0], "tenant,cluster,gpu_hours,since,until");
    assert!(
        lines[1].starts_with("inference,*,0.250000,") && lines[2].starts_with("training,*,3.000000,"),
        "{csv}"
    );
    let (code, table, err) = run(["usage", "--since", "3h", "--by", "cluster"].map(String::from).to_vec()).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        table.contains("east") && table.contains("1.250") && table.contains("west") && table.contains("2.000"),
        "{table}"
    );
    assert!(
        table
            .lines()
            .last()
            .is_some_and(|l| l.starts_with("TOTAL") && l.ends_with("3.250")),
        "{table}"
    );
    // A period that ends before it starts is refused before anything is asked.
    let (code, _, err) = run(["usage", "--since", "1h", "--until", "2h"].map(String::from).to_vec()).await;
    assert!(code != 0 && err.contains("must be before"), "{err}");
    cl.shutdown().await;
}

/// One schema: every read command's `-o json` is what the HTTP API answers for the same
/// object (status, tenants, clusters, audit, a tenant's explanation, members), and `-o
/// yaml` is the same document; against a real 3-node control plane (nodes in this
/// process) with two registered clusters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_commands_print_the_http_apis_json_and_yaml() {
    use kvota_client::client::Client;
    use serde_json::Value;
    use std::time::Duration;

    let cl = kvota_testkit::Cluster::start(3).await;
    let leader = cl.leader(Duration::from_secs(20)).await;
    // As `kvota server` does before it reports ready: the group runs at the newest
    // level before a policy is applied (the article's policy needs level 3 or more).
    cl.feature_level(
        kvota_control_plane::feature::FeatureLevel::NEWEST,
        Duration::from_secs(20),
    )
    .await;
    let cp = cl.members[&leader].rpc_addr.clone();
    let http = cl.members[&leader].http_addr.clone();
    let c = Client::new(&cl.endpoints()).expect("client");
    let (code, _, err) = tokio::task::spawn_blocking({
        let cp = cp.clone();
        move || kvota(&["policy", "apply", &repo("deploy/policies/article.yaml"), "--cp", &cp])
    })
    .await
    .expect("join");
    assert_eq!(code, 0, "{err}");
    for (name, gpus) in [("east", 16_000), ("west", 8_000)] {
        kvota_testkit::register_gpus(&c, name, gpus).await;
    }
    let run = |args: Vec<&'static str>| {
        let cp = cp.clone();
        async move {
            let (code, out, err) = tokio::task::spawn_blocking(move || {
                let mut all = args.clone();
                all.extend(["--cp", &cp]);
                kvota(&all)
            })
            .await
            .expect("join");
            assert_eq!(code, 0, "{err}");
            out
        }
    };
    let connector = kvota_tls::connect::Connector::new(None);
    let api = |path: &'static str| {
        let (http, connector) = (http.clone(), connector.clone());
        async move {
            let (code, body) = kvota_testkit::http_get(&connector, &http, path).await.expect("http");
            assert_eq!(code, 200, "{path}: {body}");
            serde_json::from_str::<Value>(&body).unwrap_or_else(|e| panic!("{path}: {e}"))
        }
    };
    // Nothing reports usage, so these stay put between the two reads.
    for (args, path) in [
        (vec!["tenants"], "/api/v1/tenants"),
        (vec!["clusters"], "/api/v1/clusters"),
        (vec!["audit", "--limit", "0"], "/api/v1/audit"),
        (
            vec!["explain", "tenant", "training"],
            "/api/v1/explain/tenant?tenant=training",
        ),
    ] {
        let mut json_args = args.clone();
        json_args.extend(["-o", "json"]);
        let cli: Value = serde_json::from_str(&run(json_args).await).expect("CLI JSON");
        assert_eq!(
            cli,
            api(path).await,
            "kvota {} -o json differs from {path}",
            args.join(" ")
        );
        let mut yaml_args = args.clone();
        yaml_args.extend(["-o", "yaml"]);
        let yaml: Value = serde_yaml_ng::from_str(&run(yaml_args).await).expect("CLI YAML");
        assert_eq!(yaml, cli, "kvota {} -o yaml is not the JSON document", args.join(" "));
    }
    let tenants: Value = serde_json::from_str(&run(vec!["tenants", "-o", "json"]).await).expect("json");
    assert_eq!(tenants["tenants"].as_array().map(Vec::len), Some(3), "{tenants}");
    let clusters: Value = serde_json::from_str(&run(vec!["clusters", "--json"]).await).expect("--json still works");
    assert_eq!(clusters[0]["labels"]["zone"], "east", "{clusters}");

    // Status: the same node, the same document (its log moves with every tick, so only
    // what stands still is compared whole).
    let st: Value = serde_json::from_str(&run(vec!["status", "-o", "json"]).await).expect("status");
    let sa = api("/api/v1/status").await;
    let keys = |v: &Value| v.as_object().map(|o| o.keys().cloned().collect::<Vec<_>>());
    assert_eq!(keys(&st), keys(&sa), "status: the same fields");
    for f in [
        "node_id",
        "role",
        "leader_id",
        "leader_rpc_addr",
        "leader_http_addr",
        "policy",
        "clusters",
        "feature_level",
        "members",
    ] {
        assert_eq!(st[f], sa[f], "status.{f}");
    }
    assert_eq!(st["members"].as_array().map(Vec::len), Some(3));
    let members: Value = serde_json::from_str(&run(vec!["members", "list", "-o", "json"]).await).expect("members");
    assert_eq!(members, sa["members"], "members list is status's members");

    // The policy in force round-trips through `policy apply`, as YAML and as JSON, and
    // the control plane holds the same policy after each.
    let before = run(vec!["policy", "get", "-o", "yaml"]).await;
    for form in ["yaml", "json"] {
        let text = run(vec!["policy", "get", "-o", form]).await;
        let file = std::env::temp_dir().join(format!("kvota-roundtrip-{}.{form}", std::process::id()));
        std::fs::write(&file, &text).expect("write");
        let (code, _, err) = tokio::task::spawn_blocking({
            let (cp, file) = (cp.clone(), file.display().to_string());
            move || kvota(&["policy", "apply", &file, "--cp", &cp])
        })
        .await
        .expect("join");
        let _ = std::fs::remove_file(&file);
        assert_eq!(code, 0, "policy get -o {form} | policy apply: {err}");
        assert_eq!(
            run(vec!["policy", "get"]).await,
            before,
            "the policy after applying its {form} form"
        );
    }

    // The tables are for people: words, not JSON.
    let audit = run(vec!["audit"]).await;
    assert!(
        audit.contains("policy myfair-cluster came into force as revision 1 (3 tenants)")
            && audit.contains("policy myfair-cluster applied again unchanged; revision 1 stays in force (3 tenants)")
            && audit.contains("cluster west joined with 8 GPUe"),
        "{audit}"
    );
    let (code, _, err) = tokio::task::spawn_blocking({
        let cp = cp.clone();
        move || kvota(&["tenants", "-o", "xml", "--cp", &cp])
    })
    .await
    .expect("join");
    assert!(code == 2 && err.contains("table") && err.contains("yaml"), "{err}");
    cl.shutdown().await;
}

/// `kvota completions bash | head -1` ends quietly: the pipe closes under the
/// generator, which must not panic.
#[test]
fn completions_into_a_closed_pipe_end_quietly() {
    let out = Command::new("bash")
        .args([
            "-c",
            &format!(
                "set -o pipefail; {} completions bash | head -1",
                env!("CARGO_BIN_EXE_kvota")
            ),
        ])
        .output()
        .expect("run bash");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !err.contains("panicked"), "{err}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);
}

/// The small things a new operator meets on a one-node control plane: a policy that
/// maps no namespace gets a note; `usage` on an empty federation totals `0.000`;
/// `--cp` at the HTTP port says so; `cluster remove` of a cluster whose lease is in
/// force names the time, not epoch milliseconds; `clusters` and `tenants` tell running,
/// admitted and waiting apart, name each agent's revision and define the score;
/// `audit` hides budget changes unless asked (`--kind`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_small_things_an_operator_meets_first() {
    let cl = kvota_testkit::Cluster::start(1).await;
    cl.leader(std::time::Duration::from_secs(10)).await;
    cl.feature_level(
        kvota_control_plane::feature::FeatureLevel::OPERATOR_VIEW,
        std::time::Duration::from_secs(20),
    )
    .await;
    let cp = cl.endpoints()[0].clone();
    let http = cl.members[&1].http_addr.clone();
    let run = |args: Vec<String>| {
        tokio::task::spawn_blocking(move || {
            let a: Vec<&str> = args.iter().map(String::as_str).collect();
            kvota(&a)
        })
    };
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();

    let (code, out, err) = run(s(&[
        "policy",
        "apply",
        &repo("deploy/policies/article.yaml"),
        "--cp",
        &cp,
    ]))
    .await
    .expect("join");
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("as revision 1"), "{out}");
    assert!(
        err.contains("note: no tenant lists a namespace") && err.contains("passes unjudged"),
        "{err}"
    );
    let (code, _, err) = run(s(&["policy", "validate", &repo("deploy/policies/quickstart.yaml")]))
        .await
        .expect("join");
    assert!(
        code == 0 && !err.contains("note:"),
        "the quickstart policy maps namespaces: {err}"
    );

    let (code, out, err) = run(s(&["usage", "--by", "none", "--cp", &cp])).await.expect("join");
    assert_eq!(code, 0, "{err}");
    let total = out
        .lines()
        .find(|l| l.starts_with("TOTAL"))
        .unwrap_or_default()
        .to_string();
    assert!(
        total.trim_end().ends_with("0.000") && !total.contains("-0.000"),
        "{out}"
    );

    let (code, _, err) = run(s(&["status", "--cp", &http])).await.expect("join");
    assert_eq!(code, 1);
    assert!(
        err.contains("answered HTTP, not gRPC") && err.contains("--listen"),
        "{err}"
    );

    let client = kvota_client::client::Client::new(&cl.endpoints()).expect("client");
    let epoch = kvota_testkit::register_gpus(&client, "east", 8_000).await;
    kvota_testkit::report_usage(&client, "east", 1, epoch, &[("training", 0, 2_000, 1_000)], (0, 0)).await;
    let (code, _, err) = run(s(&["cluster", "remove", "east", "--cp", &cp])).await.expect("join");
    assert_eq!(code, 1);
    assert!(
        err.contains("may still enforce a lease until 20") && err.contains("Z (") && err.contains("from now"),
        "{err}"
    );
    assert!(!err.contains(" ms;"), "no raw milliseconds: {err}");

    let (code, out, err) = run(s(&["clusters", "--cp", &cp])).await.expect("join");
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("policy revision 1 in force since"), "{out}");
    for col in ["RUNNING", "ADMITTED", "WAITING", "POLICY", "AGENT", "LEVEL"] {
        assert!(out.contains(col), "{col}: {out}");
    }
    let (code, out, err) = run(s(&["tenants", "--cp", &cp])).await.expect("join");
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("RUNNING") && out.contains("ADMITTED") && out.contains("WAITING"),
        "{out}"
    );
    assert!(
        out.contains("SCORE: fairness score: in use (running + admitted) against entitled"),
        "{out}"
    );

    let (code, out, err) = run(s(&["audit", "--cp", &cp])).await.expect("join");
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("cluster east joined") && !out.contains("got lease epoch"),
        "{out}"
    );
    assert!(out.contains("--kind budgets shows them"), "{out}");
    let (code, out, err) = run(s(&["audit", "--kind", "budgets", "--cp", &cp]))
        .await
        .expect("join");
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("got lease epoch") && !out.contains("joined"), "{out}");
    let (code, _, err) = run(s(&["audit", "--kind", "leases", "--cp", &cp])).await.expect("join");
    assert_eq!(code, 2, "an unknown kind is a usage error: {err}");
    cl.shutdown().await;
}

/// `kvota certs list` marks what expires within --warn-days (exit 3, for a cron job);
/// `certs renew` issues the same identity and names again with a new key, after which
/// the list is clean; `certs p12` writes a bundle a browser imports (mode 0600, the
/// password shown once), which OpenSSL opens with that password when it is installed.
#[test]
fn certs_are_listed_renewed_and_bundled_for_a_browser() {
    let dir = tempfile::tempdir().expect("tmp");
    let d = dir.path().to_str().expect("utf8");
    assert_eq!(
        kvota(&["certs", "init", "--dir", d, "--trust-domain", "renew.test"]).0,
        0
    );
    let (code, _, err) = kvota(&[
        "certs",
        "issue",
        "--dir",
        d,
        "--role",
        "node",
        "--name",
        "1",
        "--dns",
        "kvota-server-1",
        "--days",
        "10",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        kvota(&["certs", "issue", "--dir", d, "--role", "viewer", "--name", "amy"]).0,
        0
    );

    let (code, out, _) = kvota(&["certs", "list", "--dir", d, "--warn-days", "14"]);
    assert_eq!(code, 3, "{out}");
    let node_line = out
        .lines()
        .find(|l| l.starts_with("node-1.crt"))
        .expect("node-1 listed");
    assert!(
        node_line.contains("spiffe://renew.test/node/1") && node_line.ends_with("renew soon"),
        "{out}"
    );
    assert!(
        !out.lines()
            .any(|l| l.starts_with("viewer-amy.crt") && l.ends_with("renew soon")),
        "{out}"
    );
    assert!(
        out.contains("1 certificate(s) expired or expiring within 14 days"),
        "{out}"
    );

    let key_before = std::fs::read(dir.path().join("node-1.key")).expect("key");
    let node = format!("{d}/node-1.crt");
    let (code, out, err) = kvota(&["certs", "renew", &node, "--dir", d]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("renewed for 365 days"), "{out}");
    assert_ne!(
        std::fs::read(dir.path().join("node-1.key")).expect("key"),
        key_before,
        "a new key"
    );
    let (_, shown, _) = kvota(&["certs", "show", &node]);
    assert!(
        shown.contains("spiffe://renew.test/node/1") && shown.contains("kvota-server-1"),
        "the same identity and names: {shown}"
    );
    let (code, out, _) = kvota(&["certs", "list", "--dir", d, "--warn-days", "14"]);
    assert_eq!(code, 0, "{out}");

    let p12 = dir.path().join("viewer-amy.p12");
    let p12_s = p12.to_str().expect("utf8");
    let (code, out, err) = kvota(&[
        "certs",
        "p12",
        "--cert",
        &format!("{d}/viewer-amy.crt"),
        "--key",
        &format!("{d}/viewer-amy.key"),
        "--ca",
        &format!("{d}/ca.crt"),
        "--out",
        p12_s,
    ]);
    assert_eq!(code, 0, "{err}");
    let password = out
        .lines()
        .find_map(|l| l.strip_prefix("password (shown once; the browser asks for it when importing): "))
        .unwrap_or_else(|| panic!("no password: {out}"))
        .to_string();
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&p12).expect("p12").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }
    let (code, _, err) = kvota(&[
        "certs",
        "p12",
        "--cert",
        &format!("{d}/viewer-amy.crt"),
        "--key",
        &format!("{d}/viewer-amy.key"),
        "--out",
        p12_s,
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("pass --force"), "{err}");
    match Command::new("openssl")
        .args(["pkcs12", "-in", p12_s, "-nodes", "-passin"])
        .arg(format!("pass:{password}"))
        .output()
    {
        Ok(o) => {
            let text = String::from_utf8_lossy(&o.stdout);
            assert!(o.status.success(), "openssl: {}", String::from_utf8_lossy(&o.stderr));
            assert_eq!(text.matches("BEGIN CERTIFICATE").count(), 2, "{text}");
            assert!(text.contains("BEGIN PRIVATE KEY"), "{text}");
        }
        Err(_) => eprintln!("openssl not installed: the bundle's contents are not checked"),
    }
}
