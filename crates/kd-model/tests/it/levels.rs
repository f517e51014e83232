//! The kernel cases again at every lower instruction-set level: the fused ops, parity with
//! transformers, the packed GGUF kernels and autodiff run in child processes with `KD_SIMD`
//! set, so an AVX-512 machine checks its AVX-512 (here), AVX2 and scalar paths, and an
//! AVX2-only machine its AVX2 and scalar paths.

#[test]
fn kernel_cases_pass_at_every_lower_level() {
    let levels = kd_kernels::testing::assert_passes_at_lower_levels(
        &[
            "ops::",
            "parity::",
            "autodiff::",
            "gguf::packed",
            "generation::",
        ],
        &["levels::"],
    );
    eprintln!(
        "ran at {} here and again at {levels:?}",
        kd_kernels::cpu::describe()
    );
}
