//! Reading transformers tensors into candle-nn layers, shared by the
//! families.

use candle_nn::{Linear, VarBuilder};
use vl_attn::LayerNorm;

use crate::error::Result;

/// A `torch.nn.Linear` `weight (out, in)`, `bias (out)`.
pub(super) fn linear(vb: VarBuilder, inp: usize, out: usize, bias: bool) -> Result<Linear> {
    let w = vb.get((out, inp), "weight")?;
    let b = if bias {
        Some(vb.get(out, "bias")?)
    } else {
        None
    };
    Ok(Linear::new(w, b))
}

pub(super) fn layer_norm(vb: VarBuilder, width: usize, eps: f64) -> Result<LayerNorm> {
    Ok(LayerNorm::load(width, eps, vb)?)
}
