//! What `diff` reports: the kinds of difference, where each is, the first divergence with
//! its context records, and what was compared.

use crate::events::Record;
use crate::ids::WorkerId;
use serde::ser::SerializeStruct;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// The kinds of difference, in the order the summary lists them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DiffKind {
    HandoffSequence,
    RequestOutcome,
    CapacitySequence,
    BookingSequence,
    FinalState,
    Timing,
}

impl DiffKind {
    pub const ALL: [DiffKind; 6] = [
        DiffKind::HandoffSequence,
        DiffKind::RequestOutcome,
        DiffKind::CapacitySequence,
        DiffKind::BookingSequence,
        DiffKind::FinalState,
        DiffKind::Timing,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DiffKind::HandoffSequence => "handoff-sequence",
            DiffKind::RequestOutcome => "request-outcome",
            DiffKind::CapacitySequence => "capacity-sequence",
            DiffKind::BookingSequence => "booking-sequence",
            DiffKind::FinalState => "final-state",
            DiffKind::Timing => "timing",
        }
    }
}

/// A record, named as `show` names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Location {
    pub worker: WorkerId,
    pub seq: u64,
    pub at_ns: u64,
    pub fact: &'static str,
}

impl Location {
    pub(super) fn of(worker: WorkerId, rec: &Record) -> Self {
        Location { worker, seq: rec.seq, at_ns: rec.at_ns, fact: rec.fact.name() }
    }
}

/// One difference between the runs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Difference {
    pub kind: DiffKind,
    /// What differs: `worker decode-0`, `request r12`, `handoff r12#0`, ...
    pub subject: String,
    /// Where, in run A and in run B (`None`: that run has no such record).
    pub a: Option<Location>,
    pub b: Option<Location>,
    pub detail: String,
}

impl Difference {
    /// The earliest instant the difference is visible at (for picking the first divergence).
    pub fn at_ns(&self) -> u64 {
        let a = self.a.as_ref().map_or(u64::MAX, |l| l.at_ns);
        let b = self.b.as_ref().map_or(u64::MAX, |l| l.at_ns);
        a.min(b)
    }
}

/// A record shown around the first divergence.
#[derive(Clone, Debug, PartialEq)]
pub struct ContextRecord {
    pub worker: WorkerId,
    pub record: Record,
    /// This is the divergent record.
    pub divergent: bool,
}

impl Serialize for ContextRecord {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("ContextRecord", 6)?;
        st.serialize_field("at_ns", &self.record.at_ns)?;
        st.serialize_field("worker", &self.worker)?;
        st.serialize_field("seq", &self.record.seq)?;
        st.serialize_field("fact", self.record.fact.name())?;
        st.serialize_field("fields", &self.record.fact)?;
        st.serialize_field("divergent", &self.divergent)?;
        st.end()
    }
}

/// The first divergence with the records around it on both sides.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Divergence {
    pub difference: Difference,
    pub context_a: Vec<ContextRecord>,
    pub context_b: Vec<ContextRecord>,
}

/// What was compared.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Compared {
    pub workers: usize,
    pub records_a: u64,
    pub records_b: u64,
    pub capacity_transitions: u64,
    pub booking_facts: u64,
    pub handoffs: u64,
    pub requests: u64,
}

/// Timing figures compared.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TimingSummary {
    pub tolerance_pct: f64,
    pub compared: u64,
    pub outside_tolerance: u64,
    pub max_diff_pct: f64,
}

/// The result of [`diff_runs`](super::diff_runs).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DiffReport {
    pub a: PathBuf,
    pub b: PathBuf,
    pub equivalent: bool,
    /// Differences per kind (every kind present, zeros included).
    pub counts: BTreeMap<DiffKind, u64>,
    pub first: Option<Divergence>,
    /// The first `max_examples` differences found per kind, listed by kind and time.
    pub examples: Vec<Difference>,
    pub compared: Compared,
    pub timing: TimingSummary,
    /// Whether timing differences counted against equivalence.
    pub strict_timing: bool,
    /// Kinds reported but not counted against equivalence, each with why (a wall-clock run
    /// compared with a virtual one).
    pub relaxed: BTreeMap<DiffKind, String>,
}
