//! `vl caption --draw DIR`: a task's boxes, quadrilaterals and polygons
//! drawn on the image, with their labels, as a PNG per image; and the
//! one-line summary printed for them.

use std::path::Path;

use anyhow::Context;
use image::DynamicImage;
use plotters::prelude::*;
use vl::tasks::TaskOutput;

use crate::plot::{ensure_font, FAMILY};

/// Outline colours, one per instance in turn (Okabe–Ito, colour-blind safe).
const COLOURS: [RGBColor; 6] = [
    RGBColor(230, 159, 0),
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
];

/// One shape to draw: its outline as points, and its label.
struct Shape {
    points: Vec<(i32, i32)>,
    label: String,
}

fn pairs(coords: &[i32]) -> Vec<(i32, i32)> {
    coords.chunks_exact(2).map(|p| (p[0], p[1])).collect()
}

fn rect(b: &[i32; 4]) -> Vec<(i32, i32)> {
    vec![(b[0], b[1]), (b[2], b[1]), (b[2], b[3]), (b[0], b[3])]
}

fn shapes(parsed: &TaskOutput) -> Vec<Shape> {
    let boxes = |bboxes: &[[i32; 4]], labels: &[String]| -> Vec<Shape> {
        bboxes
            .iter()
            .zip(labels)
            .map(|(b, l)| Shape {
                points: rect(b),
                label: l.clone(),
            })
            .collect()
    };
    let polys = |polygons: &[Vec<Vec<i32>>], labels: &[String]| -> Vec<Shape> {
        polygons
            .iter()
            .zip(labels)
            .flat_map(|(inst, l)| {
                inst.iter().map(move |p| Shape {
                    points: pairs(p),
                    label: l.clone(),
                })
            })
            .collect()
    };
    match parsed {
        TaskOutput::Text(_) => Vec::new(),
        TaskOutput::Boxes { bboxes, labels } => boxes(bboxes, labels),
        TaskOutput::Quads { quad_boxes, labels } => quad_boxes
            .iter()
            .zip(labels)
            .map(|(q, l)| Shape {
                points: pairs(q),
                label: l.clone(),
            })
            .collect(),
        TaskOutput::Polygons { polygons, labels } => polys(polygons, labels),
        TaskOutput::BoxesOrPolygons {
            bboxes,
            bboxes_labels,
            polygons,
            polygons_labels,
        } => {
            let mut s = boxes(bboxes, bboxes_labels);
            s.extend(polys(polygons, polygons_labels));
            s
        }
    }
}

/// The shapes on one line: `label [x1, y1, …]; …` (`(none)` when there
/// are none).
pub fn summary(parsed: &TaskOutput) -> String {
    let all = shapes(parsed);
    if all.is_empty() {
        return "(none)".into();
    }
    all.iter()
        .map(|s| {
            let coords: Vec<String> = s
                .points
                .iter()
                .flat_map(|(x, y)| [x.to_string(), y.to_string()])
                .collect();
            let label = if s.label.is_empty() {
                String::new()
            } else {
                format!("{} ", s.label)
            };
            format!("{label}[{}]", coords.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// `image` with `parsed`'s shapes and labels drawn on it.
///
/// # Errors
/// plotters' drawing errors.
pub fn render(image: &DynamicImage, parsed: &TaskOutput) -> anyhow::Result<image::RgbImage> {
    ensure_font();
    let mut rgb = image.to_rgb8();
    let (w, h) = rgb.dimensions();
    let thick = (w.max(h) / 300).max(2);
    let text_size = (w.max(h) / 40).clamp(10, 28) as i32;
    {
        let root = BitMapBackend::with_buffer(rgb.as_mut(), (w, h)).into_drawing_area();
        for (i, s) in shapes(parsed).iter().enumerate() {
            if s.points.is_empty() {
                continue;
            }
            let colour = COLOURS[i % COLOURS.len()];
            let mut closed = s.points.clone();
            closed.push(s.points[0]);
            root.draw(&PathElement::new(closed, colour.stroke_width(thick)))
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            if !s.label.is_empty() {
                let (x, y) = s.points[0];
                let pos = (x + thick as i32, (y - text_size - 2).max(0));
                let style = TextStyle::from((FAMILY, text_size).into_font()).color(&colour);
                let width = (s.label.chars().count() as i32) * text_size * 6 / 10 + 4;
                root.draw(&Rectangle::new(
                    [(pos.0 - 2, pos.1), (pos.0 + width, pos.1 + text_size + 2)],
                    WHITE.mix(0.75).filled(),
                ))
                .map_err(|e| anyhow::anyhow!("{e}"))?;
                root.draw(&Text::new(s.label.clone(), pos, style))
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
            }
        }
        root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    Ok(rgb)
}

/// Writes `DIR/<image stem>.png`: [`render`]'s drawing.
///
/// # Errors
/// The directory or file cannot be written; drawing errors.
pub fn write(
    dir: &Path,
    path: &Path,
    image: &DynamicImage,
    parsed: &TaskOutput,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("{}", dir.display()))?;
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("image");
    let file = dir.join(format!("{stem}.png"));
    render(image, parsed)?
        .save(&file)
        .with_context(|| format!("{}", file.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A box is drawn where it is: its outline pixels change, the centre
    /// of the box and pixels far from it do not.
    #[test]
    fn boxes_are_drawn_where_they_are() -> anyhow::Result<()> {
        let img =
            DynamicImage::ImageRgb8(image::RgbImage::from_pixel(200, 100, image::Rgb([0, 0, 0])));
        let parsed = TaskOutput::Boxes {
            bboxes: vec![[20, 30, 120, 80]],
            labels: vec!["car".into()],
        };
        let out = render(&img, &parsed)?;
        assert_ne!(out.get_pixel(70, 30).0, [0, 0, 0], "top edge");
        assert_ne!(out.get_pixel(120, 55).0, [0, 0, 0], "right edge");
        assert_eq!(out.get_pixel(70, 55).0, [0, 0, 0], "inside");
        assert_eq!(out.get_pixel(180, 95).0, [0, 0, 0], "outside");
        assert_eq!(summary(&parsed), "car [20, 30, 120, 30, 120, 80, 20, 80]");
        Ok(())
    }
}
