//! `vl eval-shapes`: scene accuracy of a captioner on fresh shapes scenes.

use std::num::NonZeroUsize;

use image::DynamicImage;
use vl::captioner::{Captioner, ImageInput, Request};
use vl::vl_shapes::{dataset_scene, score};

use crate::args::ModelArgs;

/// Measure scene accuracy on fresh scenes.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Scenes to caption.
    #[arg(long, default_value_t = 1000)]
    n: u64,
    /// Dataset seed of the scenes.
    #[arg(long, default_value_t = EVAL_SEED)]
    seed: u64,
    /// Images captioned together.
    #[arg(long, default_value = "100", value_parser = crate::args::positive)]
    batch_size: NonZeroUsize,
}

/// Captions `--n` scenes greedily and prints one JSON line:
/// `{"model", "seed", "n", "correct", "scene_accuracy"}`; each miss goes to
/// stderr.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let captioner = Captioner::new(args.model.load()?);
    let correct = count_correct(
        &captioner,
        args.seed,
        args.n,
        args.batch_size,
        &mut |i, got, want| eprintln!("scene {i}: got {got:?}, want {want:?}"),
    )?;
    let line = serde_json::json!({
        "model": args.model.name(),
        "seed": args.seed,
        "n": args.n,
        "correct": correct,
        "scene_accuracy": correct as f64 / args.n.max(1) as f64,
    });
    println!("{line}");
    Ok(())
}

/// The dataset seed of `vl eval-shapes` (fresh scenes, neither training's
/// nor the held-out evaluation's during training).
pub const EVAL_SEED: u64 = 20_261_130;

/// Captions scenes `0..n` of dataset `seed` greedily, `batch_size` at a
/// time, and returns how many read back into their scene; each miss goes
/// to `on_miss(index, caption, true caption)`.
pub fn count_correct(
    captioner: &Captioner,
    seed: u64,
    n: u64,
    batch_size: NonZeroUsize,
    on_miss: &mut dyn FnMut(u64, &str, &str),
) -> anyhow::Result<u64> {
    let max_tokens = captioner.model().config.decoder.max_position_embeddings - 1;
    let request = Request {
        generation: captioner.greedy_config(max_tokens),
        prompt: None,
        task: None,
    };
    let mut correct = 0u64;
    let mut start = 0;
    while start < n {
        let end = (start + batch_size.get() as u64).min(n);
        let scenes: Vec<_> = (start..end).map(|i| dataset_scene(seed, i)).collect();
        let images: Vec<DynamicImage> = scenes
            .iter()
            .map(|s| DynamicImage::ImageRgb8(s.render()))
            .collect();
        let inputs: Vec<ImageInput> = images.iter().map(ImageInput::from).collect();
        for (i, (c, scene)) in captioner
            .caption(&inputs, &request)?
            .into_iter()
            .zip(&scenes)
            .enumerate()
        {
            let c = c?;
            if score(&c.text, scene) {
                correct += 1;
            } else {
                on_miss(start + i as u64, &c.text, &scene.caption());
            }
        }
        start = end;
    }
    Ok(correct)
}
