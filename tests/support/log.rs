//! Shared test support for the log tests: a proptest strategy for every `Fact` variant, fixed
//! headers, and the golden fact list.

use handoff_ledger::events::{
    EngineShape, Fact, KvDelta, MessageKind, MessageRejection, RejectReason, StreamHeader, TerminalStatus,
};
use handoff_ledger::ids::{
    Backend, CancelReason, ClockDomain, DestinationReservationId, EndReason, Generation, HandoffId,
    HandoffPolicy, KvHandoffDemand, RequestId, Role, SourceLeaseId, WallClockSync, WorkerId,
};
use proptest::prelude::*;
use uuid::Uuid;

/// The number of `Fact` variants; [`ordinal`] is an exhaustive match, so adding a variant
/// breaks the build here until the strategy, the golden list and this count are updated.
pub const FACT_VARIANTS: usize = 44;

/// The variant's position in the enum (= its bincode variant index).
pub fn ordinal(f: &Fact) -> usize {
    use Fact::*;
    match f {
        SessionStarted { .. } => 0,
        RequestArrived { .. } => 1,
        RequestQueued { .. } => 2,
        RequestScheduled { .. } => 3,
        FirstTokenEmitted { .. } => 4,
        RequestPreempted { .. } => 5,
        RequestFinished { .. } => 6,
        RequestRejected { .. } => 7,
        StepExecuted { .. } => 8,
        KvEvicted { .. } => 9,
        KvStored { .. } => 10,
        KvRemoved { .. } => 11,
        KvCleared => 12,
        HandoffStarted { .. } => 13,
        PrefillDispatched { .. } => 14,
        SourcePinned { .. } => 15,
        LeaseRenewed { .. } => 16,
        LeaseExpired { .. } => 17,
        ReaderCompleted { .. } => 18,
        SourceReleased { .. } => 19,
        DestinationRouted { .. } => 20,
        ReservationQueued { .. } => 21,
        ReservationRefused { .. } => 22,
        ReservationDequeued { .. } => 23,
        DestinationReserved { .. } => 24,
        ReceiveStarted { .. } => 25,
        ReceiveCompleted { .. } => 26,
        DestinationActivated { .. } => 27,
        ReservationExpired { .. } => 28,
        ReservationReleased { .. } => 29,
        HandoffCanceled { .. } => 30,
        MessageSent { .. } => 31,
        MessageReceived { .. } => 32,
        MessageRejected { .. } => 33,
        PrefillBooked { .. } => 34,
        PrefillComputeDone { .. } => 35,
        PrefillBookingFreed { .. } => 36,
        DecodeBooked { .. } => 37,
        DecodeBookingFreed { .. } => 38,
        DecodeResumed { .. } => 39,
        TransferTiming { .. } => 40,
        WorkerLeft { .. } => 41,
        StreamEnded => 42,
        SessionLost { .. } => 43,
    }
}

// ----- leaf strategies -----

pub fn handoff() -> impl Strategy<Value = HandoffId> {
    // A small pool half the time, so streams name the same handoff more than once.
    prop_oneof![
        (0u128..8).prop_map(|v| HandoffId(Uuid::from_u128(v))),
        any::<u128>().prop_map(|v| HandoffId(Uuid::from_u128(v))),
    ]
}
pub fn request() -> impl Strategy<Value = RequestId> {
    any::<u64>().prop_map(RequestId)
}
pub fn generation() -> impl Strategy<Value = Generation> {
    any::<u32>().prop_map(Generation)
}
pub fn lease() -> impl Strategy<Value = SourceLeaseId> {
    any::<u64>().prop_map(SourceLeaseId)
}
pub fn reservation() -> impl Strategy<Value = DestinationReservationId> {
    any::<u64>().prop_map(DestinationReservationId)
}
pub fn role() -> impl Strategy<Value = Role> {
    prop_oneof![Just(Role::Prefill), Just(Role::Decode), Just(Role::Aggregated), Just(Role::Router)]
}
pub fn worker() -> impl Strategy<Value = WorkerId> {
    (role(), any::<u32>(), any::<u32>()).prop_map(|(role, index, dp_rank)| WorkerId { role, index, dp_rank })
}
pub fn kv() -> impl Strategy<Value = KvDelta> {
    (any::<[i32; 7]>()).prop_map(|a| KvDelta {
        active: a[0],
        pinned_source: a[1],
        reserved_destination: a[2],
        cached_free: a[3],
        free: a[4],
        slots: a[5],
        headroom_tokens: a[6],
    })
}
pub fn status() -> impl Strategy<Value = TerminalStatus> {
    prop_oneof![
        Just(TerminalStatus::Completed),
        Just(TerminalStatus::Rejected),
        Just(TerminalStatus::Failed),
        Just(TerminalStatus::Canceled),
    ]
}
pub fn reject() -> impl Strategy<Value = RejectReason> {
    prop_oneof![
        Just(RejectReason::NeverFits),
        Just(RejectReason::NoCapacity),
        Just(RejectReason::NoSlot),
        Just(RejectReason::Unsupported),
    ]
}
pub fn kind() -> impl Strategy<Value = MessageKind> {
    prop_oneof![
        Just(MessageKind::SourceReady),
        Just(MessageKind::DestinationReserved),
        Just(MessageKind::ReceiveCompleted),
        Just(MessageKind::ReaderCompleted),
        Just(MessageKind::Abort),
        Just(MessageKind::LeaseRenewal),
    ]
}
pub fn rejection() -> impl Strategy<Value = MessageRejection> {
    prop_oneof![
        Just(MessageRejection::StaleGeneration),
        Just(MessageRejection::Duplicate),
        Just(MessageRejection::Late),
        Just(MessageRejection::UnknownHandoff),
        Just(MessageRejection::InvalidTransition),
    ]
}
pub fn cancel() -> impl Strategy<Value = CancelReason> {
    prop_oneof![
        Just(CancelReason::RequestAborted),
        Just(CancelReason::DestinationRejected),
        Just(CancelReason::Unsupported),
        Just(CancelReason::TransferFailed),
        Just(CancelReason::PeerLost),
        Just(CancelReason::OwnerLost),
        Just(CancelReason::Teardown),
        Just(CancelReason::Expired),
        Just(CancelReason::BootstrapTimeout),
        Just(CancelReason::Rerouted),
    ]
}
pub fn end() -> impl Strategy<Value = EndReason> {
    prop_oneof![Just(EndReason::Success), Just(EndReason::Expired), cancel().prop_map(EndReason::Canceled),]
}
pub fn policy() -> impl Strategy<Value = HandoffPolicy> {
    prop_oneof![
        Just(HandoffPolicy::Disabled),
        Just(HandoffPolicy::SourceFirst),
        Just(HandoffPolicy::DestinationFirst),
    ]
}
pub fn demand() -> impl Strategy<Value = KvHandoffDemand> {
    (any::<u32>(), any::<u32>())
        .prop_map(|(context_tokens, max_output_tokens)| KvHandoffDemand { context_tokens, max_output_tokens })
}
pub fn hashes() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(any::<u64>(), 0..24)
}

/// Any `Fact`, every variant equally likely.
pub fn fact() -> impl Strategy<Value = Fact> {
    use Fact::*;
    prop_oneof![
        generation().prop_map(|generation| SessionStarted { generation }),
        (request(), any::<u32>(), any::<u32>()).prop_map(|(request, input_tokens, output_tokens)| {
            RequestArrived { request, input_tokens, output_tokens }
        }),
        request().prop_map(|request| RequestQueued { request }),
        (request(), any::<u32>(), kv())
            .prop_map(|(request, cached_tokens, kv)| { RequestScheduled { request, cached_tokens, kv } }),
        request().prop_map(|request| FirstTokenEmitted { request }),
        (request(), kv()).prop_map(|(request, kv)| RequestPreempted { request, kv }),
        (request(), status(), any::<u32>(), kv()).prop_map(|(request, status, output_tokens, kv)| {
            RequestFinished { request, status, output_tokens, kv }
        }),
        (request(), reject()).prop_map(|(request, reason)| RequestRejected { request, reason }),
        (any::<u32>(), any::<u32>(), any::<u32>(), any::<u64>(), kv()).prop_map(
            |(prefill_tokens, decode_tokens, batch_size, duration_ns, kv)| StepExecuted {
                prefill_tokens,
                decode_tokens,
                batch_size,
                duration_ns,
                kv
            }
        ),
        kv().prop_map(|kv| KvEvicted { kv }),
        (any::<Option<u64>>(), hashes()).prop_map(|(parent, blocks)| KvStored { parent, blocks }),
        hashes().prop_map(|blocks| KvRemoved { blocks }),
        Just(KvCleared),
        (handoff(), request(), policy(), demand()).prop_map(|(handoff, request, policy, demand)| {
            HandoffStarted { handoff, request, policy, demand }
        }),
        handoff().prop_map(|handoff| PrefillDispatched { handoff }),
        (handoff(), request(), lease(), any::<u32>(), any::<u64>(), kv()).prop_map(
            |(handoff, request, lease, blocks, deadline_ns, kv)| SourcePinned {
                handoff,
                request,
                lease,
                blocks,
                deadline_ns,
                kv
            }
        ),
        (handoff(), lease(), any::<u64>())
            .prop_map(|(handoff, lease, deadline_ns)| { LeaseRenewed { handoff, lease, deadline_ns } }),
        (handoff(), lease()).prop_map(|(handoff, lease)| LeaseExpired { handoff, lease }),
        handoff().prop_map(|handoff| ReaderCompleted { handoff }),
        (handoff(), lease(), end(), kv())
            .prop_map(|(handoff, lease, reason, kv)| { SourceReleased { handoff, lease, reason, kv } }),
        (handoff(), worker()).prop_map(|(handoff, worker)| DestinationRouted { handoff, worker }),
        handoff().prop_map(|handoff| ReservationQueued { handoff }),
        (handoff(), reject()).prop_map(|(handoff, reason)| ReservationRefused { handoff, reason }),
        (handoff(), cancel()).prop_map(|(handoff, reason)| ReservationDequeued { handoff, reason }),
        (handoff(), request(), reservation(), any::<[u32; 3]>(), any::<u64>(), kv()).prop_map(
            |(handoff, request, reservation, p, deadline_ns, kv)| {
                DestinationReserved {
                    handoff,
                    request,
                    reservation,
                    pages: p[0],
                    prefix_blocks: p[1],
                    prefix_tokens: p[2],
                    deadline_ns,
                    kv,
                }
            }
        ),
        (handoff(), worker(), any::<u64>()).prop_map(|(handoff, from, bytes)| ReceiveStarted {
            handoff,
            from,
            bytes
        }),
        handoff().prop_map(|handoff| ReceiveCompleted { handoff }),
        (handoff(), reservation(), kv())
            .prop_map(|(handoff, reservation, kv)| { DestinationActivated { handoff, reservation, kv } }),
        (handoff(), reservation())
            .prop_map(|(handoff, reservation)| ReservationExpired { handoff, reservation }),
        (handoff(), reservation(), end(), kv()).prop_map(|(handoff, reservation, reason, kv)| {
            ReservationReleased { handoff, reservation, reason, kv }
        }),
        (handoff(), cancel()).prop_map(|(handoff, reason)| HandoffCanceled { handoff, reason }),
        (handoff(), kind(), worker()).prop_map(|(handoff, kind, to)| MessageSent { handoff, kind, to }),
        (handoff(), kind(), worker(), generation()).prop_map(|(handoff, kind, from, generation)| {
            MessageReceived { handoff, kind, from, generation }
        }),
        (handoff(), kind(), worker(), generation(), rejection()).prop_map(
            |(handoff, kind, from, generation, why)| MessageRejected { handoff, kind, from, generation, why }
        ),
        (request(), worker(), any::<u32>(), any::<u32>()).prop_map(
            |(request, worker, prefill_tokens, blocks)| PrefillBooked {
                request,
                worker,
                prefill_tokens,
                blocks
            }
        ),
        (request(), worker()).prop_map(|(request, worker)| PrefillComputeDone { request, worker }),
        (request(), worker()).prop_map(|(request, worker)| PrefillBookingFreed { request, worker }),
        (request(), worker(), any::<u32>()).prop_map(|(request, worker, blocks)| DecodeBooked {
            request,
            worker,
            blocks
        }),
        (request(), worker(), status())
            .prop_map(|(request, worker, status)| { DecodeBookingFreed { request, worker, status } }),
        (request(), any::<u64>()).prop_map(|(request, stalled_ns)| DecodeResumed { request, stalled_ns }),
        (handoff(), any::<[u64; 3]>()).prop_map(|(handoff, t)| TransferTiming {
            handoff,
            queued_ns: t[0],
            latency_ns: t[1],
            moving_ns: t[2]
        }),
        generation().prop_map(|generation| WorkerLeft { generation }),
        Just(StreamEnded),
        (generation(), kv()).prop_map(|(generation, kv)| SessionLost { generation, kv }),
    ]
}

/// A header for `worker` of the run `run_id`.
pub fn header(run_id: u128, worker: WorkerId) -> StreamHeader {
    let engine = if worker.role == Role::Router {
        EngineShape::none()
    } else {
        EngineShape {
            total_blocks: 4096,
            block_size: 16,
            max_request_slots: 256,
            config_json: r#"{"engine":"vllm","max_num_seqs":256}"#.to_string(),
        }
    };
    StreamHeader {
        run_id: Uuid::from_u128(run_id),
        worker,
        backend: Backend::Vllm,
        policy: HandoffPolicy::SourceFirst,
        clock: ClockDomain::Virtual,
        seed: 42,
        engine,
    }
}

/// A header with arbitrary field values (the header round-trips too).
pub fn any_header() -> impl Strategy<Value = StreamHeader> {
    (
        any::<u128>(),
        worker(),
        prop_oneof![Just(Backend::Vllm), Just(Backend::Sglang), Just(Backend::TrtLlm)],
        policy(),
        prop_oneof![
            Just(ClockDomain::Virtual),
            Just(ClockDomain::Wall),
            (any::<i64>(), any::<i64>(), any::<u64>()).prop_map(
                |(origin_unix_ns, offset_ns, uncertainty_ns)| {
                    ClockDomain::WallSynced(WallClockSync { origin_unix_ns, offset_ns, uncertainty_ns })
                }
            ),
        ],
        any::<u64>(),
        any::<[u32; 3]>(),
        ".{0,40}",
    )
        .prop_map(|(run, worker, backend, policy, clock, seed, e, config_json)| StreamHeader {
            run_id: Uuid::from_u128(run),
            worker,
            backend,
            policy,
            clock,
            seed,
            engine: EngineShape {
                total_blocks: e[0],
                block_size: e[1],
                max_request_slots: e[2],
                config_json,
            },
        })
}

pub fn h(n: u128) -> HandoffId {
    HandoffId(Uuid::from_u128(n))
}

fn kvd(a: [i32; 7]) -> KvDelta {
    KvDelta {
        active: a[0],
        pinned_source: a[1],
        reserved_destination: a[2],
        cached_free: a[3],
        free: a[4],
        slots: a[5],
        headroom_tokens: a[6],
    }
}

/// The golden v1 stream's header. Never change it: the committed file encodes it.
pub fn golden_header() -> StreamHeader {
    StreamHeader {
        run_id: Uuid::from_u128(0x6f6c_6467_0000_4000_8000_0000_0000_0001),
        worker: WorkerId { role: Role::Prefill, index: 0, dp_rank: 1 },
        backend: Backend::Sglang,
        policy: HandoffPolicy::DestinationFirst,
        clock: ClockDomain::Wall,
        seed: 0xDEAD_BEEF,
        engine: EngineShape {
            total_blocks: 1000,
            block_size: 16,
            max_request_slots: 64,
            config_json: r#"{"page_size":16,"max_running_requests":64}"#.to_string(),
        },
    }
}

/// Facts of the variants (and enum values) appended to format version 1 after its golden file
/// was committed: they have a golden file of their own, written by the build that appended
/// them. Never change existing entries; append. (They too are one consistent stream.)
pub fn golden_appended_facts() -> Vec<(u64, Fact)> {
    use Fact::*;
    vec![
        (400, DecodeResumed { request: RequestId(7), stalled_ns: 2_680_809_319_678 }),
        (410, HandoffCanceled { handoff: h(7), reason: CancelReason::BootstrapTimeout }),
        (420, HandoffCanceled { handoff: h(8), reason: CancelReason::Expired }),
        (430, TransferTiming { handoff: h(3), queued_ns: 1_000, latency_ns: 5_000, moving_ns: u64::MAX - 3 }),
        (440, WorkerLeft { generation: Generation(2) }),
        (440, StreamEnded),
        // The stream drained before its end: a successor finds nothing held.
        (450, SessionLost { generation: Generation(2), kv: KvDelta::ZERO }),
    ]
}

/// The golden v1 facts, one or more per variant, with their `at_ns`: the committed
/// `golden.hlog` encodes them, so a change here needs that file regenerated (only ever with the
/// encoding itself unchanged: `golden_v1_log_decodes_unchanged` must pass on the committed file
/// first).
///
/// They are also one consistent stream (every command folds it without a contradiction, and it
/// drains): prefill-0.1 carries, besides its own source side, the destination and router facts
/// a lone stream must hold for every variant to appear. r9 runs and is canceled, leaving 16
/// cached blocks; r7 is booked, dispatched after decode-1 reserved (destination-first), hits
/// those 16 blocks, prefills and pins its 64 (h1) until the reader completes; r8 is preempted
/// and aborted; r10 never fits; r11's pin (h2) outlives its lease; h3 reserves, receives and
/// activates r12, which completes; h4 is dequeued; h5's reservation expires.
pub fn golden_facts() -> Vec<(u64, Fact)> {
    use Fact::*;
    let d = WorkerId::decode(1);
    let p = WorkerId { role: Role::Prefill, index: 0, dp_rank: 1 };
    let r = RequestId(7);
    let big = u64::MAX - 1;
    vec![
        (0, SessionStarted { generation: Generation(3) }),
        (2, RequestQueued { request: RequestId(9) }),
        (4, RequestScheduled { request: RequestId(9), cached_tokens: 0, kv: kvd([19, 0, 0, 0, -19, 1, 0]) }),
        (
            6,
            RequestFinished {
                request: RequestId(9),
                status: TerminalStatus::Canceled,
                output_tokens: 17,
                kv: kvd([-19, 0, 0, 16, 3, -1, 0]),
            },
        ),
        (10, RequestArrived { request: r, input_tokens: 1024, output_tokens: 128 }),
        (12, PrefillBooked { request: r, worker: p, prefill_tokens: 768, blocks: 64 }),
        (
            14,
            HandoffStarted {
                handoff: h(1),
                request: r,
                policy: HandoffPolicy::DestinationFirst,
                demand: KvHandoffDemand { context_tokens: 1024, max_output_tokens: 128 },
            },
        ),
        (16, DecodeBooked { request: r, worker: d, blocks: 72 }),
        (
            17,
            MessageReceived {
                handoff: h(1),
                kind: MessageKind::DestinationReserved,
                from: d,
                generation: Generation(2),
            },
        ),
        (18, PrefillDispatched { handoff: h(1) }),
        (20, RequestQueued { request: r }),
        (30, RequestScheduled { request: r, cached_tokens: 256, kv: kvd([64, 0, 0, -16, -48, 1, 0]) }),
        (32, RequestQueued { request: RequestId(8) }),
        (34, RequestScheduled { request: RequestId(8), cached_tokens: 0, kv: kvd([3, 0, 0, 0, -3, 1, 0]) }),
        (40, FirstTokenEmitted { request: r }),
        (
            45,
            StepExecuted {
                prefill_tokens: 512,
                decode_tokens: 31,
                batch_size: 32,
                duration_ns: 12_345_678,
                kv: kvd([2, 0, 0, 0, -2, 0, 0]),
            },
        ),
        (50, RequestPreempted { request: RequestId(8), kv: kvd([-5, 0, 0, 5, 0, -1, 0]) }),
        (
            60,
            RequestFinished {
                request: RequestId(8),
                status: TerminalStatus::Canceled,
                output_tokens: 0,
                kv: KvDelta::ZERO,
            },
        ),
        (70, RequestRejected { request: RequestId(10), reason: RejectReason::NeverFits }),
        (90, KvEvicted { kv: kvd([0, 0, 0, -4, 4, 0, 0]) }),
        (100, KvStored { parent: None, blocks: vec![1, 2, u64::MAX] }),
        (101, KvStored { parent: Some(0xABCD_EF01_2345_6789), blocks: vec![] }),
        (110, KvRemoved { blocks: vec![2, 3] }),
        (120, KvCleared),
        (
            150,
            SourcePinned {
                handoff: h(1),
                request: r,
                lease: SourceLeaseId(11),
                blocks: 64,
                deadline_ns: 5_000_000_150,
                kv: kvd([-64, 64, 0, 0, 0, 0, 0]),
            },
        ),
        (152, PrefillComputeDone { request: r, worker: p }),
        (155, MessageSent { handoff: h(1), kind: MessageKind::SourceReady, to: d }),
        (160, LeaseRenewed { handoff: h(1), lease: SourceLeaseId(11), deadline_ns: big }),
        (162, RequestQueued { request: RequestId(11) }),
        (164, RequestScheduled { request: RequestId(11), cached_tokens: 0, kv: kvd([8, 0, 0, 0, -8, 1, 0]) }),
        (
            166,
            SourcePinned {
                handoff: h(2),
                request: RequestId(11),
                lease: SourceLeaseId(12),
                blocks: 8,
                deadline_ns: 170,
                kv: kvd([-8, 8, 0, 0, 0, 0, 0]),
            },
        ),
        (170, LeaseExpired { handoff: h(2), lease: SourceLeaseId(12) }),
        (180, ReaderCompleted { handoff: h(1) }),
        (
            185,
            MessageRejected {
                handoff: h(1),
                kind: MessageKind::Abort,
                from: d,
                generation: Generation(1),
                why: MessageRejection::StaleGeneration,
            },
        ),
        (
            190,
            SourceReleased {
                handoff: h(1),
                lease: SourceLeaseId(11),
                reason: EndReason::Success,
                kv: kvd([0, -64, 0, 64, 0, -1, 0]),
            },
        ),
        (
            191,
            SourceReleased {
                handoff: h(2),
                lease: SourceLeaseId(12),
                reason: EndReason::Canceled(CancelReason::PeerLost),
                kv: kvd([0, -8, 0, 0, 8, -1, 0]),
            },
        ),
        (195, PrefillBookingFreed { request: r, worker: p }),
        (200, DestinationRouted { handoff: h(3), worker: d }),
        (210, ReservationQueued { handoff: h(3) }),
        (220, ReservationRefused { handoff: h(3), reason: RejectReason::NoCapacity }),
        (225, ReservationQueued { handoff: h(4) }),
        (230, ReservationDequeued { handoff: h(4), reason: CancelReason::RequestAborted }),
        (
            240,
            DestinationReserved {
                handoff: h(3),
                request: RequestId(12),
                reservation: DestinationReservationId(21),
                pages: 40,
                prefix_blocks: 24,
                prefix_tokens: 384,
                deadline_ns: 9_000_000_000,
                kv: kvd([0, 0, 40, 0, -40, 1, 128]),
            },
        ),
        (250, ReceiveStarted { handoff: h(3), from: p, bytes: 1 << 33 }),
        (260, ReceiveCompleted { handoff: h(3) }),
        (
            270,
            DestinationActivated {
                handoff: h(3),
                reservation: DestinationReservationId(21),
                kv: kvd([40, 0, -40, 0, 0, 0, -128]),
            },
        ),
        (275, RequestScheduled { request: RequestId(12), cached_tokens: 384, kv: KvDelta::ZERO }),
        (
            277,
            DestinationReserved {
                handoff: h(5),
                request: RequestId(13),
                reservation: DestinationReservationId(22),
                pages: 10,
                prefix_blocks: 0,
                prefix_tokens: 0,
                deadline_ns: 280,
                kv: kvd([0, 0, 10, 0, -10, 1, 64]),
            },
        ),
        (280, ReservationExpired { handoff: h(5), reservation: DestinationReservationId(22) }),
        (
            290,
            ReservationReleased {
                handoff: h(5),
                reservation: DestinationReservationId(22),
                reason: EndReason::Expired,
                kv: kvd([0, 0, -10, 0, 10, -1, -64]),
            },
        ),
        (300, HandoffCanceled { handoff: h(6), reason: CancelReason::Teardown }),
        (
            360,
            RequestFinished {
                request: RequestId(12),
                status: TerminalStatus::Completed,
                output_tokens: 128,
                kv: kvd([-40, 0, 0, 40, 0, -1, 0]),
            },
        ),
        (370, DecodeBookingFreed { request: r, worker: d, status: TerminalStatus::Completed }),
    ]
}
