//! Cross-attention and self-attention for [candle](https://github.com/huggingface/candle).
//!
//! - [`CrossAttention`]: queries of one width attend to a memory of another
//!   (text over image tokens, audio over video), with grouped-query heads,
//!   optional biases, and a [`CrossKv`] cache so that the memory's keys and
//!   values are projected once and shared, without copies, by every beam or
//!   sample that reads it.
//! - [`SelfAttention`]: bidirectional self-attention with an optional key
//!   mask, for encoders (a ViT's blocks).
//! - [`CausalSelfAttention`] with a preallocated, growable [`KvCache`]
//!   (bottom-right aligned causal masks, left padding through key masks).
//! - All three share one core (the `heads` module: the projections
//!   `q_proj`, `k_proj`, `v_proj`, `o_proj` and their head layout), and each
//!   has one method, `attend`, that returns an [`AttnOutput`]: the output
//!   and, when [`Weights::Return`] is asked, the attention weights; `forward`
//!   is `attend` without the weights.
//! - [`CoAttention`]: two streams attend to each other in one call (A's
//!   queries over B, B's over A, each with its own key mask; ViLBERT/LXMERT,
//!   audio ↔ video), returning both updates and, when asked, both weight
//!   tensors; [`CoAttentionBlock`] is the pre-LN block built from it.
//! - [`mask`]: every mask, with one polarity — `1` = may attend.
//! - [`attention`]: the reference and the fused attention paths behind
//!   one entry point, [`attention::attention`]; on CPU the fused path is
//!   vl's own kernels — tiled (query blocks × key blocks, online softmax)
//!   for prefill and encoders, one row at a time for decode steps; a
//!   query row with nothing to attend to yields zeros, never NaN.
//! - [`kernels`]: vl's CPU kernels, the crate's only `unsafe` code — the
//!   matrix products for decode shapes (1–8 rows, f32/f16/bf16 weights,
//!   across the thread pool), for many bf16 rows, and for q8_0 and q4_K
//!   weights packed once (any number of rows), behind [`Proj`]; the
//!   attention, LayerNorm, addition and GELU loops. [`kernels::CpuFeatures`]
//!   detects the CPU once, and each operation has one entry point and a
//!   portable implementation that is its fallback and test oracle. The
//!   products split across the rayon pool: run a model's whole forward
//!   pass or decode step through [`kernels::on_pool`] to hand it over once
//!   (vl's decoder and ViT do), and a loop of decode steps under a
//!   [`kernels::KeepAwake`].
//! - [`Proj`]: the projections, dense or quantized (`q8_0`, `q4k`) through
//!   `quantize` on every attention and on [`FeedForward`].
//! - [`LayerNorm`] (trainable; vl's kernel for f32 and bf16 rows on
//!   AVX-512 CPUs in inference) and [`kernels::add::add`] (residual additions of
//!   bf16 activations, vectorised where candle's are not, and of f32 ones on
//!   the rayon pool): the element-wise work of a block besides GELU.
//! - [`WindowOrder`]: window attention's token order (Swin's shifted
//!   windows, DaViT's plain ones) — a projection's output in map order to
//!   the windows' heads and back, one gather each way.
//! - [`dropout`]: inverted [`Dropout`] with seeded, reproducible masks and
//!   the [`Mode`] switch (inference by default); every attention module
//!   applies its own to the attention probabilities in training.
//! - [`Resampler`]: learned queries through a stack of self-attention,
//!   cross-attention and feed-forward layers (Perceiver resampler,
//!   Q-Former), which compresses a memory to a fixed number of tokens.
//! - [`TanhGate`] (Flamingo's gated cross-attention) and [`QueryPool`]
//!   (learned queries that summarise a memory).
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use vl_attn::{mask, CrossAttention, CrossAttentionConfig, Weights};
//!
//! # fn main() -> Result<(), vl_attn::AttnError> {
//! let dev = Device::Cpu;
//! let vars = VarMap::new();
//! let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev);
//! // Text of width 64 attends to image tokens of width 96, 4 heads.
//! let attn = CrossAttention::load(vb, &CrossAttentionConfig::new(64, 96, 4))?;
//! let text = Tensor::randn(0f32, 1., (2, 5, 64), &dev)?;
//! let image = Tensor::randn(0f32, 1., (2, 197, 96), &dev)?;
//!
//! // Project the image once, reuse it at every step.
//! let kv = attn.project_memory(&image)?;
//! // The second sample has no image: its text attends to nothing.
//! let has_image = mask::image_tokens(&[197, 0], 197, &dev)?;
//! let out = attn.attend(&text, &kv, Some(&has_image), Weights::Return)?;
//! assert_eq!(out.output.dims(), &[2, 5, 64]);
//! assert_eq!(out.output.get(1)?.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
//! // Weights per head, (batch, heads, text_len, image_len).
//! assert_eq!(out.weights.map(|w| w.dims().to_vec()), Some(vec![2, 4, 5, 197]));
//! assert_eq!(attn.memory_projections(), 1);
//! # Ok(())
//! # }
//! ```

pub mod error;
pub mod kernels;
pub mod layers;

use layers::heads;
pub use layers::{
    attention, cache, co_attn, co_block, conv, cross, dropout, ffn, gate, mask, named, norm, pool,
    proj, quantize, resampler, self_attn, windows,
};

pub use attention::{quantize_kv, widen_kv, AttnOutput, Backend, GroupedOutput, Weights};
pub use cache::KvCache;
pub use co_attn::{CoAttention, CoAttentionConfig, CoAttentionOutput};
pub use co_block::{CoAttentionBlock, CoAttentionBlockConfig, CoAttentionBlockOutput};
pub use conv::{DepthwiseConv, PatchConv};
pub use cross::{CrossAttention, CrossAttentionConfig, CrossGroup, CrossKv};
pub use dropout::{Dropout, DropoutRng, Mode};
pub use error::{AttnError, Result};
pub use ffn::{Activation, FeedForward};
pub use gate::TanhGate;
pub use mask::Mask;
pub use norm::LayerNorm;
pub use pool::QueryPool;
pub use proj::Proj;
pub use quantize::{Fallback, Quantization, Quantizer, StoredBlocks};
pub use resampler::{Resampler, ResamplerConfig, ResamplerLayer};
pub use self_attn::{CacheGroup, CausalSelfAttention, SelfAttention, SelfAttentionConfig};
pub use windows::WindowOrder;
