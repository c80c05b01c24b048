//! Scene accuracy of a captioner on freshly drawn shapes-world scenes, from
//! a seed never used in training (training draws from seed 1, its
//! in-training check from 1000003).
//!
//! `cargo run --release --example eval_shapes -- --n 1000`
//!
//! Prints one JSON line: `{"model", "seed", "n", "correct", "scene_accuracy"}`;
//! wrong captions go to stderr.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use candle_core::{DType, Device};
use clap::Parser;
use image::DynamicImage;
use vl::captioner::Captioner;
use vl::vl_decoder::dir::{parse_device, parse_dtype};
use vl::vl_decoder::Quantization;
use vl::vl_shapes::{dataset_scene, score};

/// Measure scene accuracy on fresh scenes.
#[derive(Parser, Debug)]
struct Args {
    /// The model directory.
    #[arg(long, default_value = "models/shapes-captioner")]
    model: PathBuf,
    /// Scenes to caption.
    #[arg(long, default_value_t = 1000)]
    n: u64,
    /// Dataset seed of the scenes.
    #[arg(long, default_value_t = 20_261_130)]
    seed: u64,
    /// Images captioned together.
    #[arg(long, default_value_t = 100)]
    batch_size: u64,
    /// cpu, cuda[:N] or metal[:N].
    #[arg(long, default_value = "cpu")]
    device: String,
    /// f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Decoder linear layers in 8-bit (q8_0) or 4-bit (q4k) blocks at load; none = as stored.
    #[arg(long, default_value = "none")]
    quantize: Quantization,
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    let device: Device = parse_device(&args.device)?;
    let dtype: DType = parse_dtype(&args.dtype)?;
    let mut captioner = Captioner::load(&args.model, dtype, &device)?;
    captioner
        .quantize(args.quantize)
        .with_context(|| format!("--quantize {}", args.quantize))?;
    let max_tokens = captioner.model.config.decoder.max_position_embeddings - 1;
    let gen = captioner.greedy_config(max_tokens);
    let mut correct = 0u64;
    let mut start = 0;
    while start < args.n {
        let end = (start + args.batch_size.max(1)).min(args.n);
        let scenes: Vec<_> = (start..end).map(|i| dataset_scene(args.seed, i)).collect();
        let images: Vec<DynamicImage> = scenes
            .iter()
            .map(|s| DynamicImage::ImageRgb8(s.render()))
            .collect();
        let refs: Vec<&DynamicImage> = images.iter().collect();
        for (i, (c, scene)) in captioner
            .caption(&refs, &gen, &mut |_| {})?
            .iter()
            .zip(&scenes)
            .enumerate()
        {
            if score(&c.text, scene) {
                correct += 1;
            } else {
                eprintln!(
                    "scene {}: got {:?}, want {:?}",
                    start + i as u64,
                    c.text,
                    scene.caption()
                );
            }
        }
        start = end;
    }
    let line = serde_json::json!({
        "model": args.model.display().to_string(),
        "seed": args.seed,
        "n": args.n,
        "correct": correct,
        "scene_accuracy": correct as f64 / args.n.max(1) as f64,
    });
    println!("{line}");
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
