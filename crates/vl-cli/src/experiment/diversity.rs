//! `vl experiment diversity`: captions sampled at temperature 1 from a
//! fixed set of shapes scenes, at several rates of dropout on the
//! cross-attention map (query side: each text position's weights over the
//! image tokens, dropped at sampling time with inverted scaling, see
//! `VisionLanguageDecoder::set_cross_map_dropout`).
//!
//! For each rate: the mean number of distinct captions among the samples of
//! one image, the mean number of distinct scenes they read back into, and
//! the share of samples whose scene is right. Writes `diversity.json` and
//! `diversity.png`.
//!
//! Seeded: scenes from `--scene-seed`, sampling streams from `--seed`
//! (one per sample), dropout masks from `--seed` too.

use std::collections::HashSet;

use anyhow::Context;
use candle_core::Tensor;
use image::DynamicImage;
use vl::captioner::{Captioner, Request};
use vl::vl_decoder::Strategy;
use vl::vl_shapes::{dataset_scene, parse_caption, score};

use super::{command_line, write_json, Output};
use crate::args::ModelArgs;
use crate::plot::{self, Axis, Legend, Panel, Series};

/// Sample captions under cross-attention-map dropout.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    out: Output,
    #[command(flatten)]
    model: ModelArgs,
    /// Scenes captioned.
    #[arg(long, default_value_t = 100)]
    images: u64,
    /// Captions sampled per scene and rate.
    #[arg(long, default_value_t = 16)]
    samples: usize,
    /// Dropout rates on the cross-attention map, comma-separated, each in
    /// [0, 1).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8"
    )]
    rates: Vec<f64>,
    /// Sampling temperature.
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    /// Seed of the sampling streams and of the dropout masks.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Dataset seed of the scenes.
    #[arg(long, default_value_t = 7)]
    scene_seed: u64,
}

/// One rate's numbers.
#[derive(Debug, serde::Serialize)]
struct Point {
    rate: f64,
    /// Mean over images of the distinct captions among its samples.
    distinct_captions: f64,
    /// Mean over images of the distinct scenes its samples read back into
    /// (captions that do not parse count as one more).
    distinct_scenes: f64,
    /// Share of all samples whose scene is right.
    scene_accuracy: f64,
    /// The samples of the first image, as an example.
    example: Vec<String>,
}

#[derive(Debug, serde::Serialize)]
struct Report {
    command: String,
    model: String,
    images: u64,
    samples: usize,
    temperature: f64,
    seed: u64,
    scene_seed: u64,
    example_truth: String,
    points: Vec<Point>,
}

/// Runs `vl experiment diversity`.
pub fn run(args: &Args) -> anyhow::Result<()> {
    anyhow::ensure!(args.samples > 0, "--samples must be positive");
    anyhow::ensure!(args.images > 0, "--images must be positive");
    let (json, png) = args.out.paths("diversity")?;
    let mut captioner = Captioner::new(args.model.load()?);
    let scenes: Vec<_> = (0..args.images)
        .map(|i| dataset_scene(args.scene_seed, i))
        .collect();
    let pixels = scenes
        .iter()
        .map(|s| captioner.pixels(&DynamicImage::ImageRgb8(s.render())))
        .collect::<vl::Result<Vec<Tensor>>>()?;
    let max_tokens = captioner.model().config.decoder.max_position_embeddings - 1;
    let request = Request {
        generation: captioner
            .greedy_config(max_tokens)
            .with_strategy(Strategy::Sample {
                temperature: args.temperature,
                top_k: None,
                top_p: None,
                seed: args.seed,
            }),
        prompt: None,
        task: None,
    };
    let mut points = Vec::new();
    for &rate in &args.rates {
        captioner
            .model_mut()
            .decoder
            .set_cross_map_dropout(rate, args.seed)
            .with_context(|| format!("--rates {rate}"))?;
        let (mut distinct, mut distinct_scenes, mut correct) = (0usize, 0usize, 0usize);
        let mut example = Vec::new();
        for (i, (scene, px)) in scenes.iter().zip(&pixels).enumerate() {
            // One image repeated: each row samples from its own stream.
            let batch = vec![px.clone(); args.samples];
            let caps = captioner.caption_pixels(&batch, &request, &mut |_| {})?;
            let texts: Vec<String> = caps.into_iter().map(|c| c.text).collect();
            distinct += texts.iter().collect::<HashSet<_>>().len();
            distinct_scenes += texts
                .iter()
                .map(|t| parse_caption(t).ok())
                .collect::<HashSet<_>>()
                .len();
            correct += texts.iter().filter(|t| score(t, scene)).count();
            if i == 0 {
                example = texts;
            }
        }
        let n = args.images as f64;
        let point = Point {
            rate,
            distinct_captions: distinct as f64 / n,
            distinct_scenes: distinct_scenes as f64 / n,
            scene_accuracy: correct as f64 / (n * args.samples as f64),
            example,
        };
        eprintln!(
            "rate {rate:.2}: {:.2} distinct captions, {:.2} distinct scenes per image, scene accuracy {:.3}",
            point.distinct_captions, point.distinct_scenes, point.scene_accuracy
        );
        points.push(point);
    }
    captioner
        .model_mut()
        .decoder
        .set_cross_map_dropout(0.0, 0)?;

    let line = |f: &dyn Fn(&Point) -> f64| -> Vec<(f64, f64)> {
        points.iter().map(|p| (p.rate, f(p))).collect()
    };
    let panels = [
        Panel {
            title: format!(
                "diversity: {} samples per image, temperature {}",
                args.samples, args.temperature
            ),
            x: Axis::linear("cross-attention-map dropout rate"),
            y: Axis::linear("per image (mean)").range(0.0, args.samples as f64 + 0.5),
            series: vec![
                Series::new("distinct captions", line(&|p| p.distinct_captions)),
                Series::new("distinct scenes", line(&|p| p.distinct_scenes)),
            ],
            legend: Legend::UpperLeft,
        },
        Panel {
            title: "accuracy of the samples".into(),
            x: Axis::linear("cross-attention-map dropout rate"),
            y: Axis::linear("scene accuracy").range(0.0, 1.0),
            series: vec![Series::new("scene accuracy", line(&|p| p.scene_accuracy))],
            legend: Legend::LowerLeft,
        },
    ];
    plot::write_png(&png, &panels, 2, (560, 420))?;
    write_json(
        &json,
        &Report {
            command: command_line(),
            model: args.model.name(),
            images: args.images,
            samples: args.samples,
            temperature: args.temperature,
            seed: args.seed,
            scene_seed: args.scene_seed,
            example_truth: scenes[0].caption(),
            points,
        },
    )?;
    println!("wrote {} and {}", json.display(), png.display());
    Ok(())
}
