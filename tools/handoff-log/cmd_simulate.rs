//! `simulate`: randomized whole runs under network and nemesis faults, one per seed, each
//! checked after every event and at its end (see `adapters::replay::swarm`).

use crate::out::Out;
use crate::CliError;
use handoff_ledger::adapters::replay::swarm::{run_seed, seed_dir, shrink, BackendChoice, SeedOutcome};
use handoff_ledger::ids::Backend;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct SimulateArgs {
    /// Seeds to run, `A..B` (B excluded), e.g. `0..1000`.
    #[arg(long, conflicts_with = "seed")]
    pub seeds: Option<String>,
    /// One seed, to reproduce it.
    #[arg(long)]
    pub seed: Option<u64>,
    /// vllm, sglang, or both (even seeds vLLM, odd seeds SGLang).
    #[arg(long, default_value = "both")]
    pub backend: String,
    /// Where failing seeds' runs are kept (each with its trace and configuration); clean
    /// seeds' runs are removed. Default: a new directory in the system's temporary directory.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Seeds run at a time (default: the machine's cores).
    #[arg(long)]
    pub jobs: Option<usize>,
}

fn parse_seeds(args: &SimulateArgs) -> Result<std::ops::Range<u64>, CliError> {
    if let Some(s) = args.seed {
        return Ok(s..s.saturating_add(1));
    }
    let Some(text) = args.seeds.as_deref() else {
        return Err(CliError::new(2, "give --seeds A..B or --seed N"));
    };
    let bad = || CliError::new(2, format!("--seeds {text:?}: expected A..B with A < B, e.g. 0..1000"));
    let (a, b) = text.split_once("..").ok_or_else(bad)?;
    let (a, b): (u64, u64) = (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?);
    if a >= b {
        return Err(bad());
    }
    Ok(a..b)
}

fn parse_backend(text: &str) -> Result<BackendChoice, CliError> {
    match text.to_ascii_lowercase().as_str() {
        "both" => Ok(BackendChoice::Both),
        "vllm" => Ok(BackendChoice::One(Backend::Vllm)),
        "sglang" => Ok(BackendChoice::One(Backend::Sglang)),
        other => Err(CliError::new(2, format!("--backend {other:?}: expected vllm, sglang or both"))),
    }
}

pub fn run(args: &SimulateArgs) -> Result<u8, CliError> {
    let seeds = parse_seeds(args)?;
    let backends = parse_backend(&args.backend)?;
    let root = match &args.out {
        Some(p) => p.clone(),
        None => std::env::temp_dir().join(format!("handoff-simulate-{}", std::process::id())),
    };
    std::fs::create_dir_all(&root).map_err(|e| CliError::new(2, format!("{}: {e}", root.display())))?;
    let jobs =
        args.jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).clamp(1, 64);
    let started = Instant::now();
    let next = AtomicU64::new(seeds.start);
    let results: Mutex<Vec<SeedOutcome>> = Mutex::new(Vec::new());
    let io_error: Mutex<Option<String>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| loop {
                let seed = next.fetch_add(1, Ordering::Relaxed);
                if seed >= seeds.end {
                    return;
                }
                let dir = seed_dir(&root, seed);
                match run_seed(seed, backends, &dir) {
                    Ok(outcome) => {
                        if outcome.clean() {
                            let _ = std::fs::remove_dir_all(&dir);
                        }
                        results.lock().unwrap_or_else(|p| p.into_inner()).push(outcome);
                    }
                    Err(e) => {
                        *io_error.lock().unwrap_or_else(|p| p.into_inner()) =
                            Some(format!("{}: {e}", dir.display()));
                        return;
                    }
                }
            });
        }
    });
    if let Some(e) = io_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(CliError::new(2, e));
    }
    let mut results = results.into_inner().unwrap_or_else(|p| p.into_inner());
    results.sort_by_key(|r| r.seed);
    let failed: Vec<&SeedOutcome> = results.iter().filter(|r| !r.clean()).collect();
    let mut out = Out::new();
    for r in &failed {
        out.line(&format!(
            "seed {} ({}): {} broken expectation(s)",
            r.seed,
            r.backend.as_str(),
            r.failures.len()
        ))?;
        for f in r.failures.iter().take(5) {
            out.line(&format!("  {f}"))?;
        }
        out.line(&format!(
            "  reproduce with: handoff-log simulate --seed {} --backend {}  (run kept in {})",
            r.seed,
            args.backend,
            seed_dir(&root, r.seed).display()
        ))?;
        let small = seed_dir(&root, r.seed).join("shortest");
        let line = match shrink(r.seed, backends, &small) {
            Ok(Some((keep, s))) => format!(
                "  still fails with the first {keep} of its {} requests: {} (log in {})",
                r.requests,
                s.failures.first().map(String::as_str).unwrap_or(""),
                small.join("run").display()
            ),
            Ok(None) => "  no shorter trace fails".to_string(),
            Err(e) => format!("  shrinking failed: {e}"),
        };
        out.line(&line)?;
    }
    let vllm = results.iter().filter(|r| r.backend == Backend::Vllm).count();
    let events: u64 = results.iter().map(|r| r.events).sum();
    let requests: u64 = results.iter().map(|r| r.requests).sum();
    let sum = |f: fn(&SeedOutcome) -> u64| results.iter().map(f).sum::<u64>();
    let faults = format!(
        "{} messages lost, {} doubled, {} delayed, {} cut by partitions; {} pauses, {} crashes",
        sum(|r| r.network.dropped),
        sum(|r| r.network.duplicated),
        sum(|r| r.network.delayed),
        sum(|r| r.network.partitioned),
        sum(|r| r.network.paused),
        sum(|r| r.network.crashed)
    );
    out.line(&format!(
        "simulate: {} seeds ({vllm} vLLM, {} SGLang; {requests} requests, {events} events), {} in {:.1} s",
        results.len(),
        results.len() - vllm,
        if failed.is_empty() { "all clean".to_string() } else { format!("{} failed", failed.len()) },
        started.elapsed().as_secs_f64()
    ))?;
    out.line(&format!("  faults: {faults}"))?;
    out.flush()?;
    if failed.is_empty() {
        let _ = std::fs::remove_dir(&root); // empty unless the user's own
        Ok(0)
    } else {
        Ok(1)
    }
}
