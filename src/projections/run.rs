//! Folds over a whole run (a directory of streams or a merged file), in merge order.

use crate::events::{verify_run_with, LogError, Record, RunLayout, RunReader, RunSummary, StreamHeader};
use crate::ids::{HandoffId, Role, WorkerId};
use crate::model::capacity::{CapacityViolation, KvCapacitySnapshot};
use crate::model::view::SchedulerView;
use crate::projections::bookings::BookingViolation;
use crate::projections::handoffs::{HandoffEntry, HandoffLedger, HandoffStream};
use crate::projections::metrics::{MetricsFold, MetricsReport};
use crate::projections::scheduler::ViewViolation;
use crate::projections::worker::{WorkerFold, WorkerViolation};
use crate::units::ms;
use serde::Serialize;
use std::collections::BTreeMap;

/// A run whose facts contradict each other, located by stream and record.
#[derive(Debug, thiserror::Error)]
pub enum ProjectError {
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("the log contradicts itself: {worker} record seq {seq} (t={at_ms:.3} ms): {violation}")]
    Capacity { worker: WorkerId, seq: u64, at_ms: f64, violation: CapacityViolation },
    #[error("the log contradicts itself: {worker} record seq {seq} (t={at_ms:.3} ms): {violation}")]
    View { worker: WorkerId, seq: u64, at_ms: f64, violation: ViewViolation },
    #[error("the log contradicts itself: {worker} record seq {seq} (t={at_ms:.3} ms): router bookings: {violation}")]
    Booking { worker: WorkerId, seq: u64, at_ms: f64, violation: BookingViolation },
}

impl ProjectError {
    /// `violation` of `worker`'s record `rec`, located.
    pub fn located(worker: WorkerId, rec: &Record, violation: WorkerViolation) -> Self {
        let (seq, at_ms) = (rec.seq, ms(rec.at_ns));
        match violation {
            WorkerViolation::Capacity(violation) => ProjectError::Capacity { worker, seq, at_ms, violation },
            WorkerViolation::View(violation) => ProjectError::View { worker, seq, at_ms, violation },
            WorkerViolation::Booking(violation) => ProjectError::Booking { worker, seq, at_ms, violation },
        }
    }
}

/// Every stream folded by the shared [`WorkerFold`], so a command that answers from other folds
/// (the ledger, metrics) refuses a self-contradicting log as `project capacity` or `inspect`
/// does: the one rule for contradictions.
pub struct Consistency {
    folds: Vec<WorkerFold>,
}

impl Consistency {
    pub fn new(headers: &[StreamHeader]) -> Self {
        Consistency { folds: headers.iter().map(WorkerFold::new).collect() }
    }

    /// Folds record `rec` of stream `stream`; a contradiction is an error naming the record.
    pub fn check(&mut self, stream: usize, rec: &Record) -> Result<(), ProjectError> {
        let Some(fold) = self.folds.get_mut(stream) else { return Ok(()) };
        fold.apply(rec).map(|_| ()).map_err(|v| ProjectError::located(fold.worker, rec, v))
    }
}

/// `verify` of framing and content: [`crate::events::verify_run`] with every stream folded.
pub fn verify_consistent(path: &std::path::Path) -> Result<RunSummary, ProjectError> {
    let mut consistency = Consistency::new(&RunLayout::open(path)?.headers);
    verify_run_with(path, |i, rec| consistency.check(i, rec))
}

/// A peak and when it was first reached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Peak {
    pub blocks: u64,
    pub at_ns: u64,
}

impl Peak {
    fn see(&mut self, blocks: u64, at_ns: u64) {
        if blocks > self.blocks {
            *self = Peak { blocks, at_ns };
        }
    }
}

/// One worker's capacity: the final snapshot and the peaks on the way.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CapacityRow {
    pub worker: WorkerId,
    pub last: KvCapacitySnapshot,
    pub peak_active: Peak,
    pub peak_pinned_source: Peak,
    pub peak_reserved_destination: Peak,
    pub peak_kv_used: Peak,
    /// Records that changed the snapshot.
    pub transitions: u64,
}

/// Folds every engine stream's capacity; refuses a run whose deltas break conservation or
/// overdraw a class, naming the record.
pub fn project_capacity(run: &mut RunReader) -> Result<Vec<CapacityRow>, ProjectError> {
    let headers = run.headers().to_vec();
    let mut rows: Vec<Option<(WorkerFold, CapacityRow)>> = headers
        .iter()
        .map(|h| {
            (h.worker.role != Role::Router).then(|| {
                let fold = WorkerFold::new(h).without_queues();
                let row = CapacityRow {
                    worker: h.worker,
                    last: fold.capacity,
                    peak_active: Peak::default(),
                    peak_pinned_source: Peak::default(),
                    peak_reserved_destination: Peak::default(),
                    peak_kv_used: Peak::default(),
                    transitions: 0,
                };
                (fold, row)
            })
        })
        .collect();
    while let Some((i, rec)) = run.next()? {
        let Some((fold, row)) = rows[i].as_mut() else {
            continue;
        };
        let change = fold.apply(&rec).map_err(|v| ProjectError::located(row.worker, &rec, v))?;
        if change.delta.is_zero() {
            continue;
        }
        row.transitions += 1;
        let s = fold.capacity;
        row.last = s;
        row.peak_active.see(s.active_blocks, rec.at_ns);
        row.peak_pinned_source.see(s.pinned_source_blocks, rec.at_ns);
        row.peak_reserved_destination.see(s.reserved_destination_blocks, rec.at_ns);
        row.peak_kv_used.see(s.kv_used_blocks(), rec.at_ns);
    }
    Ok(rows.into_iter().flatten().map(|(_, row)| row).collect())
}

/// The handoff ledger of a run.
pub fn project_handoffs(run: &mut RunReader) -> Result<HandoffLedger, ProjectError> {
    let workers: Vec<WorkerId> = run.headers().iter().map(|h| h.worker).collect();
    let mut consistency = Consistency::new(run.headers());
    let mut ledger = HandoffLedger::new();
    while let Some((i, rec)) = run.next()? {
        consistency.check(i, &rec)?;
        ledger.apply(workers[i], &rec);
    }
    Ok(ledger)
}

/// The handoff ledger of a run as a stream: `each` gets every handoff's entry once, finished
/// handoffs roughly in the order they finished, then those still in flight at the log's end;
/// `end_ns` (the log's last instant so far) is for still-pinned durations. Memory follows the
/// handoffs in flight ([`HandoffStream`]).
pub fn project_handoffs_streaming<E: From<ProjectError>>(
    run: &mut RunReader,
    mut each: impl FnMut(HandoffId, HandoffEntry, u64) -> Result<(), E>,
) -> Result<usize, E> {
    let workers: Vec<WorkerId> = run.headers().iter().map(|h| h.worker).collect();
    let mut consistency = Consistency::new(run.headers());
    let mut stream = HandoffStream::new();
    let mut handed = 0;
    while let Some((i, rec)) = run.next().map_err(ProjectError::from)? {
        consistency.check(i, &rec)?;
        if let Some((id, entry)) = stream.apply(workers[i], &rec) {
            each(id, entry, stream.last_at_ns())?;
            handed += 1;
        }
    }
    let end = stream.last_at_ns();
    for (id, entry) in stream.finish() {
        each(id, entry, end)?;
        handed += 1;
    }
    Ok(handed)
}

/// Every engine stream's final scheduler view.
pub fn project_scheduler(run: &mut RunReader) -> Result<BTreeMap<WorkerId, SchedulerView>, ProjectError> {
    let mut folds: Vec<WorkerFold> = run.headers().iter().map(WorkerFold::new).collect();
    while let Some((i, rec)) = run.next()? {
        let fold = &mut folds[i];
        if !fold.is_router() {
            fold.apply(&rec).map_err(|v| ProjectError::located(fold.worker, &rec, v))?;
        }
    }
    Ok(folds.into_iter().filter(|f| !f.is_router()).map(|f| (f.worker, f.view())).collect())
}

/// The serving metrics and stranding figures of a run, exactly as the replay reported them.
pub fn project_metrics(run: &mut RunReader) -> Result<MetricsReport, ProjectError> {
    let headers = run.headers().to_vec();
    let mut fold = MetricsFold::new();
    for h in &headers {
        fold.add_stream(h);
    }
    let mut consistency = Consistency::new(&headers);
    while let Some((i, rec)) = run.next()? {
        consistency.check(i, &rec)?;
        fold.apply(headers[i].worker, &rec);
    }
    Ok(fold.report())
}
