//! A client of the control plane for the CLI and agents: give it any nodes' addresses;
//! it tries them in turn, follows a `kvota-leader` hint when it names one of them (it
//! never dials an address it was not given), and retries a bounded number of times with
//! jittered backoff. Every call has a deadline.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvota_proto::v1::{admin_client::AdminClient, member_client::MemberClient};
use tokio::sync::Mutex;
use tonic::transport::Channel;
use tonic::{Code, Status};

use kvota_proto::{LEADER_HEADER, MAX_API_MESSAGE_BYTES};

/// Per-call deadline: a write may wait through one failover (the control plane gives a
/// write 5 s to commit).
/// The longest a caller may set with [`Client::set_call_timeout`].
pub const CALL_TIMEOUT: Duration = Duration::from_secs(8);
/// The shortest per-call deadline a caller may set: a loaded node answers a write within
/// a few hundred milliseconds (one fsync, one replication round trip).
pub const MIN_CALL_TIMEOUT: Duration = Duration::from_millis(300);
/// Attempts per call across all endpoints before giving up.
pub const MAX_ATTEMPTS: usize = 6;

/// A control-plane client. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Client {
    endpoints: Arc<[String]>,
    preferred: Arc<AtomicUsize>,
    channels: Arc<Mutex<Vec<Option<Channel>>>>,
    call_timeout_ms: Arc<AtomicU64>,
    tls: Option<crate::tls::GrpcTls>,
}

fn retriable(s: &Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled
    )
}

fn normalize(addr: &str) -> String {
    let a = addr.trim().trim_start_matches("http://").trim_start_matches("https://");
    a.to_string()
}

impl Client {
    /// A client for these `host:port` gRPC addresses (at least one), in plain text.
    pub fn new(endpoints: &[String]) -> Result<Client, Status> {
        Client::with_tls(endpoints, None)
    }

    /// A client for these `host:port` gRPC addresses, over mutual TLS if `tls` is given.
    pub fn with_tls(endpoints: &[String], tls: Option<crate::tls::GrpcTls>) -> Result<Client, Status> {
        let eps: Vec<String> = endpoints
            .iter()
            .map(|e| normalize(e))
            .filter(|e| !e.is_empty())
            .collect();
        if eps.is_empty() {
            return Err(Status::invalid_argument("no control-plane address given"));
        }
        let n = eps.len();
        Ok(Client {
            endpoints: eps.into(),
            preferred: Arc::new(AtomicUsize::new(0)),
            channels: Arc::new(Mutex::new(vec![None; n])),
            call_timeout_ms: Arc::new(AtomicU64::new(ms(CALL_TIMEOUT))),
            tls,
        })
    }

    /// Sets the per-attempt deadline (clamped to [`MIN_CALL_TIMEOUT`]..=[`CALL_TIMEOUT`]),
    /// for this client and its clones. After it, the call moves on to the next node. An
    /// agent sets it from its lease: an answer later than the lease's usable life renews
    /// nothing, so waiting longer on a node that accepts connections but does not answer
    /// (frozen, overloaded) only lets the lease run out.
    pub fn set_call_timeout(&self, t: Duration) {
        let t = t.clamp(MIN_CALL_TIMEOUT, CALL_TIMEOUT);
        self.call_timeout_ms.store(ms(t), Ordering::Relaxed);
    }

    /// The per-attempt deadline in force.
    pub fn call_timeout(&self) -> Duration {
        Duration::from_millis(self.call_timeout_ms.load(Ordering::Relaxed))
    }

    async fn channel(&self, i: usize) -> Result<(String, Channel), Status> {
        let addr = self.endpoints[i].clone();
        let mut chans = self.channels.lock().await;
        if let Some(Some(c)) = chans.get(i) {
            return Ok((addr, c.clone()));
        }
        let c = crate::tls::channel(
            &addr,
            self.tls.as_ref(),
            kvota_tls::Expect::AnyNode,
            Duration::from_millis(800),
            CALL_TIMEOUT,
        )
        .map_err(Status::invalid_argument)?;
        if let Some(slot) = chans.get_mut(i) {
            *slot = Some(c.clone());
        }
        Ok((addr, c))
    }

    /// Which configured endpoint `addr` is. A hint naming any other address is not
    /// followed: the client dials only what it was configured with (a member cluster
    /// often reaches the nodes by other addresses than they advertise, and a path that is
    /// cut must stay cut), and every node forwards writes to the leader anyway.
    fn index_of(&self, addr: &str) -> Option<usize> {
        self.endpoints.iter().position(|e| e == addr)
    }

    /// Runs `f` against endpoints until one answers, following leader hints.
    pub async fn call<T, F, Fut>(&self, f: F) -> Result<T, Status>
    where
        F: Fn(Channel) -> Fut,
        Fut: std::future::Future<Output = Result<T, Status>>,
    {
        let mut last = Status::unavailable("no control-plane node answered");
        for attempt in 0..MAX_ATTEMPTS {
            let n = self.endpoints.len();
            let i = self.preferred.load(Ordering::Relaxed) % n.max(1);
            let (addr, ch) = self.channel(i).await?;
            let deadline = self.call_timeout();
            match tokio::time::timeout(deadline, f(ch)).await {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(s)) if retriable(&s) => {
                    // A leader hint wins; otherwise move on to the next endpoint.
                    let hint = s
                        .metadata()
                        .get(LEADER_HEADER)
                        .and_then(|v| v.to_str().ok())
                        .map(normalize);
                    let known = match hint {
                        Some(h) if h != addr => self.index_of(&h),
                        _ => None,
                    };
                    let next = known.unwrap_or((i + 1) % n.max(1));
                    if let Some(slot) = self.channels.lock().await.get_mut(i) {
                        *slot = None;
                    }
                    self.preferred.store(next, Ordering::Relaxed);
                    last = s;
                }
                Ok(Err(s)) => return Err(s),
                Err(_) => {
                    // No answer in time: the connection may be dead without knowing it (a
                    // silent cut). Dial afresh next time instead of queueing behind it.
                    if let Some(slot) = self.channels.lock().await.get_mut(i) {
                        *slot = None;
                    }
                    self.preferred.store((i + 1) % n.max(1), Ordering::Relaxed);
                    last = Status::deadline_exceeded(format!("{addr} did not answer within {deadline:?}"));
                }
            }
            // Jittered backoff: 50-100 ms, doubling, so a failover has time to finish.
            let base = 50u64 << attempt.min(4);
            let jitter = u64::from(std::process::id() ^ u32::try_from(attempt).unwrap_or(0)) % base;
            tokio::time::sleep(Duration::from_millis(base + jitter)).await;
        }
        Err(last)
    }

    /// An admin client on the given channel (for use inside [`Client::call`]).
    pub fn admin(ch: Channel) -> AdminClient<Channel> {
        AdminClient::new(ch)
    }

    /// A member client on the given channel (for use inside [`Client::call`]).
    pub fn member(ch: Channel) -> MemberClient<Channel> {
        MemberClient::new(ch).max_decoding_message_size(MAX_API_MESSAGE_BYTES)
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvota_proto::v1;

    #[test]
    fn call_timeout_is_clamped() {
        let c = Client::new(&["127.0.0.1:1".to_string()]).expect("client");
        assert_eq!(c.call_timeout(), CALL_TIMEOUT);
        c.set_call_timeout(Duration::from_millis(1));
        assert_eq!(c.call_timeout(), MIN_CALL_TIMEOUT);
        c.clone().set_call_timeout(Duration::from_secs(60));
        assert_eq!(c.call_timeout(), CALL_TIMEOUT, "clones share it");
        c.set_call_timeout(Duration::from_millis(1350));
        assert_eq!(c.call_timeout(), Duration::from_millis(1350));
    }

    /// A node that accepts connections and never answers (a frozen process) costs each
    /// attempt the deadline set, not the 8 s default.
    #[tokio::test]
    async fn a_silent_node_costs_the_deadline_set() {
        let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = silent.local_addr().expect("addr").to_string();
        let c = Client::new(&[addr]).expect("client");
        c.set_call_timeout(MIN_CALL_TIMEOUT);
        let t0 = std::time::Instant::now();
        let r = c
            .call(|ch| async move { Ok(Client::admin(ch).status(v1::Empty {}).await?.into_inner()) })
            .await;
        let e = r.expect_err("nobody answers");
        // 6 attempts of 300 ms plus at most 4.7 s of jittered backoff between them: less
        // than one attempt at the default deadline.
        assert!(t0.elapsed() < CALL_TIMEOUT, "{:?}", t0.elapsed());
        assert!(e.message().contains("did not answer within 300ms"), "{e:?}");
        drop(silent);
    }

    /// A `kvota-leader` hint naming an address the client was not given is not dialed:
    /// the client moves on to its next configured endpoint (a path that is cut, or an
    /// address the member cluster cannot reach, stays out of use).
    #[tokio::test]
    async fn a_hint_to_an_unknown_address_is_not_dialed() {
        let listen = || {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.set_nonblocking(true).expect("nonblocking");
            let a = l.local_addr().expect("addr").to_string();
            (l, a)
        };
        let ((a, a_addr), (b, b_addr), (elsewhere, elsewhere_addr)) = (listen(), listen(), listen());
        let c = Client::new(&[a_addr, b_addr]).expect("client");
        let attempts = Arc::new(AtomicUsize::new(0));
        c.call(|ch| {
            let attempts = attempts.clone();
            let hint = elsewhere_addr.clone();
            async move {
                if attempts.fetch_add(1, Ordering::SeqCst) == 0 {
                    let mut s = Status::unavailable("not the leader");
                    s.metadata_mut().insert(LEADER_HEADER, hint.parse().expect("ascii"));
                    return Err(s);
                }
                // Dials whichever endpoint the client chose; nobody answers here.
                let _ = tokio::time::timeout(Duration::from_millis(300), Client::admin(ch).status(v1::Empty {})).await;
                Ok(())
            }
        })
        .await
        .expect("the second attempt succeeds");
        assert_eq!(attempts.load(Ordering::SeqCst), 2);
        assert!(b.accept().is_ok(), "the next configured endpoint was dialed");
        assert!(elsewhere.accept().is_err(), "the hinted address was dialed");
        assert!(a.accept().is_err(), "the first endpoint was dialed again");
    }
}
