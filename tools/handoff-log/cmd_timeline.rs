//! `handoff-log timeline`: a picture of every worker's KV blocks and queues over time.

use crate::CliError;
use handoff_ledger::ids::WorkerId;
use handoff_ledger::projections::at::parse_time;
use handoff_ledger::projections::timeline::{collect_with_progress, render_svg, TimelineOptions, YAxis};
use handoff_ledger::units::ms;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct TimelineArgs {
    /// A run directory, stream file or merged run file.
    pub run: PathBuf,
    /// The SVG file to write.
    #[arg(long)]
    pub svg: PathBuf,
    /// Only this worker (`prefill-0`, `decode-1`, ...).
    #[arg(long)]
    pub worker: Option<String>,
    /// Window start on the run's clock: ms (`1500`), or with the unit the axis shows (`12.5s`,
    /// `800ms`).
    #[arg(long)]
    pub from: Option<String>,
    /// Window end, as `--from`.
    #[arg(long)]
    pub to: Option<String>,
    /// The capacity chart's y-axis: every block of the pool, only blocks in use (up to their
    /// peak: for large pools, where cached-free and free would hide the rest), or percent.
    #[arg(long, value_enum, default_value_t = YAxis::Blocks)]
    pub y_axis: YAxis,
    /// Print what was drawn as JSON on stdout (file, window, points per series, stalls).
    #[arg(long)]
    pub json: bool,
    /// Time buckets per series, used once a series has more than 5 × this many points; each
    /// bucket keeps its first, last, minimum and maximum points.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub buckets: u32,
}

fn ms_to_ns(flag: &str, v: Option<&str>) -> Result<Option<u64>, CliError> {
    v.map(|text| parse_time(text).map_err(|e| CliError::new(2, format!("{flag}: {e}")))).transpose()
}

pub fn run(args: &TimelineArgs) -> Result<u8, CliError> {
    let worker: Option<WorkerId> = args
        .worker
        .as_deref()
        .map(|w| w.parse().map_err(|e: String| CliError::new(2, format!("--worker: {e}"))))
        .transpose()?;
    let from_ns = ms_to_ns("--from", args.from.as_deref())?;
    let to_ns = ms_to_ns("--to", args.to.as_deref())?;
    if let (Some(f), Some(t)) = (from_ns, to_ns) {
        if t <= f {
            return Err(CliError::new(2, "--to must be later than --from"));
        }
    }
    let opts =
        TimelineOptions { worker, from_ns, to_ns, max_buckets: args.buckets as usize, y_axis: args.y_axis };
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = ProgressBar::new_spinner();
        b.set_style(
            ProgressStyle::with_template("{spinner} folding: {pos} records read ({per_sec})")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        b
    });
    let data = collect_with_progress(&args.run, &opts, &mut |n| {
        if let Some(b) = &bar {
            b.set_position(n);
        }
    });
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let data = data?;
    if let Some(w) = worker {
        if data.workers.is_empty() {
            let known: Vec<String> = data
                .headers
                .iter()
                .filter(|h| h.worker != WorkerId::ROUTER)
                .map(|h| h.worker.to_string())
                .collect();
            return Err(CliError::new(
                2,
                format!(
                    "--worker {w}: no such engine stream in {} (streams: {})",
                    args.run.display(),
                    known.join(", ")
                ),
            ));
        }
    }
    if !data.unended.is_empty() {
        eprintln!("handoff-log: warning: {}", crate::cmd_verify::incomplete_text(&data.unended));
    }
    let svg = render_svg(&data);
    std::fs::write(&args.svg, svg.as_bytes())
        .map_err(|e| CliError::new(2, format!("writing {}: {e}", args.svg.display())))?;
    if args.json {
        let workers: Vec<_> = data
            .workers
            .iter()
            .map(|w| {
                serde_json::json!({
                    "worker": w.worker,
                    "total_blocks": w.total_blocks,
                    "capacity_points": w.capacity.len(),
                    "queue_points": w.queues.len(),
                    "bucket_ms": ms(w.capacity_bucket_ns),
                })
            })
            .collect();
        let stalls: Vec<_> = data
            .stalls
            .iter()
            .map(|(w, a, b)| serde_json::json!({"worker": w, "from_ms": ms(*a), "to_ms": b.map(ms)}))
            .collect();
        let gating: Vec<_> = data
            .gating
            .iter()
            .map(|(w, n, peak)| serde_json::json!({"worker": w, "handoffs": n, "peak_pending": peak}))
            .collect();
        let mut out = crate::out::Out::new();
        out.line(
            &serde_json::json!({
                "svg": args.svg.display().to_string(),
                "bytes": svg.len(),
                "from_ms": ms(data.from_ns),
                "to_ms": ms(data.to_ns),
                "records": data.records,
                "workers": workers,
                "stalls": stalls,
                "gating": gating,
            })
            .to_string(),
        )?;
        out.flush()?;
    } else {
        eprintln!("wrote {} ({} workers, {} bytes)", args.svg.display(), data.workers.len(), svg.len());
    }
    Ok(0)
}
