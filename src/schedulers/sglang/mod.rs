//! SGLang-like engine core (placeholder docs, expanded below).

pub mod config;
mod core;
mod radix;

pub use self::config::{ConfigError, SglangConfig};
pub use self::core::SglangCore;

#[cfg(test)]
mod tests;
