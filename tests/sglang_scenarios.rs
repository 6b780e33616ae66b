//! Scenario tests for the SGLang core: the destination gate (proposal scenario 2), KV-event
//! timing (scenario 4), FIFO retry on capacity change, cancellation in every state, source
//! pinning, retraction and `new_token_ratio`. Every call goes through `Checked`, so the fact
//! folds are compared with the core after each one as well.

mod support;

use handoff_ledger::events::{Fact, KvDelta, RejectReason, TerminalStatus};
use handoff_ledger::ids::{CancelReason, EndReason, RequestId};
use handoff_ledger::schedulers::sglang::{ConfigError, SglangConfig};
use handoff_ledger::schedulers::{
    CommandError, CommandOutcome, EngineCore, EngineOutput, ReservationSummary,
};
use std::collections::BTreeSet;
use support::sglang::*;

fn cfg(total_pages: u32, slots: u32) -> SglangConfig {
    SglangConfig {
        total_pages,
        page_size: 16,
        max_running_requests: slots,
        max_prefill_tokens: 1024,
        chunked_prefill_size: 256,
        clip_max_new_tokens: 4096,
        num_reserved_decode_tokens: 32,
        ..SglangConfig::default()
    }
}

/// Steps until `pred` holds on a step's facts; returns the facts of that step.
fn step_until(c: &mut Checked, now: &mut u64, max: u32, pred: impl Fn(&[Fact]) -> bool) -> Vec<Fact> {
    for _ in 0..max {
        let out = c.step(*now);
        *now += out.duration_ns.max(1);
        if pred(&out.effects.facts) {
            return out.effects.facts;
        }
    }
    panic!("condition not reached in {max} steps; view {:?}", c.core.view());
}

fn drain(c: &mut Checked, now: &mut u64) {
    for _ in 0..10_000 {
        if c.core.is_empty() {
            return;
        }
        let out = c.step(*now);
        *now += out.duration_ns.max(1);
    }
    panic!("did not empty");
}

fn reserved_fact(facts: &[Fact]) -> Option<(u32, u32, u32, KvDelta)> {
    facts.iter().find_map(|f| match f {
        Fact::DestinationReserved { pages, prefix_blocks, prefix_tokens, kv, .. } => {
            Some((*pages, *prefix_blocks, *prefix_tokens, *kv))
        }
        _ => None,
    })
}

fn stored_hashes(facts: &[Fact]) -> Vec<u64> {
    facts
        .iter()
        .flat_map(|f| match f {
            Fact::KvStored { blocks, .. } => blocks.clone(),
            _ => vec![],
        })
        .collect()
}

fn count(facts: &[Fact], name: &str) -> usize {
    facts.iter().filter(|f| f.name() == name).count()
}

#[test]
fn scenario2_full_decode_refuses_then_reserves_on_free_slot() {
    let mut c = Checked::new(cfg(256, 3));
    let mut now = 0;
    // Three decoding requests take every slot.
    for i in 0..3 {
        c.cmd(|k| k.submit(req(i, 64, 6 + i as u32 * 4, 10 + i, 0), 0));
    }
    step_until(&mut c, &mut now, 5, |_| c_running_is(3));
    fn c_running_is(_: u64) -> bool {
        true
    }
    assert_eq!(c.core.view().running, 3);
    let before = c.core.snapshot();
    let r = c.cmd(|k| k.reserve_destination(hid(1), req(100, 80, 10, 1, 0), 99, now));
    assert_eq!(r.outcome, Ok(CommandOutcome::Unavailable));
    assert_eq!(count(&r.effects.facts, "ReservationQueued"), 1);
    assert!(r
        .effects
        .facts
        .contains(&Fact::ReservationRefused { handoff: hid(1), reason: RejectReason::NoSlot }));
    assert_eq!(c.core.snapshot(), before, "a refused reservation holds nothing");
    assert_eq!(c.core.view().pending_reservations, 1);
    // The first request to finish frees a slot; the same step reserves the head.
    let facts = step_until(&mut c, &mut now, 50, |f| count(f, "RequestFinished") > 0);
    let (pages, prefix_blocks, prefix_tokens, kv) =
        reserved_fact(&facts).expect("reserved when the slot freed");
    assert_eq!((pages, prefix_blocks, prefix_tokens), (5, 0, 0));
    assert_eq!(kv.slots, 1);
    assert_eq!(kv.headroom_tokens, 32);
    assert_eq!(kv.reserved_destination, 5);
    assert_eq!(c.core.snapshot().decode_headroom_tokens, 32);
    assert_eq!(c.core.view().waiting_for_remote_kv, 1);
    assert_eq!(c.core.view().pending_reservations, 0);
}

#[test]
fn scenario2_page_exhaustion_refuses_with_no_capacity() {
    // 20 pages of 16 tokens; a request of 200 tokens holds 13 pages and keeps growing.
    let mut c = Checked::new(cfg(20, 8));
    let mut now = 0;
    c.cmd(|k| k.submit(req(1, 200, 40, 1, 0), 0));
    step_until(&mut c, &mut now, 3, |f| count(f, "FirstTokenEmitted") > 0);
    // Needs 7 pages + 32 headroom tokens (2 pages) + 32 promised to the running request.
    let r = c.cmd(|k| k.reserve_destination(hid(1), req(2, 100, 5, 2, 0), 0, now));
    assert_eq!(r.outcome, Ok(CommandOutcome::Unavailable));
    assert!(r
        .effects
        .facts
        .contains(&Fact::ReservationRefused { handoff: hid(1), reason: RejectReason::NoCapacity }));
    let facts = step_until(&mut c, &mut now, 100, |f| count(f, "RequestFinished") > 0);
    let (pages, _, _, kv) = reserved_fact(&facts).expect("reserved once the pages returned");
    assert_eq!(pages, 7);
    assert_eq!(kv.slots, 1);
}

/// Runs one request to completion so its prompt pages stay cached (cached-free).
fn warm(c: &mut Checked, now: &mut u64, id: u64, input: u32, family: u64, shared: u32) {
    c.cmd(|k| k.submit(req(id, input, 2, family, shared), *now));
    drain(c, now);
}

#[test]
fn scenario2_zero_partial_and_full_prefix_hits() {
    let mut c = Checked::new(cfg(256, 16));
    let mut now = 0;
    // Family 7: 4 trace blocks of 32 tokens = 128 tokens = 8 pages cached.
    warm(&mut c, &mut now, 1, 128, 7, 4);
    let cached_before = c.core.snapshot().cached_free_blocks;
    assert!(cached_before >= 8);

    // Zero hit: another family.
    let r = c.cmd(|k| k.reserve_destination(hid(10), req(10, 100, 4, 8, 4), 0, now));
    assert_eq!(r.outcome, Ok(CommandOutcome::Applied));
    let (pages, pb, pt, kv) = reserved_fact(&r.effects.facts).unwrap();
    assert_eq!((pages, pb, pt), (7, 0, 0));
    assert_eq!(kv.reserved_destination, 7);
    assert_eq!(kv.free + kv.cached_free, -7);
    assert!(r.effects.outputs.iter().any(|o| matches!(
        o,
        EngineOutput::DestinationReserved {
            summary: ReservationSummary { pages: 7, prefix_blocks: 0, prefix_tokens: 0, missing_tokens: 112 },
            ..
        }
    )));

    // Partial hit: first 2 trace blocks (64 tokens = 4 pages) shared, then different.
    let r = c.cmd(|k| k.reserve_destination(hid(11), req(11, 160, 4, 7, 2), 0, now));
    let (pages, pb, pt, kv) = reserved_fact(&r.effects.facts).unwrap();
    assert_eq!((pages, pb, pt), (6, 4, 64));
    assert_eq!(kv.cached_free, -4, "locked prefix leaves cached-free (no eviction needed here)");
    assert_eq!(kv.reserved_destination, 10, "6 delta pages + 4 prefix pages only this reservation holds");
    assert_eq!(kv.free, -6);

    // Full hit: the same 128-token prompt; zero delta pages, nothing to transfer.
    let r = c.cmd(|k| k.reserve_destination(hid(12), req(12, 128, 4, 7, 4), 0, now));
    let (pages, pb, pt, kv) = reserved_fact(&r.effects.facts).unwrap();
    assert_eq!((pages, pb, pt), (0, 8, 128));
    assert_eq!(kv.free, 0, "a full hit allocates no page");
    assert_eq!(kv.cached_free, -4, "4 of the 8 prefix pages were already locked by hid(11)");
    assert!(r.effects.outputs.iter().any(|o| matches!(
        o,
        EngineOutput::DestinationReserved {
            summary: ReservationSummary { pages: 0, missing_tokens: 0, .. },
            ..
        }
    )));
    assert_eq!(c.core.snapshot().request_slots_used, 3);
    assert_eq!(c.core.snapshot().decode_headroom_tokens, 96);

    // Activation publishes only the new pages, once; the full hit publishes nothing.
    let r = c.cmd(|k| k.activate_destination(hid(12), now));
    assert_eq!(stored_hashes(&r.effects.facts).len(), 0);
    let r = c.cmd(|k| k.activate_destination(hid(11), now));
    assert_eq!(stored_hashes(&r.effects.facts).len(), 6, "160 tokens = 10 full pages, 4 reused");
    let r = c.cmd(|k| k.activate_destination(hid(10), now));
    assert_eq!(
        stored_hashes(&r.effects.facts).len(),
        6,
        "100 tokens = 6 full pages + 1 partial (unpublished)"
    );
    drain(&mut c, &mut now);
    let s = c.core.snapshot();
    assert_eq!((s.request_slots_used, s.decode_headroom_tokens, s.active_blocks), (0, 0, 0));
}

#[test]
fn scenario4_reserved_pages_are_published_once_and_only_after_activation() {
    let mut c = Checked::new(cfg(128, 8));
    let mut now = 0;
    let r = req(5, 96, 40, 3, 3);
    let prompt = r.prompt_block_hashes(16);
    let res = c.cmd(|k| k.reserve_destination(hid(5), r, 0, 0));
    assert_eq!(res.outcome, Ok(CommandOutcome::Applied));
    // Unrelated work runs meanwhile (it publishes its own pages).
    c.cmd(|k| k.submit(req(6, 70, 3, 4, 0), 0));
    for _ in 0..5 {
        let o = c.step(now);
        now += o.duration_ns;
    }
    let published: BTreeSet<u64> = stored_hashes(&c.facts).into_iter().collect();
    assert!(prompt.iter().all(|h| !published.contains(h)), "reserved pages published before activation");
    let a = c.cmd(|k| k.activate_destination(hid(5), now));
    assert_eq!(stored_hashes(&a.effects.facts), prompt, "activation publishes the 6 pages, in order");
    // Activating again is a no-op and publishes nothing.
    let again = c.cmd(|k| k.activate_destination(hid(5), now));
    assert_eq!(again.outcome, Ok(CommandOutcome::NoOp));
    assert!(again.effects.facts.is_empty());
    drain(&mut c, &mut now);
    let all = stored_hashes(&c.facts);
    for h in &prompt {
        assert_eq!(all.iter().filter(|x| *x == h).count(), 1, "a prompt page published more than once");
    }
}

#[test]
fn activated_destination_decodes_without_recompute() {
    let mut c = Checked::new(cfg(128, 8));
    let mut now = 0;
    c.cmd(|k| k.reserve_destination(hid(1), req(1, 90, 5, 1, 0), 0, 0));
    c.cmd(|k| k.activate_destination(hid(1), 0));
    assert_eq!(c.core.view().waiting, 1);
    let first = c.step(now);
    assert!(first.effects.facts.contains(&Fact::RequestScheduled {
        request: RequestId(1),
        cached_tokens: 90,
        kv: KvDelta::ZERO
    }));
    now += first.duration_ns;
    drain(&mut c, &mut now);
    let mut prefill = 0;
    let mut decodes = 0;
    for f in &c.facts {
        if let Fact::StepExecuted { prefill_tokens, decode_tokens, .. } = f {
            prefill += prefill_tokens;
            decodes += decode_tokens;
        }
    }
    assert_eq!(prefill, 0, "the prompt is never recomputed");
    assert_eq!(decodes, 4, "the first of 5 tokens came from the source");
    assert_eq!(
        count(&c.facts, "FirstTokenEmitted"),
        1,
        "the transferred first token is committed at activation"
    );
    assert!(c.facts.iter().any(|f| matches!(f,
        Fact::RequestFinished { request: RequestId(1), status: TerminalStatus::Completed, output_tokens: 5, kv }
            if kv.headroom_tokens == -32 && kv.slots == -1)));
}

#[test]
fn head_retries_only_when_capacity_changes() {
    let mut c = Checked::new(cfg(512, 2));
    let mut now = 0;
    c.cmd(|k| k.submit(req(1, 32, 30, 1, 0), 0));
    c.cmd(|k| k.submit(req(2, 32, 12, 2, 0), 0));
    step_until(&mut c, &mut now, 3, |f| count(f, "FirstTokenEmitted") == 2);
    c.cmd(|k| k.reserve_destination(hid(1), req(3, 50, 5, 3, 0), 0, now));
    c.cmd(|k| k.reserve_destination(hid(2), req(4, 50, 5, 4, 0), 0, now));
    let refused = |c: &Checked, h| {
        c.facts
            .iter()
            .filter(|f| matches!(f, Fact::ReservationRefused { handoff, .. } if *handoff == h))
            .count()
    };
    assert_eq!(
        (refused(&c, hid(1)), refused(&c, hid(2))),
        (1, 0),
        "the second waits behind the head untried"
    );
    // Work that frees nothing: more submissions and decode steps that finish nobody.
    c.cmd(|k| k.submit(req(5, 40, 3, 5, 0), now));
    for _ in 0..8 {
        let o = c.step(now);
        now += o.duration_ns;
        assert_eq!(count(&o.effects.facts, "RequestFinished"), 0);
    }
    assert_eq!((refused(&c, hid(1)), refused(&c, hid(2))), (1, 0), "no retry without a capacity change");
    // Request 2 finishes: its slot frees, the head reserves, then the new head is tried once.
    let facts = step_until(&mut c, &mut now, 20, |f| count(f, "RequestFinished") > 0);
    assert!(reserved_fact(&facts).is_some());
    assert_eq!(refused(&c, hid(2)), 1);
    // The queued request 5 is admitted ahead of nothing: the reservation took the only slot.
    assert_eq!(c.core.view().waiting, 1);
}

#[test]
fn cancellation_in_every_state_returns_everything_once() {
    let mut c = Checked::new(cfg(128, 4));
    let mut now = 0;
    warm(&mut c, &mut now, 1, 64, 9, 2);
    let base = c.core.snapshot();

    // Reserved with a partial prefix hit: the delta pages are freed, not cached.
    c.cmd(|k| k.reserve_destination(hid(1), req(2, 100, 5, 9, 1), 0, now));
    assert!(c.core.snapshot().reserved_destination_blocks > 0);
    let r = c.cmd(|k| k.cancel_destination(hid(1), CancelReason::TransferFailed, now));
    assert_eq!(r.outcome, Ok(CommandOutcome::Applied));
    assert_eq!(count(&r.effects.facts, "ReservationReleased"), 1);
    assert_eq!(count(&r.effects.facts, "KvStored"), 0);
    assert_eq!(c.core.snapshot(), base, "slot, pages, locks and headroom all returned");
    for again in [
        c.cmd(|k| k.cancel_destination(hid(1), CancelReason::TransferFailed, now)),
        c.cmd(|k| k.activate_destination(hid(1), now)),
    ] {
        assert_eq!(again.outcome, Ok(CommandOutcome::NoOp));
        assert!(again.effects.facts.is_empty());
    }

    // Pending: leaves the FIFO, holds nothing.
    for i in 0..4 {
        c.cmd(|k| k.submit(req(10 + i, 16, 50, 20 + i, 0), now));
    }
    step_until(&mut c, &mut now, 3, |f| count(f, "FirstTokenEmitted") == 4);
    let full = c.core.snapshot();
    let r = c.cmd(|k| k.reserve_destination(hid(2), req(3, 40, 5, 1, 0), 0, now));
    assert_eq!(r.outcome, Ok(CommandOutcome::Unavailable));
    let r = c.cmd(|k| k.cancel_destination(hid(2), CancelReason::RequestAborted, now));
    assert!(r
        .effects
        .facts
        .contains(&Fact::ReservationDequeued { handoff: hid(2), reason: CancelReason::RequestAborted }));
    assert_eq!(c.core.snapshot(), full);
    assert_eq!(c.core.view().pending_reservations, 0);
    drain(&mut c, &mut now);

    // Activated, before and after joining the batch.
    for (h, steps) in [(3u64, 0), (4, 2)] {
        let before = c.core.snapshot();
        c.cmd(|k| k.reserve_destination(hid(h), req(100 + h, 48, 20, 30 + h, 0), 0, now));
        c.cmd(|k| k.activate_destination(hid(h), now));
        for _ in 0..steps {
            let o = c.step(now);
            now += o.duration_ns;
        }
        let r = c.cmd(|k| k.cancel_destination(hid(h), CancelReason::RequestAborted, now));
        let fin = r.effects.facts.iter().find_map(|f| match f {
            Fact::RequestFinished { status, kv, .. } => Some((*status, *kv)),
            _ => None,
        });
        let (status, kv) = fin.expect("activated cancel ends the request");
        assert_eq!(status, TerminalStatus::Canceled);
        assert_eq!((kv.slots, kv.headroom_tokens), (-1, -32));
        let after = c.core.snapshot();
        assert_eq!(after.active_blocks, before.active_blocks);
        assert_eq!((after.request_slots_used, after.decode_headroom_tokens), (0, 0));
        let r = c.cmd(|k| k.cancel_destination(hid(h), CancelReason::RequestAborted, now));
        assert_eq!(r.outcome, Ok(CommandOutcome::NoOp));
    }

    // Source: queued, computing (mid-chunk) and pinned.
    let quiet = c.core.snapshot();
    c.cmd(|k| k.submit_handoff_prefill(hid(20), req(200, 50, 1, 40, 0), 1_000, now));
    let r = c.cmd(|k| k.cancel_source(hid(20), CancelReason::RequestAborted, now));
    assert_eq!(count(&r.effects.facts, "RequestFinished"), 1);
    assert_eq!(c.core.snapshot(), quiet);

    let mut small = cfg(128, 4);
    small.chunked_prefill_size = 32;
    let mut d = Checked::new(small);
    d.cmd(|k| k.submit_handoff_prefill(hid(21), req(201, 100, 1, 41, 0), 1_000, 0));
    let o = d.step(0);
    assert_eq!(count(&o.effects.facts, "FirstTokenEmitted"), 0, "first chunk of four");
    assert_eq!(d.core.snapshot().request_slots_used, 1);
    let r = d.cmd(|k| k.cancel_source(hid(21), CancelReason::PeerLost, 5));
    assert_eq!(count(&r.effects.facts, "RequestFinished"), 1);
    let s = d.core.snapshot();
    assert_eq!((s.active_blocks, s.request_slots_used), (0, 0));
    assert_eq!(s.cached_free_blocks, 2, "the computed chunk stays cached");

    c.cmd(|k| k.submit_handoff_prefill(hid(22), req(202, 50, 1, 42, 0), 1_000, now));
    step_until(&mut c, &mut now, 3, |f| count(f, "SourcePinned") == 1);
    let r = c.cmd(|k| k.cancel_source(hid(22), CancelReason::PeerLost, now));
    assert!(r.effects.facts.iter().any(|f| matches!(f,
        Fact::SourceReleased { reason: EndReason::Canceled(CancelReason::PeerLost), kv, .. } if kv.slots == -1 && kv.pinned_source == -4)));
    let r = c.cmd(|k| k.release_source(hid(22), EndReason::Success, now));
    assert_eq!(r.outcome, Ok(CommandOutcome::NoOp));
    let s = c.core.snapshot();
    assert_eq!((s.pinned_source_blocks, s.request_slots_used, s.active_blocks), (0, 0, 0));
}

#[test]
fn source_pins_in_the_same_step_and_release_keeps_pages_cached() {
    let mut c = Checked::new(cfg(128, 4));
    let r = req(1, 100, 30, 5, 3);
    let prompt = r.prompt_block_hashes(16);
    c.cmd(|k| k.submit_handoff_prefill(hid(1), r, 7_000, 1_000));
    let out = c.step(1_000);
    let end = 1_000 + out.duration_ns;
    let facts = &out.effects.facts;
    assert!(facts.contains(&Fact::FirstTokenEmitted { request: RequestId(1) }));
    assert_eq!(stored_hashes(facts), prompt, "6 full pages published at the last chunk");
    let pin = facts.iter().find_map(|f| match f {
        Fact::SourcePinned { blocks, deadline_ns, kv, .. } => Some((*blocks, *deadline_ns, *kv)),
        _ => None,
    });
    let (blocks, deadline, kv) = pin.expect("pinned in the terminal step");
    assert_eq!(blocks, 7);
    assert_eq!(deadline, end + 7_000);
    assert_eq!((kv.active, kv.pinned_source, kv.slots), (-7, 7, 0), "a pure move; the slot stays held");
    assert!(out.effects.outputs.iter().any(|o| matches!(o, EngineOutput::SourcePinned { blocks: 7, .. })));
    assert_eq!(c.core.view().held_prefills, 1);
    assert!(!c.core.is_drained() && c.core.is_empty());
    // Pinned pages survive pressure: they are not evictable.
    assert_eq!(
        c.cmd(|k| k.release_source(hid(1), EndReason::Success, end)).outcome,
        Ok(CommandOutcome::Applied)
    );
    let s = c.core.snapshot();
    assert_eq!((s.pinned_source_blocks, s.cached_free_blocks, s.request_slots_used), (0, 6, 0));
    assert!(c.core.is_drained());
    // The released pages are reused by a destination with the same prompt.
    let res = c.cmd(|k| k.reserve_destination(hid(2), req(2, 100, 30, 5, 3), 0, end));
    assert_eq!(reserved_fact(&res.effects.facts).map(|r| (r.0, r.1)), Some((1, 6)));
}

#[test]
fn pin_shared_with_a_running_request_moves_only_exclusive_pages() {
    let mut c = Checked::new(cfg(128, 4));
    let mut now = 0;
    // A running request with the same first 2 trace blocks (4 pages) keeps decoding.
    c.cmd(|k| k.submit(req(1, 64, 50, 6, 2), 0));
    step_until(&mut c, &mut now, 3, |f| count(f, "FirstTokenEmitted") == 1);
    c.cmd(|k| k.submit_handoff_prefill(hid(1), req(2, 96, 1, 6, 2), 1_000, now));
    let facts = step_until(&mut c, &mut now, 5, |f| count(f, "SourcePinned") == 1);
    let kv = facts.iter().find_map(|f| match f {
        Fact::SourcePinned { blocks: 6, kv, .. } => Some(*kv),
        _ => None,
    });
    // 6 pages, of which 3 are shared (the prefill recomputes at least its last page).
    let kv = kv.expect("pinned with 6 pages");
    assert!(kv.pinned_source < 6 && kv.pinned_source > 0, "shared pages stay active: {kv:?}");
    assert_eq!(kv.active, -kv.pinned_source);
}

#[test]
fn retraction_picks_fewest_outputs_and_resets_ratio() {
    // 12 pages of 16 tokens; three 32-token prompts that each want 60 more tokens do not fit.
    let mut config = cfg(12, 8);
    config.clip_max_new_tokens = 8; // admission estimates are optimistic on purpose
    config.new_token_ratio_decay_steps = 10;
    let init = config.init_new_token_ratio;
    let mut c = Checked::new(config);
    let mut now = 0;
    c.cmd(|k| k.submit(req(1, 32, 60, 1, 0), 0));
    step_until(&mut c, &mut now, 2, |f| count(f, "FirstTokenEmitted") == 1);
    for _ in 0..3 {
        let o = c.step(now);
        now += o.duration_ns;
    }
    let decay = (0.7 - 0.098) / 10.0;
    assert!((c.core.new_token_ratio() - (init - 3.0 * decay)).abs() < 1e-9, "ratio decays linearly");
    c.cmd(|k| k.submit(req(2, 32, 60, 2, 0), now));
    c.cmd(|k| k.submit(req(3, 48, 60, 3, 0), now));
    let facts = step_until(&mut c, &mut now, 400, |f| count(f, "RequestPreempted") > 0);
    let victims: Vec<_> = facts
        .iter()
        .filter_map(|f| match f {
            Fact::RequestPreempted { request, .. } => Some(*request),
            _ => None,
        })
        .collect();
    // Requests 2 and 3 started together (fewer outputs than request 1); 3 has the longer prompt.
    assert_eq!(victims[0], RequestId(3));
    assert_eq!(c.core.new_token_ratio(), init, "ratio resets on retraction");
    assert_eq!(c.core.view().waiting as usize, victims.len());
    drain(&mut c, &mut now);
    for id in 1..=3 {
        assert!(c.facts.iter().any(|f| matches!(f,
            Fact::RequestFinished { request, status: TerminalStatus::Completed, output_tokens: 60, .. } if request.0 == id)));
    }
    let s = c.core.snapshot();
    assert_eq!((s.active_blocks, s.request_slots_used), (0, 0));
}

#[test]
fn chunked_prefill_emits_first_token_after_the_last_chunk() {
    let mut config = cfg(128, 4);
    config.chunked_prefill_size = 64;
    let mut c = Checked::new(config);
    c.cmd(|k| k.submit(req(1, 200, 3, 1, 0), 0));
    let mut chunks = vec![];
    let mut now = 0;
    loop {
        let o = c.step(now);
        now += o.duration_ns;
        if let Some(Fact::StepExecuted { prefill_tokens, .. }) =
            o.effects.facts.iter().find(|f| f.name() == "StepExecuted")
        {
            chunks.push(*prefill_tokens);
        }
        if count(&o.effects.facts, "FirstTokenEmitted") == 1 {
            break;
        }
        assert!(chunks.len() < 10);
    }
    assert_eq!(chunks, vec![64, 64, 64, 8]);
    assert_eq!(count(&c.facts, "RequestScheduled"), 1);
}

#[test]
fn never_fitting_requests_are_rejected_at_submit() {
    let mut c = Checked::new(cfg(8, 4)); // 128 tokens
    let r = c.cmd(|k| k.submit(req(1, 120, 20, 1, 0), 0));
    assert!(matches!(r.outcome, Err(CommandError::NeverFits { needed_blocks: 9, total_blocks: 8, .. })));
    assert!(r
        .effects
        .facts
        .contains(&Fact::RequestRejected { request: RequestId(1), reason: RejectReason::NeverFits }));
    // Input 100 + 32 reserved decode tokens > 128.
    let r = c.cmd(|k| k.reserve_destination(hid(1), req(2, 100, 4, 1, 0), 0, 0));
    assert!(matches!(r.outcome, Err(CommandError::NeverFits { .. })));
    assert_eq!(c.core.view(), Default::default());
    let r = c.cmd(|k| k.cancel_destination(hid(1), CancelReason::DestinationRejected, 0));
    assert_eq!(r.outcome, Ok(CommandOutcome::NoOp));
}

#[test]
fn bogus_and_wrong_state_commands_are_typed_errors() {
    let mut c = Checked::new(cfg(64, 4));
    assert_eq!(
        c.cmd(|k| k.activate_destination(hid(1), 0)).outcome,
        Err(CommandError::UnknownHandoff(hid(1)))
    );
    c.cmd(|k| k.submit_handoff_prefill(hid(2), req(2, 40, 1, 1, 0), 10, 0));
    assert!(matches!(
        c.cmd(|k| k.release_source(hid(2), EndReason::Success, 0)).outcome,
        Err(CommandError::InvalidState { .. })
    ));
    assert_eq!(
        c.cmd(|k| k.submit_handoff_prefill(hid(2), req(3, 40, 1, 1, 0), 10, 0)).outcome,
        Err(CommandError::DuplicateHandoff(hid(2)))
    );
}

#[test]
fn config_defaults_serde_and_validation() {
    let d: SglangConfig = serde_json::from_str("{}").unwrap();
    assert_eq!(d, SglangConfig::default());
    assert_eq!((d.total_pages, d.page_size, d.max_running_requests), (16384, 64, 256));
    assert_eq!((d.max_prefill_tokens, d.chunked_prefill_size, d.clip_max_new_tokens), (16384, 8192, 4096));
    assert_eq!(
        (d.init_new_token_ratio, d.min_new_token_ratio, d.new_token_ratio_decay_steps),
        (0.7, 0.098, 600)
    );
    assert_eq!(d.num_reserved_decode_tokens, 512);
    assert!(serde_json::from_str::<SglangConfig>(r#"{"page_sise": 16}"#).is_err());
    let bad = SglangConfig { page_size: 0, ..SglangConfig::default() };
    assert!(matches!(bad.validate(), Err(ConfigError::TooSmall { field: "page_size", .. })));
    let bad = SglangConfig { min_new_token_ratio: 0.9, ..SglangConfig::default() };
    assert!(matches!(bad.validate(), Err(ConfigError::BadRatio { .. })));
    let bad = SglangConfig { chunked_prefill_size: 32, ..SglangConfig::default() };
    assert!(matches!(bad.validate(), Err(ConfigError::ChunkBelowPage { .. })));
    let core =
        handoff_ledger::schedulers::sglang::SglangCore::new(handoff_ledger::ids::WorkerId::decode(0), d)
            .unwrap();
    assert_eq!(core.shape().total_blocks, 16384);
    assert_eq!(core.shape().block_size, 64);
}

#[test]
fn prefill_batch_respects_max_prefill_tokens() {
    let mut config = cfg(256, 8);
    config.max_prefill_tokens = 128;
    let mut c = Checked::new(config);
    for i in 0..3 {
        c.cmd(|k| k.submit(req(i, 100, 5, 10 + i, 0), 0));
    }
    let o = c.step(0);
    assert_eq!(count(&o.effects.facts, "RequestScheduled"), 1, "100 + 112 page-rounded > 128");
    // A single prompt larger than the budget still runs alone.
    let mut config = cfg(256, 8);
    config.max_prefill_tokens = 64;
    let mut d = Checked::new(config);
    d.cmd(|k| k.submit(req(9, 200, 5, 1, 0), 0));
    d.cmd(|k| k.submit(req(10, 16, 5, 2, 0), 0));
    let o = d.step(0);
    assert_eq!(count(&o.effects.facts, "RequestScheduled"), 1);
    assert!(o.effects.facts.iter().any(|f| matches!(f, Fact::StepExecuted { prefill_tokens: 200, .. })));
}

#[test]
fn pinned_sources_hold_request_slots() {
    let mut c = Checked::new(cfg(256, 2));
    let mut now = 0;
    c.cmd(|k| k.submit_handoff_prefill(hid(1), req(1, 40, 1, 1, 0), 1_000, 0));
    c.cmd(|k| k.submit_handoff_prefill(hid(2), req(2, 40, 1, 2, 0), 1_000, 0));
    step_until(&mut c, &mut now, 3, |f| count(f, "SourcePinned") == 2);
    assert_eq!(c.core.snapshot().request_slots_used, 2);
    c.cmd(|k| k.submit(req(3, 40, 3, 3, 0), now));
    let o = c.step(now);
    assert_eq!(o.duration_ns, 0, "no slot: nothing runs");
    assert_eq!(c.core.view().waiting, 1);
    // A reservation is refused for the same reason.
    let r = c.cmd(|k| k.reserve_destination(hid(3), req(4, 40, 3, 4, 0), 0, now));
    assert!(r
        .effects
        .facts
        .contains(&Fact::ReservationRefused { handoff: hid(3), reason: RejectReason::NoSlot }));
    // Releasing one pin frees a slot: the FIFO head takes it at the end of the release.
    let r = c.cmd(|k| k.release_source(hid(1), EndReason::Success, now));
    assert!(reserved_fact(&r.effects.facts).is_some());
    c.cmd(|k| k.release_source(hid(2), EndReason::Success, now));
    step_until(&mut c, &mut now, 3, |f| count(f, "FirstTokenEmitted") == 1);
}

#[test]
fn nothing_preallocates_while_retracted_requests_wait() {
    let mut config = cfg(12, 8);
    config.clip_max_new_tokens = 8;
    config.num_reserved_decode_tokens = 0; // isolate the retraction rule from the headroom rule
    let mut c = Checked::new(config);
    let mut now = 0;
    c.cmd(|k| k.submit(req(1, 32, 60, 1, 0), 0));
    c.cmd(|k| k.submit(req(2, 32, 60, 2, 0), 0));
    c.cmd(|k| k.submit(req(3, 48, 60, 3, 0), 0));
    step_until(&mut c, &mut now, 400, |f| count(f, "RequestPreempted") > 0);
    let s = c.core.snapshot();
    assert!(s.free_blocks + s.cached_free_blocks >= 1, "precondition: a page is available {s:?}");
    assert!(s.request_slots_used < 8);
    let r = c.cmd(|k| k.reserve_destination(hid(1), req(9, 1, 1, 9, 0), 0, now));
    assert_eq!(r.outcome, Ok(CommandOutcome::Unavailable));
    assert!(r
        .effects
        .facts
        .contains(&Fact::ReservationRefused { handoff: hid(1), reason: RejectReason::NoCapacity }));
    // Once no retracted request waits, the head is retried and fits.
    drain(&mut c, &mut now);
    assert!(c
        .facts
        .iter()
        .any(|f| matches!(f, Fact::DestinationReserved { handoff, .. } if *handoff == hid(1))));
}
