//! Every loss on the GPU (Burn's generic operations) against the CPU's fused kernels.

use burn::tensor::{Device, Int, Tensor, TensorData};
use kd_loss::{
    KdConfig, KdObjective, LinearCe, Teacher, chunk_rows, cross_entropy, hidden_mse, kd_loss,
    linear_cross_entropy, linear_cross_entropy_chunked, linear_kd, linear_kd_chunked,
};

use crate::util::*;

const ROWS: usize = 9;
const VOCAB: usize = 48;
const K: usize = 6;

fn tensor(v: &[f32], shape: [usize; 2], device: &Device) -> Tensor<2> {
    Tensor::from_data(TensorData::new(v.to_vec(), shape), device)
}

fn topk_indices(device: &Device) -> Tensor<2, Int> {
    let idx: Vec<i64> = (0..ROWS * K)
        .map(|i| ((i / K) * 5 + (i % K) * 7) as i64 % VOCAB as i64)
        .collect();
    Tensor::from_data(TensorData::new(idx, [ROWS, K]), device)
}

fn mask() -> Vec<bool> {
    (0..ROWS).map(|r| r != 3).collect()
}

fn targets() -> Vec<i64> {
    (0..ROWS)
        .map(|r| {
            if r == 5 {
                -100
            } else {
                (r * 11 % VOCAB) as i64
            }
        })
        .collect()
}

/// The loss value, its statistics and the gradient of the student's logits for one
/// objective, full or top-k teacher, on `device`.
fn kd_on(device: &Device, objective: KdObjective, top_k: bool) -> (Vec<f32>, Vec<f32>, f64, f64) {
    let ad = device.clone().autodiff();
    let student = tensor(&pseudo(ROWS * VOCAB, 1, 4.0), [ROWS, VOCAB], &ad).require_grad();
    let t = pseudo(ROWS * VOCAB, 2, 4.0);
    let teacher = if top_k {
        let tv = pseudo(ROWS * K, 3, 4.0);
        Teacher::TopK {
            indices: topk_indices(device),
            values: tensor(&tv, [ROWS, K], device),
        }
    } else {
        Teacher::Logits(tensor(&t, [ROWS, VOCAB], device))
    };
    let config = KdConfig {
        objective,
        kd_temperature: 1.5,
        ..KdConfig::default()
    };
    let out = kd_loss(student.clone(), teacher, &mask(), 7.0, &config).unwrap();
    let grads = out.loss.backward();
    (
        values(out.loss),
        values(student.grad(&grads).unwrap()),
        out.stats.loss_sum,
        out.stats.acceptance_sum,
    )
}

/// Seven KD objectives with full and top-k teachers, CE and hidden-state MSE: value,
/// statistics and gradient equal the CPU's.
pub fn every_loss_matches_cpu(gpu: &Device) {
    for objective in KdObjective::ALL {
        for top_k in [false, true] {
            let (l_g, g_g, s_g, a_g) = kd_on(gpu, objective, top_k);
            let (l_c, g_c, s_c, a_c) = kd_on(&cpu(), objective, top_k);
            let what = format!("{objective:?}{}", if top_k { " top-k" } else { "" });
            assert_rel(&format!("{what}: loss"), &l_g, &l_c, 1e-5);
            assert_close(&format!("{what}: d logits"), &g_g, &g_c, 1e-5);
            assert!(
                (s_g - s_c).abs() <= 1e-4 * s_c.abs().max(1.0)
                    && (a_g - a_c).abs() <= 1e-4 * a_c.abs().max(1.0),
                "{what}: stats {s_g} {a_g} vs {s_c} {a_c}"
            );
        }
    }
    // Cross-entropy.
    let ce = |device: &Device| {
        let ad = device.clone().autodiff();
        let z = tensor(&pseudo(ROWS * VOCAB, 4, 4.0), [ROWS, VOCAB], &ad).require_grad();
        let out = cross_entropy(z.clone(), &targets(), 8.0).unwrap();
        let grads = out.loss.backward();
        (values(out.loss), values(z.grad(&grads).unwrap()))
    };
    let ((l_g, g_g), (l_c, g_c)) = (ce(gpu), ce(&cpu()));
    assert_rel("cross-entropy: loss", &l_g, &l_c, 1e-5);
    assert_close("cross-entropy: d logits", &g_g, &g_c, 1e-5);
    // Hidden-state MSE through a learned projection.
    let mse = |device: &Device| {
        let ad = device.clone().autodiff();
        let s = tensor(&pseudo(ROWS * 8, 5, 1.0), [ROWS, 8], &ad).require_grad();
        let w = tensor(&pseudo(8 * 12, 6, 0.5), [8, 12], &ad).require_grad();
        let t = tensor(&pseudo(ROWS * 12, 7, 1.0), [ROWS, 12], device);
        let out = hidden_mse(s.clone().matmul(w.clone()), t, None, &mask(), 8.0).unwrap();
        let grads = out.backward();
        (
            values(out),
            values(s.grad(&grads).unwrap()),
            values(w.grad(&grads).unwrap()),
        )
    };
    let ((l_g, s_g, w_g), (l_c, s_c, w_c)) = (mse(gpu), mse(&cpu()));
    assert_rel("hidden MSE: loss", &l_g, &l_c, 1e-5);
    assert_close("hidden MSE: d student", &s_g, &s_c, 1e-5);
    assert_close("hidden MSE: d projection", &w_g, &w_c, 1e-5);
}

const DIM: usize = 16;

/// `linear_cross_entropy` / `linear_kd` (+ CE) on the GPU in chunks of 4 rows give the CPU's
/// fused results: loss, statistics, d hidden and d W.
pub fn chunked_head_losses_match_cpu(gpu: &Device) {
    let run = |device: &Device, kd: Option<(KdObjective, bool)>, chunk: Option<usize>| {
        let ad = device.clone().autodiff();
        let h = tensor(&pseudo(ROWS * DIM, 8, 1.0), [ROWS, DIM], &ad).require_grad();
        let w = tensor(&pseudo(VOCAB * DIM, 9, 1.0), [VOCAB, DIM], &ad).require_grad();
        let targets = targets();
        let (loss, stat) = match kd {
            None => {
                let out = match chunk {
                    Some(c) => linear_cross_entropy_chunked(h.clone(), w.clone(), &targets, 6.0, c),
                    None => linear_cross_entropy(h.clone(), w.clone(), &targets, 6.0),
                }
                .unwrap();
                (out.loss, out.stats.loss_sum)
            }
            Some((objective, top_k)) => {
                let teacher = if top_k {
                    Teacher::TopK {
                        indices: topk_indices(device),
                        values: tensor(&pseudo(ROWS * K, 10, 3.0), [ROWS, K], device),
                    }
                } else {
                    Teacher::Logits(tensor(
                        &pseudo(ROWS * VOCAB, 11, 3.0),
                        [ROWS, VOCAB],
                        device,
                    ))
                };
                let config = KdConfig {
                    objective,
                    ..KdConfig::default()
                };
                let ce = Some(LinearCe {
                    targets: &targets,
                    weight: 0.5,
                });
                let m = mask();
                let out = match chunk {
                    Some(c) => linear_kd_chunked(
                        h.clone(),
                        w.clone(),
                        teacher,
                        &m,
                        6.0,
                        &config,
                        0.8,
                        ce,
                        c,
                    ),
                    None => linear_kd(h.clone(), w.clone(), teacher, &m, 6.0, &config, 0.8, ce),
                }
                .unwrap();
                (out.loss, out.kd.loss_sum + out.ce.unwrap().loss_sum)
            }
        };
        let grads = loss.backward();
        (
            values(loss),
            stat,
            values(h.grad(&grads).unwrap()),
            values(w.grad(&grads).unwrap()),
        )
    };
    assert!(
        chunk_rows(VOCAB) >= ROWS,
        "the default chunk holds these rows"
    );
    let cases = [
        None,
        Some((KdObjective::ForwardKl, false)),
        Some((KdObjective::JsDivergence, true)),
        Some((KdObjective::AdaptiveKl, false)),
    ];
    for kd in cases {
        let (l_c, s_c, h_c, w_c) = run(&cpu(), kd, None);
        for chunk in [Some(4), None] {
            let (l_g, s_g, h_g, w_g) = run(gpu, kd, chunk);
            let what = format!("{kd:?} in chunks of {}", chunk.unwrap_or(ROWS));
            assert_rel(&format!("{what}: loss"), &l_g, &l_c, 1e-5);
            assert!(
                (s_g - s_c).abs() <= 1e-4 * s_c.abs().max(1.0),
                "{what}: stats"
            );
            assert_close(&format!("{what}: d hidden"), &h_g, &h_c, 1e-5);
            assert_close(&format!("{what}: d W"), &w_g, &w_c, 1e-5);
        }
    }
}

/// The chunked cross-entropy keeps no `[rows, vocab]` tensor for the backward pass: the
/// device memory in use after the forward pass grows by far less than the logits' size.
pub fn chunked_cross_entropy_keeps_no_logits(gpu: &Device) {
    let (rows, dim, vocab) = (512, 64, 8192);
    let logits_bytes = (rows * vocab * 4) as u64;
    let ad = gpu.clone().autodiff();
    let h = tensor(&pseudo(rows * dim, 12, 1.0), [rows, dim], &ad).require_grad();
    let w = tensor(&pseudo(vocab * dim, 13, 0.5), [vocab, dim], gpu);
    let targets: Vec<i64> = (0..rows).map(|r| (r * 31 % vocab) as i64).collect();
    gpu.sync().unwrap();
    let Some(before) = gpu.memory_pool_usage() else {
        println!("  this device does not report its memory: not measured");
        return;
    };
    let out = linear_cross_entropy_chunked(h.clone(), w, &targets, rows as f32, 64).unwrap();
    gpu.sync().unwrap();
    let after = gpu.memory_pool_usage().unwrap();
    let kept = after.bytes_in_use.saturating_sub(before.bytes_in_use);
    println!(
        "  kept after the forward pass: {:.2} MB (logits would be {:.1} MB; reserved {:.1} MB)",
        kept as f64 / 1e6,
        logits_bytes as f64 / 1e6,
        after.bytes_reserved as f64 / 1e6
    );
    assert!(kept < logits_bytes / 8, "kept {kept} bytes");
    let grads = out.loss.backward();
    assert_eq!(h.grad(&grads).unwrap().dims(), [rows, dim]);
    drop(grads);
    // The control: the unchunked formulation does keep the logits' size (or more).
    let w = tensor(&pseudo(vocab * dim, 13, 0.5), [vocab, dim], gpu);
    gpu.sync().unwrap();
    let before = gpu.memory_pool_usage().unwrap();
    let whole = cross_entropy(h.clone().matmul(w.transpose()), &targets, rows as f32).unwrap();
    gpu.sync().unwrap();
    let after = gpu.memory_pool_usage().unwrap();
    let kept_whole = after.bytes_in_use.saturating_sub(before.bytes_in_use);
    println!(
        "  the unchunked formulation keeps {:.2} MB",
        kept_whole as f64 / 1e6
    );
    assert!(
        kept_whole >= logits_bytes,
        "unchunked kept {kept_whole} bytes"
    );
    drop(whole);
}
