//! The distill pipeline on the bundled demo pair (fixtures/demo: a 3-layer teacher and a
//! 2-layer student sharing a 1024-token tokenizer): every objective lowers its own divergence
//! on the held-out set, top-k and full-vocabulary modes both run, a resumed run ends with the
//! bytes of an uninterrupted one, ROLL's example YAML parses (and its fixture twin runs), and
//! each bad input gets a message that names what and where.

use std::path::{Path, PathBuf};

use kd_distill::{
    DistillConfig, LoadedConfig, QuietDistill, config::ResumeFrom, config::TransferBackend, load,
    run,
};
use kd_loss::KdObjective;

use crate::fixtures;

fn repo() -> PathBuf {
    fixtures().join("..")
}

/// `examples/distill/demo.yaml` at test size, with absolute paths and `out` as output.
fn demo(out: &Path, extra: &[String]) -> LoadedConfig {
    let d = fixtures().join("demo");
    let mut o = vec![
        format!("student_pretrain={}", d.join("draft").display()),
        format!("teacher_pretrain={}", d.join("target").display()),
        format!(
            "student.data_args.file_name={}",
            d.join("corpus/qa_train.jsonl").display()
        ),
        format!(
            "validation.data_args.file_name={}",
            d.join("corpus/qa_val.jsonl").display()
        ),
        format!("output_dir={}", out.display()),
        format!("logging_dir={}", out.join("logs").display()),
        "+student.data_args.max_samples=128".into(),
        "max_steps=12".into(),
        "eval_steps=0".into(),
        "save_steps=0".into(),
        "logging_steps=4".into(),
        "student.training_args.gradient_accumulation_steps=1".into(),
    ];
    o.extend(extra.iter().cloned());
    load(Some(&repo().join("examples/distill/demo.yaml")), &o).unwrap()
}

/// Overrides that point a ROLL configuration at a student, a teacher, the demo corpus and an
/// output directory, and run it for 3 steps (validation and a checkpoint at step 3).
fn three_steps_of(student: &Path, teacher: &Path, out: &Path) -> Vec<String> {
    let corpus = fixtures().join("demo/corpus");
    vec![
        format!("student_pretrain={}", student.display()),
        format!("teacher_pretrain={}", teacher.display()),
        format!("output_dir={}", out.display()),
        format!("logging_dir={}", out.join("logs").display()),
        format!(
            "student.data_args.file_name=[{}]",
            corpus.join("qa_train.jsonl").display()
        ),
        format!(
            "validation.data_args.file_name=[{}]",
            corpus.join("qa_val.jsonl").display()
        ),
        "+student.data_args.max_samples=64".into(),
        "max_steps=3".into(),
        "eval_steps=3".into(),
        "save_steps=3".into(),
    ]
}

fn run_quiet(config: &DistillConfig) -> kd_distill::DistillSummary {
    run(config, &mut QuietDistill).unwrap()
}

#[test]
fn every_objective_lowers_its_own_divergence_on_held_out_data() {
    for objective in KdObjective::ALL {
        let dir = tempfile::tempdir().unwrap();
        let c = demo(
            dir.path(),
            &[
                format!("kd_objective={}", objective.name()),
                "distill_loss_weight=1.0".into(),
            ],
        )
        .config;
        let s = run_quiet(&c);
        let (first, last) = (
            s.validations.first().unwrap(),
            s.validations.last().unwrap(),
        );
        eprintln!(
            "{}: {:.4} → {:.4}",
            objective.name(),
            first.kd_loss,
            last.kd_loss
        );
        assert_eq!((first.step, last.step), (0, 12), "{objective:?}");
        assert!(
            last.kd_loss < 0.98 * first.kd_loss,
            "{objective:?}: held-out {} {} → {}",
            objective.name(),
            first.kd_loss,
            last.kd_loss
        );
        assert!(first.tokens > 1000 && first.tokens == last.tokens);
    }
}

#[test]
fn top_k_and_full_vocabulary_modes_both_train() {
    let mut seen = Vec::new();
    for topk in [64usize, 0] {
        let dir = tempfile::tempdir().unwrap();
        let s = run_quiet(&demo(dir.path(), &[format!("logits_topk={topk}")]).config);
        let (first, last) = (
            s.validations.first().unwrap(),
            s.validations.last().unwrap(),
        );
        assert!(last.kd_loss < first.kd_loss, "top-k {topk}");
        assert!(last.val_loss < first.val_loss, "top-k {topk}");
        // The mixed loss is (1 − w)·CE + w·KD with w = 0.5.
        let r = s.last_log.unwrap();
        let term = |k: &str| r.terms.iter().find(|(n, _)| n == k).unwrap().1;
        let mixed = 0.5 * term("train_student_loss") + 0.5 * term("train_distill_loss");
        assert!(
            (r.loss - mixed).abs() < 1e-4 * r.loss.abs(),
            "{} vs {mixed}",
            r.loss
        );
        seen.push(first.kd_loss);
    }
    // On the full vocabulary the untrained student's KL is larger than on the teacher's
    // top-64 (renormalised on fewer entries).
    assert!(seen[1] > seen[0], "{seen:?}");
}

#[test]
fn a_resumed_run_ends_with_the_bytes_of_an_uninterrupted_one() {
    let dir = tempfile::tempdir().unwrap();
    let extra = [
        "max_steps=8".to_string(),
        "save_steps=4".into(),
        "eval_steps=4".into(),
        "student.model_args.lora_dropout=0.1".into(),
    ];
    let c = demo(dir.path(), &extra).config;
    let full = run_quiet(&c);
    assert_eq!(full.train.global_step, 8);
    let last = dir.path().join("checkpoint-8");
    let adapter = std::fs::read(last.join("adapter_model.safetensors")).unwrap();
    let optimizer = std::fs::read(last.join("training_state/optimizer.safetensors")).ok();
    std::fs::remove_dir_all(&last).unwrap();

    let mut resumed = demo(dir.path(), &extra).config;
    resumed.resume_from_checkpoint = ResumeFrom::Latest;
    let s = run_quiet(&resumed);
    assert_eq!(s.train.global_step, 8);
    assert_eq!(
        std::fs::read(last.join("adapter_model.safetensors")).unwrap(),
        adapter,
        "the resumed run's adapter differs"
    );
    if let Some(o) = optimizer {
        assert_eq!(
            std::fs::read(last.join("training_state/optimizer.safetensors")).unwrap(),
            o
        );
    }
    assert_eq!(
        s.validations.iter().map(|v| v.step).collect::<Vec<_>>(),
        vec![8]
    );
    assert_eq!(
        full.validations.last().unwrap().val_loss,
        s.validations.last().unwrap().val_loss
    );
    // The teacher's scores came from the cache: it did not score again.
    assert_eq!(full.scored_sequences, 128 + 75);
    assert_eq!(s.scored_sequences, 0, "the resumed run scored again");
}

/// On-policy rows (TRL's `lmbda` = 0.5, `beta` = 0.5 → JSD): the student completes the
/// questions itself, the teacher scores its answers, validation still runs, and a resumed run
/// samples what the uninterrupted one sampled.
#[test]
fn on_policy_rows_train_and_resume_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let extra = [
        "max_steps=8".to_string(),
        "save_steps=4".into(),
        "logging_steps=1".into(),
        "+lmbda=0.5".into(),
        "~kd_objective".into(),
        "+beta=0.5".into(),
        "on_policy_max_new_tokens=12".into(),
        "student.model_args.lora_dropout=0.1".into(),
    ];
    let c = demo(dir.path(), &extra).config;
    assert_eq!(
        (c.on_policy_ratio, c.kd_objective),
        (0.5, KdObjective::JsDivergence)
    );
    let full = run_quiet(&c);
    let totals = full.on_policy.clone().expect("on-policy totals");
    let rows = full.train.global_step
        * c.student.training_args.per_device_train_batch_size
        * c.student.training_args.gradient_accumulation_steps;
    let share = totals.rows as f64 / rows as f64;
    assert!((0.3..0.7).contains(&share), "on-policy share {share}");
    assert!(totals.generated_tokens > 0 && totals.generated_tokens <= 12 * totals.rows);
    let log = full.last_log.clone().unwrap();
    let term = |k: &str| log.terms.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
    assert!(term("on_policy_fraction").is_some());
    assert!(term("train_distill_loss").is_some(), "{:?}", log.terms);
    assert!(!full.validations.is_empty());
    let last = dir.path().join("checkpoint-8");
    let adapter = std::fs::read(last.join("adapter_model.safetensors")).unwrap();
    std::fs::remove_dir_all(&last).unwrap();
    let mut resumed = demo(dir.path(), &extra).config;
    resumed.resume_from_checkpoint = ResumeFrom::Latest;
    let s = run_quiet(&resumed);
    assert_eq!(s.train.global_step, 8);
    assert_eq!(
        std::fs::read(last.join("adapter_model.safetensors")).unwrap(),
        adapter,
        "the resumed on-policy run's adapter differs"
    );
    // A different λ is a different run: resuming it is refused with the difference.
    let mut other = demo(dir.path(), &extra).config;
    other.on_policy_ratio = 0.25;
    other.resume_from_checkpoint = ResumeFrom::Latest;
    let e = run(&other, &mut QuietDistill).unwrap_err().to_string();
    assert!(e.contains("on_policy"), "{e}");
}

#[test]
fn rolls_example_yaml_parses_and_its_fixture_twin_runs() {
    let roll = load(
        Some(&repo().join("examples/distill/distill_megatron.yaml")),
        &[],
    )
    .unwrap();
    let c = &roll.config;
    assert_eq!(c.exp_name, "distill_megatron");
    assert_eq!(c.distill_loss_weight, 0.85);
    assert_eq!(c.logits_topk, 64);
    assert_eq!(c.question_key, "question_zh");
    assert_eq!(c.logits_transfer_backend, TransferBackend::NcclOnly);
    assert_eq!(c.student.training_args.learning_rate, 2e-5);
    assert_eq!(c.student.training_args.gradient_accumulation_steps, 4);
    assert_eq!(
        c.student.device_mapping.as_ref().unwrap().0,
        (0..8).collect::<Vec<_>>()
    );
    assert_eq!(c.student.training_args.max_grad_norm, 1.0);
    let w = roll.warnings.join("\n");
    for key in [
        "`checkpoint_config`",
        "`system_envs`",
        "`student.strategy_args`",
        "`teacher.strategy_args`",
        "`student.model_args.attn_implementation`",
        "`student.data_args.preprocessing_num_workers`",
    ] {
        assert!(w.contains(key), "no warning for {key}:\n{w}");
    }
    assert_eq!(
        roll.warnings
            .iter()
            .filter(|l| l.contains("`system_envs`"))
            .count(),
        1
    );

    // The same keys with the paths pointed at the fixtures, run for a few steps.
    let dir = tempfile::tempdir().unwrap();
    let d = fixtures().join("demo");
    let o = three_steps_of(&d.join("draft"), &d.join("target"), dir.path());
    let twin = load(
        Some(&repo().join("examples/distill/distill_megatron_fixtures.yaml")),
        &o,
    )
    .unwrap();
    let s = run_quiet(&twin.config);
    assert_eq!(s.train.global_step, 3);
    assert_eq!(s.validations.len(), 2);
    assert!(dir.path().join("checkpoint-3/model.safetensors").is_file());
}

/// Every configuration under `examples/distill/` loads (paths are relative to the repository
/// root, as the README runs them).
#[test]
fn every_example_configuration_loads() {
    let dir = repo().join("examples/distill");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "yaml") {
            let c = load(Some(&p), &[]).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            c.config.validate().unwrap();
            n += 1;
        }
    }
    assert!(n >= 6, "{n} configurations");
}

fn error_of(config: &DistillConfig) -> String {
    run(config, &mut QuietDistill).unwrap_err().to_string()
}

#[test]
fn bad_inputs_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let yaml = repo().join("examples/distill/demo.yaml");

    // Unknown key: the nearest valid one.
    let e = load(
        Some(&yaml),
        &["+student.training_args.lerning_rate=1".into()],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("student.training_args.learning_rate") && e.contains("demo.yaml"),
        "{e}"
    );
    // Wrong type: the key path and the expected type.
    let e = load(Some(&yaml), &["logits_topk=many".into()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`logits_topk`") && e.contains("expected usize"),
        "{e}"
    );

    // Another run holds the output directory: refused, naming the holder.
    let held = kd_pipeline::RunLock::acquire(&out).unwrap();
    let e = error_of(&demo(&out, &[]).config);
    assert!(
        e.contains("in use by another run") && e.contains(&format!("PID {}", std::process::id())),
        "{e}"
    );
    drop(held);

    // Missing data file.
    let c = demo(
        &out,
        &["student.data_args.file_name=/nonexistent/qa.json".into()],
    )
    .config;
    let e = error_of(&c);
    assert!(
        e.contains("/nonexistent/qa.json") && e.contains("does not exist"),
        "{e}"
    );

    // Records without the keys: record number and the keys present.
    let data = dir.path().join("qa.json");
    std::fs::write(
        &data,
        r#"[{"question": "a", "answer": "b"}, {"prompt": "p", "response": "r"}]"#,
    )
    .unwrap();
    let c = demo(
        &out,
        &[format!("student.data_args.file_name={}", data.display())],
    )
    .config;
    let e = error_of(&c);
    assert!(
        e.contains("qa.json:1 (record 2)")
            && e.contains("missing key `question`")
            && e.contains("`prompt`, `response`"),
        "{e}"
    );

    // A teacher of another vocabulary.
    let c = demo(
        &out,
        &[format!(
            "teacher_pretrain={}",
            fixtures().join("tiny-models/tiny-llama3").display()
        )],
    )
    .config;
    let e = error_of(&c);
    assert!(
        e.contains("vocabulary mismatch") && e.contains("same type"),
        "{e}"
    );

    // A teacher of the same vocabulary size whose tokenizer maps two tokens the other way.
    let other = dir.path().join("teacher");
    std::fs::create_dir_all(&other).unwrap();
    let target = fixtures().join("demo/target");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(target.join(f), other.join(f)).unwrap();
    }
    let mut tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(target.join("tokenizer.json")).unwrap())
            .unwrap();
    let vocab = tok["model"]["vocab"].as_object_mut().unwrap();
    let (a, b) = (vocab["¡"].clone(), vocab["¢"].clone());
    vocab.insert("¡".into(), b);
    vocab.insert("¢".into(), a);
    std::fs::write(other.join("tokenizer.json"), tok.to_string()).unwrap();
    let c = demo(&out, &[format!("teacher_pretrain={}", other.display())]).config;
    let e = error_of(&c);
    assert!(
        e.contains("tokenizer mismatch")
            && e.contains("2 of the student's")
            && e.contains("same type"),
        "{e}"
    );

    // A resume path that is not a checkpoint.
    let c = demo(
        &out,
        &[format!("resume_from_checkpoint={}", dir.path().display())],
    )
    .config;
    let e = error_of(&c);
    assert!(e.contains("names no checkpoint"), "{e}");

    // An unknown template: the available ones.
    let c = demo(&out, &["student.data_args.template=qwen3".into()]).config;
    let e = error_of(&c);
    assert!(e.contains("`qwen3`") && e.contains("`native`"), "{e}");
}

/// ROLL's own `distill_megatron.yaml` (Qwen2.5 teacher → student, `template: qwen2_5`) with
/// only the model paths and the data keys overridden, on the tiny Qwen2 pair of
/// `fixtures/demo-qwen/` (a ChatML tokenizer, q/k/v biases): the run trains, validates and
/// writes a Qwen2 checkpoint, and its prompts are the ids transformers'
/// `apply_chat_template` gives with the model's own Qwen2.5 template.
#[test]
fn rolls_yaml_runs_on_a_qwen2_pair() {
    let dir = tempfile::tempdir().unwrap();
    let q = fixtures().join("demo-qwen");
    let mut o = three_steps_of(&q.join("student"), &q.join("teacher"), dir.path());
    // ROLL's file reads `question_zh` / `answer_zh`; the demo corpus has English keys.
    o.extend(["question_key=question".into(), "answer_key=answer".into()]);
    let roll = load(
        Some(&repo().join("examples/distill/distill_megatron.yaml")),
        &o,
    )
    .unwrap();
    let s = run_quiet(&roll.config);
    assert_eq!(s.train.global_step, 3);
    assert_eq!(s.validations.len(), 2);
    for v in &s.validations {
        assert!(
            v.val_loss.is_finite() && v.kd_loss.is_finite() && v.tokens > 0,
            "{v:?}"
        );
    }
    let ckpt = dir.path().join("checkpoint-3");
    let saved = kd_model::LlamaConfig::from_file(ckpt.join("config.json")).unwrap();
    assert_eq!(saved.family, kd_model::ModelFamily::Qwen2);
    assert_eq!(saved.attention_biases(), [true, true, true, false]);

    // `template: qwen2_5` is the model's own ChatML (fixtures/demo-qwen/golden.json).
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(q.join("golden.json")).unwrap()).unwrap();
    let tok = kd_distill::phases::chat_tokenizer(&q.join("student"), Some("qwen2_5")).unwrap();
    let cases = golden["examples"].as_array().unwrap();
    assert!(!cases.is_empty());
    for case in cases {
        let messages: Vec<kd_data::Message> =
            serde_json::from_value(case["messages"].clone()).unwrap();
        let want: Vec<u32> = serde_json::from_value(case["prompt_ids"].clone()).unwrap();
        assert_eq!(tok.encode_prompt(&messages).unwrap(), want);
    }
}
