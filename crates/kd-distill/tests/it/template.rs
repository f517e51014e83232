//! `data_args.template: qwen2_5` (ROLL's name) renders what a Qwen2.5 model's own chat template
//! renders, for the conversations ROLL's template handles (no tools).

use serde_json::Value;

use crate::fixtures;

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
    let roll = kd_distill::chat_tokenizer(&dir, Some("qwen2_5")).unwrap();
    let native = kd_distill::chat_tokenizer(&dir, Some("native")).unwrap();
    let mut compared = 0;
    for case in golden["cases"].as_array().unwrap() {
        // Text messages only: no tool calls, no other fields.
        let text_only = case["messages"].as_array().unwrap().iter().all(|m| {
            m.as_object()
                .unwrap()
                .keys()
                .all(|k| k == "role" || k == "content")
                && m["content"].is_string()
        });
        let plain = text_only
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
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
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
