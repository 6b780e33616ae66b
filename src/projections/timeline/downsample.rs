//! A bounded min/max-preserving downsampler over time (see the module docs of
//! [`crate::projections::timeline`]); also bounds `inspect`'s booking series and `compare`'s
//! occupancy strips.

/// One kept point: time and one value per series.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample<const N: usize> {
    pub at_ns: u64,
    pub values: [u64; N],
}

#[derive(Clone, Debug)]
struct Bucket<const N: usize> {
    index: u64,
    points: Vec<Sample<N>>,
}

impl<const N: usize> Bucket<N> {
    /// Keeps first, last and per-series argmin / argmax (earliest on ties), in time order.
    fn reduce(&mut self) {
        let n = self.points.len();
        if n <= 2 {
            return;
        }
        let mut keep = vec![false; n];
        keep[0] = true;
        keep[n - 1] = true;
        for c in 0..N {
            let (mut lo, mut hi) = (0, 0);
            for (i, p) in self.points.iter().enumerate() {
                if p.values[c] < self.points[lo].values[c] {
                    lo = i;
                }
                if p.values[c] > self.points[hi].values[c] {
                    hi = i;
                }
            }
            keep[lo] = true;
            keep[hi] = true;
        }
        let mut i = 0;
        self.points.retain(|_| {
            let k = keep[i];
            i += 1;
            k
        });
    }
}

/// A bounded min/max-preserving downsampler over time (see the module docs). It keeps every
/// point until it holds `RAW_POINTS_PER_BUCKET × max_buckets` of them, so short runs are drawn
/// exactly; past that it buckets.
#[derive(Clone, Debug)]
pub struct Downsampler<const N: usize> {
    origin_ns: u64,
    /// 0 while every point is kept.
    width_ns: u64,
    max_buckets: usize,
    raw: Vec<Sample<N>>,
    buckets: Vec<Bucket<N>>,
}

/// Points kept before bucketing starts, per bucket allowed.
pub const RAW_POINTS_PER_BUCKET: usize = 5;

impl<const N: usize> Downsampler<N> {
    pub fn new(origin_ns: u64, max_buckets: usize) -> Self {
        Downsampler {
            origin_ns,
            width_ns: 0,
            max_buckets: max_buckets.max(1),
            raw: Vec::new(),
            buckets: Vec::new(),
        }
    }

    /// Adds a sample; samples must come in non-decreasing time, not before the origin.
    pub fn push(&mut self, s: Sample<N>) {
        if self.width_ns == 0 {
            self.raw.push(s);
            if self.raw.len() > RAW_POINTS_PER_BUCKET * self.max_buckets {
                // Too many to keep: bucket what we have, at the width the span so far needs.
                let span = s.at_ns.saturating_sub(self.origin_ns) + 1;
                self.width_ns = span.div_ceil(self.max_buckets as u64).max(1);
                for p in std::mem::take(&mut self.raw) {
                    self.push_bucketed(p);
                }
            }
            return;
        }
        self.push_bucketed(s);
    }

    fn push_bucketed(&mut self, s: Sample<N>) {
        let offset = s.at_ns.saturating_sub(self.origin_ns);
        while offset / self.width_ns >= self.max_buckets as u64 {
            self.widen();
        }
        let index = offset / self.width_ns;
        match self.buckets.last_mut() {
            Some(b) if b.index == index => {
                b.points.push(s);
                // Reducing in batches keeps the same points (the extremes of a union are the
                // extremes of its parts' extremes) at a fraction of the work.
                if b.points.len() > 4 * (1 + N) {
                    b.reduce();
                }
            }
            _ => self.buckets.push(Bucket { index, points: vec![s] }),
        }
    }

    fn widen(&mut self) {
        self.width_ns = self.width_ns.saturating_mul(2);
        let old = std::mem::take(&mut self.buckets);
        for mut b in old {
            b.index /= 2;
            match self.buckets.last_mut() {
                Some(last) if last.index == b.index => {
                    last.points.append(&mut b.points);
                    if last.points.len() > 4 * (1 + N) {
                        last.reduce();
                    }
                }
                _ => self.buckets.push(b),
            }
        }
    }

    /// The bucket width (0: no point was dropped).
    pub fn bucket_width_ns(&self) -> u64 {
        self.width_ns
    }

    /// The kept samples in time order.
    pub fn points(&self) -> Vec<Sample<N>> {
        if self.width_ns == 0 {
            return self.raw.clone();
        }
        let mut out = Vec::new();
        for b in &self.buckets {
            let mut b = b.clone();
            b.reduce();
            out.extend_from_slice(&b.points);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
        /// Kept points are input points; each bucket's per-series min and max survive; the
        /// number of points stays within (2 + 2N) per bucket.
        #[test]
        fn downsampling_keeps_real_points_and_extremes(
            steps in proptest::collection::vec((0u64..5_000_000, 0u64..100, 0u64..100), 1..600),
            buckets in 1usize..40,
        ) {
            let mut ds = Downsampler::<2>::new(0, buckets);
            let mut t = 0u64;
            let mut input = Vec::new();
            for (dt, a, b) in steps {
                t += dt;
                let s = Sample { at_ns: t, values: [a, b] };
                input.push(s);
                ds.push(s);
            }
            let kept = ds.points();
            let w = ds.bucket_width_ns();
            if w == 0 {
                // Nothing dropped while few points came.
                prop_assert_eq!(&kept, &input);
                prop_assert!(input.len() <= RAW_POINTS_PER_BUCKET * buckets);
                return Ok(());
            }
            prop_assert!(kept.len() <= 6 * buckets.max(1));
            for k in &kept {
                prop_assert!(input.contains(k));
            }
            prop_assert!(kept.windows(2).all(|p| p[0].at_ns <= p[1].at_ns));
            // Per bucket: extremes of every series are present among the kept points.
            let mut by_bucket: BTreeMap<u64, Vec<Sample<2>>> = BTreeMap::new();
            for s in &input {
                by_bucket.entry(s.at_ns / w).or_default().push(*s);
            }
            for (b, ss) in by_bucket {
                let kb: Vec<_> = kept.iter().filter(|s| s.at_ns / w == b).collect();
                for c in 0..2 {
                    let lo = ss.iter().map(|s| s.values[c]).min().unwrap();
                    let hi = ss.iter().map(|s| s.values[c]).max().unwrap();
                    prop_assert!(kb.iter().any(|s| s.values[c] == lo), "bucket {b} lost min of {c}");
                    prop_assert!(kb.iter().any(|s| s.values[c] == hi), "bucket {b} lost max of {c}");
                }
                prop_assert_eq!(kb.first().map(|s| **s), ss.first().copied());
                prop_assert_eq!(kb.last().map(|s| **s), ss.last().copied());
            }
        }
    }
}
