//! Time units shared by every layer: the log's clock counts nanoseconds, reports speak ms.

/// Nanoseconds per millisecond, for integer arithmetic on the log's clock.
pub const NS_PER_MS: u64 = 1_000_000;

/// [`NS_PER_MS`] as a float divisor (distribution statistics, axis scales).
pub const NS_PER_MS_F64: f64 = NS_PER_MS as f64;

/// A duration or instant on the log's clock, in ms.
pub fn ms(ns: u64) -> f64 {
    ns as f64 / NS_PER_MS_F64
}
