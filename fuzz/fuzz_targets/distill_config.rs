//! The distill pipeline's configuration loader on arbitrary text: a ROLL YAML file (before the
//! first NUL byte) and Hydra-style overrides (one per line after it), with interpolation,
//! ROLL/TRL aliases and the unknown-key checks. Errors are fine; panics and hangs (e.g.
//! interpolation cycles) are findings.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (yaml, overrides) = text.split_once('\0').unwrap_or((text, ""));
    let overrides: Vec<String> = overrides.lines().map(String::from).collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, yaml).unwrap();
    if let Ok(loaded) = kd_distill::load(Some(&path), &overrides) {
        let _ = kd_distill::to_yaml(&loaded.config);
    }
});
