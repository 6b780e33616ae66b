//! The stamped input queue of a live process (see the module docs of `live`).
//!
//! Inputs are handled strictly in `(stamp, rank, arrival)` order: a step start ranks after
//! everything else of its instant, as the replay's queue has it. The head is handed out once
//! the wall clock reaches its release: its instant, plus a hold for a process's own events
//! (so that messages stamped at or before that instant arrive first) and a longer one for a
//! step start. An input stamped before what the process already handled is late: it is
//! handled at the process's current instant, and counted.

use super::clock::ModelClock;
use super::LiveTiming;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How long an input is held past its instant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hold {
    /// From another process: it is already as late as the network made it.
    Message,
    /// The process's own event (a step end, a timer, a command handed back, an arrival).
    Own,
    /// A step start: after the chain of messages its instant causes.
    StepStart,
    /// A step start on an idle worker a message just woke: also not before a short gather
    /// window from now.
    StepStartWoken,
    /// The frontend's own event (an arrival, a timer).
    FrontendOwn,
    /// A worker's report at the frontend. Reports of one instant are taken in the order the
    /// replay's queue would have taken the events behind them: by the instant each was queued
    /// at on its worker (`cause_ns`: a step's end is queued when the step starts), then in
    /// worker order (`sender`), never in the order the network delivered them.
    Report { cause_ns: u64, sender: u32 },
}

/// How inputs lagged behind the model, for the report.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LagStats {
    pub handled: u64,
    /// Inputs stamped before an instant the process had already handled.
    pub late: u64,
    /// The most model time a late input had been overtaken by.
    pub max_late_ns: u64,
    /// Wall time from an input's release to its handling, summed and at most (how far the
    /// process fell behind the model beyond the holds).
    pub lag_sum_us: u64,
    pub max_lag_us: u64,
}

impl LagStats {
    pub fn mean_lag_us(&self) -> f64 {
        if self.handled == 0 {
            0.0
        } else {
            self.lag_sum_us as f64 / self.handled as f64
        }
    }
}

/// The queue is full: the process is far behind (a bug or an overloaded machine); the run
/// stops instead of growing without bound.
#[derive(Debug, thiserror::Error)]
#[error("more than {0} inputs wait to be handled")]
pub struct ScheduleFull(pub usize);

/// (stamp, rank, cause, sender, arrival).
type Key = (u64, u8, u64, u32, u64);

pub struct Schedule<T> {
    /// Key: (stamp, rank, cause, sender, arrival); value: (release, the stamp the process was at when
    /// the input was queued, the input).
    items: BTreeMap<Key, (Instant, u64, T)>,
    /// The queued-at stamp of the input handed out last.
    last_queued_ns: u64,
    seq: u64,
    /// The instant of the input handled last.
    last_ns: u64,
    limit: usize,
    event_hold: Duration,
    step_hold: Duration,
    gather: Duration,
    arrival_hold: Duration,
    report_hold: Duration,
    pub stats: LagStats,
}

impl<T> Schedule<T> {
    pub fn new(timing: &LiveTiming, limit: usize) -> Self {
        Schedule {
            items: BTreeMap::new(),
            seq: 0,
            last_ns: 0,
            last_queued_ns: 0,
            limit,
            event_hold: Duration::from_micros(timing.event_hold_us),
            step_hold: Duration::from_micros(timing.step_hold_us),
            gather: Duration::from_micros(timing.gather_us),
            arrival_hold: Duration::from_micros(timing.arrival_hold_us),
            report_hold: Duration::from_micros(timing.report_hold_us),
            stats: LagStats::default(),
        }
    }

    /// Queues `item` stamped `at_ns`.
    pub fn push(&mut self, clock: &ModelClock, at_ns: u64, hold: Hold, item: T) -> Result<(), ScheduleFull> {
        if self.items.len() >= self.limit {
            return Err(ScheduleFull(self.limit));
        }
        let stamp = if at_ns < self.last_ns {
            tracing::debug!(
                at_ms = at_ns as f64 / 1e6,
                handled_ms = self.last_ns as f64 / 1e6,
                model_now_ms = clock.model_at(Instant::now()) as f64 / 1e6,
                "late input"
            );
            self.stats.late += 1;
            self.stats.max_late_ns = self.stats.max_late_ns.max(self.last_ns - at_ns);
            self.last_ns
        } else {
            at_ns
        };
        let (rank, cause, sender, extra) = match hold {
            Hold::Message => (0, 0, 0, Duration::ZERO),
            Hold::Own => (0, 0, 0, self.event_hold),
            Hold::StepStart | Hold::StepStartWoken => (1, 0, 0, self.step_hold),
            Hold::FrontendOwn => (0, 0, 0, self.arrival_hold),
            Hold::Report { cause_ns, sender } => (0, cause_ns, sender, self.report_hold),
        };
        let mut release = clock.wall_at(stamp) + extra;
        if hold == Hold::StepStartWoken {
            release = release.max(Instant::now() + self.gather);
        }
        self.seq += 1;
        self.items.insert((stamp, rank, cause, sender, self.seq), (release, self.last_ns, item));
        Ok(())
    }

    /// When the head may be handled (`None`: nothing waits).
    pub fn next_release(&self) -> Option<Instant> {
        self.items.first_key_value().map(|(_, (release, _, _))| *release)
    }

    /// The stamp and input at the head.
    pub fn head(&self) -> Option<(u64, &T)> {
        self.items.first_key_value().map(|((stamp, ..), (_, _, item))| (*stamp, item))
    }

    /// The stamp the process was at when the input handed out last was queued.
    pub fn last_queued_ns(&self) -> u64 {
        self.last_queued_ns
    }

    /// The head, with its instant, if its release has come by `now`.
    pub fn pop_released(&mut self, now: Instant) -> Option<(u64, T)> {
        let (_, (release, _, _)) = self.items.first_key_value()?;
        if *release > now {
            return None;
        }
        let ((stamp, ..), (release, queued_ns, item)) = self.items.pop_first()?;
        self.last_queued_ns = queued_ns;
        let lag = now.saturating_duration_since(release).as_micros() as u64;
        self.stats.handled += 1;
        self.stats.lag_sum_us += lag;
        self.stats.max_lag_us = self.stats.max_lag_us.max(lag);
        self.last_ns = stamp;
        Some((stamp, item))
    }

    /// The instant of the input handled last.
    pub fn last_ns(&self) -> u64 {
        self.last_ns
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn timing() -> LiveTiming {
        LiveTiming {
            time_scale: 1.0,
            event_hold_us: 0,
            step_hold_us: 0,
            gather_us: 0,
            arrival_hold_us: 0,
            report_hold_us: 0,
            heartbeat_ms: 1000,
        }
    }

    proptest! {
        /// Whatever order inputs arrive in, they come out in stamp order (a step start after
        /// everything of its instant), and no stamp handed out goes backwards.
        #[test]
        fn inputs_come_out_in_stamp_order(
            pushes in proptest::collection::vec((0u64..50, any::<bool>()), 1..60),
            pop_after in proptest::collection::vec(any::<bool>(), 60),
        ) {
            let origin = Instant::now() - Duration::from_secs(1);
            let clock = ModelClock::new(origin, 1.0);
            let far = Instant::now() + Duration::from_secs(10);
            let mut s: Schedule<(u64, bool)> = Schedule::new(&timing(), 1000);
            let mut out: Vec<(u64, (u64, bool))> = Vec::new();
            for (i, (at, start)) in pushes.iter().enumerate() {
                let hold = if *start { Hold::StepStart } else { Hold::Message };
                s.push(&clock, *at, hold, (*at, *start)).unwrap();
                if pop_after[i] {
                    out.extend(s.pop_released(far));
                }
            }
            while let Some(x) = s.pop_released(far) {
                out.push(x);
            }
            prop_assert_eq!(out.len(), pushes.len());
            for w in out.windows(2) {
                prop_assert!(w[0].0 <= w[1].0, "stamps went backwards: {:?}", w);
            }
            // An input handed out at its own instant was not late; a later one never is early.
            for (stamp, (at, _)) in &out {
                prop_assert!(stamp >= at);
            }
            let late = out.iter().filter(|(stamp, (at, _))| stamp > at).count() as u64;
            prop_assert!(s.stats.late >= late);
        }
    }

    #[test]
    fn a_step_start_waits_for_messages_of_its_instant() {
        let clock = ModelClock::new(Instant::now() - Duration::from_secs(1), 1.0);
        let mut s: Schedule<&str> = Schedule::new(&timing(), 10);
        s.push(&clock, 5, Hold::StepStart, "start").unwrap();
        s.push(&clock, 5, Hold::Message, "message").unwrap();
        let now = Instant::now();
        assert_eq!(s.pop_released(now), Some((5, "message")));
        assert_eq!(s.pop_released(now), Some((5, "start")));
    }

    #[test]
    fn an_own_event_is_held_past_its_instant() {
        let t = LiveTiming { event_hold_us: 50_000, step_hold_us: 80_000, ..timing() };
        let origin = Instant::now();
        let clock = ModelClock::new(origin, 1.0);
        let mut s: Schedule<u8> = Schedule::new(&t, 10);
        s.push(&clock, 0, Hold::Own, 1).unwrap();
        assert_eq!(s.pop_released(origin + Duration::from_millis(10)), None);
        assert_eq!(s.pop_released(origin + Duration::from_millis(60)), Some((0, 1)));
        assert!(s.push(&clock, 0, Hold::Own, 2).is_ok());
        let mut full: Schedule<u8> = Schedule::new(&t, 1);
        full.push(&clock, 0, Hold::Own, 1).unwrap();
        assert!(full.push(&clock, 0, Hold::Own, 2).is_err());
    }
}
