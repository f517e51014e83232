//! Tokenizers built from GGUF metadata give transformers' ids
//! (`AutoTokenizer.from_pretrained(dir, gguf_file=…)`, fixtures/make_gguf_golden.py): the
//! committed tiny file and the real SmolLM2-135M-Instruct file (fixtures/fetch-smollm2.sh).

use std::path::PathBuf;

use kd_data::{ChatTemplate, ChatTokenizer};

use crate::fixtures;

fn smollm2() -> PathBuf {
    let p = fixtures().join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "{} is missing: run fixtures/fetch-smollm2.sh (the real-model tests need it)",
        p.display()
    );
    p
}

fn golden(name: &str) -> serde_json::Value {
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

/// Checks every string and conversation of a golden set; returns (strings, conversations).
fn check(
    tok: &ChatTokenizer,
    g: &serde_json::Value,
    skip: impl Fn(&str) -> bool,
) -> (usize, usize) {
    let mut strings = 0;
    for case in g["strings"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        if skip(text) {
            continue;
        }
        assert_eq!(
            tok.encode(text, true).unwrap(),
            ids(&case["ids"]),
            "{text:?}"
        );
        assert_eq!(
            tok.encode(text, false).unwrap(),
            ids(&case["ids_plain"]),
            "{text:?} (plain)"
        );
        strings += 1;
    }
    let template: &ChatTemplate = tok.template().expect("the file has a chat template");
    let mut conversations = 0;
    for case in g["conversations"].as_array().unwrap() {
        let messages = &case["messages"];
        let gen_prompt = case["add_generation_prompt"].as_bool().unwrap();
        let text = template
            .render_json(messages, gen_prompt, &Default::default())
            .unwrap();
        assert_eq!(text, case["text"].as_str().unwrap(), "{messages}");
        assert_eq!(
            tok.encode(&text, false).unwrap(),
            ids(&case["ids"]),
            "{messages}"
        );
        conversations += 1;
    }
    (strings, conversations)
}

#[test]
fn smollm2_gguf_tokenizer_matches_transformers() {
    let tok = ChatTokenizer::from_gguf(smollm2()).unwrap();
    let g = golden("smollm2-tokenizer.json");
    assert_eq!(
        tok.vocab_size() as u64,
        g["special"]["len"].as_u64().unwrap()
    );
    for (name, id) in [("<|im_start|>", 1), ("<|im_end|>", 2), ("<|endoftext|>", 0)] {
        assert_eq!(tok.token_id(name), Some(id), "{name}");
    }
    let (strings, conversations) = check(&tok, &g, |_| false);
    assert!(
        strings >= 200 && conversations >= 24,
        "{strings} strings, {conversations} conversations"
    );
}

#[test]
fn tiny_gguf_tokenizer_matches_transformers() {
    let path = fixtures().join("tiny-gguf/tiny.gguf");
    let tok = ChatTokenizer::from_gguf(&path).unwrap();
    let g = &golden("tiny.json")["tokenizer"];
    // transformers' GPT2Tokenizer adds its default `<|endoftext|>` as a 1025th token outside
    // the model's 1024-row embedding; we build only the file's vocabulary, so text containing
    // that string is not comparable.
    assert_eq!(g["special"]["len"], 1025);
    assert_eq!(tok.vocab_size(), 1024);
    let (strings, conversations) = check(&tok, g, |t| t.contains("<|endoftext|>"));
    assert!(
        strings >= 39 && conversations >= 6,
        "{strings} strings, {conversations} conversations"
    );
}

#[test]
fn gguf_tokenizer_saves_as_hugging_face_files() {
    let tok = ChatTokenizer::from_gguf(fixtures().join("tiny-gguf/tiny.gguf")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    tok.save(dir.path()).unwrap();
    let back = ChatTokenizer::from_dir(dir.path()).unwrap();
    let g = &golden("tiny.json")["tokenizer"];
    let (strings, conversations) = check(&back, g, |t| t.contains("<|endoftext|>"));
    assert!(strings >= 39 && conversations >= 6);
    // A directory holding only the .gguf file is read through its metadata.
    let only = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixtures().join("tiny-gguf/tiny.gguf"),
        only.path().join("m.gguf"),
    )
    .unwrap();
    assert_eq!(
        ChatTokenizer::from_dir(only.path()).unwrap().vocab_size(),
        1024
    );
}
