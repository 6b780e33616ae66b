//! Workers lost mid-run: a stream that stops without its end marker while the others go on
//! (a live worker killed, or its link broken). Its peers' streams say what they ended on their
//! own because of it (`HandoffCanceled { PeerLost }` of handoffs shared with it), and the
//! router's which requests placed on it failed.

use super::report::WorkerLoss;
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
}

impl LossWatch {
    pub(super) fn apply(&mut self, worker: WorkerId, at_ns: u64, fact: &Fact) {
        self.last_ns.insert(worker, at_ns);
        match fact {
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
        let mut out = Vec::new();
        if unended.len() >= streams {
            return out;
        }
        for w in unended.iter().filter(|w| w.role != Role::Router) {
            let stopped = self.last_ns.get(w).copied().unwrap_or(0);
            if stopped >= end_ns {
                continue; // it went on to the end: the whole run stopped, not this worker
            }
            let peers: Vec<(WorkerId, u64)> = self
                .peer_lost
                .iter()
                .filter(|((lost, _), _)| lost == w)
                .map(|((_, by), n)| (*by, *n))
                .collect();
            out.push(WorkerLoss {
                worker: *w,
                stopped_at_ms: ms(stopped),
                peer_roles_ended: peers.iter().map(|(_, n)| n).sum(),
                by_peer: peers.into_iter().map(|(p, n)| (p.to_string(), n)).collect(),
                failed_requests: self.failed.iter().filter(|p| p.contains(w)).count() as u64,
            });
        }
        out
    }
}
