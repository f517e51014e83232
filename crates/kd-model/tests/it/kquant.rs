//! A model whose every matrix is a K-quant (Q4_K, Q5_K, Q6_K super-blocks) or a Q5_0/Q5_1
//! (llama.cpp's fallbacks for rows that are not multiples of 256) decodes lean from its
//! blocks, each layer on the host, as the f32 model the eager loader makes from the same file
//! computes (that loader's K-quant dequantisation is held to transformers' GGUF loader by
//! `gguf::packed_decoding_equals_the_f32_model` on fixtures/tiny-gguf/tiny.gguf).

use kd_gguf::{GgmlType, GgufWriter, Value};
use kd_model::{ForwardOptions, GenerateOptions, Llama, SeededPrompt, TokenBatch};

use crate::util::{avx2, cpu, lcg, to_vec};

const HIDDEN: usize = 256;
const FFN: usize = 512;
const VOCAB: usize = 320;
const LAYERS: usize = 2;

/// `[rows, cols]` random blocks with small f16 scales (and minimums), so that activations
/// stay in range through the layers.
fn random_blocks(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    next: &mut impl FnMut() -> u32,
) -> Vec<u8> {
    let (block, size) = ty.block().unwrap();
    let mut bytes: Vec<u8> = (0..rows * cols / block * size)
        .map(|_| next() as u8)
        .collect();
    let half = |v: f32| half::f16::from_f32(v).to_le_bytes();
    for b in bytes.chunks_exact_mut(size) {
        let d = ((next() % 1000) as f32 / 1000.0 + 0.5) * 2e-3;
        if ty == GgmlType::Q6K {
            b[208..210].copy_from_slice(&half(d));
        } else {
            b[0..2].copy_from_slice(&half(d));
        }
        if matches!(ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q5_1) {
            b[2..4].copy_from_slice(&half(d * 8.0));
        }
    }
    bytes
}

/// A 2-layer Llama of width 256 whose embedding (tied head) and projections are Q4_K, Q5_K,
/// Q6_K (layer 0) and Q5_0, Q5_1 (some of layer 1's), written as a GGUF file.
fn k_quant_gguf(path: &std::path::Path) {
    let mut next = lcg(99);
    let mut w = GgufWriter::new("llama");
    for (k, v) in [
        ("block_count", LAYERS),
        ("context_length", 256),
        ("embedding_length", HIDDEN),
        ("feed_forward_length", FFN),
        ("attention.head_count", 4),
        ("attention.head_count_kv", 2),
    ] {
        w.add(&format!("llama.{k}"), Value::U32(v as u32)).unwrap();
    }
    w.add("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5))
        .unwrap();
    let ones: Vec<u8> = (0..HIDDEN).flat_map(|_| 1f32.to_le_bytes()).collect();
    let mut tensor = |name: &str, ty: GgmlType, rows: usize, cols: usize| {
        let data = random_blocks(ty, rows, cols, &mut next);
        w.add_tensor(name, ty, &[rows, cols], data).unwrap();
    };
    tensor("token_embd.weight", GgmlType::Q6K, VOCAB, HIDDEN);
    let kv = HIDDEN / 2;
    for l in 0..LAYERS {
        let n = |m: &str| format!("blk.{l}.{m}.weight");
        let (q4k, q5k) = if l == 0 {
            (GgmlType::Q4K, GgmlType::Q5K)
        } else {
            (GgmlType::Q5_0, GgmlType::Q5_1)
        };
        tensor(&n("attn_q"), q4k, HIDDEN, HIDDEN);
        tensor(&n("attn_k"), q5k, kv, HIDDEN);
        tensor(&n("attn_v"), GgmlType::Q6K, kv, HIDDEN);
        tensor(&n("attn_output"), GgmlType::Q4K, HIDDEN, HIDDEN);
        tensor(&n("ffn_gate"), q5k, FFN, HIDDEN);
        tensor(&n("ffn_up"), q4k, FFN, HIDDEN);
        tensor(&n("ffn_down"), GgmlType::Q6K, HIDDEN, FFN);
    }
    for l in 0..LAYERS {
        for m in ["attn_norm", "ffn_norm"] {
            w.add_tensor(
                &format!("blk.{l}.{m}.weight"),
                GgmlType::F32,
                &[HIDDEN],
                ones.clone(),
            )
            .unwrap();
        }
    }
    w.add_tensor("output_norm.weight", GgmlType::F32, &[HIDDEN], ones)
        .unwrap();
    std::fs::write(path, w.to_bytes().unwrap()).unwrap();
}

#[test]
fn a_k_quant_and_q5_model_decodes_lean_from_its_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("k-quants.gguf");
    k_quant_gguf(&path);
    let dev = cpu();
    assert_eq!(
        Llama::packed_projections(&path).unwrap(),
        Some((LAYERS * 7, LAYERS * 7))
    );
    let lean = Llama::load_for_inference(&path, &dev).unwrap();
    let eager = Llama::load(&path, &dev).unwrap();
    // Built at every level; below AVX2 a pass does not use them (the logits below agree).
    assert!(lean.host_layers());
    let host = avx2();
    let ids: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % VOCAB as u32).collect();
    let logits = |m: &Llama| {
        let mut cache = m.new_cache();
        let pass = m
            .forward_cached(
                &TokenBatch::single(&ids),
                &mut cache,
                &ForwardOptions::default(),
            )
            .unwrap();
        to_vec(pass.into_logits().unwrap())
    };
    let (got, want) = (logits(&lean), logits(&eager));
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(scale > 1e-3, "logits of some size: {scale}");
    let d = got
        .iter()
        .zip(&want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    // The same weights bit for bit; only the order of the f32 sums differs.
    assert!(
        d <= 1e-4 * (1.0 + scale),
        "lean vs f32: max |Δ| {d} (logits up to {scale})"
    );
    let seeded = [SeededPrompt { ids: &ids, seed: 0 }];
    let mut options = GenerateOptions::greedy(8);
    options.stop_token_ids = vec![u32::MAX];
    assert_eq!(
        lean.generate(&seeded, &options).unwrap()[0].ids,
        eager.generate(&seeded, &options).unwrap()[0].ids
    );
    if host {
        assert_eq!(lean.f32_copies_made(), Some((0, LAYERS * 7 + 1)));
    } else {
        // Below AVX2 every pass reads the f32 copies, made from the blocks on first use.
        assert_eq!(
            lean.f32_copies_made(),
            Some((LAYERS * 7 + 1, LAYERS * 7 + 1))
        );
    }
    // 8-bit activations against the K-quant blocks: near the f32 logits (the rounding of
    // the activations to 8 bits is what differs).
    let int8 = lean.clone().with_int8_activations(true);
    assert!(int8.int8_activations());
    let d8 = logits(&int8)
        .iter()
        .zip(&want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(d8 <= 0.05 * (1.0 + scale), "int8 vs f32: max |Δ| {d8}");
}
