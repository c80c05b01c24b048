//! Scoring predicted captions against true scenes.

use std::borrow::Borrow;

use crate::caption::parse_caption;
use crate::scene::Scene;

/// Whether `prediction` is a correct caption of `truth`: it parses, and the
/// scene it reads back into has the same objects (size, colour, shape) and,
/// for two objects, the same relation between the same two. Either phrasing
/// of a relation counts.
pub fn score(prediction: &str, truth: &Scene) -> bool {
    parse_caption(prediction).is_ok_and(|key| key == truth.key())
}

/// The share of `(prediction, truth)` pairs that [`score`] counts correct,
/// in `[0, 1]`; `0.0` when there are no pairs.
pub fn scene_accuracy<I, P, S>(pairs: I) -> f64
where
    I: IntoIterator<Item = (P, S)>,
    P: AsRef<str>,
    S: Borrow<Scene>,
{
    let (correct, total) =
        pairs
            .into_iter()
            .fold((0_u64, 0_u64), |(correct, total), (prediction, truth)| {
                let hit = score(prediction.as_ref(), truth.borrow());
                (correct + u64::from(hit), total + 1)
            });
    if total == 0 {
        0.0
    } else {
        correct as f64 / total as f64
    }
}
