//! For the test harnesses of crates built on these kernels: run a test binary's
//! kernel-level cases again at every lower instruction-set level.
//!
//! The level is fixed per process ([`cpu::level`] reads
//! [`SIMD_ENV`] once), so a test at another level is a child process:
//! [`rerun_at_lower_levels`] starts the running test binary again with `KD_SIMD` set, once
//! per level below the one in use, with libtest filters that select the cases. An AVX-512
//! machine thereby runs every case at AVX-512, AVX2 and scalar; an AVX2 machine at AVX2 and
//! scalar.
//!
//! [`beside_other_draws`] runs work while another thread keeps reseeding Burn's CPU random
//! generator (one for the whole process) and drawing from it: what draws from a seed of its
//! own gives the same values.

use std::process::Command;

use crate::cpu::{self, SIMD_ENV, SimdLevel};

/// Set in the children [`rerun_at_lower_levels`] starts, so that they do not start more.
pub const RERUN_ENV: &str = "KD_SIMD_RERUN";

/// One child run of a test binary.
#[derive(Debug)]
pub struct LevelRun {
    /// The level the child ran at.
    pub level: SimdLevel,
    /// Whether it exited successfully.
    pub success: bool,
    /// Tests it reported as passed (libtest's `test result: ok. N passed` lines, summed).
    pub passed: usize,
    /// Its standard output and error, for the failure message.
    pub output: String,
}

/// Runs the current test binary again once per supported level below
/// [`cpu::level`], with `KD_SIMD` set to that level and the libtest
/// arguments `filters` (test-name filters, e.g. `ops::`) followed by `--skip` for each of
/// `skip` (e.g. the calling test's own name). Nothing is run inside such a child (so
/// children never start children). An error when the binary cannot be started.
pub fn rerun_at_lower_levels(filters: &[&str], skip: &[&str]) -> std::io::Result<Vec<LevelRun>> {
    if std::env::var_os(RERUN_ENV).is_some() {
        return Ok(Vec::new());
    }
    let exe = std::env::current_exe()?;
    let mut runs = Vec::new();
    for level in cpu::supported().into_iter().filter(|l| *l < cpu::level()) {
        let mut cmd = Command::new(&exe);
        cmd.args(filters);
        for s in skip {
            cmd.args(["--skip", s]);
        }
        let out = cmd
            .env(SIMD_ENV, level.name())
            .env(RERUN_ENV, "1")
            .output()?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let passed = text
            .lines()
            .filter_map(|l| l.trim().strip_prefix("test result: ok."))
            .filter_map(|rest| rest.split_whitespace().next()?.parse::<usize>().ok())
            .sum();
        runs.push(LevelRun {
            level,
            success: out.status.success(),
            passed,
            output: text,
        });
    }
    Ok(runs)
}

/// [`rerun_at_lower_levels`] with its checks: panics, with the child's output, when a child
/// fails or runs no test (a filter that matches nothing would otherwise pass silently).
/// Returns the levels run.
pub fn assert_passes_at_lower_levels(filters: &[&str], skip: &[&str]) -> Vec<SimdLevel> {
    let runs = rerun_at_lower_levels(filters, skip).expect("start the test binary again");
    for r in &runs {
        assert!(
            r.success && r.passed > 0,
            "at KD_SIMD={} the tests {filters:?} {}:\n{}",
            r.level,
            if r.success { "ran no test" } else { "failed" },
            r.output
        );
    }
    runs.into_iter().map(|r| r.level).collect()
}

/// Runs `f` on this thread while another thread keeps reseeding Burn's CPU random generator
/// (one for the whole process) and drawing from it; the other thread has drawn before `f`
/// starts and stops when `f` returns or panics.
#[cfg(feature = "flex")]
pub fn beside_other_draws<R>(f: impl FnOnce() -> R) -> R {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    /// Stops the other thread when `f` returns or unwinds.
    struct Stop<'a>(&'a AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let (stop, draws) = (AtomicBool::new(false), AtomicU64::new(0));
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let device = burn::tensor::Device::flex();
            while !stop.load(Ordering::Relaxed) {
                device.seed(draws.fetch_add(1, Ordering::Relaxed));
                let _ = burn::tensor::Tensor::<2>::random(
                    [16, 16],
                    burn::tensor::Distribution::Default,
                    &device,
                );
            }
        });
        let _stop = Stop(&stop);
        while draws.load(Ordering::Relaxed) == 0 {
            std::hint::spin_loop();
        }
        f()
    })
}
