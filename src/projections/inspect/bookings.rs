//! Router bookings beside physical occupancy: the blocks the router booked on each worker
//! (from the shared [`crate::projections::bookings::BookingFold`]), their peaks and gaps against `kv_used`, a bounded series
//! of both, and the stretches during which they diverged (`overbooked`, `unbooked_pins`).

use super::report::{BookingPoint, BookingRow, Divergence, PeakAt, BOOKING_SERIES_BUCKETS};
use super::MAX_INTERVALS_PER_WORKER;
use crate::ids::{Role, WorkerId};
use crate::model::capacity::KvCapacitySnapshot;
use crate::projections::timeline::{Downsampler, Sample};
use crate::units::ms;

#[derive(Clone, Debug)]
struct OpenDivergence {
    start_ns: u64,
    worst: u64,
}

/// One worker's closed divergence stretches (the first [`MAX_INTERVALS_PER_WORKER`]; the
/// rest are counted).
#[derive(Default)]
struct Divergences {
    list: Vec<Divergence>,
    dropped: u64,
}

impl Divergences {
    /// Opens, extends or closes a divergence stretch of one kind on one worker.
    fn track(
        &mut self,
        slot: &mut Option<OpenDivergence>,
        worker: WorkerId,
        kind: &'static str,
        on: bool,
        value: u64,
        t: u64,
    ) {
        match (slot.as_mut(), on) {
            (Some(d), true) => d.worst = d.worst.max(value),
            (None, true) => *slot = Some(OpenDivergence { start_ns: t, worst: value }),
            (Some(_), false) => {
                if let Some(d) = slot.take() {
                    self.close(d, worker, kind, Some(t), t);
                }
            }
            (None, false) => {}
        }
    }

    fn close(
        &mut self,
        d: OpenDivergence,
        worker: WorkerId,
        kind: &'static str,
        end_ns: Option<u64>,
        run_end_ns: u64,
    ) {
        if self.list.len() >= MAX_INTERVALS_PER_WORKER {
            self.dropped += 1;
            return;
        }
        self.list.push(Divergence {
            worker,
            kind,
            started_at_ms: ms(d.start_ns),
            ended_at_ms: end_ns.map(ms),
            duration_ms: ms(end_ns.unwrap_or(run_end_ns).saturating_sub(d.start_ns)),
            worst_blocks: d.worst,
        });
    }
}

/// One engine worker's router bookings beside its occupancy.
pub(super) struct BookingWatch {
    worker: WorkerId,
    /// Router bookings on this worker, in blocks.
    booked_blocks: u64,
    series: Option<Downsampler<2>>,
    last_point: Option<[u64; 2]>,
    row: BookingRow,
    overbooked: Option<OpenDivergence>,
    unbooked: Option<OpenDivergence>,
    divergences: Divergences,
}

impl BookingWatch {
    pub(super) fn new(worker: WorkerId, total_blocks: u64) -> Self {
        BookingWatch {
            worker,
            booked_blocks: 0,
            series: None,
            last_point: None,
            row: BookingRow {
                worker,
                total_blocks,
                peak_booked: PeakAt::default(),
                peak_kv_used: PeakAt::default(),
                max_booked_over_used: PeakAt::default(),
                max_used_over_booked: PeakAt::default(),
                overbooked_ms: 0.0,
                unbooked_pins_ms: 0.0,
                series: Vec::new(),
            },
            overbooked: None,
            unbooked: None,
            divergences: Divergences::default(),
        }
    }

    pub(super) fn booked_blocks(&self) -> u64 {
        self.booked_blocks
    }

    /// A booking or its release moved `delta` blocks on this worker.
    pub(super) fn set_booked_blocks(&mut self, blocks: u64) {
        self.booked_blocks = blocks;
    }

    /// Judges the state settled at `t` (it holds until `next`): `cap` is the worker's
    /// physical KV, `role` its role.
    pub(super) fn settle(&mut self, role: Role, cap: &KvCapacitySnapshot, t: u64, next: u64) {
        let used = cap.kv_used_blocks();
        let booked = self.booked_blocks;
        let total = cap.total_blocks;
        let b = &mut self.row;
        b.peak_booked.see(booked, t);
        if self.last_point != Some([booked, used]) {
            self.last_point = Some([booked, used]);
            self.series
                .get_or_insert_with(|| Downsampler::new(t, BOOKING_SERIES_BUCKETS))
                .push(Sample { at_ns: t, values: [booked, used] });
        }
        b.peak_kv_used.see(used, t);
        b.max_booked_over_used.see(booked.saturating_sub(used), t);
        b.max_used_over_booked.see(used.saturating_sub(booked), t);
        let span_ms = ms(next.saturating_sub(t));
        let over = total > 0 && booked > total;
        self.divergences.track(&mut self.overbooked, self.worker, "overbooked", over, booked, t);
        if over {
            b.overbooked_ms += span_ms;
        }
        let unbooked = role == Role::Prefill && cap.pinned_source_blocks > 0 && booked == 0;
        self.divergences.track(
            &mut self.unbooked,
            self.worker,
            "unbooked_pins",
            unbooked,
            cap.pinned_source_blocks,
            t,
        );
        if unbooked {
            b.unbooked_pins_ms += span_ms;
        }
    }

    /// Closes open stretches at the run's end `end`: this worker's row, its divergences and
    /// how many more were not kept.
    pub(super) fn finish(&mut self, end: u64) -> (BookingRow, Vec<Divergence>, u64) {
        for (slot, kind) in [(&mut self.overbooked, "overbooked"), (&mut self.unbooked, "unbooked_pins")] {
            if let Some(d) = slot.take() {
                self.divergences.close(d, self.worker, kind, None, end);
            }
        }
        let mut row = self.row.clone();
        row.series = self
            .series
            .as_ref()
            .map(|d| d.points())
            .unwrap_or_default()
            .into_iter()
            .map(|p| BookingPoint { at_ms: ms(p.at_ns), booked: p.values[0], kv_used: p.values[1] })
            .collect();
        (row, std::mem::take(&mut self.divergences.list), self.divergences.dropped)
    }
}
