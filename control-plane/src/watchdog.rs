//! Fast failover when the leader's process is gone.
//!
//! openraft 0.9 lets a follower that knew a leader start an election only after the
//! leader lease (`election_timeout_max`) plus its own election timeout have passed since
//! the last heartbeat, and every follower refuses votes while that lease runs: with the
//! defaults (50 ms heartbeat, 150-300 ms elections) a failover takes 450-600 ms before
//! the first vote, and split votes add whole timeouts to the tail.
//!
//! When a leader has been silent for three heartbeats, this watchdog asks its host for a
//! TCP connection. A refused connection means nothing listens there any more: the
//! process died (SIGKILL, crash, OOM) while its host stayed up. Then the survivors need
//! not wait for their random timers: the first of them (lowest node id) calls an
//! election as soon as the lease has run out on every follower, and each next one a
//! third of a lease later if no leader has appeared, so they do not split the vote. A
//! leader that is merely slow, paused, or cut off accepts connections or does not answer
//! at all; the watchdog then does nothing and openraft's timers decide, as before.
//! Calling an election early is always safe in Raft; at worst it disturbs a leader that
//! was about to come back.

use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::types::{NodeId, Raft};

/// When each follower last heard from which leader (updated by the Raft transport on
/// every AppendEntries, heartbeats included).
#[derive(Debug, Default)]
pub struct LeaderContact {
    last: Mutex<Option<(NodeId, Instant)>>,
}

impl LeaderContact {
    /// `leader` just sent us AppendEntries.
    pub fn heard(&self, leader: NodeId) {
        *self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some((leader, Instant::now()));
    }

    /// The leader heard from last, and when.
    pub fn last(&self) -> Option<(NodeId, Instant)> {
        *self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// What the probe of a silent leader found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Probe {
    /// Connection refused: no process listens at the leader's address.
    Gone,
    /// It accepted, or did not answer in time: maybe alive; leave it to the timers.
    Unsure,
}

async fn probe(addr: &str, within: Duration) -> Probe {
    match tokio::time::timeout(within, tokio::net::TcpStream::connect(addr)).await {
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => Probe::Gone,
        _ => Probe::Unsure,
    }
}

/// How long after the leader's last heartbeat a survivor of rank `rank` (0 = lowest id)
/// calls an election once the leader is known to be gone.
pub fn election_due(lease: Duration, rank: usize) -> Duration {
    lease + Duration::from_millis(20) + (lease / 3) * u32::try_from(rank).unwrap_or(u32::MAX)
}

/// What this node's Raft metrics say: whether it follows, the leader it knows, the
/// voters other than `leader` (ascending), and `leader`'s Raft address.
fn view_of(raft: &Raft, leader: NodeId) -> (bool, Option<NodeId>, Vec<NodeId>, Option<String>) {
    let m = raft.metrics();
    let m = m.borrow();
    let membership = m.membership_config.membership();
    let mut voters: Vec<NodeId> = membership.voter_ids().filter(|&v| v != leader).collect();
    voters.sort_unstable();
    let addr = membership.get_node(&leader).map(|n| {
        if n.raft_addr.is_empty() {
            n.rpc_addr.clone()
        } else {
            n.raft_addr.clone()
        }
    });
    (
        m.state == openraft::ServerState::Follower,
        m.current_leader,
        voters,
        addr,
    )
}

/// Runs until `stop` turns true.
pub async fn run(
    raft: Raft,
    contact: Arc<LeaderContact>,
    me: NodeId,
    heartbeat: Duration,
    lease: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let every = (heartbeat / 5).clamp(Duration::from_millis(5), Duration::from_millis(25));
    // The silence (leader, last heard) already probed, its finding, and whether this node
    // already called an election for it.
    let mut episode: Option<((NodeId, Instant), Probe, bool)> = None;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
        }
        let Some((leader, at)) = contact.last() else { continue };
        let (follower, current, voters, addr) = view_of(&raft, leader);
        let silent = at.elapsed();
        if !follower || current.is_some_and(|c| c != leader) || silent < heartbeat * 3 {
            continue;
        }
        let Some(addr) = addr else { continue };
        let Some(rank) = voters.iter().position(|&v| v == me) else {
            continue;
        };
        let finding = match episode {
            Some((e, p, _)) if e == (leader, at) => p,
            _ => {
                let p = probe(&addr, heartbeat).await;
                episode = Some(((leader, at), p, false));
                if p == Probe::Gone {
                    tracing::info!(leader, %addr, "the leader refuses connections: its process is gone; the survivors elect without waiting for their timers");
                }
                p
            }
        };
        let called = episode.is_some_and(|(_, _, c)| c);
        if finding == Probe::Gone && !called && at.elapsed() >= election_due(lease, rank) {
            if let Some(e) = episode.as_mut() {
                e.2 = true;
            }
            tracing::info!(
                leader,
                rank,
                after_ms = u64::try_from(at.elapsed().as_millis()).unwrap_or(u64::MAX),
                "calling an election"
            );
            if let Err(e) = raft.trigger().elect().await {
                tracing::warn!(error = %e, "could not call an election");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn survivors_are_staggered_after_the_lease() {
        let lease = Duration::from_millis(300);
        assert_eq!(election_due(lease, 0), Duration::from_millis(320));
        assert_eq!(election_due(lease, 1), Duration::from_millis(420));
        assert!(
            election_due(lease, 0) > lease,
            "never before every follower's lease has run out"
        );
    }

    #[tokio::test]
    async fn a_closed_port_is_gone_and_a_listening_one_is_not() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        assert_eq!(
            probe(&addr, Duration::from_millis(200)).await,
            Probe::Unsure,
            "something listens"
        );
        drop(l);
        assert_eq!(probe(&addr, Duration::from_millis(200)).await, Probe::Gone);
    }
}
