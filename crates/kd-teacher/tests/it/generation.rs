//! Generation equals transformers' greedy `generate`, does not depend on batching, samples
//! reproducibly; scores are log-probabilities.

use kd_teacher::{FinishReason, Prompt, SamplingParams, Teacher};
use safetensors::SafeTensors;

use crate::{fixtures, prompts, teacher};

fn golden_i64(key: &str) -> (Vec<usize>, Vec<i64>) {
    let bytes = std::fs::read(fixtures().join("golden/tiny-llama3.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let v = st.tensor(key).unwrap();
    (
        v.shape().to_vec(),
        v.data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
    )
}

#[test]
fn greedy_generation_equals_transformers() {
    let (shape, ids) = golden_i64("generate.input_ids");
    let (_, mask) = golden_i64("generate.attention_mask");
    let (gshape, expected) = golden_i64("generate.new_tokens");
    let (b, s) = (shape[0], shape[1]);
    let prompts: Vec<Prompt> = (0..b)
        .map(|r| Prompt {
            index: r as u64,
            ids: (0..s)
                .filter(|j| mask[r * s + j] != 0)
                .map(|j| ids[r * s + j] as u32)
                .collect(),
        })
        .collect();
    // transformers ran without eos (it generates all 8 tokens): use a stop id that never occurs.
    let params = SamplingParams {
        max_new_tokens: gshape[1],
        stop_token_ids: vec![9999],
        ..SamplingParams::default()
    };
    for batch in [1, 2, 3] {
        let out = teacher(batch).generate(&prompts, &params).unwrap();
        for (r, g) in out.iter().enumerate() {
            let want: Vec<u32> = expected[r * gshape[1]..(r + 1) * gshape[1]]
                .iter()
                .map(|t| *t as u32)
                .collect();
            assert_eq!(g.ids, want, "batch {batch} row {r}");
            assert_eq!(g.finish_reason, FinishReason::Length);
        }
    }
}

#[test]
fn rows_finish_independently_and_batching_does_not_matter() {
    let prompts = prompts(11);
    // Stop on the token the rows produce most often, so that some rows stop early.
    let free = SamplingParams {
        max_new_tokens: 12,
        stop_token_ids: vec![255],
        ..SamplingParams::default()
    };
    let mut counts = std::collections::BTreeMap::<u32, usize>::new();
    for g in teacher(4).generate(&prompts, &free).unwrap() {
        for t in &g.ids[..g.ids.len() - 1] {
            *counts.entry(*t).or_default() += 1;
        }
    }
    let stop = *counts.iter().max_by_key(|(_, c)| **c).unwrap().0;
    let params = SamplingParams {
        max_new_tokens: 12,
        stop_token_ids: vec![stop],
        return_logprobs: true,
        ..SamplingParams::default()
    };
    let alone: Vec<_> = prompts
        .iter()
        .map(|p| {
            teacher(1)
                .generate(std::slice::from_ref(p), &params)
                .unwrap()
                .remove(0)
        })
        .collect();
    let batched = teacher(4).generate(&prompts, &params).unwrap();
    let mut stopped = 0;
    for (a, b) in alone.iter().zip(&batched) {
        assert_eq!(a.ids, b.ids);
        assert_eq!(a.finish_reason, b.finish_reason);
        if b.finish_reason == FinishReason::Stop {
            assert_eq!(*b.ids.last().unwrap(), stop);
            assert!(b.ids.len() < 12);
            stopped += 1;
        }
        let (la, lb) = (a.logprobs.as_ref().unwrap(), b.logprobs.as_ref().unwrap());
        assert_eq!(la.len(), a.ids.len());
        assert!(
            la.iter()
                .zip(lb)
                .all(|(x, y)| (x - y).abs() < 1e-4 && *x <= 0.0)
        );
    }
    assert!(stopped > 0, "no row stopped early; pick another stop token");
}

#[test]
fn sampling_is_seeded_per_prompt() {
    let prompts = prompts(6);
    let params = SamplingParams {
        max_new_tokens: 6,
        temperature: 1.0,
        top_k: 50,
        top_p: 0.9,
        seed: 3,
        stop_token_ids: vec![9999],
        ..SamplingParams::default()
    };
    let a = teacher(6).generate(&prompts, &params).unwrap();
    let b = teacher(2).generate(&prompts, &params).unwrap();
    assert_eq!(a, b, "sampling depends on batching");
    let c = teacher(6)
        .generate(
            &prompts,
            &SamplingParams {
                seed: 4,
                ..params.clone()
            },
        )
        .unwrap();
    assert_ne!(a, c);
    let greedy = teacher(6)
        .generate(
            &prompts,
            &SamplingParams {
                temperature: 0.0,
                ..params
            },
        )
        .unwrap();
    assert_ne!(a, greedy);
}

#[test]
fn scores_are_top_k_log_probabilities() {
    let t = teacher(2);
    let seqs = vec![vec![1, 17, 45, 200], vec![1, 88]];
    let scores = t.score(&seqs, 5).unwrap();
    assert_eq!(scores[0].len, 4);
    assert_eq!(scores[1].indices.len(), 2 * 5);
    for s in &scores {
        for p in 0..s.len {
            let lp = &s.logprobs[p * 5..(p + 1) * 5];
            assert!(lp.windows(2).all(|w| w[0] >= w[1]), "not sorted: {lp:?}");
            assert!(lp[0] <= 0.0);
        }
    }
    // The greedy continuation is the top-1 of the last position.
    let g = t
        .generate(
            &[kd_teacher::Prompt {
                index: 0,
                ids: seqs[0].clone(),
            }],
            &SamplingParams {
                max_new_tokens: 1,
                stop_token_ids: vec![9999],
                ..SamplingParams::default()
            },
        )
        .unwrap();
    assert_eq!(g[0].ids[0], scores[0].indices[3 * 5]);
    assert!(t.score(&seqs, 0).is_err());
}

#[test]
fn bad_inputs_are_clear_errors() {
    let t = teacher(2);
    let e = t
        .generate(
            &[Prompt {
                index: 7,
                ids: vec![1, 300],
            }],
            &SamplingParams::default(),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("prompt 7") && e.contains("300"), "{e}");
    let e = t
        .generate(
            &[Prompt {
                index: 1,
                ids: vec![],
            }],
            &SamplingParams::default(),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("empty"), "{e}");
    let e = t
        .generate(
            &prompts(1),
            &SamplingParams {
                top_p: 0.0,
                ..SamplingParams::default()
            },
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("top_p"), "{e}");
}
