//! `LoraLinear`: a frozen base projection plus an optional low-rank adapter,
//! y = base(x) + scale · B(A(dropout(x))), computed as x·A then ·B (never materialising
//! W + s·A·B, which Burn's own `apply_lora` does on every forward).

use burn::module::{Module, Param};
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::tensor::{Device, Tensor, TensorData};

use crate::dropout::dropout_mask;
use crate::error::{LoraError, Result};

/// The adapter of one projection: A `[in, r]` and B `[r, out]` in Burn's layout (PEFT stores
/// `lora_A.weight` `[r, in]` and `lora_B.weight` `[out, r]`).
#[derive(Module, Debug)]
pub struct LoraAdapter {
    /// Down-projection `in → r` (PEFT's `lora_A`), Kaiming-uniform initialised.
    pub lora_a: Linear,
    /// Up-projection `r → out` (PEFT's `lora_B`), zero initialised.
    pub lora_b: Linear,
    /// α / r (or α / √r).
    pub scale: f64,
    /// Dropout probability on the adapter input (training only).
    pub dropout: f64,
}

impl LoraAdapter {
    /// A fresh adapter as PEFT initialises it: A Kaiming-uniform (bound 1/√in, PEFT's
    /// `kaiming_uniform_(a=√5)`), B zeros, so the adapted layer starts equal to the base.
    pub fn new(
        d_in: usize,
        d_out: usize,
        r: usize,
        scale: f64,
        dropout: f64,
        device: &Device,
    ) -> Self {
        let lora_a = LinearConfig::new(d_in, r)
            .with_bias(false)
            .with_initializer(Initializer::KaimingUniform {
                gain: 1.0 / 3f64.sqrt(),
                fan_out_only: false,
            })
            .init(device);
        let lora_b = LinearConfig::new(r, d_out)
            .with_bias(false)
            .with_initializer(Initializer::Zeros)
            .init(device);
        Self {
            lora_a,
            lora_b,
            scale,
            dropout,
        }
    }

    /// A fresh adapter whose A is drawn from a seed instead of the device's generator
    /// (Kaiming-uniform, bound 1/√in, values decided by hash(seed, index)), so that
    /// initialisation is reproducible whatever else uses the global generator.
    pub fn seeded(
        d_in: usize,
        d_out: usize,
        r: usize,
        scale: f64,
        dropout: f64,
        seed: u64,
        device: &Device,
    ) -> Self {
        let bound = 1.0 / (d_in as f64).sqrt();
        let base = crate::dropout::splitmix64(seed);
        // A in Burn's layout [in, r].
        let a: Vec<f32> = (0..(d_in * r) as u64)
            .map(|i| {
                let u = (crate::dropout::splitmix64(base ^ i) >> 11) as f64 / (1u64 << 53) as f64;
                ((2.0 * u - 1.0) * bound) as f32
            })
            .collect();
        let mut adapter = Self::new(d_in, d_out, r, scale, dropout, device);
        adapter.lora_a = Linear {
            weight: Param::from_tensor(Tensor::from_data(TensorData::new(a, [d_in, r]), device)),
            bias: None,
        };
        adapter
    }

    /// An adapter from PEFT-layout values: A `[r, in]`, B `[out, r]` (row-major f32).
    pub fn from_peft(
        a: &[f32],
        b: &[f32],
        (r, d_in, d_out): (usize, usize, usize),
        scale: f64,
        dropout: f64,
        device: &Device,
    ) -> Result<Self> {
        if a.len() != r * d_in || b.len() != d_out * r {
            return Err(LoraError::Shape(format!(
                "adapter of rank {r} for [{d_out}, {d_in}] needs A [{r}, {d_in}] and B [{d_out}, {r}]"
            )));
        }
        // Transposed on the host so that the parameter is contiguous, as a freshly trained one
        // is (a strided view would change the matmul's summation order, and exact resume
        // needs bit-identical arithmetic).
        let t = |v: &[f32], rows: usize, cols: usize| {
            let mut out = Vec::with_capacity(v.len());
            for c in 0..cols {
                out.extend((0..rows).map(|r| v[r * cols + c]));
            }
            Tensor::<2>::from_data(TensorData::new(out, [cols, rows]), device)
        };
        Ok(Self {
            lora_a: Linear {
                weight: Param::from_tensor(t(a, r, d_in)),
                bias: None,
            },
            lora_b: Linear {
                weight: Param::from_tensor(t(b, d_out, r)),
                bias: None,
            },
            scale,
            dropout,
        })
    }

    /// Rank.
    pub fn rank(&self) -> usize {
        self.lora_a.weight.dims()[1]
    }

    /// A and B in PEFT layout (`[r, in]`, `[out, r]`), as tensor data.
    pub fn to_peft(&self) -> (TensorData, TensorData) {
        (
            self.lora_a.weight.val().transpose().into_data(),
            self.lora_b.weight.val().transpose().into_data(),
        )
    }

    /// The weight update s·A·B in Burn's layout `[in, out]`.
    pub fn delta(&self) -> Tensor<2> {
        self.lora_a.weight.val().matmul(self.lora_b.weight.val()) * self.scale
    }

    /// scale · B(A(dropout(x))). `dropout_seed` is `Some` in training: the mask is derived
    /// from it deterministically (see [`crate::dropout_mask`]).
    pub fn forward<const D: usize>(&self, x: Tensor<D>, dropout_seed: Option<u64>) -> Tensor<D> {
        let x = match dropout_seed {
            Some(seed) if self.dropout > 0.0 => {
                let mask = dropout_mask(&x.dims(), self.dropout, seed, &x.device());
                x * mask
            }
            _ => x,
        };
        self.lora_b.forward(self.lora_a.forward(x)) * self.scale
    }
}

/// A projection that can carry a LoRA adapter.
#[derive(Module, Debug)]
pub struct LoraLinear {
    /// The base projection (frozen while adapters train).
    pub base: Linear,
    /// The adapter, if any.
    pub adapter: Option<LoraAdapter>,
}

impl LoraLinear {
    /// A projection without adapter.
    pub fn new(base: Linear) -> Self {
        Self {
            base,
            adapter: None,
        }
    }

    /// `[in, out]`.
    pub fn dims(&self) -> (usize, usize) {
        let [i, o] = self.base.weight.dims();
        (i, o)
    }

    /// base(x) + adapter(x).
    ///
    /// # Shapes
    /// - `x`: `[..., in]` → `[..., out]`
    pub fn forward<const D: usize>(&self, x: Tensor<D>, dropout_seed: Option<u64>) -> Tensor<D> {
        match &self.adapter {
            None => self.base.forward(x),
            Some(a) => self.base.forward(x.clone()) + a.forward(x, dropout_seed),
        }
    }

    /// Folds the adapter into the base weight (W ← W + s·A·B) and removes it.
    pub fn merge(self) -> Self {
        match self.adapter {
            None => self,
            Some(a) => {
                let merged = self.base.weight.val() + a.delta().without_autodiff();
                let base = Linear {
                    weight: Param::from_tensor(merged.without_autodiff()),
                    bias: self.base.bias,
                };
                Self {
                    base,
                    adapter: None,
                }
            }
        }
    }
}
