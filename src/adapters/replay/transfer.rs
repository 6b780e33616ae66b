//! KV transfer timing, behind a trait so the replay can swap models.
//!
//! The caller passes the tokens actually missing at the destination (after the destination's
//! prefix reuse, already rounded up to whole destination blocks); the model only turns them into
//! a delay. Concurrent transfers do not contend for bandwidth in these models.

use serde::{Deserialize, Serialize};

/// Turns a transfer's size into its duration.
pub trait TransferModel {
    /// Nanoseconds to move `missing_tokens` tokens of KV to the destination.
    fn transfer_ns(&self, missing_tokens: u64) -> u64;
}

/// The reference's default link: 64 GB/s.
pub const DEFAULT_BANDWIDTH_GBPS: f64 = 64.0;
/// A Llama-3-8B-shaped model: 32 layers × 2 (K and V) × 8 KV heads × 128 head dim × 2 bytes.
pub const DEFAULT_KV_BYTES_PER_TOKEN: u64 = 131_072;

/// Bounds on the link's settings, and the longest a transfer may take (≈ 31.7 years): a duration
/// past it is cut to it, so that an instant plus a transfer never wraps the nanosecond clock (a
/// transfer that long outlives every lease and reservation, which then fail it visibly).
pub const MIN_BANDWIDTH_GBPS: f64 = 1e-3;
pub const MAX_KV_BYTES_PER_TOKEN: u64 = 1 << 27;
pub const MAX_TRANSFER_NS: u64 = 1_000_000_000_000_000_000;

/// Delay = latency + bytes / bandwidth, bytes = missing tokens × KV bytes per token.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BandwidthTransfer {
    /// Link bandwidth in GB/s, where 1 GB = 1e9 bytes.
    #[serde(default = "default_bandwidth")]
    pub bandwidth_gbps: f64,
    #[serde(default = "default_kv_bytes")]
    pub kv_bytes_per_token: u64,
    /// Fixed per-transfer latency added to every transfer, including an empty one.
    #[serde(default)]
    pub latency_ns: u64,
}

fn default_bandwidth() -> f64 {
    DEFAULT_BANDWIDTH_GBPS
}
fn default_kv_bytes() -> u64 {
    DEFAULT_KV_BYTES_PER_TOKEN
}

impl Default for BandwidthTransfer {
    fn default() -> Self {
        BandwidthTransfer {
            bandwidth_gbps: DEFAULT_BANDWIDTH_GBPS,
            kv_bytes_per_token: DEFAULT_KV_BYTES_PER_TOKEN,
            latency_ns: 0,
        }
    }
}

impl BandwidthTransfer {
    /// Bytes a transfer of `missing_tokens` carries (saturating: absurd sizes stay finite).
    pub fn bytes(&self, missing_tokens: u64) -> u64 {
        missing_tokens.saturating_mul(self.kv_bytes_per_token)
    }

    pub fn validate(&self) -> Result<(), TransferConfigError> {
        if !(self.bandwidth_gbps.is_finite() && self.bandwidth_gbps >= MIN_BANDWIDTH_GBPS) {
            return Err(TransferConfigError(format!(
                "bandwidth_gbps must be a finite number >= {MIN_BANDWIDTH_GBPS} (1 MB/s), got {}",
                self.bandwidth_gbps
            )));
        }
        if self.kv_bytes_per_token == 0 || self.kv_bytes_per_token > MAX_KV_BYTES_PER_TOKEN {
            return Err(TransferConfigError(format!(
                "kv_bytes_per_token must be in 1..={MAX_KV_BYTES_PER_TOKEN}, got {}",
                self.kv_bytes_per_token
            )));
        }
        if self.latency_ns > MAX_TRANSFER_NS {
            return Err(TransferConfigError(format!(
                "latency_ns must be at most {MAX_TRANSFER_NS}, got {}",
                self.latency_ns
            )));
        }
        Ok(())
    }
}

impl TransferModel for BandwidthTransfer {
    fn transfer_ns(&self, missing_tokens: u64) -> u64 {
        // bytes / (GB/s) = ns, since 1 GB/s moves one byte per ns. Round up: a transfer of any
        // bytes takes at least one ns. f64 is exact for byte counts below 2^53 (~9 PB).
        let wire_ns = (self.bytes(missing_tokens) as f64 / self.bandwidth_gbps).ceil();
        self.latency_ns.saturating_add(wire_ns as u64).min(MAX_TRANSFER_NS)
    }
}

/// Every transfer takes the same time, whatever its size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FixedTransfer {
    pub delay_ns: u64,
}

impl TransferModel for FixedTransfer {
    fn transfer_ns(&self, _missing_tokens: u64) -> u64 {
        self.delay_ns
    }
}

/// A transfer model as configured, e.g. in TOML:
/// `transfer = { mode = "bandwidth", bandwidth_gbps = 64.0 }` or
/// `transfer = { mode = "fixed", delay_ns = 2000000 }`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "kebab-case")]
pub enum TransferConfig {
    Bandwidth(BandwidthTransfer),
    Fixed(FixedTransfer),
}

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig::Bandwidth(BandwidthTransfer::default())
    }
}

/// A configuration value out of range.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("transfer config: {0}")]
pub struct TransferConfigError(pub String);

impl TransferConfig {
    /// KV bytes per token, for sizing transfers in facts (the fixed-delay model has no size of
    /// its own, so it reports the default model's).
    pub fn kv_bytes_per_token(&self) -> u64 {
        match self {
            TransferConfig::Bandwidth(b) => b.kv_bytes_per_token,
            TransferConfig::Fixed(_) => DEFAULT_KV_BYTES_PER_TOKEN,
        }
    }

    pub fn validate(&self) -> Result<(), TransferConfigError> {
        match self {
            TransferConfig::Bandwidth(b) => b.validate(),
            TransferConfig::Fixed(f) if f.delay_ns > MAX_TRANSFER_NS => Err(TransferConfigError(format!(
                "delay_ns must be at most {MAX_TRANSFER_NS}, got {}",
                f.delay_ns
            ))),
            TransferConfig::Fixed(_) => Ok(()),
        }
    }
}

impl TransferModel for TransferConfig {
    fn transfer_ns(&self, missing_tokens: u64) -> u64 {
        match self {
            TransferConfig::Bandwidth(b) => b.transfer_ns(missing_tokens),
            TransferConfig::Fixed(f) => f.transfer_ns(missing_tokens),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidth_delay_matches_hand_computation() {
        let t = BandwidthTransfer::default();
        // 1000 tokens × 131072 B = 131,072,000 B at 64e9 B/s = 2,048,000 ns.
        assert_eq!(t.transfer_ns(1000), 2_048_000);
        assert_eq!(t.transfer_ns(0), 0);
        let t = BandwidthTransfer { latency_ns: 500, ..t };
        assert_eq!(t.transfer_ns(0), 500);
        assert_eq!(t.transfer_ns(1000), 2_048_500);
        // Rounds up: 1 byte per token at 3 GB/s → 1/3 ns → 1 ns.
        let t = BandwidthTransfer { bandwidth_gbps: 3.0, kv_bytes_per_token: 1, latency_ns: 0 };
        assert_eq!(t.transfer_ns(1), 1);
    }

    #[test]
    fn delay_is_monotone_in_tokens() {
        let t = BandwidthTransfer { bandwidth_gbps: 7.3, kv_bytes_per_token: 12_345, latency_ns: 11 };
        let mut prev = 0;
        for n in (0..100_000u64).step_by(997) {
            let d = t.transfer_ns(n);
            assert!(d >= prev, "{n}: {d} < {prev}");
            prev = d;
        }
    }

    #[test]
    fn fixed_ignores_size() {
        let f = FixedTransfer { delay_ns: 42 };
        assert_eq!(f.transfer_ns(0), 42);
        assert_eq!(f.transfer_ns(1 << 40), 42);
    }

    #[test]
    fn config_parses_defaults_and_rejects_unknown_fields() {
        let c: TransferConfig = serde_json::from_str(r#"{"mode":"bandwidth"}"#).unwrap();
        assert_eq!(c, TransferConfig::default());
        let c: TransferConfig =
            serde_json::from_str(r#"{"mode":"bandwidth","bandwidth_gbps":32,"latency_ns":7}"#).unwrap();
        assert_eq!(c.transfer_ns(1000), 4_096_007);
        let c: TransferConfig = serde_json::from_str(r#"{"mode":"fixed","delay_ns":9}"#).unwrap();
        assert_eq!(c.transfer_ns(123), 9);
        assert!(serde_json::from_str::<TransferConfig>(r#"{"mode":"bandwidth","bandwith_gbps":1}"#).is_err());
        assert!(serde_json::from_str::<TransferConfig>(r#"{"mode":"fixed"}"#).is_err());
        assert!(serde_json::from_str::<TransferConfig>(r#"{"mode":"warp"}"#).is_err());
    }

    #[test]
    fn validation_rejects_bad_values() {
        for bw in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let c = TransferConfig::Bandwidth(BandwidthTransfer { bandwidth_gbps: bw, ..Default::default() });
            assert!(c.validate().is_err(), "{bw}");
        }
        let c = TransferConfig::Bandwidth(BandwidthTransfer { kv_bytes_per_token: 0, ..Default::default() });
        assert!(c.validate().is_err());
        assert!(TransferConfig::default().validate().is_ok());
    }
}
