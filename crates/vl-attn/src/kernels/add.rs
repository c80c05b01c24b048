//! Residual additions of bf16 and f32 activations on CPU.
//!
//! Why vl owns it: candle's CPU bf16 addition widens, adds and rounds
//! through its `CpuBF16` helpers, which call `_mm256_cvtneps_pbh` as a
//! function (candle is not compiled for AVX512_BF16): with `--dtype bf16`
//! the ViT-B encoder's 24 residual additions per image took ~8% of the
//! encode (a profile of `vl bench --dtype bf16`). Here the same
//! arithmetic — widen, add in f32, round to nearest even with
//! `vcvtneps2bf16` — runs 16 values per instruction, split across the
//! rayon pool. Anything else (other dtypes or devices, broadcasting,
//! tracked tensors, CPUs without AVX512_BF16) is candle's `a + b`. The
//! same arithmetic in plain Rust is the fallback of [`add_with`] and the
//! oracle.
//!
//! f32 additions run on the rayon pool too, each task writing its own
//! chunk of the sum: candle hands them to a thread pool of its own, whose
//! workers then compete with vl's for the cores (and whose hand-over
//! showed among the single-core stretches of a Florence-2 encode). The
//! sums are IEEE additions, the same bits either way.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::features::Bf16Simd;
use super::features::{Bf16Isa, CpuFeatures};
use crate::kernels::host::{contiguous, par_filled};

/// Elements per parallel task.
const CHUNK: usize = 16 * 1024;

/// `a + b`, the two of one shape: on vl's kernel for untracked bf16 CPU
/// tensors where the CPU has AVX512_BF16, candle's addition otherwise
/// (which broadcasts nothing either: shapes must match).
///
/// # Errors
/// Candle's: shapes or dtypes that differ.
pub fn add(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let plain = a.device().is_cpu()
        && a.dtype() == b.dtype()
        && a.dims() == b.dims()
        && !a.track_op()
        && !b.track_op();
    match a.dtype() {
        DType::F32 if plain => a.contiguous()?.apply_op2_no_bwd(&b.contiguous()?, &F32Add),
        DType::BF16 if plain && crate::kernels::gemm_bf16::accelerated() => {
            add_with(CpuFeatures::get().bf16_isa(), a, b)
        }
        _ => a + b,
    }
}

/// `a + b` for two bf16 CPU tensors of one shape on a given
/// implementation (the token proves the CPU runs it): the portable one
/// anywhere.
///
/// # Errors
/// Other dtypes, devices or shapes, named.
pub fn add_with(isa: Bf16Isa, a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    if !a.device().is_cpu() || !b.device().is_cpu() {
        candle_core::bail!(
            "vl-bf16-add: a and b must be on the CPU, got {:?} and {:?}",
            a.device(),
            b.device()
        );
    }
    a.contiguous()?
        .apply_op2_no_bwd(&b.contiguous()?, &Bf16Add { isa })
}

struct Bf16Add {
    isa: Bf16Isa,
}

/// The two operands of an addition as contiguous slices, or an error
/// naming the op and what differs.
fn operands<'a, T>(
    op: &str,
    (a, l1): (&'a [T], &Layout),
    (b, l2): (&'a [T], &Layout),
) -> candle_core::Result<(&'a [T], &'a [T])> {
    if l1.dims() != l2.dims() {
        candle_core::bail!("{op}: shapes differ, {:?} and {:?}", l1.dims(), l2.dims());
    }
    Ok((contiguous(a, l1, op, "a")?, contiguous(b, l2, op, "b")?))
}

/// `a + b` for f32 on the rayon pool.
struct F32Add;

impl CustomOp2 for F32Add {
    fn name(&self) -> &'static str {
        "vl-f32-add"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(a), CpuStorage::F32(b)) = (s1, s2) else {
            candle_core::bail!(
                "vl-f32-add: a and b must be f32, got {:?} and {:?}",
                s1.dtype(),
                s2.dtype()
            );
        };
        let (a, b) = operands("vl-f32-add", (a, l1), (b, l2))?;
        let y = par_filled(a.len(), CHUNK, |i, y| {
            let (a, b) = (&a[i * CHUNK..][..y.len()], &b[i * CHUNK..][..y.len()]);
            for (y, (a, b)) in y.iter_mut().zip(a.iter().zip(b)) {
                *y = a + b;
            }
        });
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }
}

impl CustomOp2 for Bf16Add {
    fn name(&self) -> &'static str {
        "vl-bf16-add"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::BF16(a), CpuStorage::BF16(b)) = (s1, s2) else {
            candle_core::bail!(
                "vl-bf16-add: a and b must be bf16, got {:?} and {:?}",
                s1.dtype(),
                s2.dtype()
            );
        };
        let (a, b) = operands("vl-bf16-add", (a, l1), (b, l2))?;
        let mut y = vec![bf16::ZERO; a.len()];
        let chunks = y
            .par_chunks_mut(CHUNK)
            .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)));
        match self.isa.simd() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves AVX512F and AVX512_BF16.
            Bf16Simd::Amx | Bf16Simd::Avx512Bf16 | Bf16Simd::Avx512Fma => {
                chunks.for_each(|(y, (a, b))| unsafe { add_avx512(a, b, y) })
            }
            _ => chunks.for_each(|(y, (a, b))| add_portable(a, b, y)),
        }
        Ok((CpuStorage::BF16(y), l1.shape().clone()))
    }
}

/// `y = a + b` in plain Rust: each pair widened, added in f32 and rounded
/// to nearest even (`bf16::from_f32`), as the AVX-512 version and
/// candle's addition round (subnormal results aside, which `vcvtneps2bf16`
/// flushes to zero and this keeps).
fn add_portable(a: &[bf16], b: &[bf16], y: &mut [bf16]) {
    for (y, (a, b)) in y.iter_mut().zip(a.iter().zip(b)) {
        *y = bf16::from_f32(a.to_f32() + b.to_f32());
    }
}

/// `y = a + b` with AVX-512, rounded as candle's bf16 addition rounds on
/// AVX512_BF16 CPUs: 16 values at a time widened
/// ([`crate::kernels::gemv::Weight::load16`]), added and rounded ([`crate::kernels::gemm_bf16::store_bf16x16`]: to nearest
/// even, subnormal inputs and results flushed to zero as candle's path
/// does); the tail through the same instructions on padded vectors.
///
/// # Safety
/// The CPU has AVX512F and AVX512_BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn add_avx512(a: &[bf16], b: &[bf16], y: &mut [bf16]) {
    use std::arch::x86_64::_mm512_add_ps;

    use crate::kernels::gemm_bf16::store_bf16x16;
    use crate::kernels::gemv::Weight;
    let n = y.len().min(a.len()).min(b.len());
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: values `i..i + 16` exist in `a`, `b` and `y`.
        unsafe {
            let sum = _mm512_add_ps(
                bf16::load16(a.as_ptr().add(i)),
                bf16::load16(b.as_ptr().add(i)),
            );
            store_bf16x16(y.as_mut_ptr().add(i), sum);
        }
        i += 16;
    }
    if i < n {
        let (mut pa, mut pb, mut py) = ([bf16::ZERO; 16], [bf16::ZERO; 16], [bf16::ZERO; 16]);
        pa[..n - i].copy_from_slice(&a[i..n]);
        pb[..n - i].copy_from_slice(&b[i..n]);
        // SAFETY: the padded buffers hold 16 values each.
        unsafe {
            let sum = _mm512_add_ps(bf16::load16(pa.as_ptr()), bf16::load16(pb.as_ptr()));
            store_bf16x16(py.as_mut_ptr(), sum);
        }
        y[i..n].copy_from_slice(&py[..n - i]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// `a + b` rounded to bf16 the documented way, from the bits: the
    /// sum of two f32 is exact in f64, rounded once to f32, then to the
    /// nearest bf16 with ties to even (NaN aside, which the inputs lack).
    fn oracle(a: f32, b: f32) -> f32 {
        let sum = (a as f64 + b as f64) as f32;
        let bits = sum.to_bits();
        if sum.is_infinite() {
            return sum;
        }
        let lsb = (bits >> 16) & 1;
        f32::from_bits((bits + 0x7FFF + lsb) & 0xFFFF_0000)
    }

    /// Every implementation this CPU runs gives the oracle's bytes, and so
    /// does [`add`] where it routes to them (on x86-64 candle's addition
    /// gives the same bytes; on aarch64 it rounds some ties otherwise):
    /// lengths past and off the vector width and the task size, values
    /// from 1e-30 to 1e30 of both signs, ties of the rounding,
    /// infinities; other dtypes and broadcasting go to candle; shapes
    /// that differ are an error.
    #[test]
    fn every_implementation_rounds_to_nearest_even() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        for n in [1, 15, 16, 17, 1000, CHUNK + 33] {
            let a: Vec<f32> = (0..n)
                .map(|i| {
                    let m = ((i * 7919) % 2001) as f32 / 1000.0 - 1.0;
                    m * 10f32.powi((i % 61) as i32 - 30)
                })
                .collect();
            let mut b: Vec<f32> = (0..n)
                .map(|i| ((i * 104_729) % 3001) as f32 - 1500.0)
                .collect();
            // 1 + 2^-8 is a tie between two bf16 neighbours of 1.
            b[0] = 1.0 / 256.0;
            let mut a = a;
            a[0] = 1.0;
            if n > 2 {
                (a[1], a[2]) = (f32::INFINITY, f32::NEG_INFINITY);
            }
            let a = Tensor::from_vec(a, n, &dev)?.to_dtype(DType::BF16)?;
            let b = Tensor::from_vec(b, n, &dev)?.to_dtype(DType::BF16)?;
            let wide = |t: &Tensor| t.to_dtype(DType::F32)?.to_vec1::<f32>();
            let want: Vec<f32> = wide(&a)?
                .iter()
                .zip(wide(&b)?)
                .map(|(&a, b)| oracle(a, b))
                .collect();
            let mut all = Vec::new();
            if crate::kernels::gemm_bf16::accelerated() {
                all.push(("add", add(&a, &b)?));
                #[cfg(target_arch = "x86_64")]
                all.push(("candle", (&a + &b)?));
            }
            for isa in CpuFeatures::get().bf16_isas() {
                all.push((
                    if isa == Bf16Isa::portable() {
                        "portable"
                    } else {
                        "simd"
                    },
                    add_with(isa, &a, &b)?,
                ));
            }
            for (name, got) in all {
                let got = got.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                assert_eq!(got.len(), want.len());
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(g.to_bits() == w.to_bits(), "{name} n {n}, {i}: {g} vs {w}");
                }
            }
        }
        let a = Tensor::zeros((2, 3), DType::BF16, &dev)?;
        let err = add_with(
            Bf16Isa::portable(),
            &a,
            &Tensor::zeros((3, 2), DType::BF16, &dev)?,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("[2, 3]") && err.contains("[3, 2]"), "{err}");
        let f = Tensor::new(&[1f32, 2.0], &dev)?;
        assert_eq!(add(&f, &f)?.to_vec1::<f32>()?, [2.0, 4.0]);
        let a = Tensor::zeros((2, 3), DType::BF16, &dev)?;
        assert!(add(&a, &Tensor::zeros((3, 2), DType::BF16, &dev)?).is_err());
        Ok(())
    }

    /// f32 sums on the pool equal candle's, for sizes around the tasks'
    /// chunk, contiguous or not; other shapes are refused by name.
    #[test]
    fn f32_sums_are_candles() -> candle_core::Result<()> {
        let dev = candle_core::Device::Cpu;
        for n in [1, 17, CHUNK, 3 * CHUNK + 5] {
            let a = Tensor::randn(0f32, 1., (n, 2), &dev)?;
            let b = Tensor::randn(0f32, 1., (2, n), &dev)?.t()?;
            let got = add(&a, &b)?.flatten_all()?.to_vec1::<f32>()?;
            let want = (&a + &b)?.flatten_all()?.to_vec1::<f32>()?;
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(g, w)| g.to_bits() == w.to_bits()),
                "{n}"
            );
        }
        let a = Tensor::zeros((2, 3), DType::F32, &dev)?;
        let b = Tensor::zeros((3, 2), DType::F32, &dev)?;
        assert!(add(&a, &b).is_err());
        Ok(())
    }
}
