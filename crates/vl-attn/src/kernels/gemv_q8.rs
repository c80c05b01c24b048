//! vl's q8_0 products on the CPU: `y = x W^T` with `W (n, k)` quantized
//! to q8_0 (per 32 weights, an f16 scale `max|w| / 127` and 32 `i8`, as
//! candle and ggml quantize) and packed once, at load, into tiles of 16
//! rows, for any number of rows of `x` — a decode step, beams, a prefill,
//! an encoder.
//!
//! Why vl owns it: candle's x86 q8_0 product repacks each weight into
//! tiles on first use and keeps them beside the blocks it was given (two
//! copies of every weight), runs on a thread pool of its own whose worker
//! spins between products while vl's pool computes everything else (on
//! two cores a fifth of a decode step went to that spinning), and rounds
//! `x` per 256 values. A [`PackedQ8`] is the only copy of its weight, its
//! products run on the rayon pool (the process's one pool, sized by
//! `--threads`), and `x` is rounded per 32 values (ggml's q8_0 × q8_0).
//!
//! The layout: for each tile of 16 rows and each block of 32 columns, 512
//! bytes `[group of 4 columns (8)][row (16)][4 bytes]` holding `w + 128`
//! (unsigned), and the 16 rows' f16 scales apart. One AVX-512 VNNI
//! `vpdpbusd` multiplies a group (16 rows × 4 columns) by 4 values of `x`
//! broadcast, so 8 of them give a block's 16 integer dot products; each
//! lane starts at `-128 × Σx` of the block, which takes the offset back.
//! The integer sums are exact; `scale_w · scale_x · sum` accumulates in
//! f32. Every output is computed the same way whatever the number of
//! rows, so a decode step equals the full pass bit for bit.
//!
//! Many rows (an encoder's, a prefill's) take two tiles at once on VNNI
//! (`tile_pair_vnni`: each broadcast of `x` serves 32 outputs, and the
//! kernel adds the bias and stores from its registers), and a product may
//! apply a GELU as it stores ([`PackedQ8::matmul_gelu`]) — both with the
//! same values, bit for bit.
//!
//! The instruction set is chosen once per process ([`CpuFeatures::q8_isa`]): AVX-512
//! VNNI intrinsics, or the same arithmetic in plain Rust compiled for
//! AVX2+FMA or for the target's baseline. Every path is tested against an
//! f64 reference on odd shapes.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use half::f16;
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::features::Simd;
use super::features::{CpuFeatures, Isa, Q8Isa, Q8Simd};
use crate::kernels::aligned::CacheAligned;
#[cfg(target_arch = "x86_64")]
use crate::kernels::gemv::prefetch;
use crate::kernels::host::{leaf_len, zeroed};
use crate::kernels::micro::{madd, Kernel};
use crate::kernels::q8_amx;

/// Values per q8_0 block.
pub const BLOCK_VALUES: usize = 32;
/// Bytes per q8_0 block in candle's format: an f16 scale and 32 `i8`.
const BLOCK_BYTES: usize = 34;
/// Rows per tile (the lanes of an AVX-512 register of i32).
pub(crate) const TILE_ROWS: usize = 16;
/// Bytes per tile and block.
const TILE_BYTES: usize = TILE_ROWS * BLOCK_VALUES;
/// Rows of `x` per block of a many-row product (64 rows of 3072 values
/// and their scales: a share of L2), so that `x` stays in cache while a
/// task's weights pass by.
const ROW_BLOCK: usize = 64;
/// Rows of `x` per call of the two-tile kernel ([`tile_pair_vnni`]): its
/// 2 × 6 integer and 2 × 6 f32 accumulators, the two tiles' group and the
/// broadcast value take 27 of the 32 registers. A chunk of
/// [`ffn_tiled`]'s rows is a multiple of it.
const PAIR_ROWS: usize = 6;
/// Rows of a row block from which its products take the two-tile kernel.
const PAIR_MIN_ROWS: usize = 32;
/// Rows of `x` per call of the one-tile VNNI kernel ([`tile_vnni`]): 16
/// f32 sums and the tile's 8 groups take 24 of the 32 registers. A
/// server's 9–16-row decode batch then reads each tile once, streaming
/// the weight while it multiplies; in two calls of 8 rows the second
/// read it from cache with the memory idle (a 16-row vit-gpt2 q8_0 step
/// took ~8% less, AMD EPYC Zen 4).
#[cfg(target_arch = "x86_64")]
const VNNI_TILE_ROWS: usize = 16;
/// Rows of a [`tile_vnni`] call from which each row's block is one
/// `vpdpbusd` chain: that many independent chains cover the instruction's
/// latency, and the second chain's closing add is saved. Fewer rows (a
/// single request's step) split each row in two chains.
#[cfg(target_arch = "x86_64")]
const CHAINED_ROWS: usize = 4;
/// The most rows of `x` any kernel takes per call of
/// [`Tiled::accumulate`]: the widest call [`rows_by_tiles`] makes.
const MOST_TILE_ROWS: usize = 16;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(VNNI_TILE_ROWS <= MOST_TILE_ROWS);

/// A q8_0 weight `(n, k)` packed for vl's kernels (see the module's
/// documentation): `n` rounded up to tiles of 16 rows, the padding rows
/// zero and never computed.
#[derive(Debug)]
pub struct PackedQ8 {
    n: usize,
    k: usize,
    /// `(tiles, k / 32)` tiles of [`TILE_BYTES`]: `w + 128`, from a
    /// cache line (the kernels load them 64 bytes at a time).
    qs: CacheAligned<u8>,
    /// `(tiles, k / 32, 16)` f16 scales, as bits.
    d: Vec<u16>,
    /// The layer's bias, added as the outputs are stored.
    bias: Option<Vec<f32>>,
}

impl PackedQ8 {
    /// Quantizes `w (n, k)` (on the CPU, `k` a multiple of 32) to q8_0
    /// as candle does (per 32 weights, scale `max|w| / 127` in f16, values
    /// `round(w / scale)`), straight into the packed layout: no second
    /// copy of the weight, tiles on the pool.
    ///
    /// # Errors
    /// A weight that is not 2-D, not on the CPU, or of a width that is not
    /// a multiple of 32, named with its shape.
    pub fn quantize(w: &Tensor) -> candle_core::Result<Self> {
        let (n, k) = w.dims2()?;
        if !w.device().is_cpu() || !k.is_multiple_of(BLOCK_VALUES) {
            candle_core::bail!(
                "vl-q8_0: packs a weight (n, k * 32) on the CPU; got {:?} on {:?}",
                w.dims(),
                w.device()
            );
        }
        crate::kernels::with_values(&w.to_dtype(DType::F32)?, |values: &[f32]| {
            Self::pack(values, n, k)
        })
    }

    /// The packing of [`PackedQ8::quantize`], from `(n, k)` row-major
    /// values.
    fn pack(values: &[f32], n: usize, k: usize) -> Self {
        let blocks = k / BLOCK_VALUES;
        let tiles = n.div_ceil(TILE_ROWS);
        let mut qs = CacheAligned::filled(tiles * blocks * TILE_BYTES, 128u8);
        let mut d = vec![0u16; tiles * blocks * TILE_ROWS];
        if blocks > 0 {
            qs.par_chunks_mut(blocks * TILE_BYTES)
                .zip(d.par_chunks_mut(blocks * TILE_ROWS))
                .enumerate()
                .for_each(|(t, (qs, d))| {
                    let rows = TILE_ROWS.min(n - t * TILE_ROWS);
                    let values = &values[t * TILE_ROWS * k..][..rows * k];
                    pack_tile_on(CpuFeatures::get().isa(), values, k, qs, d);
                });
        }
        Self {
            n,
            k,
            qs,
            d,
            bias: None,
        }
    }

    /// Packs candle's q8_0 blocks (the weight of a GGUF file, say).
    ///
    /// # Errors
    /// A tensor not q8_0 `(n, k)` on the CPU, named.
    pub fn from_qtensor(q: &QTensor) -> candle_core::Result<Self> {
        let (n, k) = q.shape().dims2()?;
        if q.dtype() != GgmlDType::Q8_0 || !q.device().is_cpu() {
            candle_core::bail!(
                "vl-q8_0: packs a q8_0 weight on the CPU; got {:?} ({n}, {k})",
                q.dtype()
            );
        }
        let bytes = q.data()?;
        let blocks = k / BLOCK_VALUES;
        if bytes.len() != n * blocks * BLOCK_BYTES {
            candle_core::bail!(
                "vl-q8_0: a q8_0 weight of {} bytes for ({n}, {k})",
                bytes.len()
            );
        }
        let tiles = n.div_ceil(TILE_ROWS);
        // Padding rows: weight 0 (128 unsigned), scale 0.
        let mut qs = CacheAligned::filled(tiles * blocks * TILE_BYTES, 128u8);
        let mut d = vec![0u16; tiles * blocks * TILE_ROWS];
        for row in 0..n {
            let (t, j) = (row / TILE_ROWS, row % TILE_ROWS);
            for b in 0..blocks {
                let src = &bytes[(row * blocks + b) * BLOCK_BYTES..][..BLOCK_BYTES];
                let tb = t * blocks + b;
                d[tb * TILE_ROWS + j] = u16::from_le_bytes([src[0], src[1]]);
                let tile = &mut qs[tb * TILE_BYTES..][..TILE_BYTES];
                for (v, &byte) in src[2..].iter().enumerate() {
                    let (g, c) = (v / 4, v % 4);
                    tile[(g * TILE_ROWS + j) * 4 + c] = (byte as i8 as i16 + 128) as u8;
                }
            }
        }
        Ok(Self {
            n,
            k,
            qs,
            d,
            bias: None,
        })
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
        self.qs.len() + 2 * self.d.len()
    }

    /// The blocks in candle's (ggml's) q8_0 layout, row by row: per block
    /// the f16 scale (little-endian), then 32 signed bytes — what
    /// [`PackedQ8::from_qtensor`] packs, byte for byte.
    pub fn to_blocks(&self) -> Vec<u8> {
        let blocks = self.k / BLOCK_VALUES;
        let mut out = vec![0u8; self.n * blocks * BLOCK_BYTES];
        for row in 0..self.n {
            let (t, j) = (row / TILE_ROWS, row % TILE_ROWS);
            for b in 0..blocks {
                let dst = &mut out[(row * blocks + b) * BLOCK_BYTES..][..BLOCK_BYTES];
                let tb = t * blocks + b;
                dst[..2].copy_from_slice(&self.d[tb * TILE_ROWS + j].to_le_bytes());
                let tile = &self.qs[tb * TILE_BYTES..][..TILE_BYTES];
                for (v, byte) in dst[2..].iter_mut().enumerate() {
                    let (g, c) = (v / 4, v % 4);
                    *byte = (tile[(g * TILE_ROWS + j) * 4 + c] as i16 - 128) as i8 as u8;
                }
            }
        }
        out
    }

    /// The weight the blocks stand for, `(n, k)` f32 (exactly candle's
    /// dequantization of the same blocks).
    pub fn dequantize(&self) -> candle_core::Result<Tensor> {
        let blocks = self.k / BLOCK_VALUES;
        let mut w = vec![0f32; self.n * self.k];
        for (row, wr) in w.chunks_exact_mut(self.k.max(1)).enumerate() {
            let (t, j) = (row / TILE_ROWS, row % TILE_ROWS);
            for b in 0..blocks {
                let tb = t * blocks + b;
                let s = f16::from_bits(self.d[tb * TILE_ROWS + j]).to_f32();
                let tile = &self.qs[tb * TILE_BYTES..][..TILE_BYTES];
                for (v, o) in wr[b * BLOCK_VALUES..][..BLOCK_VALUES]
                    .iter_mut()
                    .enumerate()
                {
                    let (g, c) = (v / 4, v % 4);
                    *o = (tile[(g * TILE_ROWS + j) * 4 + c] as i32 - 128) as f32 * s;
                }
            }
        }
        Tensor::from_vec(w, (self.n, self.k), &Device::Cpu)
    }

    /// `x W^T` (plus the bias, if any) on this CPU's best [`Q8Isa`].
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

    /// [`PackedQ8::matmul`] on a given implementation (tests compare
    /// them; the token proves the CPU runs it).
    ///
    /// # Errors
    /// As [`PackedQ8::matmul`].
    pub fn matmul_with(&self, isa: Q8Isa, x: &Tensor) -> candle_core::Result<Tensor> {
        matmul_tiled(self, isa, x)
    }

    /// `GELU(x W^T + b)` (exact when `exact`, else the tanh form) in f32:
    /// [`PackedQ8::matmul`] and [`crate::Activation`]'s GELU on
    /// f32, bit for bit, with the GELU applied as the product stores its
    /// outputs — an encoder's hidden layer is not written out and read
    /// back between the two.
    ///
    /// # Errors
    /// As [`PackedQ8::matmul`].
    pub fn matmul_gelu(&self, x: &Tensor, exact: bool) -> candle_core::Result<Tensor> {
        matmul_tiled_then(self, CpuFeatures::get().q8_isa(), x, Some(exact))
    }
}

impl Tiled for PackedQ8 {
    const NAME: &'static str = "vl-q8_0";
    type Input = Activations;

    fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    fn bias_values(&self) -> Option<&[f32]> {
        self.bias.as_deref()
    }

    fn q8_tile(&self, t: usize) -> Option<(&[u8], &[u16])> {
        let blocks = self.k / BLOCK_VALUES;
        Some((
            &self.qs[t * blocks * TILE_BYTES..][..blocks * TILE_BYTES],
            &self.d[t * blocks * TILE_ROWS..][..blocks * TILE_ROWS],
        ))
    }

    #[inline(always)]
    fn accumulate<const R: usize>(
        &self,
        isa: Q8Isa,
        a: &Activations,
        t: usize,
        r0: usize,
        acc: &mut [[f32; TILE_ROWS]; R],
    ) {
        match isa.simd() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves AVX-512F, BW and VNNI.
            Q8Simd::Amx | Q8Simd::Vnni => unsafe {
                tile_vnni::<R, OutPtr>(self, a, t, r0, Sums::Acc(acc))
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves AVX2 and FMA.
            Q8Simd::Avx2 => unsafe { tile_avx2(self, a, t, r0, acc) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: the token proves NEON and the dot-product extension.
            Q8Simd::NeonDot => unsafe { tile_neon_dot(self, a, t, r0, acc) },
            _ => tile_plain(isa.f32_isa(), self, a, t, r0, acc),
        }
    }

    fn tile_rows(&self, isa: Q8Isa) -> usize {
        match isa.simd() {
            #[cfg(target_arch = "x86_64")]
            Q8Simd::Amx | Q8Simd::Vnni => VNNI_TILE_ROWS,
            _ => 8,
        }
    }

    fn pair_rows(&self, isa: Q8Isa) -> usize {
        match isa.simd() {
            #[cfg(target_arch = "x86_64")]
            Q8Simd::Amx | Q8Simd::Vnni => PAIR_ROWS,
            _ => 0,
        }
    }

    #[inline(always)]
    unsafe fn pair_store<const R: usize, O: Out>(
        &self,
        isa: Q8Isa,
        a: &Activations,
        t: usize,
        r0: usize,
        out: &O,
        gelu: Option<bool>,
    ) {
        match isa.simd() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves AVX-512F, BW and VNNI; the
            // caller's contract is `tile_pair_vnni`'s.
            Q8Simd::Amx | Q8Simd::Vnni => unsafe {
                tile_pair_vnni::<R, O>(self, a, t, r0, out, gelu)
            },
            // SAFETY: the caller's contract.
            _ => unsafe { pair_apart::<Self, R, O>(self, isa, a, t, r0, out, gelu) },
        }
    }

    #[inline(always)]
    unsafe fn tile_store<const R: usize, O: Out>(
        &self,
        isa: Q8Isa,
        a: &Activations,
        t: usize,
        r0: usize,
        out: &O,
        gelu: Option<bool>,
    ) {
        match isa.simd() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves AVX-512F, BW and VNNI; the
            // caller's contract is `tile`'s, which `tile_vnni` stores by.
            Q8Simd::Amx | Q8Simd::Vnni => unsafe {
                tile_vnni::<R, O>(self, a, t, r0, Sums::Out(out, gelu))
            },
            // SAFETY: the caller's contract.
            _ => unsafe { tile_cold::<Self, R, O>(self, isa, a, t, r0, out, gelu) },
        }
    }
}

/// [`tile`] as a call of its own, so that the compiler does not hoist
/// its address arithmetic for each row count into every tile's loop (4%
/// of a 16-row q8_0 decode step went to that setup, for the path of the
/// other instruction sets, unused).
///
/// # Safety
/// As [`tile`].
#[inline(never)]
unsafe fn tile_cold<P: Tiled, const R: usize, O: Out>(
    p: &P,
    isa: Q8Isa,
    a: &P::Input,
    t: usize,
    r0: usize,
    out: &O,
    gelu: Option<bool>,
) {
    // SAFETY: the caller's contract.
    unsafe { tile::<P, R, O>(p, isa, a, t, r0, out, gelu) }
}

/// A weight `(n, k)` packed in tiles of [`TILE_ROWS`] rows whose products
/// take `x` rounded to q8_0 ([`Tiled::Input`]): [`PackedQ8`], and
/// [`crate::kernels::gemv_q4k::PackedQ4K`]. [`matmul_tiled`] does the rest: the
/// checks, the rounding, the split across the pool, the bias, the stores.
pub(crate) trait Tiled: Sync {
    /// The kernel's name in errors.
    const NAME: &'static str;
    /// What its products read of `x`: [`Activations`], or
    /// [`SummedActivations`] when they need the blocks' sums too. The type
    /// carries what the kernel reads, so no kernel can be handed less.
    type Input: RoundedInput;
    /// `(n, k)`.
    fn dims(&self) -> (usize, usize);
    /// The layer's bias, `(n)`.
    fn bias_values(&self) -> Option<&[f32]>;
    /// `acc[i][j] = Σ` over `k` of row `r0 + i` of `x` times row
    /// `16 t + j` of the weight (the padding rows' lanes are unused).
    ///
    /// # Panics
    /// If `t` is not a tile of the weight, rows `r0..r0 + R` do not exist
    /// in `a` or `a`'s width is not the weight's: callers iterate over
    /// both, so that never happens.
    fn accumulate<const R: usize>(
        &self,
        isa: Q8Isa,
        a: &Self::Input,
        t: usize,
        r0: usize,
        acc: &mut [[f32; TILE_ROWS]; R],
    );
    /// Rows of `x` at most per call of [`Tiled::accumulate`] on `isa`:
    /// as many as its kernel keeps the sums of in registers, up to
    /// [`MOST_TILE_ROWS`].
    fn tile_rows(&self, isa: Q8Isa) -> usize {
        let _ = isa;
        8
    }
    /// Rows of `x` per call of [`Tiled::pair_store`] on `isa` in a
    /// many-row product, or 0 where two tiles at once are no faster than
    /// one at a time.
    fn pair_rows(&self, isa: Q8Isa) -> usize {
        let _ = isa;
        0
    }
    /// Tiles `t` and `t + 1` against rows `r0..r0 + R`, plus the bias,
    /// through the GELU if asked, stored in `out`: the values of
    /// [`Tiled::accumulate`] and [`store`], bit for bit, from a kernel
    /// that reads each value of `x` once for both tiles and stores from
    /// its registers.
    ///
    /// # Panics
    /// As [`Tiled::accumulate`], for tile `t + 1` too.
    ///
    /// # Safety
    /// As [`tile`], for both tiles.
    #[inline(always)]
    unsafe fn pair_store<const R: usize, O: Out>(
        &self,
        isa: Q8Isa,
        a: &Self::Input,
        t: usize,
        r0: usize,
        out: &O,
        gelu: Option<bool>,
    ) where
        Self: Sized,
    {
        // SAFETY: the caller's contract.
        unsafe { pair_apart::<Self, R, O>(self, isa, a, t, r0, out, gelu) }
    }
    /// Tile `t` against rows `r0..r0 + R`, plus the bias, through the
    /// GELU if asked, stored in `out`: [`tile`], which a kernel may do
    /// from its registers rather than through [`Tiled::accumulate`]'s
    /// array (a 16-row decode step's tiles each went through 1 KiB of
    /// stack: zeroed, stored, read back). By default [`tile`] as a call
    /// of its own ([`tile_cold`]): inlined into [`rows_by_tiles`]'s 16
    /// row counts, its address arithmetic was hoisted into every tile
    /// (a vit-gpt2 q4_K decode step took 3.4 against 3.7 ms out of line,
    /// medians of 7 interleaved rounds; its 197-row encode 4% longer).
    ///
    /// # Panics
    /// As [`Tiled::accumulate`].
    ///
    /// # Safety
    /// As [`tile`].
    #[inline(always)]
    unsafe fn tile_store<const R: usize, O: Out>(
        &self,
        isa: Q8Isa,
        a: &Self::Input,
        t: usize,
        r0: usize,
        out: &O,
        gelu: Option<bool>,
    ) where
        Self: Sized,
    {
        // SAFETY: the caller's contract.
        unsafe { tile_cold::<Self, R, O>(self, isa, a, t, r0, out, gelu) }
    }
    /// Tile `t`'s q8_0 blocks as packed (`k / 32` blocks of
    /// [`TILE_BYTES`], then their `16 · k / 32` f16 scales as bits), for
    /// a kernel that widens them ([`crate::kernels::q8_amx`]); `None`
    /// for weights of another format (all of a type answer alike).
    ///
    /// # Panics
    /// If `t` is not a tile of the weight.
    fn q8_tile(&self, t: usize) -> Option<(&[u8], &[u16])> {
        let _ = t;
        None
    }
    /// Tile `t`'s bias (its columns' values), if the layer has one.
    ///
    /// # Panics
    /// If `t` is not a tile of the weight.
    #[cfg(target_arch = "x86_64")]
    fn tile_bias(&self, t: usize) -> Option<&[f32]> {
        let n = self.dims().0;
        let b = self.bias_values()?;
        Some(&b[t * TILE_ROWS..n.min((t + 1) * TILE_ROWS)])
    }
}

/// Rows of `x` rounded to q8_0 as a [`Tiled`] product reads them.
pub(crate) trait RoundedInput: Sync + Sized {
    /// Rounds `x (rows, k)` on `isa`, rows split across the pool.
    fn round(isa: Isa, x: &[f32], rows: usize, k: usize) -> Self;
    /// [`RoundedInput::round`] on the calling thread alone.
    fn round_here(isa: Isa, x: &[f32], rows: usize, k: usize) -> Self;
    /// The rounded values and scales.
    fn activations(&self) -> &Activations;
}

impl RoundedInput for Activations {
    fn round(isa: Isa, x: &[f32], rows: usize, k: usize) -> Self {
        Activations::new(isa, x, rows, k)
    }

    fn round_here(isa: Isa, x: &[f32], rows: usize, k: usize) -> Self {
        Activations::new_here(isa, x, rows, k)
    }

    fn activations(&self) -> &Activations {
        self
    }
}

impl RoundedInput for SummedActivations {
    fn round(isa: Isa, x: &[f32], rows: usize, k: usize) -> Self {
        Activations::new(isa, x, rows, k).with_sums()
    }

    fn round_here(isa: Isa, x: &[f32], rows: usize, k: usize) -> Self {
        Activations::new_here(isa, x, rows, k).with_sums()
    }

    fn activations(&self) -> &Activations {
        &self.acts
    }
}

/// A layer's bias `(n)` (any float dtype, on the CPU) for a [`Tiled`]
/// weight of `dims` `(n, k)`, as the f32 values its kernels add when they
/// store; any other bias is named in the error.
pub(crate) fn checked_bias<P: Tiled>(
    (n, k): (usize, usize),
    bias: Option<&Tensor>,
) -> candle_core::Result<Option<Vec<f32>>> {
    match bias {
        None => Ok(None),
        Some(b) if b.dims() == [n] && b.device().is_cpu() => {
            Ok(Some(b.to_dtype(DType::F32)?.to_vec1::<f32>()?))
        }
        Some(b) => candle_core::bail!(
            "{}: a bias ({n}) on the CPU for a weight ({n}, {k}); got {:?} on {:?}",
            P::NAME,
            b.dims(),
            b.device()
        ),
    }
}

/// A bias held as f32 values, as a tensor `(n)`.
pub(crate) fn bias_tensor(bias: Option<&[f32]>) -> candle_core::Result<Option<Tensor>> {
    bias.map(|b| Tensor::from_slice(b, b.len(), &Device::Cpu))
        .transpose()
}

/// `x W^T` (plus the bias, if any) for `x: (..., k)` f32, f16 or bf16 on
/// the CPU, any number of rows → `(..., n)` f32, on `isa`.
///
/// # Errors
/// An `x` of another width, not on the CPU or of an integer dtype, and an
/// `isa` this CPU does not support, named.
pub(crate) fn matmul_tiled<P: Tiled>(p: &P, isa: Q8Isa, x: &Tensor) -> candle_core::Result<Tensor> {
    matmul_tiled_then(p, isa, x, None)
}

/// [`matmul_tiled`], then a GELU (exact when `gelu` is `Some(true)`, tanh
/// when `Some(false)`) applied to each output before it is stored: the
/// bits of the two steps apart, without writing the product out and
/// reading it back.
///
/// # Errors
/// As [`matmul_tiled`].
pub(crate) fn matmul_tiled_then<P: Tiled>(
    p: &P,
    isa: Q8Isa,
    x: &Tensor,
    gelu: Option<bool>,
) -> candle_core::Result<Tensor> {
    let n = p.dims().0;
    let rows = checked_rows(p, x)?;
    let dims = x.dims();
    let mut shape = dims[..dims.len() - 1].to_vec();
    shape.push(n);
    if rows == 0 || n == 0 {
        return Tensor::zeros(shape, DType::F32, x.device());
    }
    if q8_amx::takes(p, isa, x.dims()) {
        let y = crate::kernels::with_values(&x.to_dtype(DType::F32)?, |xs: &[f32]| {
            // SAFETY: `takes` said yes; the tasks store every tile of
            // every row, rows one after the other: all `rows · n` values.
            unsafe {
                written(rows * n, |ptr| {
                    q8_amx::product_into(p, isa, xs, rows, (gelu, None), &OutPtr(ptr))
                })
            }
        })?;
        return Tensor::from_vec(y, shape, x.device());
    }
    let y = product(p, isa, &rounded(p, isa, x, rows)?, gelu);
    Tensor::from_vec(y, shape, x.device())
}

/// `x W^T + b + residual` where the product runs on the tile unit
/// ([`q8_amx::takes`]), the residual `(..., n)` added as the sums are
/// stored: the bits of the product and then the addition (one f32
/// addition of the same two values), without a pass over the output.
/// `None` where the product runs elsewhere, or the residual is not f32 on
/// the CPU: the caller adds it after.
///
/// # Errors
/// As [`matmul_tiled`]; a residual of another shape than the product's,
/// named.
pub(crate) fn matmul_tiled_add<P: Tiled>(
    p: &P,
    isa: Q8Isa,
    x: &Tensor,
    residual: &Tensor,
) -> candle_core::Result<Option<Tensor>> {
    let n = p.dims().0;
    let rows = checked_rows(p, x)?;
    if !q8_amx::takes(p, isa, x.dims())
        || residual.dtype() != DType::F32
        || !residual.device().is_cpu()
    {
        return Ok(None);
    }
    let dims = x.dims();
    let mut shape = dims[..dims.len() - 1].to_vec();
    shape.push(n);
    if residual.dims() != shape.as_slice() {
        candle_core::bail!(
            "{}: a residual {:?} for a product {shape:?}",
            P::NAME,
            residual.dims()
        );
    }
    let x = x.to_dtype(DType::F32)?;
    let y = crate::kernels::with_values(&x, |xs: &[f32]| {
        crate::kernels::with_values(residual, |res: &[f32]| {
            // SAFETY: `takes` said yes; the tasks store every tile of
            // every row, rows one after the other: all `rows · n` values;
            // the residual is `(rows, n)` (checked).
            unsafe {
                written(rows * n, |ptr| {
                    q8_amx::product_into(p, isa, xs, rows, (None, Some(res)), &OutPtr(ptr))
                })
            }
        })
    })??;
    Ok(Some(Tensor::from_vec(y, shape, x.device())?))
}

/// The rows of `x (..., k)` for a product by `p`, or the error naming `x`
/// when it is of another width, not on the CPU or of an integer dtype.
fn checked_rows<P: Tiled>(p: &P, x: &Tensor) -> candle_core::Result<usize> {
    let (n, k) = p.dims();
    let dims = x.dims();
    if dims.last() != Some(&k)
        || !x.device().is_cpu()
        || !matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
    {
        candle_core::bail!(
            "{}: takes x (..., {k}) f32, f16 or bf16 on the CPU for a weight ({n}, {k}); got x {dims:?} {:?} on {:?}",
            P::NAME,
            x.dtype(),
            x.device()
        );
    }
    Ok(x.elem_count() / k.max(1))
}

/// `x`'s `rows` (checked by [`checked_rows`]) rounded for `p`'s kernels:
/// read in place where `x` is contiguous f32 (an encoder's activations: a
/// copy of them was 2.5% of a Florence-2 q8_0 encode).
fn rounded<P: Tiled>(p: &P, isa: Q8Isa, x: &Tensor, rows: usize) -> candle_core::Result<P::Input> {
    let k = p.dims().1;
    crate::kernels::with_values(&x.to_dtype(DType::F32)?, |xs: &[f32]| {
        P::Input::round(isa.f32_isa(), xs, rows, k)
    })
}

/// A vector of `len` values written by `fill` through the pointer it is
/// given — not zeroed first (a memset and, for a fresh buffer, its page
/// faults, before the kernels overwrite it).
///
/// # Safety
/// `fill` writes every one of the `len` values and no other.
unsafe fn written(len: usize, fill: impl FnOnce(*mut f32)) -> Vec<f32> {
    let mut y: Vec<f32> = Vec::with_capacity(len);
    fill(y.as_mut_ptr());
    // SAFETY: the caller's contract.
    unsafe { y.set_len(len) };
    y
}

/// `y (rows, n)`: tile columns split across the pool, each task writing
/// its own columns of every row.
fn product<P: Tiled>(p: &P, isa: Q8Isa, input: &P::Input, gelu: Option<bool>) -> Vec<f32> {
    let len = input.activations().rows * p.dims().0;
    // SAFETY: the tasks of `product_into` store every tile of every row,
    // rows one after the other: all `rows · n` values.
    unsafe { written(len, |ptr| product_into(p, isa, input, gelu, &OutPtr(ptr))) }
}

/// [`product`]'s work into `out`, split across the pool.
///
/// # Safety
/// `out`'s places for every row's every tile are disjoint and writable.
unsafe fn product_into<P: Tiled, O: Out>(
    p: &P,
    isa: Q8Isa,
    input: &P::Input,
    gelu: Option<bool>,
    out: &O,
) {
    let n = p.dims().0;
    let a = input.activations();
    let tiles = n.div_ceil(TILE_ROWS);
    let threads = rayon::current_num_threads().max(1);
    // A decode step's few rows: a few column tasks per thread. An
    // encoder's many rows: also split in chunks of rows, for about 16
    // tasks per thread — a core that falls behind (a shared machine's
    // cores do) then leaves the other waiting for at most a small task
    // (with 4 column tasks per thread, a seventh of a Florence-2 encode's
    // single-core time was the last tasks of its products).
    let mut per_task = tiles.div_ceil(threads * 4).max(1);
    if a.rows > ROW_BLOCK {
        // A task reads its tiles once per block of rows: keep them within
        // half a core's L2, so that the blocks after the first read them
        // from there (a stacked product of every layer's keys and values
        // had 144 tiles, 1.7 MB, a task).
        let l2 = CpuFeatures::get().l2_bytes.unwrap_or(1 << 20);
        per_task = per_task.min((l2 / 2 / (TILE_ROWS * a.k).max(1)).max(1));
    }
    let col_tasks = tiles.div_ceil(per_task);
    let row_chunk = if a.rows <= 4 * ROW_BLOCK {
        a.rows.max(1)
    } else {
        let chunks = (threads * 16).div_ceil(col_tasks);
        a.rows.div_ceil(chunks).next_multiple_of(ROW_BLOCK)
    };
    let tasks = col_tasks * a.rows.div_ceil(row_chunk);
    (0..tasks)
        .into_par_iter()
        .with_max_len(leaf_len(tasks))
        .for_each(|task| {
            let (rc, ct) = (task / col_tasks, task % col_tasks);
            let t0 = ct * per_task;
            let t1 = (t0 + per_task).min(tiles);
            let rows = rc * row_chunk..((rc + 1) * row_chunk).min(a.rows);
            for r0 in rows.clone().step_by(ROW_BLOCK) {
                let r1 = (r0 + ROW_BLOCK).min(rows.end);
                // SAFETY: tasks write disjoint blocks (tile columns
                // `t0..t1` of their chunk of rows) of `out`, which
                // outlives the loop.
                unsafe { rows_by_tiles(p, isa, input, t0..t1, r0..r1, out, gelu) };
            }
        });
}

/// `x W^T` (plus the bias, if any) for `x: (rows, k)` on the CPU into
/// a layout of the caller's: tile `t` (outputs `16 t ..`, up to 16) of row
/// `r` at `rows[r] + tiles[t]` of the `len` values returned — e.g. a
/// fused q/k/v projection straight to window attention's heads, with no
/// projection in token order to copy from.
///
/// # Errors
/// As [`matmul_tiled`], and tables of other lengths than `x`'s rows and
/// the weight's tiles, named.
///
/// # Safety
/// The places are disjoint, within `len` and together cover it (checked
/// in debug builds).
pub(crate) unsafe fn matmul_tiled_placed<P: Tiled>(
    p: &P,
    isa: Q8Isa,
    x: &Tensor,
    rows: &[usize],
    tiles: &[usize],
    len: usize,
) -> candle_core::Result<Vec<f32>> {
    let n = p.dims().0;
    let m = checked_rows(p, x)?;
    if rows.len() != m || tiles.len() != n.div_ceil(TILE_ROWS) {
        candle_core::bail!(
            "{}: a placed product takes {m} row places and {} tile places for x {:?} and a weight {:?}; got {} and {}",
            P::NAME,
            n.div_ceil(TILE_ROWS),
            x.dims(),
            p.dims(),
            rows.len(),
            tiles.len()
        );
    }
    #[cfg(debug_assertions)]
    {
        let mut seen = vec![false; len];
        for &r in rows {
            for (t, &c) in tiles.iter().enumerate() {
                let cols = (n - t * TILE_ROWS).min(TILE_ROWS);
                for s in &mut seen[r + c..][..cols] {
                    assert!(!*s, "two places overlap at {}", r + c);
                    *s = true;
                }
            }
        }
        assert!(seen.iter().all(|&s| s), "the places leave values unwritten");
    }
    if q8_amx::takes(p, isa, x.dims()) {
        return crate::kernels::with_values(&x.to_dtype(DType::F32)?, |xs: &[f32]| {
            // SAFETY: `takes` said yes; the caller's contract: the places
            // cover the `len` values.
            unsafe {
                written(len, |ptr| {
                    q8_amx::product_into(p, isa, xs, m, (None, None), &Placed { ptr, rows, tiles })
                })
            }
        });
    }
    let a = rounded(p, isa, x, m)?;
    // SAFETY: the caller's contract: the places cover the `len` values.
    Ok(unsafe {
        written(len, |ptr| {
            product_into(p, isa, &a, None, &Placed { ptr, rows, tiles })
        })
    })
}

/// The hidden layer's bytes a task of [`ffn_tiled`] keeps in f32: with
/// its rounded copy and the two weights' tiles it stays in a core's L2.
const FFN_HIDDEN_BYTES: usize = 192 * 1024;

/// `down(GELU(up(x)))` for an encoder's many rows, a chunk of rows per
/// task: the chunk is rounded, multiplied by `up` into a hidden layer
/// that stays in the task's cache (the GELU applied as it is stored),
/// rounded again and multiplied by `down` into its rows of the output.
/// The values are those of the two products apart ([`product`] with the
/// GELU, then without): every row is rounded and multiplied alike, only
/// the order of the work differs — but the hidden layer, up to 4× the
/// input's width, is neither written to memory in f32, read back to be
/// rounded, nor faulted in as a fresh buffer (the first stage of a
/// Florence-2 DaViT, 36,864 tokens × 512 hidden values, spent twice its
/// products' time on that traffic).
///
/// `None` where it does not pay: under 4 chunks per thread (a decode
/// step's rows read each weight once), or a hidden layer so wide that a
/// chunk of it in [`FFN_HIDDEN_BYTES`] is under [`PAIR_MIN_ROWS`] rows —
/// too few for the two-tile kernel, and too few to be worth reading both
/// weights again for (every chunk does).
pub(crate) fn ffn_tiled<U: Tiled, D: Tiled>(
    up: &U,
    down: &D,
    isa: Q8Isa,
    x: &Tensor,
    exact: bool,
) -> candle_core::Result<Option<Tensor>> {
    let ((hidden, k), (n, down_k)) = (up.dims(), down.dims());
    let dims = x.dims();
    if down_k != hidden {
        candle_core::bail!(
            "{}: the feed-forward's second weight ({n}, {down_k}) does not take the first's {hidden} outputs",
            D::NAME
        );
    }
    if dims.last() != Some(&k) || !x.device().is_cpu() || x.dtype() != DType::F32 {
        return Ok(None);
    }
    let rows = x.elem_count() / k.max(1);
    if q8_amx::takes(up, isa, dims) || q8_amx::takes(down, isa, dims) {
        // The products apart, on the tile unit (whose values a chunk
        // through VNNI would not give): each task keeps its widened tiles
        // and reads the rows from the L2 as they pass.
        return Ok(None);
    }
    let chunk = (FFN_HIDDEN_BYTES / (4 * hidden.max(1))) / PAIR_ROWS * PAIR_ROWS;
    let threads = rayon::current_num_threads().max(1);
    if chunk < PAIR_MIN_ROWS || rows < 4 * chunk * threads || n == 0 {
        return Ok(None);
    }
    let (up_tiles, down_tiles) = (hidden.div_ceil(TILE_ROWS), n.div_ceil(TILE_ROWS));
    let mut shape = dims[..dims.len() - 1].to_vec();
    shape.push(n);
    let y = crate::kernels::with_values(x, |xs: &[f32]| {
        // SAFETY: the chunks cover every row, and each task stores every
        // tile of `down` for its own rows (`c * chunk ..`) alone.
        unsafe {
            written(rows * n, |ptr| {
                let out = OutPtr(ptr);
                xs.par_chunks(chunk * k).enumerate().for_each(|(c, xs)| {
                    let rows_here = xs.len() / k;
                    let input = U::Input::round_here(isa.f32_isa(), xs, rows_here, k);
                    // The task's own `(rows_here, hidden)`: every tile of
                    // `up` stored for every row.
                    let h = written(rows_here * hidden, |h| {
                        let h = OutPtr(h);
                        rows_by_tiles(up, isa, &input, 0..up_tiles, 0..rows_here, &h, Some(exact))
                    });
                    let h = D::Input::round_here(isa.f32_isa(), &h, rows_here, hidden);
                    let mine = out.offset(c * chunk * n);
                    rows_by_tiles(down, isa, &h, 0..down_tiles, 0..rows_here, &mine, None);
                })
            })
        }
    })?;
    Ok(Some(Tensor::from_vec(y, shape, x.device())?))
}

/// Rows `rows` of `input` against tiles `tiles` of `p`, plus the bias,
/// through the GELU if asked, stored in `out`: two tiles at once where
/// the weight has a kernel for them and the rows are an encoder's many,
/// else one at a time — the same values either way.
///
/// # Safety
/// `out` is `(rows of input, n)` from its pointer on; no other thread
/// writes these tiles' columns of these rows meanwhile.
unsafe fn rows_by_tiles<P: Tiled, O: Out>(
    p: &P,
    isa: Q8Isa,
    input: &P::Input,
    tiles: std::ops::Range<usize>,
    rows: std::ops::Range<usize>,
    out: &O,
    gelu: Option<bool>,
) {
    let (t0, t1) = (tiles.start, tiles.end);
    let (r0, r1) = (rows.start, rows.end);
    let mut t = t0;
    let pair = p.pair_rows(isa);
    // Two tiles at once where the weight has a kernel for them and the
    // block has an encoder's rows. A decode batch's few rows read each
    // weight from memory once, and there the one-tile kernel, which
    // prefetches, is faster (a 16-row serve step of vit-gpt2 q8_0 took
    // 23–25 ms on the two-tile kernel against 19–21 ms).
    while pair > 0 && t + 1 < t1 && r1 - r0 >= PAIR_MIN_ROWS {
        let mut r = r0;
        while r < r1 {
            let step = (r1 - r).min(pair);
            // SAFETY: as below, for tiles `t` and `t + 1`.
            unsafe {
                match step {
                    6 => p.pair_store::<6, O>(isa, input, t, r, out, gelu),
                    5 => p.pair_store::<5, O>(isa, input, t, r, out, gelu),
                    4 => p.pair_store::<4, O>(isa, input, t, r, out, gelu),
                    3 => p.pair_store::<3, O>(isa, input, t, r, out, gelu),
                    2 => p.pair_store::<2, O>(isa, input, t, r, out, gelu),
                    _ => p.pair_store::<1, O>(isa, input, t, r, out, gelu),
                }
            }
            r += step;
        }
        t += 2;
    }
    let most = p.tile_rows(isa).clamp(1, MOST_TILE_ROWS);
    for t in t..t1 {
        let mut r = r0;
        while r < r1 {
            // Up to `most` rows share each tile's loads.
            let step = (r1 - r).min(most);
            // SAFETY: the caller's contract; rows `r..r + step` exist.
            unsafe {
                match step {
                    16 => p.tile_store::<16, O>(isa, input, t, r, out, gelu),
                    15 => p.tile_store::<15, O>(isa, input, t, r, out, gelu),
                    14 => p.tile_store::<14, O>(isa, input, t, r, out, gelu),
                    13 => p.tile_store::<13, O>(isa, input, t, r, out, gelu),
                    12 => p.tile_store::<12, O>(isa, input, t, r, out, gelu),
                    11 => p.tile_store::<11, O>(isa, input, t, r, out, gelu),
                    10 => p.tile_store::<10, O>(isa, input, t, r, out, gelu),
                    9 => p.tile_store::<9, O>(isa, input, t, r, out, gelu),
                    8 => p.tile_store::<8, O>(isa, input, t, r, out, gelu),
                    7 => p.tile_store::<7, O>(isa, input, t, r, out, gelu),
                    6 => p.tile_store::<6, O>(isa, input, t, r, out, gelu),
                    5 => p.tile_store::<5, O>(isa, input, t, r, out, gelu),
                    4 => p.tile_store::<4, O>(isa, input, t, r, out, gelu),
                    3 => p.tile_store::<3, O>(isa, input, t, r, out, gelu),
                    2 => p.tile_store::<2, O>(isa, input, t, r, out, gelu),
                    _ => p.tile_store::<1, O>(isa, input, t, r, out, gelu),
                }
            }
            r += step;
        }
    }
}

/// Rows `r0..r0 + R` of `x` against tile `t`, written to `out`.
///
/// # Safety
/// `out` is `(rows of a, n)`; no other thread writes tile `t`'s columns
/// of these rows meanwhile.
#[inline(always)]
unsafe fn tile<P: Tiled, const R: usize, O: Out>(
    p: &P,
    isa: Q8Isa,
    a: &P::Input,
    t: usize,
    r0: usize,
    out: &O,
    gelu: Option<bool>,
) {
    let mut acc = [[0f32; TILE_ROWS]; R];
    p.accumulate(isa, a, t, r0, &mut acc);
    // SAFETY: the caller's contract.
    unsafe { store(p, isa, &mut acc, t, r0, out, gelu) };
}

/// [`Tiled::pair_store`] as two calls of [`tile`], each out of line
/// ([`tile_cold`]) as in the one-tile loop: inlined into the pair loop's
/// row counts, it too would have its address arithmetic hoisted there.
///
/// # Safety
/// As [`tile`], for both tiles.
#[inline(always)]
unsafe fn pair_apart<P: Tiled, const R: usize, O: Out>(
    p: &P,
    isa: Q8Isa,
    a: &P::Input,
    t: usize,
    r0: usize,
    out: &O,
    gelu: Option<bool>,
) {
    // SAFETY: the caller's contract.
    unsafe {
        tile_cold::<P, R, O>(p, isa, a, t, r0, out, gelu);
        tile_cold::<P, R, O>(p, isa, a, t + 1, r0, out, gelu);
    }
}

/// Tile `t`'s sums for rows `r0..r0 + R`, plus the bias, through the
/// GELU if asked, stored in `out`.
///
/// # Safety
/// As [`tile`].
#[inline(always)]
unsafe fn store<P: Tiled, const R: usize, O: Out>(
    p: &P,
    isa: Q8Isa,
    acc: &mut [[f32; TILE_ROWS]; R],
    t: usize,
    r0: usize,
    out: &O,
    gelu: Option<bool>,
) {
    let n = p.dims().0;
    let cols = (n - t * TILE_ROWS).min(TILE_ROWS);
    if cols == TILE_ROWS {
        // A whole tile, its width known here: the bias is added and the
        // rows copied as vectors rather than through a call to `memcpy`
        // per row (4.5% of a 16-row q8_0 decode step, when the VNNI
        // kernel still stored through here).
        // SAFETY: as in `store_cols`.
        unsafe { store_cols::<P, R, O, TILE_ROWS>(p, isa, acc, t, r0, out, gelu) }
    } else {
        // SAFETY: the caller's contract.
        unsafe { store_cols::<P, R, O, 0>(p, isa, acc, t, r0, out, gelu) }
    }
}

/// [`store`] of a tile's first `COLS` columns (0: as many as it has).
///
/// # Safety
/// As [`tile`]; a `COLS` other than 0 is the tile's width.
#[inline(always)]
unsafe fn store_cols<P: Tiled, const R: usize, O: Out, const COLS: usize>(
    p: &P,
    isa: Q8Isa,
    acc: &mut [[f32; TILE_ROWS]; R],
    t: usize,
    r0: usize,
    out: &O,
    gelu: Option<bool>,
) {
    let n = p.dims().0;
    let cols = if COLS == 0 {
        (n - t * TILE_ROWS).min(TILE_ROWS)
    } else {
        COLS
    };
    if let Some(b) = p.bias_values() {
        let b = &b[t * TILE_ROWS..][..cols];
        for acc in acc.iter_mut() {
            for (a, b) in acc[..cols].iter_mut().zip(b) {
                *a += b;
            }
        }
    }
    if let Some(exact) = gelu {
        crate::kernels::gelu::in_place(isa.f32_isa(), exact, acc.as_flattened_mut());
    }
    for (i, acc) in acc.iter().enumerate() {
        // SAFETY: row `r0 + i` exists and columns `t * 16 ..` of it are
        // this call's alone (the caller's contract); written through the
        // pointer (the buffer is not initialised before).
        unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr(), out.at(r0 + i, t, n), cols) };
    }
}

/// Where a product's tasks store tile `t` (up to 16 outputs) of row `r`:
/// a product is compiled for each kind of output, so that the rows' usual
/// layout costs its kernels nothing.
pub(crate) trait Out: Sync {
    /// Where tile `t` of row `r` of a product of `n` outputs goes.
    ///
    /// # Safety
    /// Row `r` and tile `t` are the product's.
    unsafe fn at(&self, r: usize, t: usize, n: usize) -> *mut f32;
}

/// Rows one after the other: tile `t` of row `r` at `r · n + 16 t`.
pub(crate) struct OutPtr(*mut f32);
// SAFETY: shared only by a product's tasks, which write disjoint
// elements.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The output from its `elems`-th value on.
    ///
    /// # Safety
    /// The buffer has room for `elems` values.
    unsafe fn offset(&self, elems: usize) -> Self {
        // SAFETY: the caller's contract.
        Self(unsafe { self.0.add(elems) })
    }
}

impl Out for OutPtr {
    #[inline(always)]
    unsafe fn at(&self, r: usize, t: usize, n: usize) -> *mut f32 {
        // SAFETY: the caller's contract; the buffer holds the rows.
        unsafe { self.0.add(r * n + t * TILE_ROWS) }
    }
}

/// A layout of the caller's ([`matmul_tiled_placed`]): tile `t` of row
/// `r` at `rows[r] + tiles[t]`.
struct Placed<'a> {
    ptr: *mut f32,
    rows: &'a [usize],
    tiles: &'a [usize],
}
// SAFETY: as `OutPtr`'s.
unsafe impl Sync for Placed<'_> {}

impl Out for Placed<'_> {
    #[inline(always)]
    unsafe fn at(&self, r: usize, t: usize, _n: usize) -> *mut f32 {
        // SAFETY: the caller's contract; the places are within the buffer
        // (`matmul_tiled_placed`'s).
        unsafe { self.ptr.add(self.rows[r] + self.tiles[t]) }
    }
}

/// Several weights of one width `k` as one [`Tiled`] product: their tiles
/// one after the other (part `w`'s tile `t` is tile `first[w] + t` of the
/// whole), each part with its own bias and kernels. One rounding of `x`
/// and one split of the work across the pool then serve them all — every
/// decoder layer's image keys and values from the same image tokens were
/// 24 products of a millisecond, each rounding the tokens again and
/// ending with a core idle while the other finished the last tiles.
pub(crate) struct Stacked<'a, P> {
    parts: &'a [&'a P],
    /// Each part's first tile; the whole's tiles at the end.
    first: Vec<usize>,
    k: usize,
}

impl<'a, P: Tiled> Stacked<'a, P> {
    /// The parts stacked, where they share a width and each has whole
    /// tiles (`n` a multiple of 16, so that the whole's tiles are all
    /// full); else `None`.
    pub(crate) fn new(parts: &'a [&'a P]) -> Option<Self> {
        let k = parts.first()?.dims().1;
        let mut first = vec![0];
        for p in parts {
            let (n, pk) = p.dims();
            if pk != k || !n.is_multiple_of(TILE_ROWS) {
                return None;
            }
            first.push(first.last()? + n / TILE_ROWS);
        }
        Some(Self { parts, first, k })
    }

    /// The part of whole tile `t` and the tile within it.
    #[inline(always)]
    fn locate(&self, t: usize) -> (usize, usize) {
        let w = self.first.partition_point(|&f| f <= t) - 1;
        (w, t - self.first[w])
    }

    /// [`Shifted`] for part `w`.
    #[inline(always)]
    fn shifted<'o, O>(&self, out: &'o O, w: usize) -> Shifted<'o, O> {
        Shifted {
            out,
            tile0: self.first[w],
            n: self.dims().0,
        }
    }
}

impl<P: Tiled> Tiled for Stacked<'_, P> {
    const NAME: &'static str = P::NAME;
    type Input = P::Input;

    fn dims(&self) -> (usize, usize) {
        (self.first.last().copied().unwrap_or(0) * TILE_ROWS, self.k)
    }

    /// None for the whole: each part adds its own as it stores.
    fn bias_values(&self) -> Option<&[f32]> {
        None
    }

    fn q8_tile(&self, t: usize) -> Option<(&[u8], &[u16])> {
        let (w, t) = self.locate(t);
        self.parts[w].q8_tile(t)
    }

    #[cfg(target_arch = "x86_64")]
    fn tile_bias(&self, t: usize) -> Option<&[f32]> {
        let (w, t) = self.locate(t);
        self.parts[w].tile_bias(t)
    }

    #[inline(always)]
    fn accumulate<const R: usize>(
        &self,
        isa: Q8Isa,
        a: &Self::Input,
        t: usize,
        r0: usize,
        acc: &mut [[f32; TILE_ROWS]; R],
    ) {
        let (w, t) = self.locate(t);
        self.parts[w].accumulate::<R>(isa, a, t, r0, acc);
    }

    fn tile_rows(&self, isa: Q8Isa) -> usize {
        self.parts
            .iter()
            .map(|p| p.tile_rows(isa))
            .min()
            .unwrap_or(8)
    }

    fn pair_rows(&self, isa: Q8Isa) -> usize {
        let rows = self.parts.iter().map(|p| p.pair_rows(isa));
        if rows.clone().all(|r| r > 0) {
            rows.min().unwrap_or(0)
        } else {
            0
        }
    }

    #[inline(always)]
    unsafe fn pair_store<const R: usize, O: Out>(
        &self,
        isa: Q8Isa,
        a: &Self::Input,
        t: usize,
        r0: usize,
        out: &O,
        gelu: Option<bool>,
    ) {
        let (w, local) = self.locate(t);
        let part = self.parts[w];
        let here = self.shifted(out, w);
        // SAFETY: the caller's contract, in the part's own tiles.
        unsafe {
            if t + 1 < self.first[w + 1] {
                part.pair_store::<R, _>(isa, a, local, r0, &here, gelu);
            } else {
                // The pair straddles two parts: a tile of each.
                part.tile_store::<R, _>(isa, a, local, r0, &here, gelu);
                let next = self.shifted(out, w + 1);
                self.parts[w + 1].tile_store::<R, _>(isa, a, 0, r0, &next, gelu);
            }
        }
    }

    #[inline(always)]
    unsafe fn tile_store<const R: usize, O: Out>(
        &self,
        isa: Q8Isa,
        a: &Self::Input,
        t: usize,
        r0: usize,
        out: &O,
        gelu: Option<bool>,
    ) {
        let (w, local) = self.locate(t);
        // SAFETY: the caller's contract, in the part's own tiles.
        unsafe { self.parts[w].tile_store::<R, _>(isa, a, local, r0, &self.shifted(out, w), gelu) }
    }
}

/// A part's view of a [`Stacked`] product's output: its tile `t` is the
/// whole's `tile0 + t`, of the whole's `n` outputs.
pub(crate) struct Shifted<'a, O> {
    out: &'a O,
    tile0: usize,
    n: usize,
}

impl<O: Out> Out for Shifted<'_, O> {
    #[inline(always)]
    unsafe fn at(&self, r: usize, t: usize, _n: usize) -> *mut f32 {
        // SAFETY: the caller's contract, in the whole's tiles.
        unsafe { self.out.at(r, self.tile0 + t, self.n) }
    }
}

/// Rows of `x` rounded to q8_0, with what the kernels read besides.
pub(crate) struct Activations {
    pub(crate) rows: usize,
    /// Values per row, a multiple of [`BLOCK_VALUES`].
    pub(crate) k: usize,
    /// `(rows, k)` rounded values.
    pub(crate) q: Vec<i8>,
    /// `(rows, k / 32)` scales.
    pub(crate) d: Vec<f32>,
    /// `(rows, k / 32)`: `-128 ×` each block's sum (what the weights'
    /// +128 offset adds to each lane).
    pub(crate) offset: Vec<i32>,
}

/// [`Activations`] with each block's scale times its sum, `dx · Σ xq`
/// (the q4_K kernels' minimum term), computed once per product rather
/// than once per tile; made only by [`Activations::with_sums`], so `sums`
/// has one value per block of `acts`.
pub(crate) struct SummedActivations {
    pub(crate) acts: Activations,
    /// `(rows, k / 32)`.
    pub(crate) sums: Vec<f32>,
}

/// Quantizes the rows of one tile (`values`: up to [`TILE_ROWS`] rows of
/// `k`) into its blocks `qs` and scales `d`, as candle's q8_0 does: scale
/// `max|w| / 127` (stored as f16), values `round(w / scale)` (half away
/// from zero), stored `+ 128`.
#[inline(always)]
fn pack_tile<K: Kernel>(values: &[f32], k: usize, qs: &mut [u8], d: &mut [u16]) {
    let _ = K::FMA;
    for (j, row) in values.chunks_exact(k).enumerate() {
        for (b, xb) in row.chunks_exact(BLOCK_VALUES).enumerate() {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = amax / 127.0;
            let id = if scale != 0.0 { 1.0 / scale } else { 0.0 };
            d[b * TILE_ROWS + j] = f16::from_f32(scale).to_bits();
            let tile = &mut qs[b * TILE_BYTES..][..TILE_BYTES];
            for (v, &x) in xb.iter().enumerate() {
                let (g, c) = (v / 4, v % 4);
                let q = (x * id).round() as i8;
                tile[(g * TILE_ROWS + j) * 4 + c] = (q as i16 + 128) as u8;
            }
        }
    }
}

crate::kernels::micro::per_isa! {
    /// [`pack_tile`] compiled for the given instruction set: `round` is
    /// then inline instructions (in the baseline, without SSE4.1, it was a
    /// call to libm's `roundf` per weight, ~6% of a BLIP q8_0 caption of
    /// 8 images with its load).
    fn pack_tile_on(values: &[f32], k: usize, qs: &mut [u8], d: &mut [u16])
        = pack_tile::<crate::kernels::micro::Avx512>
}

/// Rounds blocks of 32 values: scale `max|x| / 127`, values `x / scale`
/// rounded to the nearest (ties to even, as ggml's SIMD code does).
#[inline(always)]
fn round_blocks<K: Kernel>(x: &[f32], q: &mut [i8], d: &mut [f32], offset: &mut [i32]) {
    let _ = K::FMA;
    for (((xb, qb), db), ob) in x
        .chunks_exact(BLOCK_VALUES)
        .zip(q.chunks_exact_mut(BLOCK_VALUES))
        .zip(d.iter_mut())
        .zip(offset.iter_mut())
    {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        *db = amax / 127.0;
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (qv, &xv) in qb.iter_mut().zip(xb) {
            let r = (xv * id).round_ties_even() as i32;
            *qv = r as i8;
            sum += r;
        }
        *ob = -128 * sum;
    }
}

crate::kernels::micro::per_isa! {
    /// [`round_blocks`] compiled for the given instruction set.
    fn round_blocks_compiled(x: &[f32], q: &mut [i8], d: &mut [f32], offset: &mut [i32])
        = round_blocks::<crate::kernels::micro::Avx512>
}

/// [`round_blocks`] on the given instruction set: AVX-512F intrinsics
/// where present (the compiler does not vectorise the plain loop's
/// maximum), the plain loop compiled for the others. Every instruction
/// set gives the same bytes.
fn round_blocks_on(isa: Isa, x: &[f32], q: &mut [i8], d: &mut [f32], offset: &mut [i32]) {
    match isa.simd() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX-512F.
        Simd::Avx512 => unsafe { round_blocks_avx512(x, q, d, offset) },
        _ => round_blocks_compiled(isa, x, q, d, offset),
    }
}

/// [`round_blocks`] with AVX-512F intrinsics: two vectors per block, the
/// conversion rounding to nearest even (as `round_ties_even`), saturated
/// to `i8` (values are within ±127 already). A block with an infinite or
/// NaN value goes to the plain loop, so that those round alike too.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn round_blocks_avx512(x: &[f32], q: &mut [i8], d: &mut [f32], offset: &mut [i32]) {
    use std::arch::x86_64::*;
    let blocks = d
        .len()
        .min(offset.len())
        .min(x.len() / BLOCK_VALUES)
        .min(q.len() / BLOCK_VALUES);
    let inf = _mm512_set1_ps(f32::INFINITY);
    for b in 0..blocks {
        let xb = &x[b * BLOCK_VALUES..][..BLOCK_VALUES];
        // SAFETY: `xb` holds 32 floats and `qb` 32 bytes (just sliced).
        unsafe {
            let x0 = _mm512_loadu_ps(xb.as_ptr());
            let x1 = _mm512_loadu_ps(xb.as_ptr().add(16));
            let (a0, a1) = (_mm512_abs_ps(x0), _mm512_abs_ps(x1));
            // Not less than infinity, or unordered: inf or NaN.
            let odd = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(a0, inf)
                | _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(a1, inf);
            if odd != 0 {
                round_blocks::<crate::kernels::micro::Avx512>(
                    xb,
                    &mut q[b * BLOCK_VALUES..][..BLOCK_VALUES],
                    &mut d[b..b + 1],
                    &mut offset[b..b + 1],
                );
                continue;
            }
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
            d[b] = amax / 127.0;
            let id = _mm512_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
            const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            let r0 = _mm512_cvt_roundps_epi32::<NEAREST>(_mm512_mul_ps(x0, id));
            let r1 = _mm512_cvt_roundps_epi32::<NEAREST>(_mm512_mul_ps(x1, id));
            offset[b] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(r0, r1));
            let qb = q[b * BLOCK_VALUES..][..BLOCK_VALUES].as_mut_ptr();
            _mm_storeu_si128(qb as *mut __m128i, _mm512_cvtsepi32_epi8(r0));
            _mm_storeu_si128(qb.add(16) as *mut __m128i, _mm512_cvtsepi32_epi8(r1));
        }
    }
}

impl Activations {
    /// Rounds `x (rows, k)` block by block (see [`round_blocks`]); rows
    /// split across the pool when there are many.
    pub(crate) fn new(isa: Isa, x: &[f32], rows: usize, k: usize) -> Self {
        Self::rounded(isa, x, rows, k, true)
    }

    /// [`Activations::new`] on the calling thread alone (a task's own
    /// rows).
    pub(crate) fn new_here(isa: Isa, x: &[f32], rows: usize, k: usize) -> Self {
        Self::rounded(isa, x, rows, k, false)
    }

    fn rounded(isa: Isa, x: &[f32], rows: usize, k: usize, split: bool) -> Self {
        let blocks = k / BLOCK_VALUES;
        const CHUNK: usize = 16;
        // Each task zeroes its own part of the three buffers (no one
        // thread zeroing them all first); a decode step's few rows on the
        // calling thread.
        let (mut q, mut d, mut offset) = (
            Vec::with_capacity(rows * k),
            Vec::with_capacity(rows * blocks),
            Vec::with_capacity(rows * blocks),
        );
        let (qs, ds, os) = (
            &mut q.spare_capacity_mut()[..rows * k],
            &mut d.spare_capacity_mut()[..rows * blocks],
            &mut offset.spare_capacity_mut()[..rows * blocks],
        );
        if rows <= CHUNK || !split {
            round_blocks_on(isa, x, zeroed(qs), zeroed(ds), zeroed(os));
        } else {
            x.par_chunks(CHUNK * k)
                .zip(qs.par_chunks_mut(CHUNK * k))
                .zip(ds.par_chunks_mut(CHUNK * blocks))
                .zip(os.par_chunks_mut(CHUNK * blocks))
                .for_each(|(((x, q), d), o)| {
                    round_blocks_on(isa, x, zeroed(q), zeroed(d), zeroed(o))
                });
        }
        // SAFETY: the chunks of each buffer cover its first `rows * k`
        // (`rows * blocks`) values, every one initialised by its task.
        unsafe {
            q.set_len(rows * k);
            d.set_len(rows * blocks);
            offset.set_len(rows * blocks);
        }
        Self {
            rows,
            k,
            q,
            d,
            offset,
        }
    }

    /// With the blocks' sums ([`SummedActivations`]): the sum from the
    /// offset (`-128 Σ xq`, exact in f32: below 2^20) times the scale.
    pub(crate) fn with_sums(self) -> SummedActivations {
        let sums = self
            .offset
            .iter()
            .zip(&self.d)
            .map(|(&o, &d)| o as f32 * (-1.0 / 128.0) * d)
            .collect();
        SummedActivations { acts: self, sums }
    }

    /// Row `r`'s rounded values and block scales.
    #[cfg(test)]
    fn row(&self, r: usize) -> (&[i8], &[f32]) {
        let blocks = self.k / BLOCK_VALUES;
        (
            &self.q[r * self.k..][..self.k],
            &self.d[r * blocks..][..blocks],
        )
    }
}

/// One tile against rows `r0..r0 + R`, in plain Rust (vectorised by the
/// compiler for the instruction set it is compiled for).
#[inline(always)]
fn tile_generic<K: Kernel, const R: usize>(
    p: &PackedQ8,
    a: &Activations,
    t: usize,
    r0: usize,
    acc: &mut [[f32; TILE_ROWS]; R],
) {
    let blocks = p.k / BLOCK_VALUES;
    for b in 0..blocks {
        let tb = t * blocks + b;
        let tile: &[u8; TILE_BYTES] = p.qs[tb * TILE_BYTES..][..TILE_BYTES]
            .try_into()
            .expect("a tile");
        let dw: [f32; TILE_ROWS] =
            std::array::from_fn(|j| f16::from_bits(p.d[tb * TILE_ROWS + j]).to_f32());
        for (i, acc) in acc.iter_mut().enumerate() {
            let r = r0 + i;
            let x = &a.q[r * a.k + b * BLOCK_VALUES..][..BLOCK_VALUES];
            let mut s = [a.offset[r * blocks + b]; TILE_ROWS];
            for g in 0..BLOCK_VALUES / 4 {
                for (j, s) in s.iter_mut().enumerate() {
                    for c in 0..4 {
                        *s += tile[(g * TILE_ROWS + j) * 4 + c] as i32 * x[g * 4 + c] as i32;
                    }
                }
            }
            let dx = a.d[r * blocks + b];
            for j in 0..TILE_ROWS {
                acc[j] = madd(K::FMA, s[j] as f32, dw[j] * dx, acc[j]);
            }
        }
    }
}

crate::kernels::micro::per_isa! {
    /// [`tile_generic`] compiled for `isa` (which the CPU supports).
    fn tile_plain<const R: usize>(
        p: &PackedQ8,
        a: &Activations,
        t: usize,
        r0: usize,
        acc: &mut [[f32; TILE_ROWS]; R],
    ) = tile_generic::<crate::kernels::micro::Avx512>
}

/// Checks that `t` is a tile of `p` and `rows` are rows of `a`, of `p`'s
/// width — what the SIMD tiles read without further checks — and returns
/// the blocks per row.
///
/// # Panics
/// When they are not (callers iterate over both, so that never happens).
#[inline(always)]
fn check_tile(p: &PackedQ8, a: &Activations, t: usize, rows: std::ops::Range<usize>) -> usize {
    let blocks = p.k / BLOCK_VALUES;
    assert!(
        a.k == p.k
            && (t + 1) * blocks * TILE_BYTES <= p.qs.len()
            && (t + 1) * blocks * TILE_ROWS <= p.d.len()
            && rows.end * a.k <= a.q.len()
            && rows.end * blocks <= a.d.len().min(a.offset.len()),
        "vl-q8_0: tile {t} and rows {rows:?} outside the weight ({}, {}) or x ({}, {})",
        p.n,
        p.k,
        a.rows,
        a.k
    );
    blocks
}

/// [`tile_generic`] with AVX-512 VNNI intrinsics: per block, the tile's 8
/// groups loaded once for all `R` rows, one `vpdpbusd` chain per row from
/// [`CHAINED_ROWS`] rows (two below); the sums into the caller's array or,
/// with the bias and the GELU, into the product ([`Sums`]).
///
/// # Panics
/// If `t` is not a tile of `p`, rows `r0..r0 + R` are not in `a` or `a`'s
/// width is not `p`'s (checked once, before the loops).
///
/// # Safety
/// The CPU has AVX-512F, BW and VNNI; with [`Sums::Out`], [`tile`]'s
/// contract for `out`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile_vnni<const R: usize, O: Out>(
    p: &PackedQ8,
    a: &Activations,
    t: usize,
    r0: usize,
    to: Sums<'_, R, O>,
) {
    use std::arch::x86_64::*;
    let blocks = check_tile(p, a, t, r0..r0 + R);
    let tune = CpuFeatures::get().tuning;
    let (ahead, hint) = (tune.prefetch_ahead, tune.prefetch);
    // SAFETY: every offset below is within the tile `t` of `p` and the rows
    // `r0..r0 + R` of `a` (checked above).
    unsafe {
        let mut sums = [_mm512_setzero_ps(); R];
        let qs = p.qs.as_ptr().add(t * blocks * TILE_BYTES);
        let ds = p.d.as_ptr().add(t * blocks * TILE_ROWS);
        for b in 0..blocks {
            let tile = qs.add(b * TILE_BYTES);
            // The tiles `ahead` bytes on, and the scales as far ahead in
            // blocks (a line holds two blocks' scales).
            for line in 0..TILE_BYTES / 64 {
                prefetch(tile, ahead + 64 * line, hint);
            }
            if b % 2 == 0 {
                prefetch(ds.add(b * TILE_ROWS), ahead / 16, hint);
            }
            let w: [__m512i; 8] =
                std::array::from_fn(|g| _mm512_loadu_si512(tile.add(g * 64) as *const _));
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(ds.add(b * TILE_ROWS) as *const _));
            for (i, sum) in sums.iter_mut().enumerate() {
                let r = r0 + i;
                let x = a.q.as_ptr().add(r * a.k + b * BLOCK_VALUES);
                let x4 =
                    |g: usize| _mm512_set1_epi32((x.add(g * 4) as *const i32).read_unaligned());
                let mut s0 = _mm512_set1_epi32(*a.offset.get_unchecked(r * blocks + b));
                let s = if R >= CHAINED_ROWS {
                    // Enough rows' chains in flight to hide `vpdpbusd`'s
                    // latency: one chain per row, no closing add.
                    for (g, &w) in w.iter().enumerate() {
                        s0 = _mm512_dpbusd_epi32(s0, w, x4(g));
                    }
                    s0
                } else {
                    let mut s1 = _mm512_setzero_si512();
                    for g in (0..8).step_by(2) {
                        s0 = _mm512_dpbusd_epi32(s0, w[g], x4(g));
                        s1 = _mm512_dpbusd_epi32(s1, w[g + 1], x4(g + 1));
                    }
                    _mm512_add_epi32(s0, s1)
                };
                let s = _mm512_cvtepi32_ps(s);
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*a.d.get_unchecked(r * blocks + b)));
                *sum = _mm512_fmadd_ps(s, scale, *sum);
            }
        }
        match to {
            Sums::Acc(acc) => {
                for (o, sum) in acc.iter_mut().zip(sums) {
                    _mm512_storeu_ps(o.as_mut_ptr(), sum);
                }
            }
            // SAFETY: the caller's contract.
            Sums::Out(out, gelu) => store_sums_avx512(p, &sums, t, r0, out, gelu),
        }
    }
}

/// Where [`tile_vnni`] puts its sums: into the caller's accumulators
/// ([`Tiled::accumulate`]), or, plus the bias and through the GELU if
/// asked, straight into the product's rows ([`Tiled::tile_store`]).
#[cfg(target_arch = "x86_64")]
enum Sums<'a, const R: usize, O> {
    Acc(&'a mut [[f32; TILE_ROWS]; R]),
    Out(&'a O, Option<bool>),
}

/// [`tile_vnni`] for tiles `t` and `t + 1` at once, stored from the
/// registers ([`Tiled::pair_store`]): each value of `x` is broadcast once
/// for both tiles (a many-row product's loads were mostly those
/// broadcasts), one `vpdpbusd` chain per tile and row; then the bias, the
/// GELU if asked (the f32 kernel's own, lane by lane) and a masked store.
/// The integer sums are exact and scaled as [`tile_vnni`] scales them:
/// the values of [`tile`], bit for bit.
///
/// # Panics
/// As [`tile_vnni`], for tile `t + 1` too.
///
/// # Safety
/// The CPU has AVX-512F, BW and VNNI; `out` is `(rows of a, n)` and no
/// other thread writes these tiles' columns of these rows meanwhile.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
// Rows index the two tiles' accumulators together; iterators over one of
// them would need closures, which do not inherit the target features.
#[allow(clippy::needless_range_loop)]
unsafe fn tile_pair_vnni<const R: usize, O: Out>(
    p: &PackedQ8,
    a: &Activations,
    t: usize,
    r0: usize,
    out: &O,
    gelu: Option<bool>,
) {
    use std::arch::x86_64::*;
    let blocks = check_tile(p, a, t + 1, r0..r0 + R);
    // SAFETY: every offset below is within tiles `t` and `t + 1` of `p`
    // (tile `t + 1`'s end checked above), the rows `r0..r0 + R` of `a`,
    // and those rows' columns of the two tiles in `out` (masked to `n`).
    unsafe {
        let mut sums = [[_mm512_setzero_ps(); R]; 2];
        let qs = [
            p.qs.as_ptr().add(t * blocks * TILE_BYTES),
            p.qs.as_ptr().add((t + 1) * blocks * TILE_BYTES),
        ];
        let ds = [
            p.d.as_ptr().add(t * blocks * TILE_ROWS),
            p.d.as_ptr().add((t + 1) * blocks * TILE_ROWS),
        ];
        for b in 0..blocks {
            // Written out rather than with closures, which would not
            // inherit the function's target features (nor be inlined).
            let mut s = [[_mm512_setzero_si512(); R]; 2];
            for i in 0..R {
                let o = _mm512_set1_epi32(*a.offset.get_unchecked((r0 + i) * blocks + b));
                s[0][i] = o;
                s[1][i] = o;
            }
            for g in 0..8 {
                let w = [
                    _mm512_loadu_si512(qs[0].add(b * TILE_BYTES + g * 64) as *const _),
                    _mm512_loadu_si512(qs[1].add(b * TILE_BYTES + g * 64) as *const _),
                ];
                for i in 0..R {
                    let x = a.q.as_ptr().add((r0 + i) * a.k + b * BLOCK_VALUES + g * 4);
                    let x4 = _mm512_set1_epi32((x as *const i32).read_unaligned());
                    s[0][i] = _mm512_dpbusd_epi32(s[0][i], w[0], x4);
                    s[1][i] = _mm512_dpbusd_epi32(s[1][i], w[1], x4);
                }
            }
            for j in 0..2 {
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(ds[j].add(b * TILE_ROWS) as *const _));
                for i in 0..R {
                    let dx = *a.d.get_unchecked((r0 + i) * blocks + b);
                    let scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx));
                    sums[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[j][i]), scale, sums[j][i]);
                }
            }
        }
        for (j, sums) in sums.iter().enumerate() {
            store_sums_avx512(p, sums, t + j, r0, out, gelu);
        }
    }
}

/// Stores tile `t`'s sums of rows `r0..` (one register per row) plus the
/// bias, through the GELU if asked (the f32 kernel's own, lane by lane),
/// masked to the tile's columns: the values of [`store`], bit for bit.
///
/// # Safety
/// The CPU has AVX-512F; `out` is `(rows of x, n)`, rows `r0..r0 +
/// sums.len()` and tile `t` exist, and no other thread writes these
/// rows' columns of the tile meanwhile.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_sums_avx512<O: Out>(
    p: &PackedQ8,
    sums: &[std::arch::x86_64::__m512],
    t: usize,
    r0: usize,
    out: &O,
    gelu: Option<bool>,
) {
    use crate::kernels::gelu::gelu_one;
    use crate::kernels::micro::Fma;
    use std::arch::x86_64::*;
    let n = p.n;
    let c0 = t * TILE_ROWS;
    // `t` may be the last, partial tile (`c0 < n` as a tile).
    let cols = (n - c0).min(TILE_ROWS);
    let mask: __mmask16 = (((1u32 << cols) - 1) & 0xFFFF) as u16;
    // SAFETY: the bias has `n` values, read masked to the tile's columns;
    // the stores are the caller's contract.
    unsafe {
        let bias = p
            .bias
            .as_deref()
            .map(|b| _mm512_maskz_loadu_ps(mask, b.as_ptr().add(c0)));
        for (i, &sum) in sums.iter().enumerate() {
            let mut v = match bias {
                Some(b) => _mm512_add_ps(sum, b),
                None => sum,
            };
            if let Some(exact) = gelu {
                let mut lanes = [0f32; TILE_ROWS];
                _mm512_storeu_ps(lanes.as_mut_ptr(), v);
                for l in &mut lanes {
                    *l = gelu_one::<Fma>(exact, *l);
                }
                v = _mm512_loadu_ps(lanes.as_ptr());
            }
            _mm512_mask_storeu_ps(out.at(r0 + i, t, n), mask, v);
        }
    }
}

/// [`tile_vnni`] on AVX2: per group of 4 values, the 16 rows' bytes in two
/// 256-bit halves, multiplied by `vpmaddubsw` (unsigned × signed bytes,
/// pairs summed to 16 bits) and summed to 32 bits by `vpmaddwd`. The
/// weights are taken back to signed (`^ 0x80`), and the unsigned operand
/// is their magnitude with their sign moved onto `x` (`vpsignb`): at most
/// 128 · 127 · 2 per pair, which 16 bits hold (the stored `+ 128` form
/// would overflow them). The integer sums are exact, and the scaling is
/// [`tile_generic`]'s: the same result, bit for bit.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const R: usize>(
    p: &PackedQ8,
    a: &Activations,
    t: usize,
    r0: usize,
    acc: &mut [[f32; TILE_ROWS]; R],
) {
    use std::arch::x86_64::*;
    let blocks = check_tile(p, a, t, r0..r0 + R);
    let tune = CpuFeatures::get().tuning;
    let (ahead, hint) = (tune.prefetch_ahead, tune.prefetch);
    // SAFETY: every offset below is within the tile `t` of `p` and the rows
    // `r0..r0 + R` of `a` (checked above).
    unsafe {
        let mut lo = [_mm256_setzero_ps(); R];
        let mut hi = [_mm256_setzero_ps(); R];
        let qs = p.qs.as_ptr().add(t * blocks * TILE_BYTES);
        let ds = p.d.as_ptr().add(t * blocks * TILE_ROWS);
        let flip = _mm256_set1_epi8(i8::MIN);
        let ones = _mm256_set1_epi16(1);
        for b in 0..blocks {
            let tile = qs.add(b * TILE_BYTES);
            for line in 0..TILE_BYTES / 64 {
                prefetch(tile, ahead + 64 * line, hint);
            }
            if b % 2 == 0 {
                prefetch(ds.add(b * TILE_ROWS), ahead / 16, hint);
            }
            // Half `h` of group `g`: rows 8(h % 2) .. +8, 4 bytes each.
            let w: [__m256i; 16] = std::array::from_fn(|h| {
                _mm256_xor_si256(_mm256_loadu_si256(tile.add(h * 32) as *const _), flip)
            });
            let mag: [__m256i; 16] = std::array::from_fn(|h| _mm256_sign_epi8(w[h], w[h]));
            let dw: [f32; TILE_ROWS] =
                std::array::from_fn(|j| f16::from_bits(*ds.add(b * TILE_ROWS + j)).to_f32());
            let (dw_lo, dw_hi) = (
                _mm256_loadu_ps(dw.as_ptr()),
                _mm256_loadu_ps(dw.as_ptr().add(8)),
            );
            for i in 0..R {
                let r = r0 + i;
                let x = a.q.as_ptr().add(r * a.k + b * BLOCK_VALUES);
                let mut s_lo = _mm256_setzero_si256();
                let mut s_hi = _mm256_setzero_si256();
                for g in 0..8 {
                    let xg = _mm256_set1_epi32((x.add(g * 4) as *const i32).read_unaligned());
                    let p_lo = _mm256_maddubs_epi16(mag[2 * g], _mm256_sign_epi8(xg, w[2 * g]));
                    let p_hi =
                        _mm256_maddubs_epi16(mag[2 * g + 1], _mm256_sign_epi8(xg, w[2 * g + 1]));
                    s_lo = _mm256_add_epi32(s_lo, _mm256_madd_epi16(p_lo, ones));
                    s_hi = _mm256_add_epi32(s_hi, _mm256_madd_epi16(p_hi, ones));
                }
                let dx = _mm256_set1_ps(*a.d.get_unchecked(r * blocks + b));
                lo[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_lo), _mm256_mul_ps(dw_lo, dx), lo[i]);
                hi[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_hi), _mm256_mul_ps(dw_hi, dx), hi[i]);
            }
        }
        for (o, (l, h)) in acc.iter_mut().zip(lo.into_iter().zip(hi)) {
            _mm256_storeu_ps(o.as_mut_ptr(), l);
            _mm256_storeu_ps(o.as_mut_ptr().add(8), h);
        }
    }
}

/// `acc[i] += a[4i..4i + 4] · b[4L..4L + 4]` for the 4 lanes `i`: the
/// `sdot` instruction by element (`vdotq_laneq_s32`, whose intrinsic is
/// not stable in Rust yet), written as assembly.
///
/// # Safety
/// The CPU has the dot-product extension.
#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon,dotprod")]
#[inline]
unsafe fn sdot_lane<const L: i32>(
    acc: std::arch::aarch64::int32x4_t,
    a: std::arch::aarch64::int8x16_t,
    b: std::arch::aarch64::int8x16_t,
) -> std::arch::aarch64::int32x4_t {
    let mut acc = acc;
    // SAFETY: one register-only instruction (no memory, no flags); the
    // caller's contract gives the extension.
    unsafe {
        std::arch::asm!(
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.4b[{l}]",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            l = const L,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

/// [`tile_generic`] with NEON `sdot`: per block, the tile's 8 groups
/// loaded once for all `R` rows and turned back into signed weights (`w +
/// 128` with its top bit flipped is `w`), so that no offset term is
/// needed; per row, 4 accumulators of 4 rows each, one `sdot` per group
/// and accumulator with the group's 4 values of `x` as a lane. The
/// integer sums equal the VNNI kernel's (offset included), and the scale
/// is applied the same way, so the outputs are the same.
///
/// # Panics
/// As [`tile_vnni`].
///
/// # Safety
/// The CPU has NEON and the dot-product extension.
#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon,dotprod")]
unsafe fn tile_neon_dot<const R: usize>(
    p: &PackedQ8,
    a: &Activations,
    t: usize,
    r0: usize,
    acc: &mut [[f32; TILE_ROWS]; R],
) {
    use std::arch::aarch64::*;
    let blocks = check_tile(p, a, t, r0..r0 + R);
    let flip = vdupq_n_u8(0x80);
    // SAFETY: every offset below is within the tile `t` of `p` and the rows
    // `r0..r0 + R` of `a` (checked above).
    unsafe {
        let mut sums = [[vdupq_n_f32(0.0); 4]; R];
        for b in 0..blocks {
            let tb = t * blocks + b;
            let tile = p.qs.as_ptr().add(tb * TILE_BYTES);
            // w[g][q]: group g's 4 columns of rows 4q..4q + 4.
            let w: [[int8x16_t; 4]; 8] = std::array::from_fn(|g| {
                std::array::from_fn(|q| {
                    vreinterpretq_s8_u8(veorq_u8(vld1q_u8(tile.add(g * 64 + q * 16)), flip))
                })
            });
            let dw: [f32; TILE_ROWS] =
                std::array::from_fn(|j| f16::from_bits(p.d[tb * TILE_ROWS + j]).to_f32());
            for (i, sum) in sums.iter_mut().enumerate() {
                let r = r0 + i;
                let x = a.q.as_ptr().add(r * a.k + b * BLOCK_VALUES);
                let (x0, x1) = (vld1q_s8(x), vld1q_s8(x.add(16)));
                let dx = a.d[r * blocks + b];
                for (q, sum) in sum.iter_mut().enumerate() {
                    let mut s = vdupq_n_s32(0);
                    s = sdot_lane::<0>(s, w[0][q], x0);
                    s = sdot_lane::<1>(s, w[1][q], x0);
                    s = sdot_lane::<2>(s, w[2][q], x0);
                    s = sdot_lane::<3>(s, w[3][q], x0);
                    s = sdot_lane::<0>(s, w[4][q], x1);
                    s = sdot_lane::<1>(s, w[5][q], x1);
                    s = sdot_lane::<2>(s, w[6][q], x1);
                    s = sdot_lane::<3>(s, w[7][q], x1);
                    let scale = vmulq_n_f32(vld1q_f32(dw.as_ptr().add(4 * q)), dx);
                    *sum = vfmaq_f32(*sum, vcvtq_f32_s32(s), scale);
                }
            }
        }
        for (o, sum) in acc.iter_mut().zip(sums) {
            for (q, v) in sum.into_iter().enumerate() {
                vst1q_f32(o.as_mut_ptr().add(4 * q), v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Module;

    fn isas() -> Vec<Q8Isa> {
        CpuFeatures::get().q8_isas()
    }

    /// The rounding: scale `max|x| / 127`, values within ±127 and within
    /// half a step of `x / scale`, a block's offset `-128 ×` its sum; a
    /// zero block stays zero with scale 0; every instruction set alike.
    #[test]
    fn activations_round_per_block() {
        let mut x: Vec<f32> = (0..96 * 20)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        x[32..64].fill(0.0);
        // Row 1's first block: scale 1, so values k + 0.5 are ties (to
        // even); its second block holds an infinity, its third a NaN.
        x[96] = 127.0;
        let ties = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5];
        x[97..97 + ties.len()].copy_from_slice(&ties);
        x[130] = f32::INFINITY;
        x[170] = f32::NAN;
        let first = Activations::new(Isa::portable(), &x, 20, 96);
        assert_eq!(&first.q[97..97 + ties.len()], &[0, 2, 2, 0, -2, -2, 126]);
        for isa in CpuFeatures::get().isas() {
            let a = Activations::new(isa, &x, 20, 96);
            assert_eq!((&a.q, &a.d, &a.offset), (&first.q, &first.d, &first.offset));
            let (q, d) = a.row(0);
            assert_eq!(d[1], 0.0);
            assert!(q[32..64].iter().all(|&v| v == 0));
            for b in [0, 2] {
                let xb = &x[b * 32..][..32];
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert_eq!(d[b], amax / 127.0);
                let sum: i32 = q[b * 32..][..32].iter().map(|&v| v as i32).sum();
                assert_eq!(a.offset[b], -128 * sum);
                for (qv, xv) in q[b * 32..][..32].iter().zip(xb) {
                    assert!((-127..=127).contains(qv));
                    assert!((*qv as f32 - xv / d[b]).abs() <= 0.5 + 1e-4, "{qv} vs {xv}");
                }
            }
        }
    }

    /// Packing keeps candle's blocks exactly (dequantized bit for bit),
    /// for heights that are not a multiple of a tile.
    #[test]
    fn packing_keeps_the_blocks() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        for &(n, k) in &[(1, 32), (17, 64), (40, 800)] {
            let w = Tensor::randn(0f32, 1., (n, k), &dev)?;
            let q = QTensor::quantize(&w, GgmlDType::Q8_0)?;
            let p = PackedQ8::from_qtensor(&q)?;
            assert_eq!(p.dims(), (n, k));
            assert!(p.to_blocks() == *q.data()?, "({n}, {k}): blocks differ");
            let want: Vec<f32> = q.dequantize(&dev)?.flatten_all()?.to_vec1()?;
            let got: Vec<f32> = p.dequantize()?.flatten_all()?.to_vec1()?;
            assert_eq!(got, want);
            let again: Vec<f32> = PackedQ8::quantize(&w)?
                .dequantize()?
                .flatten_all()?
                .to_vec1()?;
            assert_eq!(again, want);
            // Rows narrowed out of a larger weight (a fused projection's
            // split) quantize as those rows alone.
            let fused = Tensor::cat(&[&Tensor::randn(0f32, 1., (3, k), &dev)?, &w], 0)?;
            let part: Vec<f32> = PackedQ8::quantize(&fused.narrow(0, 3, n)?)?
                .dequantize()?
                .flatten_all()?
                .to_vec1()?;
            assert_eq!(part, want);
        }
        Ok(())
    }

    /// The AVX2 tile gives the bits of the plain tile with fused
    /// multiply-adds (what the compiler made of it for AVX2 before): the
    /// integer sums are exact and the scaling the same; weights of −128
    /// (which stored q8_0 blocks may hold, and vl's own rounding never
    /// makes) included.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx2_tile_is_the_plain_one_bit_for_bit() -> candle_core::Result<()> {
        if CpuFeatures::get().q8_isa_for(Q8Simd::Avx2).is_none() {
            return Ok(());
        }
        let dev = Device::Cpu;
        let (n, k) = (37, 160);
        let w = Tensor::randn(0f32, 1., (n, k), &dev)?;
        let mut p = PackedQ8::quantize(&w)?;
        // Stored `+ 128`: 0 is −128.
        for i in (0..p.qs.len()).step_by(7) {
            p.qs[i] = 0;
        }
        let rows = 5;
        let x: Vec<f32> = Tensor::randn(0f32, 1., (rows, k), &dev)?
            .flatten_all()?
            .to_vec1()?;
        let a = Activations::new(Isa::portable(), &x, rows, k);
        for t in 0..n.div_ceil(TILE_ROWS) {
            let mut want = [[0f32; TILE_ROWS]; 5];
            tile_generic::<crate::kernels::micro::Fma, 5>(&p, &a, t, 0, &mut want);
            let mut got = [[0f32; TILE_ROWS]; 5];
            // SAFETY: checked above that the CPU has AVX2 and FMA.
            unsafe { tile_avx2::<5>(&p, &a, t, 0, &mut got) };
            assert_eq!(got, want, "tile {t}");
        }
        Ok(())
    }

    /// A stacked product writes each part's own product, bit for bit, on
    /// every instruction set: parts of odd tile counts (so that the
    /// two-tile kernel's pairs straddle parts), with and without biases,
    /// for a decode step's rows and an encoder's (the two-tile kernel,
    /// several blocks of rows); parts of another width or of a partial
    /// tile are refused.
    #[test]
    fn stacked_parts_are_their_own_products() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let k = 96;
        let bias = |n: usize| Tensor::randn(0f32, 1., n, &dev);
        let parts = [
            PackedQ8::quantize(&Tensor::randn(0f32, 1., (48, k), &dev)?)?
                .with_bias(Some(&bias(48)?))?,
            PackedQ8::quantize(&Tensor::randn(0f32, 1., (16, k), &dev)?)?,
            PackedQ8::quantize(&Tensor::randn(0f32, 1., (80, k), &dev)?)?
                .with_bias(Some(&bias(80)?))?,
        ];
        let refs: Vec<&PackedQ8> = parts.iter().collect();
        let whole = Stacked::new(&refs).expect("stackable");
        assert_eq!(whole.dims(), (144, k));
        for rows in [1, 5, 150] {
            let x = Tensor::randn(0f32, 1., (rows, k), &dev)?;
            // Row-major `(rows, 144)`: each part's columns after the last's.
            let places: Vec<usize> = (0..rows).map(|r| r * 144).collect();
            let tiles: Vec<usize> = (0..9).map(|t| t * TILE_ROWS).collect();
            for isa in isas() {
                // SAFETY: every (row, tile) has its own 16 of the
                // `rows · 144` values.
                let got =
                    unsafe { matmul_tiled_placed(&whole, isa, &x, &places, &tiles, rows * 144) }?;
                let mut first = 0;
                for p in &parts {
                    let n = p.dims().0;
                    let want: Vec<f32> = p.matmul_with(isa, &x)?.flatten_all()?.to_vec1()?;
                    for r in 0..rows {
                        let (g, w) = (&got[r * 144 + first..][..n], &want[r * n..][..n]);
                        assert!(
                            g == w,
                            "{isa:?}, {rows} rows: part at column {first}, row {r}"
                        );
                    }
                    first += n;
                }
            }
        }
        let other_width = PackedQ8::quantize(&Tensor::randn(0f32, 1., (16, 64), &dev)?)?;
        assert!(Stacked::new(&[&parts[0], &other_width]).is_none());
        let partial = PackedQ8::quantize(&Tensor::randn(0f32, 1., (20, k), &dev)?)?;
        assert!(Stacked::new(&[&parts[0], &partial]).is_none());
        Ok(())
    }

    /// Every supported path equals the f64 product of the dequantized
    /// weight and the rounded `x` (relative error under 1e-5: only the
    /// summation order differs) for 1 to 700 rows (past a row block, and
    /// into the chunks of rows an encoder's products split into), widths
    /// of 1 to 25 blocks and heights off the tile size; and the rows of a
    /// many-row product equal the same rows one at a time, bit for bit.
    #[test]
    fn matches_the_dequantized_reference() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        for &(n, k) in &[(1, 32), (7, 96), (16, 64), (33, 64), (65, 800)] {
            let w = Tensor::randn(0f32, 1., (n, k), &dev)?;
            let p = PackedQ8::quantize(&w)?;
            let dq: Vec<f32> = p.dequantize()?.flatten_all()?.to_vec1()?;
            for rows in [1, 2, 3, 5, 8, 9, 14, 16, 17, 70, 131, 700] {
                let x = Tensor::randn(0f32, 1., (1, rows, k), &dev)?;
                let a = Activations::new(Isa::portable(), &x.flatten_all()?.to_vec1()?, rows, k);
                let mut want = Vec::new();
                for r in 0..rows {
                    let (xq, xd) = a.row(r);
                    for wr in dq.chunks(k) {
                        want.push(
                            wr.iter()
                                .zip(xq)
                                .enumerate()
                                .map(|(j, (wv, &qv))| *wv as f64 * qv as f64 * xd[j / 32] as f64)
                                .sum::<f64>(),
                        );
                    }
                }
                let scale = want.iter().map(|v| v.abs()).fold(1e-3, f64::max);
                let bias = Tensor::randn(0f32, 1., n, &dev)?;
                let pb = PackedQ8::quantize(&w)?.with_bias(Some(&bias))?;
                assert_eq!(
                    pb.bias()?.map(|b| b.to_vec1::<f32>()).transpose()?,
                    Some(bias.to_vec1()?)
                );
                for isa in isas() {
                    if q8_amx::takes(&p, isa, x.dims()) {
                        // On the tile unit: `q8_amx`'s tests, against
                        // the bf16 product they run.
                        continue;
                    }
                    let y = p.matmul_with(isa, &x)?;
                    assert_eq!(y.dims(), &[1, rows, n]);
                    let biased = pb.matmul_with(isa, &x)?;
                    let want_biased = y.broadcast_add(&bias)?;
                    assert_eq!(
                        biased.flatten_all()?.to_vec1::<f32>()?,
                        want_biased.flatten_all()?.to_vec1::<f32>()?
                    );
                    let got: Vec<f32> = y.flatten_all()?.to_vec1()?;
                    for (g, w) in got.iter().zip(&want) {
                        let err = (*g as f64 - w).abs() / scale;
                        assert!(err < 1e-5, "{isa:?} ({rows}, {k}) x ({n}, {k}): {g} vs {w}");
                    }
                    for r in [0, rows / 2, rows - 1] {
                        let one = p.matmul_with(isa, &x.narrow(1, r, 1)?)?;
                        assert_eq!(
                            one.flatten_all()?.to_vec1::<f32>()?,
                            got[r * n..][..n].to_vec(),
                            "{isa:?}: row {r} alone vs in {rows}"
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Against the unrounded product: the error of rounding `x` stays
    /// within what 8 bits allow (relative L2 under 1%), and candle's own
    /// q8_0 product (which rounds `x` per 256 values) is no closer.
    #[test]
    fn close_to_the_f32_product() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let (n, k) = (96, 768);
        let w = Tensor::randn(0f32, 1., (n, k), &dev)?;
        let q = QTensor::quantize(&w, GgmlDType::Q8_0)?;
        let p = PackedQ8::from_qtensor(&q)?;
        let x = Tensor::randn(0f32, 1., (3, k), &dev)?;
        let exact = x.matmul(&p.dequantize()?.t()?)?;
        let rel = |y: &Tensor| -> candle_core::Result<f32> {
            let num = (y - &exact)?.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?;
            let den = exact.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?;
            Ok(num / den)
        };
        let ours = rel(&p.matmul(&x)?)?;
        let candle = rel(&candle_core::quantized::QMatMul::from_qtensor(q)?.forward(&x)?)?;
        assert!(ours < 1e-2, "{ours}");
        assert!(ours <= candle * 1.05, "vl {ours} vs candle {candle}");
        Ok(())
    }

    /// Weights of another format or width, and inputs of another width or
    /// dtype, are refused with the reason; empty inputs give empty outputs.
    #[test]
    fn refuses_what_it_does_not_take() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let q4 = QTensor::quantize(&Tensor::zeros((4, 256), DType::F32, &dev)?, GgmlDType::Q4K)?;
        let err = PackedQ8::from_qtensor(&q4).unwrap_err();
        assert!(err.to_string().contains("q8_0 weight"), "{err}");
        let err = PackedQ8::quantize(&Tensor::zeros((4, 33), DType::F32, &dev)?).unwrap_err();
        assert!(err.to_string().contains("(n, k * 32)"), "{err}");
        let p = PackedQ8::quantize(&Tensor::zeros((4, 32), DType::F32, &dev)?)?;
        let err = p
            .matmul(&Tensor::zeros((2, 64), DType::F32, &dev)?)
            .unwrap_err();
        assert!(err.to_string().contains("x (..., 32)"), "{err}");
        let err = p
            .matmul(&Tensor::zeros((2, 32), DType::U32, &dev)?)
            .unwrap_err();
        assert!(err.to_string().contains("U32"), "{err}");
        let err = PackedQ8::quantize(&Tensor::zeros((4, 32), DType::F32, &dev)?)?
            .with_bias(Some(&Tensor::zeros(5, DType::F32, &dev)?))
            .unwrap_err();
        assert!(err.to_string().contains("a bias (4)"), "{err}");
        let y = p.matmul(&Tensor::zeros((0, 32), DType::F32, &dev)?)?;
        assert_eq!(y.dims(), &[0, 4]);
        Ok(())
    }
}
