//! AdamW, clipping and the schedule equal PyTorch's (fixtures/make_optim_golden.py).

use burn::module::{Module, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};
use kd_train::SchedulerType;
use kd_train::advanced::{AdamW, AdamWParams, clip_coefficient, global_grad_norm, learning_rate};

use crate::util::*;

#[derive(Module, Debug)]
struct Params {
    w: Param<Tensor<2>>,
    b: Param<Tensor<1>>,
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn adamw_with_clipping_and_schedule_matches_pytorch() {
    let g: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("golden/adamw.json")).unwrap(),
    )
    .unwrap();
    let device = cpu().autodiff();
    let t2 = |v: Vec<f32>| Tensor::<2>::from_data(TensorData::new(v, [3, 4]), &device);
    let t1 = |v: Vec<f32>| Tensor::<1>::from_data(TensorData::new(v, [4]), &device);
    let mut module = Params {
        w: Param::from_tensor(t2(floats(&g["w0"])).require_grad()),
        b: Param::from_tensor(t1(floats(&g["b0"])).require_grad()),
    };
    let betas = floats(&g["betas"]);
    let params = AdamWParams {
        beta1: betas[0] as f64,
        beta2: betas[1] as f64,
        eps: g["eps"].as_f64().unwrap(),
        weight_decay: g["weight_decay"].as_f64().unwrap(),
    };
    let mut opt = AdamW::default();
    for (step, grads) in g["grads"].as_array().unwrap().iter().enumerate() {
        let mut gp = GradientsParams::new();
        gp.register(module.w.id, t2(floats(&grads["w"])).without_autodiff());
        gp.register(module.b.id, t1(floats(&grads["b"])).without_autodiff());
        let norm = global_grad_norm(&module, &gp);
        let want_norm = g["norms"][step].as_f64().unwrap();
        assert!(
            (norm - want_norm).abs() <= 1e-5 * want_norm,
            "step {step}: norm {norm} vs {want_norm}"
        );
        let lr = learning_rate(SchedulerType::Cosine, 0.05, step, 2, 6);
        assert!(
            (lr - g["lrs"][step].as_f64().unwrap()).abs() < 1e-12,
            "step {step}: lr"
        );
        module = opt.step(module, &gp, params, lr, clip_coefficient(norm, 1.0));
    }
    let w: Vec<f32> = module.w.val().into_data().try_into_vec_as::<f32>().unwrap();
    let b: Vec<f32> = module.b.val().into_data().try_into_vec_as::<f32>().unwrap();
    for (ours, theirs) in w
        .iter()
        .zip(floats(&g["w"]))
        .chain(b.iter().zip(floats(&g["b"])))
    {
        assert!((ours - theirs).abs() <= 2e-6, "{ours} vs {theirs}");
    }
}

#[test]
fn optimizer_state_round_trips() {
    let device = cpu();
    let mut module = Params {
        w: Param::from_tensor(Tensor::<2>::ones([3, 4], &device)),
        b: Param::from_tensor(Tensor::<1>::ones([4], &device)),
    };
    let mut gp = GradientsParams::new();
    gp.register(module.w.id, Tensor::<2>::ones([3, 4], &device) * 0.5);
    gp.register(module.b.id, Tensor::<1>::ones([4], &device));
    let params = AdamWParams {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    let mut opt = AdamW::default();
    module = opt.step(module, &gp, params, 1e-2, 1.0);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("opt.safetensors");
    opt.save(&path).unwrap();
    let mut restored = AdamW::load(&path, opt.steps, &device).unwrap();
    assert_eq!(restored.len(), 2);
    let a = opt.step(module.clone(), &gp, params, 1e-2, 1.0);
    let b = restored.step(module, &gp, params, 1e-2, 1.0);
    assert_eq!(a.w.val().into_data(), b.w.val().into_data());
    assert_eq!(a.b.val().into_data(), b.b.val().into_data());
}
