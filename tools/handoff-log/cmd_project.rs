//! `handoff-log project`: fold a run and print a projection.

use crate::out::Out;
use crate::CliError;
use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};
use handoff_ledger::events::RunReader;
use handoff_ledger::lifecycle::policy::Milestone;
use handoff_ledger::projections::run::{
    project_capacity, project_handoffs_streaming, project_metrics, project_scheduler, Consistency,
    ProjectError,
};
use handoff_ledger::units::ms;
use serde_json::json;
use std::path::Path;

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Projection {
    /// Physical KV per worker: active / pinned source / reserved destination / cached-free /
    /// free blocks, slots and headroom, with peaks.
    Capacity,
    /// Every handoff: workers, milestones, outcome and normalized transition order.
    Handoffs,
    /// Every engine's queues: waiting, running, waiting for remote KV, held, pending.
    Scheduler,
    /// Serving metrics (TTFT, ITL, TPOT, E2E) and stranding figures, as the replay reports them.
    Metrics,
    /// One record per ended request, in arrival order, with replay's `--per-request` fields
    /// (docs/per-request.md): JSON lines, or CSV with `--csv`.
    Requests,
    /// Every engine worker's capacity and queues at each instant they changed: one row per
    /// worker and instant (CSV with `--csv`, JSON lines otherwise).
    Series,
}

/// A time on the run's clock as the tables print it.
/// One row of `project handoffs`: fixed-width columns (rows are printed as they come, so no
/// table can size them to the widest cell), the milestone order last.
fn handoff_row(cells: [String; 8]) -> String {
    let [id, request, source, dest, outcome, pinned, blocks, order] = cells;
    format!(
        "{id:<36}  {request:>8}  {source:<12}  {dest:<12}  {outcome:<18}  {pinned:>10}  {blocks:>6}  {order}"
    )
}

fn ms_text(ns: u64) -> String {
    format!("{:.3}", ms(ns))
}

fn opt_ms(ns: Option<u64>) -> serde_json::Value {
    ns.map_or(serde_json::Value::Null, |v| json!(ms(v)))
}

/// Per-request records through the metrics fold's own sink (the same lines replay writes).
fn requests(run: &mut RunReader, out: &mut Out, csv: bool) -> Result<(), CliError> {
    use handoff_ledger::projections::{MetricsFold, PerRequest};
    use std::sync::{Arc, Mutex};
    let rows: Arc<Mutex<Vec<PerRequest>>> = Arc::default();
    let sink_rows = rows.clone();
    let headers = run.headers().to_vec();
    let mut fold = MetricsFold::new().with_sink(Box::new(move |r: &PerRequest| {
        if let Ok(mut v) = sink_rows.lock() {
            v.push(r.clone());
        }
    }));
    for h in &headers {
        fold.add_stream(h);
    }
    let mut header_written = false;
    // Lines leave as the fold releases them (arrival order), so memory stays bounded.
    let mut flush = |out: &mut Out, all: Vec<PerRequest>| -> Result<(), CliError> {
        for r in all {
            let value = serde_json::to_value(&r).map_err(|e| CliError::new(2, e.to_string()))?;
            let Some(m) = value.as_object() else { continue };
            if csv {
                if !header_written {
                    out.line(&m.keys().cloned().collect::<Vec<_>>().join(","))?;
                    header_written = true;
                }
                out.line(&m.values().map(csv_cell).collect::<Vec<_>>().join(","))?;
            } else {
                // The struct's own field order: the very lines replay's --per-request writes.
                out.line(&serde_json::to_string(&r).map_err(|e| CliError::new(2, e.to_string()))?)?;
            }
        }
        Ok(())
    };
    let mut consistency = Consistency::new(&headers);
    while let Some((i, rec)) = run.next()? {
        consistency.check(i, &rec)?;
        fold.apply(headers[i].worker, &rec);
        let ready = rows.lock().map(|mut v| std::mem::take(&mut *v)).unwrap_or_default();
        flush(out, ready)?;
    }
    fold.report();
    let rest = rows.lock().map(|mut v| std::mem::take(&mut *v)).unwrap_or_default();
    flush(out, rest)
}

fn csv_cell(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Null => String::new(),
        serde_json::Value::String(s) if s.contains([',', '"', '\n']) => {
            format!("\"{}\"", s.replace('"', "\"\""))
        }
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Capacity and queues per engine worker at every settled instant that changed them.
fn series(run: &mut RunReader, out: &mut Out, csv: bool) -> Result<(), CliError> {
    use handoff_ledger::projections::at::CapacityView;
    use handoff_ledger::projections::worker::WorkerFold;
    use handoff_ledger::schedulers::SchedulerView;
    let headers = run.headers().to_vec();
    let mut folds: Vec<WorkerFold> = headers.iter().map(WorkerFold::new).collect();
    let mut last: Vec<Option<(CapacityView, SchedulerView)>> = vec![None; headers.len()];
    let mut changed: Vec<usize> = Vec::new();
    let mut instant: Option<u64> = None;
    if csv {
        out.line("at_ms,worker,active_blocks,pinned_source_blocks,reserved_destination_blocks,kv_used_blocks,cached_free_blocks,free_blocks,total_blocks,request_slots_used,decode_headroom_tokens,waiting,running,waiting_for_remote_kv,held_prefills,pending_reservations")?;
    }
    let emit = |out: &mut Out,
                at_ns: u64,
                changed: &mut Vec<usize>,
                folds: &[WorkerFold],
                last: &mut Vec<Option<(CapacityView, SchedulerView)>>|
     -> Result<(), CliError> {
        changed.sort_unstable();
        changed.dedup();
        for &i in changed.iter() {
            let f = &folds[i];
            let now = (CapacityView::from(&f.capacity), f.scheduler.view());
            if last[i].as_ref() == Some(&now) {
                continue;
            }
            let (c, q) = now;
            if csv {
                let cells: Vec<String> = c.with_queues(&q).iter().map(u64::to_string).collect();
                out.line(&format!("{:.3},{},{}", ms(at_ns), f.worker, cells.join(",")))?;
            } else {
                out.line(
                    &json!({"at_ms": ms(at_ns), "worker": f.worker.to_string(), "capacity": c, "queues": q})
                        .to_string(),
                )?;
            }
            last[i] = Some(now);
        }
        changed.clear();
        Ok(())
    };
    while let Some((i, rec)) = run.next()? {
        if headers[i].worker.role == handoff_ledger::ids::Role::Router {
            continue;
        }
        if let Some(t) = instant.filter(|t| *t != rec.at_ns) {
            emit(out, t, &mut changed, &folds, &mut last)?;
        }
        instant = Some(rec.at_ns);
        let worker = headers[i].worker;
        folds[i].apply(&rec).map_err(|v| ProjectError::located(worker, &rec, v))?;
        changed.push(i);
    }
    if let Some(t) = instant {
        emit(out, t, &mut changed, &folds, &mut last)?;
    }
    Ok(())
}

pub fn run(log: &Path, what: Projection, json_out: bool, csv: bool) -> Result<u8, CliError> {
    let mut run = RunReader::open(log)?;
    let mut out = Out::new();
    match what {
        Projection::Requests => requests(&mut run, &mut out, csv)?,
        Projection::Series => series(&mut run, &mut out, csv)?,
        Projection::Capacity => {
            let rows = project_capacity(&mut run)?;
            if json_out {
                let workers: Vec<_> = rows
                    .iter()
                    .map(|r| {
                        let s = &r.last;
                        json!({
                            "worker": r.worker,
                            "active_blocks": s.active_blocks,
                            "pinned_source_blocks": s.pinned_source_blocks,
                            "reserved_destination_blocks": s.reserved_destination_blocks,
                            "kv_used_blocks": s.kv_used_blocks(),
                            "cached_free_blocks": s.cached_free_blocks,
                            "free_blocks": s.free_blocks,
                            "total_blocks": s.total_blocks,
                            "request_slots_used": s.request_slots_used,
                            "decode_headroom_tokens": s.decode_headroom_tokens,
                            "peak_active_blocks": r.peak_active.blocks,
                            "peak_pinned_source_blocks": r.peak_pinned_source.blocks,
                            "peak_pinned_source_at_ms": ms(r.peak_pinned_source.at_ns),
                            "peak_reserved_destination_blocks": r.peak_reserved_destination.blocks,
                            "peak_kv_used_blocks": r.peak_kv_used.blocks,
                            "transitions": r.transitions,
                        })
                    })
                    .collect();
                out.line(&json!({ "workers": workers }).to_string())?;
            } else {
                let mut t = Table::new();
                t.load_preset(UTF8_FULL_CONDENSED);
                t.set_header(vec![
                    "worker",
                    "active",
                    "pinned",
                    "reserved",
                    "kv_used",
                    "cached_free",
                    "free",
                    "total",
                    "slots",
                    "headroom_tok",
                    "peak_pinned (at ms)",
                    "peak_used",
                ]);
                for r in &rows {
                    let s = &r.last;
                    t.add_row(vec![
                        r.worker.to_string(),
                        s.active_blocks.to_string(),
                        s.pinned_source_blocks.to_string(),
                        s.reserved_destination_blocks.to_string(),
                        s.kv_used_blocks().to_string(),
                        s.cached_free_blocks.to_string(),
                        s.free_blocks.to_string(),
                        s.total_blocks.to_string(),
                        s.request_slots_used.to_string(),
                        s.decode_headroom_tokens.to_string(),
                        format!("{} ({})", r.peak_pinned_source.blocks, ms_text(r.peak_pinned_source.at_ns)),
                        r.peak_kv_used.blocks.to_string(),
                    ]);
                }
                out.line(&t.to_string())?;
            }
        }
        Projection::Handoffs => {
            // Streamed: each handoff is printed once it has finished (and the fold forgets it),
            // so a million-handoff run prints in the memory of the handoffs in flight.
            if json_out {
                out.line("{\"handoffs\":[")?;
            } else {
                out.line(&handoff_row(
                    ["handoff", "request", "source", "dest", "outcome", "pinned_ms", "blocks", "order"]
                        .map(String::from),
                ))?;
            }
            let mut first = true;
            let count = project_handoffs_streaming(&mut run, |id, e, end| {
                let line = if json_out {
                    let item = json!({
                        "handoff": id.to_string(),
                        "request": e.request.map(|r| r.0),
                        "policy": e.policy.map(|p| p.as_str()),
                        "source": e.source,
                        "destination": e.destination,
                        "outcome": e.outcome(),
                        "source_held_ms": opt_ms(e.pinned_at_ns),
                        "destination_reserved_ms": opt_ms(e.reserved_at_ns),
                        "destination_activated_ms": opt_ms(e.activated_at_ns),
                        "source_released_ms": opt_ms(e.source_released_at_ns),
                        "pinned_ms": e.pinned_ns(end).map(ms),
                        "pinned_blocks": e.pinned_blocks,
                        "reserved_pages": e.reserved_pages,
                        "transfer_bytes": e.transfer_bytes,
                        "normalized": e.normalized(),
                        "transitions": e.transitions,
                    });
                    format!("{}{item}", if first { "" } else { "," })
                } else {
                    handoff_row([
                        id.to_string(),
                        e.request.map(|r| r.to_string()).unwrap_or_default(),
                        e.source.map(|w| w.to_string()).unwrap_or_default(),
                        e.destination.map(|w| w.to_string()).unwrap_or_default(),
                        format!("{:?}", e.outcome()),
                        e.pinned_ns(end).map(ms_text).unwrap_or_default(),
                        e.pinned_blocks.to_string(),
                        Milestone::join(&e.normalized(), " → "),
                    ])
                };
                first = false;
                out.line(&line)
            })?;
            if json_out {
                out.line("]}")?;
            } else {
                out.line(&format!(
                    "{count} handoffs (finished ones in the order they finished, then any still in flight)"
                ))?;
            }
        }
        Projection::Scheduler => {
            let views = project_scheduler(&mut run)?;
            if json_out {
                let ws: Vec<_> = views.iter().map(|(w, v)| json!({"worker": w, "view": v})).collect();
                out.line(&json!({ "workers": ws }).to_string())?;
            } else {
                let mut t = Table::new();
                t.load_preset(UTF8_FULL_CONDENSED);
                t.set_header(vec![
                    "worker",
                    "waiting",
                    "running",
                    "waiting_remote_kv",
                    "held_prefills",
                    "pending_reservations",
                ]);
                for (w, v) in &views {
                    t.add_row(vec![
                        w.to_string(),
                        v.waiting.to_string(),
                        v.running.to_string(),
                        v.waiting_for_remote_kv.to_string(),
                        v.held_prefills.to_string(),
                        v.pending_reservations.to_string(),
                    ]);
                }
                out.line(&t.to_string())?;
            }
        }
        Projection::Metrics => {
            let report = project_metrics(&mut run)?;
            if json_out {
                out.line(&serde_json::to_string_pretty(&report.to_json()).unwrap_or_default())?;
            } else {
                out.line(&crate::report::table(&report, None))?;
            }
        }
    }
    out.flush()?;
    // Every projection read the whole run, so the streams that lack the end marker are known.
    let unended = run.unended();
    if !unended.is_empty() {
        eprintln!("handoff-log: warning: {}", crate::cmd_verify::incomplete_text(&unended));
    }
    Ok(0)
}
