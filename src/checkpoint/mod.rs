//! Loading checkpoints onto vl's own modules: one owner, [`load()`], for
//! every format.
//!
//! [`load()`] runs one sequence whatever the checkpoint:
//!
//! 1. read `config.json` once and tell the format from its `model_type`
//!    ([`ModelFormat::of`]);
//! 2. the format's family file parses that config into vl's
//!    ([`VlConfig`]), with the generation defaults and the tokenizer —
//!    no weight read yet;
//! 3. open the weights once;
//! 4. build the vision side (encoder, resampler), then convert its linear
//!    layers as [`LoadOptions::quantization`] asks;
//! 5. build the decoder, each block converted as soon as it is built (the
//!    dense weights of one block at most beside the converted ones), then
//!    the LM head.
//!
//! Conversion goes through one [`Quantizer`](vl_attn::Quantizer) for every format, vl's own
//! and the embedded model included: a layer the format cannot hold falls
//! back to the next one that fits (`q4k` → `q8_0` → dense), and the load
//! says once which ([`VlModel::fallbacks`](crate::VlModel::fallbacks)).
//!
//! The sequence is in `load.rs`; the family files implement its `Family`
//! trait (`plan`, `vision`, `decoder`).
//!
//! | `model_type` | family file | what |
//! |---|---|---|
//! | `vl` | [`native`] | vl's own directories (the shipped shapes captioner) |
//! | `vision-encoder-decoder` | [`hf`] | transformers ViT/DeiT + GPT-2/TrOCR checkpoints |
//! | `blip` | [`hf::blip`] | transformers `BlipForConditionalGeneration` captioners |
//! | `florence2` | [`hf::florence2`] | Florence-2, transformers' layout or microsoft's original |
//!
//! Anything else is refused with [`Error::UnsupportedModel`], naming what
//! was found and what vl loads. The family files only map a format's names
//! and layouts onto vl's modules; the pieces every format shares live
//! beside them: [`safetensors`] (checked tensor-by-tensor reading),
//! [`tokenizer`].

pub mod hf;
mod load;
pub mod native;
pub mod safetensors;
pub mod tokenizer;

use std::path::Path;

pub use tokenizers::Tokenizer;

use crate::error::{Error, Result};

pub use load::{fallback_summary, load, LoadOptions, Source};
pub(crate) use load::{reported_fallbacks, BlockHook, Family, Plan};
pub use native::{ModelBytes, VlConfig};

/// The weights file of a model directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The config file of a model directory.
pub const CONFIG_FILE: &str = "config.json";
/// The tokenizer file of a model directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// The `model_type`s vl loads, as [`Error::UnsupportedModel`] lists them.
pub const SUPPORTED: &[&str] = &[
    "`vl` (vl's own directories)",
    "`vision-encoder-decoder` with a `vit`, `deit` or `donut-swin` encoder and a `gpt2`, `trocr` or `mbart` decoder",
    "`blip` (BlipForConditionalGeneration)",
    "`florence2` (Florence2ForConditionalGeneration, or microsoft's original Florence-2 layout)",
];

/// Reads a JSON file into `T`, naming the file in errors.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_json(text.as_bytes(), path)
}

/// Parses JSON bytes into `T`, naming `path` in errors.
pub fn parse_json<T: serde::de::DeserializeOwned>(bytes: &[u8], path: &Path) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|source| Error::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// A config already parsed into JSON, read into `T`, naming `path` in
/// errors.
pub(crate) fn from_value<T: serde::de::DeserializeOwned>(
    value: &serde_json::Value,
    path: &Path,
) -> Result<T> {
    T::deserialize(value).map_err(|source| Error::Json {
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
    /// A Florence-2 checkpoint (transformers' or microsoft's original
    /// layout): see [`hf::florence2`].
    Florence2,
}

impl ModelFormat {
    /// The format `config.json` in `dir` declares by its `model_type`.
    ///
    /// # Errors
    /// [`Error::Io`]/[`Error::Json`] for a missing or malformed
    /// `config.json`; [`Error::UnsupportedModel`] for a `model_type` vl
    /// does not load (or none).
    pub fn detect(dir: &Path) -> Result<Self> {
        let path = dir.join(CONFIG_FILE);
        Self::of(&read_json(&path)?, &path)
    }

    /// The format a parsed `config.json` (read from `path`) declares.
    ///
    /// # Errors
    /// As [`ModelFormat::detect`].
    pub fn of(config: &serde_json::Value, path: &Path) -> Result<Self> {
        let model_type = config.get("model_type");
        match model_type.and_then(|v| v.as_str()) {
            Some(native::MODEL_TYPE) => Ok(Self::Vl),
            Some(hf::MODEL_TYPE) => Ok(Self::VisionEncoderDecoder),
            Some(hf::blip::MODEL_TYPE) => Ok(Self::Blip),
            Some(hf::florence2::MODEL_TYPE) => Ok(Self::Florence2),
            other => Err(Error::UnsupportedModel {
                path: path.to_path_buf(),
                what: "model_type",
                model_type: match (other, model_type) {
                    (Some(t), _) => t.to_string(),
                    (None, Some(v)) => v.to_string(),
                    (None, None) => "(none)".into(),
                },
                supported: SUPPORTED.to_vec(),
            }),
        }
    }
}
