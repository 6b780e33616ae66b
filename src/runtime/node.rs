//! `WorkerNode`: one worker's runtime, sans IO.
//!
//! A node owns its engine core, the role machines of the handoffs it takes part in, its
//! session generation, and what its core holds for the frontend's bookings (prefills computing,
//! sources pinned). It never reads a clock, a socket or another node: every input names its
//! instant (`at_ns`) and every effect comes back in a [`Ready`]:
//! * `facts` for the node's own stream, in order;
//! * `outputs`, in the order the node produced them: messages to the frontend and to peers,
//!   core commands to hand back at their turn ([`Output::Command`]), timers, transfers to
//!   start or cancel, and a wish to step.
//!
//! Replay and live drive the same node. The driver persists the facts, sends the messages,
//! arms the timers, starts the transfers, and feeds each back in when it is due.
//!
//! ## The inbox rule
//! A core command is applied between steps, as an engine loop applies control messages between
//! iterations. A role machine's command goes out as [`Output::Command`] and comes back through
//! [`WorkerNode::apply_command`] after whatever else is due at its instant; reaching a busy
//! node, it waits in the inbox until the step in flight ends. A message that follows a command
//! in one transition is held with the command and sent only once the command is applied (the
//! source must not hear "receive completed" before the destination has activated).

use super::protocol::{HandoffRole, Peer, ToFrontend, ToWorker};
use super::RuntimeError;
use crate::events::TerminalStatus;
use crate::events::{Fact, MessageRejection};
use crate::ids::{
    CancelReason, EndReason, Generation, HandoffId, HandoffPolicy, KvHandoffDemand, RequestId, Role, WorkerId,
};
use crate::lifecycle::destination::{
    DestinationAction, DestinationConfig, DestinationEvent, DestinationHandoff, DestinationInit,
    DestinationState,
};
use crate::lifecycle::messages::HandoffMessage;
use crate::lifecycle::source::{
    SourceAction, SourceConfig, SourceEvent, SourceHandoff, SourceInit, SourceState,
};
use crate::model::Request;
use crate::schedulers::{
    CommandError, CommandOutcome, CommandResult, Effects, EngineCore, EngineOutput, QuietDurations,
    QuietSteps,
};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Zero-duration steps in a row at one instant before a worker is declared stuck in a loop.
const MAX_ZERO_STEPS: u32 = 10_000;

/// Commands waiting in the inbox for the step in flight, at most. A node holds one command
/// per role action, and actions come from handoffs the router booked on it, so the bound is
/// only reached by a bug; it stops the run instead of growing without limit.
const MAX_INBOX: usize = 1 << 20;

/// Handoffs whose messages came before the frontend's start reached this node, at most; and
/// messages kept per such handoff. Over TCP a peer can hear of a handoff (and answer) before
/// this node does: SGLang's destination reserves and tells the source while the source's own
/// start is still on its way. The oldest is refused when more arrive.
const MAX_EARLY_HANDOFFS: usize = 1024;
const MAX_EARLY_MESSAGES: usize = 16;

/// Ended handoffs remembered, so that a message for one is refused at once as late rather than
/// kept as early.
const REMEMBERED_ENDED: usize = 1 << 13;

/// What every handoff on a node is configured with.
#[derive(Clone, Copy, Debug)]
pub struct NodeConfig {
    pub policy: HandoffPolicy,
    /// The source lease. A renewal moves its deadline to now + two thirds of it, as vLLM's
    /// lease design does (a heartbeat every sixth of the lease keeps it alive through missed
    /// ones; a dead destination's pin lasts at most two thirds of a lease after its last).
    pub lease_ns: u64,
    /// How long a destination reservation waits for its transfer.
    pub reservation_ns: u64,
    /// The destination's heartbeat to its source, if it sends one.
    pub renew_ns: Option<u64>,
    pub kv_bytes_per_token: u64,
    /// Tell the frontend of every KV block stored or removed (its routers keep a KV index
    /// only when they route by KV overlap).
    pub publish_kv_events: bool,
}

impl NodeConfig {
    /// How far past a renewal's instant it moves the source's deadline.
    pub fn renewal_extension_ns(&self) -> u64 {
        (self.lease_ns / 3).saturating_mul(2)
    }
}

/// A core command of this node.
#[derive(Clone, Debug)]
enum Command {
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

/// A core command on its way back to its node, with the messages held until it is applied.
#[derive(Clone, Debug)]
pub struct DeferredCommand {
    command: Command,
    then: Vec<(WorkerId, HandoffMessage)>,
    /// The session of the role machine that issued it. A restart ends every role of the old
    /// session (their own cancels clean up); a command of theirs that would take something
    /// (dispatch, reserve) and comes back after it is dropped, or it would reach the
    /// core after the cleanup and hold what nobody releases. A release or cancel is applied
    /// whatever its session: it finishes an end (a no-op if the cleanup did it already).
    /// `None`: a frontend request, which the core keeps across a restart.
    session: Option<Generation>,
}

/// A node's timer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeTimer {
    /// The source lease may have run out.
    Lease(HandoffId),
    /// The destination reservation may have run out.
    Reservation(HandoffId),
    /// The destination's next heartbeat to its source.
    Renew(HandoffId),
}

/// How a finished transfer was timed, when the transport measured it (shared NICs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferTiming {
    pub queued_ns: u64,
    pub latency_ns: u64,
    pub moving_ns: u64,
}

/// One effect of an input, for the driver.
#[derive(Clone, Debug)]
pub enum Output {
    ToFrontend(ToFrontend),
    ToWorker {
        to: WorkerId,
        message: HandoffMessage,
    },
    /// Hand `command` back through [`WorkerNode::apply_command`] at `at_ns`, after what is due
    /// then already.
    Command {
        at_ns: u64,
        command: DeferredCommand,
    },
    Timer {
        at_ns: u64,
        timer: NodeTimer,
    },
    /// Move `bytes` of `handoff`'s KV from `from` to this node; report its end through
    /// [`WorkerNode::on_transfer_done`].
    StartTransfer {
        handoff: HandoffId,
        from: WorkerId,
        missing_tokens: u32,
        bytes: u64,
    },
    /// The destination let go: a transfer for it still moving stops.
    CancelTransfer {
        handoff: HandoffId,
    },
    /// The node is free and wants to step after everything else due now.
    StepSoon,
}

/// What one input produced.
#[derive(Debug, Default)]
pub struct Ready {
    pub facts: Vec<Fact>,
    pub outputs: Vec<Output>,
}

impl Ready {
    pub fn is_empty(&self) -> bool {
        self.facts.is_empty() && self.outputs.is_empty()
    }
}

/// What [`WorkerNode::start_step`] did.
#[derive(Debug)]
pub enum StepPlan {
    /// Nothing to run now.
    Idle,
    /// A step runs until `until_ns`; its effects come out of [`WorkerNode::finish_step`].
    Until { until_ns: u64 },
    /// A step ran whose only effect is `first`, and the core promises `rest` decode steps that
    /// only advance every running request by a token: the driver may hold one boundary for all
    /// of them (see the replay's quiet runs) and apply them with
    /// [`WorkerNode::advance_quiet`].
    Quiet { first: Fact, first_ns: u64, rest: QuietSteps },
    /// A zero-length step was applied; ask again once its effects are carried out.
    Again,
}

struct SourceRole {
    machine: SourceHandoff,
    request: Request,
}

struct DestinationRole {
    machine: DestinationHandoff,
    request: Request,
}

/// One worker's runtime (see the module docs).
pub struct WorkerNode {
    id: WorkerId,
    core: Box<dyn EngineCore>,
    config: NodeConfig,
    generation: Generation,
    /// A step is in flight; its effects wait in `pending` until it ends.
    busy: bool,
    pending: Option<Effects>,
    inbox: VecDeque<DeferredCommand>,
    sources: BTreeMap<HandoffId, SourceRole>,
    destinations: BTreeMap<HandoffId, DestinationRole>,
    /// The destination handoff of each request decoding here.
    destination_of: BTreeMap<RequestId, HandoffId>,
    /// Handoff prefills dispatched to the core and neither pinned nor ended there.
    computing: BTreeSet<HandoffId>,
    /// Handoffs whose source pin the core reported and has not released.
    pinned: BTreeSet<HandoffId>,
    /// Messages for handoffs not started here yet, in arrival order of their first message.
    early: BTreeMap<HandoffId, Vec<HandoffMessage>>,
    early_order: VecDeque<HandoffId>,
    /// Handoffs whose role here ended, the most recent `REMEMBERED_ENDED`.
    ended: BTreeSet<HandoffId>,
    ended_order: VecDeque<HandoffId>,
    /// (instant, zero-length steps in a row at it).
    zero_steps: (u64, u32),
    /// A drained effects buffer for the core's next step.
    spare: Option<Effects>,
}

impl WorkerNode {
    pub fn new(id: WorkerId, core: Box<dyn EngineCore>, config: NodeConfig) -> Self {
        WorkerNode {
            id,
            core,
            config,
            generation: Generation(1),
            busy: false,
            pending: None,
            inbox: VecDeque::new(),
            sources: BTreeMap::new(),
            destinations: BTreeMap::new(),
            destination_of: BTreeMap::new(),
            computing: BTreeSet::new(),
            pinned: BTreeSet::new(),
            early: BTreeMap::new(),
            early_order: VecDeque::new(),
            ended: BTreeSet::new(),
            ended_order: VecDeque::new(),
            zero_steps: (u64::MAX, 0),
            spare: None,
        }
    }

    /// A node whose session starts at `generation` (a live worker rejoining a run under the
    /// generation its frontend gave it).
    pub fn with_generation(mut self, generation: Generation) -> Self {
        self.generation = generation;
        self
    }

    pub fn id(&self) -> WorkerId {
        self.id
    }

    pub fn generation(&self) -> Generation {
        self.generation
    }

    pub fn is_busy(&self) -> bool {
        self.busy
    }

    /// The engine core, to look at (view, snapshot, shape); only the node changes it.
    pub fn core(&self) -> &dyn EngineCore {
        self.core.as_ref()
    }

    /// Nothing in flight, waiting, held or decoding: the node may leave.
    pub fn holds_nothing(&self) -> bool {
        !self.busy
            && self.pending.is_none()
            && self.inbox.is_empty()
            && self.sources.is_empty()
            && self.destinations.is_empty()
            && self.core.is_drained()
    }

    pub fn source_state(&self, handoff: HandoffId) -> Option<&SourceState> {
        self.sources.get(&handoff).map(|r| r.machine.state())
    }

    pub fn destination_state(&self, handoff: HandoffId) -> Option<&DestinationState> {
        self.destinations.get(&handoff).map(|r| r.machine.state())
    }

    /// Whether either role of `handoff` is on this node.
    pub fn holds(&self, handoff: HandoffId) -> bool {
        self.sources.contains_key(&handoff) || self.destinations.contains_key(&handoff)
    }

    /// The handoffs with a role here whose other role is on `peer` (as the role machines know
    /// their peer: named at the start, or learnt from its first message).
    pub fn handoffs_with(&self, peer: WorkerId) -> Vec<HandoffId> {
        let sources = self.sources.iter().filter(|(_, r)| r.machine.peer() == Some(peer));
        let destinations = self.destinations.iter().filter(|(_, r)| r.machine.peer() == Some(peer));
        sources.map(|(h, _)| *h).chain(destinations.map(|(h, _)| *h)).collect()
    }

    /// Every source role here: handoff, request, state.
    pub fn source_roles(&self) -> impl Iterator<Item = (HandoffId, RequestId, &SourceState)> {
        self.sources.iter().map(|(h, r)| (*h, r.request.id, r.machine.state()))
    }

    /// Every destination role here: handoff, request, state.
    pub fn destination_roles(&self) -> impl Iterator<Item = (HandoffId, RequestId, &DestinationState)> {
        self.destinations.iter().map(|(h, r)| (*h, r.request.id, r.machine.state()))
    }

    /// The session begins: its first fact, and the frontend hears the generation.
    pub fn start(&mut self, ready: &mut Ready) {
        ready.facts.push(Fact::SessionStarted { generation: self.generation });
        ready.outputs.push(Output::ToFrontend(ToFrontend::SessionStarted { generation: self.generation }));
    }

    /// The worker leaves the cluster (drained): its stream's last fact.
    pub fn leave(&mut self, ready: &mut Ready) {
        ready.facts.push(Fact::WorkerLeft { generation: self.generation });
    }

    // ---- steps ----

    /// Starts a step on an idle node that has work. A zero-length step is applied at once
    /// ([`StepPlan::Again`]: the driver carries out its effects and asks again); the first step
    /// that takes time is left in flight. `quiet`: the driver can hold one boundary for a run
    /// of quiet steps.
    pub fn start_step(
        &mut self,
        at_ns: u64,
        quiet: bool,
        ready: &mut Ready,
    ) -> Result<StepPlan, RuntimeError> {
        if self.busy || self.core.is_empty() {
            return Ok(StepPlan::Idle);
        }
        if let Some(fx) = self.spare.take() {
            self.core.recycle(fx);
        }
        let out = self.core.step(at_ns);
        if out.duration_ns > 0 {
            self.busy = true;
            self.zero_steps = (u64::MAX, 0);
            if quiet {
                if let Some((first, rest)) = self.quiet_steps_after(&out.effects) {
                    self.recycle(out.effects);
                    return Ok(StepPlan::Quiet { first, first_ns: out.duration_ns, rest });
                }
            }
            self.pending = Some(out.effects);
            return Ok(StepPlan::Until { until_ns: at_ns.saturating_add(out.duration_ns) });
        }
        if out.effects.facts.is_empty() && out.effects.outputs.is_empty() {
            // Runnable work that cannot run now (e.g. waiting for blocks): idle until a
            // command changes something.
            return Ok(StepPlan::Idle);
        }
        self.count_zero_step(at_ns)?;
        self.apply_effects(at_ns, out.effects, ready);
        Ok(StepPlan::Again)
    }

    fn count_zero_step(&mut self, at_ns: u64) -> Result<(), RuntimeError> {
        let z = &mut self.zero_steps;
        if z.0 != at_ns {
            *z = (at_ns, 1);
            return Ok(());
        }
        z.1 += 1;
        if z.1 > MAX_ZERO_STEPS {
            return Err(RuntimeError(format!(
                "{} made no progress: {MAX_ZERO_STEPS} zero-length steps at t={} ms",
                self.id,
                at_ns as f64 / 1e6
            )));
        }
        Ok(())
    }

    /// The quiet steps the core promises after a step whose only effect is one `StepExecuted`
    /// (so that fact can wait for its boundary like the others).
    fn quiet_steps_after(&self, effects: &Effects) -> Option<(Fact, QuietSteps)> {
        // Cheap refusals first: this is asked after every step.
        let [first @ Fact::StepExecuted { .. }] = effects.facts.as_slice() else {
            return None;
        };
        if !effects.outputs.is_empty() {
            return None;
        }
        let rest = self.core.quiet_steps()?;
        // A step takes time (a zero-length one is the step loop's business).
        let zero = match &rest.durations {
            QuietDurations::Same(ns) => *ns == 0,
            QuietDurations::Each(d) => d.contains(&0),
        };
        (!zero).then(|| (first.clone(), rest))
    }

    /// The step in flight ended: its effects are applied. The commands that waited for it
    /// follow, one per [`WorkerNode::apply_next_waiting`]; then the driver starts the next step.
    pub fn finish_step(&mut self, at_ns: u64, ready: &mut Ready) {
        self.busy = false;
        if let Some(effects) = self.pending.take() {
            self.apply_effects(at_ns, effects, ready);
        }
    }

    /// Whether a command waits in the inbox for the step in flight.
    pub fn has_waiting(&self) -> bool {
        !self.inbox.is_empty()
    }

    /// Applies the oldest command that waited in the inbox, releasing the messages held with
    /// it. False when none waits (or a step is in flight).
    pub fn apply_next_waiting(&mut self, at_ns: u64, ready: &mut Ready) -> bool {
        if self.busy {
            return false;
        }
        let Some(deferred) = self.inbox.pop_front() else {
            return false;
        };
        self.execute_deferred(at_ns, deferred, ready);
        true
    }

    /// Applies `steps` of the quiet steps promised with [`StepPlan::Quiet`] to the core.
    pub fn advance_quiet(&mut self, steps: u64) {
        self.core.advance_quiet(steps);
    }

    /// A quiet run ends early at a boundary that fell right now: `steps` quiet steps ran, and
    /// the node is free.
    pub fn end_quiet_free(&mut self, steps: u64) {
        self.core.advance_quiet(steps);
        self.busy = false;
    }

    /// A quiet run ends early mid-step: `steps` quiet steps are applied and the one in flight
    /// becomes an ordinary step whose only fact is `in_flight`.
    pub fn end_quiet_in_flight(&mut self, steps: u64, in_flight: Fact) {
        self.core.advance_quiet(steps);
        let mut fx = self.spare.take().unwrap_or_default();
        fx.facts.push(in_flight);
        self.pending = Some(fx);
    }

    // ---- inputs ----

    /// A command handed back (see [`Output::Command`]): applied now on a free node, which then
    /// wants to step; on a busy one it waits in the inbox.
    pub fn apply_command(
        &mut self,
        at_ns: u64,
        command: DeferredCommand,
        ready: &mut Ready,
    ) -> Result<(), RuntimeError> {
        if self.busy {
            if self.inbox.len() >= MAX_INBOX {
                return Err(RuntimeError(format!(
                    "{}: more than {MAX_INBOX} commands wait for one step",
                    self.id
                )));
            }
            self.inbox.push_back(command);
            return Ok(());
        }
        self.execute_deferred(at_ns, command, ready);
        ready.outputs.push(Output::StepSoon);
        Ok(())
    }

    /// A message from the frontend.
    pub fn on_frontend(
        &mut self,
        at_ns: u64,
        message: ToWorker,
        ready: &mut Ready,
    ) -> Result<(), RuntimeError> {
        match message {
            ToWorker::Submit { request } => {
                ready.outputs.push(deferred(at_ns, Command::Submit(request)));
            }
            ToWorker::SubmitPrefilled { request, kv_ready_at_ns } => {
                ready.outputs.push(deferred(kv_ready_at_ns.max(at_ns), Command::SubmitPrefilled(request)));
            }
            ToWorker::StartSource { handoff, request, destination } => {
                self.start_source(at_ns, handoff, request, destination, ready)?;
            }
            ToWorker::StartDestination { handoff, request, source } => {
                self.start_destination(at_ns, handoff, request, source, ready)?;
            }
            ToWorker::CancelHandoff { handoff, reason } => {
                self.source_event(at_ns, handoff, SourceEvent::Cancelled { reason }, false, ready);
                self.destination_event(at_ns, handoff, DestinationEvent::Cancelled { reason }, false, ready);
            }
            ToWorker::BootstrapExpired { handoff } => {
                if matches!(self.source_state(handoff), Some(SourceState::NotStarted)) {
                    let ev = SourceEvent::Cancelled { reason: CancelReason::BootstrapTimeout };
                    self.source_event(at_ns, handoff, ev, false, ready);
                }
            }
            ToWorker::WithdrawDestination { handoff } => {
                self.destination_event(at_ns, handoff, DestinationEvent::Withdraw, false, ready);
            }
        }
        Ok(())
    }

    /// A message from the other role of a handoff: its machine here takes it. For a handoff
    /// that ended here it is refused as for an unknown handoff; for one not started here yet it
    /// waits for the start (see `MAX_EARLY_HANDOFFS`).
    pub fn on_peer(&mut self, at_ns: u64, message: HandoffMessage, ready: &mut Ready) {
        let handoff = message.handoff;
        if self.sources.contains_key(&handoff) {
            self.source_event(at_ns, handoff, SourceEvent::Message(message), false, ready);
        } else if self.destinations.contains_key(&handoff) {
            self.destination_event(at_ns, handoff, DestinationEvent::Message(message), false, ready);
        } else if self.ended.contains(&handoff) {
            ready.facts.push(message.rejected_fact(MessageRejection::UnknownHandoff));
        } else {
            self.keep_early(message, ready);
        }
    }

    fn keep_early(&mut self, message: HandoffMessage, ready: &mut Ready) {
        let handoff = message.handoff;
        if let Some(kept) = self.early.get_mut(&handoff) {
            if kept.len() < MAX_EARLY_MESSAGES {
                kept.push(message);
            } else {
                ready.facts.push(message.rejected_fact(MessageRejection::UnknownHandoff));
            }
            return;
        }
        if self.early_order.len() >= MAX_EARLY_HANDOFFS {
            if let Some(oldest) = self.early_order.pop_front() {
                for m in self.early.remove(&oldest).unwrap_or_default() {
                    ready.facts.push(m.rejected_fact(MessageRejection::UnknownHandoff));
                }
            }
        }
        self.early_order.push_back(handoff);
        self.early.insert(handoff, vec![message]);
    }

    /// The messages that came before `handoff` started here, now that it has.
    fn deliver_early(&mut self, at_ns: u64, handoff: HandoffId, ready: &mut Ready) {
        if self.early.is_empty() {
            return;
        }
        let Some(kept) = self.early.remove(&handoff) else { return };
        self.early_order.retain(|h| *h != handoff);
        for m in kept {
            self.on_peer(at_ns, m, ready);
        }
    }

    /// Messages still waiting for a start that never came (they hold no resources).
    pub fn early_messages(&self) -> usize {
        self.early.values().map(Vec::len).sum()
    }

    fn remember_ended(&mut self, handoff: HandoffId) {
        if self.ended.insert(handoff) {
            self.ended_order.push_back(handoff);
            if self.ended_order.len() > REMEMBERED_ENDED {
                if let Some(old) = self.ended_order.pop_front() {
                    self.ended.remove(&old);
                }
            }
        }
    }

    /// The transport refuses a peer message before any machine sees it (a stale sender).
    pub fn refuse(&mut self, message: HandoffMessage, why: MessageRejection, ready: &mut Ready) {
        ready.facts.push(message.rejected_fact(why));
    }

    pub fn on_timer(&mut self, at_ns: u64, timer: NodeTimer, ready: &mut Ready) {
        match timer {
            NodeTimer::Lease(h) => self.source_event(at_ns, h, SourceEvent::LeaseExpired, false, ready),
            NodeTimer::Reservation(h) => {
                self.destination_event(at_ns, h, DestinationEvent::ReservationExpired, false, ready)
            }
            NodeTimer::Renew(h) => self.renew(at_ns, h, ready),
        }
    }

    /// The transfer into `handoff`'s reservation finished.
    pub fn on_transfer_done(
        &mut self,
        at_ns: u64,
        handoff: HandoffId,
        timing: Option<TransferTiming>,
        ready: &mut Ready,
    ) {
        if let Some(t) = timing {
            ready.facts.push(Fact::TransferTiming {
                handoff,
                queued_ns: t.queued_ns,
                latency_ns: t.latency_ns,
                moving_ns: t.moving_ns,
            });
        }
        self.destination_event(at_ns, handoff, DestinationEvent::ReceiveCompleted, false, ready);
    }

    /// The transport lost the peer of `handoff` (its session ended, or the channel failed): a
    /// source here gives up, and so does a destination that still holds handoff resources (an
    /// activated one holds none). True when a role here was told.
    pub fn on_peer_lost(&mut self, at_ns: u64, handoff: HandoffId, ready: &mut Ready) -> bool {
        let mut told = false;
        if self.sources.contains_key(&handoff) {
            let ev = SourceEvent::Cancelled { reason: CancelReason::PeerLost };
            self.source_event(at_ns, handoff, ev, false, ready);
            told = true;
        }
        let live = self
            .destinations
            .get(&handoff)
            .is_some_and(|r| !matches!(r.machine.state(), DestinationState::Active { .. }));
        if live {
            let ev = DestinationEvent::Cancelled { reason: CancelReason::PeerLost };
            self.destination_event(at_ns, handoff, ev, false, ready);
            told = true;
        }
        told
    }

    /// The session ends and a new one starts: a new generation, and every handoff the old one
    /// held is canceled here (`OwnerLost`; the core frees what it held). Returns those
    /// handoffs, sources first, for the transport to tell their peers.
    pub fn restart(&mut self, at_ns: u64, ready: &mut Ready) -> Vec<HandoffId> {
        self.generation = Generation(self.generation.0.saturating_add(1));
        ready.facts.push(Fact::SessionStarted { generation: self.generation });
        let sources: Vec<HandoffId> = self.sources.keys().copied().collect();
        let destinations: Vec<HandoffId> = self.destinations.keys().copied().collect();
        for h in &sources {
            let ev = SourceEvent::Cancelled { reason: CancelReason::OwnerLost };
            self.source_event(at_ns, *h, ev, false, ready);
        }
        for h in &destinations {
            let ev = DestinationEvent::Cancelled { reason: CancelReason::OwnerLost };
            self.destination_event(at_ns, *h, ev, false, ready);
        }
        // The frontend hears of the new session after the roles' ends: whatever it still
        // believes is on this worker was lost with the old session (a start still in flight).
        ready.outputs.push(Output::ToFrontend(ToFrontend::SessionStarted { generation: self.generation }));
        sources.into_iter().chain(destinations).collect()
    }

    // ---- handoff starts ----

    fn start_source(
        &mut self,
        at_ns: u64,
        handoff: HandoffId,
        request: Request,
        destination: Option<Peer>,
        ready: &mut Ready,
    ) -> Result<(), RuntimeError> {
        let machine = SourceHandoff::new(SourceInit {
            handoff,
            request: request.id,
            policy: self.config.policy,
            demand: demand_of(&request),
            worker: self.id,
            generation: self.generation,
            destination: destination.map(|p| p.worker),
            destination_generation: destination.map(|p| p.generation),
            config: SourceConfig {
                lease_ns: self.config.lease_ns,
                renew_ns: self.config.renewal_extension_ns(),
            },
        })
        .map_err(|e| RuntimeError(e.to_string()))?;
        ready.facts.extend(machine.start_facts());
        self.sources.insert(handoff, SourceRole { machine, request });
        self.source_event(at_ns, handoff, SourceEvent::Start, false, ready);
        self.deliver_early(at_ns, handoff, ready);
        Ok(())
    }

    fn start_destination(
        &mut self,
        at_ns: u64,
        handoff: HandoffId,
        request: Request,
        source: Peer,
        ready: &mut Ready,
    ) -> Result<(), RuntimeError> {
        let machine = DestinationHandoff::new(DestinationInit {
            handoff,
            request: request.id,
            policy: self.config.policy,
            demand: demand_of(&request),
            worker: self.id,
            generation: self.generation,
            source: Some(source.worker),
            source_generation: Some(source.generation),
            config: DestinationConfig {
                reservation_ns: self.config.reservation_ns,
                kv_bytes_per_token: self.config.kv_bytes_per_token,
            },
        })
        .map_err(|e| RuntimeError(e.to_string()))?;
        ready.facts.extend(machine.start_facts());
        self.destination_of.insert(request.id, handoff);
        self.destinations.insert(handoff, DestinationRole { machine, request });
        let routed = DestinationEvent::Routed { worker: self.id };
        self.destination_event(at_ns, handoff, routed, false, ready);
        if let Some(renew) = self.config.renew_ns {
            ready
                .outputs
                .push(Output::Timer { at_ns: at_ns.saturating_add(renew), timer: NodeTimer::Renew(handoff) });
        }
        self.deliver_early(at_ns, handoff, ready);
        Ok(())
    }

    /// The destination's heartbeat: while it still waits to read, it renews the source lease.
    fn renew(&mut self, at_ns: u64, handoff: HandoffId, ready: &mut Ready) {
        let waiting = self.destination_state(handoff).is_some_and(|s| {
            matches!(
                s,
                DestinationState::NotRouted | DestinationState::Reserving | DestinationState::Reserved { .. }
            )
        });
        if !waiting {
            return;
        }
        self.destination_event(at_ns, handoff, DestinationEvent::RenewLease, false, ready);
        if let Some(renew) = self.config.renew_ns {
            ready
                .outputs
                .push(Output::Timer { at_ns: at_ns.saturating_add(renew), timer: NodeTimer::Renew(handoff) });
        }
    }

    // ---- role machines ----

    /// Feeds `ev` to the source machine of `handoff`, if this node has one. `refused`: a core
    /// refusal is ending it (the frontend reports the request rejected, not failed).
    fn source_event(
        &mut self,
        at_ns: u64,
        handoff: HandoffId,
        ev: SourceEvent,
        refused: bool,
        ready: &mut Ready,
    ) {
        let Some(role) = self.sources.get_mut(&handoff) else {
            return;
        };
        let t = match role.machine.handle(ev, at_ns) {
            Ok(t) => t,
            Err(e) => {
                let message = if let SourceEvent::Message(m) = ev { Some(m) } else { None };
                return refused_event(message, &e, ready);
            }
        };
        let released = role.machine.is_released();
        let success = matches!(role.machine.state(), SourceState::Released { how: EndReason::Success });
        ready.facts.extend(t.facts);
        let mut batch = Batch::new(at_ns, self.generation);
        for action in t.actions {
            match action {
                SourceAction::DispatchPrefill { lease_ns } => {
                    let request = role.request.clone();
                    // From here the core may compute it: the booking stays until it lets go.
                    self.computing.insert(handoff);
                    ready.outputs.push(Output::ToFrontend(ToFrontend::PrefillDispatched { handoff }));
                    batch.command(Command::DispatchPrefill { handoff, request, lease_ns });
                }
                SourceAction::ReleaseSource { reason, .. } => {
                    batch.command(Command::ReleaseSource(handoff, reason))
                }
                SourceAction::CancelPrefill { reason } => {
                    batch.command(Command::CancelSource(handoff, reason))
                }
                SourceAction::Send { to, message } => batch.message(to, message),
                SourceAction::ScheduleLeaseTimer { deadline_ns } => ready
                    .outputs
                    .push(Output::Timer { at_ns: deadline_ns.max(at_ns), timer: NodeTimer::Lease(handoff) }),
            }
        }
        ready.outputs.append(&mut batch.outputs);
        if released {
            self.sources.remove(&handoff);
            self.remember_ended(handoff);
            let ended = ToFrontend::RoleEnded { handoff, role: HandoffRole::Source, success, refused };
            ready.outputs.push(Output::ToFrontend(ended));
        }
    }

    /// Feeds `ev` to the destination machine of `handoff`, if this node has one.
    fn destination_event(
        &mut self,
        at_ns: u64,
        handoff: HandoffId,
        ev: DestinationEvent,
        refused: bool,
        ready: &mut Ready,
    ) {
        let Some(role) = self.destinations.get_mut(&handoff) else {
            return;
        };
        let t = match role.machine.handle(ev, at_ns) {
            Ok(t) => t,
            Err(e) => {
                let message = if let DestinationEvent::Message(m) = ev { Some(m) } else { None };
                return refused_event(message, &e, ready);
            }
        };
        let released = role.machine.is_released();
        let role_state = *role.machine.state();
        let success = matches!(role_state, DestinationState::Released { how: EndReason::Success });
        ready.facts.extend(t.facts);
        let mut batch = Batch::new(at_ns, self.generation);
        for action in t.actions {
            match action {
                DestinationAction::ReserveDestination { deadline_ns } => {
                    let request = role.request.clone();
                    batch.command(Command::Reserve { handoff, request, deadline_ns });
                }
                DestinationAction::StartReceive { from, missing_tokens, bytes } => {
                    ready.outputs.push(Output::StartTransfer { handoff, from, missing_tokens, bytes });
                }
                DestinationAction::ActivateDestination { .. } => {
                    ready.outputs.push(Output::ToFrontend(ToFrontend::DecodeActivated { handoff }));
                    batch.command(Command::Activate(handoff));
                }
                DestinationAction::ReleaseDestination { reason, .. } => {
                    batch.command(Command::CancelDestination(handoff, reason))
                }
                DestinationAction::AbortRequest { reason } => {
                    batch.command(Command::CancelDestination(handoff, EndReason::Canceled(reason)))
                }
                DestinationAction::Send { to, message } => batch.message(to, message),
                DestinationAction::ScheduleReservationTimer { deadline_ns } => {
                    ready.outputs.push(Output::Timer {
                        at_ns: deadline_ns.max(at_ns),
                        timer: NodeTimer::Reservation(handoff),
                    })
                }
            }
        }
        ready.outputs.append(&mut batch.outputs);
        if released {
            ready.outputs.push(Output::CancelTransfer { handoff });
            self.remember_ended(handoff);
            if let Some(role) = self.destinations.remove(&handoff) {
                if self.destination_of.get(&role.request.id) == Some(&handoff) {
                    self.destination_of.remove(&role.request.id);
                }
            }
            let withdrawn = matches!(
                role_state,
                DestinationState::Released { how: EndReason::Canceled(CancelReason::Rerouted) }
            );
            let ended = if withdrawn {
                ToFrontend::DestinationWithdrawn { handoff }
            } else {
                ToFrontend::RoleEnded { handoff, role: HandoffRole::Destination, success, refused }
            };
            ready.outputs.push(Output::ToFrontend(ended));
        }
    }

    // ---- the core ----

    fn execute_deferred(&mut self, at_ns: u64, deferred: DeferredCommand, ready: &mut Ready) {
        // (Activation is not among them: the frontend counts a decode as running from the
        // moment it is asked for, and a restart's cancel of an active destination aborts the
        // decode request, which needs the activation applied first.)
        let acquires = matches!(deferred.command, Command::DispatchPrefill { .. } | Command::Reserve { .. });
        if acquires && deferred.session.is_some_and(|g| g != self.generation) {
            tracing::debug!(worker = %self.id, command = ?deferred.command, "command of an ended session dropped");
            return;
        }
        self.execute(at_ns, deferred.command, ready);
        for (to, message) in deferred.then {
            ready.outputs.push(Output::ToWorker { to, message });
        }
    }

    fn execute(&mut self, at_ns: u64, command: Command, ready: &mut Ready) {
        let core = &mut self.core;
        match command {
            Command::Submit(request) => {
                let id = request.id;
                let r = core.submit(request, at_ns);
                self.command_result(at_ns, r, None, Some(id), ready)
            }
            Command::SubmitPrefilled(request) => {
                let id = request.id;
                let r = core.submit_prefilled(request, at_ns);
                self.command_result(at_ns, r, None, Some(id), ready)
            }
            Command::DispatchPrefill { handoff, request, lease_ns } => {
                let id = request.id;
                let r = core.submit_handoff_prefill(handoff, request, lease_ns, at_ns);
                if r.outcome.is_err() {
                    self.left_core(handoff, ready); // refused: the core never held it
                }
                self.command_result(at_ns, r, Some(handoff), Some(id), ready)
            }
            Command::Reserve { handoff, request, deadline_ns } => {
                let r = core.reserve_destination(handoff, request, deadline_ns, at_ns);
                self.command_result(at_ns, r, Some(handoff), None, ready)
            }
            Command::Activate(h) => {
                let r = core.activate_destination(h, at_ns);
                self.command_result(at_ns, r, Some(h), None, ready)
            }
            Command::ReleaseSource(h, reason) => {
                let r = core.release_source(h, reason, at_ns);
                self.command_result(at_ns, r, Some(h), None, ready)
            }
            Command::CancelSource(h, reason) => {
                let r = core.cancel_source(h, reason, at_ns);
                self.command_result(at_ns, r, Some(h), None, ready);
                // The core no longer computes this prefill (it ended it, or released the pin
                // the step in flight made).
                self.left_core(h, ready)
            }
            Command::CancelDestination(h, reason) => {
                // The core's cancel names a cause; an expired reservation is canceled as expired.
                let reason = match reason {
                    EndReason::Canceled(r) => r,
                    EndReason::Expired => CancelReason::Expired,
                    EndReason::Success => CancelReason::TransferFailed,
                };
                let r = core.cancel_destination(h, reason, at_ns);
                self.command_result(at_ns, r, Some(h), None, ready)
            }
        }
    }

    /// A dispatched prefill the core no longer computes and never pinned: the frontend frees
    /// its booking if the request already ended.
    fn left_core(&mut self, handoff: HandoffId, ready: &mut Ready) {
        if self.computing.remove(&handoff) && !self.pinned.contains(&handoff) {
            ready.outputs.push(Output::ToFrontend(ToFrontend::PrefillLeftCore { handoff }));
        }
    }

    fn command_result(
        &mut self,
        at_ns: u64,
        r: CommandResult,
        handoff: Option<HandoffId>,
        request: Option<RequestId>,
        ready: &mut Ready,
    ) {
        self.apply_effects(at_ns, r.effects, ready);
        match r.outcome {
            Ok(CommandOutcome::Applied | CommandOutcome::NoOp | CommandOutcome::Unavailable) => {}
            Err(e) => self.command_failed(at_ns, e, handoff, request, ready),
        }
    }

    /// A command the core refused: the handoff (or plain request) fails with a terminal outcome
    /// so every booking and every resource is released.
    fn command_failed(
        &mut self,
        at_ns: u64,
        e: CommandError,
        handoff: Option<HandoffId>,
        request: Option<RequestId>,
        ready: &mut Ready,
    ) {
        let reason = match e {
            CommandError::Unsupported { .. } => CancelReason::Unsupported,
            CommandError::NeverFits { .. } => CancelReason::DestinationRejected,
            // Unknown handoffs and invalid states mean an action raced a cleanup the core
            // already did: nothing to unwind.
            CommandError::UnknownHandoff(_)
            | CommandError::InvalidState { .. }
            | CommandError::DuplicateHandoff(_) => {
                tracing::debug!(worker = %self.id, error = %e, "command refused");
                return;
            }
        };
        let request = request.or_else(|| handoff.and_then(|h| self.request_of(h)));
        match handoff {
            Some(h) if self.sources.contains_key(&h) => {
                self.source_event(at_ns, h, SourceEvent::PrefillFailed { reason }, true, ready);
            }
            Some(h) if self.destinations.contains_key(&h) => {
                self.destination_event(at_ns, h, DestinationEvent::ReservationFailed { reason }, true, ready);
            }
            _ => {}
        }
        // Whatever the machines did, the request ends now (a no-op if they already ended it).
        if let Some(request) = request {
            ready.outputs.push(Output::ToFrontend(ToFrontend::Rejected { request }));
        }
    }

    fn request_of(&self, handoff: HandoffId) -> Option<RequestId> {
        let source = self.sources.get(&handoff).map(|r| r.request.id);
        source.or_else(|| self.destinations.get(&handoff).map(|r| r.request.id))
    }

    /// The core's facts go to the stream (the routers hear of KV changes, the frontend of pins
    /// released); its outputs drive the role machines and the frontend.
    fn apply_effects(&mut self, at_ns: u64, mut effects: Effects, ready: &mut Ready) {
        for f in &effects.facts {
            match f {
                Fact::KvStored { .. } | Fact::KvRemoved { .. } | Fact::KvCleared
                    if self.config.publish_kv_events =>
                {
                    ready.outputs.push(Output::ToFrontend(ToFrontend::KvChanged { fact: f.clone() }));
                }
                Fact::SourcePinned { handoff, .. } => {
                    self.pinned.insert(*handoff);
                }
                Fact::SourceReleased { handoff, .. } => {
                    self.pinned.remove(handoff);
                    ready.outputs.push(Output::ToFrontend(ToFrontend::SourceReleased { handoff: *handoff }));
                }
                _ => {}
            }
        }
        if ready.facts.is_empty() {
            // Most inputs apply one batch of effects: hand the batch over instead of copying it
            // (the emptied buffer goes back to the core with `effects`).
            std::mem::swap(&mut ready.facts, &mut effects.facts);
        } else {
            ready.facts.append(&mut effects.facts);
        }
        for o in effects.outputs.drain(..) {
            self.on_output(at_ns, o, ready);
        }
        self.recycle(effects);
    }

    fn recycle(&mut self, mut effects: Effects) {
        effects.facts.clear();
        effects.outputs.clear();
        self.spare = Some(effects);
    }

    fn on_output(&mut self, at_ns: u64, o: EngineOutput, ready: &mut Ready) {
        let to_frontend = |ready: &mut Ready, m| ready.outputs.push(Output::ToFrontend(m));
        match o {
            // A handoff prefill's first token is its own, not the user's: only the Disabled
            // policy's prefill (whose compute ends with it) and decode workers report theirs.
            EngineOutput::FirstToken { request }
                if self.id.role != Role::Prefill || self.config.policy == HandoffPolicy::Disabled =>
            {
                to_frontend(ready, ToFrontend::FirstToken { request })
            }
            EngineOutput::FirstToken { .. } => {}
            EngineOutput::Finished { request, status, .. }
                if status == TerminalStatus::Completed && self.disabled_prefill() =>
            {
                // The one token a disaggregated prefill makes: decode follows elsewhere.
                to_frontend(ready, ToFrontend::PrefillFinished { request })
            }
            EngineOutput::Finished { request, status, output_tokens } => {
                if let Some(h) = self.destination_of.get(&request).copied() {
                    self.destination_event(at_ns, h, DestinationEvent::RequestFinished, false, ready);
                }
                to_frontend(ready, ToFrontend::Finished { request, status, output_tokens });
            }
            EngineOutput::Rejected { request, .. } => to_frontend(ready, ToFrontend::Rejected { request }),
            EngineOutput::SourcePinned { handoff, request, lease, blocks, deadline_ns } => {
                self.computing.remove(&handoff); // now a pin
                to_frontend(ready, ToFrontend::PrefillPinned { handoff, request });
                let ev = SourceEvent::PrefillPinned { lease, blocks, deadline_ns };
                self.source_event(at_ns, handoff, ev, false, ready);
            }
            EngineOutput::DestinationReserved { handoff, reservation, summary } => {
                let ev = DestinationEvent::Reserved {
                    reservation,
                    prefix_tokens: summary.prefix_tokens,
                    missing_tokens: summary.missing_tokens,
                };
                self.destination_event(at_ns, handoff, ev, false, ready);
            }
            EngineOutput::ReservationFailed { handoff, .. } => {
                let request = self.request_of(handoff);
                let ev = DestinationEvent::ReservationFailed { reason: CancelReason::DestinationRejected };
                self.destination_event(at_ns, handoff, ev, true, ready);
                if let Some(request) = request {
                    to_frontend(ready, ToFrontend::Rejected { request });
                }
            }
        }
    }

    /// A prefill worker under the Disabled policy on a disaggregated cluster.
    fn disabled_prefill(&self) -> bool {
        self.config.policy == HandoffPolicy::Disabled && self.id.role == Role::Prefill
    }
}

/// A role machine refused an event: a message it refused is logged as refused (the sender
/// acted on a state this role has left); anything else was a late local event.
fn refused_event(message: Option<HandoffMessage>, e: &crate::lifecycle::TransitionError, ready: &mut Ready) {
    if let Some(m) = message {
        ready.facts.push(m.rejected_fact(MessageRejection::InvalidTransition));
    }
    tracing::debug!(error = %e, "role event refused");
}

fn demand_of(request: &Request) -> KvHandoffDemand {
    KvHandoffDemand { context_tokens: request.input_tokens, max_output_tokens: request.output_tokens }
}

fn deferred(at_ns: u64, command: Command) -> Output {
    Output::Command { at_ns, command: DeferredCommand { command, then: Vec::new(), session: None } }
}

/// One transition's commands and messages, in order; a message that follows a command waits
/// with it (see the module docs).
struct Batch {
    at_ns: u64,
    session: Generation,
    outputs: Vec<Output>,
}

impl Batch {
    fn new(at_ns: u64, session: Generation) -> Self {
        Batch { at_ns, session, outputs: Vec::new() }
    }

    fn command(&mut self, command: Command) {
        let command = DeferredCommand { command, then: Vec::new(), session: Some(self.session) };
        self.outputs.push(Output::Command { at_ns: self.at_ns, command });
    }

    fn message(&mut self, to: WorkerId, message: HandoffMessage) {
        match self.outputs.iter_mut().rev().find(|o| matches!(o, Output::Command { .. })) {
            Some(Output::Command { command, .. }) => command.then.push((to, message)),
            _ => self.outputs.push(Output::ToWorker { to, message }),
        }
    }
}
