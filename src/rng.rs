//! A small xorshift generator: for jitter, and for the random inputs of
//! tests that must reproduce. The card has no rand crate, and neither use
//! needs more than spread (never for keys or anything secret: those come
//! from the kernel).

/// Marsaglia's xorshift64.
pub struct XorShift(u64);

impl XorShift {
    /// Seeded from the clock and the process id: different each run.
    pub fn seeded() -> XorShift {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        XorShift((nanos ^ u64::from(std::process::id()).rotate_left(32)) | 1)
    }

    /// A generator from a fixed seed: the same draws every run.
    pub fn from_seed(seed: u64) -> XorShift {
        XorShift(seed | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// A draw in `[0, 1)`.
    pub fn next_unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A draw in `[0, n)` (0 for an `n` of 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_units() {
        let mut r = XorShift::seeded();

        let draws: Vec<f64> = (0..1000).map(|_| r.next_unit()).collect();

        assert!(draws.iter().all(|d| (0.0..1.0).contains(d)));
        assert!(draws.iter().any(|d| *d < 0.5) && draws.iter().any(|d| *d >= 0.5));
    }

    #[test]
    fn one_seed_draws_the_same_each_time() {
        let (mut a, mut b) = (XorShift::from_seed(7), XorShift::from_seed(7));

        let (x, y): (Vec<u64>, Vec<u64>) = (0..10).map(|_| (a.next_u64(), b.next_u64())).unzip();

        assert_eq!(x, y);
    }
}
