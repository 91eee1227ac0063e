//! The kvota member agent (`kvota agent`): cluster inventory, usage journal, lease
//! enforcement and the admission webhook.
//!
//! Not written yet: issue #4. The agent-side lease rules
//! ([`kvota_fairness::lease::AgentLease`]) and the admission decision
//! ([`kvota_fairness::admission::decide`]) it will call already exist in the core.
