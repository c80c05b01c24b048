//! The shipped captioners' greedy captions of the sample images, which were
//! drawn by `vl render-shapes` (seed 7) and are listed with their true
//! captions in `models/shapes-captioner/samples/captions.tsv`: the shipped
//! captioner, and the one with a resampler of 4 queries between its ViT and
//! its decoder.
#![allow(missing_docs)]

use std::path::Path;

use candle_core::{DType, Device};
use vl::captioner::Captioner;
use vl::vl_vision::preprocess::load_image;

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
    let captioner = Captioner::load(&root.join(RESAMPLER_MODEL), DType::F32, &Device::Cpu)?;
    let img = load_image(&root.join(MODEL).join("samples/scene_0000.png"))?;
    let pixels = captioner.pixels(&img)?.unsqueeze(0)?;
    let vision = captioner.model.vision.as_ref().expect("a ViT");
    assert_eq!(vision.forward(&pixels)?.dims(), &[1, 17, 64]);
    assert_eq!(captioner.model.encode_pixels(&pixels)?.dims(), &[1, 4, 64]);
    captions_the_samples(RESAMPLER_MODEL)
}

fn captions_the_samples(model: &str) -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let captioner = Captioner::load(&root.join(model), DType::F32, &Device::Cpu)?;
    let listing = std::fs::read_to_string(root.join(MODEL).join("samples/captions.tsv"))?;
    let gen = captioner.greedy_config(15);
    let mut n = 0;
    for line in listing.lines() {
        let (file, want) = line.split_once('\t').expect("file<TAB>caption");
        let img = load_image(&root.join(MODEL).join("samples").join(file))?;
        let got = captioner.caption(&[&img], &gen, &mut |_| {})?;
        assert_eq!(got[0].text, want, "{model}: {file}");
        // The ids end with the end token.
        assert_eq!(
            got[0].token_ids.last(),
            Some(&captioner.model.config.decoder.eos_token_id)
        );
        n += 1;
    }
    assert!(n >= 4, "only {n} samples listed");
    Ok(())
}
