//! vl's f32 matrix product for many rows (an encoder, a prefill, a batch):
//! `y = x W^T` with `x (m, k)` and `W (n, k)` in f32.
//!
//! Why vl owns it: candle's f32 product is the `gemm` crate, which picks
//! its micro-kernels once for every CPU: AVX2 ones as vl builds it, or,
//! with its `x86-v4` feature, AVX-512 ones on every CPU that has AVX-512F
//! (no switch at run time). On AMD's Zen 4, where AVX-512 is
//! double-pumped, those made a ViT encode 30% slower; on Intel's Xeons and
//! on Zen 5, which run 512-bit FMAs at full rate, the AVX2 ones leave half
//! of the machine idle. So the choice is per CPU
//! ([`crate::kernels::Tuning::f32_gemm`]), and this product is what the
//! CPUs that want AVX-512 get.
//!
//! # Layout
//! The product runs transposed, `yᵀ = W xᵀ`, so that the weight is read
//! where it lies and only `x` is packed: once per call, as panels of 32
//! rows transposed (`k × 32` floats each; `x` is `m · k` floats against
//! the weight's `n · k`). A task is a chunk of 64 weight rows × a group of
//! panels (half the core's L2 over the whole of `k`, at least 4 panels).
//! It walks `k` in blocks of 256; for every panel of the group (32 KB per
//! block, in L1) and every 8 of its weight rows (in L2) the register-tile
//! micro-kernel of the tiled attention (8 × 32, 16 AVX-512 accumulators,
//! a broadcast of a weight and two FMAs per weight row and step;
//! `Kernel::micro_rows`, one pointer per weight row) adds a `yᵀ` tile into a scratch in L2, in
//! place; at the end the scratch is stored transposed into `y`. (Packing
//! the weight per call instead cost as much as the product at a ViT's 197
//! rows.)
//!
//! One generic body compiled per instruction set (AVX-512F, AVX2+FMA, the
//! baseline) through the micro-kernel: the plain-Rust one is the fallback
//! and the oracle the others are tested against.

use std::mem::MaybeUninit;

pub mod packed;
pub use packed::PackedF32;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::features::{CpuFeatures, F32Gemm, Isa};
use crate::kernels::aligned::CacheAligned;
use crate::kernels::gemm_bf16::SyncPtr;
use crate::kernels::host::contiguous;
use crate::kernels::micro::{micro_rows, per_isa, Kernel, MR, NR};

/// Columns of `k` per block: a packed panel's block is `KC × NR` floats
/// (32 KB, in L1 while the task's weight rows pass by), a weight tile's
/// `MR × KC` (8 KB).
const KC: usize = 256;

/// Whether [`crate::Proj`] should route `x W^T` here: this CPU's tuning
/// chose vl's f32 product ([`F32Gemm::Vl`]), and [`matmul_with`] takes the
/// operands with more rows than a decode step
/// ([`crate::kernels::gemv::MAX_ROWS`], which the GEMV serves).
pub fn applies(x: &Tensor, w: &Tensor) -> bool {
    CpuFeatures::get().tuning.f32_gemm == F32Gemm::Vl
        && takes(x, w)
        && x.elem_count() / x.dims().last().copied().unwrap_or(1).max(1)
            > crate::kernels::gemv::MAX_ROWS
}

/// Whether the kernels take `x` and `w` at all, on any implementation:
/// both f32, on the CPU and untracked, `w (n, k)` contiguous with `n, k >
/// 0`, `x (..., k)` not empty.
fn takes(x: &Tensor, w: &Tensor) -> bool {
    x.device().is_cpu()
        && w.device().is_cpu()
        && !x.track_op()
        && !w.track_op()
        && x.dtype() == DType::F32
        && w.dtype() == DType::F32
        && w.rank() == 2
        && w.is_contiguous()
        && x.dims().last() == w.dims().get(1)
        && x.elem_count() > 0
        && w.elem_count() > 0
}

/// `x W^T` in f32 on the best instruction set of this CPU.
///
/// # Shapes
/// `x: (..., k)` f32 (made contiguous), `w: (n, k)` f32 contiguous →
/// `(..., n)` f32.
///
/// # Errors
/// Operands the kernels do not take, with the reason.
pub fn matmul(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    matmul_with(CpuFeatures::get().isa(), x, w)
}

/// [`matmul`] on a given implementation, on any CPU that runs it (the
/// token proves it): the portable one anywhere.
///
/// # Errors
/// Operands the kernels do not take, with the reason.
pub fn matmul_with(isa: Isa, x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    matmul_bias_with(isa, x, w, None)
}

/// `x W^T + b` in f32 on a given implementation: the bias added as the
/// product is stored (no second pass over the output), with the values of
/// [`matmul_with`] then a broadcast addition, bit for bit.
///
/// # Shapes
/// As [`matmul`], and `bias: (n)` (any float dtype; widened to f32).
///
/// # Errors
/// As [`matmul_with`], and a bias of another shape or on another device,
/// named.
pub fn matmul_bias_with(
    isa: Isa,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    if !takes(x, w) {
        candle_core::bail!(
            "vl-gemm-f32: takes untracked non-empty f32 CPU x (..., k) and a contiguous f32 w (n, k); got x {:?} {:?}, w {:?} {:?}",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype()
        );
    }
    op(isa, x, w, bias)
}

/// [`matmul_bias_with`] on this CPU's best implementation, for operands
/// the caller has checked with [`applies`] (the op itself still refuses
/// what it cannot compute).
pub(crate) fn apply(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> candle_core::Result<Tensor> {
    op(CpuFeatures::get().isa(), x, w, bias)
}

fn op(isa: Isa, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let n = w.dims().first().copied().unwrap_or(0);
    let bias = match bias {
        Some(b) if b.dims() != [n] || !b.device().is_cpu() => candle_core::bail!(
            "vl-gemm-f32: a bias of the weight's {n} outputs on the CPU; got {:?} on {:?}",
            b.dims(),
            b.device()
        ),
        Some(b) => Some(b.to_dtype(DType::F32)?.contiguous()?),
        None => None,
    };
    x.contiguous()?.apply_op2_no_bwd(w, &GemmF32 { isa, bias })
}

struct GemmF32 {
    isa: Isa,
    /// `(n)` f32, contiguous.
    bias: Option<Tensor>,
}

fn slice<'a>(s: &'a CpuStorage, l: &Layout, arg: &str) -> candle_core::Result<&'a [f32]> {
    let CpuStorage::F32(d) = s else {
        candle_core::bail!("vl-gemm-f32: {arg} must be f32, got {:?}", s.dtype());
    };
    contiguous(d, l, "vl-gemm-f32", arg)
}

impl CustomOp2 for GemmF32 {
    fn name(&self) -> &'static str {
        "vl-gemm-f32"
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
        if dims.last() != Some(&k) || n == 0 || k == 0 {
            candle_core::bail!("vl-gemm-f32: x {dims:?}, w ({n}, {k})");
        }
        let m = l1.shape().elem_count() / k;
        let (x, w) = (slice(s1, l1, "x")?, slice(s2, l2, "w")?);
        let y = match &self.bias {
            Some(b) => crate::kernels::with_values(b, |b: &[f32]| {
                product(self.isa, x, w, Some(b), m, n, k)
            })?,
            None => product(self.isa, x, w, None, m, n, k),
        };
        let mut shape = dims[..dims.len() - 1].to_vec();
        shape.push(n);
        Ok((CpuStorage::F32(y), Shape::from(shape)))
    }
}

/// `y (m, n)` = `x (m, k)` times `w (n, k)` transposed, plus `bias (n)`.
fn product(
    isa: Isa,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    m: usize,
    n: usize,
    k: usize,
) -> Vec<f32> {
    debug_assert!(x.len() == m * k && w.len() == n * k && n > 0 && k > 0);
    debug_assert!(bias.is_none_or(|b| b.len() == n));
    let panels = m.div_ceil(NR);
    let xp = pack_rows(isa, x, m, k);
    let group = group_panels(CpuFeatures::get().l2_bytes, k).min(panels);
    let groups = panels.div_ceil(group);
    let chunks = n.div_ceil(TASK_W);
    // Not zeroed first: every task writes each element of its rows and
    // columns.
    let mut y: Vec<f32> = Vec::with_capacity(m * n);
    let out = SyncPtr(y.as_mut_ptr());
    (0..groups * chunks).into_par_iter().for_each(|t| {
        // Row-group-major: the tasks that read the same packed rows are
        // neighbours (in L3 together), each on its own weight rows.
        let (g, c) = (t / chunks, t % chunks);
        let panel_range = g * group..((g + 1) * group).min(panels);
        let w_rows = c * TASK_W..((c + 1) * TASK_W).min(n);
        let bias = bias.map(|b| &b[w_rows.clone()]);
        task(isa, &xp, w, bias, out, panel_range, w_rows, m, n, k);
    });
    // SAFETY: the tasks cover every row group × weight chunk, and each
    // writes every element of its rows (below `m`) and columns: all `m *
    // n` elements are initialised.
    unsafe { y.set_len(m * n) };
    y
}

/// Bytes of packed rows that one task multiplies, over the whole of `k`:
/// half of the core's L2 (`l2`, [`CpuFeatures::l2_bytes`]; 2 MB where the
/// CPU does not say), so that the next task, on the same rows and the
/// next weight rows, finds them there; at least [`MIN_GROUP`] panels.
/// Sized per block of `k` (512 KB a block, 1.5 MB of a ViT's rows at
/// batch 8), the rows came from L3 in every task: at 1,576 rows 200–245
/// GFLOP/s; at half the 2 MB L2, 285–350 (`bench_gemm --rows 1576`, Xeon
/// model 167). Zen 5's L2 is 1 MB: half the rows per task there.
fn group_bytes(l2: Option<usize>) -> usize {
    l2.unwrap_or(2 << 20) / 2
}

/// Panels of packed rows per task for an L2 of `l2` bytes at width `k`:
/// [`group_bytes`] of them, within [`MIN_GROUP`]..=[`MAX_GROUP`].
fn group_panels(l2: Option<usize>, k: usize) -> usize {
    (group_bytes(l2) / (k * NR * 4)).clamp(MIN_GROUP, MAX_GROUP)
}
/// The fewest panels per task where there are more: at a ViT's 197 rows
/// and `k` = 3,072 (7 panels, 2.7 MB), two groups rather than four (each
/// one more pass over the weight) measured faster.
const MIN_GROUP: usize = 4;
/// The most panels per task (2,048 rows; reached where `k` < 128), which
/// bounds a thread's scratch.
const MAX_GROUP: usize = 64;
/// Weight rows (output columns) per task: [`TASK_W`] / [`MR`] blocks.
const TASK_W: usize = 8 * MR;

/// `x (m, k)` as panels of [`NR`] rows transposed: panel `q` holds `x[q ·
/// NR + l][p]` at `p · NR + l`, zero past row `m` — the micro-kernel's
/// `b` operand, so that the weight is read where it lies. On AVX-512F by
/// blocks of 16 × 16 transposed in registers (element by element, the
/// packing was ~4% of a batch-8 ViT encode, `perf`, Xeon model 167).
fn pack_rows(isa: Isa, x: &[f32], m: usize, k: usize) -> CacheAligned<f32> {
    let panels = m.div_ceil(NR);
    let avx512 = isa.simd() == super::features::Simd::Avx512;
    let pack = |xp: &mut [MaybeUninit<f32>]| {
        xp.par_chunks_mut(k * NR)
            .enumerate()
            .for_each(|(q, panel)| {
                let rows = &x[q * NR * k..(q * NR + NR.min(m - q * NR)) * k];
                // SAFETY: `avx512` only where the token proves AVX-512F.
                unsafe { pack_one(avx512, rows, k, panel) };
            })
    };
    // SAFETY: the panels cover the buffer, and each packer writes every
    // value of its panel (zeros past row `m`). Not zeroed first: that was
    // a one-thread `memset` of the whole of `x` per product, 2% of a
    // Florence-2 f32 encode (`perf`, Xeon model 167).
    unsafe { CacheAligned::written_by(panels * k * NR, pack) }
}

/// One panel of [`pack_rows`]: `rows` (at most [`NR`] rows of `k`) into
/// `panel` (`k × NR`) transposed, the lanes past the last row zero; the
/// whole columns of 16 by register transposes where `avx512`, the rest
/// element by element.
///
/// # Safety
/// With `avx512`, the CPU has AVX-512F.
unsafe fn pack_one(avx512: bool, rows: &[f32], k: usize, panel: &mut [MaybeUninit<f32>]) {
    #[cfg(target_arch = "x86_64")]
    let from = if avx512 {
        let whole = k / 16 * 16;
        // SAFETY: the contract.
        unsafe { crate::kernels::micro::transpose_rows(rows, k, whole, None, panel) };
        whole
    } else {
        0
    };
    #[cfg(not(target_arch = "x86_64"))]
    let from = {
        let _ = avx512;
        0
    };
    pack_panel(rows, k, from, panel);
}

/// Columns `from ..` of `rows` (at most [`NR`] rows of `k`) into `panel`
/// (`k × NR`) transposed, element by element, the lanes past the last row
/// zero: every value of those columns written.
fn pack_panel(rows: &[f32], k: usize, from: usize, panel: &mut [MaybeUninit<f32>]) {
    let here = rows.len() / k;
    // Sixteen columns of `k` at a time: the 16 panel rows being written
    // (2 KB) and the 16 floats read from each row stay in L1 (a whole row
    // at a time wrote a `k × 128`-byte panel one float per cache line).
    const P: usize = 16;
    for p0 in (from..k).step_by(P) {
        let p1 = (p0 + P).min(k);
        let out = &mut panel[p0 * NR..p1 * NR];
        for (l, row) in rows.chunks_exact(k).enumerate() {
            for (t, &v) in row[p0..p1].iter().enumerate() {
                out[t * NR + l].write(v);
            }
        }
        for t in 0..p1 - p0 {
            for v in &mut out[t * NR + here..(t + 1) * NR] {
                v.write(0.0);
            }
        }
    }
}

per_isa! {
    /// One task of [`product`]: rows `panels` (of [`NR`]) × columns
    /// `w_rows` of `y (m, n)`, plus those columns' `bias`.
    #[allow(clippy::too_many_arguments)]
    fn task(
        xp: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        y: SyncPtr<f32>,
        panels: std::ops::Range<usize>,
        w_rows: std::ops::Range<usize>,
        m: usize,
        n: usize,
        k: usize,
    ) = task_on::<crate::kernels::micro::Avx512>
}

thread_local! {
    /// A task's `yᵀ` scratch, kept by its thread for the next task (at
    /// most [`TASK_W`] × [`MAX_GROUP`] panels: 512 KB). Allocated and
    /// zeroed per task, it was a `memset` of the whole output per product:
    /// 6% of a Florence-2 f32 encode (`perf`, Xeon model 167).
    static SCRATCH: std::cell::Cell<Option<CacheAligned<f32>>> = const { std::cell::Cell::new(None) };
}

/// [`task`] for the micro-kernel `K`: the products transposed, `yᵀ` tiles
/// of [`MR`] weight rows × [`NR`] rows of `x`, the weight rows broadcast
/// from where they lie and the packed rows of `x` as vectors; the sums
/// accumulate over the blocks of `k` in a scratch `yᵀ` (in L2), stored
/// transposed into `y` at the end, the bias added as they are.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn task_on<K: Kernel>(
    xp: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    y: SyncPtr<f32>,
    panels: std::ops::Range<usize>,
    w_rows: std::ops::Range<usize>,
    m: usize,
    n: usize,
    k: usize,
) {
    let width = panels.len() * NR;
    let height = w_rows.len().next_multiple_of(MR);
    let mut scratch = take_scratch(height * width);
    let ct = &mut scratch[..height * width];
    task_sums::<K>(xp, w, panels.clone(), w_rows.clone(), m, k, ct);
    let rows = panels.start * NR..(panels.end * NR).min(m);
    store_rows::<K>(ct, width, rows, w_rows, bias, y, n);
    SCRATCH.set(Some(scratch));
}

/// The thread's scratch ([`SCRATCH`]), of at least `len` values, not
/// zeroed: every tile is written at the first block of `k` (`fresh`)
/// before it is read.
fn take_scratch(len: usize) -> CacheAligned<f32> {
    SCRATCH
        .take()
        .filter(|c| c.len() >= len)
        .unwrap_or_else(|| CacheAligned::new(len))
}

/// The sums of a task: `ct` (`w_rows` rounded up to [`MR`] rows of
/// `panels.len() · NR`) = weight rows `w_rows` of `w (.., k)` times the
/// packed rows `panels` of `xp` (`m` rows in all), transposed.
#[inline(always)]
fn task_sums<K: Kernel>(
    xp: &[f32],
    w: &[f32],
    panels: std::ops::Range<usize>,
    w_rows: std::ops::Range<usize>,
    m: usize,
    k: usize,
    ct: &mut [f32],
) {
    let width = panels.len() * NR;
    // The last weight rows, when fewer than MR, zero-padded to a tile
    // (only the last chunk of the weight has them).
    let tail_len = if w_rows.len().is_multiple_of(MR) {
        0
    } else {
        MR * KC.min(k)
    };
    let mut w_tail = vec![0f32; tail_len];
    for k0 in (0..k).step_by(KC) {
        let kc = KC.min(k - k0);
        let full = w_rows.len() / MR * MR;
        if tail_len > 0 {
            // The last weight rows of this block of `k`, copied once.
            w_tail.fill(0.0);
            for r in 0..w_rows.len() - full {
                let j = w_rows.start + full + r;
                w_tail[r * kc..(r + 1) * kc].copy_from_slice(&w[j * k + k0..j * k + k0 + kc]);
            }
        }
        // Panel-major: a panel's block (`KC × NR` floats) stays in L1
        // while the task's weight rows (`TASK_W × KC`, in L2) pass by.
        for (q, panel) in panels.clone().enumerate() {
            let b = &xp[panel * k * NR + k0 * NR..];
            // A last panel of at most 16 rows takes half the columns.
            let half = m - panel * NR <= NR / 2;
            for j0 in w_rows.clone().step_by(MR) {
                let (a, rs): (&[f32], usize) = if j0 - w_rows.start < full {
                    (&w[j0 * k + k0..], k)
                } else {
                    (&w_tail[..], kc)
                };
                let at = (j0 - w_rows.start) * width + q * NR;
                micro_rows::<K>(a, rs, b, kc, &mut ct[at..], width, k0 == 0, half);
            }
        }
    }
}

/// A task's sums `ct` (`width` columns a row, from row `rows.start` of
/// `y`) stored transposed into rows `rows`, columns `w_rows` of `y (.., n)`,
/// plus those columns' `bias`.
#[inline(always)]
fn store_rows<K: Kernel>(
    ct: &[f32],
    width: usize,
    rows: std::ops::Range<usize>,
    w_rows: std::ops::Range<usize>,
    bias: Option<&[f32]>,
    y: SyncPtr<f32>,
    n: usize,
) {
    let first = rows.start;
    // Whole blocks of 16 weight rows by 16 rows of `x` transposed in
    // registers where AVX-512F runs (element by element, the store was
    // ~4% of the product); the rest element by element.
    #[cfg(target_arch = "x86_64")]
    let done = if K::AVX512 {
        let whole = w_rows.len() / 16 * 16;
        // SAFETY: `K::AVX512` is set by the AVX-512F kernel alone, which
        // `per_isa` runs only where the CPU has it; the scratch holds
        // `width` values (a multiple of 32) for each of its rows, rows
        // `rows` and columns `w_rows` of `y` are this task's.
        unsafe {
            store_transposed_avx512(ct, width, rows.clone(), whole, bias, y, n, w_rows.start)
        };
        whole
    } else {
        0
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    for i in rows {
        // SAFETY: row `i` and columns `w_rows` (≤ n) of `y` are this
        // task's alone, and `y` outlives the parallel loop.
        let row =
            unsafe { std::slice::from_raw_parts_mut(y.0.add(i * n + w_rows.start), w_rows.len()) };
        for (j, v) in row.iter_mut().enumerate().skip(done) {
            let s = ct[j * width + (i - first)];
            // No addition without a bias: `-0.0 + 0.0` would be `+0.0`.
            *v = bias.map_or(s, |b| s + b[j]);
        }
    }
}

/// A dense layer as [`ffn`]'s products read it: its weight `(n, k)`
/// row-major and its bias `(n)`, if any.
#[derive(Clone, Copy)]
struct Layer<'a> {
    w: &'a [f32],
    bias: Option<&'a [f32]>,
    n: usize,
}

thread_local! {
    /// A feed-forward chunk's packed rows of `x` and of its hidden layer
    /// ([`ffn_chunk`]), kept by the thread for the next chunk.
    static FFN_PANELS: std::cell::Cell<Option<(CacheAligned<f32>, CacheAligned<f32>)>> =
        const { std::cell::Cell::new(None) };
}

/// Rows per chunk of [`ffn`] at width `k` and hidden width `h`, for an L2
/// of `l2` bytes: the chunk's packed rows of `x` and of the hidden layer,
/// and a task's scratch, in [`group_bytes`] (a multiple of [`NR`], at
/// least one panel).
fn ffn_rows(l2: Option<usize>, k: usize, h: usize) -> usize {
    (group_bytes(l2) / ((k + h + TASK_W) * 4) / NR * NR).clamp(NR, MAX_GROUP * NR)
}

/// Rows per chunk of [`ffn`] for `m` rows on `threads` threads, where
/// [`ffn_rows`] allows `most`: one chunk a thread where that is at most
/// twice `most` (a ViT's 197 rows: two of 99, each 3½ panels, where
/// chunks of 64 left one thread 4 panels and the other 2½), else `most`.
fn ffn_chunk_rows(m: usize, most: usize, threads: usize) -> usize {
    let even = m.div_ceil(threads.max(1)).max(1);
    if even <= 2 * most {
        even
    } else {
        most
    }
}

/// Whether [`ffn`] should run a feed-forward of `m` rows: where this
/// CPU's tuning chose vl's f32 product and the rows are an encoder's or a
/// prefill's, at least [`FFN_MIN_ROWS`]. In chunks it was faster than the
/// three steps apart at every shape measured, from 16 rows to 36,864
/// (`bench_gemm --ffn`, weights in cache); below that a chunk a thread
/// would read each weight once per thread, which a batch's decode step,
/// streaming its weights from memory, cannot afford.
pub fn ffn_applies(m: usize) -> bool {
    CpuFeatures::get().tuning.f32_gemm == F32Gemm::Vl && m >= FFN_MIN_ROWS
}

/// The fewest rows [`ffn_applies`] takes: two panels a thread on two.
pub const FFN_MIN_ROWS: usize = 4 * NR;

/// A feed-forward layer in f32, `GELU(x upᵀ + b_up) downᵀ + b_down`
/// (the exact GELU, or its tanh form), a chunk of rows at a time, each
/// chunk through both products on one thread: the hidden layer is
/// written by the first product's stores as the second product's packed
/// rows, plus its bias and through the GELU, and never leaves the core's
/// L2 (apart, a Florence-2 first-stage layer's 75 MB hidden layer went
/// to memory and back three times: stored, through the GELU, packed). A
/// chunk's packed rows of `x` and of the hidden layer take half the L2, or
/// the chunks are one a thread where that is at most twice as many rows.
/// The values of the three steps apart ([`matmul_bias_with`], then vl's
/// GELU as [`crate::FeedForward`] runs it, then [`matmul_bias_with`]), bit
/// for bit.
///
/// # Shapes
/// `x: (..., k)` f32, `up: (h, k)` and `down: (n, h)` f32 contiguous,
/// biases `(h)` and `(n)` (any float dtype) → `(..., n)` f32.
///
/// # Errors
/// Operands of other shapes, dtypes or devices, named.
pub fn ffn(
    isa: Isa,
    x: &Tensor,
    up: (&Tensor, Option<&Tensor>),
    down: (&Tensor, Option<&Tensor>),
    exact: bool,
) -> candle_core::Result<Tensor> {
    ffn_in_chunks(isa, x, up, down, exact, None)
}

/// [`ffn`] in chunks of `chunk` rows (at least one), or as [`ffn`]
/// chooses ([`ffn_rows`], [`ffn_chunk_rows`]).
fn ffn_in_chunks(
    isa: Isa,
    x: &Tensor,
    up: (&Tensor, Option<&Tensor>),
    down: (&Tensor, Option<&Tensor>),
    exact: bool,
    chunk: Option<usize>,
) -> candle_core::Result<Tensor> {
    let (h, n) = (
        up.0.dims().first().copied().unwrap_or(0),
        down.0.dims().first().copied().unwrap_or(0),
    );
    if !takes(x, up.0) || !takes(&up.0.t()?, down.0) {
        candle_core::bail!(
            "vl-gemm-f32 ffn: takes untracked non-empty f32 CPU x (..., k), up (h, k) and down (n, h) contiguous; got x {:?} {:?}, up {:?} {:?}, down {:?} {:?}",
            x.dims(),
            x.dtype(),
            up.0.dims(),
            up.0.dtype(),
            down.0.dims(),
            down.0.dtype()
        );
    }
    let bias = |b: Option<&Tensor>, len: usize, name: &str| match b {
        Some(b) if b.dims() != [len] || !b.device().is_cpu() => candle_core::bail!(
            "vl-gemm-f32 ffn: a {name} bias of {len} values on the CPU; got {:?} on {:?}",
            b.dims(),
            b.device()
        ),
        Some(b) => Ok(Some(b.to_dtype(DType::F32)?.to_vec1::<f32>()?)),
        None => Ok(None),
    };
    let op = Ffn {
        isa,
        up_bias: bias(up.1, h, "up")?,
        down_bias: bias(down.1, n, "down")?,
        exact,
        chunk,
    };
    x.contiguous()?.apply_op3_no_bwd(up.0, down.0, &op)
}

struct Ffn {
    isa: Isa,
    /// The biases' values, widened to f32 once, as the op is built.
    up_bias: Option<Vec<f32>>,
    down_bias: Option<Vec<f32>>,
    exact: bool,
    /// Rows per chunk, if not [`ffn_rows`].
    chunk: Option<usize>,
}

impl candle_core::CustomOp3 for Ffn {
    fn name(&self) -> &'static str {
        "vl-gemm-f32-ffn"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (h, k) = l2.shape().dims2()?;
        let (n, h2) = l3.shape().dims2()?;
        let dims = l1.shape().dims();
        if dims.last() != Some(&k) || h2 != h || n == 0 || h == 0 || k == 0 {
            candle_core::bail!("vl-gemm-f32 ffn: x {dims:?}, up ({h}, {k}), down ({n}, {h2})");
        }
        let m = l1.shape().elem_count() / k;
        let x = slice(s1, l1, "x")?;
        let up = Layer {
            w: slice(s2, l2, "up")?,
            bias: self.up_bias.as_deref(),
            n: h,
        };
        let down = Layer {
            w: slice(s3, l3, "down")?,
            bias: self.down_bias.as_deref(),
            n,
        };
        let chunk = self.chunk.unwrap_or_else(|| {
            let most = ffn_rows(CpuFeatures::get().l2_bytes, k, h);
            ffn_chunk_rows(m, most, rayon::current_num_threads())
        });
        let mut y: Vec<f32> = Vec::with_capacity(m * n);
        let out = SyncPtr(y.as_mut_ptr());
        (0..m.div_ceil(chunk)).into_par_iter().for_each(|c| {
            let rows = c * chunk..((c + 1) * chunk).min(m);
            // SAFETY: row `rows.start < m` of `y`'s `m * n` values.
            let y = SyncPtr(unsafe { out.at(rows.start * n) });
            let x = &x[rows.start * k..rows.end * k];
            ffn_chunk(self.isa, x, rows.len(), k, up, down, self.exact, y);
        });
        // SAFETY: the chunks cover the rows, and each stores every element
        // of its rows (`store_rows` over every weight row of `down`).
        unsafe { y.set_len(m * n) };
        let mut shape = dims[..dims.len() - 1].to_vec();
        shape.push(n);
        Ok((CpuStorage::F32(y), Shape::from(shape)))
    }
}

per_isa! {
    /// One chunk of [`ffn`]: `rows` rows of `x (rows, k)` through `up`, its
    /// bias and the GELU, and `down` into `y`'s rows (from the chunk's
    /// first).
    #[allow(clippy::too_many_arguments)]
    fn ffn_chunk(
        x: &[f32],
        rows: usize,
        k: usize,
        up: Layer<'_>,
        down: Layer<'_>,
        exact: bool,
        y: SyncPtr<f32>,
    ) = ffn_chunk_on::<crate::kernels::micro::Avx512>
}

/// [`ffn_chunk`] for the micro-kernel `K`. The first product's sums
/// (`yᵀ` tiles: hidden units × rows) are, per panel of rows, already the
/// second product's packed layout (`h × NR`): they are stored there plus
/// the bias and through the GELU, the lanes past the last row zero.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn ffn_chunk_on<K: Kernel>(
    x: &[f32],
    rows: usize,
    k: usize,
    up: Layer<'_>,
    down: Layer<'_>,
    exact: bool,
    y: SyncPtr<f32>,
) {
    use crate::kernels::gelu::gelu_one;
    let (h, n) = (up.n, down.n);
    let panels = rows.div_ceil(NR);
    let width = panels * NR;
    let (mut xp, mut hp) = FFN_PANELS
        .take()
        .filter(|(a, b)| a.len() >= panels * k * NR && b.len() >= panels * h * NR)
        .unwrap_or_else(|| {
            (
                CacheAligned::new(panels * k * NR),
                CacheAligned::new(panels * h * NR),
            )
        });
    #[cfg(target_arch = "x86_64")]
    let avx512 = K::AVX512;
    #[cfg(not(target_arch = "x86_64"))]
    let avx512 = false;
    for q in 0..panels {
        let here = NR.min(rows - q * NR);
        let panel = &mut xp[q * k * NR..(q + 1) * k * NR];
        // SAFETY: `MaybeUninit<f32>` has `f32`'s layout, and `pack_one`
        // writes f32 values only; `K::AVX512` is set by the AVX-512F
        // kernel alone, which `per_isa` runs only where the CPU has it.
        unsafe {
            let panel = &mut *(panel as *mut [f32] as *mut [MaybeUninit<f32>]);
            pack_one(avx512, &x[q * NR * k..(q * NR + here) * k], k, panel);
        }
    }
    let mut scratch = take_scratch(TASK_W * width);
    for c0 in (0..h).step_by(TASK_W) {
        let w_rows = c0..(c0 + TASK_W).min(h);
        let ct = &mut scratch[..w_rows.len().next_multiple_of(MR) * width];
        task_sums::<K>(&xp, up.w, 0..panels, w_rows.clone(), rows, k, ct);
        for (jj, j) in w_rows.enumerate() {
            let b = up.bias.map(|b| b[j]);
            for q in 0..panels {
                let live = NR.min(rows - q * NR);
                let sums = &ct[jj * width + q * NR..][..live];
                let out = &mut hp[(q * h + j) * NR..][..NR];
                for (o, &s) in out.iter_mut().zip(sums) {
                    // No addition without a bias, as `store_rows`.
                    *o = gelu_one::<K>(exact, b.map_or(s, |b| s + b));
                }
                out[live..].fill(0.0);
            }
        }
    }
    for c0 in (0..n).step_by(TASK_W) {
        let w_rows = c0..(c0 + TASK_W).min(n);
        let ct = &mut scratch[..w_rows.len().next_multiple_of(MR) * width];
        task_sums::<K>(&hp, down.w, 0..panels, w_rows.clone(), rows, h, ct);
        let bias = down.bias.map(|b| &b[w_rows.clone()]);
        store_rows::<K>(ct, width, 0..rows, w_rows, bias, y, n);
    }
    SCRATCH.set(Some(scratch));
    FFN_PANELS.set(Some((xp, hp)));
}

/// The scratch's first `whole` rows (a multiple of 16; weight rows
/// `col0 ..` of `y`) stored transposed into rows `rows` of `y (.., n)`,
/// plus the bias: blocks of 16 × 16 through registers
/// ([`crate::kernels::micro::transpose16`]), the values of the scalar
/// store.
///
/// # Safety
/// The CPU has AVX-512F; `ct` holds `whole` rows of `width` values with
/// `width >= rows.len()` rounded up to 16; `bias` (if any) has at least
/// `whole` values; `y` is valid for writes of rows `rows`, columns `col0
/// .. col0 + whole`, which no one else accesses meanwhile.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn store_transposed_avx512(
    ct: &[f32],
    width: usize,
    rows: std::ops::Range<usize>,
    whole: usize,
    bias: Option<&[f32]>,
    y: SyncPtr<f32>,
    n: usize,
    col0: usize,
) {
    use std::arch::x86_64::*;
    let first = rows.start;
    assert!(
        whole.is_multiple_of(16)
            && (rows.len().next_multiple_of(16) <= width)
            && ct.len() >= whole * width
            && bias.is_none_or(|b| b.len() >= whole),
        "vl-gemm-f32: a transposed store of {whole} rows of {width} outside its scratch"
    );
    for i0 in rows.clone().step_by(16) {
        let here = (rows.end - i0).min(16);
        for j0 in (0..whole).step_by(16) {
            // SAFETY: rows `j0 .. j0 + 16 <= whole` of the scratch, its
            // columns `i0 - first .. + 16 <= width` (asserted above).
            let r: [__m512; 16] = std::array::from_fn(|jj| unsafe {
                _mm512_loadu_ps(ct.as_ptr().add((j0 + jj) * width + (i0 - first)))
            });
            // SAFETY: AVX-512F (the contract).
            let cols = unsafe { crate::kernels::micro::transpose16(&r) };
            // SAFETY: `j0 + 16 <= whole <= b.len()`.
            let b = bias.map(|b| unsafe { _mm512_loadu_ps(b.as_ptr().add(j0)) });
            for (ii, &col) in cols.iter().enumerate().take(here) {
                let v = b.map_or(col, |b| _mm512_add_ps(col, b));
                // SAFETY: row `i0 + ii < rows.end`, columns `col0 + j0 ..
                // + 16 <= col0 + whole`: the contract.
                unsafe { _mm512_storeu_ps(y.0.add((i0 + ii) * n + col0 + j0), v) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// A task's rows take half the L2: 1 MB of a 2 MB one (Sapphire Rapids
    /// class Xeons), 512 KB of Zen 5's 1 MB, 1 MB where the CPU does not
    /// say. At `k` = 768 (a panel of 32 rows is 96 KB) that is 10 panels a
    /// task (a ViT-B's 197 rows, 7 panels, in one group) against 5 on Zen
    /// 5; at `k` = 3,072 both take the fewest, 4.
    #[test]
    fn row_groups_follow_the_l2() {
        assert_eq!(group_bytes(Some(2 << 20)), 1 << 20);
        assert_eq!(group_bytes(Some(1 << 20)), 512 << 10);
        assert_eq!(group_bytes(None), 1 << 20);
        assert_eq!(group_panels(Some(2 << 20), 768), 10);
        assert_eq!(group_panels(Some(1 << 20), 768), 5);
        assert_eq!(group_panels(Some(2 << 20), 3072), MIN_GROUP);
        assert_eq!(group_panels(Some(1 << 20), 3072), MIN_GROUP);
    }

    /// A tensor's f32 values as bits.
    fn bits(t: &Tensor) -> candle_core::Result<Vec<u32>> {
        Ok(t.flatten_all()?
            .to_vec1::<f32>()?
            .into_iter()
            .map(f32::to_bits)
            .collect())
    }

    /// `x W^T` in f64, one dot product per element.
    fn reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
        let mut y = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                y[i * n + j] = (0..k)
                    .map(|p| x[i * k + p] as f64 * w[j * k + p] as f64)
                    .sum();
            }
        }
        y
    }

    /// Every implementation the CPU runs against the f64 oracle, on sizes
    /// that leave partial row tiles, partial panels, partial groups and a
    /// partial block of `k`: each element within `k · 2⁻²³ · Σ|x w|` of
    /// the exact sum (f32 rounding of `k` additions), and the SIMD ones
    /// within 1e-6 relative of the portable one.
    #[test]
    fn matches_f64_on_every_isa() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        for (m, n, k) in [
            (9, 1, 1),
            (9, 33, 7),
            (17, 130, 513),
            (64, 257, 1030),
            (203, 96, 64),
            (8, 32, 512),
            // Three groups of panels (4, 4, 2; the last half-used).
            (300, 70, 2100),
        ] {
            let x = Tensor::randn(0f32, 1., (m, k), &dev)?;
            let w = Tensor::randn(0f32, 1., (n, k), &dev)?;
            let (xv, wv) = (
                x.flatten_all()?.to_vec1::<f32>()?,
                w.flatten_all()?.to_vec1::<f32>()?,
            );
            let exact = reference(&xv, &wv, m, n, k);
            let abs: Vec<f64> = reference(
                &xv.iter().map(|v| v.abs()).collect::<Vec<_>>(),
                &wv.iter().map(|v| v.abs()).collect::<Vec<_>>(),
                m,
                n,
                k,
            );
            let portable = matmul_with(Isa::portable(), &x, &w)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            for isa in CpuFeatures::get().isas() {
                let y = matmul_with(isa, &x, &w)?;
                assert_eq!(y.dims(), &[m, n]);
                let y = y.flatten_all()?.to_vec1::<f32>()?;
                for (i, ((&got, &want), &bound)) in y.iter().zip(&exact).zip(&abs).enumerate() {
                    let tol = bound * k as f64 * f32::EPSILON as f64;
                    assert!(
                        (got as f64 - want).abs() <= tol,
                        "{isa:?} ({m}, {n}, {k}) element {i}: {got} vs {want} (±{tol})"
                    );
                    let p = portable[i];
                    assert!(
                        (got - p).abs() <= 1e-6 * bound as f32 + f32::MIN_POSITIVE,
                        "{isa:?} ({m}, {n}, {k}) element {i}: {got} vs portable {p}"
                    );
                }
            }
        }
        Ok(())
    }

    /// Leading dimensions are rows: `(2, 3, 10, k)` is 60 rows, the same
    /// values as the flattened product.
    #[test]
    fn leading_dimensions_are_rows() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1., (2, 3, 10, 40), &dev)?;
        let w = Tensor::randn(0f32, 1., (50, 40), &dev)?;
        let y = matmul(&x, &w)?;
        assert_eq!(y.dims(), &[2, 3, 10, 50]);
        let flat = matmul(&x.reshape((60, 40))?, &w)?.reshape((2, 3, 10, 50))?;
        let diff = (y - flat)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        // A transposed (non-contiguous) x is made contiguous first.
        let xt = Tensor::randn(0f32, 1., (40, 12), &dev)?.t()?;
        let want = xt.contiguous()?.matmul(&w.t()?)?;
        let got = matmul(&xt, &w)?;
        let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-4, "{diff}");
        Ok(())
    }

    /// The bias added as the product is stored: the values of the product
    /// then a broadcast addition, bit for bit, on every instruction set,
    /// with a partial last weight chunk and a half last panel; a bf16 bias
    /// is widened.
    #[test]
    fn bias_as_it_stores_is_the_addition_after() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        for (m, n, k) in [(9, 33, 7), (203, 130, 300), (64, 70, 513)] {
            let x = Tensor::randn(0f32, 1., (m, k), &dev)?;
            let w = Tensor::randn(0f32, 1., (n, k), &dev)?;
            let b = Tensor::randn(0f32, 1., n, &dev)?;
            for isa in CpuFeatures::get().isas() {
                let want = matmul_with(isa, &x, &w)?.broadcast_add(&b)?;
                let got = matmul_bias_with(isa, &x, &w, Some(&b))?;
                assert_eq!(bits(&got)?, bits(&want)?, "{isa:?} ({m}, {n}, {k})");
                let b16 = b.to_dtype(DType::BF16)?;
                let want = matmul_with(isa, &x, &w)?.broadcast_add(&b16.to_dtype(DType::F32)?)?;
                let got = matmul_bias_with(isa, &x, &w, Some(&b16))?;
                assert_eq!(bits(&got)?, bits(&want)?, "{isa:?} bf16 bias");
            }
        }
        Ok(())
    }

    /// The feed-forward in chunks is its three steps apart (the product
    /// plus bias, the GELU, the product plus bias), bit for bit, on every
    /// instruction set: chunks with a last partial one and a half last
    /// panel, weights of partial tiles and tasks, with and without biases,
    /// both GELUs; and its own chunk size.
    #[test]
    fn ffn_in_chunks_is_its_steps_apart() -> candle_core::Result<()> {
        use crate::kernels::gelu::gelu_one;
        use crate::kernels::micro::Portable;
        let dev = Device::Cpu;
        for (m, k, h, n, chunk) in [
            (1, 7, 9, 5, Some(32)),
            (70, 33, 130, 70, Some(32)),
            (203, 64, 256, 72, Some(64)),
            (100, 16, 72, 8, Some(96)),
            (75, 24, 40, 24, None),
        ] {
            let x = Tensor::randn(0f32, 1., (m, k), &dev)?;
            let up = Tensor::randn(0f32, 0.3, (h, k), &dev)?;
            let down = Tensor::randn(0f32, 0.3, (n, h), &dev)?;
            let ub = Tensor::randn(0f32, 1., h, &dev)?;
            let db = Tensor::randn(0f32, 1., n, &dev)?;
            for isa in CpuFeatures::get().isas() {
                // The GELU's FMAs as `per_isa` compiles it for `isa`.
                let fma = matches!(
                    isa.simd(),
                    super::super::features::Simd::Avx512 | super::super::features::Simd::Avx2
                );
                for (biases, exact) in [(true, true), (false, true), (true, false)] {
                    let (ub, db) = if biases {
                        (Some(&ub), Some(&db))
                    } else {
                        (None, None)
                    };
                    let hidden = matmul_bias_with(isa, &x, &up, ub)?;
                    let hidden: Vec<f32> = hidden
                        .flatten_all()?
                        .to_vec1::<f32>()?
                        .into_iter()
                        .map(|v| {
                            if fma {
                                gelu_one::<Portable<true>>(exact, v)
                            } else {
                                gelu_one::<Portable<false>>(exact, v)
                            }
                        })
                        .collect();
                    let hidden = Tensor::from_vec(hidden, (m, h), &dev)?;
                    let want = matmul_bias_with(isa, &hidden, &down, db)?;
                    let got = ffn_in_chunks(isa, &x, (&up, ub), (&down, db), exact, chunk)?;
                    assert_eq!(got.dims(), &[m, n]);
                    assert_eq!(
                        bits(&got)?,
                        bits(&want)?,
                        "{isa:?} ({m}, {k}) through {h} to {n}, chunks {chunk:?}, biases {biases}, exact {exact}"
                    );
                }
            }
        }
        Ok(())
    }

    /// Chunks of the feed-forward hold their rows' packed `x` and hidden
    /// layer in half the L2, in whole panels, or are one a thread where
    /// that is at most twice as many rows.
    #[test]
    fn ffn_chunks_follow_the_l2() {
        assert_eq!(ffn_chunk_rows(197, 64, 2), 99);
        assert_eq!(ffn_chunk_rows(600, 64, 2), 64);
        assert_eq!(ffn_chunk_rows(16, 64, 2), 8);
        assert_eq!(ffn_chunk_rows(36864, 352, 2), 352);
        assert_eq!(ffn_chunk_rows(5, 64, 0), 5);
        // Florence-2's DaViT, 2 MB L2: stage 1 (128 → 512), stage 3 (512
        // → 2048), stage 4 (1024 → 4096).
        assert_eq!(ffn_rows(Some(2 << 20), 128, 512), 352);
        assert_eq!(ffn_rows(Some(2 << 20), 512, 2048), 96);
        assert_eq!(ffn_rows(Some(2 << 20), 1024, 4096), NR);
        assert_eq!(ffn_rows(Some(2 << 20), 1, 1), MAX_GROUP * NR);
    }

    /// A feed-forward whose operands do not chain, or whose biases do not
    /// fit, is an error naming them.
    #[test]
    fn ffn_refuses_what_does_not_chain() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let isa = CpuFeatures::get().isa();
        let x = Tensor::zeros((9, 8), DType::F32, &dev)?;
        let up = Tensor::zeros((16, 8), DType::F32, &dev)?;
        let down = Tensor::zeros((8, 16), DType::F32, &dev)?;
        for (up, down, what) in [
            (
                &Tensor::zeros((16, 7), DType::F32, &dev)?,
                &down,
                "up [16, 7]",
            ),
            (
                &up,
                &Tensor::zeros((8, 15), DType::F32, &dev)?,
                "down [8, 15]",
            ),
            (
                &up,
                &Tensor::zeros((8, 16), DType::BF16, &dev)?,
                "down [8, 16] BF16",
            ),
        ] {
            let err = ffn(isa, &x, (up, None), (down, None), true)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("vl-gemm-f32 ffn") && err.contains(what),
                "{err}"
            );
        }
        let b = Tensor::zeros(15, DType::F32, &dev)?;
        let err = ffn(isa, &x, (&up, Some(&b)), (&down, None), true)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("up bias of 16 values") && err.contains("[15]"),
            "{err}"
        );
        let err = ffn(isa, &x, (&up, None), (&down, Some(&b)), true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("down bias of 8 values"), "{err}");
        Ok(())
    }

    /// What the kernels do not take is an error naming the operands.
    #[test]
    fn refuses_what_it_does_not_take() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::zeros((9, 8), DType::F32, &dev)?;
        for w in [
            Tensor::zeros((4, 7), DType::F32, &dev)?,
            Tensor::zeros((4, 8), DType::BF16, &dev)?,
            Tensor::zeros((8, 4), DType::F32, &dev)?.t()?,
            Tensor::zeros((0, 8), DType::F32, &dev)?,
        ] {
            let err = matmul(&x, &w).unwrap_err().to_string();
            assert!(err.contains("vl-gemm-f32") && err.contains("w ["), "{err}");
        }
        let w = Tensor::zeros((4, 8), DType::F32, &dev)?;
        for b in [
            Tensor::zeros(5, DType::F32, &dev)?,
            Tensor::zeros((1, 4), DType::F32, &dev)?,
        ] {
            let err = matmul_bias_with(Isa::portable(), &x, &w, Some(&b))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("vl-gemm-f32") && err.contains("bias") && err.contains("4 outputs"),
                "{err}"
            );
        }
        Ok(())
    }
}
