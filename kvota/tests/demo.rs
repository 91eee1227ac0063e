//! `kvota demo` as a newcomer runs it, in its short mode: real `kvota server` child
//! processes, real agents, the whole scenario at `--speed max`; the test reads the JSON
//! summary and asserts on the measured outcomes. Bounds are documented in
//! docs/demo.md.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// Held by each test that runs a demo: its timing bounds (docs/demo.md) assume one
/// demo on the machine, and the test harness would otherwise run two at once on two
/// cores.
static ONE_DEMO_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn kvota() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvota"))
}

/// Processes whose command line mentions `needle` (our data directory).
fn processes_mentioning(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return found;
    };
    for e in dir.flatten() {
        if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(needle) {
                found.push(cmd);
            }
        }
    }
    found
}

fn num(v: &Value, path: &[&str]) -> f64 {
    let mut cur = v;
    for p in path {
        cur = &cur[*p];
    }
    cur.as_f64()
        .unwrap_or_else(|| panic!("{path:?} is not a number in the summary: {cur}"))
}

#[test]
fn the_demo_keeps_fairness_and_loses_nothing() {
    let _one = ONE_DEMO_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    let json = tmp.path().join("out.json");
    let out = kvota()
        .args(["demo", "--speed", "max", "--seed", "1", "--plain", "--json"])
        .arg(&json)
        .arg("--data-dir")
        .arg(&data)
        .output()
        .expect("run kvota demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "demo failed: {}\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
    let s: Value = serde_json::from_slice(&std::fs::read(&json).expect("summary written")).expect("summary is JSON");
    let ctx = format!(
        "summary: {}",
        serde_json::to_string_pretty(&s["tenants"]).unwrap_or_default()
    );

    // Safety: nothing admitted beyond entitlement or maxShare; every report counted once.
    assert_eq!(num(&s, &["over_admissions"]), 0.0, "{ctx}");
    assert!(
        num(&s, &["admissions_checked"]) > 50.0,
        "the check must have seen the burst: {ctx}"
    );
    assert_eq!(num(&s, &["over_max_share"]), 0.0);
    assert_eq!(num(&s, &["usage", "lost_gpue_s"]), 0.0, "{}", s["usage"]);
    assert_eq!(num(&s, &["usage", "double_counted_gpue_s"]), 0.0, "{}", s["usage"]);
    assert_eq!(num(&s, &["usage", "unacknowledged_reports"]), 0.0);
    assert!(num(&s, &["usage", "produced_gpue_s"]) > 500.0, "{}", s["usage"]);

    // Inference keeps its guarantee (beyond the 2 s reaction grace) whenever it had demand.
    assert!(
        num(&s, &["tenants", "inference", "starved_below_guarantee_ms"]) <= 1_000.0,
        "{ctx}"
    );
    assert!(num(&s, &["tenants", "inference", "delay_p99_ms"]) <= 5_000.0, "{ctx}");
    // The burst ran, and fair shares came back in bounded time after it and after healing.
    assert!(num(&s, &["tenants", "training", "pods_started"]) >= 150.0, "{ctx}");
    assert!(
        num(&s, &["recovery_after_burst_s"]) <= 8.0,
        "burst: {}",
        s["recovery_after_burst_s"]
    );
    assert!(
        num(&s, &["recovery_after_partition_s"]) <= 8.0,
        "partition: {}",
        s["recovery_after_partition_s"]
    );
    // The partition really expired the lease; the control plane failed over and healed.
    assert_eq!(s["partition_lease_expired"], Value::Bool(true));
    assert!(num(&s, &["failover_s"]) <= 5.0, "failover: {}", s["failover_s"]);
    assert_eq!(s["killed_node_rejoined"], Value::Bool(true));
    assert!(s["timeline"].as_array().is_some_and(|t| t.len() >= 20));
    // Reclaim ran in every agent; it never takes from the non-preemptible tenant.
    let evictions = s["evictions"].as_object().expect("evictions per tenant");
    assert!(
        !evictions.contains_key("inference"),
        "inference is not preemptible: {evictions:?}"
    );
    assert!(
        stdout.contains("reclaim "),
        "the summary says what reclaim did: {stdout}"
    );
    assert!(
        stdout.contains("Monday 8 AM") && stdout.contains("lease expired"),
        "{stdout}"
    );
    // The plain output names the dashboard, and says what SCORE and DENIED are.
    assert!(stdout.contains("dashboard: http://127.0.0.1:"), "{stdout}");
    assert!(
        stdout.contains("SCORE: the control plane's fairness score")
            && stdout.contains("DENIED: pods denied at least once"),
        "{stdout}"
    );
    // Denials count pods, not retries; the score at the end is the control plane's.
    for t in ["training", "inference", "research"] {
        let (pods, answers) = (
            num(&s, &["tenants", t, "pods_denied"]),
            num(&s, &["tenants", t, "denial_answers"]),
        );
        assert!(pods <= answers, "{t}: {pods} pods denied, {answers} answers: {ctx}");
        let end = num(&s, &["tenants", t, "fairness_score_at_end"]);
        assert!((0.0..=1.0).contains(&end), "{t}: {end}");
    }

    // No orphans: every server the demo started is gone.
    let left = processes_mentioning(&data.to_string_lossy());
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

fn fails_with(args: &[&str], needle: &str) {
    let out = kvota().args(args).output().expect("run kvota");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} must fail");
    assert!(stderr.contains(needle), "{args:?}: stderr lacks `{needle}`:\n{stderr}");
    assert!(stderr.lines().count() <= 4, "a newcomer's error is short:\n{stderr}");
}

#[test]
fn newcomer_mistakes_get_one_clear_line() {
    let tmp = tempfile::tempdir().expect("tmp");
    let bad = tmp.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nspec: {tenants: [{name: a, weight: 0}]}\n",
    )
    .expect("w");
    fails_with(
        &["demo", "--policy", &bad.to_string_lossy()],
        "not a valid FairnessPolicy",
    );
    let other = tmp.path().join("other.yaml");
    std::fs::write(&other, "apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: x}\nspec: {tenants: [{name: a, weight: 1}]}\n").expect("w");
    fails_with(
        &["demo", "--policy", &other.to_string_lossy()],
        "lacks inference, research, training",
    );
    fails_with(&["demo", "--policy", "/nonexistent/p.yaml"], "read --policy");
    let full = tmp.path().join("full");
    std::fs::create_dir_all(&full).expect("mkdir");
    std::fs::write(full.join("x"), "x").expect("w");
    fails_with(&["demo", "--data-dir", &full.to_string_lossy()], "is not empty");
    fails_with(&["demo", "--speed", "10"], "outside");
    fails_with(&["demo", "--speed", "fast"], "not a number");
    assert!(Path::new(env!("CARGO_BIN_EXE_kvota")).exists());
}

#[test]
fn servers_do_not_outlive_a_killed_demo() {
    use std::io::BufRead as _;
    let _one = ONE_DEMO_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    let mut child = kvota()
        .args(["demo", "--speed", "max", "--plain", "--data-dir"])
        .arg(&data)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn demo");
    let stdout = child.stdout.take().expect("stdout");
    let mut up = false;
    for line in std::io::BufReader::new(stdout).lines() {
        let Ok(line) = line else { break };
        if line.contains("cluster edge joined") {
            up = true;
            break;
        }
    }
    assert!(up, "the demo never got its clusters up");
    assert_eq!(
        processes_mentioning(&data.to_string_lossy()).len(),
        4,
        "the demo and its three servers"
    );
    child.kill().expect("SIGKILL the demo");
    let _ = child.wait();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let left = processes_mentioning(&data.to_string_lossy());
        if left.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "servers outlived the killed demo: {left:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}
