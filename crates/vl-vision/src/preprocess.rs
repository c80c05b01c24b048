//! Images in, normalised pixel tensors out: any common format, mode (gray,
//! RGBA, 16-bit) and size is converted to the model's RGB input.

use std::ops::Deref;
use std::path::Path;

use candle_core::{Device, Tensor};
use image::imageops::FilterType;
use image::{DynamicImage, ImageBuffer, ImageReader, Limits, Rgb, RgbImage};

use crate::error::{arg_err, Result, VisionError};

/// How an image is resized to the encoder's input size (transformers'
/// `resample`, PIL's filter numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Resample {
    /// PIL `NEAREST` (0).
    Nearest,
    /// PIL `BILINEAR` (2): a triangle filter, widened when shrinking.
    #[default]
    Bilinear,
    /// PIL `BICUBIC` (3): Catmull-Rom.
    Bicubic,
    /// PIL `LANCZOS` (1): Lanczos with a window of 3.
    Lanczos,
}

impl Resample {
    /// The filter of PIL's number for it (transformers' `resample`), `None`
    /// for numbers without an equivalent here (BOX 4, HAMMING 5).
    pub fn from_pil(code: u32) -> Option<Self> {
        match code {
            0 => Some(Self::Nearest),
            1 => Some(Self::Lanczos),
            2 => Some(Self::Bilinear),
            3 => Some(Self::Bicubic),
            _ => None,
        }
    }

    fn filter(self) -> FilterType {
        match self {
            Self::Nearest => FilterType::Nearest,
            Self::Bilinear => FilterType::Triangle,
            Self::Bicubic => FilterType::CatmullRom,
            Self::Lanczos => FilterType::Lanczos3,
        }
    }
}

/// What the encoder expects of its pixels: transformers' image processor
/// steps (resize, rescale, normalise), in that order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PixelSpec {
    /// Height and width after resizing.
    pub image_size: usize,
    /// Per-channel mean of rescaled pixels.
    pub mean: [f32; 3],
    /// Per-channel std.
    pub std: [f32; 3],
    /// Pixel values (0..=255) are multiplied by this first (1/255 scales to
    /// [0, 1]; 1.0 is transformers' `do_rescale = false`).
    pub rescale_factor: f32,
    /// The resize filter.
    pub resample: Resample,
    /// Whether images of another size are resized; when false, they must
    /// already be `image_size` square.
    pub resize: bool,
}

impl PixelSpec {
    /// Resize with a bilinear filter, scale to [0, 1], normalise by `mean`
    /// and `std`.
    pub fn new(image_size: usize, mean: [f32; 3], std: [f32; 3]) -> Self {
        Self {
            image_size,
            mean,
            std,
            rescale_factor: 1.0 / 255.0,
            resample: Resample::Bilinear,
            resize: true,
        }
    }
}

impl PixelSpec {
    /// `img` as RGB at the encoder's input size, resized with the model's
    /// own filter (what [`preprocess`] normalises, and what a heatmap is
    /// drawn over).
    ///
    /// # Errors
    /// [`VisionError::Argument`] naming `image` when the image has another
    /// size and the spec does not resize.
    pub fn resized(&self, img: &DynamicImage) -> Result<RgbImage> {
        let rgb = img.to_rgb8();
        Ok(self.resize_rgb(&rgb)?.unwrap_or(rgb))
    }

    /// `rgb` resized to the encoder's input size, `None` when it has that
    /// size already (nothing to copy).
    fn resize_rgb<C>(&self, rgb: &ImageBuffer<Rgb<u8>, C>) -> Result<Option<RgbImage>>
    where
        C: Deref<Target = [u8]>,
    {
        let s = self.image_size as u32;
        if rgb.dimensions() == (s, s) {
            Ok(None)
        } else if self.resize {
            Ok(Some(image::imageops::resize(
                rgb,
                s,
                s,
                self.resample.filter(),
            )))
        } else {
            arg_err(
                "image",
                format!(
                    "is {}x{}, but the model takes {s}x{s} and its preprocessor does not resize",
                    rgb.width(),
                    rgb.height()
                ),
            )
        }
    }
}

/// RGB pixels borrowed from elsewhere (another library's array, a frame
/// buffer): `height` rows of `width` RGB triples, read in place.
pub type RgbView<'a> = ImageBuffer<Rgb<u8>, &'a [u8]>;

/// The largest width or height accepted, in pixels; a larger header is
/// refused before any pixel is decoded.
pub const MAX_IMAGE_SIDE: u32 = 16_384;

/// The most memory one decode may allocate, in bytes.
pub const MAX_IMAGE_ALLOC: u64 = 1 << 30;

fn image_err(path: &Path, reason: impl Into<String>) -> VisionError {
    VisionError::Image {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// The width and height in a PNG's `IHDR` chunk, read without a decoder:
/// for reporting a header the decoder refuses.
fn png_header_size(bytes: &[u8]) -> Option<(u32, u32)> {
    let ihdr = bytes.strip_prefix(b"\x89PNG\r\n\x1a\n")?.get(4..16)?;
    let (kind, size) = ihdr.split_at(4);
    let (w, h) = size.split_at(4);
    (kind == b"IHDR").then_some((
        u32::from_be_bytes(w.try_into().ok()?),
        u32::from_be_bytes(h.try_into().ok()?),
    ))
}

/// Reads and decodes an image file with [`decode_image`]. Files larger than
/// [`MAX_IMAGE_ALLOC`] are refused without being read to the end.
pub fn load_image(path: &Path) -> Result<DynamicImage> {
    use std::io::Read;
    let file =
        std::fs::File::open(path).map_err(|e| image_err(path, format!("cannot open: {e}")))?;
    let mut bytes = Vec::new();
    file.take(MAX_IMAGE_ALLOC + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| image_err(path, format!("cannot read: {e}")))?;
    if bytes.len() as u64 > MAX_IMAGE_ALLOC {
        return Err(image_err(
            path,
            format!("is larger than {MAX_IMAGE_ALLOC} bytes"),
        ));
    }
    decode_image(&bytes, path)
}

/// Decodes an image from its bytes, guessing the format from its content,
/// with limits on size ([`MAX_IMAGE_SIDE`]) and memory ([`MAX_IMAGE_ALLOC`]).
/// `name` is the file the bytes came from, named in errors.
pub fn decode_image(bytes: &[u8], name: &Path) -> Result<DynamicImage> {
    let mut reader = ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| image_err(name, format!("cannot read: {e}")))?;
    let Some(format) = reader.format() else {
        return Err(image_err(name, "not an image (unknown format)"));
    };
    // The header's size first, so that an impossible one is reported with
    // its numbers rather than as a decoder's limit or format error.
    let (width, height) = ImageReader::with_format(std::io::Cursor::new(bytes), format)
        .into_dimensions()
        .map_err(|e| match png_header_size(bytes) {
            Some((w, h)) if w == 0 || h == 0 => {
                image_err(name, format!("has no pixels (its header says {w}x{h})"))
            }
            _ => image_err(name, format!("cannot decode: {e}")),
        })?;
    if width == 0 || height == 0 {
        return Err(image_err(
            name,
            format!("has no pixels (its header says {width}x{height})"),
        ));
    }
    if width > MAX_IMAGE_SIDE || height > MAX_IMAGE_SIDE {
        return Err(image_err(
            name,
            format!(
                "is {width}x{height}, larger than the {MAX_IMAGE_SIDE} pixels per side accepted"
            ),
        ));
    }
    let mut limits = Limits::default();
    limits.max_image_width = Some(MAX_IMAGE_SIDE);
    limits.max_image_height = Some(MAX_IMAGE_SIDE);
    limits.max_alloc = Some(MAX_IMAGE_ALLOC);
    reader.limits(limits);
    let img = reader
        .decode()
        .map_err(|e| image_err(name, format!("cannot decode: {e}")))?;
    if img.width() == 0 || img.height() == 0 {
        return Err(image_err(
            name,
            format!("has no pixels ({}x{})", img.width(), img.height()),
        ));
    }
    Ok(img)
}

/// Converts an image to the encoder's input: RGB (alpha dropped, gray
/// replicated, 16-bit scaled to 8), resized to `image_size` square with the
/// spec's filter when its size differs, multiplied by `rescale_factor`,
/// normalised by the spec's mean and std.
///
/// # Shapes
/// Returns `(3, image_size, image_size)` f32.
pub fn preprocess(img: &DynamicImage, cfg: &PixelSpec, device: &Device) -> Result<Tensor> {
    match img {
        // Read in place; other modes are converted first.
        DynamicImage::ImageRgb8(rgb) => preprocess_rgb(rgb, cfg, device),
        other => preprocess_rgb(&other.to_rgb8(), cfg, device),
    }
}

/// [`preprocess`] of RGB pixels in any container (an owned image, an
/// [`RgbView`] of borrowed memory): read in place when they have the
/// model's size already, else resized into a new buffer.
///
/// # Shapes
/// Returns `(3, image_size, image_size)` f32.
///
/// # Errors
/// As [`PixelSpec::resized`].
pub fn preprocess_rgb<C>(
    rgb: &ImageBuffer<Rgb<u8>, C>,
    cfg: &PixelSpec,
    device: &Device,
) -> Result<Tensor>
where
    C: Deref<Target = [u8]>,
{
    let resized = cfg.resize_rgb(rgb)?;
    let raw: &[u8] = match &resized {
        Some(r) => r.as_raw(),
        None => &rgb.as_raw()[..3 * rgb.width() as usize * rgb.height() as usize],
    };
    let n = cfg.image_size * cfg.image_size;
    let mut data = vec![0f32; 3 * n];
    for (i, px) in raw.chunks_exact(3).enumerate() {
        for c in 0..3 {
            data[c * n + i] = (px[c] as f32 * cfg.rescale_factor - cfg.mean[c]) / cfg.std[c];
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
