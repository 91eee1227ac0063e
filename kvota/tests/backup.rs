//! Backup and restore as an operator runs them: `kvota snapshot save` from a running
//! 3-node control plane (nodes in this process) writes a versioned file holding the
//! leader's state; `kvota snapshot restore` writes it into a new data directory; a real
//! `kvota server` process started on it is a working one-node federation with the same
//! ledger, policy, clusters and showback, which accepts writes and grows to two voters.
//! A restore never overwrites a data directory, and a file that is not a backup, or of
//! a newer format, is refused with a clear message.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kvota_client::client::Client;
use kvota_testkit::procs::{self, Procs};
use serde_json::Value;

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

async fn kvota_async(args: Vec<String>) -> (i32, String, String) {
    tokio::task::spawn_blocking(move || kvota(&args.iter().map(String::as_str).collect::<Vec<_>>()))
        .await
        .expect("join")
}

fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

async fn json(a: &[&str]) -> Value {
    let (code, out, err) = kvota_async(args(a)).await;
    assert_eq!(code, 0, "kvota {}: {err}", a.join(" "));
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("kvota {}: {e}: {out}", a.join(" ")))
}

/// Waits until `kvota status` at `rpc` names a leader and the node is ready.
async fn wait_ready(rpc: &str, what: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (code, out, err) = kvota_async(args(&["status", "-o", "json", "--cp", rpc])).await;
        if code == 0 {
            let v: Value = serde_json::from_str(&out).expect("status JSON");
            if v["ready"] == true && v["leader_id"].is_u64() {
                return v;
            }
        }
        assert!(Instant::now() < deadline, "{what} never became ready: {out}{err}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saved_federation_restores_into_a_working_node_that_grows() {
    let cl = kvota_testkit::Cluster::start(3).await;
    let leader = cl.leader(Duration::from_secs(20)).await;
    let cp = cl.members[&leader].rpc_addr.clone();
    let c = Client::new(&cl.endpoints()).expect("client");
    // Feature level 2 (showback) first, then a policy, a cluster and usage.
    cl.feature_level(
        kvota_control_plane::feature::FeatureLevel::RECORDS,
        Duration::from_secs(20),
    )
    .await;
    let policy = format!("{}/../deploy/policies/article.yaml", env!("CARGO_MANIFEST_DIR"));
    let (code, _, err) = kvota_async(args(&["policy", "apply", &policy, "--cp", &cp])).await;
    assert_eq!(code, 0, "{err}");
    let epoch = kvota_testkit::register_gpus(&c, "east", 16_000).await;
    let now = u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis(),
    )
    .expect("ms");
    kvota_testkit::report_usage(
        &c,
        "east",
        1,
        epoch,
        &[("training", 7_200_000_000, 4_000, 0)],
        (now - 3_600_000, now - 60_000),
    )
    .await;

    // Save.
    let tmp = tempfile::tempdir().expect("tmp");
    let file = tmp.path().join("kvota.backup");
    let file_s = file.display().to_string();
    let (code, out, err) = kvota_async(args(&["snapshot", "save", &file_s, "--cp", &cp])).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("saved") && out.contains("policy myfair-cluster") && out.contains("1 cluster"),
        "{out}"
    );
    let (code, _, err) = kvota_async(args(&["snapshot", "save", &file_s, "--cp", &cp])).await;
    assert!(
        code == 1 && err.contains("exists") && err.contains("--force"),
        "an existing file is not overwritten: {err}"
    );
    // Into a directory, as the backup CronJob saves (deploy/kubernetes/components/backup):
    // a file named by the time, the newest --keep kept.
    let dir = tmp.path().join("backups");
    std::fs::create_dir(&dir).expect("mkdir");
    let dir_s = dir.display().to_string();
    for _ in 0..2 {
        let (code, _, err) = kvota_async(args(&["snapshot", "save", &dir_s, "--keep", "1", "--cp", &cp])).await;
        assert_eq!(code, 0, "{err}");
        tokio::time::sleep(Duration::from_millis(1_100)).await;
    }
    let kept: Vec<_> = std::fs::read_dir(&dir).expect("dir").filter_map(Result::ok).collect();
    assert_eq!(kept.len(), 1, "--keep 1 keeps the newest");
    let name = kept[0].file_name().to_string_lossy().into_owned();
    assert!(
        name.starts_with("kvota-backup-20") && name.ends_with("Z.json"),
        "{name}"
    );
    let (code, _, err) = kvota_async(args(&["snapshot", "save", &file_s, "--keep", "1", "--cp", &cp])).await;
    assert!(
        code == 1 && err.contains("--keep needs FILE to be a directory"),
        "{err}"
    );
    let bytes = std::fs::read(&file).expect("the backup");
    let (head, saved) = kvota_control_plane::backup::decode(&bytes, kvota_control_plane::feature::FeatureLevel::NEWEST)
        .expect("a backup this build reads");
    assert_eq!((head.kind.as_str(), head.format), ("kvota-backup", 1));
    let original = cl.federation(leader).await;
    assert_eq!(
        saved.federation.ledger(),
        original.ledger(),
        "the saved ledger is the leader's"
    );
    assert_eq!(saved.federation.policy(), original.policy());
    assert!(
        saved.federation.showback().is_some_and(|s| s.cells() > 0),
        "showback saved too"
    );
    let usage_args = |rpc: &str| {
        args(&[
            "usage",
            "--since",
            "2026-01-01",
            "--by",
            "tenant,cluster",
            "-o",
            "json",
            "--cp",
            rpc,
        ])
    };
    let (code, usage_before, err) = kvota_async(usage_args(&cp)).await;
    assert_eq!(code, 0, "{err}");
    cl.shutdown().await;

    // Restore into a new directory as node 7, and start a real server on it.
    let spec = procs::specs(2, tmp.path());
    let (seven, eight) = (
        procs::ServerSpec {
            id: 7,
            ..spec[0].clone()
        },
        procs::ServerSpec {
            id: 8,
            ..spec[1].clone()
        },
    );
    let dir = seven.dir.display().to_string();
    let (code, out, err) = kvota_async(args(&[
        "snapshot",
        "restore",
        &file_s,
        "--id",
        "7",
        "--data-dir",
        &dir,
        "--member",
        &seven.member(),
    ]))
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("kvota server --id 7") && out.contains("add-learner"),
        "the next steps: {out}"
    );
    let (code, _, err) = kvota_async(args(&[
        "snapshot",
        "restore",
        &file_s,
        "--id",
        "7",
        "--data-dir",
        &dir,
        "--member",
        &seven.member(),
    ]))
    .await;
    assert!(code == 1 && err.contains("already holds a data directory"), "{err}");
    let bin = Path::new(env!("CARGO_BIN_EXE_kvota"));
    let mut running = Procs::default();
    running.push(
        procs::server_command(bin, &seven, &[], false, &[])
            .spawn()
            .expect("start node 7"),
    );
    let st = wait_ready(&seven.rpc, "the restored node").await;
    assert_eq!(
        (st["node_id"].as_u64(), st["leader_id"].as_u64()),
        (Some(7), Some(7)),
        "{st}"
    );
    assert_eq!(st["policy"], "myfair-cluster");
    // The audit log says the federation was restored, and by which backup.
    let (code, audit, err) = kvota_async(args(&["audit", "--kind", "snapshot", "--cp", &seven.rpc])).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        audit.contains("the federation was restored from a backup node")
            && audit.contains(&format!("log index {}", head.applied_index)),
        "{audit}"
    );

    // The same federation: tenants, cluster, showback to the byte.
    let tenants = json(&["tenants", "-o", "json", "--cp", &seven.rpc]).await;
    assert_eq!(tenants["tenants"].as_array().map(Vec::len), Some(3), "{tenants}");
    let clusters = json(&["clusters", "-o", "json", "--cp", &seven.rpc]).await;
    assert_eq!(clusters[0]["cluster"], "east", "{clusters}");
    let (code, usage_after, err) = kvota_async(usage_args(&seven.rpc)).await;
    assert_eq!(code, 0, "{err}");
    let (a, b): (Value, Value) = (
        serde_json::from_str(&usage_before).expect("json"),
        serde_json::from_str(&usage_after).expect("json"),
    );
    assert_eq!(a["rows"], b["rows"], "showback before {a} and after {b}");
    assert_eq!(a["rows"][0]["milli_gpue_ms"], 7_200_000_000u64);

    // It takes writes, and grows: node 8 joins as a learner, then both vote.
    let (code, _, err) = kvota_async(args(&["policy", "apply", &policy, "--cp", &seven.rpc])).await;
    assert_eq!(code, 0, "{err}");
    running.push(
        procs::server_command(bin, &eight, &[], false, &[])
            .spawn()
            .expect("start node 8"),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (code, _, err) = kvota_async(args(&[
            "members",
            "add-learner",
            "--id",
            "8",
            "--rpc",
            &eight.rpc,
            "--raft",
            &eight.raft,
            "--http",
            &eight.http,
            "--cp",
            &seven.rpc,
        ]))
        .await;
        if code == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "node 8 never joined: {err}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let (code, _, err) = kvota_async(args(&["members", "set-voters", "--voters", "7,8", "--cp", &seven.rpc])).await;
    assert_eq!(code, 0, "{err}");
    let members = json(&["members", "list", "-o", "json", "--cp", &seven.rpc]).await;
    let voters: Vec<u64> = members
        .as_array()
        .expect("members")
        .iter()
        .filter(|m| m["voter"] == true)
        .filter_map(|m| m["id"].as_u64())
        .collect();
    assert_eq!(voters, vec![7, 8], "{members}");
    wait_ready(&eight.rpc, "the new voter").await;
    let on_eight = json(&["tenants", "-o", "json", "--cp", &eight.rpc]).await;
    assert_eq!(
        on_eight["tenants"].as_array().map(Vec::len),
        Some(3),
        "node 8 has the state: {on_eight}"
    );

    // Files that are not backups, or from a newer kvota.
    let other = tmp.path().join("other");
    std::fs::write(tmp.path().join("junk"), "hello").expect("write");
    let junk = tmp.path().join("junk").display().to_string();
    let (code, _, err) = kvota_async(args(&[
        "snapshot",
        "restore",
        &junk,
        "--id",
        "9",
        "--data-dir",
        &other.display().to_string(),
        "--member",
        "9=127.0.0.1:1,127.0.0.1:2,127.0.0.1:3",
    ]))
    .await;
    assert!(code == 1 && err.contains("not a kvota backup"), "{err}");
    let newer = String::from_utf8(bytes)
        .expect("utf8")
        .replacen("\"format\":1", "\"format\":2", 1);
    std::fs::write(tmp.path().join("newer"), newer).expect("write");
    let newer = tmp.path().join("newer").display().to_string();
    let (code, _, err) = kvota_async(args(&[
        "snapshot",
        "restore",
        &newer,
        "--id",
        "9",
        "--data-dir",
        &other.display().to_string(),
        "--member",
        "9=127.0.0.1:1,127.0.0.1:2,127.0.0.1:3",
    ]))
    .await;
    assert!(code == 1 && err.contains("newer than this kvota reads"), "{err}");
    assert!(!other.join("raft").exists(), "a refused restore writes nothing");
}
