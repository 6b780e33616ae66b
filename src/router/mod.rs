//! Routers: KV index from Stored/Removed facts, selection modes, bookings.
//!
//! A [`Router`] serves one stage (prefill or decode) over a list of workers that changes only
//! when the adapter scales the stage ([`Router::add_worker`], [`Router::remove_worker`]). It is sans-IO
//! and clock-free: the adapter feeds it the workers' KV facts ([`Router::observe`]), asks it to
//! [`Router::select`], and tells it about bookings; each booking transition returns the
//! [`Fact`] the adapter appends to the router's stream (stamped with the adapter's time). All
//! randomness comes from a ChaCha8 stream seeded at construction, so the same calls give the
//! same choices and the same facts.
//!
//! ## How a replay drives the two stage routers (the proposal's accounting table)
//! | lifecycle event | prefill router | decode router |
//! | --- | --- | --- |
//! | prefill dispatched | `select`, then `book_prefill(req, w, uncached prompt tokens, blocks)` | — |
//! | prefill compute completed | `prefill_compute_done(req)` (compute load drops) | — |
//! | source pinned | booking stays | — |
//! | decode routed | — | `select`, then `book_decode(req, w, blocks)` |
//! | destination reserved / receive completed | — | booking stays |
//! | source released (reader completion, lease expiry, cancel) | `free_prefill(req)` | — |
//! | request terminal (completed, rejected, failed, canceled) | `free_prefill(req)` (no-op if already freed) | `free_decode(req, status)` |
//!
//! The reference books a disaggregated prefill as a request with one output token, so a
//! natural `blocks` for `book_prefill` is `prompt_blocks(input_tokens + 1)`; for `book_decode`,
//! the blocks the request will occupy on the decode worker. The router does not decide either:
//! the caller passes them, and the facts record them. Every free is idempotent, so a terminal
//! cleanup path can free both bookings unconditionally.
//!
//! Selection cost counts all booked blocks on a worker (prefill + decode bookings); a stage
//! router only ever holds one kind.

pub mod bookings;
pub mod index;
pub mod select;

pub use bookings::{BookingError, BookingLedger, WorkerLoad};
pub use index::KvIndex;
pub use select::RouterMode;

use crate::events::{BlockHash, Fact, TerminalStatus};
use crate::ids::{RequestId, WorkerId};
use crate::model::request::Request;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;

/// A router that cannot be built as asked.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouterError {
    #[error("router needs at least one worker")]
    NoWorkers,
    #[error("worker {0} is listed twice")]
    DuplicateWorker(WorkerId),
    #[error("router block size must be > 0")]
    ZeroBlockSize,
    #[error("{0}")]
    BadMode(String),
}

/// The router's choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Selection {
    pub worker: WorkerId,
    /// Leading prompt blocks the chosen worker already holds (computed in KV mode only; 0 in
    /// the other modes, which never consult the index).
    pub overlap_blocks: u32,
}

/// One stage's router.
#[derive(Clone, Debug)]
pub struct Router {
    /// Sorted ascending: round-robin order and tie-break order.
    workers: Vec<WorkerId>,
    mode: RouterMode,
    /// Engine block size: the granularity of the workers' KV hashes and of booked blocks.
    block_size: u32,
    rng: ChaCha8Rng,
    next_round_robin: usize,
    index: KvIndex,
    ledger: BookingLedger,
}

impl Router {
    /// A router over `workers` (any order; duplicates are an error). `block_size` is the engine
    /// block size the workers hash and the router counts blocks in.
    pub fn new(
        mut workers: Vec<WorkerId>,
        mode: RouterMode,
        block_size: u32,
        seed: u64,
    ) -> Result<Self, RouterError> {
        if workers.is_empty() {
            return Err(RouterError::NoWorkers);
        }
        if block_size == 0 {
            return Err(RouterError::ZeroBlockSize);
        }
        workers.sort();
        if let Some(w) = workers.windows(2).find(|p| p[0] == p[1]) {
            return Err(RouterError::DuplicateWorker(w[0]));
        }
        mode.validate(workers.len()).map_err(RouterError::BadMode)?;
        Ok(Router {
            workers,
            mode,
            block_size,
            rng: ChaCha8Rng::seed_from_u64(seed),
            next_round_robin: 0,
            index: KvIndex::new(),
            ledger: BookingLedger::new(),
        })
    }

    /// The workers selection chooses from, sorted.
    pub fn workers(&self) -> &[WorkerId] {
        &self.workers
    }

    /// A worker joined the stage: selection may choose it from now on. Its KV index starts
    /// empty and fills from its own facts, as any worker's does.
    pub fn add_worker(&mut self, worker: WorkerId) -> Result<(), RouterError> {
        let i = match self.workers.binary_search(&worker) {
            Ok(_) => return Err(RouterError::DuplicateWorker(worker)),
            Err(i) => i,
        };
        // Per-worker parameters (device-aware weights) must still match the list.
        self.mode.validate(self.workers.len() + 1).map_err(RouterError::BadMode)?;
        self.workers.insert(i, worker);
        Ok(())
    }

    /// A worker is leaving the stage: selection never chooses it again, while the bookings it
    /// holds stay until they are freed as usual (so its load is still told apart, and freeing
    /// them needs no special case). What it published to the KV index is forgotten at once: it
    /// can no longer attract a request, and its later KV facts are ignored.
    pub fn remove_worker(&mut self, worker: WorkerId) -> Result<(), RouterError> {
        let Ok(i) = self.workers.binary_search(&worker) else {
            return Err(RouterError::BadMode(format!("{worker} is not one of this router's workers")));
        };
        if self.workers.len() == 1 {
            return Err(RouterError::NoWorkers);
        }
        self.mode.validate(self.workers.len() - 1).map_err(RouterError::BadMode)?;
        self.workers.remove(i);
        self.index.apply(worker, &Fact::KvCleared);
        Ok(())
    }

    pub fn mode(&self) -> &RouterMode {
        &self.mode
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Whether selection consults the KV index (KV mode only). In the other modes
    /// [`Router::observe`] skips the index entirely, so routing costs nothing per stored block.
    pub fn uses_index(&self) -> bool {
        matches!(self.mode, RouterMode::KvAware { .. })
    }

    /// Folds a KV fact (`KvStored` / `KvRemoved` / `KvCleared`) from one of this router's
    /// workers into its index. Facts from other workers, other facts, and every fact when the
    /// mode does not use the index, are ignored.
    pub fn observe(&mut self, worker: WorkerId, fact: &Fact) {
        if self.uses_index()
            && matches!(fact, Fact::KvStored { .. } | Fact::KvRemoved { .. } | Fact::KvCleared)
            && self.workers.binary_search(&worker).is_ok()
        {
            self.index.apply(worker, fact);
        }
    }

    pub fn index(&self) -> &KvIndex {
        &self.index
    }

    /// Blocks a prompt of `input_tokens` occupies, partial last block included.
    pub fn prompt_blocks(&self, input_tokens: u32) -> u32 {
        input_tokens.div_ceil(self.block_size)
    }

    /// Picks a worker for `request`. Prompt hashes are computed only in KV mode.
    pub fn select(&mut self, request: &Request) -> Selection {
        if self.uses_index() {
            let hashes = request.prompt_block_hashes(self.block_size);
            self.select_with_hashes(request.input_tokens, &hashes)
        } else {
            self.select_with_hashes(request.input_tokens, &[])
        }
    }

    /// Picks a worker for a prompt of `input_tokens` whose full blocks hash to `hashes` (in this
    /// router's block size; ignored outside KV mode).
    pub fn select_with_hashes(&mut self, input_tokens: u32, hashes: &[BlockHash]) -> Selection {
        let n = self.workers.len();
        let booked = |r: &Router, w: WorkerId| r.ledger.load(w).booked_blocks() as f64;
        let plain = |worker| Selection { worker, overlap_blocks: 0 };
        match &self.mode {
            RouterMode::RoundRobin => {
                let w = self.workers[self.next_round_robin % n];
                self.next_round_robin = (self.next_round_robin + 1) % n;
                plain(w)
            }
            RouterMode::Random => plain(self.workers[self.rng.random_range(0..n)]),
            RouterMode::LeastLoaded => plain(self.least_by(|r, w| booked(r, w))),
            RouterMode::DeviceAware { weights } => {
                let weights = weights.clone();
                plain(self.least_by(|r, w| {
                    let i = r.workers.binary_search(&w).unwrap_or(0);
                    booked(r, w) / weights.get(i).copied().unwrap_or(1.0)
                }))
            }
            RouterMode::PowerOfTwo => {
                if n == 1 {
                    return plain(self.workers[0]);
                }
                let (a, b) = select::two_distinct(n, &mut self.rng);
                let (wa, wb) = (self.workers[a], self.workers[b]);
                let (la, lb) = (booked(self, wa), booked(self, wb));
                // Ties go to the lower id, whichever was drawn first.
                let pick = if la < lb || (la == lb && wa < wb) { wa } else { wb };
                plain(pick)
            }
            RouterMode::KvAware { overlap_weight, temperature } => {
                let (weight, temperature) = (*overlap_weight, *temperature);
                let overlap = self.index.overlap(hashes);
                let costs = self.kv_costs(input_tokens, &overlap, weight);
                let worker = if temperature > 0.0 {
                    select::softmax_pick(&costs, temperature, &mut self.rng)
                } else {
                    select::lowest_cost_random_tie(&costs, &mut self.rng)
                }
                .unwrap_or(self.workers[0]);
                Selection { worker, overlap_blocks: overlap.get(&worker).copied().unwrap_or(0) }
            }
        }
    }

    /// KV-mode cost of every worker, in worker order:
    /// `weight × (prompt blocks − overlap) + booked blocks`.
    pub fn kv_costs(
        &self,
        input_tokens: u32,
        overlap: &BTreeMap<WorkerId, u32>,
        weight: f64,
    ) -> Vec<(WorkerId, f64)> {
        let blocks = self.prompt_blocks(input_tokens);
        self.workers
            .iter()
            .map(|w| {
                let cached = overlap.get(w).copied().unwrap_or(0).min(blocks);
                let uncached = f64::from(blocks - cached);
                (*w, weight * uncached + self.ledger.load(*w).booked_blocks() as f64)
            })
            .collect()
    }

    fn least_by(&self, cost: impl Fn(&Router, WorkerId) -> f64) -> WorkerId {
        select::lowest_cost(self.workers.iter().map(|w| (*w, cost(self, *w)))).unwrap_or(self.workers[0])
    }

    fn check_worker(&self, worker: WorkerId) -> Result<(), BookingError> {
        if self.workers.binary_search(&worker).is_ok() {
            Ok(())
        } else {
            Err(BookingError::UnknownWorker { worker })
        }
    }

    /// Prefill dispatched to `worker`: adds `prefill_tokens` of compute load and `blocks` booked.
    pub fn book_prefill(
        &mut self,
        request: RequestId,
        worker: WorkerId,
        prefill_tokens: u32,
        blocks: u32,
    ) -> Result<Fact, BookingError> {
        self.check_worker(worker)?;
        self.ledger.book_prefill(request, worker, prefill_tokens, blocks)
    }

    /// Prefill compute finished: the compute load drops, the block booking stays.
    pub fn prefill_compute_done(&mut self, request: RequestId) -> Option<Fact> {
        self.ledger.prefill_compute_done(request)
    }

    /// The source was released (or the request ended): the prefill booking is freed.
    pub fn free_prefill(&mut self, request: RequestId) -> Option<Fact> {
        self.ledger.free_prefill(request)
    }

    /// Decode routed to `worker`: books `blocks` until the decode's terminal outcome.
    pub fn book_decode(
        &mut self,
        request: RequestId,
        worker: WorkerId,
        blocks: u32,
    ) -> Result<Fact, BookingError> {
        self.check_worker(worker)?;
        self.ledger.book_decode(request, worker, blocks)
    }

    /// The decode reached its terminal outcome: its booking is freed.
    pub fn free_decode(&mut self, request: RequestId, status: TerminalStatus) -> Option<Fact> {
        self.ledger.free_decode(request, status)
    }

    pub fn load(&self, worker: WorkerId) -> WorkerLoad {
        self.ledger.load(worker)
    }

    /// Workers with a non-zero load, in worker order.
    pub fn loads(&self) -> BTreeMap<WorkerId, WorkerLoad> {
        self.ledger.loads()
    }

    pub fn bookings(&self) -> &BookingLedger {
        &self.ledger
    }
}
