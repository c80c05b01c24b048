//! A vl model directory:
//!
//! - `config.json`: `{"model_type": "vl", "decoder": {…DecoderConfig…},
//!   "vision": {"kind": "mock_vit", …} | null}`
//! - `model.safetensors`: the decoder's tensors under `decoder.`, the vision
//!   encoder's (if it has any) under `vision.`; read tensor by tensor at load
//! - `tokenizer.json`: a tokenizers-crate tokenizer covering every id

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use serde::{Deserialize, Serialize};
use vl_attn::{Resampler, ResamplerConfig};
use vl_decoder::{DecoderConfig, GenerationConfig, VisionLanguageDecoder};
use vl_vision::{VisionConfig, VisionEncoder};

use super::safetensors::{open_weights, save_varmap};
use super::tokenizer::{load_tokenizer, parse_tokenizer};
use super::{read_json, ModelFormat, VlModel, CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE};
use crate::error::{in_file, weights_error, Error, Result};

/// The `model_type` of a vl model directory.
pub const MODEL_TYPE: &str = "vl";

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
    /// A resampler between the vision encoder and the decoder, compressing
    /// the image tokens to its queries; weights under `resampler.`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resampler: Option<ResamplerConfig>,
}

impl VlConfig {
    /// Rejects impossible values.
    pub fn validate(&self) -> Result<()> {
        if self.model_type != MODEL_TYPE {
            return Err(Error::Config {
                field: "model_type",
                reason: format!("expected \"{MODEL_TYPE}\", got {:?}", self.model_type),
            });
        }
        self.decoder.validate()?;
        let Some(vision) = &self.vision else {
            return Ok(());
        };
        vision.validate()?;
        let image_width = match &self.resampler {
            None => vision.hidden_size(),
            Some(r) => {
                r.validate()?;
                if vision.hidden_size() != r.memory_dim {
                    return Err(Error::Config {
                        field: "resampler.memory_dim",
                        reason: format!(
                            "{} does not match the vision encoder's width {}",
                            r.memory_dim,
                            vision.hidden_size()
                        ),
                    });
                }
                r.width
            }
        };
        if image_width != self.decoder.memory_dim {
            return Err(Error::Config {
                field: if self.resampler.is_some() {
                    "resampler.width"
                } else {
                    "vision.hidden_size"
                },
                reason: format!(
                    "{image_width} does not match decoder.memory_dim {}",
                    self.decoder.memory_dim
                ),
            });
        }
        Ok(())
    }
}

/// Loads a vl model directory onto `device` in `dtype`. Errors name the
/// file and, for weights, the tensor with the expected and found shape.
pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<VlModel> {
    let config_path = dir.join(CONFIG_FILE);
    let config: VlConfig = read_json(&config_path)?;
    config.validate().map_err(in_file(&config_path))?;
    let tokenizer = load_tokenizer(&dir.join(TOKENIZER_FILE), config.decoder.vocab_size)?;
    let weights = dir.join(WEIGHTS_FILE);
    let vb = open_weights(std::slice::from_ref(&weights), dtype, device)?;
    build(dir.to_path_buf(), config, vb, tokenizer, &weights)
}

/// The three files of a vl model held in memory, e.g. embedded in a binary
/// with `include_bytes!`.
#[derive(Debug, Clone, Copy)]
pub struct ModelBytes<'a> {
    /// `config.json`.
    pub config: &'a [u8],
    /// `model.safetensors`.
    pub weights: &'a [u8],
    /// `tokenizer.json`.
    pub tokenizer: &'a [u8],
}

/// Loads a vl model from its files' bytes; `name` stands for the directory
/// in errors and in [`VlModel::path`].
pub fn load_bytes(
    name: &Path,
    files: ModelBytes,
    dtype: DType,
    device: &Device,
) -> Result<VlModel> {
    let config_path = name.join(CONFIG_FILE);
    let config: VlConfig = serde_json::from_slice(files.config).map_err(|source| Error::Json {
        path: config_path.clone(),
        source,
    })?;
    config.validate().map_err(in_file(&config_path))?;
    let tok_path = name.join(TOKENIZER_FILE);
    let text = std::str::from_utf8(files.tokenizer).map_err(|e| Error::Tokenizer {
        path: tok_path.clone(),
        reason: format!("not UTF-8: {e}"),
    })?;
    let tokenizer = parse_tokenizer(text, &tok_path, config.decoder.vocab_size)?;
    let weights = name.join(WEIGHTS_FILE);
    let vb = VarBuilder::from_buffered_safetensors(files.weights.to_vec(), dtype, device)
        .map_err(weights_error(&weights))?;
    build(name.to_path_buf(), config, vb, tokenizer, &weights)
}

fn build(
    path: PathBuf,
    config: VlConfig,
    vb: VarBuilder,
    tokenizer: tokenizers::Tokenizer,
    weights: &Path,
) -> Result<VlModel> {
    let decoder = VisionLanguageDecoder::load(vb.pp("decoder"), &config.decoder)
        .map_err(weights_error(weights))?;
    let vision = match &config.vision {
        None => None,
        Some(v) => Some(VisionEncoder::load(vb.pp("vision"), v).map_err(weights_error(weights))?),
    };
    let resampler = match &config.resampler {
        None => None,
        Some(r) => Some(Resampler::load(vb.pp("resampler"), r).map_err(weights_error(weights))?),
    };
    let generation =
        GenerationConfig::greedy(&config.decoder, config.decoder.max_position_embeddings - 1);
    Ok(VlModel {
        resampler,
        path,
        pixels: config.vision.as_ref().map(VisionConfig::pixel_spec),
        generation,
        format: ModelFormat::Vl,
        config,
        decoder,
        vision,
        tokenizer,
    })
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
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let config_path = dir.join(CONFIG_FILE);
    let json = serde_json::to_string_pretty(config).map_err(|source| Error::Json {
        path: config_path.clone(),
        source,
    })?;
    std::fs::write(&config_path, json + "\n").map_err(|source| Error::Io {
        path: config_path,
        source,
    })?;
    save_varmap(vars, &dir.join(WEIGHTS_FILE))?;
    let tok_path = dir.join(TOKENIZER_FILE);
    tokenizer
        .save(&tok_path, true)
        .map_err(|e| Error::Tokenizer {
            path: tok_path,
            reason: format!("cannot write: {e}"),
        })
}
