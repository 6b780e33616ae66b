//! The one per-worker fold: what one stream says about its worker at a settled instant.
//!
//! For an engine stream, its physical KV ([`KvCapacitySnapshot`]: active, pinned source,
//! reserved destination, cached, free, slots, headroom) and its scheduler queues
//! ([`SchedulerFold`]: waiting, running, waiting for remote KV, held prefills, pending
//! reservations). For the router stream, its bookings ([`BookingFold`]). `at` (and the index's
//! checkpoints), `inspect`, `timeline`, `diff` and the capacity and scheduler projections all
//! fold a stream through this type, so they cannot disagree about a worker's state.

use crate::events::index::CheckpointFold;
use crate::events::{KvDelta, Record, StreamHeader};
use crate::ids::{Role, WorkerId};
use crate::model::capacity::{CapacityViolation, KvCapacitySnapshot};
use crate::model::view::SchedulerView;
use crate::projections::bookings::{BookingFold, BookingViolation};
use crate::projections::scheduler::{SchedulerFold, ViewViolation};
use crate::units::ms;
use serde::{Deserialize, Serialize};

/// A record the fold refused: the stream contradicts itself. The refused part changes nothing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WorkerViolation {
    #[error(transparent)]
    Capacity(#[from] CapacityViolation),
    #[error(transparent)]
    View(#[from] ViewViolation),
    #[error(transparent)]
    Booking(#[from] BookingViolation),
}

/// What one record changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Change {
    /// The KV delta the record carries (engine streams; zero when it moves nothing).
    pub delta: KvDelta,
    /// The scheduler queues may have changed.
    pub queues: bool,
}

/// One stream's fold. Serializable: the index stores it in checkpoints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerFold {
    pub worker: WorkerId,
    /// Engine streams: physical KV. (Router: stays empty.)
    pub capacity: KvCapacitySnapshot,
    /// Engine streams: the scheduler's queues (not folded when `queues` is off).
    pub scheduler: SchedulerFold,
    /// Router stream: bookings.
    pub bookings: BookingFold,
    /// Records applied.
    pub records: u64,
    pub last_at_ns: Option<u64>,
    /// The first contradiction found, located (the record is skipped by the part that refused
    /// it).
    pub violation: Option<String>,
    /// Whether the scheduler queues are folded (a capacity-only reader skips them).
    queues: bool,
}

impl CheckpointFold for WorkerFold {
    const NAME: &'static str = "worker.v1";
    fn start(header: &StreamHeader) -> Self {
        WorkerFold::new(header)
    }
    fn apply(&mut self, record: &Record) {
        // A contradiction is kept in `violation`; checkpoints resume past it.
        let _ = WorkerFold::apply(self, record);
    }
}

impl WorkerFold {
    /// The state before the stream's first record: every block free, queues empty.
    pub fn new(header: &StreamHeader) -> Self {
        Self::for_worker(header.worker, header.engine.total_blocks as u64)
    }

    /// [`WorkerFold::new`] from the two header fields it uses (a worker with no stream on one
    /// side of a diff starts from zero blocks).
    pub fn for_worker(worker: WorkerId, total_blocks: u64) -> Self {
        WorkerFold {
            worker,
            capacity: KvCapacitySnapshot::empty(total_blocks),
            scheduler: SchedulerFold::new(),
            bookings: BookingFold::new(),
            records: 0,
            last_at_ns: None,
            violation: None,
            queues: true,
        }
    }

    /// Folds capacity and bookings only (`diff` compares those sequences, not the queues).
    pub fn without_queues(mut self) -> Self {
        self.queues = false;
        self
    }

    pub fn is_router(&self) -> bool {
        self.worker.role == Role::Router
    }

    /// The scheduler queues now.
    pub fn view(&self) -> SchedulerView {
        self.scheduler.view()
    }

    /// Applies one record of this stream. Each part (capacity, queues, bookings) applies what
    /// it can; the first refusal is returned and also kept, located, in `violation`.
    pub fn apply(&mut self, rec: &Record) -> Result<Change, WorkerViolation> {
        self.records += 1;
        self.last_at_ns = Some(rec.at_ns);
        let mut change = Change::default();
        let mut first: Option<WorkerViolation> = None;
        if self.is_router() {
            if let Err(e) = self.bookings.apply(&rec.fact) {
                first = Some(e.into());
            }
        } else {
            let delta = rec.fact.kv_delta();
            if !delta.is_zero() {
                match self.capacity.apply(&delta) {
                    Ok(()) => change.delta = delta,
                    Err(e) => first = Some(e.into()),
                }
            }
            if self.queues && changes_queues(&rec.fact) {
                change.queues = true;
                if let Err(e) = self.scheduler.apply(&rec.fact) {
                    first.get_or_insert(e.into());
                }
            }
        }
        match first {
            None => Ok(change),
            Some(e) => {
                if self.violation.is_none() {
                    self.violation = Some(format!(
                        "{} record seq {} (t={:.3} ms): {e}",
                        self.worker,
                        rec.seq,
                        ms(rec.at_ns)
                    ));
                }
                Err(e)
            }
        }
    }

    /// Whether the worker holds nothing: no KV in use, no slot or headroom (engine), no booking
    /// open (router).
    pub fn is_drained(&self) -> bool {
        if self.is_router() {
            self.bookings.is_drained()
        } else {
            self.capacity.is_drained()
        }
    }
}

/// Whether a fact can change the scheduler queues (other facts skip the queue fold).
pub fn changes_queues(fact: &crate::events::Fact) -> bool {
    use crate::events::Fact;
    matches!(
        fact,
        Fact::RequestQueued { .. }
            | Fact::RequestScheduled { .. }
            | Fact::RequestPreempted { .. }
            | Fact::RequestFinished { .. }
            | Fact::RequestRejected { .. }
            | Fact::SourcePinned { .. }
            | Fact::SourceReleased { .. }
            | Fact::ReservationQueued { .. }
            | Fact::ReservationDequeued { .. }
            | Fact::DestinationReserved { .. }
            | Fact::DestinationActivated { .. }
            | Fact::SessionLost { .. }
            | Fact::ReservationReleased { .. }
    )
}
