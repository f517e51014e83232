//! LoRA adapters on Burn 0.22 (Hu et al. 2021, arXiv 2106.09685), compatible with Hugging
//! Face PEFT: the configuration ([`LoraConfig`], PEFT's `target_modules` semantics), the layer
//! ([`LoraLinear`]: frozen base plus x·A·B, never materialising the merged weight), seeded
//! dropout masks for exact resume, and the PEFT file format ([`save_peft`], [`load_peft`]).
//!
//! Applying adapters to a model, merging and exporting live in `kd-model`.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod config;
mod dropout;
mod error;
mod linear;
mod peft;

pub use config::{LoraConfig, TargetMatcher, TargetModules};
pub use dropout::{derive_seed, dropout_fill, dropout_mask, splitmix64};
pub use error::{LoraError, Result};
pub use linear::{LoraAdapter, LoraLinear};
pub use peft::{
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, PeftAdapter, PeftWeights, RawTensor, adapter_config_json,
    load_peft, save_peft,
};
