//! The vocabulary of the shapes world: every number of the specification as
//! a named constant, and the three attribute enums with their words.

use std::fmt;
use std::ops::RangeInclusive;

/// Width and height of every image, in pixels.
pub const IMAGE_SIZE: u32 = 64;

/// Distance an object's box keeps from every image edge, in pixels:
/// `MARGIN <= x` and `x + s <= IMAGE_SIZE - MARGIN`, the same for `y`.
pub const MARGIN: u32 = 2;

/// Pixels by which each of two boxes is grown on every side before the
/// non-intersection test.
pub const BOX_GROWTH: u32 = 2;

/// Smallest background grey level `g` (the background is `(g, g, g)`).
pub const BACKGROUND_MIN: u8 = 0;

/// Largest background grey level `g`.
pub const BACKGROUND_MAX: u8 = 40;

/// Fewest objects in a scene.
pub const MIN_OBJECTS: usize = 1;

/// Most objects in a scene.
pub const MAX_OBJECTS: usize = 2;

/// Probability that a sampled scene holds [`MAX_OBJECTS`] objects rather
/// than [`MIN_OBJECTS`].
pub const TWO_OBJECT_PROBABILITY: f64 = 0.5;

/// Smallest side `s` of a `small` object, in pixels.
pub const SMALL_SIDE_MIN: u32 = 10;

/// Largest side `s` of a `small` object, in pixels.
pub const SMALL_SIDE_MAX: u32 = 14;

/// Smallest side `s` of a `large` object, in pixels.
pub const LARGE_SIDE_MIN: u32 = 20;

/// Largest side `s` of a `large` object, in pixels.
pub const LARGE_SIDE_MAX: u32 = 26;

/// Largest absolute per-channel offset added to a colour's base RGB; each
/// offset is drawn from `[-COLOUR_OFFSET_MAX, COLOUR_OFFSET_MAX]`.
pub const COLOUR_OFFSET_MAX: i32 = 20;

/// Two-object scenes satisfy `| |dx| - |dy| | >= MIN_AXIS_SEPARATION`, with
/// `(dx, dy)` the offset between the box centres in pixels, so the
/// relation (left of / above) is never ambiguous.
pub const MIN_AXIS_SEPARATION: u32 = 6;

/// The shape of an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Shape {
    /// A filled disk inscribed in the box.
    Circle,
    /// The whole box.
    Square,
    /// A triangle with its base on the bottom edge of the box and its apex
    /// at the middle of the top edge.
    Triangle,
}

impl Shape {
    /// Every shape, in vocabulary order.
    pub const ALL: [Shape; 3] = [Shape::Circle, Shape::Square, Shape::Triangle];

    /// The caption word for this shape.
    pub fn word(self) -> &'static str {
        match self {
            Shape::Circle => "circle",
            Shape::Square => "square",
            Shape::Triangle => "triangle",
        }
    }

    /// The shape a caption word names, if any (exact, lowercase match).
    pub fn from_word(word: &str) -> Option<Shape> {
        Self::ALL.into_iter().find(|shape| shape.word() == word)
    }
}

/// The size class of an object; it fixes the range its side `s` is drawn from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Size {
    /// Side in [`SMALL_SIDE_MIN`]`..=`[`SMALL_SIDE_MAX`].
    Small,
    /// Side in [`LARGE_SIDE_MIN`]`..=`[`LARGE_SIDE_MAX`].
    Large,
}

impl Size {
    /// Every size class, in vocabulary order.
    pub const ALL: [Size; 2] = [Size::Small, Size::Large];

    /// The caption word for this size class.
    pub fn word(self) -> &'static str {
        match self {
            Size::Small => "small",
            Size::Large => "large",
        }
    }

    /// The size class a caption word names, if any (exact, lowercase match).
    pub fn from_word(word: &str) -> Option<Size> {
        Self::ALL.into_iter().find(|size| size.word() == word)
    }

    /// The integer sides `s` an object of this class may have, in pixels.
    pub fn side_range(self) -> RangeInclusive<u32> {
        match self {
            Size::Small => SMALL_SIDE_MIN..=SMALL_SIDE_MAX,
            Size::Large => LARGE_SIDE_MIN..=LARGE_SIDE_MAX,
        }
    }
}

/// The named colour of an object; the drawn RGB is the base plus a small
/// per-channel offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Colour {
    /// Base RGB `(220, 40, 40)`.
    Red,
    /// Base RGB `(40, 190, 60)`.
    Green,
    /// Base RGB `(50, 90, 230)`.
    Blue,
    /// Base RGB `(235, 210, 40)`.
    Yellow,
    /// Base RGB `(235, 235, 235)`.
    White,
    /// Base RGB `(160, 60, 210)`.
    Purple,
}

impl Colour {
    /// Every colour, in vocabulary order.
    pub const ALL: [Colour; 6] = [
        Colour::Red,
        Colour::Green,
        Colour::Blue,
        Colour::Yellow,
        Colour::White,
        Colour::Purple,
    ];

    /// The caption word for this colour.
    pub fn word(self) -> &'static str {
        match self {
            Colour::Red => "red",
            Colour::Green => "green",
            Colour::Blue => "blue",
            Colour::Yellow => "yellow",
            Colour::White => "white",
            Colour::Purple => "purple",
        }
    }

    /// The colour a caption word names, if any (exact, lowercase match).
    pub fn from_word(word: &str) -> Option<Colour> {
        Self::ALL.into_iter().find(|colour| colour.word() == word)
    }

    /// The base RGB of this colour, before the per-channel offsets.
    pub fn base_rgb(self) -> [u8; 3] {
        match self {
            Colour::Red => [220, 40, 40],
            Colour::Green => [40, 190, 60],
            Colour::Blue => [50, 90, 230],
            Colour::Yellow => [235, 210, 40],
            Colour::White => [235, 235, 235],
            Colour::Purple => [160, 60, 210],
        }
    }

    /// The range a drawn channel may take: the base channel plus an offset
    /// in `[-COLOUR_OFFSET_MAX, COLOUR_OFFSET_MAX]`, clamped to `[0, 255]`.
    ///
    /// `channel` is 0 (red), 1 (green) or 2 (blue); other values are taken
    /// modulo 3.
    pub fn channel_range(self, channel: usize) -> RangeInclusive<u8> {
        let base = i32::from(self.base_rgb()[channel % 3]);
        let low = clamp_channel(base - COLOUR_OFFSET_MAX);
        let high = clamp_channel(base + COLOUR_OFFSET_MAX);
        low..=high
    }

    /// Whether `rgb` is a colour this named colour can be drawn with.
    pub fn admits(self, rgb: [u8; 3]) -> bool {
        rgb.iter()
            .enumerate()
            .all(|(channel, value)| self.channel_range(channel).contains(value))
    }
}

/// Clamps an offset channel value to the 8-bit range.
pub(crate) fn clamp_channel(value: i32) -> u8 {
    // The clamp makes the conversion lossless.
    value.clamp(0, i32::from(u8::MAX)) as u8
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.word())
    }
}

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.word())
    }
}

impl fmt::Display for Colour {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.word())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip() {
        for shape in Shape::ALL {
            assert_eq!(Shape::from_word(shape.word()), Some(shape));
        }
        for size in Size::ALL {
            assert_eq!(Size::from_word(size.word()), Some(size));
        }
        for colour in Colour::ALL {
            assert_eq!(Colour::from_word(colour.word()), Some(colour));
        }
        assert_eq!(Shape::from_word("Circle"), None);
        assert_eq!(Colour::from_word("grey"), None);
    }

    #[test]
    fn channel_ranges_clamp() {
        assert_eq!(Colour::White.channel_range(0), 215..=255);
        assert_eq!(Colour::Red.channel_range(0), 200..=240);
        assert_eq!(Colour::Red.channel_range(1), 20..=60);
        assert!(Colour::White.admits([255, 255, 215]));
        assert!(!Colour::White.admits([255, 255, 214]));
    }
}
