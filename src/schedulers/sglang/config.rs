//! SGLang-like engine configuration, with the real engine's defaults where it has one.

use crate::schedulers::PolynomialTiming;
use serde::{Deserialize, Serialize};

/// Configuration of one SGLang-like worker. Every field has a default, so `{}` is a valid
/// configuration file; unknown keys are refused so a typo never silently falls back to a default.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SglangConfig {
    /// Physical KV pages on the worker (the reference mocker's `num_gpu_blocks` default).
    pub total_pages: u32,
    /// Tokens per page. SGLang's own default is 1; we default to 64 because deployments often
    /// run 64 in practice, a page-per-token model costs 64× the bookkeeping, and 64 matches the
    /// reference mocker's block size, which keeps side-by-side comparisons fair.
    pub page_size: u32,
    /// Request slots (`max_running_requests`): running, waiting-with-KV, pre-allocated
    /// (reserved), transferring and pinned-source requests all hold one.
    pub max_running_requests: u32,
    /// New prompt tokens one prefill batch may compute (`max_prefill_tokens`).
    pub max_prefill_tokens: u32,
    /// Largest prompt chunk one step computes for one request (`chunked_prefill_size`).
    pub chunked_prefill_size: u32,
    /// `max_new_tokens` estimates are clipped to this (`CLIP_MAX_NEW_TOKENS`).
    pub clip_max_new_tokens: u32,
    /// Fraction of a running request's remaining output that prefill admission reserves.
    pub init_new_token_ratio: f64,
    /// The floor the ratio decays to.
    pub min_new_token_ratio: f64,
    /// Decode passes over which the ratio decays linearly from init to min.
    pub new_token_ratio_decay_steps: u32,
    /// Decode headroom per decoding request that destination pre-allocation keeps free
    /// (admission-only, never allocated).
    pub num_reserved_decode_tokens: u32,
    /// Bound of the waiting queue for new submissions (retracted requests return regardless:
    /// they were already admitted once).
    pub max_waiting_requests: u32,
    /// Bound of the pre-allocation FIFO.
    pub max_pending_reservations: u32,
    /// Step timing model.
    pub timing: PolynomialTiming,
}

impl Default for SglangConfig {
    fn default() -> Self {
        SglangConfig {
            total_pages: 16384,
            page_size: 64,
            max_running_requests: 256,
            max_prefill_tokens: 16384,
            chunked_prefill_size: 8192,
            clip_max_new_tokens: 4096,
            init_new_token_ratio: 0.7,
            min_new_token_ratio: 0.098,
            new_token_ratio_decay_steps: 600,
            num_reserved_decode_tokens: 512,
            max_waiting_requests: 65536,
            max_pending_reservations: 65536,
            timing: PolynomialTiming::default(),
        }
    }
}

/// A configuration the core refuses.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("{field} must be at least {min} (got {got})")]
    TooSmall { field: &'static str, min: u64, got: u64 },
    #[error("{field} must be at most {max} (got {got})")]
    TooLarge { field: &'static str, max: u64, got: u64 },
    #[error("chunked_prefill_size ({chunk}) must be at least page_size ({page})")]
    ChunkBelowPage { chunk: u32, page: u32 },
    #[error("new token ratios need 0 <= min ({min}) <= init ({init}) <= 1, both finite")]
    BadRatio { init: f64, min: f64 },
    #[error("timing speedups must be finite and positive (prefill {prefill}, decode {decode})")]
    BadSpeedup { prefill: f64, decode: f64 },
}

/// Most pages one worker may have (see `validate`).
pub const MAX_PAGES: u32 = 1 << 24;

impl SglangConfig {
    /// Checks every bound the core relies on (deltas are `i32`, token counts `u32`).
    pub fn validate(&self) -> Result<(), ConfigError> {
        fn at_least(field: &'static str, got: u32, min: u32) -> Result<(), ConfigError> {
            if got < min {
                return Err(ConfigError::TooSmall { field, min: min as u64, got: got as u64 });
            }
            Ok(())
        }
        fn at_most(field: &'static str, got: u32, max: u32) -> Result<(), ConfigError> {
            if got > max {
                return Err(ConfigError::TooLarge { field, max: max as u64, got: got as u64 });
            }
            Ok(())
        }
        at_least("total_pages", self.total_pages, 1)?;
        // Memory: the radix pool keeps a node's worth of state per page, so this bounds one
        // worker to about 1.3 GB (and deltas, which are i32, stay exact).
        at_most("total_pages", self.total_pages, MAX_PAGES)?;
        at_least("page_size", self.page_size, 1)?;
        at_most("page_size", self.page_size, 1 << 20)?;
        let tokens = self.total_pages as u64 * self.page_size as u64;
        if tokens > u32::MAX as u64 {
            return Err(ConfigError::TooLarge {
                field: "total_pages × page_size",
                max: u32::MAX as u64,
                got: tokens,
            });
        }
        at_least("max_running_requests", self.max_running_requests, 1)?;
        at_most("max_running_requests", self.max_running_requests, i32::MAX as u32)?;
        at_least("max_prefill_tokens", self.max_prefill_tokens, 1)?;
        at_least("chunked_prefill_size", self.chunked_prefill_size, 1)?;
        if self.chunked_prefill_size < self.page_size {
            return Err(ConfigError::ChunkBelowPage {
                chunk: self.chunked_prefill_size,
                page: self.page_size,
            });
        }
        at_least("clip_max_new_tokens", self.clip_max_new_tokens, 1)?;
        at_least("new_token_ratio_decay_steps", self.new_token_ratio_decay_steps, 1)?;
        // Headroom rides in an i32 delta field.
        at_most("num_reserved_decode_tokens", self.num_reserved_decode_tokens, (i32::MAX as u32) / 2)?;
        at_least("max_waiting_requests", self.max_waiting_requests, 1)?;
        at_least("max_pending_reservations", self.max_pending_reservations, 1)?;
        let (init, min) = (self.init_new_token_ratio, self.min_new_token_ratio);
        if !(init.is_finite() && min.is_finite() && 0.0 <= min && min <= init && init <= 1.0) {
            return Err(ConfigError::BadRatio { init, min });
        }
        let (p, d) = (self.timing.prefill_speedup, self.timing.decode_speedup);
        if !(p.is_finite() && d.is_finite() && p > 0.0 && d > 0.0) {
            return Err(ConfigError::BadSpeedup { prefill: p, decode: d });
        }
        Ok(())
    }
}
