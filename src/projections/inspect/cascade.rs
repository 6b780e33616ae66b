//! The stranding cascade: prefill admission stalls under hot pins, decode-pressure episodes,
//! and the trigger that ties the first stall to the episode before it (definitions in the
//! module docs of [`crate::projections::inspect`]).

use super::fold::WorkerState;
use super::report::{Cascade, DecodePressure, PinRise, StallInterval, Trigger};
use super::{pct, InspectOptions, MAX_INTERVALS_PER_WORKER};
use crate::events::Fact;
use crate::ids::{RequestId, Role, WorkerId};
use crate::units::{ms, NS_PER_MS};
use std::collections::{BTreeMap, BTreeSet};

#[derive(Clone, Debug)]
struct OpenStall {
    start_ns: u64,
    pinned_at_start_pct: f64,
    peak_pinned_pct: f64,
    oldest: Option<(u64, RequestId)>,
    peak_waiting: u64,
}

/// A prefill worker's admission: the requests it queued and has not scheduled, and the
/// stalls they made.
#[derive(Default)]
pub(super) struct PrefillAdmission {
    /// Requests queued and not scheduled, with when they queued.
    waiting_since: BTreeMap<RequestId, u64>,
    waiting_order: BTreeSet<(u64, RequestId)>,
    stall: Option<OpenStall>,
    /// The last stall that ended, and when: held back so that a stall resuming within
    /// `stall_ms` continues it (one release does not end a cascade).
    closed: Option<(OpenStall, u64)>,
    stalls: Vec<StallInterval>,
    stalls_dropped: u64,
}

impl PrefillAdmission {
    pub(super) fn unqueue(&mut self, request: &RequestId) {
        if let Some(at) = self.waiting_since.remove(request) {
            self.waiting_order.remove(&(at, *request));
        }
    }

    pub(super) fn queue(&mut self, request: RequestId, at_ns: u64) {
        self.unqueue(&request);
        self.waiting_since.insert(request, at_ns);
        self.waiting_order.insert((at_ns, request));
    }

    fn push_stall(&mut self, worker: WorkerId, st: OpenStall, end_ns: Option<u64>, run_end_ns: u64) {
        if self.stalls.len() >= MAX_INTERVALS_PER_WORKER {
            self.stalls_dropped += 1;
            return;
        }
        let end = end_ns.unwrap_or(run_end_ns);
        self.stalls.push(StallInterval {
            worker,
            started_at_ms: ms(st.start_ns),
            ended_at_ms: end_ns.map(ms),
            duration_ms: ms(end.saturating_sub(st.start_ns)),
            pinned_at_start_pct: st.pinned_at_start_pct,
            peak_pinned_pct: st.peak_pinned_pct,
            oldest_waiting_request: st.oldest.map(|(_, r)| r),
            oldest_waiting_since_ms: st.oldest.map(|(q, _)| ms(q)),
            peak_waiting: st.peak_waiting,
        });
    }

    /// Closes the stalls still open at the run's end `end`: `worker`'s stall intervals and how
    /// many more were not kept.
    pub(super) fn finish(&mut self, worker: WorkerId, end: u64) -> (Vec<StallInterval>, u64) {
        if let Some((prev, closed_at)) = self.closed.take() {
            self.push_stall(worker, prev, Some(closed_at), closed_at);
        }
        if let Some(st) = self.stall.take() {
            self.push_stall(worker, st, None, end);
        }
        (std::mem::take(&mut self.stalls), self.stalls_dropped)
    }
}

/// A decode worker's figures inside the current pressure episode.
#[derive(Clone, Debug)]
struct EpisodeWorker {
    kv_used_at_start_pct: f64,
    peak_kv_used_pct: f64,
    peak_at_ns: u64,
    queued: u64,
    refused: u64,
    reason: Option<String>,
}

#[derive(Clone, Debug)]
struct Episode {
    start_ns: u64,
    /// When pressure last stopped (`None` while it holds).
    off_since_ns: Option<u64>,
    decode: BTreeMap<WorkerId, EpisodeWorker>,
    /// Each prefill worker's pinned share when the episode started.
    prefill_pinned_pct: BTreeMap<WorkerId, f64>,
}

/// A stalled prefill worker's pinned share at the trigger and when it stalled.
#[derive(Clone, Copy, Debug)]
struct PinRiseMarks {
    at_trigger_pct: f64,
    at_stall_pct: f64,
    stalled_at_ns: u64,
}

/// A decode worker under pressure at a settled instant, and why (built into words only when
/// kept).
struct Pressured {
    worker: WorkerId,
    full: bool,
    pending: u64,
    refused: bool,
    used: u64,
    total: u64,
}

impl Pressured {
    fn why(&self) -> String {
        let mut why = Vec::new();
        if self.full {
            why.push(format!("kv_used {}%", pct(self.used, self.total)));
        }
        if self.pending > 0 {
            why.push(format!("{} reservations pending", self.pending));
        }
        if self.refused {
            why.push("reservation refused".to_string());
        }
        why.join(", ")
    }
}

/// Decode-pressure episodes and the stranding cascade.
#[derive(Default)]
pub(super) struct CascadeWatch {
    episode: Option<Episode>,
    /// When the first stall started, with the episode that triggered it (if any).
    start: Option<(u64, Option<Episode>)>,
    rises: BTreeMap<WorkerId, PinRiseMarks>,
}

impl CascadeWatch {
    /// Pressure-episode counters (per decode worker, since the episode began).
    pub(super) fn count_reservation(&mut self, worker: WorkerId, fact: &Fact) {
        if let Some(ep) = self.episode.as_mut() {
            if ep.off_since_ns.is_none() && worker.role == Role::Decode {
                if let Some(ew) = ep.decode.get_mut(&worker) {
                    match fact {
                        Fact::ReservationQueued { .. } => ew.queued += 1,
                        Fact::ReservationRefused { .. } => ew.refused += 1,
                        _ => {}
                    }
                }
            }
        }
    }

    /// Judges decode pressure (cluster level) at the settled instant `t`; clears every
    /// worker's refusal of the instant.
    pub(super) fn settle_pressure(
        &mut self,
        workers: &mut [Option<WorkerState>],
        opts: &InspectOptions,
        t: u64,
    ) {
        let stall_ns = opts.stall_ms.saturating_mul(NS_PER_MS);
        let mut pressured: Vec<Pressured> = Vec::new();
        for ws in workers.iter_mut().flatten() {
            if ws.worker.role != Role::Decode {
                ws.refused_now = false;
                continue;
            }
            let used = ws.cap().kv_used_blocks();
            let total = ws.total();
            let full = total > 0 && used * 100 >= opts.decode_full_pct as u64 * total;
            let pending = ws.view.pending_reservations;
            if full || pending > 0 || ws.refused_now {
                pressured.push(Pressured {
                    worker: ws.worker,
                    full,
                    pending,
                    refused: ws.refused_now,
                    used,
                    total,
                });
            }
            ws.refused_now = false;
        }
        if !pressured.is_empty() {
            let reopen = matches!(&self.episode, Some(ep) if ep.off_since_ns.is_none()
                || ep.off_since_ns.is_some_and(|off| t.saturating_sub(off) < stall_ns));
            if !reopen {
                self.episode = Some(Episode {
                    start_ns: t,
                    off_since_ns: None,
                    decode: BTreeMap::new(),
                    prefill_pinned_pct: workers
                        .iter()
                        .flatten()
                        .filter(|w| w.worker.role == Role::Prefill)
                        .map(|w| (w.worker, pct(w.cap().pinned_source_blocks, w.total())))
                        .collect(),
                });
            }
            if let Some(ep) = self.episode.as_mut() {
                ep.off_since_ns = None;
                // Track every decode worker's peak inside the episode (until the cascade).
                if self.start.is_none() {
                    for ws in workers.iter().flatten() {
                        if ws.worker.role != Role::Decode {
                            continue;
                        }
                        let p = pct(ws.cap().kv_used_blocks(), ws.total());
                        let ew = ep.decode.entry(ws.worker).or_insert(EpisodeWorker {
                            kv_used_at_start_pct: p,
                            peak_kv_used_pct: p,
                            peak_at_ns: t,
                            queued: 0,
                            refused: 0,
                            reason: None,
                        });
                        if p > ew.peak_kv_used_pct {
                            ew.peak_kv_used_pct = p;
                            ew.peak_at_ns = t;
                        }
                    }
                    for p in &pressured {
                        if let Some(ew) = ep.decode.get_mut(&p.worker) {
                            ew.reason.get_or_insert_with(|| p.why());
                        }
                    }
                }
            }
        } else if let Some(ep) = self.episode.as_mut() {
            ep.off_since_ns.get_or_insert(t);
        }
    }

    /// Judges a prefill worker's stall at the settled instant `t` (which holds until `next`).
    pub(super) fn settle_stall(&mut self, ws: &mut WorkerState, opts: &InspectOptions, t: u64, next: u64) {
        let stall_ns = opts.stall_ms.saturating_mul(NS_PER_MS);
        let (c, v, total, worker) = (ws.cap(), ws.view, ws.total(), ws.worker);
        let a = &mut ws.admission;
        let hot = total > 0 && c.pinned_source_blocks * 100 >= opts.pin_threshold_pct as u64 * total;
        let oldest = a.waiting_order.first().copied();
        let pinned_pct = pct(c.pinned_source_blocks, total);
        let stalled_from = oldest.map(|(q, _)| q.saturating_add(stall_ns).max(t));
        if let Some(st) = a.stall.as_mut() {
            let still = hot && stalled_from.is_some_and(|s| s <= t);
            if still {
                st.peak_pinned_pct = st.peak_pinned_pct.max(pinned_pct);
                st.peak_waiting = st.peak_waiting.max(v.waiting);
            } else if let Some(st) = a.stall.take() {
                if let Some((prev, end)) = a.closed.take() {
                    a.push_stall(worker, prev, Some(end), end);
                }
                a.closed = Some((st, t));
            }
        }
        if a.stall.is_none() && hot {
            if let Some(s) = stalled_from.filter(|s| *s < next || (next == t && *s <= t)) {
                match a.closed.take() {
                    // Resumed within `stall_ms` of its end: the same stall goes on.
                    Some((mut prev, end)) if s.saturating_sub(end) < stall_ns => {
                        prev.peak_pinned_pct = prev.peak_pinned_pct.max(pinned_pct);
                        prev.peak_waiting = prev.peak_waiting.max(v.waiting);
                        a.stall = Some(prev);
                        return;
                    }
                    Some((prev, end)) => a.push_stall(worker, prev, Some(end), end),
                    None => {}
                }
                a.stall = Some(OpenStall {
                    start_ns: s,
                    pinned_at_start_pct: pinned_pct,
                    peak_pinned_pct: pinned_pct,
                    oldest,
                    peak_waiting: v.waiting,
                });
                if self.start.is_none() {
                    // The trigger: the pressure episode in progress or last ended, if it
                    // began no later than the stall.
                    let ep = self.episode.clone().filter(|e| e.start_ns <= s);
                    self.start = Some((s, ep));
                }
                let at_trigger = self
                    .start
                    .as_ref()
                    .and_then(|(_, ep)| ep.as_ref())
                    .and_then(|ep| ep.prefill_pinned_pct.get(&worker).copied())
                    .unwrap_or(0.0);
                self.rises.entry(worker).or_insert(PinRiseMarks {
                    at_trigger_pct: at_trigger,
                    at_stall_pct: pinned_pct,
                    stalled_at_ns: s,
                });
            }
        }
    }

    /// The cascade, if a stall started: `intervals` are every prefill worker's stall
    /// intervals (`intervals_dropped` more were not kept).
    pub(super) fn report(
        self,
        opts: &InspectOptions,
        intervals: Vec<StallInterval>,
        intervals_dropped: u64,
    ) -> Option<Cascade> {
        let rises = self.rises;
        self.start.map(|(start_ns, ep)| {
            let workers: Vec<WorkerId> = rises.keys().copied().collect();
            let trigger = ep.map(|ep| {
                let decode_workers: Vec<DecodePressure> = ep
                    .decode
                    .iter()
                    .filter(|(_, ew)| ew.reason.is_some())
                    .map(|(w, ew)| DecodePressure {
                        worker: *w,
                        kv_used_at_start_pct: ew.kv_used_at_start_pct,
                        peak_kv_used_pct: ew.peak_kv_used_pct,
                        peak_kv_used_at_ms: ms(ew.peak_at_ns),
                        reservations_queued: ew.queued,
                        reservations_refused: ew.refused,
                        reason: ew.reason.clone().unwrap_or_default(),
                    })
                    .collect();
                let pin_rise: Vec<PinRise> = rises
                    .iter()
                    .map(|(w, r)| PinRise {
                        worker: *w,
                        pinned_at_trigger_pct: r.at_trigger_pct,
                        pinned_at_stall_pct: r.at_stall_pct,
                        stalled_at_ms: ms(r.stalled_at_ns),
                    })
                    .collect();
                let names = |v: Vec<String>| v.join(", ");
                let summary = format!(
                    "decode capacity exhausted at {:.3} ms on {} (peak kv_used {}; {} reservations queued, {} refused); source pins then rose on {} until prefill admission stalled at {:.3} ms",
                    ms(ep.start_ns),
                    names(decode_workers.iter().map(|d| d.worker.to_string()).collect()),
                    names(decode_workers.iter().map(|d| format!("{}%", d.peak_kv_used_pct)).collect()),
                    decode_workers.iter().map(|d| d.reservations_queued).sum::<u64>(),
                    decode_workers.iter().map(|d| d.reservations_refused).sum::<u64>(),
                    names(pin_rise.iter().map(|r| format!("{} from {}% to {}%", r.worker, r.pinned_at_trigger_pct, r.pinned_at_stall_pct)).collect()),
                    ms(start_ns),
                );
                Trigger {
                    kind: "decode_exhaustion",
                    at_ms: ms(ep.start_ns),
                    decode_workers,
                    pin_rise,
                    summary,
                }
            });
            let summary = format!(
                "stranding cascade from {:.3} ms on {}: pinned source blocks ≥ {}% of the worker while queued prefill work waited unscheduled ≥ {} ms",
                ms(start_ns),
                workers.iter().map(|w| w.to_string()).collect::<Vec<_>>().join(", "),
                opts.pin_threshold_pct,
                opts.stall_ms,
            );
            Cascade {
                started_at_ms: ms(start_ns),
                workers,
                trigger,
                intervals,
                intervals_not_shown: intervals_dropped,
                summary,
            }
        })
    }
}
