//! Backoff for control-plane contact: exponential ceiling, full jitter.
//!
//! After the n-th failure in a row the next contact waits a uniformly random
//! time in `[0, min(cap, base × 2^(n-1))]`. The randomness spreads a fleet of
//! agents that lost their control plane at the same moment, so they do not
//! return to it in lockstep; the ceiling keeps a long outage from stretching
//! the wait without bound. Success resets it.

use std::time::Duration;

pub struct Backoff {
    base: Duration,
    cap: Duration,
    failures: u32,
}

impl Backoff {
    pub fn new(base: Duration, cap: Duration) -> Backoff {
        Backoff {
            base,
            cap: cap.max(base),
            failures: 0,
        }
    }

    /// Counts one more failure; returns how long to wait, given a jitter
    /// draw in `[0, 1]`.
    pub fn fail(&mut self, jitter: f64) -> Duration {
        self.failures = self.failures.saturating_add(1);
        self.ceiling().mul_f64(jitter.clamp(0.0, 1.0))
    }

    /// The longest the next wait may be.
    pub fn ceiling(&self) -> Duration {
        let doublings = self.failures.saturating_sub(1).min(32);
        self.base
            .checked_mul(1u32 << doublings.min(31))
            .map_or(self.cap, |d| d.min(self.cap))
    }

    pub fn reset(&mut self) {
        self.failures = 0;
    }

    pub fn failures(&self) -> u32 {
        self.failures
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn ceiling_doubles_up_to_the_cap() {
        let mut b = Backoff::new(S(1), S(10));

        let waits: Vec<Duration> = (0..6).map(|_| b.fail(1.0)).collect();

        assert_eq!(waits, vec![S(1), S(2), S(4), S(8), S(10), S(10)]);
    }

    #[test]
    fn jitter_scales_within_the_ceiling() {
        let mut b = Backoff::new(S(4), S(60));

        let wait = b.fail(0.25);

        assert_eq!(wait, S(1));
    }

    #[test]
    fn success_resets() {
        let mut b = Backoff::new(S(1), S(10));
        b.fail(1.0);
        b.fail(1.0);
        b.reset();

        assert_eq!(b.fail(1.0), S(1));
    }
}
