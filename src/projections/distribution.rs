//! A bounded-memory distribution of non-negative durations: exact count, mean, min, max and
//! standard deviation, and percentiles from log-linear buckets with under 0.1% relative error.
//!
//! Memory is bounded by the value range (about 1,024 buckets per power of two in use), not by
//! the number of samples: a replay of any trace length keeps a few thousand buckets per figure.

use serde::Serialize;

/// Sub-buckets per power of two: relative bucket width 1/1024 ≈ 0.1%.
const SUB_BITS: u32 = 10;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Distribution {
    count: u64,
    sum: f64,
    sum_sq: f64,
    min: f64,
    max: f64,
    /// Bucket weights by key, in groups of `2^SUB_BITS` keys (one group per power of two of
    /// the values, allocated on first use). Keys order like the values they hold. A flat
    /// array instead of a map: adding a sample (once per decode step) is two indexings.
    groups: Vec<Option<Box<[u64; GROUP]>>>,
}

/// Keys per bucket group.
const GROUP: usize = 1 << SUB_BITS;

/// Summary statistics in the reference's set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Stats {
    pub count: u64,
    pub mean: f64,
    pub min: f64,
    pub max: f64,
    pub p50: f64,
    pub p75: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
    pub std: f64,
}

fn bucket_of(value_ns: u64) -> u32 {
    // Values below 2^SUB_BITS get one bucket each (exact); above, the top SUB_BITS+1 bits.
    if value_ns < (1 << SUB_BITS) {
        return value_ns as u32;
    }
    let exp = 63 - value_ns.leading_zeros(); // >= SUB_BITS
    let shift = exp - SUB_BITS;
    let mantissa = (value_ns >> shift) as u32; // in [2^SUB_BITS, 2^(SUB_BITS+1))
    ((shift + 1) << SUB_BITS) + (mantissa - (1 << SUB_BITS))
}

/// The midpoint of a bucket's value range.
fn bucket_mid(key: u32) -> f64 {
    if key < (1 << SUB_BITS) {
        return key as f64;
    }
    let shift = (key >> SUB_BITS) - 1;
    let mantissa = (key & ((1 << SUB_BITS) - 1)) + (1 << SUB_BITS);
    let lo = (mantissa as u64) << shift;
    let width = 1u64 << shift;
    lo as f64 + (width as f64 - 1.0) / 2.0
}

impl Distribution {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `weight` samples of `value_ns`.
    pub fn add_weighted(&mut self, value_ns: u64, weight: u64) {
        if weight == 0 {
            return;
        }
        let v = value_ns as f64;
        if self.count == 0 || v < self.min {
            self.min = v;
        }
        if self.count == 0 || v > self.max {
            self.max = v;
        }
        self.count += weight;
        self.sum += v * weight as f64;
        self.sum_sq += v * v * weight as f64;
        let key = bucket_of(value_ns) as usize;
        let g = key >> SUB_BITS;
        if self.groups.len() <= g {
            self.groups.resize_with(g + 1, || None);
        }
        self.groups[g].get_or_insert_with(|| Box::new([0; GROUP]))[key & (GROUP - 1)] += weight;
    }

    pub fn add(&mut self, value_ns: u64) {
        self.add_weighted(value_ns, 1)
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// The value at quantile `q` in [0, 1] (nearest rank over buckets, clamped to min/max).
    pub fn quantile(&self, q: f64) -> f64 {
        if self.count == 0 {
            return 0.0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0u64;
        for (g, group) in self.groups.iter().enumerate() {
            let Some(group) = group else { continue };
            for (i, &w) in group.iter().enumerate() {
                seen += w;
                if w > 0 && seen >= rank {
                    return bucket_mid(((g << SUB_BITS) + i) as u32).clamp(self.min, self.max);
                }
            }
        }
        self.max
    }

    /// The empirical CDF from the buckets: `(value / scale, share of samples ≤ value)` at bucket
    /// midpoints (clamped to min / max), in rising order, ending at `(max, 1)`. Thinned to about
    /// `max_points` (a point is kept once the share has risen by `1 / max_points` since the last
    /// kept one), so drawing it costs the same for any number of samples.
    pub fn cdf(&self, scale: f64, max_points: usize) -> Vec<(f64, f64)> {
        if self.count == 0 {
            return Vec::new();
        }
        let step = 1.0 / max_points.max(1) as f64;
        let n = self.count as f64;
        let mut out: Vec<(f64, f64)> = Vec::new();
        let mut seen = 0u64;
        let mut last_kept = -1.0;
        for (g, group) in self.groups.iter().enumerate() {
            let Some(group) = group else { continue };
            for (i, &w) in group.iter().enumerate() {
                if w == 0 {
                    continue;
                }
                seen += w;
                let share = seen as f64 / n;
                if out.is_empty() || share - last_kept >= step || seen == self.count {
                    let v = bucket_mid(((g << SUB_BITS) + i) as u32).clamp(self.min, self.max);
                    out.push((v / scale, share));
                    last_kept = share;
                }
            }
        }
        if let Some(last) = out.last_mut() {
            // The top bucket's midpoint can sit below the largest sample.
            *last = (self.max / scale, 1.0);
        }
        out
    }

    /// Statistics with every value divided by `scale` (1e6 turns ns into ms).
    pub fn stats(&self, scale: f64) -> Stats {
        if self.count == 0 {
            return Stats::default();
        }
        let n = self.count as f64;
        let mean = self.sum / n;
        let var = (self.sum_sq / n - mean * mean).max(0.0);
        Stats {
            count: self.count,
            mean: mean / scale,
            min: self.min / scale,
            max: self.max / scale,
            p50: self.quantile(0.50) / scale,
            p75: self.quantile(0.75) / scale,
            p90: self.quantile(0.90) / scale,
            p95: self.quantile(0.95) / scale,
            p99: self.quantile(0.99) / scale,
            std: var.sqrt() / scale,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn small_values_are_exact() {
        let mut d = Distribution::new();
        for v in 1..=100 {
            d.add(v);
        }
        assert_eq!(d.quantile(0.5), 50.0);
        assert_eq!(d.quantile(0.99), 99.0);
        let s = d.stats(1.0);
        assert_eq!(s.count, 100);
        assert!((s.mean - 50.5).abs() < 1e-9);
        assert_eq!((s.min, s.max), (1.0, 100.0));
    }

    #[test]
    fn cdf_rises_to_one_at_the_maximum_and_is_thinned() {
        let mut d = Distribution::new();
        for v in 1..=1000u64 {
            d.add(v * 1000);
        }
        let c = d.cdf(1e3, 50);
        assert!(c.len() <= 52, "{}", c.len());
        assert_eq!(*c.last().unwrap(), (1000.0, 1.0));
        assert!(c.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 < w[1].1));
        assert!(Distribution::new().cdf(1.0, 10).is_empty());
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
        #[test]
        fn quantiles_are_within_a_tenth_of_a_percent(mut values in proptest::collection::vec(0u64..10_000_000_000, 1..400), q in 0.0f64..1.0) {
            let mut d = Distribution::new();
            for v in &values { d.add(*v); }
            values.sort();
            let rank = ((q * values.len() as f64).ceil() as usize).max(1);
            let exact = values[rank - 1] as f64;
            let got = d.quantile(q);
            prop_assert!((got - exact).abs() <= exact * 0.001 + 0.5, "q={q} exact={exact} got={got}");
        }
    }
}
