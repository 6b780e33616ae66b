//! `handoff-log timeline`: per worker, stacked KV block classes over time (active, pinned
//! source, reserved destination, cached-free, free) with router bookings as a dashed line, and
//! scheduler queue depths below, written as a self-contained SVG.
//!
//! * **Samples** are settled instants (the state after the last record of an instant, as in
//!   [`crate::projections::inspect`]); a sample is kept only when it differs from the previous
//!   one of its worker.
//! * **Downsampling** keeps memory and the SVG bounded on long runs: time is cut into at most
//!   `max_buckets` equal buckets (the width doubles, merging pairs, when the run outgrows
//!   them), and a bucket keeps its first and last sample and, per series, the samples holding
//!   its minimum and maximum. Every kept point is a real folded state, so peaks survive.
//! * **Rendering** writes SVG by hand: text is plain `<text>` in a generic font family, so no
//!   font file is read or needed, and the chart geometry carries `data-*` attributes (time
//!   and block scales) so tests can read values back off the drawing.
//!
//! This module samples the fold (`collect`); `downsample` bounds the samples, `render`
//! draws them with the primitives of [`crate::projections::svg`].

mod downsample;
mod render;

pub use downsample::{Downsampler, Sample, RAW_POINTS_PER_BUCKET};
pub use render::render_svg;

use crate::events::{RunReader, StreamHeader};
use crate::ids::{Role, WorkerId};
use crate::projections::inspect::{InspectFold, InspectOptions};
use crate::projections::run::ProjectError;
use crate::units::NS_PER_MS_F64;
use std::collections::BTreeMap;
use std::path::Path;

/// What to draw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimelineOptions {
    /// Only this worker (default: every engine worker).
    pub worker: Option<WorkerId>,
    /// Window start / end, ns on the run's clock (default: the whole run).
    pub from_ns: Option<u64>,
    pub to_ns: Option<u64>,
    /// Buckets per series once a series has more than `RAW_POINTS_PER_BUCKET ×` this many
    /// points (each bucket keeps a handful).
    pub max_buckets: usize,
    /// How the capacity chart's y-axis reads (see [`YAxis`]).
    pub y_axis: YAxis,
}

/// The capacity chart's y-axis.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
pub enum YAxis {
    /// Every block of the pool, stacked up to its total (cached-free and free included).
    #[default]
    Blocks,
    /// Only blocks in use (active, pinned source, reserved destination), up to the window's
    /// peak: on a large pool the cached-free and free area would flatten everything else.
    Used,
    /// The whole pool, as a percentage of its blocks.
    Percent,
}

impl Default for TimelineOptions {
    fn default() -> Self {
        TimelineOptions { worker: None, from_ns: None, to_ns: None, max_buckets: 300, y_axis: YAxis::Blocks }
    }
}

/// Capacity series, in this order: the five block classes bottom to top, then router booked.
pub const CAPACITY_SERIES: [&str; 6] =
    ["active", "pinned_source", "reserved_destination", "cached_free", "free", "booked"];
/// Queue series.
pub const QUEUE_SERIES: [&str; 5] =
    ["waiting", "running", "waiting_for_remote_kv", "held_prefills", "pending_reservations"];

/// One worker's series.
#[derive(Clone, Debug)]
pub struct WorkerSeries {
    pub worker: WorkerId,
    pub total_blocks: u64,
    pub block_size: u32,
    pub capacity: Vec<Sample<6>>,
    pub queues: Vec<Sample<5>>,
    pub capacity_bucket_ns: u64,
}

/// Everything the picture shows.
#[derive(Clone, Debug)]
pub struct TimelineData {
    pub headers: Vec<StreamHeader>,
    /// Streams that lack their end marker: the run is incomplete.
    pub unended: Vec<WorkerId>,
    pub from_ns: u64,
    pub to_ns: u64,
    pub records: u64,
    pub workers: Vec<WorkerSeries>,
    /// Stranding-cascade stalls (as `inspect` defines them with its default thresholds):
    /// worker, start and end (`None`: still stalled where reading stopped), ns.
    pub stalls: Vec<(WorkerId, u64, Option<u64>)>,
    pub stall_rule: String,
    /// Destination gating per decode worker: handoffs whose reservation waited ahead of
    /// prefill, and the peak FIFO depth.
    pub gating: Vec<(WorkerId, u64, u64)>,
    pub y_axis: YAxis,
}

/// One drawn worker's samples: the last values kept and their downsamplers.
struct WorkerSampler {
    stream: usize,
    worker: WorkerId,
    total_blocks: u64,
    last_cap: Option<[u64; 6]>,
    last_q: Option<[u64; 5]>,
    /// The latest state before the window (drawn from the window's start).
    pre_cap: Option<[u64; 6]>,
    pre_q: Option<[u64; 5]>,
    cap_ds: Option<Downsampler<6>>,
    q_ds: Option<Downsampler<5>>,
}

/// Folds a run into timeline series (one pass; stops reading after the window). The folding
/// itself (capacity, queues, bookings, stalls) is `inspect`'s; this samples its settled states.
pub fn collect(path: &Path, opts: &TimelineOptions) -> Result<TimelineData, ProjectError> {
    collect_with_progress(path, opts, &mut |_| {})
}

/// [`collect`], calling `progress` with the records read so far (every 64 Ki and at the end).
pub fn collect_with_progress(
    path: &Path,
    opts: &TimelineOptions,
    progress: &mut dyn FnMut(u64),
) -> Result<TimelineData, ProjectError> {
    let mut run = RunReader::open(path)?;
    let headers = run.headers().to_vec();
    let index: BTreeMap<WorkerId, usize> = headers.iter().enumerate().map(|(i, h)| (h.worker, i)).collect();
    let mut live: Vec<WorkerSampler> = headers
        .iter()
        .enumerate()
        .filter(|(_, h)| h.worker.role != Role::Router && opts.worker.map_or(true, |w| w == h.worker))
        .map(|(i, h)| WorkerSampler {
            stream: i,
            worker: h.worker,
            total_blocks: h.engine.total_blocks as u64,
            last_cap: None,
            last_q: None,
            pre_cap: None,
            pre_q: None,
            cap_ds: None,
            q_ds: None,
        })
        .collect();
    // The cascade definition lives in `inspect`; its fold also marks the stalls.
    let inspect_opts = InspectOptions { top_n: 0, ..InspectOptions::default() };
    let mut fold = InspectFold::new(&headers, inspect_opts);
    let mut first: Option<u64> = None;
    let mut records = 0u64;
    let to = opts.to_ns;
    let buckets = opts.max_buckets;
    let mut origin: Option<u64> = opts.from_ns;
    // The state settled at `t` is sampled.
    let sample = |live: &mut Vec<WorkerSampler>, fold: &mut InspectFold, t: u64, origin: &mut Option<u64>| {
        let o = *origin.get_or_insert(t);
        for l in live.iter_mut() {
            let Some((c, v, booked)) = fold.worker_state(l.stream) else {
                continue;
            };
            let cv = [
                c.active_blocks,
                c.pinned_source_blocks,
                c.reserved_destination_blocks,
                c.cached_free_blocks,
                c.free_blocks,
                booked,
            ];
            let qv = [v.waiting, v.running, v.waiting_for_remote_kv, v.held_prefills, v.pending_reservations];
            if t < o {
                l.pre_cap = Some(cv);
                l.pre_q = Some(qv);
                continue;
            }
            if l.last_cap != Some(cv) {
                l.last_cap = Some(cv);
                l.cap_ds
                    .get_or_insert_with(|| Downsampler::new(o, buckets))
                    .push(Sample { at_ns: t, values: cv });
            }
            if l.last_q != Some(qv) {
                l.last_q = Some(qv);
                l.q_ds
                    .get_or_insert_with(|| Downsampler::new(o, buckets))
                    .push(Sample { at_ns: t, values: qv });
            }
        }
    };
    let mut stopped = false;
    while let Some((i, rec)) = run.next()? {
        first.get_or_insert(rec.at_ns);
        if to.is_some_and(|to| rec.at_ns > to) {
            stopped = true;
            break;
        }
        records += 1;
        if records % 65_536 == 0 {
            progress(records);
        }
        if let Some(t) = fold.advance(rec.at_ns) {
            sample(&mut live, &mut fold, t, &mut origin);
        }
        fold.apply(i, &rec)?;
    }
    // The last instant read is settled by the end of the log (or of the window).
    let end = match fold.now_ns() {
        Some(t) => {
            sample(&mut live, &mut fold, t, &mut origin);
            t
        }
        None => to.unwrap_or(0),
    };
    let _ = stopped;
    progress(records);
    let from_ns = origin.unwrap_or(first.unwrap_or(0));
    let to_ns = to.unwrap_or(end).max(from_ns + 1);
    let workers = live
        .into_iter()
        .map(|l| {
            let mut capacity = Vec::new();
            let mut queues = Vec::new();
            // The state in force at the window's start, if it began before.
            let starts_late = |p: Option<u64>| p.map_or(true, |t| t > from_ns);
            let cap_points = l.cap_ds.as_ref().map(|d| d.points()).unwrap_or_default();
            let q_points = l.q_ds.as_ref().map(|d| d.points()).unwrap_or_default();
            if starts_late(cap_points.first().map(|s| s.at_ns)) {
                capacity.push(Sample {
                    at_ns: from_ns,
                    values: l.pre_cap.unwrap_or([0, 0, 0, 0, l.total_blocks, 0]),
                });
            }
            if starts_late(q_points.first().map(|s| s.at_ns)) {
                queues.push(Sample { at_ns: from_ns, values: l.pre_q.unwrap_or([0; 5]) });
            }
            capacity.extend(cap_points);
            queues.extend(q_points);
            let h = &headers[index[&l.worker]];
            WorkerSeries {
                worker: l.worker,
                total_blocks: l.total_blocks,
                block_size: h.engine.block_size,
                capacity,
                queues,
                capacity_bucket_ns: l.cap_ds.as_ref().map(|d| d.bucket_width_ns()).unwrap_or(0),
            }
        })
        .collect();
    let (report, _) = fold.finish();
    let gating = report
        .gating
        .as_ref()
        .map(|g| g.per_worker.iter().map(|w| (w.worker, w.handoffs, w.peak_pending)).collect())
        .unwrap_or_default();
    let ns = |ms: f64| (ms * NS_PER_MS_F64).round() as u64;
    let stalls = report
        .cascade
        .map(|c| {
            c.intervals
                .iter()
                .filter(|i| opts.worker.map_or(true, |w| w == i.worker))
                .map(|i| (i.worker, ns(i.started_at_ms), i.ended_at_ms.map(ns)))
                .collect()
        })
        .unwrap_or_default();
    let unended = run.unended();
    Ok(TimelineData {
        unended,
        headers,
        from_ns,
        to_ns,
        records,
        workers,
        stalls,
        stall_rule: format!(
            "stranding stall: pins ≥ {}% and queued prefill waiting ≥ {} ms",
            inspect_opts.pin_threshold_pct, inspect_opts.stall_ms
        ),
        gating,
        y_axis: opts.y_axis,
    })
}
