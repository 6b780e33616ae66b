//! Parity: are two runs (live and replay, two replays, two backends) equivalent?
//!
//! ## What "equivalent" means
//! Two runs are **equivalent** when every projection below is equal. Wall-clock time is not
//! compared, except as the timing figures at the end, which are reported and only fail the
//! comparison when asked (`strict_timing`).
//!
//! 1. **capacity-sequence** — per engine worker (matched by [`WorkerId`]), the sequence of
//!    [`KvCapacitySnapshot`](crate::projections::KvCapacitySnapshot) values after each fact that
//!    moves KV (a non-zero [`KvDelta`](crate::events::KvDelta)), ignoring when it happened. A
//!    delta the snapshot refuses (overdraw, broken conservation) is an element of its own, so it
//!    cannot hide.
//! 2. **booking-sequence** — the router stream's booking facts (`PrefillBooked`,
//!    `PrefillComputeDone`, `PrefillBookingFreed`, `DecodeBooked`, `DecodeBookingFreed`), fact
//!    by fact with all their fields, ignoring time.
//! 3. **handoff-sequence** — per handoff, its normalized milestone sequence
//!    ([`HandoffEntry::normalized`](crate::projections::handoffs::HandoffEntry::normalized)),
//!    outcome, source and destination workers, pinned blocks, reserved pages and prefix, and how
//!    each side ended. Handoffs are matched by their request
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
//!
//! ## Code
//! `sequences` compares each worker's capacity / booking sequence (its per-stream fold is
//! `Track`) and final state; `entities` folds handoffs and requests in merge order and
//! compares their signatures; `context` remembers
//! record offsets and re-reads them around the first divergence; `findings` collects the
//! differences; `report` holds the serialized types.

mod context;
mod entities;
mod findings;
mod id_maps;
mod report;
mod sequences;

pub use report::{
    Compared, ContextRecord, DiffKind, DiffReport, Difference, Divergence, Location, TimingSummary,
};
pub use sequences::fact_text;

use crate::events::RunLayout;
use crate::events::{LogError, StreamHeader};
use crate::ids::WorkerId;
use context::resolve;
use entities::{match_finished, report_handoff, report_request, EntitySide};
use findings::Findings;
use sequences::{compare_worker_lockstep, count_elements, final_state, offer, seq_divergence};
use sequences::{ComparisonState, WorkerComparison};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::Path;

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

/// The default of [`DiffOptions::queue_limit`].
pub const QUEUE_LIMIT: usize = 1 << 16;

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
    let relaxed = relaxed_kinds(&la, &lb);
    let mut findings = Findings {
        relaxed: relaxed.keys().copied().collect(),
        opts: opts.clone(),
        counts: DiffKind::ALL.iter().map(|k| (*k, 0)).collect(),
        examples: Vec::new(),
        first: None,
        timing: TimingSummary { tolerance_pct: opts.timing_tolerance_pct, ..Default::default() },
        compared: Compared::default(),
    };
    compare_all(&la, &lb, &mut findings, progress)?;
    let first = match findings.first.take() {
        Some(c) => Some(Divergence {
            context_a: resolve(&la, &c.ctx_a, c.div_a)?,
            context_b: resolve(&lb, &c.ctx_b, c.div_b)?,
            difference: c.diff,
        }),
        None => None,
    };
    // Listed by kind, then by when each became visible.
    findings.examples.sort_by_key(|d| (d.kind, d.at_ns()));
    let failing: u64 = findings
        .counts
        .iter()
        .filter(|(k, _)| **k != DiffKind::Timing || opts.strict_timing)
        .filter(|(k, _)| !relaxed.contains_key(k))
        .map(|(_, n)| *n)
        .sum();
    Ok(DiffReport {
        a: a.to_path_buf(),
        b: b.to_path_buf(),
        equivalent: failing == 0,
        counts: findings.counts,
        first,
        examples: findings.examples,
        compared: findings.compared,
        timing: findings.timing,
        strict_timing: opts.strict_timing,
        relaxed,
    })
}

/// What a comparison of a wall-clock run with a virtual one does not hold against them.
///
/// A live run's processes hand each other messages over TCP: an input that reaches a busy
/// worker a little later than its instant waits for the next step boundary there, and the
/// reports of nearby instants reach the router in another order. So the order in which one
/// worker's KV moves interleave (its capacity sequence) and the router's booking facts of
/// different requests interleave may differ from the replay's. What must not differ still
/// fails: every request's outcome and placement, every handoff's per-role milestones, KV moves
/// and ends, every request's bookings (each taken and freed exactly once), and every worker's
/// final state.
fn relaxed_kinds(a: &RunLayout, b: &RunLayout) -> BTreeMap<DiffKind, String> {
    let clock = |l: &RunLayout| l.headers.first().map(|h| h.clock.is_wall());
    let mut out = BTreeMap::new();
    if clock(a) != clock(b) {
        out.insert(
            DiffKind::CapacitySequence,
            "a wall-clock run interleaves one worker's KV moves of nearby instants as its inputs arrived (and a pin's blocks shared with another request's prefix return with whichever holder ends last); each handoff's milestones, blocks pinned and pages reserved are compared per role instead (handoff-sequence), and every worker must end drained (final-state)".to_string(),
        );
        out.insert(
            DiffKind::BookingSequence,
            "the router hears of nearby instants in network order; each request's bookings are compared instead (request-outcome)".to_string(),
        );
    }
    out
}

fn compare_all(
    la: &RunLayout,
    lb: &RunLayout,
    findings: &mut Findings,
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
    findings.compared.workers = workers.len();
    let c = findings.opts.context_records;
    let mut a = EntitySide::open(la, &workers, c * 2 + 1, c)?;
    let mut b = EntitySide::open(lb, &workers, c * 2 + 1, c)?;
    let wall = |l: &RunLayout| l.headers.first().map(|h| h.clock.is_wall());
    let same_clock = wall(la) == wall(lb);
    a.compare_kv_moves = same_clock;
    b.compare_kv_moves = same_clock;
    let mut cmps: Vec<WorkerComparison> = workers
        .iter()
        .map(|w| WorkerComparison {
            worker: *w,
            qa: VecDeque::new(),
            qb: VecDeque::new(),
            index: 0,
            state: ComparisonState::Live,
        })
        .collect();
    let mut queued = [0usize; 2];
    let limit = findings.opts.queue_limit;
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
                offer(cmp, step_a, q, &a.tracks[k], &b.tracks[k], findings, &mut queued, c, limit);
            }
        }
        read += 1;
        if read % 262_144 == 0 {
            progress(read);
        }
        match_finished(&mut a, &mut b, true, findings);
        match_finished(&mut b, &mut a, false, findings);
    }
    findings.compared.records_a += a.records;
    findings.compared.records_b += b.records;
    for (k, cmp) in cmps.iter_mut().enumerate() {
        let (ta, tb) = (&a.tracks[k], &b.tracks[k]);
        match cmp.state {
            ComparisonState::Deferred => {
                compare_worker_lockstep(la, lb, cmp.worker, findings)?;
                continue;
            }
            ComparisonState::Live if !cmp.qa.is_empty() || !cmp.qb.is_empty() => {
                // One sequence is longer than the other.
                let cand = seq_divergence(cmp.worker, cmp.index, cmp.qa.front(), cmp.qb.front(), ta, tb, c);
                findings.add(cand);
            }
            _ => {}
        }
        count_elements(findings, cmp.worker, cmp.index);
        final_state(findings, cmp.worker, ta, tb);
    }
    // Whatever one side finished and the other never did.
    for (k, d) in std::mem::take(&mut a.awaiting_handoffs) {
        report_handoff(findings, &k, Some(&d), None);
    }
    for (k, d) in std::mem::take(&mut b.awaiting_handoffs) {
        report_handoff(findings, &k, None, Some(&d));
    }
    for (k, d) in std::mem::take(&mut a.awaiting_requests) {
        report_request(findings, k, Some(&d), None);
    }
    for (k, d) in std::mem::take(&mut b.awaiting_requests) {
        report_request(findings, k, None, Some(&d));
    }
    progress(read);
    Ok(())
}
