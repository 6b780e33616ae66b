//! `handoff-log sweep`: one replay per point of a grid of configuration values, several at a
//! time, each into its own run directory; then the `compare` table of them.

use crate::cmd_compare::{self, fold_error, CompareArgs, CompareOutput};
use crate::cmd_replay::{open_trace, report_json, ClusterArgs};
use crate::out::Out;
use crate::CliError;
use handoff_ledger::adapters::replay::config::ReplayConfig;
use handoff_ledger::adapters::replay::engine::{Replay, ReplayOptions};
use handoff_ledger::adapters::replay::identity;
use handoff_ledger::adapters::replay::sweep::{self, Grid, PlannedRun, Shard};
use handoff_ledger::adapters::replay::trace::TraceFormat;
use handoff_ledger::events::layout::STREAM_EXTENSION;
use handoff_ledger::events::RunReader;
use handoff_ledger::projections::compare::{summarize_run, CompareOptions, RunSummary};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// The report each run leaves beside its streams.
const REPORT_FILE: &str = "report.json";
/// Stuck handoffs listed per run that did not drain (the run's report says how many in all).
const STUCK_SHOWN: usize = 10;
/// `replay` runs its event loop on the main thread, whose stack is 8 MiB on Linux; a sweep's
/// replays get the same rather than a spawned thread's default 2 MiB.
const RUN_STACK_BYTES: usize = 8 << 20;

#[derive(clap::Args)]
pub struct SweepArgs {
    /// The trace: Mooncake JSONL or Azure 2023 CSV.
    pub trace: PathBuf,
    /// A configuration key and its values, e.g. `decode=1,2,4`; one run per combination of
    /// every grid's values (grids in the order given, the last varying fastest). Keys: the
    /// flags backend, policy, prefill, decode, workers, router, prefill_router, decode_router,
    /// seed, speedup, concurrency; or any key of the JSON configuration, dotted for tables
    /// (lease_ms, vllm.num_gpu_blocks, decode_vllm.num_gpu_blocks, sglang.total_pages,
    /// transfer.bandwidth_gbps).
    #[arg(long = "grid", value_name = "KEY=V1,V2,...", required = true)]
    pub grids: Vec<Grid>,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// Trace format (default: from the extension or first line).
    #[arg(long)]
    pub trace_format: Option<TraceFormat>,
    /// JSON configuration file for every run; flags override it, grid values override both.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Directory for the runs: one `INDEX-KEY=VALUE,...` run directory each, with its
    /// streams and `report.json`.
    #[arg(long)]
    pub out: PathBuf,
    /// Replays at a time (default: the available cores).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub jobs: Option<u32>,
    /// Only the runs whose index % N is I - 1 (I from 1 to N), to spread a sweep over machines:
    /// `handoff-log compare DIR/*` then compares every shard's runs.
    #[arg(long, value_name = "I/N")]
    pub shard: Option<Shard>,
    /// Replace runs of an earlier sweep in `--out`.
    #[arg(long)]
    pub force: bool,
    // Goodput objectives and the table's format: compare's own flags.
    #[command(flatten)]
    pub output: CompareOutput,
}

/// How one replay of the sweep went.
struct Finished {
    /// Folded from the run's logs by the thread that wrote them, while the next replays run.
    summary: RunSummary,
    drained: bool,
    stuck: Vec<String>,
    stuck_total: usize,
}

pub fn run(args: &SweepArgs) -> Result<u8, CliError> {
    let mut base = match &args.config {
        Some(p) => ReplayConfig::from_file(p)?,
        None => ReplayConfig::default(),
    };
    args.cluster.apply(&mut base);
    let planned = sweep::plan(&base, &args.grids).map_err(|e| CliError::new(2, e.to_string()))?;
    // The trace is read once here so that an unreadable one stops the sweep before any run,
    // and for the run ids, which tell this sweep's runs from an earlier sweep's.
    let (trace, _) = open_trace(&args.trace, args.trace_format, base.arrival_speedup)?;
    let run_ids: Vec<uuid::Uuid> =
        planned.iter().map(|p| identity::run_id(Some(&trace), &p.config)).collect();
    let shard = args.shard.unwrap_or(Shard::WHOLE);
    let mine: Vec<&PlannedRun> = planned.iter().filter(|p| shard.includes(p.index)).collect();
    if mine.is_empty() {
        eprintln!(
            "handoff-log: shard {shard} has none of this sweep's {} runs; nothing to do",
            planned.len()
        );
        return Ok(0);
    }
    prepare_out(&args.out, &planned, &run_ids, shard, args.force)?;
    let jobs = match args.jobs {
        Some(n) => n as usize,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    }
    .min(mine.len());

    let bar = if std::io::stderr().is_terminal() {
        let b = ProgressBar::new(mine.len() as u64);
        b.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} runs, {elapsed} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b
    } else {
        ProgressBar::hidden()
    };
    let started = Instant::now();
    // Workers take the next run in index order as they free up: a long run does not hold back
    // the short ones queued behind it, and each replay is sequential and deterministic on its
    // own, so the job count changes no byte of any run's logs.
    let next = AtomicUsize::new(0);
    let results: Vec<Mutex<Option<Result<Finished, String>>>> =
        mine.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|scope| -> Result<(), CliError> {
        for _ in 0..jobs {
            std::thread::Builder::new()
                .name("sweep-run".into())
                .stack_size(RUN_STACK_BYTES)
                .spawn_scoped(scope, || loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(p) = mine.get(i) else { break };
                    let result = run_one(args, p).map_err(|e| e.message);
                    bar.inc(1);
                    bar.set_message(p.label.clone());
                    if let Ok(mut slot) = results[i].lock() {
                        *slot = Some(result);
                    }
                })
                .map_err(|e| CliError::new(2, format!("starting a replay thread: {e}")))?;
        }
        Ok(())
    })?;
    bar.finish_and_clear();
    let wall_s = started.elapsed().as_secs_f64();

    let mut done: Vec<PathBuf> = Vec::new();
    let mut summaries = Vec::new();
    let mut undrained = Vec::new();
    let mut failed = Vec::new();
    for (p, slot) in mine.iter().zip(results) {
        let result =
            slot.into_inner().ok().flatten().unwrap_or_else(|| Err("the replay thread panicked".into()));
        match result {
            Ok(Finished { summary, drained, stuck, stuck_total }) => {
                done.push(args.out.join(&p.label));
                summaries.push(summary);
                if !drained {
                    undrained.push((p.label.as_str(), stuck, stuck_total));
                }
            }
            Err(message) => failed.push((p.label.as_str(), message)),
        }
    }
    if !done.is_empty() {
        let compare = CompareArgs { runs: done, output: args.output, svg: None };
        cmd_compare::print(&compare, &summaries)?;
    }
    if !(args.output.json || args.output.csv) {
        let runs = |n: usize| if n == 1 { "1 run".to_string() } else { format!("{n} runs") };
        let of = if shard == Shard::WHOLE {
            String::new()
        } else {
            format!(" (shard {shard} of the sweep's {})", runs(planned.len()))
        };
        let wall = if wall_s < 10.0 { format!("{:.0} ms", wall_s * 1e3) } else { format!("{wall_s:.1} s") };
        let mut out = Out::new();
        out.line(&format!(
            "sweep: {}{of} in {}, {jobs} at a time, {wall} wall time; `handoff-log compare {}/*` compares every run there",
            runs(mine.len()),
            args.out.display(),
            args.out.display(),
        ))?;
        out.flush()?;
    }
    for (label, stuck, total) in &undrained {
        eprintln!("handoff-log: run {label} did not drain; {total} things are stuck:");
        for s in stuck {
            eprintln!("  {s}");
        }
        if *total > stuck.len() {
            eprintln!("  ... and {} more", total - stuck.len());
        }
    }
    for (label, message) in &failed {
        eprintln!("handoff-log: run {label} failed: {message}");
    }
    Ok(if !failed.is_empty() {
        2
    } else if !undrained.is_empty() {
        1
    } else {
        0
    })
}

/// One replay into its run directory, with its report beside the streams.
fn run_one(args: &SweepArgs, p: &PlannedRun) -> Result<Finished, CliError> {
    let dir = args.out.join(&p.label);
    std::fs::create_dir_all(&dir).map_err(|e| CliError::new(2, format!("{}: {e}", dir.display())))?;
    let (trace_identity, trace) = open_trace(&args.trace, args.trace_format, p.config.arrival_speedup)?;
    let started = Instant::now();
    let options = ReplayOptions {
        trace: Some(trace_identity),
        slo: args.output.slo.unwrap_or_default(),
        per_request: None,
        check_every_event: false,
        log_format: Default::default(),
    };
    let outcome = Replay::with_options(p.config.clone(), trace, &dir, options)?.run()?;
    let wall_ms = started.elapsed().as_secs_f64() * 1e3;
    let report = dir.join(REPORT_FILE);
    let gpus = p.config.gpus_per_worker;
    let text = serde_json::to_string_pretty(&report_json(&outcome, wall_ms, &dir, gpus)).unwrap_or_default();
    std::fs::write(&report, text + "\n")
        .map_err(|e| CliError::new(2, format!("{}: {e}", report.display())))?;
    let opts = CompareOptions { slo: args.output.slo.unwrap_or_default(), ..CompareOptions::default() };
    let summary = summarize_run(&dir, &opts, &mut |_| {}).map_err(|e| fold_error(&dir, e))?;
    Ok(Finished {
        summary,
        drained: outcome.drained,
        stuck_total: outcome.stuck.len(),
        stuck: outcome.stuck.into_iter().take(STUCK_SHOWN).collect(),
    })
}

/// Makes `out` ready for this shard's runs. A run directory there from an earlier sweep (a
/// `NNN-...` directory holding streams or a report) is replaced only with `force`: one of this
/// shard's own, or one that is not a run of this sweep at all (another label, or the same label
/// with another run id: another trace, configuration or seed), which `compare DIR/*` would
/// otherwise mix in. Other shards' runs of this same sweep are left alone, so that shards can
/// share one directory, even while they run.
fn prepare_out(
    out: &Path,
    planned: &[PlannedRun],
    run_ids: &[uuid::Uuid],
    shard: Shard,
    force: bool,
) -> Result<(), CliError> {
    let io = |p: &Path, e: std::io::Error| CliError::new(2, format!("{}: {e}", p.display()));
    if !out.exists() {
        return std::fs::create_dir_all(out).map_err(|e| io(out, e));
    }
    if !out.is_dir() {
        return Err(CliError::new(2, format!("{}: not a directory", out.display())));
    }
    let mut earlier = Vec::new();
    for entry in std::fs::read_dir(out).map_err(|e| io(out, e))? {
        let dir = entry.map_err(|e| io(out, e))?.path();
        let Some(name) = dir.file_name().and_then(|n| n.to_str()).map(str::to_string) else { continue };
        if !(dir.is_dir() && is_run_name(&name) && holds_run(&dir)?) {
            continue;
        }
        let ours = planned.iter().position(|p| p.label == name);
        let keep = match ours {
            // Another shard's run: kept unless its run id says it is another sweep's. One whose
            // streams cannot be read yet may be being written by that shard right now.
            Some(i) if !shard.includes(i) => match RunReader::open(&dir) {
                Ok(r) => r.headers().first().map_or(true, |h| h.run_id == run_ids[i]),
                Err(_) => true,
            },
            _ => false,
        };
        if !keep {
            earlier.push((name, dir));
        }
    }
    if earlier.is_empty() {
        return Ok(());
    }
    earlier.sort();
    if !force {
        let more = match earlier.len() {
            1 => String::new(),
            n => format!(" and {} more", n - 1),
        };
        return Err(CliError::new(
            2,
            format!(
                "{}: holds runs of an earlier sweep ({}{more}); give --force to replace them",
                out.display(),
                earlier[0].0
            ),
        ));
    }
    for (_, dir) in &earlier {
        // Only what a sweep writes is removed; anything else in a run directory stops it.
        for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
            let p = entry.map_err(|e| io(dir, e))?.path();
            if !is_run_file(&p) {
                return Err(CliError::new(
                    2,
                    format!("{}: not written by a sweep; move it away to replace this run", p.display()),
                ));
            }
        }
        std::fs::remove_dir_all(dir).map_err(|e| io(dir, e))?;
    }
    Ok(())
}

/// `003-...`: digits, then a dash.
fn is_run_name(name: &str) -> bool {
    let digits = name.bytes().take_while(u8::is_ascii_digit).count();
    digits > 0 && name.as_bytes().get(digits) == Some(&b'-')
}

/// A run directory holds streams or a report.
fn holds_run(dir: &Path) -> Result<bool, CliError> {
    let entries = std::fs::read_dir(dir).map_err(|e| CliError::new(2, format!("{}: {e}", dir.display())))?;
    Ok(entries.flatten().any(|e| {
        let p = e.path();
        p.extension().and_then(|x| x.to_str()) == Some(STREAM_EXTENSION)
            || p.file_name().and_then(|n| n.to_str()) == Some(REPORT_FILE)
    }))
}

/// What a sweep's run directory may hold: streams, the report, and the index `handoff-log
/// index` builds beside them.
fn is_run_file(p: &Path) -> bool {
    let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
    (p.is_file() && p.extension().and_then(|x| x.to_str()) == Some(STREAM_EXTENSION))
        || (p.is_file() && name == REPORT_FILE)
        || name == ".index"
}
