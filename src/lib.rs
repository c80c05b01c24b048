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

/// glibc's allocator settings for inference (the kernels' crate owns
/// them, so that its own benchmarks run as `vl` does).
pub use vl_attn::kernels::{keep_freed_memory, return_freed_memory};
