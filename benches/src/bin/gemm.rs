//! The f32 GEMM on the train step's shapes (bench-155m: batch 4 × 256 = 1024 rows; the
//! projections 512 → 512 / 1408 and back, the LM head against a vocabulary block of 32768), at
//! every instruction-set level this CPU runs (`kd_kernels::gemm::matmul_at`), beside PyTorch's
//! `a @ b` (`benches/gemm_pytorch.py`) at its default level and capped to AVX2 the way
//! `kd_benches::python_command` caps it.
//!
//! `cargo run --release -p kd-benches --bin gemm -- --python <venv>/bin/python`

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Parser;
use kd_kernels::cpu::{SimdLevel, supported};
use kd_kernels::gemm::{MatMut, MatRef, Threads, Write, matmul_at};

#[derive(Parser, Debug)]
struct Args {
    /// Timed repetitions per shape (median reported).
    #[arg(long, default_value_t = 7)]
    repeats: usize,
    /// Python with torch for the PyTorch column.
    #[arg(long)]
    python: Option<PathBuf>,
}

/// `(m, k, n)`: rows × inner × columns.
const SHAPES: [(usize, usize, usize); 5] = [
    (1024, 512, 512),
    (1024, 512, 1408),
    (1024, 1408, 512),
    (1024, 512, 32768),
    // The LM head's hidden gradient over the whole vocabulary (a long inner dimension: the
    // k-split path of `kd_kernels::gemm`).
    (1024, 128_256, 512),
];

fn rate(level: SimdLevel, (m, k, n): (usize, usize, usize), repeats: usize) -> f64 {
    let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.25 - 0.75).collect();
    let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 * 0.5 - 1.0).collect();
    let mut c = vec![0f32; m * n];
    let (ms, ..) = kd_benches::time_ms(1, repeats, || {
        matmul_at(
            level,
            MatMut::row_major(&mut c, m, n).expect("shape"),
            MatRef::row_major(&a, m, k).expect("shape"),
            MatRef::row_major(&b, k, n).expect("shape"),
            Write::Overwrite,
            1.0,
            Threads::All,
        )
        .expect("shape")
    });
    (m * k * n) as f64 / (ms * 1e-3) / 1e9
}

fn main() -> Result<()> {
    let args = Args::parse();
    kd_benches::print_machine()?;
    for level in supported().into_iter().rev() {
        for shape in SHAPES {
            let (m, k, n) = shape;
            println!(
                "ours    {:<6} [{m}×{k}]·[{k}×{n}]: {:.1} G multiply-adds/s",
                level.name(),
                rate(level, shape, args.repeats)
            );
        }
    }
    if let Some(py) = &args.python {
        for cap in [None, Some("avx2")] {
            let mut cmd = kd_benches::python_command(py);
            if let Some(cap) = cap {
                cmd.env("ATEN_CPU_CAPABILITY", cap)
                    .env("MKL_ENABLE_INSTRUCTIONS", "AVX2")
                    .env("ONEDNN_MAX_CPU_ISA", "AVX2");
            }
            let status = cmd
                .arg("benches/gemm_pytorch.py")
                .args(["--repeats", &args.repeats.to_string()])
                .args(["--label", cap.unwrap_or("native")])
                .status()?;
            if !status.success() {
                bail!("the PyTorch script failed");
            }
        }
    }
    Ok(())
}
