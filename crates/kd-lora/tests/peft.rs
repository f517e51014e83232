//! The PEFT file format against PEFT's own files (`fixtures/tiny-adapters/peft-r4`, written by
//! PEFT 0.21.2 through `fixtures/make_peft_fixture.py`): what we read, what we write, and
//! each refusal naming its field.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kd_lora::{
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraConfig, PeftWeights, TargetModules, adapter_config_json,
    load_peft, save_peft,
};
use serde_json::Value;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-adapters/peft-r4")
}

/// Tensors of a safetensors file read without the safetensors crate: name → (shape, f32s).
fn raw_tensors(path: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut out = BTreeMap::new();
    for (name, t) in header.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        assert_eq!(t["dtype"], "F32", "{name}");
        let shape: Vec<usize> = t["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let (a, b) = (
            t["data_offsets"][0].as_u64().unwrap() as usize,
            t["data_offsets"][1].as_u64().unwrap() as usize,
        );
        let values = data[a..b]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        out.insert(name.clone(), (shape, values));
    }
    out
}

#[test]
fn reads_what_peft_wrote() {
    let a = load_peft(&fixture()).unwrap();
    assert_eq!(
        (a.config.r, a.config.alpha, a.config.dropout),
        (4, 8.0, 0.0)
    );
    assert!(!a.config.use_rslora);
    let TargetModules::Names(mut names) = a.config.target_modules.clone() else {
        panic!("PEFT wrote a list of names");
    };
    names.sort();
    assert_eq!(
        names,
        [
            "down_proj",
            "gate_proj",
            "k_proj",
            "o_proj",
            "q_proj",
            "up_proj",
            "v_proj"
        ]
    );
    assert_eq!(
        a.base_model.as_deref(),
        Some("fixtures/tiny-models/tiny-llama3")
    );
    let raw = raw_tensors(&fixture().join(ADAPTER_WEIGHTS));
    assert_eq!(a.modules.len() * 2, raw.len());
    for (module, w) in &a.modules {
        let (sa, va) = &raw[&format!("base_model.model.{module}.lora_A.weight")];
        let (sb, vb) = &raw[&format!("base_model.model.{module}.lora_B.weight")];
        assert_eq!(sa, &vec![w.r, w.d_in], "{module}");
        assert_eq!(sb, &vec![w.d_out, w.r], "{module}");
        assert_eq!((&w.a, &w.b), (va, vb), "{module}");
    }
    assert!(a.modules.contains_key("model.layers.0.self_attn.q_proj"));
}

#[test]
fn writes_what_peft_reads() {
    let peft = load_peft(&fixture()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    save_peft(
        dir.path(),
        &peft.config,
        "fixtures/tiny-models/tiny-llama3",
        &peft.modules,
    )
    .unwrap();
    // The same tensors under PEFT's names and shapes, byte for byte in value.
    assert_eq!(
        raw_tensors(&dir.path().join(ADAPTER_WEIGHTS)),
        raw_tensors(&fixture().join(ADAPTER_WEIGHTS))
    );
    assert_eq!(load_peft(dir.path()).unwrap(), peft);
    // Every field we write has PEFT's value for the same adapter (inference_mode aside:
    // PEFT's `save_pretrained` of a trained model writes true; checkpoints are trainable).
    let ours: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join(ADAPTER_CONFIG)).unwrap())
            .unwrap();
    let theirs: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join(ADAPTER_CONFIG)).unwrap())
            .unwrap();
    for (k, v) in ours.as_object().unwrap() {
        match k.as_str() {
            "inference_mode" => assert_eq!(v, false),
            "target_modules" => {
                let set = |v: &Value| {
                    let mut s: Vec<String> = v
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_str().unwrap().to_string())
                        .collect();
                    s.sort();
                    s
                };
                assert_eq!(set(v), set(&theirs[k]));
            }
            "lora_alpha" => assert_eq!(v.as_f64(), theirs[k].as_f64()),
            _ => assert_eq!(v, &theirs[k], "`{k}`"),
        }
    }
    let with_inference = adapter_config_json(&peft.config, "x", true);
    assert_eq!(with_inference["inference_mode"], true);
}

/// An edit of `adapter_config.json`.
type Edit = Box<dyn FnOnce(&mut serde_json::Map<String, Value>)>;

/// A copy of the fixture with `adapter_config.json` edited by `edit`.
fn edited(edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join(ADAPTER_CONFIG)).unwrap())
            .unwrap();
    edit(cfg.as_object_mut().unwrap());
    std::fs::write(dir.path().join(ADAPTER_CONFIG), cfg.to_string()).unwrap();
    std::fs::copy(
        fixture().join(ADAPTER_WEIGHTS),
        dir.path().join(ADAPTER_WEIGHTS),
    )
    .unwrap();
    dir
}

#[test]
fn unsupported_adapters_are_refused_by_field() {
    let cases: Vec<(&str, Edit)> = vec![
        (
            "peft_type",
            Box::new(|m| {
                m.insert("peft_type".into(), "IA3".into());
            }),
        ),
        (
            "use_dora",
            Box::new(|m| {
                m.insert("use_dora".into(), true.into());
            }),
        ),
        (
            "fan_in_fan_out",
            Box::new(|m| {
                m.insert("fan_in_fan_out".into(), true.into());
            }),
        ),
        (
            "bias",
            Box::new(|m| {
                m.insert("bias".into(), "all".into());
            }),
        ),
        (
            "rank_pattern",
            Box::new(|m| {
                m.insert("rank_pattern".into(), serde_json::json!({"q_proj": 8}));
            }),
        ),
        (
            "alpha_pattern",
            Box::new(|m| {
                m.insert("alpha_pattern".into(), serde_json::json!({"q_proj": 8}));
            }),
        ),
        (
            "`r`",
            Box::new(|m| {
                m.remove("r");
            }),
        ),
        (
            "lora_alpha",
            Box::new(|m| {
                m.insert("lora_alpha".into(), "eight".into());
            }),
        ),
        (
            "target_modules",
            Box::new(|m| {
                m.remove("target_modules");
            }),
        ),
    ];
    for (field, edit) in cases {
        let dir = edited(edit);
        let e = load_peft(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains(field) && e.contains(ADAPTER_CONFIG),
            "{field}: {e}"
        );
    }
    // A regex target is PEFT's string form.
    let dir = edited(|m| {
        m.insert("target_modules".into(), ".*proj".into());
    });
    assert_eq!(
        load_peft(dir.path()).unwrap().config.target_modules,
        TargetModules::Regex(".*proj".into())
    );
}

#[test]
fn broken_weights_are_named() {
    let config = LoraConfig {
        r: 2,
        alpha: 4.0,
        dropout: 0.0,
        target_modules: TargetModules::Names(vec!["q_proj".into()]),
        use_rslora: false,
    };
    let w = PeftWeights {
        a: vec![0.5; 2 * 3],
        b: vec![0.25; 5 * 2],
        r: 2,
        d_in: 3,
        d_out: 5,
    };
    let module = "model.layers.0.self_attn.q_proj".to_string();
    // A rank that is not the configuration's.
    let dir = tempfile::tempdir().unwrap();
    let modules = BTreeMap::from([(module.clone(), w.clone())]);
    save_peft(
        dir.path(),
        &LoraConfig {
            r: 3,
            ..config.clone()
        },
        "b",
        &modules,
    )
    .unwrap();
    let e = load_peft(dir.path()).unwrap_err().to_string();
    assert!(e.contains(&module) && e.contains("rank-3"), "{e}");
    // lora_A without lora_B: write the file by hand.
    let st = safetensors::serialize(
        [(
            format!("base_model.model.{module}.lora_A.weight"),
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 3], &[0u8; 24])
                .unwrap(),
        )],
        None,
    )
    .unwrap();
    std::fs::write(dir.path().join(ADAPTER_WEIGHTS), st).unwrap();
    save_peft(dir.path().join("cfg").as_path(), &config, "b", &modules).unwrap();
    std::fs::copy(
        dir.path().join("cfg").join(ADAPTER_CONFIG),
        dir.path().join(ADAPTER_CONFIG),
    )
    .unwrap();
    let e = load_peft(dir.path()).unwrap_err().to_string();
    assert!(e.contains("has lora_A but no lora_B"), "{e}");
    // Not a safetensors file.
    std::fs::write(dir.path().join(ADAPTER_WEIGHTS), b"not safetensors").unwrap();
    let e = load_peft(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains(ADAPTER_WEIGHTS) && e.contains("safetensors"),
        "{e}"
    );
    // No configuration at all.
    let empty = tempfile::tempdir().unwrap();
    let e = load_peft(empty.path()).unwrap_err().to_string();
    assert!(e.contains(ADAPTER_CONFIG), "{e}");
}
