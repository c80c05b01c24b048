//! Flamingo's tanh gate, which lets a pretrained text decoder start
//! unchanged: `x + tanh(alpha) * f(x)` with `alpha` initialised to 0.

use candle_core::Tensor;
use candle_nn::{Init, VarBuilder};

use crate::error::{AttnError, Result};

/// A learned gate `tanh(alpha)`, one `alpha` shared by all channels or one
/// per channel.
#[derive(Debug, Clone)]
pub struct TanhGate {
    alpha: Tensor,
}

impl TanhGate {
    /// Loads or initialises (to zero, so the gate starts closed) `alpha` of
    /// shape `(width,)` under `vb` as `name`; `width = 1` shares one value.
    pub fn load(vb: VarBuilder, name: &str, width: usize) -> Result<Self> {
        if width == 0 {
            return Err(AttnError::Config {
                module: "TanhGate",
                reason: "width must be positive".into(),
            });
        }
        Ok(Self {
            alpha: vb.get_with_hints(width, name, Init::Const(0.0))?,
        })
    }

    /// The raw parameter `alpha`, `(width,)`.
    pub fn alpha(&self) -> &Tensor {
        &self.alpha
    }

    /// `tanh(alpha) * x`.
    ///
    /// # Shapes
    /// `x: (..., width)` (or any shape when `width = 1`) → the same shape.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let w = self.alpha.dims()[0];
        if w != 1 && x.dims().last() != Some(&w) {
            return Err(AttnError::Shape {
                arg: "gated input",
                expected: format!("(..., {w})"),
                actual: x.dims().to_vec(),
            });
        }
        Ok(x.broadcast_mul(&self.alpha.tanh()?.to_dtype(x.dtype())?)?)
    }
}
