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
//!
//! ## Code
//! `fold` is the streaming fold of pass one: each engine worker's capacity, scheduler view
//! and peaks, settled instant by instant, handing each concern its part of the state:
//! `cascade` (hot pins, stalled admission, decode-pressure episodes and the trigger),
//! `bookings` (router bookings beside occupancy, divergences), `wait_breakdown`
//! (per-handoff milestones: phases, outcomes, gating waits, the longest pins) and
//! [`decode_stalls`] (preemption storms, head-of-line blocking).
//! `longest_pinned` is pass two; `report` holds the serialized types.

mod bookings;
mod cascade;
mod fold;
mod longest_pinned;
mod lost;
mod report;
mod wait_breakdown;

pub use crate::projections::decode_stalls::{
    DecodeHolBlocking, HolInterval, HolWorker, PreemptionStorm, PreemptionStorms, StormWorker,
};
pub use fold::InspectFold;
pub use longest_pinned::TopPin;
pub use report::{
    BookingPoint, BookingRow, Bookings, Cascade, DecodePressure, Divergence, Gating, GatingWorker,
    InspectReport, Outcomes, PeakAt, Phase, PinRise, PinnedHandoff, RunInfo, StallInterval, TimelineStep,
    Trigger, WaitBreakdown, WorkerInfo, WorkerPeaks, BOOKING_SERIES_BUCKETS,
};

use crate::events::RunReader;
use crate::projections::run::ProjectError;
use serde::Serialize;
use std::path::Path;

/// Stall intervals and divergence intervals kept per worker (the rest are only counted).
pub const MAX_INTERVALS_PER_WORKER: usize = 64;

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
    let losses = std::mem::take(&mut fold.losses);
    let (mut report, top) = fold.finish();
    report.unended = run.unended();
    let end_ns = (report.run.last_at_ms * 1e6) as u64;
    report.workers_lost = losses.report(&report.unended, run.headers().len(), end_ns);
    if top.is_empty() {
        return Ok(report);
    }
    report.longest_pinned = longest_pinned::timelines(path, &top, n, progress)?;
    Ok(report)
}
