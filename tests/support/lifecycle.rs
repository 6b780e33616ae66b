//! Shared builders for the lifecycle tests (`tests/lifecycle_*.rs`).

use handoff_ledger::ids::{
    CancelReason, Generation, HandoffId, HandoffPolicy, IdMint, KvHandoffDemand, RequestId, WorkerId,
};
use handoff_ledger::lifecycle::{
    DestinationConfig, DestinationHandoff, DestinationInit, SourceConfig, SourceHandoff, SourceInit,
};

pub const LEASE_NS: u64 = 30_000_000_000;
pub const RENEW_NS: u64 = 20_000_000_000;
pub const RESERVATION_NS: u64 = 300_000_000_000;
pub const KV_BYTES_PER_TOKEN: u64 = 131_072;
pub const PROMPT_TOKENS: u32 = 4096;

pub fn source_worker() -> WorkerId {
    WorkerId::prefill(0)
}
pub fn dest_worker() -> WorkerId {
    WorkerId::decode(0)
}

pub fn handoff_id(seed: u64) -> HandoffId {
    IdMint::from_seed(seed).handoff_id()
}

pub fn demand() -> KvHandoffDemand {
    KvHandoffDemand { context_tokens: PROMPT_TOKENS, max_output_tokens: 128 }
}

pub fn source(
    id: HandoffId,
    policy: HandoffPolicy,
    destination: Option<WorkerId>,
    destination_generation: Option<Generation>,
) -> SourceHandoff {
    SourceHandoff::new(SourceInit {
        handoff: id,
        request: RequestId(1),
        policy,
        demand: demand(),
        worker: source_worker(),
        generation: Generation(3),
        destination,
        destination_generation,
        config: SourceConfig { lease_ns: LEASE_NS, renew_ns: RENEW_NS },
    })
    .expect("enabled policy")
}

pub fn destination(
    id: HandoffId,
    policy: HandoffPolicy,
    source: Option<WorkerId>,
    source_generation: Option<Generation>,
) -> DestinationHandoff {
    DestinationHandoff::new(DestinationInit {
        handoff: id,
        request: RequestId(1),
        policy,
        demand: demand(),
        worker: dest_worker(),
        generation: Generation(5),
        source,
        source_generation,
        config: DestinationConfig { reservation_ns: RESERVATION_NS, kv_bytes_per_token: KV_BYTES_PER_TOKEN },
    })
    .expect("enabled policy")
}

pub const REASONS: [CancelReason; 4] = [
    CancelReason::RequestAborted,
    CancelReason::TransferFailed,
    CancelReason::OwnerLost,
    CancelReason::Teardown,
];

pub use super::count;
