//! Test-only helpers shared by kvota's suites (a dev-dependency, never in a release
//! build): [`Pki`], a federation CA that writes certificates for any party, and
//! [`Cluster`], a control plane of real nodes in the test's process (real sockets, real
//! data directories, TLS optional), and [`fake_raft`], a fake node on the Raft port that
//! answers as a test says.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvota_client::tls::GrpcTls;
use kvota_control_plane::server::{start, Listeners, ServerConfig, ServerHandle};
use kvota_control_plane::types::Node;
use kvota_fairness::federation::Federation;
use kvota_tls::issue::{new_ca, Ca, Issued, Kind};
use kvota_tls::Role;
use tokio::net::TcpListener;

pub mod fake_raft;

/// A federation CA in a temporary directory, issuing certificates as files.
pub struct Pki {
    dir: tempfile::TempDir,
    ca: Ca,
    /// The CA certificate, PEM.
    pub ca_pem: String,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pki")
            .field("dir", &self.dir.path())
            .finish_non_exhaustive()
    }
}

/// Paths of one party's files.
#[derive(Clone, Debug)]
pub struct Files {
    /// The CA bundle.
    pub ca: PathBuf,
    /// The certificate.
    pub cert: PathBuf,
    /// The key.
    pub key: PathBuf,
}

impl Pki {
    /// A new CA of trust domain `trust_domain`.
    pub fn new(trust_domain: &str) -> Pki {
        let dir = tempfile::tempdir().expect("temporary directory");
        let ca = new_ca(trust_domain, 30).expect("make a CA");
        std::fs::write(dir.path().join("ca.crt"), &ca.cert_pem).expect("write ca.crt");
        Pki {
            ca: Ca::from_pem(&ca.cert_pem, &ca.key_pem).expect("load the CA"),
            ca_pem: ca.cert_pem,
            dir,
        }
    }

    /// The directory holding the files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The CA.
    pub fn ca(&self) -> &Ca {
        &self.ca
    }

    /// Writes a certificate for `role`/`name` and returns its files.
    pub fn files(&self, role: Role, name: &str) -> Files {
        let issued = self.ca.issue(&Kind::Party(role), name, &[], &[], 30).expect("issue");
        self.write(&format!("{role}-{name}"), &issued)
    }

    /// Writes `issued` as `<stem>.crt` and `<stem>.key`.
    pub fn write(&self, stem: &str, issued: &Issued) -> Files {
        let cert = self.dir.path().join(format!("{stem}.crt"));
        let key = self.dir.path().join(format!("{stem}.key"));
        std::fs::write(&cert, &issued.cert_pem).expect("write certificate");
        std::fs::write(&key, &issued.key_pem).expect("write key");
        Files {
            ca: self.dir.path().join("ca.crt"),
            cert,
            key,
        }
    }

    /// A loaded party of `role`/`name`.
    pub fn party(&self, role: Role, name: &str) -> GrpcTls {
        let f = self.files(role, name);
        GrpcTls::from_files(&f.ca, &f.cert, &f.key).expect("load party files")
    }
}

fn idx(id: u64) -> usize {
    usize::try_from(id - 1).expect("small id")
}

/// A control plane of `n` nodes in this process.
pub struct Cluster {
    /// Each node's data directory.
    pub dirs: Vec<PathBuf>,
    /// The running nodes (`None`: stopped).
    pub nodes: Vec<Option<ServerHandle>>,
    /// The members as initialized.
    pub members: BTreeMap<u64, Node>,
    tweak: fn(&mut ServerConfig),
    tls: Vec<Option<GrpcTls>>,
    /// The temporary directory holding the data directories.
    pub tmp: tempfile::TempDir,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("members", &self.members)
            .finish_non_exhaustive()
    }
}

/// A configuration with fast ticks, for tests.
pub fn config(id: u64, dir: PathBuf, m: &Node) -> ServerConfig {
    let mut c = ServerConfig::new(id, dir, m.rpc_addr.clone(), m.http_addr.clone(), m.raft_addr.clone());
    c.tick_ms = 200;
    c
}

/// A node's addresses from its listeners.
pub fn node_of(l: &Listeners) -> Node {
    Node {
        rpc_addr: l.api.local_addr().expect("addr").to_string(),
        http_addr: l.http.local_addr().expect("addr").to_string(),
        raft_addr: l.raft.local_addr().expect("addr").to_string(),
    }
}

impl Cluster {
    /// `n` plain-text nodes with test defaults.
    pub async fn start(n: u64) -> Cluster {
        Cluster::start_with(n, None, |_| {}).await
    }

    /// `n` nodes; with `pki`, each has a node certificate and TLS on every port; `tweak`
    /// adjusts each node's configuration (at every start and restart).
    pub async fn start_with(n: u64, pki: Option<&Pki>, tweak: fn(&mut ServerConfig)) -> Cluster {
        let tmp = tempfile::tempdir().expect("temporary directory");
        let mut listeners = Vec::new();
        let mut members = BTreeMap::new();
        for id in 1..=n {
            let l = Listeners::loopback().await.expect("bind loopback");
            members.insert(id, node_of(&l));
            listeners.push(l);
        }
        let tls: Vec<Option<GrpcTls>> = (1..=n)
            .map(|id| pki.map(|p| p.party(Role::Node, &id.to_string())))
            .collect();
        let mut nodes = Vec::new();
        let mut dirs = Vec::new();
        for (i, l) in listeners.into_iter().enumerate() {
            let id = i as u64 + 1;
            let dir = tmp.path().join(format!("node{id}"));
            let mut cfg = config(id, dir.clone(), &members[&id]);
            cfg.tls = tls[i].clone();
            tweak(&mut cfg);
            if id == 1 {
                cfg.initial_members = Some(members.clone());
            }
            nodes.push(Some(start(cfg, l).await.expect("start node")));
            dirs.push(dir);
        }
        Cluster {
            dirs,
            nodes,
            members,
            tweak,
            tls,
            tmp,
        }
    }

    /// Changes how each node's configuration is adjusted at its next (re)start.
    pub fn set_tweak(&mut self, tweak: fn(&mut ServerConfig)) {
        self.tweak = tweak;
    }

    /// Every node's gRPC API address.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.values().map(|m| m.rpc_addr.clone()).collect()
    }

    /// The running node `id`.
    pub fn node(&self, id: u64) -> &ServerHandle {
        self.nodes[idx(id)].as_ref().expect("node running")
    }

    /// The leader's id, waiting up to `within` for one.
    pub async fn leader(&self, within: Duration) -> u64 {
        let deadline = Instant::now() + within;
        loop {
            for n in self.nodes.iter().flatten() {
                let m = n.raft().metrics().borrow().clone();
                if m.state == openraft::ServerState::Leader {
                    return n.id;
                }
            }
            assert!(Instant::now() < deadline, "no leader within {within:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops node `id`.
    pub async fn stop(&mut self, id: u64) {
        if let Some(n) = self.nodes[idx(id)].take() {
            n.shutdown().await;
        }
    }

    /// Starts node `id` again on its addresses and directory.
    pub async fn restart(&mut self, id: u64) {
        if let Err(e) = self.try_restart(id).await {
            panic!("restart node {id}: {e}");
        }
    }

    /// Starts node `id` again on its addresses and directory; the error of a start that
    /// fails for another reason than a port or the directory's lock still held.
    pub async fn try_restart(&mut self, id: u64) -> Result<(), String> {
        let m = self.members[&id].clone();
        // Rebind the same ports (the members' addresses are part of the replicated state)
        // and reopen the directory. In one process, the stopped instance's last blocking
        // tasks may still hold the data directory's lock for a moment (a real restart is a new
        // process, whose exit released it), so retry for a few seconds.
        let mut tries = 0;
        let node = loop {
            let api = TcpListener::bind(&m.rpc_addr).await;
            let raft = TcpListener::bind(&m.raft_addr).await;
            let http = TcpListener::bind(&m.http_addr).await;
            let (attempt, transient) = match (api, raft, http) {
                (Ok(api), Ok(raft), Ok(http)) => {
                    let mut cfg = config(id, self.dirs[idx(id)].clone(), &m);
                    cfg.tls = self.tls[idx(id)].clone();
                    (self.tweak)(&mut cfg);
                    match start(cfg, Listeners { api, raft, http }).await {
                        Ok(n) => (Ok(n), false),
                        Err(e) => {
                            let e = format!("{e:#}");
                            let lock = e.contains("lock");
                            (Err(e), lock)
                        }
                    }
                }
                (a, r, h) => (
                    Err(format!("rebind {m:?}: {:?} {:?} {:?}", a.err(), r.err(), h.err())),
                    true,
                ),
            };
            match attempt {
                Ok(n) => break n,
                Err(_) if transient && tries < 50 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(e),
            }
        };
        self.nodes[idx(id)] = Some(node);
        Ok(())
    }

    /// Node `id`'s applied federation.
    pub async fn federation(&self, id: u64) -> Federation {
        self.node(id).ctx.state.read().await.federation.clone()
    }

    /// Waits until node `id` has applied its whole log (a restarted node replays it
    /// after it is elected), then returns its federation.
    pub async fn caught_up(&self, id: u64, within: Duration) -> Federation {
        let deadline = Instant::now() + within;
        loop {
            let m = self.node(id).raft().metrics().borrow().clone();
            let (applied, last) = (m.last_applied.map_or(0, |l| l.index), m.last_log_index.unwrap_or(0));
            if applied >= last {
                return self.federation(id).await;
            }
            assert!(
                Instant::now() < deadline,
                "node {id} applied {applied} of {last} entries within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until every running node has applied the same log index, then returns
    /// their federations.
    pub async fn converged(&self, within: Duration) -> Vec<Federation> {
        let deadline = Instant::now() + within;
        loop {
            let applied: Vec<u64> = self
                .nodes
                .iter()
                .flatten()
                .map(|n| n.raft().metrics().borrow().last_applied.map_or(0, |l| l.index))
                .collect();
            if applied.windows(2).all(|w| w[0] == w[1]) {
                let mut out = Vec::new();
                for n in self.nodes.iter().flatten() {
                    out.push(self.federation(n.id).await);
                }
                if out.windows(2).all(|w| w[0] == w[1]) {
                    return out;
                }
            }
            assert!(Instant::now() < deadline, "nodes did not converge: applied {applied:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until every running node's replicated state is at feature level `level` or
    /// above (the leader raises it once every member said it supports it).
    pub async fn feature_level(&self, level: kvota_control_plane::feature::FeatureLevel, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let mut levels = Vec::new();
            for n in self.nodes.iter().flatten() {
                levels.push(n.ctx.state.read().await.feature_level);
            }
            if levels.iter().all(|l| *l >= level) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "feature level {level} not reached within {within:?}: {levels:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops every node.
    pub async fn shutdown(mut self) {
        for id in 1..=self.nodes.len() as u64 {
            self.stop(id).await;
        }
    }
}

/// Registers member cluster `cluster` with `gpus_milli` thousandths of `nvidia.com/gpu`
/// through `c` (as that cluster would); the epoch of the lease it is answered with.
pub async fn register_gpus(c: &kvota_client::client::Client, cluster: &str, gpus_milli: u64) -> u64 {
    use kvota_proto::v1;
    let reg = v1::RegisterRequest {
        cluster: cluster.into(),
        capacity: vec![v1::Resource {
            name: "nvidia.com/gpu".into(),
            quantity_milli: gpus_milli,
        }],
        labels: [("zone".to_string(), cluster.to_string())].into(),
    };
    c.call(|ch| {
        let reg = reg.clone();
        async move {
            Ok(kvota_client::client::Client::member(ch)
                .register(reg)
                .await?
                .into_inner())
        }
    })
    .await
    .expect("register")
    .lease
    .expect("a lease")
    .epoch
}

/// One usage report of `cluster` through `c`: `(tenant, used milli-GPUe x ms, in use
/// milli-GPUe, waiting milli-GPUe)` per tenant, metered over `window` (Unix ms; `(0, 0)`:
/// none), acknowledging lease `epoch`.
pub async fn report_usage(
    c: &kvota_client::client::Client,
    cluster: &str,
    seq: u64,
    epoch: u64,
    tenants: &[(&str, u64, u64, u64)],
    window: (u64, u64),
) {
    use kvota_proto::v1;
    let report = v1::ReportRequest {
        cluster: cluster.into(),
        seq,
        held_epoch: epoch,
        tenants: tenants
            .iter()
            .map(|&(tenant, used, inuse, pending)| v1::TenantUsage {
                tenant: tenant.into(),
                used_milli_gpue_ms: used,
                inuse_milli_gpue: inuse,
                pending_milli_gpue: pending,
                largest_pending_milli_gpue: 0,
                borrowed_milli_gpue: 0,
            })
            .collect(),
        capacity: vec![],
        evictions: vec![],
        decisions: vec![],
        window_start_ms: window.0,
        window_end_ms: window.1,
        gap_in_reply: false,
        status: None,
    };
    send_report(c, &report).await.expect("report");
}

/// Sends `report` through the member service, as an agent does.
pub async fn send_report(
    c: &kvota_client::client::Client,
    report: &kvota_proto::v1::ReportRequest,
) -> Result<kvota_proto::v1::ReportReply, tonic::Status> {
    c.call(|ch| {
        let r = report.clone();
        async move { Ok(kvota_client::client::Client::member(ch).report(r).await?.into_inner()) }
    })
    .await
}

/// A connector that verifies servers as `party` does (its CA, node identities) but
/// presents no certificate: what a kubelet probe or a stranger with the CA looks like.
pub fn anonymous(party: &GrpcTls) -> kvota_tls::connect::Connector {
    let cfg = rustls::ClientConfig::builder_with_provider(kvota_tls::provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .dangerous()
        .with_custom_certificate_verifier(std::sync::Arc::new(kvota_tls::verify::ServerIdentityVerifier::new(
            party.source().clone(),
            kvota_tls::Expect::AnyNode,
        )))
        .with_no_client_auth();
    kvota_tls::connect::Connector::new(Some(std::sync::Arc::new(cfg)))
}

/// `GET path` over HTTP/1.1 through `connector` (plain or TLS): status code and body.
/// Errors (refused connection, failed handshake) are `Err` with the reason.
pub async fn http_get(
    connector: &kvota_tls::connect::Connector,
    addr: &str,
    path: &str,
) -> Result<(u16, String), String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut io = connector.dial(addr).await.map_err(|e| e.to_string())?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: kvota\r\nConnection: close\r\n\r\n");
    io.write_all(req.as_bytes()).await.map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), io.read_to_end(&mut buf))
        .await
        .map_err(|_| "no answer in 5 s".to_string())?
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&buf).to_string();
    let code = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("not HTTP: {text:?}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((code, body))
}

/// Real `kvota server` processes: addresses, command lines, and a guard that kills them.
pub mod procs {
    use std::path::{Path, PathBuf};
    use std::process::{Child, Command, Stdio};
    use std::time::Duration;

    /// Child processes, killed (SIGKILL) when the guard drops, however the test ends.
    #[derive(Debug, Default)]
    pub struct Procs(pub Vec<Option<Child>>);

    impl Drop for Procs {
        fn drop(&mut self) {
            for c in self.0.iter_mut().flatten() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    impl Procs {
        /// A guard over `children`.
        pub fn of(children: impl IntoIterator<Item = Child>) -> Procs {
            Procs(children.into_iter().map(Some).collect())
        }

        /// Adds a child.
        pub fn push(&mut self, child: Child) {
            self.0.push(Some(child));
        }

        /// Process `i` (0-based), if it has not been killed through the guard.
        pub fn get(&mut self, i: usize) -> Option<&mut Child> {
            self.0.get_mut(i).and_then(Option::as_mut)
        }

        /// SIGKILLs process `i` (0-based) and waits for it.
        pub fn kill(&mut self, i: usize) {
            if let Some(mut c) = self.0.get_mut(i).and_then(Option::take) {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    /// Node `addr`'s `Status` (its gRPC API address), or `None` if it does not answer
    /// within `within`.
    pub async fn status(addr: &str, within: Duration) -> Option<kvota_proto::v1::StatusReply> {
        use kvota_client::client::Client;
        let c = Client::new(&[addr.to_string()]).ok()?;
        let call =
            c.call(|ch| async move { Ok(Client::admin(ch).status(kvota_proto::v1::Empty {}).await?.into_inner()) });
        tokio::time::timeout(within, call).await.ok()?.ok()
    }

    /// The index in `rpcs` (gRPC API addresses) of the node that says it leads, waiting
    /// up to `within` for one; each node gets `ask` to answer.
    pub async fn leader(rpcs: &[String], ask: Duration, within: Duration) -> usize {
        let deadline = std::time::Instant::now() + within;
        loop {
            for (i, a) in rpcs.iter().enumerate() {
                if status(a, ask).await.is_some_and(|s| s.role == "leader") {
                    return i;
                }
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no leader elected within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `n` distinct free loopback ports for servers a test starts as processes.
    ///
    /// A port is free only until something else binds it, and the process that will
    /// listen on it starts a while later. Ports the kernel hands out (`bind(:0)`, and the
    /// source port of every outgoing connection other tests open meanwhile) come from
    /// the ephemeral range, so a port picked there can be taken in between: that was an
    /// occasional "Address already in use" in these tests. So ports are taken below the
    /// ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`), where only tests pick
    /// ports explicitly; each process starts at its own offset and walks on, skipping any
    /// port it cannot bind now, and all `n` are held bound until every one is chosen.
    pub fn free_ports(n: usize) -> Vec<u16> {
        use std::sync::atomic::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
        let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|s| s.split_whitespace().next().and_then(|w| w.parse::<u32>().ok()))
            .unwrap_or(32_768);
        const FLOOR: u32 = 10_000;
        if low < FLOOR + 2_000 {
            // No room below the ephemeral range: let the kernel choose.
            let held: Vec<std::net::TcpListener> = (0..n)
                .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind port 0"))
                .collect();
            return held.iter().map(|l| l.local_addr().expect("addr").port()).collect();
        }
        let span = low - FLOOR;
        let _ = NEXT.compare_exchange(
            u32::MAX,
            (std::process::id().wrapping_mul(7_919)) % span,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
        let mut held = Vec::with_capacity(n);
        let mut tries = 0u32;
        while held.len() < n {
            assert!(tries < span, "no free loopback port below {low}");
            tries += 1;
            let port = FLOOR + NEXT.fetch_add(1, Ordering::SeqCst) % span;
            let Ok(port) = u16::try_from(port) else { continue };
            if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
                held.push(l);
            }
        }
        held.iter().map(|l| l.local_addr().expect("addr").port()).collect()
    }

    /// One server's addresses and directory.
    #[derive(Clone, Debug)]
    pub struct ServerSpec {
        /// Node id (1-based).
        pub id: u64,
        /// gRPC API address.
        pub rpc: String,
        /// Raft address.
        pub raft: String,
        /// HTTP address.
        pub http: String,
        /// Data directory (its log goes beside it, `<dir>.log`).
        pub dir: PathBuf,
    }

    impl ServerSpec {
        /// The `--member` value naming this server.
        pub fn member(&self) -> String {
            format!("{}={},{},{}", self.id, self.rpc, self.http, self.raft)
        }

        /// Where its stderr goes.
        pub fn log(&self) -> PathBuf {
            self.dir.with_extension("log")
        }
    }

    /// `n` servers on free loopback ports, their directories under `dir`.
    pub fn specs(n: usize, dir: &Path) -> Vec<ServerSpec> {
        let ports = free_ports(3 * n);
        (0..n)
            .map(|i| ServerSpec {
                id: i as u64 + 1,
                rpc: format!("127.0.0.1:{}", ports[3 * i]),
                raft: format!("127.0.0.1:{}", ports[3 * i + 1]),
                http: format!("127.0.0.1:{}", ports[3 * i + 2]),
                dir: dir.join(format!("n{}", i + 1)),
            })
            .collect()
    }

    /// The command that starts `spec` with binary `bin` (stderr appended to its log),
    /// initializing the group with every one of `all` if `init`, plus `extra` flags.
    pub fn server_command(bin: &Path, spec: &ServerSpec, all: &[ServerSpec], init: bool, extra: &[String]) -> Command {
        let mut cmd = Command::new(bin);
        cmd.args([
            "server",
            "--id",
            &spec.id.to_string(),
            "--listen",
            &spec.rpc,
            "--raft-listen",
            &spec.raft,
            "--http",
            &spec.http,
        ])
        .arg("--data-dir")
        .arg(&spec.dir)
        .args(extra)
        .env(
            "RUST_LOG",
            std::env::var("KVOTA_TEST_LOG").unwrap_or_else(|_| "warn".to_string()),
        )
        .stdout(Stdio::null())
        .stderr(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(spec.log())
                .map(Stdio::from)
                .unwrap_or_else(|_| Stdio::null()),
        );
        if init {
            cmd.arg("--init");
            for m in all {
                cmd.args(["--member", &m.member()]);
            }
        }
        cmd
    }
}
