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

#[test]
fn scores_match_a_plain_forward_pass_with_hidden_states() {
    use kd_model::{ForwardOptions, HiddenStates, TokenBatch};
    use kd_teacher::ScoreOptions;
    let t = teacher(3);
    let seqs = vec![vec![1, 17, 45, 200, 3], vec![1, 88], vec![5, 6, 7]];
    let layers = vec![0, 1, t.model().config().num_hidden_layers];
    let opts = ScoreOptions {
        top_k: 4,
        hidden_layers: layers.clone(),
    };
    let scores = t.score_with(&seqs, &opts).unwrap();
    // The LM head runs on blocks of rows: blocks of 4 rows (ending inside sequences and
    // between them) give the scores of one block for the whole batch.
    let blocked = teacher(3)
        .with_score_block_rows(4)
        .score_with(&seqs, &opts)
        .unwrap();
    assert_eq!(blocked, scores, "scores depend on the LM head's blocks");
    let dim = t.model().config().hidden_size;
    for (seq, s) in seqs.iter().zip(&scores) {
        // Each sequence alone, unpadded; log-softmax on the host in f64.
        let out = t
            .model()
            .forward(
                &TokenBatch::single(seq),
                &ForwardOptions::with_hidden_states(HiddenStates::All),
            )
            .unwrap();
        let logits: Vec<f32> = out
            .logits
            .clone()
            .unwrap()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        let v = logits.len() / seq.len();
        for p in 0..seq.len() {
            let row = &logits[p * v..(p + 1) * v];
            let max = row.iter().fold(f64::NEG_INFINITY, |m, z| m.max(*z as f64));
            let lse = max
                + row
                    .iter()
                    .map(|z| (*z as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            for j in 0..4 {
                let idx = s.indices[p * 4 + j] as usize;
                let want = row[idx] as f64 - lse;
                assert!((s.logprobs[p * 4 + j] as f64 - want).abs() < 1e-5);
            }
            let best = (0..v).max_by(|a, b| row[*a].total_cmp(&row[*b])).unwrap();
            assert_eq!(s.indices[p * 4] as usize, best);
        }
        assert_eq!(s.hidden_states.len(), layers.len());
        check_hidden(&s.hidden_states, &layers, &out, seq.len() * dim);
    }
    let err = t
        .score_with(
            &seqs,
            &ScoreOptions {
                top_k: 4,
                hidden_layers: vec![99],
            },
        )
        .unwrap_err();
    assert!(err.to_string().contains("hidden layer 99"), "{err}");
}

/// Five tokens sampled at temperature 0.7 from the top 30, seed 3.
fn sampled_five() -> SamplingParams {
    SamplingParams {
        max_new_tokens: 5,
        temperature: 0.7,
        top_k: 30,
        seed: 3,
        ..SamplingParams::default()
    }
}

#[test]
fn replicas_share_the_prompts_and_agree_with_one_teacher() {
    use kd_teacher::ReplicatedTeacher;
    let (ps, params) = (prompts(7), sampled_five());
    let one = teacher(2).generate(&ps, &params).unwrap();
    let many = ReplicatedTeacher::new(vec![teacher(2), teacher(2), teacher(2)]).unwrap();
    let got = many.generate(&ps, &params).unwrap();
    assert_eq!(
        got.iter().map(|g| &g.ids).collect::<Vec<_>>(),
        one.iter().map(|g| &g.ids).collect::<Vec<_>>()
    );
    let seqs: Vec<Vec<u32>> = ps.iter().map(|p| p.ids.clone()).collect();
    let a = teacher(2).score(&seqs, 3).unwrap();
    let b = many.score(&seqs, 3).unwrap();
    assert_eq!(
        a.iter().map(|s| &s.indices).collect::<Vec<_>>(),
        b.iter().map(|s| &s.indices).collect::<Vec<_>>()
    );
    assert!(ReplicatedTeacher::<kd_teacher::LocalTeacher>::new(vec![]).is_err());
}

/// Replicas capturing, each over its share of the prompts, give the completions of plain
/// generation and, row by row, the numbers one teacher captures over all the prompts (its
/// batches pair other rows, so to rounding).
#[test]
fn replicas_capture_what_one_teacher_captures() {
    use kd_teacher::ReplicatedTeacher;
    let (ps, params) = (prompts(7), sampled_five());
    let layers = [1, 3];
    let plain = teacher(2).generate(&ps, &params).unwrap();
    let one = teacher(2).generate_captured(&ps, &params, &layers).unwrap();
    let many = ReplicatedTeacher::new(vec![teacher(2), teacher(2), teacher(2)]).unwrap();
    let got = many.generate_captured(&ps, &params, &layers).unwrap();
    assert_eq!(got.len(), ps.len());
    let close = |a: &[f32], b: &[f32], what: &str| {
        assert_eq!(a.len(), b.len(), "{what}");
        let worst = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
            .fold(0f32, f32::max);
        assert!(worst <= 1e-5, "{what}: {worst}");
    };
    for (r, ((g, row), (g1, row1))) in got.iter().zip(&one).enumerate() {
        assert_eq!(g.ids, plain[r].ids, "row {r}");
        assert_eq!(g1.ids, plain[r].ids, "row {r}");
        let n = ps[r].ids.len() + g.ids.len();
        assert_eq!(
            (row.len, row.logits_from),
            (n, ps[r].ids.len() - 1),
            "row {r}"
        );
        assert_eq!((row1.len, row1.logits_from), (row.len, row.logits_from));
        assert_eq!(row.hidden.len(), n * layers.len() * 48, "row {r}");
        assert_eq!(row.argmax, row1.argmax, "row {r}");
        close(&row.hidden, &row1.hidden, &format!("row {r} hidden"));
        close(&row.log_z, &row1.log_z, &format!("row {r} log_z"));
    }
}

#[test]
fn generation_returns_hidden_states_over_prompt_and_completion() {
    use kd_model::{ForwardOptions, HiddenStates, TokenBatch};
    let t = teacher(2);
    let ps = prompts(3);
    let last = t.model().config().num_hidden_layers;
    let params = SamplingParams {
        max_new_tokens: 4,
        stop_token_ids: vec![9999],
        hidden_layers: vec![last, 1],
        ..SamplingParams::default()
    };
    let gens = t.generate(&ps, &params).unwrap();
    let dim = t.model().config().hidden_size;
    for (p, g) in ps.iter().zip(&gens) {
        let seq: Vec<u32> = p.ids.iter().chain(&g.ids).copied().collect();
        let out = t
            .model()
            .forward(
                &TokenBatch::single(&seq),
                &ForwardOptions::with_hidden_states(HiddenStates::All),
            )
            .unwrap();
        assert_eq!(g.hidden_states.len(), 2);
        check_hidden(&g.hidden_states, &[last, 1], &out, seq.len() * dim);
    }
    // Without asking: none.
    let plain = t
        .generate(
            &ps,
            &SamplingParams {
                hidden_layers: Vec::new(),
                ..params
            },
        )
        .unwrap();
    assert!(plain.iter().all(|g| g.hidden_states.is_empty()));
}

/// The hidden states returned equal the plain forward pass's (≤ 1e-5), layer by layer.
fn check_hidden(
    got: &[kd_teacher::LayerHidden],
    layers: &[usize],
    out: &kd_model::ModelOutput,
    numel: usize,
) {
    assert_eq!(got.len(), layers.len());
    for (h, l) in got.iter().zip(layers) {
        assert_eq!((h.layer, h.values.len()), (*l, numel));
        let want: Vec<f32> = out
            .hidden_state(*l)
            .unwrap()
            .clone()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        let diff = h
            .values
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(diff < 1e-5, "layer {l}: {diff}");
    }
}
