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
use crate::projections::timeline::{Downsampler, Sample};
use crate::router::RouterMode;
use crate::units::NS_PER_MS_F64;
use serde::{Deserialize, Serialize};
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
    /// Workers whose stream lacks the end marker (the run did not end cleanly).
    pub unended: Vec<WorkerId>,
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
        unended: run.unended(),
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

mod render;
pub use render::render_svg;

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
