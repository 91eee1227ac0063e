//! Chaos tests for kvota: deterministic multi-node simulation and real-process faults.
//!
//! Not written yet: issue #6. Until then the partition-safety property is checked by the
//! fairness core's own model test (`fairness/tests/partition_safety.rs`).
