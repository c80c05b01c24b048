//! An f32 weight packed once, at load, for the products of many rows
//! (an encoder's): [`PackedF32`].
//!
//! Why a second form of [`super::matmul`]: that product reads the weight
//! where it lies, eight rows broadcast a step from eight streams of it,
//! and packs `x` per call; in a model, where every weight comes from
//! memory (a ViT-B's 344 MB pass the L3), its four products ran at
//! 210–250 GFLOP/s on a Xeon without AMX, while ONNX Runtime's MLAS —
//! whose weights are packed at load — ran the same four at about 300 in
//! its encode (`scripts/ort_profile.py`, BENCHMARKS.md). Packed, the
//! weight is one stream per task, read in order.
//!
//! # Layout
//! The weight `(n, k)` as panels of `NR` = 32 columns, `k × 32` floats
//! each (step `p` of panel `j`: `w[32j + c][p]` for `c < 32`, zero past
//! `n`), on cache lines. `x` is read where it lies, a value broadcast per
//! row and step. The register tile is `MR` = 12 rows × 32 columns (24
//! accumulators, two vector loads of the panel and 12 broadcasts a step).
//! A task is a block of up to `TASK_ROWS` rows × a group of panels
//! (about `TASK_PANEL_BYTES`); each panel meets every row tile of the
//! task over the whole of `k` (up to `KC`; wider, in blocks whose sums
//! continue in `y`), the panel in L2 after its first tile. The row tiles
//! after the first ask for the next panel's lines into L2, a share each,
//! so that the weight's read from memory overlaps the arithmetic (a
//! ViT-B/16 f32 encode on the Xeon model 207, interleaved: 140–145 →
//! 133–135 ms); a first tile asks for its own panel `AHEAD` bytes on.
//!
//! # Numerics
//! Each output is one chain of multiply-adds over `k` in order (fused
//! where the instruction set has FMA), from zero, then plus its bias: the sums of [`super::matmul_bias_with`]
//! on the same instruction set, bit for bit (tested), so packing a layer
//! changes no result. With the GELU epilogue, the values of the product
//! then vl's GELU pass.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::kernels::aligned::CacheAligned;
use crate::kernels::features::{CpuFeatures, F32Gemm, Isa, Simd};
use crate::kernels::gemm_bf16::SyncPtr;
use crate::kernels::host::contiguous;
use crate::kernels::micro::{madd, per_isa, Kernel, NR};

/// Steps of `k` per block: every encoder's whole width (a ViT-B's 768
/// and 3,072, DaViT's up to 4,096), so that a tile's sums stay in
/// registers over all of `k`; a wider `k` runs in blocks, the sums
/// continued from `y` (the same bits). A ViT-B/16 f32 encode on the Xeon
/// model 207 (`vl bench --quick`, interleaved, ms): blocks of 256
/// 160–171, 512 151–172, 768 146–150, 1,024 141–152, the whole of `k`
/// 135–148.
const KC: usize = 4096;
/// Rows of the register tile.
const MR: usize = 12;
/// The most rows of a task: a ViT's 197 in one, so that each panel group
/// is read from memory by one task.
const TASK_ROWS: usize = 240;
/// Bytes of panels per task, about: a share of the core's L2 that the
/// task's row tiles meet in turn.
const TASK_PANEL_BYTES: usize = 256 * 1024;
/// How far ahead of the step being multiplied the first row tile of a
/// block asks for its panel. Measured on a Xeon model 207 without AMX
/// (`bench_gemm --only "packed" --cold`, three interleaved rounds): the
/// four ViT-B products, weights read cold, 3.2–4.5 → 3.2–3.3 ms on the
/// down projection, 3.4–3.6 → 3.1 on the up one.
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 4096;

/// Whether [`crate::Proj`] should hold dense f32 weights of an encoder
/// packed: this CPU's tuning takes vl's f32 product ([`F32Gemm::Vl`]) and
/// runs AVX-512F.
pub fn accelerated() -> bool {
    let cpu = CpuFeatures::get();
    cpu.tuning.f32_gemm == F32Gemm::Vl && cpu.isa().simd() == Simd::Avx512
}

/// An f32 weight `W (n, k)` (and its bias) packed once into the panels
/// [`PackedF32::matmul`] reads. Any number of rows runs, on every
/// instruction set (the portable implementation is the oracle); it is
/// made for many (a decode step's few rows are [`crate::kernels::gemv`]'s,
/// which reads the weight as it lies).
#[derive(Debug)]
pub struct PackedF32 {
    panels: CacheAligned<f32>,
    /// Added to each output before it is stored.
    bias: Option<Vec<f32>>,
    n: usize,
    k: usize,
}

impl PackedF32 {
    /// Packs `w (n, k)`, f32 on the CPU, with an optional bias `(n)` (any
    /// float dtype, kept in f32).
    ///
    /// # Errors
    /// A weight of another dtype, rank or device, `n` or `k` 0, or a bias
    /// of another length, named.
    pub fn pack(w: &Tensor, bias: Option<&Tensor>) -> candle_core::Result<Self> {
        let (n, k) = w.dims2()?;
        if w.dtype() != DType::F32 || !w.device().is_cpu() || k == 0 || n == 0 {
            candle_core::bail!(
                "vl-gemm-f32-packed: packs an f32 CPU weight (n, k), n and k > 0; got {:?} {:?} on {:?}",
                w.dims(),
                w.dtype(),
                w.device()
            );
        }
        let bias = match bias {
            Some(b) if b.dims() != [n] => candle_core::bail!(
                "vl-gemm-f32-packed: bias {:?} for a weight ({n}, {k})",
                b.dims()
            ),
            Some(b) => Some(b.to_dtype(DType::F32)?.to_vec1::<f32>()?),
            None => None,
        };
        let panels = crate::kernels::with_values(w, |values: &[f32]| pack(values, n, k))?;
        Ok(Self { panels, bias, n, k })
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

    /// The weight as an f32 tensor `(n, k)` again (bit for bit).
    ///
    /// # Errors
    /// Only candle's, building the tensor.
    pub fn unpack(&self) -> candle_core::Result<Tensor> {
        let (n, k) = (self.n, self.k);
        let mut w = vec![0f32; n * k];
        for (o, row) in w.chunks_exact_mut(k).enumerate() {
            let panel = &self.panels[(o / NR) * k * NR..][..k * NR];
            for (p, v) in row.iter_mut().enumerate() {
                *v = panel[p * NR + o % NR];
            }
        }
        Tensor::from_vec(w, (n, k), &candle_core::Device::Cpu)
    }

    /// `x W^T + b`.
    ///
    /// # Shapes
    /// `x: (..., k)` f32 on the CPU (made contiguous) → `(..., n)` f32.
    ///
    /// # Errors
    /// Another dtype, device or width of `x`, named.
    pub fn matmul(self: &Arc<Self>, x: &Tensor) -> candle_core::Result<Tensor> {
        self.matmul_with(CpuFeatures::get().isa(), x, None)
    }

    /// `GELU(x W^T + b)` (exact with `exact`, else the tanh form), the
    /// GELU applied as the last block of `k` stores: the values of
    /// [`PackedF32::matmul`] then vl's GELU, bit for bit.
    ///
    /// # Errors
    /// As [`PackedF32::matmul`].
    pub fn matmul_gelu(self: &Arc<Self>, x: &Tensor, exact: bool) -> candle_core::Result<Tensor> {
        self.matmul_with(CpuFeatures::get().isa(), x, Some(exact))
    }

    /// [`PackedF32::matmul`] (with the GELU epilogue when `gelu` is
    /// `Some(exact)`) on a given implementation: the token proves the CPU
    /// runs it; tests compare them.
    ///
    /// # Errors
    /// As [`PackedF32::matmul`].
    pub fn matmul_with(
        self: &Arc<Self>,
        isa: Isa,
        x: &Tensor,
        gelu: Option<bool>,
    ) -> candle_core::Result<Tensor> {
        if !x.device().is_cpu() {
            candle_core::bail!(
                "vl-gemm-f32-packed: x must be on the CPU, got {:?}",
                x.device()
            );
        }
        x.contiguous()?.apply_op1_no_bwd(&PackedOp {
            w: self.clone(),
            isa,
            gelu,
        })
    }
}

/// `w (n, k)` row-major as panels of [`NR`] columns (see the module's
/// layout), on cache lines: per panel, blocks of 8 steps of its 32 rows
/// (each row's 8 values a line read, the block's 8 steps 8 lines
/// written). A panel's rows one at a time, each write a line apart, had
/// added about 0.18 s to a ViT-B checkpoint's load on two threads (`vl
/// bench`'s `load_ms`, Xeon model 207); this, about 0.07 s.
fn pack(values: &[f32], n: usize, k: usize) -> CacheAligned<f32> {
    const STEPS: usize = 8;
    let mut panels = CacheAligned::<f32>::new(n.div_ceil(NR) * k * NR);
    panels
        .par_chunks_mut(k * NR)
        .enumerate()
        .for_each(|(j, panel)| {
            let here = NR.min(n - j * NR);
            let rows = &values[j * NR * k..(j * NR + here) * k];
            for p0 in (0..k).step_by(STEPS) {
                let steps = STEPS.min(k - p0);
                for (c, row) in rows.chunks_exact(k).enumerate() {
                    for (s, &v) in row[p0..p0 + steps].iter().enumerate() {
                        panel[(p0 + s) * NR + c] = v;
                    }
                }
            }
        });
    panels
}

struct PackedOp {
    w: Arc<PackedF32>,
    isa: Isa,
    gelu: Option<bool>,
}

impl candle_core::CustomOp1 for PackedOp {
    fn name(&self) -> &'static str {
        "vl-gemm-f32-packed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let w = &*self.w;
        let dims = l.shape().dims();
        if dims.last() != Some(&w.k) {
            candle_core::bail!(
                "vl-gemm-f32-packed: x {dims:?} for a weight ({}, {})",
                w.n,
                w.k
            );
        }
        let CpuStorage::F32(x) = s else {
            candle_core::bail!("vl-gemm-f32-packed: x must be f32, got {:?}", s.dtype());
        };
        let x = contiguous(x, l, "vl-gemm-f32-packed", "x")?;
        let m = x.len() / w.k;
        let y = product(self.isa, x, w, m, self.gelu);
        let mut shape = dims[..dims.len() - 1].to_vec();
        shape.push(w.n);
        Ok((CpuStorage::F32(y), Shape::from(shape)))
    }
}

/// `y (m, n)` = `x (m, k)` times the packed weight transposed, plus its
/// bias, through the GELU if asked: tasks of row blocks × panel groups
/// over the rayon pool, group-major (a thread's neighbouring tasks share
/// a group, which it reads from memory once).
fn product(isa: Isa, x: &[f32], w: &PackedF32, m: usize, gelu: Option<bool>) -> Vec<f32> {
    let (n, k) = (w.n, w.k);
    let panels = n.div_ceil(NR);
    let group = (TASK_PANEL_BYTES / (k * NR * 4)).clamp(1, panels);
    let groups = panels.div_ceil(group);
    let blocks = m.div_ceil(TASK_ROWS);
    // Blocks of nearly equal size, whole tiles but the last.
    let per_block = m.div_ceil(blocks.max(1)).next_multiple_of(MR);
    // Not zeroed first: every task writes each element of its rows and
    // columns at the first block of `k`.
    let mut y: Vec<f32> = Vec::with_capacity(m * n);
    let out = SyncPtr(y.as_mut_ptr());
    (0..blocks * groups).into_par_iter().for_each(|t| {
        let (g, b) = (t / blocks, t % blocks);
        let rows = (b * per_block).min(m)..((b + 1) * per_block).min(m);
        let panel_range = g * group..((g + 1) * group).min(panels);
        task(isa, x, w, out, rows, panel_range, gelu);
    });
    // SAFETY: the blocks cover rows `0..m` (`blocks * per_block >= m`) and
    // the groups every panel, and each task writes every element of its
    // rows and of its panels' columns below `n`: all `m * n` elements are
    // initialised.
    unsafe { y.set_len(m * n) };
    y
}

per_isa! {
    /// One task of [`product`]: rows `rows` × the columns of panels
    /// `panels` of `y (m, n)`.
    fn task(
        x: &[f32],
        w: &PackedF32,
        y: SyncPtr<f32>,
        rows: std::ops::Range<usize>,
        panels: std::ops::Range<usize>,
        gelu: Option<bool>,
    ) = task_on::<crate::kernels::micro::Avx512>
}

/// [`task`] for the instruction set of `K`: blocks of [`KC`] of `k`, then
/// panels, then row tiles.
#[inline(always)]
fn task_on<K: Kernel>(
    x: &[f32],
    w: &PackedF32,
    y: SyncPtr<f32>,
    rows: std::ops::Range<usize>,
    panels: std::ops::Range<usize>,
    gelu: Option<bool>,
) {
    let (n, k) = (w.n, w.k);
    assert!(x.len() >= rows.end * k && w.panels.len() >= panels.end * k * NR);
    for k0 in (0..k).step_by(KC) {
        let kc = KC.min(k - k0);
        let last = k0 + kc == k;
        for j in panels.clone() {
            let cols = NR.min(n - j * NR);
            let block = &w.panels[j * k * NR + k0 * NR..][..kc * NR];
            let epilogue = last.then(|| Epilogue {
                bias: w.bias.as_deref().map(|b| &b[j * NR..j * NR + cols]),
                gelu,
            });
            // The next panel's block (the task's next, or the next task's
            // first: group-major, most likely this thread's), asked into
            // L2 a share per row tile after the first, so that its first
            // tile does not wait on memory.
            let tiles = rows.len().div_ceil(MR);
            let next_lines = if (j + 1) * NR < n && tiles > 1 {
                kc * NR * 4 / 64
            } else {
                0
            };
            let share = next_lines.div_ceil(tiles.saturating_sub(1).max(1));
            let next_base = w
                .panels
                .as_ptr()
                .wrapping_add((j + 1) * k * NR + k0 * NR)
                .cast::<u8>();
            for (t, r) in rows.clone().step_by(MR).enumerate() {
                let from = (t.saturating_sub(1) * share).min(next_lines);
                let tile = Tile {
                    rows: MR.min(rows.end - r),
                    cols,
                    fresh: k0 == 0,
                    ahead: t == 0,
                    next: if t == 0 {
                        (std::ptr::null(), 0)
                    } else {
                        (
                            next_base.wrapping_add(from * 64),
                            share.min(next_lines - from),
                        )
                    },
                };
                // SAFETY: rows `r .. r + tile.rows` of `x` hold `k0 + kc
                // <= k` values each (asserted); the panel's block holds
                // `kc` steps; rows `r ..` and columns `j * NR .. j * NR +
                // cols` of `y` are this task's alone (`product`'s
                // partition), valid while the parallel loop runs.
                unsafe {
                    micro::<K>(
                        x.as_ptr().add(r * k + k0),
                        k,
                        block,
                        kc,
                        y.at(r * n + j * NR),
                        n,
                        tile,
                        epilogue,
                    )
                };
            }
        }
    }
}

/// What a row tile of [`micro`] covers.
#[derive(Clone, Copy)]
struct Tile {
    /// Rows, `1 ..= MR`.
    rows: usize,
    /// Valid columns of the panel, `1 ..= NR`.
    cols: usize,
    /// The first block of `k`: the sums start from zero (else from `y`).
    fresh: bool,
    /// Ask for the panel [`AHEAD`] bytes on (where the kernel prefetches).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    ahead: bool,
    /// Lines of the next panel's block to ask into L2 while this tile
    /// runs, from the address given, spread over its steps (where the
    /// kernel prefetches; addresses are never read, so they may lie past
    /// the panels).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    next: (*const u8, usize),
}

/// What the last block of `k` does before it stores: the bias (the
/// panel's `cols` values), then the GELU (exact when `Some(true)`).
#[derive(Clone, Copy)]
struct Epilogue<'a> {
    bias: Option<&'a [f32]>,
    gelu: Option<bool>,
}

/// `tile.rows` rows of `x` (at `x`, `lda` apart) times a panel's block of
/// `kc` steps (`b`) into the tile of `y` at `y` (`ldc` apart), the sums
/// continued from `y` unless `tile.fresh`; with an epilogue, the finished
/// values through it.
///
/// # Safety
/// `tile.rows` rows of `kc` values readable at `x`, `lda` apart; `kc *
/// NR` values in `b`; `tile.rows` rows of `tile.cols` values readable and
/// writable at `y`, `ldc` apart, and nobody else's meanwhile; the
/// instruction set of `K` runs.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn micro<K: Kernel>(
    x: *const f32,
    lda: usize,
    b: &[f32],
    kc: usize,
    y: *mut f32,
    ldc: usize,
    tile: Tile,
    epilogue: Option<Epilogue<'_>>,
) {
    #[cfg(target_arch = "x86_64")]
    if K::AVX512 {
        // SAFETY: the contract; `K::AVX512` is set by the AVX-512F kernel
        // alone, which `per_isa` runs only where the CPU has it.
        unsafe {
            match tile.rows {
                12 => avx512::<12>(x, lda, b, kc, y, ldc, tile, epilogue),
                11 => avx512::<11>(x, lda, b, kc, y, ldc, tile, epilogue),
                10 => avx512::<10>(x, lda, b, kc, y, ldc, tile, epilogue),
                9 => avx512::<9>(x, lda, b, kc, y, ldc, tile, epilogue),
                8 => avx512::<8>(x, lda, b, kc, y, ldc, tile, epilogue),
                7 => avx512::<7>(x, lda, b, kc, y, ldc, tile, epilogue),
                6 => avx512::<6>(x, lda, b, kc, y, ldc, tile, epilogue),
                5 => avx512::<5>(x, lda, b, kc, y, ldc, tile, epilogue),
                4 => avx512::<4>(x, lda, b, kc, y, ldc, tile, epilogue),
                3 => avx512::<3>(x, lda, b, kc, y, ldc, tile, epilogue),
                2 => avx512::<2>(x, lda, b, kc, y, ldc, tile, epilogue),
                _ => avx512::<1>(x, lda, b, kc, y, ldc, tile, epilogue),
            }
        }
        return;
    }
    let mut acc = [[0f32; NR]; MR];
    for (i, row) in acc.iter_mut().enumerate().take(tile.rows) {
        if !tile.fresh {
            // SAFETY: the contract.
            let done = unsafe { std::slice::from_raw_parts(y.add(i * ldc), tile.cols) };
            row[..tile.cols].copy_from_slice(done);
        }
    }
    for (p, brow) in b.chunks_exact(NR).take(kc).enumerate() {
        for (i, row) in acc.iter_mut().enumerate().take(tile.rows) {
            // SAFETY: the contract.
            let v = unsafe { *x.add(i * lda + p) };
            for (a, &w) in row.iter_mut().zip(brow) {
                *a = madd(K::FMA, v, w, *a);
            }
        }
    }
    for (i, row) in acc.iter_mut().enumerate().take(tile.rows) {
        let row = &mut row[..tile.cols];
        if let Some(e) = epilogue {
            finish::<K>(row, e);
        }
        // SAFETY: the contract.
        let out = unsafe { std::slice::from_raw_parts_mut(y.add(i * ldc), tile.cols) };
        out.copy_from_slice(row);
    }
}

/// A finished row of a tile through the epilogue, in place: plus the
/// bias (no addition without one: `-0.0 + 0.0` would be `+0.0`, as
/// [`super::matmul_bias_with`] stores), then the GELU.
#[inline(always)]
fn finish<K: Kernel>(row: &mut [f32], e: Epilogue<'_>) {
    if let Some(b) = e.bias {
        for (v, &b) in row.iter_mut().zip(b) {
            *v += b;
        }
    }
    if let Some(exact) = e.gelu {
        for v in row.iter_mut() {
            *v = crate::kernels::gelu::gelu_one::<K>(exact, *v);
        }
    }
}

/// [`micro`] on AVX-512F for `M` rows: 2 × `M` accumulators.
///
/// # Safety
/// As [`micro`]'s, and the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn avx512<const M: usize>(
    x: *const f32,
    lda: usize,
    b: &[f32],
    kc: usize,
    y: *mut f32,
    ldc: usize,
    tile: Tile,
    epilogue: Option<Epilogue<'_>>,
) {
    use std::arch::x86_64::*;
    debug_assert!(b.len() >= kc * NR && M == tile.rows);
    // Columns past `cols` are neither read nor written.
    let mask = |from: usize| -> __mmask16 {
        let live = tile.cols.saturating_sub(from).min(16);
        ((1u32 << live) - 1) as __mmask16
    };
    let masks = [mask(0), mask(16)];
    // SAFETY: the contract: every load of `b` is within its `kc * NR`
    // values, and aligned (the panels start on a cache line, a step's 32
    // floats are two lines); every access to `x` within row `i < M`'s `kc`
    // values, every access to `y` within the tile's rows and masked to
    // its columns; prefetches read nothing architecturally.
    unsafe {
        let mut acc: [[__m512; 2]; M] = std::array::from_fn(|i| {
            std::array::from_fn(|v| {
                if tile.fresh {
                    _mm512_setzero_ps()
                } else {
                    _mm512_maskz_loadu_ps(masks[v], y.add(i * ldc + 16 * v))
                }
            })
        });
        let bp = b.as_ptr();
        let (next, next_lines) = tile.next;
        let every = kc.checked_div(next_lines).map_or(usize::MAX, |e| e.max(1));
        let (mut countdown, mut line) = (every, 0);
        for p in 0..kc {
            let step = bp.add(p * NR);
            countdown -= 1;
            if countdown == 0 {
                countdown = every;
                if line < next_lines {
                    _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(line * 64).cast::<i8>());
                    line += 1;
                }
            }
            if tile.ahead {
                let at = step.cast::<i8>().wrapping_add(AHEAD);
                _mm_prefetch::<_MM_HINT_T0>(at);
                _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(64));
            }
            let (b0, b1) = (_mm512_load_ps(step), _mm512_load_ps(step.add(16)));
            for (i, a) in acc.iter_mut().enumerate() {
                let v = _mm512_set1_ps(*x.add(i * lda + p));
                a[0] = _mm512_fmadd_ps(v, b0, a[0]);
                a[1] = _mm512_fmadd_ps(v, b1, a[1]);
            }
        }
        for (i, a) in acc.iter().enumerate() {
            let out = y.add(i * ldc);
            match epilogue {
                None => {
                    _mm512_mask_storeu_ps(out, masks[0], a[0]);
                    _mm512_mask_storeu_ps(out.add(16), masks[1], a[1]);
                }
                Some(e) => {
                    let mut row = [0f32; NR];
                    _mm512_storeu_ps(row.as_mut_ptr(), a[0]);
                    _mm512_storeu_ps(row.as_mut_ptr().add(16), a[1]);
                    let row = &mut row[..tile.cols];
                    finish::<crate::kernels::micro::Avx512>(row, e);
                    std::ptr::copy_nonoverlapping(row.as_ptr(), out, tile.cols);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn isas() -> Vec<Isa> {
        CpuFeatures::get().isas()
    }

    /// Every shape class: partial panels, partial row tiles, one block of
    /// `k` and two (the second partial), one and several row blocks and
    /// panel groups.
    const SHAPES: [(usize, usize, usize); 8] = [
        (1, 1, 1),
        (13, 40, KC + 5),
        (5, 33, 7),
        (13, 64, 256),
        (25, 100, 300),
        (197, 96, 768),
        (250, 40, 520),
        (481, 70, 64),
    ];

    #[test]
    fn the_bits_of_the_product_where_it_lies() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        for (m, n, k) in SHAPES {
            let x = Tensor::randn(0f32, 1., (m, k), &dev)?;
            let w = Tensor::randn(0f32, 1., (n, k), &dev)?;
            let b = Tensor::randn(0f32, 1., n, &dev)?;
            for bias in [None, Some(&b)] {
                let packed = Arc::new(PackedF32::pack(&w, bias)?);
                for isa in isas() {
                    let want = super::super::matmul_bias_with(isa, &x, &w, bias)?;
                    let got = packed.matmul_with(isa, &x, None)?;
                    let (want, got) = (
                        want.flatten_all()?.to_vec1::<f32>()?,
                        got.flatten_all()?.to_vec1::<f32>()?,
                    );
                    let same = want
                        .iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{m}x{n}x{k} bias {} on {isa:?}: packed differs from the product",
                        bias.is_some()
                    );
                }
            }
        }
        Ok(())
    }

    #[test]
    fn close_to_the_f64_product() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let (m, n, k) = (37, 70, 300);
        let x = Tensor::randn(0f32, 1., (m, k), &dev)?;
        let w = Tensor::randn(0f32, 1., (n, k), &dev)?;
        let packed = Arc::new(PackedF32::pack(&w, None)?);
        let want = x
            .to_dtype(DType::F64)?
            .matmul(&w.to_dtype(DType::F64)?.t()?)?
            .flatten_all()?
            .to_vec1::<f64>()?;
        for isa in isas() {
            let got = packed
                .matmul_with(isa, &x, None)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            for (a, b) in want.iter().zip(&got) {
                assert!(
                    (a - *b as f64).abs() <= 1e-4 * (1.0 + a.abs()),
                    "{isa:?}: {a} against {b}"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn the_gelu_epilogue_is_the_gelu_after() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        for (m, n, k) in SHAPES {
            let x = Tensor::randn(0f32, 1., (m, k), &dev)?;
            let w = Tensor::randn(0f32, 0.1, (n, k), &dev)?;
            let b = Tensor::randn(0f32, 1., n, &dev)?;
            let packed = Arc::new(PackedF32::pack(&w, Some(&b))?);
            for isa in isas() {
                for exact in [true, false] {
                    let plain = packed.matmul_with(isa, &x, None)?;
                    let want = crate::kernels::gelu::forward_with(isa, &plain, exact)?
                        .flatten_all()?
                        .to_vec1::<f32>()?;
                    let got = packed
                        .matmul_with(isa, &x, Some(exact))?
                        .flatten_all()?
                        .to_vec1::<f32>()?;
                    let same = want
                        .iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{m}x{n}x{k} exact {exact} on {isa:?}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn unpacks_bit_for_bit_and_names_what_it_refuses() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1., (45, 19), &dev)?;
        let packed = Arc::new(PackedF32::pack(&w, None)?);
        let back = packed.unpack()?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(back, w.flatten_all()?.to_vec1::<f32>()?);
        assert_eq!(packed.dims(), (45, 19));
        let err = PackedF32::pack(&w.to_dtype(DType::BF16)?, None).unwrap_err();
        assert!(err.to_string().contains("BF16"), "{err}");
        let err = PackedF32::pack(&w, Some(&Tensor::zeros(3, DType::F32, &dev)?)).unwrap_err();
        assert!(err.to_string().contains("bias [3]"), "{err}");
        let x = Tensor::zeros((2, 20), DType::F32, &dev)?;
        let err = packed.matmul(&x).unwrap_err();
        assert!(err.to_string().contains("x [2, 20]"), "{err}");
        let x = Tensor::zeros((2, 19), DType::BF16, &dev)?;
        let err = packed.matmul(&x).unwrap_err();
        assert!(err.to_string().contains("must be f32"), "{err}");
        Ok(())
    }
}
