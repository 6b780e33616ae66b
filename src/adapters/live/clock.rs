//! Model time on the wall clock: the only place live mode reads a clock.

use std::time::{Duration, Instant};

/// Model time = (wall time − origin) ÷ scale. The origin may lie in the future (a run starts
/// a moment after its handshake); model time is 0 until then.
#[derive(Clone, Copy, Debug)]
pub struct ModelClock {
    origin: Instant,
    scale: f64,
}

impl ModelClock {
    /// A clock whose model time 0 is `origin`.
    pub fn new(origin: Instant, scale: f64) -> Self {
        ModelClock { origin, scale }
    }

    /// A clock reading `model_ns` at wall instant `at` (a probe's answer); `model_ns` may be
    /// negative (before the origin).
    pub fn reading(at: Instant, model_ns: i64, scale: f64) -> Self {
        let wall_ns = model_ns as f64 * scale;
        let origin = if wall_ns >= 0.0 {
            at.checked_sub(Duration::from_nanos(wall_ns as u64)).unwrap_or(at)
        } else {
            at + Duration::from_nanos((-wall_ns) as u64)
        };
        ModelClock { origin, scale }
    }

    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Model nanoseconds at wall instant `at`, negative before the origin.
    pub fn model_at(&self, at: Instant) -> i64 {
        let wall_ns = if at >= self.origin {
            at.duration_since(self.origin).as_nanos() as f64
        } else {
            -(self.origin.duration_since(at).as_nanos() as f64)
        };
        (wall_ns / self.scale) as i64
    }

    /// Model nanoseconds now (0 before the origin).
    pub fn now_ns(&self) -> u64 {
        self.model_at(Instant::now()).max(0) as u64
    }

    /// Model instant 0 on the system clock, Unix nanoseconds.
    pub fn origin_unix_ns(&self) -> i64 {
        let (now, system) = (Instant::now(), unix_now_ns());
        if now >= self.origin {
            system - now.duration_since(self.origin).as_nanos() as i64
        } else {
            system + self.origin.duration_since(now).as_nanos() as i64
        }
    }

    /// The wall instant at which model time reaches `model_ns`.
    pub fn wall_at(&self, model_ns: u64) -> Instant {
        let wall_ns = (model_ns as f64 * self.scale).min(u64::MAX as f64 / 2.0);
        self.origin + Duration::from_nanos(wall_ns as u64)
    }
}

/// The system clock now, Unix nanoseconds (negative before 1970, as a broken clock may be).
pub fn unix_now_ns() -> i64 {
    match std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i64,
        Err(e) => -(e.duration().as_nanos() as i64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wall_and_model_time_convert_both_ways() {
        let origin = Instant::now();
        let c = ModelClock::new(origin, 0.1);
        // 10 ms of wall time is 100 ms of model time at a tenth of real time.
        assert_eq!(c.model_at(origin + Duration::from_millis(10)), 100_000_000);
        assert_eq!(c.wall_at(100_000_000), origin + Duration::from_millis(10));
        assert!(c.model_at(origin - Duration::from_millis(1)) < 0);
    }

    #[test]
    fn a_reading_before_the_origin_puts_the_origin_ahead() {
        let at = Instant::now();
        let c = ModelClock::reading(at, -50_000_000, 0.5);
        assert_eq!(c.wall_at(0), at + Duration::from_millis(25));
        let d = ModelClock::reading(at, 40_000_000, 0.5);
        assert_eq!(d.model_at(at), 40_000_000);
    }
}
