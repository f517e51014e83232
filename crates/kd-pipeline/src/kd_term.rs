//! The token-level KD term both pipelines share: the counted positions of a micro-batch, the
//! teacher's cached top-k log-probs at those positions, and the loss of the student's logits
//! there against them. These run inside the trainer's loss, so they return its error type.

use burn::tensor::{Int, Tensor, TensorData};
use kd_data::Batch;
use kd_loss::{KdConfig, LinearCe, LinearKdOutput, Teacher, linear_kd};
use kd_teacher::Scores;
use kd_train::{Result, TrainError};

/// The counted positions of a micro-batch: the flat row (`r · seq + t`) of each, and where the
/// teacher saw it (example index, position in the teacher's sequence).
pub struct Counted {
    /// Flat rows of the `[batch · seq, hidden]` hidden states.
    pub rows: Vec<i64>,
    /// (example, teacher position) of each row.
    pub at: Vec<(usize, usize)>,
}

/// The positions where `mask` (the shifted labels) counts; `offsets[e]` is how many tokens
/// truncation cut from the start of example `e` (absent = none).
pub fn counted_positions(
    batch: &Batch,
    mask: &[bool],
    seq: usize,
    offsets: Option<&[usize]>,
) -> Result<Counted> {
    if batch.is_packed() {
        return Err(TrainError::Config(
            "packed batches cannot carry per-example teacher targets: turn sequence packing off \
             when distilling"
                .into(),
        ));
    }
    let mut rows = Vec::new();
    let mut at = Vec::new();
    for (r, examples) in batch.examples.iter().enumerate() {
        let e = examples[0];
        let offset = offsets.map_or(0, |o| o[e]);
        for t in 0..seq {
            if mask[r * seq + t] {
                rows.push((r * seq + t) as i64);
                at.push((e, offset + t));
            }
        }
    }
    Ok(Counted { rows, at })
}

/// The KD loss (weighted by `kd_weight`) of the student's logits at the counted rows of
/// `flat` (`[rows, hidden]`, the final hidden states) through `lm_head` (`[vocab, hidden]`)
/// against the teacher's top-k log-probs in `scores`, plus `ce_weight ·` CE on the same rows
/// against `targets` (the shifted labels of all rows) when given; divided by `normalizer`.
/// The LM head is fused with both losses ([`kd_loss::linear_kd`]): no `[rows, vocab]` logits
/// are kept.
#[allow(clippy::too_many_arguments)]
pub fn topk_kd(
    flat: Tensor<2>,
    lm_head: Tensor<2>,
    counted: &Counted,
    scores: &[Scores],
    normalizer: f32,
    kd: &KdConfig,
    kd_weight: f32,
    ce: Option<(&[i64], f32)>,
) -> Result<LinearKdOutput> {
    let n = counted.rows.len();
    let device = flat.device();
    let k = scores[counted.at[0].0].k;
    let mut idx = Vec::with_capacity(n * k);
    let mut lps = Vec::with_capacity(n * k);
    for (e, p) in &counted.at {
        let sc = &scores[*e];
        if sc.k != k || (p + 1) * k > sc.indices.len() {
            return Err(TrainError::Config(format!(
                "the teacher's scores of example {e} do not cover position {p} (len {}, k {}): \
                 the score cache does not fit these examples; delete it and rerun",
                sc.len, sc.k
            )));
        }
        idx.extend(sc.indices[p * k..(p + 1) * k].iter().map(|i| *i as i64));
        lps.extend_from_slice(&sc.logprobs[p * k..(p + 1) * k]);
    }
    let index = Tensor::<1, Int>::from_data(TensorData::new(counted.rows.clone(), [n]), &device);
    let student_rows = flat.select(0, index);
    let teacher = Teacher::TopK {
        indices: Tensor::<2, Int>::from_data(TensorData::new(idx, [n, k]), &device),
        values: Tensor::<2>::from_data(TensorData::new(lps, [n, k]), &device),
    };
    let targets: Option<Vec<i64>> =
        ce.map(|(t, _)| counted.rows.iter().map(|r| t[*r as usize]).collect());
    let ce = match (&targets, ce) {
        (Some(t), Some((_, weight))) => Some(LinearCe { targets: t, weight }),
        _ => None,
    };
    Ok(linear_kd(
        student_rows,
        lm_head,
        teacher,
        &vec![true; n],
        normalizer,
        kd,
        kd_weight,
        ce,
    )?)
}
