//! Serving metrics and stranding figures, folded from a run's streams.
//!
//! The replay feeds this fold the records it writes, as it writes them; `handoff-log project
//! RUN metrics` feeds it the same records read back in merge order. The fold only relies on
//! order *within* a stream and on the router's terminal fact coming after the engine facts of
//! the same instant (true in both orders), so both give the same report.
//!
//! Where figures come from:
//! * arrival and terminal outcome: the router stream (`RequestArrived`, `RequestFinished`);
//! * TTFT: the first `FirstTokenEmitted` on a decode or aggregated stream (a prefill worker's
//!   own token is not the user's first token: decode produces it after activation);
//! * ITL: every decode step's duration, weighted by the tokens it produced for requests past
//!   their first token (a request's consecutive tokens are one step apart while it runs);
//! * TPOT: per request `(terminal − first token) / (output − 1)`;
//! * prefix reuse: `cached_tokens` of each request's first scheduling on a prefill or
//!   aggregated stream;
//! * stranding: pinned-block integral per prefill worker, pin durations, and the waits from
//!   prefill done to destination reserved and from reservation queued to reserved;
//! * goodput (with an [`Slo`]): completed requests that met every given threshold, checked as
//!   each request ends, so a replay and a later fold of its logs agree.
//! * worker-seconds: per role, each worker stream's span from its first `SessionStarted` (its
//!   join) to its `WorkerLeft` (or the end), within the run's duration (first arrival to last
//!   terminal outcome).
//!
//! Memory grows with requests in flight: finished requests leave the fold (optionally through a
//! per-request sink) and distributions have bounded buckets.
//!
//! The fold is here; `slo` parses and judges latency objectives, `per_request` holds the
//! per-request record, `report` the report and its flat JSON.

mod per_request;
mod report;
mod slo;

pub use per_request::{request_uuid, PerRequest, PerRequestSink};
pub use report::MetricsReport;
pub use slo::{Slo, SLO_KEYS};

use crate::events::{Fact, Record, StreamHeader, TerminalStatus};
use crate::ids::{HandoffId, RequestId, Role, WorkerId, WorkerSlots};
use crate::projections::distribution::Distribution;
use crate::units::{ms, NS_PER_MS_F64};
use std::collections::BTreeMap;

#[derive(Clone, Debug, Default)]
struct InFlight {
    arrival_ns: u64,
    input: u32,
    requested_output: u32,
    first_token_ns: Option<u64>,
    reused_tokens: Option<u32>,
    prefill_worker: Option<u32>,
    decode_worker: Option<u32>,
    handoff: Option<HandoffId>,
    prefill_admit_ns: Option<u64>,
    decode_admit_ns: Option<u64>,
    source_held_ns: Option<u64>,
    reserved_ns: Option<u64>,
    activated_ns: Option<u64>,
    released_ns: Option<u64>,
    /// Order of arrival (per-request lines are written in it).
    arrival_seq: u64,
    /// The first fact that said why the request would not complete.
    reason: Option<&'static str>,
    preemptions: u32,
    stall_ns: u64,
    receive_started_ns: Option<u64>,
    transfer_ns: Option<u64>,
    transfer_queued_ns: Option<u64>,
}

#[derive(Clone, Debug, Default)]
struct StreamState {
    role: Option<Role>,
    /// Pinned blocks now and since when (for the block-seconds integral).
    pinned_blocks: u64,
    pinned_since_ns: u64,
    pinned_block_ns: u128,
    /// A decode step whose ITL weight waits for the first tokens of the same instant.
    pending_step: Option<(u64, u64, u64)>, // (at_ns, duration_ns, decode_tokens)
    first_tokens_at: (u64, u64), // (at_ns, count)
    /// Requests first scheduled by the step whose facts carry this instant: an admission is
    /// stamped with the step's *end* (as every step fact is), so it is moved back by the step's
    /// duration when the step's `StepExecuted` comes (a scheduling with no step stays as is).
    admitted_at: (u64, Vec<RequestId>),
    /// The worker's join (its first `SessionStarted`) and leave (`WorkerLeft`).
    joined_ns: Option<u64>,
    left_ns: Option<u64>,
}

/// The fold.
#[derive(Default)]
pub struct MetricsFold {
    run_seed: u64,
    /// Per-stream state, sorted by worker (looked up once per record: see `stream_index`).
    streams: Vec<(WorkerId, StreamState)>,
    /// Where each worker is in `streams`.
    slots: WorkerSlots,
    in_flight: BTreeMap<RequestId, InFlight>,
    handoff_request: BTreeMap<HandoffId, RequestId>,
    arrivals: u64,
    /// Ended requests' records not yet written: by arrival order, with the handoff whose
    /// source release they still wait for (a record is written once every earlier arrival's
    /// is, so the lines come in arrival order).
    finished: BTreeMap<u64, (PerRequest, Option<HandoffId>)>,
    awaiting_release: BTreeMap<HandoffId, u64>,
    next_record: u64,
    reasons: BTreeMap<&'static str, u64>,
    stall: Distribution,
    pin_started: BTreeMap<HandoffId, u64>,
    queued_at: BTreeMap<HandoffId, u64>,
    first_arrival_ns: Option<u64>,
    last_terminal_ns: u64,
    num_requests: u64,
    by_status: BTreeMap<&'static str, u64>,
    total_input_tokens: u64,
    total_output_tokens: u64,
    completed_input_tokens: u64,
    reused_tokens: u64,
    scheduled_input_tokens: u64,
    ttft: Distribution,
    tpot: Distribution,
    itl: Distribution,
    e2e: Distribution,
    per_user_tok_s_milli: Distribution,
    pin: Distribution,
    pinned_to_reserved: Distribution,
    reservation_wait: Distribution,
    handoffs_started: u64,
    leases_expired: u64,
    reservations_expired: u64,
    handoffs_canceled: u64,
    sink: Option<PerRequestSink>,
    slo: Slo,
    /// Completed requests that met every threshold of `slo`.
    slo_met: u64,
}

/// Most ended requests' records held back to keep arrival order (see `write_records_upto`).
const MAX_HELD_RECORDS: usize = 1 << 16;

impl MetricsFold {
    pub fn new() -> Self {
        Self::default()
    }

    /// Calls `sink` with each request's figures when it ends (for `--per-request`).
    pub fn with_sink(mut self, sink: PerRequestSink) -> Self {
        self.sink = Some(sink);
        self
    }

    /// Judges every completed request against `slo` for goodput (an empty one: no goodput).
    pub fn with_slo(mut self, slo: Slo) -> Self {
        self.slo = slo;
        self
    }

    /// TTFT of completed requests so far, ns.
    pub fn ttft_distribution(&self) -> &Distribution {
        &self.ttft
    }

    /// E2E latency of completed requests so far, ns.
    pub fn e2e_distribution(&self) -> &Distribution {
        &self.e2e
    }

    /// Registers a stream before its records arrive.
    pub fn add_stream(&mut self, header: &StreamHeader) {
        self.run_seed = header.seed;
        let i = self.stream_index(header.worker);
        self.streams[i].1.role = Some(header.worker.role);
    }

    /// Where `worker`'s state is, added if new (kept sorted by worker, so the report sums
    /// streams in one order however they arrived).
    #[inline]
    fn stream_index(&mut self, worker: WorkerId) -> usize {
        if let Some(i) = self.slots.get(worker) {
            return i;
        }
        let i = match self.streams.binary_search_by_key(&worker, |(w, _)| *w) {
            Ok(i) => i,
            Err(i) => {
                self.streams.insert(i, (worker, StreamState::default()));
                i
            }
        };
        self.slots.rebuild(self.streams.iter().map(|(w, _)| *w));
        i
    }

    pub fn apply(&mut self, worker: WorkerId, rec: &Record) {
        let at = rec.at_ns;
        let si = self.stream_index(worker);
        let st = &mut self.streams[si].1;
        let role = worker.role;
        // Flush a pending decode step once time moves on in its stream.
        if let Some((step_at, dur, toks)) = st.pending_step {
            if at > step_at {
                let firsts = if st.first_tokens_at.0 == step_at { st.first_tokens_at.1 } else { 0 };
                self.itl.add_weighted(dur, toks.saturating_sub(firsts));
                st.pending_step = None;
            }
        }
        // Pinned-block integral on prefill streams.
        let kv = rec.fact.kv_delta();
        if kv.pinned_source != 0 {
            st.pinned_block_ns += st.pinned_blocks as u128 * (at.saturating_sub(st.pinned_since_ns)) as u128;
            st.pinned_blocks = (st.pinned_blocks as i64 + kv.pinned_source as i64).max(0) as u64;
            st.pinned_since_ns = at;
        }
        match &rec.fact {
            Fact::RequestArrived { request, input_tokens, output_tokens } if role == Role::Router => {
                self.num_requests += 1;
                self.total_input_tokens += *input_tokens as u64;
                self.first_arrival_ns = Some(self.first_arrival_ns.map_or(at, |f| f.min(at)));
                self.in_flight.insert(
                    *request,
                    InFlight {
                        arrival_ns: at,
                        input: *input_tokens,
                        requested_output: *output_tokens,
                        arrival_seq: self.arrivals,
                        ..Default::default()
                    },
                );
                self.arrivals += 1;
            }
            Fact::PrefillBooked { request, worker: w, .. } => {
                if let Some(r) = self.in_flight.get_mut(request) {
                    r.prefill_worker = Some(w.index);
                }
            }
            Fact::SessionStarted { .. } => {
                // A restart starts a new session on a worker that never left.
                self.streams[si].1.joined_ns.get_or_insert(at);
            }
            Fact::WorkerLeft { .. } => {
                self.streams[si].1.left_ns = Some(at);
            }
            Fact::DecodeBooked { request, worker: w, .. } => {
                if let Some(r) = self.in_flight.get_mut(request) {
                    r.decode_worker = Some(w.index);
                }
            }
            Fact::RequestScheduled { request, cached_tokens, .. }
                if matches!(role, Role::Prefill | Role::Aggregated) =>
            {
                if let Some(r) = self.in_flight.get_mut(request) {
                    if r.reused_tokens.is_none() {
                        r.reused_tokens = Some(*cached_tokens);
                        r.prefill_admit_ns = Some(at);
                        self.reused_tokens += *cached_tokens as u64;
                        self.scheduled_input_tokens += r.input as u64;
                        Self::note_admitted(&mut self.streams[si].1, at, *request);
                    }
                }
            }
            Fact::RequestScheduled { request, .. } if role == Role::Decode => {
                if let Some(r) = self.in_flight.get_mut(request) {
                    if r.decode_admit_ns.is_none() {
                        r.decode_admit_ns = Some(at);
                        Self::note_admitted(&mut self.streams[si].1, at, *request);
                    }
                }
            }
            Fact::RequestPreempted { request, .. } if matches!(role, Role::Decode | Role::Aggregated) => {
                if let Some(r) = self.in_flight.get_mut(request) {
                    r.preemptions += 1;
                }
            }
            Fact::DecodeResumed { request, stalled_ns }
                if matches!(role, Role::Decode | Role::Aggregated) =>
            {
                // The token after a stall is an inter-token gap like any other.
                self.itl.add(*stalled_ns);
                self.stall.add(*stalled_ns);
                if let Some(r) = self.in_flight.get_mut(request) {
                    r.stall_ns = r.stall_ns.saturating_add(*stalled_ns);
                }
            }
            Fact::RequestRejected { request, reason } => {
                if let Some(r) = self.in_flight.get_mut(request) {
                    r.reason.get_or_insert(reason.as_str());
                }
            }
            Fact::FirstTokenEmitted { request } if matches!(role, Role::Decode | Role::Aggregated) => {
                let st = &mut self.streams[si].1;
                if st.first_tokens_at.0 == at {
                    st.first_tokens_at.1 += 1;
                } else {
                    st.first_tokens_at = (at, 1);
                }
                if let Some(r) = self.in_flight.get_mut(request) {
                    r.first_token_ns.get_or_insert(at);
                }
            }
            Fact::StepExecuted { decode_tokens, duration_ns, .. } => {
                let st = &mut self.streams[si].1;
                if st.admitted_at.0 == at {
                    // These admissions happened when this step began.
                    for q in st.admitted_at.1.drain(..) {
                        if let Some(r) = self.in_flight.get_mut(&q) {
                            let admit = if role == Role::Decode {
                                &mut r.decode_admit_ns
                            } else {
                                &mut r.prefill_admit_ns
                            };
                            *admit = admit.map(|a| a.saturating_sub(*duration_ns));
                        }
                    }
                }
                if matches!(role, Role::Decode | Role::Aggregated) && *decode_tokens > 0 {
                    st.pending_step = Some((at, *duration_ns, *decode_tokens as u64));
                }
            }
            Fact::HandoffStarted { handoff, request, .. } => {
                if self.handoff_request.insert(*handoff, *request).is_none() {
                    self.handoffs_started += 1;
                }
                if let Some(r) = self.in_flight.get_mut(request) {
                    r.handoff = Some(*handoff);
                }
            }
            Fact::SourcePinned { handoff, request, .. } => {
                self.pin_started.insert(*handoff, at);
                if let Some(r) = self.in_flight.get_mut(request) {
                    r.source_held_ns.get_or_insert(at);
                }
            }
            Fact::ReservationQueued { handoff } => {
                self.queued_at.entry(*handoff).or_insert(at);
            }
            Fact::DestinationReserved { handoff, request, .. } => {
                if let Some(q) = self.queued_at.remove(handoff) {
                    self.reservation_wait.add(at.saturating_sub(q));
                }
                if let Some(p) = self.pin_started.get(handoff) {
                    self.pinned_to_reserved.add(at.saturating_sub(*p));
                }
                if let Some(r) = self.in_flight.get_mut(request) {
                    r.reserved_ns.get_or_insert(at);
                }
            }
            Fact::ReservationDequeued { handoff, .. } => {
                self.queued_at.remove(handoff);
            }
            Fact::DestinationActivated { handoff, .. } => {
                if let Some(r) = self.handoff_request.get(handoff).and_then(|q| self.in_flight.get_mut(q)) {
                    r.activated_ns.get_or_insert(at);
                }
            }
            Fact::SourceReleased { handoff, .. } => {
                if let Some(p) = self.pin_started.remove(handoff) {
                    self.pin.add(at.saturating_sub(p));
                }
                if let Some(q) = self.handoff_request.get(handoff).copied() {
                    match self.in_flight.get_mut(&q) {
                        Some(r) => {
                            r.released_ns.get_or_insert(at);
                        }
                        // The request already ended; its handoff's last fact is this release.
                        None => {
                            self.handoff_request.remove(handoff);
                        }
                    }
                }
                if let Some(seq) = self.awaiting_release.remove(handoff) {
                    if let Some((rec, waits)) = self.finished.get_mut(&seq) {
                        rec.source_released_ms.get_or_insert(ms(at));
                        *waits = None;
                    }
                    self.write_records();
                }
            }
            Fact::ReceiveStarted { handoff, .. } => {
                if let Some(r) = self.handoff_request.get(handoff).and_then(|q| self.in_flight.get_mut(q)) {
                    r.receive_started_ns.get_or_insert(at);
                }
            }
            Fact::ReceiveCompleted { handoff } => {
                if let Some(r) = self.handoff_request.get(handoff).and_then(|q| self.in_flight.get_mut(q)) {
                    r.transfer_ns = r.receive_started_ns.map(|t| at.saturating_sub(t));
                }
            }
            Fact::TransferTiming { handoff, queued_ns, .. } => {
                if let Some(r) = self.handoff_request.get(handoff).and_then(|q| self.in_flight.get_mut(q)) {
                    r.transfer_queued_ns = Some(*queued_ns);
                }
            }
            Fact::LeaseExpired { handoff, .. } => {
                self.leases_expired += 1;
                self.note_reason(*handoff, "lease-expired");
            }
            Fact::ReservationExpired { handoff, .. } => {
                self.reservations_expired += 1;
                self.note_reason(*handoff, "reservation-expired");
            }
            Fact::HandoffCanceled { handoff, reason } => {
                self.handoffs_canceled += 1;
                self.note_reason(*handoff, reason.as_str());
            }
            Fact::RequestFinished { request, status, output_tokens, .. } if role == Role::Router => {
                self.finish(*request, *status, *output_tokens, at);
            }
            _ => {}
        }
    }

    /// A request admitted by the step whose facts carry instant `at` (see `admitted_at`).
    fn note_admitted(st: &mut StreamState, at: u64, request: RequestId) {
        if st.admitted_at.0 != at {
            st.admitted_at.0 = at;
            st.admitted_at.1.clear();
        }
        st.admitted_at.1.push(request);
    }

    /// Keeps the first reason a handoff gave for its request not completing.
    fn note_reason(&mut self, handoff: HandoffId, reason: &'static str) {
        if let Some(r) = self.handoff_request.get(&handoff).and_then(|q| self.in_flight.get_mut(q)) {
            r.reason.get_or_insert(reason);
        }
    }

    /// Writes every finished record whose turn (arrival order) has come and that waits for
    /// nothing; with `all`, the rest too, in arrival order (the run is over).
    fn write_records_upto(&mut self, all: bool) {
        loop {
            // A request that never ends must not hold every later record in memory: past the
            // bound the oldest record goes out of turn.
            let full = self.finished.len() > MAX_HELD_RECORDS;
            let Some(entry) = self.finished.first_entry() else { return };
            let (seq, waits) = (*entry.key(), entry.get().1);
            let earlier_in_flight = seq != self.next_record;
            if !all && !full && (earlier_in_flight || waits.is_some()) {
                return;
            }
            let (rec, waits) = entry.remove();
            if let Some(h) = waits {
                self.awaiting_release.remove(&h);
            }
            self.next_record = seq + 1;
            if let Some(sink) = self.sink.as_mut() {
                sink(&rec);
            }
        }
    }

    fn write_records(&mut self) {
        self.write_records_upto(false);
    }

    fn finish(&mut self, request: RequestId, status: TerminalStatus, output_tokens: u32, at: u64) {
        let Some(r) = self.in_flight.remove(&request) else {
            return;
        };
        // A source still pinned when its request ends is released later: the record waits
        // for that release so that `source_released_ms` is filled in.
        let mut waits_for = None;
        if let Some(h) = r.handoff {
            // The handoff's figures are complete once its request ends; later source releases
            // (rare: a lease outliving a failed request) still count in the pin statistics.
            if r.released_ns.is_some() {
                self.handoff_request.remove(&h);
            } else if r.source_held_ns.is_some() && self.pin_started.contains_key(&h) {
                waits_for = Some(h);
            }
            self.queued_at.remove(&h);
        }
        *self.by_status.entry(status.as_str()).or_insert(0) += 1;
        let reason = match status {
            TerminalStatus::Completed => "completed",
            _ => r.reason.unwrap_or(status.as_str()),
        };
        *self.reasons.entry(reason).or_insert(0) += 1;
        self.last_terminal_ns = self.last_terminal_ns.max(at);
        let mut out = PerRequest {
            uuid: request_uuid(self.run_seed, request).to_string(),
            request_id: request.0,
            arrival_time_ms: ms(r.arrival_ns),
            first_token_ms: r.first_token_ns.map(ms),
            terminal_time_ms: Some(ms(at)),
            input_length: r.input,
            requested_output_length: r.requested_output,
            output_length: output_tokens,
            reused_input_tokens: r.reused_tokens.unwrap_or(0),
            prefill_worker_idx: r.prefill_worker,
            decode_worker_idx: r.decode_worker,
            handoff_id: r.handoff.map(|h| h.to_string()),
            prefill_admit_ms: r.prefill_admit_ns.map(ms),
            source_held_ms: r.source_held_ns.map(ms),
            destination_reserved_ms: r.reserved_ns.map(ms),
            destination_activated_ms: r.activated_ns.map(ms),
            decode_admit_ms: r.decode_admit_ns.map(ms),
            source_released_ms: r.released_ns.map(ms),
            terminal_status: Some(status.as_str()),
            terminal_reason: Some(reason),
            preemptions: r.preemptions,
            transfer_ms: r.transfer_ns.map(ms),
            transfer_queued_ms: r.transfer_queued_ns.map(ms),
            stall_ms: ms(r.stall_ns),
            ..Default::default()
        };
        if status == TerminalStatus::Completed {
            self.total_output_tokens += output_tokens as u64;
            self.completed_input_tokens += r.input as u64;
            let e2e = at.saturating_sub(r.arrival_ns);
            self.e2e.add(e2e);
            out.e2e_latency_ms = Some(ms(e2e));
            let (mut ttft_ns, mut tpot_ns) = (None, None);
            if let Some(ft) = r.first_token_ns {
                let ttft = ft.saturating_sub(r.arrival_ns);
                self.ttft.add(ttft);
                out.ttft_ms = Some(ms(ttft));
                ttft_ns = Some(ttft);
                if output_tokens > 1 {
                    let tpot = at.saturating_sub(ft) / (output_tokens as u64 - 1);
                    self.tpot.add(tpot);
                    out.tpot_ms = Some(ms(tpot));
                    tpot_ns = Some(tpot);
                    if tpot > 0 {
                        // tokens/s per user, kept in milli-tokens/s for integer buckets.
                        self.per_user_tok_s_milli.add((1e12 / tpot as f64) as u64);
                    }
                }
            }
            if !self.slo.is_empty() && self.slo.met(ttft_ns, tpot_ns, e2e) {
                self.slo_met += 1;
            }
        }
        if self.sink.is_some() {
            if let Some(h) = waits_for {
                self.awaiting_release.insert(h, r.arrival_seq);
            }
            self.finished.insert(r.arrival_seq, (out, waits_for));
            self.write_records();
        }
    }

    /// Requests that arrived and have not ended.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The report as of the records seen so far.
    pub fn report(&mut self) -> MetricsReport {
        // The run is over: records still waiting (for a release that never came, or behind a
        // request that never ended) are written now, in arrival order.
        self.write_records_upto(true);
        // Flush pending decode steps: nothing later can change their weight.
        for (_, st) in self.streams.iter_mut() {
            if let Some((step_at, dur, toks)) = st.pending_step.take() {
                let firsts = if st.first_tokens_at.0 == step_at { st.first_tokens_at.1 } else { 0 };
                self.itl.add_weighted(dur, toks.saturating_sub(firsts));
            }
        }
        let end = self.last_terminal_ns;
        let duration_ns = end.saturating_sub(self.first_arrival_ns.unwrap_or(0));
        let secs = duration_ns as f64 / 1e9;
        let per_s = |v: u64| if secs > 0.0 { v as f64 / secs } else { 0.0 };
        let completed = *self.by_status.get("completed").unwrap_or(&0);
        let start = self.first_arrival_ns.unwrap_or(0);
        let mut worker_ns = [0u128; 3];
        for (w, st) in &self.streams {
            let role = st.role.unwrap_or(w.role);
            let i = match role {
                Role::Prefill => 0,
                Role::Decode => 1,
                Role::Aggregated => 2,
                Role::Router => continue,
            };
            // A stream that never said when it joined was there from the start.
            let from = st.joined_ns.unwrap_or(0).max(start);
            let to = st.left_ns.unwrap_or(end).min(end);
            worker_ns[i] += u128::from(to.saturating_sub(from));
        }
        let worker_seconds = |i: usize| worker_ns[i] as f64 / 1e9;
        let mut pinned_block_seconds = BTreeMap::new();
        for (w, st) in &self.streams {
            if st.role == Some(Role::Prefill) || w.role == Role::Prefill {
                let open = st.pinned_blocks as u128 * end.saturating_sub(st.pinned_since_ns) as u128;
                pinned_block_seconds.insert(w.to_string(), (st.pinned_block_ns + open) as f64 / 1e9);
            }
        }
        MetricsReport {
            num_requests: self.num_requests,
            completed_requests: completed,
            rejected_requests: *self.by_status.get("rejected").unwrap_or(&0),
            failed_requests: *self.by_status.get("failed").unwrap_or(&0),
            canceled_requests: *self.by_status.get("canceled").unwrap_or(&0),
            total_input_tokens: self.total_input_tokens,
            total_output_tokens: self.total_output_tokens,
            duration_ms: ms(duration_ns),
            request_throughput_rps: per_s(completed),
            input_throughput_tok_s: per_s(self.completed_input_tokens),
            output_throughput_tok_s: per_s(self.total_output_tokens),
            total_throughput_tok_s: per_s(self.completed_input_tokens + self.total_output_tokens),
            prefix_cache_reused_ratio: if self.scheduled_input_tokens > 0 {
                self.reused_tokens as f64 / self.scheduled_input_tokens as f64
            } else {
                0.0
            },
            ttft_ms: self.ttft.stats(NS_PER_MS_F64),
            tpot_ms: self.tpot.stats(NS_PER_MS_F64),
            itl_ms: self.itl.stats(NS_PER_MS_F64),
            e2e_latency_ms: self.e2e.stats(NS_PER_MS_F64),
            output_token_throughput_per_user: self.per_user_tok_s_milli.stats(1e3),
            handoffs_started: self.handoffs_started,
            leases_expired: self.leases_expired,
            reservations_expired: self.reservations_expired,
            handoffs_canceled: self.handoffs_canceled,
            pinned_block_seconds,
            source_pin_ms: self.pin.stats(NS_PER_MS_F64),
            prefill_done_to_reserved_ms: self.pinned_to_reserved.stats(NS_PER_MS_F64),
            reservation_wait_ms: self.reservation_wait.stats(NS_PER_MS_F64),
            stall_ms: self.stall.stats(NS_PER_MS_F64),
            terminal_reasons: self.reasons.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            slo: (!self.slo.is_empty()).then_some(self.slo),
            goodput_rps: (!self.slo.is_empty()).then(|| per_s(self.slo_met)),
            goodput_fraction: (!self.slo.is_empty()).then(|| {
                if self.num_requests > 0 {
                    self.slo_met as f64 / self.num_requests as f64
                } else {
                    0.0
                }
            }),
            worker_seconds_prefill: worker_seconds(0),
            worker_seconds_decode: worker_seconds(1),
            worker_seconds_aggregated: worker_seconds(2),
        }
    }
}
