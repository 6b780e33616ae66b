//! Parity: are two runs (live and replay, two replays, two backends) equivalent?
//!
//! ## What "equivalent" means
//! Two runs are **equivalent** when every projection below is equal. Wall-clock time is not
//! compared, except as the timing figures at the end, which are reported and only fail the
//! comparison when asked (`strict_timing`).
//!
//! 1. **capacity-sequence** — per engine worker (matched by [`WorkerId`]), the sequence of
//!    [`KvCapacitySnapshot`] values after each fact that moves KV (a non-zero [`KvDelta`]),
//!    ignoring when it happened. A delta the snapshot refuses (overdraw, broken conservation) is
//!    an element of its own, so it cannot hide.
//! 2. **booking-sequence** — the router stream's booking facts (`PrefillBooked`,
//!    `PrefillComputeDone`, `PrefillBookingFreed`, `DecodeBooked`, `DecodeBookingFreed`), fact
//!    by fact with all their fields, ignoring time.
//! 3. **handoff-sequence** — per handoff, its normalized milestone sequence
//!    ([`HandoffEntry::normalized`]), outcome, source and destination workers, pinned blocks,
//!    reserved pages and prefix, and how each side ended. Handoffs are matched by their request
//!    id and attempt number (the n-th handoff started for that request), because HandoffIds come
//!    from the seed; a handoff whose request is never named falls back to its HandoffId.
//! 4. **request-outcome** — per request id: terminal status, output tokens, and the prefill and
//!    decode workers the router booked it on, in order.
//! 5. **final-state** — per worker, the final snapshot (or the router's open bookings), and
//!    whether the worker ended drained (nothing active, pinned, reserved, no slots or headroom
//!    held; the router: no booking open). A stream present in only one run is a final-state
//!    difference too.
//! 6. **timing** — per handoff the source pin duration, per request TTFT and end-to-end
//!    latency, compared within `timing_tolerance_pct` of the larger value. Reported; counted as a
//!    difference only with `strict_timing`.
//!
//! A sequence difference is counted once per sequence (its first divergent element): after one
//! fact is inserted or dropped, every later element is shifted and counting them would say
//! nothing more.
//!
//! ## Streaming
//! Memory does not grow with the length of the logs. Each run is read once, in merge order
//! (a 16-byte-key k-way merge of its stream files, or a merged file straight through), and the
//! two walks advance together, always stepping the run that is behind:
//! - each worker's sequence elements are queued until the other run produces the matching
//!   element, compared, and dropped; only a ring of the last few record offsets is kept for
//!   context (records are re-read by offset to print them). If one run gets more than
//!   [`DiffOptions::queue_limit`] elements ahead on a worker (the runs' timing drifted far
//!   apart), that worker's queues are dropped and it is compared afterwards by reading its
//!   stream in both runs in lockstep — a second read of that stream, constant memory;
//! - handoffs and requests are kept while in flight, compared as soon as both runs have
//!   finished them, and dropped. A request finishes at its router `RequestFinished` (or the
//!   engine's, in a run without a router); a handoff once its request finished and it holds
//!   nothing. Straggling facts about an entry already compared (a late duplicate message) are
//!   recognised by a bounded memory of recently finished ids and ignored.

use crate::events::index::{read_record_at, records_around, RunLayout, Segment, SegmentKind, SegmentReader};
use crate::events::{Fact, KvDelta, LogError, Record, RunReader, StreamHeader, TerminalStatus};
use crate::ids::{CancelReason, EndReason, HandoffId, RequestId, Role, WorkerId};
use crate::lifecycle::policy::Milestone;
use crate::projections::bookings::{is_booking_fact, BookingFold};
use crate::projections::capacity::KvCapacitySnapshot;
use crate::projections::handoffs::{HandoffEntry, HandoffLedger, HandoffOutcome};
use crate::units::ms;
use serde::ser::SerializeStruct;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};

/// How to compare.
#[derive(Clone, Debug)]
pub struct DiffOptions {
    /// Timing figures differ when they are more than this percent apart (of the larger).
    pub timing_tolerance_pct: f64,
    /// Count timing differences against equivalence.
    pub strict_timing: bool,
    /// Records shown before and after the first divergence on each side.
    pub context_records: usize,
    /// Differences listed per kind (all are counted).
    pub max_examples: usize,
    /// Sequence elements one run may get ahead of the other on one worker, while both are
    /// walked in merge order, before that worker is compared on its own afterwards (a second
    /// read of its stream in both runs). Bounds memory when the runs' timing drifts apart.
    pub queue_limit: usize,
}

impl Default for DiffOptions {
    fn default() -> Self {
        DiffOptions {
            timing_tolerance_pct: 5.0,
            strict_timing: false,
            context_records: 3,
            max_examples: 10,
            queue_limit: QUEUE_LIMIT,
        }
    }
}

/// The kinds of difference, in the order the summary lists them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DiffKind {
    HandoffSequence,
    RequestOutcome,
    CapacitySequence,
    BookingSequence,
    FinalState,
    Timing,
}

impl DiffKind {
    pub const ALL: [DiffKind; 6] = [
        DiffKind::HandoffSequence,
        DiffKind::RequestOutcome,
        DiffKind::CapacitySequence,
        DiffKind::BookingSequence,
        DiffKind::FinalState,
        DiffKind::Timing,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DiffKind::HandoffSequence => "handoff-sequence",
            DiffKind::RequestOutcome => "request-outcome",
            DiffKind::CapacitySequence => "capacity-sequence",
            DiffKind::BookingSequence => "booking-sequence",
            DiffKind::FinalState => "final-state",
            DiffKind::Timing => "timing",
        }
    }
}

/// A record, named as `show` names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Location {
    pub worker: WorkerId,
    pub seq: u64,
    pub at_ns: u64,
    pub fact: &'static str,
}

impl Location {
    fn of(worker: WorkerId, rec: &Record) -> Self {
        Location { worker, seq: rec.seq, at_ns: rec.at_ns, fact: rec.fact.name() }
    }
}

/// One difference between the runs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Difference {
    pub kind: DiffKind,
    /// What differs: `worker decode-0`, `request r12`, `handoff r12#0`, ...
    pub subject: String,
    /// Where, in run A and in run B (`None`: that run has no such record).
    pub a: Option<Location>,
    pub b: Option<Location>,
    pub detail: String,
}

impl Difference {
    /// The earliest instant the difference is visible at (for picking the first divergence).
    pub fn at_ns(&self) -> u64 {
        let a = self.a.as_ref().map_or(u64::MAX, |l| l.at_ns);
        let b = self.b.as_ref().map_or(u64::MAX, |l| l.at_ns);
        a.min(b)
    }
}

/// A record shown around the first divergence.
#[derive(Clone, Debug, PartialEq)]
pub struct ContextRecord {
    pub worker: WorkerId,
    pub record: Record,
    /// This is the divergent record.
    pub divergent: bool,
}

impl Serialize for ContextRecord {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("ContextRecord", 6)?;
        st.serialize_field("at_ns", &self.record.at_ns)?;
        st.serialize_field("worker", &self.worker)?;
        st.serialize_field("seq", &self.record.seq)?;
        st.serialize_field("fact", self.record.fact.name())?;
        st.serialize_field("fields", &self.record.fact)?;
        st.serialize_field("divergent", &self.divergent)?;
        st.end()
    }
}

/// The first divergence with the records around it on both sides.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Divergence {
    pub difference: Difference,
    pub context_a: Vec<ContextRecord>,
    pub context_b: Vec<ContextRecord>,
}

/// What was compared.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Compared {
    pub workers: usize,
    pub records_a: u64,
    pub records_b: u64,
    pub capacity_transitions: u64,
    pub booking_facts: u64,
    pub handoffs: u64,
    pub requests: u64,
}

/// Timing figures compared.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TimingSummary {
    pub tolerance_pct: f64,
    pub compared: u64,
    pub outside_tolerance: u64,
    pub max_diff_pct: f64,
}

/// The result of [`diff_runs`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DiffReport {
    pub a: PathBuf,
    pub b: PathBuf,
    pub equivalent: bool,
    /// Differences per kind (every kind present, zeros included).
    pub counts: BTreeMap<DiffKind, u64>,
    pub first: Option<Divergence>,
    /// The first `max_examples` differences found per kind, listed by kind and time.
    pub examples: Vec<Difference>,
    pub compared: Compared,
    pub timing: TimingSummary,
    /// Whether timing differences counted against equivalence.
    pub strict_timing: bool,
}

/// A record to re-read for context: its stream and byte offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RecRef {
    stream: usize,
    offset: u64,
}

/// The records to print around a divergence on one side.
enum Ctx {
    /// These records.
    Refs(Vec<RecRef>),
    /// `stream`'s records from offset `start` to `after` records past the one at `div`.
    Span { stream: usize, start: u64, div: u64, after: usize },
}

/// A candidate first divergence: the difference and record references to print around it.
struct Candidate {
    diff: Difference,
    ctx_a: Ctx,
    ctx_b: Ctx,
    div_a: Option<RecRef>,
    div_b: Option<RecRef>,
}

/// Collects differences: counts, examples, and the earliest one with its context.
struct Acc {
    opts: DiffOptions,
    counts: BTreeMap<DiffKind, u64>,
    examples: Vec<Difference>,
    first: Option<Candidate>,
    timing: TimingSummary,
    compared: Compared,
}

impl Acc {
    fn add(&mut self, cand: Candidate) {
        let kind = cand.diff.kind;
        let n = self.counts.entry(kind).or_insert(0);
        *n += 1;
        if *n as usize <= self.opts.max_examples {
            self.examples.push(cand.diff.clone());
        }
        if kind == DiffKind::Timing && !self.opts.strict_timing {
            return;
        }
        let better = match &self.first {
            None => true,
            Some(f) => (cand.diff.at_ns(), cand.diff.kind) < (f.diff.at_ns(), f.diff.kind),
        };
        if better {
            self.first = Some(cand);
        }
    }

    fn plain(&mut self, diff: Difference) {
        self.add(Candidate {
            diff,
            ctx_a: Ctx::Refs(Vec::new()),
            ctx_b: Ctx::Refs(Vec::new()),
            div_a: None,
            div_b: None,
        });
    }

    /// Compares one timing figure; `None` on either side is not compared.
    fn timing(
        &mut self,
        subject: &str,
        what: &str,
        a: Option<u64>,
        b: Option<u64>,
        la: &Option<Location>,
        lb: &Option<Location>,
    ) {
        let (Some(a), Some(b)) = (a, b) else {
            return;
        };
        self.timing.compared += 1;
        let hi = a.max(b);
        if hi == 0 {
            return;
        }
        let pct = a.abs_diff(b) as f64 / hi as f64 * 100.0;
        if pct > self.timing.max_diff_pct {
            self.timing.max_diff_pct = pct;
        }
        if pct > self.opts.timing_tolerance_pct {
            self.timing.outside_tolerance += 1;
            self.plain(Difference {
                kind: DiffKind::Timing,
                subject: subject.to_string(),
                a: la.clone(),
                b: lb.clone(),
                detail: format!(
                    "{what}: A {:.3} ms, B {:.3} ms ({pct:.1}% apart, tolerance {}%)",
                    ms(a),
                    ms(b),
                    self.opts.timing_tolerance_pct
                ),
            });
        }
    }
}

/// Compares run `a` with run `b` (each a directory, merged file or stream file).
/// `progress` is told the number of records read so far, now and then.
pub fn diff_runs(
    a: &Path,
    b: &Path,
    opts: &DiffOptions,
    progress: &mut dyn FnMut(u64),
) -> Result<DiffReport, LogError> {
    let la = RunLayout::open(a)?;
    let lb = RunLayout::open(b)?;
    let mut acc = Acc {
        opts: opts.clone(),
        counts: DiffKind::ALL.iter().map(|k| (*k, 0)).collect(),
        examples: Vec::new(),
        first: None,
        timing: TimingSummary { tolerance_pct: opts.timing_tolerance_pct, ..Default::default() },
        compared: Compared::default(),
    };
    compare_all(&la, &lb, &mut acc, progress)?;
    let first = match acc.first.take() {
        Some(c) => Some(Divergence {
            context_a: resolve(&la, &c.ctx_a, c.div_a)?,
            context_b: resolve(&lb, &c.ctx_b, c.div_b)?,
            difference: c.diff,
        }),
        None => None,
    };
    // Listed by kind, then by when each became visible.
    acc.examples.sort_by_key(|d| (d.kind, d.at_ns()));
    let failing: u64 = acc
        .counts
        .iter()
        .filter(|(k, _)| **k != DiffKind::Timing || opts.strict_timing)
        .map(|(_, n)| *n)
        .sum();
    Ok(DiffReport {
        a: a.to_path_buf(),
        b: b.to_path_buf(),
        equivalent: failing == 0,
        counts: acc.counts,
        first,
        examples: acc.examples,
        compared: acc.compared,
        timing: acc.timing,
        strict_timing: opts.strict_timing,
    })
}

fn segment_of(layout: &RunLayout, stream: usize) -> Option<&Segment> {
    layout.segments.iter().find(|s| s.streams.contains(&stream))
}

fn resolve(layout: &RunLayout, ctx: &Ctx, div: Option<RecRef>) -> Result<Vec<ContextRecord>, LogError> {
    let mut out = Vec::new();
    match ctx {
        Ctx::Refs(refs) => {
            for r in refs {
                let Some(seg) = segment_of(layout, r.stream) else {
                    continue;
                };
                let (_, record) = read_record_at(&seg.path, seg.kind, r.offset)?;
                out.push(ContextRecord {
                    worker: layout.headers[r.stream].worker,
                    record,
                    divergent: Some(*r) == div,
                });
            }
        }
        Ctx::Span { stream, start, div: d, after } => {
            let Some(seg) = segment_of(layout, *stream) else {
                return Ok(out);
            };
            // A bounded read: in a merged file other streams' records lie in between.
            for (offset, record) in records_around(seg, *stream, *start, *d, *after, 1 << 20)? {
                out.push(ContextRecord {
                    worker: layout.headers[*stream].worker,
                    record,
                    divergent: offset == *d,
                });
            }
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Per-worker sequences (capacity, bookings) and final state.

/// One element of a worker's compared sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Elem {
    /// The snapshot after a KV-moving fact; `false` if the snapshot refused the delta.
    Capacity(KvCapacitySnapshot, bool, KvDelta),
    Booking(Fact),
}

impl Elem {
    fn same(&self, o: &Elem) -> bool {
        match (self, o) {
            // Equal snapshots after equal starting points mean the same transition; the delta
            // is only kept for the message.
            (Elem::Capacity(a, ok_a, _), Elem::Capacity(b, ok_b, _)) => a == b && ok_a == ok_b,
            (Elem::Booking(a), Elem::Booking(b)) => a == b,
            _ => false,
        }
    }

    fn describe(&self) -> String {
        match self {
            Elem::Capacity(s, ok, d) => format!(
                "{}delta {} → active={} pinned={} reserved={} cached_free={} free={} slots={} headroom={}",
                if *ok { "" } else { "REFUSED " },
                delta_text(d),
                s.active_blocks,
                s.pinned_source_blocks,
                s.reserved_destination_blocks,
                s.cached_free_blocks,
                s.free_blocks,
                s.request_slots_used,
                s.decode_headroom_tokens
            ),
            Elem::Booking(f) => fact_text(f),
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

fn delta_text(d: &KvDelta) -> String {
    let parts: Vec<String> = [
        ("active", d.active),
        ("pinned_source", d.pinned_source),
        ("reserved_destination", d.reserved_destination),
        ("cached_free", d.cached_free),
        ("free", d.free),
        ("slots", d.slots),
        ("headroom_tokens", d.headroom_tokens),
    ]
    .iter()
    .filter(|(_, v)| *v != 0)
    .map(|(k, v)| format!("{k}{v:+}"))
    .collect();
    if parts.is_empty() {
        "0".into()
    } else {
        parts.join(",")
    }
}

/// One worker's per-stream folds on one side: snapshot, bookings, and a ring of the offsets of
/// its last few records (for context).
struct Track {
    stream: usize,
    worker: WorkerId,
    present: bool,
    capacity: KvCapacitySnapshot,
    bookings: BookingFold,
    ring: VecDeque<RecRef>,
    ring_cap: usize,
    last: Option<Location>,
    last_ref: Option<RecRef>,
    records: u64,
}

/// One element of a worker's sequence with where it is.
struct QElem {
    loc: Location,
    r: RecRef,
    /// Offset of the oldest record of the context ring when the element was made.
    start: u64,
    elem: Elem,
}

impl Track {
    fn new(layout: &RunLayout, worker: WorkerId, ring_cap: usize) -> Self {
        let stream = layout.headers.iter().position(|h| h.worker == worker);
        Track {
            stream: stream.unwrap_or(usize::MAX),
            worker,
            present: stream.is_some(),
            capacity: match stream {
                Some(i) => KvCapacitySnapshot::empty(layout.headers[i].engine.total_blocks as u64),
                None => KvCapacitySnapshot::default(),
            },
            bookings: BookingFold::new(),
            ring: VecDeque::with_capacity(ring_cap + 1),
            ring_cap,
            last: None,
            last_ref: None,
            records: 0,
        }
    }

    /// Folds one record of this stream; returns the sequence element it adds, if any.
    fn observe(&mut self, rec: &Record, offset: u64) -> Option<QElem> {
        let r = RecRef { stream: self.stream, offset };
        self.records += 1;
        if self.ring.len() == self.ring_cap + 1 {
            self.ring.pop_front();
        }
        self.ring.push_back(r);
        let loc = Location::of(self.worker, rec);
        self.last = Some(loc.clone());
        self.last_ref = Some(r);
        let elem = if self.worker.role == Role::Router {
            if !is_booking_fact(&rec.fact) {
                return None;
            }
            // A refused booking fact is still an element: the fact itself is compared.
            let _ = self.bookings.apply(&rec.fact);
            Elem::Booking(rec.fact.clone())
        } else {
            let d = rec.fact.kv_delta();
            if d.is_zero() {
                return None;
            }
            let ok = self.capacity.apply(&d).is_ok();
            Elem::Capacity(self.capacity, ok, d)
        };
        Some(QElem { loc, r, start: self.ring.front().map_or(offset, |x| x.offset), elem })
    }

    fn drained(&self) -> bool {
        if self.worker.role == Role::Router {
            self.bookings.is_drained()
        } else {
            let s = &self.capacity;
            s.active_blocks == 0
                && s.pinned_source_blocks == 0
                && s.reserved_destination_blocks == 0
                && s.request_slots_used == 0
                && s.decode_headroom_tokens == 0
        }
    }

    fn final_text(&self) -> String {
        if !self.present {
            return "no stream".into();
        }
        if self.worker.role == Role::Router {
            let (p, d) = self.bookings.in_flight();
            format!("{p} prefill and {d} decode bookings open")
        } else {
            let s = &self.capacity;
            format!(
                "active={} pinned={} reserved={} cached_free={} free={} total={} slots={} headroom={}",
                s.active_blocks,
                s.pinned_source_blocks,
                s.reserved_destination_blocks,
                s.cached_free_blocks,
                s.free_blocks,
                s.total_blocks,
                s.request_slots_used,
                s.decode_headroom_tokens
            )
        }
    }

    /// Context for a divergence at `e` (or, when this side's sequence ended, at its last record).
    fn ctx(&self, e: Option<&QElem>, after: usize) -> (Ctx, Option<RecRef>) {
        match e {
            Some(q) => (Ctx::Span { stream: q.r.stream, start: q.start, div: q.r.offset, after }, Some(q.r)),
            None => (Ctx::Refs(self.ring.iter().copied().collect()), self.last_ref),
        }
    }
}

fn seq_kind(w: WorkerId) -> DiffKind {
    if w.role == Role::Router {
        DiffKind::BookingSequence
    } else {
        DiffKind::CapacitySequence
    }
}

/// The difference at element `index` of worker `w`'s sequence.
fn seq_divergence(
    w: WorkerId,
    index: u64,
    ea: Option<&QElem>,
    eb: Option<&QElem>,
    ta: &Track,
    tb: &Track,
    after: usize,
) -> Candidate {
    let kind = seq_kind(w);
    let describe = |e: Option<&QElem>| match e {
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
    let loc = |e: Option<&QElem>, t: &Track| match e {
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
fn final_state(acc: &mut Acc, w: WorkerId, a: &Track, b: &Track) {
    let same = if w.role == Role::Router { a.bookings == b.bookings } else { a.capacity == b.capacity };
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
    acc.add(Candidate {
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
        ctx_a: Ctx::Refs(a.ring.iter().copied().collect()),
        ctx_b: Ctx::Refs(b.ring.iter().copied().collect()),
        div_a: a.last_ref,
        div_b: b.last_ref,
    });
}

/// One side of one worker read on its own (the fallback when the merge-order walks of the two
/// runs drift too far apart for this worker; see [`QUEUE_LIMIT`]).
struct WorkerSide {
    reader: Option<SegmentReader>,
    track: Track,
}

impl WorkerSide {
    fn open(layout: &RunLayout, worker: WorkerId, ring_cap: usize) -> Result<Self, LogError> {
        let track = Track::new(layout, worker, ring_cap);
        let reader = match track.present {
            true => {
                let i = track.stream;
                let seg =
                    segment_of(layout, i).ok_or_else(|| LogError::EmptyRun { path: layout.run.clone() })?;
                let mut r = SegmentReader::open_at(seg, seg.data_start, vec![0; layout.headers.len()])?;
                if seg.kind == SegmentKind::Merged {
                    r = r.only_stream(i);
                }
                Some(r)
            }
            false => None,
        };
        Ok(WorkerSide { reader, track })
    }

    fn next_elem(&mut self) -> Result<Option<QElem>, LogError> {
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

    fn drain(&mut self) -> Result<(), LogError> {
        while self.next_elem()?.is_some() {}
        Ok(())
    }
}

/// Compares one worker's sequence and final state by reading its stream in both runs in
/// lockstep (memory: one element per side).
fn compare_worker_lockstep(
    la: &RunLayout,
    lb: &RunLayout,
    w: WorkerId,
    acc: &mut Acc,
) -> Result<(), LogError> {
    let c = acc.opts.context_records;
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
                acc.add(cand);
                break;
            }
        }
    }
    a.drain()?;
    b.drain()?;
    count_elements(acc, w, index);
    final_state(acc, w, &a.track, &b.track);
    Ok(())
}

fn count_elements(acc: &mut Acc, w: WorkerId, n: u64) {
    if seq_kind(w) == DiffKind::CapacitySequence {
        acc.compared.capacity_transitions += n;
    } else {
        acc.compared.booking_facts += n;
    }
}

/// The default of [`DiffOptions::queue_limit`].
pub const QUEUE_LIMIT: usize = 1 << 16;

#[derive(Clone, Copy, PartialEq, Eq)]
enum CmpState {
    Live,
    Diverged,
    /// Too far out of step: compared afterwards by [`compare_worker_lockstep`].
    Deferred,
}

/// One worker's sequences being compared as both runs are walked in merge order.
struct Cmp {
    worker: WorkerId,
    qa: VecDeque<QElem>,
    qb: VecDeque<QElem>,
    index: u64,
    state: CmpState,
}

// ---------------------------------------------------------------------------------------------
// Per-handoff and per-request comparisons, in merge order.

/// How a handoff is matched across runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum HKey {
    /// The n-th handoff started for the request.
    Request(RequestId, u32),
    /// A handoff whose request never showed.
    Id(HandoffId),
}

impl std::fmt::Display for HKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HKey::Request(r, n) => write!(f, "handoff of {r} (attempt {n})"),
            HKey::Id(h) => write!(f, "handoff {h}"),
        }
    }
}

/// What is compared of a handoff.
#[derive(Clone, Debug, PartialEq, Eq)]
struct HandoffSig {
    normalized: Vec<Milestone>,
    outcome: HandoffOutcome,
    source: Option<WorkerId>,
    destination: Option<WorkerId>,
    pinned_blocks: u32,
    reserved_pages: u32,
    prefix_tokens: u32,
    source_end: Option<EndReason>,
    reservation_end: Option<EndReason>,
    canceled: Option<CancelReason>,
}

impl HandoffSig {
    fn of(e: &HandoffEntry) -> Self {
        HandoffSig {
            normalized: e.normalized(),
            outcome: e.outcome(),
            source: e.source,
            destination: e.destination,
            pinned_blocks: e.pinned_blocks,
            reserved_pages: e.reserved_pages,
            prefix_tokens: e.prefix_tokens,
            source_end: e.source_end,
            reservation_end: e.reservation_end,
            canceled: e.canceled,
        }
    }

    fn differences(&self, o: &Self) -> String {
        let mut out = Vec::new();
        if self.normalized != o.normalized {
            out.push(format!(
                "sequence A [{}] vs B [{}]",
                Milestone::join(&self.normalized, ", "),
                Milestone::join(&o.normalized, ", ")
            ));
        }
        macro_rules! field {
            ($f:ident) => {
                if self.$f != o.$f {
                    out.push(format!("{} A {:?} vs B {:?}", stringify!($f), self.$f, o.$f));
                }
            };
        }
        field!(outcome);
        field!(source);
        field!(destination);
        field!(pinned_blocks);
        field!(reserved_pages);
        field!(prefix_tokens);
        field!(source_end);
        field!(reservation_end);
        field!(canceled);
        out.join("; ")
    }
}

/// What is compared of a request.
#[derive(Clone, Debug, PartialEq, Eq)]
struct RequestSig {
    status: Option<TerminalStatus>,
    output_tokens: Option<u32>,
    prefill_workers: Vec<WorkerId>,
    decode_workers: Vec<WorkerId>,
}

impl RequestSig {
    fn differences(&self, o: &Self) -> String {
        let mut out = Vec::new();
        macro_rules! field {
            ($f:ident) => {
                if self.$f != o.$f {
                    out.push(format!("{} A {:?} vs B {:?}", stringify!($f), self.$f, o.$f));
                }
            };
        }
        field!(status);
        field!(output_tokens);
        field!(prefill_workers);
        field!(decode_workers);
        out.join("; ")
    }
}

#[derive(Default)]
struct HOpen {
    request: Option<RequestId>,
    attempt: Option<u32>,
    request_finished: bool,
    ring: VecDeque<RecRef>,
    last: Option<Location>,
    last_ref: Option<RecRef>,
}

struct HDone {
    sig: HandoffSig,
    pin_ns: Option<u64>,
    last: Option<Location>,
    ring: Vec<RecRef>,
    last_ref: Option<RecRef>,
}

#[derive(Default)]
struct ROpen {
    arrival_ns: Option<u64>,
    first_token_ns: Option<u64>,
    prefill_workers: Vec<WorkerId>,
    decode_workers: Vec<WorkerId>,
    attempts: u32,
    handoffs: Vec<HandoffId>,
    ring: VecDeque<RecRef>,
    last: Option<Location>,
    last_ref: Option<RecRef>,
}

struct RDone {
    sig: RequestSig,
    ttft_ns: Option<u64>,
    e2e_ns: Option<u64>,
    last: Option<Location>,
    ring: Vec<RecRef>,
    last_ref: Option<RecRef>,
}

/// A bounded memory of recently finished ids, so that a straggling fact about one (a duplicate
/// message, a late acknowledgement) is not taken for a new entry.
struct Recent<K: std::hash::Hash + Eq + Copy> {
    set: HashSet<K, IdBuild>,
    order: VecDeque<K>,
    cap: usize,
}

impl<K: std::hash::Hash + Eq + Copy> Recent<K> {
    fn new(cap: usize) -> Self {
        Recent { set: HashSet::default(), order: VecDeque::new(), cap }
    }
    fn insert(&mut self, k: K) {
        if self.set.insert(k) {
            self.order.push_back(k);
            if self.order.len() > self.cap {
                if let Some(old) = self.order.pop_front() {
                    self.set.remove(&old);
                }
            }
        }
    }
    fn contains(&self, k: &K) -> bool {
        self.set.contains(k)
    }
}

/// A fast hasher for the lookup-only maps of ids (never iterated into output): request ids
/// and UUIDs are already well spread, so a multiply-rotate mix is enough, and SipHash's cost
/// showed in profiles of 10-million-record diffs.
#[derive(Default, Clone, Copy)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(b));
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
}

type IdBuild = std::hash::BuildHasherDefault<IdHasher>;
type IdMap<K, V> = HashMap<K, V, IdBuild>;

/// How many recently finished ids each side remembers.
const RECENT_IDS: usize = 65_536;

/// One run folded in merge order.
struct EntitySide {
    reader: RunReader,
    workers: Vec<WorkerId>,
    /// Per compared worker (the union of both runs' workers): its sequence folds.
    tracks: Vec<Track>,
    /// Per stream of this run: its index in `tracks`.
    track_of: Vec<usize>,
    has_router: bool,
    ring_cap: usize,
    ledger: HandoffLedger,
    hopen: IdMap<HandoffId, HOpen>,
    ropen: IdMap<RequestId, ROpen>,
    hdone: Recent<HandoffId>,
    rdone: Recent<RequestId>,
    /// Finished here, not yet finished on the other side.
    awaiting_h: BTreeMap<HKey, HDone>,
    awaiting_r: BTreeMap<RequestId, RDone>,
    /// Finished in the last step (to be matched by the caller).
    fresh_h: Vec<(HKey, HDone)>,
    fresh_r: Vec<(RequestId, RDone)>,
    records: u64,
    ended: bool,
}

fn push_ring(ring: &mut VecDeque<RecRef>, cap: usize, r: RecRef) {
    if ring.len() == cap {
        ring.pop_front();
    }
    ring.push_back(r);
}

impl EntitySide {
    fn open(
        layout: &RunLayout,
        all_workers: &[WorkerId],
        ring_cap: usize,
        track_ring: usize,
    ) -> Result<Self, LogError> {
        // Diff compares what each run holds; a run missing a stream shows as differences.
        let reader = RunReader::from_layout(layout.clone())?.allow_missing_peers();
        let workers: Vec<WorkerId> = layout.workers();
        let has_router = workers.iter().any(|w| w.role == Role::Router);
        let tracks = all_workers.iter().map(|w| Track::new(layout, *w, track_ring)).collect();
        let track_of =
            workers.iter().map(|w| all_workers.iter().position(|x| x == w).unwrap_or(usize::MAX)).collect();
        Ok(EntitySide {
            reader,
            workers,
            tracks,
            track_of,
            has_router,
            ring_cap: ring_cap.max(1),
            ledger: HandoffLedger::new(),
            hopen: IdMap::default(),
            ropen: IdMap::default(),
            hdone: Recent::new(RECENT_IDS),
            rdone: Recent::new(RECENT_IDS),
            awaiting_h: BTreeMap::new(),
            awaiting_r: BTreeMap::new(),
            fresh_h: Vec::new(),
            fresh_r: Vec::new(),
            records: 0,
            ended: false,
        })
    }

    /// Reads and folds one record; returns the worker sequence element it made, if any, with
    /// the worker's index in `tracks`.
    fn step(&mut self) -> Result<Option<(usize, QElem)>, LogError> {
        let Some((i, rec)) = self.reader.next()? else {
            self.ended = true;
            self.finish_all();
            return Ok(None);
        };
        self.records += 1;
        let offset = self.reader.last_record_offset().unwrap_or_default();
        let worker = self.workers[i];
        let r = RecRef { stream: i, offset };
        let k = self.track_of[i];
        let elem = self.tracks.get_mut(k).and_then(|t| t.observe(&rec, offset)).map(|q| (k, q));
        let loc = Location::of(worker, &rec);
        let cap = self.ring_cap;
        // Requests.
        if let Some(req) = rec.fact.request() {
            if !self.rdone.contains(&req) {
                let e = self.ropen.entry(req).or_default();
                push_ring(&mut e.ring, cap, r);
                e.last = Some(loc.clone());
                e.last_ref = Some(r);
                match &rec.fact {
                    Fact::RequestArrived { .. } if worker.role == Role::Router || !self.has_router => {
                        e.arrival_ns.get_or_insert(rec.at_ns);
                    }
                    Fact::PrefillBooked { worker: w, .. } => e.prefill_workers.push(*w),
                    Fact::DecodeBooked { worker: w, .. } => e.decode_workers.push(*w),
                    Fact::FirstTokenEmitted { .. }
                        if matches!(worker.role, Role::Decode | Role::Aggregated) =>
                    {
                        e.first_token_ns.get_or_insert(rec.at_ns);
                    }
                    _ => {}
                }
            }
        }
        // Handoffs.
        if let Some(h) = rec.fact.handoff() {
            if !self.hdone.contains(&h) {
                self.ledger.apply(worker, &rec);
                let o = self.hopen.entry(h).or_default();
                push_ring(&mut o.ring, cap, r);
                o.last = Some(loc.clone());
                o.last_ref = Some(r);
                if let Fact::HandoffStarted { request, .. } = &rec.fact {
                    if o.request.is_none() {
                        o.request = Some(*request);
                    }
                }
                if o.attempt.is_none() {
                    if let Some(req) = o.request.or_else(|| rec.fact.request()) {
                        o.request = Some(req);
                        if let Some(re) = self.ropen.get_mut(&req) {
                            o.attempt = Some(re.attempts);
                            re.attempts += 1;
                            re.handoffs.push(h);
                        } else if self.rdone.contains(&req) {
                            // The request already ended: its handoff can finish on its own.
                            o.attempt = Some(u32::MAX);
                            o.request_finished = true;
                        }
                    }
                }
                if o.request_finished {
                    self.try_finish_handoff(h);
                }
            }
        }
        // A request's terminal fact.
        if let Fact::RequestFinished { request, status, output_tokens, .. } = &rec.fact {
            let terminal = worker.role == Role::Router || !self.has_router;
            if terminal && !self.rdone.contains(request) {
                if let Some(e) = self.ropen.remove(request) {
                    self.finish_request(*request, e, Some(*status), Some(*output_tokens), Some(rec.at_ns));
                }
            }
        }
        Ok(elem)
    }

    fn finish_request(
        &mut self,
        request: RequestId,
        e: ROpen,
        status: Option<TerminalStatus>,
        output_tokens: Option<u32>,
        end_ns: Option<u64>,
    ) {
        self.rdone.insert(request);
        let done = RDone {
            sig: RequestSig {
                status,
                output_tokens,
                prefill_workers: e.prefill_workers,
                decode_workers: e.decode_workers,
            },
            ttft_ns: match (e.arrival_ns, e.first_token_ns, status) {
                (Some(a), Some(f), Some(TerminalStatus::Completed)) => Some(f.saturating_sub(a)),
                _ => None,
            },
            e2e_ns: match (e.arrival_ns, end_ns, status) {
                (Some(a), Some(t), Some(TerminalStatus::Completed)) => Some(t.saturating_sub(a)),
                _ => None,
            },
            last: e.last,
            ring: e.ring.into_iter().collect(),
            last_ref: e.last_ref,
        };
        self.fresh_r.push((request, done));
        for h in e.handoffs {
            if let Some(o) = self.hopen.get_mut(&h) {
                o.request_finished = true;
            }
            self.try_finish_handoff(h);
        }
    }

    fn try_finish_handoff(&mut self, h: HandoffId) {
        let holds = match self.ledger.get(&h) {
            Some(e) => {
                let source_open = e.pinned_at_ns.is_some() && e.source_released_at_ns.is_none();
                let dest_open = e.reserved_at_ns.is_some()
                    && e.activated_at_ns.is_none()
                    && e.reservation_released_at_ns.is_none();
                source_open || dest_open
            }
            None => false,
        };
        if !holds {
            self.finish_handoff(h);
        }
    }

    fn finish_handoff(&mut self, h: HandoffId) {
        let Some(o) = self.hopen.remove(&h) else {
            return;
        };
        let Some(e) = self.ledger.remove(&h) else {
            return;
        };
        self.hdone.insert(h);
        let key = match (o.request, o.attempt) {
            (Some(r), Some(n)) => HKey::Request(r, n),
            _ => HKey::Id(h),
        };
        let pin_ns = match (e.pinned_at_ns, e.source_released_at_ns) {
            (Some(p), Some(r)) => Some(r.saturating_sub(p)),
            _ => None,
        };
        self.fresh_h.push((
            key,
            HDone {
                sig: HandoffSig::of(&e),
                pin_ns,
                last: o.last,
                ring: o.ring.into_iter().collect(),
                last_ref: o.last_ref,
            },
        ));
    }

    /// At the end of the log: everything still open finishes as it is.
    fn finish_all(&mut self) {
        let mut reqs: Vec<RequestId> = self.ropen.keys().copied().collect();
        reqs.sort();
        for r in reqs {
            if let Some(e) = self.ropen.remove(&r) {
                self.finish_request(r, e, None, None, None);
            }
        }
        let mut hs: Vec<HandoffId> = self.hopen.keys().copied().collect();
        hs.sort();
        for h in hs {
            self.finish_handoff(h);
        }
    }

    fn awaiting(&self) -> usize {
        self.awaiting_h.len() + self.awaiting_r.len()
    }
}

fn compare_all(
    la: &RunLayout,
    lb: &RunLayout,
    acc: &mut Acc,
    progress: &mut dyn FnMut(u64),
) -> Result<(), LogError> {
    let workers: Vec<WorkerId> = la
        .headers
        .iter()
        .chain(lb.headers.iter())
        .map(|h: &StreamHeader| h.worker)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    acc.compared.workers = workers.len();
    let c = acc.opts.context_records;
    let mut a = EntitySide::open(la, &workers, c * 2 + 1, c)?;
    let mut b = EntitySide::open(lb, &workers, c * 2 + 1, c)?;
    let mut cmps: Vec<Cmp> = workers
        .iter()
        .map(|w| Cmp {
            worker: *w,
            qa: VecDeque::new(),
            qb: VecDeque::new(),
            index: 0,
            state: CmpState::Live,
        })
        .collect();
    let mut queued = [0usize; 2];
    let limit = acc.opts.queue_limit;
    let mut read = 0u64;
    loop {
        if a.ended && b.ended {
            break;
        }
        // Step the side that is behind: the one with fewer entries and sequence elements
        // waiting for the other (then the one that read fewer records).
        let step_a = if a.ended {
            false
        } else if b.ended {
            true
        } else {
            (a.awaiting() + queued[0], a.records) <= (b.awaiting() + queued[1], b.records)
        };
        let elem = if step_a { a.step()? } else { b.step()? };
        if let Some((k, q)) = elem {
            if let Some(cmp) = cmps.get_mut(k) {
                offer(cmp, step_a, q, &a.tracks[k], &b.tracks[k], acc, &mut queued, c, limit);
            }
        }
        read += 1;
        if read % 262_144 == 0 {
            progress(read);
        }
        settle(&mut a, &mut b, true, acc);
        settle(&mut b, &mut a, false, acc);
    }
    acc.compared.records_a += a.records;
    acc.compared.records_b += b.records;
    for (k, cmp) in cmps.iter_mut().enumerate() {
        let (ta, tb) = (&a.tracks[k], &b.tracks[k]);
        match cmp.state {
            CmpState::Deferred => {
                compare_worker_lockstep(la, lb, cmp.worker, acc)?;
                continue;
            }
            CmpState::Live if !cmp.qa.is_empty() || !cmp.qb.is_empty() => {
                // One sequence is longer than the other.
                let cand = seq_divergence(cmp.worker, cmp.index, cmp.qa.front(), cmp.qb.front(), ta, tb, c);
                acc.add(cand);
            }
            _ => {}
        }
        count_elements(acc, cmp.worker, cmp.index);
        final_state(acc, cmp.worker, ta, tb);
    }
    // Whatever one side finished and the other never did.
    for (k, d) in std::mem::take(&mut a.awaiting_h) {
        report_handoff(acc, &k, Some(&d), None);
    }
    for (k, d) in std::mem::take(&mut b.awaiting_h) {
        report_handoff(acc, &k, None, Some(&d));
    }
    for (k, d) in std::mem::take(&mut a.awaiting_r) {
        report_request(acc, k, Some(&d), None);
    }
    for (k, d) in std::mem::take(&mut b.awaiting_r) {
        report_request(acc, k, None, Some(&d));
    }
    progress(read);
    Ok(())
}

/// Adds a sequence element from run A (`from_a`) or B and compares what both runs have.
#[allow(clippy::too_many_arguments)]
fn offer(
    cmp: &mut Cmp,
    from_a: bool,
    q: QElem,
    ta: &Track,
    tb: &Track,
    acc: &mut Acc,
    queued: &mut [usize; 2],
    c: usize,
    limit: usize,
) {
    if cmp.state != CmpState::Live {
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
        acc.add(seq_divergence(cmp.worker, cmp.index, Some(&x), Some(&y), ta, tb, c));
        cmp.state = CmpState::Diverged;
        break;
    }
    if cmp.state == CmpState::Live && (cmp.qa.len() > limit || cmp.qb.len() > limit) {
        cmp.state = CmpState::Deferred;
    }
    if cmp.state != CmpState::Live {
        queued[0] -= cmp.qa.len();
        queued[1] -= cmp.qb.len();
        cmp.qa = VecDeque::new();
        cmp.qb = VecDeque::new();
    }
}

/// Matches what `x` just finished against what `y` is waiting with.
fn settle(x: &mut EntitySide, y: &mut EntitySide, x_is_a: bool, acc: &mut Acc) {
    for (k, d) in std::mem::take(&mut x.fresh_h) {
        match y.awaiting_h.remove(&k) {
            Some(other) => {
                let (da, db) = if x_is_a { (&d, &other) } else { (&other, &d) };
                report_handoff(acc, &k, Some(da), Some(db));
            }
            None => {
                x.awaiting_h.insert(k, d);
            }
        }
    }
    for (k, d) in std::mem::take(&mut x.fresh_r) {
        match y.awaiting_r.remove(&k) {
            Some(other) => {
                let (da, db) = if x_is_a { (&d, &other) } else { (&other, &d) };
                report_request(acc, k, Some(da), Some(db));
            }
            None => {
                x.awaiting_r.insert(k, d);
            }
        }
    }
}

fn report_handoff(acc: &mut Acc, k: &HKey, a: Option<&HDone>, b: Option<&HDone>) {
    let subject = k.to_string();
    let detail = match (a, b) {
        (Some(a), Some(b)) => {
            acc.compared.handoffs += 1;
            acc.timing(&subject, "source pinned", a.pin_ns, b.pin_ns, &a.last, &b.last);
            if a.sig == b.sig {
                return;
            }
            a.sig.differences(&b.sig)
        }
        (Some(a), None) => format!("only in A: [{}]", Milestone::join(&a.sig.normalized, ", ")),
        (None, Some(b)) => format!("only in B: [{}]", Milestone::join(&b.sig.normalized, ", ")),
        (None, None) => return,
    };
    acc.add(Candidate {
        diff: Difference {
            kind: DiffKind::HandoffSequence,
            subject,
            a: a.and_then(|d| d.last.clone()),
            b: b.and_then(|d| d.last.clone()),
            detail,
        },
        ctx_a: Ctx::Refs(a.map(|d| d.ring.clone()).unwrap_or_default()),
        ctx_b: Ctx::Refs(b.map(|d| d.ring.clone()).unwrap_or_default()),
        div_a: a.and_then(|d| d.last_ref),
        div_b: b.and_then(|d| d.last_ref),
    });
}

fn report_request(acc: &mut Acc, k: RequestId, a: Option<&RDone>, b: Option<&RDone>) {
    let subject = format!("request {k}");
    let detail = match (a, b) {
        (Some(a), Some(b)) => {
            acc.compared.requests += 1;
            acc.timing(&subject, "TTFT", a.ttft_ns, b.ttft_ns, &a.last, &b.last);
            acc.timing(&subject, "E2E", a.e2e_ns, b.e2e_ns, &a.last, &b.last);
            if a.sig == b.sig {
                return;
            }
            a.sig.differences(&b.sig)
        }
        (Some(_), None) => "only in A".to_string(),
        (None, Some(_)) => "only in B".to_string(),
        (None, None) => return,
    };
    acc.add(Candidate {
        diff: Difference {
            kind: DiffKind::RequestOutcome,
            subject,
            a: a.and_then(|d| d.last.clone()),
            b: b.and_then(|d| d.last.clone()),
            detail,
        },
        ctx_a: Ctx::Refs(a.map(|d| d.ring.clone()).unwrap_or_default()),
        ctx_b: Ctx::Refs(b.map(|d| d.ring.clone()).unwrap_or_default()),
        div_a: a.and_then(|d| d.last_ref),
        div_b: b.and_then(|d| d.last_ref),
    });
}
