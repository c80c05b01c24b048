//! vl's decode-shape kernel next to candle's products, on the projections
//! of a GPT-2-base decode step (width 768): `(rows, 768) x (2304, 768)^T`
//! (fused QKV), `x (3072, 768)^T` (FFN up), `(rows, 3072) x (768, 3072)^T`
//! (FFN down) and the LM head `x (50257, 768)^T`, for 1 and 4 rows: dense
//! f32 and bf16 (candle's matmul vs `vl_attn::kernels::gemv::gemv`), q8_0 (candle's
//! `QMatMul` vs `vl_attn::kernels::gemv_q8::PackedQ8`).
//!
//! And the encoder's many-row products: candle's f32 and bf16 matmul next
//! to `vl_attn::kernels::gemm_bf16` and the q8_0 product (FLOP/s as
//! elements/s), for one ViT-B/16 image (197 rows) and for a 16-row decode
//! step (a server's batch); and the q8_0 product on Florence-2 base's
//! DaViT MLP shapes for one 768² image (group `gemm q8_0`: 576–9,216
//! rows); and a whole q8_0 feed-forward on its first two stages' shapes
//! (group `ffn q8_0`): `FeedForward::forward`, which takes an encoder's
//! many rows a chunk at a time with the hidden layer kept in cache,
//! against its two products apart (the GELU in the first one's epilogue,
//! the hidden layer written out and read back).
//!
//! `cargo bench -p vl-attn --bench gemv`
//!
//! Both sides run in the same process on the same rayon pool (set its size
//! with `RAYON_NUM_THREADS`); report the ratio.

#![allow(missing_docs)] // criterion_group! generates undocumented items

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use vl_attn::kernels::gemv::{gemv, gemv_with};
use vl_attn::kernels::gemv_q8::PackedQ8;
use vl_attn::kernels::{CpuFeatures, Simd};

const SHAPES: [(&str, usize, usize); 4] = [
    ("qkv", 2304, 768),
    ("up", 3072, 768),
    ("down", 768, 3072),
    ("lm_head", 50257, 768),
];

fn products(c: &mut Criterion) {
    let dev = Device::Cpu;
    let mut group = c.benchmark_group("gemv");
    group.sample_size(20);
    for (name, out, inp) in SHAPES {
        let w32 = Tensor::randn(0f32, 1., (out, inp), &dev).expect("w");
        let q = std::sync::Arc::new(QTensor::quantize(&w32, GgmlDType::Q8_0).expect("q8_0"));
        let q_bytes = q.storage_size_in_bytes() as u64;
        let qmm = QMatMul::from_arc(q.clone()).expect("qmatmul");
        let packed = PackedQ8::from_qtensor(&q).expect("packed");
        for rows in [1usize, 4, 8] {
            let x32 = Tensor::randn(0f32, 1., (rows, inp), &dev).expect("x");
            for dtype in [DType::F32, DType::BF16] {
                let w = w32.to_dtype(dtype).expect("w");
                let x = x32.to_dtype(dtype).expect("x");
                let wt = w.t().expect("wt");
                let id = format!("{name} {dtype:?} rows {rows}");
                group.throughput(Throughput::Bytes(
                    (out * inp * dtype.size_in_bytes()) as u64,
                ));
                group.bench_function(BenchmarkId::new("candle", &id), |b| {
                    b.iter(|| x.matmul(&wt).expect("matmul"))
                });
                group.bench_function(BenchmarkId::new("vl", &id), |b| {
                    b.iter(|| gemv(&x, &w).expect("gemv"))
                });
                // The AVX2 form on a CPU that has AVX-512 too: what an
                // AVX2-only host runs, minus its clock and memory.
                let cpu = CpuFeatures::get();
                if let Some(isa) = cpu
                    .isa_for(Simd::Avx2)
                    .filter(|_| cpu.isa().simd() != Simd::Avx2)
                {
                    group.bench_function(BenchmarkId::new("vl avx2", &id), |b| {
                        b.iter(|| gemv_with(isa, &x, &w).expect("gemv"))
                    });
                }
            }
            let id = format!("{name} q8_0 rows {rows}");
            group.throughput(Throughput::Bytes(q_bytes));
            group.bench_function(BenchmarkId::new("candle", &id), |b| {
                b.iter(|| qmm.forward(&x32).expect("qmatmul"))
            });
            group.bench_function(BenchmarkId::new("vl", &id), |b| {
                b.iter(|| packed.matmul(&x32).expect("q8_0"))
            });
        }
    }
    group.finish();
}

/// The ViT-B/16 encoder's products for one image (197 tokens): candle's
/// f32 and bf16 matmul next to vl's bf16 GEMM (on CPUs with AVX512_BF16).
fn encoder(c: &mut Criterion) {
    let dev = Device::Cpu;
    let mut group = c.benchmark_group("gemm");
    group.sample_size(10);
    for (name, out, inp, m) in [
        ("o", 768, 768, 197),
        ("up", 3072, 768, 197),
        ("down", 768, 3072, 197),
        ("up", 3072, 768, 16),
    ] {
        let name = format!("{name} rows {m}");
        let name = name.as_str();
        let w32 = Tensor::randn(0f32, 1., (out, inp), &dev).expect("w");
        let x32 = Tensor::randn(0f32, 1., (m, inp), &dev).expect("x");
        group.throughput(Throughput::Elements((2 * m * out * inp) as u64));
        let wt32 = w32.t().expect("wt");
        group.bench_function(BenchmarkId::new("candle f32", name), |b| {
            b.iter(|| x32.matmul(&wt32).expect("matmul"))
        });
        let q8 = PackedQ8::quantize(&w32).expect("q8_0");
        group.bench_function(BenchmarkId::new("vl q8_0", name), |b| {
            b.iter(|| q8.matmul(&x32).expect("q8_0"))
        });
        let (x, w) = (
            x32.to_dtype(DType::BF16).expect("x"),
            w32.to_dtype(DType::BF16).expect("w"),
        );
        let wt = w.t().expect("wt");
        group.bench_function(BenchmarkId::new("candle bf16", name), |b| {
            b.iter(|| x.matmul(&wt).expect("matmul"))
        });
        if vl_attn::kernels::gemm_bf16::accelerated() {
            group.bench_function(BenchmarkId::new("vl bf16", name), |b| {
                b.iter(|| vl_attn::kernels::gemm_bf16::matmul(&x, &w).expect("gemm"))
            });
            // As the encoder runs it: the weight packed once, at load.
            let packed = std::sync::Arc::new(
                vl_attn::kernels::gemm_bf16::PackedBf16::new(&w, None)
                    .expect("pack")
                    .expect("packable"),
            );
            group.bench_function(BenchmarkId::new("vl bf16 packed", name), |b| {
                b.iter(|| packed.matmul(&x).expect("gemm"))
            });
        }
    }
    group.finish();
}

/// A decode step's products as a server runs them: weights that do not
/// stay in the core's caches between calls (24 FFN-up weights in turn, 57
/// MB of q8_0: past every L2; a shared L3 may hold them — the Xeon model
/// 167 hosts report 480 MB), for 1, 8 and 16 rows (one request, eight,
/// sixteen). Throughput as weight bytes read per second: a row count that
/// keeps the machine's read rate costs no more than one row. Beside it,
/// the first of those weights 24 times (`one up x24`: 2.4 MB, from the
/// caches): the kernel's arithmetic alone, so that the gap between the
/// two is the stream's.
fn streamed(c: &mut Criterion) {
    let dev = Device::Cpu;
    let mut group = c.benchmark_group("streamed");
    group.sample_size(10);
    let (out, inp) = (3072, 768);
    let weights: Vec<PackedQ8> = (0..24)
        .map(|_| {
            let w = Tensor::randn(0f32, 1., (out, inp), &dev).expect("w");
            PackedQ8::quantize(&w).expect("q8_0")
        })
        .collect();
    let bytes: usize = weights.iter().map(PackedQ8::size_in_bytes).sum();
    group.throughput(Throughput::Bytes(bytes as u64));
    for rows in [1usize, 8, 16] {
        let x = Tensor::randn(0f32, 1., (rows, inp), &dev).expect("x");
        group.bench_function(BenchmarkId::new("vl q8_0 one up x24", rows), |b| {
            b.iter(|| {
                for _ in 0..weights.len() {
                    weights[0].matmul(&x).expect("q8_0");
                }
            })
        });
        group.bench_function(BenchmarkId::new("vl q8_0 up x24", rows), |b| {
            b.iter(|| {
                for w in &weights {
                    w.matmul(&x).expect("q8_0");
                }
            })
        });
    }
    group.finish();
}

/// Florence-2 base's DaViT MLP products for one 768² image, q8_0.
fn encoder_q8(c: &mut Criterion) {
    let dev = Device::Cpu;
    let mut group = c.benchmark_group("gemm q8_0");
    group.sample_size(10);
    for (name, out, inp, m) in [
        ("stage 2 fc1", 1024, 256, 9216),
        ("stage 3 fc1", 2048, 512, 2304),
        ("stage 3 fc2", 512, 2048, 2304),
        ("stage 4 fc1", 4096, 1024, 576),
    ] {
        let w32 = Tensor::randn(0f32, 1., (out, inp), &dev).expect("w");
        let x32 = Tensor::randn(0f32, 1., (m, inp), &dev).expect("x");
        group.throughput(Throughput::Elements((2 * m * out * inp) as u64));
        let q8 = PackedQ8::quantize(&w32).expect("q8_0");
        group.bench_function(BenchmarkId::new("vl q8_0", name), |b| {
            b.iter(|| q8.matmul(&x32).expect("q8_0"))
        });
    }
    group.finish();
}

/// Florence-2 base's first two DaViT stages' feed-forward for one 768²
/// image, q8_0: chunked (`FeedForward::forward`) against its two products
/// apart.
fn ffn_q8(c: &mut Criterion) {
    use vl_attn::{Activation, FeedForward, Quantization};
    let dev = Device::Cpu;
    let mut group = c.benchmark_group("ffn q8_0");
    group.sample_size(10);
    for (name, width, hidden, m) in [("stage 1", 128, 512, 36864), ("stage 2", 256, 1024, 9216)] {
        let layer = |o: usize, i: usize| {
            candle_nn::Linear::new(
                Tensor::randn(0f32, 0.1, (o, i), &dev).expect("w"),
                Some(Tensor::randn(0f32, 0.1, o, &dev).expect("b")),
            )
        };
        let (up, down) = (layer(hidden, width), layer(width, hidden));
        let x = Tensor::randn(0f32, 1., (m, width), &dev).expect("x");
        group.throughput(Throughput::Elements((4 * m * hidden * width) as u64));
        let ffn = FeedForward::from_parts(up.clone(), down.clone(), Activation::Gelu)
            .quantize(Quantization::Q8_0)
            .expect("q8_0");
        group.bench_function(BenchmarkId::new("chunked", name), |b| {
            b.iter(|| ffn.forward(&x).expect("ffn"))
        });
        let packed = |l: &candle_nn::Linear| {
            PackedQ8::quantize(l.weight())
                .and_then(|p| p.with_bias(l.bias()))
                .expect("q8_0")
        };
        let (up, down) = (packed(&up), packed(&down));
        group.bench_function(BenchmarkId::new("apart", name), |b| {
            b.iter(|| {
                let h = up.matmul_gelu(&x, true).expect("up");
                down.matmul(&h).expect("down")
            })
        });
    }
    group.finish();
}

criterion_group!(benches, products, encoder, streamed, encoder_q8, ffn_q8);
criterion_main!(benches);
