//! The packed kernels against dequantised products, across kernels, batch sizes and
//! activation types.

use super::*;
use half::f16;

/// A linear congruential generator's high bits.
pub(crate) fn lcg(seed: u64) -> impl FnMut() -> u32 {
    let mut state = seed;
    move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as u32
    }
}

/// `cols` for the 32-value block types, the next multiple of 256 for the super-block ones.
fn width(ty: GgmlType, cols: usize) -> usize {
    let block = ty.block().unwrap().0;
    cols.div_ceil(block) * block
}

/// Random `[rows, cols]` blocks of `ty` with finite scales (and minimums: Q4_1's, a
/// K-quant's super-block minimum), and a random input `[n, cols]` in [-1, 1).
fn random_case(
    ty: GgmlType,
    (rows, cols, n): (usize, usize, usize),
    next: &mut impl FnMut() -> u32,
) -> (Vec<u8>, Vec<f32>) {
    let (block, size) = ty.block().unwrap();
    let mut bytes = vec![0u8; rows * cols / block * size];
    for b in bytes.iter_mut() {
        *b = next() as u8;
    }
    // A K-quant's sub-block scales (up to 63, or ±127 for Q6_K) multiply its super-block's.
    let (at, range) = match ty {
        GgmlType::Q6K => (208, 0.002),
        GgmlType::Q4K | GgmlType::Q5K => (0, 0.004),
        _ => (0, 0.1),
    };
    for blk in bytes.chunks_exact_mut(size) {
        let scale = f16::from_f32(((next() % 1000) as f32 / 1000.0 - 0.5) * range);
        blk[at..at + 2].copy_from_slice(&scale.to_le_bytes());
        if group::has_offset(ty) {
            let m = f16::from_f32(((next() % 1000) as f32 / 1000.0 - 0.5) * 2.0 * range);
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
    for ty in group::TYPES {
        let (rows, cols, n) = (70, width(ty, 96), 5);
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
    for ty in group::TYPES {
        let (rows, cols, n) = (9, width(ty, 160), WIDE_PASS + 6);
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
    for ty in group::TYPES {
        // 11 input rows: a group of 8 and a remainder in the SIMD kernels.
        let (rows, cols, n) = (70, width(ty, 128), 11);
        let (bytes, x) = random_case(ty, (rows, cols, n), &mut next);
        let p = PackedMatrix::new(ty, rows, cols, &bytes).unwrap();
        let xq = Q8Rows::quantize(&x, n, cols);
        let got = p.matmul_t_q8_with(&xq, q8::Kernel::Scalar);
        let mut w = vec![0f32; rows * cols];
        kd_gguf::dequantize(ty, &bytes, &mut w).unwrap();
        let blocks = cols / 32;
        // Each group's offset (Q4_1's minimum, minus a K-quant's sub-block minimum; 0 for the
        // types without one), `[rows, cols / 32]`.
        let layout = group::Layout::of(ty);
        let offsets: Vec<f32> = (0..rows)
            .flat_map(|j| {
                p.block_rows(j..j + 1)
                    .chunks_exact(layout.size)
                    .flat_map(|b| {
                        group::block_scales(ty, b, group::halves_to_f32)
                            .into_iter()
                            .take(1 << layout.shift)
                    })
                    .map(|s| s.offset)
                    .collect::<Vec<_>>()
            })
            .collect();
        let f32_product = p.matmul_t(&x, n);
        for r in 0..n {
            for j in 0..rows {
                // Σ w·x with x as its 8-bit blocks: q·d_x (the scale at f16 precision;
                // the offset through s = d·Σq, also at f16 precision).
                let mut want = 0f64;
                for b in 0..blocks {
                    let dx = xq.d_at(r, b) as f64;
                    for k in 0..32 {
                        let i = b * 32 + k;
                        let wv = w[j * cols + i] as f64;
                        let qv = xq.q[r * cols + i] as f64;
                        want += (wv - offsets[j * blocks + b] as f64) * qv * dx;
                    }
                    want += offsets[j * blocks + b] as f64 * xq.s_at(r, b) as f64;
                }
                let g = got[r * rows + j] as f64;
                assert!(
                    (g - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{ty:?} {r} {j}: {g} vs {want}"
                );
                // Against f32 activations: each input off by at most half a step plus
                // the scale's f16 rounding (127 steps of 2⁻¹¹ relative), and the offset
                // term by the f16 rounding of s.
                let mut bound = 1e-3;
                for i in 0..cols {
                    bound += (w[j * cols + i] as f64).abs()
                        * xq.d_at(r, i / 32) as f64
                        * (0.5 + 127.0 / 2048.0 + 1e-3);
                }
                for b in 0..blocks {
                    bound += (offsets[j * blocks + b] as f64 * xq.s_at(r, b) as f64).abs() / 1024.0;
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

/// K-quant blocks with 8-bit super-block activations (ggml's Q8_K): the product against the
/// sum it stands for (`Σ w·q·d_x` in f64 from the dequantised weights and the quantised
/// inputs), every kernel this CPU has against the scalar one bit for bit, a row alone as in
/// the batch, and the whole against the f32 product within the quantisation's error.
#[test]
fn kquant_int8_products_equal_the_integer_reference() {
    let mut next = lcg(7);
    for ty in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
        // 6 input rows: a group of 4 and a remainder in the SIMD kernels.
        let (rows, cols, n) = (37, 512, 6);
        let (bytes, x) = random_case(ty, (rows, cols, n), &mut next);
        let p = PackedMatrix::new(ty, rows, cols, &bytes).unwrap();
        let xk = Q8KRows::quantize(&x, n, cols);
        let got = p.matmul_t_q8k_with(&xk, q8::Kernel::Scalar);
        let mut w = vec![0f32; rows * cols];
        kd_gguf::dequantize(ty, &bytes, &mut w).unwrap();
        let f32_product = p.matmul_t(&x, n);
        for r in 0..n {
            for j in 0..rows {
                let (mut want, mut size, mut bound) = (0f64, 0f64, 1e-3);
                for i in 0..cols {
                    let (wv, dx) = (
                        w[j * cols + i] as f64,
                        xk.d[r * cols / 256 + i / 256] as f64,
                    );
                    let term = wv * xk.q[r * cols + i] as f64 * dx;
                    want += term;
                    size += term.abs();
                    // Each input off by at most half a step (the scale itself is exact).
                    bound += wv.abs() * dx.abs() * (0.5 + 1e-3);
                }
                let g = got[r * rows + j] as f64;
                assert!(
                    (g - want).abs() <= 1e-6 * (1.0 + size),
                    "{ty:?} {r} {j}: {g} vs {want}"
                );
                let f = f32_product[r * rows + j] as f64;
                assert!((g - f).abs() <= bound, "{ty:?} {r} {j}: {g} vs f32 {f}");
            }
        }
        for kernel in q8::Kernel::available() {
            assert_eq!(p.matmul_t_q8k_with(&xk, kernel), got, "{ty:?}: {kernel:?}");
        }
        let one = Q8KRows::quantize(&x[..cols], 1, cols);
        let alone = p.matmul_t_q8k_with(&one, q8::Kernel::detect());
        assert_eq!(alone, got[..rows].to_vec(), "{ty:?}: row alone");
    }
}

/// Each group's `q · scale + offset` is the block's dequantised values bit for bit, and
/// the SSE2 reading gives the portable one's bytes.
#[test]
fn groups_are_the_dequantised_values() {
    let mut next = lcg(7);
    for ty in group::TYPES {
        let (n, size) = ty.block().unwrap();
        for _ in 0..20 {
            let mut b: Vec<u8> = (0..size).map(|_| next() as u8).collect();
            // Finite f16 scales: clear the exponent's top bit.
            let halves: &[usize] = match ty {
                GgmlType::Q6K => &[208],
                GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
                _ => &[0],
            };
            for &at in halves {
                b[at + 1] &= 0b1011_1111;
            }
            let mut want = vec![0f32; n];
            kd_gguf::dequantize(ty, &b, &mut want).unwrap();
            for sub in 0..n / 32 {
                let (q, s) = (
                    group::values(ty, &b, sub),
                    group::block_scales(ty, &b, group::halves_to_f32)[sub],
                );
                for l in 0..32 {
                    let mut v = q[l] as f32 * s.d[l / 16];
                    if group::has_offset(ty) {
                        v += s.offset;
                    }
                    assert_eq!(
                        v.to_bits(),
                        want[sub * 32 + l].to_bits(),
                        "{ty:?} {sub} {l}"
                    );
                }
                #[cfg(target_arch = "x86_64")]
                {
                    let mut got = [0i8; 32];
                    // SAFETY: the block is whole; SSE2 is x86-64's baseline.
                    unsafe {
                        let v = group::values_sse2(ty, b.as_ptr(), sub);
                        for (i, r) in v.iter().enumerate() {
                            std::arch::x86_64::_mm_storeu_si128(
                                got.as_mut_ptr().add(16 * i) as *mut _,
                                *r,
                            );
                        }
                    }
                    assert_eq!(got, q, "{ty:?} {sub}: SSE2");
                }
            }
        }
    }
}
