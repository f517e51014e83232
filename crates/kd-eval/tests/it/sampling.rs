//! Sampled speculative decoding follows the target's distribution: on a 5-token vocabulary,
//! the frequencies of all 125 three-token continuations over 20,000 seeded rows are compared
//! with the exact probabilities the target assigns them (a chi-square test at the 0.1% level;
//! the seeds are fixed, so the outcome is deterministic).

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Device, Tensor};
use kd_eval::{Drafter, Eagle3Drafter, SpecConfig, speculative_generate};
use kd_model::{
    DraftVocab, Eagle3Config, Eagle3Draft, GenerateOptions, Llama, LlamaConfig, Sampling,
    SeededPrompt, TokenBatch, generate::to_host,
};

const V: usize = 5;
const ROWS: usize = 20_000;
const PROMPT: [u32; 2] = [1, 3];

/// Multiplies every weight, so that the random models' distributions are far from uniform.
struct Scale(f32);

impl ModuleMapper for Scale {
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let s = self.0;
        p.map(|t| t * s)
    }
}

/// Held while seeding the device's generator and drawing weights: tests run on threads of one
/// process, and a draw between another test's seed and draw would change its weights.
static DRAW: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn model(layers: usize, seed: u64, scale: f32) -> Llama {
    let _draw = DRAW.lock().unwrap_or_else(|e| e.into_inner());
    let device = Device::flex();
    device.seed(seed);
    let config = LlamaConfig::new(V, 16, 32, layers, 2, 1).unwrap();
    Llama::random(&config, &device).map(&mut Scale(scale))
}

fn softmax(z: &[f32]) -> Vec<f64> {
    let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = z.iter().map(|v| ((v - m) as f64).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|v| v / s).collect()
}

/// The exact probability of every continuation (t1, t2, t3) at temperature 1.
fn exact(target: &Llama) -> Vec<f64> {
    let mut probs = vec![0.0; V * V * V];
    for t1 in 0..V as u32 {
        for t2 in 0..V as u32 {
            let ids = [PROMPT[0], PROMPT[1], t1, t2];
            let logits = to_host(target.logits(&TokenBatch::single(&ids)).unwrap());
            let at = |pos: usize| softmax(&logits[pos * V..(pos + 1) * V]);
            let (p1, p2, p3) = (at(1), at(2), at(3));
            for (t3, p) in p3.iter().enumerate() {
                let i = (t1 as usize * V + t2 as usize) * V + t3;
                probs[i] = p1[t1 as usize] * p2[t2 as usize] * p;
            }
        }
    }
    probs
}

/// Chi-square statistic of `counts` against `probs` (cells with expected count < 5 pooled)
/// and its critical value at the 0.1% level (Wilson–Hilferty).
fn chi_square(counts: &[usize], probs: &[f64]) -> (f64, f64) {
    let n: usize = counts.iter().sum();
    let (mut stat, mut cells) = (0.0, 0usize);
    let (mut pool_o, mut pool_e) = (0.0, 0.0);
    for (o, p) in counts.iter().zip(probs) {
        let e = p * n as f64;
        if e < 5.0 {
            pool_o += *o as f64;
            pool_e += e;
        } else {
            stat += (*o as f64 - e).powi(2) / e;
            cells += 1;
        }
    }
    if pool_e > 0.0 {
        stat += (pool_o - pool_e).powi(2) / pool_e.max(1e-9);
        cells += 1;
    }
    let dof = (cells - 1) as f64;
    let z = 3.090; // one-sided 0.1%
    let h = 2.0 / (9.0 * dof);
    (stat, dof * (1.0 - h + z * h.sqrt()).powi(3))
}

fn counts(seqs: impl Iterator<Item = Vec<u32>>) -> Vec<usize> {
    let mut c = vec![0; V * V * V];
    for s in seqs {
        assert_eq!(s.len(), 3);
        c[(s[0] as usize * V + s[1] as usize) * V + s[2] as usize] += 1;
    }
    c
}

#[test]
fn sampled_output_follows_the_target_distribution() {
    let target = model(2, 1, 12.0);
    let draft = model(1, 2, 12.0);
    let probs = exact(&target);
    assert!((probs.iter().sum::<f64>() - 1.0).abs() < 1e-6);
    let prompts = seeded_rows(1000);
    let s = sampled_run_passes(
        &target,
        &draft,
        &prompts,
        &probs,
        (0.85, 0.1),
        0.0,
        "speculative",
    );
    assert_eq!(s.drafted, 2 * s.verify_steps);
    // Stopping early where the draft is unsure reads only the draft: still the target's
    // distribution. Some rounds draft fewer than k, some still draft.
    let s = sampled_run_passes(
        &target,
        &draft,
        &seeded_rows(30_000),
        &probs,
        (1.0, 0.1),
        0.6,
        "speculative, draft_p_min 0.6",
    );
    assert!(
        s.drafted > 0 && s.drafted < 2 * s.verify_steps,
        "draft_p_min 0.6: {} drafted in {} rounds",
        s.drafted,
        s.verify_steps
    );

    // Plain sampling from the target passes the same test (the check itself is sound)...
    let options = GenerateOptions {
        max_new_tokens: 3,
        sampling: Sampling::temperature(1.0),
        stop_token_ids: vec![99],
        return_logprobs: false,
    };
    let plain = target.generate(&prompts, &options).unwrap();
    let (stat, critical) = chi_square(&counts(plain.into_iter().map(|c| c.ids)), &probs);
    assert!(stat < critical, "plain: χ² {stat:.1} ≥ {critical:.1}");
    // ... and sampling from the draft fails it (the check has power).
    let from_draft = draft.generate(&prompts, &options).unwrap();
    let (stat, critical) = chi_square(&counts(from_draft.into_iter().map(|c| c.ids)), &probs);
    assert!(stat > critical, "draft: χ² {stat:.1} < {critical:.1}");
}

#[test]
fn sampled_output_with_an_eagle3_draft_follows_the_target_distribution() {
    // The same test with an EAGLE-3 draft: its draft vocabulary lacks token 4 (probability 0
    // there, so every draw of 4 comes from the target's residual or bonus).
    let target = model(2, 1, 12.0);
    let config = Eagle3Config::for_target(target.config(), V - 1).unwrap();
    let vocab = DraftVocab::from_counts(&[5, 4, 3, 2, 1], V - 1).unwrap();
    let draft = Eagle3Draft::new(
        config,
        vocab,
        target.embed_tokens.weight.val(),
        5,
        &Device::flex(),
    )
    .unwrap()
    .map(&mut Scale(3.0));
    let drafter = Eagle3Drafter::new(&draft, [0, 1, 2]);
    let probs = exact(&target);
    let prompts = seeded_rows(5000);
    sampled_run_passes(
        &target,
        &drafter,
        &prompts,
        &probs,
        (0.9, 0.05),
        0.0,
        "EAGLE-3",
    );
}

/// ROWS copies of the prompt, seeded from `first` on.
fn seeded_rows(first: u64) -> Vec<SeededPrompt<'static>> {
    (0..ROWS)
        .map(|i| SeededPrompt {
            ids: &PROMPT,
            seed: first + i as u64,
        })
        .collect()
}

/// Sampled speculative decoding of three tokens with `draft`: the pair disagrees enough
/// (α below `bounds.0`, acceptance above `bounds.1`) for rejections and residual draws to
/// happen often, each examined draft is accepted with probability α, and the continuations
/// pass the χ² test against the target's exact probabilities. Returns the counts.
fn sampled_run_passes<D: Drafter + ?Sized>(
    target: &Llama,
    draft: &D,
    prompts: &[SeededPrompt<'_>],
    probs: &[f64],
    bounds: (f64, f64),
    draft_p_min: f32,
    label: &str,
) -> kd_eval::SpecStats {
    // Token 99 is outside the vocabulary: no row stops early.
    let config = SpecConfig {
        k: 2,
        max_new_tokens: 3,
        sampling: Sampling::temperature(1.0),
        stop_token_ids: vec![99],
        draft_p_min,
    };
    let out = speculative_generate(target, draft, prompts, &config).unwrap();
    let s = &out.stats;
    // Every run starts from one target pass over the prompts, which verifies nothing:
    // counted apart from the verifications.
    assert_eq!(s.prefill_forwards, 1, "{label}");
    assert!(
        s.prefill_seconds > 0.0
            && s.prefill_seconds < s.target_seconds
            && s.verification_pass_seconds() > 0.0,
        "{label}: {s:?}"
    );
    assert!(
        s.alpha() < bounds.0 && s.acceptance_rate() > bounds.1,
        "{label}: α {} acceptance {}",
        s.alpha(),
        s.acceptance_rate()
    );
    let per_examined = s.accepted as f64 / s.examined as f64;
    assert!((s.alpha() - per_examined).abs() < 0.02, "{label}: {s:?}");
    let (stat, critical) = chi_square(&counts(out.completions.into_iter().map(|c| c.ids)), probs);
    assert!(stat < critical, "{label}: χ² {stat:.1} ≥ {critical:.1}");
    out.stats
}

#[test]
fn seeded_runs_repeat_and_do_not_depend_on_batching() {
    let target = model(2, 1, 12.0);
    let draft = model(1, 2, 12.0);
    let ids: Vec<Vec<u32>> = (0..6).map(|i| vec![1, (i % V) as u32, 2]).collect();
    let prompts: Vec<SeededPrompt<'_>> = ids
        .iter()
        .enumerate()
        .map(|(i, ids)| SeededPrompt {
            ids,
            seed: 7 + i as u64,
        })
        .collect();
    let config = SpecConfig {
        k: 3,
        max_new_tokens: 12,
        sampling: Sampling::temperature(0.8),
        stop_token_ids: vec![99],
        draft_p_min: 0.0,
    };
    let a = speculative_generate(&target, &draft, &prompts, &config).unwrap();
    let b = speculative_generate(&target, &draft, &prompts, &config).unwrap();
    assert_eq!(a.completions, b.completions);
    for (i, p) in prompts.iter().enumerate() {
        let alone =
            speculative_generate(&target, &draft, std::slice::from_ref(p), &config).unwrap();
        assert_eq!(alone.completions[0], a.completions[i], "row {i}");
    }
    // Other seeds give other samples somewhere (these models are nearly deterministic past
    // the prompt: ten tries).
    let differs = (1..=10).any(|t| {
        let other: Vec<SeededPrompt<'_>> = prompts
            .iter()
            .map(|p| SeededPrompt {
                seed: p.seed + 100 * t,
                ..*p
            })
            .collect();
        speculative_generate(&target, &draft, &other, &config)
            .unwrap()
            .completions
            != a.completions
    });
    assert!(differs, "ten other seeds gave the same samples");
}
