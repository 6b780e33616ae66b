//! The post-mortem's report types: what `inspect --json` serializes, key for key (the module
//! docs of [`crate::projections::inspect`] list the keys).

use super::InspectOptions;
use crate::events::MessageKind;
use crate::ids::{HandoffId, RequestId, WorkerId};
use crate::lifecycle::policy::Milestone;
use crate::projections::decode_stalls::{DecodeHolBlocking, PreemptionStorms};
use crate::projections::distribution::Stats;
use crate::units::ms;
use serde::Serialize;
use std::collections::BTreeMap;

/// What the run was.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunInfo {
    pub run_id: String,
    pub backend: String,
    pub policy: String,
    pub seed: u64,
    pub workers: Vec<WorkerInfo>,
    pub records: u64,
    pub first_at_ms: f64,
    pub last_at_ms: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerInfo {
    pub worker: WorkerId,
    pub total_blocks: u32,
    pub block_size: u32,
}

/// One prefill worker's stalled interval (hot pins and stalled admission).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StallInterval {
    pub worker: WorkerId,
    pub started_at_ms: f64,
    /// `None` when the run ended inside the stall.
    pub ended_at_ms: Option<f64>,
    pub duration_ms: f64,
    /// Pinned share when the stall started.
    pub pinned_at_start_pct: f64,
    pub peak_pinned_pct: f64,
    /// The request that had waited longest when the stall started, and since when.
    pub oldest_waiting_request: Option<RequestId>,
    pub oldest_waiting_since_ms: Option<f64>,
    /// Most requests waiting (queued, unscheduled) at any settled instant of the stall.
    pub peak_waiting: u64,
}

/// A decode worker's part in a trigger.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DecodePressure {
    pub worker: WorkerId,
    /// `kv_used` share when the episode started.
    pub kv_used_at_start_pct: f64,
    /// Highest settled `kv_used` share from the episode's start to the cascade.
    pub peak_kv_used_pct: f64,
    pub peak_kv_used_at_ms: f64,
    /// Reservations queued / refused on this worker from the episode's start to the cascade.
    pub reservations_queued: u64,
    pub reservations_refused: u64,
    /// Why the worker counted as under pressure when it first did in the episode.
    pub reason: String,
}

/// A prefill worker's pin rise from the trigger to its stall.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PinRise {
    pub worker: WorkerId,
    pub pinned_at_trigger_pct: f64,
    pub pinned_at_stall_pct: f64,
    pub stalled_at_ms: f64,
}

/// What set a cascade off.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Trigger {
    /// `decode_exhaustion` when a decode-pressure episode preceded the stall.
    pub kind: &'static str,
    pub at_ms: f64,
    pub decode_workers: Vec<DecodePressure>,
    pub pin_rise: Vec<PinRise>,
    /// One sentence a person reads first.
    pub summary: String,
}

/// The stranding cascade.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Cascade {
    pub started_at_ms: f64,
    /// Every prefill worker that stalled, in canonical order.
    pub workers: Vec<WorkerId>,
    /// `None` if no decode pressure preceded the stall (then the pins have another cause).
    pub trigger: Option<Trigger>,
    /// Every stall interval, by worker then time (at most
    /// [`MAX_INTERVALS_PER_WORKER`](super::MAX_INTERVALS_PER_WORKER) each).
    pub intervals: Vec<StallInterval>,
    pub intervals_not_shown: u64,
    pub summary: String,
}

/// Reservations that waited in decode FIFOs ahead of prefill dispatch.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Gating {
    /// Handoffs whose reservation queued before their prefill was dispatched.
    pub handoffs: u64,
    pub first_queued_at_ms: f64,
    /// Queue wait (queued → reserved, or → run end / dequeue) of those handoffs.
    pub wait_ms: Stats,
    pub per_worker: Vec<GatingWorker>,
    pub summary: String,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GatingWorker {
    pub worker: WorkerId,
    pub handoffs: u64,
    pub peak_pending: u64,
    pub peak_pending_at_ms: f64,
    /// Settled time during which the FIFO was not empty.
    pub pending_ms: f64,
}

/// A peak and when it was first reached (settled states).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct PeakAt {
    pub value: u64,
    pub at_ms: f64,
}

impl PeakAt {
    pub(super) fn see(&mut self, value: u64, at_ns: u64) {
        if value > self.value {
            *self = PeakAt { value, at_ms: ms(at_ns) };
        }
    }
}

/// One engine worker's peaks.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerPeaks {
    pub worker: WorkerId,
    pub total_blocks: u64,
    pub active: PeakAt,
    pub pinned_source: PeakAt,
    pub reserved_destination: PeakAt,
    pub kv_used: PeakAt,
    pub waiting: PeakAt,
    pub running: PeakAt,
    pub held_prefills: PeakAt,
    pub pending_reservations: PeakAt,
}

/// One of the longest-pinned handoffs with its full cross-worker timeline.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PinnedHandoff {
    pub rank: usize,
    pub handoff: HandoffId,
    pub request: Option<RequestId>,
    pub source: Option<WorkerId>,
    pub destination: Option<WorkerId>,
    pub pinned_ms: f64,
    /// True when the pin had not ended when the log did.
    pub still_pinned: bool,
    pub pinned_blocks: u32,
    pub outcome: String,
    pub normalized: Vec<Milestone>,
    pub timeline: Vec<TimelineStep>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TimelineStep {
    pub at_ms: f64,
    /// Since the previous step of this handoff.
    pub delta_ms: f64,
    pub worker: WorkerId,
    pub fact: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<MessageKind>,
}

/// One phase of handoff time.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Phase {
    pub phase: &'static str,
    pub meaning: &'static str,
    pub total_ms: f64,
    pub stats_ms: Stats,
}

/// How handoffs ended.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Outcomes {
    pub completed: u64,
    pub lease_expired: u64,
    pub reservation_expired: u64,
    pub canceled: u64,
    pub canceled_by_reason: BTreeMap<&'static str, u64>,
    pub in_flight_at_end: u64,
}

/// Where handoff time went.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WaitBreakdown {
    pub handoffs: u64,
    pub phases: Vec<Phase>,
    pub outcomes: Outcomes,
}

/// A stretch during which bookings and occupancy disagreed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Divergence {
    pub worker: WorkerId,
    /// `overbooked` (booked blocks exceed the worker's total) or `unbooked_pins` (physical
    /// pins with no prefill booking on the worker).
    pub kind: &'static str,
    pub started_at_ms: f64,
    pub ended_at_ms: Option<f64>,
    pub duration_ms: f64,
    /// The worst value during the stretch: booked blocks (overbooked) or pinned blocks.
    pub worst_blocks: u64,
}

/// Router bookings beside physical occupancy for one worker.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BookingRow {
    pub worker: WorkerId,
    pub total_blocks: u64,
    pub peak_booked: PeakAt,
    pub peak_kv_used: PeakAt,
    /// Largest settled `booked − kv_used` (router thinks fuller than it is).
    pub max_booked_over_used: PeakAt,
    /// Largest settled `kv_used − booked` (physically fuller than the router thinks).
    pub max_used_over_booked: PeakAt,
    pub overbooked_ms: f64,
    pub unbooked_pins_ms: f64,
    /// Booked and used blocks over time: at most [`BOOKING_SERIES_BUCKETS`] time buckets, each
    /// keeping its first, last, minimum and maximum points (every point a settled state).
    pub series: Vec<BookingPoint>,
}

/// Time buckets of a booking series.
pub const BOOKING_SERIES_BUCKETS: usize = 24;

/// Router-booked beside physically used blocks at one settled instant.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct BookingPoint {
    pub at_ms: f64,
    pub booked: u64,
    pub kv_used: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Bookings {
    pub workers: Vec<BookingRow>,
    pub divergences: Vec<Divergence>,
    pub divergences_not_shown: u64,
}

/// The post-mortem.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct InspectReport {
    pub run: RunInfo,
    pub options: InspectOptions,
    pub cascade: Option<Cascade>,
    pub gating: Option<Gating>,
    pub preemption_storms: PreemptionStorms,
    pub decode_hol_blocking: DecodeHolBlocking,
    pub peaks: Vec<WorkerPeaks>,
    pub longest_pinned: Vec<PinnedHandoff>,
    pub wait_breakdown: WaitBreakdown,
    pub bookings: Bookings,
    /// Workers whose stream stopped without its end marker while the others went on.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub workers_lost: Vec<WorkerLoss>,
    /// Workers whose stream lacks the end marker (the run did not end cleanly). Not in the
    /// JSON: the command says it on stderr.
    #[serde(skip)]
    pub unended: Vec<WorkerId>,
}

/// A worker whose stream stopped mid-run (see `lost`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerLoss {
    pub worker: WorkerId,
    pub stopped_at_ms: f64,
    /// Handoff roles its peers ended because it was gone (`PeerLost`: their own link to it
    /// ended, or the frontend, failing the request, said so).
    pub peer_roles_ended: u64,
    pub by_peer: Vec<(String, u64)>,
    /// Requests placed on it that failed.
    pub failed_requests: u64,
    /// A restarted process took over its stream (`SessionLost`): the run went on with it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub taken_over: Option<SessionTakeover>,
}

/// A lost session's successor, as its stream's `SessionLost` record says.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SessionTakeover {
    pub at_ms: f64,
    pub lost_generation: u32,
    /// Blocks the dead session held (active, pinned, reserved), returned to free.
    pub blocks_held: u64,
    /// Cached blocks the dead session's cache had (gone with its process).
    pub cached_blocks: u64,
    pub slots_held: u64,
}
