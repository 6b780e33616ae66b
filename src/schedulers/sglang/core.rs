//! `SglangCore`: the SGLang-like scheduler. See the module docs in `mod.rs` for the model.

use super::config::{ConfigError, SglangConfig};
use super::radix::{Holder, Kind, KvPool};
use crate::events::{BlockHash, EngineShape, Fact, KvDelta, RejectReason, TerminalStatus};
use crate::ids::{
    CancelReason, DestinationReservationId, EndReason, HandoffId, RequestId, SourceLeaseId, WorkerId,
};
use crate::model::capacity::KvCapacitySnapshot;
use crate::schedulers::handoffs::{Arrival, HandoffTable, PendingReservations, ResourceIds};
use crate::schedulers::request::{decode_block_hash, ROOT_HASH};
use crate::schedulers::{
    CommandError, CommandOutcome, CommandResult, Effects, EngineCore, EngineOutput, QuietDurations,
    QuietSteps, Request, ReservationSummary, SchedulerView, StepOutput, StepShape, TimingModel,
};
use std::collections::VecDeque;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Queued without KV (new, or retracted).
    Waiting,
    /// Part of the prompt computed; holds a slot and KV.
    Chunking,
    /// In the decode batch.
    Running,
    /// Destination pre-allocated, waiting for remote KV.
    Reserved,
    /// Destination activated, waiting to join the decode batch (SGLang's prebuilt queue).
    Prebuilt,
    /// Handoff prefill finished; KV pinned for the reader.
    Pinned,
}

#[derive(Clone, Debug)]
struct SourceInfo {
    handoff: HandoffId,
    lease_ns: u64,
    lease: Option<SourceLeaseId>,
}

#[derive(Clone, Debug)]
struct DestinationInfo {
    handoff: HandoffId,
    reservation: DestinationReservationId,
    /// Headroom tokens booked; returned once at the request's terminal outcome.
    headroom: u32,
}

#[derive(Clone, Debug)]
struct RequestState {
    request: Request,
    /// Page hashes: the prompt's full pages, then decode pages (filled in on demand).
    hashes: Vec<BlockHash>,
    holder: Holder,
    /// Tokens whose KV is computed.
    kv_len: u32,
    /// Tokens the current prefill must have KV for (prompt + output so far).
    fill: u32,
    /// Output tokens produced so far.
    output: u32,
    /// Output tokens to produce (at least one: a prefill always samples one).
    target: u32,
    phase: Phase,
    has_slot: bool,
    retracted: bool,
    /// Disabled policy's decode: the prompt's KV arrived with the request (see
    /// `EngineCore::submit_prefilled`); pages are taken and published at admission.
    prefilled: bool,
    /// When a retraction interrupted its output (the start of the decode step that retracted
    /// it, right after its previous token); cleared by its next token.
    stalled_since_ns: Option<u64>,
    source: Option<SourceInfo>,
    dest: Option<DestinationInfo>,
}

#[derive(Clone, Copy, Debug)]
enum DestinationEntry {
    Pending,
    Live(usize),
}

/// What a prefill batch may still take, in tokens.
struct PrefillBudget {
    /// KV: free and evictable tokens, less what decoding requests keep back
    /// (`new_token_ratio` × their clipped remaining output).
    total: i64,
    /// Prompt tokens (`max_prefill_tokens`; the batch's first request may exceed it).
    input: i64,
    /// Chunk tokens (`chunked_prefill_size`).
    chunk: i64,
}

/// The chunked request's next chunk: (request key, tokens, pages to allocate).
type Continuation = (usize, u32, u32);

/// An SGLang-like engine core: pages, a radix prefix cache with lock references, a request-slot
/// pool, `new_token_ratio` admission with retraction, chunked prefill, destination
/// pre-allocation and source pinning.
pub struct SglangCore {
    worker: WorkerId,
    cfg: SglangConfig,
    config_json: String,
    pool: KvPool,
    reqs: Vec<Option<RequestState>>,
    spare_keys: Vec<usize>,
    waiting: VecDeque<usize>,
    chunking: Option<usize>,
    running: Vec<usize>,
    prebuilt: VecDeque<usize>,
    pending: PendingReservations,
    /// Handoff prefills by handoff: the key of their request.
    sources: HandoffTable<usize>,
    dests: HandoffTable<DestinationEntry>,
    slots_used: u32,
    headroom_tokens: u64,
    n_reserved: u32,
    n_pinned: u32,
    retracted_waiting: u32,
    new_token_ratio: f64,
    /// Capacity changes other than freed pages (slots, headroom, retracted requests re-admitted).
    own_epoch: u64,
    ids: ResourceIds,
}

fn outcome_ok(o: CommandOutcome, effects: Effects) -> CommandResult {
    CommandResult { outcome: Ok(o), effects }
}

fn outcome_err(e: CommandError, effects: Effects) -> CommandResult {
    CommandResult { outcome: Err(e), effects }
}

impl SglangCore {
    pub fn new(worker: WorkerId, config: SglangConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let config_json = serde_json::to_string(&config).unwrap_or_default();
        Ok(SglangCore {
            worker,
            pool: KvPool::new(config.total_pages),
            new_token_ratio: config.init_new_token_ratio,
            cfg: config,
            config_json,
            reqs: Vec::new(),
            spare_keys: Vec::new(),
            waiting: VecDeque::new(),
            chunking: None,
            running: Vec::new(),
            prebuilt: VecDeque::new(),
            pending: PendingReservations::new(),
            sources: HandoffTable::new(),
            dests: HandoffTable::new(),
            slots_used: 0,
            headroom_tokens: 0,
            n_reserved: 0,
            n_pinned: 0,
            retracted_waiting: 0,
            own_epoch: 0,
            ids: ResourceIds::starting_at(0),
        })
    }

    pub fn config(&self) -> &SglangConfig {
        &self.cfg
    }

    /// The current `new_token_ratio` (tests and diagnostics).
    pub fn new_token_ratio(&self) -> f64 {
        self.new_token_ratio
    }

    /// Cached pages in the radix tree (tests and diagnostics).
    pub fn cached_pages(&self) -> usize {
        self.pool.cached_nodes()
    }

    // ----- small helpers -----

    fn page(&self) -> u32 {
        self.cfg.page_size
    }

    fn pages_for(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.page())
    }

    fn total_tokens(&self) -> u64 {
        self.cfg.total_pages as u64 * self.page() as u64
    }

    fn epoch(&self) -> u64 {
        self.pool.freed_epoch + self.own_epoch
    }

    fn req(&self, key: usize) -> Option<&RequestState> {
        self.reqs.get(key).and_then(|r| r.as_ref())
    }

    fn insert_req(&mut self, r: RequestState) -> usize {
        match self.spare_keys.pop() {
            Some(k) => {
                self.reqs[k] = Some(r);
                k
            }
            None => {
                self.reqs.push(Some(r));
                self.reqs.len() - 1
            }
        }
    }

    fn new_req(&self, request: Request, target: u32) -> RequestState {
        let hashes = request.prompt_block_hashes(self.page());
        RequestState {
            // An empty prompt still feeds one token to sample from.
            fill: request.input_tokens.max(1),
            request,
            hashes,
            holder: Holder::new(Kind::Active),
            kv_len: 0,
            output: 0,
            target: target.max(1),
            phase: Phase::Waiting,
            has_slot: false,
            retracted: false,
            prefilled: false,
            stalled_since_ns: None,
            source: None,
            dest: None,
        }
    }

    /// Makes sure `r.hashes` names the first `n` pages (decode pages get request-unique hashes).
    fn ensure_hashes(r: &mut RequestState, n: usize) {
        while r.hashes.len() < n {
            let i = r.hashes.len();
            let parent = r.hashes.last().copied().unwrap_or(ROOT_HASH);
            r.hashes.push(decode_block_hash(parent, r.request.id, i as u32));
        }
    }

    /// Pending evictions become a `KvRemoved` fact; then `make` gets the pending delta.
    fn emit(&mut self, eff: &mut Effects, make: impl FnOnce(KvDelta) -> Fact) {
        self.flush_removed(eff);
        let kv = self.pool.take_acc();
        eff.facts.push(make(kv));
    }

    fn flush_removed(&mut self, eff: &mut Effects) {
        if !self.pool.removed.is_empty() {
            let blocks = std::mem::take(&mut self.pool.removed);
            eff.facts.push(Fact::KvRemoved { blocks });
        }
    }

    /// One decode step without retraction lowers `new_token_ratio` toward its floor.
    fn decay_new_token_ratio(&mut self) {
        let decay = (self.cfg.init_new_token_ratio - self.cfg.min_new_token_ratio)
            / self.cfg.new_token_ratio_decay_steps as f64;
        self.new_token_ratio = (self.new_token_ratio - decay).max(self.cfg.min_new_token_ratio);
    }

    fn take_slot(&mut self) {
        self.slots_used += 1;
        self.pool.acc.slots += 1;
    }

    fn give_slot(&mut self) {
        self.slots_used -= 1;
        self.pool.acc.slots -= 1;
        self.own_epoch += 1;
    }

    /// Pages needed for the whole sequence; more than the worker has means it can never run.
    fn never_fits(&self, input: u32, target: u32, extra: u32) -> Option<u64> {
        let need = (input as u64 + (target.max(1) as u64)).max(input as u64 + extra as u64);
        let pages = need.div_ceil(self.page() as u64);
        (pages > self.cfg.total_pages as u64).then_some(pages)
    }

    fn reject(&mut self, request: RequestId, pages: u64) -> CommandResult {
        let mut eff = Effects::default();
        eff.facts.push(Fact::RequestRejected { request, reason: RejectReason::NeverFits });
        eff.outputs.push(EngineOutput::Rejected { request, reason: RejectReason::NeverFits });
        outcome_err(
            CommandError::NeverFits {
                request,
                needed_blocks: pages,
                total_blocks: self.cfg.total_pages as u64,
            },
            eff,
        )
    }

    fn enqueue(&mut self, r: RequestState, eff: &mut Effects) -> bool {
        if self.waiting.len() >= self.cfg.max_waiting_requests as usize {
            let request = r.request.id;
            eff.facts.push(Fact::RequestRejected { request, reason: RejectReason::NoCapacity });
            eff.outputs.push(EngineOutput::Rejected { request, reason: RejectReason::NoCapacity });
            return false;
        }
        let id = r.request.id;
        let key = self.insert_req(r);
        self.waiting.push_back(key);
        eff.facts.push(Fact::RequestQueued { request: id });
        true
    }

    // ----- request endings -----

    /// Caches the request's computed full pages (KvStored), unlocks its path and frees the rest.
    fn release_kv_cached(&mut self, key: usize, eff: &mut Effects) {
        let page = self.page();
        let Some(r) = self.reqs.get_mut(key).and_then(|r| r.as_mut()) else {
            return;
        };
        let full = (r.kv_len / page) as usize;
        Self::ensure_hashes(r, full);
        let stored = self.pool.insert(&mut r.holder, &r.hashes, full);
        self.pool.release(&mut r.holder);
        if let Some(f) = stored {
            eff.facts.push(f);
        }
    }

    /// Ends a request that holds no reservation or pin: caches its KV, returns its slot and
    /// headroom, and emits `RequestFinished`. The caller has already removed it from queues.
    fn finish(&mut self, key: usize, status: TerminalStatus, eff: &mut Effects) {
        self.release_kv_cached(key, eff);
        let Some(r) = self.reqs.get_mut(key).and_then(|r| r.take()) else {
            return;
        };
        self.spare_keys.push(key);
        if r.has_slot {
            self.give_slot();
        }
        if r.retracted {
            self.retracted_waiting -= 1;
            self.own_epoch += 1;
        }
        if let Some(d) = &r.dest {
            self.return_headroom(d.headroom);
            self.dests.end(d.handoff);
        }
        if let Some(s) = &r.source {
            self.sources.end(s.handoff);
        }
        let (request, output_tokens) = (r.request.id, r.output);
        self.emit(eff, |kv| Fact::RequestFinished { request, status, output_tokens, kv });
        eff.outputs.push(EngineOutput::Finished { request, status, output_tokens });
    }

    fn return_headroom(&mut self, tokens: u32) {
        self.headroom_tokens -= tokens as u64;
        self.pool.acc.headroom_tokens -= tokens as i32;
        self.own_epoch += 1;
    }

    /// Removes a request from whichever runnable queue holds it.
    fn unqueue(&mut self, key: usize) {
        if self.chunking == Some(key) {
            self.chunking = None;
        }
        self.waiting.retain(|&k| k != key);
        self.running.retain(|&k| k != key);
        self.prebuilt.retain(|&k| k != key);
    }

    // ----- destination pre-allocation -----

    /// Requests that will decode here and are promised headroom: running, chunking, prebuilt
    /// and reserved (transferring).
    fn decoding_count(&self) -> u64 {
        self.running.len() as u64
            + self.chunking.is_some() as u64
            + self.prebuilt.len() as u64
            + self.n_reserved as u64
    }

    /// One reservation attempt. On success the request is retained as a `Reserved` holder.
    fn try_reserve(
        &mut self,
        handoff: HandoffId,
        r: &Request,
        deadline_ns: u64,
        eff: &mut Effects,
    ) -> Result<(), RejectReason> {
        if self.slots_used >= self.cfg.max_running_requests {
            return Err(RejectReason::NoSlot);
        }
        if self.retracted_waiting > 0 {
            // Nothing new pre-allocates while retracted requests wait to run again.
            return Err(RejectReason::NoCapacity);
        }
        let page = self.page() as i64;
        let hashes = r.prompt_block_hashes(self.page());
        let prefix = self.pool.match_prefix(&hashes, hashes.len());
        let prefix_tokens = prefix.len() as u32 * self.page();
        let prompt_pages = self.pages_for(r.input_tokens);
        let delta_pages = prompt_pages.saturating_sub(prefix.len() as u32);
        let unlocked = self.pool.unlocked_count(&prefix);
        let reserved = self.cfg.num_reserved_decode_tokens as i64;
        let retractable: i64 = self
            .running
            .iter()
            .filter_map(|&k| self.req(k))
            .map(|q| q.request.input_tokens as i64 + q.output as i64)
            .sum();
        let missing = r.input_tokens as i64 - prefix_tokens as i64;
        let clip = r.output_tokens.min(self.cfg.clip_max_new_tokens) as i64;
        let need = (missing + reserved).max(missing + clip - retractable).max(0);
        let need = (need + page - 1) / page * page;
        let available = (self.pool.available() as i64 - unlocked as i64) * page;
        let promised = reserved * self.decoding_count() as i64;
        if need > available - promised || delta_pages as u64 > self.pool.available() - unlocked {
            return Err(RejectReason::NoCapacity);
        }
        // Commit: lock the prefix snapshot, allocate the delta, take a slot, book headroom.
        let mut req = self.new_req(r.clone(), r.output_tokens);
        req.holder.kind = Kind::Reserved;
        self.pool.lock_path(&mut req.holder, &prefix);
        if !self.pool.alloc(&mut req.holder, delta_pages) {
            // Unreachable by the check above; unwind rather than panic.
            self.pool.release(&mut req.holder);
            let _ = self.pool.take_acc();
            return Err(RejectReason::NoCapacity);
        }
        self.take_slot();
        req.has_slot = true;
        self.headroom_tokens += reserved as u64;
        self.pool.acc.headroom_tokens += reserved as i32;
        let reservation = self.ids.reservation();
        req.dest = Some(DestinationInfo { handoff, reservation, headroom: reserved as u32 });
        req.phase = Phase::Reserved;
        let request = req.request.id;
        let key = self.insert_req(req);
        self.n_reserved += 1;
        self.dests.hold(handoff, DestinationEntry::Live(key));
        let prefix_blocks = prefix.len() as u32;
        self.emit(eff, |kv| Fact::DestinationReserved {
            handoff,
            request,
            reservation,
            pages: delta_pages,
            prefix_blocks,
            prefix_tokens,
            deadline_ns,
            kv,
        });
        let missing_tokens = (r.input_tokens - prefix_tokens).div_ceil(self.page()) * self.page();
        eff.outputs.push(EngineOutput::DestinationReserved {
            handoff,
            reservation,
            summary: ReservationSummary { pages: delta_pages, prefix_blocks, prefix_tokens, missing_tokens },
        });
        Ok(())
    }

    /// Retries the FIFO head while capacity changed since its last attempt (a never-tried head
    /// is always tried). Called at the end of every command and step.
    fn retry_pending(&mut self, eff: &mut Effects) {
        while let Some(p) = self.pending.take_due(self.epoch()) {
            if let Err(reason) = self.try_reserve(p.handoff, &p.request, p.deadline_ns, eff) {
                let handoff = p.handoff;
                self.pending.put_back(p, self.epoch());
                eff.facts.push(Fact::ReservationRefused { handoff, reason });
                return;
            }
        }
    }

    // ----- scheduling -----

    /// Tokens prefill admission keeps back for requests that will decode: their clipped
    /// remaining output times `new_token_ratio`.
    fn decode_reservation_tokens(&self) -> u64 {
        let clip = self.cfg.clip_max_new_tokens;
        let mut sum = 0.0f64;
        let keys = self.running.iter().chain(self.prebuilt.iter());
        for &k in keys {
            if let Some(r) = self.req(k) {
                sum += r.target.saturating_sub(r.output).min(clip) as f64;
            }
        }
        (sum * self.new_token_ratio).ceil() as u64
    }

    /// Builds and runs a prefill batch. Returns (prefill tokens, batch size) or None when no
    /// prefill can run.
    fn prefill_pass(
        &mut self,
        eff: &mut Effects,
        step_kv: &mut KvDelta,
        done: &mut Vec<usize>,
    ) -> Option<(u32, u32)> {
        let page = self.page();
        let mut budget = PrefillBudget {
            total: (self.pool.available() * page as u64) as i64 - self.decode_reservation_tokens() as i64,
            input: self.cfg.max_prefill_tokens as i64,
            chunk: self.cfg.chunked_prefill_size as i64,
        };
        let mut batch: Vec<(usize, u32)> = Vec::new();
        let cont = self.plan_continuation(&mut budget);
        self.admit_for_prefill(&mut budget, cont, &mut batch, eff);

        // The continuation allocates after admissions, from the pages it was promised.
        if let Some((k, chunk, pages)) = cont {
            if let Some(r) = self.reqs.get_mut(k).and_then(|r| r.as_mut()) {
                if self.pool.alloc(&mut r.holder, pages) {
                    batch.insert(0, (k, chunk));
                }
            }
        }
        if batch.is_empty() {
            *step_kv = step_kv.plus(self.pool.take_acc());
            return None;
        }
        let tokens = self.forward_prefill(&batch, eff, done);
        *step_kv = step_kv.plus(self.pool.take_acc());
        Some((tokens, batch.len() as u32))
    }

    /// The request being chunked continues first: its next chunk (key, tokens, pages to
    /// allocate), taken from `budget`. It is bounded by chunk size and by the pages physically
    /// available (not by the estimate, which it already passed).
    fn plan_continuation(&self, budget: &mut PrefillBudget) -> Option<Continuation> {
        let page = self.page();
        if let Some(k) = self.chunking {
            if let Some(r) = self.req(k) {
                let mut end = r.fill.min(r.kv_len.saturating_add(budget.chunk as u32));
                if end < r.fill {
                    end = end / page * page; // a non-final chunk ends on a page boundary
                }
                let max_pages = r.holder.pages() as u64 + self.pool.available();
                if self.pages_for(end) as u64 > max_pages {
                    end = r.fill.min((max_pages * page as u64).min(u32::MAX as u64) as u32);
                    if end < r.fill {
                        end = end / page * page;
                    }
                }
                let chunk = end.saturating_sub(r.kv_len);
                let pages = self.pages_for(end).saturating_sub(r.holder.pages());
                if chunk > 0 {
                    budget.chunk -= chunk as i64;
                    budget.input -= chunk as i64;
                    budget.total -= pages as i64 * page as i64;
                    return Some((k, chunk, pages));
                }
            }
        }
        None
    }

    /// Admits new (or retracted) requests into the prefill batch, FIFO, while a slot is free
    /// and `budget` holds (after the continuation `cont`, whose pages are promised): each
    /// locks its cached prefix, takes pages for its chunk and a slot (`RequestScheduled`).
    fn admit_for_prefill(
        &mut self,
        budget: &mut PrefillBudget,
        cont: Option<Continuation>,
        batch: &mut Vec<(usize, u32)>,
        eff: &mut Effects,
    ) {
        let page = self.page();
        let pages_promised: u64 = cont.map(|c| c.2 as u64).unwrap_or(0);
        let mut chunk_taken = self.chunking.is_some();
        while let Some(&k) = self.waiting.front() {
            if self.slots_used >= self.cfg.max_running_requests || budget.chunk <= 0 {
                break;
            }
            let clip = self.cfg.clip_max_new_tokens;
            let Some(r) = self.reqs.get_mut(k).and_then(|r| r.as_mut()) else {
                self.waiting.pop_front();
                continue;
            };
            let fill = r.fill;
            let max_match = (fill.saturating_sub(1) / page) as usize;
            Self::ensure_hashes(r, max_match);
            let prefix = self.pool.match_prefix(&r.hashes[..max_match.min(r.hashes.len())], max_match);
            let Some(r) = self.reqs[k].as_ref() else {
                break;
            };
            let prefix_tokens = prefix.len() as u32 * page;
            let extend = fill - prefix_tokens;
            let future = r.target.saturating_sub(r.output).min(clip);
            let total = extend as i64 + future as i64;
            let unlocked = self.pool.unlocked_count(&prefix);
            if total + (unlocked * page as u64) as i64 > budget.total {
                break;
            }
            let real_input = extend.div_ceil(page) * page;
            // Only the batch's first request may exceed max_prefill_tokens.
            if real_input as i64 > budget.input && (!batch.is_empty() || cont.is_some()) {
                break;
            }
            let chunk = if (extend as i64) <= budget.chunk {
                extend
            } else {
                if chunk_taken {
                    break;
                }
                (budget.chunk as u32) / page * page
            };
            if chunk == 0 {
                break;
            }
            let pages = self.pages_for(prefix_tokens + chunk) - prefix.len() as u32;
            let avail = self.pool.available().saturating_sub(unlocked).saturating_sub(pages_promised);
            if pages as u64 > avail {
                break;
            }
            // Admit.
            self.waiting.pop_front();
            let Some(r) = self.reqs.get_mut(k).and_then(|r| r.as_mut()) else {
                continue;
            };
            self.pool.lock_path(&mut r.holder, &prefix);
            let ok = self.pool.alloc(&mut r.holder, pages);
            debug_assert!(ok);
            r.kv_len = prefix_tokens;
            r.has_slot = true;
            let was_retracted = std::mem::replace(&mut r.retracted, false);
            let request = r.request.id;
            if chunk < extend {
                r.phase = Phase::Chunking;
                chunk_taken = true;
                self.chunking = Some(k);
                budget.total -= chunk as i64;
            } else {
                r.phase = Phase::Running;
                budget.total -= total;
            }
            budget.total -= (unlocked * page as u64) as i64;
            if was_retracted {
                self.retracted_waiting -= 1;
                self.own_epoch += 1;
            }
            self.take_slot();
            self.emit(eff, |kv| Fact::RequestScheduled { request, cached_tokens: prefix_tokens, kv });
            budget.input -= (chunk.div_ceil(page) * page) as i64;
            budget.chunk -= chunk as i64;
            batch.push((k, chunk));
        }
    }

    /// The forward pass of a prefill batch: each chunk's KV becomes valid and its full pages
    /// enter the tree; requests whose prefill is complete go to `done`. Returns the tokens
    /// computed.
    fn forward_prefill(&mut self, batch: &[(usize, u32)], eff: &mut Effects, done: &mut Vec<usize>) -> u32 {
        let page = self.page();
        let mut tokens = 0u32;
        for &(k, chunk) in batch {
            let Some(r) = self.reqs.get_mut(k).and_then(|r| r.as_mut()) else {
                continue;
            };
            r.kv_len += chunk;
            tokens += chunk;
            let full = (r.kv_len / page) as usize;
            Self::ensure_hashes(r, full);
            if let Some(f) = self.pool.insert(&mut r.holder, &r.hashes, full) {
                eff.facts.push(f);
            }
            if r.kv_len >= r.fill {
                done.push(k);
            }
        }
        tokens
    }

    /// Admits prefilled requests (Disabled policy's decode) at the head of the waiting queue,
    /// FIFO: each takes a slot and the pages its prompt needs beyond the cached prefix, which
    /// become valid (and published) at once; it joins the decode batch, whose next step makes
    /// its first token. A head that does not fit blocks the queue, as admission does.
    fn admit_prefilled(&mut self, eff: &mut Effects) {
        let page = self.page();
        while let Some(&k) = self.waiting.front() {
            if self.slots_used >= self.cfg.max_running_requests {
                return;
            }
            let Some(r) = self.req(k) else {
                self.waiting.pop_front();
                continue;
            };
            if !r.prefilled {
                return;
            }
            let prompt_pages = (r.request.input_tokens / page) as usize;
            let prefix = self.pool.match_prefix(&r.hashes[..prompt_pages.min(r.hashes.len())], prompt_pages);
            let pages = self.pages_for(r.request.input_tokens).saturating_sub(prefix.len() as u32);
            let unlocked = self.pool.unlocked_count(&prefix);
            if pages as u64 > self.pool.available().saturating_sub(unlocked) {
                return;
            }
            self.waiting.pop_front();
            let Some(r) = self.reqs.get_mut(k).and_then(|r| r.as_mut()) else {
                continue;
            };
            self.pool.lock_path(&mut r.holder, &prefix);
            let ok = self.pool.alloc(&mut r.holder, pages);
            debug_assert!(ok, "checked above");
            r.kv_len = r.request.input_tokens;
            r.fill = r.kv_len;
            r.has_slot = true;
            r.phase = Phase::Running;
            let full = (r.kv_len / page) as usize;
            let stored = self.pool.insert(&mut r.holder, &r.hashes, full);
            let (request, cached_tokens) = (r.request.id, prefix.len() as u32 * page);
            self.take_slot();
            self.running.push(k);
            self.emit(eff, |kv| Fact::RequestScheduled { request, cached_tokens, kv });
            if let Some(f) = stored {
                eff.facts.push(f);
            }
        }
    }

    /// Activated destinations (the prebuilt queue) join the decode batch, with no forward pass
    /// for them; one whose only token came from the source ends here.
    fn join_prebuilt(&mut self, eff: &mut Effects) {
        while let Some(k) = self.prebuilt.pop_front() {
            let Some(r) = self.reqs.get_mut(k).and_then(|r| r.as_mut()) else {
                continue;
            };
            r.phase = Phase::Running;
            let (request, cached_tokens, finished) = (r.request.id, r.kv_len, r.output >= r.target);
            self.emit(eff, |kv| Fact::RequestScheduled { request, cached_tokens, kv });
            if finished {
                self.finish(k, TerminalStatus::Completed, eff);
            } else {
                self.running.push(k);
            }
        }
    }

    /// The decode pass: retracts until every running request can grow by a token (resetting
    /// `new_token_ratio`, or decaying it when none was retracted), then advances each by one
    /// token. Prefilled requests' first tokens go to `first_tokens`. Returns the step's shape.
    fn decode_pass(
        &mut self,
        at_ns: u64,
        eff: &mut Effects,
        step_kv: &mut KvDelta,
        first_tokens: &mut Vec<RequestId>,
    ) -> StepShape {
        let retracted = self.retract_for_decode(at_ns, eff);
        if retracted {
            self.new_token_ratio = self.cfg.init_new_token_ratio;
        } else {
            self.decay_new_token_ratio();
        }
        let page = self.page();
        let mut active_kv = 0u64;
        for &k in &self.running {
            let Some(r) = self.reqs.get_mut(k).and_then(|r| r.as_mut()) else {
                continue;
            };
            active_kv += r.kv_len as u64;
            if r.kv_len % page == 0 {
                let ok = self.pool.alloc(&mut r.holder, 1);
                debug_assert!(ok, "retraction guarantees growth pages");
            }
            if r.output == 0 {
                first_tokens.push(r.request.id); // a prefilled request's first token
            }
            r.kv_len += 1;
            r.output += 1;
        }
        *step_kv = step_kv.plus(self.pool.take_acc());
        StepShape {
            decode_requests: self.running.len() as u64,
            active_kv_tokens: active_kv,
            total_kv_tokens: self.total_tokens(),
            ..StepShape::default()
        }
    }

    /// The results of a prefill pass, observed at `end_ns`: a request whose prefill completed
    /// samples its token (its first, or the one after a retraction), then a handoff prefill
    /// pins, a finished request ends, and any other joins the decode batch.
    fn prefill_results(&mut self, done: Vec<usize>, end_ns: u64, eff: &mut Effects) {
        for k in done {
            let Some(r) = self.reqs.get_mut(k).and_then(|r| r.as_mut()) else {
                continue;
            };
            if self.chunking == Some(k) {
                self.chunking = None;
            }
            let first = r.output == 0;
            r.output += 1;
            r.phase = Phase::Running;
            let stalled = r.stalled_since_ns.take();
            let (request, is_source, finished) = (r.request.id, r.source.is_some(), r.output >= r.target);
            if first {
                eff.facts.push(Fact::FirstTokenEmitted { request });
                eff.outputs.push(EngineOutput::FirstToken { request });
            } else if let Some(since) = stalled {
                eff.facts.push(Fact::DecodeResumed { request, stalled_ns: end_ns.saturating_sub(since) });
            }
            if is_source {
                self.pin_source(k, end_ns, eff);
            } else if finished {
                self.finish(k, TerminalStatus::Completed, eff);
            } else {
                self.running.push(k);
            }
        }
    }

    /// Ends the running requests that produced their last token in this decode pass.
    fn finish_decoded(&mut self, eff: &mut Effects) {
        let mut i = 0;
        while i < self.running.len() {
            let k = self.running[i];
            let finished = self.req(k).map(|r| r.output >= r.target).unwrap_or(true);
            if finished {
                self.running.swap_remove(i);
                self.finish(k, TerminalStatus::Completed, eff);
            } else {
                i += 1;
            }
        }
    }

    /// Retracts running requests until every one can grow by a token. Returns whether any was
    /// retracted.
    fn retract_for_decode(&mut self, at_ns: u64, eff: &mut Effects) -> bool {
        let page = self.page();
        let mut any = false;
        loop {
            let need =
                self.running.iter().filter_map(|&k| self.req(k)).filter(|r| r.kv_len % page == 0).count()
                    as u64;
            if need <= self.pool.available() || self.running.is_empty() {
                return any;
            }
            // Fewest output tokens first; ties: the longer prompt, then the newest.
            let victim = self
                .running
                .iter()
                .enumerate()
                .filter_map(|(i, &k)| self.req(k).map(|r| (i, k, r)))
                .min_by_key(|(_, k, r)| {
                    (r.output, std::cmp::Reverse(r.request.input_tokens), std::cmp::Reverse(*k))
                })
                .map(|(i, k, _)| (i, k));
            let Some((i, k)) = victim else { return any };
            self.running.remove(i);
            self.release_kv_cached(k, eff);
            self.give_slot();
            let Some(r) = self.reqs.get_mut(k).and_then(|r| r.as_mut()) else {
                continue;
            };
            r.kv_len = 0;
            r.fill = (r.request.input_tokens + r.output).max(1);
            r.phase = Phase::Waiting;
            r.has_slot = false;
            r.retracted = true;
            // Transferred KV is gone once retracted: it recomputes here like any other.
            r.prefilled = false;
            if r.output > 0 && r.stalled_since_ns.is_none() {
                r.stalled_since_ns = Some(at_ns);
            }
            r.holder.kind = Kind::Active;
            let request = r.request.id;
            self.retracted_waiting += 1;
            self.waiting.push_front(k);
            self.emit(eff, |kv| Fact::RequestPreempted { request, kv });
            any = true;
        }
    }

    fn pin_source(&mut self, key: usize, at_ns: u64, eff: &mut Effects) {
        let lease = self.ids.lease();
        let Some(r) = self.reqs.get_mut(key).and_then(|r| r.as_mut()) else {
            return;
        };
        self.pool.set_kind(&mut r.holder, Kind::Pinned);
        r.phase = Phase::Pinned;
        let Some(s) = r.source.as_mut() else { return };
        s.lease = Some(lease);
        let (handoff, deadline_ns) = (s.handoff, at_ns.saturating_add(s.lease_ns));
        let (request, blocks) = (r.request.id, r.holder.pages());
        self.n_pinned += 1;
        self.emit(eff, |kv| Fact::SourcePinned { handoff, request, lease, blocks, deadline_ns, kv });
        eff.outputs.push(EngineOutput::SourcePinned { handoff, request, lease, blocks, deadline_ns });
    }

    fn source_released(&mut self, key: usize, reason: EndReason, eff: &mut Effects) {
        let Some(mut r) = self.reqs.get_mut(key).and_then(|r| r.take()) else {
            return;
        };
        self.spare_keys.push(key);
        self.pool.release(&mut r.holder);
        if r.has_slot {
            self.give_slot();
        }
        self.n_pinned -= 1;
        let Some(s) = r.source else { return };
        self.sources.end(s.handoff);
        let (handoff, lease) = (s.handoff, s.lease.unwrap_or(SourceLeaseId(u64::MAX)));
        self.emit(eff, |kv| Fact::SourceReleased { handoff, lease, reason, kv });
    }

    /// Shared tail of every command: retry the FIFO head if capacity changed.
    fn finish_command(
        &mut self,
        outcome: Result<CommandOutcome, CommandError>,
        mut eff: Effects,
    ) -> CommandResult {
        self.retry_pending(&mut eff);
        debug_assert!(self.pool.acc.is_zero(), "unattributed delta {:?}", self.pool.acc);
        CommandResult { outcome, effects: eff }
    }
}

impl EngineCore for SglangCore {
    fn worker(&self) -> WorkerId {
        self.worker
    }

    fn shape(&self) -> EngineShape {
        EngineShape {
            total_blocks: self.cfg.total_pages,
            block_size: self.cfg.page_size,
            max_request_slots: self.cfg.max_running_requests,
            config_json: self.config_json.clone(),
        }
    }

    fn submit(&mut self, request: Request, _at_ns: u64) -> CommandResult {
        if let Some(pages) = self.never_fits(request.input_tokens, request.output_tokens, 0) {
            return self.reject(request.id, pages);
        }
        let r = self.new_req(request.clone(), request.output_tokens);
        let mut eff = Effects::default();
        self.enqueue(r, &mut eff);
        self.finish_command(Ok(CommandOutcome::Applied), eff)
    }

    fn submit_prefilled(&mut self, request: Request, _at_ns: u64) -> CommandResult {
        if let Some(pages) = self.never_fits(request.input_tokens, request.output_tokens, 0) {
            return self.reject(request.id, pages);
        }
        let mut r = self.new_req(request.clone(), request.output_tokens);
        r.prefilled = true;
        let mut eff = Effects::default();
        self.enqueue(r, &mut eff);
        self.finish_command(Ok(CommandOutcome::Applied), eff)
    }

    fn submit_handoff_prefill(
        &mut self,
        handoff: HandoffId,
        request: Request,
        lease_ns: u64,
        _at_ns: u64,
    ) -> CommandResult {
        if let Some(outcome) = self.sources.start_answer(handoff) {
            return CommandResult { outcome, effects: Effects::default() };
        }
        if let Some(pages) = self.never_fits(request.input_tokens, 1, 0) {
            self.sources.refuse(handoff);
            return self.reject(request.id, pages);
        }
        let mut r = self.new_req(request, 1);
        r.source = Some(SourceInfo { handoff, lease_ns, lease: None });
        let mut eff = Effects::default();
        if self.enqueue(r, &mut eff) {
            if let Some(&k) = self.waiting.back() {
                self.sources.hold(handoff, k);
            }
        } else {
            self.sources.refuse(handoff);
        }
        self.finish_command(Ok(CommandOutcome::Applied), eff)
    }

    fn reserve_destination(
        &mut self,
        handoff: HandoffId,
        request: Request,
        deadline_ns: u64,
        _at_ns: u64,
    ) -> CommandResult {
        if let Some(outcome) = self.dests.start_answer(handoff) {
            return CommandResult { outcome, effects: Effects::default() };
        }
        let mut eff = Effects::default();
        if let Some(pages) =
            self.never_fits(request.input_tokens, request.output_tokens, self.cfg.num_reserved_decode_tokens)
        {
            eff.facts.push(Fact::ReservationRefused { handoff, reason: RejectReason::NeverFits });
            self.dests.refuse(handoff);
            let e = CommandError::NeverFits {
                request: request.id,
                needed_blocks: pages,
                total_blocks: self.cfg.total_pages as u64,
            };
            return outcome_err(e, eff);
        }
        match self.pending.arrival(self.cfg.max_pending_reservations) {
            Arrival::TryNow => match self.try_reserve(handoff, &request, deadline_ns, &mut eff) {
                Ok(()) => return self.finish_command(Ok(CommandOutcome::Applied), eff),
                Err(reason) => {
                    eff.facts.push(Fact::ReservationQueued { handoff });
                    eff.facts.push(Fact::ReservationRefused { handoff, reason });
                    self.pending.push(handoff, request, deadline_ns, Some(self.epoch()));
                    self.dests.hold(handoff, DestinationEntry::Pending);
                }
            },
            Arrival::Full => return self.pending_full(handoff, eff),
            Arrival::Queue => {
                // FIFO: nobody overtakes the head; this one is tried when it becomes the head.
                eff.facts.push(Fact::ReservationQueued { handoff });
                self.pending.push(handoff, request, deadline_ns, None);
                self.dests.hold(handoff, DestinationEntry::Pending);
            }
        }
        self.finish_command(Ok(CommandOutcome::Unavailable), eff)
    }

    fn activate_destination(&mut self, handoff: HandoffId, _at_ns: u64) -> CommandResult {
        let eff = Effects::default();
        let key = match self.dests.lookup(handoff) {
            Err(outcome) => return CommandResult { outcome, effects: eff },
            Ok(DestinationEntry::Pending) => {
                let e =
                    CommandError::InvalidState { handoff, command: "activate_destination", state: "pending" };
                return outcome_err(e, eff);
            }
            Ok(DestinationEntry::Live(k)) => *k,
        };
        let Some(r) = self.req(key) else {
            return outcome_err(CommandError::UnknownHandoff(handoff), eff);
        };
        if r.phase != Phase::Reserved {
            return outcome_ok(CommandOutcome::NoOp, eff);
        }
        let mut eff = eff;
        let page = self.page();
        let Some(r) = self.reqs.get_mut(key).and_then(|r| r.as_mut()) else {
            return outcome_err(CommandError::UnknownHandoff(handoff), eff);
        };
        // Reserved → active, then the received full pages become cached and published, once.
        self.pool.set_kind(&mut r.holder, Kind::Active);
        r.kv_len = r.request.input_tokens;
        r.fill = r.kv_len;
        r.output = 1; // the first token came from the source's prefill
        r.phase = Phase::Prebuilt;
        let request_id = r.request.id;
        let full = (r.kv_len / page) as usize;
        let stored = self.pool.insert(&mut r.holder, &r.hashes, full);
        let reservation =
            r.dest.as_ref().map(|d| d.reservation).unwrap_or(DestinationReservationId(u64::MAX));
        self.n_reserved -= 1;
        self.prebuilt.push_back(key);
        self.emit(&mut eff, |kv| Fact::DestinationActivated { handoff, reservation, kv });
        if let Some(f) = stored {
            eff.facts.push(f);
        }
        // SGLang commits the transferred first token at once (a prebuilt batch, no forward
        // pass): the user's first token leaves the decode worker at activation.
        eff.facts.push(Fact::FirstTokenEmitted { request: request_id });
        eff.outputs.push(EngineOutput::FirstToken { request: request_id });
        self.finish_command(Ok(CommandOutcome::Applied), eff)
    }

    fn release_source(&mut self, handoff: HandoffId, reason: EndReason, _at_ns: u64) -> CommandResult {
        let mut eff = Effects::default();
        let key = match self.sources.lookup(handoff) {
            Ok(&key) => key,
            Err(outcome) => return CommandResult { outcome, effects: eff },
        };
        if self.req(key).map(|r| r.phase) != Some(Phase::Pinned) {
            let e = CommandError::InvalidState { handoff, command: "release_source", state: "computing" };
            return outcome_err(e, eff);
        }
        self.source_released(key, reason, &mut eff);
        self.finish_command(Ok(CommandOutcome::Applied), eff)
    }

    fn cancel_source(&mut self, handoff: HandoffId, reason: CancelReason, _at_ns: u64) -> CommandResult {
        let mut eff = Effects::default();
        let key = match self.sources.lookup(handoff) {
            Ok(&key) => key,
            Err(outcome) => return CommandResult { outcome, effects: eff },
        };
        match self.req(key).map(|r| r.phase) {
            Some(Phase::Pinned) => self.source_released(key, EndReason::Canceled(reason), &mut eff),
            Some(_) => {
                self.unqueue(key);
                self.finish(key, TerminalStatus::Canceled, &mut eff);
            }
            None => return outcome_err(CommandError::UnknownHandoff(handoff), eff),
        }
        self.finish_command(Ok(CommandOutcome::Applied), eff)
    }

    fn cancel_destination(&mut self, handoff: HandoffId, reason: CancelReason, _at_ns: u64) -> CommandResult {
        let mut eff = Effects::default();
        let key = match self.dests.lookup(handoff) {
            Err(outcome) => return CommandResult { outcome, effects: eff },
            Ok(DestinationEntry::Pending) => {
                self.pending.remove(handoff);
                self.dests.end(handoff);
                eff.facts.push(Fact::ReservationDequeued { handoff, reason });
                return self.finish_command(Ok(CommandOutcome::Applied), eff);
            }
            Ok(DestinationEntry::Live(k)) => *k,
        };
        match self.req(key).map(|r| r.phase) {
            Some(Phase::Reserved) => {
                // Aborted before the KV arrived: pages are freed WITHOUT entering the cache.
                let Some(mut r) = self.reqs.get_mut(key).and_then(|r| r.take()) else {
                    return outcome_err(CommandError::UnknownHandoff(handoff), eff);
                };
                self.spare_keys.push(key);
                let p = r.holder.private;
                self.pool.free_private(&mut r.holder, p);
                self.pool.release(&mut r.holder);
                self.give_slot();
                self.n_reserved -= 1;
                let (headroom, reservation) = r
                    .dest
                    .as_ref()
                    .map(|d| (d.headroom, d.reservation))
                    .unwrap_or((0, DestinationReservationId(u64::MAX)));
                self.return_headroom(headroom);
                self.dests.end(handoff);
                let reason = EndReason::Canceled(reason);
                self.emit(&mut eff, |kv| Fact::ReservationReleased { handoff, reservation, reason, kv });
            }
            Some(_) => {
                // Activated: aborted like any request on this engine.
                self.unqueue(key);
                self.finish(key, TerminalStatus::Canceled, &mut eff);
            }
            None => return outcome_err(CommandError::UnknownHandoff(handoff), eff),
        }
        self.finish_command(Ok(CommandOutcome::Applied), eff)
    }

    fn step(&mut self, at_ns: u64) -> StepOutput {
        let mut eff = Effects::default();
        self.join_prebuilt(&mut eff);
        self.admit_prefilled(&mut eff);
        let mut step_kv = KvDelta::ZERO;
        let mut done = Vec::new();
        let mut first_tokens = Vec::new();
        let shape;
        let (prefill_tokens, decode_tokens, batch_size);
        if let Some((tokens, n)) = self.prefill_pass(&mut eff, &mut step_kv, &mut done) {
            shape = StepShape { prefill_tokens: tokens as u64, ..StepShape::default() };
            (prefill_tokens, decode_tokens, batch_size) = (tokens, 0, n);
        } else if !self.running.is_empty() {
            shape = self.decode_pass(at_ns, &mut eff, &mut step_kv, &mut first_tokens);
            let n = shape.decode_requests as u32;
            (prefill_tokens, decode_tokens, batch_size) = (0, n, n);
        } else {
            self.flush_removed(&mut eff);
            debug_assert!(self.pool.acc.is_zero());
            self.retry_pending(&mut eff);
            return StepOutput { effects: eff, duration_ns: 0 };
        }
        let duration_ns = self.cfg.timing.step_ns(&shape);
        self.flush_removed(&mut eff);
        eff.facts.push(Fact::StepExecuted {
            prefill_tokens,
            decode_tokens,
            batch_size,
            duration_ns,
            kv: step_kv,
        });
        let end_ns = at_ns.saturating_add(duration_ns);
        for request in first_tokens {
            eff.facts.push(Fact::FirstTokenEmitted { request });
            eff.outputs.push(EngineOutput::FirstToken { request });
        }
        self.prefill_results(done, end_ns, &mut eff);
        if decode_tokens > 0 {
            self.finish_decoded(&mut eff);
        }
        self.retry_pending(&mut eff);
        debug_assert!(self.pool.acc.is_zero(), "unattributed delta {:?}", self.pool.acc);
        StepOutput { effects: eff, duration_ns }
    }

    fn quiet_steps(&self) -> Option<QuietSteps> {
        // Nothing to admit, activate, chunk, retry or account between steps.
        if self.running.is_empty()
            || !self.waiting.is_empty()
            || self.chunking.is_some()
            || !self.prebuilt.is_empty()
            || !self.pool.acc.is_zero()
            || !self.pool.removed.is_empty()
        {
            return None;
        }
        if self.pending.head_is_due(self.epoch()) {
            return None;
        }
        let page = self.page() as u64;
        let mut steps = u64::MAX;
        let mut active_kv = 0u64;
        for &k in &self.running {
            let r = self.req(k)?;
            let (kv, output, target) = (r.kv_len as u64, r.output as u64, r.target as u64);
            // …nor produce a first token (a prefilled request's, which is a fact of its own)…
            if output == 0 {
                return None;
            }
            // Step `i` of the run must not start a page (which allocates, and may retract)…
            if kv % page == 0 {
                return None;
            }
            steps = steps.min(page - kv % page);
            // …nor produce the last token.
            steps = steps.min(target.saturating_sub(output + 1));
            if steps == 0 {
                return None;
            }
            active_kv += kv;
        }
        // The timing model charges for the active KV, which grows by a token per request and
        // step: one duration per step.
        let n = self.running.len() as u64;
        let durations = (0..steps)
            .map(|i| {
                self.cfg.timing.step_ns(&StepShape {
                    decode_requests: n,
                    active_kv_tokens: active_kv + i * n,
                    total_kv_tokens: self.total_tokens(),
                    ..StepShape::default()
                })
            })
            .collect();
        Some(QuietSteps { steps, batch: n as u32, durations: QuietDurations::Each(durations) })
    }

    fn advance_quiet(&mut self, steps: u64) {
        let n = steps as u32;
        for &k in &self.running {
            if let Some(r) = self.reqs.get_mut(k).and_then(|r| r.as_mut()) {
                r.kv_len += n;
                r.output += n;
            }
        }
        // Step by step, as `step` does: the same floating-point result.
        for _ in 0..steps {
            self.decay_new_token_ratio();
        }
    }

    fn is_empty(&self) -> bool {
        self.waiting.is_empty()
            && self.running.is_empty()
            && self.chunking.is_none()
            && self.prebuilt.is_empty()
    }

    fn is_drained(&self) -> bool {
        self.is_empty() && self.sources.is_empty() && self.dests.is_empty() && self.pending.is_empty()
    }

    fn snapshot(&self) -> KvCapacitySnapshot {
        let c = self.pool.counts();
        KvCapacitySnapshot {
            active_blocks: c[0],
            pinned_source_blocks: c[1],
            reserved_destination_blocks: c[2],
            cached_free_blocks: c[3],
            free_blocks: c[4],
            total_blocks: self.pool.total() as u64,
            request_slots_used: self.slots_used as u64,
            decode_headroom_tokens: self.headroom_tokens,
        }
    }

    fn audit(&self) -> KvCapacitySnapshot {
        let live = self.reqs.iter().flatten();
        let c = self.pool.audit(live.clone().map(|r| &r.holder));
        let slots = live.clone().filter(|r| r.has_slot).count() as u64;
        let headroom = live.filter_map(|r| r.dest.as_ref()).map(|d| d.headroom as u64).sum();
        KvCapacitySnapshot {
            active_blocks: c[0],
            pinned_source_blocks: c[1],
            reserved_destination_blocks: c[2],
            cached_free_blocks: c[3],
            free_blocks: c[4],
            total_blocks: self.pool.total() as u64,
            request_slots_used: slots,
            decode_headroom_tokens: headroom,
        }
    }

    fn view(&self) -> SchedulerView {
        SchedulerView {
            waiting: (self.waiting.len() + self.prebuilt.len()) as u64,
            running: (self.running.len() + self.chunking.is_some() as usize) as u64,
            waiting_for_remote_kv: self.n_reserved as u64,
            held_prefills: self.n_pinned as u64,
            pending_reservations: self.pending.len() as u64,
        }
    }
}

impl SglangCore {
    fn pending_full(&mut self, handoff: HandoffId, mut eff: Effects) -> CommandResult {
        eff.facts.push(Fact::ReservationRefused { handoff, reason: RejectReason::NoCapacity });
        eff.outputs.push(EngineOutput::ReservationFailed { handoff, reason: RejectReason::NoCapacity });
        self.dests.refuse(handoff);
        self.finish_command(Ok(CommandOutcome::Applied), eff)
    }
}
