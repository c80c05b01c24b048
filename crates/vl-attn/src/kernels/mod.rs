//! vl's CPU kernels: the only `unsafe` code of the crate, and the one
//! place that knows what the CPU can run.
//!
//! [`CpuFeatures`] detects the CPU once; every SIMD implementation is
//! reached through a token it hands out ([`Isa`], [`Q8Isa`],
//! [`Bf16Isa`]), so `#[target_feature]` code never runs on a CPU without
//! the feature. Each operation has one entry point, which picks its
//! implementation from the best token, and a portable implementation in
//! plain Rust that is both the fallback and the oracle its SIMD siblings
//! are tested against (on odd sizes, every implementation the CPU runs).
//!
//! | operation | entry point | implementations |
//! |---|---|---|
//! | f32/f16/bf16 GEMV, 1–8 rows | [`gemv::gemv`] | AVX-512F, AVX2+FMA, portable |
//! | q8_0 product, any rows | [`gemv_q8::PackedQ8::matmul`] | AMX-BF16 (an encoder's rows, [`q8_amx`]), AVX-512 VNNI, AVX2+FMA, portable |
//! | q4_K product, any rows | [`gemv_q4k::PackedQ4K::matmul`] | AVX-512 VNNI, AVX2+FMA, portable |
//! | f32 GEMM, many rows (where [`Tuning::f32_gemm`] chooses it) | [`gemm_f32::matmul`] | AVX-512F, AVX2+FMA, portable |
//! | f32 GEMM on a weight packed at load (an encoder's layers, [`crate::Proj::pack_f32`]; GELU in its epilogue) | [`gemm_f32::PackedF32::matmul`], [`gemm_f32::PackedF32::matmul_gelu`] | AVX-512F, AVX2+FMA, portable |
//! | f32 feed-forward, an encoder's rows a chunk at a time (GELU as the first product stores) | [`gemm_f32::ffn`] (through [`crate::FeedForward`]) | AVX-512F, AVX2+FMA, portable |
//! | bf16 GEMM (and packed bf16 GEMV; GELU in its epilogue) | [`gemm_bf16::matmul`], [`gemm_bf16::PackedBf16::matmul`], [`gemm_bf16::PackedBf16::matmul_gelu`] | AMX-BF16 (blocks of 32 rows), AVX512_BF16, AVX-512F FMAs on widened weights (where [`Tuning::bf16_gemm`] chooses them), portable |
//! | fused attention, per row and tiled | `attention::fused` (through [`crate::attention::attention`]) | AVX-512F, AVX2+FMA, portable |
//! | keys and values in 8 bits (q8_0 blocks) | [`kv_q8::quantize`], [`kv_q8::widen`] | AVX-512F, portable (quantize); portable (widen) |
//! | LayerNorm | [`norm::layer_norm`] | AVX-512F (f32), AVX512_BF16 (bf16), portable |
//! | bf16 and f32 addition | [`add::add`] | AVX512_BF16 (bf16), portable |
//! | GELU (erf and tanh) | `gelu::forward` (through [`crate::FeedForward`]) | AVX-512F, AVX2+FMA, portable |
//! | depth-wise convolution, channels-last | [`dwconv::depthwise_nhwc`] | portable (vectorised by the compiler) |
//! | convolution patches (im2col), channels-last | [`im2col::patches_nhwc`] | portable |
//! | q4_K quantizer | `q4k` (through [`crate::Proj::quantize`]) | AVX-512F, AVX2+FMA, portable |
//!
//! The products split across the rayon pool. Called from a thread
//! outside it, each one hands its work over and waits (about 10 µs on a
//! 2-core machine); run a model's whole forward pass or decode step
//! through [`on_pool`] to pay that once (vl's decoder and ViT do), and
//! hold a [`KeepAwake`] over a loop of decode steps so that the pool's
//! workers do not fall asleep between their parallel parts (vl's
//! `generate` and `vl serve` do).

pub mod add;
pub(crate) mod aligned;
pub(crate) mod attention;
pub mod dwconv;
pub mod features;
pub(crate) mod gelu;
pub mod gemm_bf16;
pub mod gemm_f32;
pub mod gemv;
pub mod gemv_q4k;
pub mod gemv_q8;
pub(crate) mod host;
pub mod im2col;
pub mod kv_q8;
pub(crate) mod micro;
pub mod norm;
pub(crate) mod q4k;
pub mod q8_amx;
pub(crate) mod tiled;

pub use features::{
    Bf16Gemm, Bf16Isa, Bf16Simd, CpuFeatures, F32Gemm, Isa, PrefetchHint, Q8Isa, Q8Simd, Simd,
    Tuning, Vendor,
};
pub use host::{keep_freed_memory, on_pool, return_freed_memory, with_values, KeepAwake};
