//! Offline replay: trace readers, when requests arrive (workload), transfer timing, configuration,
//! scaling the cluster during a run, sweeps over configurations and the discrete-event loop.

pub mod config;
pub mod contention;
pub mod engine;
pub mod faults;
pub mod identity;
pub mod queue;
pub mod scaling;
pub mod sink;
pub mod sweep;
pub mod trace;
pub mod transfer;
pub mod workload;
