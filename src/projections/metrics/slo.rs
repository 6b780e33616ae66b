//! Latency objectives for goodput: parsing `--slo`, and judging one completed request.

use crate::units::NS_PER_MS_F64;
use serde::Serialize;

/// Latency objectives a request must all meet to count toward goodput (DistServe's
/// definition). Thresholds are ms; a missing one is not checked.
///
/// * `ttft_ms`: the request's time to first token;
/// * `itl_ms` and `tpot_ms`: the request's mean inter-token gap, `(last token − first token) /
///   (output tokens − 1)` (its TPOT). The fold sees no per-token times for a request, only its
///   first and last token, so `itl_ms` is checked against that mean as well; a request with one
///   output token has no gap and meets both;
/// * `e2e_ms`: arrival to last token.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Slo {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub itl_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tpot_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub e2e_ms: Option<f64>,
}

/// The keys `Slo::from_str` accepts, in the order they are printed.
pub const SLO_KEYS: [&str; 4] = ["ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"];

impl Slo {
    /// No threshold given: goodput is not computed.
    pub fn is_empty(&self) -> bool {
        // Checked once per completed request: no allocation.
        self.ttft_ms.is_none() && self.itl_ms.is_none() && self.tpot_ms.is_none() && self.e2e_ms.is_none()
    }

    /// The given thresholds as `(key, ms)`, in [`SLO_KEYS`] order.
    pub fn thresholds(&self) -> Vec<(&'static str, f64)> {
        [self.ttft_ms, self.itl_ms, self.tpot_ms, self.e2e_ms]
            .into_iter()
            .zip(SLO_KEYS)
            .filter_map(|(v, k)| v.map(|v| (k, v)))
            .collect()
    }

    /// Whether a completed request with these figures (ns) met every given threshold. A request
    /// without a first token fails a TTFT objective; one without a gap meets the gap objectives.
    pub(super) fn met(&self, ttft_ns: Option<u64>, tpot_ns: Option<u64>, e2e_ns: u64) -> bool {
        let within =
            |limit_ms: Option<f64>, value_ns: Option<u64>, missing_meets: bool| match (limit_ms, value_ns) {
                (None, _) => true,
                (Some(l), Some(v)) => v as f64 / NS_PER_MS_F64 <= l,
                (Some(_), None) => missing_meets,
            };
        within(self.ttft_ms, ttft_ns, false)
            && within(self.itl_ms, tpot_ns, true)
            && within(self.tpot_ms, tpot_ns, true)
            && within(self.e2e_ms, Some(e2e_ns), false)
    }
}

impl std::fmt::Display for Slo {
    /// `ttft_ms=2000,itl_ms=50`: what `from_str` reads.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.thresholds().iter().map(|(k, v)| format!("{k}={v}")).collect();
        f.write_str(&parts.join(","))
    }
}

impl std::str::FromStr for Slo {
    type Err = String;

    /// Reads `key=ms[,key=ms...]` with keys from [`SLO_KEYS`], each at most once, values finite
    /// and > 0.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut slo = Slo::default();
        for part in s.split(',').map(str::trim) {
            if part.is_empty() {
                return Err(format!("empty entry in `{s}` (expected key=ms[,key=ms...])"));
            }
            let Some((key, value)) = part.split_once('=') else {
                return Err(format!("`{part}`: expected key=ms, e.g. ttft_ms=2000"));
            };
            let key = key.trim();
            let slot = match key {
                "ttft_ms" => &mut slo.ttft_ms,
                "itl_ms" => &mut slo.itl_ms,
                "tpot_ms" => &mut slo.tpot_ms,
                "e2e_ms" => &mut slo.e2e_ms,
                other => {
                    return Err(format!("unknown SLO key `{other}` (expected {})", SLO_KEYS.join(", ")));
                }
            };
            let ms: f64 = value
                .trim()
                .parse()
                .ok()
                .filter(|v: &f64| v.is_finite() && *v > 0.0)
                .ok_or_else(|| format!("{key}: `{}` is not a time in ms greater than 0", value.trim()))?;
            if slot.replace(ms).is_some() {
                return Err(format!("{key} is given twice"));
            }
        }
        Ok(slo)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slo_reads_any_subset_of_the_keys() {
        let s: Slo = "ttft_ms=2000, itl_ms=50".parse().unwrap();
        assert_eq!(s, Slo { ttft_ms: Some(2000.0), itl_ms: Some(50.0), ..Slo::default() });
        assert_eq!(s.to_string(), "ttft_ms=2000,itl_ms=50");
        let s: Slo = "e2e_ms=1.5,tpot_ms=20".parse().unwrap();
        assert_eq!(s.thresholds(), vec![("tpot_ms", 20.0), ("e2e_ms", 1.5)]);
    }

    #[test]
    fn slo_errors_name_the_key() {
        for (text, needle) in [
            ("ttft=10", "unknown SLO key `ttft`"),
            ("ttft_ms=fast", "ttft_ms: `fast`"),
            ("itl_ms=-1", "itl_ms: `-1`"),
            ("e2e_ms", "`e2e_ms`: expected key=ms"),
            ("ttft_ms=1,ttft_ms=2", "ttft_ms is given twice"),
            ("ttft_ms=1,", "empty entry"),
        ] {
            let e = text.parse::<Slo>().unwrap_err();
            assert!(e.contains(needle), "{text}: {e}");
        }
    }

    #[test]
    fn a_request_meets_an_slo_only_within_every_threshold() {
        let slo: Slo = "ttft_ms=100,itl_ms=10".parse().unwrap();
        let ms = |v: u64| v * 1_000_000;
        assert!(slo.met(Some(ms(100)), Some(ms(10)), ms(5000)));
        assert!(!slo.met(Some(ms(101)), Some(ms(10)), ms(5000)));
        assert!(!slo.met(Some(ms(100)), Some(ms(11)), ms(5000)));
        assert!(slo.met(Some(ms(1)), None, ms(1)), "one output token: no gap to miss");
        assert!(!slo.met(None, None, ms(1)), "no first token: TTFT missed");
    }
}
