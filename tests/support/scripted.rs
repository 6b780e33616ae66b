//! Scripted fixture runs for the `inspect` and `timeline` tests, written with the library's own
//! `RunWriter`. Every figure is fixed, so the same script writes byte-identical streams; the
//! committed copies under `fixtures/runs/` are checked against a fresh write.
//!
//! Each request's prompt is 4 blocks (256 tokens at 64 tokens per block); decode books 8.

use super::{fixture, ms};
use handoff_ledger::events::{
    EngineShape, Fact, KvDelta, RejectReason, RunWriter, StreamHeader, TerminalStatus,
};
use handoff_ledger::ids::*;
use std::path::{Path, PathBuf};

pub const PROMPT_BLOCKS: i32 = 4;
const Z: KvDelta = KvDelta::ZERO;

pub fn handoff_of(req: u64) -> HandoffId {
    HandoffId(uuid::Uuid::from_u128(0xA11C_E000_0000_4000_8000_0000_0000_0000 + req as u128))
}

fn header(backend: Backend, worker: WorkerId, total_blocks: u32) -> StreamHeader {
    StreamHeader {
        run_id: uuid::Uuid::from_u128(0x5eed),
        worker,
        backend,
        policy: backend.native_policy(),
        clock: ClockDomain::Virtual,
        seed: 7,
        engine: EngineShape {
            total_blocks,
            block_size: 64,
            max_request_slots: 8,
            config_json: String::new(),
        },
    }
}

/// Facts are collected and written at `finish`, each stream in time order (a stable sort, so
/// facts of one instant keep the order the script gave them): the script may describe one
/// request's life after another, but a stream must never go back in time.
pub struct Script {
    w: RunWriter,
    policy: HandoffPolicy,
    pending: Vec<(WorkerId, u64, Fact)>,
}

impl Script {
    pub fn new(dir: &Path, backend: Backend, prefill_blocks: &[u32], decode_blocks: &[u32]) -> Self {
        let mut hs = Vec::new();
        for (i, b) in prefill_blocks.iter().enumerate() {
            hs.push(header(backend, WorkerId::prefill(i as u32), *b));
        }
        for (i, b) in decode_blocks.iter().enumerate() {
            hs.push(header(backend, WorkerId::decode(i as u32), *b));
        }
        hs.push(header(backend, WorkerId::ROUTER, 0));
        let mut w = RunWriter::create(dir, hs).expect("create run");
        let workers: Vec<WorkerId> = w.headers().map(|h| h.worker).collect();
        for wk in workers {
            w.append(wk, 0, &Fact::SessionStarted { generation: Generation(1) }).expect("append");
        }
        Script { w, policy: backend.native_policy(), pending: Vec::new() }
    }

    pub fn put(&mut self, worker: WorkerId, t_ms: u64, fact: Fact) {
        self.pending.push((worker, ms(t_ms), fact));
    }

    fn started(&mut self, t: u64, worker: WorkerId, req: u64) {
        let policy = self.policy;
        self.put(
            worker,
            t,
            Fact::HandoffStarted {
                handoff: handoff_of(req),
                request: RequestId(req),
                policy,
                demand: KvHandoffDemand { context_tokens: 256, max_output_tokens: 256 },
            },
        );
    }

    /// The request arrives and the router books prefill blocks on `p`.
    pub fn arrive(&mut self, t: u64, req: u64, p: u32) {
        let r = RequestId(req);
        self.put(
            WorkerId::ROUTER,
            t,
            Fact::RequestArrived { request: r, input_tokens: 256, output_tokens: 256 },
        );
        self.put(
            WorkerId::ROUTER,
            t,
            Fact::PrefillBooked {
                request: r,
                worker: WorkerId::prefill(p),
                prefill_tokens: 256,
                blocks: PROMPT_BLOCKS as u32,
            },
        );
    }

    /// Source role begins: the handoff starts on `p`, prefill is dispatched and queued.
    pub fn dispatch(&mut self, t: u64, req: u64, p: u32) {
        let pw = WorkerId::prefill(p);
        self.started(t, pw, req);
        self.put(pw, t, Fact::PrefillDispatched { handoff: handoff_of(req) });
        self.put(pw, t, Fact::RequestQueued { request: RequestId(req) });
    }

    /// Prefill admits the request: 4 blocks from cached-free (`from_cached`) or free.
    pub fn schedule(&mut self, t: u64, req: u64, p: u32, from_cached: bool) {
        let kv = if from_cached {
            KvDelta { cached_free: -PROMPT_BLOCKS, active: PROMPT_BLOCKS, slots: 1, ..Z }
        } else {
            KvDelta { free: -PROMPT_BLOCKS, active: PROMPT_BLOCKS, slots: 1, ..Z }
        };
        self.put(
            WorkerId::prefill(p),
            t,
            Fact::RequestScheduled { request: RequestId(req), cached_tokens: 0, kv },
        );
    }

    /// Prefill finishes: active → pinned, atomically; the router drops compute load.
    pub fn pin(&mut self, t: u64, req: u64, p: u32) {
        let pw = WorkerId::prefill(p);
        let r = RequestId(req);
        self.put(pw, t, Fact::FirstTokenEmitted { request: r });
        self.put(
            pw,
            t,
            Fact::SourcePinned {
                handoff: handoff_of(req),
                request: r,
                lease: SourceLeaseId(req),
                blocks: PROMPT_BLOCKS as u32,
                deadline_ns: ms(t + 480_000),
                kv: KvDelta { active: -PROMPT_BLOCKS, pinned_source: PROMPT_BLOCKS, slots: -1, ..Z },
            },
        );
        self.put(WorkerId::ROUTER, t, Fact::PrefillComputeDone { request: r, worker: pw });
    }

    /// The decode router picks `d` and books 8 blocks; the destination role begins.
    pub fn route(&mut self, t: u64, req: u64, d: u32) {
        let dw = WorkerId::decode(d);
        self.put(WorkerId::ROUTER, t, Fact::DecodeBooked { request: RequestId(req), worker: dw, blocks: 8 });
        self.started(t, dw, req);
        self.put(dw, t, Fact::DestinationRouted { handoff: handoff_of(req), worker: dw });
    }

    /// No room on `d`: the reservation waits in the FIFO, refused once.
    pub fn queue_reservation(&mut self, t: u64, req: u64, d: u32) {
        let dw = WorkerId::decode(d);
        self.put(dw, t, Fact::ReservationQueued { handoff: handoff_of(req) });
        self.put(
            dw,
            t,
            Fact::ReservationRefused { handoff: handoff_of(req), reason: RejectReason::NoCapacity },
        );
    }

    /// Destination reserves 4 fresh pages on `d`.
    pub fn reserve(&mut self, t: u64, req: u64, d: u32) {
        self.put(
            WorkerId::decode(d),
            t,
            Fact::DestinationReserved {
                handoff: handoff_of(req),
                request: RequestId(req),
                reservation: DestinationReservationId(req),
                pages: PROMPT_BLOCKS as u32,
                prefix_blocks: 0,
                prefix_tokens: 0,
                deadline_ns: ms(t + 300_000),
                kv: KvDelta { free: -PROMPT_BLOCKS, reserved_destination: PROMPT_BLOCKS, ..Z },
            },
        );
    }

    /// Transfer from `p` (5 ms), activation and decode admission on `d`, then the reader
    /// acknowledgement releases the source pin into the cache 1 ms later.
    pub fn transfer_activate_release(&mut self, t: u64, req: u64, p: u32, d: u32) {
        let pw = WorkerId::prefill(p);
        let dw = WorkerId::decode(d);
        let h = handoff_of(req);
        let r = RequestId(req);
        self.put(dw, t, Fact::ReceiveStarted { handoff: h, from: pw, bytes: 256 * 131_072 });
        self.put(dw, t + 5, Fact::ReceiveCompleted { handoff: h });
        self.put(
            dw,
            t + 5,
            Fact::DestinationActivated {
                handoff: h,
                reservation: DestinationReservationId(req),
                kv: KvDelta { reserved_destination: -PROMPT_BLOCKS, active: PROMPT_BLOCKS, ..Z },
            },
        );
        self.put(
            dw,
            t + 5,
            Fact::RequestScheduled { request: r, cached_tokens: 0, kv: KvDelta { slots: 1, ..Z } },
        );
        self.put(pw, t + 6, Fact::ReaderCompleted { handoff: h });
        self.put(
            pw,
            t + 6,
            Fact::SourceReleased {
                handoff: h,
                lease: SourceLeaseId(req),
                reason: EndReason::Success,
                kv: KvDelta { pinned_source: -PROMPT_BLOCKS, cached_free: PROMPT_BLOCKS, ..Z },
            },
        );
        self.put(WorkerId::ROUTER, t + 6, Fact::PrefillBookingFreed { request: r, worker: pw });
    }

    /// A decode step on `d` that grows running requests by `blocks` in total.
    pub fn grow(&mut self, t: u64, d: u32, blocks: i32, batch: u32) {
        self.put(
            WorkerId::decode(d),
            t,
            Fact::StepExecuted {
                prefill_tokens: 0,
                decode_tokens: batch,
                batch_size: batch,
                duration_ns: ms(20),
                kv: KvDelta { free: -blocks, active: blocks, ..Z },
            },
        );
    }

    /// The request completes on `d`, returning `blocks`; the router ends it.
    pub fn complete(&mut self, t: u64, req: u64, d: u32, blocks: i32) {
        let dw = WorkerId::decode(d);
        let r = RequestId(req);
        self.put(
            dw,
            t,
            Fact::RequestFinished {
                request: r,
                status: TerminalStatus::Completed,
                output_tokens: 256,
                kv: KvDelta { active: -blocks, free: blocks, slots: -1, ..Z },
            },
        );
        self.put(
            WorkerId::ROUTER,
            t,
            Fact::RequestFinished {
                request: r,
                status: TerminalStatus::Completed,
                output_tokens: 256,
                kv: Z,
            },
        );
        self.put(
            WorkerId::ROUTER,
            t,
            Fact::DecodeBookingFreed { request: r, worker: dw, status: TerminalStatus::Completed },
        );
    }

    pub fn finish(mut self) {
        let mut facts = std::mem::take(&mut self.pending);
        facts.sort_by_key(|(_, at, _)| *at);
        for (worker, at, fact) in facts {
            self.w.append(worker, at, &fact).expect("append");
        }
        self.w.finish().expect("finish run");
    }
}

/// Source-first handoff of `req` with room everywhere: dispatched at `t`, prefilled 40 ms,
/// reserved at once on `d`, transferred, activated, released.
fn quick_source_first(s: &mut Script, t: u64, req: u64, d: u32, from_cached: bool) {
    s.arrive(t, req, 0);
    s.dispatch(t, req, 0);
    s.schedule(t + 1, req, 0, from_cached);
    s.pin(t + 40, req, 0);
    s.route(t + 40, req, d);
    s.reserve(t + 40, req, d);
    s.transfer_activate_release(t + 40, req, 0, d);
}

/// The vLLM stranding cascade, small: prefill-0 has 20 blocks, decode-0 and decode-1 16 each.
///
/// * 0–30 ms: r0..r3 hand off normally (two per decode worker); by 400 ms their decode growth
///   fills both decode workers (16/16).
/// * 500–900 ms: r4..r8 prefill and pin; their reservations queue and are refused. Pins reach
///   20/20 on prefill-0.
/// * 1000, 1100 ms: r9, r10 queue on prefill-0 and cannot be admitted: the stall begins at
///   1000 + 1000 = 2000 ms.
/// * 3000 ms: decode-0 finishes its long requests; r4, r6, r8 reserve, their pins are released
///   and r9, r10 are admitted (the stall ends at 3006 ms). 3200 ms: decode-1 does the same for
///   r5, r7 and r10. Everything drains by 3600 ms.
pub fn write_cascade(dir: &Path) {
    let mut s = Script::new(dir, Backend::Vllm, &[20], &[16, 16]);
    for req in 0..4u64 {
        quick_source_first(&mut s, req * 10, req, (req % 2) as u32, false);
    }
    for t in [100, 200, 300, 400] {
        s.grow(t, 0, 2, 2);
        s.grow(t, 1, 2, 2);
    }
    for (k, req) in (4..9u64).enumerate() {
        let t = 500 + 100 * k as u64;
        let d = (req % 2) as u32;
        s.arrive(t, req, 0);
        s.dispatch(t, req, 0);
        // r4..r7 reuse the cached blocks r0..r3 left; r8 takes the last free ones.
        s.schedule(t + 1, req, 0, req < 8);
        s.pin(t + 40, req, 0);
        s.route(t + 40, req, d);
        s.queue_reservation(t + 40, req, d);
    }
    for (t, req) in [(1000u64, 9u64), (1100, 10)] {
        s.arrive(t, req, 0);
        s.dispatch(t, req, 0);
    }
    // decode-0 frees 16 blocks: r4, r6, r8 reserve and activate; their pins go to the cache.
    s.complete(3000, 0, 0, 8);
    s.complete(3000, 2, 0, 8);
    for req in [4u64, 6, 8] {
        s.reserve(3000, req, 0);
        s.transfer_activate_release(3000, req, 0, 0);
    }
    // r9 and r10 are admitted from the cache the moment pins fall.
    s.schedule(3006, 9, 0, true);
    s.schedule(3006, 10, 0, true);
    s.pin(3046, 9, 0);
    s.route(3046, 9, 0);
    s.reserve(3046, 9, 0);
    s.transfer_activate_release(3046, 9, 0, 0);
    s.pin(3046, 10, 0);
    s.route(3046, 10, 1);
    s.queue_reservation(3046, 10, 1);
    // decode-1 frees its 16 blocks: r5, r7 and r10 reserve.
    s.complete(3200, 1, 1, 8);
    s.complete(3200, 3, 1, 8);
    for req in [5u64, 7, 10] {
        s.reserve(3200, req, 1);
        s.transfer_activate_release(3200, req, 0, 1);
    }
    for (req, d, t) in [
        (4u64, 0u32, 3400u64),
        (6, 0, 3400),
        (8, 0, 3400),
        (9, 0, 3450),
        (5, 1, 3500),
        (7, 1, 3500),
        (10, 1, 3600),
    ] {
        s.complete(t, req, d, PROMPT_BLOCKS);
    }
    s.finish();
}

/// The same arrivals on roomy decode workers (64 blocks each): every reservation succeeds at
/// once, pins last 6 ms, prefill never waits.
pub fn write_healthy(dir: &Path) {
    let mut s = Script::new(dir, Backend::Vllm, &[20], &[64, 64]);
    for req in 0..4u64 {
        quick_source_first(&mut s, req * 10, req, (req % 2) as u32, false);
    }
    for t in [100, 200, 300, 400] {
        s.grow(t, 0, 2, 2);
        s.grow(t, 1, 2, 2);
    }
    for (k, req) in (4..11u64).enumerate() {
        let t = 500 + 100 * k as u64;
        quick_source_first(&mut s, t, req, (req % 2) as u32, true);
    }
    s.complete(3000, 0, 0, 8);
    s.complete(3000, 2, 0, 8);
    s.complete(3200, 1, 1, 8);
    s.complete(3200, 3, 1, 8);
    for req in 4..11u64 {
        s.complete(3400 + 10 * req, req, (req % 2) as u32, PROMPT_BLOCKS);
    }
    s.finish();
}

/// SGLang-style destination-first gating: decode-0 (16 blocks) fills up, and r4..r7 wait in
/// its reservation FIFO *before* their prefill is dispatched; prefill-0 stays idle meanwhile.
pub fn write_gated(dir: &Path) {
    let mut s = Script::new(dir, Backend::Sglang, &[20], &[16]);
    let dest_first = |s: &mut Script, t: u64, req: u64, from_cached: bool| {
        s.dispatch(t, req, 0);
        s.schedule(t + 1, req, 0, from_cached);
        s.pin(t + 40, req, 0);
        s.transfer_activate_release(t + 40, req, 0, 0);
    };
    for req in 0..4u64 {
        let t = req * 10;
        s.arrive(t, req, 0);
        s.route(t, req, 0);
        s.reserve(t, req, 0);
        dest_first(&mut s, t, req, false);
    }
    for t in [100, 200] {
        s.grow(t, 0, 0, 4);
    }
    for (k, req) in (4..8u64).enumerate() {
        let t = 500 + 100 * k as u64;
        s.arrive(t, req, 0);
        s.route(t, req, 0);
        s.queue_reservation(t, req, 0);
    }
    for req in 0..4u64 {
        s.complete(2000, req, 0, PROMPT_BLOCKS);
    }
    for (k, req) in (4..8u64).enumerate() {
        s.reserve(2000, req, 0);
        dest_first(&mut s, 2000 + 50 * k as u64, req, true);
    }
    for req in 4..8u64 {
        s.complete(2600, req, 0, PROMPT_BLOCKS);
    }
    s.finish();
}

/// Handoffs that fail three ways (vLLM, prefill-0 20 blocks, decode-0 16):
/// * r0 pins at 40 ms, its reservation queues, and its 500 ms lease expires at 540 ms;
/// * r1 reserves at 140 ms but its transfer never completes: the reservation expires at 440 ms;
/// * r2 reserves at 240 ms and the client aborts at 300 ms.
pub fn write_failures(dir: &Path) {
    let mut s = Script::new(dir, Backend::Vllm, &[20], &[16]);
    let p = WorkerId::prefill(0);
    let d = WorkerId::decode(0);
    let r = WorkerId::ROUTER;
    for (req, t) in [(0u64, 0u64), (1, 100), (2, 200)] {
        s.arrive(t, req, 0);
        s.dispatch(t, req, 0);
        s.schedule(t + 1, req, 0, false);
        s.pin(t + 40, req, 0);
        s.route(t + 40, req, 0);
    }
    let release = |s: &mut Script, t: u64, req: u64, reason: EndReason| {
        s.put(
            p,
            t,
            Fact::SourceReleased {
                handoff: handoff_of(req),
                lease: SourceLeaseId(req),
                reason,
                kv: KvDelta { pinned_source: -PROMPT_BLOCKS, free: PROMPT_BLOCKS, ..Z },
            },
        );
        s.put(r, t, Fact::PrefillBookingFreed { request: RequestId(req), worker: p });
    };
    let fail = |s: &mut Script, t: u64, req: u64, status: TerminalStatus| {
        s.put(r, t, Fact::DecodeBookingFreed { request: RequestId(req), worker: d, status });
        s.put(r, t, Fact::RequestFinished { request: RequestId(req), status, output_tokens: 0, kv: Z });
    };
    // r0: lease expiry.
    s.queue_reservation(40, 0, 0);
    s.put(p, 540, Fact::LeaseExpired { handoff: handoff_of(0), lease: SourceLeaseId(0) });
    release(&mut s, 540, 0, EndReason::Expired);
    s.put(d, 540, Fact::ReservationDequeued { handoff: handoff_of(0), reason: CancelReason::PeerLost });
    fail(&mut s, 540, 0, TerminalStatus::Failed);
    // r1: reservation expiry.
    s.reserve(140, 1, 0);
    s.put(d, 140, Fact::ReceiveStarted { handoff: handoff_of(1), from: p, bytes: 256 * 131_072 });
    s.put(
        d,
        440,
        Fact::ReservationExpired { handoff: handoff_of(1), reservation: DestinationReservationId(1) },
    );
    s.put(
        d,
        440,
        Fact::ReservationReleased {
            handoff: handoff_of(1),
            reservation: DestinationReservationId(1),
            reason: EndReason::Expired,
            kv: KvDelta { reserved_destination: -PROMPT_BLOCKS, free: PROMPT_BLOCKS, ..Z },
        },
    );
    s.put(p, 440, Fact::HandoffCanceled { handoff: handoff_of(1), reason: CancelReason::TransferFailed });
    release(&mut s, 440, 1, EndReason::Canceled(CancelReason::TransferFailed));
    fail(&mut s, 440, 1, TerminalStatus::Failed);
    // r2: the client aborts.
    s.reserve(240, 2, 0);
    for w in [p, d] {
        s.put(w, 300, Fact::HandoffCanceled { handoff: handoff_of(2), reason: CancelReason::RequestAborted });
    }
    s.put(
        d,
        300,
        Fact::ReservationReleased {
            handoff: handoff_of(2),
            reservation: DestinationReservationId(2),
            reason: EndReason::Canceled(CancelReason::RequestAborted),
            kv: KvDelta { reserved_destination: -PROMPT_BLOCKS, free: PROMPT_BLOCKS, ..Z },
        },
    );
    release(&mut s, 300, 2, EndReason::Canceled(CancelReason::RequestAborted));
    fail(&mut s, 300, 2, TerminalStatus::Canceled);
    s.finish();
}

/// `fixtures/runs/`, where the scripted runs are committed beside the generated ones.
pub fn fixtures_dir() -> PathBuf {
    fixture("runs")
}

/// A fixture's name and the script that writes it.
pub type Fixture = (&'static str, fn(&Path));

/// Every scripted fixture.
pub fn scripted() -> [Fixture; 4] {
    [
        ("scripted-cascade", write_cascade as fn(&Path)),
        ("scripted-healthy", write_healthy),
        ("scripted-gated", write_gated),
        ("scripted-failures", write_failures),
    ]
}
