//! The kvota control plane (`kvota server`): a Raft group (openraft + sled) whose state
//! machine is [`kvota_fairness::federation::Federation`].
//!
//! Not written yet: issue #3. The replicated state machine it will wrap already exists
//! in the fairness core, so the adapter here stays thin: decode a command, call the core.
