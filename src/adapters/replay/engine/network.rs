//! The in-process network: what a node or the frontend produced is carried out here.
//!
//! * A node's facts go to its stream (the simulator also reads them for its liveness guards).
//! * Frontend ↔ worker messages are delivered at once, depth first, in the order they were
//!   sent: the frontend and the workers are one process in replay, so a booking freed by a
//!   released pin is freed before anything else happens, as it was when these were calls.
//! * Worker ↔ worker handoff messages, core commands, timers and transfers go through the
//!   event queue (the fault plan acts on handoff messages as they are delivered).
//! * While a fault tells several roles of one loss (`hold`), the frontend hears of none of
//!   them until all were told: otherwise the first role's end would end the request and
//!   cancel the second role with another reason before its transport told it.

use super::simulator::Event;
use super::{Replay, ReplayError};
use crate::adapters::replay::transfer::TransferModel;
use crate::events::Fact;
use crate::ids::WorkerId;
use crate::runtime::{FrontendReady, Output, Ready, ToFrontend, ToWorker};
use std::collections::VecDeque;

/// A frontend ↔ worker message in the in-process network.
#[derive(Debug)]
pub(super) enum Local {
    ToFrontend { from: WorkerId, message: ToFrontend },
    ToWorker { to: WorkerId, message: ToWorker },
}

impl Replay<'_> {
    pub(super) fn take_ready(&mut self) -> Ready {
        self.spare_ready.pop().unwrap_or_default()
    }

    pub(super) fn take_front(&mut self) -> FrontendReady {
        self.spare_front.pop().unwrap_or_default()
    }

    /// Carries out what node `slot` produced, in order.
    pub(super) fn carry_out(&mut self, slot: usize, mut ready: Ready) -> Result<(), ReplayError> {
        let now = self.now_ns;
        let worker = self.nodes[slot].id();
        for fact in ready.facts.drain(..) {
            self.observe(slot, &fact, now);
            self.sink.push(worker, now, fact)?;
        }
        if ready.outputs.is_empty() {
            self.spare_ready.push(ready);
            return Ok(());
        }
        // The buffer is kept while its outputs are carried out: a delivery they cause takes
        // another from the pool, so the pool holds one per nesting level at most.
        let mut outputs = std::mem::take(&mut ready.outputs);
        for output in outputs.drain(..) {
            self.carry_output(slot, worker, output)?;
        }
        ready.outputs = outputs;
        self.spare_ready.push(ready);
        Ok(())
    }

    fn carry_output(&mut self, slot: usize, worker: WorkerId, output: Output) -> Result<(), ReplayError> {
        let now = self.now_ns;
        match output {
            Output::ToFrontend(message) => self.send_local(Local::ToFrontend { from: worker, message })?,
            Output::ToWorker { to, message } => self.send_handoff(worker, to, message),
            Output::Command { at_ns, command } => {
                self.push(at_ns, Event::Command { slot, command: Box::new(command) })
            }
            Output::Timer { at_ns, timer } => {
                let at_ns =
                    if self.nemesis.is_off() { at_ns } else { self.nemesis.timer_at(worker, now, at_ns) };
                self.push(at_ns, Event::Timer { slot, timer });
            }
            Output::StartTransfer { handoff, from, missing_tokens, bytes } => {
                if self.contention.is_some() {
                    self.start_shared_transfer(slot, handoff, from, bytes)?;
                } else {
                    let at = now.saturating_add(self.transfer.transfer_ns(missing_tokens as u64));
                    self.push(at, Event::TransferDone { slot, handoff });
                }
            }
            Output::CancelTransfer { handoff } => self.cancel_shared_transfer(handoff),
            Output::StepSoon => {
                self.queue.push_start(slot, now);
            }
        }
        Ok(())
    }

    /// Carries out what the frontend produced: router facts, bootstrap timers, messages to
    /// workers (delivered at once), then the requests that ended.
    pub(super) fn carry_out_frontend(&mut self, mut out: FrontendReady) -> Result<(), ReplayError> {
        let now = self.now_ns;
        if out.facts.is_empty() && out.timers.is_empty() && out.sends.is_empty() && out.ended.is_empty() {
            self.spare_front.push(out);
            return Ok(());
        }
        for fact in out.facts.drain(..) {
            self.emit_router(now, fact)?;
        }
        for (at_ns, request) in out.timers.drain(..) {
            self.push(at_ns, Event::BootstrapTimer { request });
        }
        let mut sends = std::mem::take(&mut out.sends);
        let mut ended = std::mem::take(&mut out.ended);
        for (to, message) in sends.drain(..) {
            self.send_local(Local::ToWorker { to, message })?;
        }
        for e in ended.drain(..) {
            self.request_ended(e)?;
        }
        out.sends = sends;
        out.ended = ended;
        self.spare_front.push(out);
        Ok(())
    }

    pub(super) fn emit_router(&mut self, at_ns: u64, fact: Fact) -> Result<(), ReplayError> {
        self.last_progress_ns = at_ns;
        self.sink.push(WorkerId::ROUTER, at_ns, fact)
    }

    /// Delivers a frontend ↔ worker message now, or holds it while a fault is being told.
    fn send_local(&mut self, local: Local) -> Result<(), ReplayError> {
        if let Some(held) = self.held.as_mut() {
            held.push_back(local);
            return Ok(());
        }
        self.deliver_local(local)
    }

    fn deliver_local(&mut self, local: Local) -> Result<(), ReplayError> {
        let now = self.now_ns;
        match local {
            Local::ToFrontend { from, message } => {
                let mut out = self.take_front();
                self.frontend.on_worker(now, from, message, &mut out)?;
                self.carry_out_frontend(out)
            }
            Local::ToWorker { to, message } => {
                let slot = self.slot_of(to);
                if !self.nemesis.is_off() && self.stopped(slot) {
                    let generation = self.nodes[slot].generation();
                    self.hold_input(
                        slot,
                        Event::FromFrontend { slot, message: Box::new(message), generation },
                    );
                    return Ok(());
                }
                let mut ready = self.take_ready();
                self.nodes[slot].on_frontend(now, message, &mut ready)?;
                self.carry_out(slot, ready)
            }
        }
    }

    /// A handoff message between workers, as the network treats it: delivered now, or lost,
    /// delayed or doubled by the nemesis.
    fn send_handoff(
        &mut self,
        from: WorkerId,
        to: WorkerId,
        message: crate::lifecycle::messages::HandoffMessage,
    ) {
        let now = self.now_ns;
        let slot = self.slot_of(to);
        if self.nemesis.is_off() {
            self.push(now, Event::Deliver { slot, msg: message });
            return;
        }
        for delay in self.nemesis.fate(from, to, now).deliveries.into_iter().flatten() {
            self.push(now.saturating_add(delay), Event::Deliver { slot, msg: message });
        }
    }

    /// From now until [`Replay::release`], frontend ↔ worker messages wait.
    pub(super) fn hold(&mut self) {
        self.held.get_or_insert_with(VecDeque::new);
    }

    /// Delivers what waited, in order.
    pub(super) fn release(&mut self) -> Result<(), ReplayError> {
        let Some(mut held) = self.held.take() else { return Ok(()) };
        while let Some(local) = held.pop_front() {
            self.deliver_local(local)?;
        }
        Ok(())
    }

    /// Hands node `slot` to `input` with a fresh buffer and carries out what it produced.
    pub(super) fn on_node<T>(
        &mut self,
        slot: usize,
        input: impl FnOnce(&mut crate::runtime::WorkerNode, u64, &mut Ready) -> T,
    ) -> Result<T, ReplayError> {
        let now = self.now_ns;
        let mut ready = self.take_ready();
        let value = input(&mut self.nodes[slot], now, &mut ready);
        self.carry_out(slot, ready)?;
        Ok(value)
    }
}
