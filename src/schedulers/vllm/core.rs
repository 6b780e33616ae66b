//! The vLLM-like engine core: waiting queue, running set, token budget, chunked prefill, LIFO
//! preemption, prefix caching, and the handoff resources it owns (held prefills = source pins,
//! destination reservations with their pending FIFO).
//!
//! ## Token model
//! A request's known tokens are `input + generated`. While prefilling (`computed < input +
//! generated`) it computes chunks; the chunk that reaches that target produces one output token
//! (the first one, unless the request is recomputing after preemption). While decoding,
//! `computed == input + generated − 1` and each step computes the last token's KV and produces
//! the next. A request finishes when `generated == max(output_tokens, 1)`, so it never needs KV
//! beyond `input + output − 1` tokens; a request (or handoff prefill: `input`) needing more
//! blocks than the worker has is rejected at submit, because LIFO preemption of a lone request
//! that can never complete would loop forever.
//!
//! ## Handoff resources
//! * Source: a handoff prefill is an ordinary request until its terminal prefill chunk; then, in
//!   the same step and before any completion, it leaves the running set (slot −1) and its block
//!   references become `Pinned` references (`SourcePinned`). Release/cancel returns them to the
//!   cache with their hashes.
//! * Destination: a reservation holds `Reserved` references on the locally cached prefix plus
//!   fresh hashless pages for the rest of the prompt; no slot. Activation turns them into
//!   `Active` references, hashes and publishes the fresh pages, and queues the request as
//!   computed but its last token (`computed = input − 1`, `generated = 0`): its first step
//!   recomputes that token as decode work and emits the first output token on this worker.
//! * The TRT-LLM backend refuses destination reservation with `CommandError::Unsupported`: the
//!   proposal defers generation-side pre-allocation for it (see engine-semantics notes).
//!
//! * Sources and destinations live in the shared [`HandoffTable`]s, so a command naming a
//!   handoff this core ended is a `NoOp`, one naming a handoff it never saw is
//!   `UnknownHandoff`, and a start of either kind of id already held or ended is
//!   `DuplicateHandoff` (see [`crate::schedulers::handoffs`]); a refused start counts as ended.
//!
//! ## Pending reservations
//! FIFO ([`PendingReservations`]), bounded by `max_pending_reservations`. Only the head is
//! retried, at the end of every command and step, and only if the pool's capacity epoch (bumped
//! whenever a block becomes unreferenced) moved since the head's last attempt. A later
//! reservation never overtakes a queued one.
//!
//! ## Queues and their bounds
//! * waiting: `max_waiting_requests`; a submit beyond it gets `RequestRejected{NoCapacity}` +
//!   `Rejected` output and `Ok(Unavailable)`. Preempted requests (front) and activated
//!   destinations (back) always re-enter: they were admitted already.
//! * running: `max_num_seqs` (one request slot each).
//! * pending reservations: `max_pending_reservations`; beyond it the reservation is refused for
//!   good (`ReservationRefused{NoCapacity}` + `ReservationFailed` output, as SGLang's core does),
//!   so the handoff fails instead of waiting on a queue it never entered.
//! * A second live request with the same id is refused with `Err(InvalidState)`; for plain
//!   `submit` the error names the nil handoff id (the contract has no request-level variant).
//!
//! ## Liveness
//! Admission is FIFO and stops at the first waiting request that does not fit (vLLM's
//! head-of-line blocking). One exception: when nothing is running, waiting requests that hold KV
//! (activated destinations) may bypass a blocked head, because only running them releases their
//! KV; if none fits, the first is admitted without compute and the next step's LIFO preemption
//! returns its blocks to the cache. KV held by pins and reservations is released only by commands.
//!
//! ## Facts of a step (all observed at `at_ns + duration_ns`)
//! `RequestPreempted` / `RequestScheduled` (with `KvRemoved` before any fact whose allocation
//! evicted) in scheduling order, then `StepExecuted` (decode growth, prefill chunks of running
//! requests, duplicate-hash adoption), `KvStored` for newly full blocks, then per request
//! `FirstTokenEmitted`, `SourcePinned` or `RequestFinished`, then any reservation retry.

use super::block_pool::{BlockId, BlockPool, BuildIntegerHasher, Owner};
use super::config::{ConfigError, VllmConfig};
use crate::events::{BlockHash, EngineShape, Fact, KvDelta, RejectReason, TerminalStatus};
use crate::ids::{
    Backend, CancelReason, DestinationReservationId, EndReason, HandoffId, RequestId, SourceLeaseId, WorkerId,
};
use crate::model::capacity::KvCapacitySnapshot;
use crate::schedulers::handoffs::{Arrival, HandoffTable, PendingReservations, ResourceIds};
use crate::schedulers::request::{decode_block_hash, ROOT_HASH};
use crate::schedulers::{
    CommandError, CommandOutcome, CommandResult, Effects, EngineCore, EngineOutput, QuietDurations,
    QuietSteps, Request, ReservationSummary, SchedulerView, StepOutput, StepShape, TimingModel,
};
use std::collections::{HashMap, HashSet, VecDeque};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SequenceKind {
    Plain,
    /// Disabled policy's decode: the prompt's KV arrives with the request (see
    /// `EngineCore::submit_prefilled`); allocated and published at admission.
    Prefilled,
    Source {
        handoff: HandoffId,
        lease_ns: u64,
    },
    Destination {
        handoff: HandoffId,
    },
}

/// A request in waiting or running. `repr(C)` with the fields a decode step reads first, so
/// they share a cache line: a replay steps eight workers in turn, and each step finds its
/// requests' state evicted by the others' work.
#[derive(Clone, Debug)]
#[repr(C)]
struct Sequence {
    computed: u32,
    generated: u32,
    /// `req.input_tokens.max(1)` and `req.output_tokens.max(1)`, kept beside the counters.
    prompt: u32,
    max_out: u32,
    /// `blocks[..hashed]` carry their hash in the pool.
    hashed: usize,
    blocks: Vec<BlockId>,
    kind: SequenceKind,
    /// Hashes of full blocks known so far (prompt blocks, then decode blocks as they fill).
    hashes: Vec<BlockHash>,
    req: Request,
    /// When a preemption interrupted its output (the start of the step that preempted it, when
    /// its previous token had just come out); cleared by the next token.
    stalled_since_ns: Option<u64>,
}

impl Sequence {
    fn new(req: Request, hashes: Vec<BlockHash>, blocks: Vec<BlockId>, kind: SequenceKind) -> Self {
        Sequence {
            computed: 0,
            generated: 0,
            prompt: req.input_tokens.max(1),
            max_out: req.output_tokens.max(1),
            hashed: 0,
            blocks,
            kind,
            hashes,
            req,
            stalled_since_ns: None,
        }
    }
    fn prompt(&self) -> u32 {
        self.prompt
    }
    fn target(&self) -> u32 {
        self.prompt().saturating_add(self.generated)
    }
    fn max_output(&self) -> u32 {
        self.max_out
    }
    /// Block `hashed` is allocated and `computed` has reached its end: there is a block to hash.
    /// Multiplies rather than divides: it is asked for every request on every step.
    #[inline]
    fn fills_block(&self, block_size: u32) -> bool {
        self.hashed < self.blocks.len()
            && (self.hashed as u64 + 1) * block_size as u64 <= self.computed as u64
    }
    /// Decoding means `computed == input + generated − 1`: only the last token's KV is missing.
    /// Anything less (a fresh prompt, or a recompute after preemption) is prefill, whose final
    /// chunk reaches `target()` and produces the next token.
    fn is_prefilling(&self) -> bool {
        let decode_at = if self.generated == 0 { self.prompt() } else { self.target() - 1 };
        self.computed < decode_at
    }
}

#[derive(Clone, Debug)]
enum SourceEntry {
    /// Queued or computing: an ordinary request in waiting/running.
    Live(RequestId),
    Pinned {
        lease: SourceLeaseId,
        blocks: Vec<BlockId>,
    },
}

#[derive(Clone, Debug)]
enum DestinationEntry {
    /// Waiting in the pending FIFO, which holds its request.
    Pending,
    Reserved {
        reservation: DestinationReservationId,
        request: Request,
        blocks: Vec<BlockId>,
        prefix_blocks: u32,
        /// The prompt's block hashes, computed for the reservation's prefix match and kept for
        /// activation.
        hashes: Vec<BlockHash>,
    },
    Activated(RequestId),
}

/// The vLLM-like core. See the module docs.
#[derive(Clone)]
/// `repr(C)`: the fields every step touches come first, in a few adjacent cache lines (a replay
/// steps eight workers in turn, so each step starts with its worker's state evicted).
#[repr(C)]
pub struct VllmCore {
    /// In scheduling order; the last one is preempted first (LIFO).
    running: Vec<RequestId>,
    waiting: VecDeque<RequestId>,
    /// Requests in waiting or running, by id (lookup only).
    seqs: HashMap<RequestId, Sequence, BuildIntegerHasher>,
    pending: PendingReservations,
    /// Emptied effects handed back by the adapter, reused by the next step.
    spare: Option<Effects>,
    /// Per-step scratch lists, kept so a step allocates nothing in steady state.
    scratch_scheduled: Vec<Scheduled>,
    scratch_produced: Vec<RequestId>,
    /// The last decode-only step's (active KV tokens, duration): the timing model is a pure
    /// function of them (total KV is fixed per core).
    last_decode_timing: Option<(u64, u64)>,
    cfg: VllmConfig,
    pool: BlockPool,
    worker: WorkerId,
    backend: Backend,
    shape: EngineShape,
    /// Request ids this core holds in any form (seqs, pending or reserved destinations).
    live: HashSet<RequestId, BuildIntegerHasher>,
    sources: HandoffTable<SourceEntry>,
    pinned: u64,
    dests: HandoffTable<DestinationEntry>,
    reserved: u64,
    ids: ResourceIds,
    internal_error: Option<String>,
}

/// A request scheduled in a step: (id, tokens, prefilling, fast-path flags). A decode token
/// that needs no new block is computed already in the scheduling pass (`ADVANCED`), which also
/// notes whether it produces output worth a look (`PRODUCES`) and fills a block (`FILLS`).
type Scheduled = (RequestId, u64, bool, u8);
const ADVANCED: u8 = 1;
const PRODUCES: u8 = 2;
const FILLS: u8 = 4;

/// A reservation that fits: (blocks, prefix blocks, fresh pages, prompt block hashes).
type Reservation = (Vec<BlockId>, u32, u32, Vec<BlockHash>);

fn slots(n: i32) -> KvDelta {
    KvDelta { slots: n, ..KvDelta::ZERO }
}

fn nil_handoff() -> HandoffId {
    HandoffId(uuid::Uuid::nil())
}

impl VllmCore {
    pub fn new(worker: WorkerId, backend: Backend, config: VllmConfig) -> Result<Self, ConfigError> {
        if backend == Backend::Sglang {
            return Err(ConfigError::Backend(backend.as_str()));
        }
        config.validate()?;
        let shape = EngineShape {
            total_blocks: config.num_gpu_blocks,
            block_size: config.block_size,
            max_request_slots: config.max_num_seqs,
            config_json: serde_json::to_string(&config).unwrap_or_default(),
        };
        Ok(VllmCore {
            worker,
            backend,
            cfg: config,
            shape,
            pool: BlockPool::new(config.num_gpu_blocks),
            seqs: HashMap::default(),
            live: HashSet::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            sources: HandoffTable::new(),
            pinned: 0,
            dests: HandoffTable::new(),
            pending: PendingReservations::new(),
            reserved: 0,
            ids: ResourceIds::starting_at(1),
            internal_error: None,
            spare: None,
            scratch_scheduled: Vec::new(),
            scratch_produced: Vec::new(),
            last_decode_timing: None,
        })
    }

    pub fn config(&self) -> &VllmConfig {
        &self.cfg
    }

    /// A broken internal invariant (never expected; tests assert it stays `None`).
    pub fn internal_error(&self) -> Option<&str> {
        self.internal_error.as_deref()
    }

    fn note_err<E: std::fmt::Display>(&mut self, r: Result<(), E>) {
        if let Err(e) = r {
            if self.internal_error.is_none() {
                self.internal_error = Some(e.to_string());
            }
        }
    }

    fn bs(&self) -> u32 {
        self.cfg.block_size
    }

    fn blocks_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.bs() as u64)
    }

    /// Blocks a request needs at its largest (see module docs).
    fn peak_blocks(&self, req: &Request, prefill_only: bool) -> u64 {
        let input = req.input_tokens.max(1) as u64;
        let tokens = if prefill_only { input } else { input + req.output_tokens.max(1) as u64 - 1 };
        self.blocks_for(tokens)
    }

    fn prompt_hashes(&self, req: &Request) -> Vec<BlockHash> {
        if self.cfg.enable_prefix_caching {
            req.prompt_block_hashes(self.bs())
        } else {
            Vec::new()
        }
    }

    fn flush_removed(&mut self, fx: &mut Effects) {
        let r = self.pool.take_removed();
        if !r.is_empty() {
            fx.facts.push(Fact::KvRemoved { blocks: r });
        }
    }

    fn release_all(&mut self, blocks: &[BlockId], owner: Owner) {
        // Reverse order: a request's tail blocks enter the LRU first and are evicted first,
        // which keeps shared prefixes cached longest.
        let r = self.pool.release_all_rev(blocks, owner);
        self.note_err(r);
    }

    /// Gives `seq`'s newly full blocks their hashes (adopting a canonical block on a duplicate
    /// hash) and returns the runs to publish as `KvStored`.
    fn hash_full_blocks(&mut self, id: RequestId, runs: &mut Vec<(Option<BlockHash>, Vec<BlockHash>)>) {
        if !self.cfg.enable_prefix_caching {
            return;
        }
        let bs = self.bs();
        // The sequence is updated in place (the pool and the map are different fields): taking
        // it out of the map and putting it back cost two hash lookups and two moves per call.
        let Some(s) = self.seqs.get_mut(&id) else { return };
        // Most decode steps fill no block (block `hashed` is full once `computed` reaches its end).
        if !s.fills_block(bs) {
            return;
        }
        let pool = &mut self.pool;
        let mut error: Option<String> = None;
        let full = ((s.computed / bs) as usize).min(s.blocks.len());
        let mut run: Option<(Option<BlockHash>, Vec<BlockHash>)> = None;
        // Prompt hashes are known ahead: prefetch buckets, then chain heads, a few blocks ahead.
        const BUCKET_AHEAD: usize = 24;
        const CHAIN_AHEAD: usize = 12;
        let known = full.min(s.hashes.len());
        for b in s.hashed..(s.hashed + BUCKET_AHEAD).min(known) {
            pool.prefetch_bucket(s.blocks[b], s.hashes[b]);
        }
        while s.hashed < full {
            let b = s.hashed;
            if b + BUCKET_AHEAD < known {
                pool.prefetch_bucket(s.blocks[b + BUCKET_AHEAD], s.hashes[b + BUCKET_AHEAD]);
            }
            if b + CHAIN_AHEAD < known {
                pool.prefetch_chain(s.hashes[b + CHAIN_AHEAD]);
            }
            if s.hashes.len() <= b {
                let parent = if b == 0 { ROOT_HASH } else { s.hashes[b - 1] };
                s.hashes.push(decode_block_hash(parent, s.req.id, b as u32));
            }
            let h = s.hashes[b];
            let blk = s.blocks[b];
            match pool.set_hash(blk, h) {
                Ok(None) => {
                    let parent = if b == 0 { None } else { Some(s.hashes[b - 1]) };
                    // Sized for the rest of the full blocks: the run leaves with its fact,
                    // and regrowing it from empty costs a copy per doubling.
                    run.get_or_insert_with(|| (parent, Vec::with_capacity(full - b))).1.push(h);
                }
                Ok(Some(canonical)) => {
                    // One physical block per hash: keep the canonical one, drop our copy.
                    pool.acquire(canonical, Owner::Active);
                    if let Err(e) = pool.release(blk, Owner::Active) {
                        error.get_or_insert(e.to_string());
                    }
                    s.blocks[b] = canonical;
                    if let Some(r) = run.take() {
                        runs.push(r);
                    }
                }
                Err(e) => {
                    error.get_or_insert(e.to_string());
                }
            }
            s.hashed += 1;
        }
        if let Some(r) = run.take() {
            runs.push(r);
        }
        if let Some(e) = error {
            self.note_err::<String>(Err(e));
        }
    }

    #[inline]
    fn push_stored(fx: &mut Effects, runs: Vec<(Option<BlockHash>, Vec<BlockHash>)>) {
        if runs.is_empty() {
            return;
        }
        for (parent, blocks) in runs {
            fx.facts.push(Fact::KvStored { parent, blocks });
        }
    }

    /// Ends a request in waiting or running (cancel, completion): releases its blocks to the
    /// cache, returns its slot if running, and forgets its handoff registration.
    fn end_request(&mut self, id: RequestId, status: TerminalStatus, fx: &mut Effects) {
        self.end_request_inner(id, status, fx, false);
    }

    /// `in_step`: the caller knows the request is running and removes ended requests from the
    /// running list in one pass afterwards (keeps a step O(running) however many finish).
    fn end_request_inner(&mut self, id: RequestId, status: TerminalStatus, fx: &mut Effects, in_step: bool) {
        let Some(s) = self.seqs.remove(&id) else { return };
        let was_running = if in_step {
            true
        } else if let Some(pos) = self.running.iter().rposition(|r| *r == id) {
            self.running.remove(pos);
            true
        } else {
            if let Some(pos) = self.waiting.iter().position(|r| *r == id) {
                self.waiting.remove(pos);
            }
            false
        };
        self.release_all(&s.blocks, Owner::Active);
        let mut kv = self.pool.take_delta();
        if was_running {
            kv = kv.plus(slots(-1));
        }
        fx.facts.push(Fact::RequestFinished { request: id, status, output_tokens: s.generated, kv });
        fx.outputs.push(EngineOutput::Finished { request: id, status, output_tokens: s.generated });
        self.live.remove(&id);
        match s.kind {
            SequenceKind::Plain | SequenceKind::Prefilled => {}
            SequenceKind::Source { handoff, .. } => {
                self.sources.end(handoff);
            }
            SequenceKind::Destination { handoff } => {
                self.dests.end(handoff);
            }
        }
    }

    /// Preempts a running request (LIFO victim): blocks back to the cache, computed reset, front
    /// of the waiting queue.
    fn preempt(&mut self, id: RequestId, at_ns: u64, fx: &mut Effects, step_acc: &mut KvDelta) {
        *step_acc = step_acc.plus(self.pool.take_delta());
        let Some(mut s) = self.seqs.remove(&id) else { return };
        if s.generated > 0 && s.stalled_since_ns.is_none() {
            s.stalled_since_ns = Some(at_ns);
        }
        if s.kind == SequenceKind::Prefilled {
            // Its transferred KV is gone: it recomputes here, like any preempted request.
            s.kind = SequenceKind::Plain;
        }
        if let Some(pos) = self.running.iter().rposition(|r| *r == id) {
            self.running.remove(pos);
        }
        self.release_all(&s.blocks, Owner::Active);
        s.blocks.clear();
        s.hashed = 0;
        s.computed = 0;
        self.seqs.insert(id, s);
        self.waiting.push_front(id);
        let kv = self.pool.take_delta().plus(slots(-1));
        fx.facts.push(Fact::RequestPreempted { request: id, kv });
    }

    /// Longest run of `hashes[..limit]` present in the pool, and how many of those blocks are
    /// cached-free (taking them removes them from what an allocation could evict).
    fn match_prefix(&self, hashes: &[BlockHash], limit: usize) -> (Vec<BlockId>, u64) {
        let mut out = Vec::new();
        let mut cached = 0;
        for h in hashes.iter().take(limit) {
            match self.pool.lookup(*h) {
                Some(b) => {
                    if self.pool.is_cached_free(b) {
                        cached += 1;
                    }
                    out.push(b);
                }
                None => break,
            }
        }
        (out, cached)
    }

    /// Tries to admit the waiting head. Returns the tokens it computes this step and whether
    /// they are prefill tokens, or `None` if it does not fit (head-of-line blocking).
    fn try_admit(
        &mut self,
        id: RequestId,
        budget: u64,
        fx: &mut Effects,
        step_acc: &mut KvDelta,
    ) -> Option<(u64, bool)> {
        *step_acc = step_acc.plus(self.pool.take_delta());
        let bs = self.bs() as u64;
        let s = self.seqs.get(&id)?;
        if !s.blocks.is_empty() && !s.is_prefilling() {
            // An activated destination: KV already valid, decode one token.
            let need = self.blocks_for(s.computed as u64 + 1).saturating_sub(s.blocks.len() as u64);
            if self.pool.available() < need {
                return None;
            }
            let cached_tokens = s.computed;
            fx.facts.push(Fact::RequestScheduled { request: id, cached_tokens, kv: slots(1) });
            self.grow(id, need, fx, step_acc);
            return Some((1, false));
        }
        let target = s.target() as u64;
        let limit = ((target - 1) / bs) as usize;
        let (matched, matched_cached) =
            if s.blocks.is_empty() { self.match_prefix(&s.hashes, limit) } else { (Vec::new(), 0) };
        let start = if s.blocks.is_empty() {
            if s.kind == SequenceKind::Prefilled {
                // The transferred prompt is valid but its last token, which decode recomputes
                // to produce the first output token (as after a remote-KV load).
                target - 1
            } else {
                matched.len() as u64 * bs
            }
        } else {
            s.computed as u64
        };
        let remaining = target.saturating_sub(start);
        let chunk = if self.cfg.enable_chunked_prefill {
            remaining.min(budget)
        } else if remaining <= budget || budget == self.cfg.max_num_batched_tokens as u64 {
            remaining
        } else {
            return None;
        };
        if chunk == 0 {
            return None;
        }
        let have = s.blocks.len() as u64 + matched.len() as u64;
        let need = self.blocks_for(start + chunk).saturating_sub(have);
        if self.pool.available().saturating_sub(matched_cached) < need {
            return None;
        }
        for &b in &matched {
            self.pool.acquire(b, Owner::Active);
        }
        // Fresh blocks go straight into the sequence (no list of their own to allocate).
        let s = self.seqs.get_mut(&id)?;
        if s.blocks.is_empty() {
            s.hashed = matched.len();
            s.computed = start as u32;
        }
        s.blocks.reserve(matched.len() + need as usize);
        s.blocks.extend(matched);
        let mut failed = false;
        for _ in 0..need {
            match self.pool.alloc(Owner::Active) {
                Some(b) => s.blocks.push(b),
                None => failed = true,
            }
        }
        if failed {
            self.note_err::<String>(Err("allocation failed after capacity check".into()));
        }
        let cached_tokens = start as u32;
        self.flush_removed(fx);
        let kv = self.pool.take_delta().plus(slots(1));
        fx.facts.push(Fact::RequestScheduled { request: id, cached_tokens, kv });
        Some((chunk, true))
    }

    /// See step 3 of [`EngineCore::step`]: only called with nothing running or scheduled.
    fn unblock(
        &mut self,
        fx: &mut Effects,
        step_acc: &mut KvDelta,
        budget: u64,
        scheduled: &mut Vec<Scheduled>,
    ) {
        let with_kv: Vec<(usize, RequestId)> = self
            .waiting
            .iter()
            .enumerate()
            .filter(|(_, id)| self.seqs.get(id).map(|s| !s.blocks.is_empty()).unwrap_or(false))
            .map(|(i, id)| (i, *id))
            .collect();
        for &(pos, id) in &with_kv {
            if let Some((tokens, prefill)) = self.try_admit(id, budget, fx, step_acc) {
                self.waiting.remove(pos);
                self.running.push(id);
                scheduled.push((id, tokens, prefill, 0));
                return;
            }
        }
        if let Some(&(pos, id)) = with_kv.first() {
            self.waiting.remove(pos);
            self.running.push(id);
            let cached_tokens = self.seqs.get(&id).map(|s| s.computed).unwrap_or(0);
            fx.facts.push(Fact::RequestScheduled { request: id, cached_tokens, kv: slots(1) });
        }
    }

    /// Allocates `need` fresh blocks for a running request's growth (delta into the step).
    fn grow(&mut self, id: RequestId, need: u64, fx: &mut Effects, step_acc: &mut KvDelta) {
        if need == 0 && self.pool.is_quiet() {
            // Most decode steps: nothing to allocate and no accounting pending.
            return;
        }
        // Fresh blocks go straight into the sequence (no list of their own to allocate).
        let mut failed = false;
        if let Some(s) = self.seqs.get_mut(&id) {
            for _ in 0..need {
                match self.pool.alloc(Owner::Active) {
                    Some(b) => s.blocks.push(b),
                    None => failed = true,
                }
            }
        } else {
            for _ in 0..need {
                if self.pool.alloc(Owner::Active).is_none() {
                    failed = true;
                }
            }
        }
        if failed {
            self.note_err::<String>(Err("growth allocation failed after capacity check".into()));
        }
        *step_acc = step_acc.plus(self.pool.take_delta());
        self.flush_removed(fx);
    }

    /// Reserves destination capacity for `req` if it fits now: cached prefix (Reserved refs)
    /// plus fresh hashless pages. Returns (blocks, prefix_blocks, pages, prompt hashes).
    fn try_reserve(&mut self, req: &Request) -> Option<Reservation> {
        let hashes = self.prompt_hashes(req);
        let total = self.blocks_for(req.input_tokens.max(1) as u64);
        let (matched, matched_cached) = self.match_prefix(&hashes, hashes.len());
        let pages = total.saturating_sub(matched.len() as u64);
        // vLLM serves running requests before admitting new (remote-KV) ones: a reservation
        // may not take the blocks the requests already admitted here need for their next
        // token (one each), or every freed block would go to the pending FIFO and decode
        // would thrash on preemption.
        let growth_reserve = (self.running.len() + self.waiting.len()) as u64;
        if self.pool.available().saturating_sub(matched_cached) < pages + growth_reserve {
            return None;
        }
        for &b in &matched {
            self.pool.acquire(b, Owner::Reserved);
        }
        let prefix_blocks = matched.len() as u32;
        let mut blocks = matched;
        blocks.reserve_exact(pages as usize);
        for _ in 0..pages {
            match self.pool.alloc(Owner::Reserved) {
                Some(b) => blocks.push(b),
                None => self.note_err::<String>(Err("reservation allocation failed after check".into())),
            }
        }
        Some((blocks, prefix_blocks, pages as u32, hashes))
    }

    /// Records a successful reservation: fact, output, state.
    fn book_reservation(
        &mut self,
        handoff: HandoffId,
        request: Request,
        deadline_ns: u64,
        got: Reservation,
        fx: &mut Effects,
    ) {
        let (blocks, prefix_blocks, pages, hashes) = got;
        let reservation = self.ids.reservation();
        let prefix_tokens = (prefix_blocks as u64 * self.bs() as u64).min(request.input_tokens as u64) as u32;
        self.flush_removed(fx);
        let kv = self.pool.take_delta();
        fx.facts.push(Fact::DestinationReserved {
            handoff,
            request: request.id,
            reservation,
            pages,
            prefix_blocks,
            prefix_tokens,
            deadline_ns,
            kv,
        });
        let summary = ReservationSummary {
            pages,
            prefix_blocks,
            prefix_tokens,
            missing_tokens: request.input_tokens.saturating_sub(prefix_tokens),
        };
        fx.outputs.push(EngineOutput::DestinationReserved { handoff, reservation, summary });
        self.reserved += 1;
        self.dests.hold(
            handoff,
            DestinationEntry::Reserved { reservation, request, blocks, prefix_blocks, hashes },
        );
    }

    /// Retries the pending FIFO's head while capacity changed since its last attempt.
    fn retry_pending(&mut self, fx: &mut Effects) {
        while let Some(p) = self.pending.take_due(self.pool.epoch()) {
            let h = p.handoff;
            if self.peak_blocks(&p.request, true) > self.pool.total() {
                self.dests.end(h);
                self.live.remove(&p.request.id);
                fx.facts.push(Fact::ReservationDequeued {
                    handoff: h,
                    reason: CancelReason::DestinationRejected,
                });
                fx.outputs
                    .push(EngineOutput::ReservationFailed { handoff: h, reason: RejectReason::NeverFits });
                continue;
            }
            match self.try_reserve(&p.request) {
                Some(got) => self.book_reservation(h, p.request, p.deadline_ns, got, fx),
                None => {
                    self.pending.put_back(p, self.pool.epoch());
                    fx.facts.push(Fact::ReservationRefused { handoff: h, reason: RejectReason::NoCapacity });
                    return;
                }
            }
        }
    }

    fn finish_command(
        &mut self,
        outcome: Result<CommandOutcome, CommandError>,
        mut fx: Effects,
    ) -> CommandResult {
        self.retry_pending(&mut fx);
        CommandResult { outcome, effects: fx }
    }

    fn enqueue(
        &mut self,
        req: Request,
        kind: SequenceKind,
        fx: &mut Effects,
    ) -> Result<CommandOutcome, CommandError> {
        let prefill_only = matches!(kind, SequenceKind::Source { .. });
        let needed = self.peak_blocks(&req, prefill_only);
        if needed > self.pool.total() {
            fx.facts.push(Fact::RequestRejected { request: req.id, reason: RejectReason::NeverFits });
            fx.outputs.push(EngineOutput::Rejected { request: req.id, reason: RejectReason::NeverFits });
            return Err(CommandError::NeverFits {
                request: req.id,
                needed_blocks: needed,
                total_blocks: self.pool.total(),
            });
        }
        if self.waiting.len() >= self.cfg.max_waiting_requests as usize {
            fx.facts.push(Fact::RequestRejected { request: req.id, reason: RejectReason::NoCapacity });
            fx.outputs.push(EngineOutput::Rejected { request: req.id, reason: RejectReason::NoCapacity });
            return Ok(CommandOutcome::Unavailable);
        }
        let id = req.id;
        let hashes = self.prompt_hashes(&req);
        self.seqs.insert(id, Sequence::new(req, hashes, Vec::new(), kind));
        self.live.insert(id);
        self.waiting.push_back(id);
        fx.facts.push(Fact::RequestQueued { request: id });
        Ok(CommandOutcome::Applied)
    }

    /// Step 1: gives each running request, in scheduling order, its tokens for this step
    /// (a prefill chunk within the budget, or one decode token), preempting from the back
    /// (LIFO) when the blocks it needs are not available. Stops at the budget's end or at a
    /// request that cannot get its blocks. Returns whether it preempted.
    fn schedule_running(
        &mut self,
        at_ns: u64,
        budget: &mut u64,
        scheduled: &mut Vec<Scheduled>,
        fx: &mut Effects,
        step_acc: &mut KvDelta,
    ) -> bool {
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let id = self.running[i];
            let quiet = self.pool.is_quiet();
            let bs = self.cfg.block_size as u64;
            let Some(s) = self.seqs.get_mut(&id) else {
                i += 1;
                continue;
            };
            let (tokens, prefill) = if s.is_prefilling() {
                let remaining = (s.target() - s.computed) as u64;
                (remaining.min(*budget), true)
            } else {
                (1, false)
            };
            let kv_tokens = s.computed as u64 + tokens;
            // Multiply before dividing: most steps need no new block.
            let held = s.blocks.len() as u64;
            if !prefill && kv_tokens <= held * bs && quiet {
                // The common decode token: no block to find, nobody to preempt, no accounting
                // pending. Compute it now (step 4 would, unchanged by anything in between) and
                // save step 4 the lookup.
                s.computed += 1;
                s.generated += 1;
                let mut flags = ADVANCED;
                if s.generated == 1
                    || s.generated >= s.max_output()
                    || matches!(s.kind, SequenceKind::Source { .. })
                {
                    flags |= PRODUCES;
                }
                if s.fills_block(self.cfg.block_size) {
                    flags |= FILLS;
                }
                *budget = budget.saturating_sub(1);
                scheduled.push((id, 1, false, flags));
                i += 1;
                continue;
            }
            let need = if kv_tokens <= held * bs { 0 } else { kv_tokens.div_ceil(bs).saturating_sub(held) };
            let mut self_preempted = false;
            while self.pool.available() < need {
                let Some(&victim) = self.running.last() else { break };
                self.preempt(victim, at_ns, fx, step_acc);
                preempted = true;
                if victim == id {
                    self_preempted = true;
                    break;
                }
            }
            if self_preempted || self.pool.available() < need {
                break;
            }
            self.grow(id, need, fx, step_acc);
            *budget = budget.saturating_sub(tokens);
            scheduled.push((id, tokens, prefill, 0));
            i += 1;
        }
        preempted
    }

    /// Step 2: admits waiting requests FIFO while the budget and `max_num_seqs` allow, up to
    /// the first that does not fit (head-of-line blocking).
    fn admit_waiting(
        &mut self,
        budget: &mut u64,
        scheduled: &mut Vec<Scheduled>,
        fx: &mut Effects,
        step_acc: &mut KvDelta,
    ) {
        while *budget > 0 && self.running.len() < self.cfg.max_num_seqs as usize {
            let Some(&id) = self.waiting.front() else { break };
            let Some((tokens, prefill)) = self.try_admit(id, *budget, fx, step_acc) else {
                break;
            };
            self.waiting.pop_front();
            self.running.push(id);
            *budget = budget.saturating_sub(tokens);
            scheduled.push((id, tokens, prefill, 0));
        }
    }

    /// Step 4: advances every scheduled request by its tokens, notes in `produced` the ones
    /// whose token step 5 must look at, and hashes newly full blocks into `runs`. Returns the
    /// step's (prefill, decode) tokens.
    fn compute(
        &mut self,
        scheduled: &[Scheduled],
        produced: &mut Vec<RequestId>,
        runs: &mut Vec<(Option<BlockHash>, Vec<BlockHash>)>,
    ) -> (u64, u64) {
        let mut prefill_tokens = 0u64;
        let mut decode_tokens = 0u64;
        for &(id, tokens, prefill, flags) in scheduled {
            if flags & ADVANCED != 0 {
                decode_tokens += 1;
                if flags & PRODUCES != 0 {
                    produced.push(id);
                }
                if flags & FILLS != 0 {
                    self.hash_full_blocks(id, runs);
                }
                continue;
            }
            let Some(s) = self.seqs.get_mut(&id) else { continue };
            if prefill {
                let target = s.target();
                // An activated destination's one-token recompute costs a decode step, not a
                // prefill (its KV arrived by transfer).
                let remote_tail =
                    matches!(s.kind, SequenceKind::Destination { .. } | SequenceKind::Prefilled)
                        && s.generated == 0
                        && tokens == 1
                        && s.computed + 1 == s.prompt();
                s.computed = s.computed.saturating_add(tokens as u32);
                if remote_tail {
                    decode_tokens += tokens;
                } else {
                    prefill_tokens += tokens;
                }
                if s.computed >= target {
                    s.generated += 1;
                    produced.push(id);
                }
            } else {
                s.computed += 1;
                s.generated += 1;
                decode_tokens += 1;
                // Step 5 only acts on a first token, a finished request or a terminal prefill;
                // a decode token in the middle of a request needs nothing there.
                if s.generated == 1
                    || s.generated >= s.max_output()
                    || matches!(s.kind, SequenceKind::Source { .. })
                {
                    produced.push(id);
                }
            }
            if s.fills_block(self.cfg.block_size) {
                self.hash_full_blocks(id, runs);
            }
        }
        (prefill_tokens, decode_tokens)
    }

    /// The modeled duration of a step that computed these tokens.
    fn step_duration(&mut self, prefill_tokens: u64, decode_tokens: u64) -> u64 {
        let bs = self.bs() as u64;
        let shape = StepShape {
            prefill_tokens,
            decode_requests: decode_tokens,
            active_kv_tokens: self.pool.active_blocks() * bs,
            total_kv_tokens: self.pool.total() * bs,
        };
        // Decode-only steps repeat their shape for many steps in a row (KV usage moves in whole
        // blocks): reuse the last such step's duration when the shape is the same.
        match self.last_decode_timing {
            Some((active, ns))
                if shape.prefill_tokens == 0
                    && shape.decode_requests > 0
                    && active == shape.active_kv_tokens =>
            {
                ns
            }
            _ => {
                let ns = self.cfg.timing.step_ns(&shape);
                if shape.prefill_tokens == 0 && shape.decode_requests > 0 {
                    self.last_decode_timing = Some((shape.active_kv_tokens, ns));
                }
                ns
            }
        }
    }

    /// Step 5: what the produced tokens mean, observed at `end_ns`: first tokens (or a decode
    /// resumed after preemption), a handoff prefill's pin, completions. Requests that leave
    /// the running set go in one pass at the end.
    fn deliver_produced(&mut self, produced: &[RequestId], end_ns: u64, fx: &mut Effects) {
        let mut left_running = false;
        for &id in produced {
            let Some(s) = self.seqs.get(&id) else { continue };
            let first = s.generated == 1;
            let kind = s.kind;
            let done = s.generated >= s.max_output();
            if first {
                fx.facts.push(Fact::FirstTokenEmitted { request: id });
                fx.outputs.push(EngineOutput::FirstToken { request: id });
            } else if let Some(since) = s.stalled_since_ns {
                let stalled_ns = end_ns.saturating_sub(since);
                fx.facts.push(Fact::DecodeResumed { request: id, stalled_ns });
                if let Some(s) = self.seqs.get_mut(&id) {
                    s.stalled_since_ns = None;
                }
            }
            match kind {
                SequenceKind::Source { handoff, lease_ns } => {
                    self.pin_source(id, handoff, lease_ns, end_ns, fx);
                    left_running = true;
                }
                _ if done => {
                    self.end_request_inner(id, TerminalStatus::Completed, fx, true);
                    left_running = true;
                }
                _ => {}
            }
        }
        if left_running {
            let seqs = &self.seqs;
            self.running.retain(|r| seqs.contains_key(r));
        }
    }

    /// A handoff prefill's terminal step: its blocks become held-prefill ownership in one
    /// transition (no completion), and it leaves the running set.
    fn pin_source(
        &mut self,
        id: RequestId,
        handoff: HandoffId,
        lease_ns: u64,
        end_ns: u64,
        fx: &mut Effects,
    ) {
        let Some(s) = self.seqs.remove(&id) else { return };
        let r = self.pool.rekind_all(&s.blocks, Owner::Active, Owner::Pinned);
        self.note_err(r);
        self.live.remove(&id);
        let lease = self.ids.lease();
        let deadline_ns = end_ns.saturating_add(lease_ns);
        let blocks = s.blocks.len() as u32;
        let kv = self.pool.take_delta().plus(slots(-1));
        fx.facts.push(Fact::SourcePinned { handoff, request: id, lease, blocks, deadline_ns, kv });
        fx.outputs.push(EngineOutput::SourcePinned { handoff, request: id, lease, blocks, deadline_ns });
        self.sources.hold(handoff, SourceEntry::Pinned { lease, blocks: s.blocks });
        self.pinned += 1;
    }

    /// Recounts every block's owner references from the core's own owners (requests, pins,
    /// reservations), derives each class by the precedence rule, and checks them against the
    /// pool's counters and structures.
    pub fn try_audit(&self) -> Result<KvCapacitySnapshot, String> {
        let pool_snap = self.pool.audit().map_err(|e| e.to_string())?;
        let n = self.pool.total() as usize;
        let mut refs = vec![[0u32; 3]; n];
        let mut add = |blocks: &[BlockId], o: Owner| -> Result<(), String> {
            for &b in blocks {
                let r = refs.get_mut(b as usize).ok_or_else(|| format!("block {b} out of range"))?;
                r[o as usize] += 1;
            }
            Ok(())
        };
        for id in self.waiting.iter().chain(self.running.iter()) {
            let s = self.seqs.get(id).ok_or_else(|| format!("{id} queued but unknown"))?;
            add(&s.blocks, Owner::Active)?;
        }
        if self.seqs.len() != self.waiting.len() + self.running.len() {
            return Err("a request is neither waiting nor running".into());
        }
        for src in self.sources.values() {
            if let SourceEntry::Pinned { blocks, .. } = src {
                add(blocks, Owner::Pinned)?;
            }
        }
        for d in self.dests.values() {
            if let DestinationEntry::Reserved { blocks, .. } = d {
                add(blocks, Owner::Reserved)?;
            }
        }
        let mut snap = KvCapacitySnapshot::empty(n as u64);
        snap.free_blocks = 0;
        for (b, r) in refs.iter().enumerate() {
            if *r != self.pool.refs_of(b as BlockId) {
                return Err(format!(
                    "block {b}: owners hold {r:?}, pool counts {:?}",
                    self.pool.refs_of(b as BlockId)
                ));
            }
            if r[Owner::Active as usize] > 0 {
                snap.active_blocks += 1;
            } else if r[Owner::Reserved as usize] > 0 {
                snap.reserved_destination_blocks += 1;
            } else if r[Owner::Pinned as usize] > 0 {
                snap.pinned_source_blocks += 1;
            } else if self.pool.hash_of(b as BlockId).is_some() {
                snap.cached_free_blocks += 1;
            } else {
                snap.free_blocks += 1;
            }
        }
        snap.request_slots_used = self.running.len() as u64;
        let mut p = pool_snap;
        p.request_slots_used = snap.request_slots_used;
        if p != snap {
            return Err(format!("pool recount {p:?} != owner recount {snap:?}"));
        }
        let pinned = self.sources.values().filter(|s| matches!(s, SourceEntry::Pinned { .. })).count() as u64;
        let reserved =
            self.dests.values().filter(|d| matches!(d, DestinationEntry::Reserved { .. })).count() as u64;
        if pinned != self.pinned || reserved != self.reserved {
            return Err("pin/reservation counters drifted".into());
        }
        Ok(snap)
    }
}

impl EngineCore for VllmCore {
    fn worker(&self) -> WorkerId {
        self.worker
    }

    fn shape(&self) -> EngineShape {
        self.shape.clone()
    }

    fn submit(&mut self, request: Request, _at_ns: u64) -> CommandResult {
        let mut fx = Effects::default();
        if self.live.contains(&request.id) {
            // No request-level error variant in the shared contract: the nil handoff marks it.
            let e = CommandError::InvalidState {
                handoff: nil_handoff(),
                command: "submit",
                state: "request id already live",
            };
            return self.finish_command(Err(e), fx);
        }
        let outcome = self.enqueue(request, SequenceKind::Plain, &mut fx);
        self.finish_command(outcome, fx)
    }

    fn submit_prefilled(&mut self, request: Request, _at_ns: u64) -> CommandResult {
        let mut fx = Effects::default();
        if self.live.contains(&request.id) {
            let e = CommandError::InvalidState {
                handoff: nil_handoff(),
                command: "submit_prefilled",
                state: "request id already live",
            };
            return self.finish_command(Err(e), fx);
        }
        let outcome = self.enqueue(request, SequenceKind::Prefilled, &mut fx);
        self.finish_command(outcome, fx)
    }

    fn submit_handoff_prefill(
        &mut self,
        handoff: HandoffId,
        request: Request,
        lease_ns: u64,
        _at_ns: u64,
    ) -> CommandResult {
        let mut fx = Effects::default();
        if let Some(outcome) = self.sources.start_answer(handoff) {
            return self.finish_command(outcome, fx);
        }
        if self.live.contains(&request.id) {
            self.sources.refuse(handoff);
            let e = CommandError::InvalidState {
                handoff,
                command: "submit_handoff_prefill",
                state: "request id already live",
            };
            return self.finish_command(Err(e), fx);
        }
        let id = request.id;
        let outcome = self.enqueue(request, SequenceKind::Source { handoff, lease_ns }, &mut fx);
        if outcome == Ok(CommandOutcome::Applied) {
            self.sources.hold(handoff, SourceEntry::Live(id));
        } else {
            self.sources.refuse(handoff);
        }
        self.finish_command(outcome, fx)
    }

    fn reserve_destination(
        &mut self,
        handoff: HandoffId,
        request: Request,
        deadline_ns: u64,
        _at_ns: u64,
    ) -> CommandResult {
        let mut fx = Effects::default();
        if let Some(outcome) = self.dests.start_answer(handoff) {
            return self.finish_command(outcome, fx);
        }
        if self.backend == Backend::TrtLlm {
            // The proposal defers generation-side pre-allocation for TRT-LLM.
            self.dests.refuse(handoff);
            let e = CommandError::Unsupported { backend: "trtllm", what: "destination reservation" };
            return self.finish_command(Err(e), fx);
        }
        if self.live.contains(&request.id) {
            self.dests.refuse(handoff);
            let e = CommandError::InvalidState {
                handoff,
                command: "reserve_destination",
                state: "request id already live",
            };
            return self.finish_command(Err(e), fx);
        }
        let needed = self.peak_blocks(&request, false);
        if needed > self.pool.total() {
            self.dests.refuse(handoff);
            let e = CommandError::NeverFits {
                request: request.id,
                needed_blocks: needed,
                total_blocks: self.pool.total(),
            };
            return self.finish_command(Err(e), fx);
        }
        let tried_epoch = match self.pending.arrival(self.cfg.max_pending_reservations) {
            Arrival::Full => {
                // A refusal the caller must act on: an `Err(InvalidState)` here once left the
                // destination waiting (and renewing its source's lease) forever.
                self.dests.refuse(handoff);
                fx.facts.push(Fact::ReservationRefused { handoff, reason: RejectReason::NoCapacity });
                fx.outputs
                    .push(EngineOutput::ReservationFailed { handoff, reason: RejectReason::NoCapacity });
                return self.finish_command(Ok(CommandOutcome::Applied), fx);
            }
            // FIFO: never overtake a queued reservation.
            Arrival::Queue => None,
            Arrival::TryNow => match self.try_reserve(&request) {
                Some(got) => {
                    self.live.insert(request.id);
                    self.book_reservation(handoff, request, deadline_ns, got, &mut fx);
                    return self.finish_command(Ok(CommandOutcome::Applied), fx);
                }
                None => Some(self.pool.epoch()),
            },
        };
        self.live.insert(request.id);
        self.dests.hold(handoff, DestinationEntry::Pending);
        self.pending.push(handoff, request, deadline_ns, tried_epoch);
        fx.facts.push(Fact::ReservationQueued { handoff });
        if tried_epoch.is_some() {
            fx.facts.push(Fact::ReservationRefused { handoff, reason: RejectReason::NoCapacity });
        }
        self.finish_command(Ok(CommandOutcome::Unavailable), fx)
    }

    fn activate_destination(&mut self, handoff: HandoffId, _at_ns: u64) -> CommandResult {
        let mut fx = Effects::default();
        match self.dests.lookup(handoff) {
            Err(outcome) => return self.finish_command(outcome, fx),
            Ok(DestinationEntry::Pending) => {
                let e = CommandError::InvalidState { handoff, command: "activate", state: "pending" };
                return self.finish_command(Err(e), fx);
            }
            Ok(DestinationEntry::Activated(_)) => return self.finish_command(Ok(CommandOutcome::NoOp), fx),
            Ok(DestinationEntry::Reserved { .. }) => {}
        }
        let Some(DestinationEntry::Reserved { reservation, request, blocks, prefix_blocks, hashes }) =
            self.dests.take(&handoff)
        else {
            return self.finish_command(Err(CommandError::UnknownHandoff(handoff)), fx);
        };
        self.reserved -= 1;
        let r = self.pool.rekind_all(&blocks, Owner::Reserved, Owner::Active);
        self.note_err(r);
        let id = request.id;
        let prompt = request.input_tokens.max(1);
        // Prefix blocks already carry their hashes (never republished); hashing starts at the
        // first fresh page.
        let prefix_hashed = prefix_blocks as usize;
        self.seqs.insert(
            id,
            Sequence {
                hashed: prefix_hashed,
                // Like vLLM's decode after a remote load: every prompt token but the last is
                // valid; the first step recomputes the last one into its existing slot and
                // produces the first output token here (TTFT is observed on the decode worker).
                computed: prompt - 1,
                ..Sequence::new(request, hashes, blocks, SequenceKind::Destination { handoff })
            },
        );
        // Every transferred prompt block is valid now (the last token's recompute rewrites a
        // slot it already has), so publish them all at activation, once.
        let mut runs = Vec::new();
        if let Some(s) = self.seqs.get_mut(&id) {
            s.computed = prompt;
        }
        self.hash_full_blocks(id, &mut runs);
        if let Some(s) = self.seqs.get_mut(&id) {
            s.computed = prompt - 1;
        }
        let kv = self.pool.take_delta();
        fx.facts.push(Fact::DestinationActivated { handoff, reservation, kv });
        Self::push_stored(&mut fx, runs);
        self.waiting.push_back(id);
        self.dests.hold(handoff, DestinationEntry::Activated(id));
        let done = self.seqs.get(&id).map(|s| s.generated >= s.max_output()).unwrap_or(false);
        if done {
            // The prefill's first token was the only one asked for.
            self.end_request(id, TerminalStatus::Completed, &mut fx);
        }
        self.finish_command(Ok(CommandOutcome::Applied), fx)
    }

    fn release_source(&mut self, handoff: HandoffId, reason: EndReason, _at_ns: u64) -> CommandResult {
        let mut fx = Effects::default();
        match self.sources.lookup(handoff) {
            Err(outcome) => return self.finish_command(outcome, fx),
            Ok(SourceEntry::Live(_)) => {
                let e = CommandError::InvalidState { handoff, command: "release_source", state: "computing" };
                return self.finish_command(Err(e), fx);
            }
            Ok(SourceEntry::Pinned { .. }) => {}
        }
        if let Some(SourceEntry::Pinned { lease, blocks }) = self.sources.end(handoff) {
            self.release_all(&blocks, Owner::Pinned);
            self.pinned -= 1;
            let kv = self.pool.take_delta();
            fx.facts.push(Fact::SourceReleased { handoff, lease, reason, kv });
        }
        self.finish_command(Ok(CommandOutcome::Applied), fx)
    }

    fn cancel_source(&mut self, handoff: HandoffId, reason: CancelReason, _at_ns: u64) -> CommandResult {
        let mut fx = Effects::default();
        match self.sources.end_held(handoff) {
            Err(outcome) => self.finish_command(outcome, fx),
            Ok(SourceEntry::Live(id)) => {
                // Queued: dropped; computing: aborted. Either way its blocks return at once.
                self.end_request(id, TerminalStatus::Canceled, &mut fx);
                self.finish_command(Ok(CommandOutcome::Applied), fx)
            }
            Ok(SourceEntry::Pinned { lease, blocks }) => {
                self.release_all(&blocks, Owner::Pinned);
                self.pinned -= 1;
                let kv = self.pool.take_delta();
                fx.facts.push(Fact::SourceReleased {
                    handoff,
                    lease,
                    reason: EndReason::Canceled(reason),
                    kv,
                });
                self.finish_command(Ok(CommandOutcome::Applied), fx)
            }
        }
    }

    fn cancel_destination(&mut self, handoff: HandoffId, reason: CancelReason, _at_ns: u64) -> CommandResult {
        let mut fx = Effects::default();
        match self.dests.end_held(handoff) {
            Err(outcome) => self.finish_command(outcome, fx),
            Ok(DestinationEntry::Pending) => {
                if let Some(p) = self.pending.remove(handoff) {
                    self.live.remove(&p.request.id);
                }
                fx.facts.push(Fact::ReservationDequeued { handoff, reason });
                self.finish_command(Ok(CommandOutcome::Applied), fx)
            }
            Ok(DestinationEntry::Reserved { reservation, request, blocks, .. }) => {
                self.release_all(&blocks, Owner::Reserved);
                self.reserved -= 1;
                self.live.remove(&request.id);
                let kv = self.pool.take_delta();
                fx.facts.push(Fact::ReservationReleased {
                    handoff,
                    reservation,
                    reason: EndReason::Canceled(reason),
                    kv,
                });
                self.finish_command(Ok(CommandOutcome::Applied), fx)
            }
            Ok(DestinationEntry::Activated(id)) => {
                self.end_request(id, TerminalStatus::Canceled, &mut fx);
                self.finish_command(Ok(CommandOutcome::Applied), fx)
            }
        }
    }

    fn step(&mut self, at_ns: u64) -> StepOutput {
        let mut fx = self.spare.take().unwrap_or_default();
        let mut step_acc = self.pool.take_delta();
        let mut budget = self.cfg.max_num_batched_tokens as u64;
        let mut scheduled = std::mem::take(&mut self.scratch_scheduled);
        scheduled.clear();

        // 1. Running requests, in scheduling order; make room by preempting from the back.
        let preempted = self.schedule_running(at_ns, &mut budget, &mut scheduled, &mut fx, &mut step_acc);

        // 2. Waiting requests, FIFO, unless this step preempted (vLLM does not admit then).
        if !preempted {
            self.admit_waiting(&mut budget, &mut scheduled, &mut fx, &mut step_acc);
        }

        // 3. Liveness: nothing runs and the head is blocked. Waiting requests that hold KV
        // (activated destinations) can only give it back by running, so the first of them that
        // fits bypasses the head; if none fits, the first is admitted without compute and the
        // next step's LIFO preemption returns its blocks to the cache.
        if !preempted && self.running.is_empty() && scheduled.is_empty() && budget > 0 {
            self.unblock(&mut fx, &mut step_acc, budget, &mut scheduled);
        }

        if scheduled.is_empty() {
            // Nothing runnable now (empty, or the head waits for capacity held elsewhere).
            self.retry_pending(&mut fx);
            self.scratch_scheduled = scheduled;
            return StepOutput { effects: fx, duration_ns: 0 };
        }

        // 4. Compute: advance tokens, hash and publish newly full blocks.
        let mut produced = std::mem::take(&mut self.scratch_produced);
        produced.clear();
        let mut runs = Vec::new();
        let (prefill_tokens, decode_tokens) = self.compute(&scheduled, &mut produced, &mut runs);
        step_acc = step_acc.plus(self.pool.take_delta());
        let duration_ns = self.step_duration(prefill_tokens, decode_tokens);
        fx.facts.push(Fact::StepExecuted {
            prefill_tokens: prefill_tokens as u32,
            decode_tokens: decode_tokens as u32,
            batch_size: scheduled.len() as u32,
            duration_ns,
            kv: step_acc,
        });
        Self::push_stored(&mut fx, runs);

        // 5. Tokens produced: first tokens, pins, completions.
        self.deliver_produced(&produced, at_ns.saturating_add(duration_ns), &mut fx);
        self.retry_pending(&mut fx);
        self.scratch_scheduled = scheduled;
        self.scratch_produced = produced;
        StepOutput { effects: fx, duration_ns }
    }

    fn is_empty(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    fn is_drained(&self) -> bool {
        self.is_empty() && self.sources.is_empty() && self.dests.is_empty() && self.pending.is_empty()
    }

    fn snapshot(&self) -> KvCapacitySnapshot {
        let mut s = self.pool.snapshot_blocks();
        s.request_slots_used = self.running.len() as u64;
        s
    }

    fn audit(&self) -> KvCapacitySnapshot {
        // A failed audit returns an impossible snapshot (zero total) so it never equals snapshot().
        self.try_audit().unwrap_or_default()
    }

    fn view(&self) -> SchedulerView {
        SchedulerView {
            waiting: self.waiting.len() as u64,
            running: self.running.len() as u64,
            waiting_for_remote_kv: self.reserved,
            held_prefills: self.pinned,
            pending_reservations: self.pending.len() as u64,
        }
    }
    fn quiet_steps(&self) -> Option<QuietSteps> {
        // Nothing may be admitted, retried or accounted between steps.
        if self.running.is_empty() || !self.waiting.is_empty() || !self.pool.is_quiet() {
            return None;
        }
        if self.running.len() as u64 > self.cfg.max_num_batched_tokens as u64 {
            return None;
        }
        // `retry_pending` does nothing while the head was tried at this capacity epoch (quiet
        // steps never change it).
        if self.pending.head_is_due(self.pool.epoch()) {
            return None;
        }
        // The duration comes from the decode memo, keyed by active KV, which no quiet step
        // changes.
        let bs = self.bs() as u64;
        let active_kv_tokens = self.pool.active_blocks() * bs;
        let duration_ns = match self.last_decode_timing {
            Some((active, ns)) if active == active_kv_tokens => ns,
            _ => return None,
        };
        let mut steps = u64::MAX;
        for id in &self.running {
            let s = self.seqs.get(id)?;
            if s.is_prefilling() || s.generated == 0 || matches!(s.kind, SequenceKind::Source { .. }) {
                return None;
            }
            let (computed, generated) = (s.computed as u64, s.generated as u64);
            // Step `i` of the run needs `computed + i` tokens of KV in the blocks held…
            steps = steps.min((s.blocks.len() as u64 * bs).saturating_sub(computed));
            // …must not produce the last token (which ends the request)…
            steps = steps.min((s.max_output() as u64).saturating_sub(generated + 1));
            // …and must not fill the next block to hash.
            if self.cfg.enable_prefix_caching && s.hashed < s.blocks.len() {
                steps = steps.min(((s.hashed as u64 + 1) * bs).saturating_sub(computed + 1));
            }
            if steps == 0 {
                return None;
            }
        }
        Some(QuietSteps {
            steps,
            batch: self.running.len() as u32,
            durations: QuietDurations::Same(duration_ns),
        })
    }

    fn advance_quiet(&mut self, steps: u64) {
        let steps = steps as u32;
        for id in &self.running {
            if let Some(s) = self.seqs.get_mut(id) {
                s.computed += steps;
                s.generated += steps;
            }
        }
    }

    fn recycle(&mut self, mut effects: Effects) {
        effects.facts.clear();
        effects.outputs.clear();
        self.spare = Some(effects);
    }
}
