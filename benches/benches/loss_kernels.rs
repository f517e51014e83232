//! Criterion benchmark of the fused loss kernels: forward + backward w.r.t. the student
//! logits through autodiff, N = 1024 × V = 128256 f32 (`docs/src/benchmarks.md`).
//! For memory figures and the PyTorch column, run the `loss_figures` binary.
//!
//! `cargo bench -p kd-benches --bench loss_kernels`

use burn::tensor::{Device, Distribution, Tensor};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kd_loss::{KdConfig, KdObjective, Teacher, cross_entropy, kd_loss};

const N: usize = 1024;
const V: usize = 128_256;

fn bench(c: &mut Criterion) {
    eprintln!("machine: {}", kd_kernels::cpu::describe());
    let plain = Device::flex();
    plain.seed(0);
    let device = plain.clone().autodiff();
    let student =
        Tensor::<2>::random([N, V], Distribution::Normal(0.0, 2.0), &device).require_grad();
    let teacher = Tensor::<2>::random([N, V], Distribution::Normal(0.0, 2.0), &plain);
    let mask: Vec<bool> = (0..N).map(|i| i % 10 != 3).collect();
    let count = mask.iter().filter(|m| **m).count() as f32;
    let targets: Vec<i64> = (0..N)
        .map(|i| {
            if mask[i] {
                ((i * 7919) % V) as i64
            } else {
                -100
            }
        })
        .collect();

    let mut group = c.benchmark_group("loss_fwd_bwd_1024x128256");
    group.sample_size(10);
    group.throughput(Throughput::Elements(N as u64));
    group.bench_function("cross_entropy", |b| {
        b.iter(|| {
            let out = cross_entropy(student.clone(), &targets, count).unwrap();
            student.grad(&out.loss.backward())
        })
    });
    for obj in KdObjective::ALL {
        let config = KdConfig {
            kd_temperature: 2.0,
            logits_topk: 0,
            ..KdConfig::new(obj)
        };
        group.bench_function(obj.name(), |b| {
            b.iter(|| {
                let out = kd_loss(
                    student.clone(),
                    Teacher::Logits(teacher.clone()),
                    &mask,
                    count,
                    &config,
                )
                .unwrap();
                student.grad(&out.loss.backward())
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
