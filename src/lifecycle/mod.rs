//! Role-local handoff state machines (source, destination) and the messages between them.
//!
//! Each worker owns the state of its own role only: a prefill worker runs a [`SourceHandoff`]
//! per handoff, a decode worker a [`DestinationHandoff`]. Replay composes both in one process;
//! live workers join them over TCP; the machines are the same and never know which.
//!
//! The machines are pure: `handle(event, at_ns)` validates one event and returns the local
//! actions the adapter must execute (engine-core commands, messages to the peer, timers) plus
//! the facts the adapter appends to the role's own stream. They read no clock (deadlines and
//! `at_ns` are inputs) and do no IO. The facts the engine core emits itself (`SourcePinned`,
//! `SourceReleased`, `DestinationReserved`, `DestinationActivated`, `ReservationReleased`) are
//! not repeated here; their outcomes come back to the machines as events.
//!
//! ## Rules both machines keep
//! - An invalid transition is a [`TransitionError`] and leaves the machine exactly as it was.
//! - A duplicate event is a no-op (a duplicate message also yields a `MessageRejected{Duplicate}`
//!   fact). Anything after `Released` is a no-op and never resurrects the handoff, with two
//!   deliberate exceptions that only *free* things: a source pin or destination reservation the
//!   core reports after the handoff was canceled is released at once (the core raced the cancel),
//!   and the first late message from a peer after a failed handoff is answered with one `Abort`
//!   so the peer frees its side without waiting for its own deadline.
//! - Every pin and reservation ends exactly once. An engine command that was issued but not yet
//!   acknowledged (`DispatchPrefill`, `ReserveDestination`) is cleaned up as if it had applied
//!   (`CancelPrefill`, `ReleaseDestination{reservation: None}`); the engine core treats a cleanup
//!   of something it already ended as a no-op.
//! - A message from an older generation of the peer is rejected (`StaleGeneration`). A message
//!   from a newer generation means the peer restarted and lost this handoff: the machine cancels
//!   with [`CancelReason::PeerLost`](crate::ids::CancelReason) (no `Abort` is sent to the new
//!   incarnation, which never knew the handoff). The first generation seen from a peer is simply
//!   learned, unless the constructor was given one.
//!
//! ## Disabled policy
//! [`HandoffPolicy::Disabled`](crate::ids::HandoffPolicy) means no handoff lifecycle at all: the
//! constructors refuse it with [`NewHandoffError::PolicyDisabled`] and the adapter runs the plain
//! request path instead.

pub mod destination;
pub mod messages;
pub mod policy;
pub mod source;

pub use destination::{
    DestinationAction, DestinationConfig, DestinationEvent, DestinationHandoff, DestinationInit,
    DestinationState, DestinationTransition,
};
pub use messages::{HandoffMessage, MessageBody};
pub use source::{
    SourceAction, SourceConfig, SourceEvent, SourceHandoff, SourceInit, SourceState, SourceTransition,
};

use crate::events::{Fact, MessageRejection};
use crate::ids::{Generation, HandoffId, HandoffPolicy, WorkerId};

/// What one event did: local actions for the adapter to execute, in order, and the facts to
/// append to the role's own stream, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transition<A> {
    pub actions: Vec<A>,
    pub facts: Vec<Fact>,
}

impl<A> Default for Transition<A> {
    fn default() -> Self {
        Transition { actions: Vec::new(), facts: Vec::new() }
    }
}

impl<A> Transition<A> {
    /// Nothing happened (a duplicate, late or stale event).
    pub fn none() -> Self {
        Self::default()
    }
    pub fn is_noop(&self) -> bool {
        self.actions.is_empty()
    }
}

/// An event that is not valid in the machine's current state. The machine is unchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("handoff {handoff}: event {event} is not valid in state {state}")]
pub struct TransitionError {
    pub handoff: HandoffId,
    pub state: &'static str,
    pub event: &'static str,
}

/// A machine could not be constructed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NewHandoffError {
    /// The Disabled policy has no handoff lifecycle; run the plain request path instead.
    #[error("handoff {0}: the disabled policy has no handoff lifecycle")]
    PolicyDisabled(HandoffId),
    /// The peer named at construction is this worker itself.
    #[error("handoff {0}: a worker cannot be its own peer")]
    SelfPeer(HandoffId),
}

/// What a role knows about its peer's session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PeerSession {
    pub worker: Option<WorkerId>,
    pub generation: Option<Generation>,
    /// An `Abort` already went to `worker`: never send a second.
    pub abort_sent: bool,
}

/// How an arriving message relates to the peer session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PeerCheck {
    /// Same incarnation (or the first one seen).
    Current,
    /// From an older incarnation: reject.
    Stale,
    /// From a newer incarnation: the peer restarted and lost this handoff.
    Restarted,
    /// From a worker that is not this handoff's peer: an invalid transition.
    Foreign,
}

impl PeerSession {
    pub fn new(worker: Option<WorkerId>, generation: Option<Generation>) -> Self {
        PeerSession { worker, generation, abort_sent: false }
    }

    pub fn check(&self, from: WorkerId, generation: Generation) -> PeerCheck {
        if let Some(w) = self.worker {
            if w != from {
                return PeerCheck::Foreign;
            }
        }
        match self.generation {
            None => PeerCheck::Current,
            Some(g) if generation < g => PeerCheck::Stale,
            Some(g) if generation > g => PeerCheck::Restarted,
            Some(_) => PeerCheck::Current,
        }
    }

    /// Learn the worker and generation from an accepted message.
    pub fn learn(&mut self, from: WorkerId, generation: Generation) {
        if self.worker.is_none() {
            self.worker = Some(from);
        }
        self.generation = Some(match self.generation {
            Some(g) => g.max(generation),
            None => generation,
        });
    }
}

pub(crate) fn check_policy(handoff: HandoffId, policy: HandoffPolicy) -> Result<(), NewHandoffError> {
    if policy == HandoffPolicy::Disabled {
        return Err(NewHandoffError::PolicyDisabled(handoff));
    }
    Ok(())
}

/// `MessageRejected` for a message that was not applied.
pub(crate) fn rejected(msg: &HandoffMessage, why: MessageRejection) -> Fact {
    msg.rejected_fact(why)
}
