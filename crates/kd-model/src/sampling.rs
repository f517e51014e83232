//! Choosing the next token from a row of logits: greedy, or temperature → top-k → softmax →
//! top-p → sample (the order transformers and SGLang apply them), from a per-prompt random
//! stream; and the same warped distribution as a dense vector, which speculative sampling
//! compares between draft and target.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// How a token is drawn from logits (SGLang/vLLM names).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    /// 0 = greedy; otherwise logits are divided by it before sampling.
    pub temperature: f32,
    /// Keep the k most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1 = all).
    pub top_p: f32,
}

impl Default for Sampling {
    fn default() -> Self {
        Self::GREEDY
    }
}

impl Sampling {
    /// Greedy decoding (argmax, first index on ties as `torch.argmax`).
    pub const GREEDY: Self = Self {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
    };

    /// Plain sampling at temperature `t` (no top-k, no top-p).
    pub fn temperature(t: f32) -> Self {
        Self {
            temperature: t,
            ..Self::GREEDY
        }
    }

    /// Whether this is greedy decoding (temperature 0, or top-k 1).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Checks ranges.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(ModelError::Input(format!(
                "sampling temperature must be a number ≥ 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::Input(format!(
                "top_p must lie in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// The index of the largest logit (the first one on ties, as `torch.argmax`).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    let mut max = f32::NEG_INFINITY;
    for (i, z) in logits.iter().enumerate() {
        if *z > max {
            max = *z;
            best = i;
        }
    }
    best as u32
}

/// `log softmax(logits)[token]` at temperature 1.
pub fn log_prob(logits: &[f32], token: u32) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|z| (z - max).exp()).sum::<f32>().ln();
    logits[token as usize] - lse
}

/// The next token and its log-probability under the unmodified distribution (temperature 1).
pub fn next_token(logits: &[f32], sampling: &Sampling, rng: &mut ChaCha8Rng) -> (u32, f32) {
    let token = choose(logits, sampling, rng);
    (token, log_prob(logits, token))
}

/// The next token alone ([`next_token`] without the log-probability, which costs a pass over
/// the vocabulary).
pub fn choose(logits: &[f32], sampling: &Sampling, rng: &mut ChaCha8Rng) -> u32 {
    if sampling.temperature == 0.0 {
        argmax(logits)
    } else if keeps_all(logits.len(), sampling) {
        // The whole vocabulary: no ranking needed (a sort of 128k entries would cost more
        // than a decode step's LM head).
        sample_from(&distribution(logits, sampling), rng)
    } else {
        let (cand, probs) = candidates(logits, sampling);
        cand[draw(&probs, rng)].0 as u32
    }
}

/// The distribution [`next_token`] draws from, over the whole vocabulary (zero outside the
/// kept tokens): one-hot at the argmax for greedy decoding.
pub fn distribution(logits: &[f32], sampling: &Sampling) -> Vec<f32> {
    let mut out = vec![0.0; logits.len()];
    if sampling.temperature == 0.0 {
        if !out.is_empty() {
            out[argmax(logits) as usize] = 1.0;
        }
        return out;
    }
    if keeps_all(logits.len(), sampling) {
        // Plain softmax at the temperature: no ranking needed.
        let t = sampling.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) / t;
        let mut total = 0.0;
        for (o, z) in out.iter_mut().zip(logits) {
            *o = (z / t - max).exp();
            total += *o;
        }
        for o in &mut out {
            *o /= total;
        }
        return out;
    }
    let (cand, probs) = candidates(logits, sampling);
    for ((i, _), p) in cand.iter().zip(&probs) {
        out[*i] = *p;
    }
    out
}

/// Whether neither top-k nor top-p removes a token.
fn keeps_all(vocab: usize, sampling: &Sampling) -> bool {
    (sampling.top_k == 0 || sampling.top_k >= vocab) && sampling.top_p >= 1.0
}

/// Draws an index from a (dense, normalised) distribution with one uniform number.
pub fn sample_from(probs: &[f32], rng: &mut ChaCha8Rng) -> u32 {
    draw(probs, rng) as u32
}

/// The kept tokens (index, tempered logit), most likely first (ties by index), and their
/// probabilities after top-k and top-p (renormalised).
fn candidates(logits: &[f32], sampling: &Sampling) -> (Vec<(usize, f32)>, Vec<f32>) {
    let t = sampling.temperature;
    let mut cand: Vec<(usize, f32)> = logits.iter().enumerate().map(|(i, z)| (i, z / t)).collect();
    if sampling.top_k > 0 && sampling.top_k < cand.len() {
        cand.select_nth_unstable_by(sampling.top_k - 1, |a, b| b.1.total_cmp(&a.1));
        cand.truncate(sampling.top_k);
    }
    cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let max = cand[0].1;
    let mut probs: Vec<f32> = cand.iter().map(|(_, z)| (z - max).exp()).collect();
    let total: f32 = probs.iter().sum();
    for p in &mut probs {
        *p /= total;
    }
    if sampling.top_p < 1.0 {
        // Keep the smallest prefix whose mass reaches top_p (at least one token).
        let mut mass = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            mass += p;
            if mass >= sampling.top_p {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        cand.truncate(keep);
        let total: f32 = probs.iter().sum();
        for p in &mut probs {
            *p /= total;
        }
    }
    (cand, probs)
}

/// The index whose cumulative probability first exceeds one uniform draw; the last index
/// with positive probability when rounding leaves the total just below the draw.
fn draw(probs: &[f32], rng: &mut ChaCha8Rng) -> usize {
    let u: f32 = rng.random();
    let mut acc = 0.0;
    let mut last = 0;
    for (i, p) in probs.iter().enumerate() {
        if *p > 0.0 {
            acc += p;
            last = i;
            if u < acc {
                return i;
            }
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn greedy_top_k_top_p() {
        let logits = [0.0, 3.0, 1.0, 2.9, -1.0];
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let (t, lp) = next_token(&logits, &Sampling::GREEDY, &mut rng);
        assert_eq!(t, 1);
        assert!(lp < 0.0 && lp > -1.0);
        // top_k = 1 is greedy whatever the temperature.
        let k1 = Sampling {
            temperature: 5.0,
            top_k: 1,
            top_p: 1.0,
        };
        for _ in 0..20 {
            assert_eq!(next_token(&logits, &k1, &mut rng).0, 1);
        }
        // top_k = 2 only ever yields the two best.
        let k2 = Sampling {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
        };
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..200 {
            seen.insert(next_token(&logits, &k2, &mut rng).0);
        }
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![1, 3]);
        // A tiny top_p keeps only the best.
        let p = Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.01,
        };
        assert_eq!(next_token(&logits, &p, &mut rng).0, 1);
    }

    #[test]
    fn dense_distribution_matches_the_sampler() {
        let logits = [0.5, 2.0, -1.0, 1.5, 0.0, 1.9];
        let s = Sampling {
            temperature: 0.7,
            top_k: 4,
            top_p: 0.9,
        };
        let probs = distribution(&logits, &s);
        assert!((probs.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        // Softmax at T = 0.7 over the top 4 (indices 1, 5, 3, 0), then the top-p prefix.
        let kept: Vec<usize> = (0..6).filter(|i| probs[*i] > 0.0).collect();
        assert_eq!(kept, vec![1, 3, 5]);
        // Frequencies of the sampler agree with the dense distribution.
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let n = 40_000;
        let mut counts = [0usize; 6];
        for _ in 0..n {
            counts[next_token(&logits, &s, &mut rng).0 as usize] += 1;
        }
        for i in 0..6 {
            let f = counts[i] as f32 / n as f32;
            assert!(
                (f - probs[i]).abs() < 0.01,
                "token {i}: {f} vs {}",
                probs[i]
            );
        }
        // Without top-k / top-p it is the tempered softmax.
        let plain = distribution(&logits, &Sampling::temperature(0.7));
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let z: f32 = logits.iter().map(|v| ((v - m) / 0.7).exp()).sum();
        for (p, v) in plain.iter().zip(&logits) {
            assert!((p - ((v - m) / 0.7).exp() / z).abs() < 1e-6);
        }
        // Greedy is one-hot at the argmax.
        let g = distribution(&logits, &Sampling::GREEDY);
        assert_eq!(g[1], 1.0);
        assert_eq!(g.iter().sum::<f32>(), 1.0);
    }
}
