//! The simulator: the event queue on a virtual clock, the run loop and the dispatch of each
//! event, the in-process address book (worker id → slot) and the transfer model (fixed
//! bandwidth, or NICs shared under `contention`).

use super::{Replay, ReplayError, ReplayOutcome};
use crate::adapters::replay::queue::EventQueue;
use crate::ids::{HandoffId, RequestId, Role, WorkerId};
use crate::lifecycle::messages::HandoffMessage;
use crate::runtime::{DeferredCommand, NodeTimer, TransferTiming};

#[derive(Clone, Debug)]
pub(super) enum Event {
    Arrival,
    StepDone(usize),
    /// A free worker with work starts its next step: queued to run after everything else due
    /// at its instant (see `queue`), so that requests arriving together share a step.
    StepStart(usize),
    /// A node's core command, handed back at its turn (the inbox rule is the node's).
    /// (Boxed: the queue moves every event several times, and this one is the largest.)
    Command {
        slot: usize,
        command: Box<DeferredCommand>,
    },
    /// A handoff message from the other role's worker.
    Deliver {
        slot: usize,
        msg: HandoffMessage,
    },
    TransferDone {
        slot: usize,
        handoff: HandoffId,
    },
    /// The NIC contention model's next instant of interest (a transfer finishing or its latency
    /// ending); stale ticks find nothing due.
    TransferTick,
    /// A node's lease, reservation or heartbeat timer.
    Timer {
        slot: usize,
        timer: NodeTimer,
    },
    BootstrapTimer {
        request: RequestId,
    },
    /// A delayed fault's time: only makes an event boundary, where the fault is checked.
    FaultTimer,
    /// The planned change `cfg.scale[i]` is due.
    Scale(usize),
    /// The planner looks at the recent requests (every `planner.interval_ms`).
    PlannerTick,
    /// A frontend message that reached a paused worker, delivered when it resumes, unless
    /// the worker crashed meanwhile (`generation` is the session it was sent to: a crash
    /// resets the connection and what waited in it is lost).
    FromFrontend {
        slot: usize,
        message: Box<crate::runtime::ToWorker>,
        generation: crate::ids::Generation,
    },
    /// The transport of a worker that was paused when its peer was lost tells it now.
    PeerLost {
        slot: usize,
        handoff: HandoffId,
        generation: crate::ids::Generation,
    },
    /// `network.pauses[i]` begins.
    Pause(usize),
    /// `network.crashes[i]` is due.
    Crash(usize),
    /// A paused worker's pause may have ended: what waited for it is handed over.
    Resume(usize),
}

impl Event {
    /// The worker an event is for, if it is for one.
    fn slot(&self) -> Option<usize> {
        match self {
            Event::StepDone(s) | Event::StepStart(s) => Some(*s),
            Event::Command { slot, .. }
            | Event::Deliver { slot, .. }
            | Event::TransferDone { slot, .. }
            | Event::Timer { slot, .. }
            | Event::FromFrontend { slot, .. }
            | Event::PeerLost { slot, .. } => Some(*slot),
            _ => None,
        }
    }
}

impl Replay<'_> {
    pub(super) fn push(&mut self, at_ns: u64, ev: Event) {
        self.queue.push(at_ns, ev);
    }

    /// Runs to the end of the trace and until every event is handled.
    pub fn run(mut self) -> Result<ReplayOutcome, ReplayError> {
        while let Some((at_ns, ev)) = self.queue.pop_with_starts(Event::StepDone, Event::StepStart) {
            if at_ns >= self.quiet.earliest_ns {
                // A step boundary ranks by its worker; anything else after every boundary.
                let rank = if let Event::StepDone(s) = ev { s } else { usize::MAX };
                self.write_quiet_until(at_ns, rank)?;
            }
            self.now_ns = at_ns;
            // A step start is the loop's own bookkeeping, not an event of the run: a quiet run
            // has none between its steps, and the count must not depend on coalescing.
            if !matches!(ev, Event::StepStart(_)) {
                self.events += 1;
            }
            self.handle(ev)?;
            self.check_invariants()?;
            if !self.leaving.is_empty() {
                self.check_leaving()?;
            }
            if self.now_ns.saturating_sub(self.last_progress_ns) > self.progress_limit_ns {
                self.check_progress();
            }
            if self.livelock.is_some() {
                break;
            }
            if self.events >= self.next_progress {
                self.next_progress = self.events + 4096;
                if let Some(p) = self.progress.as_mut() {
                    p(self.arrivals, self.now_ns);
                }
            }
        }
        let stuck = self.diagnose();
        let drained = stuck.is_empty();
        let faults = self.fault_reports();
        let scaling = self.scaling_report();
        let report = self.sink.finish()?;
        Ok(ReplayOutcome {
            report,
            run_id: self.run_id,
            backend: self.cfg.backend,
            policy: self.policy,
            seed: self.cfg.seed,
            description: self.description.clone(),
            trace_lines_read: self.workload.trace_lines_read(),
            drained,
            stuck,
            events: self.events,
            coalesced_steps: self.quiet.coalesced,
            virtual_end_ns: self.now_ns,
            faults,
            workload: self.workload.stats(),
            scaling,
            network: self.nemesis.report,
        })
    }

    fn handle(&mut self, ev: Event) -> Result<(), ReplayError> {
        // A paused worker gets nothing until it resumes; its inputs wait, in order.
        if !self.nemesis.is_off() {
            if let Some(slot) = ev.slot().filter(|s| self.stopped(*s)) {
                self.hold_input(slot, ev);
                return Ok(());
            }
        }
        // Fault injection may drop, reject or double a delivery.
        if self.faults.active() && self.fault_intercepts(&ev)? {
            return self.fault_boundary();
        }
        match ev {
            Event::Arrival => self.on_arrival()?,
            Event::StepDone(s) => self.on_step_done(s)?,
            Event::StepStart(s) => self.kick(s)?,
            Event::Command { slot, command } => self.on_command(slot, *command)?,
            Event::Deliver { slot, msg } => self.on_deliver(slot, msg)?,
            Event::TransferDone { slot, handoff } => {
                self.on_node(slot, |n, now, r| n.on_transfer_done(now, handoff, None, r))?;
            }
            Event::TransferTick => self.on_transfer_tick()?,
            Event::Timer { slot, timer } => self.on_node(slot, |n, now, r| n.on_timer(now, timer, r))?,
            Event::BootstrapTimer { request } => {
                let mut out = self.take_front();
                self.frontend.on_bootstrap_timer(request, &mut out);
                self.carry_out_frontend(out)?;
            }
            Event::FaultTimer => {}
            Event::Scale(i) => self.on_planned_scale(i)?,
            Event::PlannerTick => self.on_planner_tick()?,
            Event::FromFrontend { slot, message, generation } => {
                if self.nodes[slot].generation() == generation {
                    self.on_node(slot, |n, now, r| n.on_frontend(now, *message, r))??;
                }
            }
            Event::PeerLost { slot, handoff, generation } => {
                if self.nodes[slot].generation() == generation {
                    self.peer_lost(slot, handoff)?;
                }
            }
            Event::Pause(i) => self.on_pause(i)?,
            Event::Crash(i) => self.on_crash(i)?,
            Event::Resume(s) => self.on_resume(s)?,
        }
        if self.faults.active() {
            self.fault_boundary()?;
        }
        Ok(())
    }

    /// Whether slot `s` takes no input now: paused, or still to be handed what waited while it
    /// was (so nothing overtakes those).
    pub(super) fn stopped(&self, s: usize) -> bool {
        self.nemesis.paused(s, self.now_ns).is_some() || !self.paused_inputs[s].is_empty()
    }

    /// Keeps an input of a stopped worker for when it resumes, in arrival order.
    pub(super) fn hold_input(&mut self, s: usize, ev: Event) {
        if self.paused_inputs[s].is_empty() {
            let at = self.nemesis.paused(s, self.now_ns).unwrap_or(self.now_ns);
            self.push(at, Event::Resume(s));
        }
        self.paused_inputs[s].push_back(ev);
    }

    /// The pause ended (unless it was extended): the inputs that waited are handled, in order.
    fn on_resume(&mut self, s: usize) -> Result<(), ReplayError> {
        if let Some(until) = self.nemesis.paused(s, self.now_ns) {
            self.push(until, Event::Resume(s));
            return Ok(());
        }
        for ev in std::mem::take(&mut self.paused_inputs[s]) {
            self.handle(ev)?;
        }
        Ok(())
    }

    /// A worker's transport tells it the peer of `handoff` is gone; a paused worker hears of it
    /// when it resumes. True when a role of the handoff is (or, paused, was) on it.
    pub(super) fn peer_lost(&mut self, slot: usize, handoff: HandoffId) -> Result<bool, ReplayError> {
        if !self.nemesis.is_off() && self.stopped(slot) {
            let holds = self.nodes[slot].holds(handoff);
            if holds {
                let generation = self.nodes[slot].generation();
                self.hold_input(slot, Event::PeerLost { slot, handoff, generation });
            }
            return Ok(holds);
        }
        self.on_node(slot, |n, now, r| n.on_peer_lost(now, handoff, r))
    }

    fn on_pause(&mut self, i: usize) -> Result<(), ReplayError> {
        let p = self.cfg.network.pauses[i].clone();
        let s = self.slot_named(&p.worker)?;
        let until = self.now_ns.saturating_add(p.for_ms.saturating_mul(crate::units::NS_PER_MS));
        let paused = &mut self.nemesis.paused_until_ns[s];
        *paused = (*paused).max(until);
        self.nemesis.report.paused += 1;
        tracing::info!(worker = %p.worker, for_ms = p.for_ms, "paused");
        Ok(())
    }

    fn on_crash(&mut self, i: usize) -> Result<(), ReplayError> {
        let c = self.cfg.network.crashes[i].clone();
        let s = self.slot_named(&c.worker)?;
        if matches!(self.members[s].membership, super::Membership::Left { .. }) {
            return Ok(()); // it left before its crash was due
        }
        // A crashed process is running again from here, paused or not before; what waited for
        // it is handed to the new session now (what belonged to the old one it drops).
        self.nemesis.paused_until_ns[s] = 0;
        let text = self.restart_worker(s)?;
        if !self.paused_inputs[s].is_empty() {
            self.push(self.now_ns, Event::Resume(s));
        }
        self.nemesis.report.crashed += 1;
        tracing::info!("{text}");
        Ok(())
    }

    /// The slot of a worker the configuration names (validated: it exists or may join).
    fn slot_named(&self, name: &str) -> Result<usize, ReplayError> {
        let w: WorkerId = name.parse().map_err(|e| ReplayError::Engine(format!("network: {name}: {e}")))?;
        let s = self.slot_of(w);
        if s >= self.nodes.len() {
            return Err(ReplayError::Engine(format!("network: {name} has not joined the run")));
        }
        Ok(s)
    }

    pub(super) fn slot_of(&self, w: WorkerId) -> usize {
        let slots = match w.role {
            Role::Decode => &self.decode_slots,
            _ => &self.prefill_slots,
        };
        // Every worker a router or a message names has a slot; an unknown one maps past the
        // end, so a bug shows as an out-of-range panic at the caller rather than a wrong worker.
        slots.get(w.index as usize).copied().unwrap_or(usize::MAX)
    }

    /// Starts (or queues) a transfer in the contention model, from `from`'s NIC to slot `s`'s.
    pub(super) fn start_shared_transfer(
        &mut self,
        s: usize,
        handoff: HandoffId,
        from: WorkerId,
        bytes: u64,
    ) -> Result<(), ReplayError> {
        let key = self.next_transfer_key;
        self.next_transfer_key += 1;
        let source = self.slot_of(from);
        if let Some(m) = self.contention.as_mut() {
            m.start(self.now_ns, key, source, s, bytes)
                .map_err(|e| ReplayError::Engine(format!("transfer: {e}")))?;
        }
        self.transfers.insert(key, (s, handoff));
        self.transfer_of.insert(handoff, key);
        self.arm_transfer_tick();
        Ok(())
    }

    /// A destination let go of its handoff: a transfer still queued or moving stops sharing.
    pub(super) fn cancel_shared_transfer(&mut self, handoff: HandoffId) {
        let Some(key) = self.transfer_of.remove(&handoff) else { return };
        self.transfers.remove(&key);
        if let Some(m) = self.contention.as_mut() {
            m.cancel(self.now_ns, key);
        }
        self.arm_transfer_tick();
    }

    fn arm_transfer_tick(&mut self) {
        let due = self.contention.as_ref().and_then(|m| m.next_event_ns());
        arm(&mut self.queue, &mut self.tick_armed_ns, self.now_ns, due, Event::TransferTick);
    }

    fn on_transfer_tick(&mut self) -> Result<(), ReplayError> {
        let now = self.now_ns;
        if self.tick_armed_ns == Some(now) {
            self.tick_armed_ns = None;
        }
        let done = self.contention.as_mut().map(|m| m.advance(now)).unwrap_or_default();
        for c in done {
            let Some((slot, handoff)) = self.transfers.remove(&c.key) else { continue };
            self.transfer_of.remove(&handoff);
            let timing =
                TransferTiming { queued_ns: c.queued_ns, latency_ns: c.latency_ns, moving_ns: c.moving_ns };
            self.on_node(slot, |n, now, r| n.on_transfer_done(now, handoff, Some(timing), r))?;
        }
        self.arm_transfer_tick();
        Ok(())
    }
}

/// Queues `ev` for `due` (not before `now_ns`) unless one is queued for that instant or earlier
/// already (`armed`): an event that wakes a component whose next instant keeps moving (the
/// workload, the contention model) is queued once per instant, not once per change.
pub(super) fn arm(
    queue: &mut EventQueue<Event>,
    armed: &mut Option<u64>,
    now_ns: u64,
    due: Option<u64>,
    ev: Event,
) {
    let Some(due) = due else { return };
    let at = due.max(now_ns);
    if armed.map_or(true, |a| at < a) {
        *armed = Some(at);
        queue.push(at, ev);
    }
}
