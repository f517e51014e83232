//! Incremental decoding with the KV cache: equals the full forward, equals transformers'
//! greedy `generate`, and each row of a left-padded batch decodes as it would alone.

use kd_model::{ForwardOptions, Llama, PaddingSide, TokenBatch};

use crate::util::*;

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decoding of `steps` tokens; returns the new tokens and each step's logits.
fn greedy(model: &Llama, rows: &[Vec<u32>], steps: usize) -> (Vec<Vec<u32>>, Vec<Vec<Vec<f32>>>) {
    let vocab = model.config().vocab_size;
    let b = rows.len();
    let last = ForwardOptions::last_positions(1);
    let mut cache = model.new_cache();
    let mut batch = TokenBatch::from_rows(rows, 0, PaddingSide::Left);
    let mut tokens = vec![Vec::new(); b];
    let mut step_logits = vec![Vec::new(); b];
    for _ in 0..steps {
        let out = model.forward_cached(&batch, &mut cache, &last).unwrap();
        let logits = to_vec(out.logits.unwrap());
        assert_eq!(logits.len(), b * vocab);
        let next: Vec<u32> = (0..b)
            .map(|r| argmax(&logits[r * vocab..(r + 1) * vocab]))
            .collect();
        for r in 0..b {
            tokens[r].push(next[r]);
            step_logits[r].push(logits[r * vocab..(r + 1) * vocab].to_vec());
        }
        batch = TokenBatch::new(b, 1, next, vec![true; b]).unwrap();
    }
    (tokens, step_logits)
}

fn prompts(g: &std::collections::HashMap<String, Golden>) -> Vec<Vec<u32>> {
    let ids = &g["generate.input_ids"];
    let mask = &g["generate.attention_mask"].i64;
    let s = ids.shape[1];
    (0..ids.shape[0])
        .map(|r| {
            (0..s)
                .filter(|j| mask[r * s + j] != 0)
                .map(|j| ids.i64[r * s + j] as u32)
                .collect()
        })
        .collect()
}

#[test]
fn batched_greedy_equals_transformers_generate() {
    for name in [
        "tiny-llama3",
        "tiny-tied",
        "tiny-sharded",
        "tiny-qwen2",
        "tiny-qwen3",
    ] {
        let g = golden(name);
        let model = load(name);
        let rows = prompts(&g);
        let expected = &g["generate.new_tokens"];
        let steps = expected.shape[1];
        let (tokens, _) = greedy(&model, &rows, steps);
        for (r, row) in tokens.iter().enumerate() {
            let theirs: Vec<u32> = expected.i64[r * steps..(r + 1) * steps]
                .iter()
                .map(|t| *t as u32)
                .collect();
            assert_eq!(row, &theirs, "{name} row {r}");
        }
    }
}

#[test]
fn cached_decoding_equals_full_forward_and_rows_alone() {
    let name = "tiny-llama3";
    let g = golden(name);
    let model = load(name);
    let vocab = model.config().vocab_size;
    let rows = prompts(&g);
    let steps = 6;
    let (tokens, step_logits) = greedy(&model, &rows, steps);
    for (r, prompt) in rows.iter().enumerate() {
        // Full forward over prompt + generated tokens: position p predicts token p + 1.
        let mut full: Vec<u32> = prompt.clone();
        full.extend(&tokens[r][..steps - 1]);
        let logits = to_vec(model.logits(&TokenBatch::single(&full)).unwrap());
        for (step, ours) in step_logits[r].iter().enumerate() {
            let p = prompt.len() - 1 + step;
            let theirs = &logits[p * vocab..(p + 1) * vocab];
            let d = ours
                .iter()
                .zip(theirs)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                d <= 1e-4,
                "row {r} step {step}: cached vs full max |Δ| = {d}"
            );
        }
        // The row generated alone.
        let (alone, alone_logits) = greedy(&model, std::slice::from_ref(prompt), steps);
        assert_eq!(alone[0], tokens[r], "row {r}: batched and alone differ");
        for step in 0..steps {
            let d = alone_logits[0][step]
                .iter()
                .zip(&step_logits[r][step])
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                d <= 1e-5,
                "row {r} step {step}: batched vs alone max |Δ| = {d}"
            );
        }
    }
}

#[test]
fn cache_row_retention_and_errors() {
    let model = load("tiny-tied");
    let rows = vec![vec![1, 5, 9], vec![1, 7]];
    let mut cache = model.new_cache();
    let batch = TokenBatch::from_rows(&rows, 0, PaddingSide::Left);
    model
        .forward_cached(&batch, &mut cache, &ForwardOptions::default())
        .unwrap();
    assert_eq!(cache.len(), 3);
    assert_eq!(cache.real_lengths(), &[3, 2]);
    // A batch of the wrong size is refused.
    let one = TokenBatch::single(&[4]);
    assert!(
        model
            .forward_cached(&one, &mut cache, &ForwardOptions::default())
            .is_err()
    );
    // Keeping only row 1 continues it exactly as alone.
    cache.retain_rows(&[1]).unwrap();
    let step = model
        .forward_cached(&one, &mut cache, &ForwardOptions::default())
        .unwrap();
    let alone = model.logits(&TokenBatch::single(&[1, 7, 4])).unwrap();
    let a = to_vec(step.logits.unwrap());
    let b = to_vec(alone);
    let d = a
        .iter()
        .zip(&b[2 * 256..])
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(d <= 1e-5, "{d}");
    assert!(cache.retain_rows(&[3]).is_err());
    // Token ids beyond the vocabulary are refused.
    let e = model
        .logits(&TokenBatch::single(&[1, 256]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("256"), "{e}");
}

#[test]
fn cache_rolls_back_rows_to_shorter_lengths() {
    let model = load("tiny-llama3");
    let vocab = model.config().vocab_size;
    let rows = vec![vec![1, 5, 9, 4, 7], vec![1, 8, 3]];
    let mut cache = model.new_cache();
    let batch = TokenBatch::from_rows(&rows, 0, PaddingSide::Left);
    model
        .forward_cached(&batch, &mut cache, &ForwardOptions::default())
        .unwrap();
    // Keep [1, 5, 9] and [1, 8]: the next token continues those prefixes exactly.
    cache.truncate(&[3, 2]).unwrap();
    assert_eq!(cache.real_lengths(), &[3, 2]);
    assert_eq!(
        cache.len(),
        4,
        "row 0's third real token sits at slot 2 + padding 0"
    );
    let next = TokenBatch::new(2, 1, vec![11, 12], vec![true; 2]).unwrap();
    let out = to_vec(
        model
            .forward_cached(&next, &mut cache, &ForwardOptions::default())
            .unwrap()
            .logits
            .unwrap(),
    );
    for (r, prefix) in [vec![1, 5, 9, 11], vec![1, 8, 12]].iter().enumerate() {
        let alone = to_vec(model.logits(&TokenBatch::single(prefix)).unwrap());
        let last = &alone[(prefix.len() - 1) * vocab..];
        let d = out[r * vocab..(r + 1) * vocab]
            .iter()
            .zip(last)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(d <= 1e-5, "row {r}: rolled back vs alone max |Δ| = {d}");
    }
    // Rolling forward or a wrong row count is refused.
    assert!(cache.truncate(&[9, 1]).is_err());
    assert!(cache.truncate(&[1]).is_err());
    cache.truncate(&[0, 0]).unwrap();
    assert_eq!(cache.len(), 0);
}

#[test]
fn generate_is_greedy_decoding_with_stops() {
    use kd_model::{FinishReason, GenerateOptions, SeededPrompt};
    let name = "tiny-llama3";
    let model = load(name);
    let rows = prompts(&golden(name));
    let steps = 6;
    let (tokens, _) = greedy(&model, &rows, steps);
    let seeded: Vec<SeededPrompt<'_>> = rows
        .iter()
        .map(|ids| SeededPrompt { ids, seed: 0 })
        .collect();
    let free = GenerateOptions {
        stop_token_ids: vec![10_000],
        ..GenerateOptions::greedy(steps)
    };
    let out = model.generate(&seeded, &free).unwrap();
    for (r, c) in out.iter().enumerate() {
        assert_eq!(c.ids, tokens[r], "row {r}");
        assert_eq!(c.finish_reason, FinishReason::Length);
    }
    // Stopping at row 0's third token ends that row there (the stop token kept) and cuts
    // any other row at its first occurrence.
    let stop = tokens[0][2];
    let stopped = model
        .generate(
            &seeded,
            &GenerateOptions {
                stop_token_ids: vec![stop],
                ..GenerateOptions::greedy(steps)
            },
        )
        .unwrap();
    for (r, c) in stopped.iter().enumerate() {
        match tokens[r].iter().position(|t| *t == stop) {
            Some(i) => {
                assert_eq!(c.ids, tokens[r][..=i], "row {r}");
                assert_eq!(c.finish_reason, FinishReason::Stop);
            }
            None => assert_eq!(c.ids, tokens[r]),
        }
    }
    // Timed, the same completions; the steps after the prefill are the longest row's tokens
    // after its first, and the tokens they chose every row's after its first (a stopped row
    // leaves the batch).
    for (options, expected) in [
        (&free, &out),
        (
            &GenerateOptions {
                stop_token_ids: vec![stop],
                ..GenerateOptions::greedy(steps)
            },
            &stopped,
        ),
    ] {
        let (timed, timings) = model.generate_timed(&seeded, options).unwrap();
        assert_eq!(&timed, expected);
        let after_first = |c: &kd_model::Completion| c.ids.len() - 1;
        assert_eq!(timings.steps, timed.iter().map(after_first).max().unwrap());
        assert_eq!(
            timings.decode_tokens,
            timed.iter().map(after_first).sum::<usize>()
        );
        assert!(timings.decode_tokens_per_s().is_some_and(|r| r > 0.0));
    }
}

/// The cache appends into preallocated slots: its capacity doubles when a step needs more
/// (not on every step), a cache allocated for the whole decode never grows, rolled-back slots
/// are reused, and every variant decodes exactly as the full forward pass does.
#[test]
fn cache_capacity_grows_geometrically_and_decodes_as_the_full_pass() {
    let model = load("tiny-llama3");
    let vocab = model.config().vocab_size;
    let prompt = [1u32, 5, 9, 4, 7];
    let feed = [11u32, 3, 8, 2, 6, 10, 12, 13, 14, 15, 16, 17];
    let decode = |mut cache: kd_model::KvCache| {
        let last = ForwardOptions::last_positions(1);
        let mut capacities = Vec::new();
        let mut logits = Vec::new();
        let out = model
            .forward_cached(&TokenBatch::single(&prompt), &mut cache, &last)
            .unwrap();
        logits.push(to_vec(out.logits.unwrap()));
        capacities.push(cache.capacity());
        for &t in &feed {
            let out = model
                .forward_cached(&TokenBatch::single(&[t]), &mut cache, &last)
                .unwrap();
            logits.push(to_vec(out.logits.unwrap()));
            capacities.push(cache.capacity());
        }
        (logits, capacities, cache)
    };
    let (grown, capacities, _) = decode(model.new_cache());
    // 5 prompt slots; the 6th token doubles to 10, the 11th to 20.
    let mut want = vec![5];
    want.extend(std::iter::repeat_n(10, 5));
    want.extend(std::iter::repeat_n(20, 7));
    assert_eq!(capacities, want);
    let (reserved, capacities, mut cache) = decode(model.new_cache_with_capacity(64));
    assert!(capacities.iter().all(|c| *c == 64), "{capacities:?}");
    let full: Vec<u32> = prompt.iter().chain(&feed).copied().collect();
    let alone = to_vec(model.logits(&TokenBatch::single(&full)).unwrap());
    for (step, (a, b)) in grown.iter().zip(&reserved).enumerate() {
        let at = (prompt.len() - 1 + step) * vocab;
        let reference = &alone[at..at + vocab];
        for (what, got) in [("grown", a), ("reserved", b)] {
            let d = got
                .iter()
                .zip(reference)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(d <= 1e-5, "step {step} ({what}): max |Δ| {d}");
        }
    }
    // Roll back to the prompt and feed another continuation into the same slots.
    cache.truncate(&[prompt.len() as i64]).unwrap();
    assert_eq!((cache.len(), cache.capacity()), (prompt.len(), 64));
    let out = model
        .forward_cached(
            &TokenBatch::single(&[20, 21]),
            &mut cache,
            &ForwardOptions::default(),
        )
        .unwrap();
    let got = to_vec(out.logits.unwrap());
    let other: Vec<u32> = prompt.iter().chain(&[20, 21]).copied().collect();
    let alone = to_vec(model.logits(&TokenBatch::single(&other)).unwrap());
    let d = got
        .iter()
        .zip(&alone[prompt.len() * vocab..])
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(d <= 1e-5, "after the rollback: max |Δ| {d}");
}

/// `generate_captured` makes the completions `generate` makes, and keeps at every position of
/// prompt + completion the hidden states asked for, and the log-normaliser and argmax of the
/// logits from the prompt's last position on (the completion's last token, which no decode
/// step feeds, included). The references: the same batch decoded by hand (every row fed its
/// greedy token at every step, none leaving the batch), and for the f32 model the full pass
/// over each finished sequence too. On the f32 model and on its Q8_0 blocks (the host decode
/// path where the CPU has AVX2; the full pass, and a prompt's pass over many rows, read the
/// f32 weights there, so the full pass is no reference for it), with a prompt of 150 tokens,
/// and a stop token ending rows early. (The lean SmolLM2, whose long prompts pass in chunks:
/// `gguf::a_lean_smollm2_captures_what_it_computes`.)
#[test]
fn generation_captures_what_the_full_pass_computes() {
    use kd_model::GenerateOptions;
    let base = load("tiny-llama3");
    let (layers, vocab) = (base.config().num_hidden_layers, base.config().vocab_size);
    let mut rows = prompts(&golden("tiny-llama3"));
    let mut next = lcg(7);
    rows.push((0..150).map(|_| next() % vocab as u32).collect());
    let q8 = load("tiny-llama3").with_q8_0_weights(true);
    check_capture("f32", &base, &rows, &[1, 2, layers], Some(1e-4));
    check_capture("q8_0", &q8, &rows, &[1, 2, layers], None);
    assert!(
        base.generate_captured(&[], &GenerateOptions::greedy(1), &[])
            .is_err()
    );
    assert!(
        base.generate_captured(&[], &GenerateOptions::greedy(1), &[layers + 1])
            .is_err()
    );
}

/// The checks of [`generation_captures_what_the_full_pass_computes`] on `model`, greedy
/// 7 new tokens of `rows` capturing `wanted`; against the full pass within `full_pass`
/// (absolute, hidden states and normalisers) where given. The batch decoded by hand agrees
/// within 1e-4.
pub fn check_capture(
    what: &str,
    model: &Llama,
    rows: &[Vec<u32>],
    wanted: &[usize],
    full_pass: Option<f32>,
) {
    use kd_model::{GenerateOptions, HiddenStates, SeededPrompt};
    let (d, vocab) = (model.config().hidden_size, model.config().vocab_size);
    let steps = 7;
    let log_z_of = |l: &[f32]| {
        let max = l.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
        let sum: f64 = l.iter().map(|v| ((v - max) as f64).exp()).sum();
        max + sum.ln() as f32
    };
    let seeded: Vec<SeededPrompt<'_>> = rows
        .iter()
        .map(|ids| SeededPrompt { ids, seed: 0 })
        .collect();
    let free = model
        .generate(&seeded, &GenerateOptions::greedy(steps))
        .unwrap();
    // A stop token: row 0's third token ends row 0 there and cuts other rows.
    let options = GenerateOptions {
        stop_token_ids: vec![free[0].ids[2]],
        ..GenerateOptions::greedy(steps)
    };
    let plain = model.generate(&seeded, &options).unwrap();
    let captured = model.generate_captured(&seeded, &options, wanted).unwrap();
    assert_eq!(plain.len(), captured.len());
    // The reference: the same left-padded batch decoded by hand, every row fed its greedy
    // token at every step (none leaves the batch), hidden states at its real positions.
    let by_hand = {
        let b = rows.len();
        let options = ForwardOptions {
            hidden_states: HiddenStates::Layers(wanted.to_vec()),
            ..ForwardOptions::last_positions(1)
        };
        let mut cache = model.new_cache();
        let mut batch = TokenBatch::from_rows(rows, 0, PaddingSide::Left);
        let mut out: Vec<(Vec<f32>, Vec<Vec<f32>>)> = vec![Default::default(); b];
        for step in 0..=steps {
            let pass = model.forward_cached(&batch, &mut cache, &options).unwrap();
            let s = batch.seq_len();
            let states: Vec<Vec<f32>> = pass
                .hidden_states
                .iter()
                .map(|(_, h)| to_vec(h.clone()))
                .collect();
            let logits = to_vec(pass.logits.unwrap());
            let mut next = Vec::new();
            for (r, (hidden, row_logits)) in out.iter_mut().enumerate() {
                let real = if step == 0 { rows[r].len() } else { 1 };
                for t in s - real..s {
                    for state in &states {
                        hidden.extend_from_slice(&state[(r * s + t) * d..][..d]);
                    }
                }
                let l = logits[r * vocab..(r + 1) * vocab].to_vec();
                next.push(argmax(&l));
                row_logits.push(l);
            }
            batch = TokenBatch::new(b, 1, next, vec![true; b]).unwrap();
        }
        out
    };
    assert!(
        plain.iter().any(|c| c.ids.len() < steps),
        "{what}: no row stopped early"
    );
    for (r, (c, (cc, row))) in plain.iter().zip(&captured).enumerate() {
        assert_eq!(c, cc, "{what} row {r}: the completion changed");
        let sequence: Vec<u32> = rows[r].iter().chain(&c.ids).copied().collect();
        let (p, n) = (rows[r].len(), sequence.len());
        assert_eq!(row.len, n, "{what} row {r}");
        assert_eq!(row.hidden.len(), n * wanted.len() * d, "{what} row {r}");
        assert_eq!(row.logits_from, p - 1, "{what} row {r}");
        assert_eq!(row.log_z.len(), n - row.logits_from, "{what} row {r}");
        assert_eq!(row.argmax.len(), row.log_z.len(), "{what} row {r}");
        let (mut hidden, logits) = by_hand[r].clone();
        hidden.truncate(n * wanted.len() * d);
        let mut references = vec![("the batch by hand", 1e-4, hidden, logits)];
        if let Some(tol) = full_pass {
            let full = model
                .forward(
                    &TokenBatch::single(&sequence),
                    &ForwardOptions::with_hidden_states(HiddenStates::Layers(wanted.to_vec())),
                )
                .unwrap();
            let states: Vec<Vec<f32>> = full
                .hidden_states
                .iter()
                .map(|(_, h)| to_vec(h.clone()))
                .collect();
            let hidden = (0..n)
                .flat_map(|t| {
                    states
                        .iter()
                        .flat_map(move |s| s[t * d..(t + 1) * d].to_vec())
                })
                .collect();
            let all = to_vec(full.logits.unwrap());
            let logits = (p - 1..n)
                .map(|t| all[t * vocab..(t + 1) * vocab].to_vec())
                .collect();
            references.push(("the full pass", tol, hidden, logits));
        }
        for (reference, tol, hidden, logits) in references {
            let worst = row
                .hidden
                .iter()
                .zip(&hidden)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                worst <= tol,
                "{what} row {r} against {reference}: hidden states max |Δ| {worst}"
            );
            for (j, l) in logits.iter().take(row.log_z.len()).enumerate() {
                let t = p - 1 + j;
                let log_z = log_z_of(l);
                assert!(
                    (row.log_z[j] - log_z).abs() <= tol,
                    "{what} row {r} position {t} against {reference}: log_z {} for {log_z}",
                    row.log_z[j]
                );
                let margin = l[argmax(l) as usize] - l[row.argmax[j] as usize];
                assert!(
                    margin <= tol,
                    "{what} row {r} position {t}: argmax margin {margin}"
                );
            }
        }
        // The argmax is the greedy choice where a step chose one.
        assert_eq!(row.argmax[..n - p], sequence[p..], "{what} row {r}");
    }
}
