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

/// Borrowed RGB pixels (`ImageInput::Rgb8`, what the Python package
/// passes for a NumPy array) are captioned as the decoded image is, at the
/// model's size (read in place) and at another (resized); a buffer of the
/// wrong length is that input's own error, the others still captioned.
#[test]
fn borrowed_pixels_caption_as_the_image() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let captioner = Captioner::load(&root.join(MODEL), &LoadOptions::default())?;
    let side = captioner.model().vision()?.spec().width as u32;
    let request = Request::new(captioner.greedy_config(15));
    for file in ["scene_0001.png", "scene_0002.png"] {
        let img = load_image(&root.join(MODEL).join("samples").join(file))?;
        let rgb = img.to_rgb8();
        // The sample (at the model's size) and a 3x upscale of it.
        let big = image::imageops::resize(&rgb, side * 3, side * 2, image::imageops::Nearest);
        let big_img = image::DynamicImage::ImageRgb8(big.clone());
        let short = &rgb.as_raw()[..rgb.as_raw().len() - 3];
        let inputs = [
            ImageInput::Image(&img),
            ImageInput::Rgb8 {
                width: rgb.width(),
                height: rgb.height(),
                pixels: rgb.as_raw(),
            },
            ImageInput::Image(&big_img),
            ImageInput::Rgb8 {
                width: big.width(),
                height: big.height(),
                pixels: big.as_raw(),
            },
            ImageInput::Rgb8 {
                width: rgb.width(),
                height: rgb.height(),
                pixels: short,
            },
        ];
        assert_eq!(
            rgb.dimensions(),
            (side, side),
            "{file}: a sample at the model's size"
        );
        let got = captioner.caption(&inputs, &request)?;
        let text = |i: usize| -> String {
            match &got[i] {
                Ok(c) => c.text.clone(),
                Err(e) => panic!("{file}: input {i}: {e}"),
            }
        };
        assert_eq!(text(1), text(0), "{file}: in place");
        assert_eq!(text(3), text(2), "{file}: resized");
        let err = got[4].as_ref().expect_err("a short buffer").to_string();
        assert!(
            err.contains(&format!("need {} bytes", rgb.as_raw().len())),
            "{err}"
        );
    }
    Ok(())
}

/// Captions started at different steps and stepped together, each with
/// its own settings (greedy, beams, heatmaps or not), are the captions
/// that `caption_pixels` gives each image alone: text, ids and heatmaps.
#[test]
fn captions_joining_a_running_batch_equal_each_alone() -> anyhow::Result<()> {
    use vl::captioner::Captioning;
    use vl::vl_decoder::Strategy;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let captioner = Captioner::load(&root.join(MODEL), &LoadOptions::default())?;
    let greedy = captioner.greedy_config(15);
    let maps = captioner.with_heatmaps(&greedy)?;
    let beams = greedy.clone().with_strategy(Strategy::beam(3));
    let settings = [greedy.clone(), beams, maps, greedy];
    let pixels: Vec<candle_core::Tensor> = (0..6)
        .map(|i| {
            let img = load_image(&root.join(MODEL).join(format!("samples/scene_000{i}.png")))?;
            captioner.pixels(&img).map_err(anyhow::Error::from)
        })
        .collect::<anyhow::Result<_>>()?;
    let side = captioner.model().vision()?.spec().width as u32;
    let mut running: Vec<(usize, Captioning)> = Vec::new();
    let mut got = vec![None; pixels.len()];
    let mut joined = 0;
    for step in 0..40 {
        // Two images join at step 0, then one every other step.
        let new: Vec<usize> = match step {
            0 => vec![0, 1],
            s if s % 2 == 0 && s / 2 + 1 < pixels.len() => vec![s / 2 + 1],
            _ => vec![],
        };
        let requests: Vec<Request> = new
            .iter()
            .map(|&i| Request::new(settings[i % settings.len()].clone()))
            .collect();
        let batch: Vec<_> = new.iter().map(|&i| pixels[i].clone()).collect();
        for (&i, c) in
            new.iter()
                .zip(captioner.start(&batch, &vec![(side, side); new.len()], &requests)?)
        {
            running.push((i, c?));
            joined += 1;
        }
        let mut refs: Vec<&mut Captioning> = running.iter_mut().map(|(_, c)| c).collect();
        captioner.step(&mut refs, &mut |_| {})?;
        for (i, c) in std::mem::take(&mut running) {
            if c.is_done() {
                got[i] = Some(captioner.finish(c)?);
            } else {
                running.push((i, c));
            }
        }
    }
    assert_eq!(joined, pixels.len());
    for (i, got) in got.into_iter().enumerate() {
        let got = got.ok_or_else(|| anyhow::anyhow!("image {i} did not end"))?;
        let request = Request::new(settings[i % settings.len()].clone());
        let alone = captioner.caption_pixels(&pixels[i..=i], &request, &mut |_| {})?;
        assert_eq!(got.text, alone[0].text, "image {i}");
        assert_eq!(got.token_ids, alone[0].token_ids, "image {i}");
        assert_eq!(got.heatmaps.len(), alone[0].heatmaps.len(), "image {i}");
        for (a, b) in got.heatmaps.iter().zip(&alone[0].heatmaps) {
            let d = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(d < 1e-5, "image {i}: heatmap differs by {d}");
        }
    }
    Ok(())
}
