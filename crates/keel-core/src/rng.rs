//! Deterministic randomness. The core never draws randomness itself: callers pass an `Rng`
//! (seeded in tests, from entropy in production), so every decision can be replayed exactly.

/// SplitMix64: tiny, fast, statistically sound for simulation and tie-breaking (not crypto).
#[derive(Debug, Clone)]
pub struct Rng(u64);

/// SplitMix64's increment (the golden ratio in 64 bits).
pub const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// The generator's state: a generator built from it continues the same sequence.
    pub fn state(&self) -> u64 {
        self.0
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN_GAMMA);
        mix(self.0)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal by Box–Muller.
    pub fn normal(&mut self) -> f64 {
        let u1 = self.next_f64().max(f64::MIN_POSITIVE);
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Lognormal with the given median and shape `sigma` (sigma 0 returns the median).
    pub fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        if sigma <= 0.0 {
            return median;
        }
        median * (sigma * self.normal()).exp()
    }
}

/// The SplitMix64 finaliser: a strong 64-bit mixing function, also used as a stable hash step.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A stable 64-bit hash of bytes (FNV-1a folded through `mix`): the same on every platform and
/// release, unlike `std`'s `DefaultHasher`, so it can key caches and simulated generations.
pub fn hash_bytes(seed: u64, bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    mix(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_sequences_repeat() {
        let a: Vec<u64> = {
            let mut r = Rng::new(7);
            (0..4).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = Rng::new(7);
            (0..4).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        assert_eq!(hash_bytes(1, b"abc"), hash_bytes(1, b"abc"));
        assert_ne!(hash_bytes(1, b"abc"), hash_bytes(2, b"abc"));
    }

    #[test]
    fn lognormal_median_is_roughly_right() {
        let mut r = Rng::new(42);
        let mut v: Vec<f64> = (0..2001).map(|_| r.lognormal(100.0, 0.5)).collect();
        v.sort_by(f64::total_cmp);
        let median = v[1000];
        assert!((80.0..125.0).contains(&median), "{median}");
    }
}
