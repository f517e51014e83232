//! Shared helpers: fixture paths and golden-file access.

use std::collections::HashMap;
use std::path::PathBuf;

use burn::tensor::{Device, Tensor};
use kd_model::{Llama, TokenBatch};
use safetensors::{Dtype, SafeTensors};

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

pub fn model_dir(name: &str) -> PathBuf {
    fixtures().join("tiny-models").join(name)
}

pub fn cpu() -> Device {
    kd_model::parse_device("cpu").unwrap()
}

pub fn load(name: &str) -> Llama {
    Llama::load(model_dir(name), &cpu()).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// A tensor of a golden file, flattened, with its shape.
#[derive(Debug, Clone)]
pub struct Golden {
    pub shape: Vec<usize>,
    pub f32: Vec<f32>,
    pub i64: Vec<i64>,
}

pub fn golden(name: &str) -> HashMap<String, Golden> {
    let path = fixtures()
        .join("golden")
        .join(format!("{name}.safetensors"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(k, v)| {
            let data = v.data();
            let (f32, i64) = match v.dtype() {
                Dtype::F32 => (
                    data.chunks_exact(4)
                        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                        .collect(),
                    Vec::new(),
                ),
                Dtype::I64 => (
                    Vec::new(),
                    data.chunks_exact(8)
                        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                        .collect(),
                ),
                other => panic!("{k}: unexpected dtype {other:?}"),
            };
            (
                k,
                Golden {
                    shape: v.shape().to_vec(),
                    f32,
                    i64,
                },
            )
        })
        .collect()
}

/// The batch `prefix` (right / left / offset) of a golden file, with its explicit positions.
pub fn golden_batch(g: &HashMap<String, Golden>, prefix: &str) -> TokenBatch {
    let ids = &g[&format!("{prefix}.input_ids")];
    let mask = &g[&format!("{prefix}.attention_mask")].i64;
    let pos = g[&format!("{prefix}.position_ids")].i64.clone();
    let [b, s] = [ids.shape[0], ids.shape[1]];
    TokenBatch::new(
        b,
        s,
        ids.i64.iter().map(|i| *i as u32).collect(),
        mask.iter().map(|m| *m != 0).collect(),
    )
    .unwrap()
    .with_positions(pos)
    .unwrap()
}

pub fn to_vec(t: Tensor<3>) -> Vec<f32> {
    t.into_data().try_into_vec_as::<f32>().unwrap()
}

/// Max |a − b| over the positions where `mask` is set; `a` and `b` are `[b, s, width]`.
pub fn max_diff_masked(a: &[f32], b: &[f32], mask: &[bool], width: usize) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    assert_eq!(a.len(), mask.len() * width);
    let mut worst = 0f32;
    for (pos, m) in mask.iter().enumerate() {
        if *m {
            for j in pos * width..(pos + 1) * width {
                let d = (a[j] - b[j]).abs();
                assert!(
                    d.is_finite(),
                    "non-finite value at flat index {j}: {} vs {}",
                    a[j],
                    b[j]
                );
                worst = worst.max(d);
            }
        }
    }
    worst
}
