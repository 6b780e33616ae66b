//! Pass two: the full cross-worker timelines of the longest pins pass one found.

use super::report::{PinnedHandoff, TimelineStep};
use crate::events::RunReader;
use crate::ids::{HandoffId, WorkerId};
use crate::projections::handoffs::HandoffLedger;
use crate::projections::run::ProjectError;
use crate::units::ms;
use std::collections::BTreeSet;
use std::path::Path;

/// A longest-pinned candidate found by pass one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TopPin {
    pub handoff: HandoffId,
    pub pinned_ns: u64,
    pub still_pinned: bool,
}

/// Reads the run at `path` again and folds the handoff ledger of just the `top` handoffs into
/// their reports, in `top`'s order. `read` is the count of records pass one read: `progress`
/// goes on counting from it.
pub(super) fn timelines(
    path: &Path,
    top: &[TopPin],
    read: u64,
    progress: &mut dyn FnMut(u64),
) -> Result<Vec<PinnedHandoff>, ProjectError> {
    let mut n = read;
    let wanted: BTreeSet<HandoffId> = top.iter().map(|t| t.handoff).collect();
    let mut run = RunReader::open(path)?;
    let workers: Vec<WorkerId> = run.headers().iter().map(|h| h.worker).collect();
    let mut ledger = HandoffLedger::new();
    while let Some((i, rec)) = run.next()? {
        n += 1;
        if n % 65_536 == 0 {
            progress(n);
        }
        if rec.fact.handoff().is_some_and(|h| wanted.contains(&h)) {
            ledger.apply(workers[i], &rec);
        }
    }
    progress(n);
    Ok(top
        .iter()
        .enumerate()
        .map(|(rank, t)| {
            let e = ledger.get(&t.handoff).cloned().unwrap_or_default();
            let mut prev = e.transitions.first().map(|x| x.at_ns).unwrap_or(0);
            let timeline = e
                .transitions
                .iter()
                .map(|x| {
                    let step = TimelineStep {
                        at_ms: ms(x.at_ns),
                        delta_ms: ms(x.at_ns.saturating_sub(prev)),
                        worker: x.worker,
                        fact: x.fact,
                        message: x.message,
                    };
                    prev = x.at_ns;
                    step
                })
                .collect();
            let outcome = match serde_json::to_value(e.outcome()) {
                Ok(serde_json::Value::String(s)) => s,
                _ => String::new(),
            };
            PinnedHandoff {
                rank: rank + 1,
                handoff: t.handoff,
                request: e.request,
                source: e.source,
                destination: e.destination,
                pinned_ms: ms(t.pinned_ns),
                still_pinned: t.still_pinned,
                pinned_blocks: e.pinned_blocks,
                outcome,
                normalized: e.normalized(),
                timeline,
            }
        })
        .collect())
}
