//! The source role: a prefill worker's view of one handoff.
//!
//! ```text
//! source-first:      NotStarted -Start-> Computing -PrefillPinned-> Pinned
//!                      -DestinationReserved msg-> AwaitingReaderCompletion
//!                      -ReceiveCompleted / ReaderCompleted msg-> Released(Success)
//! destination-first: NotStarted -DestinationReserved msg-> Computing
//!                      -PrefillPinned-> AwaitingReaderCompletion -> Released(Success)
//! any live state:    -Cancelled / Abort msg / peer restart-> Released(Canceled)
//! Pinned, Awaiting:  -LeaseExpired (at or after the deadline)-> Released(Expired)
//! Computing:         -PrefillFailed-> Released(Canceled)
//! ```
//! Under source-first a destination may reserve before the prefill finishes (the decode router
//! can route early); the machine remembers the reservation and goes from `Computing` straight to
//! `AwaitingReaderCompletion`, as destination-first does.
//!
//! `SourceReady` goes to the destination as soon as the source is pinned *and* knows its
//! destination: at the pin if the destination was named at construction or has already
//! reserved, otherwise when the destination's `DestinationReserved` arrives.

use super::messages::{event_name, HandoffMessage, MessageBody};
use super::{check_policy, rejected, NewHandoffError, PeerCheck, PeerSession, Transition, TransitionError};
use crate::events::{Fact, MessageKind, MessageRejection};
use crate::ids::{
    CancelReason, EndReason, Generation, HandoffId, HandoffPolicy, KvHandoffDemand, RequestId, SourceLeaseId,
    WorkerId,
};

/// Lease timing for the source role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SourceConfig {
    /// Lease length the engine core records at the pin (`deadline = pin time + lease_ns`).
    pub lease_ns: u64,
    /// A `LeaseRenewal` moves the deadline to `max(deadline, at_ns + renew_ns)`.
    pub renew_ns: u64,
}

/// Everything a source machine is built from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SourceInit {
    pub handoff: HandoffId,
    pub request: RequestId,
    pub policy: HandoffPolicy,
    pub demand: KvHandoffDemand,
    /// This (prefill) worker.
    pub worker: WorkerId,
    /// This worker's session generation; stamped on every message it sends.
    pub generation: Generation,
    /// The destination, if the router already chose it (destination-first); otherwise learned
    /// from the destination's first message.
    pub destination: Option<WorkerId>,
    /// The destination's generation, if known; otherwise learned from its first message.
    pub destination_generation: Option<Generation>,
    pub config: SourceConfig,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceState {
    /// Created; the prefill is not dispatched (destination-first: waiting for the reservation).
    NotStarted,
    /// The prefill was dispatched to the engine core and has not pinned yet.
    Computing,
    /// Prefill done, KV pinned; no destination reservation known yet (stranded KV).
    Pinned { lease: SourceLeaseId, blocks: u32, deadline_ns: u64 },
    /// Pinned, and the destination has reserved: waiting for its reader completion.
    AwaitingReaderCompletion { lease: SourceLeaseId, blocks: u32, deadline_ns: u64 },
    /// Ended, exactly once.
    Released { how: EndReason },
}

impl SourceState {
    pub fn name(&self) -> &'static str {
        match self {
            SourceState::NotStarted => "NotStarted",
            SourceState::Computing => "Computing",
            SourceState::Pinned { .. } => "Pinned",
            SourceState::AwaitingReaderCompletion { .. } => "AwaitingReaderCompletion",
            SourceState::Released { .. } => "Released",
        }
    }
}

/// What the source machine reacts to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceEvent {
    /// The request reached this worker. Source-first dispatches now; destination-first waits for
    /// the destination's reservation (so `Start` is a no-op there).
    Start,
    /// A message from the destination (or the transport on its behalf).
    Message(HandoffMessage),
    /// The engine core's `SourcePinned` output: terminal prefill ownership became this lease.
    PrefillPinned { lease: SourceLeaseId, blocks: u32, deadline_ns: u64 },
    /// The adapter's lease timer fired at `at_ns`. Ignored when the deadline has moved later.
    LeaseExpired,
    /// Local cancellation (request abort, teardown, own session ending).
    Cancelled { reason: CancelReason },
    /// The engine core ended the prefill without pinning it (rejected, aborted).
    PrefillFailed { reason: CancelReason },
}

impl SourceEvent {
    fn name(&self) -> &'static str {
        match self {
            SourceEvent::Start => "Start",
            SourceEvent::Message(m) => event_name(m.kind()),
            SourceEvent::PrefillPinned { .. } => "PrefillPinned",
            SourceEvent::LeaseExpired => "LeaseExpired",
            SourceEvent::Cancelled { .. } => "Cancelled",
            SourceEvent::PrefillFailed { .. } => "PrefillFailed",
        }
    }
}

/// What the adapter must do, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceAction {
    /// `EngineCore::submit_handoff_prefill(handoff, request, lease_ns, at_ns)`.
    DispatchPrefill { lease_ns: u64 },
    /// `EngineCore::release_source(handoff, reason, at_ns)`: ends `lease`. Issued exactly once
    /// per lease the core reported.
    ReleaseSource { lease: SourceLeaseId, reason: EndReason },
    /// `EngineCore::cancel_source(handoff, reason, at_ns)`: ends a dispatched prefill that has
    /// not reported a pin (queued, computing, or pinned but not yet reported).
    CancelPrefill { reason: CancelReason },
    /// Deliver `message` to `to` (in-process in replay, over TCP live).
    Send { to: WorkerId, message: HandoffMessage },
    /// Arm (or re-arm) the lease timer: feed `LeaseExpired` at `deadline_ns`. Earlier timers may
    /// be left to fire; the machine ignores them.
    ScheduleLeaseTimer { deadline_ns: u64 },
}

pub type SourceTransition = Transition<SourceAction>;

/// A prefill worker's state for one handoff.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceHandoff {
    id: HandoffId,
    request: RequestId,
    policy: HandoffPolicy,
    demand: KvHandoffDemand,
    worker: WorkerId,
    generation: Generation,
    config: SourceConfig,
    peer: PeerSession,
    /// The destination's `DestinationReserved` was applied.
    destination_reserved: bool,
    /// `DispatchPrefill` was issued (so the core may still report a pin).
    dispatched: bool,
    source_ready_sent: bool,
    /// The lease the core reported, once it has.
    lease: Option<SourceLeaseId>,
    state: SourceState,
}

impl SourceHandoff {
    /// A source machine in `NotStarted`. Append [`Self::start_facts`] to the stream.
    pub fn new(init: SourceInit) -> Result<Self, NewHandoffError> {
        check_policy(init.handoff, init.policy)?;
        if init.destination == Some(init.worker) {
            return Err(NewHandoffError::SelfPeer(init.handoff));
        }
        Ok(SourceHandoff {
            id: init.handoff,
            request: init.request,
            policy: init.policy,
            demand: init.demand,
            worker: init.worker,
            generation: init.generation,
            config: init.config,
            peer: PeerSession::new(init.destination, init.destination_generation),
            destination_reserved: false,
            dispatched: false,
            source_ready_sent: false,
            lease: None,
            state: SourceState::NotStarted,
        })
    }

    /// `HandoffStarted`, for the role's stream at construction.
    pub fn start_facts(&self) -> Vec<Fact> {
        vec![Fact::HandoffStarted {
            handoff: self.id,
            request: self.request,
            policy: self.policy,
            demand: self.demand,
        }]
    }

    pub fn id(&self) -> HandoffId {
        self.id
    }
    pub fn request(&self) -> RequestId {
        self.request
    }
    pub fn policy(&self) -> HandoffPolicy {
        self.policy
    }
    pub fn worker(&self) -> WorkerId {
        self.worker
    }
    /// The destination, once known.
    pub fn peer(&self) -> Option<WorkerId> {
        self.peer.worker
    }
    pub fn peer_generation(&self) -> Option<Generation> {
        self.peer.generation
    }
    pub fn state(&self) -> &SourceState {
        &self.state
    }
    pub fn state_name(&self) -> &'static str {
        self.state.name()
    }
    pub fn is_released(&self) -> bool {
        matches!(self.state, SourceState::Released { .. })
    }
    /// The lease deadline while pinned.
    pub fn deadline_ns(&self) -> Option<u64> {
        match self.state {
            SourceState::Pinned { deadline_ns, .. }
            | SourceState::AwaitingReaderCompletion { deadline_ns, .. } => Some(deadline_ns),
            _ => None,
        }
    }
    /// The lease the core reported, if any (it stays known after release).
    pub fn lease(&self) -> Option<SourceLeaseId> {
        self.lease
    }

    /// Apply one event at `at_ns`. On error nothing changed.
    pub fn handle(&mut self, ev: SourceEvent, at_ns: u64) -> Result<SourceTransition, TransitionError> {
        // Work on a copy and commit only on success: an error can never leave a half-applied
        // transition behind. The machine is a few dozen bytes.
        let mut next = self.clone();
        let t = next.apply(ev, at_ns)?;
        *self = next;
        Ok(t)
    }

    fn err(&self, event: &'static str) -> TransitionError {
        TransitionError { handoff: self.id, state: self.state.name(), event }
    }

    fn apply(&mut self, ev: SourceEvent, at_ns: u64) -> Result<SourceTransition, TransitionError> {
        let mut t = SourceTransition::none();
        match ev {
            SourceEvent::Start => {
                if self.state == SourceState::NotStarted && self.policy == HandoffPolicy::SourceFirst {
                    self.dispatch(&mut t);
                }
                // Destination-first waits for the reservation; anything later is a duplicate.
            }
            SourceEvent::PrefillPinned { lease, blocks, deadline_ns } => match self.state {
                SourceState::NotStarted => return Err(self.err(ev.name())),
                SourceState::Computing => {
                    self.lease = Some(lease);
                    self.state = if self.destination_reserved {
                        SourceState::AwaitingReaderCompletion { lease, blocks, deadline_ns }
                    } else {
                        SourceState::Pinned { lease, blocks, deadline_ns }
                    };
                    t.actions.push(SourceAction::ScheduleLeaseTimer { deadline_ns });
                    self.send_source_ready(&mut t, blocks);
                }
                SourceState::Pinned { lease: l, .. }
                | SourceState::AwaitingReaderCompletion { lease: l, .. } => {
                    if l != lease {
                        return Err(self.err("PrefillPinned(second lease)"));
                    }
                }
                SourceState::Released { how } => {
                    match self.lease {
                        Some(l) if l == lease => {} // duplicate of a pin already ended
                        Some(_) => return Err(self.err("PrefillPinned(second lease)")),
                        None if self.dispatched => {
                            // The core pinned before it saw our cancel: end the pin now.
                            self.lease = Some(lease);
                            t.actions.push(SourceAction::ReleaseSource { lease, reason: how });
                        }
                        None => return Err(self.err(ev.name())),
                    }
                }
            },
            SourceEvent::LeaseExpired => match self.state {
                SourceState::NotStarted | SourceState::Computing => return Err(self.err(ev.name())),
                SourceState::Pinned { lease, deadline_ns, .. }
                | SourceState::AwaitingReaderCompletion { lease, deadline_ns, .. } => {
                    if at_ns >= deadline_ns {
                        self.state = SourceState::Released { how: EndReason::Expired };
                        t.actions.push(SourceAction::ReleaseSource { lease, reason: EndReason::Expired });
                        t.facts.push(Fact::LeaseExpired { handoff: self.id, lease });
                        // The destination must not read freed blocks: tell it.
                        self.send_abort(&mut t, CancelReason::TransferFailed);
                    }
                    // Earlier than the deadline: a timer from before a renewal. Ignore.
                }
                SourceState::Released { .. } => {}
            },
            SourceEvent::Cancelled { reason } => {
                if !self.is_released() {
                    self.cancel(&mut t, reason, true);
                }
            }
            SourceEvent::PrefillFailed { reason } => match self.state {
                SourceState::Computing => {
                    // The core already ended the prefill: nothing to free here.
                    self.state = SourceState::Released { how: EndReason::Canceled(reason) };
                    t.facts.push(Fact::HandoffCanceled { handoff: self.id, reason });
                    self.send_abort(&mut t, reason);
                }
                SourceState::Released { .. } => {}
                _ => return Err(self.err(ev.name())),
            },
            SourceEvent::Message(msg) => self.on_message(&mut t, msg, at_ns)?,
        }
        Ok(t)
    }

    fn on_message(
        &mut self,
        t: &mut SourceTransition,
        msg: HandoffMessage,
        at_ns: u64,
    ) -> Result<(), TransitionError> {
        let name = event_name(msg.kind());
        if msg.handoff != self.id {
            return Err(self.err("Message(other handoff)"));
        }
        // Only a destination sends these; anything else is misrouted.
        if msg.kind() == MessageKind::SourceReady {
            return Err(self.err(name));
        }
        if let MessageBody::DestinationReserved { destination, .. } = msg.body {
            if destination != msg.from {
                return Err(self.err("Message(DestinationReserved from another worker)"));
            }
        }
        let check = self.peer.check(msg.from, msg.generation);
        if check == PeerCheck::Foreign {
            return Err(self.err("Message(foreign worker)"));
        }
        if let SourceState::Released { how } = self.state {
            t.facts.push(rejected(&msg, MessageRejection::Late));
            self.reply_late(t, &msg, check, how);
            return Ok(());
        }
        match check {
            PeerCheck::Stale => {
                t.facts.push(rejected(&msg, MessageRejection::StaleGeneration));
                return Ok(());
            }
            PeerCheck::Restarted => {
                // The incarnation that knew this handoff is gone.
                t.facts.push(msg.received_fact());
                self.peer.generation = Some(msg.generation);
                self.cancel(t, CancelReason::PeerLost, false);
                return Ok(());
            }
            PeerCheck::Current | PeerCheck::Foreign => {}
        }
        match msg.body {
            MessageBody::SourceReady { .. } => return Err(self.err(name)),
            MessageBody::DestinationReserved { .. } => {
                if self.destination_reserved {
                    t.facts.push(rejected(&msg, MessageRejection::Duplicate));
                    return Ok(());
                }
                self.accept(t, &msg);
                self.destination_reserved = true;
                match self.state {
                    // Destination-first: the reservation is the gate for the prefill.
                    // (Source-first just remembers it until Start.)
                    SourceState::NotStarted if self.policy == HandoffPolicy::DestinationFirst => {
                        self.dispatch(t);
                    }
                    SourceState::Pinned { lease, blocks, deadline_ns } => {
                        self.state = SourceState::AwaitingReaderCompletion { lease, blocks, deadline_ns };
                        self.send_source_ready(t, blocks);
                    }
                    _ => {}
                }
            }
            MessageBody::ReceiveCompleted | MessageBody::ReaderCompleted => match self.state {
                SourceState::Pinned { lease, .. } | SourceState::AwaitingReaderCompletion { lease, .. } => {
                    self.accept(t, &msg);
                    self.state = SourceState::Released { how: EndReason::Success };
                    t.facts.push(Fact::ReaderCompleted { handoff: self.id });
                    t.actions.push(SourceAction::ReleaseSource { lease, reason: EndReason::Success });
                }
                _ => return Err(self.err(name)),
            },
            MessageBody::Abort { reason } => {
                self.accept(t, &msg);
                self.cancel(t, reason, false);
            }
            MessageBody::LeaseRenewal => match self.state {
                SourceState::Pinned { lease, blocks, deadline_ns }
                | SourceState::AwaitingReaderCompletion { lease, blocks, deadline_ns } => {
                    let extended = deadline_ns.max(at_ns.saturating_add(self.config.renew_ns));
                    if extended == deadline_ns {
                        t.facts.push(rejected(&msg, MessageRejection::Duplicate));
                        return Ok(());
                    }
                    self.accept(t, &msg);
                    self.state = match self.state {
                        SourceState::Pinned { .. } => {
                            SourceState::Pinned { lease, blocks, deadline_ns: extended }
                        }
                        _ => SourceState::AwaitingReaderCompletion { lease, blocks, deadline_ns: extended },
                    };
                    t.facts.push(Fact::LeaseRenewed { handoff: self.id, lease, deadline_ns: extended });
                    t.actions.push(SourceAction::ScheduleLeaseTimer { deadline_ns: extended });
                }
                // No lease yet: the heartbeat only shows the destination is alive.
                _ => self.accept(t, &msg),
            },
        }
        Ok(())
    }

    /// Record an applied message and learn the peer from it.
    fn accept(&mut self, t: &mut SourceTransition, msg: &HandoffMessage) {
        self.peer.learn(msg.from, msg.generation);
        t.facts.push(msg.received_fact());
    }

    fn dispatch(&mut self, t: &mut SourceTransition) {
        self.state = SourceState::Computing;
        self.dispatched = true;
        t.actions.push(SourceAction::DispatchPrefill { lease_ns: self.config.lease_ns });
        t.facts.push(Fact::PrefillDispatched { handoff: self.id });
    }

    fn send(&mut self, t: &mut SourceTransition, to: WorkerId, body: MessageBody) {
        let message =
            HandoffMessage { handoff: self.id, from: self.worker, generation: self.generation, body };
        t.facts.push(Fact::MessageSent { handoff: self.id, kind: body.kind(), to });
        t.actions.push(SourceAction::Send { to, message });
    }

    fn send_source_ready(&mut self, t: &mut SourceTransition, blocks: u32) {
        if self.source_ready_sent {
            return;
        }
        if let Some(to) = self.peer.worker {
            self.source_ready_sent = true;
            let body = MessageBody::SourceReady {
                source: self.worker,
                blocks,
                prompt_tokens: self.demand.context_tokens,
            };
            self.send(t, to, body);
        }
    }

    fn send_abort(&mut self, t: &mut SourceTransition, reason: CancelReason) {
        if self.peer.abort_sent {
            return;
        }
        if let Some(to) = self.peer.worker {
            self.peer.abort_sent = true;
            self.send(t, to, MessageBody::Abort { reason });
        }
    }

    /// End a live handoff for `reason`, freeing exactly what this role holds or has requested.
    /// `local`: this worker decided it, so the peer is told; otherwise the peer already knows
    /// (its Abort) or is gone (restart).
    fn cancel(&mut self, t: &mut SourceTransition, reason: CancelReason, local: bool) {
        match self.state {
            SourceState::NotStarted | SourceState::Released { .. } => {}
            SourceState::Computing => t.actions.push(SourceAction::CancelPrefill { reason }),
            SourceState::Pinned { lease, .. } | SourceState::AwaitingReaderCompletion { lease, .. } => {
                t.actions.push(SourceAction::ReleaseSource { lease, reason: EndReason::Canceled(reason) })
            }
        }
        self.state = SourceState::Released { how: EndReason::Canceled(reason) };
        t.facts.push(Fact::HandoffCanceled { handoff: self.id, reason });
        if local {
            self.send_abort(t, reason);
        } else {
            self.peer.abort_sent = true;
        }
    }

    /// After a failed handoff, the first message from a peer that did not hear of the failure
    /// gets one Abort, so it frees its side now rather than at its own deadline.
    fn reply_late(
        &mut self,
        t: &mut SourceTransition,
        msg: &HandoffMessage,
        check: PeerCheck,
        how: EndReason,
    ) {
        let reason = match how {
            EndReason::Success => return,
            EndReason::Expired => CancelReason::TransferFailed,
            EndReason::Canceled(r) => r,
        };
        if check != PeerCheck::Current || msg.kind() == MessageKind::Abort {
            return;
        }
        if self.peer.worker.is_none() {
            self.peer.learn(msg.from, msg.generation);
        }
        self.send_abort(t, reason);
    }
}
