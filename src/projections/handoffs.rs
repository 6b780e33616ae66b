//! The handoff ledger: per HandoffId, every transition on both roles, in merge order, plus the
//! milestones a person asks about (when pinned, reserved, activated, released; how it ended).

use crate::events::{Fact, MessageKind, Record};
use crate::ids::{CancelReason, EndReason, HandoffId, HandoffPolicy, RequestId, Role, WorkerId};
use crate::lifecycle::policy::Milestone;
use serde::Serialize;
use std::collections::BTreeMap;

/// One transition of one handoff as some role recorded it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Transition {
    pub at_ns: u64,
    pub worker: WorkerId,
    /// The fact's variant name (`SourcePinned`, `MessageReceived`, ...).
    pub fact: &'static str,
    /// For messages: which kind.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<MessageKind>,
}

/// How a handoff ended, as far as the log says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HandoffOutcome {
    /// Destination activated and source released on success.
    Completed,
    /// The source lease expired.
    LeaseExpired,
    /// The destination reservation expired.
    ReservationExpired,
    /// Canceled on some role.
    Canceled,
    /// Not finished when the log ends.
    InFlight,
}

/// Everything the ledger knows about one handoff.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HandoffEntry {
    pub request: Option<RequestId>,
    pub policy: Option<HandoffPolicy>,
    pub source: Option<WorkerId>,
    pub destination: Option<WorkerId>,
    pub started_at_ns: Option<u64>,
    pub dispatched_at_ns: Option<u64>,
    pub pinned_at_ns: Option<u64>,
    pub pinned_blocks: u32,
    pub routed_at_ns: Option<u64>,
    pub reserved_at_ns: Option<u64>,
    pub reserved_pages: u32,
    pub prefix_tokens: u32,
    pub receive_started_at_ns: Option<u64>,
    pub transfer_bytes: u64,
    pub receive_completed_at_ns: Option<u64>,
    pub activated_at_ns: Option<u64>,
    pub reader_completed_at_ns: Option<u64>,
    pub source_released_at_ns: Option<u64>,
    pub source_end: Option<EndReason>,
    pub reservation_released_at_ns: Option<u64>,
    pub reservation_end: Option<EndReason>,
    pub lease_expired: bool,
    pub reservation_expired: bool,
    pub canceled: Option<CancelReason>,
    pub rejected_messages: u32,
    pub transitions: Vec<Transition>,
}

impl HandoffEntry {
    pub fn outcome(&self) -> HandoffOutcome {
        if self.lease_expired {
            HandoffOutcome::LeaseExpired
        } else if self.reservation_expired {
            HandoffOutcome::ReservationExpired
        } else if self.canceled.is_some() {
            HandoffOutcome::Canceled
        } else if self.activated_at_ns.is_some() && self.source_end == Some(EndReason::Success) {
            HandoffOutcome::Completed
        } else {
            HandoffOutcome::InFlight
        }
    }

    /// The ownership milestones in the order they happened, named as the reference names them:
    /// `SourceHeld`, `DestinationAccepted`, `DestinationReserved`, `DestinationActivated`,
    /// `SourceReleased`, then `Completed` when both sides ended on success.
    pub fn normalized(&self) -> Vec<Milestone> {
        let mut marks: Vec<(u64, Milestone)> = [
            (self.pinned_at_ns, Milestone::SourceHeld),
            (self.routed_at_ns, Milestone::DestinationAccepted),
            (self.reserved_at_ns, Milestone::DestinationReserved),
            (self.activated_at_ns, Milestone::DestinationActivated),
            (self.source_released_at_ns, Milestone::SourceReleased),
        ]
        .into_iter()
        .filter_map(|(at, m)| Some((at?, m)))
        .collect();
        // Equal timestamps keep the lifecycle's own order (the enum's).
        marks.sort();
        let mut out: Vec<Milestone> = marks.into_iter().map(|(_, m)| m).collect();
        if self.outcome() == HandoffOutcome::Completed {
            out.push(Milestone::Completed);
        }
        out
    }

    /// The milestones as `diff` compares them: ordered by each role's own stream and by the
    /// messages between the roles, never by comparing the two roles' timestamps (live, those
    /// come from two processes' clocks). Each role's facts are taken in its stream's order; a
    /// fact after a role received a message comes after the other role sent it; otherwise the
    /// source's go first. A source-first handoff reads `SourceHeld, DestinationAccepted,
    /// DestinationReserved, DestinationActivated, SourceReleased`; a destination-first one starts
    /// `DestinationAccepted, DestinationReserved, SourceHeld`, because its source heard of the
    /// reservation before it held anything.
    pub fn per_role(&self) -> Vec<Milestone> {
        let side = |who: Option<WorkerId>| -> Vec<CausalStep> {
            let Some(w) = who else { return Vec::new() };
            self.transitions.iter().filter(|t| t.worker == w).filter_map(CausalStep::of).collect()
        };
        let (source, destination) = (side(self.source), side(self.destination));
        let messages = source.iter().chain(&destination).any(|s| !matches!(s, CausalStep::Milestone(_)));
        if !messages {
            // Nothing causal between the roles (a log written without its messages): the
            // timestamps are all there is.
            return self.normalized();
        }
        let mut out = causal_merge(&source, &destination);
        if !out.contains(&Milestone::DestinationAccepted) && self.routed_at_ns.is_some() {
            // Routed by the router alone (its stream is not a role's): before the destination's
            // own facts.
            let at = out
                .iter()
                .position(|m| matches!(m, Milestone::DestinationReserved | Milestone::DestinationActivated));
            out.insert(at.unwrap_or(out.len()), Milestone::DestinationAccepted);
        }
        if self.outcome() == HandoffOutcome::Completed {
            out.push(Milestone::Completed);
        }
        out
    }

    /// How long the source was pinned (to release, or to `end_ns` if still pinned).
    pub fn pinned_ns(&self, end_ns: u64) -> Option<u64> {
        let from = self.pinned_at_ns?;
        Some(self.source_released_at_ns.unwrap_or(end_ns).saturating_sub(from))
    }
}

/// One role's fact, as the causal order of [`HandoffEntry::per_role`] sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CausalStep {
    Milestone(Milestone),
    Sent(MessageKind),
    Received(MessageKind),
}

impl CausalStep {
    fn of(t: &Transition) -> Option<Self> {
        Some(match (t.fact, t.message) {
            ("SourcePinned", _) => CausalStep::Milestone(Milestone::SourceHeld),
            ("SourceReleased", _) => CausalStep::Milestone(Milestone::SourceReleased),
            ("DestinationRouted", _) => CausalStep::Milestone(Milestone::DestinationAccepted),
            ("DestinationReserved", _) => CausalStep::Milestone(Milestone::DestinationReserved),
            ("DestinationActivated", _) => CausalStep::Milestone(Milestone::DestinationActivated),
            ("MessageSent", Some(k)) => CausalStep::Sent(k),
            ("MessageReceived", Some(k)) => CausalStep::Received(k),
            _ => return None,
        })
    }
}

/// Merges the two roles' steps: a receive waits for its send on the other side (the n-th
/// receive of a kind for the n-th send); otherwise the source's steps go first. A receive
/// whose send is missing (a log cut short) does not hold the merge up.
fn causal_merge(source: &[CausalStep], destination: &[CausalStep]) -> Vec<Milestone> {
    let sides = [source, destination];
    let mut next = [0usize; 2];
    let mut sent: [Vec<MessageKind>; 2] = [Vec::new(), Vec::new()];
    let mut received: [Vec<MessageKind>; 2] = [Vec::new(), Vec::new()];
    let mut out = Vec::new();
    let ready =
        |side: usize, step: &CausalStep, sent: &[Vec<MessageKind>; 2], received: &[Vec<MessageKind>; 2]| {
            match step {
                CausalStep::Received(k) => {
                    let sends = sent[1 - side].iter().filter(|x| *x == k).count();
                    let receives = received[side].iter().filter(|x| *x == k).count();
                    sends > receives
                }
                _ => true,
            }
        };
    while next[0] < sides[0].len() || next[1] < sides[1].len() {
        let pick = (0..2)
            .find(|s| next[*s] < sides[*s].len() && ready(*s, &sides[*s][next[*s]], &sent, &received))
            .unwrap_or(if next[0] < sides[0].len() { 0 } else { 1 });
        let step = sides[pick][next[pick]];
        next[pick] += 1;
        match step {
            CausalStep::Milestone(m) => out.push(m),
            CausalStep::Sent(k) => sent[pick].push(k),
            CausalStep::Received(k) => received[pick].push(k),
        }
    }
    out
}

/// Where one role of a handoff stands, as far as telling when the role is done: a source ends at
/// its release; a destination at activation, its reservation's release or dequeue; a canceled
/// role that holds nothing has nothing left to end. (diff and [`HandoffStream`] both ask.)
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RoleProgress {
    /// The stream (diff) or the worker's place (the stream fold) of the role.
    pub stream: usize,
    pub is_source: bool,
    pinned: bool,
    /// A reservation queued or held and not yet dequeued, released or activated.
    waiting: bool,
    canceled: bool,
    pub ended: bool,
}

impl RoleProgress {
    pub(crate) fn new(stream: usize, is_source: bool) -> Self {
        RoleProgress { stream, is_source, ..RoleProgress::default() }
    }

    pub(crate) fn observe(&mut self, fact: &Fact) {
        match fact {
            Fact::SourcePinned { .. } => self.pinned = true,
            Fact::SourceReleased { .. } => self.ended = true,
            Fact::ReservationQueued { .. } | Fact::DestinationReserved { .. } => self.waiting = true,
            Fact::ReservationDequeued { .. }
            | Fact::ReservationReleased { .. }
            | Fact::DestinationActivated { .. } => {
                self.waiting = false;
                if !self.is_source {
                    self.ended = true;
                }
            }
            Fact::HandoffCanceled { .. } => self.canceled = true,
            _ => {}
        }
        if self.canceled && !self.waiting && (!self.is_source || !self.pinned) {
            self.ended = true;
        }
    }
}

/// The ledger folded as a stream: a handoff whose every started role has ended is handed out
/// (oldest first) once more than [`HandoffStream::KEEP_FINISHED`] finished ones wait, so memory
/// follows the handoffs in flight, not the length of the log. Waiting a while before handing
/// one out lets a late fact about it (a duplicate message refused after its end) still join
/// its entry.
#[derive(Debug, Default)]
pub struct HandoffStream {
    ledger: HandoffLedger,
    roles: std::collections::HashMap<HandoffId, Vec<(WorkerId, RoleProgress)>>,
    finished: std::collections::VecDeque<HandoffId>,
}

impl HandoffStream {
    /// Finished handoffs kept before the oldest is handed out.
    pub const KEEP_FINISHED: usize = 4096;

    pub fn new() -> Self {
        Self::default()
    }

    /// Folds one record; returns a finished handoff to hand out, if one is due.
    pub fn apply(&mut self, worker: WorkerId, record: &Record) -> Option<(HandoffId, HandoffEntry)> {
        self.ledger.apply(worker, record);
        if matches!(record.fact, Fact::SessionLost { .. }) {
            self.end_roles_of(worker, record.at_ns);
            return self.due();
        }
        let id = record.fact.handoff()?;
        let roles = self.roles.entry(id).or_default();
        if matches!(record.fact, Fact::HandoffStarted { .. }) && !roles.iter().any(|(w, _)| *w == worker) {
            let is_source = worker.role != Role::Decode;
            roles.push((worker, RoleProgress::new(0, is_source)));
        }
        let Some((_, role)) = roles.iter_mut().find(|(w, _)| *w == worker) else { return self.due() };
        let was = role.ended;
        role.observe(&record.fact);
        if !was && role.ended && roles.iter().all(|(_, r)| r.ended) {
            self.roles.remove(&id);
            self.finished.push_back(id);
        }
        self.due()
    }

    /// `worker`'s session died with its process: its roles end there, whatever state they
    /// were in (the stream says so with `SessionLost`, before the next session starts).
    fn end_roles_of(&mut self, worker: WorkerId, at_ns: u64) {
        let mut done = Vec::new();
        for (id, roles) in &mut self.roles {
            let mut touched = false;
            for (w, role) in roles.iter_mut() {
                if *w == worker && !role.ended {
                    role.ended = true;
                    touched = true;
                }
            }
            if !touched {
                continue;
            }
            if let Some(e) = self.ledger.entries.get_mut(id) {
                e.transitions.push(Transition { at_ns, worker, fact: "SessionLost", message: None });
            }
            if roles.iter().all(|(_, r)| r.ended) {
                done.push(*id);
            }
        }
        // Handed out in id order: the map's order is not the log's.
        done.sort();
        for id in done {
            self.roles.remove(&id);
            self.finished.push_back(id);
        }
    }

    fn due(&mut self) -> Option<(HandoffId, HandoffEntry)> {
        if self.finished.len() <= Self::KEEP_FINISHED {
            return None;
        }
        let id = self.finished.pop_front()?;
        self.ledger.remove(&id).map(|e| (id, e))
    }

    /// The latest timestamp seen.
    pub fn last_at_ns(&self) -> u64 {
        self.ledger.last_at_ns()
    }

    /// At the end of the log: the finished handoffs still kept (in the order they finished),
    /// then the unfinished ones (by id).
    pub fn finish(mut self) -> impl Iterator<Item = (HandoffId, HandoffEntry)> {
        let mut out: Vec<(HandoffId, HandoffEntry)> = Vec::with_capacity(self.ledger.entries.len());
        for id in std::mem::take(&mut self.finished) {
            if let Some(e) = self.ledger.remove(&id) {
                out.push((id, e));
            }
        }
        out.extend(std::mem::take(&mut self.ledger.entries));
        out.into_iter()
    }
}

/// The fold. Memory grows with the number of handoffs in the log (it keeps every transition):
/// it is a post-mortem view; [`HandoffStream`] is the same fold handing finished handoffs out.
#[derive(Clone, Debug, Default)]
pub struct HandoffLedger {
    entries: BTreeMap<HandoffId, HandoffEntry>,
    last_at_ns: u64,
}

impl HandoffLedger {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn entries(&self) -> &BTreeMap<HandoffId, HandoffEntry> {
        &self.entries
    }

    pub fn get(&self, id: &HandoffId) -> Option<&HandoffEntry> {
        self.entries.get(id)
    }

    /// Removes and returns a handoff's entry, so a streaming consumer (diff) can drop handoffs
    /// it has finished with and keep memory proportional to handoffs in flight.
    pub fn remove(&mut self, id: &HandoffId) -> Option<HandoffEntry> {
        self.entries.remove(id)
    }

    /// The latest timestamp seen (the log's end, for still-pinned durations).
    pub fn last_at_ns(&self) -> u64 {
        self.last_at_ns
    }

    pub fn apply(&mut self, worker: WorkerId, record: &Record) {
        self.last_at_ns = self.last_at_ns.max(record.at_ns);
        let Some(id) = record.fact.handoff() else {
            return;
        };
        let at = record.at_ns;
        let e = self.entries.entry(id).or_default();
        let message = match &record.fact {
            Fact::MessageSent { kind, .. }
            | Fact::MessageReceived { kind, .. }
            | Fact::MessageRejected { kind, .. } => Some(*kind),
            _ => None,
        };
        e.transitions.push(Transition { at_ns: at, worker, fact: record.fact.name(), message });
        let first = |slot: &mut Option<u64>| {
            if slot.is_none() {
                *slot = Some(at);
            }
        };
        match &record.fact {
            Fact::HandoffStarted { request, policy, .. } => {
                e.request = Some(*request);
                e.policy = Some(*policy);
                first(&mut e.started_at_ns);
                match worker.role {
                    Role::Prefill => e.source = Some(worker),
                    Role::Decode => e.destination = Some(worker),
                    _ => {}
                }
            }
            Fact::PrefillDispatched { .. } => {
                e.source.get_or_insert(worker);
                first(&mut e.dispatched_at_ns);
            }
            Fact::SourcePinned { request, blocks, .. } => {
                e.request.get_or_insert(*request);
                e.source = Some(worker);
                e.pinned_blocks = *blocks;
                first(&mut e.pinned_at_ns);
            }
            Fact::DestinationRouted { worker: dest, .. } => {
                e.destination = Some(*dest);
                first(&mut e.routed_at_ns);
            }
            Fact::DestinationReserved { request, pages, prefix_tokens, .. } => {
                e.request.get_or_insert(*request);
                e.destination = Some(worker);
                e.reserved_pages = *pages;
                e.prefix_tokens = *prefix_tokens;
                first(&mut e.reserved_at_ns);
            }
            Fact::ReceiveStarted { bytes, .. } => {
                e.transfer_bytes = *bytes;
                first(&mut e.receive_started_at_ns);
            }
            Fact::ReceiveCompleted { .. } => first(&mut e.receive_completed_at_ns),
            Fact::DestinationActivated { .. } => first(&mut e.activated_at_ns),
            Fact::ReaderCompleted { .. } => first(&mut e.reader_completed_at_ns),
            Fact::SourceReleased { reason, .. } => {
                first(&mut e.source_released_at_ns);
                e.source_end.get_or_insert(*reason);
            }
            Fact::ReservationReleased { reason, .. } => {
                first(&mut e.reservation_released_at_ns);
                e.reservation_end.get_or_insert(*reason);
            }
            Fact::LeaseExpired { .. } => e.lease_expired = true,
            Fact::ReservationExpired { .. } => e.reservation_expired = true,
            Fact::HandoffCanceled { reason, .. } => {
                e.canceled.get_or_insert(*reason);
            }
            Fact::MessageRejected { .. } => e.rejected_messages += 1,
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::KvDelta;
    use crate::ids::{DestinationReservationId, SourceLeaseId};

    fn rec(at_ns: u64, fact: Fact) -> Record {
        Record { seq: 0, at_ns, fact }
    }

    #[test]
    fn source_first_normalizes_in_reference_order() {
        let id = HandoffId(uuid::Uuid::from_u128(1));
        let mut l = HandoffLedger::new();
        let p = WorkerId::prefill(0);
        let d = WorkerId::decode(1);
        let z = KvDelta::ZERO;
        l.apply(
            p,
            &rec(
                1,
                Fact::SourcePinned {
                    handoff: id,
                    request: RequestId(3),
                    lease: SourceLeaseId(1),
                    blocks: 4,
                    deadline_ns: 9,
                    kv: z,
                },
            ),
        );
        l.apply(WorkerId::ROUTER, &rec(2, Fact::DestinationRouted { handoff: id, worker: d }));
        l.apply(
            d,
            &rec(
                3,
                Fact::DestinationReserved {
                    handoff: id,
                    request: RequestId(3),
                    reservation: DestinationReservationId(1),
                    pages: 4,
                    prefix_blocks: 0,
                    prefix_tokens: 0,
                    deadline_ns: 99,
                    kv: z,
                },
            ),
        );
        assert_eq!(l.get(&id).unwrap().outcome(), HandoffOutcome::InFlight);
        l.apply(
            d,
            &rec(
                5,
                Fact::DestinationActivated { handoff: id, reservation: DestinationReservationId(1), kv: z },
            ),
        );
        l.apply(
            p,
            &rec(
                5,
                Fact::SourceReleased {
                    handoff: id,
                    lease: SourceLeaseId(1),
                    reason: EndReason::Success,
                    kv: z,
                },
            ),
        );
        let e = l.get(&id).unwrap();
        assert_eq!(e.outcome(), HandoffOutcome::Completed);
        assert_eq!(
            Milestone::join(&e.normalized(), " "),
            "SourceHeld DestinationAccepted DestinationReserved DestinationActivated SourceReleased Completed"
        );
        assert_eq!(e.pinned_ns(100), Some(4));
        assert_eq!((e.source, e.destination), (Some(p), Some(d)));
    }

    #[test]
    fn expiry_is_not_completion() {
        let id = HandoffId(uuid::Uuid::from_u128(2));
        let mut l = HandoffLedger::new();
        let p = WorkerId::prefill(0);
        l.apply(
            p,
            &rec(
                1,
                Fact::SourcePinned {
                    handoff: id,
                    request: RequestId(1),
                    lease: SourceLeaseId(1),
                    blocks: 4,
                    deadline_ns: 9,
                    kv: KvDelta::ZERO,
                },
            ),
        );
        l.apply(p, &rec(9, Fact::LeaseExpired { handoff: id, lease: SourceLeaseId(1) }));
        l.apply(
            p,
            &rec(
                9,
                Fact::SourceReleased {
                    handoff: id,
                    lease: SourceLeaseId(1),
                    reason: EndReason::Expired,
                    kv: KvDelta::ZERO,
                },
            ),
        );
        let e = l.get(&id).unwrap();
        assert_eq!(e.outcome(), HandoffOutcome::LeaseExpired);
        assert_eq!(e.normalized(), [Milestone::SourceHeld, Milestone::SourceReleased]);
    }
}
