//! The acceptance report on the fixtures.

use kd_eval::{EvalOptions, EvalPhase, SpecConfig, evaluate, expected_length, ratio_interval};

use crate::{fixtures, load, prompts};

#[test]
fn report_counts_agree_with_each_other() {
    let target = load("tiny-llama3");
    let draft = load("tiny-llama3").keep_layers(&[0, 1]).unwrap();
    let prompts = prompts(10);
    let options = EvalOptions {
        spec: SpecConfig {
            k: 4,
            max_new_tokens: 12,
            ..SpecConfig::default()
        },
        batch_size: 4,
        ..EvalOptions::default()
    };
    let mut phases = Vec::new();
    let r = evaluate(&target, &draft, &prompts, &options, |phase, done, total| {
        assert!(done <= total);
        phases.push(phase);
    })
    .unwrap();
    assert_eq!(r.prompts, 10);
    assert_eq!(r.greedy_identical_rows, Some(10));
    // Each batch is decoded by every phase in turn (the timings interleave): 3 batches.
    use EvalPhase::{Draft, Speculative, Target};
    assert_eq!(phases, [Speculative, Target, Draft].repeat(3));
    let s = &r.stats;
    assert!((r.mean_accepted_length_with_bonus - r.mean_accepted_length - 1.0).abs() < 1e-12);
    assert!((r.acceptance_rate * 4.0 - r.mean_accepted_length).abs() < 1e-9);
    // Position 0 is examined at every verification, later ones only after acceptances.
    assert_eq!(s.reached[0], s.verify_steps);
    assert!(s.reached.windows(2).all(|w| w[0] >= w[1]));
    assert_eq!(s.reached[1], s.accepted_at[0]);
    assert_eq!(r.expected_length_from_alpha, expected_length(r.alpha, 4));
    // The target's token among the draft's top m: the top 1 is the top-1 agreement, a wider
    // top holds it at least as often, and this 2-layer draft misses more often than top 8.
    assert_eq!(s.in_top.len(), kd_eval::TOP_M);
    assert_eq!(s.in_top[0], s.top1_agree);
    assert!(s.in_top.windows(2).all(|w| w[0] <= w[1]), "{:?}", s.in_top);
    assert!(
        s.in_top[0] < s.in_top[7] && s.in_top[7] <= s.examined,
        "{s:?}"
    );
    assert_eq!(r.top_m_agreement.len(), kd_eval::TOP_M);
    assert_eq!(r.top_m_agreement[0], r.top1_agreement);
    let c = r.cost_ratio.unwrap();
    assert!(c > 0.0 && c.is_finite());
    assert!(r.measured_speedup.unwrap() > 0.0);
    assert!(r.summary().contains("mean accepted length"));
    // Three batches: the intervals over them hold the point estimates.
    let (rate, tau) = (
        r.acceptance_rate_ci95.unwrap(),
        r.mean_accepted_length_with_bonus_ci95.unwrap(),
    );
    assert!(
        rate.low <= r.acceptance_rate && r.acceptance_rate <= rate.high,
        "{rate:?}"
    );
    assert!(
        (0.0..=1.0).contains(&rate.low) && rate.high <= 1.0,
        "{rate:?}"
    );
    let t = r.mean_accepted_length_with_bonus;
    assert!(1.0 <= tau.low && tau.low <= t && t <= tau.high, "{tau:?}");
    assert!(r.summary().contains("95% CI"), "{}", r.summary());
}

/// The interval of a ratio over clusters against statsmodels' HC1 interval of the same
/// weighted mean (`fixtures/make_ratio_interval_golden.py`).
#[test]
fn ratio_intervals_match_statsmodels() {
    let path = fixtures().join("golden/ratio-intervals.json");
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let cases = golden["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 4);
    for case in cases {
        let column = |key: &str| -> Vec<f64> {
            case[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect()
        };
        let (a, d) = (column("a"), column("d"));
        let got = ratio_interval(a.iter().copied().zip(d.iter().copied())).unwrap();
        let (low, high) = (
            case["low"].as_f64().unwrap(),
            case["high"].as_f64().unwrap(),
        );
        let name = case["name"].as_str().unwrap();
        assert!(
            (got.low - low).abs() < 1e-12,
            "{name}: low {} vs {low}",
            got.low
        );
        assert!(
            (got.high - high).abs() < 1e-12,
            "{name}: high {} vs {high}",
            got.high
        );
    }
}
