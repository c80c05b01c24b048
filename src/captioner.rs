//! Captioning images: one owner for images in and captions out. A
//! [`Captioner`] takes image files or decoded images, reads and
//! preprocesses each on its own (a bad input costs only itself), captions
//! them in batches (a batch that fails is retried image by image), and
//! returns one result per input, in order — so that the CLI, a server or
//! a Python binding only say where the images come from and where the
//! captions go.

use std::collections::HashSet;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};

use candle_core::Tensor;
use image::{DynamicImage, RgbImage};
use vl_decoder::{
    generate_from, step_decodings, Decoding, Generated, GenerationConfig, TokenEvent,
};
use vl_vision::preprocess::load_image;

use crate::checkpoint::{LoadOptions, Source};
use crate::donut::{donut_text, token2json, DonutValue, Reader};
use crate::error::{arg_err, Error, Result};
use crate::heatmap;
use crate::model::VlModel;
use crate::tasks::{Task, TaskOutput};

/// One image's caption.
#[derive(Debug, Clone, PartialEq)]
pub struct Caption {
    /// The caption's text (special tokens dropped): with a prompt, the
    /// prompt and its continuation, as transformers decodes BLIP's output;
    /// Donut's as `DonutProcessor` decodes it (tags kept), Nougat's
    /// Markdown after `post_process_generation` ([`crate::nougat`]).
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
    /// A task's parsed output (Florence-2 with [`Request::task`]): text,
    /// or boxes, quadrilaterals or polygons in the input image's pixels.
    pub task: Option<TaskOutput>,
    /// A Donut checkpoint's output read as JSON ([`crate::donut::token2json`]
    /// of [`Caption::text`], as `DonutProcessor.token2json`).
    pub document: Option<DonutValue>,
}

impl Caption {
    /// The caption as `vl caption --json` writes it (without the `image`
    /// key): `caption`, `token_ids`, with `task` (the request's) its
    /// parsed output under the task's token, in the processor's own keys
    /// (e.g. `{"<OD>": {"bboxes": [...], "labels": [...]}}`), and a Donut
    /// checkpoint's JSON under `document`.
    pub fn to_json(&self, task: Option<Task>) -> serde_json::Value {
        let mut line = serde_json::json!({"caption": self.text, "token_ids": self.token_ids});
        if let (Some(task), Some(parsed)) = (task, &self.task) {
            // A `TaskOutput` is plain data: serialising it cannot fail.
            line[task.token()] = serde_json::to_value(parsed).unwrap_or_default();
        }
        if let Some(document) = &self.document {
            line["document"] = serde_json::to_value(document).unwrap_or_default();
        }
        line
    }
}

/// An image to caption: a file, or an image decoded already.
#[derive(Debug, Clone, Copy)]
pub enum ImageInput<'a> {
    /// An image file (any format the `image` crate reads), read and
    /// decoded by the captioner.
    Path(&'a Path),
    /// A decoded image.
    Image(&'a DynamicImage),
    /// RGB pixels in memory the caller keeps (e.g. a NumPy array's): read
    /// in place, never copied. `pixels` holds `height` rows of `width`
    /// RGB triples; another length is that input's error.
    Rgb8 {
        /// Its width in pixels.
        width: u32,
        /// Its height in pixels.
        height: u32,
        /// `width * height * 3` bytes, row by row.
        pixels: &'a [u8],
    },
}

/// An input read for captioning: a decoded image, or borrowed pixels.
enum Read<'a> {
    Image(std::borrow::Cow<'a, DynamicImage>),
    Rgb8(vl_vision::RgbView<'a>),
}

impl<'a> Read<'a> {
    fn new(input: &ImageInput<'a>) -> Result<Self> {
        Ok(match *input {
            ImageInput::Path(p) => Self::Image(std::borrow::Cow::Owned(load_image(p)?)),
            ImageInput::Image(img) => Self::Image(std::borrow::Cow::Borrowed(img)),
            ImageInput::Rgb8 {
                width,
                height,
                pixels,
            } => {
                let expected = width as usize * height as usize * 3;
                if width == 0 || height == 0 || pixels.len() != expected {
                    return arg_err(
                        "image",
                        format!(
                            "{width}x{height} RGB pixels need {expected} bytes (width * height * 3), got {}",
                            pixels.len()
                        ),
                    );
                }
                match vl_vision::RgbView::from_raw(width, height, pixels) {
                    Some(view) => Self::Rgb8(view),
                    None => return arg_err("image", "pixels do not fit their size"),
                }
            }
        })
    }

    fn size(&self) -> (u32, u32) {
        match self {
            Self::Image(img) => (img.width(), img.height()),
            Self::Rgb8(view) => view.dimensions(),
        }
    }

    fn image(&self) -> Option<&DynamicImage> {
        match self {
            Self::Image(img) => Some(img),
            Self::Rgb8(_) => None,
        }
    }
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
    /// BLIP: text to continue (see [`VlModel::prompt_ids`]). Florence-2:
    /// the task's text input (a phrase, a region as location tokens), or
    /// without a task a free prompt for its encoder.
    pub prompt: Option<&'a str>,
    /// Florence-2's task (default [`Task::Caption`]); other models take
    /// none.
    pub task: Option<Task>,
}

impl<'a> Request<'a> {
    /// `generation` with no prompt and no task.
    pub fn new(generation: GenerationConfig) -> Self {
        Self {
            generation,
            prompt: None,
            task: None,
        }
    }
}

/// Where a request's prompt goes.
#[derive(Debug)]
enum Prompted {
    /// After the decoder's start token (BLIP), or nowhere.
    Decoder(Vec<u32>),
    /// In place of the decoder's start token (Donut's task prompts): the
    /// first id starts, the rest follow.
    Start(Vec<u32>),
    /// Into the text encoder after the image tokens (Florence-2), with the
    /// task whose output is parsed.
    Encoder { ids: Vec<u32>, task: Option<Task> },
}

impl Prompted {
    /// The generation settings and the ids after the start token: for a
    /// prompt that replaces the start token, its first id as the start.
    fn generation<'a>(
        &self,
        gen: &GenerationConfig,
        ids: &'a [u32],
    ) -> (GenerationConfig, &'a [u32]) {
        match (self, ids) {
            (Self::Start(_), [start, rest @ ..]) => (
                GenerationConfig {
                    start_token_id: *start,
                    ..gen.clone()
                },
                rest,
            ),
            _ => (gen.clone(), ids),
        }
    }
}

/// One image's caption in progress: started by [`Captioner::start`],
/// advanced by [`Captioner::step`] with any others, turned into its
/// [`Caption`] by [`Captioner::finish`] once [`Captioning::is_done`].
#[derive(Debug)]
pub struct Captioning {
    decoding: Decoding,
    prompted: Prompted,
    size: (u32, u32),
    /// The vision encoder's tokens per image.
    image_len: usize,
}

impl Captioning {
    /// Whether the caption has ended.
    pub fn is_done(&self) -> bool {
        self.decoding.generated().is_some()
    }

    /// Decoder rows it takes in a step: 1, or its beams.
    pub fn rows(&self) -> usize {
        self.decoding.rows()
    }

    /// Tokens fed so far.
    pub fn position(&self) -> usize {
        self.decoding.position()
    }
}

/// One input's outcome, handed to [`Captioner::caption_each`]'s callback
/// in input order.
#[derive(Debug)]
pub struct Captioned<'a> {
    /// The input's position in the inputs given.
    pub index: usize,
    /// The decoded image, when it could be read (`None` as well for
    /// [`ImageInput::Rgb8`]: the caller has those pixels).
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
        self.caption_batched(inputs, request, self.batch_size)
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
        on_result: F,
    ) -> Result<()>
    where
        F: FnMut(Captioned<'_>) -> Result<()>,
    {
        self.caption_each_in(inputs, request, self.batch_size, on_result)
    }

    /// [`Captioner::caption`], `batch_size` images at a time instead of
    /// the captioner's own batch size (e.g. one per call of a binding).
    ///
    /// # Errors
    /// As [`Captioner::caption_each`].
    pub fn caption_batched<'a>(
        &self,
        inputs: &[ImageInput<'a>],
        request: &Request,
        batch_size: NonZeroUsize,
    ) -> Result<Vec<Result<Caption>>> {
        let mut out = Vec::with_capacity(inputs.len());
        self.caption_each_in(inputs, request, batch_size, |c| {
            out.push(c.caption);
            Ok(())
        })?;
        Ok(out)
    }

    fn caption_each_in<'a, F>(
        &self,
        inputs: &[ImageInput<'a>],
        request: &Request,
        batch_size: NonZeroUsize,
        mut on_result: F,
    ) -> Result<()>
    where
        F: FnMut(Captioned<'_>) -> Result<()>,
    {
        let vision = self.model.vision()?;
        let prompted = self.prompted(request)?;
        let gen = &request.generation;
        for (chunk_index, chunk) in inputs.chunks(batch_size.get()).enumerate() {
            let first = chunk_index * batch_size.get();
            // Decoded images (owned when read here) or borrowed pixels,
            // then the encoder's input of each one that preprocessed.
            let mut read: Vec<Result<Read<'a>>> = chunk.iter().map(Read::new).collect();
            let mut pixels = Vec::with_capacity(chunk.len());
            let mut sizes = Vec::with_capacity(chunk.len());
            let mut batch = Vec::with_capacity(chunk.len());
            for (i, img) in read.iter_mut().enumerate() {
                let Ok(image) = img else { continue };
                let preprocessed = match image {
                    Read::Image(image) => vision.pixels(image),
                    Read::Rgb8(view) => vision.pixels_rgb(view),
                };
                match preprocessed {
                    Ok(p) => {
                        pixels.push(p);
                        sizes.push(image.size());
                        batch.push(i);
                    }
                    Err(e) => *img = Err(e.into()),
                }
            }
            let mut captions: Vec<Option<Result<Caption>>> =
                (0..chunk.len()).map(|_| None).collect();
            if !pixels.is_empty() {
                match self.caption_tokens(&pixels, &sizes, gen, &prompted, &mut |_| {}) {
                    Ok(done) => {
                        for (i, c) in batch.iter().zip(done) {
                            captions[*i] = Some(Ok(c));
                        }
                    }
                    // One image alone: its own error.
                    Err(e) if pixels.len() == 1 => captions[batch[0]] = Some(Err(e)),
                    // A failed batch is retried image by image.
                    Err(_) => {
                        for ((i, p), size) in batch.iter().zip(&pixels).zip(&sizes) {
                            let one = self
                                .caption_tokens(
                                    std::slice::from_ref(p),
                                    std::slice::from_ref(size),
                                    gen,
                                    &prompted,
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
                    image: image.as_ref().and_then(Read::image),
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
    /// [`Captioner::pixels`]) as `request` says, streaming each token to
    /// `on_token`. No per-image recovery: one error fails the batch. A
    /// task's locations are in the pixels' frame (the model's input size),
    /// the original image's size being unknown here.
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
        let (h, w) = self.model.vision()?.spec().size();
        let sizes = vec![(w as u32, h as u32); pixels.len()];
        self.caption_pixels_sized(pixels, &sizes, request, on_token)
    }

    /// [`Captioner::caption_pixels`], a task's locations in the frame of
    /// each original image: `sizes` holds each image's (width, height).
    ///
    /// # Errors
    /// As [`Captioner::caption_pixels`]; [`Error::Argument`] naming
    /// `sizes` when it does not have one entry per image.
    pub fn caption_pixels_sized(
        &self,
        pixels: &[Tensor],
        sizes: &[(u32, u32)],
        request: &Request,
        on_token: &mut dyn FnMut(TokenEvent),
    ) -> Result<Vec<Caption>> {
        if sizes.len() != pixels.len() {
            return arg_err(
                "sizes",
                format!("{} sizes for {} images", sizes.len(), pixels.len()),
            );
        }
        let prompted = self.prompted(request)?;
        self.caption_tokens(pixels, sizes, &request.generation, &prompted, on_token)
    }

    /// Where `request`'s prompt goes, checked against the model before any
    /// image is read.
    fn prompted(&self, request: &Request) -> Result<Prompted> {
        let model = &self.model;
        if model.text_encoder.is_none() {
            if let Some(task) = request.task {
                return arg_err(
                    "task",
                    format!(
                        "{task}: the model in {} ({:?}) takes no task; only Florence-2 checkpoints do",
                        model.path.display(),
                        model.format
                    ),
                );
            }
            return Ok(match request.prompt {
                Some(p) if model.prompt_replaces_start() => Prompted::Start(model.prompt_ids(p)?),
                Some(p) => Prompted::Decoder(model.prompt_ids(p)?),
                None => Prompted::Decoder(Vec::new()),
            });
        }
        let (prompt, task) = match (request.task, request.prompt) {
            (Some(t), input) => (t.prompt(input)?, Some(t)),
            (None, Some(free)) => (free.to_string(), None),
            (None, None) => (Task::Caption.prompt(None)?, Some(Task::Caption)),
        };
        Ok(Prompted::Encoder {
            ids: model.encoder_prompt_ids(&prompt)?,
            task,
        })
    }

    fn caption_tokens(
        &self,
        pixels: &[Tensor],
        sizes: &[(u32, u32)],
        gen: &GenerationConfig,
        prompted: &Prompted,
        on_token: &mut dyn FnMut(TokenEvent),
    ) -> Result<Vec<Caption>> {
        let image_tokens = self.model.vision()?.encode(pixels)?;
        let image_len = image_tokens.dim(1)?;
        let (memory, prompt_ids) = match prompted {
            Prompted::Decoder(ids) | Prompted::Start(ids) => (image_tokens, ids.as_slice()),
            Prompted::Encoder { ids, .. } => (
                self.model.encoder_memory(&image_tokens, ids)?,
                &[] as &[u32],
            ),
        };
        let (gen, prompt_ids) = prompted.generation(gen, prompt_ids);
        let ctx = self.model.decoder.image_context(&memory, None)?;
        let generated = generate_from(&self.model.decoder, &ctx, &gen, prompt_ids, on_token)?;
        generated
            .into_iter()
            .zip(sizes)
            .map(|(g, &size)| self.caption_of(g, prompted, size, image_len))
            .collect()
    }

    /// A generation's caption: its text as the model's processor decodes
    /// it, a task's parsed output, its heatmaps over the patches.
    fn caption_of(
        &self,
        g: Generated,
        prompted: &Prompted,
        size: (u32, u32),
        image_len: usize,
    ) -> Result<Caption> {
        // Image tokens before the patches: CLS (and DeiT's distillation
        // token), DaViT's pooled token; heatmaps are refused for resampled
        // tokens. A text encoder's memory has the prompt after the patches.
        let from = self.model.vision()?.patches_from().unwrap_or(0);
        let patches = from..image_len.max(from);
        let decode = |ids: &[u32], skip_special: bool| {
            self.model
                .tokenizer
                .decode(ids, skip_special)
                .map_err(|e| Error::Tokenizer {
                    path: self.model.path.clone(),
                    reason: format!("cannot decode {ids:?}: {e}"),
                })
        };
        let mut document = None;
        let (text, task) = match prompted {
            // As DonutProcessor: the whole sequence decoded with its
            // special tokens (the task's tags among them), the end and
            // padding tokens and the first tag removed; then read as JSON.
            Prompted::Decoder(ids) | Prompted::Start(ids)
                if self.model.config.reader == Some(Reader::Donut) =>
            {
                let start = match prompted {
                    Prompted::Decoder(_) => Some(self.model.generation.start_token_id),
                    _ => None,
                };
                let all: Vec<u32> = start.iter().chain(ids).chain(&g.tokens).copied().collect();
                let token = |id: Option<u32>| {
                    id.and_then(|id| self.model.tokenizer.id_to_token(id))
                        .unwrap_or_default()
                };
                let gen = &self.model.generation;
                let text = donut_text(
                    &decode(&all, false)?,
                    &token(gen.eos_token_ids.first().copied()),
                    &token(Some(gen.pad_token_id)),
                );
                let added: HashSet<String> = self
                    .model
                    .tokenizer
                    .get_added_tokens_decoder()
                    .into_values()
                    .map(|t| t.content)
                    .collect();
                document = Some(token2json(&text, &added));
                (text, None)
            }
            // As NougatProcessor: decoded without the special tokens, then
            // post_process_generation's Markdown fixes.
            Prompted::Decoder(ids) if self.model.config.reader == Some(Reader::Nougat) => {
                let all: Vec<u32> = ids.iter().chain(&g.tokens).copied().collect();
                (
                    crate::nougat::post_process(&decode(&all, true)?, true),
                    None,
                )
            }
            // The prompt's words, then the caption (the start token is
            // special, skipped either way).
            Prompted::Decoder(ids) | Prompted::Start(ids) => {
                let all: Vec<u32> = ids.iter().chain(&g.tokens).copied().collect();
                (decode(&all, true)?, None)
            }
            // As the processor: decoded with the special tokens (locations
            // among them), then parsed for the task.
            Prompted::Encoder { task, .. } => {
                let raw = decode(&g.tokens, false)?;
                let task_cfg = self.model.config.tasks.clone().unwrap_or_default();
                let parsed = task.map(|t| crate::tasks::parse(&raw, t, size, &task_cfg));
                let text = match &parsed {
                    Some(TaskOutput::Text(t)) => t.clone(),
                    _ => raw
                        .replace("<s>", "")
                        .replace("</s>", "")
                        .trim()
                        .to_string(),
                };
                (text, parsed)
            }
        };
        Ok(Caption {
            text,
            token_ids: g.tokens,
            heatmaps: g
                .cross_attention
                .into_iter()
                .map(|w| {
                    w.get(patches.clone())
                        .map(<[f32]>::to_vec)
                        .unwrap_or_default()
                })
                .collect(),
            task,
            document,
        })
    }

    /// Starts captioning each image of `pixels` (from
    /// [`Captioner::pixels`]) with its own request, for a caller that
    /// advances captions step by step and lets new ones join between steps
    /// ([`Captioner::step`]): the images are encoded together and each
    /// one's keys and values projected once — once for requests given the
    /// same pixel tensor (clones of one, e.g. a request's choices). `sizes` holds each original
    /// image's (width, height) for a task's locations.
    ///
    /// A request that cannot start (a prompt that does not fit, settings
    /// the model refuses) is its own error; the others start.
    ///
    /// # Errors
    /// [`Error::Argument`] naming `sizes` or `requests` when they do not
    /// have one entry per image; encoding errors, which fail every image.
    pub fn start(
        &self,
        pixels: &[Tensor],
        sizes: &[(u32, u32)],
        requests: &[Request],
    ) -> Result<Vec<Result<Captioning>>> {
        for (arg, n) in [("sizes", sizes.len()), ("requests", requests.len())] {
            if n != pixels.len() {
                return arg_err(arg, format!("{n} entries for {} images", pixels.len()));
            }
        }
        if pixels.is_empty() {
            return Ok(Vec::new());
        }
        let prompted: Vec<Result<Prompted>> = requests.iter().map(|r| self.prompted(r)).collect();
        // Requests over the same pixels (one tensor: the choices of one
        // request) share one encoding: `slot[i]` is request i's image.
        let mut unique: Vec<Tensor> = Vec::with_capacity(pixels.len());
        let slot: Vec<usize> = pixels
            .iter()
            .map(|p| {
                unique
                    .iter()
                    .position(|u| u.id() == p.id())
                    .unwrap_or_else(|| {
                        unique.push(p.clone());
                        unique.len() - 1
                    })
            })
            .collect();
        let image_tokens = self.model.vision()?.encode(&unique)?;
        let image_len = image_tokens.dim(1)?;
        let decoder = &self.model.decoder;
        // Prompts for the decoder share one projection of every image;
        // a text encoder reads each image with its own prompt.
        let shared = if prompted
            .iter()
            .any(|p| matches!(p, Ok(Prompted::Decoder(_) | Prompted::Start(_))))
        {
            decoder.image_context(&image_tokens, None)?.split()?
        } else {
            Vec::new()
        };
        let start = |i: usize, prompted: Prompted| -> Result<Captioning> {
            let gen = &requests[i].generation;
            let decoding = match &prompted {
                Prompted::Decoder(ids) | Prompted::Start(ids) => {
                    let (gen, ids) = prompted.generation(gen, ids);
                    Decoding::start(decoder, &shared[slot[i]], &gen, ids)?
                }
                Prompted::Encoder { ids, .. } => {
                    let memory = self
                        .model
                        .encoder_memory(&image_tokens.narrow(0, slot[i], 1)?, ids)?;
                    let ctx = decoder.image_context(&memory, None)?;
                    Decoding::start(decoder, &ctx, gen, &[])?
                }
            };
            Ok(Captioning {
                decoding,
                prompted,
                size: sizes[i],
                image_len,
            })
        };
        Ok(prompted
            .into_iter()
            .enumerate()
            .map(|(i, p)| start(i, p?))
            .collect())
    }

    /// Advances every caption of `captions` that has not ended by one token
    /// in one pass of the decoder over all their rows (see
    /// [`vl_decoder::step_decodings`]), streaming each token with
    /// [`TokenEvent::image`] the caption's index in `captions`. A caption's
    /// tokens are those [`Captioner::caption_pixels_sized`] gives its image
    /// alone with its request, up to the products' rounding for the row
    /// count (see [`vl_decoder::VisionLanguageDecoder::step_many`]).
    ///
    /// A loop of steps is faster with a [`vl_attn::kernels::KeepAwake`]
    /// held over it, as `vl serve` holds one while requests run.
    ///
    /// # Errors
    /// As [`vl_decoder::step_decodings`]: captions recording heatmaps of
    /// different blocks cannot step together.
    pub fn step(
        &self,
        captions: &mut [&mut Captioning],
        on_token: &mut dyn FnMut(TokenEvent),
    ) -> Result<()> {
        let mut decodings: Vec<&mut Decoding> =
            captions.iter_mut().map(|c| &mut c.decoding).collect();
        Ok(step_decodings(
            &self.model.decoder,
            &mut decodings,
            on_token,
        )?)
    }

    /// The caption of one that ended, as [`Captioner::caption_pixels_sized`]
    /// returns it.
    ///
    /// # Errors
    /// [`Error::Argument`] naming `captioning` when it has not ended;
    /// tokenizer errors.
    pub fn finish(&self, captioning: Captioning) -> Result<Caption> {
        let Captioning {
            decoding,
            prompted,
            size,
            image_len,
        } = captioning;
        let position = decoding.position();
        match decoding.into_generated() {
            Some(g) => self.caption_of(g, &prompted, size, image_len),
            None => arg_err(
                "captioning",
                format!("it has not ended (at position {position})"),
            ),
        }
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
