//! Every case of fixtures/golden/kd-losses.* through both implementations: loss value and
//! gradient w.r.t. the student logits equal PyTorch's (float64) to ≤ 1e-5 relative.

use burn::tensor::{Tensor, TensorData};
use kd_loss::{
    HiddenProjection, KdConfig, KdObjective, KernelPath, LinearCe, SparseStudent, Teacher,
    cross_entropy_with, hidden_mse, kd_loss_with, linear_kd, next_token_targets,
};
use serde_json::Value;

use crate::util::*;

const RTOL: f64 = 1e-5;

fn objective(name: &str) -> KdObjective {
    serde_json::from_value(Value::String(name.to_string())).unwrap()
}

fn config(case: &Value) -> KdConfig {
    KdConfig {
        objective: objective(case["objective"].as_str().unwrap()),
        kd_temperature: case["tau"].as_f64().unwrap() as f32,
        teacher_temperature: case["tau_T"].as_f64().unwrap() as f32,
        skew_lambda: case["lam"].as_f64().unwrap() as f32,
        adaptive_kl_alpha: case["alpha_A"].as_f64().unwrap() as f32,
        logits_topk: case["topk"].as_u64().unwrap() as usize,
        sparse_student: match case["student_mode"].as_str().unwrap() {
            "renormalized" => SparseStudent::Renormalized,
            "full_logsumexp" => SparseStudent::FullLogsumexp,
            other => panic!("{other}"),
        },
        scale_by_temperature_squared: case["scale_by_temperature_squared"].as_bool().unwrap(),
    }
}

/// Runs one KD case through `path` with autodiff; returns (loss, grad, stats).
fn run_kd(
    case: &Value,
    g: &std::collections::HashMap<String, Arr>,
    path: KernelPath,
    sparse_teacher: bool,
) -> (f64, Vec<f32>, kd_loss::LossStats) {
    let p = case["prefix"].as_str().unwrap();
    let device = cpu().autodiff();
    let student = t2(&g[&format!("{p}student")], &device).require_grad();
    let teacher_full = t2(&g[&format!("{p}teacher")], &device);
    let mask: Vec<bool> = g[&format!("{p}mask")].i.iter().map(|m| *m != 0).collect();
    let n = g[&format!("{p}N")].i[0] as f32;
    let cfg = config(case);
    let teacher = if sparse_teacher {
        // The teacher as a server returns it: top-k indices and values.
        let k = cfg.logits_topk;
        let (values, indices) = teacher_full.topk_with_indices(k, 1);
        Teacher::TopK { indices, values }
    } else {
        Teacher::Logits(teacher_full)
    };
    let out = kd_loss_with(student.clone(), teacher, &mask, n, &cfg, path).unwrap();
    let loss = scalar(out.loss.clone());
    let grads = out.loss.backward();
    let grad = vec_f32(student.grad(&grads).unwrap());
    (loss, grad, out.stats)
}

#[test]
fn kd_cases_match_pytorch_on_both_paths() {
    let (cases, g) = golden();
    let mut checked = 0;
    for case in cases.iter().filter(|c| c["kind"] == "kd") {
        let name = case["name"].as_str().unwrap();
        let p = case["prefix"].as_str().unwrap();
        let want_loss = g[&format!("{p}loss")].f[0];
        let want_grad = &g[&format!("{p}grad")].f;
        let acceptance: f64 = g[&format!("{p}acceptance")].f.iter().sum();
        let top1: i64 = g[&format!("{p}top1")].i.iter().sum();
        let nonfinite = g[&format!("{p}nonfinite")].i[0] as usize;
        let topk = case["topk"].as_u64().unwrap() > 0;
        for (path, sparse) in [
            (KernelPath::Fused, false),
            (KernelPath::Reference, false),
            (KernelPath::Fused, true),
            (KernelPath::Reference, true),
        ] {
            if sparse && !topk {
                continue;
            }
            let (loss, grad, stats) = run_kd(case, &g, path, sparse);
            let what = format!("{name} {path:?} sparse={sparse}");
            assert!(
                close(loss, want_loss, RTOL, 1e-7),
                "{what}: loss {loss} vs {want_loss}"
            );
            let e = max_rel(&grad, want_grad);
            assert!(e <= RTOL, "{what}: gradient max rel err {e:.2e}");
            assert_eq!(stats.nonfinite_positions, nonfinite, "{what}");
            assert!(
                close(stats.acceptance_sum, acceptance, 1e-5, 1e-6),
                "{what}: acceptance {} vs {acceptance}",
                stats.acceptance_sum
            );
            assert_eq!(stats.top1_matches as i64, top1, "{what}: top1");
            checked += 1;
        }
    }
    assert!(checked >= 60, "only {checked} runs");
}

/// `linear_kd` on every KD case, with the case's student logits written as an LM head:
/// hidden = I (R × R) and W = studentᵀ ([V, R]), so hidden · Wᵀ is the student's logits. Then
/// PyTorch's loss is the loss, dW = PyTorch's d loss / d logits transposed, and
/// d hidden = (d loss / d logits) · W.
#[test]
fn linear_kd_matches_pytorch_through_an_identity_head() {
    let (cases, g) = golden();
    let mut checked = 0;
    for case in cases.iter().filter(|c| c["kind"] == "kd") {
        let name = case["name"].as_str().unwrap();
        let p = case["prefix"].as_str().unwrap();
        let student = &g[&format!("{p}student")];
        let (rows, vocab) = (student.shape[0], student.shape[1]);
        let want_loss = g[&format!("{p}loss")].f[0];
        let want_grad = &g[&format!("{p}grad")].f;
        let top1: i64 = g[&format!("{p}top1")].i.iter().sum();
        let topk = case["topk"].as_u64().unwrap() > 0;
        // A head cannot hold −∞ / NaN logits (0 · ∞ in the product): those cases test the
        // row kernels, which linear_kd shares with kd_loss.
        if student.f.iter().any(|v| !v.is_finite()) {
            continue;
        }
        for sparse in [false, true] {
            if sparse && !topk {
                continue;
            }
            let device = cpu().autodiff();
            let mut eye = vec![0f32; rows * rows];
            for r in 0..rows {
                eye[r * rows + r] = 1.0;
            }
            let hidden =
                Tensor::<2>::from_data(burn::tensor::TensorData::new(eye, [rows, rows]), &device)
                    .require_grad();
            let w = t2(student, &device).transpose().require_grad();
            let teacher_full = t2(&g[&format!("{p}teacher")], &device);
            let mask: Vec<bool> = g[&format!("{p}mask")].i.iter().map(|m| *m != 0).collect();
            let n = g[&format!("{p}N")].i[0] as f32;
            let cfg = config(case);
            let teacher = if sparse {
                let (values, indices) = teacher_full.topk_with_indices(cfg.logits_topk, 1);
                Teacher::TopK { indices, values }
            } else {
                Teacher::Logits(teacher_full)
            };
            let out = linear_kd(
                hidden.clone(),
                w.clone(),
                teacher,
                &mask,
                n,
                &cfg,
                1.0,
                None,
            )
            .unwrap();
            let what = format!("{name} sparse={sparse}");
            let loss = scalar(out.loss.clone());
            assert!(
                close(loss, want_loss, RTOL, 1e-7),
                "{what}: loss {loss} vs {want_loss}"
            );
            assert_eq!(out.kd.top1_matches as i64, top1, "{what}");
            let grads = out.loss.backward();
            let dw = vec_f32(w.grad(&grads).unwrap());
            let want_dw: Vec<f64> = (0..vocab)
                .flat_map(|v| (0..rows).map(move |r| (v, r)))
                .map(|(v, r)| want_grad[r * vocab + v])
                .collect();
            let e = max_rel(&dw, &want_dw);
            assert!(e <= RTOL, "{what}: dW max rel err {e:.2e}");
            let dh = vec_f32(hidden.grad(&grads).unwrap());
            let want_dh: Vec<f64> = (0..rows)
                .flat_map(|r| (0..rows).map(move |c| (r, c)))
                .map(|(r, c)| {
                    (0..vocab)
                        .map(|v| want_grad[r * vocab + v] * student.f[c * vocab + v])
                        .sum()
                })
                .collect();
            let e = max_rel(&dh, &want_dh);
            assert!(e <= 1e-4, "{what}: d hidden max rel err {e:.2e}");
            checked += 1;
        }
    }
    assert!(checked >= 30, "only {checked} runs");
}

/// `linear_kd` with the CE term equals the reference path's KD + CE on the same logits.
#[test]
fn linear_kd_with_cross_entropy_equals_the_sum_of_both_terms() {
    let (cases, g) = golden();
    for case in cases.iter().filter(|c| c["kind"] == "kd").take(8) {
        let p = case["prefix"].as_str().unwrap();
        let student = &g[&format!("{p}student")];
        if student.f.iter().any(|v| !v.is_finite()) {
            continue;
        }
        let (rows, vocab) = (student.shape[0], student.shape[1]);
        let mask: Vec<bool> = g[&format!("{p}mask")].i.iter().map(|m| *m != 0).collect();
        let targets: Vec<i64> = (0..rows)
            .map(|r| {
                if mask[r] {
                    ((r * 7) % vocab) as i64
                } else {
                    -100
                }
            })
            .collect();
        let n = g[&format!("{p}N")].i[0] as f32;
        let cfg = config(case);
        let device = cpu().autodiff();
        let mut eye = vec![0f32; rows * rows];
        for r in 0..rows {
            eye[r * rows + r] = 1.0;
        }
        let hidden =
            Tensor::<2>::from_data(burn::tensor::TensorData::new(eye, [rows, rows]), &device);
        let w = t2(student, &device).transpose().require_grad();
        let teacher = || Teacher::Logits(t2(&g[&format!("{p}teacher")], &device));
        let fused = linear_kd(
            hidden,
            w.clone(),
            teacher(),
            &mask,
            n,
            &cfg,
            0.7,
            Some(LinearCe {
                targets: &targets,
                weight: 0.3,
            }),
        )
        .unwrap();
        let fused_loss = scalar(fused.loss.clone());
        let dw = vec_f32(fused.loss.backward().pipe(|g| w.grad(&g).unwrap()));

        let logits = t2(student, &device).require_grad();
        let kd = kd_loss_with(
            logits.clone(),
            teacher(),
            &mask,
            n,
            &cfg,
            KernelPath::Reference,
        )
        .unwrap();
        let ce = cross_entropy_with(logits.clone(), &targets, n, KernelPath::Reference).unwrap();
        let total = kd.loss * 0.7 + ce.loss * 0.3;
        let want_loss = scalar(total.clone());
        let want: Vec<f64> = vec_f32(logits.grad(&total.backward()).unwrap().transpose())
            .into_iter()
            .map(f64::from)
            .collect();
        assert!(
            close(fused_loss, want_loss, 1e-5, 1e-7),
            "{fused_loss} vs {want_loss}"
        );
        let e = max_rel(&dw, &want);
        assert!(e <= 1e-5, "dW max rel err {e:.2e}");
        let ce_stats = fused.ce.unwrap();
        assert_eq!(ce_stats.counted, mask.iter().filter(|m| **m).count());
        assert!(close(ce_stats.loss_sum, ce.stats.loss_sum, 1e-5, 1e-6));
    }
}

trait Pipe: Sized {
    fn pipe<T>(self, f: impl FnOnce(Self) -> T) -> T {
        f(self)
    }
}
impl<T> Pipe for T {}

#[test]
fn cross_entropy_matches_pytorch() {
    let (cases, g) = golden();
    for case in cases.iter().filter(|c| c["kind"] == "ce") {
        let p = case["prefix"].as_str().unwrap();
        let targets = &g[&format!("{p}targets")].i;
        let n = g[&format!("{p}N")].i[0] as f32;
        for path in [KernelPath::Fused, KernelPath::Reference] {
            let device = cpu().autodiff();
            let logits = t2(&g[&format!("{p}logits")], &device).require_grad();
            let out = cross_entropy_with(logits.clone(), targets, n, path).unwrap();
            let loss = scalar(out.loss.clone());
            let want = g[&format!("{p}loss")].f[0];
            assert!(
                close(loss, want, RTOL, 1e-7),
                "{p} {path:?}: {loss} vs {want}"
            );
            let grads = out.loss.backward();
            let e = max_rel(
                &vec_f32(logits.grad(&grads).unwrap()),
                &g[&format!("{p}grad")].f,
            );
            assert!(e <= RTOL, "{p} {path:?}: gradient max rel err {e:.2e}");
        }
    }
}

#[test]
fn shifted_layout_matches_pytorch() {
    let (cases, g) = golden();
    let case = cases.iter().find(|c| c["kind"] == "shifted").unwrap();
    let p = case["prefix"].as_str().unwrap();
    let (b, s, v) = (
        case["batch"].as_u64().unwrap() as usize,
        case["seq"].as_u64().unwrap() as usize,
        case["vocab"].as_u64().unwrap() as usize,
    );
    let labels = &g[&format!("{p}labels")].i;
    let shifted = next_token_targets(labels, b, s);
    assert_eq!(shifted.count as i64, g[&format!("{p}N")].i[0]);
    let n = shifted.count as f32;
    let cfg = KdConfig {
        logits_topk: 0,
        ..config(case)
    };
    for path in [KernelPath::Fused, KernelPath::Reference] {
        let device = cpu().autodiff();
        let flat = |key: &str| {
            let a = &g[&format!("{p}{key}")];
            Tensor::<2>::from_data(burn::tensor::TensorData::new(a.f32s(), [b * s, v]), &device)
        };
        let logits = flat("logits").require_grad();
        let ce = cross_entropy_with(logits.clone(), &shifted.targets, n, path).unwrap();
        let kd = kd_loss_with(
            logits.clone(),
            Teacher::Logits(flat("teacher_logits")),
            &shifted.mask,
            n,
            &cfg,
            path,
        )
        .unwrap();
        assert!(
            close(
                scalar(ce.loss.clone()),
                g[&format!("{p}ce_loss")].f[0],
                RTOL,
                1e-7
            ),
            "{path:?} ce"
        );
        assert!(
            close(
                scalar(kd.loss.clone()),
                g[&format!("{p}kd_loss")].f[0],
                RTOL,
                1e-7
            ),
            "{path:?} kd"
        );
        let ce_grad = vec_f32(logits.grad(&ce.loss.backward()).unwrap());
        let kd_grad = vec_f32(logits.grad(&kd.loss.backward()).unwrap());
        // PyTorch's gradients are [b, s, v] with zeros at the last position.
        assert!(
            max_rel(&ce_grad, &g[&format!("{p}ce_grad")].f) <= RTOL,
            "{path:?} ce grad"
        );
        assert!(
            max_rel(&kd_grad, &g[&format!("{p}kd_grad")].f) <= RTOL,
            "{path:?} kd grad"
        );
    }
}

#[test]
fn hidden_mse_matches_pytorch() {
    let (cases, g) = golden();
    for case in cases.iter().filter(|c| c["kind"] == "hidden_mse") {
        let p = case["prefix"].as_str().unwrap();
        let device = cpu().autodiff();
        let hs = t2(&g[&format!("{p}h_S")], &device).require_grad();
        let ht = t2(&g[&format!("{p}h_T")], &device);
        let pw = &g[&format!("{p}P")];
        let proj =
            HiddenProjection::from_torch_weight(pw.f32s(), pw.shape[0], pw.shape[1], &device)
                .unwrap();
        let mask: Vec<bool> = g[&format!("{p}mask")].i.iter().map(|m| *m != 0).collect();
        let n = g[&format!("{p}N")].i[0] as f32;
        let loss = hidden_mse(hs.clone(), ht, Some(&proj), &mask, n).unwrap();
        assert!(
            close(
                scalar(loss.clone()),
                g[&format!("{p}loss")].f[0],
                RTOL,
                1e-7
            ),
            "{p}"
        );
        let grads = loss.backward();
        assert!(
            max_rel(
                &vec_f32(hs.grad(&grads).unwrap()),
                &g[&format!("{p}grad_h_S")].f
            ) <= RTOL,
            "{p} grad h_S"
        );
        // Burn stores the projection [d_S, d_T]; PyTorch [d_T, d_S].
        let gp = vec_f32(proj.proj.weight.val().grad(&grads).unwrap().transpose());
        assert!(
            max_rel(&gp, &g[&format!("{p}grad_P")].f) <= RTOL,
            "{p} grad P"
        );
    }
}

#[test]
fn hidden_mse_without_projection_needs_equal_widths() {
    let device = cpu();
    let a = Tensor::<2>::zeros([2, 4], &device);
    let b = Tensor::<2>::zeros([2, 6], &device);
    let e = hidden_mse(a.clone(), b, None, &[true, true], 2.0)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("student 4, teacher 6") && e.contains("projection"),
        "{e}"
    );
    // Equal widths: Σ_counted Σ_j (h_S − h_T)² / (N · d) and its gradient 2 (h_S − h_T) /
    // (N · d) on counted rows (0 elsewhere), from the contract's formula in f64.
    let (rows, d, n) = (5usize, 6usize, 7.0f64);
    let hs: Vec<f32> = (0..rows * d)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
        .collect();
    let ht: Vec<f32> = (0..rows * d)
        .map(|i| ((i * 53 % 29) as f32 - 14.0) / 9.0)
        .collect();
    let mask = [true, false, true, true, false];
    let mut want = 0.0f64;
    let mut want_grad = vec![0.0f64; rows * d];
    for r in (0..rows).filter(|r| mask[*r]) {
        for j in 0..d {
            let diff = f64::from(hs[r * d + j]) - f64::from(ht[r * d + j]);
            want += diff * diff / (n * d as f64);
            want_grad[r * d + j] = 2.0 * diff / (n * d as f64);
        }
    }
    let ad = cpu().autodiff();
    let student = Tensor::<2>::from_data(TensorData::new(hs, [rows, d]), &ad).require_grad();
    let teacher = Tensor::<2>::from_data(TensorData::new(ht, [rows, d]), &ad);
    let loss = hidden_mse(student.clone(), teacher, None, &mask, n as f32).unwrap();
    assert!(close(scalar(loss.clone()), want, 1e-6, 1e-9), "{want}");
    let grads = loss.backward();
    assert!(max_rel(&vec_f32(student.grad(&grads).unwrap()), &want_grad) <= 1e-6);
}
