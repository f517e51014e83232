//! Training EAGLE-3 drafts with the generic trainer: the draft as a [`Trainable`] model, and
//! the TTT loss over the target's features, computed online per micro-batch (the target runs
//! without gradients on each batch; nothing is cached on disk).
//!
//! Alignment follows SpecForge's target head: the target runs over the unshifted tokens; the
//! draft's position `t` reads the target's features at `t` and the embedding of token `t + 1`,
//! and learns the target's distribution at `t + 1`; a position counts when token `t + 1` is a
//! completion token. The loss of a micro-batch is SpecForge's masked soft cross-entropy summed
//! over positions and steps (weights `0.8^k`), divided by the trainer's normaliser (the step's
//! label-token count) rather than SpecForge's `batch · seq`, so that gradient accumulation and
//! micro-batch sizes do not change the objective.

use std::path::Path;

use burn::module::Module;
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use kd_data::{Batch, Example};
use kd_eval::Drafter;
use kd_lora::derive_seed;
use kd_loss::{TTT_DECAY, TttTargets, ttt_step_counts, ttt_step_loss};
use kd_model::{DraftVocab, Eagle3Config, Eagle3Draft, ForwardOptions, HiddenStates, Llama};
use kd_train::{
    StepLoss, StepLossFn, TrainConfig, TrainError, TrainMode, Trainable, Trainer, token_batch,
};

use crate::acceptance::{CheckpointDraft, CheckpointEval, Eagle3Source, TrainingWatcher};
use crate::config::DraftHeadInit;
use crate::error::PipelineError;
use crate::observe::Phase;
use crate::run::{Phases, Trained};
use crate::settings::train_config;
use crate::setup::{aux_layers, draft_vocab_size};

/// The target layers whose hidden states the draft reads, in Hugging Face's
/// `output_hidden_states` indexing (index i is the input of decoder layer i): `[2, L/2, L − 3]`
/// for a target of `L` layers, the low / mid / high choice of EAGLE-3, SpecForge, vLLM and
/// SGLang. Small targets clamp into `1..L` (the inputs of layers 1 to L − 1, which every
/// server can capture).
pub fn default_feature_layers(num_layers: usize) -> [usize; 3] {
    let top = num_layers.saturating_sub(1).max(1);
    let high = num_layers.saturating_sub(3).clamp(1, top);
    let mid = (num_layers / 2).clamp(1, high);
    let low = 2.clamp(1, mid);
    [low, mid, high]
}

/// The draft vocabulary from the completion tokens of the training examples (the tokens the
/// draft learns to predict), by SpecForge's rule ([`DraftVocab::from_counts`]).
pub fn draft_vocab_from_examples(
    examples: &[Example],
    target_vocab: usize,
    size: usize,
) -> kd_model::Result<DraftVocab> {
    let mut counts = vec![0u64; target_vocab];
    for e in examples {
        for &l in &e.labels {
            if l >= 0 && (l as usize) < target_vocab {
                counts[l as usize] += 1;
            }
        }
    }
    DraftVocab::from_counts(&counts, size.min(target_vocab))
}

/// An EAGLE-3 draft under training: every draft weight trains, the target's embedding stays
/// frozen. Checkpoints hold the draft as SpecForge exports it ([`Eagle3Draft::save`]).
#[derive(Module, Debug)]
pub struct Eagle3Model {
    /// The draft.
    pub draft: Eagle3Draft,
}

impl Trainable for Eagle3Model {
    fn device(&self) -> Device {
        self.draft.fc.val().device()
    }

    fn mode(&self) -> TrainMode {
        TrainMode::Full
    }

    fn pad_id(&self) -> u32 {
        self.draft.config().llama.pad_token_id.unwrap_or(0)
    }

    fn save_files(&self, dir: &Path) -> kd_train::Result<()> {
        Ok(self.draft.save(dir)?)
    }

    fn load_files(self, dir: &Path) -> kd_train::Result<Self> {
        let device = self.device();
        let embedding = self.draft.embed_tokens.val();
        Ok(Self {
            draft: Eagle3Draft::load(dir, Some(embedding), &device)?,
        })
    }

    fn describe(&self) -> Option<String> {
        let c = self.draft.config();
        Some(format!(
            "EAGLE-3 draft: width {}, draft vocabulary {} of {}, features of 3 target layers",
            c.llama.hidden_size, c.draft_vocab_size, c.llama.vocab_size
        ))
    }
}

/// `["ttt_step0{suffix}", …, "ttt_step15{suffix}"]`.
macro_rules! step_names {
    ($suffix:literal) => {
        step_names!($suffix; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)
    };
    ($suffix:literal; $($k:literal)*) => {
        [$(concat!("ttt_step", $k, $suffix)),*]
    };
}

/// The per-step metric names of the training log, for the first 16 TTT steps (later steps are
/// trained but not logged one by one). `ttt_step{k}_acc`: the share of the step's label tokens
/// where step `k`'s draft argmax is the target's argmax (SpecForge's `acc_k`; for `k > 0`
/// SpecForge divides by the labels left after the shift, a few fewer). `ttt_step{k}_alpha`:
/// `Σ min(p_target, p_draft)` per label token, a token outside the draft vocabulary counting
/// as rejected (SpecForge's acceptance rate divides by the in-vocabulary tokens instead), the
/// expected acceptance of that step's draft.
const STEP_ACC: [&str; 16] = step_names!("_acc");
/// See [`STEP_ACC`].
const STEP_ALPHA: [&str; 16] = step_names!("_alpha");

/// The TTT loss of an EAGLE-3 draft against a target run online.
pub struct Eagle3Loss<'a> {
    /// The target (inference only).
    pub target: &'a Llama,
    /// Its layers the draft reads ([`default_feature_layers`]).
    pub layers: [usize; 3],
    /// TTT steps per position (SpecForge's default 7).
    pub ttt_length: usize,
}

/// What one micro-batch's target pass gives the draft.
struct TargetPass {
    ids: Tensor<2, Int>,
    features: Tensor<3>,
    targets: TttTargets,
}

impl Eagle3Loss<'_> {
    fn target_pass(
        &self,
        batch: &Batch,
        draft: &Eagle3Draft,
        device: &Device,
    ) -> kd_train::Result<TargetPass> {
        let (b, s) = (batch.batch_size, batch.seq_len);
        let tb = token_batch(batch)?;
        let out = self.target.forward(
            &tb,
            &ForwardOptions {
                hidden_states: HiddenStates::Layers(self.layers.to_vec()),
                ..ForwardOptions::default()
            },
        )?;
        let features = Tensor::cat(
            out.hidden_states.iter().map(|(_, h)| h.clone()).collect(),
            2,
        );
        let logits = out.into_logits()?;
        let vocab = logits.dims()[2];
        let target_device = logits.device();
        // Shift left by one: row t holds the target's distribution at t + 1, the last row zeros.
        let shifted = Tensor::cat(
            vec![
                logits.slice([0..b, 1..s, 0..vocab]),
                Tensor::<3>::zeros([b, 1, vocab], (&target_device, DType::F32)),
            ],
            1,
        );
        let mut ids = vec![0i64; b * s];
        let mut mask = vec![0f32; b * s];
        for row in 0..b {
            for t in 0..s - 1 {
                let next = row * s + t + 1;
                ids[row * s + t] = batch.input_ids[next] as i64;
                mask[row * s + t] =
                    (batch.labels[next] >= 0 && batch.attention_mask[next]) as u8 as f32;
            }
        }
        let mask_t =
            Tensor::<2>::from_data(TensorData::new(mask, [b, s]), (&target_device, DType::F32));
        let targets = TttTargets::new(shifted, mask_t, draft.vocab().target_ids());
        // To the draft's device (small: the draft vocabulary, not the target's).
        let move3 = |t: Tensor<3>| Tensor::<3>::from_data(t.into_data(), device);
        let move2 = |t: Tensor<2>| Tensor::<2>::from_data(t.into_data(), device);
        Ok(TargetPass {
            ids: Tensor::from_data(TensorData::new(ids, [b, s]), device),
            features: move3(features),
            targets: TttTargets {
                target_p: move3(targets.target_p),
                target_p_on_draft: move3(targets.target_p_on_draft),
                target_ids: Tensor::from_data(targets.target_ids.into_data(), device),
                position_mask: move2(targets.position_mask),
                loss_mask: move2(targets.loss_mask),
            },
        })
    }
}

impl StepLossFn<Eagle3Model> for Eagle3Loss<'_> {
    fn loss(
        &self,
        model: &Eagle3Model,
        batch: &Batch,
        normalizer: f32,
        _dropout_seed: u64,
    ) -> kd_train::Result<StepLoss> {
        if self.ttt_length == 0 {
            return Err(TrainError::Config("ttt_length must be at least 1".into()));
        }
        let device = model.device();
        let pass = self.target_pass(batch, &model.draft, &device)?;
        let rows = (batch.batch_size * batch.seq_len) as f64;
        let logits = model.draft.unroll(pass.ids, pass.features, self.ttt_length);
        let mut total: Option<Tensor<1>> = None;
        let mut first = 0.0;
        let mut metrics = Vec::new();
        let per_token = 1.0 / normalizer.max(1.0) as f64;
        for (k, l) in logits.into_iter().enumerate() {
            let targets = pass.targets.step(k);
            if let (Some(acc), Some(alpha)) = (STEP_ACC.get(k), STEP_ALPHA.get(k)) {
                let counts = ttt_step_counts(
                    l.clone().detach(),
                    &targets,
                    model.draft.vocab().target_ids(),
                );
                metrics.push((*acc, counts.correct * per_token));
                metrics.push((*alpha, counts.overlap * per_token));
            }
            // ttt_step_loss divides by batch · seq: undo it, then divide by the normaliser.
            let step = ttt_step_loss(l, &targets)
                .mul_scalar(TTT_DECAY.powi(k as i32) * rows / normalizer.max(1.0) as f64);
            if k == 0 {
                first = step.clone().into_scalar::<f32>() as f64;
            }
            total = Some(match total {
                Some(t) => t + step,
                None => step,
            });
        }
        let total = total.expect("at least one step");
        let mut terms = vec![
            ("ttt_loss", total.clone().into_scalar::<f32>() as f64),
            ("ttt_step0_loss", first),
        ];
        terms.extend(metrics);
        Ok(StepLoss {
            terms,
            total,
            kd: None,
        })
    }
}

/// The EAGLE-3 phases of a speculator run (after generation): a fresh draft for the target
/// (or `init_adapter`'s draft directory), acceptance before, TTT training with the generic
/// trainer (checkpoints are SpecForge draft directories), acceptance after.
pub(crate) fn train_eagle3(phases: Phases<'_, '_>) -> crate::Result<Trained> {
    let Phases {
        config,
        setup,
        teacher,
        examples,
        timer,
        mut tb,
        eval,
        observer,
        warnings,
    } = phases;
    let Some(target) = teacher.target() else {
        return Err(PipelineError::Config(
            "--draft_method eagle3 reads the target's hidden states: --target_model must be a \
             local model directory"
                .into(),
        ));
    };
    let tc = target.config();
    let layers = aux_layers(config, tc);
    let device = &setup.draft_device;
    let embedding = Tensor::<2>::from_data(target.embed_tokens.weight.val().into_data(), device);
    let draft = match &config.init_adapter {
        Some(dir) => {
            let draft = Eagle3Draft::load(dir, Some(embedding.clone()), device)?;
            kd_eval::Eagle3Drafter::new(&draft, layers).check_target(target)?;
            draft
        }
        None => {
            let size = draft_vocab_size(config, tc.vocab_size);
            let vocab = draft_vocab_from_examples(&examples.examples, tc.vocab_size, size)?;
            let mut draft_config = Eagle3Config::for_target(tc, vocab.len())?;
            draft_config.aux_layers = Some(layers);
            device.seed(derive_seed(config.seed, &[0xEA3]));
            let draft = Eagle3Draft::new(draft_config, vocab, embedding.clone(), device)?;
            match config.draft_head_init {
                DraftHeadInit::Random => draft,
                DraftHeadInit::Target => draft.with_target_head(target)?,
            }
        }
    };
    let coverage = vocab_coverage(draft.vocab(), &examples.examples);
    if coverage < 0.95 {
        let w = format!(
            "the draft vocabulary of {} tokens covers {:.1}% of the completion tokens: a draft \
             never proposes the rest (raise --draft_vocab_size)",
            draft.vocab().len(),
            100.0 * coverage
        );
        warnings.push(observer, w);
    }
    if eval.file.is_some() {
        observer.on_phase(Phase::EvalBefore);
        let head = draft.clone().with_q8_0_weights(eval.draft_q8_0);
        eval.before(
            &kd_eval::Eagle3Drafter::new(&head, layers),
            tb.as_deref_mut(),
            observer,
        )?;
        timer.end(Phase::EvalBefore);
    }

    observer.on_phase(Phase::Train);
    let loss = Eagle3Loss {
        target,
        layers,
        ttt_length: config.ttt_length,
    };
    let base = CheckpointDraft::Eagle3(Box::new(Eagle3Source {
        embedding,
        device: device.clone(),
        layers,
    }));
    let mut watcher = TrainingWatcher {
        inner: observer,
        last_log: None,
        eval: eval.at_checkpoints(base, config.eval_steps),
    };
    let train = TrainConfig {
        mode: TrainMode::Full,
        ..train_config(config)
    };
    let (trained, summary) = Trainer::new(train, &loss)
        .observer(&mut watcher)
        .run(Eagle3Model { draft }, &examples.examples)?;
    let measured = match watcher.eval.take() {
        Some(CheckpointEval { error: Some(e), .. }) => return Err(e),
        Some(e) => e.results,
        None => Vec::new(),
    };
    let last_log = watcher.last_log.take();
    timer.end(Phase::Train);

    if eval.file.is_some() {
        observer.on_phase(Phase::EvalAfter);
        let head = trained.draft.clone().with_q8_0_weights(eval.draft_q8_0);
        eval.after(
            &kd_eval::Eagle3Drafter::new(&head, layers),
            &summary,
            &measured,
            tb,
            observer,
        )?;
        timer.end(Phase::EvalAfter);
    }
    Ok(Trained {
        summary,
        on_policy: None,
        last_log,
    })
}

/// Share of the examples' completion tokens inside the draft vocabulary.
fn vocab_coverage(vocab: &DraftVocab, examples: &[Example]) -> f64 {
    let inside: std::collections::HashSet<u32> = vocab.target_ids().iter().copied().collect();
    let (mut hit, mut all) = (0usize, 0usize);
    for l in examples.iter().flat_map(|e| &e.labels) {
        if *l >= 0 {
            all += 1;
            hit += inside.contains(&(*l as u32)) as usize;
        }
    }
    if all == 0 {
        1.0
    } else {
        hit as f64 / all as f64
    }
}
