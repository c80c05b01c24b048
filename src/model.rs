//! A loaded model: its decoder, its vision pipeline, its tokenizer and the
//! checkpoint's defaults, as [`crate::checkpoint::load`] makes it.

use std::path::PathBuf;

use candle_core::Tensor;
use vl_attn::{Fallback, Quantization, Quantizer};
use vl_decoder::{GenerationConfig, TextEncoder, VisionLanguageDecoder};
use vl_vision::{PixelSpec, VisionPipeline};

use crate::checkpoint::{reported_fallbacks, ModelFormat, VlConfig};
use crate::error::{arg_err, Result};

/// A loaded model.
#[derive(Debug)]
pub struct VlModel {
    /// Where it was loaded from (for a model in memory, its name).
    pub path: PathBuf,
    /// Its configuration.
    pub config: VlConfig,
    /// The decoder.
    pub decoder: VisionLanguageDecoder,
    /// The text encoder whose output the decoder reads, for models that
    /// have one (Florence-2): it reads the image tokens and the prompt.
    pub text_encoder: Option<TextEncoder>,
    /// Images → image tokens (pixel spec, encoder, resampler), if the
    /// model reads images.
    pub vision: Option<VisionPipeline>,
    /// The tokenizer.
    pub tokenizer: tokenizers::Tokenizer,
    /// The checkpoint's generation defaults (for vl directories: greedy,
    /// as many tokens as the positions allow).
    pub generation: GenerationConfig,
    /// The directory's layout.
    pub format: ModelFormat,
    /// The format its linear layers were converted to (each, or the
    /// format it fell back to: [`VlModel::fallbacks`]).
    pub quantization: Quantization,
    /// The layers that could not hold [`VlModel::quantization`] and what
    /// they hold instead.
    pub fallbacks: Vec<Fallback>,
}

impl VlModel {
    /// Converts the linear layers of the vision pipeline and the decoder
    /// (the LM head included) to `q`, as [`crate::checkpoint::load`] does
    /// during a load: a layer `q` cannot hold gets the next format that
    /// fits, recorded in [`VlModel::fallbacks`] and said once in the log.
    /// `Quantization::None` changes nothing.
    ///
    /// # Errors
    /// candle's errors; the model is unchanged on error.
    pub fn quantize(&mut self, q: Quantization) -> Result<()> {
        if q == Quantization::None {
            return Ok(());
        }
        let quantizer = Quantizer::fitting(q);
        let vision = match &self.vision {
            Some(v) => Some(v.quantize(&quantizer)?),
            None => None,
        };
        let decoder = self.decoder.quantize(quantizer.within("decoder"))?;
        let text_encoder = match &self.text_encoder {
            Some(te) => Some(te.quantize(quantizer.within("text_encoder"))?),
            None => None,
        };
        self.vision = vision;
        self.decoder = decoder;
        self.text_encoder = text_encoder;
        self.quantization = q;
        self.fallbacks = reported_fallbacks(&quantizer, q, &self.path);
        Ok(())
    }

    /// The model's tensors by the names a vl directory holds them under
    /// (`decoder.…`, `vision.…`, `resampler.…`): what [`VlModel::save`]
    /// writes (see [`vl_attn::named`]).
    ///
    /// # Errors
    /// candle's errors dequantizing a layer.
    pub fn named_tensors(&self) -> Result<vl_attn::named::Named> {
        let mut tensors = vl_attn::named::Named::new();
        self.decoder.named_tensors("decoder", &mut tensors)?;
        if let Some(te) = &self.text_encoder {
            te.named_tensors("text_encoder", &mut tensors)?;
        }
        if let Some(v) = &self.vision {
            v.encoder().named_tensors("vision", &mut tensors)?;
            if let Some(r) = v.resampler() {
                r.named_tensors("resampler", &mut tensors)?;
            }
        }
        Ok(tensors)
    }

    /// Writes the model as a vl model directory (`config.json`,
    /// `model.safetensors`, `tokenizer.json`) that [`crate::checkpoint::load`]
    /// reads back into the same model, whatever it was loaded from:
    /// dense tensors are written as they are (bit for bit, in their
    /// dtype); converted layers (16-bit, `q8_0`, `q4k`) as the f32 values
    /// they compute with, with the format in `config.json`, so that the
    /// load converts them back to the same blocks.
    ///
    /// The generation defaults (beams, lengths, special tokens, penalties)
    /// are written too, so that a saved transformers checkpoint decodes as
    /// it did.
    ///
    /// # Errors
    /// [`crate::Error::Io`] naming the file that cannot be written; candle's
    /// errors dequantizing a layer.
    pub fn save(&self, dir: &std::path::Path) -> Result<()> {
        let tensors = self.named_tensors()?;
        let config = VlConfig {
            quantization: self.quantization,
            generation: Some(self.generation.clone()),
            ..self.config.clone()
        };
        crate::checkpoint::native::write_dir(dir, &config, &tensors, &self.tokenizer)
    }

    /// The ids a text prompt puts after the start token, tokenized as the
    /// checkpoint's own processor does. BLIP (`BlipProcessor`, then
    /// `generate`): the text with the tokenizer's special tokens, its first
    /// (`[CLS]`, whose place the start token `[DEC]` takes) and last
    /// (`[SEP]`) ids dropped. Donut ([`crate::donut::Reader::Donut`]): the
    /// text without special tokens, which replaces the start token (see
    /// [`VlModel::prompt_replaces_start`]).
    ///
    /// # Errors
    /// [`crate::Error::Argument`] naming `prompt` for a model whose family
    /// defines no prompt, a text the tokenizer rejects, or one that
    /// tokenizes to fewer than the two special tokens (BLIP) or to none
    /// (Donut).
    pub fn prompt_ids(&self, prompt: &str) -> Result<Vec<u32>> {
        if self.prompt_replaces_start() {
            let enc = match self.tokenizer.encode(prompt, false) {
                Ok(e) => e,
                Err(e) => return arg_err("prompt", format!("{prompt:?}: {e}")),
            };
            if enc.get_ids().is_empty() {
                return arg_err("prompt", format!("{prompt:?} tokenizes to no token"));
            }
            return Ok(enc.get_ids().to_vec());
        }
        if self.format != ModelFormat::Blip {
            return arg_err(
                "prompt",
                format!(
                    "the model in {} ({:?}) defines no prompt handling; only BLIP and Donut checkpoints take a prompt",
                    self.path.display(),
                    self.format
                ),
            );
        }
        let enc = match self.tokenizer.encode(prompt, true) {
            Ok(e) => e,
            Err(e) => return arg_err("prompt", format!("{prompt:?}: {e}")),
        };
        match enc.get_ids() {
            [_, words @ .., _] => Ok(words.to_vec()),
            ids => arg_err(
                "prompt",
                format!("{prompt:?} tokenizes to {ids:?}, without [CLS] ... [SEP]"),
            ),
        }
    }

    /// Whether a prompt's ids replace the decoder's start token instead of
    /// following it: Donut's task prompts (`<s_cord-v2>`,
    /// `<s_docvqa><s_question>…`), which transformers' `generate` feeds
    /// as they are under a `donut` encoder.
    pub fn prompt_replaces_start(&self) -> bool {
        self.config.reader == Some(crate::donut::Reader::Donut)
    }

    /// The ids of a text encoder's prompt (Florence-2): `<s>` prompt `</s>`
    /// tokenized without adding special tokens, as `Florence2Processor`
    /// does after its image placeholders.
    ///
    /// # Errors
    /// [`crate::Error::Argument`] naming `prompt` for a model without a
    /// text encoder or a text the tokenizer rejects.
    pub fn encoder_prompt_ids(&self, prompt: &str) -> Result<Vec<u32>> {
        if self.text_encoder.is_none() {
            return arg_err(
                "prompt",
                format!(
                    "the model in {} has no text encoder to read a prompt",
                    self.path.display()
                ),
            );
        }
        match self.tokenizer.encode(format!("<s>{prompt}</s>"), false) {
            Ok(e) => Ok(e.get_ids().to_vec()),
            Err(e) => arg_err("prompt", format!("{prompt:?}: {e}")),
        }
    }

    /// The memory the decoder reads for `image_tokens` and a text
    /// encoder's prompt `ids` (the same prompt for every image): the text
    /// encoder's output over `[image tokens; prompt]`.
    ///
    /// # Shapes
    /// `image_tokens: (images, tokens, width)` → `(images, tokens +
    /// ids.len(), width)`.
    ///
    /// # Errors
    /// [`crate::Error::Argument`] naming `prompt` for a model without a
    /// text encoder; the encoder's errors (an id outside the vocabulary, a
    /// sequence longer than its positions).
    pub fn encoder_memory(&self, image_tokens: &Tensor, ids: &[u32]) -> Result<Tensor> {
        let Some(te) = &self.text_encoder else {
            return arg_err(
                "prompt",
                format!("the model in {} has no text encoder", self.path.display()),
            );
        };
        let n = image_tokens.dim(0)?;
        let prompt = Tensor::new(ids, image_tokens.device())?
            .unsqueeze(0)?
            .repeat((n, 1))?;
        Ok(te.forward(Some(image_tokens), &prompt)?)
    }

    /// The vision pipeline; an error naming `images` when the model reads
    /// none.
    pub fn vision(&self) -> Result<&VisionPipeline> {
        match &self.vision {
            Some(v) => Ok(v),
            None => arg_err(
                "images",
                format!("the model in {} has no vision encoder", self.path.display()),
            ),
        }
    }

    /// What the vision encoder expects of its pixels; an error when the
    /// model has no vision encoder.
    pub fn pixel_spec(&self) -> Result<&PixelSpec> {
        Ok(self.vision()?.spec())
    }

    /// Image tokens of a batch of preprocessed pixels (see
    /// [`vl_vision::preprocess`]), through the resampler when the model has
    /// one.
    ///
    /// # Shapes
    /// `pixels: (images, 3, size, size)` → `(images, tokens, memory_dim)`.
    pub fn encode_pixels(&self, pixels: &Tensor) -> Result<Tensor> {
        Ok(self.vision()?.encode_batch(pixels)?)
    }
}
