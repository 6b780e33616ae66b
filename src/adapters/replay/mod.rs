//! Offline replay: trace readers, when requests arrive (workload), transfer timing, configuration,
//! scaling the cluster during a run, the network's and the nemesis' faults, sweeps over configurations and the discrete-event loop.

pub mod config;
pub mod contention;
pub mod engine;
pub mod faults;
pub mod identity;
pub mod nemesis;
pub mod queue;
pub mod scaling;
pub mod sink;
pub mod swarm;
pub mod sweep;
pub mod trace;
pub mod transfer;
pub mod workload;
