//! Co-attention and its block: parity with two cross-attentions, weights,
//! masks, batching, errors, quantization.
#![allow(missing_docs)]

mod common;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Tensor, D};
use candle_nn::VarMap;
use common::*;
use vl_attn::mask::{self, PaddingSide};
use vl_attn::{
    AttnError, Backend, CoAttention, CoAttentionBlock, CoAttentionBlockConfig, CoAttentionConfig,
    CrossAttention, FeedForward, LayerNorm, Mask, Weights,
};

/// Widths that differ, so that swapped directions or masks fail on shapes.
const A_DIM: usize = 24;
const B_DIM: usize = 40;
const INNER: usize = 32;
const HEADS: usize = 4;
const A_LEN: usize = 7;
const B_LEN: usize = 5;

fn cfg() -> CoAttentionConfig {
    CoAttentionConfig::new(A_DIM, B_DIM, INNER, HEADS)
}

/// A module over plain tensors (initialised through a `VarMap`, then
/// detached), so that `Backend::Fused` really runs the fused kernel.
fn module(cfg: &CoAttentionConfig) -> (VarMap, CoAttention) {
    let vars = VarMap::new();
    CoAttention::load(vb(&vars, DType::F32), cfg).expect("init");
    let attn = CoAttention::load(frozen(&vars, DType::F32), cfg).expect("load");
    (vars, attn)
}

/// A key mask `(batch, 1, max_len)` with `lengths` real positions per sample.
fn keys(lengths: &[usize], max_len: usize) -> Mask {
    let m = mask::key_padding(
        lengths,
        max_len,
        PaddingSide::Right,
        &candle_core::Device::Cpu,
    )
    .expect("key padding");
    Mask::from_keys(&m).expect("mask")
}

fn row_sums(w: &Tensor) -> Vec<f32> {
    w.sum(D::Minus1)
        .and_then(|s| s.flatten_all())
        .and_then(|s| s.to_vec1::<f32>())
        .expect("row sums")
}

/// Catches: directions swapped, a direction reading the other's output
/// instead of the input stream, the two key masks swapped, weights of the
/// wrong direction returned. Same weights, same inputs → within 1e-6 (the
/// same operations in the same order), on both backends.
#[test]
fn equals_two_cross_attentions_from_the_same_weights() -> anyhow::Result<()> {
    let cfg = cfg();
    let (vars, co) = module(&cfg);
    let a_to_b = CrossAttention::load(frozen(&vars, DType::F32).pp("a_to_b"), &cfg.a_to_b())?;
    let b_to_a = CrossAttention::load(frozen(&vars, DType::F32).pp("b_to_a"), &cfg.b_to_a())?;
    let (a, b) = (seeded(&[3, A_LEN, A_DIM], 1), seeded(&[3, B_LEN, B_DIM], 2));
    let a_keys = keys(&[A_LEN, 3, 1], A_LEN);
    let b_keys = keys(&[2, B_LEN, 4], B_LEN);

    let got = co.attend(&a, &b, Some(&a_keys), Some(&b_keys), Weights::Return)?;
    let want_a = a_to_b.attend(
        &a,
        &a_to_b.project_memory(&b)?,
        Some(&b_keys),
        Weights::Return,
    )?;
    let want_b = b_to_a.attend(
        &b,
        &b_to_a.project_memory(&a)?,
        Some(&a_keys),
        Weights::Return,
    )?;
    assert!(max_abs_diff(&got.a, &want_a.output) <= 1e-6);
    assert!(max_abs_diff(&got.b, &want_b.output) <= 1e-6);
    let (Some(wa), Some(wb)) = (&got.a_weights, &got.b_weights) else {
        anyhow::bail!("weights were asked for");
    };
    assert!(max_abs_diff(wa, want_a.weights.as_ref().expect("weights")) <= 1e-6);
    assert!(max_abs_diff(wb, want_b.weights.as_ref().expect("weights")) <= 1e-6);

    for backend in [Backend::Reference, Backend::Fused] {
        let co = co.clone().with_backend(backend);
        let (ga, gb) = co.forward(&a, &b, Some(&a_keys), Some(&b_keys))?;
        let wa = a_to_b
            .clone()
            .with_backend(backend)
            .forward(&a, &b, Some(&b_keys))?;
        let wb = b_to_a
            .clone()
            .with_backend(backend)
            .forward(&b, &a, Some(&a_keys))?;
        assert!(max_abs_diff(&ga, &wa) <= 1e-6, "{backend:?}");
        assert!(max_abs_diff(&gb, &wb) <= 1e-6, "{backend:?}");
        assert!(co
            .attend(&a, &b, None, None, Weights::Skip)?
            .a_weights
            .is_none());
    }
    Ok(())
}

/// Catches: weights not normalised, a fully masked row producing NaN or a
/// bias instead of zero, a mask applied to the wrong stream. Rows sum to 1
/// within 1e-5; a sample whose B is entirely masked gets exactly 0 in A's
/// update and in A's weights, while its B still attends to A.
#[test]
fn weight_rows_sum_to_one_and_fully_masked_rows_are_zero() -> anyhow::Result<()> {
    let (_v, co) = module(&cfg());
    let (a, b) = (seeded(&[3, A_LEN, A_DIM], 3), seeded(&[3, B_LEN, B_DIM], 4));
    let b_keys = keys(&[B_LEN, 0, 2], B_LEN);
    let out = co.attend(&a, &b, None, Some(&b_keys), Weights::Return)?;
    let (Some(wa), Some(wb)) = (out.a_weights, out.b_weights) else {
        anyhow::bail!("weights were asked for");
    };
    assert_eq!(wa.dims(), &[3, HEADS, A_LEN, B_LEN]);
    assert_eq!(wb.dims(), &[3, HEADS, B_LEN, A_LEN]);

    // Sample 1 of A has no key left: exactly zero, output and weights.
    assert_eq!(out.a.get(1)?.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
    assert_eq!(wa.get(1)?.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
    for s in [0, 2] {
        assert!(out.a.get(s)?.abs()?.sum_all()?.to_scalar::<f32>()? > 0.0);
        for sum in row_sums(&wa.get(s)?) {
            assert!((sum - 1.0).abs() <= 1e-5, "sample {s}: a row sums to {sum}");
        }
    }
    // B's queries were not masked: every row sums to 1, sample 1 included.
    for sum in row_sums(&wb) {
        assert!(
            (sum - 1.0).abs() <= 1e-5,
            "a row of b_weights sums to {sum}"
        );
    }
    assert!(out.b.get(1)?.abs()?.sum_all()?.to_scalar::<f32>()? > 0.0);
    assert!(all_finite(&out.a) && all_finite(&out.b));
    Ok(())
}

/// Catches: a key mask ignored or applied to the wrong direction. Changing
/// B at positions that `b_keys` masks out changes A's update by at most
/// 1e-6 (and symmetrically for A and `a_keys`), while changing an unmasked
/// position does change it.
#[test]
fn masked_positions_change_nothing() -> anyhow::Result<()> {
    let (_v, co) = module(&cfg());
    let (a, b) = (seeded(&[2, A_LEN, A_DIM], 5), seeded(&[2, B_LEN, B_DIM], 6));
    let (a_len, b_len) = ([A_LEN, 4], [3, B_LEN]);
    let (a_keys, b_keys) = (keys(&a_len, A_LEN), keys(&b_len, B_LEN));
    let base = co.attend(&a, &b, Some(&a_keys), Some(&b_keys), Weights::Skip)?;

    // Replace the masked positions of each stream by other values.
    let keep = |m: &Mask| m.tensor().squeeze(1)?.unsqueeze(2)?.to_dtype(DType::F32);
    let (keep_a, keep_b) = (keep(&a_keys)?, keep(&b_keys)?);
    let a2 = (a.broadcast_mul(&keep_a)? + seeded(a.dims(), 7).broadcast_mul(&(1.0 - &keep_a)?)?)?;
    let b2 = (b.broadcast_mul(&keep_b)? + seeded(b.dims(), 8).broadcast_mul(&(1.0 - &keep_b)?)?)?;
    assert!(max_abs_diff(&a, &a2) > 0.1 && max_abs_diff(&b, &b2) > 0.1);

    let new_b = co.attend(&a, &b2, Some(&a_keys), Some(&b_keys), Weights::Skip)?;
    assert!(max_abs_diff(&base.a, &new_b.a) <= 1e-6);
    let new_a = co.attend(&a2, &b, Some(&a_keys), Some(&b_keys), Weights::Skip)?;
    assert!(max_abs_diff(&base.b, &new_a.b) <= 1e-6);

    // An unmasked position of B does matter to A.
    let b3 = (&b + seeded(b.dims(), 9))?;
    let moved = co.attend(&a, &b3, Some(&a_keys), Some(&b_keys), Weights::Skip)?;
    assert!(max_abs_diff(&base.a, &moved.a) > 1e-3);
    Ok(())
}

/// Catches: samples leaking into each other, a per-sample mask read with
/// the wrong batch index. Each sample alone gives its batch row within 1e-5
/// (gemm kernels may round differently for different batch sizes).
#[test]
fn batch_equals_per_sample() -> anyhow::Result<()> {
    let (_v, co) = module(&cfg());
    let (a, b) = (
        seeded(&[3, A_LEN, A_DIM], 10),
        seeded(&[3, B_LEN, B_DIM], 11),
    );
    let (a_len, b_len) = ([2, A_LEN, 5], [B_LEN, 1, 3]);
    let all = co.attend(
        &a,
        &b,
        Some(&keys(&a_len, A_LEN)),
        Some(&keys(&b_len, B_LEN)),
        Weights::Return,
    )?;
    for s in 0..3 {
        let one = co.attend(
            &a.narrow(0, s, 1)?,
            &b.narrow(0, s, 1)?,
            Some(&keys(&a_len[s..=s], A_LEN)),
            Some(&keys(&b_len[s..=s], B_LEN)),
            Weights::Return,
        )?;
        assert!(max_abs_diff(&all.a.narrow(0, s, 1)?, &one.a) <= 1e-5);
        assert!(max_abs_diff(&all.b.narrow(0, s, 1)?, &one.b) <= 1e-5);
        let w = |o: &Option<Tensor>| o.clone().expect("weights");
        assert!(max_abs_diff(&w(&all.a_weights).narrow(0, s, 1)?, &w(&one.a_weights)) <= 1e-5);
        assert!(max_abs_diff(&w(&all.b_weights).narrow(0, s, 1)?, &w(&one.b_weights)) <= 1e-5);
    }
    Ok(())
}

fn shape_arg(e: AttnError) -> &'static str {
    match e {
        AttnError::Shape { arg, .. } | AttnError::DType { arg, .. } => arg,
        other => panic!("expected a shape or dtype error, got {other}"),
    }
}

/// Catches: a bad argument reported under another name (the inner
/// `queries`/`memory`/`mask`), or a panic instead of an error.
#[test]
fn bad_shapes_and_masks_are_errors_naming_the_argument() -> anyhow::Result<()> {
    let (_v, co) = module(&cfg());
    let (a, b) = (
        seeded(&[2, A_LEN, A_DIM], 12),
        seeded(&[2, B_LEN, B_DIM], 13),
    );
    let run = |a: &Tensor, b: &Tensor, ak: Option<&Mask>, bk: Option<&Mask>| {
        co.attend(a, b, ak, bk, Weights::Skip).map(|_| ())
    };
    // Widths swapped, or a stream of the wrong rank.
    assert_eq!(shape_arg(run(&b, &a, None, None).unwrap_err()), "a");
    assert_eq!(shape_arg(run(&a, &a, None, None).unwrap_err()), "b");
    assert_eq!(shape_arg(run(&a.get(0)?, &b, None, None).unwrap_err()), "a");
    // Batches that differ.
    assert_eq!(
        shape_arg(run(&a, &b.narrow(0, 0, 1)?, None, None).unwrap_err()),
        "b"
    );
    // Masks over the wrong stream's length, or swapped.
    let a_keys = keys(&[A_LEN, 2], A_LEN);
    let b_keys = keys(&[B_LEN, 2], B_LEN);
    assert_eq!(
        shape_arg(run(&a, &b, Some(&b_keys), None).unwrap_err()),
        "a_keys"
    );
    assert_eq!(
        shape_arg(run(&a, &b, None, Some(&a_keys)).unwrap_err()),
        "b_keys"
    );
    let three = keys(&[1, 1, 1], B_LEN);
    assert_eq!(
        shape_arg(run(&a, &b, None, Some(&three)).unwrap_err()),
        "b_keys"
    );
    // A dtype that is not the weights'.
    let a64 = a.to_dtype(DType::F64)?;
    assert_eq!(shape_arg(run(&a64, &b, None, None).unwrap_err()), "a");
    let b64 = b.to_dtype(DType::F64)?;
    assert_eq!(shape_arg(run(&a, &b64, None, None).unwrap_err()), "b");
    // Fused cannot return weights: an error, not a fallback.
    let fused = co.clone().with_backend(Backend::Fused);
    assert!(fused.attend(&a, &b, None, None, Weights::Return).is_err());
    // Impossible configs, before any tensor is built.
    for bad in [
        CoAttentionConfig::new(A_DIM, B_DIM, 30, HEADS),
        CoAttentionConfig::new(0, B_DIM, INNER, HEADS),
        CoAttentionConfig {
            num_kv_heads: 3,
            ..cfg()
        },
    ] {
        assert!(matches!(
            bad.validate(),
            Err(AttnError::Config {
                module: "CoAttention",
                ..
            })
        ));
    }
    Ok(())
}

/// Catches: a projection left out of `quantize`, a quantize error without
/// the direction in its path.
#[test]
fn quantize_covers_both_directions() -> anyhow::Result<()> {
    let (_v, co) = module(&CoAttentionConfig::new(64, 96, 64, 4));
    let q = co.quantize(GgmlDType::Q8_0)?;
    assert_eq!(q.quantization(), Some(GgmlDType::Q8_0));
    assert_eq!(q.a_to_b().quantization(), Some(GgmlDType::Q8_0));
    assert_eq!(q.b_to_a().quantization(), Some(GgmlDType::Q8_0));
    let (a, b) = (seeded(&[2, 3, 64], 14), seeded(&[2, 9, 96], 15));
    let (qa, qb) = q.forward(&a, &b, None, None)?;
    assert_eq!((qa.dims(), qb.dims()), (&[2, 3, 64][..], &[2, 9, 96][..]));

    // b_dim = 40 is no multiple of 32: the first refused projection is
    // a_to_b's key projection (its input is B).
    let (_v, co) = module(&CoAttentionConfig::new(64, 40, 64, 4));
    match co.quantize(GgmlDType::Q8_0) {
        Err(AttnError::Quantize { layer, .. }) => assert_eq!(layer, "a_to_b.k_proj"),
        other => anyhow::bail!("expected a quantize error, got {other:?}"),
    }
    Ok(())
}

/// A block with every parameter random (norms included), over plain tensors.
fn block(cfg: &CoAttentionBlockConfig, zero_outputs: bool) -> (VarMap, CoAttentionBlock) {
    let mut vars = VarMap::new();
    CoAttentionBlock::load(vb(&vars, DType::F32), cfg).expect("init");
    let names: Vec<(String, Vec<usize>)> = vars
        .data()
        .lock()
        .expect("vars")
        .iter()
        .map(|(n, v)| (n.clone(), v.dims().to_vec()))
        .collect();
    for (i, (name, dims)) in names.iter().enumerate() {
        let zero = zero_outputs && (name.contains("o_proj") || name.contains(".down."));
        let value = if zero {
            Tensor::zeros(dims.as_slice(), DType::F32, &candle_core::Device::Cpu).expect("zeros")
        } else {
            (seeded(dims, 100 + i as u64) * 0.5).expect("scale")
        };
        vars.set_one(name, value).expect("set");
    }
    let blk = CoAttentionBlock::load(frozen(&vars, DType::F32), cfg).expect("load");
    (vars, blk)
}

fn block_cfg() -> CoAttentionBlockConfig {
    CoAttentionBlockConfig {
        a_intermediate: 48,
        b_intermediate: 56,
        ..CoAttentionBlockConfig::new(cfg())
    }
}

/// Catches: a missing residual, an update added to the wrong stream. With
/// the attention output and feed-forward down projections zero (weights and
/// biases), the block is exactly the identity (tolerance 0).
#[test]
fn block_with_zero_outputs_is_the_identity() -> anyhow::Result<()> {
    let (_v, blk) = block(&block_cfg(), true);
    let (a, b) = (
        seeded(&[2, A_LEN, A_DIM], 16),
        seeded(&[2, B_LEN, B_DIM], 17),
    );
    let out = blk.attend(
        &a,
        &b,
        None,
        Some(&keys(&[B_LEN, 0], B_LEN)),
        Weights::Return,
    )?;
    assert_eq!(max_abs_diff(&out.a, &a), 0.0);
    assert_eq!(max_abs_diff(&out.b, &b), 0.0);
    assert_eq!(
        out.a_weights.map(|w| w.dims().to_vec()),
        Some(vec![2, HEADS, A_LEN, B_LEN])
    );
    assert_eq!(
        out.b_weights.map(|w| w.dims().to_vec()),
        Some(vec![2, HEADS, B_LEN, A_LEN])
    );
    Ok(())
}

/// Catches: a norm used for the wrong role or stream, the feed-forward
/// reading the stream before its co-attention update, B's update reading
/// A's new value. The block equals its formula, built by hand from the same
/// weights, within 1e-5; it returns its shapes and refuses bad inputs.
#[test]
fn block_equals_its_formula() -> anyhow::Result<()> {
    let cfg = block_cfg();
    let (vars, blk) = block(&cfg, false);
    let vb = frozen(&vars, DType::F32);
    let eps = cfg.layer_norm_eps;
    let norm = |w, n: &str| LayerNorm::load(w, eps, vb.pp(n));
    let (norm_a, norm_b) = (
        norm(A_DIM, "co_attn_norm_a")?,
        norm(B_DIM, "co_attn_norm_b")?,
    );
    let (ffn_norm_a, ffn_norm_b) = (norm(A_DIM, "ffn_norm_a")?, norm(B_DIM, "ffn_norm_b")?);
    let co = CoAttention::load(vb.pp("co_attn"), &cfg.co_attn)?;
    let ffn_a = FeedForward::load(vb.pp("ffn_a"), A_DIM, cfg.a_intermediate, cfg.activation)?;
    let ffn_b = FeedForward::load(vb.pp("ffn_b"), B_DIM, cfg.b_intermediate, cfg.activation)?;

    let (a, b) = (
        seeded(&[2, A_LEN, A_DIM], 18),
        seeded(&[2, B_LEN, B_DIM], 19),
    );
    let (a_keys, b_keys) = (keys(&[A_LEN, 3], A_LEN), keys(&[2, B_LEN], B_LEN));
    let (da, db) = co.forward(
        &norm_a.forward(&a)?,
        &norm_b.forward(&b)?,
        Some(&a_keys),
        Some(&b_keys),
    )?;
    let a1 = (&a + da)?;
    let b1 = (&b + db)?;
    let want_a = (&a1 + ffn_a.forward(&ffn_norm_a.forward(&a1)?)?)?;
    let want_b = (&b1 + ffn_b.forward(&ffn_norm_b.forward(&b1)?)?)?;

    let (got_a, got_b) = blk.forward(&a, &b, Some(&a_keys), Some(&b_keys))?;
    assert_eq!(got_a.dims(), &[2, A_LEN, A_DIM]);
    assert_eq!(got_b.dims(), &[2, B_LEN, B_DIM]);
    assert!(max_abs_diff(&got_a, &want_a) <= 1e-5);
    assert!(max_abs_diff(&got_b, &want_b) <= 1e-5);

    // Bad inputs name their argument, before the norms see them.
    let err = |a: &Tensor, b: &Tensor| blk.forward(a, b, None, None).map(|_| ()).unwrap_err();
    assert_eq!(shape_arg(err(&b, &a)), "a");
    assert_eq!(shape_arg(err(&a, &a)), "b");
    assert_eq!(shape_arg(err(&a.to_dtype(DType::F64)?, &b)), "a");
    assert!(matches!(
        CoAttentionBlockConfig {
            layer_norm_eps: 0.0,
            ..cfg.clone()
        }
        .validate(),
        Err(AttnError::Config {
            module: "CoAttentionBlock",
            ..
        })
    ));

    // Quantized, every projection: the path names the stream.
    let q = blk.quantize(GgmlDType::Q8_0);
    match q {
        Err(AttnError::Quantize { layer, .. }) => assert_eq!(layer, "co_attn.a_to_b.q_proj"),
        other => anyhow::bail!("a_dim 24 cannot be q8_0: got {:?}", other.map(|_| ())),
    }
    Ok(())
}
