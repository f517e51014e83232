//! The tokenizer a GGUF file describes, built as transformers' GGUF loader builds it
//! (`transformers.integrations.gguf.gguf_tokenizer_mapping`): a byte-level BPE from
//! `tokenizer.ggml.tokens` and `tokenizer.ggml.merges`, control tokens (type 3) as special
//! added tokens, user-defined ones (type 4) as plain added tokens, the pre-tokenizer's split
//! chosen by `tokenizer.ggml.pre`, BOS prepended when `tokenizer.ggml.add_bos_token` says so,
//! and the chat template from `tokenizer.chat_template`.
//!
//! Only `tokenizer.ggml.model = "gpt2"` (byte-level BPE: Llama 3, SmolLM, Qwen, …) is
//! supported; sentencepiece vocabularies (`"llama"`) are refused with that reason.

use std::collections::BTreeMap;
use std::path::Path;
use std::str::FromStr;

use kd_gguf::GgufFile;
use serde_json::{Value, json};

use crate::error::{DataError, Result};
use crate::template::ChatTemplate;

/// llama.cpp's token type for control tokens (`<|im_start|>`).
const CONTROL: i64 = 3;
/// llama.cpp's token type for user-defined added tokens (`<think>`).
const USER_DEFINED: i64 = 4;

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The split regex transformers uses for a `tokenizer.ggml.pre` value; `None` keeps GPT-2's
/// byte-level regex (SmolLM's `smollm`, `default`, `gpt2`, …).
fn split_regex(pre: &str) -> Option<&'static str> {
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" | "dbrx" | "smaug-bpe" => LLAMA3_SPLIT,
        "tekken" => TEKKEN_SPLIT,
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => QWEN2_SPLIT,
        "qwen35" => QWEN35_SPLIT,
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => GPT4O_SPLIT,
        _ => return None,
    })
}

/// GPT-2's byte → character table (`bytes_to_unicode`).
fn byte_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        table[b as usize] = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).expect("256..=323 are characters")
        };
    }
    table
}

/// The tokenizer, chat template and special tokens of a GGUF file.
pub(crate) struct GgufTokenizer {
    pub tokenizer: tokenizers::Tokenizer,
    pub template: Option<ChatTemplate>,
    /// `bos_token`, `eos_token`, `unk_token`, `pad_token` → their text.
    pub special_tokens: BTreeMap<String, String>,
    pub add_bos_token: bool,
}

fn gguf_err(e: kd_gguf::GgufError) -> DataError {
    DataError::Tokenizer(e.to_string())
}

/// Builds the tokenizer of a GGUF file.
pub(crate) fn from_gguf(path: &Path) -> Result<GgufTokenizer> {
    let g = GgufFile::open(path).map_err(gguf_err)?;
    let file = path.display();
    let model = g.str("tokenizer.ggml.model").map_err(gguf_err)?;
    if model != "gpt2" {
        return Err(DataError::Tokenizer(format!(
            "{file}: metadata key `tokenizer.ggml.model` is `{model}`: only byte-level BPE \
             vocabularies (`gpt2`: Llama 3, SmolLM, Qwen, …) are supported; use the model's \
             tokenizer.json instead"
        )));
    }
    let tokens = g.strings("tokenizer.ggml.tokens").map_err(gguf_err)?;
    let merges = match g.get("tokenizer.ggml.merges") {
        Some(_) => g.strings("tokenizer.ggml.merges").map_err(gguf_err)?,
        None => {
            return Err(DataError::Tokenizer(format!(
                "{file}: metadata key `tokenizer.ggml.merges` is missing: a byte-level BPE \
                 vocabulary needs its merges"
            )));
        }
    };
    let types = g
        .opt_ints("tokenizer.ggml.token_type")
        .map_err(gguf_err)?
        .unwrap_or_default();
    if !types.is_empty() && types.len() != tokens.len() {
        return Err(DataError::Tokenizer(format!(
            "{file}: `tokenizer.ggml.token_type` has {} entries for {} tokens",
            types.len(),
            tokens.len()
        )));
    }

    let (vocab, merges) = bpe_model(&tokens, &merges, &file)?;
    let added = added_tokens(&tokens, &types, &vocab);

    let token_text = |key: &str| -> Result<Option<(String, u32)>> {
        let Some(id) = g
            .opt_uint(&format!("tokenizer.ggml.{key}_token_id"))
            .map_err(gguf_err)?
        else {
            return Ok(None);
        };
        match tokens.get(id as usize) {
            Some(t) => Ok(Some((t.to_string(), id as u32))),
            None => Err(DataError::Tokenizer(format!(
                "{file}: `tokenizer.ggml.{key}_token_id` is {id}, outside the {}-token \
                 vocabulary",
                tokens.len()
            ))),
        }
    };
    let bos = token_text("bos")?;
    let add_bos = g
        .opt_bool("tokenizer.ggml.add_bos_token")
        .map_err(gguf_err)?
        .unwrap_or(false);
    let add_eos = g
        .opt_bool("tokenizer.ggml.add_eos_token")
        .map_err(gguf_err)?
        .unwrap_or(false);
    let eos = token_text("eos")?;
    let mut special_tokens = BTreeMap::new();
    for (name, key) in [
        ("bos_token", "bos"),
        ("eos_token", "eos"),
        ("unk_token", "unknown"),
        ("pad_token", "padding"),
    ] {
        if let Some((text, _)) = token_text(key)? {
            special_tokens.insert(name.to_string(), text);
        }
    }

    let pre = g.opt_str("tokenizer.ggml.pre").map_err(gguf_err)?;
    let pre_tokenizer = pre_tokenizer(pre);
    let post_processor = post_processor(
        bos.as_ref().filter(|_| add_bos),
        eos.as_ref().filter(|_| add_eos),
    );
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": merges,
        },
    });
    let tokenizer = tokenizers::Tokenizer::from_str(&spec.to_string())
        .map_err(|e| DataError::Tokenizer(format!("{file}: building its tokenizer: {e}")))?;
    let template = match g.opt_str("tokenizer.chat_template").map_err(gguf_err)? {
        Some(source) => Some(ChatTemplate::new(source, special_tokens.clone())?),
        None => None,
    };
    tracing::debug!(
        path = %path.display(),
        tokens = tokens.len(),
        added = added.len(),
        pre = pre.unwrap_or("(none)"),
        "built tokenizer from GGUF metadata"
    );
    Ok(GgufTokenizer {
        tokenizer,
        template,
        special_tokens,
        add_bos_token: add_bos,
    })
}

/// The BPE model's vocabulary (each token spelled in GPT-2's byte alphabet) and merges.
fn bpe_model(
    tokens: &[&str],
    merges: &[&str],
    file: &std::path::Display<'_>,
) -> Result<(serde_json::Map<String, Value>, Vec<Value>)> {
    let alphabet = byte_alphabet();
    let mut vocab = serde_json::Map::new();
    for (id, t) in tokens.iter().enumerate() {
        let key = if spelled(t, &alphabet) {
            t.to_string()
        } else {
            t.bytes().map(|b| alphabet[b as usize]).collect()
        };
        vocab.insert(key, id.into());
    }
    let merges: Vec<Value> = merges
        .iter()
        .enumerate()
        .map(|(i, m)| match m.split_once(' ') {
            Some((a, b)) => Ok(json!([a, b])),
            None => Err(DataError::Tokenizer(format!(
                "{file}: `tokenizer.ggml.merges` entry {i} ({m:?}) is not two tokens separated \
                 by a space"
            ))),
        })
        .collect::<Result<_>>()?;
    Ok((vocab, merges))
}

/// Whether a token is spelled in GPT-2's byte alphabet.
fn spelled(t: &str, alphabet: &[char; 256]) -> bool {
    t.chars().all(|c| alphabet.contains(&c))
}

/// The added tokens: control tokens (special) and user-defined ones (plain).
fn added_tokens(
    tokens: &[&str],
    types: &[i64],
    vocab: &serde_json::Map<String, Value>,
) -> Vec<Value> {
    let alphabet = byte_alphabet();
    let mut added = Vec::new();
    for (id, (t, &ty)) in tokens.iter().zip(types).enumerate() {
        // A control token spelled outside the byte alphabet is a llama.cpp mislabel that
        // transformers skips (adding it would grow the vocabulary).
        let special = ty == CONTROL && spelled(t, &alphabet);
        let user = ty == USER_DEFINED && vocab.contains_key(*t);
        if special || user {
            added.push(json!({
                "id": id, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": special,
            }));
        }
    }
    added
}

/// The pre-tokenizer: `tokenizer.ggml.pre`'s split regex then byte-level, or GPT-2's.
fn pre_tokenizer(pre: Option<&str>) -> Value {
    match pre.and_then(split_regex) {
        Some(regex) => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        ]}),
        None => json!({
            "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true,
        }),
    }
}

/// transformers' `update_post_processor`: `bos $A eos` (each part when enabled).
fn post_processor(bos: Option<&(String, u32)>, eos: Option<&(String, u32)>) -> Value {
    let piece =
        |t: &(String, u32), type_id: u32| json!({"SpecialToken": {"id": t.0, "type_id": type_id}});
    let seq = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
    let mut single = Vec::new();
    let mut pair = Vec::new();
    for (out, part, type_id) in [(&mut single, "A", 0), (&mut pair, "A", 0)] {
        out.extend(bos.map(|b| piece(b, type_id)));
        out.push(seq(part, type_id));
        out.extend(eos.map(|e| piece(e, type_id)));
    }
    pair.extend(bos.map(|b| piece(b, 1)));
    pair.push(seq("B", 1));
    pair.extend(eos.map(|e| piece(e, 1)));
    let mut special = serde_json::Map::new();
    for t in [bos, eos].into_iter().flatten() {
        special.insert(
            t.0.clone(),
            json!({"id": t.0, "ids": [t.1], "tokens": [t.0]}),
        );
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special})
}
