//! Head bookkeeping shared by the attention modules.

use candle_core::Tensor;

use crate::error::{AttnError, Result};
use crate::mask::Mask;

/// How an inner width splits into heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HeadLayout {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl HeadLayout {
    pub fn new(
        module: &'static str,
        inner: usize,
        num_heads: usize,
        num_kv_heads: usize,
    ) -> Result<Self> {
        let err = |reason: String| Err(AttnError::Config { module, reason });
        if num_heads == 0 || num_kv_heads == 0 {
            return err(format!(
                "heads ({num_heads}) and kv heads ({num_kv_heads}) must be positive"
            ));
        }
        if inner == 0 || inner % num_heads != 0 {
            return err(format!(
                "inner width {inner} is not a positive multiple of heads {num_heads}"
            ));
        }
        if num_heads % num_kv_heads != 0 {
            return err(format!(
                "heads {num_heads} is not divisible by kv heads {num_kv_heads}"
            ));
        }
        Ok(Self {
            num_heads,
            num_kv_heads,
            head_dim: inner / num_heads,
        })
    }

    pub fn kv_inner(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    pub fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }
}

/// Checks a `(batch, len, width)` input and returns `(batch, len)`.
pub(crate) fn check_input(
    arg: &'static str,
    x: &Tensor,
    width: usize,
    width_name: &str,
) -> Result<(usize, usize)> {
    match x.dims() {
        &[b, t, d] if d == width => Ok((b, t)),
        dims => Err(AttnError::Shape {
            arg,
            expected: format!("(batch, len, {width}) with {width_name} = {width}"),
            actual: dims.to_vec(),
        }),
    }
}

/// `(b, t, heads * head_dim)` -> `(b, heads, t, head_dim)`, contiguous.
pub(crate) fn split_heads(
    x: &Tensor,
    b: usize,
    t: usize,
    heads: usize,
    head_dim: usize,
) -> Result<Tensor> {
    // (b, t, h, hd) -> (b, h, t, hd)
    Ok(x.reshape((b, t, heads, head_dim))?
        .transpose(1, 2)?
        .contiguous()?)
}

/// `(b, heads, t, head_dim)` -> `(b, t, heads * head_dim)`.
pub(crate) fn merge_heads(x: &Tensor, b: usize, t: usize) -> Result<Tensor> {
    let (_, h, _, hd) = x.dims4()?;
    // (b, h, t, hd) -> (b, t, h, hd) -> (b, t, h * hd)
    Ok(x.transpose(1, 2)?.reshape((b, t, h * hd))?)
}

/// Zeroes the output rows `(b, t, out)` of queries that the mask lets
/// attend to nothing, so that they receive nothing, not even a bias.
pub(crate) fn silence_unattending(out: Tensor, mask: Option<&Mask>) -> Result<Tensor> {
    match mask {
        None => Ok(out),
        Some(m) => Ok(out.broadcast_mul(&m.any_key(out.dtype())?)?),
    }
}
