//! The packed kernels against dequantised products, across kernels, batch sizes and
//! activation types.

use super::*;

/// A linear congruential generator's high bits.
fn lcg(seed: u64) -> impl FnMut() -> u32 {
    let mut state = seed;
    move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as u32
    }
}

/// Random `[rows, cols]` blocks of `ty` with finite scales (and Q4_1 minimums), and a
/// random input `[n, cols]` in [-1, 1).
fn random_case(
    ty: GgmlType,
    (rows, cols, n): (usize, usize, usize),
    next: &mut impl FnMut() -> u32,
) -> (Vec<u8>, Vec<f32>) {
    let size = ty.block().unwrap().1;
    let mut bytes = vec![0u8; rows * cols / 32 * size];
    for b in bytes.iter_mut() {
        *b = next() as u8;
    }
    for blk in bytes.chunks_exact_mut(size) {
        let scale = f16::from_f32((next() % 1000) as f32 / 1000.0 * 0.1 - 0.05);
        blk[..2].copy_from_slice(&scale.to_le_bytes());
        if ty == GgmlType::Q4_1 {
            let m = f16::from_f32((next() % 1000) as f32 / 1000.0 * 0.2 - 0.1);
            blk[2..4].copy_from_slice(&m.to_le_bytes());
        }
    }
    let x = (0..n * cols)
        .map(|_| (next() % 2000) as f32 / 1000.0 - 1.0)
        .collect();
    (bytes, x)
}

/// Random blocks with finite scales; the packed product against the dequantised f32
/// matrix, and the scalar kernel against the AVX2 one bit for bit.
#[test]
fn packed_products_equal_the_dequantised_ones() {
    let mut next = lcg(11);
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1] {
        let (rows, cols, n) = (70, 96, 5);
        let (bytes, x) = random_case(ty, (rows, cols, n), &mut next);
        let p = PackedMatrix::new(ty, rows, cols, &bytes).unwrap();
        let got = p.matmul_t(&x, n);
        let mut w = vec![0f32; rows * cols];
        kd_gguf::dequantize(ty, &bytes, &mut w).unwrap();
        for r in 0..n {
            for j in 0..rows {
                let want: f64 = (0..cols)
                    .map(|i| x[r * cols + i] as f64 * w[j * cols + i] as f64)
                    .sum();
                let g = got[r * rows + j] as f64;
                assert!(
                    (g - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{ty:?} {r} {j}"
                );
            }
        }
        // Every kernel this CPU has gives the scalar kernel's bits.
        let scalar = p.matmul_t_with(&x, n, Kernel::Scalar);
        for k in Kernel::available() {
            assert_eq!(p.matmul_t_with(&x, n, k), scalar, "{ty:?}: {k:?} vs scalar");
        }
        assert_eq!(got, scalar, "{ty:?}: the detected kernel");
    }
}

/// Every kernel gives each input row the bits it gives that row alone, whatever the
/// number of rows below a wide pass (1 to 63: every group size of the SIMD kernels and their
/// remainders, and input tiles' boundaries): a speculative verification of k drafts then
/// agrees with plain decoding exactly. A wide pass (a lean model's prefill: one GEMM over a
/// dequantised block) stays within the f32 product's rounding of the rows alone.
#[test]
fn a_row_gives_the_same_bits_alone_and_in_any_batch() {
    let mut next = lcg(23);
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1] {
        let (rows, cols, n) = (9, 160, WIDE_PASS + 6);
        let (bytes, x) = random_case(ty, (rows, cols, n), &mut next);
        let p = PackedMatrix::new(ty, rows, cols, &bytes).unwrap();
        for k in Kernel::available() {
            let alone: Vec<Vec<f32>> = (0..n)
                .map(|r| p.matmul_t_with(&x[r * cols..(r + 1) * cols], 1, k))
                .collect();
            for m in 1..=n {
                let got = p.matmul_t_with(&x[..m * cols], m, k);
                for (r, want) in alone.iter().enumerate().take(m) {
                    let got = &got[r * rows..(r + 1) * rows];
                    if m < WIDE_PASS {
                        assert_eq!(got, &want[..], "{ty:?} {k:?} {m}");
                    } else {
                        for (g, w) in got.iter().zip(want) {
                            assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{ty:?} {m}");
                        }
                    }
                }
            }
        }
    }
}

/// Random blocks and inputs: the 8-bit-activation product against the sum it stands for
/// (`Σ d_w·d_x·Σ w·q + m_w·s_x` over blocks, in f64 from the dequantised weights and the
/// quantised inputs), every kernel this CPU has against the scalar one bit for bit, a row
/// alone as in the batch, and the whole against the f32 product within the quantisation's
/// error.
#[test]
fn int8_products_equal_the_integer_reference() {
    let mut next = lcg(5);
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1] {
        // 11 input rows: a group of 8 and a remainder in the SIMD kernels.
        let (rows, cols, n) = (70, 128, 11);
        let (bytes, x) = random_case(ty, (rows, cols, n), &mut next);
        let p = PackedMatrix::new(ty, rows, cols, &bytes).unwrap();
        let xq = Q8Rows::quantize(&x, n, cols);
        let got = p.matmul_t_q8_with(&xq, q8::Kernel::Scalar);
        let mut w = vec![0f32; rows * cols];
        kd_gguf::dequantize(ty, &bytes, &mut w).unwrap();
        let blocks = cols / 32;
        let f32_product = p.matmul_t(&x, n);
        for r in 0..n {
            for j in 0..rows {
                // Σ w·x with x as its 8-bit blocks: q·d_x (the scale at f16 precision;
                // Q4_1's offset through s = d·Σq, also at f16 precision).
                let mut want = 0f64;
                for b in 0..blocks {
                    let dx = xq.d[r * blocks + b] as f64;
                    for k in 0..32 {
                        let i = b * 32 + k;
                        let wv = w[j * cols + i] as f64;
                        let qv = xq.q[r * cols + i] as f64;
                        want += match ty {
                            GgmlType::Q4_1 => (wv - p.m[j * blocks + b] as f64) * qv * dx,
                            _ => wv * qv * dx,
                        };
                    }
                    if ty == GgmlType::Q4_1 {
                        want += p.m[j * blocks + b] as f64 * xq.s[r * blocks + b] as f64;
                    }
                }
                let g = got[r * rows + j] as f64;
                assert!(
                    (g - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{ty:?} {r} {j}: {g} vs {want}"
                );
                // Against f32 activations: each input off by at most half a step plus
                // the scale's f16 rounding (127 steps of 2⁻¹¹ relative), and Q4_1's
                // offset term by the f16 rounding of s.
                let mut bound = 1e-3;
                for i in 0..cols {
                    bound += (w[j * cols + i] as f64).abs()
                        * xq.d[r * blocks + i / 32] as f64
                        * (0.5 + 127.0 / 2048.0 + 1e-3);
                }
                if ty == GgmlType::Q4_1 {
                    for b in 0..blocks {
                        bound += (p.m[j * blocks + b] as f64 * xq.s[r * blocks + b] as f64).abs()
                            / 1024.0;
                    }
                }
                let f = f32_product[r * rows + j] as f64;
                assert!((g - f).abs() <= bound, "{ty:?} {r} {j}: {g} vs f32 {f}");
            }
        }
        for kernel in q8::Kernel::available() {
            assert_eq!(p.matmul_t_q8_with(&xq, kernel), got, "{ty:?}: {kernel:?}");
        }
        let one = Q8Rows::quantize(&x[..cols], 1, cols);
        assert_eq!(
            p.matmul_t_q8(&one),
            got[..rows].to_vec(),
            "{ty:?}: row alone"
        );
    }
}
