//! The speculator pipeline end to end: prompts → the target's completions (resumable cache)
//! → the draft's LoRA training → acceptance of the draft before and after, by real
//! speculative decoding on held-out prompts.

use std::path::PathBuf;
use std::time::Instant;

use kd_eval::{EvalOptions, evaluate_across};
use kd_lora::derive_seed;
use kd_loss::HiddenProjection;
use kd_model::Llama;
use kd_teacher::{Generation, Scores, sequences_hash};

use crate::acceptance::{
    AcceptanceFile, CheckpointAcceptance, CheckpointEval, TrainingWatcher, log_acceptance,
    read_acceptance, write_acceptance, write_best,
};
use crate::config::SpeculatorConfig;
use crate::data::{Examples, build_examples};
use crate::error::{PipelineError, Result};
use crate::loss::{SpeculatorLoss, TeacherTargets};
use crate::observe::{Phase, SpeculatorObserver};
use crate::settings::{
    TeacherBackend, eval_options, load_teacher, lora_config, on_policy_config, train_config,
};
use crate::setup::{ACCEPTANCE_FILE, RUN_CONFIG_FILE, Setup, clear_run, setup};
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
/// them), acceptance before training, training, acceptance after.
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
    // Held until the run returns: a second run into the same directory is refused.
    let _lock = if world.is_root() {
        Some(prepare_output_dir(config)?)
    } else {
        None
    };
    let teacher = load_teacher(config, &setup)?;
    let draft_base = Llama::load(&config.draft_model, &setup.draft_device)?;
    if let Some(target) = teacher.target() {
        kd_eval::check_pair(target, &draft_base)?;
    }
    timer.end(Phase::Setup);

    observer.on_phase(Phase::Generate);
    let generations = generate_completions(config, &setup, &teacher, observer)?;
    let generated_tokens = generations.iter().map(|g| g.ids.len()).sum();
    let examples = training_examples(config, &setup, &generations, observer, &mut warnings)?;
    timer.end(Phase::Generate);

    // The target's hidden states and top-k log-probs, when a loss term of the off-policy rows
    // needs them.
    let scores = if config.use_distillation || off_policy_kd(config) {
        observer.on_phase(Phase::Score);
        let s = score(config, &setup, &teacher, &examples, &generations, observer)?;
        timer.end(Phase::Score);
        Some(s)
    } else {
        None
    };

    let (draft, projection) = init_draft(config, &setup, &draft_base, scores.as_deref())?;
    let mut eval = Acceptance::new(config, &setup, &teacher, observer, &mut warnings);
    // Every rank decodes its share of the held-out prompts; rank 0 writes the results.
    let mut tb = if world.is_root() {
        Some(TensorBoard::create(&config.output_dir.join("runs"))?)
    } else {
        None
    };
    if eval.file.is_some() {
        observer.on_phase(Phase::EvalBefore);
        eval.before(&draft, tb.as_mut(), observer)?;
        timer.end(Phase::EvalBefore);
    }

    observer.on_phase(Phase::Train);
    let trained = train_draft(TrainInputs {
        config,
        base_model,
        draft,
        projection,
        draft_base: &draft_base,
        teacher: &teacher,
        examples: &examples,
        scores: scores.as_deref(),
        eval: &eval,
        observer,
    })?;
    timer.end(Phase::Train);

    if eval.file.is_some() {
        observer.on_phase(Phase::EvalAfter);
        eval.after(&trained, tb.as_mut(), observer)?;
        timer.end(Phase::EvalAfter);
    }

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
        last_log: trained.last_log,
        acceptance_path: eval.file.as_ref().map(|_| eval.path.clone()),
        acceptance: eval.file,
        warnings: warnings.0,
    })
}

/// Non-fatal problems, each told to the observer as it is met and kept for the summary.
#[derive(Default)]
struct Warnings(Vec<String>);

impl Warnings {
    fn push(&mut self, observer: &mut dyn SpeculatorObserver, warning: String) {
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
    kd_model::write_atomic(&out.join(RUN_CONFIG_FILE), text.as_bytes())?;
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
                setup.draft_device.seed(derive_seed(config.seed, &[0x9A0]));
                HiddenProjection::new(ds, dt, &setup.draft_device)
            })
        }
        _ => None,
    };
    Ok((draft, projection))
}

/// The acceptance measurement of a run on the held-out prompts (absent when the target is
/// remote only or no prompt is held out), and `acceptance.json`.
struct Acceptance<'a> {
    target: Option<&'a Llama>,
    prompts: Vec<Vec<u32>>,
    options: EvalOptions,
    path: PathBuf,
    output_dir: &'a std::path::Path,
    file: Option<AcceptanceFile>,
}

impl<'a> Acceptance<'a> {
    fn new(
        config: &'a SpeculatorConfig,
        setup: &Setup,
        teacher: &'a TeacherBackend,
        observer: &mut dyn SpeculatorObserver,
        warnings: &mut Warnings,
    ) -> Self {
        let prompts = setup.prompts.eval_ids();
        let options = eval_options(config);
        let target = teacher.target().filter(|_| !prompts.is_empty());
        let file = target.map(|_| AcceptanceFile {
            options: options.clone(),
            prompts: prompts.len(),
            prompts_hash: sequences_hash(&prompts),
            before: None,
            after: None,
            checkpoints: Vec::new(),
            best_checkpoint: None,
        });
        if prompts.is_empty() {
            let w = "no prompt is held out (--eval_fraction 0): acceptance is not measured";
            warnings.push(observer, w.to_string());
        }
        Self {
            target,
            prompts,
            options,
            path: config.output_dir.join(ACCEPTANCE_FILE),
            output_dir: &config.output_dir,
            file,
        }
    }

    /// Acceptance of the untrained draft (reused from `acceptance.json` when a resumed run
    /// measured it with the same options and prompts).
    fn before(
        &mut self,
        draft: &Llama,
        tb: Option<&mut TensorBoard>,
        observer: &mut dyn SpeculatorObserver,
    ) -> Result<()> {
        let (Some(file), Some(target)) = (self.file.as_mut(), self.target) else {
            return Ok(());
        };
        let previous = read_acceptance(&self.path)
            .filter(|p| p.options == file.options && p.prompts_hash == file.prompts_hash);
        let before = match previous.and_then(|p| p.before) {
            Some(before) => before,
            None => {
                let merged = draft.clone().merge_and_unload();
                evaluate_across(
                    kd_dist::world(),
                    target,
                    &merged,
                    &self.prompts,
                    &self.options,
                    |phase, d, t| observer.on_eval_progress(phase, d, t),
                )?
            }
        };
        observer.on_acceptance("before", &before);
        file.before = Some(before.clone());
        // Rank 0 writes (the only one with a TensorBoard).
        let Some(tb) = tb else {
            return Ok(());
        };
        log_acceptance(tb, &before, 0)?;
        write_acceptance(&self.path, file)
    }

    /// Acceptance of the trained draft; every measured checkpoint (the last one included)
    /// competes for the best, which is recorded and linked.
    fn after(
        &mut self,
        trained: &TrainedDraft,
        tb: Option<&mut TensorBoard>,
        observer: &mut dyn SpeculatorObserver,
    ) -> Result<()> {
        let (Some(file), Some(target)) = (self.file.as_mut(), self.target) else {
            return Ok(());
        };
        let summary = &trained.summary;
        let merged = trained.draft.clone().merge_and_unload();
        let after = evaluate_across(
            kd_dist::world(),
            target,
            &merged,
            &self.prompts,
            &self.options,
            |phase, d, t| observer.on_eval_progress(phase, d, t),
        )?;
        observer.on_acceptance("after", &after);
        // Rank 0 writes (the only one with a TensorBoard).
        let Some(tb) = tb else {
            file.after = Some(after);
            return Ok(());
        };
        log_acceptance(tb, &after, summary.global_step)?;
        for c in &trained.checkpoints {
            log_acceptance(tb, &c.report, c.step)?;
        }
        // The last checkpoint holds the trained draft: it competes for the best too.
        let mut checkpoints = trained.checkpoints.clone();
        if let Some(last) = summary.checkpoints.last()
            && !checkpoints.iter().any(|c| &c.checkpoint == last)
        {
            checkpoints.push(CheckpointAcceptance {
                checkpoint: last.clone(),
                step: summary.global_step,
                report: after.clone(),
            });
        }
        file.after = Some(after);
        file.checkpoints = checkpoints;
        file.best_checkpoint = file
            .checkpoints
            .iter()
            .max_by(|a, b| {
                a.report
                    .mean_accepted_length
                    .total_cmp(&b.report.mean_accepted_length)
            })
            .map(|c| c.checkpoint.clone());
        write_acceptance(&self.path, file)?;
        write_best(self.output_dir, summary.checkpoints.last(), file)
    }
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

/// What the training phase produced.
struct TrainedDraft {
    draft: Llama,
    summary: TrainSummary,
    on_policy: Option<OnPolicyTotals>,
    last_log: Option<LogRecord>,
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
        eval: eval
            .file
            .as_ref()
            .and(eval.target)
            .map(|target| CheckpointEval {
                target,
                base: draft_base,
                prompts: &eval.prompts,
                options: &eval.options,
                every: config.eval_steps,
                last_step: 0,
                results: Vec::new(),
                error: None,
            }),
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
        summary,
        on_policy: on_policy.totals().cloned(),
        last_log: wrapper.last_log.take(),
        checkpoints,
    })
}

/// Whether the off-policy rows have a KD term (they need the target's top-k).
pub(crate) fn off_policy_kd(config: &SpeculatorConfig) -> bool {
    config.kd_weight > 0.0 && config.on_policy_ratio < 1.0
}

struct PhaseTimer {
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
    fn end(&mut self, phase: Phase) {
        self.phases
            .push((phase, self.since.elapsed().as_secs_f64()));
        self.since = Instant::now();
    }
}
