//! The per-worker runtime: a worker's slot (engine core, inbox, role machines, generation),
//! starting steps, the inbox rule (commands wait for the step in flight), each command's call
//! into the core, and the core's outputs mapped to role-machine events and frontend outcomes.

use super::liveness::PreemptionStreak;
use super::simulator::Event;
use super::{Replay, ReplayError};
use crate::events::{Fact, TerminalStatus};
use crate::ids::{CancelReason, EndReason, Generation, HandoffId, HandoffPolicy, RequestId, Role, WorkerId};
use crate::lifecycle::destination::{DestinationEvent, DestinationHandoff};
use crate::lifecycle::source::{SourceEvent, SourceHandoff};
use crate::schedulers::{
    CommandError, CommandOutcome, CommandResult, Effects, EngineCore, EngineOutput, Request,
};
use std::collections::{BTreeMap, VecDeque};

/// Zero-duration steps in a row at one instant before a worker is declared stuck in a loop.
const MAX_ZERO_STEPS: u32 = 10_000;

/// A command for one worker, applied when the worker is between steps.
#[derive(Clone, Debug)]
pub(super) enum Command {
    Submit(Request),
    /// Disabled policy's decode: the prompt's KV came with the request.
    SubmitPrefilled(Request),
    DispatchPrefill {
        handoff: HandoffId,
        request: Request,
        lease_ns: u64,
    },
    Reserve {
        handoff: HandoffId,
        request: Request,
        deadline_ns: u64,
    },
    Activate(HandoffId),
    ReleaseSource(HandoffId, EndReason),
    CancelSource(HandoffId, CancelReason),
    CancelDestination(HandoffId, EndReason),
}

pub(super) struct Slot {
    pub(super) id: WorkerId,
    pub(super) core: Box<dyn EngineCore>,
    /// A step is in flight; its effects wait in `pending` until `StepDone`.
    pub(super) busy: bool,
    pub(super) pending: Option<Effects>,
    pub(super) inbox: VecDeque<(Command, Vec<Event>)>,
    pub(super) generation: Generation,
    pub(super) sources: BTreeMap<HandoffId, SourceHandoff>,
    pub(super) destinations: BTreeMap<HandoffId, DestinationHandoff>,
    zero_steps: (u64, u32),
    /// The latest run of preemptions of one request with nothing finishing on this worker
    /// (see [`Replay::note_preemption`]).
    pub(super) preemptions: Option<PreemptionStreak>,
    pub(super) membership: Membership,
}

impl Slot {
    pub(super) fn new(id: WorkerId, core: Box<dyn EngineCore>) -> Self {
        Slot {
            id,
            core,
            busy: false,
            pending: None,
            inbox: VecDeque::new(),
            generation: Generation(1),
            sources: BTreeMap::new(),
            destinations: BTreeMap::new(),
            zero_steps: (u64::MAX, 0),
            preemptions: None,
            membership: Membership::Active,
        }
    }
}

/// Where a worker stands in the cluster (see `scaling`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Membership {
    /// Routers may select it.
    Active,
    /// Taken out of routing; it finishes what it holds, then leaves.
    Leaving,
    /// Drained and gone (its stream ends with `WorkerLeft` at this instant).
    Left { at_ns: u64 },
}

impl Replay<'_> {
    /// Writes one of worker `slot`'s facts to its stream. Some facts are also read here as
    /// signals (each a message once issue #10 splits the frontend off): KV facts feed both
    /// routers' indexes, a pin's start and release keep the prefill booking (`pinned`,
    /// [`Replay::source_released`]), and preemptions feed the livelock watch.
    pub(super) fn emit(&mut self, slot: usize, at_ns: u64, fact: Fact) -> Result<(), ReplayError> {
        if Self::is_progress(&fact) {
            self.last_progress_ns = at_ns;
        }
        let worker = self.slots[slot].id;
        if matches!(fact, Fact::KvStored { .. } | Fact::KvRemoved { .. } | Fact::KvCleared) {
            self.prefill_router.observe(worker, &fact);
            if let Some(d) = self.decode_router.as_mut() {
                d.observe(worker, &fact);
            }
        }
        // Router bookings follow physical pins: the prefill booking lives until the core
        // reports the source released (the proposal's accounting table).
        let released = match &fact {
            Fact::RequestPreempted { request, .. } => {
                self.note_preemption(slot, *request, at_ns);
                None
            }
            // Progress on the worker: a request finished, pinned its prefill or got its first
            // token.
            Fact::RequestFinished { .. } | Fact::FirstTokenEmitted { .. } => {
                self.slots[slot].preemptions = None;
                None
            }
            Fact::SourcePinned { handoff, .. } => {
                self.slots[slot].preemptions = None;
                self.pinned.insert(*handoff);
                None
            }
            Fact::SourceReleased { handoff, .. } => {
                self.pinned.remove(handoff);
                self.handoff_request.get(handoff).copied()
            }
            _ => None,
        };
        self.sink.push(worker, at_ns, fact)?;
        if let Some(req) = released {
            self.source_released(req, at_ns)?;
        }
        Ok(())
    }

    pub(super) fn emit_all(&mut self, slot: usize, at_ns: u64, facts: Vec<Fact>) -> Result<(), ReplayError> {
        for f in facts {
            self.emit(slot, at_ns, f)?;
        }
        Ok(())
    }

    /// A step ended: its effects are applied, then every command that waited in the inbox (each
    /// followed by the events that waited for it), and the worker starts again after everything
    /// else due at this instant.
    pub(super) fn on_step_done(&mut self, s: usize) -> Result<(), ReplayError> {
        let now = self.now_ns;
        // (`is_some` first: taking moves the whole run, and most boundaries have none.)
        if self.quiet.runs[s].is_some() {
            if let Some(q) = self.quiet.runs[s].take() {
                self.finish_quiet(s, q)?;
            }
        }
        self.slots[s].busy = false;
        if let Some(effects) = self.slots[s].pending.take() {
            self.apply_effects(s, effects)?;
        }
        while let Some((command, then)) = self.slots[s].inbox.pop_front() {
            self.execute(s, command)?;
            self.push_all(then);
        }
        if self.queue.has_due(now) {
            self.queue.push_start(s, now);
        } else {
            // Nothing else is due at this instant (no event, no other start), so
            // starting now is starting after everything of the instant: skip the
            // round trip through the queue that most step boundaries would take.
            self.kick(s)?;
        }
        Ok(())
    }

    /// The inbox rule: a command reaching a busy worker waits for the step in flight (a quiet
    /// run is cut at that step first); an idle worker applies it at once, then `then`, and
    /// starts a step after everything else due now.
    pub(super) fn on_command(
        &mut self,
        slot: usize,
        command: Command,
        then: Vec<Event>,
    ) -> Result<(), ReplayError> {
        let now = self.now_ns;
        if self.slots[slot].busy && self.quiet.runs[slot].is_some() {
            if let Some(q) = self.quiet.runs[slot].take() {
                // Leaves the worker free if its last step ended right now.
                self.cut_quiet(slot, q)?;
            }
        }
        if self.slots[slot].busy {
            self.slots[slot].inbox.push_back((command, then));
        } else {
            self.execute(slot, command)?;
            self.push_all(then);
            self.queue.push_start(slot, now);
        }
        Ok(())
    }

    /// Starts a step on an idle worker that has work.
    pub(super) fn kick(&mut self, s: usize) -> Result<(), ReplayError> {
        let now = self.now_ns;
        loop {
            if self.slots[s].busy || self.slots[s].core.is_empty() {
                return Ok(());
            }
            if let Some(fx) = self.spare_effects.pop() {
                self.slots[s].core.recycle(fx);
            }
            let out = self.slots[s].core.step(now);
            if out.duration_ns > 0 {
                if self.quiet.enabled {
                    if let Some(q) = self.quiet_run(s, now, &out) {
                        let slot = &mut self.slots[s];
                        slot.busy = true;
                        slot.zero_steps = (u64::MAX, 0);
                        self.queue.push_lane(s, q.end_of(q.steps), Event::StepDone(s));
                        self.quiet.runs[s] = Some(q);
                        self.quiet.refresh(s);
                        self.recycle_effects(out.effects);
                        return Ok(());
                    }
                }
                let slot = &mut self.slots[s];
                slot.busy = true;
                slot.pending = Some(out.effects);
                slot.zero_steps = (u64::MAX, 0);
                self.queue.push_lane(s, now.saturating_add(out.duration_ns), Event::StepDone(s));
                return Ok(());
            }
            if out.effects.facts.is_empty() && out.effects.outputs.is_empty() {
                // Runnable work that cannot run now (e.g. waiting for blocks): idle until a
                // command changes something.
                return Ok(());
            }
            let z = &mut self.slots[s].zero_steps;
            if z.0 == now {
                z.1 += 1;
                if z.1 > MAX_ZERO_STEPS {
                    return Err(ReplayError::Engine(format!(
                        "{} made no progress: {MAX_ZERO_STEPS} zero-length steps at t={} ms",
                        self.slots[s].id,
                        now as f64 / 1e6
                    )));
                }
            } else {
                *z = (now, 1);
            }
            self.apply_effects(s, out.effects)?;
        }
    }

    pub(super) fn execute(&mut self, s: usize, command: Command) -> Result<(), ReplayError> {
        let now = self.now_ns;
        let core = &mut self.slots[s].core;
        match command {
            Command::Submit(request) => {
                let id = request.id;
                let r = core.submit(request, now);
                self.command_result(s, r, None, Some(id))
            }
            Command::SubmitPrefilled(request) => {
                let id = request.id;
                let r = core.submit_prefilled(request, now);
                self.command_result(s, r, None, Some(id))
            }
            Command::DispatchPrefill { handoff, request, lease_ns } => {
                let id = request.id;
                let r = core.submit_handoff_prefill(handoff, request, lease_ns, now);
                if r.outcome.is_err() {
                    self.source_left_core(handoff)?; // refused: the core never held it
                }
                self.command_result(s, r, Some(handoff), Some(id))
            }
            Command::Reserve { handoff, request, deadline_ns } => {
                let r = core.reserve_destination(handoff, request, deadline_ns, now);
                self.command_result(s, r, Some(handoff), None)
            }
            Command::Activate(h) => {
                let r = core.activate_destination(h, now);
                self.command_result(s, r, Some(h), None)
            }
            Command::ReleaseSource(h, reason) => {
                let r = core.release_source(h, reason, now);
                self.command_result(s, r, Some(h), None)
            }
            Command::CancelSource(h, reason) => {
                let r = core.cancel_source(h, reason, now);
                self.command_result(s, r, Some(h), None)?;
                // The core no longer computes this prefill (it ended it, or released the pin
                // the step in flight made).
                self.source_left_core(h)
            }
            Command::CancelDestination(h, reason) => {
                // The core's cancel names a cause; an expired reservation is canceled as expired.
                let reason = match reason {
                    EndReason::Canceled(r) => r,
                    EndReason::Expired => CancelReason::Expired,
                    EndReason::Success => CancelReason::TransferFailed,
                };
                let r = core.cancel_destination(h, reason, now);
                self.command_result(s, r, Some(h), None)
            }
        }
    }

    fn command_result(
        &mut self,
        s: usize,
        r: CommandResult,
        handoff: Option<HandoffId>,
        request: Option<RequestId>,
    ) -> Result<(), ReplayError> {
        self.apply_effects(s, r.effects)?;
        match r.outcome {
            Ok(CommandOutcome::Applied | CommandOutcome::NoOp | CommandOutcome::Unavailable) => Ok(()),
            Err(e) => self.command_failed(s, e, handoff, request),
        }
    }

    /// A command the core refused: the handoff (or plain request) fails with a terminal outcome
    /// so every booking and every resource is released.
    fn command_failed(
        &mut self,
        s: usize,
        e: CommandError,
        handoff: Option<HandoffId>,
        request: Option<RequestId>,
    ) -> Result<(), ReplayError> {
        let reason = match e {
            CommandError::Unsupported { .. } => CancelReason::Unsupported,
            CommandError::NeverFits { .. } => CancelReason::DestinationRejected,
            // Unknown handoffs and invalid states mean an action raced a cleanup the core
            // already did: nothing to unwind.
            CommandError::UnknownHandoff(_)
            | CommandError::InvalidState { .. }
            | CommandError::DuplicateHandoff(_) => {
                tracing::debug!(worker = %self.slots[s].id, error = %e, "command refused");
                return Ok(());
            }
        };
        if let Some(req) = request.or_else(|| handoff.and_then(|h| self.handoff_request.get(&h).copied())) {
            if let Some(g) = self.guards.get_mut(&req) {
                g.fail_status = Some(TerminalStatus::Rejected);
            }
        }
        match handoff {
            Some(h) if self.slots[s].sources.contains_key(&h) => {
                self.source_event(s, h, SourceEvent::PrefillFailed { reason })?;
            }
            Some(h) if self.slots[s].destinations.contains_key(&h) => {
                self.destination_event(s, h, DestinationEvent::ReservationFailed { reason })?;
            }
            _ => {}
        }
        // Whatever the machines did, the request ends now (a no-op if they already ended it).
        if let Some(req) = request.or_else(|| handoff.and_then(|h| self.handoff_request.get(&h).copied())) {
            self.terminal(req, TerminalStatus::Rejected, 0)?;
        }
        Ok(())
    }

    pub(super) fn apply_effects(&mut self, s: usize, mut effects: Effects) -> Result<(), ReplayError> {
        let now = self.now_ns;
        for f in effects.facts.drain(..) {
            self.emit(s, now, f)?;
        }
        for o in effects.outputs.drain(..) {
            self.on_output(s, o)?;
        }
        self.recycle_effects(effects);
        Ok(())
    }

    /// The emptied vectors wait for whichever core steps next: the most recently drained
    /// buffer is the one still in cache.
    fn recycle_effects(&mut self, mut effects: Effects) {
        if self.spare_effects.len() < self.slots.len() {
            effects.facts.clear();
            effects.outputs.clear();
            self.spare_effects.push(effects);
        }
    }

    fn on_output(&mut self, s: usize, o: EngineOutput) -> Result<(), ReplayError> {
        let now = self.now_ns;
        match o {
            EngineOutput::FirstToken { request } => {
                // The user's first token comes from decode (a prefill worker's is its own).
                if self.planner.is_some() && self.slots[s].id.role != Role::Prefill {
                    if let Some(g) = self.guards.get_mut(&request) {
                        g.first_token_ns.get_or_insert(now);
                    }
                }
                // Aggregated: prefill compute ends with the first token.
                if self.policy == HandoffPolicy::Disabled {
                    if let Some(f) = self.prefill_router.prefill_compute_done(request) {
                        self.emit_router(now, f)?;
                    }
                }
            }
            EngineOutput::Finished { request, status, output_tokens }
                if status == TerminalStatus::Completed && self.disabled_prefill(s) =>
            {
                let _ = output_tokens; // the one token a disaggregated prefill makes
                self.prefill_finished_unpinned(request)?;
            }
            EngineOutput::Finished { request, status, output_tokens } => {
                if let Some(h) = self.guards.get(&request).and_then(|g| g.handoff) {
                    if self.slots[s].destinations.contains_key(&h) {
                        self.destination_event(s, h, DestinationEvent::RequestFinished)?;
                    }
                }
                self.terminal(request, status, output_tokens)?;
            }
            EngineOutput::Rejected { request, .. } => {
                self.terminal(request, TerminalStatus::Rejected, 0)?;
            }
            EngineOutput::SourcePinned { handoff, request, lease, blocks, deadline_ns } => {
                self.computing.remove(&handoff); // now a pin (tracked in `pinned`)
                if let Some(f) = self.prefill_router.prefill_compute_done(request) {
                    self.emit_router(now, f)?;
                }
                // Source-first: the decode is routed once the prefill is done and pinned.
                let needs_route = self.guards.get(&request).is_some_and(|g| g.decode.is_none());
                if needs_route && self.policy == HandoffPolicy::SourceFirst {
                    let req = self.guards[&request].request.clone();
                    let d_slot = self.route_decode(request, &req)?;
                    if let Some(g) = self.guards.get_mut(&request) {
                        g.decode = Some(d_slot);
                    }
                    self.start_destination(d_slot, handoff, &req, s)?;
                }
                self.source_event(s, handoff, SourceEvent::PrefillPinned { lease, blocks, deadline_ns })?;
            }
            EngineOutput::DestinationReserved { handoff, reservation, summary } => {
                self.destination_event(
                    s,
                    handoff,
                    DestinationEvent::Reserved {
                        reservation,
                        prefix_tokens: summary.prefix_tokens,
                        missing_tokens: summary.missing_tokens,
                    },
                )?;
            }
            EngineOutput::ReservationFailed { handoff, .. } => {
                if let Some(g) = self.handoff_request.get(&handoff).and_then(|r| self.guards.get_mut(r)) {
                    g.fail_status = Some(TerminalStatus::Rejected);
                }
                self.destination_event(
                    s,
                    handoff,
                    DestinationEvent::ReservationFailed { reason: CancelReason::DestinationRejected },
                )?;
                if let Some(req) = self.handoff_request.get(&handoff).copied() {
                    self.terminal(req, TerminalStatus::Rejected, 0)?;
                }
            }
        }
        Ok(())
    }

    /// A prefill worker under the Disabled policy on a disaggregated cluster.
    fn disabled_prefill(&self, s: usize) -> bool {
        self.policy == HandoffPolicy::Disabled && self.slots[s].id.role == Role::Prefill
    }
}
