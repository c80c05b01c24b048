//! Cross-attention heatmaps: where each generated word looked.
//!
//! A word's map is the cross-attention of the decoder position that chose
//! it (the position before the word), averaged over heads, in the **last
//! block that has cross-attention** — the one closest to the output. The
//! CLS token is dropped and the patch weights are laid on the patch grid,
//! normalised to [0, 1], upscaled to the image and blended over it.

use image::{Rgb, RgbImage};

/// How much larger than the model's input a heatmap is drawn.
pub const UPSCALE: u32 = 4;
/// Height of the caption strip under each map, in pixels.
const LABEL_HEIGHT: u32 = 12;
/// Glyph width and height of the built-in bitmap font, in font pixels.
const GLYPH_W: u32 = 5;
const GLYPH_H: u32 = 7;

/// One word's patch weights `(grid * grid)`, row-major, as a heatmap over
/// `image` (already resized to the model's input), upscaled by [`UPSCALE`],
/// with the word written underneath.
pub fn overlay(image: &RgbImage, weights: &[f32], grid: u32, word: &str) -> RgbImage {
    let (w, h) = image.dimensions();
    let (ow, oh) = (w * UPSCALE, h * UPSCALE);
    let max = weights.iter().copied().fold(0f32, f32::max);
    let min = weights.iter().copied().fold(f32::INFINITY, f32::min);
    let span = (max - min).max(1e-12);
    let mut out = RgbImage::new(ow, oh + LABEL_HEIGHT * 2);
    for y in 0..oh {
        for x in 0..ow {
            let src = image.get_pixel(x / UPSCALE, y / UPSCALE);
            let (gx, gy) = (x * grid / ow, y * grid / oh);
            let a = weights
                .get((gy * grid + gx) as usize)
                .map_or(0.0, |v| (v - min) / span);
            let heat = colormap(a);
            let blend = |s: u8, h: u8| (0.45 * s as f32 + 0.55 * h as f32) as u8;
            out.put_pixel(
                x,
                y,
                Rgb([
                    blend(src[0], heat[0]),
                    blend(src[1], heat[1]),
                    blend(src[2], heat[2]),
                ]),
            );
        }
    }
    draw_text(&mut out, word, 2, oh + 3, 2);
    out
}

/// All words' maps side by side, with the whole caption underneath.
pub fn grid(maps: &[RgbImage], caption: &str) -> RgbImage {
    let (w, h) = maps.first().map_or((1, 1), |m| m.dimensions());
    let cols = (maps.len() as u32).clamp(1, 6);
    let rows = (maps.len() as u32).div_ceil(cols).max(1);
    let caption_h = LABEL_HEIGHT * 2;
    let mut out = RgbImage::new(cols * w, rows * h + caption_h);
    for (i, m) in maps.iter().enumerate() {
        let (cx, cy) = ((i as u32 % cols) * w, (i as u32 / cols) * h);
        image::imageops::replace(&mut out, m, cx as i64, cy as i64);
    }
    draw_text(&mut out, caption, 2, rows * h + 4, 2);
    out
}

/// Black → red → yellow → white.
fn colormap(a: f32) -> [u8; 3] {
    let a = a.clamp(0.0, 1.0);
    let r = (a * 3.0).min(1.0);
    let g = (a * 3.0 - 1.0).clamp(0.0, 1.0);
    let b = (a * 3.0 - 2.0).clamp(0.0, 1.0);
    [(r * 255.0) as u8, (g * 255.0) as u8, (b * 255.0) as u8]
}

/// Writes lowercase letters and spaces in a 5×7 bitmap font, `scale`
/// screen pixels per font pixel; other characters are drawn as blanks.
fn draw_text(img: &mut RgbImage, text: &str, x0: u32, y0: u32, scale: u32) {
    let mut x = x0;
    for ch in text.chars() {
        if let Some(rows) = glyph(ch) {
            for (gy, bits) in rows.iter().enumerate() {
                for gx in 0..GLYPH_W {
                    if bits & (1 << (GLYPH_W - 1 - gx)) != 0 {
                        for dy in 0..scale {
                            for dx in 0..scale {
                                let (px, py) = (x + gx * scale + dx, y0 + gy as u32 * scale + dy);
                                if px < img.width() && py < img.height() {
                                    img.put_pixel(px, py, Rgb([255, 255, 255]));
                                }
                            }
                        }
                    }
                }
            }
        }
        x += (GLYPH_W + 1) * scale;
    }
}

/// Rows of a 5×7 glyph, most significant of the 5 bits on the left.
fn glyph(ch: char) -> Option<[u8; GLYPH_H as usize]> {
    Some(match ch {
        'a' => [0, 0, 14, 1, 15, 17, 15],
        'b' => [16, 16, 30, 17, 17, 17, 30],
        'c' => [0, 0, 14, 16, 16, 17, 14],
        'd' => [1, 1, 15, 17, 17, 17, 15],
        'e' => [0, 0, 14, 17, 31, 16, 14],
        'f' => [6, 9, 8, 28, 8, 8, 8],
        'g' => [0, 15, 17, 17, 15, 1, 14],
        'h' => [16, 16, 22, 25, 17, 17, 17],
        'i' => [4, 0, 12, 4, 4, 4, 14],
        'j' => [2, 0, 6, 2, 2, 18, 12],
        'k' => [16, 16, 18, 20, 24, 20, 18],
        'l' => [12, 4, 4, 4, 4, 4, 14],
        'm' => [0, 0, 26, 21, 21, 17, 17],
        'n' => [0, 0, 22, 25, 17, 17, 17],
        'o' => [0, 0, 14, 17, 17, 17, 14],
        'p' => [0, 0, 30, 17, 30, 16, 16],
        'q' => [0, 0, 13, 19, 15, 1, 1],
        'r' => [0, 0, 22, 25, 16, 16, 16],
        's' => [0, 0, 14, 16, 14, 1, 30],
        't' => [8, 8, 28, 8, 8, 9, 6],
        'u' => [0, 0, 17, 17, 17, 19, 13],
        'v' => [0, 0, 17, 17, 17, 10, 4],
        'w' => [0, 0, 17, 17, 21, 21, 10],
        'x' => [0, 0, 17, 10, 4, 10, 17],
        'y' => [0, 0, 17, 17, 15, 1, 14],
        'z' => [0, 0, 31, 2, 4, 8, 31],
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlay_is_upscaled_with_a_label_strip() {
        let img = RgbImage::from_pixel(64, 64, Rgb([10, 10, 10]));
        let mut w = vec![0f32; 64];
        w[9] = 1.0;
        let m = overlay(&img, &w, 8, "red");
        assert_eq!(m.dimensions(), (256, 256 + 24));
        // The hot patch (row 1, col 1) is brighter than a cold one.
        let hot = m.get_pixel(32 + 16, 32 + 16);
        let cold = m.get_pixel(200, 200);
        assert!(hot[0] > cold[0]);
        let g = grid(&[m.clone(), m], "a red circle");
        assert_eq!(g.dimensions(), (512, 280 + 24));
    }
}
