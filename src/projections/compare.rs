//! `handoff-log compare`: what each of several runs was and what came out of it, folded from
//! its logs, and a picture of their latency CDFs and stranded KV over time.
//!
//! One streaming pass per run feeds three folds: the serving metrics ([`MetricsFold`], with the
//! goodput objectives, so a run compared here reports what its replay reported), the post-mortem
//! ([`InspectFold`], for per-worker peaks, bootstrap timeouts and the cascade), and a cluster
//! sum of pinned source and reserved destination blocks at every settled instant (downsampled
//! as the timeline is). Memory does not grow with the length of the log: the latency CDFs are
//! drawn from the metrics' bounded distribution buckets, not from kept samples.
//!
//! What was run comes from the stream headers (backend, policy, seed, run id, and the shape from
//! which workers have streams) and, for replays, from the router stream's header `config_json`,
//! a [`RunDescription`] (trace, routers, config digest). Logs without one (live workers, older
//! replays) show those as unknown.

use crate::events::{Fact, RunReader, StreamHeader};
use crate::ids::{Role, WorkerId};
use crate::projections::inspect::{InspectFold, InspectOptions, PeakAt};
use crate::projections::metrics::{MetricsFold, MetricsReport, Slo};
use crate::projections::run::ProjectError;
use crate::projections::svg::{esc, fmt_tick, layer_path, nice_step};
use crate::projections::timeline::{Downsampler, Sample};
use crate::router::RouterMode;
use crate::units::NS_PER_MS_F64;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// What a replay records about itself in its router stream's header (`config_json`). Every
/// field is optional: a reader takes what is there and ignores keys it does not know.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RunDescription {
    /// The trace path as given to the replay.
    pub trace: Option<String>,
    pub trace_bytes: Option<u64>,
    /// Lines in the trace, when the replay knew them before it started (a trace of at most
    /// 1 MiB, all of it fingerprinted for the run id).
    pub trace_lines: Option<u64>,
    /// `2P+2D` or `4 aggregated`.
    pub shape: Option<String>,
    pub prefill_router: Option<RouterMode>,
    /// `None` on an aggregated cluster.
    pub decode_router: Option<RouterMode>,
    /// 16 hex digits: see `adapters::replay::identity`.
    pub config_digest: Option<String>,
}

impl RunDescription {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The description in a router header; empty when the header carries none (or text that
    /// is not one: the field is free-form for writers other than the replay).
    pub fn from_header(header: &StreamHeader) -> Self {
        serde_json::from_str(&header.engine.config_json).unwrap_or_default()
    }
}

/// A router mode as people read it: its name, with its parameters when they are not the
/// defaults (`kv(overlap_weight=2,temperature=0.5)`, `device-aware(weights=1,2)`).
pub fn router_label(mode: &RouterMode) -> String {
    match mode {
        RouterMode::KvAware { overlap_weight, temperature } if mode != &RouterMode::kv() => {
            format!("kv(overlap_weight={overlap_weight},temperature={temperature})")
        }
        RouterMode::DeviceAware { weights } if !weights.is_empty() => {
            let w: Vec<String> = weights.iter().map(|w| w.to_string()).collect();
            format!("device-aware(weights={})", w.join(","))
        }
        m => m.name().to_string(),
    }
}

/// What to fold.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CompareOptions {
    /// Goodput objectives (empty: no goodput).
    pub slo: Slo,
    /// Points per latency CDF (about).
    pub cdf_points: usize,
    /// Time buckets of the blocks-over-time series (as `timeline --buckets`).
    pub series_buckets: usize,
}

impl Default for CompareOptions {
    fn default() -> Self {
        CompareOptions { slo: Slo::default(), cdf_points: 400, series_buckets: 300 }
    }
}

/// A worker's peak of one block class.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct WorkerPeak {
    pub worker: WorkerId,
    pub blocks: u64,
    pub at_ms: f64,
}

/// Everything `compare` shows about one run.
#[derive(Clone, Debug, PartialEq)]
pub struct RunSummary {
    pub path: PathBuf,
    pub run_id: String,
    pub backend: String,
    pub policy: String,
    pub seed: u64,
    /// From the streams present: `2P+2D` or `4 aggregated`.
    pub shape: String,
    pub description: RunDescription,
    pub metrics: MetricsReport,
    /// The highest per-worker peak of pinned source / reserved destination blocks (the
    /// inspect report's peaks; the first worker in canonical order on a tie). `None` when no
    /// engine worker ever held any.
    pub peak_pinned: Option<WorkerPeak>,
    pub peak_reserved: Option<WorkerPeak>,
    /// `RequestPreempted` facts on any worker (vLLM preemption, SGLang retraction).
    pub preemptions: u64,
    /// Handoffs canceled by the bootstrap timeout (destination-first).
    pub bootstrap_timeouts: u64,
    /// When the run's stranding cascade started (inspect's definition), if it had one.
    pub cascade_started_at_ms: Option<f64>,
    /// CDFs of completed requests' TTFT and E2E latency: `(ms, share ≤ ms)`.
    pub ttft_cdf_ms: Vec<(f64, f64)>,
    pub e2e_cdf_ms: Vec<(f64, f64)>,
    /// Pinned source and reserved destination blocks summed over workers, at settled instants
    /// (`values` = [pinned, reserved]), downsampled keeping each bucket's extremes.
    pub blocks_series: Vec<Sample<2>>,
    /// The largest settled pinned + reserved sum (exact, before downsampling).
    pub peak_pinned_plus_reserved_blocks: u64,
    pub first_at_ns: u64,
    pub last_at_ns: u64,
    pub records: u64,
}

/// `2P+2D` from the streams of a run, or `4 aggregated`.
pub fn shape_of(headers: &[StreamHeader]) -> String {
    let count = |r: Role| headers.iter().filter(|h| h.worker.role == r).count();
    let (p, d, a) = (count(Role::Prefill), count(Role::Decode), count(Role::Aggregated));
    match (p + d, a) {
        (0, a) => format!("{a} aggregated"),
        (_, 0) => format!("{p}P+{d}D"),
        (_, a) => format!("{p}P+{d}D+{a} aggregated"),
    }
}

fn highest(peaks: impl Iterator<Item = (WorkerId, PeakAt)>) -> Option<WorkerPeak> {
    let mut best: Option<WorkerPeak> = None;
    for (worker, p) in peaks {
        if p.value > best.map_or(0, |b| b.blocks) {
            best = Some(WorkerPeak { worker, blocks: p.value, at_ms: p.at_ms });
        }
    }
    best
}

/// Folds one run (directory, merged file or stream file). `progress` gets the records read so
/// far, every 64 Ki records and at the end.
pub fn summarize_run(
    path: &Path,
    opts: &CompareOptions,
    progress: &mut dyn FnMut(u64),
) -> Result<RunSummary, ProjectError> {
    let mut run = RunReader::open(path)?;
    let headers = run.headers().to_vec();
    let mut metrics = MetricsFold::new().with_slo(opts.slo);
    for h in &headers {
        metrics.add_stream(h);
    }
    // Only pass one of inspect: the longest pins' timelines are not shown here.
    let mut inspect = InspectFold::new(&headers, InspectOptions { top_n: 0, ..InspectOptions::default() });
    let mut blocks = [0i64; 2];
    let mut last_sample: Option<[u64; 2]> = None;
    let mut series: Option<Downsampler<2>> = None;
    let mut peak_sum = 0u64;
    let mut preemptions = 0u64;
    let mut records = 0u64;
    let mut first: Option<u64> = None;
    // The sums as they stood once instant `t` settled.
    let mut sample = |t: u64, blocks: [i64; 2], origin: u64| {
        let v = [blocks[0].max(0) as u64, blocks[1].max(0) as u64];
        peak_sum = peak_sum.max(v[0] + v[1]);
        if last_sample != Some(v) {
            last_sample = Some(v);
            series
                .get_or_insert_with(|| Downsampler::new(origin, opts.series_buckets))
                .push(Sample { at_ns: t, values: v });
        }
    };
    while let Some((i, rec)) = run.next()? {
        let origin = *first.get_or_insert(rec.at_ns);
        records += 1;
        if records % 65_536 == 0 {
            progress(records);
        }
        if let Some(t) = inspect.advance(rec.at_ns) {
            sample(t, blocks, origin);
        }
        inspect.apply(i, &rec)?;
        metrics.apply(headers[i].worker, &rec);
        let d = rec.fact.kv_delta();
        blocks[0] += d.pinned_source as i64;
        blocks[1] += d.reserved_destination as i64;
        if matches!(rec.fact, Fact::RequestPreempted { .. }) {
            preemptions += 1;
        }
    }
    progress(records);
    let first_at_ns = first.unwrap_or(0);
    let last_at_ns = inspect.now_ns().unwrap_or(0);
    if records > 0 {
        sample(last_at_ns, blocks, first_at_ns);
    }
    let blocks_series = series.map(|s| s.points()).unwrap_or_default();
    let ttft_cdf_ms = metrics.ttft_distribution().cdf(NS_PER_MS_F64, opts.cdf_points);
    let e2e_cdf_ms = metrics.e2e_distribution().cdf(NS_PER_MS_F64, opts.cdf_points);
    let report = metrics.report();
    let (post_mortem, _) = inspect.finish();
    let description = headers
        .iter()
        .find(|h| h.worker.role == Role::Router)
        .map(RunDescription::from_header)
        .unwrap_or_default();
    let h0 = headers.first();
    Ok(RunSummary {
        path: path.to_path_buf(),
        run_id: h0.map(|h| h.run_id.to_string()).unwrap_or_default(),
        backend: h0.map(|h| h.backend.as_str().to_string()).unwrap_or_default(),
        policy: h0.map(|h| h.policy.as_str().to_string()).unwrap_or_default(),
        seed: h0.map_or(0, |h| h.seed),
        shape: shape_of(&headers),
        description,
        metrics: report,
        peak_pinned: highest(post_mortem.peaks.iter().map(|p| (p.worker, p.pinned_source))),
        peak_reserved: highest(post_mortem.peaks.iter().map(|p| (p.worker, p.reserved_destination))),
        preemptions,
        bootstrap_timeouts: post_mortem
            .wait_breakdown
            .outcomes
            .canceled_by_reason
            .get("bootstrap-timeout")
            .copied()
            .unwrap_or(0),
        cascade_started_at_ms: post_mortem.cascade.map(|c| c.started_at_ms),
        ttft_cdf_ms,
        e2e_cdf_ms,
        blocks_series,
        peak_pinned_plus_reserved_blocks: peak_sum,
        first_at_ns,
        last_at_ns,
        records,
    })
}

// ------------------------------------------------------------------------------------------
// SVG
// ------------------------------------------------------------------------------------------

const WIDTH: f64 = 1000.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 24.0;
const PANEL_GAP: f64 = 70.0;
const CDF_TOP: f64 = 86.0;
const CDF_H: f64 = 240.0;
const STRIP_H: f64 = 80.0;
/// Vertical room per strip besides its chart: title above, axis labels below.
const STRIP_EXTRA: f64 = 62.0;

/// One color per run, in order (cycled past eight runs).
const RUN_COLORS: [&str; 8] =
    ["#3b6fb6", "#e0542c", "#1d9e8f", "#8e5cc2", "#d62f8f", "#6b8e23", "#b8860b", "#555555"];
/// The timeline's colors for the two block classes.
const PINNED_COLOR: &str = "#e0542c";
const RESERVED_COLOR: &str = "#8e5cc2";

/// Milliseconds shown in seconds from 10,000 ms on, as the tables do.
fn time_unit(max_ms: f64) -> (&'static str, f64) {
    if max_ms >= 10_000.0 {
        ("s", 1e3)
    } else {
        ("ms", 1.0)
    }
}

/// Renders the comparison as a standalone SVG: the TTFT and E2E CDFs of every run side by side
/// (one line per run, legend by `names`), and below them one strip per run of pinned and
/// reserved blocks over time, summed over workers. `names[i]` names `runs[i]`.
///
/// Geometry carries `data-*` attributes so tests can read values back: each CDF panel its
/// x range in ms and pixel edges, each CDF line `data-run` and `data-chart` (`ttft`, `e2e`).
pub fn render_svg(runs: &[RunSummary], names: &[String]) -> String {
    let strips_top = CDF_TOP + CDF_H + 96.0;
    let height = strips_top + runs.len() as f64 * (STRIP_H + STRIP_EXTRA) + 10.0;
    let mut svg = String::with_capacity(64 * 1024);
    let _ = write!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH:.0}" height="{height:.0}" viewBox="0 0 {WIDTH:.0} {height:.0}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="12" fill="#222">"##
    );
    let _ = write!(svg, r#"<rect x="0" y="0" width="{WIDTH:.0}" height="{height:.0}" fill="white"/>"#);
    let title = format!("{} run{} compared", runs.len(), if runs.len() == 1 { "" } else { "s" });
    let _ = write!(
        svg,
        r##"<text x="{LEFT}" y="26" font-size="17" font-weight="bold">{}</text><text x="{LEFT}" y="46" fill="#555">{}</text>"##,
        esc(&title),
        esc("latency CDFs of completed requests; below, pinned source + reserved destination blocks summed over workers")
    );
    let panel_w = (WIDTH - LEFT - RIGHT - PANEL_GAP) / 2.0;
    for (k, (chart, label)) in [("ttft", "TTFT"), ("e2e", "E2E latency")].into_iter().enumerate() {
        let x0 = LEFT + k as f64 * (panel_w + PANEL_GAP);
        let cdfs: Vec<&Vec<(f64, f64)>> =
            runs.iter().map(|r| if k == 0 { &r.ttft_cdf_ms } else { &r.e2e_cdf_ms }).collect();
        cdf_panel(&mut svg, chart, label, x0, panel_w, &cdfs, names);
    }
    // Legend: one line swatch per run.
    let mut lx = LEFT;
    let ly = CDF_TOP + CDF_H + 62.0;
    for (i, name) in names.iter().enumerate() {
        let color = RUN_COLORS[i % RUN_COLORS.len()];
        let _ = write!(
            svg,
            r#"<g class="legend" data-run="{}"><line x1="{lx:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{color}" stroke-width="3"/><text x="{:.1}" y="{ly:.1}">{}</text></g>"#,
            esc(name),
            ly - 4.0,
            lx + 22.0,
            ly - 4.0,
            lx + 28.0,
            esc(name)
        );
        // Generic sans-serif at 12 px averages about 6.6 px per character.
        lx += 28.0 + name.chars().count() as f64 * 6.6 + 24.0;
    }
    // Strips share one time axis (from each run's first record) and one block scale.
    let span_ns = runs.iter().map(|r| r.last_at_ns.saturating_sub(r.first_at_ns)).max().unwrap_or(0).max(1);
    let top_blocks = runs.iter().map(|r| r.peak_pinned_plus_reserved_blocks).max().unwrap_or(0).max(1);
    let (unit, div) = time_unit(span_ns as f64 / NS_PER_MS_F64);
    let span = span_ns as f64 / NS_PER_MS_F64 / div;
    let step = nice_step(span, 10.0);
    let (x0, x1) = (LEFT, WIDTH - RIGHT);
    let x_of = |t_ns: u64, origin: u64| {
        x0 + (t_ns.saturating_sub(origin) as f64 / span_ns as f64).min(1.0) * (x1 - x0)
    };
    for (i, r) in runs.iter().enumerate() {
        let top = strips_top + i as f64 * (STRIP_H + STRIP_EXTRA);
        let chart_top = top + 22.0;
        let bottom = chart_top + STRIP_H;
        let y_of = |v: f64| bottom - (v / top_blocks as f64).min(1.0) * STRIP_H;
        let _ = write!(
            svg,
            r##"<text x="{LEFT}" y="{:.1}" font-size="13" font-weight="bold">{}</text><text x="{:.1}" y="{:.1}" fill="#555" font-size="11">{} · {} · {} · peak pinned + reserved {} blocks</text>"##,
            top + 12.0,
            esc(&names[i]),
            LEFT + names[i].chars().count() as f64 * 7.4 + 14.0,
            top + 12.0,
            esc(&r.backend),
            esc(&r.policy),
            esc(&r.shape),
            r.peak_pinned_plus_reserved_blocks
        );
        let _ = write!(
            svg,
            r##"<g class="strip" data-run="{}" data-x0="{x0:.2}" data-x1="{x1:.2}" data-span-ns="{span_ns}" data-y-bottom="{bottom:.2}" data-y-top="{chart_top:.2}" data-blocks-top="{top_blocks}"><rect x="{x0:.2}" y="{chart_top:.2}" width="{:.2}" height="{STRIP_H:.2}" fill="#f6f7f9" stroke="#c9ced6" stroke-width="0.5"/>"##,
            esc(&names[i]),
            x1 - x0
        );
        let s = &r.blocks_series;
        if !s.is_empty() {
            let xs: Vec<f64> = s.iter().map(|p| x_of(p.at_ns, r.first_at_ns)).collect();
            let end = x_of(r.last_at_ns, r.first_at_ns);
            let zero: Vec<f64> = s.iter().map(|_| bottom).collect();
            let pinned: Vec<f64> = s.iter().map(|p| y_of(p.values[0] as f64)).collect();
            let both: Vec<f64> = s.iter().map(|p| y_of((p.values[0] + p.values[1]) as f64)).collect();
            let _ = write!(
                svg,
                r#"<path class="pinned" d="{}" fill="{PINNED_COLOR}" stroke="none"/><path class="reserved" d="{}" fill="{RESERVED_COLOR}" stroke="none"/>"#,
                layer_path(&xs, &pinned, &zero, end),
                layer_path(&xs, &both, &pinned, end)
            );
        }
        svg.push_str("</g>");
        // Block scale on the left, time below.
        let _ = write!(
            svg,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="#555" font-size="10">{top_blocks}</text><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#555" font-size="10">0</text>"##,
            x0 - 6.0,
            chart_top + 9.0,
            x0 - 6.0,
            bottom
        );
        x_ticks(&mut svg, span, step, bottom, 15.0, |t| x0 + (t / span).min(1.0) * (x1 - x0));
        let _ = write!(
            svg,
            r##"<text x="{x1:.2}" y="{:.2}" text-anchor="end" fill="#555" font-size="10">time since the run's first record ({unit}) · <tspan fill="{PINNED_COLOR}">■ pinned source</tspan> <tspan fill="{RESERVED_COLOR}">■ reserved destination</tspan></text>"##,
            bottom + 30.0
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// One CDF panel with a line per run.
fn cdf_panel(
    svg: &mut String,
    chart: &str,
    label: &str,
    x0: f64,
    width: f64,
    cdfs: &[&Vec<(f64, f64)>],
    names: &[String],
) {
    let x1 = x0 + width;
    let (top, bottom) = (CDF_TOP, CDF_TOP + CDF_H);
    let max_ms = cdfs.iter().filter_map(|c| c.last().map(|p| p.0)).fold(0.0f64, f64::max);
    let top_ms = if max_ms > 0.0 { max_ms } else { 1.0 };
    let (unit, div) = time_unit(top_ms);
    let x_of = |ms: f64| x0 + (ms / top_ms).clamp(0.0, 1.0) * width;
    let y_of = |share: f64| bottom - share.clamp(0.0, 1.0) * CDF_H;
    let _ = write!(
        svg,
        r##"<text x="{x0:.1}" y="{:.1}" font-size="14" font-weight="bold">{} CDF</text><g class="cdf-panel" data-chart="{chart}" data-x0="{x0:.2}" data-x1="{x1:.2}" data-ms-at-x1="{top_ms}" data-y-bottom="{bottom:.2}" data-y-top="{top:.2}"><rect x="{x0:.2}" y="{top:.2}" width="{width:.2}" height="{CDF_H:.2}" fill="#f6f7f9" stroke="#c9ced6" stroke-width="0.5"/>"##,
        top - 10.0,
        esc(label)
    );
    for q in [0.0, 0.25, 0.5, 0.75, 1.0] {
        let y = y_of(q);
        let _ = write!(
            svg,
            r##"<line x1="{x0:.2}" y1="{y:.2}" x2="{x1:.2}" y2="{y:.2}" stroke="#dde1e6"/><text x="{:.2}" y="{:.2}" text-anchor="end" fill="#555" font-size="10">{q:.2}</text>"##,
            x0 - 6.0,
            y + 3.5
        );
    }
    for (i, c) in cdfs.iter().enumerate() {
        if c.is_empty() {
            continue;
        }
        // A step function: flat until the next value, then up to its share.
        let mut d = String::new();
        let _ = write!(d, "M{:.2},{:.2}V{:.2}", x_of(c[0].0), y_of(0.0), y_of(c[0].1));
        for p in &c[1..] {
            let _ = write!(d, "H{:.2}V{:.2}", x_of(p.0), y_of(p.1));
        }
        let _ = write!(
            svg,
            r#"<path class="cdf" data-chart="{chart}" data-run="{}" d="{d}" fill="none" stroke="{}" stroke-width="2"/>"#,
            esc(&names[i]),
            RUN_COLORS[i % RUN_COLORS.len()]
        );
    }
    svg.push_str("</g>");
    let span = top_ms / div;
    let step = nice_step(span, 5.0);
    x_ticks(svg, span, step, bottom, 16.0, |t| x_of(t * div));
    let _ = write!(
        svg,
        r##"<text x="{:.2}" y="{:.2}" text-anchor="middle" fill="#555">{} ({unit}) · share of completed requests at or below</text>"##,
        (x0 + x1) / 2.0,
        bottom + 34.0,
        esc(label)
    );
}

/// Tick marks and labels every `step` along an x axis spanning `span` (axis units) at `bottom`;
/// `x_of` places a value, labels sit `label_dy` below the axis.
fn x_ticks(svg: &mut String, span: f64, step: f64, bottom: f64, label_dy: f64, x_of: impl Fn(f64) -> f64) {
    let mut t = 0.0;
    while t <= span + step * 1e-9 {
        let x = x_of(t);
        let _ = write!(
            svg,
            r##"<line x1="{x:.2}" y1="{bottom:.2}" x2="{x:.2}" y2="{:.2}" stroke="#8a9099"/><text x="{x:.2}" y="{:.2}" text-anchor="middle" fill="#555" font-size="10">{}</text>"##,
            bottom + 4.0,
            bottom + label_dy,
            fmt_tick(t, step)
        );
        t += step;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_description_survives_its_header_and_anything_else_reads_as_unknown() {
        let d = RunDescription {
            trace: Some("t.jsonl".into()),
            trace_bytes: Some(10),
            trace_lines: Some(2),
            shape: Some("2P+2D".into()),
            prefill_router: Some(RouterMode::kv()),
            decode_router: Some(RouterMode::RoundRobin),
            config_digest: Some("00000000000000ff".into()),
        };
        let back: RunDescription = serde_json::from_str(&d.to_json()).unwrap();
        assert_eq!(back, d);
        let other: RunDescription = serde_json::from_str(r#"{"engine":"vllm"}"#).unwrap();
        assert_eq!(other, RunDescription::default());
    }
}
