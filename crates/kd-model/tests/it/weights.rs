//! Loading, saving and reporting bad checkpoints.

use std::path::Path;

use kd_model::{Llama, ModelError, SaveDType, TokenBatch};

use crate::util::*;

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

fn batch() -> TokenBatch {
    TokenBatch::single(&[1, 17, 45, 200, 3])
}

#[test]
fn save_and_reload_is_exact() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["tiny-llama3", "tiny-tied", "tiny-sharded"] {
        let model = load(name);
        let before = to_vec(model.logits(&batch()).unwrap());
        let single = tmp.path().join(name);
        model.save(&single, SaveDType::F32).unwrap();
        assert!(single.join("model.safetensors").is_file());
        let again = Llama::load(&single, &cpu()).unwrap();
        assert_eq!(again.config().to_json(), model.config().to_json(), "{name}");
        assert_eq!(to_vec(again.logits(&batch()).unwrap()), before, "{name}");

        let sharded = tmp.path().join(format!("{name}-sharded"));
        model
            .save_sharded(&sharded, SaveDType::F32, 50_000)
            .unwrap();
        assert!(sharded.join("model.safetensors.index.json").is_file());
        assert!(!sharded.join("model.safetensors").exists());
        let again = Llama::load(&sharded, &cpu()).unwrap();
        assert_eq!(
            to_vec(again.logits(&batch()).unwrap()),
            before,
            "{name} sharded"
        );
    }
}

#[test]
fn bf16_save_matches_transformers_bf16_copy() {
    // Saving the f32 model as bf16 gives the same weights transformers' `.to(bfloat16)` gave.
    let tmp = tempfile::tempdir().unwrap();
    let model = load("tiny-llama3");
    model.save(tmp.path(), SaveDType::BF16).unwrap();
    let ours = Llama::load(tmp.path(), &cpu()).unwrap();
    let theirs = load("tiny-llama3-bf16");
    assert_eq!(
        to_vec(ours.logits(&batch()).unwrap()),
        to_vec(theirs.logits(&batch()).unwrap())
    );
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["torch_dtype"], "bfloat16");
    assert_eq!(cfg["rope_scaling"]["rope_type"], "llama3");
}

fn weights_error(dir: &Path) -> Vec<String> {
    match Llama::load(dir, &cpu()) {
        Err(ModelError::Weights { problems, .. }) => problems,
        Err(other) => panic!("expected a weights error, got {other}"),
        Ok(_) => panic!("expected a weights error, the model loaded"),
    }
}

#[test]
fn mismatched_checkpoints_name_every_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    copy_dir(&model_dir("tiny-llama3"), &dir);
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();

    // Two layers more than the checkpoint has: every missing tensor is listed with its shape.
    std::fs::write(
        dir.join("config.json"),
        config.replace("\"num_hidden_layers\": 3", "\"num_hidden_layers\": 5"),
    )
    .unwrap();
    let problems = weights_error(&dir);
    assert_eq!(problems.len(), 2 * 9, "{problems:#?}");
    assert!(
        problems.iter().any(|p| p.contains(
            "missing tensor `model.layers.4.self_attn.q_proj.weight` (expected shape [48, 48])"
        )),
        "{problems:#?}"
    );

    // One layer fewer: the extra tensors are unexpected.
    std::fs::write(
        dir.join("config.json"),
        config.replace("\"num_hidden_layers\": 3", "\"num_hidden_layers\": 2"),
    )
    .unwrap();
    let problems = weights_error(&dir);
    assert_eq!(problems.len(), 9, "{problems:#?}");
    assert!(
        problems
            .iter()
            .all(|p| p.starts_with("unexpected tensor `model.layers.2.")),
        "{problems:#?}"
    );

    // A different width: shapes are reported with both values.
    std::fs::write(
        dir.join("config.json"),
        config.replace("\"intermediate_size\": 128", "\"intermediate_size\": 64"),
    )
    .unwrap();
    let problems = weights_error(&dir);
    assert!(problems.iter().any(|p| p.contains("`model.layers.0.mlp.gate_proj.weight` has shape [128, 48], config.json implies [64, 48]")), "{problems:#?}");
    let msg = Llama::load(&dir, &cpu()).err().unwrap().to_string();
    assert!(msg.contains("does not match its configuration"), "{msg}");

    // Tied in config.json but the checkpoint holds an lm_head: accepted (transformers ties it).
    std::fs::write(
        dir.join("config.json"),
        config.replace(
            "\"tie_word_embeddings\": false",
            "\"tie_word_embeddings\": true",
        ),
    )
    .unwrap();
    let tied = Llama::load(&dir, &cpu()).unwrap();
    assert!(tied.lm_head.is_none());
}

#[test]
fn missing_and_broken_files() {
    let tmp = tempfile::tempdir().unwrap();
    let e = Llama::load(tmp.path(), &cpu()).err().unwrap().to_string();
    assert!(e.contains("config.json"), "{e}");
    std::fs::copy(
        model_dir("tiny-tied").join("config.json"),
        tmp.path().join("config.json"),
    )
    .unwrap();
    let e = Llama::load(tmp.path(), &cpu()).err().unwrap();
    assert!(matches!(e, ModelError::NoWeights { .. }), "{e}");
    assert!(e.to_string().contains("model.safetensors"), "{e}");
    std::fs::write(
        tmp.path().join("model.safetensors"),
        b"not a safetensors file",
    )
    .unwrap();
    let e = Llama::load(tmp.path(), &cpu()).err().unwrap().to_string();
    assert!(
        e.contains("invalid safetensors") && e.contains("model.safetensors"),
        "{e}"
    );
    // A shard named in the index but absent.
    let dir = tmp.path().join("sharded");
    copy_dir(&model_dir("tiny-sharded"), &dir);
    std::fs::remove_file(dir.join("model-00003-of-00006.safetensors")).unwrap();
    let e = Llama::load(&dir, &cpu()).err().unwrap().to_string();
    assert!(e.contains("model-00003-of-00006.safetensors"), "{e}");
}
