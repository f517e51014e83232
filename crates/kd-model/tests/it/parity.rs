//! Logits and hidden states equal transformers' on padded batches: within twice
//! transformers' own float32 spread of the float64 result (`util::Reference`).

use kd_model::{ComputeDType, ForwardOptions, HiddenStates, Llama};

use crate::util::*;

/// The Llama models of fixtures/make_tiny_llamas.py and the Qwen2 / Qwen3 ones of
/// fixtures/make_tiny_qwens.py.
const MODELS: [&str; 5] = [
    "tiny-llama3",
    "tiny-tied",
    "tiny-sharded",
    "tiny-qwen2",
    "tiny-qwen3",
];
const BATCHES: [&str; 3] = ["right", "left", "offset"];

#[test]
fn rope_inverse_frequencies_match() {
    for name in MODELS {
        let g = golden(name);
        let model = load(name);
        let ours = model.rope().inv_freq();
        let theirs = &g["inv_freq"].f32;
        assert_eq!(ours.len(), theirs.len(), "{name}");
        for (a, b) in ours.iter().zip(theirs) {
            assert!((a - b).abs() <= 1e-7 * b.abs(), "{name}: {a} vs {b}");
        }
    }
}

#[test]
fn f32_logits_and_hidden_states_match_transformers() {
    for name in MODELS {
        let g = golden(name);
        let reference = Reference::load(name);
        let model = load(name);
        let c = model.config().clone();
        for prefix in BATCHES {
            let batch = golden_batch(&g, prefix);
            let out = model
                .forward(
                    &batch,
                    &ForwardOptions::with_hidden_states(HiddenStates::All),
                )
                .unwrap();
            let logits = to_vec(out.logits.clone().unwrap());
            let key = format!("{prefix}.logits");
            reference.check(&format!("{name} {key}"), &key, &logits, Some(batch.mask()));
            assert_eq!(
                argmaxes_masked(&logits, batch.mask(), c.vocab_size),
                argmaxes_masked(&g[&key].f32, batch.mask(), c.vocab_size),
                "{name} {key}: argmax"
            );
            assert_eq!(out.hidden_states.len(), c.num_hidden_layers + 1);
            for (i, h) in &out.hidden_states {
                let key = format!("{prefix}.hidden.{i}");
                reference.check(
                    &format!("{name} {key}"),
                    &key,
                    &to_vec(h.clone()),
                    Some(batch.mask()),
                );
            }
        }
    }
}

#[test]
fn chosen_hidden_states_and_no_logits() {
    let name = "tiny-llama3";
    let g = golden(name);
    let model = load(name);
    let batch = golden_batch(&g, "right");
    let opts = ForwardOptions {
        logits: false,
        last_positions: None,
        hidden_states: HiddenStates::Layers(vec![3, 1]),
        dropout_seed: None,
    };
    let out = model.forward(&batch, &opts).unwrap();
    assert!(out.logits.is_none());
    assert_eq!(
        out.hidden_states
            .iter()
            .map(|(i, _)| *i)
            .collect::<Vec<_>>(),
        vec![3, 1]
    );
    Reference::load(name).check(
        "tiny-llama3 right.hidden.3 alone",
        "right.hidden.3",
        &to_vec(out.hidden_state(3).unwrap().clone()),
        Some(batch.mask()),
    );
    let bad = ForwardOptions::with_hidden_states(HiddenStates::Layers(vec![4]));
    let e = model.forward(&batch, &bad).unwrap_err().to_string();
    assert!(e.contains("0..=3"), "{e}");
}

#[test]
fn bf16_checkpoints() {
    // tiny-qwen2-bf16 is sharded, tiny-qwen3-bf16 tied with q/k norms.
    for name in ["tiny-llama3", "tiny-tied", "tiny-qwen2", "tiny-qwen3"] {
        let g = golden(name);
        let reference = Reference::load(name);
        let dir = model_dir(&format!("{name}-bf16"));
        let vocab = 256;
        // bf16 weights computed in f32: same numbers as transformers on the upcast weights.
        let model = Llama::load(&dir, &cpu()).unwrap();
        // bf16 weights computed in bf16: compared with transformers computing in bf16.
        let model_bf16 = Llama::load_with(&dir, ComputeDType::BF16, &cpu()).unwrap();
        for prefix in BATCHES {
            let batch = golden_batch(&g, prefix);
            let logits = to_vec(model.logits(&batch).unwrap());
            let key = format!("bf16_upcast.{prefix}.logits");
            reference.check(&format!("{name} {key}"), &key, &logits, Some(batch.mask()));
            let logits = to_vec(model_bf16.logits(&batch).unwrap());
            let theirs = &g[&format!("bf16_native.{prefix}.logits")].f32;
            let d = max_diff_masked(&logits, theirs, batch.mask(), vocab);
            let scale = theirs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let f32_ref = &g[&format!("bf16_upcast.{prefix}.logits")].f32;
            let ours_vs_f32 = max_diff_masked(&logits, f32_ref, batch.mask(), vocab);
            let theirs_vs_f32 = max_diff_masked(theirs, f32_ref, batch.mask(), vocab);
            eprintln!(
                "{name} {prefix}: bf16 compute: max |Δlogits| vs transformers bf16 {d:.3e}; \
                 vs the same bf16 weights computed in f32: ours {ours_vs_f32:.3e}, transformers bf16 {theirs_vs_f32:.3e} \
                 (max |logit| {scale:.2})"
            );
            // bf16 has 8 bits of mantissa; different kernels round differently.
            assert!(d <= 0.05 * scale.max(1.0), "{name} {prefix}: {d}");
        }
    }
}
