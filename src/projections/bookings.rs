//! The one fold of router bookings over the router stream (`PrefillBooked`,
//! `PrefillComputeDone`, `PrefillBookingFreed`, `DecodeBooked`, `DecodeBookingFreed`), shared by
//! `at`, `inspect`, `timeline` (through inspect), `diff` and the router's own property tests.
//!
//! It rebuilds each worker's [`WorkerLoad`] from the numbers the facts carry, so comparing it
//! with a live [`crate::router::Router`] checks both the facts' content and the router's
//! arithmetic. Memory: one entry per booking in flight, plus one load per worker ever booked.

use crate::events::Fact;
use crate::ids::{RequestId, WorkerId};
use crate::router::WorkerLoad;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A booking fact that contradicts the bookings folded so far (booked twice, freed or completed
/// without a booking, or by a worker that does not hold it). The fold changes nothing for it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BookingViolation(pub String);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct PrefillBooking {
    worker: WorkerId,
    tokens: u64,
    blocks: u64,
    compute_done: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct DecodeBooking {
    worker: WorkerId,
    blocks: u64,
}

/// Router bookings per worker and per request. Serializable: `at`'s index checkpoints it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BookingFold {
    per_worker: BTreeMap<WorkerId, WorkerLoad>,
    prefill: BTreeMap<RequestId, PrefillBooking>,
    decode: BTreeMap<RequestId, DecodeBooking>,
}

/// The worker a router booking fact books, completes or frees (`None`: not a booking fact).
pub fn booked_worker(fact: &Fact) -> Option<WorkerId> {
    match *fact {
        Fact::PrefillBooked { worker, .. }
        | Fact::PrefillComputeDone { worker, .. }
        | Fact::PrefillBookingFreed { worker, .. }
        | Fact::DecodeBooked { worker, .. }
        | Fact::DecodeBookingFreed { worker, .. } => Some(worker),
        _ => None,
    }
}

/// Whether a fact is one of the router's booking facts (the router booking sequence).
pub fn is_booking_fact(fact: &Fact) -> bool {
    booked_worker(fact).is_some()
}

impl BookingFold {
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one fact; facts other than bookings are ignored.
    pub fn apply(&mut self, fact: &Fact) -> Result<(), BookingViolation> {
        match *fact {
            Fact::PrefillBooked { request, worker, prefill_tokens, blocks } => {
                if self.prefill.contains_key(&request) {
                    return refuse(format!("{request} prefill booked twice"));
                }
                let b = PrefillBooking {
                    worker,
                    tokens: prefill_tokens as u64,
                    blocks: blocks as u64,
                    compute_done: false,
                };
                let w = self.per_worker.entry(worker).or_default();
                w.active_prefill_tokens += b.tokens;
                w.prefill_blocks += b.blocks;
                self.prefill.insert(request, b);
            }
            Fact::PrefillComputeDone { request, worker } => self.compute_done(request, worker)?,
            Fact::PrefillBookingFreed { request, worker } => self.free_prefill(request, worker)?,
            Fact::DecodeBooked { request, worker, blocks } => {
                if self.decode.contains_key(&request) {
                    return refuse(format!("{request} decode booked twice"));
                }
                self.per_worker.entry(worker).or_default().decode_blocks += blocks as u64;
                self.decode.insert(request, DecodeBooking { worker, blocks: blocks as u64 });
            }
            Fact::DecodeBookingFreed { request, worker, .. } => match self.decode.get(&request) {
                Some(b) if b.worker == worker => {
                    let w = self.per_worker.entry(worker).or_default();
                    w.decode_blocks = w.decode_blocks.saturating_sub(b.blocks);
                    self.decode.remove(&request);
                }
                Some(b) => return refuse(held_elsewhere(request, "decode booking freed", worker, b.worker)),
                None => return refuse(format!("{request} decode booking freed but not booked")),
            },
            _ => {}
        }
        Ok(())
    }

    fn compute_done(&mut self, request: RequestId, worker: WorkerId) -> Result<(), BookingViolation> {
        match self.prefill.get_mut(&request) {
            Some(b) if b.worker != worker => {
                refuse(held_elsewhere(request, "prefill compute done", worker, b.worker))
            }
            Some(b) if b.compute_done => refuse(format!("{request} prefill compute done twice")),
            Some(b) => {
                b.compute_done = true;
                let w = self.per_worker.entry(b.worker).or_default();
                w.active_prefill_tokens = w.active_prefill_tokens.saturating_sub(b.tokens);
                Ok(())
            }
            None => refuse(format!("{request} prefill compute done but not booked")),
        }
    }

    fn free_prefill(&mut self, request: RequestId, worker: WorkerId) -> Result<(), BookingViolation> {
        match self.prefill.get(&request) {
            Some(b) if b.worker != worker => {
                refuse(held_elsewhere(request, "prefill booking freed", worker, b.worker))
            }
            Some(&b) => {
                let w = self.per_worker.entry(b.worker).or_default();
                if !b.compute_done {
                    w.active_prefill_tokens = w.active_prefill_tokens.saturating_sub(b.tokens);
                }
                w.prefill_blocks = w.prefill_blocks.saturating_sub(b.blocks);
                self.prefill.remove(&request);
                Ok(())
            }
            None => refuse(format!("{request} prefill booking freed but not booked")),
        }
    }

    /// Every worker ever booked, with its current load (zeros once its bookings ended).
    pub fn per_worker(&self) -> &BTreeMap<WorkerId, WorkerLoad> {
        &self.per_worker
    }

    /// Every worker with a non-zero load, in worker order.
    pub fn loads(&self) -> BTreeMap<WorkerId, WorkerLoad> {
        self.per_worker.iter().filter(|(_, l)| !l.is_zero()).map(|(w, l)| (*w, *l)).collect()
    }

    /// `worker`'s load (zero when never booked).
    pub fn load(&self, worker: WorkerId) -> WorkerLoad {
        self.per_worker.get(&worker).copied().unwrap_or_default()
    }

    /// Bookings not yet freed: (prefill, decode).
    pub fn in_flight(&self) -> (usize, usize) {
        (self.prefill.len(), self.decode.len())
    }

    /// Nothing booked anywhere.
    pub fn is_drained(&self) -> bool {
        self.prefill.is_empty() && self.decode.is_empty()
    }
}

fn refuse(message: String) -> Result<(), BookingViolation> {
    Err(BookingViolation(message))
}

fn held_elsewhere(request: RequestId, what: &str, by: WorkerId, holder: WorkerId) -> String {
    format!("{request} {what} on {by}, but {holder} holds the booking")
}
