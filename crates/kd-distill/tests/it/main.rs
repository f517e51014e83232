//! The distill pipeline end to end on the demo fixtures.

mod distill;
mod template;

pub fn fixtures() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}
