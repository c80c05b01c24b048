//! Loading checkpoints, by format, onto vl's own modules.
//!
//! [`VlModel::load`] reads a directory's `config.json`, tells the format
//! from its `model_type`, and hands it to the loader of that format:
//!
//! | `model_type` | loader | what |
//! |---|---|---|
//! | `vl` | [`native`] | vl's own directories (the shipped shapes captioner) |
//! | `vision-encoder-decoder` | [`hf`] | transformers ViT/DeiT + GPT-2/TrOCR checkpoints |
//! | `blip` | [`hf::blip`] | transformers `BlipForConditionalGeneration` captioners |
//!
//! Anything else is refused with [`Error::UnsupportedModel`], naming what
//! was found and what vl loads. The pieces every format shares live beside
//! them: [`safetensors`] (checked tensor-by-tensor reading), [`tokenizer`].

pub mod hf;
pub mod native;
pub mod safetensors;
pub mod tokenizer;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use serde::Deserialize;
use vl_decoder::{GenerationConfig, VisionLanguageDecoder};
use vl_vision::preprocess::preprocess_batch;
use vl_vision::{PixelSpec, VisionEncoder};

use crate::error::{arg_err, Error, Result};

pub use native::{ModelBytes, VlConfig};
pub use tokenizers::Tokenizer;

/// The weights file of a model directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The config file of a model directory.
pub const CONFIG_FILE: &str = "config.json";
/// The tokenizer file of a model directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// The `model_type`s vl loads, as [`Error::UnsupportedModel`] lists them.
pub const SUPPORTED: &[&str] = &[
    "`vl` (vl's own directories)",
    "`vision-encoder-decoder` with a `vit` or `deit` encoder and a `gpt2` or `trocr` decoder",
    "`blip` (BlipForConditionalGeneration)",
];

/// Reads a JSON file into `T`, naming the file in errors.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| Error::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// The layout of a model directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFormat {
    /// vl's own: see [`native`].
    Vl,
    /// A transformers `VisionEncoderDecoderModel` (ViT or DeiT + GPT-2 or
    /// TrOCR): see [`hf`].
    VisionEncoderDecoder,
    /// A transformers `BlipForConditionalGeneration`: see [`hf::blip`].
    Blip,
}

impl ModelFormat {
    /// The format `config.json` in `dir` declares by its `model_type`.
    ///
    /// # Errors
    /// [`Error::Io`]/[`Error::Json`] for a missing or malformed
    /// `config.json`; [`Error::UnsupportedModel`] for a `model_type` vl
    /// does not load (or none).
    pub fn detect(dir: &Path) -> Result<Self> {
        #[derive(Deserialize)]
        struct Probe {
            model_type: Option<serde_json::Value>,
        }
        let path = dir.join(CONFIG_FILE);
        let probe: Probe = read_json(&path)?;
        match probe.model_type.as_ref().and_then(|v| v.as_str()) {
            Some(native::MODEL_TYPE) => Ok(Self::Vl),
            Some(hf::MODEL_TYPE) => Ok(Self::VisionEncoderDecoder),
            Some(hf::blip::MODEL_TYPE) => Ok(Self::Blip),
            other => Err(Error::UnsupportedModel {
                path,
                what: "model_type",
                model_type: match other {
                    Some(t) => t.to_string(),
                    None => match probe.model_type {
                        Some(v) => v.to_string(),
                        None => "(none)".into(),
                    },
                },
                supported: SUPPORTED.to_vec(),
            }),
        }
    }
}

/// A loaded model: decoder, vision encoder, tokenizer and the checkpoint's
/// defaults.
#[derive(Debug)]
pub struct VlModel {
    /// Where it was loaded from (for an embedded model, its name).
    pub path: PathBuf,
    /// Its configuration.
    pub config: VlConfig,
    /// The decoder.
    pub decoder: VisionLanguageDecoder,
    /// The vision encoder, if any.
    pub vision: Option<VisionEncoder>,
    /// The resampler between encoder and decoder, if configured.
    pub resampler: Option<vl_attn::Resampler>,
    /// The tokenizer.
    pub tokenizer: tokenizers::Tokenizer,
    /// What the vision encoder expects of its pixels, if there is one.
    pub pixels: Option<PixelSpec>,
    /// The checkpoint's generation defaults (for vl directories: greedy,
    /// as many tokens as the positions allow).
    pub generation: GenerationConfig,
    /// The directory's layout.
    pub format: ModelFormat,
}

/// `vision` quantized to `format` (as it is when `None`): a family
/// loader's step of [`VlModel::load_quantized`].
pub(crate) fn quantized_vision(
    vision: VisionEncoder,
    format: Option<candle_core::quantized::GgmlDType>,
) -> Result<VisionEncoder> {
    Ok(match format {
        Some(f) => vision.quantize(f)?,
        None => vision,
    })
}

/// Block `i` of a decoder being loaded, quantized to `format` (as it is
/// when `None`) as soon as it is built: a loader then holds one dense block
/// at a time, not the whole dense decoder. Errors name the block as
/// [`VisionLanguageDecoder::into_quantized`] does.
pub(crate) fn quantized_block(
    i: usize,
    block: vl_decoder::block::DecoderBlock,
    format: Option<candle_core::quantized::GgmlDType>,
) -> Result<vl_decoder::block::DecoderBlock> {
    Ok(match format {
        Some(f) => block
            .quantize(f)
            .map_err(|e| e.within(&format!("blocks.{i}")))?,
        None => block,
    })
}

/// `decoder` quantized to `format` (as it is when `None`), block by block,
/// each dense block dropped as soon as its quantized copy exists (blocks
/// the loader quantized already are kept as they are).
pub(crate) fn quantized_decoder(
    decoder: VisionLanguageDecoder,
    format: Option<candle_core::quantized::GgmlDType>,
) -> Result<VisionLanguageDecoder> {
    Ok(match format {
        Some(f) => decoder.into_quantized(f)?,
        None => decoder,
    })
}

impl VlModel {
    /// Loads `dir` onto `device` in `dtype`, in whichever format its
    /// `config.json` declares ([`ModelFormat::detect`]). Errors name the
    /// file and, for weights, the tensor with the expected and found shape.
    pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        Self::load_quantized(dir, dtype, device, vl_decoder::Quantization::None)
    }

    /// [`VlModel::load`] with the linear layers quantized to `q` (as
    /// [`VlModel::quantize`] does), converted part by part as the load goes:
    /// for transformers' checkpoints the vision encoder is quantized before
    /// the decoder's weights are read and each decoder block as soon as it
    /// is read, so the dense weights of the encoder or of one block at most
    /// are in memory beside the quantized ones (and the embeddings, which
    /// stay dense) — peak memory stays under the dense file's size for `q8_0`,
    /// where loading first and quantizing after holds the whole dense model
    /// and a quantized copy. vl's own (small) directories are loaded, then
    /// quantized. On CPUs with AVX512_BF16 a `bf16` load packs its linear
    /// layers for vl's bf16 kernels as `Quantization::Bf16` does.
    ///
    /// # Errors
    /// As [`VlModel::load`] and [`VlModel::quantize`].
    pub fn load_quantized(
        dir: &Path,
        dtype: DType,
        device: &Device,
        q: vl_decoder::Quantization,
    ) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "not a model directory"),
            });
        }
        // On CPUs with vl's bf16 kernels, a bf16 model's linear layers are
        // packed for them once (what `--quantize bf16` does): the same
        // products (biases added before the rounding), no packing per call.
        let q = if q == vl_decoder::Quantization::None
            && dtype == DType::BF16
            && device.is_cpu()
            && vl_attn::kernels::gemm_bf16::accelerated()
        {
            vl_decoder::Quantization::Bf16
        } else {
            q
        };
        let format = q.ggml_dtype();
        match ModelFormat::detect(dir)? {
            ModelFormat::Vl => {
                let mut model = native::load(dir, dtype, device)?;
                model.quantize(q)?;
                Ok(model)
            }
            ModelFormat::VisionEncoderDecoder => hf::load(dir, dtype, device, format),
            ModelFormat::Blip => hf::blip::load(dir, dtype, device, format),
        }
    }

    /// Writes a vl model directory (see [`native::save`]).
    pub fn save(
        dir: &Path,
        config: &VlConfig,
        vars: &VarMap,
        tokenizer: &tokenizers::Tokenizer,
    ) -> Result<()> {
        native::save(dir, config, vars, tokenizer)
    }

    /// Quantizes the decoder's and the vision encoder's linear layers (and
    /// the LM head) to `q`; `Quantization::None` changes nothing.
    ///
    /// # Errors
    /// A layer whose width does not fit the format's block size, named
    /// (`decoder.…` or `vision.…`).
    pub fn quantize(&mut self, q: vl_decoder::Quantization) -> Result<()> {
        if let Some(format) = q.ggml_dtype() {
            // The vision encoder first, as `load_quantized` does: the same
            // layer is named when one does not fit.
            let vision = match &self.vision {
                Some(v) => Some(v.quantize(format)?),
                None => None,
            };
            let decoder = self.decoder.quantize(format)?;
            let resampler = match &self.resampler {
                Some(r) => Some(r.quantize(format).map_err(|e| e.within("resampler"))?),
                None => None,
            };
            self.decoder = decoder;
            self.vision = vision;
            self.resampler = resampler;
        }
        Ok(())
    }

    /// The ids a text prompt puts after the start token, tokenized as the
    /// checkpoint's own processor does. Only BLIP defines prompts
    /// (`BlipProcessor`, then `generate`): the text with the tokenizer's
    /// special tokens, its first (`[CLS]`, whose place the start token `[DEC]`
    /// takes) and last (`[SEP]`) ids dropped.
    ///
    /// # Errors
    /// [`Error::Argument`] naming `prompt` for a model whose family defines
    /// no prompt, a text the tokenizer rejects, or one that tokenizes to
    /// fewer than the two special tokens.
    pub fn prompt_ids(&self, prompt: &str) -> Result<Vec<u32>> {
        if self.format != ModelFormat::Blip {
            return arg_err(
                "prompt",
                format!(
                    "the model in {} ({:?}) defines no prompt handling; only BLIP checkpoints take a prompt",
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

    /// Image tokens of decoded images: preprocessing, then the encoder.
    ///
    /// # Shapes
    /// Returns `(images.len(), tokens, memory_dim)`.
    pub fn encode_images(&self, images: &[&image::DynamicImage]) -> Result<Tensor> {
        let pixels = preprocess_batch(images, self.pixel_spec()?, self.decoder.device())?;
        self.encode_pixels(&pixels)
    }

    /// What the vision encoder expects of its pixels; an error when the
    /// model has no vision encoder.
    pub fn pixel_spec(&self) -> Result<&PixelSpec> {
        match (&self.vision, &self.pixels) {
            (Some(_), Some(spec)) => Ok(spec),
            _ => arg_err(
                "images",
                format!("the model in {} has no vision encoder", self.path.display()),
            ),
        }
    }

    /// Image tokens of preprocessed pixels (see [`vl_vision::preprocess`]),
    /// through the resampler when the model has one.
    ///
    /// # Shapes
    /// `pixels: (images, 3, size, size)` → `(images, tokens, memory_dim)`.
    pub fn encode_pixels(&self, pixels: &Tensor) -> Result<Tensor> {
        let Some(vision) = &self.vision else {
            return arg_err(
                "images",
                format!("the model in {} has no vision encoder", self.path.display()),
            );
        };
        let tokens = vision.forward(&pixels.to_dtype(self.decoder.dtype())?)?;
        match &self.resampler {
            None => Ok(tokens),
            // (images, tokens, vision width) -> (images, queries, memory_dim)
            Some(r) => Ok(r.forward(&tokens, None)?),
        }
    }
}
