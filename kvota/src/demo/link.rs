//! A TCP proxy whose link can be cut: a real socket fault between an agent and the
//! control plane. While cut, open connections are dropped and new ones are accepted and
//! closed at once (the client sees a reset, as after a network partition with a
//! middlebox, or a peer that went away).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

/// A running proxy. Dropping it does not stop it; it lives as long as the runtime.
#[derive(Clone, Debug)]
pub struct LinkProxy {
    addr: String,
    cut: Arc<AtomicBool>,
}

impl LinkProxy {
    /// Listens on a free loopback port and forwards every connection to `target`.
    pub async fn start(target: String) -> std::io::Result<LinkProxy> {
        let l = TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?.to_string();
        let cut = Arc::new(AtomicBool::new(false));
        let c = cut.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = l.accept().await else { return };
                if c.load(Ordering::SeqCst) {
                    continue; // dropped at once
                }
                let target = target.clone();
                let c2 = c.clone();
                tokio::spawn(async move {
                    let Ok(mut out) = TcpStream::connect(&target).await else {
                        return;
                    };
                    let copy = tokio::io::copy_bidirectional(&mut inbound, &mut out);
                    let watch = async {
                        while !c2.load(Ordering::SeqCst) {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    };
                    tokio::select! { _ = copy => {}, _ = watch => {} }
                });
            }
        });
        Ok(LinkProxy { addr, cut })
    }

    /// The address to connect to instead of the target.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Cuts (`true`) or restores (`false`) the link.
    pub fn set_cut(&self, cut: bool) {
        self.cut.store(cut, Ordering::SeqCst);
    }

    /// Whether the link is cut.
    pub fn is_cut(&self) -> bool {
        self.cut.load(Ordering::SeqCst)
    }
}
