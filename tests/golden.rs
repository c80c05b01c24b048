//! The shipped captioners' greedy captions of the sample images, which were
//! drawn by `vl render-shapes` (seed 7) and are listed with their true
//! captions in `models/shapes-captioner/samples/captions.tsv`: the shipped
//! captioner, and the one with a resampler of 4 queries between its ViT and
//! its decoder.
#![allow(missing_docs)]

use std::path::Path;

use vl::captioner::{Captioner, ImageInput, Request};
use vl::vl_vision::preprocess::load_image;
use vl::LoadOptions;

const MODEL: &str = "models/shapes-captioner";
const RESAMPLER_MODEL: &str = "models/shapes-captioner-resampler";

#[test]
fn shipped_model_captions_its_samples() -> anyhow::Result<()> {
    captions_the_samples(MODEL)
}

/// The resampler model captions the same samples right, reading 4 image
/// tokens instead of the ViT's 17.
#[test]
fn resampler_model_captions_the_samples() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let captioner = Captioner::load(&root.join(RESAMPLER_MODEL), &LoadOptions::default())?;
    let img = load_image(&root.join(MODEL).join("samples/scene_0000.png"))?;
    let pixels = captioner.pixels(&img)?;
    let vision = captioner.model().vision()?;
    let batch = pixels.unsqueeze(0)?;
    assert_eq!(vision.encoder().forward(&batch)?.dims(), &[1, 17, 64]);
    assert_eq!(vision.encode(&[pixels])?.dims(), &[1, 4, 64]);
    captions_the_samples(RESAMPLER_MODEL)
}

fn captions_the_samples(model: &str) -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let captioner = Captioner::load(&root.join(model), &LoadOptions::default())?;
    let listing = std::fs::read_to_string(root.join(MODEL).join("samples/captions.tsv"))?;
    let request = Request {
        generation: captioner.greedy_config(15),
        prompt: None,
        task: None,
    };
    let samples: Vec<(std::path::PathBuf, &str)> = listing
        .lines()
        .map(|line| {
            let (file, want) = line.split_once('\t').expect("file<TAB>caption");
            (root.join(MODEL).join("samples").join(file), want)
        })
        .collect();
    assert!(samples.len() >= 4, "only {} samples listed", samples.len());
    // The files themselves, read by the captioner, in batches.
    let inputs: Vec<ImageInput> = samples.iter().map(|(p, _)| ImageInput::from(p)).collect();
    let got = captioner.caption(&inputs, &request)?;
    assert_eq!(got.len(), samples.len());
    for ((path, want), got) in samples.iter().zip(got) {
        let got = got?;
        assert_eq!(got.text, *want, "{model}: {}", path.display());
        // The ids end with the end token.
        assert_eq!(
            got.token_ids.last(),
            Some(&captioner.model().config.decoder.eos_token_id)
        );
    }
    Ok(())
}
