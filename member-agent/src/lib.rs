//! The kvota member agent (`kvota agent`): cluster inventory, usage journal, lease
//! enforcement and the admission webhook.
//!
//! Built so far (issue #4 in progress): [`review`], the AdmissionReview handling the
//! webhook serves (pure: parse, map to tenant, decide, record the effect atomically),
//! and [`journal`], the durable usage journal that keeps every report until the control
//! plane acknowledges it. The HTTPS server, the Kubernetes inventory, the reporting loop
//! and the simulated cluster are not written yet.

pub mod journal;
pub mod review;
