//! A vl model directory:
//!
//! - `config.json`: `{"model_type": "vl", "decoder": {…DecoderConfig…},
//!   "vision": {"kind": "mock_vit", …} | null}`
//! - `model.safetensors`: the decoder's tensors under `decoder.`, the vision
//!   encoder's (if it has any) under `vision.`; read tensor by tensor at load
//! - `tokenizer.json`: a tokenizers-crate tokenizer covering every id

use std::path::Path;

use candle_nn::{VarBuilder, VarMap};
use serde::{Deserialize, Serialize};
use vl_attn::{Quantization, Resampler, ResamplerConfig};
use vl_decoder::{
    DecoderConfig, GenerationConfig, TextEncoder, TextEncoderConfig, VisionLanguageDecoder,
};
use vl_vision::{VisionConfig, VisionEncoder};

use super::tokenizer::{load_tokenizer, parse_tokenizer};
use super::{
    from_value, BlockHook, Family, ModelFormat, Plan, Source, CONFIG_FILE, TOKENIZER_FILE,
    WEIGHTS_FILE,
};
use crate::error::{in_file, Error, Result};

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
    /// The format the linear layers are converted to at load (default
    /// `none`): a model saved after conversion ([`crate::VlModel::save`])
    /// holds the values its converted layers compute with and says which
    /// format gives them back.
    #[serde(default, skip_serializing_if = "Quantization::is_none")]
    pub quantization: Quantization,
    /// The generation defaults (default: greedy, as many tokens as the
    /// positions allow); [`crate::VlModel::save`] writes a checkpoint's own
    /// (a transformers checkpoint's beams and lengths).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<GenerationConfig>,
    /// A text encoder between the vision side and the decoder (Florence-2's
    /// BART encoder): it reads the image tokens and the prompt, and the
    /// decoder's cross-attention reads its output; weights under
    /// `text_encoder.`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_encoder: Option<TextEncoderConfig>,
    /// The tasks' post-processing settings of a model prompted by task
    /// (Florence-2; see [`crate::tasks`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks: Option<crate::tasks::TaskConfig>,
    /// The document processor whose prompt and output handling the model
    /// takes (Donut, Nougat; see [`crate::donut::Reader`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reader: Option<crate::donut::Reader>,
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
        if let Some(t) = &self.tasks {
            t.validate()?;
        }
        if let Some(te) = &self.text_encoder {
            te.validate()?;
            if te.hidden_size != self.decoder.memory_dim {
                return Err(Error::Config {
                    field: "text_encoder.hidden_size",
                    reason: format!(
                        "{} does not match decoder.memory_dim {}",
                        te.hidden_size, self.decoder.memory_dim
                    ),
                });
            }
            if te.vocab_size != self.decoder.vocab_size && te.shares_decoder_embeddings {
                return Err(Error::Config {
                    field: "text_encoder.vocab_size",
                    reason: format!(
                        "{} does not match the decoder's vocab_size {} whose table it shares",
                        te.vocab_size, self.decoder.vocab_size
                    ),
                });
            }
        }
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
        // With a text encoder, the image tokens are its input.
        let (reads, reader) = match &self.text_encoder {
            Some(te) => (te.hidden_size, "text_encoder.hidden_size"),
            None => (self.decoder.memory_dim, "decoder.memory_dim"),
        };
        if image_width != reads {
            return Err(Error::Config {
                field: if self.resampler.is_some() {
                    "resampler.width"
                } else {
                    "vision.hidden_size"
                },
                reason: format!("{image_width} does not match {reader} {reads}"),
            });
        }
        Ok(())
    }
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

/// vl's own directories as a [`Family`]: the config is vl's already, and
/// the tensors carry vl's names.
pub(crate) struct Native;

impl Family for Native {
    const FORMAT: ModelFormat = ModelFormat::Vl;

    fn plan(source: &Source, config: &serde_json::Value) -> Result<Plan<Self>> {
        let config_path = source.path(CONFIG_FILE);
        let config: VlConfig = from_value(config, &config_path)?;
        config.validate().map_err(in_file(&config_path))?;
        let tok_path = source.path(TOKENIZER_FILE);
        let vocab = config.decoder.vocab_size;
        let tokenizer = match source {
            Source::Dir(_) => load_tokenizer(&tok_path, vocab)?,
            Source::Memory { files, .. } => {
                let text = std::str::from_utf8(files.tokenizer).map_err(|e| Error::Tokenizer {
                    path: tok_path.clone(),
                    reason: format!("not UTF-8: {e}"),
                })?;
                parse_tokenizer(text, &tok_path, vocab)?
            }
        };
        let generation = match &config.generation {
            Some(g) => {
                g.validate().map_err(in_file(&config_path))?;
                g.check_ids(vocab).map_err(in_file(&config_path))?;
                g.clone()
            }
            None => GenerationConfig::greedy(
                &config.decoder,
                config.decoder.max_position_embeddings - 1,
            ),
        };
        Ok(Plan {
            family: Native,
            config,
            generation,
            tokenizer,
        })
    }

    fn vision(
        &self,
        vb: &VarBuilder,
        config: &VlConfig,
    ) -> Result<Option<(VisionEncoder, Option<Resampler>)>> {
        let Some(v) = &config.vision else {
            return Ok(None);
        };
        let encoder = VisionEncoder::load(vb.pp("vision"), v)?;
        let resampler = match &config.resampler {
            None => None,
            Some(r) => Some(Resampler::load(vb.pp("resampler"), r)?),
        };
        Ok(Some((encoder, resampler)))
    }

    /// All blocks at once: vl's own models are small, and [`super::load()`]
    /// converts them after.
    fn decoder(
        &self,
        vb: &VarBuilder,
        config: &VlConfig,
        _: &mut BlockHook,
    ) -> Result<VisionLanguageDecoder> {
        Ok(VisionLanguageDecoder::load(
            vb.pp("decoder"),
            &config.decoder,
        )?)
    }

    fn text_encoder(
        &self,
        vb: &VarBuilder,
        config: &VlConfig,
        decoder: &VisionLanguageDecoder,
    ) -> Result<Option<TextEncoder>> {
        match &config.text_encoder {
            None => Ok(None),
            Some(c) => Ok(Some(TextEncoder::load(
                vb.pp("text_encoder"),
                c,
                decoder.token_table(),
            )?)),
        }
    }
}

/// Writes a model directory: `config`, the variables of `vars` (named
/// `decoder.…` and `vision.…`), and `tokenizer` — how a model trained here
/// is written (any loaded model: [`crate::VlModel::save`]).
pub fn save(
    dir: &Path,
    config: &VlConfig,
    vars: &VarMap,
    tokenizer: &tokenizers::Tokenizer,
) -> Result<()> {
    let weights = dir.join(WEIGHTS_FILE);
    let data = vars.data().lock().map_err(|_| Error::Weights {
        path: weights.clone(),
        reason: "the variable map's lock is poisoned".into(),
    })?;
    let tensors = data
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect();
    drop(data);
    write_dir(dir, config, &tensors, tokenizer)
}

/// Writes `config.json`, `model.safetensors` (`tensors`) and
/// `tokenizer.json` into `dir`, created if missing.
pub(crate) fn write_dir(
    dir: &Path,
    config: &VlConfig,
    tensors: &std::collections::BTreeMap<String, candle_core::Tensor>,
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
    let weights = dir.join(WEIGHTS_FILE);
    let tensors: std::collections::HashMap<&str, candle_core::Tensor> = tensors
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    candle_core::safetensors::save(&tensors, &weights).map_err(|e| Error::Weights {
        path: weights,
        reason: format!("cannot write: {e}"),
    })?;
    let tok_path = dir.join(TOKENIZER_FILE);
    tokenizer
        .save(&tok_path, true)
        .map_err(|e| Error::Tokenizer {
            path: tok_path,
            reason: format!("cannot write: {e}"),
        })
}
