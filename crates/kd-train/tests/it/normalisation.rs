//! Gradient accumulation normalises by the global token count of the step (not the mean of
//! micro-batch means), and splitting micro-batches into shards reproduces the unsplit step
//! (what data-parallel replicas would compute).

use burn::module::Module;
use kd_data::{Batch, collate};
use kd_model::LoraConfig;
use kd_train::advanced::shard_rows;
use kd_train::{CausalLmLoss, StepLossFn, TrainModel};

/// Gradients, loss and terms of one step.
type Step = (burn::optim::GradientsParams, f64, Vec<(&'static str, f64)>);

/// The gradient, loss and terms of one step whose micro-batches all learn through `loss`.
fn step_gradients(
    model: &TrainModel,
    batches: &[Batch],
    normalizer: f32,
    loss: &dyn StepLossFn,
    seeds: &[u64],
) -> kd_train::Result<Step> {
    let parts: Vec<(&Batch, &dyn StepLossFn)> = batches.iter().map(|b| (b, loss)).collect();
    let s = kd_train::advanced::step_gradients(model, &parts, normalizer, seeds)?;
    Ok((s.grads, s.loss, s.terms))
}

use crate::util::*;

fn grad_vec(model: &TrainModel, grads: &burn::optim::GradientsParams) -> Vec<f32> {
    let mut out = Vec::new();
    for (_, p) in model.llama.projections() {
        let a = p.adapter.as_ref().unwrap();
        for w in [&a.lora_a.weight, &a.lora_b.weight] {
            out.extend(
                grads
                    .get::<2>(w.id)
                    .unwrap()
                    .into_data()
                    .try_into_vec_as::<f32>()
                    .unwrap(),
            );
        }
    }
    out
}

fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn global_token_count_and_shards() {
    let examples = examples(8);
    // No dropout here: micro-batches of different shapes would draw different masks.
    let config = LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        ..LoraConfig::default()
    };
    let llama = base_model().apply_lora_seeded(&config, 99).unwrap();
    let model = TrainModel::new(llama.train());
    let loss = CausalLmLoss { weight: 1.0 };
    let rows: Vec<Vec<usize>> = (0..8).map(|i| vec![i]).collect();
    let batch = |r: &[Vec<usize>]| -> Batch { collate(&examples, r, 0, usize::MAX) };
    let whole = batch(&rows);
    let n = whole.label_tokens() as f32;
    let seeds = [1u64; 8];

    // One micro-batch holding the whole global batch.
    let (g_whole, l_whole, _) = step_gradients(&model, &[whole], n, &loss, &seeds[..1]).unwrap();
    // Four micro-batches of two rows, each normalised by the global count: the same step.
    let parts: Vec<Batch> = rows.chunks(2).map(batch).collect();
    let (g_parts, l_parts, _) = step_gradients(&model, &parts, n, &loss, &seeds).unwrap();
    // Two shards each taking half of two micro-batches of four rows (what two data-parallel
    // replicas would do).
    let shards: Vec<Batch> = rows
        .chunks(4)
        .flat_map(|r| shard_rows(r, 2))
        .map(|s| batch(&s))
        .collect();
    assert_eq!(shards.len(), 4);
    let (g_dp, l_dp, _) = step_gradients(&model, &shards, n, &loss, &seeds).unwrap();

    let (a, b, c) = (
        grad_vec(&model, &g_whole),
        grad_vec(&model, &g_parts),
        grad_vec(&model, &g_dp),
    );
    assert!(a.iter().any(|v| *v != 0.0));
    assert!(
        rel_diff(&b, &a) <= 1e-5,
        "accumulated vs whole: {}",
        rel_diff(&b, &a)
    );
    assert!(
        rel_diff(&c, &a) <= 1e-5,
        "shards vs single: {}",
        rel_diff(&c, &a)
    );
    assert!(
        (l_parts - l_whole).abs() <= 1e-5 * l_whole.abs()
            && (l_dp - l_whole).abs() <= 1e-5 * l_whole.abs()
    );

    // The mean of micro-batch means is a different objective (token counts differ per part).
    let mut naive = vec![0f32; a.len()];
    for p in &parts {
        let (g, _, _) = step_gradients(
            &model,
            std::slice::from_ref(p),
            p.label_tokens() as f32,
            &loss,
            &seeds,
        )
        .unwrap();
        for (x, y) in naive.iter_mut().zip(grad_vec(&model, &g)) {
            *x += y / parts.len() as f32;
        }
    }
    assert!(
        rel_diff(&naive, &a) > 1e-3,
        "the naive mean should differ here"
    );
    let _ = model.num_params();
}
