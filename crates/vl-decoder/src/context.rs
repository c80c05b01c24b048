//! The image side of decoding: every block's image keys and values,
//! projected once per image batch ([`crate::VisionLanguageDecoder::image_context`])
//! and shared by every step and beam.

use vl_attn::mask::{MediaAttention, MediaSpan};
use vl_attn::{CrossKv, Mask};

/// Where each sample's images sit in its text, for an interleaved context.
#[derive(Debug, Clone)]
pub(crate) struct Media {
    /// Per sample, its images in text order.
    pub(crate) spans: Vec<Vec<MediaSpan>>,
    pub(crate) mode: MediaAttention,
    /// Memory tokens per sample (images and padding).
    pub(crate) memory_len: usize,
}

/// Every block's image keys and values, projected once per image batch and
/// reused at every decode step; `None` in blocks without cross-attention
/// and in text-only mode.
///
/// An interleaved context ([`crate::VisionLanguageDecoder::interleaved_context`])
/// holds one memory row per sample, each with several images, and the
/// spans that say which text positions see which image.
#[derive(Debug, Clone)]
pub struct ImageContext {
    pub(crate) layers: Vec<Option<CrossKv>>,
    pub(crate) mask: Option<Mask>,
    /// Memory rows: images, or samples of an interleaved context.
    pub(crate) images: usize,
    pub(crate) media: Option<Media>,
}

impl ImageContext {
    /// The number of memory rows: images, or samples of an interleaved
    /// context (each holding several images); 0 in text-only mode. Decode
    /// rows are laid out by it (see [`crate::DecodeState`]).
    pub fn images(&self) -> usize {
        self.images
    }

    /// An interleaved context's images, per sample in text order; `None`
    /// for a context of one image per row.
    pub fn media_spans(&self) -> Option<&[Vec<MediaSpan>]> {
        self.media.as_ref().map(|m| m.spans.as_slice())
    }

    /// An interleaved context's media attention; `None` for a context of
    /// one image per row.
    pub fn media_attention(&self) -> Option<MediaAttention> {
        self.media.as_ref().map(|m| m.mode)
    }

    /// Whether there is no image.
    pub fn is_text_only(&self) -> bool {
        self.layers.iter().all(Option::is_none)
    }

    /// Block `layer`'s keys and values.
    pub fn layer(&self, layer: usize) -> Option<&CrossKv> {
        self.layers.get(layer).and_then(Option::as_ref)
    }

    /// The per-image token mask `(images | 1, 1, image_len)`, if any
    /// (never for an interleaved context, whose mask depends on the
    /// position).
    pub fn mask(&self) -> Option<&Mask> {
        self.mask.as_ref()
    }

    /// Each image's context alone, in order (the keys and values are views
    /// of this context's, nothing projected again): for decodes that start
    /// and end at different times ([`crate::Decoding`]). A text-only context
    /// gives itself.
    ///
    /// # Errors
    /// [`crate::DecoderError::Argument`] naming `image` for an interleaved
    /// context, whose samples step alone.
    pub fn split(&self) -> crate::Result<Vec<ImageContext>> {
        if self.media.is_some() {
            return crate::error::arg_err(
                "image",
                "an interleaved context cannot be split into images",
            );
        }
        if self.images <= 1 {
            return Ok(vec![self.clone()]);
        }
        (0..self.images)
            .map(|i| {
                let layers = self
                    .layers
                    .iter()
                    .map(|kv| match kv {
                        Some(kv) => Ok(Some(CrossKv::new(
                            kv.k().narrow(0, i, 1)?,
                            kv.v().narrow(0, i, 1)?,
                        )?)),
                        None => Ok(None),
                    })
                    .collect::<crate::Result<_>>()?;
                let mask = match &self.mask {
                    Some(m) if m.dims().0 > 1 => Some(m.index_select(
                        &candle_core::Tensor::new(&[i as u32], m.tensor().device())?,
                    )?),
                    other => other.clone(),
                };
                Ok(ImageContext {
                    layers,
                    mask,
                    images: 1,
                    media: None,
                })
            })
            .collect()
    }
}
