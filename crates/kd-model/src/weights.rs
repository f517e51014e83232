//! Reading and writing Hugging Face safetensors checkpoints: `model.safetensors`, or shards
//! listed in `model.safetensors.index.json`; stored dtypes F32, BF16 and F16; the tokenizer
//! files that travel with a checkpoint.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use burn::module::Param;
use burn::nn::{Embedding, Linear, RmsNorm};
use burn::tensor::{DType, Device, Tensor, TensorData};
use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

mod save;

pub use crate::lora::{TOKENIZER_FILES, copy_tokenizer_files};
pub(crate) use save::save;
pub use save::{RawTensor, SaveDType, write_atomic, write_safetensors};

use crate::config::LlamaConfig;
use crate::error::{ModelError, Result};
use crate::model::{DecoderLayer, Llama, LmHead, Mlp};
use kd_lora::LoraLinear;

/// Largest shard [`Llama::save`] writes by default (transformers' default, 5 GB).
pub const DEFAULT_MAX_SHARD_BYTES: usize = 5_000_000_000;

/// File name of a single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// File name of the index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Tensors some checkpoints carry that are derived buffers, not weights.
fn ignorable(name: &str) -> bool {
    name.ends_with(".rotary_emb.inv_freq")
}

/// Every weight a configuration implies, with its checkpoint shape (`[out, in]` for
/// projections), in the order transformers writes them.
pub fn expected_tensors(c: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    let (d, i) = (c.hidden_size, c.intermediate_size);
    let (q, kv) = (
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
    );
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![c.vocab_size, d],
    )];
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let mut push = |name: String, shape: Vec<usize>| out.push((name, shape));
        push(format!("{p}.input_layernorm.weight"), vec![d]);
        for ((proj, o, inp), bias) in [
            ("q_proj", q, d),
            ("k_proj", kv, d),
            ("v_proj", kv, d),
            ("o_proj", d, q),
        ]
        .into_iter()
        .zip(c.attention_biases())
        {
            push(format!("{p}.self_attn.{proj}.weight"), vec![o, inp]);
            if bias {
                push(format!("{p}.self_attn.{proj}.bias"), vec![o]);
            }
        }
        if c.qk_norm() {
            push(format!("{p}.self_attn.q_norm.weight"), vec![c.head_dim]);
            push(format!("{p}.self_attn.k_norm.weight"), vec![c.head_dim]);
        }
        push(format!("{p}.post_attention_layernorm.weight"), vec![d]);
        for (proj, o, inp) in [("gate_proj", i, d), ("up_proj", i, d), ("down_proj", d, i)] {
            push(format!("{p}.mlp.{proj}.weight"), vec![o, inp]);
            if c.mlp_bias {
                push(format!("{p}.mlp.{proj}.bias"), vec![o]);
            }
        }
    }
    out.push(("model.norm.weight".to_string(), vec![d]));
    if !c.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![c.vocab_size, d]));
    }
    out
}

/// Where a model's tensors come from: safetensors files or a GGUF file, under Hugging Face
/// names.
pub(crate) trait TensorSource {
    /// The directory or file, for error messages.
    fn origin(&self) -> &Path;
    /// Stored shapes of every tensor (`[out, in]` for projections).
    fn shapes(&self) -> Result<BTreeMap<String, Vec<usize>>>;
    /// Reads one tensor as `dtype` (F32 or BF16), transposing a 2-D one when asked.
    fn read(&self, name: &str, dtype: DType, transpose: bool) -> Result<TensorData>;
}

/// The safetensors files of a model directory, memory-mapped, with a name → file index.
pub(crate) struct Checkpoint {
    dir: PathBuf,
    files: Vec<(PathBuf, Mmap)>,
    index: HashMap<String, usize>,
}

impl Checkpoint {
    pub(crate) fn open(dir: &Path) -> Result<Self> {
        let single = dir.join(SINGLE_FILE);
        let index_path = dir.join(INDEX_FILE);
        let names: Vec<PathBuf> = if index_path.is_file() {
            let text =
                std::fs::read_to_string(&index_path).map_err(|e| ModelError::io(&index_path, e))?;
            let json: Value = serde_json::from_str(&text).map_err(|source| ModelError::Json {
                path: index_path.clone(),
                source,
            })?;
            let map = json
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| {
                    ModelError::config(&index_path, "weight_map", "missing or not an object")
                })?;
            let mut files: Vec<PathBuf> = Vec::new();
            for (tensor, file) in map {
                let file = file.as_str().ok_or_else(|| {
                    ModelError::config(
                        &index_path,
                        format!("weight_map.{tensor}"),
                        "expected a file name",
                    )
                })?;
                let path = dir.join(file);
                if !files.contains(&path) {
                    files.push(path);
                }
            }
            files.sort();
            files
        } else if single.is_file() {
            vec![single]
        } else {
            return Err(ModelError::NoWeights {
                dir: dir.to_path_buf(),
            });
        };

        let mut files = Vec::with_capacity(names.len());
        let mut index = HashMap::new();
        for (n, path) in names.into_iter().enumerate() {
            let file = File::open(&path).map_err(|e| ModelError::io(&path, e))?;
            // SAFETY: the map is read-only; like every safetensors reader we rely on the file
            // not being truncated while the model loads.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(&path, e))?;
            let st = SafeTensors::deserialize(&map).map_err(|e| ModelError::Safetensors {
                path: path.clone(),
                message: e.to_string(),
            })?;
            for name in st.names() {
                index.insert(name.to_string(), n);
            }
            files.push((path, map));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            files,
            index,
        })
    }

    fn parse<'a>(&self, path: &Path, map: &'a Mmap) -> Result<SafeTensors<'a>> {
        SafeTensors::deserialize(map).map_err(|e| ModelError::Safetensors {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }
}

impl TensorSource for Checkpoint {
    fn origin(&self) -> &Path {
        &self.dir
    }

    fn shapes(&self) -> Result<BTreeMap<String, Vec<usize>>> {
        let mut out = BTreeMap::new();
        for (path, map) in &self.files {
            let st = self.parse(path, map)?;
            for (name, view) in st.tensors() {
                out.insert(name, view.shape().to_vec());
            }
        }
        Ok(out)
    }

    fn read(&self, name: &str, dtype: DType, transpose: bool) -> Result<TensorData> {
        let n = self.index[name];
        let (path, map) = &self.files[n];
        let st = self.parse(path, map)?;
        let view = st.tensor(name).map_err(|e| ModelError::Safetensors {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let shape = view.shape().to_vec();
        let bytes = view.data();
        let unsupported = || ModelError::UnsupportedDType {
            path: path.clone(),
            name: name.to_string(),
            dtype: format!("{:?}", view.dtype()),
        };
        if dtype == DType::BF16 {
            let values: Vec<bf16> = match view.dtype() {
                Dtype::BF16 => decode(bytes, |b: &[u8; 2]| bf16::from_le_bytes(*b)),
                Dtype::F16 => decode(bytes, |b: &[u8; 2]| {
                    bf16::from_f32(f16::from_le_bytes(*b).to_f32())
                }),
                Dtype::F32 => decode(bytes, |b: &[u8; 4]| bf16::from_f32(f32::from_le_bytes(*b))),
                _ => return Err(unsupported()),
            };
            Ok(transpose_data(values, shape, transpose))
        } else {
            let values: Vec<f32> = match view.dtype() {
                Dtype::F32 => decode(bytes, |b: &[u8; 4]| f32::from_le_bytes(*b)),
                Dtype::BF16 => decode(bytes, |b: &[u8; 2]| bf16::from_le_bytes(*b).to_f32()),
                Dtype::F16 => decode(bytes, |b: &[u8; 2]| f16::from_le_bytes(*b).to_f32()),
                _ => return Err(unsupported()),
            };
            Ok(transpose_data(values, shape, transpose))
        }
    }
}

fn decode<T, const N: usize>(bytes: &[u8], f: impl Fn(&[u8; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(N)
        .map(|c| f(c.try_into().expect("chunks_exact yields N bytes")))
        .collect()
}

/// Row-major `values` of `shape` as tensor data, transposed when asked and 2-D.
pub(crate) fn transpose_data<T: burn::tensor::Element + Copy>(
    values: Vec<T>,
    shape: Vec<usize>,
    transpose: bool,
) -> TensorData {
    if transpose && shape.len() == 2 {
        let (rows, cols) = (shape[0], shape[1]);
        let mut out = Vec::with_capacity(values.len());
        for c in 0..cols {
            out.extend((0..rows).map(|r| values[r * cols + c]));
        }
        TensorData::new(out, [cols, rows])
    } else {
        TensorData::new(values, shape)
    }
}

/// How weights are placed in memory when a model is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ComputeDType {
    /// f32, whatever the stored dtype (the default; exact parity with transformers in f32).
    #[default]
    F32,
    /// bf16, where the device supports bf16 arithmetic (half the memory; activations in bf16).
    BF16,
}

impl ComputeDType {
    fn burn(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::BF16 => DType::BF16,
        }
    }
}

/// Every tensor the configuration implies is stored with its shape, and nothing else is
/// (but what loading ignores); all problems in one error. The number of tensors expected.
fn check_shapes(ck: &dyn TensorSource, config: &LlamaConfig) -> Result<usize> {
    let dir = ck.origin();
    let stored = ck.shapes()?;
    let expected = expected_tensors(config);
    let mut problems = Vec::new();
    let expected_names: HashSet<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
    for (name, shape) in &expected {
        match stored.get(name) {
            None => problems.push(format!(
                "missing tensor `{name}` (expected shape {shape:?})"
            )),
            Some(found) if found != shape => problems.push(format!(
                "tensor `{name}` has shape {found:?}, config.json implies {shape:?}"
            )),
            Some(_) => {}
        }
    }
    for (name, shape) in &stored {
        let tied_head = name == "lm_head.weight" && config.tie_word_embeddings;
        if !expected_names.contains(name.as_str()) && !ignorable(name) && !tied_head {
            problems.push(format!("unexpected tensor `{name}` with shape {shape:?}"));
        }
    }
    if !problems.is_empty() {
        return Err(ModelError::Weights {
            dir: dir.to_path_buf(),
            problems,
        });
    }
    Ok(expected.len())
}

/// Loads a model from a tensor source, checking every tensor against the configuration first.
pub(crate) fn load(
    ck: &dyn TensorSource,
    config: LlamaConfig,
    dtype: ComputeDType,
    device: &Device,
) -> Result<Llama> {
    load_with(ck, config, dtype, device, &|_| None)
}

/// A 2-D weight made from elsewhere than the source, under its checkpoint name (a lean GGUF
/// model's projections, whose f32 values come from their blocks only when a path reads them).
pub(crate) type LazyWeights<'a> = &'a dyn Fn(&str) -> Option<Param<Tensor<2>>>;

/// [`load`], with the 2-D weights `lazy` gives taken from it instead of read.
pub(crate) fn load_with(
    ck: &dyn TensorSource,
    config: LlamaConfig,
    dtype: ComputeDType,
    device: &Device,
    lazy: LazyWeights<'_>,
) -> Result<Llama> {
    if dtype == ComputeDType::BF16 && !device.supports_dtype(DType::BF16) {
        return Err(ModelError::Device {
            name: format!("{device:?}"),
            message: "bf16 arithmetic is not supported on this device; load in f32".into(),
        });
    }
    let dir = ck.origin();
    let tensors = check_shapes(ck, &config)?;
    tracing::debug!(dir = %dir.display(), tensors, "loading weights");

    let dt = dtype.burn();
    let tensor = |name: &str, transpose: bool| -> Result<Tensor<2>> {
        Ok(Tensor::from_data(
            ck.read(name, dt, transpose)?,
            (device, dt),
        ))
    };
    let vector = |name: &str| -> Result<Tensor<1>> {
        Ok(Tensor::from_data(ck.read(name, dt, false)?, (device, dt)))
    };
    let weight = |name: &str, transpose: bool| -> Result<Param<Tensor<2>>> {
        match lazy(name) {
            Some(param) => Ok(param),
            None => Ok(Param::from_tensor(tensor(name, transpose)?)),
        }
    };
    let linear = |name: &str, bias: bool| -> Result<LoraLinear> {
        Ok(LoraLinear::new(Linear {
            weight: weight(&format!("{name}.weight"), true)?,
            bias: if bias {
                Some(Param::from_tensor(vector(&format!("{name}.bias"))?))
            } else {
                None
            },
        }))
    };
    let norm = |name: &str| -> Result<RmsNorm> {
        Ok(RmsNorm {
            gamma: Param::from_tensor(vector(&format!("{name}.weight"))?),
            epsilon: config.rms_norm_eps,
        })
    };

    let embed_tokens = Embedding {
        weight: weight("model.embed_tokens.weight", false)?,
    };
    let mut layers = Vec::with_capacity(config.num_hidden_layers);
    for l in 0..config.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let [qb, kb, vb, ob] = config.attention_biases();
        let attn = [
            linear(&format!("{p}.self_attn.q_proj"), qb)?,
            linear(&format!("{p}.self_attn.k_proj"), kb)?,
            linear(&format!("{p}.self_attn.v_proj"), vb)?,
            linear(&format!("{p}.self_attn.o_proj"), ob)?,
        ];
        let qk_norms = if config.qk_norm() {
            Some([
                norm(&format!("{p}.self_attn.q_norm"))?,
                norm(&format!("{p}.self_attn.k_norm"))?,
            ])
        } else {
            None
        };
        let mb = config.mlp_bias;
        layers.push(DecoderLayer {
            input_layernorm: norm(&format!("{p}.input_layernorm"))?,
            self_attn: Llama::attention_from_parts(&config, attn, qk_norms),
            post_attention_layernorm: norm(&format!("{p}.post_attention_layernorm"))?,
            mlp: Mlp {
                gate_proj: linear(&format!("{p}.mlp.gate_proj"), mb)?,
                up_proj: linear(&format!("{p}.mlp.up_proj"), mb)?,
                down_proj: linear(&format!("{p}.mlp.down_proj"), mb)?,
            },
        });
    }
    let norm = norm("model.norm")?;
    let lm_head = if config.tie_word_embeddings {
        None
    } else {
        Some(LmHead {
            weight: weight("lm_head.weight", false)?,
        })
    };
    Ok(Llama::from_parts(
        config,
        embed_tokens,
        layers,
        norm,
        lm_head,
    ))
}
