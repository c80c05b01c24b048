//! The optional transform before the LM head: `norm(act(dense(x)))`, as
//! BERT's `cls.predictions.transform` (BLIP's text decoder).

use candle_core::Tensor;
use candle_nn::{Linear, Module, VarBuilder};
use vl_attn::{Activation, LayerNorm};

use crate::config::DecoderConfig;
use crate::error::{arg_err, Result};

/// `norm(act(dense(x)))` on the hidden states, before the LM head
/// (`output_transform` in [`DecoderConfig`]); `act` is the config's
/// `hidden_act`. Stays dense when the decoder is quantized.
///
/// Weights: `dense (hidden, hidden)` with bias, `norm`.
#[derive(Debug, Clone)]
pub struct OutputTransform {
    dense: Linear,
    act: Activation,
    norm: LayerNorm,
}

impl OutputTransform {
    /// Adds `dense` and `norm` under `prefix` (see [`vl_attn::named`]).
    pub fn named_tensors(&self, prefix: &str, out: &mut vl_attn::named::Named) {
        use vl_attn::named::join;
        out.insert(join(prefix, "dense.weight"), self.dense.weight().clone());
        if let Some(b) = self.dense.bias() {
            out.insert(join(prefix, "dense.bias"), b.clone());
        }
        self.norm.named_tensors(&join(prefix, "norm"), out);
    }

    /// Loads (or initialises) `dense` and `norm` under `vb`.
    pub fn load(vb: VarBuilder, cfg: &DecoderConfig) -> Result<Self> {
        let h = cfg.hidden_size;
        Ok(Self {
            dense: candle_nn::linear(h, h, vb.pp("dense"))?,
            act: cfg.hidden_act,
            norm: LayerNorm::load(h, cfg.layer_norm_eps, vb.pp("norm"))?,
        })
    }

    /// Builds the transform from existing parts (checkpoint converters).
    ///
    /// # Errors
    /// [`crate::DecoderError::Argument`] naming `dense` when its weight is
    /// not `(hidden_size, hidden_size)`.
    pub fn from_parts(dense: Linear, norm: LayerNorm, cfg: &DecoderConfig) -> Result<Self> {
        let h = cfg.hidden_size;
        if dense.weight().dims() != [h, h] {
            return arg_err(
                "output_transform.dense",
                format!(
                    "expected weight shape [{h}, {h}], got {:?}",
                    dense.weight().dims()
                ),
            );
        }
        Ok(Self {
            dense,
            act: cfg.hidden_act,
            norm,
        })
    }

    /// # Shapes
    /// `x: (batch, len, hidden)` → `(batch, len, hidden)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.act.forward(&self.dense.forward(x)?)?;
        Ok(self.norm.forward(&h)?)
    }
}
