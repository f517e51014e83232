//! Greedy speculative decoding returns exactly the target's greedy output.

use kd_eval::{SpecConfig, speculative_generate};
use kd_model::{FinishReason, GenerateOptions, Llama, SeededPrompt};

use crate::{load, prompts};

fn seeded(prompts: &[Vec<u32>]) -> Vec<SeededPrompt<'_>> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, ids)| SeededPrompt {
            ids,
            seed: i as u64,
        })
        .collect()
}

/// Each prompt decoded alone by the target, greedily.
fn plain(target: &Llama, prompts: &[Vec<u32>], options: &GenerateOptions) -> Vec<Vec<u32>> {
    seeded(prompts)
        .iter()
        .map(|p| {
            target.generate(std::slice::from_ref(p), options).unwrap()[0]
                .ids
                .clone()
        })
        .collect()
}

#[test]
fn equals_target_greedy_for_several_drafts_and_k() {
    let target = load("tiny-llama3");
    let prompts = prompts(7);
    // No stop token in range: every row runs to the length limit.
    let options = GenerateOptions {
        stop_token_ids: vec![10_000],
        ..GenerateOptions::greedy(14)
    };
    let expected = plain(&target, &prompts, &options);
    let drafts = [
        (
            "first layer of the target",
            load("tiny-llama3").keep_layers(&[0]).unwrap(),
        ),
        ("unrelated model", load("tiny-sharded")),
        ("the target itself", load("tiny-llama3")),
    ];
    for (name, draft) in &drafts {
        for k in [1, 3, 4] {
            let config = SpecConfig {
                k,
                max_new_tokens: 14,
                stop_token_ids: vec![10_000],
                ..SpecConfig::default()
            };
            let out = speculative_generate(&target, draft, &seeded(&prompts), &config).unwrap();
            for (r, (c, e)) in out.completions.iter().zip(&expected).enumerate() {
                assert_eq!(&c.ids, e, "draft {name}, k {k}, row {r}");
                assert_eq!(c.finish_reason, FinishReason::Length);
            }
            let s = &out.stats;
            assert_eq!(s.drafted, s.verify_steps * k);
            assert!(s.accepted <= s.drafted);
            assert_eq!(s.emitted, 7 * 14);
            // Every verification gains at least one token: fewer passes than plain decoding.
            assert!(
                s.target_forwards <= 14,
                "{name}: {} target passes",
                s.target_forwards
            );
            if *name == "the target itself" {
                assert!(s.acceptance_rate() > 0.95, "{name}: {s:?}");
                assert!(s.top1_agreement() > 0.95);
                assert!(
                    s.alpha() > 0.99,
                    "α of a model against itself: {}",
                    s.alpha()
                );
            }
        }
    }
}

#[test]
fn rows_stop_independently_at_stop_tokens() {
    let target = load("tiny-llama3");
    let draft = load("tiny-llama3").keep_layers(&[0, 2]).unwrap();
    let prompts = prompts(9);
    // Stop at a token the target produces early in some rows and never in others.
    let free = plain(
        &target,
        &prompts,
        &GenerateOptions {
            stop_token_ids: vec![10_000],
            ..GenerateOptions::greedy(10)
        },
    );
    let stop = free[0][3];
    let options = GenerateOptions {
        stop_token_ids: vec![stop],
        ..GenerateOptions::greedy(10)
    };
    let expected: Vec<_> = seeded(&prompts)
        .iter()
        .map(|p| target.generate(std::slice::from_ref(p), &options).unwrap()[0].clone())
        .collect();
    assert!(
        expected
            .iter()
            .any(|c| c.finish_reason == FinishReason::Stop)
    );
    assert!(
        expected
            .iter()
            .any(|c| c.finish_reason == FinishReason::Length)
    );
    let config = SpecConfig {
        k: 3,
        max_new_tokens: 10,
        stop_token_ids: vec![stop],
        ..SpecConfig::default()
    };
    let out = speculative_generate(&target, &draft, &seeded(&prompts), &config).unwrap();
    for (r, (c, e)) in out.completions.iter().zip(&expected).enumerate() {
        assert_eq!(c.ids, e.ids, "row {r}");
        assert_eq!(c.finish_reason, e.finish_reason, "row {r}");
    }
}

#[test]
fn mismatched_vocabularies_and_bad_options_are_refused() {
    let target = load("tiny-llama3");
    let small = Llama::random(
        &kd_model::LlamaConfig::new(100, 16, 32, 1, 2, 1).unwrap(),
        &burn::tensor::Device::flex(),
    );
    let p = vec![vec![1u32, 2]];
    let e = speculative_generate(&target, &small, &seeded(&p), &SpecConfig::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("100") && e.contains("256"), "{e}");
    let k0 = SpecConfig {
        k: 0,
        ..SpecConfig::default()
    };
    let e = speculative_generate(&target, &target, &seeded(&p), &k0).unwrap_err();
    assert!(e.to_string().contains("at least 1"), "{e}");
}
