//! The speculator pipeline end to end on the demo fixtures.

mod eagle3;
mod speculator;

pub fn fixtures() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}
