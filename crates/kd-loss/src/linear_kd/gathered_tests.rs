use super::*;
use crate::config::KdObjective;

/// The gathered top-k path equals the blocked GEMM path: statistics, d hidden and the
/// scattered dW (a masked row included).
#[test]
fn gathered_equals_blocked() {
    let (rows, dim, vocab, k) = (6, 8, 40, 5);
    let h: Vec<f32> = (0..rows * dim)
        .map(|i| ((i * 31 % 13) as f32 - 6.0) / 6.0)
        .collect();
    let w: Vec<f32> = (0..vocab * dim)
        .map(|i| ((i * 17 % 11) as f32 - 5.0) / 8.0)
        .collect();
    // Distinct within each row, as a teacher's top-k are.
    let indices: Vec<u32> = (0..rows * k).map(|i| ((i * 13) % vocab) as u32).collect();
    let values: Vec<f32> = (0..rows * k)
        .map(|i| ((i % 7) as f32 - 3.0) / 2.0)
        .collect();
    let teacher = TeacherRows::Sparse {
        indices: &indices,
        values: &values,
        k,
    };
    for objective in KdObjective::ALL {
        let job = LinearKdJob {
            kd: KdConfig {
                logits_topk: k,
                kd_temperature: 1.5,
                ..KdConfig::new(objective)
            }
            .kernel_params(),
            mask: (0..rows).map(|r| r != 2).collect(),
            kd_scale: 0.3,
            targets: Vec::new(),
            ce_scale: 0.0,
        };
        let dims = (rows, dim, vocab);
        let a = host_gathered_kd(&h, &w, dims, (&indices, &values, k), &job, true, true);
        let b = host_blocked_kd(&h, &w, dims, teacher, &job, true, true, 4);
        assert_eq!(a.0.counted, b.0.counted);
        assert!((a.0.loss_sum - b.0.loss_sum).abs() < 1e-5, "{objective:?}");
        assert!((a.0.acceptance_sum - b.0.acceptance_sum).abs() < 1e-5);
        assert_eq!(a.0.top1, b.0.top1);
        for (x, y) in [(&a.2, &b.2), (&a.3, &b.3)] {
            let (x, y) = (x.as_ref().unwrap(), y.as_ref().unwrap());
            let d = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            assert!(d < 1e-5, "{objective:?}: {d}");
        }
    }
}
