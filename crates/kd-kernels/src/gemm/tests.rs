use super::*;

fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
        }
    }
    c
}

#[test]
fn products_transposes_and_accumulation() {
    let (m, k, n) = (5, 7, 3);
    let a: Vec<f32> = (0..m * k).map(|i| (i % 11) as f32 - 5.0).collect();
    let b: Vec<f32> = (0..k * n).map(|i| (i % 7) as f32 * 0.5).collect();
    let want = naive(&a, &b, m, k, n);
    let mut c = vec![1f32; m * n];
    matmul(
        MatMut::row_major(&mut c, m, n).unwrap(),
        MatRef::row_major(&a, m, k).unwrap(),
        MatRef::row_major(&b, k, n).unwrap(),
        Write::Overwrite,
        1.0,
        Threads::One,
    )
    .unwrap();
    assert_eq!(c, want);
    // bᵀ stored row-major, read back through a transposed view; accumulate twice alpha.
    let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
    matmul(
        MatMut::row_major(&mut c, m, n).unwrap(),
        MatRef::row_major(&a, m, k).unwrap(),
        MatRef::row_major(&bt, n, k).unwrap().t(),
        Write::Accumulate,
        2.0,
        Threads::All,
    )
    .unwrap();
    assert!(c.iter().zip(&want).all(|(c, w)| *c == 3.0 * w));
    let mut v = Vec::new();
    matmul_into(
        &mut v,
        MatRef::row_major(&a, m, k).unwrap(),
        MatRef::row_major(&b, k, n).unwrap(),
        1.0,
        Threads::Auto,
    )
    .unwrap();
    assert_eq!(v, want);
}

#[test]
fn views_past_their_slice_and_unchained_shapes_are_errors() {
    let a = [0f32; 12];
    assert!(matches!(
        MatRef::row_major(&a, 4, 4),
        Err(KernelError::OutOfBounds {
            needed: 16,
            len: 12,
            ..
        })
    ));
    // A strided view reaching one past the end.
    assert!(MatRef::new(&a, 3, 2, 6, 1).is_err());
    // Strides whose extent overflows (or that do not fit an isize) are refused.
    assert!(MatRef::new(&a, 3, 1, 1 << 63, 1).is_err());
    assert!(MatRef::new(&a, 1, 1, usize::MAX, 1).is_err());
    assert!(MatMut::rows(&mut [0f32; 4], 2, 1, usize::MAX / 2 + 2).is_err());
    assert!(MatRef::new(&a, 3, 2, 5, 1).is_ok());
    let mut c = [0f32; 12];
    assert!(matches!(
        MatMut::rows(&mut c, 3, 4, 3),
        Err(KernelError::OverlappingRows { .. })
    ));
    let e = matmul(
        MatMut::row_major(&mut c, 3, 4).unwrap(),
        MatRef::row_major(&a, 3, 4).unwrap(),
        MatRef::row_major(&a, 3, 4).unwrap(),
        Write::Overwrite,
        1.0,
        Threads::One,
    )
    .unwrap_err();
    assert_eq!(e.to_string(), "cannot multiply [3, 4] · [3, 4] into [3, 4]");
}

#[test]
fn every_level_is_within_the_rounding_bound() {
    // |ĉ − c| ≤ γ_n Σ|terms| with γ_n = n·u/(1 − n·u), u = 2⁻²⁴, for any summation order
    // (Higham, Accuracy and Stability, §3.5); c in f64. Shapes cross the microkernels'
    // edges and the k-blocking (kc ≥ 512), strided and transposed operands included.
    let u = 2f64.powi(-24);
    for level in crate::cpu::supported() {
        for &(m, k, n) in &[
            (1, 1, 1),
            (5, 7, 3),
            (33, 130, 17),
            (64, 700, 96),
            (3, 1500, 200),
            (5, 40_000, 7),
        ] {
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 97.0)
                .collect();
            let bt: Vec<f32> = (0..n * k)
                .map(|i| ((i * 104_729 % 997) as f32 - 498.0) / 89.0)
                .collect();
            let mut c = vec![0.5f32; m * n];
            matmul_at(
                level,
                MatMut::row_major(&mut c, m, n).unwrap(),
                MatRef::row_major(&a, m, k).unwrap(),
                MatRef::row_major(&bt, n, k).unwrap().t(),
                Write::Accumulate,
                0.75,
                Threads::All,
            )
            .unwrap();
            // k products, the scaling by alpha, one addition per k-block into dst and,
            // for a long k (the last shape), the sum of up to 16 parts: counted as
            // k + 20 terms of |alpha|·Σ|a||b| + |dst|.
            let kk = (k + 20) as f64;
            let gamma = kk * u / (1.0 - kk * u);
            for i in 0..m {
                for j in 0..n {
                    let (mut want, mut mag) = (0f64, 0f64);
                    for p in 0..k {
                        let x = a[i * k + p] as f64 * bt[j * k + p] as f64;
                        want += x;
                        mag += x.abs();
                    }
                    let want = 0.5 + 0.75 * want;
                    let got = c[i * n + j] as f64;
                    let bound = gamma * (0.75 * mag + 0.5);
                    assert!(
                        (got - want).abs() <= bound,
                        "{level} [{m}, {k}]·[{k}, {n}] at ({i}, {j}): {got} vs {want} (bound {bound:e})"
                    );
                }
            }
        }
    }
}
