//! The acceptance rule of speculative decoding for one row: greedy accepts the target's
//! argmax; sampling accepts d with probability min(1, p(d)/q(d)) and on rejection draws from
//! norm(max(0, p − q)) (Leviathan et al. 2023, Chen et al. 2023).

use kd_model::Sampling;
use kd_model::sampling::{argmax, distribution, sample_from};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::stats::SpecStats;

/// The next token from logits `z`: the argmax, or a draw from the warped distribution.
pub(crate) fn choose(z: &[f32], sampling: &Sampling, rng: &mut ChaCha8Rng) -> u32 {
    if sampling.is_greedy() {
        argmax(z)
    } else {
        sample_from(&distribution(z, sampling), rng)
    }
}

/// Verifies one row's `drafts` against the target's logits `p` (position i at
/// `p[i·vocab..]`, one more position than drafts) and the draft's logits `q_at(i)`: how many
/// are accepted, and the target's token after them (the correction at the first rejection,
/// or the bonus token after all). Greedy accepts the target's argmax; sampling accepts d with
/// probability min(1, p(d)/q(d)) and on rejection draws from norm(max(0, p − q)).
pub(crate) fn verify_row<'q>(
    drafts: &[u32],
    p: &[f32],
    q_at: impl Fn(usize) -> &'q [f32],
    q_probs: &[Vec<f32>],
    sampling: &Sampling,
    rng: &mut ChaCha8Rng,
    stats: &mut SpecStats,
) -> (usize, u32) {
    let vocab = p.len() / (drafts.len() + 1);
    let p_at = |i: usize| &p[i * vocab..(i + 1) * vocab];
    let greedy = sampling.is_greedy();
    let mut accepted = 0;
    let mut next = None;
    for (i, &d) in drafts.iter().enumerate() {
        let (zp, zq) = (p_at(i), q_at(i));
        stats.reached[i] += 1;
        stats.examined += 1;
        let target = argmax(zp);
        if target == argmax(zq) {
            stats.top1_agree += 1;
        }
        let at = zq[target as usize];
        stats.count_rank(zq.iter().filter(|&&v| v > at).count());
        let ok = if greedy {
            stats.alpha_sum += overlap(&softmax(zp), &softmax(zq));
            target == d
        } else {
            let (p, q) = (distribution(zp, sampling), &q_probs[i]);
            stats.alpha_sum += overlap(&p, q);
            let (pd, qd) = (p[d as usize], q[d as usize]);
            let u: f32 = rng.random();
            // q(d) > 0: d was drawn from q.
            let ok = u < (pd / qd).min(1.0);
            if !ok {
                next = Some(residual_sample(&p, q, rng));
            }
            ok
        };
        if ok {
            accepted += 1;
            stats.accepted_at[i] += 1;
        } else {
            if greedy {
                next = Some(target);
            }
            break;
        }
    }
    let next = next.unwrap_or_else(|| choose(p_at(drafts.len()), sampling, rng));
    stats.verify_steps += 1;
    stats.drafted += drafts.len();
    stats.accepted += accepted;
    (accepted, next)
}

/// The largest probability of softmax(z) at temperature 1.
pub(crate) fn top_probability(z: &[f32]) -> f32 {
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    1.0 / z.iter().map(|v| (v - max).exp()).sum::<f32>()
}

/// softmax(z) at temperature 1.
fn softmax(z: &[f32]) -> Vec<f32> {
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut e: Vec<f32> = z.iter().map(|v| (v - max).exp()).collect();
    let s: f32 = e.iter().sum();
    for v in &mut e {
        *v /= s;
    }
    e
}

/// Σ_x min(p(x), q(x)).
fn overlap(p: &[f32], q: &[f32]) -> f64 {
    p.iter().zip(q).map(|(a, b)| a.min(*b) as f64).sum()
}

/// A draw from norm(max(0, p − q)); from p itself when the residual has no mass (p ≤ q
/// everywhere up to rounding, which makes a rejection all but impossible).
fn residual_sample(p: &[f32], q: &[f32], rng: &mut ChaCha8Rng) -> u32 {
    let mut r: Vec<f32> = p.iter().zip(q).map(|(a, b)| (a - b).max(0.0)).collect();
    let total: f32 = r.iter().sum();
    if total <= 0.0 || !total.is_finite() {
        return sample_from(p, rng);
    }
    for v in &mut r {
        *v /= total;
    }
    sample_from(&r, rng)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// Greedy verification of two drafts: the first is the target's argmax (accepted), the
    /// second is not (rejected). The target's argmax at the first position is the draft's own
    /// argmax (rank 0: in every top m); at the second, the draft ranks it third (two logits
    /// above it: in the tops of 3 and wider only).
    #[test]
    fn the_targets_token_is_counted_in_the_drafts_top_m() {
        let p = [
            0.0, 5.0, 1.0, 2.0, /* position 1 */ 0.0, 5.0, 1.0, 2.0, /* bonus */ 0.0,
            0.0, 0.0, 1.0,
        ];
        let q = [[0.0f32, 4.0, 1.0, 2.0], [3.0, 1.0, 2.0, 0.0]];
        let mut stats = SpecStats::new(2);
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let (accepted, next) = verify_row(
            &[1, 0],
            &p,
            |i| &q[i][..],
            &[],
            &Sampling::temperature(0.0),
            &mut rng,
            &mut stats,
        );
        assert_eq!((accepted, next), (1, 1));
        assert_eq!(stats.examined, 2);
        assert_eq!(stats.in_top, [1, 1, 2, 2, 2, 2, 2, 2]);
        assert_eq!(stats.top_m_agreement(1), 0.5);
        assert_eq!(stats.top_m_agreement(3), 1.0);
        assert_eq!(stats.top_m_agreement(0), 0.0);
        assert_eq!(stats.top_m_agreement(9), 0.0);
        // Counts add up across runs, older counts without the field included.
        let mut merged = SpecStats::default();
        merged.merge(&stats);
        merged.merge(&SpecStats::default());
        merged.merge(&stats);
        assert_eq!(merged.in_top, [2, 2, 4, 4, 4, 4, 4, 4]);
    }
}
