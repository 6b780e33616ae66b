//! Live mode: one OS process per worker, talking TCP, on wall clocks.
//!
//! Live adds only a clock and a transport around the runtime's sans-IO types: every worker
//! process drives one [`WorkerNode`](crate::runtime::WorkerNode), the launcher (or a
//! stand-alone frontend) drives the [`Frontend`](crate::runtime::Frontend), and each writes its
//! own stream in the replay's format with clock domain `wall`. So `handoff-log diff LIVE
//! REPLAY` compares the two runs directly.
//!
//! ## Time
//! Each process keeps a [`ModelClock`](clock::ModelClock): model time = wall time since the
//! run's origin ÷ the time scale. Workers learn the frontend's origin in the handshake from a
//! round-trip probe (half the best round trip of a few), never by comparing two hosts' clocks.
//!
//! Every input a process handles carries a model instant (its *stamp*), and the process
//! handles inputs in stamp order ([`schedule`]):
//! * a message carries the instant its sender handled what caused it: the model has no
//!   network latency (replay delivers these at once), so the receiver handles it as of that
//!   instant, and the real latency only shows as lateness;
//! * a process's own events (a step's end, a command handed back, a timer, a transfer's end, an
//!   arrival) are stamped when they are due, and handled once the wall clock has passed that
//!   instant by a small hold, so messages sent at or before it by other processes arrive
//!   first;
//! * a step starts after everything of its instant, as in replay: a longer hold, so the chain
//!   of messages one instant causes (an arrival, its dispatch, the reservation it triggers)
//!   reaches the worker before its step takes its batch.
//!
//! Facts are stamped with the instant of the input that produced them, so a step takes exactly
//! its modeled duration in the log, and wall-clock jitter delays handling instead of moving
//! stamps. An input that arrives after its process moved past its stamp is handled at once,
//! stamped with the process's current instant, and counted as late; the report says how late
//! inputs were and how far handling lagged behind the model.
//!
//! ## Modules
//! `clock` (model time on the wall clock), `wire` (frames and their codec), `schedule` (the
//! stamped input queue), `worker` (a worker process), `frontend` (the frontend's process),
//! `launch` (starting and stopping worker processes), `metrics` (each worker's `/metrics`).

pub mod clock;
pub mod frontend;
pub mod launch;
pub mod link;
pub mod metrics;
pub mod schedule;
pub mod wire;
pub mod worker;

use crate::adapters::replay::config::ReplayConfig;
use serde::{Deserialize, Serialize};

/// Why a live process could not run or finish.
#[derive(Debug, thiserror::Error)]
pub enum LiveError {
    #[error(transparent)]
    Replay(#[from] crate::adapters::replay::engine::ReplayError),
    #[error(transparent)]
    Log(#[from] crate::events::LogError),
    #[error("{0}")]
    Config(String),
    /// A peer broke the protocol or the connection failed; names the peer.
    #[error("{peer}: {what}")]
    Link { peer: String, what: String },
    #[error("{0}")]
    Io(String),
    #[error("{0}")]
    Runtime(String),
}

impl From<crate::runtime::RuntimeError> for LiveError {
    fn from(e: crate::runtime::RuntimeError) -> Self {
        LiveError::Runtime(e.0)
    }
}

/// How a live run keeps time and watches its links. Sent to every worker in the handshake, so
/// all processes of a run use the same values.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LiveTiming {
    /// Wall time per model time: 0.1 runs ten times faster than the trace.
    pub time_scale: f64,
    /// Wall microseconds a worker waits past an own event's instant before handling it.
    pub event_hold_us: u64,
    /// Wall microseconds a worker waits past an instant before starting a step at it.
    pub step_hold_us: u64,
    /// Wall microseconds an idle worker woken by a message waits before its step takes its
    /// batch: messages of the same instant sent just after it are still on the wire.
    pub gather_us: u64,
    /// Wall microseconds the frontend waits past an arrival's (or a timer's) instant: the
    /// workers' reports stamped before it (a booking freed) must be in before it routes.
    pub arrival_hold_us: u64,
    /// Wall microseconds the frontend holds a worker's report past its instant, so reports of
    /// one instant from several workers are taken in worker order.
    pub report_hold_us: u64,
    /// Model milliseconds between heartbeats on every link; a link silent for two of them
    /// (and a little slack) counts as lost.
    pub heartbeat_ms: u64,
}

impl LiveTiming {
    /// SGLang's heartbeat is 5 s with two misses; the holds cover a few loopback hops on a
    /// busy machine (see the module docs).
    pub fn new(time_scale: f64) -> Self {
        LiveTiming {
            time_scale,
            // A worker's report leaves once its own hold (2 ms) has passed and reaches the
            // frontend a loopback hop later; the frontend holds reports and arrivals 4 ms
            // longer, so the reports of one instant are all in and taken in order even when a
            // loaded machine delays a process by several milliseconds. What the frontend
            // relays then reaches a busy worker about 4 ms plus two hops after the worker's
            // own events of its instant, so it is handled late (its facts stamped later); a
            // step start waits just longer than the reports' hold, so such an input still
            // makes the batch it would have made in replay. The start's hold must stay close
            // to the reports' (within a step's wall duration): a step ends no earlier than its
            // start was handled, and its reports must still reach the frontend inside their
            // hold. See docs/live.md for what this buys and what it cannot.
            event_hold_us: 2_000,
            step_hold_us: 6_600,
            gather_us: 200,
            arrival_hold_us: 6_000,
            report_hold_us: 6_000,
            heartbeat_ms: 5_000,
        }
    }

    pub fn validate(&self) -> Result<(), LiveError> {
        if !(self.time_scale.is_finite() && self.time_scale > 0.0 && self.time_scale <= 1000.0) {
            return Err(LiveError::Config(format!(
                "--time-scale must be > 0 and at most 1000, got {}",
                self.time_scale
            )));
        }
        if self.heartbeat_ms == 0 {
            return Err(LiveError::Config("heartbeat_ms must be > 0".into()));
        }
        Ok(())
    }

    /// Wall time of one heartbeat interval.
    pub fn heartbeat_wall(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.heartbeat_ms as f64 / 1e3 * self.time_scale)
            .max(std::time::Duration::from_millis(20))
    }

    /// How long a link may stay silent before it counts as lost: two heartbeats, and slack for
    /// a busy machine.
    pub fn silence_limit(&self) -> std::time::Duration {
        self.heartbeat_wall() * 2 + std::time::Duration::from_millis(500)
    }
}

/// What live mode cannot run (replay-only features), said before anything starts.
pub fn check_supported(cfg: &ReplayConfig) -> Result<(), LiveError> {
    let refuse =
        |what: &str| Err(LiveError::Config(format!("{what} is replay-only; live mode has real faults")));
    if !cfg.faults.is_empty() {
        return refuse("a fault plan (`faults`)");
    }
    if !cfg.network.is_off() {
        return refuse("the simulated network (`network`)");
    }
    if cfg.contention.enabled {
        return Err(LiveError::Config(
            "transfer contention is modeled by the replay's shared-NIC simulator only; live mode times each transfer on its own".into(),
        ));
    }
    if !cfg.scale.is_empty() || cfg.planner.is_some() {
        return Err(LiveError::Config("planned scaling and the planner run in replay only so far".into()));
    }
    if !cfg.is_disaggregated() {
        return Err(LiveError::Config(
            "live mode runs a disaggregated cluster: give --prefill N --decode M".into(),
        ));
    }
    Ok(())
}
