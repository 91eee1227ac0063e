//! A client of the control plane for the CLI and agents: give it any nodes' addresses;
//! it tries them in turn, follows a `kvota-leader` hint, and retries a bounded number
//! of times with jittered backoff. Every call has a deadline.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvota_proto::v1::{admin_client::AdminClient, member_client::MemberClient};
use tokio::sync::Mutex;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::node::LEADER_HEADER;

/// Per-call deadline: a write may wait through one failover (see `node::WRITE_TIMEOUT`).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(8);
/// Attempts per call across all endpoints before giving up.
pub const MAX_ATTEMPTS: usize = 6;

/// A control-plane client. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Client {
    endpoints: Arc<Mutex<Vec<String>>>,
    preferred: Arc<AtomicUsize>,
    channels: Arc<Mutex<Vec<Option<Channel>>>>,
}

fn retriable(s: &Status) -> bool {
    matches!(s.code(), Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled)
}

fn normalize(addr: &str) -> String {
    let a = addr.trim().trim_start_matches("http://");
    a.to_string()
}

impl Client {
    /// A client for these `host:port` gRPC addresses (at least one).
    pub fn new(endpoints: &[String]) -> Result<Client, Status> {
        let eps: Vec<String> = endpoints.iter().map(|e| normalize(e)).filter(|e| !e.is_empty()).collect();
        if eps.is_empty() {
            return Err(Status::invalid_argument("no control-plane address given"));
        }
        let n = eps.len();
        Ok(Client {
            endpoints: Arc::new(Mutex::new(eps)),
            preferred: Arc::new(AtomicUsize::new(0)),
            channels: Arc::new(Mutex::new(vec![None; n])),
        })
    }

    async fn channel(&self, i: usize) -> Result<(String, Channel), Status> {
        let addr = self.endpoints.lock().await[i].clone();
        let mut chans = self.channels.lock().await;
        if let Some(Some(c)) = chans.get(i) {
            return Ok((addr, c.clone()));
        }
        let ep = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| Status::invalid_argument(format!("bad address {addr}: {e}")))?
            .connect_timeout(Duration::from_millis(800))
            .timeout(CALL_TIMEOUT)
            .tcp_nodelay(true);
        let c = ep.connect_lazy();
        if let Some(slot) = chans.get_mut(i) {
            *slot = Some(c.clone());
        }
        Ok((addr, c))
    }

    async fn index_of(&self, addr: &str) -> usize {
        let mut eps = self.endpoints.lock().await;
        if let Some(i) = eps.iter().position(|e| e == addr) {
            return i;
        }
        eps.push(addr.to_string());
        self.channels.lock().await.push(None);
        eps.len() - 1
    }

    /// Runs `f` against endpoints until one answers, following leader hints.
    pub async fn call<T, F, Fut>(&self, f: F) -> Result<T, Status>
    where
        F: Fn(Channel) -> Fut,
        Fut: std::future::Future<Output = Result<T, Status>>,
    {
        let mut last = Status::unavailable("no control-plane node answered");
        for attempt in 0..MAX_ATTEMPTS {
            let n = self.endpoints.lock().await.len();
            let i = self.preferred.load(Ordering::Relaxed) % n.max(1);
            let (addr, ch) = self.channel(i).await?;
            match tokio::time::timeout(CALL_TIMEOUT, f(ch)).await {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(s)) if retriable(&s) => {
                    // A leader hint wins; otherwise move on to the next endpoint.
                    let hint = s
                        .metadata()
                        .get(LEADER_HEADER)
                        .and_then(|v| v.to_str().ok())
                        .map(normalize);
                    let next = match hint {
                        Some(h) if h != addr => self.index_of(&h).await,
                        _ => (i + 1) % n.max(1),
                    };
                    if let Some(slot) = self.channels.lock().await.get_mut(i) {
                        *slot = None;
                    }
                    self.preferred.store(next, Ordering::Relaxed);
                    last = s;
                }
                Ok(Err(s)) => return Err(s),
                Err(_) => {
                    self.preferred.store((i + 1) % n.max(1), Ordering::Relaxed);
                    last = Status::deadline_exceeded(format!("{addr} did not answer within {CALL_TIMEOUT:?}"));
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
        MemberClient::new(ch).max_decoding_message_size(crate::server::MAX_API_MESSAGE_BYTES)
    }
}
