//! vl's CPU GELU, both forms, for f32 activations.
//!
//! Why vl owns it: candle's CPU `gelu_erf` calls a scalar `erf` per
//! element and its `gelu` a scalar `tanh`; over a ViT-B encoder's 12 ×
//! 197 × 3072 activations per image that is ~5% of the encode (a profile
//! of `vl caption --quantize bf16 --batch-size 8`). Here both are
//! branch-free f32 polynomials over [`crate::kernels::tiled`]'s vectorised `exp`,
//! compiled for AVX-512, AVX2+FMA or the baseline ([`crate::kernels::CpuFeatures::isa`]),
//! split across the rayon pool:
//!
//! - exact: `x/2 · erfc(-x/√2)`, with `erfc` from Numerical Recipes'
//!   Chebyshev fit (fractional error < 1.2e-7 everywhere), so large
//!   negative inputs keep their relative precision;
//! - tanh form: `x · σ(2u)`, `u = √(2/π)(x + 0.044715 x³)`, which is
//!   `x/2 · (1 + tanh u)`, with `σ` built from `exp(-2|u|)` so no `exp`
//!   overflows.
//!
//! [`forward`] takes this path for untracked f32 and bf16 CPU tensors (bf16
//! widened to f32 and rounded back, as candle's bf16 ops do) and candle's
//! ops otherwise (autograd, f16, other devices).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use half::bf16;

use crate::kernels::features::{CpuFeatures, Isa};
use crate::kernels::host::{contiguous, par_filled};
#[cfg(target_arch = "x86_64")]
use crate::kernels::micro::Fma;
use crate::kernels::micro::{madd, Kernel};
use crate::kernels::tiled::exp_neg;

/// Elements per parallel task.
const CHUNK: usize = 16 * 1024;
/// bf16 elements widened to f32 at a time.
const WIDEN: usize = 512;

/// GELU, exact (`erf`) or with the tanh approximation, of `x`.
///
/// # Errors
/// Only candle's.
pub(crate) fn forward(x: &Tensor, exact: bool) -> candle_core::Result<Tensor> {
    forward_with(CpuFeatures::get().isa(), x, exact)
}

/// [`forward`] on a given implementation (the token proves the CPU runs
/// it): what a product's GELU epilogue is tested against.
///
/// # Errors
/// Only candle's.
pub(crate) fn forward_with(isa: Isa, x: &Tensor, exact: bool) -> candle_core::Result<Tensor> {
    if x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::BF16) && !x.track_op() {
        return x.contiguous()?.apply_op1_no_bwd(&Gelu { exact, isa });
    }
    if exact {
        x.gelu_erf()
    } else {
        x.gelu()
    }
}

struct Gelu {
    exact: bool,
    isa: Isa,
}

/// `x/2 · erfc(-x/√2)`.
// The coefficients as published (f32 rounds them).
#[allow(clippy::excessive_precision)]
#[inline(always)]
fn gelu_erf<K: Kernel>(x: f32) -> f32 {
    let z = x * -std::f32::consts::FRAC_1_SQRT_2;
    let a = z.abs();
    let t = 1.0 / madd(K::FMA, 0.5, a, 1.0);
    // Numerical Recipes' `erfcc`: erfc(a) = t · exp(-a² + P(t)).
    let mut p = 0.170_872_77;
    for c in [
        -0.822_152_23,
        1.488_515_87,
        -1.135_203_98,
        0.278_868_07,
        -0.186_288_06,
        0.096_784_18,
        0.374_091_96,
        1.000_023_68,
        -1.265_512_23,
    ] {
        p = madd(K::FMA, p, t, c);
    }
    // exp(-a² + P), a² = x²/2 = hi + lo from x itself (not from the
    // rounded a), as one `exp` of the sum rounded to f32: a relative error
    // of about a² · 2^-24 (1.5e-6 at a = 5, x = -7.1, where the GELU is
    // -5e-12; under 1e-6 for |x| < 5.7). exp(-hi) · exp(P - lo) kept 1e-6
    // there with a second `exp`, about 30% of the function's operations
    // (a Florence-2 q8_0 encode, 84 million GELUs, took 1143 against
    // 1095 ms, medians of 4 interleaved rounds).
    let hi = 0.5 * (x * x);
    let lo = if K::FMA {
        0.5 * x.mul_add(x, -(x * x))
    } else {
        0.0
    };
    let erfc_a = t * exp_neg::<K>((p - lo) - hi);
    let erfc_z = if z >= 0.0 { erfc_a } else { 2.0 - erfc_a };
    0.5 * x * erfc_z
}

/// `x · σ(2u)`, `u = √(2/π)(x + 0.044715 x³)`.
#[inline(always)]
fn gelu_tanh<K: Kernel>(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let u = SQRT_2_OVER_PI * madd(K::FMA, 0.044_715 * x * x, x, x);
    // σ(2u) = 1 / (1 + e^{-2u}) for u ≥ 0, e^{2u} / (1 + e^{2u}) below.
    let e = exp_neg::<K>(-2.0 * u.abs());
    let s = if u >= 0.0 { 1.0 } else { e } / (1.0 + e);
    x * s
}

/// GELU of one value, exact or with the tanh approximation (what
/// [`run_generic`] computes per element: a caller that holds the values
/// in registers, a product's epilogue, gets the same bits).
#[inline(always)]
pub(crate) fn gelu_one<K: Kernel>(exact: bool, x: f32) -> f32 {
    if exact {
        gelu_erf::<K>(x)
    } else {
        gelu_tanh::<K>(x)
    }
}

#[inline(always)]
pub(crate) fn run_generic<K: Kernel>(exact: bool, x: &[f32], y: &mut [f32]) {
    if exact {
        for (o, &v) in y.iter_mut().zip(x) {
            *o = gelu_erf::<K>(v);
        }
    } else {
        for (o, &v) in y.iter_mut().zip(x) {
            *o = gelu_tanh::<K>(v);
        }
    }
}

crate::kernels::micro::per_isa! {
    /// GELU of `x` into `y`.
    fn run(exact: bool, x: &[f32], y: &mut [f32]) = run_generic::<Fma>
}

/// GELU of `y` in place: [`run_generic`]'s values, bit for bit.
#[inline(always)]
pub(crate) fn in_place_generic<K: Kernel>(exact: bool, y: &mut [f32]) {
    if exact {
        for v in y.iter_mut() {
            *v = gelu_erf::<K>(*v);
        }
    } else {
        for v in y.iter_mut() {
            *v = gelu_tanh::<K>(*v);
        }
    }
}

crate::kernels::micro::per_isa! {
    /// GELU of `y` in place (a product's outputs before it stores them).
    pub(crate) fn in_place(exact: bool, y: &mut [f32]) = in_place_generic::<Fma>
}

/// [`run_generic`] for bf16: widened through two stack buffers (no
/// allocation) and rounded back (to nearest even, as candle's bf16 ops),
/// the conversions compiled for the same instruction set as the GELU (in
/// the caller's baseline they ran 4 values at a time: ~4% of a `--dtype
/// bf16` encode).
#[inline(always)]
fn run_bf16_generic<K: Kernel>(exact: bool, x: &[bf16], y: &mut [bf16]) {
    let (mut wide, mut out) = ([0f32; WIDEN], [0f32; WIDEN]);
    for (y, x) in y.chunks_mut(WIDEN).zip(x.chunks(WIDEN)) {
        let (wide, out) = (&mut wide[..x.len()], &mut out[..x.len()]);
        for (w, v) in wide.iter_mut().zip(x) {
            *w = v.to_f32();
        }
        run_generic::<K>(exact, wide, out);
        for (o, v) in y.iter_mut().zip(out.iter()) {
            *o = bf16::from_f32(*v);
        }
    }
}

crate::kernels::micro::per_isa! {
    /// GELU of bf16 `x` into `y`.
    fn run_bf16(exact: bool, x: &[bf16], y: &mut [bf16]) = run_bf16_generic::<Fma>
}

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "vl-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let y = match s {
            CpuStorage::F32(data) => {
                let x = contiguous(data, l, "vl-gelu", "x")?;
                CpuStorage::F32(par_filled(x.len(), CHUNK, |i, y| {
                    run(self.isa, self.exact, &x[i * CHUNK..][..y.len()], y)
                }))
            }
            CpuStorage::BF16(data) => {
                let x = contiguous(data, l, "vl-gelu", "x")?;
                CpuStorage::BF16(par_filled(x.len(), CHUNK, |i, y| {
                    run_bf16(self.isa, self.exact, &x[i * CHUNK..][..y.len()], y)
                }))
            }
            _ => candle_core::bail!("vl-gelu: x must be f32 or bf16, got {:?}", s.dtype()),
        };
        Ok((y, l.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn erf_gelu(x: f64) -> f64 {
        0.5 * x * libm::erfc(-x / std::f64::consts::SQRT_2)
    }

    fn tanh_gelu(x: f64) -> f64 {
        let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
        // x/2 · (1 + tanh u), without 1 + tanh u cancelling for u << 0.
        x / (1.0 + (-2.0 * u).exp())
    }

    /// Both forms on every instruction set this CPU has against f64
    /// references over [-30, 30] (steps of 1/64, and ±0, ±1e-20): relative
    /// error under 1e-6 where the value is above 1e-35 in magnitude, plus
    /// the f32 rounding of the exponent: `x² · 3e-8` for the exact form,
    /// `|u| · 2.4e-7` for the tanh form (as any f32 GELU);
    /// absolute 1e-35 below (deep negative inputs underflow to 0 as in
    /// f32); +inf gives +inf; NaN stays NaN.
    #[test]
    fn matches_f64_on_every_isa() {
        let mut xs: Vec<f32> = (-30 * 64..=30 * 64).map(|i| i as f32 / 64.0).collect();
        xs.extend([0.0, -0.0, 1e-20, -1e-20]);
        for isa in CpuFeatures::get().isas() {
            for exact in [true, false] {
                let op = Gelu { exact, isa };
                let mut ys = vec![0f32; xs.len()];
                run(op.isa, op.exact, &xs, &mut ys);
                for (&x, &y) in xs.iter().zip(&ys) {
                    let want = if exact {
                        erf_gelu(x as f64)
                    } else {
                        tanh_gelu(x as f64)
                    };
                    let rel = ((y as f64 - want) / want).abs();
                    // The exponent's own f32 rounding: in the exact form
                    // -x²/2 + P(t) (a relative x²/2 · 2^-24, doubled
                    // without FMA, where x² itself is rounded); in the
                    // tanh form u (2|u| · 2^-23).
                    let x64 = x as f64;
                    let tol = if exact {
                        1e-6 + x64 * x64 * 3e-8
                    } else {
                        let u = 0.8 * (x64 + 0.045 * x64 * x64 * x64);
                        1e-6 + 2.0 * u.abs() * 1.2e-7
                    };
                    let ok = if want.abs() > 1e-35 {
                        rel < tol
                    } else {
                        (y as f64 - want).abs() < 1e-35
                    };
                    assert!(ok, "{isa:?} exact {exact}: gelu({x}) = {y}, want {want}");
                }
                let mut edge = [0f32; 2];
                run(op.isa, op.exact, &[f32::NAN, f32::INFINITY], &mut edge);
                assert!(
                    edge[0].is_nan(),
                    "{isa:?} exact {exact}: NaN in, {}",
                    edge[0]
                );
                assert_eq!(edge[1], f32::INFINITY, "{isa:?} exact {exact}");
            }
        }
    }

    /// Through candle: the same values as candle's `gelu_erf` / `gelu`
    /// (relative 1e-5 on the scale of the values; in bf16, the f32 result
    /// rounded once)
    /// on a tensor longer than one parallel chunk, of its shape; a tracked
    /// input takes candle's path and keeps its gradient.
    #[test]
    fn equals_candles_ops() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let x = (Tensor::randn(0f32, 1., (3, 7, CHUNK / 5), &dev)? * 4.0)?;
        for exact in [true, false] {
            let got = forward(&x, exact)?;
            let want = if exact { x.gelu_erf()? } else { x.gelu()? };
            assert_eq!(got.dims(), x.dims());
            let err = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(err < 1e-5 * 16.0, "exact {exact}: {err}");
            // bf16: the f32 values of the bf16 inputs, rounded once (candle's
            // bf16 `gelu` computes in bf16 steps and is further off).
            let xb = x.to_dtype(DType::BF16)?;
            let got = forward(&xb, exact)?;
            assert_eq!(got.dtype(), DType::BF16);
            let want = forward(&xb.to_dtype(DType::F32)?, exact)?.to_dtype(DType::BF16)?;
            let diff = (got.to_dtype(DType::F32)? - want.to_dtype(DType::F32)?)?;
            let diff = diff.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "bf16 exact {exact}");
        }
        let v = candle_core::Var::from_tensor(&x.narrow(2, 0, 8)?)?;
        let y = forward(v.as_tensor(), true)?.sum_all()?;
        let g = y.backward()?;
        assert!(g.get(v.as_tensor()).is_some(), "gradient reaches x");
        Ok(())
    }
}
