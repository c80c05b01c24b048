//! One decode step (one new token, batch 1) of a GPT-2-small-sized decoder
//! with cross-attention to 197 image tokens of width 768: dense f32 weights
//! against q8_0 and q4k weights, and image keys/values cached once against
//! re-projected at every step; and the single projections behind a step.
//!
//! `cargo bench -p vl-decoder --bench decode_step -- --noplot`
//!
//! On a shared CPU, prefix `RAYON_NUM_THREADS=1 CANDLE_NUM_THREADS=1`:
//! candle's quantized kernels spin at a barrier, and a worker thread that
//! loses its core to another process stalls every step (BENCHMARKS.md).
//!
//! Weights are random (candle's `VarMap` initialisation); timings do not
//! depend on their values. Each step sees between `PROMPT` and `MAX_TEXT`
//! text tokens in its cache; the state is rebuilt, untimed, when it reaches
//! `MAX_TEXT`.

#![allow(missing_docs)] // criterion_group! generates undocumented items

use std::time::{Duration, Instant};

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use candle_nn::{Linear, Module, VarBuilder, VarMap};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use vl_attn::Proj;
use vl_decoder::{
    Activation, DecodeState, DecoderConfig, ImageContext, StepOptions, VisionLanguageDecoder,
};

/// ViT-B/16 at 224 px: 196 patches and a CLS token.
const IMAGE_TOKENS: usize = 197;
/// Text tokens fed before the timed steps.
const PROMPT: usize = 8;
/// Text tokens after which the state is rebuilt.
const MAX_TEXT: usize = 64;

/// GPT-2 small (124M) with a cross-attention in every block.
fn gpt2_small() -> DecoderConfig {
    DecoderConfig {
        vocab_size: 50257,
        hidden_size: 768,
        num_attention_heads: 12,
        num_hidden_layers: 12,
        intermediate_size: 3072,
        max_position_embeddings: 1024,
        memory_dim: 768,
        hidden_act: Activation::GeluTanh,
        ..DecoderConfig::tiny(50257, 768)
    }
}

/// A state over `ctx` with the prompt already fed.
fn fresh_state(model: &VisionLanguageDecoder, ctx: &ImageContext) -> DecodeState {
    let prompt = Tensor::ones((1, PROMPT), DType::U32, model.device()).expect("prompt");
    let mut state = model.start(ctx, 1).expect("start");
    model
        .step(&mut state, &prompt, StepOptions::last())
        .map(|o| o.values)
        .expect("prompt step");
    state
}

/// Times `iters` single-token steps; with `reproject`, each step also
/// projects every block's image keys and values again, as a decoder without
/// an image cache would.
fn time_steps(
    model: &VisionLanguageDecoder,
    image: &Tensor,
    reproject: bool,
    iters: u64,
) -> Duration {
    let token = Tensor::ones((1, 1), DType::U32, model.device()).expect("token");
    let ctx = model.image_context(image, None).expect("image context");
    let mut state = fresh_state(model, &ctx);
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        if state.position() >= MAX_TEXT {
            state = fresh_state(model, &ctx);
        }
        let start = Instant::now();
        if reproject {
            // The same keys and values as in `state`'s context, projected
            // again: the cost a decoder without an image cache pays.
            std::hint::black_box(model.image_context(image, None).expect("image context"));
        }
        let logits = model
            .step(&mut state, &token, StepOptions::last())
            .map(|o| o.values);
        std::hint::black_box(logits.expect("step"));
        total += start.elapsed();
    }
    total
}

fn decode_step(c: &mut Criterion) {
    let dev = Device::Cpu;
    let cfg = gpt2_small();
    let vars = VarMap::new();
    let dense = VisionLanguageDecoder::load(VarBuilder::from_varmap(&vars, DType::F32, &dev), &cfg)
        .expect("load");
    let image = Tensor::randn(0f32, 1., (1, IMAGE_TOKENS, cfg.memory_dim), &dev).expect("image");
    let q8 = dense.quantize(GgmlDType::Q8_0).expect("q8_0");
    let q4k = dense.quantize(GgmlDType::Q4K).expect("q4k");

    let mut group = c.benchmark_group("decode_step_gpt2_small_197_image_tokens");
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(2));
    group.measurement_time(Duration::from_secs(8));
    for (name, model) in [("f32", &dense), ("q8_0", &q8), ("q4k", &q4k)] {
        group.bench_function(BenchmarkId::new("cached_image_kv", name), |b| {
            b.iter_custom(|iters| time_steps(model, &image, false, iters))
        });
    }
    for (name, model) in [("f32", &dense), ("q8_0", &q8)] {
        group.bench_function(BenchmarkId::new("reprojected_image", name), |b| {
            b.iter_custom(|iters| time_steps(model, &image, true, iters))
        });
    }
    group.finish();
}

/// One projection of a decode step (a matrix-vector product) per weight
/// format: the FFN's `up` and `down` and the LM head.
fn proj_matvec(c: &mut Criterion) {
    let dev = Device::Cpu;
    let mut group = c.benchmark_group("proj_matvec");
    group.sample_size(20);
    for (out_dim, in_dim) in [(3072usize, 768usize), (768, 3072), (50257, 768)] {
        let w = Tensor::randn(0f32, 0.02, (out_dim, in_dim), &dev).expect("weight");
        let dense = Proj::from(Linear::new(w, None));
        let x = Tensor::randn(0f32, 1., (1, 1, in_dim), &dev).expect("x");
        for (name, format) in [
            ("f32", None),
            ("q8_0", Some(GgmlDType::Q8_0)),
            ("q4k", Some(GgmlDType::Q4K)),
        ] {
            let p = match format {
                None => dense.clone(),
                Some(f) => dense.quantize("proj", f).expect("quantize"),
            };
            let id = BenchmarkId::new(name, format!("{out_dim}x{in_dim}"));
            group.bench_function(id, |b| b.iter(|| p.forward(&x).expect("forward")));
        }
    }
    group.finish();
}

criterion_group!(benches, proj_matvec, decode_step);
criterion_main!(benches);
