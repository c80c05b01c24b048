//! Images → image tokens, owned in one place: the pixel spec, the encoder
//! and the resampler between the encoder and a decoder.
//!
//! The hops from a decoded image to the tokens a decoder's
//! cross-attention reads:
//!
//! 1. [`VisionPipeline::pixels`]: [`PixelSpec::resized`] (the model's own
//!    filter), then rescaled and normalised into a `(3, height, width)` f32
//!    tensor on the encoder's device — each image on its own, so that one
//!    bad image costs only itself;
//! 2. [`VisionPipeline::encode`]: the images' tensors stacked once into
//!    `(images, 3, height, width)`, cast once to the encoder's dtype inside
//!    the encoder's patch embedding, encoded, then resampled when the model
//!    has a resampler.

use candle_core::{Device, Tensor};
use image::DynamicImage;
use vl_attn::{Quantizer, Resampler};

use crate::encoder::VisionEncoder;
use crate::error::{arg_err, Result};
use crate::preprocess::{preprocess, preprocess_rgb, PixelSpec, RgbView};

/// A model's vision side: what it expects of its pixels, its encoder, and
/// the resampler (if any) that turns the encoder's tokens into the
/// decoder's image tokens.
#[derive(Debug, Clone)]
pub struct VisionPipeline {
    spec: PixelSpec,
    encoder: VisionEncoder,
    resampler: Option<Resampler>,
    device: Device,
}

impl VisionPipeline {
    /// The pipeline of `encoder` (preprocessing as its config says,
    /// [`crate::VisionConfig::pixel_spec`]), through `resampler` when
    /// given.
    ///
    /// # Errors
    /// [`crate::VisionError::Argument`] naming `resampler` when its memory
    /// width is not the encoder's token width.
    pub fn new(
        encoder: VisionEncoder,
        resampler: Option<Resampler>,
        device: &Device,
    ) -> Result<Self> {
        let cfg = encoder.config();
        if let Some(r) = &resampler {
            let (want, got) = (cfg.hidden_size(), r.config().memory_dim);
            if want != got {
                return arg_err(
                    "resampler",
                    format!("reads tokens of width {got}, the encoder makes {want}"),
                );
            }
        }
        Ok(Self {
            spec: cfg.pixel_spec(),
            encoder,
            resampler,
            device: device.clone(),
        })
    }

    /// A copy whose encoder's dense f32 layers are packed for vl's f32
    /// product where that is this CPU's ([`VisionEncoder::pack_f32`]: a
    /// ViT's; the same values); the resampler as it is.
    ///
    /// # Errors
    /// Only candle's, reading the weights.
    pub fn pack_f32(&self) -> Result<Self> {
        Ok(Self {
            encoder: self.encoder.pack_f32()?,
            ..self.clone()
        })
    }

    /// What the encoder expects of its pixels.
    pub fn spec(&self) -> &PixelSpec {
        &self.spec
    }

    /// The encoder.
    pub fn encoder(&self) -> &VisionEncoder {
        &self.encoder
    }

    /// The resampler, if any.
    pub fn resampler(&self) -> Option<&Resampler> {
        self.resampler.as_ref()
    }

    /// The image tokens before the patches that [`VisionPipeline::encode`]
    /// returns (CLS, and DeiT's distillation token); `None` when a
    /// resampler makes them (its queries are not patches).
    pub fn patches_from(&self) -> Option<usize> {
        match self.resampler {
            Some(_) => None,
            None => Some(self.encoder.config().num_prefix_tokens()),
        }
    }

    /// One image as the encoder's input (hop 1 above).
    ///
    /// # Shapes
    /// Returns `(3, height, width)` f32 on the encoder's device.
    ///
    /// # Errors
    /// An image the spec cannot take (another size where the spec does not
    /// resize), named.
    pub fn pixels(&self, image: &DynamicImage) -> Result<Tensor> {
        preprocess(image, &self.spec, &self.device)
    }

    /// [`VisionPipeline::pixels`] of borrowed RGB pixels, read in place.
    ///
    /// # Shapes
    /// Returns `(3, height, width)` f32 on the encoder's device.
    ///
    /// # Errors
    /// As [`VisionPipeline::pixels`].
    pub fn pixels_rgb(&self, image: &RgbView<'_>) -> Result<Tensor> {
        preprocess_rgb(image, &self.spec, &self.device)
    }

    /// Image tokens of the images whose [`VisionPipeline::pixels`] these are
    /// (hop 2 above).
    ///
    /// # Shapes
    /// `pixels`: each `(3, height, width)` → `(pixels.len(), tokens, width)`.
    ///
    /// # Errors
    /// [`crate::VisionError::Argument`] naming `pixels` when there are none
    /// or one is not `(3, height, width)`; the encoder's errors.
    pub fn encode(&self, pixels: &[Tensor]) -> Result<Tensor> {
        let (h, w) = self.spec.size();
        if pixels.is_empty() {
            return arg_err("pixels", "no image to encode");
        }
        if let Some((i, p)) = pixels
            .iter()
            .enumerate()
            .find(|(_, p)| p.dims() != [3, h, w])
        {
            return arg_err(
                "pixels",
                format!(
                    "image {i}: expected shape [3, {h}, {w}], got {:?}",
                    p.dims()
                ),
            );
        }
        self.encode_batch(&Tensor::stack(pixels, 0)?)
    }

    /// Image tokens of a batch of pixels `(images, 3, height, width)`, e.g.
    /// [`crate::preprocess::preprocess_batch`]'s.
    ///
    /// # Errors
    /// The encoder's errors for pixels of another shape.
    pub fn encode_batch(&self, pixels: &Tensor) -> Result<Tensor> {
        let tokens = self.encoder.forward(pixels)?;
        match &self.resampler {
            None => Ok(tokens),
            // (images, tokens, encoder width) -> (images, queries, width)
            Some(r) => Ok(r.forward(&tokens, None)?),
        }
    }

    /// Image tokens of decoded images: [`VisionPipeline::pixels`] for each,
    /// then [`VisionPipeline::encode`].
    pub fn encode_images(&self, images: &[&DynamicImage]) -> Result<Tensor> {
        let pixels = images
            .iter()
            .map(|img| self.pixels(img))
            .collect::<Result<Vec<_>>>()?;
        self.encode(&pixels)
    }

    /// The same pipeline with the encoder's and the resampler's linear
    /// layers converted by `q` (their layers named `vision.…` and
    /// `resampler.…`).
    ///
    /// # Errors
    /// As [`VisionEncoder::quantize`] and [`Resampler::quantize`].
    pub fn quantize(&self, q: impl Into<Quantizer>) -> Result<Self> {
        let q: Quantizer = q.into();
        Ok(Self {
            encoder: self.encoder.quantize(&q)?,
            resampler: match &self.resampler {
                Some(r) => Some(r.quantize(q.within("resampler"))?),
                None => None,
            },
            ..self.clone()
        })
    }
}
