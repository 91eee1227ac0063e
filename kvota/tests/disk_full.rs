//! A control-plane node whose disk fills up, with a real file system that runs out of
//! space (a small tmpfs; needs root to mount it, so the test says so and skips
//! otherwise): below its free-space reserve the node is not ready and says why, with a
//! metric; when writes fail its Raft core stops and the process exits non-zero with a
//! clear line (so its supervisor restarts it); once space returns it starts again with
//! every acknowledged write.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvota_client::client::Client;
use kvota_proto::v1;
use kvota_testkit::procs::free_ports;

struct Mount(PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

fn mount_tmpfs(dir: &Path, size: &str) -> Option<Mount> {
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
        .arg(dir)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    ok.then(|| Mount(dir.to_path_buf()))
}

fn free_bytes(dir: &Path) -> u64 {
    let s = rustix::fs::statvfs(dir).expect("statvfs");
    s.f_bavail * s.f_frsize
}

/// Writes zeros into `file` until the file system has at most `left` bytes free.
fn fill(file: &Path, left: u64) {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(file)
        .expect("open filler");
    let chunk = vec![0u8; 64 << 10];
    let dir = file.parent().expect("dir");
    while free_bytes(dir) > left {
        let n = usize::try_from((free_bytes(dir) - left).min(chunk.len() as u64)).expect("small");
        if f.write_all(&chunk[..n.max(1)]).is_err() {
            break;
        }
    }
    let _ = f.sync_all();
}

struct Node {
    rpc: String,
    http: String,
    raft: String,
    dir: PathBuf,
    log: PathBuf,
}

impl Node {
    fn start(&self, init: bool) -> Child {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvota"));
        cmd.args([
            "server",
            "--id",
            "1",
            "--listen",
            &self.rpc,
            "--raft-listen",
            &self.raft,
            "--http",
            &self.http,
            "--min-free-disk-mb",
            "4",
        ])
        .arg("--data-dir")
        .arg(&self.dir)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.log)
                .map(Stdio::from)
                .expect("log"),
        );
        if init {
            cmd.arg("--init");
        }
        cmd.spawn().expect("spawn kvota server")
    }

    async fn readyz(&self) -> Option<(u16, String)> {
        kvota_testkit::http_get(&kvota_tls::connect::Connector::new(None), &self.http, "/readyz")
            .await
            .ok()
    }
}

async fn register(c: &Client, name: &str) -> Result<(), tonic::Status> {
    let req = v1::RegisterRequest {
        cluster: name.into(),
        capacity: vec![v1::Resource {
            name: "nvidia.com/gpu".into(),
            quantity_milli: 8_000,
        }],
        labels: Default::default(),
    };
    c.call(|ch| {
        let req = req.clone();
        async move { Ok(Client::member(ch).register(req).await?.into_inner()) }
    })
    .await
    .map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_readiness_then_stops_the_node_and_it_recovers_when_space_returns() {
    let tmp = tempfile::tempdir().expect("tmp");
    let Some(mount) = mount_tmpfs(tmp.path(), "24m") else {
        eprintln!("SKIPPED: mounting a tmpfs needs root (this test fills a real file system); run the suite as root, as CI does");
        return;
    };
    let ports = free_ports(3);
    let node = Node {
        rpc: format!("127.0.0.1:{}", ports[0]),
        http: format!("127.0.0.1:{}", ports[1]),
        raft: format!("127.0.0.1:{}", ports[2]),
        dir: mount.0.join("data"),
        log: tmp.path().with_extension("server.log"),
    };
    let log = || std::fs::read_to_string(&node.log).unwrap_or_default();
    let mut child = node.start(true);
    let client = Client::new(std::slice::from_ref(&node.rpc)).expect("client");
    client.set_call_timeout(Duration::from_secs(2));
    let yaml = kvota_fairness::policy::Policy::article_example_yaml().to_string();
    let deadline = Instant::now() + Duration::from_secs(20);
    while client
        .call(|ch| {
            let yaml = yaml.clone();
            async move {
                Ok(Client::admin(ch)
                    .apply_policy(v1::PolicyRequest { yaml })
                    .await?
                    .into_inner())
            }
        })
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "no policy applied\n{}", log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(node.readyz().await.map(|r| r.0), Some(200));

    // Below the reserve (4 MiB): not ready, and it says why.
    fill(&mount.0.join("filler-1"), 2 << 20);
    let deadline = Instant::now() + Duration::from_secs(5);
    let why = loop {
        match node.readyz().await {
            Some((503, body)) => break body,
            other => assert!(Instant::now() < deadline, "still ready with 2 MiB free: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(why.contains("below its free-space reserve"), "{why}");
    let (_, metrics) = kvota_testkit::http_get(&kvota_tls::connect::Connector::new(None), &node.http, "/metrics")
        .await
        .expect("metrics");
    assert!(metrics.contains("kvota_disk_low 1"), "{metrics}");
    assert!(log().contains("disk is nearly full"), "{}", log());

    // Full: writes fail, the Raft core stops, the process exits non-zero and says why.
    fill(&mount.0.join("filler-2"), 0);
    let mut acked = Vec::new();
    let mut exited = None;
    for i in 0..2_000 {
        if let Some(status) = child.try_wait().expect("wait") {
            exited = Some(status);
            break;
        }
        let name = format!("c{i}");
        if register(&client, &name).await.is_ok() {
            acked.push(name);
        }
    }
    let status = match exited {
        Some(s) => s,
        None => {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if let Some(s) = child.try_wait().expect("wait") {
                    break s;
                }
                assert!(
                    Instant::now() < deadline,
                    "the node did not stop on a full disk\n{}",
                    log()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert!(!status.success(), "exited {status}");
    let text = log();
    assert!(
        text.contains("the Raft core stopped") && text.contains("No space left"),
        "{text}"
    );

    // Space returns; the supervisor (here, the test) starts it again: every
    // acknowledged registration is there.
    for f in ["filler-1", "filler-2"] {
        std::fs::remove_file(mount.0.join(f)).expect("free space");
    }
    let mut child = node.start(false);
    let deadline = Instant::now() + Duration::from_secs(20);
    while node.readyz().await.map(|r| r.0) != Some(200) {
        assert!(Instant::now() < deadline, "not ready after space returned\n{}", log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let clusters = client
        .call(|ch| async move { Ok(Client::admin(ch).list_clusters(v1::Empty {}).await?.into_inner()) })
        .await
        .expect("clusters");
    let names: Vec<&str> = clusters.clusters.iter().map(|c| c.cluster.as_str()).collect();
    for a in &acked {
        assert!(names.contains(&a.as_str()), "acknowledged {a} lost; have {names:?}");
    }
    register(&client, "after").await.expect("writes work again");
    let _ = child.kill();
    let _ = child.wait();
    eprintln!(
        "{} registrations acknowledged before the disk filled; all kept",
        acked.len()
    );
}
