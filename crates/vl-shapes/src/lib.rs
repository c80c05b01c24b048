//! The shapes world: the domain of the small captioner, with a seeded scene
//! sampler, a renderer, a caption writer, a strict caption parser and a
//! scorer.
//!
//! # The shapes world, version 1
//!
//! **Images.** Each image is a 64-pixel square, 8-bit RGB. The background
//! is a single grey `(g, g, g)` with `g` an integer drawn uniformly from 0 to
//! 40 inclusive. An image holds one object or two, each case with
//! probability one half.
//!
//! **Objects.** An object has a shape (circle, square or triangle), a size
//! class and a named colour. It sits in an axis-aligned `s × s` box whose
//! top-left corner `(x, y)` has integer coordinates. A small object has an
//! integer side `s` from 10 to 14, a large one from 20 to 26, uniformly. The
//! named colours and their base RGB values are red `(220, 40, 40)`, green
//! `(40, 190, 60)`, blue `(50, 90, 230)`, yellow `(235, 210, 40)`, white
//! `(235, 235, 235)` and purple `(160, 60, 210)`; the drawn colour adds an
//! independent integer offset from −20 to +20 to each channel and clamps the
//! result to `0..=255`.
//!
//! **Geometry.** A pixel `(px, py)` belongs to an object when the point
//! `(px + 0.5, py + 0.5)`, its centre, is inside the shape, boundary
//! included. A square fills its whole box. A circle is the disk centred on
//! the middle of the box, `(x + s/2, y + s/2)`, of radius `s/2`. A triangle
//! stands on the bottom edge of the box, corners `(x, y + s)` and
//! `(x + s, y + s)`, with its apex at the middle of the top edge,
//! `(x + s/2, y)`. Objects are painted over the background in order.
//!
//! **Placement.** Every box keeps two pixels from each edge of the image:
//! `2 ≤ x` and `x + s ≤ 62`, and likewise for `y`. When there are two
//! objects, three more rules hold: their boxes stay apart even after each is
//! enlarged by 2 pixels on all four sides; they never have both the same
//! colour and the same shape; and the offset `(dx, dy)` between the two box
//! centres is never near a diagonal, `| |dx| − |dy| | ≥ 6`.
//!
//! **Captions.** A caption is lowercase words separated by single spaces,
//! with no punctuation. An object is described as `a {size} {colour}
//! {shape}`, e.g. `a large purple triangle`. A one-object caption is just
//! that phrase. With two objects, if the horizontal offset dominates
//! (`|dx| > |dy|`) the caption names the left object, then `to the left of`,
//! then the right one; if the vertical offset dominates it names the upper
//! object (smaller `y`), then `above`, then the lower one.
//!
//! **Scoring.** A caption is read back into a scene description: its object
//! phrases and, for two objects, their relation. The reverse phrasings are
//! accepted: `X to the right of Y` means `Y to the left of X`, and `X below
//! Y` means `Y above X`. A predicted caption is correct when it reads back
//! into the true scene's description: the same objects (size, colour and
//! shape) and, for two, the same relation between the same pair. A caption
//! outside the grammar is wrong. Scene accuracy is the fraction of correct
//! predictions.
//!
//! # Map of the crate
//!
//! - [`world`]: the numbers of the world as constants, and [`Shape`],
//!   [`Size`], [`Colour`].
//! - [`Object`] and [`Scene`]: drawn geometry, validated by [`Scene::new`].
//! - [`SceneKey`]: the semantic, canonical view used for scoring.
//! - [`sample_scene`], [`Scene::sample`], [`dataset_scene`]: seeded sampling
//!   with [`ShapesRng`] (ChaCha8).
//! - [`fn@render`]: scene → 64 × 64 [`image::RgbImage`].
//! - [`fn@caption`], [`parse_caption`], [`VOCAB`]: the caption grammar.
//! - [`fn@score`], [`scene_accuracy`]: scoring predictions.
//!
//! ```
//! use vl_shapes::{dataset_scene, parse_caption, render, score, IMAGE_SIZE};
//!
//! let scene = dataset_scene(7, 0);
//! let image = render(&scene);
//! assert_eq!(image.dimensions(), (IMAGE_SIZE, IMAGE_SIZE));
//! let caption = scene.caption();
//! assert_eq!(parse_caption(&caption), Ok(scene.key()));
//! assert!(score(&caption, &scene));
//! ```

pub mod caption;
pub mod key;
pub mod render;
pub mod sample;
pub mod scene;
pub mod score;
pub mod world;

pub use caption::{caption, parse_caption, ParseError, VOCAB};
pub use key::{ObjectKey, Relation, SceneKey};
pub use render::render;
pub use sample::{dataset_scene, sample_object, sample_scene, scene_rng, ShapesRng};
pub use scene::{Object, Scene, SceneError};
pub use score::{scene_accuracy, score};
pub use world::{
    Colour, Shape, Size, BACKGROUND_MAX, BACKGROUND_MIN, BOX_GROWTH, COLOUR_OFFSET_MAX, IMAGE_SIZE,
    LARGE_SIDE_MAX, LARGE_SIDE_MIN, MARGIN, MAX_OBJECTS, MIN_AXIS_SEPARATION, MIN_OBJECTS,
    SMALL_SIDE_MAX, SMALL_SIDE_MIN, TWO_OBJECT_PROBABILITY,
};
