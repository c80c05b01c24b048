//! Layer normalisation that trains.
//!
//! candle-nn's `LayerNorm` runs a fused kernel without a backward pass
//! whenever its input is contiguous, which silently cuts gradients. This
//! wrapper keeps the fused kernel for inference and switches to the
//! differentiable composition when the input tracks gradients.

use candle_core::Tensor;
use candle_nn::{LayerNormConfig, Module, VarBuilder};

use crate::error::Result;

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
        Ok(self.inner.forward(x)?)
    }
}
