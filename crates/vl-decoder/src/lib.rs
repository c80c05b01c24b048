//! A vision-language decoder over image memory, on candle: pre-LN by
//! default, post-LN by configuration ([`NormPlacement`]).
//!
//! Text tokens run through [`DecoderBlock`]s that each attend causally to
//! the text and, through cross-attention, to image tokens: text gives the
//! queries, the image the keys and values. The image's keys and values are
//! projected once per image into an [`ImageContext`] and reused at every
//! decode step, shared by every beam of that image.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use vl_decoder::{DecoderConfig, ForwardMasks, StepOptions, VisionLanguageDecoder};
//!
//! # fn main() -> Result<(), vl_decoder::DecoderError> {
//! let dev = Device::Cpu;
//! let vars = VarMap::new();
//! let cfg = DecoderConfig::tiny(100, 48);
//! let decoder = VisionLanguageDecoder::load(VarBuilder::from_varmap(&vars, DType::F32, &dev), &cfg)?;
//! // Image tokens from any encoder (vl-vision's ViT, say): (1, 197, 48).
//! let image = Tensor::randn(0f32, 1., (1, 197, 48), &dev)?;
//!
//! // Full forward over a prompt...
//! let tokens = Tensor::new(&[[1u32, 5, 7]], &dev)?;
//! let logits = decoder.forward(&tokens, Some(&image), ForwardMasks::default())?;
//! assert_eq!(logits.dims(), &[1, 3, 100]);
//!
//! // ...or step by step: the image is projected once.
//! let ctx = decoder.image_context(&image, None)?;
//! let mut state = decoder.start(&ctx, 1)?;
//! for &t in &[1u32, 5, 7] {
//!     let step = decoder.step(&mut state, &Tensor::new(&[[t]], &dev)?, StepOptions::last())?;
//!     assert_eq!(step.values.dims(), &[1, 100]); // the last position's logits
//! }
//! # Ok(())
//! # }
//! ```

pub mod block;
pub mod config;
pub mod context;
pub mod encoder;
pub mod error;
pub mod generate;
pub mod head;
pub mod init;
pub mod model;
pub mod positions;

pub mod state;

pub use block::{BlockGroup, DecoderBlock};
pub use config::{Activation, DecoderConfig, Dropouts, NormPlacement};
pub use context::ImageContext;
pub use encoder::{EncoderLayer, TextEncoder, TextEncoderConfig, TextEncoderParts};
pub use error::{DecoderError, Result};
pub use generate::{
    generate, generate_from, step_decodings, Decoding, EarlyStopping, Generated, GenerationConfig,
    StopReason, Strategy, TokenEvent,
};
pub use head::OutputTransform;
pub use model::{DecoderParts, ForwardMasks, VisionLanguageDecoder};
pub use positions::{PositionEmbedding, Positions};
pub use state::{DecodeState, StepOptions, StepOutput, StepPositions, StepValues};
pub use vl_attn::{Dropout, DropoutRng, FeedForward, LayerNorm, Mode};
