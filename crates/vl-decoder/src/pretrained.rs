//! A vl model directory:
//!
//! - `config.json`: `{"model_type": "vl", "decoder": {…DecoderConfig…},
//!   "vision": {"kind": "mock_vit", …} | null}`
//! - `model.safetensors`: the decoder's tensors under `decoder.`, the vision
//!   encoder's (if it has any) under `vision.`; memory-mapped at load
//! - `tokenizer.json`: a tokenizers-crate tokenizer covering every id

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use candle_nn::VarMap;
use serde::{Deserialize, Serialize};

use crate::config::DecoderConfig;
use crate::dir::{
    load_tokenizer, mmap_weights, read_json, save_varmap, weights_error, CONFIG_FILE,
    TOKENIZER_FILE, WEIGHTS_FILE,
};
use crate::error::{config_err, DecoderError, Result};
use crate::mock_vit::{MockVit, MockVitConfig};
use crate::model::VisionLanguageDecoder;

/// The `model_type` of a vl model directory.
pub const MODEL_TYPE: &str = "vl";

/// The vision encoder of a model directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum VisionConfig {
    /// The seeded, weightless [`MockVit`].
    MockVit(MockVitConfig),
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
        match &self.vision {
            Some(VisionConfig::MockVit(v)) => {
                v.validate()?;
                if v.hidden_size != self.decoder.memory_dim {
                    return config_err(
                        "vision.hidden_size",
                        format!(
                            "{} does not match decoder.memory_dim {}",
                            v.hidden_size, self.decoder.memory_dim
                        ),
                    );
                }
                Ok(())
            }
            None => Ok(()),
        }
    }
}

/// A vision encoder.
#[derive(Debug, Clone)]
pub enum VisionEncoder {
    /// The mock encoder.
    MockVit(MockVit),
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
}

impl VlModel {
    /// Loads `dir` onto `device` in `dtype`. Errors name the file and, for
    /// weights, the tensor with the expected and found shape.
    pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        if !dir.is_dir() {
            return Err(DecoderError::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "not a model directory"),
            });
        }
        let config_path = dir.join(CONFIG_FILE);
        let config: VlConfig = read_json(&config_path)?;
        config.validate().map_err(|e| match e {
            DecoderError::Config { field, reason } => DecoderError::Config {
                field,
                reason: format!("{reason} (in {})", config_path.display()),
            },
            other => other,
        })?;
        let tokenizer = load_tokenizer(&dir.join(TOKENIZER_FILE), config.decoder.vocab_size)?;
        let weights = dir.join(WEIGHTS_FILE);
        let vb = mmap_weights(std::slice::from_ref(&weights), dtype, device)?;
        let decoder = VisionLanguageDecoder::load(vb.pp("decoder"), &config.decoder)
            .map_err(|e| weights_error(&weights, e))?;
        let vision = match &config.vision {
            None => None,
            Some(VisionConfig::MockVit(v)) => {
                Some(VisionEncoder::MockVit(MockVit::new(v, dtype, device)?))
            }
        };
        Ok(Self {
            path: dir.to_path_buf(),
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
