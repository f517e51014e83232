//! The committed Llama 3.1 tokenizer gives transformers' ids through the `tokenizers` crate.

use crate::util::fixtures;

#[test]
fn llama3_tokenizer_ids_match_transformers() {
    let dir = fixtures().join("llama3-tokenizer");
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("golden/llama3-tokenizer-ids.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        tok.get_vocab_size(true) as u64,
        golden["vocab_size"].as_u64().unwrap()
    );
    let cases = golden["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let ids = |key: &str| -> Vec<u32> {
            case[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect()
        };
        let plain = tok.encode(text, false).unwrap();
        assert_eq!(plain.get_ids(), ids("ids").as_slice(), "{text:?}");
        let special = tok.encode(text, true).unwrap();
        assert_eq!(
            special.get_ids(),
            ids("ids_with_special").as_slice(),
            "{text:?} (special)"
        );
        assert_eq!(
            tok.decode(plain.get_ids(), false).unwrap(),
            text,
            "{text:?} decode"
        );
    }
    assert_eq!(tok.token_to_id("<|eot_id|>"), Some(128_009));
    assert_eq!(tok.token_to_id("<|begin_of_text|>"), Some(128_000));
}
