//! The decoder end to end on random weights: a batch of 2 × 10 tokens over
//! MockViT image tokens (197 per image), 4 blocks; checks that step-by-step
//! decoding with the image and text caches equals the full forward pass.
//!
//! `cargo run --release --example decoder_demo`

use std::process::ExitCode;

use anyhow::ensure;
use candle_core::{DType, Device, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use vl::vl_attn::mask;
use vl::vl_decoder::{DecoderConfig, ForwardMasks, StepOptions, VisionLanguageDecoder};
use vl::vl_vision::{MockVit, MockVitConfig};

const BATCH: usize = 2;
const TEXT_LEN: usize = 10;
const VOCAB: usize = 1000;
const MEMORY_DIM: usize = 96;
const SEED: u64 = 0;

fn run() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let cfg = DecoderConfig {
        hidden_size: 64,
        num_attention_heads: 4,
        num_hidden_layers: 4,
        intermediate_size: 256,
        max_position_embeddings: 64,
        ..DecoderConfig::tiny(VOCAB, MEMORY_DIM)
    };
    let vars = VarMap::new();
    let decoder =
        VisionLanguageDecoder::load(VarBuilder::from_varmap(&vars, DType::F32, &dev), &cfg)?;
    let vit = MockVit::new(&MockVitConfig::base(MEMORY_DIM, SEED), DType::F32, &dev)?;
    let images = Tensor::rand(0f32, 1., (BATCH, 3, 224, 224), &dev)?;
    let memory = vit.forward(&images)?; // (2, 197, 96)
    let tokens = Tensor::rand(0f32, VOCAB as f32, (BATCH, TEXT_LEN), &dev)?.to_dtype(DType::U32)?;

    let logits = decoder.forward(&tokens, Some(&memory), ForwardMasks::default())?;
    println!("image tokens shape: {:?}", memory.dims());
    println!("logits shape: {:?}", logits.dims());
    println!(
        "self-attention mask shape: {:?}",
        mask::causal(TEXT_LEN, &dev)?.dims()
    );

    // The first block's cross-attention, applied to the embedded tokens of sample 0.
    if let Some(branch) = decoder.blocks()[0].cross_branch() {
        let x = decoder.embeddings(&tokens, 0)?;
        let out = branch
            .cross_attn
            .forward(&branch.cross_attn_norm.forward(&x)?, &memory, None)?;
        let norms = out
            .sqr()?
            .sum(D::Minus1)?
            .sqrt()?
            .get(0)?
            .to_vec1::<f32>()?;
        let norms: Vec<String> = norms.iter().map(|n| format!("{n:.3}")).collect();
        println!("cross-attention output norms: {}", norms.join(" "));
    }

    // Step by step: image keys/values projected once, one token at a time.
    let ctx = decoder.image_context(&memory, None)?;
    let mut state = decoder.start(&ctx, 1)?;
    let mut steps = Vec::with_capacity(TEXT_LEN);
    for t in 0..TEXT_LEN {
        steps.push(
            decoder
                .step(&mut state, &tokens.narrow(1, t, 1)?, StepOptions::all())?
                .values,
        );
    }
    let stepped = Tensor::cat(&steps, 1)?;
    let diff = (stepped - &logits)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?;
    println!("kv-cache max abs diff: {diff:.2e}");
    ensure!(diff <= 1e-5, "cached and uncached logits differ by {diff}");
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
