use super::*;

/// ⌊λn + u⌋ rows: never more than one away from λn, λ on average, the same rows for the
/// same (seed, epoch, step), others for another step.
#[test]
fn on_policy_rows_take_a_share_lambda_on_average() {
    for (n, ratio) in [(16, 0.5), (8, 0.25), (3, 0.5), (5, 1.0), (7, 0.0)] {
        let mut total = 0usize;
        let steps = 4000;
        for step in 0..steps {
            let rows = on_policy_rows(n, ratio, 42, 1, step);
            assert_eq!(rows.len(), n);
            let k = rows.iter().filter(|r| **r).count();
            let exact = ratio * n as f64;
            assert!(
                k as f64 >= exact.floor() && k as f64 <= exact.ceil(),
                "{k} rows of {n} at λ {ratio}"
            );
            assert_eq!(rows, on_policy_rows(n, ratio, 42, 1, step));
            total += k;
        }
        let mean = total as f64 / (steps * n) as f64;
        assert!(
            (mean - ratio).abs() < 0.01,
            "mean share {mean} at λ {ratio}"
        );
    }
    let a: Vec<Vec<bool>> = (0..8).map(|s| on_policy_rows(16, 0.5, 42, 0, s)).collect();
    assert!(
        a.windows(2).any(|w| w[0] != w[1]),
        "rows vary with the step"
    );
    assert_ne!(
        on_policy_rows(16, 0.5, 42, 0, 3),
        on_policy_rows(16, 0.5, 42, 1, 3)
    );
    assert_ne!(sample_seed(1, 0, 3, 5), sample_seed(1, 0, 3, 6));
    assert_ne!(sample_seed(1, 0, 3, 5), sample_seed(1, 1, 3, 5));
}

#[test]
fn terms_keep_on_and_off_policy_rows_apart() {
    let samples = OnPolicySamples {
        examples: vec![
            Example {
                id: "a".into(),
                input_ids: vec![1, 2, 3],
                labels: vec![-100, 2, 3],
                prompt_len: 1,
            };
            2
        ],
        generated_tokens: 40,
        generation_seconds: 2.0,
        scored_tokens: 60,
        scoring_seconds: 0.5,
        ..OnPolicySamples::default()
    };
    let stats = |loss_sum, counted, acceptance_sum, top1_matches| LossStats {
        loss_sum,
        counted,
        nonfinite_positions: 0,
        acceptance_sum,
        top1_matches,
    };
    let kd = [
        Some(stats(3.0, 10, 4.0, 2)),
        Some(stats(1.0, 10, 6.0, 3)),
        Some(stats(2.0, 20, 10.0, 10)),
        None,
    ];
    let terms = on_policy_terms(&samples, 8, &[false, false, true, false], &kd, 10.0);
    let get = |k: &str| terms.iter().find(|(n, _)| *n == k).map(|(_, v)| *v);
    assert_eq!(get("on_policy_fraction"), Some(0.25));
    assert_eq!(get("kd_off_policy"), Some(0.2));
    assert_eq!(get("off_policy_alpha"), Some(0.5));
    assert_eq!(get("off_policy_top1"), Some(0.25));
    assert_eq!(get("kd_on_policy"), Some(0.1));
    assert_eq!(get("on_policy_alpha"), Some(0.5));
    assert_eq!(get("on_policy_top1"), Some(0.5));
    assert_eq!(get("on_policy_generation_tokens_per_second"), Some(20.0));
    assert_eq!(get("on_policy_scoring_tokens_per_second"), Some(120.0));
    assert_eq!(get("on_policy_generation_share"), Some(0.2));
    assert_eq!(get("on_policy_scoring_share"), Some(0.05));
}
