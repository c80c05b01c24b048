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
/// back to the kernel. Call it first thing, before any thread starts (the
/// `vl` command does, and the Python package when it is imported); then,
/// once a model is loaded, [`return_freed_memory`].
///
/// Inference allocates and frees its activations layer after layer, many
/// of them larger than the 32 MB up to which glibc can serve a block from
/// its heap: with glibc's defaults each of those was a fresh mapping whose
/// every page faulted in again, zeroed by the kernel. So: every block from
/// the heap (no mappings at all), one heap for every thread (another
/// thread's heap holds at most 64 MB, past which glibc maps even with
/// mappings off — and a thread keeps the heap it first allocated from,
/// hence "before any thread starts"), no trimming of the heap's top, and
/// 64 MB of top padding. Donut-base's Swin encode of a 1280×960 page
/// (stage 1's tensors are 39–157 MB) faulted ≈ 1 M pages (≈ 4 GB) per
/// encode with only the last two settings, set after the load, and took
/// 2.41–2.56 s in bf16 weights and 5.6 s in f32, against 1.95–2.02 s and
/// 3.86 s now (BENCHMARKS.md); peak RSS 1.93 → 1.78 GB. Earlier, with the
/// last two alone: a BLIP-base caption of 8 images at batch 8 in bf16 went
/// from 2.34–2.43 to 2.19 s at the same peak.
///
/// The cost: memory kept can be fragmented, so a batch run's peak can grow
/// (`vl bench` of vit-gpt2 in f32, batch 8 included: 1122 → 1241 MB), and
/// what a loader frees stays with the process until
/// [`return_freed_memory`]. Elsewhere than Linux with glibc, a no-op.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only sets the allocator's parameters (it takes the
    // allocator's lock).
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

/// Hands the heap's free memory back to the kernel now (glibc's
/// `malloc_trim`): after a model's load under [`keep_freed_memory`], what
/// the loader freed (an f32 checkpoint's tensors before their
/// quantization, say) would otherwise stay resident. What inference frees
/// later is kept as [`keep_freed_memory`] says; the first batch faults in
/// what it needs once. Elsewhere than Linux with glibc, a no-op.
pub fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only releases free memory (it takes the
    // allocator's locks).
    unsafe {
        libc::malloc_trim(0);
    }
}
