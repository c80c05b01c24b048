//! Reading transformers tensors into candle-nn layers, shared by the
//! families.

use candle_nn::{Linear, VarBuilder};
use vl_attn::LayerNorm;

use crate::error::Result;

/// A `torch.nn.Linear` `weight (out, in)`, `bias (out)`.
pub(super) fn linear(vb: VarBuilder, inp: usize, out: usize, bias: bool) -> Result<Linear> {
    let w = vb.get((out, inp), "weight")?;
    let b = if bias {
        Some(vb.get(out, "bias")?)
    } else {
        None
    };
    Ok(Linear::new(w, b))
}

pub(super) fn layer_norm(vb: VarBuilder, width: usize, eps: f64) -> Result<LayerNorm> {
    Ok(LayerNorm::load(width, eps, vb)?)
}

/// `w (rows, cols)` transposed to a contiguous `(cols, rows)`. On CPU in
/// blocks of 32 × 32, output rows split across the pool: candle's strided
/// copy walks a transposed view one element at a time (~11% of a vit-gpt2
/// caption's wall time, its load included, went to GPT-2's Conv1D
/// weights). Elsewhere (and for other dtypes) candle's `t().contiguous()`.
pub(super) fn transposed(w: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    use candle_core::DType;
    fn blocked<T: candle_core::WithDType>(
        w: &candle_core::Tensor,
        rows: usize,
        cols: usize,
    ) -> candle_core::Result<candle_core::Tensor> {
        use rayon::prelude::*;
        const B: usize = 32;
        // Read in place (a weight just read), copied if not contiguous.
        let dst = vl_attn::kernels::with_values(w, |src: &[T]| {
            let mut dst = vec![T::from_f64(0.0); rows * cols];
            if rows > 0 {
                dst.par_chunks_mut(B * rows)
                    .enumerate()
                    .for_each(|(block, out)| {
                        let j0 = block * B;
                        let width = out.len() / rows;
                        for i0 in (0..rows).step_by(B) {
                            for j in 0..width {
                                for i in i0..(i0 + B).min(rows) {
                                    out[j * rows + i] = src[i * cols + j0 + j];
                                }
                            }
                        }
                    });
            }
            dst
        })?;
        candle_core::Tensor::from_vec(dst, (cols, rows), w.device())
    }
    let (rows, cols) = w.dims2()?;
    if !w.device().is_cpu() {
        return Ok(w.t()?.contiguous()?);
    }
    Ok(match w.dtype() {
        DType::F32 => blocked::<f32>(w, rows, cols)?,
        DType::BF16 => blocked::<half::bf16>(w, rows, cols)?,
        DType::F16 => blocked::<half::f16>(w, rows, cols)?,
        _ => w.t()?.contiguous()?,
    })
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    /// The blocked transpose equals candle's, for shapes off the block
    /// size and every dtype it handles (and one it leaves to candle).
    #[test]
    fn transposed_equals_candles() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        for (r, c) in [(1, 1), (3, 70), (33, 65), (64, 32), (100, 7)] {
            let w = Tensor::arange(0f32, (r * c) as f32, &dev)?.reshape((r, c))?;
            for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
                let w = w.to_dtype(dtype)?;
                let got = super::transposed(&w).map_err(candle_core::Error::wrap)?;
                let want = w.t()?.contiguous()?;
                assert_eq!(got.dims(), &[c, r]);
                let diff = (got.to_dtype(DType::F64)? - want.to_dtype(DType::F64)?)?
                    .abs()?
                    .sum_all()?
                    .to_scalar::<f64>()?;
                assert_eq!(diff, 0.0, "{dtype:?} {r}x{c}");
            }
        }
        Ok(())
    }
}
