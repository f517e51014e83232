//! AdamW as PyTorch computes it (decoupled decay, then the bias-corrected update with
//! denominator √v/√(1−β₂ᵗ) + ε), with state keyed by parameter path — not by Burn's
//! per-process `ParamId` — so that it saves to safetensors and resumes exactly in a new
//! process; global-norm gradient clipping like `torch.nn.utils.clip_grad_norm_` (Burn's own
//! clipping is per tensor).

use std::collections::BTreeMap;
use std::path::Path;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};
use safetensors::{Dtype, SafeTensors};

use crate::error::{Result, TrainError};

/// AdamW hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWParams {
    /// β₁.
    pub beta1: f64,
    /// β₂.
    pub beta2: f64,
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay (skipped for 1-D parameters: norms and biases).
    pub weight_decay: f64,
}

/// First and second moments of one parameter, as host data `[numel]` (f32).
#[derive(Debug, Clone)]
struct Moments {
    shape: Vec<usize>,
    m: Tensor<1>,
    v: Tensor<1>,
}

/// AdamW state: per-parameter moments by path, and the number of steps taken.
#[derive(Debug, Clone, Default)]
pub struct AdamW {
    moments: BTreeMap<String, Moments>,
    /// Optimizer steps taken (bias correction uses step + 1 for the next one).
    pub steps: u64,
}

fn join(path: &[String]) -> String {
    path.join(".")
}

/// Σ‖g‖² over every parameter with a gradient.
struct NormVisitor<'a> {
    grads: &'a GradientsParams,
    sum: f64,
}

impl ModuleVisitor for NormVisitor<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = self.grads.get::<D>(param.id) {
            let s: f32 = g.powi_scalar(2).sum().into_scalar();
            self.sum += s as f64;
        }
    }
}

/// The global L2 norm of the gradients of `module`'s parameters.
pub fn global_grad_norm<M: Module>(module: &M, grads: &GradientsParams) -> f64 {
    let mut v = NormVisitor { grads, sum: 0.0 };
    module.visit(&mut v);
    v.sum.sqrt()
}

/// The factor `clip_grad_norm_` scales gradients by: min(1, max_norm / (norm + 1e-6)).
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    (max_norm / (norm + 1e-6)).min(1.0)
}

struct StepMapper<'a> {
    opt: &'a mut AdamW,
    grads: &'a GradientsParams,
    params: AdamWParams,
    lr: f64,
    grad_scale: f64,
    path: Vec<String>,
}

impl ModuleMapper for StepMapper<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(grad) = self.grads.get::<D>(param.id) else {
            return param;
        };
        let path = join(&self.path);
        let (id, tensor, mapper) = param.consume();
        let was_autodiff = tensor.is_autodiff();
        let require_grad = tensor.is_require_grad();
        let dims = tensor.dims();
        let n: usize = dims.iter().product();
        let p = tensor.without_autodiff().reshape([n]);
        let g = grad.without_autodiff().reshape([n]) * self.grad_scale;
        let AdamWParams {
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.params;
        let t = (self.opt.steps + 1) as i32;
        let entry = self.opt.moments.entry(path).or_insert_with(|| Moments {
            shape: dims.to_vec(),
            m: Tensor::zeros([n], &p.device()),
            v: Tensor::zeros([n], &p.device()),
        });
        entry.m = entry.m.clone() * beta1 + g.clone() * (1.0 - beta1);
        entry.v = entry.v.clone() * beta2 + g.powi_scalar(2) * (1.0 - beta2);
        // PyTorch: p *= 1 − lr·wd; p −= lr/bc1 · m / (√v/√bc2 + ε).
        let decay = if D > 1 { weight_decay } else { 0.0 };
        let p = if decay > 0.0 {
            p * (1.0 - self.lr * decay)
        } else {
            p
        };
        let bc1 = 1.0 - beta1.powi(t);
        let bc2 = 1.0 - beta2.powi(t);
        let denom = entry.v.clone().sqrt() / bc2.sqrt() + eps;
        let p = p - entry.m.clone() / denom * (self.lr / bc1);
        let mut p: Tensor<D> = p.reshape(dims);
        if was_autodiff {
            p = p.autodiff();
        }
        if require_grad {
            p = p.require_grad();
        }
        Param::from_mapped_value(id, p, mapper)
    }
}

impl AdamW {
    /// One optimizer step on every parameter of `module` that has a gradient, with the
    /// gradients multiplied by `grad_scale` (clipping) first.
    pub fn step<M: Module>(
        &mut self,
        module: M,
        grads: &GradientsParams,
        params: AdamWParams,
        lr: f64,
        grad_scale: f64,
    ) -> M {
        let mut mapper = StepMapper {
            opt: self,
            grads,
            params,
            lr,
            grad_scale,
            path: Vec::new(),
        };
        let module = module.map(&mut mapper);
        self.steps += 1;
        module
    }

    /// Number of parameters with state.
    pub fn len(&self) -> usize {
        self.moments.len()
    }

    /// Whether no parameter has state yet.
    pub fn is_empty(&self) -> bool {
        self.moments.is_empty()
    }

    /// Writes the moments to a safetensors file (`m.<path>`, `v.<path>`, original shapes).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut tensors = Vec::new();
        for (name, mo) in &self.moments {
            for (k, t) in [("m", &mo.m), ("v", &mo.v)] {
                let data = t.clone().into_data().convert::<f32>();
                let values = data.try_into_vec_as::<f32>().expect("f32 moments");
                tensors.push((
                    format!("{k}.{name}"),
                    TensorData::new(values, mo.shape.clone()),
                ));
            }
        }
        kd_model::weights::write_safetensors(path, &tensors, kd_model::SaveDType::F32)?;
        Ok(())
    }

    /// Reads moments written by [`save`](Self::save); `steps` comes from the training state.
    pub fn load(path: &Path, steps: u64, device: &burn::tensor::Device) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| TrainError::io(path, e))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| TrainError::Checkpoint {
            path: path.to_path_buf(),
            message: format!("invalid optimizer state: {e}"),
        })?;
        type Part = (Option<Tensor<1>>, Option<Tensor<1>>, Vec<usize>);
        let mut parts: BTreeMap<String, Part> = BTreeMap::new();
        for (name, view) in st.tensors() {
            if view.dtype() != Dtype::F32 {
                return Err(TrainError::Checkpoint {
                    path: path.to_path_buf(),
                    message: format!("optimizer tensor `{name}` is not f32"),
                });
            }
            let values: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let n = values.len();
            let t = Tensor::<1>::from_data(TensorData::new(values, [n]), device);
            let (kind, param) = name.split_once('.').unwrap_or(("", &name));
            let entry =
                parts
                    .entry(param.to_string())
                    .or_insert((None, None, view.shape().to_vec()));
            match kind {
                "m" => entry.0 = Some(t),
                "v" => entry.1 = Some(t),
                _ => {
                    return Err(TrainError::Checkpoint {
                        path: path.to_path_buf(),
                        message: format!("unexpected optimizer tensor `{name}`"),
                    });
                }
            }
        }
        let mut moments = BTreeMap::new();
        for (name, (m, v, shape)) in parts {
            match (m, v) {
                (Some(m), Some(v)) => {
                    moments.insert(name, Moments { shape, m, v });
                }
                _ => {
                    return Err(TrainError::Checkpoint {
                        path: path.to_path_buf(),
                        message: format!("optimizer state of `{name}` lacks m or v"),
                    });
                }
            }
        }
        Ok(Self { moments, steps })
    }
}
