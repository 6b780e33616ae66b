//! The Prometheus `/metrics` endpoint of one live worker.
//!
//! The driver owns the [`WorkerNode`] and, whenever it likes, stores a [`WorkerGauges`] (plain
//! numbers read off the node at one instant) in a shared slot; [`serve`] renders the latest one
//! for each scrape. The scrape path never touches the node, so a slow or hostile scraper cannot
//! stall the worker: it holds the slot's lock only to copy a few hundred bytes.
//!
//! # Names
//!
//! Everything is prefixed `handoff_` and carries the labels `worker` (`decode-0`) and `backend`
//! (`vllm`). Where the real engines export the same quantity, the name follows vLLM's:
//!
//! | here | vLLM | SGLang |
//! |---|---|---|
//! | `handoff_kv_usage_perc` | `vllm:kv_cache_usage_perc` (was `vllm:gpu_cache_usage_perc`) | `sglang:token_usage` |
//! | `handoff_num_requests_running` | `vllm:num_requests_running` | `sglang:num_running_reqs` |
//! | `handoff_num_requests_waiting` | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` |
//! | `handoff_kv_capacity_blocks`, `handoff_block_size_tokens` | the `num_gpu_blocks` and `block_size` labels of `vllm:cache_config_info` | — |
//!
//! Like vLLM's, `handoff_kv_usage_perc` is a fraction (1 means full) despite its name. It counts
//! what the proposal calls physically unavailable: active + pinned source + reserved
//! destination blocks; cached-free blocks are reusable and do not count.
//!
//! The rest has no counterpart in a single engine: the five KV block classes
//! (`handoff_kv_blocks{class}`, which sum to `handoff_kv_capacity_blocks`), request slots and
//! decode headroom, the disaggregation queues of the scheduler view, the worker's own queues
//! (`handoff_queue_depth{queue}`), its handoff roles by state (`handoff_handoffs{role,state}`,
//! every state present), its generation, and the driver's progress (model time, steps, facts,
//! late inputs).
//!
//! # Format
//!
//! The body is what prometheus-client's text encoder writes: OpenMetrics 1.0 text, so a
//! counter registered as `steps` is exposed as `handoff_steps_total` under `# TYPE
//! handoff_steps counter`, and the body ends with `# EOF`. It is served as
//! `application/openmetrics-text` (the content type the crate's own examples use), which
//! Prometheus asks for first; the classic `text/plain; version=0.0.4` would mislabel those
//! counter families. A gauge never ends in `_total`, which OpenMetrics reserves for counters
//! (hence `kv_capacity_blocks`, not `kv_blocks_total`).

use crate::ids::{Backend, WorkerId};
use crate::lifecycle::{DestinationState, SourceState};
use crate::runtime::WorkerNode;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::borrow::Cow;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::timeout;

/// The `state` label values of source roles, in [`SourceState`]'s order.
pub const SOURCE_STATES: [&str; 5] =
    ["not_started", "computing", "pinned", "awaiting_reader_completion", "released"];

/// The `state` label values of destination roles, in [`DestinationState`]'s order.
pub const DESTINATION_STATES: [&str; 6] =
    ["not_routed", "reserving", "reserved", "receiving", "active", "released"];

/// The content type of a `/metrics` reply (see the module docs for why not `text/plain`).
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The most connections served at once; one more is closed as soon as it is accepted.
pub const MAX_CONNECTIONS: usize = 16;

/// A request head (request line and headers) longer than this is refused.
const MAX_REQUEST_HEAD_BYTES: usize = 8 * 1024;
/// A client gets this long to send its whole request head.
const READ_TIMEOUT: Duration = Duration::from_secs(2);
/// A client that does not read its reply is dropped after this long.
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);
/// After replying, how long and how much of what the client still sends is read and dropped.
/// Closing a socket with unread input makes the kernel reset the connection, and a reset can
/// destroy the reply before the client has read it (a 400 to an oversized request, say).
const DRAIN_TIMEOUT: Duration = Duration::from_millis(500);
const MAX_DRAIN_BYTES: usize = 64 * 1024;
/// A failed accept (out of file descriptors, most often) is retried after this long, so a
/// lasting failure does not spin the loop.
const ACCEPT_RETRY_DELAY: Duration = Duration::from_millis(50);

/// The slot the driver writes and [`serve`] reads.
pub type SharedGauges = Arc<Mutex<(WorkerId, Backend, WorkerGauges)>>;

/// Queue depths the node does not know: the driver's own buffers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueDepths {
    /// Inputs received (frontend, peer, timer, transfer) not yet handed to the node.
    pub inbox_inputs: usize,
    /// Encoded frames waiting to be written to a peer or the frontend.
    pub outgoing_frames: usize,
    /// Peer messages that came before their handoff started (`WorkerNode::early_messages`, plus
    /// any the driver holds itself).
    pub early_messages: usize,
}

/// What the driver itself counts; [`WorkerGauges::observe`] leaves it at zero, so the driver
/// keeps its own and puts it back: `WorkerGauges { progress, ..WorkerGauges::observe(..) }`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DriverProgress {
    /// The instant of the node's latest input, on the run's clock.
    pub model_time_ms: f64,
    /// Engine steps finished.
    pub steps_total: u64,
    /// Facts written to the worker's stream.
    pub facts_total: u64,
    /// Inputs handed to the node after the instant they were due.
    pub late_inputs_total: u64,
    /// The most any input was late: how long after its due instant it reached the node.
    pub max_lateness_ms: f64,
}

/// One worker at one instant, as plain numbers (cheap to copy into the shared slot).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WorkerGauges {
    // The five block classes; they sum to `total_blocks`.
    pub active_blocks: u64,
    pub pinned_source_blocks: u64,
    pub reserved_destination_blocks: u64,
    pub cached_free_blocks: u64,
    pub free_blocks: u64,
    pub total_blocks: u64,
    pub block_size_tokens: u64,
    pub request_slots_used: u64,
    /// SGLang's request slots, or vLLM's running-sequence limit (`max_num_seqs`).
    pub request_slots_max: u64,
    /// Decode headroom promised to reservations.
    pub decode_headroom_tokens: u64,
    pub requests_running: u64,
    pub requests_waiting: u64,
    /// Reserved destinations waiting for their KV to arrive.
    pub requests_waiting_for_remote_kv: u64,
    /// Finished prefills whose KV is pinned for a reader.
    pub held_prefills: u64,
    /// Reservations waiting in the core's pending FIFO.
    pub pending_reservations: u64,
    pub generation: u64,
    pub inbox_inputs: u64,
    pub outgoing_frames: u64,
    pub early_messages: u64,
    /// Source roles on the node by state, indexed as [`SOURCE_STATES`].
    pub source_handoffs: [u64; SOURCE_STATES.len()],
    /// Destination roles on the node by state, indexed as [`DESTINATION_STATES`].
    pub destination_handoffs: [u64; DESTINATION_STATES.len()],
    pub progress: DriverProgress,
}

impl WorkerGauges {
    /// Reads `node` (its core's snapshot, view and shape; its generation and roles) and the
    /// driver's `queues`. Costs a walk over the node's roles and a copy of the engine's config
    /// text (`EngineCore::shape`).
    pub fn observe(node: &WorkerNode, queues: QueueDepths) -> WorkerGauges {
        let core = node.core();
        let kv = core.snapshot();
        let view = core.view();
        let shape = core.shape();
        WorkerGauges {
            active_blocks: kv.active_blocks,
            pinned_source_blocks: kv.pinned_source_blocks,
            reserved_destination_blocks: kv.reserved_destination_blocks,
            cached_free_blocks: kv.cached_free_blocks,
            free_blocks: kv.free_blocks,
            total_blocks: kv.total_blocks,
            block_size_tokens: u64::from(shape.block_size),
            request_slots_used: kv.request_slots_used,
            request_slots_max: u64::from(shape.max_request_slots),
            decode_headroom_tokens: kv.decode_headroom_tokens,
            requests_running: view.running,
            requests_waiting: view.waiting,
            requests_waiting_for_remote_kv: view.waiting_for_remote_kv,
            held_prefills: view.held_prefills,
            pending_reservations: view.pending_reservations,
            generation: u64::from(node.generation().0),
            inbox_inputs: queues.inbox_inputs as u64,
            outgoing_frames: queues.outgoing_frames as u64,
            early_messages: queues.early_messages as u64,
            source_handoffs: count_sources(node),
            destination_handoffs: count_destinations(node),
            progress: DriverProgress::default(),
        }
    }

    /// Physically unavailable blocks over all blocks (0 for a worker without blocks).
    pub fn kv_usage_fraction(&self) -> f64 {
        let used = self.active_blocks + self.pinned_source_blocks + self.reserved_destination_blocks;
        if self.total_blocks == 0 {
            return 0.0;
        }
        used as f64 / self.total_blocks as f64
    }
}

fn count_sources(node: &WorkerNode) -> [u64; SOURCE_STATES.len()] {
    let mut counts = [0; SOURCE_STATES.len()];
    for (_, _, state) in node.source_roles() {
        counts[source_state_index(state)] += 1;
    }
    counts
}

fn count_destinations(node: &WorkerNode) -> [u64; DESTINATION_STATES.len()] {
    let mut counts = [0; DESTINATION_STATES.len()];
    for (_, _, state) in node.destination_roles() {
        counts[destination_state_index(state)] += 1;
    }
    counts
}

// Exhaustive matches: a new state fails to compile here until it gets a label.
fn source_state_index(state: &SourceState) -> usize {
    match state {
        SourceState::NotStarted => 0,
        SourceState::Computing => 1,
        SourceState::Pinned { .. } => 2,
        SourceState::AwaitingReaderCompletion { .. } => 3,
        SourceState::Released { .. } => 4,
    }
}

fn destination_state_index(state: &DestinationState) -> usize {
    match state {
        DestinationState::NotRouted => 0,
        DestinationState::Reserving => 1,
        DestinationState::Reserved { .. } => 2,
        DestinationState::Receiving { .. } => 3,
        DestinationState::Active { .. } => 4,
        DestinationState::Released { .. } => 5,
    }
}

// ---- rendering ----

type UnsignedGauge = Gauge<u64, AtomicU64>;
type FloatGauge = Gauge<f64, AtomicU64>;
type Labels = Vec<(&'static str, &'static str)>;

/// The OpenMetrics text exposition of `g` (see the module docs for the names). A fresh
/// registry per scrape: the gauges are a copy, so there is nothing to keep between scrapes.
pub fn render(worker: WorkerId, backend: Backend, g: &WorkerGauges) -> String {
    let labels: [(Cow<'static, str>, Cow<'static, str>); 2] =
        [("worker".into(), worker.to_string().into()), ("backend".into(), backend.as_str().into())];
    let mut registry = Registry::with_prefix_and_labels("handoff", labels.into_iter());
    register_kv(&mut registry, g);
    register_scheduler(&mut registry, g);
    register_queues(&mut registry, g);
    register_handoffs(&mut registry, g);
    register_progress(&mut registry, &g.progress);
    let mut text = String::new();
    encode(&mut text, &registry).expect("writing to a String does not fail");
    text
}

fn register_kv(registry: &mut Registry, g: &WorkerGauges) {
    let classes = [
        ("active", g.active_blocks),
        ("pinned_source", g.pinned_source_blocks),
        ("reserved_destination", g.reserved_destination_blocks),
        ("cached_free", g.cached_free_blocks),
        ("free", g.free_blocks),
    ];
    let blocks = classes.map(|(class, value)| (vec![("class", class)], value));
    registry.register(
        "kv_blocks",
        "KV blocks by ownership class; the classes sum to the capacity",
        family(blocks),
    );
    registry.register("kv_capacity_blocks", "KV blocks on the worker", unsigned(g.total_blocks));
    registry.register("block_size_tokens", "Tokens per KV block", unsigned(g.block_size_tokens));
    registry.register(
        "kv_usage_perc",
        "KV usage: active, pinned source and reserved destination blocks over all blocks; 1 means full",
        float(g.kv_usage_fraction()),
    );
}

fn register_scheduler(registry: &mut Registry, g: &WorkerGauges) {
    let counts = [
        ("num_requests_running", "Requests running in the engine", g.requests_running),
        ("num_requests_waiting", "Requests waiting to be scheduled", g.requests_waiting),
        (
            "num_requests_waiting_for_remote_kv",
            "Reserved destinations waiting for their KV to arrive",
            g.requests_waiting_for_remote_kv,
        ),
        ("num_held_prefills", "Finished prefills whose KV is pinned for a reader", g.held_prefills),
        ("num_pending_reservations", "Destination reservations waiting for capacity", g.pending_reservations),
        ("request_slots_used", "Request slots in use", g.request_slots_used),
        (
            "request_slots_max",
            "Request slots (SGLang) or running-sequence limit (vLLM max_num_seqs)",
            g.request_slots_max,
        ),
        (
            "decode_headroom_tokens",
            "Decode headroom tokens promised to reservations",
            g.decode_headroom_tokens,
        ),
        ("generation", "Incarnation of the worker process; higher after a restart", g.generation),
    ];
    for (name, help, value) in counts {
        registry.register(name, help, unsigned(value));
    }
}

fn register_queues(registry: &mut Registry, g: &WorkerGauges) {
    let queues = [("inbox", g.inbox_inputs), ("outgoing", g.outgoing_frames), ("early", g.early_messages)];
    let depths = queues.map(|(queue, value)| (vec![("queue", queue)], value));
    registry.register(
        "queue_depth",
        "Items waiting in the worker's queues: inputs for the node, frames to send, messages before their handoff",
        family(depths),
    );
}

fn register_handoffs(registry: &mut Registry, g: &WorkerGauges) {
    let sources = SOURCE_STATES.iter().zip(g.source_handoffs);
    let destinations = DESTINATION_STATES.iter().zip(g.destination_handoffs);
    let roles = sources
        .map(|(state, value)| (vec![("role", "source"), ("state", *state)], value))
        .chain(destinations.map(|(state, value)| (vec![("role", "destination"), ("state", *state)], value)));
    registry.register("handoffs", "Handoff roles on the worker by role and state", family(roles));
}

fn register_progress(registry: &mut Registry, progress: &DriverProgress) {
    registry.register(
        "model_time_ms",
        "Instant of the node's latest input on the run's clock",
        float(progress.model_time_ms),
    );
    registry.register("steps", "Engine steps finished", counter(progress.steps_total));
    registry.register("facts", "Facts written to the worker's stream", counter(progress.facts_total));
    registry.register(
        "late_inputs",
        "Inputs handed to the node after their due instant",
        counter(progress.late_inputs_total),
    );
    registry.register(
        "max_lateness_ms",
        "Latest an input was handed to the node after its due instant",
        float(progress.max_lateness_ms),
    );
}

fn unsigned(value: u64) -> UnsignedGauge {
    let gauge = UnsignedGauge::default();
    gauge.set(value);
    gauge
}

fn float(value: f64) -> FloatGauge {
    let gauge = FloatGauge::default();
    gauge.set(value);
    gauge
}

fn counter(value: u64) -> Counter {
    let counter = Counter::default();
    counter.inc_by(value);
    counter
}

fn family(series: impl IntoIterator<Item = (Labels, u64)>) -> Family<Labels, UnsignedGauge> {
    let family = Family::<Labels, UnsignedGauge>::default();
    for (labels, value) in series {
        family.get_or_create(&labels).set(value);
    }
    family
}

// ---- serving ----

/// Serves `GET /metrics` on `listener` until this future is dropped (its task aborted), which
/// also drops every connection in progress. A minimal HTTP/1.1 server: one request per
/// connection, then `Connection: close`.
pub async fn serve(listener: TcpListener, state: SharedGauges) {
    let mut connections = JoinSet::new();
    loop {
        let accepted = listener.accept().await;
        reap(&mut connections);
        let (stream, peer) = match accepted {
            Ok(pair) => pair,
            Err(error) => {
                tracing::debug!(%error, "metrics: accept failed");
                tokio::time::sleep(ACCEPT_RETRY_DELAY).await;
                continue;
            }
        };
        if connections.len() >= MAX_CONNECTIONS {
            // Dropping the stream closes it.
            tracing::debug!(%peer, "metrics: too many connections, closed");
            continue;
        }
        let state = Arc::clone(&state);
        connections.spawn(async move { handle(stream, peer, &state).await });
    }
}

/// Forgets finished connections, so that `len` counts the live ones.
fn reap(connections: &mut JoinSet<()>) {
    while let Some(finished) = connections.try_join_next() {
        if let Err(error) = finished {
            tracing::debug!(%error, "metrics: connection task failed");
        }
    }
}

async fn handle(mut stream: TcpStream, peer: SocketAddr, state: &SharedGauges) {
    let response = match timeout(READ_TIMEOUT, read_head(&mut stream)).await {
        Err(_) => Response::plain(Status::RequestTimeout),
        Ok(Err(error)) => {
            tracing::debug!(%peer, %error, "metrics: reading the request failed");
            return;
        }
        Ok(Ok(Head::Closed)) => return,
        Ok(Ok(Head::TooLarge)) => Response::plain(Status::BadRequest),
        Ok(Ok(Head::Complete(head))) => respond(&head, state),
    };
    if response.status != Status::Ok {
        tracing::debug!(%peer, status = response.status.line(), "metrics: request refused");
    }
    if let Err(error) = send(&mut stream, response).await {
        tracing::debug!(%peer, %error, "metrics: writing the reply failed");
        return;
    }
    drain(&mut stream).await;
}

/// What reading a request head found.
enum Head {
    /// The bytes before the blank line that ends the head.
    Complete(Vec<u8>),
    /// [`MAX_REQUEST_HEAD_BYTES`] without a blank line.
    TooLarge,
    /// The client closed before finishing the head.
    Closed,
}

async fn read_head(stream: &mut TcpStream) -> io::Result<Head> {
    let mut head = vec![0; MAX_REQUEST_HEAD_BYTES];
    let mut filled = 0;
    while filled < head.len() {
        let read = stream.read(&mut head[filled..]).await?;
        if read == 0 {
            return Ok(Head::Closed);
        }
        // The blank line may straddle two reads.
        let searched_from = filled.saturating_sub(3);
        filled += read;
        if let Some(at) = find_blank_line(&head[searched_from..filled]) {
            head.truncate(searched_from + at);
            return Ok(Head::Complete(head));
        }
    }
    Ok(Head::TooLarge)
}

fn find_blank_line(bytes: &[u8]) -> Option<usize> {
    bytes.windows(4).position(|w| w == b"\r\n\r\n")
}

/// The reply to a complete request head.
fn respond(head: &[u8], state: &SharedGauges) -> Response {
    let Some((method, path)) = parse_head(head) else {
        return Response::plain(Status::BadRequest);
    };
    if path != "/metrics" {
        return Response::plain(Status::NotFound);
    }
    if method != "GET" {
        return Response::plain(Status::MethodNotAllowed);
    }
    // Copy under the lock, render outside it. A poisoned lock still holds whole numbers: the
    // slot is only ever assigned, so a panic elsewhere cannot leave it half written.
    let (worker, backend, gauges) = *state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    Response {
        status: Status::Ok,
        content_type: METRICS_CONTENT_TYPE,
        body: render(worker, backend, &gauges),
    }
}

/// The method and path (query dropped) of a well-formed head: a request line `METHOD SP
/// /target SP HTTP/1.x`, then header lines each with a colon, and no control characters.
fn parse_head(head: &[u8]) -> Option<(&str, &str)> {
    let text = std::str::from_utf8(head).ok()?;
    let mut lines = text.split("\r\n");
    let mut parts = lines.next()?.split(' ');
    let (method, target, version) = (parts.next()?, parts.next()?, parts.next()?);
    let well_formed = parts.next().is_none()
        && !method.is_empty()
        && method.bytes().all(|b| b.is_ascii_uppercase())
        && target.starts_with('/')
        && version.starts_with("HTTP/1.")
        && lines.all(|line| line.contains(':'))
        && !text.chars().any(|c| c.is_control() && c != '\r' && c != '\n' && c != '\t');
    let path = target.split('?').next()?;
    well_formed.then_some((method, path))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Ok,
    BadRequest,
    NotFound,
    MethodNotAllowed,
    RequestTimeout,
}

impl Status {
    fn line(self) -> &'static str {
        match self {
            Status::Ok => "200 OK",
            Status::BadRequest => "400 Bad Request",
            Status::NotFound => "404 Not Found",
            Status::MethodNotAllowed => "405 Method Not Allowed",
            Status::RequestTimeout => "408 Request Timeout",
        }
    }
}

struct Response {
    status: Status,
    content_type: &'static str,
    body: String,
}

impl Response {
    fn plain(status: Status) -> Response {
        Response { status, content_type: "text/plain; charset=utf-8", body: format!("{}\n", status.line()) }
    }

    /// Head and body in one buffer, so they leave in one write: two small writes would wait on
    /// Nagle's algorithm and the client's delayed acknowledgement.
    fn into_bytes(self) -> Vec<u8> {
        let allow = if self.status == Status::MethodNotAllowed { "Allow: GET\r\n" } else { "" };
        let head = format!(
            "HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n{allow}Connection: close\r\n\r\n",
            self.status.line(),
            self.content_type,
            self.body.len()
        );
        let mut bytes = head.into_bytes();
        bytes.extend_from_slice(self.body.as_bytes());
        bytes
    }
}

async fn send(stream: &mut TcpStream, response: Response) -> io::Result<()> {
    let bytes = response.into_bytes();
    let write = async {
        stream.write_all(&bytes).await?;
        stream.shutdown().await
    };
    timeout(WRITE_TIMEOUT, write).await.unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into()))
}

/// Reads and drops what the client still sends, for a moment (see [`DRAIN_TIMEOUT`]).
async fn drain(stream: &mut TcpStream) {
    let mut sink = [0; 4096];
    let discard = async {
        let mut left = MAX_DRAIN_BYTES;
        while left > 0 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(read) => left = left.saturating_sub(read),
            }
        }
    };
    // Running out of time or bytes is the normal end for a client that keeps sending.
    let _ = timeout(DRAIN_TIMEOUT, discard).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{HandoffPolicy, IdMint, RequestId};
    use crate::runtime::{DeferredCommand, NodeConfig, Output, Ready, StepPlan, ToWorker};
    use crate::schedulers::vllm::{VllmConfig, VllmCore};
    use crate::schedulers::Request;
    use std::collections::{BTreeMap, BTreeSet};

    // ---- a real node ----

    fn node(worker: WorkerId) -> WorkerNode {
        let core =
            VllmCore::new(worker, Backend::Vllm, VllmConfig::default()).expect("the default config is valid");
        let config = NodeConfig {
            policy: HandoffPolicy::SourceFirst,
            lease_ns: 2_000_000_000,
            reservation_ns: 3_000_000_000,
            renew_ns: None,
            kv_bytes_per_token: 1024,
            publish_kv_events: false,
        };
        let mut node = WorkerNode::new(worker, Box::new(core), config);
        node.start(&mut Ready::default());
        node
    }

    /// Hands back every core command in `ready`, and those they produce, at `at_ns`.
    fn apply_commands(node: &mut WorkerNode, at_ns: u64, ready: &mut Ready) {
        loop {
            let commands: Vec<DeferredCommand> = std::mem::take(&mut ready.outputs)
                .into_iter()
                .filter_map(|output| match output {
                    Output::Command { command, .. } => Some(command),
                    _ => None,
                })
                .collect();
            if commands.is_empty() {
                return;
            }
            for command in commands {
                node.apply_command(at_ns, command, ready).expect("the command applies");
            }
        }
    }

    /// A prefill node whose one handoff has computed its prompt and pinned the KV (source
    /// first: no destination yet).
    fn prefill_node_holding_a_pin() -> WorkerNode {
        let mut node = node(WorkerId::prefill(0));
        let mut ready = Ready::default();
        let handoff = IdMint::from_seed(7).handoff_id();
        let start = ToWorker::StartSource {
            handoff,
            request: Request::unique(RequestId(1), 512, 16, 0),
            destination: None,
        };
        node.on_frontend(0, start, &mut ready).expect("the source starts");
        apply_commands(&mut node, 0, &mut ready);
        let mut now_ns = 0;
        while !matches!(node.source_state(handoff), Some(SourceState::Pinned { .. })) {
            match node.start_step(now_ns, false, &mut ready).expect("the step runs") {
                StepPlan::Until { until_ns } => {
                    now_ns = until_ns;
                    node.finish_step(now_ns, &mut ready);
                }
                StepPlan::Again => {}
                plan => panic!("the prefill stalled before pinning: {plan:?}"),
            }
            apply_commands(&mut node, now_ns, &mut ready);
        }
        node
    }

    // ---- a strict reader of the exposition ----

    #[derive(Debug)]
    struct Sample {
        name: String,
        labels: BTreeMap<String, String>,
        value: f64,
    }

    fn is_metric_name(name: &str) -> bool {
        let mut chars = name.chars();
        chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    }

    /// `name{key="value",...} value`, or panics.
    fn parse_sample(line: &str) -> Sample {
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no value: {line}"));
        let value = value.parse().unwrap_or_else(|_| panic!("not a number: {line}"));
        let (name, labels) = series.split_once('{').unwrap_or_else(|| panic!("no labels: {line}"));
        assert!(is_metric_name(name), "bad name: {line}");
        let labels = labels.strip_suffix('}').unwrap_or_else(|| panic!("labels not closed: {line}"));
        let labels = labels
            .split(',')
            .map(|pair| {
                let (key, quoted) = pair.split_once('=').unwrap_or_else(|| panic!("bad label: {line}"));
                let value = quoted.strip_prefix('"').and_then(|v| v.strip_suffix('"'));
                assert!(is_metric_name(key), "bad label name: {line}");
                (key.to_string(), value.unwrap_or_else(|| panic!("unquoted label: {line}")).to_string())
            })
            .collect();
        Sample { name: name.to_string(), labels, value }
    }

    /// Checks the exposition line by line and returns its samples: every family has one HELP
    /// and one TYPE, every sample belongs to one (a counter's with `_total`), and it ends with
    /// `# EOF`.
    fn parse_exposition(text: &str) -> Vec<Sample> {
        assert!(text.ends_with("# EOF\n"), "no EOF marker");
        let (mut helped, mut typed) = (BTreeSet::new(), BTreeMap::new());
        let mut samples = Vec::new();
        for line in text.lines().filter(|line| *line != "# EOF") {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').unwrap_or_else(|| panic!("empty help: {line}"));
                assert!(!help.trim().is_empty() && helped.insert(name.to_string()), "help: {line}");
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap_or_else(|| panic!("no type: {line}"));
                assert!(matches!(kind, "gauge" | "counter"), "type: {line}");
                assert!(typed.insert(name.to_string(), kind.to_string()).is_none(), "second type: {line}");
            } else {
                assert!(!line.starts_with('#'), "unexpected comment: {line}");
                samples.push(parse_sample(line));
            }
        }
        assert_eq!(
            helped,
            typed.keys().cloned().collect::<BTreeSet<String>>(),
            "every family has HELP and TYPE"
        );
        for sample in &samples {
            let counter =
                sample.name.strip_suffix("_total").filter(|f| typed.get(*f).is_some_and(|k| k == "counter"));
            let family = counter.unwrap_or(&sample.name);
            assert!(typed.contains_key(family), "sample of no family: {}", sample.name);
            assert_eq!(typed[family] == "counter", counter.is_some(), "counter samples end in _total");
        }
        samples
    }

    fn value_of(samples: &[Sample], name: &str, label: Option<(&str, &str)>) -> f64 {
        let found: Vec<&Sample> = samples
            .iter()
            .filter(|s| {
                s.name == name && label.map_or(true, |(k, v)| s.labels.get(k).is_some_and(|x| x == v))
            })
            .collect();
        assert_eq!(found.len(), 1, "one sample of {name} {label:?}");
        found[0].value
    }

    fn check_exposition(worker: WorkerId, gauges: &WorkerGauges) -> Vec<Sample> {
        let samples = parse_exposition(&render(worker, Backend::Vllm, gauges));
        for sample in &samples {
            assert_eq!(sample.labels["worker"], worker.to_string(), "{sample:?}");
            assert_eq!(sample.labels["backend"], "vllm", "{sample:?}");
        }
        let classes: Vec<&Sample> = samples.iter().filter(|s| s.name == "handoff_kv_blocks").collect();
        assert_eq!(classes.len(), 5);
        let sum: f64 = classes.iter().map(|s| s.value).sum();
        assert_eq!(
            sum,
            value_of(&samples, "handoff_kv_capacity_blocks", None),
            "the classes sum to the capacity"
        );
        for (role, states) in [("source", &SOURCE_STATES[..]), ("destination", &DESTINATION_STATES[..])] {
            for state in states {
                let series = samples.iter().filter(|s| {
                    s.name == "handoff_handoffs" && s.labels["role"] == role && s.labels["state"] == *state
                });
                assert_eq!(series.count(), 1, "{role} {state} present once");
            }
        }
        samples
    }

    #[test]
    fn an_idle_decode_worker_renders_all_free() {
        let node = node(WorkerId::decode(0));
        let queues = QueueDepths { inbox_inputs: 2, outgoing_frames: 3, early_messages: 0 };
        let gauges = WorkerGauges::observe(&node, queues);
        let samples = check_exposition(WorkerId::decode(0), &gauges);
        let total = value_of(&samples, "handoff_kv_capacity_blocks", None);
        assert!(total > 0.0);
        assert_eq!(value_of(&samples, "handoff_kv_blocks", Some(("class", "free"))), total);
        assert_eq!(value_of(&samples, "handoff_kv_usage_perc", None), 0.0);
        assert_eq!(value_of(&samples, "handoff_queue_depth", Some(("queue", "outgoing"))), 3.0);
        assert_eq!(value_of(&samples, "handoff_generation", None), 1.0);
        let handoffs: f64 = samples.iter().filter(|s| s.name == "handoff_handoffs").map(|s| s.value).sum();
        assert_eq!(handoffs, 0.0);
    }

    #[test]
    fn a_pinned_prefill_renders_its_pin_and_the_driver_progress() {
        let node = prefill_node_holding_a_pin();
        let progress = DriverProgress {
            model_time_ms: 12.5,
            steps_total: 4,
            facts_total: 30,
            late_inputs_total: 1,
            max_lateness_ms: 0.25,
        };
        let gauges = WorkerGauges { progress, ..WorkerGauges::observe(&node, QueueDepths::default()) };
        assert!(gauges.pinned_source_blocks > 0, "{gauges:?}");
        let samples = check_exposition(WorkerId::prefill(0), &gauges);
        let pinned = value_of(&samples, "handoff_kv_blocks", Some(("class", "pinned_source")));
        assert_eq!(pinned, gauges.pinned_source_blocks as f64);
        let usage = value_of(&samples, "handoff_kv_usage_perc", None);
        assert!(usage > 0.0 && usage <= 1.0, "{usage}");
        let pinned_roles = samples.iter().find(|s| {
            s.name == "handoff_handoffs" && s.labels["role"] == "source" && s.labels["state"] == "pinned"
        });
        assert_eq!(pinned_roles.map(|s| s.value), Some(1.0));
        assert_eq!(value_of(&samples, "handoff_steps_total", None), 4.0);
        assert_eq!(value_of(&samples, "handoff_late_inputs_total", None), 1.0);
        assert_eq!(value_of(&samples, "handoff_model_time_ms", None), 12.5);
    }

    #[test]
    fn request_heads_are_parsed_strictly() {
        let state: SharedGauges =
            Arc::new(Mutex::new((WorkerId::decode(0), Backend::Vllm, WorkerGauges::default())));
        let cases: [(&[u8], Status); 10] = [
            (b"GET /metrics HTTP/1.1\r\nHost: x", Status::Ok),
            (b"GET /metrics?name=x HTTP/1.0", Status::Ok),
            (b"GET /nope HTTP/1.1", Status::NotFound),
            (b"POST /metrics HTTP/1.1\r\nContent-Length: 0", Status::MethodNotAllowed),
            (b"GET /metrics HTTP/2.0", Status::BadRequest),
            (b"GET  /metrics HTTP/1.1", Status::BadRequest),
            (b"GET metrics HTTP/1.1", Status::BadRequest),
            (b"GET /metrics HTTP/1.1\r\nno colon here", Status::BadRequest),
            (b"GET /metrics HTTP/1.1\r\nHost: \x00", Status::BadRequest),
            (b"\xff\xfe /metrics HTTP/1.1", Status::BadRequest),
        ];
        for (head, status) in cases {
            assert_eq!(respond(head, &state).status, status, "{}", String::from_utf8_lossy(head));
        }
    }

    // ---- the server ----

    /// Some client steps may take this long at most; nothing in these tests should come near.
    const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

    async fn start_server() -> (SocketAddr, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let gauges = WorkerGauges::observe(&node(WorkerId::decode(0)), QueueDepths::default());
        let state: SharedGauges = Arc::new(Mutex::new((WorkerId::decode(0), Backend::Vllm, gauges)));
        (address, tokio::spawn(serve(listener, state)))
    }

    /// Sends `request` and reads until the server closes (an error if it resets).
    async fn exchange(address: SocketAddr, request: &[u8]) -> io::Result<String> {
        let talk = async {
            let mut stream = TcpStream::connect(address).await?;
            stream.write_all(request).await?;
            let mut reply = Vec::new();
            stream.read_to_end(&mut reply).await?;
            Ok::<String, io::Error>(String::from_utf8_lossy(&reply).into_owned())
        };
        timeout(CLIENT_TIMEOUT, talk).await.expect("the server answered in time")
    }

    fn status_of(reply: &str) -> &str {
        reply.split("\r\n").next().unwrap_or("")
    }

    async fn scrape(address: SocketAddr) -> String {
        let reply =
            exchange(address, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n").await.expect("a reply");
        assert_eq!(status_of(&reply), "HTTP/1.1 200 OK", "{reply}");
        reply
    }

    #[tokio::test(flavor = "current_thread")]
    async fn serves_metrics_refuses_the_rest_and_survives_garbage() {
        let (address, server) = start_server().await;

        let reply = scrape(address).await;
        let (head, body) = reply.split_once("\r\n\r\n").expect("a head and a body");
        assert!(head.contains(&format!("Content-Type: {METRICS_CONTENT_TYPE}\r\n")), "{head}");
        assert!(head.contains(&format!("Content-Length: {}\r\n", body.len())), "{head}");
        assert!(head.contains("Connection: close"), "{head}");
        assert!(body.contains("handoff_kv_capacity_blocks{"), "{body}");
        parse_exposition(body);

        let reply = exchange(address, b"GET /nope HTTP/1.1\r\n\r\n").await.expect("a reply");
        assert_eq!(status_of(&reply), "HTTP/1.1 404 Not Found");

        // 20 KB without a line break: refused, or at worst the connection is reset.
        match exchange(address, &[b'x'; 20_000]).await {
            Ok(reply) => assert_eq!(status_of(&reply), "HTTP/1.1 400 Bad Request", "{reply}"),
            Err(error) => assert_eq!(error.kind(), io::ErrorKind::ConnectionReset, "{error}"),
        }
        scrape(address).await;
        server.abort();
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_connection_past_the_limit_is_closed_at_once() {
        let (address, server) = start_server().await;
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            idle.push(
                timeout(CLIENT_TIMEOUT, TcpStream::connect(address))
                    .await
                    .expect("connect")
                    .expect("connect"),
            );
        }
        // Past the limit: closed before any request, long before the read timeout.
        let mut extra = TcpStream::connect(address).await.expect("connect");
        let mut byte = [0; 1];
        let read = timeout(READ_TIMEOUT / 2, extra.read(&mut byte)).await.expect("closed at once");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");

        drop(idle);
        // The idle connections' tasks end when they see the close; until then one may still count.
        let mut answered = false;
        for _ in 0..40 {
            let reply = exchange(address, b"GET /metrics HTTP/1.1\r\n\r\n").await;
            if reply.is_ok_and(|r| status_of(&r) == "HTTP/1.1 200 OK") {
                answered = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert!(answered, "the server answers once the idle connections are gone");
        server.abort();
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_silent_client_times_out() {
        let (address, server) = start_server().await;
        let talk = async {
            let mut stream = TcpStream::connect(address).await?;
            stream.write_all(b"GET /metrics HTTP/1.1\r\n").await?;
            let mut reply = Vec::new();
            stream.read_to_end(&mut reply).await?;
            io::Result::Ok(String::from_utf8_lossy(&reply).into_owned())
        };
        let reply = timeout(READ_TIMEOUT * 3, talk).await.expect("timed out by the server").expect("a reply");
        assert_eq!(status_of(&reply), "HTTP/1.1 408 Request Timeout");
        server.abort();
    }
}
