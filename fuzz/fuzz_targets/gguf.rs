//! The GGUF reader on arbitrary bytes: opening, every metadata getter the loaders use, every
//! tensor's bytes and dequantisation, and the tokenizer built from GGUF metadata. Errors are
//! fine; panics, aborts, hangs and unbounded allocations are findings.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, data).unwrap();
    let Ok(file) = kd_gguf::GgufFile::open(&path) else {
        return;
    };
    for key in file.metadata().keys() {
        let _ = file.str(key);
        let _ = file.opt_uint(key);
        let _ = file.opt_float(key);
        let _ = file.opt_bool(key);
        let _ = file.strings(key);
        let _ = file.opt_ints(key);
    }
    for t in file.tensors() {
        let _ = t.shape();
        let _ = t.n_elements();
        let _ = file.tensor_bytes(&t.name);
        // Bounded like the loaders' inputs here: at most 4 M values per tensor.
        if t.n_elements() <= 1 << 22 {
            let _ = file.dequantize(&t.name);
        }
    }
    let _ = kd_data::ChatTokenizer::from_gguf(&path);
});
