//! Hidden-state MSE through a learned projection (speculator distillation: Llama-3.2-1B's
//! 2048-wide states to Llama-3.1-8B's 4096).

use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{Device, Distribution, Tensor, TensorData};

use crate::error::{LossError, Result};

/// The learned map from student to teacher hidden width: `Linear(d_S → d_T)`, no bias,
/// Xavier-uniform init (as `docs/src/loss-contract.md` specifies); trained with the adapters.
#[derive(Module, Debug)]
pub struct HiddenProjection {
    /// The weight, Burn layout `[d_S, d_T]`.
    pub proj: Linear,
}

impl HiddenProjection {
    /// A freshly initialised projection: Xavier-uniform, gain 1 (U(−a, a), a = √(6 / (d_S +
    /// d_T)), as Burn's `Initializer::XavierUniform` draws), drawn from `seed` alone
    /// ([`kd_kernels::SeededDraws`]: on the CPU, the values `device.seed(seed)` and the
    /// backend's `Tensor::random` would give, without that process-wide generator).
    pub fn new(d_student: usize, d_teacher: usize, seed: u64, device: &Device) -> Self {
        let a = 3f64.sqrt() * (2.0 / (d_student + d_teacher) as f64).sqrt();
        let weight = kd_kernels::SeededDraws::new(seed).tensor(
            [d_student, d_teacher],
            Distribution::Uniform(-a, a),
            device,
        );
        Self {
            proj: Linear {
                weight: burn::module::Param::from_tensor(weight),
                bias: None,
            },
        }
    }

    /// A projection from a PyTorch-layout weight `[d_T, d_S]` (row-major values).
    pub fn from_torch_weight(
        values: Vec<f32>,
        d_teacher: usize,
        d_student: usize,
        device: &Device,
    ) -> Result<Self> {
        if values.len() != d_teacher * d_student {
            return Err(LossError::Shape(format!(
                "projection weight has {} values, expected [{d_teacher}, {d_student}]",
                values.len()
            )));
        }
        let w = Tensor::<2>::from_data(TensorData::new(values, [d_teacher, d_student]), device)
            .transpose();
        Ok(Self {
            proj: Linear {
                weight: burn::module::Param::from_tensor(w),
                bias: None,
            },
        })
    }

    /// `(d_S, d_T)`.
    pub fn dims(&self) -> (usize, usize) {
        let [i, o] = self.proj.weight.dims();
        (i, o)
    }
}

/// MSE = Σ_counted Σ_j (P h_S − h_T)²_{r,j} / (N · d_T) over rows with `mask[r]`.
///
/// # Shapes
/// - `student`: `[rows, d_S]`, `teacher`: `[rows, d_T]`; without a projection d_S must equal
///   d_T.
pub fn hidden_mse(
    student: Tensor<2>,
    teacher: Tensor<2>,
    projection: Option<&HiddenProjection>,
    mask: &[bool],
    normalizer: f32,
) -> Result<Tensor<1>> {
    let [rows, ds] = student.dims();
    let [trows, dt] = teacher.dims();
    if rows != trows || mask.len() != rows {
        return Err(LossError::Shape(format!(
            "student hidden [{rows}, {ds}], teacher hidden [{trows}, {dt}], mask of {}: row counts differ",
            mask.len()
        )));
    }
    if !(normalizer.is_finite() && normalizer > 0.0) {
        return Err(LossError::Input(format!(
            "the normaliser must be positive, got {normalizer}"
        )));
    }
    let projected = match projection {
        Some(p) => {
            let (pi, po) = p.dims();
            if (pi, po) != (ds, dt) {
                return Err(LossError::Shape(format!(
                    "the projection maps {pi} → {po} but the hidden states are {ds} (student) → {dt} (teacher)"
                )));
            }
            p.proj.forward(student)
        }
        None if ds == dt => student,
        None => {
            return Err(LossError::Shape(format!(
                "hidden widths differ (student {ds}, teacher {dt}) and no projection was given: \
                 distilling hidden states between different widths needs a learned projection \
                 (HiddenProjection::new({ds}, {dt}, ..))"
            )));
        }
    };
    let device = projected.device();
    let w: Vec<f32> = mask.iter().map(|m| if *m { 1.0 } else { 0.0 }).collect();
    let w = Tensor::<2>::from_data(TensorData::new(w, [rows, 1]), &device);
    let diff = projected - teacher.without_autodiff();
    Ok((diff.powi_scalar(2) * w).sum() / (normalizer * dt as f32))
}
