//! Step timing models. A core asks its model how long a step takes; the duration is part of the
//! step's output, never a sleep.

use serde::{Deserialize, Serialize};

/// What a step did, as far as timing cares.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepShape {
    /// New (uncached) prompt tokens computed in this step.
    pub prefill_tokens: u64,
    /// Requests that produced a decode token in this step.
    pub decode_requests: u64,
    /// KV tokens held by active requests when the step ran.
    pub active_kv_tokens: u64,
    /// KV tokens the worker holds in total.
    pub total_kv_tokens: u64,
}

pub trait TimingModel: Send + Sync {
    /// The modeled duration of one step, in nanoseconds.
    fn step_ns(&self, step: &StepShape) -> u64;
}

/// The reference mocker's default polynomial, with speedup ratios that divide step times.
///
/// * prefill_ms = 4.209989e-7·T² + 1.518344e-2·T + 16.50142 for T new tokens (0 when T = 0)
/// * decode_ms = −25.74·p² + 54.01·p + 5.74, p = active / total KV tokens, at least 1 ms,
///   charged when the step decodes at least one request.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolynomialTiming {
    #[serde(default = "one")]
    pub prefill_speedup: f64,
    #[serde(default = "one")]
    pub decode_speedup: f64,
}

fn one() -> f64 {
    1.0
}

impl Default for PolynomialTiming {
    fn default() -> Self {
        PolynomialTiming { prefill_speedup: 1.0, decode_speedup: 1.0 }
    }
}

impl PolynomialTiming {
    pub fn prefill_ms(&self, tokens: u64) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let t = tokens as f64;
        (4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142) / self.prefill_speedup
    }

    pub fn decode_ms(&self, active_kv_tokens: u64, total_kv_tokens: u64) -> f64 {
        let p = if total_kv_tokens == 0 {
            0.0
        } else {
            (active_kv_tokens as f64 / total_kv_tokens as f64).min(1.0)
        };
        (-25.74 * p * p + 54.01 * p + 5.74).max(1.0) / self.decode_speedup
    }
}

impl TimingModel for PolynomialTiming {
    fn step_ns(&self, s: &StepShape) -> u64 {
        let mut ms = self.prefill_ms(s.prefill_tokens);
        if s.decode_requests > 0 {
            ms += self.decode_ms(s.active_kv_tokens, s.total_kv_tokens);
        }
        (ms * 1e6).round() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polynomial_matches_reference_coefficients() {
        let m = PolynomialTiming::default();
        assert_eq!(m.prefill_ms(0), 0.0);
        let p4k = m.prefill_ms(4096);
        assert!((p4k - (4.209989e-7 * 4096.0f64.powi(2) + 1.518344e-2 * 4096.0 + 16.50142)).abs() < 1e-9);
        assert!((m.decode_ms(0, 100) - 5.74).abs() < 1e-9);
        assert!((m.decode_ms(50, 100) - (-25.74 * 0.25 + 54.01 * 0.5 + 5.74)).abs() < 1e-9);
        let fast = PolynomialTiming { prefill_speedup: 2.0, decode_speedup: 4.0 };
        assert!((fast.prefill_ms(4096) - p4k / 2.0).abs() < 1e-9);
        let ns = m.step_ns(&StepShape {
            prefill_tokens: 0,
            decode_requests: 1,
            active_kv_tokens: 0,
            total_kv_tokens: 10,
        });
        assert_eq!(ns, 5_740_000);
        let idle = m.step_ns(&StepShape::default());
        assert_eq!(idle, 0);
    }
}
