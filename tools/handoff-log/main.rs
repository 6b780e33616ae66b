//! `handoff-log`: record, replay, check and explain KV handoff logs.

mod cmd_at;
mod cmd_compare;
mod cmd_diff;
mod cmd_index;
mod cmd_inspect;
mod cmd_live;
mod cmd_project;
mod cmd_replay;
mod cmd_show;
mod cmd_simulate;
mod cmd_sweep;
mod cmd_timeline;
mod cmd_verify;
mod out;
mod report;

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "handoff-log", version, about = "Record, replay, check and explain prefill→decode KV handoff logs", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check framing, checksums and sequence numbers of every stream; print record and handoff
    /// counts. Exit 0 when sound, 1 naming the offending file and byte offset.
    Verify {
        /// Run directories, stream files (`*.hlog`) or merged run files.
        #[arg(required = true)]
        logs: Vec<PathBuf>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Print one line per record in merge order.
    ///
    /// Columns: AT_MS (time, ms, 3 decimals) WORKER SEQ FACT DETAILS, where DETAILS is the
    /// fact's fields as `key=value`.
    Show {
        /// A run directory, stream file or merged run file.
        log: PathBuf,
        /// Only records about this HandoffId (or an unambiguous prefix of one).
        #[arg(long)]
        handoff: Option<String>,
        /// Only records about this request (its index in the trace, as `r12` shows it: 12),
        /// its handoff's included.
        #[arg(long)]
        request: Option<u64>,
        /// Only records from this worker (`prefill-0`, `decode-1`, `router`, ...).
        #[arg(long)]
        worker: Option<String>,
        /// Stop after this many records.
        #[arg(long)]
        limit: Option<u64>,
        /// JSON lines instead of columns.
        #[arg(long)]
        json: bool,
    },
    /// Replay a trace through a simulated disaggregated (or aggregated) cluster; print the
    /// serving report and write one fact stream per worker to `--out`.
    Replay(Box<cmd_replay::ReplayArgs>),
    /// Run the cluster as real processes: this one is the frontend, and one `worker` process
    /// per worker talks TCP on wall clocks; each writes its stream in `--out` (clock `wall`), so
    /// `diff LIVE REPLAY` compares it with the replay of the same trace and configuration.
    Live(Box<cmd_live::LiveArgs>),
    /// One live worker process (what `live` starts; run it by hand on another host).
    Worker(cmd_live::WorkerArgs),
    /// Write a run directory as one merged file (records in merge order).
    Merge {
        /// A run directory (or any run).
        run: PathBuf,
        /// The merged file to write (conventionally `*.hrun`).
        out: PathBuf,
        /// Replace an existing file at OUT (as `replay --force` replaces a run).
        #[arg(long)]
        force: bool,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Truncate the torn tail of every stream of a run (the only repair there is: anything
    /// else damaged is an error naming the file and byte offset, and nothing is written).
    Recover {
        /// A run directory or stream file.
        run: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish or powershell) on stdout, e.g.
    /// `handoff-log completions bash > /etc/bash_completion.d/handoff-log`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Compare two runs' projections (parity): exit 0 equivalent, 1 different, 2 unusable.
    ///
    /// Compared: per-worker capacity sequences, router booking sequences, per-handoff
    /// normalized sequences (matched by request id), per-request outcomes, final snapshots and
    /// drained state. Timing (pin duration, TTFT, E2E) is compared within the tolerance and
    /// reported, and only fails with --strict-timing.
    Diff {
        /// Run A (directory, merged file or stream file).
        a: PathBuf,
        /// Run B.
        b: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Timing figures further apart than this percent (of the larger) are reported.
        #[arg(long, default_value_t = 5.0, value_name = "PCT")]
        timing_tolerance: f64,
        /// Timing differences make the runs different (exit 1).
        #[arg(long)]
        strict_timing: bool,
    },
    /// Several runs side by side: what was run (backend, policy, shape, routers, seed, trace)
    /// and what came out (outcomes, goodput, latency, stranding, peaks, preemptions), each
    /// folded from its logs, with every run after the first also as its difference from the
    /// first. Exit 0, or 2 naming an unusable run.
    Compare(cmd_compare::CompareArgs),
    /// Replay a trace once per combination of grid values (`--grid decode=1,2`), several
    /// replays at a time, each into its own run directory under `--out`; then print the
    /// `compare` table of them. Exit 0 when every run drained, 1 naming a run that did not, 2
    /// for unusable input or a run that stopped with an error.
    Sweep(Box<cmd_sweep::SweepArgs>),
    /// Randomized whole runs, one per seed: each seed draws the cluster, engine sizes,
    /// timeouts, a trace and network faults (drops, doubles, delays, a partition, pauses, a
    /// crash, late timers), runs it checking every worker after every event, then checks the
    /// log (drained, every request ended once, every pin and reservation released once).
    /// Exit 0 when every seed is clean, 1 naming each failing seed and how to reproduce it.
    Simulate(cmd_simulate::SimulateArgs),
    /// Every worker's capacity snapshot, scheduler queues and router bookings at an instant
    /// (all records with at_ns <= T applied). Uses the run's index when present.
    At {
        /// A run directory, stream file or merged run file.
        log: PathBuf,
        /// The instant: ms (fractional allowed), or with a unit: 12.5s, 300us, 1500000ns.
        #[arg(long, value_name = "T")]
        time: String,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Build the sled index beside a run (RUN/.index, or FILE.index), or verify and reuse it.
    /// `show --handoff/--worker` and `at` use it when present; a stale one is rebuilt.
    Index {
        /// A run directory, stream file or merged run file.
        log: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Fold a run and print a projection.
    Project {
        /// A run directory, stream file or merged run file.
        log: PathBuf,
        /// Which projection.
        #[arg(value_enum)]
        what: cmd_project::Projection,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// CSV (`requests` and `series`): one header line, then one row per record.
        #[arg(long, conflicts_with = "json")]
        csv: bool,
    },
    /// Post-mortem of a run: stranding cascade and its trigger, destination gating, decode
    /// preemption storms and head-of-line blocking, peaks per worker, the longest-pinned
    /// handoffs with their timelines, where handoff time went, and router bookings beside
    /// physical occupancy.
    Inspect(cmd_inspect::InspectArgs),
    /// Draw every worker's KV blocks (active / pinned / reserved / cached-free / free, router
    /// bookings dashed) and queue depths over time as an SVG.
    Timeline(cmd_timeline::TimelineArgs),
}

/// A user-facing error: printed on stderr, mapped to an exit code.
pub struct CliError {
    pub code: u8,
    pub message: String,
}

impl CliError {
    pub fn new(code: u8, message: impl Into<String>) -> Self {
        CliError { code, message: message.into() }
    }
}

impl<E: std::error::Error> From<E> for CliError {
    fn from(e: E) -> Self {
        CliError::new(2, e.to_string())
    }
}

/// Asks the kernel not to back this process with transparent huge pages. A replay touches
/// some tens of MB once, from a fresh process; right after another large process has exited
/// (as when timing it side by side with the reference mocker), each 2 MB huge-page fault can
/// stall on compaction. Measured on the full Mooncake replay, each run right after a reference
/// run: 0.49–0.61 s with huge pages, 0.44–0.50 s without; back-to-back runs alike either way.
fn disable_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    // SAFETY: prctl(PR_SET_THP_DISABLE) takes plain integers and only sets a flag on this
    // process; a failure (an old kernel) leaves the default, which is harmless.
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}

fn main() -> ExitCode {
    disable_transparent_huge_pages();
    // Diagnostics (e.g. refused commands inside a replay) go to stderr when asked for with
    // HANDOFF_LOG=debug; the default is silent so stdout and stderr stay for results and errors.
    let filter = tracing_subscriber::EnvFilter::try_from_env("HANDOFF_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Colours only for a person at a terminal, not in a file or a CI log.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .try_init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Verify { logs, json } => cmd_verify::run(&logs, json),
        Command::Show { log, handoff, request, worker, limit, json } => {
            let filter =
                cmd_show::Filter { handoff: handoff.as_deref(), request, worker: worker.as_deref(), limit };
            cmd_show::run(&log, filter, json)
        }
        Command::Project { log, what, json, csv } => cmd_project::run(&log, what, json, csv),
        Command::Merge { run, out, force, json } => cmd_verify::merge(&run, &out, force, json),
        Command::Recover { run, json } => cmd_verify::recover(&run, json),
        Command::Replay(args) => cmd_replay::run(*args),
        Command::Live(args) => cmd_live::run(&args),
        Command::Worker(args) => cmd_live::run_worker(&args),
        Command::Inspect(args) => cmd_inspect::run(&args),
        Command::Timeline(args) => cmd_timeline::run(&args),
        Command::Diff { a, b, json, timing_tolerance, strict_timing } => {
            cmd_diff::run(&a, &b, json, timing_tolerance, strict_timing)
        }
        Command::Compare(args) => cmd_compare::run(&args),
        Command::Sweep(args) => cmd_sweep::run(&args),
        Command::Simulate(args) => cmd_simulate::run(&args),
        Command::At { log, time, json } => cmd_at::run(&log, &time, json),
        Command::Index { log, json } => cmd_index::run(&log, json),
        Command::Completions { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(shell, &mut Cli::command(), "handoff-log", &mut std::io::stdout());
            Ok(0)
        }
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            if !e.message.is_empty() {
                eprintln!("handoff-log: {}", e.message);
            }
            ExitCode::from(e.code)
        }
    }
}

// mimalloc: the replay allocates and frees many small vectors per request; glibc's allocator
// showed up at several percent of the event loop.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
