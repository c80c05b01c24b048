//! Inverted dropout with seeded, reproducible masks, and the
//! training/inference switch that turns it on.
//!
//! - [`Dropout`]: a probability `p` in `[0, 1)`. In training it zeroes each
//!   element with probability `p` and scales the kept ones by `1 / (1 - p)`,
//!   so that the expectation is unchanged; in inference (or with `p = 0`) it
//!   returns its input itself, bit for bit.
//! - [`Mode`]: [`Mode::Inference`] (the default everywhere) or
//!   [`Mode::Training`] with a [`DropoutRng`].
//! - [`DropoutRng`]: a seed and a draw counter shared by its clones. Draw
//!   `n` of seed `s` is a pure function of `(s, n)` and the element index
//!   (a SplitMix64 hash), so the same seed and the same sequence of calls
//!   give the same masks on every run, thread count and device. Masks are
//!   drawn on the CPU (in parallel) and copied to the tensor's device.
//!
//! Attention modules apply their [`Dropout`] to the attention probabilities
//! (see [`crate::attention::attention_with_dropout`] for the backends);
//! decoders apply theirs to residual branches and embeddings.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use crate::error::{AttnError, Result};

/// Bits of a hash that make one uniform draw in `[0, 1)`.
const UNIFORM_BITS: u32 = 24;

/// SplitMix64's increment (the golden ratio in 64 bits).
const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's finaliser: a bijective hash of 64 bits.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The source of dropout masks: a seed and a counter of draws, shared by
/// clones (a model hands one clone to each of its modules, and they draw in
/// the order the forward pass calls them).
#[derive(Debug, Clone)]
pub struct DropoutRng {
    seed: u64,
    draws: Arc<AtomicU64>,
}

impl DropoutRng {
    /// A fresh generator: draw 0 of `seed` comes next.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            draws: Arc::default(),
        }
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Masks drawn so far, by this generator and its clones.
    pub fn draws(&self) -> u64 {
        self.draws.load(Ordering::Relaxed)
    }

    /// The key of the next mask; each call advances the counter.
    fn next_key(&self) -> u64 {
        let draw = self.draws.fetch_add(1, Ordering::Relaxed);
        mix(self.seed.wrapping_add(mix(draw.wrapping_add(GOLDEN_GAMMA))))
    }
}

/// Whether a forward pass trains (dropout on) or infers (dropout off).
#[derive(Debug, Clone, Default)]
pub enum Mode {
    /// Dropout is the identity. The default.
    #[default]
    Inference,
    /// Dropout draws its masks from the generator.
    Training(DropoutRng),
}

impl Mode {
    /// Training with a fresh [`DropoutRng`] of `seed`.
    pub fn training(seed: u64) -> Self {
        Self::Training(DropoutRng::new(seed))
    }

    /// Whether this is [`Mode::Training`].
    pub fn is_training(&self) -> bool {
        matches!(self, Self::Training(_))
    }
}

/// Inverted dropout of probability `p`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Dropout {
    p: f64,
}

impl Dropout {
    /// No dropout (`p = 0`).
    pub const NONE: Self = Self { p: 0.0 };

    /// Dropout of probability `p`.
    ///
    /// # Errors
    /// [`AttnError::Argument`] naming `arg` (the caller's field, e.g.
    /// `"attention_dropout"`) unless `0 <= p < 1`.
    pub fn new(arg: &'static str, p: f64) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            return Err(AttnError::Argument {
                arg,
                reason: format!("expected a dropout probability in [0, 1), got {p}"),
            });
        }
        Ok(Self { p })
    }

    /// The probability of dropping an element.
    pub fn p(&self) -> f64 {
        self.p
    }

    /// Whether `mode` makes this dropout do anything (training, `p > 0`).
    pub fn is_active(&self, mode: &Mode) -> bool {
        self.p > 0.0 && mode.is_training()
    }

    /// In training, `x` with each element zeroed with probability `p` and
    /// the others scaled by `1 / (1 - p)`, one mask drawn from the mode's
    /// generator; differentiable (the mask is a constant factor). In
    /// inference or with `p = 0`, `x` itself (a clone of the handle: the
    /// same storage, bit-identical).
    ///
    /// # Shapes
    /// `x`: any shape → the same shape.
    pub fn forward(&self, x: &Tensor, mode: &Mode) -> Result<Tensor> {
        let Mode::Training(rng) = mode else {
            return Ok(x.clone());
        };
        if self.p == 0.0 {
            return Ok(x.clone());
        }
        let mask = self.mask(x.elem_count(), rng.next_key());
        let mask = Tensor::from_vec(mask, x.shape(), x.device())?;
        let mask = match x.dtype() {
            DType::F32 => mask,
            dtype => mask.to_dtype(dtype)?,
        };
        Ok(x.mul(&mask)?)
    }

    /// `n` factors, each 0 (probability `p`) or `1 / (1 - p)`; element `i`
    /// depends only on `key` and `i`.
    fn mask(&self, n: usize, key: u64) -> Vec<f32> {
        let keep = (1.0 / (1.0 - self.p)) as f32;
        let scale = 1.0 / (1u64 << UNIFORM_BITS) as f64;
        (0..n)
            .into_par_iter()
            .map(|i| {
                let h = mix(key ^ (i as u64).wrapping_mul(GOLDEN_GAMMA));
                let u = (h >> (u64::BITS - UNIFORM_BITS)) as f64 * scale;
                if u < self.p {
                    0.0
                } else {
                    keep
                }
            })
            .collect()
    }
}
