//! A vision encoder chosen by configuration: the mock ViT, a trained ViT,
//! Florence-2's DaViT or Donut's and Nougat's Swin.

use candle_core::Tensor;
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};
use vl_attn::Quantizer;

use crate::davit::{DavitConfig, Florence2Vision};
use crate::error::Result;
use crate::mock_vit::{MockVit, MockVitConfig};
use crate::preprocess::PixelSpec;
use crate::swin::{Swin, SwinConfig};
use crate::vit::{Vit, VitConfig};

/// The vision encoder of a model directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum VisionConfig {
    /// The seeded, weightless [`MockVit`].
    MockVit(MockVitConfig),
    /// A trained [`Vit`], weights under `vision.`.
    Vit(VitConfig),
    /// Florence-2's DaViT and projector ([`Florence2Vision`]), weights
    /// under `vision.backbone.` and `vision.projector.`.
    Davit(DavitConfig),
    /// Donut's and Nougat's [`Swin`], weights under `vision.`.
    Swin(SwinConfig),
}

impl VisionConfig {
    /// Rejects impossible values.
    pub fn validate(&self) -> Result<()> {
        match self {
            Self::MockVit(c) => c.validate(),
            Self::Vit(c) => c.validate(),
            Self::Davit(c) => c.validate(),
            Self::Swin(c) => c.validate(),
        }
    }

    /// The width of the image tokens.
    pub fn hidden_size(&self) -> usize {
        match self {
            Self::MockVit(c) => c.hidden_size,
            Self::Vit(c) => c.output_width(),
            Self::Davit(c) => c.projection_dim,
            Self::Swin(c) => c.output_width(),
        }
    }

    /// Tokens before the patches in the encoder's output: the CLS token, and
    /// DeiT's distillation token after it; DaViT's pooled token; none for
    /// Swin.
    pub fn num_prefix_tokens(&self) -> usize {
        match self {
            Self::Swin(_) => 0,
            Self::MockVit(_) | Self::Davit(_) => 1,
            Self::Vit(c) => c.num_prefix_tokens(),
        }
    }

    /// What the encoder expects of its pixels (the mock ViT takes pixels
    /// normalised by mean 0.5 and std 0.5).
    pub fn pixel_spec(&self) -> PixelSpec {
        match self {
            Self::MockVit(c) => PixelSpec::new(c.image_size, [0.5; 3], [0.5; 3]),
            Self::Vit(c) => c.pixel_spec(),
            Self::Davit(c) => c.pixel_spec(),
            Self::Swin(c) => c.pixel_spec(),
        }
    }
}

/// A vision encoder.
// One per model, built once: the size of the larger variant costs nothing,
// and boxing it would change every match on `Vit`.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum VisionEncoder {
    /// The mock encoder.
    MockVit(MockVit),
    /// A trained ViT.
    Vit(Vit),
    /// Florence-2's DaViT and projector.
    Florence2(Florence2Vision),
    /// Donut's and Nougat's Swin.
    Swin(Swin),
}

impl VisionEncoder {
    /// Builds the encoder of `cfg`, its weights (if any) under `vb`.
    pub fn load(vb: VarBuilder, cfg: &VisionConfig) -> Result<Self> {
        Ok(match cfg {
            VisionConfig::MockVit(c) => Self::MockVit(MockVit::new(c, vb.dtype(), vb.device())?),
            VisionConfig::Vit(c) => Self::Vit(Vit::load(vb, c)?),
            VisionConfig::Davit(c) => Self::Florence2(Florence2Vision::load(
                vb.pp("backbone"),
                vb.pp("projector"),
                c,
            )?),
            VisionConfig::Swin(c) => Self::Swin(Swin::load(vb, c)?),
        })
    }

    /// A copy with the ViT's projections quantized to `format` (see
    /// [`Vit::quantize`]); the mock ViT has no weights and is returned as
    /// it is.
    ///
    /// # Errors
    /// As [`Vit::quantize`]: a width that does not fit the format's block
    /// size, naming the layer.
    pub fn quantize(&self, q: impl Into<Quantizer>) -> Result<Self> {
        let q: Quantizer = q.into();
        Ok(match self {
            Self::MockVit(m) => Self::MockVit(m.clone()),
            Self::Vit(v) => Self::Vit(v.quantize(q.within("vision"))?),
            Self::Florence2(f) => Self::Florence2(f.quantize(&q.within("vision"))?),
            Self::Swin(s) => Self::Swin(s.quantize(&q.within("vision"))?),
        })
    }

    /// A copy whose ViT holds its dense f32 layers packed for vl's f32
    /// product of many rows ([`vl_attn::Proj::pack_f32`]: the same values,
    /// bit for bit, each weight held once; CPU weights only) where that
    /// product is this CPU's
    /// ([`vl_attn::kernels::gemm_f32::packed::accelerated`]); otherwise,
    /// and for the other encoders, the encoder as it is. (DaViT's
    /// feed-forward runs a chunk of rows through both products on the
    /// weights as they lie, its hidden layer in the core's cache, which two
    /// packed products would lose.) On a Xeon without AMX, a ViT-B/16's
    /// products read from memory ran 10–30% faster packed (`bench_gemm
    /// --cold`, BENCHMARKS.md).
    ///
    /// # Errors
    /// Only candle's, reading the weights.
    pub fn pack_f32(&self) -> Result<Self> {
        match self {
            Self::Vit(_) if vl_attn::kernels::gemm_f32::packed::accelerated() => {
                self.quantize(Quantizer::packing_f32())
            }
            _ => Ok(self.clone()),
        }
    }

    /// Switches a ViT between training and inference (see
    /// [`crate::Vit::set_mode`]); the mock encoder has no dropout.
    pub fn set_mode(&mut self, mode: vl_attn::Mode) {
        match self {
            // DaViT's only training-time layer is stochastic depth, which
            // vl does not train.
            Self::MockVit(_) | Self::Florence2(_) | Self::Swin(_) => {}
            Self::Vit(v) => v.set_mode(mode),
        }
    }

    /// Adds the encoder's tensors under `prefix` (see
    /// [`vl_attn::named`]); the mock ViT has none (its weights come from
    /// its seed).
    ///
    /// # Errors
    /// candle's, dequantizing a converted layer.
    pub fn named_tensors(&self, prefix: &str, out: &mut vl_attn::named::Named) -> Result<()> {
        match self {
            Self::MockVit(_) => Ok(()),
            Self::Vit(v) => v.named_tensors(prefix, out),
            Self::Florence2(f) => f.named_tensors(prefix, out),
            Self::Swin(s) => s.named_tensors(prefix, out),
        }
    }

    /// Its configuration.
    pub fn config(&self) -> VisionConfig {
        match self {
            Self::MockVit(m) => VisionConfig::MockVit(m.config().clone()),
            Self::Vit(v) => VisionConfig::Vit(v.config().clone()),
            Self::Florence2(f) => VisionConfig::Davit(f.config().clone()),
            Self::Swin(s) => VisionConfig::Swin(s.config().clone()),
        }
    }

    /// Image tokens of normalised pixels.
    ///
    /// # Shapes
    /// `pixels: (batch, 3, height, width)` → `(batch, tokens, hidden)`.
    pub fn forward(&self, pixels: &Tensor) -> Result<Tensor> {
        match self {
            Self::MockVit(m) => m.forward(pixels),
            Self::Vit(v) => v.forward(pixels),
            Self::Florence2(f) => f.forward(pixels),
            Self::Swin(s) => s.forward(pixels),
        }
    }
}
