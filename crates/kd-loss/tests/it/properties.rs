//! Mathematical properties of the objectives, on both implementations, plus finite-difference
//! checks of the fused gradients.

use burn::tensor::{Distribution, Tensor};
use kd_loss::{KdConfig, KdObjective, KernelPath, Teacher, kd_loss_and_grad, kd_loss_with};

use crate::util::*;

const PATHS: [KernelPath; 2] = [KernelPath::Fused, KernelPath::Reference];

/// The device's generator is shared by the tests, which run in parallel threads: seeding and
/// drawing hold this lock, so that each draw comes from its own seed (without it, another
/// test's seed taken between them once gave a student equal to its teacher).
static DEVICE_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn logits(rows: usize, vocab: usize, seed: u64) -> Tensor<2> {
    let device = cpu();
    let _draw = DEVICE_RNG.lock().unwrap_or_else(|e| e.into_inner());
    device.seed(seed);
    Tensor::random([rows, vocab], Distribution::Normal(0.0, 2.0), &device)
}

fn full(objective: KdObjective) -> KdConfig {
    KdConfig {
        logits_topk: 0,
        ..KdConfig::new(objective)
    }
}

fn loss(
    s: &Tensor<2>,
    t: &Tensor<2>,
    cfg: &KdConfig,
    path: KernelPath,
) -> (f64, kd_loss::LossStats) {
    let rows = s.dims()[0];
    let out = kd_loss_with(
        s.clone(),
        Teacher::Logits(t.clone()),
        &vec![true; rows],
        rows as f32,
        cfg,
        path,
    )
    .unwrap();
    (scalar(out.loss), out.stats)
}

#[test]
fn divergences_are_nonnegative_and_zero_at_equality() {
    let s = logits(6, 50, 1);
    let t = logits(6, 50, 2);
    for path in PATHS {
        for obj in KdObjective::ALL {
            let cfg = KdConfig {
                kd_temperature: 1.5,
                ..full(obj)
            };
            let (l, _) = loss(&s, &t, &cfg, path);
            assert!(l > 0.0, "{obj:?} {path:?}: {l}");
            let (same, stats) = loss(&s, &s, &cfg, path);
            assert!(same.abs() < 1e-6, "{obj:?} {path:?}: {same} at p = q");
            assert!((stats.acceptance_rate() - 1.0).abs() < 1e-5);
            assert_eq!(stats.top1_agreement(), 1.0);
        }
    }
}

#[test]
fn skew_to_zero_gives_kl() {
    let s = logits(5, 40, 3);
    let t = logits(5, 40, 4);
    for path in PATHS {
        let (fkl, _) = loss(&s, &t, &full(KdObjective::ForwardKl), path);
        let (rkl, _) = loss(&s, &t, &full(KdObjective::ReverseKl), path);
        for lam in [0.0f32, 1e-6] {
            let sf = KdConfig {
                skew_lambda: lam,
                ..full(KdObjective::SkewedForwardKl)
            };
            let sr = KdConfig {
                skew_lambda: lam,
                ..full(KdObjective::SkewedReverseKl)
            };
            assert!(
                close(loss(&s, &t, &sf, path).0, fkl, 1e-4, 1e-6),
                "{path:?} λ={lam}"
            );
            assert!(
                close(loss(&s, &t, &sr, path).0, rkl, 1e-4, 1e-6),
                "{path:?} λ={lam}"
            );
        }
        // Skewing shrinks the divergence.
        let sf = KdConfig {
            skew_lambda: 0.5,
            ..full(KdObjective::SkewedForwardKl)
        };
        assert!(loss(&s, &t, &sf, path).0 < fkl);
    }
}

#[test]
fn adaptive_kl_weights_sum_to_one() {
    // With per-row weights summing to one, each row's AKL lies between its FKL and RKL; on a
    // single row that bounds the loss. α = 0 leaves the tail empty: AKL = FKL.
    for seed in 0..4 {
        let s = logits(1, 64, 10 + seed);
        let t = logits(1, 64, 20 + seed);
        for path in PATHS {
            let (fkl, _) = loss(&s, &t, &full(KdObjective::ForwardKl), path);
            let (rkl, _) = loss(&s, &t, &full(KdObjective::ReverseKl), path);
            let (akl, _) = loss(&s, &t, &full(KdObjective::AdaptiveKl), path);
            let (lo, hi) = (fkl.min(rkl), fkl.max(rkl));
            assert!(
                akl >= lo - 1e-6 && akl <= hi + 1e-6,
                "{path:?}: {akl} not in [{lo}, {hi}]"
            );
            let a0 = KdConfig {
                adaptive_kl_alpha: 0.0,
                ..full(KdObjective::AdaptiveKl)
            };
            assert!(
                close(loss(&s, &t, &a0, path).0, fkl, 1e-5, 1e-7),
                "{path:?} α = 0"
            );
        }
    }
}

#[test]
fn js_is_symmetric_and_tv_is_one_minus_overlap() {
    let s = logits(7, 33, 5);
    let t = logits(7, 33, 6);
    for path in PATHS {
        let js = full(KdObjective::JsDivergence);
        let (a, _) = loss(&s, &t, &js, path);
        let (b, _) = loss(&t, &s, &js, path);
        assert!(close(a, b, 1e-5, 1e-7), "{path:?}: {a} vs {b}");
        assert!(a <= std::f64::consts::LN_2);
        let (tv, stats) = loss(&s, &t, &full(KdObjective::TvDistance), path);
        let overlap = stats.acceptance_rate();
        assert!(
            close(tv, 1.0 - overlap, 1e-5, 1e-6),
            "{path:?}: TV {tv} vs 1 − Σmin {}",
            1.0 - overlap
        );
    }
}

#[test]
fn fused_gradients_pass_finite_differences() {
    // Central differences in f64 on the loss the kernel reports, tiny shapes.
    let (rows, vocab) = (3, 12);
    let s = logits(rows, vocab, 7);
    let t = logits(rows, vocab, 8);
    let base: Vec<f32> = vec_f32(s.clone());
    let mask = [true, false, true];
    // Adaptive KL is left out: its weights are constants by definition (no gradient flows
    // through them), so its gradient is not the derivative of its value.
    for obj in KdObjective::ALL
        .into_iter()
        .filter(|o| *o != KdObjective::AdaptiveKl)
    {
        for topk in [0, 5] {
            let cfg = KdConfig {
                logits_topk: topk,
                kd_temperature: 1.3,
                ..KdConfig::new(obj)
            };
            let at = |v: &[f32]| {
                let x = Tensor::<2>::from_data(
                    burn::tensor::TensorData::new(v.to_vec(), [rows, vocab]),
                    &cpu(),
                );
                kd_loss_and_grad(x, Teacher::Logits(t.clone()), &mask, 2.0, &cfg).unwrap()
            };
            let (_, grad, _) = at(&base);
            let grad = vec_f32(grad);
            let h = 1e-2f32;
            for i in [0, 5, 11, 26, 30, 35] {
                let mut up = base.clone();
                up[i] += h;
                let mut down = base.clone();
                down[i] -= h;
                let fd = (at(&up).0 as f64 - at(&down).0 as f64) / (2.0 * h as f64);
                assert!(
                    (fd - grad[i] as f64).abs()
                        <= 2e-3 * grad.iter().fold(0f32, |m, g| m.max(g.abs())) as f64 + 2e-4,
                    "{obj:?} topk={topk} [{i}]: fd {fd} vs analytic {}",
                    grad[i]
                );
            }
            // Masked row 1 gets no gradient.
            assert!(grad[vocab..2 * vocab].iter().all(|g| *g == 0.0));
        }
    }
}

#[test]
fn bad_inputs_are_clear_errors() {
    let s = logits(2, 8, 1);
    let cfg = full(KdObjective::ForwardKl);
    let e = kd_loss_with(
        s.clone(),
        Teacher::Logits(logits(2, 9, 2)),
        &[true; 2],
        2.0,
        &cfg,
        KernelPath::Auto,
    )
    .unwrap_err();
    assert!(e.to_string().contains("vocabularies"), "{e}");
    let e = kd_loss_with(
        s.clone(),
        Teacher::Logits(logits(2, 8, 2)),
        &[true; 3],
        2.0,
        &cfg,
        KernelPath::Auto,
    )
    .unwrap_err();
    assert!(e.to_string().contains("mask has 3"), "{e}");
    let e = kd_loss_with(
        s.clone(),
        Teacher::Logits(logits(2, 8, 2)),
        &[true; 2],
        0.0,
        &cfg,
        KernelPath::Auto,
    )
    .unwrap_err();
    assert!(e.to_string().contains("normaliser"), "{e}");
    let e = kd_loss::cross_entropy(s, &[3, 8], 1.0).unwrap_err();
    assert!(e.to_string().contains("target 8 at row 1"), "{e}");
}
