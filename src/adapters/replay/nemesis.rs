//! Faults of the network and of the machines, as the simulator applies them: handoff messages
//! between workers lost, doubled or delayed (a random delay reorders them), links partitioned
//! and healed, a worker paused (its process stopped: nothing reaches it and it does nothing),
//! crashed and restarted under a new generation, or its timers made late by a clock jump.
//!
//! None of these reaches into a node: the simulator decides what is delivered and when, and a
//! crash is the node's own `restart`. Every draw comes from one stream seeded by the run's
//! seed, separate from the router's and the id mint's, so the same configuration and seed give
//! the same faults and turning them on changes no other draw. Message faults stop at `until_ms`
//! (when given): from there the network is clean and the run must drain on its own, which is
//! the liveness half of a fault run.
//!
//! Configuration: `"network": {"drop": 0.05, "duplicate": 0.05, "delay_ms": 20, "until_ms":
//! 60000, "partitions": [{"at_ms": 100, "heal_ms": 900, "workers": ["decode-0"]}], "pauses":
//! [{"worker": "prefill-1", "at_ms": 50, "for_ms": 400}], "crashes": [{"worker": "decode-1",
//! "at_ms": 700}], "clock_jumps": [{"worker": "prefill-0", "at_ms": 0, "late_ms": 200}]}`.

use crate::ids::WorkerId;
use crate::units::NS_PER_MS;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// What the network and the nemesis do to a run (all off by default).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NetworkFaults {
    /// Probability that a handoff message between workers is lost.
    pub drop: f64,
    /// Probability that it is delivered twice (the copy with a delay of its own).
    pub duplicate: f64,
    /// Each message waits a uniform draw in [0, delay_ms] ms: messages overtake each other.
    pub delay_ms: f64,
    /// Message faults (drop, duplicate, delay) stop here; `None`: for the whole run.
    pub until_ms: Option<u64>,
    pub partitions: Vec<Partition>,
    pub pauses: Vec<Pause>,
    pub crashes: Vec<Crash>,
    pub clock_jumps: Vec<ClockJump>,
}

/// From `at_ms` until `heal_ms`, handoff messages between the named workers and every other
/// worker are lost.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Partition {
    pub at_ms: u64,
    pub heal_ms: u64,
    pub workers: Vec<String>,
}

/// The worker's process is stopped for `for_ms` from `at_ms`: its steps, commands, timers and
/// messages wait until it resumes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pause {
    pub worker: String,
    pub at_ms: u64,
    pub for_ms: u64,
}

/// The worker crashes at `at_ms` and restarts at once under a new generation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Crash {
    pub worker: String,
    pub at_ms: u64,
}

/// Timers the worker arms from `at_ms` on fire `late_ms` late (its timer service stalled). A
/// timer never fires early: a node's timers and the instants it is told share one clock, so a
/// timer that came before its deadline would be a timer from before a renewal, which the role
/// machines rightly ignore.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClockJump {
    pub worker: String,
    pub at_ms: u64,
    pub late_ms: u64,
}

impl NetworkFaults {
    pub fn is_off(&self) -> bool {
        *self == NetworkFaults::default()
    }

    /// Checks every setting, naming the key: `known` are the workers the run may have.
    pub fn validate(&self, known: &[String], max_ms: u64) -> Result<(), String> {
        for (key, p) in [("drop", self.drop), ("duplicate", self.duplicate)] {
            if !(0.0..=1.0).contains(&p) {
                return Err(format!("network.{key} must be a probability in [0, 1], got {p}"));
            }
        }
        if !(self.delay_ms >= 0.0 && self.delay_ms <= max_ms as f64) {
            return Err(format!("network.delay_ms must be in [0, {max_ms}], got {}", self.delay_ms));
        }
        let worker = |key: &str, w: &str| {
            if known.iter().any(|k| k == w) {
                Ok(())
            } else {
                Err(format!("network.{key}: no worker {w:?} in this run (workers: {})", known.join(", ")))
            }
        };
        let instant = |key: &str, ms: u64| {
            if ms > max_ms {
                Err(format!("network.{key} is {ms} ms; at most {max_ms}"))
            } else {
                Ok(())
            }
        };
        if let Some(u) = self.until_ms {
            instant("until_ms", u)?;
        }
        for (i, p) in self.partitions.iter().enumerate() {
            instant(&format!("partitions[{i}].at_ms"), p.at_ms)?;
            instant(&format!("partitions[{i}].heal_ms"), p.heal_ms)?;
            if p.heal_ms < p.at_ms {
                return Err(format!(
                    "network.partitions[{i}]: heal_ms ({}) before at_ms ({})",
                    p.heal_ms, p.at_ms
                ));
            }
            for w in &p.workers {
                worker(&format!("partitions[{i}].workers"), w)?;
            }
        }
        for (i, p) in self.pauses.iter().enumerate() {
            worker(&format!("pauses[{i}].worker"), &p.worker)?;
            instant(&format!("pauses[{i}].at_ms"), p.at_ms)?;
            instant(&format!("pauses[{i}].for_ms"), p.for_ms)?;
        }
        for (i, c) in self.crashes.iter().enumerate() {
            worker(&format!("crashes[{i}].worker"), &c.worker)?;
            instant(&format!("crashes[{i}].at_ms"), c.at_ms)?;
        }
        for (i, j) in self.clock_jumps.iter().enumerate() {
            worker(&format!("clock_jumps[{i}].worker"), &j.worker)?;
            instant(&format!("clock_jumps[{i}].at_ms"), j.at_ms)?;
            instant(&format!("clock_jumps[{i}].late_ms"), j.late_ms)?;
        }
        Ok(())
    }
}

/// What the nemesis did, for the report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NetworkReport {
    pub dropped: u64,
    pub duplicated: u64,
    pub delayed: u64,
    pub partitioned: u64,
    pub paused: u64,
    pub crashed: u64,
}

/// The nemesis during a run.
pub(crate) struct Nemesis {
    pub config: NetworkFaults,
    /// `config.is_off()`, kept: it is asked on every event.
    off: bool,
    rng: ChaCha8Rng,
    pub report: NetworkReport,
    /// Per slot: paused until this instant (0: running).
    pub paused_until_ns: Vec<u64>,
}

/// What happens to one handoff message: delivered after each of these delays (none: lost).
pub(crate) struct Fate {
    pub deliveries: [Option<u64>; 2],
}

impl Nemesis {
    pub fn new(config: NetworkFaults, seed: u64, slots: usize) -> Self {
        // A stream of its own: the run's other draws do not move when faults are turned on.
        let rng = ChaCha8Rng::seed_from_u64(seed ^ 0x6e65_6d65_7369_7321);
        let off = config.is_off();
        Nemesis { config, off, rng, report: NetworkReport::default(), paused_until_ns: vec![0; slots] }
    }

    pub fn is_off(&self) -> bool {
        self.off
    }

    /// Whether handoff messages between `a` and `b` are cut by a partition at `at_ns`.
    fn partitioned(&self, a: WorkerId, b: WorkerId, at_ns: u64) -> bool {
        let (a, b) = (a.to_string(), b.to_string());
        self.config.partitions.iter().any(|p| {
            let (from, to) = (p.at_ms.saturating_mul(NS_PER_MS), p.heal_ms.saturating_mul(NS_PER_MS));
            let inside = |w: &String| p.workers.contains(w);
            at_ns >= from && at_ns < to && inside(&a) != inside(&b)
        })
    }

    /// The fate of a handoff message sent from `from` to `to` at `at_ns`.
    pub fn fate(&mut self, from: WorkerId, to: WorkerId, at_ns: u64) -> Fate {
        if self.partitioned(from, to, at_ns) {
            self.report.partitioned += 1;
            return Fate { deliveries: [None, None] };
        }
        let active = self.config.until_ms.map_or(true, |u| at_ns < u.saturating_mul(NS_PER_MS));
        if !active {
            return Fate { deliveries: [Some(0), None] };
        }
        if self.config.drop > 0.0 && self.rng.random_bool(self.config.drop) {
            self.report.dropped += 1;
            return Fate { deliveries: [None, None] };
        }
        let first = self.delay_ns();
        let second = if self.config.duplicate > 0.0 && self.rng.random_bool(self.config.duplicate) {
            self.report.duplicated += 1;
            Some(self.delay_ns())
        } else {
            None
        };
        Fate { deliveries: [Some(first), second] }
    }

    fn delay_ns(&mut self) -> u64 {
        if self.config.delay_ms <= 0.0 {
            return 0;
        }
        self.report.delayed += 1;
        let max_ns = (self.config.delay_ms * NS_PER_MS as f64) as u64;
        self.rng.random_range(0..=max_ns)
    }

    /// Where a timer of `worker` armed at `armed_ns` for `at_ns` fires, after clock jumps.
    pub fn timer_at(&self, worker: WorkerId, armed_ns: u64, at_ns: u64) -> u64 {
        let name = worker.to_string();
        let late_ns: u64 = self
            .config
            .clock_jumps
            .iter()
            .filter(|j| j.worker == name && armed_ns >= j.at_ms.saturating_mul(NS_PER_MS))
            .map(|j| j.late_ms.saturating_mul(NS_PER_MS))
            .fold(0, u64::saturating_add);
        at_ns.saturating_add(late_ns)
    }

    /// Until when slot `s` is paused at `at_ns` (`None`: running).
    pub fn paused(&self, s: usize, at_ns: u64) -> Option<u64> {
        self.paused_until_ns.get(s).copied().filter(|u| *u > at_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_draws_the_same_fates_and_validation_names_the_key() {
        let config = NetworkFaults { drop: 0.3, duplicate: 0.3, delay_ms: 5.0, ..NetworkFaults::default() };
        let (p, d) = (WorkerId::prefill(0), WorkerId::decode(0));
        let draw = |seed| {
            let mut n = Nemesis::new(config.clone(), seed, 2);
            (0..200).map(|i| n.fate(p, d, i).deliveries).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        let all = draw(7);
        assert!(all.iter().any(|f| f[0].is_none()) && all.iter().any(|f| f[1].is_some()));
        let known = vec!["prefill-0".to_string(), "decode-0".to_string()];
        let bad = NetworkFaults { drop: 1.5, ..NetworkFaults::default() };
        assert!(bad.validate(&known, 1000).unwrap_err().contains("network.drop"));
        let bad = NetworkFaults {
            pauses: vec![Pause { worker: "decode-9".into(), at_ms: 0, for_ms: 1 }],
            ..NetworkFaults::default()
        };
        assert!(bad.validate(&known, 1000).unwrap_err().contains("pauses[0].worker"));
    }

    #[test]
    fn a_partition_cuts_only_links_across_it_and_heals() {
        let config = NetworkFaults {
            partitions: vec![Partition { at_ms: 1, heal_ms: 2, workers: vec!["decode-0".into()] }],
            ..NetworkFaults::default()
        };
        let mut n = Nemesis::new(config, 0, 3);
        let (p, d0, d1) = (WorkerId::prefill(0), WorkerId::decode(0), WorkerId::decode(1));
        assert!(n.fate(p, d0, 1_500_000).deliveries[0].is_none());
        assert_eq!(n.fate(p, d1, 1_500_000).deliveries[0], Some(0));
        assert_eq!(n.fate(p, d0, 2_000_000).deliveries[0], Some(0), "healed");
        assert_eq!(n.fate(p, d0, 500_000).deliveries[0], Some(0), "not yet");
    }

    #[test]
    fn clock_jumps_make_timers_armed_after_them_late() {
        let config = NetworkFaults {
            clock_jumps: vec![ClockJump { worker: "prefill-0".into(), at_ms: 10, late_ms: 50 }],
            ..NetworkFaults::default()
        };
        let n = Nemesis::new(config, 0, 1);
        let w = WorkerId::prefill(0);
        assert_eq!(n.timer_at(w, 5 * NS_PER_MS, 100 * NS_PER_MS), 100 * NS_PER_MS, "armed before the jump");
        assert_eq!(n.timer_at(w, 20 * NS_PER_MS, 100 * NS_PER_MS), 150 * NS_PER_MS);
        assert_eq!(n.timer_at(WorkerId::decode(0), 20 * NS_PER_MS, 30 * NS_PER_MS), 30 * NS_PER_MS);
    }
}
