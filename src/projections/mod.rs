//! Pure folds over records. A projection never reads a clock or a file: it is fed records in
//! stream (or deterministic merge) order and answers from what it has seen.

/// Kept at its old path: the snapshot is the model layer's.
pub use crate::model::capacity;

pub use capacity::KvCapacitySnapshot;
pub mod scheduler;

pub use scheduler::SchedulerFold;
pub mod handoffs;
pub use handoffs::HandoffLedger;
pub mod distribution;
pub mod metrics;

pub use metrics::{MetricsFold, MetricsReport, PerRequest, PerRequestSink};
pub mod at;
pub mod bookings;
pub mod compare;
pub mod decode_stalls;
pub mod diff;
pub mod inspect;
pub mod run;
pub mod svg;
pub mod timeline;
pub mod worker;
