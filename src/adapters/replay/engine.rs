//! The offline replay: a discrete-event loop on a virtual clock that composes per-worker engine
//! cores, the role-local handoff state machines, the routers and an in-process transport, and
//! writes every worker's facts to its own stream.
//!
//! ## Determinism
//! Events are ordered by `(time, insertion sequence)`. Every id and every random choice comes
//! from the run's seed. Maps whose order is observed are `BTreeMap`s. Same trace + config + seed
//! ⇒ byte-identical logs.
//!
//! ## Shape of the loop
//! * A worker runs one step at a time. A step's facts are observed when it completes; commands
//!   that reach a busy worker wait in its inbox and are applied between steps, as a real engine
//!   loop applies control messages between iterations.
//! * Cross-worker effects (messages, commands the frontend issues, transfer completions,
//!   timers) are events, never nested calls, so no handler re-enters another.
//! * The frontend keeps each request's guard (its workers, its handoff, whether it ended): the
//!   router's request guard, which frees bookings exactly once at the terminal outcome. Handoff
//!   state itself lives only in the role machines on each worker.
//! * The cluster may change shape mid-run (`scaling`): a joining worker gets the next slot, a
//!   lane and a stream of its own; a leaving one is out of routing at once and is looked at
//!   after every event until it holds nothing, then writes `WorkerLeft`. Without a plan or a
//!   planner none of this runs.
//! * The run ends when no event is left. Every worker must then be drained; if one is not, the
//!   replay says which handoffs are stuck, where, and on what they wait.

use crate::adapters::replay::config::{ConfigError, ReplayConfig};
use crate::adapters::replay::contention::ContentionModel;
use crate::adapters::replay::faults::{FaultKind, FaultReport, FaultState, Late};
use crate::adapters::replay::identity::{self, TraceIdentity};
use crate::adapters::replay::queue::EventQueue;
use crate::adapters::replay::scaling::{role_name, Planner, ScaledWorker, ScalingDecision};
use crate::adapters::replay::sink::FactSink;
use crate::adapters::replay::trace::{TraceError, TraceReader};
use crate::adapters::replay::transfer::{TransferConfig, TransferModel};
use crate::adapters::replay::workload::{Workload, WorkloadStats};
use crate::events::{EngineShape, Fact, LogError, RunWriter, StreamHeader, TerminalStatus};
use crate::ids::{
    Backend, CancelReason, ClockDomain, EndReason, Generation, HandoffId, HandoffPolicy, IdMint,
    KvHandoffDemand, RequestId, Role, WorkerId,
};
use crate::lifecycle::destination::{
    DestinationAction, DestinationConfig, DestinationEvent, DestinationHandoff, DestinationInit,
};
use crate::lifecycle::messages::HandoffMessage;
use crate::lifecycle::source::{SourceAction, SourceConfig, SourceEvent, SourceHandoff, SourceInit};
use crate::projections::compare::RunDescription;
use crate::projections::metrics::{MetricsFold, MetricsReport, PerRequestSink, Slo};
use crate::router::Router;
use crate::schedulers::sglang::SglangCore;
use crate::schedulers::vllm::VllmCore;
use crate::schedulers::{
    CommandError, CommandOutcome, CommandResult, Effects, EngineCore, EngineOutput, QuietDurations,
    QuietSteps, Request, StepOutput,
};
use std::collections::{BTreeMap, VecDeque};
use std::path::Path;

const NS_PER_MS: u64 = 1_000_000;
/// Zero-duration steps in a row at one instant before a worker is declared stuck in a loop.
const MAX_ZERO_STEPS: u32 = 10_000;

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

/// A command for one worker, applied when the worker is between steps.
#[derive(Clone, Debug)]
enum Command {
    Submit(Request),
    /// Disabled policy's decode: the prompt's KV came with the request.
    SubmitPrefilled(Request),
    DispatchPrefill {
        handoff: HandoffId,
        request: Request,
        lease_ns: u64,
    },
    Reserve {
        handoff: HandoffId,
        request: Request,
        deadline_ns: u64,
    },
    Activate(HandoffId),
    ReleaseSource(HandoffId, EndReason),
    CancelSource(HandoffId, CancelReason),
    CancelDestination(HandoffId, EndReason),
}

#[derive(Clone, Debug)]
enum Event {
    Arrival,
    StepDone(usize),
    /// A free worker with work starts its next step: queued to run after everything else due
    /// at its instant (see `queue`), so that requests arriving together share a step.
    StepStart(usize),
    /// A core command; `then` are events that must wait until it is applied (messages that
    /// follow it in the same transition: "receive completed" only once activation is done).
    Command {
        slot: usize,
        command: Command,
        then: Vec<Event>,
    },
    Deliver {
        slot: usize,
        msg: HandoffMessage,
    },
    TransferDone {
        slot: usize,
        handoff: HandoffId,
    },
    /// The NIC contention model's next instant of interest (a transfer finishing or its latency
    /// ending); stale ticks find nothing due.
    TransferTick,
    LeaseTimer {
        slot: usize,
        handoff: HandoffId,
    },
    ReservationTimer {
        slot: usize,
        handoff: HandoffId,
    },
    RenewTimer {
        slot: usize,
        handoff: HandoffId,
    },
    BootstrapTimer {
        request: RequestId,
    },
    /// A delayed fault's time: only makes an event boundary, where the fault is checked.
    FaultTimer,
    /// The planned change `cfg.scale[i]` is due.
    Scale(usize),
    /// The planner looks at the recent requests (every `planner.interval_ms`).
    PlannerTick,
}

/// One transition's actions as events, in order. A message that follows a core command in the
/// same transition waits until that command is applied: the worker may be mid-step, and e.g.
/// "receive completed" must not reach the source before the destination has activated.
#[derive(Default)]
struct Batch {
    events: Vec<Event>,
}

impl Batch {
    fn command(&mut self, slot: usize, command: Command) {
        self.events.push(Event::Command { slot, command, then: Vec::new() });
    }

    fn message(&mut self, slot: usize, msg: HandoffMessage) {
        let deliver = Event::Deliver { slot, msg };
        match self.events.iter_mut().rev().find(|e| matches!(e, Event::Command { .. })) {
            Some(Event::Command { then, .. }) => then.push(deliver),
            _ => self.events.push(deliver),
        }
    }
}

struct Slot {
    id: WorkerId,
    core: Box<dyn EngineCore>,
    /// A step is in flight; its effects wait in `pending` until `StepDone`.
    busy: bool,
    pending: Option<Effects>,
    inbox: VecDeque<(Command, Vec<Event>)>,
    generation: Generation,
    sources: BTreeMap<HandoffId, SourceHandoff>,
    destinations: BTreeMap<HandoffId, DestinationHandoff>,
    zero_steps: (u64, u32),
    /// The latest run of preemptions of one request with nothing finishing on this worker
    /// (see [`Replay::note_preemption`]).
    preemptions: Option<PreemptionStreak>,
    membership: Membership,
}

impl Slot {
    fn new(id: WorkerId, core: Box<dyn EngineCore>) -> Self {
        Slot {
            id,
            core,
            busy: false,
            pending: None,
            inbox: VecDeque::new(),
            generation: Generation(1),
            sources: BTreeMap::new(),
            destinations: BTreeMap::new(),
            zero_steps: (u64::MAX, 0),
            preemptions: None,
            membership: Membership::Active,
        }
    }
}

/// Where a worker stands in the cluster (see `scaling`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Membership {
    /// Routers may select it.
    Active,
    /// Taken out of routing; it finishes what it holds, then leaves.
    Leaving,
    /// Drained and gone (its stream ends with `WorkerLeft` at this instant).
    Left { at_ns: u64 },
}

/// A request preempted again and again, with no request on its worker finishing, pinning its
/// prefill or getting its first token in between.
#[derive(Clone, Copy, Debug)]
struct PreemptionStreak {
    request: RequestId,
    since_ns: u64,
    count: u64,
}

/// Preemptions in one streak before the streak can mean a livelock (with the time limit in
/// [`Replay::note_preemption`]).
const LIVELOCK_PREEMPTIONS: u64 = 1000;

/// The frontend's request guard.
struct Guard {
    request: Request,
    handoff: Option<HandoffId>,
    prefill: Option<usize>,
    decode: Option<usize>,
    activated: bool,
    /// The outcome to report if the handoff ends without activation (set before the role
    /// machine is told why, so a refusal reads as `rejected`, not `failed`).
    fail_status: Option<TerminalStatus>,
    /// For the planner's samples: arrival, and the user's first token (from a decode or
    /// aggregated worker; only noted while a planner runs).
    arrival_ns: u64,
    first_token_ns: Option<u64>,
}

impl Guard {
    /// A request that arrived at `arrival_ns` and was booked on prefill slot `prefill`.
    fn new(request: Request, handoff: Option<HandoffId>, prefill: usize, arrival_ns: u64) -> Self {
        Guard {
            request,
            handoff,
            prefill: Some(prefill),
            decode: None,
            activated: false,
            fail_status: None,
            arrival_ns,
            first_token_ns: None,
        }
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
}

pub struct Replay<'a> {
    cfg: ReplayConfig,
    run_id: uuid::Uuid,
    description: RunDescription,
    policy: HandoffPolicy,
    now_ns: u64,
    events: u64,
    queue: EventQueue<Event>,
    /// Drained effect buffers, handed to the next core that steps (at most one per worker).
    spare_effects: Vec<Effects>,
    slots: Vec<Slot>,
    prefill_router: Router,
    decode_router: Option<Router>,
    guards: BTreeMap<RequestId, Guard>,
    handoff_request: BTreeMap<HandoffId, RequestId>,
    /// Handoffs whose source pin the core has reported and not yet released.
    pinned: std::collections::BTreeSet<HandoffId>,
    /// Handoff prefills dispatched to the core and neither pinned nor ended there: like a pin,
    /// they keep the prefill booking (and the frontend's correlation) until the core lets go.
    computing: std::collections::BTreeSet<HandoffId>,
    transfer: TransferConfig,
    mint: IdMint,
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
    held_back: bool,
    block_size: u32,
    progress: Option<Progress<'a>>,
    /// `events` at which the progress callback is next due.
    next_progress: u64,
    /// Fault injection (inert without a fault plan).
    faults: FaultState,
    /// Quiet runs in progress, by slot (see [`QuietRun`]).
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

/// A worker in a run of quiet steps: `steps` steps from `start_ns`, the first an ordinary step
/// already applied to the core when the run began (`first`, its only fact), the others decode
/// steps that the core promised would each only advance every running request by a token and
/// write `rest.fact(i)` (see [`EngineCore::quiet_steps`]).
///
/// Most of a replay's events are such steps (no block to allocate or hash, no token that ends
/// anything, no command in between). Instead of a boundary event, a core call and an effects
/// round trip per step, the run keeps one boundary queued (the last step's end) and:
/// * writes each step's fact when its boundary would have popped: before any event that comes
///   after it in the queue's `(time, rank)` order ([`Replay::write_quiet_until`]); so every
///   stream, the metrics fold and the event count see exactly what step-by-step replay gives;
/// * applies the steps to the core in one go ([`EngineCore::advance_quiet`]) when the last
///   boundary pops, or when a command reaches the worker mid-run: then the steps begun by that
///   instant are applied, the one in flight becomes an ordinary pending step, and the
///   command waits in the inbox for its end, as it would have.
///
/// Only commands touch a core (role machines, deliveries and timers reach it through them),
/// so a run can be cut at exactly the step a command lands in.
#[derive(Clone, Debug)]
struct QuietRun {
    // What writing each fact reads, first.
    worker: WorkerId,
    start_ns: u64,
    first_ns: u64,
    steps: u64,
    /// Facts written so far (steps `1..=written` have ended).
    written: u64,
    /// The promised steps' common duration, 0 when they differ (then see `ends`).
    same_ns: u64,
    first: Fact,
    rest: QuietSteps,
    /// Each step's end when the promised durations differ (`ends[j - 1]` for step `j`); empty
    /// when they are all the same.
    ends: Vec<u64>,
}

impl QuietRun {
    fn new(worker: WorkerId, start_ns: u64, first: Fact, first_ns: u64, rest: QuietSteps) -> Self {
        let steps = rest.steps.saturating_add(1);
        let (same_ns, ends) = match &rest.durations {
            QuietDurations::Same(ns) => (*ns, Vec::new()),
            QuietDurations::Each(d) => {
                let first_end = start_ns.saturating_add(first_ns);
                let ends = std::iter::once(first_end)
                    .chain(d.iter().scan(first_end, |at, ns| {
                        *at = at.saturating_add(*ns);
                        Some(*at)
                    }))
                    .collect();
                (0, ends)
            }
        };
        QuietRun { worker, start_ns, first_ns, steps, written: 0, same_ns, first, rest, ends }
    }

    /// When step `step` (from 1) ends.
    fn end_of(&self, step: u64) -> u64 {
        if self.same_ns > 0 {
            let rest_ns = step.saturating_sub(1).saturating_mul(self.same_ns);
            return self.start_ns.saturating_add(self.first_ns).saturating_add(rest_ns);
        }
        step.checked_sub(1).and_then(|i| self.ends.get(i as usize)).copied().unwrap_or(u64::MAX)
    }

    /// The fact step `step` (from 1) writes.
    fn fact_of(&self, step: u64) -> Fact {
        if step <= 1 {
            self.first.clone()
        } else {
            self.rest.fact(step - 2)
        }
    }

    /// When the next fact is due for [`Replay::write_quiet_until`], `u64::MAX` if none: the
    /// last step's fact is written by its own boundary event.
    fn next_due_ns(&self) -> u64 {
        if self.written + 1 < self.steps {
            self.end_of(self.written + 1)
        } else {
            u64::MAX
        }
    }
}

/// The quiet runs, with each run's next unwritten boundary kept apart in a few contiguous
/// words: every event pop asks for the earliest.
struct QuietRuns {
    enabled: bool,
    runs: Vec<Option<QuietRun>>,
    /// Per slot: the end of the next step whose fact is due before the run's last boundary,
    /// `u64::MAX` when none.
    next_at: Vec<u64>,
    /// The minimum of `next_at`.
    earliest_ns: u64,
    /// Steps written by runs rather than by their own boundary event.
    coalesced: u64,
}

impl QuietRuns {
    fn refresh(&mut self, slot: usize) {
        self.next_at[slot] = self.runs[slot].as_ref().map_or(u64::MAX, QuietRun::next_due_ns);
        self.earliest_ns = self.next_at.iter().copied().min().unwrap_or(u64::MAX);
    }
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
        let transfer = cfg.transfer;
        let workload = Workload::new(trace, cfg.load, cfg.max_buffered_requests)?;
        let mut mint = IdMint::from_seed(cfg.seed);
        // The run id used to be these two draws; they are still taken so that every later draw
        // (router seeds, handoff ids) stays what it was. The run id now also depends on the
        // trace and the configuration (identity.rs), so runs of seed 0 no longer share one.
        let _ = (mint.next_u64(), mint.next_u64());
        let run_id = identity::run_id(options.trace.as_ref(), &cfg);
        let description = identity::describe(options.trace.as_ref(), &cfg);
        let per_request = options.per_request;
        let mut slots = Vec::new();
        let mut workers: Vec<WorkerId> = Vec::new();
        if cfg.is_disaggregated() {
            workers.extend((0..cfg.prefill_workers).map(WorkerId::prefill));
            workers.extend((0..cfg.decode_workers).map(WorkerId::decode));
        } else {
            workers.extend((0..cfg.workers).map(WorkerId::aggregated));
        }
        let mut headers = Vec::new();
        let mut metrics = MetricsFold::new().with_slo(options.slo);
        if let Some(sink) = per_request {
            metrics = metrics.with_sink(sink);
        }
        let mut block_size = 0;
        for w in &workers {
            let core = make_core(*w, &cfg)?;
            let shape = core.shape();
            if block_size != 0 && shape.block_size != block_size {
                return Err(ConfigError::Invalid(format!(
                    "{w}: block size {} differs from other workers' {block_size}; KV-aware routing and transfers need one block size",
                    shape.block_size
                ))
                .into());
            }
            block_size = shape.block_size;
            let header = header(run_id, *w, &cfg, policy, shape);
            metrics.add_stream(&header);
            headers.push(header);
            slots.push(Slot::new(*w, core));
        }
        let contention = match (&cfg.transfer, cfg.contention.enabled) {
            (crate::adapters::replay::transfer::TransferConfig::Bandwidth(link), true) => {
                let names: Vec<String> = workers.iter().map(|w| w.to_string()).collect();
                // NIC overrides may also name workers that join later.
                let mut known = names.clone();
                if !cfg.scale.is_empty() || cfg.planner.is_some() {
                    for i in 0..crate::adapters::replay::config::MAX_WORKERS {
                        known.push(WorkerId::prefill(i).to_string());
                        known.push(WorkerId::decode(i).to_string());
                    }
                }
                cfg.contention
                    .validate(&known)
                    .map_err(|e| ConfigError::Invalid(format!("contention: {e}")))?;
                Some(
                    ContentionModel::new(&cfg.contention, names, link)
                        .map_err(|e| ConfigError::Invalid(format!("contention: {e}")))?,
                )
            }
            _ => None,
        };
        // The router has no engine: its header's free-text config says what was run (trace,
        // shape, routers, config digest), which `compare` shows.
        let router_shape = EngineShape { config_json: description.to_json(), ..EngineShape::none() };
        let router_header = header(run_id, WorkerId::ROUTER, &cfg, policy, router_shape);
        metrics.add_stream(&router_header);
        headers.push(router_header);
        let out = RunWriter::create(out_dir, headers)?;
        let sink = FactSink::start(out, metrics)
            .map_err(|e| ReplayError::Engine(format!("starting the log writer thread: {e}")))?;
        let (prefill_workers, decode_workers): (Vec<WorkerId>, Vec<WorkerId>) = if cfg.is_disaggregated() {
            workers.iter().partition(|w| w.role == Role::Prefill)
        } else {
            (workers.clone(), Vec::new())
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
        let mut prefill_slots = Vec::new();
        let mut decode_slots = Vec::new();
        for (s, w) in workers.iter().enumerate() {
            match w.role {
                Role::Decode => decode_slots.push(s),
                _ => prefill_slots.push(s),
            }
        }
        let planner = cfg.planner.map(Planner::new);
        let mut r = Replay {
            policy,
            now_ns: 0,
            events: 0,
            queue: EventQueue::new(workers.len()),
            spare_effects: Vec::new(),
            slots,
            prefill_router,
            decode_router,
            guards: BTreeMap::new(),
            handoff_request: BTreeMap::new(),
            pinned: std::collections::BTreeSet::new(),
            computing: std::collections::BTreeSet::new(),
            transfer,
            mint,
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
            quiet: QuietRuns {
                // Fault phases are checked at every event boundary: keep them all.
                enabled: cfg.coalesce_quiet_steps && cfg.faults.is_empty(),
                runs: vec![None; workers.len()],
                next_at: vec![u64::MAX; workers.len()],
                earliest_ns: u64::MAX,
                coalesced: 0,
            },
            livelock: None,
            last_progress_ns: 0,
            progress_limit_ns: 0,
            run_id,
            description,
            prefill_slots,
            decode_slots,
            leaving: Vec::new(),
            planner,
            scaling: Vec::new(),
            cfg,
        };
        for s in 0..r.slots.len() {
            let g = r.slots[s].generation;
            r.emit(s, 0, Fact::SessionStarted { generation: g })?;
        }
        r.emit_router(0, Fact::SessionStarted { generation: Generation(1) })?;
        // Longer than every lifecycle timeout: by then a deadline would have moved something.
        r.progress_limit_ns = r
            .cfg
            .lease_ms
            .max(r.cfg.reservation_timeout_ms)
            .max(r.cfg.bootstrap_timeout_ms)
            .saturating_add(1_000)
            .saturating_mul(NS_PER_MS);
        r.arm_arrival();
        for i in 0..r.cfg.scale.len() {
            let at = r.cfg.scale[i].at_ms.saturating_mul(NS_PER_MS);
            r.push(at, Event::Scale(i));
        }
        if let Some(p) = &r.planner {
            let at = p.interval_ns();
            r.push(at, Event::PlannerTick);
        }
        Ok(r)
    }

    pub fn with_progress(mut self, p: Progress<'a>) -> Self {
        self.progress = Some(p);
        self
    }

    fn push(&mut self, at_ns: u64, ev: Event) {
        self.queue.push(at_ns, ev);
    }

    fn push_all(&mut self, evs: Vec<Event>) {
        let now = self.now_ns;
        for ev in evs {
            self.push(now, ev);
        }
    }

    /// Whether a fact shows the run moving. Lease renewals, their messages and refused
    /// reservation retries can repeat forever without anything changing, so they do not count.
    fn is_progress(fact: &Fact) -> bool {
        use crate::events::MessageKind::LeaseRenewal;
        !matches!(
            fact,
            Fact::LeaseRenewed { .. }
                | Fact::ReservationRefused { .. }
                | Fact::MessageSent { kind: LeaseRenewal, .. }
                | Fact::MessageReceived { kind: LeaseRenewal, .. }
                | Fact::MessageRejected { kind: LeaseRenewal, .. }
        )
    }

    /// Virtual time has passed the progress limit since anything moved: with requests in flight
    /// and no worker computing, nothing but timers that change nothing is left, so the run
    /// stops and names what keeps it alive.
    fn check_progress(&mut self) {
        if self.guards.is_empty() || self.slots.iter().any(|s| s.busy) || self.livelock.is_some() {
            self.last_progress_ns = self.now_ns;
            return;
        }
        let waiting: Vec<String> = self
            .slots
            .iter()
            .flat_map(|s| s.destinations.iter().map(move |(h, m)| (s.id, *h, m.state_name())))
            .take(5)
            .map(|(w, h, state)| format!("{h} (destination on {w}, {state})"))
            .collect();
        self.livelock = Some(format!(
            "no progress for {:.1} s of virtual time with {} requests in flight and every worker idle: only lease renewals and refused retries happen; waiting handoffs: {}",
            self.now_ns.saturating_sub(self.last_progress_ns) as f64 / 1e9,
            self.guards.len(),
            if waiting.is_empty() { "none".to_string() } else { waiting.join(", ") }
        ));
    }

    fn emit(&mut self, slot: usize, at_ns: u64, fact: Fact) -> Result<(), ReplayError> {
        if Self::is_progress(&fact) {
            self.last_progress_ns = at_ns;
        }
        let worker = self.slots[slot].id;
        if matches!(fact, Fact::KvStored { .. } | Fact::KvRemoved { .. } | Fact::KvCleared) {
            self.prefill_router.observe(worker, &fact);
            if let Some(d) = self.decode_router.as_mut() {
                d.observe(worker, &fact);
            }
        }
        // Router bookings follow physical pins: the prefill booking lives until the core
        // reports the source released (the proposal's accounting table).
        let released = match &fact {
            Fact::RequestPreempted { request, .. } => {
                self.note_preemption(slot, *request, at_ns);
                None
            }
            // Progress on the worker: a request finished, pinned its prefill or got its first
            // token.
            Fact::RequestFinished { .. } | Fact::FirstTokenEmitted { .. } => {
                self.slots[slot].preemptions = None;
                None
            }
            Fact::SourcePinned { handoff, .. } => {
                self.slots[slot].preemptions = None;
                self.pinned.insert(*handoff);
                None
            }
            Fact::SourceReleased { handoff, .. } => {
                self.pinned.remove(handoff);
                self.handoff_request.get(handoff).copied()
            }
            _ => None,
        };
        self.sink.push(worker, at_ns, fact)?;
        if let Some(req) = released {
            if let Some(f) = self.prefill_router.free_prefill(req) {
                self.emit_router(at_ns, f)?;
            }
            if let Some(h) = self.guards.get(&req).and_then(|g| g.handoff) {
                self.forget_handoff(h);
            } else {
                let hs: Vec<HandoffId> =
                    self.handoff_request.iter().filter(|(_, r)| **r == req).map(|(h, _)| *h).collect();
                for h in hs {
                    self.forget_handoff(h);
                }
            }
        }
        Ok(())
    }

    fn emit_router(&mut self, at_ns: u64, fact: Fact) -> Result<(), ReplayError> {
        self.last_progress_ns = at_ns;
        self.sink.push(WorkerId::ROUTER, at_ns, fact)
    }

    fn emit_all(&mut self, slot: usize, at_ns: u64, facts: Vec<Fact>) -> Result<(), ReplayError> {
        for f in facts {
            self.emit(slot, at_ns, f)?;
        }
        Ok(())
    }

    /// Runs to the end of the trace and until every event is handled.
    pub fn run(mut self) -> Result<ReplayOutcome, ReplayError> {
        while let Some((at_ns, ev)) = self.queue.pop_with_starts(Event::StepDone, Event::StepStart) {
            if at_ns >= self.quiet.earliest_ns {
                // A step boundary ranks by its worker; anything else after every boundary.
                let rank = if let Event::StepDone(s) = ev { s } else { usize::MAX };
                self.write_quiet_until(at_ns, rank)?;
            }
            self.now_ns = at_ns;
            // A step start is the loop's own bookkeeping, not an event of the run: a quiet run
            // has none between its steps, and the count must not depend on coalescing.
            if !matches!(ev, Event::StepStart(_)) {
                self.events += 1;
            }
            self.handle(ev)?;
            if !self.leaving.is_empty() {
                self.check_leaving()?;
            }
            if self.now_ns.saturating_sub(self.last_progress_ns) > self.progress_limit_ns {
                self.check_progress();
            }
            if self.livelock.is_some() {
                break;
            }
            if self.events >= self.next_progress {
                self.next_progress = self.events + 4096;
                if let Some(p) = self.progress.as_mut() {
                    p(self.arrivals, self.now_ns);
                }
            }
        }
        let stuck = self.diagnose();
        let drained = stuck.is_empty();
        let faults = self.fault_reports();
        let scaling = self.scaling_report();
        let report = self.sink.finish()?;
        Ok(ReplayOutcome {
            report,
            run_id: self.run_id,
            backend: self.cfg.backend,
            policy: self.policy,
            seed: self.cfg.seed,
            description: self.description.clone(),
            trace_lines_read: self.workload.trace_lines_read(),
            drained,
            stuck,
            events: self.events,
            coalesced_steps: self.quiet.coalesced,
            virtual_end_ns: self.now_ns,
            faults,
            workload: self.workload.stats(),
            scaling,
        })
    }

    fn handle(&mut self, ev: Event) -> Result<(), ReplayError> {
        let now = self.now_ns;
        // Fault injection may drop, reject or double a delivery.
        if self.faults.active() && self.fault_intercepts(&ev)? {
            return self.fault_boundary();
        }
        match ev {
            Event::Arrival => self.on_arrival()?,
            Event::StepDone(s) => {
                // (`is_some` first: taking moves the whole run, and most boundaries have none.)
                if self.quiet.runs[s].is_some() {
                    if let Some(q) = self.quiet.runs[s].take() {
                        self.finish_quiet(s, q)?;
                    }
                }
                self.slots[s].busy = false;
                if let Some(effects) = self.slots[s].pending.take() {
                    self.apply_effects(s, effects)?;
                }
                while let Some((command, then)) = self.slots[s].inbox.pop_front() {
                    self.execute(s, command)?;
                    self.push_all(then);
                }
                if self.queue.has_due(now) {
                    self.queue.push_start(s, now);
                } else {
                    // Nothing else is due at this instant (no event, no other start), so
                    // starting now is starting after everything of the instant: skip the
                    // round trip through the queue that most step boundaries would take.
                    self.kick(s)?;
                }
            }
            Event::StepStart(s) => self.kick(s)?,
            Event::Command { slot, command, then } => {
                if self.slots[slot].busy && self.quiet.runs[slot].is_some() {
                    if let Some(q) = self.quiet.runs[slot].take() {
                        // Leaves the worker free if its last step ended right now.
                        self.cut_quiet(slot, q)?;
                    }
                }
                if self.slots[slot].busy {
                    self.slots[slot].inbox.push_back((command, then));
                } else {
                    self.execute(slot, command)?;
                    self.push_all(then);
                    self.queue.push_start(slot, now);
                }
            }
            Event::Deliver { slot, msg } => {
                let handoff = msg.handoff;
                if self.slots[slot].sources.contains_key(&handoff) {
                    self.source_event(slot, handoff, SourceEvent::Message(msg))?;
                } else if self.slots[slot].destinations.contains_key(&handoff) {
                    self.destination_event(slot, handoff, DestinationEvent::Message(msg))?;
                } else if !matches!(self.slots[slot].membership, Membership::Left { .. }) {
                    let f = msg.rejected_fact(crate::events::MessageRejection::UnknownHandoff);
                    self.emit(slot, now, f)?;
                }
                // (A worker that left has no transport: a straggler message to it is lost.)
            }
            Event::TransferDone { slot, handoff } => {
                self.destination_event(slot, handoff, DestinationEvent::ReceiveCompleted)?;
            }
            Event::TransferTick => self.on_transfer_tick()?,
            Event::LeaseTimer { slot, handoff } => {
                self.source_event(slot, handoff, SourceEvent::LeaseExpired)?;
            }
            Event::ReservationTimer { slot, handoff } => {
                self.destination_event(slot, handoff, DestinationEvent::ReservationExpired)?;
            }
            Event::RenewTimer { slot, handoff } => self.on_renew(slot, handoff)?,
            Event::BootstrapTimer { request } => self.on_bootstrap_timeout(request)?,
            Event::FaultTimer => {}
            Event::Scale(i) => self.on_planned_scale(i)?,
            Event::PlannerTick => self.on_planner_tick()?,
        }
        if self.faults.active() {
            self.fault_boundary()?;
        }
        Ok(())
    }

    // ----- arrivals and routing -----

    /// Queues an `Arrival` for the workload's next due request, unless one is queued for that
    /// instant or earlier already.
    fn arm_arrival(&mut self) {
        let due = self.workload.next_due_ns();
        arm(&mut self.queue, &mut self.arrival_armed_ns, self.now_ns, due, Event::Arrival);
    }

    fn on_arrival(&mut self) -> Result<(), ReplayError> {
        let now = self.now_ns;
        if self.arrival_armed_ns == Some(now) {
            self.arrival_armed_ns = None;
        }
        if self.guards.len() >= self.cfg.max_in_flight {
            self.held_back = true;
            return Ok(());
        }
        let Some(t) = self.workload.pop_due(now)? else {
            self.arm_arrival();
            return Ok(());
        };
        let request = t.to_request();
        self.arrivals += 1;
        self.arm_arrival();
        let id = request.id;
        self.emit_router(
            now,
            Fact::RequestArrived {
                request: id,
                input_tokens: request.input_tokens,
                output_tokens: request.output_tokens,
            },
        )?;
        let prompt_blocks = request.input_tokens.div_ceil(self.block_size);
        let total_blocks = (request.input_tokens + request.output_tokens).div_ceil(self.block_size);
        let p = self.prefill_router.select(&request).worker;
        let booked = self
            .prefill_router
            .book_prefill(id, p, request.input_tokens, prompt_blocks)
            .map_err(|e| ReplayError::Engine(e.to_string()))?;
        self.emit_router(now, booked)?;
        let p_slot = self.slot_of(p);
        if self.policy == HandoffPolicy::Disabled && self.cfg.is_disaggregated() {
            // The behaviour before the lifecycle: a one-token prefill that frees its KV as it
            // finishes; decode follows (see `prefill_finished_unpinned`).
            self.guards.insert(id, Guard::new(request.clone(), None, p_slot, now));
            let prefill = Request { output_tokens: 1, ..request };
            self.push(
                now,
                Event::Command { slot: p_slot, command: Command::Submit(prefill), then: Vec::new() },
            );
            return Ok(());
        }
        if self.policy == HandoffPolicy::Disabled {
            // Aggregated: the same worker prefills and decodes.
            let booked = self
                .prefill_router
                .book_decode(id, p, total_blocks)
                .map_err(|e| ReplayError::Engine(e.to_string()))?;
            self.emit_router(now, booked)?;
            let guard = Guard { decode: Some(p_slot), ..Guard::new(request.clone(), None, p_slot, now) };
            self.guards.insert(id, guard);
            self.push(
                now,
                Event::Command { slot: p_slot, command: Command::Submit(request), then: Vec::new() },
            );
            return Ok(());
        }
        let handoff = self.mint.handoff_id();
        self.handoff_request.insert(handoff, id);
        let demand = KvHandoffDemand {
            context_tokens: request.input_tokens,
            max_output_tokens: request.output_tokens,
        };
        let mut guard = Guard::new(request.clone(), Some(handoff), p_slot, now);
        let mut dest = None;
        if self.policy == HandoffPolicy::DestinationFirst {
            // SGLang: the decode is chosen (and booked) together with the prefill.
            let d_slot = self.route_decode(id, &request)?;
            guard.decode = Some(d_slot);
            dest = Some(d_slot);
            self.push(
                now.saturating_add(self.cfg.bootstrap_timeout_ms * NS_PER_MS),
                Event::BootstrapTimer { request: id },
            );
        }
        self.guards.insert(id, guard);
        let source = SourceHandoff::new(SourceInit {
            handoff,
            request: id,
            policy: self.policy,
            demand,
            worker: p,
            generation: self.slots[p_slot].generation,
            destination: dest.map(|d| self.slots[d].id),
            destination_generation: dest.map(|d| self.slots[d].generation),
            config: SourceConfig {
                lease_ns: self.cfg.lease_ms * NS_PER_MS,
                renew_ns: self.cfg.lease_ms * NS_PER_MS,
            },
        })
        .map_err(|e| ReplayError::Engine(e.to_string()))?;
        let facts = source.start_facts();
        self.emit_all(p_slot, now, facts)?;
        self.slots[p_slot].sources.insert(handoff, source);
        if let Some(d_slot) = dest {
            self.start_destination(d_slot, handoff, &request, p_slot)?;
        }
        self.source_event(p_slot, handoff, SourceEvent::Start)?;
        Ok(())
    }

    /// The decode router picks and books a decode worker.
    fn route_decode(&mut self, id: RequestId, request: &Request) -> Result<usize, ReplayError> {
        let now = self.now_ns;
        let total_blocks = (request.input_tokens + request.output_tokens).div_ceil(self.block_size);
        let router =
            self.decode_router.as_mut().ok_or_else(|| ReplayError::Engine("no decode router".into()))?;
        let d = router.select(request).worker;
        let booked =
            router.book_decode(id, d, total_blocks).map_err(|e| ReplayError::Engine(e.to_string()))?;
        self.emit_router(now, booked)?;
        Ok(self.slot_of(d))
    }

    fn start_destination(
        &mut self,
        d_slot: usize,
        handoff: HandoffId,
        request: &Request,
        p_slot: usize,
    ) -> Result<(), ReplayError> {
        let now = self.now_ns;
        let d = self.slots[d_slot].id;
        let dest = DestinationHandoff::new(DestinationInit {
            handoff,
            request: request.id,
            policy: self.policy,
            demand: KvHandoffDemand {
                context_tokens: request.input_tokens,
                max_output_tokens: request.output_tokens,
            },
            worker: d,
            generation: self.slots[d_slot].generation,
            source: Some(self.slots[p_slot].id),
            source_generation: Some(self.slots[p_slot].generation),
            config: DestinationConfig {
                reservation_ns: self.cfg.reservation_timeout_ms * NS_PER_MS,
                kv_bytes_per_token: self.cfg.transfer.kv_bytes_per_token(),
            },
        })
        .map_err(|e| ReplayError::Engine(e.to_string()))?;
        let facts = dest.start_facts();
        self.emit_all(d_slot, now, facts)?;
        self.slots[d_slot].destinations.insert(handoff, dest);
        self.destination_event(d_slot, handoff, DestinationEvent::Routed { worker: d })?;
        if let Some(renew) = self.cfg.lease_renew_ms {
            self.push(now.saturating_add(renew * NS_PER_MS), Event::RenewTimer { slot: d_slot, handoff });
        }
        Ok(())
    }

    fn slot_of(&self, w: WorkerId) -> usize {
        let slots = match w.role {
            Role::Decode => &self.decode_slots,
            _ => &self.prefill_slots,
        };
        // Every worker a router or a message names has a slot; an unknown one maps past the
        // end, so a bug shows as an out-of-range panic at the caller rather than a wrong worker.
        slots.get(w.index as usize).copied().unwrap_or(usize::MAX)
    }

    // ----- workers -----

    /// Starts a step on an idle worker that has work.
    fn kick(&mut self, s: usize) -> Result<(), ReplayError> {
        let now = self.now_ns;
        loop {
            if self.slots[s].busy || self.slots[s].core.is_empty() {
                return Ok(());
            }
            if let Some(fx) = self.spare_effects.pop() {
                self.slots[s].core.recycle(fx);
            }
            let out = self.slots[s].core.step(now);
            if out.duration_ns > 0 {
                if self.quiet.enabled {
                    if let Some(q) = self.quiet_run(s, now, &out) {
                        let slot = &mut self.slots[s];
                        slot.busy = true;
                        slot.zero_steps = (u64::MAX, 0);
                        self.queue.push_lane(s, q.end_of(q.steps), Event::StepDone(s));
                        self.quiet.runs[s] = Some(q);
                        self.quiet.refresh(s);
                        self.recycle_effects(out.effects);
                        return Ok(());
                    }
                }
                let slot = &mut self.slots[s];
                slot.busy = true;
                slot.pending = Some(out.effects);
                slot.zero_steps = (u64::MAX, 0);
                self.queue.push_lane(s, now.saturating_add(out.duration_ns), Event::StepDone(s));
                return Ok(());
            }
            if out.effects.facts.is_empty() && out.effects.outputs.is_empty() {
                // Runnable work that cannot run now (e.g. waiting for blocks): idle until a
                // command changes something.
                return Ok(());
            }
            let z = &mut self.slots[s].zero_steps;
            if z.0 == now {
                z.1 += 1;
                if z.1 > MAX_ZERO_STEPS {
                    return Err(ReplayError::Engine(format!(
                        "{} made no progress: {MAX_ZERO_STEPS} zero-length steps at t={} ms",
                        self.slots[s].id,
                        now as f64 / 1e6
                    )));
                }
            } else {
                *z = (now, 1);
            }
            self.apply_effects(s, out.effects)?;
        }
    }

    fn execute(&mut self, s: usize, command: Command) -> Result<(), ReplayError> {
        let now = self.now_ns;
        let core = &mut self.slots[s].core;
        match command {
            Command::Submit(request) => {
                let id = request.id;
                let r = core.submit(request, now);
                self.command_result(s, r, None, Some(id))
            }
            Command::SubmitPrefilled(request) => {
                let id = request.id;
                let r = core.submit_prefilled(request, now);
                self.command_result(s, r, None, Some(id))
            }
            Command::DispatchPrefill { handoff, request, lease_ns } => {
                let id = request.id;
                let r = core.submit_handoff_prefill(handoff, request, lease_ns, now);
                if r.outcome.is_err() {
                    self.source_left_core(handoff)?; // refused: the core never held it
                }
                self.command_result(s, r, Some(handoff), Some(id))
            }
            Command::Reserve { handoff, request, deadline_ns } => {
                let r = core.reserve_destination(handoff, request, deadline_ns, now);
                self.command_result(s, r, Some(handoff), None)
            }
            Command::Activate(h) => {
                let r = core.activate_destination(h, now);
                self.command_result(s, r, Some(h), None)
            }
            Command::ReleaseSource(h, reason) => {
                let r = core.release_source(h, reason, now);
                self.command_result(s, r, Some(h), None)
            }
            Command::CancelSource(h, reason) => {
                let r = core.cancel_source(h, reason, now);
                self.command_result(s, r, Some(h), None)?;
                // The core no longer computes this prefill (it ended it, or released the pin
                // the step in flight made).
                self.source_left_core(h)
            }
            Command::CancelDestination(h, reason) => {
                // The core's cancel names a cause; an expired reservation is canceled as expired.
                let reason = match reason {
                    EndReason::Canceled(r) => r,
                    EndReason::Expired => CancelReason::Expired,
                    EndReason::Success => CancelReason::TransferFailed,
                };
                let r = core.cancel_destination(h, reason, now);
                self.command_result(s, r, Some(h), None)
            }
        }
    }

    /// A dispatched prefill the core no longer computes (ended or refused; a pin is tracked in
    /// `pinned` instead): the prefill booking of a request that already ended is freed now.
    fn source_left_core(&mut self, h: HandoffId) -> Result<(), ReplayError> {
        if !self.computing.remove(&h) || self.pinned.contains(&h) {
            return Ok(());
        }
        if let Some(req) = self.handoff_request.get(&h).copied() {
            if !self.guards.contains_key(&req) {
                if let Some(f) = self.prefill_router.free_prefill(req) {
                    self.emit_router(self.now_ns, f)?;
                }
            }
        }
        self.forget_handoff(h);
        Ok(())
    }

    fn command_result(
        &mut self,
        s: usize,
        r: CommandResult,
        handoff: Option<HandoffId>,
        request: Option<RequestId>,
    ) -> Result<(), ReplayError> {
        self.apply_effects(s, r.effects)?;
        match r.outcome {
            Ok(CommandOutcome::Applied | CommandOutcome::NoOp | CommandOutcome::Unavailable) => Ok(()),
            Err(e) => self.command_failed(s, e, handoff, request),
        }
    }

    /// A command the core refused: the handoff (or plain request) fails with a terminal outcome
    /// so every booking and every resource is released.
    fn command_failed(
        &mut self,
        s: usize,
        e: CommandError,
        handoff: Option<HandoffId>,
        request: Option<RequestId>,
    ) -> Result<(), ReplayError> {
        let reason = match e {
            CommandError::Unsupported { .. } => CancelReason::Unsupported,
            CommandError::NeverFits { .. } => CancelReason::DestinationRejected,
            // Unknown handoffs and invalid states mean an action raced a cleanup the core
            // already did: nothing to unwind.
            CommandError::UnknownHandoff(_)
            | CommandError::InvalidState { .. }
            | CommandError::DuplicateHandoff(_) => {
                tracing::debug!(worker = %self.slots[s].id, error = %e, "command refused");
                return Ok(());
            }
        };
        if let Some(req) = request.or_else(|| handoff.and_then(|h| self.handoff_request.get(&h).copied())) {
            if let Some(g) = self.guards.get_mut(&req) {
                g.fail_status = Some(TerminalStatus::Rejected);
            }
        }
        match handoff {
            Some(h) if self.slots[s].sources.contains_key(&h) => {
                self.source_event(s, h, SourceEvent::PrefillFailed { reason })?;
            }
            Some(h) if self.slots[s].destinations.contains_key(&h) => {
                self.destination_event(s, h, DestinationEvent::ReservationFailed { reason })?;
            }
            _ => {}
        }
        // Whatever the machines did, the request ends now (a no-op if they already ended it).
        if let Some(req) = request.or_else(|| handoff.and_then(|h| self.handoff_request.get(&h).copied())) {
            self.terminal(req, TerminalStatus::Rejected, 0)?;
        }
        Ok(())
    }

    fn apply_effects(&mut self, s: usize, mut effects: Effects) -> Result<(), ReplayError> {
        let now = self.now_ns;
        for f in effects.facts.drain(..) {
            self.emit(s, now, f)?;
        }
        for o in effects.outputs.drain(..) {
            self.on_output(s, o)?;
        }
        self.recycle_effects(effects);
        Ok(())
    }

    /// The emptied vectors wait for whichever core steps next: the most recently drained
    /// buffer is the one still in cache.
    fn recycle_effects(&mut self, mut effects: Effects) {
        if self.spare_effects.len() < self.slots.len() {
            effects.facts.clear();
            effects.outputs.clear();
            self.spare_effects.push(effects);
        }
    }

    /// Watches for a livelock the cores cannot see: a request that gets blocks for a chunk,
    /// then needs more than the worker can give while other requests hold their KV waiting
    /// behind it, is preempted, readmitted first, and so on forever, with virtual time
    /// advancing (so the zero-length-step guard never fires). Once one request has been
    /// preempted `LIVELOCK_PREEMPTIONS` times with no request on its worker finishing, pinning
    /// its prefill or getting its first token, for longer than every lifecycle timeout (so no
    /// lease, reservation or bootstrap expiry can still free anything), the run stops and
    /// reports it as stuck.
    fn note_preemption(&mut self, slot: usize, request: RequestId, at_ns: u64) {
        // The same bound as the no-progress guard's: longer than every lifecycle timeout.
        let limit_ns = self.progress_limit_ns;
        let sl = &mut self.slots[slot];
        let s = match &mut sl.preemptions {
            Some(s) if s.request == request => s,
            streak => {
                *streak = Some(PreemptionStreak { request, since_ns: at_ns, count: 1 });
                return;
            }
        };
        s.count += 1;
        let (count, lasted_ns) = (s.count, at_ns.saturating_sub(s.since_ns));
        if count >= LIVELOCK_PREEMPTIONS && lasted_ns > limit_ns {
            let c = sl.core.snapshot();
            let v = sl.core.view();
            self.livelock = Some(format!(
                "{} livelocked: {request} was preempted {count} times over {:.1} s with no request on the worker making progress; it cannot get the KV it needs while others hold theirs ({} waiting, {} running, {} waiting for remote KV; KV {} active / {} pinned / {} reserved of {} blocks)",
                sl.id,
                lasted_ns as f64 / 1e9,
                v.waiting,
                v.running,
                v.waiting_for_remote_kv,
                c.active_blocks,
                c.pinned_source_blocks,
                c.reserved_destination_blocks,
                c.total_blocks
            ));
        }
    }

    // ----- quiet runs (see `QuietRun`) -----

    /// A quiet run starting with the step just taken (`out`, begun at `now`), if that step
    /// wrote one fact and no output (so the fact can wait for its boundary like the others) and
    /// the core promises quiet steps after it.
    fn quiet_run(&self, s: usize, now: u64, out: &StepOutput) -> Option<QuietRun> {
        // Cheap refusals first: this is asked after every step.
        let [first @ Fact::StepExecuted { .. }] = out.effects.facts.as_slice() else {
            return None;
        };
        if !out.effects.outputs.is_empty() {
            return None;
        }
        let rest = self.slots[s].core.quiet_steps()?;
        // A step takes time (a zero-length one is the kick loop's business).
        let zero = match &rest.durations {
            QuietDurations::Same(ns) => *ns == 0,
            QuietDurations::Each(d) => d.contains(&0),
        };
        if zero {
            return None;
        }
        Some(QuietRun::new(self.slots[s].id, now, first.clone(), out.duration_ns, rest))
    }

    /// Writes every quiet step's fact whose boundary comes before `(at_ns, rank)` in the
    /// queue's order (boundaries rank by worker), across workers in that same order.
    fn write_quiet_until(&mut self, at_ns: u64, rank: usize) -> Result<(), ReplayError> {
        loop {
            let mut best = (u64::MAX, usize::MAX);
            for (i, &t) in self.quiet.next_at.iter().enumerate() {
                if t < best.0 {
                    best = (t, i);
                }
            }
            if best >= (at_ns, rank) {
                // `best` is the minimum of `next_at`.
                self.quiet.earliest_ns = best.0;
                return Ok(());
            }
            let (t, s) = best;
            let Some(q) = self.quiet.runs[s].as_mut() else {
                return Err(ReplayError::Engine(format!("quiet run of slot {s} vanished")));
            };
            q.written += 1;
            let (worker, fact) = (q.worker, q.fact_of(q.written));
            // `earliest_ns` is brought up to date when the loop ends.
            self.quiet.next_at[s] = q.next_due_ns();
            self.events += 1;
            self.quiet.coalesced += 1;
            self.sink.push(worker, t, fact)?;
        }
    }

    /// The run's last boundary popped: the earlier facts are written; apply the run to the
    /// core and write the last step's fact.
    fn finish_quiet(&mut self, s: usize, q: QuietRun) -> Result<(), ReplayError> {
        self.quiet.refresh(s);
        if q.written + 1 != q.steps || q.end_of(q.steps) != self.now_ns {
            return Err(ReplayError::Engine(format!(
                "{}: quiet run out of step ({} of {} written at t={} ns)",
                q.worker, q.written, q.steps, self.now_ns
            )));
        }
        self.slots[s].core.advance_quiet(q.steps - 1);
        self.sink.push(q.worker, self.now_ns, q.fact_of(q.steps))
    }

    /// A command reached the worker mid-run, at `now`: every step that ended by now has its
    /// fact written, and the steps begun by now (one more) are applied; the one in flight
    /// becomes an ordinary pending step whose boundary is its end.
    fn cut_quiet(&mut self, s: usize, q: QuietRun) -> Result<(), ReplayError> {
        self.quiet.refresh(s);
        let ended = q.written;
        if ended >= 1 && q.end_of(ended) == self.now_ns {
            // A step ended at this very instant and the next one would only start after
            // everything due now (a step start ranks last): the worker is free, as it would be
            // stepping one boundary at a time. Apply the steps that ran and take back the run's
            // last boundary; the command is applied at once and the worker starts again later
            // in this instant.
            if !self.queue.cancel_lane(s) {
                return Err(ReplayError::Engine(format!(
                    "{}: quiet run cut out of step (no boundary queued at t={} ns)",
                    q.worker, self.now_ns
                )));
            }
            self.slots[s].core.advance_quiet(ended - 1);
            self.slots[s].busy = false;
            self.queue.push_start(s, self.now_ns);
            return Ok(());
        }
        let in_flight_end = q.end_of(ended + 1);
        if ended >= q.steps || in_flight_end <= self.now_ns || !self.queue.move_lane(s, in_flight_end) {
            return Err(ReplayError::Engine(format!(
                "{}: quiet run cut out of step ({} of {} written at t={} ns)",
                q.worker, q.written, q.steps, self.now_ns
            )));
        }
        self.slots[s].core.advance_quiet(ended);
        let mut fx = self.spare_effects.pop().unwrap_or_default();
        fx.facts.push(q.fact_of(ended + 1));
        self.slots[s].pending = Some(fx);
        Ok(())
    }

    fn on_output(&mut self, s: usize, o: EngineOutput) -> Result<(), ReplayError> {
        let now = self.now_ns;
        match o {
            EngineOutput::FirstToken { request } => {
                // The user's first token comes from decode (a prefill worker's is its own).
                if self.planner.is_some() && self.slots[s].id.role != Role::Prefill {
                    if let Some(g) = self.guards.get_mut(&request) {
                        g.first_token_ns.get_or_insert(now);
                    }
                }
                // Aggregated: prefill compute ends with the first token.
                if self.policy == HandoffPolicy::Disabled {
                    if let Some(f) = self.prefill_router.prefill_compute_done(request) {
                        self.emit_router(now, f)?;
                    }
                }
            }
            EngineOutput::Finished { request, status, output_tokens }
                if status == TerminalStatus::Completed && self.disabled_prefill(s) =>
            {
                let _ = output_tokens; // the one token a disaggregated prefill makes
                self.prefill_finished_unpinned(request)?;
            }
            EngineOutput::Finished { request, status, output_tokens } => {
                if let Some(h) = self.guards.get(&request).and_then(|g| g.handoff) {
                    if self.slots[s].destinations.contains_key(&h) {
                        self.destination_event(s, h, DestinationEvent::RequestFinished)?;
                    }
                }
                self.terminal(request, status, output_tokens)?;
            }
            EngineOutput::Rejected { request, .. } => {
                self.terminal(request, TerminalStatus::Rejected, 0)?;
            }
            EngineOutput::SourcePinned { handoff, request, lease, blocks, deadline_ns } => {
                self.computing.remove(&handoff); // now a pin (tracked in `pinned`)
                if let Some(f) = self.prefill_router.prefill_compute_done(request) {
                    self.emit_router(now, f)?;
                }
                // Source-first: the decode is routed once the prefill is done and pinned.
                let needs_route = self.guards.get(&request).is_some_and(|g| g.decode.is_none());
                if needs_route && self.policy == HandoffPolicy::SourceFirst {
                    let req = self.guards[&request].request.clone();
                    let d_slot = self.route_decode(request, &req)?;
                    if let Some(g) = self.guards.get_mut(&request) {
                        g.decode = Some(d_slot);
                    }
                    self.start_destination(d_slot, handoff, &req, s)?;
                }
                self.source_event(s, handoff, SourceEvent::PrefillPinned { lease, blocks, deadline_ns })?;
            }
            EngineOutput::DestinationReserved { handoff, reservation, summary } => {
                self.destination_event(
                    s,
                    handoff,
                    DestinationEvent::Reserved {
                        reservation,
                        prefix_tokens: summary.prefix_tokens,
                        missing_tokens: summary.missing_tokens,
                    },
                )?;
            }
            EngineOutput::ReservationFailed { handoff, .. } => {
                if let Some(g) = self.handoff_request.get(&handoff).and_then(|r| self.guards.get_mut(r)) {
                    g.fail_status = Some(TerminalStatus::Rejected);
                }
                self.destination_event(
                    s,
                    handoff,
                    DestinationEvent::ReservationFailed { reason: CancelReason::DestinationRejected },
                )?;
                if let Some(req) = self.handoff_request.get(&handoff).copied() {
                    self.terminal(req, TerminalStatus::Rejected, 0)?;
                }
            }
        }
        Ok(())
    }

    /// A prefill worker under the Disabled policy on a disaggregated cluster.
    fn disabled_prefill(&self, s: usize) -> bool {
        self.policy == HandoffPolicy::Disabled && self.slots[s].id.role == Role::Prefill
    }

    /// Disabled policy: the prefill finished and freed its KV (its booking goes with it, as
    /// the old harness freed the prefill router's ownership at once); the decode router picks
    /// and books a worker, which gets the request once the whole prompt's modeled transfer
    /// time has passed — no reservation holds capacity for it meanwhile.
    fn prefill_finished_unpinned(&mut self, request: RequestId) -> Result<(), ReplayError> {
        let now = self.now_ns;
        if let Some(f) = self.prefill_router.free_prefill(request) {
            self.emit_router(now, f)?;
        }
        let Some(req) = self.guards.get(&request).map(|g| g.request.clone()) else {
            return Ok(());
        };
        let d_slot = self.route_decode(request, &req)?;
        if let Some(g) = self.guards.get_mut(&request) {
            g.decode = Some(d_slot);
        }
        let at = now.saturating_add(self.transfer.transfer_ns(req.input_tokens as u64));
        self.push(
            at,
            Event::Command { slot: d_slot, command: Command::SubmitPrefilled(req), then: Vec::new() },
        );
        Ok(())
    }

    // ----- NIC contention (see `contention`) -----

    /// Starts (or queues) a transfer in the contention model, from `from`'s NIC to slot `s`'s.
    fn start_shared_transfer(
        &mut self,
        s: usize,
        handoff: HandoffId,
        from: WorkerId,
        bytes: u64,
    ) -> Result<(), ReplayError> {
        let key = self.next_transfer_key;
        self.next_transfer_key += 1;
        let source = self.slot_of(from);
        if let Some(m) = self.contention.as_mut() {
            m.start(self.now_ns, key, source, s, bytes)
                .map_err(|e| ReplayError::Engine(format!("transfer: {e}")))?;
        }
        self.transfers.insert(key, (s, handoff));
        self.transfer_of.insert(handoff, key);
        self.arm_transfer_tick();
        Ok(())
    }

    /// A destination let go of its handoff: a transfer still queued or moving stops sharing.
    fn cancel_shared_transfer(&mut self, handoff: HandoffId) {
        let Some(key) = self.transfer_of.remove(&handoff) else { return };
        self.transfers.remove(&key);
        if let Some(m) = self.contention.as_mut() {
            m.cancel(self.now_ns, key);
        }
        self.arm_transfer_tick();
    }

    fn arm_transfer_tick(&mut self) {
        let due = self.contention.as_ref().and_then(|m| m.next_event_ns());
        arm(&mut self.queue, &mut self.tick_armed_ns, self.now_ns, due, Event::TransferTick);
    }

    fn on_transfer_tick(&mut self) -> Result<(), ReplayError> {
        let now = self.now_ns;
        if self.tick_armed_ns == Some(now) {
            self.tick_armed_ns = None;
        }
        let done = self.contention.as_mut().map(|m| m.advance(now)).unwrap_or_default();
        for c in done {
            let Some((slot, handoff)) = self.transfers.remove(&c.key) else { continue };
            self.transfer_of.remove(&handoff);
            let fact = Fact::TransferTiming {
                handoff,
                queued_ns: c.queued_ns,
                latency_ns: c.latency_ns,
                moving_ns: c.moving_ns,
            };
            self.emit(slot, now, fact)?;
            self.destination_event(slot, handoff, DestinationEvent::ReceiveCompleted)?;
        }
        self.arm_transfer_tick();
        Ok(())
    }

    // ----- role machines -----

    fn source_event(&mut self, s: usize, handoff: HandoffId, ev: SourceEvent) -> Result<(), ReplayError> {
        let now = self.now_ns;
        let Some(m) = self.slots[s].sources.get_mut(&handoff) else {
            return Ok(());
        };
        let t = match m.handle(ev, now) {
            Ok(t) => t,
            Err(e) => {
                if let SourceEvent::Message(msg) = ev {
                    let f = msg.rejected_fact(crate::events::MessageRejection::InvalidTransition);
                    self.emit(s, now, f)?;
                }
                tracing::debug!(error = %e, "source event refused");
                return Ok(());
            }
        };
        let released = m.is_released();
        let success =
            matches!(m.state(), crate::lifecycle::source::SourceState::Released { how: EndReason::Success });
        self.emit_all(s, now, t.facts)?;
        let mut batch = Batch::default();
        for a in t.actions {
            match a {
                SourceAction::DispatchPrefill { lease_ns } => {
                    let Some(req) = self.handoff_request.get(&handoff).and_then(|r| self.guards.get(r))
                    else {
                        continue;
                    };
                    let request = req.request.clone();
                    // From here the core may compute it: the booking stays (see `computing`).
                    self.computing.insert(handoff);
                    batch.command(s, Command::DispatchPrefill { handoff, request, lease_ns });
                }
                // The prefill booking is freed when the core reports the pin's release.
                SourceAction::ReleaseSource { reason, .. } => {
                    batch.command(s, Command::ReleaseSource(handoff, reason))
                }
                SourceAction::CancelPrefill { reason } => {
                    batch.command(s, Command::CancelSource(handoff, reason))
                }
                SourceAction::Send { to, message } => batch.message(self.slot_of(to), message),
                SourceAction::ScheduleLeaseTimer { deadline_ns } => {
                    self.push(deadline_ns.max(now), Event::LeaseTimer { slot: s, handoff });
                }
            }
        }
        self.push_all(batch.events);
        if released {
            self.slots[s].sources.remove(&handoff);
            if let Some(req) = self.handoff_request.get(&handoff).copied() {
                if !success {
                    self.fail_unless_activated(req)?;
                }
            }
            self.forget_handoff(handoff);
        }
        Ok(())
    }

    fn destination_event(
        &mut self,
        s: usize,
        handoff: HandoffId,
        ev: DestinationEvent,
    ) -> Result<(), ReplayError> {
        let now = self.now_ns;
        let Some(m) = self.slots[s].destinations.get_mut(&handoff) else {
            return Ok(());
        };
        let t = match m.handle(ev, now) {
            Ok(t) => t,
            Err(e) => {
                if let DestinationEvent::Message(msg) = ev {
                    let f = msg.rejected_fact(crate::events::MessageRejection::InvalidTransition);
                    self.emit(s, now, f)?;
                }
                tracing::debug!(error = %e, "destination event refused");
                return Ok(());
            }
        };
        let released = m.is_released();
        self.emit_all(s, now, t.facts)?;
        let mut batch = Batch::default();
        for a in t.actions {
            match a {
                DestinationAction::ReserveDestination { deadline_ns } => {
                    let Some(req) = self.handoff_request.get(&handoff).and_then(|r| self.guards.get(r))
                    else {
                        continue;
                    };
                    let request = req.request.clone();
                    batch.command(s, Command::Reserve { handoff, request, deadline_ns });
                }
                DestinationAction::StartReceive { from, missing_tokens, bytes } => {
                    if self.contention.is_some() {
                        self.start_shared_transfer(s, handoff, from, bytes)?;
                    } else {
                        let at = now.saturating_add(self.transfer.transfer_ns(missing_tokens as u64));
                        self.push(at, Event::TransferDone { slot: s, handoff });
                    }
                }
                DestinationAction::ActivateDestination { .. } => {
                    if let Some(req) = self.handoff_request.get(&handoff).copied() {
                        if let Some(g) = self.guards.get_mut(&req) {
                            g.activated = true;
                        }
                    }
                    batch.command(s, Command::Activate(handoff));
                }
                DestinationAction::ReleaseDestination { reason, .. } => {
                    batch.command(s, Command::CancelDestination(handoff, reason))
                }
                DestinationAction::AbortRequest { reason } => {
                    batch.command(s, Command::CancelDestination(handoff, EndReason::Canceled(reason)))
                }
                DestinationAction::Send { to, message } => batch.message(self.slot_of(to), message),
                DestinationAction::ScheduleReservationTimer { deadline_ns } => {
                    self.push(deadline_ns.max(now), Event::ReservationTimer { slot: s, handoff });
                }
            }
        }
        self.push_all(batch.events);
        if released {
            self.cancel_shared_transfer(handoff);
            self.slots[s].destinations.remove(&handoff);
            if let Some(req) = self.handoff_request.get(&handoff).copied() {
                self.fail_unless_activated(req)?;
            }
            self.forget_handoff(handoff);
        }
        Ok(())
    }

    /// A role ended its part of the handoff without success: unless decode already runs, the
    /// request ends (rejected if a core refused it, failed otherwise).
    fn fail_unless_activated(&mut self, req: RequestId) -> Result<(), ReplayError> {
        if self.faults.defer(req) {
            return Ok(()); // a fault is ending several roles; the outcome follows (fault_flush)
        }
        let Some(g) = self.guards.get(&req) else {
            return Ok(());
        };
        if g.activated {
            return Ok(());
        }
        let status = g.fail_status.unwrap_or(TerminalStatus::Failed);
        self.terminal(req, status, 0)
    }

    /// Drops the frontend's correlation once neither role holds the handoff.
    fn forget_handoff(&mut self, handoff: HandoffId) {
        let held = self
            .slots
            .iter()
            .any(|s| s.sources.contains_key(&handoff) || s.destinations.contains_key(&handoff));
        if held || self.pinned.contains(&handoff) || self.computing.contains(&handoff) {
            return;
        }
        if let Some(req) = self.handoff_request.get(&handoff) {
            if self.guards.contains_key(req) {
                return; // the request still runs (activated decode)
            }
        }
        self.handoff_request.remove(&handoff);
    }

    /// The destination's heartbeat: while it still waits to read, it renews the source lease.
    fn on_renew(&mut self, s: usize, handoff: HandoffId) -> Result<(), ReplayError> {
        let now = self.now_ns;
        let Some(m) = self.slots[s].destinations.get(&handoff) else {
            return Ok(());
        };
        if !matches!(m.state_name(), "NotRouted" | "Reserving" | "Reserved") {
            return Ok(());
        }
        self.destination_event(s, handoff, DestinationEvent::RenewLease)?;
        if let Some(renew) = self.cfg.lease_renew_ms {
            self.push(now.saturating_add(renew * NS_PER_MS), Event::RenewTimer { slot: s, handoff });
        }
        Ok(())
    }

    /// SGLang's bootstrap timeout: a prefill still waiting for its destination fails.
    fn on_bootstrap_timeout(&mut self, request: RequestId) -> Result<(), ReplayError> {
        let Some(g) = self.guards.get(&request) else {
            return Ok(());
        };
        let (Some(h), Some(p)) = (g.handoff, g.prefill) else {
            return Ok(());
        };
        let waiting = self.slots[p].sources.get(&h).is_some_and(|m| m.state_name() == "NotStarted");
        if waiting {
            self.source_event(p, h, SourceEvent::Cancelled { reason: CancelReason::BootstrapTimeout })?;
        }
        Ok(())
    }

    /// The request's terminal outcome: the frontend's guard frees its bookings exactly once.
    fn terminal(
        &mut self,
        request: RequestId,
        status: TerminalStatus,
        output_tokens: u32,
    ) -> Result<(), ReplayError> {
        let now = self.now_ns;
        let Some(g) = self.guards.remove(&request) else {
            return Ok(());
        };
        if let Some(p) = self.planner.as_mut() {
            // The same figures the report folds: TTFT, and TPOT for more than one token.
            if let (TerminalStatus::Completed, Some(first)) = (status, g.first_token_ns) {
                let ttft = first.saturating_sub(g.arrival_ns);
                let tpot =
                    (output_tokens > 1).then(|| now.saturating_sub(first) / u64::from(output_tokens - 1));
                p.record(now, ttft, tpot);
            }
        }
        if let Some(f) = self.prefill_router.prefill_compute_done(request) {
            self.emit_router(now, f)?;
        }
        // A pinned source keeps its prefill booking until it is released; a prefill the core
        // still computes keeps it until the core ends or releases it.
        let source_held = g.handoff.is_some_and(|h| self.pinned.contains(&h) || self.computing.contains(&h));
        if !source_held {
            if let Some(f) = self.prefill_router.free_prefill(request) {
                self.emit_router(now, f)?;
            }
        }
        // Aggregated serving books decode on its one router.
        let decode_router = match self.decode_router.as_mut() {
            Some(r) => r,
            None => &mut self.prefill_router,
        };
        if let Some(f) = decode_router.free_decode(request, status) {
            self.emit_router(now, f)?;
        }
        let kv = crate::events::KvDelta::ZERO;
        self.emit_router(now, Fact::RequestFinished { request, status, output_tokens, kv })?;
        if let Some(h) = g.handoff {
            // Anything still held for this handoff on either role is canceled.
            if status != TerminalStatus::Completed {
                for s in 0..self.slots.len() {
                    if self.slots[s].sources.contains_key(&h) {
                        self.source_event(
                            s,
                            h,
                            SourceEvent::Cancelled { reason: CancelReason::RequestAborted },
                        )?;
                    }
                    if self.slots[s].destinations.contains_key(&h) {
                        self.destination_event(
                            s,
                            h,
                            DestinationEvent::Cancelled { reason: CancelReason::RequestAborted },
                        )?;
                    }
                }
            }
            self.forget_handoff(h);
        }
        // The workload hears of every end: a session's next turn, a closed-loop slot.
        self.workload.on_terminal(request.0, status.into(), now)?;
        if self.held_back {
            self.held_back = false;
            self.arrival_armed_ns = Some(now);
            self.push(now, Event::Arrival);
        }
        self.arm_arrival();
        Ok(())
    }

    // ----- liveness -----

    fn diagnose(&self) -> Vec<String> {
        let mut out: Vec<String> = self.livelock.iter().cloned().collect();
        for slot in &self.slots {
            for (h, m) in &slot.sources {
                out.push(format!(
                    "handoff {h} ({}) source on {} stuck in {}: {}",
                    self.handoff_request.get(h).map(|r| r.to_string()).unwrap_or_default(),
                    slot.id,
                    m.state_name(),
                    match m.state_name() {
                        "NotStarted" => "waiting for the destination's reservation",
                        "Computing" => "waiting for the prefill to run",
                        "Pinned" => "pinned, waiting for a destination reservation",
                        "AwaitingReaderCompletion" => "pinned, waiting for reader completion",
                        _ => "waiting",
                    }
                ));
            }
            for (h, m) in &slot.destinations {
                out.push(format!(
                    "handoff {h} ({}) destination on {} stuck in {}: {}",
                    self.handoff_request.get(h).map(|r| r.to_string()).unwrap_or_default(),
                    slot.id,
                    m.state_name(),
                    match m.state_name() {
                        "Reserving" => "waiting in the reservation FIFO for capacity",
                        "Reserved" => "reserved, waiting for the source's KV",
                        "Receiving" => "waiting for the transfer to complete",
                        "Active" => "decoding",
                        _ => "waiting",
                    }
                ));
            }
            if slot.membership == Membership::Leaving {
                out.push(format!("{} was taken out of routing and never drained", slot.id));
            }
            if !slot.core.is_drained() {
                let v = slot.core.view();
                let c = slot.core.snapshot();
                out.push(format!(
                    "{} not drained: {} waiting, {} running, {} waiting for remote KV, {} held prefills, {} pending reservations; KV {} active / {} pinned / {} reserved of {} blocks",
                    slot.id, v.waiting, v.running, v.waiting_for_remote_kv, v.held_prefills, v.pending_reservations,
                    c.active_blocks, c.pinned_source_blocks, c.reserved_destination_blocks, c.total_blocks
                ));
            }
        }
        for (r, g) in &self.guards {
            let name =
                |slot: Option<usize>| slot.map_or("none".to_string(), |s| self.slots[s].id.to_string());
            out.push(format!(
                "{r} never reached a terminal outcome (prefill {}, decode {}, handoff {})",
                name(g.prefill),
                name(g.decode),
                g.handoff.map_or("none".to_string(), |h| h.to_string())
            ));
        }
        out
    }
}

/// The engine core of worker `w`, as the configuration gives its role.
fn make_core(w: WorkerId, cfg: &ReplayConfig) -> Result<Box<dyn EngineCore>, ReplayError> {
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

/// Queues `ev` for `due` (not before `now_ns`) unless one is queued for that instant or earlier
/// already (`armed`): an event that wakes a component whose next instant keeps moving (the
/// workload, the contention model) is queued once per instant, not once per change.
fn arm(queue: &mut EventQueue<Event>, armed: &mut Option<u64>, now_ns: u64, due: Option<u64>, ev: Event) {
    let Some(due) = due else { return };
    let at = due.max(now_ns);
    if armed.map_or(true, |a| at < a) {
        *armed = Some(at);
        queue.push(at, ev);
    }
}

fn header(
    run_id: uuid::Uuid,
    worker: WorkerId,
    cfg: &ReplayConfig,
    policy: HandoffPolicy,
    engine: EngineShape,
) -> StreamHeader {
    StreamHeader {
        run_id,
        worker,
        backend: cfg.backend,
        policy,
        clock: ClockDomain::Virtual,
        seed: cfg.seed,
        engine,
    }
}

// ----- scaling (plan, planner and semantics: scaling.rs) -----

impl Replay<'_> {
    fn on_planned_scale(&mut self, i: usize) -> Result<(), ReplayError> {
        let Some(e) = self.cfg.scale.get(i).copied() else {
            return Err(ReplayError::Engine(format!("scale[{i}] vanished from the plan")));
        };
        for (role, change) in [(Role::Prefill, e.prefill), (Role::Decode, e.decode)] {
            if change != 0 {
                self.scale_role(role, change, format!("planned (scale[{i}])"))?;
            }
        }
        Ok(())
    }

    fn on_planner_tick(&mut self) -> Result<(), ReplayError> {
        let now = self.now_ns;
        let active = (self.active_count(Role::Prefill), self.active_count(Role::Decode));
        let Some(planner) = self.planner.as_mut() else { return Ok(()) };
        let changes = planner.decide(now, active);
        let interval_ns = planner.interval_ns();
        for c in changes {
            if self.scale_role(c.role, c.change, c.reason)? != 0 {
                if let Some(p) = self.planner.as_mut() {
                    p.changed(c.role, now);
                }
            }
        }
        // Ticks never keep a run alive on their own: with nothing else queued, nothing can
        // happen any more but ticks.
        if !self.queue.is_empty() {
            self.push(now.saturating_add(interval_ns), Event::PlannerTick);
        }
        Ok(())
    }

    /// Workers of `role` that routers may select.
    fn active_count(&self, role: Role) -> u32 {
        let slots = if role == Role::Prefill { &self.prefill_slots } else { &self.decode_slots };
        slots.iter().filter(|s| self.slots[**s].membership == Membership::Active).count() as u32
    }

    /// Adds `change` workers of `role` (or takes `-change` out of routing), as far as the
    /// limits allow, and records the decision. Returns the change applied.
    fn scale_role(&mut self, role: Role, change: i32, mut reason: String) -> Result<i32, ReplayError> {
        let now = self.now_ns;
        let wanted = change.unsigned_abs();
        let mut workers = Vec::new();
        let mut refused = None;
        for k in 0..wanted {
            if change > 0 {
                match self.add_worker(role)? {
                    Some(w) => workers.push(w),
                    None => {
                        refused = Some(format!(
                            "{} of {wanted} additions refused: at most {} {} workers per run",
                            wanted - k,
                            crate::adapters::replay::config::MAX_WORKERS,
                            role_name(role)
                        ));
                        break;
                    }
                }
            } else {
                if self.active_count(role) <= 1 {
                    refused = Some(format!(
                        "{} of {wanted} removals refused: a role keeps at least one worker taking work",
                        wanted - k
                    ));
                    break;
                }
                workers.push(self.start_leaving(role)?);
            }
        }
        if let Some(r) = refused {
            reason.push_str("; ");
            reason.push_str(&r);
        }
        let applied = workers.len() as i32 * change.signum();
        let names: Vec<String> = workers.iter().map(|w| w.to_string()).collect();
        tracing::info!(at_ms = now as f64 / 1e6, role = role_name(role), applied, workers = ?names, %reason, "scaled");
        self.scaling.push(ScalingDecision {
            at_ms: now as f64 / 1e6,
            role: role_name(role),
            change: applied,
            reason,
            workers: names.into_iter().map(|worker| ScaledWorker { worker, left_at_ms: None }).collect(),
        });
        Ok(applied)
    }

    /// A worker joins now with the next index of its role: a new stream starting with
    /// `SessionStarted`, a lane, a NIC, and a place in its router. `None` when the role has
    /// had as many workers as a run may create.
    fn add_worker(&mut self, role: Role) -> Result<Option<WorkerId>, ReplayError> {
        let now = self.now_ns;
        let index = if role == Role::Prefill { self.prefill_slots.len() } else { self.decode_slots.len() };
        if index >= crate::adapters::replay::config::MAX_WORKERS as usize {
            return Ok(None);
        }
        let w = WorkerId { role, index: index as u32, dp_rank: 0 };
        let core = make_core(w, &self.cfg)?;
        let shape = core.shape();
        if shape.block_size != self.block_size {
            return Err(ReplayError::Engine(format!(
                "{w}: block size {} differs from other workers' {}",
                shape.block_size, self.block_size
            )));
        }
        self.sink.add_stream(header(self.run_id, w, &self.cfg, self.policy, shape));
        let s = self.slots.len();
        self.slots.push(Slot::new(w, core));
        if self.queue.add_lane() != s {
            return Err(ReplayError::Engine(format!("{w}: its lane and slot differ")));
        }
        self.quiet.runs.push(None);
        self.quiet.next_at.push(u64::MAX);
        if role == Role::Prefill {
            self.prefill_slots.push(s);
        } else {
            self.decode_slots.push(s);
        }
        if let (Some(m), TransferConfig::Bandwidth(link)) = (self.contention.as_mut(), &self.cfg.transfer) {
            // NICs are numbered as slots are.
            if m.add_nic(&self.cfg.contention, &w.to_string(), link) != s {
                return Err(ReplayError::Engine(format!("{w}: its NIC and slot differ")));
            }
        }
        self.emit(s, now, Fact::SessionStarted { generation: Generation(1) })?;
        self.router_of(role)?
            .add_worker(w)
            .map_err(|e| ReplayError::Engine(format!("adding {w} to its router: {e}")))?;
        Ok(Some(w))
    }

    fn router_of(&mut self, role: Role) -> Result<&mut Router, ReplayError> {
        match role {
            Role::Decode => {
                self.decode_router.as_mut().ok_or_else(|| ReplayError::Engine("no decode router".into()))
            }
            _ => Ok(&mut self.prefill_router),
        }
    }

    /// Takes the highest-indexed worker of `role` still taking work out of routing; it leaves
    /// once drained (see [`Replay::check_leaving`]).
    fn start_leaving(&mut self, role: Role) -> Result<WorkerId, ReplayError> {
        let slots = if role == Role::Prefill { &self.prefill_slots } else { &self.decode_slots };
        let Some(s) = slots.iter().rev().copied().find(|s| self.slots[*s].membership == Membership::Active)
        else {
            return Err(ReplayError::Engine(format!("no {} worker left to remove", role_name(role))));
        };
        let w = self.slots[s].id;
        self.slots[s].membership = Membership::Leaving;
        self.router_of(role)?
            .remove_worker(w)
            .map_err(|e| ReplayError::Engine(format!("taking {w} out of its router: {e}")))?;
        self.leaving.push(s);
        Ok(w)
    }

    /// Every leaving worker that holds nothing any more (no step, command, request, pin,
    /// reservation or booking) leaves now: `WorkerLeft` ends its stream.
    fn check_leaving(&mut self) -> Result<(), ReplayError> {
        let mut i = 0;
        while i < self.leaving.len() {
            let s = self.leaving[i];
            let slot = &self.slots[s];
            let router = if slot.id.role == Role::Decode {
                self.decode_router.as_ref()
            } else {
                Some(&self.prefill_router)
            };
            let drained = !slot.busy
                && slot.pending.is_none()
                && slot.inbox.is_empty()
                && slot.sources.is_empty()
                && slot.destinations.is_empty()
                && slot.core.is_drained()
                && router.map_or(true, |r| r.load(slot.id).is_zero());
            if !drained {
                i += 1;
                continue;
            }
            self.leaving.remove(i);
            let (now, generation) = (self.now_ns, slot.generation);
            self.emit(s, now, Fact::WorkerLeft { generation })?;
            self.slots[s].membership = Membership::Left { at_ns: now };
        }
        Ok(())
    }

    /// The decisions, with when each removed worker left.
    fn scaling_report(&mut self) -> Vec<ScalingDecision> {
        let mut out = std::mem::take(&mut self.scaling);
        for d in out.iter_mut().filter(|d| d.change < 0) {
            for w in &mut d.workers {
                let slot = w.worker.parse::<WorkerId>().ok().map(|id| self.slot_of(id));
                if let Some(Membership::Left { at_ns }) =
                    slot.and_then(|s| self.slots.get(s)).map(|s| s.membership)
                {
                    w.left_at_ms = Some(at_ns as f64 / 1e6);
                }
            }
        }
        out
    }
}

// ----- fault injection (plan and phases: faults.rs; semantics: docs/faults.md) -----

impl Replay<'_> {
    /// Applies the fault plan to a delivery: a lost channel drops it, a message from an older
    /// generation of a restarted sender is rejected as stale, a duplicate is queued behind it,
    /// a late-message fault keeps a copy. True when the delivery is consumed here.
    fn fault_intercepts(&mut self, ev: &Event) -> Result<bool, ReplayError> {
        let Event::Deliver { slot, msg } = ev else {
            return Ok(false);
        };
        let (slot, msg) = (*slot, *msg);
        let h = msg.handoff;
        if self.faults.lost_channels.contains(&h) {
            // The transport for this handoff is gone: the receiver never sees the message.
            tracing::debug!(handoff = %h, kind = ?msg.kind(), "message dropped: channel lost");
            return Ok(true);
        }
        if self.faults.restarted {
            // The receiver's transport saw the sender's session end (the disconnect that told it
            // PeerLost), so anything stamped with an older generation is from a dead incarnation.
            let sender = self.slot_of(msg.from);
            if self.slots.get(sender).is_some_and(|s| msg.generation < s.generation) {
                let f = msg.rejected_fact(crate::events::MessageRejection::StaleGeneration);
                self.emit(slot, self.now_ns, f)?;
                return Ok(true);
            }
        }
        if let Some(fault) = self.faults.duplicate_next.remove(&h) {
            let text = format!("{:?} to {} delivered twice", msg.kind(), self.slots[slot].id);
            self.faults.note(fault, text);
            self.push(self.now_ns, Event::Deliver { slot, msg });
        }
        if let Some(Late::Armed(fault)) = self.faults.late.get(&h).copied() {
            self.faults.late.insert(h, Late::Captured { fault, slot, msg });
        }
        Ok(false)
    }

    /// Runs at every event boundary while a plan exists: fires each armed fault whose phase
    /// holds now, and re-delivers late copies once their handoff is released on both roles.
    fn fault_boundary(&mut self) -> Result<(), ReplayError> {
        let now = self.now_ns;
        if !self.faults.late.is_empty() {
            let ready: Vec<(HandoffId, usize, usize, HandoffMessage)> = self
                .faults
                .late
                .iter()
                .filter_map(|(h, l)| match l {
                    Late::Captured { fault, slot, msg } if !self.fault_held(*h) => {
                        Some((*h, *fault, *slot, *msg))
                    }
                    _ => None,
                })
                .collect();
            for (h, fault, slot, msg) in ready {
                self.faults.late.insert(h, Late::Sent);
                let text = format!(
                    "{:?} to {} delivered again at t={:.3} ms, after both roles released the handoff",
                    msg.kind(),
                    self.slots[slot].id,
                    now as f64 / 1e6
                );
                self.faults.note(fault, text);
                self.push(now, Event::Deliver { slot, msg });
            }
        }
        if self.faults.armed.is_empty() {
            return Ok(());
        }
        // Requests are numbered in arrival order: only those that arrived can be in a phase.
        let arrived: Vec<RequestId> =
            self.faults.armed.range(..RequestId(self.arrivals)).map(|(r, _)| *r).collect();
        for r in arrived {
            let Some(pending) = self.faults.armed.get(&r).cloned() else {
                continue;
            };
            let (h, p, d) = match self.guards.get(&r) {
                Some(Guard { handoff: Some(h), prefill, decode, .. }) => (*h, *prefill, *decode),
                _ => {
                    for i in self.faults.armed.remove(&r).unwrap_or_default() {
                        self.faults.note(i, "the request ended before this phase".into());
                    }
                    continue;
                }
            };
            let s_state = p.and_then(|p| self.slots[p].sources.get(&h)).map(|m| m.state_name());
            let d_state = d.and_then(|d| self.slots[d].destinations.get(&h)).map(|m| m.state_name());
            let mut due = Vec::new();
            let mut rest = Vec::new();
            for &i in &pending {
                let spec = self.faults.reports[i].spec;
                let holds = spec.phase.holds(s_state, d_state, d.is_some());
                match (holds, self.faults.due_ns.get(&i).copied()) {
                    (true, None) if spec.delay_ms == 0 => due.push(i),
                    (true, None) => {
                        let at = now.saturating_add(spec.delay_ms.saturating_mul(NS_PER_MS));
                        self.faults.due_ns.insert(i, at);
                        self.push(at, Event::FaultTimer);
                        rest.push(i);
                    }
                    (true, Some(at)) if now >= at => due.push(i),
                    (true, Some(_)) | (false, None) => rest.push(i),
                    (false, Some(_)) => {
                        let text = "the handoff left the phase before the delay elapsed".to_string();
                        self.faults.note(i, text);
                    }
                }
            }
            if due.is_empty() && rest.len() == pending.len() {
                continue; // nothing changed
            }
            if rest.is_empty() {
                self.faults.armed.remove(&r);
            } else {
                self.faults.armed.insert(r, rest);
            }
            for i in due {
                self.fire_fault(i, r, h, p, d)?;
            }
        }
        Ok(())
    }

    /// Whether any role still holds the handoff.
    fn fault_held(&self, h: HandoffId) -> bool {
        self.slots.iter().any(|s| s.sources.contains_key(&h) || s.destinations.contains_key(&h))
    }

    fn fire_fault(
        &mut self,
        i: usize,
        request: RequestId,
        h: HandoffId,
        p: Option<usize>,
        d: Option<usize>,
    ) -> Result<(), ReplayError> {
        let now = self.now_ns;
        let spec = self.faults.reports[i].spec;
        self.faults.reports[i].fired_at_ns = Some(now);
        self.faults.reports[i].handoff = Some(h);
        tracing::info!(fault = %spec, handoff = %h, at_ms = now as f64 / 1e6, "fault fired");
        match spec.kind {
            FaultKind::Cancel => {
                // The frontend's abort: the request ends canceled and both roles cancel.
                self.terminal(request, TerminalStatus::Canceled, 0)?;
            }
            FaultKind::ChannelLoss => {
                self.faults.lost_channels.insert(h);
                self.faults.deferring = true;
                let mut told = Vec::new();
                if let Some(p) = p.filter(|p| self.slots[*p].sources.contains_key(&h)) {
                    self.source_event(p, h, SourceEvent::Cancelled { reason: CancelReason::PeerLost })?;
                    told.push(self.slots[p].id.to_string());
                }
                if let Some(d) = d.filter(|d| self.fault_live_destination(*d, h)) {
                    self.destination_event(
                        d,
                        h,
                        DestinationEvent::Cancelled { reason: CancelReason::PeerLost },
                    )?;
                    told.push(self.slots[d].id.to_string());
                }
                self.fault_flush()?;
                self.faults.note(i, format!("peer-lost delivered locally to [{}]", told.join(", ")));
            }
            FaultKind::RestartSource => match p {
                Some(p) => self.restart_worker(p, i)?,
                None => self.faults.note(i, "no source to restart".into()),
            },
            FaultKind::RestartDestination => match d {
                Some(d) => self.restart_worker(d, i)?,
                None => self.faults.note(i, "no destination to restart".into()),
            },
            FaultKind::DuplicateMessage => {
                self.faults.duplicate_next.insert(h, i);
            }
            FaultKind::LateMessage => {
                self.faults.late.insert(h, Late::Armed(i));
            }
        }
        Ok(())
    }

    /// A destination role that still holds handoff resources. An activated destination holds
    /// none (its reservation became ordinary decode KV), so a transport failure towards the
    /// source does not concern it, as a late source message does not.
    fn fault_live_destination(&self, d: usize, h: HandoffId) -> bool {
        self.slots[d].destinations.get(&h).is_some_and(|m| m.state_name() != "Active")
    }

    /// Ends the deferral a fault opened: each request whose roles it ended now gets its outcome.
    fn fault_flush(&mut self) -> Result<(), ReplayError> {
        self.faults.deferring = false;
        for r in std::mem::take(&mut self.faults.deferred) {
            self.fail_unless_activated(r)?;
        }
        Ok(())
    }

    /// The worker's session ends and a new one starts: a new generation, every handoff the old
    /// one held canceled locally (`OwnerLost`, its core frees the resources), each peer told by
    /// its transport (`PeerLost`) — never by a message from the dead incarnation.
    fn restart_worker(&mut self, s: usize, fault: usize) -> Result<(), ReplayError> {
        let now = self.now_ns;
        let generation = Generation(self.slots[s].generation.0.saturating_add(1));
        self.slots[s].generation = generation;
        self.faults.restarted = true;
        self.emit(s, now, Fact::SessionStarted { generation })?;
        self.faults.deferring = true;
        let sources: Vec<HandoffId> = self.slots[s].sources.keys().copied().collect();
        let destinations: Vec<HandoffId> = self.slots[s].destinations.keys().copied().collect();
        let mut peers = 0;
        for h in &sources {
            self.source_event(s, *h, SourceEvent::Cancelled { reason: CancelReason::OwnerLost })?;
            for ps in 0..self.slots.len() {
                if ps != s && self.fault_live_destination(ps, *h) {
                    let ev = DestinationEvent::Cancelled { reason: CancelReason::PeerLost };
                    self.destination_event(ps, *h, ev)?;
                    peers += 1;
                }
            }
        }
        for h in &destinations {
            self.destination_event(s, *h, DestinationEvent::Cancelled { reason: CancelReason::OwnerLost })?;
            for ps in 0..self.slots.len() {
                if ps != s && self.slots[ps].sources.contains_key(h) {
                    self.source_event(ps, *h, SourceEvent::Cancelled { reason: CancelReason::PeerLost })?;
                    peers += 1;
                }
            }
        }
        self.fault_flush()?;
        let text = format!(
            "{} restarted as generation {}: {} handoff roles canceled (owner-lost), {} peer roles canceled (peer-lost)",
            self.slots[s].id,
            generation.0,
            sources.len() + destinations.len(),
            peers
        );
        self.faults.note(fault, text);
        Ok(())
    }

    /// The plan's outcome at the end of the run: faults never fired say why.
    fn fault_reports(&mut self) -> Vec<FaultReport> {
        let arrived = self.arrivals;
        for (r, pending) in std::mem::take(&mut self.faults.armed) {
            for i in pending {
                let why = if r.0 >= arrived {
                    "no such request in the trace".to_string()
                } else {
                    "the phase was never reached before the run ended".to_string()
                };
                self.faults.note(i, why);
            }
        }
        let late: Vec<Late> = self.faults.late.values().copied().collect();
        for l in &late {
            match l {
                Late::Armed(i) => {
                    self.faults.note(*i, "no message of the handoff was delivered after the phase".into())
                }
                Late::Captured { fault, .. } => {
                    self.faults.note(*fault, "the handoff was never released on both roles".into())
                }
                Late::Sent => {}
            }
        }
        let leftover: Vec<usize> = self.faults.duplicate_next.values().copied().collect();
        for i in leftover {
            self.faults.note(i, "no message of the handoff was delivered after the phase".into());
        }
        let reports = std::mem::take(&mut self.faults.reports);
        for r in reports.iter().filter(|r| !r.fired()) {
            tracing::warn!("{r}");
        }
        reports
    }
}
