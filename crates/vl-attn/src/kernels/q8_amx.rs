//! q8_0 products of an encoder's many rows on AMX-BF16
//! ([`Q8Simd::Amx`]).
//!
//! AMX's integer products (`tdpbusd`) sum a whole `k` on the tile unit,
//! but a q8_0 weight has a scale per 32 values of a row: each block's
//! 16 × 16 sums would have to be stored and scaled by the vector unit
//! before the next, and that scaling alone cost as much as the VNNI
//! kernel's whole product (BENCHMARKS.md, "AMX-INT8 for the q8_0
//! products: tried, not kept"). Here each task widens its tiles of the
//! weight to bf16 instead, into a buffer that stays in its core's L2 —
//! `d · q` is exact in f32 and rounded once, a relative change under 2⁻⁹,
//! far inside the format's own step of `d` — and multiplies them by `x`
//! rounded to bf16 (8 significant bits for every value, where q8_0's
//! rounding of `x` has steps of 1/127 of its block's largest) on
//! `tdpbf16ps`, the sums in f32; the bias and the GELU are added as the
//! q8_0 kernels add them.
//!
//! So the values are those of `Σ bf16(x) · bf16(d · q)` summed in f32,
//! not the VNNI kernels' bits. The route follows each sample's rows (an
//! image's tokens, not the batch's), and each output
//! depends on its own row and column alone, so a batch computes as each of
//! its samples alone, bit for bit; samples of fewer than [`MIN_ROWS`] rows
//! (a decode step, whose one read of each weight bounds it; a 17-token
//! image of the shapes captioner) keep VNNI.

#[cfg(target_arch = "x86_64")]
use rayon::prelude::*;

use super::features::{Q8Isa, Q8Simd};
use super::gemv_q8::{Out, Tiled};
#[cfg(target_arch = "x86_64")]
use super::gemv_q8::{BLOCK_VALUES, TILE_ROWS};

/// Rows from which a product of [`Q8Simd::Amx`] runs on the tile unit:
/// its blocks of 32 rows are then mostly whole, and the widening of each
/// weight value (about a sixth of a cycle) is shared by enough rows.
pub const MIN_ROWS: usize = 64;

/// `u32` (bf16 pairs) of a widened tile per q8_0 block: 16 pairs of `k`
/// × 16 columns, one AMX B tile (1 KiB).
#[cfg(target_arch = "x86_64")]
const BLOCK_PAIRS: usize = (BLOCK_VALUES / 2) * TILE_ROWS;

/// Bytes of widened tiles a task keeps in its core's L2 while its rows of
/// `x` pass by (as the bf16 GEMM's panel groups).
#[cfg(target_arch = "x86_64")]
const TASK_BYTES: usize = 256 * 1024;

/// Rows per task at least, where a product has so many that it splits
/// them (a DaViT's 36,864): each task widens its tiles again.
#[cfg(target_arch = "x86_64")]
const CHUNK_ROWS: usize = 256;

/// What a product does to each sum after its bias: the GELU (exact when
/// `Some(true)`), then the addition of a residual `(rows, n)` in the
/// output's row-major order (for [`gemv_q8::OutPtr`](super::gemv_q8)
/// outputs only), each if given.
pub(crate) type Epilogue<'a> = (Option<bool>, Option<&'a [f32]>);

/// Whether a product of `x` (of dims `x_dims`, `(..., k)`) by `p` on
/// `isa` runs here: the token is [`Q8Simd::Amx`], `p`'s tiles are q8_0
/// blocks ([`Tiled::q8_tile`]), and each sample has an encoder's rows —
/// [`MIN_ROWS`] or more of [`sample_rows`], so that a batch's products
/// take the route each of its samples takes alone (a batch of four
/// 17-token images computes as each image alone, and a decode step of 16
/// requests as each request's step).
pub(crate) fn takes<P: Tiled>(p: &P, isa: Q8Isa, x_dims: &[usize]) -> bool {
    isa.simd() == Q8Simd::Amx
        && sample_rows(x_dims) >= MIN_ROWS
        && p.dims().0 > 0
        && p.q8_tile(0).is_some()
}

/// The rows of one sample of `x (..., k)`: its dims between the first
/// and the last (`(batch, tokens, k)`: the tokens; `(batch, h, w, c)`:
/// `h · w`), or all its rows where it has two dims or fewer.
pub(crate) fn sample_rows(x_dims: &[usize]) -> usize {
    match x_dims {
        [] | [_] => 1,
        [rows, _] => *rows,
        [_, inner @ .., _] => inner.iter().product(),
    }
}

/// `x (rows, k)` by `p`, plus the bias, through the GELU if asked, into
/// `out`, tile columns × chunks of rows split across the pool.
///
/// # Safety
/// [`takes`] said yes for `p`, `isa` and `x`; `x` holds `rows` rows of
/// `p`'s `k`; `out`'s places for every row's every tile are disjoint and
/// writable.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn product_into<P: Tiled, O: Out>(
    p: &P,
    isa: Q8Isa,
    x: &[f32],
    rows: usize,
    (gelu, residual): Epilogue<'_>,
    out: &O,
) {
    use super::aligned::CacheAligned;
    use super::features::{Bf16Simd, CpuFeatures};
    let (n, k) = p.dims();
    if let Some(r) = residual {
        assert_eq!(r.len(), rows * n, "q8_amx: a residual of another shape");
    }
    let bf16_isa = CpuFeatures::get()
        .bf16_isa_for(Bf16Simd::Avx512Bf16)
        .expect("q8_0's Amx token implies AVX512_BF16");
    let tiles = n.div_ceil(TILE_ROWS);
    let tile_len = (k / BLOCK_VALUES) * BLOCK_PAIRS;
    let threads = rayon::current_num_threads().max(1);
    // Pairs of tiles (the kernel's two B tiles), as many as the L2 share
    // holds; for a few hundred rows, also at least 4 column tasks a
    // thread where the weight has that many pairs.
    let fit = (TASK_BYTES / (tile_len * 4)).max(2) / 2 * 2;
    let per_task = if rows > 4 * CHUNK_ROWS {
        // Tasks enough in chunks of rows: as many tiles a task as fit, so
        // that the rows, which each task reads once, are read by few.
        fit
    } else {
        fit.min(tiles.div_ceil(threads * 4).next_multiple_of(2))
            .max(2)
    };
    let col_tasks = tiles.div_ceil(per_task);
    let row_chunk = if rows <= 4 * CHUNK_ROWS {
        rows
    } else {
        let chunks = (threads * 16).div_ceil(col_tasks);
        rows.div_ceil(chunks).max(CHUNK_ROWS).next_multiple_of(32)
    };
    let tasks = col_tasks * rows.div_ceil(row_chunk);
    // Where every tile is one task's, each row is read by one task: it
    // rounds its blocks of rows as it reaches them, in its L1 (a DaViT's
    // first stages, 36,864 rows, wrote and read back a rounded copy of 5–19
    // MB per product); else `x` is rounded once for the tasks to share,
    // with zero rows to a whole last block of 32 (read where they lie, and
    // stored by none).
    let xb;
    let src = if col_tasks == 1 {
        x86::Rows::Here(&x[..rows * k])
    } else {
        let padded = rows.next_multiple_of(2 * TILE_ROWS) * k;
        xb = super::gemm_bf16::to_bf16_padded(bf16_isa, &x[..rows * k], padded);
        x86::Rows::Rounded(&xb)
    };
    thread_local! {
        /// A task's widened tiles, kept by its thread for the next task.
        static WIDE: std::cell::Cell<Option<CacheAligned<u32>>> =
            const { std::cell::Cell::new(None) };
    }
    (0..tasks)
        .into_par_iter()
        .with_max_len(super::host::leaf_len(tasks))
        .for_each(|task| {
            let (rc, ct) = (task / col_tasks, task % col_tasks);
            let t0 = ct * per_task;
            let t1 = (t0 + per_task).min(tiles);
            let rows = rc * row_chunk..((rc + 1) * row_chunk).min(rows);
            let need = (t1 - t0) * tile_len;
            WIDE.with(|cell| {
                let mut wide = cell
                    .take()
                    .filter(|w| w.len() >= need)
                    .unwrap_or_else(|| CacheAligned::new(per_task * tile_len));
                for t in t0..t1 {
                    let (qs, d) = p.q8_tile(t).expect("takes: q8_0 tiles");
                    // SAFETY: the token proves AVX-512F, BW and
                    // AVX512_BF16.
                    unsafe { x86::widen(qs, d, &mut wide[(t - t0) * tile_len..][..tile_len]) };
                }
                // SAFETY: the token proves AMX-BF16 granted; the rows and
                // tiles are this task's alone (the caller's contract for
                // `out`).
                unsafe { x86::task(p, isa, &src, &wide, t0..t1, rows, (out, (gelu, residual))) };
                cell.set(Some(wide));
            });
        });
}

/// Not on this target: [`takes`] never says yes.
///
/// # Safety
/// None needed; it panics.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) unsafe fn product_into<P: Tiled, O: Out>(
    _: &P,
    _: Q8Isa,
    _: &[f32],
    _: usize,
    _: Epilogue<'_>,
    _: &O,
) {
    unreachable!("q8_amx: no Amx token on this target")
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;
    use std::arch::x86_64::*;
    use std::ops::Range;

    use half::bf16;

    use super::{BLOCK_PAIRS, BLOCK_VALUES, TILE_ROWS};
    use crate::kernels::features::Q8Isa;
    use crate::kernels::gemm_bf16::{tdp_1x2, tdp_2x2, tdp_store, tdp_zero, TileConfig};
    use crate::kernels::gemv_q8::{Out, Tiled};

    /// Where a task's blocks of rows come from.
    pub(super) enum Rows<'a> {
        /// `x` rounded to bf16 for the whole product, zero rows to a whole
        /// last block of 32.
        Rounded(&'a [bf16]),
        /// `x` itself, each block rounded by the task as it reaches it.
        Here(&'a [f32]),
    }

    /// One tile's q8_0 blocks (`qs`: per block 8 groups of 16 rows × 4
    /// values, stored `+ 128`; `d`: per block 16 f16 scales) widened to
    /// bf16 pairs in AMX's B-tile layout: per block, pair `p` of `k` ×
    /// column `c` at `16 p + c`, the first of the pair in the low half.
    /// Each group of 4 values per row gives two pairs, in the same lanes.
    ///
    /// # Safety
    /// The CPU has AVX-512F, BW and AVX512_BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn widen(qs: &[u8], d: &[u16], dst: &mut [u32]) {
        let blocks = d.len() / TILE_ROWS;
        assert!(
            qs.len() >= blocks * BLOCK_VALUES * TILE_ROWS && dst.len() >= blocks * BLOCK_PAIRS,
            "q8_amx: a tile's blocks and its widened copy disagree"
        );
        // Lane `2j` from the first value's 16, `2j + 1` from the second's.
        let order: [u16; 32] = std::array::from_fn(|i| (i / 2 + 16 * (i % 2)) as u16);
        // SAFETY: the lengths asserted above bound every load and store;
        // the CPU runs the instructions (the contract).
        unsafe {
            let order = _mm512_loadu_si512(order.as_ptr().cast());
            let low = _mm512_set1_epi32(0xFF);
            for b in 0..blocks {
                let scale = _mm512_cvtph_ps(_mm256_loadu_si256(d.as_ptr().add(b * 16).cast()));
                // `(q + 128) d - 128 d`: exact in f32 (an 11-bit scale by
                // an 8-bit value), rounded once by the FMA.
                let shift = _mm512_mul_ps(scale, _mm512_set1_ps(-128.0));
                let value = |v: __m512i| {
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), scale, shift)
                };
                for g in 0..8 {
                    let v = _mm512_loadu_si512(qs.as_ptr().add((b * 8 + g) * 64).cast());
                    let f0 = value(v);
                    let f1 = value(_mm512_srli_epi32::<8>(v));
                    let f2 = value(_mm512_srli_epi32::<16>(v));
                    let f3 = value(_mm512_srli_epi32::<24>(v));
                    let p0: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(f1, f0));
                    let p1: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(f3, f2));
                    let at = dst.as_mut_ptr().add(b * BLOCK_PAIRS + 2 * g * TILE_ROWS);
                    _mm512_storeu_si512(at.cast(), _mm512_permutexvar_epi16(order, p0));
                    _mm512_storeu_si512(
                        at.add(TILE_ROWS).cast(),
                        _mm512_permutexvar_epi16(order, p1),
                    );
                }
            }
        }
    }

    /// Rows `rows` of `x` (`(.., k)`, from `src`) against tiles `tiles` of
    /// `p`,
    /// widened in `wide` (tile `t` at `(t - tiles.start)` tiles' length):
    /// per block of 32 rows (which stays in L1 while the task's tiles pass
    /// from its L2: a tall product's rows are read from memory once) and
    /// pair of tiles, four 16 × 16 f32 tiles
    /// (`tmm0`–`tmm3`) take `tdpbf16ps` of two 16-row tiles of `x`
    /// (`tmm4`, `tmm5`) by the two widened tiles (`tmm6`, `tmm7`) per
    /// block of 32 values; a last block of 16 rows or fewer takes one
    /// tile of rows, a last odd tile one B tile. The zero rows past the
    /// end of a last block are computed and not stored.
    ///
    /// # Safety
    /// The CPU runs AMX-BF16 with the tile state granted (the token
    /// [`crate::kernels::Q8Simd::Amx`] proves it); the rows and tiles are
    /// `p`'s, and `out`'s places for them are writable and no other
    /// thread's.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn task<P: Tiled, O: Out>(
        p: &P,
        isa: Q8Isa,
        src: &Rows<'_>,
        wide: &[u32],
        tiles: Range<usize>,
        rows: Range<usize>,
        (out, epilogue): (&O, super::Epilogue<'_>),
    ) {
        let k = p.dims().1;
        let blocks = k / BLOCK_VALUES;
        let tile_len = blocks * BLOCK_PAIRS;
        assert!(
            match src {
                Rows::Rounded(xb) => xb.len() >= rows.end.next_multiple_of(2 * TILE_ROWS) * k,
                Rows::Here(x) => x.len() >= rows.end * k,
            } && wide.len() >= tiles.len() * tile_len,
            "q8_amx: a task's rows (rounded: padded to a block of 32) or widened tiles are short"
        );
        // The block of rows a task rounds itself (`Rows::Here`).
        let mut block = match src {
            Rows::Here(_) => crate::kernels::aligned::CacheAligned::<bf16>::new(2 * TILE_ROWS * k),
            Rows::Rounded(_) => crate::kernels::aligned::CacheAligned::new(0),
        };
        let x_stride = 2 * k;
        let mut sums = [[[0f32; TILE_ROWS]; 2 * TILE_ROWS]; 2];
        let cfg = TileConfig::sixteen_by_64();
        // SAFETY: each A tile load reads 16 rows of 64 bytes from byte
        // `64 b` (`b < k / 32`) of rows inside the rounded `x` (asserted:
        // whole blocks of 32 rows) or the task's block of 32; each B tile
        // load 1 KiB of a widened tile's block, inside `wide` (asserted).
        // The stores write `sums`' 16-row halves (rows of 64 bytes). The
        // tiles are configured first and released last.
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) cfg.as_ptr(), options(nostack, readonly));
            let mut r0 = rows.start;
            while r0 < rows.end {
                let here = (rows.end - r0).min(2 * TILE_ROWS);
                let a = match src {
                    Rows::Rounded(xb) => xb.as_ptr().add(r0 * k),
                    Rows::Here(x) => {
                        let y = &mut block[..here * k];
                        // SAFETY: `round` writes every value of `y` (a
                        // valid bf16 each); the token proves the ISA.
                        crate::kernels::gemm_bf16::round_into(&x[r0 * k..][..here * k], y);
                        block[here * k..].fill(bf16::ZERO);
                        block.as_ptr()
                    }
                }
                .cast::<u8>();
                let halves = if here > TILE_ROWS { 2 } else { 1 };
                let mut t = tiles.start;
                while t < tiles.end {
                    let two = t + 1 < tiles.end;
                    let b0 = wide.as_ptr().add((t - tiles.start) * tile_len).cast::<u8>();
                    let b1 = if two { b0.add(tile_len * 4) } else { b0 };
                    tdp_zero();
                    for b in 0..blocks {
                        let a0 = a.add(64 * b);
                        let (w0, w1) = (b0.add(4 * BLOCK_PAIRS * b), b1.add(4 * BLOCK_PAIRS * b));
                        let strides = (x_stride, 64);
                        match (halves, two) {
                            (2, true) => {
                                tdp_2x2((a0, a0.add(TILE_ROWS * x_stride)), (w0, w1), strides)
                            }
                            (2, false) => asm!(
                                "tileloadd tmm4, [{a0} + {xs}*1]",
                                "tileloadd tmm5, [{a1} + {xs}*1]",
                                "tileloadd tmm6, [{w0} + {ws}*1]",
                                "tdpbf16ps tmm0, tmm4, tmm6",
                                "tdpbf16ps tmm2, tmm5, tmm6",
                                a0 = in(reg) a0,
                                a1 = in(reg) a0.add(TILE_ROWS * x_stride),
                                w0 = in(reg) w0,
                                xs = in(reg) x_stride,
                                ws = in(reg) 64usize,
                                options(nostack, readonly)
                            ),
                            (_, true) => tdp_1x2(a0, (w0, w1), strides),
                            (_, false) => asm!(
                                "tileloadd tmm4, [{a0} + {xs}*1]",
                                "tileloadd tmm6, [{w0} + {ws}*1]",
                                "tdpbf16ps tmm0, tmm4, tmm6",
                                a0 = in(reg) a0,
                                w0 = in(reg) w0,
                                xs = in(reg) x_stride,
                                ws = in(reg) 64usize,
                                options(nostack, readonly)
                            ),
                        }
                    }
                    let s0 = sums[0].as_mut_ptr().cast::<u8>();
                    let s1 = sums[1].as_mut_ptr().cast::<u8>();
                    let half = TILE_ROWS * TILE_ROWS * 4;
                    // Tile `t`'s sums in `sums[0]`, tile `t + 1`'s in `sums[1]`.
                    tdp_store([s0, s1, s0.add(half), s1.add(half)], 64);
                    store(p, isa, &mut sums[0][..here], t, r0, (out, epilogue));
                    if two {
                        store(p, isa, &mut sums[1][..here], t + 1, r0, (out, epilogue));
                    }
                    t += if two { 2 } else { 1 };
                }
                r0 += here;
            }
            asm!("tilerelease", options(nostack, nomem));
        }
    }

    /// Sums `acc` of rows `r0 ..` by tile `t` of `p`, plus the tile's
    /// bias, through the GELU if asked, plus the residual if any, stored
    /// at `out`'s places: the bias added and the rows stored as vectors
    /// (per value, the q8_0 kernels' general store took a cycle), the
    /// GELU over the block's sums in one call.
    ///
    /// # Safety
    /// As [`task`]'s, for these rows and this tile; a residual is `(rows,
    /// n)`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn store<P: Tiled, O: Out>(
        p: &P,
        isa: Q8Isa,
        acc: &mut [[f32; TILE_ROWS]],
        t: usize,
        r0: usize,
        (out, (gelu, residual)): (&O, super::Epilogue<'_>),
    ) {
        let n = p.dims().0;
        let cols = (n - t * TILE_ROWS).min(TILE_ROWS);
        let mask: __mmask16 = if cols == TILE_ROWS {
            !0
        } else {
            (1 << cols) - 1
        };
        // SAFETY: the bias has the tile's `cols` values (masked past
        // them), as has each row's part of the residual; each row of
        // `acc` is 16 values; the places are the caller's to write, `cols`
        // values each (masked).
        unsafe {
            if let Some(b) = p.tile_bias(t) {
                let b = _mm512_maskz_loadu_ps(mask, b.as_ptr());
                for row in acc.iter_mut() {
                    _mm512_storeu_ps(
                        row.as_mut_ptr(),
                        _mm512_add_ps(_mm512_loadu_ps(row.as_ptr()), b),
                    );
                }
            }
            if let Some(exact) = gelu {
                crate::kernels::gelu::in_place(isa.f32_isa(), exact, acc.as_flattened_mut());
            }
            for (i, row) in acc.iter().enumerate() {
                let mut v = _mm512_loadu_ps(row.as_ptr());
                if let Some(res) = residual {
                    let r = res.as_ptr().add((r0 + i) * n + t * TILE_ROWS);
                    v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, r));
                }
                _mm512_mask_storeu_ps(out.at(r0 + i, t, n), mask, v);
            }
        }
    }
}

/// On x86-64 alone: no other target hands out the Amx token.
#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use candle_core::{Device, Tensor};
    use half::bf16;

    use super::*;
    use crate::kernels::gemv_q8::{matmul_tiled_placed, matmul_tiled_then, PackedQ8, Stacked};
    use crate::kernels::CpuFeatures;

    /// The CPU's Amx token, or `None` (the tests then have nothing to
    /// run: `takes` never says yes without it).
    fn amx() -> Option<Q8Isa> {
        CpuFeatures::get().q8_isa_for(Q8Simd::Amx)
    }

    /// `Σ bf16(x) · bf16(w)` in f64 per row and column of the dequantized
    /// weight, plus the bias, through the GELU (exact or tanh) if asked.
    fn reference(
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        gelu: Option<bool>,
        k: usize,
    ) -> Vec<f64> {
        let round =
            |v: &[f32]| -> Vec<f64> { v.iter().map(|&v| bf16::from_f32(v).to_f64()).collect() };
        let (xb, wb) = (round(x), round(w));
        let n = w.len() / k;
        let mut y = Vec::new();
        for xr in xb.chunks(k) {
            for (c, wr) in wb.chunks(k).enumerate() {
                let mut v: f64 = xr.iter().zip(wr).map(|(a, b)| a * b).sum();
                v += bias.map_or(0., |b| b[c] as f64);
                y.push(match gelu {
                    None => v,
                    Some(true) => 0.5 * v * (1. + erf(v / 2f64.sqrt())),
                    Some(false) => {
                        0.5 * v
                            * (1.
                                + ((2. / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v))
                                    .tanh())
                    }
                });
            }
        }
        assert_eq!(y.len(), x.len() / k * n);
        y
    }

    /// erf to f64 precision for the reference (Abramowitz–Stegun 7.1.26
    /// is too coarse): its Taylor series near 0, the continued fraction
    /// of erfc beyond.
    fn erf(v: f64) -> f64 {
        let a = v.abs();
        let e = if a < 2.5 {
            let mut term = a;
            let mut sum = a;
            for n in 1..200 {
                term *= -a * a / n as f64;
                sum += term / (2 * n + 1) as f64;
            }
            sum * 2. / std::f64::consts::PI.sqrt()
        } else {
            let mut f = 0.;
            for n in (1..120).rev() {
                f = (n as f64 / 2.) / (a + f);
            }
            1. - (-a * a).exp() / (std::f64::consts::PI.sqrt() * (a + f))
        };
        e.copysign(v)
    }

    /// A widened tile holds `bf16(d · q)` of the dequantized weight, pair
    /// `p` × column `c` at `16 p + c` per block, the first of the pair in
    /// the low half.
    #[test]
    fn widening_rounds_the_dequantized_weight() -> candle_core::Result<()> {
        let Some(isa) = amx() else { return Ok(()) };
        let _ = isa;
        let (n, k) = (40, 96);
        let p = PackedQ8::quantize(&Tensor::randn(0f32, 1., (n, k), &Device::Cpu)?)?;
        let dq: Vec<f32> = p.dequantize()?.flatten_all()?.to_vec1()?;
        let blocks = k / BLOCK_VALUES;
        for t in 0..n.div_ceil(TILE_ROWS) {
            let (qs, d) = p.q8_tile(t).expect("q8_0 tiles");
            let mut wide = vec![0u32; blocks * BLOCK_PAIRS];
            // SAFETY: the Amx token implies AVX-512F, BW and AVX512_BF16.
            unsafe { x86::widen(qs, d, &mut wide) };
            for c in 0..TILE_ROWS.min(n - t * TILE_ROWS) {
                for v in 0..k {
                    let (b, pair) = (v / BLOCK_VALUES, (v % BLOCK_VALUES) / 2);
                    let word = wide[b * BLOCK_PAIRS + pair * TILE_ROWS + c];
                    let got = if v % 2 == 0 {
                        word & 0xFFFF
                    } else {
                        word >> 16
                    };
                    let want = bf16::from_f32(dq[(t * TILE_ROWS + c) * k + v]).to_bits();
                    assert_eq!(got, want as u32, "tile {t}, column {c}, value {v}");
                }
            }
        }
        Ok(())
    }

    /// Products on the tile unit equal the f64 product of `x` and the
    /// weight both rounded to bf16 (relative error under 1e-5 of the
    /// largest output: only the f32 summation differs), plus the bias,
    /// through either GELU: from [`MIN_ROWS`] rows, with a last block of
    /// up to 16 rows and of more, heights off the tile size (an odd last
    /// tile), widths of 2 to 100 blocks, rows rounded once for the whole
    /// product and by each task (one column task: a single tile, or
    /// chunks of many rows); a product's rows equal the same
    /// rows in a product of their own, bit for bit; fewer rows than
    /// [`MIN_ROWS`] are not taken.
    #[test]
    fn matches_the_bf16_reference() -> candle_core::Result<()> {
        let Some(isa) = amx() else { return Ok(()) };
        let dev = Device::Cpu;
        for &(n, k) in &[(16, 64), (33, 64), (65, 800), (200, 3200)] {
            let w = Tensor::randn(0f32, 1., (n, k), &dev)?;
            let bias = Tensor::randn(0f32, 1., n, &dev)?;
            let p = PackedQ8::quantize(&w)?.with_bias(Some(&bias))?;
            assert!(!takes(&p, isa, &[MIN_ROWS - 1, k]));
            assert!(!takes(&p, isa, &[4, 17, k]), "4 samples of 17 rows");
            let dq: Vec<f32> = p.dequantize()?.flatten_all()?.to_vec1()?;
            let b: Vec<f32> = bias.to_vec1()?;
            // 1100 rows: chunks of rows, each task's rows rounded by it.
            for rows in [MIN_ROWS, 70, 90, 131, 700, 1100] {
                if k >= 800 && rows > 131 {
                    continue;
                }
                assert!(takes(&p, isa, &[rows, k]));
                let x = Tensor::randn(0f32, 1., (rows, k), &dev)?;
                let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
                for gelu in [None, Some(true), Some(false)] {
                    let want = reference(&xs, &dq, Some(&b), gelu, k);
                    let scale = want.iter().map(|v| v.abs()).fold(1e-3, f64::max);
                    let y = matmul_tiled_then(&p, isa, &x, gelu)?;
                    assert_eq!(y.dims(), &[rows, n]);
                    let got: Vec<f32> = y.flatten_all()?.to_vec1()?;
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        let err = (*g as f64 - w).abs() / scale;
                        assert!(
                            err < 1e-5,
                            "({rows}, {k}) x ({n}, {k}) {gelu:?}, output {i}: {g} vs {w}"
                        );
                    }
                    if gelu.is_none() {
                        // The residual added as the sums are stored: the
                        // bits of the addition after.
                        let r = Tensor::randn(0f32, 1., (rows, n), &dev)?;
                        let fused = crate::kernels::gemv_q8::matmul_tiled_add(&p, isa, &x, &r)?
                            .expect("on the tile unit");
                        let apart = (&y + &r)?;
                        assert_eq!(
                            fused.flatten_all()?.to_vec1::<f32>()?,
                            apart.flatten_all()?.to_vec1::<f32>()?,
                            "({rows}, {k}) x ({n}, {k}) plus a residual"
                        );
                    }
                    let r0 = rows - MIN_ROWS;
                    let own = matmul_tiled_then(&p, isa, &x.narrow(0, r0, MIN_ROWS)?, gelu)?;
                    assert_eq!(
                        own.flatten_all()?.to_vec1::<f32>()?,
                        got[r0 * n..].to_vec(),
                        "rows {r0}.. of {rows} in a product of their own"
                    );
                }
            }
        }
        Ok(())
    }

    /// A batch's product takes the route of its samples' rows, so each
    /// sample's outputs are those it gets alone, bit for bit: four
    /// samples of 17 rows (68 rows together, on VNNI as each alone) and
    /// two of 70 (on the tile unit, as each alone).
    #[test]
    fn a_batch_computes_as_each_sample_alone() -> candle_core::Result<()> {
        let Some(isa) = amx() else { return Ok(()) };
        let dev = Device::Cpu;
        let (n, k) = (48, 96);
        let p = PackedQ8::quantize(&Tensor::randn(0f32, 1., (n, k), &dev)?)?;
        for (batch, rows) in [(4, 17), (2, 70)] {
            let x = Tensor::randn(0f32, 1., (batch, rows, k), &dev)?;
            assert_eq!(takes(&p, isa, x.dims()), rows >= MIN_ROWS);
            let all: Vec<f32> = matmul_tiled_then(&p, isa, &x, None)?
                .flatten_all()?
                .to_vec1()?;
            for b in 0..batch {
                let alone = matmul_tiled_then(&p, isa, &x.narrow(0, b, 1)?, None)?;
                assert_eq!(
                    alone.flatten_all()?.to_vec1::<f32>()?,
                    all[b * rows * n..][..rows * n].to_vec(),
                    "sample {b} of {batch} × {rows} rows"
                );
            }
        }
        assert_eq!(sample_rows(&[7]), 1);
        assert_eq!(sample_rows(&[9, 4]), 9);
        assert_eq!(sample_rows(&[2, 12, 12, 64]), 144);
        Ok(())
    }

    /// A stacked product on the tile unit, placed: each part's own
    /// product (with its own bias), bit for bit.
    #[test]
    fn stacked_placed_parts_are_their_own_products() -> candle_core::Result<()> {
        let Some(isa) = amx() else { return Ok(()) };
        let dev = Device::Cpu;
        let k = 96;
        let parts = [
            PackedQ8::quantize(&Tensor::randn(0f32, 1., (48, k), &dev)?)?
                .with_bias(Some(&Tensor::randn(0f32, 1., 48, &dev)?))?,
            PackedQ8::quantize(&Tensor::randn(0f32, 1., (16, k), &dev)?)?,
        ];
        let refs: Vec<&PackedQ8> = parts.iter().collect();
        let whole = Stacked::new(&refs).expect("stackable");
        let rows = 150;
        let x = Tensor::randn(0f32, 1., (rows, k), &dev)?;
        // Row-major `(rows, 64)`, the parts swapped: part 1's tile first.
        let places: Vec<usize> = (0..rows).map(|r| r * 64).collect();
        let tiles: Vec<usize> = vec![16, 32, 48, 0];
        assert!(takes(&whole, isa, &[rows, k]));
        // SAFETY: every (row, tile) has its own 16 of the `rows · 64`
        // values.
        let got = unsafe { matmul_tiled_placed(&whole, isa, &x, &places, &tiles, rows * 64) }?;
        let first: Vec<f32> = matmul_tiled_then(&parts[0], isa, &x, None)?
            .flatten_all()?
            .to_vec1()?;
        let second: Vec<f32> = matmul_tiled_then(&parts[1], isa, &x, None)?
            .flatten_all()?
            .to_vec1()?;
        for r in 0..rows {
            assert_eq!(&got[r * 64 + 16..][..48], &first[r * 48..][..48], "row {r}");
            assert_eq!(&got[r * 64..][..16], &second[r * 16..][..16], "row {r}");
        }
        Ok(())
    }
}
