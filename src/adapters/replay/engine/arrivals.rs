//! The workload's side of the frontend: when the next request arrives, handing it to the
//! frontend (unless `max_in_flight` holds it back), and telling the workload (and the
//! planner) of every request that ended.

use super::simulator::{arm, Event};
use super::{Replay, ReplayError};
use crate::runtime::RequestEnded;

impl Replay<'_> {
    /// Queues an `Arrival` for the workload's next due request, unless one is queued for that
    /// instant or earlier already.
    pub(super) fn arm_arrival(&mut self) {
        let due = self.workload.next_due_ns();
        arm(&mut self.queue, &mut self.arrival_armed_ns, self.now_ns, due, Event::Arrival);
    }

    /// The workload's next due request arrives at the frontend.
    pub(super) fn on_arrival(&mut self) -> Result<(), ReplayError> {
        let now = self.now_ns;
        if self.arrival_armed_ns == Some(now) {
            self.arrival_armed_ns = None;
        }
        if !self.frontend.can_admit() {
            self.held_back = true;
            return Ok(());
        }
        let Some(t) = self.workload.pop_due(now)? else {
            self.arm_arrival();
            return Ok(());
        };
        let request = t.to_request();
        self.arrivals += 1;
        self.arm_arrival();
        let mut out = self.take_front();
        self.frontend.on_arrival(now, request, &mut out)?;
        self.carry_out_frontend(out)
    }

    /// A request reached its terminal outcome at the frontend: the planner takes its latency,
    /// the workload hears of it (a session's next turn, a closed-loop slot), and an arrival
    /// held back by `max_in_flight` may come now.
    pub(super) fn request_ended(&mut self, e: RequestEnded) -> Result<(), ReplayError> {
        let now = self.now_ns;
        if let (Some(p), Some(sample)) = (self.planner.as_mut(), e.sample) {
            p.record(e.at_ns, sample.ttft_ns, sample.tpot_ns);
        }
        self.workload.on_terminal(e.request.0, e.status.into(), now)?;
        if self.held_back {
            self.held_back = false;
            self.arrival_armed_ns = Some(now);
            self.push(now, Event::Arrival);
        }
        self.arm_arrival();
        Ok(())
    }
}
