//! What the trainer trains: the [`Trainable`] trait, and [`TrainModel`] — a Llama (with
//! LoRA adapters, or whole) plus the optional hidden-state projection — which implements it.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::{Device, Tensor};
use kd_loss::HiddenProjection;
use kd_model::{Llama, SaveDType};

use crate::checkpoint::PROJECTION_FILE;
use crate::config::TrainMode;
use crate::error::{Result, TrainError};

/// A Burn module the trainer can train: its device, the mode it trains in, and the files a
/// checkpoint holds for it (written into a checkpoint directory, read back on resume).
pub trait Trainable: Module + Sized {
    /// The device its parameters live on.
    fn device(&self) -> Device;
    /// Adapters on a frozen base ([`TrainMode::Lora`]) or every parameter
    /// ([`TrainMode::Full`]); the trainer refuses a run whose configuration says otherwise.
    fn mode(&self) -> TrainMode;
    /// The padding id batches of this model are collated with.
    fn pad_id(&self) -> u32;
    /// Writes the model's files into a checkpoint directory.
    fn save_files(&self, dir: &Path) -> Result<()>;
    /// Reads a checkpoint's files into this model (resume).
    fn load_files(self, dir: &Path) -> Result<Self>;
    /// A line for `training_log.txt` describing what trains (e.g. PEFT's parameter report).
    fn describe(&self) -> Option<String> {
        None
    }
}

/// Where a [`TrainModel`]'s checkpoints point: the base model named in `adapter_config.json`
/// and the tokenizer files copied beside the weights.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelFiles {
    /// `base_model_name_or_path` written into adapter configs.
    pub base_model: String,
    /// Tokenizer files copied into every checkpoint (a Hugging Face directory or a GGUF
    /// file).
    pub tokenizer_dir: Option<PathBuf>,
}

/// A student or draft: the Llama (LoRA adapters attached with `apply_lora`, or trained whole)
/// and, for hidden-state distillation, the student → teacher projection.
#[derive(Module, Debug)]
pub struct TrainModel {
    /// The student / draft model.
    pub llama: Llama,
    /// Student → teacher hidden-state projection, trained with the adapters.
    pub projection: Option<HiddenProjection>,
    /// What checkpoints name and copy.
    #[module(skip)]
    pub files: ModelFiles,
}

impl TrainModel {
    /// The model alone, trained in LoRA mode when it carries adapters and whole otherwise.
    pub fn new(llama: Llama) -> Self {
        Self {
            llama,
            projection: None,
            files: ModelFiles::default(),
        }
    }

    /// With the hidden-state projection.
    pub fn with_projection(mut self, projection: Option<HiddenProjection>) -> Self {
        self.projection = projection;
        self
    }

    /// With the base model name and tokenizer directory its checkpoints carry.
    pub fn with_files(mut self, files: ModelFiles) -> Self {
        self.files = files;
        self
    }
}

impl Trainable for TrainModel {
    fn device(&self) -> Device {
        self.llama.embed_tokens.weight.device()
    }

    fn mode(&self) -> TrainMode {
        if self.llama.has_adapters() {
            TrainMode::Lora
        } else {
            TrainMode::Full
        }
    }

    fn pad_id(&self) -> u32 {
        self.llama.pad_id()
    }

    fn save_files(&self, dir: &Path) -> Result<()> {
        match self.mode() {
            TrainMode::Lora => self.llama.save_adapter(dir, &self.files.base_model)?,
            TrainMode::Full => self.llama.save(dir, SaveDType::F32)?,
        }
        if let Some(p) = &self.projection {
            let w = p.proj.weight.val().transpose().into_data();
            kd_model::weights::write_safetensors(
                &dir.join(PROJECTION_FILE),
                &[("weight".to_string(), w)],
                SaveDType::F32,
            )?;
        }
        if let Some(tok) = &self.files.tokenizer_dir {
            crate::tokenizer_files::write_tokenizer_files(tok, dir)?;
        }
        Ok(())
    }

    fn load_files(self, dir: &Path) -> Result<Self> {
        let device = self.device();
        let llama = match self.mode() {
            TrainMode::Lora => self.llama.load_adapter(dir)?.0,
            TrainMode::Full => Llama::load(dir, &device)?,
        };
        let projection = match self.projection {
            None => None,
            Some(p) => Some(read_projection(
                &dir.join(PROJECTION_FILE),
                p.dims(),
                &device,
            )?),
        };
        Ok(Self {
            llama,
            projection,
            files: self.files,
        })
    }

    fn describe(&self) -> Option<String> {
        (self.mode() == TrainMode::Lora).then(|| self.llama.parameter_report().to_string())
    }
}

/// A saved projection (`[d_T, d_S]`, PyTorch layout, key `weight`) of dims `(d_S, d_T)`.
fn read_projection(
    path: &Path,
    (ds, dt): (usize, usize),
    device: &Device,
) -> Result<HiddenProjection> {
    let bytes = std::fs::read(path).map_err(|e| TrainError::io(path, e))?;
    let bad = |message: String| TrainError::Checkpoint {
        path: path.to_path_buf(),
        message,
    };
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
    let w = st.tensor("weight").map_err(|e| bad(e.to_string()))?;
    let values: Vec<f32> = w
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok(HiddenProjection::from_torch_weight(values, dt, ds, device)?)
}

/// Whether every parameter of `model` is finite (checked before a checkpoint is written).
pub(crate) fn all_finite<M: Module>(model: &M) -> bool {
    struct V(bool);
    impl burn::module::ModuleVisitor for V {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<D>>) {
            if self.0 {
                let bad: i64 = p.val().is_finite().bool_not().int().sum().into_scalar();
                self.0 = bad == 0;
            }
        }
    }
    let mut v = V(true);
    model.visit(&mut v);
    v.0
}
