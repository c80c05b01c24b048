//! Caption writing and strict caption parsing.
//!
//! Grammar (words separated by exactly one space, nothing else):
//!
//! ```text
//! caption  = object [ relation object ]
//! object   = "a" size colour shape
//! relation = "to the left of" | "to the right of" | "above" | "below"
//! ```

use thiserror::Error;

use crate::key::{ObjectKey, Relation, SceneKey};
use crate::scene::Scene;
use crate::world::{Colour, Shape, Size};

/// Every word the caption grammar can produce, in a fixed order (the
/// captioner's tokenizer is built from it; append, never reorder).
pub const VOCAB: &[&str] = &[
    "a", "small", "large", "red", "green", "blue", "yellow", "white", "purple", "circle", "square",
    "triangle", "to", "the", "left", "right", "of", "above", "below",
];

/// The canonical caption of a scene: the object phrase, or the left (upper)
/// object `to the left of` (`above`) the other.
pub fn caption(scene: &Scene) -> String {
    scene.caption()
}

/// Why a caption is not in the grammar. Positions count words from 1, words
/// being what lies between single spaces.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ParseError {
    /// The caption is the empty string.
    #[error("empty caption")]
    Empty,
    /// Two spaces in a row, or a leading or trailing space.
    #[error("empty word at position {position}: extra, leading or trailing space")]
    EmptyWord {
        /// Position of the empty word.
        position: usize,
    },
    /// A word other than the grammar allows here (unknown, uppercase,
    /// punctuated or out of place).
    #[error("word {position} {word:?}: expected {expected}")]
    UnexpectedWord {
        /// Position of the offending word.
        position: usize,
        /// The offending word.
        word: String,
        /// What the grammar allows at this position.
        expected: &'static str,
    },
    /// The caption stops in the middle of a phrase.
    #[error("caption ends at word {position}: expected {expected}")]
    UnexpectedEnd {
        /// Position the missing word would have.
        position: usize,
        /// What the grammar needs at this position.
        expected: &'static str,
    },
    /// Words follow a complete two-object caption.
    #[error("word {position} {word:?}: trailing word after a complete caption")]
    TrailingWords {
        /// Position of the first trailing word.
        position: usize,
        /// The first trailing word.
        word: String,
    },
}

const EXPECT_ARTICLE: &str = "\"a\"";
const EXPECT_SIZE: &str = "a size (small, large)";
const EXPECT_COLOUR: &str = "a colour (red, green, blue, yellow, white, purple)";
const EXPECT_SHAPE: &str = "a shape (circle, square, triangle)";
const EXPECT_RELATION: &str =
    "end of caption or a relation (to the left of, to the right of, above, below)";
const EXPECT_THE: &str = "\"the\"";
const EXPECT_SIDE: &str = "\"left\" or \"right\"";
const EXPECT_OF: &str = "\"of\"";

/// A cursor over the space-separated words of a caption.
struct Words<'a> {
    words: Vec<&'a str>,
    next: usize,
}

impl<'a> Words<'a> {
    /// The next word, or an error naming what was expected if there is
    /// none or it is empty.
    fn take(&mut self, expected: &'static str) -> Result<&'a str, ParseError> {
        let position = self.next + 1;
        let word = *self
            .words
            .get(self.next)
            .ok_or(ParseError::UnexpectedEnd { position, expected })?;
        if word.is_empty() {
            return Err(ParseError::EmptyWord { position });
        }
        self.next += 1;
        Ok(word)
    }

    /// Takes the next word and maps it with `read`, naming `expected` when
    /// `read` rejects it.
    fn read<T>(
        &mut self,
        expected: &'static str,
        read: impl FnOnce(&str) -> Option<T>,
    ) -> Result<T, ParseError> {
        let word = self.take(expected)?;
        read(word).ok_or_else(|| ParseError::UnexpectedWord {
            position: self.next,
            word: word.to_owned(),
            expected,
        })
    }

    /// Takes the next word, which must be `literal`.
    fn expect(&mut self, literal: &'static str, expected: &'static str) -> Result<(), ParseError> {
        self.read(expected, |word| (word == literal).then_some(()))
    }

    fn is_done(&self) -> bool {
        self.next == self.words.len()
    }

    /// `a {size} {colour} {shape}`.
    fn object(&mut self) -> Result<ObjectKey, ParseError> {
        self.expect("a", EXPECT_ARTICLE)?;
        let size = self.read(EXPECT_SIZE, Size::from_word)?;
        let colour = self.read(EXPECT_COLOUR, Colour::from_word)?;
        let shape = self.read(EXPECT_SHAPE, Shape::from_word)?;
        Ok(ObjectKey {
            size,
            colour,
            shape,
        })
    }

    /// A relation phrase, as the canonical relation and whether it is the
    /// reversed phrasing (`to the right of`, `below`).
    fn relation(&mut self) -> Result<(Relation, bool), ParseError> {
        let phrase = self.read(EXPECT_RELATION, |word| match word {
            "to" => Some(None),
            "above" => Some(Some((Relation::Above, false))),
            "below" => Some(Some((Relation::Above, true))),
            _ => None,
        })?;
        if let Some(relation) = phrase {
            return Ok(relation);
        }
        self.expect("the", EXPECT_THE)?;
        let reversed = self.read(EXPECT_SIDE, |word| match word {
            "left" => Some(false),
            "right" => Some(true),
            _ => None,
        })?;
        self.expect("of", EXPECT_OF)?;
        Ok((Relation::LeftOf, reversed))
    }
}

/// Reads a caption back into its scene key, strictly: lowercase grammar
/// words separated by single spaces, no punctuation, nothing before or
/// after. `X to the right of Y` reads as `Y to the left of X`, and
/// `X below Y` as `Y above X`.
pub fn parse_caption(caption: &str) -> Result<SceneKey, ParseError> {
    if caption.is_empty() {
        return Err(ParseError::Empty);
    }
    let mut words = Words {
        words: caption.split(' ').collect(),
        next: 0,
    };
    let left = words.object()?;
    if words.is_done() {
        return Ok(SceneKey::One(left));
    }
    let (relation, reversed) = words.relation()?;
    let right = words.object()?;
    if let Some(word) = words.words.get(words.next) {
        return Err(ParseError::TrailingWords {
            position: words.next + 1,
            word: (*word).to_owned(),
        });
    }
    let (first, second) = if reversed {
        (right, left)
    } else {
        (left, right)
    };
    Ok(SceneKey::Two {
        first,
        relation,
        second,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn vocab_is_exactly_the_grammar_words() {
        let mut expected: BTreeSet<&str> = ["a", "to", "the", "left", "right", "of"]
            .into_iter()
            .chain(["above", "below"])
            .collect();
        expected.extend(Size::ALL.map(Size::word));
        expected.extend(Colour::ALL.map(Colour::word));
        expected.extend(Shape::ALL.map(Shape::word));
        let vocab: BTreeSet<&str> = VOCAB.iter().copied().collect();
        assert_eq!(vocab.len(), VOCAB.len(), "duplicate word in VOCAB");
        assert_eq!(vocab, expected);
    }

    #[test]
    fn error_positions_name_the_word() {
        assert_eq!(
            parse_caption("a small red circle to the lft of a large blue square"),
            Err(ParseError::UnexpectedWord {
                position: 7,
                word: "lft".into(),
                expected: EXPECT_SIDE,
            })
        );
        assert_eq!(
            parse_caption("a small red"),
            Err(ParseError::UnexpectedEnd {
                position: 4,
                expected: EXPECT_SHAPE,
            })
        );
        assert_eq!(
            parse_caption("a small  red circle"),
            Err(ParseError::EmptyWord { position: 3 })
        );
    }
}
