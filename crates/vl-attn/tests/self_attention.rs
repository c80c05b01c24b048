//! Self-attention: causal (step-by-step == full, padding, the cache) and
//! bidirectional (future tokens count, masks, the ViT's old construction).
#![allow(missing_docs)]

mod common;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, IndexOp, Tensor};
use candle_nn::VarMap;
use common::*;
use vl_attn::mask::{self, PaddingSide};
use vl_attn::{
    AttnError, Backend, CausalSelfAttention, CrossAttention, CrossAttentionConfig, KvCache, Mask,
    SelfAttention, SelfAttentionConfig, Weights,
};

/// A module over plain tensors (initialised through a `VarMap`, then
/// detached), so that `Backend::Fused` really runs the fused kernel.
fn module(hidden: usize, heads: usize, kv_heads: usize) -> (VarMap, CausalSelfAttention) {
    let vars = VarMap::new();
    let cfg = SelfAttentionConfig {
        num_kv_heads: kv_heads,
        ..SelfAttentionConfig::new(hidden, heads)
    };
    CausalSelfAttention::load(vb(&vars, DType::F32), &cfg).expect("init");
    let attn = CausalSelfAttention::load(frozen(&vars, DType::F32), &cfg).expect("load");
    (vars, attn)
}

/// The new tokens' output through `cache`, without weights.
fn cached(
    attn: &CausalSelfAttention,
    x: &Tensor,
    cache: &mut KvCache,
    mask: Option<&Mask>,
) -> Result<Tensor, AttnError> {
    Ok(attn.attend(x, Some(cache), mask, Weights::Skip)?.output)
}

#[test]
fn step_by_step_equals_full() -> anyhow::Result<()> {
    for backend in [Backend::Reference, Backend::Fused] {
        let (_v, attn) = module(32, 4, 2);
        let attn = attn.with_backend(backend);
        let x = randn(&[2, 9, 32]);
        let full = attn.forward(&x, None)?;
        // A prompt of 4, then one token at a time; a capacity of 2 forces growth.
        let mut cache = KvCache::new(2)?;
        let mut outs = vec![cached(&attn, &x.narrow(1, 0, 4)?, &mut cache, None)?];
        for t in 4..9 {
            outs.push(cached(&attn, &x.narrow(1, t, 1)?, &mut cache, None)?);
        }
        assert_eq!(cache.len(), 9);
        assert!(cache.capacity() >= 9);
        let stepped = Tensor::cat(&outs, 1)?;
        let diff = max_abs_diff(&stepped, &full);
        assert!(diff <= 1e-5, "{backend:?}: {diff}");
    }
    Ok(())
}

/// A causal self-attention (32 wide, 4 heads, 2 key heads) and an input
/// `(2, 9, 32)` whose values are multiples of 1/64 in [-0.5, 0.5]: every
/// projection is exact in f32 whatever the number of rows it runs over
/// (products of 1/4096, sums far inside f32's 24 bits), so keys and values
/// rounded to 16 bits are the same from a step and from the whole sequence
/// (an f32 product of 4 rows and of 9 can differ in the last bit, which a
/// 16-bit rounding may turn into a whole 16-bit step).
fn exact_module() -> anyhow::Result<(CausalSelfAttention, Tensor)> {
    let dev = Device::Cpu;
    let grid = |n: usize, seed: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 + seed * 11) % 65) as f32 / 64.0 - 0.5)
            .collect()
    };
    let linear = |rows: usize, seed: usize| -> anyhow::Result<candle_nn::Linear> {
        Ok(candle_nn::Linear::new(
            Tensor::from_vec(grid(rows * 32, seed), (rows, 32), &dev)?,
            Some(Tensor::from_vec(grid(rows, seed + 1), rows, &dev)?),
        ))
    };
    let cfg = SelfAttentionConfig {
        num_kv_heads: 2,
        ..SelfAttentionConfig::new(32, 4)
    };
    let attn = CausalSelfAttention::from_parts(
        linear(32, 1)?,
        linear(16, 2)?,
        linear(16, 3)?,
        linear(32, 4)?,
        &cfg,
    )?;
    let x = Tensor::from_vec(grid(2 * 9 * 32, 5), (2, 9, 32), &dev)?;
    Ok((attn, x))
}

/// Keys and values kept in 16 bits (under f32 activations; what
/// `quantize` chooses on the CPU unless told otherwise): the cache holds the f32 ones rounded
/// once, step-by-step still equals the whole sequence (which rounds them
/// alike) within 1e-5 on every backend, and the output is the one over
/// their f32 widening.
#[test]
fn a_16_bit_cache_steps_as_the_whole_sequence() -> anyhow::Result<()> {
    let (wide, x) = exact_module()?;
    // The f32 keys and values, appended as below (a prompt of 4, then one
    // token at a time: the projections of 4 rows and of 1 round alike).
    let mut f32_cache = KvCache::new(16)?;
    cached(&wide, &x.narrow(1, 0, 4)?, &mut f32_cache, None)?;
    for t in 4..9 {
        cached(&wide, &x.narrow(1, t, 1)?, &mut f32_cache, None)?;
    }
    let (k32, v32) = f32_cache.current()?.expect("appended");
    for half in [DType::BF16, DType::F16] {
        let attn = wide.clone().with_cache_dtype(Some(half));
        assert_eq!(attn.cache_dtype(), Some(half));
        for backend in [Backend::Reference, Backend::Fused, Backend::Auto] {
            let attn = attn.clone().with_backend(backend);
            let full = attn.forward(&x, None)?;
            let mut cache = KvCache::new(2)?;
            let mut outs = vec![cached(&attn, &x.narrow(1, 0, 4)?, &mut cache, None)?];
            for t in 4..9 {
                outs.push(cached(&attn, &x.narrow(1, t, 1)?, &mut cache, None)?);
            }
            let (k, v) = cache.current()?.expect("appended");
            assert_eq!((k.dtype(), v.dtype()), (half, half));
            let rounded = |t: &Tensor| -> anyhow::Result<Tensor> {
                Ok(t.to_dtype(half)?.to_dtype(DType::F32)?)
            };
            assert_eq!(max_abs_diff(&k.to_dtype(DType::F32)?, &rounded(&k32)?), 0.0);
            assert_eq!(max_abs_diff(&v.to_dtype(DType::F32)?, &rounded(&v32)?), 0.0);
            let stepped = Tensor::cat(&outs, 1)?;
            let diff = max_abs_diff(&stepped, &full);
            assert!(diff <= 1e-5, "{half:?} {backend:?}: {diff}");
            // Not the f32 cache's output: the rounding is really there.
            assert!(max_abs_diff(&full, &wide.forward(&x, None)?) > 0.0);
        }
    }
    // Quantization keeps a choice made; unasked, it keeps keys and values
    // as cross-attention keeps an image's: bf16 for 8-bit and bf16
    // weights, f16 for f16 weights; none for f32 "weights".
    for (format, cache) in [
        (GgmlDType::Q8_0, Some(DType::BF16)),
        (GgmlDType::BF16, Some(DType::BF16)),
        (GgmlDType::F16, Some(DType::F16)),
        (GgmlDType::F32, None),
    ] {
        assert_eq!(wide.quantize(format)?.cache_dtype(), cache, "{format:?}");
        for chosen in [DType::F16, DType::F32] {
            let kept = wide.clone().with_cache_dtype(Some(chosen));
            assert_eq!(kept.quantize(format)?.cache_dtype(), Some(chosen));
        }
    }
    Ok(())
}

#[test]
fn future_tokens_do_not_leak() -> anyhow::Result<()> {
    let (_v, attn) = module(16, 2, 2);
    let x = randn(&[1, 6, 16]);
    let mut y = x.clone();
    y = Tensor::cat(&[y.narrow(1, 0, 4)?, randn(&[1, 2, 16])], 1)?;
    let (a, b) = (attn.forward(&x, None)?, attn.forward(&y, None)?);
    assert!(max_abs_diff(&a.narrow(1, 0, 4)?, &b.narrow(1, 0, 4)?) <= 1e-6);
    Ok(())
}

#[test]
fn left_padding_equals_unpadded() -> anyhow::Result<()> {
    let (_v, attn) = module(16, 4, 4);
    let short = randn(&[1, 3, 16]);
    let long = randn(&[1, 5, 16]);
    // Batch: the short sample left-padded with 2 junk tokens.
    let padded = Tensor::cat(&[randn(&[1, 2, 16]), short.clone()], 1)?;
    let batch = Tensor::cat(&[padded, long.clone()], 0)?;
    let keys = mask::key_padding(&[3, 5], 5, PaddingSide::Left, &Device::Cpu)?;
    let key_mask = Mask::from_keys(&keys)?;
    let out = attn.forward(&batch, Some(&key_mask))?;
    let alone = attn.forward(&short, None)?;
    assert!(max_abs_diff(&out.i(0)?.narrow(0, 2, 3)?, &alone.i(0)?) <= 1e-5);
    assert!(max_abs_diff(&out.i(1)?, &attn.forward(&long, None)?.i(0)?) <= 1e-5);
    // Padding rows attend to nothing: exact zeros, no NaN.
    assert_eq!(
        out.i(0)?
            .narrow(0, 0, 2)?
            .abs()?
            .sum_all()?
            .to_scalar::<f32>()?,
        0.0
    );

    // The same with a cache, then one decode step with the grown key mask.
    let mut cache = KvCache::new(8)?;
    let pre = cached(&attn, &batch, &mut cache, Some(&key_mask))?;
    assert!(max_abs_diff(&pre, &out) <= 1e-6);
    let next = randn(&[2, 1, 16]);
    let keys6 = mask::key_padding(&[4, 6], 6, PaddingSide::Left, &Device::Cpu)?;
    let step = cached(&attn, &next, &mut cache, Some(&Mask::from_keys(&keys6)?))?;
    let alone6 = attn.forward(&Tensor::cat(&[short, next.i(0..1)?], 1)?, None)?;
    assert!(max_abs_diff(&step.i(0)?, &alone6.i(0)?.narrow(0, 3, 1)?) <= 1e-5);
    Ok(())
}

#[test]
fn cache_index_select_and_reset() -> anyhow::Result<()> {
    let (_v, attn) = module(16, 2, 1);
    let x = randn(&[2, 4, 16]);
    // Room for 8: the cached rows are a non-contiguous view of the buffer.
    let mut cache = KvCache::new(8)?;
    cached(&attn, &x, &mut cache, None)?;
    // Keep sample 1 twice (two beams of it).
    cache.index_select(&Tensor::new(&[1u32, 1], &Device::Cpu)?)?;
    let next = randn(&[1, 1, 16]).repeat((2, 1, 1))?;
    let out = cached(&attn, &next, &mut cache, None)?;
    let want = attn.forward(&Tensor::cat(&[x.i(1..2)?, next.i(0..1)?], 1)?, None)?;
    assert!(max_abs_diff(&out.i(0)?, &want.i(0)?.narrow(0, 4, 1)?) <= 1e-5);
    assert!(max_abs_diff(&out.i(0)?, &out.i(1)?) == 0.0);
    cache.reset();
    assert!(cache.is_empty());
    let again = cached(&attn, &x.i(0..2)?, &mut cache, None)?;
    assert!(max_abs_diff(&again, &attn.forward(&x, None)?) <= 1e-6);
    Ok(())
}

#[test]
fn wrong_inputs_are_errors() -> anyhow::Result<()> {
    let (_v, attn) = module(16, 2, 2);
    let err = attn.forward(&randn(&[2, 3, 8]), None).unwrap_err();
    assert!(
        err.to_string().contains("x:") && err.to_string().contains("16"),
        "{err}"
    );
    let mut cache = KvCache::new(4)?;
    cached(&attn, &randn(&[2, 3, 16]), &mut cache, None)?;
    // A different batch than the cache holds.
    let err = cached(&attn, &randn(&[3, 1, 16]), &mut cache, None).unwrap_err();
    assert!(err.to_string().contains("cache"), "{err}");
    let err = cached(
        &attn,
        &randn(&[2, 1, 16]),
        &mut cache,
        Some(&Mask::from_keys(&Tensor::ones(
            (2, 3),
            DType::U8,
            &Device::Cpu,
        )?)?),
    )
    .unwrap_err();
    assert!(err.to_string().contains("mask"), "{err}");
    Ok(())
}

fn bidirectional(hidden: usize, heads: usize, kv_heads: usize) -> (VarMap, SelfAttention) {
    let vars = VarMap::new();
    let cfg = SelfAttentionConfig {
        num_kv_heads: kv_heads,
        ..SelfAttentionConfig::new(hidden, heads)
    };
    SelfAttention::load(vb(&vars, DType::F32), &cfg).expect("init");
    let attn = SelfAttention::load(frozen(&vars, DType::F32), &cfg).expect("load");
    (vars, attn)
}

/// The non-causal attention is the attention of the tokens over
/// themselves that the ViT used to build from a `CrossAttention(x, x)`:
/// same weights, same output within 1e-6, on both backends.
#[test]
fn bidirectional_equals_cross_attention_over_itself() -> anyhow::Result<()> {
    let (vars, attn) = bidirectional(32, 4, 4);
    let cross = CrossAttention::load(
        frozen(&vars, DType::F32),
        &CrossAttentionConfig::new(32, 32, 4),
    )?;
    let x = randn(&[2, 7, 32]);
    let want = cross.forward(&x, &x, None)?;
    for backend in [Backend::Reference, Backend::Fused] {
        let got = attn.clone().with_backend(backend).forward(&x, None)?;
        let d = max_abs_diff(&got, &want);
        // The same arithmetic in another order (the two modules project
        // keys and values in separate products): measured up to 1.4e-6 on
        // unseeded inputs, so 1e-5.
        assert!(d <= 1e-5, "{backend:?}: {d}");
    }
    Ok(())
}

/// Later tokens change earlier outputs (unlike the causal attention), the
/// weights of every query cover every key, and rows sum to 1.
#[test]
fn bidirectional_sees_the_future() -> anyhow::Result<()> {
    let (_v, attn) = bidirectional(16, 2, 1);
    let x = randn(&[1, 5, 16]);
    let y = Tensor::cat(&[x.narrow(1, 0, 4)?, randn(&[1, 1, 16])], 1)?;
    let (a, b) = (attn.forward(&x, None)?, attn.forward(&y, None)?);
    assert!(max_abs_diff(&a.narrow(1, 0, 1)?, &b.narrow(1, 0, 1)?) > 1e-4);
    let out = attn.attend(&x, None, Weights::Return)?;
    let w = out
        .weights
        .ok_or_else(|| anyhow::anyhow!("weights were asked for"))?;
    assert_eq!(w.dims(), &[1, 2, 5, 5]);
    assert!(
        max_abs_diff(
            &w.sum(3)?,
            &Tensor::ones((1, 2, 5), DType::F32, &Device::Cpu)?
        ) <= 1e-6
    );
    // The first query gives the last key some weight: no causal mask.
    assert!(w.i((0, 0, 0, 4))?.to_scalar::<f32>()? > 0.0);
    // `forward` may take the fused kernel, `attend` with weights the
    // reference one: two summation orders over unseeded inputs, so 1e-5
    // (1.4e-6 seen).
    let d = max_abs_diff(&out.output, &a);
    assert!(d <= 1e-5, "{d}");
    Ok(())
}

/// A right-padded sample equals the unpadded one (padding keys are masked,
/// whatever they hold); a query whose keys are all masked gets zeros.
#[test]
fn bidirectional_key_mask() -> anyhow::Result<()> {
    for backend in [Backend::Reference, Backend::Fused] {
        let (_v, attn) = bidirectional(16, 4, 2);
        let attn = attn.with_backend(backend);
        let short = randn(&[1, 3, 16]);
        let padded = Tensor::cat(&[short.clone(), (randn(&[1, 2, 16]) * 1e3)?], 1)?;
        let keys = mask::key_padding(&[3, 0], 5, PaddingSide::Right, &Device::Cpu)?;
        let batch = Tensor::cat(&[padded, randn(&[1, 5, 16])], 0)?;
        let out = attn.forward(&batch, Some(&Mask::from_keys(&keys)?))?;
        let alone = attn.forward(&short, None)?;
        let d = max_abs_diff(&out.i(0)?.narrow(0, 0, 3)?, &alone.i(0)?);
        assert!(d <= 1e-5, "{backend:?}: {d}");
        assert_eq!(out.i(1)?.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
        let err = attn
            .forward(&batch, Some(&Mask::from_keys(&keys.narrow(1, 0, 4)?)?))
            .unwrap_err();
        assert!(matches!(err, AttnError::Shape { arg: "mask", .. }), "{err}");
    }
    Ok(())
}
