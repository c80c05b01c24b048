//! Image encoders for vl's decoders, on candle.
//!
//! - [`Vit`]: a ViT (patch embedding, class token, learned positions,
//!   pre-LN blocks) built from vl-attn's non-causal self-attention, layer
//!   norm and feed-forward layers; loads vl's own weights or, through the
//!   root crate's checkpoint loaders, transformers' `ViTModel` weights.
//! - [`MockVit`]: a seeded, weightless stand-in with the shapes of a ViT,
//!   for tests and for models trained over fixed random image features.
//! - [`preprocess`]: decoding, resizing and normalising images into the
//!   `(batch, 3, size, size)` pixels an encoder expects ([`PixelSpec`]).
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use vl_vision::{MockVit, MockVitConfig};
//!
//! # fn main() -> Result<(), vl_vision::VisionError> {
//! let vit = MockVit::new(&MockVitConfig::base(48, 0), DType::F32, &Device::Cpu)?;
//! let pixels = Tensor::zeros((2, 3, 224, 224), DType::F32, &Device::Cpu)?;
//! let tokens = vit.forward(&pixels)?; // (2, 197, 48): a class token and 14 × 14 patches
//! assert_eq!(tokens.dims(), &[2, 197, 48]);
//! # Ok(())
//! # }
//! ```

pub mod davit;
pub mod encoder;
pub mod error;
pub mod mock_vit;
pub mod pipeline;
pub mod preprocess;
pub mod swin;
pub mod vit;

pub use davit::{Davit, DavitConfig, Florence2Projector, Florence2Vision};
pub use encoder::{VisionConfig, VisionEncoder};
pub use error::{Result, VisionError};
pub use mock_vit::{MockVit, MockVitConfig};
pub use pipeline::VisionPipeline;
pub use preprocess::{DocumentFit, PixelSpec, Resample, RgbView};
pub use swin::{Swin, SwinConfig};
pub use vit::{Vit, VitBlock, VitConfig};
