//! Every case of fixtures/golden/kd-losses.* through both implementations: loss value and
//! gradient w.r.t. the student logits equal PyTorch's (float64) to ≤ 1e-5 relative.

use burn::tensor::Tensor;
use kd_loss::{
    HiddenProjection, KdConfig, KdObjective, KernelPath, SparseStudent, Teacher,
    cross_entropy_with, hidden_mse, kd_loss_with, next_token_targets,
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
    let same = hidden_mse(a.clone(), a, None, &[true, true], 2.0).unwrap();
    assert_eq!(scalar(same), 0.0);
}
