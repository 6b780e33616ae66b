//! `handoff-log compare`: several runs side by side, each folded from its own logs; every run
//! after the first also as its difference from the first.

use crate::out::Out;
use crate::CliError;
use comfy_table::{
    presets::UTF8_FULL_CONDENSED, Cell, CellAlignment, ColumnConstraint, ContentArrangement, Table, Width,
};
use handoff_ledger::projections::compare::{
    render_svg, router_label, summarize_run, CompareOptions, RunSummary,
};
use handoff_ledger::projections::distribution::Stats;
use handoff_ledger::projections::metrics::Slo;
use handoff_ledger::projections::run::ProjectError;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Map, Value};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct CompareArgs {
    /// The runs: run directories, merged run files or stream files. The first is the baseline
    /// the others' differences are taken from.
    #[arg(required = true, value_name = "RUN")]
    pub runs: Vec<PathBuf>,
    #[command(flatten)]
    pub output: CompareOutput,
    /// Also write an SVG: TTFT and E2E CDFs of every run, and per run its pinned and reserved
    /// blocks over time (summed over workers).
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
}

/// What a comparison is judged against and how it prints: shared by `compare` and `sweep`,
/// whose table is a comparison of its runs.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct CompareOutput {
    /// Goodput objectives, ms: any of ttft_ms, itl_ms, tpot_ms, e2e_ms, e.g.
    /// `ttft_ms=2000,itl_ms=50`. Goodput is the completed requests per second (over the run's
    /// duration) that met every one, and the share of all requests that did. itl_ms and
    /// tpot_ms are both checked against the request's mean inter-token gap (its TPOT).
    #[arg(long, value_name = "KEY=MS,...")]
    pub slo: Option<Slo>,
    /// One JSON object: the objectives and an object per run with every figure and its
    /// difference from the first run.
    #[arg(long, conflicts_with = "csv")]
    pub json: bool,
    /// CSV: a header line, then one line per run (differences from the first run in
    /// `*_delta` and `*_delta_pct` columns).
    #[arg(long)]
    pub csv: bool,
}

/// How a figure's value reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Count,
    Ms,
    Blocks,
    BlockSeconds,
    PerSecond,
    Share,
}

/// One numeric row of the comparison: the same list feeds the table, the JSON and the CSV, so
/// they cannot disagree.
struct Figure {
    key: String,
    label: String,
    kind: Kind,
    /// `None`: an empty statistic, or a figure the run cannot have (goodput without an SLO).
    value: Option<f64>,
    /// What an empty value means when not just "nothing to show" (e.g. no cascade).
    empty: &'static str,
    /// Whether a difference means anything (not for the instant a cascade started).
    delta: bool,
}

fn figure(key: impl Into<String>, label: impl Into<String>, kind: Kind, value: Option<f64>) -> Figure {
    Figure { key: key.into(), label: label.into(), kind, value, empty: "—", delta: true }
}

/// A statistic's value, or `None` when it has no samples.
fn stat(s: &Stats, pick: fn(&Stats) -> f64) -> Option<f64> {
    (s.count > 0).then(|| pick(s))
}

/// Terminal reasons other than completion shown as their own rows: each run's three most
/// frequent, ordered by their total over all runs (then by name, for a stable order).
fn top_reasons(runs: &[RunSummary]) -> Vec<String> {
    let mut shown: std::collections::BTreeMap<String, u64> = std::collections::BTreeMap::new();
    for r in runs {
        let mut mine: Vec<(&String, &u64)> =
            r.metrics.terminal_reasons.iter().filter(|(k, _)| k.as_str() != "completed").collect();
        mine.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        for (k, _) in mine.into_iter().take(3) {
            shown.insert(k.clone(), 0);
        }
    }
    for (k, total) in shown.iter_mut() {
        *total = runs.iter().map(|r| r.metrics.terminal_reasons.get(k).copied().unwrap_or(0)).sum();
    }
    let mut v: Vec<(String, u64)> = shown.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    v.into_iter().map(|(k, _)| k).collect()
}

fn figures(r: &RunSummary, reasons: &[String]) -> Vec<Figure> {
    let m = &r.metrics;
    let count = |v: u64| Some(v as f64);
    let mut f = vec![
        figure("num_requests", "requests", Kind::Count, count(m.num_requests)),
        figure("completed_requests", "completed", Kind::Count, count(m.completed_requests)),
        figure("rejected_requests", "rejected", Kind::Count, count(m.rejected_requests)),
        figure("failed_requests", "failed", Kind::Count, count(m.failed_requests)),
        figure("canceled_requests", "canceled", Kind::Count, count(m.canceled_requests)),
    ];
    for reason in reasons {
        f.push(figure(
            format!("ended_{}", reason.replace('-', "_")),
            format!("ended: {reason}"),
            Kind::Count,
            count(m.terminal_reasons.get(reason).copied().unwrap_or(0)),
        ));
    }
    f.push(figure("duration_ms", "virtual duration", Kind::Ms, Some(m.duration_ms)));
    f.push(figure(
        "request_throughput_rps",
        "throughput (requests/s)",
        Kind::PerSecond,
        Some(m.request_throughput_rps),
    ));
    f.push(figure("goodput_rps", "goodput (requests/s)", Kind::PerSecond, m.goodput_rps));
    f.push(figure("goodput_fraction", "goodput (% of requests)", Kind::Share, m.goodput_fraction));
    for (name, label, s) in [
        ("ttft", "TTFT", &m.ttft_ms),
        ("itl", "ITL", &m.itl_ms),
        ("tpot", "TPOT", &m.tpot_ms),
        ("e2e_latency", "E2E", &m.e2e_latency_ms),
    ] {
        f.push(figure(format!("mean_{name}_ms"), format!("{label} mean"), Kind::Ms, stat(s, |s| s.mean)));
        f.push(figure(format!("median_{name}_ms"), format!("{label} p50"), Kind::Ms, stat(s, |s| s.p50)));
        f.push(figure(format!("p90_{name}_ms"), format!("{label} p90"), Kind::Ms, stat(s, |s| s.p90)));
        f.push(figure(format!("p99_{name}_ms"), format!("{label} p99"), Kind::Ms, stat(s, |s| s.p99)));
    }
    let stranded = (!m.pinned_block_seconds.is_empty()).then(|| m.pinned_block_seconds.values().sum());
    f.push(figure("stranded_pin_block_seconds", "stranded pin block-seconds", Kind::BlockSeconds, stranded));
    f.push(figure("max_source_pin_ms", "longest pin", Kind::Ms, stat(&m.source_pin_ms, |s| s.max)));
    f.push(figure(
        "median_reservation_wait_ms",
        "reservation wait p50",
        Kind::Ms,
        stat(&m.reservation_wait_ms, |s| s.p50),
    ));
    f.push(figure(
        "max_reservation_wait_ms",
        "reservation wait max",
        Kind::Ms,
        stat(&m.reservation_wait_ms, |s| s.max),
    ));
    f.push(figure("bootstrap_timeouts", "bootstrap timeouts", Kind::Count, count(r.bootstrap_timeouts)));
    f.push(figure(
        "median_prefill_done_to_reserved_ms",
        "prefill done → reserved p50",
        Kind::Ms,
        stat(&m.prefill_done_to_reserved_ms, |s| s.p50),
    ));
    f.push(figure(
        "peak_pinned_blocks",
        "worker peak pinned blocks",
        Kind::Blocks,
        Some(r.peak_pinned.map_or(0.0, |p| p.blocks as f64)),
    ));
    f.push(figure(
        "peak_reserved_blocks",
        "worker peak reserved blocks",
        Kind::Blocks,
        Some(r.peak_reserved.map_or(0.0, |p| p.blocks as f64)),
    ));
    f.push(figure("preemptions", "preemptions", Kind::Count, count(r.preemptions)));
    f.push(figure("max_stall_ms", "stall max", Kind::Ms, stat(&m.stall_ms, |s| s.max)));
    f.push(Figure {
        empty: "none",
        delta: false,
        ..figure("cascade_started_at_ms", "stranding cascade from", Kind::Ms, r.cascade_started_at_ms)
    });
    f
}

/// What was run, as `(key, label, JSON value, table text)`.
fn what_was_run(r: &RunSummary) -> Vec<(&'static str, &'static str, Value, String)> {
    let d = &r.description;
    let text = |v: &Option<String>| v.clone().unwrap_or_else(|| "—".to_string());
    let prefill = d.prefill_router.as_ref().map(router_label);
    // An aggregated cluster has one router; a log without a description, unknown ones.
    let decode = d.decode_router.as_ref().map(router_label);
    let decode_text = match (&prefill, &decode) {
        (Some(_), None) => "(none)".to_string(),
        _ => text(&decode),
    };
    let trace_name = d
        .trace
        .as_ref()
        .map(|t| Path::new(t).file_name().map_or(t.clone(), |n| n.to_string_lossy().into_owned()));
    let short_id: String = r.run_id.chars().take(8).collect();
    vec![
        ("run_id", "run id", r.run_id.clone().into(), short_id),
        ("backend", "backend", r.backend.clone().into(), r.backend.clone()),
        ("policy", "policy", r.policy.clone().into(), r.policy.clone()),
        ("shape", "shape", r.shape.clone().into(), r.shape.clone()),
        ("prefill_router", "prefill router", prefill.clone().into(), text(&prefill)),
        ("decode_router", "decode router", decode.into(), decode_text),
        ("seed", "seed", r.seed.into(), r.seed.to_string()),
        ("trace", "trace", d.trace.clone().into(), text(&trace_name)),
        (
            "trace_lines",
            "trace lines",
            d.trace_lines.into(),
            d.trace_lines.map_or("—".into(), |n| thousands(n as f64, 0)),
        ),
        ("config_digest", "config digest", d.config_digest.clone().into(), text(&d.config_digest)),
    ]
}

/// `1234567.8` as `1,234,567.8` with `decimals` decimals.
fn thousands(v: f64, decimals: usize) -> String {
    let text = format!("{:.decimals$}", v.abs());
    let (int, frac) = match text.split_once('.') {
        Some((i, f)) => (i.to_string(), format!(".{f}")),
        None => (text.clone(), String::new()),
    };
    let mut grouped = String::new();
    for (i, c) in int.chars().enumerate() {
        if i > 0 && (int.len() - i) % 3 == 0 {
            grouped.push(',');
        }
        grouped.push(c);
    }
    let sign = if v < 0.0 && text.chars().any(|c| c != '0' && c != '.') { "-" } else { "" };
    format!("{sign}{grouped}{frac}")
}

/// A value as the table shows it: times in ms, or in s from 10,000 ms on.
fn show(kind: Kind, v: f64) -> String {
    unsigned_zero(match kind {
        Kind::Count | Kind::Blocks => thousands(v, 0),
        Kind::Ms if v.abs() >= 10_000.0 => format!("{} s", thousands(v / 1e3, 1)),
        Kind::Ms if v.abs() >= 100.0 => format!("{} ms", thousands(v, 1)),
        Kind::Ms => format!("{v:.2} ms"),
        Kind::BlockSeconds if v.abs() >= 100.0 => thousands(v, 0),
        Kind::BlockSeconds => format!("{v:.2}"),
        Kind::PerSecond => format!("{v:.3}"),
        Kind::Share => format!("{:.1}%", v * 100.0),
    })
}

/// `-0.000` (a tiny negative, rounded) reads as `0.000`.
fn unsigned_zero(s: String) -> String {
    match s.strip_prefix('-') {
        Some(rest) if !rest.chars().any(|c| ('1'..='9').contains(&c)) => rest.to_string(),
        _ => s,
    }
}

/// A difference: signed, in the figure's unit (shares in percentage points), with the change
/// relative to the first run when that is not zero.
fn show_delta(kind: Kind, base: f64, v: f64) -> String {
    let d = v - base;
    let abs = match kind {
        Kind::Share => unsigned_zero(format!("{:.1} pp", d * 100.0)),
        _ => show(kind, d),
    };
    // A sign only where the shown digits are not all zero.
    let plus =
        |text: &str, x: f64| if x > 0.0 && text.chars().any(|c| ('1'..='9').contains(&c)) { "+" } else { "" };
    let sign = plus(&abs, d);
    match percent(base, v) {
        Some(p) => {
            let pct = unsigned_zero(format!("{p:.1}%"));
            format!("{sign}{abs} ({}{pct})", plus(&pct, p))
        }
        None => format!("{sign}{abs}"),
    }
}

fn percent(base: f64, v: f64) -> Option<f64> {
    (base != 0.0).then(|| (v - base) / base.abs() * 100.0)
}

/// A JSON number: counts and blocks as integers.
fn number(kind: Kind, v: f64) -> Value {
    match kind {
        Kind::Count | Kind::Blocks => Value::from(v.round() as i64),
        _ => Value::from(v),
    }
}

/// Names for the runs: the file or directory name, or the path as given when two would share a
/// name.
fn names(paths: &[PathBuf]) -> Vec<String> {
    let base: Vec<String> = paths
        .iter()
        .map(|p| {
            p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| p.display().to_string())
        })
        .collect();
    base.iter()
        .zip(paths)
        .map(
            |(b, p)| {
                if base.iter().filter(|o| *o == b).count() > 1 {
                    p.display().to_string()
                } else {
                    b.clone()
                }
            },
        )
        .collect()
}

pub fn fold_error(path: &Path, e: ProjectError) -> CliError {
    match e {
        // Log errors already name the file (and the byte offset).
        ProjectError::Log(e) => CliError::new(2, e.to_string()),
        e => CliError::new(2, format!("{}: {e}", path.display())),
    }
}

pub fn run(args: &CompareArgs) -> Result<u8, CliError> {
    let opts = CompareOptions { slo: args.output.slo.unwrap_or_default(), ..CompareOptions::default() };
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = ProgressBar::new_spinner();
        b.set_style(
            ProgressStyle::with_template("{spinner} {msg}: {pos} records read ({per_sec})")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        b
    });
    let mut runs = Vec::with_capacity(args.runs.len());
    for path in &args.runs {
        if let Some(b) = &bar {
            b.set_message(path.display().to_string());
            b.set_position(0);
        }
        let summary = summarize_run(path, &opts, &mut |n| {
            if let Some(b) = &bar {
                b.set_position(n);
            }
        });
        runs.push(summary.map_err(|e| {
            if let Some(b) = &bar {
                b.finish_and_clear();
            }
            fold_error(path, e)
        })?);
    }
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    for r in runs.iter().filter(|r| !r.unended.is_empty()) {
        eprintln!(
            "handoff-log: warning: {}: {}",
            r.path.display(),
            crate::cmd_verify::incomplete_text(&r.unended)
        );
    }
    print(args, &runs)
}

/// Prints runs already folded (`runs[i]` from `args.runs[i]`) as `run` does.
pub fn print(args: &CompareArgs, runs: &[RunSummary]) -> Result<u8, CliError> {
    let opts = CompareOptions { slo: args.output.slo.unwrap_or_default(), ..CompareOptions::default() };
    let names = names(&args.runs);
    let reasons = top_reasons(runs);
    let figs: Vec<Vec<Figure>> = runs.iter().map(|r| figures(r, &reasons)).collect();
    if let Some(svg) = &args.svg {
        std::fs::write(svg, render_svg(runs, &names))
            .map_err(|e| CliError::new(2, format!("{}: {e}", svg.display())))?;
    }
    let mut out = Out::new();
    if args.output.json {
        let v = to_json(runs, &names, &figs, &opts.slo);
        out.line(
            &serde_json::to_string_pretty(&v).map_err(|e| CliError::new(2, format!("encoding JSON: {e}")))?,
        )?;
    } else if args.output.csv {
        out.line(to_csv(runs, &names, &figs).trim_end_matches('\n'))?;
    } else {
        out.line(&table(runs, &names, &figs))?;
        let mut notes = Vec::new();
        if runs.len() > 1 {
            notes.push(format!(
                "Δ: each run minus the first ({}), and that change in percent of the first",
                names[0]
            ));
        }
        notes.push(match opts.slo.is_empty() {
            true => "goodput: give --slo (e.g. ttft_ms=2000,itl_ms=50) to judge requests against objectives".to_string(),
            false => format!(
                "goodput: completed requests that met {} (itl_ms and tpot_ms: the request's mean inter-token gap), per second of the run and as a share of all requests",
                opts.slo
            ),
        });
        notes.push("run id: first 8 hex digits (--json has it whole)".into());
        for n in notes {
            out.line(&n)?;
        }
        if let Some(svg) = &args.svg {
            out.line(&format!("wrote {}", svg.display()))?;
        }
    }
    out.flush()?;
    Ok(0)
}

fn table(runs: &[RunSummary], names: &[String], figs: &[Vec<Figure>]) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_content_arrangement(ContentArrangement::Dynamic);
    // The terminal's width when printing to one; otherwise (a file, a pipe, a test) 120.
    if t.width().is_none() {
        t.set_width(120);
    }
    let right = |s: &str| Cell::new(s).set_alignment(CellAlignment::Right);
    let mut header = vec![Cell::new("figure")];
    for (i, name) in names.iter().enumerate() {
        header.push(right(name));
        if i > 0 {
            header.push(right("Δ"));
        }
    }
    t.set_header(header);
    // Per column, the widest cell that must not wrap (labels, numbers) and the widest of all
    // (names, routers and paths may wrap; a number broken over two lines would not read as one).
    let columns = 2 * runs.len();
    let mut unbroken = vec![0usize; columns];
    let mut widest = vec![0usize; columns];
    let mut keep = |column: usize, text: &str, wraps: bool| {
        let w = text.chars().count();
        widest[column] = widest[column].max(w);
        if !wraps {
            unbroken[column] = unbroken[column].max(w);
        }
    };
    for (i, name) in names.iter().enumerate() {
        keep(if i == 0 { 1 } else { 2 * i }, name, true);
    }
    let about: Vec<_> = runs.iter().map(what_was_run).collect();
    for row in 0..about[0].len() {
        keep(0, about[0][row].1, false);
        let mut cells = vec![Cell::new(about[0][row].1)];
        for (i, a) in about.iter().enumerate() {
            keep(if i == 0 { 1 } else { 2 * i }, &a[row].3, true);
            cells.push(Cell::new(&a[row].3));
            if i > 0 {
                cells.push(Cell::new(""));
            }
        }
        t.add_row(cells);
    }
    for row in 0..figs[0].len() {
        let base = &figs[0][row];
        keep(0, &base.label, false);
        let mut cells = vec![Cell::new(&base.label)];
        for (i, f) in figs.iter().enumerate() {
            let f = &f[row];
            let value = f.value.map_or_else(|| f.empty.to_string(), |v| show(f.kind, v));
            keep(if i == 0 { 1 } else { 2 * i }, &value, false);
            cells.push(right(&value));
            if i > 0 {
                let d = match (base.value, f.value) {
                    (Some(a), Some(b)) if f.delta => show_delta(f.kind, a, b),
                    _ => String::new(),
                };
                keep(2 * i + 1, &d, false);
                cells.push(right(&d));
            }
        }
        t.add_row(cells);
    }
    let budget = (t.width().unwrap_or(120) as usize).saturating_sub(3 * columns + 1);
    for (i, w) in column_widths(&unbroken, &widest, budget).into_iter().enumerate() {
        if let Some(c) = t.column_mut(i) {
            // comfy-table's widths count the cell padding (one space each side).
            c.set_constraint(ColumnConstraint::Absolute(Width::Fixed(w as u16 + 2)));
        }
    }
    t.to_string()
}

/// Content widths for the table's columns within `budget`: each column gets what its
/// unbreakable cells need, then what is left goes, a character at a time from the left, to
/// columns whose wrapping cells want more. Over budget, the table is wider than asked: numbers
/// are never broken.
fn column_widths(unbroken: &[usize], widest: &[usize], budget: usize) -> Vec<usize> {
    let mut w: Vec<usize> = unbroken.iter().map(|u| (*u).max(1)).collect();
    let mut left = budget.saturating_sub(w.iter().sum());
    while left > 0 {
        let mut grew = false;
        for (c, want) in widest.iter().enumerate() {
            if left > 0 && w[c] < *want {
                w[c] += 1;
                left -= 1;
                grew = true;
            }
        }
        if !grew {
            break;
        }
    }
    w
}

fn to_json(runs: &[RunSummary], names: &[String], figs: &[Vec<Figure>], slo: &Slo) -> Value {
    let mut list = Vec::new();
    for (i, (r, fs)) in runs.iter().zip(figs).enumerate() {
        let mut m = Map::new();
        m.insert("name".into(), names[i].clone().into());
        m.insert("path".into(), r.path.display().to_string().into());
        for (k, _, v, _) in what_was_run(r) {
            m.insert(k.into(), v);
        }
        m.insert("records".into(), r.records.into());
        m.insert("terminal_reasons".into(), json!(r.metrics.terminal_reasons));
        m.insert("peak_pinned_worker".into(), r.peak_pinned.map(|p| p.worker.to_string()).into());
        m.insert("peak_reserved_worker".into(), r.peak_reserved.map(|p| p.worker.to_string()).into());
        for f in fs {
            m.insert(f.key.clone(), f.value.map_or(Value::Null, |v| number(f.kind, v)));
        }
        let delta = (i > 0).then(|| {
            let mut d = Map::new();
            for (f, base) in fs.iter().zip(&figs[0]) {
                if !f.delta {
                    continue;
                }
                let v = match (base.value, f.value) {
                    (Some(a), Some(b)) => json!({
                        "absolute": number(f.kind, b - a),
                        "percent": percent(a, b),
                    }),
                    _ => Value::Null,
                };
                d.insert(f.key.clone(), v);
            }
            Value::Object(d)
        });
        m.insert("delta".into(), delta.unwrap_or(Value::Null));
        list.push(Value::Object(m));
    }
    json!({
        "slo": if slo.is_empty() { Value::Null } else { json!(slo) },
        "baseline": names.first(),
        "runs": list,
    })
}

/// A CSV field, quoted when it holds a comma, a quote or a line break.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

fn csv_value(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::String(s) => csv_field(s),
        other => csv_field(&other.to_string()),
    }
}

fn to_csv(runs: &[RunSummary], names: &[String], figs: &[Vec<Figure>]) -> String {
    let mut header: Vec<String> = vec!["name".into(), "path".into()];
    header.extend(what_was_run(&runs[0]).into_iter().map(|(k, ..)| k.to_string()));
    header.extend(figs[0].iter().map(|f| f.key.clone()));
    header.extend(["peak_pinned_worker".to_string(), "peak_reserved_worker".to_string()]);
    for f in figs[0].iter().filter(|f| f.delta) {
        header.push(format!("{}_delta", f.key));
        header.push(format!("{}_delta_pct", f.key));
    }
    let mut s = header.join(",");
    s.push('\n');
    for (i, (r, fs)) in runs.iter().zip(figs).enumerate() {
        let mut row: Vec<String> = vec![csv_field(&names[i]), csv_field(&r.path.display().to_string())];
        row.extend(what_was_run(r).iter().map(|(_, _, v, _)| csv_value(v)));
        row.extend(fs.iter().map(|f| f.value.map_or_else(String::new, |v| csv_value(&number(f.kind, v)))));
        row.push(r.peak_pinned.map(|p| p.worker.to_string()).unwrap_or_default());
        row.push(r.peak_reserved.map(|p| p.worker.to_string()).unwrap_or_default());
        for (f, base) in fs.iter().zip(&figs[0]).filter(|(f, _)| f.delta) {
            match (i > 0, base.value, f.value) {
                (true, Some(a), Some(b)) => {
                    row.push(csv_value(&number(f.kind, b - a)));
                    row.push(percent(a, b).map(|p| csv_value(&Value::from(p))).unwrap_or_default());
                }
                _ => row.extend([String::new(), String::new()]),
            }
        }
        s.push_str(&row.join(","));
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_as_people_write_them() {
        assert_eq!(thousands(1_234_567.89, 1), "1,234,567.9");
        assert_eq!(thousands(-1234.0, 0), "-1,234");
        assert_eq!(thousands(-0.01, 1), "0.0");
        assert_eq!(show(Kind::Ms, 12_345.0), "12.3 s");
        assert_eq!(show(Kind::Ms, 9_999.0), "9,999.0 ms");
        assert_eq!(show(Kind::Ms, 33.8), "33.80 ms");
        assert_eq!(show_delta(Kind::Count, 10.0, 15.0), "+5 (+50.0%)");
        assert_eq!(show_delta(Kind::Ms, 20_000.0, 10_000.0), "-10.0 s (-50.0%)");
        assert_eq!(show_delta(Kind::Count, 0.0, 3.0), "+3");
        assert_eq!(show_delta(Kind::Share, 0.5, 0.25), "-25.0 pp (-50.0%)");
        assert_eq!(show_delta(Kind::PerSecond, 0.0771, 0.07709), "0.000 (0.0%)");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(column_widths(&[5, 3, 3], &[5, 10, 3], 14), vec![5, 6, 3]);
        assert_eq!(column_widths(&[5, 3], &[5, 10], 4), vec![5, 3], "over budget: numbers stay whole");
    }
}
