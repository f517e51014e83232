//! The devices this build reaches: the CPU, every wgpu adapter (`wgpu:N`) with what it
//! computes in, and the GPU `benches/gpu.sh` picks by default (the first hardware adapter,
//! else the first one).
//!
//! `cargo run --release -p kd-benches --bin devices`

use anyhow::Result;
use burn::tensor::DType;
use kd_model::{
    device::adapters, device::cuda_compiled, device::describe, device::wgpu_compiled, parse_device,
};

fn main() -> Result<()> {
    kd_benches::print_machine()?;
    println!("cpu: {}", describe(&parse_device("cpu")?));
    println!(
        "features: wgpu {}, cuda {}",
        if wgpu_compiled() { "on" } else { "off" },
        if cuda_compiled() { "on" } else { "off" }
    );
    let all = adapters();
    if all.is_empty() && wgpu_compiled() {
        println!(
            "no wgpu adapter: install a Vulkan driver (Debian: apt-get install \
             mesa-vulkan-drivers libvulkan1)"
        );
    }
    for a in &all {
        let dtypes: Vec<&str> = [
            (DType::F32, "f32"),
            (DType::F16, "f16"),
            (DType::BF16, "bf16"),
        ]
        .into_iter()
        .filter(|(d, _)| a.device.supports_dtype(*d))
        .map(|(_, n)| n)
        .collect();
        println!(
            "wgpu:{}: {} ({}; {}; computes in {})",
            a.index,
            a.name,
            a.target,
            if a.hardware { "hardware" } else { "software" },
            dtypes.join(", ")
        );
    }
    if cuda_compiled() {
        println!("default GPU: cuda:0 {}", describe(&parse_device("cuda:0")?));
    } else if let Some(a) = all.iter().find(|a| a.hardware).or_else(|| all.first()) {
        println!("default GPU: wgpu:{} {}", a.index, a.name);
    }
    Ok(())
}
