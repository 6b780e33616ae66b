//! Property test of the source role alone: random sequences of valid, duplicate, reordered,
//! stale, late and invalid events, with a fake engine core that pins (possibly racing a cancel)
//! or fails the prefill. Checks after every event and at the end that the pin and the dispatch
//! each end exactly once, that nothing leaves `Released`, and that errors change nothing.

mod support;

use handoff_ledger::events::{Fact, MessageRejection};
use handoff_ledger::ids::{CancelReason, EndReason, Generation, HandoffId, HandoffPolicy, SourceLeaseId};
use handoff_ledger::ids::{DestinationReservationId, WorkerId};
use handoff_ledger::lifecycle::{
    HandoffMessage, MessageBody, SourceAction, SourceEvent, SourceHandoff, SourceState,
};
use proptest::prelude::*;
use support::lifecycle::*;

const LEASE: SourceLeaseId = SourceLeaseId(77);

#[derive(Clone, Copy, Debug)]
enum Gen {
    Current,
    Stale,
    Newer,
}

#[derive(Clone, Copy, Debug)]
enum Body {
    Reserved,
    ReceiveDone,
    ReaderDone,
    Abort(CancelReason),
    Renewal,
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Start,
    Advance(u64),
    /// The fake core finishes the prefill and pins it (its output is queued, not yet delivered).
    CorePins,
    /// Deliver the queued pin output (again, if already delivered: a duplicate).
    DeliverPin,
    /// The fake core ends the prefill without pinning.
    CoreFails(CancelReason),
    LeaseTimer,
    Cancel(CancelReason),
    Msg(Gen, Body),
    /// A message from a worker that is not the destination.
    Foreign(Body),
    /// A message for another handoff.
    OtherHandoff,
    /// A SourceReady sent to the source.
    Misrouted,
    /// Deliver the last message again.
    Redeliver,
    /// A pin the core never made (nothing was dispatched, or a second lease).
    BogusPin,
}

fn body_strategy() -> impl Strategy<Value = Body> {
    prop_oneof![
        8 => Just(Body::Reserved),
        2 => Just(Body::ReceiveDone),
        2 => Just(Body::ReaderDone),
        1 => (0..REASONS.len()).prop_map(|i| Body::Abort(REASONS[i])),
        2 => Just(Body::Renewal),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let gen = prop_oneof![40 => Just(Gen::Current), 4 => Just(Gen::Stale), 1 => Just(Gen::Newer)];
    prop_oneof![
        6 => Just(Op::Start),
        3 => (0..2 * LEASE_NS).prop_map(Op::Advance),
        8 => Just(Op::CorePins),
        8 => Just(Op::DeliverPin),
        1 => (0..REASONS.len()).prop_map(|i| Op::CoreFails(REASONS[i])),
        5 => Just(Op::LeaseTimer),
        1 => (0..REASONS.len()).prop_map(|i| Op::Cancel(REASONS[i])),
        14 => (gen, body_strategy()).prop_map(|(g, b)| Op::Msg(g, b)),
        1 => body_strategy().prop_map(Op::Foreign),
        1 => Just(Op::OtherHandoff),
        1 => Just(Op::Misrouted),
        2 => Just(Op::Redeliver),
        1 => Just(Op::BogusPin),
    ]
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Core {
    Idle,
    Computing,
    /// Pinned; the output may or may not have been delivered.
    Pinned,
    Failed,
    /// Canceled before it pinned: it never will.
    Canceled,
}

/// The accounting the test keeps from the actions it sees (not from the machine's internals).
struct World {
    id: HandoffId,
    now: u64,
    core: Core,
    dispatches: u32,
    /// A `DispatchPrefill` the machine has not yet seen end (pin, fail, or its own cancel).
    dispatch_open: bool,
    cancel_prefills: u32,
    /// The machine accepted the pin.
    lease_acked: bool,
    lease_releases: u32,
    released_entries: u32,
    last_msg: Option<HandoffMessage>,
    facts: Vec<Fact>,
}

fn body(b: Body, from: WorkerId) -> MessageBody {
    match b {
        Body::Reserved => MessageBody::DestinationReserved {
            destination: from,
            reservation: DestinationReservationId(5),
            prefix_tokens: 0,
            missing_tokens: PROMPT_TOKENS,
        },
        Body::ReceiveDone => MessageBody::ReceiveCompleted,
        Body::ReaderDone => MessageBody::ReaderCompleted,
        Body::Abort(r) => MessageBody::Abort { reason: r },
        Body::Renewal => MessageBody::LeaseRenewal,
    }
}

fn gen_of(g: Gen) -> Generation {
    match g {
        Gen::Stale => Generation(0),
        Gen::Current => Generation(1),
        Gen::Newer => Generation(2),
    }
}

impl World {
    fn pin_event(&self) -> SourceEvent {
        SourceEvent::PrefillPinned { lease: LEASE, blocks: 256, deadline_ns: self.now + LEASE_NS }
    }

    /// Deliver one event and check every per-step rule.
    fn deliver(&mut self, m: &mut SourceHandoff, ev: SourceEvent) -> Result<(), TestCaseError> {
        let before = m.clone();
        let res = m.handle(ev, self.now);
        let t = match res {
            Err(e) => {
                prop_assert_eq!(&before, m, "error {} changed the machine", e);
                prop_assert_eq!(e.handoff, self.id);
                return Ok(());
            }
            Ok(t) => t,
        };
        if before.is_released() {
            prop_assert_eq!(before.state(), m.state(), "left Released on {:?}", ev);
        }
        // A timer from before a renewal is ignored; one at or after the deadline ends the pin.
        if let (SourceEvent::LeaseExpired, Some(d)) = (ev, before.deadline_ns()) {
            if self.now < d {
                prop_assert!(t.actions.is_empty() && t.facts.is_empty());
                prop_assert_eq!(&before, &*m);
            } else {
                prop_assert_eq!(m.state(), &SourceState::Released { how: EndReason::Expired });
            }
        }
        // A renewal moves the deadline to at least now + renew_ns, never earlier.
        if let SourceEvent::Message(msg @ HandoffMessage { body: MessageBody::LeaseRenewal, .. }) = ev {
            let applied = t.facts.contains(&msg.received_fact());
            if let Some(old) = before.deadline_ns() {
                if before.peer_generation() == Some(msg.generation) && old < self.now + RENEW_NS {
                    prop_assert!(applied, "a live renewal was not applied");
                }
            }
            if let (Some(old), Some(new), true) = (before.deadline_ns(), m.deadline_ns(), applied) {
                prop_assert_eq!(new, old.max(self.now + RENEW_NS));
            }
        }
        // A message from an older incarnation of the known destination is rejected, inertly.
        if let SourceEvent::Message(msg) = ev {
            if let (Some(g), Some(p)) = (before.peer_generation(), before.peer()) {
                if msg.generation < g && msg.from == p && !before.is_released() {
                    prop_assert_eq!(&t.facts, &vec![msg.rejected_fact(MessageRejection::StaleGeneration)]);
                    prop_assert!(t.actions.is_empty());
                    prop_assert_eq!(&before, &*m);
                }
            }
        }
        if !before.is_released() && m.is_released() {
            self.released_entries += 1;
        }
        // The core's actions, as the fake core applies them.
        for a in &t.actions {
            match *a {
                SourceAction::DispatchPrefill { lease_ns } => {
                    prop_assert_eq!(lease_ns, LEASE_NS);
                    self.dispatches += 1;
                    prop_assert_eq!(self.dispatches, 1, "second DispatchPrefill");
                    self.dispatch_open = true;
                    self.core = Core::Computing;
                }
                SourceAction::CancelPrefill { .. } => {
                    self.cancel_prefills += 1;
                    prop_assert!(self.dispatch_open, "CancelPrefill without an open dispatch");
                    prop_assert!(!self.lease_acked, "CancelPrefill for a pin the machine holds");
                    self.dispatch_open = false;
                    if self.core == Core::Computing {
                        self.core = Core::Canceled;
                    }
                }
                SourceAction::ReleaseSource { lease, .. } => {
                    prop_assert_eq!(lease, LEASE);
                    prop_assert!(m.lease() == Some(LEASE), "release of a pin never reported");
                    self.lease_releases += 1;
                    prop_assert_eq!(self.lease_releases, 1, "pin released twice");
                }
                SourceAction::Send { to, message } => {
                    prop_assert_eq!(Some(to), m.peer());
                    prop_assert_eq!(message.from, source_worker());
                    prop_assert_eq!(message.handoff, self.id);
                }
                SourceAction::ScheduleLeaseTimer { deadline_ns } => {
                    prop_assert_eq!(Some(deadline_ns), m.deadline_ns());
                }
            }
        }
        let sends = t.actions.iter().filter(|a| matches!(a, SourceAction::Send { .. })).count();
        prop_assert_eq!(sends, count(&t.facts, "MessageSent"));
        if let SourceEvent::PrefillFailed { .. } = ev {
            if before.state() == &SourceState::Computing {
                self.dispatch_open = false;
            }
        }
        // The pin became known to the machine in this step.
        if before.lease().is_none() && m.lease() == Some(LEASE) {
            self.lease_acked = true;
            if self.dispatch_open {
                self.dispatch_open = false;
                prop_assert_eq!(self.lease_releases, 0, "a fresh pin released at once");
            } else {
                // Late pin after the machine ended the dispatch: it must free it at once.
                prop_assert_eq!(self.lease_releases, 1, "late pin not released");
            }
        }
        if m.is_released() {
            prop_assert!(!self.dispatch_open, "released with a dispatch still open");
            prop_assert_eq!(
                self.lease_releases,
                u32::from(self.lease_acked),
                "released without ending its pin"
            );
        }
        // Messages that are not applied change nothing and do nothing.
        for f in &t.facts {
            if let Fact::MessageRejected { why, .. } = f {
                prop_assert!(
                    t.actions.is_empty()
                        || (*why == MessageRejection::Late
                            && t.actions.iter().all(|a| matches!(a, SourceAction::Send { message, .. } if matches!(message.body, MessageBody::Abort { .. })))),
                    "rejected message caused actions {:?}",
                    t.actions
                );
                prop_assert_eq!(before.state(), m.state());
            }
            // A newer incarnation of a known destination means it lost the handoff.
            if let Fact::MessageReceived { generation, .. } = f {
                if let Some(g) = before.peer_generation() {
                    if *generation > g && !before.is_released() {
                        prop_assert_eq!(
                            m.state(),
                            &SourceState::Released { how: EndReason::Canceled(CancelReason::PeerLost) }
                        );
                    }
                }
            }
        }
        self.facts.extend(t.facts);
        Ok(())
    }
}

fn run(policy: HandoffPolicy, known_dest: bool, known_gen: bool, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let id = handoff_id(11);
    let dest = dest_worker();
    let mut m = source(id, policy, known_dest.then_some(dest), known_gen.then_some(Generation(1)));
    let mut w = World {
        id,
        now: 1_000,
        core: Core::Idle,
        dispatches: 0,
        dispatch_open: false,
        cancel_prefills: 0,
        lease_acked: false,
        lease_releases: 0,
        released_entries: 0,
        last_msg: None,
        facts: m.start_facts(),
    };
    for op in ops {
        match op {
            Op::Start => w.deliver(&mut m, SourceEvent::Start)?,
            Op::Advance(d) => w.now += d,
            Op::CorePins => {
                if w.core == Core::Computing {
                    w.core = Core::Pinned;
                }
            }
            Op::DeliverPin => {
                if w.core == Core::Pinned {
                    let ev = w.pin_event();
                    w.deliver(&mut m, ev)?;
                }
            }
            Op::CoreFails(r) => {
                if w.core == Core::Computing {
                    w.core = Core::Failed;
                    w.deliver(&mut m, SourceEvent::PrefillFailed { reason: r })?;
                }
            }
            Op::LeaseTimer => w.deliver(&mut m, SourceEvent::LeaseExpired)?,
            Op::Cancel(r) => w.deliver(&mut m, SourceEvent::Cancelled { reason: r })?,
            Op::Msg(g, b) => {
                let msg =
                    HandoffMessage { handoff: id, from: dest, generation: gen_of(g), body: body(b, dest) };
                w.last_msg = Some(msg);
                w.deliver(&mut m, SourceEvent::Message(msg))?;
            }
            Op::Foreign(b) => {
                // Once the destination is known, another worker's message is invalid. (Before
                // that, the first destination to speak is learned; the run keeps the canonical one.)
                if m.peer().is_some() {
                    let other = WorkerId::decode(9);
                    let msg = HandoffMessage {
                        handoff: id,
                        from: other,
                        generation: Generation(1),
                        body: body(b, other),
                    };
                    let before = m.clone();
                    prop_assert!(
                        m.handle(SourceEvent::Message(msg), w.now).is_err(),
                        "foreign message accepted"
                    );
                    prop_assert_eq!(&before, &m);
                }
            }
            Op::OtherHandoff => {
                let msg = HandoffMessage {
                    handoff: handoff_id(999),
                    from: dest,
                    generation: Generation(1),
                    body: MessageBody::ReaderCompleted,
                };
                let before = m.clone();
                prop_assert!(m.handle(SourceEvent::Message(msg), w.now).is_err());
                prop_assert_eq!(&before, &m);
            }
            Op::Misrouted => {
                let msg = HandoffMessage {
                    handoff: id,
                    from: dest,
                    generation: Generation(1),
                    body: MessageBody::SourceReady { source: dest, blocks: 1, prompt_tokens: 1 },
                };
                let before = m.clone();
                prop_assert!(m.handle(SourceEvent::Message(msg), w.now).is_err());
                prop_assert_eq!(&before, &m);
            }
            Op::Redeliver => {
                if let Some(msg) = w.last_msg {
                    w.deliver(&mut m, SourceEvent::Message(msg))?;
                }
            }
            Op::BogusPin => {
                // A pin the core never made: refused when nothing was dispatched, and a second
                // lease is refused once one is known. (A pin while computing is indistinguishable
                // from a real one, so it is not probed.)
                let ev =
                    SourceEvent::PrefillPinned { lease: SourceLeaseId(1), blocks: 1, deadline_ns: w.now };
                if w.dispatches == 0 || w.lease_acked {
                    let before = m.clone();
                    prop_assert!(m.handle(ev, w.now).is_err(), "bogus pin accepted");
                    prop_assert_eq!(&before, &m);
                }
            }
        }
    }
    // Teardown: whatever is left is canceled, and a pin still in flight arrives late (twice).
    w.deliver(&mut m, SourceEvent::Cancelled { reason: CancelReason::Teardown })?;
    prop_assert!(m.is_released());
    if w.core == Core::Pinned {
        let ev = w.pin_event();
        w.deliver(&mut m, ev)?;
        w.deliver(&mut m, ev)?;
    }
    prop_assert_eq!(w.released_entries, 1, "entered Released {} times", w.released_entries);
    if std::env::var_os("LIFECYCLE_COVERAGE").is_some() {
        eprintln!("COVER {:?} acked={} dispatched={}", m.state(), w.lease_acked, w.dispatches);
    }
    prop_assert!(!w.dispatch_open, "a dispatch was never ended");
    if w.lease_acked {
        prop_assert_eq!(w.lease_releases, 1);
    } else {
        prop_assert_eq!(w.lease_releases, 0);
    }
    prop_assert!(w.cancel_prefills <= 1);
    prop_assert_eq!(count(&w.facts, "PrefillDispatched"), w.dispatches as usize);
    prop_assert!(count(&w.facts, "HandoffCanceled") <= 1);
    prop_assert!(count(&w.facts, "ReaderCompleted") <= 1);
    prop_assert!(count(&w.facts, "LeaseExpired") <= 1);
    let ended = count(&w.facts, "HandoffCanceled")
        + count(&w.facts, "ReaderCompleted")
        + count(&w.facts, "LeaseExpired");
    prop_assert_eq!(ended, 1, "the handoff must end by exactly one of cancel, reader completion, expiry");
    match m.state() {
        SourceState::Released { how: EndReason::Success } => {
            prop_assert_eq!(count(&w.facts, "ReaderCompleted"), 1)
        }
        SourceState::Released { how: EndReason::Expired } => {
            prop_assert_eq!(count(&w.facts, "LeaseExpired"), 1)
        }
        SourceState::Released { .. } => prop_assert_eq!(count(&w.facts, "HandoffCanceled"), 1),
        s => prop_assert!(false, "not released: {:?}", s),
    }
    // Destination-first never dispatches before the destination's reservation was applied.
    if policy == HandoffPolicy::DestinationFirst {
        let dispatched = w.facts.iter().position(|f| matches!(f, Fact::PrefillDispatched { .. }));
        if let Some(d) = dispatched {
            let reserved = w.facts.iter().position(|f| {
                matches!(
                    f,
                    Fact::MessageReceived {
                        kind: handoff_ledger::events::MessageKind::DestinationReserved,
                        ..
                    }
                )
            });
            prop_assert!(
                matches!(reserved, Some(r) if r < d),
                "destination-first dispatched before reservation"
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn source_first_sequences_end_every_pin_exactly_once(
        known_dest in any::<bool>(), known_gen in any::<bool>(),
        ops in proptest::collection::vec(op_strategy(), 0..60),
    ) {
        run(HandoffPolicy::SourceFirst, known_dest, known_gen, ops)?;
    }

    #[test]
    fn destination_first_sequences_end_every_pin_exactly_once(
        known_dest in any::<bool>(), known_gen in any::<bool>(),
        ops in proptest::collection::vec(op_strategy(), 0..60),
    ) {
        run(HandoffPolicy::DestinationFirst, known_dest, known_gen, ops)?;
    }
}

/// A guided sequence that the random search may rarely hit: cancel while computing, then the
/// core's pin (it raced the cancel) arrives, then again.
#[test]
fn pin_racing_a_cancel_is_released_once() {
    let id = handoff_id(3);
    let mut m = source(id, HandoffPolicy::SourceFirst, None, None);
    let t = m.handle(SourceEvent::Start, 0).unwrap();
    assert_eq!(t.actions, vec![SourceAction::DispatchPrefill { lease_ns: LEASE_NS }]);
    let t = m.handle(SourceEvent::Cancelled { reason: CancelReason::RequestAborted }, 5).unwrap();
    assert_eq!(t.actions, vec![SourceAction::CancelPrefill { reason: CancelReason::RequestAborted }]);
    let pin = SourceEvent::PrefillPinned { lease: LEASE, blocks: 8, deadline_ns: 100 };
    let t = m.handle(pin, 6).unwrap();
    assert_eq!(
        t.actions,
        vec![SourceAction::ReleaseSource {
            lease: LEASE,
            reason: EndReason::Canceled(CancelReason::RequestAborted)
        }]
    );
    assert!(m.handle(pin, 7).unwrap().actions.is_empty());
    assert!(m.is_released());
}
