//! Helpers shared by the vl-attn tests.
#![allow(dead_code, missing_docs)]

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};

pub fn vb(vars: &VarMap, dtype: DType) -> VarBuilder<'static> {
    VarBuilder::from_varmap(vars, dtype, &Device::Cpu)
}

/// A builder over plain tensors (not `Var`s) holding copies of `vars`'
/// current values: modules loaded from it do not track gradients, so that
/// `Backend::Fused` serves them (it refuses inputs that track gradients).
pub fn frozen(vars: &VarMap, dtype: DType) -> VarBuilder<'static> {
    let tensors = vars
        .data()
        .lock()
        .expect("vars")
        .iter()
        .map(|(name, var)| (name.clone(), var.as_tensor().detach()))
        .collect::<std::collections::HashMap<_, _>>();
    VarBuilder::from_tensors(tensors, dtype, &Device::Cpu)
}

pub fn randn(shape: &[usize]) -> Tensor {
    Tensor::randn(0f32, 1., shape, &Device::Cpu).expect("randn")
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a.to_dtype(DType::F32).expect("dtype") - b.to_dtype(DType::F32).expect("dtype"))
        .expect("sub")
        .abs()
        .expect("abs")
        .flatten_all()
        .expect("flatten")
        .max(0)
        .expect("max")
        .to_scalar::<f32>()
        .expect("scalar")
}

pub fn all_finite(t: &Tensor) -> bool {
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .expect("to_vec")
        .iter()
        .all(|x| x.is_finite())
}

/// A random 0/1 mask with the given shape.
pub fn random_mask(shape: &[usize], density: f64) -> Tensor {
    Tensor::rand(0f32, 1., shape, &Device::Cpu)
        .and_then(|t| t.lt(density))
        .expect("mask")
}

/// Deterministic standard-normal-ish data from a seed (sum of uniforms), so
/// that a failing property case reproduces.
pub fn seeded(shape: &[usize], seed: u64) -> Tensor {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut uniform = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32
    };
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|_| (0..4).map(|_| uniform()).sum::<f32>() - 2.0)
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).expect("seeded")
}

/// A deterministic 0/1 `u8` mask; `density` of ones.
pub fn seeded_mask(shape: &[usize], seed: u64, density: f32) -> Tensor {
    seeded(shape, seed ^ 0xABCD)
        .lt((density - 0.5) * 2.0)
        .expect("mask")
}

/// `shape` filled from a seeded generator (splitmix64), roughly normal
/// (a sum of four uniforms, variance 1): for tests whose bound depends on
/// the values, which candle's unseeded `randn` would make flaky.
pub fn seeded_randn(shape: &[usize], seed: u64) -> Tensor {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f32 / (1u64 << 53) as f32 - 0.5
    };
    let n: usize = shape.iter().product();
    // Four uniforms on [-0.5, 0.5): variance 4/12, scaled to 1.
    let values: Vec<f32> = (0..n)
        .map(|_| (next() + next() + next() + next()) * 3f32.sqrt())
        .collect();
    Tensor::from_vec(values, shape, &Device::Cpu).expect("seeded tensor")
}

/// Every variable of `vars` (by sorted name) set from [`seeded_randn`]:
/// norms' weights to 1, biases to 0, other weights scaled by
/// `1/sqrt(fan_in)`, so that a model built on `vars` is the same on every
/// run.
pub fn seed_vars(vars: &candle_nn::VarMap, seed: u64) {
    let data = vars.data().lock().expect("vars");
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for (i, name) in names.into_iter().enumerate() {
        let var = &data[name];
        let dims = var.as_tensor().dims().to_vec();
        let t = if name.contains("norm") && name.ends_with("weight") {
            Tensor::ones(dims.as_slice(), DType::F32, &Device::Cpu).expect("ones")
        } else if name.ends_with("bias") {
            Tensor::zeros(dims.as_slice(), DType::F32, &Device::Cpu).expect("zeros")
        } else {
            let fan_in = *dims.last().unwrap_or(&1) as f64;
            (seeded_randn(&dims, seed.wrapping_add(i as u64)) / fan_in.sqrt()).expect("scale")
        };
        var.set(&t.to_dtype(var.as_tensor().dtype()).expect("dtype"))
            .expect("set");
    }
}
