//! Property tests: random interleavings of submits, handoff commands (valid and bogus ids),
//! cancels and steps. After every call the folds of the emitted facts must equal the core's
//! snapshot, audit and view (checked inside `Checked`); at the end every reservation and pin
//! must have ended exactly once and nothing may leak.

mod support;

use handoff_ledger::events::Fact;
use handoff_ledger::ids::{CancelReason, EndReason, HandoffId};
use handoff_ledger::schedulers::{CommandError, Effects, EngineCore};
use proptest::prelude::*;
use std::collections::BTreeMap;
use support::sglang::*;

#[derive(Clone, Debug)]
enum Op {
    Submit {
        input: u32,
        output: u32,
        family: u64,
        shared: u32,
    },
    /// The Disabled policy's decode: the prompt's KV arrives with the request.
    Prefilled {
        input: u32,
        output: u32,
        family: u64,
        shared: u32,
    },
    Prefill {
        input: u32,
        family: u64,
        shared: u32,
    },
    Reserve {
        input: u32,
        output: u32,
        family: u64,
        shared: u32,
    },
    Activate(usize),
    Release(usize),
    CancelSource(usize),
    CancelDest(usize),
    Step,
    Step4,
}

fn op() -> impl Strategy<Value = Op> {
    let shape = || (prop_oneof![9 => 0u32..300, 1 => 600u32..900], 0u32..50, 0u64..3, 0u32..8);
    prop_oneof![
        3 => shape().prop_map(|(input, output, family, shared)| Op::Submit { input, output, family, shared }),
        1 => shape().prop_map(|(input, output, family, shared)| Op::Prefilled { input, output, family, shared }),
        2 => shape().prop_map(|(input, _, family, shared)| Op::Prefill { input, family, shared }),
        3 => shape().prop_map(|(input, output, family, shared)| Op::Reserve { input, output, family, shared }),
        2 => (0usize..24).prop_map(Op::Activate),
        2 => (0usize..24).prop_map(Op::Release),
        1 => (0usize..24).prop_map(Op::CancelSource),
        1 => (0usize..24).prop_map(Op::CancelDest),
        5 => Just(Op::Step),
        2 => Just(Op::Step4),
    ]
}

/// Picks a known handoff, or a bogus one when the index runs past the list.
fn pick(list: &[HandoffId], i: usize) -> HandoffId {
    list.get(i).copied().unwrap_or(hid(9_999_000 + i as u64))
}

/// How a `Step` op steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stepping {
    /// One step.
    One,
    /// When the core promises quiet steps, that many `step()` calls, each checked against the
    /// promise; otherwise one step.
    QuietOneByOne,
    /// When the core promises quiet steps, one `advance_quiet` and the promised facts;
    /// otherwise one step.
    QuietAtOnce,
}

fn step_op(c: &mut Checked, now: &mut u64, stepping: Stepping, quiet: &mut u64) {
    match (stepping, c.core.quiet_steps()) {
        (Stepping::One, _) | (_, None) => {
            let d = c.step(*now).duration_ns;
            *now += d;
        }
        (Stepping::QuietOneByOne, Some(q)) => {
            *quiet += q.steps;
            for k in 0..q.steps {
                let out = c.step(*now);
                assert_eq!(
                    (out.effects.facts.as_slice(), out.effects.outputs.len(), out.duration_ns),
                    (std::slice::from_ref(&q.fact(k)), 0, q.duration_ns(k)),
                    "quiet step {k} of {q:?} broke the promise"
                );
                *now += out.duration_ns;
            }
        }
        (Stepping::QuietAtOnce, Some(q)) => {
            *quiet += q.steps;
            c.core.advance_quiet(q.steps);
            let facts = (0..q.steps).map(|k| q.fact(k)).collect();
            c.absorb(&Effects { facts, outputs: Vec::new() });
            *now += (0..q.steps).map(|k| q.duration_ns(k)).sum::<u64>();
        }
    }
}

fn run(ops: &[Op]) -> Checked {
    run_stepping(ops, Stepping::One).0
}

/// Like `run`; also returns how many steps were promised quiet.
fn run_stepping(ops: &[Op], stepping: Stepping) -> (Checked, u64) {
    let mut quiet = 0;
    let mut c = Checked::new(small_config());
    let mut now = 0u64;
    let mut next_id = 0u64;
    let (mut srcs, mut dsts) = (Vec::new(), Vec::new());
    for op in ops {
        now += 1_000;
        match *op {
            Op::Submit { input, output, family, shared } => {
                next_id += 1;
                c.cmd(|k| k.submit(req(next_id, input, output, family, shared), now));
            }
            Op::Prefilled { input, output, family, shared } => {
                next_id += 1;
                c.cmd(|k| k.submit_prefilled(req(next_id, input, output, family, shared), now));
            }
            Op::Prefill { input, family, shared } => {
                next_id += 1;
                let h = hid(next_id);
                c.cmd(|k| k.submit_handoff_prefill(h, req(next_id, input, 1, family, shared), 5_000, now));
                srcs.push(h);
            }
            Op::Reserve { input, output, family, shared } => {
                next_id += 1;
                let h = hid(next_id);
                c.cmd(|k| {
                    k.reserve_destination(h, req(next_id, input, output, family, shared), now + 9, now)
                });
                dsts.push(h);
            }
            Op::Activate(i) => {
                let r = c.cmd(|k| k.activate_destination(pick(&dsts, i), now));
                if i >= dsts.len() {
                    assert!(matches!(r.outcome, Err(CommandError::UnknownHandoff(_))));
                }
            }
            Op::Release(i) => {
                let r = c.cmd(|k| k.release_source(pick(&srcs, i), EndReason::Success, now));
                if i >= srcs.len() {
                    assert!(matches!(r.outcome, Err(CommandError::UnknownHandoff(_))));
                }
            }
            Op::CancelSource(i) => {
                c.cmd(|k| k.cancel_source(pick(&srcs, i), CancelReason::RequestAborted, now));
            }
            Op::CancelDest(i) => {
                c.cmd(|k| k.cancel_destination(pick(&dsts, i), CancelReason::TransferFailed, now));
            }
            Op::Step => step_op(&mut c, &mut now, stepping, &mut quiet),
            Op::Step4 => {
                for _ in 0..4 {
                    step_op(&mut c, &mut now, stepping, &mut quiet);
                }
            }
        }
    }
    // Teardown: end every handoff, then run until drained.
    for &h in &srcs {
        let r = c.cmd(|k| k.release_source(h, EndReason::Success, now));
        if r.outcome.is_err() {
            c.cmd(|k| k.cancel_source(h, CancelReason::Teardown, now));
        }
    }
    for (i, &h) in dsts.iter().enumerate() {
        // Activate half of what is reserved so activated requests also run to completion.
        if i % 2 == 0 {
            c.cmd(|k| k.activate_destination(h, now));
        }
    }
    for &h in &dsts {
        let r = c.cmd(|k| k.activate_destination(h, now));
        let _ = r;
        c.cmd(|k| k.cancel_destination(h, CancelReason::Teardown, now));
    }
    let mut steps = 0;
    while !c.core.is_drained() {
        let d = c.step(now).duration_ns;
        now += d.max(1);
        steps += 1;
        assert!(steps < 20_000, "did not drain: view {:?}", c.core.view());
    }
    (c, quiet)
}

fn check_end(c: &Checked) {
    let s = c.core.snapshot();
    assert_eq!(s.active_blocks + s.pinned_source_blocks + s.reserved_destination_blocks, 0, "leak: {s:?}");
    assert_eq!(s.request_slots_used, 0, "slot leak: {s:?}");
    assert_eq!(s.decode_headroom_tokens, 0, "headroom leak: {s:?}");
    assert_eq!(s.cached_free_blocks + s.free_blocks, s.total_blocks);
    assert_eq!(c.core.view(), Default::default());
    assert!(c.core.is_empty());
    // Every reservation and pin ended exactly once.
    for (h, n) in c.handoff_counts() {
        let get = |k: &str| n.get(k).copied().unwrap_or(0);
        assert!(get("SourcePinned") <= 1, "{h}: pinned twice {n:?}");
        assert_eq!(get("SourcePinned"), get("SourceReleased"), "{h}: pin not ended once {n:?}");
        assert!(get("DestinationReserved") <= 1, "{h}: reserved twice {n:?}");
        assert_eq!(
            get("DestinationReserved"),
            get("DestinationActivated") + get("ReservationReleased"),
            "{h}: reservation not ended once {n:?}"
        );
        assert!(get("ReservationQueued") <= 1);
        if get("ReservationQueued") == 1 {
            assert_eq!(get("DestinationReserved") + get("ReservationDequeued"), 1, "{h}: queue exit {n:?}");
        }
    }
    // Every request that was queued or activated reached exactly one terminal fact, except
    // handoff prefills, which end at their pin.
    let mut ends: BTreeMap<u64, u32> = BTreeMap::new();
    for f in &c.facts {
        if let Fact::RequestFinished { request, .. } = f {
            *ends.entry(request.0).or_default() += 1;
        }
    }
    assert!(ends.values().all(|&n| n == 1), "a request finished twice");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 160, max_shrink_iters: 2000, ..ProptestConfig::default() })]

    #[test]
    fn folds_match_core_after_every_call(ops in proptest::collection::vec(op(), 1..120)) {
        let c = run(&ops);
        check_end(&c);
        let d = c.total_delta();
        prop_assert_eq!(d.active + d.pinned_source + d.reserved_destination, 0);
    }

    /// Quiet steps hold their promise one by one (each writes exactly the promised fact, no
    /// output, the promised duration), and applying them at once leaves a core that behaves
    /// identically under every later call.
    #[test]
    fn quiet_steps_at_once_equal_step_by_step(ops in proptest::collection::vec(op(), 1..120)) {
        let (one_by_one, q1) = run_stepping(&ops, Stepping::QuietOneByOne);
        let (at_once, q2) = run_stepping(&ops, Stepping::QuietAtOnce);
        prop_assert_eq!(q1, q2);
        prop_assert_eq!(&one_by_one.facts, &at_once.facts);
        prop_assert_eq!(one_by_one.core.new_token_ratio(), at_once.core.new_token_ratio());
        check_end(&at_once);
    }

    #[test]
    fn same_inputs_give_identical_facts(ops in proptest::collection::vec(op(), 1..60)) {
        let a = run(&ops);
        let b = run(&ops);
        prop_assert_eq!(a.facts, b.facts);
    }
}

/// Guards the generator: random runs must reach every interesting path, or the property
/// above proves little. Deterministic runner (seeded by proptest's fixed deterministic seed).
#[test]
fn random_runs_exercise_every_path() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let mut tot: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut pinned_partial = 0;
    for _ in 0..100 {
        let ops = proptest::collection::vec(op(), 1..120).new_tree(&mut runner).unwrap().current();
        let c = run(&ops);
        for f in &c.facts {
            *tot.entry(f.name()).or_default() += 1;
            if let Fact::SourcePinned { kv, .. } = f {
                pinned_partial += (kv.pinned_source > 0) as u32;
            }
        }
    }
    eprintln!("fact counts over 100 deterministic runs: {tot:#?}");
    for name in [
        "DestinationReserved",
        "DestinationActivated",
        "ReservationRefused",
        "ReservationDequeued",
        "ReservationReleased",
        "RequestPreempted",
        "RequestRejected",
        "SourcePinned",
        "KvRemoved",
    ] {
        assert!(tot.get(name).copied().unwrap_or(0) > 0, "no {name} in any run");
    }
    assert!(pinned_partial > 0, "no pin ever moved a page to pinned_source");
}
