//! Test support for diff / at / index: a generator of self-consistent disaggregated runs, and a
//! rewriter that copies a run with one record changed or dropped.
//!
//! Also used by `benches/fold.rs` (with `#[path]`). That generated runs are sound (they verify,
//! fold without contradictions, and drain) is checked in `tests/diff_lib.rs`.

use handoff_ledger::events::{
    EngineShape, Fact, KvDelta, Record, RunReader, RunWriter, StreamHeader, TerminalStatus,
};
use handoff_ledger::ids::{
    Backend, ClockDomain, DestinationReservationId, EndReason, HandoffPolicy, IdMint, KvHandoffDemand,
    RequestId, SourceLeaseId, WorkerId,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::path::Path;

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenConfig {
    pub requests: u64,
    pub prefill_workers: u32,
    pub decode_workers: u32,
    /// SourceFirst (vLLM order) or DestinationFirst (SGLang order).
    pub policy: HandoffPolicy,
    /// Arrivals, sizes, routing, durations.
    pub workload_seed: u64,
    /// HandoffIds (a live run and a replay with another seed differ only here).
    pub id_seed: u64,
    /// Multiplies every instant (1.0: as generated). Order is preserved exactly.
    pub time_scale: f64,
    /// Decode steps per request (more records per request).
    pub decode_steps: u32,
    pub total_blocks: u32,
}

impl Default for GenConfig {
    fn default() -> Self {
        GenConfig {
            requests: 40,
            prefill_workers: 2,
            decode_workers: 2,
            policy: HandoffPolicy::SourceFirst,
            workload_seed: 7,
            id_seed: 11,
            time_scale: 1.0,
            decode_steps: 3,
            total_blocks: 4096,
        }
    }
}

pub fn header(cfg: &GenConfig, worker: WorkerId) -> StreamHeader {
    let engine = if worker == WorkerId::ROUTER {
        EngineShape::none()
    } else {
        EngineShape {
            total_blocks: cfg.total_blocks,
            block_size: 64,
            max_request_slots: 256,
            config_json: "{}".into(),
        }
    };
    StreamHeader {
        run_id: uuid::Uuid::from_u128(0xd1ff ^ cfg.id_seed as u128),
        worker,
        backend: match cfg.policy {
            HandoffPolicy::DestinationFirst => Backend::Sglang,
            _ => Backend::Vllm,
        },
        policy: cfg.policy,
        clock: ClockDomain::Virtual,
        seed: cfg.id_seed,
        engine,
    }
}

pub fn workers(cfg: &GenConfig) -> Vec<WorkerId> {
    let mut w: Vec<WorkerId> = (0..cfg.prefill_workers).map(WorkerId::prefill).collect();
    w.extend((0..cfg.decode_workers).map(WorkerId::decode));
    w.push(WorkerId::ROUTER);
    w
}

struct Req {
    id: RequestId,
    handoff: handoff_ledger::ids::HandoffId,
    p: WorkerId,
    d: WorkerId,
    input: u32,
    output: u32,
    blocks: u32,
    grown: u32,
    steps_left: u32,
    first_token: bool,
    lease: SourceLeaseId,
    reservation: DestinationReservationId,
}

/// Per-worker physical state, to emit deltas that conserve blocks.
#[derive(Clone, Copy, Default)]
struct Cap {
    free: i64,
    cached: i64,
}

/// Writes a run to `dir`; returns the number of records written.
pub fn generate(dir: &Path, cfg: &GenConfig) -> u64 {
    let mut w = RunWriter::create(dir, workers(cfg).into_iter().map(|x| header(cfg, x))).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.workload_seed);
    let mut mint = IdMint::from_seed(cfg.id_seed);
    let mut caps: HashMap<WorkerId, Cap> =
        workers(cfg).into_iter().map(|x| (x, Cap { free: cfg.total_blocks as i64, cached: 0 })).collect();
    // (base time in µs, tie-breaker, request index, stage)
    let mut heap: BinaryHeap<Reverse<(u64, u64, u64, u8)>> = BinaryHeap::new();
    let mut reqs: HashMap<u64, Req> = HashMap::new();
    let mut tie = 0u64;
    let mut records = 0u64;
    let scale = cfg.time_scale;
    let at = |us: u64| ((us * 1000) as f64 * scale).round() as u64;
    if cfg.requests > 0 {
        heap.push(Reverse((1_000, 0, 0, 0)));
    }
    let z = KvDelta::ZERO;
    let df = cfg.policy == HandoffPolicy::DestinationFirst;
    let mut lease_no = 0u64;
    while let Some(Reverse((t, _, i, stage))) = heap.pop() {
        let now = at(t);
        let mut push_for = |heap: &mut BinaryHeap<_>, dt: u64, idx: u64, st: u8| {
            tie += 1;
            heap.push(Reverse((t + dt, tie, idx, st)));
        };
        let mut emit = |worker: WorkerId, f: Fact| {
            w.append(worker, now, &f).unwrap();
            records += 1;
        };
        let r = WorkerId::ROUTER;
        match stage {
            // Arrival.
            0 => {
                if i + 1 < cfg.requests {
                    let gap = rng.random_range(50..2_000u64);
                    push_for(&mut heap, gap, i + 1, 0);
                }
                let input = rng.random_range(16..600u32);
                let output = rng.random_range(2..40u32);
                lease_no += 1;
                let q = Req {
                    id: RequestId(i),
                    handoff: mint.handoff_id(),
                    p: WorkerId::prefill(rng.random_range(0..cfg.prefill_workers)),
                    d: WorkerId::decode(rng.random_range(0..cfg.decode_workers)),
                    input,
                    output,
                    blocks: input.div_ceil(64),
                    grown: 0,
                    steps_left: cfg.decode_steps,
                    first_token: false,
                    lease: SourceLeaseId(lease_no),
                    reservation: DestinationReservationId(lease_no),
                };
                emit(r, Fact::RequestArrived { request: q.id, input_tokens: input, output_tokens: output });
                let demand = KvHandoffDemand { context_tokens: input, max_output_tokens: output };
                if df {
                    emit(r, Fact::DecodeBooked { request: q.id, worker: q.d, blocks: q.blocks + 1 });
                    emit(r, Fact::DestinationRouted { handoff: q.handoff, worker: q.d });
                    emit(
                        q.d,
                        Fact::HandoffStarted {
                            handoff: q.handoff,
                            request: q.id,
                            policy: cfg.policy,
                            demand,
                        },
                    );
                    reserve(&mut caps, &mut emit, &q);
                }
                emit(
                    r,
                    Fact::PrefillBooked {
                        request: q.id,
                        worker: q.p,
                        prefill_tokens: input,
                        blocks: q.blocks,
                    },
                );
                emit(
                    q.p,
                    Fact::HandoffStarted { handoff: q.handoff, request: q.id, policy: cfg.policy, demand },
                );
                emit(q.p, Fact::PrefillDispatched { handoff: q.handoff });
                emit(q.p, Fact::RequestQueued { request: q.id });
                reqs.insert(i, q);
                push_for(&mut heap, rng.random_range(10..500u64), i, 1);
            }
            // Prefill scheduled.
            1 => {
                let q = &reqs[&i];
                let c = caps.get_mut(&q.p).unwrap();
                let n = q.blocks as i64;
                let from_free = n.min(c.free);
                let from_cached = n - from_free;
                assert!(from_cached <= c.cached, "generator: prefill out of blocks");
                c.free -= from_free;
                c.cached -= from_cached;
                emit(
                    q.p,
                    Fact::RequestScheduled {
                        request: q.id,
                        cached_tokens: 0,
                        kv: KvDelta {
                            active: n as i32,
                            free: -from_free as i32,
                            cached_free: -from_cached as i32,
                            slots: 1,
                            ..z
                        },
                    },
                );
                emit(
                    q.p,
                    Fact::StepExecuted {
                        prefill_tokens: q.input,
                        decode_tokens: 0,
                        batch_size: 1,
                        duration_ns: 1_000_000,
                        kv: z,
                    },
                );
                push_for(&mut heap, rng.random_range(200..3_000u64), i, 2);
            }
            // Prefill done: pin; source-first routes and reserves now.
            2 => {
                let q = &reqs[&i];
                emit(q.p, Fact::FirstTokenEmitted { request: q.id });
                emit(
                    q.p,
                    Fact::SourcePinned {
                        handoff: q.handoff,
                        request: q.id,
                        lease: q.lease,
                        blocks: q.blocks,
                        deadline_ns: now + 1_000_000_000,
                        kv: KvDelta {
                            active: -(q.blocks as i32),
                            pinned_source: q.blocks as i32,
                            slots: -1,
                            ..z
                        },
                    },
                );
                emit(r, Fact::PrefillComputeDone { request: q.id, worker: q.p });
                if !df {
                    emit(r, Fact::DecodeBooked { request: q.id, worker: q.d, blocks: q.blocks + 1 });
                    emit(r, Fact::DestinationRouted { handoff: q.handoff, worker: q.d });
                    emit(
                        q.d,
                        Fact::HandoffStarted {
                            handoff: q.handoff,
                            request: q.id,
                            policy: cfg.policy,
                            demand: KvHandoffDemand { context_tokens: q.input, max_output_tokens: q.output },
                        },
                    );
                    reserve(&mut caps, &mut emit, q);
                }
                push_for(&mut heap, rng.random_range(100..2_000u64), i, 3);
            }
            // Transfer done: activate, release the source.
            3 => {
                let q = &reqs[&i];
                let n = q.blocks as i32;
                emit(
                    q.d,
                    Fact::ReceiveStarted { handoff: q.handoff, from: q.p, bytes: q.blocks as u64 * 65_536 },
                );
                emit(q.d, Fact::ReceiveCompleted { handoff: q.handoff });
                emit(
                    q.d,
                    Fact::DestinationActivated {
                        handoff: q.handoff,
                        reservation: q.reservation,
                        kv: KvDelta {
                            reserved_destination: -n,
                            active: n,
                            headroom_tokens: -(q.output as i32),
                            ..z
                        },
                    },
                );
                emit(q.p, Fact::ReaderCompleted { handoff: q.handoff });
                emit(
                    q.p,
                    Fact::SourceReleased {
                        handoff: q.handoff,
                        lease: q.lease,
                        reason: EndReason::Success,
                        kv: KvDelta { pinned_source: -n, cached_free: n, ..z },
                    },
                );
                caps.get_mut(&q.p).unwrap().cached += n as i64;
                emit(r, Fact::PrefillBookingFreed { request: q.id, worker: q.p });
                emit(q.d, Fact::RequestScheduled { request: q.id, cached_tokens: 0, kv: z });
                push_for(&mut heap, rng.random_range(100..1_000u64), i, 4);
            }
            // Decode steps, then finish.
            _ => {
                let q = reqs.get_mut(&i).unwrap();
                if !q.first_token {
                    q.first_token = true;
                    emit(q.d, Fact::FirstTokenEmitted { request: q.id });
                }
                if q.steps_left > 0 {
                    q.steps_left -= 1;
                    let grow = (q.steps_left % 2 == 0) as i32;
                    let c = caps.get_mut(&q.d).unwrap();
                    assert!(c.free >= grow as i64, "generator: decode out of blocks");
                    c.free -= grow as i64;
                    q.grown += grow as u32;
                    emit(
                        q.d,
                        Fact::StepExecuted {
                            prefill_tokens: 0,
                            decode_tokens: 1,
                            batch_size: 1,
                            duration_ns: 200_000,
                            kv: KvDelta { active: grow, free: -grow, ..z },
                        },
                    );
                    push_for(&mut heap, rng.random_range(100..800u64), i, 4);
                } else {
                    let q = reqs.remove(&i).unwrap();
                    let n = (q.blocks + q.grown) as i32;
                    caps.get_mut(&q.d).unwrap().free += n as i64;
                    emit(
                        q.d,
                        Fact::RequestFinished {
                            request: q.id,
                            status: TerminalStatus::Completed,
                            output_tokens: q.output,
                            kv: KvDelta { active: -n, free: n, slots: -1, ..z },
                        },
                    );
                    emit(
                        r,
                        Fact::RequestFinished {
                            request: q.id,
                            status: TerminalStatus::Completed,
                            output_tokens: q.output,
                            kv: z,
                        },
                    );
                    emit(
                        r,
                        Fact::DecodeBookingFreed {
                            request: q.id,
                            worker: q.d,
                            status: TerminalStatus::Completed,
                        },
                    );
                }
            }
        }
    }
    w.finish().unwrap();
    records
}

fn reserve(caps: &mut HashMap<WorkerId, Cap>, emit: &mut impl FnMut(WorkerId, Fact), q: &Req) {
    let n = q.blocks as i64;
    let c = caps.get_mut(&q.d).unwrap();
    assert!(c.free >= n, "generator: decode out of blocks");
    c.free -= n;
    emit(
        q.d,
        Fact::DestinationReserved {
            handoff: q.handoff,
            request: q.id,
            reservation: q.reservation,
            pages: q.blocks,
            prefix_blocks: 0,
            prefix_tokens: 0,
            deadline_ns: u64::MAX / 2,
            kv: KvDelta {
                reserved_destination: n as i32,
                free: -n as i32,
                slots: 1,
                headroom_tokens: q.output as i32,
                ..KvDelta::ZERO
            },
        },
    );
}

/// What to do with one record while copying a run.
pub enum Edit {
    Keep,
    Drop,
    Replace(Fact),
}

/// Copies the run at `src` to the directory `dst`, in merge order, letting `edit` change or drop
/// records (seq numbers are reassigned, so a dropped record shifts its stream's later seqs).
pub fn rewrite(src: &Path, dst: &Path, mut edit: impl FnMut(WorkerId, &Record) -> Edit) {
    let mut run = RunReader::open(src).unwrap();
    let headers = run.headers().to_vec();
    let mut w = RunWriter::create(dst, headers.iter().cloned()).unwrap();
    while let Some((i, rec)) = run.next().unwrap() {
        let worker = headers[i].worker;
        match edit(worker, &rec) {
            Edit::Keep => {
                w.append(worker, rec.at_ns, &rec.fact).unwrap();
            }
            Edit::Drop => {}
            Edit::Replace(f) => {
                w.append(worker, rec.at_ns, &f).unwrap();
            }
        }
    }
    w.finish().unwrap();
}
