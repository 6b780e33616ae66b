//! Fault injection, applied by the simulator: deliveries dropped, rejected as stale, doubled or
//! replayed late, and at each event boundary the armed faults whose phase holds are fired
//! (cancel, channel loss, worker restart). The plan and its phases are in `replay::faults`;
//! what each fault models is in docs/faults.md.

use super::simulator::Event;
use super::{Replay, ReplayError, NS_PER_MS};
use crate::adapters::replay::faults::{FaultKind, FaultReport, Late};
use crate::events::MessageRejection;
use crate::ids::{HandoffId, RequestId};
use crate::lifecycle::messages::HandoffMessage;

impl Replay<'_> {
    /// Applies the fault plan to a delivery: a lost channel drops it, a message from an older
    /// generation of a restarted sender is rejected as stale, a duplicate is queued behind it,
    /// a late-message fault keeps a copy. True when the delivery is consumed here.
    pub(super) fn fault_intercepts(&mut self, ev: &Event) -> Result<bool, ReplayError> {
        let Event::Deliver { slot, msg } = ev else {
            return Ok(false);
        };
        let (slot, msg) = (*slot, *msg);
        let h = msg.handoff;
        if self.faults.lost_channels.contains(&h) {
            // The transport for this handoff is gone: the receiver never sees the message.
            tracing::debug!(handoff = %h, kind = ?msg.kind(), "message dropped: channel lost");
            return Ok(true);
        }
        if self.faults.restarted {
            // The receiver's transport saw the sender's session end (the disconnect that told it
            // PeerLost), so anything stamped with an older generation is from a dead incarnation.
            let sender = self.slot_of(msg.from);
            if self.nodes.get(sender).is_some_and(|n| msg.generation < n.generation()) {
                self.on_node(slot, |n, _, r| n.refuse(msg, MessageRejection::StaleGeneration, r))?;
                return Ok(true);
            }
        }
        if let Some(fault) = self.faults.duplicate_next.remove(&h) {
            let text = format!("{:?} to {} delivered twice", msg.kind(), self.nodes[slot].id());
            self.faults.note(fault, text);
            self.push(self.now_ns, Event::Deliver { slot, msg });
        }
        if let Some(Late::Armed(fault)) = self.faults.late.get(&h).copied() {
            self.faults.late.insert(h, Late::Captured { fault, slot, msg });
        }
        Ok(false)
    }

    /// Runs at every event boundary while a plan exists: fires each armed fault whose phase
    /// holds now, and re-delivers late copies once their handoff is released on both roles.
    pub(super) fn fault_boundary(&mut self) -> Result<(), ReplayError> {
        let now = self.now_ns;
        if !self.faults.late.is_empty() {
            let ready: Vec<(HandoffId, usize, usize, HandoffMessage)> = self
                .faults
                .late
                .iter()
                .filter_map(|(h, l)| match l {
                    Late::Captured { fault, slot, msg } if !self.fault_held(*h) => {
                        Some((*h, *fault, *slot, *msg))
                    }
                    _ => None,
                })
                .collect();
            for (h, fault, slot, msg) in ready {
                self.faults.late.insert(h, Late::Sent);
                let text = format!(
                    "{:?} to {} delivered again at t={:.3} ms, after both roles released the handoff",
                    msg.kind(),
                    self.nodes[slot].id(),
                    now as f64 / 1e6
                );
                self.faults.note(fault, text);
                self.push(now, Event::Deliver { slot, msg });
            }
        }
        if self.faults.armed.is_empty() {
            return Ok(());
        }
        // Requests are numbered in arrival order: only those that arrived can be in a phase.
        let arrived: Vec<RequestId> =
            self.faults.armed.range(..RequestId(self.arrivals)).map(|(r, _)| *r).collect();
        for r in arrived {
            let Some(pending) = self.faults.armed.get(&r).cloned() else {
                continue;
            };
            let placement = self.frontend.placement(r);
            let Some((h, p, d)) = placement.and_then(|p| Some((p.handoff?, p.prefill, p.decode))) else {
                for i in self.faults.armed.remove(&r).unwrap_or_default() {
                    self.faults.note(i, "the request ended before this phase".into());
                }
                continue;
            };
            let (p, d) = (p.map(|w| self.slot_of(w)), d.map(|w| self.slot_of(w)));
            let s_state = p.and_then(|p| self.nodes[p].source_state(h).copied());
            let d_state = d.and_then(|d| self.nodes[d].destination_state(h).copied());
            let mut due = Vec::new();
            let mut rest = Vec::new();
            for &i in &pending {
                let spec = self.faults.reports[i].spec;
                let holds = spec.phase.holds(s_state.as_ref(), d_state.as_ref(), d.is_some());
                match (holds, self.faults.due_ns.get(&i).copied()) {
                    (true, None) if spec.delay_ms == 0 => due.push(i),
                    (true, None) => {
                        let at = now.saturating_add(spec.delay_ms.saturating_mul(NS_PER_MS));
                        self.faults.due_ns.insert(i, at);
                        self.push(at, Event::FaultTimer);
                        rest.push(i);
                    }
                    (true, Some(at)) if now >= at => due.push(i),
                    (true, Some(_)) | (false, None) => rest.push(i),
                    (false, Some(_)) => {
                        let text = "the handoff left the phase before the delay elapsed".to_string();
                        self.faults.note(i, text);
                    }
                }
            }
            if due.is_empty() && rest.len() == pending.len() {
                continue; // nothing changed
            }
            if rest.is_empty() {
                self.faults.armed.remove(&r);
            } else {
                self.faults.armed.insert(r, rest);
            }
            for i in due {
                self.fire_fault(i, r, h, p, d)?;
            }
        }
        Ok(())
    }

    /// Whether any role still holds the handoff.
    fn fault_held(&self, h: HandoffId) -> bool {
        self.nodes.iter().any(|n| n.holds(h))
    }

    fn fire_fault(
        &mut self,
        i: usize,
        request: RequestId,
        h: HandoffId,
        p: Option<usize>,
        d: Option<usize>,
    ) -> Result<(), ReplayError> {
        let now = self.now_ns;
        let spec = self.faults.reports[i].spec;
        self.faults.reports[i].fired_at_ns = Some(now);
        self.faults.reports[i].handoff = Some(h);
        tracing::info!(fault = %spec, handoff = %h, at_ms = now as f64 / 1e6, "fault fired");
        match spec.kind {
            FaultKind::Cancel => {
                // The frontend's abort: the request ends canceled and both roles cancel.
                let mut out = self.take_front();
                self.frontend.abort(now, request, &mut out);
                self.carry_out_frontend(out)?;
            }
            FaultKind::ChannelLoss => {
                self.faults.lost_channels.insert(h);
                // Each role hears of the loss from its own transport before the frontend hears
                // of either role's end.
                self.hold();
                let mut told = Vec::new();
                for s in [p, d].into_iter().flatten() {
                    if self.peer_lost(s, h)? {
                        told.push(self.nodes[s].id().to_string());
                    }
                }
                self.release()?;
                self.faults.note(i, format!("peer-lost delivered locally to [{}]", told.join(", ")));
            }
            FaultKind::RestartSource => match p {
                Some(p) => {
                    let text = self.restart_worker(p)?;
                    self.faults.note(i, text);
                }
                None => self.faults.note(i, "no source to restart".into()),
            },
            FaultKind::RestartDestination => match d {
                Some(d) => {
                    let text = self.restart_worker(d)?;
                    self.faults.note(i, text);
                }
                None => self.faults.note(i, "no destination to restart".into()),
            },
            FaultKind::DuplicateMessage => {
                self.faults.duplicate_next.insert(h, i);
            }
            FaultKind::LateMessage => {
                self.faults.late.insert(h, Late::Armed(i));
            }
        }
        Ok(())
    }

    /// The worker's session ends and a new one starts: a new generation, every handoff the old
    /// one held canceled locally (`OwnerLost`, its core frees the resources), each peer told by
    /// its transport (`PeerLost`) — never by a message from the dead incarnation.
    pub(super) fn restart_worker(&mut self, s: usize) -> Result<String, ReplayError> {
        self.faults.restarted = true;
        self.hold();
        let held = self.on_node(s, |n, now, r| n.restart(now, r))?;
        let mut peers = 0;
        for h in &held {
            for ps in (0..self.nodes.len()).filter(|ps| *ps != s) {
                if self.peer_lost(ps, *h)? {
                    peers += 1;
                }
            }
        }
        self.release()?;
        let text = format!(
            "{} restarted as generation {}: {} handoff roles canceled (owner-lost), {} peer roles canceled (peer-lost)",
            self.nodes[s].id(),
            self.nodes[s].generation().0,
            held.len(),
            peers
        );
        Ok(text)
    }

    /// The plan's outcome at the end of the run: faults never fired say why.
    pub(super) fn fault_reports(&mut self) -> Vec<FaultReport> {
        let arrived = self.arrivals;
        for (r, pending) in std::mem::take(&mut self.faults.armed) {
            for i in pending {
                let why = if r.0 >= arrived {
                    "no such request in the trace".to_string()
                } else {
                    "the phase was never reached before the run ended".to_string()
                };
                self.faults.note(i, why);
            }
        }
        let late: Vec<Late> = self.faults.late.values().copied().collect();
        for l in &late {
            match l {
                Late::Armed(i) => {
                    self.faults.note(*i, "no message of the handoff was delivered after the phase".into())
                }
                Late::Captured { fault, .. } => {
                    self.faults.note(*fault, "the handoff was never released on both roles".into())
                }
                Late::Sent => {}
            }
        }
        let leftover: Vec<usize> = self.faults.duplicate_next.values().copied().collect();
        for i in leftover {
            self.faults.note(i, "no message of the handoff was delivered after the phase".into());
        }
        let reports = std::mem::take(&mut self.faults.reports);
        for r in reports.iter().filter(|r| !r.fired()) {
            tracing::warn!("{r}");
        }
        reports
    }
}
