//! kvota's client side of the control plane, shared by the member agent and the CLI:
//! [`client`] (any node's address; follows the leader, retries with backoff, a deadline
//! on every call) and [`tls`] (mutual TLS by identity). It depends on the wire schema
//! and the TLS crate only, so a member cluster's agent carries no Raft or storage code.

pub mod client;
pub mod tls;

pub use client::Client;
