//! EAGLE-3 drafts against `fixtures/eagle3/` (SpecForge's `LlamaForCausalLMEagle3` re-implemented
//! in PyTorch by `fixtures/make_eagle3_golden.py`): `fc`, three TTT steps' hidden outputs and
//! logits against the float64 reference, bounded by 3× the reference's own float32 spread; the
//! draft vocabulary by SpecForge's rule exactly; the export under SpecForge's names.

use std::collections::HashMap;
use std::path::PathBuf;

use burn::tensor::{DType, Int, Tensor, TensorData};
use kd_model::{DraftVocab, Eagle3Draft};
use safetensors::{Dtype, SafeTensors};

use crate::util::{avx2, cpu, fixtures};

/// Values of a safetensors file as f64 (floats, ints and bools alike), with shapes.
fn read(name: &str) -> HashMap<String, (Vec<usize>, Vec<f64>)> {
    let path: PathBuf = fixtures().join("eagle3").join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(k, v)| {
            let d = v.data();
            let values: Vec<f64> = match v.dtype() {
                Dtype::F64 => d
                    .chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
                Dtype::F32 => d
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                Dtype::I64 => d
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                Dtype::BOOL => d.iter().map(|&b| b as f64).collect(),
                other => panic!("{k}: unexpected dtype {other:?}"),
            };
            (k, (v.shape().to_vec(), values))
        })
        .collect()
}

fn draft() -> Eagle3Draft {
    Eagle3Draft::load(fixtures().join("eagle3"), None, &cpu()).unwrap()
}

fn host(t: Tensor<3>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

/// The fixture's input ids `[batch, seq]` and concatenated target features
/// `[batch, seq, 3·d]`.
fn fixture_inputs() -> (Tensor<2, Int>, Tensor<3>) {
    let inputs = read("inputs.safetensors");
    let device = cpu();
    let (ids_shape, ids) = &inputs["input_ids"];
    let ids = Tensor::<2, Int>::from_data(
        TensorData::new(
            ids.iter().map(|&v| v as i64).collect::<Vec<_>>(),
            [ids_shape[0], ids_shape[1]],
        ),
        &device,
    );
    let (shape, features) = &inputs["hidden_states"];
    let features = Tensor::<3>::from_data(
        TensorData::new(
            features.iter().map(|&v| v as f32).collect::<Vec<_>>(),
            [shape[0], shape[1], shape[2]],
        ),
        (&device, DType::F32),
    );
    (ids, features)
}

/// Max |ours − f64| over rows `t < rows` of `[batch, seq, width]` tensors, and the bound:
/// 3 × max |f32 − f64| of the reference itself.
fn compare(name: &str, ours: &[f32], rows: usize) -> (f64, f64) {
    let f64s = read("golden_f64.safetensors");
    let f32s = read("golden_f32.safetensors");
    let (shape, reference) = &f64s[name];
    let (_, reference32) = &f32s[name];
    let (seq, width) = (shape[1], shape[2]);
    let mut worst = 0.0f64;
    let mut spread = 0.0f64;
    for (i, (r, r32)) in reference.iter().zip(reference32).enumerate() {
        if (i / width) % seq >= rows {
            continue;
        }
        worst = worst.max((ours[i] as f64 - r).abs());
        spread = spread.max((r32 - r).abs());
    }
    let bound = 3.0 * spread;
    eprintln!(
        "{name}: max |Δ| vs float64 {worst:.3e} (bound {bound:.3e}, 3 × the reference's float32 spread over the same rows)"
    );
    (worst, bound)
}

#[test]
fn ttt_steps_match_specforge() {
    let draft = draft();
    let device = cpu();
    let (ids, features) = fixture_inputs();
    let seq = ids.dims()[1];

    let (worst, bound) = compare("fc_out", &host(draft.fuse(features.clone())), seq);
    assert!(worst <= bound, "fc_out: {worst} > {bound}");

    // The steps one by one, so that each step's hidden output is checked too.
    let mut cache = kd_model::eagle3::TttCache::new();
    let mut hidden = draft.fuse(features.clone());
    let mut step_ids = ids.clone();
    let mut logits = Vec::new();
    for k in 0..3 {
        if k > 0 {
            step_ids = Tensor::cat(
                vec![
                    step_ids.slice([0..2, 1..seq]),
                    Tensor::<2, Int>::zeros([2, 1], &device),
                ],
                1,
            );
        }
        hidden = draft.step(step_ids.clone(), hidden, &mut cache);
        // SpecForge's two attention backends differ on the last k rows of step k (rows that
        // no loss counts): compare the rows where they agree.
        let rows = seq - k;
        let (worst, bound) = compare(&format!("step{k}.hidden_out"), &host(hidden.clone()), rows);
        assert!(worst <= bound, "step {k} hidden: {worst} > {bound}");
        let l = host(draft.logits(hidden.clone()));
        let (worst, bound) = compare(&format!("step{k}.logits"), &l, rows);
        assert!(worst <= bound, "step {k} logits: {worst} > {bound}");
        logits.push(l);
    }
    // `unroll` is the same computation in one call.
    let unrolled = draft.unroll(ids, features, 3);
    for (k, (a, b)) in unrolled.into_iter().zip(&logits).enumerate() {
        assert_eq!(&host(a), b, "unroll step {k}");
    }
}

#[test]
fn draft_vocab_follows_specforge_rule() {
    let inputs = read("inputs.safetensors");
    let golden = read("golden_f64.safetensors");
    for case in ["a", "b"] {
        let counts: Vec<u64> = inputs[&format!("vocab.counts_{case}")]
            .1
            .iter()
            .map(|&c| c as u64)
            .collect();
        let vocab = DraftVocab::from_counts(&counts, 32).unwrap();
        let d2t: Vec<f64> = vocab.d2t().iter().map(|&v| v as f64).collect();
        let t2d: Vec<f64> = vocab.t2d().iter().map(|&v| v as u8 as f64).collect();
        assert_eq!(
            d2t,
            golden[&format!("vocab.d2t_{case}")].1,
            "d2t, case {case}"
        );
        assert_eq!(
            t2d,
            golden[&format!("vocab.t2d_{case}")].1,
            "t2d, case {case}"
        );
    }
    // The draft file's own mapping reads back to the same vocabulary.
    let draft = draft();
    let file = read("model.safetensors");
    let d2t: Vec<f64> = draft.vocab().d2t().iter().map(|&v| v as f64).collect();
    assert_eq!(d2t, file["d2t"].1);
    let t2d: Vec<f64> = draft
        .vocab()
        .t2d()
        .iter()
        .map(|&v| v as u8 as f64)
        .collect();
    assert_eq!(t2d, file["t2d"].1);
}

#[test]
fn export_names_and_values_are_specforge_s() {
    let draft = draft();
    let file = read("model.safetensors");
    let ours = draft.named_tensors();
    for (name, data) in &ours {
        let (shape, values) = file
            .get(name)
            .unwrap_or_else(|| panic!("{name} is not a SpecForge tensor name"));
        assert_eq!(&data.shape().to_vec(), shape, "{name}");
        let v: Vec<f64> = data
            .try_to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|&x| x as f64)
            .collect();
        assert_eq!(&v, values, "{name}");
    }
    // Everything but the mapping and the (target's) embedding is exported.
    let expected = file
        .keys()
        .filter(|k| !matches!(k.as_str(), "d2t" | "t2d" | "embed_tokens.weight"))
        .count();
    assert_eq!(ours.len(), expected);
}

#[test]
fn a_missing_embedding_is_named() {
    let dir = tempfile::tempdir().unwrap();
    fixture_without(dir.path(), "eagle3/config.json", "embed_tokens.weight");
    let err = Eagle3Draft::load(dir.path(), None, &cpu())
        .unwrap_err()
        .to_string();
    assert!(err.contains("embed_tokens.weight"), "{err}");
    // Given the target's embedding, it loads.
    let embedding = draft().embed_tokens.val();
    Eagle3Draft::load(dir.path(), Some(embedding), &cpu()).unwrap();
}

/// The fixture's draft written to `dir` without its tensor `left_out` (the embedding, as
/// SpecForge exports a draft, or another), with the configuration `config` (a path under
/// `fixtures/`).
fn fixture_without(dir: &std::path::Path, config: &str, left_out: &str) {
    fixture_edited(dir, config, left_out, None);
}

/// Writes into `dir` the `config` fixture as `config.json` and the fixture draft's tensors but
/// `left_out`, plus `added` (a name and a length: f32 zeros) when given.
fn fixture_edited(
    dir: &std::path::Path,
    config: &str,
    left_out: &str,
    added: Option<(&str, usize)>,
) {
    std::fs::copy(fixtures().join(config), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(fixtures().join("eagle3/model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let zeros = vec![0u8; 4 * added.map_or(0, |(_, n)| n)];
    let mut kept: Vec<_> = st
        .tensors()
        .into_iter()
        .filter(|(k, _)| k != left_out)
        .collect();
    if let Some((name, n)) = added {
        let view = safetensors::tensor::TensorView::new(Dtype::F32, vec![n], &zeros).unwrap();
        kept.push((name.to_string(), view));
    }
    safetensors::serialize_to_file(kept, None, &dir.join("model.safetensors")).unwrap();
}

/// The `speculators` directory `out` holds the tensors of `theirs_dir`, bit for bit, and every
/// configuration value speculators wrote there but its provenance and the tensors and keys
/// named in `besides`.
fn same_as_speculators(out: &std::path::Path, theirs_dir: &std::path::Path, besides: &[&str]) {
    let (ours, theirs) = (
        std::fs::read(out.join("model.safetensors")).unwrap(),
        std::fs::read(theirs_dir.join("model.safetensors")).unwrap(),
    );
    let (ours, theirs) = (
        SafeTensors::deserialize(&ours).unwrap(),
        SafeTensors::deserialize(&theirs).unwrap(),
    );
    let sorted = |st: &SafeTensors| {
        let mut n: Vec<String> = st
            .names()
            .into_iter()
            .filter(|n| !besides.contains(n))
            .map(String::from)
            .collect();
        n.sort();
        n
    };
    assert_eq!(sorted(&ours), sorted(&theirs));
    for name in sorted(&theirs) {
        let (a, b) = (ours.tensor(&name).unwrap(), theirs.tensor(&name).unwrap());
        assert_eq!(a.dtype(), b.dtype(), "{name}");
        assert_eq!(a.shape(), b.shape(), "{name}");
        assert!(a.data() == b.data(), "{name}: values differ");
    }

    let json = |p: std::path::PathBuf| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    let (ours, theirs) = (
        json(out.join("config.json")),
        json(theirs_dir.join("config.json")),
    );
    // Provenance and settings with no bearing on the draft: versions, the config class's
    // module for `trust_remote_code` (vLLM parses the JSON itself), training flags at their
    // defaults, a padding id for an embedding the draft does not carry.
    let provenance: Vec<&str> = [
        "speculators_version",
        "transformers_version",
        "dtype",
        "auto_map",
        "embed_requires_grad",
        "tie_word_embeddings",
        "pad_token_id",
    ]
    .into_iter()
    .chain(besides.iter().copied())
    .collect();
    fn same(path: &str, theirs: &serde_json::Value, ours: &serde_json::Value, skip: &[&str]) {
        match theirs {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    if skip.contains(&k.as_str()) {
                        continue;
                    }
                    let at = format!("{path}.{k}");
                    let mine = ours
                        .get(k)
                        .unwrap_or_else(|| panic!("{at} missing from the export"));
                    same(&at, v, mine, skip);
                }
            }
            serde_json::Value::Array(items) => {
                let mine = ours.as_array().unwrap_or_else(|| panic!("{path}"));
                assert_eq!(items.len(), mine.len(), "{path}");
                for (i, (a, b)) in items.iter().zip(mine).enumerate() {
                    same(&format!("{path}[{i}]"), a, b, skip);
                }
            }
            serde_json::Value::Number(n) => {
                let a = n.as_f64().unwrap();
                let b = ours
                    .as_f64()
                    .unwrap_or_else(|| panic!("{path}: ours {ours}"));
                assert!(a == b, "{path}: speculators {a}, ours {b}");
            }
            // `null` target_hidden_size means the draft's width, which the export states.
            serde_json::Value::Null if path == ".target_hidden_size" => {}
            _ => assert_eq!(theirs, ours, "{path}"),
        }
    }
    same("", &theirs, &ours, &provenance);
    assert_eq!(
        ours["target_hidden_size"],
        theirs["transformer_layer_config"]["hidden_size"]
    );
}

/// `export --to vllm` against vLLM's own `speculators` library (0.9.0):
/// `fixtures/eagle3/speculators/converted/` is what its converter wrote for the same
/// SpecForge-layout draft (`fixtures/make_speculators_golden.py`, which also ran its model
/// class on that directory and on this export: the SpecForge goldens within 4e-6). The export
/// holds the same tensors, bit for bit, and every configuration value speculators wrote but
/// its provenance; reading the converter's output back gives the fixture's draft.
#[test]
fn a_vllm_export_is_what_speculators_writes() {
    use kd_model::eagle3::{Eagle3Format, export_eagle3};
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("specforge");
    std::fs::create_dir(&src).unwrap();
    // The fixture naming its feature layers, as SpecForge writes them.
    fixture_without(
        &src,
        "eagle3/speculators/specforge-config.json",
        "embed_tokens.weight",
    );
    let out = tmp.path().join("vllm");
    let verifier = test_verifier();
    export_eagle3(&src, &out, &Eagle3Format::Speculators(verifier)).unwrap();
    let theirs_dir = fixtures().join("eagle3/speculators/converted");
    same_as_speculators(&out, &theirs_dir, &[]);

    // Reading speculators' file back: the fixture's draft, the feature layers as written.
    let embedding = draft().embed_tokens.val();
    let loaded = Eagle3Draft::load(&theirs_dir, Some(embedding), &cpu()).unwrap();
    assert_eq!(loaded.config().aux_layers, Some([2, 4, 6]));
    assert_eq!(loaded.vocab(), draft().vocab());
    let original = draft().named_tensors();
    for (name, data) in loaded.named_tensors() {
        assert_eq!(original[&name], data, "{name}");
    }
}

/// `w` `[in, out]` rounded to Q8_0 blocks along `in` (as `with_q8_0_weights` stores it) and
/// back to f32.
fn q8_0_values(w: Tensor<2>) -> Tensor<2> {
    let [input, out] = w.dims();
    let device = w.device();
    let rows: Vec<f32> = w.transpose().into_data().try_to_vec::<f32>().unwrap();
    let blocks = kd_gguf::quantize_q8_0(&rows).unwrap();
    let mut back = vec![0f32; rows.len()];
    kd_gguf::dequantize(kd_gguf::GgmlType::Q8_0, &blocks, &mut back).unwrap();
    Tensor::<2>::from_data(TensorData::new(back, [out, input]), &device).transpose()
}

#[test]
fn decoding_reads_the_q8_0_weights_and_step_0_matches_specforge() {
    let inputs = read("inputs.safetensors");
    let device = cpu();
    let (ids_shape, ids) = &inputs["input_ids"];
    let (shape, features) = &inputs["hidden_states"];
    let (batch, seq) = (ids_shape[0], ids_shape[1]);
    let ids = Tensor::<2, Int>::from_data(
        TensorData::new(
            ids.iter().map(|&v| v as i64).collect::<Vec<_>>(),
            [batch, seq],
        ),
        &device,
    );
    let features = Tensor::<3>::from_data(
        TensorData::new(
            features.iter().map(|&v| v as f32).collect::<Vec<_>>(),
            [shape[0], shape[1], shape[2]],
        ),
        (&device, DType::F32),
    );
    // Each row decoded through the cache, as speculative decoding runs the draft.
    let decode = |d: &Eagle3Draft| -> (Vec<f32>, Vec<f32>) {
        let mut hidden = Vec::new();
        let mut logits = Vec::new();
        for b in 0..batch {
            let mut cache = kd_model::eagle3::DraftKvCache::new();
            let h = d.forward_cached(
                ids.clone().slice([b..b + 1, 0..seq]),
                d.fuse_decoding(features.clone().slice([b..b + 1, 0..seq])),
                &mut cache,
            );
            logits.push(d.logits_decoding(h.clone()));
            hidden.push(h);
        }
        (host(Tensor::cat(hidden, 0)), host(Tensor::cat(logits, 0)))
    };

    // f32 weights: the decoding kernels compute SpecForge's step 0.
    let plain = draft();
    assert!(!plain.has_q8_0_weights());
    let (hidden, logits) = decode(&plain);
    let (worst, bound) = compare("step0.hidden_out", &hidden, seq);
    assert!(worst <= bound, "decoded hidden: {worst} > {bound}");
    let (worst, bound) = compare("step0.logits", &logits, seq);
    assert!(worst <= bound, "decoded logits: {worst} > {bound}");

    // Q8_0 blocks: the product with the rounded weights, up to f32 summation order.
    let q8 = draft().with_q8_0_weights(true);
    assert!(q8.has_q8_0_weights());
    let mut rounded = draft();
    for p in [
        &mut rounded.fc,
        &mut rounded.q_proj,
        &mut rounded.k_proj,
        &mut rounded.v_proj,
        &mut rounded.o_proj,
        &mut rounded.gate_proj,
        &mut rounded.up_proj,
        &mut rounded.down_proj,
        &mut rounded.lm_head,
    ] {
        *p = burn::module::Param::from_tensor(q8_0_values(p.val()));
    }
    let (q_hidden, q_logits) = decode(&q8);
    if !avx2() {
        // Below AVX2 (`KD_SIMD=scalar`) the blocks stand down: the f32 weights are read.
        assert_eq!((q_hidden, q_logits), (hidden, logits));
        return;
    }
    let (r_hidden, r_logits) = decode(&rounded);
    let max_diff = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    };
    let scale = |a: &[f32]| a.iter().map(|x| x.abs()).fold(0f32, f32::max);
    assert!(max_diff(&q_hidden, &r_hidden) <= 1e-5 * scale(&r_hidden).max(1.0));
    assert!(max_diff(&q_logits, &r_logits) <= 1e-5 * scale(&r_logits).max(1.0));
    // ... which are not the f32 weights (the blocks are what was read), and stay near them.
    let moved = max_diff(&q_logits, &logits);
    assert!(
        moved > 0.0 && moved < 0.05 * scale(&logits),
        "Q8_0 moved the logits by {moved} (scale {})",
        scale(&logits)
    );
    // Dropping the blocks returns to the f32 weights.
    assert_eq!(decode(&q8.with_q8_0_weights(false)).1, logits);
}

/// Decoding on the host (the default with Q8_0 blocks) against the same draft on Burn's
/// operations: a prefill too wide for the host (40 positions, Burn's path on both, its cache
/// taken over by the host), then passes of 1–3 positions with rollbacks between them, as
/// speculative rounds run; every hidden output and logit agrees to f32 rounding, and the
/// caches hold the same positions.
/// The verifier the speculators fixtures name (`fixtures/eagle3/speculators/verifier`).
fn test_verifier() -> kd_model::eagle3::SpeculatorsVerifier {
    kd_model::eagle3::SpeculatorsVerifier {
        name_or_path: "fixtures/eagle3/speculators/verifier".into(),
        architectures: vec!["LlamaForCausalLM".into()],
        speculative_tokens: 3,
    }
}

/// `draft`'s three TTT steps on the fixture's inputs against speculators' logits for the same
/// draft (`fixtures/eagle3/speculators/<name>/logits.safetensors`), within 2e-5.
fn unrolls_as_speculators(draft: &Eagle3Draft, name: &str) {
    let (ids, features) = fixture_inputs();
    let reference = read(&format!("speculators/{name}/logits.safetensors"));
    for (k, logits) in draft.unroll(ids, features, 3).into_iter().enumerate() {
        let (_, theirs) = &reference[&format!("step{k}.logits")];
        let ours = host(logits);
        assert_eq!(ours.len(), theirs.len(), "{name} step {k}");
        let worst = ours
            .iter()
            .zip(theirs)
            .fold(0f64, |m, (a, b)| m.max((*a as f64 - b).abs()));
        eprintln!("{name} step {k}: max |ours − speculators| {worst:.2e}");
        assert!(worst <= 2e-5, "{name} step {k}: {worst}");
    }
}

/// A variant of the fixture's draft as vLLM's `speculators` wrote it
/// (`fixtures/eagle3/speculators/<name>/`), read with the fixture's embedding.
fn speculators_draft(name: &str) -> Eagle3Draft {
    let dir = fixtures().join("eagle3/speculators").join(name);
    Eagle3Draft::load(dir, Some(draft().embed_tokens.val()), &cpu()).unwrap()
}

/// `variant`, a draft speculators wrote (`fixtures/eagle3/speculators/<name>/`), survives a
/// checkpoint (`checkpoint/` in the returned directory); `--to vllm` writes speculators'
/// tensors bit for bit (its embedding left out) and every configuration value it wrote but
/// provenance and `architectures` (its `save_pretrained` names the model class, its converter
/// `Eagle3Speculator`); `--to sglang` is refused with a message holding each of `refusal`,
/// writing nothing.
fn checkpoints_and_exports_as_speculators(
    variant: &Eagle3Draft,
    name: &str,
    refusal: &[&str],
) -> tempfile::TempDir {
    use kd_model::eagle3::{Eagle3Format, export_eagle3};
    let tmp = tempfile::tempdir().unwrap();
    let checkpoint = tmp.path().join("checkpoint");
    variant.save(&checkpoint).unwrap();
    let again = Eagle3Draft::load(&checkpoint, Some(draft().embed_tokens.val()), &cpu()).unwrap();
    assert_eq!(again.named_tensors(), variant.named_tensors());
    assert_eq!(again.config(), variant.config());
    let vllm = tmp.path().join("vllm");
    export_eagle3(
        &checkpoint,
        &vllm,
        &Eagle3Format::Speculators(test_verifier()),
    )
    .unwrap();
    let theirs = fixtures().join("eagle3/speculators").join(name);
    same_as_speculators(&vllm, &theirs, &["embed_tokens.weight", "architectures"]);
    let e = export_eagle3(
        &checkpoint,
        &tmp.path().join("sglang"),
        &Eagle3Format::SpecForge,
    )
    .unwrap_err()
    .to_string();
    for part in refusal {
        assert!(e.contains(part), "{e}");
    }
    assert!(!tmp.path().join("sglang").exists());
    tmp
}

/// A draft whose decoder layer adds its normalised hidden input as the residual
/// (`norm_before_residual`, as Red Hat's speculators drafts have it), read from the
/// `speculators` layout: its three TTT steps' logits against speculators' own on the same
/// inputs (`make_speculators_golden.py`; they differ from the plain draft's by up to 3.3); the
/// setting survives a checkpoint, `--to vllm` writes what speculators' converter wrote, and
/// `--to sglang` is refused by name, since SGLang's layer has only the raw residual.
#[test]
fn a_norm_before_residual_draft_computes_what_speculators_computes() {
    let nbr = speculators_draft("norm-before-residual");
    assert!(nbr.config().norm_before_residual);
    assert!(!draft().config().norm_before_residual);
    unrolls_as_speculators(&nbr, "norm-before-residual");
    checkpoints_and_exports_as_speculators(&nbr, "norm-before-residual", &["norm_before_residual"]);
}

/// A draft over the target's whole vocabulary as speculators stores one, without `d2t` and
/// `t2d` (`fixtures/eagle3/speculators/full-vocab/`): read with the identity map, its logits
/// over all 96 tokens are speculators' own, `--to vllm` writes it back as speculators wrote
/// it, and `--to sglang` writes the identity maps SpecForge's layout always has. A smaller
/// draft without `d2t` is an error naming it.
#[test]
fn a_whole_vocabulary_draft_without_maps_reads_and_exports() {
    use kd_model::eagle3::{Eagle3Format, export_eagle3};
    let dir = fixtures().join("eagle3/speculators/full-vocab");
    let full = speculators_draft("full-vocab");
    assert_eq!(full.vocab().target_ids(), (0..96).collect::<Vec<u32>>());
    unrolls_as_speculators(&full, "full-vocab");
    let tmp = tempfile::tempdir().unwrap();
    let verifier = test_verifier();
    export_eagle3(
        &dir,
        &tmp.path().join("vllm"),
        &Eagle3Format::Speculators(verifier),
    )
    .unwrap();
    same_as_speculators(&tmp.path().join("vllm"), &dir, &[]);
    // SpecForge's layout always holds the maps (its exporter requires them): the identity.
    export_eagle3(&dir, &tmp.path().join("sglang"), &Eagle3Format::SpecForge).unwrap();
    let bytes = std::fs::read(tmp.path().join("sglang/model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("d2t").unwrap().data(), &[0u8; 8 * 96][..]);
    assert_eq!(st.tensor("t2d").unwrap().data(), &[1u8; 96][..]);
    let again = Eagle3Draft::load(
        tmp.path().join("sglang"),
        Some(draft().embed_tokens.val()),
        &cpu(),
    )
    .unwrap();
    assert_eq!(again.named_tensors(), full.named_tensors());

    // The fixture's 32-token draft without its map.
    let small = tmp.path().join("small");
    std::fs::create_dir(&small).unwrap();
    fixture_without(&small, "eagle3/config.json", "d2t");
    let e = Eagle3Draft::load(&small, None, &cpu())
        .unwrap_err()
        .to_string();
    assert!(e.contains("d2t"), "{e}");
}

/// A draft whose decoder layer is Qwen3's (speculators' `Qwen3DecoderEagle3FirstLayer`: each
/// query and key head RMS-normalised before RoPE), as speculators itself saved one, its
/// layer configuration without `model_type` (speculators' default, Qwen3's): its three TTT
/// steps' logits against speculators' own (they differ from the Llama layer's by up to 3.7);
/// it survives a checkpoint; `--to vllm` writes speculators' tensors bit for bit (its
/// embedding left out) and its layer configuration; `--to sglang` and `--to gguf` are refused
/// by name, since neither SGLang's layer nor llama.cpp's has the norms. A `model_type:
/// "qwen3"` draft without them, and a tensor the draft would not read, are errors naming the
/// tensor.
#[test]
fn a_qwen3_layer_draft_computes_what_speculators_computes() {
    use kd_model::eagle3::{GgufWeightType, export_eagle3_gguf};
    let qwen3 = speculators_draft("qwen3-layer");
    assert!(qwen3.config().llama.qk_norm());
    assert!(qwen3.q_norm.is_some() && qwen3.k_norm.is_some());
    assert!(draft().q_norm.is_none());
    unrolls_as_speculators(&qwen3, "qwen3-layer");
    let tmp =
        checkpoints_and_exports_as_speculators(&qwen3, "qwen3-layer", &["model_type", "q_norm"]);
    let checkpoint = tmp.path().join("checkpoint");
    let e = export_eagle3_gguf(
        &checkpoint,
        &fixtures().join("tiny-gguf/tiny.gguf"),
        &tmp.path().join("draft.gguf"),
        GgufWeightType::F32,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("model_type") && e.contains("q_norm"), "{e}");
    assert!(!tmp.path().join("draft.gguf").exists());

    // SpecForge's layout saying `qwen3` without the norms (SpecForge's layer is Llama's).
    let bare = tmp.path().join("bare");
    std::fs::create_dir(&bare).unwrap();
    fixture_without(&bare, "eagle3/config.json", "embed_tokens.weight");
    let config = std::fs::read_to_string(bare.join("config.json")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&config).unwrap();
    json["model_type"] = "qwen3".into();
    std::fs::write(bare.join("config.json"), json.to_string()).unwrap();
    let e = Eagle3Draft::load(&bare, Some(draft().embed_tokens.val()), &cpu())
        .unwrap_err()
        .to_string();
    assert!(e.contains("midlayer.self_attn.q_norm.weight"), "{e}");
    // A tensor the draft would not read: named, not skipped.
    let extra = tmp.path().join("extra");
    std::fs::create_dir(&extra).unwrap();
    fixture_edited(
        &extra,
        "eagle3/config.json",
        "",
        Some(("midlayer.self_attn.q_proj.bias", 64)),
    );
    let e = Eagle3Draft::load(&extra, None, &cpu())
        .unwrap_err()
        .to_string();
    assert!(e.contains("midlayer.self_attn.q_proj.bias"), "{e}");
}

/// A draft that RMS-normalises the concatenated target features before `fc`
/// (`norm_before_fc`, its weight `input_norm.weight`; nvidia's gpt-oss EAGLE-3 drafts have
/// it), as speculators saved one (`fixtures/eagle3/speculators/norm-before-fc/`): its three TTT
/// steps' logits against speculators' own (they differ from the plain draft's by up to 4.9);
/// decoding's `fuse_decoding` applies the norm too; a checkpoint keeps it; `--to vllm` writes
/// speculators' tensors bit for bit; `--to gguf` writes llama.cpp's `eagle3.norm_before_fc`
/// and `enc.output_norm.weight` (its converter's `conversion/llama.py`); `--to sglang` is
/// refused by name.
#[test]
fn a_norm_before_fc_draft_computes_what_speculators_computes() {
    use kd_gguf::GgufFile;
    use kd_model::eagle3::{GgufWeightType, export_eagle3_gguf};
    let normed = speculators_draft("norm-before-fc");
    assert!(normed.config().norm_before_fc && normed.input_norm.is_some());
    assert!(draft().input_norm.is_none());
    unrolls_as_speculators(&normed, "norm-before-fc");
    let (_, features) = fixture_inputs();
    let (a, b) = (
        host(normed.fuse(features.clone())),
        host(normed.fuse_decoding(features.clone())),
    );
    let worst = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(worst <= 1e-5, "fuse_decoding against fuse: {worst}");
    // The norm matters: without it `fc` gives something else.
    let plain = host(draft().fuse(features));
    let apart = a
        .iter()
        .zip(&plain)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(apart > 0.1, "{apart}");

    let tmp =
        checkpoints_and_exports_as_speculators(&normed, "norm-before-fc", &["norm_before_fc"]);

    // llama.cpp's layout, on a draft that fits the tiny GGUF target.
    let src = tmp.path().join("tiny-draft");
    let fresh = draft_over_tiny_gguf(&src, [1, 2, 2]);
    let mut config = fresh.config().clone();
    config.norm_before_fc = true;
    let width = 3 * config.target_hidden_size;
    let weights: Vec<f32> = (0..width)
        .map(|i| 1.0 + (i as f32 * 0.71).sin() / 2.0)
        .collect();
    let mut with_norm = Eagle3Draft::new(
        config,
        fresh.vocab().clone(),
        fresh.embed_tokens.val(),
        7,
        &cpu(),
    )
    .unwrap();
    with_norm.input_norm = Some(burn::module::Param::from_tensor(Tensor::from_data(
        TensorData::new(weights.clone(), [width]),
        &cpu(),
    )));
    with_norm.save(&src).unwrap();
    let path = tmp.path().join("draft.gguf");
    let target = fixtures().join("tiny-gguf/tiny.gguf");
    export_eagle3_gguf(&src, &target, &path, GgufWeightType::Q8_0).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.opt_bool("eagle3.norm_before_fc").unwrap(), Some(true));
    assert_eq!(
        f.tensor("enc.output_norm.weight").unwrap().shape(),
        vec![width]
    );
    assert_eq!(f.dequantize("enc.output_norm.weight").unwrap(), weights);
}

#[test]
fn host_decoding_follows_the_burn_path() {
    host_decoding_follows_the_burn_path_of(draft());
    host_decoding_follows_the_burn_path_of(speculators_draft("norm-before-residual"));
    host_decoding_follows_the_burn_path_of(speculators_draft("qwen3-layer"));
}

fn host_decoding_follows_the_burn_path_of(draft: Eagle3Draft) {
    let q8 = draft.with_q8_0_weights(true);
    let burn = q8.clone().with_host_decoding(false);
    let device = cpu();
    let d = q8.config().llama.hidden_size;
    let ids = |from: usize, n: usize| {
        let v: Vec<i64> = (from..from + n).map(|i| (i * 7 % 90 + 3) as i64).collect();
        Tensor::<2, Int>::from_data(TensorData::new(v, [1, n]), &device)
    };
    let hidden = |from: usize, n: usize| {
        let v: Vec<f32> = (0..n * d)
            .map(|i| ((from * d + i) as f32 * 0.37).sin() * 1.5)
            .collect();
        Tensor::<3>::from_data(TensorData::new(v, [1, n, d]), &device)
    };
    // (keep the first `keep` positions, then run `n` new ones)
    let steps = [
        (0, 40),
        (40, 1),
        (41, 2),
        (42, 1),
        (42, 3),
        (44, 1),
        (40, 2),
        (42, 1),
    ];
    let (mut a, mut b) = (
        kd_model::eagle3::DraftKvCache::new(),
        kd_model::eagle3::DraftKvCache::new(),
    );
    let mut worst = 0f32;
    for (i, &(keep, n)) in steps.iter().enumerate() {
        a.truncate(keep);
        b.truncate(keep);
        assert_eq!(a.len(), keep, "step {i}");
        let ha = q8.forward_cached(ids(keep, n), hidden(keep, n), &mut a);
        let hb = burn.forward_cached(ids(keep, n), hidden(keep, n), &mut b);
        assert_eq!((a.len(), b.len()), (keep + n, keep + n), "step {i}");
        let la = host(q8.logits_decoding(ha.clone()));
        let lb = host(burn.logits_decoding(hb.clone()));
        for (x, y) in [(host(ha), host(hb)), (la, lb)] {
            assert_eq!(x.len(), y.len(), "step {i}");
            let scale = y.iter().fold(1f32, |m, v| m.max(v.abs()));
            let diff = x
                .iter()
                .zip(&y)
                .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            worst = worst.max(diff / scale);
            assert!(diff <= 2e-5 * scale, "step {i}: {diff} (scale {scale})");
        }
    }
    eprintln!("host against Burn: worst |Δ| / scale {worst:.2e}");
    if !avx2() {
        // Below AVX2 the blocks, and so the host path, stand down: the same operations.
        assert_eq!(worst, 0.0);
    }
}

/// llama.cpp's name of each SpecForge tensor (its converter's `conversion/llama.py` and
/// `src/models/eagle3.cpp`), with the head count of the Q/K permutation.
const LLAMA_CPP_NAMES: [(&str, &str, Option<usize>); 13] = [
    ("fc.weight", "fc.weight", None),
    (
        "midlayer.input_layernorm.weight",
        "blk.0.attn_norm.weight",
        None,
    ),
    (
        "midlayer.hidden_norm.weight",
        "blk.0.attn_norm_2.weight",
        None,
    ),
    (
        "midlayer.self_attn.q_proj.weight",
        "blk.0.attn_q.weight",
        Some(4),
    ),
    (
        "midlayer.self_attn.k_proj.weight",
        "blk.0.attn_k.weight",
        Some(2),
    ),
    (
        "midlayer.self_attn.v_proj.weight",
        "blk.0.attn_v.weight",
        None,
    ),
    (
        "midlayer.self_attn.o_proj.weight",
        "blk.0.attn_output.weight",
        None,
    ),
    (
        "midlayer.post_attention_layernorm.weight",
        "blk.0.ffn_norm.weight",
        None,
    ),
    (
        "midlayer.mlp.gate_proj.weight",
        "blk.0.ffn_gate.weight",
        None,
    ),
    ("midlayer.mlp.up_proj.weight", "blk.0.ffn_up.weight", None),
    (
        "midlayer.mlp.down_proj.weight",
        "blk.0.ffn_down.weight",
        None,
    ),
    ("norm.weight", "output_norm.weight", None),
    ("lm_head.weight", "output.weight", None),
];

/// A fresh draft over the tiny GGUF target (96 wide, 3 layers, 1024 tokens, 4 heads, 2 KV
/// heads), saved in SpecForge's layout.
fn draft_over_tiny_gguf(dir: &std::path::Path, aux: [usize; 3]) -> Eagle3Draft {
    let device = cpu();
    let target = kd_model::Llama::load(fixtures().join("tiny-gguf/tiny.gguf"), &device).unwrap();
    let mut config = kd_model::Eagle3Config::for_target(target.config(), 64).unwrap();
    config.aux_layers = Some(aux);
    let counts: Vec<u64> = (0..1024u64).map(|i| (i * 7919) % 101).collect();
    let vocab = DraftVocab::from_counts(&counts, 64).unwrap();
    let draft =
        Eagle3Draft::new(config, vocab, target.embed_tokens.weight.val(), 7, &device).unwrap();
    draft.save(dir).unwrap();
    draft
}

#[test]
fn a_draft_exports_as_llama_cpp_s_eagle3_gguf() {
    use kd_gguf::{GgmlType, GgufFile, Value};
    use kd_model::{eagle3::GgufWeightType, eagle3::export_eagle3_gguf, gguf::unpermute_rows};

    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("draft");
    let draft = draft_over_tiny_gguf(&src, [1, 2, 2]);
    let target_path = fixtures().join("tiny-gguf/tiny.gguf");
    let target = GgufFile::open(&target_path).unwrap();
    let ours = draft.named_tensors();
    for (ty, name) in [
        (GgufWeightType::F32, "f32"),
        (GgufWeightType::F16, "f16"),
        (GgufWeightType::Q8_0, "q8_0"),
    ] {
        let path = dir.path().join(format!("draft-{name}.gguf"));
        export_eagle3_gguf(&src, &target_path, &path, ty).unwrap();
        let f = GgufFile::open(&path).unwrap();
        assert_eq!(f.str("general.architecture").unwrap(), "eagle3");
        for (key, want) in [
            ("eagle3.block_count", 1),
            ("eagle3.embedding_length", 96),
            ("eagle3.feed_forward_length", 256),
            ("eagle3.attention.head_count", 4),
            ("eagle3.attention.head_count_kv", 2),
            ("eagle3.attention.key_length", 24),
            ("eagle3.target_hidden_size", 96),
            ("eagle3.context_length", 512),
            ("eagle3.vocab_size", 1024),
        ] {
            assert_eq!(f.uint(key).unwrap(), want, "{key}");
        }
        assert_eq!(
            f.opt_ints("eagle3.target_layers").unwrap(),
            Some(vec![1, 2, 2])
        );
        assert_eq!(
            f.opt_bool("eagle3.norm_before_residual").unwrap(),
            Some(false)
        );
        assert_eq!(f.opt_bool("eagle3.norm_before_fc").unwrap(), Some(false));
        assert_eq!(f.opt_float("eagle3.rope.freq_base").unwrap(), Some(10000.0));
        // The target's tokenizer, every key of it.
        let tokenizer = |g: &GgufFile| -> Vec<(String, Value)> {
            g.metadata()
                .iter()
                .filter(|(k, _)| k.starts_with("tokenizer."))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        };
        assert_eq!(tokenizer(&f), tokenizer(&target));
        assert!(tokenizer(&f).len() >= 8);

        let mut names: Vec<&str> = f.tensors().iter().map(|t| t.name.as_str()).collect();
        names.sort_unstable();
        let mut want: Vec<&str> = LLAMA_CPP_NAMES.iter().map(|(_, g, _)| *g).collect();
        want.push("d2t");
        want.sort_unstable();
        assert_eq!(names, want, "{name}");
        for (specforge, gguf, heads) in LLAMA_CPP_NAMES {
            let data = &ours[specforge];
            let shape = data.shape().to_vec();
            let t = f.tensor(gguf).unwrap();
            assert_eq!(t.shape(), shape, "{gguf}");
            let expected_ty = match (shape.len(), ty) {
                (1, _) | (_, GgufWeightType::F32) => GgmlType::F32,
                (_, GgufWeightType::F16) => GgmlType::F16,
                (_, GgufWeightType::Q8_0) => GgmlType::Q8_0,
            };
            assert_eq!(t.ty, expected_ty, "{gguf}");
            let mut values = f.dequantize(gguf).unwrap();
            if let Some(h) = heads {
                values = unpermute_rows(&values, &shape, h).unwrap();
            }
            let want: Vec<f32> = data.try_to_vec::<f32>().unwrap();
            // f32 exactly; f16 to its rounding (half an ulp: 2⁻¹¹ relative, 2⁻²⁵ near zero);
            // Q8_0 to half a step of the block (weights are N(0, 0.02²), so |w| < 0.12 and a
            // step < 0.001).
            for (i, (a, b)) in values.iter().zip(&want).enumerate() {
                let tol = match expected_ty {
                    GgmlType::F32 => 0.0,
                    GgmlType::F16 => b.abs() / 2048.0 + 3e-8,
                    _ => 1e-3,
                };
                assert!((a - b).abs() <= tol, "{name} {gguf}[{i}]: {a} vs {b}");
            }
            if heads.is_some() && ty == GgufWeightType::F32 {
                // The rows really are permuted (the un-permuted file differs from the raw one).
                assert_ne!(f.dequantize(gguf).unwrap(), want, "{gguf}");
            }
        }
        // d2t as absolute target ids.
        let d2t: Vec<i64> = f
            .tensor_bytes("d2t")
            .unwrap()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let ids: Vec<i64> = draft
            .vocab()
            .target_ids()
            .iter()
            .map(|&t| t as i64)
            .collect();
        assert_eq!(d2t, ids);
    }
    // A draft with `norm_before_residual` says so to llama.cpp.
    let config_path = src.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["norm_before_residual"] = true.into();
    std::fs::write(&config_path, config.to_string()).unwrap();
    let path = dir.path().join("draft-nbr.gguf");
    export_eagle3_gguf(&src, &target_path, &path, GgufWeightType::F32).unwrap();
    assert_eq!(
        GgufFile::open(&path)
            .unwrap()
            .opt_bool("eagle3.norm_before_residual")
            .unwrap(),
        Some(true)
    );
}

#[test]
fn a_gguf_export_names_what_does_not_fit_the_target() {
    use kd_model::{eagle3::GgufWeightType, eagle3::export_eagle3_gguf};

    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("draft");
    draft_over_tiny_gguf(&src, [1, 2, 2]);
    let out = dir.path().join("out/draft.gguf");
    // A target of another width (48).
    let other = fixtures().join("tiny-gguf/tiny-llama3.gguf");
    let e = export_eagle3_gguf(&src, &other, &out, GgufWeightType::F16)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("target_hidden_size") && e.contains("96") && e.contains("embedding_length 48"),
        "{e}"
    );
    // Feature layers outside the target's 3 layers.
    let src3 = dir.path().join("draft3");
    draft_over_tiny_gguf(&src3, [1, 2, 3]);
    let tiny = fixtures().join("tiny-gguf/tiny.gguf");
    let e = export_eagle3_gguf(&src3, &tiny, &out, GgufWeightType::F16)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("eagle_aux_hidden_state_layer_ids")
            && e.contains("layer 3")
            && e.contains("block_count"),
        "{e}"
    );
    // Not a GGUF target.
    let e = export_eagle3_gguf(&src, &src.join("config.json"), &out, GgufWeightType::F16)
        .unwrap_err()
        .to_string();
    assert!(e.contains("config.json"), "{e}");
    assert!(!out.exists(), "nothing written on an error");
}

/// A draft whose output layer starts from the target's gives, before training, the target's
/// own logits over the draft vocabulary: its `lm_head(norm(h))` equals the target's final
/// norm and LM head on the same hidden states, at the columns the vocabulary names. A lean
/// target (reading the head's rows from its blocks) starts the same head, bit for bit.
#[test]
fn a_draft_head_started_from_the_target_gives_the_target_s_logits() {
    let device = cpu();
    let path = fixtures().join("tiny-gguf/tiny.gguf");
    let target = kd_model::Llama::load(&path, &device).unwrap();
    let lean = kd_model::Llama::load_for_inference(&path, &device).unwrap();
    let counts: Vec<u64> = (0..1024u64).map(|i| (i * 7919) % 101).collect();
    let vocab = DraftVocab::from_counts(&counts, 64).unwrap();
    let fresh = || {
        let config = kd_model::Eagle3Config::for_target(target.config(), 64).unwrap();
        Eagle3Draft::new(
            config,
            vocab.clone(),
            target.embed_tokens.weight.val(),
            7,
            &device,
        )
        .unwrap()
    };
    let random = fresh();
    let draft = fresh().with_target_head(&target).unwrap();
    let from_lean = fresh().with_target_head(&lean).unwrap();
    assert_eq!(
        draft.lm_head.val().into_data(),
        from_lean.lm_head.val().into_data()
    );
    assert_ne!(
        draft.lm_head.val().into_data(),
        random.lm_head.val().into_data()
    );

    device.seed(8);
    let h = Tensor::<3>::random(
        [2, 3, 96],
        burn::tensor::Distribution::Normal(0.0, 1.0),
        (&device, DType::F32),
    );
    let ours = host(draft.logits(h.clone()));
    let full = host(target.lm_head_forward(target.norm.forward(h)));
    let scale = full.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(scale > 0.1, "the target's logits are not all near zero");
    for row in 0..6 {
        for (j, &t) in vocab.target_ids().iter().enumerate() {
            let (a, b) = (ours[row * 64 + j], full[row * 1024 + t as usize]);
            assert!(
                (a - b).abs() <= 1e-5 * scale,
                "row {row}, draft token {j} (target {t}): {a} vs the target's {b}"
            );
        }
    }

    // A draft over another vocabulary does not take this target's head.
    let mut config = kd_model::Eagle3Config::for_target(target.config(), 64).unwrap();
    config.llama.vocab_size = 2048;
    let counts: Vec<u64> = (0..2048u64).map(|i| (i * 7919) % 101).collect();
    let other = Eagle3Draft::new(
        config,
        DraftVocab::from_counts(&counts, 64).unwrap(),
        Tensor::<2>::zeros([2048, 96], (&device, DType::F32)),
        9,
        &device,
    )
    .unwrap();
    let err = other.with_target_head(&target).unwrap_err().to_string();
    assert!(err.contains("1024") && err.contains("2048"), "{err}");
}
