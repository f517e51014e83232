//! Shared helpers of the benchmark binaries: process memory readings and timing.

use std::time::Instant;

/// The machine line every bench prints first: CPU model, logical CPUs, the instruction-set
/// level the kernels use (`KD_SIMD` caps it) and the CPU's best. An error for an unreadable
/// `KD_SIMD`.
pub fn machine() -> anyhow::Result<String> {
    kd_kernels::cpu::requested()?;
    Ok(kd_kernels::cpu::describe())
}

/// Prints [`machine`] as `machine: …`.
pub fn print_machine() -> anyhow::Result<()> {
    println!("machine: {}", machine()?);
    Ok(())
}

/// A command running a PyTorch twin: `OMP_WAIT_POLICY=PASSIVE` (PyTorch's 2-thread runs
/// collapse under any other load without it, `docs/src/benchmarks.md`) and, when `KD_SIMD`
/// caps our kernels below the CPU's best, the same cap on PyTorch's side
/// (`ATEN_CPU_CAPABILITY`, `MKL_ENABLE_INSTRUCTIONS`, `ONEDNN_MAX_CPU_ISA`), so that both
/// sides of a comparison run the same instruction set: an AVX-512 machine stands in for an
/// AVX2-only one (same caches and clock, so not the same machine).
pub fn python_command(python: impl AsRef<std::ffi::OsStr>) -> std::process::Command {
    use kd_kernels::cpu::{SimdLevel, detected, level};
    let mut cmd = std::process::Command::new(python);
    cmd.env("OMP_WAIT_POLICY", "PASSIVE");
    if level() < detected() {
        let (aten, mkl, onednn) = match level() {
            SimdLevel::Scalar => ("default", "SSE4_2", "SSE41"),
            SimdLevel::Avx2 => ("avx2", "AVX2", "AVX2"),
            SimdLevel::Avx512 => ("avx512", "AVX512", "AVX512_CORE"),
        };
        cmd.env("ATEN_CPU_CAPABILITY", aten)
            .env("MKL_ENABLE_INSTRUCTIONS", mkl)
            .env("ONEDNN_MAX_CPU_ISA", onednn);
    }
    cmd
}

/// A field of `/proc/self/status` in bytes (`VmRSS`, `VmHWM`).
pub fn proc_status_bytes(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Resets the peak resident set size (`VmHWM`) to the current one (Linux ≥ 4.0).
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Peak memory above the current resident set while `f` runs: (result, extra bytes).
///
/// Measured as `VmHWM` after `f` minus `VmRSS` before it, with the peak reset first; the
/// result of `f` is kept alive until the reading, so it counts too.
pub fn peak_extra<R>(f: impl FnOnce() -> R) -> (R, Option<u64>) {
    let base = proc_status_bytes("VmRSS");
    let ok = reset_peak_rss();
    let r = f();
    let peak = proc_status_bytes("VmHWM");
    let extra = match (ok, base, peak) {
        (true, Some(b), Some(p)) => Some(p.saturating_sub(b)),
        _ => None,
    };
    (r, extra)
}

/// CPU time of this process (user + system), in seconds.
pub fn cpu_seconds() -> f64 {
    let Ok(text) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields 14 and 15 (utime, stime) follow the parenthesised command name.
    let rest = text.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// Median, min and max of `repeats` timed calls after `warmup` untimed ones, in ms, plus
/// CPU time / wall time over the timed calls.
pub fn time_ms(warmup: usize, repeats: usize, mut f: impl FnMut()) -> (f64, f64, f64, f64) {
    for _ in 0..warmup {
        f();
    }
    let cpu0 = cpu_seconds();
    let wall0 = Instant::now();
    let mut times: Vec<f64> = (0..repeats)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    let wall = wall0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    (
        median,
        times[0],
        times[times.len() - 1],
        cpu / wall.max(1e-9),
    )
}

/// The train-step benches' batch: `b` rows of `s` pseudo-random ids below `vocab` (a fixed LCG
/// stream), labels = ids, no padding.
pub fn random_batch(b: usize, s: usize, vocab: usize) -> kd_data::Batch {
    let mut state = 0x2545_F491u64;
    let ids: Vec<u32> = (0..b * s)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % vocab as u64) as u32
        })
        .collect();
    kd_data::Batch {
        batch_size: b,
        seq_len: s,
        input_ids: ids.clone(),
        attention_mask: vec![true; b * s],
        labels: ids.iter().map(|t| *t as i64).collect(),
        position_ids: (0..b).flat_map(|_| 0..s as i64).collect(),
        sequence_ids: vec![1; b * s],
        examples: (0..b).map(|i| vec![i]).collect(),
    }
}

/// The generation benches' prompts: `n` rows of `len` ids in `lo..vocab` from a fixed LCG
/// stream (seed 7).
pub fn random_prompts(n: usize, len: usize, lo: u64, vocab: u64) -> Vec<Vec<u32>> {
    let mut state = 7u64;
    (0..n)
        .map(|_| {
            (0..len)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (lo + (state >> 33) % (vocab - lo)) as u32
                })
                .collect()
        })
        .collect()
}

/// The median of timings.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The model shapes the benches run (random weights).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// bench-155m of `docs/src/benchmarks.md`.
    #[value(name = "bench-155m")]
    Bench155m,
    /// Llama-3.2-1B's configuration (`fixtures/configs/llama-3.2-1b-instruct.json`), the
    /// seed's draft.
    #[value(name = "seed-1b")]
    Seed1b,
}

impl Preset {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Bench155m => "bench-155m",
            Preset::Seed1b => "seed-1b",
        }
    }

    /// The model configuration.
    pub fn config(self) -> kd_model::Result<kd_model::LlamaConfig> {
        match self {
            Preset::Bench155m => Ok(kd_model::LlamaConfig::bench_155m()),
            Preset::Seed1b => kd_model::LlamaConfig::from_file(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../fixtures/configs/llama-3.2-1b-instruct.json"
            )),
        }
    }
}
