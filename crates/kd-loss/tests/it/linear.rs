//! `linear_cross_entropy` (LM head fused with the loss) equals `cross_entropy(hidden · Wᵀ)`:
//! loss, statistics and the gradients of the hidden states and of a trained head.

use burn::tensor::{Tensor, TensorData};
use kd_loss::{KernelPath, cross_entropy_with, linear_cross_entropy};

use crate::util::cpu;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
        })
        .collect()
}

fn flat(t: Tensor<2>) -> Vec<f32> {
    t.into_data().try_into_vec_as::<f32>().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

#[test]
fn fused_head_equals_logits_then_cross_entropy() {
    let (rows, dim, vocab) = (9, 16, 301);
    let targets: Vec<i64> = (0..rows as i64)
        .map(|r| {
            if r == 4 {
                -100
            } else {
                (r * 37) % vocab as i64
            }
        })
        .collect();
    let normalizer = 8.0;
    let device = cpu().autodiff();
    let run = |fused: bool| {
        let h =
            Tensor::<2>::from_data(TensorData::new(values(rows * dim, 1), [rows, dim]), &device)
                .require_grad();
        let w = Tensor::<2>::from_data(
            TensorData::new(values(vocab * dim, 2), [vocab, dim]),
            &device,
        )
        .require_grad();
        let out = if fused {
            linear_cross_entropy(h.clone(), w.clone(), &targets, normalizer).unwrap()
        } else {
            let logits = h.clone().matmul(w.clone().transpose());
            cross_entropy_with(logits, &targets, normalizer, KernelPath::Reference).unwrap()
        };
        // An upstream factor other than 1 reaches both gradients.
        let grads = (out.loss.clone() * 3.0).backward();
        let loss = out.loss.into_data().try_into_vec_as::<f32>().unwrap()[0];
        (
            loss,
            out.stats,
            flat(h.grad(&grads).expect("hidden gradient")),
            flat(w.grad(&grads).expect("weight gradient")),
        )
    };
    let (loss, stats, dh, dw) = run(true);
    let (ref_loss, ref_stats, ref_dh, ref_dw) = run(false);
    assert!(
        (loss - ref_loss).abs() <= 1e-5 * ref_loss.abs(),
        "{loss} vs {ref_loss}"
    );
    assert_eq!(stats.counted, ref_stats.counted);
    assert_eq!(stats.counted, rows - 1);
    assert!(
        max_diff(&dh, &ref_dh) <= 1e-6,
        "dh {}",
        max_diff(&dh, &ref_dh)
    );
    assert!(
        max_diff(&dw, &ref_dw) <= 1e-6,
        "dw {}",
        max_diff(&dw, &ref_dw)
    );
    // The ignored row gets no gradient.
    assert!(dh[4 * dim..5 * dim].iter().all(|g| *g == 0.0));
}

#[test]
fn frozen_head_and_plain_tensors() {
    let (rows, dim, vocab) = (5, 8, 64);
    let targets: Vec<i64> = (0..rows as i64).map(|r| r * 7).collect();
    let device = cpu();
    let h = Tensor::<2>::from_data(TensorData::new(values(rows * dim, 3), [rows, dim]), &device);
    let w = Tensor::<2>::from_data(
        TensorData::new(values(vocab * dim, 4), [vocab, dim]),
        &device,
    );
    let plain = linear_cross_entropy(h.clone(), w.clone(), &targets, 5.0).unwrap();
    let reference = cross_entropy_with(
        h.clone().matmul(w.clone().transpose()),
        &targets,
        5.0,
        KernelPath::Reference,
    )
    .unwrap();
    let (a, b) = (
        plain.loss.into_data().try_into_vec_as::<f32>().unwrap()[0],
        reference.loss.into_data().try_into_vec_as::<f32>().unwrap()[0],
    );
    assert!((a - b).abs() <= 1e-5 * b.abs(), "{a} vs {b}");
    // Autodiff with a frozen head: only the hidden states get a gradient.
    let ad = cpu().autodiff();
    let h = Tensor::<2>::from_data(h.into_data(), &ad).require_grad();
    let w = Tensor::<2>::from_data(w.into_data(), &ad);
    let grads = linear_cross_entropy(h.clone(), w.clone(), &targets, 5.0)
        .unwrap()
        .loss
        .backward();
    assert!(h.grad(&grads).is_some());
    assert!(w.grad(&grads).is_none());
}

#[test]
fn shape_and_target_errors_name_the_problem() {
    let device = cpu();
    let h = Tensor::<2>::zeros([2, 4], &device);
    let e = linear_cross_entropy(h.clone(), Tensor::zeros([10, 3], &device), &[0, 1], 2.0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("[10, 3]") && e.contains("[2, 4]"), "{e}");
    let e = linear_cross_entropy(h.clone(), Tensor::zeros([10, 4], &device), &[0], 2.0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("1 targets for 2 rows"), "{e}");
    let e = linear_cross_entropy(h, Tensor::zeros([10, 4], &device), &[0, 10], 2.0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("target 10 at row 1"), "{e}");
}
