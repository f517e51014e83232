//! LoRA on the Llama: applying adapters by module path, PEFT save/load, merging and
//! exporting a merged Hugging Face directory.

use std::collections::BTreeMap;
use std::path::Path;

use burn::module::Module;
use kd_lora::{LoraAdapter, LoraConfig, PeftWeights, load_peft, save_peft};

use crate::error::{ModelError, Result};
use crate::model::Llama;
use crate::weights::SaveDType;

/// Trainable vs total parameters, printed as PEFT prints it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParameterReport {
    /// Adapter parameters.
    pub trainable: usize,
    /// All parameters (base and adapters).
    pub total: usize,
}

fn thousands(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

impl std::fmt::Display for ParameterReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "trainable params: {} || all params: {} || trainable%: {:.4}",
            thousands(self.trainable),
            thousands(self.total),
            100.0 * self.trainable as f64 / self.total.max(1) as f64
        )
    }
}

fn lora_err(e: kd_lora::LoraError) -> ModelError {
    ModelError::Lora(e.to_string())
}

impl Llama {
    /// Attaches fresh adapters (A Kaiming-uniform, B zero) to the projections the config
    /// targets and freezes every base parameter, so that only adapters get gradients and
    /// optimizer state. Seed the device first for reproducible initialisation.
    pub fn apply_lora(self, config: &LoraConfig) -> Result<Self> {
        self.attach(config, None)
    }

    /// Like [`apply_lora`](Self::apply_lora), with every A matrix drawn from `seed` (and the
    /// module's index) instead of the device's global generator: reproducible whatever else
    /// draws random numbers meanwhile.
    pub fn apply_lora_seeded(self, config: &LoraConfig, seed: u64) -> Result<Self> {
        self.attach(config, Some(seed))
    }

    fn attach(self, config: &LoraConfig, seed: Option<u64>) -> Result<Self> {
        let matcher = config.matcher().map_err(lora_err)?;
        let paths: Vec<String> = self.projections().into_iter().map(|(p, _)| p).collect();
        let selected = matcher.check(&paths).map_err(lora_err)?;
        let device = self.embed_tokens.weight.device();
        let mut model = self.no_grad();
        for (k, (path, proj)) in paths.iter().zip(model.projections_mut()).enumerate() {
            if selected.contains(path) {
                let (d_in, d_out) = proj.dims();
                let (r, scale, p) = (config.r, config.scaling(), config.dropout);
                proj.adapter = Some(match seed {
                    Some(seed) => {
                        let s = kd_lora::derive_seed(seed, &[k as u64]);
                        LoraAdapter::seeded(d_in, d_out, r, scale, p, s, &device)
                    }
                    None => LoraAdapter::new(d_in, d_out, r, scale, p, &device),
                });
            }
        }
        model.lora = Some(config.clone());
        Ok(model)
    }

    /// The settings of the attached adapters (from [`apply_lora`](Self::apply_lora) or
    /// [`load_adapter`](Self::load_adapter)); `None` without adapters.
    pub fn lora_config(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }

    /// Parameters in adapters vs in the whole model.
    pub fn parameter_report(&self) -> ParameterReport {
        let trainable: usize = self
            .projections()
            .iter()
            .filter_map(|(_, p)| p.adapter.as_ref())
            .map(|a| a.num_params())
            .sum();
        ParameterReport {
            trainable,
            total: self.num_params(),
        }
    }

    /// Whether any projection carries an adapter.
    pub fn has_adapters(&self) -> bool {
        self.projections().iter().any(|(_, p)| p.adapter.is_some())
    }

    /// The adapters' weights in PEFT layout, keyed by module path.
    pub fn adapter_weights(&self) -> BTreeMap<String, PeftWeights> {
        let mut out = BTreeMap::new();
        for (path, p) in self.projections() {
            if let Some(a) = &p.adapter {
                let (da, db) = a.to_peft();
                let (d_in, d_out) = p.dims();
                out.insert(
                    path,
                    PeftWeights {
                        a: da.try_into_vec_as::<f32>().expect("float adapter"),
                        b: db.try_into_vec_as::<f32>().expect("float adapter"),
                        r: a.rank(),
                        d_in,
                        d_out,
                    },
                );
            }
        }
        out
    }

    /// Writes the adapters in PEFT layout (`adapter_config.json` with the settings they were
    /// attached with, `adapter_model.safetensors`), loadable with `PeftModel.from_pretrained`;
    /// `base_model` is written as `base_model_name_or_path`.
    pub fn save_adapter(&self, dir: impl AsRef<Path>, base_model: &str) -> Result<()> {
        let (Some(config), true) = (&self.lora, self.has_adapters()) else {
            return Err(ModelError::Lora("the model has no adapters to save".into()));
        };
        save_peft(dir.as_ref(), config, base_model, &self.adapter_weights()).map_err(lora_err)
    }

    /// Loads a PEFT adapter directory (written by PEFT or by [`save_adapter`](Self::save_adapter))
    /// onto this model; base parameters are frozen. Every adapter module must exist in the
    /// model with matching widths.
    pub fn load_adapter(self, dir: impl AsRef<Path>) -> Result<(Self, LoraConfig)> {
        let dir = dir.as_ref();
        let adapter = load_peft(dir).map_err(lora_err)?;
        let paths: Vec<String> = self.projections().into_iter().map(|(p, _)| p).collect();
        let mut problems = Vec::new();
        for (module, w) in &adapter.modules {
            match paths.iter().position(|p| p == module) {
                None => problems.push(format!(
                    "adapter module `{module}` does not exist in this model (a different architecture or layer count?)"
                )),
                Some(i) => {
                    let (d_in, d_out) = self.projections()[i].1.dims();
                    if (w.d_in, w.d_out) != (d_in, d_out) {
                        problems.push(format!(
                            "`{module}.lora_A.weight` [{}, {}] / `lora_B.weight` [{}, {}] do not fit the \
                             model's projection [{d_out}, {d_in}]",
                            w.r, w.d_in, w.d_out, w.r
                        ));
                    }
                }
            }
        }
        if !problems.is_empty() {
            return Err(ModelError::Weights {
                dir: dir.to_path_buf(),
                problems,
            });
        }
        let device = self.embed_tokens.weight.device();
        let scale = adapter.config.scaling();
        let mut model = self.no_grad();
        for (path, proj) in paths.iter().zip(model.projections_mut()) {
            if let Some(w) = adapter.modules.get(path) {
                proj.adapter = Some(
                    LoraAdapter::from_peft(
                        &w.a,
                        &w.b,
                        (w.r, w.d_in, w.d_out),
                        scale,
                        adapter.config.dropout,
                        &device,
                    )
                    .map_err(lora_err)?,
                );
            }
        }
        model.lora = Some(adapter.config.clone());
        Ok((model, adapter.config))
    }

    /// Folds every adapter into its base weight and removes it (PEFT's `merge_and_unload`).
    pub fn merge_and_unload(mut self) -> Self {
        // Packed GGUF blocks mirror the unmerged weights.
        self.packed = None;
        self.lora = None;
        for proj in self.projections_mut() {
            let taken = std::mem::replace(proj, kd_lora::LoraLinear::new(proj.base.clone()));
            *proj = taken.merge();
        }
        self
    }

    /// Merges the adapters and writes a Hugging Face model directory that SGLang, vLLM and
    /// transformers load: `config.json`, safetensors weights, and the tokenizer files found
    /// in `tokenizer_dir` (tokenizer.json, tokenizer_config.json, special_tokens_map.json,
    /// generation_config.json, chat_template.jinja).
    pub fn export_merged(
        self,
        dir: impl AsRef<Path>,
        dtype: SaveDType,
        tokenizer_dir: Option<&Path>,
    ) -> Result<()> {
        let dir = dir.as_ref();
        let merged = self.merge_and_unload();
        merged.save(dir, dtype)?;
        if let Some(src) = tokenizer_dir {
            copy_tokenizer_files(src, dir)?;
        }
        Ok(())
    }
}

/// The files that make a directory usable as a tokenizer by transformers.
pub const TOKENIZER_FILES: [&str; 6] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "tokenizer.model",
];

/// Copies whichever [`TOKENIZER_FILES`] exist in `src` to `dst` (atomically each).
pub fn copy_tokenizer_files(src: &Path, dst: &Path) -> Result<()> {
    std::fs::create_dir_all(dst).map_err(|e| ModelError::io(dst, e))?;
    for name in TOKENIZER_FILES {
        let from = src.join(name);
        if from.is_file() {
            let bytes = std::fs::read(&from).map_err(|e| ModelError::io(&from, e))?;
            crate::weights::write_atomic(&dst.join(name), &bytes)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peft_style_report() {
        let r = ParameterReport {
            trainable: 11_272_192,
            total: 1_247_086_592,
        };
        assert_eq!(
            r.to_string(),
            "trainable params: 11,272,192 || all params: 1,247,086,592 || trainable%: 0.9039"
        );
    }
}
