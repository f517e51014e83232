//! The host all-reduce of data-parallel training (`kd_dist`, Open MPI loaded at run time)
//! beside its PyTorch twin (`torch.distributed` with the gloo backend, what CPU data-parallel
//! PyTorch uses), same buffer, same ranks, one run.
//!
//! Started alone, it starts itself under `mpirun -np N` (and then the twin); each rank sums a
//! buffer of `--params` f32 values (default 45 M: the seed's r = 64 LoRA adapters on
//! Llama-3.2-1B, ~180 MB) `--iters` times after one warm-up, then the same values in f64 (what
//! the trainer all-reduces: it sums sharded gradients in f64). Reports the median time per
//! all-reduce, the algorithm bandwidth (buffer bytes / time) and the bus bandwidth
//! (× 2(N−1)/N, the bytes each rank moves in a ring).
//!
//! `cargo run --release -p kd-benches --bin allreduce -- --ranks 2 --params 45000000`

use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// Ranks.
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// f32 values per all-reduce.
    #[arg(long, default_value_t = 45_000_000)]
    params: usize,
    /// Timed all-reduces (after one warm-up).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// The Python with torch for the twin; none: skip it.
    #[arg(long, default_value = "python3")]
    python: String,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let world = kd_dist::init()?;
    if world.is_distributed() {
        let out = rank(world, &args);
        kd_dist::exit(u8::from(out.is_err()));
        return out;
    }
    // Alone: start the ranks, then the twin.
    let exe = std::env::current_exe()?;
    let Some(mut cmd) = kd_dist::local_mpirun(args.ranks) else {
        bail!("no mpirun found: install Open MPI (Debian: openmpi-bin)");
    };
    let status = cmd
        .arg(exe)
        .args(std::env::args().skip(1))
        .status()
        .context("starting mpirun")?;
    if !status.success() {
        bail!("the ranks failed: {status}");
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/allreduce_pytorch.py");
    if args.python != "none" {
        let status = Command::new(&args.python)
            .arg(script)
            .args(["--ranks", &args.ranks.to_string()])
            .args(["--params", &args.params.to_string()])
            .args(["--iters", &args.iters.to_string()])
            .status();
        match status {
            Ok(s) if s.success() => {}
            other => println!("pytorch twin did not run ({other:?}): {script}"),
        }
    }
    Ok(())
}

fn rank(world: &kd_dist::World, args: &Args) -> Result<()> {
    let n = world.size() as f64;
    let library = world.library().unwrap_or_default();
    let library = library.split(',').next().unwrap_or_default().to_string();
    let report = |dtype: &str, bytes: usize, times: &mut Vec<f64>| {
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let mb = bytes as f64 / 1e6;
        if world.is_root() {
            println!(
                "kd_dist ({library}) {} ranks, {mb:.1} MB {dtype}: median {:.1} ms, algbw {:.0} MB/s, busbw {:.0} MB/s",
                world.size(),
                median * 1e3,
                mb / median,
                mb / median * 2.0 * (n - 1.0) / n
            );
        }
    };
    // f32: what a plain all-reduce of the gradients moves.
    let mut buf: Vec<f32> = (0..args.params)
        .map(|i| (i % 97) as f32 * 1e-3 + world.rank() as f32)
        .collect();
    world.all_reduce_sum_f32(&mut buf)?;
    // Check the sum once: Σ_r (x + r) = N·x + N(N−1)/2.
    let nf = world.size() as f32;
    for (i, v) in buf.iter().enumerate().step_by(4099) {
        let want = (i % 97) as f32 * 1e-3 * nf + nf * (nf - 1.0) / 2.0;
        if (v - want).abs() > 1e-3 * want.abs().max(1.0) {
            bail!("element {i}: {v} where {want} was expected");
        }
    }
    let mut times = Vec::with_capacity(args.iters);
    for _ in 0..args.iters {
        world.barrier()?;
        let t = Instant::now();
        world.all_reduce_sum_f32(&mut buf)?;
        times.push(t.elapsed().as_secs_f64());
    }
    report("f32", args.params * 4, &mut times);
    drop(buf);
    // f64: what the trainer moves (it sums sharded gradients in f64).
    let mut wide: Vec<f64> = (0..args.params).map(|i| (i % 97) as f64).collect();
    world.all_reduce_sum_f64(&mut wide)?;
    let mut times = Vec::with_capacity(args.iters);
    for _ in 0..args.iters {
        world.barrier()?;
        let t = Instant::now();
        world.all_reduce_sum_f64(&mut wide)?;
        times.push(t.elapsed().as_secs_f64());
    }
    report("f64", args.params * 8, &mut times);
    Ok(())
}
