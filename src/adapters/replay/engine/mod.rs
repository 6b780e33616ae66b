//! The offline replay: a discrete-event simulator on a virtual clock around the runtime's
//! sans-IO nodes ([`crate::runtime`]): one `WorkerNode` per worker, one `Frontend`, an
//! in-process network between them, a transfer model and faults. Every worker's facts go to
//! its own stream, the frontend's to the router's.
//!
//! ## Determinism
//! Events are ordered by `(time, insertion sequence)`. Every id and every random choice comes
//! from the run's seed. Maps whose order is observed are `BTreeMap`s. Same trace + config + seed
//! ⇒ byte-identical logs.
//!
//! ## Shape of the loop
//! * A worker runs one step at a time. A step's facts are observed when it completes; commands
//!   that reach a busy worker wait in its inbox and are applied between steps (the node's
//!   inbox rule).
//! * Frontend ↔ worker messages are delivered at once, depth first (`network`); handoff
//!   messages between workers, commands handed back, timers and transfer ends are queued
//!   events, never nested calls.
//! * The cluster may change shape mid-run (`scaling`): a joining worker gets the next slot, a
//!   node, a lane and a stream of its own; a leaving one is out of routing at once and is looked
//!   at after every event until it holds nothing, then writes `WorkerLeft`. Without a plan or a
//!   planner none of this runs.
//! * The run ends when no event is left. Every worker must then be drained; if one is not, the
//!   replay says which handoffs are stuck, where, and on what they wait.
//!
//! ## Modules
//! What is simulator-only lives here: `simulator` (the clock, the loop, dispatch, transfers),
//! `network` (carrying out what nodes and the frontend produced), `steps` (step boundaries and
//! commands handed back), `arrivals` (the workload's side of the frontend), `quiet` (coalesced
//! quiet decode steps), `cluster` (scaling), `fault_injection` and `liveness` (the guards that
//! stop a run that cannot finish); the writer thread is `replay::sink`.
//!
//! This file builds a replay and holds what it hands back.

use crate::adapters::replay::config::{ConfigError, ReplayConfig};
use crate::adapters::replay::contention::ContentionModel;
use crate::adapters::replay::faults::{FaultReport, FaultState};
use crate::adapters::replay::identity::{self, TraceIdentity};
use crate::adapters::replay::nemesis::{Nemesis, NetworkReport};
use crate::adapters::replay::queue::EventQueue;
use crate::adapters::replay::scaling::{Planner, ScalingDecision};
use crate::adapters::replay::sink::FactSink;
use crate::adapters::replay::trace::{TraceError, TraceReader};
use crate::adapters::replay::transfer::TransferConfig;
use crate::adapters::replay::transfer::TransferModel;
use crate::adapters::replay::workload::{Workload, WorkloadStats};
use crate::events::{EngineShape, LogError, RunWriter, StreamHeader};
use crate::ids::{Backend, ClockDomain, HandoffId, HandoffPolicy, IdMint, Role, WorkerId};
use crate::projections::compare::RunDescription;
use crate::projections::metrics::{MetricsFold, MetricsReport, PerRequestSink, Slo};
use crate::router::Router;
use crate::runtime::{
    Frontend, FrontendConfig, FrontendReady, NodeConfig, PromptTransferTime, Ready, RuntimeError, WorkerNode,
};
use crate::schedulers::sglang::SglangCore;
use crate::schedulers::vllm::VllmCore;
use crate::schedulers::EngineCore;
use std::collections::{BTreeMap, VecDeque};
use std::path::Path;

mod arrivals;
mod cluster;
mod fault_injection;
mod liveness;
mod network;
mod quiet;
mod simulator;
mod steps;

use liveness::PreemptionStreak;
use network::Local;
use quiet::QuietRuns;
use simulator::Event;

use crate::units::NS_PER_MS;

/// Why a replay could not run or finish.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("{0}")]
    Engine(String),
}

impl From<RuntimeError> for ReplayError {
    fn from(e: RuntimeError) -> Self {
        ReplayError::Engine(e.0)
    }
}

/// What a finished replay hands back.
pub struct ReplayOutcome {
    pub report: MetricsReport,
    pub run_id: uuid::Uuid,
    pub backend: Backend,
    /// The policy in force.
    pub policy: HandoffPolicy,
    pub seed: u64,
    /// What was run, as the router stream's header records it.
    pub description: RunDescription,
    /// Lines of the trace read (blank lines counted): all of them unless the run stopped early.
    pub trace_lines_read: u64,
    /// Every worker drained at the end.
    pub drained: bool,
    /// When not drained: one line per stuck handoff or request, saying where and on what.
    pub stuck: Vec<String>,
    pub events: u64,
    /// Of `events`, step boundaries that a quiet run applied without queuing them (see
    /// `QuietRun`): they are in the logs like any other step.
    pub coalesced_steps: u64,
    pub virtual_end_ns: u64,
    /// One entry per planned fault, in plan order: when it fired and what it did, or that its
    /// phase was never reached.
    pub faults: Vec<FaultReport>,
    /// Sessions, turns issued and dropped.
    pub workload: WorkloadStats,
    /// Every planned change and planner decision, in the order applied.
    pub scaling: Vec<ScalingDecision>,
    /// What the network's and the nemesis' faults did.
    pub network: NetworkReport,
}

/// Progress callback: (requests arrived, virtual time ns).
pub type Progress<'a> = &'a mut dyn FnMut(u64, u64);

/// What a replay records besides its configuration (all optional).
#[derive(Default)]
pub struct ReplayOptions {
    /// The trace file, for the run id and the router header (`None`: an in-memory trace).
    pub trace: Option<TraceIdentity>,
    /// Goodput objectives for the report (empty: no goodput).
    pub slo: Slo,
    /// Receives each request's record as it ends (`--per-request`).
    pub per_request: Option<PerRequestSink>,
    /// After every event, check each worker: the fold of the facts it wrote equals its core's
    /// counters and a recount of its block structures, and the counters conserve blocks
    /// (`simulate`; slow).
    pub check_every_event: bool,
    /// The stream format to write (v2 unless a reader of v1 only must read the run).
    pub log_format: crate::events::LogFormat,
}

pub struct Replay<'a> {
    cfg: ReplayConfig,
    run_id: uuid::Uuid,
    description: RunDescription,
    policy: HandoffPolicy,
    now_ns: u64,
    events: u64,
    queue: EventQueue<Event>,
    /// One node per worker, by slot (join order), and the simulator's own record of each.
    nodes: Vec<WorkerNode>,
    members: Vec<Member>,
    frontend: Frontend,
    /// Frontend ↔ worker messages held while a fault tells several roles of one loss (see
    /// `network`), and the spare output buffers of the depth-first delivery.
    held: Option<VecDeque<Local>>,
    spare_ready: Vec<Ready>,
    spare_front: Vec<FrontendReady>,
    transfer: TransferConfig,
    /// The run's streams and the metrics fold, behind the writer thread.
    sink: FactSink,
    /// When each trace request arrives (open loop, sessions, closed loop).
    workload: Workload,
    /// The time of the `Arrival` event queued last, while it is pending.
    arrival_armed_ns: Option<u64>,
    /// Transfers sharing NICs (`None` unless contention is enabled), with each transfer's
    /// destination and handoff by key, the key of each handoff's transfer, and the time of the
    /// `TransferTick` queued last.
    contention: Option<ContentionModel>,
    transfers: BTreeMap<u64, (usize, HandoffId)>,
    transfer_of: BTreeMap<HandoffId, u64>,
    next_transfer_key: u64,
    tick_armed_ns: Option<u64>,
    arrivals: u64,
    /// An arrival is due but `max_in_flight` holds it until a request ends.
    held_back: bool,
    block_size: u32,
    progress: Option<Progress<'a>>,
    /// `events` at which the progress callback is next due.
    next_progress: u64,
    /// Fault injection (inert without a fault plan).
    faults: FaultState,
    /// The network's and the nemesis' faults (inert unless configured).
    nemesis: Nemesis,
    /// Per slot, the inputs that reached a paused worker, in order (see `simulator::hold_input`).
    paused_inputs: Vec<VecDeque<Event>>,
    /// Per slot, the capacity folded from the facts written (only with `check_every_event`).
    folded: Option<Vec<crate::model::KvCapacitySnapshot>>,
    /// A broken invariant found while writing a fact, reported after the event.
    invariant: Option<String>,
    /// Quiet runs in progress, by slot (see [`QuietRun`](quiet::QuietRun)).
    quiet: QuietRuns,
    /// Set when a worker is found livelocked: the run stops and says why.
    livelock: Option<String>,
    /// The last instant something moved (see [`Replay::is_progress`]), and how long virtual
    /// time may pass after it, with requests in flight and every worker idle, before the run
    /// counts as stuck.
    last_progress_ns: u64,
    progress_limit_ns: u64,
    /// Each role's slots by worker index (aggregated workers are in `prefill_slots`): slots are
    /// in join order, the starting workers first in worker order, then each joiner.
    prefill_slots: Vec<usize>,
    decode_slots: Vec<usize>,
    /// Slots taken out of routing and not yet drained (empty unless a removal is under way: the
    /// event loop only looks at them then).
    leaving: Vec<usize>,
    planner: Option<Planner>,
    scaling: Vec<ScalingDecision>,
}

impl<'a> Replay<'a> {
    /// Builds the cluster and opens the output streams in `out_dir`; the run id comes from the
    /// configuration and seed alone (see [`Replay::with_options`] for one that knows its trace).
    pub fn new(
        cfg: ReplayConfig,
        trace: TraceReader<Box<dyn std::io::BufRead>>,
        out_dir: &Path,
        per_request: Option<PerRequestSink>,
    ) -> Result<Self, ReplayError> {
        Self::with_options(cfg, trace, out_dir, ReplayOptions { per_request, ..ReplayOptions::default() })
    }

    /// [`Replay::new`] with what the run records about its trace and the goodput objectives.
    pub fn with_options(
        cfg: ReplayConfig,
        trace: TraceReader<Box<dyn std::io::BufRead>>,
        out_dir: &Path,
        options: ReplayOptions,
    ) -> Result<Self, ReplayError> {
        cfg.validate()?;
        let policy = cfg.effective_policy();
        cfg.transfer.validate().map_err(|e| ConfigError::Invalid(e.to_string()))?;
        let workload = Workload::new(trace, cfg.load, cfg.max_buffered_requests)?;
        let run_id = identity::run_id(options.trace.as_ref(), &cfg);
        let description = identity::describe(options.trace.as_ref(), &cfg);
        let workers = starting_workers(&cfg);
        let (nodes, mut headers, block_size) =
            engine_nodes(&workers, &cfg, run_id, policy, ClockDomain::Virtual)?;
        let contention = contention_model(&cfg, &workers)?;
        // The router has no engine: its header's free-text config says what was run (trace,
        // shape, routers, config digest), which `compare` shows.
        let router_shape = EngineShape { config_json: description.to_json(), ..EngineShape::none() };
        headers.push(header(run_id, WorkerId::ROUTER, &cfg, policy, router_shape, ClockDomain::Virtual));
        let mut metrics = MetricsFold::new().with_slo(options.slo);
        if let Some(sink) = options.per_request {
            metrics = metrics.with_sink(sink);
        }
        for h in &headers {
            metrics.add_stream(h);
        }
        let out = RunWriter::create_as(out_dir, headers, options.log_format)?;
        let sink = FactSink::start(out, metrics)
            .map_err(|e| ReplayError::Engine(format!("starting the log writer thread: {e}")))?;
        let frontend = build_frontend(&cfg, &workers, block_size, policy)?;
        let (prefill_slots, decode_slots) = role_slots(&workers);
        let folded = options.check_every_event.then(|| nodes.iter().map(|n| n.core().snapshot()).collect());
        let mut r = Replay {
            folded,
            invariant: None,
            policy,
            now_ns: 0,
            events: 0,
            queue: EventQueue::new(workers.len()),
            members: vec![Member::default(); nodes.len()],
            nodes,
            frontend,
            held: None,
            spare_ready: Vec::new(),
            spare_front: Vec::new(),
            transfer: cfg.transfer,
            sink,
            workload,
            arrival_armed_ns: None,
            contention,
            transfers: BTreeMap::new(),
            transfer_of: BTreeMap::new(),
            next_transfer_key: 0,
            tick_armed_ns: None,
            arrivals: 0,
            held_back: false,
            block_size,
            progress: None,
            next_progress: 4096,
            faults: FaultState::new(&cfg.faults),
            nemesis: Nemesis::new(cfg.network.clone(), cfg.seed, workers.len()),
            paused_inputs: vec![VecDeque::new(); workers.len()],
            // Fault phases are checked at every event boundary, and a paused worker's steps
            // wait: keep every boundary.
            quiet: QuietRuns::new(
                cfg.coalesce_quiet_steps && cfg.faults.is_empty() && cfg.network.is_off(),
                workers.len(),
            ),
            livelock: None,
            last_progress_ns: 0,
            progress_limit_ns: 0,
            run_id,
            description,
            prefill_slots,
            decode_slots,
            leaving: Vec::new(),
            planner: cfg.planner.map(Planner::new),
            scaling: Vec::new(),
            cfg,
        };
        r.start()?;
        Ok(r)
    }

    /// Time 0: every starting stream (the router's too) opens its session, and the first
    /// arrival, the planned changes and the planner's first tick are queued.
    fn start(&mut self) -> Result<(), ReplayError> {
        for s in 0..self.nodes.len() {
            let mut ready = self.take_ready();
            self.nodes[s].start(&mut ready);
            self.carry_out(s, ready)?;
        }
        let mut out = self.take_front();
        self.frontend.start(&mut out);
        self.carry_out_frontend(out)?;
        // Longer than every lifecycle timeout: by then a deadline would have moved something.
        self.progress_limit_ns = self
            .cfg
            .lease_ms
            .max(self.cfg.reservation_timeout_ms)
            .max(self.cfg.bootstrap_timeout_ms)
            .saturating_add(1_000)
            .saturating_mul(NS_PER_MS);
        self.arm_arrival();
        for i in 0..self.cfg.scale.len() {
            let at = self.cfg.scale[i].at_ms.saturating_mul(NS_PER_MS);
            self.push(at, Event::Scale(i));
        }
        if let Some(p) = &self.planner {
            let at = p.interval_ns();
            self.push(at, Event::PlannerTick);
        }
        for i in 0..self.cfg.network.pauses.len() {
            let at = self.cfg.network.pauses[i].at_ms.saturating_mul(NS_PER_MS);
            self.push(at, Event::Pause(i));
        }
        for i in 0..self.cfg.network.crashes.len() {
            let at = self.cfg.network.crashes[i].at_ms.saturating_mul(NS_PER_MS);
            self.push(at, Event::Crash(i));
        }
        Ok(())
    }

    pub fn with_progress(mut self, p: Progress<'a>) -> Self {
        self.progress = Some(p);
        self
    }
}

/// The frontend of a run: its routers over `workers` and the handoff-id mint, every draw taken
/// from the seed in one order, so replay and live of one configuration mint the same ids.
pub fn build_frontend(
    cfg: &ReplayConfig,
    workers: &[WorkerId],
    block_size: u32,
    policy: HandoffPolicy,
) -> Result<Frontend, ReplayError> {
    let mut mint = IdMint::from_seed(cfg.seed);
    // The run id used to be these two draws; they are still taken so that every later draw
    // (router seeds, handoff ids) stays what it was. The run id now also depends on the
    // trace and the configuration (identity.rs), so runs of seed 0 no longer share one.
    let _ = (mint.next_u64(), mint.next_u64());
    let (prefill_router, decode_router) = routers(cfg, workers, block_size, &mut mint)?;
    let frontend_config = FrontendConfig {
        policy,
        disaggregated: cfg.is_disaggregated(),
        bootstrap_timeout_ns: cfg.bootstrap_timeout_ms * NS_PER_MS,
        max_in_flight: cfg.max_in_flight,
        block_size,
        latency_samples: cfg.planner.is_some(),
    };
    Ok(Frontend::new(
        frontend_config,
        prefill_router,
        decode_router,
        mint,
        Box::new(PromptLink(cfg.transfer)),
    ))
}

/// The workers a run starts with, in slot order: prefill then decode, or the aggregated ones.
pub fn starting_workers(cfg: &ReplayConfig) -> Vec<WorkerId> {
    if cfg.is_disaggregated() {
        let prefill = (0..cfg.prefill_workers).map(WorkerId::prefill);
        prefill.chain((0..cfg.decode_workers).map(WorkerId::decode)).collect()
    } else {
        (0..cfg.workers).map(WorkerId::aggregated).collect()
    }
}

/// A node with its engine core for each worker, the workers' stream headers, and the one
/// block size they must share.
pub fn engine_nodes(
    workers: &[WorkerId],
    cfg: &ReplayConfig,
    run_id: uuid::Uuid,
    policy: HandoffPolicy,
    clock: ClockDomain,
) -> Result<(Vec<WorkerNode>, Vec<StreamHeader>, u32), ReplayError> {
    let mut nodes = Vec::new();
    let mut headers = Vec::new();
    let mut block_size = 0;
    for w in workers {
        let core = make_core(*w, cfg)?;
        let shape = core.shape();
        if block_size != 0 && shape.block_size != block_size {
            return Err(ConfigError::Invalid(format!(
                "{w}: block size {} differs from other workers' {block_size}; KV-aware routing and transfers need one block size",
                shape.block_size
            ))
            .into());
        }
        block_size = shape.block_size;
        headers.push(header(run_id, *w, cfg, policy, shape, clock));
        nodes.push(WorkerNode::new(*w, core, node_config(cfg, policy)));
    }
    Ok((nodes, headers, block_size))
}

/// What every node of the run is configured with.
pub fn node_config(cfg: &ReplayConfig, policy: HandoffPolicy) -> NodeConfig {
    NodeConfig {
        policy,
        lease_ns: cfg.lease_ms * NS_PER_MS,
        reservation_ns: cfg.reservation_timeout_ms * NS_PER_MS,
        renew_ns: cfg.lease_renew_ms.map(|ms| ms * NS_PER_MS),
        kv_bytes_per_token: cfg.transfer.kv_bytes_per_token(),
        publish_kv_events: [&cfg.prefill_router, &cfg.decode_router]
            .into_iter()
            .any(|m| matches!(m, crate::router::RouterMode::KvAware { .. })),
    }
}

/// The Disabled policy's prompt transfer, as the link models it.
struct PromptLink(TransferConfig);

impl PromptTransferTime for PromptLink {
    fn prompt_transfer_ns(&self, input_tokens: u32) -> u64 {
        self.0.transfer_ns(input_tokens as u64)
    }
}

/// What the simulator keeps of each worker beside its node.
#[derive(Clone, Copy, Debug, Default)]
struct Member {
    membership: Membership,
    /// The latest run of preemptions of one request with nothing finishing on this worker
    /// (see [`Replay::note_preemption`]).
    preemptions: Option<PreemptionStreak>,
}

/// Where a worker stands in the cluster (see `scaling`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Membership {
    /// Routers may select it.
    #[default]
    Active,
    /// Taken out of routing; it finishes what it holds, then leaves.
    Leaving,
    /// Drained and gone (its stream ends with `WorkerLeft` at this instant).
    Left { at_ns: u64 },
}

/// The NICs transfers share, one per starting worker (`None` unless contention is on with a
/// bandwidth transfer model).
fn contention_model(
    cfg: &ReplayConfig,
    workers: &[WorkerId],
) -> Result<Option<ContentionModel>, ReplayError> {
    let (TransferConfig::Bandwidth(link), true) = (&cfg.transfer, cfg.contention.enabled) else {
        return Ok(None);
    };
    let names: Vec<String> = workers.iter().map(|w| w.to_string()).collect();
    // NIC overrides may also name workers that join later.
    let mut known = names.clone();
    if !cfg.scale.is_empty() || cfg.planner.is_some() {
        for i in 0..crate::adapters::replay::config::MAX_WORKERS {
            known.push(WorkerId::prefill(i).to_string());
            known.push(WorkerId::decode(i).to_string());
        }
    }
    cfg.contention.validate(&known).map_err(|e| ConfigError::Invalid(format!("contention: {e}")))?;
    let model = ContentionModel::new(&cfg.contention, names, link)
        .map_err(|e| ConfigError::Invalid(format!("contention: {e}")))?;
    Ok(Some(model))
}

/// The prefill router (every worker of an aggregated run) and the decode router, each seeded
/// by the next draw of `mint`, prefill first.
fn routers(
    cfg: &ReplayConfig,
    workers: &[WorkerId],
    block_size: u32,
    mint: &mut IdMint,
) -> Result<(Router, Option<Router>), ReplayError> {
    let (prefill_workers, decode_workers): (Vec<WorkerId>, Vec<WorkerId>) = if cfg.is_disaggregated() {
        workers.iter().partition(|w| w.role == Role::Prefill)
    } else {
        (workers.to_vec(), Vec::new())
    };
    let route_err = |e: crate::router::RouterError| ConfigError::Invalid(format!("router: {e}"));
    let prefill_router =
        Router::new(prefill_workers, cfg.prefill_router.clone(), block_size, mint.next_u64())
            .map_err(route_err)?;
    let decode_router = if decode_workers.is_empty() {
        None
    } else {
        Some(
            Router::new(decode_workers, cfg.decode_router.clone(), block_size, mint.next_u64())
                .map_err(route_err)?,
        )
    };
    Ok((prefill_router, decode_router))
}

/// Each role's slots by worker index (aggregated workers count as prefill).
fn role_slots(workers: &[WorkerId]) -> (Vec<usize>, Vec<usize>) {
    let mut prefill_slots = Vec::new();
    let mut decode_slots = Vec::new();
    for (s, w) in workers.iter().enumerate() {
        match w.role {
            Role::Decode => decode_slots.push(s),
            _ => prefill_slots.push(s),
        }
    }
    (prefill_slots, decode_slots)
}

/// The engine core of worker `w`, as the configuration gives its role.
pub fn make_core(w: WorkerId, cfg: &ReplayConfig) -> Result<Box<dyn EngineCore>, ReplayError> {
    Ok(match cfg.backend {
        Backend::Vllm | Backend::TrtLlm => Box::new(
            VllmCore::new(w, cfg.backend, *cfg.vllm_for(w.role))
                .map_err(|e| ConfigError::Invalid(format!("vllm: {e}")))?,
        ),
        Backend::Sglang => Box::new(
            SglangCore::new(w, cfg.sglang_for(w.role).clone())
                .map_err(|e| ConfigError::Invalid(format!("sglang: {e}")))?,
        ),
    })
}

pub fn header(
    run_id: uuid::Uuid,
    worker: WorkerId,
    cfg: &ReplayConfig,
    policy: HandoffPolicy,
    engine: EngineShape,
    clock: ClockDomain,
) -> StreamHeader {
    StreamHeader { run_id, worker, backend: cfg.backend, policy, clock, seed: cfg.seed, engine }
}
