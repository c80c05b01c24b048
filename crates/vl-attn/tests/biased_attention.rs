//! Attention with additive float biases on the scores (Swin's relative
//! position bias and shifted-window mask): the CPU kernel against the
//! reference path, against plain attention, and bad biases named.
#![allow(missing_docs)]

mod common;

use candle_core::{DType, Tensor};
use common::*;
use vl_attn::attention::{attention, attention_with_bias, Weights};
use vl_attn::{AttnError, Backend};

/// A Swin-like stage: 2 images of 6 windows of 49 tokens, 3 heads of 32;
/// a bias per head, a mask per window closing keys with -100.
fn swin_like() -> (Tensor, Tensor, Tensor, Tensor, Tensor) {
    let (n, heads, t, hd, windows) = (12, 3, 49, 32, 6);
    let q = randn(&[n, heads, t, hd]);
    let k = randn(&[n, heads, t, hd]);
    let v = randn(&[n, heads, t, hd]);
    let per_head = randn(&[1, heads, t, t]);
    let cut = randn(&[windows, 1, t, t]);
    let per_window = cut
        .ge(1.0)
        .expect("ge")
        .to_dtype(DType::F32)
        .expect("f32")
        .affine(-100.0, 0.0)
        .expect("affine");
    (q, k, v, per_head, per_window)
}

#[test]
fn the_kernel_equals_the_reference_path() -> anyhow::Result<()> {
    let (q, k, v, per_head, per_window) = swin_like();
    let scale = 1.0 / 32f64.sqrt();
    for biases in [
        vec![&per_head],
        vec![&per_window],
        vec![&per_head, &per_window],
    ] {
        let want = attention_with_bias(&q, &k, &v, &biases, scale, Backend::Reference)?;
        for backend in [Backend::Fused, Backend::Auto] {
            let got = attention_with_bias(&q, &k, &v, &biases, scale, backend)?;
            let diff = max_abs_diff(&got, &want);
            assert!(diff <= 1e-5, "{} biases, {backend:?}: {diff}", biases.len());
        }
    }
    // In bf16 the kernel computes in f32 and rounds once: within bf16's
    // rounding of the reference's own bf16 products.
    let half = |t: &Tensor| t.to_dtype(DType::BF16);
    let (qh, kh, vh) = (half(&q)?, half(&k)?, half(&v)?);
    let (bh, wh) = (half(&per_head)?, half(&per_window)?);
    let got = attention_with_bias(&qh, &kh, &vh, &[&bh, &wh], scale, Backend::Auto)?;
    assert_eq!(got.dtype(), DType::BF16);
    let want = attention_with_bias(&q, &k, &v, &[&per_head, &per_window], scale, Backend::Auto)?;
    let diff = max_abs_diff(&got.to_dtype(DType::F32)?, &want);
    assert!(diff <= 5e-2, "bf16: {diff}");
    Ok(())
}

/// A zero bias is plain attention; a bias that is the same for every key
/// of a query changes nothing either (softmax is shift-invariant); -100 on
/// a key is (within exp(-100)) the key masked out.
#[test]
fn biases_act_as_they_should() -> anyhow::Result<()> {
    let (q, k, v, _, _) = swin_like();
    let (n, heads, t, _) = q.dims4()?;
    let scale = 0.2;
    let plain = attention(&q, &k, &v, None, scale, Backend::Auto, Weights::Skip)?.output;
    let zero = Tensor::zeros((1, 1, t, t), DType::F32, q.device())?;
    // Small (up to 6): a large constant would cost the scores' low bits.
    let per_row = Tensor::arange(0f32, t as f32, q.device())?
        .affine(0.125, 0.0)?
        .reshape((1, 1, t, 1))?
        .broadcast_as((n, heads, t, t))?
        .contiguous()?;
    for backend in [Backend::Reference, Backend::Auto] {
        for bias in [&zero, &per_row] {
            let got = attention_with_bias(&q, &k, &v, &[bias], scale, backend)?;
            assert!(max_abs_diff(&got, &plain) <= 1e-5, "{backend:?}");
        }
        // Key 0 closed by -100 for every query: as if masked.
        let mut closed = vec![0f32; t * t];
        for i in 0..t {
            closed[i * t] = -100.0;
        }
        let closed = Tensor::from_vec(closed, (1, 1, t, t), q.device())?;
        let got = attention_with_bias(&q, &k, &v, &[&closed], scale, backend)?;
        let mut open = vec![1u8; t * t];
        for i in 0..t {
            open[i * t] = 0;
        }
        let mask = vl_attn::Mask::new(Tensor::from_vec(open, (1, t, t), q.device())?)?;
        let masked = attention(&q, &k, &v, Some(&mask), scale, Backend::Auto, Weights::Skip)?;
        assert!(max_abs_diff(&got, &masked.output) <= 1e-5, "{backend:?}");
    }
    Ok(())
}

#[test]
fn bad_biases_are_named() -> anyhow::Result<()> {
    let (q, k, v, per_head, _) = swin_like();
    let t = q.dims4()?.2;
    let named = |r: Result<Tensor, AttnError>| match r {
        Err(AttnError::Shape { arg, .. }) | Err(AttnError::DType { arg, .. }) => arg,
        other => panic!("expected a named error, got {other:?}"),
    };
    // 5 samples do not divide 12 windows; 2 heads are neither 1 nor 3.
    let five = randn(&[5, 1, t, t]);
    let two_heads = randn(&[1, 2, t, t]);
    let short = randn(&[1, 3, t, t - 1]);
    for (bias, at) in [(&five, 1), (&two_heads, 1), (&short, 0)] {
        let biases = if at == 0 {
            vec![bias]
        } else {
            vec![&per_head, bias]
        };
        let r = attention_with_bias(&q, &k, &v, &biases, 1.0, Backend::Auto);
        assert_eq!(named(r), ["biases[0]", "biases[1]"][at]);
    }
    let f16 = per_head.to_dtype(DType::F16)?;
    let r = attention_with_bias(&q, &k, &v, &[&f16], 1.0, Backend::Auto);
    assert_eq!(named(r), "biases[0]");
    // Keys shared by several query samples are not what this serves.
    let shared = k.narrow(0, 0, 1)?;
    let r = attention_with_bias(&q, &shared, &v.narrow(0, 0, 1)?, &[], 1.0, Backend::Auto);
    assert_eq!(named(r), "k");
    Ok(())
}
