//! The real model (SmolLM2-135M-Instruct, GGUF, fetched by fixtures/fetch-smollm2.sh) answers
//! through this project's own code: GGUF weights, GGUF tokenizer, its chat template, the
//! local teacher's greedy decoding.

use kd_data::{ChatTokenizer, Message};
use kd_model::Llama;
use kd_teacher::{FinishReason, LocalTeacher, Prompt, SamplingParams, Teacher, model_fingerprint};

use crate::fixtures;

#[test]
fn smollm2_says_the_capital_of_france_is_paris() {
    let path = fixtures().join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.is_file(),
        "{} is missing: run fixtures/fetch-smollm2.sh (the real-model tests need it)",
        path.display()
    );
    let model = Llama::load_for_inference(&path, &burn::tensor::Device::flex()).unwrap();
    assert!(model.has_packed_weights());
    let tokenizer = ChatTokenizer::from_gguf(&path).unwrap();
    let teacher = LocalTeacher::new(model, 1, model_fingerprint(&path).unwrap());
    let question = [Message::new("user", "What is the capital of France?")];
    let ids = tokenizer.encode_prompt(&question).unwrap();
    let params = SamplingParams {
        max_new_tokens: 24,
        ..SamplingParams::default()
    };
    let out = teacher
        .generate(&[Prompt { index: 0, ids }], &params)
        .unwrap();
    let answer = tokenizer.decode(&out[0].ids, true).unwrap();
    assert!(answer.contains("Paris"), "the answer was {answer:?}");
    assert_eq!(out[0].finish_reason, FinishReason::Stop, "{answer:?}");

    // The same ids as transformers' greedy generate from the same file.
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("golden/gguf/smollm2-logits.json")).unwrap(),
    )
    .unwrap();
    let want: Vec<u32> = golden["generate"]["new_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(out[0].ids, want, "{answer:?}");
}
