//! The speculator pipeline end to end: prompts → the target's completions (resumable cache)
//! → the draft's LoRA training → acceptance of the draft before and after, by real
//! speculative decoding on held-out prompts.

use std::path::PathBuf;
use std::time::Instant;

use kd_lora::derive_seed;
use kd_loss::HiddenProjection;
use kd_model::Llama;
use kd_teacher::{Generation, Scores};

use crate::acceptance::{
    Acceptance, AcceptanceFile, CheckpointAcceptance, CheckpointDraft, CheckpointEval,
    TrainingWatcher,
};
use crate::config::{DraftMethod, SpeculatorConfig};
use crate::data::{Examples, build_examples};
use crate::error::{PipelineError, Result};
use crate::loss::{SpeculatorLoss, TeacherTargets};
use crate::observe::{Phase, SpeculatorObserver};
use crate::settings::{TeacherBackend, load_teacher, lora_config, on_policy_config, train_config};
use crate::setup::{RUN_CONFIG_FILE, Setup, clear_run, setup};
use crate::teacher::{generate_completions, score};
use kd_pipeline::on_policy::OnPolicy;
use kd_pipeline::on_policy::{OnPolicyData, OnPolicyTotals};
use kd_train::metrics::{LogRecord, TensorBoard};
use kd_train::{ModelFiles, TrainModel, TrainSummary, Trainer};

/// How a run went.
#[derive(Debug, Clone, PartialEq)]
pub struct SpeculatorSummary {
    /// Where everything was written.
    pub output_dir: PathBuf,
    /// Prompts read, used for training, held out.
    pub prompts: (usize, usize, usize),
    /// Tokens the target generated (cached shards included).
    pub generated_tokens: usize,
    /// Completions the target returned empty (not trained on).
    pub empty_completions: usize,
    /// Label tokens trained on per epoch.
    pub trained_tokens_per_epoch: usize,
    /// Wall time of each phase.
    pub phase_seconds: Vec<(Phase, f64)>,
    /// The trainer's summary.
    pub train: TrainSummary,
    /// What the on-policy rows cost (runs with on-policy rows only).
    pub on_policy: Option<OnPolicyTotals>,
    /// EAGLE-3 runs: the training rows the target ran on, and those read back from memory or
    /// from disk (`--target_cache_dir`) instead.
    pub target_rows: Option<crate::eagle3::CacheStats>,
    /// The last logged losses.
    pub last_log: Option<LogRecord>,
    /// Acceptance before and after training (absent when the target is remote only or no
    /// prompt is held out).
    pub acceptance: Option<AcceptanceFile>,
    /// `acceptance.json`, when written.
    pub acceptance_path: Option<PathBuf>,
    /// Non-fatal problems met on the way.
    pub warnings: Vec<String>,
}

/// Runs the pipeline: setup, the target's completions, its scores (when a loss term needs
/// them), acceptance before training, training, acceptance after. With
/// `draft_method: eagle3` the draft is an EAGLE-3 head over the target's features instead of
/// LoRA adapters on `draft_model` (no scoring phase: the target runs online in training).
pub fn run(
    config: &SpeculatorConfig,
    observer: &mut dyn SpeculatorObserver,
) -> Result<SpeculatorSummary> {
    let mut timer = PhaseTimer::new();
    let mut warnings = Warnings::default();

    observer.on_phase(Phase::Setup);
    // The draft as the user named it: a hub id stays the adapters' `base_model_name_or_path`
    // (as PEFT records it), not the snapshot directory it resolves to here.
    let base_model = config.draft_model.display().to_string();
    // Across ranks (mpirun -np N), every rank runs every phase on its share; rank 0 alone
    // writes the run's files. Hub ids are downloaded by one rank per machine at a time.
    let world = kd_dist::world();
    let config = &kd_pipeline::ranks::local_turns(world, || config.with_local_models())?;
    let setup = setup(config)?;
    for w in &setup.warnings {
        warnings.push(observer, w.clone());
    }
    // Before the output directory is touched: a target that cannot decode as asked
    // (`--target_int8`, `--target_amx`) is refused with the earlier run's files intact.
    let teacher = load_teacher(config, &setup)?;
    // So is a --target_cache_dir holding another target's rows, before anything is generated.
    let target_cache = match (config.draft_method, teacher.target()) {
        (DraftMethod::Eagle3, Some(target)) => {
            Some(crate::eagle3::target_cache(config, &teacher, target)?)
        }
        _ => None,
    };
    // Held until the run returns: a second run into the same directory is refused.
    let _lock = if world.is_root() {
        Some(prepare_output_dir(config)?)
    } else {
        None
    };
    let draft_base = match config.draft_method {
        DraftMethod::Lora => {
            let draft = Llama::load(&config.draft_model, &setup.draft_device)?;
            if let Some(target) = teacher.target() {
                kd_eval::check_pair(target, &draft)?;
            }
            Some(draft)
        }
        DraftMethod::Eagle3 => None,
    };
    timer.end(Phase::Setup);

    observer.on_phase(Phase::Generate);
    let generations =
        generate_completions(config, &setup, &teacher, target_cache.as_ref(), observer)?;
    let generated_tokens = generations.iter().map(|g| g.ids.len()).sum();
    let examples = training_examples(config, &setup, &generations, observer, &mut warnings)?;
    timer.end(Phase::Generate);

    let mut eval = Acceptance::new(config, &setup, &teacher, observer, &mut warnings);
    // Every rank decodes its share of the held-out prompts; rank 0 writes the results.
    let mut tb = if world.is_root() {
        Some(TensorBoard::create(&config.output_dir.join("runs"))?)
    } else {
        None
    };
    let phases = Phases {
        config,
        setup: &setup,
        teacher: &teacher,
        examples: &examples,
        timer: &mut timer,
        tb: tb.as_mut(),
        eval: &mut eval,
        observer,
        warnings: &mut warnings,
    };
    let trained = match &draft_base {
        Some(draft_base) => train_lora(phases, draft_base, base_model, &generations)?,
        None => crate::eagle3::train_eagle3(phases, target_cache)?,
    };

    Ok(SpeculatorSummary {
        output_dir: config.output_dir.clone(),
        prompts: (
            setup.prompts.records.len(),
            setup.prompts.train.len(),
            setup.prompts.eval.len(),
        ),
        generated_tokens,
        empty_completions: examples.empty,
        trained_tokens_per_epoch: examples
            .examples
            .iter()
            .map(|e| e.labels.iter().skip(1).filter(|l| **l >= 0).count())
            .sum(),
        phase_seconds: timer.phases,
        train: trained.summary,
        on_policy: trained.on_policy,
        target_rows: trained.target_rows,
        last_log: trained.last_log,
        acceptance_path: eval.file.as_ref().map(|_| eval.path.clone()),
        acceptance: eval.file,
        warnings: warnings.0,
    })
}

/// What the phases after generation share: the run's inputs, its clock, TensorBoard and the
/// acceptance measurement.
pub(crate) struct Phases<'a, 'b> {
    pub(crate) config: &'a SpeculatorConfig,
    pub(crate) setup: &'a Setup,
    pub(crate) teacher: &'a TeacherBackend,
    pub(crate) examples: &'a Examples,
    pub(crate) timer: &'b mut PhaseTimer,
    pub(crate) tb: Option<&'b mut TensorBoard>,
    pub(crate) eval: &'b mut Acceptance<'a>,
    pub(crate) observer: &'b mut dyn SpeculatorObserver,
    /// Non-fatal problems met on the way (the summary's).
    pub(crate) warnings: &'b mut Warnings,
}

/// The LoRA draft's phases: the target's scores (when a loss term needs them), acceptance
/// before, training, acceptance after.
fn train_lora(
    phases: Phases<'_, '_>,
    draft_base: &Llama,
    base_model: String,
    generations: &[Generation],
) -> Result<Trained> {
    let Phases {
        config,
        setup,
        teacher,
        examples,
        timer,
        mut tb,
        eval,
        observer,
        warnings: _,
    } = phases;
    // The target's hidden states and top-k log-probs, when a loss term of the off-policy rows
    // needs them.
    let scores = if config.use_distillation || off_policy_kd(config) {
        observer.on_phase(Phase::Score);
        let s = score(config, setup, teacher, examples, generations, observer)?;
        timer.end(Phase::Score);
        Some(s)
    } else {
        None
    };

    let (draft, projection) = init_draft(config, setup, draft_base, scores.as_deref())?;
    if eval.file.is_some() {
        observer.on_phase(Phase::EvalBefore);
        let merged = draft
            .clone()
            .merge_and_unload()
            .with_q8_0_weights(eval.draft_q8_0);
        eval.before(&merged, tb.as_deref_mut(), observer)?;
        timer.end(Phase::EvalBefore);
    }

    observer.on_phase(Phase::Train);
    let trained = train_draft(TrainInputs {
        config,
        base_model,
        draft,
        projection,
        draft_base,
        teacher,
        examples,
        scores: scores.as_deref(),
        eval,
        observer,
    })?;
    timer.end(Phase::Train);

    if eval.file.is_some() {
        observer.on_phase(Phase::EvalAfter);
        let merged = trained
            .draft
            .clone()
            .merge_and_unload()
            .with_q8_0_weights(eval.draft_q8_0);
        eval.after(
            &merged,
            &trained.trained.summary,
            &trained.checkpoints,
            tb,
            observer,
        )?;
        timer.end(Phase::EvalAfter);
    }
    Ok(trained.trained)
}

/// Non-fatal problems, each told to the observer as it is met and kept for the summary.
#[derive(Default)]
pub(crate) struct Warnings(Vec<String>);

impl Warnings {
    pub(crate) fn push(&mut self, observer: &mut dyn SpeculatorObserver, warning: String) {
        observer.on_warning(&warning);
        self.0.push(warning);
    }
}

/// Clears the output directory when asked to, creates it, and writes the run's configuration.
fn prepare_output_dir(config: &SpeculatorConfig) -> Result<kd_pipeline::RunLock> {
    let out = &config.output_dir;
    let lock = kd_pipeline::RunLock::acquire(out)?;
    if config.overwrite_output_dir {
        clear_run(out)?;
    }
    let text = serde_json::to_string_pretty(config).expect("the configuration serialises");
    kd_model::weights::write_atomic(&out.join(RUN_CONFIG_FILE), text.as_bytes())?;
    Ok(lock)
}

/// The training examples (prompt + completion, labels on the completion), with warnings for
/// empty completions and for what `--max_seq_length` cut.
fn training_examples(
    config: &SpeculatorConfig,
    setup: &Setup,
    generations: &[Generation],
    observer: &mut dyn SpeculatorObserver,
    warnings: &mut Warnings,
) -> Result<Examples> {
    let examples = build_examples(&setup.prompts, generations, config.max_seq_length);
    if examples.examples.is_empty() {
        return Err(PipelineError::Config(format!(
            "the target returned {} empty completions and nothing else: there is nothing to \
             train on (check the teacher server's API and stop tokens)",
            examples.empty
        )));
    }
    if examples.empty > 0 {
        let w = format!(
            "{} of {} completions came back empty and are not trained on",
            examples.empty,
            generations.len()
        );
        warnings.push(observer, w);
    }
    if examples.truncation.examples > 0 {
        let t = &examples.truncation;
        let w = format!(
            "{} examples were cut to --max_seq_length {} ({} prompt and {} completion tokens \
             removed)",
            t.examples, config.max_seq_length, t.prompt_tokens, t.completion_tokens
        );
        warnings.push(observer, w);
    }
    Ok(examples)
}

/// The draft to train: LoRA (fresh or warm-started from `--init_adapter`), and the projection
/// for hidden-state MSE when the draft's width differs from the target's.
fn init_draft(
    config: &SpeculatorConfig,
    setup: &Setup,
    draft_base: &Llama,
    scores: Option<&[Scores]>,
) -> Result<(Llama, Option<HiddenProjection>)> {
    let draft = match &config.init_adapter {
        Some(dir) => draft_base.clone().load_adapter(dir)?.0,
        None => draft_base
            .clone()
            .apply_lora_seeded(&lora_config(config), config.seed)?,
    };
    let projection = match (scores, config.use_distillation) {
        (Some(s), true) => {
            let dt = s
                .first()
                .and_then(|s| s.hidden_states.first())
                .map(|h| h.dim)
                .unwrap_or(0);
            let ds = draft.config().hidden_size;
            (ds != dt).then(|| {
                let seed = derive_seed(config.seed, &[0x9A0]);
                HiddenProjection::new(ds, dt, seed, &setup.draft_device)
            })
        }
        _ => None,
    };
    Ok((draft, projection))
}

/// What the training phase needs.
struct TrainInputs<'a, 'o> {
    config: &'a SpeculatorConfig,
    /// `base_model_name_or_path` of the adapters.
    base_model: String,
    draft: Llama,
    projection: Option<HiddenProjection>,
    draft_base: &'a Llama,
    teacher: &'a TeacherBackend,
    examples: &'a Examples,
    scores: Option<&'a [Scores]>,
    eval: &'a Acceptance<'a>,
    observer: &'o mut dyn SpeculatorObserver,
}

/// What training produced, whatever the draft.
pub(crate) struct Trained {
    pub(crate) summary: TrainSummary,
    pub(crate) on_policy: Option<OnPolicyTotals>,
    pub(crate) target_rows: Option<crate::eagle3::CacheStats>,
    pub(crate) last_log: Option<LogRecord>,
}

/// What the LoRA training phase produced.
struct TrainedDraft {
    draft: Llama,
    trained: Trained,
    /// Acceptance of the checkpoints measured during training (`--eval_steps`).
    checkpoints: Vec<CheckpointAcceptance>,
}

/// Trains the draft: the speculator loss over the off-policy examples, plus on-policy rows
/// when asked for, with acceptance measured at checkpoints every `--eval_steps`.
fn train_draft(inputs: TrainInputs<'_, '_>) -> Result<TrainedDraft> {
    let TrainInputs {
        config,
        base_model,
        draft,
        projection,
        draft_base,
        teacher,
        examples,
        scores,
        eval,
        observer,
    } = inputs;
    let files = ModelFiles {
        base_model,
        tokenizer_dir: Some(config.draft_model.clone()),
    };
    let loss = SpeculatorLoss {
        ce_weight: config.ce_weight,
        distillation_weight: if config.use_distillation {
            config.distillation_weight
        } else {
            0.0
        },
        draft_layer: config
            .distill_draft_layer
            .unwrap_or(draft.config().num_hidden_layers),
        kd_weight: config.kd_weight,
        kd: SpeculatorLoss::kd_config(config.kd_objective(), config.temperature, config.kd_topk),
        teacher: scores.map(|s| TeacherTargets {
            scores: s,
            offsets: &examples.offsets,
        }),
    };
    let mut wrapper = TrainingWatcher {
        inner: observer,
        last_log: None,
        eval: eval.at_checkpoints(CheckpointDraft::Lora(draft_base), config.eval_steps),
    };
    let mut on_policy = OnPolicyData::new(OnPolicy {
        config: on_policy_config(config),
        teacher: teacher.teacher(),
    })?;
    let model = TrainModel::new(draft)
        .with_projection(projection)
        .with_files(files);
    let (trained, summary) = Trainer::new(train_config(config), &loss)
        .observer(&mut wrapper)
        .step_data(&mut on_policy)
        .run(model, &examples.examples)?;
    let checkpoints = match wrapper.eval.take() {
        Some(CheckpointEval { error: Some(e), .. }) => return Err(e),
        Some(e) => e.results,
        None => Vec::new(),
    };
    Ok(TrainedDraft {
        draft: trained.llama,
        trained: Trained {
            summary,
            on_policy: on_policy.totals().cloned(),
            target_rows: None,
            last_log: wrapper.last_log.take(),
        },
        checkpoints,
    })
}

/// Whether the off-policy rows have a KD term (they need the target's top-k).
pub(crate) fn off_policy_kd(config: &SpeculatorConfig) -> bool {
    config.kd_weight > 0.0 && config.on_policy_ratio < 1.0
}

pub(crate) struct PhaseTimer {
    phases: Vec<(Phase, f64)>,
    since: Instant,
}

impl PhaseTimer {
    fn new() -> Self {
        Self {
            phases: Vec::new(),
            since: Instant::now(),
        }
    }

    /// Records the time since the previous phase ended (or the run started).
    pub(crate) fn end(&mut self, phase: Phase) {
        self.phases
            .push((phase, self.since.elapsed().as_secs_f64()));
        self.since = Instant::now();
    }
}
