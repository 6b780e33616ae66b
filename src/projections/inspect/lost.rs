//! Workers lost mid-run: a stream that stops without its end marker while the others go on
//! (a live worker killed, or its link broken). Its peers' streams say what they ended on their
//! own because of it (`HandoffCanceled { PeerLost }` of handoffs shared with it), and the
//! router's which requests placed on it failed.

use super::report::{SessionTakeover, WorkerLoss};
use crate::events::{Fact, TerminalStatus};
use crate::ids::{CancelReason, HandoffId, RequestId, Role, WorkerId};
use crate::units::ms;
use std::collections::BTreeMap;

#[derive(Default)]
pub(super) struct LossWatch {
    /// Each handoff's source and destination workers, as their streams started them.
    roles: BTreeMap<HandoffId, [Option<WorkerId>; 2]>,
    /// Each request's workers, as the router booked them.
    placed: BTreeMap<RequestId, Vec<WorkerId>>,
    /// Per worker: its last record's instant.
    last_ns: BTreeMap<WorkerId, u64>,
    /// (lost peer, ending worker) → roles ended there with `PeerLost`.
    peer_lost: BTreeMap<(WorkerId, WorkerId), u64>,
    /// Requests that failed at the router, with the workers they were on.
    failed: Vec<Vec<WorkerId>>,
    /// Sessions lost and taken over by a restarted process: the worker, where its old session's
    /// records stop, and the takeover.
    taken_over: Vec<(WorkerId, u64, SessionTakeover)>,
}

impl LossWatch {
    pub(super) fn apply(&mut self, worker: WorkerId, at_ns: u64, fact: &Fact) {
        let before = self.last_ns.insert(worker, at_ns);
        match fact {
            Fact::SessionLost { generation, kv } => {
                let back = |d: i32| u64::from(d.unsigned_abs());
                let takeover = SessionTakeover {
                    at_ms: ms(at_ns),
                    lost_generation: generation.0,
                    blocks_held: back(kv.active) + back(kv.pinned_source) + back(kv.reserved_destination),
                    cached_blocks: back(kv.cached_free),
                    slots_held: back(kv.slots),
                };
                self.taken_over.push((worker, before.unwrap_or(at_ns), takeover));
            }
            Fact::HandoffStarted { handoff, .. } if worker.role != Role::Router => {
                let side = usize::from(worker.role == Role::Decode);
                self.roles.entry(*handoff).or_default()[side] = Some(worker);
            }
            Fact::HandoffCanceled { handoff, reason: CancelReason::PeerLost } => {
                let Some(pair) = self.roles.get(handoff) else { return };
                if let Some(peer) = pair.iter().flatten().find(|w| **w != worker) {
                    *self.peer_lost.entry((*peer, worker)).or_default() += 1;
                }
            }
            Fact::PrefillBooked { request, worker: w, .. }
            | Fact::DecodeBooked { request, worker: w, .. } => {
                self.placed.entry(*request).or_default().push(*w);
            }
            Fact::RequestFinished { request, status, .. } if worker.role == Role::Router => {
                let placed = self.placed.remove(request).unwrap_or_default();
                if *status == TerminalStatus::Failed {
                    self.failed.push(placed);
                }
            }
            _ => {}
        }
    }

    /// One entry per worker in `unended` whose stream stopped before the run's end, when some
    /// other stream did end cleanly (in a log from before end markers every stream lacks one,
    /// and an idle worker's stream simply ends early).
    pub(super) fn report(&self, unended: &[WorkerId], streams: usize, end_ns: u64) -> Vec<WorkerLoss> {
        let mut out: Vec<WorkerLoss> = self
            .taken_over
            .iter()
            .map(|(w, stopped, t)| WorkerLoss { taken_over: Some(t.clone()), ..self.loss(*w, *stopped) })
            .collect();
        if unended.len() >= streams {
            return out;
        }
        for w in unended.iter().filter(|w| w.role != Role::Router) {
            let stopped = self.last_ns.get(w).copied().unwrap_or(0);
            if stopped >= end_ns {
                continue; // it went on to the end: the whole run stopped, not this worker
            }
            out.push(self.loss(*w, stopped));
        }
        out
    }

    /// What the run says about `w`'s loss (its peers' and the router's side; summed over the
    /// run when it was lost more than once).
    fn loss(&self, w: WorkerId, stopped_ns: u64) -> WorkerLoss {
        let peers: Vec<(WorkerId, u64)> =
            self.peer_lost.iter().filter(|((lost, _), _)| *lost == w).map(|((_, by), n)| (*by, *n)).collect();
        WorkerLoss {
            worker: w,
            stopped_at_ms: ms(stopped_ns),
            peer_roles_ended: peers.iter().map(|(_, n)| n).sum(),
            by_peer: peers.into_iter().map(|(p, n)| (p.to_string(), n)).collect(),
            failed_requests: self.failed.iter().filter(|p| p.contains(&w)).count() as u64,
            taken_over: None,
        }
    }
}
