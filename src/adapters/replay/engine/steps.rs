//! The simulator's side of a node's steps: a step's boundary, commands handed back at their
//! turn, starting the next step, and handoff messages delivered to a node.

use super::{Membership, Replay, ReplayError};
use crate::lifecycle::messages::HandoffMessage;
use crate::runtime::{DeferredCommand, StepPlan};

impl Replay<'_> {
    /// A step ended: its effects are carried out, then every command that waited for it, and
    /// the worker starts again after everything else due at this instant.
    pub(super) fn on_step_done(&mut self, s: usize) -> Result<(), ReplayError> {
        let now = self.now_ns;
        // (`is_some` first: taking moves the whole run, and most boundaries have none.)
        if self.quiet.runs[s].is_some() {
            if let Some(q) = self.quiet.runs[s].take() {
                self.finish_quiet(s, q)?;
            }
        }
        self.on_node(s, |n, now, r| n.finish_step(now, r))?;
        while self.nodes[s].has_waiting() && self.on_node(s, |n, now, r| n.apply_next_waiting(now, r))? {}
        if self.queue.has_due(now) {
            self.queue.push_start(s, now);
        } else {
            // Nothing else is due at this instant (no event, no other start), so starting now
            // is starting after everything of the instant: skip the round trip through the
            // queue that most step boundaries would take.
            self.kick(s)?;
        }
        Ok(())
    }

    /// A command handed back: a quiet run in flight is cut at the step it lands in first; the
    /// node applies the inbox rule.
    pub(super) fn on_command(&mut self, slot: usize, command: DeferredCommand) -> Result<(), ReplayError> {
        if self.nodes[slot].is_busy() && self.quiet.runs[slot].is_some() {
            if let Some(q) = self.quiet.runs[slot].take() {
                // Leaves the worker free if its last step ended right now.
                self.cut_quiet(slot, q)?;
            }
        }
        self.on_node(slot, |n, now, r| n.apply_command(now, command, r))??;
        Ok(())
    }

    /// Starts a step on an idle worker that has work.
    pub(super) fn kick(&mut self, s: usize) -> Result<(), ReplayError> {
        let quiet = self.quiet.enabled;
        loop {
            match self.on_node(s, |n, now, r| n.start_step(now, quiet, r))?? {
                StepPlan::Idle => return Ok(()),
                StepPlan::Again => continue,
                StepPlan::Until { until_ns } => {
                    self.queue.push_lane(s, until_ns, super::simulator::Event::StepDone(s));
                    return Ok(());
                }
                StepPlan::Quiet { first, first_ns, rest } => {
                    let q = self.quiet_run(s, first, first_ns, rest);
                    self.queue.push_lane(s, q.end_of(q.steps), super::simulator::Event::StepDone(s));
                    self.quiet.runs[s] = Some(q);
                    self.quiet.refresh(s);
                    return Ok(());
                }
            }
        }
    }

    /// A handoff message reaches its worker (a worker that left has no transport: a
    /// straggler to it is lost).
    pub(super) fn on_deliver(&mut self, slot: usize, msg: HandoffMessage) -> Result<(), ReplayError> {
        if matches!(self.members[slot].membership, Membership::Left { .. }) {
            return Ok(());
        }
        self.on_node(slot, |n, now, r| n.on_peer(now, msg, r))
    }
}
