//! Seeded initialisation: candle's CPU random generator cannot be seeded,
//! so a fresh [`VarMap`] is re-drawn here from a seed, variable by variable
//! in name order, for reproducible training.

use candle_core::Tensor;
use candle_nn::VarMap;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal, Uniform};

use crate::error::{DecoderError, Result};

/// The standard deviation of embeddings, CLS tokens, positions and learned
/// queries.
pub const SMALL_INIT_STD: f32 = 0.02;

/// Re-draws every variable of `vars` from `seed`:
///
/// - `…norm.weight` → 1, `…norm.bias`, other biases and `…_gate` → 0;
/// - embeddings (`…embed_tokens.weight`, `…embed_positions.weight`), `…cls`,
///   `…positions`, `…queries` → N(0, 0.02);
/// - other matrices `(out, in)` → U(-1/√in, 1/√in).
///
/// The same seed and the same variables give the same values on every
/// machine.
pub fn seeded_init(vars: &VarMap, seed: u64) -> Result<()> {
    let data = vars.data().lock().map_err(|_| DecoderError::Argument {
        arg: "vars",
        reason: "the variable map's lock is poisoned".into(),
    })?;
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    for name in names {
        let var = &data[name];
        let t = var.as_tensor();
        let n = t.elem_count();
        let dims = t.dims().to_vec();
        let values: Vec<f32> = if name.ends_with("norm.weight") {
            vec![1.0; n]
        } else if name.ends_with(".bias") || name.ends_with("_gate") {
            vec![0.0; n]
        } else if name.ends_with("embed_tokens.weight")
            || name.ends_with("embed_positions.weight")
            || name.ends_with("cls")
            || name.ends_with("positions")
            || name.ends_with("queries")
        {
            let normal = Normal::new(0f32, SMALL_INIT_STD).map_err(|e| DecoderError::Argument {
                arg: "init",
                reason: e.to_string(),
            })?;
            (0..n).map(|_| normal.sample(&mut rng)).collect()
        } else {
            let fan_in = dims.last().copied().unwrap_or(1).max(1);
            let bound = 1.0 / (fan_in as f32).sqrt();
            let uniform =
                Uniform::new_inclusive(-bound, bound).map_err(|e| DecoderError::Argument {
                    arg: "init",
                    reason: e.to_string(),
                })?;
            (0..n).map(|_| uniform.sample(&mut rng)).collect()
        };
        let fresh = Tensor::from_vec(values, dims, t.device())?.to_dtype(t.dtype())?;
        var.set(&fresh)?;
    }
    Ok(())
}
