//! Seeded sampling of scenes from the shapes-world distribution.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::scene::{check_pair, Object, Scene};
use crate::world::{
    clamp_channel, Colour, Shape, Size, BACKGROUND_MAX, BACKGROUND_MIN, COLOUR_OFFSET_MAX,
    IMAGE_SIZE, MARGIN, TWO_OBJECT_PROBABILITY,
};

/// The random generator every seeded sampler of this crate uses.
pub type ShapesRng = ChaCha8Rng;

/// The generator for scene `index` of the dataset with `seed`: ChaCha8
/// seeded from `seed`, on stream `index`. Stream 0 is the plain
/// `seed_from_u64(seed)` generator.
pub fn scene_rng(seed: u64, index: u64) -> ShapesRng {
    let mut rng = ShapesRng::seed_from_u64(seed);
    rng.set_stream(index);
    rng
}

/// Scene `index` of the dataset with `seed`; the same pair always gives the
/// same scene, whatever other scenes were sampled before.
pub fn dataset_scene(seed: u64, index: u64) -> Scene {
    sample_scene(&mut scene_rng(seed, index))
}

impl Scene {
    /// The scene sampled from `ShapesRng::seed_from_u64(seed)`; equal to
    /// [`dataset_scene`]`(seed, 0)`.
    pub fn sample(seed: u64) -> Scene {
        sample_scene(&mut ShapesRng::seed_from_u64(seed))
    }
}

/// Samples a scene: background grey uniform in
/// `[BACKGROUND_MIN, BACKGROUND_MAX]`; one or two objects with equal
/// probability; each object drawn independently by [`sample_object`]. Two
/// objects are drawn again, both, until they obey the pair rules, so the
/// pair follows the independent distribution conditioned on those rules.
///
/// Terminates with probability 1 for a uniform generator.
pub fn sample_scene<R: Rng + ?Sized>(rng: &mut R) -> Scene {
    let background = rng.random_range(BACKGROUND_MIN..=BACKGROUND_MAX);
    if !rng.random_bool(TWO_OBJECT_PROBABILITY) {
        return Scene::one_unchecked(background, sample_object(rng));
    }
    loop {
        let a = sample_object(rng);
        let b = sample_object(rng);
        if check_pair(&a, &b).is_ok() {
            return Scene::two_unchecked(background, [a, b]);
        }
    }
}

/// Samples one object on its own: shape, size class and colour uniform;
/// side `s` uniform in the class's range; each RGB channel its base plus a
/// uniform offset in `[-COLOUR_OFFSET_MAX, COLOUR_OFFSET_MAX]`, clamped;
/// corner `x` and `y` uniform in `[MARGIN, IMAGE_SIZE - MARGIN - s]`.
pub fn sample_object<R: Rng + ?Sized>(rng: &mut R) -> Object {
    let shape = Shape::ALL[rng.random_range(0..Shape::ALL.len())];
    let size = Size::ALL[rng.random_range(0..Size::ALL.len())];
    let colour = Colour::ALL[rng.random_range(0..Colour::ALL.len())];
    let s = rng.random_range(size.side_range());
    let rgb = colour.base_rgb().map(|base| {
        clamp_channel(i32::from(base) + rng.random_range(-COLOUR_OFFSET_MAX..=COLOUR_OFFSET_MAX))
    });
    let corners = MARGIN..=IMAGE_SIZE - MARGIN - s;
    let x = rng.random_range(corners.clone());
    let y = rng.random_range(corners);
    Object {
        shape,
        size,
        colour,
        s,
        x,
        y,
        rgb,
    }
}
