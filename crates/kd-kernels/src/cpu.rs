//! Run-time CPU-feature detection, the instruction-set level the kernels use, and the
//! [`dispatch!`](crate::dispatch) macro.
//!
//! One binary serves every x86-64 CPU: each kernel is compiled for several
//! [`SimdLevel`]s and the level is chosen at run time. [`level()`] is the best level this
//! CPU runs, capped by the environment variable [`SIMD_ENV`] (`KD_SIMD=scalar|avx2|avx512`),
//! so that every path can be exercised (and compared) on one machine; tests re-run their
//! kernel-level cases at each lower level with [`crate::testing::rerun_at_lower_levels`].

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

use crate::KernelError;

/// The environment variable that caps the instruction set of the kernels (and of the
/// workspace's GEMM calls): `scalar`, `avx2` or `avx512`; unset or `native` means the best
/// this CPU has. A level above the CPU's is lowered to the CPU's.
pub const SIMD_ENV: &str = "KD_SIMD";

/// An instruction-set level a kernel is compiled for, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// The baseline target (SSE2 on x86-64; NEON-free code elsewhere).
    Scalar,
    /// x86-64-v3: AVX2, FMA, F16C, BMI1/2, LZCNT (what `pulp::x86::V3` requires).
    Avx2,
    /// x86-64-v4: AVX-512 F, BW, CD, DQ, VL on top of v3 (what `pulp::x86::V4` requires).
    Avx512,
}

impl SimdLevel {
    /// Every level, lowest first.
    pub const ALL: [SimdLevel; 3] = [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512];

    /// The level's name as [`SIMD_ENV`] spells it.
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
        }
    }

    /// Whether this CPU can run code compiled for the level.
    pub fn available(self) -> bool {
        self <= detected()
    }
}

impl fmt::Display for SimdLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SimdLevel {
    type Err = KernelError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" | "none" => Ok(SimdLevel::Scalar),
            "avx2" | "x86-64-v3" => Ok(SimdLevel::Avx2),
            "avx512" | "avx-512" | "x86-64-v4" => Ok(SimdLevel::Avx512),
            _ => Err(KernelError::SimdLevel {
                value: s.to_string(),
            }),
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> SimdLevel {
    use std::arch::is_x86_feature_detected as has;
    let v3 = has!("avx")
        && has!("avx2")
        && has!("fma")
        && has!("f16c")
        && has!("bmi1")
        && has!("bmi2")
        && has!("lzcnt")
        && has!("popcnt")
        && has!("sse4.2");
    let v4 = v3
        && has!("avx512f")
        && has!("avx512bw")
        && has!("avx512cd")
        && has!("avx512dq")
        && has!("avx512vl");
    if v4 {
        SimdLevel::Avx512
    } else if v3 {
        SimdLevel::Avx2
    } else {
        SimdLevel::Scalar
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> SimdLevel {
    SimdLevel::Scalar
}

/// The best level this CPU runs (detected once).
pub fn detected() -> SimdLevel {
    static DETECTED: OnceLock<SimdLevel> = OnceLock::new();
    *DETECTED.get_or_init(detect)
}

/// The cap that [`SIMD_ENV`] asks for: `None` when unset, empty or `native`; an error naming
/// the variable and the accepted values when it is set to anything else.
pub fn requested() -> Result<Option<SimdLevel>, KernelError> {
    match std::env::var(SIMD_ENV) {
        Ok(v) if v.trim().is_empty() || v.trim().eq_ignore_ascii_case("native") => Ok(None),
        Ok(v) => v.parse().map(Some),
        Err(_) => Ok(None),
    }
}

/// The level the kernels use: [`detected()`] capped by [`SIMD_ENV`] (read once). An
/// unreadable value is reported once through `tracing` and ignored; binaries call
/// [`requested()`] at start to refuse it instead.
pub fn level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| match requested() {
        Ok(Some(cap)) => cap.min(detected()),
        Ok(None) => detected(),
        Err(e) => {
            tracing::warn!("{e}; using {}", detected());
            detected()
        }
    })
}

/// Every level this CPU runs, lowest first.
pub fn supported() -> Vec<SimdLevel> {
    SimdLevel::ALL
        .into_iter()
        .filter(|l| l.available())
        .collect()
}

/// The CPU's model name (`/proc/cpuinfo` on Linux, `sysctl` names elsewhere are not read):
/// `"unknown"` when it cannot be read.
pub fn model_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name") || l.starts_with("Model"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_string())
}

/// One line naming the machine for benchmark and test output: model, logical CPUs, the
/// level in use and the CPU's best, e.g. `Intel(R) Xeon(R) Processor, 2 CPUs, kernels avx512
/// (CPU: avx512)`.
pub fn describe() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!(
        "{}, {} CPUs, kernels {} (CPU: {})",
        model_name(),
        cpus,
        level(),
        detected()
    )
}

/// Defines `fn $name(level: SimdLevel, args..)`: the body compiled for AVX-512, for
/// AVX2/FMA and for the baseline target, the build taken being the best of `level` and
/// [`detected()`](crate::cpu::detected). Callers pass [`level()`](crate::cpu::level). Use
/// plain `*` and `+` in the body (no `mul_add`) so that every build gives the same bits:
/// the compiler neither fuses nor reassociates them, it only widens the vectors.
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
/// double(kd_kernels::cpu::level(), &mut xs);
/// assert_eq!(xs, [2.0, 4.0]);
/// ```
#[macro_export]
macro_rules! dispatch {
    ($(#[$doc:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $crate::dispatch! { $(#[$doc])* $vis fn $name($($arg: $ty),*) -> () $body }
    };
    ($(#[$doc:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty $body:block) => {
        $(#[$doc])*
        #[allow(clippy::too_many_arguments, clippy::unused_unit)]
        $vis fn $name(level: $crate::cpu::SimdLevel, $($arg: $ty),*) -> $ret {
            #[inline(always)]
            #[allow(clippy::too_many_arguments, clippy::unused_unit)]
            fn body($($arg: $ty),*) -> $ret $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512bw,avx512cd,avx512dq,avx512vl,avx2,fma")]
            #[allow(clippy::too_many_arguments, clippy::unused_unit)]
            fn avx512($($arg: $ty),*) -> $ret {
                body($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            #[allow(clippy::too_many_arguments, clippy::unused_unit)]
            fn avx2($($arg: $ty),*) -> $ret {
                body($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            match level.min($crate::cpu::detected()) {
                // SAFETY: the CPU has AVX-512 F/BW/CD/DQ/VL, AVX2 and FMA (detected).
                $crate::cpu::SimdLevel::Avx512 => return unsafe { avx512($($arg),*) },
                // SAFETY: the CPU has AVX2 and FMA (detected).
                $crate::cpu::SimdLevel::Avx2 => return unsafe { avx2($($arg),*) },
                $crate::cpu::SimdLevel::Scalar => {}
            }
            let _ = level;
            body($($arg),*)
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_order_and_cap() {
        assert_eq!("AVX2".parse::<SimdLevel>().unwrap(), SimdLevel::Avx2);
        assert_eq!("x86-64-v4".parse::<SimdLevel>().unwrap(), SimdLevel::Avx512);
        assert_eq!("scalar".parse::<SimdLevel>().unwrap(), SimdLevel::Scalar);
        let e = "sse9".parse::<SimdLevel>().unwrap_err().to_string();
        assert!(
            e.contains("KD_SIMD") && e.contains("sse9") && e.contains("avx512"),
            "{e}"
        );
        assert!(SimdLevel::Scalar < SimdLevel::Avx2 && SimdLevel::Avx2 < SimdLevel::Avx512);
        assert!(level() <= detected());
        assert_eq!(supported().first(), Some(&SimdLevel::Scalar));
        assert_eq!(supported().last(), Some(&detected()));
        assert!(describe().contains(detected().name()));
    }

    #[test]
    fn detection_agrees_with_pulp() {
        #[cfg(target_arch = "x86_64")]
        {
            assert_eq!(
                pulp::x86::V3::try_new().is_some(),
                SimdLevel::Avx2.available()
            );
            assert_eq!(
                pulp::x86::V4::try_new().is_some(),
                SimdLevel::Avx512.available()
            );
        }
    }
}
