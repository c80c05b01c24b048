//! Layer normalisation that trains, and runs on vl's kernel on CPU.
//!
//! candle-nn's `LayerNorm` runs a fused kernel without a backward pass
//! whenever its input is contiguous, which silently cuts gradients. This
//! wrapper switches to the differentiable composition when the input
//! tracks gradients. In inference on CPUs with AVX-512, f32 and bf16 rows
//! are normalised by vl's kernel: candle's sums each row's squares one
//! value at a time (and widens bf16 one value at a time), ~2% of a ViT-B
//! encode in f32 and ~4% in bf16 (profiles of `vl bench`). Elsewhere
//! (other dtypes and devices, other CPUs) candle's fused kernel runs.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};
use candle_nn::{LayerNormConfig, Module, VarBuilder};
#[cfg(target_arch = "x86_64")]
use half::bf16;
#[cfg(target_arch = "x86_64")]
use rayon::prelude::*;

use crate::error::Result;
#[cfg(target_arch = "x86_64")]
use crate::kernel::contiguous;

/// Layer normalisation with weight and bias: `weight (width,)`, `bias (width,)`.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    inner: candle_nn::LayerNorm,
    eps: f64,
}

impl LayerNorm {
    /// Loads or initialises (weight 1, bias 0) a norm of `width` under `vb`.
    pub fn load(width: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        let cfg = LayerNormConfig {
            eps,
            ..Default::default()
        };
        Ok(Self {
            inner: candle_nn::layer_norm(width, cfg, vb)?,
            eps,
        })
    }

    /// Builds from existing weight and bias.
    pub fn new(weight: Tensor, bias: Tensor, eps: f64) -> Self {
        Self {
            inner: candle_nn::LayerNorm::new(weight, bias, eps),
            eps,
        }
    }

    /// A copy with its weight and bias in `dtype` (e.g. an f32 norm on
    /// the last hidden state of a 16-bit model, widened first).
    ///
    /// # Errors
    /// When a tensor cannot be converted (a device without `dtype`).
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        let weight = self.inner.weight().to_dtype(dtype)?;
        let bias = match self.inner.bias() {
            Some(b) => b.to_dtype(dtype)?,
            None => weight.zeros_like()?,
        };
        Ok(Self::new(weight, bias, self.eps))
    }

    /// Normalises over the last dimension.
    ///
    /// # Shapes
    /// `x: (..., width)` → the same shape.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.track_op() {
            let bias = match self.inner.bias() {
                Some(b) => b.clone(),
                None => self.inner.weight().zeros_like()?,
            };
            return Ok(candle_nn::ops::layer_norm_slow(
                x,
                self.inner.weight(),
                &bias,
                self.eps as f32,
            )?);
        }
        if let Some(bias) = self.inner.bias() {
            if ours(x, self.inner.weight(), bias) {
                let op = Norm {
                    eps: self.eps as f32,
                };
                return Ok(x
                    .contiguous()?
                    .apply_op3_no_bwd(self.inner.weight(), bias, &op)?);
            }
        }
        Ok(self.inner.forward(x)?)
    }
}

/// Whether vl's kernel normalises `x`: untracked, on CPU, f32 (AVX-512F)
/// or bf16 (AVX-512F and AVX512_BF16), with a weight and bias of its dtype
/// and of its last dimension's width, contiguous.
fn ours(x: &Tensor, weight: &Tensor, bias: &Tensor) -> bool {
    let Some(&width) = x.dims().last() else {
        return false;
    };
    let supported = match x.dtype() {
        DType::F32 => crate::gemv::isa() == crate::gemv::Isa::Avx512,
        DType::BF16 => crate::gemm_bf16::available(),
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

/// The op's `x`, weight and bias.
#[cfg(target_arch = "x86_64")]
type Slices<'a, T> = (&'a [T], &'a [T], &'a [T]);

/// `x`, weight and bias as contiguous slices, or an error naming the one
/// that is not.
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
fn rows<T: Copy + Default + Send + Sync>(
    x: &[T],
    width: usize,
    row: impl Fn(&[T], &mut [T]) + Sync,
) -> Vec<T> {
    let task = (16 * 1024 / width).max(1) * width;
    let mut y = vec![T::default(); x.len()];
    y.par_chunks_mut(task)
        .zip(x.par_chunks(task))
        .for_each(|(y, x)| {
            for (y, x) in y.chunks_exact_mut(width).zip(x.chunks_exact(width)) {
                row(x, y);
            }
        });
    y
}

/// `(x - mean) / sqrt(var + eps) · weight + bias` over the last dimension.
struct Norm {
    eps: f32,
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
        let y = match (s1, s2, s3) {
            #[cfg(target_arch = "x86_64")]
            (CpuStorage::F32(x), CpuStorage::F32(w), CpuStorage::F32(b)) => {
                let (x, w, b) = slices((x, l1), (w, l2), (b, l3))?;
                // SAFETY: `ours` chose this op on a CPU with AVX-512F;
                // rows, weight and bias are `width` long.
                CpuStorage::F32(rows(x, width, |x, y| unsafe {
                    row_f32(x, w, b, self.eps, y)
                }))
            }
            #[cfg(target_arch = "x86_64")]
            (CpuStorage::BF16(x), CpuStorage::BF16(w), CpuStorage::BF16(b))
                if crate::gemm_bf16::available() =>
            {
                let (x, w, b) = slices((x, l1), (w, l2), (b, l3))?;
                // SAFETY: AVX-512F and AVX512_BF16 (checked); rows, weight
                // and bias are `width` long.
                CpuStorage::BF16(rows(x, width, |x, y| unsafe {
                    row_bf16(x, w, b, self.eps, y)
                }))
            }
            _ => candle_core::bail!(
                "vl-layer-norm: x, weight and bias must be f32, or bf16 on a CPU with \
                 AVX512_BF16, alike; got {:?}, {:?}, {:?}",
                s1.dtype(),
                s2.dtype(),
                s3.dtype()
            ),
        };
        Ok((y, l1.shape().clone()))
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{
        __m512, _mm512_add_ps, _mm512_fmadd_ps, _mm512_mul_ps, _mm512_reduce_add_ps,
        _mm512_set1_ps, _mm512_setzero_ps, _mm512_storeu_ps, _mm512_sub_ps,
    };

    use half::bf16;

    use crate::kernel::Lanes;

    /// Elements the kernel writes: 16 f32 lanes stored as the type.
    pub(super) trait Out: Lanes {
        /// # Safety
        /// 16 values writable at `p`; the CPU has AVX-512F (and
        /// AVX512_BF16 for bf16).
        unsafe fn store16(p: *mut Self, v: __m512);
        fn from_f32(v: f32) -> Self;
    }

    impl Out for f32 {
        #[inline(always)]
        unsafe fn store16(p: *mut f32, v: __m512) {
            // SAFETY: the caller's contract.
            unsafe { _mm512_storeu_ps(p, v) }
        }
        fn from_f32(v: f32) -> f32 {
            v
        }
    }

    impl Out for bf16 {
        #[inline(always)]
        unsafe fn store16(p: *mut bf16, v: __m512) {
            // SAFETY: the caller's contract.
            unsafe { crate::gemm_bf16::store_bf16x16(p, v) }
        }
        fn from_f32(v: f32) -> bf16 {
            bf16::from_f32(v)
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
    /// [`row_f32`] and [`row_bf16`], compiled for those.
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

    /// vl's kernel (or candle's, where vl's does not run) against an f64
    /// reference computed from the same (rounded) inputs: f32 within 1e-5
    /// of the largest output, bf16 within one bf16 step (2^-7) of it;
    /// widths past and off the vector width (1, 17, 768), rows with a mean
    /// of 1e3 where vl's kernel runs (candle's one-pass `E[x²] - mean²`
    /// loses their variance: an error of 1.0 in f32), several tasks' worth
    /// of rows; the op ran (`ours`) where the CPU allows.
    #[test]
    fn matches_f64() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        for (rows, width) in [(3, 1), (5, 17), (45, 768)] {
            let n = rows * width;
            let w: Vec<f32> = (0..width).map(|i| 0.5 + (i % 7) as f32 / 7.0).collect();
            let b: Vec<f32> = (0..width).map(|i| (i % 5) as f32 / 5.0 - 0.4).collect();
            for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1.0 / 128.0)] {
                let expected = match dtype {
                    DType::F32 => crate::gemv::isa() == crate::gemv::Isa::Avx512,
                    _ => crate::gemm_bf16::available(),
                };
                // Rows at a mean of 1e3 only for vl's kernel (candle's
                // loses them, above).
                let offset = if expected { 1e3 } else { 0.0 };
                let x: Vec<f32> = (0..n)
                    .map(|i| {
                        let noise = ((i * 7919) % 1013) as f32 / 1013.0 - 0.5;
                        if (i / width) % 2 == 1 {
                            offset + noise
                        } else {
                            noise * 4.0
                        }
                    })
                    .collect();
                let x = Tensor::from_vec(x, (rows, width), &dev)?.to_dtype(dtype)?;
                let w = Tensor::from_vec(w.clone(), width, &dev)?.to_dtype(dtype)?;
                let b = Tensor::from_vec(b.clone(), width, &dev)?.to_dtype(dtype)?;
                let host = |t: &Tensor| -> candle_core::Result<Vec<f64>> {
                    t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()
                };
                let (xs, ws, bs) = (host(&x)?, host(&w)?, host(&b)?);
                let want: Vec<f64> = xs
                    .chunks(width)
                    .flat_map(|r| {
                        let mean = r.iter().sum::<f64>() / width as f64;
                        let var = r.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / width as f64;
                        let rstd = 1.0 / (var + 1e-5).sqrt();
                        r.iter()
                            .zip(ws.iter().zip(&bs))
                            .map(move |(v, (w, b))| (v - mean) * rstd * w + b)
                            .collect::<Vec<_>>()
                    })
                    .collect();
                let got = LayerNorm::new(w.clone(), b.clone(), 1e-5)
                    .forward(&x)
                    .map_err(candle_core::Error::wrap)?;
                assert_eq!(got.dtype(), dtype);
                let got = host(&got)?;
                let scale = want.iter().fold(1f64, |m, v| m.max(v.abs()));
                let err = got
                    .iter()
                    .zip(&want)
                    .fold(0f64, |m, (g, w)| m.max((g - w).abs()));
                assert!(err <= tol * scale, "{dtype:?} {rows}x{width}: {err}");
                assert_eq!(ours(&x, &w, &b), expected);
            }
        }
        Ok(())
    }
}
