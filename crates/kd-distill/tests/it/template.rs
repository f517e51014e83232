//! `data_args.template: qwen2_5` (ROLL's name) renders what a Qwen2.5 model's own chat template
//! renders, for the conversations ROLL's template handles (no tools).

use serde_json::Value;

use crate::fixtures;

/// Whether a golden case's messages are plain text (role and content only).
fn text_only(case: &Value) -> bool {
    case["messages"].as_array().unwrap().iter().all(|m| {
        m.as_object()
            .unwrap()
            .keys()
            .all(|k| k == "role" || k == "content")
            && m["content"].is_string()
    })
}

/// A golden case's token ids.
fn ids(case: &Value) -> Vec<u32> {
    case["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn qwen2_5_template_is_the_models_own_chatml() {
    // fixtures/make_qwen_chat_template_golden.py: Qwen2.5-7B-Instruct's template through
    // transformers' apply_chat_template, with Qwen3's tokenizer (the same ids for text without
    // Qwen3's four added tokens).
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("golden/qwen-chat-templates.json")).unwrap(),
    )
    .unwrap();
    let dir = fixtures().join("qwen2-tokenizer");
    let roll = kd_distill::phases::chat_tokenizer(&dir, Some("qwen2_5")).unwrap();
    let native = kd_distill::phases::chat_tokenizer(&dir, Some("native")).unwrap();
    let mut compared = 0;
    for case in golden["cases"].as_array().unwrap() {
        // Text messages only: no tool calls, no other fields.
        let plain = text_only(case)
            && case["template"] == "Qwen-Qwen2.5-7B-Instruct"
            && case["extra"].as_object().is_some_and(|m| m.is_empty())
            && case.get("error").is_none()
            && case["qwen25_tokenizer_would_differ"] == false;
        let messages: Option<Vec<kd_data::Message>> =
            serde_json::from_value(case["messages"].clone()).ok();
        let Some(messages) = messages.filter(|m| {
            plain
                && m.iter()
                    .all(|m| matches!(m.role.as_str(), "system" | "user" | "assistant"))
        }) else {
            continue;
        };
        let agp = case["add_generation_prompt"].as_bool().unwrap();
        let want = ids(case);
        let name = case["name"].as_str().unwrap();
        assert_eq!(roll.encode_chat(&messages, agp).unwrap(), want, "{name}");
        compared += 1;
    }
    assert!(compared >= 20, "{compared} cases compared");
    // The tokenizer's own template (Qwen3's) differs from Qwen2.5's only where thinking or
    // tools come in; `native` keeps it.
    assert!(
        native
            .template()
            .unwrap()
            .source()
            .contains("enable_thinking")
    );
}

/// `chat_template_kwargs` (beyond ROLL's keys, as vLLM and SGLang take it) reaches the
/// template: with `+chat_template_kwargs.enable_thinking=false` the run renders Qwen3's
/// non-thinking turns as transformers' `apply_chat_template(..., enable_thinking=False)` does.
#[test]
fn chat_template_kwargs_reach_the_template() {
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("golden/qwen-chat-templates.json")).unwrap(),
    )
    .unwrap();
    let dir = fixtures().join("qwen2-tokenizer");
    let yaml = fixtures().join("../examples/distill/demo.yaml");
    let loaded = kd_distill::load(
        Some(&yaml),
        &["+chat_template_kwargs.enable_thinking=false".to_string()],
    )
    .unwrap();
    assert_eq!(
        loaded.config.chat_template_kwargs.get("enable_thinking"),
        Some(&Value::Bool(false))
    );
    let off = kd_distill::phases::run_tokenizer(&loaded.config, &dir).unwrap();
    let default = kd_distill::phases::chat_tokenizer(&dir, Some("native")).unwrap();
    let mut compared = 0;
    for case in golden["cases"].as_array().unwrap() {
        if case["template"] != "Qwen-Qwen3-0.6B"
            || case["extra"].as_object().map(|m| m.len()) != Some(1)
            || case["extra"]["enable_thinking"] != Value::Bool(false)
            || case.get("error").is_some()
            // Text messages only (no reasoning_content, tools or other fields).
            || !text_only(case)
        {
            continue;
        }
        let Ok(messages) =
            serde_json::from_value::<Vec<kd_data::Message>>(case["messages"].clone())
        else {
            continue;
        };
        let agp = case["add_generation_prompt"].as_bool().unwrap();
        let want = ids(case);
        let name = case["name"].as_str().unwrap();
        assert_eq!(off.encode_chat(&messages, agp).unwrap(), want, "{name}");
        if agp {
            // The empty think block is the variable's doing.
            assert_ne!(default.encode_chat(&messages, agp).unwrap(), want, "{name}");
        }
        compared += 1;
    }
    assert!(compared >= 5, "{compared} cases compared");
}
