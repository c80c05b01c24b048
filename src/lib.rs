//! vl: a vision-language decoder on candle.
//!
//! Re-exports the workspace crates so that the top-level examples and tests
//! build against one package.
pub use vl_attn;
pub use vl_decoder;
pub use vl_shapes;
