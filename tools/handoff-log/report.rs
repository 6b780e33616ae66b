//! The replay report as a table for people.

use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};
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
    lat.set_header(vec!["ms", "mean", "p50", "p90", "p99", "max", "n"]);
    let mut add = |name: &str, s: &Stats| {
        lat.add_row(vec![
            name.to_string(),
            f(s.mean),
            f(s.p50),
            f(s.p90),
            f(s.p99),
            f(s.max),
            s.count.to_string(),
        ]);
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
        s.push_str(&format!("\npinned block-seconds: {}", parts.join(", ")));
    }
    s
}
