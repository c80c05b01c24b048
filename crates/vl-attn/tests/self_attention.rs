//! Causal self-attention: step-by-step == full, padding, the cache.
#![allow(missing_docs)]

mod common;

use candle_core::{DType, Device, IndexOp, Tensor};
use candle_nn::VarMap;
use common::*;
use vl_attn::mask::{self, PaddingSide};
use vl_attn::{Backend, CausalSelfAttention, KvCache, Mask, SelfAttentionConfig};

fn module(hidden: usize, heads: usize, kv_heads: usize) -> (VarMap, CausalSelfAttention) {
    let vars = VarMap::new();
    let cfg = SelfAttentionConfig {
        num_kv_heads: kv_heads,
        ..SelfAttentionConfig::new(hidden, heads)
    };
    let attn = CausalSelfAttention::load(vb(&vars, DType::F32), &cfg).expect("load");
    (vars, attn)
}

#[test]
fn step_by_step_equals_full() -> anyhow::Result<()> {
    for backend in [Backend::Reference, Backend::Fused] {
        let (_v, attn) = module(32, 4, 2);
        let attn = attn.with_backend(backend);
        let x = randn(&[2, 9, 32]);
        let full = attn.forward(&x, None)?;
        // A prompt of 4, then one token at a time; a capacity of 2 forces growth.
        let mut cache = KvCache::new(2);
        let mut outs = vec![attn.forward_cached(&x.narrow(1, 0, 4)?, &mut cache, None)?];
        for t in 4..9 {
            outs.push(attn.forward_cached(&x.narrow(1, t, 1)?, &mut cache, None)?);
        }
        assert_eq!(cache.len(), 9);
        assert!(cache.capacity() >= 9);
        let stepped = Tensor::cat(&outs, 1)?;
        let diff = max_abs_diff(&stepped, &full);
        assert!(diff <= 1e-5, "{backend:?}: {diff}");
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
    let mut cache = KvCache::new(8);
    let pre = attn.forward_cached(&batch, &mut cache, Some(&key_mask))?;
    assert!(max_abs_diff(&pre, &out) <= 1e-6);
    let next = randn(&[2, 1, 16]);
    let keys6 = mask::key_padding(&[4, 6], 6, PaddingSide::Left, &Device::Cpu)?;
    let step = attn.forward_cached(&next, &mut cache, Some(&Mask::from_keys(&keys6)?))?;
    let alone6 = attn.forward(&Tensor::cat(&[short, next.i(0..1)?], 1)?, None)?;
    assert!(max_abs_diff(&step.i(0)?, &alone6.i(0)?.narrow(0, 3, 1)?) <= 1e-5);
    Ok(())
}

#[test]
fn cache_index_select_and_reset() -> anyhow::Result<()> {
    let (_v, attn) = module(16, 2, 1);
    let x = randn(&[2, 4, 16]);
    // Room for 8: the cached rows are a non-contiguous view of the buffer.
    let mut cache = KvCache::new(8);
    attn.forward_cached(&x, &mut cache, None)?;
    // Keep sample 1 twice (two beams of it).
    cache.index_select(&Tensor::new(&[1u32, 1], &Device::Cpu)?)?;
    let next = randn(&[1, 1, 16]).repeat((2, 1, 1))?;
    let out = attn.forward_cached(&next, &mut cache, None)?;
    let want = attn.forward(&Tensor::cat(&[x.i(1..2)?, next.i(0..1)?], 1)?, None)?;
    assert!(max_abs_diff(&out.i(0)?, &want.i(0)?.narrow(0, 4, 1)?) <= 1e-5);
    assert!(max_abs_diff(&out.i(0)?, &out.i(1)?) == 0.0);
    cache.reset();
    assert!(cache.is_empty());
    let again = attn.forward_cached(&x.i(0..2)?, &mut cache, None)?;
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
    let mut cache = KvCache::new(4);
    attn.forward_cached(&randn(&[2, 3, 16]), &mut cache, None)?;
    // A different batch than the cache holds.
    let err = attn
        .forward_cached(&randn(&[3, 1, 16]), &mut cache, None)
        .unwrap_err();
    assert!(err.to_string().contains("cache"), "{err}");
    let err = attn
        .forward_cached(
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
