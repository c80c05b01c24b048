//! The position-wise feed-forward layer and its activations, shared by the
//! decoder and the ViT.

use crate::quantize::Quantizer;
use candle_core::Tensor;
use candle_nn::{Module, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::proj::Proj;

/// The feed-forward activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum Activation {
    /// GELU with the exact erf (`gelu` in transformers).
    #[default]
    #[serde(rename = "gelu", alias = "gelu_erf")]
    Gelu,
    /// GELU with the tanh approximation (`gelu_new`, `gelu_pytorch_tanh`).
    #[serde(
        rename = "gelu_tanh",
        alias = "gelu_new",
        alias = "gelu_pytorch_tanh",
        alias = "gelu_fast"
    )]
    GeluTanh,
    /// `max(0, x)`.
    #[serde(rename = "relu")]
    Relu,
    /// `x * sigmoid(x)`.
    #[serde(rename = "silu", alias = "swish")]
    Silu,
}

impl Activation {
    /// Applies the activation.
    pub fn forward(self, x: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
        match self {
            // vl's vectorised kernel for f32 on the CPU, candle's ops
            // otherwise.
            Self::Gelu => crate::kernels::gelu::forward(x, true),
            Self::GeluTanh => crate::kernels::gelu::forward(x, false),
            Self::Relu => x.relu(),
            Self::Silu => x.silu(),
        }
    }
}

/// The position-wise feed-forward layer `down(act(up(x)))`, dense or
/// quantized.
#[derive(Debug, Clone)]
pub struct FeedForward {
    up: Proj,
    down: Proj,
    act: Activation,
}

impl FeedForward {
    /// Loads `up (intermediate, hidden)` and `down (hidden, intermediate)`
    /// with biases.
    pub fn load(
        vb: VarBuilder,
        hidden: usize,
        intermediate: usize,
        act: Activation,
    ) -> Result<Self> {
        Ok(Self::from_parts(
            candle_nn::linear(hidden, intermediate, vb.pp("up"))?,
            candle_nn::linear(intermediate, hidden, vb.pp("down"))?,
            act,
        ))
    }

    /// Builds from existing layers: dense ones or [`Proj`]s of any format.
    pub fn from_parts(up: impl Into<Proj>, down: impl Into<Proj>, act: Activation) -> Self {
        Self {
            up: up.into(),
            down: down.into(),
            act,
        }
    }

    /// A copy with `up` and `down` quantized to `format`.
    ///
    /// # Errors
    /// [`crate::AttnError::Quantize`] naming `up` (or `down`) when
    /// `hidden` (or `intermediate`) is not a multiple of the format's block
    /// size.
    pub fn quantize(&self, q: impl Into<Quantizer>) -> Result<Self> {
        let q: Quantizer = q.into();
        Ok(Self {
            up: q.proj("up", &self.up)?,
            down: q.proj("down", &self.down)?,
            act: self.act,
        })
    }

    /// The activation between the projections.
    pub fn activation(&self) -> Activation {
        self.act
    }

    /// The up and down projections (a checkpoint's names for them differ:
    /// `fc1`/`fc2`, `up`/`down`).
    pub fn parts(&self) -> (&Proj, &Proj) {
        (&self.up, &self.down)
    }

    /// Adds `up` and `down` under `prefix` (see [`crate::named`]).
    pub fn named_tensors(&self, prefix: &str, out: &mut crate::named::Named) -> Result<()> {
        use crate::named::join;
        self.up.named_tensors(&join(prefix, "up"), out)?;
        self.down.named_tensors(&join(prefix, "down"), out)
    }

    /// # Shapes
    /// `x: (batch, len, hidden)` → `(batch, len, hidden)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self
            .down
            .forward(&self.act.forward(&self.up.forward(x)?)?)?)
    }
}
