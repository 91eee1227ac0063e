//! Workload traces: the jobs a simulation replays.
//!
//! Three formats load into one [`Trace`]:
//! - **Philly** (`philly:DIR[:GPU]`): the per-VC job files of the Microsoft Philly trace
//!   as shipped by the Gavel project (`<vc>.trace`, tab-separated, plus
//!   `throughputs.json`). A VC is a tenant; every job is training. Duration =
//!   `total_steps / throughput[gpu][(job_type, gpus)]["null"]`. Where the file has no
//!   entry for a job's GPU count (some sizes above 8), the throughput of the largest
//!   listed size is scaled linearly (perfect scaling, an optimistic assumption).
//! - **Alibaba 2023** (`alibaba:FILE`): `openb_pod_list_*.csv`. Tenants come from `qos`:
//!   `LS` is `inference` (long-running services), `BE` is `training`, `Burstable` and
//!   `Guaranteed` are `research` (batch). A pod's GPUe is `num_gpu * gpu_milli`;
//!   duration is `deletion_time - scheduled_time`. Pods without GPUs, and pods that
//!   never ran in the original cluster (no `scheduled_time`), are left out.
//! - **Generic CSV** (`csv:FILE`, or any `.csv` with this header) for users' own traces:
//!   `tenant,submit_s,gpus,duration_s[,kind]`, `gpus` may be fractional (0.5),
//!   `kind` is `training` (default) or `inference`.
//!
//! - **Synthetic** (`synth:many-tenants`, `synth:mixed-sizes`, with `:seed=N` and
//!   `:days=D`): generated from a seed, see [`crate::synth`].
//!
//! Every loader reports problems with the file and line and never panics on input.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use kvota_fairness::MilliGpue;

/// What a job is, for the workload model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// A batch job: runs for its duration, can be preempted and resumes from its last
    /// checkpoint.
    Training,
    /// A replica of a long-running service: runs for its lifetime; while it waits, its
    /// service is short of capacity (see the latency model in the crate docs).
    Inference,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Training => "training",
            Kind::Inference => "inference",
        })
    }
}

/// One job (pod) of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Job {
    /// Tenant name (must be a tenant of the policy).
    pub tenant: String,
    /// Batch or service.
    pub kind: Kind,
    /// Submission time, ms from the trace's start.
    pub submit_ms: u64,
    /// GPUe requested (1000 = one GPU).
    pub gpue: MilliGpue,
    /// Run time (or service lifetime), ms; at least 1.
    pub duration_ms: u64,
}

/// A loaded trace: jobs sorted by submission time, and notes on what the loader assumed.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    /// Where it came from (for reports).
    pub source: String,
    /// Jobs by submission time (stable: ties keep file order).
    pub jobs: Vec<Job>,
    /// Assumptions and skipped rows, in words.
    pub notes: Vec<String>,
    /// A FairnessPolicy (YAML) naming the trace's tenants, for traces that come with
    /// one (the synthetic `many-tenants`); `kvota sim` uses it when given no `--policy`.
    pub policy_yaml: Option<String>,
}

/// Why a trace could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file or directory could not be read.
    #[error("cannot read {path}: {error}")]
    Io {
        /// Path.
        path: PathBuf,
        /// Cause (shown in the message, not chained: one line says it all).
        error: std::io::Error,
    },
    /// A row or document is malformed.
    #[error("{path}:{line}: {why}")]
    Parse {
        /// File.
        path: String,
        /// 1-based line (0: the whole file).
        line: usize,
        /// What is wrong.
        why: String,
    },
    /// The spec names no known format.
    #[error("{0}")]
    Spec(String),
}

fn read(path: &Path) -> Result<String, TraceError> {
    std::fs::read_to_string(path).map_err(|error| TraceError::Io {
        path: path.to_path_buf(),
        error,
    })
}

fn perr(path: &str, line: usize, why: impl Into<String>) -> TraceError {
    TraceError::Parse {
        path: path.to_string(),
        line,
        why: why.into(),
    }
}

impl Trace {
    /// Loads a trace from a spec: `philly:DIR[:GPU]`, `alibaba:FILE`, `csv:FILE`,
    /// `synth:KIND[:seed=N][:days=D]` (generated, see [`crate::synth`]), or a bare path
    /// (a directory with `throughputs.json` is Philly, a CSV is recognised by its header).
    pub fn load(spec: &str) -> Result<Trace, TraceError> {
        if let Some(rest) = spec.strip_prefix("synth:") {
            return crate::synth::load(rest);
        }
        if let Some(rest) = spec.strip_prefix("philly:") {
            let (dir, gpu) = match rest.rsplit_once(':') {
                Some((d, g)) if !g.contains('/') && !g.is_empty() => (d, g),
                _ => (rest, "v100"),
            };
            return load_philly(Path::new(dir), gpu);
        }
        if let Some(file) = spec.strip_prefix("alibaba:") {
            let p = Path::new(file);
            return parse_alibaba(&p.display().to_string(), &read(p)?);
        }
        if let Some(file) = spec.strip_prefix("csv:") {
            let p = Path::new(file);
            return parse_csv(&p.display().to_string(), &read(p)?);
        }
        let p = Path::new(spec);
        if p.is_dir() {
            if p.join("throughputs.json").is_file() {
                return load_philly(p, "v100");
            }
            return Err(TraceError::Spec(format!(
                "{spec} is a directory without throughputs.json; for the Philly trace give the philly-vc directory, else a CSV file"
            )));
        }
        let text = read(p)?;
        let header = text.lines().next().unwrap_or("").trim();
        if header.starts_with("name,cpu_milli") {
            parse_alibaba(spec, &text)
        } else if header.starts_with("tenant,") {
            parse_csv(spec, &text)
        } else {
            Err(TraceError::Spec(format!(
                "{spec}: unknown trace format (header `{}`); use philly:DIR, alibaba:FILE or a CSV with header tenant,submit_s,gpus,duration_s[,kind]",
                header.chars().take(60).collect::<String>()
            )))
        }
    }

    /// Multiplies every time (submission and duration) by `factor` (0.5 = twice as fast).
    pub fn scale_time(&mut self, factor: f64) {
        for j in &mut self.jobs {
            j.submit_ms = scale(j.submit_ms, factor);
            j.duration_ms = scale(j.duration_ms, factor).max(1);
        }
    }

    /// Keeps the first `n` jobs by submission time.
    pub fn truncate(&mut self, n: usize) {
        self.jobs.truncate(n);
    }

    /// Tenant names appearing in the trace.
    pub fn tenants(&self) -> Vec<String> {
        let mut v: Vec<String> = self.jobs.iter().map(|j| j.tenant.clone()).collect();
        v.sort();
        v.dedup();
        v
    }

    fn finish(mut self) -> Trace {
        self.sort();
        self
    }

    /// Sorts jobs by submission time (stable: ties keep their order).
    pub(crate) fn sort(&mut self) {
        self.jobs.sort_by_key(|j| j.submit_ms);
    }
}

fn scale(ms: u64, factor: f64) -> u64 {
    let v = (ms as f64 * factor).round();
    if v <= 0.0 {
        0
    } else if v >= u64::MAX as f64 {
        u64::MAX
    } else {
        // In range and integral: the conversion is exact.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let out = v as u64;
        out
    }
}

fn secs_to_ms(s: f64) -> Option<u64> {
    if !s.is_finite() || !(0.0..=1e15).contains(&s) {
        return None;
    }
    Some(scale(1000, s))
}

/// Steps per second per `(gpu type, job key)`.
pub type Throughputs = BTreeMap<String, BTreeMap<String, f64>>;

/// Parses Gavel's `throughputs.json`, keeping only the `"null"` (job alone) figure.
pub fn parse_throughputs(path: &str, text: &str) -> Result<Throughputs, TraceError> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| perr(path, e.line(), e.to_string()))?;
    let obj = v
        .as_object()
        .ok_or_else(|| perr(path, 0, "expected an object keyed by GPU type"))?;
    let mut out = Throughputs::new();
    for (gpu, jobs) in obj {
        let Some(jobs) = jobs.as_object() else { continue };
        let mut m = BTreeMap::new();
        for (key, entry) in jobs {
            if let Some(t) = entry.get("null").and_then(serde_json::Value::as_f64) {
                if t > 0.0 && t.is_finite() {
                    m.insert(key.clone(), t);
                }
            }
        }
        out.insert(gpu.clone(), m);
    }
    Ok(out)
}

/// Loads every `<vc>.trace` in `dir` with durations for `gpu`.
pub fn load_philly(dir: &Path, gpu: &str) -> Result<Trace, TraceError> {
    let tp = dir.join("throughputs.json");
    let thr = parse_throughputs(&tp.display().to_string(), &read(&tp)?)?;
    let Some(table) = thr.get(gpu) else {
        return Err(TraceError::Spec(format!(
            "GPU type `{gpu}` is not in {}; known: {}",
            tp.display(),
            thr.keys().cloned().collect::<Vec<_>>().join(", ")
        )));
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|error| TraceError::Io {
            path: dir.to_path_buf(),
            error,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "trace"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(TraceError::Spec(format!("{} holds no <vc>.trace files", dir.display())));
    }
    let mut trace = Trace {
        source: format!("philly:{}:{gpu}", dir.display()),
        ..Trace::default()
    };
    let mut scaled = 0usize;
    for f in files {
        let vc = f.file_stem().and_then(|s| s.to_str()).unwrap_or("vc").to_string();
        let (jobs, n_scaled) = parse_philly_vc(&f.display().to_string(), &vc, &read(&f)?, table)?;
        scaled += n_scaled;
        trace.jobs.extend(jobs);
    }
    trace.notes.push(format!(
        "Philly: every VC's clock starts at 0 (they are aligned at the start); durations on {gpu}; \
         {scaled} jobs used a GPU count absent from throughputs.json and were scaled linearly from the largest listed size"
    ));
    Ok(trace.finish())
}

/// Parses one VC file. Tenant is `vc-<vc>` (policy tenant names must start with a letter).
pub fn parse_philly_vc(
    path: &str,
    vc: &str,
    text: &str,
    table: &BTreeMap<String, f64>,
) -> Result<(Vec<Job>, usize), TraceError> {
    let tenant = format!("vc-{vc}");
    let mut jobs = Vec::new();
    let mut scaled = 0;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split('\t').collect();
        if f.len() != 7 {
            return Err(perr(
                path,
                n,
                format!("expected 7 tab-separated fields, found {}", f.len()),
            ));
        }
        let steps: f64 = f[4]
            .trim()
            .parse()
            .map_err(|_| perr(path, n, format!("total_steps `{}` is not a number", f[4])))?;
        let arrival: f64 = f[5]
            .trim()
            .parse()
            .map_err(|_| perr(path, n, format!("arrival_time `{}` is not a number", f[5])))?;
        let gpus: u32 = f[6]
            .trim()
            .parse()
            .map_err(|_| perr(path, n, format!("gpus `{}` is not a whole number", f[6])))?;
        if gpus == 0 || gpus > 4096 {
            return Err(perr(path, n, format!("gpus {gpus} is out of range 1..=4096")));
        }
        let job_type = f[0].trim();
        let (rate, was_scaled) = philly_rate(table, job_type, gpus).ok_or_else(|| {
            perr(
                path,
                n,
                format!("no throughput for job type `{job_type}` at any GPU count"),
            )
        })?;
        scaled += usize::from(was_scaled);
        let secs = steps / rate;
        let submit_ms = secs_to_ms(arrival).ok_or_else(|| perr(path, n, "arrival time out of range"))?;
        let duration_ms = secs_to_ms(secs)
            .ok_or_else(|| perr(path, n, "duration out of range"))?
            .max(1);
        jobs.push(Job {
            tenant: tenant.clone(),
            kind: Kind::Training,
            submit_ms,
            gpue: u64::from(gpus) * 1000,
            duration_ms,
        });
    }
    Ok((jobs, scaled))
}

fn philly_rate(table: &BTreeMap<String, f64>, job_type: &str, gpus: u32) -> Option<(f64, bool)> {
    if let Some(r) = table.get(&format!("('{job_type}', {gpus})")) {
        return Some((*r, false));
    }
    // Largest listed size below (or, failing that, any size) and linear scaling.
    let prefix = format!("('{job_type}', ");
    let sizes: Vec<(u32, f64)> = table
        .iter()
        .filter_map(|(k, r)| Some((k.strip_prefix(&prefix)?.strip_suffix(')')?.trim().parse().ok()?, *r)))
        .collect();
    let below = sizes.iter().filter(|(n, _)| *n <= gpus).max_by_key(|(n, _)| *n);
    let best = below.or_else(|| sizes.iter().min_by_key(|(n, _)| *n))?;
    Some((best.1 * f64::from(gpus) / f64::from(best.0), true))
}

fn csv_fields(line: &str) -> Vec<&str> {
    line.split(',').map(str::trim).collect()
}

/// The tenant of an Alibaba QoS class.
fn alibaba_tenant(qos: &str) -> Option<&'static str> {
    match qos {
        "LS" => Some("inference"),
        "BE" => Some("training"),
        "Burstable" | "Guaranteed" => Some("research"),
        _ => None,
    }
}

/// One Alibaba pod (line `n`) as a job: `(gpus, milli)` its request, created at
/// `create_s()` (read once the request is known good), run for `run_s` seconds.
fn alibaba_job(
    path: &str,
    n: usize,
    tenant: &str,
    (gpus, milli): (f64, f64),
    create_s: impl FnOnce() -> Result<f64, TraceError>,
    run_s: f64,
) -> Result<Job, TraceError> {
    let gpue = gpus * milli;
    if !(gpue > 0.0 && gpue <= 4_096_000.0) {
        return Err(perr(
            path,
            n,
            format!("GPU request {gpus} x {milli} milli is out of range"),
        ));
    }
    Ok(Job {
        tenant: tenant.to_string(),
        kind: if tenant == "inference" {
            Kind::Inference
        } else {
            Kind::Training
        },
        submit_ms: secs_to_ms(create_s()?).ok_or_else(|| perr(path, n, "creation_time out of range"))?,
        gpue: scale(1, gpue),
        duration_ms: secs_to_ms(run_s.max(1.0)).ok_or_else(|| perr(path, n, "run time out of range"))?,
    })
}

/// Parses an Alibaba 2023 `openb_pod_list_*.csv`.
pub fn parse_alibaba(path: &str, text: &str) -> Result<Trace, TraceError> {
    let mut lines = text.lines().enumerate();
    let (_, header) = lines.next().ok_or_else(|| perr(path, 1, "empty file"))?;
    let cols = csv_fields(header);
    let col = |name: &str| {
        cols.iter()
            .position(|c| *c == name)
            .ok_or_else(|| perr(path, 1, format!("missing column `{name}`")))
    };
    let (c_gpu, c_milli, c_qos, c_create, c_delete, c_sched) = (
        col("num_gpu")?,
        col("gpu_milli")?,
        col("qos")?,
        col("creation_time")?,
        col("deletion_time")?,
        col("scheduled_time")?,
    );
    let mut trace = Trace {
        source: format!("alibaba:{path}"),
        ..Trace::default()
    };
    let (mut no_gpu, mut never_ran) = (0usize, 0usize);
    for (i, line) in lines {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let f = csv_fields(line);
        if f.len() != cols.len() {
            return Err(perr(
                path,
                n,
                format!("expected {} fields, found {}", cols.len(), f.len()),
            ));
        }
        let num = |c: usize, what: &str| -> Result<f64, TraceError> {
            f[c].parse::<f64>()
                .map_err(|_| perr(path, n, format!("{what} `{}` is not a number", f[c])))
        };
        let gpus = num(c_gpu, "num_gpu")?;
        if gpus <= 0.0 {
            no_gpu += 1;
            continue;
        }
        if f[c_sched].is_empty() || f[c_delete].is_empty() {
            never_ran += 1;
            continue;
        }
        let milli = num(c_milli, "gpu_milli")?;
        let (start, end) = (num(c_sched, "scheduled_time")?, num(c_delete, "deletion_time")?);
        let tenant = alibaba_tenant(f[c_qos]).ok_or_else(|| {
            perr(
                path,
                n,
                format!("unknown qos `{}` (expected LS, BE, Burstable or Guaranteed)", f[c_qos]),
            )
        })?;
        let create = || num(c_create, "creation_time");
        trace
            .jobs
            .push(alibaba_job(path, n, tenant, (gpus, milli), create, end - start)?);
    }
    trace.notes.push(format!(
        "Alibaba: LS = inference, BE = training, Burstable/Guaranteed = research; left out {no_gpu} pods without GPUs and {never_ran} that never ran"
    ));
    Ok(trace.finish())
}

/// Parses the generic CSV format (see the module docs).
pub fn parse_csv(path: &str, text: &str) -> Result<Trace, TraceError> {
    let mut lines = text.lines().enumerate();
    let (_, header) = lines.next().ok_or_else(|| perr(path, 1, "empty file"))?;
    let cols = csv_fields(header);
    if cols.len() < 4
        || cols[..4] != ["tenant", "submit_s", "gpus", "duration_s"]
        || (cols.len() == 5 && cols[4] != "kind")
        || cols.len() > 5
    {
        return Err(perr(
            path,
            1,
            "header must be `tenant,submit_s,gpus,duration_s` or `tenant,submit_s,gpus,duration_s,kind`",
        ));
    }
    let mut trace = Trace {
        source: format!("csv:{path}"),
        ..Trace::default()
    };
    for (i, line) in lines {
        let n = i + 1;
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        let f = csv_fields(line);
        if f.len() != cols.len() && f.len() != 4 {
            return Err(perr(
                path,
                n,
                format!("expected {} fields, found {}", cols.len(), f.len()),
            ));
        }
        let num = |c: usize, what: &str| -> Result<f64, TraceError> {
            match f[c].parse::<f64>() {
                Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
                _ => Err(perr(path, n, format!("{what} `{}` is not a non-negative number", f[c]))),
            }
        };
        let gpus = num(2, "gpus")?;
        if gpus <= 0.0 || gpus > 4096.0 {
            return Err(perr(path, n, format!("gpus {gpus} is out of range (0, 4096]")));
        }
        let kind = match f.get(4).copied().unwrap_or("training") {
            "training" | "" => Kind::Training,
            "inference" => Kind::Inference,
            other => {
                return Err(perr(
                    path,
                    n,
                    format!("kind `{other}` is neither training nor inference"),
                ))
            }
        };
        if f[0].is_empty() {
            return Err(perr(path, n, "tenant is empty"));
        }
        trace.jobs.push(Job {
            tenant: f[0].to_string(),
            kind,
            submit_ms: secs_to_ms(num(1, "submit_s")?).ok_or_else(|| perr(path, n, "submit_s out of range"))?,
            gpue: scale(1000, gpus),
            duration_ms: secs_to_ms(num(3, "duration_s")?)
                .ok_or_else(|| perr(path, n, "duration_s out of range"))?
                .max(1),
        });
    }
    Ok(trace.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generic_csv_parses_and_sorts() {
        let t = parse_csv(
            "t.csv",
            "tenant,submit_s,gpus,duration_s,kind\nb,10,0.5,60,inference\na,0,2,30\n",
        )
        .expect("parse");
        assert_eq!(t.jobs.len(), 2);
        assert_eq!(
            t.jobs[0],
            Job {
                tenant: "a".into(),
                kind: Kind::Training,
                submit_ms: 0,
                gpue: 2000,
                duration_ms: 30_000
            }
        );
        assert_eq!(t.jobs[1].gpue, 500);
        assert_eq!(t.jobs[1].kind, Kind::Inference);
    }

    #[test]
    fn generic_csv_errors_name_the_line() {
        let e = parse_csv("t.csv", "tenant,submit_s,gpus,duration_s\na,0,x,1\n").expect_err("bad");
        assert_eq!(e.to_string(), "t.csv:2: gpus `x` is not a non-negative number");
        let e = parse_csv("t.csv", "who,when\n").expect_err("bad header");
        assert!(e.to_string().starts_with("t.csv:1: header must be"), "{e}");
        let e = parse_csv("t.csv", "tenant,submit_s,gpus,duration_s\na,0,0,1\n").expect_err("zero gpus");
        assert!(e.to_string().contains("out of range"), "{e}");
    }

    #[test]
    fn philly_rows_use_throughputs_and_scale_missing_sizes() {
        let thr = parse_throughputs(
            "t.json",
            r#"{"v100": {"('A3C', 1)": {"null": 2.0}, "('A3C', 8)": {"null": 10.0, "x": [1]}}}"#,
        )
        .expect("json");
        let table = &thr["v100"];
        let text = "A3C\tcmd\t-n\t1\t100\t6.0\t1\nA3C\tcmd\t-n\t1\t100\t0\t16\n";
        let (jobs, scaled) = parse_philly_vc("x.trace", "abc", text, table).expect("parse");
        assert_eq!(scaled, 1);
        assert_eq!(jobs[0].tenant, "vc-abc");
        assert_eq!(
            (jobs[0].submit_ms, jobs[0].duration_ms, jobs[0].gpue),
            (6000, 50_000, 1000)
        );
        // 16 GPUs: 10 steps/s at 8 GPUs scaled to 20 steps/s.
        assert_eq!((jobs[1].duration_ms, jobs[1].gpue), (5000, 16_000));
        let e = parse_philly_vc("x.trace", "abc", "A3C\t1\t2\n", table).expect_err("short");
        assert!(e.to_string().contains("x.trace:1: expected 7"), "{e}");
        let e = parse_philly_vc("x.trace", "abc", "Nope\tc\t-n\t1\t100\t0\t1\n", table).expect_err("unknown");
        assert!(e.to_string().contains("no throughput for job type `Nope`"), "{e}");
    }

    #[test]
    fn alibaba_maps_qos_to_tenants_and_skips_what_never_ran() {
        let text = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n\
            p0,1,1,1,460,,LS,Running,10,110,20\n\
            p1,1,1,0,0,,BE,Running,0,10,0\n\
            p2,1,1,8,1000,,BE,Succeeded,5,1005,5\n\
            p3,1,1,1,1000,,BE,Pending,5,50,\n\
            p4,1,1,1,1000,,Burstable,Running,1,2,1\n";
        let t = parse_alibaba("a.csv", text).expect("parse");
        let got: Vec<(&str, Kind, u64, u64, u64)> = t
            .jobs
            .iter()
            .map(|j| (j.tenant.as_str(), j.kind, j.submit_ms, j.gpue, j.duration_ms))
            .collect();
        assert_eq!(
            got,
            [
                ("research", Kind::Training, 1000, 1000, 1000),
                ("training", Kind::Training, 5000, 8000, 1_000_000),
                ("inference", Kind::Inference, 10_000, 460, 90_000),
            ]
        );
        assert!(
            t.notes[0].contains("1 pods without GPUs and 1 that never ran"),
            "{:?}",
            t.notes
        );
        let e = parse_alibaba("a.csv", "name,num_gpu\n").expect_err("columns");
        assert!(e.to_string().contains("missing column `gpu_milli`"), "{e}");
    }

    #[test]
    fn time_scaling_compresses_both_clocks() {
        let mut t = parse_csv("t.csv", "tenant,submit_s,gpus,duration_s\na,100,1,10\n").expect("parse");
        t.scale_time(0.5);
        assert_eq!((t.jobs[0].submit_ms, t.jobs[0].duration_ms), (50_000, 5_000));
    }
}
