//! Changing the cluster's shape during a replay: planned changes (`scale`) and a simple SLO
//! planner (`planner`), with what each decision did.
//!
//! ## Semantics
//! * A worker that **joins** takes the next index of its role (indices are never reused, so a
//!   stream always belongs to one worker), writes `SessionStarted` at the join instant as the
//!   first record of a stream created then, and both routers may select it from that instant.
//! * A worker that is **removed** is the highest-indexed worker of its role still taking work.
//!   From that instant its router never selects it; everything it holds (requests, pinned
//!   sources, reservations, router bookings) ends as it would have, and once nothing is left it
//!   writes `WorkerLeft` as its stream's last record before the end marker. A role always keeps one worker
//!   taking work: a removal that would take the last one is refused.
//! * The **planner** looks, every `interval_ms`, at the requests completed in the last
//!   `window_ms` (a bounded ring of their TTFT and TPOT, kept from the outputs the replay
//!   already handles). TTFT p90 over `ttft_ms_p90` adds a prefill worker, TPOT p90 (the mean
//!   inter-token latency of each request) over `itl_ms_p90` adds a decode worker; when both are
//!   under `scale_down_below` × their targets, one worker of each role is removed. Each role
//!   changes at most once per `cooldown_ms` (planner decisions only; planned changes do not
//!   count) and stays within `min_*..=max_*`. Decisions use virtual time only, so they are
//!   deterministic.

use crate::ids::Role;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

use crate::units::NS_PER_MS;

/// Completed requests the planner remembers at most; older ones leave the ring first (a window
/// holding more would be judged on its latest requests only).
pub const MAX_PLANNER_SAMPLES: usize = 1 << 16;

/// One planned change, e.g. `{"at_ms": 60000, "decode": 2}` (positive adds workers, negative
/// removes them, draining).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScaleEntry {
    pub at_ms: u64,
    #[serde(default)]
    pub prefill: i32,
    #[serde(default)]
    pub decode: i32,
}

/// The SLO planner's settings (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PlannerConfig {
    pub ttft_ms_p90: f64,
    pub itl_ms_p90: f64,
    pub window_ms: u64,
    pub interval_ms: u64,
    pub cooldown_ms: u64,
    pub min_prefill: u32,
    pub max_prefill: u32,
    pub min_decode: u32,
    pub max_decode: u32,
    /// Both quantiles under this share of their targets removes workers.
    pub scale_down_below: f64,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        PlannerConfig {
            ttft_ms_p90: 2000.0,
            itl_ms_p90: 50.0,
            window_ms: 30_000,
            interval_ms: 10_000,
            cooldown_ms: 60_000,
            min_prefill: 1,
            max_prefill: 8,
            min_decode: 1,
            max_decode: 8,
            scale_down_below: 0.5,
        }
    }
}

/// Checks a plan against the starting cluster, naming the offending entry or key.
/// `max_duration_ms` and `max_workers` are the configuration's general bounds.
pub fn validate(
    scale: &[ScaleEntry],
    planner: Option<&PlannerConfig>,
    start: (u32, u32),
    max_duration_ms: u64,
    max_workers: u32,
) -> Result<(), String> {
    let (mut prefill, mut decode) = (i64::from(start.0), i64::from(start.1));
    let (mut created_prefill, mut created_decode) = (prefill, decode);
    let limit = i64::from(max_workers);
    for (i, e) in scale.iter().enumerate() {
        let name = format!("scale[{i}] (at_ms {})", e.at_ms);
        if e.at_ms > max_duration_ms {
            return Err(format!("{name}: at_ms is at most {max_duration_ms}"));
        }
        if let Some(prev) = i.checked_sub(1).map(|p| scale[p]) {
            if e.at_ms < prev.at_ms {
                return Err(format!(
                    "{name} comes before scale[{}] (at_ms {}): entries must be in non-decreasing at_ms order",
                    i - 1,
                    prev.at_ms
                ));
            }
        }
        if e.prefill == 0 && e.decode == 0 {
            return Err(format!("{name} changes nothing: give `prefill` or `decode` a non-zero count"));
        }
        for (role, change, active, created) in [
            ("prefill", e.prefill, &mut prefill, &mut created_prefill),
            ("decode", e.decode, &mut decode, &mut created_decode),
        ] {
            let change = i64::from(change);
            if change.abs() > limit {
                return Err(format!("{name}: {role} {change} is more than {max_workers} workers"));
            }
            *active += change;
            if change > 0 {
                *created += change;
            }
            if *active < 1 {
                return Err(format!(
                    "{name} would remove the last {role} worker ({} taking work before it); a role keeps at least one",
                    *active - change
                ));
            }
            if *created > limit {
                return Err(format!(
                    "{name} would make {created} {role} workers over the run; at most {max_workers} per role"
                ));
            }
        }
    }
    if let Some(p) = planner {
        p.validate(start, max_duration_ms, max_workers)?;
    }
    Ok(())
}

impl PlannerConfig {
    fn validate(&self, start: (u32, u32), max_duration_ms: u64, max_workers: u32) -> Result<(), String> {
        for (key, v) in [("ttft_ms_p90", self.ttft_ms_p90), ("itl_ms_p90", self.itl_ms_p90)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("planner.{key} must be a positive number of ms, got {v}"));
            }
        }
        if !(self.scale_down_below.is_finite() && self.scale_down_below > 0.0 && self.scale_down_below < 1.0)
        {
            return Err(format!(
                "planner.scale_down_below must be between 0 and 1 (a share of the targets), got {}",
                self.scale_down_below
            ));
        }
        for (key, ms, zero_ok) in [
            ("window_ms", self.window_ms, false),
            ("interval_ms", self.interval_ms, false),
            ("cooldown_ms", self.cooldown_ms, true),
        ] {
            if (ms == 0 && !zero_ok) || ms > max_duration_ms {
                let low = if zero_ok { 0 } else { 1 };
                return Err(format!("planner.{key} is {ms}; give {low}..={max_duration_ms} ms"));
            }
        }
        for (role, min, max, now) in [
            ("prefill", self.min_prefill, self.max_prefill, start.0),
            ("decode", self.min_decode, self.max_decode, start.1),
        ] {
            if min < 1 {
                return Err(format!("planner.min_{role} must be >= 1: a role keeps at least one worker"));
            }
            if min > max || max > max_workers {
                return Err(format!(
                    "planner.min_{role} ({min}) and max_{role} ({max}) must satisfy 1 <= min <= max <= {max_workers}"
                ));
            }
            if now < min || now > max {
                return Err(format!(
                    "planner: the run starts with {now} {role} workers, outside min_{role}..=max_{role} ({min}..={max})"
                ));
            }
        }
        Ok(())
    }
}

/// A role the cluster scales: prefill or decode.
pub fn role_name(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        _ => "decode",
    }
}

/// One worker a scaling decision added or took out of routing.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ScaledWorker {
    pub worker: String,
    /// When a removed worker had drained and left (`WorkerLeft`); `None` for an added worker,
    /// or a removed one that never drained.
    pub left_at_ms: Option<f64>,
}

/// What one planned entry or planner decision did to one role.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ScalingDecision {
    pub at_ms: f64,
    pub role: &'static str,
    /// Workers added (positive) or taken out of routing (negative), as applied.
    pub change: i32,
    /// `planned (scale[i])` or the planner's measurement, plus any part refused.
    pub reason: String,
    pub workers: Vec<ScaledWorker>,
}

/// A change the planner wants now.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannerChange {
    pub role: Role,
    pub change: i32,
    pub reason: String,
}

#[derive(Clone, Copy, Debug)]
struct Sample {
    finished_ns: u64,
    ttft_ns: u64,
    /// Requests with one output token have no inter-token latency.
    tpot_ns: Option<u64>,
}

/// The planner's state: recent completions and when each role last changed.
#[derive(Clone, Debug)]
pub struct Planner {
    cfg: PlannerConfig,
    samples: VecDeque<Sample>,
    /// Prefill, decode.
    last_change_ns: [Option<u64>; 2],
}

/// The `q` quantile of `v` (sorted in place), interpolating linearly between order statistics.
fn quantile(v: &mut [u64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    let pos = q * (v.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = (lo + 1).min(v.len() - 1);
    let frac = pos - lo as f64;
    Some(v[lo] as f64 + (v[hi] as f64 - v[lo] as f64) * frac)
}

fn slot(role: Role) -> usize {
    usize::from(role != Role::Prefill)
}

impl Planner {
    pub fn new(cfg: PlannerConfig) -> Self {
        Planner { cfg, samples: VecDeque::new(), last_change_ns: [None; 2] }
    }

    pub fn interval_ns(&self) -> u64 {
        self.cfg.interval_ms.saturating_mul(NS_PER_MS)
    }

    /// A request completed at `finished_ns` (virtual time never goes back, so the ring stays in
    /// finish order).
    pub fn record(&mut self, finished_ns: u64, ttft_ns: u64, tpot_ns: Option<u64>) {
        if self.samples.len() >= MAX_PLANNER_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back(Sample { finished_ns, ttft_ns, tpot_ns });
    }

    fn cooled(&self, role: Role, now_ns: u64) -> bool {
        let cooldown_ns = self.cfg.cooldown_ms.saturating_mul(NS_PER_MS);
        self.last_change_ns[slot(role)].map_or(true, |t| now_ns >= t.saturating_add(cooldown_ns))
    }

    /// The planner applied a change of `role` at `now_ns`: its cooldown starts.
    pub fn changed(&mut self, role: Role, now_ns: u64) {
        self.last_change_ns[slot(role)] = Some(now_ns);
    }

    /// What to change now, given how many workers of each role take work (prefill, decode).
    /// Requests that finished `window_ms` or longer ago leave the ring first.
    pub fn decide(&mut self, now_ns: u64, active: (u32, u32)) -> Vec<PlannerChange> {
        let window_ns = self.cfg.window_ms.saturating_mul(NS_PER_MS);
        while self.samples.front().is_some_and(|s| s.finished_ns.saturating_add(window_ns) <= now_ns) {
            self.samples.pop_front();
        }
        let mut ttft: Vec<u64> = self.samples.iter().map(|s| s.ttft_ns).collect();
        let mut itl: Vec<u64> = self.samples.iter().filter_map(|s| s.tpot_ns).collect();
        let (n_ttft, n_itl) = (ttft.len(), itl.len());
        let ms = |ns: f64| ns / 1e6;
        let ttft_ms = quantile(&mut ttft, 0.9).map(ms);
        let itl_ms = quantile(&mut itl, 0.9).map(ms);
        let window_s = self.cfg.window_ms as f64 / 1e3;
        let mut out = Vec::new();
        let c = self.cfg;
        if let Some(q) = ttft_ms.filter(|q| *q > c.ttft_ms_p90) {
            if active.0 < c.max_prefill && self.cooled(Role::Prefill, now_ns) {
                out.push(PlannerChange {
                    role: Role::Prefill,
                    change: 1,
                    reason: format!(
                        "TTFT p90 {q:.1} ms > target {} ms over {n_ttft} requests in the last {window_s} s",
                        c.ttft_ms_p90
                    ),
                });
            }
        }
        if let Some(q) = itl_ms.filter(|q| *q > c.itl_ms_p90) {
            if active.1 < c.max_decode && self.cooled(Role::Decode, now_ns) {
                out.push(PlannerChange {
                    role: Role::Decode,
                    change: 1,
                    reason: format!(
                        "ITL (TPOT) p90 {q:.2} ms > target {} ms over {n_itl} requests in the last {window_s} s",
                        c.itl_ms_p90
                    ),
                });
            }
        }
        if let (Some(t), Some(i)) = (ttft_ms, itl_ms) {
            let low = c.scale_down_below;
            if t < low * c.ttft_ms_p90 && i < low * c.itl_ms_p90 {
                let reason = format!(
                    "TTFT p90 {t:.1} ms and ITL (TPOT) p90 {i:.2} ms both under {:.0}% of their targets ({} / {} ms) over {n_ttft} requests in the last {window_s} s",
                    low * 100.0,
                    c.ttft_ms_p90,
                    c.itl_ms_p90
                );
                for (role, now, min) in
                    [(Role::Prefill, active.0, c.min_prefill), (Role::Decode, active.1, c.min_decode)]
                {
                    if now > min && self.cooled(role, now_ns) {
                        out.push(PlannerChange { role, change: -1, reason: reason.clone() });
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantile_interpolates_between_order_statistics() {
        assert_eq!(quantile(&mut [], 0.9), None);
        assert_eq!(quantile(&mut [5], 0.9), Some(5.0));
        // pos = 0.9 × 9 = 8.1: between the 9th (80) and 10th (90) values.
        let mut v: Vec<u64> = (1..=10).rev().map(|x| x * 10).collect();
        let q = quantile(&mut v, 0.9).unwrap();
        assert!((q - 91.0).abs() < 1e-9, "{q}");
    }

    #[test]
    fn planner_adds_within_max_and_cooldown_and_removes_when_both_are_low() {
        let cfg = PlannerConfig {
            itl_ms_p90: 10.0,
            cooldown_ms: 20_000,
            max_decode: 3,
            window_ms: 10_000,
            ..PlannerConfig::default()
        };
        let mut p = Planner::new(cfg);
        let s = NS_PER_MS * 1000;
        p.record(s, 100 * NS_PER_MS, Some(20 * NS_PER_MS));
        let d = p.decide(2 * s, (1, 2));
        assert_eq!(d.len(), 1);
        assert_eq!((d[0].role, d[0].change), (Role::Decode, 1));
        p.changed(Role::Decode, 2 * s);
        p.record(3 * s, 100 * NS_PER_MS, Some(20 * NS_PER_MS));
        assert!(p.decide(4 * s, (1, 3)).is_empty(), "at max");
        assert!(p.decide(4 * s, (1, 2)).is_empty(), "cooling down");
        assert_eq!(p.decide(22 * s, (1, 2)).len(), 0, "the sample left the window");
        p.record(23 * s, 100 * NS_PER_MS, Some(20 * NS_PER_MS));
        assert_eq!(p.decide(23 * s, (1, 2)).len(), 1, "cooled down");
        // Both far under target: one of each role above its minimum goes.
        let mut p = Planner::new(cfg);
        p.record(s, NS_PER_MS, Some(NS_PER_MS));
        let d = p.decide(s, (2, 1));
        assert_eq!(d.len(), 1);
        assert_eq!((d[0].role, d[0].change), (Role::Prefill, -1));
    }

    #[test]
    fn plans_are_checked_in_order_and_keep_a_worker_per_role() {
        let e = |at_ms, prefill, decode| ScaleEntry { at_ms, prefill, decode };
        let v = |s: &[ScaleEntry]| validate(s, None, (2, 2), 1_000_000, 16);
        assert!(v(&[e(10, 0, 2), e(20, -1, -3)]).is_ok());
        let err = v(&[e(20, 0, 1), e(10, 0, 1)]).unwrap_err();
        assert!(err.contains("scale[1]") && err.contains("non-decreasing"), "{err}");
        let err = v(&[e(10, 0, -1), e(20, 0, -1)]).unwrap_err();
        assert!(err.contains("scale[1]") && err.contains("last decode worker"), "{err}");
        assert!(v(&[e(10, 0, 0)]).unwrap_err().contains("changes nothing"));
        assert!(v(&[e(10, 15, 0)]).unwrap_err().contains("at most 16"));
    }
}
