//! A draft's `model.safetensors`: reading floats (f32, bf16, f16), `d2t` (i64) and `t2d`
//! (bool), and writing tensors.

use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use crate::error::{ModelError, Result};

/// Reads the tensors of one safetensors file as f32 (floats), i64 (`d2t`) or bool (`t2d`).
pub(super) struct WeightsFile {
    path: std::path::PathBuf,
    bytes: Vec<u8>,
}

impl WeightsFile {
    pub(super) fn open(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
        SafeTensors::deserialize(&bytes).map_err(|e| ModelError::Safetensors {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            bytes,
        })
    }

    pub(super) fn tensors(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).expect("checked when opened")
    }

    pub(super) fn has(&self, name: &str) -> bool {
        self.tensors().tensor(name).is_ok()
    }

    pub(super) fn error(&self, name: &str, message: String) -> ModelError {
        ModelError::Safetensors {
            path: self.path.clone(),
            message: format!("{name}: {message}"),
        }
    }

    pub(super) fn floats(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let st = self.tensors();
        let view = st
            .tensor(name)
            .map_err(|_| self.error(name, "missing".into()))?;
        if view.shape() != shape {
            return Err(self.error(
                name,
                format!("shape {:?}, expected {shape:?}", view.shape()),
            ));
        }
        let data = view.data();
        Ok(match view.dtype() {
            Dtype::F32 => data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::BF16 => data
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F16 => data
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => return Err(self.error(name, format!("dtype {other:?}, expected a float"))),
        })
    }

    pub(super) fn ints(&self, name: &str) -> Result<Vec<i64>> {
        let st = self.tensors();
        let view = st
            .tensor(name)
            .map_err(|_| self.error(name, "missing".into()))?;
        match view.dtype() {
            Dtype::I64 => Ok(view
                .data()
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect()),
            other => Err(self.error(name, format!("dtype {other:?}, expected I64"))),
        }
    }
}

/// The bytes of a safetensors file holding `tensors` (name, dtype, shape, data), with
/// PyTorch's `format` metadata; `path` names the file in an error.
pub(super) fn serialize_tensors<'a>(
    tensors: impl Iterator<Item = (&'a str, Dtype, &'a [usize], &'a [u8])>,
    path: &Path,
) -> Result<Vec<u8>> {
    struct View<'a>(Dtype, &'a [usize], &'a [u8]);
    impl safetensors::View for View<'_> {
        fn dtype(&self) -> Dtype {
            self.0
        }
        fn shape(&self) -> &[usize] {
            self.1
        }
        fn data(&self) -> std::borrow::Cow<'_, [u8]> {
            std::borrow::Cow::Borrowed(self.2)
        }
        fn data_len(&self) -> usize {
            self.2.len()
        }
    }
    let metadata = Some(std::collections::HashMap::from([(
        "format".to_string(),
        "pt".to_string(),
    )]));
    safetensors::serialize(
        tensors.map(|(n, dt, shape, bytes)| (n, View(dt, shape, bytes))),
        metadata,
    )
    .map_err(|e| ModelError::Safetensors {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}
