//! Time travel: every worker's capacity snapshot, scheduler queues and router bookings at an
//! instant `T`, i.e. after applying every record with `at_ns <= T` (in stream order).
//!
//! All three folds are per stream: a worker's capacity and queues depend only on its own stream,
//! and the router's bookings only on the router stream. So each file of a run can be read on its
//! own, and with an index ([`crate::events::index`]) each starts from the latest checkpoint
//! taken at or before `T` instead of from its first record. When a stream's `at_ns` never
//! decreases, reading stops at the first record after `T`; otherwise it reads to the end of the
//! file and skips the later records.

use crate::events::index::{IndexError, RunIndex};
use crate::events::{RunLayout, SegmentReader};
use crate::ids::{Role, WorkerId};
use crate::model::capacity::KvCapacitySnapshot;
use crate::model::view::SchedulerView;
use crate::projections::worker::WorkerFold;
use crate::router::WorkerLoad;
use crate::units::ms;
use serde::{Deserialize, Serialize};
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

impl From<WorkerLoad> for WorkerBookings {
    fn from(l: WorkerLoad) -> Self {
        WorkerBookings {
            active_prefill_tokens: l.active_prefill_tokens,
            booked_prefill_blocks: l.prefill_blocks,
            booked_decode_blocks: l.decode_blocks,
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
    pub fn with_queues(&self, q: &crate::model::view::SchedulerView) -> [u64; 14] {
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
    pub fn from_folds(t_ns: u64, folds: &[WorkerFold]) -> Self {
        let router = folds.iter().find(|f| f.worker.role == Role::Router);
        let workers = folds
            .iter()
            .map(|f| {
                let engine = f.worker.role != Role::Router;
                WorkerAt {
                    worker: f.worker,
                    capacity: engine.then(|| CapacityView::from(&f.capacity)),
                    queues: engine.then(|| f.scheduler.view()),
                    bookings: engine
                        .then(|| router.map(|r| r.bookings.load(f.worker)).unwrap_or_default().into()),
                    open_bookings: (!engine).then(|| f.bookings.in_flight()),
                    records_applied: f.records,
                    last_at_ns: f.last_at_ns,
                }
            })
            .collect();
        AtReport {
            time_ns: t_ns,
            time_ms: ms(t_ns),
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
    let mut folds: Vec<Option<WorkerFold>> = vec![None; n];
    let mut read = 0u64;
    for (si, seg) in segments.iter().enumerate() {
        let cp = match index {
            Some(idx) => idx.checkpoint_before::<WorkerFold>(si, t_ns)?,
            None => None,
        };
        let (offset, next_seq, mut states) = match cp {
            Some(cp) => (cp.offset, cp.next_seq, cp.states),
            None => (
                seg.start_position(),
                vec![0; n],
                seg.streams.iter().map(|&s| WorkerFold::new(&headers[s])).collect(),
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
                // A contradiction is reported through the fold's `violation`.
                let _ = st.apply(&rec);
            }
        }
        for (k, st) in states.into_iter().enumerate() {
            if let Some(&s) = seg.streams.get(k) {
                folds[s] = Some(st);
            }
        }
    }
    progress(read);
    let folds: Vec<WorkerFold> = folds
        .into_iter()
        .enumerate()
        .map(|(i, f)| f.unwrap_or_else(|| WorkerFold::new(&headers[i])))
        .collect();
    Ok(AtReport::from_folds(t_ns, &folds))
}
