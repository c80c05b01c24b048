//! Helpers shared by the integration tests: an independent, floating-point
//! reading of the page's geometry to cross-check the crate's exact one.

#![allow(dead_code)]

use vl_shapes::{Colour, Object, Shape};

/// Whether pixel `(px, py)`'s centre lies inside `object`, computed in `f64`
/// straight from the page's wording (boundary counts as inside).
pub fn inside_f64(object: &Object, px: u32, py: u32) -> bool {
    inside_with_boundary(object, px, py, true)
}

/// The same test, with the boundary counted as inside or not.
pub fn inside_with_boundary(object: &Object, px: u32, py: u32, boundary: bool) -> bool {
    let le = |a: f64, b: f64| if boundary { a <= b } else { a < b };
    let (qx, qy) = (f64::from(px) + 0.5, f64::from(py) + 0.5);
    let (x, y, s) = (
        f64::from(object.x),
        f64::from(object.y),
        f64::from(object.s),
    );
    match object.shape {
        Shape::Square => le(x, qx) && le(qx, x + s) && le(y, qy) && le(qy, y + s),
        Shape::Circle => {
            let (cx, cy, r) = (x + s / 2.0, y + s / 2.0, s / 2.0);
            le((qx - cx).powi(2) + (qy - cy).powi(2), r * r)
        }
        Shape::Triangle => {
            let vertices = [(x, y + s), (x + s, y + s), (x + s / 2.0, y)];
            let edge =
                |a: (f64, f64), b: (f64, f64)| (b.0 - a.0) * (qy - a.1) - (b.1 - a.1) * (qx - a.0);
            let e = [
                edge(vertices[0], vertices[1]),
                edge(vertices[1], vertices[2]),
                edge(vertices[2], vertices[0]),
            ];
            e.iter().all(|&v| le(0.0, v)) || e.iter().all(|&v| le(v, 0.0))
        }
    }
}

/// Whether `rgb` is `colour`'s base with each channel offset by at most 20
/// and clamped, written out independently of the crate.
pub fn rgb_matches(colour: Colour, rgb: [u8; 3]) -> bool {
    colour.base_rgb().iter().zip(rgb).all(|(&base, value)| {
        let (base, value) = (i32::from(base), i32::from(value));
        let low = (base - 20).max(0);
        let high = (base + 20).min(255);
        (low..=high).contains(&value)
    })
}

/// Box centre in pixels.
pub fn centre(object: &Object) -> (f64, f64) {
    let half = f64::from(object.s) / 2.0;
    (f64::from(object.x) + half, f64::from(object.y) + half)
}

/// Builds an object with the base colour.
pub fn object(
    shape: Shape,
    size: vl_shapes::Size,
    colour: Colour,
    s: u32,
    x: u32,
    y: u32,
) -> Object {
    Object {
        shape,
        size,
        colour,
        s,
        x,
        y,
        rgb: colour.base_rgb(),
    }
}
