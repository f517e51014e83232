//! Memory read bandwidth: a 1 GiB f32 buffer summed by 1 and by all of rayon's threads (each
//! thread a contiguous part, eight lane sums so that the loop vectorises), the median of five
//! passes. What decoding at batch 1 is measured against: the weights read per token over this
//! figure is the fraction of the bandwidth limit a decoder reaches.
//!
//! `cargo run --release -p kd-benches --bin read_bandwidth`

use std::time::Instant;

use anyhow::Result;
use rayon::prelude::*;

/// Bytes read per pass.
const BYTES: usize = 1 << 30;

/// Eight lane sums of `x` (vectorised by the compiler).
fn lane_sum(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    for chunk in x.chunks_exact(8) {
        for (l, v) in lanes.iter_mut().zip(chunk) {
            *l += v;
        }
    }
    lanes.iter().sum()
}

/// GB/s of one pass over `buf` split into `threads` parts (the sum kept, so that it is computed).
fn pass(buf: &[f32], threads: usize) -> f64 {
    let part = buf.len().div_ceil(threads);
    let start = Instant::now();
    let sum: f32 = buf.par_chunks(part).map(lane_sum).sum();
    std::hint::black_box(sum);
    BYTES as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn main() -> Result<()> {
    kd_benches::print_machine()?;
    let buf: Vec<f32> = (0..BYTES / 4).map(|i| (i % 3) as f32).collect();
    let all = rayon::current_num_threads();
    for threads in [1, all] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()?;
        let mut rates: Vec<f64> = (0..6)
            .map(|_| pool.install(|| pass(&buf, threads)))
            .collect();
        rates.remove(0); // warm-up
        rates.sort_by(f64::total_cmp);
        println!(
            "read bandwidth, {threads} thread(s): {:.1} GB/s (median of 5 passes of 1 GiB; {:.1}–{:.1})",
            rates[2], rates[0], rates[4]
        );
    }
    Ok(())
}
