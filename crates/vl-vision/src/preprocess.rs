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

/// The document processors' geometry (transformers' `DonutImageProcessor`
/// and `NougatImageProcessor`): each step on when its flag is, in this
/// order, before rescaling and normalising.
///
/// 1. `crop_margin` (Nougat): the image cropped to the bounding box of its
///    dark pixels (gray level below 200 after stretching the gray range to
///    0..=255); an image of one gray level is kept whole;
/// 2. `align_long_axis`: rotated 90° clockwise when its long side lies
///    across the input's;
/// 3. `resize`: scaled, aspect ratio kept, so that its shorter side is the
///    input's shorter side (the longer side truncated to whole pixels);
/// 4. `thumbnail` (a filter): scaled down, aspect ratio kept, to fit
///    inside the input (only when it does not), with that filter (Donut's
///    processor uses its own `resample`, Nougat's bicubic);
/// 5. `pad`: zero pixels (before normalising) added around it, half of
///    the difference on each side (the odd pixel right and bottom), to the
///    input's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct DocumentFit {
    /// Crop to the content first (Nougat's `do_crop_margin`).
    #[serde(default)]
    pub crop_margin: bool,
    /// `do_align_long_axis`.
    #[serde(default)]
    pub align_long_axis: bool,
    /// `do_thumbnail`, with the filter it resizes with.
    #[serde(default)]
    pub thumbnail: Option<Resample>,
    /// `do_pad`.
    #[serde(default)]
    pub pad: bool,
}

/// What the encoder expects of its pixels: transformers' image processor
/// steps (resize, rescale, normalise), in that order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PixelSpec {
    /// Height of the encoder's input.
    pub height: usize,
    /// Width of the encoder's input.
    pub width: usize,
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
    /// already be the input's size (after the document steps, if any).
    pub resize: bool,
    /// `None`: resized to the input's size whatever their aspect ratio (ViT's
    /// processors); else the document processors' steps.
    pub document: Option<DocumentFit>,
}

impl PixelSpec {
    /// A square input of side `image_size`: resize with a bilinear filter,
    /// scale to [0, 1], normalise by `mean` and `std`.
    pub fn new(image_size: usize, mean: [f32; 3], std: [f32; 3]) -> Self {
        Self {
            height: image_size,
            width: image_size,
            mean,
            std,
            rescale_factor: 1.0 / 255.0,
            resample: Resample::Bilinear,
            resize: true,
            document: None,
        }
    }

    /// `(height, width)` of the encoder's input.
    pub fn size(&self) -> (usize, usize) {
        (self.height, self.width)
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

    /// `rgb` brought to the encoder's input size, `None` when it has that
    /// size already and no step changes it (nothing to copy).
    fn resize_rgb<C>(&self, rgb: &ImageBuffer<Rgb<u8>, C>) -> Result<Option<RgbImage>>
    where
        C: Deref<Target = [u8]>,
    {
        if let Some(fit) = self.document {
            return self.fit_document(rgb, fit).map(Some);
        }
        let (w, h) = (self.width as u32, self.height as u32);
        if rgb.dimensions() == (w, h) {
            Ok(None)
        } else if self.resize {
            Ok(Some(image::imageops::resize(
                rgb,
                w,
                h,
                self.resample.filter(),
            )))
        } else {
            self.size_err(rgb.width(), rgb.height())
        }
    }

    fn size_err<T>(&self, w: u32, h: u32) -> Result<T> {
        arg_err(
            "image",
            format!(
                "is {w}x{h}, but the model takes {}x{} and its preprocessor does not resize",
                self.width, self.height
            ),
        )
    }

    /// [`DocumentFit`]'s steps, in its order.
    fn fit_document<C>(&self, rgb: &ImageBuffer<Rgb<u8>, C>, fit: DocumentFit) -> Result<RgbImage>
    where
        C: Deref<Target = [u8]>,
    {
        let (out_w, out_h) = (self.width as u32, self.height as u32);
        let mut img: RgbImage = ImageBuffer::from_raw(
            rgb.width(),
            rgb.height(),
            rgb.as_raw()[..3 * rgb.width() as usize * rgb.height() as usize].to_vec(),
        )
        .expect("a buffer of the image's own size");
        if fit.crop_margin {
            img = crop_margin(img);
        }
        if fit.align_long_axis {
            let (w, h) = img.dimensions();
            if (out_w < out_h && w > h) || (out_w > out_h && w < h) {
                img = image::imageops::rotate90(&img);
            }
        }
        if self.resize {
            // transformers' get_resize_output_image_size(default_to_square
            // = False): the shorter side to the input's shorter side.
            let short_to = out_w.min(out_h) as u64;
            let (w, h) = (img.width() as u64, img.height() as u64);
            let (nw, nh) = if w <= h {
                (short_to, short_to * h / w)
            } else {
                (short_to * w / h, short_to)
            };
            if (nw, nh) != (w, h) {
                img = image::imageops::resize(&img, nw as u32, nh as u32, self.resample.filter());
            }
        }
        if let Some(filter) = fit.thumbnail {
            let (w, h) = img.dimensions();
            let (mut tw, mut th) = (w.min(out_w), h.min(out_h));
            if (tw, th) != (w, h) {
                if h > w {
                    tw = (w as u64 * th as u64 / h as u64) as u32;
                } else if w > h {
                    th = (h as u64 * tw as u64 / w as u64) as u32;
                }
                img = image::imageops::resize(&img, tw.max(1), th.max(1), filter.filter());
            }
        }
        if fit.pad {
            let (w, h) = img.dimensions();
            if w <= out_w && h <= out_h && (w, h) != (out_w, out_h) {
                let mut canvas = RgbImage::new(out_w, out_h);
                let (left, top) = ((out_w - w) / 2, (out_h - h) / 2);
                image::imageops::replace(&mut canvas, &img, left.into(), top.into());
                img = canvas;
            }
        }
        if img.dimensions() != (out_w, out_h) {
            return arg_err(
                "image",
                format!(
                    "is {}x{} after the document steps ({fit:?}, resize {}), but the model takes {out_w}x{out_h}",
                    img.width(),
                    img.height(),
                    self.resize
                ),
            );
        }
        Ok(img)
    }
}

/// Nougat's `crop_margin`: the image cut to the bounding box of the pixels
/// darker than 200 once the gray range is stretched to 0..=255 (gray as
/// PIL's `convert("L")`: `(R·299 + G·587 + B·114 + 500) / 1000`); kept
/// whole when it is one gray level or has no such pixel.
fn crop_margin(img: RgbImage) -> RgbImage {
    let gray: Vec<u8> = img
        .pixels()
        .map(|p| {
            let [r, g, b] = p.0;
            ((r as u32 * 19595 + g as u32 * 38470 + b as u32 * 7471 + 0x8000) >> 16) as u8
        })
        .collect();
    let (Some(&lo), Some(&hi)) = (gray.iter().min(), gray.iter().max()) else {
        return img;
    };
    if lo == hi {
        return img;
    }
    let (w, h) = img.dimensions();
    let (mut x0, mut y0, mut x1, mut y1) = (u32::MAX, u32::MAX, 0, 0);
    let range = (hi - lo) as f64;
    for (i, &g) in gray.iter().enumerate() {
        if ((g - lo) as f64 / range * 255.0) < 200.0 {
            let (x, y) = (i as u32 % w, i as u32 / w);
            x0 = x0.min(x);
            y0 = y0.min(y);
            x1 = x1.max(x);
            y1 = y1.max(y);
        }
    }
    if x0 == u32::MAX || (x0, y0, x1, y1) == (0, 0, w - 1, h - 1) {
        return img;
    }
    image::imageops::crop_imm(&img, x0, y0, x1 - x0 + 1, y1 - y0 + 1).to_image()
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
    let n = cfg.height * cfg.width;
    let mut data = vec![0f32; 3 * n];
    for (i, px) in raw.chunks_exact(3).enumerate() {
        for c in 0..3 {
            data[c * n + i] = (px[c] as f32 * cfg.rescale_factor - cfg.mean[c]) / cfg.std[c];
        }
    }
    Ok(Tensor::from_vec(data, (3, cfg.height, cfg.width), device)?)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(height: usize, width: usize, fit: DocumentFit) -> PixelSpec {
        PixelSpec {
            height,
            width,
            document: Some(fit),
            ..PixelSpec::new(height, [0.0; 3], [1.0; 3])
        }
    }

    /// An image whose pixel (x, y) is (x, y, 7).
    fn coords(w: u32, h: u32) -> RgbImage {
        RgbImage::from_fn(w, h, |x, y| Rgb([x as u8, y as u8, 7]))
    }

    #[test]
    fn a_wide_image_turns_clockwise_for_a_tall_input_then_pads() -> Result<()> {
        let fit = DocumentFit {
            align_long_axis: true,
            pad: true,
            ..DocumentFit::default()
        };
        // 6 wide, 4 tall -> rotated to 4x6 -> padded to 4x8 (one row each
        // side).
        let out = spec(8, 4, fit).resized(&DynamicImage::ImageRgb8(coords(6, 4)))?;
        assert_eq!(out.dimensions(), (4, 8));
        // np.rot90(k=3): the old bottom-left corner comes first.
        assert_eq!(out.get_pixel(0, 1).0, [0, 3, 7]);
        assert_eq!(out.get_pixel(3, 1).0, [0, 0, 7]);
        assert_eq!(out.get_pixel(0, 6).0, [5, 3, 7]);
        assert_eq!(out.get_pixel(0, 0).0, [0, 0, 0], "padding is zero");
        assert_eq!(out.get_pixel(0, 7).0, [0, 0, 0]);
        Ok(())
    }

    #[test]
    fn padding_puts_the_odd_pixel_right_and_bottom() -> Result<()> {
        let fit = DocumentFit {
            pad: true,
            ..DocumentFit::default()
        };
        let mut s = spec(6, 7, fit);
        s.resize = false;
        let out = s.resized(&DynamicImage::ImageRgb8(coords(4, 3)))?;
        // 3 columns to add: 1 left, 2 right; 3 rows: 1 top, 2 bottom.
        assert_eq!(out.get_pixel(1, 1).0, [0, 0, 7]);
        assert_eq!(out.get_pixel(4, 3).0, [3, 2, 7]);
        assert_eq!(out.get_pixel(5, 4).0, [0, 0, 0]);
        Ok(())
    }

    #[test]
    fn resize_and_thumbnail_keep_the_aspect_ratio() -> Result<()> {
        let fit = DocumentFit {
            thumbnail: Some(Resample::Bilinear),
            ..DocumentFit::default()
        };
        // 10x40 (w x h): the shorter side to 8 -> 8x32; the thumbnail fits
        // 16 rows -> int(8 * 16 / 32) = 4 wide. Without padding it is not
        // the input's size: refused, with the size it got to.
        let e = spec(16, 8, fit)
            .resized(&DynamicImage::ImageRgb8(coords(10, 40)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("is 4x16 after the document steps"), "{e}");
        Ok(())
    }

    #[test]
    fn margins_are_cropped_to_the_dark_content() {
        let mut page = RgbImage::from_pixel(10, 8, Rgb([255, 255, 255]));
        page.put_pixel(2, 3, Rgb([10, 10, 10]));
        page.put_pixel(6, 5, Rgb([150, 150, 150]));
        let out = crop_margin(page);
        assert_eq!(out.dimensions(), (5, 3));
        assert_eq!(out.get_pixel(0, 0).0, [10, 10, 10]);
        // One grey level: kept whole.
        let flat = RgbImage::from_pixel(4, 4, Rgb([200, 200, 200]));
        assert_eq!(crop_margin(flat).dimensions(), (4, 4));
    }
}
