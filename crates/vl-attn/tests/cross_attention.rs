//! Cross-attention: shapes, cache, masks, errors.
#![allow(missing_docs)]

mod common;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, IndexOp, Tensor};
use candle_nn::VarMap;
use common::*;
use vl_attn::attention::{self, Backend, Weights};
use vl_attn::{mask, AttnError, CrossAttention, CrossAttentionConfig, CrossKv, Mask};

/// A module over plain tensors (initialised through a `VarMap`, then
/// detached), so that `Backend::Fused` really runs the fused kernel: it
/// refuses, with an error, inputs that track gradients.
fn module(q: usize, m: usize, heads: usize, kv_heads: usize) -> (VarMap, CrossAttention) {
    let vars = VarMap::new();
    let cfg = CrossAttentionConfig {
        num_kv_heads: kv_heads,
        ..CrossAttentionConfig::new(q, m, heads)
    };
    CrossAttention::load(vb(&vars, DType::F32), &cfg).expect("init");
    let attn = CrossAttention::load(frozen(&vars, DType::F32), &cfg).expect("load");
    (vars, attn)
}

/// The output over projected keys and values, without weights.
fn cached(
    attn: &CrossAttention,
    q: &Tensor,
    kv: &CrossKv,
    mask: Option<&Mask>,
) -> anyhow::Result<Tensor> {
    Ok(attn.attend(q, kv, mask, Weights::Skip)?.output)
}

/// The output and the weights over an unprojected memory.
fn with_weights(
    attn: &CrossAttention,
    q: &Tensor,
    memory: &Tensor,
    mask: Option<&Mask>,
) -> anyhow::Result<(Tensor, Tensor)> {
    let out = attn.attend(q, &attn.project_memory(memory)?, mask, Weights::Return)?;
    let w = out
        .weights
        .ok_or_else(|| anyhow::anyhow!("weights were asked for"))?;
    Ok((out.output, w))
}

#[test]
fn output_shape_whatever_the_key_length() -> anyhow::Result<()> {
    let (_v, attn) = module(32, 48, 4, 2);
    for k_len in [1, 7, 197] {
        let out = attn.forward(&randn(&[2, 5, 32]), &randn(&[2, k_len, 48]), None)?;
        assert_eq!(out.dims(), &[2, 5, 32]);
        let (_, w) = with_weights(&attn, &randn(&[2, 5, 32]), &randn(&[2, k_len, 48]), None)?;
        assert_eq!(w.dims(), &[2, 4, 5, k_len]);
    }
    Ok(())
}

#[test]
fn cached_equals_uncached() -> anyhow::Result<()> {
    let (_v, attn) = module(32, 24, 4, 4);
    let (q, m) = (randn(&[3, 6, 32]), randn(&[3, 11, 24]));
    let kv = attn.project_memory(&m)?;
    let direct = attn.forward(&q, &m, None)?;
    // The same queries: within 1e-6.
    assert!(max_abs_diff(&cached(&attn, &q, &kv, None)?, &direct) <= 1e-6);
    // Reused at several "steps" of one query each: within 1e-5, since the
    // query projection of 1 row and of 6 rows runs different gemm kernels,
    // which round differently (~1e-6).
    for t in 0..6 {
        let step = cached(&attn, &q.narrow(1, t, 1)?, &kv, None)?;
        assert!(max_abs_diff(&step, &direct.narrow(1, t, 1)?) <= 1e-5);
    }
    Ok(())
}

/// A memory kept in 16 bits (under f32 queries; what `quantize` to an
/// integer format chooses on the CPU): the keys and values are the f32
/// ones rounded once, and every backend attends over them as over their
/// f32 widening (within 1e-5), one decode step as the whole sequence.
#[test]
fn a_16_bit_memory_attends_as_its_widening() -> anyhow::Result<()> {
    let (_v, attn) = module(32, 24, 4, 2);
    let (q, m) = (randn(&[2, 5, 32]), randn(&[2, 13, 24]));
    let full = attn.project_memory(&m)?;
    for half in [DType::BF16, DType::F16] {
        let attn = attn.clone().with_memory_dtype(Some(half));
        assert_eq!(attn.memory_dtype(), Some(half));
        let kv = attn.project_memory(&m)?;
        assert_eq!((kv.k().dtype(), kv.v().dtype()), (half, half));
        assert_eq!(
            max_abs_diff(
                &kv.k().to_dtype(DType::F32)?,
                &full.k().to_dtype(half)?.to_dtype(DType::F32)?
            ),
            0.0
        );
        let widened = CrossKv::new(kv.k().to_dtype(DType::F32)?, kv.v().to_dtype(DType::F32)?)?;
        for backend in [Backend::Reference, Backend::Fused, Backend::Auto] {
            let attn = attn.clone().with_backend(backend);
            let want = cached(&attn, &q, &widened, None)?;
            let got = cached(&attn, &q, &kv, None)?;
            assert!(max_abs_diff(&got, &want) <= 1e-5, "{half:?} {backend:?}");
            let step = cached(&attn, &q.narrow(1, 4, 1)?, &kv, None)?;
            assert!(
                max_abs_diff(&step, &want.narrow(1, 4, 1)?) <= 1e-5,
                "{half:?} {backend:?}"
            );
            assert!(max_abs_diff(&attn.forward(&q, &m, None)?, &want) <= 1e-5);
        }
    }
    // Quantizing f32 activations' weights on the CPU keeps the memory in
    // 16 bits: bf16 for q8_0 and bf16 weights, f16 for f16 weights.
    let (_w, wide) = module(32, 32, 4, 2);
    for (format, memory) in [
        (GgmlDType::Q8_0, DType::BF16),
        (GgmlDType::BF16, DType::BF16),
        (GgmlDType::F16, DType::F16),
    ] {
        assert_eq!(wide.quantize(format)?.memory_dtype(), Some(memory));
    }

    // Keys and values of an integer dtype, or 16-bit under 16-bit queries
    // of another kind, are refused naming them.
    let kv = attn.project_memory(&m)?;
    let bf16_q = q.to_dtype(DType::BF16)?;
    let err = attention::attention(
        &bf16_q.reshape((2, 5, 4, 8))?.transpose(1, 2)?,
        &kv.k().to_dtype(DType::F16)?,
        &kv.v().to_dtype(DType::F16)?,
        None,
        1.0,
        Backend::Auto,
        Weights::Skip,
    )
    .unwrap_err();
    assert!(err.to_string().contains('k'), "{err}");
    Ok(())
}

/// Values only; that no copy is made is measured in `tests/beam_memory.rs`.
#[test]
fn beams_share_one_memory_without_copies() -> anyhow::Result<()> {
    // 2 images, 3 beams each: queries (6, t, d) over a memory of batch 2.
    let (_v, attn) = module(16, 16, 4, 2);
    let m = randn(&[2, 9, 16]);
    let q = randn(&[6, 4, 16]);
    let kv = attn.project_memory(&m)?;
    let shared = cached(&attn, &q, &kv, None)?;
    let repeated = attn.forward(&q, &m.repeat_interleave(3)?, None)?;
    // Within 1e-5: projecting 2 or 6 memories runs different gemm blockings.
    let d = max_abs_diff(&shared, &repeated);
    assert!(d <= 1e-5, "{d}");
    // The reference path agrees too, with per-beam masks.
    let masks = random_mask(&[6, 4, 9], 0.6).to_dtype(DType::U8)?;
    let masks = Mask::new(masks)?;
    let ref_attn = attn.clone().with_backend(Backend::Reference);
    let a = cached(&attn, &q, &kv, Some(&masks))?;
    let b = ref_attn.forward(&q, &m.repeat_interleave(3)?, Some(&masks))?;
    assert!(max_abs_diff(&a, &b) <= 1e-5);
    Ok(())
}

trait RepeatInterleave {
    fn repeat_interleave(&self, r: usize) -> candle_core::Result<Tensor>;
}

impl RepeatInterleave for Tensor {
    fn repeat_interleave(&self, r: usize) -> candle_core::Result<Tensor> {
        let idx: Vec<u32> = (0..self.dim(0)? as u32)
            .flat_map(|i| std::iter::repeat_n(i, r))
            .collect();
        self.index_select(&Tensor::new(idx, self.device())?, 0)
    }
}

#[test]
fn cross_kv_index_select_reorders() -> anyhow::Result<()> {
    let (_v, attn) = module(8, 8, 2, 2);
    let m = randn(&[3, 5, 8]);
    let kv = attn.project_memory(&m)?;
    let picked = kv.index_select(&Tensor::new(&[2u32, 0], &Device::Cpu)?)?;
    assert_eq!(picked.batch(), 2);
    let q = randn(&[2, 1, 8]);
    let out = cached(&attn, &q, &picked, None)?;
    let want = attn.forward(&q, &Tensor::stack(&[m.i(2)?, m.i(0)?], 0)?, None)?;
    assert!(max_abs_diff(&out, &want) <= 1e-6);
    Ok(())
}

#[test]
fn a_sample_without_image_gets_exact_zeros() -> anyhow::Result<()> {
    let (_v, attn) = module(8, 12, 2, 1);
    let m = mask::image_tokens(&[5, 0, 3], 5, &Device::Cpu)?;
    for backend in [Backend::Reference, Backend::Fused] {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let a = attn.clone().with_backend(backend);
            let vars = VarMap::new();
            let a = if dtype == DType::F32 {
                a
            } else {
                CrossAttention::load(vb(&vars, dtype), a.config())?;
                CrossAttention::load(frozen(&vars, dtype), a.config())?.with_backend(backend)
            };
            let q = randn(&[3, 4, 8]).to_dtype(dtype)?;
            let mem = randn(&[3, 5, 12]).to_dtype(dtype)?;
            // Weights come from the reference path only.
            let reference = a.clone().with_backend(Backend::Reference);
            let (out, w) = with_weights(&reference, &q, &mem, Some(&m))?;
            let fused = a.forward(&q, &mem, Some(&m))?;
            for t in [&out, &w, &fused] {
                assert!(all_finite(t), "{backend:?} {dtype:?}");
            }
            assert_eq!(
                out.i(1)?
                    .to_dtype(DType::F32)?
                    .abs()?
                    .sum_all()?
                    .to_scalar::<f32>()?,
                0.0
            );
            assert_eq!(
                fused
                    .i(1)?
                    .to_dtype(DType::F32)?
                    .abs()?
                    .sum_all()?
                    .to_scalar::<f32>()?,
                0.0
            );
            assert_eq!(
                w.i(1)?
                    .to_dtype(DType::F32)?
                    .sum_all()?
                    .to_scalar::<f32>()?,
                0.0
            );
        }
    }
    Ok(())
}

#[test]
fn errors_name_the_argument() -> anyhow::Result<()> {
    let (_v, attn) = module(16, 24, 4, 2);
    let err = attn
        .forward(&randn(&[2, 3, 16]), &randn(&[2, 5, 20]), None)
        .unwrap_err();
    assert!(
        matches!(err, AttnError::Shape { arg: "memory", .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("24") && err.to_string().contains("20"),
        "{err}"
    );
    let err = attn
        .forward(&randn(&[2, 3, 15]), &randn(&[2, 5, 24]), None)
        .unwrap_err();
    assert!(
        matches!(err, AttnError::Shape { arg: "queries", .. }),
        "{err}"
    );
    let err = attn
        .forward(&randn(&[3, 3, 16]), &randn(&[2, 5, 24]), None)
        .unwrap_err();
    assert!(
        matches!(err, AttnError::Shape { arg: "queries", .. }),
        "{err}"
    );
    let err = attn
        .forward(
            &randn(&[2, 3, 16]),
            &randn(&[2, 5, 24]).to_dtype(DType::F16)?,
            None,
        )
        .unwrap_err();
    assert!(
        matches!(err, AttnError::DType { arg: "memory", .. }),
        "{err}"
    );
    let bad_mask = Mask::new(Tensor::ones((2, 3, 4), DType::U8, &Device::Cpu)?)?;
    let err = attn
        .forward(&randn(&[2, 3, 16]), &randn(&[2, 5, 24]), Some(&bad_mask))
        .unwrap_err();
    assert!(matches!(err, AttnError::Shape { arg: "mask", .. }), "{err}");
    Ok(())
}

#[test]
fn construction_rejects_impossible_heads() {
    let vars = VarMap::new();
    let bad_inner = CrossAttentionConfig {
        inner_dim: 30,
        ..CrossAttentionConfig::new(32, 32, 4)
    };
    let err = CrossAttention::load(vb(&vars, DType::F32), &bad_inner).unwrap_err();
    assert!(
        err.to_string().contains("30") && err.to_string().contains("4"),
        "{err}"
    );
    let bad_kv = CrossAttentionConfig {
        num_kv_heads: 3,
        ..CrossAttentionConfig::new(32, 32, 4)
    };
    let err = CrossAttention::load(vb(&vars, DType::F32), &bad_kv).unwrap_err();
    assert!(err.to_string().contains("kv heads 3"), "{err}");
}

#[test]
fn kernel_rejects_bad_shapes() {
    let q = randn(&[2, 4, 3, 8]);
    let k = randn(&[2, 3, 5, 8]);
    let err =
        attention::attention(&q, &k, &k, None, 1.0, Backend::Fused, Weights::Skip).unwrap_err();
    assert!(matches!(err, AttnError::Shape { arg: "k", .. }), "{err}");
}

/// `Backend::Fused` never falls back silently: a module whose weights track
/// gradients (built from a `VarMap`) and a request for weights are errors
/// naming `backend`, so that every `Fused` test above, which succeeds, ran
/// the fused kernel. `Auto` serves both through the reference path.
#[test]
fn fused_backend_refuses_what_it_cannot_run() -> anyhow::Result<()> {
    let vars = VarMap::new();
    let cfg = CrossAttentionConfig::new(16, 16, 2);
    let trainable = CrossAttention::load(vb(&vars, DType::F32), &cfg)?;
    let (q, m) = (randn(&[1, 3, 16]), randn(&[1, 4, 16]));
    let err = trainable
        .clone()
        .with_backend(Backend::Fused)
        .forward(&q, &m, None)
        .unwrap_err();
    assert!(
        matches!(err, AttnError::Argument { arg: "backend", .. })
            && err.to_string().contains("gradients"),
        "{err}"
    );
    assert!(trainable.forward(&q, &m, None)?.track_op());
    let frozen =
        CrossAttention::load(frozen(&vars, DType::F32), &cfg)?.with_backend(Backend::Fused);
    let kv = frozen.project_memory(&m)?;
    let err = frozen.attend(&q, &kv, None, Weights::Return).unwrap_err();
    assert!(
        matches!(err, AttnError::Argument { arg: "backend", .. })
            && err.to_string().contains("weights"),
        "{err}"
    );
    // The frozen fused module agrees with the trainable reference one.
    let fused = frozen.forward(&q, &m, None)?;
    assert!(!fused.track_op());
    assert!(max_abs_diff(&fused, &trainable.forward(&q, &m, None)?) <= 1e-5);
    Ok(())
}
