//! Magpie prompts from the demo target: the prefix the template gives, sampling that does not
//! depend on the batch, and the batch file read back by the pipeline's own reader.

use kd_data::{ChatTokenizer, Message, OpenAiBatchSource};
use kd_model::{Llama, parse_device};
use kd_speculator::{
    PipelineError, magpie::MagpieOptions, magpie::magpie_prefix, magpie::magpie_prompts,
    magpie::write_batch_input,
};

use crate::demo;

const SYSTEM: &str = "You are a helpful assistant.";

#[test]
fn the_prefix_is_where_a_user_message_begins() {
    let tokenizer = ChatTokenizer::from_dir(demo().join("target")).unwrap();
    for system in [None, Some(SYSTEM)] {
        let prefix = magpie_prefix(&tokenizer, system).unwrap();
        let mut messages: Vec<Message> = system.map(Message::system).into_iter().collect();
        messages.push(Message::user("What is AI?"));
        let full = tokenizer.encode_prompt(&messages).unwrap();
        assert!(full.len() > prefix.len() + 2, "{system:?}");
        assert_eq!(&full[..prefix.len()], &prefix[..], "{system:?}");
        // What follows the prefix is the message (and then the template's own tokens).
        let rest = tokenizer.decode(&full[prefix.len()..], true).unwrap();
        assert!(rest.trim_start().starts_with("What is AI?"), "{rest:?}");
    }
}

#[test]
fn prompts_are_distinct_finished_and_independent_of_the_batch() {
    let dir = demo().join("target");
    let target = Llama::load(&dir, &parse_device("cpu").unwrap()).unwrap();
    let tokenizer = ChatTokenizer::from_dir(&dir).unwrap();
    let options = MagpieOptions {
        count: 6,
        system: Some(SYSTEM.into()),
        max_prompt_tokens: 48,
        batch_size: 4,
        seed: 7,
        max_attempts: 400,
        ..MagpieOptions::default()
    };
    let got = magpie_prompts(&target, &tokenizer, &options).unwrap();
    assert_eq!(got.len(), 6);
    let distinct: std::collections::HashSet<_> = got.iter().collect();
    assert_eq!(distinct.len(), 6, "{got:?}");
    assert!(got.iter().all(|p| !p.trim().is_empty() && p.trim() == p));
    let one_at_a_time = MagpieOptions {
        batch_size: 1,
        ..options.clone()
    };
    assert_eq!(
        magpie_prompts(&target, &tokenizer, &one_at_a_time).unwrap(),
        got
    );
    let other_seed = MagpieOptions {
        seed: 8,
        ..options.clone()
    };
    assert_ne!(
        magpie_prompts(&target, &tokenizer, &other_seed).unwrap(),
        got
    );

    // Too few finished messages: an error that says how many were found.
    let impossible = MagpieOptions {
        max_prompt_tokens: 1,
        max_attempts: 8,
        ..options
    };
    let e = magpie_prompts(&target, &tokenizer, &impossible).unwrap_err();
    assert!(matches!(e, PipelineError::Config(_)), "{e}");
    assert!(e.to_string().contains("after 8 samples, 6 wanted"), "{e}");

    // The file reads back as the same conversations.
    let out = tempfile::tempdir().unwrap();
    let path = out.path().join("magpie").join("batch_input.jsonl");
    write_batch_input(&path, &got, Some(SYSTEM), "magpie").unwrap();
    let source = OpenAiBatchSource::from_data_dir(out.path()).unwrap();
    let records: Vec<_> = source.records().collect::<Result<_, _>>().unwrap();
    assert_eq!(records.len(), got.len());
    for (r, p) in records.iter().zip(&got) {
        assert_eq!(
            r.messages,
            vec![Message::system(SYSTEM), Message::user(p.clone())]
        );
    }
    assert_eq!(records[0].custom_id.as_deref(), Some("magpie-00000"));
}
