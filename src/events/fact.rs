//! Facts: the past-tense records every role appends to its own stream.
//!
//! Format version 1. Facts are encoded by the codec module (bincode, variant index first), so the
//! **order of variants and fields is part of the on-disk format**: append new variants at the
//! end and bump [`crate::events::FORMAT_VERSION`] for anything else. The golden log under
//! `fixtures/golden/` fails the tests if this file changes the encoding by accident.
//!
//! Physical KV ownership is exact by construction: every fact that moves blocks between
//! ownership classes carries the [`KvDelta`] it caused, and the capacity projection is the sum of
//! those deltas over a stream. A delta always sums to zero over the five block classes (blocks
//! are conserved); request slots and decode headroom ride beside it and never enter that sum.

use crate::ids::{
    CancelReason, DestinationReservationId, EndReason, Generation, HandoffId, HandoffPolicy, KvHandoffDemand,
    RequestId, SourceLeaseId, WorkerId,
};
use serde::{Deserialize, Serialize};

pub use crate::model::delta::KvDelta;
pub use crate::model::request::BlockHash;

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum TerminalStatus {
    Completed,
    /// The engine refused it (e.g. the prompt can never fit).
    Rejected,
    /// Its handoff failed (lease or reservation expired, transfer failed, peer lost).
    Failed,
    Canceled,
}

impl TerminalStatus {
    /// The reference's per-request `terminal_status` spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            TerminalStatus::Completed => "completed",
            TerminalStatus::Rejected => "rejected",
            TerminalStatus::Failed => "failed",
            TerminalStatus::Canceled => "canceled",
        }
    }
}

/// Why an engine refused a request or a reservation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RejectReason {
    /// The prompt needs more blocks than the worker has in total.
    NeverFits,
    /// Not enough free capacity right now (a reservation will retry when capacity changes).
    NoCapacity,
    /// No request slot is free (SGLang slot pool).
    NoSlot,
    /// The backend does not support the operation (TRT-LLM destination reservation).
    Unsupported,
}

impl RejectReason {
    /// The per-request report's `terminal_reason` spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::NeverFits => "never-fits",
            RejectReason::NoCapacity => "no-capacity",
            RejectReason::NoSlot => "no-slot",
            RejectReason::Unsupported => "unsupported",
        }
    }
}

/// The kinds of message that cross between the two roles of a handoff.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum MessageKind {
    SourceReady,
    DestinationReserved,
    ReceiveCompleted,
    ReaderCompleted,
    Abort,
    LeaseRenewal,
}

/// Why a received message was not applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MessageRejection {
    /// Sent by an older incarnation of the peer.
    StaleGeneration,
    /// Already applied; a no-op.
    Duplicate,
    /// Arrived after the handoff was released.
    Late,
    /// No handoff with that id on this worker.
    UnknownHandoff,
    /// Not valid in the handoff's current state.
    InvalidTransition,
}

/// One past-tense fact. See the module docs for the format rules.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Fact {
    // ----- worker sessions -----
    /// A worker incarnation began (first record of every live stream; replay writes one too).
    SessionStarted { generation: Generation },

    // ----- requests (router stream and engine streams) -----
    /// The frontend received a request.
    RequestArrived { request: RequestId, input_tokens: u32, output_tokens: u32 },
    /// The engine queued the request as waiting work.
    RequestQueued { request: RequestId },
    /// The engine scheduled the request into its running batch; `kv` is the prompt allocation.
    RequestScheduled { request: RequestId, cached_tokens: u32, kv: KvDelta },
    /// The engine produced the request's first output token.
    FirstTokenEmitted { request: RequestId },
    /// The engine preempted (or SGLang retracted) a running request back to waiting.
    RequestPreempted { request: RequestId, kv: KvDelta },
    /// The request reached a terminal outcome on this stream; `kv` returns what it held.
    RequestFinished { request: RequestId, status: TerminalStatus, output_tokens: u32, kv: KvDelta },
    /// The engine refused the request without running it.
    RequestRejected { request: RequestId, reason: RejectReason },

    // ----- engine steps -----
    /// One forward pass. `kv` covers allocations made during the step that no other fact names
    /// (prefill chunks of already-running requests, decode growth).
    StepExecuted { prefill_tokens: u32, decode_tokens: u32, batch_size: u32, duration_ns: u64, kv: KvDelta },
    /// Cached-free blocks were evicted outside an allocation (rare; allocations fold their own
    /// evictions into their delta).
    KvEvicted { kv: KvDelta },

    // ----- KV index visibility -----
    /// Blocks became valid and reusable under these hashes.
    KvStored { parent: Option<BlockHash>, blocks: Vec<BlockHash> },
    /// Blocks stopped being reusable under these hashes.
    KvRemoved { blocks: Vec<BlockHash> },
    /// Everything this worker had published is gone.
    KvCleared,

    // ----- handoff lifecycle, source role -----
    /// A handoff began on this worker (both roles record it).
    HandoffStarted { handoff: HandoffId, request: RequestId, policy: HandoffPolicy, demand: KvHandoffDemand },
    /// The prefill for this handoff was dispatched to the source engine.
    PrefillDispatched { handoff: HandoffId },
    /// Terminal prefill ownership became a held source pin, atomically (active → pinned).
    SourcePinned {
        handoff: HandoffId,
        request: RequestId,
        lease: SourceLeaseId,
        blocks: u32,
        deadline_ns: u64,
        kv: KvDelta,
    },
    /// The source's lease was extended.
    LeaseRenewed { handoff: HandoffId, lease: SourceLeaseId, deadline_ns: u64 },
    /// The source's lease deadline passed before its readers completed.
    LeaseExpired { handoff: HandoffId, lease: SourceLeaseId },
    /// All readers acknowledged the transfer.
    ReaderCompleted { handoff: HandoffId },
    /// The pin ended (exactly once per lease): blocks return to the cache or are freed.
    SourceReleased { handoff: HandoffId, lease: SourceLeaseId, reason: EndReason, kv: KvDelta },

    // ----- handoff lifecycle, destination role -----
    /// The decode router picked this worker as the destination.
    DestinationRouted { handoff: HandoffId, worker: WorkerId },
    /// The reservation waits in the pending FIFO for capacity.
    ReservationQueued { handoff: HandoffId },
    /// A reservation attempt found no capacity; it stays queued.
    ReservationRefused { handoff: HandoffId, reason: RejectReason },
    /// A queued reservation left the FIFO without ever reserving (canceled while pending).
    ReservationDequeued { handoff: HandoffId, reason: CancelReason },
    /// The destination reserved slot, prefix snapshot, delta pages and headroom.
    DestinationReserved {
        handoff: HandoffId,
        request: RequestId,
        reservation: DestinationReservationId,
        /// Fresh pages allocated for the missing prompt (not valid until activation).
        pages: u32,
        /// Locally cached prefix blocks locked for this handoff.
        prefix_blocks: u32,
        /// Prompt tokens covered by the locked prefix (page-aligned).
        prefix_tokens: u32,
        deadline_ns: u64,
        kv: KvDelta,
    },
    /// Transfer into the reservation began.
    ReceiveStarted { handoff: HandoffId, from: WorkerId, bytes: u64 },
    /// Destination KV is valid; decode may activate.
    ReceiveCompleted { handoff: HandoffId },
    /// The reservation became an active request (reserved → active); the request is queued.
    DestinationActivated { handoff: HandoffId, reservation: DestinationReservationId, kv: KvDelta },
    /// The reservation's deadline passed before activation.
    ReservationExpired { handoff: HandoffId, reservation: DestinationReservationId },
    /// The reservation ended without activation (exactly once per reservation).
    ReservationReleased {
        handoff: HandoffId,
        reservation: DestinationReservationId,
        reason: EndReason,
        kv: KvDelta,
    },

    // ----- handoff lifecycle, both roles -----
    /// The handoff was canceled on this role.
    HandoffCanceled { handoff: HandoffId, reason: CancelReason },
    /// A handoff message left this worker.
    MessageSent { handoff: HandoffId, kind: MessageKind, to: WorkerId },
    /// A handoff message arrived and was applied.
    MessageReceived { handoff: HandoffId, kind: MessageKind, from: WorkerId, generation: Generation },
    /// A handoff message arrived and was not applied.
    MessageRejected {
        handoff: HandoffId,
        kind: MessageKind,
        from: WorkerId,
        generation: Generation,
        why: MessageRejection,
    },

    // ----- router bookings (router stream) -----
    /// The prefill router selected a worker and booked the prefill's compute and blocks.
    PrefillBooked { request: RequestId, worker: WorkerId, prefill_tokens: u32, blocks: u32 },
    /// Prefill compute finished: compute load drops, the booking stays until source release.
    PrefillComputeDone { request: RequestId, worker: WorkerId },
    /// The prefill booking ended (source released, or the request ended).
    PrefillBookingFreed { request: RequestId, worker: WorkerId },
    /// The decode router selected a worker and booked the request's estimated blocks.
    DecodeBooked { request: RequestId, worker: WorkerId, blocks: u32 },
    /// The decode booking ended at the request's terminal outcome.
    DecodeBookingFreed { request: RequestId, worker: WorkerId, status: TerminalStatus },

    // ----- appended after format version 1 shipped (new variants go last) -----
    /// A request preempted (vLLM) or retracted (SGLang) after producing output produced its
    /// next token: `stalled_ns` is the gap since its previous token, which step facts cannot
    /// show (the stall is an inter-token latency like any other, only a long one).
    DecodeResumed { request: RequestId, stalled_ns: u64 },
    /// With NIC contention modeled, how a finished transfer's time split (destination stream,
    /// just before `ReceiveCompleted`): waiting for a transfer slot on both NICs, the fixed
    /// latency, and moving bytes at its share of the bandwidth.
    TransferTiming { handoff: HandoffId, queued_ns: u64, latency_ns: u64, moving_ns: u64 },
    /// The worker left the cluster for good (its last record before the end marker): it was taken out
    /// of routing by a planned or planner-decided scale-down, finished everything it held, and
    /// `generation` was its last incarnation. Worker-seconds count its stream up to here.
    WorkerLeft { generation: Generation },
    /// The writer's last record on a clean end of the run. A stream whose last record is not
    /// this one was cut short (a crash, a kill, an error mid-run): readers say the run is
    /// incomplete rather than fold partial figures as if they were whole.
    StreamEnded,
    /// A restarted live process took over the stream of this worker's incarnation `generation`,
    /// which died without ending it (written before the new `SessionStarted`). Whatever that
    /// session held went with its process: `kv` returns every block, slot and headroom token the
    /// stream's own fold says it held to free (the new process starts from an empty pool), and
    /// its queued requests and handoff roles end here. Its peers and the frontend ended their
    /// sides when the worker was lost.
    SessionLost { generation: Generation, kv: KvDelta },
}

impl Fact {
    /// The handoff this fact concerns, if any (used by `show --handoff` and the index).
    pub fn handoff(&self) -> Option<HandoffId> {
        use Fact::*;
        match self {
            HandoffStarted { handoff, .. }
            | PrefillDispatched { handoff }
            | SourcePinned { handoff, .. }
            | LeaseRenewed { handoff, .. }
            | LeaseExpired { handoff, .. }
            | ReaderCompleted { handoff }
            | SourceReleased { handoff, .. }
            | DestinationRouted { handoff, .. }
            | ReservationQueued { handoff }
            | ReservationRefused { handoff, .. }
            | ReservationDequeued { handoff, .. }
            | DestinationReserved { handoff, .. }
            | ReceiveStarted { handoff, .. }
            | ReceiveCompleted { handoff }
            | DestinationActivated { handoff, .. }
            | ReservationExpired { handoff, .. }
            | ReservationReleased { handoff, .. }
            | HandoffCanceled { handoff, .. }
            | MessageSent { handoff, .. }
            | MessageReceived { handoff, .. }
            | MessageRejected { handoff, .. }
            | TransferTiming { handoff, .. } => Some(*handoff),
            _ => None,
        }
    }

    /// The request this fact concerns, if it names one directly.
    pub fn request(&self) -> Option<RequestId> {
        use Fact::*;
        match self {
            RequestArrived { request, .. }
            | RequestQueued { request }
            | RequestScheduled { request, .. }
            | FirstTokenEmitted { request }
            | RequestPreempted { request, .. }
            | RequestFinished { request, .. }
            | RequestRejected { request, .. }
            | HandoffStarted { request, .. }
            | SourcePinned { request, .. }
            | DestinationReserved { request, .. }
            | PrefillBooked { request, .. }
            | PrefillComputeDone { request, .. }
            | PrefillBookingFreed { request, .. }
            | DecodeBooked { request, .. }
            | DecodeBookingFreed { request, .. }
            | DecodeResumed { request, .. } => Some(*request),
            _ => None,
        }
    }

    /// The physical ownership change this fact carries (zero for facts that move nothing).
    pub fn kv_delta(&self) -> KvDelta {
        use Fact::*;
        match self {
            RequestScheduled { kv, .. }
            | RequestPreempted { kv, .. }
            | RequestFinished { kv, .. }
            | StepExecuted { kv, .. }
            | KvEvicted { kv }
            | SourcePinned { kv, .. }
            | SourceReleased { kv, .. }
            | DestinationReserved { kv, .. }
            | DestinationActivated { kv, .. }
            | ReservationReleased { kv, .. }
            | SessionLost { kv, .. } => *kv,
            _ => KvDelta::ZERO,
        }
    }

    /// The variant's name, as `show` prints it.
    pub fn name(&self) -> &'static str {
        use Fact::*;
        match self {
            SessionStarted { .. } => "SessionStarted",
            RequestArrived { .. } => "RequestArrived",
            RequestQueued { .. } => "RequestQueued",
            RequestScheduled { .. } => "RequestScheduled",
            FirstTokenEmitted { .. } => "FirstTokenEmitted",
            RequestPreempted { .. } => "RequestPreempted",
            RequestFinished { .. } => "RequestFinished",
            RequestRejected { .. } => "RequestRejected",
            StepExecuted { .. } => "StepExecuted",
            KvEvicted { .. } => "KvEvicted",
            KvStored { .. } => "KvStored",
            KvRemoved { .. } => "KvRemoved",
            KvCleared => "KvCleared",
            HandoffStarted { .. } => "HandoffStarted",
            PrefillDispatched { .. } => "PrefillDispatched",
            SourcePinned { .. } => "SourcePinned",
            LeaseRenewed { .. } => "LeaseRenewed",
            LeaseExpired { .. } => "LeaseExpired",
            ReaderCompleted { .. } => "ReaderCompleted",
            SourceReleased { .. } => "SourceReleased",
            DestinationRouted { .. } => "DestinationRouted",
            ReservationQueued { .. } => "ReservationQueued",
            ReservationRefused { .. } => "ReservationRefused",
            ReservationDequeued { .. } => "ReservationDequeued",
            DestinationReserved { .. } => "DestinationReserved",
            ReceiveStarted { .. } => "ReceiveStarted",
            ReceiveCompleted { .. } => "ReceiveCompleted",
            DestinationActivated { .. } => "DestinationActivated",
            ReservationExpired { .. } => "ReservationExpired",
            ReservationReleased { .. } => "ReservationReleased",
            HandoffCanceled { .. } => "HandoffCanceled",
            MessageSent { .. } => "MessageSent",
            MessageReceived { .. } => "MessageReceived",
            MessageRejected { .. } => "MessageRejected",
            PrefillBooked { .. } => "PrefillBooked",
            PrefillComputeDone { .. } => "PrefillComputeDone",
            PrefillBookingFreed { .. } => "PrefillBookingFreed",
            DecodeBooked { .. } => "DecodeBooked",
            DecodeBookingFreed { .. } => "DecodeBookingFreed",
            DecodeResumed { .. } => "DecodeResumed",
            TransferTiming { .. } => "TransferTiming",
            WorkerLeft { .. } => "WorkerLeft",
            StreamEnded => "StreamEnded",
            SessionLost { .. } => "SessionLost",
        }
    }
}

impl crate::model::capacity::KvCapacitySnapshot {
    /// Applies the delta a fact carries (facts that move nothing leave the snapshot as it is).
    pub fn apply_fact(&mut self, fact: &Fact) -> Result<(), crate::model::capacity::CapacityViolation> {
        let d = fact.kv_delta();
        if d.is_zero() {
            return Ok(());
        }
        self.apply(&d)
    }
}
