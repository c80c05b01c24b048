//! Audio queries video: audio frames (2, 50, 256) attend to video tokens
//! (2, 16, 512) through cross-attention of inner width 128 with 4 heads.
//!
//! `cargo run --release --example cross_attention_av`

use std::process::ExitCode;

use anyhow::{ensure, Context};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use vl::vl_attn::{CrossAttention, CrossAttentionConfig, Weights};

fn run() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let vars = VarMap::new();
    let cfg = CrossAttentionConfig {
        inner_dim: 128,
        out_dim: 256,
        ..CrossAttentionConfig::new(256, 512, 4)
    };
    let attn = CrossAttention::load(VarBuilder::from_varmap(&vars, DType::F32, &dev), &cfg)?;
    let audio = Tensor::randn(0f32, 1., (2, 50, 256), &dev)?;
    let video = Tensor::randn(0f32, 1., (2, 16, 512), &dev)?;
    let kv = attn.project_memory(&video)?;
    let got = attn.attend(&audio, &kv, None, Weights::Return)?;
    let (out, weights) = (got.output, got.weights.context("weights were asked for")?);
    println!("audio (queries): {:?}", audio.dims());
    println!("video (memory):  {:?}", video.dims());
    println!("output:          {:?}", out.dims());
    println!("weights:         {:?}", weights.dims());
    let sums = weights.sum(D::Minus1)?.flatten_all()?.to_vec1::<f32>()?;
    let worst = sums.iter().map(|s| (s - 1.0).abs()).fold(0f32, f32::max);
    ensure!(worst <= 1e-5, "a weight row sums to 1 ± {worst}");
    println!(
        "every weight row sums to 1 (max deviation {worst:.1e}, {} rows)",
        sums.len()
    );
    let _ = out.to_dtype(DType::F32).context("output")?;
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
