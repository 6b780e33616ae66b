//! `handoff-log index RUN`: build (or verify and reuse) the sled index beside a run, and the
//! indexed paths of `show --handoff` / `show --worker`.

use crate::out::Out;
use crate::CliError;
use handoff_ledger::events::index::{IndexError, IndexStatus, RunIndex};
use handoff_ledger::events::Record;
use handoff_ledger::events::{RunLayout, SegmentReader};
use handoff_ledger::ids::{HandoffId, WorkerId};
use handoff_ledger::projections::worker::WorkerFold;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::Path;

/// A spinner counting records on stderr, only when stderr is a terminal.
pub struct Progress {
    bar: Option<ProgressBar>,
}

impl Progress {
    pub fn new(label: &'static str) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = ProgressBar::new_spinner();
            b.set_style(
                ProgressStyle::with_template("{spinner} {msg} {pos} records ({per_sec})")
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            );
            b.set_message(label);
            b
        });
        Progress { bar }
    }

    pub fn set(&self, records: u64) {
        if let Some(b) = &self.bar {
            b.set_position(records);
        }
    }

    pub fn done(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

pub fn run(run: &Path, json: bool) -> Result<u8, CliError> {
    let p = Progress::new("indexing");
    let started = std::time::Instant::now();
    let (idx, status) = RunIndex::open_or_rebuild_with::<WorkerFold>(run, &mut |n| p.set(n))?;
    p.done();
    let meta = idx.meta();
    let status_text = match &status {
        IndexStatus::Fresh => "fresh (reused)".to_string(),
        IndexStatus::Built => "built".to_string(),
        IndexStatus::Rebuilt(why) => format!("rebuilt: {why}"),
    };
    let mut out = Out::new();
    if json {
        let v = serde_json::json!({
            "index": idx.path().display().to_string(),
            "status": match &status {
                IndexStatus::Fresh => "fresh",
                IndexStatus::Built => "built",
                IndexStatus::Rebuilt(_) => "rebuilt",
            },
            "reason": match &status { IndexStatus::Rebuilt(w) => Some(w.clone()), _ => None },
            "records": meta.records,
            "streams": meta.workers.iter().map(|w| w.to_string()).collect::<Vec<_>>(),
            "checkpoints": meta.checkpoints.iter().sum::<u64>(),
            "time_ordered": meta.all_monotone(),
            "elapsed_ms": started.elapsed().as_secs_f64() * 1e3,
        });
        out.line(&v.to_string())?;
    } else {
        out.line(&format!("index {}: {status_text}", idx.path().display()))?;
        out.line(&format!(
            "{} records in {} streams, {} checkpoints, streams time-ordered: {}",
            meta.records,
            meta.workers.len(),
            meta.checkpoints.iter().sum::<u64>(),
            if meta.all_monotone() { "yes" } else { "no (at reads to the end of each file)" }
        ))?;
    }
    out.flush()?;
    Ok(0)
}

/// `show` through the index, when one exists beside the run (it is verified, and rebuilt if
/// stale, before use). `emit` gets each record in merge order and returns `false` to stop.
/// Returns `false` (nothing emitted) when the scan must be used instead: no index, no filter the
/// index serves, or streams that are not time-ordered (postings cannot then be put back in
/// merge order).
pub fn indexed_show(
    log: &Path,
    handoff: Option<HandoffId>,
    worker: Option<WorkerId>,
    emit: &mut dyn FnMut(WorkerId, &Record) -> Result<bool, CliError>,
) -> Result<bool, CliError> {
    if (handoff.is_none() && worker.is_none()) || !RunIndex::exists(log) {
        return Ok(false);
    }
    let (idx, status) = match RunIndex::open_or_rebuild::<WorkerFold>(log) {
        Ok(x) => x,
        Err(e @ IndexError::Busy { .. }) => {
            eprintln!("handoff-log: {e}; reading without it");
            return Ok(false);
        }
        Err(e) => return Err(e.into()),
    };
    if let IndexStatus::Rebuilt(why) = &status {
        eprintln!("handoff-log: index was stale and has been rebuilt ({why})");
    }
    let meta = idx.meta();
    if !meta.all_monotone() {
        return Ok(false);
    }
    let workers = meta.workers.clone();
    if let Some(h) = handoff {
        let postings = match idx.offsets_for_handoff(h) {
            Ok(p) => p,
            Err(e @ IndexError::Db { .. }) => {
                // The postings part is damaged: never trust it, rebuild and ask again.
                eprintln!("handoff-log: {e}; rebuilding the index");
                drop(idx);
                let rebuilt = RunIndex::build::<WorkerFold>(log)?;
                let p = rebuilt.offsets_for_handoff(h)?;
                return emit_postings(&rebuilt, &p, &workers, worker, emit);
            }
            Err(e) => return Err(e.into()),
        };
        return emit_postings(&idx, &postings, &workers, worker, emit);
    }
    // --worker alone: read that worker's records only (its own file in a directory; in a merged
    // file the other streams' records are checked but not decoded).
    let Some(w) = worker else {
        return Ok(false);
    };
    let Some(stream) = workers.iter().position(|x| *x == w) else {
        return Ok(false);
    };
    let layout = RunLayout::open(log)?;
    let Some(seg) = layout.segment_of(stream) else {
        return Ok(false);
    };
    let mut r =
        SegmentReader::open_at(seg, seg.start_position(), vec![0; workers.len()])?.only_stream(stream);
    while let Some((_, rec)) = r.next_record()? {
        if !emit(w, &rec)? {
            break;
        }
    }
    Ok(true)
}

fn emit_postings(
    idx: &RunIndex,
    postings: &[handoff_ledger::events::index::Posting],
    workers: &[WorkerId],
    worker: Option<WorkerId>,
    emit: &mut dyn FnMut(WorkerId, &Record) -> Result<bool, CliError>,
) -> Result<bool, CliError> {
    for (i, rec) in idx.read_postings(postings)? {
        let Some(w) = workers.get(i).copied() else {
            continue;
        };
        if worker.map_or(true, |x| x == w) && !emit(w, &rec)? {
            break;
        }
    }
    Ok(true)
}
