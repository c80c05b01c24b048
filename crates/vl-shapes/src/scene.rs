//! Drawn scenes: objects with their exact geometry and RGB, validated
//! against every rule of the shapes world.
//!
//! Geometry is computed exactly in *half-pixel units* (every coordinate
//! doubled), where box corners, box centres, circle radii, triangle vertices
//! and pixel centres are all integers; boundary points count as inside.

use thiserror::Error;

use crate::key::{ObjectKey, Relation, SceneKey};
use crate::world::{
    Colour, Shape, Size, BACKGROUND_MAX, BACKGROUND_MIN, BOX_GROWTH, COLOUR_OFFSET_MAX, IMAGE_SIZE,
    MARGIN, MAX_OBJECTS, MIN_AXIS_SEPARATION, MIN_OBJECTS,
};

/// One drawn object: its attributes and the geometry and colour it is
/// drawn with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Object {
    /// The object's shape.
    pub shape: Shape,
    /// The object's size class; `s` lies in its range.
    pub size: Size,
    /// The object's named colour; `rgb` is within the offsets of its base.
    pub colour: Colour,
    /// Side of the object's square box, in pixels.
    pub s: u32,
    /// Column of the box's top-left corner.
    pub x: u32,
    /// Row of the box's top-left corner.
    pub y: u32,
    /// The RGB the object is filled with.
    pub rgb: [u8; 3],
}

impl Object {
    /// The object's attributes, without geometry or exact colour.
    pub fn key(&self) -> ObjectKey {
        ObjectKey {
            size: self.size,
            colour: self.colour,
            shape: self.shape,
        }
    }

    /// The centre of the object's box, `(x + s/2, y + s/2)`, in pixels.
    pub fn centre(&self) -> (f64, f64) {
        let (cx, cy) = self.centre_half();
        (cx as f64 / 2.0, cy as f64 / 2.0)
    }

    /// The centre of the box in half-pixel units: `(2x + s, 2y + s)`.
    pub(crate) fn centre_half(&self) -> (i64, i64) {
        let s = i64::from(self.s);
        (2 * i64::from(self.x) + s, 2 * i64::from(self.y) + s)
    }

    /// Whether pixel `(px, py)` is filled by this object, i.e. whether its
    /// centre `(px + 0.5, py + 0.5)` lies inside the shape (boundary
    /// included).
    pub fn contains_pixel(&self, px: u32, py: u32) -> bool {
        // Half-pixel units: pixel centre, box corner, side.
        let (qx, qy) = (2 * i64::from(px) + 1, 2 * i64::from(py) + 1);
        let (left, top) = (2 * i64::from(self.x), 2 * i64::from(self.y));
        let side = 2 * i64::from(self.s);
        let (right, bottom) = (left + side, top + side);
        match self.shape {
            Shape::Square => (left..=right).contains(&qx) && (top..=bottom).contains(&qy),
            Shape::Circle => {
                let (cx, cy) = self.centre_half();
                let radius = i64::from(self.s);
                (qx - cx).pow(2) + (qy - cy).pow(2) <= radius.pow(2)
            }
            Shape::Triangle => {
                let base_left = (left, bottom);
                let base_right = (right, bottom);
                let apex = (left + i64::from(self.s), top);
                let point = (qx, qy);
                let edges = [
                    edge(base_left, base_right, point),
                    edge(base_right, apex, point),
                    edge(apex, base_left, point),
                ];
                edges.iter().all(|&e| e >= 0) || edges.iter().all(|&e| e <= 0)
            }
        }
    }

    /// Checks the object's own rules: side within its class, placement
    /// within the margins, RGB within the offsets of its colour.
    fn validate(&self, index: usize) -> Result<(), SceneError> {
        let sides = self.size.side_range();
        if !sides.contains(&self.s) {
            return Err(SceneError::Side {
                index,
                size: self.size,
                side: self.s,
                min: *sides.start(),
                max: *sides.end(),
            });
        }
        for (axis, position) in [('x', self.x), ('y', self.y)] {
            let far = position.checked_add(self.s);
            if position < MARGIN || far.is_none_or(|far| far > IMAGE_SIZE - MARGIN) {
                return Err(SceneError::Placement {
                    index,
                    axis,
                    position,
                    side: self.s,
                });
            }
        }
        if !self.colour.admits(self.rgb) {
            return Err(SceneError::Rgb {
                index,
                colour: self.colour,
                rgb: self.rgb,
            });
        }
        Ok(())
    }
}

/// Edge function of `point` against the directed edge `from → to`; its sign
/// tells the side of the edge the point is on, zero meaning on the line.
fn edge(from: (i64, i64), to: (i64, i64), point: (i64, i64)) -> i64 {
    (to.0 - from.0) * (point.1 - from.1) - (to.1 - from.1) * (point.0 - from.0)
}

/// Whether two objects' boxes, each grown by [`BOX_GROWTH`] pixels on every
/// side, share a pixel.
pub(crate) fn grown_boxes_intersect(a: &Object, b: &Object) -> bool {
    let gap = 2 * i64::from(BOX_GROWTH);
    let overlaps = |start_a: u32, start_b: u32| {
        let (start_a, start_b) = (i64::from(start_a), i64::from(start_b));
        start_a + i64::from(a.s) + gap > start_b && start_b + i64::from(b.s) + gap > start_a
    };
    overlaps(a.x, b.x) && overlaps(a.y, b.y)
}

/// Offset `(dx, dy)` from `a`'s box centre to `b`'s, in half-pixel units.
pub(crate) fn centre_offset_half(a: &Object, b: &Object) -> (i64, i64) {
    let (ax, ay) = a.centre_half();
    let (bx, by) = b.centre_half();
    (bx - ax, by - ay)
}

/// Whether two objects satisfy the pair rules: grown boxes apart, not both
/// colour and shape shared, and `| |dx| - |dy| | >= MIN_AXIS_SEPARATION`.
pub(crate) fn check_pair(a: &Object, b: &Object) -> Result<(), SceneError> {
    if grown_boxes_intersect(a, b) {
        return Err(SceneError::Overlap);
    }
    if a.colour == b.colour && a.shape == b.shape {
        return Err(SceneError::SameColourAndShape {
            colour: a.colour,
            shape: a.shape,
        });
    }
    let (dx, dy) = centre_offset_half(a, b);
    if (dx.abs() - dy.abs()).abs() < 2 * i64::from(MIN_AXIS_SEPARATION) {
        return Err(SceneError::AmbiguousRelation {
            dx: dx as f64 / 2.0,
            dy: dy as f64 / 2.0,
        });
    }
    Ok(())
}

/// A scene that obeys every rule of the shapes world: a grey background and
/// one or two objects, drawn in order.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scene {
    background: u8,
    objects: Objects,
}

/// The objects of a scene; the type admits only one or two.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Objects {
    One(Object),
    Two([Object; 2]),
}

impl Scene {
    /// Builds a scene, checking the background level, the object count and
    /// every per-object and pair rule.
    pub fn new(background: u8, objects: Vec<Object>) -> Result<Scene, SceneError> {
        if !(BACKGROUND_MIN..=BACKGROUND_MAX).contains(&background) {
            return Err(SceneError::Background { grey: background });
        }
        let objects = match *objects.as_slice() {
            [only] => {
                only.validate(0)?;
                Objects::One(only)
            }
            [a, b] => {
                a.validate(0)?;
                b.validate(1)?;
                check_pair(&a, &b)?;
                Objects::Two([a, b])
            }
            _ => {
                return Err(SceneError::ObjectCount {
                    count: objects.len(),
                })
            }
        };
        Ok(Scene {
            background,
            objects,
        })
    }

    /// A one-object scene the caller has already checked (the sampler).
    pub(crate) fn one_unchecked(background: u8, object: Object) -> Scene {
        Scene {
            background,
            objects: Objects::One(object),
        }
    }

    /// A two-object scene the caller has already checked (the sampler).
    pub(crate) fn two_unchecked(background: u8, objects: [Object; 2]) -> Scene {
        Scene {
            background,
            objects: Objects::Two(objects),
        }
    }

    /// The grey level `g` of the background `(g, g, g)`.
    pub fn background(&self) -> u8 {
        self.background
    }

    /// The objects, in drawing order (one or two).
    pub fn objects(&self) -> &[Object] {
        match &self.objects {
            Objects::One(only) => std::slice::from_ref(only),
            Objects::Two(pair) => pair,
        }
    }

    /// The semantic view of the scene used for scoring: the objects'
    /// attributes and, for two, the relation in canonical order (left one
    /// first when `|dx| > |dy|`, upper one first otherwise).
    pub fn key(&self) -> SceneKey {
        match &self.objects {
            Objects::One(only) => SceneKey::One(only.key()),
            Objects::Two([a, b]) => {
                let (dx, dy) = centre_offset_half(a, b);
                let (relation, b_first) = if dx.abs() > dy.abs() {
                    (Relation::LeftOf, dx < 0)
                } else {
                    (Relation::Above, dy < 0)
                };
                let (first, second) = if b_first { (b, a) } else { (a, b) };
                SceneKey::Two {
                    first: first.key(),
                    relation,
                    second: second.key(),
                }
            }
        }
    }

    /// The caption of the scene, in canonical phrasing.
    pub fn caption(&self) -> String {
        self.key().to_string()
    }
}

/// A rule of the shapes world that a scene breaks.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SceneError {
    /// The background grey level is above the allowed range.
    #[error("background grey {grey} is outside [{BACKGROUND_MIN}, {BACKGROUND_MAX}]")]
    Background {
        /// The grey level given.
        grey: u8,
    },
    /// The scene does not hold one or two objects.
    #[error("a scene holds {MIN_OBJECTS} or {MAX_OBJECTS} objects, got {count}")]
    ObjectCount {
        /// The number of objects given.
        count: usize,
    },
    /// An object's side is outside its size class's range.
    #[error("object {index}: side {side} is outside the {size} range [{min}, {max}]")]
    Side {
        /// Position of the object in the scene.
        index: usize,
        /// The object's size class.
        size: Size,
        /// The side given.
        side: u32,
        /// Smallest side of the class.
        min: u32,
        /// Largest side of the class.
        max: u32,
    },
    /// An object's box crosses the margin along one axis.
    #[error(
        "object {index}: {axis} = {position} with side {side} breaks \
         {MARGIN} <= {axis} and {axis} + side <= {}",
        IMAGE_SIZE - MARGIN
    )]
    Placement {
        /// Position of the object in the scene.
        index: usize,
        /// `'x'` or `'y'`.
        axis: char,
        /// The corner coordinate given along that axis.
        position: u32,
        /// The object's side.
        side: u32,
    },
    /// An object's RGB is not its colour's base within the allowed offsets.
    #[error(
        "object {index}: rgb {rgb:?} is not within ±{COLOUR_OFFSET_MAX} of {colour}'s base {:?}",
        colour.base_rgb()
    )]
    Rgb {
        /// Position of the object in the scene.
        index: usize,
        /// The object's named colour.
        colour: Colour,
        /// The RGB given.
        rgb: [u8; 3],
    },
    /// The two boxes, grown by [`BOX_GROWTH`] pixels, intersect.
    #[error("the two boxes, each grown by {BOX_GROWTH} pixels, intersect")]
    Overlap,
    /// Both objects have the same colour and the same shape.
    #[error("both objects are {colour} {shape}s")]
    SameColourAndShape {
        /// The shared colour.
        colour: Colour,
        /// The shared shape.
        shape: Shape,
    },
    /// The centre offset is too close to the diagonal to name one relation.
    #[error(
        "centre offset (dx, dy) = ({dx}, {dy}) has | |dx| - |dy| | below {MIN_AXIS_SEPARATION}"
    )]
    AmbiguousRelation {
        /// Horizontal offset between the box centres, in pixels.
        dx: f64,
        /// Vertical offset between the box centres, in pixels.
        dy: f64,
    },
}
