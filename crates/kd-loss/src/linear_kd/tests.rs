use super::*;
use crate::config::KdObjective;

/// Blocks of rows give the numbers of one block (the dW accumulation, the reused gradient
/// buffer and masked rows included), with and without CE, full and top-k teachers.
#[test]
fn blocks_equal_one_block() {
    let (rows, dim, vocab, k) = (7, 5, 33, 4);
    let h: Vec<f32> = (0..rows * dim)
        .map(|i| ((i * 37 % 11) as f32 - 5.0) / 7.0)
        .collect();
    let w: Vec<f32> = (0..vocab * dim)
        .map(|i| ((i * 53 % 13) as f32 - 6.0) / 9.0)
        .collect();
    let t: Vec<f32> = (0..rows * vocab)
        .map(|i| ((i * 29 % 17) as f32 - 8.0) / 5.0)
        .collect();
    let indices: Vec<u32> = (0..rows * k).map(|i| ((i * 7) % vocab) as u32).collect();
    let values: Vec<f32> = (0..rows * k).map(|i| -((i % k) as f32)).collect();
    for objective in [KdObjective::ForwardKl, KdObjective::JsDivergence] {
        for with_ce in [false, true] {
            let job = LinearKdJob {
                kd: KdConfig {
                    logits_topk: 0,
                    ..KdConfig::new(objective)
                }
                .kernel_params(),
                mask: (0..rows).map(|r| r != 3).collect(),
                kd_scale: 0.5,
                targets: if with_ce {
                    (0..rows as i64)
                        .map(|r| if r == 5 { -100 } else { r * 4 })
                        .collect()
                } else {
                    Vec::new()
                },
                ce_scale: 0.25,
            };
            for teacher in [
                TeacherRows::Full(&t),
                TeacherRows::Sparse {
                    indices: &indices,
                    values: &values,
                    k,
                },
            ] {
                let dims = (rows, dim, vocab);
                let one = host_linear_kd(&h, &w, dims, teacher, &job, true, true, rows);
                assert_eq!(one.0.counted, 6);
                assert_eq!(one.1.counted, if with_ce { 6 } else { 0 });
                for block in [1, 2, 3] {
                    let b = host_linear_kd(&h, &w, dims, teacher, &job, true, true, block);
                    assert!((b.0.loss_sum - one.0.loss_sum).abs() < 1e-5);
                    assert!((b.1.loss_sum - one.1.loss_sum).abs() < 1e-5);
                    for (x, y) in [(&b.2, &one.2), (&b.3, &one.3)] {
                        let (x, y) = (x.as_ref().unwrap(), y.as_ref().unwrap());
                        let d = x.iter().zip(y).fold(0f32, |m, (a, c)| m.max((a - c).abs()));
                        assert!(d < 1e-6, "block {block}: {d}");
                    }
                    // Without gradients the statistics are the same.
                    let s = host_linear_kd(&h, &w, dims, teacher, &job, false, false, block);
                    assert!((s.0.loss_sum - one.0.loss_sum).abs() < 1e-5);
                    assert!((s.1.loss_sum - one.1.loss_sum).abs() < 1e-5);
                    assert!(s.2.is_none() && s.3.is_none());
                }
            }
        }
    }
}
