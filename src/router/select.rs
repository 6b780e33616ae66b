//! Selection modes and the pure choice functions behind them.

use crate::ids::WorkerId;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// How a stage router picks a worker. In a config file:
/// `router = { mode = "kv", overlap_weight = 1.0, temperature = 0.0 }`; on the command line the
/// mode's name (`round-robin`, `random`, `kv`, `least-loaded`, `p2c`, `device-aware`) with its
/// defaults.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "kebab-case", try_from = "serde_json::Value")]
pub enum RouterMode {
    /// Workers in id order, one after another. The reference's default.
    #[default]
    RoundRobin,
    /// Uniformly at random (seeded).
    Random,
    /// Lowest cost = `overlap_weight` × uncached prompt blocks + booked blocks; temperature 0
    /// takes the minimum (equal costs: one of them uniformly at random, seeded, as the
    /// reference's selector does), > 0 samples softmax(−cost / T).
    #[serde(rename = "kv")]
    KvAware { overlap_weight: f64, temperature: f64 },
    /// Fewest booked blocks; ties to the lowest worker id.
    LeastLoaded,
    /// Two distinct workers at random (seeded); the one with fewer booked blocks, ties to the
    /// lower id.
    #[serde(rename = "p2c")]
    PowerOfTwo,
    /// Fewest booked blocks divided by the worker's weight (a faster device takes more); ties
    /// to the lowest id. `weights[i]` belongs to the i-th worker in id order; empty means all 1.
    DeviceAware { weights: Vec<f64> },
}

fn default_overlap_weight() -> f64 {
    1.0
}

/// What a config may say. Parsed flat and checked by hand, because serde's internally tagged
/// enums accept (and drop) stray fields on unit variants: `{mode = "round-robin", weights = [1]}`
/// must be an error, not silently a round-robin.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRouterMode {
    mode: String,
    overlap_weight: Option<f64>,
    temperature: Option<f64>,
    weights: Option<Vec<f64>>,
}

/// A config gives a mode either as the command line's name (`"kv"`) or as a table with its
/// parameters (`{"mode": "kv", "temperature": 0.5}`).
impl TryFrom<serde_json::Value> for RouterMode {
    type Error = String;
    fn try_from(v: serde_json::Value) -> Result<Self, String> {
        match v {
            serde_json::Value::String(name) => name.parse(),
            table @ serde_json::Value::Object(_) => {
                let raw: RawRouterMode = serde_json::from_value(table).map_err(|e| e.to_string())?;
                raw.try_into()
            }
            other => {
                Err(format!("a router mode is a name such as \"kv\" or a table with a `mode`, got {other}"))
            }
        }
    }
}

impl TryFrom<RawRouterMode> for RouterMode {
    type Error = String;
    fn try_from(raw: RawRouterMode) -> Result<Self, String> {
        let mut mode: RouterMode = raw.mode.parse()?;
        let stray = |field: &str| Err(format!("router mode `{}` takes no `{field}`", raw.mode));
        match &mut mode {
            RouterMode::KvAware { overlap_weight, temperature } => {
                if raw.weights.is_some() {
                    return stray("weights");
                }
                *overlap_weight = raw.overlap_weight.unwrap_or(*overlap_weight);
                *temperature = raw.temperature.unwrap_or(*temperature);
            }
            RouterMode::DeviceAware { weights } => {
                if raw.overlap_weight.is_some() {
                    return stray("overlap_weight");
                }
                if raw.temperature.is_some() {
                    return stray("temperature");
                }
                *weights = raw.weights.unwrap_or_default();
            }
            _ => {
                if raw.overlap_weight.is_some() {
                    return stray("overlap_weight");
                }
                if raw.temperature.is_some() {
                    return stray("temperature");
                }
                if raw.weights.is_some() {
                    return stray("weights");
                }
            }
        }
        Ok(mode)
    }
}

impl RouterMode {
    /// The KV-aware mode with the reference's defaults (weight 1.0, temperature 0).
    pub fn kv() -> Self {
        RouterMode::KvAware { overlap_weight: 1.0, temperature: 0.0 }
    }

    /// The CLI name.
    pub fn name(&self) -> &'static str {
        match self {
            RouterMode::RoundRobin => "round-robin",
            RouterMode::Random => "random",
            RouterMode::KvAware { .. } => "kv",
            RouterMode::LeastLoaded => "least-loaded",
            RouterMode::PowerOfTwo => "p2c",
            RouterMode::DeviceAware { .. } => "device-aware",
        }
    }

    /// Checks the parameters against a router of `workers` workers.
    pub fn validate(&self, workers: usize) -> Result<(), String> {
        match self {
            RouterMode::KvAware { overlap_weight, temperature } => {
                if !(overlap_weight.is_finite() && *overlap_weight >= 0.0) {
                    return Err(format!(
                        "kv router: overlap_weight must be finite and >= 0, got {overlap_weight}"
                    ));
                }
                if !(temperature.is_finite() && *temperature >= 0.0) {
                    return Err(format!("kv router: temperature must be finite and >= 0, got {temperature}"));
                }
            }
            RouterMode::DeviceAware { weights } => {
                if !weights.is_empty() && weights.len() != workers {
                    return Err(format!(
                        "device-aware router: {} weights for {workers} workers (give one per worker, in id order)",
                        weights.len()
                    ));
                }
                if let Some(w) = weights.iter().find(|w| !(w.is_finite() && **w > 0.0)) {
                    return Err(format!("device-aware router: weights must be finite and > 0, got {w}"));
                }
            }
            _ => {}
        }
        Ok(())
    }
}

impl std::str::FromStr for RouterMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "round-robin" => RouterMode::RoundRobin,
            "random" => RouterMode::Random,
            "kv" => RouterMode::KvAware { overlap_weight: default_overlap_weight(), temperature: 0.0 },
            "least-loaded" => RouterMode::LeastLoaded,
            "p2c" => RouterMode::PowerOfTwo,
            "device-aware" => RouterMode::DeviceAware { weights: Vec::new() },
            other => {
                return Err(format!(
                    "unknown router mode `{other}` (expected round-robin, random, kv, least-loaded, p2c or device-aware)"
                ))
            }
        })
    }
}

impl std::fmt::Display for RouterMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The worker with the lowest cost; equal costs go to the lowest worker id. `costs` must be in
/// ascending worker order (the first minimum wins). `None` only for an empty input.
pub fn lowest_cost(costs: impl IntoIterator<Item = (WorkerId, f64)>) -> Option<WorkerId> {
    let mut best: Option<(WorkerId, f64)> = None;
    for (w, c) in costs {
        match best {
            Some((_, b)) if c.total_cmp(&b).is_ge() => {}
            _ => best = Some((w, c)),
        }
    }
    best.map(|(w, _)| w)
}

/// The worker with the lowest cost; among equal lowest costs one uniformly at random (a
/// reservoir draw per tie, so the stream is consumed only when there is a tie). Without this,
/// a light load with no shared prefixes sends every request to the first worker.
pub fn lowest_cost_random_tie(costs: &[(WorkerId, f64)], rng: &mut ChaCha8Rng) -> Option<WorkerId> {
    let mut best: Option<(WorkerId, f64)> = None;
    let mut ties = 0u64;
    for &(w, c) in costs {
        match best {
            Some((_, b)) if c.total_cmp(&b).is_gt() => {}
            Some((_, b)) if c.total_cmp(&b).is_eq() => {
                ties += 1;
                if rng.random_range(0..ties) == 0 {
                    best = Some((w, c));
                }
            }
            _ => {
                best = Some((w, c));
                ties = 1;
            }
        }
    }
    best.map(|(w, _)| w)
}

/// Samples a worker with probability ∝ exp(−(cost − min cost) / temperature). Shifting by the
/// minimum keeps the best worker's weight at 1, so nothing underflows to an all-zero sum.
pub fn softmax_pick(costs: &[(WorkerId, f64)], temperature: f64, rng: &mut ChaCha8Rng) -> Option<WorkerId> {
    let min = costs.iter().map(|(_, c)| *c).min_by(f64::total_cmp)?;
    let weights: Vec<f64> = costs.iter().map(|(_, c)| (-(c - min) / temperature).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut r = rng.random::<f64>() * total;
    for ((w, _), p) in costs.iter().zip(&weights) {
        if r < *p {
            return Some(*w);
        }
        r -= p;
    }
    // Rounding left a sliver past the last weight: the last worker takes it.
    costs.last().map(|(w, _)| *w)
}

/// Two distinct indices in `0..n` (n ≥ 2), uniformly.
pub fn two_distinct(n: usize, rng: &mut ChaCha8Rng) -> (usize, usize) {
    let a = rng.random_range(0..n);
    let mut b = rng.random_range(0..n - 1);
    if b >= a {
        b += 1;
    }
    (a, b)
}
