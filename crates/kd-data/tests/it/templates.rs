//! Every golden case renders to transformers' text and ids, with both templates.

use std::collections::BTreeMap;

use kd_data::{ChatTemplate, ChatTokenizer, special_tokens};
use serde_json::Value;

use crate::fixtures;

#[test]
fn chat_templates_match_transformers() {
    // fixtures/make_chat_template_golden.py: Llama 3.x and other templates, Llama 3.1 tokenizer.
    check_golden("golden/chat-templates.json", "llama3-tokenizer", 6);
}

#[test]
fn qwen_chat_templates_match_transformers() {
    // fixtures/make_qwen_chat_template_golden.py: Qwen2.5-Instruct's and Qwen3's own templates
    // (Qwen3's `enable_thinking` true, false and absent; tools), Qwen3's tokenizer.
    check_golden("golden/qwen-chat-templates.json", "qwen2-tokenizer", 4);
}

/// Renders every case of a golden file (`golden`, relative to fixtures/) with its template and
/// the tokenizer directory's special tokens, and compares text and ids; `want_errors` is the
/// number of cases the golden file expects to be refused.
fn check_golden(golden: &str, tokenizer: &str, want_errors: usize) {
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join(golden)).unwrap()).unwrap();
    let dir = fixtures().join(tokenizer);
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap())
            .unwrap();
    let specials = special_tokens(&config);
    let base = ChatTokenizer::from_dir(&dir).unwrap();
    let mut templates = BTreeMap::new();
    for (name, path) in golden["templates"].as_object().unwrap() {
        let source =
            std::fs::read_to_string(fixtures().join("..").join(path.as_str().unwrap())).unwrap();
        templates.insert(
            name.clone(),
            ChatTemplate::new(&source, specials.clone()).unwrap(),
        );
    }
    let (mut ok, mut errors) = (0, 0);
    for case in golden["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let template = &templates[case["template"].as_str().unwrap()];
        let extra: BTreeMap<String, Value> = case["extra"]
            .as_object()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        let agp = case["add_generation_prompt"].as_bool().unwrap();
        let messages = &case["messages"];
        let rendered = template.render_json(messages, agp, &extra);
        if case.get("error").and_then(Value::as_bool) == Some(true) {
            // Refused as transformers refuses it: the template's own `raise_exception` message
            // (a TemplateError), or the empty conversation apply_chat_template rejects before
            // rendering (a ValueError).
            let e = rendered.expect_err(name).to_string();
            let want = case["error_message"].as_str().unwrap();
            match case["error_type"].as_str().unwrap() {
                "TemplateError" => assert!(e.contains(want), "{name}: {e} (want {want})"),
                "ValueError" => {
                    assert!(want.contains("empty conversation"), "{name}: {want}");
                    assert!(e.contains("empty conversation"), "{name}: {e}");
                }
                other => panic!("{name}: unexpected golden error type {other}"),
            }
            errors += 1;
            continue;
        }
        let text = rendered.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            text,
            case["text"].as_str().unwrap(),
            "{name} ({}, agp={agp})",
            case["template"]
        );
        let ids = base.encode(&text, false).unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ids, want, "{name} ids");
        ok += 1;
    }
    let golden_errors = golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c.get("error").and_then(Value::as_bool) == Some(true))
        .count();
    assert_eq!(golden_errors, want_errors, "the golden file's error cases");
    assert!(
        ok >= 100 && errors == golden_errors,
        "{ok} rendered, {errors} errors"
    );
}

#[test]
fn tokenizer_dir_template_gives_apply_chat_template_ids() {
    // The tokenizer's own template through the high-level API.
    let tok = ChatTokenizer::from_dir(fixtures().join("llama3-tokenizer")).unwrap();
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("golden/chat-templates.json")).unwrap(),
    )
    .unwrap();
    let case = golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| {
            c["template"] == "llama3-tokenizer-config"
                && c["add_generation_prompt"] == true
                && c["name"] == "system_user"
        })
        .expect("a system_user case");
    let messages: Vec<kd_data::Message> = serde_json::from_value(case["messages"].clone()).unwrap();
    let ids = tok.encode_prompt(&messages).unwrap();
    let want: Vec<u32> = case["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(ids, want);
}

#[test]
fn template_variables_reach_the_template() {
    // Qwen3's own template (its tokenizer_config.json) with `enable_thinking: false` set once
    // on the tokenizer gives the golden case rendered with that variable; unset, the template's
    // default (thinking on) gives the case rendered without it.
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("golden/qwen-chat-templates.json")).unwrap(),
    )
    .unwrap();
    let cases = golden["cases"].as_array().unwrap();
    let find = |extra: Value| {
        cases
            .iter()
            .find(|c| {
                c["template"] == "Qwen-Qwen3-0.6B"
                    && c["add_generation_prompt"] == true
                    && c["name"] == "system_user"
                    && c["extra"] == extra
            })
            .unwrap_or_else(|| panic!("a system_user case with extra {extra}"))
    };
    let ids = |case: &Value| -> Vec<u32> {
        case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    let off = find(serde_json::json!({"enable_thinking": false}));
    let default = find(serde_json::json!({}));
    assert_ne!(ids(off), ids(default), "the flag changes the prompt");
    let messages: Vec<kd_data::Message> = serde_json::from_value(off["messages"].clone()).unwrap();
    let tok = ChatTokenizer::from_dir(fixtures().join("qwen2-tokenizer")).unwrap();
    assert_eq!(tok.encode_prompt(&messages).unwrap(), ids(default));
    let source = tok.template().unwrap().identity();
    let vars = BTreeMap::from([("enable_thinking".to_string(), Value::Bool(false))]);
    let tok = tok.with_template_variables(&vars).unwrap();
    assert_eq!(tok.encode_prompt(&messages).unwrap(), ids(off));
    assert_ne!(
        tok.template().unwrap().identity(),
        source,
        "cache keys see the variable"
    );
    let bad = BTreeMap::from([("messages".to_string(), Value::Null)]);
    let e = tok.with_template_variables(&bad).unwrap_err().to_string();
    assert!(e.contains("`messages`"), "{e}");
}
