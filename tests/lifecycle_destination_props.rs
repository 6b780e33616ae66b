//! Property test of the destination role alone: random sequences of routing, core reservation
//! outputs (possibly racing a cancel), source messages (current, stale, newer generation,
//! duplicated, late), transfer completion, expiry, cancellation and invalid events. Checks after
//! every event and at the end that the reservation request and the reservation each end exactly
//! once, that no transfer starts without a reservation, that nothing leaves `Released`, and that
//! errors change nothing.

mod support;

use handoff_ledger::events::{Fact, MessageRejection};
use handoff_ledger::ids::{
    CancelReason, DestinationReservationId, EndReason, Generation, HandoffId, HandoffPolicy, WorkerId,
};
use handoff_ledger::lifecycle::{
    DestinationAction, DestinationEvent, DestinationHandoff, DestinationState, HandoffMessage, MessageBody,
};
use proptest::prelude::*;
use support::lifecycle::*;

const RES: DestinationReservationId = DestinationReservationId(42);
const MISSING: u32 = 1024;

#[derive(Clone, Copy, Debug)]
enum Gen {
    Current,
    Stale,
    Newer,
}

#[derive(Clone, Copy, Debug)]
enum Body {
    Ready,
    Abort(CancelReason),
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Route,
    RouteElsewhere,
    Advance(u64),
    /// The fake core reserves (its output is queued, not yet delivered).
    CoreReserves,
    /// Deliver the queued reservation output (again: a duplicate).
    DeliverReserved,
    CoreFails(CancelReason),
    /// The transfer timer fires (only meaningful once receiving; delivered regardless).
    TransferDone,
    ReservationTimer,
    Cancel(CancelReason),
    Finish,
    Heartbeat,
    /// The frontend moves the handoff to a worker that joined (acts only while reserving).
    Withdraw,
    Msg(Gen, Body),
    Foreign,
    OtherHandoff,
    /// A source-bound message kind sent to the destination.
    Misrouted,
    Redeliver,
    /// A reservation the core never made.
    BogusReserved,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let gen = prop_oneof![40 => Just(Gen::Current), 4 => Just(Gen::Stale), 1 => Just(Gen::Newer)];
    let body =
        prop_oneof![12 => Just(Body::Ready), 1 => (0..REASONS.len()).prop_map(|i| Body::Abort(REASONS[i]))];
    prop_oneof![
        8 => Just(Op::Route),
        1 => Just(Op::RouteElsewhere),
        3 => (0..2 * RESERVATION_NS).prop_map(Op::Advance),
        8 => Just(Op::CoreReserves),
        8 => Just(Op::DeliverReserved),
        1 => (0..REASONS.len()).prop_map(|i| Op::CoreFails(REASONS[i])),
        6 => Just(Op::TransferDone),
        5 => Just(Op::ReservationTimer),
        1 => (0..REASONS.len()).prop_map(|i| Op::Cancel(REASONS[i])),
        2 => Just(Op::Finish),
        1 => Just(Op::Heartbeat),
        1 => Just(Op::Withdraw),
        12 => (gen, body).prop_map(|(g, b)| Op::Msg(g, b)),
        1 => Just(Op::Foreign),
        1 => Just(Op::OtherHandoff),
        1 => Just(Op::Misrouted),
        2 => Just(Op::Redeliver),
        1 => Just(Op::BogusReserved),
    ]
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Core {
    Idle,
    /// Pending in the core's FIFO.
    Pending,
    /// Reserved; the output may or may not have been delivered.
    Reserved,
    Failed,
    /// Canceled while pending: it never reserves.
    Canceled,
}

struct World {
    id: HandoffId,
    now: u64,
    core: Core,
    reserves: u32,
    /// A `ReserveDestination` the machine has not yet seen end.
    request_open: bool,
    /// The machine accepted the reservation.
    reservation_acked: bool,
    /// Release-or-activate count for the reservation.
    reservation_ends: u32,
    receives: u32,
    released_entries: u32,
    last_msg: Option<HandoffMessage>,
    facts: Vec<Fact>,
}

fn gen_of(g: Gen) -> Generation {
    match g {
        Gen::Stale => Generation(0),
        Gen::Current => Generation(1),
        Gen::Newer => Generation(2),
    }
}

fn body(b: Body, from: WorkerId) -> MessageBody {
    match b {
        Body::Ready => MessageBody::SourceReady { source: from, blocks: 256, prompt_tokens: PROMPT_TOKENS },
        Body::Abort(r) => MessageBody::Abort { reason: r },
    }
}

impl World {
    fn reserved_event(&self) -> DestinationEvent {
        DestinationEvent::Reserved {
            reservation: RES,
            prefix_tokens: PROMPT_TOKENS - MISSING,
            missing_tokens: MISSING,
        }
    }

    fn deliver(&mut self, m: &mut DestinationHandoff, ev: DestinationEvent) -> Result<(), TestCaseError> {
        let before = m.clone();
        let t = match m.handle(ev, self.now) {
            Err(e) => {
                prop_assert_eq!(&before, &*m, "error {} changed the machine", e);
                prop_assert_eq!(e.handoff, self.id);
                return Ok(());
            }
            Ok(t) => t,
        };
        if before.is_released() {
            prop_assert_eq!(before.state(), m.state(), "left Released on {:?}", ev);
        }
        if !before.is_released() && m.is_released() {
            self.released_entries += 1;
        }
        for a in &t.actions {
            match *a {
                DestinationAction::ReserveDestination { deadline_ns } => {
                    prop_assert_eq!(deadline_ns, self.now + RESERVATION_NS);
                    self.reserves += 1;
                    prop_assert_eq!(self.reserves, 1, "second ReserveDestination");
                    self.request_open = true;
                    self.core = Core::Pending;
                }
                DestinationAction::ReleaseDestination { reservation: None, .. } => {
                    prop_assert!(self.request_open, "released a reservation request that is not open");
                    prop_assert!(
                        !self.reservation_acked,
                        "released the request after its reservation was known"
                    );
                    self.request_open = false;
                    if self.core == Core::Pending {
                        self.core = Core::Canceled;
                    }
                }
                DestinationAction::ReleaseDestination { reservation: Some(r), .. }
                | DestinationAction::ActivateDestination { reservation: r } => {
                    prop_assert_eq!(r, RES);
                    prop_assert!(m.reservation() == Some(RES), "ended a reservation never reported");
                    self.reservation_ends += 1;
                    prop_assert_eq!(self.reservation_ends, 1, "reservation ended twice");
                    if let DestinationAction::ActivateDestination { .. } = a {
                        prop_assert_eq!(self.receives, 1, "activated without a transfer");
                    }
                }
                DestinationAction::StartReceive { from, missing_tokens, bytes } => {
                    // Invariant 1: a transfer needs an engine-owned reservation.
                    prop_assert!(self.reservation_acked || m.reservation() == Some(RES));
                    prop_assert_eq!(self.reservation_ends, 0, "transfer into an ended reservation");
                    prop_assert_eq!(Some(from), m.peer());
                    prop_assert_eq!(missing_tokens, MISSING);
                    prop_assert_eq!(bytes, u64::from(MISSING) * KV_BYTES_PER_TOKEN);
                    self.receives += 1;
                    prop_assert_eq!(self.receives, 1, "second transfer");
                }
                DestinationAction::AbortRequest { .. } => {
                    let was_active = matches!(before.state(), DestinationState::Active { .. });
                    prop_assert!(was_active, "AbortRequest outside Active");
                }
                DestinationAction::Send { to, message } => {
                    prop_assert_eq!(Some(to), m.peer());
                    prop_assert_eq!(message.from, dest_worker());
                    prop_assert_eq!(message.handoff, self.id);
                }
                DestinationAction::ScheduleReservationTimer { deadline_ns } => {
                    prop_assert_eq!(Some(deadline_ns), m.deadline_ns());
                }
            }
        }
        let sends = t.actions.iter().filter(|a| matches!(a, DestinationAction::Send { .. })).count();
        prop_assert_eq!(sends, count(&t.facts, "MessageSent"));
        if let DestinationEvent::ReservationFailed { .. } = ev {
            if before.state() == &DestinationState::Reserving {
                self.request_open = false;
            }
        }
        if before.reservation().is_none() && m.reservation() == Some(RES) {
            self.reservation_acked = true;
            if self.request_open {
                self.request_open = false;
                prop_assert_eq!(self.reservation_ends, 0, "a fresh reservation ended at once");
            } else {
                prop_assert_eq!(self.reservation_ends, 1, "late reservation not released");
            }
        }
        if m.is_released() {
            prop_assert!(!self.request_open, "released with a reservation request still open");
            prop_assert_eq!(
                self.reservation_ends,
                u32::from(self.reservation_acked),
                "released without ending its reservation"
            );
        }
        // Timers before the deadline, and after activation, do nothing.
        if let DestinationEvent::ReservationExpired = ev {
            match (before.deadline_ns(), before.state()) {
                (Some(d), _) if self.now < d => {
                    prop_assert!(t.actions.is_empty() && t.facts.is_empty());
                    prop_assert_eq!(&before, &*m);
                }
                (Some(_), _) => {
                    prop_assert_eq!(m.state(), &DestinationState::Released { how: EndReason::Expired })
                }
                (None, DestinationState::Active { .. }) => prop_assert!(t.actions.is_empty()),
                _ => {}
            }
        }
        if let DestinationEvent::Message(msg) = ev {
            if let (Some(g), Some(p)) = (before.peer_generation(), before.peer()) {
                if msg.generation < g && msg.from == p && !before.is_released() {
                    prop_assert_eq!(&t.facts, &vec![msg.rejected_fact(MessageRejection::StaleGeneration)]);
                    prop_assert!(t.actions.is_empty());
                    prop_assert_eq!(&before, &*m);
                }
                let live =
                    !before.is_released() && !matches!(before.state(), DestinationState::Active { .. });
                if msg.generation > g && msg.from == p && live {
                    prop_assert_eq!(
                        m.state(),
                        &DestinationState::Released { how: EndReason::Canceled(CancelReason::PeerLost) }
                    );
                }
            }
        }
        for f in &t.facts {
            if let Fact::MessageRejected { why, .. } = f {
                let only_abort_replies = t.actions.iter().all(|a| {
                    matches!(a, DestinationAction::Send { message, .. } if matches!(message.body, MessageBody::Abort { .. }))
                });
                prop_assert!(t.actions.is_empty() || (*why == MessageRejection::Late && only_abort_replies));
                prop_assert_eq!(before.state(), m.state());
            }
        }
        self.facts.extend(t.facts);
        Ok(())
    }
}

fn run(
    policy: HandoffPolicy,
    known_source: bool,
    known_gen: bool,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let id = handoff_id(21);
    let src = source_worker();
    let mut m = destination(id, policy, known_source.then_some(src), known_gen.then_some(Generation(1)));
    let mut w = World {
        id,
        now: 1_000,
        core: Core::Idle,
        reserves: 0,
        request_open: false,
        reservation_acked: false,
        reservation_ends: 0,
        receives: 0,
        released_entries: 0,
        last_msg: None,
        facts: m.start_facts(),
    };
    for op in ops {
        match op {
            Op::Route => w.deliver(&mut m, DestinationEvent::Routed { worker: dest_worker() })?,
            Op::RouteElsewhere => {
                let before = m.clone();
                let elsewhere = DestinationEvent::Routed { worker: WorkerId::decode(7) };
                prop_assert!(m.handle(elsewhere, w.now).is_err(), "routed to another worker accepted");
                prop_assert_eq!(&before, &m);
            }
            Op::Advance(d) => w.now += d,
            Op::CoreReserves => {
                if w.core == Core::Pending {
                    w.core = Core::Reserved;
                }
            }
            Op::DeliverReserved => {
                if w.core == Core::Reserved {
                    let ev = w.reserved_event();
                    w.deliver(&mut m, ev)?;
                }
            }
            Op::CoreFails(r) => {
                if w.core == Core::Pending {
                    w.core = Core::Failed;
                    w.deliver(&mut m, DestinationEvent::ReservationFailed { reason: r })?;
                }
            }
            Op::TransferDone => w.deliver(&mut m, DestinationEvent::ReceiveCompleted)?,
            Op::ReservationTimer => w.deliver(&mut m, DestinationEvent::ReservationExpired)?,
            Op::Cancel(r) => w.deliver(&mut m, DestinationEvent::Cancelled { reason: r })?,
            Op::Finish => w.deliver(&mut m, DestinationEvent::RequestFinished)?,
            Op::Heartbeat => w.deliver(&mut m, DestinationEvent::RenewLease)?,
            Op::Withdraw => w.deliver(&mut m, DestinationEvent::Withdraw)?,
            Op::Msg(g, b) => {
                let msg =
                    HandoffMessage { handoff: id, from: src, generation: gen_of(g), body: body(b, src) };
                w.last_msg = Some(msg);
                w.deliver(&mut m, DestinationEvent::Message(msg))?;
            }
            Op::Foreign => {
                if m.peer().is_some() {
                    let other = WorkerId::prefill(9);
                    let msg = HandoffMessage {
                        handoff: id,
                        from: other,
                        generation: Generation(1),
                        body: body(Body::Ready, other),
                    };
                    let before = m.clone();
                    prop_assert!(
                        m.handle(DestinationEvent::Message(msg), w.now).is_err(),
                        "foreign message accepted"
                    );
                    prop_assert_eq!(&before, &m);
                }
            }
            Op::OtherHandoff => {
                let msg = HandoffMessage {
                    handoff: handoff_id(998),
                    from: src,
                    generation: Generation(1),
                    body: MessageBody::Abort { reason: CancelReason::RequestAborted },
                };
                let before = m.clone();
                prop_assert!(m.handle(DestinationEvent::Message(msg), w.now).is_err());
                prop_assert_eq!(&before, &m);
            }
            Op::Misrouted => {
                for body in
                    [MessageBody::ReceiveCompleted, MessageBody::ReaderCompleted, MessageBody::LeaseRenewal]
                {
                    let msg = HandoffMessage { handoff: id, from: src, generation: Generation(1), body };
                    let before = m.clone();
                    prop_assert!(m.handle(DestinationEvent::Message(msg), w.now).is_err());
                    prop_assert_eq!(&before, &m);
                }
            }
            Op::Redeliver => {
                if let Some(msg) = w.last_msg {
                    w.deliver(&mut m, DestinationEvent::Message(msg))?;
                }
            }
            Op::BogusReserved => {
                if w.reserves == 0 || w.reservation_acked {
                    let ev = DestinationEvent::Reserved {
                        reservation: DestinationReservationId(1),
                        prefix_tokens: 0,
                        missing_tokens: 1,
                    };
                    let before = m.clone();
                    prop_assert!(m.handle(ev, w.now).is_err(), "bogus reservation accepted");
                    prop_assert_eq!(&before, &m);
                }
            }
        }
    }
    // Teardown, then a reservation still in flight arrives late (twice).
    if !m.is_released() {
        let active = matches!(m.state(), DestinationState::Active { .. });
        let ev = if active {
            DestinationEvent::RequestFinished
        } else {
            DestinationEvent::Cancelled { reason: CancelReason::Teardown }
        };
        w.deliver(&mut m, ev)?;
    }
    prop_assert!(m.is_released());
    if w.core == Core::Reserved {
        let ev = w.reserved_event();
        w.deliver(&mut m, ev)?;
        w.deliver(&mut m, ev)?;
    }
    prop_assert_eq!(w.released_entries, 1);
    prop_assert!(!w.request_open, "a reservation request was never ended");
    prop_assert_eq!(w.reservation_ends, u32::from(w.reservation_acked));
    prop_assert!(count(&w.facts, "HandoffCanceled") <= 1);
    prop_assert!(count(&w.facts, "ReservationExpired") <= 1);
    prop_assert!(count(&w.facts, "ReceiveCompleted") <= 1);
    prop_assert_eq!(count(&w.facts, "ReceiveStarted"), w.receives as usize);
    prop_assert_eq!(count(&w.facts, "DestinationRouted"), w.reserves as usize);
    match m.state() {
        DestinationState::Released { how: EndReason::Success } => {
            prop_assert_eq!(count(&w.facts, "ReceiveCompleted"), 1);
            prop_assert_eq!(count(&w.facts, "HandoffCanceled") + count(&w.facts, "ReservationExpired"), 0);
        }
        DestinationState::Released { how: EndReason::Expired } => {
            prop_assert_eq!(count(&w.facts, "ReservationExpired"), 1)
        }
        DestinationState::Released { .. } => prop_assert_eq!(count(&w.facts, "HandoffCanceled"), 1),
        s => prop_assert!(false, "not released: {:?}", s),
    }
    if std::env::var_os("LIFECYCLE_COVERAGE").is_some() {
        eprintln!("COVER {:?} acked={} receives={}", m.state(), w.reservation_acked, w.receives);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn source_first_destination_ends_every_reservation_exactly_once(
        known_source in any::<bool>(), known_gen in any::<bool>(),
        ops in proptest::collection::vec(op_strategy(), 0..60),
    ) {
        run(HandoffPolicy::SourceFirst, known_source, known_gen, ops)?;
    }

    #[test]
    fn destination_first_destination_ends_every_reservation_exactly_once(
        known_source in any::<bool>(), known_gen in any::<bool>(),
        ops in proptest::collection::vec(op_strategy(), 0..60),
    ) {
        run(HandoffPolicy::DestinationFirst, known_source, known_gen, ops)?;
    }
}

/// SourceReady before the reservation, and the reservation racing a cancel.
#[test]
fn ready_before_reserved_starts_receive_on_reservation_and_late_reservation_is_freed() {
    let id = handoff_id(4);
    let src = source_worker();
    let mut m = destination(id, HandoffPolicy::SourceFirst, None, None);
    m.handle(DestinationEvent::Routed { worker: dest_worker() }, 0).unwrap();
    let ready = HandoffMessage {
        handoff: id,
        from: src,
        generation: Generation(1),
        body: MessageBody::SourceReady { source: src, blocks: 256, prompt_tokens: PROMPT_TOKENS },
    };
    let t = m.handle(DestinationEvent::Message(ready), 1).unwrap();
    assert!(t.actions.is_empty(), "no transfer without a reservation: {:?}", t.actions);
    let t = m
        .handle(
            DestinationEvent::Reserved { reservation: RES, prefix_tokens: 0, missing_tokens: PROMPT_TOKENS },
            2,
        )
        .unwrap();
    assert!(t
        .actions
        .iter()
        .any(|a| matches!(a, DestinationAction::StartReceive { from, .. } if *from == src)));
    assert!(t.actions.iter().any(|a| matches!(a, DestinationAction::Send { message, .. }
        if matches!(message.body, MessageBody::DestinationReserved { .. }))));
    assert_eq!(m.state_name(), "Receiving");

    let mut n = destination(handoff_id(5), HandoffPolicy::DestinationFirst, Some(src), None);
    n.handle(DestinationEvent::Routed { worker: dest_worker() }, 0).unwrap();
    let t = n.handle(DestinationEvent::Cancelled { reason: CancelReason::RequestAborted }, 1).unwrap();
    let how = EndReason::Canceled(CancelReason::RequestAborted);
    assert_eq!(t.actions[0], DestinationAction::ReleaseDestination { reservation: None, reason: how });
    let late = DestinationEvent::Reserved { reservation: RES, prefix_tokens: 0, missing_tokens: 1 };
    let t = n.handle(late, 2).unwrap();
    assert_eq!(
        t.actions,
        vec![DestinationAction::ReleaseDestination { reservation: Some(RES), reason: how }]
    );
    assert!(n.handle(late, 3).unwrap().actions.is_empty());
}
