//! vl: a vision-language decoder on candle.
//!
//! Re-exports the workspace crates so that the top-level examples and tests
//! build against one package, and holds what they share: the captioning
//! pipeline ([`captioner`]) and the shapes captioner's data ([`shapes`]).
pub use vl_attn;
pub use vl_decoder;
pub use vl_shapes;

pub mod captioner;
pub mod heatmap;
#[cfg(feature = "hub")]
pub mod hub;
pub mod shapes;

/// The README's Rust examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
