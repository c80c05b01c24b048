//! Incremental decoding: the [`DecodeState`] a decoder's
//! [`crate::VisionLanguageDecoder::step`] advances, and what a step is asked
//! for ([`StepOptions`]) and returns ([`StepOutput`]).

use candle_core::{Device, Tensor};
use vl_attn::{KvCache, Mask};

use crate::context::ImageContext;
use crate::error::{arg_err, Result};

/// Which positions a step returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StepPositions {
    /// Every position fed (a prefill of several tokens, teacher forcing).
    All,
    /// The last position fed: what generation needs.
    #[default]
    Last,
}

/// What a step returns for those positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StepValues {
    /// LM-head logits, f32 whatever the decoder's dtype
    /// ([`crate::VisionLanguageDecoder::logits`]).
    #[default]
    Logits,
    /// The last block's hidden states, before the final norm.
    Hidden,
}

/// What [`crate::VisionLanguageDecoder::step`] returns: by default the
/// logits of the last position, and no attention weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepOptions {
    /// Every position or the last.
    pub positions: StepPositions,
    /// Logits or hidden states.
    pub values: StepValues,
    /// The block whose cross-attention weights to return, per head.
    pub weights_of: Option<usize>,
}

impl StepOptions {
    /// Logits of the last position (the default).
    pub fn last() -> Self {
        Self::default()
    }

    /// Logits of every position fed.
    pub fn all() -> Self {
        Self {
            positions: StepPositions::All,
            ..Self::default()
        }
    }

    /// Hidden states instead of logits.
    pub fn hidden(self) -> Self {
        Self {
            values: StepValues::Hidden,
            ..self
        }
    }

    /// Also block `layer`'s cross-attention weights.
    pub fn with_weights_of(self, layer: usize) -> Self {
        Self {
            weights_of: Some(layer),
            ..self
        }
    }
}

/// The result of a step (shapes in [`crate::VisionLanguageDecoder::step`]).
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// Logits or hidden states.
    pub values: Tensor,
    /// The asked block's cross-attention weights per head, if asked and
    /// that block has an image to read.
    pub weights: Option<Tensor>,
}

/// The most rows a [`DecodeState`] may hold: rows are indexed by `u32`
/// (beam reordering, the per-row image mask).
pub(crate) const MAX_ROWS: usize = u32::MAX as usize;

/// `per_image * images` (one image in text-only mode), or `None` when that
/// overflows or passes [`MAX_ROWS`].
pub(crate) fn decode_rows(images: usize, per_image: usize) -> Option<usize> {
    per_image
        .checked_mul(images.max(1))
        .filter(|&rows| rows <= MAX_ROWS)
}

/// The state of incremental decoding: per-block text caches and the
/// position offset, over an [`ImageContext`] shared by every row.
///
/// Rows are laid out image by image: with `images` images and `per_image`
/// rows each (beams or samples), row `b` reads image `b / per_image` — for
/// an interleaved context, sample `b / per_image` and its spans.
#[derive(Debug)]
pub struct DecodeState {
    pub(crate) image: ImageContext,
    /// The image mask expanded to one row per decode row, built once.
    pub(crate) image_mask: Option<Mask>,
    /// Interleaved context with several rows per sample: each row's
    /// sample, `(rows,)` u32, to expand the per-step media mask.
    pub(crate) row_samples: Option<Tensor>,
    pub(crate) caches: Vec<KvCache>,
    pub(crate) rows: usize,
    pub(crate) per_image: usize,
    pub(crate) offset: usize,
    /// Where the caches live (also in text-only mode, with no image).
    pub(crate) device: Device,
}

impl DecodeState {
    /// Tokens decoded so far (the next token's position).
    pub fn position(&self) -> usize {
        self.offset
    }

    /// Rows being decoded.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Rows per image.
    pub fn per_image(&self) -> usize {
        self.per_image
    }

    /// The shared image context.
    pub fn image(&self) -> &ImageContext {
        &self.image
    }

    /// Keeps rows `indices` in that order (beam search): row `j` becomes a
    /// copy of row `indices[j]`'s text cache. Rows must stay with their
    /// image: `indices[j] / per_image == j / per_image`. The image context is
    /// untouched — no image key or value is copied.
    pub fn reorder(&mut self, indices: &[u32]) -> Result<()> {
        if indices.len() != self.rows {
            return arg_err(
                "indices",
                format!("expected {} row indices, got {}", self.rows, indices.len()),
            );
        }
        if let Some((j, &i)) = indices
            .iter()
            .enumerate()
            .find(|(j, &i)| i as usize / self.per_image != j / self.per_image)
        {
            return arg_err(
                "indices",
                format!(
                    "row {j} would take row {i}, which reads another image ({} rows per image)",
                    self.per_image
                ),
            );
        }
        let idx = Tensor::new(indices, &self.device)?;
        for cache in &mut self.caches {
            cache.index_select(&idx)?;
        }
        Ok(())
    }
}
