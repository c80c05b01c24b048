//! Attention kernels side by side: the reference path, the fused path and
//! candle-nn's CPU flash attention, at width 768 with 12 heads; and the
//! cost of self- vs cross-attention modules at Nt=64, Nv=576; and an
//! image's keys and values through q8_0 projections (vit-gpt2's 197
//! tokens, twelve layers): what a server pays for each request it admits.
//!
//! `cargo bench -p vl-attn --bench attention`

#![allow(missing_docs)] // criterion_group! generates undocumented items

use candle_core::{DType, Device, Tensor};
use candle_nn::attention::{flash_attn, AttnMask};
use candle_nn::{VarBuilder, VarMap};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use vl_attn::attention::{attention, Backend, Weights};
use vl_attn::{CausalSelfAttention, CrossAttention, CrossAttentionConfig, SelfAttentionConfig};

const HEADS: usize = 12;
const HEAD_DIM: usize = 64;

fn kernels(c: &mut Criterion) {
    let dev = Device::Cpu;
    let mut group = c.benchmark_group("kernel");
    group.sample_size(10);
    for (tq, tk) in [
        (1usize, 197usize),
        (1, 1000),
        (197, 197),
        (64, 576),
        (1024, 4096),
    ] {
        let q = Tensor::randn(0f32, 1., (1, HEADS, tq, HEAD_DIM), &dev).expect("q");
        let k = Tensor::randn(0f32, 1., (1, HEADS, tk, HEAD_DIM), &dev).expect("k");
        let v = Tensor::randn(0f32, 1., (1, HEADS, tk, HEAD_DIM), &dev).expect("v");
        let scale = 1.0 / (HEAD_DIM as f64).sqrt();
        let id = format!("{tq}x{tk}");
        group.bench_function(BenchmarkId::new("reference", &id), |b| {
            b.iter(|| {
                attention(&q, &k, &v, None, scale, Backend::Reference, Weights::Skip).expect("ref")
            })
        });
        group.bench_function(BenchmarkId::new("fused", &id), |b| {
            b.iter(|| {
                attention(&q, &k, &v, None, scale, Backend::Fused, Weights::Skip).expect("fused")
            })
        });
        if tq == 1 {
            // A decode step against an image's keys and values kept in
            // bf16 (as `CrossAttention::with_memory_dtype` caches them).
            let (kb, vb) = (
                k.to_dtype(DType::BF16).expect("kb"),
                v.to_dtype(DType::BF16).expect("vb"),
            );
            group.bench_function(BenchmarkId::new("fused_bf16_kv", &id), |b| {
                b.iter(|| {
                    attention(&q, &kb, &vb, None, scale, Backend::Fused, Weights::Skip)
                        .expect("fused bf16")
                })
            });
        }
        // candle-nn wants (batch, len, heads, head_dim).
        let (qf, kf, vf) = (
            q.transpose(1, 2).and_then(|t| t.contiguous()).expect("qf"),
            k.transpose(1, 2).and_then(|t| t.contiguous()).expect("kf"),
            v.transpose(1, 2).and_then(|t| t.contiguous()).expect("vf"),
        );
        group.bench_function(BenchmarkId::new("candle_flash", &id), |b| {
            b.iter(|| {
                flash_attn::<f32>(&qf, &kf, &vf, scale as f32, AttnMask::None, None, None)
                    .expect("flash")
            })
        });
    }
    group.finish();
}

fn self_vs_cross(c: &mut Criterion) {
    let dev = Device::Cpu;
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev);
    let width = HEADS * HEAD_DIM;
    let sa = CausalSelfAttention::load(vb.pp("self"), &SelfAttentionConfig::new(width, HEADS))
        .expect("self");
    let ca = CrossAttention::load(
        vb.pp("cross"),
        &CrossAttentionConfig::new(width, width, HEADS),
    )
    .expect("cross");
    let text = Tensor::randn(0f32, 1., (1, 64, width), &dev).expect("text");
    let image = Tensor::randn(0f32, 1., (1, 576, width), &dev).expect("image");
    let kv = ca.project_memory(&image).expect("kv");
    let mut group = c.benchmark_group("module_nt64_nv576");
    group.sample_size(10);
    group.bench_function("self_attention", |b| {
        b.iter(|| sa.forward(&text, None).expect("self"))
    });
    group.bench_function("cross_attention", |b| {
        b.iter(|| ca.forward(&text, &image, None).expect("cross"))
    });
    group.bench_function("cross_attention_cached_kv", |b| {
        b.iter(|| ca.attend(&text, &kv, None, Weights::Skip).expect("cached"))
    });
    group.finish();
}

/// The attention of one decode step of 16 requests through a 12-layer
/// decoder (vit-gpt2's shape): per layer, each row against its image's
/// 197 keys and values in bf16 and its own 128-token f32 text cache. The
/// layers' keys and values (116 + 151 MB) are distinct buffers, more than
/// a last-level cache holds, so each step reads them from memory as a
/// served decode does: divide 267 MB by the time for the rate reached.
fn decode_step_from_memory(c: &mut Criterion) {
    const LAYERS: usize = 12;
    const ROWS: usize = 16;
    let dev = Device::Cpu;
    let scale = 1.0 / (HEAD_DIM as f64).sqrt();
    let layer = |len: usize, dtype: DType| {
        let kv = |name| {
            Tensor::randn(0f32, 1., (ROWS, HEADS, len, HEAD_DIM), &dev)
                .and_then(|t| t.to_dtype(dtype))
                .expect(name)
        };
        (kv("k"), kv("v"))
    };
    let cross: Vec<_> = (0..LAYERS).map(|_| layer(197, DType::BF16)).collect();
    let text: Vec<_> = (0..LAYERS).map(|_| layer(128, DType::F32)).collect();
    let q = Tensor::randn(0f32, 1., (ROWS, HEADS, 1, HEAD_DIM), &dev).expect("q");
    let mut group = c.benchmark_group("decode_step_from_memory");
    group.sample_size(20);
    group.bench_function("16_rows_12_layers", |b| {
        b.iter(|| {
            for ((tk, tv), (ck, cv)) in text.iter().zip(&cross) {
                attention(&q, tk, tv, None, scale, Backend::Fused, Weights::Skip).expect("self");
                attention(&q, ck, cv, None, scale, Backend::Fused, Weights::Skip).expect("cross");
            }
        })
    });
    // Both caches in bf16 (`vl serve --quantize q8_0`'s default: 116 +
    // 75 MB), then both as q8 rows (`--image-cache q8 --text-cache q8`:
    // 62 + 40 MB).
    let recast =
        |layers: &[(Tensor, Tensor)], f: &dyn Fn(&Tensor) -> Tensor| -> Vec<(Tensor, Tensor)> {
            layers.iter().map(|(k, v)| (f(k), f(v))).collect()
        };
    let bf16 = |t: &Tensor| t.to_dtype(DType::BF16).expect("bf16");
    let q8 = |t: &Tensor| vl_attn::quantize_kv(&t.to_dtype(DType::F32).expect("f32")).expect("q8");
    for (name, f) in [
        ("bf16_caches", &bf16 as &dyn Fn(&Tensor) -> Tensor),
        ("q8_caches", &q8),
    ] {
        let (text, cross) = (recast(&text, f), recast(&cross, f));
        group.bench_function(format!("16_rows_12_layers_{name}"), |b| {
            b.iter(|| {
                for ((tk, tv), (ck, cv)) in text.iter().zip(&cross) {
                    attention(&q, tk, tv, None, scale, Backend::Fused, Weights::Skip)
                        .expect("self");
                    attention(&q, ck, cv, None, scale, Backend::Fused, Weights::Skip)
                        .expect("cross");
                }
            })
        });
    }
    group.finish();
}

/// DaViT's window attention at Florence-2 base's 768² input: every
/// window of 12 × 12 tokens against itself, head width 32 — stage 1
/// (256 windows × 4 heads) and stage 3 (16 windows × 16 heads, 9 blocks
/// of the encoder). Each call is `4 · windows · heads · 144² · 32` FLOP
/// (stage 1: 2.72 G; stage 3: 0.68 G).
fn window_attention(c: &mut Criterion) {
    const TOKENS: usize = 144;
    const WIDTH: usize = 32;
    let dev = Device::Cpu;
    let mut group = c.benchmark_group("davit_window");
    group.sample_size(10);
    for (name, windows, heads) in [
        ("stage1", 256usize, 4usize),
        ("stage1_quarter", 64, 4),
        ("stage3", 16, 16),
    ] {
        let t = |n| Tensor::randn(0f32, 1., (windows, heads, TOKENS, WIDTH), &dev).expect(n);
        let (q, k, v) = (t("q"), t("k"), t("v"));
        let scale = 1.0 / (WIDTH as f64).sqrt();
        group.bench_function(name, |b| {
            b.iter(|| {
                attention(&q, &k, &v, None, scale, Backend::Fused, Weights::Skip).expect("fused")
            })
        });
    }
    group.finish();
}

/// Twelve layers' image keys and values for 1 and 16 images of 197
/// tokens (a ViT-B/16's), through q8_0 projections into the bf16 memory a
/// quantized decoder keeps: layer by layer, and stacked
/// ([`CrossAttention::project_memories`]).
fn image_kv_q8(c: &mut Criterion) {
    let dev = Device::Cpu;
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev);
    let width = HEADS * HEAD_DIM;
    let ca = CrossAttention::load(
        vb.pp("cross"),
        &CrossAttentionConfig::new(width, width, HEADS),
    )
    .expect("cross")
    .quantize(candle_core::quantized::GgmlDType::Q8_0)
    .expect("q8_0");
    let layers = vec![&ca; 12];
    let mut group = c.benchmark_group("image_kv_q8_0_197");
    group.sample_size(20);
    for images in [1usize, 16] {
        let image = Tensor::randn(0f32, 1., (images, 197, width), &dev).expect("image");
        group.bench_function(BenchmarkId::new("12_layers_one_by_one", images), |b| {
            b.iter(|| {
                for l in &layers {
                    l.project_memory(&image).expect("kv");
                }
            })
        });
        group.bench_function(BenchmarkId::new("12_layers_stacked", images), |b| {
            b.iter(|| CrossAttention::project_memories(&layers, &image).expect("kvs"))
        });
    }
    group.finish();
}

criterion_group!(
    benches,
    kernels,
    self_vs_cross,
    image_kv_q8,
    decode_step_from_memory,
    window_attention
);
criterion_main!(benches);
