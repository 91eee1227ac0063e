//! The kvota wire API (`kvota.v1`): member, admin and Raft transport services.
//!
//! Not written yet: issue #3 (the control plane) defines the protobuf files and the
//! `TryFrom` conversions into the domain types of `kvota-fairness`. The crate exists now
//! so that the workspace has its final shape.
