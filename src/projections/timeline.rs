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

use crate::events::{RunReader, StreamHeader};
use crate::ids::{Role, WorkerId};
use crate::projections::inspect::{InspectFold, InspectOptions};
use crate::projections::run::ProjectError;
use crate::units::NS_PER_MS_F64;
use std::collections::BTreeMap;
use std::fmt::Write as _;
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

/// One kept point: time and one value per series.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample<const N: usize> {
    pub at_ns: u64,
    pub values: [u64; N],
}

#[derive(Clone, Debug)]
struct Bucket<const N: usize> {
    index: u64,
    points: Vec<Sample<N>>,
}

impl<const N: usize> Bucket<N> {
    /// Keeps first, last and per-series argmin / argmax (earliest on ties), in time order.
    fn reduce(&mut self) {
        let n = self.points.len();
        if n <= 2 {
            return;
        }
        let mut keep = vec![false; n];
        keep[0] = true;
        keep[n - 1] = true;
        for c in 0..N {
            let (mut lo, mut hi) = (0, 0);
            for (i, p) in self.points.iter().enumerate() {
                if p.values[c] < self.points[lo].values[c] {
                    lo = i;
                }
                if p.values[c] > self.points[hi].values[c] {
                    hi = i;
                }
            }
            keep[lo] = true;
            keep[hi] = true;
        }
        let mut i = 0;
        self.points.retain(|_| {
            let k = keep[i];
            i += 1;
            k
        });
    }
}

/// A bounded min/max-preserving downsampler over time (see the module docs). It keeps every
/// point until it holds `RAW_POINTS_PER_BUCKET × max_buckets` of them, so short runs are drawn
/// exactly; past that it buckets.
#[derive(Clone, Debug)]
pub struct Downsampler<const N: usize> {
    origin_ns: u64,
    /// 0 while every point is kept.
    width_ns: u64,
    max_buckets: usize,
    raw: Vec<Sample<N>>,
    buckets: Vec<Bucket<N>>,
}

/// Points kept before bucketing starts, per bucket allowed.
pub const RAW_POINTS_PER_BUCKET: usize = 5;

impl<const N: usize> Downsampler<N> {
    pub fn new(origin_ns: u64, max_buckets: usize) -> Self {
        Downsampler {
            origin_ns,
            width_ns: 0,
            max_buckets: max_buckets.max(1),
            raw: Vec::new(),
            buckets: Vec::new(),
        }
    }

    /// Adds a sample; samples must come in non-decreasing time, not before the origin.
    pub fn push(&mut self, s: Sample<N>) {
        if self.width_ns == 0 {
            self.raw.push(s);
            if self.raw.len() > RAW_POINTS_PER_BUCKET * self.max_buckets {
                // Too many to keep: bucket what we have, at the width the span so far needs.
                let span = s.at_ns.saturating_sub(self.origin_ns) + 1;
                self.width_ns = span.div_ceil(self.max_buckets as u64).max(1);
                for p in std::mem::take(&mut self.raw) {
                    self.push_bucketed(p);
                }
            }
            return;
        }
        self.push_bucketed(s);
    }

    fn push_bucketed(&mut self, s: Sample<N>) {
        let offset = s.at_ns.saturating_sub(self.origin_ns);
        while offset / self.width_ns >= self.max_buckets as u64 {
            self.widen();
        }
        let index = offset / self.width_ns;
        match self.buckets.last_mut() {
            Some(b) if b.index == index => {
                b.points.push(s);
                // Reducing in batches keeps the same points (the extremes of a union are the
                // extremes of its parts' extremes) at a fraction of the work.
                if b.points.len() > 4 * (1 + N) {
                    b.reduce();
                }
            }
            _ => self.buckets.push(Bucket { index, points: vec![s] }),
        }
    }

    fn widen(&mut self) {
        self.width_ns = self.width_ns.saturating_mul(2);
        let old = std::mem::take(&mut self.buckets);
        for mut b in old {
            b.index /= 2;
            match self.buckets.last_mut() {
                Some(last) if last.index == b.index => {
                    last.points.append(&mut b.points);
                    if last.points.len() > 4 * (1 + N) {
                        last.reduce();
                    }
                }
                _ => self.buckets.push(b),
            }
        }
    }

    /// The bucket width (0: no point was dropped).
    pub fn bucket_width_ns(&self) -> u64 {
        self.width_ns
    }

    /// The kept samples in time order.
    pub fn points(&self) -> Vec<Sample<N>> {
        if self.width_ns == 0 {
            return self.raw.clone();
        }
        let mut out = Vec::new();
        for b in &self.buckets {
            let mut b = b.clone();
            b.reduce();
            out.extend_from_slice(&b.points);
        }
        out
    }
}

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

struct Live {
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
    let mut live: Vec<Live> = headers
        .iter()
        .enumerate()
        .filter(|(_, h)| h.worker.role != Role::Router && opts.worker.map_or(true, |w| w == h.worker))
        .map(|(i, h)| Live {
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
    let sample = |live: &mut Vec<Live>, fold: &mut InspectFold, t: u64, origin: &mut Option<u64>| {
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
    Ok(TimelineData {
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

// ------------------------------------------------------------------------------------------
// SVG
// ------------------------------------------------------------------------------------------

const WIDTH: f64 = 1200.0;
const LEFT: f64 = 78.0;
const RIGHT: f64 = 24.0;
const CAP_H: f64 = 190.0;
const Q_H: f64 = 80.0;
const PANEL_GAP: f64 = 64.0;
const HEAD: f64 = 96.0;

/// Colors of the block classes (bottom to top) and of the booked line.
const CAP_COLORS: [&str; 5] = ["#3b6fb6", "#e0542c", "#8e5cc2", "#9fd49a", "#eceff3"];
const CAP_LABELS: [&str; 5] = ["active", "pinned source", "reserved destination", "cached-free", "free"];
const Q_COLORS: [&str; 5] = ["#d62f8f", "#3b6fb6", "#8e5cc2", "#e0542c", "#1d9e8f"];
const Q_LABELS: [&str; 5] =
    ["waiting", "running", "waiting for remote KV", "held prefills", "pending reservations"];

pub(crate) fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// A "nice" tick step (1, 2 or 5 × 10^k) giving about `target` ticks over `span`.
pub(crate) fn nice_step(span: f64, target: f64) -> f64 {
    if span <= 0.0 || !span.is_finite() {
        return 1.0;
    }
    let raw = span / target;
    let mag = 10f64.powf(raw.log10().floor());
    let norm = raw / mag;
    let m = if norm <= 1.0 {
        1.0
    } else if norm <= 2.0 {
        2.0
    } else if norm <= 5.0 {
        5.0
    } else {
        10.0
    };
    m * mag
}

pub(crate) fn fmt_tick(v: f64, step: f64) -> String {
    let decimals = if step >= 1.0 { 0 } else { (-step.log10().floor()) as usize };
    format!("{v:.decimals$}")
}

struct Scale {
    t0: f64,
    t1: f64,
    x0: f64,
    x1: f64,
}

impl Scale {
    fn x(&self, t_ns: u64) -> f64 {
        let t = t_ns as f64;
        let f = ((t - self.t0) / (self.t1 - self.t0)).clamp(0.0, 1.0);
        self.x0 + f * (self.x1 - self.x0)
    }
}

/// Step path of one stacked layer: the top boundary left to right, the bottom right to left.
pub(crate) fn layer_path(xs: &[f64], tops: &[f64], bottoms: &[f64], x_end: f64) -> String {
    let mut d = String::new();
    let n = xs.len();
    let _ = write!(d, "M{:.2},{:.2}", xs[0], tops[0]);
    for i in 1..n {
        let _ = write!(d, "H{:.2}V{:.2}", xs[i], tops[i]);
    }
    let _ = write!(d, "H{:.2}V{:.2}", x_end, bottoms[n - 1]);
    for i in (0..n).rev() {
        let _ = write!(d, "H{:.2}", xs[i]);
        if i > 0 {
            let _ = write!(d, "V{:.2}", bottoms[i - 1]);
        }
    }
    d.push('Z');
    d
}

/// Step line through `(x, y)` points, held to `x_end`.
pub(crate) fn step_line(xs: &[f64], ys: &[f64], x_end: f64) -> String {
    let mut d = String::new();
    let _ = write!(d, "M{:.2},{:.2}", xs[0], ys[0]);
    for i in 1..xs.len() {
        let _ = write!(d, "H{:.2}V{:.2}", xs[i], ys[i]);
    }
    let _ = write!(d, "H{x_end:.2}");
    d
}

fn legend(svg: &mut String, x: &mut f64, y: f64, color: &str, label: &str, dashed: bool, line: bool) {
    if line {
        let dash = if dashed { " stroke-dasharray=\"5,3\"" } else { "" };
        let _ = write!(
            svg,
            r#"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{color}" stroke-width="2"{dash}/>"#,
            *x,
            y - 4.0,
            *x + 18.0,
            y - 4.0
        );
    } else {
        let _ = write!(
            svg,
            r##"<rect x="{:.1}" y="{:.1}" width="14" height="10" fill="{color}" stroke="#8a9099" stroke-width="0.5"/>"##,
            *x,
            y - 9.0
        );
    }
    let _ = write!(svg, r#"<text x="{:.1}" y="{:.1}">{}</text>"#, *x + 22.0, y, esc(label));
    // Generic sans-serif at 12 px averages about 6.6 px per character.
    *x += 22.0 + label.chars().count() as f64 * 6.6 + 18.0;
}

/// Renders the timeline as a standalone SVG document.
pub fn render_svg(data: &TimelineData) -> String {
    let n = data.workers.len().max(1) as f64;
    let height = HEAD + n * (CAP_H + Q_H + PANEL_GAP + 80.0) + 10.0;
    let mut svg = String::with_capacity(64 * 1024);
    let _ = write!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH:.0}" height="{height:.0}" viewBox="0 0 {WIDTH:.0} {height:.0}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="12" fill="#222">"##
    );
    let _ = write!(svg, r#"<rect x="0" y="0" width="{WIDTH:.0}" height="{height:.0}" fill="white"/>"#);
    // Title: run info from the headers.
    let h0 = data.headers.first();
    let span_ms = (data.to_ns - data.from_ns) as f64 / NS_PER_MS_F64;
    let use_s = span_ms >= 10_000.0;
    let (unit, div) = if use_s { ("s", 1e9) } else { ("ms", NS_PER_MS_F64) };
    let title = match h0 {
        Some(h) => format!(
            "KV blocks per worker · {} · {} · seed {} · run {}",
            h.backend.as_str(),
            h.policy.as_str(),
            h.seed,
            h.run_id
        ),
        None => "KV blocks per worker".to_string(),
    };
    let sub = format!(
        "{} worker{} drawn · {:.3}–{:.3} {unit} · {} records read",
        data.workers.len(),
        if data.workers.len() == 1 { "" } else { "s" },
        data.from_ns as f64 / div,
        data.to_ns as f64 / div,
        data.records
    );
    let _ = write!(
        svg,
        r##"<text x="{LEFT}" y="26" font-size="17" font-weight="bold">{}</text><text x="{LEFT}" y="46" fill="#555">{}</text>"##,
        esc(&title),
        esc(&sub)
    );
    // Legend.
    let mut lx = LEFT;
    for k in 0..5 {
        legend(&mut svg, &mut lx, 70.0, CAP_COLORS[k], CAP_LABELS[k], false, false);
    }
    legend(&mut svg, &mut lx, 70.0, "#111", "router booked", true, true);
    if !data.stalls.is_empty() {
        legend(&mut svg, &mut lx, 70.0, "#b00020", &data.stall_rule, false, false);
    }
    let mut lx = LEFT;
    for k in 0..5 {
        legend(&mut svg, &mut lx, 88.0, Q_COLORS[k], Q_LABELS[k], false, true);
    }

    let sc = Scale { t0: data.from_ns as f64, t1: data.to_ns as f64, x0: LEFT, x1: WIDTH - RIGHT };
    let t_step = nice_step((data.to_ns - data.from_ns) as f64 / div, 10.0);
    let mut top = HEAD;
    for (wi, w) in data.workers.iter().enumerate() {
        let cap_top = top + 50.0;
        let cap_bottom = cap_top + CAP_H;
        let q_top = cap_bottom + 30.0;
        let q_bottom = q_top + Q_H;
        let h = data.headers.iter().find(|h| h.worker == w.worker);
        // What happened on this worker, in one line under its name.
        let mine: Vec<_> = data.stalls.iter().filter(|s| s.0 == w.worker).collect();
        let gated = data.gating.iter().find(|g| g.0 == w.worker);
        let (note, note_color) = match (mine.first(), gated) {
            (Some((_, a, b)), _) => (
                format!(
                    "stranding stall{} ×{}, first {:.3}–{} {unit}",
                    if mine.len() > 1 { "s" } else { "" },
                    mine.len(),
                    *a as f64 / div,
                    b.map(|b| format!("{:.3}", b as f64 / div)).unwrap_or_else(|| "end".into())
                ),
                "#7a0016",
            ),
            (None, Some((_, n, peak))) => (
                format!(
                    "destination gating: {n} reservations waited here ahead of their prefill (FIFO peak {peak}); no stranded source KV"
                ),
                "#0f6e64",
            ),
            (None, None) => (String::new(), "#555"),
        };
        let _ = write!(
            svg,
            r##"<text x="{LEFT}" y="{:.1}" font-size="14" font-weight="bold">{} · {} blocks × {} tokens{}</text><text x="{LEFT}" y="{:.1}" font-size="11" fill="{note_color}">{}</text>"##,
            top + 14.0,
            w.worker,
            w.total_blocks,
            w.block_size,
            h.map(|h| format!(" · {}", h.backend.as_str())).unwrap_or_default(),
            top + 30.0,
            esc(&note),
        );
        // --- capacity chart ---
        // The value the chart's top stands for: the pool, or the peak of what is in use.
        let used_peak = w.capacity.iter().map(|s| s.values[0] + s.values[1] + s.values[2]).max().unwrap_or(0);
        let (layers, chart_top) = match data.y_axis {
            YAxis::Used => {
                let step = nice_step(used_peak.max(1) as f64, 4.0).max(1.0);
                (3, ((used_peak.max(1) as f64 / step).ceil() * step).max(1.0) as u64)
            }
            YAxis::Blocks | YAxis::Percent => (5, w.total_blocks),
        };
        let total = chart_top.max(1) as f64;
        let ypx = |v: f64| cap_bottom - (v / total).min(1.0) * CAP_H;
        let _ = write!(
            svg,
            r#"<g class="capacity" data-worker="{}" data-t0-ns="{}" data-t1-ns="{}" data-x0="{:.2}" data-x1="{:.2}" data-y-bottom="{:.2}" data-y-top="{:.2}" data-blocks-top="{}" data-bucket-ns="{}">"#,
            w.worker,
            data.from_ns,
            data.to_ns,
            sc.x0,
            sc.x1,
            cap_bottom,
            cap_top,
            chart_top,
            w.capacity_bucket_ns
        );
        let _ = write!(
            svg,
            r##"<clipPath id="clip{wi}"><rect x="{:.2}" y="{:.2}" width="{:.2}" height="{:.2}"/></clipPath>"##,
            sc.x0,
            cap_top - 1.0,
            sc.x1 - sc.x0,
            CAP_H + 2.0
        );
        if !w.capacity.is_empty() {
            let xs: Vec<f64> = w.capacity.iter().map(|s| sc.x(s.at_ns)).collect();
            let mut below = vec![0.0f64; w.capacity.len()];
            for k in 0..layers {
                let above: Vec<f64> =
                    w.capacity.iter().zip(&below).map(|(s, b)| b + s.values[k] as f64).collect();
                let tops: Vec<f64> = above.iter().map(|v| ypx(*v)).collect();
                let bottoms: Vec<f64> = below.iter().map(|v| ypx(*v)).collect();
                let _ = write!(
                    svg,
                    r#"<path data-series="{}" d="{}" fill="{}" stroke="none"/>"#,
                    CAPACITY_SERIES[k],
                    layer_path(&xs, &tops, &bottoms, sc.x1),
                    CAP_COLORS[k]
                );
                below = above;
            }
            let booked: Vec<f64> = w.capacity.iter().map(|s| ypx(s.values[5] as f64)).collect();
            let _ = write!(
                svg,
                r##"<path data-series="booked" d="{}" fill="none" stroke="#111" stroke-width="1.6" stroke-dasharray="5,3" clip-path="url(#clip{wi})"/>"##,
                step_line(&xs, &booked, sc.x1)
            );
            // Where the router booked more than the worker has, say so on the top edge.
            let over: Vec<usize> =
                (0..w.capacity.len()).filter(|i| w.capacity[*i].values[5] > w.total_blocks).collect();
            if !over.is_empty() {
                let peak = over.iter().map(|i| w.capacity[*i].values[5]).max().unwrap_or(0);
                let _ = write!(
                    svg,
                    r##"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="#111" font-size="11">router booked up to {} blocks, above the {} the worker has (dashed line clipped at the top)</text>"##,
                    sc.x1,
                    top + 14.0,
                    peak,
                    w.total_blocks
                );
            }
        }
        // Stranding stalls on this worker, as a band over the stack.
        for (sw, start, end) in &data.stalls {
            if *sw != w.worker {
                continue;
            }
            let xa = sc.x(*start);
            let xb = sc.x(end.unwrap_or(data.to_ns));
            if xb <= xa {
                continue;
            }
            let decimals = if use_s { 1 } else { 0 };
            let label = format!(
                "stall {:.decimals$}–{} {unit}",
                *start as f64 / div,
                end.map(|e| format!("{:.decimals$}", e as f64 / div)).unwrap_or_else(|| "end".into())
            );
            let text_w = label.chars().count() as f64 * 6.4 + 8.0;
            // Label a band only where it fits inside it; the panel title counts them all.
            let text = if xb - xa >= text_w {
                format!(
                    r##"<text x="{:.2}" y="{:.2}" fill="white" font-size="11" font-weight="bold">{}</text>"##,
                    xa + 4.0,
                    cap_top - 5.0,
                    esc(&label)
                )
            } else {
                String::new()
            };
            let _ = write!(
                svg,
                r##"<rect class="stall" x="{xa:.2}" y="{cap_top:.2}" width="{w:.2}" height="{CAP_H:.2}" fill="#b00020" fill-opacity="0.08" stroke="#7a0016" stroke-width="1.4" stroke-dasharray="5,3"/><rect x="{xa:.2}" y="{:.2}" width="{w:.2}" height="13" fill="#b00020" stroke="white" stroke-width="0.5"/>{text}"##,
                cap_top - 15.0,
                w = xb - xa,
            );
        }
        svg.push_str("</g>");
        // Axes of the capacity chart.
        match data.y_axis {
            YAxis::Blocks => {
                axis_y(&mut svg, cap_top, cap_bottom, w.total_blocks as f64, "blocks", sc.x0, sc.x1)
            }
            YAxis::Used => {
                axis_y(&mut svg, cap_top, cap_bottom, chart_top as f64, "blocks in use", sc.x0, sc.x1)
            }
            YAxis::Percent => axis_y(&mut svg, cap_top, cap_bottom, 100.0, "% of blocks", sc.x0, sc.x1),
        }
        axis_x(&mut svg, &sc, cap_bottom, data, t_step, div, false, unit);
        // --- queue chart ---
        let q_max = w.queues.iter().flat_map(|s| s.values.iter().copied()).max().unwrap_or(0).max(1) as f64;
        let q_step = nice_step(q_max, 3.0).max(1.0);
        let q_top_val = (q_max / q_step).ceil() * q_step;
        let qy = |v: f64| q_bottom - (v / q_top_val) * Q_H;
        let _ = write!(
            svg,
            r#"<g class="queues" data-worker="{}" data-t0-ns="{}" data-t1-ns="{}" data-x0="{:.2}" data-x1="{:.2}" data-y-bottom="{:.2}" data-y-top="{:.2}" data-value-top="{}">"#,
            w.worker, data.from_ns, data.to_ns, sc.x0, sc.x1, q_bottom, q_top, q_top_val
        );
        if !w.queues.is_empty() {
            let xs: Vec<f64> = w.queues.iter().map(|s| sc.x(s.at_ns)).collect();
            for k in 0..5 {
                if w.queues.iter().all(|s| s.values[k] == 0) {
                    continue;
                }
                let ys: Vec<f64> = w.queues.iter().map(|s| qy(s.values[k] as f64)).collect();
                // Dense lines (more than a point per 3 px) are drawn thin so they stay legible.
                let stroke = if w.queues.len() as f64 > (sc.x1 - sc.x0) / 3.0 { 0.8 } else { 1.6 };
                let _ = write!(
                    svg,
                    r#"<path data-series="{}" d="{}" fill="none" stroke="{}" stroke-width="{stroke}"/>"#,
                    QUEUE_SERIES[k],
                    step_line(&xs, &ys, sc.x1),
                    Q_COLORS[k]
                );
            }
        }
        svg.push_str("</g>");
        axis_y(&mut svg, q_top, q_bottom, q_top_val, "requests", sc.x0, sc.x1);
        axis_x(&mut svg, &sc, q_bottom, data, t_step, div, true, unit);
        top = q_bottom + PANEL_GAP;
    }
    svg.push_str("</svg>\n");
    svg
}

fn axis_y(svg: &mut String, y_top: f64, y_bottom: f64, top_val: f64, label: &str, x0: f64, x1: f64) {
    let step = nice_step(top_val, 4.0).max(1.0);
    let _ = write!(
        svg,
        r##"<rect x="{x0:.2}" y="{y_top:.2}" width="{:.2}" height="{:.2}" fill="none" stroke="#9aa0a8" stroke-width="1"/>"##,
        x1 - x0,
        y_bottom - y_top
    );
    let mut v = 0.0;
    while v <= top_val + 1e-9 {
        let y = y_bottom - (v / top_val.max(1e-9)) * (y_bottom - y_top);
        let _ = write!(
            svg,
            r##"<line x1="{:.2}" y1="{y:.2}" x2="{x0:.2}" y2="{y:.2}" stroke="#9aa0a8"/><line x1="{x0:.2}" y1="{y:.2}" x2="{x1:.2}" y2="{y:.2}" stroke="#000" stroke-opacity="0.07"/><text x="{:.2}" y="{:.2}" text-anchor="end" font-size="11">{}</text>"##,
            x0 - 4.0,
            x0 - 6.0,
            y + 4.0,
            fmt_tick(v, step)
        );
        v += step;
    }
    let cy = (y_top + y_bottom) / 2.0;
    let _ = write!(
        svg,
        r##"<text transform="translate({:.2},{cy:.2}) rotate(-90)" text-anchor="middle" fill="#555">{label}</text>"##,
        x0 - 52.0
    );
}

#[allow(clippy::too_many_arguments)]
fn axis_x(
    svg: &mut String,
    sc: &Scale,
    y: f64,
    data: &TimelineData,
    step: f64,
    div: f64,
    with_label: bool,
    unit: &str,
) {
    let from = data.from_ns as f64 / div;
    let to = data.to_ns as f64 / div;
    let mut v = (from / step).ceil() * step;
    while v <= to + 1e-9 {
        let x = sc.x((v * div) as u64);
        let _ = write!(
            svg,
            r##"<line x1="{x:.2}" y1="{y:.2}" x2="{x:.2}" y2="{:.2}" stroke="#9aa0a8"/><text x="{x:.2}" y="{:.2}" text-anchor="middle" font-size="11">{}</text>"##,
            y + 4.0,
            y + 16.0,
            fmt_tick(v, step)
        );
        v += step;
    }
    if with_label {
        let _ = write!(
            svg,
            r##"<text x="{:.2}" y="{:.2}" text-anchor="middle" fill="#555">time ({unit})</text>"##,
            (sc.x0 + sc.x1) / 2.0,
            y + 32.0
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
        /// Kept points are input points; each bucket's per-series min and max survive; the
        /// number of points stays within (2 + 2N) per bucket.
        #[test]
        fn downsampling_keeps_real_points_and_extremes(
            steps in proptest::collection::vec((0u64..5_000_000, 0u64..100, 0u64..100), 1..600),
            buckets in 1usize..40,
        ) {
            let mut ds = Downsampler::<2>::new(0, buckets);
            let mut t = 0u64;
            let mut input = Vec::new();
            for (dt, a, b) in steps {
                t += dt;
                let s = Sample { at_ns: t, values: [a, b] };
                input.push(s);
                ds.push(s);
            }
            let kept = ds.points();
            let w = ds.bucket_width_ns();
            if w == 0 {
                // Nothing dropped while few points came.
                prop_assert_eq!(&kept, &input);
                prop_assert!(input.len() <= RAW_POINTS_PER_BUCKET * buckets);
                return Ok(());
            }
            prop_assert!(kept.len() <= 6 * buckets.max(1));
            for k in &kept {
                prop_assert!(input.contains(k));
            }
            prop_assert!(kept.windows(2).all(|p| p[0].at_ns <= p[1].at_ns));
            // Per bucket: extremes of every series are present among the kept points.
            let mut by_bucket: BTreeMap<u64, Vec<Sample<2>>> = BTreeMap::new();
            for s in &input {
                by_bucket.entry(s.at_ns / w).or_default().push(*s);
            }
            for (b, ss) in by_bucket {
                let kb: Vec<_> = kept.iter().filter(|s| s.at_ns / w == b).collect();
                for c in 0..2 {
                    let lo = ss.iter().map(|s| s.values[c]).min().unwrap();
                    let hi = ss.iter().map(|s| s.values[c]).max().unwrap();
                    prop_assert!(kb.iter().any(|s| s.values[c] == lo), "bucket {b} lost min of {c}");
                    prop_assert!(kb.iter().any(|s| s.values[c] == hi), "bucket {b} lost max of {c}");
                }
                prop_assert_eq!(kb.first().map(|s| **s), ss.first().copied());
                prop_assert_eq!(kb.last().map(|s| **s), ss.last().copied());
            }
        }
    }
}
