//! The error type of vl-decoder.

/// Everything that can go wrong in vl-decoder.
///
/// Messages name the culprit — the config field, the argument — with the
/// expected and the actual value. File formats, images and tokenizers are
/// the business of the crates that read them (vl-vision, the `vl` crate's
/// `checkpoint` module).
#[derive(Debug, thiserror::Error)]
pub enum DecoderError {
    /// A configuration value is impossible.
    #[error("config: {field}: {reason}")]
    Config {
        /// The config field, as spelled in `config.json`.
        field: &'static str,
        /// What is wrong, with the values involved.
        reason: String,
    },
    /// An argument is out of range (a generation setting, a token id, a
    /// device name).
    #[error("{arg}: {reason}")]
    Argument {
        /// The argument, e.g. `num_beams`.
        arg: &'static str,
        /// What is wrong, with the values involved.
        reason: String,
    },
    /// A sequence would pass the model's last position.
    #[error("position {position} is past the model's max_position_embeddings {max}")]
    MaxPositions {
        /// The first position that does not exist.
        position: usize,
        /// The model's number of positions.
        max: usize,
    },
    /// An error from the attention modules.
    #[error(transparent)]
    Attn(#[from] vl_attn::AttnError),
    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl DecoderError {
    /// Prefixes the layer path of a quantization error with `scope` (see
    /// [`vl_attn::AttnError::within`]); other errors are unchanged.
    pub fn within(self, scope: &str) -> Self {
        match self {
            Self::Attn(e) => Self::Attn(e.within(scope)),
            other => other,
        }
    }
}

/// The result type of vl-decoder.
pub type Result<T> = std::result::Result<T, DecoderError>;

pub(crate) fn config_err<T>(field: &'static str, reason: impl Into<String>) -> Result<T> {
    Err(DecoderError::Config {
        field,
        reason: reason.into(),
    })
}

pub(crate) fn arg_err<T>(arg: &'static str, reason: impl Into<String>) -> Result<T> {
    Err(DecoderError::Argument {
        arg,
        reason: reason.into(),
    })
}
