//! Pass one: the streaming fold. Every engine worker's physical KV and scheduler queues (the
//! shared [`WorkerFold`]), the router's bookings (the shared [`BookingFold`]) and the peaks are
//! folded here, record by record, and settled instant by instant; the findings built on them (cascade, bookings, handoff waits,
//! decode stalls) keep their own state in their own modules and are called from here.

use super::bookings::BookingWatch;
use super::cascade::{CascadeWatch, PrefillAdmission};
use super::longest_pinned::TopPin;
use super::lost::LossWatch;
use super::report::{Bookings, GatingWorker, InspectReport, PeakAt, RunInfo, WorkerInfo, WorkerPeaks};
use super::wait_breakdown::HandoffWatch;
use super::InspectOptions;
use crate::events::{Fact, Record, RejectReason, StreamHeader};
use crate::ids::{Role, WorkerId};
use crate::model::capacity::KvCapacitySnapshot;
use crate::model::view::SchedulerView;
use crate::projections::bookings::{booked_worker, BookingFold};
use crate::projections::decode_stalls::{DecodeHolBlocking, DecodeWatch, PreemptionStorms};
use crate::projections::run::ProjectError;
use crate::projections::worker::{WorkerFold, WorkerViolation};
use crate::units::ms;

/// One engine worker's folded state.
pub(super) struct WorkerState {
    pub(super) worker: WorkerId,
    /// Capacity and queues, as every command folds them.
    fold: WorkerFold,
    /// The scheduler view, recomputed at a settled instant only if the stream changed.
    pub(super) view: SchedulerView,
    dirty: bool,
    peaks: WorkerPeaks,
    /// Prefill admission: queued requests and the stalls they make (prefill workers only).
    pub(super) admission: PrefillAdmission,
    /// Decode: a reservation refused in the current instant (pressure).
    pub(super) refused_now: bool,
    /// Router bookings on this worker beside its occupancy.
    bookings: BookingWatch,
    gating_handoffs: u64,
    gating_pending_ns: u64,
    /// Preemption storms and head-of-line blocking (decode and aggregated workers only).
    decode: Option<DecodeWatch>,
}

impl WorkerState {
    fn new(h: &StreamHeader, opts: &InspectOptions) -> Self {
        let total = h.engine.total_blocks as u64;
        WorkerState {
            worker: h.worker,
            fold: WorkerFold::new(h),
            view: SchedulerView::default(),
            dirty: false,
            peaks: WorkerPeaks {
                worker: h.worker,
                total_blocks: total,
                active: PeakAt::default(),
                pinned_source: PeakAt::default(),
                reserved_destination: PeakAt::default(),
                kv_used: PeakAt::default(),
                waiting: PeakAt::default(),
                running: PeakAt::default(),
                held_prefills: PeakAt::default(),
                pending_reservations: PeakAt::default(),
            },
            admission: PrefillAdmission::default(),
            refused_now: false,
            bookings: BookingWatch::new(h.worker, total),
            gating_handoffs: 0,
            gating_pending_ns: 0,
            decode: matches!(h.worker.role, Role::Decode | Role::Aggregated).then(|| {
                DecodeWatch::new(h.worker, opts.storm_preemptions, opts.storm_window_ms, opts.stall_ms)
            }),
        }
    }

    pub(super) fn total(&self) -> u64 {
        self.fold.capacity.total_blocks
    }

    /// Physical KV now.
    pub(super) fn cap(&self) -> KvCapacitySnapshot {
        self.fold.capacity
    }

    /// Recomputes the scheduler view if a fact changed it since.
    fn refresh_view(&mut self) {
        if self.dirty {
            self.view = self.fold.view();
            self.dirty = false;
        }
    }

    /// Peaks of the state settled at `t` (it holds until `next`).
    fn see_peaks(&mut self, t: u64, next: u64) {
        let (c, v) = (self.cap(), self.view);
        let p = &mut self.peaks;
        p.active.see(c.active_blocks, t);
        p.pinned_source.see(c.pinned_source_blocks, t);
        p.reserved_destination.see(c.reserved_destination_blocks, t);
        p.kv_used.see(c.kv_used_blocks(), t);
        p.waiting.see(v.waiting, t);
        p.running.see(v.running, t);
        p.held_prefills.see(v.held_prefills, t);
        p.pending_reservations.see(v.pending_reservations, t);
        if v.pending_reservations > 0 {
            self.gating_pending_ns += next.saturating_sub(t);
        }
    }
}

/// The streaming fold of pass one. Feed it every record of a run in merge order.
pub struct InspectFold {
    opts: InspectOptions,
    headers: Vec<StreamHeader>,
    workers: Vec<Option<WorkerState>>,
    /// The router's bookings, per worker and request.
    bookings: BookingFold,
    now_ns: Option<u64>,
    first_ns: Option<u64>,
    records: u64,
    /// Decode-pressure episodes and the stranding cascade.
    cascade: CascadeWatch,
    /// Per-handoff milestones while unfinished, and what finished ones add up to.
    handoffs: HandoffWatch,
    /// What workers that stopped mid-run left their peers and the router to end.
    pub(super) losses: LossWatch,
}

impl InspectFold {
    pub fn new(headers: &[StreamHeader], opts: InspectOptions) -> Self {
        let workers = headers
            .iter()
            .map(|h| (h.worker.role != Role::Router).then(|| WorkerState::new(h, &opts)))
            .collect();
        InspectFold {
            opts,
            headers: headers.to_vec(),
            workers,
            bookings: BookingFold::new(),
            now_ns: None,
            first_ns: None,
            records: 0,
            cascade: CascadeWatch::default(),
            handoffs: HandoffWatch::new(opts.top_n),
            losses: LossWatch::default(),
        }
    }

    fn index_of(&self, w: WorkerId) -> Option<usize> {
        self.headers.iter().position(|h| h.worker == w)
    }

    /// The state of worker `w`'s stream (`None` for the router or an unknown worker).
    fn worker_mut(&mut self, w: WorkerId) -> Option<&mut WorkerState> {
        let i = self.index_of(w)?;
        self.workers[i].as_mut()
    }

    /// Moves the fold's clock to `at_ns`: if time advanced, the state of the previous instant
    /// is settled (judged, and its queue counts refreshed) and that instant is returned. `apply`
    /// calls it; a caller that samples settled states calls it first, samples, then applies.
    pub fn advance(&mut self, at_ns: u64) -> Option<u64> {
        self.first_ns.get_or_insert(at_ns);
        match self.now_ns {
            Some(now) if at_ns > now => {
                self.settle(now, at_ns);
                self.now_ns = Some(at_ns);
                Some(now)
            }
            None => {
                self.now_ns = Some(at_ns);
                None
            }
            _ => None,
        }
    }

    /// The last instant seen.
    pub fn now_ns(&self) -> Option<u64> {
        self.now_ns
    }

    /// An engine stream's current physical KV, queue counts and router-booked blocks (`None`
    /// for the router stream).
    pub fn worker_state(&mut self, stream: usize) -> Option<(KvCapacitySnapshot, SchedulerView, u64)> {
        let ws = self.workers.get_mut(stream)?.as_mut()?;
        ws.refresh_view();
        Some((ws.cap(), ws.view, ws.bookings.booked_blocks()))
    }

    /// Applies one record of stream `stream` (an index into the run's headers).
    pub fn apply(&mut self, stream: usize, rec: &Record) -> Result<(), ProjectError> {
        let Some(header) = self.headers.get(stream) else {
            return Ok(());
        };
        let worker = header.worker;
        self.records += 1;
        self.advance(rec.at_ns);
        let at = rec.at_ns;
        if let Some(ws) = self.workers[stream].as_mut() {
            let change = ws.fold.apply(rec).map_err(|v| ProjectError::located(worker, rec, v))?;
            ws.dirty |= change.queues;
            if let Some(d) = ws.decode.as_mut() {
                d.apply(at, &rec.fact);
            }
            match &rec.fact {
                Fact::RequestQueued { request } | Fact::RequestPreempted { request, .. }
                    if worker.role == Role::Prefill =>
                {
                    ws.admission.queue(*request, at);
                }
                Fact::RequestScheduled { request, .. }
                | Fact::RequestFinished { request, .. }
                | Fact::RequestRejected { request, .. } => ws.admission.unqueue(request),
                Fact::ReservationRefused {
                    reason: RejectReason::NoCapacity | RejectReason::NoSlot, ..
                } => {
                    ws.refused_now = true;
                }
                _ => {}
            }
        }
        self.losses.apply(worker, at, &rec.fact);
        self.cascade.count_reservation(worker, &rec.fact);
        if let Some(w) = booked_worker(&rec.fact) {
            self.bookings
                .apply(&rec.fact)
                .map_err(|v| ProjectError::located(worker, rec, WorkerViolation::Booking(v)))?;
            let booked = self.bookings.load(w).booked_blocks();
            if let Some(ws) = self.worker_mut(w) {
                ws.bookings.set_booked_blocks(booked);
            }
        }
        if self.handoffs.apply(worker, at, &rec.fact) {
            // The handoff's reservation queued ahead of its prefill: gated on this worker.
            if let Some(ws) = self.worker_mut(worker) {
                ws.gating_handoffs += 1;
            }
        }
        Ok(())
    }

    /// The state after the last record at `t` holds over `[t, next)`: judge it.
    fn settle(&mut self, t: u64, next: u64) {
        let opts = self.opts;
        for ws in self.workers.iter_mut().flatten() {
            ws.refresh_view();
        }
        // Decode pressure (cluster level), judged first so an episode that starts at `t` can
        // trigger a stall that starts at `t`.
        self.cascade.settle_pressure(&mut self.workers, &opts, t);
        for ws in self.workers.iter_mut().flatten() {
            ws.see_peaks(t, next);
            ws.bookings.settle(ws.worker.role, &ws.fold.capacity, t, next);
            if let Some(d) = ws.decode.as_mut() {
                d.settle(t, &ws.fold.capacity, ws.view.waiting);
            }
            if ws.worker.role == Role::Prefill {
                self.cascade.settle_stall(ws, &opts, t, next);
            }
        }
    }

    /// Ends the fold at the last record's instant: closes open stalls, stretches and handoffs
    /// (unfinished ones count as in flight) and returns the report, whose `longest_pinned`
    /// still lacks timelines, plus the longest pins, longest first.
    pub fn finish(mut self) -> (InspectReport, Vec<TopPin>) {
        let end = self.now_ns.unwrap_or(0);
        self.settle(end, end);
        self.handoffs.finish_open(end);
        let mut peaks = Vec::new();
        let mut booking_rows = Vec::new();
        let mut divergences = Vec::new();
        let mut divergences_dropped = 0;
        let mut intervals = Vec::new();
        let mut intervals_dropped = 0;
        let mut gating_workers = Vec::new();
        let mut preemption_storms = PreemptionStorms::default();
        let mut decode_hol_blocking = DecodeHolBlocking::default();
        let mut workers_info = Vec::new();
        for (h, ws) in self.headers.iter().zip(self.workers.iter_mut()) {
            workers_info.push(WorkerInfo {
                worker: h.worker,
                total_blocks: h.engine.total_blocks,
                block_size: h.engine.block_size,
            });
            let Some(ws) = ws.as_mut() else {
                continue;
            };
            let (mut stalls, stalls_dropped) = ws.admission.finish(ws.worker, end);
            if let Some(d) = ws.decode.as_mut() {
                d.finish(end, &mut preemption_storms, &mut decode_hol_blocking);
            }
            let (row, mut worker_divergences, worker_dropped) = ws.bookings.finish(end);
            peaks.push(ws.peaks.clone());
            booking_rows.push(row);
            divergences.append(&mut worker_divergences);
            divergences_dropped += worker_dropped;
            intervals.append(&mut stalls);
            intervals_dropped += stalls_dropped;
            if ws.gating_handoffs > 0 {
                gating_workers.push(GatingWorker {
                    worker: ws.worker,
                    handoffs: ws.gating_handoffs,
                    peak_pending: ws.peaks.pending_reservations.value,
                    peak_pending_at_ms: ws.peaks.pending_reservations.at_ms,
                    pending_ms: ms(ws.gating_pending_ns),
                });
            }
        }
        divergences.sort_by(|a, b| {
            (a.worker, a.kind).cmp(&(b.worker, b.kind)).then(a.started_at_ms.total_cmp(&b.started_at_ms))
        });
        let cascade = self.cascade.report(&self.opts, intervals, intervals_dropped);
        let (gating, wait_breakdown, top) = self.handoffs.report(gating_workers);

        let first = self.headers.first();
        let report = InspectReport {
            run: RunInfo {
                run_id: first.map(|h| h.run_id.to_string()).unwrap_or_default(),
                backend: first.map(|h| h.backend.as_str().to_string()).unwrap_or_default(),
                policy: first.map(|h| h.policy.as_str().to_string()).unwrap_or_default(),
                seed: first.map(|h| h.seed).unwrap_or(0),
                workers: workers_info,
                records: self.records,
                first_at_ms: ms(self.first_ns.unwrap_or(0)),
                last_at_ms: ms(end),
            },
            options: self.opts,
            cascade,
            gating,
            preemption_storms,
            decode_hol_blocking,
            peaks,
            longest_pinned: Vec::new(),
            wait_breakdown,
            bookings: Bookings {
                workers: booking_rows,
                divergences,
                divergences_not_shown: divergences_dropped,
            },
            workers_lost: Vec::new(),
            unended: Vec::new(),
        };
        (report, top)
    }
}
