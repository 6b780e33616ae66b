//! `handoff-log live` and `handoff-log worker`: the replay's cluster as real processes.
//!
//! `live` runs the frontend in this process and (unless `--external-workers`) starts one
//! `handoff-log worker` process per worker; each writes its own stream into `--out`. The report
//! is folded from those streams once every worker has left, exactly as `project metrics` would.

use crate::cmd_replay::{open_trace, ClusterArgs};
use crate::out::Out;
use crate::CliError;
use handoff_ledger::adapters::live::frontend::{self, FrontendOutcome, FrontendSetup, JoinedWorker};
use handoff_ledger::adapters::live::launch::{LaunchPlan, Workers};
use handoff_ledger::adapters::live::worker::{self, WorkerOptions};
use handoff_ledger::adapters::live::{check_supported, LiveTiming};
use handoff_ledger::adapters::replay::config::ReplayConfig;
use handoff_ledger::adapters::replay::identity;
use handoff_ledger::adapters::replay::trace::TraceFormat;
use handoff_ledger::adapters::replay::workload::Workload;
use handoff_ledger::events::RunReader;
use handoff_ledger::ids::{Role, WorkerId};
use handoff_ledger::projections::metrics::{MetricsFold, MetricsReport, Slo};
use handoff_ledger::projections::PerRequest;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct LiveArgs {
    /// The trace: Mooncake JSONL or Azure 2023 CSV.
    pub trace: PathBuf,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[arg(long)]
    pub trace_format: Option<TraceFormat>,
    /// JSON configuration file (the replay's); flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Directory for the run's streams: each worker process writes its own there.
    #[arg(long)]
    pub out: PathBuf,
    /// Replace the streams of an earlier run in `--out`.
    #[arg(long)]
    pub force: bool,
    /// Wall time per model time: 0.1 runs the trace ten times faster than it was recorded
    /// (arrivals, step durations and timeouts alike).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Where the frontend listens for workers.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Start no worker processes: wait for `handoff-log worker --frontend ADDR` processes
    /// (other hosts, say) to join; the address is printed on stderr.
    #[arg(long)]
    pub external_workers: bool,
    /// Serve `/metrics` on each started worker (an ephemeral loopback port, listed in
    /// `OUT/live-workers.json`).
    #[arg(long)]
    pub metrics: bool,
    #[arg(long)]
    pub report_json: Option<PathBuf>,
    #[arg(long)]
    pub per_request: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
    #[arg(long, value_name = "KEY=MS,...")]
    pub slo: Option<Slo>,
}

#[derive(clap::Args)]
pub struct WorkerArgs {
    /// prefill or decode.
    #[arg(long, value_parser = parse_role)]
    pub role: Role,
    #[arg(long)]
    pub index: u32,
    /// The frontend's address (HOST:PORT).
    #[arg(long)]
    pub frontend: String,
    /// Where to listen for peer workers.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Serve Prometheus metrics at ADDR/metrics.
    #[arg(long)]
    pub metrics: Option<String>,
    /// Directory for this worker's stream.
    #[arg(long)]
    pub out: PathBuf,
}

fn parse_role(s: &str) -> Result<Role, String> {
    match s.to_ascii_lowercase().as_str() {
        "prefill" => Ok(Role::Prefill),
        "decode" => Ok(Role::Decode),
        _ => Err(format!("{s}: a live worker is prefill or decode")),
    }
}

pub fn run_worker(a: &WorkerArgs) -> Result<u8, CliError> {
    let worker = match a.role {
        Role::Prefill => WorkerId::prefill(a.index),
        Role::Decode => WorkerId::decode(a.index),
        other => {
            return Err(CliError::new(
                2,
                format!("--role {}: a live worker is prefill or decode", other.as_str()),
            ))
        }
    };
    let options = WorkerOptions {
        worker,
        frontend: a.frontend.clone(),
        listen: a.listen.clone(),
        metrics: a.metrics.clone(),
        out: a.out.clone(),
    };
    match worker::run(options) {
        Ok(summary) if summary.drained => Ok(0),
        Ok(summary) => {
            for s in &summary.stuck {
                eprintln!("handoff-log worker {worker}: stuck: {s}");
            }
            Ok(1)
        }
        Err(e) => Err(CliError::new(1, format!("worker {worker}: {e}"))),
    }
}

pub fn run(a: &LiveArgs) -> Result<u8, CliError> {
    let mut cfg = match &a.config {
        Some(p) => ReplayConfig::from_file(p)?,
        None => ReplayConfig::default(),
    };
    a.cluster.apply(&mut cfg);
    cfg.validate()?;
    check_supported(&cfg).map_err(|e| CliError::new(2, e.to_string()))?;
    let timing = LiveTiming::new(a.time_scale);
    timing.validate().map_err(|e| CliError::new(2, e.to_string()))?;
    prepare_out(&a.out, a.force)?;
    for p in [&a.report_json, &a.per_request].into_iter().flatten() {
        std::fs::File::create(p).map_err(|e| CliError::new(2, format!("{}: {e}", p.display())))?;
    }
    let (trace_identity, trace) = open_trace(&a.trace, a.trace_format, cfg.arrival_speedup)?;
    let workload = Workload::new(trace, cfg.load, cfg.max_buffered_requests)
        .map_err(|e| CliError::new(2, e.to_string()))?;
    let run_id = identity::run_id(Some(&trace_identity), &cfg);
    let description = identity::describe(Some(&trace_identity), &cfg);
    let listener = std::net::TcpListener::bind(&a.listen)
        .map_err(|e| CliError::new(2, format!("--listen {}: {e}", a.listen)))?;
    let address = listener.local_addr()?.to_string();
    let workers_of_run = handoff_ledger::adapters::replay::engine::starting_workers(&cfg);
    let mut children = None;
    if a.external_workers {
        eprintln!(
            "handoff-log live: frontend listening on {address}; waiting for {} workers",
            workers_of_run.len()
        );
    } else {
        // Said for the launched run too: a killed worker restarted by hand joins here.
        eprintln!(
            "handoff-log live: frontend listening on {address}; starting {} workers",
            workers_of_run.len()
        );
        let exe = std::env::current_exe()?;
        let plan =
            LaunchPlan { exe: &exe, frontend: address.clone(), out: a.out.clone(), metrics: a.metrics };
        children = Some(Workers::spawn(&plan, &workers_of_run)?);
    }
    let list_path = a.out.join("live-workers.json");
    let on_joined = Box::new(move |joined: &[JoinedWorker]| {
        let text = serde_json::to_string_pretty(joined).unwrap_or_default();
        if let Err(e) = std::fs::write(&list_path, text + "\n") {
            tracing::warn!("{}: {e}", list_path.display());
        }
    });
    let gpus_per_worker = cfg.gpus_per_worker;
    let setup = FrontendSetup { cfg, run_id, description, timing, out: a.out.clone(), workload, on_joined };
    let started = Instant::now();
    let result = frontend::run(listener, setup);
    let exits = children.as_mut().map(|c| c.wait_all(Duration::from_secs(20))).unwrap_or_default();
    let wall_ms = started.elapsed().as_secs_f64() * 1e3;
    let outcome = result.map_err(|e| CliError::new(1, format!("live run: {e}")))?;
    let report = fold_report(&a.out, a.slo.unwrap_or_default(), a.per_request.as_deref())?;
    let json = report_json(&report, &outcome, run_id, wall_ms, &a.out, &exits);
    if let Some(p) = &a.report_json {
        let text = serde_json::to_string_pretty(&json).unwrap_or_default();
        std::fs::write(p, text + "\n").map_err(|e| CliError::new(2, format!("{}: {e}", p.display())))?;
    }
    let mut out = Out::new();
    if a.json {
        out.line(&serde_json::to_string_pretty(&json).unwrap_or_default())?;
    } else {
        out.line(&format!(
            "live run {run_id} · {} workers · time scale {}",
            workers_of_run.len(),
            a.time_scale
        ))?;
        out.line(&crate::report::table(&report, Some(gpus_per_worker)))?;
        for line in live_lines(&outcome, &exits, a.time_scale) {
            out.line(&line)?;
        }
        out.line(&format!("wall time {wall_ms:.0} ms; logs in {}", a.out.display()))?;
    }
    out.flush()?;
    exit_code(&report, &outcome)
}

/// Exit codes as replay's: 1 when nothing completed or something did not drain (a lost worker
/// counts), 130 when interrupted.
fn exit_code(report: &MetricsReport, outcome: &FrontendOutcome) -> Result<u8, CliError> {
    if outcome.interrupted {
        eprintln!("handoff-log: interrupted; every worker was told to cancel and leave");
        return Ok(130);
    }
    if report.num_requests > 0 && report.completed_requests == 0 {
        eprintln!("handoff-log: no request completed");
        return Ok(1);
    }
    let undrained: Vec<String> = outcome
        .summaries
        .values()
        .flat_map(|s| s.stuck.iter().cloned())
        .chain(outcome.lost.iter().map(|(w, why)| format!("{w} was lost: {why}")))
        .collect();
    if !undrained.is_empty() {
        eprintln!("handoff-log: the run did not drain:");
        for s in undrained.iter().take(50) {
            eprintln!("  {s}");
        }
        return Ok(1);
    }
    Ok(0)
}

fn prepare_out(out: &Path, force: bool) -> Result<(), CliError> {
    std::fs::create_dir_all(out).map_err(|e| CliError::new(2, format!("{}: {e}", out.display())))?;
    for entry in std::fs::read_dir(out)? {
        let p = entry?.path();
        if p.extension().and_then(|e| e.to_str()) == Some("hlog") {
            if !force {
                return Err(CliError::new(
                    2,
                    format!(
                        "{} holds the streams of another run ({}); give --force to replace them",
                        out.display(),
                        p.display()
                    ),
                ));
            }
            std::fs::remove_file(&p)?;
        }
    }
    Ok(())
}

/// The report, folded from the streams the processes wrote.
fn fold_report(out: &Path, slo: Slo, per_request: Option<&Path>) -> Result<MetricsReport, CliError> {
    let mut run = RunReader::open(out)?;
    let mut fold = MetricsFold::new().with_slo(slo);
    if let Some(p) = per_request {
        let file = std::fs::File::create(p).map_err(|e| CliError::new(2, format!("{}: {e}", p.display())))?;
        let mut w = std::io::BufWriter::new(file);
        fold = fold.with_sink(Box::new(move |r: &PerRequest| {
            let line = serde_json::to_string(r).unwrap_or_default();
            let _ = w.write_all(line.as_bytes()).and_then(|_| w.write_all(b"\n"));
        }));
    }
    let headers = run.headers().to_vec();
    for h in &headers {
        fold.add_stream(h);
    }
    while let Some((i, rec)) = run.next()? {
        fold.apply(headers[i].worker, &rec);
    }
    Ok(fold.report())
}

fn report_json(
    report: &MetricsReport,
    outcome: &FrontendOutcome,
    run_id: uuid::Uuid,
    wall_ms: f64,
    out: &Path,
    exits: &[(WorkerId, Option<std::process::ExitStatus>)],
) -> serde_json::Value {
    let mut json = report.to_json();
    if let Some(m) = json.as_object_mut() {
        m.insert("run_id".into(), run_id.to_string().into());
        m.insert("clock".into(), "wall".into());
        m.insert("wall_time_ms".into(), wall_ms.into());
        m.insert("log_dir".into(), out.display().to_string().into());
        m.insert("trace_lines".into(), outcome.trace_lines_read.into());
        m.insert(
            "drained".into(),
            (outcome.lost.is_empty() && outcome.summaries.values().all(|s| s.drained)).into(),
        );
        m.insert("frontend_lag".into(), serde_json::to_value(outcome.lag).unwrap_or_default());
        m.insert("workers".into(), serde_json::to_value(&outcome.summaries).unwrap_or_default());
        let lost: Vec<String> = outcome.lost.iter().map(|(w, why)| format!("{w}: {why}")).collect();
        m.insert("workers_lost".into(), lost.into());
        let rejoined: Vec<String> = outcome
            .rejoined
            .iter()
            .map(|(w, why, g)| format!("{w}: {why}; rejoined as session {}", g.0))
            .collect();
        m.insert("workers_rejoined".into(), rejoined.into());
        let exits: Vec<String> = exits
            .iter()
            .map(|(w, s)| format!("{w}: {}", s.map_or("killed".to_string(), |s| s.to_string())))
            .collect();
        m.insert("worker_exits".into(), exits.into());
    }
    json
}

/// What the live run adds to the report: how far processes lagged the model, step drift, CPU.
fn live_lines(
    outcome: &FrontendOutcome,
    exits: &[(WorkerId, Option<std::process::ExitStatus>)],
    time_scale: f64,
) -> Vec<String> {
    let mut lines = Vec::new();
    let f = &outcome.lag;
    lines.push(format!(
        "frontend: {} inputs, {} late (at most {:.3} ms model), lag mean {:.0} µs max {:.1} ms wall",
        f.handled,
        f.late,
        f.max_late_ns as f64 / 1e6,
        f.mean_lag_us(),
        f.max_lag_us as f64 / 1e3
    ));
    for (w, s) in &outcome.summaries {
        let step_lag_us = if s.steps > 0 { s.step_end_lag_us_sum as f64 / s.steps as f64 } else { 0.0 };
        lines.push(format!(
            "{w}: {} steps, each end handled {:.0} µs (at most {:.1} ms) wall after its modeled instant ({:.3} ms model), {} inputs, {} late (at most {:.3} ms), lag mean {:.0} µs max {:.1} ms, clock ±{} µs, cpu {}",
            s.steps,
            step_lag_us,
            s.step_end_lag_us_max as f64 / 1e3,
            step_lag_us / 1e3 / time_scale,
            s.lag.handled,
            s.lag.late,
            s.lag.max_late_ns as f64 / 1e6,
            s.lag.mean_lag_us(),
            s.lag.max_lag_us as f64 / 1e3,
            s.clock_uncertainty_us,
            s.cpu_ms.map_or("—".into(), |c| format!("{c:.0} ms")),
        ));
    }
    for (w, why) in &outcome.lost {
        lines.push(format!("{w} was lost: {why}"));
    }
    for (w, why, generation) in &outcome.rejoined {
        lines.push(format!(
            "{w} was lost ({why}) and rejoined: session {} took over its stream and left drained",
            generation.0
        ));
    }
    for (w, status) in exits {
        match status {
            Some(s) if s.success() => {}
            Some(s) => lines.push(format!("{w} exited: {s}")),
            None => lines.push(format!("{w} did not exit in time and was killed")),
        }
    }
    lines
}
