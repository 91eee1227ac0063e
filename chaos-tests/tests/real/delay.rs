//! Packet delay on one namespace's outgoing traffic, like
//! `tc qdisc add dev eth0 root netem delay 200ms 50ms`, for kernels without netem.
//!
//! CI's kernel is built without `CONFIG_NET_SCH_NETEM` (as is this machine's), so the
//! delay is made with netfilter instead: an iptables rule in the namespace sends every
//! packet leaving `eth0` to NFQUEUE, where the kernel holds it until this module, bound
//! to the queue over netlink from a thread that entered the namespace, accepts it
//! 200 ± 50 ms later. The packets are real and so is the delay; only the timer is ours.
//! `--queue-bypass` and the queue's fail-open flag let traffic through unharmed if this
//! thread is gone or the queue is full.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::net::netlink::{SocketAddrNetlink, NETFILTER};
use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketType};

use super::net::sh;

const NFNL_SUBSYS_QUEUE: u16 = 3;
const NFQNL_MSG_PACKET: u16 = 0;
const NFQNL_MSG_VERDICT: u16 = 1;
const NFQNL_MSG_CONFIG: u16 = 2;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NFQA_PACKET_HDR: u16 = 1;
const NFQA_VERDICT_HDR: u16 = 2;
const NFQA_CFG_CMD: u16 = 1;
const NFQA_CFG_PARAMS: u16 = 2;
const NFQA_CFG_QUEUE_MAXLEN: u16 = 3;
const NFQA_CFG_MASK: u16 = 4;
const NFQA_CFG_FLAGS: u16 = 5;
const NFQNL_CFG_CMD_BIND: u8 = 1;
const NFQNL_COPY_META: u8 = 1;
const NFQA_CFG_F_FAIL_OPEN: u32 = 1;
const NF_ACCEPT: u32 = 1;
/// Packets the kernel holds at most; past it (fail-open) they pass undelayed. A few
/// hundred packets a second for 250 ms at most is far below.
const QUEUE_MAXLEN: u32 = 8_192;

fn attr(buf: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = u16::try_from(4 + payload.len()).unwrap_or(u16::MAX);
    buf.extend_from_slice(&len.to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(payload);
    while buf.len() % 4 != 0 {
        buf.push(0);
    }
}

/// A netfilter-queue message: netlink header, nfgenmsg for `queue`, then `attrs`.
fn message(kind: u16, flags: u16, seq: u32, queue: u16, attrs: &[(u16, Vec<u8>)]) -> Vec<u8> {
    let mut body = vec![0u8 /* AF_UNSPEC */, 0 /* NFNETLINK_V0 */];
    body.extend_from_slice(&queue.to_be_bytes());
    for (k, p) in attrs {
        attr(&mut body, *k, p);
    }
    let mut m = Vec::with_capacity(16 + body.len());
    m.extend_from_slice(&u32::try_from(16 + body.len()).unwrap_or(u32::MAX).to_ne_bytes());
    m.extend_from_slice(&((NFNL_SUBSYS_QUEUE << 8) | kind).to_ne_bytes());
    m.extend_from_slice(&flags.to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    m.extend(body);
    m
}

fn u16_at(b: &[u8], i: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(i..i + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], i: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(i..i + 4)?.try_into().ok()?))
}

/// What one datagram from the kernel holds: packet ids queued, and errors answered.
fn parse(buf: &[u8]) -> (Vec<u32>, Vec<i32>) {
    let (mut ids, mut errors) = (Vec::new(), Vec::new());
    let mut at = 0;
    while let (Some(len), Some(kind)) = (u32_at(buf, at), u16_at(buf, at + 4)) {
        let len = usize::try_from(len).unwrap_or(0);
        if len < 16 || at + len > buf.len() {
            break;
        }
        let msg = &buf[at..at + len];
        if kind == NLMSG_ERROR {
            if let Some(e) = msg.get(16..20).and_then(|b| b.try_into().ok()).map(i32::from_ne_bytes) {
                if e != 0 {
                    errors.push(e);
                }
            }
        } else if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET {
            let mut a = 20; // header + nfgenmsg
            while let (Some(alen), Some(akind)) = (u16_at(msg, a), u16_at(msg, a + 2)) {
                let alen = usize::from(alen);
                if alen < 4 {
                    break;
                }
                if akind & 0x7fff == NFQA_PACKET_HDR {
                    if let Some(id) = msg
                        .get(a + 4..a + 8)
                        .and_then(|b| b.try_into().ok())
                        .map(u32::from_be_bytes)
                    {
                        ids.push(id);
                    }
                }
                a += (alen + 3) & !3;
            }
        }
        at += (len + 3) & !3;
    }
    (ids, errors)
}

/// A running delay; removed (rules deleted, held packets released) on drop.
#[derive(Debug)]
pub struct Delay {
    ns: String,
    rule: Vec<String>,
    stop: Arc<AtomicBool>,
    delayed: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
}

impl Delay {
    /// Delays every packet leaving `eth0` in namespace `ns` by `base` ± `jitter`
    /// (uniform), through NFQUEUE number `queue`.
    pub fn start(ns: &str, queue: u16, base: Duration, jitter: Duration) -> Result<Delay, String> {
        let stop = Arc::new(AtomicBool::new(false));
        let delayed = Arc::new(AtomicU64::new(0));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
        let (ns2, stop2, delayed2) = (ns.to_string(), stop.clone(), delayed.clone());
        let thread = std::thread::Builder::new()
            .name(format!("delay-{ns}"))
            .spawn(move || {
                let r = Self::run(&ns2, queue, base, jitter, &stop2, &delayed2, &ready_tx);
                if let Err(e) = &r {
                    let _ = ready_tx.send(Err(e.clone()));
                }
                r
            })
            .map_err(|e| format!("start the delay thread: {e}"))?;
        match ready_rx.recv_timeout(Duration::from_secs(5)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err("the delay thread did not bind its queue within 5 s".into()),
        }
        let rule: Vec<String> = [
            "OUTPUT",
            "-o",
            "eth0",
            "-j",
            "NFQUEUE",
            "--queue-num",
            &queue.to_string(),
            "--queue-bypass",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut d = Delay {
            ns: ns.to_string(),
            rule,
            stop,
            delayed,
            thread: Some(thread),
        };
        d.iptables("-I")?;
        Ok(d)
    }

    fn iptables(&mut self, op: &str) -> Result<(), String> {
        let mut args: Vec<&str> = vec!["netns", "exec", &self.ns, "iptables", "-w", op];
        args.extend(self.rule.iter().map(String::as_str));
        sh("ip", &args).map(|_| ())
    }

    /// Packets delayed so far.
    pub fn delayed(&self) -> u64 {
        self.delayed.load(Ordering::SeqCst)
    }

    /// Removes the rule, releases what is held, and reports how many packets were delayed.
    pub fn stop(mut self) -> Result<u64, String> {
        self.finish()
    }

    fn finish(&mut self) -> Result<u64, String> {
        let removed = self.iptables("-D");
        self.stop.store(true, Ordering::SeqCst);
        let joined = self
            .thread
            .take()
            .map(|t| t.join().unwrap_or_else(|_| Err("the delay thread panicked".into())));
        removed?;
        if let Some(r) = joined {
            r?;
        }
        Ok(self.delayed())
    }

    fn run(
        ns: &str,
        queue: u16,
        base: Duration,
        jitter: Duration,
        stop: &AtomicBool,
        delayed: &AtomicU64,
        ready: &std::sync::mpsc::Sender<Result<(), String>>,
    ) -> Result<(), String> {
        let f = std::fs::File::open(format!("/run/netns/{ns}")).map_err(|e| format!("open /run/netns/{ns}: {e}"))?;
        // Only this thread enters the namespace; the socket made next belongs to it.
        rustix::thread::move_into_link_name_space(f.as_fd(), Some(rustix::thread::LinkNameSpaceType::Network))
            .map_err(|e| format!("enter namespace {ns}: {e}"))?;
        let sock = rustix::net::socket(AddressFamily::NETLINK, SocketType::RAW, Some(NETFILTER))
            .map_err(|e| format!("netlink socket: {e}"))?;
        rustix::net::bind(&sock, &SocketAddrNetlink::new(0, 0)).map_err(|e| format!("bind netlink: {e}"))?;
        let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&sock, 4 << 20);
        // Wake up often enough to release packets on time (the jitter's resolution).
        rustix::net::sockopt::set_socket_timeout(
            &sock,
            rustix::net::sockopt::Timeout::Recv,
            Some(Duration::from_millis(2)),
        )
        .map_err(|e| format!("netlink timeout: {e}"))?;
        let config = message(
            NFQNL_MSG_CONFIG,
            NLM_F_REQUEST | NLM_F_ACK,
            1,
            queue,
            &[
                (
                    NFQA_CFG_CMD,
                    vec![NFQNL_CFG_CMD_BIND, 0, 0, 2 /* AF_INET, big-endian */],
                ),
                (NFQA_CFG_PARAMS, vec![0, 0, 0, 0, NFQNL_COPY_META]),
                (NFQA_CFG_QUEUE_MAXLEN, QUEUE_MAXLEN.to_be_bytes().to_vec()),
                (NFQA_CFG_MASK, NFQA_CFG_F_FAIL_OPEN.to_be_bytes().to_vec()),
                (NFQA_CFG_FLAGS, NFQA_CFG_F_FAIL_OPEN.to_be_bytes().to_vec()),
            ],
        );
        rustix::net::send(&sock, &config, SendFlags::empty()).map_err(|e| format!("bind queue {queue}: {e}"))?;
        let mut buf = vec![0u8; 1 << 16];
        let (n, _) = rustix::net::recv(&sock, &mut buf[..], RecvFlags::empty())
            .map_err(|e| format!("bind queue {queue}: no answer: {e}"))?;
        let (_, errors) = parse(&buf[..n]);
        if let Some(e) = errors.first() {
            return Err(format!(
                "bind queue {queue}: kernel error {e} (is another process bound to it?)"
            ));
        }
        let _ = ready.send(Ok(()));
        let mut held: BinaryHeap<Reverse<(Instant, u32)>> = BinaryHeap::new();
        let mut rng = u64::from(std::process::id()) ^ 0x9e37_79b9_7f4a_7c15;
        let jitter_ms = u64::try_from(jitter.as_millis()).unwrap_or(0);
        let mut seq = 2u32;
        loop {
            let stopping = stop.load(Ordering::SeqCst);
            let mut idle = false;
            match rustix::net::recv(&sock, &mut buf[..], RecvFlags::empty()) {
                Ok((n, _)) => {
                    for id in parse(&buf[..n]).0 {
                        // xorshift64: uniform jitter in [-j, +j] ms.
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        let offset = if jitter_ms == 0 { 0 } else { rng % (2 * jitter_ms + 1) };
                        let due = Instant::now() + base + Duration::from_millis(offset) - jitter;
                        held.push(Reverse((due, id)));
                    }
                }
                // Timeout (nothing queued), or the socket overran (ENOBUFS): go on.
                Err(_) => idle = true,
            }
            let now = Instant::now();
            while let Some(Reverse((due, id))) = held.peek().copied() {
                if due > now && !stopping {
                    break;
                }
                held.pop();
                let mut hdr = NF_ACCEPT.to_be_bytes().to_vec();
                hdr.extend_from_slice(&id.to_be_bytes());
                seq = seq.wrapping_add(1);
                let v = message(NFQNL_MSG_VERDICT, NLM_F_REQUEST, seq, queue, &[(NFQA_VERDICT_HDR, hdr)]);
                rustix::net::send(&sock, &v, SendFlags::empty())
                    .map_err(|e| format!("verdict for packet {id}: {e}"))?;
                delayed.fetch_add(1, Ordering::SeqCst);
            }
            // Stopping: the rule is gone; release what is held and what is still queued.
            if stopping && held.is_empty() && idle {
                return Ok(());
            }
        }
    }
}

impl Drop for Delay {
    fn drop(&mut self) {
        if self.thread.is_some() {
            let _ = self.finish();
        }
    }
}
