//! Router bookings, per the proposal's accounting table, and their fold over the router stream.
//!
//! * Prefill stage: `book_prefill` at dispatch adds compute load (active prefill tokens) and a
//!   block booking; `prefill_compute_done` drops the compute load but keeps the booking (the
//!   source stays pinned); `free_prefill` ends the booking at source release or at the request's
//!   terminal outcome (also dropping compute load if compute never finished).
//! * Decode stage: `book_decode` at selection; `free_decode` at the decode's terminal outcome. A
//!   failed handoff is a terminal outcome, so its bookings free too.
//!
//! Every transition returns the fact for the router's stream; repeating a transition that has
//! already happened is a no-op returning `None`, so cleanup paths can call freely. Bookings exist
//! only for requests in flight.

use crate::events::{Fact, TerminalStatus};
use crate::ids::{RequestId, WorkerId};
use std::collections::BTreeMap;

/// What the router has booked on one worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct WorkerLoad {
    /// Prompt tokens of prefills dispatched here whose compute has not finished.
    pub active_prefill_tokens: u64,
    /// Blocks booked by prefills (held until the source is released).
    pub prefill_blocks: u64,
    /// Blocks booked by decodes (held until the decode's terminal outcome).
    pub decode_blocks: u64,
}

impl WorkerLoad {
    /// All booked blocks: the load that selection balances.
    pub fn booked_blocks(&self) -> u64 {
        self.prefill_blocks + self.decode_blocks
    }

    pub fn is_zero(&self) -> bool {
        *self == WorkerLoad::default()
    }
}

/// A booking transition the state does not allow.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BookingError {
    #[error("{request} already has a prefill booking on {worker}")]
    PrefillAlreadyBooked { request: RequestId, worker: WorkerId },
    #[error("{request} already has a decode booking on {worker}")]
    DecodeAlreadyBooked { request: RequestId, worker: WorkerId },
    #[error("{worker} is not one of this router's workers")]
    UnknownWorker { worker: WorkerId },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PrefillBooking {
    worker: WorkerId,
    prefill_tokens: u32,
    blocks: u32,
    compute_done: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct DecodeBooking {
    worker: WorkerId,
    blocks: u32,
}

/// The booking state shared by the router and its fold: both apply the same transitions, the
/// router from its calls, the fold from the facts those calls returned.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BookingLedger {
    prefill: BTreeMap<RequestId, PrefillBooking>,
    decode: BTreeMap<RequestId, DecodeBooking>,
    loads: BTreeMap<WorkerId, WorkerLoad>,
}

impl BookingLedger {
    pub fn new() -> Self {
        Self::default()
    }

    /// The worker's booked load (zero for a worker with nothing booked).
    pub fn load(&self, worker: WorkerId) -> WorkerLoad {
        self.loads.get(&worker).copied().unwrap_or_default()
    }

    /// Every worker with a non-zero load, in worker order.
    pub fn loads(&self) -> BTreeMap<WorkerId, WorkerLoad> {
        self.loads.iter().filter(|(_, l)| !l.is_zero()).map(|(w, l)| (*w, *l)).collect()
    }

    /// Requests holding a prefill booking / a decode booking.
    pub fn in_flight(&self) -> (usize, usize) {
        (self.prefill.len(), self.decode.len())
    }

    pub fn prefill_worker(&self, request: RequestId) -> Option<WorkerId> {
        self.prefill.get(&request).map(|b| b.worker)
    }

    pub fn decode_worker(&self, request: RequestId) -> Option<WorkerId> {
        self.decode.get(&request).map(|b| b.worker)
    }

    fn load_mut(&mut self, worker: WorkerId) -> &mut WorkerLoad {
        self.loads.entry(worker).or_default()
    }

    fn drop_zero(&mut self, worker: WorkerId) {
        if self.loads.get(&worker).is_some_and(WorkerLoad::is_zero) {
            self.loads.remove(&worker);
        }
    }

    pub fn book_prefill(
        &mut self,
        request: RequestId,
        worker: WorkerId,
        prefill_tokens: u32,
        blocks: u32,
    ) -> Result<Fact, BookingError> {
        if let Some(b) = self.prefill.get(&request) {
            return Err(BookingError::PrefillAlreadyBooked { request, worker: b.worker });
        }
        self.prefill.insert(request, PrefillBooking { worker, prefill_tokens, blocks, compute_done: false });
        let l = self.load_mut(worker);
        l.active_prefill_tokens += u64::from(prefill_tokens);
        l.prefill_blocks += u64::from(blocks);
        Ok(Fact::PrefillBooked { request, worker, prefill_tokens, blocks })
    }

    pub fn prefill_compute_done(&mut self, request: RequestId) -> Option<Fact> {
        let b = self.prefill.get_mut(&request)?;
        if b.compute_done {
            return None;
        }
        b.compute_done = true;
        let (worker, tokens) = (b.worker, b.prefill_tokens);
        self.load_mut(worker).active_prefill_tokens -= u64::from(tokens);
        self.drop_zero(worker);
        Some(Fact::PrefillComputeDone { request, worker })
    }

    pub fn free_prefill(&mut self, request: RequestId) -> Option<Fact> {
        let b = self.prefill.remove(&request)?;
        let l = self.load_mut(b.worker);
        if !b.compute_done {
            l.active_prefill_tokens -= u64::from(b.prefill_tokens);
        }
        l.prefill_blocks -= u64::from(b.blocks);
        self.drop_zero(b.worker);
        Some(Fact::PrefillBookingFreed { request, worker: b.worker })
    }

    pub fn book_decode(
        &mut self,
        request: RequestId,
        worker: WorkerId,
        blocks: u32,
    ) -> Result<Fact, BookingError> {
        if let Some(b) = self.decode.get(&request) {
            return Err(BookingError::DecodeAlreadyBooked { request, worker: b.worker });
        }
        self.decode.insert(request, DecodeBooking { worker, blocks });
        self.load_mut(worker).decode_blocks += u64::from(blocks);
        Ok(Fact::DecodeBooked { request, worker, blocks })
    }

    pub fn free_decode(&mut self, request: RequestId, status: TerminalStatus) -> Option<Fact> {
        let b = self.decode.remove(&request)?;
        self.load_mut(b.worker).decode_blocks -= u64::from(b.blocks);
        self.drop_zero(b.worker);
        Some(Fact::DecodeBookingFreed { request, worker: b.worker, status })
    }
}

/// A router-stream fact that contradicts the bookings folded so far.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("router fold: {0}")]
pub struct RouterFoldViolation(pub String);

/// The bookings projection over a router stream. After folding every fact a [`super::Router`]
/// returned, its loads equal the router's own.
///
/// Written independently of [`BookingLedger`] (it recomputes a worker's load from the live
/// bookings it holds rather than keeping running sums), so a test comparing the two checks both
/// the facts' content and the router's arithmetic. Memory: one entry per booking in flight.
#[derive(Clone, Debug, Default)]
pub struct RouterFold {
    /// request → (worker, prefill tokens, blocks, compute done)
    prefill: BTreeMap<RequestId, (WorkerId, u32, u32, bool)>,
    /// request → (worker, blocks)
    decode: BTreeMap<RequestId, (WorkerId, u32)>,
}

impl RouterFold {
    pub fn new() -> Self {
        Self::default()
    }

    /// Folds one fact. Booking facts must be consistent (booked once, freed once, by the worker
    /// that holds the booking); other facts are ignored.
    pub fn apply(&mut self, fact: &Fact) -> Result<(), RouterFoldViolation> {
        let bad = |m: String| Err(RouterFoldViolation(m));
        match fact {
            Fact::PrefillBooked { request, worker, prefill_tokens, blocks } => {
                if self.prefill.contains_key(request) {
                    return bad(format!("{request}: prefill booked twice"));
                }
                self.prefill.insert(*request, (*worker, *prefill_tokens, *blocks, false));
            }
            Fact::PrefillComputeDone { request, worker } => match self.prefill.get_mut(request) {
                Some((w, _, _, done)) if w == worker => {
                    if *done {
                        return bad(format!("{request}: prefill compute done twice"));
                    }
                    *done = true;
                }
                _ => {
                    return bad(format!(
                        "{request}: compute done on {worker}, which holds no prefill booking for it"
                    ))
                }
            },
            Fact::PrefillBookingFreed { request, worker } => match self.prefill.get(request) {
                Some((w, ..)) if w == worker => {
                    self.prefill.remove(request);
                }
                _ => return bad(format!("{request}: prefill booking freed on {worker}, which holds none")),
            },
            Fact::DecodeBooked { request, worker, blocks } => {
                if self.decode.contains_key(request) {
                    return bad(format!("{request}: decode booked twice"));
                }
                self.decode.insert(*request, (*worker, *blocks));
            }
            Fact::DecodeBookingFreed { request, worker, .. } => match self.decode.get(request) {
                Some((w, _)) if w == worker => {
                    self.decode.remove(request);
                }
                _ => return bad(format!("{request}: decode booking freed on {worker}, which holds none")),
            },
            _ => {}
        }
        Ok(())
    }

    /// Every worker with a non-zero load, in worker order. O(bookings in flight).
    pub fn loads(&self) -> BTreeMap<WorkerId, WorkerLoad> {
        let mut out: BTreeMap<WorkerId, WorkerLoad> = BTreeMap::new();
        for (w, tokens, blocks, done) in self.prefill.values() {
            let l = out.entry(*w).or_default();
            if !done {
                l.active_prefill_tokens += u64::from(*tokens);
            }
            l.prefill_blocks += u64::from(*blocks);
        }
        for (w, blocks) in self.decode.values() {
            out.entry(*w).or_default().decode_blocks += u64::from(*blocks);
        }
        out.retain(|_, l| !l.is_zero());
        out
    }

    pub fn load(&self, worker: WorkerId) -> WorkerLoad {
        self.loads().get(&worker).copied().unwrap_or_default()
    }

    /// Requests holding a prefill booking / a decode booking.
    pub fn in_flight(&self) -> (usize, usize) {
        (self.prefill.len(), self.decode.len())
    }
}
