//! The layers: attention (self, cross, co-attention, the resampler), the
//! projections and their weight formats, norms, feed-forward, gates,
//! masks, caches and dropout — built on candle, calling [`crate::kernels`]
//! for their CPU work. Every module is re-exported at the crate's root
//! (`vl_attn::cross`, `vl_attn::CrossAttention`).

pub mod attention;
pub mod cache;
pub mod co_attn;
pub mod co_block;
pub mod conv;
pub mod cross;
pub mod dropout;
pub mod ffn;
pub mod gate;
pub(crate) mod heads;
pub mod mask;
pub mod named;
pub mod norm;
pub mod pool;
pub mod proj;
pub mod quantize;
pub mod resampler;
pub mod self_attn;
pub mod windows;

/// Whether `a` and `b` hold the same f32 values, bit for bit, in order
/// (the tests of fused paths against the steps they replace).
#[cfg(test)]
pub(crate) fn same_bits(
    a: &candle_core::Tensor,
    b: &candle_core::Tensor,
) -> candle_core::Result<bool> {
    let (a, b) = (
        a.flatten_all()?.to_vec1::<f32>()?,
        b.flatten_all()?.to_vec1::<f32>()?,
    );
    Ok(a.len() == b.len() && a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()))
}
