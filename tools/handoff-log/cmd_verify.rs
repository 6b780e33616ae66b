//! `handoff-log verify`: framing, checksums, sequence numbers, run ids, and that the facts agree
//! with each other (every stream folded as every other command folds it).

use crate::out::Out;
use crate::CliError;
use handoff_ledger::ids::{ClockDomain, Role, WallClockSync, WorkerId};
use handoff_ledger::projections::run::{verify_consistent, ProjectError};
use serde_json::json;
use std::path::PathBuf;

/// Where a live process's model time began, and how far its system clock was from the
/// frontend's (nothing folds across processes' clocks; this is for the reader).
fn clock_text(worker: WorkerId, c: &WallClockSync) -> String {
    let origin = chrono::DateTime::from_timestamp_nanos(c.origin_unix_ns);
    let origin = origin.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    if worker.role == Role::Router {
        return format!("  {worker}: wall clock, model time 0 at {origin} (the frontend's clock, which the workers' probes read)");
    }
    format!(
        "  {worker}: wall clock, model time 0 at {origin}; system clock {:+.3} ms from the frontend's (±{:.3} ms)",
        c.offset_ns as f64 / 1e6,
        c.uncertainty_ns as f64 / 1e6
    )
}

pub fn run(logs: &[PathBuf], json_out: bool) -> Result<u8, CliError> {
    let mut out = Out::new();
    let mut worst = 0u8;
    for path in logs {
        match verify_consistent(path) {
            Ok(s) => {
                let torn: Vec<_> = s
                    .torn_tails
                    .iter()
                    .map(|(p, t)| json!({"file": p.display().to_string(), "offset": t.offset, "bytes": t.bytes}))
                    .collect();
                if json_out {
                    let streams: Vec<_> = s
                        .streams
                        .iter()
                        .map(|st| json!({"worker": st.header.worker, "records": st.records, "clock": st.header.clock}))
                        .collect();
                    let unended: Vec<String> = s.unended.iter().map(|w| w.to_string()).collect();
                    out.line(
                        &json!({"log": path.display().to_string(), "ok": true, "records": s.records,
                                "handoffs": s.handoffs, "streams": streams, "torn_tails": torn,
                                "complete": unended.is_empty(), "unended": unended})
                        .to_string(),
                    )?;
                } else {
                    out.line(&format!(
                        "{}: ok: {} streams, {} records, {} handoffs",
                        path.display(),
                        s.streams.len(),
                        s.records,
                        s.handoffs
                    ))?;
                    if !s.unended.is_empty() {
                        out.line(&format!("{}: {}", path.display(), incomplete_text(&s.unended)))?;
                    }
                    for st in &s.streams {
                        if let ClockDomain::WallSynced(c) = st.header.clock {
                            out.line(&clock_text(st.header.worker, &c))?;
                        }
                    }
                    for (p, t) in &s.torn_tails {
                        out.line(&format!(
                            "{}: torn tail at byte offset {} ({} bytes of a partial last record or block); the records before it are sound and opening for append truncates it",
                            p.display(),
                            t.offset,
                            t.bytes
                        ))?;
                    }
                }
            }
            Err(e) => {
                // Damage and contradiction alike make the log unsound: exit 1.
                worst = 1;
                if json_out {
                    let located = match &e {
                        ProjectError::Log(le) => {
                            json!({"file": le.path().display().to_string(), "offset": le.offset()})
                        }
                        _ => json!({"contradiction": true}),
                    };
                    let mut v =
                        json!({"log": path.display().to_string(), "ok": false, "error": e.to_string()});
                    if let (Some(m), Some(extra)) = (v.as_object_mut(), located.as_object()) {
                        m.extend(extra.clone());
                    }
                    out.line(&v.to_string())?;
                } else {
                    out.flush()?;
                    eprintln!("handoff-log: {e}");
                }
            }
        }
    }
    out.flush()?;
    Ok(worst)
}

/// What a reader says of a run some of whose streams lack the end marker.
pub fn incomplete_text(unended: &[handoff_ledger::ids::WorkerId]) -> String {
    let names: Vec<String> = unended.iter().map(|w| w.to_string()).collect();
    format!(
        "incomplete run: {} {} no end marker (the writer stopped before a clean end, or the log \
         predates end markers); figures from it cover only what was written",
        names.join(", "),
        if names.len() == 1 { "has" } else { "have" }
    )
}

/// `handoff-log merge RUN OUT`.
pub fn merge(
    run: &std::path::Path,
    out_path: &std::path::Path,
    force: bool,
    json_out: bool,
) -> Result<u8, CliError> {
    if out_path.exists() && !force {
        return Err(CliError::new(
            2,
            format!("{}: already exists; refusing to replace it (pass --force)", out_path.display()),
        ));
    }
    let s = handoff_ledger::events::write_merged(run, out_path)?;
    let mut out = Out::new();
    if json_out {
        let torn: Vec<_> = s
            .torn_tails
            .iter()
            .map(|(p, t)| json!({"file": p.display().to_string(), "offset": t.offset, "bytes": t.bytes}))
            .collect();
        out.line(
            &json!({"out": out_path.display().to_string(), "streams": s.streams, "records": s.records,
                    "bytes": s.bytes, "torn_tails_left_out": torn})
            .to_string(),
        )?;
    } else {
        out.line(&format!(
            "{}: {} streams, {} records, {} bytes",
            out_path.display(),
            s.streams,
            s.records,
            s.bytes
        ))?;
        for (p, t) in &s.torn_tails {
            out.line(&format!(
                "{}: torn tail at byte offset {} left out ({} bytes)",
                p.display(),
                t.offset,
                t.bytes
            ))?;
        }
    }
    out.flush()?;
    Ok(0)
}

/// `handoff-log recover RUN`.
pub fn recover(run: &std::path::Path, json_out: bool) -> Result<u8, CliError> {
    let cut = handoff_ledger::events::recover_run(run)?;
    let mut out = Out::new();
    if json_out {
        let cut: Vec<_> = cut
            .iter()
            .map(|(p, t)| json!({"file": p.display().to_string(), "offset": t.offset, "bytes": t.bytes}))
            .collect();
        out.line(&json!({"run": run.display().to_string(), "truncated": cut}).to_string())?;
    } else {
        if cut.is_empty() {
            out.line(&format!("{}: no torn tail; nothing written", run.display()))?;
        }
        for (p, t) in &cut {
            if t.offset == 0 && t.bytes == 0 {
                out.line(&format!(
                    "{}: removed an empty stream (its header never reached the disk)",
                    p.display()
                ))?;
                continue;
            }
            out.line(&format!(
                "{}: truncated {} bytes of a torn record at byte offset {}",
                p.display(),
                t.bytes,
                t.offset
            ))?;
        }
    }
    out.flush()?;
    Ok(0)
}
