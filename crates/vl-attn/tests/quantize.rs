//! Quantized projections: outputs close to dense, caches still agree,
//! half-precision activations, clear errors on unsupported widths.
//!
//! Tolerances (relative L2 error of the module output against the dense
//! module, four quantized projections in series): q8_0 < 2% (seen: about
//! 1.1%), q4k < 20% (seen: about 12%; one 4-bit projection alone is about
//! 7%). Cached against uncached decoding of the same quantized module: max
//! abs difference < 1e-4 (seen: 0).
#![allow(missing_docs)]

mod common;

use candle_core::quantized::GgmlDType;
use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use common::*;
use vl_attn::{
    AttnError, CausalSelfAttention, CrossAttention, CrossAttentionConfig, SelfAttention,
    SelfAttentionConfig, Weights,
};

const Q8_TOL: f32 = 0.02;
const Q4K_TOL: f32 = 0.2;

fn rel_err(got: &Tensor, want: &Tensor) -> anyhow::Result<f32> {
    let got = got.to_dtype(DType::F32)?;
    let want = want.to_dtype(DType::F32)?;
    let num = (&got - &want)?
        .sqr()?
        .sum_all()?
        .sqrt()?
        .to_scalar::<f32>()?;
    let den = want.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?;
    Ok(num / den)
}

#[test]
fn cross_attention_close_to_dense() -> anyhow::Result<()> {
    for (format, width, tol) in [
        (GgmlDType::Q8_0, 64, Q8_TOL),
        (GgmlDType::Q4K, 256, Q4K_TOL),
    ] {
        let vars = VarMap::new();
        let cfg = CrossAttentionConfig::new(width, width, 4);
        let dense = CrossAttention::load(vb(&vars, DType::F32), &cfg)?;
        let q = dense.quantize(format)?;
        assert_eq!(q.quantization(), Some(format));
        assert_eq!(dense.quantization(), None);
        let (text, image) = (seeded(&[2, 3, width], 1), seeded(&[2, 17, width], 2));
        let want = dense.forward(&text, &image, None)?;
        let got = q.forward(&text, &image, None)?;
        let err = rel_err(&got, &want)?;
        assert!(err < tol, "{format:?}: relative error {err} >= {tol}");
        // The projected memory is used the same way as the dense one.
        let kv = q.project_memory(&image)?;
        let cached = q.attend(&text, &kv, None, Weights::Skip)?.output;
        assert!(max_abs_diff(&cached, &got) < 1e-6);
    }
    Ok(())
}

/// Quantized self-attention step by step (a cache that grows past its
/// first capacity) against the full pass. With 3 positions both run the
/// same kernels (vl's q8_0 products compute each row alike whatever the
/// row count; the per-row attention kernel for both): equal to 1e-6. With
/// 6, the full pass takes the tiled attention kernel, whose sums differ
/// in the last bits, and rounding the output projection's input to 8 bits
/// can turn that into one 8-bit step: within 1% (relative L2), where a
/// caching mistake (a wrong position or key) is of order 1.
#[test]
fn self_attention_cached_equals_uncached() -> anyhow::Result<()> {
    let vars = VarMap::new();
    let dense = CausalSelfAttention::load(vb(&vars, DType::F32), &SelfAttentionConfig::new(64, 4))?;
    let q = dense.quantize(GgmlDType::Q8_0)?;
    for (len, same_kernels) in [(3, true), (6, false)] {
        let x = seeded(&[2, len, 64], 3);
        let full = q.forward(&x, None)?;
        assert!(rel_err(&full, &dense.forward(&x, None)?)? < Q8_TOL);
        let mut cache = q.new_cache(2)?;
        let steps = (0..len)
            .map(|i| {
                q.attend(&x.narrow(1, i, 1)?, Some(&mut cache), None, Weights::Skip)
                    .map(|o| o.output)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let steps = Tensor::cat(&steps, 1)?;
        if same_kernels {
            let diff = max_abs_diff(&steps, &full);
            assert!(diff <= 1e-6, "cached vs uncached, {len} positions: {diff}");
        } else {
            let err = rel_err(&steps, &full)?;
            assert!(err < 1e-2, "cached vs uncached, {len} positions: {err}");
        }
    }
    Ok(())
}

/// A bf16 or f16 module stays one after quantization: it takes and returns
/// that dtype, within 3% of the dense f32 module.
#[test]
fn half_precision_activations() -> anyhow::Result<()> {
    let vars = VarMap::new();
    let cfg = CrossAttentionConfig::new(64, 96, 4);
    let dense = CrossAttention::load(vb(&vars, DType::F32), &cfg)?;
    let (text, image) = (seeded(&[1, 4, 64], 4), seeded(&[1, 9, 96], 5));
    let want = dense.forward(&text, &image, None)?;
    for dtype in [DType::BF16, DType::F16] {
        // The same weights, cast.
        let cast = vars
            .data()
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned VarMap"))?
            .iter()
            .map(|(name, var)| Ok((name.clone(), var.as_tensor().to_dtype(dtype)?)))
            .collect::<anyhow::Result<HashMap<_, _>>>()?;
        let half = CrossAttention::load(VarBuilder::from_tensors(cast, dtype, &Device::Cpu), &cfg)?;
        let q = half.quantize(GgmlDType::Q8_0)?;
        let got = q.forward(&text.to_dtype(dtype)?, &image.to_dtype(dtype)?, None)?;
        assert_eq!(got.dtype(), dtype);
        let err = rel_err(&got, &want)?;
        assert!(err < 0.03, "{dtype:?}: relative error {err}");
        // f32 activations into a bf16 module are still refused.
        assert!(matches!(
            q.forward(&text, &image.to_dtype(dtype)?, None),
            Err(AttnError::DType { .. })
        ));
    }
    Ok(())
}

#[test]
fn unsupported_width_names_the_projection() -> anyhow::Result<()> {
    let vars = VarMap::new();
    // memory_dim 48 is not a multiple of q8_0's block of 32.
    let cross = CrossAttention::load(vb(&vars, DType::F32), &CrossAttentionConfig::new(64, 48, 4))?;
    let err = cross
        .quantize(GgmlDType::Q8_0)
        .err()
        .map(|e| e.within("cross_attn").to_string())
        .unwrap_or_default();
    assert!(
        err.contains("cross_attn.k_proj") && err.contains("48") && err.contains("32"),
        "{err}"
    );
    // hidden 64 is fine for q8_0 but not for q4k (256).
    let vars = VarMap::new();
    let attn = CausalSelfAttention::load(vb(&vars, DType::F32), &SelfAttentionConfig::new(64, 4))?;
    assert!(attn.quantize(GgmlDType::Q8_0).is_ok());
    match attn.quantize(GgmlDType::Q4K) {
        Err(AttnError::Quantize {
            layer,
            in_dim: 64,
            block: 256,
            ..
        }) => assert_eq!(layer, "q_proj"),
        other => panic!("expected a Quantize error, got {other:?}"),
    }
    Ok(())
}

/// The bidirectional self-attention quantizes like the others: q8_0 within
/// the same tolerance of the dense module, and a hidden width of 48 is
/// refused naming `q_proj`.
#[test]
fn bidirectional_self_attention_quantizes() -> anyhow::Result<()> {
    let vars = VarMap::new();
    let dense = SelfAttention::load(vb(&vars, DType::F32), &SelfAttentionConfig::new(64, 4))?;
    let q = dense.quantize(GgmlDType::Q8_0)?;
    assert_eq!(q.quantization(), Some(GgmlDType::Q8_0));
    let x = seeded(&[2, 9, 64], 6);
    let err = rel_err(&q.forward(&x, None)?, &dense.forward(&x, None)?)?;
    assert!(err < Q8_TOL, "relative error {err} >= {Q8_TOL}");
    let vars = VarMap::new();
    let narrow = SelfAttention::load(vb(&vars, DType::F32), &SelfAttentionConfig::new(48, 4))?;
    match narrow.quantize(GgmlDType::Q8_0) {
        Err(AttnError::Quantize {
            layer,
            in_dim: 48,
            block: 32,
            ..
        }) => assert_eq!(layer, "q_proj"),
        other => panic!("expected a Quantize error, got {other:?}"),
    }
    Ok(())
}
