//! kd-data integration tests: chat templates against transformers' apply_chat_template
//! (fixtures/make_chat_template_golden.py), sources and their error policy, examples.

mod examples;
mod gguf;
mod sources;
mod templates;

use std::path::PathBuf;

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}
