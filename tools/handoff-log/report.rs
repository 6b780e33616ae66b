//! The replay report as a table for people.

use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, CellAlignment, Table};
use handoff_ledger::projections::distribution::Stats;
use handoff_ledger::projections::MetricsReport;

fn f(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// GPU-hours of `r`'s worker-seconds at `gpus_per_worker` GPUs each.
pub fn gpu_hours(r: &MetricsReport, gpus_per_worker: u32) -> f64 {
    r.worker_seconds() * f64::from(gpus_per_worker) / 3600.0
}

/// The report as tables; with `gpus_per_worker` (known to the replay, not to the logs), the
/// run's GPU-hours too.
pub fn table(r: &MetricsReport, gpus_per_worker: Option<u32>) -> String {
    let mut totals = Table::new();
    totals.load_preset(UTF8_FULL_CONDENSED);
    totals.set_header(vec!["figure", "value"]);
    let rows: Vec<(&str, String)> = vec![
        ("requests", r.num_requests.to_string()),
        (
            "completed / rejected / failed / canceled",
            format!(
                "{} / {} / {} / {}",
                r.completed_requests, r.rejected_requests, r.failed_requests, r.canceled_requests
            ),
        ),
        ("input / output tokens", format!("{} / {}", r.total_input_tokens, r.total_output_tokens)),
        ("virtual duration (s)", f(r.duration_ms / 1e3)),
        ("requests/s", f(r.request_throughput_rps)),
        (
            "goodput",
            match (r.slo, r.goodput_rps, r.goodput_fraction) {
                (Some(slo), Some(rps), Some(share)) => {
                    format!("{} requests/s, {:.1}% of requests (SLO {slo})", f(rps), share * 100.0)
                }
                _ => "— (no SLO given)".to_string(),
            },
        ),
        ("output tokens/s", f(r.output_throughput_tok_s)),
        ("total tokens/s", f(r.total_throughput_tok_s)),
        ("prefix cache reuse", format!("{:.1}%", r.prefix_cache_reused_ratio * 100.0)),
        ("handoffs started", r.handoffs_started.to_string()),
        (
            "leases expired / reservations expired / canceled",
            format!("{} / {} / {}", r.leases_expired, r.reservations_expired, r.handoffs_canceled),
        ),
    ];
    let mut rows = rows;
    if r.worker_seconds_aggregated > 0.0 {
        rows.push(("worker-seconds (aggregated)", f(r.worker_seconds_aggregated)));
    } else {
        rows.push((
            "worker-seconds (prefill / decode)",
            format!("{} / {}", f(r.worker_seconds_prefill), f(r.worker_seconds_decode)),
        ));
    }
    if let Some(gpus) = gpus_per_worker {
        rows.push(("GPU-hours", format!("{} ({gpus} per worker)", f(gpu_hours(r, gpus)))));
    }
    for (k, v) in rows {
        totals.add_row(vec![k.to_string(), v]);
    }
    let mut lat = Table::new();
    lat.load_preset(UTF8_FULL_CONDENSED);
    lat.set_header(vec!["latency", "mean", "p50", "p90", "p99", "max", "n"]);
    let mut add = |name: &str, s: &Stats| {
        let right = |text: String| Cell::new(text).set_alignment(CellAlignment::Right);
        let mut row = vec![Cell::new(name)];
        // An empty statistic has no value, not a value of zero.
        let values = [s.mean, s.p50, s.p90, s.p99, s.max];
        row.extend(values.iter().map(|v| right(if s.count == 0 { "—".to_string() } else { duration(*v) })));
        row.push(right(s.count.to_string()));
        lat.add_row(row);
    };
    add("TTFT", &r.ttft_ms);
    add("TPOT", &r.tpot_ms);
    add("ITL", &r.itl_ms);
    add("stall (preempted)", &r.stall_ms);
    add("E2E", &r.e2e_latency_ms);
    add("source pinned", &r.source_pin_ms);
    add("prefill done → reserved", &r.prefill_done_to_reserved_ms);
    add("reservation wait", &r.reservation_wait_ms);
    let mut s = format!("{totals}\n{lat}");
    if !r.pinned_block_seconds.is_empty() {
        let parts: Vec<String> =
            r.pinned_block_seconds.iter().map(|(w, v)| format!("{w} {}", f(*v))).collect();
        s.push_str(&wrapped("pinned block-seconds: ", &parts, 100));
    }
    s
}

/// A latency in ms as a person reads it: ms below 10 s, seconds above.
fn duration(ms: f64) -> String {
    if ms.abs() >= 10_000.0 {
        format!("{:.1} s", ms / 1e3)
    } else {
        format!("{} ms", f(ms))
    }
}

/// `label` then `parts` joined by ", ", broken into lines of at most `width` characters (a
/// cluster of 100 prefill workers is one figure per worker, not one 3,000-character line).
fn wrapped(label: &str, parts: &[String], width: usize) -> String {
    let mut out = format!("\n{label}");
    let mut line_len = label.chars().count();
    for (i, p) in parts.iter().enumerate() {
        let piece = if i + 1 < parts.len() { format!("{p}, ") } else { p.clone() };
        if line_len + piece.chars().count() > width && line_len > label.len() {
            out.push_str("\n  ");
            line_len = 2;
        }
        line_len += piece.chars().count();
        out.push_str(&piece);
    }
    out
}
