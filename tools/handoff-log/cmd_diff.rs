//! `handoff-log diff A B`: are two runs equivalent? (See `handoff_ledger::projections::diff`
//! for what is compared.) Exit 0 equivalent, 1 different, 2 unusable input.

use crate::cmd_index::Progress;
use crate::cmd_show::text_line;
use crate::out::Out;
use crate::CliError;
use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};
use handoff_ledger::projections::diff::{diff_runs, DiffKind, DiffOptions, DiffReport, Location};
use handoff_ledger::units::ms;
use std::path::Path;

pub fn run(
    a: &Path,
    b: &Path,
    json: bool,
    timing_tolerance_pct: f64,
    strict_timing: bool,
) -> Result<u8, CliError> {
    if !timing_tolerance_pct.is_finite() || timing_tolerance_pct < 0.0 {
        return Err(CliError::new(
            2,
            format!("--timing-tolerance {timing_tolerance_pct}: must be a non-negative percent"),
        ));
    }
    let opts = DiffOptions { timing_tolerance_pct, strict_timing, ..DiffOptions::default() };
    let p = Progress::new("comparing");
    let report = diff_runs(a, b, &opts, &mut |n| p.set(n))?;
    p.done();
    let mut out = Out::new();
    if json {
        let v =
            serde_json::to_string(&report).map_err(|e| CliError::new(2, format!("encoding JSON: {e}")))?;
        out.line(&v)?;
    } else {
        for line in text(&report) {
            out.line(&line)?;
        }
    }
    out.flush()?;
    Ok(if report.equivalent { 0 } else { 1 })
}

fn loc(l: &Option<Location>) -> String {
    match l {
        Some(l) => format!("{} seq {} ({}, t={:.3} ms)", l.worker, l.seq, l.fact, ms(l.at_ns)),
        None => "-".into(),
    }
}

/// The report for people: verdict, first divergence with context, summary by kind.
pub fn text(r: &DiffReport) -> Vec<String> {
    let mut lines = Vec::new();
    lines.push(format!(
        "{}: A = {}, B = {}",
        if r.equivalent { "EQUIVALENT" } else { "DIFFERENT" },
        r.a.display(),
        r.b.display()
    ));
    if let Some(f) = &r.first {
        let d = &f.difference;
        lines.push(String::new());
        lines.push(format!("first divergence: {} on {}", d.kind.as_str(), d.subject));
        lines.push(format!("  A: {}", loc(&d.a)));
        lines.push(format!("  B: {}", loc(&d.b)));
        lines.push(format!("  {}", d.detail));
        for (side, ctx) in [("A", &f.context_a), ("B", &f.context_b)] {
            lines.push(String::new());
            lines.push(format!(
                "  {side}:   {:>14} {:<10} {:>8} {:<20} DETAILS",
                "AT_MS", "WORKER", "SEQ", "FACT"
            ));
            if ctx.is_empty() {
                lines.push(format!("  {side}:   (no records)"));
            }
            for c in ctx {
                let mark = if c.divergent { ">>" } else { "  " };
                lines.push(format!("  {side}:{mark} {}", text_line(c.worker, &c.record)));
            }
        }
    }
    lines.push(String::new());
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(vec!["kind", "differences", "fails parity"]);
    for k in DiffKind::ALL {
        let n = r.counts.get(&k).copied().unwrap_or(0);
        let (label, fails) = if k == DiffKind::Timing {
            (
                format!("{} (±{}%)", k.as_str(), r.timing.tolerance_pct),
                if r.strict_timing { "yes" } else { "no (reported)" },
            )
        } else if r.relaxed.contains_key(&k) {
            (k.as_str().to_string(), "no (relaxed)")
        } else {
            (k.as_str().to_string(), "yes")
        };
        t.add_row(vec![label, n.to_string(), fails.to_string()]);
    }
    lines.push(t.to_string());
    for (k, why) in &r.relaxed {
        lines.push(format!("relaxed {}: {why}", k.as_str()));
    }
    if !r.examples.is_empty() {
        lines.push("examples:".into());
        for d in &r.examples {
            let mut text = format!("  {} {}: {}", d.kind.as_str(), d.subject, d.detail);
            if text.chars().count() > 220 {
                text = text.chars().take(217).collect::<String>() + "...";
            }
            lines.push(text);
        }
    }
    let c = &r.compared;
    lines.push(format!(
        "compared: {} workers, {} / {} records, {} capacity transitions, {} booking facts, {} handoffs, {} requests, {} timing figures (max {:.1}% apart)",
        c.workers,
        c.records_a,
        c.records_b,
        c.capacity_transitions,
        c.booking_facts,
        c.handoffs,
        c.requests,
        r.timing.compared,
        r.timing.max_diff_pct
    ));
    lines
}
