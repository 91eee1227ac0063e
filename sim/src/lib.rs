//! `kvota sim`: a trace-driven, discrete-event comparison of GPU fairness policies.
//!
//! Not written yet: issue #7. It will drive the same fairness core as the real system.
