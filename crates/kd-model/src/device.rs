//! Device names.
//!
//! | name | device | feature |
//! |---|---|---|
//! | `cpu` | Burn's pure-Rust flex backend, with this crate's fused kernels | always |
//! | `wgpu`, `wgpu:N` | the default / the N-th adapter of Burn's wgpu backend (Vulkan, Metal, DX12; shaders compiled at run time) | `wgpu` (default) |
//! | `vulkan[:N]`, `metal[:N]` | the default / the N-th adapter wgpu finds on that graphics API, pinned to it | `wgpu` |
//! | `cuda`, `cuda:N` | CUDA device N | `cuda` (its first build downloads an LLVM bundle) |
//!
//! A bare index (`0`, as the seed's `--target_gpus 0,1` gives them) names a hardware GPU: the
//! CUDA device in a CUDA build, otherwise the N-th wgpu adapter that is a GPU (software
//! rasterizers such as lavapipe are left out; name them with `wgpu:N`).
//!
//! Asking for a device this build cannot reach is an error that names the feature to build
//! with, never a silent CPU run.

use burn::tensor::Device;

use crate::error::{ModelError, Result};

/// Parses a device name (see the [module docs](self)).
pub fn parse_device(name: &str) -> Result<Device> {
    let err = |message: String| ModelError::Device {
        name: name.to_string(),
        message,
    };
    let trimmed = name.trim();
    if trimmed == "cpu" {
        return Ok(Device::flex());
    }
    if trimmed.chars().all(|c| c.is_ascii_digit()) && !trimmed.is_empty() {
        let index = trimmed
            .parse::<usize>()
            .map_err(|e| err(format!("not a GPU index: {e}")))?;
        return gpu(index).map_err(err);
    }
    let (family, index) = match trimmed.split_once(':') {
        Some((family, n)) => {
            let index = n.parse::<usize>().map_err(|_| {
                err(format!(
                    "expected `{family}:N` with N a device index, e.g. `{family}:0`"
                ))
            })?;
            (family, Some(index))
        }
        None => (trimmed, None),
    };
    match family {
        "cuda" => {
            cuda_device(index.unwrap_or(0)).ok_or_else(|| {
                err("this build has no CUDA support: rebuild with `--features cuda` (needs network \
                 access on first build), use a wgpu device (`wgpu:0`, feature `wgpu`), or `cpu`"
                .into())
            })
        }
        "wgpu" | "vulkan" | "metal" => {
            let api = match family {
                "vulkan" => Some(GraphicsApi::Vulkan),
                "metal" => Some(GraphicsApi::Metal),
                _ => None,
            };
            wgpu_device(api, index).map_err(err)
        }
        _ => Err(err(
            "unknown device: expected `cpu`, `wgpu[:N]`, `vulkan[:N]`, `metal[:N]`, `cuda[:N]` \
             or a GPU index"
                .into(),
        )),
    }
}

/// Parses a comma-separated device list (`"cuda:0,cuda:1"`, `"wgpu:0"`, or GPU indices
/// `"0,1"` as the seed's `--target_gpus` gives them).
pub fn parse_device_list(list: &str) -> Result<Vec<Device>> {
    list.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(parse_device)
        .collect()
}

/// Whether this build has CUDA support (the `cuda` feature).
pub fn cuda_compiled() -> bool {
    cfg!(feature = "cuda")
}

/// Whether this build has Burn's wgpu backend (the `wgpu` feature).
pub fn wgpu_compiled() -> bool {
    cfg!(feature = "wgpu")
}

/// Whether a bare GPU index (`--target_gpus 0`) can name a device in this build: CUDA is
/// compiled in, or wgpu sees at least one hardware GPU.
pub fn gpus_available() -> bool {
    cuda_compiled() || adapters().iter().any(|a| a.hardware)
}

/// The graphics API a wgpu device runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraphicsApi {
    /// Vulkan (Linux, Windows, Android; lavapipe in CI).
    Vulkan,
    /// Metal (macOS, iOS).
    Metal,
}

impl GraphicsApi {
    #[cfg_attr(not(feature = "wgpu"), allow(dead_code))]
    fn name(self) -> &'static str {
        match self {
            GraphicsApi::Vulkan => "vulkan",
            GraphicsApi::Metal => "metal",
        }
    }
}

/// One adapter of Burn's wgpu backend, as `wgpu:N` names it.
#[derive(Debug, Clone)]
pub struct Adapter {
    /// `N` in `wgpu:N`.
    pub index: usize,
    /// The name the driver reports (`NVIDIA GeForce RTX 4090`, `llvmpipe (LLVM 15.0.6, 256 bits)`).
    pub name: String,
    /// The runtime's fingerprint of the adapter (its PCI vendor and device ids), which keys
    /// compiled kernels and measurements.
    pub target: String,
    /// A card on a bus (`false` for a software rasterizer such as lavapipe).
    pub hardware: bool,
    /// The device, ready to use.
    pub device: Device,
}

/// Every adapter of Burn's wgpu backend, in `wgpu:N` order (empty without the `wgpu`
/// feature or without a Vulkan/Metal/DX12 driver). Opens each device.
pub fn adapters() -> Vec<Adapter> {
    wgpu_adapters()
}

/// A one-line description of a device: its backend and, for a GPU, the adapter's name.
pub fn describe(device: &Device) -> String {
    let device = device.clone().without_autodiff();
    if device == Device::flex() {
        return "cpu (Burn flex backend, fused kernels)".into();
    }
    describe_gpu(&device)
}

/// The device of a bare GPU index: CUDA device `index` in a CUDA build, otherwise the
/// `index`-th hardware wgpu adapter.
fn gpu(index: usize) -> std::result::Result<Device, String> {
    if let Some(device) = cuda_device(index) {
        return Ok(device);
    }
    if !wgpu_compiled() {
        return Err(
            "a bare index names a GPU, and this build has none: rebuild with \
                    `--features wgpu` (or `cuda`), or use `cpu`"
                .into(),
        );
    }
    let all = adapters();
    let hardware: Vec<&Adapter> = all.iter().filter(|a| a.hardware).collect();
    match hardware.get(index) {
        Some(a) => Ok(a.device.clone()),
        None => Err(format!(
            "a bare index names a hardware GPU, and this machine has {} ({}); name a software \
             adapter as `wgpu:N`, build with `--features cuda` for CUDA, or use `cpu`",
            hardware.len(),
            list_adapters(&all)
        )),
    }
}

fn list_adapters(all: &[Adapter]) -> String {
    if all.is_empty() {
        return "no wgpu adapter: install a Vulkan driver (Debian: `apt-get install \
                mesa-vulkan-drivers libvulkan1`)"
            .into();
    }
    all.iter()
        .map(|a| {
            format!(
                "wgpu:{} {}{}",
                a.index,
                a.name,
                if a.hardware { "" } else { " (software)" }
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(feature = "cuda")]
fn cuda_device(index: usize) -> Option<Device> {
    Some(Device::cuda(index))
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(_index: usize) -> Option<Device> {
    None
}

#[cfg(feature = "wgpu")]
fn wgpu_adapters() -> Vec<Adapter> {
    use burn::tensor::DeviceType;
    Device::enumerate(DeviceType::Wgpu)
        .into_vec()
        .into_iter()
        .enumerate()
        .map(|(index, device)| {
            let identity = device.identity();
            Adapter {
                index,
                name: identity
                    .as_ref()
                    .map_or_else(|| "unknown adapter".into(), |i| i.name.clone()),
                target: identity
                    .as_ref()
                    .map_or_else(String::new, |i| i.fingerprint.clone()),
                hardware: identity.as_ref().is_some_and(|i| i.physical.is_some()),
                device,
            }
        })
        .collect()
}

#[cfg(not(feature = "wgpu"))]
fn wgpu_adapters() -> Vec<Adapter> {
    Vec::new()
}

#[cfg(feature = "wgpu")]
fn wgpu_device(
    api: Option<GraphicsApi>,
    index: Option<usize>,
) -> std::result::Result<Device, String> {
    use burn::tensor::DeviceKind;
    let Some(api) = api else {
        return match index {
            // The device is lazy: check now that there is something for it to land on.
            None if adapters().is_empty() => Err(list_adapters(&[])),
            None => Ok(Device::wgpu(DeviceKind::DefaultDevice)),
            Some(n) => {
                let all = adapters();
                all.get(n).map(|a| a.device.clone()).ok_or_else(|| {
                    format!(
                        "no wgpu adapter {n}: this machine has {} ({})",
                        all.len(),
                        list_adapters(&all)
                    )
                })
            }
        };
    };
    pinned_device(api, index)
}

/// The adapter `index` (default: wgpu's choice) of `api`'s own list, pinned to that API.
#[cfg(feature = "wgpu")]
fn pinned_device(api: GraphicsApi, index: Option<usize>) -> std::result::Result<Device, String> {
    use burn::tensor::wgpu::wgpu;
    use burn_dispatch::devices::{WgpuBackend, WgpuDevice, WgpuDeviceKind};
    let (backends, backend) = match api {
        GraphicsApi::Vulkan => (wgpu::Backends::VULKAN, WgpuBackend::Vulkan),
        GraphicsApi::Metal => (wgpu::Backends::METAL, WgpuBackend::Metal),
    };
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let infos: Vec<wgpu::AdapterInfo> =
        futures_lite::future::block_on(instance.enumerate_adapters(backends))
            .iter()
            .map(|a| a.get_info())
            .collect();
    if infos.is_empty() {
        return Err(format!(
            "no {} adapter on this machine{}",
            api.name(),
            if api == GraphicsApi::Vulkan {
                " (Debian: `apt-get install mesa-vulkan-drivers libvulkan1`)"
            } else {
                ""
            }
        ));
    }
    let kind = match index {
        None => WgpuDeviceKind::DefaultDevice,
        Some(n) => {
            let Some(info) = infos.get(n) else {
                return Err(format!(
                    "no {} adapter {n}: this machine has {}: {}",
                    api.name(),
                    infos.len(),
                    infos
                        .iter()
                        .enumerate()
                        .map(|(i, a)| format!("{}:{i} {}", api.name(), a.name))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            };
            // wgpu counts each device type on its own (`DiscreteGpu(1)` is the second
            // discrete GPU), so find this adapter's place among those of its type.
            let same = infos[..n]
                .iter()
                .filter(|a| a.device_type == info.device_type)
                .count();
            match info.device_type {
                wgpu::DeviceType::DiscreteGpu => WgpuDeviceKind::DiscreteGpu(same),
                wgpu::DeviceType::IntegratedGpu => WgpuDeviceKind::IntegratedGpu(same),
                wgpu::DeviceType::VirtualGpu => WgpuDeviceKind::VirtualGpu(same),
                wgpu::DeviceType::Cpu => WgpuDeviceKind::Cpu,
                wgpu::DeviceType::Other => WgpuDeviceKind::Other(same),
            }
        }
    };
    Ok(Device::new(WgpuDevice::new(kind).on(backend)))
}

#[cfg(not(feature = "wgpu"))]
fn wgpu_device(
    _api: Option<GraphicsApi>,
    _index: Option<usize>,
) -> std::result::Result<Device, String> {
    Err(
        "this build has no wgpu support: rebuild with `--features wgpu` (the default \
         features include it), or use `cpu`"
            .into(),
    )
}

#[cfg(feature = "wgpu")]
fn describe_gpu(device: &Device) -> String {
    match device.identity() {
        Some(i) => format!(
            "{}{} — {device:?}",
            i.name,
            if i.physical.is_some() {
                ""
            } else {
                " (software)"
            }
        ),
        None => format!("{device:?}"),
    }
}

#[cfg(not(feature = "wgpu"))]
fn describe_gpu(device: &Device) -> String {
    format!("{device:?}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_parses() {
        assert!(parse_device("cpu").is_ok());
        assert!(parse_device_list("cpu").unwrap().len() == 1);
        assert!(describe(&parse_device("cpu").unwrap()).starts_with("cpu"));
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_feature_is_a_clear_error() {
        for name in ["cuda", "cuda:1"] {
            let e = parse_device_list(name).unwrap_err().to_string();
            assert!(e.contains("--features cuda"), "{e}");
        }
    }

    #[cfg(not(feature = "wgpu"))]
    #[test]
    fn wgpu_without_feature_is_a_clear_error() {
        for name in ["wgpu", "wgpu:0", "vulkan:0", "metal", "0"] {
            let e = parse_device_list(name).unwrap_err().to_string();
            assert!(e.contains("--features wgpu"), "{e}");
        }
    }

    /// A bare index never lands on a software rasterizer, and out-of-range adapters are
    /// refused with the list of those that exist.
    #[cfg(all(feature = "wgpu", not(feature = "cuda")))]
    #[test]
    fn indices_name_hardware_gpus_and_out_of_range_lists_adapters() {
        let all = adapters();
        let hardware = all.iter().filter(|a| a.hardware).count();
        let e = parse_device(&hardware.to_string()).unwrap_err().to_string();
        assert!(e.contains("hardware GPU"), "{e}");
        let e = parse_device(&format!("wgpu:{}", all.len()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no wgpu adapter"), "{e}");
        for a in &all {
            let d = parse_device(&format!("wgpu:{}", a.index)).unwrap();
            assert!(d == a.device);
        }
    }

    #[test]
    fn bad_names() {
        for name in ["gpu", "cuda:x", "cuda1", "wgpu:", "wgpu:-1", "vulkan:x"] {
            let e = parse_device(name).unwrap_err().to_string();
            assert!(e.contains(name), "{e}");
        }
    }
}
