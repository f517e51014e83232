//! Golden-file access and comparison helpers.

use std::collections::HashMap;
use std::path::PathBuf;

use burn::tensor::{Device, Tensor, TensorData};
use safetensors::{Dtype, SafeTensors};

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

#[derive(Debug, Clone)]
pub struct Arr {
    pub shape: Vec<usize>,
    pub f: Vec<f64>,
    pub i: Vec<i64>,
}

impl Arr {
    pub fn f32s(&self) -> Vec<f32> {
        self.f.iter().map(|v| *v as f32).collect()
    }
}

pub fn golden() -> (Vec<serde_json::Value>, HashMap<String, Arr>) {
    let cases: Vec<serde_json::Value> = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("golden/kd-losses.json")).unwrap(),
    )
    .unwrap();
    let bytes = std::fs::read(fixtures().join("golden/kd-losses.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out = HashMap::new();
    for (k, v) in st.tensors() {
        let d = v.data();
        let (f, i) = match v.dtype() {
            Dtype::F32 => (
                d.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                vec![],
            ),
            Dtype::F64 => (
                d.chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
                vec![],
            ),
            Dtype::I64 => (
                vec![],
                d.chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
            ),
            other => panic!("{k}: {other:?}"),
        };
        out.insert(
            k,
            Arr {
                shape: v.shape().to_vec(),
                f,
                i,
            },
        );
    }
    (cases, out)
}

pub fn cpu() -> Device {
    Device::flex()
}

pub fn t2(a: &Arr, device: &Device) -> Tensor<2> {
    Tensor::from_data(TensorData::new(a.f32s(), [a.shape[0], a.shape[1]]), device)
}

pub fn vec_f32(t: Tensor<2>) -> Vec<f32> {
    t.into_data().try_into_vec_as::<f32>().unwrap()
}

pub fn scalar(t: Tensor<1>) -> f64 {
    t.into_data().try_into_vec_as::<f32>().unwrap()[0] as f64
}

/// |a − b| ≤ rtol · |b| + atol.
pub fn close(a: f64, b: f64, rtol: f64, atol: f64) -> bool {
    (a - b).abs() <= rtol * b.abs() + atol
}

/// Max |a − b| relative to max |b| (or absolute when b is all zero).
pub fn max_rel(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    a.iter()
        .zip(b)
        .fold(0f64, |m, (x, y)| m.max((*x as f64 - y).abs()))
        / scale
}
