//! Device names: `cpu` (Burn's pure-Rust flex backend) and `cuda:N` (feature `cuda`).

use burn::tensor::Device;

use crate::error::{ModelError, Result};

/// Parses a device name: `cpu`, `cuda` (= `cuda:0`) or `cuda:N`.
///
/// Asking for CUDA in a build without the `cuda` feature is an error, never a silent CPU run.
pub fn parse_device(name: &str) -> Result<Device> {
    let err = |message: &str| ModelError::Device {
        name: name.to_string(),
        message: message.to_string(),
    };
    let trimmed = name.trim();
    if trimmed == "cpu" {
        return Ok(Device::flex());
    }
    let index = match trimmed.strip_prefix("cuda") {
        Some("") => 0,
        Some(rest) => rest
            .strip_prefix(':')
            .and_then(|n| n.parse::<usize>().ok())
            .ok_or_else(|| err("expected `cuda:N` with N a GPU index, e.g. `cuda:0`"))?,
        None => return Err(err("unknown device: expected `cpu` or `cuda:N`")),
    };
    cuda_device(index).ok_or_else(|| {
        err(
            "this build has no CUDA support: rebuild with `--features cuda` (needs network \
             access on first build), or use `cpu`",
        )
    })
}

/// Whether this build has CUDA support (the `cuda` feature).
pub fn cuda_compiled() -> bool {
    cfg!(feature = "cuda")
}

/// Parses a comma-separated device list (`"cuda:0,cuda:1"`, or GPU indices `"0,1"` as the
/// seed's `--target_gpus` gives them).
pub fn parse_device_list(list: &str) -> Result<Vec<Device>> {
    list.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            let s = s.trim();
            if s.chars().all(|c| c.is_ascii_digit()) {
                parse_device(&format!("cuda:{s}"))
            } else {
                parse_device(s)
            }
        })
        .collect()
}

#[cfg(feature = "cuda")]
fn cuda_device(index: usize) -> Option<Device> {
    Some(Device::cuda(index))
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(_index: usize) -> Option<Device> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_parses() {
        assert!(parse_device("cpu").is_ok());
        assert!(parse_device_list("cpu").unwrap().len() == 1);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_feature_is_a_clear_error() {
        for name in ["cuda", "cuda:1", "0"] {
            let e = parse_device_list(name).unwrap_err().to_string();
            assert!(e.contains("--features cuda"), "{e}");
        }
    }

    #[test]
    fn bad_names() {
        for name in ["gpu", "cuda:x", "cuda1"] {
            let e = parse_device(name).unwrap_err().to_string();
            assert!(e.contains(name), "{e}");
        }
    }
}
