//! Property: on random prefill histories, the stall `inspect` reports (start and end of the
//! first one) is exactly the one a brute-force scan of the definition finds: the earliest
//! instant at which pinned blocks are ≥ the threshold share AND some request has waited
//! unscheduled for ≥ `stall_ms`, judged on settled states (all records of an instant applied),
//! ending where that stops holding unless it holds again within `stall_ms`.

mod support;

use handoff_ledger::events::{EngineShape, Fact, KvDelta, Record, StreamHeader};
use handoff_ledger::ids::*;
use handoff_ledger::projections::inspect::{InspectFold, InspectOptions};
use proptest::prelude::*;
use std::collections::BTreeMap;
use support::NS_PER_MS as MS;

const TOTAL: i32 = 10;
const STALL_MS: u64 = 5;

#[derive(Clone, Copy, Debug)]
enum Op {
    Queue,
    Schedule,
    Pin,
    Release,
}

fn op() -> impl Strategy<Value = (u64, Op)> {
    (0u64..4, prop_oneof![Just(Op::Queue), Just(Op::Schedule), Just(Op::Pin), Just(Op::Release)])
}

fn header() -> StreamHeader {
    StreamHeader {
        run_id: uuid::Uuid::from_u128(1),
        worker: WorkerId::prefill(0),
        backend: Backend::Vllm,
        policy: HandoffPolicy::SourceFirst,
        clock: ClockDomain::Virtual,
        seed: 0,
        engine: EngineShape {
            total_blocks: TOTAL as u32,
            block_size: 16,
            max_request_slots: 64,
            config_json: String::new(),
        },
    }
}

/// Turns random ops into a valid prefill stream (ops that cannot apply are skipped): each
/// request takes 1 block when scheduled, keeps it pinned, and frees it when released.
fn records(ops: &[(u64, Op)]) -> Vec<Record> {
    let z = KvDelta::ZERO;
    let mut out = Vec::new();
    let mut t = 0u64;
    let mut next_req = 0u64;
    let mut waiting: Vec<u64> = Vec::new();
    let mut running: Vec<u64> = Vec::new();
    let mut pinned: Vec<u64> = Vec::new();
    let mut used = 0;
    for (dt, op) in ops {
        t += dt;
        let mut push = |fact| out.push(Record { seq: out.len() as u64, at_ns: t * MS, fact });
        match op {
            Op::Queue => {
                push(Fact::RequestQueued { request: RequestId(next_req) });
                waiting.push(next_req);
                next_req += 1;
            }
            Op::Schedule if !waiting.is_empty() && used < TOTAL => {
                let r = waiting.remove(0);
                used += 1;
                running.push(r);
                push(Fact::RequestScheduled {
                    request: RequestId(r),
                    cached_tokens: 0,
                    kv: KvDelta { free: -1, active: 1, slots: 1, ..z },
                });
            }
            Op::Pin if !running.is_empty() => {
                let r = running.remove(0);
                pinned.push(r);
                push(Fact::SourcePinned {
                    handoff: HandoffId(uuid::Uuid::from_u128(r as u128 + 1)),
                    request: RequestId(r),
                    lease: SourceLeaseId(r),
                    blocks: 1,
                    deadline_ns: u64::MAX,
                    kv: KvDelta { active: -1, pinned_source: 1, slots: -1, ..z },
                });
            }
            Op::Release if !pinned.is_empty() => {
                let r = pinned.remove(0);
                used -= 1;
                push(Fact::SourceReleased {
                    handoff: HandoffId(uuid::Uuid::from_u128(r as u128 + 1)),
                    lease: SourceLeaseId(r),
                    reason: EndReason::Success,
                    kv: KvDelta { pinned_source: -1, free: 1, ..z },
                });
            }
            _ => {}
        }
    }
    out
}

/// The first stall by brute force: (start, end) in ns, end `None` if it lasts to the end.
fn brute_force(recs: &[Record], pin_pct: u64) -> Option<(u64, Option<u64>)> {
    let end = recs.last()?.at_ns;
    // Settled state after each instant: (instant, pinned, waiting queued-at times).
    let mut states: Vec<(u64, u64, Vec<u64>)> = Vec::new();
    let mut pinned = 0u64;
    let mut waiting: BTreeMap<u64, u64> = BTreeMap::new();
    for (i, r) in recs.iter().enumerate() {
        match &r.fact {
            Fact::RequestQueued { request } => {
                waiting.insert(request.0, r.at_ns);
            }
            Fact::RequestScheduled { request, .. } => {
                waiting.remove(&request.0);
            }
            Fact::SourcePinned { .. } => pinned += 1,
            Fact::SourceReleased { .. } => pinned -= 1,
            _ => {}
        }
        if recs.get(i + 1).map_or(true, |n| n.at_ns > r.at_ns) {
            states.push((r.at_ns, pinned, waiting.values().copied().collect()));
        }
    }
    let state_at = |c: u64| states.iter().rev().find(|s| s.0 <= c);
    let holds = |c: u64| {
        state_at(c).is_some_and(|(_, p, w)| {
            p * 100 >= pin_pct * TOTAL as u64 && w.iter().any(|q| q + STALL_MS * MS <= c)
        })
    };
    // Candidate instants: every settled instant and every wait-threshold crossing.
    let mut cands: Vec<u64> = states.iter().map(|s| s.0).collect();
    for (_, _, w) in &states {
        cands.extend(w.iter().map(|q| q + STALL_MS * MS));
    }
    cands.retain(|c| *c <= end);
    cands.sort();
    cands.dedup();
    let start = *cands.iter().find(|c| holds(**c))?;
    // It ends where the condition fails, unless it holds again within `stall_ms`.
    let mut from = start;
    loop {
        let Some(stop) = states.iter().map(|s| s.0).find(|c| *c > from && !holds(*c)) else {
            return Some((start, None));
        };
        match cands.iter().find(|c| **c > stop && holds(**c)) {
            Some(again) if again - stop < STALL_MS * MS => from = *again,
            _ => return Some((start, Some(stop))),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
    #[test]
    fn first_stall_matches_a_brute_force_scan(
        ops in proptest::collection::vec(op(), 1..120),
        pin_pct in prop_oneof![Just(30u32), Just(50), Just(80)],
    ) {
        let recs = records(&ops);
        prop_assume!(!recs.is_empty());
        let opts = InspectOptions {
            top_n: 0,
            pin_threshold_pct: pin_pct,
            stall_ms: STALL_MS,
            decode_full_pct: 95,
            ..InspectOptions::default()
        };
        let mut fold = InspectFold::new(&[header()], opts);
        for r in &recs {
            fold.apply(0, r).unwrap();
        }
        let (report, _) = fold.finish();
        let got = report.cascade.map(|c| {
            let i = &c.intervals[0];
            (
                (i.started_at_ms * 1e6).round() as u64,
                i.ended_at_ms.map(|e| (e * 1e6).round() as u64),
            )
        });
        prop_assert_eq!(got, brute_force(&recs, pin_pct as u64));
    }
}
