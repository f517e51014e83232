//! The GPU test set: every model path on a wgpu device against the CPU (and, for the forward
//! pass, against transformers' logits): forward in f32 (and bf16 where the device computes
//! in it), KV-cached decoding and greedy generation, LoRA training with dropout through
//! autodiff, every loss, the chunked LM-head losses and their memory, AdamW steps of a whole
//! run, checkpoint reload and merged export.
//!
//! The device is `KD_GPU_DEVICE` (any name `kd_model::parse_device` takes), else the first
//! hardware wgpu adapter, else the first adapter (lavapipe in CI). Where there is none, every
//! test is listed as ignored and the reason is printed; with `KD_REQUIRE_GPU=1` (CI) that is
//! a failure instead.

mod losses;
mod model;
mod training;
mod util;

use libtest_mimic::{Arguments, Trial};

type Test = fn(&burn::tensor::Device);

const TESTS: &[(&str, Test)] = &[
    (
        "model::device_names_reach_the_adapters",
        model::device_names_reach_the_adapters,
    ),
    (
        "model::forward_matches_cpu_and_transformers",
        model::forward_matches_cpu_and_transformers,
    ),
    (
        "model::bf16_forward_or_a_clear_error",
        model::bf16_forward_or_a_clear_error,
    ),
    (
        "model::cached_decoding_and_greedy_generation_match_cpu",
        model::cached_decoding_and_greedy_generation_match_cpu,
    ),
    (
        "model::lora_gradients_with_dropout_match_cpu",
        model::lora_gradients_with_dropout_match_cpu,
    ),
    (
        "losses::every_loss_matches_cpu",
        losses::every_loss_matches_cpu,
    ),
    (
        "losses::chunked_head_losses_match_cpu",
        losses::chunked_head_losses_match_cpu,
    ),
    (
        "losses::chunked_cross_entropy_keeps_no_logits",
        losses::chunked_cross_entropy_keeps_no_logits,
    ),
    (
        "training::run_checkpoint_and_export_match_cpu",
        training::run_checkpoint_and_export_match_cpu,
    ),
];

fn main() {
    let mut args = Arguments::from_args();
    // One device: run the tests one after another (memory figures are per device).
    args.test_threads.get_or_insert(1);
    let required = std::env::var_os("KD_REQUIRE_GPU").is_some_and(|v| v != "0");
    let device = util::gpu_device();
    // A listing (`--list`, as `cargo nextest` asks for one) holds the tests alone.
    match &device {
        _ if args.list => {}
        Ok((_, about)) => println!("GPU test set on {about}"),
        Err(why) if required => {
            println!("GPU test set: {why}; KD_REQUIRE_GPU is set, so every test fails");
        }
        Err(why) => println!(
            "GPU test set NOT RUN: {why}. Its {} tests are listed as ignored. Install a \
             Vulkan driver (Debian: `apt-get install mesa-vulkan-drivers libvulkan1`, the CPU \
             one is lavapipe) to run them; KD_REQUIRE_GPU=1 makes a missing device a failure.",
            TESTS.len()
        ),
    }
    let trials = TESTS
        .iter()
        .map(|&(name, test)| {
            let device = device
                .as_ref()
                .map(|(d, _)| d.clone())
                .map_err(Clone::clone);
            let missing = device.is_err();
            Trial::test(name, move || match device {
                Ok(device) => {
                    test(&device);
                    Ok(())
                }
                Err(why) => Err(why.into()),
            })
            .with_ignored_flag(missing && !required)
        })
        .collect();
    libtest_mimic::run(&args, trials).exit();
}
