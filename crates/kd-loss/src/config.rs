//! Loss configuration: the objective and its parameters, with ROLL's names and defaults.

use serde::{Deserialize, Serialize};

/// The divergence between teacher (p) and student (q) distributions
/// (`docs/src/loss-contract.md`). Serialised with ROLL's names (`forward_kl`, …).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum KdObjective {
    /// Σ p (log p − log q).
    #[default]
    ForwardKl,
    /// Σ q (log q − log p).
    ReverseKl,
    /// Σ p (log p − log(λp + (1−λ)q)) (DistiLLM, arXiv 2402.03898; teacher entropy kept).
    SkewedForwardKl,
    /// Σ q (log q − log((1−λ)p + λq)).
    SkewedReverseKl,
    /// w_head · forward KL + w_tail · reverse KL (Wu et al. 2024, arXiv 2404.02657).
    AdaptiveKl,
    /// Jensen–Shannon divergence with m = (p + q)/2 (ε = 1e-9 inside the logs).
    JsDivergence,
    /// Total variation ½ Σ |p − q| (= 1 − Σ min(p, q), the rejection rate of speculative
    /// sampling).
    TvDistance,
}

impl KdObjective {
    /// Every objective, in the order of `docs/src/loss-contract.md`.
    pub const ALL: [KdObjective; 7] = [
        Self::ForwardKl,
        Self::ReverseKl,
        Self::SkewedForwardKl,
        Self::SkewedReverseKl,
        Self::JsDivergence,
        Self::AdaptiveKl,
        Self::TvDistance,
    ];

    /// The serialised name (`"forward_kl"`).
    pub fn name(self) -> &'static str {
        match self {
            Self::ForwardKl => "forward_kl",
            Self::ReverseKl => "reverse_kl",
            Self::SkewedForwardKl => "skewed_forward_kl",
            Self::SkewedReverseKl => "skewed_reverse_kl",
            Self::AdaptiveKl => "adaptive_kl",
            Self::JsDivergence => "js_divergence",
            Self::TvDistance => "tv_distance",
        }
    }
}

/// How the student distribution is formed in top-k mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum SparseStudent {
    /// ROLL's form: q = softmax of the student logits gathered at the teacher's top-k indices,
    /// renormalised over those K entries (both distributions live on the K-support).
    #[default]
    Renormalized,
    /// q = the student's full-vocabulary log-softmax gathered at the top-k indices, not
    /// renormalised (the teacher mass outside the top-k is ignored). Its gradient reaches
    /// every vocabulary entry through the log-sum-exp.
    FullLogsumexp,
}

/// Everything that defines a distillation loss term.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KdConfig {
    /// The divergence (`kd_objective`).
    #[serde(rename = "kd_objective")]
    pub objective: KdObjective,
    /// Temperature τ applied to the student logits (and to the teacher's).
    pub kd_temperature: f32,
    /// Extra temperature τ_T of the teacher: p = softmax(z_T / (τ·τ_T)).
    pub teacher_temperature: f32,
    /// λ of the skewed objectives.
    pub skew_lambda: f32,
    /// α of adaptive KL (tail mass threshold).
    pub adaptive_kl_alpha: f32,
    /// K of top-k mode; 0 = full vocabulary. ROLL's default is 64.
    pub logits_topk: usize,
    /// The student distribution in top-k mode.
    pub sparse_student: SparseStudent,
    /// Multiply the loss by τ² (Hinton et al.); off by default, as in ROLL.
    pub scale_by_temperature_squared: bool,
}

impl Default for KdConfig {
    fn default() -> Self {
        Self {
            objective: KdObjective::ForwardKl,
            kd_temperature: 1.0,
            teacher_temperature: 1.0,
            skew_lambda: 0.1,
            adaptive_kl_alpha: 0.5,
            logits_topk: 64,
            sparse_student: SparseStudent::Renormalized,
            scale_by_temperature_squared: false,
        }
    }
}

impl KdConfig {
    /// The configuration with the given objective and defaults elsewhere.
    pub fn new(objective: KdObjective) -> Self {
        Self {
            objective,
            ..Self::default()
        }
    }

    /// Checks the parameters' ranges.
    pub fn validate(&self) -> Result<(), crate::LossError> {
        let bad =
            |field: &str, msg: &str| Err(crate::LossError::Config(format!("`{field}`: {msg}")));
        if !(self.kd_temperature.is_finite() && self.kd_temperature > 0.0) {
            return bad("kd_temperature", "must be a positive number");
        }
        if !(self.teacher_temperature.is_finite() && self.teacher_temperature > 0.0) {
            return bad("teacher_temperature", "must be a positive number");
        }
        if !(0.0..=1.0).contains(&self.skew_lambda) {
            return bad("skew_lambda", "must lie in [0, 1]");
        }
        if !(0.0..=1.0).contains(&self.adaptive_kl_alpha) {
            return bad("adaptive_kl_alpha", "must lie in [0, 1]");
        }
        Ok(())
    }

    pub(crate) fn kernel_params(&self) -> crate::kernels::KdParams {
        crate::kernels::KdParams {
            objective: self.objective,
            inv_tau_student: 1.0 / self.kd_temperature,
            inv_tau_teacher: 1.0 / (self.kd_temperature * self.teacher_temperature),
            skew_lambda: self.skew_lambda,
            adaptive_alpha: self.adaptive_kl_alpha,
            topk: self.logits_topk,
            sparse_student: self.sparse_student,
        }
    }

    /// The factor the summed loss is multiplied by besides 1/N (τ² when asked for).
    pub(crate) fn extra_scale(&self) -> f32 {
        if self.scale_by_temperature_squared {
            self.kd_temperature * self.kd_temperature
        } else {
            1.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serde_names_and_unknown_keys() {
        for o in KdObjective::ALL {
            let json = serde_json::to_string(&o).unwrap();
            assert_eq!(json, format!("\"{}\"", o.name()));
        }
        let c: KdConfig =
            serde_json::from_str(r#"{"kd_objective": "adaptive_kl", "logits_topk": 0}"#).unwrap();
        assert_eq!(c.objective, KdObjective::AdaptiveKl);
        assert_eq!(c.logits_topk, 0);
        assert_eq!(c.skew_lambda, 0.1);
        let e = serde_json::from_str::<KdConfig>(r#"{"kd_objectiv": "forward_kl"}"#).unwrap_err();
        assert!(e.to_string().contains("kd_objectiv"), "{e}");
        let e = serde_json::from_str::<KdConfig>(r#"{"kd_objective": "kl"}"#).unwrap_err();
        assert!(e.to_string().contains("forward_kl"), "{e}");
    }

    #[test]
    fn validation() {
        assert!(KdConfig::default().validate().is_ok());
        let c = KdConfig {
            kd_temperature: 0.0,
            ..KdConfig::default()
        };
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("kd_temperature")
        );
        let c = KdConfig {
            skew_lambda: 1.5,
            ..KdConfig::default()
        };
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("skew_lambda")
        );
    }
}
