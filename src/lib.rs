//! vl: a vision-language decoder on candle, batteries included.
//!
//! The workspace crates each hold one job and are re-exported here:
//! [`vl_attn`] (attention, masks, caches, kernels), [`vl_vision`] (ViT, mock
//! ViT, preprocessing), [`vl_decoder`] (decoder, decode state, generation)
//! and [`vl_shapes`] (the shapes world). This crate adds what needs files,
//! images and tokenizers:
//!
//! - [`checkpoint`]: loading models by format (vl's own directories,
//!   transformers ViT/DeiT + GPT-2/TrOCR), safetensors and tokenizers;
//! - [`captioner`]: the captioning pipeline, images in, captions out;
//! - [`heatmap`]: cross-attention heatmaps over the image;
//! - [`settings`]: devices, dtypes and generation overrides, typed;
//! - [`shapes`]: the shapes captioner's data and recipe.
//!
//! The `vl` command (crate `vl-cli`) is the front end.
pub use vl_attn;
pub use vl_decoder;
pub use vl_shapes;
pub use vl_vision;

pub mod captioner;
pub mod checkpoint;
pub mod donut;
pub mod error;
pub mod heatmap;
#[cfg(feature = "hub")]
pub mod hub;
pub mod model;
pub mod nougat;
pub mod settings;
pub mod shapes;
pub mod tasks;

pub use checkpoint::{load, LoadOptions, ModelFormat, Source, VlConfig};
pub use error::{Error, Result};
pub use model::VlModel;

/// The README's Rust examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// Has glibc's allocator keep freed memory for reuse instead of handing it
/// back to the kernel: blocks up to 32 MB (its most) from the heap rather
/// than fresh mappings, and no trimming of the heap's top. The `vl` command
/// and the Python package call it once the model is loaded, for inference
/// (the loader's buffers are returned as glibc's defaults would; the peaks
/// below were the same either way): a batch's activations are allocated
/// and freed layer after layer, and with glibc's defaults each large one
/// was a new mapping whose every page faulted in again (a BLIP-base
/// caption of 8 images at batch 8 in bf16: 2.34-2.43 → 2.19 s, the same
/// peak RSS). The cost: memory kept can be fragmented, so a batch run's
/// peak can grow (`vl bench` of vit-gpt2 in f32, batch 8 included: 1122 →
/// 1241 MB; q8_0: 0.79 → 0.80 of the weights file). The 64 MB of top
/// padding is what makes the gain (without it, 2.33-2.38 s). Elsewhere
/// than Linux with glibc, a no-op.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only sets the allocator's parameters (it takes the
    // allocator's lock).
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}
