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
    read_safetensors(
        &fixtures()
            .join("golden")
            .join(format!("{name}.safetensors")),
    )
}

fn read_safetensors(path: &std::path::Path) -> HashMap<String, Golden> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
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

/// The argmax of each row of `width` values (first of equal maxima) where `mask` is set.
pub fn argmaxes_masked(values: &[f32], mask: &[bool], width: usize) -> Vec<usize> {
    values
        .chunks_exact(width)
        .zip(mask)
        .filter(|(_, m)| **m)
        .map(|(row, _)| {
            row.iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (i, v)| if *v > b.1 { (i, *v) } else { b },
                )
                .0
        })
        .collect()
}

/// The float64 reference of a golden and the measured float32 spread behind each bound
/// (`fixtures/make_reference_spread.py`, outputs in `fixtures/golden/spread/`).
///
/// A test compares our f32 output with the float64 result and asserts
/// `max |ours − ref_f64| ≤ 3 · spread`, `spread = max(f32_vs_f64, committed_vs_f64)`:
/// transformers' own float32 distance from the exact result, measured on two CPUs (the one
/// that made the golden and the one that ran the spread script). Summation order, which
/// differs between CPUs and implementations, moves a float32 result by about one spread; the
/// scalar level (no FMA) by up to twice that (measured worst ratios: 1.62 with FMA, 1.89
/// without; the script's docstring has the derivation). A wrong kernel moves it by orders of
/// magnitude more.
pub struct Reference {
    name: String,
    tensors: HashMap<String, Golden>,
    keys: serde_json::Value,
}

/// How many times the reference's own float32 spread our result may be from float64.
pub const SPREAD_FACTOR: f32 = 3.0;

impl Reference {
    /// `fixtures/golden/spread/<name>.{json,safetensors}`.
    pub fn load(name: &str) -> Self {
        let dir = fixtures().join("golden/spread");
        let json = dir.join(format!("{name}.json"));
        let text =
            std::fs::read_to_string(&json).unwrap_or_else(|e| panic!("{}: {e}", json.display()));
        let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
        Self {
            name: name.to_string(),
            tensors: read_safetensors(&dir.join(format!("{name}.safetensors"))),
            keys: doc["keys"].clone(),
        }
    }

    /// The float64 result of `key`, rounded to f32.
    pub fn f64(&self, key: &str) -> &[f32] {
        &self
            .tensors
            .get(key)
            .unwrap_or_else(|| panic!("{}: no reference for {key}", self.name))
            .f32
    }

    /// The measured spread of `key`: the larger of the two float32 errors.
    pub fn spread(&self, key: &str) -> f32 {
        let e = &self.keys[key];
        let f = |k: &str| {
            e[k].as_f64()
                .unwrap_or_else(|| panic!("{}: {key} has no {k}", self.name))
        };
        f("f32_vs_f64").max(f("committed_vs_f64")) as f32
    }

    /// `SPREAD_FACTOR · spread(key)`.
    pub fn bound(&self, key: &str) -> f32 {
        SPREAD_FACTOR * self.spread(key)
    }

    /// Asserts `max |ours − ref_f64(key)| ≤ bound(key)` over the masked positions (`mask`
    /// per position of `width` values; `None`: every value). Returns the distance.
    pub fn check(&self, what: &str, key: &str, ours: &[f32], mask: Option<&[bool]>) -> f32 {
        let want = self.f64(key);
        let d = match mask {
            Some(m) => max_diff_masked(ours, want, m, ours.len() / m.len().max(1)),
            None => {
                assert_eq!(ours.len(), want.len(), "{what}: lengths differ");
                ours.iter().zip(want).fold(0f32, |w, (a, b)| {
                    assert!(a.is_finite(), "{what}: non-finite value {a}");
                    w.max((a - b).abs())
                })
            }
        };
        let spread = self.spread(key);
        eprintln!(
            "{what}: max |ours − float64| {d:.3e}, transformers' float32 spread {spread:.3e} ({:.2}×)",
            d / spread.max(f32::MIN_POSITIVE)
        );
        assert!(
            d <= SPREAD_FACTOR * spread,
            "{what}: max |ours − float64| = {d:e} exceeds {SPREAD_FACTOR} × the reference's float32 spread {spread:e} ({}: {key})",
            self.name
        );
        d
    }
}

/// A linear congruential generator's high bits, for random test data.
pub fn lcg(seed: u64) -> impl FnMut() -> u32 {
    let mut state = seed;
    move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as u32
    }
}

/// Whether the packed kernels (GGUF blocks, Q8_0 blocks made at load, 8-bit activations, host
/// layers) run at the level in use; below AVX2 (`KD_SIMD=scalar`) they stand down and
/// decoding reads f32 weights.
pub fn avx2() -> bool {
    kd_kernels::cpu::level() >= kd_kernels::cpu::SimdLevel::Avx2
}
