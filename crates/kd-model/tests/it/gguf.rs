//! GGUF loading against transformers' own GGUF loader (fixtures/make_gguf_golden.py):
//! a committed tiny file with every supported tensor type, and the real SmolLM2-135M-Instruct
//! file that fixtures/fetch-smollm2.sh fetches.

use std::path::PathBuf;

use kd_model::{Llama, LlamaConfig, ModelError, RopeScaling, TokenBatch};

use crate::util::{Reference, avx2, cpu, fixtures, golden, to_vec};

fn tiny_gguf() -> PathBuf {
    fixtures().join("tiny-gguf/tiny.gguf")
}

/// The real model; its absence fails the test with the command that fetches it.
pub fn smollm2() -> PathBuf {
    let p = fixtures().join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "{} is missing: run fixtures/fetch-smollm2.sh (the real-model tests need it)",
        p.display()
    );
    p
}

fn json(name: &str) -> serde_json::Value {
    let p = fixtures().join("golden/gguf").join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn tiny_gguf_logits_match_transformers() {
    let model = Llama::load(tiny_gguf(), &cpu()).unwrap();
    let g = json("tiny.json");
    let c = model.config();
    let want = &g["config"];
    assert_eq!(c.vocab_size as u64, want["vocab_size"].as_u64().unwrap());
    assert_eq!(c.num_hidden_layers, 3);
    assert_eq!(
        (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
        (4, 2, 24)
    );
    assert!(c.tie_word_embeddings);
    assert_eq!(c.rms_norm_eps, want["rms_norm_eps"].as_f64().unwrap());
    assert_eq!(c.rope_theta, 10_000.0);
    assert_eq!(c.rope_scaling, RopeScaling::Default);
    assert_eq!(
        (c.bos_token_ids.as_slice(), c.eos_token_ids.as_slice()),
        (&[0][..], &[4][..])
    );

    let logits = golden("gguf/tiny");
    let reference = Reference::load("gguf-tiny");
    let sequences = g["sequences"].as_array().unwrap();
    assert_eq!(sequences.len(), 3);
    for (i, s) in sequences.iter().enumerate() {
        let ids = ids(&s["ids"]);
        let got = to_vec(model.logits(&TokenBatch::single(&ids)).unwrap());
        let key = format!("logits.{i}");
        let want = &logits[&key];
        assert_eq!(want.shape, [ids.len(), 1024]);
        reference.check(&format!("tiny.gguf sequence {i}"), &key, &got, None);
        let argmax: Vec<usize> = got.chunks_exact(1024).map(argmax).collect();
        assert_eq!(
            argmax,
            self::ids(&s["argmax"])
                .iter()
                .map(|&a| a as usize)
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn tiny_gguf_queries_and_keys_are_unpermuted_as_transformers_does() {
    let model = Llama::load(tiny_gguf(), &cpu()).unwrap();
    let g = json("tiny.json");
    let attn = &model.layers[0].self_attn;
    for (key, proj) in [("q_proj_rows", &attn.q_proj), ("k_proj_rows", &attn.k_proj)] {
        // Burn holds [in, out]; transformers [out, in].
        let w = proj.base.weight.val().transpose();
        let [out, inp] = w.dims();
        let rows = g[key]["values"].as_array().unwrap();
        assert_eq!(g[key]["shape"], serde_json::json!([out, inp]));
        let got: Vec<f32> = w.into_data().try_into_vec_as::<f32>().unwrap();
        for (r, row) in rows.iter().enumerate() {
            assert_eq!(
                &got[r * inp..(r + 1) * inp],
                floats(row).as_slice(),
                "{key} row {r}"
            );
        }
    }
}

#[test]
fn gguf_loads_from_a_directory_and_refuses_ambiguity() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(tiny_gguf(), dir.path().join("model.gguf")).unwrap();
    let from_dir = Llama::load(dir.path(), &cpu()).unwrap();
    assert_eq!(from_dir.config().hidden_size, 96);
    assert_eq!(
        LlamaConfig::from_gguf(dir.path()).unwrap(),
        *from_dir.config()
    );
    std::fs::copy(tiny_gguf(), dir.path().join("other.gguf")).unwrap();
    let e = Llama::load(dir.path(), &cpu()).unwrap_err().to_string();
    assert!(
        e.contains(
            "holds 2 .gguf files (model.gguf, other.gguf) and no config.json; pass the file"
        ),
        "{e}"
    );
}

#[test]
fn bad_gguf_files_are_errors_naming_what_is_wrong() {
    let bytes = std::fs::read(tiny_gguf()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");

    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let e = Llama::load(&path, &cpu()).unwrap_err().to_string();
    assert!(e.contains("truncated: tensor `output_norm.weight`"), "{e}");

    // Another architecture, same length: the error names the key and the value.
    let key = b"general.architecture";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 4 + 8;
    let mut other = bytes.clone();
    assert_eq!(&other[at..at + 5], b"llama");
    other[at..at + 5].copy_from_slice(b"gemma");
    std::fs::write(&path, &other).unwrap();
    let e = Llama::load(&path, &cpu()).unwrap_err();
    assert!(matches!(e, ModelError::Config { .. }), "{e:?}");
    let e = e.to_string();
    assert!(
        e.contains("`general.architecture`: unsupported architecture `gemma`")
            && e.contains(r#"supported are "llama", "qwen2", "qwen3""#),
        "{e}"
    );

    // An unknown quantisation type id on one tensor names that tensor.
    let name = b"blk.1.attn_v.weight";
    let at = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    let ty_at = at + 4 + 2 * 8; // n_dims, two dims
    let mut q = bytes.clone();
    q[ty_at..ty_at + 4].copy_from_slice(&10u32.to_le_bytes()); // Q2_K
    std::fs::write(&path, &q).unwrap();
    let e = Llama::load(&path, &cpu()).unwrap_err().to_string();
    assert!(
        e.contains("tensor `blk.1.attn_v.weight` is stored as Q2_K"),
        "{e}"
    );

    std::fs::write(&path, b"not a model").unwrap();
    let e = Llama::load(&path, &cpu()).unwrap_err().to_string();
    assert!(e.contains("not a GGUF file"), "{e}");
}

#[test]
fn smollm2_logits_match_transformers() {
    let model = Llama::load(smollm2(), &cpu()).unwrap();
    let c = model.config();
    assert_eq!(
        (
            c.num_hidden_layers,
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads
        ),
        (30, 576, 9, 3)
    );
    assert_eq!(
        (c.vocab_size, c.intermediate_size, c.rope_theta),
        (49_152, 1536, 100_000.0)
    );
    assert!(c.tie_word_embeddings);
    let g = json("smollm2-logits.json");
    let cols = golden("gguf/smollm2-logits");
    let reference = Reference::load("gguf-smollm2");
    let prompts = g["prompts"].as_array().unwrap();
    assert_eq!(prompts.len(), 4);
    for (i, p) in prompts.iter().enumerate() {
        let ids = ids(&p["ids"]);
        let logits = to_vec(model.logits(&TokenBatch::single(&ids)).unwrap());
        let v = c.vocab_size;
        assert_eq!(cols[&format!("logits.{i}")].shape, [ids.len(), 1024]);
        let (mut first, mut top, mut lse) = (Vec::new(), Vec::new(), Vec::new());
        let argmax = self::ids(&p["argmax"]);
        for (t, row) in logits.chunks_exact(v).enumerate() {
            first.extend_from_slice(&row[..1024]);
            top.extend(
                self::ids(&p["top16_ids"][t])
                    .iter()
                    .map(|&id| row[id as usize]),
            );
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            lse.push(m + row.iter().map(|x| ((x - m) as f64).exp()).sum::<f64>().ln() as f32);
            assert_eq!(
                self::argmax(row) as u32,
                argmax[t],
                "prompt {i} position {t}: argmax"
            );
        }
        for (key, ours) in [("logits", first), ("top16_values", top), ("logsumexp", lse)] {
            let key = format!("{key}.{i}");
            reference.check(&format!("SmolLM2 prompt {i} {key}"), &key, &ours, None);
        }
    }
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0
}

#[test]
fn packed_decoding_equals_the_f32_model() {
    let dev = cpu();
    let f32_model = Llama::load(tiny_gguf(), &dev).unwrap();
    let packed = Llama::load_for_inference(tiny_gguf(), &dev).unwrap();
    assert!(packed.has_packed_weights() && !f32_model.has_packed_weights());
    // make_gguf_golden.py's `tiny_type`: attn_v Q4_0, attn_output Q4_1, ffn_up Q8_0 and
    // ffn_down Q4_K / Q5_K / Q6_K in each of the 3 layers; the rest F16, BF16 or F32, so the
    // layers stay Burn operations.
    assert_eq!(
        Llama::packed_projections(tiny_gguf()).unwrap(),
        Some((12, 21))
    );
    assert!(!packed.host_layers());
    let g = json("tiny.json");
    let reference = Reference::load("gguf-tiny");
    // Up to 32 rows take the packed kernels: sequences of 5 and 17 tokens.
    for (i, s) in g["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .take(2)
    {
        let ids = ids(&s["ids"]);
        let a = to_vec(packed.logits(&TokenBatch::single(&ids)).unwrap());
        let b = to_vec(f32_model.logits(&TokenBatch::single(&ids)).unwrap());
        // Both paths within the reference's bound of the float64 result (their products differ
        // in summation order: packed blocks vs GEMM), so within twice that bound of each other.
        let key = format!("logits.{i}");
        reference.check(&format!("packed sequence {i}"), &key, &a, None);
        reference.check(&format!("f32 sequence {i}"), &key, &b, None);
        let d = max_abs_diff(&a, &b);
        assert!(
            d <= 2.0 * reference.bound(&key),
            "sequence {i}: packed vs f32 max |Δ| {d}"
        );
    }
    // Greedy decoding gives the same tokens; a derived draft keeps its layers' blocks.
    let prompt = ids(&g["sequences"][1]["ids"]);
    let p = [kd_model::SeededPrompt {
        ids: &prompt,
        seed: 0,
    }];
    let mut options = kd_model::GenerateOptions::greedy(12);
    options.stop_token_ids = vec![u32::MAX];
    let a = packed.generate(&p, &options).unwrap();
    let b = f32_model.generate(&p, &options).unwrap();
    assert_eq!(a[0].ids, b[0].ids);
    let kept = packed.keep_layers(&[0, 2]).unwrap();
    assert!(kept.has_packed_weights());
    let a = kept.generate(&p, &options).unwrap();
    let b = f32_model
        .keep_layers(&[0, 2])
        .unwrap()
        .generate(&p, &options)
        .unwrap();
    assert_eq!(a[0].ids, b[0].ids);
}

#[test]
fn q8_0_blocks_made_at_load_decode_close_to_the_f32_weights() {
    let dev = cpu();
    // The demo draft's MLP is 176 wide: its down projection (not a multiple of 32) keeps
    // reading f32 while the rest reads blocks.
    for name in ["demo/target", "demo/draft"] {
        let f32_model = Llama::load(fixtures().join(name), &dev).unwrap();
        let q8 = Llama::load(fixtures().join(name), &dev)
            .unwrap()
            .with_q8_0_weights(true);
        assert!(q8.has_packed_weights() && !f32_model.has_packed_weights());
        let ids: Vec<u32> = vec![1, 17, 250, 3, 99, 42];
        let batch = TokenBatch::single(&ids);
        let a = to_vec(q8.logits(&batch).unwrap());
        let b = to_vec(f32_model.logits(&batch).unwrap());
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = max_abs_diff(&a, &b);
        if avx2() {
            // Weights rounded to 8 bits move the logits a little, never much.
            assert!(
                d > 0.0 && d < 0.02 * scale,
                "{name}: max |Δ| {d} at scale {scale}"
            );
        } else {
            // Below AVX2 the blocks stand down: decoding reads the f32 weights.
            assert_eq!(d, 0.0, "{name}: blocks read below AVX2");
        }
        // Greedy decoding, batched rows and the KV cache go through the blocks too.
        let p = [kd_model::SeededPrompt { ids: &ids, seed: 0 }];
        let mut options = kd_model::GenerateOptions::greedy(8);
        options.stop_token_ids = vec![u32::MAX];
        assert_eq!(q8.generate(&p, &options).unwrap()[0].ids.len(), 8);
        // Dropping the blocks is the f32 model again, bit for bit.
        let back = to_vec(q8.with_q8_0_weights(false).logits(&batch).unwrap());
        assert_eq!(back, b, "{name}");
    }
}

#[test]
fn llama3_rope_scaling_is_recovered_from_rope_freqs() {
    // fixtures/make_llama3_gguf.py: tiny-llama3 as llama.cpp's converter writes it (the
    // scaling only as `rope_freqs.weight`); the safetensors twin is tested against transformers.
    let dev = cpu();
    let gguf = Llama::load(fixtures().join("tiny-gguf/tiny-llama3.gguf"), &dev).unwrap();
    let hf = crate::util::load("tiny-llama3");
    assert_eq!(
        gguf.config().rope_scaling,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        }
    );
    assert_eq!(gguf.config().rope_scaling, hf.config().rope_scaling);
    let ids: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 256).collect();
    let a = to_vec(gguf.logits(&TokenBatch::single(&ids)).unwrap());
    let b = to_vec(hf.logits(&TokenBatch::single(&ids)).unwrap());
    let d = max_abs_diff(&a, &b);
    assert!(d <= 1e-5, "GGUF vs safetensors twin: max |Δ| {d}");
}

/// Log-softmax of one row, in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = m + row.iter().map(|x| (*x as f64 - m).exp()).sum::<f64>().ln();
    row.iter().map(|x| *x as f64 - lse).collect()
}

/// 8-bit activations (integer dot products, as llama.cpp computes) against the f32
/// activations of the same packed blocks on SmolLM2-135M-Instruct: per-position top-1
/// agreement and KL(f32 ‖ int8) over the four golden chat prompts, fed through the KV cache
/// in passes of up to 6 tokens (the shapes of decoding and of a speculative verification).
#[test]
fn smollm2_int8_activations_agree_with_f32_activations() {
    let dev = cpu();
    let model = Llama::load_for_inference(smollm2(), &dev).unwrap();
    let int8 = model.clone().with_int8_activations(true);
    assert!(int8.int8_activations() && !model.int8_activations());
    let g = json("smollm2-logits.json");
    let v = model.config().vocab_size;
    let run_in = |m: &Llama, ids: &[u32], pass: usize| -> Vec<f32> {
        let mut cache = m.new_cache();
        let mut out = Vec::new();
        for chunk in ids.chunks(pass) {
            let pass = m
                .forward_cached(
                    &TokenBatch::single(chunk),
                    &mut cache,
                    &kd_model::ForwardOptions::default(),
                )
                .unwrap();
            out.extend(to_vec(pass.into_logits().unwrap()));
        }
        out
    };
    let run = |m: &Llama, ids: &[u32]| run_in(m, ids, 6);
    // Top-1 agreement, mean and largest KL(a ‖ b) over the fixture's positions.
    let compare = |a_model: &Llama, b_model: &Llama| {
        let (mut agree, mut positions, mut kl_sum, mut kl_max) = (0usize, 0usize, 0f64, 0f64);
        for p in g["prompts"].as_array().unwrap() {
            let mut ids = ids(&p["ids"]);
            ids.extend(self::ids(&g["generate"]["no_eos_stop_ids"]));
            let (a, b) = (run(a_model, &ids), run(b_model, &ids));
            for (ra, rb) in a.chunks_exact(v).zip(b.chunks_exact(v)) {
                agree += usize::from(argmax(ra) == argmax(rb));
                positions += 1;
                let (la, lb) = (log_softmax(ra), log_softmax(rb));
                let kl: f64 = la.iter().zip(&lb).map(|(x, y)| x.exp() * (x - y)).sum();
                kl_sum += kl;
                kl_max = kl_max.max(kl);
            }
        }
        (
            agree as f64 / positions as f64,
            kl_sum / positions as f64,
            kl_max,
            positions,
        )
    };
    let (top1, kl_mean, kl_max, positions) = compare(&model, &int8);
    eprintln!(
        "int8 vs f32 activations over {positions} positions: top-1 agreement {top1:.4}, \
         KL mean {kl_mean:.2e}, max {kl_max:.2e}"
    );
    // On AMX tiles (other float rounding than the VNNI kernel): the same bounds against f32
    // activations.
    let amx = int8.clone().with_amx_tiles(true);
    if amx.amx_tiles() {
        let (top1, kl_mean, kl_max, _) = compare(&model, &amx);
        let (same, vnni_mean, vnni_max, _) = compare(&int8, &amx);
        eprintln!(
            "AMX tiles vs f32 activations: top-1 {top1:.4}, KL mean {kl_mean:.2e}, max \
             {kl_max:.2e}; vs the VNNI kernel: top-1 {same:.4}, KL mean {vnni_mean:.2e}, max \
             {vnni_max:.2e}"
        );
        assert!(
            top1 >= 0.97 && kl_mean <= 8e-3 && kl_max <= 0.1,
            "AMX tiles"
        );
    }
    // Measured on this fixture: 0.9832 (4 of 238 flip), mean 4.17e-3 (4.13e-3 before attention
    // took passes of up to 16 tokens query by query), max 5.02e-2; on AMX tiles 0.9832,
    // 4.02e-3, 4.08e-2 (against the VNNI kernel: 0.9832, 3.51e-3, 4.31e-2) — the same
    // on every CPU (integer products, fixed float order). Bounds at about twice that: a wrong
    // scale or block order gives KL orders of magnitude larger.
    assert!(top1 >= 0.97, "top-1 agreement {top1}");
    assert!(kl_mean <= 8e-3, "mean KL {kl_mean}");
    assert!(kl_max <= 0.1, "max KL {kl_max}");
    // Below AVX2 the 8-bit products stand down (the agreement above is then exact), and the
    // f32 products of Burn's GEMM depend on the number of rows: the check below is the
    // 8-bit kernels'.
    if !avx2() {
        assert_eq!((kl_max, top1), (0.0, 1.0), "8-bit products below AVX2");
        return;
    }
    // What speculative decoding relies on: a pass over several tokens gives each position
    // what one-token passes give it (rows do not see each other in the products).
    let ids = ids(&g["prompts"][0]["ids"]);
    let (chunked, single) = (run_in(&int8, &ids, 6), run_in(&int8, &ids[..], 1));
    for (t, (a, b)) in chunked
        .chunks_exact(v)
        .zip(single.chunks_exact(v))
        .enumerate()
    {
        assert_eq!(argmax(a), argmax(b), "position {t}");
        let d = max_abs_diff(a, b);
        assert!(
            d <= 1e-4,
            "position {t}: 6-token vs 1-token passes differ by {d}"
        );
    }
}

/// `load_for_inference` on the CPU is lean: SmolLM2's 210 projections and its tied embedding
/// stay in their blocks, and a cached prefill of whole prompts (31 to 38 tokens: three passes
/// wider than 32 rows, which the host layers take when lean) and greedy decoding make no f32
/// copy where the CPU
/// runs the host layers (AVX2). The logits stay within the reference's bound of
/// transformers' and give its argmax at every position; the copies a path asks for later are
/// the eager loader's values bit for bit.
#[test]
fn a_lean_smollm2_prefills_and_decodes_from_its_blocks_alone() {
    let dev = cpu();
    let lean = Llama::load_for_inference(smollm2(), &dev).unwrap();
    assert_eq!(lean.f32_copies_made(), Some((0, 30 * 7 + 1)));
    assert_eq!(
        Llama::load(smollm2(), &dev).unwrap().f32_copies_made(),
        None
    );
    let host = avx2();
    let g = json("smollm2-logits.json");
    let reference = Reference::load("gguf-smollm2");
    let v = lean.config().vocab_size;
    for (i, p) in g["prompts"].as_array().unwrap().iter().enumerate() {
        let ids = ids(&p["ids"]);
        let mut cache = lean.new_cache();
        let pass = lean
            .forward_cached(
                &TokenBatch::single(&ids),
                &mut cache,
                &kd_model::ForwardOptions::default(),
            )
            .unwrap();
        let logits = to_vec(pass.into_logits().unwrap());
        let argmax = self::ids(&p["argmax"]);
        let mut first = Vec::new();
        for (t, row) in logits.chunks_exact(v).enumerate() {
            first.extend_from_slice(&row[..1024]);
            assert_eq!(
                self::argmax(row) as u32,
                argmax[t],
                "prompt {i} position {t}"
            );
        }
        let key = format!("logits.{i}");
        reference.check(&format!("lean SmolLM2 prompt {i}"), &key, &first, None);
    }
    // Two prompts as one 75-token pass: wide enough for the products' GEMM over blocks
    // dequantised per task. Against the eager model's f32 GEMM: within twice the reference's
    // bound, and the same greedy continuation.
    let eager = Llama::load(smollm2(), &dev).unwrap();
    let mut long = ids(&g["prompts"][0]["ids"]);
    long.extend(ids(&g["prompts"][1]["ids"]));
    let mut cache = lean.new_cache();
    let pass = lean
        .forward_cached(
            &TokenBatch::single(&long),
            &mut cache,
            &kd_model::ForwardOptions::default(),
        )
        .unwrap();
    let a = to_vec(pass.into_logits().unwrap());
    let b = to_vec(eager.logits(&TokenBatch::single(&long)).unwrap());
    let d = max_abs_diff(&a, &b);
    let bound = 2.0 * reference.bound("logits.0");
    assert!(
        d <= bound,
        "75-token pass: lean vs f32 max |Δ| {d} > {bound}"
    );
    let seeded = [kd_model::SeededPrompt {
        ids: &long,
        seed: 0,
    }];
    let mut options = kd_model::GenerateOptions::greedy(8);
    options.stop_token_ids = vec![u32::MAX];
    let out = lean.generate(&seeded, &options).unwrap();
    assert_eq!(
        out[0].ids,
        eager.generate(&seeded, &options).unwrap()[0].ids
    );
    // A prompt of several hundred tokens: the lean model prefills it through the cache in
    // chunks of positions (one chunk's activations at a time). Its last position's logits
    // against the eager model's single pass, and the greedy continuation.
    let mut longer = Vec::new();
    for _ in 0..3 {
        for p in g["prompts"].as_array().unwrap() {
            longer.extend(ids(&p["ids"]));
        }
    }
    assert!(longer.len() > 300, "{} tokens", longer.len());
    let mut cache = lean.new_cache();
    let pass = lean
        .forward_cached(
            &TokenBatch::single(&longer),
            &mut cache,
            &kd_model::ForwardOptions::last_positions(1),
        )
        .unwrap();
    let a = to_vec(pass.into_logits().unwrap());
    let b = to_vec(eager.logits(&TokenBatch::single(&longer)).unwrap());
    let d = max_abs_diff(&a, &b[b.len() - v..]);
    assert!(
        d <= bound,
        "{}-token prefill: lean vs f32 max |Δ| {d} > {bound}",
        longer.len()
    );
    let seeded = [kd_model::SeededPrompt {
        ids: &longer,
        seed: 0,
    }];
    assert_eq!(
        lean.generate(&seeded, &options).unwrap()[0].ids,
        eager.generate(&seeded, &options).unwrap()[0].ids
    );
    if host {
        assert_eq!(lean.f32_copies_made(), Some((0, 211)), "no f32 copy made");
    }
    // A copy made on demand is the eager loader's weight bit for bit: a Llama-permuted query
    // and key projection, a value and a down projection, and the tied embedding.
    let bits = |t: burn::tensor::Tensor<2>| -> Vec<u32> {
        let v: Vec<f32> = t.into_data().try_to_vec().unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    };
    let (l, e) = (&lean.layers, &eager.layers);
    for (a, b) in [
        (&l[0].self_attn.q_proj, &e[0].self_attn.q_proj),
        (&l[3].self_attn.k_proj, &e[3].self_attn.k_proj),
        (&l[7].self_attn.v_proj, &e[7].self_attn.v_proj),
        (&l[29].mlp.down_proj, &e[29].mlp.down_proj),
    ] {
        assert_eq!(bits(a.base.weight.val()), bits(b.base.weight.val()));
    }
    assert_eq!(
        bits(lean.embed_tokens.weight.val()),
        bits(eager.embed_tokens.weight.val())
    );
    let made = if host {
        5
    } else {
        lean.f32_copies_made().unwrap().0
    };
    assert_eq!(lean.f32_copies_made(), Some((made, 211)));
}

/// SmolLM2's Q4_1 file loaded lean for decoding with f32 activations, 8-bit ones, and 8-bit
/// ones on AMX tiles where the CPU has them; `None` below AVX2, where decoding reads f32
/// copies through Burn's operations, whose products over several rows round differently from
/// one row's (the bit-for-bit pass tests then skip).
fn smollm2_decoding_paths() -> Option<Vec<(&'static str, Llama)>> {
    if !avx2() {
        eprintln!("skipped: below AVX2 (KD_SIMD or the CPU)");
        return None;
    }
    let base = Llama::load_for_inference(smollm2(), &cpu()).unwrap();
    let int8 = base.clone().with_int8_activations(true);
    let amx = int8.clone().with_amx_tiles(true);
    let mut models = vec![("f32", base), ("int8", int8)];
    if amx.amx_tiles() {
        models.push(("int8 on AMX tiles", amx));
    }
    Some(models)
}

/// The logits of one cached pass over `rows` (left-padded), every position.
fn cached_logits(m: &Llama, cache: &mut kd_model::KvCache, rows: &[Vec<u32>]) -> Vec<f32> {
    let batch = TokenBatch::from_rows(rows, m.pad_id(), kd_model::PaddingSide::Left);
    let out = m
        .forward_cached(&batch, cache, &kd_model::ForwardOptions::default())
        .unwrap();
    kd_model::generate::to_host(out.into_logits().unwrap())
}

/// SmolLM2's Q4_1 blocks: a cached pass over 2 to 16 new tokens (a speculative
/// verification) gives each row the logits of one-token passes bit for bit, with f32
/// activations, 8-bit ones, and 8-bit ones on AMX tiles where the CPU has them: attention
/// computes a pass of at most 16 queries row by row, each over its own keys, as a one-token
/// pass does. At AVX2 and above (the host layers).
#[test]
fn smollm2_short_passes_give_each_row_the_bits_of_one_token_passes() {
    let Some(models) = smollm2_decoding_paths() else {
        return;
    };
    let ids: Vec<u32> = (0..40).map(|j| (100 + j * 977 % 40_000) as u32).collect();
    let (prompt, extra) = ids.split_at(21);
    let logits = |m: &Llama, cache: &mut kd_model::KvCache, fed: &[u32]| {
        cached_logits(m, cache, &[fed.to_vec()])
    };
    for (name, m) in &models {
        let mut cache = m.new_cache();
        logits(m, &mut cache, prompt);
        let start = cache.real_lengths()[0];
        let one: Vec<Vec<f32>> = (0..16)
            .map(|t| logits(m, &mut cache, &extra[t..t + 1]))
            .collect();
        let v = one[0].len();
        for n in [2, 5, 16] {
            cache.truncate(&[start]).unwrap();
            let many = logits(m, &mut cache, &extra[..n]);
            for (t, row) in one.iter().enumerate().take(n) {
                assert!(
                    many[t * v..(t + 1) * v] == row[..],
                    "{name}: row {t} of a pass over {n}"
                );
            }
        }
    }
}

/// SmolLM2's Q4_1 blocks, a batch of two rows whose KV cache holds masked slots in the middle
/// of one row (the drafts of a verification that only the other row kept, as batched
/// speculative decoding leaves them): the row's next logits are those of the row decoded
/// alone, bit for bit, with f32 and 8-bit activations (and on AMX tiles where the CPU has
/// them), at AVX2 and above. Attention gathers a row's visible keys before it sums over them.
#[test]
fn smollm2_masked_slots_of_a_batch_leave_a_row_the_bits_it_has_alone() {
    let Some(models) = smollm2_decoding_paths() else {
        return;
    };
    let row = |seed: usize, n: usize| -> Vec<u32> {
        (0..n)
            .map(|j| (100 + (seed * 7919 + j * 977) % 40_000) as u32)
            .collect()
    };
    let (p0, p1) = (row(1, 23), row(2, 17));
    let (d0, d1) = (row(3, 4), row(4, 4));
    let v = 49_152;
    for (name, m) in &models {
        let pass = |cache: &mut kd_model::KvCache, rows: &[Vec<u32>]| cached_logits(m, cache, rows);
        // Row 1 alone: its prompt, its first draft, then one more token.
        let mut alone = m.new_cache();
        pass(&mut alone, std::slice::from_ref(&p1));
        pass(&mut alone, &[d1[..1].to_vec()]);
        let want = pass(&mut alone, &[vec![7_001]]);
        // The batch: both prompts, four drafts each; row 0 keeps all, row 1 its first only.
        let mut cache = m.new_cache();
        pass(&mut cache, &[p0.clone(), p1.clone()]);
        pass(&mut cache, &[d0.clone(), d1.clone()]);
        let lens = cache.real_lengths().to_vec();
        cache.truncate(&[lens[0], lens[1] - 3]).unwrap();
        let got = pass(&mut cache, &[vec![7_000], vec![7_001]]);
        let last = |l: &[f32], rows: usize, r: usize| {
            l[(l.len() / rows) * (r + 1) - v..(l.len() / rows) * (r + 1)].to_vec()
        };
        assert!(
            last(&got, 2, 1) == last(&want, 1, 0),
            "{name}: row 1 after its masked slots"
        );
    }
}

/// What the lean SmolLM2 computes while it generates (`generate_captured`): the same checks
/// as `generation::generation_captures_what_the_full_pass_computes`, with a prompt of over
/// 128 tokens, which the lean model passes through the cache in chunks: the hidden states of
/// the chunks are joined in order. The full pass (the f32 copies made from the same blocks,
/// one GEMM) is a reference within the bound the logits' reference allows the two paths.
#[test]
fn a_lean_smollm2_captures_what_it_computes() {
    let lean = Llama::load_for_inference(smollm2(), &cpu()).unwrap();
    let g = json("smollm2-logits.json");
    let mut rows: Vec<Vec<u32>> = g["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| ids(&p["ids"]))
        .collect();
    let long: Vec<u32> = (0..5).flat_map(|k| rows[k % rows.len()].clone()).collect();
    assert!(long.len() > 128, "{}", long.len());
    rows.push(long);
    let bound = 2.0 * Reference::load("gguf-smollm2").bound("logits.0");
    crate::generation::check_capture("lean SmolLM2", &lean, &rows, &[2, 15, 27, 30], Some(bound));
}
