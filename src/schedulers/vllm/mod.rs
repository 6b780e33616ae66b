//! The vLLM-like engine core: a prefix-caching block pool, chunked prefill under a token budget,
//! `max_num_seqs`, LIFO preemption, and the handoff resources the scheduler owns (held prefills
//! for source-first handoff, destination reservations with a pending FIFO).
//!
//! * [`block_pool`]: blocks, hashes, reference counts, LRU of cached-free blocks, ownership
//!   classes with their precedence.
//! * [`core`]: [`VllmCore`], the [`EngineCore`](crate::schedulers::EngineCore) implementation.
//! * [`config`]: [`VllmConfig`] (reference mocker defaults) and [`ConfigError`].

pub mod block_pool;
pub mod config;
pub mod core;

pub use self::config::{ConfigError, VllmConfig};
pub use self::core::VllmCore;

#[cfg(test)]
mod tests;
