//! The kvota wire API: member and admin services (`kvota.v1`), and the Raft transport
//! between control-plane nodes with the replicated log's schema (`kvota.raft.v1`).
//!
//! Generated code lives in [`v1`]; [`convert`] turns the member service's messages into
//! the fairness core's types with validation (and back), so nothing unvalidated crosses
//! into the core; [`answers`] does the same for the admin service's read answers
//! (explanations, audit records); [`log`] turns the replicated log's commands
//! (`kvota.raft.v1`'s `Log*` messages) into the core's types and back, checking their
//! structure only (a log entry must read the same on every node).

/// Generated protobuf types and gRPC stubs for `kvota.v1`.
#[allow(
    missing_docs,
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic,
    unreachable_pub
)]
pub mod v1 {
    tonic::include_proto!("kvota.v1");
}

/// Generated protobuf types and gRPC stubs for `kvota.raft.v1`: the Raft transport
/// between control-plane nodes and the replicated log's schema.
pub mod raft {
    /// Version 1.
    #[allow(
        missing_docs,
        missing_debug_implementations,
        clippy::all,
        clippy::pedantic,
        unreachable_pub
    )]
    pub mod v1 {
        tonic::include_proto!("kvota.raft.v1");
    }
}

pub mod answers;
pub mod convert;
pub mod log;

/// Metadata key on a request a follower forwarded, so it is never forwarded twice.
pub const FORWARDED_HEADER: &str = "kvota-forwarded";
/// Metadata key carrying the leader's address on `UNAVAILABLE` answers.
pub const LEADER_HEADER: &str = "kvota-leader";
/// Largest member/admin message either side accepts: 4 MiB (a report for 10,000 tenants
/// is about 400 KB). Larger ones are refused with `RESOURCE_EXHAUSTED` before decoding.
pub const MAX_API_MESSAGE_BYTES: usize = 4 << 20;

/// A client for etcd's `KV.Put`, for the benchmark that compares kvota with etcd.
#[allow(
    missing_docs,
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic,
    unreachable_pub
)]
pub mod etcd {
    tonic::include_proto!("etcdserverpb");
}
