//! The metrics report, with the reference mocker's key names, and its flat JSON.

use super::Slo;
use crate::projections::distribution::Stats;
use serde::Serialize;
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// The report, with the reference's key names. `to_json` flattens the statistics as
/// `mean_ttft_ms`, `median_ttft_ms`, `p99_ttft_ms`, ...
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct MetricsReport {
    pub num_requests: u64,
    pub completed_requests: u64,
    pub rejected_requests: u64,
    pub failed_requests: u64,
    pub canceled_requests: u64,
    pub total_input_tokens: u64,
    pub total_output_tokens: u64,
    pub duration_ms: f64,
    pub request_throughput_rps: f64,
    pub input_throughput_tok_s: f64,
    pub output_throughput_tok_s: f64,
    pub total_throughput_tok_s: f64,
    pub prefix_cache_reused_ratio: f64,
    pub ttft_ms: Stats,
    pub tpot_ms: Stats,
    pub itl_ms: Stats,
    pub e2e_latency_ms: Stats,
    pub output_token_throughput_per_user: Stats,
    pub handoffs_started: u64,
    pub leases_expired: u64,
    pub reservations_expired: u64,
    pub handoffs_canceled: u64,
    /// Pinned source block-seconds per prefill worker.
    pub pinned_block_seconds: BTreeMap<String, f64>,
    pub source_pin_ms: Stats,
    pub prefill_done_to_reserved_ms: Stats,
    pub reservation_wait_ms: Stats,
    /// Output stalls from preemption / retraction (each also an ITL sample).
    pub stall_ms: Stats,
    /// Ended requests by `terminal_reason`.
    pub terminal_reasons: BTreeMap<String, u64>,
    /// The objectives goodput was judged by; `None` when none was given.
    pub slo: Option<Slo>,
    /// Completed requests per second (over `duration_ms`) that met every objective.
    pub goodput_rps: Option<f64>,
    /// The share of all requests (`num_requests`, whatever their outcome) that completed and
    /// met every objective.
    pub goodput_fraction: Option<f64>,
    /// Per role, the integral of the workers present over the run's duration: a worker counts
    /// from its join (first `SessionStarted`) to its leave (`WorkerLeft`) or the end.
    pub worker_seconds_prefill: f64,
    pub worker_seconds_decode: f64,
    pub worker_seconds_aggregated: f64,
}

impl MetricsReport {
    /// Worker-seconds over every role.
    pub fn worker_seconds(&self) -> f64 {
        self.worker_seconds_prefill + self.worker_seconds_decode + self.worker_seconds_aggregated
    }
}

impl MetricsReport {
    /// The flat JSON object of the reference's summary plus our stranding figures.
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        let mut put = |k: &str, v: Value| {
            m.insert(k.to_string(), v);
        };
        put("num_requests", self.num_requests.into());
        put("completed_requests", self.completed_requests.into());
        put("rejected_requests", self.rejected_requests.into());
        put("failed_requests", self.failed_requests.into());
        put("canceled_requests", self.canceled_requests.into());
        put("total_input_tokens", self.total_input_tokens.into());
        put("total_output_tokens", self.total_output_tokens.into());
        put("duration_ms", self.duration_ms.into());
        put("request_throughput_rps", self.request_throughput_rps.into());
        put("input_throughput_tok_s", self.input_throughput_tok_s.into());
        put("output_throughput_tok_s", self.output_throughput_tok_s.into());
        put("total_throughput_tok_s", self.total_throughput_tok_s.into());
        put("prefix_cache_reused_ratio", self.prefix_cache_reused_ratio.into());
        put("num_ttft_samples", self.ttft_ms.count.into());
        put("num_tpot_samples", self.tpot_ms.count.into());
        put("num_e2e_latency_samples", self.e2e_latency_ms.count.into());
        put("handoffs_started", self.handoffs_started.into());
        put("leases_expired", self.leases_expired.into());
        put("reservations_expired", self.reservations_expired.into());
        put("handoffs_canceled", self.handoffs_canceled.into());
        put("pinned_block_seconds", serde_json::to_value(&self.pinned_block_seconds).unwrap_or(Value::Null));
        put("num_itl_samples", self.itl_ms.count.into());
        put("num_stalls", self.stall_ms.count.into());
        put("terminal_reasons", serde_json::to_value(&self.terminal_reasons).unwrap_or(Value::Null));
        put("slo", self.slo.and_then(|s| serde_json::to_value(s).ok()).unwrap_or(Value::Null));
        put("goodput_rps", self.goodput_rps.into());
        put("goodput_fraction", self.goodput_fraction.into());
        put("worker_seconds_prefill", self.worker_seconds_prefill.into());
        put("worker_seconds_decode", self.worker_seconds_decode.into());
        put("worker_seconds_aggregated", self.worker_seconds_aggregated.into());
        for (name, unit, s) in [
            ("ttft", "_ms", &self.ttft_ms),
            ("tpot", "_ms", &self.tpot_ms),
            ("itl", "_ms", &self.itl_ms),
            ("e2e_latency", "_ms", &self.e2e_latency_ms),
            ("output_token_throughput_per_user", "", &self.output_token_throughput_per_user),
            ("source_pin", "_ms", &self.source_pin_ms),
            ("prefill_done_to_reserved", "_ms", &self.prefill_done_to_reserved_ms),
            ("reservation_wait", "_ms", &self.reservation_wait_ms),
            ("stall", "_ms", &self.stall_ms),
        ] {
            for (stat, v) in [
                ("mean", s.mean),
                ("min", s.min),
                ("max", s.max),
                ("median", s.p50),
                ("p75", s.p75),
                ("p90", s.p90),
                ("p95", s.p95),
                ("p99", s.p99),
                ("std", s.std),
            ] {
                put(&format!("{stat}_{name}{unit}"), v.into());
            }
        }
        Value::Object(m)
    }
}
