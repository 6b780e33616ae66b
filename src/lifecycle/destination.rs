//! The destination role: a decode worker's view of one handoff.
//!
//! ```text
//! NotRouted -Routed-> Reserving [ReserveDestination]
//! Reserving -Reserved-> Reserved [Send DestinationReserved, ScheduleReservationTimer]
//! Reserved + SourceReady seen (either order) -> Receiving [StartReceive]
//! Receiving -ReceiveCompleted-> Active [ActivateDestination, Send ReceiveCompleted]
//! Active -RequestFinished-> Released(Success)
//! Reserving/Reserved/Receiving -Cancelled / Abort msg / peer restart / ReservationExpired /
//!   ReservationFailed-> Released
//! ```
//! The policy does not change this role's steps: under destination-first the source waits for
//! this role's `DestinationReserved`; under source-first it may already be pinned.
//!
//! `Routed` moves straight to `Reserving` because `ReserveDestination` is issued with it; there
//! is no resting "routed" state (the proposal's `Routed{worker}` is the `DestinationRouted`
//! fact). The reservation deadline starts when the core reports the reservation, so time spent
//! in the core's pending FIFO (vLLM's head-of-line wait for capacity) does not count against it.

use super::messages::{event_name, HandoffMessage, MessageBody};
use super::{check_policy, rejected, NewHandoffError, PeerCheck, PeerSession, Transition, TransitionError};
use crate::events::{Fact, MessageKind, MessageRejection};
use crate::ids::{
    CancelReason, DestinationReservationId, EndReason, Generation, HandoffId, HandoffPolicy, KvHandoffDemand,
    RequestId, WorkerId,
};

/// Reservation timing and transfer sizing for the destination role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DestinationConfig {
    /// How long a reservation may wait for its transfer to complete (SGLang's waiting timeout).
    pub reservation_ns: u64,
    /// KV bytes per token, to size `StartReceive`/`ReceiveStarted` from the missing tokens.
    pub kv_bytes_per_token: u64,
}

/// Everything a destination machine is built from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DestinationInit {
    pub handoff: HandoffId,
    pub request: RequestId,
    pub policy: HandoffPolicy,
    pub demand: KvHandoffDemand,
    /// This (decode) worker.
    pub worker: WorkerId,
    /// This worker's session generation; stamped on every message it sends.
    pub generation: Generation,
    /// The source, if the router named it (it usually does); otherwise learned from `SourceReady`.
    pub source: Option<WorkerId>,
    /// The source's generation, if known; otherwise learned from its first message.
    pub source_generation: Option<Generation>,
    pub config: DestinationConfig,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DestinationState {
    /// Created; the decode router has not picked this worker yet.
    NotRouted,
    /// `ReserveDestination` issued; the core has not reported the reservation (it may be
    /// waiting in the core's pending FIFO).
    Reserving,
    /// Physical destination capacity is held; waiting for the source to be ready.
    Reserved { reservation: DestinationReservationId },
    /// The transfer into the reservation is in flight.
    Receiving { reservation: DestinationReservationId },
    /// Destination KV is valid and the request is ordinary decode work.
    Active { reservation: DestinationReservationId },
    /// Ended, exactly once.
    Released { how: EndReason },
}

impl DestinationState {
    pub fn name(&self) -> &'static str {
        match self {
            DestinationState::NotRouted => "NotRouted",
            DestinationState::Reserving => "Reserving",
            DestinationState::Reserved { .. } => "Reserved",
            DestinationState::Receiving { .. } => "Receiving",
            DestinationState::Active { .. } => "Active",
            DestinationState::Released { .. } => "Released",
        }
    }
}

/// What the destination machine reacts to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DestinationEvent {
    /// The decode router picked `worker` (must be this worker) for the handoff.
    Routed { worker: WorkerId },
    /// The engine core's `DestinationReserved` output.
    Reserved { reservation: DestinationReservationId, prefix_tokens: u32, missing_tokens: u32 },
    /// The core can never reserve here (never fits, unsupported); it has already dropped it.
    ReservationFailed { reason: CancelReason },
    /// A message from the source.
    Message(HandoffMessage),
    /// The adapter's transfer timer fired: destination KV is valid.
    ReceiveCompleted,
    /// The adapter's reservation timer fired at `at_ns`. Ignored before the deadline or once
    /// the reservation was activated.
    ReservationExpired,
    /// Local cancellation (request abort, teardown, own session ending).
    Cancelled { reason: CancelReason },
    /// The activated decode request finished.
    RequestFinished,
    /// The adapter's heartbeat timer: tell the source this destination is alive (lease renewal).
    RenewLease,
    /// The frontend moves the handoff to a decode worker that joined with room. Only a
    /// destination still waiting for its reservation lets go (the source never heard of it, so
    /// it is not told); any other state ignores it.
    Withdraw,
}

impl DestinationEvent {
    fn name(&self) -> &'static str {
        match self {
            DestinationEvent::Routed { .. } => "Routed",
            DestinationEvent::Reserved { .. } => "Reserved",
            DestinationEvent::ReservationFailed { .. } => "ReservationFailed",
            DestinationEvent::Message(m) => event_name(m.kind()),
            DestinationEvent::ReceiveCompleted => "ReceiveCompleted",
            DestinationEvent::Withdraw => "Withdraw",
            DestinationEvent::ReservationExpired => "ReservationExpired",
            DestinationEvent::Cancelled { .. } => "Cancelled",
            DestinationEvent::RequestFinished => "RequestFinished",
            DestinationEvent::RenewLease => "RenewLease",
        }
    }
}

/// What the adapter must do, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DestinationAction {
    /// `EngineCore::reserve_destination(handoff, request, deadline_ns, at_ns)`. `deadline_ns` is
    /// the deadline if the core reserves at once; the machine's own timer starts at `Reserved`.
    ReserveDestination { deadline_ns: u64 },
    /// Start the transfer from `from` (the adapter schedules `ReceiveCompleted`).
    StartReceive { from: WorkerId, missing_tokens: u32, bytes: u64 },
    /// `EngineCore::activate_destination(handoff, at_ns)`: ends `reservation` by activation.
    ActivateDestination { reservation: DestinationReservationId },
    /// `EngineCore::cancel_destination(handoff, reason, at_ns)`. `reservation: None` ends a
    /// reservation request the core has not acknowledged (pending, or reserved but not yet
    /// reported); `Some(r)` ends reservation `r`. Each happens at most once.
    ReleaseDestination { reservation: Option<DestinationReservationId>, reason: EndReason },
    /// The handoff was over (activated) when it was canceled: abort the running decode request
    /// (`EngineCore::cancel_destination` handles an activated handoff as a request abort).
    AbortRequest { reason: CancelReason },
    /// Deliver `message` to `to`.
    Send { to: WorkerId, message: HandoffMessage },
    /// Arm the reservation timer: feed `ReservationExpired` at `deadline_ns`.
    ScheduleReservationTimer { deadline_ns: u64 },
}

pub type DestinationTransition = Transition<DestinationAction>;

/// What the source reported in `SourceReady`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SourceReadyInfo {
    blocks: u32,
    prompt_tokens: u32,
}

/// What the core reported in `Reserved`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ReservationInfo {
    id: DestinationReservationId,
    prefix_tokens: u32,
    missing_tokens: u32,
}

/// A decode worker's state for one handoff.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DestinationHandoff {
    id: HandoffId,
    request: RequestId,
    policy: HandoffPolicy,
    demand: KvHandoffDemand,
    worker: WorkerId,
    generation: Generation,
    config: DestinationConfig,
    peer: PeerSession,
    source_ready: Option<SourceReadyInfo>,
    /// `ReserveDestination` was issued (so the core may still report a reservation).
    reserve_issued: bool,
    /// The reservation the core reported, once it has (it stays known after release).
    reservation: Option<ReservationInfo>,
    reserved_sent: bool,
    deadline_ns: Option<u64>,
    state: DestinationState,
}

impl DestinationHandoff {
    /// A destination machine in `NotRouted`. Append [`Self::start_facts`] to the stream.
    pub fn new(init: DestinationInit) -> Result<Self, NewHandoffError> {
        check_policy(init.handoff, init.policy)?;
        if init.source == Some(init.worker) {
            return Err(NewHandoffError::SelfPeer(init.handoff));
        }
        Ok(DestinationHandoff {
            id: init.handoff,
            request: init.request,
            policy: init.policy,
            demand: init.demand,
            worker: init.worker,
            generation: init.generation,
            config: init.config,
            peer: PeerSession::new(init.source, init.source_generation),
            source_ready: None,
            reserve_issued: false,
            reservation: None,
            reserved_sent: false,
            deadline_ns: None,
            state: DestinationState::NotRouted,
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
    /// The source, once known.
    pub fn peer(&self) -> Option<WorkerId> {
        self.peer.worker
    }
    pub fn peer_generation(&self) -> Option<Generation> {
        self.peer.generation
    }
    pub fn state(&self) -> &DestinationState {
        &self.state
    }
    pub fn state_name(&self) -> &'static str {
        self.state.name()
    }
    pub fn is_released(&self) -> bool {
        matches!(self.state, DestinationState::Released { .. })
    }
    /// The reservation deadline while a reservation is held and not yet activated.
    pub fn deadline_ns(&self) -> Option<u64> {
        match self.state {
            DestinationState::Reserved { .. } | DestinationState::Receiving { .. } => self.deadline_ns,
            _ => None,
        }
    }
    /// The reservation the core reported, if any (it stays known after release).
    pub fn reservation(&self) -> Option<DestinationReservationId> {
        self.reservation.map(|r| r.id)
    }

    /// Apply one event at `at_ns`. On error nothing changed.
    pub fn handle(
        &mut self,
        ev: DestinationEvent,
        at_ns: u64,
    ) -> Result<DestinationTransition, TransitionError> {
        // Work on a copy and commit only on success (see SourceHandoff::handle).
        let mut next = self.clone();
        let t = next.apply(ev, at_ns)?;
        *self = next;
        Ok(t)
    }

    fn err(&self, event: &'static str) -> TransitionError {
        TransitionError { handoff: self.id, state: self.state.name(), event }
    }

    fn apply(&mut self, ev: DestinationEvent, at_ns: u64) -> Result<DestinationTransition, TransitionError> {
        let mut t = DestinationTransition::none();
        match ev {
            DestinationEvent::Routed { worker } => {
                if worker != self.worker {
                    return Err(self.err("Routed(another worker)"));
                }
                if self.state == DestinationState::NotRouted {
                    self.state = DestinationState::Reserving;
                    self.reserve_issued = true;
                    let deadline_ns = at_ns.saturating_add(self.config.reservation_ns);
                    t.facts.push(Fact::DestinationRouted { handoff: self.id, worker });
                    t.actions.push(DestinationAction::ReserveDestination { deadline_ns });
                }
                // Otherwise a duplicate, or late after release.
            }
            DestinationEvent::Reserved { reservation, prefix_tokens, missing_tokens } => self.on_reserved(
                &mut t,
                ReservationInfo { id: reservation, prefix_tokens, missing_tokens },
                at_ns,
            )?,
            DestinationEvent::ReservationFailed { reason } => match self.state {
                DestinationState::Reserving => {
                    // The core dropped the request itself: nothing to free here.
                    self.state = DestinationState::Released { how: EndReason::Canceled(reason) };
                    t.facts.push(Fact::HandoffCanceled { handoff: self.id, reason });
                    self.send_abort(&mut t, reason);
                }
                DestinationState::Released { .. } => {}
                _ => return Err(self.err(ev.name())),
            },
            DestinationEvent::ReceiveCompleted => match self.state {
                DestinationState::Receiving { reservation } => {
                    self.state = DestinationState::Active { reservation };
                    t.facts.push(Fact::ReceiveCompleted { handoff: self.id });
                    t.actions.push(DestinationAction::ActivateDestination { reservation });
                    match self.peer.worker {
                        Some(to) => self.send(&mut t, to, MessageBody::ReceiveCompleted),
                        None => return Err(self.err(ev.name())), // unreachable: Receiving needs SourceReady
                    }
                }
                DestinationState::Active { .. } | DestinationState::Released { .. } => {}
                _ => return Err(self.err(ev.name())),
            },
            DestinationEvent::ReservationExpired => self.on_reservation_expired(&mut t, at_ns, ev)?,
            DestinationEvent::Cancelled { reason } => {
                if !self.is_released() {
                    self.cancel(&mut t, reason, true);
                }
            }
            DestinationEvent::Withdraw => {
                if self.state == DestinationState::Reserving {
                    self.cancel(&mut t, CancelReason::Rerouted, false);
                }
            }
            DestinationEvent::RequestFinished => match self.state {
                DestinationState::Active { .. } => {
                    self.state = DestinationState::Released { how: EndReason::Success };
                }
                DestinationState::Released { .. } => {}
                _ => return Err(self.err(ev.name())),
            },
            DestinationEvent::RenewLease => match self.state {
                DestinationState::NotRouted
                | DestinationState::Reserving
                | DestinationState::Reserved { .. }
                | DestinationState::Receiving { .. } => {
                    if let Some(to) = self.peer.worker {
                        self.send(&mut t, to, MessageBody::LeaseRenewal);
                    }
                }
                DestinationState::Active { .. } | DestinationState::Released { .. } => {}
            },
            DestinationEvent::Message(msg) => self.on_message(&mut t, msg)?,
        }
        Ok(t)
    }

    /// The core reported the reservation: hold it until the source is ready, or end one the
    /// core made after a cancel it had not seen.
    fn on_reserved(
        &mut self,
        t: &mut DestinationTransition,
        info: ReservationInfo,
        at_ns: u64,
    ) -> Result<(), TransitionError> {
        let name = "Reserved";
        let reservation = info.id;
        match self.state {
            DestinationState::NotRouted => return Err(self.err(name)),
            DestinationState::Reserving => {
                self.reservation = Some(info);
                let deadline_ns = at_ns.saturating_add(self.config.reservation_ns);
                self.deadline_ns = Some(deadline_ns);
                self.state = DestinationState::Reserved { reservation };
                t.actions.push(DestinationAction::ScheduleReservationTimer { deadline_ns });
                self.send_reserved(t);
                if self.source_ready.is_some() {
                    self.start_receive(t)?;
                }
            }
            DestinationState::Reserved { reservation: r }
            | DestinationState::Receiving { reservation: r }
            | DestinationState::Active { reservation: r } => {
                if r != reservation {
                    return Err(self.err("Reserved(second reservation)"));
                }
            }
            DestinationState::Released { how } => match self.reservation {
                Some(r) if r.id == reservation => {}
                Some(_) => return Err(self.err("Reserved(second reservation)")),
                None if self.reserve_issued => {
                    // The core reserved before it saw our cancel: end it now.
                    self.reservation = Some(info);
                    t.actions.push(DestinationAction::ReleaseDestination {
                        reservation: Some(reservation),
                        reason: how,
                    });
                }
                None => return Err(self.err(name)),
            },
        }
        Ok(())
    }

    /// The reservation timer fired: a reservation still unread at its deadline is released.
    fn on_reservation_expired(
        &mut self,
        t: &mut DestinationTransition,
        at_ns: u64,
        ev: DestinationEvent,
    ) -> Result<(), TransitionError> {
        match self.state {
            DestinationState::Reserved { reservation } | DestinationState::Receiving { reservation } => {
                let deadline = self.deadline_ns.unwrap_or(0);
                if at_ns >= deadline {
                    self.state = DestinationState::Released { how: EndReason::Expired };
                    t.facts.push(Fact::ReservationExpired { handoff: self.id, reservation });
                    t.actions.push(DestinationAction::ReleaseDestination {
                        reservation: Some(reservation),
                        reason: EndReason::Expired,
                    });
                    self.send_abort(t, CancelReason::TransferFailed);
                }
            }
            // Activated or released: the timer outlived the reservation.
            DestinationState::Active { .. } | DestinationState::Released { .. } => {}
            DestinationState::NotRouted | DestinationState::Reserving => return Err(self.err(ev.name())),
        };
        Ok(())
    }

    fn on_message(
        &mut self,
        t: &mut DestinationTransition,
        msg: HandoffMessage,
    ) -> Result<(), TransitionError> {
        let name = event_name(msg.kind());
        if msg.handoff != self.id {
            return Err(self.err("Message(other handoff)"));
        }
        // Only SourceReady and Abort travel from a source to a destination.
        if !matches!(msg.kind(), MessageKind::SourceReady | MessageKind::Abort) {
            return Err(self.err(name));
        }
        if let MessageBody::SourceReady { source, .. } = msg.body {
            if source != msg.from {
                return Err(self.err("Message(SourceReady from another worker)"));
            }
        }
        let check = self.peer.check(msg.from, msg.generation);
        if check == PeerCheck::Foreign {
            return Err(self.err("Message(foreign worker)"));
        }
        match self.state {
            DestinationState::Released { how } => {
                t.facts.push(rejected(&msg, MessageRejection::Late));
                self.reply_late(t, &msg, check, how);
                return Ok(());
            }
            DestinationState::Active { .. } => {
                // The transfer is complete; the source's fate no longer matters here.
                let why = match (check, msg.body) {
                    (PeerCheck::Stale, _) => MessageRejection::StaleGeneration,
                    (PeerCheck::Current, MessageBody::SourceReady { .. }) => MessageRejection::Duplicate,
                    _ => MessageRejection::Late,
                };
                t.facts.push(rejected(&msg, why));
                return Ok(());
            }
            _ => {}
        }
        match check {
            PeerCheck::Stale => {
                t.facts.push(rejected(&msg, MessageRejection::StaleGeneration));
                return Ok(());
            }
            PeerCheck::Restarted => {
                t.facts.push(msg.received_fact());
                self.peer.generation = Some(msg.generation);
                self.cancel(t, CancelReason::PeerLost, false);
                return Ok(());
            }
            PeerCheck::Current | PeerCheck::Foreign => {}
        }
        match msg.body {
            MessageBody::SourceReady { blocks, prompt_tokens, .. } => {
                if self.source_ready.is_some() {
                    t.facts.push(rejected(&msg, MessageRejection::Duplicate));
                    return Ok(());
                }
                self.peer.learn(msg.from, msg.generation);
                t.facts.push(msg.received_fact());
                self.source_ready = Some(SourceReadyInfo { blocks, prompt_tokens });
                if let DestinationState::Reserved { .. } = self.state {
                    // If the source was unknown when we reserved, it learns of the reservation now.
                    self.send_reserved(t);
                    self.start_receive(t)?;
                }
            }
            MessageBody::Abort { reason } => {
                self.peer.learn(msg.from, msg.generation);
                t.facts.push(msg.received_fact());
                self.cancel(t, reason, false);
            }
            _ => return Err(self.err(name)),
        }
        Ok(())
    }

    fn send(&mut self, t: &mut DestinationTransition, to: WorkerId, body: MessageBody) {
        let message =
            HandoffMessage { handoff: self.id, from: self.worker, generation: self.generation, body };
        t.facts.push(Fact::MessageSent { handoff: self.id, kind: body.kind(), to });
        t.actions.push(DestinationAction::Send { to, message });
    }

    fn send_reserved(&mut self, t: &mut DestinationTransition) {
        if self.reserved_sent {
            return;
        }
        if let (Some(to), Some(r)) = (self.peer.worker, self.reservation) {
            self.reserved_sent = true;
            let body = MessageBody::DestinationReserved {
                destination: self.worker,
                reservation: r.id,
                prefix_tokens: r.prefix_tokens,
                missing_tokens: r.missing_tokens,
            };
            self.send(t, to, body);
        }
    }

    /// Reserved and the source is ready: start the transfer (invariant 1: never without a
    /// reservation).
    fn start_receive(&mut self, t: &mut DestinationTransition) -> Result<(), TransitionError> {
        let (Some(from), Some(r)) = (self.peer.worker, self.reservation) else {
            return Err(self.err("StartReceive(without source or reservation)"));
        };
        self.state = DestinationState::Receiving { reservation: r.id };
        let bytes = u64::from(r.missing_tokens).saturating_mul(self.config.kv_bytes_per_token);
        t.actions.push(DestinationAction::StartReceive { from, missing_tokens: r.missing_tokens, bytes });
        t.facts.push(Fact::ReceiveStarted { handoff: self.id, from, bytes });
        Ok(())
    }

    fn send_abort(&mut self, t: &mut DestinationTransition, reason: CancelReason) {
        if self.peer.abort_sent {
            return;
        }
        if let Some(to) = self.peer.worker {
            self.peer.abort_sent = true;
            self.send(t, to, MessageBody::Abort { reason });
        }
    }

    /// End a live handoff for `reason`, freeing exactly what this role holds or has requested.
    fn cancel(&mut self, t: &mut DestinationTransition, reason: CancelReason, local: bool) {
        let how = EndReason::Canceled(reason);
        let mut tell_peer = local;
        match self.state {
            DestinationState::NotRouted | DestinationState::Released { .. } => {}
            DestinationState::Reserving => {
                t.actions.push(DestinationAction::ReleaseDestination { reservation: None, reason: how })
            }
            DestinationState::Reserved { reservation } | DestinationState::Receiving { reservation } => t
                .actions
                .push(DestinationAction::ReleaseDestination { reservation: Some(reservation), reason: how }),
            DestinationState::Active { .. } => {
                // The reservation already ended by activation and the source was told; only the
                // running request remains.
                t.actions.push(DestinationAction::AbortRequest { reason });
                tell_peer = false;
            }
        }
        self.state = DestinationState::Released { how };
        t.facts.push(Fact::HandoffCanceled { handoff: self.id, reason });
        if tell_peer {
            self.send_abort(t, reason);
        } else {
            self.peer.abort_sent = true;
        }
    }

    /// One `Abort` back to a peer that messages a failed handoff (see
    /// [`PeerSession::late_abort_reason`]).
    fn reply_late(
        &mut self,
        t: &mut DestinationTransition,
        msg: &HandoffMessage,
        check: PeerCheck,
        how: EndReason,
    ) {
        if let Some(reason) = self.peer.late_abort_reason(msg, check, how) {
            self.send_abort(t, reason);
        }
    }
}
