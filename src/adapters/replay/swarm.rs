//! `simulate`: randomized whole runs, each drawn from one seed (TigerBeetle's VOPR swarm).
//!
//! A seed draws the scenario — backend (unless fixed), cluster shape, routers, engine sizes,
//! lease / reservation / bootstrap timeouts, a generated trace, and the network's and nemesis'
//! faults (`nemesis`): drops, doubles and delays of handoff messages, a partition, pauses, a
//! crash, late timers; and in about 3 seeds of 10, one or two decode workers joining mid-run
//! (so waiting destinations move to them under faults too). Message faults stop at the end of the trace's arrivals; from there the
//! network is clean and the run must drain on its own (the liveness phase).
//!
//! The safety checks run during the replay, after every event (`check_every_event`: each
//! worker's folded facts equal its core's counters and a recount of its block structures,
//! blocks conserved), and on the written run: it drained, every request arrived reached one
//! terminal outcome, the log verifies with its content (capacity conservation per worker,
//! bookings freed by the worker that holds them), every pin and reservation ended exactly once
//! and nothing released came back.

use crate::adapters::replay::config::ReplayConfig;
use crate::adapters::replay::engine::{Replay, ReplayOptions, ReplayOutcome};
use crate::adapters::replay::nemesis::{ClockJump, Crash, NetworkFaults, Partition, Pause};
use crate::adapters::replay::trace::{TraceOptions, TraceReader};
use crate::events::{Fact, RunReader};
use crate::ids::{Backend, HandoffId, WorkerId};
use crate::router::RouterMode;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};

/// Which backends a seed may draw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    One(Backend),
    /// Even seeds vLLM, odd seeds SGLang.
    Both,
}

/// A drawn scenario: the configuration and the trace's lines.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub config: ReplayConfig,
    pub trace: Vec<String>,
}

/// How one seed went.
#[derive(Debug)]
pub struct SeedOutcome {
    pub seed: u64,
    pub backend: Backend,
    /// Every broken expectation (empty: clean).
    pub failures: Vec<String>,
    pub requests: u64,
    pub events: u64,
    /// What the faults did.
    pub network: crate::adapters::replay::nemesis::NetworkReport,
}

impl SeedOutcome {
    pub fn clean(&self) -> bool {
        self.failures.is_empty()
    }
}

const ROUTERS: [RouterMode; 4] =
    [RouterMode::RoundRobin, RouterMode::Random, RouterMode::LeastLoaded, RouterMode::PowerOfTwo];

impl Scenario {
    /// Everything about a run, from its seed.
    pub fn draw(seed: u64, backends: BackendChoice) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let backend = match backends {
            BackendChoice::One(b) => b,
            BackendChoice::Both if seed % 2 == 0 => Backend::Vllm,
            BackendChoice::Both => Backend::Sglang,
        };
        let mut config = ReplayConfig {
            backend,
            seed,
            prefill_workers: rng.random_range(1..=3),
            decode_workers: rng.random_range(1..=3),
            lease_ms: rng.random_range(200..=5_000),
            reservation_timeout_ms: rng.random_range(200..=5_000),
            bootstrap_timeout_ms: rng.random_range(200..=5_000),
            ..ReplayConfig::default()
        };
        config.prefill_router = ROUTERS[rng.random_range(0..ROUTERS.len())].clone();
        config.decode_router = if rng.random_bool(0.3) {
            RouterMode::KvAware { overlap_weight: 1.0, temperature: 0.0 }
        } else {
            ROUTERS[rng.random_range(0..ROUTERS.len())].clone()
        };
        if rng.random_bool(0.3) {
            config.lease_renew_ms = Some(config.lease_ms / rng.random_range(2..=6));
        }
        // Small pools, so that pins, reservations and preemptions press on capacity.
        config.vllm.num_gpu_blocks = rng.random_range(48..=1_024);
        config.vllm.max_num_seqs = rng.random_range(2..=64);
        config.sglang.total_pages = rng.random_range(48..=1_024);
        config.sglang.max_running_requests = rng.random_range(2..=64);
        let (trace, span_ms) = generate_trace(&mut rng);
        config.network = draw_faults(&mut rng, &config, span_ms);
        // Decode workers joining mid-run (destinations waiting elsewhere move to them), from a
        // stream of its own so the draws above stay what they were for every seed.
        let mut scaling = ChaCha8Rng::seed_from_u64(seed ^ 0x5ca1_e0f0_dec0_de00);
        if scaling.random_bool(0.3) {
            let at_ms = scaling.random_range(0..=span_ms.max(1));
            let decode = scaling.random_range(1..=2);
            config.scale = vec![crate::adapters::replay::scaling::ScaleEntry { at_ms, prefill: 0, decode }];
        }
        Scenario { config, trace }
    }
}

/// A trace of 5–60 requests over at most a few seconds, some sharing prompt prefixes.
fn generate_trace(rng: &mut ChaCha8Rng) -> (Vec<String>, u64) {
    let n = rng.random_range(5..=60);
    let mut at_ms = 0u64;
    let mut next_block = 1_000u64;
    let mut lines = Vec::with_capacity(n);
    for _ in 0..n {
        at_ms += rng.random_range(0..=120);
        let input: u32 = rng.random_range(1..=4_000);
        let output: u32 = rng.random_range(1..=96);
        let blocks = input.div_ceil(512) as u64;
        let shared = if rng.random_bool(0.4) { rng.random_range(0..=blocks.min(4)) } else { 0 };
        let ids: Vec<String> = (0..blocks)
            .map(|b| {
                if b < shared {
                    b.to_string()
                } else {
                    next_block += 1;
                    next_block.to_string()
                }
            })
            .collect();
        lines.push(format!(
            r#"{{"timestamp": {at_ms}, "input_length": {input}, "output_length": {output}, "hash_ids": [{}]}}"#,
            ids.join(", ")
        ));
    }
    (lines, at_ms)
}

fn draw_faults(rng: &mut ChaCha8Rng, config: &ReplayConfig, span_ms: u64) -> NetworkFaults {
    let workers: Vec<String> = config.known_workers();
    let pick = |rng: &mut ChaCha8Rng| workers[rng.random_range(0..workers.len())].clone();
    let when = |rng: &mut ChaCha8Rng| rng.random_range(0..=span_ms.max(1));
    let mut f = NetworkFaults {
        drop: if rng.random_bool(0.5) { rng.random_range(0.0..0.2) } else { 0.0 },
        duplicate: if rng.random_bool(0.5) { rng.random_range(0.0..0.2) } else { 0.0 },
        delay_ms: if rng.random_bool(0.5) { rng.random_range(0.0..30.0) } else { 0.0 },
        until_ms: Some(span_ms),
        ..NetworkFaults::default()
    };
    if rng.random_bool(0.3) {
        let at_ms = when(rng);
        f.partitions.push(Partition {
            at_ms,
            heal_ms: at_ms + rng.random_range(0..=2_000),
            workers: vec![pick(rng)],
        });
    }
    for _ in 0..rng.random_range(0..=2) {
        f.pauses.push(Pause { worker: pick(rng), at_ms: when(rng), for_ms: rng.random_range(0..=2_000) });
    }
    if rng.random_bool(0.3) {
        f.crashes.push(Crash { worker: pick(rng), at_ms: when(rng) });
    }
    if rng.random_bool(0.2) {
        f.clock_jumps.push(ClockJump {
            worker: pick(rng),
            at_ms: when(rng),
            late_ms: rng.random_range(0..=1_000),
        });
    }
    f
}

/// Runs one seed into `dir` (its trace is written there too, to reproduce by hand) and checks
/// it. A run that stops with an error is a failure, not an error: it is what `simulate` is for.
pub fn run_seed(seed: u64, backends: BackendChoice, dir: &Path) -> std::io::Result<SeedOutcome> {
    run_scenario(seed, &Scenario::draw(seed, backends), dir)
}

/// The shortest prefix of a failing seed's trace that still fails (same configuration and
/// faults), run into `dir`: the smallest log that shows the defect. `None` if even the whole
/// trace runs clean there (the failure depended on something else).
pub fn shrink(
    seed: u64,
    backends: BackendChoice,
    dir: &Path,
) -> std::io::Result<Option<(usize, SeedOutcome)>> {
    let full = Scenario::draw(seed, backends);
    for keep in 1..=full.trace.len() {
        let scenario = Scenario { config: full.config.clone(), trace: full.trace[..keep].to_vec() };
        let _ = std::fs::remove_dir_all(dir);
        let outcome = run_scenario(seed, &scenario, dir)?;
        if !outcome.clean() {
            return Ok(Some((keep, outcome)));
        }
    }
    Ok(None)
}

fn run_scenario(seed: u64, scenario: &Scenario, dir: &Path) -> std::io::Result<SeedOutcome> {
    std::fs::create_dir_all(dir)?;
    let trace_path = dir.join("trace.jsonl");
    std::fs::write(&trace_path, scenario.trace.join("\n") + "\n")?;
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&scenario.config)?)?;
    let mut out = SeedOutcome {
        seed,
        backend: scenario.config.backend,
        failures: Vec::new(),
        requests: scenario.trace.len() as u64,
        events: 0,
        network: Default::default(),
    };
    let log_dir = dir.join("run");
    match replay(scenario, &trace_path, &log_dir) {
        Ok(outcome) => {
            out.events = outcome.events;
            out.network = outcome.network;
            check_outcome(&outcome, out.requests, &mut out.failures);
            check_log(&log_dir, &mut out.failures);
        }
        Err(e) => out.failures.push(format!("the replay stopped: {e}")),
    }
    Ok(out)
}

fn replay(scenario: &Scenario, trace: &Path, out: &Path) -> Result<ReplayOutcome, String> {
    let file = std::fs::File::open(trace).map_err(|e| format!("{}: {e}", trace.display()))?;
    let input: Box<dyn BufRead> = Box::new(std::io::BufReader::new(file));
    let options = TraceOptions { format: None, speedup: 1.0 };
    let boxed = TraceReader::new(input, trace, options).map_err(|e| e.to_string())?;
    let run_options = ReplayOptions { check_every_event: true, ..ReplayOptions::default() };
    let r =
        Replay::with_options(scenario.config.clone(), boxed, out, run_options).map_err(|e| e.to_string())?;
    r.run().map_err(|e| e.to_string())
}

fn check_outcome(outcome: &ReplayOutcome, requests: u64, failures: &mut Vec<String>) {
    if !outcome.drained {
        failures.push(format!("did not drain: {}", outcome.stuck.join("; ")));
    }
    let r = &outcome.report;
    let ended = r.completed_requests + r.rejected_requests + r.failed_requests + r.canceled_requests;
    if r.num_requests != requests || ended != requests {
        failures.push(format!("{requests} requests in the trace, {} arrived, {ended} ended", r.num_requests));
    }
}

/// What the written run must show: it verifies with its content, and per worker and handoff
/// every pin and reservation ended exactly once, with nothing after its end.
fn check_log(dir: &Path, failures: &mut Vec<String>) {
    if let Err(e) = crate::projections::run::verify_consistent(dir) {
        failures.push(format!("the log contradicts itself: {e}"));
        return;
    }
    let mut reader = match RunReader::open(dir) {
        Ok(r) => r,
        Err(e) => return failures.push(format!("reading the run: {e}")),
    };
    let mut roles: BTreeMap<(WorkerId, HandoffId), RoleLife> = BTreeMap::new();
    let mut bookings = crate::projections::bookings::BookingFold::new();
    loop {
        let (worker, rec) = match reader.next_record() {
            Ok(Some(r)) => r,
            Ok(None) => break,
            Err(e) => return failures.push(format!("reading the run: {e}")),
        };
        if worker == WorkerId::ROUTER {
            if let Err(v) = bookings.apply(&rec.fact) {
                failures.push(format!("router at t={} ns: {v}", rec.at_ns));
            }
        }
        let Some(h) = rec.fact.handoff() else { continue };
        let life = roles.entry((worker, h)).or_default();
        if let Some(why) = life.apply(&rec.fact) {
            failures.push(format!("{worker} {h} at t={} ns: {why}", rec.at_ns));
        }
    }
    if !bookings.is_drained() {
        let (prefill, decode) = bookings.in_flight();
        failures.push(format!("bookings still open at the end: {prefill} prefill, {decode} decode"));
    }
    for ((w, h), life) in roles {
        if life.pins != life.pin_ends || life.reservations != life.reservation_ends {
            failures.push(format!(
                "{w} {h}: {} pins and {} pin ends, {} reservations and {} reservation ends",
                life.pins, life.pin_ends, life.reservations, life.reservation_ends
            ));
        }
    }
}

/// One role's resources over its life on one worker.
#[derive(Default)]
struct RoleLife {
    pins: u32,
    pin_ends: u32,
    reservations: u32,
    reservation_ends: u32,
}

impl RoleLife {
    /// Counts a fact; the reason, if it breaks exactly-once or comes back after an end.
    fn apply(&mut self, fact: &Fact) -> Option<String> {
        match fact {
            Fact::SourcePinned { .. } => {
                self.pins += 1;
                (self.pins > 1).then(|| "pinned twice (a released source came back)".to_string())
            }
            Fact::SourceReleased { .. } => {
                self.pin_ends += 1;
                (self.pin_ends > self.pins).then(|| "a pin released more often than made".to_string())
            }
            Fact::DestinationReserved { .. } => {
                self.reservations += 1;
                (self.reservations > 1)
                    .then(|| "reserved twice (a released destination came back)".to_string())
            }
            Fact::DestinationActivated { .. } | Fact::ReservationReleased { .. } => {
                self.reservation_ends += 1;
                (self.reservation_ends > self.reservations)
                    .then(|| "a reservation ended more often than made".to_string())
            }
            _ => None,
        }
    }
}

/// Where seed `seed`'s run goes under `root`.
pub fn seed_dir(root: &Path, seed: u64) -> PathBuf {
    root.join(format!("seed-{seed}"))
}
