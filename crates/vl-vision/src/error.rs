//! The error type of vl-vision.

use std::path::PathBuf;

/// Everything that can go wrong in vl-vision.
///
/// Messages name the culprit — the config field, the image file, the
/// argument — with the expected and the actual value.
#[derive(Debug, thiserror::Error)]
pub enum VisionError {
    /// A configuration value is impossible.
    #[error("config: {field}: {reason}")]
    Config {
        /// The config field, as spelled in `config.json`.
        field: &'static str,
        /// What is wrong, with the values involved.
        reason: String,
    },
    /// An image file cannot be read, is not an image, or is unusable.
    #[error("{}: {reason}", path.display())]
    Image {
        /// The image file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// An argument is out of range (a pixel tensor of the wrong shape, an
    /// empty batch).
    #[error("{arg}: {reason}")]
    Argument {
        /// The argument, e.g. `pixels`.
        arg: &'static str,
        /// What is wrong, with the values involved.
        reason: String,
    },
    /// An error from the attention modules.
    #[error(transparent)]
    Attn(#[from] vl_attn::AttnError),
    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl VisionError {
    /// Prefixes the layer path of a quantization error with `scope` (see
    /// [`vl_attn::AttnError::within`]); other errors are unchanged.
    pub fn within(self, scope: &str) -> Self {
        match self {
            Self::Attn(e) => Self::Attn(e.within(scope)),
            other => other,
        }
    }
}

/// The result type of vl-vision.
pub type Result<T> = std::result::Result<T, VisionError>;

pub(crate) fn config_err<T>(field: &'static str, reason: impl Into<String>) -> Result<T> {
    Err(VisionError::Config {
        field,
        reason: reason.into(),
    })
}

pub(crate) fn arg_err<T>(arg: &'static str, reason: impl Into<String>) -> Result<T> {
    Err(VisionError::Argument {
        arg,
        reason: reason.into(),
    })
}
