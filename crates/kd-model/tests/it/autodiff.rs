//! Gradients through the model (autodiff, GQA via repeated K/V) equal PyTorch's.

use burn::module::{Module, Param};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};
use kd_model::Llama;

use crate::util::*;

/// Mean next-token cross-entropy over real tokens, as in fixtures/make_tiny_llamas.py.
fn loss(model: &Llama, name: &str) -> Tensor<1> {
    let g = golden(name);
    let batch = golden_batch(&g, "right");
    let (b, s) = (batch.batch_size(), batch.seq_len());
    let logits = model.logits(&batch).unwrap();
    let v = logits.dims()[2];
    let device = logits.device();
    let logp = log_softmax(logits.slice([0..b, 0..s - 1, 0..v]), 2);
    let mut targets = Vec::new();
    let mut weights = Vec::new();
    for r in 0..b {
        for t in 1..s {
            targets.push(batch.ids()[r * s + t] as i64);
            weights.push(if batch.mask()[r * s + t] { 1f32 } else { 0.0 });
        }
    }
    let count: f32 = weights.iter().sum();
    let targets = Tensor::<3, Int>::from_data(TensorData::new(targets, [b, s - 1, 1]), &device);
    let weights = Tensor::<3>::from_data(TensorData::new(weights, [b, s - 1, 1]), &device);
    (logp.gather(2, targets) * weights).sum().neg() / count
}

fn grad1(p: &Param<Tensor<1>>, grads: &burn::tensor::Gradients) -> Vec<f32> {
    let g = p.val().grad(grads).expect("parameter has a gradient");
    g.into_data().try_into_vec_as::<f32>().unwrap()
}

fn grad(p: &Param<Tensor<2>>, grads: &burn::tensor::Gradients, transpose: bool) -> Vec<f32> {
    let g = p.val().grad(grads).expect("parameter has a gradient");
    let g = if transpose { g.transpose() } else { g };
    g.into_data().try_into_vec_as::<f32>().unwrap()
}

fn check(name: &str, what: &str, ours: &[f32], theirs: &[f32]) {
    assert_eq!(ours.len(), theirs.len(), "{name} {what}");
    let scale = theirs.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = ours
        .iter()
        .zip(theirs)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    eprintln!("{name} grad {what}: max |Δ| = {d:.2e} (max |g| {scale:.2e})");
    assert!(
        d <= 1e-5 * scale.max(1.0) + 1e-6,
        "{name} {what}: max |Δ| = {d}, scale {scale}"
    );
}

#[test]
fn gradients_match_pytorch() {
    for name in ["tiny-llama3", "tiny-tied", "tiny-qwen2", "tiny-qwen3"] {
        let g = golden(name);
        let model = load(name).train();
        let loss = loss(&model, name);
        let value = loss.clone().into_data().try_into_vec_as::<f32>().unwrap()[0];
        let expected = g["grad.loss"].f32[0];
        assert!(
            (value - expected).abs() <= 1e-5 * expected.abs(),
            "{name}: loss {value} vs {expected}"
        );
        let grads = loss.backward();
        let l0 = &model.layers[0];
        check(
            name,
            "embed",
            &grad(&model.embed_tokens.weight, &grads, false),
            &g["grad.model.embed_tokens.weight"].f32,
        );
        check(
            name,
            "q_proj",
            &grad(&l0.self_attn.q_proj.base.weight, &grads, true),
            &g["grad.model.layers.0.self_attn.q_proj.weight"].f32,
        );
        check(
            name,
            "k_proj",
            &grad(&l0.self_attn.k_proj.base.weight, &grads, true),
            &g["grad.model.layers.0.self_attn.k_proj.weight"].f32,
        );
        check(
            name,
            "v_proj",
            &grad(&l0.self_attn.v_proj.base.weight, &grads, true),
            &g["grad.model.layers.0.self_attn.v_proj.weight"].f32,
        );
        check(
            name,
            "down_proj",
            &grad(&model.layers[1].mlp.down_proj.base.weight, &grads, true),
            &g["grad.model.layers.1.mlp.down_proj.weight"].f32,
        );
        let norm = l0.input_layernorm.gamma.val().grad(&grads).unwrap();
        check(
            name,
            "input_layernorm",
            &norm.into_data().try_into_vec_as::<f32>().unwrap(),
            &g["grad.model.layers.0.input_layernorm.weight"].f32,
        );
        // Qwen2's q/k biases and Qwen3's per-head q/k norms, where the golden has them.
        for (what, bias) in [
            ("q_proj.bias", &l0.self_attn.q_proj.base.bias),
            ("k_proj.bias", &l0.self_attn.k_proj.base.bias),
        ] {
            if let Some(want) = g.get(&format!("grad.model.layers.0.self_attn.{what}")) {
                let bias = bias.as_ref().expect("a Qwen2 q/k projection has a bias");
                check(name, what, &grad1(bias, &grads), &want.f32);
            }
        }
        for (what, norm) in [
            ("q_norm.weight", &l0.self_attn.q_norm),
            ("k_norm.weight", &l0.self_attn.k_norm),
        ] {
            if let Some(want) = g.get(&format!("grad.model.layers.0.self_attn.{what}")) {
                let norm = norm.as_ref().expect("a Qwen3 layer has q/k norms");
                check(name, what, &grad1(&norm.gamma, &grads), &want.f32);
            }
        }
        if let Some(head) = &model.lm_head {
            check(
                name,
                "lm_head",
                &grad(&head.weight, &grads, false),
                &g["grad.lm_head.weight"].f32,
            );
        }
    }
}

#[test]
fn autodiff_forward_equals_plain_forward() {
    let g = golden("tiny-llama3");
    let batch = golden_batch(&g, "left");
    let plain = to_vec(load("tiny-llama3").logits(&batch).unwrap());
    let trained = load("tiny-llama3").train();
    let ad = to_vec(trained.logits(&batch).unwrap());
    let d = max_diff_masked(&plain, &ad, batch.mask(), 256);
    assert!(d <= 1e-5, "{d}");
    assert_eq!(trained.num_params(), 100_944);
}
