//! Branch-free f32 `exp` and `ln` that the compiler vectorises, and lane-parallel reductions.
//!
//! `f32::exp`/`f32::ln` are library calls that block vectorisation; these are polynomial
//! versions accurate to about 2 ulp over the ranges used here. Only plain `*` and `+` are
//! used (no `mul_add`), so the AVX2 build and the portable build give bit-identical results.
//! Reductions keep [`LANES`] independent partial sums so that they vectorise without
//! reassociating: the summation order is fixed and the same on every machine.

/// Number of independent accumulators in reductions (one AVX2 register of f32).
pub const LANES: usize = 8;

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// Below this `exp` underflows (to subnormals); we return exactly 0.
const EXP_MIN: f32 = -87.336_55;
const EXP_MAX: f32 = 88.722_83;
/// Adding and subtracting 1.5 · 2²³ rounds to the nearest integer (|x| < 2²²).
const ROUND_MAGIC: f32 = 12_582_912.0;

/// `e^x`; 0 for x < −87.3 (including −∞), +∞ for x > 88.7, NaN for NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // NaN takes the 0 path here and is restored at the end (clamp would propagate it into the
    // integer conversion).
    let xc = if x.is_nan() {
        0.0
    } else {
        x.clamp(EXP_MIN, EXP_MAX)
    };
    let shifted = xc * LOG2E + ROUND_MAGIC;
    let k = shifted - ROUND_MAGIC;
    let r = xc - k * LN2_HI - k * LN2_LO;
    // Taylor series of e^r on |r| ≤ ln2/2: the truncation error is below 2e-8 relative.
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // The integer k sits in the low mantissa bits of 1.5·2²³ + k (k in [-126, 128]); reading
    // it from the bits avoids a float-to-int conversion (and its checks in debug builds).
    let ki = shifted.to_bits() as i32 - ROUND_MAGIC.to_bits() as i32;
    // 2^k in two halves so that k = 128 (x near the top of the range) does not overflow the
    // exponent field.
    let half = ki >> 1;
    let s1 = f32::from_bits(((half + 127) as u32) << 23);
    let s2 = f32::from_bits(((ki - half + 127) as u32) << 23);
    let y = p * s1 * s2;
    let y = if x < EXP_MIN { 0.0 } else { y };
    let y = if x > EXP_MAX { f32::INFINITY } else { y };
    if x.is_nan() { x } else { y }
}

/// Natural logarithm for x > 0 (finite); −∞ for 0, NaN for negative or NaN input.
#[inline(always)]
pub fn ln(x: f32) -> f32 {
    // Scale subnormals into the normal range first.
    let tiny = x < f32::MIN_POSITIVE;
    let xs = if tiny { x * 8_388_608.0 } else { x }; // 2^23
    let bits = xs.to_bits();
    // Split into m · 2^e with m in [√½, √2).
    let mut e = ((bits >> 23) & 0xff) as i32 - 127;
    let mut m = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000);
    let big = m > std::f32::consts::SQRT_2;
    m = if big { m * 0.5 } else { m };
    e = if big { e + 1 } else { e };
    let e = e as f32 - if tiny { 23.0 } else { 0.0 };
    // ln(m) = 2·atanh(s), s = (m − 1)/(m + 1), |s| ≤ 0.1716.
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let poly = 2.0
        * s
        * (1.0
            + s2 * (1.0 / 3.0
                + s2 * (0.2 + s2 * (1.0 / 7.0 + s2 * (1.0 / 9.0 + s2 * (1.0 / 11.0))))));
    let y = e * LN2_HI + (poly + e * LN2_LO);
    let y = if x == 0.0 { f32::NEG_INFINITY } else { y };
    let y = if x == f32::INFINITY { f32::INFINITY } else { y };
    if x < 0.0 || x.is_nan() { f32::NAN } else { y }
}

/// Elements mapped per block before summing: the map runs as a plain element loop (which
/// the loop vectoriser handles even for long bodies such as `exp`), the sum over the block
/// with [`LANES`] partial sums.
const BLOCK: usize = 512;

/// Adds `buf` into the lane accumulators (lane = index mod [`LANES`], fixed order).
#[inline(always)]
fn accumulate(acc: &mut [f32; LANES], buf: &[f32]) {
    let full = buf.len() / LANES * LANES;
    for b in (0..full).step_by(LANES) {
        let c: &[f32; LANES] = buf[b..b + LANES].try_into().expect("lane block");
        for l in 0..LANES {
            acc[l] += c[l];
        }
    }
    for (l, x) in buf[full..].iter().enumerate() {
        acc[l] += *x;
    }
}

/// Σ f(xᵢ) with [`LANES`] partial sums (fixed order, vectorisable).
#[inline(always)]
pub fn sum_map(xs: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut buf = [0f32; BLOCK];
    for chunk in xs.chunks(BLOCK) {
        let buf = &mut buf[..chunk.len()];
        for (b, x) in buf.iter_mut().zip(chunk) {
            *b = f(*x);
        }
        accumulate(&mut acc, buf);
    }
    lane_total(acc)
}

/// Σ f(xᵢ, yᵢ) with [`LANES`] partial sums.
#[inline(always)]
pub fn sum_map2(xs: &[f32], ys: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    debug_assert_eq!(xs.len(), ys.len());
    let mut acc = [0f32; LANES];
    let mut buf = [0f32; BLOCK];
    for (cx, cy) in xs.chunks(BLOCK).zip(ys.chunks(BLOCK)) {
        let buf = &mut buf[..cx.len()];
        for ((b, x), y) in buf.iter_mut().zip(cx).zip(cy) {
            *b = f(*x, *y);
        }
        accumulate(&mut acc, buf);
    }
    lane_total(acc)
}

/// The maximum of a slice (−∞ for an empty one), NaN-insensitive (NaN is checked apart).
#[inline(always)]
pub fn max(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            acc[l] = if c[l] > acc[l] { c[l] } else { acc[l] };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for v in acc.into_iter().chain(tail.iter().copied()) {
        if v > m {
            m = v;
        }
    }
    m
}

#[inline(always)]
fn lane_total(acc: [f32; LANES]) -> f32 {
    // A fixed pairwise tree.
    let a = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    (a[0] + a[2]) + (a[1] + a[3])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_accurate() {
        let mut worst = 0;
        let mut x = -87.0f32;
        while x < 88.0 {
            let u = ulps(exp(x), (x as f64).exp() as f32);
            worst = worst.max(u);
            x += 0.0137;
        }
        assert!(worst <= 3, "worst {worst} ulp");
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-1000.0), 0.0);
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(88.7).is_finite());
    }

    #[test]
    fn ln_is_accurate() {
        let mut worst = 0;
        // Subnormals (a multiplicative step would stall there), then normals.
        for bits in [1u32, 7, 1000, 0x0040_0000, 0x007f_ffff] {
            let x = f32::from_bits(bits);
            assert!(ulps(ln(x), (x as f64).ln() as f32) <= 3, "{x:e}");
        }
        let mut x = f32::MIN_POSITIVE;
        while x < 1e38 {
            let u = ulps(ln(x), (x as f64).ln() as f32);
            worst = worst.max(u);
            x *= 1.0093;
        }
        assert!(worst <= 3, "worst {worst} ulp");
        assert_eq!(ln(0.0), f32::NEG_INFINITY);
        assert_eq!(ln(1.0), 0.0);
        assert_eq!(ln(f32::INFINITY), f32::INFINITY);
        assert!(ln(-1.0).is_nan());
        assert!(ln(f32::NAN).is_nan());
    }

    #[test]
    fn reductions() {
        let xs: Vec<f32> = (0..37).map(|i| i as f32).collect();
        assert_eq!(sum_map(&xs, |x| x), 666.0);
        assert_eq!(
            sum_map2(&xs, &xs, |x, y| x * y),
            (0..37).map(|i| (i * i) as f32).sum::<f32>()
        );
        assert_eq!(max(&xs), 36.0);
        assert_eq!(max(&[]), f32::NEG_INFINITY);
    }

    crate::dispatch! {
        /// exp and ln of every value and their lane sums, as the kernels use them.
        fn map_all(xs: &[f32], e: &mut [f32], l: &mut [f32]) -> (f32, f32, f32) {
            for ((x, e), l) in xs.iter().zip(e.iter_mut()).zip(l.iter_mut()) {
                *e = exp(*x);
                *l = ln(x.abs());
            }
            (sum_map(xs, exp), sum_map2(xs, e, |x, e| x * e), max(l))
        }
    }

    #[test]
    fn every_level_gives_the_same_bits() {
        // Plain `*`/`+` only: the AVX-512, AVX2 and baseline builds may widen the vectors
        // but neither fuse nor reassociate, so each level must reproduce the scalar bits.
        let xs: Vec<f32> = (0..4099)
            .map(|i| ((i as f32) * 0.618_034).sin() * 80.0)
            .collect();
        let run = |level| {
            let (mut e, mut l) = (vec![0f32; xs.len()], vec![0f32; xs.len()]);
            let sums = map_all(level, &xs, &mut e, &mut l);
            (e, l, sums)
        };
        let (e0, l0, s0) = run(crate::cpu::SimdLevel::Scalar);
        for (x, (e, l)) in xs.iter().zip(e0.iter().zip(&l0)) {
            assert!(ulps(*e, (*x as f64).exp() as f32) <= 3, "exp({x})");
            assert!(ulps(*l, (x.abs() as f64).ln() as f32) <= 3, "ln({x})");
        }
        for level in crate::cpu::supported() {
            let (e, l, s) = run(level);
            let same =
                |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same(&e, &e0) && same(&l, &l0),
                "{level}: element bits differ"
            );
            assert_eq!(
                (s.0.to_bits(), s.1.to_bits(), s.2.to_bits()),
                (s0.0.to_bits(), s0.1.to_bits(), s0.2.to_bits()),
                "{level}: reduction bits differ"
            );
        }
    }
}
