use super::*;

fn load_str(text: &str, overrides: &[&str]) -> Result<LoadedConfig> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.yaml");
    std::fs::write(&p, text).unwrap();
    let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    load(Some(&p), &o)
}

#[test]
fn defaults_overrides_and_interpolation() {
    let c = load_str(
        "exp_name: x\nstudent_pretrain: s\nmax_steps: 7\nstudent:\n  model_args:\n    model_name_or_path: ${student_pretrain}\n  training_args:\n    learning_rate: 1.0e-4\nlogging_dir: ${output_dir}/logs-${exp_name}\n",
        &["max_steps=9", "student.training_args.per_device_train_batch_size=2", "+teacher.url=http://x"],
    )
    .unwrap();
    let cfg = c.config;
    assert_eq!(cfg.max_steps, 9);
    assert_eq!(cfg.student.model_args.model_name_or_path, Some("s".into()));
    assert_eq!(cfg.student.training_args.learning_rate, 1e-4);
    assert_eq!(cfg.student.training_args.per_device_train_batch_size, 2);
    assert_eq!(cfg.logging_dir, PathBuf::from("./output/logs-x"));
    assert_eq!(cfg.teacher.url.as_deref(), Some("http://x"));
    // ROLL's defaults elsewhere.
    assert_eq!(cfg.logits_topk, 64);
    assert_eq!(cfg.distill_loss_weight, 0.5);
    assert_eq!(
        cfg.student.training_args.lr_scheduler_type,
        super::super::config::LrScheduler::Linear
    );
}

#[test]
fn trls_gkd_names_are_aliases() {
    use kd_loss::KdObjective;
    let c = load_str("lmbda: 0.5\nbeta: 0.5\nseq_kd: false\n", &[])
        .unwrap()
        .config;
    assert_eq!(c.on_policy_ratio, 0.5);
    assert_eq!(c.kd_objective, KdObjective::JsDivergence);
    for (beta, objective) in [
        ("0", KdObjective::ForwardKl),
        ("0.0", KdObjective::ForwardKl),
        ("1", KdObjective::ReverseKl),
    ] {
        let c = load_str(&format!("beta: {beta}\n"), &[]).unwrap().config;
        assert_eq!(c.kd_objective, objective, "beta {beta}");
    }
    // Overrides name the alias too.
    let c = load_str("", &["+lmbda=1.0"]).unwrap().config;
    assert_eq!(c.on_policy_ratio, 1.0);
    let e = load_str("beta: 0.3\n", &[]).unwrap_err().to_string();
    assert!(
        e.contains("`beta: 0.3`") && e.contains("skewed_forward_kl"),
        "{e}"
    );
    let e = load_str("lmbda: 0.5\non_policy_ratio: 0.5\n", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("give one"), "{e}");
    let e = load_str("beta: 0\nkd_objective: tv_distance\n", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("`beta`") && e.contains("`kd_objective`"), "{e}");
    let e = load_str("seq_kd: true\n", &[]).unwrap_err().to_string();
    assert!(
        e.contains("`seq_kd: true`") && e.contains("speculator"),
        "{e}"
    );
    let e = load_str("lmbda: 1.5\n", &[])
        .unwrap()
        .config
        .validate()
        .unwrap_err();
    assert!(e.to_string().contains("`lmbda`"), "{e}");
}

#[test]
fn unknown_keys_and_wrong_types_are_named() {
    let e = load_str("distill_loss_wieght: 0.3\n", &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`distill_loss_wieght`") && e.contains("`distill_loss_weight`"),
        "{e}"
    );
    let e = load_str("student:\n  training_args:\n    learnig_rate: 1\n", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("student.training_args.learning_rate"), "{e}");
    let e = load_str("student:\n  training_args:\n    learning_rate: fast\n", &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("student.training_args.learning_rate") && e.contains("f64"),
        "{e}"
    );
    let e = load_str("", &["max_stepz=3"]).unwrap_err().to_string();
    assert!(e.contains("+max_stepz"), "{e}");
    let e = load_str("max_steps: 3\n", &["+max_steps=4"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("already"), "{e}");
    let e = load_str("x: ${nope}\n", &[]).unwrap_err().to_string();
    assert!(e.contains("`x`"), "{e}");
}

#[test]
fn roll_keys_without_meaning_warn_and_clip_precedence() {
    let c = load_str(
        "max_grad_norm: 2.0\nsystem_envs:\n  A: b\nstudent:\n  strategy_args:\n    strategy_name: megatron_train\n  training_args:\n    max_grad_norm: 1.0\n",
        &[],
    )
    .unwrap();
    assert_eq!(c.config.student.training_args.max_grad_norm, 2.0);
    let w = c.warnings.join("\n");
    assert!(w.contains("`system_envs`"), "{w}");
    assert!(w.contains("`student.strategy_args`"), "{w}");
    assert!(w.contains("top level wins"), "{w}");
}
