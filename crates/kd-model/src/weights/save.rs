//! Writing a model as a Hugging Face checkpoint: every weight under its checkpoint name,
//! safetensors shards and their index, each file written atomically.

use std::collections::HashMap;
use std::path::Path;

use burn::nn::Linear;
use burn::tensor::TensorData;
use half::{bf16, f16};
pub use kd_lora::RawTensor;
use safetensors::Dtype;

use super::{INDEX_FILE, SINGLE_FILE};
use crate::error::{ModelError, Result};
use crate::model::Llama;

/// Every weight of a model under its checkpoint name, in checkpoint layout (`[out, in]`).
fn named_tensors(model: &Llama) -> Vec<(String, TensorData)> {
    let mut out = Vec::new();
    let mut put = |name: String, t: TensorData| out.push((name, t));
    let linear = |put: &mut dyn FnMut(String, TensorData), name: &str, l: &Linear| {
        put(
            format!("{name}.weight"),
            l.weight.val().transpose().into_data(),
        );
        if let Some(b) = &l.bias {
            put(format!("{name}.bias"), b.val().into_data());
        }
    };
    put(
        "model.embed_tokens.weight".into(),
        model.embed_tokens.weight.val().into_data(),
    );
    for (l, layer) in model.layers.iter().enumerate() {
        let p = format!("model.layers.{l}");
        put(
            format!("{p}.input_layernorm.weight"),
            layer.input_layernorm.gamma.val().into_data(),
        );
        let a = &layer.self_attn;
        for (n, proj) in [
            ("q_proj", &a.q_proj),
            ("k_proj", &a.k_proj),
            ("v_proj", &a.v_proj),
            ("o_proj", &a.o_proj),
        ] {
            linear(&mut put, &format!("{p}.self_attn.{n}"), &proj.base);
        }
        for (n, norm) in [("q_norm", &a.q_norm), ("k_norm", &a.k_norm)] {
            if let Some(norm) = norm {
                put(
                    format!("{p}.self_attn.{n}.weight"),
                    norm.gamma.val().into_data(),
                );
            }
        }
        put(
            format!("{p}.post_attention_layernorm.weight"),
            layer.post_attention_layernorm.gamma.val().into_data(),
        );
        let m = &layer.mlp;
        for (n, proj) in [
            ("gate_proj", &m.gate_proj),
            ("up_proj", &m.up_proj),
            ("down_proj", &m.down_proj),
        ] {
            linear(&mut put, &format!("{p}.mlp.{n}"), &proj.base);
        }
    }
    put(
        "model.norm.weight".into(),
        model.norm.gamma.val().into_data(),
    );
    if let Some(head) = &model.lm_head {
        put("lm_head.weight".into(), head.weight.val().into_data());
    }
    out
}

/// The dtype weights are written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaveDType {
    /// float32.
    F32,
    /// bfloat16 (what the hub's Llama checkpoints use).
    BF16,
    /// float16.
    F16,
}

/// Serialises tensors into one safetensors file at `path`, atomically (temporary file in the
/// same directory, then rename), with `{"format": "pt"}` metadata as transformers expects.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, TensorData)],
    dtype: SaveDType,
) -> Result<()> {
    let views: Vec<(String, RawTensor)> = tensors
        .iter()
        .map(|(name, t)| {
            let values: Vec<f32> = t.clone().try_into_vec_as::<f32>().expect("float data");
            let (dt, bytes): (Dtype, Vec<u8>) = match dtype {
                SaveDType::F32 => (
                    Dtype::F32,
                    values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                ),
                SaveDType::BF16 => (
                    Dtype::BF16,
                    values
                        .iter()
                        .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                        .collect(),
                ),
                SaveDType::F16 => (
                    Dtype::F16,
                    values
                        .iter()
                        .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                        .collect(),
                ),
            };
            (
                name.clone(),
                RawTensor {
                    dtype: dt,
                    shape: t.shape().to_vec(),
                    bytes,
                },
            )
        })
        .collect();
    let metadata = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    let bytes = safetensors::serialize(views.iter().map(|(n, v)| (n.as_str(), v)), metadata)
        .map_err(|e| ModelError::Safetensors {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    write_atomic(path, &bytes)
}

/// Writes `bytes` to `path` atomically ([`kd_kernels::write_atomic`]: temporary file, fsync,
/// rename, fsync of the directory), so that a crash never leaves a half-written file under
/// the final name.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    kd_kernels::write_atomic(path, bytes).map_err(|e| ModelError::io(path, e))
}

/// Saves weights in Hugging Face layout: `model.safetensors`, or shards of at most
/// `max_shard_bytes` named `model-0000i-of-0000n.safetensors` plus the index.
pub(crate) fn save(
    model: &Llama,
    dir: &Path,
    dtype: SaveDType,
    max_shard_bytes: usize,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let elem = match dtype {
        SaveDType::F32 => 4,
        SaveDType::BF16 | SaveDType::F16 => 2,
    };
    let tensors = named_tensors(model);
    let mut shards: Vec<Vec<(String, TensorData)>> = vec![Vec::new()];
    let mut current = 0usize;
    let mut total = 0usize;
    for (name, t) in tensors {
        let size = t.num_elements() * elem;
        if current > 0 && current + size > max_shard_bytes {
            shards.push(Vec::new());
            current = 0;
        }
        current += size;
        total += size;
        shards
            .last_mut()
            .expect("one shard at least")
            .push((name, t));
    }
    // A stale file of the other layout would be picked up by loaders: remove it.
    if shards.len() == 1 {
        write_safetensors(&dir.join(SINGLE_FILE), &shards[0], dtype)?;
        let _ = std::fs::remove_file(dir.join(INDEX_FILE));
        return Ok(());
    }
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
        write_safetensors(&dir.join(&file), shard, dtype)?;
        for (name, _) in shard {
            weight_map.insert(name.clone(), file.clone().into());
        }
    }
    let index = serde_json::json!({
        "metadata": {"total_size": total},
        "weight_map": weight_map,
    });
    let text = serde_json::to_string_pretty(&index).expect("JSON values serialise");
    write_atomic(&dir.join(INDEX_FILE), text.as_bytes())?;
    let _ = std::fs::remove_file(dir.join(SINGLE_FILE));
    Ok(())
}
