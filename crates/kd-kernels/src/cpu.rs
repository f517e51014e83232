//! Run-time CPU-feature detection and the [`dispatch!`](crate::dispatch) macro.

/// Whether the AVX2/FMA builds of the kernels can run on this CPU (checked once, then
/// cached by the standard library's detection).
pub fn simd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Defines `fn $name(simd: bool, args..)`: the body compiled twice, for AVX2/FMA (taken when
/// `simd` is true, which callers get from [`simd()`](crate::cpu::simd)) and for the baseline
/// target. Use plain `*` and `+` in the body (no `mul_add`) so that both builds give the same
/// bits.
///
/// ```
/// kd_kernels::dispatch! {
///     /// Doubles every value.
///     fn double(xs: &mut [f32]) {
///         for x in xs.iter_mut() {
///             *x *= 2.0;
///         }
///     }
/// }
/// let mut xs = [1.0f32, 2.0];
/// double(kd_kernels::cpu::simd(), &mut xs);
/// assert_eq!(xs, [2.0, 4.0]);
/// ```
#[macro_export]
macro_rules! dispatch {
    ($(#[$doc:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$doc])*
        $vis fn $name(simd: bool, $($arg: $ty),*) {
            #[inline(always)]
            fn body($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            fn avx2($($arg: $ty),*) {
                body($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            if simd && $crate::cpu::simd() {
                // SAFETY: the CPU has AVX2 and FMA (checked just above).
                unsafe { avx2($($arg),*) };
                return;
            }
            let _ = simd;
            body($($arg),*)
        }
    };
}
