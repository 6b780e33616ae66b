//! The rule, the table and the FIFO on their own; then both cores against the same rule.

use super::*;
use crate::schedulers::request::TRACE_BLOCK_SIZE;

fn hid(n: u128) -> HandoffId {
    HandoffId(uuid::Uuid::from_u128(n))
}

fn request(id: u64) -> Request {
    Request {
        id: crate::ids::RequestId(id),
        input_tokens: 64,
        output_tokens: 4,
        trace_blocks: vec![id].into(),
        trace_block_size: TRACE_BLOCK_SIZE,
        arrival_ns: 0,
        hash_cache: Default::default(),
    }
}

#[test]
fn the_rule_answers_by_standing_and_intent() {
    let h = hid(1);
    assert_eq!(answer(h, Standing::Held, Intent::Act), None);
    assert_eq!(answer(h, Standing::Ended, Intent::Act), Some(Ok(CommandOutcome::NoOp)));
    assert_eq!(answer(h, Standing::NeverSeen, Intent::Act), Some(Err(CommandError::UnknownHandoff(h))));
    assert_eq!(answer(h, Standing::NeverSeen, Intent::Start), None);
    for standing in [Standing::Held, Standing::Ended] {
        assert_eq!(answer(h, standing, Intent::Start), Some(Err(CommandError::DuplicateHandoff(h))));
    }
}

#[test]
fn a_table_moves_a_handoff_from_never_seen_to_held_to_ended() {
    let mut t: HandoffTable<u32> = HandoffTable::new();
    let h = hid(1);
    assert_eq!(t.standing(h), Standing::NeverSeen);
    assert_eq!(t.lookup(h), Err(Err(CommandError::UnknownHandoff(h))));
    assert_eq!(t.start_answer(h), None);
    t.hold(h, 7);
    assert_eq!(t.lookup(h), Ok(&7));
    assert_eq!(t.start_answer(h), Some(Err(CommandError::DuplicateHandoff(h))));
    // A new phase replaces the entry; taking it out for the next phase does not end it.
    t.hold(h, 8);
    assert_eq!(t.take(&h), Some(8));
    assert_eq!(t.standing(h), Standing::NeverSeen);
    t.hold(h, 9);
    assert_eq!(t.end(h), Some(9));
    assert_eq!(t.end(h), None, "ending twice is harmless");
    assert_eq!(t.standing(h), Standing::Ended);
    assert_eq!(t.lookup(h), Err(Ok(CommandOutcome::NoOp)));
    assert_eq!(t.start_answer(h), Some(Err(CommandError::DuplicateHandoff(h))));
    assert!(t.is_empty());
    // A refused start is ended without ever being held.
    t.refuse(hid(2));
    assert_eq!(t.standing(hid(2)), Standing::Ended);
}

#[test]
fn the_memory_of_ended_handoffs_forgets_the_oldest_first() {
    let mut t: HandoffTable<()> = HandoffTable::new();
    for i in 0..=ENDED_MEMORY as u128 {
        t.refuse(hid(i));
    }
    assert_eq!(t.standing(hid(0)), Standing::NeverSeen, "the oldest is forgotten");
    assert_eq!(t.standing(hid(1)), Standing::Ended);
    assert_eq!(t.standing(hid(ENDED_MEMORY as u128)), Standing::Ended);
    // Remembering one again neither duplicates it nor forgets another.
    t.refuse(hid(1));
    assert_eq!(t.standing(hid(1)), Standing::Ended);
    assert_eq!(t.ended.order.len(), ENDED_MEMORY);
}

#[test]
fn pending_reservations_retry_the_head_only_when_the_epoch_moved() {
    let mut p = PendingReservations::new();
    assert_eq!(p.arrival(2), Arrival::TryNow);
    p.push(hid(1), request(1), 10, Some(5));
    assert_eq!(p.arrival(2), Arrival::Queue);
    p.push(hid(2), request(2), 20, None);
    assert_eq!(p.arrival(2), Arrival::Full);
    // Tried at epoch 5: not due until the epoch moves.
    assert!(!p.head_is_due(5));
    assert!(p.take_due(5).is_none());
    let head = p.take_due(6).expect("due at a new epoch");
    assert_eq!((head.handoff, head.deadline_ns), (hid(1), 10));
    p.put_back(head, 6);
    assert!(!p.head_is_due(6));
    assert_eq!(p.len(), 2);
    // Removing the head makes the never-tried second one due at any epoch.
    assert_eq!(p.remove(hid(1)).map(|r| r.handoff), Some(hid(1)));
    assert!(p.head_is_due(6));
    assert!(p.remove(hid(1)).is_none());
    assert_eq!(p.take_due(6).map(|r| r.request.id.0), Some(2));
    assert!(p.is_empty());
}

#[test]
fn resource_ids_count_from_their_first_id_per_kind() {
    let mut ids = ResourceIds::starting_at(1);
    assert_eq!(ids.lease(), SourceLeaseId(1));
    assert_eq!(ids.lease(), SourceLeaseId(2));
    assert_eq!(ids.reservation(), DestinationReservationId(1));
}
