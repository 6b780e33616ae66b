//! The handoff bookkeeping both engine cores share: the table of the handoffs a core holds (one
//! per role), the rule that answers a command naming a handoff, the FIFO of reservations waiting
//! for capacity, and the counters that mint lease and reservation ids.
//!
//! ## The rule
//! A core answers a command by what it knows of the handoff it names ([`answer`]):
//!
//! | command | held | ended (remembered) | never seen |
//! |---|---|---|---|
//! | start (`submit_handoff_prefill`, `reserve_destination`) | `DuplicateHandoff` | `DuplicateHandoff` | the core's own logic |
//! | activate, release, cancel | the core's own logic | `Ok(NoOp)` | `UnknownHandoff` |
//!
//! Every start the core does not refuse as a duplicate either enters the table or ends at once
//! (a refusal: [`HandoffTable::refuse`]), so a late command on a refused handoff is a `NoOp`
//! like one on a handoff that ran to its end. A [`HandoffId`] names one attempt and is never
//! reused, which is why starting an ended one again is a duplicate.
//!
//! The memory of ended handoffs is bounded ([`ENDED_MEMORY`] per table, oldest forgotten first)
//! so it follows the handoffs in flight rather than the length of the run; a command that
//! arrives after its handoff was forgotten gets `UnknownHandoff`.
//!
//! ## Pending reservations
//! [`PendingReservations`] is the FIFO of destination reservations that could not be made when
//! they arrived. A reservation never overtakes a queued one: it is tried at arrival only when
//! the FIFO is empty. Only the head is retried, and only when the core's capacity epoch (which
//! each core bumps whenever capacity returns) moved since the head's last attempt.

use crate::ids::{DestinationReservationId, HandoffId, SourceLeaseId};
use crate::schedulers::{CommandError, CommandOutcome, Request};
use std::collections::{BTreeMap, HashSet, VecDeque};

/// How many ended handoffs a table remembers, to answer a late command with `NoOp` instead of
/// `UnknownHandoff`.
pub const ENDED_MEMORY: usize = 8192;

/// A command's answer.
pub type Answer = Result<CommandOutcome, CommandError>;

/// What a core knows of a handoff.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// In the table: the core holds something for it.
    Held,
    /// Held once (or refused at its start) and ended; still remembered.
    Ended,
    /// Never seen, or ended so long ago that it was forgotten.
    NeverSeen,
}

/// What a command does to its handoff.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Intent {
    /// Registers it: `submit_handoff_prefill`, `reserve_destination`.
    Start,
    /// Acts on one already registered: activate, release, cancel.
    Act,
}

/// The rule (see the module docs). `None`: the core's own logic decides.
pub fn answer(handoff: HandoffId, standing: Standing, intent: Intent) -> Option<Answer> {
    match (intent, standing) {
        (Intent::Start, Standing::NeverSeen) | (Intent::Act, Standing::Held) => None,
        (Intent::Start, Standing::Held | Standing::Ended) => {
            Some(Err(CommandError::DuplicateHandoff(handoff)))
        }
        (Intent::Act, Standing::Ended) => Some(Ok(CommandOutcome::NoOp)),
        (Intent::Act, Standing::NeverSeen) => Some(Err(CommandError::UnknownHandoff(handoff))),
    }
}

/// The last [`ENDED_MEMORY`] handoffs that ended in one table.
#[derive(Clone, Debug, Default)]
struct EndedHandoffs {
    order: VecDeque<HandoffId>,
    set: HashSet<HandoffId>,
}

impl EndedHandoffs {
    fn add(&mut self, handoff: HandoffId) {
        if self.set.insert(handoff) {
            self.order.push_back(handoff);
            if self.order.len() > ENDED_MEMORY {
                if let Some(oldest) = self.order.pop_front() {
                    self.set.remove(&oldest);
                }
            }
        }
    }

    fn contains(&self, handoff: &HandoffId) -> bool {
        self.set.contains(handoff)
    }
}

/// The handoffs of one role a core holds, keyed by id, with each core's own entry, and the
/// memory of those that ended.
#[derive(Clone, Debug)]
pub struct HandoffTable<E> {
    held: BTreeMap<HandoffId, E>,
    ended: EndedHandoffs,
}

impl<E> Default for HandoffTable<E> {
    fn default() -> Self {
        HandoffTable { held: BTreeMap::new(), ended: EndedHandoffs::default() }
    }
}

impl<E> HandoffTable<E> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn standing(&self, handoff: HandoffId) -> Standing {
        if self.held.contains_key(&handoff) {
            Standing::Held
        } else if self.ended.contains(&handoff) {
            Standing::Ended
        } else {
            Standing::NeverSeen
        }
    }

    /// The rule for a start: `DuplicateHandoff` if the handoff is held or ended; `None` (the
    /// core's own logic decides) if it was never seen.
    pub fn start_answer(&self, handoff: HandoffId) -> Option<Answer> {
        answer(handoff, self.standing(handoff), Intent::Start)
    }

    /// The rule for any other command: the entry when the core holds the handoff (its own logic
    /// decides), else the answer (`NoOp` for an ended one, `UnknownHandoff` otherwise).
    pub fn lookup(&self, handoff: HandoffId) -> Result<&E, Answer> {
        match self.held.get(&handoff) {
            Some(entry) => Ok(entry),
            None => Err(answer(handoff, self.standing(handoff), Intent::Act)
                .unwrap_or(Err(CommandError::UnknownHandoff(handoff)))),
        }
    }

    pub fn get(&self, handoff: &HandoffId) -> Option<&E> {
        self.held.get(handoff)
    }

    pub fn get_mut(&mut self, handoff: &HandoffId) -> Option<&mut E> {
        self.held.get_mut(handoff)
    }

    /// Holds `entry` for `handoff`: a start, or a new phase replacing the previous entry.
    pub fn hold(&mut self, handoff: HandoffId, entry: E) {
        self.held.insert(handoff, entry);
    }

    /// Takes the entry out without ending the handoff: the caller holds its next phase.
    pub fn take(&mut self, handoff: &HandoffId) -> Option<E> {
        self.held.remove(handoff)
    }

    /// The handoff ended here: its entry leaves and it is remembered. Ending it again is
    /// harmless (`None`).
    pub fn end(&mut self, handoff: HandoffId) -> Option<E> {
        self.ended.add(handoff);
        self.held.remove(&handoff)
    }

    /// Ends a held handoff and returns its entry; for any other, the rule's answer.
    pub fn end_held(&mut self, handoff: HandoffId) -> Result<E, Answer> {
        self.lookup(handoff)?;
        self.end(handoff).ok_or(Err(CommandError::UnknownHandoff(handoff)))
    }

    /// A start refused at once (it never held anything): remembered as ended.
    pub fn refuse(&mut self, handoff: HandoffId) {
        self.ended.add(handoff);
    }

    pub fn values(&self) -> impl Iterator<Item = &E> {
        self.held.values()
    }

    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

/// A destination reservation that waits for capacity.
#[derive(Clone, Debug)]
pub struct PendingReservation {
    pub handoff: HandoffId,
    /// Retained for the reservation; never resubmitted.
    pub request: Request,
    pub deadline_ns: u64,
    /// Capacity epoch of the last attempt (`None`: never tried).
    pub tried_epoch: Option<u64>,
}

/// What a new reservation does on arrival.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// The FIFO is empty: try it now (queue it, tried, if it does not fit).
    TryNow,
    /// Others wait: queue it, untried, behind them.
    Queue,
    /// The FIFO is at its bound: refuse it for good.
    Full,
}

/// The FIFO of pending reservations (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct PendingReservations {
    fifo: VecDeque<PendingReservation>,
}

impl PendingReservations {
    pub fn new() -> Self {
        Self::default()
    }

    /// What a reservation arriving now does, with the FIFO bounded to `bound` entries.
    pub fn arrival(&self, bound: u32) -> Arrival {
        if self.fifo.is_empty() {
            Arrival::TryNow
        } else if self.fifo.len() >= bound as usize {
            Arrival::Full
        } else {
            Arrival::Queue
        }
    }

    /// Queues at the back. `tried_epoch` is the epoch of the attempt just made, if any.
    pub fn push(&mut self, handoff: HandoffId, request: Request, deadline_ns: u64, tried_epoch: Option<u64>) {
        self.fifo.push_back(PendingReservation { handoff, request, deadline_ns, tried_epoch });
    }

    /// Whether the head is due for an attempt at `epoch`: never tried, or tried at another one.
    pub fn head_is_due(&self, epoch: u64) -> bool {
        self.fifo.front().is_some_and(|head| head.tried_epoch != Some(epoch))
    }

    /// Takes the head out if it is due at `epoch`. A failed attempt goes back with
    /// [`PendingReservations::put_back`].
    pub fn take_due(&mut self, epoch: u64) -> Option<PendingReservation> {
        if self.head_is_due(epoch) {
            self.fifo.pop_front()
        } else {
            None
        }
    }

    /// Returns the head taken by [`PendingReservations::take_due`] after a failed attempt at
    /// `epoch`.
    pub fn put_back(&mut self, pending: PendingReservation, epoch: u64) {
        self.fifo.push_front(PendingReservation { tried_epoch: Some(epoch), ..pending });
    }

    /// Removes `handoff`'s reservation, wherever it waits.
    pub fn remove(&mut self, handoff: HandoffId) -> Option<PendingReservation> {
        let at = self.fifo.iter().position(|p| p.handoff == handoff)?;
        self.fifo.remove(at)
    }

    pub fn len(&self) -> usize {
        self.fifo.len()
    }

    pub fn is_empty(&self) -> bool {
        self.fifo.is_empty()
    }
}

/// The counters a core mints its source lease and reservation ids from (each core starts at
/// its own first id).
#[derive(Clone, Debug)]
pub struct ResourceIds {
    next_lease: u64,
    next_reservation: u64,
}

impl ResourceIds {
    pub fn starting_at(first: u64) -> Self {
        ResourceIds { next_lease: first, next_reservation: first }
    }

    pub fn lease(&mut self) -> SourceLeaseId {
        let id = SourceLeaseId(self.next_lease);
        self.next_lease += 1;
        id
    }

    pub fn reservation(&mut self) -> DestinationReservationId {
        let id = DestinationReservationId(self.next_reservation);
        self.next_reservation += 1;
        id
    }
}

#[cfg(test)]
mod tests;
