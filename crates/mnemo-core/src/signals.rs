//! Ranking signals: a bounded factor on a recalled row's fused score from its importance, its
//! confidence and how long ago it was last used.
//!
//! factor = (1 + w_i·(importance − ½)) · (1 + w_c·(confidence − ½)) · (1 − w_d·(1 − decay)),
//! decay = ½^(age_days / half_life_days), age from the last access, else the event time.
//!
//! A missing importance or confidence counts as ½ (factor 1), so untyped rows are not pushed
//! down. With weights in [0, 1] the factor stays within [`SignalWeights::bounds`]: no row's
//! score moves by more than that, whatever its signals. A weight of 0 turns its signal off.

/// How much each signal may move a score, and the decay's half-life.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SignalWeights {
    pub importance: f64,
    pub confidence: f64,
    pub decay: f64,
    pub half_life_days: f64,
}

impl SignalWeights {
    /// Every signal off: the fused score is the score.
    pub const OFF: Self = Self { importance: 0.0, confidence: 0.0, decay: 0.0, half_life_days: 30.0 };

    /// The smallest and largest factor these weights can give.
    pub fn bounds(&self) -> (f64, f64) {
        let low = (1.0 - self.importance / 2.0) * (1.0 - self.confidence / 2.0) * (1.0 - self.decay);
        let high = (1.0 + self.importance / 2.0) * (1.0 + self.confidence / 2.0);
        (low, high)
    }
}

/// One row's signals.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Signals {
    pub importance: Option<f32>,
    pub confidence: Option<f32>,
    /// Days since the row was last recalled, or since its event when it never was.
    pub age_days: f64,
}

/// ½^(age / half-life), 1 for a row used now; out-of-range ages are clamped.
pub fn decay(age_days: f64, half_life_days: f64) -> f64 {
    if half_life_days <= 0.0 {
        return 1.0;
    }
    0.5f64.powf(age_days.max(0.0) / half_life_days)
}

/// The factor the fused score is multiplied by (see the module's formula).
pub fn signal_factor(weights: &SignalWeights, signals: &Signals) -> f64 {
    let centred = |x: Option<f32>| f64::from(x.unwrap_or(0.5)).clamp(0.0, 1.0) - 0.5;
    let importance = 1.0 + weights.importance * centred(signals.importance);
    let confidence = 1.0 + weights.confidence * centred(signals.confidence);
    let freshness = 1.0 - weights.decay * (1.0 - decay(signals.age_days, weights.half_life_days));
    importance * confidence * freshness
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator, so the property test needs no dependency.
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f64 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (self.0 >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    #[test]
    fn every_factor_stays_within_its_bounds_and_so_does_every_overtaking() {
        let mut rng = Lcg(7);
        for _ in 0..20_000 {
            let weights = SignalWeights {
                importance: rng.next(),
                confidence: rng.next(),
                decay: rng.next(),
                half_life_days: 1.0 + rng.next() * 100.0,
            };
            let mut signals = || {
                let mut unit = || (rng.next() > 0.2).then(|| rng.next() as f32);
                Signals { importance: unit(), confidence: unit(), age_days: rng.next() * 1000.0 }
            };
            let (one, other) = (signals(), signals());
            let (low, high) = weights.bounds();
            let (f1, f2) = (signal_factor(&weights, &one), signal_factor(&weights, &other));
            for f in [f1, f2] {
                assert!(f >= low - 1e-12 && f <= high + 1e-12, "{f} outside [{low}, {high}] for {weights:?}");
            }
            // A row with the lower fused score passes the other only if the two scores were
            // within the bounds' ratio of each other.
            let (lower, higher) = (rng.next() * 0.02, rng.next() * 0.02);
            if lower < higher && lower * f1 > higher * f2 {
                assert!(higher / lower <= high / low + 1e-9, "{lower} passed {higher}");
            }
        }
    }

    #[test]
    fn each_signal_moves_the_score_its_way_and_zero_turns_it_off() {
        let w = SignalWeights { importance: 0.3, confidence: 0.3, decay: 0.3, half_life_days: 30.0 };
        let base = Signals { importance: Some(0.5), confidence: Some(0.5), age_days: 0.0 };
        let f = |s: Signals| signal_factor(&w, &s);
        assert!(f(Signals { importance: Some(0.9), ..base }) > f(base));
        assert!(f(Signals { importance: Some(0.1), ..base }) < f(base));
        assert!(f(Signals { confidence: Some(0.9), ..base }) > f(base));
        assert!(f(Signals { age_days: 60.0, ..base }) < f(base));
        assert_eq!(f(Signals { importance: None, confidence: None, ..base }), 1.0);
        let off = SignalWeights::OFF;
        assert_eq!(
            signal_factor(&off, &Signals { importance: Some(1.0), confidence: Some(0.0), age_days: 900.0 }),
            1.0
        );
        assert!((decay(30.0, 30.0) - 0.5).abs() < 1e-12);
    }
}
