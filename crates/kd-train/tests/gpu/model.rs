//! The model's paths on the GPU against the CPU and transformers.

use std::collections::HashMap;

use burn::tensor::{DType, Device};
use kd_model::{
    ComputeDType, ForwardOptions, GenerateOptions, Llama, SeededPrompt, TokenBatch,
    layers::LoraLinear,
};
use safetensors::{Dtype, SafeTensors};

use crate::util::*;

/// transformers' inputs and logits for the fixture models (fixtures/make_tiny_llamas.py).
fn golden(name: &str) -> HashMap<String, (Vec<usize>, Vec<f64>)> {
    let path = fixtures()
        .join("golden")
        .join(format!("{name}.safetensors"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .filter_map(|(k, v)| {
            let d = v.data();
            let values: Vec<f64> = match v.dtype() {
                Dtype::F32 => d
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                Dtype::I64 => d
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                _ => return None,
            };
            Some((k, (v.shape().to_vec(), values)))
        })
        .collect()
}

fn golden_batch(g: &HashMap<String, (Vec<usize>, Vec<f64>)>, prefix: &str) -> TokenBatch {
    let (shape, ids) = &g[&format!("{prefix}.input_ids")];
    let mask = &g[&format!("{prefix}.attention_mask")].1;
    let pos = &g[&format!("{prefix}.position_ids")].1;
    TokenBatch::new(
        shape[0],
        shape[1],
        ids.iter().map(|i| *i as u32).collect(),
        mask.iter().map(|m| *m != 0.0).collect(),
    )
    .unwrap()
    .with_positions(pos.iter().map(|p| *p as i64).collect())
    .unwrap()
}

/// Values at the unmasked positions of `[b, s, width]` logits.
fn unmasked(v: &[f32], mask: &[bool], width: usize) -> Vec<f32> {
    mask.iter()
        .enumerate()
        .filter(|(_, m)| **m)
        .flat_map(|(p, _)| v[p * width..(p + 1) * width].iter().copied())
        .collect()
}

/// f32 logits on padded batches equal the CPU's and transformers' (≤ 1e-4), the Qwen2 (q/k/v
/// biases) and Qwen3 (per-head q/k norms) models included.
pub fn forward_matches_cpu_and_transformers(gpu: &Device) {
    for name in [
        "tiny-llama3",
        "tiny-tied",
        "tiny-sharded",
        "tiny-qwen2",
        "tiny-qwen3",
    ] {
        let g = golden(name);
        let (on_gpu, on_cpu) = (load(name, gpu), load(name, &cpu()));
        let vocab = on_gpu.config().vocab_size;
        for prefix in ["right", "left", "offset"] {
            let batch = golden_batch(&g, prefix);
            let ours = values(on_gpu.logits(&batch).unwrap());
            let cpu_logits = values(on_cpu.logits(&batch).unwrap());
            let theirs: Vec<f32> = g[&format!("{prefix}.logits")]
                .1
                .iter()
                .map(|v| *v as f32)
                .collect();
            let m = batch.mask();
            assert_close(
                &format!("{name} {prefix}: logits vs CPU"),
                &unmasked(&ours, m, vocab),
                &unmasked(&cpu_logits, m, vocab),
                1e-4,
            );
            assert_close(
                &format!("{name} {prefix}: logits vs transformers"),
                &unmasked(&ours, m, vocab),
                &unmasked(&theirs, m, vocab),
                1e-4,
            );
        }
    }
}

/// bf16 where the device computes in it (logits within bf16 rounding of the CPU's bf16
/// model); elsewhere loading in bf16 is refused with an error that says so.
pub fn bf16_forward_or_a_clear_error(gpu: &Device) {
    let dir = model_dir("tiny-llama3-bf16");
    if !gpu.supports_dtype(DType::BF16) {
        let e = Llama::load_with(&dir, ComputeDType::BF16, gpu)
            .expect_err("bf16 on a device without bf16 arithmetic must be refused")
            .to_string();
        println!("  no bf16 arithmetic on this device; loading in bf16 says: {e}");
        assert!(e.contains("bf16"), "{e}");
        // The bf16 checkpoint itself loads (computing in f32) and matches the CPU.
        let batch = TokenBatch::single(&[1, 17, 45, 200, 3, 9]);
        let a = values(Llama::load(&dir, gpu).unwrap().logits(&batch).unwrap());
        let b = values(Llama::load(&dir, &cpu()).unwrap().logits(&batch).unwrap());
        assert_close(
            "bf16 checkpoint computed in f32: logits vs CPU",
            &a,
            &b,
            1e-4,
        );
        return;
    }
    let batch = TokenBatch::single(&[1, 17, 45, 200, 3, 9]);
    let on_gpu = Llama::load_with(&dir, ComputeDType::BF16, gpu).unwrap();
    assert_eq!(on_gpu.dtype(), DType::BF16);
    let a = values(on_gpu.logits(&batch).unwrap());
    let b = values(Llama::load(&dir, &cpu()).unwrap().logits(&batch).unwrap());
    // bf16 keeps 8 significant bits: 2⁻⁸ relative per operation, a few layers deep.
    assert_rel("bf16 logits vs the CPU's f32", &a, &b, 5e-2);
}

/// Decoding with the KV cache gives the full pass's logits, and greedy generation gives the
/// CPU's tokens.
pub fn cached_decoding_and_greedy_generation_match_cpu(gpu: &Device) {
    let model = load("tiny-llama3", gpu);
    let vocab = model.config().vocab_size;
    let ids = [1u32, 17, 45, 200, 3, 9, 11, 80];
    let full = values(model.logits(&TokenBatch::single(&ids)).unwrap());
    let mut cache = model.new_cache();
    let mut stepped = values(
        model
            .forward_cached(
                &TokenBatch::single(&ids[..5]),
                &mut cache,
                &ForwardOptions::default(),
            )
            .unwrap()
            .into_logits()
            .unwrap(),
    );
    for id in &ids[5..] {
        stepped.extend(values(
            model
                .forward_cached(
                    &TokenBatch::single(&[*id]),
                    &mut cache,
                    &ForwardOptions::default(),
                )
                .unwrap()
                .into_logits()
                .unwrap(),
        ));
    }
    assert_eq!(stepped.len(), ids.len() * vocab);
    assert_close("cached decoding vs the full pass", &stepped, &full, 1e-4);

    let prompts = [
        SeededPrompt {
            ids: &[1, 17, 45],
            seed: 1,
        },
        SeededPrompt {
            ids: &[1, 200, 3, 9, 11, 80, 7],
            seed: 2,
        },
    ];
    let options = GenerateOptions {
        stop_token_ids: vec![u32::MAX - 1],
        ..GenerateOptions::greedy(24)
    };
    let ours = model.generate(&prompts, &options).unwrap();
    let theirs = load("tiny-llama3", &cpu())
        .generate(&prompts, &options)
        .unwrap();
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        println!(
            "  prompt {i}: {} greedy tokens, equal: {}",
            a.ids.len(),
            a.ids == b.ids
        );
        assert_eq!(
            a.ids, b.ids,
            "prompt {i}: greedy tokens differ from the CPU's"
        );
        assert_eq!(a.ids.len(), 24);
    }
}

fn projections(model: &Llama) -> Vec<&LoraLinear> {
    model.projections().into_iter().map(|(_, p)| p).collect()
}

/// A LoRA training forward and backward pass with dropout (seeded masks) gives the CPU's
/// loss and adapter gradients.
pub fn lora_gradients_with_dropout_match_cpu(gpu: &Device) {
    let adapter = fixtures().join("tiny-adapters/peft-r4");
    let run = |device: &Device| {
        let (mut model, _) = Llama::load(model_dir("tiny-llama3"), &device.clone().autodiff())
            .unwrap()
            .load_adapter(&adapter)
            .unwrap();
        for l in &mut model.layers {
            for p in [
                &mut l.self_attn.q_proj,
                &mut l.self_attn.k_proj,
                &mut l.self_attn.v_proj,
                &mut l.self_attn.o_proj,
                &mut l.mlp.gate_proj,
                &mut l.mlp.up_proj,
                &mut l.mlp.down_proj,
            ] {
                p.adapter.as_mut().unwrap().dropout = 0.1;
            }
        }
        let rows = vec![vec![1u32, 17, 45, 200, 3, 9, 11], vec![1, 80, 7, 3]];
        let batch = TokenBatch::from_rows(&rows, 0, kd_model::PaddingSide::Right);
        let labels: Vec<i64> = batch
            .ids()
            .iter()
            .zip(batch.mask())
            .map(|(i, m)| if *m { *i as i64 } else { -100 })
            .collect();
        let t = kd_loss::next_token_targets(&labels, 2, batch.seq_len());
        let out = model
            .forward(
                &batch,
                &ForwardOptions {
                    dropout_seed: Some(5),
                    ..ForwardOptions::default()
                },
            )
            .unwrap();
        let logits = out.into_logits().unwrap();
        let [b, s, v] = logits.dims();
        let loss = kd_loss::cross_entropy(logits.reshape([b * s, v]), &t.targets, t.count as f32)
            .unwrap()
            .loss;
        let grads = loss.backward();
        let mut g = Vec::new();
        for p in projections(&model) {
            let a = p.adapter.as_ref().unwrap();
            for w in [&a.lora_a.weight, &a.lora_b.weight] {
                g.extend(values(w.val().grad(&grads).expect("adapter gradient")));
            }
        }
        (values(loss), g)
    };
    let (loss_gpu, g_gpu) = run(gpu);
    let (loss_cpu, g_cpu) = run(&cpu());
    assert_close(
        "CE loss with LoRA dropout vs CPU",
        &loss_gpu,
        &loss_cpu,
        1e-5,
    );
    assert!(
        g_cpu.iter().any(|x| x.abs() > 1e-6),
        "gradients are all zero"
    );
    assert_close("LoRA A/B gradients vs CPU", &g_gpu, &g_cpu, 1e-5);
}

/// `wgpu:N` is the N-th adapter, `vulkan:N` the same adapter pinned to Vulkan, and both
/// compute what the CPU does; names beyond the adapters there are, or of an API the machine
/// lacks, are errors that say what exists.
pub fn device_names_reach_the_adapters(_gpu: &Device) {
    let all = kd_model::device::adapters();
    assert!(!all.is_empty());
    let x = pseudo(6 * 5, 1, 1.0);
    let y = pseudo(5 * 4, 2, 1.0);
    let product = |device: &Device| {
        let a = burn::tensor::Tensor::<2>::from_data(
            burn::tensor::TensorData::new(x.clone(), [6, 5]),
            device,
        );
        let b = burn::tensor::Tensor::<2>::from_data(
            burn::tensor::TensorData::new(y.clone(), [5, 4]),
            device,
        );
        values(a.matmul(b))
    };
    let reference = product(&cpu());
    for a in &all {
        let name = format!("wgpu:{}", a.index);
        let d = kd_model::parse_device(&name).unwrap();
        assert!(d == a.device, "{name}");
        println!("  {name}: {}", kd_model::device::describe(&d));
        assert_close(
            &format!("{name}: a product vs CPU"),
            &product(&d),
            &reference,
            1e-5,
        );
    }
    // Vulkan where the machine has it (wgpu falls back to OpenGL where it does not).
    match kd_model::parse_device("vulkan:0") {
        Ok(d) => {
            println!("  vulkan:0: {}", kd_model::device::describe(&d));
            assert_close("vulkan:0: a product vs CPU", &product(&d), &reference, 1e-5);
        }
        Err(e) => {
            println!("  vulkan:0: {e}");
            assert!(e.to_string().contains("no vulkan adapter"), "{e}");
        }
    }
    if cfg!(target_os = "linux") {
        let e = kd_model::parse_device("metal:0").unwrap_err().to_string();
        assert!(e.contains("no metal adapter"), "{e}");
    }
    let e = kd_model::parse_device(&format!("wgpu:{}", all.len()))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no wgpu adapter") && e.contains(&all[0].name),
        "{e}"
    );
    let e = kd_model::parse_device("vulkan:99").unwrap_err().to_string();
    assert!(e.contains("no vulkan adapter"), "{e}");
}
