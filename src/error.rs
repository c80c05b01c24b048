//! The error type of the `vl` crate: loading checkpoints, reading images and
//! tokenizers, and everything the workspace crates can report.

use std::path::{Path, PathBuf};

use vl_attn::AttnError;
use vl_decoder::DecoderError;
use vl_vision::VisionError;

use crate::checkpoint::safetensors::TensorIssue;

/// Everything that can go wrong in `vl`.
///
/// Messages name the culprit — the file, the tensor, the config field, the
/// argument — with the expected and the actual value.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration value is impossible.
    #[error("config: {field}: {reason}")]
    Config {
        /// The config field, as spelled in `config.json`.
        field: &'static str,
        /// What is wrong, with the values involved.
        reason: String,
    },
    /// An argument is out of range (a generation setting, a device name).
    #[error("{arg}: {reason}")]
    Argument {
        /// The argument, e.g. `num_beams` or `device`.
        arg: &'static str,
        /// What is wrong, with the values involved.
        reason: String,
    },
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A JSON file does not parse or has fields of the wrong type.
    #[error("{}: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The underlying error, with line and column.
        source: serde_json::Error,
    },
    /// A weights file is malformed, lacks a tensor, or has one of the wrong
    /// shape or dtype.
    #[error("{}: {reason}", path.display())]
    Weights {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the tensor and the expected vs found value.
        reason: String,
    },
    /// A tokenizer file is malformed or does not fit the model.
    #[error("{}: {reason}", path.display())]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A checkpoint of a kind vl does not load.
    #[error(
        "{}: {what} `{model_type}` is not supported; vl loads {}",
        path.display(),
        supported.join(", ")
    )]
    UnsupportedModel {
        /// The `config.json` that declares it.
        path: PathBuf,
        /// Which field: `model_type`, `decoder.model_type`, ….
        what: &'static str,
        /// The value found.
        model_type: String,
        /// What vl loads instead.
        supported: Vec<&'static str>,
    },
    /// An error from the decoder.
    #[error(transparent)]
    Decoder(#[from] DecoderError),
    /// An error from the vision encoders or image preprocessing.
    #[error(transparent)]
    Vision(#[from] VisionError),
    /// An error from the attention modules.
    #[error(transparent)]
    Attn(#[from] AttnError),
    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// The result type of `vl`.
pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn config_err<T>(field: &'static str, reason: impl Into<String>) -> Result<T> {
    Err(Error::Config {
        field,
        reason: reason.into(),
    })
}

/// Checks dropout probabilities read from a checkpoint's config with vl's
/// own rule ([`vl_attn::Dropout::new`]: `0 <= p < 1`), naming the first
/// field that breaks it.
pub(crate) fn check_dropouts(fields: &[(&'static str, f64)]) -> Result<()> {
    for &(field, p) in fields {
        if let Err(e) = vl_attn::Dropout::new(field, p) {
            let reason = match e {
                vl_attn::AttnError::Argument { reason, .. } => reason,
                other => other.to_string(),
            };
            return config_err(field, reason);
        }
    }
    Ok(())
}

pub(crate) fn arg_err<T>(arg: &'static str, reason: impl Into<String>) -> Result<T> {
    Err(Error::Argument {
        arg,
        reason: reason.into(),
    })
}

impl Error {
    /// The config or argument error inside, whichever crate raised it.
    fn config_parts(&self) -> Option<(&'static str, &str)> {
        match self {
            Self::Config { field, reason }
            | Self::Decoder(DecoderError::Config { field, reason })
            | Self::Vision(VisionError::Config { field, reason }) => Some((field, reason)),
            Self::Argument { arg, reason }
            | Self::Decoder(DecoderError::Argument { arg, reason })
            | Self::Vision(VisionError::Argument { arg, reason }) => Some((arg, reason)),
            _ => None,
        }
    }

    /// The candle error inside, whichever crate raised it.
    fn candle(&self) -> Option<&candle_core::Error> {
        match self {
            Self::Candle(c)
            | Self::Attn(AttnError::Candle(c))
            | Self::Decoder(DecoderError::Candle(c))
            | Self::Decoder(DecoderError::Attn(AttnError::Candle(c)))
            | Self::Vision(VisionError::Candle(c))
            | Self::Vision(VisionError::Attn(AttnError::Candle(c))) => Some(c),
            _ => None,
        }
    }
}

/// Adds the file to a config or argument error read from it: `config:
/// field: reason (in path)`.
pub fn in_file<E: Into<Error>>(path: &Path) -> impl Fn(E) -> Error + '_ {
    move |e| {
        let e = e.into();
        match e.config_parts() {
            Some((field, reason)) => Error::Config {
                field,
                reason: format!("{reason} (in {})", path.display()),
            },
            None => e,
        }
    }
}

/// Turns an error raised while a model took its tensors from a weights file
/// into [`Error::Weights`] naming `path`: the checked reader's own
/// [`TensorIssue`] (the tensor, expected vs found) when it raised it, the
/// candle error otherwise.
pub fn weights_error<E: Into<Error>>(path: &Path) -> impl Fn(E) -> Error + '_ {
    move |e| {
        let e = e.into();
        let Some(c) = e.candle() else {
            return e;
        };
        let reason = match TensorIssue::find(c) {
            Some(issue) => issue.to_string(),
            None => c.to_string(),
        };
        Error::Weights {
            path: path.to_path_buf(),
            reason,
        }
    }
}
