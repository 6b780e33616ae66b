//! Where handoff time went: per-handoff milestones, kept only while a handoff is unfinished,
//! folded into phase totals and distributions, outcomes, destination-gating waits and the
//! `top_n` longest pins when it finishes.

use super::longest_pinned::TopPin;
use super::report::{Gating, GatingWorker, Outcomes, Phase, WaitBreakdown};
use crate::events::Fact;
use crate::ids::{CancelReason, EndReason, HandoffId, HandoffPolicy, Role, WorkerId};
use crate::projections::distribution::Distribution;
use crate::units::{ms, NS_PER_MS_F64};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};

/// Finished handoffs remembered so that stray late facts (a message arriving after both roles
/// ended) do not reopen them. Bounded; older ids are forgotten.
const FINISHED_MEMORY: usize = 1 << 16;

/// Per-handoff milestones, kept only while the handoff is unfinished.
#[derive(Clone, Debug, Default)]
struct HandoffMarks {
    first_ns: u64,
    /// The latest fact applied to it.
    last_ns: u64,
    policy: Option<HandoffPolicy>,
    source: Option<WorkerId>,
    destination: Option<WorkerId>,
    dispatched_ns: Option<u64>,
    pinned_ns: Option<u64>,
    queued_ns: Option<u64>,
    reserved_ns: Option<u64>,
    recv_started_ns: Option<u64>,
    recv_completed_ns: Option<u64>,
    activated_ns: Option<u64>,
    released_ns: Option<u64>,
    reservation_ended_ns: Option<u64>,
    source_end: Option<EndReason>,
    lease_expired: bool,
    reservation_expired: bool,
    canceled: Option<CancelReason>,
    src_started: bool,
    src_done: bool,
    dst_started: bool,
    dst_done: bool,
    gated: bool,
}

/// Bounded-memory distribution plus an exact total, per phase.
#[derive(Default)]
struct PhaseTotals {
    dist: Distribution,
    total_ns: u128,
}

impl PhaseTotals {
    fn add(&mut self, from: Option<u64>, to: Option<u64>) {
        if let (Some(a), Some(b)) = (from, to) {
            if b >= a {
                self.dist.add(b - a);
                self.total_ns += (b - a) as u128;
            }
        }
    }
}

const PHASES: [(&str, &str); 8] = [
    (
        "destination_capacity",
        "source pinned → destination reserved (prefill done, waiting for decode capacity)",
    ),
    ("reservation_queue", "reservation queued → reserved (waiting in a decode FIFO)"),
    (
        "prefill_after_reservation",
        "destination reserved → transfer started (destination-first: prefill runs after reserving)",
    ),
    ("transfer", "receive started → receive completed (waiting for the bytes)"),
    ("reader_ack", "destination activated → source released (waiting for reader acknowledgement; 0 when the source was released first)"),
    ("lease_expired", "source pinned → released by lease expiry (pins that waited out their lease)"),
    ("reservation_expired", "destination reserved → released by reservation expiry"),
    (
        "canceled",
        "first fact of a canceled handoff → its last release or cancel (time it held or waited before giving up)",
    ),
];

/// Every handoff's milestones while it is unfinished, and what the finished ones add up to.
pub(super) struct HandoffWatch {
    top_n: usize,
    open: BTreeMap<HandoffId, HandoffMarks>,
    finished: BTreeSet<HandoffId>,
    finished_order: VecDeque<HandoffId>,
    count: u64,
    phases: Vec<PhaseTotals>,
    pin_total: PhaseTotals,
    outcomes: Outcomes,
    gating_wait: Distribution,
    gating_count: u64,
    gating_first_ns: Option<u64>,
    /// Min-heap of the `top_n` longest pins: (pinned_ns, Reverse(id)).
    top: BinaryHeap<Reverse<(u64, Reverse<HandoffId>, bool)>>,
}

impl HandoffWatch {
    pub(super) fn new(top_n: usize) -> Self {
        HandoffWatch {
            top_n,
            open: BTreeMap::new(),
            finished: BTreeSet::new(),
            finished_order: VecDeque::new(),
            count: 0,
            phases: PHASES.iter().map(|_| PhaseTotals::default()).collect(),
            pin_total: PhaseTotals::default(),
            outcomes: Outcomes::default(),
            gating_wait: Distribution::new(),
            gating_count: 0,
            gating_first_ns: None,
            top: BinaryHeap::new(),
        }
    }

    /// Folds one fact of `worker`'s stream; true when it made its handoff gated (its
    /// reservation queued on `worker` before its prefill was dispatched).
    pub(super) fn apply(&mut self, worker: WorkerId, at: u64, fact: &Fact) -> bool {
        let mut gated_now = false;
        let Some(id) = fact.handoff() else {
            return false;
        };
        // Only facts that begin a role's part may create state: a stray late message about a
        // finished handoff must not resurrect it.
        let creates = matches!(
            fact,
            Fact::HandoffStarted { .. }
                | Fact::PrefillDispatched { .. }
                | Fact::SourcePinned { .. }
                | Fact::DestinationRouted { .. }
                | Fact::ReservationQueued { .. }
                | Fact::DestinationReserved { .. }
        );
        if !self.open.contains_key(&id) {
            if !creates || self.finished.contains(&id) {
                return false;
            }
            self.count += 1;
            self.open.insert(id, HandoffMarks { first_ns: at, ..HandoffMarks::default() });
        }
        let Some(h) = self.open.get_mut(&id) else {
            return false;
        };
        h.last_ns = h.last_ns.max(at);
        let first = |slot: &mut Option<u64>| {
            slot.get_or_insert(at);
        };
        match fact {
            Fact::HandoffStarted { policy, .. } => {
                h.policy = Some(*policy);
                match worker.role {
                    Role::Prefill => {
                        h.src_started = true;
                        h.source = Some(worker);
                    }
                    Role::Decode => {
                        h.dst_started = true;
                        h.destination = Some(worker);
                    }
                    _ => {}
                }
            }
            Fact::PrefillDispatched { .. } => {
                h.src_started = true;
                h.source.get_or_insert(worker);
                first(&mut h.dispatched_ns);
            }
            Fact::SourcePinned { .. } => {
                h.src_started = true;
                h.source = Some(worker);
                first(&mut h.pinned_ns);
            }
            Fact::DestinationRouted { worker: d, .. } => {
                h.dst_started = true;
                h.destination = Some(*d);
            }
            Fact::ReservationQueued { .. } => {
                h.dst_started = true;
                h.destination = Some(worker);
                first(&mut h.queued_ns);
                if h.dispatched_ns.is_none() && h.pinned_ns.is_none() && !h.gated {
                    h.gated = true;
                    gated_now = true;
                    self.gating_count += 1;
                    self.gating_first_ns.get_or_insert(at);
                }
            }
            Fact::ReservationDequeued { .. } => {
                h.dst_done = true;
                first(&mut h.reservation_ended_ns);
            }
            Fact::DestinationReserved { .. } => {
                h.dst_started = true;
                h.destination = Some(worker);
                first(&mut h.reserved_ns);
            }
            Fact::ReceiveStarted { .. } => first(&mut h.recv_started_ns),
            Fact::ReceiveCompleted { .. } => first(&mut h.recv_completed_ns),
            Fact::DestinationActivated { .. } => {
                first(&mut h.activated_ns);
                h.dst_done = true;
            }
            Fact::ReservationExpired { .. } => h.reservation_expired = true,
            Fact::ReservationReleased { .. } => {
                first(&mut h.reservation_ended_ns);
                h.dst_done = true;
            }
            Fact::LeaseExpired { .. } => h.lease_expired = true,
            Fact::SourceReleased { reason, .. } => {
                first(&mut h.released_ns);
                h.source_end.get_or_insert(*reason);
                h.src_done = true;
            }
            Fact::HandoffCanceled { reason, .. } => {
                h.canceled.get_or_insert(*reason);
                match worker.role {
                    // A role that holds nothing ends with the cancel; one that holds a pin or a
                    // reservation ends when it releases it.
                    Role::Prefill if h.pinned_ns.is_none() => h.src_done = true,
                    Role::Decode if h.reserved_ns.is_none() => h.dst_done = true,
                    _ => {}
                }
            }
            _ => {}
        }
        let failed = h.lease_expired || h.reservation_expired || h.canceled.is_some();
        let done = (h.src_done && h.dst_done)
            || (h.src_done && !h.dst_started && failed)
            || (h.dst_done && !h.src_started && failed);
        if done {
            if let Some(h) = self.open.remove(&id) {
                self.finish_handoff(id, h, at, false);
            }
        }
        gated_now
    }

    fn finish_handoff(&mut self, id: HandoffId, h: HandoffMarks, end_ns: u64, at_end: bool) {
        if !at_end {
            self.finished.insert(id);
            self.finished_order.push_back(id);
            if self.finished_order.len() > FINISHED_MEMORY {
                if let Some(old) = self.finished_order.pop_front() {
                    self.finished.remove(&old);
                }
            }
        }
        // Phases.
        // Which side waited first follows the policy; without one, the order of the marks.
        let source_first = match h.policy {
            Some(HandoffPolicy::SourceFirst) => true,
            Some(HandoffPolicy::DestinationFirst) => false,
            _ => h.pinned_ns.is_some() && h.reserved_ns >= h.pinned_ns,
        };
        if source_first {
            self.phases[0].add(h.pinned_ns, h.reserved_ns);
        } else {
            self.phases[2].add(h.reserved_ns, h.recv_started_ns);
        }
        self.phases[1].add(h.queued_ns, h.reserved_ns);
        self.phases[3].add(h.recv_started_ns, h.recv_completed_ns);
        if h.source_end == Some(EndReason::Success) {
            // A source released before its destination activated waited for no one: 0.
            let released = match (h.activated_ns, h.released_ns) {
                (Some(a), Some(r)) => Some(r.max(a)),
                (_, r) => r,
            };
            self.phases[4].add(h.activated_ns, released);
        }
        if h.lease_expired {
            self.phases[5].add(h.pinned_ns, h.released_ns.or(Some(end_ns)));
        }
        if h.reservation_expired {
            self.phases[6].add(h.reserved_ns, h.reservation_ended_ns.or(Some(end_ns)));
        }
        if h.canceled.is_some() && !h.lease_expired && !h.reservation_expired {
            self.phases[7].add(Some(h.first_ns), Some(h.last_ns));
        }
        if h.gated {
            if let Some(q) = h.queued_ns {
                let until = h.reserved_ns.or(h.reservation_ended_ns).unwrap_or(end_ns);
                self.gating_wait.add(until.saturating_sub(q));
            }
        }
        // Outcome, in the ledger's precedence.
        let o = &mut self.outcomes;
        if h.lease_expired {
            o.lease_expired += 1;
        } else if h.reservation_expired {
            o.reservation_expired += 1;
        } else if let Some(r) = h.canceled {
            o.canceled += 1;
            *o.canceled_by_reason.entry(r.as_str()).or_insert(0) += 1;
        } else if h.activated_ns.is_some() && h.source_end == Some(EndReason::Success) {
            o.completed += 1;
        } else if at_end {
            o.in_flight_at_end += 1;
        } else if h.activated_ns.is_some() || h.source_end == Some(EndReason::Success) {
            // A handoff with no pin (policy without source pinning) that activated.
            o.completed += 1;
        } else {
            o.in_flight_at_end += 1;
        }
        // Pins.
        if let Some(p) = h.pinned_ns {
            let still = h.released_ns.is_none();
            let until = h.released_ns.unwrap_or(end_ns);
            let d = until.saturating_sub(p);
            self.pin_total.add(Some(p), Some(until));
            if self.top_n > 0 {
                let key = Reverse((d, Reverse(id), still));
                if self.top.len() < self.top_n {
                    self.top.push(key);
                } else if let Some(min) = self.top.peek() {
                    if (d, Reverse(id)) > (min.0 .0, min.0 .1) {
                        self.top.pop();
                        self.top.push(key);
                    }
                }
            }
        }
    }

    /// At the run's end `end`: every unfinished handoff finishes as in flight.
    pub(super) fn finish_open(&mut self, end: u64) {
        let open: Vec<(HandoffId, HandoffMarks)> = std::mem::take(&mut self.open).into_iter().collect();
        for (id, h) in open {
            self.finish_handoff(id, h, end, true);
        }
    }

    /// Destination gating (`None` when no reservation waited ahead of its prefill), with the
    /// per-worker figures the fold kept; the wait breakdown; the longest pins, longest first.
    pub(super) fn report(
        self,
        gating_workers: Vec<GatingWorker>,
    ) -> (Option<Gating>, WaitBreakdown, Vec<TopPin>) {
        let gating = self.gating_first_ns.map(|first| {
            let wait = self.gating_wait.stats(NS_PER_MS_F64);
            let summary = format!(
                "{} reservations waited in decode FIFOs ahead of prefill dispatch (from {:.3} ms; wait p50 {:.3} ms, max {:.3} ms): capacity waiting happened before prefill, not as stranded source KV",
                self.gating_count,
                ms(first),
                wait.p50,
                wait.max
            );
            Gating {
                handoffs: self.gating_count,
                first_queued_at_ms: ms(first),
                wait_ms: wait,
                per_worker: gating_workers,
                summary,
            }
        });

        let mut phases: Vec<Phase> = PHASES
            .iter()
            .zip(self.phases.iter())
            .map(|((name, meaning), acc)| Phase {
                phase: name,
                meaning,
                total_ms: acc.total_ns as f64 / NS_PER_MS_F64,
                stats_ms: acc.dist.stats(NS_PER_MS_F64),
            })
            .collect();
        phases.insert(
            0,
            Phase {
                phase: "source_pinned",
                meaning: "source pinned → released (or run end): all stranded time",
                total_ms: self.pin_total.total_ns as f64 / NS_PER_MS_F64,
                stats_ms: self.pin_total.dist.stats(NS_PER_MS_F64),
            },
        );

        let mut top: Vec<TopPin> = self
            .top
            .into_iter()
            .map(|Reverse((d, Reverse(id), still))| TopPin { handoff: id, pinned_ns: d, still_pinned: still })
            .collect();
        top.sort_by(|a, b| b.pinned_ns.cmp(&a.pinned_ns).then(a.handoff.cmp(&b.handoff)));
        let breakdown = WaitBreakdown { handoffs: self.count, phases, outcomes: self.outcomes };
        (gating, breakdown, top)
    }
}
