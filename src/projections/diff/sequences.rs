//! Per-worker sequences: each engine worker's capacity snapshots after every KV-moving fact
//! and the router's booking facts, folded per stream by [`Track`] on each side, compared
//! element by element as both runs are walked (or, when they drift too far apart, afterwards
//! in lockstep), and the final state of each worker.

use super::context::{Context, RecordRef};
use super::findings::{Candidate, Findings};
use super::report::{DiffKind, Difference, Location};
use crate::events::{Fact, KvDelta, LogError, Record, RunLayout, SegmentKind, SegmentReader};
use crate::ids::{Role, WorkerId};
use crate::model::capacity::KvCapacitySnapshot;
use crate::projections::bookings::is_booking_fact;
use crate::projections::worker::{WorkerFold, WorkerViolation};
use std::collections::VecDeque;

/// One element of a worker's compared sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum SequenceElement {
    /// The snapshot after a KV-moving fact; `false` if the snapshot refused the delta.
    Capacity(KvCapacitySnapshot, bool, KvDelta),
    Booking(Fact),
}

impl SequenceElement {
    pub(super) fn same(&self, o: &SequenceElement) -> bool {
        match (self, o) {
            // Equal snapshots after equal starting points mean the same transition; the delta
            // is only kept for the message.
            (SequenceElement::Capacity(a, ok_a, _), SequenceElement::Capacity(b, ok_b, _)) => {
                a == b && ok_a == ok_b
            }
            (SequenceElement::Booking(a), SequenceElement::Booking(b)) => a == b,
            _ => false,
        }
    }

    pub(super) fn describe(&self) -> String {
        match self {
            SequenceElement::Capacity(s, ok, d) => format!(
                "{}delta {} → active={} pinned={} reserved={} cached_free={} free={} slots={} headroom={}",
                if *ok { "" } else { "REFUSED " },
                d,
                s.active_blocks,
                s.pinned_source_blocks,
                s.reserved_destination_blocks,
                s.cached_free_blocks,
                s.free_blocks,
                s.request_slots_used,
                s.decode_headroom_tokens
            ),
            SequenceElement::Booking(f) => fact_text(f),
        }
    }
}

/// A fact as `Name key=value ...` (JSON field values, worker ids as text).
pub fn fact_text(fact: &Fact) -> String {
    let mut out = fact.name().to_string();
    if let Ok(serde_json::Value::Object(m)) = serde_json::to_value(fact) {
        if let Some(serde_json::Value::Object(fields)) = m.values().next() {
            for (k, v) in fields {
                out.push(' ');
                out.push_str(k);
                out.push('=');
                match v {
                    serde_json::Value::String(s) => out.push_str(s),
                    other => out.push_str(&other.to_string()),
                }
            }
        }
    }
    out
}

/// One worker's per-stream folds on one side: snapshot, bookings, and a ring of the offsets of
/// its last few records (for context).
pub(super) struct Track {
    pub(super) stream: usize,
    pub(super) worker: WorkerId,
    pub(super) present: bool,
    /// Capacity (engine) or bookings (router), as every command folds them.
    pub(super) fold: WorkerFold,
    pub(super) ring: VecDeque<RecordRef>,
    pub(super) ring_cap: usize,
    pub(super) last: Option<Location>,
    pub(super) last_ref: Option<RecordRef>,
    pub(super) records: u64,
}

/// One element of a worker's sequence with where it is.
pub(super) struct QueuedElement {
    pub(super) loc: Location,
    pub(super) r: RecordRef,
    /// Offset of the oldest record of the context ring when the element was made.
    pub(super) start: u64,
    pub(super) elem: SequenceElement,
}

impl Track {
    pub(super) fn new(layout: &RunLayout, worker: WorkerId, ring_cap: usize) -> Self {
        let stream = layout.headers.iter().position(|h| h.worker == worker);
        Track {
            stream: stream.unwrap_or(usize::MAX),
            worker,
            present: stream.is_some(),
            fold: match stream {
                Some(i) => WorkerFold::new(&layout.headers[i]),
                None => WorkerFold::for_worker(worker, 0),
            }
            .without_queues(),
            ring: VecDeque::with_capacity(ring_cap + 1),
            ring_cap,
            last: None,
            last_ref: None,
            records: 0,
        }
    }

    /// Folds one record of this stream; returns the sequence element it adds, if any.
    pub(super) fn observe(&mut self, rec: &Record, offset: u64) -> Option<QueuedElement> {
        let r = RecordRef { stream: self.stream, offset };
        self.records += 1;
        if self.ring.len() == self.ring_cap + 1 {
            self.ring.pop_front();
        }
        self.ring.push_back(r);
        let loc = Location::of(self.worker, rec);
        self.last = Some(loc.clone());
        self.last_ref = Some(r);
        let applied = self.fold.apply(rec);
        let elem = if self.worker.role == Role::Router {
            if !is_booking_fact(&rec.fact) {
                return None;
            }
            // A refused booking fact is still an element: the fact itself is compared.
            SequenceElement::Booking(rec.fact.clone())
        } else {
            // A refused delta is still an element, marked as refused.
            let (ok, d) = match applied {
                Ok(change) => (true, change.delta),
                Err(WorkerViolation::Capacity(v)) => (false, v.delta),
                Err(_) => (true, rec.fact.kv_delta()),
            };
            if d.is_zero() {
                return None;
            }
            SequenceElement::Capacity(self.fold.capacity, ok, d)
        };
        Some(QueuedElement { loc, r, start: self.ring.front().map_or(offset, |x| x.offset), elem })
    }

    pub(super) fn drained(&self) -> bool {
        self.fold.is_drained()
    }

    pub(super) fn final_text(&self) -> String {
        if !self.present {
            return "no stream".into();
        }
        if self.worker.role == Role::Router {
            let (p, d) = self.fold.bookings.in_flight();
            format!("{p} prefill and {d} decode bookings open")
        } else {
            self.fold.capacity.to_string()
        }
    }

    /// Context for a divergence at `e` (or, when this side's sequence ended, at its last record).
    pub(super) fn ctx(&self, e: Option<&QueuedElement>, after: usize) -> (Context, Option<RecordRef>) {
        match e {
            Some(q) => {
                (Context::Span { stream: q.r.stream, start: q.start, div: q.r.offset, after }, Some(q.r))
            }
            None => (Context::Refs(self.ring.iter().copied().collect()), self.last_ref),
        }
    }
}

pub(super) fn seq_kind(w: WorkerId) -> DiffKind {
    if w.role == Role::Router {
        DiffKind::BookingSequence
    } else {
        DiffKind::CapacitySequence
    }
}

/// The difference at element `index` of worker `w`'s sequence.
pub(super) fn seq_divergence(
    w: WorkerId,
    index: u64,
    ea: Option<&QueuedElement>,
    eb: Option<&QueuedElement>,
    ta: &Track,
    tb: &Track,
    after: usize,
) -> Candidate {
    let kind = seq_kind(w);
    let describe = |e: Option<&QueuedElement>| match e {
        Some(q) => q.elem.describe(),
        None => "(sequence ends)".into(),
    };
    let detail = format!(
        "element {index} of the {} sequence: A {}; B {}",
        if kind == DiffKind::BookingSequence { "booking" } else { "capacity" },
        describe(ea),
        describe(eb)
    );
    // A side whose sequence ended is located at its last record.
    let loc = |e: Option<&QueuedElement>, t: &Track| match e {
        Some(q) => Some(q.loc.clone()),
        None => t.last.clone(),
    };
    let (ctx_a, div_a) = ta.ctx(ea, after);
    let (ctx_b, div_b) = tb.ctx(eb, after);
    Candidate {
        diff: Difference { kind, subject: format!("worker {w}"), a: loc(ea, ta), b: loc(eb, tb), detail },
        ctx_a,
        ctx_b,
        div_a,
        div_b,
    }
}

/// Reports the final-state difference of worker `w`, if any.
pub(super) fn final_state(findings: &mut Findings, w: WorkerId, a: &Track, b: &Track) {
    // Against a virtual run, a wall-clock run may return a block to the cache or to the free
    // list depending on what else the cache held at that moment (see `relaxed_kinds`): the
    // two count as one class there.
    let unused_as_one = findings.relaxed.contains(&DiffKind::CapacitySequence);
    let held = |t: &Track| {
        let c = &t.fold.capacity;
        (
            c.active_blocks,
            c.pinned_source_blocks,
            c.reserved_destination_blocks,
            c.cached_free_blocks + c.free_blocks,
            c.total_blocks,
            c.request_slots_used,
            c.decode_headroom_tokens,
        )
    };
    let same = if w.role == Role::Router {
        a.fold.bookings == b.fold.bookings
    } else if unused_as_one {
        held(a) == held(b)
    } else {
        a.fold.capacity == b.fold.capacity
    };
    if a.present && b.present && same && a.drained() == b.drained() {
        return;
    }
    let drained = |t: &Track| {
        if t.drained() {
            "drained"
        } else {
            "NOT drained"
        }
    };
    findings.add(Candidate {
        diff: Difference {
            kind: DiffKind::FinalState,
            subject: format!("worker {w}"),
            a: a.last.clone(),
            b: b.last.clone(),
            detail: format!(
                "at the end: A {} ({}); B {} ({})",
                a.final_text(),
                drained(a),
                b.final_text(),
                drained(b)
            ),
        },
        ctx_a: Context::Refs(a.ring.iter().copied().collect()),
        ctx_b: Context::Refs(b.ring.iter().copied().collect()),
        div_a: a.last_ref,
        div_b: b.last_ref,
    });
}

/// One side of one worker read on its own (the fallback when the merge-order walks of the two
/// runs drift too far apart for this worker; see [`QUEUE_LIMIT`](super::QUEUE_LIMIT)).
pub(super) struct WorkerSide {
    pub(super) reader: Option<SegmentReader>,
    pub(super) track: Track,
}

impl WorkerSide {
    pub(super) fn open(layout: &RunLayout, worker: WorkerId, ring_cap: usize) -> Result<Self, LogError> {
        let track = Track::new(layout, worker, ring_cap);
        let reader = match track.present {
            true => {
                let i = track.stream;
                let seg =
                    layout.segment_of(i).ok_or_else(|| LogError::EmptyRun { path: layout.run.clone() })?;
                let mut r = SegmentReader::open_at(seg, seg.start_position(), vec![0; layout.headers.len()])?;
                if seg.kind == SegmentKind::Merged {
                    r = r.only_stream(i);
                }
                Some(r)
            }
            false => None,
        };
        Ok(WorkerSide { reader, track })
    }

    pub(super) fn next_elem(&mut self) -> Result<Option<QueuedElement>, LogError> {
        let Some(reader) = self.reader.as_mut() else {
            return Ok(None);
        };
        while let Some((_, rec)) = reader.next_record()? {
            if let Some(q) = self.track.observe(&rec, reader.last_record_offset().unwrap_or_default()) {
                return Ok(Some(q));
            }
        }
        Ok(None)
    }

    pub(super) fn drain(&mut self) -> Result<(), LogError> {
        while self.next_elem()?.is_some() {}
        Ok(())
    }
}

/// Compares one worker's sequence and final state by reading its stream in both runs in
/// lockstep (memory: one element per side).
pub(super) fn compare_worker_lockstep(
    la: &RunLayout,
    lb: &RunLayout,
    w: WorkerId,
    findings: &mut Findings,
) -> Result<(), LogError> {
    let c = findings.opts.context_records;
    let mut a = WorkerSide::open(la, w, c)?;
    let mut b = WorkerSide::open(lb, w, c)?;
    let mut index = 0u64;
    loop {
        let ea = a.next_elem()?;
        let eb = b.next_elem()?;
        match (&ea, &eb) {
            (None, None) => break,
            (Some(x), Some(y)) if x.elem.same(&y.elem) => index += 1,
            _ => {
                let cand = seq_divergence(w, index, ea.as_ref(), eb.as_ref(), &a.track, &b.track, c);
                findings.add(cand);
                break;
            }
        }
    }
    a.drain()?;
    b.drain()?;
    count_elements(findings, w, index);
    final_state(findings, w, &a.track, &b.track);
    Ok(())
}

pub(super) fn count_elements(findings: &mut Findings, w: WorkerId, n: u64) {
    if seq_kind(w) == DiffKind::CapacitySequence {
        findings.compared.capacity_transitions += n;
    } else {
        findings.compared.booking_facts += n;
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum ComparisonState {
    Live,
    Diverged,
    /// Too far out of step: compared afterwards by [`compare_worker_lockstep`].
    Deferred,
}

/// One worker's sequences being compared as both runs are walked in merge order.
pub(super) struct WorkerComparison {
    pub(super) worker: WorkerId,
    pub(super) qa: VecDeque<QueuedElement>,
    pub(super) qb: VecDeque<QueuedElement>,
    pub(super) index: u64,
    pub(super) state: ComparisonState,
}

/// Adds a sequence element from run A (`from_a`) or B and compares what both runs have.
#[allow(clippy::too_many_arguments)]
pub(super) fn offer(
    cmp: &mut WorkerComparison,
    from_a: bool,
    q: QueuedElement,
    ta: &Track,
    tb: &Track,
    findings: &mut Findings,
    queued: &mut [usize; 2],
    c: usize,
    limit: usize,
) {
    if cmp.state != ComparisonState::Live {
        return;
    }
    if from_a {
        cmp.qa.push_back(q);
        queued[0] += 1;
    } else {
        cmp.qb.push_back(q);
        queued[1] += 1;
    }
    while !cmp.qa.is_empty() && !cmp.qb.is_empty() {
        let (Some(x), Some(y)) = (cmp.qa.pop_front(), cmp.qb.pop_front()) else {
            break;
        };
        queued[0] -= 1;
        queued[1] -= 1;
        if x.elem.same(&y.elem) {
            cmp.index += 1;
            continue;
        }
        findings.add(seq_divergence(cmp.worker, cmp.index, Some(&x), Some(&y), ta, tb, c));
        cmp.state = ComparisonState::Diverged;
        break;
    }
    if cmp.state == ComparisonState::Live && (cmp.qa.len() > limit || cmp.qb.len() > limit) {
        cmp.state = ComparisonState::Deferred;
    }
    if cmp.state != ComparisonState::Live {
        queued[0] -= cmp.qa.len();
        queued[1] -= cmp.qb.len();
        cmp.qa = VecDeque::new();
        cmp.qb = VecDeque::new();
    }
}
