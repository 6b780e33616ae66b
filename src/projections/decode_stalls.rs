//! The decode-side findings of `inspect`: preemption storms and decode head-of-line blocking.
//! Their definitions are in the [`inspect`](crate::projections::inspect) module docs; this module
//! holds the per-worker fold that finds them, fed by
//! [`InspectFold`](crate::projections::inspect::InspectFold) with every fact of one decode (or
//! aggregated) worker and judged on its settled instants.
//!
//! Memory is bounded: the storm window keeps only the last `storm_preemptions` preemptions
//! (whether a window qualifies depends on nothing older), per-request state lives only while a
//! request is on the worker, and both lists keep at most
//! [`MAX_INTERVALS_PER_WORKER`] entries per worker (the rest are only counted).

use crate::events::Fact;
use crate::ids::{HandoffId, RequestId, WorkerId};
use crate::model::capacity::KvCapacitySnapshot;
use crate::projections::inspect::{pct, MAX_INTERVALS_PER_WORKER};
use crate::units::{ms, NS_PER_MS};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

// ------------------------------------------------------------------------------------------
// Report types
// ------------------------------------------------------------------------------------------

/// A burst of preemptions on one worker.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PreemptionStorm {
    pub worker: WorkerId,
    pub started_at_ms: f64,
    /// When the window's count fell below the threshold; `None` when the run ended inside.
    pub ended_at_ms: Option<f64>,
    pub duration_ms: f64,
    pub preemptions: u64,
    /// Distinct requests preempted.
    pub requests: u64,
    /// The request preempted most often (the lowest id among equals) and how many times.
    pub most_preempted_request: RequestId,
    pub most_preempted_times: u64,
    /// The longest preemption stall (`DecodeResumed`) that began with a preemption of this
    /// storm; `None` when none of them had resumed by the end of the log.
    pub longest_stall_ms: Option<f64>,
    pub longest_stall_request: Option<RequestId>,
    /// Settled `kv_used` share at the instant the storm started.
    pub kv_used_at_start_pct: f64,
}

/// One worker's storms in all (exact, also when the list is cut short).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StormWorker {
    pub worker: WorkerId,
    pub storms: u64,
    pub preemptions: u64,
    /// Distinct requests preempted in any of its storms.
    pub requests: u64,
    pub first_started_at_ms: f64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PreemptionStorms {
    /// Workers that had at least one storm, in canonical order.
    pub per_worker: Vec<StormWorker>,
    /// Every storm, by worker then time (at most [`MAX_INTERVALS_PER_WORKER`] each).
    pub storms: Vec<PreemptionStorm>,
    pub storms_not_shown: u64,
}

/// A stretch during which queued requests waited behind a head that could not be admitted
/// while the worker kept stepping.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HolInterval {
    pub worker: WorkerId,
    pub started_at_ms: f64,
    /// `None` when the run ended inside the stretch.
    pub ended_at_ms: Option<f64>,
    pub duration_ms: f64,
    /// Most requests waiting at any settled instant of the stretch.
    pub peak_waiting: u64,
    /// The request at the head of the waiting queue when the stretch started.
    pub head_request: Option<RequestId>,
    /// Free plus cached-free blocks when the stretch started.
    pub free_blocks_at_start: u64,
    /// Blocks the head gave back when it was last preempted: what it needs again to resume
    /// (chunked prefill may admit it a chunk at a time). Omitted when the head was never
    /// preempted here (its need is not in the log).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head_need_blocks: Option<u64>,
}

/// One worker's head-of-line blocking in all (exact, also when the list is cut short).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HolWorker {
    pub worker: WorkerId,
    pub intervals: u64,
    pub blocked_ms: f64,
    pub longest_ms: f64,
    pub first_started_at_ms: f64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DecodeHolBlocking {
    /// Workers that had at least one interval, in canonical order.
    pub per_worker: Vec<HolWorker>,
    /// Every interval, by worker then time (at most [`MAX_INTERVALS_PER_WORKER`] each).
    pub intervals: Vec<HolInterval>,
    pub intervals_not_shown: u64,
}

// ------------------------------------------------------------------------------------------
// Fold state
// ------------------------------------------------------------------------------------------

/// A waiting queue as both engines keep it: queued and activated requests join at the back,
/// preempted ones go back to the front (vLLM and SGLang alike), and any may leave from
/// anywhere (the vLLM core lets requests that hold KV bypass a blocked head).
#[derive(Clone, Debug, Default)]
struct AdmissionQueue {
    place_of: BTreeMap<RequestId, i64>,
    by_place: BTreeMap<i64, RequestId>,
    front: i64,
    back: i64,
}

impl AdmissionQueue {
    fn remove(&mut self, request: &RequestId) {
        if let Some(p) = self.place_of.remove(request) {
            self.by_place.remove(&p);
        }
    }
    fn push_back(&mut self, request: RequestId) {
        self.remove(&request);
        self.back += 1;
        self.place_of.insert(request, self.back);
        self.by_place.insert(self.back, request);
    }
    fn push_front(&mut self, request: RequestId) {
        self.remove(&request);
        self.front -= 1;
        self.place_of.insert(request, self.front);
        self.by_place.insert(self.front, request);
    }
    fn head(&self) -> Option<RequestId> {
        self.by_place.values().next().copied()
    }
}

/// One of the last `storm_preemptions` preemptions.
#[derive(Clone, Copy, Debug)]
struct RecentPreemption {
    at_ns: u64,
    request: RequestId,
    /// Its stall, if it resumed before any storm claimed it.
    stall_ns: Option<u64>,
    /// Whether a storm has counted it.
    counted: bool,
}

#[derive(Clone, Debug)]
struct OpenStorm {
    start_ns: u64,
    /// Its first and latest preemption: every preemption between them is the storm's.
    first_ns: u64,
    last_ns: u64,
    preemptions: u64,
    /// Preemptions per request still on the worker (a finished one can recur no more, so it
    /// is dropped once no uncounted preemption of it is left in the window).
    times: BTreeMap<RequestId, u64>,
    requests: u64,
    most: (u64, RequestId),
    longest_stall: Option<(u64, RequestId)>,
    kv_used_at_start_pct: f64,
    /// When the window's count last fell below the threshold, while the window still holds
    /// one of its preemptions (it may yet resume); `None` while it holds.
    ended_ns: Option<u64>,
}

impl OpenStorm {
    fn see_stall(&mut self, request: RequestId, stall_ns: u64) {
        see_longer(&mut self.longest_stall, request, stall_ns);
    }
}

fn uncount(uncounted: &mut BTreeMap<RequestId, u32>, request: RequestId) {
    if let Some(c) = uncounted.get_mut(&request) {
        *c -= 1;
        if *c == 0 {
            uncounted.remove(&request);
        }
    }
}

fn see_longer(slot: &mut Option<(u64, RequestId)>, request: RequestId, stall_ns: u64) {
    // Longest first, then the lowest id: the same log always names the same request.
    let better = match *slot {
        None => true,
        Some((d, r)) => stall_ns > d || (stall_ns == d && request < r),
    };
    if better {
        *slot = Some((stall_ns, request));
    }
}

#[derive(Clone, Debug)]
struct OpenHol {
    start_ns: u64,
    last_step_ns: u64,
    /// Longest time without a step so far (a worker that stops stepping is idle, not blocked).
    longest_gap_ns: u64,
    peak_waiting: u64,
    head: Option<RequestId>,
    free_at_start: u64,
    head_need: Option<u64>,
}

#[derive(Clone, Copy, Debug, Default)]
struct StormTotals {
    storms: u64,
    preemptions: u64,
    requests: u64,
    first_ns: Option<u64>,
}

#[derive(Clone, Copy, Debug, Default)]
struct HolTotals {
    intervals: u64,
    blocked_ns: u64,
    longest_ns: u64,
    first_ns: Option<u64>,
}

/// A storm that ended, kept until the report is built (a stall may still resume into it).
#[derive(Clone, Debug)]
struct ClosedStorm {
    storm: OpenStorm,
    end_ns: u64,
    ended: bool,
}

/// Preemption storms and head-of-line blocking on one decode (or aggregated) worker.
pub(crate) struct DecodeWatch {
    worker: WorkerId,
    storm_preemptions: usize,
    storm_window_ns: u64,
    /// `stall_ms`: how long a blocked stretch must last, and the step gap that makes it idle.
    stall_ns: u64,

    queue: AdmissionQueue,
    /// Blocks each waiting preempted request gave back.
    released_blocks: BTreeMap<RequestId, u64>,
    /// Reserved destinations' requests, to know who joins the queue at activation.
    reserved: BTreeMap<HandoffId, RequestId>,

    /// The last `storm_preemptions` preemptions: whether a window qualifies depends on no
    /// older one.
    recent: VecDeque<RecentPreemption>,
    /// Preemptions of the current instant, judged when it settles.
    preempted_now: Vec<RequestId>,
    /// When the preemption that began each request's current stall happened.
    stall_began: BTreeMap<RequestId, u64>,
    storm: Option<OpenStorm>,
    storms: Vec<ClosedStorm>,
    storms_dropped: u64,
    storm_totals: StormTotals,
    /// Requests on the worker already counted in `storm_totals.requests`.
    counted_requests: BTreeSet<RequestId>,
    /// Uncounted preemptions in `recent`, per request: a storm may still count them.
    uncounted: BTreeMap<RequestId, u32>,
    /// Finished requests whose counts are kept because `recent` still holds an uncounted
    /// preemption of theirs (forgetting them would count them again as new; at most
    /// `storm_preemptions` of them).
    finished_uncounted: Vec<RequestId>,

    last_scheduled_ns: Option<u64>,
    /// The settled instant the waiting queue last became non-empty.
    waiting_since_ns: Option<u64>,
    hol: Option<OpenHol>,
    hols: Vec<HolInterval>,
    hols_dropped: u64,
    hol_totals: HolTotals,
}

impl DecodeWatch {
    pub(crate) fn new(worker: WorkerId, storm_preemptions: u32, storm_window_ms: u64, stall_ms: u64) -> Self {
        DecodeWatch {
            worker,
            // A threshold of 0 would make every instant a storm; 1 is the least that means anything.
            storm_preemptions: storm_preemptions.max(1) as usize,
            storm_window_ns: storm_window_ms.saturating_mul(NS_PER_MS).max(1),
            stall_ns: stall_ms.saturating_mul(NS_PER_MS),
            queue: AdmissionQueue::default(),
            released_blocks: BTreeMap::new(),
            reserved: BTreeMap::new(),
            recent: VecDeque::new(),
            preempted_now: Vec::new(),
            stall_began: BTreeMap::new(),
            storm: None,
            storms: Vec::new(),
            storms_dropped: 0,
            storm_totals: StormTotals::default(),
            counted_requests: BTreeSet::new(),
            uncounted: BTreeMap::new(),
            finished_uncounted: Vec::new(),
            last_scheduled_ns: None,
            waiting_since_ns: None,
            hol: None,
            hols: Vec::new(),
            hols_dropped: 0,
            hol_totals: HolTotals::default(),
        }
    }

    /// One fact of this worker's stream, already accepted by the capacity and scheduler folds.
    pub(crate) fn apply(&mut self, at_ns: u64, fact: &Fact) {
        match fact {
            Fact::RequestQueued { request } => self.queue.push_back(*request),
            Fact::DestinationReserved { handoff, request, .. } => {
                self.reserved.insert(*handoff, *request);
            }
            Fact::ReservationReleased { handoff, .. } => {
                self.reserved.remove(handoff);
            }
            Fact::DestinationActivated { handoff, .. } => {
                if let Some(request) = self.reserved.remove(handoff) {
                    self.queue.push_back(request);
                }
            }
            Fact::RequestPreempted { request, kv } => {
                self.queue.push_front(*request);
                self.released_blocks.insert(*request, kv.active.min(0).unsigned_abs() as u64);
                self.preempted_now.push(*request);
                // A stall runs from the first preemption after a token to the next token.
                self.stall_began.entry(*request).or_insert(at_ns);
            }
            Fact::RequestScheduled { request, .. } => {
                self.queue.remove(request);
                self.released_blocks.remove(request);
                self.last_scheduled_ns = Some(at_ns);
            }
            Fact::RequestFinished { request, .. } | Fact::RequestRejected { request, .. } => {
                self.queue.remove(request);
                self.released_blocks.remove(request);
                self.stall_began.remove(request);
                if self.uncounted.contains_key(request) {
                    self.finished_uncounted.push(*request);
                } else {
                    self.forget_request(request);
                }
            }
            // Preempted before its first token: no stall to resume.
            Fact::FirstTokenEmitted { request } => {
                self.stall_began.remove(request);
            }
            Fact::DecodeResumed { request, stalled_ns } => {
                if let Some(began) = self.stall_began.remove(request) {
                    self.attribute_stall(began, *request, *stalled_ns);
                }
            }
            Fact::StepExecuted { .. } => {
                if let Some(h) = self.hol.as_mut() {
                    h.longest_gap_ns = h.longest_gap_ns.max(at_ns.saturating_sub(h.last_step_ns));
                    h.last_step_ns = at_ns;
                }
            }
            _ => {}
        }
    }

    /// Drops a finished request's storm counts (it can be preempted here no more).
    fn forget_request(&mut self, request: &RequestId) {
        self.counted_requests.remove(request);
        if let Some(s) = self.storm.as_mut() {
            s.times.remove(request);
        }
    }

    /// Gives a resumed stall to the storm whose preemption began it, if any.
    fn attribute_stall(&mut self, began_ns: u64, request: RequestId, stall_ns: u64) {
        if let Some(s) = self.storm.as_mut().filter(|s| s.first_ns <= began_ns && began_ns <= s.last_ns) {
            s.see_stall(request, stall_ns);
            return;
        }
        let mut ended = self.storms.iter_mut().map(|c| &mut c.storm);
        if let Some(s) = ended.find(|s| s.first_ns <= began_ns && began_ns <= s.last_ns) {
            s.see_stall(request, stall_ns);
            return;
        }
        // Not in a storm yet, but a storm starting within the window would claim it.
        if let Some(e) = self.recent.iter_mut().find(|e| e.at_ns == began_ns && e.request == request) {
            e.stall_ns = Some(e.stall_ns.map_or(stall_ns, |d| d.max(stall_ns)));
        }
    }

    /// The state after the last record at `t` holds until the next instant: judge it.
    pub(crate) fn settle(&mut self, t: u64, cap: &KvCapacitySnapshot, waiting: u64) {
        if !self.preempted_now.is_empty() {
            let pending = std::mem::take(&mut self.preempted_now);
            self.judge_storm(t, pending, cap);
        }
        self.judge_hol(t, cap, waiting);
    }

    fn judge_storm(&mut self, t: u64, pending: Vec<RequestId>, cap: &KvCapacitySnapshot) {
        let n = self.storm_preemptions;
        let w = self.storm_window_ns;
        let k = pending.len();
        // Before this instant the storm held until its window's oldest preemption aged out.
        let held_until = (self.recent.len() >= n).then(|| self.recent[0].at_ns.saturating_add(w));
        // At `t`, with this instant's preemptions: is the n-th most recent one inside the window?
        let holds_now = k >= n
            || (self.recent.len() >= n - k
                && self.recent[self.recent.len() - (n - k)].at_ns.saturating_add(w) > t);
        if let Some(s) = self.storm.as_mut().filter(|s| s.ended_ns.is_none()) {
            match held_until {
                Some(e) if e < t => s.ended_ns = Some(e),
                // It ends right now unless this instant's preemptions keep the window full.
                Some(e) if e == t && !holds_now => s.ended_ns = Some(t),
                _ => {}
            }
        }
        if holds_now {
            // A storm whose window still holds one of its preemptions resumes: the windows
            // overlap, so it is the same burst. Otherwise the old storm is over.
            let resumes = self.storm.as_ref().is_some_and(|s| s.last_ns.saturating_add(w) > t);
            if !resumes {
                self.finalize_storm(None);
            }
            // The window's earlier preemptions not yet counted are the storm's too (at most
            // n − 1: the window did not qualify just before `t`, so all are in `recent`).
            let mut seed = Vec::new();
            for e in self.recent.iter_mut().filter(|e| !e.counted && e.at_ns.saturating_add(w) > t) {
                e.counted = true;
                seed.push(*e);
                uncount(&mut self.uncounted, e.request);
            }
            match self.storm.as_mut() {
                Some(s) => s.ended_ns = None,
                None => {
                    self.storm = Some(OpenStorm {
                        start_ns: t,
                        first_ns: seed.first().map_or(t, |e| e.at_ns),
                        last_ns: t,
                        preemptions: 0,
                        times: BTreeMap::new(),
                        requests: 0,
                        most: (0, RequestId(0)),
                        longest_stall: None,
                        kv_used_at_start_pct: pct(cap.kv_used_blocks(), cap.total_blocks),
                        ended_ns: None,
                    });
                    self.storm_totals.storms += 1;
                    self.storm_totals.first_ns.get_or_insert(t);
                }
            }
            for e in seed {
                self.count_preemption(e.request, e.at_ns);
                if let (Some(d), Some(s)) = (e.stall_ns, self.storm.as_mut()) {
                    s.see_stall(e.request, d);
                }
            }
            for r in &pending {
                self.count_preemption(*r, t);
            }
        }
        for request in pending {
            self.recent.push_back(RecentPreemption { at_ns: t, request, stall_ns: None, counted: holds_now });
            if !holds_now {
                *self.uncounted.entry(request).or_insert(0) += 1;
            }
        }
        while self.recent.len() > n {
            if let Some(e) = self.recent.pop_front().filter(|e| !e.counted) {
                uncount(&mut self.uncounted, e.request);
            }
        }
        let mut finished = std::mem::take(&mut self.finished_uncounted);
        finished.retain(|r| {
            let keep = self.uncounted.contains_key(r);
            if !keep {
                self.forget_request(r);
            }
            keep
        });
        self.finished_uncounted = finished;
    }

    fn count_preemption(&mut self, request: RequestId, at_ns: u64) {
        let Some(s) = self.storm.as_mut() else {
            return;
        };
        s.preemptions += 1;
        s.last_ns = s.last_ns.max(at_ns);
        let times = s.times.entry(request).or_insert(0);
        *times += 1;
        if *times == 1 {
            s.requests += 1;
        }
        let times = *times;
        if times > s.most.0 || (times == s.most.0 && request < s.most.1) {
            s.most = (times, request);
        }
        self.storm_totals.preemptions += 1;
        if self.counted_requests.insert(request) {
            self.storm_totals.requests += 1;
        }
    }

    /// Moves the storm into the list: ended at its `ended_ns`, else at `run_end_ns` (the run
    /// ended inside it).
    fn finalize_storm(&mut self, run_end_ns: Option<u64>) {
        let Some(mut storm) = self.storm.take() else {
            return;
        };
        if self.storms.len() >= MAX_INTERVALS_PER_WORKER {
            self.storms_dropped += 1;
            return;
        }
        let (end_ns, ended) = match (storm.ended_ns, run_end_ns) {
            (Some(e), _) => (e, true),
            (None, end) => (end.unwrap_or(storm.last_ns), false),
        };
        // Its requests can recur in no other storm's counts; only its stalls may still come.
        storm.times.clear();
        self.storms.push(ClosedStorm { storm, end_ns, ended });
    }

    fn judge_hol(&mut self, t: u64, cap: &KvCapacitySnapshot, waiting: u64) {
        if waiting == 0 {
            self.waiting_since_ns = None;
            self.close_hol(t, Some(t));
            return;
        }
        let since = *self.waiting_since_ns.get_or_insert(t);
        let anchor = self.last_scheduled_ns.map_or(since, |s| s.max(since));
        // A request was scheduled: the head moved (or something got past it).
        if self.hol.as_ref().is_some_and(|h| h.start_ns != anchor) {
            self.close_hol(t, Some(t));
        }
        let h = self.hol.get_or_insert_with(|| {
            let head = self.queue.head();
            OpenHol {
                start_ns: anchor,
                last_step_ns: anchor,
                longest_gap_ns: 0,
                peak_waiting: waiting,
                head,
                free_at_start: cap.free_blocks + cap.cached_free_blocks,
                head_need: head.and_then(|r| self.released_blocks.get(&r).copied()),
            }
        });
        h.peak_waiting = h.peak_waiting.max(waiting);
    }

    fn close_hol(&mut self, end_ns: u64, ended: Option<u64>) {
        let Some(h) = self.hol.take() else {
            return;
        };
        let duration_ns = end_ns.saturating_sub(h.start_ns);
        let longest_gap_ns = h.longest_gap_ns.max(end_ns.saturating_sub(h.last_step_ns));
        if duration_ns < self.stall_ns || longest_gap_ns >= self.stall_ns {
            return;
        }
        let t = &mut self.hol_totals;
        t.intervals += 1;
        t.blocked_ns += duration_ns;
        t.longest_ns = t.longest_ns.max(duration_ns);
        t.first_ns.get_or_insert(h.start_ns);
        if self.hols.len() >= MAX_INTERVALS_PER_WORKER {
            self.hols_dropped += 1;
            return;
        }
        self.hols.push(HolInterval {
            worker: self.worker,
            started_at_ms: ms(h.start_ns),
            ended_at_ms: ended.map(ms),
            duration_ms: ms(duration_ns),
            peak_waiting: h.peak_waiting,
            head_request: h.head,
            free_blocks_at_start: h.free_at_start,
            head_need_blocks: h.head_need,
        });
    }

    /// Ends the watch at the run's last instant (already settled) and moves its findings into
    /// the report's lists.
    pub(crate) fn finish(&mut self, end_ns: u64, storms: &mut PreemptionStorms, hol: &mut DecodeHolBlocking) {
        let window_ns = self.storm_window_ns;
        let oldest_ns = self.recent.front().map(|e| e.at_ns);
        if let Some(s) = self.storm.as_mut().filter(|s| s.ended_ns.is_none()) {
            // It ends when its window's oldest preemption ages out, if that is inside the run.
            let until = oldest_ns.map_or(end_ns, |at| at.saturating_add(window_ns));
            if until <= end_ns {
                s.ended_ns = Some(until);
            }
        }
        self.finalize_storm(Some(end_ns));
        self.close_hol(end_ns, None);
        let st = self.storm_totals;
        if st.storms > 0 {
            storms.per_worker.push(StormWorker {
                worker: self.worker,
                storms: st.storms,
                preemptions: st.preemptions,
                requests: st.requests,
                first_started_at_ms: st.first_ns.map_or(0.0, ms),
            });
        }
        for c in self.storms.drain(..) {
            let s = c.storm;
            storms.storms.push(PreemptionStorm {
                worker: self.worker,
                started_at_ms: ms(s.start_ns),
                ended_at_ms: c.ended.then(|| ms(c.end_ns)),
                duration_ms: ms(c.end_ns.saturating_sub(s.start_ns)),
                preemptions: s.preemptions,
                requests: s.requests,
                most_preempted_request: s.most.1,
                most_preempted_times: s.most.0,
                longest_stall_ms: s.longest_stall.map(|(d, _)| ms(d)),
                longest_stall_request: s.longest_stall.map(|(_, r)| r),
                kv_used_at_start_pct: s.kv_used_at_start_pct,
            });
        }
        storms.storms_not_shown += self.storms_dropped;
        let ht = self.hol_totals;
        if ht.intervals > 0 {
            hol.per_worker.push(HolWorker {
                worker: self.worker,
                intervals: ht.intervals,
                blocked_ms: ms(ht.blocked_ns),
                longest_ms: ms(ht.longest_ns),
                first_started_at_ms: ht.first_ns.map_or(0.0, ms),
            });
        }
        hol.intervals.append(&mut self.hols);
        hol.intervals_not_shown += self.hols_dropped;
    }
}
