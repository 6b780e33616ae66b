//! Liveness: what counts as progress, the no-progress guard, the preemption livelock watch,
//! and the end-of-run diagnosis of what is stuck where.

use super::{Membership, Replay};
use crate::events::Fact;
use crate::ids::RequestId;
use crate::lifecycle::destination::DestinationState;
use crate::lifecycle::source::SourceState;

/// A request preempted again and again, with no request on its worker finishing, pinning its
/// prefill or getting its first token in between.
#[derive(Clone, Copy, Debug)]
pub(super) struct PreemptionStreak {
    request: RequestId,
    since_ns: u64,
    count: u64,
}

/// Preemptions in one streak before the streak can mean a livelock (with the time limit in
/// [`Replay::note_preemption`]).
const LIVELOCK_PREEMPTIONS: u64 = 1000;

impl Replay<'_> {
    /// What the simulator reads of a worker's facts as it writes them: progress for the
    /// no-progress guard, and preemption streaks for the livelock watch.
    pub(super) fn observe(&mut self, slot: usize, fact: &Fact, at_ns: u64) {
        if Self::is_progress(fact) {
            self.last_progress_ns = at_ns;
        }
        if let Some(folded) = self.folded.as_mut() {
            let d = fact.kv_delta();
            if let Err(v) = folded[slot].apply(&d) {
                // Reported by the check after this event, with the worker and the instant.
                self.invariant =
                    Some(format!("{}: {fact:?} at t={at_ns} ns breaks capacity: {v}", self.nodes[slot].id()));
            }
        }
        match fact {
            Fact::RequestPreempted { request, .. } => self.note_preemption(slot, *request, at_ns),
            // Progress on the worker: a request finished, pinned its prefill or got its first
            // token.
            Fact::RequestFinished { .. } | Fact::FirstTokenEmitted { .. } | Fact::SourcePinned { .. } => {
                self.members[slot].preemptions = None;
            }
            _ => {}
        }
    }

    /// The per-event check (`ReplayOptions::check_every_event`): every worker's folded facts,
    /// core counters and recount agree, and blocks are conserved.
    pub(super) fn check_invariants(&mut self) -> Result<(), super::ReplayError> {
        let Some(folded) = self.folded.as_ref() else { return Ok(()) };
        let at = self.now_ns;
        if let Some(why) = self.invariant.take() {
            return Err(super::ReplayError::Engine(format!("invariant broken: {why}")));
        }
        for (node, fold) in self.nodes.iter().zip(folded) {
            // A step in flight has changed the core already and shows its facts at its end.
            if node.is_busy() {
                continue;
            }
            let (counted, recounted) = (node.core().snapshot(), node.core().audit());
            if *fold != counted || counted != recounted || !counted.is_conserved() {
                return Err(super::ReplayError::Engine(format!(
                    "invariant broken on {} at t={at} ns: folded facts {fold}, core counters {counted}, recount {recounted}",
                    node.id()
                )));
            }
        }
        Ok(())
    }

    /// Whether a fact shows the run moving. Lease renewals, their messages and refused
    /// reservation retries can repeat forever without anything changing, so they do not count.
    pub(super) fn is_progress(fact: &Fact) -> bool {
        use crate::events::MessageKind::LeaseRenewal;
        !matches!(
            fact,
            Fact::LeaseRenewed { .. }
                | Fact::ReservationRefused { .. }
                | Fact::MessageSent { kind: LeaseRenewal, .. }
                | Fact::MessageReceived { kind: LeaseRenewal, .. }
                | Fact::MessageRejected { kind: LeaseRenewal, .. }
        )
    }

    /// Virtual time has passed the progress limit since anything moved: with requests in flight
    /// and no worker computing, nothing but timers that change nothing is left, so the run
    /// stops and names what keeps it alive.
    pub(super) fn check_progress(&mut self) {
        if self.frontend.in_flight() == 0 || self.nodes.iter().any(|n| n.is_busy()) || self.livelock.is_some()
        {
            self.last_progress_ns = self.now_ns;
            return;
        }
        let waiting: Vec<String> = self
            .nodes
            .iter()
            .flat_map(|n| n.destination_roles().map(move |(h, _, state)| (n.id(), h, state.name())))
            .take(5)
            .map(|(w, h, state)| format!("{h} (destination on {w}, {state})"))
            .collect();
        self.livelock = Some(format!(
            "no progress for {:.1} s of virtual time with {} requests in flight and every worker idle: only lease renewals and refused retries happen; waiting handoffs: {}",
            self.now_ns.saturating_sub(self.last_progress_ns) as f64 / 1e9,
            self.frontend.in_flight(),
            if waiting.is_empty() { "none".to_string() } else { waiting.join(", ") }
        ));
    }

    /// Watches for a livelock the cores cannot see: a request that gets blocks for a chunk,
    /// then needs more than the worker can give while other requests hold their KV waiting
    /// behind it, is preempted, readmitted first, and so on forever, with virtual time
    /// advancing (so the zero-length-step guard never fires). Once one request has been
    /// preempted `LIVELOCK_PREEMPTIONS` times with no request on its worker finishing, pinning
    /// its prefill or getting its first token, for longer than every lifecycle timeout (so no
    /// lease, reservation or bootstrap expiry can still free anything), the run stops and
    /// reports it as stuck.
    pub(super) fn note_preemption(&mut self, slot: usize, request: RequestId, at_ns: u64) {
        // The same bound as the no-progress guard's: longer than every lifecycle timeout.
        let limit_ns = self.progress_limit_ns;
        let s = match &mut self.members[slot].preemptions {
            Some(s) if s.request == request => s,
            streak => {
                *streak = Some(PreemptionStreak { request, since_ns: at_ns, count: 1 });
                return;
            }
        };
        s.count += 1;
        let (count, lasted_ns) = (s.count, at_ns.saturating_sub(s.since_ns));
        if count >= LIVELOCK_PREEMPTIONS && lasted_ns > limit_ns {
            let node = &self.nodes[slot];
            let (c, v) = (node.core().snapshot(), node.core().view());
            self.livelock = Some(format!(
                "{} livelocked: {request} was preempted {count} times over {:.1} s with no request on the worker making progress; it cannot get the KV it needs while others hold theirs ({} waiting, {} running, {} waiting for remote KV; KV {} active / {} pinned / {} reserved of {} blocks)",
                node.id(),
                lasted_ns as f64 / 1e9,
                v.waiting,
                v.running,
                v.waiting_for_remote_kv,
                c.active_blocks,
                c.pinned_source_blocks,
                c.reserved_destination_blocks,
                c.total_blocks
            ));
        }
    }

    pub(super) fn diagnose(&self) -> Vec<String> {
        let mut out: Vec<String> = self.livelock.iter().cloned().collect();
        for (node, member) in self.nodes.iter().zip(&self.members) {
            let w = node.id();
            for (h, request, state) in node.source_roles() {
                let why = match state {
                    SourceState::NotStarted => "waiting for the destination's reservation",
                    SourceState::Computing => "waiting for the prefill to run",
                    SourceState::Pinned { .. } => "pinned, waiting for a destination reservation",
                    SourceState::AwaitingReaderCompletion { .. } => "pinned, waiting for reader completion",
                    SourceState::Released { .. } => "waiting",
                };
                out.push(format!("handoff {h} ({request}) source on {w} stuck in {}: {why}", state.name()));
            }
            for (h, request, state) in node.destination_roles() {
                let why = match state {
                    DestinationState::Reserving => "waiting in the reservation FIFO for capacity",
                    DestinationState::Reserved { .. } => "reserved, waiting for the source's KV",
                    DestinationState::Receiving { .. } => "waiting for the transfer to complete",
                    DestinationState::Active { .. } => "decoding",
                    DestinationState::NotRouted | DestinationState::Released { .. } => "waiting",
                };
                out.push(format!(
                    "handoff {h} ({request}) destination on {w} stuck in {}: {why}",
                    state.name()
                ));
            }
            if member.membership == Membership::Leaving {
                out.push(format!("{w} was taken out of routing and never drained"));
            }
            let core = node.core();
            if !core.is_drained() {
                let v = core.view();
                let c = core.snapshot();
                out.push(format!(
                    "{w} not drained: {} waiting, {} running, {} waiting for remote KV, {} held prefills, {} pending reservations; KV {} active / {} pinned / {} reserved of {} blocks",
                    v.waiting, v.running, v.waiting_for_remote_kv, v.held_prefills, v.pending_reservations,
                    c.active_blocks, c.pinned_source_blocks, c.reserved_destination_blocks, c.total_blocks
                ));
            }
        }
        for (r, p) in self.frontend.placements() {
            let name = |w: Option<crate::ids::WorkerId>| w.map_or("none".to_string(), |w| w.to_string());
            out.push(format!(
                "{r} never reached a terminal outcome (prefill {}, decode {}, handoff {})",
                name(p.prefill),
                name(p.decode),
                p.handoff.map_or("none".to_string(), |h| h.to_string())
            ));
        }
        out
    }
}
