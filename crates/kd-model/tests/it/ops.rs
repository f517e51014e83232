//! The fused CPU training kernels (`kd_model::ops`) against Burn's own composite ops: values
//! and gradients, grouped K/V heads, padding masks with fully masked rows.

use burn::tensor::activation::silu;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, Tensor, TensorData};
use kd_model::ops::{fused_attention, fused_swiglu};

use crate::util::cpu;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
        })
        .collect()
}

fn leaf<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<D> {
    let n = shape.iter().product();
    Tensor::from_data(TensorData::new(values(n, seed), shape), &cpu().autodiff()).require_grad()
}

fn flat<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_into_vec_as::<f32>().unwrap()
}

fn assert_close(what: &str, ours: &[f32], reference: &[f32], tol: f32) {
    assert_eq!(ours.len(), reference.len(), "{what}");
    let d = ours
        .iter()
        .zip(reference)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(d <= tol, "{what}: max |Δ| = {d:e}");
}

fn repeat_kv(x: Tensor<4>, groups: usize) -> Tensor<4> {
    let [b, kv, t, d] = x.dims();
    x.unsqueeze_dim::<5>(2)
        .expand([b, kv, groups, t, d])
        .reshape([b, kv * groups, t, d])
}

/// The fused attention against Burn's composite attention (K/V heads repeated) on `mask`
/// (`[b, s, s]`, `true` = masked): output, dq, dk, dv. Returns the output.
fn check_attention(
    (b, h, kv, s, d): (usize, usize, usize, usize, usize),
    mask: Vec<bool>,
    tol: (f32, f32),
) -> Vec<f32> {
    let mask = Tensor::<4, Bool>::from_data(TensorData::new(mask, [b, 1, s, s]), &cpu().autodiff());
    let scale = 1.0 / (d as f64).sqrt();
    let run = |fused: bool| {
        let (q, k, v) = (
            leaf([b, h, s, d], 1),
            leaf([b, kv, s, d], 2),
            leaf([b, kv, s, d], 3),
        );
        let out = if fused {
            fused_attention(q.clone(), k.clone(), v.clone(), &mask, scale).unwrap()
        } else {
            attention(
                q.clone(),
                repeat_kv(k.clone(), h / kv),
                repeat_kv(v.clone(), h / kv),
                Some(mask.clone()),
                None,
                AttentionModuleOptions {
                    scale: Some(scale),
                    softcap: None,
                    is_causal: false,
                },
            )
        };
        // A loss that weighs every output element differently.
        let w = Tensor::<4>::from_data(
            TensorData::new(values(b * h * s * d, 4), [b, h, s, d]),
            &out.device(),
        );
        let grads = (out.clone() * w).sum().backward();
        let g = |t: &Tensor<4>| flat(t.grad(&grads).expect("gradient"));
        (flat(out), g(&q), g(&k), g(&v))
    };
    let (out, dq, dk, dv) = run(true);
    let (ref_out, ref_dq, ref_dk, ref_dv) = run(false);
    assert_close("attention output", &out, &ref_out, tol.0);
    assert_close("dq", &dq, &ref_dq, tol.1);
    assert_close("dk", &dk, &ref_dk, tol.1);
    assert_close("dv", &dv, &ref_dv, tol.1);
    out
}

#[test]
fn attention_matches_burn_with_grouped_heads_and_padding() {
    // 70 queries: two blocks of the kernel's query blocking (64), the second one ragged.
    let (b, h, kv, s, d) = (3, 4, 2, 70, 8);
    // Row 0: causal with two left-padding slots (its first two queries see nothing); row 1:
    // causal, plus one masked key in the middle; row 2: 66 padding slots (a whole block of
    // queries sees nothing).
    let mut mask = vec![false; b * s * s];
    for r in 0..b {
        for i in 0..s {
            for j in 0..s {
                let pad = (r == 0 && j < 2) || (r == 2 && j < 66);
                let hole = r == 1 && j == 3 && i > 3;
                mask[(r * s + i) * s + j] = j > i || pad || hole;
            }
        }
    }
    let out = check_attention((b, h, kv, s, d), mask, (1e-5, 1e-5));
    // The fully masked query rows give zeros, as Burn's do.
    for (row, seen_from) in [(0, 2), (2, 66)] {
        for head in 0..h {
            for i in 0..s {
                let at = ((row * h + head) * s + i) * d;
                let zero = out[at..at + d].iter().all(|x| *x == 0.0);
                assert_eq!(zero, i < seen_from, "row {row} head {head} query {i}");
            }
        }
    }
}

/// Sequences longer than one key block (256): the online softmax rescales earlier partial
/// outputs when a later block raises a row's maximum, and the backward pass recomputes the
/// probabilities of every block from the log-sum-exp. Row 1 is packed (two segments, the
/// second starting inside the second key block), row 0 causal with 300 padding slots (a
/// whole key block and part of the next masked).
#[test]
fn attention_over_several_key_blocks_matches_burn() {
    let (b, h, kv, s, d) = (2, 2, 1, 600, 16);
    let mut mask = vec![false; b * s * s];
    for i in 0..s {
        for j in 0..s {
            mask[i * s + j] = j > i || j < 300;
            let seg = |t: usize| usize::from(t >= 333);
            mask[(s + i) * s + j] = j > i || seg(i) != seg(j);
        }
    }
    check_attention((b, h, kv, s, d), mask, (1e-5, 1e-5));
}

/// A short pass (16 queries or fewer: decoding, a speculative verification), which takes
/// each query alone: against Burn, with a head width past a multiple of the kernel's 16 lanes,
/// left padding, a masked key inside a row's span (whose visible keys are gathered) and
/// queries that see nothing.
#[test]
fn short_pass_attention_matches_burn() {
    let (b, h, kv, s, d) = (3, 4, 2, 6, 40);
    // Row 0: causal after two padding slots; row 1: causal with key 1 masked for queries 2..;
    // row 2: three padding slots (queries 0–2 see nothing).
    let mut mask = vec![false; b * s * s];
    for r in 0..b {
        for i in 0..s {
            for j in 0..s {
                let pad = (r == 0 && j < 2) || (r == 2 && j < 3);
                let hole = r == 1 && j == 1 && i > 1;
                mask[(r * s + i) * s + j] = j > i || pad || hole;
            }
        }
    }
    let out = check_attention((b, h, kv, s, d), mask, (1e-5, 1e-5));
    for head in 0..h {
        for i in 0..3 {
            let at = ((2 * h + head) * s + i) * d;
            assert!(
                out[at..at + d].iter().all(|x| *x == 0.0),
                "head {head} query {i}"
            );
        }
    }
}

/// Each query of a short pass has the same bits as the same query in a pass of its own (what
/// makes a speculative verification agree with plain decoding exactly), holes included.
#[test]
fn short_pass_queries_equal_one_query_passes() {
    same_bits_as_one_query_passes((2, 6, 2, 5, 23, 64));
}

/// The same over a cache of 1030 keys with three K/V heads at batch 1 (a SmolLM2 decode step
/// after a long prompt), where the pass cuts its queries evenly across the threads instead of
/// one task per head: the cut changes no query's bits.
#[test]
fn a_long_short_pass_cut_across_threads_keeps_each_querys_bits() {
    same_bits_as_one_query_passes((1, 9, 3, 5, 1030, 64));
}

/// [`short_pass_queries_equal_one_query_passes`] for `(b, h, kv, s, t, d)`, and the whole pass
/// against Burn's attention; the last row has three padding slots and, for its queries from
/// the fourth on, a hole.
fn same_bits_as_one_query_passes((b, h, kv, s, t, d): (usize, usize, usize, usize, usize, usize)) {
    let device = cpu();
    let tensor = |shape: [usize; 4], seed| {
        Tensor::<4>::from_data(
            TensorData::new(values(shape.iter().product(), seed), shape),
            &device,
        )
    };
    let (q, k, v) = (
        tensor([b, h, s, d], 5),
        tensor([b, kv, t, d], 6),
        tensor([b, kv, t, d], 7),
    );
    // Causal over the last s keys of t; the last row has three padding slots and, for its
    // queries from the fourth on, a masked key inside the span (a draft slot another row kept).
    let mut mask = vec![false; b * s * t];
    for r in 0..b {
        for i in 0..s {
            for j in 0..t {
                let future = j > t - s + i;
                let pad = r == b - 1 && j < 3;
                let hole = r == b - 1 && j == t - s + 1 && i >= 3;
                mask[(r * s + i) * t + j] = future || pad || hole;
            }
        }
    }
    let mask_of = |rows: &[bool], s: usize| {
        Tensor::<4, Bool>::from_data(TensorData::new(rows.to_vec(), [b, 1, s, t]), &device)
    };
    let whole =
        flat(fused_attention(q.clone(), k.clone(), v.clone(), &mask_of(&mask, s), 0.125).unwrap());
    let reference = flat(attention(
        q.clone(),
        repeat_kv(k.clone(), h / kv),
        repeat_kv(v.clone(), h / kv),
        Some(mask_of(&mask, s)),
        None,
        AttentionModuleOptions {
            scale: Some(0.125),
            softcap: None,
            is_causal: false,
        },
    ));
    assert_close(
        "the short pass against Burn's attention",
        &whole,
        &reference,
        1e-5,
    );
    for i in 0..s {
        let rows: Vec<bool> = (0..b)
            .flat_map(|r| mask[(r * s + i) * t..][..t].to_vec())
            .collect();
        let qi = q.clone().slice([0..b, 0..h, i..i + 1, 0..d]);
        let alone =
            flat(fused_attention(qi, k.clone(), v.clone(), &mask_of(&rows, 1), 0.125).unwrap());
        for r in 0..b {
            for head in 0..h {
                let at = ((r * h + head) * s + i) * d;
                let one = ((r * h + head) * d)..((r * h + head) * d + d);
                assert_eq!(
                    whole[at..at + d]
                        .iter()
                        .map(|x| x.to_bits())
                        .collect::<Vec<_>>(),
                    alone[one].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "row {r} head {head} query {i}"
                );
            }
        }
    }
}

#[test]
fn swiglu_matches_silu_times_up() {
    // Large enough for several parallel chunks and a ragged tail.
    let shape = [3, 5, 4099];
    let run = |fused: bool| {
        let (g, u) = (leaf(shape, 5), leaf(shape, 6));
        let out = if fused {
            fused_swiglu(g.clone(), u.clone())
        } else {
            silu(g.clone()) * u.clone()
        };
        let w = Tensor::<3>::from_data(
            TensorData::new(values(shape.iter().product(), 7), shape),
            &out.device(),
        );
        let grads = (out.clone() * w).sum().backward();
        (
            flat(out),
            flat(g.grad(&grads).expect("gate gradient")),
            flat(u.grad(&grads).expect("up gradient")),
        )
    };
    let (out, dg, du) = run(true);
    let (ref_out, ref_dg, ref_du) = run(false);
    assert_close("swiglu output", &out, &ref_out, 1e-5);
    assert_close("d gate", &dg, &ref_dg, 1e-5);
    assert_close("d up", &du, &ref_du, 1e-5);
    // Plain (non-autodiff) tensors take the same kernel.
    let plain = fused_swiglu(
        leaf(shape, 5).without_autodiff(),
        leaf(shape, 6).without_autodiff(),
    );
    assert_eq!(flat(plain), out);
}

#[test]
fn lora_projection_matches_the_adapter_ops() {
    use burn::module::{Module, Param};
    use burn::nn::Linear;
    use kd_lora::{LoraAdapter, LoraLinear};
    use kd_model::ops::{LoraDropout, fused_lora_linear};

    let (n, din, dout, r) = (37, 24, 40, 4);
    let device = cpu().autodiff();
    let plain = |shape: [usize; 2], seed| {
        Tensor::<2>::from_data(
            TensorData::new(values(shape[0] * shape[1], seed), shape),
            &device,
        )
    };
    let run = |fused: bool, dropout: Option<(f64, u64)>| {
        let x = leaf([n, din], 11);
        let p = dropout.map_or(0.0, |(p, _)| p);
        let mut adapter = LoraAdapter::new(din, dout, r, 0.75, p, &device);
        adapter.lora_a = Linear {
            weight: Param::from_tensor(plain([din, r], 12)),
            bias: None,
        };
        adapter.lora_b = Linear {
            weight: Param::from_tensor(plain([r, dout], 13)),
            bias: None,
        };
        let layer = LoraLinear {
            base: Linear {
                weight: Param::from_tensor(plain([din, dout], 14)),
                bias: None,
            }
            .no_grad(),
            adapter: Some(adapter),
        };
        let a = layer.adapter.as_ref().unwrap();
        let y = if fused {
            fused_lora_linear(
                x.clone(),
                layer.base.weight.val(),
                a.lora_a.weight.val(),
                a.lora_b.weight.val(),
                a.scale,
                dropout.map(|(p, seed)| LoraDropout { p, seed }),
            )
        } else {
            layer.forward(x.clone(), dropout.map(|(_, seed)| seed))
        };
        let w = plain([n, dout], 15);
        let grads = (y.clone() * w).sum().backward();
        let g = |t: Tensor<2>| flat(t.grad(&grads).expect("gradient"));
        (
            flat(y),
            g(x),
            g(a.lora_a.weight.val()),
            g(a.lora_b.weight.val()),
            layer.base.weight.val().grad(&grads).is_none(),
        )
    };
    // Without dropout, then with the seed's default 0.05 and with 0.5 (the unfused path draws
    // the same mask from the same seed: kd_lora::dropout_mask).
    for dropout in [None, Some((0.05, 7)), Some((0.5, 8))] {
        let (y, dx, da, db, frozen) = run(true, dropout);
        let (ref_y, ref_dx, ref_da, ref_db, _) = run(false, dropout);
        let what = |t: &str| format!("{t} (dropout {dropout:?})");
        assert_close(&what("lora output"), &y, &ref_y, 1e-4);
        assert_close(&what("dx"), &dx, &ref_dx, 1e-4);
        assert_close(&what("dA"), &da, &ref_da, 1e-4);
        assert_close(&what("dB"), &db, &ref_db, 1e-4);
        assert!(frozen, "the base weight gets no gradient");
    }
    // Dropout does change the result (the mask is applied, not ignored).
    let (with, ..) = run(true, Some((0.5, 8)));
    let (without, ..) = run(true, None);
    assert!(with.iter().zip(&without).any(|(a, b)| (a - b).abs() > 1e-3));
}

#[test]
fn rms_norm_matches_burn() {
    use burn::module::Param;
    use burn::nn::RmsNormConfig;
    use kd_model::ops::fused_rms_norm;

    // 70 rows: several parallel tasks and a ragged last one; width 37: a lane tail.
    let shape = [2, 35, 37];
    let device = cpu().autodiff();
    let run = |fused: bool| {
        let x = leaf(shape, 21);
        let mut norm = RmsNormConfig::new(37).with_epsilon(1e-5).init(&device);
        norm.gamma = Param::from_tensor(
            Tensor::<1>::from_data(TensorData::new(values(37, 22), [37]), &device).require_grad(),
        );
        let y = if fused {
            fused_rms_norm(x.clone(), norm.gamma.val(), norm.epsilon)
        } else {
            norm.forward(x.clone())
        };
        let w = Tensor::<3>::from_data(
            TensorData::new(values(shape.iter().product(), 23), shape),
            &device,
        );
        let grads = (y.clone() * w).sum().backward();
        let dgamma = norm.gamma.val().grad(&grads).expect("gamma gradient");
        (
            flat(y),
            flat(x.grad(&grads).expect("x gradient")),
            dgamma.into_data().try_into_vec_as::<f32>().unwrap(),
        )
    };
    let (y, dx, dg) = run(true);
    let (ref_y, ref_dx, ref_dg) = run(false);
    assert_close("rms_norm output", &y, &ref_y, 1e-5);
    assert_close("dx", &dx, &ref_dx, 1e-5);
    assert_close("dgamma", &dg, &ref_dg, 1e-4);
}

/// Operands that do not fit stop with a message naming them before any kernel indexes a
/// buffer (the kernels hand raw pointers to GEMM): no safe call can read out of bounds.
#[test]
fn mismatched_operands_panic_instead_of_reading_out_of_bounds() {
    use burn::backend::Dispatch;
    use kd_model::ops::{AttentionJob, TrainOpsBackend, fused_lora_linear, fused_rms_norm};
    let device = cpu();
    let t = |shape: &[usize], seed| {
        let n = shape.iter().product();
        Tensor::<2>::from_data(TensorData::new(values(n, seed), shape.to_vec()), &device)
    };
    let t4 = |shape: [usize; 4], seed| {
        Tensor::<4>::from_data(
            TensorData::new(values(shape.iter().product(), seed), shape),
            &device,
        )
    };
    let message = |f: Box<dyn FnOnce() + std::panic::UnwindSafe>| -> String {
        let e = std::panic::catch_unwind(f).expect_err("a mismatch must panic");
        e.downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    };
    // Keys shorter than the mask says.
    let (q, k, v) = (
        t4([1, 2, 8, 4], 1),
        t4([1, 1, 3, 4], 2),
        t4([1, 1, 3, 4], 3),
    );
    let mask =
        Tensor::<4, Bool>::from_data(TensorData::new(vec![false; 8 * 8], [1, 1, 8, 8]), &device);
    let e = message(Box::new(move || {
        let _ = fused_attention(q, k, v, &mask, 0.5);
    }));
    assert!(e.contains("masked_attention") && e.contains("mask"), "{e}");
    // A job whose mask does not have the size it claims is refused when it is built.
    let e = AttentionJob::new(vec![false; 15], 1, 4, 4, 1.0).unwrap_err();
    assert!(e.to_string().contains("15 entries"), "{e}");
    assert!(AttentionJob::new(vec![false; 16], 1, 4, 4, f32::NAN).is_err());
    // A job for other dimensions than the operands', through the backend trait.
    let (q, k, v) = (
        t4([1, 1, 4, 4], 1),
        t4([1, 1, 4, 4], 2),
        t4([1, 1, 4, 4], 3),
    );
    let e = message(Box::new(move || {
        let job = AttentionJob::new(vec![false; 40], 1, 4, 10, 1.0).unwrap();
        let _ = <Dispatch as TrainOpsBackend>::masked_attention(
            q.into_dispatch(),
            k.into_dispatch(),
            v.into_dispatch(),
            job,
        );
    }));
    assert!(e.contains("the mask must be"), "{e}");
    // K/V heads that do not divide the query heads.
    let (q, k, v) = (
        t4([1, 3, 4, 4], 1),
        t4([1, 2, 4, 4], 2),
        t4([1, 2, 4, 4], 3),
    );
    let mask =
        Tensor::<4, Bool>::from_data(TensorData::new(vec![false; 16], [1, 1, 4, 4]), &device);
    let e = message(Box::new(move || {
        let _ = fused_attention(q, k, v, &mask, 0.5);
    }));
    assert!(e.contains("do not agree"), "{e}");
    // A LoRA B of the wrong width.
    let (x, w, a, b) = (t(&[5, 6], 1), t(&[6, 7], 2), t(&[6, 2], 3), t(&[2, 9], 4));
    let e = message(Box::new(move || {
        let _ = fused_lora_linear(x, w, a, b, 1.0, None);
    }));
    assert!(e.contains("lora_linear") && e.contains("[2, 9]"), "{e}");
    // SwiGLU halves of different sizes; RMSNorm's gamma not the last axis.
    let (g, u) = (t(&[4, 8], 1), t(&[4, 7], 2));
    let e = message(Box::new(move || {
        let _ = fused_swiglu(g, u);
    }));
    assert!(e.contains("swiglu"), "{e}");
    let x = t(&[4, 8], 1);
    let gamma = Tensor::<1>::from_data(TensorData::new(vec![1.0f32; 5], [5]), &device);
    let e = message(Box::new(move || {
        let _ = fused_rms_norm(x, gamma, 1e-5);
    }));
    assert!(e.contains("rms_norm") && e.contains("gamma"), "{e}");
}
