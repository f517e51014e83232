//! The decoder families this crate runs, and everything that differs between them, in one
//! place: the model reads [`ModelFamily`]'s answers (which projections carry a bias, whether
//! queries and keys are normalised per head, how a GGUF file stores them), never the family's
//! name.
//!
//! | family | transformers class | q/k/v bias | o bias | per-head q/k RMSNorm | GGUF q/k rows |
//! |---|---|---|---|---|---|
//! | Llama | `LlamaForCausalLM` | `attention_bias` | `attention_bias` | no | permuted |
//! | Qwen2 / Qwen2.5 | `Qwen2ForCausalLM` | always | never | no | as in HF |
//! | Qwen3 (dense) | `Qwen3ForCausalLM` | `attention_bias` | `attention_bias` | yes | as in HF |
//!
//! Everything else (RMSNorm, RoPE, SwiGLU MLP, grouped-query attention, tied or untied head)
//! is shared.

use std::fmt;

/// A decoder family (`model_type` in `config.json`, `general.architecture` in GGUF).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ModelFamily {
    /// Llama 2/3 and the models built on its layout (SmolLM, TinyLlama, Mistral-style dense).
    #[default]
    Llama,
    /// Qwen2 and Qwen2.5: bias on the query, key and value projections, none on the output.
    Qwen2,
    /// Qwen3 dense models: RMSNorm over each query and key head before RoPE.
    Qwen3,
}

impl ModelFamily {
    /// Every family, in the order error messages list them.
    pub const ALL: [ModelFamily; 3] = [Self::Llama, Self::Qwen2, Self::Qwen3];

    /// The `model_type` of its `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
        }
    }

    /// The transformers class that runs it (`architectures[0]` of its `config.json`).
    pub fn architecture(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    /// The family of a `model_type` (also a GGUF `general.architecture`: the names agree).
    pub fn from_model_type(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.model_type() == name)
    }

    /// The family of an `architectures` entry (`…ForCausalLM` or the bare `…Model`).
    pub fn from_architecture(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| {
            let class = f.architecture();
            name == class
                || class
                    .strip_suffix("ForCausalLM")
                    .map(|b| format!("{b}Model"))
                    == Some(name.to_string())
        })
    }

    /// The supported names, for error messages: `"llama", "qwen2", "qwen3"`.
    pub fn supported() -> String {
        Self::ALL
            .iter()
            .map(|f| format!("{:?}", f.model_type()))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Which of the q, k, v and o projections carry a bias, given the config's
    /// `attention_bias`.
    pub fn attention_biases(self, attention_bias: bool) -> [bool; 4] {
        match self {
            Self::Llama | Self::Qwen3 => [attention_bias; 4],
            Self::Qwen2 => [true, true, true, false],
        }
    }

    /// Whether each query and key head goes through its own RMSNorm (`q_norm`, `k_norm`,
    /// over `head_dim`) before RoPE.
    pub fn qk_norm(self) -> bool {
        self == Self::Qwen3
    }

    /// Whether llama.cpp's converter interleaves the two halves of each query/key head in
    /// the GGUF rows (its `LlamaModel.permute`); the Qwen converters store HF's order.
    pub(crate) fn gguf_permutes_qk(self) -> bool {
        self == Self::Llama
    }

    /// Whether `config.json` may carry `attention_bias` / `mlp_bias` for this family.
    pub(crate) fn config_fields(self) -> (bool, bool) {
        match self {
            Self::Llama => (true, true),
            Self::Qwen2 => (false, false),
            Self::Qwen3 => (true, false),
        }
    }

    /// transformers' default `head_dim` when `config.json` has none (`None`: hidden size /
    /// heads). `Qwen3Config` declares 128.
    pub(crate) fn default_head_dim(self) -> Option<usize> {
        (self == Self::Qwen3).then_some(128)
    }

    /// transformers' default `max_position_embeddings` for the family's config class.
    pub(crate) fn default_max_positions(self) -> usize {
        match self {
            Self::Llama => 2048,
            Self::Qwen2 | Self::Qwen3 => 32_768,
        }
    }
}

impl fmt::Display for ModelFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.model_type())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for f in ModelFamily::ALL {
            assert_eq!(ModelFamily::from_model_type(f.model_type()), Some(f));
            assert_eq!(ModelFamily::from_architecture(f.architecture()), Some(f));
        }
        assert_eq!(
            ModelFamily::from_architecture("Qwen2Model"),
            Some(ModelFamily::Qwen2)
        );
        assert_eq!(ModelFamily::from_architecture("MistralForCausalLM"), None);
        assert_eq!(ModelFamily::supported(), r#""llama", "qwen2", "qwen3""#);
    }
}
