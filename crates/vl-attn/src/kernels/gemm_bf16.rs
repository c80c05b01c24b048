//! vl's bf16 matrix product for many rows (the encoder, a prefill):
//! `y = x W^T` with `x (m, k)` and `W (n, k)` in bf16, accumulated in f32.
//!
//! Why vl owns it: candle's CPU backend has no fast bf16 product (its bf16
//! matmul is several times slower than its f32 one), so `--dtype bf16`
//! was vl's slowest mode. On CPUs with AVX512_BF16 this kernel runs
//! `vdpbf16ps` (two bf16 products summed into an f32 lane per
//! instruction): the weight is packed into panels of 32 columns × k/2
//! pairs, and a micro-kernel of up to 8 rows × 32 columns keeps 16
//! accumulators in registers; blocks of rows × groups of panels are split
//! across the rayon pool. Where the CPU also has AMX-BF16 (Intel's Xeons
//! from Sapphire Rapids on) and the operating system grants the tile
//! state, blocks of 32 rows run on the tile unit instead (`amx`), on the
//! same packed panels. Where `vdpbf16ps` runs at a lower rate than the
//! FMAs (Intel's Xeons without the tile unit: half of the FMAs' products
//! on the model 207 measured), the products run on FMAs instead
//! ([`Bf16Simd::Avx512Fma`], chosen by [`crate::kernels::Tuning`]): each
//! pair of the panel widened to two f32 vectors (exact), f32 rows of `x`
//! kept as they are, blocks of 12 rows × 32 columns. A portable
//! implementation in plain Rust (the same panels, `x` widened pair by
//! pair) runs anywhere and is the oracle the others are tested against; [`crate::Proj`] routes products
//! here only where the CPU has AVX512_BF16 ([`accelerated`]), and to
//! candle's product elsewhere.
//!
//! Like [`crate::kernels::gemv`], a candle `CustomOp2` on the CPU, outside autograd:
//! [`crate::Proj`] routes plain bf16 CPU products of more than
//! [`crate::kernels::gemv::MAX_ROWS`] rows here, packing the weight per call; a
//! weight quantized to bf16 ([`crate::Proj::quantize`]) is packed once, at
//! load time, as a [`PackedBf16`], which also runs the decode steps.

use std::mem::MaybeUninit;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

use super::features::{Bf16Isa, Bf16Simd, CpuFeatures};
use crate::kernels::aligned::CacheAligned;
use crate::kernels::host::contiguous;

/// Columns of a packed panel: two AVX-512 registers of f32.
const NR: usize = 32;
/// Rows of the micro-kernel.
const MR: usize = 8;
/// Rows per parallel task (a multiple of [`MR`]).
const TASK_ROWS: usize = 8 * MR;

/// Whether this CPU runs the kernels on AVX512_BF16 (x86-64 with AVX512F
/// and AVX512_BF16), where they beat candle's bf16 product: what callers
/// ask before routing products here.
pub fn accelerated() -> bool {
    CpuFeatures::get().bf16_isa().simd() != Bf16Simd::Portable
}

/// Whether [`matmul`] takes `x` and `w`: the kernels [`accelerated`], both
/// on the CPU and untracked, `w (n, k)` bf16 and contiguous with `k` even,
/// `x (..., k)` bf16 or f32 (rounded to bf16 for the `vdpbf16ps` and tile
/// products, kept in f32 for the FMA ones: the weights-only bf16 of
/// [`crate::Proj::quantize`]).
pub fn applies(x: &Tensor, w: &Tensor) -> bool {
    accelerated() && takes(x, w)
}

/// Whether the kernels take `x` and `w` at all, on any implementation.
fn takes(x: &Tensor, w: &Tensor) -> bool {
    x.device().is_cpu()
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
    if !accelerated() {
        candle_core::bail!("vl-gemm-bf16: this CPU has no AVX512_BF16 (use matmul_with)");
    }
    matmul_with(CpuFeatures::get().bf16_isa(), x, w)
}

/// [`matmul`] on a given implementation, on any CPU that runs it (the
/// token proves it): the portable one anywhere.
///
/// # Errors
/// Operands the kernels do not take, with the reason.
pub fn matmul_with(isa: Bf16Isa, x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    if !takes(x, w) {
        candle_core::bail!(
            "vl-gemm-bf16: takes untracked bf16 or f32 CPU x (..., k) and a contiguous bf16 w (n, k), k even; got x {:?} {:?}, w {:?} {:?}",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype()
        );
    }
    x.contiguous()?.apply_op2_no_bwd(w, &GemmBf16 { isa })
}

/// [`matmul`] for operands the caller has checked with [`applies`] (the op
/// itself still refuses what it cannot compute).
pub(crate) fn apply(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let isa = CpuFeatures::get().bf16_isa();
    x.contiguous()?.apply_op2_no_bwd(w, &GemmBf16 { isa })
}

struct GemmBf16 {
    isa: Bf16Isa,
}

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
        if dims.last() != Some(&k) || k % 2 != 0 {
            candle_core::bail!("vl-gemm-bf16: x {dims:?}, w ({n}, {k})");
        }
        let m = l1.shape().elem_count() / k;
        let w = slice(s2, l2, "w")?;
        let (isa, packed) = (self.isa, pack(w, n, k));
        let y = match s1 {
            CpuStorage::F32(x) => {
                let x = Rows::F32(contiguous(x, l1, "vl-gemm-bf16", "x")?);
                CpuStorage::F32(rows_product(isa, x, &packed, (None, None), m, (n, k)))
            }
            _ => {
                let x = Rows::Bf16(slice(s1, l1, "x")?);
                CpuStorage::BF16(rows_product(isa, x, &packed, (None, None), m, (n, k)))
            }
        };
        let mut shape = dims[..dims.len() - 1].to_vec();
        shape.push(n);
        Ok((y, Shape::from(shape)))
    }
}

/// `x` rounded to bf16 for a product's rows, split across the pool: on
/// AVX512_BF16 sixteen at a time by `vcvtneps2bf16` (to nearest even, as
/// `bf16::from_f32`, subnormals flushed to zero, as [`store_bf16x16`]
/// rounds the outputs), else by `bf16::from_f32`. (`bf16::from_f32` one
/// value at a time was ≈ 9% of a Swin encode's time in bf16 weights.)
pub(crate) fn to_bf16(isa: Bf16Isa, x: &[f32]) -> CacheAligned<bf16> {
    to_bf16_padded(isa, x, x.len())
}

/// [`to_bf16`] into `len >= x.len()` values, zeros after `x`'s (the rows
/// that make a last block of a tile kernel whole).
pub(crate) fn to_bf16_padded(isa: Bf16Isa, x: &[f32], len: usize) -> CacheAligned<bf16> {
    const CHUNK: usize = 1 << 14;
    assert!(
        len >= x.len(),
        "to_bf16_padded: {len} values for {}",
        x.len()
    );
    let round = |y: &mut [MaybeUninit<bf16>]| {
        let (y, pad) = y.split_at_mut(x.len());
        for v in pad {
            v.write(bf16::ZERO);
        }
        y.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .for_each(|(y, x)| match isa.simd() {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the token proves AVX-512F and AVX512_BF16.
                Bf16Simd::Amx | Bf16Simd::Avx512Bf16 | Bf16Simd::Avx512Fma => unsafe {
                    avx512::round(x, y)
                },
                _ => {
                    for (y, &x) in y.iter_mut().zip(x) {
                        y.write(bf16::from_f32(x));
                    }
                }
            })
    };
    // On a cache line (the AMX kernel loads rows of `x` where they lie),
    // not zeroed first.
    // SAFETY: the chunks cover all `x.len()` values, and each chunk's are
    // all written (`avx512::round`'s contract, or the loop); the padding
    // is zeroed.
    unsafe { CacheAligned::written_by(len, round) }
}

/// `x` rounded to bf16 into `y` (as long) on the calling thread, as
/// [`to_bf16`] rounds on AVX512_BF16 (a kernel's block of rows, in its
/// cache).
///
/// # Safety
/// The CPU has AVX-512F and AVX512_BF16.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn round_into(x: &[f32], y: &mut [bf16]) {
    // SAFETY: `round` writes every element of `y` with a valid bf16, so
    // viewing initialised values as `MaybeUninit` loses nothing; the
    // caller's contract for the instructions.
    unsafe {
        let y = &mut *(y as *mut [bf16] as *mut [MaybeUninit<bf16>]);
        avx512::round(x, y)
    }
}

/// `x` rounded to bf16 on the pool exactly as `bf16::from_f32` rounds it
/// (and so candle's `to_dtype`): to nearest, ties to even, subnormals
/// kept, NaN made quiet — where [`to_bf16`]'s `vcvtneps2bf16` flushes
/// subnormals. Written without branches, so that it vectorises under
/// each instruction set (`from_f32` one value at a time was a seventh of
/// the time of 12 layers' image keys and values).
pub(crate) fn to_bf16_exact(x: &[f32]) -> Vec<bf16> {
    const CHUNK: usize = 1 << 14;
    let isa = super::CpuFeatures::get().isa();
    let mut y = vec![bf16::ZERO; x.len()];
    y.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(y, x)| round_exact_on(isa, x, y));
    y
}

/// [`to_bf16_exact`]'s rounding of one chunk.
#[inline(always)]
fn round_exact<K: crate::kernels::micro::Kernel>(x: &[f32], y: &mut [bf16]) {
    let _ = K::FMA;
    for (y, &x) in y.iter_mut().zip(x) {
        let bits = x.to_bits();
        // Adding 0x7fff and the kept part's lowest bit carries into it
        // when the dropped half is over 0x8000, or is 0x8000 and the kept
        // part odd: ties to even.
        let lsb = (bits >> 16) & 1;
        let rounded = bits.wrapping_add(0x7fff + lsb) >> 16;
        let nan = (bits & 0x7fff_ffff) > 0x7f80_0000;
        *y = bf16::from_bits(if nan { (bits >> 16) | 0x40 } else { rounded } as u16);
    }
}

crate::kernels::micro::per_isa! {
    /// [`round_exact`] compiled for the given instruction set.
    fn round_exact_on(x: &[f32], y: &mut [bf16]) = round_exact::<crate::kernels::micro::Avx512>
}

/// `w (n, k)` as panels of [`NR`] columns: panel `j`, pair `p` holds
/// `w[j*NR + c][2p], w[j*NR + c][2p + 1]` for `c` in `0..NR` (as one u32
/// each), columns past `n` zero.
fn pack(w: &[bf16], n: usize, k: usize) -> CacheAligned<u32> {
    let pairs = k / 2;
    let panels = n.div_ceil(NR);
    // On a cache line: every load of a panel is a whole line.
    let mut packed = CacheAligned::<u32>::new(panels * pairs * NR);
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

/// A bf16 weight `W (n, k)` packed once, at load time, into the panels the
/// kernels read: what [`crate::Proj`] keeps for `--quantize bf16` on CPUs
/// with AVX512_BF16 ([`PackedBf16::new`]), so that no product packs its
/// weight per call and the weight is held once. [`PackedBf16::pack`]
/// packs on any CPU; the products then run the portable implementation.
///
/// [`Self::matmul`] takes f32 or bf16 activations: up to
/// [`crate::kernels::gemv::MAX_ROWS`] rows (decode steps) run a matrix-vector
/// kernel that widens the weight to f32 and keeps `x` in f32 (as
/// [`crate::kernels::gemv`] does); more rows run the GEMM of the token: on
/// `vdpbf16ps` or the tile unit `x` rounded to bf16, on FMAs
/// ([`Bf16Simd::Avx512Fma`]) `x` kept in f32.
#[derive(Debug)]
pub struct PackedBf16 {
    panels: CacheAligned<u32>,
    /// Added to each output in f32 before it is stored (or rounded).
    bias: Option<Vec<f32>>,
    n: usize,
    k: usize,
}

impl PackedBf16 {
    /// Packs `w (n, k)`, bf16 on the CPU, `k` even, with an optional bias
    /// `(n)` (any float dtype, kept in f32 and added in the kernels'
    /// epilogue); `None` when this CPU has no AVX512_BF16 ([`accelerated`])
    /// and the weight should stay a plain tensor.
    ///
    /// # Errors
    /// As [`PackedBf16::pack`].
    pub fn new(w: &Tensor, bias: Option<&Tensor>) -> candle_core::Result<Option<Self>> {
        if !accelerated() {
            return Ok(None);
        }
        Self::pack(w, bias).map(Some)
    }

    /// Packs `w (n, k)` as [`PackedBf16::new`] does, on any CPU.
    ///
    /// # Errors
    /// A weight of another dtype, rank or device, `k` odd or 0, `n` 0, or
    /// a bias of another length, named.
    pub fn pack(w: &Tensor, bias: Option<&Tensor>) -> candle_core::Result<Self> {
        let (n, k) = w.dims2()?;
        if w.dtype() != DType::BF16 || !w.device().is_cpu() || k % 2 != 0 || k == 0 || n == 0 {
            candle_core::bail!(
                "vl-gemm-bf16: packs a bf16 CPU weight (n, k), n > 0, k even and > 0; got {:?} {:?} on {:?}",
                w.dims(),
                w.dtype(),
                w.device()
            );
        }
        let bias = match bias {
            Some(b) if b.dims() != [n] => {
                candle_core::bail!("vl-gemm-bf16: bias {:?} for a weight ({n}, {k})", b.dims())
            }
            Some(b) => Some(b.to_dtype(DType::F32)?.to_vec1::<f32>()?),
            None => None,
        };
        let values = w.flatten_all()?.to_vec1::<bf16>()?;
        Ok(Self {
            panels: pack(&values, n, k),
            bias,
            n,
            k,
        })
    }

    /// The weight's shape `(n, k)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// The bias, f32, if any.
    ///
    /// # Errors
    /// Only candle's, building the tensor.
    pub fn bias(&self) -> candle_core::Result<Option<Tensor>> {
        crate::kernels::gemv_q8::bias_tensor(self.bias.as_deref())
    }

    /// The weight as a bf16 tensor `(n, k)` again (bit for bit).
    ///
    /// # Errors
    /// Only candle's, building the tensor.
    pub fn unpack(&self) -> candle_core::Result<Tensor> {
        let (n, k) = (self.n, self.k);
        let pairs = k / 2;
        let mut w = vec![bf16::ZERO; n * k];
        for (o, row) in w.chunks_exact_mut(k).enumerate() {
            let panel = &self.panels[(o / NR) * pairs * NR..][..pairs * NR];
            for (p, pair) in row.chunks_exact_mut(2).enumerate() {
                let bits = panel[p * NR + o % NR];
                pair[0] = bf16::from_bits(bits as u16);
                pair[1] = bf16::from_bits((bits >> 16) as u16);
            }
        }
        Tensor::from_vec(w, (n, k), &candle_core::Device::Cpu)
    }

    /// `x W^T + b`.
    ///
    /// # Shapes
    /// `x: (..., k)` f32 or bf16 on the CPU (made contiguous) → `(..., n)`
    /// in `x`'s dtype.
    ///
    /// # Errors
    /// Another dtype, device or width of `x`, named.
    pub fn matmul(self: &std::sync::Arc<Self>, x: &Tensor) -> candle_core::Result<Tensor> {
        self.matmul_with(CpuFeatures::get().bf16_isa(), x)
    }

    /// [`PackedBf16::matmul`] on a given implementation (tests compare
    /// them; the token proves the CPU runs it).
    ///
    /// # Errors
    /// As [`PackedBf16::matmul`].
    pub fn matmul_with(
        self: &std::sync::Arc<Self>,
        isa: Bf16Isa,
        x: &Tensor,
    ) -> candle_core::Result<Tensor> {
        x.contiguous()?.apply_op1_no_bwd(&PackedOp {
            w: self.clone(),
            isa,
            mode: Mode::Plain,
        })
    }

    /// `GELU(x W^T + b)` for many rows of f32 `x`, as a feed-forward's
    /// second product ([`PackedBf16::matmul_f32`]) takes its rows without
    /// loss: rounded to bf16 where the products round their rows to bf16
    /// anyway (`vdpbf16ps`, the tile unit), in f32 on FMAs
    /// ([`Bf16Simd::Avx512Fma`]), which keep them. The GELU (exact when
    /// `exact`, else tanh) runs on the accumulators, in the product's
    /// epilogue: no separate pass over the hidden layer — the same values
    /// as the three steps apart.
    ///
    /// # Shapes
    /// `x: (..., k)` f32 on the CPU, more than
    /// [`crate::kernels::gemv::MAX_ROWS`] rows (made contiguous) → `(...,
    /// n)` bf16, or f32 on [`Bf16Simd::Avx512Fma`].
    ///
    /// # Errors
    /// Another dtype, device or width of `x`, or too few rows, named.
    pub fn matmul_gelu(
        self: &std::sync::Arc<Self>,
        x: &Tensor,
        exact: bool,
    ) -> candle_core::Result<Tensor> {
        self.matmul_gelu_with(CpuFeatures::get().bf16_isa(), x, exact)
    }

    /// [`PackedBf16::matmul_gelu`] on a given implementation.
    ///
    /// # Errors
    /// As [`PackedBf16::matmul_gelu`].
    pub fn matmul_gelu_with(
        self: &std::sync::Arc<Self>,
        isa: Bf16Isa,
        x: &Tensor,
        exact: bool,
    ) -> candle_core::Result<Tensor> {
        x.contiguous()?.apply_op1_no_bwd(&PackedOp {
            w: self.clone(),
            isa,
            mode: Mode::Gelu { exact },
        })
    }

    /// `x W^T + b` in f32 whatever `x`'s dtype (f32 or bf16): the second
    /// product of [`PackedBf16::matmul_gelu`]'s feed-forward.
    ///
    /// # Shapes
    /// `x: (..., k)` f32 or bf16 on the CPU → `(..., n)` f32.
    ///
    /// # Errors
    /// As [`PackedBf16::matmul`].
    pub fn matmul_f32(self: &std::sync::Arc<Self>, x: &Tensor) -> candle_core::Result<Tensor> {
        x.contiguous()?.apply_op1_no_bwd(&PackedOp {
            w: self.clone(),
            isa: CpuFeatures::get().bf16_isa(),
            mode: Mode::F32Out,
        })
    }
}

/// The op of [`PackedBf16::matmul`] and its variants.
struct PackedOp {
    w: std::sync::Arc<PackedBf16>,
    isa: Bf16Isa,
    mode: Mode,
}

/// What [`PackedOp`] returns.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `x W^T + b` in `x`'s dtype.
    Plain,
    /// `GELU(x W^T + b)` for f32 `x` of many rows: rounded to bf16, or
    /// f32 on FMAs.
    Gelu { exact: bool },
    /// `x W^T + b` in f32.
    F32Out,
}

impl candle_core::CustomOp1 for PackedOp {
    fn name(&self) -> &'static str {
        "vl-gemm-bf16-packed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (w, isa) = (&*self.w, self.isa);
        let dims = l.shape().dims();
        if dims.last() != Some(&w.k) {
            candle_core::bail!("vl-gemm-bf16: x {dims:?} for a weight ({}, {})", w.n, w.k);
        }
        let m = l.shape().elem_count() / w.k.max(1);
        let decode = m <= crate::kernels::gemv::MAX_ROWS;
        let y = match (s, self.mode) {
            (CpuStorage::F32(_), Mode::Gelu { .. }) if decode => candle_core::bail!(
                "vl-gemm-bf16: the fused GELU takes more than {} rows, got {m}",
                crate::kernels::gemv::MAX_ROWS
            ),
            (CpuStorage::F32(x), Mode::Gelu { exact }) => {
                let x = contiguous(x, l, "vl-gemm-bf16", "x")?;
                let gelu = Some(exact);
                if isa.simd() == Bf16Simd::Avx512Fma {
                    CpuStorage::F32(product_packed(isa, Rows::F32(x), w, m, gelu))
                } else {
                    CpuStorage::BF16(product_packed(isa, Rows::F32(x), w, m, gelu))
                }
            }
            (CpuStorage::F32(x), _) => {
                let x = contiguous(x, l, "vl-gemm-bf16", "x")?;
                if decode {
                    CpuStorage::F32(gemv_packed(isa, x, w, m))
                } else {
                    CpuStorage::F32(product_packed(isa, Rows::F32(x), w, m, None))
                }
            }
            (CpuStorage::BF16(x), mode @ (Mode::Plain | Mode::F32Out)) => {
                let x = contiguous(x, l, "vl-gemm-bf16", "x")?;
                let f32_out = mode == Mode::F32Out;
                if decode {
                    let x: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
                    let y = gemv_packed(isa, &x, w, m);
                    if f32_out {
                        CpuStorage::F32(y)
                    } else {
                        CpuStorage::BF16(y.into_iter().map(bf16::from_f32).collect())
                    }
                } else if f32_out {
                    CpuStorage::F32(product_packed(isa, Rows::Bf16(x), w, m, None))
                } else {
                    CpuStorage::BF16(product_packed(isa, Rows::Bf16(x), w, m, None))
                }
            }
            _ => candle_core::bail!(
                "vl-gemm-bf16: x must be f32 (or bf16, without the fused GELU), got {:?}",
                s.dtype()
            ),
        };
        let mut shape = dims[..dims.len() - 1].to_vec();
        shape.push(w.n);
        Ok((y, Shape::from(shape)))
    }
}

/// `y (m, n) = x (m, k) W^T` for a few rows of f32 `x`, the packed weight
/// widened to f32: the panels split across the rayon pool.
fn gemv_packed(isa: Bf16Isa, x: &[f32], w: &PackedBf16, m: usize) -> Vec<f32> {
    let (n, k) = (w.n, w.k);
    let panel_len = (k / 2) * NR;
    let panels = n.div_ceil(NR);
    let threads = rayon::current_num_threads().max(1);
    let group = panels.div_ceil(threads * 4).max(1);
    let mut y = vec![0f32; m * n];
    let out = SyncPtr(y.as_mut_ptr());
    (0..panels.div_ceil(group)).into_par_iter().for_each(|g| {
        let (first, last) = (g * group, ((g + 1) * group).min(panels));
        let range = &w.panels[first * panel_len..last * panel_len];
        let bias = w.bias.as_deref();
        // SAFETY: group `g` writes columns `first * NR .. min(last * NR, n)`
        // of every row, which no other group writes; `y` outlives the
        // loop; the token proves the instruction set (AVX512_BF16 comes
        // with AVX512F, all `gemv_task` needs).
        match isa.simd() {
            #[cfg(target_arch = "x86_64")]
            Bf16Simd::Amx | Bf16Simd::Avx512Bf16 | Bf16Simd::Avx512Fma => unsafe {
                avx512::gemv_task(x, range, out, m, (first, last), (n, k), bias)
            },
            _ => unsafe { portable::gemv_task(x, range, out, m, (first, last), (n, k), bias) },
        }
    });
    y
}

/// An output element: the f32 accumulator rounded (bf16) or as is (f32).
trait Out: Copy + Default + Send + Sync {
    /// Whether the element is bf16 (else f32): the AVX-512 kernels'
    /// vector stores.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    const BF16: bool;
    fn from_acc(v: f32) -> Self;
}

impl Out for bf16 {
    const BF16: bool = true;
    #[inline(always)]
    fn from_acc(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

impl Out for f32 {
    const BF16: bool = false;
    #[inline(always)]
    fn from_acc(v: f32) -> Self {
        v
    }
}

/// A product's rows of `x`, as the op was given them.
#[derive(Clone, Copy)]
enum Rows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

/// `y (m, n)` = `x (m, k)` times the packed `w (n, k)` transposed, plus
/// the epilogue, on `isa`: on [`Bf16Simd::Avx512Fma`] f32 rows as they
/// are and bf16 ones widened to f32 (exact), else f32 rows rounded to
/// bf16 ([`to_bf16`]) for the bf16 products.
fn rows_product<O: Out>(
    isa: Bf16Isa,
    x: Rows<'_>,
    packed: &[u32],
    epilogue: Epilogue<'_>,
    m: usize,
    (n, k): (usize, usize),
) -> Vec<O> {
    match (isa.simd(), x) {
        (Bf16Simd::Avx512Fma, Rows::F32(x)) => panels_product(isa, x, packed, epilogue, m, (n, k)),
        (Bf16Simd::Avx512Fma, Rows::Bf16(x)) => {
            let wide: Vec<f32> = x.par_iter().map(|v| v.to_f32()).collect();
            panels_product(isa, &wide, packed, epilogue, m, (n, k))
        }
        (_, Rows::F32(x)) => panels_product(isa, &to_bf16(isa, x)[..], packed, epilogue, m, (n, k)),
        (_, Rows::Bf16(x)) => panels_product(isa, x, packed, epilogue, m, (n, k)),
    }
}

/// [`rows_product`] with a packed weight, plus its bias, then GELU (exact
/// when `gelu` is `Some(true)`, tanh when `Some(false)`) if asked.
fn product_packed<O: Out>(
    isa: Bf16Isa,
    x: Rows<'_>,
    w: &PackedBf16,
    m: usize,
    gelu: Option<bool>,
) -> Vec<O> {
    rows_product(isa, x, &w.panels, (w.bias.as_deref(), gelu), m, (w.n, w.k))
}

/// What a task does to an accumulator before storing it: add the bias
/// (`n` values) if any, then GELU (exact when `Some(true)`) if any.
type Epilogue<'a> = (Option<&'a [f32]>, Option<bool>);

/// A row element a task takes: bf16 (the `vdpbf16ps` and tile kernels')
/// or f32 (the FMA kernel's), each dispatched to the kernels that take it.
trait TaskRow: crate::kernels::gemv::Weight {
    /// One task of [`panels_product`] on `isa`.
    ///
    /// # Safety
    /// As [`portable::task`]'s, and the token proves the instruction set.
    unsafe fn task<O: Out>(
        isa: Bf16Isa,
        x: &[Self],
        panels: &[u32],
        y: *mut O,
        shape: TaskShape,
        epilogue: Epilogue<'_>,
    );
}

impl TaskRow for bf16 {
    unsafe fn task<O: Out>(
        isa: Bf16Isa,
        x: &[bf16],
        panels: &[u32],
        y: *mut O,
        shape: TaskShape,
        epilogue: Epilogue<'_>,
    ) {
        // SAFETY: the contract; each token proves its instructions (the
        // FMA one implies AVX512_BF16 too).
        unsafe {
            match isa.simd() {
                #[cfg(target_arch = "x86_64")]
                Bf16Simd::Avx512Bf16 | Bf16Simd::Avx512Fma => {
                    avx512::task(x, panels, y, shape, epilogue)
                }
                #[cfg(target_arch = "x86_64")]
                Bf16Simd::Amx => amx::task(x, panels, y, shape, epilogue),
                _ => portable::task(x, panels, y, shape, epilogue),
            }
        }
    }
}

impl TaskRow for f32 {
    unsafe fn task<O: Out>(
        isa: Bf16Isa,
        x: &[f32],
        panels: &[u32],
        y: *mut O,
        shape: TaskShape,
        epilogue: Epilogue<'_>,
    ) {
        // SAFETY: the contract; every token but the portable one proves
        // AVX-512F, all the FMA kernel needs.
        unsafe {
            match isa.simd() {
                #[cfg(target_arch = "x86_64")]
                Bf16Simd::Amx | Bf16Simd::Avx512Bf16 | Bf16Simd::Avx512Fma => {
                    avx512::task_fma(x, panels, y, shape, epilogue)
                }
                _ => portable::task(x, panels, y, shape, epilogue),
            }
        }
    }
}

/// `y (m, n)` = `x (m, k)` times the panels of `w (n, k)` transposed.
///
/// The work is split in two dimensions, blocks of [`TASK_ROWS`] rows ×
/// groups of panels of about [`TASK_PANEL_BYTES`], so that the tasks are
/// many and of nearly equal size whatever `m` (197 rows in 64-row tasks
/// alone would leave one of two threads idle a quarter of the time), and
/// each task's rows and panels stay in the core's L2 while it runs.
fn panels_product<X: TaskRow, O: Out>(
    isa: Bf16Isa,
    x: &[X],
    packed: &[u32],
    epilogue: Epilogue<'_>,
    m: usize,
    (n, k): (usize, usize),
) -> Vec<O> {
    // Not zeroed first (a memset and, for a fresh buffer, its page faults,
    // before the tasks overwrite it): the tasks write every element.
    let mut y: Vec<O> = Vec::with_capacity(m * n);
    let panel_len = (k / 2) * NR;
    let panels = n.div_ceil(NR);
    let group = (TASK_PANEL_BYTES / (panel_len * 4).max(1)).clamp(1, panels);
    let groups = panels.div_ceil(group);
    let blocks = m.div_ceil(TASK_ROWS);
    let out = SyncPtr(y.as_mut_ptr());
    (0..blocks * groups).into_par_iter().for_each(|t| {
        // Group-major: the tasks of one panel group (all row blocks) are
        // neighbours, so a thread reads a group from memory once and keeps
        // it in L2 for every row block; the two halves of the range (one
        // per thread, as rayon splits it) read disjoint halves of the
        // weight.
        let (g, b) = (t / blocks, t % blocks);
        let rows = TASK_ROWS.min(m - b * TASK_ROWS);
        let xt = &x[b * TASK_ROWS * k..(b * TASK_ROWS + rows) * k];
        let first = g * group;
        let last = (first + group).min(panels);
        let panel_range = &packed[first * panel_len..last * panel_len];
        // SAFETY: task `t` writes only rows `b * TASK_ROWS ..` (`rows` of
        // them), columns `first * NR .. min(last * NR, n)` of `y`: no two
        // tasks overlap, and `y` outlives the parallel loop; the token
        // proves the instruction set.
        unsafe {
            let y = out.at(b * TASK_ROWS * n);
            X::task(
                isa,
                xt,
                panel_range,
                y,
                (rows, (first, last), (n, k)),
                epilogue,
            )
        };
    });
    // SAFETY: the tasks cover every row block × panel group, and each
    // writes every row and column of its block and group (`task`'s tiles
    // span all its rows and the group's columns up to `n`): all `m * n`
    // elements are initialised.
    unsafe { y.set_len(m * n) };
    y
}

/// Bytes of packed panels per task, about (a share of an L2).
const TASK_PANEL_BYTES: usize = 256 * 1024;

/// An output buffer shared by the parallel tasks of a product (here and
/// in [`crate::kernels::gemm_f32`]), each of which writes its own disjoint
/// elements while the buffer outlives them.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr<O>(pub(crate) *mut O);

// SAFETY: the tasks that share it write disjoint elements and the buffer
// outlives them (each product's contract, at its parallel loop).
unsafe impl<O: Send> Send for SyncPtr<O> {}
// SAFETY: as above.
unsafe impl<O: Send> Sync for SyncPtr<O> {}

impl<O> SyncPtr<O> {
    /// The element `offset` elements past the start.
    ///
    /// # Safety
    /// `offset` is inside the buffer.
    pub(crate) unsafe fn at(self, offset: usize) -> *mut O {
        // SAFETY: the caller's contract.
        unsafe { self.0.add(offset) }
    }
}

/// 16 f32 lanes rounded to bf16 by `vcvtneps2bf16` (to nearest even, as
/// `bf16::from_f32` and candle's bf16 ops on such CPUs; subnormals flush
/// to zero) and stored at `p`.
///
/// # Safety
/// 16 values writable at `p`; the CPU has AVX-512F and AVX512_BF16 (the
/// caller is compiled for them, so that this inlines).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn store_bf16x16(p: *mut half::bf16, v: std::arch::x86_64::__m512) {
    use std::arch::x86_64::{__m256i, _mm256_storeu_si256, _mm512_cvtneps_pbh};
    // SAFETY: the caller's contract; `__m256bh` and `__m256i` are both 256
    // bits.
    unsafe {
        let half: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
        _mm256_storeu_si256(p.cast(), half);
    }
}

/// A task's rows, its panels `first..last` and the product's `(n, k)`.
type TaskShape = (usize, (usize, usize), (usize, usize));

/// `ldtilecfg`'s 64 bytes: palette 1, eight tiles of 16 rows × 64 bytes
/// (the bf16 GEMM's and [`crate::kernels::q8_amx`]'s).
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
pub(crate) struct TileConfig([u8; 64]);

#[cfg(target_arch = "x86_64")]
impl TileConfig {
    pub(crate) fn sixteen_by_64() -> Self {
        let mut c = [0u8; 64];
        c[0] = 1;
        for t in 0..8 {
            // colsb (u16 little-endian) at 16 + 2t, rows at 48 + t.
            c[16 + 2 * t] = 64;
            c[48 + t] = 16;
        }
        Self(c)
    }

    /// The bytes, for `ldtilecfg`.
    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.0.as_ptr()
    }
}

/// One step of the AMX kernels (this GEMM's and
/// [`crate::kernels::q8_amx`]'s): `tmm0`–`tmm3` += the products of two
/// 16-row tiles of `x` at `a0`, `a1` (rows `a_stride` bytes apart) by two
/// B tiles at `b0`, `b1` (rows `b_stride` apart), loaded into `tmm4`–`tmm7`.
///
/// # Safety
/// The tile state is configured (16 rows × 64 bytes each); every load's
/// 16 rows of 64 bytes are readable.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn tdp_2x2(
    (a0, a1): (*const u8, *const u8),
    (b0, b1): (*const u8, *const u8),
    (a_stride, b_stride): (usize, usize),
) {
    // SAFETY: the caller's contract.
    unsafe {
        std::arch::asm!(
            "tileloadd tmm4, [{a0} + {xs}*1]",
            "tileloadd tmm5, [{a1} + {xs}*1]",
            "tileloadd tmm6, [{b0} + {bs}*1]",
            "tileloadd tmm7, [{b1} + {bs}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            a0 = in(reg) a0,
            a1 = in(reg) a1,
            b0 = in(reg) b0,
            b1 = in(reg) b1,
            xs = in(reg) a_stride,
            bs = in(reg) b_stride,
            options(nostack, readonly)
        )
    }
}

/// The AMX kernels' accumulators `tmm0`–`tmm3` set to zero.
///
/// # Safety
/// The tile state is configured.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn tdp_zero() {
    // SAFETY: the caller's contract.
    unsafe {
        std::arch::asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem)
        )
    }
}

/// The AMX kernels' accumulators stored: `tmm0` (rows 0–15 of the first
/// B tile's columns) at `c[0]`, `tmm1` (rows 0–15, second) at `c[1]`,
/// `tmm2` (rows 16–31, first) at `c[2]`, `tmm3` at `c[3]`, each tile's 16
/// rows of 64 bytes `stride` bytes apart.
///
/// # Safety
/// The tile state is configured; the 16 rows of 64 bytes at each place
/// are writable.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn tdp_store(c: [*mut u8; 4], stride: usize) {
    // SAFETY: the caller's contract.
    unsafe {
        std::arch::asm!(
            "tilestored [{c00} + {s}*1], tmm0",
            "tilestored [{c01} + {s}*1], tmm1",
            "tilestored [{c10} + {s}*1], tmm2",
            "tilestored [{c11} + {s}*1], tmm3",
            c00 = in(reg) c[0],
            c01 = in(reg) c[1],
            c10 = in(reg) c[2],
            c11 = in(reg) c[3],
            s = in(reg) stride,
            options(nostack)
        )
    }
}

/// [`tdp_2x2`] for one tile of rows: `tmm0`, `tmm1` += the tile at `a0`
/// by the B tiles at `b0`, `b1`.
///
/// # Safety
/// As [`tdp_2x2`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn tdp_1x2(
    a0: *const u8,
    (b0, b1): (*const u8, *const u8),
    (a_stride, b_stride): (usize, usize),
) {
    // SAFETY: the caller's contract.
    unsafe {
        std::arch::asm!(
            "tileloadd tmm4, [{a0} + {xs}*1]",
            "tileloadd tmm6, [{b0} + {bs}*1]",
            "tileloadd tmm7, [{b1} + {bs}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            a0 = in(reg) a0,
            b0 = in(reg) b0,
            b1 = in(reg) b1,
            xs = in(reg) a_stride,
            bs = in(reg) b_stride,
            options(nostack, readonly)
        )
    }
}

/// The GEMM's rows in blocks of 32 on AMX's tile unit: for each panel of
/// [`NR`] columns, four 16 × 16 f32 accumulator tiles (`tmm0`–`tmm3`) take
/// `tdpbf16ps` of two 16-row tiles of `x` (`tmm4`, `tmm5`: 32 bf16 of `k`
/// per row, loaded where the rows lie) by the panel's two halves
/// (`tmm6`, `tmm7`: 16 pairs of `k` × 16 columns, loaded from the panel
/// with its row stride: the pair-interleaved panel is AMX's own layout for
/// the second operand); the sums go through a 32 × 32 buffer to the same
/// epilogue as the AVX512_BF16 kernel's. The rows past the last whole
/// block of 32 run as a zero-padded block — of one tile of rows (`tmm4`
/// by the two halves into `tmm0`, `tmm1`) when they are 16 or fewer; a
/// `k` that is not a multiple of 32 runs on AVX512_BF16
/// ([`avx512::task`]).
///
/// Instructions by `asm!`: Rust has no stable AMX intrinsics, and LLVM's
/// assembler takes the mnemonics whatever the target features.
#[cfg(target_arch = "x86_64")]
mod amx {
    use std::arch::asm;

    use half::bf16;

    use super::{avx512, tdp_1x2, tdp_2x2, tdp_store, tdp_zero, Out, TileConfig, NR};

    /// Rows of an AMX tile, and of `x` per tile.
    const TILE_ROWS: usize = 16;
    /// Rows of `x` per block: two tiles.
    const BLOCK: usize = 2 * TILE_ROWS;
    /// `k` per `tdpbf16ps`: 64 bytes of bf16 per tile row.
    const TILE_K: usize = 32;

    /// [`avx512::task`] with the blocks of 32 rows on the tile unit.
    ///
    /// # Safety
    /// As [`avx512::task`]'s, and the CPU runs AMX-BF16 with the tile
    /// state granted to this process (the [`super::Bf16Simd::Amx`] token's
    /// proof).
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn task<O: Out>(
        x: &[bf16],
        packed: &[u32],
        y: *mut O,
        (rows, (first, last), (n, k)): super::TaskShape,
        epilogue: super::Epilogue<'_>,
    ) {
        if !k.is_multiple_of(TILE_K) {
            // SAFETY: the contract.
            unsafe { avx512::task(x, packed, y, (rows, (first, last), (n, k)), epilogue) };
            return;
        }
        let full = rows / BLOCK * BLOCK;
        if full > 0 {
            // SAFETY: the contract (AMX granted; `y`'s rows and columns).
            unsafe { blocks::<2, O>(x, full, packed, y, (full, (first, last), (n, k)), epilogue) };
        }
        if rows > full {
            // The last rows as a zero-padded block, of one tile of rows
            // where they fit in one: on the tile unit, a block of 32 costs
            // about what 4 rows cost on AVX512_BF16, and half a block
            // about half (a ViT's 197 rows: 208 computed rather than 224).
            let tail = rows - full;
            let height = if tail <= TILE_ROWS { TILE_ROWS } else { BLOCK };
            // On a cache line, as the rows before it (`to_bf16`).
            let mut padded = crate::kernels::aligned::CacheAligned::<bf16>::new(height * k);
            padded[..tail * k].copy_from_slice(&x[full * k..rows * k]);
            let shape = (height, (first, last), (n, k));
            // SAFETY: the contract, for the rows from `full` on (only the
            // first `tail` rows of the block are stored).
            unsafe {
                if height == TILE_ROWS {
                    blocks::<1, O>(&padded, tail, packed, y.add(full * n), shape, epilogue)
                } else {
                    blocks::<2, O>(&padded, tail, packed, y.add(full * n), shape, epilogue)
                }
            };
        }
    }

    /// The whole blocks of `16 H` rows, `H` tiles of rows each (`rows` a
    /// multiple of `16 H`, `k` of 32), the first `stored` rows written to
    /// `y`.
    ///
    /// # Safety
    /// As [`task`]'s, for `stored` rows.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn blocks<const H: usize, O: Out>(
        x: &[bf16],
        stored: usize,
        packed: &[u32],
        y: *mut O,
        (rows, (first, last), (n, k)): super::TaskShape,
        epilogue: super::Epilogue<'_>,
    ) {
        let block = H * TILE_ROWS;
        debug_assert!((H == 1 || H == 2) && rows.is_multiple_of(block) && k.is_multiple_of(TILE_K));
        assert!(x.len() >= rows * k, "amx: x shorter than its rows");
        let pairs = k / 2;
        assert!(
            packed.len() >= (last - first) * pairs * NR,
            "amx: packed shorter than its panels"
        );
        let cfg = TileConfig::sixteen_by_64();
        let x_stride = k * 2;
        let panel_stride = NR * 4;
        let mut sums = [[0f32; NR]; BLOCK];
        // SAFETY: every tile load reads 16 rows of 64 bytes: of `x`, rows
        // `r0 .. r0 + 16 H <= rows` from byte `2 p0`, `p0 + 32 <= k`; of the
        // panel, pairs `p0 / 2 .. p0 / 2 + 16 <= k / 2`, 64 bytes from the
        // row's start or middle (`NR * 4 = 128` bytes a row) — all inside
        // the lengths asserted above. The stores write the 32 × 32 f32
        // buffer (rows of 128 bytes). The tiles are configured first and
        // released last; the CPU runs AMX (the contract).
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) cfg.as_ptr(), options(nostack, readonly));
            for (j, panel) in (first..last).zip(packed.chunks_exact(pairs * NR)) {
                let cols = NR.min(n - j * NR);
                let b = panel.as_ptr().cast::<u8>();
                for r0 in (0..rows).step_by(block) {
                    tdp_zero();
                    let a = x.as_ptr().add(r0 * k).cast::<u8>();
                    for p0 in (0..k).step_by(TILE_K) {
                        let a0 = a.add(2 * p0);
                        let b0 = b.add((p0 / 2) * panel_stride);
                        let strides = (x_stride, panel_stride);
                        if H == 1 {
                            // One tile of rows by the panel's two halves.
                            tdp_1x2(a0, (b0, b0.add(64)), strides);
                        } else {
                            tdp_2x2(
                                (a0, a0.add(TILE_ROWS * x_stride)),
                                (b0, b0.add(64)),
                                strides,
                            );
                        }
                    }
                    let c = sums.as_mut_ptr().cast::<u8>();
                    let lower = TILE_ROWS * NR * 4;
                    tdp_store([c, c.add(64), c.add(lower), c.add(lower + 64)], NR * 4);
                    let here = stored.saturating_sub(r0).min(block);
                    for (i, row) in sums.iter().enumerate().take(here) {
                        // SAFETY: row `r0 + i < stored`, the panel's
                        // columns of this task (the contract).
                        avx512::store_row(row, y.add((r0 + i) * n + j * NR), j, cols, epilogue);
                    }
                }
            }
            asm!("tilerelease", options(nostack, nomem));
        }
    }
}

/// The kernels in plain Rust over the same panels: the fallback and the
/// oracle. A pair of bf16 weights is widened to f32 (the top halves of
/// two f32) and multiplied by the pair of `x`, summed in f32 per column;
/// `vdpbf16ps` sums the same products, so the two differ by rounding only.
mod portable {
    use super::{Out, SyncPtr, NR};
    use crate::kernels::gelu::gelu_one;
    use crate::kernels::gemv::Weight;
    use crate::kernels::micro::Portable;

    /// Plain Rust with `mul_add` (as [`crate::kernels::micro::Fma`], which
    /// exists on x86-64 only).
    type Fma = Portable<true>;

    /// The low and high bf16 of a packed pair, as f32.
    #[inline(always)]
    fn widen(pair: u32) -> (f32, f32) {
        (
            f32::from_bits(pair << 16),
            f32::from_bits(pair & 0xFFFF_0000),
        )
    }

    /// [`super::avx512::task`] in plain Rust, for bf16 rows of `x` (the
    /// GEMM) or f32 ones (the decode steps' GEMV: [`gemv_task`]).
    ///
    /// # Safety
    /// `y` is valid for writes of `rows` rows of `n`, columns
    /// `first * NR .. min(last * NR, n)`, which no one else accesses
    /// meanwhile.
    pub(super) unsafe fn task<X: Weight, O: Out>(
        x: &[X],
        packed: &[u32],
        y: *mut O,
        (rows, (first, last), (n, k)): super::TaskShape,
        (bias, gelu): super::Epilogue<'_>,
    ) {
        let pairs = k / 2;
        for (j, panel) in (first..last).zip(packed.chunks_exact(pairs * NR)) {
            let cols = NR.min(n - j * NR);
            for (r, xr) in x.chunks_exact(k).take(rows).enumerate() {
                let mut acc = [0f32; NR];
                for (p, pair_cols) in panel.chunks_exact(NR).take(pairs).enumerate() {
                    let (xa, xb) = (xr[2 * p].to_f32(), xr[2 * p + 1].to_f32());
                    for (a, &pair) in acc.iter_mut().zip(pair_cols) {
                        let (lo, hi) = widen(pair);
                        *a += lo * xa + hi * xb;
                    }
                }
                for (c, v) in acc.iter().take(cols).enumerate() {
                    let v = v + bias.map_or(0.0, |b| b[j * NR + c]);
                    // With FMA as the AVX-512 epilogue and GELU kernel
                    // (`mul_add` is exact either way): the same bits.
                    let v = gelu.map_or(v, |exact| gelu_one::<Fma>(exact, v));
                    // SAFETY: row `r < rows`, column `j * NR + c` of this
                    // task's columns (the contract).
                    unsafe { y.add(r * n + j * NR + c).write(O::from_acc(v)) };
                }
            }
        }
    }

    /// [`super::avx512::gemv_task`] in plain Rust: [`task`] over f32 rows.
    ///
    /// # Safety
    /// `y` is valid for `m` rows of `n`, columns `first * NR .. min(last *
    /// NR, n)` written by no one else meanwhile.
    pub(super) unsafe fn gemv_task(
        x: &[f32],
        packed: &[u32],
        y: SyncPtr<f32>,
        m: usize,
        panels: (usize, usize),
        dims: (usize, usize),
        bias: Option<&[f32]>,
    ) {
        // SAFETY: the caller's contract, which is `task`'s.
        unsafe { task(x, packed, y.0, (m, panels, dims), (bias, None)) }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use half::bf16;

    use super::{Out, MR, NR};
    use crate::kernels::gelu::{gelu_one, run_generic};
    use crate::kernels::gemv::prefetch;
    use crate::kernels::micro::Fma;
    use crate::kernels::CpuFeatures;

    /// `x` rounded to bf16 into `y` (as long), sixteen at a time; the last
    /// few through a padded vector, so that every value rounds the same way.
    ///
    /// # Safety
    /// The CPU has AVX512F and AVX512_BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn round(x: &[f32], y: &mut [std::mem::MaybeUninit<bf16>]) {
        assert_eq!(
            x.len(),
            y.len(),
            "vl-gemm-bf16: rounding {} values into {}",
            x.len(),
            y.len()
        );
        let full = x.len() / 16 * 16;
        // SAFETY: `i + 16 <= full <= x.len() == y.len()`; the caller's
        // contract for the instructions.
        unsafe {
            for i in (0..full).step_by(16) {
                let v = _mm512_loadu_ps(x.as_ptr().add(i));
                super::store_bf16x16(y.as_mut_ptr().add(i).cast(), v);
            }
        }
        let rest = x.len() - full;
        if rest > 0 {
            let mut lanes = [0f32; 16];
            lanes[..rest].copy_from_slice(&x[full..]);
            let mut out = [bf16::ZERO; 16];
            // SAFETY: 16 values readable in `lanes`, writable in `out`.
            unsafe { super::store_bf16x16(out.as_mut_ptr(), _mm512_loadu_ps(lanes.as_ptr())) };
            for (y, v) in y[full..].iter_mut().zip(out) {
                y.write(v);
            }
        }
    }

    /// Rows `x (rows, k)` times panels `first .. last` (given as
    /// `packed`, from panel `first` on) into `y`, which points at the
    /// task's first row of the `(rows, n)` output (row stride `n`).
    ///
    /// # Safety
    /// `y` is valid for writes of `rows` rows of `n`, columns
    /// `first * NR .. min(last * NR, n)`, which no one else accesses
    /// meanwhile; the CPU has AVX512F and AVX512_BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn task<O: Out>(
        x: &[bf16],
        packed: &[u32],
        y: *mut O,
        shape: super::TaskShape,
        epilogue: super::Epilogue<'_>,
    ) {
        let (_, _, (_, k)) = shape;
        // SAFETY: the contract (AVX512_BF16, for `dot_block`, included).
        unsafe {
            blocks_of_rows::<_, O, MR>(x, packed, y, shape, epilogue, |xs, panel, mr, tile| {
                dot_block(xs, panel, k, mr, tile)
            })
        }
    }

    /// [`task`] for f32 rows on FMAs ([`super::Bf16Simd::Avx512Fma`]):
    /// per pair of `k`, the panel's 32 columns widened to f32 (as
    /// [`gemv_task`] widens them) and multiplied by `x` as it is, in
    /// blocks of [`MR_FMA`] rows.
    ///
    /// # Safety
    /// As [`task`]'s, but the CPU needs only AVX512F (AVX512_BF16 for a
    /// bf16 `O`).
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn task_fma<O: Out>(
        x: &[f32],
        packed: &[u32],
        y: *mut O,
        shape: super::TaskShape,
        epilogue: super::Epilogue<'_>,
    ) {
        let (_, _, (_, k)) = shape;
        // SAFETY: the contract (AVX-512F, for `fma_block`, included).
        unsafe {
            blocks_of_rows::<_, O, MR_FMA>(x, packed, y, shape, epilogue, |xs, panel, mr, tile| {
                fma_block(xs, panel, k, mr, tile)
            })
        }
    }

    /// Panels `first .. last` (given as `packed`) times the task's rows
    /// in blocks of up to `R`, each block's sums from `block(rows, panel,
    /// mr, tile)` stored by [`store_row`] with the epilogue: the loop of
    /// [`task`] and [`task_fma`].
    ///
    /// # Safety
    /// As [`task`]'s.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn blocks_of_rows<X, O: Out, const R: usize>(
        x: &[X],
        packed: &[u32],
        y: *mut O,
        (rows, (first, last), (n, k)): super::TaskShape,
        epilogue: super::Epilogue<'_>,
        block: impl Fn(&[X], &[u32], usize, &mut [[f32; NR]; R]),
    ) {
        let pairs = k / 2;
        for (j, panel) in (first..last).zip(packed.chunks_exact(pairs * NR)) {
            let cols = NR.min(n - j * NR);
            let mut r = 0;
            while r < rows {
                let mr = R.min(rows - r);
                let mut tile = [[0f32; NR]; R];
                block(&x[r * k..(r + mr) * k], panel, mr, &mut tile);
                for (i, row) in tile.iter().take(mr).enumerate() {
                    // SAFETY: row `r + i < rows`, columns `j * NR ..
                    // j * NR + cols` within this task's columns (the
                    // contract).
                    unsafe { store_row(row, y.add((r + i) * n + j * NR), j, cols, epilogue) };
                }
                r += mr;
            }
        }
    }

    /// `mr <= MR` rows of bf16 `x` times one panel on `vdpbf16ps`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn dot_block(xs: &[bf16], panel: &[u32], k: usize, mr: usize, tile: &mut [[f32; NR]; MR]) {
        match mr {
            8 => micro::<8>(xs, panel, k, tile),
            7 => micro::<7>(xs, panel, k, tile),
            6 => micro::<6>(xs, panel, k, tile),
            5 => micro::<5>(xs, panel, k, tile),
            4 => micro::<4>(xs, panel, k, tile),
            3 => micro::<3>(xs, panel, k, tile),
            2 => micro::<2>(xs, panel, k, tile),
            _ => micro::<1>(xs, panel, k, tile),
        }
    }

    /// `mr <= MR_FMA` rows of f32 `x` times one panel on FMAs.
    #[target_feature(enable = "avx512f")]
    fn fma_block(xs: &[f32], panel: &[u32], k: usize, mr: usize, tile: &mut [[f32; NR]; MR_FMA]) {
        match mr {
            12 => micro_fma::<12>(xs, panel, k, tile),
            11 => micro_fma::<11>(xs, panel, k, tile),
            10 => micro_fma::<10>(xs, panel, k, tile),
            9 => micro_fma::<9>(xs, panel, k, tile),
            8 => micro_fma::<8>(xs, panel, k, tile),
            7 => micro_fma::<7>(xs, panel, k, tile),
            6 => micro_fma::<6>(xs, panel, k, tile),
            5 => micro_fma::<5>(xs, panel, k, tile),
            4 => micro_fma::<4>(xs, panel, k, tile),
            3 => micro_fma::<3>(xs, panel, k, tile),
            2 => micro_fma::<2>(xs, panel, k, tile),
            _ => micro_fma::<1>(xs, panel, k, tile),
        }
    }

    /// Rows of the FMA micro-kernel: 12 × 2 accumulators, the four
    /// widened weight vectors and the mask in 29 of the 32 registers, so
    /// that the widening (four instructions a pair) is shared by 48 FMAs.
    pub(super) const MR_FMA: usize = 12;

    /// `M` rows of f32 `x` (each `k` long) times one panel into `tile`,
    /// the panel widened to f32 pair by pair.
    #[target_feature(enable = "avx512f")]
    fn micro_fma<const M: usize>(
        x: &[f32],
        panel: &[u32],
        k: usize,
        tile: &mut [[f32; NR]; MR_FMA],
    ) {
        let pairs = k / 2;
        assert!(x.len() >= M * k && panel.len() >= pairs * NR && M <= MR_FMA);
        let high = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
        let mut acc = [[_mm512_setzero_ps(); 2]; M];
        for p in 0..pairs {
            // SAFETY: the panel holds `pairs * NR` u32 (asserted); `p <
            // pairs`, so the 32 u32 read (two 512-bit loads) are inside it.
            let (b0, b1) = unsafe {
                let ptr = panel.as_ptr().add(p * NR) as *const __m512i;
                (_mm512_loadu_si512(ptr), _mm512_loadu_si512(ptr.add(1)))
            };
            // bf16 is the top half of an f32: the low element shifted up,
            // the high one masked.
            let lo0 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(b0));
            let hi0 = _mm512_castsi512_ps(_mm512_and_si512(b0, high));
            let lo1 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(b1));
            let hi1 = _mm512_castsi512_ps(_mm512_and_si512(b1, high));
            for (r, a) in acc.iter_mut().enumerate() {
                // SAFETY: `r < M` rows of `k` values are in `x` (asserted)
                // and `2p + 1 < k`.
                let (xa, xb) = unsafe {
                    let xp = x.as_ptr().add(r * k + 2 * p);
                    (_mm512_set1_ps(*xp), _mm512_set1_ps(*xp.add(1)))
                };
                a[0] = _mm512_fmadd_ps(lo0, xa, a[0]);
                a[1] = _mm512_fmadd_ps(lo1, xa, a[1]);
                a[0] = _mm512_fmadd_ps(hi0, xb, a[0]);
                a[1] = _mm512_fmadd_ps(hi1, xb, a[1]);
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

    /// The sums of one row of panel `j` (`cols` of its [`NR`] columns
    /// valid) plus the bias, through GELU if asked, stored at `dst` as
    /// `O`: a full panel as two vectors (rounded to bf16 by
    /// [`super::store_bf16x16`]), a partial one element by element.
    ///
    /// # Safety
    /// `cols` elements writable at `dst`; `bias`, if any, has `j * NR +
    /// cols` values; the CPU has AVX512F and AVX512_BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    #[inline]
    pub(super) unsafe fn store_row<O: Out>(
        row: &[f32; NR],
        dst: *mut O,
        j: usize,
        cols: usize,
        (bias, gelu): super::Epilogue<'_>,
    ) {
        // SAFETY: the contract.
        unsafe {
            if cols == NR {
                let mut v = [
                    _mm512_loadu_ps(row.as_ptr()),
                    _mm512_loadu_ps(row.as_ptr().add(16)),
                ];
                if let Some(b) = bias {
                    for (h, v) in v.iter_mut().enumerate() {
                        let bv = _mm512_loadu_ps(b.as_ptr().add(j * NR + 16 * h));
                        *v = _mm512_add_ps(*v, bv);
                    }
                }
                if let Some(exact) = gelu {
                    // GELU's own loop over the panel's values (the same
                    // code as its pass over a tensor).
                    let mut wide = [0f32; NR];
                    _mm512_storeu_ps(wide.as_mut_ptr(), v[0]);
                    _mm512_storeu_ps(wide.as_mut_ptr().add(16), v[1]);
                    let mut out = [0f32; NR];
                    run_generic::<Fma>(exact, &wide, &mut out);
                    v = [
                        _mm512_loadu_ps(out.as_ptr()),
                        _mm512_loadu_ps(out.as_ptr().add(16)),
                    ];
                }
                for (h, v) in v.into_iter().enumerate() {
                    if O::BF16 {
                        super::store_bf16x16(dst.add(16 * h).cast(), v);
                    } else {
                        _mm512_storeu_ps(dst.add(16 * h) as *mut f32, v);
                    }
                }
            } else {
                for (c, v) in row.iter().take(cols).enumerate() {
                    let v = v + bias.map_or(0.0, |b| b[j * NR + c]);
                    let v = gelu.map_or(v, |exact| gelu_one::<Fma>(exact, v));
                    dst.add(c).write(O::from_acc(v));
                }
            }
        }
    }

    /// Rows `x (m, k)` (f32) times panels `first .. last` (`packed`, from
    /// panel `first` on) into `y (m, n)`: per pair of `k`, the panel's 32
    /// columns widened to f32 (low and high halves) and two FMAs per
    /// register and row.
    ///
    /// # Safety
    /// `y` is valid for `m` rows of `n`, columns `first * NR .. min(last *
    /// NR, n)` written by no one else meanwhile; the CPU has AVX512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn gemv_task(
        x: &[f32],
        packed: &[u32],
        y: super::SyncPtr<f32>,
        m: usize,
        (first, last): (usize, usize),
        (n, k): (usize, usize),
        bias: Option<&[f32]>,
    ) {
        let pairs = k / 2;
        let high = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
        let tune = CpuFeatures::get().tuning;
        let (ahead, hint) = (tune.prefetch_ahead, tune.prefetch);
        for (j, panel) in (first..last).zip(packed.chunks_exact(pairs * NR)) {
            let cols = NR.min(n - j * NR);
            for (r, xr) in x.chunks_exact(k).take(m).enumerate() {
                let mut acc = [_mm512_setzero_ps(); 4];
                for (p, xp) in xr.chunks_exact(2).enumerate() {
                    // SAFETY: the panel holds `pairs * NR` u32, `p < pairs`.
                    let (b0, b1) = unsafe {
                        let ptr = panel.as_ptr().add(p * NR) as *const __m512i;
                        prefetch(ptr, ahead, hint);
                        prefetch(ptr, ahead + 64, hint);
                        (_mm512_loadu_si512(ptr), _mm512_loadu_si512(ptr.add(1)))
                    };
                    let (xa, xb) = (_mm512_set1_ps(xp[0]), _mm512_set1_ps(xp[1]));
                    // bf16 is the top half of an f32: the low element
                    // shifted up, the high one masked.
                    let lo0 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(b0));
                    let hi0 = _mm512_castsi512_ps(_mm512_and_si512(b0, high));
                    let lo1 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(b1));
                    let hi1 = _mm512_castsi512_ps(_mm512_and_si512(b1, high));
                    acc[0] = _mm512_fmadd_ps(lo0, xa, acc[0]);
                    acc[1] = _mm512_fmadd_ps(hi0, xb, acc[1]);
                    acc[2] = _mm512_fmadd_ps(lo1, xa, acc[2]);
                    acc[3] = _mm512_fmadd_ps(hi1, xb, acc[3]);
                }
                let mut row = [0f32; NR];
                // SAFETY: `row` is NR = 32 f32, two 512-bit stores.
                unsafe {
                    _mm512_storeu_ps(row.as_mut_ptr(), _mm512_add_ps(acc[0], acc[1]));
                    _mm512_storeu_ps(row.as_mut_ptr().add(16), _mm512_add_ps(acc[2], acc[3]));
                }
                for (c, v) in row.iter().take(cols).enumerate() {
                    let v = v + bias.map_or(0.0, |b| b[j * NR + c]);
                    // SAFETY: row `r < m`, column `j * NR + c` of this
                    // group's columns (the contract).
                    unsafe { y.at(r * n + j * NR + c).write(v) };
                }
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

    /// The branch-free rounding is `bf16::from_f32`'s, bit for bit: on
    /// ties both ways, subnormals, the largest finite values, infinities
    /// and NaNs, and on a sweep of bit patterns across the whole range.
    #[test]
    fn exact_rounding_is_from_f32() {
        let mut values: Vec<f32> = [
            0.0,
            -0.0,
            1.0,
            1.0 + f32::EPSILON,
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            f32::from_bits(0x3f80_8001),
            f32::from_bits(0x3f80_7fff),
            f32::MIN_POSITIVE,
            f32::MIN_POSITIVE / 3.0,
            f32::from_bits(1),
            f32::from_bits(0x0000_8000),
            f32::from_bits(0x0001_8000),
            f32::MAX,
            f32::MIN,
            f32::from_bits(0x7f7f_8000),
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xff80_0001),
            f32::from_bits(0x7fbf_ffff),
        ]
        .to_vec();
        values.extend((0..1u64 << 20).map(|i| f32::from_bits((i * 4099 + (i >> 3)) as u32)));
        values.extend((0..1u32 << 16).map(|i| f32::from_bits(0x3f80_0000 | i)));
        let got = to_bf16_exact(&values);
        for (x, y) in values.iter().zip(&got) {
            assert_eq!(
                y.to_bits(),
                bf16::from_f32(*x).to_bits(),
                "{x:e} ({:#x})",
                x.to_bits()
            );
        }
    }
    use super::*;
    use candle_core::Device;

    /// The activations' rounding to bf16, on every implementation this CPU
    /// runs, is `bf16::from_f32`'s bit for bit on normal values (ties to
    /// even included) and infinities, NaN stays NaN, at lengths around the
    /// vector width and past a parallel chunk.
    #[test]
    fn rounding_to_bf16_is_half_s() {
        let special = [
            1.0f32,
            -0.0,
            f32::from_bits(0x3f80_8000), // halfway: to even (down)
            f32::from_bits(0x3f81_8000), // halfway: to even (up)
            f32::from_bits(0x3f80_8001),
            f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ];
        let isas = [Bf16Isa::portable(), CpuFeatures::get().bf16_isa()];
        for len in [0usize, 1, 15, 16, 17, 37, (1 << 14) + 5] {
            let x: Vec<f32> = (0..len)
                .map(|i| match special.get(i) {
                    Some(&v) => v,
                    None => ((i as f32) * 0.618_034).sin() * 10f32.powi(i as i32 % 9 - 4),
                })
                .collect();
            for isa in isas {
                let y = to_bf16(isa, &x);
                assert_eq!(y.len(), len);
                for (i, (&x, y)) in x.iter().zip(&y).enumerate() {
                    let want = bf16::from_f32(x);
                    if x.is_nan() {
                        assert!(y.is_nan(), "{isa:?}, {len}: NaN at {i} became {y}");
                    } else {
                        assert_eq!(y.to_bits(), want.to_bits(), "{isa:?}, {len}: {x} at {i}");
                    }
                }
            }
        }
    }

    /// Every implementation this CPU runs equals the f64 product of the
    /// bf16 values (relative error under 1e-2, the output being rounded to
    /// bf16) on odd shapes: rows not a multiple of 8 or of the task size
    /// (on AMX: last rows of up to 16 and of more, padded to a tile of
    /// rows or to a block of two), columns not a multiple of 32 (31, 33), 1
    /// row and many.
    #[test]
    fn matches_the_reference() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        for isa in CpuFeatures::get().bf16_isas() {
            for &(m, n, k) in &[
                (1, 1, 2),
                (9, 33, 18),
                (7, 31, 34),
                (16, 40, 64),
                (50, 40, 96),
                (70, 100, 64),
                (130, 65, 770),
                (197, 300, 2048),
            ] {
                let x = Tensor::randn(0f32, 1., (m, k), &dev)?.to_dtype(DType::BF16)?;
                let w = Tensor::randn(0f32, 1., (n, k), &dev)?.to_dtype(DType::BF16)?;
                let y = matmul_with(isa, &x, &w)?;
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
                assert!(err < 1e-2, "{isa:?} ({m}, {k}) x ({n}, {k}): {err}");
                // f32 activations (rounded to bf16 inside) give f32 outputs:
                // the same products, without the output's rounding.
                let y32 = matmul_with(isa, &x.to_dtype(DType::F32)?, &w)?;
                assert_eq!(y32.dtype(), DType::F32);
                let err = (y32.to_dtype(DType::F64)? - &want)?
                    .abs()?
                    .max_all()?
                    .to_scalar::<f64>()?
                    / scale;
                assert!(err < 1e-5, "{isa:?} f32 x: ({m}, {k}) x ({n}, {k}): {err}");
            }
        }
        Ok(())
    }

    /// The GELU in the epilogue gives the bits of the three steps apart
    /// (the f32 product, GELU over it, rounding to bf16 — kept in f32 on
    /// FMAs) on every accelerated implementation of the CPU, and the
    /// portable one is within a bf16 step of each; the second product
    /// takes the hidden layer and returns f32. Full and partial panels,
    /// both GELUs.
    #[test]
    fn fused_gelu_is_the_steps_apart() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        for &(m, n, k) in &[(9, 80, 64), (70, 34, 96), (130, 64, 770)] {
            let x = Tensor::randn(0f32, 1., (m, k), &dev)?;
            let w = Tensor::randn(0f32, 0.2, (n, k), &dev)?.to_dtype(DType::BF16)?;
            let b = Tensor::randn(0f32, 1., n, &dev)?;
            let packed = std::sync::Arc::new(PackedBf16::pack(&w, Some(&b))?);
            let mut isas: Vec<Bf16Isa> = CpuFeatures::get()
                .bf16_isas()
                .into_iter()
                .filter(|i| i.simd() != Bf16Simd::Portable)
                .collect();
            if isas.is_empty() {
                isas.push(Bf16Isa::portable());
            }
            for (exact, best) in [true, false]
                .into_iter()
                .flat_map(|e| isas.iter().map(move |&i| (e, i)))
            {
                let fused = packed.matmul_gelu_with(best, &x, exact)?;
                let keeps_f32 = best.simd() == Bf16Simd::Avx512Fma;
                let hidden = if keeps_f32 { DType::F32 } else { DType::BF16 };
                assert_eq!(fused.dtype(), hidden);
                let portable = packed.matmul_gelu_with(Bf16Isa::portable(), &x, exact)?;
                let step = (fused.to_dtype(DType::F32)? - portable.to_dtype(DType::F32)?)?
                    .abs()?
                    .max_all()?
                    .to_scalar::<f32>()?;
                let top = fused
                    .to_dtype(DType::F32)?
                    .abs()?
                    .max_all()?
                    .to_scalar::<f32>()?;
                assert!(
                    step <= top / 128.0,
                    "{best:?} ({m}, {n}, {k}) exact {exact}: {step}"
                );
                if accelerated() {
                    let y = packed.matmul_with(best, &x)?;
                    let act = if exact {
                        crate::Activation::Gelu
                    } else {
                        crate::Activation::GeluTanh
                    };
                    // Rounded as the second product rounds its input
                    // (`vcvtneps2bf16` flushes subnormals, which a deep
                    // negative GELU gives; candle's `to_dtype` keeps them).
                    let gelu = act.forward(&y)?.flatten_all()?.to_vec1::<f32>()?;
                    let differ = if keeps_f32 {
                        let fused = fused.flatten_all()?.to_vec1::<f32>()?;
                        fused
                            .iter()
                            .zip(&gelu)
                            .filter(|(f, a)| f.to_bits() != a.to_bits())
                            .count()
                    } else {
                        let apart = to_bf16(best, &gelu);
                        let fused = fused.flatten_all()?.to_vec1::<bf16>()?;
                        fused
                            .iter()
                            .zip(&apart)
                            .filter(|(f, a)| f.to_bits() != a.to_bits())
                            .count()
                    };
                    assert_eq!(
                        differ, 0,
                        "{best:?} ({m}, {n}, {k}) exact {exact}: values differ"
                    );
                }
                let back = std::sync::Arc::new(PackedBf16::pack(&w.t()?.contiguous()?, None)?);
                let y = back.matmul_f32(&fused)?;
                assert_eq!((y.dtype(), y.dims()), (DType::F32, &[m, k][..]));
            }
        }
        Ok(())
    }

    /// A packed weight unpacks bit for bit, keeps its bias, and its product
    /// equals the f64 product of the bf16 weight plus the bias: with f32
    /// `x` kept as is for 1 to 8 rows and, on the FMA kernel, for more
    /// (error 1e-5 of the largest sum of `|x|·|w|` terms), rounded to bf16
    /// for more elsewhere (1e-5 against the rounded `x`), for `n` not a multiple of 32 and several panel groups;
    /// bf16 `x` gives bf16 outputs (1e-2 against the product of those bf16
    /// values); on every implementation this CPU runs.
    #[test]
    fn packed_weights_match_the_reference() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        for isa in CpuFeatures::get().bf16_isas() {
            for &(n, k) in &[(1, 2), (33, 18), (31, 34), (300, 2048), (65, 770)] {
                let w = Tensor::randn(0f32, 1., (n, k), &dev)?.to_dtype(DType::BF16)?;
                let bias = Tensor::randn(0f32, 1., n, &dev)?;
                let packed = std::sync::Arc::new(PackedBf16::pack(&w, Some(&bias))?);
                assert_eq!(
                    packed.bias()?.expect("bias").to_vec1::<f32>()?,
                    bias.to_vec1::<f32>()?
                );
                assert_eq!(packed.dims(), (n, k));
                let back = packed.unpack()?.to_dtype(DType::F32)?;
                let diff = (back - w.to_dtype(DType::F32)?)?.abs()?.max_all()?;
                assert_eq!(diff.to_scalar::<f32>()?, 0.0, "({n}, {k}) unpacks");
                let w64 = w.to_dtype(DType::F64)?;
                for m in [1, 3, 8, 9, 197] {
                    let x = Tensor::randn(0f32, 1., (m, 1, k), &dev)?;
                    let kept =
                        m <= crate::kernels::gemv::MAX_ROWS || isa.simd() == Bf16Simd::Avx512Fma;
                    let used = if kept {
                        x.clone()
                    } else {
                        x.to_dtype(DType::BF16)?.to_dtype(DType::F32)?
                    };
                    // The error of `y` against the f64 product of `xs` (the
                    // activations the kernel was given), on the scale of the
                    // terms it sums (the largest `|x|·|w| + |b|`): an output
                    // whose terms cancel is near 0, and f32 rounding is not
                    // small beside it (with the largest output as the scale,
                    // (1, 2) failed in a CI run: 1.6e-5).
                    let rel = |y: &Tensor, xs: &Tensor| -> candle_core::Result<f64> {
                        let xs = xs.to_dtype(DType::F64)?;
                        let b64 = bias.to_dtype(DType::F64)?;
                        let want = xs.broadcast_matmul(&w64.t()?)?.broadcast_add(&b64)?;
                        let terms = xs
                            .abs()?
                            .broadcast_matmul(&w64.abs()?.t()?)?
                            .broadcast_add(&b64.abs()?)?;
                        let scale = terms.max_all()?.to_scalar::<f64>()?.max(1e-3);
                        let d = (y.to_dtype(DType::F64)? - &want)?.abs()?.max_all()?;
                        Ok(d.to_scalar::<f64>()? / scale)
                    };
                    let y = packed.matmul_with(isa, &x)?;
                    assert_eq!((y.dims(), y.dtype()), (&[m, 1, n][..], DType::F32));
                    let err = rel(&y, &used)?;
                    assert!(err < 1e-5, "{isa:?} f32 x ({m}, {k}) x ({n}, {k}): {err}");
                    let x16 = x.to_dtype(DType::BF16)?;
                    let y16 = packed.matmul_with(isa, &x16)?;
                    assert_eq!(y16.dtype(), DType::BF16);
                    let err = rel(&y16, &x16)?;
                    assert!(err < 1e-2, "{isa:?} bf16 x ({m}, {k}) x ({n}, {k}): {err}");
                }
            }
        }
        Ok(())
    }

    /// A weight of width 0 (or height 0) is refused with its shape, not a
    /// panic inside the pool.
    #[test]
    fn packing_refuses_empty_weights() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        for dims in [(4, 0), (0, 4)] {
            let w = Tensor::zeros(dims, DType::BF16, &dev)?;
            let err = PackedBf16::pack(&w, None).unwrap_err().to_string();
            assert!(err.contains(&format!("[{}, {}]", dims.0, dims.1)), "{err}");
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
            let err = matmul_with(Bf16Isa::portable(), &x, &w)
                .unwrap_err()
                .to_string();
            assert!(err.contains("vl-gemm-bf16"), "{err}");
        }
        Ok(())
    }
}
