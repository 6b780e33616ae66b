//! The differences found: counts per kind, the first examples, timing figures, and the
//! earliest difference with the record references to print around it.

use super::context::{Context, RecordRef};
use super::report::{Compared, DiffKind, Difference, Location, TimingSummary};
use super::DiffOptions;
use crate::units::ms;
use std::collections::BTreeMap;

/// A candidate first divergence: the difference and record references to print around it.
pub(super) struct Candidate {
    pub(super) diff: Difference,
    pub(super) ctx_a: Context,
    pub(super) ctx_b: Context,
    pub(super) div_a: Option<RecordRef>,
    pub(super) div_b: Option<RecordRef>,
}

/// Collects differences: counts, examples, and the earliest one with its context.
pub(super) struct Findings {
    /// Kinds counted but not held against equivalence (never the first divergence).
    pub(super) relaxed: Vec<DiffKind>,
    pub(super) opts: DiffOptions,
    pub(super) counts: BTreeMap<DiffKind, u64>,
    pub(super) examples: Vec<Difference>,
    pub(super) first: Option<Candidate>,
    pub(super) timing: TimingSummary,
    pub(super) compared: Compared,
}

impl Findings {
    pub(super) fn add(&mut self, cand: Candidate) {
        let kind = cand.diff.kind;
        let n = self.counts.entry(kind).or_insert(0);
        *n += 1;
        if *n as usize <= self.opts.max_examples {
            self.examples.push(cand.diff.clone());
        }
        if (kind == DiffKind::Timing && !self.opts.strict_timing) || self.relaxed.contains(&kind) {
            return;
        }
        let better = match &self.first {
            None => true,
            Some(f) => (cand.diff.at_ns(), cand.diff.kind) < (f.diff.at_ns(), f.diff.kind),
        };
        if better {
            self.first = Some(cand);
        }
    }

    pub(super) fn plain(&mut self, diff: Difference) {
        self.add(Candidate {
            diff,
            ctx_a: Context::Refs(Vec::new()),
            ctx_b: Context::Refs(Vec::new()),
            div_a: None,
            div_b: None,
        });
    }

    /// Compares one timing figure; `None` on either side is not compared.
    pub(super) fn timing(
        &mut self,
        subject: &str,
        what: &str,
        a: Option<u64>,
        b: Option<u64>,
        la: &Option<Location>,
        lb: &Option<Location>,
    ) {
        let (Some(a), Some(b)) = (a, b) else {
            return;
        };
        self.timing.compared += 1;
        let hi = a.max(b);
        if hi == 0 {
            return;
        }
        let pct = a.abs_diff(b) as f64 / hi as f64 * 100.0;
        if pct > self.timing.max_diff_pct {
            self.timing.max_diff_pct = pct;
        }
        if pct > self.opts.timing_tolerance_pct {
            self.timing.outside_tolerance += 1;
            self.plain(Difference {
                kind: DiffKind::Timing,
                subject: subject.to_string(),
                a: la.clone(),
                b: lb.clone(),
                detail: format!(
                    "{what}: A {:.3} ms, B {:.3} ms ({pct:.1}% apart, tolerance {}%)",
                    ms(a),
                    ms(b),
                    self.opts.timing_tolerance_pct
                ),
            });
        }
    }
}
