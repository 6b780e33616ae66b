//! `handoff-log replay`: the main job. Replays a trace through a simulated cluster, prints the
//! report, and leaves one fact stream per worker in `--out`.

use crate::out::Out;
use crate::CliError;
use handoff_ledger::adapters::replay::config::ReplayConfig;
use handoff_ledger::adapters::replay::engine::{Replay, ReplayOptions, ReplayOutcome};
use handoff_ledger::adapters::replay::identity::TraceIdentity;
use handoff_ledger::adapters::replay::trace::{TraceFormat, TraceOptions, TraceReader};
use handoff_ledger::events::LogFormat;
use handoff_ledger::ids::{Backend, HandoffPolicy};
use handoff_ledger::projections::compare::router_label;
use handoff_ledger::projections::metrics::Slo;
use handoff_ledger::projections::{PerRequest, PerRequestSink};
use handoff_ledger::router::RouterMode;
use handoff_ledger::units::ms;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

#[derive(clap::Args)]
pub struct ReplayArgs {
    /// The trace: Mooncake JSONL or Azure 2023 CSV.
    pub trace: PathBuf,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// Trace format (default: from the extension or first line).
    #[arg(long)]
    pub trace_format: Option<TraceFormat>,
    /// JSON configuration file; flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Directory for the run's fact streams (one `.hlog` per worker plus `router.hlog`).
    #[arg(long, required_unless_present = "print_config")]
    pub out: Option<PathBuf>,
    /// Replace the streams of an earlier run in `--out`.
    #[arg(long)]
    pub force: bool,
    /// Write the report as JSON (the reference mocker's key names).
    #[arg(long)]
    pub report_json: Option<PathBuf>,
    /// Write one JSON line per request.
    #[arg(long)]
    pub per_request: Option<PathBuf>,
    /// Print the report as JSON on stdout instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Print the full effective configuration (the config file and flags over every default)
    /// as JSON and exit without replaying; docs/config.md explains each key.
    #[arg(long)]
    pub print_config: bool,
    /// Goodput objectives, ms: any of ttft_ms, itl_ms, tpot_ms, e2e_ms, e.g.
    /// `ttft_ms=2000,itl_ms=50`. Goodput is the completed requests per second (over the run's
    /// duration) that met every one, and the share of all requests that did. itl_ms and
    /// tpot_ms are both checked against the request's mean inter-token gap (its TPOT).
    #[arg(long, value_name = "KEY=MS,...")]
    pub slo: Option<Slo>,
    /// The stream format to write: 2 (compact blocks, the default) or 1 (one frame per record,
    /// for tools that read only version 1). Every command reads both.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=2))]
    pub log_format: u16,
}

/// The cluster and run flags `replay` and `sweep` share; they override `--config`.
#[derive(clap::Args)]
pub struct ClusterArgs {
    /// Engine model: vllm (source-first) or sglang (destination-first). Default: vllm.
    #[arg(long, value_parser = parse_backend)]
    pub backend: Option<Backend>,
    /// Override the backend's native policy: source-first, destination-first, or disabled (the
    /// behaviour before the lifecycle: nothing pinned or reserved). Default: the backend's.
    #[arg(long, value_parser = parse_policy)]
    pub policy: Option<HandoffPolicy>,
    /// Prefill workers (disaggregated serving).
    #[arg(long)]
    pub prefill: Option<u32>,
    /// Decode workers (disaggregated serving).
    #[arg(long)]
    pub decode: Option<u32>,
    /// Aggregated workers (no handoff). Default, when no shape is given: 1.
    #[arg(long, conflicts_with_all = ["prefill", "decode"])]
    pub workers: Option<u32>,
    /// Routing mode for both stages: round-robin, random, kv, least-loaded, p2c, device-aware.
    /// Default: round-robin.
    #[arg(long)]
    pub router: Option<RouterMode>,
    /// Routing mode for the prefill stage only.
    #[arg(long)]
    pub prefill_router: Option<RouterMode>,
    /// Routing mode for the decode stage only.
    #[arg(long)]
    pub decode_router: Option<RouterMode>,
    /// The run's one seed. Default: 0.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Arrival speedup ratio (divides trace timestamps and session delays). Default: 1.
    #[arg(long)]
    pub speedup: Option<f64>,
    /// Closed loop: keep N sessions in flight (a request without `session_id` is a one-turn
    /// session), each next one starting when one ends; trace timestamps of first turns are
    /// ignored. Without it, requests arrive at their timestamps.
    #[arg(long)]
    pub concurrency: Option<u32>,
}

impl ClusterArgs {
    /// Applies the flags given to `cfg`, as each one documents.
    pub fn apply(&self, cfg: &mut ReplayConfig) {
        if let Some(b) = self.backend {
            cfg.backend = b;
        }
        if self.policy.is_some() {
            cfg.policy = self.policy;
        }
        if let Some(n) = self.workers {
            cfg.workers = n;
            cfg.prefill_workers = 0;
            cfg.decode_workers = 0;
        }
        if let Some(n) = self.prefill {
            cfg.prefill_workers = n;
        }
        if let Some(n) = self.decode {
            cfg.decode_workers = n;
        }
        if let Some(m) = &self.router {
            cfg.prefill_router = m.clone();
            cfg.decode_router = m.clone();
        }
        if let Some(m) = &self.prefill_router {
            cfg.prefill_router = m.clone();
        }
        if let Some(m) = &self.decode_router {
            cfg.decode_router = m.clone();
        }
        if let Some(s) = self.seed {
            cfg.seed = s;
        }
        if let Some(s) = self.speedup {
            cfg.arrival_speedup = s;
        }
        if let Some(n) = self.concurrency {
            cfg.load = handoff_ledger::adapters::replay::workload::LoadMode::Closed { concurrency: n };
        }
    }
}

fn parse_backend(s: &str) -> Result<Backend, String> {
    match s.to_ascii_lowercase().as_str() {
        "vllm" => Ok(Backend::Vllm),
        "sglang" => Ok(Backend::Sglang),
        "trtllm" | "trt-llm" => Err(
            "backend `trtllm` is not modeled (its destination reservation is deferred by the proposal); use vllm or sglang"
                .to_string(),
        ),
        o => Err(format!("unknown backend `{o}` (vllm or sglang)")),
    }
}

/// A file the run will write at its end: its directory must exist and the file be creatable.
fn check_writable(path: &std::path::Path) -> Result<(), CliError> {
    let existed = path.exists();
    let opened = std::fs::OpenOptions::new().append(true).create(true).open(path);
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    opened.map(|_| ()).map_err(|e| CliError::new(2, format!("{}: {e}", path.display())))
}

fn parse_policy(s: &str) -> Result<HandoffPolicy, String> {
    match s {
        "source-first" => Ok(HandoffPolicy::SourceFirst),
        "destination-first" => Ok(HandoffPolicy::DestinationFirst),
        "disabled" => Ok(HandoffPolicy::Disabled),
        o => Err(format!("unknown policy `{o}` (source-first, destination-first, disabled)")),
    }
}

pub fn run(a: ReplayArgs) -> Result<u8, CliError> {
    let mut cfg = match &a.config {
        Some(p) => ReplayConfig::from_file(p)?,
        None => ReplayConfig::default(),
    };
    a.cluster.apply(&mut cfg);
    let c = &a.cluster;
    let shape_defaulted = c.prefill.is_none()
        && c.decode.is_none()
        && c.workers.is_none()
        && !cfg.is_disaggregated()
        && cfg.workers == ReplayConfig::default().workers
        && a.config.is_none();
    cfg.validate()?;
    if a.print_config {
        let text = serde_json::to_string_pretty(&cfg)
            .map_err(|e| CliError::new(2, format!("printing the configuration: {e}")))?;
        Out::new().line(&text)?;
        return Ok(0);
    }
    let out_dir = a.out.clone().ok_or_else(|| CliError::new(2, "--out DIR is required"))?;
    if a.force && out_dir.is_dir() {
        for entry in std::fs::read_dir(&out_dir)? {
            let p = entry?.path();
            if p.extension().and_then(|e| e.to_str()) == Some("hlog") {
                std::fs::remove_file(&p)?;
            }
        }
    }
    let (trace_identity, trace) = open_trace(&a.trace, a.trace_format, cfg.arrival_speedup)?;

    // Per-request lines stream out as requests end (from the log writer's thread); the first
    // write error is kept and reported, and the file is flushed once the run is over.
    // Output files are checked before the replay runs, not after it has spent its time.
    if let Some(p) = &a.report_json {
        check_writable(p)?;
    }
    let per_request_out: Option<Arc<Mutex<PerRequestOut>>> = match &a.per_request {
        Some(p) => {
            let f = File::create(p).map_err(|e| CliError::new(2, format!("{}: {e}", p.display())))?;
            Some(Arc::new(Mutex::new(PerRequestOut { w: BufWriter::new(f), err: None })))
        }
        None => None,
    };
    let per_request: Option<PerRequestSink> = per_request_out.clone().map(|out| {
        Box::new(move |r: &PerRequest| {
            let Ok(mut o) = out.lock() else { return };
            if o.err.is_some() {
                return;
            }
            let line = serde_json::to_string(r).unwrap_or_default();
            if let Err(e) = o.w.write_all(line.as_bytes()).and_then(|_| o.w.write_all(b"\n")) {
                o.err = Some(e);
            }
        }) as PerRequestSink
    });

    let bar = if std::io::stderr().is_terminal() {
        let b = indicatif::ProgressBar::new_spinner();
        b.set_style(
            indicatif::ProgressStyle::with_template("{spinner} {elapsed} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
        );
        Some(b)
    } else {
        None
    };
    let mut progress = |arrived: u64, now_ns: u64| {
        if let Some(b) = &bar {
            b.set_message(format!("{arrived} requests arrived, t = {:.1} s (virtual)", now_ns as f64 / 1e9));
            b.tick();
        }
    };
    let gpus_per_worker = cfg.gpus_per_worker;
    let started = Instant::now();
    let options = ReplayOptions {
        trace: Some(trace_identity),
        slo: a.slo.unwrap_or_default(),
        per_request,
        check_every_event: false,
        log_format: LogFormat::from_version(a.log_format).unwrap_or_default(),
    };
    let replay = Replay::with_options(cfg, trace, &out_dir, options)?.with_progress(&mut progress);
    let outcome = replay.run()?;
    let wall_ms = started.elapsed().as_secs_f64() * 1e3;
    if let Some(cpu_ms) = thread_cpu_ms() {
        // The event loop's own CPU time (the log writer runs on another thread): the figure to
        // watch when tuning, as it does not depend on what else the machine is doing.
        tracing::info!(
            loop_cpu_ms = cpu_ms,
            wall_ms,
            events = outcome.events,
            coalesced_steps = outcome.coalesced_steps,
            "replay finished"
        );
    }
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    if let Some(out) = per_request_out {
        let mut o = out.lock().map_err(|_| CliError::new(2, "writing per-request lines: writer panicked"))?;
        let flushed = o.w.flush();
        if let Some(e) = o.err.take().or(flushed.err()) {
            return Err(CliError::new(2, format!("writing per-request lines: {e}")));
        }
    }
    let json = report_json(&outcome, wall_ms, &out_dir, gpus_per_worker);
    if let Some(p) = &a.report_json {
        let text = serde_json::to_string_pretty(&json).unwrap_or_default();
        std::fs::write(p, text + "\n").map_err(|e| CliError::new(2, format!("{}: {e}", p.display())))?;
    }
    let mut out = Out::new();
    if a.json {
        out.line(&serde_json::to_string_pretty(&json).unwrap_or_default())?;
    } else {
        out.line(&headline(&outcome))?;
        if shape_defaulted {
            out.line("(no --prefill/--decode or --workers given, and none in a config: one aggregated worker, no handoff)")?;
        }
        out.line(&crate::report::table(&outcome.report, Some(gpus_per_worker)))?;
        let w = &outcome.workload;
        if w.sessions_seen > 0 {
            out.line(&format!(
                "sessions: {} ({} cut short by a failed or canceled turn; {} later turns dropped)",
                w.sessions_seen, w.sessions_cut_short, w.turns_dropped
            ))?;
        }
        for d in &outcome.scaling {
            let workers: Vec<String> = d
                .workers
                .iter()
                .map(|w| match w.left_at_ms {
                    Some(t) => format!("{} (left at {:.3} ms)", w.worker, t),
                    None => w.worker.clone(),
                })
                .collect();
            out.line(&format!(
                "scaling at {:.3} ms: {} {:+} [{}]: {}",
                d.at_ms,
                d.role,
                d.change,
                workers.join(", "),
                d.reason
            ))?;
        }
        for f in &outcome.faults {
            let when = match f.fired_at_ns {
                Some(t) => format!("fired at {:.3} ms", ms(t)),
                None => "NOT fired".to_string(),
            };
            out.line(&format!(
                "fault {} {} on request {}: {when}{}{}",
                f.spec.kind.as_str(),
                f.spec.phase.as_str(),
                f.spec.request,
                f.handoff.map(|h| format!(", handoff {h}")).unwrap_or_default(),
                if f.notes.is_empty() { String::new() } else { format!(" ({})", f.notes.join("; ")) }
            ))?;
        }
        out.line(&format!(
            "wall time {:.0} ms for {} events; logs in {}",
            wall_ms,
            outcome.events,
            out_dir.display()
        ))?;
    }
    out.flush()?;
    let report = &outcome.report;
    if report.num_requests > 0 && report.completed_requests == 0 {
        let reasons: Vec<String> = report.terminal_reasons.iter().map(|(k, v)| format!("{v} {k}")).collect();
        eprintln!(
            "handoff-log: no request completed ({}); see terminal_reason in --per-request or `handoff-log show {} --request 0`",
            reasons.join(", "),
            out_dir.display()
        );
        return Ok(1);
    }
    if !outcome.drained {
        eprintln!("handoff-log: the run did not drain; {} things are stuck:", outcome.stuck.len());
        for s in outcome.stuck.iter().take(50) {
            eprintln!("  {s}");
        }
        if outcome.stuck.len() > 50 {
            eprintln!("  ... and {} more", outcome.stuck.len() - 50);
        }
        return Ok(1);
    }
    Ok(0)
}

/// Opens a trace for a replay: its identity (for the run id) and a reader that starts with the
/// prefix read for it, so that no byte is read twice.
pub fn open_trace(
    path: &Path,
    format: Option<TraceFormat>,
    speedup: f64,
) -> Result<(TraceIdentity, TraceReader<Box<dyn BufRead>>), CliError> {
    let opts = TraceOptions { format, speedup };
    let trace_error = |e: std::io::Error| CliError::new(2, format!("{}: {e}", path.display()));
    let mut file = File::open(path).map_err(trace_error)?;
    // The run id needs the trace's fingerprint before the first header is written.
    let meta = file.metadata().map_err(trace_error)?;
    let file_bytes = meta.is_file().then_some(meta.len());
    let (identity, prefix) = TraceIdentity::read(path, &mut file, file_bytes).map_err(trace_error)?;
    let reader: Box<dyn BufRead> =
        Box::new(BufReader::with_capacity(1 << 20, std::io::Cursor::new(prefix).chain(file)));
    Ok((identity, TraceReader::new(reader, path, opts)?))
}

/// The report JSON (`--report-json`, and `report.json` in each run of a sweep): the reference
/// mocker's key names, then what was run and how the replay went.
pub fn report_json(
    outcome: &ReplayOutcome,
    wall_ms: f64,
    log_dir: &Path,
    gpus_per_worker: u32,
) -> serde_json::Value {
    let mut json = outcome.report.to_json();
    if let Some(m) = json.as_object_mut() {
        m.insert("wall_time_ms".into(), wall_ms.into());
        m.insert("drained".into(), outcome.drained.into());
        m.insert("events".into(), outcome.events.into());
        m.insert("log_dir".into(), log_dir.display().to_string().into());
        let w = &outcome.workload;
        m.insert("sessions".into(), w.sessions_seen.into());
        m.insert("session_turns_dropped".into(), w.turns_dropped.into());
        if !outcome.faults.is_empty() {
            m.insert("faults".into(), serde_json::to_value(&outcome.faults).unwrap_or_default());
        }
        for (k, v) in what_was_run(outcome) {
            m.insert(k.into(), v);
        }
        // The logs carry worker-seconds; GPUs per worker only the configuration knows.
        m.insert("gpus_per_worker".into(), gpus_per_worker.into());
        m.insert("gpu_hours".into(), crate::report::gpu_hours(&outcome.report, gpus_per_worker).into());
        if !outcome.scaling.is_empty() {
            m.insert("scaling".into(), serde_json::to_value(&outcome.scaling).unwrap_or_default());
        }
    }
    json
}

/// What was run, for the report JSON: the run id, the cluster and the trace (key `trace_lines`
/// counts every line read, blank ones included).
fn what_was_run(o: &ReplayOutcome) -> Vec<(&'static str, serde_json::Value)> {
    let d = &o.description;
    vec![
        ("run_id", o.run_id.to_string().into()),
        ("backend", o.backend.as_str().into()),
        ("policy", o.policy.as_str().into()),
        ("shape", d.shape.clone().into()),
        ("prefill_router", d.prefill_router.as_ref().map(router_label).into()),
        ("decode_router", d.decode_router.as_ref().map(router_label).into()),
        ("seed", o.seed.into()),
        ("trace", d.trace.clone().into()),
        ("trace_lines", o.trace_lines_read.into()),
        ("config_digest", d.config_digest.clone().into()),
    ]
}

/// One line above the report table saying what was run.
fn headline(o: &ReplayOutcome) -> String {
    let d = &o.description;
    let routers = match (&d.prefill_router, &d.decode_router) {
        (Some(p), Some(q)) => {
            format!("prefill router {}, decode router {}", router_label(p), router_label(q))
        }
        (Some(p), None) => format!("router {}", router_label(p)),
        _ => "routers unknown".to_string(),
    };
    format!(
        "run {} · {} · {} · {} · {routers} · seed {} · trace {} ({} lines) · config {}",
        o.run_id,
        o.backend.as_str(),
        o.policy.as_str(),
        d.shape.as_deref().unwrap_or("—"),
        o.seed,
        d.trace.as_deref().unwrap_or("—"),
        o.trace_lines_read,
        d.config_digest.as_deref().unwrap_or("—"),
    )
}

/// The per-request file and its first write error.
struct PerRequestOut {
    w: BufWriter<File>,
    err: Option<std::io::Error>,
}

/// CPU time (user + system) of the calling thread so far, from /proc (Linux only).
fn thread_cpu_ms() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    // Linux reports these in USER_HZ, which is 100 on every mainstream configuration.
    Some(ticks * 10.0)
}
