//! The semantic view of a scene, used for scoring: what a caption says,
//! without geometry or exact colours.

use std::fmt;

use crate::world::{Colour, Shape, Size};

/// The attributes of one object that a caption names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    /// Size class.
    pub size: Size,
    /// Named colour.
    pub colour: Colour,
    /// Shape.
    pub shape: Shape,
}

impl fmt::Display for ObjectKey {
    /// The object phrase `a {size} {colour} {shape}`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a {} {} {}", self.size, self.colour, self.shape)
    }
}

/// The relation from the first object of a two-object scene to the second,
/// in canonical order (the reverse phrasings `to the right of` and `below`
/// are stored as these with the objects swapped).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Relation {
    /// The first object is to the left of the second (`|dx| > |dy|`).
    LeftOf,
    /// The first object is above the second (`|dy| > |dx|`).
    Above,
}

impl Relation {
    /// The caption words of this relation.
    pub fn phrase(self) -> &'static str {
        match self {
            Relation::LeftOf => "to the left of",
            Relation::Above => "above",
        }
    }
}

/// What a caption says about a scene, in canonical form: two scenes are the
/// same for scoring exactly when their keys are equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SceneKey {
    /// A scene with one object.
    One(ObjectKey),
    /// A scene with two objects: `first` is the left one for
    /// [`Relation::LeftOf`] and the upper one for [`Relation::Above`].
    Two {
        /// The left or upper object.
        first: ObjectKey,
        /// How `first` stands to `second`.
        relation: Relation,
        /// The right or lower object.
        second: ObjectKey,
    },
}

impl fmt::Display for SceneKey {
    /// The canonical caption: the object phrase, or
    /// `{first} to the left of {second}` / `{first} above {second}`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SceneKey::One(object) => write!(f, "{object}"),
            SceneKey::Two {
                first,
                relation,
                second,
            } => write!(f, "{first} {} {second}", relation.phrase()),
        }
    }
}

impl std::str::FromStr for SceneKey {
    type Err = crate::caption::ParseError;

    /// Parses a caption; see [`crate::parse_caption`].
    fn from_str(caption: &str) -> Result<Self, Self::Err> {
        crate::caption::parse_caption(caption)
    }
}
