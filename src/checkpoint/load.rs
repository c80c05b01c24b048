//! The loading sequence every format runs ([`load`]), what it takes
//! ([`Source`], [`LoadOptions`]) and what a format's family file provides
//! ([`Family`]).

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use tokenizers::Tokenizer;
use vl_attn::{Fallback, Quantization, Quantizer, Resampler};
use vl_decoder::block::DecoderBlock;
use vl_decoder::{GenerationConfig, TextEncoder, VisionLanguageDecoder};
use vl_vision::{VisionEncoder, VisionPipeline};

use super::{
    hf, native, parse_json, read_json, safetensors, ModelBytes, ModelFormat, VlConfig, CONFIG_FILE,
    WEIGHTS_FILE,
};
use crate::error::{weights_error, Error, Result};
use crate::model::VlModel;

/// Where a model's files are.
#[derive(Debug, Clone, Copy)]
pub enum Source<'a> {
    /// A model directory (any format).
    Dir(&'a Path),
    /// A vl model's three files in memory (e.g. embedded in a binary with
    /// `include_bytes!`); `name` stands for the directory in errors and in
    /// [`VlModel::path`].
    Memory {
        /// What the model is called.
        name: &'a Path,
        /// Its files.
        files: ModelBytes<'a>,
    },
}

impl<'a> From<&'a Path> for Source<'a> {
    fn from(dir: &'a Path) -> Self {
        Self::Dir(dir)
    }
}

impl<'a> From<&'a PathBuf> for Source<'a> {
    fn from(dir: &'a PathBuf) -> Self {
        Self::Dir(dir)
    }
}

/// How a model is loaded.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// The dtype of the activations and of the dense weights.
    pub dtype: DType,
    /// Where the model runs.
    pub device: Device,
    /// The format of the linear layers (encoder, resampler, decoder, LM
    /// head), converted as the load goes; each layer the format cannot
    /// hold gets the next format that fits.
    pub quantization: Quantization,
    /// The dtype of the decoder's text cache (its self-attention's keys
    /// and values). `None`, the default: the activations' dtype, except
    /// under converted weights (`quantization`) with f32 activations on
    /// the CPU, where it follows the weights as the image's keys and
    /// values do — q8 rows ([`vl_attn::quantize_kv`]) for `q8_0` and `q4k`
    /// where the head width is a multiple of 32 (else bf16), bf16 for bf16
    /// weights, f16 for f16 weights (see [`vl_attn::Quantizer::kv_dtype`]).
    /// A 16-bit cache halves what a decode step reads from it — the larger part of a step
    /// past a few thousand tokens (a Nougat page) — rounding keys and
    /// values as transformers' bf16 model does. `Some(F32)` keeps f32
    /// under any weights (see
    /// [`vl_decoder::VisionLanguageDecoder::set_text_cache_dtype`]).
    pub text_cache: Option<DType>,
    /// The dtype of the image's keys and values (each cross-attention's,
    /// projected once per image). `None`, the default: as the blocks are
    /// built or quantized (under converted weights with f32 activations on
    /// the CPU, as the text cache: see [`LoadOptions::text_cache`]).
    /// `Some(U8)`: q8 rows ([`vl_attn::quantize_kv`],
    /// 8-bit values with an f16 scale per 32), about half of bf16's bytes —
    /// what a decode step of many requests reads most of after the
    /// weights (see
    /// [`vl_decoder::VisionLanguageDecoder::set_image_cache_dtype`]).
    pub image_cache: Option<DType>,
}

impl Default for LoadOptions {
    /// f32 on the CPU, weights as stored.
    fn default() -> Self {
        Self::new(DType::F32, &Device::Cpu)
    }
}

impl LoadOptions {
    /// `dtype` on `device`, weights as stored.
    pub fn new(dtype: DType, device: &Device) -> Self {
        Self {
            dtype,
            device: device.clone(),
            quantization: Quantization::None,
            text_cache: None,
            image_cache: None,
        }
    }

    /// The same, the linear layers converted to `q`.
    #[must_use]
    pub fn quantized(self, q: Quantization) -> Self {
        Self {
            quantization: q,
            ..self
        }
    }

    /// The same, the image's keys and values kept in `dtype` (see
    /// [`LoadOptions::image_cache`]).
    #[must_use]
    pub fn with_image_cache(self, dtype: Option<DType>) -> Self {
        Self {
            image_cache: dtype,
            ..self
        }
    }

    /// The same, the decoder's text cache kept in `dtype` (see
    /// [`LoadOptions::text_cache`]).
    #[must_use]
    pub fn with_text_cache(self, dtype: Option<DType>) -> Self {
        Self {
            text_cache: dtype,
            ..self
        }
    }
}

impl<'a> Source<'a> {
    /// The directory, or the name standing for it.
    pub(crate) fn root(&self) -> &'a Path {
        match *self {
            Self::Dir(dir) => dir,
            Self::Memory { name, .. } => name,
        }
    }

    /// The path of the model's file `name`, for reading and for errors.
    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.root().join(name)
    }

    /// The directory of a format that only loads from one.
    pub(crate) fn dir(&self, format: ModelFormat) -> Result<&'a Path> {
        match *self {
            Self::Dir(dir) => Ok(dir),
            Self::Memory { name, .. } => Err(Error::Argument {
                arg: "source",
                reason: format!(
                    "{}: a {format:?} checkpoint loads from a directory; in memory, only vl's own models load",
                    name.display()
                ),
            }),
        }
    }

    fn config(&self) -> Result<serde_json::Value> {
        match self {
            Self::Dir(dir) => read_json(&dir.join(CONFIG_FILE)),
            Self::Memory { name, files } => parse_json(files.config, &name.join(CONFIG_FILE)),
        }
    }

    /// The weights as a checked builder, the path that names them in
    /// errors (the file, or the shard index), and the reader of the blocks
    /// a converted model stored (files on disk only).
    fn weights(
        &self,
        dtype: DType,
        device: &Device,
    ) -> Result<(
        PathBuf,
        VarBuilder<'static>,
        Option<safetensors::SharedWeights>,
    )> {
        match self {
            Self::Dir(dir) => {
                let (label, files) = hf::weight_files(dir)?;
                let (vb, shared) = safetensors::open_shared(&files, dtype, device)?;
                Ok((label, vb, Some(shared)))
            }
            Self::Memory { name, files } => {
                let label = name.join(WEIGHTS_FILE);
                let vb =
                    VarBuilder::from_buffered_safetensors(files.weights.to_vec(), dtype, device)
                        .map_err(weights_error(&label))?;
                Ok((label, vb, None))
            }
        }
    }
}

/// What a family file makes of a checkpoint's config, before any weight is
/// read.
pub(crate) struct Plan<C> {
    /// The family's own config, as its file parsed it.
    pub family: C,
    /// The model in vl's terms.
    pub config: VlConfig,
    /// The checkpoint's generation defaults.
    pub generation: GenerationConfig,
    /// The tokenizer, checked against the vocabulary.
    pub tokenizer: Tokenizer,
}

/// What [`load`] hands each decoder block to as soon as it is built.
pub(crate) type BlockHook<'h> = dyn FnMut(usize, DecoderBlock) -> Result<DecoderBlock> + 'h;

/// A checkpoint family: its names and layouts mapped onto vl's modules.
/// [`load`] calls the three steps in order.
pub(crate) trait Family: Sized {
    /// The layout it reads.
    const FORMAT: ModelFormat;

    /// Parses and checks the config (read once, by [`load`]) and everything
    /// else that is not weights: generation defaults, preprocessing,
    /// tokenizer.
    fn plan(source: &Source, config: &serde_json::Value) -> Result<Plan<Self>>;

    /// The vision encoder and the resampler, dense; `None` for a model
    /// without images.
    fn vision(
        &self,
        vb: &VarBuilder,
        config: &VlConfig,
    ) -> Result<Option<(VisionEncoder, Option<Resampler>)>>;

    /// The decoder, each block handed to `block` as soon as it is built (a
    /// family may also build them all, then [`load`] converts the rest).
    fn decoder(
        &self,
        vb: &VarBuilder,
        config: &VlConfig,
        block: &mut BlockHook,
    ) -> Result<VisionLanguageDecoder>;

    /// The text encoder between the vision side and the decoder, dense
    /// (Florence-2's); `None` (the default) for a decoder that reads the
    /// image tokens directly. `decoder` is built already: a text encoder
    /// may share its token table.
    fn text_encoder(
        &self,
        _vb: &VarBuilder,
        _config: &VlConfig,
        _decoder: &VisionLanguageDecoder,
    ) -> Result<Option<TextEncoder>> {
        Ok(None)
    }
}

/// Loads a model from `source` (a directory of any format vl reads, or a
/// vl model's files in memory) as `options` say. Errors name the file and,
/// for weights, the tensor with the expected and found shape.
///
/// ```no_run
/// use std::path::Path;
/// use vl::checkpoint::{load, LoadOptions};
/// use vl::vl_attn::Quantization;
///
/// let options = LoadOptions::default().quantized(Quantization::Q8_0);
/// let model = load(Path::new("models/shapes-captioner"), &options)?;
/// for f in &model.fallbacks {
///     println!("{} kept {:?}", f.layer, f.got);
/// }
/// # Ok::<(), vl::Error>(())
/// ```
///
/// Dense bf16 weights on a CPU with vl's bf16 kernels are held packed for
/// them ([`Quantization::for_model`]); [`VlModel::quantization`] says what
/// the model holds.
///
/// # Errors
/// [`Error::Io`]/[`Error::Json`] for a missing or malformed file;
/// [`Error::UnsupportedModel`] for a format vl does not read;
/// [`Error::Config`] naming the field (and file) of an impossible config;
/// [`Error::Weights`] naming the file and the tensor; [`Error::Tokenizer`].
pub fn load<'a>(source: impl Into<Source<'a>>, options: &LoadOptions) -> Result<VlModel> {
    let source = source.into();
    if let Source::Dir(dir) = source {
        if !dir.is_dir() {
            return Err(Error::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "not a model directory"),
            });
        }
    }
    let config = source.config()?;
    match ModelFormat::of(&config, &source.path(CONFIG_FILE))? {
        ModelFormat::Vl => load_family::<native::Native>(&source, &config, options),
        ModelFormat::VisionEncoderDecoder => load_family::<hf::HfConfig>(&source, &config, options),
        ModelFormat::Blip => load_family::<hf::blip::HfBlipConfig>(&source, &config, options),
        ModelFormat::Florence2 => {
            load_family::<hf::florence2::HfFlorence2>(&source, &config, options)
        }
    }
}

fn load_family<F: Family>(
    source: &Source,
    config: &serde_json::Value,
    options: &LoadOptions,
) -> Result<VlModel> {
    let Plan {
        family,
        config,
        generation,
        tokenizer,
    } = F::plan(source, config)?;
    // A model saved converted says its format; a format asked overrides it.
    let asked = if options.quantization.is_none() {
        config.quantization
    } else {
        options.quantization
    };
    let quantization = asked.for_model(options.dtype, &options.device);
    if quantization != asked {
        tracing::debug!(
            "{}: bf16 weights held as {quantization} for vl's bf16 kernels",
            source.root().display()
        );
    }
    let (label, vb, stored) = source.weights(options.dtype, &options.device)?;
    let quantizer = match stored {
        Some(s) => Quantizer::fitting(quantization).with_stored(std::sync::Arc::new(s)),
        None => Quantizer::fitting(quantization),
    };
    let converts = quantizer.format().is_some();
    let vision = match family.vision(&vb, &config).map_err(weights_error(&label))? {
        None => None,
        Some((encoder, resampler)) => {
            let pipeline = VisionPipeline::new(encoder, resampler, &options.device)?;
            // A ViT's layers left dense f32 are packed for vl's f32
            // product where it is this CPU's (the same values).
            Some(
                if converts {
                    pipeline.quantize(&quantizer)?
                } else {
                    pipeline
                }
                .pack_f32()?,
            )
        }
    };
    let dq = quantizer.within("decoder");
    let decoder = family
        .decoder(&vb, &config, &mut |i, block| {
            if converts {
                Ok(block.quantize(dq.within(&format!("blocks.{i}")))?)
            } else {
                Ok(block)
            }
        })
        .map_err(weights_error(&label))?;
    // The layers the family did not hand over (the LM head; all of them for
    // a family that builds its blocks at once); blocks converted already are
    // shared as they are.
    let mut decoder = if converts {
        decoder.into_quantized(&dq)?
    } else {
        decoder
    };
    // Unasked, the cache is as quantizing left it (see `text_cache`).
    if let Some(dtype) = options.text_cache {
        decoder.set_text_cache_dtype(Some(dtype))?;
    }
    if let Some(dtype) = options.image_cache {
        decoder.set_image_cache_dtype(Some(dtype))?;
    }
    let text_encoder = match family
        .text_encoder(&vb, &config, &decoder)
        .map_err(weights_error(&label))?
    {
        Some(te) if converts => Some(te.quantize(quantizer.within("text_encoder"))?),
        other => other,
    };
    let fallbacks = reported_fallbacks(&quantizer, quantization, source.root());
    Ok(VlModel {
        path: source.root().to_path_buf(),
        config,
        decoder,
        text_encoder,
        vision,
        tokenizer,
        generation,
        format: F::FORMAT,
        quantization,
        fallbacks,
    })
}

/// The layers that fell back while `quantizer` converted the model at
/// `path` to `q`, said once in the log.
pub(crate) fn reported_fallbacks(
    quantizer: &Quantizer,
    q: Quantization,
    path: &Path,
) -> Vec<Fallback> {
    let fallbacks = quantizer.fallbacks();
    if let Some(summary) = fallback_summary(q, &fallbacks) {
        tracing::warn!("{}: {summary}", path.display());
    }
    fallbacks
}

/// One line saying which layers could not hold `q` and what they hold
/// instead, grouped by format; `None` when every layer holds `q`.
pub fn fallback_summary(q: Quantization, fallbacks: &[Fallback]) -> Option<String> {
    if fallbacks.is_empty() {
        return None;
    }
    // By what they hold and their width: one group per kind of layer.
    let mut groups: Vec<((String, usize), Vec<&str>)> = Vec::new();
    for f in fallbacks {
        let key = (vl_attn::quantize::format_name(f.got), f.in_dim);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, layers)) => layers.push(&f.layer),
            None => groups.push((key, vec![&f.layer])),
        }
    }
    let parts: Vec<String> = groups
        .into_iter()
        .map(|((got, width), layers)| {
            format!(
                "{got} for {} of input width {width} ({})",
                layers.len(),
                layers.join(", ")
            )
        })
        .collect();
    Some(format!(
        "{} layer{} cannot hold {q} (input width not a multiple of its block of {}): {}",
        fallbacks.len(),
        if fallbacks.len() == 1 { "" } else { "s" },
        q.block_size(),
        parts.join("; ")
    ))
}
