//! Per-handoff and per-request comparisons, in merge order: each side folds handoffs and
//! requests while in flight, and each one finished on both sides is compared by its
//! signature (and timing) and dropped.

use super::context::{push_ring, Context, RecordRef};
use super::findings::{Candidate, Findings};
use super::id_maps::{IdMap, RecentIds, RECENT_IDS};
use super::report::{DiffKind, Difference, Location};
use super::sequences::{QueuedElement, Track};
use crate::events::RunLayout;
use crate::events::{Fact, LogError, RunReader, TerminalStatus};
use crate::ids::{CancelReason, EndReason, HandoffId, RequestId, Role, WorkerId};
use crate::lifecycle::policy::Milestone;
use crate::projections::handoffs::{HandoffEntry, HandoffLedger, HandoffOutcome, RoleProgress};
use std::collections::{BTreeMap, VecDeque};

/// How a handoff is matched across runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum HandoffKey {
    /// The n-th handoff started for the request.
    Request(RequestId, u32),
    /// A handoff whose request never showed.
    Id(HandoffId),
}

impl std::fmt::Display for HandoffKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HandoffKey::Request(r, n) => write!(f, "handoff of {r} (attempt {n})"),
            HandoffKey::Id(h) => write!(f, "handoff {h}"),
        }
    }
}

/// What is compared of a handoff.
#[derive(Clone, Debug, PartialEq, Eq)]
struct HandoffSignature {
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
    /// Each role's KV moves (fact, delta), in its own stream's order: taken and returned
    /// exactly once. Empty unless both runs share a clock domain (see `compare_kv_moves`).
    source_kv: Vec<(&'static str, crate::model::KvDelta)>,
    destination_kv: Vec<(&'static str, crate::model::KvDelta)>,
}

impl HandoffSignature {
    fn of(e: &HandoffEntry, o: &OpenHandoff) -> Self {
        HandoffSignature {
            normalized: e.per_role(),
            outcome: e.outcome(),
            source: e.source,
            destination: e.destination,
            pinned_blocks: e.pinned_blocks,
            reserved_pages: e.reserved_pages,
            prefix_tokens: e.prefix_tokens,
            source_end: e.source_end,
            reservation_end: e.reservation_end,
            canceled: e.canceled,
            source_kv: o.source_kv.clone(),
            destination_kv: o.destination_kv.clone(),
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
        let moves = |m: &[(&str, crate::model::KvDelta)]| {
            m.iter().map(|(fact, d)| format!("{fact} {d}")).collect::<Vec<_>>().join(", ")
        };
        for (name, a, b) in [
            ("source KV moves", &self.source_kv, &o.source_kv),
            ("destination KV moves", &self.destination_kv, &o.destination_kv),
        ] {
            if a != b {
                out.push(format!("{name} A [{}] vs B [{}]", moves(a), moves(b)));
            }
        }
        out.join("; ")
    }
}

/// What is compared of a request.
#[derive(Clone, Debug, PartialEq, Eq)]
struct RequestSignature {
    status: Option<TerminalStatus>,
    output_tokens: Option<u32>,
    prefill_workers: Vec<WorkerId>,
    decode_workers: Vec<WorkerId>,
    /// The router's booking facts of the request, sorted: each booking taken and freed exactly
    /// once.
    bookings: Vec<String>,
}

impl RequestSignature {
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
        field!(bookings);
        out.join("; ")
    }
}

/// One role of a handoff as its own stream tells it: whether it has ended there. A handoff
/// is compared only once every role that started has ended on its own stream, so the result
/// never depends on how two processes' clocks (or a message's latency) interleave the roles'
/// facts with the router's.
#[derive(Default)]
struct OpenHandoff {
    request: Option<RequestId>,
    attempt: Option<u32>,
    request_finished: bool,
    roles: Vec<RoleProgress>,
    source_kv: Vec<(&'static str, crate::model::KvDelta)>,
    destination_kv: Vec<(&'static str, crate::model::KvDelta)>,
    ring: VecDeque<RecordRef>,
    last: Option<Location>,
    last_ref: Option<RecordRef>,
}

pub(super) struct FinishedHandoff {
    sig: HandoffSignature,
    pin_ns: Option<u64>,
    trail: Trail,
}

/// Where a finished handoff or request was last seen: its last record and the references of
/// its last few (the context printed for it).
pub(super) struct Trail {
    last: Option<Location>,
    ring: Vec<RecordRef>,
    last_ref: Option<RecordRef>,
}

impl Trail {
    /// The difference `detail` between two sides' entities, with their trails as context.
    fn candidate(
        kind: DiffKind,
        subject: String,
        a: Option<&Trail>,
        b: Option<&Trail>,
        detail: String,
    ) -> Candidate {
        Candidate {
            diff: Difference {
                kind,
                subject,
                a: a.and_then(|t| t.last.clone()),
                b: b.and_then(|t| t.last.clone()),
                detail,
            },
            ctx_a: Context::Refs(a.map(|t| t.ring.clone()).unwrap_or_default()),
            ctx_b: Context::Refs(b.map(|t| t.ring.clone()).unwrap_or_default()),
            div_a: a.and_then(|t| t.last_ref),
            div_b: b.and_then(|t| t.last_ref),
        }
    }
}

#[derive(Default)]
struct OpenRequest {
    arrival_ns: Option<u64>,
    first_token_ns: Option<u64>,
    prefill_workers: Vec<WorkerId>,
    decode_workers: Vec<WorkerId>,
    attempts: u32,
    handoffs: Vec<HandoffId>,
    bookings: Vec<String>,
    /// Bookings taken and not yet freed: a request is compared once it ended and every
    /// booking it took was freed (the pin's booking may be freed after the request ended).
    open_bookings: i32,
    /// The router's terminal fact, once seen, and where (a difference is shown there).
    terminal: Option<(TerminalStatus, u32, u64)>,
    terminal_at: Option<(Location, RecordRef)>,
    ring: VecDeque<RecordRef>,
    last: Option<Location>,
    last_ref: Option<RecordRef>,
}

pub(super) struct FinishedRequest {
    sig: RequestSignature,
    ttft_ns: Option<u64>,
    e2e_ns: Option<u64>,
    trail: Trail,
}

/// One run folded in merge order.
pub(super) struct EntitySide {
    reader: RunReader,
    workers: Vec<WorkerId>,
    /// Per compared worker (the union of both runs' workers): its sequence folds.
    pub(super) tracks: Vec<Track>,
    /// Per stream of this run: its index in `tracks`.
    track_of: Vec<usize>,
    has_router: bool,
    ring_cap: usize,
    ledger: HandoffLedger,
    open_handoffs: IdMap<HandoffId, OpenHandoff>,
    open_requests: IdMap<RequestId, OpenRequest>,
    finished_handoffs: RecentIds<HandoffId>,
    finished_requests: RecentIds<RequestId>,
    /// Finished here, not yet finished on the other side.
    pub(super) awaiting_handoffs: BTreeMap<HandoffKey, FinishedHandoff>,
    pub(super) awaiting_requests: BTreeMap<RequestId, FinishedRequest>,
    /// Finished in the last step (to be matched by the caller).
    fresh_handoffs: Vec<(HandoffKey, FinishedHandoff)>,
    fresh_requests: Vec<(RequestId, FinishedRequest)>,
    pub(super) records: u64,
    pub(super) ended: bool,
    /// Compare each handoff role's KV moves block for block. Off when a wall-clock run meets a
    /// virtual one: a pin's blocks shared with another request's prefix return with the last
    /// holder, and which holder is last depends on the order nearby instants were handled.
    pub(super) compare_kv_moves: bool,
}

impl EntitySide {
    pub(super) fn open(
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
            open_handoffs: IdMap::default(),
            open_requests: IdMap::default(),
            finished_handoffs: RecentIds::new(RECENT_IDS),
            finished_requests: RecentIds::new(RECENT_IDS),
            awaiting_handoffs: BTreeMap::new(),
            awaiting_requests: BTreeMap::new(),
            fresh_handoffs: Vec::new(),
            fresh_requests: Vec::new(),
            records: 0,
            ended: false,
            compare_kv_moves: true,
        })
    }

    /// Reads and folds one record; returns the worker sequence element it made, if any, with
    /// the worker's index in `tracks`.
    pub(super) fn step(&mut self) -> Result<Option<(usize, QueuedElement)>, LogError> {
        let Some((i, rec)) = self.reader.next()? else {
            self.ended = true;
            self.finish_all();
            return Ok(None);
        };
        self.records += 1;
        let offset = self.reader.last_record_offset().unwrap_or_default();
        let worker = self.workers[i];
        let r = RecordRef { stream: i, offset };
        let k = self.track_of[i];
        let elem = self.tracks.get_mut(k).and_then(|t| t.observe(&rec, offset)).map(|q| (k, q));
        let loc = Location::of(worker, &rec);
        let cap = self.ring_cap;
        // Requests.
        if let Some(req) = rec.fact.request() {
            if !self.finished_requests.contains(&req) {
                let e = self.open_requests.entry(req).or_default();
                push_ring(&mut e.ring, cap, r);
                e.last = Some(loc.clone());
                e.last_ref = Some(r);
                match &rec.fact {
                    Fact::RequestArrived { .. } if worker.role == Role::Router || !self.has_router => {
                        e.arrival_ns.get_or_insert(rec.at_ns);
                    }
                    Fact::PrefillBooked { worker: w, .. } => {
                        e.prefill_workers.push(*w);
                        e.bookings.push(super::sequences::fact_text(&rec.fact));
                        e.open_bookings += 1;
                    }
                    Fact::DecodeBooked { worker: w, .. } => {
                        e.decode_workers.push(*w);
                        e.bookings.push(super::sequences::fact_text(&rec.fact));
                        e.open_bookings += 1;
                    }
                    Fact::PrefillBookingFreed { .. } | Fact::DecodeBookingFreed { .. } => {
                        e.bookings.push(super::sequences::fact_text(&rec.fact));
                        e.open_bookings -= 1;
                    }
                    Fact::PrefillComputeDone { .. } => {
                        e.bookings.push(super::sequences::fact_text(&rec.fact))
                    }

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
            if !self.finished_handoffs.contains(&h) {
                self.ledger.apply(worker, &rec);
                let o = self.open_handoffs.entry(h).or_default();
                if matches!(rec.fact, Fact::HandoffStarted { .. }) && !o.roles.iter().any(|p| p.stream == i) {
                    let is_source = worker.role != Role::Decode;
                    o.roles.push(RoleProgress::new(i, is_source));
                }
                if let Some(p) = o.roles.iter_mut().find(|p| p.stream == i) {
                    p.observe(&rec.fact);
                    let delta = rec.fact.kv_delta();
                    if self.compare_kv_moves && delta != crate::model::KvDelta::ZERO {
                        let moves = if p.is_source { &mut o.source_kv } else { &mut o.destination_kv };
                        moves.push((rec.fact.name(), delta));
                    }
                }
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
                        if let Some(re) = self.open_requests.get_mut(&req) {
                            o.attempt = Some(re.attempts);
                            re.attempts += 1;
                            re.handoffs.push(h);
                        } else if self.finished_requests.contains(&req) {
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
            if terminal && !self.finished_requests.contains(request) {
                if let Some(e) = self.open_requests.get_mut(request) {
                    e.terminal.get_or_insert((*status, *output_tokens, rec.at_ns));
                    e.terminal_at.get_or_insert((loc.clone(), r));
                }
            }
        }
        // A request ended at the router and every booking it took was freed: it is compared.
        if let Some(req) = rec.fact.request() {
            let settled =
                self.open_requests.get(&req).is_some_and(|e| e.terminal.is_some() && e.open_bookings <= 0);
            if settled {
                if let Some(e) = self.open_requests.remove(&req) {
                    let (status, tokens, at) = e.terminal.unwrap_or((TerminalStatus::Failed, 0, 0));
                    self.finish_request(req, e, Some(status), Some(tokens), Some(at));
                }
            }
        }
        Ok(elem)
    }

    fn finish_request(
        &mut self,
        request: RequestId,
        e: OpenRequest,
        status: Option<TerminalStatus>,
        output_tokens: Option<u32>,
        end_ns: Option<u64>,
    ) {
        self.finished_requests.insert(request);
        let done = FinishedRequest {
            sig: RequestSignature {
                status,
                output_tokens,
                prefill_workers: e.prefill_workers,
                decode_workers: e.decode_workers,
                // Which bookings, each exactly once; their order is the policy's (and, live,
                // the network's), which booking-sequence compares.
                bookings: {
                    let mut b = e.bookings;
                    b.sort();
                    b
                },
            },
            ttft_ns: match (e.arrival_ns, e.first_token_ns, status) {
                (Some(a), Some(f), Some(TerminalStatus::Completed)) => Some(f.saturating_sub(a)),
                _ => None,
            },
            e2e_ns: match (e.arrival_ns, end_ns, status) {
                (Some(a), Some(t), Some(TerminalStatus::Completed)) => Some(t.saturating_sub(a)),
                _ => None,
            },
            trail: match e.terminal_at {
                Some((at, r)) => {
                    Trail { last: Some(at), ring: e.ring.into_iter().collect(), last_ref: Some(r) }
                }
                None => Trail { last: e.last, ring: e.ring.into_iter().collect(), last_ref: e.last_ref },
            },
        };
        self.fresh_requests.push((request, done));
        for h in e.handoffs {
            if let Some(o) = self.open_handoffs.get_mut(&h) {
                o.request_finished = true;
            }
            self.try_finish_handoff(h);
        }
    }

    fn try_finish_handoff(&mut self, h: HandoffId) {
        if self.open_handoffs.get(&h).is_some_and(|o| o.roles.iter().any(|p| !p.ended)) {
            return;
        }
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
        let Some(o) = self.open_handoffs.remove(&h) else {
            return;
        };
        let Some(e) = self.ledger.remove(&h) else {
            return;
        };
        self.finished_handoffs.insert(h);
        let key = match (o.request, o.attempt) {
            (Some(r), Some(n)) => HandoffKey::Request(r, n),
            _ => HandoffKey::Id(h),
        };
        let pin_ns = match (e.pinned_at_ns, e.source_released_at_ns) {
            (Some(p), Some(r)) => Some(r.saturating_sub(p)),
            _ => None,
        };
        self.fresh_handoffs.push((
            key,
            FinishedHandoff {
                sig: HandoffSignature::of(&e, &o),
                pin_ns,
                trail: Trail { last: o.last, ring: o.ring.into_iter().collect(), last_ref: o.last_ref },
            },
        ));
    }

    /// At the end of the log: everything still open finishes as it is.
    fn finish_all(&mut self) {
        let mut reqs: Vec<RequestId> = self.open_requests.keys().copied().collect();
        reqs.sort();
        for r in reqs {
            if let Some(e) = self.open_requests.remove(&r) {
                self.finish_request(r, e, None, None, None);
            }
        }
        let mut hs: Vec<HandoffId> = self.open_handoffs.keys().copied().collect();
        hs.sort();
        for h in hs {
            self.finish_handoff(h);
        }
    }

    pub(super) fn awaiting(&self) -> usize {
        self.awaiting_handoffs.len() + self.awaiting_requests.len()
    }
}

/// Matches what `x` just finished against what `y` is waiting with.
pub(super) fn match_finished(x: &mut EntitySide, y: &mut EntitySide, x_is_a: bool, findings: &mut Findings) {
    for (k, d) in std::mem::take(&mut x.fresh_handoffs) {
        match y.awaiting_handoffs.remove(&k) {
            Some(other) => {
                let (da, db) = if x_is_a { (&d, &other) } else { (&other, &d) };
                report_handoff(findings, &k, Some(da), Some(db));
            }
            None => {
                x.awaiting_handoffs.insert(k, d);
            }
        }
    }
    for (k, d) in std::mem::take(&mut x.fresh_requests) {
        match y.awaiting_requests.remove(&k) {
            Some(other) => {
                let (da, db) = if x_is_a { (&d, &other) } else { (&other, &d) };
                report_request(findings, k, Some(da), Some(db));
            }
            None => {
                x.awaiting_requests.insert(k, d);
            }
        }
    }
}

pub(super) fn report_handoff(
    findings: &mut Findings,
    k: &HandoffKey,
    a: Option<&FinishedHandoff>,
    b: Option<&FinishedHandoff>,
) {
    let subject = k.to_string();
    let detail = match (a, b) {
        (Some(a), Some(b)) => {
            findings.compared.handoffs += 1;
            findings.timing(&subject, "source pinned", a.pin_ns, b.pin_ns, &a.trail.last, &b.trail.last);
            if a.sig == b.sig {
                return;
            }
            a.sig.differences(&b.sig)
        }
        (Some(a), None) => format!("only in A: [{}]", Milestone::join(&a.sig.normalized, ", ")),
        (None, Some(b)) => format!("only in B: [{}]", Milestone::join(&b.sig.normalized, ", ")),
        (None, None) => return,
    };
    let (a, b) = (a.map(|d| &d.trail), b.map(|d| &d.trail));
    findings.add(Trail::candidate(DiffKind::HandoffSequence, subject, a, b, detail));
}

pub(super) fn report_request(
    findings: &mut Findings,
    k: RequestId,
    a: Option<&FinishedRequest>,
    b: Option<&FinishedRequest>,
) {
    let subject = format!("request {k}");
    let detail = match (a, b) {
        (Some(a), Some(b)) => {
            findings.compared.requests += 1;
            findings.timing(&subject, "TTFT", a.ttft_ns, b.ttft_ns, &a.trail.last, &b.trail.last);
            findings.timing(&subject, "E2E", a.e2e_ns, b.e2e_ns, &a.trail.last, &b.trail.last);
            if a.sig == b.sig {
                return;
            }
            a.sig.differences(&b.sig)
        }
        (Some(_), None) => "only in A".to_string(),
        (None, Some(_)) => "only in B".to_string(),
        (None, None) => return,
    };
    let (a, b) = (a.map(|d| &d.trail), b.map(|d| &d.trail));
    findings.add(Trail::candidate(DiffKind::RequestOutcome, subject, a, b, detail));
}
