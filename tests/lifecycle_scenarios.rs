//! Exact outputs of each role for the proposal's named situations: the action and fact lists an
//! adapter sees, step by step. (The property tests cover the space; these pin the contract.)

mod support;

use handoff_ledger::events::{Fact, MessageKind, MessageRejection};
use handoff_ledger::ids::{
    CancelReason, DestinationReservationId, EndReason, Generation, HandoffPolicy, KvHandoffDemand, RequestId,
    SourceLeaseId,
};
use handoff_ledger::lifecycle::{
    DestinationAction, DestinationEvent, DestinationState, HandoffMessage, MessageBody, NewHandoffError,
    SourceAction, SourceConfig, SourceEvent, SourceHandoff, SourceInit, SourceState,
};
use support::lifecycle::*;

const LEASE: SourceLeaseId = SourceLeaseId(3);
const RES: DestinationReservationId = DestinationReservationId(8);

fn from_dest(id: handoff_ledger::ids::HandoffId, g: u32, body: MessageBody) -> HandoffMessage {
    HandoffMessage { handoff: id, from: dest_worker(), generation: Generation(g), body }
}

fn from_src(id: handoff_ledger::ids::HandoffId, g: u32, body: MessageBody) -> HandoffMessage {
    HandoffMessage { handoff: id, from: source_worker(), generation: Generation(g), body }
}

fn reserved_body() -> MessageBody {
    MessageBody::DestinationReserved {
        destination: dest_worker(),
        reservation: RES,
        prefix_tokens: 0,
        missing_tokens: PROMPT_TOKENS,
    }
}

#[test]
fn disabled_policy_has_no_machine() {
    let id = handoff_id(1);
    let r = SourceHandoff::new(SourceInit {
        handoff: id,
        request: RequestId(0),
        policy: HandoffPolicy::Disabled,
        demand: KvHandoffDemand { context_tokens: 1, max_output_tokens: 1 },
        worker: source_worker(),
        generation: Generation(0),
        destination: None,
        destination_generation: None,
        config: SourceConfig { lease_ns: 1, renew_ns: 1 },
    });
    assert_eq!(r.unwrap_err(), NewHandoffError::PolicyDisabled(id));
}

#[test]
fn source_first_source_steps() {
    let id = handoff_id(2);
    let mut s = source(id, HandoffPolicy::SourceFirst, None, None);
    assert_eq!(
        s.start_facts(),
        vec![Fact::HandoffStarted {
            handoff: id,
            request: RequestId(1),
            policy: HandoffPolicy::SourceFirst,
            demand: demand()
        }]
    );
    let t = s.handle(SourceEvent::Start, 10).unwrap();
    assert_eq!(t.actions, vec![SourceAction::DispatchPrefill { lease_ns: LEASE_NS }]);
    assert_eq!(t.facts, vec![Fact::PrefillDispatched { handoff: id }]);
    assert!(s.handle(SourceEvent::Start, 11).unwrap().actions.is_empty(), "duplicate Start");

    // Pinned with no destination known: stranded, nobody to tell yet.
    let pin = SourceEvent::PrefillPinned { lease: LEASE, blocks: 256, deadline_ns: 1_000 };
    let t = s.handle(pin, 20).unwrap();
    assert_eq!(t.actions, vec![SourceAction::ScheduleLeaseTimer { deadline_ns: 1_000 }]);
    assert_eq!(s.state(), &SourceState::Pinned { lease: LEASE, blocks: 256, deadline_ns: 1_000 });
    assert_eq!(s.deadline_ns(), Some(1_000));

    // The destination reserves: the source learns it and sends SourceReady.
    let msg = from_dest(id, 1, reserved_body());
    let t = s.handle(SourceEvent::Message(msg), 30).unwrap();
    let ready = HandoffMessage {
        handoff: id,
        from: source_worker(),
        generation: Generation(3),
        body: MessageBody::SourceReady { source: source_worker(), blocks: 256, prompt_tokens: PROMPT_TOKENS },
    };
    assert_eq!(t.actions, vec![SourceAction::Send { to: dest_worker(), message: ready }]);
    assert_eq!(
        t.facts,
        vec![
            msg.received_fact(),
            Fact::MessageSent { handoff: id, kind: MessageKind::SourceReady, to: dest_worker() }
        ]
    );
    assert_eq!(s.state_name(), "AwaitingReaderCompletion");
    // The same message again: a duplicate, recorded, inert.
    let t = s.handle(SourceEvent::Message(msg), 31).unwrap();
    assert!(t.actions.is_empty());
    assert_eq!(t.facts, vec![msg.rejected_fact(MessageRejection::Duplicate)]);

    // Reader completion releases the pin on success.
    let done = from_dest(id, 1, MessageBody::ReceiveCompleted);
    let t = s.handle(SourceEvent::Message(done), 40).unwrap();
    assert_eq!(t.actions, vec![SourceAction::ReleaseSource { lease: LEASE, reason: EndReason::Success }]);
    assert_eq!(t.facts, vec![done.received_fact(), Fact::ReaderCompleted { handoff: id }]);
    assert_eq!(s.state(), &SourceState::Released { how: EndReason::Success });
    // Late everything: no resurrection, no actions.
    let t = s.handle(SourceEvent::Message(from_dest(id, 1, MessageBody::ReaderCompleted)), 41).unwrap();
    assert!(t.actions.is_empty());
    assert!(matches!(t.facts[..], [Fact::MessageRejected { why: MessageRejection::Late, .. }]));
    assert!(s.handle(SourceEvent::LeaseExpired, 5_000).unwrap().actions.is_empty());
    assert!(s
        .handle(SourceEvent::Cancelled { reason: CancelReason::Teardown }, 5_001)
        .unwrap()
        .actions
        .is_empty());
    assert_eq!(s.state(), &SourceState::Released { how: EndReason::Success });
}

#[test]
fn destination_first_source_waits_for_the_reservation() {
    let id = handoff_id(3);
    let mut s = source(id, HandoffPolicy::DestinationFirst, Some(dest_worker()), None);
    let t = s.handle(SourceEvent::Start, 1).unwrap();
    assert!(t.actions.is_empty() && t.facts.is_empty());
    assert_eq!(s.state_name(), "NotStarted");
    // A pin before any dispatch is invalid and changes nothing.
    let before = s.clone();
    let e = s.handle(SourceEvent::PrefillPinned { lease: LEASE, blocks: 1, deadline_ns: 9 }, 2).unwrap_err();
    assert_eq!((e.state, e.event), ("NotStarted", "PrefillPinned"));
    assert_eq!(before, s);
    assert!(e.to_string().contains("PrefillPinned is not valid in state NotStarted"));

    let t = s.handle(SourceEvent::Message(from_dest(id, 1, reserved_body())), 3).unwrap();
    assert_eq!(t.actions, vec![SourceAction::DispatchPrefill { lease_ns: LEASE_NS }]);
    let t = s.handle(SourceEvent::PrefillPinned { lease: LEASE, blocks: 16, deadline_ns: 500 }, 4).unwrap();
    assert_eq!(s.state_name(), "AwaitingReaderCompletion", "reservation already known: straight to awaiting");
    assert_eq!(t.actions[0], SourceAction::ScheduleLeaseTimer { deadline_ns: 500 });
    assert!(matches!(
        t.actions[1],
        SourceAction::Send { message: HandoffMessage { body: MessageBody::SourceReady { .. }, .. }, .. }
    ));
}

#[test]
fn renewal_moves_the_deadline_and_stale_timers_are_ignored_then_expiry_aborts_the_reader() {
    let id = handoff_id(4);
    let mut s = source(id, HandoffPolicy::SourceFirst, Some(dest_worker()), Some(Generation(1)));
    s.handle(SourceEvent::Start, 0).unwrap();
    s.handle(SourceEvent::PrefillPinned { lease: LEASE, blocks: 4, deadline_ns: LEASE_NS }, 0).unwrap();
    let renew = from_dest(id, 1, MessageBody::LeaseRenewal);
    let at = LEASE_NS - 1;
    let t = s.handle(SourceEvent::Message(renew), at).unwrap();
    let new_deadline = at + RENEW_NS;
    assert_eq!(t.actions, vec![SourceAction::ScheduleLeaseTimer { deadline_ns: new_deadline }]);
    assert!(t.facts.contains(&Fact::LeaseRenewed { handoff: id, lease: LEASE, deadline_ns: new_deadline }));
    // The original timer fires: ignored.
    let t = s.handle(SourceEvent::LeaseExpired, LEASE_NS).unwrap();
    assert!(t.actions.is_empty());
    assert_eq!(s.deadline_ns(), Some(new_deadline));
    // The renewed one fires: the pin expires and the destination is told not to read.
    let t = s.handle(SourceEvent::LeaseExpired, new_deadline).unwrap();
    assert_eq!(t.actions[0], SourceAction::ReleaseSource { lease: LEASE, reason: EndReason::Expired });
    assert!(matches!(
        t.actions[1],
        SourceAction::Send {
            message: HandoffMessage { body: MessageBody::Abort { reason: CancelReason::TransferFailed }, .. },
            ..
        }
    ));
    assert_eq!(t.facts[0], Fact::LeaseExpired { handoff: id, lease: LEASE });
}

#[test]
fn stale_generation_is_rejected_and_newer_generation_is_peer_loss() {
    let id = handoff_id(5);
    let mut s = source(id, HandoffPolicy::SourceFirst, None, None);
    s.handle(SourceEvent::Start, 0).unwrap();
    s.handle(SourceEvent::PrefillPinned { lease: LEASE, blocks: 4, deadline_ns: 99 }, 0).unwrap();
    // First message: its generation is learned.
    s.handle(SourceEvent::Message(from_dest(id, 4, reserved_body())), 1).unwrap();
    assert_eq!(s.peer_generation(), Some(Generation(4)));
    // Older incarnation: rejected, inert.
    let old = from_dest(id, 3, MessageBody::ReceiveCompleted);
    let before = s.clone();
    let t = s.handle(SourceEvent::Message(old), 2).unwrap();
    assert_eq!(t.facts, vec![old.rejected_fact(MessageRejection::StaleGeneration)]);
    assert_eq!(before, s);
    // Newer incarnation: the old one lost the handoff; free the pin, tell nobody.
    let t = s.handle(SourceEvent::Message(from_dest(id, 5, MessageBody::LeaseRenewal)), 3).unwrap();
    assert_eq!(
        t.actions,
        vec![SourceAction::ReleaseSource {
            lease: LEASE,
            reason: EndReason::Canceled(CancelReason::PeerLost)
        }]
    );
    assert!(t.facts.contains(&Fact::HandoffCanceled { handoff: id, reason: CancelReason::PeerLost }));
}

#[test]
fn a_source_canceled_before_it_knew_its_destination_aborts_it_on_first_contact() {
    let id = handoff_id(6);
    let mut s = source(id, HandoffPolicy::SourceFirst, None, None);
    let t = s.handle(SourceEvent::Cancelled { reason: CancelReason::RequestAborted }, 0).unwrap();
    assert!(t.actions.is_empty(), "nothing was dispatched, nobody to tell");
    let msg = from_dest(id, 1, reserved_body());
    let t = s.handle(SourceEvent::Message(msg), 1).unwrap();
    let abort = HandoffMessage {
        handoff: id,
        from: source_worker(),
        generation: Generation(3),
        body: MessageBody::Abort { reason: CancelReason::RequestAborted },
    };
    assert_eq!(t.actions, vec![SourceAction::Send { to: dest_worker(), message: abort }]);
    assert_eq!(t.facts[0], msg.rejected_fact(MessageRejection::Late));
    // Only once.
    assert!(s.handle(SourceEvent::Message(msg), 2).unwrap().actions.is_empty());
}

#[test]
fn destination_steps_and_activation_barrier() {
    let id = handoff_id(7);
    let mut d = destination(id, HandoffPolicy::DestinationFirst, Some(source_worker()), None);
    let t = d.handle(DestinationEvent::Routed { worker: dest_worker() }, 100).unwrap();
    assert_eq!(t.actions, vec![DestinationAction::ReserveDestination { deadline_ns: 100 + RESERVATION_NS }]);
    assert_eq!(t.facts, vec![Fact::DestinationRouted { handoff: id, worker: dest_worker() }]);
    assert_eq!(d.state_name(), "Reserving");
    assert_eq!(d.deadline_ns(), None, "no deadline while the core has not reserved");

    let t = d
        .handle(
            DestinationEvent::Reserved { reservation: RES, prefix_tokens: 1024, missing_tokens: 3072 },
            200,
        )
        .unwrap();
    let deadline = 200 + RESERVATION_NS;
    let reserved_msg = HandoffMessage {
        handoff: id,
        from: dest_worker(),
        generation: Generation(5),
        body: MessageBody::DestinationReserved {
            destination: dest_worker(),
            reservation: RES,
            prefix_tokens: 1024,
            missing_tokens: 3072,
        },
    };
    assert_eq!(
        t.actions,
        vec![
            DestinationAction::ScheduleReservationTimer { deadline_ns: deadline },
            DestinationAction::Send { to: source_worker(), message: reserved_msg },
        ]
    );
    assert_eq!(d.state(), &DestinationState::Reserved { reservation: RES });

    let ready = from_src(
        id,
        2,
        MessageBody::SourceReady { source: source_worker(), blocks: 256, prompt_tokens: PROMPT_TOKENS },
    );
    let t = d.handle(DestinationEvent::Message(ready), 300).unwrap();
    let bytes = 3072 * KV_BYTES_PER_TOKEN;
    assert_eq!(
        t.actions,
        vec![DestinationAction::StartReceive { from: source_worker(), missing_tokens: 3072, bytes }]
    );
    assert_eq!(
        t.facts,
        vec![ready.received_fact(), Fact::ReceiveStarted { handoff: id, from: source_worker(), bytes }]
    );

    let t = d.handle(DestinationEvent::ReceiveCompleted, 400).unwrap();
    assert_eq!(t.actions[0], DestinationAction::ActivateDestination { reservation: RES });
    assert!(matches!(
        t.actions[1],
        DestinationAction::Send { message: HandoffMessage { body: MessageBody::ReceiveCompleted, .. }, .. }
    ));
    assert_eq!(t.facts[0], Fact::ReceiveCompleted { handoff: id });
    assert_eq!(d.state(), &DestinationState::Active { reservation: RES });
    // The reservation timer outlived the reservation: ignored.
    assert!(d.handle(DestinationEvent::ReservationExpired, deadline).unwrap().actions.is_empty());
    // An Abort from the source now changes nothing: the KV is already valid here.
    let t = d
        .handle(
            DestinationEvent::Message(from_src(
                id,
                2,
                MessageBody::Abort { reason: CancelReason::TransferFailed },
            )),
            500,
        )
        .unwrap();
    assert!(t.actions.is_empty());
    assert_eq!(d.state_name(), "Active");
    // Canceling the running request after activation aborts the request, not the reservation.
    let mut d2 = d.clone();
    let t = d2.handle(DestinationEvent::Cancelled { reason: CancelReason::RequestAborted }, 600).unwrap();
    assert_eq!(t.actions, vec![DestinationAction::AbortRequest { reason: CancelReason::RequestAborted }]);
    // Normal end.
    let t = d.handle(DestinationEvent::RequestFinished, 600).unwrap();
    assert!(t.actions.is_empty());
    assert_eq!(d.state(), &DestinationState::Released { how: EndReason::Success });
}

#[test]
fn destination_reservation_failure_and_expiry_tell_the_source() {
    let id = handoff_id(8);
    let mut d = destination(id, HandoffPolicy::DestinationFirst, Some(source_worker()), None);
    d.handle(DestinationEvent::Routed { worker: dest_worker() }, 0).unwrap();
    let t = d
        .handle(DestinationEvent::ReservationFailed { reason: CancelReason::DestinationRejected }, 1)
        .unwrap();
    assert_eq!(t.actions.len(), 1, "nothing to free, only the source to tell");
    assert!(matches!(
        t.actions[0],
        DestinationAction::Send {
            message: HandoffMessage {
                body: MessageBody::Abort { reason: CancelReason::DestinationRejected },
                ..
            },
            ..
        }
    ));

    let mut e = destination(handoff_id(9), HandoffPolicy::SourceFirst, Some(source_worker()), None);
    e.handle(DestinationEvent::Routed { worker: dest_worker() }, 0).unwrap();
    e.handle(DestinationEvent::Reserved { reservation: RES, prefix_tokens: 0, missing_tokens: 16 }, 10)
        .unwrap();
    assert!(e
        .handle(DestinationEvent::ReservationExpired, 10 + RESERVATION_NS - 1)
        .unwrap()
        .actions
        .is_empty());
    let t = e.handle(DestinationEvent::ReservationExpired, 10 + RESERVATION_NS).unwrap();
    assert_eq!(
        t.actions[0],
        DestinationAction::ReleaseDestination { reservation: Some(RES), reason: EndReason::Expired }
    );
    assert!(matches!(
        t.actions[1],
        DestinationAction::Send {
            message: HandoffMessage { body: MessageBody::Abort { reason: CancelReason::TransferFailed }, .. },
            ..
        }
    ));
    assert_eq!(t.facts[0], Fact::ReservationExpired { handoff: handoff_id(9), reservation: RES });
}
