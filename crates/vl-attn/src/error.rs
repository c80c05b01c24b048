//! The error type of vl-attn.

use candle_core::{DType, Device};

/// Everything that can go wrong in vl-attn.
///
/// Messages name the argument, the expected and the actual value, so that a
/// caller can tell which of its inputs was wrong without reading our code.
#[derive(Debug, thiserror::Error)]
pub enum AttnError {
    /// A tensor argument has the wrong shape.
    #[error("{arg}: expected shape {expected}, got {actual:?}")]
    Shape {
        /// The argument, e.g. `"memory"`.
        arg: &'static str,
        /// The expected shape, in words, e.g. `"(batch, len, 512)"`.
        expected: String,
        /// The shape the caller passed.
        actual: Vec<usize>,
    },
    /// A tensor argument has another dtype than the one it must match.
    #[error("{arg}: dtype {actual:?} does not match {expected_from} dtype {expected:?}")]
    DType {
        /// The argument with the wrong dtype.
        arg: &'static str,
        /// Where the expected dtype came from, e.g. `"queries"`.
        expected_from: &'static str,
        /// The expected dtype.
        expected: DType,
        /// The dtype the caller passed.
        actual: DType,
    },
    /// A tensor argument lives on another device than the one it must match.
    #[error("{arg}: device {actual} does not match {expected_from} device {expected}")]
    Device {
        /// The argument on the wrong device.
        arg: &'static str,
        /// Where the expected device came from.
        expected_from: &'static str,
        /// The expected device, as text.
        expected: String,
        /// The device the caller passed, as text.
        actual: String,
    },
    /// A module configuration is impossible.
    #[error("invalid {module} config: {reason}")]
    Config {
        /// The module being built, e.g. `"CrossAttention"`.
        module: &'static str,
        /// What is wrong, with the values involved.
        reason: String,
    },
    /// An argument that is not a tensor is out of range.
    #[error("{arg}: {reason}")]
    Argument {
        /// The argument.
        arg: &'static str,
        /// What is wrong, with the values involved.
        reason: String,
    },
    /// A weight cannot be quantized to the asked format: its input width is
    /// not a multiple of the format's block size.
    #[error(
        "{layer}: cannot quantize weight ({out_dim}, {in_dim}) to {format}: \
         input width {in_dim} is not a multiple of the block size {block}"
    )]
    Quantize {
        /// The layer's path, e.g. `"blocks.1.cross_attn.k_proj"`.
        layer: String,
        /// The quantized format, e.g. `"Q4K"`.
        format: String,
        /// The weight's output width.
        out_dim: usize,
        /// The weight's input width.
        in_dim: usize,
        /// The format's block size.
        block: usize,
    },
    /// An error from candle itself.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl AttnError {
    /// Prefixes the layer path of a [`AttnError::Quantize`] with `scope`
    /// (`"k_proj"` within `"cross_attn"` becomes `"cross_attn.k_proj"`);
    /// other errors are returned unchanged.
    pub fn within(self, scope: &str) -> Self {
        match self {
            Self::Quantize {
                layer,
                format,
                out_dim,
                in_dim,
                block,
            } => Self::Quantize {
                layer: format!("{scope}.{layer}"),
                format,
                out_dim,
                in_dim,
                block,
            },
            other => other,
        }
    }
}

/// The result type of vl-attn.
pub type Result<T> = std::result::Result<T, AttnError>;

pub(crate) fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".to_string(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// Checks that `t` has `want` dtype and lives on `device`.
pub(crate) fn check_dtype_device(
    arg: &'static str,
    t: &candle_core::Tensor,
    expected_from: &'static str,
    want: DType,
    device: &Device,
) -> Result<()> {
    if t.dtype() != want {
        return Err(AttnError::DType {
            arg,
            expected_from,
            expected: want,
            actual: t.dtype(),
        });
    }
    if !t.device().same_device(device) {
        return Err(AttnError::Device {
            arg,
            expected_from,
            expected: device_name(device),
            actual: device_name(t.device()),
        });
    }
    Ok(())
}
