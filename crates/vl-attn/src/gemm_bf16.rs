//! vl's bf16 matrix product for many rows (the encoder, a prefill):
//! `y = x W^T` with `x (m, k)` and `W (n, k)` in bf16, accumulated in f32.
//!
//! Why vl owns it: candle's CPU backend has no fast bf16 product (its bf16
//! matmul is several times slower than its f32 one), so `--dtype bf16`
//! was vl's slowest mode. On CPUs with AVX512_BF16 this kernel runs
//! `vdpbf16ps` (two bf16 products summed into an f32 lane per
//! instruction): the weight is packed per call into panels of 32 columns ×
//! k/2 pairs, and a micro-kernel of up to 8 rows × 32 columns keeps 16
//! accumulators in registers; rows are split across the rayon pool. Elsewhere
//! ([`available`] false) callers use candle's product.
//!
//! Like [`crate::gemv`], a candle `CustomOp2` on the CPU, outside autograd:
//! [`crate::Proj`] routes plain bf16 CPU products of more than
//! [`crate::gemv::MAX_ROWS`] rows here.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

use crate::kernel::contiguous;

/// Columns of a packed panel: two AVX-512 registers of f32.
const NR: usize = 32;
/// Rows of the micro-kernel.
const MR: usize = 8;
/// Rows per parallel task (a multiple of [`MR`]).
const TASK_ROWS: usize = 8 * MR;

/// Whether this CPU runs the kernel (x86-64 with AVX512F and AVX512_BF16),
/// detected once.
pub fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Whether [`matmul`] takes `x` and `w`: the kernel [`available`], both
/// on the CPU and untracked, `w (n, k)` bf16 and contiguous with `k` even,
/// `x (..., k)` bf16 or f32 (rounded to bf16 for the products: the
/// weights-only bf16 of [`crate::Proj::quantize`]).
pub fn applies(x: &Tensor, w: &Tensor) -> bool {
    available()
        && x.device().is_cpu()
        && w.device().is_cpu()
        && !x.track_op()
        && !w.track_op()
        && matches!(x.dtype(), DType::BF16 | DType::F32)
        && w.dtype() == DType::BF16
        && w.rank() == 2
        && w.is_contiguous()
        && x.dims().last() == w.dims().get(1)
        && w.dims()[1].is_multiple_of(2)
        && x.elem_count() > 0
}

/// `x W^T` in bf16 with f32 accumulation.
///
/// # Shapes
/// `x: (..., k)` bf16 or f32 (made contiguous), `w: (n, k)` bf16
/// contiguous, `k` even → `(..., n)` in `x`'s dtype.
///
/// # Errors
/// When [`applies`] is false, with the reason.
pub fn matmul(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    if !applies(x, w) {
        candle_core::bail!(
            "vl-gemm-bf16: takes untracked bf16 or f32 CPU x (..., k) and a contiguous bf16 w (n, k), k even, on a CPU with AVX512_BF16 ({}); got x {:?} {:?}, w {:?} {:?}",
            available(),
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype()
        );
    }
    apply(x, w)
}

/// [`matmul`] for operands the caller has checked with [`applies`] (the op
/// itself still refuses what it cannot compute).
pub(crate) fn apply(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op2_no_bwd(w, &GemmBf16)
}

struct GemmBf16;

fn slice<'a>(s: &'a CpuStorage, l: &Layout, arg: &str) -> candle_core::Result<&'a [bf16]> {
    let CpuStorage::BF16(d) = s else {
        candle_core::bail!("vl-gemm-bf16: {arg} must be bf16, got {:?}", s.dtype());
    };
    contiguous(d, l, "vl-gemm-bf16", arg)
}

impl CustomOp2 for GemmBf16 {
    fn name(&self) -> &'static str {
        "vl-gemm-bf16"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, k) = l2.shape().dims2()?;
        let dims = l1.shape().dims();
        if dims.last() != Some(&k) || k % 2 != 0 || !available() {
            candle_core::bail!("vl-gemm-bf16: x {dims:?}, w ({n}, {k})");
        }
        let m = l1.shape().elem_count() / k;
        let w = slice(s2, l2, "w")?;
        let y = match s1 {
            CpuStorage::F32(x) => {
                let x = contiguous(x, l1, "vl-gemm-bf16", "x")?;
                let x: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                CpuStorage::F32(product(&x, w, m, n, k))
            }
            _ => CpuStorage::BF16(product(slice(s1, l1, "x")?, w, m, n, k)),
        };
        let mut shape = dims[..dims.len() - 1].to_vec();
        shape.push(n);
        Ok((y, Shape::from(shape)))
    }
}

/// `w (n, k)` as panels of [`NR`] columns: panel `j`, pair `p` holds
/// `w[j*NR + c][2p], w[j*NR + c][2p + 1]` for `c` in `0..NR` (as one u32
/// each), columns past `n` zero.
fn pack(w: &[bf16], n: usize, k: usize) -> Vec<u32> {
    let pairs = k / 2;
    let panels = n.div_ceil(NR);
    let mut packed = vec![0u32; panels * pairs * NR];
    packed
        .par_chunks_mut(pairs * NR)
        .enumerate()
        .for_each(|(j, panel)| {
            for c in 0..NR.min(n - j * NR) {
                let row = &w[(j * NR + c) * k..(j * NR + c + 1) * k];
                for (p, pair) in row.chunks_exact(2).enumerate() {
                    panel[p * NR + c] =
                        pair[0].to_bits() as u32 | ((pair[1].to_bits() as u32) << 16);
                }
            }
        });
    packed
}

/// An output element: the f32 accumulator rounded (bf16) or as is (f32).
trait Out: Copy + Default + Send + Sync {
    fn from_acc(v: f32) -> Self;
}

impl Out for bf16 {
    #[inline(always)]
    fn from_acc(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

impl Out for f32 {
    #[inline(always)]
    fn from_acc(v: f32) -> Self {
        v
    }
}

/// `y (m, n)` = `x (m, k)` times `w (n, k)` transposed.
fn product<O: Out>(x: &[bf16], w: &[bf16], m: usize, n: usize, k: usize) -> Vec<O> {
    let packed = pack(w, n, k);
    let mut y = vec![O::default(); m * n];
    y.par_chunks_mut(TASK_ROWS * n)
        .enumerate()
        .for_each(|(t, yt)| {
            let rows = yt.len() / n;
            let xt = &x[t * TASK_ROWS * k..(t * TASK_ROWS + rows) * k];
            // SAFETY: `product` runs only when `available()` (checked by
            // `cpu_fwd`), i.e. the CPU has AVX512F and AVX512_BF16.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                avx512::task(xt, &packed, yt, rows, n, k)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (xt, rows);
        });
    y
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use half::bf16;

    use super::{Out, MR, NR};

    /// Rows `x (rows, k)` into `y (rows, n)` over every panel.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) fn task<O: Out>(
        x: &[bf16],
        packed: &[u32],
        y: &mut [O],
        rows: usize,
        n: usize,
        k: usize,
    ) {
        let pairs = k / 2;
        for (j, panel) in packed.chunks_exact(pairs * NR).enumerate() {
            let cols = NR.min(n - j * NR);
            let mut r = 0;
            while r < rows {
                let mr = MR.min(rows - r);
                let xs = &x[r * k..(r + mr) * k];
                let mut tile = [[0f32; NR]; MR];
                match mr {
                    8 => micro::<8>(xs, panel, k, &mut tile),
                    7 => micro::<7>(xs, panel, k, &mut tile),
                    6 => micro::<6>(xs, panel, k, &mut tile),
                    5 => micro::<5>(xs, panel, k, &mut tile),
                    4 => micro::<4>(xs, panel, k, &mut tile),
                    3 => micro::<3>(xs, panel, k, &mut tile),
                    2 => micro::<2>(xs, panel, k, &mut tile),
                    _ => micro::<1>(xs, panel, k, &mut tile),
                }
                for (i, row) in tile.iter().take(mr).enumerate() {
                    let out = &mut y[(r + i) * n + j * NR..(r + i) * n + j * NR + cols];
                    for (o, v) in out.iter_mut().zip(row) {
                        *o = O::from_acc(*v);
                    }
                }
                r += mr;
            }
        }
    }

    /// `M` rows of `x` (each `k` long) times one panel into `tile`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn micro<const M: usize>(x: &[bf16], panel: &[u32], k: usize, tile: &mut [[f32; NR]; MR]) {
        let pairs = k / 2;
        debug_assert!(x.len() >= M * k && panel.len() >= pairs * NR);
        let mut acc = [[_mm512_setzero_ps(); 2]; M];
        for p in 0..pairs {
            // SAFETY: the panel holds `pairs * NR` u32; `p < pairs`, so the
            // 32 u32 read (two 512-bit loads) are inside it.
            let (b0, b1) = unsafe {
                let ptr = panel.as_ptr().add(p * NR) as *const __m512i;
                (_mm512_loadu_si512(ptr), _mm512_loadu_si512(ptr.add(1)))
            };
            // SAFETY: same size, plain bits.
            let (b0, b1) = unsafe {
                (
                    std::mem::transmute::<__m512i, __m512bh>(b0),
                    std::mem::transmute::<__m512i, __m512bh>(b1),
                )
            };
            for (r, a) in acc.iter_mut().enumerate() {
                // The pair x[r][2p], x[r][2p + 1] is one little-endian u32
                // in memory, low half first, as the panel packs it.
                // SAFETY: `r < M` rows of `k` values are in `x` and
                // `2p + 1 < k`; the read is unaligned-safe.
                let pair =
                    unsafe { (x.as_ptr().add(r * k + 2 * p) as *const i32).read_unaligned() };
                // SAFETY: same size, plain bits.
                let xa =
                    unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair)) };
                a[0] = _mm512_dpbf16_ps(a[0], xa, b0);
                a[1] = _mm512_dpbf16_ps(a[1], xa, b1);
            }
        }
        for (t, a) in tile.iter_mut().zip(&acc) {
            // SAFETY: each row of `tile` is NR = 32 f32, two 512-bit stores.
            unsafe {
                _mm512_storeu_ps(t.as_mut_ptr(), a[0]);
                _mm512_storeu_ps(t.as_mut_ptr().add(16), a[1]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Equals the f64 product of the bf16 values (relative error under
    /// 1e-2, the output being rounded to bf16) on odd shapes: rows not a
    /// multiple of 8 or of the task size, columns not a multiple of 32,
    /// 1 row and many; skipped (passing) on CPUs without AVX512_BF16.
    #[test]
    fn matches_the_reference() -> candle_core::Result<()> {
        if !available() {
            eprintln!("no AVX512_BF16 on this CPU: nothing to test");
            return Ok(());
        }
        let dev = Device::Cpu;
        for &(m, n, k) in &[(1, 1, 2), (9, 33, 18), (70, 100, 64), (130, 65, 770)] {
            let x = Tensor::randn(0f32, 1., (m, k), &dev)?.to_dtype(DType::BF16)?;
            let w = Tensor::randn(0f32, 1., (n, k), &dev)?.to_dtype(DType::BF16)?;
            let y = matmul(&x, &w)?;
            assert_eq!(y.dims(), &[m, n]);
            let want = x
                .to_dtype(DType::F64)?
                .matmul(&w.to_dtype(DType::F64)?.t()?)?;
            let scale = want.abs()?.max_all()?.to_scalar::<f64>()?.max(1e-3);
            let err = (y.to_dtype(DType::F64)? - &want)?
                .abs()?
                .max_all()?
                .to_scalar::<f64>()?
                / scale;
            assert!(err < 1e-2, "({m}, {k}) x ({n}, {k}): {err}");
            // f32 activations (rounded to bf16 inside) give f32 outputs:
            // the same products, without the output's rounding.
            let y32 = matmul(&x.to_dtype(DType::F32)?, &w)?;
            assert_eq!(y32.dtype(), DType::F32);
            let err = (y32.to_dtype(DType::F64)? - &want)?
                .abs()?
                .max_all()?
                .to_scalar::<f64>()?
                / scale;
            assert!(err < 1e-5, "f32 x: ({m}, {k}) x ({n}, {k}): {err}");
        }
        Ok(())
    }

    /// Odd k, f16 activations, a tracked weight: refused with a reason.
    #[test]
    fn refuses_what_it_does_not_take() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::zeros((4, 6), DType::BF16, &dev)?;
        let cases = [
            (
                Tensor::zeros((2, 5), DType::BF16, &dev)?,
                Tensor::zeros((4, 5), DType::BF16, &dev)?,
            ),
            (Tensor::zeros((2, 6), DType::F16, &dev)?, w.clone()),
            (
                Tensor::zeros((2, 6), DType::BF16, &dev)?,
                candle_core::Var::from_tensor(&w)?.as_tensor().clone(),
            ),
        ];
        for (x, w) in cases {
            assert!(!applies(&x, &w));
            let err = matmul(&x, &w).unwrap_err().to_string();
            assert!(err.contains("vl-gemm-bf16"), "{err}");
        }
        Ok(())
    }
}
