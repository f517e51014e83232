//! The speculator pipeline on the bundled demo pair (fixtures/demo): acceptance rises, the
//! outputs follow the seed's layout, a resumed run ends with the bytes of an uninterrupted
//! one, and the errors a user meets say what and where.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kd_speculator::{Phase, SpeculatorConfig, SpeculatorObserver, run};
use kd_teacher::{CacheProgress, LocalTeacher, ServeConfig, router};
use kd_train::TrainObserver;
use kd_train::checkpoint::read_state;

use crate::{cut_after_first_epoch, demo, fixtures, same_last_checkpoint, small};

/// Records the teacher-cache progress of a run.
#[derive(Default)]
struct Record {
    reused_shards: usize,
    generated_shards: usize,
    phases: Vec<Phase>,
}

impl TrainObserver for Record {}

impl SpeculatorObserver for Record {
    fn on_phase(&mut self, phase: Phase) {
        self.phases.push(phase);
    }

    fn on_teacher_progress(&mut self, phase: Phase, p: &CacheProgress, _total: usize) {
        if phase == Phase::Generate {
            if p.reused {
                self.reused_shards += 1;
            } else {
                self.generated_shards += 1;
            }
        }
    }
}

#[test]
fn acceptance_rises_and_the_outputs_follow_the_seed_layout() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut rec = Record::default();
    let summary = run(&small(&out), &mut rec).unwrap();
    assert_eq!(summary.prompts, (240, 216, 24));
    assert_eq!(summary.empty_completions, 0);
    assert!(
        summary.generated_tokens > 216 * 5,
        "{}",
        summary.generated_tokens
    );
    let a = summary.acceptance.as_ref().unwrap();
    let (before, after) = (a.before.as_ref().unwrap(), a.after.as_ref().unwrap());
    // Speculative decoding reproduced the target's greedy output on every held-out row.
    assert_eq!(before.greedy_identical_rows, Some(24));
    assert_eq!(after.greedy_identical_rows, Some(24));
    // Measured here: 0.18 → 0.41 drafted tokens accepted per verification.
    assert!(
        after.mean_accepted_length > 1.5 * before.mean_accepted_length,
        "mean accepted length {} → {}",
        before.mean_accepted_length,
        after.mean_accepted_length
    );
    assert!(after.acceptance_rate > before.acceptance_rate);
    assert_eq!(
        rec.phases,
        [
            Phase::Setup,
            Phase::Generate,
            Phase::EvalBefore,
            Phase::Train,
            Phase::EvalAfter
        ]
    );
    // The seed's output structure.
    for e in 0..3 {
        let c = out.join(format!("checkpoint-epoch-{e}"));
        for f in [
            "adapter_config.json",
            "adapter_model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "trainer_state.json",
        ] {
            assert!(c.join(f).is_file(), "{}/{f}", c.display());
        }
        assert!(read_state(&c).is_ok());
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(c.join("adapter_config.json")).unwrap())
                .unwrap();
        assert_eq!(cfg["r"], 16);
        assert_eq!(cfg["peft_type"], "LORA");
        // The same fields as the checkpoint PEFT was shown to load
        // (`a_pipeline_checkpoint_loads_in_peft_as_it_loads_here`).
        let checked: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(
                fixtures().join("golden/speculator-checkpoint/adapter_config.json"),
            )
            .unwrap(),
        )
        .unwrap();
        let keys =
            |v: &serde_json::Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
        assert_eq!(keys(&cfg), keys(&checked));
    }
    let log = std::fs::read_to_string(out.join("training_log.txt")).unwrap();
    assert!(
        log.lines().filter(|l| l.starts_with("step ")).count() >= 5,
        "{log}"
    );
    let file: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("acceptance.json")).unwrap())
            .unwrap();
    assert_eq!(
        file["after"]["mean_accepted_length"].as_f64().unwrap(),
        after.mean_accepted_length
    );
    assert!(out.join("speculator_config.json").is_file());
    // The chart beside it draws both reports, each τ in the legend.
    let svg = std::fs::read_to_string(out.join("acceptance.svg")).unwrap();
    for report in ["before", "after"] {
        let tau = file[report]["mean_accepted_length_with_bonus"]
            .as_f64()
            .unwrap();
        let entry = format!("{report}: τ {tau:.2}");
        assert!(svg.contains(&entry), "no `{entry}` in acceptance.svg");
    }
    // TensorBoard got the acceptance tags.
    let events: Vec<u8> = std::fs::read_dir(out.join("runs"))
        .unwrap()
        .flatten()
        .flat_map(|e| std::fs::read(e.path()).unwrap())
        .collect();
    for tag in [
        "eval/acceptance_rate",
        "eval/mean_accepted_length",
        "train/ce_loss",
    ] {
        assert!(
            events.windows(tag.len()).any(|w| w == tag.as_bytes()),
            "no {tag} in the event files"
        );
    }

    // Running again into the same directory without resuming is refused, naming what
    // changed.
    let other = SpeculatorConfig {
        lora_r: 8,
        ..small(&out)
    };
    let e = run(&other, &mut Record::default()).unwrap_err().to_string();
    assert!(
        e.contains("--resume_from_checkpoint") && e.contains("lora_r"),
        "{e}"
    );
}

#[test]
fn a_resumed_run_ends_with_the_bytes_of_an_uninterrupted_one() {
    let dir = tempfile::tempdir().unwrap();
    let full = dir.path().join("full");
    let config = SpeculatorConfig {
        num_epochs: 2,
        eval_fraction: 0.0,
        use_distillation: true,
        kd_weight: 0.5,
        ..small(&full)
    };
    run(&config, &mut Record::default()).unwrap();
    // A run killed after its first epoch checkpoint leaves that checkpoint and the teacher
    // cache behind.
    let cut = dir.path().join("cut");
    cut_after_first_epoch(&full, &cut);
    let resumed = SpeculatorConfig {
        output_dir: cut.clone(),
        resume_from_checkpoint: Some("latest".into()),
        ..config.clone()
    };
    let mut rec = Record::default();
    let summary = run(&resumed, &mut rec).unwrap();
    assert_eq!(rec.generated_shards, 0, "the teacher cache is reused");
    assert!(rec.reused_shards > 0);
    assert_eq!(
        summary.train.checkpoints.len(),
        1,
        "only epoch 1 is trained again"
    );
    same_last_checkpoint(
        &full,
        &cut,
        &[
            "adapter_model.safetensors",
            "projection.safetensors",
            "training_state/optimizer.safetensors",
        ],
    );
}

/// The `term` of every logged record of a finished run (from the last checkpoint's
/// `trainer_state.json`).
fn logged(checkpoint: &Path, term: &str) -> Vec<f64> {
    let history: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(checkpoint.join("trainer_state.json")).unwrap(),
    )
    .unwrap();
    history["log_history"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| {
            r["terms"]
                .as_array()
                .unwrap()
                .iter()
                .find(|t| t[0] == term)
                .and_then(|t| t[1].as_f64())
        })
        .collect()
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// Only on-policy rows (λ = 1): the draft learns from its own completions alone (no
/// cross-entropy row is left), so the fall of their KD and the rise of α come from the
/// on-policy path.
#[test]
fn on_policy_rows_alone_teach_the_draft() {
    let dir = tempfile::tempdir().unwrap();
    let config = SpeculatorConfig {
        num_epochs: 2,
        eval_fraction: 0.0,
        kd_weight: 1.0,
        kd_objective: Some(kd_loss::KdObjective::ForwardKl),
        temperature: 1.0,
        on_policy_ratio: 1.0,
        on_policy_max_new_tokens: Some(16),
        logging_steps: 1,
        ..small(dir.path())
    };
    let summary = run(&config, &mut Record::default()).unwrap();
    let totals = summary.on_policy.clone().expect("on-policy totals");
    assert_eq!(totals.rows, config.num_epochs * summary.prompts.1);
    assert!(totals.generated_tokens > 0 && totals.generated_tokens <= totals.rows * 16);
    let last = dir.path().join("checkpoint-epoch-1");
    assert!(
        logged(&last, "ce_loss").is_empty(),
        "no off-policy row is left"
    );
    assert!(
        logged(&last, "on_policy_fraction")
            .iter()
            .all(|f| *f == 1.0)
    );
    let kd = logged(&last, "kd_on_policy");
    let alpha = logged(&last, "on_policy_alpha");
    let third = kd.len() / 3;
    let (first, end) = (mean(&kd[..third]), mean(&kd[kd.len() - third..]));
    assert!(
        end < 0.9 * first,
        "the KD of on-policy rows did not fall: {first:.4} → {end:.4}"
    );
    let (a0, a1) = (mean(&alpha[..third]), mean(&alpha[alpha.len() - third..]));
    assert!(
        a1 > a0 + 0.01,
        "α on on-policy rows did not rise: {a0:.4} → {a1:.4}"
    );
}

/// On-policy rows on the Qwen2 pair of `fixtures/demo-qwen` (q/k/v biases, a ChatML
/// tokenizer, Qwen's chat template with `enable_thinking` passed through): the student samples
/// its own completions, the teacher scores them, their KD is logged, and speculative decoding
/// with the trained adapters still reproduces the teacher's greedy output.
#[test]
fn on_policy_rows_on_a_qwen_pair() {
    let dir = tempfile::tempdir().unwrap();
    let pair = fixtures().join("demo-qwen");
    let config = SpeculatorConfig {
        target_model: pair.join("teacher"),
        draft_model: pair.join("student"),
        max_samples: Some(40),
        num_epochs: 1,
        lora_r: 4,
        lora_alpha: 8.0,
        max_new_tokens: 16,
        eval_max_new_tokens: 16,
        eval_fraction: 0.2,
        kd_weight: 1.0,
        on_policy_ratio: 0.5,
        on_policy_max_new_tokens: Some(8),
        logging_steps: 1,
        chat_template_kwargs: [("enable_thinking".to_string(), serde_json::json!(false))].into(),
        ..small(dir.path())
    };
    let summary = run(&config, &mut Record::default()).unwrap();
    let totals = summary.on_policy.clone().expect("on-policy totals");
    assert!(
        totals.rows > 0 && totals.rows < summary.prompts.1,
        "{totals:?}"
    );
    assert!(
        totals.generated_tokens > 0 && totals.scored_tokens > 0,
        "{totals:?}"
    );
    let kd = logged(&dir.path().join("checkpoint-epoch-0"), "kd_on_policy");
    assert!(
        !kd.is_empty() && kd.iter().all(|v| v.is_finite() && *v >= 0.0),
        "{kd:?}"
    );
    let after = summary
        .acceptance
        .expect("held-out prompts")
        .after
        .expect("after training");
    assert_eq!(
        after.greedy_identical_rows,
        Some(after.prompts),
        "{after:?}"
    );
}

/// On-policy rows (λ = 0.5, the default objective TV distance) beside off-policy ones: the
/// metrics keep them apart, and a run resumed from its epoch checkpoint samples what the
/// uninterrupted run sampled and ends with the same bytes.
#[test]
fn a_resumed_on_policy_run_samples_what_the_uninterrupted_one_sampled() {
    let dir = tempfile::tempdir().unwrap();
    let full = dir.path().join("full");
    let config = SpeculatorConfig {
        num_epochs: 2,
        eval_fraction: 0.0,
        kd_weight: 1.0,
        on_policy_ratio: 0.5,
        on_policy_max_new_tokens: Some(16),
        lora_dropout: 0.1,
        logging_steps: 1,
        ..small(&full)
    };
    assert_eq!(config.kd_objective(), kd_loss::KdObjective::TvDistance);
    let summary = run(&config, &mut Record::default()).unwrap();
    let totals = summary.on_policy.clone().expect("on-policy totals");
    // Every training prompt once per epoch, a share λ of them on-policy on average.
    let share = totals.rows as f64 / (config.num_epochs * summary.prompts.1) as f64;
    assert!((share - 0.5).abs() < 0.1, "on-policy share {share}");
    assert!(totals.scored_tokens > totals.generated_tokens);
    let last = full.join("checkpoint-epoch-1");
    for k in [
        "on_policy_fraction",
        "kd_on_policy",
        "kd_off_policy",
        "on_policy_alpha",
        "on_policy_top1",
        "on_policy_generation_tokens_per_second",
        "on_policy_scoring_tokens_per_second",
        "ce_loss",
    ] {
        assert!(!logged(&last, k).is_empty(), "no {k} logged");
    }
    assert!(
        logged(&last, "on_policy_alpha")
            .iter()
            .all(|a| (0.0..=1.0).contains(a))
    );

    let cut = dir.path().join("cut");
    cut_after_first_epoch(&full, &cut);
    let resumed = SpeculatorConfig {
        output_dir: cut.clone(),
        resume_from_checkpoint: Some("latest".into()),
        ..config.clone()
    };
    let again = run(&resumed, &mut Record::default()).unwrap();
    let second = again.on_policy.expect("on-policy totals");
    assert!(second.rows > 0 && second.rows < totals.rows);
    same_last_checkpoint(
        &full,
        &cut,
        &[
            "adapter_model.safetensors",
            "training_state/optimizer.safetensors",
        ],
    );
    // A different λ is another run: resuming it is refused.
    let other = SpeculatorConfig {
        on_policy_ratio: 0.25,
        ..resumed
    };
    let e = run(&other, &mut Record::default()).unwrap_err().to_string();
    assert!(e.contains("on_policy"), "{e}");
}

/// On-policy rows scored by a remote teacher (the target served over SGLang's API) train the
/// draft exactly as the target in this process does: same samples, same scores, same bytes.
#[test]
fn on_policy_rows_scored_by_a_remote_teacher_equal_a_local_one() {
    let dir = tempfile::tempdir().unwrap();
    let local = SpeculatorConfig {
        max_samples: Some(96),
        num_epochs: 1,
        eval_fraction: 0.0,
        kd_weight: 1.0,
        on_policy_ratio: 0.5,
        on_policy_max_new_tokens: Some(12),
        ..small(&dir.path().join("local"))
    };
    let remote = SpeculatorConfig {
        output_dir: dir.path().join("remote"),
        teacher_url: Some(dying_teacher(usize::MAX)),
        ..local.clone()
    };
    let a = run(&local, &mut Record::default()).unwrap();
    let b = run(&remote, &mut Record::default()).unwrap();
    let (ta, tb) = (a.on_policy.clone().unwrap(), b.on_policy.clone().unwrap());
    assert!(ta.rows > 0);
    assert_eq!(
        (ta.rows, ta.generated_tokens, ta.scored_tokens),
        (tb.rows, tb.generated_tokens, tb.scored_tokens)
    );
    let adapter = |s: &kd_speculator::SpeculatorSummary| {
        std::fs::read(
            s.train
                .checkpoints
                .last()
                .unwrap()
                .join("adapter_model.safetensors"),
        )
        .unwrap()
    };
    assert!(
        adapter(&a) == adapter(&b),
        "the remote teacher trained another draft"
    );
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let err = |c: &SpeculatorConfig| run(c, &mut Record::default()).unwrap_err().to_string();

    // No batch files where the data directory points.
    let empty = dir.path().join("no-data");
    std::fs::create_dir_all(&empty).unwrap();
    let e = err(&SpeculatorConfig {
        data_dir: empty.clone(),
        ..small(&out)
    });
    assert!(
        e.contains(&empty.display().to_string()) && e.contains("batch_input.jsonl"),
        "{e}"
    );
    let e = err(&SpeculatorConfig {
        data_dir: dir.path().join("missing"),
        ..small(&out)
    });
    assert!(
        e.contains("--data_dir") && e.contains("missing") && e.contains("does not exist"),
        "{e}"
    );

    // A threshold that is not a probability.
    let e = err(&SpeculatorConfig {
        eval_draft_p_min: 1.5,
        ..small(&out)
    });
    assert!(e.contains("--eval_draft_p_min") && e.contains("1.5"), "{e}");

    // A draft with another vocabulary: both sizes are named.
    let other = dir.path().join("other-draft");
    std::fs::create_dir_all(&other).unwrap();
    for (src, name) in [
        (fixtures().join("tiny-models/tiny-llama3"), "config.json"),
        (
            fixtures().join("tiny-models/tiny-llama3"),
            "model.safetensors",
        ),
        (fixtures().join("llama3-tokenizer"), "tokenizer.json"),
        (fixtures().join("llama3-tokenizer"), "tokenizer_config.json"),
    ] {
        std::fs::copy(src.join(name), other.join(name)).unwrap();
    }
    let e = err(&SpeculatorConfig {
        draft_model: other,
        ..small(&out)
    });
    assert!(
        e.contains("vocabulary mismatch") && e.contains("1024") && e.contains("256"),
        "{e}"
    );

    // GPU ids on a machine whose build reaches no GPU (no CUDA, no hardware wgpu adapter).
    if !kd_model::device::gpus_available() {
        let e = err(&SpeculatorConfig {
            target_gpus: "0,1,2,3".into(),
            ..small(&out)
        });
        // Built with wgpu (the workspace), the error names the cuda feature; built alone
        // without it, "rebuild with `--features wgpu` (or `cuda`)".
        assert!(
            e.contains("--target_gpus") && e.contains("--features") && e.contains("cuda"),
            "{e}"
        );
    }

    // A teacher URL nobody listens on: named in the error, nothing retried for long.
    let e = err(&SpeculatorConfig {
        teacher_url: Some("http://127.0.0.1:9".into()),
        teacher_max_retries: 0,
        ..small(&out)
    });
    assert!(e.contains("127.0.0.1:9"), "{e}");

    // Mutually exclusive flags and empty loss.
    let e = err(&SpeculatorConfig {
        resume_from_checkpoint: Some("latest".into()),
        init_adapter: Some(dir.path().into()),
        ..small(&out)
    });
    assert!(e.contains("exclude each other"), "{e}");
    let e = err(&SpeculatorConfig {
        ce_weight: 0.0,
        ..small(&out)
    });
    assert!(e.contains("every loss term is off"), "{e}");

    // Another run holds the output directory: refused, naming the holder; the dry run says so.
    let held = kd_pipeline::RunLock::acquire(&out).unwrap();
    let e = err(&small(&out));
    assert!(
        e.contains("in use by another run") && e.contains(&format!("PID {}", std::process::id())),
        "{e}"
    );
    let plan = kd_speculator::plan(&small(&out)).unwrap();
    assert!(
        plan.warnings.iter().any(|w| w.contains("in use")),
        "{plan:?}"
    );
    drop(held);
    // An output directory that is a file: named at once, by the dry run too.
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let e = err(&small(&file));
    assert!(e.contains("--output_dir") && e.contains("is a file"), "{e}");
    let e = kd_speculator::plan(&small(&file)).unwrap_err().to_string();
    assert!(e.contains("is a file"), "{e}");
    // One that cannot be created (under a file): the dry run and the run both name it.
    let under = file.join("run");
    let e = kd_speculator::plan(&small(&under)).unwrap_err().to_string();
    assert!(
        e.contains("output_dir") && e.contains(under.to_str().unwrap()) && e.contains("cannot be"),
        "{e}"
    );
    let e = err(&small(&under));
    assert!(e.contains("output_dir") && e.contains("cannot be"), "{e}");
    // A distillation layer beyond the model's hidden states: named with the valid range.
    for (draft_layer, target_layer, flag) in [
        (Some(99), None, "--distill_draft_layer 99"),
        (None, Some(77), "--distill_target_layer 77"),
    ] {
        let config = SpeculatorConfig {
            use_distillation: true,
            distill_draft_layer: draft_layer,
            distill_target_layer: target_layer,
            ..small(&dir.path().join("distill"))
        };
        let e = kd_speculator::plan(&config).unwrap_err().to_string();
        assert!(e.contains(flag) && e.contains("hidden states 0..="), "{e}");
    }
    // 8-bit activations for a target without GGUF blocks (the demo's safetensors): the dry
    // run refuses as the run does, naming the flag.
    let out = dir.path().join("refused");
    for (int8, amx, flag) in [
        (true, false, "--target_int8"),
        (false, true, "--target_amx"),
    ] {
        let config = SpeculatorConfig {
            target_int8: int8,
            target_amx: amx,
            ..small(&out)
        };
        let e = kd_speculator::plan(&config).unwrap_err().to_string();
        assert!(
            e.contains(flag) && e.contains("no packed GGUF blocks"),
            "{e}"
        );
        let e = err(&config);
        assert!(
            e.contains(flag) && e.contains("no packed GGUF blocks"),
            "{e}"
        );
    }
    // ... and for a target only reachable at --teacher_url (refused before any request).
    let remote = SpeculatorConfig {
        teacher_url: Some("http://127.0.0.1:9".into()),
        teacher_max_retries: 0,
        target_model: "example-org/not-in-the-cache".into(),
        target_int8: true,
        ..small(&out)
    };
    for e in [
        kd_speculator::plan(&remote).unwrap_err().to_string(),
        err(&remote),
    ] {
        assert!(
            e.contains("--target_int8") && e.contains("only reachable at --teacher_url"),
            "{e}"
        );
    }
    assert!(!out.exists(), "the refused runs made {}", out.display());
}

/// Serves the demo target over SGLang's API; every request after the first `healthy` ones
/// fails with 503, as a dying server does.
fn dying_teacher(healthy: usize) -> String {
    let model =
        kd_model::Llama::load(demo().join("target"), &burn::tensor::Device::flex()).unwrap();
    let fingerprint = kd_teacher::model_fingerprint(&demo().join("target")).unwrap();
    let teacher = LocalTeacher::new(model, 32, fingerprint);
    let count = Arc::new(AtomicUsize::new(0));
    let app = router(teacher, ServeConfig::default()).layer(axum::middleware::from_fn(
        move |req: axum::extract::Request, next: axum::middleware::Next| {
            let n = count.fetch_add(1, Ordering::SeqCst);
            async move {
                if n >= healthy {
                    axum::response::IntoResponse::into_response((
                        axum::http::StatusCode::SERVICE_UNAVAILABLE,
                        "the server died",
                    ))
                } else {
                    next.run(req).await
                }
            }
        },
    ));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(listener).unwrap();
            axum::serve(l, app).await.unwrap();
        });
    });
    url
}

#[test]
fn a_teacher_that_dies_mid_generation_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    // 216 training prompts in shards of 32 prompts, one request per prompt: the server dies
    // during the fourth shard.
    let url = dying_teacher(100);
    let config = SpeculatorConfig {
        teacher_url: Some(url.clone()),
        teacher_max_retries: 1,
        eval_fraction: 0.1,
        ..small(&out)
    };
    let e = run(&config, &mut Record::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains(&url) && e.contains("503"), "{e}");
    let shards = |d: &Path| {
        std::fs::read_dir(d.join("teacher_cache/generations"))
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("shard-"))
            .count()
    };
    assert_eq!(
        shards(&out),
        3,
        "the shards done before the failure are kept"
    );

    // A healthy server: the run resumes generation at the fourth shard and finishes, with
    // the hidden-state and KD terms scored over SGLang's API (`return_hidden_states`).
    let healthy = SpeculatorConfig {
        teacher_url: Some(dying_teacher(usize::MAX)),
        use_distillation: true,
        kd_weight: 0.5,
        ..config.clone()
    };
    let mut rec = Record::default();
    let summary = run(&healthy, &mut rec).unwrap();
    assert_eq!((rec.reused_shards, rec.generated_shards), (3, 4));
    let terms = &summary.last_log.as_ref().unwrap().terms;
    for t in ["ce_loss", "hidden_mse", "kd_loss"] {
        assert!(
            terms.iter().any(|(k, v)| k == t && v.is_finite()),
            "{terms:?}"
        );
    }
    // The completions equal those of the local teacher in an uninterrupted run.
    let local = dir.path().join("local");
    run(
        &SpeculatorConfig {
            output_dir: local.clone(),
            num_epochs: 1,
            eval_fraction: 0.1,
            ..small(&local)
        },
        &mut Record::default(),
    )
    .unwrap();
    for s in 0..7 {
        let name = format!("teacher_cache/generations/shard-{s:05}.jsonl");
        let a = std::fs::read_to_string(out.join(&name)).unwrap();
        let b = std::fs::read_to_string(local.join(&name)).unwrap();
        let ids = |t: &str| -> Vec<serde_json::Value> {
            t.lines()
                .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["ids"].clone())
                .collect()
        };
        assert_eq!(ids(&a), ids(&b), "{name}");
    }
    assert!(
        summary.acceptance.is_some(),
        "the target is local too: acceptance measured"
    );
}

/// The seed's "Loading Trained Model" snippet on a checkpoint of this pipeline:
/// `fixtures/check_speculator_checkpoint.py` loaded it with PEFT (`from_pretrained`,
/// `merge_and_unload`, the tokenizer from the checkpoint) and recorded the chat-template
/// ids, the last position's logits and the greedy continuation; here the same checkpoint
/// loaded by this toolkit gives the same numbers.
#[test]
fn a_pipeline_checkpoint_loads_in_peft_as_it_loads_here() {
    use kd_data::{ChatTokenizer, Message};
    use kd_model::{GenerateOptions, Llama, SeededPrompt, TokenBatch, generate::to_host};

    let checkpoint = fixtures().join("golden/speculator-checkpoint");
    let text =
        std::fs::read_to_string(fixtures().join("golden/speculator-checkpoint-peft.json")).unwrap();
    let golden: serde_json::Value = serde_json::from_str(&text).unwrap();
    let (model, lora) = Llama::load(demo().join("draft"), &burn::tensor::Device::flex())
        .unwrap()
        .load_adapter(&checkpoint)
        .unwrap();
    assert_eq!((lora.r, lora.alpha), (8, 16.0));
    let merged = model.merge_and_unload();
    let tokenizer = ChatTokenizer::from_dir(&checkpoint).unwrap();
    let cases = golden["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 3);
    for (i, case) in cases.iter().enumerate() {
        let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
        let ids = tokenizer.encode_prompt(&messages).unwrap();
        let want: Vec<u32> = serde_json::from_value(case["input_ids"].clone()).unwrap();
        assert_eq!(ids, want, "case {i}: chat-template ids");
        let logits = to_host(merged.logits(&TokenBatch::single(&ids)).unwrap());
        let v = merged.config().vocab_size;
        let last = &logits[(ids.len() - 1) * v..];
        let want: Vec<f32> = serde_json::from_value(case["last_logits"].clone()).unwrap();
        let argmax = |r: &[f32]| {
            r.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(j, _)| j)
        };
        assert_eq!(argmax(last), argmax(&want), "case {i}: argmax");
        // Within three times transformers' own float32 spread of the float64 result
        // (fixtures/make_reference_spread.py derives the factor).
        let key = format!("case.{i}.last_logits");
        let (f64_logits, spread) = reference_f64("speculator-checkpoint-peft", &key);
        let d = last
            .iter()
            .zip(&f64_logits)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            d <= 3.0 * spread,
            "case {i}: logits vs PEFT's merged model in float64: max |Δ| = {d}, spread {spread}"
        );
        let new = merged
            .generate(
                &[SeededPrompt { ids: &ids, seed: 0 }],
                &GenerateOptions::greedy(8),
            )
            .unwrap();
        let want: Vec<u32> = serde_json::from_value(case["greedy_new_ids"].clone()).unwrap();
        assert_eq!(new[0].ids, want, "case {i}: greedy continuation");
    }
}

/// The float64 reference of `key` in `fixtures/golden/spread/<name>` and its measured float32
/// spread: the larger of transformers' float32 distances from it on the two CPUs measured.
fn reference_f64(name: &str, key: &str) -> (Vec<f32>, f32) {
    let dir = fixtures().join("golden/spread");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap())
            .unwrap();
    let e = &doc["keys"][key];
    let spread = e["f32_vs_f64"]
        .as_f64()
        .unwrap()
        .max(e["committed_vs_f64"].as_f64().unwrap()) as f32;
    let bytes = std::fs::read(dir.join(format!("{name}.safetensors"))).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let values = st
        .tensor(key)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (values, spread)
}
