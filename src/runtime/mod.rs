//! The worker runtime shared by replay and live: a sans-IO [`WorkerNode`] per worker, the
//! [`Frontend`], and the [`protocol`] they speak.
//!
//! Neither a node nor the frontend reads a clock, a socket or the other's state. Each input
//! names its instant and returns what it produced: facts for its own stream and messages,
//! timers and transfers for the driver (raft-rs's `Ready`). The offline replay
//! (`adapters::replay`) drives them on a virtual clock through an in-process network; live
//! mode drives the same types on a wall clock over TCP. See docs/architecture.md.

pub mod frontend;
pub mod node;
pub mod protocol;

pub use frontend::{
    Frontend, FrontendConfig, FrontendReady, LatencySample, Placement, PromptTransferTime, RequestEnded,
};
pub use node::{DeferredCommand, NodeConfig, NodeTimer, Output, Ready, StepPlan, TransferTiming, WorkerNode};
pub use protocol::{
    Body, Endpoint, Envelope, HandoffRole, Peer, ProtocolError, ToFrontend, ToWorker, PROTOCOL_VERSION,
};

/// A node or the frontend cannot go on (a bug or an impossible configuration, never bad
/// input from a peer: that is refused with a fact).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RuntimeError(pub String);
