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

// ----- both cores, one rule -----

mod both_cores {
    use super::{hid, Answer};
    use crate::ids::{Backend, CancelReason, EndReason, HandoffId, RequestId, WorkerId};
    use crate::schedulers::request::TRACE_BLOCK_SIZE;
    use crate::schedulers::sglang::{SglangConfig, SglangCore};
    use crate::schedulers::vllm::{VllmConfig, VllmCore};
    use crate::schedulers::{CommandError, CommandOutcome, EngineCore, Request};

    const APPLIED: Answer = Ok(CommandOutcome::Applied);
    const NO_OP: Answer = Ok(CommandOutcome::NoOp);

    fn unknown(h: HandoffId) -> Answer {
        Err(CommandError::UnknownHandoff(h))
    }

    fn duplicate(h: HandoffId) -> Answer {
        Err(CommandError::DuplicateHandoff(h))
    }

    /// `NeverFits` names each core's own block count: only the variant is compared.
    fn never_fits() -> Answer {
        Err(CommandError::NeverFits { request: RequestId(0), needed_blocks: 0, total_blocks: 0 })
    }

    fn normalized(a: Answer) -> Answer {
        match a {
            Err(CommandError::NeverFits { .. }) => never_fits(),
            other => other,
        }
    }

    /// Both cores with 64 blocks (pages) of 16 tokens.
    fn cores() -> Vec<(&'static str, Box<dyn EngineCore>)> {
        let vllm = VllmConfig { num_gpu_blocks: 64, block_size: 16, ..VllmConfig::default() };
        let sglang = SglangConfig { total_pages: 64, page_size: 16, ..SglangConfig::default() };
        vec![
            ("vllm", Box::new(VllmCore::new(WorkerId::aggregated(0), Backend::Vllm, vllm).unwrap())),
            ("sglang", Box::new(SglangCore::new(WorkerId::aggregated(0), sglang).unwrap())),
        ]
    }

    fn req(id: u64, input: u32, output: u32) -> Request {
        Request {
            id: RequestId(id),
            input_tokens: input,
            output_tokens: output,
            trace_blocks: vec![1000 + id].into(),
            trace_block_size: TRACE_BLOCK_SIZE,
            arrival_ns: 0,
            hash_cache: Default::default(),
        }
    }

    fn step_until(core: &mut dyn EngineCore, done: impl Fn(&dyn EngineCore) -> bool) {
        for _ in 0..50 {
            if done(core) {
                return;
            }
            core.step(0);
        }
        panic!("not reached in 50 steps");
    }

    /// Both cores are held to the same expected answers, so they agree with each other.
    fn check(core: &str, what: &str, got: Answer, want: Answer) {
        assert_eq!(normalized(got), want, "{core}: {what}");
    }

    #[test]
    fn a_never_seen_handoff_is_unknown_to_every_command_on_both_cores() {
        for (name, mut core) in cores() {
            let c = core.as_mut();
            let h = hid(1);
            let a = c.activate_destination(h, 0).outcome;
            check(name, "activate", a, unknown(h));
            let a = c.release_source(h, EndReason::Success, 0).outcome;
            check(name, "release", a, unknown(h));
            let a = c.cancel_source(h, CancelReason::Teardown, 0).outcome;
            check(name, "cancel source", a, unknown(h));
            let a = c.cancel_destination(h, CancelReason::Teardown, 0).outcome;
            check(name, "cancel destination", a, unknown(h));
        }
    }

    #[test]
    fn an_ended_source_answers_late_commands_with_no_op_and_a_restart_as_duplicate() {
        for (name, mut core) in cores() {
            let c = core.as_mut();
            // Pinned, then released.
            let h = hid(2);
            let a = c.submit_handoff_prefill(h, req(2, 64, 1), 1_000, 0).outcome;
            check(name, "prefill", a, APPLIED);
            let a = c.submit_handoff_prefill(h, req(3, 64, 1), 1_000, 0).outcome;
            check(name, "prefill of a held id", a, duplicate(h));
            step_until(c, |c| c.view().held_prefills == 1);
            let a = c.release_source(h, EndReason::Success, 0).outcome;
            check(name, "release", a, APPLIED);
            let a = c.release_source(h, EndReason::Expired, 0).outcome;
            check(name, "release again", a, NO_OP);
            let a = c.cancel_source(h, CancelReason::Teardown, 0).outcome;
            check(name, "cancel after release", a, NO_OP);
            let a = c.submit_handoff_prefill(h, req(4, 64, 1), 1_000, 0).outcome;
            check(name, "prefill of an ended id", a, duplicate(h));
            // The destination table never saw it.
            let a = c.cancel_destination(h, CancelReason::Teardown, 0).outcome;
            check(name, "cancel as a destination", a, unknown(h));

            // Canceled while queued.
            let h = hid(3);
            let a = c.submit_handoff_prefill(h, req(5, 64, 1), 1_000, 0).outcome;
            check(name, "prefill", a, APPLIED);
            let a = c.cancel_source(h, CancelReason::RequestAborted, 0).outcome;
            check(name, "cancel queued", a, APPLIED);
            let a = c.release_source(h, EndReason::Success, 0).outcome;
            check(name, "release after cancel", a, NO_OP);

            // Refused at its start (it can never fit): ended all the same.
            let h = hid(4);
            let a = c.submit_handoff_prefill(h, req(6, 4096, 1), 1_000, 0).outcome;
            check(name, "prefill that never fits", a, never_fits());
            let a = c.cancel_source(h, CancelReason::Teardown, 0).outcome;
            check(name, "cancel after refusal", a, NO_OP);
            let a = c.release_source(h, EndReason::Expired, 0).outcome;
            check(name, "release after refusal", a, NO_OP);
            let a = c.submit_handoff_prefill(h, req(7, 64, 1), 1_000, 0).outcome;
            check(name, "prefill of a refused id", a, duplicate(h));
            assert!(c.is_drained(), "{name}");
            assert_eq!(c.audit(), c.snapshot(), "{name}");
        }
    }

    #[test]
    fn an_ended_destination_answers_late_commands_with_no_op_and_a_restart_as_duplicate() {
        for (name, mut core) in cores() {
            let c = core.as_mut();
            // Reserved, then canceled.
            let h = hid(5);
            let a = c.reserve_destination(h, req(10, 64, 4), u64::MAX, 0).outcome;
            check(name, "reserve", a, APPLIED);
            let a = c.reserve_destination(h, req(11, 64, 4), u64::MAX, 0).outcome;
            check(name, "reserve of a held id", a, duplicate(h));
            let a = c.cancel_destination(h, CancelReason::TransferFailed, 0).outcome;
            check(name, "cancel", a, APPLIED);
            let a = c.activate_destination(h, 0).outcome;
            check(name, "activate after cancel", a, NO_OP);
            let a = c.cancel_destination(h, CancelReason::Teardown, 0).outcome;
            check(name, "cancel again", a, NO_OP);
            let a = c.reserve_destination(h, req(12, 64, 4), u64::MAX, 0).outcome;
            check(name, "reserve of an ended id", a, duplicate(h));
            // The source table never saw it.
            let a = c.release_source(h, EndReason::Success, 0).outcome;
            check(name, "release as a source", a, unknown(h));

            // Activated and run to completion.
            let h = hid(6);
            let a = c.reserve_destination(h, req(13, 64, 3), u64::MAX, 0).outcome;
            check(name, "reserve", a, APPLIED);
            let a = c.activate_destination(h, 0).outcome;
            check(name, "activate", a, APPLIED);
            let a = c.activate_destination(h, 0).outcome;
            check(name, "activate while held", a, NO_OP);
            step_until(c, |c| c.is_drained());
            let a = c.activate_destination(h, 0).outcome;
            check(name, "activate after completion", a, NO_OP);
            let a = c.cancel_destination(h, CancelReason::Teardown, 0).outcome;
            check(name, "cancel after completion", a, NO_OP);

            // Refused at its start (it can never fit): ended all the same.
            let h = hid(7);
            let a = c.reserve_destination(h, req(14, 4096, 4), u64::MAX, 0).outcome;
            check(name, "reserve that never fits", a, never_fits());
            let a = c.activate_destination(h, 0).outcome;
            check(name, "activate after refusal", a, NO_OP);
            let a = c.cancel_destination(h, CancelReason::Teardown, 0).outcome;
            check(name, "cancel after refusal", a, NO_OP);
            let a = c.reserve_destination(h, req(15, 64, 4), u64::MAX, 0).outcome;
            check(name, "reserve of a refused id", a, duplicate(h));
            assert!(c.is_drained(), "{name}");
            assert_eq!(c.audit(), c.snapshot(), "{name}");
        }
    }
}
