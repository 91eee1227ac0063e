//! `kvota sim` as a user runs it: real traces in, every promised output file out, and a
//! clear one-line error for each mistake.

use std::path::Path;
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

const SCHEDULERS: [&str; 5] = [
    "wfq-decay",
    "round-robin",
    "strict-priority",
    "static-reservation",
    "drf-elastic",
];

/// A morning burst of training next to steady inference, in the generic CSV format.
fn write_trace(dir: &Path) -> String {
    let mut csv = String::from("tenant,submit_s,gpus,duration_s,kind\n");
    for i in 0..6 {
        csv += &format!("inference,{},1,3600,inference\n", i * 60);
    }
    for i in 0..40 {
        csv += &format!("training,{},2,{},training\n", 600 + i, 1800 + i * 30);
    }
    csv += "research,900,0.5,600,training\n";
    let p = dir.join("trace.csv");
    std::fs::write(&p, csv).expect("write trace");
    p.display().to_string()
}

#[test]
fn sim_compares_all_five_schedulers_and_writes_every_output() {
    let tmp = tempfile::tempdir().expect("tmp");
    let trace = write_trace(tmp.path());
    let out = tmp.path().join("out");
    let (code, stdout, err) = kvota(&[
        "sim",
        "--trace",
        &format!("csv:{trace}"),
        "--clusters",
        "east=8,west=8",
        "--tick",
        "10s",
        "--out",
        out.to_str().expect("utf8"),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("replayed 47 jobs x 5 schedulers"), "{stdout}");
    let report = std::fs::read_to_string(out.join("report.md")).expect("report.md");
    for s in SCHEDULERS {
        assert!(
            report.contains(&format!("| {s} | inference |")),
            "no inference row for {s}:\n{report}"
        );
        let svg = std::fs::read_to_string(out.join(format!("share-{s}.svg"))).expect("share chart");
        assert!(svg.starts_with("<svg") && svg.contains("training"), "{s}");
    }
    assert!(
        report.contains("clusters: east=8, west=8 (16 GPUs in all; nodes of 8 GPUs)"),
        "{report}"
    );
    let results = std::fs::read_to_string(out.join("results.csv")).expect("results.csv");
    assert_eq!(
        results.lines().count(),
        1 + 5 * 3,
        "header + 5 schedulers x 3 tenants:\n{results}"
    );
    assert!(results.lines().all(|l| l.split(',').count() == 20), "{results}");
    let series = std::fs::read_to_string(out.join("series.csv")).expect("series.csv");
    assert!(
        series.starts_with("scheduler,t_hours,fairness_score,share_inference,share_research,share_training\n"),
        "{series}"
    );
    assert!(
        std::fs::read_to_string(out.join("fairness.svg"))
            .expect("fairness chart")
            .matches("<polyline")
            .count()
            == 5
    );
}

#[test]
fn sim_replays_the_philly_format_with_the_philly_policy() {
    let tmp = tempfile::tempdir().expect("tmp");
    let out = tmp.path().join("out");
    let (code, stdout, err) = kvota(&[
        "sim",
        "--trace",
        &format!("philly:{}", repo("sim/tests/fixtures/philly")),
        "--policy",
        &repo("deploy/policies/philly-vc.yaml"),
        "--clusters",
        "32",
        "--scheduler",
        "wfq-decay,static-reservation",
        "--out",
        out.to_str().expect("utf8"),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("replayed 16 jobs x 2 schedulers"), "{stdout}");
    let results = std::fs::read_to_string(out.join("results.csv")).expect("results.csv");
    let row = results
        .lines()
        .find(|l| l.starts_with("wfq-decay,vc-925e2b,"))
        .expect("vc-925e2b row");
    assert_eq!(row.split(',').nth(2), Some("4"), "4 jobs in that VC: {row}");
}

#[test]
fn sim_mistakes_get_one_clear_line() {
    let tmp = tempfile::tempdir().expect("tmp");
    let trace = format!("csv:{}", write_trace(tmp.path()));
    let out = tmp.path().join("o").display().to_string();
    let philly_policy = repo("deploy/policies/philly-vc.yaml");
    let philly = format!("philly:{}", repo("sim/tests/fixtures/philly"));
    let cases: [(Vec<&str>, &str); 8] = [
        (
            vec!["--trace", &philly],
            "for the Philly trace: --policy deploy/policies/philly-vc.yaml",
        ),
        (
            vec!["--trace", &trace, "--scheduler", "fifo"],
            "--scheduler: unknown `fifo`; choose from wfq-decay, round-robin",
        ),
        (
            vec!["--trace", &trace, "--clusters", "2x8", "--partition", "c9@1h..2h"],
            "no cluster `c9` (clusters: c1, c2)",
        ),
        (
            vec!["--trace", &trace, "--clusters", "eight"],
            "`eight` is not a GPU count",
        ),
        (
            vec!["--trace", "csv:/nonexistent/trace.csv"],
            "cannot read /nonexistent/trace.csv",
        ),
        (
            vec!["--trace", &trace, "--policy", &philly_policy],
            "the trace has tenant `inference` but the policy does not",
        ),
        (vec!["--trace", &trace, "--tick", "soon"], "--tick"),
        (
            vec!["--trace", &trace, "--time-scale", "0"],
            "--time-scale must be a positive number",
        ),
    ];
    for (args, needle) in cases {
        let mut all = vec!["sim", "--out", &out];
        all.extend(args.iter().copied());
        let (code, _, err) = kvota(&all);
        assert_eq!(code, 1, "{all:?}: {err}");
        assert!(err.contains(needle), "{all:?}: expected `{needle}` in:\n{err}");
        assert!(err.lines().count() <= 2, "{all:?}: not one clear line:\n{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn sim_generates_synthetic_traces_from_a_seed_and_many_tenants_brings_its_policy() {
    let tmp = tempfile::tempdir().expect("tmp");
    let out = tmp.path().join("out");
    let o = out.to_str().expect("utf8");
    // No --policy: many-tenants names 150 tenants the article's policy lacks, so this
    // runs only if the trace's own policy is used.
    let (code, stdout, err) = kvota(&[
        "sim",
        "--trace",
        "synth:many-tenants:seed=3:days=1",
        "--clusters",
        "3x1024",
        "--scheduler",
        "drf-elastic",
        "--out",
        o,
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("x 1 schedulers"), "{stdout}");
    let report = std::fs::read_to_string(out.join("report.md")).expect("report.md");
    assert!(
        report.contains("policy: `synth-many-tenants` (150 tenants)"),
        "{report}"
    );
    // mixed-sizes fits the default (article) policy.
    let (code, _, err) = kvota(&[
        "sim",
        "--trace",
        "synth:mixed-sizes:seed=3:days=2",
        "--clusters",
        "3x128",
        "--scheduler",
        "wfq-decay",
        "--out",
        o,
    ]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = kvota(&["sim", "--trace", "synth:few-tenants", "--out", o]);
    assert_eq!(code, 1);
    assert!(
        err.contains("unknown kind `few-tenants`") && err.contains("many-tenants, mixed-sizes"),
        "{err}"
    );
}
