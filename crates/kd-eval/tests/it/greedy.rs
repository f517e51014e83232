//! Greedy speculative decoding returns exactly the target's greedy output (tiny models, and
//! SmolLM2 with 8-bit activations).

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
    let p_min = SpecConfig {
        draft_p_min: 1.5,
        ..SpecConfig::default()
    };
    let e = speculative_generate(&target, &target, &seeded(&p), &p_min).unwrap_err();
    assert!(e.to_string().contains("draft_p_min"), "{e}");
}

#[test]
fn drafting_fewer_tokens_where_the_draft_is_unsure_keeps_the_target_output() {
    let target = load("tiny-llama3");
    let draft = load("tiny-llama3").keep_layers(&[0, 1]).unwrap();
    let prompts = prompts(7);
    let options = GenerateOptions {
        stop_token_ids: vec![10_000],
        ..GenerateOptions::greedy(14)
    };
    let expected = plain(&target, &prompts, &options);
    let k = 4;
    let mut drafted = Vec::new();
    for p_min in [0.0, 0.05, 0.1, 1.0] {
        let config = SpecConfig {
            k,
            max_new_tokens: 14,
            stop_token_ids: vec![10_000],
            draft_p_min: p_min,
            ..SpecConfig::default()
        };
        // As one batch (rows draft different numbers of tokens each round) and row by row.
        let out = speculative_generate(&target, &draft, &seeded(&prompts), &config).unwrap();
        for (r, (c, e)) in out.completions.iter().zip(&expected).enumerate() {
            assert_eq!(&c.ids, e, "draft_p_min {p_min}, row {r}");
            let alone = speculative_generate(&target, &draft, &seeded(&prompts)[r..r + 1], &config)
                .unwrap();
            assert_eq!(
                &alone.completions[0].ids, e,
                "draft_p_min {p_min}, row {r} alone"
            );
        }
        let s = &out.stats;
        assert!(s.accepted <= s.drafted && s.drafted <= k * s.verify_steps);
        eprintln!(
            "draft_p_min {p_min}: {} drafted in {} rounds, {} accepted",
            s.drafted, s.verify_steps, s.accepted
        );
        drafted.push((s.drafted, s.verify_steps));
    }
    // Always k at 0; nothing at 1 (no draft is ever certain); in between, some rounds draft
    // fewer than k and some draft.
    assert_eq!(drafted[0].0, k * drafted[0].1);
    assert_eq!(drafted[3].0, 0);
    assert!(
        drafted[1..3]
            .iter()
            .any(|(d, rounds)| *d > 0 && *d < k * rounds),
        "{drafted:?}"
    );
}

/// SmolLM2's Q4_1 blocks with 8-bit activations (and on AMX tiles where the CPU has them) as
/// the target, drafted for by itself (nearly every draft accepted, so every drafted position
/// is verified): greedy speculative decoding of prompts of 20 to 31 tokens, a batch of 12 and
/// one at a time, gives the target alone's tokens. The target reads the prompts in a pass of
/// their own; were the first drafts verified in the prompts' pass, their rows would round
/// otherwise and 8-bit rounding would change tokens. At AVX2 and above (below it the
/// multi-row products go through Burn's operations, which round otherwise).
#[test]
fn smollm2_with_8_bit_activations_keeps_its_greedy_output() {
    if kd_kernels::cpu::level() < kd_kernels::cpu::SimdLevel::Avx2 {
        eprintln!("skipped: below AVX2 (KD_SIMD or the CPU)");
        return;
    }
    let path = crate::fixtures().join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.is_file(),
        "{} is missing: run fixtures/fetch-smollm2.sh",
        path.display()
    );
    let int8 = Llama::load_for_inference(&path, &kd_model::parse_device("cpu").unwrap())
        .unwrap()
        .with_int8_activations(true);
    let amx = int8.clone().with_amx_tiles(true);
    let mut targets = vec![("int8", int8)];
    if amx.amx_tiles() {
        targets.push(("int8 on AMX tiles", amx));
    }
    let prompts: Vec<Vec<u32>> = (0..12)
        .map(|i| {
            (0..20 + i)
                .map(|j| (100 + (i * 7919 + j * 977) % 40_000) as u32)
                .collect()
        })
        .collect();
    let (new, k) = (8, 4);
    let options = GenerateOptions {
        stop_token_ids: vec![u32::MAX],
        ..GenerateOptions::greedy(new)
    };
    let config = SpecConfig {
        k,
        max_new_tokens: new,
        stop_token_ids: vec![u32::MAX],
        ..SpecConfig::default()
    };
    for (name, target) in &targets {
        let expected = plain(target, &prompts, &options);
        let batched = speculative_generate(target, target, &seeded(&prompts), &config).unwrap();
        assert!(
            batched.stats.acceptance_rate() > 0.9,
            "{name}: {:?}",
            batched.stats
        );
        for (r, e) in expected.iter().enumerate() {
            let alone = speculative_generate(
                target,
                target,
                &seeded(std::slice::from_ref(&prompts[r])),
                &config,
            )
            .unwrap();
            assert_eq!(&alone.completions[0].ids, e, "{name}: row {r} alone");
            assert_eq!(
                &batched.completions[r].ids, e,
                "{name}: row {r} in the batch"
            );
        }
    }
}
