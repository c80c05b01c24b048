//! The resampler: fixed output size, batch == per-sample, masked and
//! permuted memory, named errors, quantization, gradients to the queries.
#![allow(missing_docs)]

mod common;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, IndexOp, Tensor};
use candle_nn::{VarBuilder, VarMap};
use common::{frozen, max_abs_diff, randn, seed_vars, seeded_randn};
use vl_attn::{mask, Resampler, ResamplerConfig};

/// Image tokens of width 24 (a class token and 8 × 8 patches) into 8
/// queries of width 32, 2 layers of 4 heads.
fn cfg() -> ResamplerConfig {
    ResamplerConfig::new(32, 24, 8, 2, 4)
}

fn build(cfg: &ResamplerConfig) -> (VarMap, Resampler) {
    let vars = VarMap::new();
    Resampler::load(
        VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu),
        cfg,
    )
    .expect("init");
    let r = Resampler::load(frozen(&vars, DType::F32), cfg).expect("load");
    (vars, r)
}

#[test]
fn any_memory_length_gives_num_queries_tokens() -> anyhow::Result<()> {
    let (_v, r) = build(&cfg());
    for len in [1, 17, 65] {
        let out = r.forward(&randn(&[2, len, 24]), None)?;
        assert_eq!(out.dims(), &[2, 8, 32]);
    }
    Ok(())
}

/// Batched and one at a time, the products may sum in another order (a
/// GEMM's blocking follows its rows): equal to f32 rounding of the
/// outputs' scale — 16 ulps of the largest output (these seeded values
/// differ by 1.07e-6 at most over outputs up to 2.85 with AVX-512, ~4
/// ulps; the bound leaves other GEMM blockings room). Seeded: candle's
/// unseeded initialisation once gave a difference of 1.06e-5 against the
/// former absolute bound of 1e-5.
#[test]
fn batch_equals_per_sample() -> anyhow::Result<()> {
    let c = cfg();
    let (vars, _) = build(&c);
    seed_vars(&vars, 3);
    let r = Resampler::load(frozen(&vars, DType::F32), &c)?;
    let m = seeded_randn(&[3, 65, 24], 7);
    let all = r.forward(&m, None)?;
    let scale = all.abs()?.max_all()?.to_scalar::<f32>()?;
    for i in 0..3 {
        let one = r.forward(&m.narrow(0, i, 1)?, None)?;
        let d = max_abs_diff(&all.i(i)?, &one.i(0)?);
        assert!(
            d <= 16.0 * f32::EPSILON * scale,
            "sample {i}: {d} (outputs up to {scale})"
        );
    }
    Ok(())
}

/// No positions inside: permuting the memory tokens changes nothing, and
/// masked tokens are not read.
#[test]
fn masked_or_permuted_memory_changes_nothing() -> anyhow::Result<()> {
    let (_v, r) = build(&cfg());
    let m = randn(&[2, 10, 24]);
    let base = r.forward(&m, None)?;
    let perm: Vec<u32> = vec![3, 9, 0, 1, 7, 2, 8, 4, 6, 5];
    let permuted = m.index_select(&Tensor::new(perm.as_slice(), &Device::Cpu)?, 1)?;
    let d = max_abs_diff(&base, &r.forward(&permuted, None)?);
    assert!(d <= 1e-5, "permuted: {d}");

    // Sample 0 sees 6 tokens, sample 1 all 10: replacing sample 0's last
    // 4 tokens changes nothing, while an unmasked change does.
    let keep = mask::image_tokens(&[6, 10], 10, &Device::Cpu)?;
    let masked = r.forward(&m, Some(&keep))?;
    let noise = Tensor::cat(&[m.i((0..1, 0..6))?, randn(&[1, 4, 24])], 1)?;
    let m2 = Tensor::cat(&[noise, m.i(1..2)?], 0)?;
    let d = max_abs_diff(&masked, &r.forward(&m2, Some(&keep))?);
    assert!(d <= 1e-6, "masked tokens were read: {d}");
    let d = max_abs_diff(&masked.i(1)?, &base.i(1)?);
    assert!(d <= 1e-6, "a full mask changed sample 1: {d}");
    let d = max_abs_diff(&masked.i(0)?, &base.i(0)?);
    assert!(d > 1e-4, "the mask changed nothing: {d}");
    Ok(())
}

#[test]
fn bad_inputs_are_named_errors() -> anyhow::Result<()> {
    let (_v, r) = build(&cfg());
    for (m, says) in [
        (randn(&[2, 5, 16]), "memory"),
        (randn(&[5, 24]), "memory"),
        (
            Tensor::zeros((2, 0, 24), DType::F32, &Device::Cpu)?,
            "memory",
        ),
    ] {
        let err = r.forward(&m, None).unwrap_err().to_string();
        assert!(err.contains(says), "{err}");
    }
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    for (bad, says) in [
        (ResamplerConfig { depth: 0, ..cfg() }, "depth"),
        (
            ResamplerConfig {
                num_queries: 0,
                ..cfg()
            },
            "num_queries",
        ),
        (
            ResamplerConfig {
                num_heads: 5,
                ..cfg()
            },
            "num_heads",
        ),
        (
            ResamplerConfig {
                layer_norm_eps: -1.0,
                ..cfg()
            },
            "layer_norm_eps",
        ),
    ] {
        let err = Resampler::load(vb.clone(), &bad).unwrap_err().to_string();
        assert!(err.contains(says), "{err}");
    }
    Ok(())
}

#[test]
fn quantized_close_to_dense_and_unfit_widths_named() -> anyhow::Result<()> {
    // Seeded weights and memory: the bound is about these values.
    let wide = ResamplerConfig::new(64, 64, 8, 2, 4);
    let vars = VarMap::new();
    Resampler::load(
        VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu),
        &wide,
    )?;
    seed_vars(&vars, 11);
    let r = Resampler::load(frozen(&vars, DType::F32), &wide)?;
    let m = seeded_randn(&[2, 17, 64], 5);
    let dense = r.forward(&m, None)?;
    let q = r.quantize(GgmlDType::Q8_0)?.forward(&m, None)?;
    // Relative L2 error of 8-bit blocks through 2 layers (0.0155 on these
    // seeded values with AVX-512 VNNI; the bound leaves room for other ISAs'
    // rounding of the activations).
    let rel = ((&q - &dense)?.sqr()?.sum_all()?.to_scalar::<f32>()?
        / dense.sqr()?.sum_all()?.to_scalar::<f32>()?)
    .sqrt();
    eprintln!("q8_0 resampler: relative L2 {rel}");
    assert!(rel <= 0.025, "{rel}");
    let (_v, narrow) = build(&cfg());
    let err = narrow.quantize(GgmlDType::Q8_0).unwrap_err().to_string();
    // Width 32 fits the blocks; the memory's 24 does not.
    assert!(
        err.contains("layers.0.cross_attn.k_proj") && err.contains("24"),
        "{err}"
    );
    Ok(())
}

#[test]
fn the_queries_train() -> anyhow::Result<()> {
    let vars = VarMap::new();
    let r = Resampler::load(
        VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu),
        &cfg(),
    )?;
    // A random linear read-out: the output norm makes a plain sum of
    // squares all but constant.
    let out = r.forward(&randn(&[2, 9, 24]), None)?;
    let loss = (out * randn(&[2, 8, 32]))?.sum_all()?;
    let grads = loss.backward()?;
    let data = vars.data().lock().map_err(|_| anyhow::anyhow!("lock"))?;
    for name in [
        "queries",
        "layers.1.cross_attn.q_proj.weight",
        "layers.0.ffn.up.weight",
    ] {
        let g = grads.get(data[name].as_tensor()).expect(name);
        let max = g.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert!(max > 1e-7, "{name}: {max}");
    }
    Ok(())
}
