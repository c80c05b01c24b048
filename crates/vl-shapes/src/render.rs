//! Rasterising a scene into a 64 × 64 RGB image.

use image::{Rgb, RgbImage};

use crate::scene::{Object, Scene};
use crate::world::IMAGE_SIZE;

/// Renders a scene: an `IMAGE_SIZE × IMAGE_SIZE` image filled with the grey
/// background, then each object painted over it in order. A pixel is
/// painted when its centre lies inside the shape (see
/// [`Object::contains_pixel`]).
pub fn render(scene: &Scene) -> RgbImage {
    let grey = scene.background();
    let mut image = RgbImage::from_pixel(IMAGE_SIZE, IMAGE_SIZE, Rgb([grey; 3]));
    for object in scene.objects() {
        paint(&mut image, object);
    }
    image
}

/// Paints the pixels of `object` that fall inside `image` with its RGB.
fn paint(image: &mut RgbImage, object: &Object) {
    // Only pixels of the box can be inside the shape.
    let columns = object.x..object.x.saturating_add(object.s).min(image.width());
    let rows = object.y..object.y.saturating_add(object.s).min(image.height());
    for py in rows {
        for px in columns.clone() {
            if object.contains_pixel(px, py) {
                image.put_pixel(px, py, Rgb(object.rgb));
            }
        }
    }
}

impl Scene {
    /// Renders the scene; see [`render`].
    pub fn render(&self) -> RgbImage {
        render(self)
    }
}
