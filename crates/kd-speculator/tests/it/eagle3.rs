//! EAGLE-3 drafts trained by the generic trainer on the demo target: the TTT loss falls, a
//! checkpoint is a SpecForge draft directory that reloads to the same weights, and greedy
//! speculative decoding with the draft returns exactly what the target alone returns.

use std::collections::BTreeMap;

use burn::tensor::{Device, Int, Tensor, TensorData};
use kd_data::Example;
use kd_model::{DraftVocab, Eagle3Config, Eagle3Draft, Llama, eagle3::DraftKvCache, parse_device};
use kd_speculator::eagle3::{
    CacheStats, Eagle3Loss, Eagle3Model, TARGET_ROWS_MANIFEST, TargetCache, TargetRowsManifest,
    default_feature_layers, draft_vocab_from_examples,
};
use kd_train::{LogRecord, TrainConfig, TrainMode, TrainObserver, Trainer};

use crate::fixtures;

/// Prompts of a few ids followed by a completion the target is made to continue: repeated
/// patterns, so that a draft can learn them in a few steps.
fn examples(vocab: u32) -> Vec<Example> {
    (0..48usize)
        .map(|i| {
            let prompt: Vec<u32> = (0..3 + i % 4)
                .map(|j| 5 + ((i * 7 + j * 3) as u32) % (vocab - 10))
                .collect();
            let completion: Vec<u32> = (0..12).map(|j| 20 + ((i % 3) * 5 + j % 5) as u32).collect();
            let mut ids = prompt.clone();
            ids.extend(&completion);
            let mut labels = vec![-100i64; prompt.len()];
            labels.extend(completion.iter().map(|&c| c as i64));
            Example {
                id: format!("e{i}"),
                input_ids: ids,
                labels,
                prompt_len: prompt.len(),
            }
        })
        .collect()
}

/// What the loss tests start from: the demo target, [`examples`], a draft vocabulary of their
/// completions' most frequent tokens and the default feature layers.
struct DemoSetup {
    device: Device,
    target: Llama,
    examples: Vec<Example>,
    vocab: DraftVocab,
    layers: [usize; 3],
}

impl DemoSetup {
    /// With a draft vocabulary of `size` tokens.
    fn new(size: usize) -> Self {
        let device = parse_device("cpu").unwrap();
        let target = Llama::load(fixtures().join("demo/target"), &device).unwrap();
        let tc = target.config();
        let examples = examples(tc.vocab_size as u32);
        let vocab = draft_vocab_from_examples(&examples, tc.vocab_size, size).unwrap();
        let layers = default_feature_layers(tc.num_hidden_layers);
        Self {
            device,
            target,
            examples,
            vocab,
            layers,
        }
    }

    /// A fresh draft over the setup's vocabulary, initialised from `seed`.
    fn draft(&self, seed: u64) -> Eagle3Draft {
        Eagle3Draft::new(
            Eagle3Config::for_target(self.target.config(), self.vocab.len()).unwrap(),
            self.vocab.clone(),
            self.target.embed_tokens.weight.val(),
            seed,
            &self.device,
        )
        .unwrap()
    }
}

/// Three epochs of TTT-`ttt` training of a fresh draft (from `seed`) on the setup's examples
/// with `cache`: the trained weights, and what the cache held and read.
fn train_with_cache(
    setup: &DemoSetup,
    cache: TargetCache,
    ttt: usize,
    seed: u64,
) -> (std::collections::BTreeMap<String, TensorData>, CacheStats) {
    let loss = Eagle3Loss {
        target: &setup.target,
        layers: setup.layers,
        ttt_length: ttt,
        cache,
    };
    let out = tempfile::tempdir().unwrap();
    let train = TrainConfig {
        output_dir: out.path().to_path_buf(),
        mode: TrainMode::Full,
        num_epochs: 3,
        learning_rate: 3e-3,
        train_batch_size: 8,
        save_steps: 0,
        ..TrainConfig::default()
    };
    let draft = setup.draft(seed);
    let (trained, _) = Trainer::new(train, &loss)
        .run(Eagle3Model { draft }, &setup.examples)
        .unwrap();
    (trained.draft.named_tensors(), loss.cache.stats())
}

struct Losses(Vec<f64>);

impl TrainObserver for Losses {
    fn on_log(&mut self, r: &LogRecord) {
        self.0.push(r.loss);
    }
}

#[test]
fn ttt_training_lowers_the_loss_and_checkpoints_reload() {
    train_and_decode("demo/target", 20, 0.5);
}

/// The target's outputs kept between epochs change nothing in what is trained: three epochs
/// with every row kept, with none, and with a budget for some, end with the same weights bit
/// for bit; the full cache ran the target once per row and read the rows back after that.
#[test]
fn the_target_cache_changes_nothing_and_keeps_to_its_budget() {
    let setup = DemoSetup::new(64);
    let examples = &setup.examples;
    let per_position = TargetCache::bytes_per_position(setup.target.config().hidden_size);
    let positions: usize = examples.iter().map(|e| e.input_ids.len()).sum();
    let train = |budget: usize| train_with_cache(&setup, TargetCache::new(budget), 3, 11);
    let (kept, all) = train(1 << 30);
    let rows = examples.len();
    assert_eq!((all.rows, all.misses, all.hits), (rows, rows, 2 * rows));
    // The targets and the keys (three numbers per position).
    assert_eq!(all.bytes, positions * (per_position + 12));
    let (computed, none) = train(0);
    assert_eq!(
        none,
        CacheStats {
            rows: 0,
            bytes: 0,
            hits: 0,
            misses: 3 * rows,
            disk_reads: 0,
            disk_writes: 0,
            captured: 0,
        }
    );
    let budget = all.bytes / 2;
    let (part_kept, part) = train(budget);
    assert!(
        part.rows > 0 && part.rows < rows && part.bytes <= budget,
        "{part:?}"
    );
    assert_eq!(part.hits, 2 * part.rows);
    assert_eq!(part.hits + part.misses, 3 * rows);
    for (name, want) in &computed {
        assert_eq!(
            &kept[name], want,
            "{name}: kept rows vs the target every epoch"
        );
        assert_eq!(&part_kept[name], want, "{name}: some rows kept");
    }
}

/// Rows kept on disk (`--target_cache_dir`) are read back by later runs instead of running the
/// target, and training on them ends with the weights of training without any cache, bit for
/// bit: a first run writes every row once and reads them back from disk in its later epochs
/// (no memory budget); a second run over the same directory never runs the target; a damaged
/// row file and another row's file are computed again and rewritten; a directory of other
/// layers is refused, naming both.
#[test]
fn target_rows_on_disk_are_read_back_with_the_same_bits() {
    let setup = DemoSetup::new(64);
    let examples = &setup.examples;
    let dir = tempfile::tempdir().unwrap();
    let rows_dir = dir.path().join("targets");
    let manifest = TargetRowsManifest::new("demo".into(), setup.layers, setup.target.config());
    let train = |budget: usize, disk: bool| {
        let mut cache = TargetCache::new(budget);
        if disk {
            cache = cache.with_dir(&rows_dir, &manifest).unwrap();
        }
        train_with_cache(&setup, cache, 2, 5)
    };
    let files = || {
        let mut f: Vec<_> = std::fs::read_dir(rows_dir.join("rows"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        f.sort();
        f
    };
    let (want, _) = train(0, false);
    let rows = examples.len();
    let same = |got: &BTreeMap<String, TensorData>, what: &str| {
        for (name, w) in &want {
            assert_eq!(
                &got[name], w,
                "{name}: {what} against the target every epoch"
            );
        }
    };

    let (first, stats) = train(0, true);
    same(&first, "rows written, then read back from disk");
    assert_eq!(
        stats,
        CacheStats {
            rows: 0,
            bytes: 0,
            hits: 0,
            misses: rows,
            disk_reads: 2 * rows,
            disk_writes: rows,
            captured: 0,
        }
    );
    let written = files();
    assert_eq!(written.len(), rows);
    assert!(rows_dir.join(TARGET_ROWS_MANIFEST).is_file());

    let (again, stats) = train(1 << 30, true);
    same(&again, "a later run reading every row from disk");
    assert_eq!(
        (
            stats.misses,
            stats.disk_reads,
            stats.hits,
            stats.disk_writes
        ),
        (0, rows, 2 * rows, 0)
    );

    // One file cut short, another holding a third row's bytes.
    let cut = std::fs::read(&written[0]).unwrap();
    std::fs::write(&written[0], &cut[..cut.len() / 2]).unwrap();
    std::fs::copy(&written[2], &written[1]).unwrap();
    let (mended, stats) = train(0, true);
    same(&mended, "two damaged rows computed again");
    assert_eq!(
        (stats.misses, stats.disk_writes, stats.disk_reads),
        (2, 2, rows - 2 + 2 * rows)
    );
    assert_eq!(
        std::fs::read(&written[0]).unwrap(),
        cut,
        "rewritten as before"
    );

    // The demo target's layers are [1, 1, 1] (3 layers).
    let moved = [setup.layers[0], setup.layers[1], setup.layers[2] + 1];
    let other = TargetRowsManifest::new("other".into(), moved, setup.target.config());
    let e = TargetCache::new(0)
        .with_dir(&rows_dir, &other)
        .unwrap_err()
        .to_string();
    let layers = |l: [usize; 3]| {
        format!(
            "{:?}",
            [l[0], l[1], l[2], setup.target.config().num_hidden_layers]
        )
    };
    assert!(
        e.contains("--target_cache_dir")
            && e.contains("target: held demo, this run other")
            && e.contains(&format!(
                "layers: held {}, this run {}",
                layers(setup.layers),
                layers(moved)
            )),
        "{e}"
    );
}

/// The loss of a micro-batch is SpecForge's TTT loss against the target's own distribution:
/// the logits of the draft vocabulary that training makes again from the target's final
/// hidden state (rows kept or not) give the loss that the target's full logits give through
/// `kd_loss::TttTargets::new` (checked against SpecForge's code in kd-loss).
#[test]
fn the_loss_reads_the_targets_own_distribution() {
    use kd_loss::{TTT_DECAY, TttTargets, ttt_step_loss};
    use kd_model::{ForwardOptions, HiddenStates};
    use kd_train::StepLossFn;

    let setup = DemoSetup::new(16);
    let DemoSetup {
        target,
        examples,
        vocab,
        layers,
        ..
    } = &setup;
    // The 16 most frequent completion tokens: target ids that are not 0..16.
    assert_ne!(vocab.target_ids(), (0..16).collect::<Vec<u32>>().as_slice());
    let draft = setup.draft(5);
    let device = setup.device.clone();
    let ttt = 3;
    let loss = Eagle3Loss {
        target,
        layers: *layers,
        ttt_length: ttt,
        cache: TargetCache::new(1 << 30),
    };
    let model = Eagle3Model {
        draft: draft.clone(),
    };
    for row in [5usize, 18] {
        let batch = kd_data::collate(examples, &[vec![row]], 0, 64);
        let normalizer = batch.label_tokens() as f32;
        // Computed, then read back from the cache: the same loss.
        let got: Vec<f32> = (0..2)
            .map(|_| {
                let step = loss.loss(&model, &batch, normalizer, 0).unwrap();
                step.total.into_scalar::<f32>()
            })
            .collect();
        assert_eq!(got[0], got[1], "row {row}: kept vs computed");

        let s = batch.seq_len;
        let v = target.config().vocab_size;
        let out = target
            .forward(
                &kd_train::token_batch(&batch).unwrap(),
                &ForwardOptions {
                    hidden_states: HiddenStates::Layers(layers.to_vec()),
                    ..ForwardOptions::default()
                },
            )
            .unwrap();
        let features = Tensor::cat(
            out.hidden_states.iter().map(|(_, h)| h.clone()).collect(),
            2,
        );
        // Position t learns the target's distribution at t + 1 (the last one: none, masked).
        let logits = out.into_logits().unwrap();
        let next = Tensor::cat(
            vec![
                logits.slice([0..1, 1..s]),
                Tensor::<3>::zeros([1, 1, v], &device),
            ],
            1,
        );
        let shifted: Vec<i64> = (0..s)
            .map(|t| batch.input_ids.get(t + 1).map_or(0, |&i| i as i64))
            .collect();
        let mask: Vec<f32> = (0..s)
            .map(|t| f32::from(batch.labels.get(t + 1).is_some_and(|&l| l >= 0)))
            .collect();
        let targets = TttTargets::new(
            next,
            Tensor::<2>::from_data(TensorData::new(mask, [1, s]), &device),
            vocab.target_ids(),
        );
        let ids = Tensor::<2, Int>::from_data(TensorData::new(shifted, [1, s]), &device);
        let want: f32 = draft
            .unroll(ids, features, ttt)
            .into_iter()
            .enumerate()
            .map(|(k, l)| {
                ttt_step_loss(l, &targets.step(k)).into_scalar::<f32>()
                    * TTT_DECAY.powi(k as i32) as f32
                    * s as f32
                    / normalizer
            })
            .sum();
        assert!(
            (got[0] - want).abs() <= 1e-5 * want.abs(),
            "row {row}: the training loss {} against {want} from the target's logits",
            got[0]
        );
    }
}

#[test]
fn a_qwen_target_gets_a_llama_shaped_draft() {
    // tiny-qwen2 (q/k/v biases, θ 1e6): the draft layer stays Llama-shaped, as SpecForge's
    // does; its features come from the Qwen layers.
    let target = Llama::load(
        fixtures().join("tiny-models/tiny-qwen2"),
        &parse_device("cpu").unwrap(),
    )
    .unwrap();
    let config = Eagle3Config::for_target(target.config(), 64).unwrap();
    assert_eq!(config.llama.family, kd_model::ModelFamily::Llama);
    assert_eq!(config.llama.hidden_size, target.config().hidden_size);
    assert_eq!(config.llama.attention_biases(), [false; 4]);
    // A random target's distributions are hard to learn: measured 2.15 → 1.89 in 10 epochs.
    train_and_decode("tiny-models/tiny-qwen2", 10, 0.95);
}

/// Trains an EAGLE-3 draft for the target under fixtures/ for `epochs` epochs: the TTT loss
/// falls below `ratio` of its first value, the checkpoint reloads bit for bit, and greedy
/// speculative decoding returns the target's own greedy tokens.
fn train_and_decode(target_dir: &str, epochs: usize, ratio: f64) {
    let device = parse_device("cpu").unwrap();
    let target = Llama::load(fixtures().join(target_dir), &device).unwrap();
    let tc = target.config().clone();
    let examples = examples(tc.vocab_size as u32);
    let vocab = draft_vocab_from_examples(&examples, tc.vocab_size, 64).unwrap();
    let config = Eagle3Config::for_target(&tc, 64).unwrap();
    let embedding = target.embed_tokens.weight.val();
    let draft = Eagle3Draft::new(config, vocab, embedding.clone(), 7, &device).unwrap();
    let layers = default_feature_layers(tc.num_hidden_layers);
    let loss = Eagle3Loss {
        target: &target,
        layers,
        ttt_length: 3,
        cache: TargetCache::new(1 << 30),
    };
    let out = tempfile::tempdir().unwrap();
    let train = TrainConfig {
        output_dir: out.path().to_path_buf(),
        mode: TrainMode::Full,
        num_epochs: epochs,
        learning_rate: 3e-3,
        train_batch_size: 8,
        logging_steps: 1,
        save_steps: 0,
        ..TrainConfig::default()
    };
    let mut losses = Losses(Vec::new());
    let (trained, summary) = Trainer::new(train, &loss)
        .observer(&mut losses)
        .run(Eagle3Model { draft }, &examples)
        .unwrap();
    let losses = losses.0;
    assert!(losses.len() >= epochs / 2, "{losses:?}");
    let first = losses[0];
    let last = *losses.last().unwrap();
    eprintln!(
        "{target_dir}: TTT loss {first:.4} → {last:.4} over {} steps",
        summary.global_step
    );
    assert!(
        last < ratio * first,
        "{target_dir}: the loss did not fall below {ratio} of its first value: {first} → {last}"
    );

    // The last checkpoint is a SpecForge draft directory: config + weights + d2t/t2d.
    let ckpt = summary.checkpoints.last().expect("a checkpoint");
    let config = Eagle3Config::from_file(ckpt.join("config.json")).unwrap();
    assert_eq!(config.draft_vocab_size, 64);
    let reloaded = Eagle3Draft::load(ckpt, Some(embedding), &device).unwrap();
    assert_eq!(reloaded.vocab(), trained.draft.vocab());
    for (name, data) in trained.draft.named_tensors() {
        assert_eq!(reloaded.named_tensors()[&name], data, "{name}");
    }

    // Speculative decoding with the trained draft returns the target's own greedy tokens.
    let prompts: Vec<Vec<u32>> = examples
        .iter()
        .take(6)
        .map(|e| e.input_ids[..e.prompt_len + 2].to_vec())
        .collect();
    let seeded: Vec<kd_model::SeededPrompt<'_>> = prompts
        .iter()
        .map(|ids| kd_model::SeededPrompt { ids, seed: 0 })
        .collect();
    let drafter = kd_eval::Eagle3Drafter::new(&reloaded, layers);
    let plain = target
        .generate(&seeded, &kd_model::GenerateOptions::greedy(16))
        .unwrap();
    // Always 3 drafts, then rows that stop drafting where the head is unsure (rows of one
    // batch then verify different numbers of drafts).
    for p_min in [0.0, 0.3] {
        let spec = kd_eval::SpecConfig {
            k: 3,
            max_new_tokens: 16,
            draft_p_min: p_min,
            ..kd_eval::SpecConfig::default()
        };
        // All rows as one left-padded batch (rows finish and diverge independently) ...
        let batched = kd_eval::speculative_generate(&target, &drafter, &seeded, &spec).unwrap();
        for (i, (got, want)) in batched.completions.iter().zip(&plain).enumerate() {
            assert_eq!(got.ids, want.ids, "p_min {p_min}, prompt {:?}", prompts[i]);
            // ... and one row at a time.
            let alone =
                kd_eval::speculative_generate(&target, &drafter, &seeded[i..i + 1], &spec).unwrap();
            assert_eq!(
                alone.completions[0].ids, want.ids,
                "p_min {p_min}, prompt {:?} alone",
                prompts[i]
            );
        }
        let stats = &batched.stats;
        eprintln!(
            "EAGLE-3 greedy, draft_p_min {p_min}: {} verifications, {} drafted, acceptance \
             {:.1}%, mean accepted length {:.2}",
            stats.verify_steps,
            stats.drafted,
            100.0 * stats.acceptance_rate(),
            stats.mean_accepted_length()
        );
        assert!(stats.verify_steps > 0 && stats.verify_steps < 6 * 16);
    }
}

#[test]
fn cached_decoding_matches_the_ttt_step() {
    // Feeding positions one at a time through the cache computes what step 0 computes over
    // the whole sequence at once.
    let device = parse_device("cpu").unwrap();
    device.seed(3);
    let target = Llama::load(fixtures().join("demo/target"), &device).unwrap();
    let tc = target.config().clone();
    let vocab =
        draft_vocab_from_examples(&examples(tc.vocab_size as u32), tc.vocab_size, 32).unwrap();
    let draft = Eagle3Draft::new(
        Eagle3Config::for_target(&tc, 32).unwrap(),
        vocab,
        target.embed_tokens.weight.val(),
        3,
        &device,
    )
    .unwrap();
    let s = 6;
    let ids: Vec<i64> = (0..s as i64).map(|i| 5 + 3 * i).collect();
    let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, s]), &device);
    let features = Tensor::<3>::random(
        [1, s, 3 * tc.hidden_size],
        burn::tensor::Distribution::Normal(0.0, 1.0),
        &device,
    );
    let whole = draft.step(
        ids.clone(),
        draft.fuse(features.clone()),
        &mut kd_model::eagle3::TttCache::new(),
    );
    let mut cache = DraftKvCache::new();
    let first = draft.forward_cached(
        ids.clone().slice([0..1, 0..4]),
        draft.fuse(features.clone().slice([0..1, 0..4])),
        &mut cache,
    );
    // A rejected position rolled back and fed again gives the same result.
    let _ = draft.forward_cached(
        ids.clone().slice([0..1, 4..5]),
        draft.fuse(features.clone().slice([0..1, 0..1])),
        &mut cache,
    );
    cache.truncate(4);
    let rest = draft.forward_cached(
        ids.slice([0..1, 4..s]),
        draft.fuse(features.slice([0..1, 4..s])),
        &mut cache,
    );
    let cached = Tensor::cat(vec![first, rest], 1);
    let diff: f32 = (whole - cached).abs().max().into_scalar();
    assert!(diff < 1e-5, "cached decoding differs by {diff}");
}

/// A safetensors file of `fixtures/eagle3/` as f32 tensors (ints and bools converted), by name.
fn fixture_tensors(name: &str) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    use safetensors::{Dtype, SafeTensors};
    let bytes = std::fs::read(fixtures().join("eagle3").join(name)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(k, v)| {
            let d = v.data();
            let values: Vec<f32> = match v.dtype() {
                Dtype::F64 => d
                    .chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().unwrap()) as f32)
                    .collect(),
                Dtype::F32 => d
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
                Dtype::I64 => d
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f32)
                    .collect(),
                other => panic!("{k}: unexpected dtype {other:?}"),
            };
            (k, (v.shape().to_vec(), values))
        })
        .collect()
}

/// The TTT loss's gradients through the draft against SpecForge's own code:
/// `fixtures/eagle3/specforge/` holds what SpecForge 0.2.0's `LlamaForCausalLMEagle3` and
/// `OnlineEagle3Model` computed on the fixture draft and inputs (three steps, the step losses
/// weighted 0.8^k as its `Eagle3TrainStrategy` does, then `backward()`;
/// `fixtures/make_specforge_golden.py`). Here the draft unrolls the same three steps and
/// `kd_loss::ttt_loss` (SpecForge's loss) backpropagates through it: every trained tensor's
/// gradient within 1e-4 of SpecForge's float64 run, and within ten times SpecForge's own
/// float32-to-float64 spread (measured: 1.0–3.0e-7 against spreads of 0.9–3.7e-7).
#[test]
fn ttt_gradients_match_specforge() {
    gradients_match("eagle3", "eagle3/specforge", "midlayer.");
}

/// The same for the drafts read from vLLM's `speculators` layout whose layers add norms:
/// Qwen3's decoder layer (per-head `q_norm`, `k_norm`) and `norm_before_fc` (`input_norm`
/// over the features). The reference is speculators' own model class on the draft it saved,
/// with SpecForge's step loss on its logits against the targets SpecForge's `OnlineEagle3Model`
/// computes (`fixtures/make_speculators_golden.py`); the added norms are trained too
/// (measured: within 3.7e-7 of the float64 reference, whose own f32 − f64 spreads are
/// 0.7–2.8e-7).
#[test]
fn ttt_gradients_of_speculators_norms_match() {
    gradients_match(
        "eagle3/speculators/qwen3-layer",
        "eagle3/speculators/qwen3-layer",
        "layers.0.",
    );
    gradients_match(
        "eagle3/speculators/norm-before-fc",
        "eagle3/speculators/norm-before-fc",
        "layers.0.",
    );
}

/// The draft in `fixtures/<draft>` unrolled three TTT steps on the fixture's inputs,
/// `kd_loss::ttt_loss` backpropagated: every trained tensor's gradient against
/// `fixtures/<reference>/grads_f64.safetensors` (names with the layer prefix `layer`), within
/// 1e-4 and ten times the reference's own f32 − f64 spread (`grads_f32.safetensors`).
fn gradients_match(draft_dir: &str, reference_dir: &str, layer: &str) {
    use burn::module::{Module, Param};
    let device = parse_device("cpu").unwrap();
    let draft = Eagle3Draft::load(fixtures().join(draft_dir), None, &device)
        .unwrap()
        .train();
    let inputs = fixture_tensors("inputs.safetensors");
    let tensor3 = |name: &str| {
        let (s, v) = &inputs[name];
        Tensor::<3>::from_data(TensorData::new(v.clone(), [s[0], s[1], s[2]]), &device)
    };
    let tensor2 = |name: &str| {
        let (s, v) = &inputs[name];
        Tensor::<2>::from_data(TensorData::new(v.clone(), [s[0], s[1]]), &device)
    };
    let (shape, ids) = &inputs["input_ids"];
    let ids = Tensor::<2, Int>::from_data(
        TensorData::new(
            ids.iter().map(|&v| v as i64).collect::<Vec<_>>(),
            [shape[0], shape[1]],
        ),
        &device,
    );
    let logits = draft.unroll(ids, tensor3("hidden_states"), 3);
    let targets = kd_loss::TttTargets::new(
        tensor3("target"),
        tensor2("loss_mask"),
        draft.vocab().target_ids(),
    );
    let grads = kd_loss::ttt_loss(&logits, &targets).backward();

    let reference = fixture_tensors(&format!("../{reference_dir}/grads_f64.safetensors"));
    let reference32 = fixture_tensors(&format!("../{reference_dir}/grads_f32.safetensors"));
    let linear = |p: &Param<Tensor<2>>| {
        // Burn holds [in, out]; nn.Linear [out, in].
        let g = p.val().grad(&grads).expect("a gradient").transpose();
        g.into_data().try_into_vec_as::<f32>().unwrap()
    };
    let vector = |p: &Param<Tensor<1>>| {
        let g = p.val().grad(&grads).expect("a gradient");
        g.into_data().try_into_vec_as::<f32>().unwrap()
    };
    let m = |name: &str| format!("{layer}{name}");
    let mut ours: Vec<(String, Vec<f32>)> = vec![
        ("fc.weight".into(), linear(&draft.fc)),
        (m("self_attn.q_proj.weight"), linear(&draft.q_proj)),
        (m("self_attn.k_proj.weight"), linear(&draft.k_proj)),
        (m("self_attn.v_proj.weight"), linear(&draft.v_proj)),
        (m("self_attn.o_proj.weight"), linear(&draft.o_proj)),
        (m("mlp.gate_proj.weight"), linear(&draft.gate_proj)),
        (m("mlp.up_proj.weight"), linear(&draft.up_proj)),
        (m("mlp.down_proj.weight"), linear(&draft.down_proj)),
        ("lm_head.weight".into(), linear(&draft.lm_head)),
        (m("input_layernorm.weight"), vector(&draft.input_layernorm)),
        (m("hidden_norm.weight"), vector(&draft.hidden_norm)),
        (
            m("post_attention_layernorm.weight"),
            vector(&draft.post_attention_layernorm),
        ),
        ("norm.weight".into(), vector(&draft.norm)),
    ];
    for (name, p) in [
        ("input_norm.weight".to_string(), &draft.input_norm),
        (m("self_attn.q_norm.weight"), &draft.q_norm),
        (m("self_attn.k_norm.weight"), &draft.k_norm),
    ] {
        if let Some(p) = p {
            ours.push((name, vector(p)));
        }
    }
    assert_eq!(ours.len(), reference.len(), "every trained tensor");
    // The target's embedding stays frozen, as SpecForge trains it.
    assert!(draft.embed_tokens.val().grad(&grads).is_none());
    for (name, g) in ours {
        let (_, theirs) = &reference[&name];
        let (_, theirs32) = &reference32[&name];
        assert_eq!(g.len(), theirs.len(), "{name}");
        let worst = |a: &[f32]| {
            a.iter()
                .zip(theirs)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
        };
        let (d, spread) = (worst(&g), worst(theirs32));
        eprintln!(
            "{draft_dir} {name}: max |ours − reference| {d:.2e} (reference f32 − f64 {spread:.2e})"
        );
        assert!(d <= 1e-4, "{name}: {d} > 1e-4");
        assert!(d <= 10.0 * spread.max(1e-7), "{name}: {d} > 10 × {spread}");
    }
}

/// `speculator export --to vllm` of a draft in the `speculators` layout, outside any run and
/// without `--verifier`, keeps the verifier the draft names (its `name_or_path` and
/// `architectures`); `--to sglang` needs none.
#[test]
fn re_exporting_a_speculators_draft_keeps_its_verifier() {
    use kd_speculator::{ExportTarget, export};
    let tmp = tempfile::tempdir().unwrap();
    let draft = fixtures().join("eagle3/speculators/converted");
    let config = |to, dir: &str| crate::export_config(&draft, tmp.path().join(dir), to);
    let named = export(&config(ExportTarget::Vllm, "vllm")).unwrap();
    assert_eq!(
        named.as_deref(),
        Some("fixtures/eagle3/speculators/verifier")
    );
    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("vllm/config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        json["speculators_config"]["verifier"],
        serde_json::json!({
            "name_or_path": "fixtures/eagle3/speculators/verifier",
            "architectures": ["LlamaForCausalLM"]
        })
    );
    assert_eq!(
        export(&config(ExportTarget::Sglang, "sglang")).unwrap(),
        None
    );
    // llama.cpp needs the target's GGUF file, which a speculators config does not name.
    let e = export(&config(ExportTarget::Gguf, "draft.gguf"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("--verifier"), "{e}");
}
