//! Router bookings, per the proposal's accounting table (their fold over the router stream is
//! [`crate::projections::bookings::BookingFold`]).
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
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
