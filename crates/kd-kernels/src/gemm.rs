//! A safe, slice-based wrapper of the `gemm` crate's f32 matrix product.
//!
//! A [`MatRef`] or [`MatMut`] is a slice plus a shape and strides; its constructor checks
//! that every element it names lies inside the slice (and, for destinations, that no two
//! elements share a place). [`matmul`] checks that the shapes chain. Only then are pointers
//! formed, so no call through this module can read or write out of bounds. Transposes are
//! views with swapped strides ([`MatRef::t`]).

use gemm::Parallelism;

use crate::KernelError;

/// Values one view spans: its last index + 1 (0 when empty); `None` when that overflows.
fn extent(rows: usize, cols: usize, rs: usize, cs: usize) -> Option<usize> {
    if rows == 0 || cols == 0 {
        return Some(0);
    }
    (rows - 1)
        .checked_mul(rs)?
        .checked_add((cols - 1).checked_mul(cs)?)?
        .checked_add(1)
}

fn check(rows: usize, cols: usize, rs: usize, cs: usize, len: usize) -> Result<(), KernelError> {
    // Strides reach GEMM as `isize`: larger ones (even on an axis of size 1, where they are
    // never applied) are refused rather than wrapped.
    let fits = rs <= isize::MAX as usize && cs <= isize::MAX as usize;
    let needed = extent(rows, cols, rs, cs)
        .filter(|_| fits)
        .unwrap_or(usize::MAX);
    if needed > len {
        return Err(KernelError::OutOfBounds {
            rows,
            cols,
            row_stride: rs,
            col_stride: cs,
            needed,
            len,
        });
    }
    Ok(())
}

/// A read-only `rows × cols` matrix inside a slice: element `(i, j)` is
/// `data[i · row_stride + j · col_stride]`.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a> MatRef<'a> {
    /// A strided view; an error when it reaches past the slice.
    pub fn new(
        data: &'a [f32],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Result<Self, KernelError> {
        check(rows, cols, row_stride, col_stride, data.len())?;
        Ok(Self {
            data,
            rows,
            cols,
            rs: row_stride,
            cs: col_stride,
        })
    }

    /// A row-major `rows × cols` view of the slice's start.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Result<Self, KernelError> {
        Self::new(data, rows, cols, cols, 1)
    }

    /// Rows of row stride `row_stride` (≥ `cols` for distinct rows) at the slice's start.
    pub fn rows(
        data: &'a [f32],
        rows: usize,
        cols: usize,
        row_stride: usize,
    ) -> Result<Self, KernelError> {
        Self::new(data, rows, cols, row_stride, 1)
    }

    /// The transpose (the same values, strides swapped).
    pub fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Columns `c0..c1` (`c0 ≤ c1 ≤ cols`): a view inside this one, so it needs no check.
    fn columns(&self, c0: usize, c1: usize) -> Self {
        debug_assert!(c0 <= c1 && c1 <= self.cols);
        let start = if c0 == c1 { 0 } else { c0 * self.cs };
        Self {
            data: &self.data[start.min(self.data.len())..],
            cols: c1 - c0,
            ..*self
        }
    }
}

/// A writable `rows × cols` matrix of contiguous rows inside a slice: element `(i, j)` is
/// `data[i · row_stride + j]`, with `row_stride ≥ cols` so that no two elements alias.
#[derive(Debug)]
pub struct MatMut<'a> {
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
    rs: usize,
}

impl<'a> MatMut<'a> {
    /// Rows of `cols` values, `row_stride` apart; an error when they reach past the slice
    /// or overlap.
    pub fn rows(
        data: &'a mut [f32],
        rows: usize,
        cols: usize,
        row_stride: usize,
    ) -> Result<Self, KernelError> {
        if rows > 1 && row_stride < cols {
            return Err(KernelError::OverlappingRows {
                rows,
                cols,
                row_stride,
            });
        }
        check(rows, cols, row_stride, 1, data.len())?;
        Ok(Self {
            data,
            rows,
            cols,
            rs: row_stride,
        })
    }

    /// A row-major `rows × cols` view of the slice's start.
    pub fn row_major(data: &'a mut [f32], rows: usize, cols: usize) -> Result<Self, KernelError> {
        Self::rows(data, rows, cols, cols)
    }

    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }
}

/// Whether the destination's old values are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write {
    /// `dst = alpha · lhs · rhs`.
    Overwrite,
    /// `dst += alpha · lhs · rhs`.
    Accumulate,
}

/// Threads of one product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Threads {
    /// On the calling thread (callers that parallelise over independent products).
    One,
    /// On rayon's pool.
    All,
    /// On rayon's pool when the product has at least 2¹⁸ multiply-adds, else on the
    /// calling thread.
    Auto,
}

impl Threads {
    fn parallelism(self, m: usize, n: usize, k: usize) -> Parallelism {
        match self {
            Self::One => Parallelism::None,
            Self::All => Parallelism::Rayon(0),
            Self::Auto if m.saturating_mul(n).saturating_mul(k) >= 1 << 18 => Parallelism::Rayon(0),
            Self::Auto => Parallelism::None,
        }
    }
}

fn chain(dst: (usize, usize), lhs: &MatRef, rhs: &MatRef) -> Result<(), KernelError> {
    if lhs.rows != dst.0 || rhs.cols != dst.1 || lhs.cols != rhs.rows {
        return Err(KernelError::Shapes {
            dst_rows: dst.0,
            dst_cols: dst.1,
            lhs_rows: lhs.rows,
            lhs_cols: lhs.cols,
            rhs_rows: rhs.rows,
            rhs_cols: rhs.cols,
        });
    }
    Ok(())
}

/// `dst (+)= alpha · lhs · rhs`; an error when the shapes do not chain
/// (`lhs [m, k] · rhs [k, n] → dst [m, n]`).
pub fn matmul(
    dst: MatMut<'_>,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    write: Write,
    alpha: f32,
    threads: Threads,
) -> Result<(), KernelError> {
    matmul_at(crate::cpu::level(), dst, lhs, rhs, write, alpha, threads)
}

/// [`matmul`] on the microkernels of `level` (lowered to what this CPU runs) rather than of
/// [`cpu::level()`](crate::cpu::level): for comparing levels in one process.
pub fn matmul_at(
    level: crate::cpu::SimdLevel,
    dst: MatMut<'_>,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    write: Write,
    alpha: f32,
    threads: Threads,
) -> Result<(), KernelError> {
    chain((dst.rows, dst.cols), &lhs, &rhs)?;
    let (m, n) = (dst.rows, dst.cols);
    if m == 0 || n == 0 {
        return Ok(());
    }
    if let Some(parts) = k_parts(m, n, lhs.cols, threads) {
        k_split(level, dst, lhs, rhs, write, alpha, parts);
        return Ok(());
    }
    let accumulate = write == Write::Accumulate;
    // SAFETY: the constructors checked that every (i, j) of each view, under its strides,
    // lies inside its slice, and that the destination's elements are distinct; `dst` is a
    // unique borrow, so it aliases neither operand; the shapes chain (checked above).
    unsafe {
        raw_at(
            level,
            (dst.data.as_mut_ptr(), dst.rs),
            accumulate,
            &lhs,
            &rhs,
            alpha,
            threads,
        )
    };
    Ok(())
}

/// Products whose inner dimension dwarfs the output (`k ≥ 16384` and `k ≥ 8 · max(m, n)`:
/// the LM head's `dh = dlogits · W` over the vocabulary) split `k` into parts computed side by
/// side: the GEMM's own threading splits the output and synchronises its threads once per
/// k-block, hundreds of times over such a `k`; independent parts do not (measured with
/// `benches/src/bin/gemm.rs`). The number of parts depends on the shape only (about 32768
/// of `k` each, 2 to 16), never on the thread count, so the sums are the same on every machine.
fn k_parts(m: usize, n: usize, k: usize, threads: Threads) -> Option<usize> {
    (threads != Threads::One && k >= 16_384 && k >= 8 * m.max(n))
        .then(|| k.div_ceil(32_768).clamp(2, 16))
}

/// [`matmul_at`] as `parts` products over consecutive ranges of `k`, each into its own buffer
/// (in parallel, each on one thread when there are at least as many parts as threads), then
/// `dst (+)= alpha · Σ parts` summed in part order.
fn k_split(
    level: crate::cpu::SimdLevel,
    dst: MatMut<'_>,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    write: Write,
    alpha: f32,
    parts: usize,
) {
    use rayon::prelude::*;
    let (m, n, k) = (dst.rows, dst.cols, lhs.cols);
    let inner = if parts >= rayon::current_num_threads() {
        Threads::One
    } else {
        Threads::All
    };
    let bounds: Vec<(usize, usize)> = (0..parts)
        .map(|p| (p * k / parts, (p + 1) * k / parts))
        .collect();
    let partial: Vec<Vec<f32>> = bounds
        .par_iter()
        .map(|&(k0, k1)| {
            let mut out = Vec::new();
            matmul_into_at(
                level,
                &mut out,
                lhs.columns(k0, k1),
                rhs.t().columns(k0, k1).t(),
                1.0,
                inner,
            )
            .expect("parts of a product whose shapes chain");
            out
        })
        .collect();
    let (rs, accumulate) = (dst.rs, write == Write::Accumulate);
    dst.data
        .par_chunks_mut(rs)
        .take(m)
        .enumerate()
        .for_each(|(i, row)| {
            for (j, d) in row[..n].iter_mut().enumerate() {
                let mut sum = 0f32;
                for part in &partial {
                    sum += part[i * n + j];
                }
                *d = if accumulate {
                    *d + alpha * sum
                } else {
                    alpha * sum
                };
            }
        });
}

/// The `gemm` call: `dst (+)= alpha · lhs · rhs` with `dst` row-major at stride `dst.1`, on
/// the microkernels of `level` (lowered to what the CPU runs).
///
/// The `gemm` crate picks its microkernels once per process from the CPU's features (AVX-512
/// when built with its `x86-v4` feature, as this workspace builds it); to honour a lower
/// level, this calls its generic driver with that level's microkernels, exactly as its own
/// dispatch does (`gemm_common::gemm::gemm_basic_generic` with `gemm_f32`'s tables and the
/// same `a · b + c` scalar fallback), after the same orientation step as `gemm::gemm`: a
/// row-major destination is computed as the transposed product (the microkernels prefer
/// column-major output).
///
/// # Safety
/// `dst` must be valid for writes (and for reads when `accumulate`) of `lhs.rows` rows of
/// `rhs.cols` values at its stride, alias neither operand, and the shapes must chain.
unsafe fn raw_at(
    level: crate::cpu::SimdLevel,
    dst: (*mut f32, usize),
    accumulate: bool,
    lhs: &MatRef<'_>,
    rhs: &MatRef<'_>,
    alpha: f32,
    threads: Threads,
) {
    use crate::cpu::SimdLevel;
    let (m, n, k) = (lhs.rows, rhs.cols, lhs.cols);
    if m == 0 || n == 0 {
        return;
    }
    let parallelism = threads.parallelism(m, n, k);
    // gemm's convention: dst = alpha · dst + beta · lhs · rhs.
    let (read, beta, alpha) = (accumulate, alpha, if accumulate { 1.0 } else { 0.0 });
    // (pointer, column stride, row stride) of each operand.
    let view = |v: &MatRef<'_>| (v.data.as_ptr(), v.cs as isize, v.rs as isize);
    let (mm, nn, d, l, r) = if dst.1 > 1 {
        // dstᵀ [n, m] = rhsᵀ · lhsᵀ (what gemm::gemm does for a row-major destination).
        let t = |(p, cs, rs)| (p, rs, cs);
        (n, m, (dst.0, dst.1 as isize, 1), t(view(rhs)), t(view(lhs)))
    } else {
        (m, n, (dst.0, 1, dst.1 as isize), view(lhs), view(rhs))
    };
    macro_rules! call {
        ($simd:expr, $ukr:path, $n:expr) => {{
            use $ukr as u;
            // SAFETY: forwarded contract; the microkernel set matches `$simd`, which exists
            // (its `try_new` succeeded, or it is the scalar one).
            unsafe {
                gemm_common::gemm::gemm_basic_generic::<
                    _,
                    f32,
                    { $n },
                    { u::MR_DIV_N * $n },
                    { u::NR },
                    { u::MR_DIV_N },
                    { u::H_M },
                    { u::H_N },
                >(
                    $simd,
                    mm,
                    nn,
                    k,
                    d.0,
                    d.1,
                    d.2,
                    read,
                    l.0,
                    l.1,
                    l.2,
                    r.0,
                    r.1,
                    r.2,
                    alpha,
                    beta,
                    false,
                    false,
                    false,
                    |a, b, c| a * b + c,
                    &u::UKR,
                    &u::H_UKR,
                    false,
                    parallelism,
                )
            }
        }};
    }
    #[cfg(target_arch = "x86_64")]
    match level.min(crate::cpu::detected()) {
        SimdLevel::Avx512 => {
            if let Some(simd) = gemm_common::simd::V4::try_new() {
                return call!(simd, gemm_f32::microkernel::avx512f::f32, 16);
            }
        }
        SimdLevel::Avx2 => {
            if let Some(simd) = gemm_common::simd::V3::try_new() {
                return call!(simd, gemm_f32::microkernel::fma::f32, 8);
            }
        }
        SimdLevel::Scalar => {
            let scalar = gemm_common::simd::Scalar;
            return call!(scalar, gemm_f32::microkernel::scalar::f32, 1);
        }
    }
    let _ = level;
    // Other architectures: the crate's own choice (NEON on aarch64).
    // SAFETY: forwarded contract; the operands' views were checked by their constructors.
    unsafe {
        gemm::gemm(
            mm,
            nn,
            k,
            d.0,
            d.1,
            d.2,
            read,
            l.0,
            l.1,
            l.2,
            r.0,
            r.1,
            r.2,
            alpha,
            beta,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// `dst = alpha · lhs · rhs` into a vector cleared and refilled with the `[m, n]` product,
/// row-major, without zeroing it first (the product writes every element).
pub fn matmul_into(
    dst: &mut Vec<f32>,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    alpha: f32,
    threads: Threads,
) -> Result<(), KernelError> {
    matmul_into_at(crate::cpu::level(), dst, lhs, rhs, alpha, threads)
}

/// [`matmul_into`] on the microkernels of `level`.
pub fn matmul_into_at(
    level: crate::cpu::SimdLevel,
    dst: &mut Vec<f32>,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    alpha: f32,
    threads: Threads,
) -> Result<(), KernelError> {
    let (m, n) = (lhs.rows, rhs.cols);
    chain((m, n), &lhs, &rhs)?;
    dst.clear();
    let len = m.checked_mul(n).expect("product size overflows usize");
    dst.reserve(len);
    if len == 0 {
        return Ok(());
    }
    if k_parts(m, n, lhs.cols, threads).is_some() {
        dst.resize(len, 0.0);
        return matmul_at(
            level,
            MatMut::row_major(dst, m, n)?,
            lhs,
            rhs,
            Write::Overwrite,
            alpha,
            threads,
        );
    }
    // SAFETY: `dst` has capacity for m × n values, written row-major with row stride n; the
    // product does not read the destination (`accumulate` false) and writes every element
    // before `set_len` exposes them. The operands were checked by their constructors and do
    // not alias `dst` (a unique borrow).
    unsafe {
        raw_at(
            level,
            (dst.as_mut_ptr(), n),
            false,
            &lhs,
            &rhs,
            alpha,
            threads,
        );
        dst.set_len(len);
    }
    Ok(())
}

#[cfg(test)]
mod tests;
