//! Captioning images: one owner for images in and captions out. A
//! [`Captioner`] takes image files or decoded images, reads and
//! preprocesses each on its own (a bad input costs only itself), captions
//! them in batches (a batch that fails is retried image by image), and
//! returns one result per input, in order — so that the CLI, a server or
//! a Python binding only say where the images come from and where the
//! captions go.

use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};

use candle_core::Tensor;
use image::{DynamicImage, RgbImage};
use vl_decoder::{generate_from, GenerationConfig, TokenEvent};
use vl_vision::preprocess::load_image;

use crate::checkpoint::{LoadOptions, Source};
use crate::error::{arg_err, Error, Result};
use crate::heatmap;
use crate::model::VlModel;

/// One image's caption.
#[derive(Debug, Clone, PartialEq)]
pub struct Caption {
    /// The caption's text (special tokens dropped): with a prompt, the
    /// prompt and its continuation, as transformers decodes BLIP's output.
    pub text: String,
    /// The ids generated after the start token (and the prompt), the EOS
    /// included if one was generated.
    pub token_ids: Vec<u32>,
    /// With [`GenerationConfig::cross_attention_of`] set (see
    /// [`Captioner::with_heatmaps`]): per token, the cross-attention weights
    /// (heads averaged) over the image's patch tokens (the class token
    /// dropped) of the position that chose it, recorded while captioning.
    /// Empty otherwise.
    ///
    /// # Shapes
    /// `token_ids.len()` rows of `patches` weights.
    pub heatmaps: Vec<Vec<f32>>,
}

/// An image to caption: a file, or an image decoded already.
#[derive(Debug, Clone, Copy)]
pub enum ImageInput<'a> {
    /// An image file (any format the `image` crate reads), read and
    /// decoded by the captioner.
    Path(&'a Path),
    /// A decoded image.
    Image(&'a DynamicImage),
}

impl<'a> From<&'a Path> for ImageInput<'a> {
    fn from(p: &'a Path) -> Self {
        Self::Path(p)
    }
}

impl<'a> From<&'a PathBuf> for ImageInput<'a> {
    fn from(p: &'a PathBuf) -> Self {
        Self::Path(p)
    }
}

impl<'a> From<&'a DynamicImage> for ImageInput<'a> {
    fn from(img: &'a DynamicImage) -> Self {
        Self::Image(img)
    }
}

/// What to generate for each image.
#[derive(Debug, Clone)]
pub struct Request<'a> {
    /// Decoding settings (see [`Captioner::generation`] for the
    /// checkpoint's defaults).
    pub generation: GenerationConfig,
    /// Text to continue (BLIP checkpoints only; see
    /// [`VlModel::prompt_ids`]).
    pub prompt: Option<&'a str>,
}

/// One input's outcome, handed to [`Captioner::caption_each`]'s callback
/// in input order.
#[derive(Debug)]
pub struct Captioned<'a> {
    /// The input's position in the inputs given.
    pub index: usize,
    /// The decoded image, when it could be read.
    pub image: Option<&'a DynamicImage>,
    /// The caption, or why this input has none.
    pub caption: Result<Caption>,
}

/// The images of one word's heatmap and of the whole caption's grid.
#[derive(Debug, Clone)]
pub struct AttentionMaps {
    /// Per generated token: the token's text and its heatmap over the
    /// image as the model saw it.
    pub words: Vec<(String, RgbImage)>,
    /// Every word's map side by side, the caption underneath.
    pub grid: RgbImage,
}

/// The default number of images captioned together.
pub const DEFAULT_BATCH_SIZE: NonZeroUsize = match NonZeroUsize::new(8) {
    Some(n) => n,
    None => unreachable!(),
};

/// A loaded captioning model.
#[derive(Debug)]
pub struct Captioner {
    model: VlModel,
    batch_size: NonZeroUsize,
}

impl Captioner {
    /// Captions with a loaded model, [`DEFAULT_BATCH_SIZE`] images at a
    /// time.
    pub fn new(model: VlModel) -> Self {
        Self {
            model,
            batch_size: DEFAULT_BATCH_SIZE,
        }
    }

    /// Loads a model ([`crate::checkpoint::load`]) to caption with.
    pub fn load<'a>(source: impl Into<Source<'a>>, options: &LoadOptions) -> Result<Self> {
        Ok(Self::new(crate::checkpoint::load(source, options)?))
    }

    /// Captions `n` images at a time.
    #[must_use]
    pub fn with_batch_size(self, n: NonZeroUsize) -> Self {
        Self {
            batch_size: n,
            ..self
        }
    }

    /// The model.
    pub fn model(&self) -> &VlModel {
        &self.model
    }

    /// The model, to change its settings (e.g. a decoder's dropout in an
    /// experiment).
    pub fn model_mut(&mut self) -> &mut VlModel {
        &mut self.model
    }

    /// The checkpoint's generation defaults.
    pub fn generation(&self) -> &GenerationConfig {
        &self.model.generation
    }

    /// Greedy decoding with the model's special tokens, up to `max_new_tokens`.
    pub fn greedy_config(&self, max_new_tokens: usize) -> GenerationConfig {
        GenerationConfig::greedy(&self.model.config.decoder, max_new_tokens)
    }

    /// Captions `inputs`, one result per input in order (see
    /// [`Captioner::caption_each`]).
    ///
    /// # Errors
    /// As [`Captioner::caption_each`]: only what concerns every input.
    pub fn caption<'a>(
        &self,
        inputs: &[ImageInput<'a>],
        request: &Request,
    ) -> Result<Vec<Result<Caption>>> {
        let mut out = Vec::with_capacity(inputs.len());
        self.caption_each(inputs, request, |c| {
            out.push(c.caption);
            Ok(())
        })?;
        Ok(out)
    }

    /// Captions `inputs` in batches, handing each input's outcome to
    /// `on_result` in input order as soon as its batch is done. Each input
    /// is read, decoded and preprocessed on its own, so that a missing,
    /// corrupt or unfit image is its own error and every other one is still
    /// captioned; a batch that fails is retried image by image. `on_result`
    /// may stop the run by returning an error, which is returned.
    ///
    /// # Errors
    /// What concerns every input, before any is read: a prompt the model
    /// takes no prompt for ([`VlModel::prompt_ids`]), a model without a
    /// vision encoder; and `on_result`'s own errors.
    pub fn caption_each<'a, F>(
        &self,
        inputs: &[ImageInput<'a>],
        request: &Request,
        mut on_result: F,
    ) -> Result<()>
    where
        F: FnMut(Captioned<'_>) -> Result<()>,
    {
        let vision = self.model.vision()?;
        let prompt_ids = match request.prompt {
            Some(p) => self.model.prompt_ids(p)?,
            None => Vec::new(),
        };
        let gen = &request.generation;
        for (chunk_index, chunk) in inputs.chunks(self.batch_size.get()).enumerate() {
            let first = chunk_index * self.batch_size.get();
            // Decoded images (owned when read here), then the encoder's
            // input of each one that preprocessed.
            let mut read: Vec<Result<std::borrow::Cow<'a, DynamicImage>>> = chunk
                .iter()
                .map(|input| match input {
                    ImageInput::Path(p) => Ok(std::borrow::Cow::Owned(load_image(p)?)),
                    ImageInput::Image(img) => Ok(std::borrow::Cow::Borrowed(*img)),
                })
                .collect();
            let mut pixels = Vec::with_capacity(chunk.len());
            let mut batch = Vec::with_capacity(chunk.len());
            for (i, img) in read.iter_mut().enumerate() {
                let Ok(image) = img else { continue };
                match vision.pixels(image) {
                    Ok(p) => {
                        pixels.push(p);
                        batch.push(i);
                    }
                    Err(e) => *img = Err(e.into()),
                }
            }
            let mut captions: Vec<Option<Result<Caption>>> =
                (0..chunk.len()).map(|_| None).collect();
            if !pixels.is_empty() {
                match self.caption_tokens(&pixels, gen, &prompt_ids, &mut |_| {}) {
                    Ok(done) => {
                        for (i, c) in batch.iter().zip(done) {
                            captions[*i] = Some(Ok(c));
                        }
                    }
                    // One image alone: its own error.
                    Err(e) if pixels.len() == 1 => captions[batch[0]] = Some(Err(e)),
                    // A failed batch is retried image by image.
                    Err(_) => {
                        for (i, p) in batch.iter().zip(&pixels) {
                            let one = self
                                .caption_tokens(
                                    std::slice::from_ref(p),
                                    gen,
                                    &prompt_ids,
                                    &mut |_| {},
                                )
                                .map(|mut c| c.remove(0));
                            captions[*i] = Some(one);
                        }
                    }
                }
            }
            drop(pixels);
            for (i, (img, caption)) in read.into_iter().zip(captions).enumerate() {
                let (image, caption) = match img {
                    Err(e) => (None, Err(e)),
                    Ok(image) => {
                        let caption = caption.unwrap_or_else(|| {
                            arg_err("image", "was not captioned (no batch held it)")
                        });
                        (Some(image), caption)
                    }
                };
                on_result(Captioned {
                    index: first + i,
                    image: image.as_deref(),
                    caption,
                })?;
            }
        }
        Ok(())
    }

    /// One image as the encoder's input (see
    /// [`vl_vision::VisionPipeline::pixels`]), for callers that assemble
    /// their own batches.
    ///
    /// # Shapes
    /// Returns `(3, image_size, image_size)` f32.
    pub fn pixels(&self, image: &DynamicImage) -> Result<Tensor> {
        Ok(self.model.vision()?.pixels(image)?)
    }

    /// Captions one batch of preprocessed images (from
    /// [`Captioner::pixels`]) continuing `prompt` (BLIP checkpoints only),
    /// streaming each token to `on_token`. No per-image recovery: one
    /// error fails the batch.
    ///
    /// # Errors
    /// As [`VlModel::prompt_ids`], naming `prompt`; encoding and generation
    /// errors.
    pub fn caption_pixels(
        &self,
        pixels: &[Tensor],
        request: &Request,
        on_token: &mut dyn FnMut(TokenEvent),
    ) -> Result<Vec<Caption>> {
        let prompt_ids = match request.prompt {
            Some(p) => self.model.prompt_ids(p)?,
            None => Vec::new(),
        };
        self.caption_tokens(pixels, &request.generation, &prompt_ids, on_token)
    }

    fn caption_tokens(
        &self,
        pixels: &[Tensor],
        gen: &GenerationConfig,
        prompt_ids: &[u32],
        on_token: &mut dyn FnMut(TokenEvent),
    ) -> Result<Vec<Caption>> {
        let vision = self.model.vision()?;
        let memory = vision.encode(pixels)?;
        let decoder = &self.model.decoder;
        let ctx = decoder.image_context(&memory, None)?;
        let generated = generate_from(decoder, &ctx, gen, prompt_ids, on_token)?;
        // Image tokens before the patches: CLS (and DeiT's distillation
        // token); heatmaps are refused for resampled tokens.
        let prefix = vision.patches_from().unwrap_or(0);
        generated
            .into_iter()
            .map(|g| {
                // The prompt's words, then the caption (the start token is
                // special, skipped either way).
                let all: Vec<u32> = prompt_ids.iter().chain(&g.tokens).copied().collect();
                let text =
                    self.model
                        .tokenizer
                        .decode(&all, true)
                        .map_err(|e| Error::Tokenizer {
                            path: self.model.path.clone(),
                            reason: format!("cannot decode {all:?}: {e}"),
                        })?;
                Ok(Caption {
                    text,
                    token_ids: g.tokens,
                    heatmaps: g
                        .cross_attention
                        .into_iter()
                        .map(|w| w.get(prefix..).map(<[f32]>::to_vec).unwrap_or_default())
                        .collect(),
                })
            })
            .collect()
    }

    /// The block whose cross-attention the heatmaps show: the last one that
    /// has cross-attention.
    pub fn heatmap_layer(&self) -> Option<usize> {
        self.model
            .decoder
            .blocks()
            .iter()
            .rposition(|b| b.has_cross_attention())
    }

    /// `cfg` recording the heatmaps of [`Captioner::heatmap_layer`] into
    /// each [`Caption::heatmaps`], from the captioning pass itself (no
    /// second encode or replay).
    ///
    /// # Errors
    /// [`Error::Argument`] naming `heatmaps` when the model has no
    /// cross-attention, or a resampler whose queries are not the image's
    /// patches.
    pub fn with_heatmaps(&self, cfg: &GenerationConfig) -> Result<GenerationConfig> {
        if self.model.vision()?.patches_from().is_none() {
            return arg_err(
                "heatmaps",
                "the model's resampler turns the patches into queries: there is no patch grid to draw",
            );
        }
        let Some(layer) = self.heatmap_layer() else {
            return arg_err("heatmaps", "the model has no cross-attention");
        };
        Ok(GenerationConfig {
            cross_attention_of: Some(layer),
            ..cfg.clone()
        })
    }

    /// The heatmaps of `caption` (made with [`Captioner::with_heatmaps`])
    /// over `image` as the model saw it: resized with the model's own
    /// filter to its input size.
    ///
    /// # Errors
    /// An image the model's preprocessing refuses; a caption without
    /// heatmaps ([`Error::Argument`] naming `caption`).
    pub fn attention_maps(&self, image: &DynamicImage, caption: &Caption) -> Result<AttentionMaps> {
        let spec = self.model.vision()?.spec();
        if caption.heatmaps.is_empty() && !caption.token_ids.is_empty() {
            return arg_err(
                "caption",
                "has no heatmaps: caption with Captioner::with_heatmaps's settings",
            );
        }
        let shown = spec.resized(image)?;
        let grid = (caption.heatmaps.first().map_or(0, Vec::len) as f64).sqrt() as u32;
        let words: Vec<(String, RgbImage)> = caption
            .token_ids
            .iter()
            .zip(&caption.heatmaps)
            .map(|(id, w)| {
                let word = self.model.tokenizer.id_to_token(*id).unwrap_or_default();
                let tile = heatmap::overlay(&shown, w, grid, &word);
                (word, tile)
            })
            .collect();
        let tiles: Vec<RgbImage> = words.iter().map(|(_, t)| t.clone()).collect();
        Ok(AttentionMaps {
            grid: heatmap::grid(&tiles, &caption.text),
            words,
        })
    }
}
