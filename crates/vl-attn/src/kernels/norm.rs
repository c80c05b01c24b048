//! LayerNorm rows on the CPU: `(x - mean) / sqrt(var + eps) · weight +
//! bias` over the last dimension, f32 or bf16, rows split across the
//! rayon pool.
//!
//! Each row takes two passes, its mean and then the mean square of its
//! deviations, with every value taken relative to the row's first one
//! (exact for values within a factor 2 of it), so that a large mean costs
//! no precision: the sums are of the small differences, not of the large
//! values (candle's one-pass `E[x²] - mean²` loses a row at a mean of 1e3
//! in f32). One implementation per instruction set: AVX-512F intrinsics
//! (f32 rows; bf16 rows with AVX512_BF16 for the rounding), and the same
//! arithmetic in plain Rust, which is the fallback and the oracle.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};
use half::bf16;

use super::features::{Bf16Isa, Bf16Simd, CpuFeatures, Isa, Simd};
use super::gemv::Weight;
use super::host::contiguous;

/// Whether [`crate::LayerNorm`] runs this kernel on `x`: untracked, on
/// CPU, f32 where the CPU has AVX-512F or bf16 where it has AVX512_BF16
/// (elsewhere candle's fused kernel is as fast as the portable one, and
/// stays), with a weight and bias of its dtype and of its last
/// dimension's width, contiguous.
pub fn applies(x: &Tensor, weight: &Tensor, bias: &Tensor) -> bool {
    let Some(&width) = x.dims().last() else {
        return false;
    };
    let cpu = CpuFeatures::get();
    let supported = match x.dtype() {
        DType::F32 => cpu.isa().simd() == Simd::Avx512,
        DType::BF16 => cpu.bf16_isa().simd() != Bf16Simd::Portable,
        _ => false,
    };
    supported
        && x.device().is_cpu()
        && !x.track_op()
        && width > 0
        && [weight, bias].iter().all(|t| {
            t.dtype() == x.dtype() && t.dims() == [width] && t.is_contiguous() && !t.track_op()
        })
}

/// `x (..., width)` normalised with `weight (width)` and `bias (width)`,
/// all f32 or all bf16 on the CPU, on the best implementation this CPU
/// runs; `x` may be strided (it is made contiguous first).
///
/// # Errors
/// Tensors of other dtypes, devices or widths, named.
pub fn layer_norm(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f32,
) -> candle_core::Result<Tensor> {
    let cpu = CpuFeatures::get();
    layer_norm_with(x, weight, bias, eps, (cpu.isa(), cpu.bf16_isa()))
}

/// [`layer_norm`] on given implementations: `f32` rows on `isa`'s, bf16
/// rows on `bf16`'s.
pub(crate) fn layer_norm_with(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f32,
    (isa, bf16): (Isa, Bf16Isa),
) -> candle_core::Result<Tensor> {
    if !x.device().is_cpu() {
        candle_core::bail!("vl-layer-norm: x must be on the CPU, got {:?}", x.device());
    }
    x.contiguous()?
        .apply_op3_no_bwd(weight, bias, &Norm { eps, isa, bf16 })
}

/// The op's `x`, weight and bias.
type Slices<'a, T> = (&'a [T], &'a [T], &'a [T]);

/// `x`, weight and bias as contiguous slices, or an error naming the one
/// that is not.
fn slices<'a, T>(
    (x, lx): (&'a [T], &Layout),
    (w, lw): (&'a [T], &Layout),
    (b, lb): (&'a [T], &Layout),
) -> candle_core::Result<Slices<'a, T>> {
    Ok((
        contiguous(x, lx, "vl-layer-norm", "x")?,
        contiguous(w, lw, "vl-layer-norm", "weight")?,
        contiguous(b, lb, "vl-layer-norm", "bias")?,
    ))
}

/// Every row of `x` (`width` values each) through `row(x, y)`, rows split
/// across the pool in tasks of about 16K values.
fn rows<T: Copy + Default + Send + Sync>(
    x: &[T],
    width: usize,
    row: impl Fn(&[T], &mut [T]) + Sync,
) -> Vec<T> {
    let task = (16 * 1024 / width).max(1) * width;
    crate::kernels::host::par_filled(x.len(), task, |i, y| {
        let x = &x[i * task..][..y.len()];
        for (y, x) in y.chunks_exact_mut(width).zip(x.chunks_exact(width)) {
            row(x, y);
        }
    })
}

/// `(x - mean) / sqrt(var + eps) · weight + bias` over the last dimension.
struct Norm {
    eps: f32,
    /// The implementation of f32 rows.
    isa: Isa,
    /// The implementation of bf16 rows.
    bf16: Bf16Isa,
}

impl CustomOp3 for Norm {
    fn name(&self) -> &'static str {
        "vl-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let width = l1.dims().last().copied().unwrap_or(0);
        if width == 0 || l2.dims() != [width] || l3.dims() != [width] {
            candle_core::bail!(
                "vl-layer-norm: x {:?}, weight {:?} and bias {:?} do not fit",
                l1.dims(),
                l2.dims(),
                l3.dims()
            );
        }
        let eps = self.eps;
        let y = match (s1, s2, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(w), CpuStorage::F32(b)) => {
                let (x, w, b) = slices((x, l1), (w, l2), (b, l3))?;
                CpuStorage::F32(match self.isa.simd() {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: the token proves AVX-512F; rows, weight and
                    // bias are `width` long (checked above).
                    Simd::Avx512 => rows(x, width, |x, y| unsafe { row_f32(x, w, b, eps, y) }),
                    _ => rows(x, width, |x, y| portable_row(x, w, b, eps, y)),
                })
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(w), CpuStorage::BF16(b)) => {
                let (x, w, b) = slices((x, l1), (w, l2), (b, l3))?;
                CpuStorage::BF16(match self.bf16.simd() {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: the token proves AVX-512F and AVX512_BF16;
                    // rows, weight and bias are `width` long.
                    Bf16Simd::Amx | Bf16Simd::Avx512Bf16 | Bf16Simd::Avx512Fma => {
                        rows(x, width, |x, y| unsafe { row_bf16(x, w, b, eps, y) })
                    }
                    _ => rows(x, width, |x, y| portable_row(x, w, b, eps, y)),
                })
            }
            _ => candle_core::bail!(
                "vl-layer-norm: x, weight and bias must be f32 or bf16 alike; got {:?}, {:?}, {:?}",
                s1.dtype(),
                s2.dtype(),
                s3.dtype()
            ),
        };
        Ok((y, l1.shape().clone()))
    }
}

/// An element of a row: widened to f32 to be read, rounded from f32 to
/// be written (bf16 to nearest even, as `vcvtneps2bf16` rounds).
pub(crate) trait RowElem: Weight + Default {
    fn from_f32(v: f32) -> Self;
}

impl RowElem for f32 {
    #[inline(always)]
    fn from_f32(v: f32) -> f32 {
        v
    }
}

impl RowElem for bf16 {
    #[inline(always)]
    fn from_f32(v: f32) -> bf16 {
        bf16::from_f32(v)
    }
}

/// One row in plain Rust: the fallback and the oracle. The arithmetic of
/// [`avx512::row`] — the two passes relative to the row's first value,
/// sums over 16 lanes then across them — so the two agree to rounding.
pub(crate) fn portable_row<E: RowElem>(x: &[E], w: &[E], b: &[E], eps: f32, y: &mut [E]) {
    const LANES: usize = 16;
    let n = x.len().min(w.len()).min(b.len()).min(y.len());
    if n == 0 {
        return;
    }
    let full = n / LANES * LANES;
    let origin = x[0].to_f32();
    let mut acc = [0f32; LANES];
    for c in x[..full].chunks_exact(LANES) {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v.to_f32() - origin;
        }
    }
    let sum = x[full..n]
        .iter()
        .fold(acc.iter().sum::<f32>(), |s, v| s + (v.to_f32() - origin));
    let mean = sum / n as f32;
    let mut acc = [0f32; LANES];
    for c in x[..full].chunks_exact(LANES) {
        for (a, v) in acc.iter_mut().zip(c) {
            let d = (v.to_f32() - origin) - mean;
            *a += d * d;
        }
    }
    let squares = x[full..n].iter().fold(acc.iter().sum::<f32>(), |s, v| {
        let d = (v.to_f32() - origin) - mean;
        s + d * d
    });
    let rstd = 1.0 / (squares / n as f32 + eps).sqrt();
    // Plain products and sums (`mul_add` is a library call on x86-64's
    // baseline, which has no FMA).
    for i in 0..n {
        let d = ((x[i].to_f32() - origin) - mean) * rstd;
        y[i] = E::from_f32(d * w[i].to_f32() + b[i].to_f32());
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{
        __m512, _mm512_add_ps, _mm512_fmadd_ps, _mm512_mul_ps, _mm512_reduce_add_ps,
        _mm512_set1_ps, _mm512_setzero_ps, _mm512_storeu_ps, _mm512_sub_ps,
    };

    use half::bf16;

    use super::RowElem;
    use crate::kernels::gemv::Weight;

    /// Elements the kernel writes: 16 f32 lanes stored as the type.
    pub(super) trait Out: Weight + RowElem {
        /// # Safety
        /// 16 values writable at `p`; the CPU has AVX-512F (and
        /// AVX512_BF16 for bf16).
        unsafe fn store16(p: *mut Self, v: __m512);
    }

    impl Out for f32 {
        #[inline(always)]
        unsafe fn store16(p: *mut f32, v: __m512) {
            // SAFETY: the caller's contract.
            unsafe { _mm512_storeu_ps(p, v) }
        }
    }

    impl Out for bf16 {
        #[inline(always)]
        unsafe fn store16(p: *mut bf16, v: __m512) {
            // SAFETY: the caller's contract.
            unsafe { crate::kernels::gemm_bf16::store_bf16x16(p, v) }
        }
    }

    /// One row: its mean, then the mean square of its deviations (two
    /// passes), then `(x - mean) · rstd · w + b`; 16 values at a time, the
    /// tail one by one. In f32, with every value taken relative to the
    /// row's first one (exact for values within a factor 2 of it), so that
    /// a large mean costs no precision: the sums are of the small
    /// differences, not of the large values.
    ///
    /// # Safety
    /// The CPU has AVX-512F and, for bf16, AVX512_BF16; inlined only into
    /// [`row_f32`](super::row_f32) and [`row_bf16`](super::row_bf16),
    /// compiled for those.
    #[inline(always)]
    pub(super) unsafe fn row<E: Out>(x: &[E], w: &[E], b: &[E], eps: f32, y: &mut [E]) {
        let n = x.len().min(w.len()).min(b.len()).min(y.len());
        if n == 0 {
            return;
        }
        let full = n / 16 * 16;
        let origin = x[0].to_f32();
        // SAFETY: every offset below is `< full <= n` plus up to 15.
        unsafe {
            let (xp, wp, bp, yp) = (x.as_ptr(), w.as_ptr(), b.as_ptr(), y.as_mut_ptr());
            let vorigin = _mm512_set1_ps(origin);
            let shifted = |i: usize| _mm512_sub_ps(E::load16(xp.add(i)), vorigin);
            let mut acc = _mm512_setzero_ps();
            for i in (0..full).step_by(16) {
                acc = _mm512_add_ps(acc, shifted(i));
            }
            let sum = x[full..n]
                .iter()
                .fold(_mm512_reduce_add_ps(acc), |s, v| s + (v.to_f32() - origin));
            // The mean relative to `origin`.
            let mean = sum / n as f32;
            let vmean = _mm512_set1_ps(mean);
            let mut acc = _mm512_setzero_ps();
            for i in (0..full).step_by(16) {
                let d = _mm512_sub_ps(shifted(i), vmean);
                acc = _mm512_fmadd_ps(d, d, acc);
            }
            let squares = x[full..n].iter().fold(_mm512_reduce_add_ps(acc), |s, v| {
                let d = (v.to_f32() - origin) - mean;
                s + d * d
            });
            let rstd = 1.0 / (squares / n as f32 + eps).sqrt();
            let vrstd = _mm512_set1_ps(rstd);
            for i in (0..full).step_by(16) {
                let d = _mm512_mul_ps(_mm512_sub_ps(shifted(i), vmean), vrstd);
                let v = _mm512_fmadd_ps(d, E::load16(wp.add(i)), E::load16(bp.add(i)));
                E::store16(yp.add(i), v);
            }
            for i in full..n {
                let d = ((x[i].to_f32() - origin) - mean) * rstd;
                y[i] = E::from_f32(d.mul_add(w[i].to_f32(), b[i].to_f32()));
            }
        }
    }
}

/// [`avx512::row`] for f32 rows.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn row_f32(x: &[f32], w: &[f32], b: &[f32], eps: f32, y: &mut [f32]) {
    // SAFETY: the caller's contract.
    unsafe { avx512::row(x, w, b, eps, y) }
}

/// [`avx512::row`] for bf16 rows.
///
/// # Safety
/// The CPU has AVX-512F and AVX512_BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn row_bf16(x: &[bf16], w: &[bf16], b: &[bf16], eps: f32, y: &mut [bf16]) {
    // SAFETY: the caller's contract.
    unsafe { avx512::row(x, w, b, eps, y) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Every implementation this CPU runs, f32 and bf16, against an f64
    /// oracle computed from the same (rounded) inputs: f32 within 1e-5 of
    /// the largest output, bf16 within one bf16 step (2^-7) of it; widths
    /// 1, 15, 16, 17 (the vector width and its neighbours), 33 and 768;
    /// rows at a mean of 1e3 (which a one-pass variance loses) beside
    /// rows of noise; several tasks' worth of rows.
    #[test]
    fn every_implementation_matches_f64() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let cpu = CpuFeatures::get();
        for (rows, width) in [(3, 1), (4, 15), (4, 16), (5, 17), (3, 33), (45, 768)] {
            let n = rows * width;
            let w: Vec<f32> = (0..width).map(|i| 0.5 + (i % 7) as f32 / 7.0).collect();
            let b: Vec<f32> = (0..width).map(|i| (i % 5) as f32 / 5.0 - 0.4).collect();
            let x: Vec<f32> = (0..n)
                .map(|i| {
                    let noise = ((i * 7919) % 1013) as f32 / 1013.0 - 0.5;
                    if (i / width) % 2 == 1 {
                        1e3 + noise
                    } else {
                        noise * 4.0
                    }
                })
                .collect();
            for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1.0 / 128.0)] {
                let x = Tensor::from_vec(x.clone(), (rows, width), &dev)?.to_dtype(dtype)?;
                let w = Tensor::from_vec(w.clone(), width, &dev)?.to_dtype(dtype)?;
                let b = Tensor::from_vec(b.clone(), width, &dev)?.to_dtype(dtype)?;
                let want = oracle(&x, &w, &b, 1e-5)?;
                let scale = want.iter().fold(1f64, |m, v| m.max(v.abs()));
                let pairs: Vec<(Isa, Bf16Isa)> = match dtype {
                    DType::F32 => cpu
                        .isas()
                        .into_iter()
                        .map(|i| (i, cpu.bf16_isa()))
                        .collect(),
                    _ => cpu
                        .bf16_isas()
                        .into_iter()
                        .map(|i| (cpu.isa(), i))
                        .collect(),
                };
                for pair in pairs {
                    let got = layer_norm_with(&x, &w, &b, 1e-5, pair)?;
                    assert_eq!(got.dtype(), dtype);
                    let got = host(&got)?;
                    let err = got
                        .iter()
                        .zip(&want)
                        .fold(0f64, |m, (g, w)| m.max((g - w).abs()));
                    assert!(
                        err <= tol * scale,
                        "{dtype:?} {rows}x{width} on {pair:?}: {err}"
                    );
                }
            }
        }
        Ok(())
    }

    /// Mismatched widths and dtypes are named, not a panic.
    #[test]
    fn bad_inputs_are_named() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::zeros((2, 8), DType::F32, &dev)?;
        let w = Tensor::ones(7, DType::F32, &dev)?;
        let err = layer_norm(&x, &w, &w, 1e-5).unwrap_err().to_string();
        assert!(err.contains("[2, 8]") && err.contains("[7]"), "{err}");
        let h = Tensor::ones(8, DType::F16, &dev)?;
        let err = layer_norm(&x.to_dtype(DType::F16)?, &h, &h, 1e-5)
            .unwrap_err()
            .to_string();
        assert!(err.contains("F16"), "{err}");
        Ok(())
    }

    fn host(t: &Tensor) -> candle_core::Result<Vec<f64>> {
        t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()
    }

    /// LayerNorm in f64 over the last dimension.
    pub(crate) fn oracle(
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        eps: f64,
    ) -> candle_core::Result<Vec<f64>> {
        let width = w.elem_count();
        let (xs, ws, bs) = (host(x)?, host(w)?, host(b)?);
        Ok(xs
            .chunks(width)
            .flat_map(|r| {
                let mean = r.iter().sum::<f64>() / width as f64;
                let var = r.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / width as f64;
                let rstd = 1.0 / (var + eps).sqrt();
                r.iter()
                    .zip(ws.iter().zip(&bs))
                    .map(move |(v, (w, b))| (v - mean) * rstd * w + b)
                    .collect::<Vec<_>>()
            })
            .collect())
    }
}
