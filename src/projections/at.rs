//! Time travel: every worker's capacity snapshot, scheduler queues and router bookings at an
//! instant `T`, i.e. after applying every record with `at_ns <= T` (in stream order).
//!
//! All three folds are per stream: a worker's capacity and queues depend only on its own stream,
//! and the router's bookings only on the router stream. So each file of a run can be read on its
//! own, and with an index ([`crate::events::index`]) each starts from the latest checkpoint
//! taken at or before `T` instead of from its first record. When a stream's `at_ns` never
//! decreases, reading stops at the first record after `T`; otherwise it reads to the end of the
//! file and skips the later records.

use crate::events::index::{CheckpointFold, IndexError, RunIndex};
use crate::events::{Fact, Record, StreamHeader, TerminalStatus};
use crate::events::{RunLayout, SegmentReader};
use crate::ids::{RequestId, Role, WorkerId};
use crate::projections::capacity::KvCapacitySnapshot;
use crate::projections::scheduler::SchedulerFold;
use crate::schedulers::SchedulerView;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// The router's bookings for one worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerBookings {
    /// Prompt tokens booked for prefill compute that has not finished.
    pub active_prefill_tokens: u64,
    /// Blocks booked by prefills whose booking has not been freed (compute done or not).
    pub booked_prefill_blocks: u64,
    /// Blocks booked by decodes whose booking has not been freed.
    pub booked_decode_blocks: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct PrefillBooking {
    worker: WorkerId,
    tokens: u64,
    blocks: u64,
    compute_done: bool,
}

/// The router booking fold over the router stream (`PrefillBooked`, `PrefillComputeDone`,
/// `PrefillBookingFreed`, `DecodeBooked`, `DecodeBookingFreed`). Memory grows with bookings
/// in flight, not with the log.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouterBookings {
    per_worker: BTreeMap<WorkerId, WorkerBookings>,
    prefill: BTreeMap<RequestId, PrefillBooking>,
    decode: BTreeMap<RequestId, (WorkerId, u64)>,
}

impl RouterBookings {
    pub fn new() -> Self {
        Self::default()
    }

    /// Per worker, every worker ever booked (zeros included once its bookings ended).
    pub fn per_worker(&self) -> &BTreeMap<WorkerId, WorkerBookings> {
        &self.per_worker
    }

    /// Bookings not yet freed: (prefill, decode).
    pub fn open_bookings(&self) -> (usize, usize) {
        (self.prefill.len(), self.decode.len())
    }

    /// Nothing booked anywhere.
    pub fn is_drained(&self) -> bool {
        self.prefill.is_empty() && self.decode.is_empty()
    }

    /// Applies one fact; other facts are ignored. A free of an unknown booking is an error
    /// (the router stream contradicts itself) and changes nothing.
    pub fn apply(&mut self, fact: &Fact) -> Result<(), String> {
        match fact {
            Fact::PrefillBooked { request, worker, prefill_tokens, blocks } => {
                if self.prefill.contains_key(request) {
                    return Err(format!("{request} prefill booked twice"));
                }
                let b = PrefillBooking {
                    worker: *worker,
                    tokens: *prefill_tokens as u64,
                    blocks: *blocks as u64,
                    compute_done: false,
                };
                let w = self.per_worker.entry(*worker).or_default();
                w.active_prefill_tokens += b.tokens;
                w.booked_prefill_blocks += b.blocks;
                self.prefill.insert(*request, b);
            }
            Fact::PrefillComputeDone { request, .. } => match self.prefill.get_mut(request) {
                Some(b) if !b.compute_done => {
                    b.compute_done = true;
                    let w = self.per_worker.entry(b.worker).or_default();
                    w.active_prefill_tokens = w.active_prefill_tokens.saturating_sub(b.tokens);
                }
                Some(_) => return Err(format!("{request} prefill compute done twice")),
                None => return Err(format!("{request} prefill compute done but not booked")),
            },
            Fact::PrefillBookingFreed { request, .. } => match self.prefill.remove(request) {
                Some(b) => {
                    let w = self.per_worker.entry(b.worker).or_default();
                    if !b.compute_done {
                        w.active_prefill_tokens = w.active_prefill_tokens.saturating_sub(b.tokens);
                    }
                    w.booked_prefill_blocks = w.booked_prefill_blocks.saturating_sub(b.blocks);
                }
                None => return Err(format!("{request} prefill booking freed but not booked")),
            },
            Fact::DecodeBooked { request, worker, blocks } => {
                if self.decode.contains_key(request) {
                    return Err(format!("{request} decode booked twice"));
                }
                self.per_worker.entry(*worker).or_default().booked_decode_blocks += *blocks as u64;
                self.decode.insert(*request, (*worker, *blocks as u64));
            }
            Fact::DecodeBookingFreed { request, .. } => match self.decode.remove(request) {
                Some((worker, blocks)) => {
                    let w = self.per_worker.entry(worker).or_default();
                    w.booked_decode_blocks = w.booked_decode_blocks.saturating_sub(blocks);
                }
                None => return Err(format!("{request} decode booking freed but not booked")),
            },
            _ => {}
        }
        Ok(())
    }
}

/// Whether a fact is one of the router's booking facts (the router booking sequence).
pub fn is_booking_fact(fact: &Fact) -> bool {
    matches!(
        fact,
        Fact::PrefillBooked { .. }
            | Fact::PrefillComputeDone { .. }
            | Fact::PrefillBookingFreed { .. }
            | Fact::DecodeBooked { .. }
            | Fact::DecodeBookingFreed { .. }
    )
}

/// A `DecodeBookingFreed` status, for `is_booking_fact` users that print it.
pub fn booking_status(fact: &Fact) -> Option<TerminalStatus> {
    match fact {
        Fact::DecodeBookingFreed { status, .. } => Some(*status),
        _ => None,
    }
}

/// Everything `at` folds for one stream. Serializable: the index stores it in checkpoints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StreamFold {
    pub worker: WorkerId,
    /// Engine streams: physical KV. (Router: stays empty.)
    pub capacity: KvCapacitySnapshot,
    /// Engine streams: the scheduler's queues.
    pub scheduler: SchedulerFold,
    /// Router stream: bookings.
    pub bookings: RouterBookings,
    /// Records applied.
    pub records: u64,
    pub last_at_ns: Option<u64>,
    /// The first contradiction found (the record is skipped by the fold that refused it).
    pub violation: Option<String>,
}

impl CheckpointFold for StreamFold {
    const NAME: &'static str = "at.stream.v1";
    fn start(header: &StreamHeader) -> Self {
        StreamFold::new(header)
    }
    fn apply(&mut self, record: &Record) {
        StreamFold::apply(self, record)
    }
}

impl StreamFold {
    pub fn new(header: &StreamHeader) -> Self {
        StreamFold {
            worker: header.worker,
            capacity: KvCapacitySnapshot::empty(header.engine.total_blocks as u64),
            scheduler: SchedulerFold::new(),
            bookings: RouterBookings::new(),
            records: 0,
            last_at_ns: None,
            violation: None,
        }
    }

    pub fn apply(&mut self, rec: &Record) {
        self.records += 1;
        self.last_at_ns = Some(rec.at_ns);
        let mut note = |msg: String| {
            if self.violation.is_none() {
                self.violation = Some(format!(
                    "{} seq {} (t={:.3} ms): {msg}",
                    self.worker,
                    rec.seq,
                    rec.at_ns as f64 / 1e6
                ));
            }
        };
        if self.worker.role == Role::Router {
            if let Err(e) = self.bookings.apply(&rec.fact) {
                note(e);
            }
        } else {
            if let Err(e) = self.capacity.apply_fact(&rec.fact) {
                note(e.to_string());
            }
            if let Err(e) = self.scheduler.apply(&rec.fact) {
                note(e.to_string());
            }
        }
    }
}

/// A capacity snapshot with the proposal's names, `kv_used_blocks` included.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct CapacityView {
    pub active_blocks: u64,
    pub pinned_source_blocks: u64,
    pub reserved_destination_blocks: u64,
    pub kv_used_blocks: u64,
    pub cached_free_blocks: u64,
    pub free_blocks: u64,
    pub total_blocks: u64,
    pub request_slots_used: u64,
    pub decode_headroom_tokens: u64,
}

impl From<&KvCapacitySnapshot> for CapacityView {
    fn from(s: &KvCapacitySnapshot) -> Self {
        CapacityView {
            active_blocks: s.active_blocks,
            pinned_source_blocks: s.pinned_source_blocks,
            reserved_destination_blocks: s.reserved_destination_blocks,
            kv_used_blocks: s.kv_used_blocks(),
            cached_free_blocks: s.cached_free_blocks,
            free_blocks: s.free_blocks,
            total_blocks: s.total_blocks,
            request_slots_used: s.request_slots_used,
            decode_headroom_tokens: s.decode_headroom_tokens,
        }
    }
}

impl CapacityView {
    /// The block and slot figures and the queues, in one fixed order (for tables and CSV rows:
    /// `at` and `project series` print the same columns).
    pub fn with_queues(&self, q: &crate::schedulers::SchedulerView) -> [u64; 14] {
        [
            self.active_blocks,
            self.pinned_source_blocks,
            self.reserved_destination_blocks,
            self.kv_used_blocks,
            self.cached_free_blocks,
            self.free_blocks,
            self.total_blocks,
            self.request_slots_used,
            self.decode_headroom_tokens,
            q.waiting,
            q.running,
            q.waiting_for_remote_kv,
            q.held_prefills,
            q.pending_reservations,
        ]
    }
}

/// One worker at the instant.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerAt {
    pub worker: WorkerId,
    /// Engine workers only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity: Option<CapacityView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queues: Option<SchedulerView>,
    /// The router's bookings for this worker (engine workers; zeros when never booked).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bookings: Option<WorkerBookings>,
    /// Router only: bookings not yet freed (prefill, decode).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub open_bookings: Option<(usize, usize)>,
    /// Records of this worker's stream at or before the instant.
    pub records_applied: u64,
    pub last_at_ns: Option<u64>,
}

/// The whole run at the instant.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AtReport {
    pub time_ns: u64,
    pub time_ms: f64,
    pub workers: Vec<WorkerAt>,
    pub records_applied: u64,
    /// Contradictions met on the way (the run's facts disagree with each other).
    pub violations: Vec<String>,
}

impl AtReport {
    /// Builds the report from one fold per stream (in canonical worker order).
    pub fn from_folds(t_ns: u64, folds: &[StreamFold]) -> Self {
        let router = folds.iter().find(|f| f.worker.role == Role::Router);
        let workers = folds
            .iter()
            .map(|f| {
                let engine = f.worker.role != Role::Router;
                WorkerAt {
                    worker: f.worker,
                    capacity: engine.then(|| CapacityView::from(&f.capacity)),
                    queues: engine.then(|| f.scheduler.view()),
                    bookings: engine.then(|| {
                        router
                            .and_then(|r| r.bookings.per_worker().get(&f.worker).copied())
                            .unwrap_or_default()
                    }),
                    open_bookings: (!engine).then(|| f.bookings.open_bookings()),
                    records_applied: f.records,
                    last_at_ns: f.last_at_ns,
                }
            })
            .collect();
        AtReport {
            time_ns: t_ns,
            time_ms: t_ns as f64 / 1e6,
            workers,
            records_applied: folds.iter().map(|f| f.records).sum(),
            violations: folds.iter().filter_map(|f| f.violation.clone()).collect(),
        }
    }
}

/// Parses an instant: milliseconds by default (`12.5`), or with a unit suffix `ns`, `us`,
/// `ms`, `s` (`12.5s`, `300us`). Returns nanoseconds.
pub fn parse_time(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let (num, scale) = if let Some(n) = t.strip_suffix("ns") {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix("us").or_else(|| t.strip_suffix("µs")) {
        (n, 1e3)
    } else if let Some(n) = t.strip_suffix("ms") {
        (n, 1e6)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1e9)
    } else {
        (t, 1e6)
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("time `{text}`: expected a number of ms, or e.g. 12.5s, 300us"))?;
    if !v.is_finite() || v < 0.0 {
        return Err(format!("time `{text}`: must be a finite, non-negative instant"));
    }
    let ns = (v * scale).round();
    if ns > u64::MAX as f64 {
        return Err(format!("time `{text}`: too large"));
    }
    Ok(ns as u64)
}

/// The run's state at `t_ns`. With `index`, each file is read from its latest checkpoint at or
/// before `t_ns`; without, from its first record. `progress` is told how many records were read.
pub fn state_at(
    run: &Path,
    t_ns: u64,
    index: Option<&RunIndex>,
    progress: &mut dyn FnMut(u64),
) -> Result<AtReport, IndexError> {
    let layout = RunLayout::open(run)?;
    let monotone = match index {
        // The index was verified against the run when it was opened, so its segments are the
        // layout's and its monotone flags describe these files.
        Some(idx) => idx.meta().monotone.clone(),
        None => vec![false; layout.headers.len()],
    };
    let RunLayout { headers, segments, .. } = layout;
    let n = headers.len();
    let mut folds: Vec<Option<StreamFold>> = vec![None; n];
    let mut read = 0u64;
    for (si, seg) in segments.iter().enumerate() {
        let cp = match index {
            Some(idx) => idx.checkpoint_before::<StreamFold>(si, t_ns)?,
            None => None,
        };
        let (offset, next_seq, mut states) = match cp {
            Some(cp) => (cp.offset, cp.next_seq, cp.states),
            None => (
                seg.data_start,
                vec![0; n],
                seg.streams.iter().map(|&s| StreamFold::new(&headers[s])).collect(),
            ),
        };
        let mut slot = vec![usize::MAX; n];
        for (k, &s) in seg.streams.iter().enumerate() {
            slot[s] = k;
        }
        // Early stop is only sound when every stream in the file is time-ordered.
        let ordered = seg.streams.iter().all(|&s| monotone.get(s) == Some(&true));
        let mut reader = SegmentReader::open_at(seg, offset, next_seq)?;
        while let Some((stream, rec)) = reader.next_record()? {
            read += 1;
            if read % 65_536 == 0 {
                progress(read);
            }
            if rec.at_ns > t_ns {
                if ordered {
                    break;
                }
                continue;
            }
            if let Some(st) = states.get_mut(slot[stream]) {
                st.apply(&rec);
            }
        }
        for (k, st) in states.into_iter().enumerate() {
            if let Some(&s) = seg.streams.get(k) {
                folds[s] = Some(st);
            }
        }
    }
    progress(read);
    let folds: Vec<StreamFold> = folds
        .into_iter()
        .enumerate()
        .map(|(i, f)| f.unwrap_or_else(|| StreamFold::new(&headers[i])))
        .collect();
    Ok(AtReport::from_folds(t_ns, &folds))
}
