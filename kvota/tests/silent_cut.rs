//! A link cut silently (packets dropped, no reset: a partition with no middlebox to
//! answer) between a client and the control plane, then healed. The connection the
//! client held is dead without knowing it; the first call after the heal must not queue
//! behind it (each such call would cost a whole call deadline: an agent's lease can run
//! out that way although the network is back). Found by the compose test
//! (`docker network disconnect`), where recovery took 12-19 s.
//!
//! Real parts: a one-node control plane, the real client, a TCP proxy that can swallow
//! bytes instead of forwarding them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvota_client::client::Client;
use kvota_proto::v1;
use kvota_testkit::Cluster;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Forwards connections to `target`; while `held`, every byte is swallowed, and a
/// connection that saw the hold stays dead (swallowing) after it ends, as a TCP
/// connection across a healed partition whose peer state was lost would.
struct Blackhole {
    addr: String,
    held: Arc<AtomicBool>,
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    held: Arc<AtomicBool>,
    dead: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if held.load(Ordering::SeqCst) {
            dead.store(true, Ordering::SeqCst);
        }
        if dead.load(Ordering::SeqCst) {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

impl Blackhole {
    async fn start(target: String) -> Blackhole {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        let held = Arc::new(AtomicBool::new(false));
        let h = held.clone();
        tokio::spawn(async move {
            while let Ok((inbound, _)) = l.accept().await {
                let Ok(out) = TcpStream::connect(&target).await else {
                    continue;
                };
                let dead = Arc::new(AtomicBool::new(h.load(Ordering::SeqCst)));
                let (ir, iw) = inbound.into_split();
                let (or, ow) = out.into_split();
                tokio::spawn(pump(ir, ow, h.clone(), dead.clone()));
                tokio::spawn(pump(or, iw, h.clone(), dead));
            }
        });
        Blackhole { addr, held }
    }
}

async fn status(c: &Client) -> Result<v1::StatusReply, tonic::Status> {
    c.call(|ch| async move { Ok(Client::admin(ch).status(v1::Empty {}).await?.into_inner()) })
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_call_after_a_silent_cut_heals_dials_afresh() {
    let cluster = Cluster::start(1).await;
    cluster.leader(Duration::from_secs(20)).await;
    let hole = Blackhole::start(cluster.endpoints()[0].clone()).await;
    let client = Client::new(std::slice::from_ref(&hole.addr)).expect("client");
    let deadline = Duration::from_secs(2);
    client.set_call_timeout(deadline);
    status(&client).await.expect("status through the proxy");

    // Cut silently: the call gets no answer, and says so within its attempts' deadlines.
    hole.held.store(true, Ordering::SeqCst);
    let t = Instant::now();
    let err = status(&client).await.expect_err("no answer while cut");
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err}");
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());

    // Healed: the next call answers at once, on a new connection, not after the dead
    // one's deadline.
    hole.held.store(false, Ordering::SeqCst);
    let t = Instant::now();
    status(&client).await.expect("status after the heal");
    let took = t.elapsed();
    assert!(
        took < deadline,
        "the first call after the heal took {took:?}: it waited on the dead connection"
    );
    cluster.shutdown().await;
}
