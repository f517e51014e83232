//! The OpenAI batch reader (`*/batch_input.jsonl`) on arbitrary bytes, under both bad-record
//! policies and both turn selections. Errors are fine; panics are findings.
#![no_main]

use kd_data::{BadRecordPolicy, OpenAiBatchSource};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("batch_input.jsonl");
    std::fs::write(&path, data).unwrap();
    for (policy, last_user_only) in [
        (BadRecordPolicy::Error, false),
        (BadRecordPolicy::Skip, true),
    ] {
        let source = OpenAiBatchSource {
            files: vec![path.clone()],
            last_user_only,
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
