//! `handoff-log at RUN --time T`: every worker's capacity, queues and router bookings at T.

use crate::cmd_index::Progress;
use crate::out::Out;
use crate::CliError;
use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};
use handoff_ledger::events::index::{IndexError, IndexStatus, RunIndex};
use handoff_ledger::projections::at::{parse_time, state_at, AtReport};
use handoff_ledger::projections::worker::WorkerFold;
use std::path::Path;

pub fn run(log: &Path, time: &str, json: bool) -> Result<u8, CliError> {
    let t_ns = parse_time(time).map_err(|e| CliError::new(2, format!("--time: {e}")))?;
    // An index is used when present, and only after it was checked against the run.
    let index = if RunIndex::exists(log) {
        match RunIndex::open_or_rebuild::<WorkerFold>(log) {
            Ok((idx, status)) => {
                if let IndexStatus::Rebuilt(why) = &status {
                    eprintln!("handoff-log: index was stale and has been rebuilt ({why})");
                }
                Some(idx)
            }
            Err(e @ IndexError::Busy { .. }) => {
                eprintln!("handoff-log: {e}; reading without it");
                None
            }
            Err(e) => return Err(e.into()),
        }
    } else {
        None
    };
    let p = Progress::new("folding");
    let report = state_at(log, t_ns, index.as_ref(), &mut |n| p.set(n))?;
    p.done();
    let mut out = Out::new();
    if json {
        let v =
            serde_json::to_string(&report).map_err(|e| CliError::new(2, format!("encoding JSON: {e}")))?;
        out.line(&v)?;
    } else {
        out.line(&table(&report))?;
    }
    out.flush()?;
    // The state is printed as far as the folds could take it; a contradiction then fails the
    // command as it fails every command that folds the log.
    match report.violations.first() {
        None => Ok(0),
        Some(v) => {
            let more = report.violations.len() - 1;
            let also = if more > 0 { format!(" (and {more} more streams)") } else { String::new() };
            Err(CliError::new(2, format!("the log contradicts itself: {v}{also}")))
        }
    }
}

fn table(r: &AtReport) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(vec![
        "worker",
        "active",
        "pinned",
        "reserved",
        "used",
        "cached",
        "free",
        "total",
        "slots",
        "headroom",
        "waiting",
        "running",
        "wait_kv",
        "held",
        "pending",
        "bk_prefill_tok",
        "bk_prefill_blk",
        "bk_decode_blk",
    ]);
    for w in &r.workers {
        let mut row = vec![w.worker.to_string()];
        match (&w.capacity, &w.queues, &w.bookings) {
            (Some(c), Some(q), Some(b)) => {
                let bookings = [b.active_prefill_tokens, b.booked_prefill_blocks, b.booked_decode_blocks];
                for v in c.with_queues(q).into_iter().chain(bookings) {
                    row.push(v.to_string());
                }
            }
            _ => {
                let (p, d) = w.open_bookings.unwrap_or_default();
                row.push(format!("open bookings: {p} prefill, {d} decode"));
            }
        }
        t.add_row(row);
    }
    format!("at t = {:.3} ms ({} records applied)\n{t}", r.time_ms, r.records_applied)
}
