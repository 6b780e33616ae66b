//! The scheduler view, folded from one engine stream: which requests wait, run, wait for remote
//! KV, are held as pinned prefills, or wait in the reservation FIFO.
//!
//! Rules (the contract engine cores emit against):
//! * `RequestQueued` → waiting; `RequestScheduled` waiting → running; `RequestPreempted`
//!   running → waiting; `RequestFinished` / `RequestRejected` remove the request wherever it is.
//! * `SourcePinned` removes the request from running and holds the handoff;
//!   `SourceReleased` ends the hold.
//! * `ReservationQueued` adds to the pending FIFO; `ReservationDequeued` removes from it.
//! * `DestinationReserved` leaves the FIFO (if there) and waits for remote KV;
//!   `DestinationActivated` turns it into a waiting request (no separate `RequestQueued`);
//!   `ReservationReleased` ends it.
//!
//! Memory grows with requests in flight, not with stream length.

use crate::events::Fact;
use crate::ids::{HandoffId, RequestId};
use crate::model::view::SchedulerView;
use std::collections::{BTreeMap, BTreeSet};

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
enum Phase {
    Waiting,
    Running,
}

/// Where a request is, for violation messages.
fn phase_text(phase: Option<&Phase>) -> &'static str {
    match phase {
        Some(Phase::Waiting) => "waiting",
        Some(Phase::Running) => "running",
        None => "not queued",
    }
}

/// A fact the fold could not place (the stream contradicts itself).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("scheduler view: {0}")]
pub struct ViewViolation(pub String);

/// Serializable so an index can store it in a checkpoint and resume the fold mid-stream.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SchedulerFold {
    requests: BTreeMap<RequestId, Phase>,
    /// Requests in `Running`, kept as a count so `view` is O(1) (timelines call it per record).
    running: u64,
    held: BTreeSet<HandoffId>,
    pending: BTreeSet<HandoffId>,
    reserved: BTreeMap<HandoffId, RequestId>,
}

impl SchedulerFold {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn view(&self) -> SchedulerView {
        let running = self.running;
        SchedulerView {
            waiting: self.requests.len() as u64 - running,
            running,
            waiting_for_remote_kv: self.reserved.len() as u64,
            held_prefills: self.held.len() as u64,
            pending_reservations: self.pending.len() as u64,
        }
    }

    pub fn apply(&mut self, fact: &Fact) -> Result<(), ViewViolation> {
        let err = |m: String| Err(ViewViolation(m));
        match fact {
            Fact::RequestQueued { request } if self.requests.insert(*request, Phase::Waiting).is_some() => {
                return err(format!("{request} queued twice"));
            }
            Fact::RequestScheduled { request, .. } => match self.requests.get_mut(request) {
                Some(p @ Phase::Waiting) => {
                    *p = Phase::Running;
                    self.running += 1;
                }
                other => return err(format!("{request} scheduled while {}", phase_text(other.as_deref()))),
            },
            Fact::RequestPreempted { request, .. } => match self.requests.get_mut(request) {
                Some(p @ Phase::Running) => {
                    *p = Phase::Waiting;
                    self.running -= 1;
                }
                other => return err(format!("{request} preempted while {}", phase_text(other.as_deref()))),
            },
            Fact::RequestFinished { request, .. } | Fact::RequestRejected { request, .. }
                if self.requests.remove(request) == Some(Phase::Running) =>
            {
                self.running -= 1;
            }
            Fact::SourcePinned { handoff, request, .. } => {
                if self.requests.remove(request) != Some(Phase::Running) {
                    return err(format!("{request} pinned while not running"));
                }
                self.running -= 1;
                if !self.held.insert(*handoff) {
                    return err(format!("handoff {handoff} pinned twice"));
                }
            }
            Fact::SourceReleased { handoff, .. } if !self.held.remove(handoff) => {
                return err(format!("handoff {handoff} released but not held"));
            }
            Fact::ReservationQueued { handoff } if !self.pending.insert(*handoff) => {
                return err(format!("handoff {handoff} queued twice"));
            }
            Fact::ReservationDequeued { handoff, .. } if !self.pending.remove(handoff) => {
                return err(format!("handoff {handoff} dequeued but not pending"));
            }
            Fact::DestinationReserved { handoff, request, .. } => {
                self.pending.remove(handoff);
                if self.reserved.insert(*handoff, *request).is_some() {
                    return err(format!("handoff {handoff} reserved twice"));
                }
            }
            Fact::DestinationActivated { handoff, .. } => match self.reserved.remove(handoff) {
                Some(request) => {
                    if self.requests.insert(request, Phase::Waiting).is_some() {
                        return err(format!("{request} activated while already queued"));
                    }
                }
                None => return err(format!("handoff {handoff} activated but not reserved")),
            },
            Fact::ReservationReleased { handoff, .. } if self.reserved.remove(handoff).is_none() => {
                return err(format!("handoff {handoff} reservation released but not held"));
            }
            // The process that held these queues is gone; its successor starts with none.
            Fact::SessionLost { .. } => *self = SchedulerFold::new(),
            _ => {}
        }
        Ok(())
    }
}
