//! The per-request record (`--per-request`, docs/per-request.md) and its stable id.

use crate::ids::RequestId;
use serde::Serialize;

/// One request's figures, written as a JSON line by `--per-request`. Key names follow the
/// reference mocker's per-request report so existing scripts keep working.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PerRequest {
    pub uuid: String,
    pub request_id: u64,
    pub arrival_time_ms: f64,
    pub first_token_ms: Option<f64>,
    pub terminal_time_ms: Option<f64>,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_latency_ms: Option<f64>,
    pub input_length: u32,
    pub requested_output_length: u32,
    pub output_length: u32,
    pub reused_input_tokens: u32,
    pub prefill_worker_idx: Option<u32>,
    pub decode_worker_idx: Option<u32>,
    pub handoff_id: Option<String>,
    pub prefill_admit_ms: Option<f64>,
    pub source_held_ms: Option<f64>,
    pub destination_reserved_ms: Option<f64>,
    pub destination_activated_ms: Option<f64>,
    pub decode_admit_ms: Option<f64>,
    pub source_released_ms: Option<f64>,
    pub terminal_status: Option<&'static str>,
    /// Why it ended: `completed`, a rejection (`never-fits`, `no-capacity`, ...), or the
    /// handoff's first failure (`lease-expired`, `reservation-expired`, `bootstrap-timeout`,
    /// `transfer-failed`, `peer-lost`, ...). See docs/per-request.md.
    pub terminal_reason: Option<&'static str>,
    /// Times a decode or aggregated engine preempted (vLLM) or retracted (SGLang) it.
    pub preemptions: u32,
    /// The KV transfer, from its start on the destination to receive completion (with NIC
    /// contention: queueing for a transfer slot included; `transfer_queued_ms` is that part).
    pub transfer_ms: Option<f64>,
    pub transfer_queued_ms: Option<f64>,
    /// Output stalls those caused: the summed gaps from the token before each preemption to
    /// the token after it (each gap is also one ITL sample).
    pub stall_ms: f64,
}

/// Receives each request's figures as it ends (`--per-request` writes them as JSON lines).
pub type PerRequestSink = Box<dyn FnMut(&PerRequest) + Send>;

/// A stable per-request UUID derived from the run's seed and the request index.
pub fn request_uuid(seed: u64, request: RequestId) -> uuid::Uuid {
    let hi = crate::model::request::mix(seed ^ 0x5_eed0_f4e9_0e57, request.0);
    let lo = crate::model::request::mix(hi, request.0 ^ 0x0123_4567_89ab_cdef);
    uuid::Builder::from_random_bytes(((hi as u128) << 64 | lo as u128).to_be_bytes()).into_uuid()
}
