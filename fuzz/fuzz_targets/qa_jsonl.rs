//! The question/answer reader (distill's JSON/JSONL data) on arbitrary bytes, with the default
//! and dotted keys, under both bad-record policies. Errors are fine; panics are findings.
#![no_main]

use kd_data::{BadRecordPolicy, QaKeys, QaSource};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data.jsonl");
    std::fs::write(&path, data).unwrap();
    let dotted = QaKeys {
        question_key: "a.b".into(),
        answer_key: "c.0".into(),
        prompt_key: Some("p".into()),
        system_key: Some("s".into()),
    };
    for (keys, policy) in [
        (QaKeys::default(), BadRecordPolicy::Error),
        (dotted, BadRecordPolicy::Skip),
    ] {
        let source = QaSource {
            files: vec![path.clone()],
            keys,
            policy,
        };
        let mut records = source.records();
        for r in records.by_ref() {
            if let Err(e) = r {
                let _ = e.to_string();
            }
        }
        let _ = records.skipped().total();
    }
});
