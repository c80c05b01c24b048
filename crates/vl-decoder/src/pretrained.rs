//! A vl model directory:
//!
//! - `config.json`: `{"model_type": "vl", "decoder": {…DecoderConfig…},
//!   "vision": {"kind": "mock_vit", …} | null}`
//! - `model.safetensors`: the decoder's tensors under `decoder.`, the vision
//!   encoder's (if it has any) under `vision.`; read tensor by tensor at load
//! - `tokenizer.json`: a tokenizers-crate tokenizer covering every id

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use serde::{Deserialize, Serialize};

use crate::config::DecoderConfig;
use crate::dir::{
    in_file, load_tokenizer, open_weights, read_json, save_varmap, weights_error, CONFIG_FILE,
    TOKENIZER_FILE, WEIGHTS_FILE,
};
use crate::error::{arg_err, config_err, DecoderError, Result};
use crate::generate::GenerationConfig;
use crate::mock_vit::{MockVit, MockVitConfig};
use crate::model::VisionLanguageDecoder;
use crate::preprocess::{preprocess_batch, PixelSpec};
use crate::vit::{Vit, VitConfig};

/// The `model_type` of a vl model directory.
pub const MODEL_TYPE: &str = "vl";

/// The vision encoder of a model directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum VisionConfig {
    /// The seeded, weightless [`MockVit`].
    MockVit(MockVitConfig),
    /// A trained [`Vit`], weights under `vision.`.
    Vit(VitConfig),
}

impl VisionConfig {
    /// The width of the image tokens.
    pub fn hidden_size(&self) -> usize {
        match self {
            Self::MockVit(c) => c.hidden_size,
            Self::Vit(c) => c.output_width(),
        }
    }

    /// What the encoder expects of its pixels (the mock ViT takes pixels
    /// normalised by mean 0.5 and std 0.5).
    pub fn pixel_spec(&self) -> PixelSpec {
        match self {
            Self::MockVit(c) => PixelSpec::new(c.image_size, [0.5; 3], [0.5; 3]),
            Self::Vit(c) => c.pixel_spec(),
        }
    }
}

/// `config.json` of a vl model directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VlConfig {
    /// Always `"vl"`.
    pub model_type: String,
    /// The decoder.
    pub decoder: DecoderConfig,
    /// The vision encoder, if the directory has one.
    #[serde(default)]
    pub vision: Option<VisionConfig>,
}

impl VlConfig {
    /// Rejects impossible values.
    pub fn validate(&self) -> Result<()> {
        if self.model_type != MODEL_TYPE {
            return config_err(
                "model_type",
                format!("expected \"{MODEL_TYPE}\", got {:?}", self.model_type),
            );
        }
        self.decoder.validate()?;
        let Some(vision) = &self.vision else {
            return Ok(());
        };
        match vision {
            VisionConfig::MockVit(v) => v.validate()?,
            VisionConfig::Vit(v) => v.validate()?,
        }
        if vision.hidden_size() != self.decoder.memory_dim {
            return config_err(
                "vision.hidden_size",
                format!(
                    "{} does not match decoder.memory_dim {}",
                    vision.hidden_size(),
                    self.decoder.memory_dim
                ),
            );
        }
        Ok(())
    }
}

/// A vision encoder.
#[derive(Debug, Clone)]
pub enum VisionEncoder {
    /// The mock encoder.
    MockVit(MockVit),
    /// A trained ViT.
    Vit(Vit),
}

impl VisionEncoder {
    /// Builds the encoder of `cfg`, its weights (if any) under `vb`.
    pub fn load(vb: VarBuilder, cfg: &VisionConfig) -> Result<Self> {
        Ok(match cfg {
            VisionConfig::MockVit(c) => Self::MockVit(MockVit::new(c, vb.dtype(), vb.device())?),
            VisionConfig::Vit(c) => Self::Vit(Vit::load(vb, c)?),
        })
    }

    /// Image tokens of normalised pixels.
    ///
    /// # Shapes
    /// `pixels: (batch, 3, size, size)` → `(batch, tokens, hidden)`.
    pub fn forward(&self, pixels: &Tensor) -> Result<Tensor> {
        match self {
            Self::MockVit(m) => m.forward(pixels),
            Self::Vit(v) => v.forward(pixels),
        }
    }
}

/// The layout of a model directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFormat {
    /// vl's own: see the module documentation.
    Vl,
    /// A transformers `VisionEncoderDecoderModel` (ViT + GPT-2): see
    /// [`crate::hf`].
    VisionEncoderDecoder,
}

/// A loaded model directory.
#[derive(Debug)]
pub struct VlModel {
    /// Where it was loaded from.
    pub path: PathBuf,
    /// Its configuration.
    pub config: VlConfig,
    /// The decoder.
    pub decoder: VisionLanguageDecoder,
    /// The vision encoder, if any.
    pub vision: Option<VisionEncoder>,
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

impl VlModel {
    /// Loads `dir` onto `device` in `dtype`: a vl model directory, or a
    /// transformers vision-encoder-decoder checkpoint ([`crate::hf`]),
    /// told apart by `config.json`'s `model_type`. Errors name the file
    /// and, for weights, the tensor with the expected and found shape.
    pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        if !dir.is_dir() {
            return Err(DecoderError::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "not a model directory"),
            });
        }
        if crate::hf::is_hf_checkpoint(dir) {
            return crate::hf::load(dir, dtype, device);
        }
        let config_path = dir.join(CONFIG_FILE);
        let config: VlConfig = read_json(&config_path)?;
        config.validate().map_err(in_file(&config_path))?;
        let tokenizer = load_tokenizer(&dir.join(TOKENIZER_FILE), config.decoder.vocab_size)?;
        let weights = dir.join(WEIGHTS_FILE);
        let vb = open_weights(std::slice::from_ref(&weights), None, dtype, device)?;
        let decoder = VisionLanguageDecoder::load(vb.pp("decoder"), &config.decoder)
            .map_err(|e| weights_error(&weights, e))?;
        let vision = match &config.vision {
            None => None,
            Some(v) => Some(
                VisionEncoder::load(vb.pp("vision"), v).map_err(|e| weights_error(&weights, e))?,
            ),
        };
        let generation =
            GenerationConfig::greedy(&config.decoder, config.decoder.max_position_embeddings - 1);
        Ok(Self {
            path: dir.to_path_buf(),
            pixels: config.vision.as_ref().map(VisionConfig::pixel_spec),
            generation,
            format: ModelFormat::Vl,
            config,
            decoder,
            vision,
            tokenizer,
        })
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

    /// Image tokens of preprocessed pixels (see [`crate::preprocess`]).
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
        vision.forward(&pixels.to_dtype(self.decoder.dtype())?)
    }

    /// Writes a model directory: `config`, the variables of `vars` (named
    /// `decoder.…` and `vision.…`), and `tokenizer`.
    pub fn save(
        dir: &Path,
        config: &VlConfig,
        vars: &VarMap,
        tokenizer: &tokenizers::Tokenizer,
    ) -> Result<()> {
        config.validate()?;
        std::fs::create_dir_all(dir).map_err(|source| DecoderError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let config_path = dir.join(CONFIG_FILE);
        let json = serde_json::to_string_pretty(config).map_err(|source| DecoderError::Json {
            path: config_path.clone(),
            source,
        })?;
        std::fs::write(&config_path, json + "\n").map_err(|source| DecoderError::Io {
            path: config_path,
            source,
        })?;
        save_varmap(vars, &dir.join(WEIGHTS_FILE))?;
        let tok_path = dir.join(TOKENIZER_FILE);
        tokenizer
            .save(&tok_path, true)
            .map_err(|e| DecoderError::Tokenizer {
                path: tok_path,
                reason: format!("cannot write: {e}"),
            })
    }
}
