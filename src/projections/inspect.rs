//! The post-mortem of a run (`handoff-log inspect`): did a stranding cascade happen, what set it
//! off, did decode workers thrash on preemption or block behind their queue's head, where
//! handoff time went, and where router bookings and physical occupancy parted ways.
//!
//! ## Settled instants
//! Records of one instant (`at_ns`) are applied together; every condition below is judged on
//! the *settled* state after the last record of an instant, which then holds until the next
//! instant. Transient states inside one instant (a release and a reservation stamped with the
//! same time, ordered only by stream index) are not real occupancy and never count.
//!
//! ## Definitions
//! * **Hot pins.** A prefill worker's pins are hot while
//!   `pinned_source_blocks × 100 ≥ pin_threshold_pct × total_blocks` (default 50 %).
//! * **Stalled admission.** A prefill worker's admission is stalled at `t` while some request
//!   it queued (`RequestQueued`, or re-queued by `RequestPreempted`) has not been scheduled
//!   since `t − stall_ms` or earlier (default 1000 ms).
//! * **Stranding cascade on a prefill worker**: an interval during which its pins are hot *and*
//!   its admission is stalled. It starts at the first instant both hold (exactly: the later of
//!   the instant pins became hot and `oldest_queued_at + stall_ms`) and ends at the first settled
//!   instant either stops holding — unless both hold again within `stall_ms` of that end, in
//!   which case it is the same interval (a release that admits one request and is at once
//!   followed by new pins does not end a cascade). The run's cascade is the first such
//!   interval on any worker; `workers` lists every prefill worker that stalled.
//! * **Decode pressure.** A decode worker is under pressure at a settled instant when
//!   `kv_used × 100 ≥ decode_full_pct × total` (default 95 %), or its reservation FIFO is not
//!   empty, or it refused a reservation (`ReservationRefused`) at that instant. The cluster is
//!   under pressure while any decode worker is. Pressure episodes separated by less than
//!   `stall_ms` merge into one (so a worker hovering around the threshold is one episode).
//! * **Trigger** of a cascade: the decode-pressure episode in progress (or the last one ended)
//!   when the cascade started, reported by its start, the decode workers under pressure and
//!   their peak `kv_used` up to the cascade, reservations queued and refused, and each stalled
//!   prefill worker's pinned share at the trigger and at the stall (the rise).
//! * **Destination gating** (SGLang-style, reported as its own finding, never as a cascade): a
//!   reservation that waited in a decode FIFO (`ReservationQueued`) before its prefill was
//!   dispatched. Capacity waiting happens ahead of prefill, so source KV is not stranded.
//! * **Preemption storm** on a decode (or aggregated) worker: a burst of `RequestPreempted`
//!   facts (vLLM preemption, SGLang retraction). A window qualifies at an instant `τ` when at
//!   least `storm_preemptions` (default 10) of the worker's preemptions fall in
//!   `(τ − storm_window_ms, τ]` (default 1000 ms). A storm starts at the instant of the
//!   preemption that first makes a window qualify, and ends when the count drops below the
//!   threshold (exactly: when its window's oldest preemption ages out, unless preemptions at
//!   that very instant keep it full) — unless a window qualifies again while it still holds one
//!   of the storm's preemptions (before the storm's last preemption + `storm_window_ms`): such
//!   consecutive windows overlap, so the storm resumes and its end moves on. Its preemptions are
//!   those of its first window and every later one until it ends (none is in two storms). Its
//!   longest stall is the longest `DecodeResumed::stalled_ns` of a stall that began with one of
//!   its preemptions; `kv_used` is the settled share at the instant it started.
//! * **Decode head-of-line blocking** on a decode (or aggregated) worker: a stretch during which
//!   its scheduler view's `waiting` is non-empty (activated destinations waiting for admission,
//!   preempted requests waiting to resume, queued requests on an aggregated worker), no
//!   `RequestScheduled` happens on the worker, and the worker keeps stepping. Exactly: it starts
//!   at the later of the worker's last `RequestScheduled` and the settled instant its waiting
//!   queue became non-empty (no `stall_ms` is added: the start is when the queue last moved);
//!   it ends at the first settled instant a request is scheduled or the queue is empty (or at the
//!   run's end); it counts when it lasted at least `stall_ms` and never went `stall_ms` or more
//!   without a `StepExecuted` (from its start to its end), so an idle worker is not blocked.
//!   Its head is the request both engines admit next: the most recently preempted waiting
//!   request (preemption puts a request back at the front of the queue), else the one queued
//!   first. The head's need is the blocks it gave back at its last preemption (omitted when it
//!   was never preempted there), beside free plus cached-free blocks at the stretch's start.
//!   Any scheduling ends a stretch, also one that lets a request holding KV past the blocked
//!   head (vLLM does when nothing runs), so a head starved for long shows as back-to-back
//!   intervals naming the same head.
//!
//! ## Report (`--json` keys)
//! [`InspectReport`] serializes with these top-level keys: `run` (ids, backend, policy, streams,
//! records, time span), `options` (the thresholds above), `cascade` (`null` when none; else
//! `started_at_ms`, `workers`, `trigger` (`null` if no decode pressure preceded the stall; else
//! `kind`, `at_ms`, `decode_workers`, `pin_rise`, `summary`), `intervals`, `summary`), `gating`
//! (`null` when none), `preemption_storms` (`per_worker` totals, then `storms`: `worker`,
//! `started_at_ms`, `ended_at_ms` (`null` if the run ended inside), `duration_ms`,
//! `preemptions`, `requests`, `most_preempted_request`, `most_preempted_times`,
//! `longest_stall_ms` and `longest_stall_request` (`null` if none resumed),
//! `kv_used_at_start_pct`; and `storms_not_shown`), `decode_hol_blocking` (`per_worker` totals,
//! then `intervals`: `worker`, `started_at_ms`, `ended_at_ms`, `duration_ms`, `peak_waiting`,
//! `head_request`, `free_blocks_at_start` and, when known, `head_need_blocks`; and
//! `intervals_not_shown`; both lists are empty when none were found), `peaks` (per engine
//! worker: value and `at_ms` of active, pinned, reserved, kv_used blocks and of each queue),
//! `longest_pinned` (with every transition: `at_ms`, `delta_ms`, `worker`, `fact`, `message`),
//! `wait_breakdown` (`phases` with totals and distributions, `outcomes`) and `bookings` (per
//! worker peaks of booked and used blocks, their largest gaps, a bounded `series` of both over
//! time, and `divergences`). Times are ms on the run's clock.
//!
//! ## Cost
//! One streaming pass folds capacity, queues, bookings, per-handoff milestones (only while a
//! handoff is unfinished), decode storm windows (the last `storm_preemptions` preemptions per
//! worker) and bounded-memory distributions; it keeps the ids of the `top_n`
//! longest-pinned handoffs. A second pass over the same run collects the full cross-worker
//! transitions of just those `top_n` handoffs. Memory grows with requests and handoffs in
//! flight, never with the length of the log.

use crate::events::{Fact, MessageKind, Record, RejectReason, RunReader, StreamHeader};
use crate::ids::{CancelReason, EndReason, HandoffId, HandoffPolicy, RequestId, Role, WorkerId};
use crate::lifecycle::policy::Milestone;
use crate::projections::capacity::KvCapacitySnapshot;
use crate::projections::decode_stalls::DecodeWatch;
pub use crate::projections::decode_stalls::{
    DecodeHolBlocking, HolInterval, HolWorker, PreemptionStorm, PreemptionStorms, StormWorker,
};
use crate::projections::distribution::{Distribution, Stats};
use crate::projections::handoffs::HandoffLedger;
use crate::projections::run::ProjectError;
use crate::projections::scheduler::SchedulerFold;
use crate::projections::timeline::{Downsampler, Sample};
use crate::schedulers::SchedulerView;
use crate::units::{ms, NS_PER_MS, NS_PER_MS_F64};
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::path::Path;

/// Stall intervals and divergence intervals kept per worker (the rest are only counted).
pub const MAX_INTERVALS_PER_WORKER: usize = 64;
/// Finished handoffs remembered so that stray late facts (a message arriving after both roles
/// ended) do not reopen them. Bounded; older ids are forgotten.
const FINISHED_MEMORY: usize = 1 << 16;

pub(crate) fn pct(part: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        // One decimal is what a person reads; rounding here keeps snapshots stable.
        (part as f64 * 1000.0 / total as f64).round() / 10.0
    }
}

/// Thresholds of the definitions in the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct InspectOptions {
    /// How many longest-pinned handoffs to report with their full timelines.
    pub top_n: usize,
    /// Pinned share of a prefill worker's blocks at which its pins count as hot.
    pub pin_threshold_pct: u32,
    /// How long a queued prefill request must wait unscheduled for admission to count as
    /// stalled (also the merge gap of decode-pressure episodes).
    pub stall_ms: u64,
    /// Decode `kv_used` share at which a decode worker counts as full.
    pub decode_full_pct: u32,
    /// Preemptions within `storm_window_ms` on one worker that make a preemption storm.
    pub storm_preemptions: u32,
    /// The sliding window of a preemption storm.
    pub storm_window_ms: u64,
}

impl Default for InspectOptions {
    fn default() -> Self {
        InspectOptions {
            top_n: 5,
            pin_threshold_pct: 50,
            stall_ms: 1000,
            decode_full_pct: 95,
            storm_preemptions: 10,
            storm_window_ms: 1000,
        }
    }
}

// ------------------------------------------------------------------------------------------
// Report types
// ------------------------------------------------------------------------------------------

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
    /// Every stall interval, by worker then time (at most [`MAX_INTERVALS_PER_WORKER`] each).
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
    fn see(&mut self, value: u64, at_ns: u64) {
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
}

// ------------------------------------------------------------------------------------------
// Fold state
// ------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct OpenStall {
    start_ns: u64,
    pinned_at_start_pct: f64,
    peak_pinned_pct: f64,
    oldest: Option<(u64, RequestId)>,
    peak_waiting: u64,
}

#[derive(Clone, Debug)]
struct OpenDivergence {
    start_ns: u64,
    worst: u64,
}

struct WorkerState {
    worker: WorkerId,
    cap: KvCapacitySnapshot,
    sched: SchedulerFold,
    /// The scheduler view, recomputed at a settled instant only if the stream changed.
    view: SchedulerView,
    dirty: bool,
    peaks: WorkerPeaks,
    /// Prefill admission: requests queued and not scheduled, with when they queued.
    waiting_since: BTreeMap<RequestId, u64>,
    waiting_order: BTreeSet<(u64, RequestId)>,
    stall: Option<OpenStall>,
    /// The last stall that ended, and when: held back so that a stall resuming within
    /// `stall_ms` continues it (one release does not end a cascade).
    closed: Option<(OpenStall, u64)>,
    stalls: Vec<StallInterval>,
    stalls_dropped: u64,
    /// Decode: refusals in the current instant (pressure) and since the episode began.
    refused_now: bool,
    /// Router bookings on this worker, in blocks.
    booked_blocks: u64,
    booking_series: Option<Downsampler<2>>,
    last_booking_point: Option<[u64; 2]>,
    booking: BookingRow,
    overbooked: Option<OpenDivergence>,
    unbooked: Option<OpenDivergence>,
    divergences: Vec<Divergence>,
    divergences_dropped: u64,
    gating_handoffs: u64,
    gating_pending_ns: u64,
    /// Preemption storms and head-of-line blocking (decode and aggregated workers only).
    decode: Option<DecodeWatch>,
}

impl WorkerState {
    fn total(&self) -> u64 {
        self.cap.total_blocks
    }
    fn unqueue(&mut self, request: &RequestId) {
        if let Some(at) = self.waiting_since.remove(request) {
            self.waiting_order.remove(&(at, *request));
        }
    }
    fn queue(&mut self, request: RequestId, at_ns: u64) {
        self.unqueue(&request);
        self.waiting_since.insert(request, at_ns);
        self.waiting_order.insert((at_ns, request));
    }
}

/// A decode worker's figures inside the current pressure episode.
#[derive(Clone, Debug)]
struct EpisodeWorker {
    kv_used_at_start_pct: f64,
    peak_kv_used_pct: f64,
    peak_at_ns: u64,
    queued: u64,
    refused: u64,
    reason: Option<String>,
}

#[derive(Clone, Debug)]
struct Episode {
    start_ns: u64,
    /// When pressure last stopped (`None` while it holds).
    off_since_ns: Option<u64>,
    decode: BTreeMap<WorkerId, EpisodeWorker>,
    /// Each prefill worker's pinned share when the episode started.
    prefill_pinned_pct: BTreeMap<WorkerId, f64>,
}

#[derive(Clone, Copy, Debug)]
struct RiseRaw {
    at_trigger_pct: f64,
    at_stall_pct: f64,
    stalled_at_ns: u64,
}

/// Per-handoff milestones, kept only while the handoff is unfinished.
#[derive(Clone, Debug, Default)]
struct HState {
    first_ns: u64,
    /// The latest fact applied to it.
    last_ns: u64,
    policy: Option<HandoffPolicy>,
    source: Option<WorkerId>,
    destination: Option<WorkerId>,
    dispatched_ns: Option<u64>,
    pinned_ns: Option<u64>,
    queued_ns: Option<u64>,
    reserved_ns: Option<u64>,
    recv_started_ns: Option<u64>,
    recv_completed_ns: Option<u64>,
    activated_ns: Option<u64>,
    released_ns: Option<u64>,
    reservation_ended_ns: Option<u64>,
    source_end: Option<EndReason>,
    lease_expired: bool,
    reservation_expired: bool,
    canceled: Option<CancelReason>,
    src_started: bool,
    src_done: bool,
    dst_started: bool,
    dst_done: bool,
    gated: bool,
}

/// Bounded-memory distribution plus an exact total, per phase.
#[derive(Default)]
struct PhaseAcc {
    dist: Distribution,
    total_ns: u128,
}

impl PhaseAcc {
    fn add(&mut self, from: Option<u64>, to: Option<u64>) {
        if let (Some(a), Some(b)) = (from, to) {
            if b >= a {
                self.dist.add(b - a);
                self.total_ns += (b - a) as u128;
            }
        }
    }
}

const PHASES: [(&str, &str); 8] = [
    (
        "destination_capacity",
        "source pinned → destination reserved (prefill done, waiting for decode capacity)",
    ),
    ("reservation_queue", "reservation queued → reserved (waiting in a decode FIFO)"),
    (
        "prefill_after_reservation",
        "destination reserved → transfer started (destination-first: prefill runs after reserving)",
    ),
    ("transfer", "receive started → receive completed (waiting for the bytes)"),
    ("reader_ack", "destination activated → source released (waiting for reader acknowledgement; 0 when the source was released first)"),
    ("lease_expired", "source pinned → released by lease expiry (pins that waited out their lease)"),
    ("reservation_expired", "destination reserved → released by reservation expiry"),
    (
        "canceled",
        "first fact of a canceled handoff → its last release or cancel (time it held or waited before giving up)",
    ),
];

/// The streaming fold of pass one. Feed it every record of a run in merge order.
pub struct InspectFold {
    opts: InspectOptions,
    headers: Vec<StreamHeader>,
    workers: Vec<Option<WorkerState>>,
    /// Requests' prefill / decode booking blocks, for freeing (router facts carry no blocks).
    prefill_bookings: BTreeMap<(RequestId, WorkerId), u32>,
    decode_bookings: BTreeMap<(RequestId, WorkerId), u32>,
    now_ns: Option<u64>,
    first_ns: Option<u64>,
    records: u64,
    episode: Option<Episode>,
    cascade_start: Option<(u64, Option<Episode>)>,
    rises: BTreeMap<WorkerId, RiseRaw>,
    handoffs: BTreeMap<HandoffId, HState>,
    finished: BTreeSet<HandoffId>,
    finished_order: VecDeque<HandoffId>,
    handoff_count: u64,
    phases: Vec<PhaseAcc>,
    pin_total: PhaseAcc,
    outcomes: Outcomes,
    gating_wait: Distribution,
    gating_count: u64,
    gating_first_ns: Option<u64>,
    /// Min-heap of the `top_n` longest pins: (pinned_ns, Reverse(id)).
    top: BinaryHeap<Reverse<(u64, Reverse<HandoffId>, bool)>>,
}

impl InspectFold {
    pub fn new(headers: &[StreamHeader], opts: InspectOptions) -> Self {
        let workers = headers
            .iter()
            .map(|h| {
                (h.worker.role != Role::Router).then(|| {
                    let total = h.engine.total_blocks as u64;
                    WorkerState {
                        worker: h.worker,
                        cap: KvCapacitySnapshot::empty(total),
                        sched: SchedulerFold::new(),
                        view: SchedulerView::default(),
                        dirty: false,
                        peaks: WorkerPeaks {
                            worker: h.worker,
                            total_blocks: total,
                            active: PeakAt::default(),
                            pinned_source: PeakAt::default(),
                            reserved_destination: PeakAt::default(),
                            kv_used: PeakAt::default(),
                            waiting: PeakAt::default(),
                            running: PeakAt::default(),
                            held_prefills: PeakAt::default(),
                            pending_reservations: PeakAt::default(),
                        },
                        waiting_since: BTreeMap::new(),
                        waiting_order: BTreeSet::new(),
                        stall: None,
                        closed: None,
                        stalls: Vec::new(),
                        stalls_dropped: 0,
                        refused_now: false,
                        booked_blocks: 0,
                        booking: BookingRow {
                            worker: h.worker,
                            total_blocks: total,
                            peak_booked: PeakAt::default(),
                            peak_kv_used: PeakAt::default(),
                            max_booked_over_used: PeakAt::default(),
                            max_used_over_booked: PeakAt::default(),
                            overbooked_ms: 0.0,
                            unbooked_pins_ms: 0.0,
                            series: Vec::new(),
                        },
                        booking_series: None,
                        last_booking_point: None,
                        overbooked: None,
                        unbooked: None,
                        divergences: Vec::new(),
                        divergences_dropped: 0,
                        gating_handoffs: 0,
                        gating_pending_ns: 0,
                        decode: matches!(h.worker.role, Role::Decode | Role::Aggregated).then(|| {
                            DecodeWatch::new(
                                h.worker,
                                opts.storm_preemptions,
                                opts.storm_window_ms,
                                opts.stall_ms,
                            )
                        }),
                    }
                })
            })
            .collect();
        InspectFold {
            opts,
            headers: headers.to_vec(),
            workers,
            prefill_bookings: BTreeMap::new(),
            decode_bookings: BTreeMap::new(),
            now_ns: None,
            first_ns: None,
            records: 0,
            episode: None,
            cascade_start: None,
            rises: BTreeMap::new(),
            handoffs: BTreeMap::new(),
            finished: BTreeSet::new(),
            finished_order: VecDeque::new(),
            handoff_count: 0,
            phases: PHASES.iter().map(|_| PhaseAcc::default()).collect(),
            pin_total: PhaseAcc::default(),
            outcomes: Outcomes::default(),
            gating_wait: Distribution::new(),
            gating_count: 0,
            gating_first_ns: None,
            top: BinaryHeap::new(),
        }
    }

    fn index_of(&self, w: WorkerId) -> Option<usize> {
        self.headers.iter().position(|h| h.worker == w)
    }

    /// Moves the fold's clock to `at_ns`: if time advanced, the state of the previous instant
    /// is settled (judged, and its queue counts refreshed) and that instant is returned. `apply`
    /// calls it; a caller that samples settled states calls it first, samples, then applies.
    pub fn advance(&mut self, at_ns: u64) -> Option<u64> {
        self.first_ns.get_or_insert(at_ns);
        match self.now_ns {
            Some(now) if at_ns > now => {
                self.settle(now, at_ns);
                self.now_ns = Some(at_ns);
                Some(now)
            }
            None => {
                self.now_ns = Some(at_ns);
                None
            }
            _ => None,
        }
    }

    /// The last instant seen.
    pub fn now_ns(&self) -> Option<u64> {
        self.now_ns
    }

    /// An engine stream's current physical KV, queue counts and router-booked blocks (`None`
    /// for the router stream).
    pub fn worker_state(&mut self, stream: usize) -> Option<(KvCapacitySnapshot, SchedulerView, u64)> {
        let ws = self.workers.get_mut(stream)?.as_mut()?;
        if ws.dirty {
            ws.view = ws.sched.view();
            ws.dirty = false;
        }
        Some((ws.cap, ws.view, ws.booked_blocks))
    }

    /// Applies one record of stream `stream` (an index into the run's headers).
    pub fn apply(&mut self, stream: usize, rec: &Record) -> Result<(), ProjectError> {
        let Some(header) = self.headers.get(stream) else {
            return Ok(());
        };
        let worker = header.worker;
        self.records += 1;
        self.advance(rec.at_ns);
        let at = rec.at_ns;
        if let Some(ws) = self.workers[stream].as_mut() {
            ws.cap.apply_fact(&rec.fact).map_err(|violation| ProjectError::Capacity {
                worker,
                seq: rec.seq,
                at_ms: ms(at),
                violation,
            })?;
            ws.sched.apply(&rec.fact).map_err(|violation| ProjectError::View {
                worker,
                seq: rec.seq,
                at_ms: ms(at),
                violation,
            })?;
            ws.dirty |= changes_view(&rec.fact);
            if let Some(d) = ws.decode.as_mut() {
                d.apply(at, &rec.fact);
            }
            match &rec.fact {
                Fact::RequestQueued { request } | Fact::RequestPreempted { request, .. }
                    if worker.role == Role::Prefill =>
                {
                    ws.queue(*request, at);
                }
                Fact::RequestScheduled { request, .. }
                | Fact::RequestFinished { request, .. }
                | Fact::RequestRejected { request, .. } => ws.unqueue(request),
                Fact::ReservationRefused {
                    reason: RejectReason::NoCapacity | RejectReason::NoSlot, ..
                } => {
                    ws.refused_now = true;
                }
                _ => {}
            }
        }
        // Pressure-episode counters (per decode worker, since the episode began).
        if let Some(ep) = self.episode.as_mut() {
            if ep.off_since_ns.is_none() && worker.role == Role::Decode {
                if let Some(ew) = ep.decode.get_mut(&worker) {
                    match rec.fact {
                        Fact::ReservationQueued { .. } => ew.queued += 1,
                        Fact::ReservationRefused { .. } => ew.refused += 1,
                        _ => {}
                    }
                }
            }
        }
        self.apply_booking(&rec.fact);
        self.apply_handoff(worker, at, &rec.fact);
        Ok(())
    }

    fn apply_booking(&mut self, fact: &Fact) {
        let (w, delta): (WorkerId, i64) = match *fact {
            Fact::PrefillBooked { request, worker, blocks, .. } => {
                let prev = self.prefill_bookings.insert((request, worker), blocks);
                (worker, blocks as i64 - prev.unwrap_or(0) as i64)
            }
            Fact::PrefillBookingFreed { request, worker } => {
                let b = self.prefill_bookings.remove(&(request, worker)).unwrap_or(0);
                (worker, -(b as i64))
            }
            Fact::DecodeBooked { request, worker, blocks } => {
                let prev = self.decode_bookings.insert((request, worker), blocks);
                (worker, blocks as i64 - prev.unwrap_or(0) as i64)
            }
            Fact::DecodeBookingFreed { request, worker, .. } => {
                let b = self.decode_bookings.remove(&(request, worker)).unwrap_or(0);
                (worker, -(b as i64))
            }
            _ => return,
        };
        if let Some(i) = self.index_of(w) {
            if let Some(ws) = self.workers[i].as_mut() {
                ws.booked_blocks = (ws.booked_blocks as i64 + delta).max(0) as u64;
            }
        }
    }

    fn apply_handoff(&mut self, worker: WorkerId, at: u64, fact: &Fact) {
        let Some(id) = fact.handoff() else {
            return;
        };
        // Only facts that begin a role's part may create state: a stray late message about a
        // finished handoff must not resurrect it.
        let creates = matches!(
            fact,
            Fact::HandoffStarted { .. }
                | Fact::PrefillDispatched { .. }
                | Fact::SourcePinned { .. }
                | Fact::DestinationRouted { .. }
                | Fact::ReservationQueued { .. }
                | Fact::DestinationReserved { .. }
        );
        if !self.handoffs.contains_key(&id) {
            if !creates || self.finished.contains(&id) {
                return;
            }
            self.handoff_count += 1;
            self.handoffs.insert(id, HState { first_ns: at, ..HState::default() });
        }
        let Some(h) = self.handoffs.get_mut(&id) else {
            return;
        };
        h.last_ns = h.last_ns.max(at);
        let first = |slot: &mut Option<u64>| {
            slot.get_or_insert(at);
        };
        match fact {
            Fact::HandoffStarted { policy, .. } => {
                h.policy = Some(*policy);
                match worker.role {
                    Role::Prefill => {
                        h.src_started = true;
                        h.source = Some(worker);
                    }
                    Role::Decode => {
                        h.dst_started = true;
                        h.destination = Some(worker);
                    }
                    _ => {}
                }
            }
            Fact::PrefillDispatched { .. } => {
                h.src_started = true;
                h.source.get_or_insert(worker);
                first(&mut h.dispatched_ns);
            }
            Fact::SourcePinned { .. } => {
                h.src_started = true;
                h.source = Some(worker);
                first(&mut h.pinned_ns);
            }
            Fact::DestinationRouted { worker: d, .. } => {
                h.dst_started = true;
                h.destination = Some(*d);
            }
            Fact::ReservationQueued { .. } => {
                h.dst_started = true;
                h.destination = Some(worker);
                first(&mut h.queued_ns);
                if h.dispatched_ns.is_none() && h.pinned_ns.is_none() && !h.gated {
                    h.gated = true;
                    if let Some(i) = self.headers.iter().position(|x| x.worker == worker) {
                        if let Some(ws) = self.workers[i].as_mut() {
                            ws.gating_handoffs += 1;
                        }
                    }
                    self.gating_count += 1;
                    self.gating_first_ns.get_or_insert(at);
                }
            }
            Fact::ReservationDequeued { .. } => {
                h.dst_done = true;
                first(&mut h.reservation_ended_ns);
            }
            Fact::DestinationReserved { .. } => {
                h.dst_started = true;
                h.destination = Some(worker);
                first(&mut h.reserved_ns);
            }
            Fact::ReceiveStarted { .. } => first(&mut h.recv_started_ns),
            Fact::ReceiveCompleted { .. } => first(&mut h.recv_completed_ns),
            Fact::DestinationActivated { .. } => {
                first(&mut h.activated_ns);
                h.dst_done = true;
            }
            Fact::ReservationExpired { .. } => h.reservation_expired = true,
            Fact::ReservationReleased { .. } => {
                first(&mut h.reservation_ended_ns);
                h.dst_done = true;
            }
            Fact::LeaseExpired { .. } => h.lease_expired = true,
            Fact::SourceReleased { reason, .. } => {
                first(&mut h.released_ns);
                h.source_end.get_or_insert(*reason);
                h.src_done = true;
            }
            Fact::HandoffCanceled { reason, .. } => {
                h.canceled.get_or_insert(*reason);
                match worker.role {
                    // A role that holds nothing ends with the cancel; one that holds a pin or a
                    // reservation ends when it releases it.
                    Role::Prefill if h.pinned_ns.is_none() => h.src_done = true,
                    Role::Decode if h.reserved_ns.is_none() => h.dst_done = true,
                    _ => {}
                }
            }
            _ => {}
        }
        let failed = h.lease_expired || h.reservation_expired || h.canceled.is_some();
        let done = (h.src_done && h.dst_done)
            || (h.src_done && !h.dst_started && failed)
            || (h.dst_done && !h.src_started && failed);
        if done {
            if let Some(h) = self.handoffs.remove(&id) {
                self.finish_handoff(id, h, at, false);
            }
        }
    }

    fn finish_handoff(&mut self, id: HandoffId, h: HState, end_ns: u64, at_end: bool) {
        if !at_end {
            self.finished.insert(id);
            self.finished_order.push_back(id);
            if self.finished_order.len() > FINISHED_MEMORY {
                if let Some(old) = self.finished_order.pop_front() {
                    self.finished.remove(&old);
                }
            }
        }
        // Phases.
        // Which side waited first follows the policy; without one, the order of the marks.
        let source_first = match h.policy {
            Some(HandoffPolicy::SourceFirst) => true,
            Some(HandoffPolicy::DestinationFirst) => false,
            _ => h.pinned_ns.is_some() && h.reserved_ns >= h.pinned_ns,
        };
        if source_first {
            self.phases[0].add(h.pinned_ns, h.reserved_ns);
        } else {
            self.phases[2].add(h.reserved_ns, h.recv_started_ns);
        }
        self.phases[1].add(h.queued_ns, h.reserved_ns);
        self.phases[3].add(h.recv_started_ns, h.recv_completed_ns);
        if h.source_end == Some(EndReason::Success) {
            // A source released before its destination activated waited for no one: 0.
            let released = match (h.activated_ns, h.released_ns) {
                (Some(a), Some(r)) => Some(r.max(a)),
                (_, r) => r,
            };
            self.phases[4].add(h.activated_ns, released);
        }
        if h.lease_expired {
            self.phases[5].add(h.pinned_ns, h.released_ns.or(Some(end_ns)));
        }
        if h.reservation_expired {
            self.phases[6].add(h.reserved_ns, h.reservation_ended_ns.or(Some(end_ns)));
        }
        if h.canceled.is_some() && !h.lease_expired && !h.reservation_expired {
            self.phases[7].add(Some(h.first_ns), Some(h.last_ns));
        }
        if h.gated {
            if let Some(q) = h.queued_ns {
                let until = h.reserved_ns.or(h.reservation_ended_ns).unwrap_or(end_ns);
                self.gating_wait.add(until.saturating_sub(q));
            }
        }
        // Outcome, in the ledger's precedence.
        let o = &mut self.outcomes;
        if h.lease_expired {
            o.lease_expired += 1;
        } else if h.reservation_expired {
            o.reservation_expired += 1;
        } else if let Some(r) = h.canceled {
            o.canceled += 1;
            *o.canceled_by_reason.entry(r.as_str()).or_insert(0) += 1;
        } else if h.activated_ns.is_some() && h.source_end == Some(EndReason::Success) {
            o.completed += 1;
        } else if at_end {
            o.in_flight_at_end += 1;
        } else if h.activated_ns.is_some() || h.source_end == Some(EndReason::Success) {
            // A handoff with no pin (policy without source pinning) that activated.
            o.completed += 1;
        } else {
            o.in_flight_at_end += 1;
        }
        // Pins.
        if let Some(p) = h.pinned_ns {
            let still = h.released_ns.is_none();
            let until = h.released_ns.unwrap_or(end_ns);
            let d = until.saturating_sub(p);
            self.pin_total.add(Some(p), Some(until));
            if self.opts.top_n > 0 {
                let key = Reverse((d, Reverse(id), still));
                if self.top.len() < self.opts.top_n {
                    self.top.push(key);
                } else if let Some(min) = self.top.peek() {
                    if (d, Reverse(id)) > (min.0 .0, min.0 .1) {
                        self.top.pop();
                        self.top.push(key);
                    }
                }
            }
        }
    }

    /// The state after the last record at `t` holds over `[t, next)`: judge it.
    fn settle(&mut self, t: u64, next: u64) {
        let opts = self.opts;
        let stall_ns = opts.stall_ms.saturating_mul(NS_PER_MS);
        // Decode pressure (cluster level), judged first so an episode that starts at `t` can
        // trigger a stall that starts at `t`.
        // (worker, full, pending reservations, refused), built into words only when kept.
        let mut pressured: Vec<(WorkerId, bool, u64, bool, u64, u64)> = Vec::new();
        for ws in self.workers.iter_mut().flatten() {
            if ws.dirty {
                ws.view = ws.sched.view();
                ws.dirty = false;
            }
            if ws.worker.role != Role::Decode {
                ws.refused_now = false;
                continue;
            }
            let used = ws.cap.kv_used_blocks();
            let total = ws.total();
            let full = total > 0 && used * 100 >= opts.decode_full_pct as u64 * total;
            let pending = ws.view.pending_reservations;
            if full || pending > 0 || ws.refused_now {
                pressured.push((ws.worker, full, pending, ws.refused_now, used, total));
            }
            ws.refused_now = false;
        }
        let why = |full: bool, pending: u64, refused: bool, used: u64, total: u64| {
            let mut why = Vec::new();
            if full {
                why.push(format!("kv_used {}%", pct(used, total)));
            }
            if pending > 0 {
                why.push(format!("{pending} reservations pending"));
            }
            if refused {
                why.push("reservation refused".to_string());
            }
            why.join(", ")
        };
        if !pressured.is_empty() {
            let reopen = matches!(&self.episode, Some(ep) if ep.off_since_ns.is_none()
                || ep.off_since_ns.is_some_and(|off| t.saturating_sub(off) < stall_ns));
            if !reopen {
                self.episode = Some(Episode {
                    start_ns: t,
                    off_since_ns: None,
                    decode: BTreeMap::new(),
                    prefill_pinned_pct: self
                        .workers
                        .iter()
                        .flatten()
                        .filter(|w| w.worker.role == Role::Prefill)
                        .map(|w| (w.worker, pct(w.cap.pinned_source_blocks, w.total())))
                        .collect(),
                });
            }
            if let Some(ep) = self.episode.as_mut() {
                ep.off_since_ns = None;
                // Track every decode worker's peak inside the episode (until the cascade).
                if self.cascade_start.is_none() {
                    for ws in self.workers.iter().flatten() {
                        if ws.worker.role != Role::Decode {
                            continue;
                        }
                        let p = pct(ws.cap.kv_used_blocks(), ws.total());
                        let ew = ep.decode.entry(ws.worker).or_insert(EpisodeWorker {
                            kv_used_at_start_pct: p,
                            peak_kv_used_pct: p,
                            peak_at_ns: t,
                            queued: 0,
                            refused: 0,
                            reason: None,
                        });
                        if p > ew.peak_kv_used_pct {
                            ew.peak_kv_used_pct = p;
                            ew.peak_at_ns = t;
                        }
                    }
                    for (w, full, pending, refused, used, total) in &pressured {
                        if let Some(ew) = ep.decode.get_mut(w) {
                            ew.reason.get_or_insert_with(|| why(*full, *pending, *refused, *used, *total));
                        }
                    }
                }
            }
        } else if let Some(ep) = self.episode.as_mut() {
            ep.off_since_ns.get_or_insert(t);
        }

        for i in 0..self.workers.len() {
            let Some(ws) = self.workers[i].as_mut() else {
                continue;
            };
            let c = ws.cap;
            let v = ws.view;
            let p = &mut ws.peaks;
            p.active.see(c.active_blocks, t);
            p.pinned_source.see(c.pinned_source_blocks, t);
            p.reserved_destination.see(c.reserved_destination_blocks, t);
            p.kv_used.see(c.kv_used_blocks(), t);
            p.waiting.see(v.waiting, t);
            p.running.see(v.running, t);
            p.held_prefills.see(v.held_prefills, t);
            p.pending_reservations.see(v.pending_reservations, t);
            if v.pending_reservations > 0 {
                ws.gating_pending_ns += next.saturating_sub(t);
            }

            // Bookings beside occupancy.
            let used = c.kv_used_blocks();
            let booked = ws.booked_blocks;
            let total = ws.total();
            let b = &mut ws.booking;
            b.peak_booked.see(booked, t);
            if ws.last_booking_point != Some([booked, used]) {
                ws.last_booking_point = Some([booked, used]);
                ws.booking_series
                    .get_or_insert_with(|| Downsampler::new(t, BOOKING_SERIES_BUCKETS))
                    .push(Sample { at_ns: t, values: [booked, used] });
            }
            b.peak_kv_used.see(used, t);
            b.max_booked_over_used.see(booked.saturating_sub(used), t);
            b.max_used_over_booked.see(used.saturating_sub(booked), t);
            let span_ms = ms(next.saturating_sub(t));
            let over = total > 0 && booked > total;
            track(
                &mut ws.overbooked,
                &mut ws.divergences,
                &mut ws.divergences_dropped,
                ws.worker,
                "overbooked",
                over,
                booked,
                t,
            );
            if over {
                b.overbooked_ms += span_ms;
            }
            let unbooked = ws.worker.role == Role::Prefill && c.pinned_source_blocks > 0 && booked == 0;
            track(
                &mut ws.unbooked,
                &mut ws.divergences,
                &mut ws.divergences_dropped,
                ws.worker,
                "unbooked_pins",
                unbooked,
                c.pinned_source_blocks,
                t,
            );
            if unbooked {
                b.unbooked_pins_ms += span_ms;
            }
            if let Some(d) = ws.decode.as_mut() {
                d.settle(t, &c, v.waiting);
            }

            // Stranding cascade on prefill workers.
            if ws.worker.role != Role::Prefill {
                continue;
            }
            let hot = total > 0 && c.pinned_source_blocks * 100 >= opts.pin_threshold_pct as u64 * total;
            let oldest = ws.waiting_order.first().copied();
            let pinned_pct = pct(c.pinned_source_blocks, total);
            let stalled_from = oldest.map(|(q, _)| q.saturating_add(stall_ns).max(t));
            if let Some(st) = ws.stall.as_mut() {
                let still = hot && stalled_from.is_some_and(|s| s <= t);
                if still {
                    st.peak_pinned_pct = st.peak_pinned_pct.max(pinned_pct);
                    st.peak_waiting = st.peak_waiting.max(v.waiting);
                } else if let Some(st) = ws.stall.take() {
                    if let Some((prev, end)) = ws.closed.take() {
                        push_stall(ws, prev, Some(end), end);
                    }
                    ws.closed = Some((st, t));
                }
            }
            if ws.stall.is_none() && hot {
                if let Some(s) = stalled_from.filter(|s| *s < next || (next == t && *s <= t)) {
                    match ws.closed.take() {
                        // Resumed within `stall_ms` of its end: the same stall goes on.
                        Some((mut prev, end)) if s.saturating_sub(end) < stall_ns => {
                            prev.peak_pinned_pct = prev.peak_pinned_pct.max(pinned_pct);
                            prev.peak_waiting = prev.peak_waiting.max(v.waiting);
                            ws.stall = Some(prev);
                            continue;
                        }
                        Some((prev, end)) => push_stall(ws, prev, Some(end), end),
                        None => {}
                    }
                    ws.stall = Some(OpenStall {
                        start_ns: s,
                        pinned_at_start_pct: pinned_pct,
                        peak_pinned_pct: pinned_pct,
                        oldest,
                        peak_waiting: v.waiting,
                    });
                    if self.cascade_start.is_none() {
                        // The trigger: the pressure episode in progress or last ended, if it
                        // began no later than the stall.
                        let ep = self.episode.clone().filter(|e| e.start_ns <= s);
                        self.cascade_start = Some((s, ep));
                    }
                    let at_trigger = self
                        .cascade_start
                        .as_ref()
                        .and_then(|(_, ep)| ep.as_ref())
                        .and_then(|ep| ep.prefill_pinned_pct.get(&ws.worker).copied())
                        .unwrap_or(0.0);
                    self.rises.entry(ws.worker).or_insert(RiseRaw {
                        at_trigger_pct: at_trigger,
                        at_stall_pct: pinned_pct,
                        stalled_at_ns: s,
                    });
                }
            }
        }
    }
}

/// Whether a fact can change the scheduler view's counts (the facts
/// [`SchedulerFold::apply`] acts on); steps and KV events, most of a log, cannot.
pub fn changes_view(fact: &Fact) -> bool {
    matches!(
        fact,
        Fact::RequestQueued { .. }
            | Fact::RequestScheduled { .. }
            | Fact::RequestPreempted { .. }
            | Fact::RequestFinished { .. }
            | Fact::RequestRejected { .. }
            | Fact::SourcePinned { .. }
            | Fact::SourceReleased { .. }
            | Fact::ReservationQueued { .. }
            | Fact::ReservationDequeued { .. }
            | Fact::DestinationReserved { .. }
            | Fact::DestinationActivated { .. }
            | Fact::ReservationReleased { .. }
    )
}

/// A longest-pinned candidate found by pass one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TopPin {
    pub handoff: HandoffId,
    pub pinned_ns: u64,
    pub still_pinned: bool,
}

impl InspectFold {
    /// Ends the fold at the last record's instant: closes open stalls, stretches and handoffs
    /// (unfinished ones count as in flight) and returns the report, whose `longest_pinned`
    /// still lacks timelines, plus the longest pins, longest first.
    pub fn finish(mut self) -> (InspectReport, Vec<TopPin>) {
        let end = self.now_ns.unwrap_or(0);
        self.settle(end, end);
        let open: Vec<(HandoffId, HState)> = std::mem::take(&mut self.handoffs).into_iter().collect();
        for (id, h) in open {
            self.finish_handoff(id, h, end, true);
        }
        let mut peaks = Vec::new();
        let mut booking_rows = Vec::new();
        let mut divergences = Vec::new();
        let mut divergences_dropped = 0;
        let mut intervals = Vec::new();
        let mut intervals_dropped = 0;
        let mut gating_workers = Vec::new();
        let mut preemption_storms = PreemptionStorms::default();
        let mut decode_hol_blocking = DecodeHolBlocking::default();
        let mut workers_info = Vec::new();
        for (h, ws) in self.headers.iter().zip(self.workers.iter_mut()) {
            workers_info.push(WorkerInfo {
                worker: h.worker,
                total_blocks: h.engine.total_blocks,
                block_size: h.engine.block_size,
            });
            let Some(ws) = ws.as_mut() else {
                continue;
            };
            if let Some((prev, closed_at)) = ws.closed.take() {
                push_stall(ws, prev, Some(closed_at), closed_at);
            }
            if let Some(st) = ws.stall.take() {
                push_stall(ws, st, None, end);
            }
            if let Some(d) = ws.decode.as_mut() {
                d.finish(end, &mut preemption_storms, &mut decode_hol_blocking);
            }
            for (slot, kind) in [(&mut ws.overbooked, "overbooked"), (&mut ws.unbooked, "unbooked_pins")] {
                if let Some(d) = slot.take() {
                    close_divergence(
                        d,
                        &mut ws.divergences,
                        &mut ws.divergences_dropped,
                        ws.worker,
                        kind,
                        None,
                        end,
                    );
                }
            }
            peaks.push(ws.peaks.clone());
            let mut row = ws.booking.clone();
            row.series = ws
                .booking_series
                .as_ref()
                .map(|d| d.points())
                .unwrap_or_default()
                .into_iter()
                .map(|p| BookingPoint { at_ms: ms(p.at_ns), booked: p.values[0], kv_used: p.values[1] })
                .collect();
            booking_rows.push(row);
            divergences.append(&mut ws.divergences);
            divergences_dropped += ws.divergences_dropped;
            intervals.append(&mut ws.stalls);
            intervals_dropped += ws.stalls_dropped;
            if ws.gating_handoffs > 0 {
                gating_workers.push(GatingWorker {
                    worker: ws.worker,
                    handoffs: ws.gating_handoffs,
                    peak_pending: ws.peaks.pending_reservations.value,
                    peak_pending_at_ms: ws.peaks.pending_reservations.at_ms,
                    pending_ms: ms(ws.gating_pending_ns),
                });
            }
        }
        divergences.sort_by(|a, b| {
            (a.worker, a.kind).cmp(&(b.worker, b.kind)).then(a.started_at_ms.total_cmp(&b.started_at_ms))
        });

        let cascade = self.cascade_start.take().map(|(start_ns, ep)| {
            let workers: Vec<WorkerId> = self.rises.keys().copied().collect();
            let trigger = ep.map(|ep| {
                let decode_workers: Vec<DecodePressure> = ep
                    .decode
                    .iter()
                    .filter(|(_, ew)| ew.reason.is_some())
                    .map(|(w, ew)| DecodePressure {
                        worker: *w,
                        kv_used_at_start_pct: ew.kv_used_at_start_pct,
                        peak_kv_used_pct: ew.peak_kv_used_pct,
                        peak_kv_used_at_ms: ms(ew.peak_at_ns),
                        reservations_queued: ew.queued,
                        reservations_refused: ew.refused,
                        reason: ew.reason.clone().unwrap_or_default(),
                    })
                    .collect();
                let pin_rise: Vec<PinRise> = self
                    .rises
                    .iter()
                    .map(|(w, r)| PinRise {
                        worker: *w,
                        pinned_at_trigger_pct: r.at_trigger_pct,
                        pinned_at_stall_pct: r.at_stall_pct,
                        stalled_at_ms: ms(r.stalled_at_ns),
                    })
                    .collect();
                let names = |v: Vec<String>| v.join(", ");
                let summary = format!(
                    "decode capacity exhausted at {:.3} ms on {} (peak kv_used {}; {} reservations queued, {} refused); source pins then rose on {} until prefill admission stalled at {:.3} ms",
                    ms(ep.start_ns),
                    names(decode_workers.iter().map(|d| d.worker.to_string()).collect()),
                    names(decode_workers.iter().map(|d| format!("{}%", d.peak_kv_used_pct)).collect()),
                    decode_workers.iter().map(|d| d.reservations_queued).sum::<u64>(),
                    decode_workers.iter().map(|d| d.reservations_refused).sum::<u64>(),
                    names(pin_rise.iter().map(|r| format!("{} from {}% to {}%", r.worker, r.pinned_at_trigger_pct, r.pinned_at_stall_pct)).collect()),
                    ms(start_ns),
                );
                Trigger {
                    kind: "decode_exhaustion",
                    at_ms: ms(ep.start_ns),
                    decode_workers,
                    pin_rise,
                    summary,
                }
            });
            let summary = format!(
                "stranding cascade from {:.3} ms on {}: pinned source blocks ≥ {}% of the worker while queued prefill work waited unscheduled ≥ {} ms",
                ms(start_ns),
                workers.iter().map(|w| w.to_string()).collect::<Vec<_>>().join(", "),
                self.opts.pin_threshold_pct,
                self.opts.stall_ms,
            );
            Cascade {
                started_at_ms: ms(start_ns),
                workers,
                trigger,
                intervals: intervals.clone(),
                intervals_not_shown: intervals_dropped,
                summary,
            }
        });

        let gating = self.gating_first_ns.map(|first| {
            let wait = self.gating_wait.stats(NS_PER_MS_F64);
            let summary = format!(
                "{} reservations waited in decode FIFOs ahead of prefill dispatch (from {:.3} ms; wait p50 {:.3} ms, max {:.3} ms): capacity waiting happened before prefill, not as stranded source KV",
                self.gating_count,
                ms(first),
                wait.p50,
                wait.max
            );
            Gating {
                handoffs: self.gating_count,
                first_queued_at_ms: ms(first),
                wait_ms: wait,
                per_worker: gating_workers,
                summary,
            }
        });

        let mut phases: Vec<Phase> = PHASES
            .iter()
            .zip(self.phases.iter())
            .map(|((name, meaning), acc)| Phase {
                phase: name,
                meaning,
                total_ms: acc.total_ns as f64 / NS_PER_MS_F64,
                stats_ms: acc.dist.stats(NS_PER_MS_F64),
            })
            .collect();
        phases.insert(
            0,
            Phase {
                phase: "source_pinned",
                meaning: "source pinned → released (or run end): all stranded time",
                total_ms: self.pin_total.total_ns as f64 / NS_PER_MS_F64,
                stats_ms: self.pin_total.dist.stats(NS_PER_MS_F64),
            },
        );

        let mut top: Vec<TopPin> = self
            .top
            .into_iter()
            .map(|Reverse((d, Reverse(id), still))| TopPin { handoff: id, pinned_ns: d, still_pinned: still })
            .collect();
        top.sort_by(|a, b| b.pinned_ns.cmp(&a.pinned_ns).then(a.handoff.cmp(&b.handoff)));

        let first = self.headers.first();
        let report = InspectReport {
            run: RunInfo {
                run_id: first.map(|h| h.run_id.to_string()).unwrap_or_default(),
                backend: first.map(|h| h.backend.as_str().to_string()).unwrap_or_default(),
                policy: first.map(|h| h.policy.as_str().to_string()).unwrap_or_default(),
                seed: first.map(|h| h.seed).unwrap_or(0),
                workers: workers_info,
                records: self.records,
                first_at_ms: ms(self.first_ns.unwrap_or(0)),
                last_at_ms: ms(end),
            },
            options: self.opts,
            cascade,
            gating,
            preemption_storms,
            decode_hol_blocking,
            peaks,
            longest_pinned: Vec::new(),
            wait_breakdown: WaitBreakdown { handoffs: self.handoff_count, phases, outcomes: self.outcomes },
            bookings: Bookings {
                workers: booking_rows,
                divergences,
                divergences_not_shown: divergences_dropped,
            },
        };
        (report, top)
    }
}

/// Inspects a run at `path` (directory, merged file or stream): pass one folds everything,
/// pass two collects the timelines of the longest pins. `progress` is called with the number
/// of records read so far (every 64 Ki records and at the end of each pass).
pub fn inspect_run(
    path: &Path,
    opts: InspectOptions,
    progress: &mut dyn FnMut(u64),
) -> Result<InspectReport, ProjectError> {
    let mut run = RunReader::open(path)?;
    let mut fold = InspectFold::new(run.headers(), opts);
    let mut n = 0u64;
    while let Some((i, rec)) = run.next()? {
        fold.apply(i, &rec)?;
        n += 1;
        if n % 65_536 == 0 {
            progress(n);
        }
    }
    progress(n);
    let end_ns = fold.now_ns.unwrap_or(0);
    let (mut report, top) = fold.finish();
    if top.is_empty() {
        return Ok(report);
    }
    let wanted: BTreeSet<HandoffId> = top.iter().map(|t| t.handoff).collect();
    let mut run = RunReader::open(path)?;
    let workers: Vec<WorkerId> = run.headers().iter().map(|h| h.worker).collect();
    let mut ledger = HandoffLedger::new();
    while let Some((i, rec)) = run.next()? {
        n += 1;
        if n % 65_536 == 0 {
            progress(n);
        }
        if rec.fact.handoff().is_some_and(|h| wanted.contains(&h)) {
            ledger.apply(workers[i], &rec);
        }
    }
    progress(n);
    report.longest_pinned = top
        .iter()
        .enumerate()
        .map(|(rank, t)| {
            let e = ledger.get(&t.handoff).cloned().unwrap_or_default();
            let mut prev = e.transitions.first().map(|x| x.at_ns).unwrap_or(0);
            let timeline = e
                .transitions
                .iter()
                .map(|x| {
                    let step = TimelineStep {
                        at_ms: ms(x.at_ns),
                        delta_ms: ms(x.at_ns.saturating_sub(prev)),
                        worker: x.worker,
                        fact: x.fact,
                        message: x.message,
                    };
                    prev = x.at_ns;
                    step
                })
                .collect();
            let outcome = match serde_json::to_value(e.outcome()) {
                Ok(serde_json::Value::String(s)) => s,
                _ => String::new(),
            };
            PinnedHandoff {
                rank: rank + 1,
                handoff: t.handoff,
                request: e.request,
                source: e.source,
                destination: e.destination,
                pinned_ms: ms(t.pinned_ns),
                still_pinned: t.still_pinned,
                pinned_blocks: e.pinned_blocks,
                outcome,
                normalized: e.normalized(),
                timeline,
            }
        })
        .collect();
    let _ = end_ns;
    Ok(report)
}

fn ws_total_ms(start_ns: u64, end_ns: u64) -> f64 {
    ms(end_ns.saturating_sub(start_ns))
}

/// Opens, extends or closes a divergence stretch of one kind on one worker.
#[allow(clippy::too_many_arguments)]
fn track(
    slot: &mut Option<OpenDivergence>,
    list: &mut Vec<Divergence>,
    dropped: &mut u64,
    worker: WorkerId,
    kind: &'static str,
    on: bool,
    value: u64,
    t: u64,
) {
    match (slot.as_mut(), on) {
        (Some(d), true) => d.worst = d.worst.max(value),
        (None, true) => *slot = Some(OpenDivergence { start_ns: t, worst: value }),
        (Some(_), false) => {
            if let Some(d) = slot.take() {
                close_divergence(d, list, dropped, worker, kind, Some(t), t);
            }
        }
        (None, false) => {}
    }
}

fn close_divergence(
    d: OpenDivergence,
    list: &mut Vec<Divergence>,
    dropped: &mut u64,
    worker: WorkerId,
    kind: &'static str,
    end_ns: Option<u64>,
    run_end_ns: u64,
) {
    if list.len() >= MAX_INTERVALS_PER_WORKER {
        *dropped += 1;
        return;
    }
    list.push(Divergence {
        worker,
        kind,
        started_at_ms: ms(d.start_ns),
        ended_at_ms: end_ns.map(ms),
        duration_ms: ws_total_ms(d.start_ns, end_ns.unwrap_or(run_end_ns)),
        worst_blocks: d.worst,
    });
}

fn push_stall(ws: &mut WorkerState, st: OpenStall, end_ns: Option<u64>, run_end_ns: u64) {
    if ws.stalls.len() >= MAX_INTERVALS_PER_WORKER {
        ws.stalls_dropped += 1;
        return;
    }
    let end = end_ns.unwrap_or(run_end_ns);
    ws.stalls.push(StallInterval {
        worker: ws.worker,
        started_at_ms: ms(st.start_ns),
        ended_at_ms: end_ns.map(ms),
        duration_ms: ws_total_ms(st.start_ns, end),
        pinned_at_start_pct: st.pinned_at_start_pct,
        peak_pinned_pct: st.peak_pinned_pct,
        oldest_waiting_request: st.oldest.map(|(_, r)| r),
        oldest_waiting_since_ms: st.oldest.map(|(q, _)| ms(q)),
        peak_waiting: st.peak_waiting,
    });
}
