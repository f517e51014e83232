//! Writing an EAGLE-3 draft as llama.cpp serves it (`llama-server -m target.gguf -md
//! draft.gguf --spec-type draft-eagle3`): one GGUF file of architecture `eagle3`, laid out as
//! llama.cpp's `convert_hf_to_gguf.py … --target-model-dir` lays out a SpecForge draft
//! (`conversion/llama.py`, llama-cpp-python 0.3.36's vendored llama.cpp `0c1e57098`):
//!
//! - the draft's hyper-parameters under `eagle3.*`, with `eagle3.target_layers` (the three
//!   feature layers, llama.cpp capturing the *input* of each, our indexing too) and
//!   `eagle3.target_hidden_size`;
//! - the target's tokenizer (every `tokenizer.*` key of the target's GGUF: llama.cpp checks
//!   that draft and target vocabularies agree);
//! - tensors under llama.cpp's names: `fc.weight`, `blk.0.attn_norm` (the embedding's norm),
//!   `blk.0.attn_norm_2` (the hidden stream's), `blk.0.attn_{q,k,v,output}`,
//!   `blk.0.ffn_{norm,gate,up,down}`, `output_norm`, `output` (the draft head),
//!   `enc.output_norm` (the features' norm of a `norm_before_fc` draft), and `d2t` as
//!   absolute target ids (i64); `t2d` is not written (llama.cpp does not use it) and neither is
//!   the embedding (the draft reads the target's);
//! - `q_proj` and `k_proj` rows permuted as the converter permutes a Llama's (ggml rotates
//!   adjacent pairs), the inverse of [`crate::unpermute_rows`];
//! - Llama 3 RoPE scaling as a `rope_freqs.weight` tensor of per-frequency divisors.

use std::path::Path;

use half::f16;
use kd_gguf::{GgmlType, GgufFile, GgufWriter, Value, quantize_q8_0};

use super::export::{expected_tensors, layer_prefix};
use super::file::WeightsFile;
use super::{DraftVocab, Eagle3Config, WEIGHTS_FILE};
use crate::config::RopeScaling;
use crate::error::{ModelError, Result};
use crate::gguf::{LAYER_MODULES, permuted_heads};
use crate::rope::Rope;

/// The type of the draft's matrices in the GGUF file (norms stay F32, `d2t` I64).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GgufWeightType {
    /// 32-bit floats: exactly the trained weights.
    F32,
    /// IEEE half (the converter's default for an f32 draft).
    #[default]
    F16,
    /// Q8_0 blocks (ggml's reference quantiser); a matrix whose rows are not whole blocks of 32
    /// falls back to F16, as in the converter.
    Q8_0,
}

/// llama.cpp's name of each SpecForge tensor (the decoder layer's under `midlayer.`), and the
/// head count whose Q/K permutation it takes.
fn gguf_name(specforge: &str, c: &Eagle3Config) -> Option<(String, Option<usize>)> {
    let top = match specforge {
        "fc.weight" => Some("fc.weight"),
        // llama.cpp's converter: `input_norm.weight` → `enc.output_norm.weight`.
        "input_norm.weight" => Some("enc.output_norm.weight"),
        "midlayer.hidden_norm.weight" => Some("blk.0.attn_norm_2.weight"),
        "norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(name) = top {
        return Some((name.to_string(), None));
    }
    let module = specforge
        .strip_prefix("midlayer.")?
        .strip_suffix(".weight")?;
    let &(gguf, _) = LAYER_MODULES.iter().find(|(_, hf)| *hf == module)?;
    Some((
        format!("blk.0.{gguf}.weight"),
        permuted_heads(module, &c.llama),
    ))
}

/// Permutes the rows of a `[rows, cols]` Q/K projection of `heads` heads as llama.cpp's
/// converter does (`LlamaModel.permute`): Hugging Face row `(h, half, i)` becomes file row
/// `(h, i, half)`.
fn permute_rows(values: &[f32], rows: usize, cols: usize, heads: usize) -> Option<Vec<f32>> {
    if heads == 0 || !rows.is_multiple_of(2 * heads) {
        return None;
    }
    let mut out = vec![0f32; values.len()];
    for (hf, file) in crate::gguf::unpermuted_order(rows, heads)
        .into_iter()
        .enumerate()
    {
        out[file * cols..(file + 1) * cols].copy_from_slice(&values[hf * cols..(hf + 1) * cols]);
    }
    Some(out)
}

/// `values` (row-major `shape`) encoded as `ty` for a matrix, F32 for a vector.
fn encode(values: &[f32], shape: &[usize], ty: GgufWeightType) -> (GgmlType, Vec<u8>) {
    let f32_bytes = || values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let f16_bytes = || {
        values
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect()
    };
    match (shape.len(), ty) {
        (1, _) | (_, GgufWeightType::F32) => (GgmlType::F32, f32_bytes()),
        (_, GgufWeightType::F16) => (GgmlType::F16, f16_bytes()),
        (_, GgufWeightType::Q8_0) if shape[shape.len() - 1].is_multiple_of(32) => {
            let q = quantize_q8_0(values).expect("rows of whole blocks");
            (GgmlType::Q8_0, q)
        }
        (_, GgufWeightType::Q8_0) => (GgmlType::F16, f16_bytes()),
    }
}

/// Writes the EAGLE-3 draft directory `src` (SpecForge's or the `speculators` layout) as the
/// GGUF file `dst` that llama.cpp serves beside `target`, the target's GGUF file (its
/// tokenizer is copied; its width, depth and vocabulary are checked against the draft's).
/// Matrices are written as `ty`. Every mismatch is an error naming the key or tensor and
/// both values; `dst` is written atomically (nothing is written on an error).
pub fn export_eagle3_gguf(src: &Path, target: &Path, dst: &Path, ty: GgufWeightType) -> Result<()> {
    let config_path = src.join("config.json");
    let config = Eagle3Config::from_file(&config_path)?;
    if config.llama.qk_norm() {
        return Err(ModelError::config(
            &config_path,
            "model_type",
            "\"qwen3\": this draft's layer normalises each query and key head (q_norm, \
             k_norm); llama.cpp's eagle3 graph has no such tensors, so it would compute \
             something else; export it --to vllm",
        ));
    }
    let file = WeightsFile::open(&src.join(WEIGHTS_FILE))?;
    let from = layer_prefix(&file);
    let target_file = GgufFile::open(target)?;
    let layers = check_target(&config, &config_path, &target_file)?;

    let l = &config.llama;
    let mut w = GgufWriter::new("eagle3");
    let u32v = |v: usize| -> Result<Value> {
        u32::try_from(v)
            .map(Value::U32)
            .map_err(|_| ModelError::Input(format!("{v} does not fit a GGUF uint32")))
    };
    let keys = [
        ("general.name", Value::String("EAGLE-3 draft".into())),
        ("eagle3.block_count", u32v(1)?),
        ("eagle3.context_length", u32v(l.max_position_embeddings)?),
        ("eagle3.embedding_length", u32v(l.hidden_size)?),
        ("eagle3.feed_forward_length", u32v(l.intermediate_size)?),
        ("eagle3.attention.head_count", u32v(l.num_attention_heads)?),
        (
            "eagle3.attention.head_count_kv",
            u32v(l.num_key_value_heads)?,
        ),
        ("eagle3.attention.key_length", u32v(l.head_dim)?),
        ("eagle3.attention.value_length", u32v(l.head_dim)?),
        ("eagle3.rope.freq_base", Value::F32(l.rope_theta as f32)),
        ("eagle3.rope.dimension_count", u32v(l.head_dim)?),
        (
            "eagle3.attention.layer_norm_rms_epsilon",
            Value::F32(l.rms_norm_eps as f32),
        ),
        ("eagle3.vocab_size", u32v(l.vocab_size)?),
        (
            "eagle3.target_layers",
            Value::Array(
                layers
                    .iter()
                    .map(|&i| i32::try_from(i).map(Value::I32))
                    .collect::<std::result::Result<_, _>>()
                    .map_err(|_| ModelError::Input(format!("feature layers {layers:?}")))?,
            ),
        ),
        (
            "eagle3.target_hidden_size",
            u32v(config.target_hidden_size)?,
        ),
        (
            "eagle3.norm_before_residual",
            Value::Bool(config.norm_before_residual),
        ),
        ("eagle3.norm_before_fc", Value::Bool(config.norm_before_fc)),
    ];
    for (k, v) in keys {
        w.add(k, v)?;
    }
    // The target's tokenizer, in its order: llama.cpp compares it with the target's.
    for (k, v) in target_file.metadata() {
        if k.starts_with("tokenizer.") {
            w.add(k, v.clone())?;
        }
    }

    for (name, shape) in expected_tensors(&config) {
        let stored = name.replacen("midlayer.", from, 1);
        match name.as_str() {
            "t2d" => continue,
            "d2t" => {
                let vocab = DraftVocab::from_d2t(&file.ints(&stored)?, l.vocab_size)?;
                let ids: Vec<u8> = vocab
                    .target_ids()
                    .iter()
                    .flat_map(|&t| i64::from(t).to_le_bytes())
                    .collect();
                w.add_tensor("d2t", GgmlType::I64, &[vocab.len()], ids)?;
                continue;
            }
            _ => {}
        }
        let (gguf, heads) = gguf_name(&name, &config).ok_or_else(|| {
            ModelError::Input(format!("{name}: no llama.cpp name for this tensor"))
        })?;
        let mut values = file.floats(&stored, &shape)?;
        if let Some(heads) = heads {
            values = permute_rows(&values, shape[0], shape[1], heads).ok_or_else(|| {
                file.error(
                    &stored,
                    format!(
                        "{} rows are not {heads} heads of even width (llama.cpp's Q/K \
                         permutation)",
                        shape[0]
                    ),
                )
            })?;
        }
        let (gty, bytes) = encode(&values, &shape, ty);
        w.add_tensor(&gguf, gty, &shape, bytes)?;
    }
    if matches!(l.rope_scaling, RopeScaling::Llama3 { .. }) {
        // llama.cpp divides each frequency by its factor: default / scaled.
        let mut plain = l.clone();
        plain.rope_scaling = RopeScaling::Default;
        let factors: Vec<u8> = Rope::new(&plain)
            .inv_freq()
            .iter()
            .zip(Rope::new(l).inv_freq())
            .flat_map(|(d, s)| (d / s).to_le_bytes())
            .collect();
        w.add_tensor(
            "rope_freqs.weight",
            GgmlType::F32,
            &[l.head_dim / 2],
            factors,
        )?;
    }
    if let Some(parent) = dst.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| ModelError::io(parent, e))?;
    }
    crate::weights::write_atomic(dst, &w.to_bytes()?)
}

/// The target file fits the draft: width, vocabulary and the feature layers' range. Returns
/// the feature layers (the draft's, else llama.cpp's default `[2, L/2, L − 3]`).
fn check_target(
    config: &Eagle3Config,
    config_path: &Path,
    target: &GgufFile,
) -> Result<[usize; 3]> {
    let arch = target.str("general.architecture")?;
    let width = target.uint(&format!("{arch}.embedding_length"))? as usize;
    let depth = target.uint(&format!("{arch}.block_count"))? as usize;
    let mismatch = |key: &str, draft: String, target_value: String| {
        ModelError::config(
            config_path,
            key,
            format!(
                "{draft}, but the target {} has {target_value}: export the draft beside the \
                 target it was trained for",
                target.path().display()
            ),
        )
    };
    if config.target_hidden_size != width {
        return Err(mismatch(
            "target_hidden_size",
            config.target_hidden_size.to_string(),
            format!("{arch}.embedding_length {width}"),
        ));
    }
    if config.llama.hidden_size != width {
        // llama.cpp's draft reads the target's embedding rows as its own input.
        return Err(mismatch(
            "hidden_size",
            config.llama.hidden_size.to_string(),
            format!("{arch}.embedding_length {width} (the draft reads the target's embedding)"),
        ));
    }
    let tokens = target.strings("tokenizer.ggml.tokens")?.len();
    if config.llama.vocab_size != tokens {
        return Err(mismatch(
            "vocab_size",
            config.llama.vocab_size.to_string(),
            format!("{tokens} tokens in tokenizer.ggml.tokens"),
        ));
    }
    let layers = config
        .aux_layers
        .unwrap_or([2, depth / 2, depth.saturating_sub(3)]);
    if let Some(bad) = layers.iter().find(|&&i| i == 0 || i >= depth) {
        return Err(mismatch(
            "eagle_aux_hidden_state_layer_ids",
            format!("{layers:?} (layer {bad})"),
            format!(
                "{depth} layers ({arch}.block_count; expected 1 to {})",
                depth.max(2) - 1
            ),
        ));
    }
    Ok(layers)
}
