//! Scenario tests of the vLLM-like core (proposal scenarios 1 and 4, retry discipline,
//! cancellation in every state, preemption, prefix reuse, plain-path equivalence).

mod support;

use handoff_ledger::events::{Fact, KvDelta, RejectReason, TerminalStatus};
use handoff_ledger::ids::{Backend, CancelReason, EndReason, RequestId, WorkerId};
use handoff_ledger::schedulers::vllm::VllmConfig;
use handoff_ledger::schedulers::{
    CommandError, CommandOutcome, EngineCore, EngineOutput, PolynomialTiming, StepShape, TimingModel,
};
use support::vllm::{hid, req, small, Harness};

const LEASE_NS: u64 = 30_000_000_000;

fn handoff_fact(f: &Fact) -> bool {
    f.handoff().is_some()
}

/// Proposal scenario 1: a stranded vLLM source. Decode is full, so the reservation is
/// unavailable; the 4K prefill pins its KV on the source: compute load falls to zero while the
/// pinned blocks stay. Then decode frees, the reservation lands, activation publishes, and only
/// then is the source released.
#[test]
fn scenario1_stranded_source_then_reserve_activate_release() {
    let mut p = Harness::with_backend(small(128, 64), Backend::Vllm, WorkerId::prefill(0));
    let mut d = Harness::with_backend(small(128, 64), Backend::Vllm, WorkerId::decode(0));
    let h = hid(1);
    let prompt = req(100, 4096, 50, &[11, 12, 13, 14, 15, 16, 17, 18]);

    // Fill decode: two long prompts decoding for a while (55 blocks each, growing to 56).
    for (i, t) in [(1u64, 901u64), (2, 902)] {
        assert_eq!(
            d.run("fill", |c, now| c.submit(req(i, 3500, 40, &[t]), now)),
            Ok(CommandOutcome::Applied)
        );
    }
    d.step();
    d.step();
    assert_eq!(d.core.view().running, 2);
    assert!(d.core.snapshot().active_blocks >= 110);

    // Source: the 4096-token prefill runs and pins in the same step as its first token.
    let r = p.core.submit_handoff_prefill(h, prompt.clone(), LEASE_NS, p.now_ns);
    assert_eq!(p.cmd(r, "submit handoff"), Ok(CommandOutcome::Applied));
    let t0 = p.now_ns;
    let out = p.step();
    let names: Vec<_> = out.effects.facts.iter().map(|f| f.name()).collect();
    assert_eq!(names, ["RequestScheduled", "StepExecuted", "KvStored", "FirstTokenEmitted", "SourcePinned"]);
    assert!(!p.log.iter().any(|f| matches!(f, Fact::RequestFinished { .. })), "no normal completion first");
    let pinned = out
        .effects
        .outputs
        .iter()
        .find_map(|o| match o {
            EngineOutput::SourcePinned { blocks, deadline_ns, .. } => Some((*blocks, *deadline_ns)),
            _ => None,
        })
        .expect("SourcePinned output");
    assert_eq!(pinned, (64, t0 + out.duration_ns + LEASE_NS));

    // Stranded: no running work (a step costs nothing), yet 64 blocks stay pinned.
    let s = p.core.snapshot();
    assert_eq!((s.active_blocks, s.pinned_source_blocks, s.request_slots_used), (0, 64, 0));
    assert!(p.core.is_empty() && !p.core.is_drained());
    assert_eq!(p.core.view().held_prefills, 1);
    let idle = p.step();
    assert_eq!(idle.duration_ns, 0);
    assert_eq!(p.core.snapshot().pinned_source_blocks, 64);

    // Decode has 18 blocks free: the reservation (64 pages) is unavailable and queued.
    let r = d.core.reserve_destination(h, prompt.clone(), u64::MAX, d.now_ns);
    assert_eq!(d.cmd(r, "reserve"), Ok(CommandOutcome::Unavailable));
    assert_eq!(d.core.view().pending_reservations, 1);
    assert_eq!(d.core.snapshot().reserved_destination_blocks, 0);

    // Free decode: its requests finish; the pending head is retried and reserved.
    d.step_until(200, |d| d.core.view().running == 0);
    assert_eq!(d.count("DestinationReserved"), 1);
    let s = d.core.snapshot();
    assert_eq!((s.reserved_destination_blocks, s.active_blocks, s.request_slots_used), (64, 0, 0));
    assert_eq!(d.core.view().waiting_for_remote_kv, 1);
    assert_eq!(p.core.snapshot().pinned_source_blocks, 64, "source still pinned while decode reserves");
    let summary = d
        .outputs
        .iter()
        .find_map(|o| match o {
            EngineOutput::DestinationReserved { summary, .. } => Some(*summary),
            _ => None,
        })
        .unwrap();
    assert_eq!((summary.pages, summary.prefix_blocks, summary.missing_tokens), (64, 0, 4096));

    // Activate: reserved → active, the 64 prompt blocks are published once, under the same
    // hashes the source published.
    let before = d.stored_hashes().len();
    let r = d.core.activate_destination(h, d.now_ns);
    assert_eq!(d.cmd(r, "activate"), Ok(CommandOutcome::Applied));
    let s = d.core.snapshot();
    assert_eq!((s.reserved_destination_blocks, s.active_blocks), (0, 64));
    let published: Vec<u64> = d.stored_hashes()[before..].to_vec();
    assert_eq!(published, prompt.prompt_block_hashes(64));
    assert_eq!(p.stored_hashes(), published);
    assert_eq!(p.core.snapshot().pinned_source_blocks, 64, "activation does not release the source");

    // Release the source last: its blocks go back to the cache with their hashes.
    let r = p.core.release_source(h, EndReason::Success, p.now_ns);
    assert_eq!(p.cmd(r, "release"), Ok(CommandOutcome::Applied));
    let s = p.core.snapshot();
    assert_eq!((s.pinned_source_blocks, s.cached_free_blocks), (0, 64));
    assert!(p.core.is_drained());
    let r = p.core.release_source(h, EndReason::Success, p.now_ns);
    assert_eq!(p.cmd(r, "release again"), Ok(CommandOutcome::NoOp));

    // Decode runs the retained request as already computed: no prefill tokens; it produces all
    // 50 output tokens itself, the first one (TTFT) on its first step.
    let prefill_before: u32 = prefill_tokens(&d.log);
    d.step_until(200, |d| d.core.is_drained());
    assert_eq!(prefill_tokens(&d.log), prefill_before, "the prompt is never recomputed");
    let fin = d.log.iter().find_map(|f| match f {
        Fact::RequestFinished { request, status, output_tokens, .. } if *request == RequestId(100) => {
            Some((*status, *output_tokens))
        }
        _ => None,
    });
    assert_eq!(fin, Some((TerminalStatus::Completed, 50)));
    assert_eq!(
        d.log
            .iter()
            .filter(|f| matches!(f, Fact::FirstTokenEmitted { request } if *request == RequestId(100)))
            .count(),
        1,
        "the decode worker emits the user's first token"
    );
    let s = d.core.snapshot();
    assert_eq!(s.active_blocks + s.pinned_source_blocks + s.reserved_destination_blocks, 0);
}

fn prefill_tokens(log: &[Fact]) -> u32 {
    log.iter()
        .map(|f| match f {
            Fact::StepExecuted { prefill_tokens, .. } => *prefill_tokens,
            _ => 0,
        })
        .sum()
}

/// Scenario 4: reserved pages are invisible to the KV index until activation, then published
/// exactly once; reused prefix blocks are never republished.
#[test]
fn scenario4_no_stored_before_activation_exactly_once_after() {
    let mut d = Harness::with_backend(small(256, 64), Backend::Vllm, WorkerId::decode(0));
    // Warm a 1024-token prefix (16 blocks) with a plain request.
    d.run("warm", |c, now| c.submit(req(1, 1024, 2, &[1, 2]), now)).unwrap();
    d.step_until(20, |d| d.core.is_empty());
    assert_eq!(d.core.snapshot().cached_free_blocks, 16);

    let b = req(2, 2048, 5, &[1, 2, 3, 4]);
    let hashes = b.prompt_block_hashes(64);
    let r = d.core.reserve_destination(hid(4), b.clone(), u64::MAX, d.now_ns);
    assert_eq!(d.cmd(r, "reserve"), Ok(CommandOutcome::Applied));
    let (pages, prefix_blocks, prefix_tokens) = d
        .log
        .iter()
        .find_map(|f| match f {
            Fact::DestinationReserved { pages, prefix_blocks, prefix_tokens, .. } => {
                Some((*pages, *prefix_blocks, *prefix_tokens))
            }
            _ => None,
        })
        .unwrap();
    assert_eq!((pages, prefix_blocks, prefix_tokens), (16, 16, 1024));
    assert_eq!(d.core.snapshot().reserved_destination_blocks, 32, "prefix locked + pages");
    for _ in 0..5 {
        d.step();
    }
    let stored = d.stored_hashes();
    assert!(hashes[16..].iter().all(|h| !stored.contains(h)), "nothing published before activation");

    // Another request sharing the prefix can still reuse it; it cannot match the reserved pages.
    d.run("probe", |c, now| c.submit(req(3, 2048, 1, &[1, 2, 3, 4]), now)).unwrap();
    d.step();
    let cached = d.log.iter().find_map(|f| match f {
        Fact::RequestScheduled { request, cached_tokens, .. } if *request == RequestId(3) => {
            Some(*cached_tokens)
        }
        _ => None,
    });
    assert_eq!(cached, Some(1024), "reserved pages give no KV hit");
    d.step_until(50, |d| d.core.view().running == 0 && d.core.view().waiting == 0);

    // The probe published hashes[16..] itself meanwhile; activation adopts those canonical
    // blocks instead of publishing duplicates. Use a fresh suffix to see publication.
    let c = req(4, 2048, 3, &[1, 2, 5, 6]);
    let ch = c.prompt_block_hashes(64);
    let r = d.core.reserve_destination(hid(5), c.clone(), u64::MAX, d.now_ns);
    assert_eq!(d.cmd(r, "reserve c"), Ok(CommandOutcome::Applied));
    assert!(ch[16..].iter().all(|h| !d.stored_hashes().contains(h)));
    let r = d.core.activate_destination(hid(5), d.now_ns);
    assert_eq!(d.cmd(r, "activate c"), Ok(CommandOutcome::Applied));
    let last = d.log.iter().rev().find_map(|f| match f {
        Fact::KvStored { parent, blocks } => Some((*parent, blocks.clone())),
        _ => None,
    });
    assert_eq!(last, Some((Some(ch[15]), ch[16..].to_vec())), "one KvStored, chained on the prefix");

    // Activating b now: its suffix hashes were published by the probe, so nothing new.
    let n_before = d.count("KvStored");
    let r = d.core.activate_destination(hid(4), d.now_ns);
    assert_eq!(d.cmd(r, "activate b"), Ok(CommandOutcome::Applied));
    assert_eq!(d.count("KvStored"), n_before);
    let r = d.core.activate_destination(hid(4), d.now_ns);
    assert_eq!(d.cmd(r, "activate again"), Ok(CommandOutcome::NoOp));
    d.step_until(100, |d| d.core.is_drained());
    let stored = d.stored_hashes();
    for h in hashes.iter().chain(ch.iter()) {
        assert_eq!(stored.iter().filter(|x| *x == h).count(), 1, "each prompt hash published exactly once");
    }
}

#[test]
fn full_prefix_hit_reservation_has_no_pages_and_publishes_nothing() {
    let mut d = Harness::new(small(64, 64));
    d.run("warm", |c, now| c.submit(req(1, 1024, 2, &[1, 2]), now)).unwrap();
    d.step_until(20, |d| d.core.is_empty());
    let n = d.count("KvStored");
    let r = d.core.reserve_destination(hid(1), req(2, 1024, 4, &[1, 2]), u64::MAX, d.now_ns);
    assert_eq!(d.cmd(r, "reserve"), Ok(CommandOutcome::Applied));
    let summary = d.outputs.iter().find_map(|o| match o {
        EngineOutput::DestinationReserved { summary, .. } => Some(*summary),
        _ => None,
    });
    let s = summary.unwrap();
    assert_eq!((s.pages, s.prefix_blocks, s.prefix_tokens, s.missing_tokens), (0, 16, 1024, 0));
    d.run("activate", |c, now| c.activate_destination(hid(1), now)).unwrap();
    assert_eq!(d.count("KvStored"), n);
    d.step_until(20, |d| d.core.is_drained());
    assert_eq!(prefill_tokens(&d.log), 1024, "only the warm-up request computed a prompt");
}

/// A refused reservation is retried only when capacity changed, head first, never overtaken.
#[test]
fn unavailable_reservation_retries_only_on_capacity_change() {
    let mut d = Harness::new(small(64, 16));
    // Hold capacity with two pinned sources on this worker (32 + 30 blocks).
    for (i, (h, input)) in [(hid(1), 512u32), (hid(2), 480)].into_iter().enumerate() {
        let r =
            d.core.submit_handoff_prefill(h, req(10 + i as u64, input, 1, &[700 + i as u64]), LEASE_NS, 0);
        d.cmd(r, "pin").unwrap();
        d.step();
    }
    assert_eq!(d.core.snapshot().pinned_source_blocks, 62);

    let r = d.core.reserve_destination(hid(3), req(20, 256, 4, &[800]), u64::MAX, d.now_ns);
    assert_eq!(d.cmd(r, "reserve x"), Ok(CommandOutcome::Unavailable));
    assert_eq!(d.count("ReservationRefused"), 1);
    for _ in 0..5 {
        d.step();
    }
    assert_eq!(d.count("ReservationRefused"), 1, "no capacity change, no retry");
    // A second reservation queues behind the head without an attempt of its own.
    let r = d.core.reserve_destination(hid(4), req(21, 320, 4, &[801]), u64::MAX, d.now_ns);
    assert_eq!(d.cmd(r, "reserve y"), Ok(CommandOutcome::Unavailable));
    assert_eq!((d.count("ReservationRefused"), d.count("ReservationQueued")), (1, 2));
    // A command that frees nothing does not retry either (here one naming a handoff this core
    // never saw).
    let r = d.core.release_source(hid(99), EndReason::Success, d.now_ns);
    assert_eq!(d.cmd(r, "unknown"), Err(CommandError::UnknownHandoff(hid(99))));
    assert_eq!(d.count("ReservationRefused"), 1);

    // Capacity changes: x (16 blocks) fits, then y (20 blocks) tries once and is refused.
    d.run("release", |c, now| c.release_source(hid(2), EndReason::Success, now)).unwrap();
    assert_eq!(d.count("DestinationReserved"), 1);
    assert_eq!(d.count("ReservationRefused"), 2);
    assert_eq!(d.core.view().pending_reservations, 1);
    for _ in 0..5 {
        d.step();
    }
    assert_eq!(d.count("ReservationRefused"), 2);
    // Canceling x frees its 16 pages: y is retried and fits.
    d.run("cancel x", |c, now| c.cancel_destination(hid(3), CancelReason::RequestAborted, now)).unwrap();
    assert_eq!(d.count("DestinationReserved"), 2);
    assert_eq!(d.count("ReservationRefused"), 2);
    assert_eq!(d.core.view().pending_reservations, 0);
    // Each handoff is canceled in its own role (the other role never saw it).
    d.run("cleanup", |c, now| c.cancel_source(hid(1), CancelReason::Teardown, now)).unwrap();
    d.run("cleanup", |c, now| c.cancel_destination(hid(4), CancelReason::Teardown, now)).unwrap();
    assert!(d.core.is_drained());
}

/// Cancellation returns every block and slot exactly once in every state; repeats are no-ops.
#[test]
fn cancel_in_every_state_returns_everything_once() {
    let cfg = VllmConfig { max_num_batched_tokens: 256, ..small(64, 16) };
    let mut d = Harness::new(cfg);
    // Source queued.
    d.run("s1", |c, now| c.submit_handoff_prefill(hid(1), req(1, 300, 1, &[1]), LEASE_NS, now)).unwrap();
    assert_eq!(
        d.run("c1", |c, now| c.cancel_source(hid(1), CancelReason::RequestAborted, now)),
        Ok(CommandOutcome::Applied)
    );
    // Source computing (chunked: 600 tokens at 256 per step).
    d.run("s2", |c, now| c.submit_handoff_prefill(hid(2), req(2, 600, 1, &[2]), LEASE_NS, now)).unwrap();
    d.step();
    assert_eq!(d.core.view().running, 1);
    assert_eq!(
        d.run("c2", |c, now| c.cancel_source(hid(2), CancelReason::RequestAborted, now)),
        Ok(CommandOutcome::Applied)
    );
    assert_eq!(d.core.snapshot().active_blocks, 0);
    // Source pinned.
    d.run("s3", |c, now| c.submit_handoff_prefill(hid(3), req(3, 200, 1, &[3]), LEASE_NS, now)).unwrap();
    d.step();
    assert_eq!(d.core.view().held_prefills, 1);
    assert_eq!(
        d.run("c3", |c, now| c.cancel_source(hid(3), CancelReason::PeerLost, now)),
        Ok(CommandOutcome::Applied)
    );
    for h in [hid(1), hid(2), hid(3)] {
        assert_eq!(
            d.run("again", |c, now| c.cancel_source(h, CancelReason::Teardown, now)),
            Ok(CommandOutcome::NoOp)
        );
        assert_eq!(
            d.run("late", |c, now| c.release_source(h, EndReason::Expired, now)),
            Ok(CommandOutcome::NoOp)
        );
    }
    // Destination reserved, then pending behind it, then activated.
    d.run("r4", |c, now| c.reserve_destination(hid(4), req(4, 900, 5, &[4]), 0, now)).unwrap();
    let r = d.core.reserve_destination(hid(5), req(5, 900, 5, &[5]), 0, 0);
    assert_eq!(d.cmd(r, "r5"), Ok(CommandOutcome::Unavailable));
    assert_eq!(
        d.run("c5", |c, now| c.cancel_destination(hid(5), CancelReason::RequestAborted, now)),
        Ok(CommandOutcome::Applied)
    );
    assert_eq!(d.core.view().pending_reservations, 0);
    assert_eq!(
        d.run("c4", |c, now| c.cancel_destination(hid(4), CancelReason::RequestAborted, now)),
        Ok(CommandOutcome::Applied)
    );
    assert_eq!(d.core.snapshot().reserved_destination_blocks, 0);
    d.run("r6", |c, now| c.reserve_destination(hid(6), req(6, 100, 50, &[6]), 0, now)).unwrap();
    d.run("a6", |c, now| c.activate_destination(hid(6), now)).unwrap();
    d.step();
    assert_eq!(d.core.view().running, 1);
    assert_eq!(
        d.run("c6", |c, now| c.cancel_destination(hid(6), CancelReason::TransferFailed, now)),
        Ok(CommandOutcome::Applied)
    );
    for h in [hid(4), hid(5), hid(6)] {
        assert_eq!(
            d.run("again", |c, now| c.cancel_destination(h, CancelReason::Teardown, now)),
            Ok(CommandOutcome::NoOp)
        );
    }
    assert!(d.core.is_drained());
    let s = d.core.snapshot();
    assert_eq!(
        s.active_blocks + s.pinned_source_blocks + s.reserved_destination_blocks + s.request_slots_used,
        0
    );
    assert_eq!(s.cached_free_blocks + s.free_blocks, 64);
    // Exactly one end per pin and per reservation.
    assert_eq!(d.count("SourcePinned"), d.count("SourceReleased"));
    assert_eq!(
        d.count("DestinationReserved"),
        d.count("ReservationReleased") + d.count("DestinationActivated")
    );
    assert_eq!(d.count("ReservationQueued"), d.count("ReservationDequeued"));
}

#[test]
fn lifo_preemption_evicts_the_latest_scheduled_and_both_finish() {
    let mut d = Harness::new(small(16, 16));
    d.run("r1", |c, now| c.submit(req(1, 100, 100, &[1]), now)).unwrap();
    d.run("r2", |c, now| c.submit(req(2, 100, 100, &[2]), now)).unwrap();
    d.step();
    assert_eq!(d.core.view().running, 2);
    d.step_until(2000, |d| d.count("RequestPreempted") > 0);
    let first = d.log.iter().find_map(|f| match f {
        Fact::RequestPreempted { request, kv } => Some((*request, *kv)),
        _ => None,
    });
    let (victim, kv) = first.unwrap();
    assert_eq!(victim, RequestId(2), "the most recently scheduled request goes first");
    assert_eq!(kv.slots, -1);
    assert!(kv.active < 0);
    assert_eq!(d.core.view().waiting, 1);
    d.step_until(5000, |d| d.core.is_drained());
    let done: Vec<_> = d
        .log
        .iter()
        .filter_map(|f| match f {
            Fact::RequestFinished { request, status: TerminalStatus::Completed, output_tokens, .. } => {
                Some((*request, *output_tokens))
            }
            _ => None,
        })
        .collect();
    assert_eq!(done, vec![(RequestId(1), 100), (RequestId(2), 100)]);
    assert!(!d
        .log
        .iter()
        .any(|f| matches!(f, Fact::RequestPreempted { request, .. } if *request == RequestId(1))));
}

#[test]
fn prefix_reuse_hits_shared_blocks_and_always_computes_one_token() {
    let mut d = Harness::new(small(128, 64));
    d.run("a", |c, now| c.submit(req(1, 1024, 2, &[1, 2]), now)).unwrap();
    d.step_until(20, |d| d.core.is_empty());
    d.run("b", |c, now| c.submit(req(2, 1024, 2, &[1, 3]), now)).unwrap();
    d.run("c", |c, now| c.submit(req(3, 1024, 2, &[1, 2]), now)).unwrap();
    d.step_until(20, |d| d.core.is_empty());
    let cached: Vec<_> = d
        .log
        .iter()
        .filter_map(|f| match f {
            Fact::RequestScheduled { request, cached_tokens, .. } => Some((request.0, *cached_tokens)),
            _ => None,
        })
        .collect();
    assert_eq!(cached, vec![(1, 0), (2, 512), (3, 960)]);
    assert_eq!(prefill_tokens(&d.log), 1024 + 512 + 64);
}

#[test]
fn duplicate_hashes_keep_one_canonical_block() {
    let mut d = Harness::new(small(32, 16));
    d.run("a", |c, now| c.submit(req(1, 64, 3, &[7]), now)).unwrap();
    d.run("b", |c, now| c.submit(req(2, 64, 3, &[7]), now)).unwrap();
    d.step();
    // Both computed the same 4 blocks in one step; the second adopted the first's.
    assert_eq!(d.core.snapshot().active_blocks, 4);
    assert_eq!(d.stored_hashes().len(), 4);
    d.step_until(20, |d| d.core.is_drained());
}

/// The plain path (Disabled policy) emits exactly the facts of aggregated serving: no handoff
/// fact, and the step-by-step shape derived by hand for one small request.
#[test]
fn plain_submit_emits_only_aggregated_facts() {
    let mut d = Harness::new(small(8, 64));
    let r = d.core.submit(req(1, 100, 3, &[1]), 0);
    let names: Vec<_> = r.effects.facts.iter().map(|f| f.name()).collect();
    assert_eq!(names, ["RequestQueued"]);
    d.cmd(r, "submit").unwrap();
    let steps: Vec<Vec<&str>> =
        (0..4).map(|_| d.step().effects.facts.iter().map(|f| f.name()).collect()).collect();
    assert_eq!(
        steps,
        vec![
            vec!["RequestScheduled", "StepExecuted", "KvStored", "FirstTokenEmitted"],
            vec!["StepExecuted"],
            vec!["StepExecuted", "RequestFinished"],
            vec![],
        ]
    );
    assert!(!d.log.iter().any(handoff_fact));
    // Durations follow the timing model: 100 prefill tokens, then decodes at 2/8 blocks active.
    let t = PolynomialTiming::default();
    let durs: Vec<u64> = d
        .log
        .iter()
        .filter_map(|f| match f {
            Fact::StepExecuted { duration_ns, .. } => Some(*duration_ns),
            _ => None,
        })
        .collect();
    let dec = t.step_ns(&StepShape {
        prefill_tokens: 0,
        decode_requests: 1,
        active_kv_tokens: 128,
        total_kv_tokens: 512,
    });
    let pre = t.step_ns(&StepShape {
        prefill_tokens: 100,
        decode_requests: 0,
        active_kv_tokens: 128,
        total_kv_tokens: 512,
    });
    assert_eq!(durs, vec![pre, dec, dec]);
    let s = d.core.snapshot();
    assert_eq!((s.cached_free_blocks, s.free_blocks), (1, 7));
    assert_eq!(
        d.log.iter().find_map(|f| match f {
            Fact::RequestScheduled { kv, .. } => Some(*kv),
            _ => None,
        }),
        Some(KvDelta { free: -2, active: 2, slots: 1, ..KvDelta::ZERO })
    );
}

#[test]
fn never_fitting_prompts_are_rejected_at_submit() {
    let mut d = Harness::new(small(8, 64));
    let r = d.core.submit(req(1, 600, 1, &[1]), 0);
    assert_eq!(
        r.effects.outputs,
        vec![EngineOutput::Rejected { request: RequestId(1), reason: RejectReason::NeverFits }]
    );
    assert!(matches!(
        d.cmd(r, "submit"),
        Err(CommandError::NeverFits { needed_blocks: 10, total_blocks: 8, .. })
    ));
    let r = d.core.reserve_destination(hid(1), req(2, 600, 1, &[1]), 0, 0);
    assert!(matches!(d.cmd(r, "reserve"), Err(CommandError::NeverFits { .. })));
    assert!(d.core.is_drained());
}

#[test]
fn trtllm_refuses_destination_reservation() {
    let mut d = Harness::with_backend(small(64, 32), Backend::TrtLlm, WorkerId::decode(0));
    let r = d.core.reserve_destination(hid(1), req(1, 100, 5, &[1]), 0, 0);
    assert_eq!(
        d.cmd(r, "reserve"),
        Err(CommandError::Unsupported { backend: "trtllm", what: "destination reservation" })
    );
    assert!(d.core.is_drained());
    // Its plain and source paths work.
    d.run("src", |c, now| c.submit_handoff_prefill(hid(2), req(2, 100, 5, &[2]), LEASE_NS, now)).unwrap();
    d.step();
    assert_eq!(d.core.view().held_prefills, 1);
}

#[test]
fn activation_of_a_single_token_request_finishes_after_one_decode_step() {
    let mut d = Harness::new(small(64, 16));
    d.run("r", |c, now| c.reserve_destination(hid(1), req(1, 100, 1, &[1]), 0, now)).unwrap();
    d.run("a", |c, now| c.activate_destination(hid(1), now)).unwrap();
    assert!(!d.core.is_drained(), "the one output token is produced by decode");
    d.step();
    assert!(d.core.is_drained());
    assert_eq!(d.count("FirstTokenEmitted"), 1);
    assert_eq!(d.count("RequestFinished"), 1);
    assert_eq!(prefill_tokens(&d.log), 0, "the last prompt token's recompute is decode work");
    // The handoff ended here: a late activation is a no-op.
    assert_eq!(d.core.activate_destination(hid(1), 0).outcome, Ok(CommandOutcome::NoOp));
}

/// Liveness: activated destinations holding nearly the whole pool while waiting must not
/// deadlock the head of the queue (each needs one more block as it decodes). Reservations leave
/// one block per admitted request, so a third one waits.
#[test]
fn waiting_requests_holding_all_kv_still_drain() {
    let mut d = Harness::new(small(9, 16));
    for i in 0..2u64 {
        let h = hid(i as u128);
        d.run("reserve", |c, now| c.reserve_destination(h, req(i, 64, 10, &[50 + i]), 0, now)).unwrap();
        d.run("activate", |c, now| c.activate_destination(h, now)).unwrap();
    }
    let s = d.core.snapshot();
    assert_eq!((s.active_blocks, s.free_blocks + s.cached_free_blocks), (8, 1));
    assert_eq!(d.core.view().waiting, 2);
    let r = d.core.reserve_destination(hid(9), req(9, 16, 10, &[59]), 0, d.now_ns);
    assert_eq!(d.cmd(r, "third"), Ok(CommandOutcome::Unavailable), "the last block is kept for growth");
    let r = d.core.cancel_destination(hid(9), CancelReason::RequestAborted, d.now_ns);
    assert_eq!(d.cmd(r, "cancel third"), Ok(CommandOutcome::Applied));
    d.step_until(200, |d| d.core.is_drained());
    assert_eq!(d.count("RequestFinished"), 2);
    assert!(d.count("RequestPreempted") >= 1, "the forced admission was preempted to free KV");
}

#[test]
fn chunked_prefill_splits_by_budget_and_first_token_comes_with_the_last_chunk() {
    let cfg = VllmConfig { max_num_batched_tokens: 256, ..small(128, 16) };
    let mut d = Harness::new(cfg);
    d.run("submit", |c, now| c.submit(req(1, 1000, 3, &[1, 2]), now)).unwrap();
    let mut chunks = Vec::new();
    let mut first_at = None;
    for i in 0..6 {
        let out = d.step();
        for f in &out.effects.facts {
            match f {
                Fact::StepExecuted { prefill_tokens, .. } if *prefill_tokens > 0 => {
                    chunks.push(*prefill_tokens)
                }
                Fact::FirstTokenEmitted { .. } => first_at = Some(i),
                _ => {}
            }
        }
    }
    assert_eq!(chunks, vec![256, 256, 256, 232]);
    assert_eq!(first_at, Some(3));
    // Without chunking the whole prompt runs in one (over-budget) step.
    let cfg = VllmConfig { max_num_batched_tokens: 256, enable_chunked_prefill: false, ..small(128, 16) };
    let mut d = Harness::new(cfg);
    d.run("submit", |c, now| c.submit(req(1, 1000, 3, &[1, 2]), now)).unwrap();
    let out = d.step();
    assert!(out.effects.facts.iter().any(|f| matches!(f, Fact::StepExecuted { prefill_tokens: 1000, .. })));
}

#[test]
fn decode_grown_blocks_are_hashed_published_and_cached() {
    use handoff_ledger::schedulers::request::decode_block_hash;
    let mut d = Harness::new(small(32, 16));
    let r = req(7, 64, 40, &[3]);
    let prompt = r.prompt_block_hashes(16);
    d.run("submit", |c, now| c.submit(r.clone(), now)).unwrap();
    d.step_until(100, |d| d.core.is_drained());
    // KV holds 64 + 39 tokens: 6 full blocks (4 prompt + 2 decode) and one partial.
    let mut expected = prompt.clone();
    for b in 4..6u32 {
        let parent = expected[b as usize - 1];
        expected.push(decode_block_hash(parent, RequestId(7), b));
    }
    assert_eq!(d.stored_hashes(), expected);
    let s = d.core.snapshot();
    assert_eq!((s.cached_free_blocks, s.free_blocks), (6, 26));
}
