//! The committed Llama 3.1 and Qwen tokenizers give transformers' ids through the `tokenizers`
//! crate.

use crate::util::fixtures;

/// Encodes every case of `golden` (relative to fixtures/) with the tokenizer of `dir`, with and
/// without special tokens, and decodes the plain ids: the decoding must be the case's
/// `decoded` where the golden file has one (normalisation may change the text), else the text
/// itself. Returns the tokenizer, the golden file and how many decodings differ from the text.
fn check_ids(dir: &str, golden: &str) -> (tokenizers::Tokenizer, serde_json::Value, usize) {
    let tok =
        tokenizers::Tokenizer::from_file(fixtures().join(dir).join("tokenizer.json")).unwrap();
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join(golden)).unwrap()).unwrap();
    assert_eq!(
        tok.get_vocab_size(true) as u64,
        golden["vocab_size"].as_u64().unwrap()
    );
    let cases = golden["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    let mut differ = 0;
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
        let decoded = case.get("decoded").and_then(|d| d.as_str()).unwrap_or(text);
        assert_eq!(
            tok.decode(plain.get_ids(), false).unwrap(),
            decoded,
            "{text:?} decode"
        );
        differ += usize::from(decoded != text);
    }
    (tok, golden, differ)
}

#[test]
fn llama3_tokenizer_ids_match_transformers() {
    let (tok, _, differ) = check_ids("llama3-tokenizer", "golden/llama3-tokenizer-ids.json");
    assert_eq!(differ, 0);
    assert_eq!(tok.token_to_id("<|eot_id|>"), Some(128_009));
    assert_eq!(tok.token_to_id("<|begin_of_text|>"), Some(128_000));
}

#[test]
fn qwen_tokenizer_ids_match_transformers() {
    // fixtures/make_qwen_tokenizer_golden.py: Qwen3's tokenizer.json (Qwen2.5's BPE plus four
    // added tokens), 432 strings: ids with and without special tokens, and the decoded text
    // (which differs from the input where NFC normalisation changes it).
    let (tok, golden, differ) = check_ids("qwen2-tokenizer", "golden/qwen2-tokenizer-ids.json");
    assert!(golden["cases"].as_array().unwrap().len() >= 400);
    // The golden's own count of strings whose decoding is not the input (NFC, added tokens).
    let want = golden["checks"]["decode_differs_from_text"]
        .as_array()
        .unwrap()
        .len();
    assert_eq!(differ, want);
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(151_645));
    assert_eq!(tok.token_to_id("<|endoftext|>"), Some(151_643));
    assert_eq!(tok.token_to_id("<think>"), Some(151_667));
}
