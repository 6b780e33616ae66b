//! The per-worker runtime's role machines: a source or destination event goes into the
//! handoff's machine on that worker, and its actions come out as core commands, messages and
//! timers (a message after a command in one transition waits until the command is applied).

use super::simulator::Event;
use super::worker::{Command, Membership};
use super::{Replay, ReplayError, NS_PER_MS};
use crate::adapters::replay::transfer::TransferModel;
use crate::ids::{EndReason, HandoffId};
use crate::lifecycle::destination::{DestinationAction, DestinationEvent};
use crate::lifecycle::messages::HandoffMessage;
use crate::lifecycle::source::{SourceAction, SourceEvent};

/// One transition's actions as events, in order. A message that follows a core command in the
/// same transition waits until that command is applied: the worker may be mid-step, and e.g.
/// "receive completed" must not reach the source before the destination has activated.
#[derive(Default)]
struct Batch {
    events: Vec<Event>,
}

impl Batch {
    fn command(&mut self, slot: usize, command: Command) {
        self.events.push(Event::Command { slot, command, then: Vec::new() });
    }

    fn message(&mut self, slot: usize, msg: HandoffMessage) {
        let deliver = Event::Deliver { slot, msg };
        match self.events.iter_mut().rev().find(|e| matches!(e, Event::Command { .. })) {
            Some(Event::Command { then, .. }) => then.push(deliver),
            _ => self.events.push(deliver),
        }
    }
}

impl Replay<'_> {
    /// A message reaches the worker: the role machine of its handoff there takes it; with none,
    /// it is rejected as for an unknown handoff.
    pub(super) fn on_deliver(&mut self, slot: usize, msg: HandoffMessage) -> Result<(), ReplayError> {
        let handoff = msg.handoff;
        if self.slots[slot].sources.contains_key(&handoff) {
            self.source_event(slot, handoff, SourceEvent::Message(msg))?;
        } else if self.slots[slot].destinations.contains_key(&handoff) {
            self.destination_event(slot, handoff, DestinationEvent::Message(msg))?;
        } else if !matches!(self.slots[slot].membership, Membership::Left { .. }) {
            let f = msg.rejected_fact(crate::events::MessageRejection::UnknownHandoff);
            self.emit(slot, self.now_ns, f)?;
        }
        // (A worker that left has no transport: a straggler message to it is lost.)
        Ok(())
    }

    pub(super) fn source_event(
        &mut self,
        s: usize,
        handoff: HandoffId,
        ev: SourceEvent,
    ) -> Result<(), ReplayError> {
        let now = self.now_ns;
        let Some(m) = self.slots[s].sources.get_mut(&handoff) else {
            return Ok(());
        };
        let t = match m.handle(ev, now) {
            Ok(t) => t,
            Err(e) => {
                if let SourceEvent::Message(msg) = ev {
                    let f = msg.rejected_fact(crate::events::MessageRejection::InvalidTransition);
                    self.emit(s, now, f)?;
                }
                tracing::debug!(error = %e, "source event refused");
                return Ok(());
            }
        };
        let released = m.is_released();
        let success =
            matches!(m.state(), crate::lifecycle::source::SourceState::Released { how: EndReason::Success });
        self.emit_all(s, now, t.facts)?;
        let mut batch = Batch::default();
        for a in t.actions {
            match a {
                SourceAction::DispatchPrefill { lease_ns } => {
                    let Some(req) = self.handoff_request.get(&handoff).and_then(|r| self.guards.get(r))
                    else {
                        continue;
                    };
                    let request = req.request.clone();
                    // From here the core may compute it: the booking stays (see `computing`).
                    self.computing.insert(handoff);
                    batch.command(s, Command::DispatchPrefill { handoff, request, lease_ns });
                }
                // The prefill booking is freed when the core reports the pin's release.
                SourceAction::ReleaseSource { reason, .. } => {
                    batch.command(s, Command::ReleaseSource(handoff, reason))
                }
                SourceAction::CancelPrefill { reason } => {
                    batch.command(s, Command::CancelSource(handoff, reason))
                }
                SourceAction::Send { to, message } => batch.message(self.slot_of(to), message),
                SourceAction::ScheduleLeaseTimer { deadline_ns } => {
                    self.push(deadline_ns.max(now), Event::LeaseTimer { slot: s, handoff });
                }
            }
        }
        self.push_all(batch.events);
        if released {
            self.slots[s].sources.remove(&handoff);
            if let Some(req) = self.handoff_request.get(&handoff).copied() {
                if !success {
                    self.fail_unless_activated(req)?;
                }
            }
            self.forget_handoff(handoff);
        }
        Ok(())
    }

    pub(super) fn destination_event(
        &mut self,
        s: usize,
        handoff: HandoffId,
        ev: DestinationEvent,
    ) -> Result<(), ReplayError> {
        let now = self.now_ns;
        let Some(m) = self.slots[s].destinations.get_mut(&handoff) else {
            return Ok(());
        };
        let t = match m.handle(ev, now) {
            Ok(t) => t,
            Err(e) => {
                if let DestinationEvent::Message(msg) = ev {
                    let f = msg.rejected_fact(crate::events::MessageRejection::InvalidTransition);
                    self.emit(s, now, f)?;
                }
                tracing::debug!(error = %e, "destination event refused");
                return Ok(());
            }
        };
        let released = m.is_released();
        self.emit_all(s, now, t.facts)?;
        let mut batch = Batch::default();
        for a in t.actions {
            match a {
                DestinationAction::ReserveDestination { deadline_ns } => {
                    let Some(req) = self.handoff_request.get(&handoff).and_then(|r| self.guards.get(r))
                    else {
                        continue;
                    };
                    let request = req.request.clone();
                    batch.command(s, Command::Reserve { handoff, request, deadline_ns });
                }
                DestinationAction::StartReceive { from, missing_tokens, bytes } => {
                    if self.contention.is_some() {
                        self.start_shared_transfer(s, handoff, from, bytes)?;
                    } else {
                        let at = now.saturating_add(self.transfer.transfer_ns(missing_tokens as u64));
                        self.push(at, Event::TransferDone { slot: s, handoff });
                    }
                }
                DestinationAction::ActivateDestination { .. } => {
                    if let Some(req) = self.handoff_request.get(&handoff).copied() {
                        if let Some(g) = self.guards.get_mut(&req) {
                            g.activated = true;
                        }
                    }
                    batch.command(s, Command::Activate(handoff));
                }
                DestinationAction::ReleaseDestination { reason, .. } => {
                    batch.command(s, Command::CancelDestination(handoff, reason))
                }
                DestinationAction::AbortRequest { reason } => {
                    batch.command(s, Command::CancelDestination(handoff, EndReason::Canceled(reason)))
                }
                DestinationAction::Send { to, message } => batch.message(self.slot_of(to), message),
                DestinationAction::ScheduleReservationTimer { deadline_ns } => {
                    self.push(deadline_ns.max(now), Event::ReservationTimer { slot: s, handoff });
                }
            }
        }
        self.push_all(batch.events);
        if released {
            self.cancel_shared_transfer(handoff);
            self.slots[s].destinations.remove(&handoff);
            if let Some(req) = self.handoff_request.get(&handoff).copied() {
                self.fail_unless_activated(req)?;
            }
            self.forget_handoff(handoff);
        }
        Ok(())
    }

    /// The destination's heartbeat: while it still waits to read, it renews the source lease.
    pub(super) fn on_renew(&mut self, s: usize, handoff: HandoffId) -> Result<(), ReplayError> {
        let now = self.now_ns;
        let Some(m) = self.slots[s].destinations.get(&handoff) else {
            return Ok(());
        };
        if !matches!(m.state_name(), "NotRouted" | "Reserving" | "Reserved") {
            return Ok(());
        }
        self.destination_event(s, handoff, DestinationEvent::RenewLease)?;
        if let Some(renew) = self.cfg.lease_renew_ms {
            self.push(now.saturating_add(renew * NS_PER_MS), Event::RenewTimer { slot: s, handoff });
        }
        Ok(())
    }
}
