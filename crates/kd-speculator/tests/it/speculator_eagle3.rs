//! `--draft_method eagle3` on the bundled demo target: an EAGLE-3 head is trained on the
//! target's completions, acceptance rises from the untrained head's, greedy speculative
//! decoding keeps the target's output, checkpoints are SpecForge draft directories that
//! `speculator eval` takes, a resumed run ends with the bytes of an uninterrupted one, the
//! settings that cannot apply are refused by name, and a run (EAGLE-3 or LoRA) draws nothing
//! from the random generator that the whole process shares.

use std::path::Path;

use kd_speculator::{DraftMethod, EvalConfig, Phase, SpeculatorConfig, SpeculatorObserver, run};
use kd_train::TrainObserver;

use crate::{cut_after_first_epoch, demo, same_last_checkpoint, small};

/// The demo run at test size (`small`) with an EAGLE-3 head: 240 prompts (24 held out).
fn small_eagle3(out: &Path) -> SpeculatorConfig {
    SpeculatorConfig {
        // Not read by an EAGLE-3 run: a path that does not exist proves it.
        draft_model: "no/such/draft".into(),
        draft_method: DraftMethod::Eagle3,
        draft_vocab_size: Some(256),
        aux_layers: vec![1, 2, 2],
        ttt_length: 3,
        ..small(out)
    }
}

#[derive(Default)]
struct Phases(Vec<Phase>, Vec<String>);

impl TrainObserver for Phases {}

impl SpeculatorObserver for Phases {
    fn on_phase(&mut self, phase: Phase) {
        self.0.push(phase);
    }

    fn on_warning(&mut self, warning: &str) {
        self.1.push(warning.to_string());
    }
}

#[test]
fn an_eagle3_head_learns_the_target_and_keeps_its_output() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut rec = Phases::default();
    let summary = run(&small_eagle3(&out), &mut rec).unwrap();
    assert_eq!(summary.prompts, (240, 216, 24));
    assert_eq!(
        rec.0,
        [
            Phase::Setup,
            Phase::Generate,
            Phase::EvalBefore,
            Phase::Train,
            Phase::EvalAfter
        ]
    );
    let a = summary.acceptance.as_ref().unwrap();
    let (before, after) = (a.before.as_ref().unwrap(), a.after.as_ref().unwrap());
    assert_eq!(before.greedy_identical_rows, Some(24));
    assert_eq!(after.greedy_identical_rows, Some(24));
    eprintln!(
        "EAGLE-3 on the demo target: mean accepted length {:.3} → {:.3}, acceptance {:.1}% → {:.1}%",
        before.mean_accepted_length,
        after.mean_accepted_length,
        100.0 * before.acceptance_rate,
        100.0 * after.acceptance_rate
    );
    // Measured: 0.000 → 0.095 (216 training prompts, 3 epochs; the untrained head guesses).
    assert!(
        after.mean_accepted_length > 0.05
            && after.mean_accepted_length > 5.0 * before.mean_accepted_length,
        "mean accepted length {} → {}",
        before.mean_accepted_length,
        after.mean_accepted_length
    );
    // The cost of an EAGLE-3 draft is measured inside speculative decoding.
    assert!(after.cost_ratio.is_some_and(|c| c > 0.0));
    // Checkpoints are SpecForge draft directories naming the target layers read.
    for e in 0..3 {
        let c = out.join(format!("checkpoint-epoch-{e}"));
        assert!(kd_model::eagle3::is_eagle3_dir(&c), "{}", c.display());
        let config = kd_model::Eagle3Config::from_file(c.join("config.json")).unwrap();
        assert_eq!(config.aux_layers, Some([1, 2, 2]));
        assert_eq!(config.draft_vocab_size, 256);
        assert!(c.join("model.safetensors").is_file());
        assert!(c.join("trainer_state.json").is_file());
    }
    let log = std::fs::read_to_string(out.join("training_log.txt")).unwrap();
    assert!(log.contains("ttt_loss"), "{log}");
    // Every logged step has each TTT step's accuracy and α, shares of the label tokens; the
    // first step's accuracy rises with training.
    let field = |line: &str, name: &str| -> Option<f64> {
        let at = line.find(&format!("| {name} "))? + name.len() + 3;
        line[at..].split_whitespace().next()?.parse().ok()
    };
    let steps: Vec<&str> = log.lines().filter(|l| l.contains("ttt_loss")).collect();
    assert!(steps.len() >= 2, "{log}");
    for line in &steps {
        for k in 0..3 {
            for name in [format!("ttt_step{k}_acc"), format!("ttt_step{k}_alpha")] {
                let v = field(line, &name).unwrap_or_else(|| panic!("{name} missing: {line}"));
                assert!((0.0..=1.0).contains(&v), "{name} {v}: {line}");
            }
        }
        assert!(field(line, "ttt_step3_acc").is_none(), "{line}");
    }
    let acc = |line: &str| field(line, "ttt_step0_acc").unwrap();
    eprintln!("{}\n{}", steps[0], steps[steps.len() - 1]);
    assert!(
        acc(steps[steps.len() - 1]) > acc(steps[0]),
        "step-0 accuracy {} → {}",
        acc(steps[0]),
        acc(steps[steps.len() - 1])
    );

    // `speculator eval` takes the checkpoint as the draft.
    let report = kd_speculator::eval(
        &EvalConfig {
            target_model: demo().join("target"),
            draft_model: out.join("checkpoint-epoch-2"),
            data_dir: demo().join("data"),
            max_samples: Some(8),
            options: kd_eval::EvalOptions {
                spec: kd_eval::SpecConfig {
                    max_new_tokens: 16,
                    ..kd_eval::SpecConfig::default()
                },
                ..kd_eval::EvalOptions::default()
            },
            ..EvalConfig::default()
        },
        |_, _, _| {},
    )
    .unwrap()
    .report;
    assert_eq!(report.greedy_identical_rows, Some(8));
    assert!(report.mean_accepted_length > 0.0, "{report:?}");

    exports_for_sglang_and_vllm(&out, &out.join("checkpoint-epoch-2"));

    // The finished run resumed with `--eval_draft_q8_0`: the acceptance is measured again
    // (not reused from the f32 measurement), with the head decoding from Q8_0 blocks, and is
    // recorded as such; greedy output is still the target's.
    let f32_file = kd_speculator::files::read_acceptance(&out.join("acceptance.json")).unwrap();
    assert!(!f32_file.draft_q8_0);
    let q8 = SpeculatorConfig {
        eval_draft_q8_0: true,
        resume_from_checkpoint: Some("latest".into()),
        ..small_eagle3(&out)
    };
    let resumed = run(&q8, &mut Phases::default()).unwrap();
    let a8 = resumed.acceptance.as_ref().unwrap();
    let (before8, after8) = (a8.before.as_ref().unwrap(), a8.after.as_ref().unwrap());
    assert_eq!(before8.greedy_identical_rows, Some(24));
    assert_eq!(after8.greedy_identical_rows, Some(24));
    let file = kd_speculator::files::read_acceptance(&out.join("acceptance.json")).unwrap();
    assert!(file.draft_q8_0);
    // A reused report would be the f32 one to the bit, its timings included.
    assert_ne!(
        file.before, f32_file.before,
        "the Q8_0 measurement reused the f32 one"
    );
    assert_eq!(
        file.decoding,
        kd_speculator::files::AcceptanceFile::DECODING
    );

    // A file written before the decoding loop's version was recorded (decoding 1, when a
    // Llama draft's first verification read the prompts) is measured again, not reused.
    let path = out.join("acceptance.json");
    let mut old: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    old.as_object_mut().unwrap().remove("decoding");
    std::fs::write(&path, old.to_string()).unwrap();
    assert_eq!(
        kd_speculator::files::read_acceptance(&path)
            .unwrap()
            .decoding,
        1
    );
    run(&q8, &mut Phases::default()).unwrap();
    let again = kd_speculator::files::read_acceptance(&path).unwrap();
    assert_eq!(
        again.decoding,
        kd_speculator::files::AcceptanceFile::DECODING
    );
    assert_ne!(
        again.before, file.before,
        "a decoding-1 measurement was reused"
    );
}

/// `speculator export` of a trained checkpoint: both layouts load back to the same tensors,
/// the speculators config names the verifier and SpecForge's semantics, and a foreign or
/// missing tensor is an error naming it.
fn exports_for_sglang_and_vllm(out: &Path, checkpoint: &Path) {
    use kd_speculator::{ExportConfig, ExportTarget, export};
    let device = burn::tensor::Device::flex();
    let target = kd_model::Llama::load(demo().join("target"), &device).unwrap();
    let embedding = || Some(target.embed_tokens.weight.val());
    let original = kd_model::Eagle3Draft::load(checkpoint, embedding(), &device).unwrap();
    let config = |to, dir: &str| crate::export_config(checkpoint, out.join(dir), to);
    assert_eq!(
        export(&config(ExportTarget::Sglang, "sglang")).unwrap(),
        None
    );
    let verifier = export(&config(ExportTarget::Vllm, "vllm"))
        .unwrap()
        .unwrap();
    assert_eq!(verifier, demo().join("target").display().to_string());
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("vllm/config.json")).unwrap())
            .unwrap();
    assert_eq!(
        json["architectures"],
        serde_json::json!(["Eagle3Speculator"])
    );
    assert_eq!(json["norm_before_residual"], false);
    assert_eq!(
        json["eagle_aux_hidden_state_layer_ids"],
        serde_json::json!([1, 2, 2])
    );
    assert_eq!(
        json["speculators_config"]["verifier"]["architectures"],
        serde_json::json!(["LlamaForCausalLM"])
    );
    assert_eq!(json["transformer_layer_config"]["num_hidden_layers"], 1);
    // llama.cpp needs the target's GGUF file; this run's target is a Hugging Face directory.
    let e = export(&config(ExportTarget::Gguf, "draft.gguf"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("is not a GGUF file") && e.contains("--verifier"),
        "{e}"
    );
    for dir in ["sglang", "vllm"] {
        let loaded = kd_model::Eagle3Draft::load(out.join(dir), embedding(), &device).unwrap();
        assert_eq!(loaded.config().aux_layers, Some([1, 2, 2]), "{dir}");
        assert_eq!(loaded.vocab(), original.vocab(), "{dir}");
        for (name, data) in original.named_tensors() {
            assert_eq!(loaded.named_tensors()[&name], data, "{dir}: {name}");
        }
    }
    let names = |dir: &str| -> Vec<String> {
        let bytes = std::fs::read(out.join(dir).join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut n: Vec<String> = st.names().into_iter().map(String::from).collect();
        n.sort();
        n
    };
    assert!(
        names("vllm")
            .iter()
            .any(|n| n == "layers.0.self_attn.q_proj.weight")
    );
    assert!(
        names("sglang")
            .iter()
            .any(|n| n == "midlayer.self_attn.q_proj.weight")
    );

    // A foreign tensor and a missing one are named.
    let bad = out.join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::copy(checkpoint.join("config.json"), bad.join("config.json")).unwrap();
    let bytes = std::fs::read(checkpoint.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let write = |skip: &str, extra: bool| {
        let mut views: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
            .tensors()
            .into_iter()
            .filter(|(n, _)| n != skip)
            .collect();
        if extra {
            let norm = st.tensor("norm.weight").unwrap();
            views.push(("midlayer.extra_norm.weight".into(), norm));
        }
        safetensors::serialize_to_file(views, None, &bad.join("model.safetensors")).unwrap();
    };
    let bad_config = |to| ExportConfig {
        draft: bad.clone(),
        verifier: Some(demo().join("target").display().to_string()),
        ..config(to, "bad-out")
    };
    write("", true);
    let e = export(&bad_config(ExportTarget::Sglang))
        .unwrap_err()
        .to_string();
    assert!(e.contains("midlayer.extra_norm.weight"), "{e}");
    write("midlayer.mlp.up_proj.weight", false);
    let e = export(&bad_config(ExportTarget::Vllm))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("midlayer.mlp.up_proj.weight") && e.contains("missing"),
        "{e}"
    );
    assert!(!out.join("bad-out").exists(), "nothing written on an error");
}

/// Resumed after its first epoch, a run ends with the bytes of the uninterrupted one: with
/// the target run in training, and with the rows kept as the target generated them
/// (`--target_cache_dir`), which the resumed run, generating nothing, reads back.
#[test]
fn a_resumed_eagle3_run_ends_with_the_bytes_of_an_uninterrupted_one() {
    let dir = tempfile::tempdir().unwrap();
    for (name, rows) in [("computed", None), ("kept", Some(dir.path().join("rows")))] {
        let full = dir.path().join(format!("full-{name}"));
        let config = SpeculatorConfig {
            num_epochs: 2,
            eval_fraction: 0.0,
            target_cache_dir: rows.clone(),
            ..small_eagle3(&full)
        };
        let first = run(&config, &mut Phases::default()).unwrap();
        let trained = first.prompts.1;
        let captured = first.target_rows.unwrap().captured;
        assert_eq!(captured, if rows.is_some() { trained } else { 0 });
        let cut = dir.path().join(format!("cut-{name}"));
        cut_after_first_epoch(&full, &cut);
        let resumed = SpeculatorConfig {
            output_dir: cut.clone(),
            resume_from_checkpoint: Some("latest".into()),
            ..config.clone()
        };
        let summary = run(&resumed, &mut Phases::default()).unwrap();
        assert_eq!(
            summary.train.checkpoints.len(),
            1,
            "{name}: only epoch 1 again"
        );
        if rows.is_some() {
            let t = summary.target_rows.unwrap();
            assert_eq!((t.captured, t.misses), (0, 0), "{name}: {t:?}");
        }
        same_last_checkpoint(
            &full,
            &cut,
            &["model.safetensors", "training_state/optimizer.safetensors"],
        );
    }
}

#[test]
fn eagle3_settings_that_cannot_apply_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let err = |c: SpeculatorConfig| run(&c, &mut Phases::default()).unwrap_err().to_string();
    let e = err(SpeculatorConfig {
        draft_vocab_size: Some(5000),
        ..small_eagle3(&out)
    });
    assert!(
        e.contains("--draft_vocab_size 5000") && e.contains("1024"),
        "{e}"
    );
    let e = err(SpeculatorConfig {
        aux_layers: vec![1, 2, 9],
        ..small_eagle3(&out)
    });
    assert!(e.contains("--aux_layers 9") && e.contains("1 to 2"), "{e}");
    let e = err(SpeculatorConfig {
        aux_layers: vec![1, 2],
        ..small_eagle3(&out)
    });
    assert!(e.contains("--aux_layers"), "{e}");
    let e = err(SpeculatorConfig {
        use_distillation: true,
        ..small_eagle3(&out)
    });
    assert!(e.contains("--use_distillation"), "{e}");
    let e = err(SpeculatorConfig {
        ttt_length: 0,
        ..small_eagle3(&out)
    });
    assert!(e.contains("--ttt_length"), "{e}");
    let e = err(SpeculatorConfig {
        draft_intermediate_size: Some(0),
        ..small_eagle3(&out)
    });
    assert!(e.contains("--draft_intermediate_size"), "{e}");
    // The demo target is safetensors: no GGUF blocks to take 8-bit activations.
    let e = err(SpeculatorConfig {
        target_int8: true,
        ..small_eagle3(&out)
    });
    assert!(
        e.contains("--target_int8") && e.contains("no packed GGUF blocks"),
        "{e}"
    );
    // Nothing was written by the refused runs.
    assert!(!out.join("teacher_cache").exists());
    assert!(!out.exists(), "the refused runs made {}", out.display());
}

#[test]
fn the_dry_run_states_what_the_target_cache_holds() {
    let dir = tempfile::tempdir().unwrap();
    let config = small_eagle3(&dir.path().join("run"));
    let features = |config: &SpeculatorConfig| {
        let plan = kd_speculator::plan(config).unwrap();
        let (_, line) = plan
            .items
            .into_iter()
            .find(|(k, _)| k == "features")
            .expect("a features line");
        line
    };
    let target = kd_model::LlamaConfig::from_file(demo().join("target/config.json")).unwrap();
    // Three features and the final hidden state of the target's width, the normaliser, the
    // argmax; no logits of the draft vocabulary.
    let per_position = 4 * (4 * target.hidden_size + 1) + 8;
    let line = features(&config);
    assert!(
        line.contains(&format!(
            "{:.1} KB per token position",
            per_position as f64 / 1e3
        )) && line.contains("--target_cache_mb 4096 MiB")
            && line.contains(&format!(
                "about {} positions",
                (4096usize << 20) / per_position
            )),
        "{line}"
    );
    assert!(line.contains("nothing on disk"), "{line}");
    let rows = dir.path().join("rows");
    let on_disk = features(&SpeculatorConfig {
        target_cache_dir: Some(rows.clone()),
        ..config.clone()
    });
    assert!(
        on_disk.contains(&format!("on disk in {}", rows.display()))
            && on_disk.contains("MB for this run's rows")
            && on_disk.contains("rows beyond it are read back from disk")
            && on_disk.contains("writes each row as it generates the completion")
            && !on_disk.contains("nothing on disk"),
        "{on_disk}"
    );
    let disk_only = features(&SpeculatorConfig {
        target_cache_dir: Some(rows.clone()),
        target_cache_mb: 0,
        ..config.clone()
    });
    assert!(
        disk_only.contains("none kept in memory") && !disk_only.contains("every micro-batch"),
        "{disk_only}"
    );
    let off = features(&SpeculatorConfig {
        target_cache_mb: 0,
        ..config
    });
    assert!(off.contains("on every micro-batch"), "{off}");
}

/// `--max_seq_length` cutting rows: a row cut at its completion's end (its prompt whole) is the
/// first positions of what the target computed while generating, and is kept then; a row
/// whose prompt was cut starts elsewhere, and the target runs over it in training. Both train
/// as a run whose target runs over every row in training does, to rounding. The prompts are
/// the first two words of demo questions without the system message (two distinct ones from
/// each domain, 40), so that many fit in half of 40 positions and keep their prompts whole.
#[test]
fn rows_cut_short_of_their_completion_are_kept_while_generating() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data/short");
    std::fs::create_dir_all(&data).unwrap();
    let mut domains: Vec<_> = std::fs::read_dir(demo().join("data"))
        .unwrap()
        .map(|e| e.unwrap().path().join("batch_input.jsonl"))
        .collect();
    domains.sort();
    let (mut lines, mut seen) = (String::new(), std::collections::HashSet::new());
    for file in domains {
        let mut taken = 0;
        for line in std::fs::read_to_string(file).unwrap().lines() {
            let mut request: serde_json::Value = serde_json::from_str(line).unwrap();
            let messages = request["body"]["messages"].as_array_mut().unwrap();
            messages.retain(|m| m["role"] != "system");
            let question = messages.last_mut().unwrap();
            let words: Vec<&str> = question["content"].as_str().unwrap().split(' ').collect();
            let short = words[..words.len().min(2)].join(" ");
            if !seen.insert(short.clone()) {
                continue;
            }
            question["content"] = short.into();
            lines.push_str(&format!("{request}\n"));
            taken += 1;
            if taken == 2 {
                break;
            }
        }
    }
    std::fs::write(data.join("batch_input.jsonl"), lines).unwrap();
    let config = SpeculatorConfig {
        data_dir: dir.path().join("data"),
        max_samples: None,
        max_seq_length: 40,
        target_cache_dir: Some(dir.path().join("rows")),
        target_cache_mb: 0,
        num_epochs: 2,
        eval_fraction: 0.0,
        ..small_eagle3(&dir.path().join("kept"))
    };
    let mut phases = Phases::default();
    let kept = run(&config, &mut phases).unwrap();
    let trained = kept.prompts.1;
    // How many rows the cut shortened, from its warning.
    let cut: usize = phases
        .1
        .iter()
        .find_map(|w| w.split_once(" examples were cut to --max_seq_length 40"))
        .map(|(n, _)| n.parse().unwrap())
        .expect("some rows are cut");
    let t = kept.target_rows.unwrap();
    assert_eq!(t.captured + t.misses, trained, "{t:?}");
    // Rows the cut shortened were kept while generating, and others were computed.
    assert!(t.captured > trained - cut, "{t:?}, {cut} of {trained} cut");
    assert!(t.misses > 0, "{t:?}");
    assert_eq!(t.disk_writes, trained, "{t:?}");
    let t = trains_as_if_computed(&config, &kept, &dir.path().join("computed"));
    assert_eq!((t.captured, t.misses), (0, 2 * trained));
}

/// `config` run again into `out` without a rows directory, so that its target runs over every
/// row in training: its last loss is `kept`'s to 1e-4 (relative). Returns its row counts.
fn trains_as_if_computed(
    config: &SpeculatorConfig,
    kept: &kd_speculator::SpeculatorSummary,
    out: &Path,
) -> kd_speculator::eagle3::CacheStats {
    let computed = run(
        &SpeculatorConfig {
            output_dir: out.to_path_buf(),
            target_cache_dir: None,
            ..config.clone()
        },
        &mut Phases::default(),
    )
    .unwrap();
    let (a, b) = (
        kept.train.last_loss.unwrap(),
        computed.train.last_loss.unwrap(),
    );
    assert!(
        (a - b).abs() <= 1e-4 * b.abs(),
        "last loss {a} with the generation's rows, {b} with the training's passes"
    );
    computed.target_rows.unwrap()
}

/// `--target_cache_dir`: the run keeps what the target computed for each training row while
/// it generated the row's completion there, under a manifest naming the target's fingerprint
/// and the layers, and trains on it without a pass of the target of its own; its losses are
/// those of a run whose target runs over each row in training (no directory), to rounding. A
/// second run over the same rows reads every row back (the target runs on none) and ends with
/// the first run's checkpoint, byte for byte; a run reading other layers is refused, naming
/// both, before it generates or trains anything.
#[test]
fn target_rows_kept_on_disk_serve_a_second_run() {
    let dir = tempfile::tempdir().unwrap();
    let rows = dir.path().join("rows");
    let config = SpeculatorConfig {
        target_cache_dir: Some(rows.clone()),
        target_cache_mb: 0,
        num_epochs: 2,
        max_samples: Some(40),
        eval_fraction: 0.0,
        ..small_eagle3(&dir.path().join("first"))
    };
    let first = run(&config, &mut Phases::default()).unwrap();
    let trained = first.prompts.1;
    let t = first.target_rows.unwrap();
    // Every row kept as it was generated and written; both epochs read them back from disk
    // (no memory for them), and the target ran over none in training.
    assert_eq!(
        (t.captured, t.misses, t.disk_writes, t.disk_reads, t.hits),
        (trained, 0, trained, 2 * trained, 0)
    );
    let t = trains_as_if_computed(&config, &first, &dir.path().join("computed"));
    assert_eq!((t.captured, t.misses), (0, 2 * trained));
    let manifest: kd_speculator::eagle3::TargetRowsManifest = serde_json::from_slice(
        &std::fs::read(rows.join(kd_speculator::eagle3::TARGET_ROWS_MANIFEST)).unwrap(),
    )
    .unwrap();
    assert_eq!(
        manifest.target,
        kd_teacher::model_fingerprint(&demo().join("target")).unwrap()
    );
    assert_eq!(manifest.layers, vec![1, 2, 2, 3]);
    assert_eq!(
        std::fs::read_dir(rows.join("rows")).unwrap().count(),
        trained
    );

    let second = dir.path().join("second");
    let again = run(
        &SpeculatorConfig {
            output_dir: second.clone(),
            ..config.clone()
        },
        &mut Phases::default(),
    )
    .unwrap();
    let t = again.target_rows.unwrap();
    // Its own output directory: it generates again (the same completions, the same rows
    // written over the first run's), then reads them back.
    assert_eq!(
        (t.captured, t.misses, t.disk_writes, t.disk_reads),
        (trained, 0, trained, 2 * trained)
    );
    let bytes =
        |out: &Path| std::fs::read(out.join("checkpoint-epoch-1/model.safetensors")).unwrap();
    assert!(bytes(&second) == bytes(&dir.path().join("first")));

    let third = dir.path().join("third");
    let e = run(
        &SpeculatorConfig {
            output_dir: third.clone(),
            aux_layers: vec![1, 1, 2],
            ..config
        },
        &mut Phases::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("layers: held [1, 2, 2, 3], this run [1, 1, 2, 3]"),
        "{e}"
    );
    assert!(!third.exists(), "the refused run made {}", third.display());
}

/// `--draft_intermediate_size` sets a fresh head's MLP width: the checkpoint says so (and a
/// run starting from it loads weights of that shape), speculative decoding with it (from Q8_0 blocks) keeps the
/// target's output, and a run continuing from it with another width keeps the checkpoint's
/// and warns, naming both.
#[test]
fn a_wider_head_mlp_is_trained_saved_and_kept_when_continued() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let config = SpeculatorConfig {
        draft_intermediate_size: Some(96),
        num_epochs: 1,
        max_samples: Some(60),
        eval_draft_q8_0: true,
        ..small_eagle3(&out)
    };
    let plan = kd_speculator::plan(&config).unwrap();
    let (_, draft) = plan.items.iter().find(|(k, _)| k == "draft").unwrap();
    assert!(draft.contains("(MLP 96)"), "{draft}");
    let summary = run(&config, &mut Phases::default()).unwrap();
    let after = summary.acceptance.as_ref().unwrap().after.as_ref().unwrap();
    assert_eq!(after.greedy_identical_rows, Some(summary.prompts.2));
    let checkpoint = out.join("checkpoint-epoch-0");
    let saved = kd_model::Eagle3Config::from_file(checkpoint.join("config.json")).unwrap();
    let target = kd_model::LlamaConfig::from_file(demo().join("target/config.json")).unwrap();
    assert_ne!(target.intermediate_size, 96);
    assert_eq!(saved.llama.intermediate_size, 96);

    let next = dir.path().join("next");
    let mut rec = Phases::default();
    run(
        &SpeculatorConfig {
            init_adapter: Some(checkpoint.clone()),
            draft_intermediate_size: Some(128),
            eval_fraction: 0.0,
            ..SpeculatorConfig {
                output_dir: next.clone(),
                ..config
            }
        },
        &mut rec,
    )
    .unwrap();
    assert!(
        rec.1.iter().any(
            |w| w.contains("--draft_intermediate_size 128 is not applied") && w.contains("has 96")
        ),
        "{:?}",
        rec.1
    );
    let kept =
        kd_model::Eagle3Config::from_file(next.join("checkpoint-epoch-0/config.json")).unwrap();
    assert_eq!(kept.llama.intermediate_size, 96);
}

/// SmolLM2 (Q4_1) as the target with 8-bit activations (`--target_int8`; `--target_amx` where
/// the CPU has AMX tiles): it generates the completions, its hidden states train the head, and
/// speculative decoding with the head keeps its greedy output on every held-out prompt. The
/// teacher cache and `acceptance.json` record how the target decoded. At AVX2 and above (below
/// it the 8-bit products stand down).
#[test]
fn smollm2_with_8_bit_activations_runs_the_eagle3_pipeline() {
    if kd_kernels::cpu::level() < kd_kernels::cpu::SimdLevel::Avx2 {
        eprintln!("skipped: below AVX2 (KD_SIMD or the CPU)");
        return;
    }
    let target = crate::fixtures().join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        target.is_file(),
        "{} is missing: run fixtures/fetch-smollm2.sh",
        target.display()
    );
    let amx = kd_model::Llama::load_for_inference(&target, &kd_model::parse_device("cpu").unwrap())
        .unwrap()
        .with_int8_activations(true)
        .with_amx_tiles(true)
        .amx_tiles();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let config = SpeculatorConfig {
        target_model: target,
        target_int8: !amx,
        target_amx: amx,
        max_samples: Some(24),
        eval_fraction: 0.25,
        max_new_tokens: 8,
        eval_max_new_tokens: 8,
        num_epochs: 1,
        ttt_length: 1,
        draft_vocab_size: Some(512),
        aux_layers: vec![2, 15, 27],
        eval_k: 2,
        ..small_eagle3(&out)
    };
    // The dry run takes the flag this CPU supports, and refuses --target_amx without tiles.
    let plan = kd_speculator::plan(&config).unwrap();
    let (_, line) = plan.items.iter().find(|(k, _)| k == "target").unwrap();
    let flag = if amx {
        "(--target_amx)"
    } else {
        "(--target_int8)"
    };
    assert!(line.contains(flag), "{line}");
    if !kd_model::Llama::amx_tiles_available() {
        let tiles = SpeculatorConfig {
            target_int8: false,
            target_amx: true,
            ..config.clone()
        };
        let e = kd_speculator::plan(&tiles).unwrap_err().to_string();
        assert!(e.contains("--target_amx: no AMX tiles"), "{e}");
    }
    let summary = run(&config, &mut Phases::default()).unwrap();
    assert_eq!(summary.prompts, (24, 18, 6));
    let a = summary.acceptance.as_ref().unwrap();
    assert_eq!((a.target_int8, a.target_amx), (true, amx));
    for report in [a.before.as_ref().unwrap(), a.after.as_ref().unwrap()] {
        assert_eq!(report.greedy_identical_rows, Some(6), "{report:?}");
    }
    let manifest =
        std::fs::read_to_string(out.join("teacher_cache/generations/manifest.json")).unwrap();
    let suffix = if amx { "+int8-amx" } else { "+int8" };
    assert!(manifest.contains(&format!("{suffix}\"")), "{manifest}");
}

/// A run draws nothing from Burn's CPU generator, which every thread of the process shares
/// (other tests here seed it and draw): an EAGLE-3 run (a fresh head) and a LoRA run with the
/// hidden-state projection each end with the same checkpoint bytes while another thread keeps
/// reseeding that generator and drawing from it.
#[test]
fn runs_draw_nothing_from_the_process_wide_generator() {
    let dir = tempfile::tempdir().unwrap();
    let same_beside = |name: &str, make: &dyn Fn(&Path) -> SpeculatorConfig, files: &[&str]| {
        let at = |run: &str| SpeculatorConfig {
            num_epochs: 1,
            max_samples: Some(40),
            eval_fraction: 0.0,
            ..make(&dir.path().join(format!("{name}-{run}")))
        };
        let alone = at("alone");
        run(&alone, &mut Phases::default()).unwrap();
        let beside = at("beside");
        kd_kernels::testing::beside_other_draws(|| run(&beside, &mut Phases::default())).unwrap();
        for f in files {
            let bytes = |c: &SpeculatorConfig| {
                std::fs::read(c.output_dir.join("checkpoint-epoch-0").join(f)).unwrap()
            };
            assert!(bytes(&alone) == bytes(&beside), "{name}: {f} differs");
        }
    };
    same_beside("eagle3", &small_eagle3, &["model.safetensors"]);
    same_beside(
        "lora",
        &|out| SpeculatorConfig {
            use_distillation: true,
            kd_weight: 0.5,
            ..small(out)
        },
        &["adapter_model.safetensors", "projection.safetensors"],
    );
}
