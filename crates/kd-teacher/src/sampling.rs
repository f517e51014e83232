//! Choosing the next token from a row of logits: greedy, or temperature → top-k → top-p →
//! sample (the order transformers and SGLang apply them), from a per-prompt random stream.

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::types::SamplingParams;

/// The next token and its log-probability under the unmodified distribution (temperature 1).
pub fn next_token(logits: &[f32], params: &SamplingParams, rng: &mut ChaCha8Rng) -> (u32, f32) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|z| (z - max).exp()).sum::<f32>().ln();
    let token = if params.temperature == 0.0 {
        // First index of the maximum (as torch.argmax).
        logits.iter().position(|z| *z == max).unwrap_or(0)
    } else {
        sample(logits, params, rng)
    };
    (token as u32, logits[token] - lse)
}

fn sample(logits: &[f32], params: &SamplingParams, rng: &mut ChaCha8Rng) -> usize {
    let t = params.temperature;
    let mut cand: Vec<(usize, f32)> = logits.iter().enumerate().map(|(i, z)| (i, z / t)).collect();
    if params.top_k > 0 && params.top_k < cand.len() {
        cand.select_nth_unstable_by(params.top_k - 1, |a, b| b.1.total_cmp(&a.1));
        cand.truncate(params.top_k);
    }
    cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let max = cand[0].1;
    let mut probs: Vec<f32> = cand.iter().map(|(_, z)| (z - max).exp()).collect();
    let total: f32 = probs.iter().sum();
    for p in &mut probs {
        *p /= total;
    }
    if params.top_p < 1.0 {
        // Keep the smallest prefix whose mass reaches top_p (at least one token).
        let mut mass = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            mass += p;
            if mass >= params.top_p {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        let total: f32 = probs.iter().sum();
        for p in &mut probs {
            *p /= total;
        }
    }
    let u: f32 = rng.random();
    let mut acc = 0.0;
    for (i, p) in probs.iter().enumerate() {
        acc += p;
        if u < acc {
            return cand[i].0;
        }
    }
    cand[probs.len() - 1].0
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn greedy_top_k_top_p() {
        let logits = [0.0, 3.0, 1.0, 2.9, -1.0];
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let greedy = SamplingParams::default();
        let (t, lp) = next_token(&logits, &greedy, &mut rng);
        assert_eq!(t, 1);
        assert!(lp < 0.0 && lp > -1.0);
        // top_k = 1 is greedy whatever the temperature.
        let k1 = SamplingParams {
            temperature: 5.0,
            top_k: 1,
            ..SamplingParams::default()
        };
        for _ in 0..20 {
            assert_eq!(next_token(&logits, &k1, &mut rng).0, 1);
        }
        // top_k = 2 only ever yields the two best.
        let k2 = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            ..SamplingParams::default()
        };
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..200 {
            seen.insert(next_token(&logits, &k2, &mut rng).0);
        }
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![1, 3]);
        // A tiny top_p keeps only the best.
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.01,
            ..SamplingParams::default()
        };
        assert_eq!(next_token(&logits, &p, &mut rng).0, 1);
    }
}
