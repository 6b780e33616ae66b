//! Two SGLang cores wired destination-first by a minimal driver: reserve on the decode core,
//! dispatch the prefill only once reserved, activate on pin, then release the source. Checks
//! the folds of both streams after every call and that both workers drain without leaks.

mod support;

use handoff_ledger::events::Fact;
use handoff_ledger::ids::EndReason;
use handoff_ledger::schedulers::sglang::SglangConfig;
use handoff_ledger::schedulers::{CommandOutcome, EngineCore, EngineOutput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use support::sglang::*;

fn run(seed: u64) {
    eprintln!("seed {seed}");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let cfg = SglangConfig {
        total_pages: 2048,
        page_size: 16,
        max_running_requests: 32,
        ..SglangConfig::default()
    };
    let mut pre = Checked::new(cfg.clone());
    let mut dec = Checked::new(SglangConfig { total_pages: 1024, ..cfg });
    let n = 150u64;
    let reqs: BTreeMap<u64, _> = (0..n)
        .map(|i| {
            let input = rng.random_range(1..1500);
            let output = rng.random_range(1..120);
            let family = rng.random_range(0..4);
            (i, req(i, input, output, family, rng.random_range(0..20)))
        })
        .collect();
    let mut now = 0u64;
    let mut next = 0u64;
    let mut dispatched_before_reserved = 0;
    for _ in 0..200_000 {
        // One arrival per loop turn until all have arrived.
        if next < n {
            let r = reqs[&next].clone();
            let out = dec.cmd(|k| k.reserve_destination(hid(next), r, now + 1_000_000_000, now));
            assert!(matches!(out.outcome, Ok(CommandOutcome::Applied | CommandOutcome::Unavailable)));
            next += 1;
            route(&mut pre, &mut dec, &reqs, out.effects.outputs, now, &mut dispatched_before_reserved);
        }
        let p = pre.step(now);
        route(&mut pre, &mut dec, &reqs, p.effects.outputs, now, &mut dispatched_before_reserved);
        let d = dec.step(now);
        route(&mut pre, &mut dec, &reqs, d.effects.outputs, now, &mut dispatched_before_reserved);
        now += p.duration_ns.max(d.duration_ns).max(1_000);
        if next == n && pre.core.is_drained() && dec.core.is_drained() {
            break;
        }
    }
    assert!(
        pre.core.is_drained() && dec.core.is_drained(),
        "stuck: prefill {:?} decode {:?}",
        pre.core.view(),
        dec.core.view()
    );
    assert_eq!(dispatched_before_reserved, 0);
    for c in [&pre, &dec] {
        let s = c.core.snapshot();
        assert_eq!(s.kv_used_blocks() + s.request_slots_used + s.decode_headroom_tokens, 0, "leak {s:?}");
    }
    let completed = dec.facts.iter().filter(|f| matches!(f, Fact::RequestFinished { .. })).count();
    assert_eq!(completed as u64, n);
    let pins = pre.facts.iter().filter(|f| matches!(f, Fact::SourcePinned { .. })).count();
    assert_eq!(pins as u64, n);
    let reused: u32 = dec
        .facts
        .iter()
        .filter_map(|f| match f {
            Fact::DestinationReserved { prefix_blocks, .. } => Some(*prefix_blocks),
            _ => None,
        })
        .sum();
    assert!(reused > 0, "shared prefixes should hit the decode radix cache");
}

fn route(
    pre: &mut Checked,
    dec: &mut Checked,
    reqs: &BTreeMap<u64, handoff_ledger::schedulers::Request>,
    outputs: Vec<EngineOutput>,
    now: u64,
    bad: &mut u32,
) {
    for o in outputs {
        match o {
            EngineOutput::DestinationReserved { handoff, .. } => {
                let id = handoff.0.as_u128() as u64 - 1;
                let r = reqs[&id].clone();
                let out = pre.cmd(|k| k.submit_handoff_prefill(handoff, r, 5_000_000_000, now));
                assert_eq!(out.outcome, Ok(CommandOutcome::Applied));
            }
            EngineOutput::SourcePinned { handoff, .. } => {
                if dec.core.view().waiting_for_remote_kv == 0 {
                    *bad += 1;
                }
                let a = dec.cmd(|k| k.activate_destination(handoff, now));
                assert_eq!(a.outcome, Ok(CommandOutcome::Applied));
                let out = pre.cmd(|k| k.release_source(handoff, EndReason::Success, now));
                assert_eq!(out.outcome, Ok(CommandOutcome::Applied));
                route(pre, dec, reqs, out.effects.outputs, now, bad);
                route(pre, dec, reqs, a.effects.outputs, now, bad);
            }
            _ => {}
        }
    }
}

#[test]
fn destination_first_pipeline_drains_without_leaks() {
    for seed in [1, 2, 3] {
        run(seed);
    }
}
