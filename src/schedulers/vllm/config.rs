//! Configuration of the vLLM-like core. Defaults are the reference mocker's (its vLLM engine uses
//! 64-token blocks; vLLM itself defaults to 16).

use crate::schedulers::PolynomialTiming;
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VllmConfig {
    #[serde(default = "d_num_gpu_blocks")]
    pub num_gpu_blocks: u32,
    #[serde(default = "d_block_size")]
    pub block_size: u32,
    /// Running-sequence limit (a request slot is one running sequence).
    #[serde(default = "d_max_num_seqs")]
    pub max_num_seqs: u32,
    /// Token budget of one step (prefill chunk tokens + one per decoding request).
    #[serde(default = "d_max_num_batched_tokens")]
    pub max_num_batched_tokens: u32,
    #[serde(default = "d_true")]
    pub enable_prefix_caching: bool,
    #[serde(default = "d_true")]
    pub enable_chunked_prefill: bool,
    /// Bound of the waiting queue. A submit beyond it is rejected (`RequestRejected{NoCapacity}`).
    /// Preempted requests re-enter at the front and are never refused (they were admitted once).
    #[serde(default = "d_max_waiting")]
    pub max_waiting_requests: u32,
    /// Bound of the pending-reservation FIFO. A reservation beyond it is refused for good
    /// (`ReservationRefused{NoCapacity}` and a `ReservationFailed` output: the handoff fails).
    #[serde(default = "d_max_pending")]
    pub max_pending_reservations: u32,
    #[serde(default)]
    pub timing: PolynomialTiming,
}

fn d_num_gpu_blocks() -> u32 {
    16384
}
fn d_block_size() -> u32 {
    64
}
fn d_max_num_seqs() -> u32 {
    256
}
fn d_max_num_batched_tokens() -> u32 {
    8192
}
fn d_true() -> bool {
    true
}
fn d_max_waiting() -> u32 {
    1 << 20
}
fn d_max_pending() -> u32 {
    1 << 16
}

impl Default for VllmConfig {
    fn default() -> Self {
        VllmConfig {
            num_gpu_blocks: d_num_gpu_blocks(),
            block_size: d_block_size(),
            max_num_seqs: d_max_num_seqs(),
            max_num_batched_tokens: d_max_num_batched_tokens(),
            enable_prefix_caching: true,
            enable_chunked_prefill: true,
            max_waiting_requests: d_max_waiting(),
            max_pending_reservations: d_max_pending(),
            timing: PolynomialTiming::default(),
        }
    }
}

/// A configuration the core cannot run with.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("num_gpu_blocks must be in 1..{max}, got {got}")]
    NumGpuBlocks { got: u32, max: u32 },
    #[error("block_size must be at least 1")]
    ZeroBlockSize,
    #[error("max_num_seqs must be at least 1")]
    ZeroMaxNumSeqs,
    #[error("max_num_batched_tokens must be at least 1")]
    ZeroBatchedTokens,
    #[error("max_waiting_requests must be at least 1")]
    ZeroWaiting,
    #[error("max_pending_reservations must be at least 1")]
    ZeroPending,
    #[error("timing speedups must be finite and positive, got prefill {prefill} decode {decode}")]
    BadSpeedup { prefill: f64, decode: f64 },
    #[error("backend {0} has no vLLM-like core")]
    Backend(&'static str),
}

/// Most blocks one worker may have: the pool keeps about 80 bytes per block (the block, its
/// hash buckets, free stack and LRU entry), so this is about 1.3 GB; more would exhaust the
/// machine before saying why. (Block ids are u32 with one value reserved as a sentinel.)
pub const MAX_BLOCKS: u32 = 1 << 24;

impl VllmConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.num_gpu_blocks == 0 || self.num_gpu_blocks > MAX_BLOCKS {
            return Err(ConfigError::NumGpuBlocks { got: self.num_gpu_blocks, max: MAX_BLOCKS });
        }
        if self.block_size == 0 {
            return Err(ConfigError::ZeroBlockSize);
        }
        if self.max_num_seqs == 0 {
            return Err(ConfigError::ZeroMaxNumSeqs);
        }
        if self.max_num_batched_tokens == 0 {
            return Err(ConfigError::ZeroBatchedTokens);
        }
        if self.max_waiting_requests == 0 {
            return Err(ConfigError::ZeroWaiting);
        }
        if self.max_pending_reservations == 0 {
            return Err(ConfigError::ZeroPending);
        }
        let ok = |x: f64| x.is_finite() && x > 0.0;
        if !ok(self.timing.prefill_speedup) || !ok(self.timing.decode_speedup) {
            return Err(ConfigError::BadSpeedup {
                prefill: self.timing.prefill_speedup,
                decode: self.timing.decode_speedup,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_reference_mockers() {
        let c: VllmConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(c, VllmConfig::default());
        assert_eq!(
            (c.num_gpu_blocks, c.block_size, c.max_num_seqs, c.max_num_batched_tokens),
            (16384, 64, 256, 8192)
        );
        assert!(c.enable_prefix_caching && c.enable_chunked_prefill);
        assert!(c.validate().is_ok());
    }

    #[test]
    fn unknown_fields_and_bad_values_are_refused() {
        assert!(serde_json::from_str::<VllmConfig>(r#"{"num_blocks": 3}"#).is_err());
        let c = VllmConfig { num_gpu_blocks: 0, ..Default::default() };
        assert!(matches!(c.validate(), Err(ConfigError::NumGpuBlocks { .. })));
        let c = VllmConfig { block_size: 0, ..Default::default() };
        assert_eq!(c.validate(), Err(ConfigError::ZeroBlockSize));
        let c = VllmConfig { max_num_seqs: 0, ..Default::default() };
        assert_eq!(c.validate(), Err(ConfigError::ZeroMaxNumSeqs));
        let c = VllmConfig { max_num_batched_tokens: 0, ..Default::default() };
        assert_eq!(c.validate(), Err(ConfigError::ZeroBatchedTokens));
        let c = VllmConfig {
            timing: PolynomialTiming { prefill_speedup: 0.0, decode_speedup: 1.0 },
            ..Default::default()
        };
        assert!(matches!(c.validate(), Err(ConfigError::BadSpeedup { .. })));
    }
}
