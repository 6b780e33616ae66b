//! The frontend's process in live mode: the runtime's [`Frontend`] on a wall clock, the
//! workload feeding it arrivals at their trace instants, and one TCP link per worker.
//!
//! It waits until every worker of the run has said hello, answers their clock probes, sends
//! the address book, and starts the model clock a moment later. Then it handles arrivals,
//! bootstrap timers and the workers' reports in stamp order (see `live`). A worker whose link
//! ends before its goodbye is lost: its requests fail, routing leaves it out, and every other
//! worker is told so it reclaims its side. When the trace is exhausted and no request is in
//! flight, every worker is asked to leave; each closes its stream and says goodbye.

use super::clock::ModelClock;
use super::link::{self, Link, LINK_QUEUE_FRAMES};
use super::schedule::{Hold, LagStats, Schedule};
use super::wire::{Frame, FrameBody, PeerAddress, WorkerSummary};
use super::{LiveError, LiveTiming};
use crate::adapters::replay::config::ReplayConfig;
use crate::adapters::replay::engine::{build_frontend, header, make_core};
use crate::adapters::replay::workload::Workload;
use crate::events::{layout::stream_file_name, EngineShape, Fact, StreamWriter};
use crate::ids::{ClockDomain, Generation, RequestId, WallClockSync, WorkerId};
use crate::projections::compare::RunDescription;
use crate::runtime::{Body, Endpoint, Envelope, Frontend, FrontendReady, ToFrontend};
use futures_util::StreamExt;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufWriter;
use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::codec::Framed;

const MAX_SCHEDULED: usize = 1 << 20;
const EVENT_QUEUE: usize = 1 << 14;
/// How long the model clock's origin lies after the last worker joined: time for every
/// worker's clock probes and its stream's first fact.
const START_LEAD: Duration = Duration::from_millis(300);
/// How long the frontend waits for every worker to join, and for each to leave at the end.
const JOIN_TIMEOUT: Duration = Duration::from_secs(60);
const LEAVE_TIMEOUT: Duration = Duration::from_secs(15);
const FLUSH_EVERY: Duration = Duration::from_millis(50);

/// A worker as it joined.
#[derive(Clone, Debug, serde::Serialize)]
pub struct JoinedWorker {
    pub worker: WorkerId,
    pub pid: u32,
    pub listen: String,
    pub metrics: Option<String>,
}

/// Told of every worker once all have joined.
pub type OnJoined = Box<dyn FnOnce(&[JoinedWorker]) + Send>;

/// What the frontend needs to run.
pub struct FrontendSetup {
    pub cfg: ReplayConfig,
    pub run_id: uuid::Uuid,
    pub description: RunDescription,
    pub timing: LiveTiming,
    pub out: PathBuf,
    pub workload: Workload,
    /// Told of every worker once all have joined (the launcher writes them down for tests and
    /// operators).
    pub on_joined: OnJoined,
}

/// How a live run ended at the frontend.
pub struct FrontendOutcome {
    pub summaries: BTreeMap<WorkerId, WorkerSummary>,
    /// Workers whose link ended before their goodbye, with why (a worker that came back and
    /// then left cleanly is in `rejoined` instead).
    pub lost: Vec<(WorkerId, String)>,
    /// Workers lost and restarted: why the earlier session was lost, and the session that
    /// took over (and left cleanly).
    pub rejoined: Vec<(WorkerId, String, Generation)>,
    pub lag: LagStats,
    pub arrivals: u64,
    pub trace_lines_read: u64,
    pub interrupted: bool,
    pub model_end_ns: u64,
}

/// What reaches the loop from the links. Worker events carry the session of the link they
/// came on: a restarted worker's old link may still report its end after the new one opened.
enum LinkEvent {
    Worker {
        from: WorkerId,
        generation: Generation,
        frame: Frame,
    },
    WorkerGone {
        worker: WorkerId,
        generation: Generation,
        why: String,
    },
    /// A worker said hello after the run began: a lost worker's restarted process.
    Rejoin {
        joined: JoinedWorker,
        link: Link,
    },
    Interrupt,
}

/// What every welcome says but the generation.
struct WelcomeParts {
    run_id: uuid::Uuid,
    config_json: String,
    timing: LiveTiming,
    trace_json: String,
}

enum Input {
    Arrival,
    BootstrapTimer(RequestId),
    FromWorker {
        from: WorkerId,
        message: ToFrontend,
    },
    /// The worker's session `generation` is gone.
    WorkerLost(WorkerId, Generation),
}

/// One worker's link and where it stands.
struct Member {
    to: Option<mpsc::Sender<Frame>>,
    generation: Generation,
    said_bye: bool,
}

pub fn run(listener: std::net::TcpListener, setup: FrontendSetup) -> Result<FrontendOutcome, LiveError> {
    // One I/O thread for the links; the frontend's loop runs on this thread (see `link`).
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| LiveError::Io(format!("starting the frontend's runtime: {e}")))?;
    let mut run = runtime.block_on(async move {
        listener.set_nonblocking(true).map_err(|e| LiveError::Io(e.to_string()))?;
        let listener = TcpListener::from_std(listener).map_err(|e| LiveError::Io(e.to_string()))?;
        join(listener, setup).await
    })?;
    let _context = runtime.enter();
    let outcome = run.run();
    // Closing every link lets each worker's last frames drain and the processes end.
    run.members.clear();
    outcome
}

/// Waits for every worker, welcomes them, and opens the router stream: the run is ready.
async fn join(listener: TcpListener, mut setup: FrontendSetup) -> Result<FrontendRun, LiveError> {
    let cfg = setup.cfg.clone();
    let workers = crate::adapters::replay::engine::starting_workers(&cfg);
    let block_size = block_size(&cfg, &workers)?;
    let policy = cfg.effective_policy();
    let frontend = build_frontend(&cfg, &workers, block_size, policy)?;
    let mut joined = accept_workers(&listener, &workers).await?;
    let config_json =
        serde_json::to_string(&cfg).map_err(|e| LiveError::Config(format!("configuration: {e}")))?;
    let welcome = WelcomeParts {
        run_id: setup.run_id,
        config_json,
        timing: setup.timing,
        trace_json: setup.description.to_json(),
    };
    for (j, link) in &mut joined {
        link::send_frame(link, welcome.frame(Generation(1)), &j.worker.to_string()).await?;
    }
    let list: Vec<JoinedWorker> = joined.iter().map(|(j, _)| j.clone()).collect();
    (std::mem::replace(&mut setup.on_joined, Box::new(|_| {})))(&list);
    let clock = ModelClock::new(Instant::now() + START_LEAD, setup.timing.time_scale);
    let router_shape = EngineShape { config_json: setup.description.to_json(), ..EngineShape::none() };
    // The frontend's clock is the reference the workers' probes read.
    let sync = WallClockSync { origin_unix_ns: clock.origin_unix_ns(), offset_ns: 0, uncertainty_ns: 0 };
    let router_header =
        header(setup.run_id, WorkerId::ROUTER, &cfg, policy, router_shape, ClockDomain::WallSynced(sync));
    let path = setup.out.join(stream_file_name(WorkerId::ROUTER));
    let stream = StreamWriter::create(&path, &router_header)?;
    FrontendRun::new(setup, frontend, clock, stream, joined, listener, welcome)
}

impl WelcomeParts {
    fn frame(&self, generation: Generation) -> FrameBody {
        FrameBody::Welcome {
            run_id: self.run_id,
            generation,
            config_json: self.config_json.clone(),
            timing: self.timing,
            trace_json: self.trace_json.clone(),
        }
    }
}

/// Keeps accepting once the run began: a lost worker's restarted process says hello here
/// (anything else is refused, as before the run).
fn spawn_rejoin_accept(listener: TcpListener, events: SyncSender<LinkEvent>) {
    link::spawn_accept_loop(listener, Duration::from_secs(5), move |link, address, first| match first {
        Ok(Frame { body: FrameBody::Hello { worker, listen, metrics, pid }, .. }) => {
            let listen = reachable(&listen, &address);
            let joined = JoinedWorker { worker, pid, listen, metrics };
            let _ = events.send(LinkEvent::Rejoin { joined, link });
        }
        Ok(other) => {
            tracing::warn!(%address, "refused a connection that did not say hello: {:?}", other.body)
        }
        Err(e) => tracing::warn!("refused a connection during the run: {e}"),
    });
}

/// Every worker shares one block size (the replay checks the same).
fn block_size(cfg: &ReplayConfig, workers: &[WorkerId]) -> Result<u32, LiveError> {
    let mut size = 0;
    for w in workers {
        let s = make_core(*w, cfg)?.shape().block_size;
        if size != 0 && s != size {
            return Err(LiveError::Config(format!("{w}: block size {s} differs from other workers' {size}")));
        }
        size = s;
    }
    Ok(size)
}

/// Accepts connections until every worker of the run has said hello.
async fn accept_workers(
    listener: &TcpListener,
    workers: &[WorkerId],
) -> Result<Vec<(JoinedWorker, Link)>, LiveError> {
    let mut joined: BTreeMap<WorkerId, (JoinedWorker, Link)> = BTreeMap::new();
    let until = tokio::time::Instant::now() + JOIN_TIMEOUT;
    while joined.len() < workers.len() {
        let accepted = tokio::time::timeout_at(until, listener.accept()).await;
        let (stream, address) = match accepted {
            Err(_) => {
                let missing: Vec<String> =
                    workers.iter().filter(|w| !joined.contains_key(w)).map(|w| w.to_string()).collect();
                return Err(LiveError::Config(format!(
                    "workers did not join within {} s: {}",
                    JOIN_TIMEOUT.as_secs(),
                    missing.join(", ")
                )));
            }
            Ok(Err(e)) => return Err(LiveError::Io(format!("accepting workers: {e}"))),
            Ok(Ok(x)) => x,
        };
        let _ = stream.set_nodelay(true);
        let peer = address.to_string();
        let mut link = Framed::new(stream, super::wire::LinkCodec::default());
        let hello = match link::next_frame(&mut link, Duration::from_secs(5), &peer).await {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!("refused a connection before the run: {e}");
                continue;
            }
        };
        let FrameBody::Hello { worker, listen, metrics, pid } = hello.body else {
            tracing::warn!(%peer, "refused a connection that did not say hello");
            continue;
        };
        if !workers.contains(&worker) || joined.contains_key(&worker) {
            tracing::warn!(%peer, %worker, "refused a worker this run does not have (or has already)");
            let why = format!("this run has no {worker}, or has one already");
            let _ = link::send_frame(&mut link, FrameBody::Refused { why, retry_for_ms: None }, &peer).await;
            continue;
        }
        // A worker listening on every interface is reached at the address it came from.
        let listen = reachable(&listen, &address);
        joined.insert(worker, (JoinedWorker { worker, pid, listen, metrics }, link));
    }
    Ok(joined.into_values().collect())
}

fn reachable(listen: &str, from: &std::net::SocketAddr) -> String {
    match listen.parse::<std::net::SocketAddr>() {
        Ok(a) if a.ip().is_unspecified() => std::net::SocketAddr::new(from.ip(), a.port()).to_string(),
        _ => listen.to_string(),
    }
}

struct FrontendRun {
    frontend: Frontend,
    workload: Workload,
    clock: ModelClock,
    schedule: Schedule<Input>,
    stream: StreamWriter<BufWriter<File>>,
    events: Receiver<LinkEvent>,
    members: BTreeMap<WorkerId, Member>,
    book: Vec<PeerAddress>,
    arrival_armed_ns: Option<u64>,
    held_back: bool,
    arrivals: u64,
    shutting_down: Option<Instant>,
    summaries: BTreeMap<WorkerId, WorkerSummary>,
    lost: Vec<(WorkerId, String)>,
    flushed_at: Instant,
    interrupted: bool,
    events_in: SyncSender<LinkEvent>,
    timing: LiveTiming,
    welcome: WelcomeParts,
}

impl FrontendRun {
    fn new(
        setup: FrontendSetup,
        frontend: Frontend,
        clock: ModelClock,
        stream: StreamWriter<BufWriter<File>>,
        joined: Vec<(JoinedWorker, Link)>,
        listener: TcpListener,
        welcome: WelcomeParts,
    ) -> Result<Self, LiveError> {
        let (events_in, events) = sync_channel(EVENT_QUEUE);
        let mut members = BTreeMap::new();
        let mut book = Vec::new();
        for (j, link) in joined {
            book.push(PeerAddress { worker: j.worker, generation: Generation(1), address: j.listen.clone() });
            let to = open_link(j.worker, Generation(1), link, &setup.timing, &events_in);
            members.insert(j.worker, Member { to: Some(to), generation: Generation(1), said_bye: false });
        }
        spawn_interrupt(events_in.clone());
        spawn_rejoin_accept(listener, events_in.clone());
        Ok(FrontendRun {
            frontend,
            workload: setup.workload,
            clock,
            schedule: Schedule::new(&setup.timing, MAX_SCHEDULED),
            stream,
            events,
            members,
            book,
            arrival_armed_ns: None,
            held_back: false,
            arrivals: 0,
            shutting_down: None,
            summaries: BTreeMap::new(),
            lost: Vec::new(),
            flushed_at: Instant::now(),
            interrupted: false,
            events_in,
            timing: setup.timing,
            welcome,
        })
    }

    fn run(&mut self) -> Result<FrontendOutcome, LiveError> {
        let mut out = FrontendReady::default();
        self.frontend.start(&mut out);
        self.carry_out(0, out)?;
        self.arm_arrival()?;
        let mut arrived = Vec::new();
        loop {
            link::gather(&self.events, self.schedule.next_release(), FLUSH_EVERY, &mut arrived)?;
            for e in arrived.drain(..) {
                self.on_link_event(e)?;
            }
            self.handle_released()?;
            if self.flushed_at.elapsed() >= FLUSH_EVERY {
                self.stream.flush()?;
                self.flushed_at = Instant::now();
            }
            if self.finished() {
                return self.finish();
            }
        }
    }

    /// Hands out what is due, in stamp order.
    fn handle_released(&mut self) -> Result<(), LiveError> {
        let now = Instant::now();
        while let Some((at_ns, input)) = self.schedule.pop_released(now) {
            self.handle(at_ns, input)?;
        }
        Ok(())
    }

    /// Whether the run is over: every worker left (or was lost) after the shutdown, or the
    /// leave timeout ran out.
    fn finished(&mut self) -> bool {
        if self.shutting_down.is_none() && (self.interrupted || self.done()) {
            self.shutting_down = Some(Instant::now());
            for w in self.members.keys().copied().collect::<Vec<_>>() {
                if self.interrupted {
                    // Closing the link is the word: each worker cancels and leaves.
                    if let Some(m) = self.members.get_mut(&w) {
                        m.to = None;
                    }
                } else {
                    self.send(w, Frame::new(FrameBody::Shutdown));
                }
            }
        }
        let Some(since) = self.shutting_down else { return false };
        let all_gone = self.members.values().all(|m| m.said_bye || m.to.is_none());
        all_gone || since.elapsed() >= LEAVE_TIMEOUT
    }

    /// Trace exhausted, nothing in flight, nothing scheduled but stale timers.
    fn done(&self) -> bool {
        self.workload.is_exhausted() && self.frontend.in_flight() == 0 && self.arrival_armed_ns.is_none()
    }

    fn finish(&mut self) -> Result<FrontendOutcome, LiveError> {
        for (w, m) in &self.members {
            if !m.said_bye && m.to.is_some() {
                self.lost.push((
                    *w,
                    format!("did not leave within {} s of the shutdown", LEAVE_TIMEOUT.as_secs()),
                ));
            }
        }
        let at = self.stream.last_at_ns();
        if !self.interrupted {
            self.stream.append(at, &Fact::StreamEnded)?;
        }
        self.stream.sync_data()?;
        // Closing every link lets each worker's last frames drain and the processes end.
        for m in self.members.values_mut() {
            m.to = None;
        }
        // A worker that came back and then left cleanly ended drained: its loss is told apart.
        let (rejoined, lost): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.lost).into_iter().partition(|(w, _)| {
                self.members.get(w).is_some_and(|m| m.said_bye && m.generation > Generation(1))
            });
        let rejoined = rejoined.into_iter().map(|(w, why)| (w, why, self.members[&w].generation)).collect();
        Ok(FrontendOutcome {
            summaries: std::mem::take(&mut self.summaries),
            lost,
            rejoined,
            lag: self.schedule.stats,
            arrivals: self.arrivals,
            trace_lines_read: self.workload.trace_lines_read(),
            interrupted: self.interrupted,
            model_end_ns: at,
        })
    }

    fn on_link_event(&mut self, event: LinkEvent) -> Result<(), LiveError> {
        match event {
            LinkEvent::Interrupt => {
                tracing::warn!("interrupted: the workers are told to cancel and leave");
                self.interrupted = true;
                Ok(())
            }
            LinkEvent::WorkerGone { worker, generation, why } => {
                let Some(m) = self.members.get_mut(&worker) else { return Ok(()) };
                if m.said_bye || m.to.is_none() || m.generation != generation {
                    return Ok(());
                }
                m.to = None;
                tracing::warn!(%worker, "worker lost: {why}");
                self.lost.push((worker, why));
                let now = self.clock.now_ns();
                self.push(now, Hold::Message, Input::WorkerLost(worker, generation))
            }
            LinkEvent::Worker { from, generation, frame } => {
                if self.members.get(&from).is_some_and(|m| m.generation != generation) {
                    return Ok(()); // an earlier session's link
                }
                self.on_worker_frame(from, frame)
            }
            LinkEvent::Rejoin { joined, link } => {
                self.rejoin(joined, link);
                Ok(())
            }
        }
    }

    /// Why a hello from `worker` cannot be taken during the run, if it cannot, and for how long
    /// it may be said again: a stranger, a worker that left, any hello once the run is ending,
    /// and a worker whose session still counts as in the run (its old process may be dead
    /// with its link not yet found silent, which takes at most the silence limit).
    fn rejoin_refusal(&self, worker: WorkerId) -> Option<(&'static str, Option<Duration>)> {
        let Some(m) = self.members.get(&worker) else { return Some(("not a worker of this run", None)) };
        if self.shutting_down.is_some() {
            Some(("the run is ending", None))
        } else if m.said_bye {
            Some(("it left the run", None))
        } else if m.to.is_some() {
            let wait = self.timing.silence_limit() * 2 + Duration::from_secs(1);
            Some(("its session is still in the run", Some(wait)))
        } else {
            None
        }
    }

    /// A lost worker's restarted process said hello: it is welcomed under the next session,
    /// and every other worker learns where that session listens (before any work can be
    /// routed to it, which waits for its `SessionStarted` report). Its clock probes and its
    /// `Ready` are answered as at the start. Anything else is refused, saying why.
    fn rejoin(&mut self, joined: JoinedWorker, link: Link) {
        let worker = joined.worker;
        if let Some((why, retry_for)) = self.rejoin_refusal(worker) {
            tracing::warn!(%worker, pid = joined.pid, "refused a hello during the run: {why}");
            // Told to the worker too, so it can say why it stops (or try again a little later).
            let body = FrameBody::Refused {
                why: format!("{worker}: {why}"),
                retry_for_ms: retry_for.map(|d| d.as_millis() as u64),
            };
            tokio::spawn(async move {
                let mut link = link;
                let _ = link::send_frame(&mut link, body, &worker.to_string()).await;
            });
            return;
        }
        let generation = Generation(self.members[&worker].generation.0.saturating_add(1));
        let to = open_link(worker, generation, link, &self.timing, &self.events_in);
        if to.try_send(Frame::new(self.welcome.frame(generation))).is_err() {
            return tracing::warn!(%worker, "refused a hello during the run: its link closed at once");
        }
        self.members.insert(worker, Member { to: Some(to), generation, said_bye: false });
        let entry = PeerAddress { worker, generation, address: joined.listen.clone() };
        // Every member has its entry in the book from the start.
        if let Some(p) = self.book.iter_mut().find(|p| p.worker == worker) {
            *p = entry.clone();
        }
        for w in self.members.keys().copied().collect::<Vec<_>>() {
            if w != worker {
                self.send(w, Frame::new(FrameBody::Peers { peers: vec![entry.clone()] }));
            }
        }
        tracing::warn!(%worker, pid = joined.pid, "rejoined as session {}", generation.0);
    }

    fn on_worker_frame(&mut self, from: WorkerId, frame: Frame) -> Result<(), LiveError> {
        match frame.body {
            FrameBody::Probe { id } => {
                let model_ns = self.clock.model_at(Instant::now());
                let unix_ns = super::clock::unix_now_ns();
                self.send(from, Frame::new(FrameBody::ProbeAnswer { id, model_ns, unix_ns }));
                Ok(())
            }
            FrameBody::Ready => {
                // Its clock is set: the address book, before any work reaches it.
                self.send(from, Frame::new(FrameBody::Peers { peers: self.book.clone() }));
                Ok(())
            }
            FrameBody::Stamped {
                at_ns,
                cause_ns,
                envelope: Envelope { body: Body::ToFrontend(message), generation, .. },
            } => {
                let current = self.members.get(&from).map(|m| m.generation);
                if current.is_some_and(|g| generation < g) {
                    tracing::warn!(worker = %from, "dropped a report of an older session");
                    return Ok(());
                }
                let hold = Hold::Report { cause_ns, sender: sender_rank(from) };
                self.push(at_ns, hold, Input::FromWorker { from, message })
            }
            FrameBody::Bye { summary } => {
                if let Some(m) = self.members.get_mut(&from) {
                    m.said_bye = true;
                    m.to = None;
                }
                self.summaries.insert(from, summary);
                Ok(())
            }
            other => {
                tracing::warn!(worker = %from, "unexpected frame: {other:?}");
                Ok(())
            }
        }
    }

    fn push(&mut self, at_ns: u64, hold: Hold, input: Input) -> Result<(), LiveError> {
        self.schedule
            .push(&self.clock, at_ns, hold, input)
            .map_err(|e| LiveError::Runtime(format!("frontend: {e}")))
    }

    fn arm_arrival(&mut self) -> Result<(), LiveError> {
        let Some(due) = self.workload.next_due_ns() else { return Ok(()) };
        let at = due.max(self.schedule.last_ns());
        if self.arrival_armed_ns.map_or(true, |a| at < a) {
            self.arrival_armed_ns = Some(at);
            self.push(at, Hold::FrontendOwn, Input::Arrival)?;
        }
        Ok(())
    }

    fn handle(&mut self, at_ns: u64, input: Input) -> Result<(), LiveError> {
        let mut out = FrontendReady::default();
        match input {
            Input::Arrival => {
                if self.arrival_armed_ns == Some(at_ns) {
                    self.arrival_armed_ns = None;
                }
                if !self.frontend.can_admit() {
                    self.held_back = true;
                    return Ok(());
                }
                let due = self.workload.pop_due(at_ns).map_err(|e| LiveError::Config(e.to_string()))?;
                let Some(t) = due else { return self.arm_arrival() };
                self.arrivals += 1;
                self.arm_arrival()?;
                self.frontend.on_arrival(at_ns, t.to_request(), &mut out)?;
            }
            Input::BootstrapTimer(request) => self.frontend.on_bootstrap_timer(request, &mut out),
            Input::FromWorker { from, message } => self.frontend.on_worker(at_ns, from, message, &mut out)?,
            Input::WorkerLost(worker, generation) => {
                self.frontend.worker_lost(at_ns, worker, &mut out);
                for w in self.members.keys().copied().collect::<Vec<_>>() {
                    if w != worker {
                        self.send(w, Frame::new(FrameBody::WorkerLost { worker, generation }));
                    }
                }
            }
        }
        self.carry_out(at_ns, out)
    }

    fn carry_out(&mut self, at_ns: u64, out: FrontendReady) -> Result<(), LiveError> {
        for fact in &out.facts {
            self.stream.append(at_ns, fact)?;
        }
        for (due, request) in out.timers {
            self.push(due, Hold::FrontendOwn, Input::BootstrapTimer(request))?;
        }
        for (to, message) in out.sends {
            let envelope = Envelope::new(Endpoint::Frontend, Generation(1), Body::ToWorker(message));
            let cause_ns = self.schedule.last_queued_ns();
            if !self.send(to, Frame::new(FrameBody::Stamped { at_ns, cause_ns, envelope })) {
                // Work routed to a lost worker fails as the rest of its work did.
                let generation = self.members.get(&to).map_or(Generation(1), |m| m.generation);
                self.push(at_ns, Hold::Message, Input::WorkerLost(to, generation))?;
            }
        }
        for e in out.ended {
            self.workload
                .on_terminal(e.request.0, e.status.into(), at_ns)
                .map_err(|e| LiveError::Config(e.to_string()))?;
            if self.held_back {
                self.held_back = false;
                self.arrival_armed_ns = None;
                self.push(at_ns, Hold::Message, Input::Arrival)?;
                self.arrival_armed_ns = Some(at_ns);
            }
            self.arm_arrival()?;
        }
        Ok(())
    }

    /// Queues a frame for a worker; false when the worker is gone.
    fn send(&mut self, to: WorkerId, frame: Frame) -> bool {
        let Some(m) = self.members.get_mut(&to) else { return false };
        let Some(tx) = &m.to else { return false };
        if tx.try_send(frame).is_err() {
            tracing::warn!(worker = %to, "the worker's link is full or closed: it counts as lost");
            m.to = None;
            self.lost.push((to, "its link is full or closed".into()));
            return false;
        }
        true
    }
}

/// Starts a worker link's writer (with heartbeats) and reader; frames for it go to the sender.
fn open_link(
    worker: WorkerId,
    generation: Generation,
    link: Link,
    timing: &LiveTiming,
    events: &SyncSender<LinkEvent>,
) -> mpsc::Sender<Frame> {
    let (to, frames) = mpsc::channel(LINK_QUEUE_FRAMES);
    let (sink, source) = link.split();
    link::spawn_writer(sink, frames, timing.heartbeat_wall(), events.clone(), move |why| {
        LinkEvent::WorkerGone { worker, generation, why }
    });
    link::spawn_reader(
        source,
        timing.silence_limit(),
        events.clone(),
        move |frame| LinkEvent::Worker { from: worker, generation, frame },
        move |why| LinkEvent::WorkerGone { worker, generation, why },
    );
    to
}

/// Workers in slot order (prefill before decode, by index), after the frontend's own (0).
fn sender_rank(w: WorkerId) -> u32 {
    let role = match w.role {
        crate::ids::Role::Decode => 1u32,
        _ => 0,
    };
    1 + role * 1_000_000 + w.index
}

fn spawn_interrupt(events: SyncSender<LinkEvent>) {
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            let _ = events.send(LinkEvent::Interrupt);
        }
    });
}
