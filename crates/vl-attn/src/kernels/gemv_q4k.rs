//! vl's q4_K products on the CPU: `y = x W^T` with `W (n, k)` in candle's
//! and ggml's q4_K (per 256 weights an f16 `d` and `dmin`; per 32 a 6-bit
//! scale `sc` and minimum `m`; per weight 4 bits `q`, standing for
//! `d·sc·q − dmin·m`), packed once, at load, into tiles of 16 rows, for
//! any number of rows of `x`.
//!
//! Why vl owns it: candle's q4_K product on x86 runs at 0.29–0.45 of the
//! machine's read bandwidth in a decode step, for the reasons
//! [`crate::kernels::gemv_q8`] gives for its q8_0 one (a thread pool of its own
//! that spins beside vl's, and a repacked second copy of every weight).
//!
//! The layout follows [`crate::kernels::gemv_q8::PackedQ8`]'s: for each tile of 16
//! rows and each 32-weight sub-block, 256 bytes `[group pair (4)][row
//! (16)][4 bytes]`, where byte `c` of a row holds column `4p + c` of the
//! sub-block in its low nibble and column `16 + 4p + c` in its high one.
//! A tile's blocks follow each other as records of 2368 bytes (37 cache
//! lines): the 16 rows' `d` and `dmin` (f16), their 8 sub-blocks' `sc`
//! and `m` (a byte each), then the 8 sub-blocks' nibbles; a tile's
//! product reads one stream. Per sub-block a kernel loads 4 vectors,
//! splits the nibbles, and 8 AVX-512 VNNI `vpdpbusd` give the 16 rows'
//! integer dot products with `x` rounded to q8_0 (per 32 values, as
//! [`crate::kernels::gemv_q8`] rounds it; candle rounds per 256); then
//! `acc += (d·sc)·dx·Σ q·xq − (dmin·m)·dx·Σ xq`. The bytes held are
//! 4.625 bits per weight (candle's blocks 4.5: the scales and minimums
//! are whole bytes here).

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use half::f16;
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::features::Q8Simd;
use super::features::{CpuFeatures, Q8Isa};
#[cfg(target_arch = "x86_64")]
use crate::kernels::gemv::prefetch;
use crate::kernels::gemv_q8::{
    bias_tensor, checked_bias, matmul_tiled, matmul_tiled_then, SummedActivations, Tiled, TILE_ROWS,
};
use crate::kernels::micro::{madd, Kernel};
use crate::kernels::q4k::{self, scale_min, BLOCK_BYTES, BLOCK_VALUES};

/// Weights per sub-block (one scale and minimum).
const SUB: usize = 32;
/// Sub-blocks per block.
const SUBS: usize = BLOCK_VALUES / SUB;
/// Bytes per tile and sub-block: 16 rows × 32 nibbles.
const TILE_BYTES: usize = TILE_ROWS * SUB / 2;
/// Where a record's parts start: `d`, `dmin` (16 f16 bits each), `sc`,
/// `m` (16 bytes per sub-block each), the sub-blocks' tiles.
const D: usize = 0;
const DMIN: usize = D + 2 * TILE_ROWS;
const SC: usize = DMIN + 2 * TILE_ROWS;
const M: usize = SC + SUBS * TILE_ROWS;
const QS: usize = M + SUBS * TILE_ROWS;
/// Bytes per tile and block.
const REC: usize = QS + SUBS * TILE_BYTES;

/// A q4_K weight `(n, k)` packed for vl's kernels (see the module's
/// documentation): `n` rounded up to tiles of 16 rows, the padding rows
/// zero and never stored.
#[derive(Debug)]
pub struct PackedQ4K {
    n: usize,
    k: usize,
    /// `(tiles, k / 256)` records of [`REC`] bytes.
    data: Vec<u8>,
    /// The layer's bias, added as the outputs are stored.
    bias: Option<Vec<f32>>,
}

impl PackedQ4K {
    /// Bytes held per weight: 4.625 bits (candle's q4_K blocks: 4.5).
    pub const BYTES_PER_WEIGHT: f64 = REC as f64 / (TILE_ROWS * BLOCK_VALUES) as f64;

    /// Quantizes `w (n, k)` (on the CPU, `k` a multiple of 256) to q4_K
    /// exactly as candle's `QTensor::quantize` does (with vl's faster
    /// quantizer, which writes candle's bytes) and packs it, tiles on the
    /// pool.
    ///
    /// # Errors
    /// A weight that is not 2-D, not on the CPU, or of a width that is not
    /// a multiple of 256, named with its shape.
    pub fn quantize(w: &Tensor) -> candle_core::Result<Self> {
        let (n, k) = w.dims2()?;
        if !w.device().is_cpu() || !k.is_multiple_of(BLOCK_VALUES) {
            candle_core::bail!(
                "vl-q4k: packs a weight (n, k * 256) on the CPU; got {:?} on {:?}",
                w.dims(),
                w.device()
            );
        }
        crate::kernels::with_values(&w.to_dtype(DType::F32)?, |values: &[f32]| {
            let mut p = Self::empty(n, k);
            let blocks = k / BLOCK_VALUES;
            p.tiles_mut().for_each(|(t, tile)| {
                let rows = TILE_ROWS.min(n - t * TILE_ROWS);
                let mut bytes = vec![0u8; rows * blocks * BLOCK_BYTES];
                q4k::quantize(&values[t * TILE_ROWS * k..][..rows * k], &mut bytes);
                place(tile, &bytes, blocks);
            });
            p
        })
    }

    /// Packs candle's q4_K blocks (a GGUF file's weight, say).
    ///
    /// # Errors
    /// A tensor not q4_K `(n, k)` on the CPU, named.
    pub fn from_qtensor(q: &QTensor) -> candle_core::Result<Self> {
        let (n, k) = q.shape().dims2()?;
        if q.dtype() != GgmlDType::Q4K || !q.device().is_cpu() {
            candle_core::bail!(
                "vl-q4k: packs a q4_K weight on the CPU; got {:?} ({n}, {k})",
                q.dtype()
            );
        }
        let bytes = q.data()?;
        let blocks = k / BLOCK_VALUES;
        if bytes.len() != n * blocks * BLOCK_BYTES {
            candle_core::bail!(
                "vl-q4k: a q4_K weight of {} bytes for ({n}, {k})",
                bytes.len()
            );
        }
        let mut p = Self::empty(n, k);
        p.tiles_mut().for_each(|(t, tile)| {
            let rows = TILE_ROWS.min(n - t * TILE_ROWS);
            place(
                tile,
                &bytes[t * TILE_ROWS * blocks * BLOCK_BYTES..][..rows * blocks * BLOCK_BYTES],
                blocks,
            );
        });
        Ok(p)
    }

    /// Zero tiles for `(n, k)`.
    fn empty(n: usize, k: usize) -> Self {
        Self {
            n,
            k,
            data: vec![0; n.div_ceil(TILE_ROWS) * (k / BLOCK_VALUES) * REC],
            bias: None,
        }
    }

    /// Each tile's records, on the pool.
    fn tiles_mut(&mut self) -> impl ParallelIterator<Item = (usize, &mut [u8])> {
        // Chunks of at least one byte (a zero-width weight has none).
        let per_tile = (self.k / BLOCK_VALUES * REC).max(1);
        self.data.par_chunks_mut(per_tile).enumerate()
    }

    /// With the layer's bias `(n)` (any float dtype), added to every
    /// output row as it is stored.
    ///
    /// # Errors
    /// A bias of another length or not on the CPU, named.
    pub fn with_bias(mut self, bias: Option<&Tensor>) -> candle_core::Result<Self> {
        self.bias = checked_bias::<Self>((self.n, self.k), bias)?;
        Ok(self)
    }

    /// The bias, `(n)` f32, if any.
    pub fn bias(&self) -> candle_core::Result<Option<Tensor>> {
        bias_tensor(self.bias.as_deref())
    }

    /// `(n, k)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// The bytes held.
    pub fn size_in_bytes(&self) -> usize {
        self.data.len()
    }

    /// The blocks in candle's (ggml's) q4_K layout, row by row — what
    /// [`PackedQ4K::from_qtensor`] packs, byte for byte.
    pub fn to_blocks(&self) -> Vec<u8> {
        let blocks = self.k / BLOCK_VALUES;
        let mut out = vec![0u8; self.n * blocks * BLOCK_BYTES];
        for row in 0..self.n {
            let (t, j) = (row / TILE_ROWS, row % TILE_ROWS);
            for b in 0..blocks {
                let rec = &self.data[(t * blocks + b) * REC..][..REC];
                let block = &mut out[(row * blocks + b) * BLOCK_BYTES..][..BLOCK_BYTES];
                unplace(rec, j, block);
            }
        }
        out
    }

    /// The weight the blocks stand for, `(n, k)` f32: exactly candle's
    /// dequantization of the same blocks (`d·sc·q − dmin·m`, in that
    /// order).
    pub fn dequantize(&self) -> candle_core::Result<Tensor> {
        let blocks = self.k / BLOCK_VALUES;
        let mut w = vec![0f32; self.n * self.k];
        for (row, wr) in w.chunks_exact_mut(self.k.max(1)).enumerate() {
            let (t, j) = (row / TILE_ROWS, row % TILE_ROWS);
            for (s, ws) in wr.chunks_exact_mut(SUB).enumerate() {
                let (b, s) = (s / SUBS, s % SUBS);
                let rec = &self.data[(t * blocks + b) * REC..][..REC];
                let d1 = half_at(rec, D, j) * rec[SC + s * TILE_ROWS + j] as f32;
                let m1 = half_at(rec, DMIN, j) * rec[M + s * TILE_ROWS + j] as f32;
                let tile = &rec[QS + s * TILE_BYTES..][..TILE_BYTES];
                for (v, o) in ws.iter_mut().enumerate() {
                    *o = d1 * nibble(tile, j, v) as f32 - m1;
                }
            }
        }
        Tensor::from_vec(w, (self.n, self.k), &Device::Cpu)
    }

    /// `x W^T` (plus the bias, if any) on this CPU's best
    /// [`Q8Isa`].
    ///
    /// # Shapes
    /// `x: (..., k)` f32, f16 or bf16 on the CPU, any number of rows →
    /// `(..., n)` f32.
    ///
    /// # Errors
    /// An `x` of another width, not on the CPU or of an integer dtype,
    /// named.
    pub fn matmul(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.matmul_with(CpuFeatures::get().q8_isa(), x)
    }

    /// [`PackedQ4K::matmul`] on a given implementation (tests compare
    /// them; the token proves the CPU runs it).
    ///
    /// # Errors
    /// As [`PackedQ4K::matmul`].
    pub fn matmul_with(&self, isa: Q8Isa, x: &Tensor) -> candle_core::Result<Tensor> {
        matmul_tiled(self, isa, x)
    }

    /// `GELU(x W^T + b)` in f32, the GELU applied as the outputs are
    /// stored: as [`crate::kernels::gemv_q8::PackedQ8::matmul_gelu`].
    ///
    /// # Errors
    /// As [`PackedQ4K::matmul`].
    pub fn matmul_gelu(&self, x: &Tensor, exact: bool) -> candle_core::Result<Tensor> {
        matmul_tiled_then(self, CpuFeatures::get().q8_isa(), x, Some(exact))
    }
}

/// Weight `v` (0..32) of row `j` in a tile's sub-block.
fn nibble(tile: &[u8], j: usize, v: usize) -> u8 {
    let (half, c) = (v / 16, v % 16);
    let byte = tile[((c / 4) * TILE_ROWS + j) * 4 + c % 4];
    if half == 0 {
        byte & 0xF
    } else {
        byte >> 4
    }
}

/// Row `j`'s f16 at `at` in a record, widened.
fn half_at(rec: &[u8], at: usize, j: usize) -> f32 {
    f16::from_bits(u16::from_ne_bytes([rec[at + 2 * j], rec[at + 2 * j + 1]])).to_f32()
}

/// Row `j`'s block in a record, back in candle's layout: [`place`]
/// undone, the 6-bit scales and minimums packed as ggml packs them (the
/// inverse of [`scale_min`]).
fn unplace(rec: &[u8], j: usize, block: &mut [u8]) {
    block[0..2].copy_from_slice(&rec[D + 2 * j..][..2]);
    block[2..4].copy_from_slice(&rec[DMIN + 2 * j..][..2]);
    let sc = |s: usize| rec[SC + s * TILE_ROWS + j];
    let m = |s: usize| rec[M + s * TILE_ROWS + j];
    let scales = &mut block[4..16];
    for s in 0..4 {
        scales[s] = sc(s) | ((sc(s + 4) >> 4) << 6);
        scales[s + 4] = m(s) | ((m(s + 4) >> 4) << 6);
        scales[s + 8] = (sc(s + 4) & 0xF) | ((m(s + 4) & 0xF) << 4);
    }
    let qs = &mut block[16..BLOCK_BYTES];
    for s in 0..SUBS {
        let t = &rec[QS + s * TILE_BYTES..][..TILE_BYTES];
        let dst = &mut qs[(s / 2) * 32..][..32];
        for (v, byte) in dst.iter_mut().enumerate() {
            let q = nibble(t, j, v);
            if s % 2 == 0 {
                *byte = (*byte & 0xF0) | q;
            } else {
                *byte = (*byte & 0x0F) | (q << 4);
            }
        }
    }
}

/// Places the q4_K blocks of up to 16 rows (`blocks` per row, in candle's
/// layout) into a tile's records.
fn place(tile: &mut [u8], bytes: &[u8], blocks: usize) {
    for (j, row) in bytes.chunks_exact(blocks * BLOCK_BYTES).enumerate() {
        for (b, block) in row.chunks_exact(BLOCK_BYTES).enumerate() {
            let rec = &mut tile[b * REC..][..REC];
            rec[D + 2 * j..][..2].copy_from_slice(&block[0..2]);
            rec[DMIN + 2 * j..][..2].copy_from_slice(&block[2..4]);
            let scales: &[u8; 12] = block[4..16].try_into().expect("12 bytes");
            let qs = &block[16..BLOCK_BYTES];
            for s in 0..SUBS {
                (rec[SC + s * TILE_ROWS + j], rec[M + s * TILE_ROWS + j]) = scale_min(s, scales);
                // Sub-block s: the low (s even) or high nibbles of bytes
                // 32 (s / 2) .. + 32 (candle's order).
                let src = &qs[(s / 2) * 32..][..32];
                let q = |v: usize| {
                    if s % 2 == 0 {
                        src[v] & 0xF
                    } else {
                        src[v] >> 4
                    }
                };
                let t = &mut rec[QS + s * TILE_BYTES..][..TILE_BYTES];
                for c in 0..16 {
                    t[((c / 4) * TILE_ROWS + j) * 4 + c % 4] = q(c) | (q(16 + c) << 4);
                }
            }
        }
    }
}

impl Tiled for PackedQ4K {
    const NAME: &'static str = "vl-q4k";
    type Input = SummedActivations;

    fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    fn bias_values(&self) -> Option<&[f32]> {
        self.bias.as_deref()
    }

    #[inline(always)]
    fn accumulate<const R: usize>(
        &self,
        isa: Q8Isa,
        a: &SummedActivations,
        t: usize,
        r0: usize,
        acc: &mut [[f32; TILE_ROWS]; R],
    ) {
        match isa.simd() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves AVX-512F, BW and VNNI.
            Q8Simd::Amx | Q8Simd::Vnni => unsafe { tile_vnni(self, a, t, r0, acc) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves AVX2 and FMA.
            Q8Simd::Avx2 => unsafe { tile_avx2(self, a, t, r0, acc) },
            _ => tile_plain(isa.f32_isa(), self, a, t, r0, acc),
        }
    }
}

/// One tile against rows `r0..r0 + R`, in plain Rust (vectorised by the
/// compiler for the instruction set it is compiled for).
#[inline(always)]
fn tile_generic<K: Kernel, const R: usize>(
    p: &PackedQ4K,
    input: &SummedActivations,
    t: usize,
    r0: usize,
    acc: &mut [[f32; TILE_ROWS]; R],
) {
    let a = &input.acts;
    let (blocks, subs) = (p.k / BLOCK_VALUES, p.k / SUB);
    for s in 0..subs {
        let (b, sb) = (s / SUBS, s % SUBS);
        let rec = &p.data[(t * blocks + b) * REC..][..REC];
        let tile = &rec[QS + sb * TILE_BYTES..][..TILE_BYTES];
        let scale: [f32; TILE_ROWS] =
            std::array::from_fn(|j| half_at(rec, D, j) * rec[SC + sb * TILE_ROWS + j] as f32);
        let min: [f32; TILE_ROWS] =
            std::array::from_fn(|j| half_at(rec, DMIN, j) * rec[M + sb * TILE_ROWS + j] as f32);
        for (i, acc) in acc.iter_mut().enumerate() {
            let r = r0 + i;
            let x = &a.q[r * a.k + s * SUB..][..SUB];
            let mut sum = [0i32; TILE_ROWS];
            for c in 0..16 {
                for (j, sum) in sum.iter_mut().enumerate() {
                    let byte = tile[((c / 4) * TILE_ROWS + j) * 4 + c % 4];
                    *sum +=
                        (byte & 0xF) as i32 * x[c] as i32 + (byte >> 4) as i32 * x[16 + c] as i32;
                }
            }
            let blk = r * subs + s;
            let dx = a.d[blk];
            let sx = input.sums[blk];
            for j in 0..TILE_ROWS {
                acc[j] = madd(K::FMA, sum[j] as f32, scale[j] * dx, acc[j]);
                acc[j] = madd(K::FMA, -min[j], sx, acc[j]);
            }
        }
    }
}

crate::kernels::micro::per_isa! {
    /// [`tile_generic`] compiled for `isa` (which the CPU supports).
    fn tile_plain<const R: usize>(
        p: &PackedQ4K,
        a: &SummedActivations,
        t: usize,
        r0: usize,
        acc: &mut [[f32; TILE_ROWS]; R],
    ) = tile_generic::<crate::kernels::micro::Avx512>
}

/// [`tile_generic`] with AVX-512 VNNI intrinsics: per sub-block, the
/// tile's 4 vectors loaded and split into nibbles once for all `R` rows,
/// two `vpdpbusd` chains per row.
///
/// # Panics
/// If `t` is not a tile of `p`, rows `r0..r0 + R` are not in `a` or `a`'s
/// width is not `p`'s (checked once, before the loops).
///
/// # Safety
/// The CPU has AVX-512F, BW and VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile_vnni<const R: usize>(
    p: &PackedQ4K,
    input: &SummedActivations,
    t: usize,
    r0: usize,
    acc: &mut [[f32; TILE_ROWS]; R],
) {
    use std::arch::x86_64::*;
    check_tile(p, input, t, r0, R);
    let a = &input.acts;
    let (blocks, subs) = (p.k / BLOCK_VALUES, p.k / SUB);
    let tune = CpuFeatures::get().tuning;
    let (ahead, hint) = (tune.prefetch_ahead, tune.prefetch);
    // SAFETY: every offset below is within the tile `t` of `p` and the rows
    // `r0..r0 + R` of `a` (checked above).
    unsafe {
        let mut sums = [_mm512_setzero_ps(); R];
        let low = _mm512_set1_epi8(0x0F);
        let recs = p.data.as_ptr().add(t * blocks * REC);
        for b in 0..blocks {
            let rec = recs.add(b * REC);
            // Every line of the stream is asked for `ahead` bytes
            // before it is read: the head's 5 here, each sub-block's 4
            // below.
            for line in 0..QS / 64 {
                prefetch(rec, ahead + 64 * line, hint);
            }
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(D) as *const _));
            let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(DMIN) as *const _));
            for j in 0..SUBS {
                let s = b * SUBS + j;
                let tile = rec.add(QS + j * TILE_BYTES);
                for line in 0..TILE_BYTES / 64 {
                    prefetch(tile, ahead + 64 * line, hint);
                }
                let v: [__m512i; 4] =
                    std::array::from_fn(|g| _mm512_loadu_si512(tile.add(g * 64) as *const _));
                let lo = v.map(|v| _mm512_and_si512(v, low));
                let hi = v.map(|v| _mm512_and_si512(_mm512_srli_epi16::<4>(v), low));
                let widen = |bytes: *const u8| {
                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(bytes as *const _)))
                };
                let scale = _mm512_mul_ps(d, widen(rec.add(SC + j * TILE_ROWS)));
                let min = _mm512_mul_ps(dmin, widen(rec.add(M + j * TILE_ROWS)));
                for (i, sum) in sums.iter_mut().enumerate() {
                    let r = r0 + i;
                    let x = a.q.as_ptr().add(r * a.k + s * SUB);
                    let x4 =
                        |g: usize| _mm512_set1_epi32((x.add(g * 4) as *const i32).read_unaligned());
                    let mut s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], x4(0));
                    let mut s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[1], x4(1));
                    s0 = _mm512_dpbusd_epi32(s0, lo[2], x4(2));
                    s1 = _mm512_dpbusd_epi32(s1, lo[3], x4(3));
                    s0 = _mm512_dpbusd_epi32(s0, hi[0], x4(4));
                    s1 = _mm512_dpbusd_epi32(s1, hi[1], x4(5));
                    s0 = _mm512_dpbusd_epi32(s0, hi[2], x4(6));
                    s1 = _mm512_dpbusd_epi32(s1, hi[3], x4(7));
                    let blk = r * subs + s;
                    let dx = _mm512_set1_ps(*a.d.get_unchecked(blk));
                    let q = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
                    *sum = _mm512_fmadd_ps(q, _mm512_mul_ps(scale, dx), *sum);
                    let sx = _mm512_set1_ps(*input.sums.get_unchecked(blk));
                    *sum = _mm512_fnmadd_ps(min, sx, *sum);
                }
            }
        }
        for (o, sum) in acc.iter_mut().zip(sums) {
            _mm512_storeu_ps(o.as_mut_ptr(), sum);
        }
    }
}

/// The checks [`tile_vnni`] and [`tile_avx2`] make before reading without
/// bounds checks: tile `t` in `p`, rows `r0..r0 + rows` in `input`.
#[cfg(target_arch = "x86_64")]
fn check_tile(p: &PackedQ4K, input: &SummedActivations, t: usize, r0: usize, rows: usize) {
    let a = &input.acts;
    let (blocks, subs) = (p.k / BLOCK_VALUES, p.k / SUB);
    // `input.sums` has one value per block of `a` (its type's invariant),
    // so the rows' check covers it.
    assert!(
        a.k == p.k
            && (t + 1) * blocks * REC <= p.data.len()
            && (r0 + rows) * a.k <= a.q.len()
            && (r0 + rows) * subs <= a.d.len().min(input.sums.len()),
        "vl-q4k: tile {t} and rows {r0}..{} outside the weight ({}, {}) or x ({}, {})",
        r0 + rows,
        p.n,
        p.k,
        a.rows,
        a.k
    );
}

/// [`tile_vnni`] on AVX2: the nibbles are unsigned and small, so
/// `vpmaddubsw` (unsigned × signed bytes, pairs summed to 16 bits: at most
/// 15 · 127 · 2) and `vpmaddwd` give each row's exact integer sums, 8 rows
/// per 256-bit half; the scaling is [`tile_generic`]'s, so the result is
/// the same bit for bit.
///
/// # Panics
/// As [`tile_vnni`].
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const R: usize>(
    p: &PackedQ4K,
    input: &SummedActivations,
    t: usize,
    r0: usize,
    acc: &mut [[f32; TILE_ROWS]; R],
) {
    use std::arch::x86_64::*;
    check_tile(p, input, t, r0, R);
    let a = &input.acts;
    let (blocks, subs) = (p.k / BLOCK_VALUES, p.k / SUB);
    let tune = CpuFeatures::get().tuning;
    let (ahead, hint) = (tune.prefetch_ahead, tune.prefetch);
    // SAFETY: every offset below is within the tile `t` of `p` and the rows
    // `r0..r0 + R` of `a` (checked above).
    unsafe {
        let mut sums = [[_mm256_setzero_ps(); 2]; R];
        let low = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let recs = p.data.as_ptr().add(t * blocks * REC);
        for b in 0..blocks {
            let rec = recs.add(b * REC);
            for line in 0..QS / 64 {
                prefetch(rec, ahead + 64 * line, hint);
            }
            // The record's scalars, read as the plain tile reads them.
            let record = std::slice::from_raw_parts(rec, REC);
            let d: [f32; TILE_ROWS] = std::array::from_fn(|j| half_at(record, D, j));
            let dmin: [f32; TILE_ROWS] = std::array::from_fn(|j| half_at(record, DMIN, j));
            for j in 0..SUBS {
                let s = b * SUBS + j;
                let tile = rec.add(QS + j * TILE_BYTES);
                for line in 0..TILE_BYTES / 64 {
                    prefetch(tile, ahead + 64 * line, hint);
                }
                // Half `h`: group pair h / 2, rows 8(h % 2) .. +8.
                let v: [__m256i; 8] =
                    std::array::from_fn(|h| _mm256_loadu_si256(tile.add(h * 32) as *const _));
                let lo = v.map(|v| _mm256_and_si256(v, low));
                let hi = v.map(|v| _mm256_and_si256(_mm256_srli_epi16::<4>(v), low));
                let scale: [f32; TILE_ROWS] =
                    std::array::from_fn(|r| d[r] * record[SC + j * TILE_ROWS + r] as f32);
                let min: [f32; TILE_ROWS] =
                    std::array::from_fn(|r| dmin[r] * record[M + j * TILE_ROWS + r] as f32);
                let scale = [
                    _mm256_loadu_ps(scale.as_ptr()),
                    _mm256_loadu_ps(scale.as_ptr().add(8)),
                ];
                let min = [
                    _mm256_loadu_ps(min.as_ptr()),
                    _mm256_loadu_ps(min.as_ptr().add(8)),
                ];
                for (i, sum) in sums.iter_mut().enumerate() {
                    let r = r0 + i;
                    let x = a.q.as_ptr().add(r * a.k + s * SUB);
                    let x4 =
                        |g: usize| _mm256_set1_epi32((x.add(g * 4) as *const i32).read_unaligned());
                    let dot = |u: __m256i, x: __m256i| {
                        _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones)
                    };
                    let blk = r * subs + s;
                    let dx = _mm256_set1_ps(*a.d.get_unchecked(blk));
                    let sx = _mm256_set1_ps(*input.sums.get_unchecked(blk));
                    for (half, sum) in sum.iter_mut().enumerate() {
                        let mut q = _mm256_setzero_si256();
                        for g in 0..4 {
                            q = _mm256_add_epi32(q, dot(lo[2 * g + half], x4(g)));
                            q = _mm256_add_epi32(q, dot(hi[2 * g + half], x4(g + 4)));
                        }
                        let q = _mm256_cvtepi32_ps(q);
                        *sum = _mm256_fmadd_ps(q, _mm256_mul_ps(scale[half], dx), *sum);
                        *sum = _mm256_fnmadd_ps(min[half], sx, *sum);
                    }
                }
            }
        }
        for (o, [l, h]) in acc.iter_mut().zip(sums) {
            _mm256_storeu_ps(o.as_mut_ptr(), l);
            _mm256_storeu_ps(o.as_mut_ptr().add(8), h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QMatMul;
    use candle_core::Module;

    fn isas() -> Vec<Q8Isa> {
        CpuFeatures::get().q8_isas()
    }

    fn weight(n: usize, k: usize, seed: usize) -> Tensor {
        let w: Vec<f32> = (0..n * k)
            .map(|i| (((i * 7919 + seed * 104729) % 2003) as f32 / 2003.0 - 0.45) * 0.2)
            .collect();
        Tensor::from_vec(w, (n, k), &Device::Cpu).expect("weight")
    }

    fn x(rows: usize, k: usize) -> Tensor {
        let x: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 31 % 97) as f32 - 48.0) / 17.0)
            .collect();
        Tensor::from_vec(x, (rows, k), &Device::Cpu).expect("x")
    }

    /// The AVX2 tile gives the bits of the plain tile with fused
    /// multiply-adds (what the compiler made of it for AVX2 before).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx2_tile_is_the_plain_one_bit_for_bit() -> candle_core::Result<()> {
        use crate::kernels::features::Isa;
        use crate::kernels::gemv_q8::Activations;
        if CpuFeatures::get().q8_isa_for(Q8Simd::Avx2).is_none() {
            return Ok(());
        }
        let (n, k, rows) = (37, 512, 3);
        let p = PackedQ4K::quantize(&weight(n, k, 5))?;
        let xs: Vec<f32> = x(rows, k).flatten_all()?.to_vec1()?;
        let a = Activations::new(Isa::portable(), &xs, rows, k).with_sums();
        for t in 0..n.div_ceil(TILE_ROWS) {
            let mut want = [[0f32; TILE_ROWS]; 3];
            tile_generic::<crate::kernels::micro::Fma, 3>(&p, &a, t, 0, &mut want);
            let mut got = [[0f32; TILE_ROWS]; 3];
            // SAFETY: checked above that the CPU has AVX2 and FMA.
            unsafe { tile_avx2::<3>(&p, &a, t, 0, &mut got) };
            assert_eq!(got, want, "tile {t}");
        }
        Ok(())
    }

    /// The packing keeps candle's blocks: dequantized, the packed weight
    /// is candle's dequantization of `QTensor::quantize`'s bytes, bit for
    /// bit, from the weight or from those bytes; padding rows are not
    /// there.
    #[test]
    fn packing_keeps_candles_weights() -> candle_core::Result<()> {
        for (n, k) in [(16, 256), (37, 512), (3, 768), (1, 256)] {
            let w = weight(n, k, n);
            let q = QTensor::quantize(&w, GgmlDType::Q4K)?;
            let want = q
                .dequantize(&Device::Cpu)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            for p in [PackedQ4K::quantize(&w)?, PackedQ4K::from_qtensor(&q)?] {
                assert_eq!(p.dims(), (n, k));
                let got = p.dequantize()?.flatten_all()?.to_vec1::<f32>()?;
                assert_eq!(got, want, "({n}, {k})");
                // And back to candle's bytes, scales' bit packing included.
                assert!(p.to_blocks() == *q.data()?, "({n}, {k}): blocks differ");
            }
        }
        Ok(())
    }

    /// Every instruction set and every number of rows against an f64
    /// product of the dequantized weight and `x` as the kernel rounds it
    /// (q8_0 per 32): the only differences left are f32 sums, within
    /// 1e-4 relative to the row's scale; and within the rounding of `x`
    /// of the f32 product (3% of the output's scale). Bias added.
    #[test]
    fn products_match_f64_on_every_isa() -> anyhow::Result<()> {
        for (n, k, rows) in [
            (37, 512, 1),
            (16, 256, 3),
            (50, 768, 9),
            (5, 256, 70),
            (40, 256, 600),
        ] {
            let w = weight(n, k, 3);
            let bias = Tensor::arange(0f32, n as f32, &Device::Cpu)?.affine(0.01, -0.1)?;
            let p = PackedQ4K::quantize(&w)?.with_bias(Some(&bias))?;
            let wd = p.dequantize()?.to_vec2::<f32>()?;
            let xs = x(rows, k);
            let xv = xs.to_vec2::<f32>()?;
            let b = bias.to_vec1::<f32>()?;
            // x as the kernels round it.
            let flat: Vec<f32> = xv.concat();
            let a = crate::kernels::gemv_q8::Activations::new(
                crate::kernels::Isa::portable(),
                &flat,
                rows,
                k,
            );
            for isa in isas() {
                let y = p.matmul_with(isa, &xs)?.to_vec2::<f32>()?;
                assert_eq!((y.len(), y[0].len()), (rows, n));
                for r in 0..rows {
                    let scale = xv[r].iter().map(|v| v.abs()).sum::<f32>() as f64 * 0.02;
                    for c in 0..n {
                        let mut rounded = 0f64;
                        let mut exact = 0f64;
                        for i in 0..k {
                            let xq = a.q[r * k + i] as f64 * a.d[r * k / 32 + i / 32] as f64;
                            rounded += wd[c][i] as f64 * xq;
                            exact += wd[c][i] as f64 * xv[r][i] as f64;
                        }
                        let got = (y[r][c] - b[c]) as f64;
                        assert!(
                            (got - rounded).abs() <= 1e-4 * scale + 1e-6,
                            "{isa:?} ({n}, {k}) row {r} col {c}: {got} vs {rounded}"
                        );
                        assert!(
                            (got - exact).abs() <= 0.03 * scale,
                            "{isa:?} ({n}, {k}) row {r} col {c}: {got} vs f32 {exact}"
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Close to candle's own q4_K product of the same blocks (which rounds
    /// `x` per 256 values): within 2% of the output's scale.
    #[test]
    fn products_agree_with_candles() -> anyhow::Result<()> {
        let (n, k, rows) = (64, 768, 2);
        let w = weight(n, k, 5);
        let q = QTensor::quantize(&w, GgmlDType::Q4K)?;
        let p = PackedQ4K::from_qtensor(&q)?;
        let xs = x(rows, k);
        let want = QMatMul::from_qtensor(q)?.forward(&xs)?.to_vec2::<f32>()?;
        let got = p.matmul(&xs)?.to_vec2::<f32>()?;
        for r in 0..rows {
            let scale = xs.get(r)?.abs()?.sum_all()?.to_scalar::<f32>()? * 0.02;
            for c in 0..n {
                assert!(
                    (got[r][c] - want[r][c]).abs() <= 0.02 * scale,
                    "row {r} col {c}: {} vs candle {}",
                    got[r][c],
                    want[r][c]
                );
            }
        }
        Ok(())
    }

    /// Bad input is named: a width that is not whole blocks, a tensor of
    /// another format, an `x` of another width.
    #[test]
    fn bad_input_is_named() -> candle_core::Result<()> {
        let e = PackedQ4K::quantize(&weight(4, 100, 0))
            .unwrap_err()
            .to_string();
        assert!(e.contains("vl-q4k") && e.contains("[4, 100]"), "{e}");
        let q8 = QTensor::quantize(&weight(4, 256, 0), GgmlDType::Q8_0)?;
        let e = PackedQ4K::from_qtensor(&q8).unwrap_err().to_string();
        assert!(e.contains("q4_K") && e.contains("Q8_0"), "{e}");
        let p = PackedQ4K::quantize(&weight(4, 256, 0))?;
        let e = p.matmul(&x(1, 512)).unwrap_err().to_string();
        assert!(
            e.contains("vl-q4k") && e.contains("(..., 256)") && e.contains("[1, 512]"),
            "{e}"
        );
        let e = p
            .with_bias(Some(&Tensor::zeros(5, DType::F32, &Device::Cpu)?))
            .unwrap_err()
            .to_string();
        assert!(e.contains("vl-q4k: a bias (4)") && e.contains("[5]"), "{e}");
        Ok(())
    }

    /// The bytes held are [`PackedQ4K::BYTES_PER_WEIGHT`] per weight.
    #[test]
    fn bytes_per_weight_is_what_is_held() -> candle_core::Result<()> {
        let p = PackedQ4K::quantize(&weight(48, 512, 1))?;
        assert_eq!(
            p.size_in_bytes() as f64,
            48.0 * 512.0 * PackedQ4K::BYTES_PER_WEIGHT
        );
        assert_eq!(PackedQ4K::BYTES_PER_WEIGHT, 4.625 / 8.0);
        Ok(())
    }
}
