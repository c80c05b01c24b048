//! A pre-LN vision-language decoder over image memory, on candle.
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
//! use vl_decoder::{DecoderConfig, ForwardMasks, MockVit, MockVitConfig, VisionLanguageDecoder};
//!
//! # fn main() -> Result<(), vl_decoder::DecoderError> {
//! let dev = Device::Cpu;
//! let vars = VarMap::new();
//! let cfg = DecoderConfig::tiny(100, 48);
//! let decoder = VisionLanguageDecoder::load(VarBuilder::from_varmap(&vars, DType::F32, &dev), &cfg)?;
//! let vit = MockVit::new(&MockVitConfig::base(48, 0), DType::F32, &dev)?;
//! let image = vit.forward(&Tensor::zeros((1, 3, 224, 224), DType::F32, &dev)?)?; // (1, 197, 48)
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
//!     let last = decoder.step_last(&mut state, &Tensor::new(&[[t]], &dev)?)?; // (1, 100)
//!     assert_eq!(last.dims(), &[1, 100]);
//! }
//! # Ok(())
//! # }
//! ```

pub mod block;
pub mod config;
pub mod dir;
pub mod error;
pub mod generate;
pub mod hf;
pub mod init;
pub mod mock_vit;
pub mod model;

pub mod preprocess;
pub mod pretrained;
pub mod quantize;
pub mod vit;

pub use block::DecoderBlock;
pub use config::{Activation, DecoderConfig};
pub use error::{DecoderError, Result};
pub use generate::{
    generate, EarlyStopping, Generated, GenerationConfig, StopReason, Strategy, TokenEvent,
};
pub use mock_vit::{MockVit, MockVitConfig};
pub use model::{DecodeState, ForwardMasks, ImageContext, VisionLanguageDecoder};
pub use pretrained::{ModelFormat, VisionConfig, VisionEncoder, VlConfig, VlModel};
pub use quantize::Quantization;
pub use vit::{Vit, VitBlock, VitConfig};
pub use vl_attn::{FeedForward, LayerNorm};
