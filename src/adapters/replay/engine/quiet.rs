//! Quiet runs: a worker's decode steps that only advance every running request by a token,
//! applied to its core in one go while each step's fact is still written where its boundary
//! falls (see [`QuietRun`]).

use super::{Replay, ReplayError};
use crate::events::Fact;
use crate::ids::WorkerId;
use crate::schedulers::{QuietDurations, QuietSteps};

/// A worker in a run of quiet steps: `steps` steps from `start_ns`, the first an ordinary step
/// already applied to the core when the run began (`first`, its only fact), the others decode
/// steps that the core promised would each only advance every running request by a token and
/// write `rest.fact(i)` (see [`EngineCore::quiet_steps`]).
///
/// Most of a replay's events are such steps (no block to allocate or hash, no token that ends
/// anything, no command in between). Instead of a boundary event, a core call and an effects
/// round trip per step, the run keeps one boundary queued (the last step's end) and:
/// * writes each step's fact when its boundary would have popped: before any event that comes
///   after it in the queue's `(time, rank)` order ([`Replay::write_quiet_until`]); so every
///   stream, the metrics fold and the event count see exactly what step-by-step replay gives;
/// * applies the steps to the core in one go ([`EngineCore::advance_quiet`]) when the last
///   boundary pops, or when a command reaches the worker mid-run: then the steps begun by that
///   instant are applied, the one in flight becomes an ordinary pending step, and the
///   command waits in the inbox for its end, as it would have.
///
/// Only commands touch a core (role machines, deliveries and timers reach it through them),
/// so a run can be cut at exactly the step a command lands in.
///
/// [`EngineCore::quiet_steps`]: crate::schedulers::EngineCore::quiet_steps
/// [`EngineCore::advance_quiet`]: crate::schedulers::EngineCore::advance_quiet
#[derive(Clone, Debug)]
pub(super) struct QuietRun {
    // What writing each fact reads, first.
    worker: WorkerId,
    start_ns: u64,
    first_ns: u64,
    pub(super) steps: u64,
    /// Facts written so far (steps `1..=written` have ended).
    written: u64,
    /// The promised steps' common duration, 0 when they differ (then see `ends`).
    same_ns: u64,
    first: Fact,
    rest: QuietSteps,
    /// Each step's end when the promised durations differ (`ends[j - 1]` for step `j`); empty
    /// when they are all the same.
    ends: Vec<u64>,
}

impl QuietRun {
    fn new(worker: WorkerId, start_ns: u64, first: Fact, first_ns: u64, rest: QuietSteps) -> Self {
        let steps = rest.steps.saturating_add(1);
        let (same_ns, ends) = match &rest.durations {
            QuietDurations::Same(ns) => (*ns, Vec::new()),
            QuietDurations::Each(d) => {
                let first_end = start_ns.saturating_add(first_ns);
                let ends = std::iter::once(first_end)
                    .chain(d.iter().scan(first_end, |at, ns| {
                        *at = at.saturating_add(*ns);
                        Some(*at)
                    }))
                    .collect();
                (0, ends)
            }
        };
        QuietRun { worker, start_ns, first_ns, steps, written: 0, same_ns, first, rest, ends }
    }

    /// When step `step` (from 1) ends.
    pub(super) fn end_of(&self, step: u64) -> u64 {
        if self.same_ns > 0 {
            let rest_ns = step.saturating_sub(1).saturating_mul(self.same_ns);
            return self.start_ns.saturating_add(self.first_ns).saturating_add(rest_ns);
        }
        step.checked_sub(1).and_then(|i| self.ends.get(i as usize)).copied().unwrap_or(u64::MAX)
    }

    /// The fact step `step` (from 1) writes.
    fn fact_of(&self, step: u64) -> Fact {
        if step <= 1 {
            self.first.clone()
        } else {
            self.rest.fact(step - 2)
        }
    }

    /// When the next fact is due for [`Replay::write_quiet_until`], `u64::MAX` if none: the
    /// last step's fact is written by its own boundary event.
    fn next_due_ns(&self) -> u64 {
        if self.written + 1 < self.steps {
            self.end_of(self.written + 1)
        } else {
            u64::MAX
        }
    }
}

/// The quiet runs, with each run's next unwritten boundary kept apart in a few contiguous
/// words: every event pop asks for the earliest.
pub(super) struct QuietRuns {
    pub(super) enabled: bool,
    pub(super) runs: Vec<Option<QuietRun>>,
    /// Per slot: the end of the next step whose fact is due before the run's last boundary,
    /// `u64::MAX` when none.
    pub(super) next_at: Vec<u64>,
    /// The minimum of `next_at`.
    pub(super) earliest_ns: u64,
    /// Steps written by runs rather than by their own boundary event.
    pub(super) coalesced: u64,
}

impl QuietRuns {
    /// No run in progress on any of `slots` workers; `enabled` false turns coalescing off.
    pub(super) fn new(enabled: bool, slots: usize) -> Self {
        QuietRuns {
            enabled,
            runs: vec![None; slots],
            next_at: vec![u64::MAX; slots],
            earliest_ns: u64::MAX,
            coalesced: 0,
        }
    }

    pub(super) fn refresh(&mut self, slot: usize) {
        self.next_at[slot] = self.runs[slot].as_ref().map_or(u64::MAX, QuietRun::next_due_ns);
        self.earliest_ns = self.next_at.iter().copied().min().unwrap_or(u64::MAX);
    }
}

impl Replay<'_> {
    /// The quiet run a node began at `now` (see [`StepPlan::Quiet`](crate::runtime::StepPlan)).
    pub(super) fn quiet_run(&self, s: usize, first: Fact, first_ns: u64, rest: QuietSteps) -> QuietRun {
        QuietRun::new(self.nodes[s].id(), self.now_ns, first, first_ns, rest)
    }

    /// Writes every quiet step's fact whose boundary comes before `(at_ns, rank)` in the
    /// queue's order (boundaries rank by worker), across workers in that same order.
    pub(super) fn write_quiet_until(&mut self, at_ns: u64, rank: usize) -> Result<(), ReplayError> {
        loop {
            let mut best = (u64::MAX, usize::MAX);
            for (i, &t) in self.quiet.next_at.iter().enumerate() {
                if t < best.0 {
                    best = (t, i);
                }
            }
            if best >= (at_ns, rank) {
                // `best` is the minimum of `next_at`.
                self.quiet.earliest_ns = best.0;
                return Ok(());
            }
            let (t, s) = best;
            let Some(q) = self.quiet.runs[s].as_mut() else {
                return Err(ReplayError::Engine(format!("quiet run of slot {s} vanished")));
            };
            q.written += 1;
            let (worker, fact) = (q.worker, q.fact_of(q.written));
            // `earliest_ns` is brought up to date when the loop ends.
            self.quiet.next_at[s] = q.next_due_ns();
            self.events += 1;
            self.quiet.coalesced += 1;
            self.sink.push(worker, t, fact)?;
        }
    }

    /// The run's last boundary popped: the earlier facts are written; apply the run to the
    /// core and write the last step's fact.
    pub(super) fn finish_quiet(&mut self, s: usize, q: QuietRun) -> Result<(), ReplayError> {
        self.quiet.refresh(s);
        if q.written + 1 != q.steps || q.end_of(q.steps) != self.now_ns {
            return Err(ReplayError::Engine(format!(
                "{}: quiet run out of step ({} of {} written at t={} ns)",
                q.worker, q.written, q.steps, self.now_ns
            )));
        }
        self.nodes[s].advance_quiet(q.steps - 1);
        self.sink.push(q.worker, self.now_ns, q.fact_of(q.steps))
    }

    /// A command reached the worker mid-run, at `now`: every step that ended by now has its
    /// fact written, and the steps begun by now (one more) are applied; the one in flight
    /// becomes an ordinary pending step whose boundary is its end.
    pub(super) fn cut_quiet(&mut self, s: usize, q: QuietRun) -> Result<(), ReplayError> {
        self.quiet.refresh(s);
        let ended = q.written;
        if ended >= 1 && q.end_of(ended) == self.now_ns {
            // A step ended at this very instant and the next one would only start after
            // everything due now (a step start ranks last): the worker is free, as it would be
            // stepping one boundary at a time. Apply the steps that ran and take back the run's
            // last boundary; the command is applied at once and the worker starts again later
            // in this instant.
            if !self.queue.cancel_lane(s) {
                return Err(ReplayError::Engine(format!(
                    "{}: quiet run cut out of step (no boundary queued at t={} ns)",
                    q.worker, self.now_ns
                )));
            }
            self.nodes[s].end_quiet_free(ended - 1);
            self.queue.push_start(s, self.now_ns);
            return Ok(());
        }
        let in_flight_end = q.end_of(ended + 1);
        if ended >= q.steps || in_flight_end <= self.now_ns || !self.queue.move_lane(s, in_flight_end) {
            return Err(ReplayError::Engine(format!(
                "{}: quiet run cut out of step ({} of {} written at t={} ns)",
                q.worker, q.written, q.steps, self.now_ns
            )));
        }
        self.nodes[s].end_quiet_in_flight(ended, q.fact_of(ended + 1));
        Ok(())
    }
}
