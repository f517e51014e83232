//! The EAGLE-3 TTT loss against SpecForge's (`fixtures/eagle3/`, made by
//! `fixtures/make_eagle3_golden.py`): the target distribution over the draft vocabulary, the
//! position masks, each step's loss, acceptance rate and accuracy, and the 0.8-weighted sum, computed
//! from the reference's own float64 step logits; bounds from the reference's float32 spread.

use std::collections::HashMap;

use burn::tensor::{DType, Tensor, TensorData};
use kd_loss::{TttTargets, ttt_acceptance_rate, ttt_loss, ttt_step_counts, ttt_step_loss};
use safetensors::{Dtype, SafeTensors};

use crate::util::{cpu, fixtures, scalar};

fn read(name: &str) -> HashMap<String, (Vec<usize>, Vec<f64>)> {
    let path = fixtures().join("eagle3").join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(k, v)| {
            let d = v.data();
            let values: Vec<f64> = match v.dtype() {
                Dtype::F64 => d
                    .chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
                Dtype::F32 => d
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                Dtype::I64 => d
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                Dtype::BOOL => d.iter().map(|&b| b as f64).collect(),
                other => panic!("{k}: unexpected dtype {other:?}"),
            };
            (k, (v.shape().to_vec(), values))
        })
        .collect()
}

fn t3(entry: &(Vec<usize>, Vec<f64>)) -> Tensor<3> {
    let (s, v) = entry;
    Tensor::from_data(
        TensorData::new(
            v.iter().map(|&x| x as f32).collect::<Vec<_>>(),
            [s[0], s[1], s[2]],
        ),
        (&cpu(), DType::F32),
    )
}

fn t2(entry: &(Vec<usize>, Vec<f64>)) -> Tensor<2> {
    let (s, v) = entry;
    Tensor::from_data(
        TensorData::new(
            v.iter().map(|&x| x as f32).collect::<Vec<_>>(),
            [s[0], s[1]],
        ),
        (&cpu(), DType::F32),
    )
}

fn host2(t: Tensor<2>) -> Vec<f64> {
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|&x| x as f64)
        .collect()
}

/// 3 × max |f32 − f64| of the reference for `name`, and at least 4 float32 ulps of the
/// largest value: PyTorch's float32 softmax over 32 entries lands within one ulp of float64,
/// a correct float32 one may be a few ulps off (Burn's, measured: 3.5e-7 on values up to 0.98).
fn bound(name: &str, f64s: &HashMap<String, (Vec<usize>, Vec<f64>)>) -> f64 {
    let f32s = read("golden_f32.safetensors");
    let spread = f64s[name]
        .1
        .iter()
        .zip(&f32s[name].1)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    let magnitude = f64s[name].1.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    (3.0 * spread).max(4.0 * magnitude * f32::EPSILON as f64)
}

#[test]
fn ttt_loss_matches_specforge() {
    let inputs = read("inputs.safetensors");
    let golden = read("golden_f64.safetensors");
    let draft = read("model.safetensors");
    let draft_to_target: Vec<u32> = draft["d2t"]
        .1
        .iter()
        .enumerate()
        .map(|(i, d)| (i as f64 + d) as u32)
        .collect();
    let targets = TttTargets::new(
        t3(&inputs["target"]),
        t2(&inputs["loss_mask"]),
        &draft_to_target,
    );
    let [b, s, dv] = targets.target_p.dims();
    let p: Vec<f64> = targets
        .target_p
        .clone()
        .reshape([b * s, dv])
        .into_data()
        .try_to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|&x| x as f64)
        .collect();
    let worst = p
        .iter()
        .zip(&golden["target_p"].1)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    let tp_bound = bound("target_p", &golden);
    assert!(worst <= tp_bound, "target_p: {worst} > {tp_bound}");

    let mut logits = Vec::new();
    for k in 0..3 {
        let step = targets.step(k);
        assert_eq!(
            host2(step.position_mask.clone()),
            golden[&format!("step{k}.position_mask")].1,
            "step {k} position mask"
        );
        assert_eq!(
            host2(step.loss_mask.clone()),
            golden[&format!("step{k}.loss_mask")].1,
            "step {k} loss mask"
        );
        let l = t3(&golden[&format!("step{k}.logits")]);
        let loss = scalar(ttt_step_loss(l.clone(), &step));
        let name = format!("step{k}.loss");
        let expected = golden[&name].1[0];
        let tol = bound(&name, &golden);
        eprintln!("{name}: ours {loss:.9}, reference {expected:.9} (tolerance {tol:.1e})");
        assert!(
            (loss - expected).abs() <= tol,
            "{name}: {loss} vs {expected}"
        );
        let rate = ttt_acceptance_rate(l.clone(), &step);
        let name = format!("step{k}.acceptance_rate");
        let expected = golden[&name].1[0];
        let tol = bound(&name, &golden);
        assert!(
            (rate - expected).abs() <= tol,
            "{name}: {rate} vs {expected}"
        );
        // The metric sums: SpecForge's accuracy is a ratio of counts (exact), its acceptance
        // rate the same as above.
        let counts = ttt_step_counts(l.clone(), &step, &draft_to_target);
        let expected = golden[&format!("step{k}.acc")].1[0];
        assert_eq!(
            counts.labels,
            golden[&format!("step{k}.loss_mask")].1.iter().sum::<f64>(),
            "step {k} labels"
        );
        assert!(
            (counts.accuracy() - expected).abs() <= 1e-12,
            "step{k}.acc: {} ({} of {}) vs {expected}",
            counts.accuracy(),
            counts.correct,
            counts.labels
        );
        assert!(
            (counts.acceptance_rate() - rate).abs() <= 1e-12,
            "step {k}: counts' rate {} vs {rate}",
            counts.acceptance_rate()
        );
        logits.push(l);
    }
    let total = scalar(ttt_loss(&logits, &targets));
    let expected = golden["total_loss"].1[0];
    let tol = bound("total_loss", &golden);
    assert!(
        (total - expected).abs() <= tol,
        "total loss {total} vs {expected}"
    );
}
