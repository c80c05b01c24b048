//! Dropout: range checks, inference is the identity, the kept fraction and
//! the mean in training, seeded masks, attention-probability dropout on
//! every backend and its gradients.
#![allow(missing_docs)]

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use common::*;
use vl_attn::attention::{attention, attention_with_dropout};
use vl_attn::{
    Backend, CausalSelfAttention, CrossAttention, CrossAttentionConfig, Dropout, DropoutRng, Mode,
    SelfAttentionConfig, Weights,
};

/// Elements of the tensors whose kept fraction is measured.
const LARGE: usize = 100_000;
/// Allowed gap between the kept fraction and `1 - p` on [`LARGE`]
/// elements: the fraction's standard deviation is at most
/// `sqrt(0.25 / LARGE)` ≈ 0.0016, so this is over 6 of them.
const KEPT_TOLERANCE: f64 = 0.01;
/// Standard deviations allowed between the mean of a dropped tensor of ones
/// and 1.
const MEAN_SIGMAS: f64 = 5.0;
/// Seed of the tests' masks.
const SEED: u64 = 7;
/// Float tolerance of the attention comparisons (sums of a few products in
/// f32, measured differences around 1e-7).
const TOL: f32 = 1e-5;

fn ones(n: usize) -> Tensor {
    Tensor::ones(n, DType::F32, &Device::Cpu).expect("ones")
}

fn dropout(p: f64) -> Dropout {
    Dropout::new("p", p).expect("valid p")
}

#[test]
fn p_out_of_range_is_an_error_naming_the_field() {
    for p in [-0.1, 1.0, 1.5, f64::NAN] {
        let err = Dropout::new("attention_dropout", p)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.starts_with("attention_dropout:") && err.contains(&p.to_string()),
            "{p}: {err}"
        );
    }
    for p in [0.0, 0.5, 0.999] {
        assert!(Dropout::new("attention_dropout", p).is_ok(), "{p}");
    }
}

/// Inference, or p = 0 in training, returns the input itself.
#[test]
fn inference_and_zero_p_are_the_identity() -> anyhow::Result<()> {
    let x = randn(&[3, 4, 5]);
    for (d, mode) in [
        (dropout(0.5), Mode::Inference),
        (Dropout::NONE, Mode::training(SEED)),
    ] {
        let y = d.forward(&x, &mode)?;
        assert_eq!(max_abs_diff(&x, &y), 0.0, "{d:?} {mode:?}");
        assert_eq!(x.id(), y.id(), "{d:?} {mode:?}: not the input itself");
    }
    Ok(())
}

/// In training, a fraction 1 - p of the elements is kept, each scaled by
/// 1 / (1 - p), so the mean of a tensor of ones stays 1.
#[test]
fn kept_fraction_and_mean_in_training() -> anyhow::Result<()> {
    let x = ones(LARGE);
    let mode = Mode::training(SEED);
    for p in [0.1, 0.5, 0.9] {
        let y = dropout(p).forward(&x, &mode)?.to_vec1::<f32>()?;
        let kept: Vec<f32> = y.iter().copied().filter(|&v| v != 0.0).collect();
        let fraction = kept.len() as f64 / LARGE as f64;
        assert!(
            (fraction - (1.0 - p)).abs() <= KEPT_TOLERANCE,
            "p {p}: kept {fraction}"
        );
        let scale = (1.0 / (1.0 - p)) as f32;
        assert!(
            kept.iter()
                .all(|&v| (v - scale).abs() <= scale * f32::EPSILON),
            "p {p}: kept values are not 1 / (1 - p) = {scale}"
        );
        let mean = y.iter().map(|&v| f64::from(v)).sum::<f64>() / LARGE as f64;
        // Each element is Bernoulli(1 - p) / (1 - p): variance p / (1 - p).
        let sigma = (p / (1.0 - p) / LARGE as f64).sqrt();
        assert!(
            (mean - 1.0).abs() <= MEAN_SIGMAS * sigma,
            "p {p}: mean {mean}, allowed 1 ± {}",
            MEAN_SIGMAS * sigma
        );
    }
    Ok(())
}

#[test]
fn same_seed_same_masks_other_seed_other_masks() -> anyhow::Result<()> {
    let x = ones(1000);
    let d = dropout(0.5);
    let draw2 = |seed| -> anyhow::Result<(Tensor, Tensor)> {
        let mode = Mode::training(seed);
        Ok((d.forward(&x, &mode)?, d.forward(&x, &mode)?))
    };
    let (a1, a2) = draw2(SEED)?;
    let (b1, b2) = draw2(SEED)?;
    let (c1, _) = draw2(SEED + 1)?;
    assert_eq!(max_abs_diff(&a1, &b1), 0.0);
    assert_eq!(max_abs_diff(&a2, &b2), 0.0);
    assert!(max_abs_diff(&a1, &a2) > 0.0, "successive draws repeat");
    assert!(max_abs_diff(&a1, &c1) > 0.0, "another seed, the same mask");
    // Clones share the counter: they draw the next masks, not the same.
    let rng = DropoutRng::new(SEED);
    let (m1, m2) = (Mode::Training(rng.clone()), Mode::Training(rng.clone()));
    assert_eq!(max_abs_diff(&d.forward(&x, &m1)?, &a1), 0.0);
    assert_eq!(max_abs_diff(&d.forward(&x, &m2)?, &a2), 0.0);
    assert_eq!(rng.draws(), 2);
    Ok(())
}

/// Attention dropout drops probabilities, not outputs: the output is
/// `(softmax(q kᵀ · scale) ⊙ M) v` with M the mask the same seed draws
/// first, and the gradients flow through the kept probabilities.
#[test]
fn attention_dropout_masks_probabilities_and_gradients_flow() -> anyhow::Result<()> {
    let (b, h, tq, tk, hd) = (2, 2, 5, 7, 4);
    let scale = 0.5;
    let d = dropout(0.5);
    let q = Var::from_tensor(&randn(&[b, h, tq, hd]))?;
    let k = randn(&[b, h, tk, hd]);
    let v = Var::from_tensor(&randn(&[b, h, tk, hd]))?;
    let mode = Mode::training(SEED);
    let out = attention_with_dropout(
        q.as_tensor(),
        &k,
        v.as_tensor(),
        None,
        scale,
        Backend::Reference,
        Weights::Return,
        (d, &mode),
    )?;
    let weights = out.weights.expect("weights asked for");
    let mask = d.forward(
        &Tensor::ones((b, h, tq, tk), DType::F32, &Device::Cpu)?,
        &Mode::training(SEED),
    )?;
    let kept = (weights.detach() * &mask)?;
    let want = kept.matmul(&v.as_tensor().detach())?;
    assert!(max_abs_diff(&out.output, &want) <= TOL);
    // Dropout changed something: some probability was dropped.
    let plain = attention(
        q.as_tensor(),
        &k,
        v.as_tensor(),
        None,
        scale,
        Backend::Reference,
        Weights::Skip,
    )?;
    assert!(max_abs_diff(&out.output, &plain.output) > TOL);

    let grads = out.output.sum_all()?.backward()?;
    // d sum(out) / dv = (w ⊙ M)ᵀ · 1
    let grad_v = grads.get(v.as_tensor()).expect("v's gradient");
    let want_v = kept
        .t()?
        .matmul(&Tensor::ones((b, h, tq, hd), DType::F32, &Device::Cpu)?)?;
    assert!(max_abs_diff(grad_v, &want_v) <= TOL);
    let grad_q = grads.get(q.as_tensor()).expect("q's gradient");
    let norm = grad_q.sqr()?.sum_all()?.to_scalar::<f32>()?;
    assert!(norm.is_finite() && norm > 0.0, "q's gradient: {norm}");
    Ok(())
}

/// While dropout is active, `Auto` takes the reference path (even for a
/// decode-length query it would send to the fused kernel) and `Fused`
/// refuses; in inference both run as without dropout.
#[test]
fn backends_under_dropout() -> anyhow::Result<()> {
    let q = randn(&[1, 2, 1, 4]);
    let k = randn(&[1, 2, 6, 4]);
    let d = dropout(0.5);
    let run = |backend, mode: &Mode| {
        attention_with_dropout(&q, &k, &k, None, 0.5, backend, Weights::Skip, (d, mode))
    };
    let auto = run(Backend::Auto, &Mode::training(SEED))?.output;
    let reference = run(Backend::Reference, &Mode::training(SEED))?.output;
    assert_eq!(max_abs_diff(&auto, &reference), 0.0);
    let err = run(Backend::Fused, &Mode::training(SEED))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.starts_with("backend:") && err.contains("dropout"),
        "{err}"
    );
    for backend in [Backend::Auto, Backend::Reference, Backend::Fused] {
        let with = run(backend, &Mode::Inference)?.output;
        let without = attention(&q, &k, &k, None, 0.5, backend, Weights::Skip)?.output;
        assert_eq!(max_abs_diff(&with, &without), 0.0, "{backend:?}");
    }
    Ok(())
}

/// Modules: a dropout set on a module changes nothing in inference (bit for
/// bit, every backend) and changes the output in training.
#[test]
fn modules_apply_attention_dropout_only_in_training() -> anyhow::Result<()> {
    let vars = VarMap::new();
    let cross_cfg = CrossAttentionConfig::new(16, 12, 4);
    CrossAttention::load(vb(&vars, DType::F32), &cross_cfg)?;
    let self_cfg = SelfAttentionConfig::new(16, 4);
    let self_vars = VarMap::new();
    CausalSelfAttention::load(vb(&self_vars, DType::F32), &self_cfg)?;
    let (x, memory) = (randn(&[2, 5, 16]), randn(&[2, 9, 12]));
    for backend in [Backend::Auto, Backend::Reference, Backend::Fused] {
        let cross =
            CrossAttention::load(frozen(&vars, DType::F32), &cross_cfg)?.with_backend(backend);
        let mut dropped = cross.clone().with_attention_dropout(dropout(0.5));
        assert_eq!(
            max_abs_diff(
                &cross.forward(&x, &memory, None)?,
                &dropped.forward(&x, &memory, None)?
            ),
            0.0,
            "cross {backend:?}"
        );
        let causal = CausalSelfAttention::load(frozen(&self_vars, DType::F32), &self_cfg)?
            .with_backend(backend);
        let mut causal_dropped = causal.clone().with_attention_dropout(dropout(0.5));
        assert_eq!(
            max_abs_diff(
                &causal.forward(&x, None)?,
                &causal_dropped.forward(&x, None)?
            ),
            0.0,
            "causal {backend:?}"
        );
        if backend == Backend::Fused {
            continue;
        }
        dropped.set_mode(Mode::training(SEED));
        causal_dropped.set_mode(Mode::training(SEED));
        assert!(
            max_abs_diff(
                &cross.forward(&x, &memory, None)?,
                &dropped.forward(&x, &memory, None)?
            ) > TOL
        );
        assert!(
            max_abs_diff(
                &causal.forward(&x, None)?,
                &causal_dropped.forward(&x, None)?
            ) > TOL
        );
    }
    Ok(())
}
