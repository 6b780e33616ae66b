//! A live worker process: one [`WorkerNode`] on a wall clock, its stream, its links.
//!
//! It joins the run at the frontend (hello, welcome with the configuration and its
//! generation, clock probes), opens its stream, and then handles its inputs in stamp order
//! ([`Schedule`]) as they are released: frontend messages, peer messages, its own step ends,
//! commands, timers and transfer ends. What the node produces goes out at once: facts to the
//! stream, messages over TCP, timers and steps into the schedule.
//!
//! A peer link that closes, breaks or goes silent for two heartbeats ends every handoff role
//! shared with that peer here (`PeerLost`), without a word from the peer. The frontend's link
//! ending (the launcher died, Ctrl-C, SIGTERM) cancels every handoff here; the worker keeps
//! stepping until it holds nothing, closes its stream and exits.

use super::clock::ModelClock;
use super::link::{self, Link, LINK_QUEUE_FRAMES};
use super::metrics::{DriverProgress, QueueDepths, WorkerGauges};
use super::schedule::{Hold, Schedule};
use super::wire::{Frame, FrameBody, LinkCodec, PeerAddress, WorkerSummary};
use super::{LiveError, LiveTiming};
use crate::adapters::replay::config::ReplayConfig;
use crate::adapters::replay::engine::{header, make_core, node_config};
use crate::adapters::replay::transfer::{TransferConfig, TransferModel};
use crate::events::MessageRejection;
use crate::events::{layout::stream_file_name, EngineShape, Fact, StreamWriter};
use crate::ids::{Backend, CancelReason, ClockDomain, Generation, HandoffId, WallClockSync, WorkerId};
use crate::lifecycle::messages::HandoffMessage;
use crate::runtime::{
    Body, DeferredCommand, Endpoint, Envelope, NodeTimer, Output, Ready, StepPlan, ToWorker, WorkerNode,
};
use futures_util::StreamExt;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufWriter;
use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::codec::Framed;

/// Inputs waiting in a worker's schedule, at most.
const MAX_SCHEDULED: usize = 1 << 20;
/// Link events waiting for the worker's loop, at most (readers wait when it is full).
const EVENT_QUEUE: usize = 1 << 14;
/// The stream is flushed at least this often, and at every terminal fact.
const FLUSH_EVERY: Duration = Duration::from_millis(50);
/// How long a leaving worker waits for its last handoffs to end before it says what is stuck.
const DRAIN_GRACE: Duration = Duration::from_secs(5);
/// Clock probes in the handshake; the one with the shortest round trip sets the clock.
const PROBES: u32 = 5;

/// How to start a worker process.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    pub worker: WorkerId,
    /// The frontend's address.
    pub frontend: String,
    /// Where this worker listens for its peers (`127.0.0.1:0`: any free port).
    pub listen: String,
    /// Where to serve `/metrics` (none when `None`).
    pub metrics: Option<String>,
    /// The run directory for this worker's stream.
    pub out: PathBuf,
}

/// Runs a worker until its run ends; returns what it reported at the end.
pub fn run(options: WorkerOptions) -> Result<WorkerSummary, LiveError> {
    // One I/O thread for the links; the node's loop runs on this thread (see `link`).
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| LiveError::Io(format!("starting the worker's runtime: {e}")))?;
    let mut worker = runtime.block_on(join(options))?;
    let _context = runtime.enter();
    let result = worker.run();
    // The goodbye and everything before it go out before the process ends.
    worker.to_frontend = None;
    if let Some(w) = worker.frontend_writer.take() {
        let _ = runtime.block_on(async { tokio::time::timeout(Duration::from_secs(5), w).await });
    }
    result
}

/// Joins the run: listeners, hello, welcome, clock probes; the worker is ready to start.
async fn join(options: WorkerOptions) -> Result<Worker, LiveError> {
    let listener = TcpListener::bind(&options.listen).await.map_err(|e| {
        LiveError::Io(format!("{}: listening for peers at {}: {e}", options.worker, options.listen))
    })?;
    let listen = listener.local_addr().map_err(|e| LiveError::Io(e.to_string()))?.to_string();
    let metrics_listener = match &options.metrics {
        Some(a) => {
            Some(TcpListener::bind(a).await.map_err(|e| LiveError::Io(format!("metrics at {a}: {e}")))?)
        }
        None => None,
    };
    let metrics_address = metrics_listener.as_ref().and_then(|l| l.local_addr().ok()).map(|a| a.to_string());
    let hello = FrameBody::Hello {
        worker: options.worker,
        listen,
        metrics: metrics_address,
        pid: std::process::id(),
    };
    let peer = format!("frontend {}", options.frontend);
    // An earlier session's stream is claimed before the hello: a process of this worker that
    // still runs (stopped, or cut off) keeps it, and two writers never share one file.
    let lock = claim_stream(&options.out.join(stream_file_name(options.worker))).await?;
    let (mut link, join) = say_hello(&options.frontend, hello, &peer).await?;
    let mut early = Vec::new();
    let (clock, sync) = probe_clock(&mut link, &join.timing, &peer, &mut early).await?;
    let mut worker = Worker::new(&options, join, clock, sync, link, listener, metrics_listener, lock)?;
    for frame in early {
        worker.on_frontend_frame(frame)?;
    }
    Ok(worker)
}

/// Connects to the frontend, retrying for a while: a launcher starts its workers before it
/// is sure to be listening, and a worker on another host may start first.
async fn connect_frontend(address: &str) -> Result<Link, LiveError> {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        match TcpStream::connect(address).await {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(Framed::new(s, LinkCodec::default()));
            }
            Err(e) if Instant::now() >= until => {
                return Err(LiveError::Link { peer: format!("frontend {address}"), what: e.to_string() })
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// Says hello until the frontend welcomes this worker, or refuses it for good. A refusal that
/// may pass (a restarted worker whose old session the frontend has not yet found dead) is
/// retried for as long as the frontend says.
async fn say_hello(address: &str, hello: FrameBody, peer: &str) -> Result<(Link, Join), LiveError> {
    let mut retry_until: Option<Instant> = None;
    loop {
        let mut link = connect_frontend(address).await?;
        link::send_frame(&mut link, hello.clone(), peer).await?;
        match join_run(&mut link, peer).await? {
            Answer::Welcome(join) => return Ok((link, join)),
            Answer::Refused { why, retry_for_ms } => {
                // The first refusal that may pass sets how long to keep trying; one that
                // cannot pass ends it.
                if retry_until.is_none() {
                    retry_until = retry_for_ms.map(|ms| Instant::now() + Duration::from_millis(ms));
                }
                if retry_for_ms.is_none() || retry_until.is_none_or(|u| Instant::now() >= u) {
                    return Err(LiveError::Config(format!("{peer} refused the hello: {why}")));
                }
                tracing::warn!("{peer} refused the hello for now ({why}); saying it again");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// How the frontend answered a hello.
enum Answer {
    Welcome(Join),
    Refused { why: String, retry_for_ms: Option<u64> },
}

/// What the frontend's welcome says.
struct Join {
    run_id: uuid::Uuid,
    generation: Generation,
    config: ReplayConfig,
    timing: LiveTiming,
    trace_json: String,
}

async fn join_run(link: &mut Link, peer: &str) -> Result<Answer, LiveError> {
    // The frontend answers once every worker of the run has joined.
    let frame = link::next_frame(link, Duration::from_secs(120), peer).await?;
    let (run_id, generation, config_json, timing, trace_json) = match frame.body {
        FrameBody::Welcome { run_id, generation, config_json, timing, trace_json } => {
            (run_id, generation, config_json, timing, trace_json)
        }
        FrameBody::Refused { why, retry_for_ms } => return Ok(Answer::Refused { why, retry_for_ms }),
        other => {
            return Err(LiveError::Link {
                peer: peer.into(),
                what: format!("expected a welcome, got {other:?}"),
            })
        }
    };
    let config: ReplayConfig = serde_json::from_str(&config_json)
        .map_err(|e| LiveError::Config(format!("{peer} sent a configuration this build cannot read: {e}")))?;
    config.validate().map_err(|e| LiveError::Config(e.to_string()))?;
    timing.validate()?;
    Ok(Answer::Welcome(Join { run_id, generation, config, timing, trace_json }))
}

/// Sets the model clock from the frontend's answers: the probe with the shortest round trip,
/// its answer taken as read halfway through. Returns the clock and how it was set (this
/// process's system clock against the frontend's, from the same probe, for the header).
async fn probe_clock(
    link: &mut Link,
    timing: &LiveTiming,
    peer: &str,
    early: &mut Vec<Frame>,
) -> Result<(ModelClock, WallClockSync), LiveError> {
    // Per probe: its round trip, the local instant and system time halfway, the answer.
    let mut best: Option<(Duration, Instant, i64, i64, i64)> = None;
    for id in 0..PROBES {
        let sent = Instant::now();
        let sent_unix_ns = super::clock::unix_now_ns();
        link::send_frame(link, FrameBody::Probe { id }, peer).await?;
        let (received, answered, model_ns, unix_ns) = loop {
            let frame = link::next_frame(link, Duration::from_secs(10), peer).await?;
            match frame.body {
                FrameBody::ProbeAnswer { id, model_ns, unix_ns } => {
                    break (Instant::now(), id, model_ns, unix_ns)
                }
                // The run may begin while this worker still probes: what came meanwhile is
                // handled once the loop runs.
                _ => early.push(frame),
            }
        };
        if answered != id {
            return Err(LiveError::Link {
                peer: peer.into(),
                what: format!("answered probe {answered}, not {id}"),
            });
        }
        let round_trip = received - sent;
        if best.map_or(true, |(b, ..)| round_trip < b) {
            let halfway_unix_ns = sent_unix_ns + (round_trip / 2).as_nanos() as i64;
            best = Some((round_trip, sent + round_trip / 2, model_ns, halfway_unix_ns, unix_ns));
        }
    }
    let (round_trip, at, model_ns, halfway_unix_ns, answer_unix_ns) =
        best.ok_or_else(|| LiveError::Runtime("no clock probe".into()))?;
    let clock = ModelClock::reading(at, model_ns, timing.time_scale);
    let sync = WallClockSync {
        origin_unix_ns: clock.origin_unix_ns(),
        offset_ns: halfway_unix_ns - answer_unix_ns,
        uncertainty_ns: (round_trip / 2).as_nanos() as u64,
    };
    Ok((clock, sync))
}

/// What reaches the worker's loop from its links.
enum LinkEvent {
    Frontend(Frame),
    FrontendGone(String),
    Peer { from: WorkerId, generation: Generation, frame: Frame },
    PeerGone { peer: WorkerId, generation: Generation, why: String },
    Terminate(&'static str),
}

/// One input in the schedule.
enum Input {
    FromFrontend(ToWorker),
    FromPeer { message: HandoffMessage },
    Command(DeferredCommand),
    Timer(NodeTimer),
    TransferDone(HandoffId),
    StepDone,
    StepStart,
    PeerLost(WorkerId),
}

/// Outgoing peer links, opened on first use.
struct PeerLinks {
    book: BTreeMap<WorkerId, PeerAddress>,
    links: BTreeMap<WorkerId, mpsc::Sender<Frame>>,
}

struct Worker {
    id: WorkerId,
    run_id: uuid::Uuid,
    node: WorkerNode,
    clock: ModelClock,
    timing: LiveTiming,
    schedule: Schedule<Input>,
    stream: StreamWriter<BufWriter<File>>,
    transfer: TransferConfig,
    events: Receiver<LinkEvent>,
    events_in: SyncSender<LinkEvent>,
    to_frontend: Option<mpsc::Sender<Frame>>,
    /// The frontend link's writer: awaited at the end so the goodbye is on the wire.
    frontend_writer: Option<tokio::task::JoinHandle<()>>,
    peers: PeerLinks,
    /// The newest session known of each peer.
    generations: BTreeMap<WorkerId, Generation>,
    /// The model instant the session starts at: 0 for the run's first sessions (the clock's
    /// origin), the takeover's instant for a restarted worker.
    start_ns: u64,
    /// Held for the process's life: no other process of this worker writes the stream.
    _stream_lock: File,
    step_queued: bool,
    flush_due: bool,
    flushed_at: Instant,
    /// Set once the run is over (`Shutdown`) or the frontend is gone: leave when drained.
    leaving: Option<(Instant, Option<String>)>,
    summary: WorkerSummary,
    gauges: Option<Arc<Mutex<(WorkerId, Backend, WorkerGauges)>>>,
    gauges_at: Instant,
}

impl Worker {
    fn new(
        options: &WorkerOptions,
        join: Join,
        clock: ModelClock,
        sync: WallClockSync,
        link: Link,
        listener: TcpListener,
        metrics: Option<TcpListener>,
        lock: Option<File>,
    ) -> Result<Self, LiveError> {
        let cfg = &join.config;
        let w = options.worker;
        let policy = cfg.effective_policy();
        let core = make_core(w, cfg)?;
        let mut shape: EngineShape = core.shape();
        if shape.config_json.is_empty() {
            shape.config_json = join.trace_json.clone();
        }
        let stream_header = header(join.run_id, w, cfg, policy, shape, ClockDomain::WallSynced(sync));
        std::fs::create_dir_all(&options.out)
            .map_err(|e| LiveError::Io(format!("{}: {e}", options.out.display())))?;
        let path = options.out.join(stream_file_name(w));
        let (stream, start_ns, lock) = match lock {
            Some(lock) if join.generation > Generation(1) => {
                let (stream, at) = take_over_stream(&path, w, &join, &clock)?;
                (stream, at, lock)
            }
            Some(_) => {
                return Err(LiveError::Config(format!(
                    "{}: a stream of {w} is there already",
                    path.display()
                )))
            }
            None if join.generation > Generation(1) => {
                return Err(LiveError::Config(format!(
                    "{w} rejoins as session {}, but {} (its earlier sessions' stream) is not there: \
                     start it with the --out its first process had",
                    join.generation.0,
                    path.display()
                )))
            }
            None => {
                let stream = StreamWriter::create(&path, &stream_header)?;
                let lock =
                    File::open(&path).map_err(|e| LiveError::Io(format!("{}: {e}", path.display())))?;
                lock.try_lock()
                    .map_err(|e| LiveError::Io(format!("{}: locking the stream: {e}", path.display())))?;
                (stream, 0, lock)
            }
        };
        let node = WorkerNode::new(w, core, node_config(cfg, policy)).with_generation(join.generation);
        let (events_in, events) = sync_channel(EVENT_QUEUE);
        let (sink, source) = link.split();
        let (to_frontend, frames) = mpsc::channel(LINK_QUEUE_FRAMES);
        let heartbeat = join.timing.heartbeat_wall();
        let frontend_writer =
            link::spawn_writer(sink, frames, heartbeat, events_in.clone(), LinkEvent::FrontendGone);
        link::spawn_reader(
            source,
            join.timing.silence_limit(),
            events_in.clone(),
            LinkEvent::Frontend,
            LinkEvent::FrontendGone,
        );
        spawn_accept(listener, join.run_id, join.timing, events_in.clone());
        spawn_signals(events_in.clone());
        let gauges = metrics.map(|l| {
            let state = Arc::new(Mutex::new((w, cfg.backend, WorkerGauges::default())));
            tokio::spawn(super::metrics::serve(l, state.clone()));
            state
        });
        let summary =
            WorkerSummary { clock_uncertainty_us: sync.uncertainty_ns / 1_000, ..WorkerSummary::default() };
        Ok(Worker {
            id: w,
            run_id: join.run_id,
            node,
            clock,
            timing: join.timing,
            schedule: Schedule::new(&join.timing, MAX_SCHEDULED),
            stream,
            transfer: cfg.transfer,
            events,
            events_in,
            to_frontend: Some(to_frontend),
            frontend_writer: Some(frontend_writer),
            peers: PeerLinks { book: BTreeMap::new(), links: BTreeMap::new() },
            generations: BTreeMap::new(),
            start_ns,
            _stream_lock: lock,
            step_queued: false,
            flush_due: false,
            flushed_at: Instant::now(),
            leaving: None,
            summary,
            gauges,
            gauges_at: Instant::now(),
        })
    }

    fn run(&mut self) -> Result<WorkerSummary, LiveError> {
        let mut ready = Ready::default();
        self.node.start(&mut ready);
        self.carry_out(self.start_ns, ready)?;
        self.send_frontend(FrameBody::Ready);
        let mut arrived = Vec::new();
        loop {
            link::gather(&self.events, self.schedule.next_release(), FLUSH_EVERY, &mut arrived)?;
            for e in arrived.drain(..) {
                self.on_link_event(e)?;
            }
            self.handle_released()?;
            self.housekeeping()?;
            if let Some(summary) = self.try_leave()? {
                return Ok(summary);
            }
        }
    }

    fn handle_released(&mut self) -> Result<(), LiveError> {
        let now = Instant::now();
        while let Some((at_ns, input)) = self.schedule.pop_released(now) {
            self.handle(at_ns, input)?;
        }
        Ok(())
    }

    fn housekeeping(&mut self) -> Result<(), LiveError> {
        if self.flush_due || self.flushed_at.elapsed() >= FLUSH_EVERY {
            self.stream.flush()?;
            self.flush_due = false;
            self.flushed_at = Instant::now();
        }
        if self.gauges.is_some() && self.gauges_at.elapsed() >= Duration::from_millis(50) {
            self.update_gauges();
        }
        Ok(())
    }

    fn update_gauges(&mut self) {
        self.gauges_at = Instant::now();
        let queues = QueueDepths {
            inbox_inputs: self.schedule.len(),
            outgoing_frames: self.outgoing_frames(),
            early_messages: self.node.early_messages(),
        };
        let mut g = WorkerGauges::observe(&self.node, queues);
        g.progress = DriverProgress {
            model_time_ms: self.schedule.last_ns() as f64 / 1e6,
            steps_total: self.summary.steps,
            facts_total: self.stream.next_seq(),
            late_inputs_total: self.schedule.stats.late,
            max_lateness_ms: self.schedule.stats.max_late_ns as f64 / 1e6,
        };
        if let Some(state) = &self.gauges {
            if let Ok(mut s) = state.lock() {
                s.2 = g;
            }
        }
    }

    fn outgoing_frames(&self) -> usize {
        let queued = |tx: &mpsc::Sender<Frame>| LINK_QUEUE_FRAMES - tx.capacity();
        self.to_frontend.as_ref().map_or(0, queued) + self.peers.links.values().map(queued).sum::<usize>()
    }

    // ---- link events ----

    fn on_link_event(&mut self, event: LinkEvent) -> Result<(), LiveError> {
        match event {
            LinkEvent::Frontend(frame) => self.on_frontend_frame(frame),
            LinkEvent::FrontendGone(why) => {
                self.frontend_gone(format!("the frontend's link ended: {why}"));
                Ok(())
            }
            LinkEvent::Terminate(signal) => {
                self.frontend_gone(format!("{signal} received"));
                Ok(())
            }
            LinkEvent::Peer { from, generation, frame } => self.on_peer_frame(from, generation, frame),
            LinkEvent::PeerGone { peer, generation, why } => {
                if self.generations.get(&peer).is_some_and(|g| *g > generation) {
                    return Ok(()); // an older session's link: the peer is back already
                }
                tracing::warn!(worker = %self.id, %peer, "peer link ended: {why}");
                self.peers.links.remove(&peer);
                self.push_now(Hold::Message, Input::PeerLost(peer))
            }
        }
    }

    fn on_frontend_frame(&mut self, frame: Frame) -> Result<(), LiveError> {
        match frame.body {
            FrameBody::Stamped { at_ns, envelope: Envelope { body: Body::ToWorker(m), .. }, .. } => {
                self.push(at_ns, Hold::Message, Input::FromFrontend(m))
            }
            FrameBody::Peers { peers } => {
                for p in peers {
                    self.note_generation(p.worker, p.generation);
                    if self.peers.book.get(&p.worker).is_some_and(|old| old.generation < p.generation) {
                        self.peers.links.remove(&p.worker);
                    }
                    self.peers.book.insert(p.worker, p);
                }
                Ok(())
            }
            FrameBody::WorkerLost { worker, generation } => {
                self.note_generation(worker, Generation(generation.0.saturating_add(1)));
                self.peers.links.remove(&worker);
                self.push_now(Hold::Message, Input::PeerLost(worker))
            }
            FrameBody::Shutdown => {
                if self.leaving.is_none() {
                    self.leaving = Some((Instant::now(), None));
                }
                Ok(())
            }
            other => {
                tracing::warn!(worker = %self.id, "the frontend sent an unexpected frame: {other:?}");
                Ok(())
            }
        }
    }

    fn on_peer_frame(
        &mut self,
        from: WorkerId,
        generation: Generation,
        frame: Frame,
    ) -> Result<(), LiveError> {
        let FrameBody::Stamped { at_ns, envelope, .. } = frame.body else {
            tracing::warn!(worker = %self.id, peer = %from, "unexpected frame from a peer: {:?}", frame.body);
            return Ok(());
        };
        let Body::Handoff(message) = envelope.body else {
            tracing::warn!(worker = %self.id, peer = %from, "a peer sent a non-handoff message");
            return Ok(());
        };
        let known = self.generations.get(&from).copied().unwrap_or(generation);
        if envelope.generation < known || generation < known {
            // An older incarnation of the peer: refused, never applied.
            let mut ready = Ready::default();
            self.node.refuse(message, MessageRejection::StaleGeneration, &mut ready);
            let at = self.schedule.last_ns();
            return self.carry_out(at, ready);
        }
        self.note_generation(from, envelope.generation);
        self.push(at_ns, Hold::Message, Input::FromPeer { message })
    }

    fn note_generation(&mut self, worker: WorkerId, generation: Generation) {
        let g = self.generations.entry(worker).or_insert(generation);
        *g = (*g).max(generation);
    }

    /// The frontend is gone: every handoff here is canceled, and the worker leaves once it
    /// holds nothing.
    fn frontend_gone(&mut self, why: String) {
        if matches!(self.leaving, Some((_, Some(_)))) {
            return;
        }
        tracing::warn!(worker = %self.id, "{why}; canceling every handoff and leaving");
        let mut handoffs: Vec<HandoffId> = self.node.source_roles().map(|(h, _, _)| h).collect();
        handoffs.extend(self.node.destination_roles().map(|(h, _, _)| h));
        for handoff in handoffs {
            let cancel = ToWorker::CancelHandoff { handoff, reason: CancelReason::RequestAborted };
            let _ = self.push_now(Hold::Message, Input::FromFrontend(cancel));
        }
        self.to_frontend = None;
        self.leaving = Some((Instant::now(), Some(why)));
    }

    fn push(&mut self, at_ns: u64, hold: Hold, input: Input) -> Result<(), LiveError> {
        self.schedule
            .push(&self.clock, at_ns, hold, input)
            .map_err(|e| LiveError::Runtime(format!("{}: {e}", self.id)))
    }

    fn push_now(&mut self, hold: Hold, input: Input) -> Result<(), LiveError> {
        let now = self.clock.now_ns();
        self.push(now, hold, input)
    }

    // ---- inputs ----

    fn handle(&mut self, at_ns: u64, input: Input) -> Result<(), LiveError> {
        let mut ready = Ready::default();
        match input {
            Input::FromFrontend(m) => self.node.on_frontend(at_ns, m, &mut ready)?,
            Input::FromPeer { message } => self.node.on_peer(at_ns, message, &mut ready),
            Input::Command(c) => self.node.apply_command(at_ns, c, &mut ready)?,
            Input::Timer(t) => self.node.on_timer(at_ns, t, &mut ready),
            Input::TransferDone(h) => self.node.on_transfer_done(at_ns, h, None, &mut ready),
            Input::StepDone => return self.step_done(at_ns),
            Input::StepStart => return self.step_start(at_ns),
            Input::PeerLost(peer) => {
                for h in self.node.handoffs_with(peer) {
                    self.node.on_peer_lost(at_ns, h, &mut ready);
                }
            }
        }
        self.carry_out(at_ns, ready)
    }

    fn step_done(&mut self, at_ns: u64) -> Result<(), LiveError> {
        let lag_us = Instant::now().saturating_duration_since(self.clock.wall_at(at_ns)).as_micros() as u64;
        self.summary.steps += 1;
        self.summary.step_end_lag_us_sum += lag_us;
        self.summary.step_end_lag_us_max = self.summary.step_end_lag_us_max.max(lag_us);
        let mut ready = Ready::default();
        self.node.finish_step(at_ns, &mut ready);
        self.carry_out(at_ns, ready)?;
        loop {
            let mut ready = Ready::default();
            let applied = self.node.apply_next_waiting(at_ns, &mut ready);
            self.carry_out(at_ns, ready)?;
            if !applied {
                break;
            }
        }
        self.queue_step(at_ns, Hold::StepStart)
    }

    fn queue_step(&mut self, at_ns: u64, hold: Hold) -> Result<(), LiveError> {
        if self.step_queued || self.node.is_busy() {
            return Ok(());
        }
        self.step_queued = true;
        self.push(at_ns, hold, Input::StepStart)
    }

    fn step_start(&mut self, at_ns: u64) -> Result<(), LiveError> {
        self.step_queued = false;
        loop {
            let mut ready = Ready::default();
            let plan = self.node.start_step(at_ns, false, &mut ready)?;
            self.carry_out(at_ns, ready)?;
            match plan {
                StepPlan::Idle => return Ok(()),
                StepPlan::Again => continue,
                StepPlan::Until { until_ns } => {
                    return self.push(until_ns, Hold::Own, Input::StepDone);
                }
                StepPlan::Quiet { .. } => {
                    return Err(LiveError::Runtime("a quiet run was planned, but live asks for none".into()))
                }
            }
        }
    }

    /// Facts to the stream, messages out, the rest into the schedule.
    fn carry_out(&mut self, at_ns: u64, ready: Ready) -> Result<(), LiveError> {
        for fact in &ready.facts {
            self.stream.append(at_ns, fact)?;
            if ends_something(fact) {
                self.flush_due = true;
            }
        }
        for output in ready.outputs {
            self.carry_output(at_ns, output)?;
        }
        Ok(())
    }

    fn carry_output(&mut self, at_ns: u64, output: Output) -> Result<(), LiveError> {
        match output {
            Output::ToFrontend(m) => {
                let envelope =
                    Envelope::new(Endpoint::Worker(self.id), self.node.generation(), Body::ToFrontend(m));
                let cause_ns = self.schedule.last_queued_ns();
                self.send_frontend(FrameBody::Stamped { at_ns, cause_ns, envelope });
            }
            Output::ToWorker { to, message } => {
                let envelope =
                    Envelope::new(Endpoint::Worker(self.id), self.node.generation(), Body::Handoff(message));
                let cause_ns = self.schedule.last_queued_ns();
                self.send_peer(to, Frame::new(FrameBody::Stamped { at_ns, cause_ns, envelope }));
            }
            Output::Command { at_ns: due, command } => {
                self.push(due.max(at_ns), Hold::Own, Input::Command(command))?
            }
            Output::Timer { at_ns: due, timer } => {
                self.push(due.max(at_ns), Hold::Own, Input::Timer(timer))?
            }
            Output::StartTransfer { handoff, missing_tokens, .. } => {
                let done = at_ns.saturating_add(self.transfer.transfer_ns(missing_tokens as u64));
                self.push(done, Hold::Own, Input::TransferDone(handoff))?;
            }
            // A transfer times itself out here; the destination ignores the end of one it let go.
            Output::CancelTransfer { .. } => {}
            Output::StepSoon => self.queue_step(at_ns, Hold::StepStartWoken)?,
        }
        Ok(())
    }

    fn send_frontend(&mut self, body: FrameBody) {
        let Some(tx) = &self.to_frontend else { return };
        if tx.try_send(Frame::new(body)).is_err() {
            // A frontend that takes nothing is as good as gone.
            self.frontend_gone("the frontend's link is full or closed".into());
        }
    }

    fn send_peer(&mut self, to: WorkerId, frame: Frame) {
        if !self.peers.links.contains_key(&to) {
            let Some(address) = self.peers.book.get(&to).cloned() else {
                tracing::warn!(worker = %self.id, peer = %to, "no address for the peer; its handoffs end");
                let _ = self.push_now(Hold::Message, Input::PeerLost(to));
                return;
            };
            let tx = self.open_peer_link(address);
            self.peers.links.insert(to, tx);
        }
        let Some(tx) = self.peers.links.get(&to) else { return };
        if tx.try_send(frame).is_err() {
            tracing::warn!(worker = %self.id, peer = %to, "the peer's link is full or closed");
            self.peers.links.remove(&to);
            let _ = self.push_now(Hold::Message, Input::PeerLost(to));
        }
    }

    fn open_peer_link(&self, address: PeerAddress) -> mpsc::Sender<Frame> {
        let (tx, rx) = mpsc::channel(LINK_QUEUE_FRAMES);
        let events = self.events_in.clone();
        let hello =
            FrameBody::PeerHello { run_id: self.run_id, worker: self.id, generation: self.node.generation() };
        let heartbeat = self.timing.heartbeat_wall();
        tokio::spawn(async move {
            let peer = address.worker;
            let generation = address.generation;
            let gone = move |why: String| LinkEvent::PeerGone { peer, generation, why };
            let connected =
                tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(&address.address)).await;
            let stream = match connected {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    return drop(events.send(gone(format!("connecting to {}: {e}", address.address))))
                }
                Err(_) => {
                    return drop(events.send(gone(format!("connecting to {} timed out", address.address))))
                }
            };
            let _ = stream.set_nodelay(true);
            let mut link = Framed::new(stream, LinkCodec::default());
            if let Err(e) = link::send_frame(&mut link, hello, &address.address).await {
                return drop(events.send(gone(e.to_string())));
            }
            let (sink, mut source) = link.split();
            // The peer never writes on this connection: reading only tells when it closes.
            let closed_events = events.clone();
            tokio::spawn(async move {
                while let Some(Ok(_)) = source.next().await {}
                let _ = closed_events.send(gone("connection closed".into()));
            });
            link::spawn_writer(sink, rx, heartbeat, events, gone).await.ok();
        });
        tx
    }

    /// Leaves once the run is over and nothing is held (or the grace ran out): the stream is
    /// closed with its end marker, and the frontend hears a last word.
    fn try_leave(&mut self) -> Result<Option<WorkerSummary>, LiveError> {
        let Some((since, why)) = &self.leaving else { return Ok(None) };
        let drained = self.node.holds_nothing();
        if !drained && since.elapsed() < DRAIN_GRACE {
            return Ok(None);
        }
        let why = why.clone();
        let at = self.stream.last_at_ns();
        self.stream.append(at, &Fact::StreamEnded)?;
        self.stream.sync_data()?;
        self.summary.drained = drained;
        self.summary.stuck = if drained { Vec::new() } else { self.stuck() };
        self.summary.lag = self.schedule.stats;
        self.summary.cpu_ms = process_cpu_ms();
        let summary = self.summary.clone();
        if let Some(why) = why {
            return Err(LiveError::Link {
                peer: "frontend".into(),
                what: format!("{why}; the stream is closed"),
            });
        }
        self.send_frontend(FrameBody::Bye { summary: summary.clone() });
        Ok(Some(summary))
    }

    fn stuck(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .node
            .source_roles()
            .map(|(h, r, s)| format!("{}: source of handoff {h} (request {}) is {s:?}", self.id, r.0))
            .collect();
        out.extend(
            self.node.destination_roles().map(|(h, r, s)| {
                format!("{}: destination of handoff {h} (request {}) is {s:?}", self.id, r.0)
            }),
        );
        if out.is_empty() {
            out.push(format!("{}: the engine still holds {}", self.id, self.node.core().snapshot()));
        }
        out
    }
}

/// How long a restarted worker waits for the process that held its stream to let it go (a
/// killed one lets go as it exits).
const CLAIM_WAIT: Duration = Duration::from_secs(3);

/// Locks the stream at `path` if there is one (`None` when there is none yet), waiting up to
/// [`CLAIM_WAIT`] for another process that holds it; still held then is an error naming it.
async fn claim_stream(path: &std::path::Path) -> Result<Option<File>, LiveError> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(LiveError::Io(format!("{}: {e}", path.display()))),
    };
    let until = Instant::now() + CLAIM_WAIT;
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(Some(file)),
            Err(std::fs::TryLockError::WouldBlock) if Instant::now() < until => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(LiveError::Config(format!(
                    "{}: held by another process of this worker that still runs; stop it first",
                    path.display()
                )))
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(LiveError::Io(format!("{}: locking the stream: {e}", path.display())))
            }
        }
    }
}

/// Continues the stream of this worker's earlier session for a restarted process (the
/// frontend welcomed it under a later generation). The stream must be this run's and this
/// worker's; it is read whole and folded, so the successor knows what the dead session held;
/// a torn tail (the kill cut a record) is cut off, any other damage refuses the takeover.
/// The stream then records the loss (`SessionLost`, returning all of it to free, and
/// `KvCleared`) at the model instant returned, which the new session starts at.
fn take_over_stream(
    path: &std::path::Path,
    w: WorkerId,
    join: &Join,
    clock: &ModelClock,
) -> Result<(StreamWriter<BufWriter<File>>, u64), LiveError> {
    let shown = path.display();
    let header = crate::events::StreamReader::open(path)?.header().clone();
    if header.run_id != join.run_id || header.worker != w {
        return Err(LiveError::Config(format!(
            "{shown}: the stream of {} in run {}, not of {w} in run {}",
            header.worker, header.run_id, join.run_id
        )));
    }
    let mut fold = crate::projections::worker::WorkerFold::new(&header).without_queues();
    let mut lost = Generation(1);
    let (mut stream, torn) = StreamWriter::open_append_observing(path, |rec| {
        if let Fact::SessionStarted { generation } = rec.fact {
            lost = generation;
        }
        // A contradiction is the dead session's own; the successor still starts clean.
        let _ = fold.apply(rec);
    })?;
    if lost >= join.generation {
        return Err(LiveError::Config(format!(
            "{shown}: {w}'s stream already has session {}; the frontend welcomed it as {}",
            lost.0, join.generation.0
        )));
    }
    if let Some(t) = torn {
        tracing::warn!(worker = %w, "{shown}: cut the torn tail the dead session left ({} bytes at offset {})", t.bytes, t.offset);
    }
    let at_ns = clock.now_ns().max(stream.last_at_ns());
    let kv = fold.capacity.release_all().ok_or_else(|| {
        LiveError::Config(format!("{shown}: the dead session held more blocks than a delta carries"))
    })?;
    stream.append(at_ns, &Fact::SessionLost { generation: lost, kv })?;
    stream.append(at_ns, &Fact::KvCleared)?;
    Ok((stream, at_ns))
}

/// A fact after which the stream is flushed at once: the end of a request or of a handoff's
/// hold on KV (what a post-mortem must not lose).
fn ends_something(fact: &Fact) -> bool {
    matches!(
        fact,
        Fact::RequestFinished { .. }
            | Fact::RequestRejected { .. }
            | Fact::SourceReleased { .. }
            | Fact::ReservationReleased { .. }
            | Fact::DestinationActivated { .. }
            | Fact::HandoffCanceled { .. }
            | Fact::SessionLost { .. }
    )
}

/// Accepts peers' connections: each must introduce itself for this run within a few seconds.
fn spawn_accept(
    listener: TcpListener,
    run_id: uuid::Uuid,
    timing: LiveTiming,
    events: SyncSender<LinkEvent>,
) {
    link::spawn_accept_loop(listener, Duration::from_secs(5), move |link, address, hello| {
        let (worker, generation) = match hello {
            Ok(Frame { body: FrameBody::PeerHello { run_id: r, worker, generation }, .. }) if r == run_id => {
                (worker, generation)
            }
            Ok(Frame { body: FrameBody::PeerHello { run_id: r, worker, .. }, .. }) => {
                return tracing::warn!(%address, %worker, "refused a peer of another run ({r})");
            }
            Ok(other) => {
                return tracing::warn!(%address, "refused a connection that did not introduce itself: {:?}", other.body);
            }
            Err(e) => return tracing::warn!("refused a connection: {e}"),
        };
        // The peer never reads on this connection: only the reading half is kept.
        let (_, source) = link.split();
        link::spawn_reader(
            source,
            timing.silence_limit(),
            events.clone(),
            move |frame| LinkEvent::Peer { from: worker, generation, frame },
            move |why| LinkEvent::PeerGone { peer: worker, generation, why: format!("{address}: {why}") },
        );
    });
}

/// SIGTERM and SIGINT end the worker as if its frontend were gone: it cancels what it holds,
/// closes its stream and exits.
fn spawn_signals(events: SyncSender<LinkEvent>) {
    tokio::spawn(async move {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let (Ok(mut term), Ok(mut int)) =
                (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
            else {
                return;
            };
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            let _ = events.send(LinkEvent::Terminate(name));
        }
        #[cfg(not(unix))]
        {
            if tokio::signal::ctrl_c().await.is_ok() {
                let _ = events.send(LinkEvent::Terminate("Ctrl-C"));
            }
        }
    });
}

/// CPU time (user + system) of this process so far, from /proc (Linux only).
pub fn process_cpu_ms() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    // USER_HZ is 100 on every Linux this runs on.
    Some(ticks * 10.0)
}
