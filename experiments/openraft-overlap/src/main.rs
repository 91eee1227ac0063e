//! Does openraft 0.10's non-blocking append make a commit cheaper than 0.9's on this disk?
//!
//! Three in-process nodes per run, each with a log file on the same disk, one `fdatasync`
//! per append; clients write through the leader for a fixed time. Four setups, measured
//! back to back and interleaved, `--rounds` times:
//!
//! - `0.9 inline`: openraft 0.9.25 with the flush inside `append`, as kvota runs today;
//! - `0.9 background`: the same with the flush on a thread (0.9 still waits for it
//!   before replicating, so this shows the store alone changes nothing);
//! - `0.10 inline`: openraft 0.10.0-alpha.37, flush inside `append` (0.10 awaits `append`
//!   itself, so this cannot overlap either);
//! - `0.10 background`: flush on a thread, so replication starts while the leader
//!   flushes: the overlap issue 19 asks about.

/// Defines `cluster(dir, flush)` in a version's module: the same start-up for both
/// openraft versions, written once (`$or` is the crate, `$raft` its `Raft` type; the
/// module provides `Router`, `Log`, `LogStore`, `Net` and `Machine`).
#[macro_export]
macro_rules! cluster_fn {
    ($or:ident, $raft:ty) => {
        /// Starts three nodes with their logs in `dir`, elects node 1, and returns a writer that
        /// proposes through the leader.
        pub async fn cluster(
            dir: &std::path::Path,
            flush: Flush,
        ) -> Result<$crate::Writer, String> {
            let config = Arc::new(
                $or::Config {
                    cluster_name: "overlap".into(),
                    heartbeat_interval: 50,
                    election_timeout_min: 150,
                    election_timeout_max: 300,
                    snapshot_policy: $or::SnapshotPolicy::Never,
                    max_payload_entries: 32,
                    ..Default::default()
                }
                .validate()
                .map_err(|e| e.to_string())?,
            );
            let router: Router = Arc::default();
            let mut nodes = BTreeMap::new();
            for id in 1..=3u64 {
                let (d, file) = LogFile::for_node(dir, id, flush)?;
                let log = LogStore(Arc::new(Log {
                    entries: Mutex::default(),
                    vote: Mutex::default(),
                    purged: Mutex::default(),
                    file,
                    dir: d,
                }));
                let raft = <$raft>::new(
                    id,
                    Arc::clone(&config),
                    Net {
                        router: Arc::clone(&router),
                    },
                    log,
                    Machine::default(),
                )
                .await
                .map_err(|e| e.to_string())?;
                router.lock().unwrap().insert(id, raft);
                nodes.insert(id, BasicNode::default());
            }
            let leader = router.lock().unwrap()[&1].clone();
            leader.initialize(nodes).await.map_err(|e| e.to_string())?;
            leader
                .wait(Some(std::time::Duration::from_secs(10)))
                .current_leader(1, "node 1 leads")
                .await
                .map_err(|e| e.to_string())?;
            let all: Vec<$raft> = router.lock().unwrap().values().cloned().collect();
            Ok($crate::Writer::new(
                move |value| {
                    let leader = leader.clone();
                    async move {
                        leader
                            .client_write(Req {
                                value,
                                pad: $crate::PAD.to_string(),
                            })
                            .await
                            .map(|_| ())
                            .map_err(|e| e.to_string())
                    }
                },
                move || {
                    let all = all.clone();
                    async move {
                        for r in all {
                            let _ = r.shutdown().await;
                        }
                    }
                },
            ))
        }
    };
}

mod disk;
mod v09;
mod v10;

use std::fmt;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use disk::Flush;

/// One client request: a value to add and padding to the size of a usage report entry.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Req {
    pub value: u64,
    pub pad: String,
}

impl fmt::Display for Req {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Req({})", self.value)
    }
}

/// Padding that makes an entry about the size of a usage report's (a few hundred bytes).
pub const PAD: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

type BoxFut<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Proposes through one cluster's leader, whichever openraft it runs.
pub struct Writer {
    write: Arc<dyn Fn(u64) -> BoxFut<Result<(), String>> + Send + Sync>,
    stop: Box<dyn FnOnce() -> BoxFut<()> + Send>,
}

impl Writer {
    pub fn new<W, WF, S, SF>(write: W, stop: S) -> Self
    where
        W: Fn(u64) -> WF + Send + Sync + 'static,
        WF: Future<Output = Result<(), String>> + Send + 'static,
        S: FnOnce() -> SF + Send + 'static,
        SF: Future<Output = ()> + Send + 'static,
    {
        Writer {
            write: Arc::new(move |v| Box::pin(write(v))),
            stop: Box::new(move || Box::pin(stop())),
        }
    }
}

/// What one load phase measured.
struct Phase {
    ops_per_s: f64,
    p50: Duration,
    p99: Duration,
    failed: u64,
    /// Log entries per `fdatasync`, over all three nodes.
    per_sync: f64,
}

async fn load(w: &Writer, clients: usize, secs: f64) -> Phase {
    let warm = Duration::from_millis(500);
    let deadline = Instant::now() + warm + Duration::from_secs_f64(secs);
    let start = Instant::now() + warm;
    let mut tasks = Vec::new();
    let (records0, syncs0) = (disk::RECORDS.load(Relaxed), disk::SYNCS.load(Relaxed));
    for c in 0..clients {
        let write = Arc::clone(&w.write);
        tasks.push(tokio::spawn(async move {
            let (mut lat, mut failed) = (Vec::new(), 0u64);
            let mut v = c as u64;
            while Instant::now() < deadline {
                let t = Instant::now();
                let ok = write(v).await.is_ok();
                v += 1;
                if t >= start {
                    if ok {
                        lat.push(t.elapsed());
                    } else {
                        failed += 1;
                    }
                }
            }
            (lat, failed)
        }));
    }
    let (mut lat, mut failed) = (Vec::new(), 0);
    for t in tasks {
        let (l, f) = t.await.expect("a client task panicked");
        lat.extend(l);
        failed += f;
    }
    let records = disk::RECORDS.load(Relaxed) - records0;
    let syncs = (disk::SYNCS.load(Relaxed) - syncs0).max(1);
    lat.sort();
    let at = |q: f64| {
        lat.get(((lat.len() as f64 - 1.0) * q) as usize)
            .copied()
            .unwrap_or_default()
    };
    Phase {
        ops_per_s: lat.len() as f64 / secs,
        p50: at(0.5),
        p99: at(0.99),
        failed,
        per_sync: records as f64 / syncs as f64,
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Version {
    V09,
    V10,
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Version::V09 => "0.9.25",
            Version::V10 => "0.10.0-alpha.37",
        })
    }
}

struct Args {
    seconds: f64,
    rounds: usize,
    clients: Vec<usize>,
    dir: Option<PathBuf>,
}

const HELP: &str = "\
openraft-overlap: commits per second of three in-process openraft nodes writing real
log files (one fdatasync per append), openraft 0.9.25 against 0.10.0-alpha.37, the
leader's flush inline or on a flusher thread.

Usage: openraft-overlap [--seconds S] [--rounds N] [--clients 1,64] [--dir DIR]

  --seconds S     measured time per setup and client count (default 5; 0.5 s warm-up)
  --rounds N      how many times to measure every setup, interleaved (default 3)
  --clients LIST  concurrent clients, comma-separated (default 1,64)
  --dir DIR       where the log files go (default: a temporary directory; it must be
                  on the disk you want to measure)
";

fn parse() -> Result<Args, String> {
    let mut a = Args {
        seconds: 5.0,
        rounds: 3,
        clients: vec![1, 64],
        dir: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            print!("{HELP}");
            std::process::exit(0);
        }
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value (see --help)"))?;
        match flag.as_str() {
            "--seconds" => {
                a.seconds = value.parse().ok().filter(|s: &f64| *s > 0.0 && *s <= 600.0).ok_or_else(|| {
                    format!("--seconds {value:?}: expected a number of seconds above 0 and at most 600")
                })?;
            }
            "--rounds" => {
                a.rounds = value
                    .parse()
                    .ok()
                    .filter(|n| (1..=100).contains(n))
                    .ok_or_else(|| {
                        format!("--rounds {value:?}: expected a whole number from 1 to 100")
                    })?;
            }
            "--clients" => {
                a.clients = value
                    .split(',')
                    .map(|c| c.trim().parse().ok().filter(|n| (1..=1024).contains(n)))
                    .collect::<Option<Vec<usize>>>()
                    .ok_or_else(|| {
                        format!(
                            "--clients {value:?}: expected numbers from 1 to 1024, comma-separated"
                        )
                    })?;
            }
            "--dir" => a.dir = Some(PathBuf::from(value)),
            other => return Err(format!("unknown flag {other:?} (see --help)")),
        }
    }
    Ok(a)
}

/// The disk's own cost: p50 of a 300-byte append plus `fdatasync`.
fn disk_p50(dir: &std::path::Path) -> std::io::Result<Duration> {
    use std::io::Write;
    let path = dir.join("probe");
    let mut f = std::fs::File::options()
        .create(true)
        .append(true)
        .open(&path)?;
    let mut lat = Vec::new();
    for _ in 0..300 {
        let t = Instant::now();
        f.write_all(&[7u8; 300])?;
        f.sync_data()?;
        lat.push(t.elapsed());
    }
    std::fs::remove_file(path)?;
    lat.sort();
    Ok(lat[lat.len() / 2])
}

fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1e3)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("openraft-overlap: {e}");
            std::process::exit(2);
        }
    };
    let tmp;
    let base = match &args.dir {
        Some(d) => d.clone(),
        None => {
            tmp = match tempfile::tempdir() {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("openraft-overlap: cannot create a temporary directory ({e}); pass --dir");
                    std::process::exit(1);
                }
            };
            tmp.path().to_path_buf()
        }
    };
    match disk_p50(&base) {
        Ok(p) => println!(
            "disk: 300-byte append + fdatasync, p50 {} ms, in {}",
            ms(p),
            base.display()
        ),
        Err(e) => {
            eprintln!("openraft-overlap: cannot write to {}: {e}", base.display());
            std::process::exit(1);
        }
    }
    let setups = [
        (Version::V09, Flush::Inline),
        (Version::V09, Flush::Background),
        (Version::V10, Flush::Inline),
        (Version::V10, Flush::Background),
    ];
    // results[setup][clients index] = ops/s per round
    let mut results = vec![vec![Vec::new(); args.clients.len()]; setups.len()];
    println!("| round | openraft | flush | clients | commits/s | p50 ms | p99 ms | failed | entries per fdatasync |");
    println!("|---|---|---|---:|---:|---:|---:|---:|---:|");
    let mut run = 0;
    for round in 1..=args.rounds {
        for (s, &(version, flush)) in setups.iter().enumerate() {
            run += 1;
            let dir = base.join(format!("run{run}"));
            let writer = match version {
                Version::V09 => v09::cluster(&dir, flush).await,
                Version::V10 => v10::cluster(&dir, flush).await,
            };
            let writer = match writer {
                Ok(w) => w,
                Err(e) => {
                    eprintln!("openraft-overlap: starting {version} ({flush:?}) failed: {e}");
                    std::process::exit(1);
                }
            };
            for (ci, &clients) in args.clients.iter().enumerate() {
                let p = load(&writer, clients, args.seconds).await;
                println!(
                    "| {round} | {version} | {flush:?} | {clients} | {:.0} | {} | {} | {} | {:.1} |",
                    p.ops_per_s,
                    ms(p.p50),
                    ms(p.p99),
                    p.failed,
                    p.per_sync
                );
                results[s][ci].push(p.ops_per_s);
            }
            (writer.stop)().await;
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    println!();
    println!(
        "medians over {} rounds (commits/s; ratio to 0.9.25 inline):",
        args.rounds
    );
    for (ci, &clients) in args.clients.iter().enumerate() {
        let median = |v: &Vec<f64>| {
            let mut v = v.clone();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let base_ops = median(&results[0][ci]);
        for (s, &(version, flush)) in setups.iter().enumerate() {
            let m = median(&results[s][ci]);
            println!(
                "  {clients:>4} clients  {:<16} {:<10} {m:>8.0}  {:.2}",
                version.to_string(),
                format!("{flush:?}"),
                m / base_ops
            );
        }
    }
}
