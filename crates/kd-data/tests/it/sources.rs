//! Sources: OpenAI batch files, question/answer sets, text; bad records under both policies.

use std::path::Path;

use kd_data::source::BadRecordKind;
use kd_data::{
    BadRecordPolicy, DataError, Message, OpenAiBatchSource, QaKeys, QaSource, Sampling, TextSource,
    find_batch_files,
};

use crate::fixtures;

#[test]
fn batch_files_are_found_in_order() {
    let dir = fixtures().join("data/sft_sample");
    let files = find_batch_files(&dir).unwrap();
    assert_eq!(files.len(), 2);
    assert!(
        files[0].ends_with("part-a/batch_input.jsonl")
            && files[1].ends_with("part-b/batch_input.jsonl")
    );
    // A file is accepted directly.
    assert_eq!(find_batch_files(&files[1]).unwrap(), vec![files[1].clone()]);
    let empty = tempfile::tempdir().unwrap();
    let e = find_batch_files(empty.path()).unwrap_err().to_string();
    assert!(e.contains("batch_input.jsonl"), "{e}");
}

#[test]
fn prompts_end_at_the_last_user_turn() {
    let source = OpenAiBatchSource::from_data_dir(&fixtures().join("data/sft_sample")).unwrap();
    let prompts: Vec<_> = source.records().collect::<Result<_, _>>().unwrap();
    assert_eq!(prompts.len(), 40);
    assert_eq!(prompts[0].id, "part-a-000");
    assert_eq!(prompts[0].messages[0].role, "system");
    assert!(
        prompts
            .iter()
            .all(|p| p.messages.last().unwrap().role == "user")
    );
    // Multi-turn history is kept; list-of-parts content is joined without separator.
    let p1 = &prompts[1];
    assert_eq!(p1.messages.len(), 3);
    let p2 = &prompts[2];
    assert_eq!(
        p2.messages.last().unwrap().content,
        "Write a short poem about photosynthesis."
    );
    assert_eq!(prompts[24].custom_id.as_deref(), Some("part-b-024"));
    // last_user_only keeps the last user turn alone.
    let only = OpenAiBatchSource {
        last_user_only: true,
        ..source.clone()
    };
    let p: Vec<_> = only.records().collect::<Result<_, _>>().unwrap();
    assert!(
        p.iter()
            .all(|r| r.messages.len() == 1 && r.messages[0].role == "user")
    );
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

const BAD_LINES: &str = r#"{"custom_id": "ok-1", "body": {"messages": [{"role": "user", "content": "fine"}]}}
{"custom_id": "broken", "body": {"messages": [
{"custom_id": "nomsg", "body": {}}
{"custom_id": "nouser", "body": {"messages": [{"role": "system", "content": "s"}]}}
{"custom_id": "image", "body": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}}
{"custom_id": "badrole", "body": {"messages": [{"role": 3, "content": "x"}]}}
{"custom_id": "ok-2", "body": {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}}
"#;

#[test]
fn bad_records_error_with_file_and_line_or_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "batch_input.jsonl", BAD_LINES);
    let source = OpenAiBatchSource {
        files: vec![path.clone()],
        last_user_only: false,
        policy: BadRecordPolicy::Error,
    };
    let mut it = source.records();
    assert!(it.next().unwrap().is_ok());
    match it.next().unwrap() {
        Err(DataError::Record {
            path: p,
            line,
            reason,
            ..
        }) => {
            assert_eq!((p, line), (path.clone(), 2));
            assert!(
                reason.contains("invalid JSON") && reason.contains("skip"),
                "{reason}"
            );
        }
        other => panic!("expected a record error, got {other:?}"),
    }
    assert!(it.next().is_none(), "reading stops at the first error");

    let skip = OpenAiBatchSource {
        policy: BadRecordPolicy::Skip,
        ..source
    };
    let mut it = skip.records();
    let ok: Vec<_> = it.by_ref().collect::<Result<_, _>>().unwrap();
    assert_eq!(
        ok.iter().map(|p| p.id.as_str()).collect::<Vec<_>>(),
        vec!["ok-1", "ok-2"]
    );
    assert_eq!(ok[1].messages[0].content, "ab");
    let counts = &it.skipped().counts;
    assert_eq!(counts[&BadRecordKind::InvalidJson], 1);
    assert_eq!(counts[&BadRecordKind::NoMessages], 1);
    assert_eq!(counts[&BadRecordKind::NoUserTurn], 1);
    assert_eq!(counts[&BadRecordKind::NonTextPart], 1);
    assert_eq!(counts[&BadRecordKind::WrongType], 1);
    assert_eq!(it.skipped().total(), 5);
}

/// Files as a new user brings them: a byte-order mark, an empty user message, an unknown
/// role, a line that is not UTF-8.
#[test]
fn openai_files_from_the_wild() {
    let dir = tempfile::tempdir().unwrap();
    let user = |id: &str, text: &str| {
        format!(
            r#"{{"custom_id": "{id}", "body": {{"messages": [{{"role": "user", "content": "{text}"}}]}}}}"#
        )
    };
    let mut bytes = b"\xEF\xBB\xBF".to_vec();
    bytes.extend(user("first", "hello").as_bytes());
    bytes.push(b'\n');
    bytes.extend(user("empty", "  ").as_bytes());
    bytes.push(b'\n');
    bytes.extend(
        br#"{"custom_id": "wizard", "body": {"messages": [{"role": "wizard", "content": "x"}, {"role": "user", "content": "hi"}]}}"#,
    );
    bytes.push(b'\n');
    // "café" in Latin-1: the byte 0xE9 alone is not UTF-8.
    let mut latin1 = user("latin1", "caf#").into_bytes();
    let at = latin1.iter().position(|b| *b == b'#').unwrap();
    latin1[at] = 0xE9;
    bytes.extend(latin1);
    bytes.push(b'\n');
    bytes.extend(user("last", "bye").as_bytes());
    bytes.push(b'\n');
    let path = dir.path().join("batch_input.jsonl");
    std::fs::write(&path, bytes).unwrap();
    let source = OpenAiBatchSource::from_data_dir(&path).unwrap();

    // `error`: the BOM'd first record reads; the empty prompt stops the stream at line 2.
    let mut it = source.records();
    assert_eq!(it.next().unwrap().unwrap().id, "first");
    let e = it.next().unwrap().unwrap_err().to_string();
    assert!(
        e.contains("batch_input.jsonl:2:") && e.contains("user message is empty"),
        "{e}"
    );
    // Each bad line alone names its line and what is wrong.
    for (line, want) in [(3, "unknown role \"wizard\""), (4, "not valid UTF-8")] {
        let only = dir.path().join(format!("line{line}.jsonl"));
        let text = std::fs::read(&path).unwrap();
        let chosen = text.split(|b| *b == b'\n').nth(line - 1).unwrap().to_vec();
        std::fs::write(&only, [b"\n".repeat(line - 1), chosen].concat()).unwrap();
        let e = OpenAiBatchSource::from_data_dir(&only)
            .unwrap()
            .records()
            .next()
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!(":{line}:")) && e.contains(want), "{e}");
    }

    // `skip`: the good records kept (the BOM'd one included), each bad one counted by reason.
    let skip = OpenAiBatchSource {
        policy: BadRecordPolicy::Skip,
        ..source
    };
    let mut it = skip.records();
    let ok: Vec<_> = it.by_ref().collect::<Result<_, _>>().unwrap();
    assert_eq!(
        ok.iter().map(|p| p.id.as_str()).collect::<Vec<_>>(),
        vec!["first", "last"]
    );
    let counts = &it.skipped().counts;
    assert_eq!(counts[&BadRecordKind::EmptyPrompt], 1);
    assert_eq!(counts[&BadRecordKind::UnknownRole], 1);
    assert_eq!(counts[&BadRecordKind::InvalidUtf8], 1);
}

#[test]
fn qa_sets_from_array_and_jsonl_with_dotted_keys() {
    let keys = QaKeys {
        system_key: Some("meta.system".into()),
        ..QaKeys::default()
    };
    let source = QaSource {
        files: vec![fixtures().join("data/qa_sample.json")],
        keys: keys.clone(),
        policy: BadRecordPolicy::Error,
    };
    let records: Vec<_> = source.records().collect::<Result<_, _>>().unwrap();
    assert_eq!(records.len(), 30);
    assert_eq!(
        records[0].messages[0],
        Message::new("system", "Answer with the full equation.")
    );
    assert_eq!(records[0].messages[1].role, "user");
    assert!(records[0].answer.contains('='));
    assert_eq!(
        records[1].location.line, 9,
        "array elements carry their starting line"
    );

    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "qa.jsonl",
        "{\"question\": \"q1\", \"answer\": 42, \"meta\": {}}\n{\"question\": \"q2\"}\n{\"question\": [1], \"answer\": \"a\"}\n{\"question\": \"q\", \"answer\": \"  \"}\n",
    );
    let skip = QaSource {
        files: vec![path.clone()],
        keys: keys.clone(),
        policy: BadRecordPolicy::Skip,
    };
    let mut it = skip.records();
    let ok: Vec<_> = it.by_ref().collect::<Result<_, _>>().unwrap();
    assert_eq!(ok.len(), 1);
    assert_eq!(ok[0].answer, "42");
    assert_eq!(it.skipped().total(), 3);
    let strict = QaSource {
        policy: BadRecordPolicy::Error,
        ..skip
    };
    let e = strict
        .records()
        .collect::<Result<Vec<_>, _>>()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("qa.jsonl:2") && e.contains("missing key `answer`"),
        "{e}"
    );
}

/// Records of a one-line JSON array are told apart by record number; null is called null;
/// a missing key lists the keys the record has.
#[test]
fn qa_errors_locate_records_and_name_what_is_there() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "qa.json",
        r#"[{"question": "q1", "answer": "a1"}, {"question": "q2", "answer": "a2"}, {"question": null, "answer": "a3"}, {"prompt": "p", "response": "r"}]"#,
    );
    let source = |policy| QaSource {
        files: vec![path.clone()],
        keys: QaKeys::default(),
        policy,
    };
    let mut it = source(BadRecordPolicy::Skip).records();
    let ok: Vec<_> = it.by_ref().collect::<Result<_, _>>().unwrap();
    assert_eq!(ok.len(), 2);
    assert_eq!((ok[0].location.line, ok[0].location.record), (1, Some(1)));
    assert_eq!(ok[1].location.record, Some(2));
    assert!(ok[1].id.ends_with("qa.json:1 (record 2)"), "{}", ok[1].id);
    assert_eq!(it.skipped().counts[&BadRecordKind::WrongType], 1);
    assert_eq!(it.skipped().counts[&BadRecordKind::MissingKey], 1);

    let e = source(BadRecordPolicy::Error)
        .records()
        .collect::<Result<Vec<_>, _>>()
        .unwrap_err();
    match &e {
        DataError::Record { line, record, .. } => assert_eq!((*line, *record), (1, Some(3))),
        other => panic!("expected a record error, got {other:?}"),
    }
    let e = e.to_string();
    assert!(
        e.contains("qa.json:1 (record 3)") && e.contains("`question` is null"),
        "{e}"
    );

    // Without the null record, the missing keys are reported with the keys present.
    let path2 = write(
        dir.path(),
        "qa2.json",
        r#"[{"question": "q1", "answer": "a1"}, {"prompt": "p", "response": "r"}]"#,
    );
    let e = QaSource {
        files: vec![path2],
        keys: QaKeys::default(),
        policy: BadRecordPolicy::Error,
    }
    .records()
    .collect::<Result<Vec<_>, _>>()
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("(record 2)")
            && e.contains("missing key `question`")
            && e.contains("keys present: `prompt`, `response`"),
        "{e}"
    );
}

#[test]
fn text_sources() {
    let dir = tempfile::tempdir().unwrap();
    let txt = write(dir.path(), "a.txt", "line one\nline two\n");
    let jsonl = write(
        dir.path(),
        "b.jsonl",
        "{\"text\": \"doc\"}\n{\"text\": \"\"}\n",
    );
    let source = TextSource {
        files: vec![txt, jsonl],
        text_key: "text".into(),
        policy: BadRecordPolicy::Skip,
    };
    let records: Vec<_> = source.records().collect::<Result<_, _>>().unwrap();
    assert_eq!(records.len(), 2);
    assert_eq!(records[0].text, "line one\nline two\n");
    assert!(records[0].document_end && records[1].document_end);
}

#[test]
fn sampling_prompts_is_deterministic() {
    let source = OpenAiBatchSource::from_data_dir(&fixtures().join("data/sft_sample")).unwrap();
    let s = Sampling {
        max_samples: Some(10),
        shuffle: true,
        seed: 3,
    };
    let a: Vec<String> = s
        .apply(source.records())
        .unwrap()
        .into_iter()
        .map(|p| p.id)
        .collect();
    let b: Vec<String> = s
        .apply(source.records())
        .unwrap()
        .into_iter()
        .map(|p| p.id)
        .collect();
    assert_eq!(a, b);
    assert_eq!(a.len(), 10);
}
