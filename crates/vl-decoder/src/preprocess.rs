//! Images in, normalised pixel tensors out: any common format, mode (gray,
//! RGBA, 16-bit) and size is converted to the model's RGB input.

use std::path::Path;

use candle_core::{Device, Tensor};
use image::imageops::FilterType;
use image::{DynamicImage, ImageReader, Limits};

use crate::error::{DecoderError, Result};

/// What the encoder expects of its pixels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PixelSpec {
    /// Height and width after resizing.
    pub image_size: usize,
    /// Per-channel mean of pixels scaled to [0, 1].
    pub mean: [f32; 3],
    /// Per-channel std.
    pub std: [f32; 3],
}

/// The largest width or height accepted, in pixels; a larger header is
/// refused before any pixel is decoded.
pub const MAX_IMAGE_SIDE: u32 = 16_384;

/// The most memory one decode may allocate, in bytes.
pub const MAX_IMAGE_ALLOC: u64 = 1 << 30;

fn image_err(path: &Path, reason: impl Into<String>) -> DecoderError {
    DecoderError::Image {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Reads and decodes an image file, guessing the format from its content,
/// with limits on size and memory.
pub fn load_image(path: &Path) -> Result<DynamicImage> {
    let mut reader = ImageReader::open(path)
        .map_err(|e| image_err(path, format!("cannot open: {e}")))?
        .with_guessed_format()
        .map_err(|e| image_err(path, format!("cannot read: {e}")))?;
    if reader.format().is_none() {
        return Err(image_err(path, "not an image (unknown format)"));
    }
    let mut limits = Limits::default();
    limits.max_image_width = Some(MAX_IMAGE_SIDE);
    limits.max_image_height = Some(MAX_IMAGE_SIDE);
    limits.max_alloc = Some(MAX_IMAGE_ALLOC);
    reader.limits(limits);
    let img = reader
        .decode()
        .map_err(|e| image_err(path, format!("cannot decode: {e}")))?;
    if img.width() == 0 || img.height() == 0 {
        return Err(image_err(
            path,
            format!("has no pixels ({}x{})", img.width(), img.height()),
        ));
    }
    Ok(img)
}

/// Converts an image to the encoder's input: RGB (alpha dropped, gray
/// replicated, 16-bit scaled to 8), resized to `image_size` square with a
/// triangle filter when its size differs, scaled to [0, 1], normalised by
/// the config's mean and std.
///
/// # Shapes
/// Returns `(3, image_size, image_size)` f32.
pub fn preprocess(img: &DynamicImage, cfg: &PixelSpec, device: &Device) -> Result<Tensor> {
    let s = cfg.image_size as u32;
    let rgb = img.to_rgb8();
    let rgb = if rgb.dimensions() == (s, s) {
        rgb
    } else {
        image::imageops::resize(&rgb, s, s, FilterType::Triangle)
    };
    let n = (s * s) as usize;
    let mut data = vec![0f32; 3 * n];
    for (i, px) in rgb.pixels().enumerate() {
        for c in 0..3 {
            data[c * n + i] = (px[c] as f32 / 255.0 - cfg.mean[c]) / cfg.std[c];
        }
    }
    Ok(Tensor::from_vec(
        data,
        (3, cfg.image_size, cfg.image_size),
        device,
    )?)
}

/// Preprocesses a batch.
///
/// # Shapes
/// Returns `(batch, 3, image_size, image_size)` f32.
pub fn preprocess_batch(
    images: &[&DynamicImage],
    cfg: &PixelSpec,
    device: &Device,
) -> Result<Tensor> {
    let each = images
        .iter()
        .map(|img| preprocess(img, cfg, device))
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::stack(&each, 0)?)
}
