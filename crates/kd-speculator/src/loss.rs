//! The speculator's loss: `ce_weight · CE + distillation_weight · hidden MSE + kd_weight ·
//! KD`, every term a sum over the step's counted positions divided by their global count
//! (`docs/src/loss-contract.md`). Counted positions are those that predict a completion token
//! (the shifted labels); the hidden MSE and the KD term are taken at the same positions.

use burn::tensor::{Int, Tensor, TensorData};
use kd_data::Batch;
use kd_loss::{KdConfig, KdObjective, hidden_mse, linear_cross_entropy};
use kd_teacher::Scores;

use kd_pipeline::kd_term::{counted_positions, topk_kd};
use kd_train::{FinalHidden, Result, StepLoss, StepLossFn, TrainError, TrainModel, final_hidden};

/// What the target recorded for the training examples, aligned with them.
pub struct TeacherTargets<'a> {
    /// One entry per training example: the target's view of its whole prompt + completion.
    pub scores: &'a [Scores],
    /// Per example: prompt tokens truncation cut from its start.
    pub offsets: &'a [usize],
}

/// The loss of one micro-batch of the speculator pipeline.
pub struct SpeculatorLoss<'a> {
    /// Weight of the cross-entropy on the completion tokens.
    pub ce_weight: f64,
    /// Weight of the hidden-state MSE (0 = off).
    pub distillation_weight: f64,
    /// The draft's hidden state compared (transformers' index).
    pub draft_layer: usize,
    /// Weight of the top-k KD term (0 = off).
    pub kd_weight: f64,
    /// The KD objective and temperature.
    pub kd: KdConfig,
    /// The target's hidden states and top-k log-probs, when a term needs them.
    pub teacher: Option<TeacherTargets<'a>>,
}

impl SpeculatorLoss<'_> {
    /// The KD configuration of the pipeline's flags.
    pub fn kd_config(objective: KdObjective, temperature: f64, topk: usize) -> KdConfig {
        KdConfig {
            kd_temperature: temperature as f32,
            logits_topk: topk,
            ..KdConfig::new(objective)
        }
    }

    fn teacher(&self) -> Result<&TeacherTargets<'_>> {
        self.teacher.as_ref().ok_or_else(|| {
            TrainError::Config("the hidden-state and KD terms need the target's scores".into())
        })
    }
}

impl StepLossFn for SpeculatorLoss<'_> {
    fn loss(
        &self,
        model: &TrainModel,
        batch: &Batch,
        normalizer: f32,
        dropout_seed: u64,
    ) -> Result<StepLoss> {
        let llama = &model.llama;
        let last = llama.layers.len();
        let hidden_wanted = self.distillation_weight > 0.0;
        let extra: &[usize] = if hidden_wanted {
            &[self.draft_layer]
        } else {
            &[]
        };
        let FinalHidden {
            out,
            flat,
            shifted,
            seq: s,
        } = final_hidden(llama, batch, Some(dropout_seed), extra)?;
        let d = flat.dims()[1];
        let b = batch.batch_size;
        let device = flat.device();

        let mut total: Option<Tensor<1>> = None;
        let mut terms = Vec::new();
        let mut kd_stats = None;
        let mut add = |t: Tensor<1>, name: &'static str, value: f64| {
            total = Some(match total.take() {
                Some(acc) => acc + t,
                None => t,
            });
            terms.push((name, value));
        };
        if self.ce_weight > 0.0 {
            let ce = linear_cross_entropy(
                flat.clone(),
                llama.lm_head_weight(),
                &shifted.targets,
                normalizer,
            )?;
            let value = ce.stats.loss_sum / normalizer as f64 * self.ce_weight;
            add(ce.loss * self.ce_weight, "ce_loss", value);
        }

        let needs_teacher = hidden_wanted || self.kd_weight > 0.0;
        if needs_teacher && shifted.count > 0 {
            let teacher = self.teacher()?;
            let counted = counted_positions(batch, &shifted.mask, s, Some(teacher.offsets))?;
            let n = counted.rows.len();
            let index =
                Tensor::<1, Int>::from_data(TensorData::new(counted.rows.clone(), [n]), &device);
            if hidden_wanted {
                let student = if self.draft_layer == last {
                    flat.clone()
                } else {
                    let h = out
                        .hidden_state(self.draft_layer)
                        .expect("requested")
                        .clone();
                    h.reshape([b * s, d])
                };
                let student = student.select(0, index.clone());
                let dt = teacher.scores[counted.at[0].0]
                    .hidden_states
                    .first()
                    .map(|h| h.dim)
                    .ok_or_else(|| {
                        TrainError::Config("the target's scores hold no hidden states".into())
                    })?;
                let mut values = Vec::with_capacity(n * dt);
                for (e, p) in &counted.at {
                    let h = &teacher.scores[*e].hidden_states[0];
                    values.extend_from_slice(&h.values[p * dt..(p + 1) * dt]);
                }
                let target = Tensor::<2>::from_data(TensorData::new(values, [n, dt]), &device);
                let mse = hidden_mse(
                    student,
                    target,
                    model.projection.as_ref(),
                    &vec![true; n],
                    normalizer,
                )? * self.distillation_weight;
                let value = mse.clone().into_scalar::<f32>() as f64;
                add(mse, "hidden_mse", value);
            }
            if self.kd_weight > 0.0 {
                let kd = topk_kd(
                    flat.clone(),
                    llama.lm_head_weight(),
                    &counted,
                    teacher.scores,
                    normalizer,
                    &self.kd,
                    self.kd_weight as f32,
                    None,
                )?;
                let value = kd.kd.loss_sum / normalizer as f64 * self.kd_weight;
                kd_stats = Some(kd.kd);
                add(kd.loss, "kd_loss", value);
            }
        }
        // Nothing counted in this micro-batch: a zero that still reaches the graph.
        let total = total.unwrap_or_else(|| flat.sum() * 0.0);
        Ok(StepLoss {
            total,
            terms,
            kd: kd_stats,
        })
    }
}
