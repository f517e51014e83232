//! Every golden case renders to transformers' text and ids, with both templates.

use std::collections::BTreeMap;

use kd_data::{ChatTemplate, ChatTokenizer, special_tokens};
use serde_json::Value;

use crate::fixtures;

#[test]
fn chat_templates_match_transformers() {
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("golden/chat-templates.json")).unwrap(),
    )
    .unwrap();
    let dir = fixtures().join("llama3-tokenizer");
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
    assert_eq!(golden_errors, 6, "the golden file's error cases");
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
