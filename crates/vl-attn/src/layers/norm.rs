//! Layer normalisation that trains, and runs on vl's kernel on CPU.
//!
//! candle-nn's `LayerNorm` runs a fused kernel without a backward pass
//! whenever its input is contiguous, which silently cuts gradients. This
//! wrapper switches to the differentiable composition when the input
//! tracks gradients. In inference on CPUs with AVX-512, f32 and bf16 rows
//! are normalised by vl's kernel ([`crate::kernels::norm`]): candle's sums
//! each row's squares one value at a time (and widens bf16 one value at a
//! time), ~2% of a ViT-B encode in f32 and ~4% in bf16 (profiles of `vl
//! bench`). Elsewhere (other dtypes and devices, other CPUs) candle's
//! fused kernel runs.

use candle_core::{DType, Tensor};
use candle_nn::{LayerNormConfig, Module, VarBuilder};

use crate::error::Result;
use crate::kernels::norm;

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

    /// Adds `prefix.weight` and `prefix.bias` (see [`crate::named`]).
    pub fn named_tensors(&self, prefix: &str, out: &mut crate::named::Named) {
        use crate::named::join;
        out.insert(join(prefix, "weight"), self.inner.weight().clone());
        if let Some(b) = self.inner.bias() {
            out.insert(join(prefix, "bias"), b.clone());
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
            if norm::applies(x, self.inner.weight(), bias) {
                return Ok(norm::layer_norm(
                    x,
                    self.inner.weight(),
                    bias,
                    self.eps as f32,
                )?);
            }
        }
        Ok(self.inner.forward(x)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The layer on whichever kernel runs (vl's where [`norm::applies`],
    /// candle's elsewhere) against f64, at a mean of 0 (candle's one-pass
    /// variance is exact enough there): f32 within 1e-5 of the largest
    /// output, bf16 within 2^-7.
    #[test]
    fn forward_matches_f64() -> Result<()> {
        let dev = Device::Cpu;
        let (rows, width) = (6, 40);
        let x: Vec<f32> = (0..rows * width)
            .map(|i| ((i * 7919) % 1013) as f32 / 1013.0 * 4.0 - 2.0)
            .collect();
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1.0 / 128.0)] {
            let x = Tensor::from_vec(x.clone(), (rows, width), &dev)?.to_dtype(dtype)?;
            let w = Tensor::arange(0f32, width as f32, &dev)?
                .affine(0.01, 0.5)?
                .to_dtype(dtype)?;
            let b = Tensor::arange(0f32, width as f32, &dev)?
                .affine(-0.01, 0.1)?
                .to_dtype(dtype)?;
            let got = LayerNorm::new(w.clone(), b.clone(), 1e-5).forward(&x)?;
            let host = |t: &Tensor| -> Result<Vec<f64>> {
                Ok(t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?)
            };
            let (xs, ws, bs, got) = (host(&x)?, host(&w)?, host(&b)?, host(&got)?);
            for (r, (xr, gr)) in xs.chunks(width).zip(got.chunks(width)).enumerate() {
                let mean = xr.iter().sum::<f64>() / width as f64;
                let var = xr.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / width as f64;
                for (i, (v, g)) in xr.iter().zip(gr).enumerate() {
                    let want = (v - mean) / (var + 1e-5).sqrt() * ws[i] + bs[i];
                    assert!(
                        (g - want).abs() <= tol * 4.0,
                        "{dtype:?} row {r}: {g} vs {want}"
                    );
                }
            }
        }
        Ok(())
    }
}
