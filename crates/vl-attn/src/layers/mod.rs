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
