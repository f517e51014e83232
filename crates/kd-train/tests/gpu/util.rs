//! The device, fixtures and comparisons.

use std::path::PathBuf;

use burn::tensor::{Device, Tensor};
use kd_model::Llama;

/// The GPU to test on and a description of it, or why there is none.
pub fn gpu_device() -> Result<(Device, String), String> {
    if let Ok(name) = std::env::var("KD_GPU_DEVICE") {
        let device = kd_model::parse_device(&name).map_err(|e| e.to_string())?;
        let about = format!("{name}: {}", kd_model::device::describe(&device));
        return Ok((device, about));
    }
    if !kd_model::device::wgpu_compiled() {
        return Err("this build has no wgpu backend (the `wgpu` feature of kd-model)".into());
    }
    let adapters = kd_model::device::adapters();
    let chosen = adapters
        .iter()
        .find(|a| a.hardware)
        .or_else(|| adapters.first())
        .ok_or("no Vulkan, Metal or DX12 adapter found")?;
    Ok((
        chosen.device.clone(),
        format!(
            "wgpu:{} {}{} ({})",
            chosen.index,
            chosen.name,
            if chosen.hardware { "" } else { ", software" },
            chosen.target
        ),
    ))
}

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

pub fn model_dir(name: &str) -> PathBuf {
    fixtures().join("tiny-models").join(name)
}

pub fn cpu() -> Device {
    Device::flex()
}

pub fn load(name: &str, device: &Device) -> Llama {
    Llama::load(model_dir(name), device).unwrap_or_else(|e| panic!("{name}: {e}"))
}

pub fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32 values")
}

/// max |a − b|.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// max |a − b| / max(1, max |b|).
pub fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(1f32, |m, y| m.max(y.abs()));
    max_diff(a, b) / scale
}

/// Asserts `max |a − b| ≤ tol` and prints the figure.
pub fn assert_close(what: &str, a: &[f32], b: &[f32], tol: f32) {
    let d = max_diff(a, b);
    println!("  {what}: max |Δ| = {d:.2e} (tolerance {tol:.0e})");
    assert!(d <= tol, "{what}: max |Δ| = {d} > {tol}");
}

/// Asserts `max |a − b| / max(1, max |b|) ≤ tol` and prints the figure.
pub fn assert_rel(what: &str, a: &[f32], b: &[f32], tol: f32) {
    let d = rel_diff(a, b);
    println!("  {what}: max |Δ| / max(1, |ref|) = {d:.2e} (tolerance {tol:.0e})");
    assert!(d <= tol, "{what}: relative Δ = {d} > {tol}");
}

/// Deterministic values in [-scale, scale).
pub fn pseudo(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}
