//! The loss kernels against PyTorch again at every lower instruction-set level (child
//! processes with `KD_SIMD` set): an AVX-512 machine checks its AVX-512 (here), AVX2 and
//! scalar row kernels and GEMM, an AVX2-only machine its AVX2 and scalar ones.

#[test]
fn kernel_cases_pass_at_every_lower_level() {
    let levels = kd_kernels::testing::assert_passes_at_lower_levels(
        &["golden::", "linear::", "properties::"],
        &["levels::"],
    );
    eprintln!(
        "ran at {} here and again at {levels:?}",
        kd_kernels::cpu::describe()
    );
}
