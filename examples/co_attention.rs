//! Audio and video attend to each other: audio frames (2, 50, 256) query
//! video tokens (2, 16, 512) and video tokens query audio frames, in one
//! co-attention call of inner width 128 with 4 heads. The second clip has
//! 40 real audio frames (the last 10 are padding that video must not read).
//!
//! Prints both output shapes and both weight shapes, and checks that every
//! weight row sums to 1.
//!
//! `cargo run --example co_attention`
//!
//! Exit codes: 0 when every row sums to 1 within 1e-5, 1 otherwise or on
//! any error.

use std::process::ExitCode;

use anyhow::{ensure, Context};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use vl::vl_attn::mask::{self, PaddingSide};
use vl::vl_attn::{CoAttention, CoAttentionConfig, Mask, Weights};

/// The largest accepted deviation of a weight row's sum from 1.
const ROW_SUM_TOLERANCE: f32 = 1e-5;

/// Audio frames per clip, padding included.
const AUDIO_LEN: usize = 50;

/// Real audio frames per clip.
const AUDIO_FRAMES: [usize; 2] = [AUDIO_LEN, 40];

/// The largest `|sum - 1|` over the rows of `weights`, and the row count.
fn worst_row(weights: &Tensor) -> anyhow::Result<(f32, usize)> {
    let sums = weights.sum(D::Minus1)?.flatten_all()?.to_vec1::<f32>()?;
    let worst = sums.iter().map(|s| (s - 1.0).abs()).fold(0f32, f32::max);
    Ok((worst, sums.len()))
}

fn run() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let vars = VarMap::new();
    let cfg = CoAttentionConfig::new(256, 512, 128, 4);
    let co = CoAttention::load(VarBuilder::from_varmap(&vars, DType::F32, &dev), &cfg)?;
    let audio = Tensor::randn(0f32, 1., (2, AUDIO_LEN, 256), &dev)?;
    let video = Tensor::randn(0f32, 1., (2, 16, 512), &dev)?;
    // Which audio frames the video tokens may attend to: (2, 1, 50).
    let audio_keys = Mask::from_keys(&mask::key_padding(
        &AUDIO_FRAMES,
        AUDIO_LEN,
        PaddingSide::Right,
        &dev,
    )?)?;
    let out = co.attend(&audio, &video, Some(&audio_keys), None, Weights::Return)?;
    let audio_weights = out.a_weights.context("weights were asked for")?;
    let video_weights = out.b_weights.context("weights were asked for")?;
    println!("audio (a):                  {:?}", audio.dims());
    println!("video (b):                  {:?}", video.dims());
    println!("audio output:               {:?}", out.a.dims());
    println!("video output:               {:?}", out.b.dims());
    println!("audio weights (over video): {:?}", audio_weights.dims());
    println!("video weights (over audio): {:?}", video_weights.dims());
    for (name, w) in [("audio", &audio_weights), ("video", &video_weights)] {
        let (worst, rows) = worst_row(w)?;
        ensure!(
            worst <= ROW_SUM_TOLERANCE,
            "a row of the {name} weights sums to 1 ± {worst}"
        );
        println!("every {name} weight row sums to 1 (max deviation {worst:.1e}, {rows} rows)");
    }
    // The second clip's padded frames receive no weight at all.
    let (real, len) = (AUDIO_FRAMES[1], AUDIO_LEN);
    let padded = video_weights.get(1)?.narrow(D::Minus1, real, len - real)?;
    let leaked = padded.abs()?.sum_all()?.to_scalar::<f32>()?;
    ensure!(leaked == 0.0, "padded audio frames got weight {leaked}");
    println!("padded audio frames get no weight (clip 1, frames {real}..{len})");
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
