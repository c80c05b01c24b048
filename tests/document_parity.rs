//! Parity with transformers on the committed document-model fixtures
//! (`scripts/document_fixtures.py`): Donut- and Nougat-shaped
//! vision-encoder-decoder checkpoints, a `donut-swin` encoder under an
//! mBART decoder, each read with its own image processor's settings.
//!
//! - pixels of `image.png`, which the processor's steps bring to the input
//!   size without resampling (Donut's: rotated, padded; Nougat's: margins
//!   cropped, padded), within 1e-5;
//! - the encoder's state, teacher-forced logits in one pass and cached
//!   (≤ 1e-4), greedy, 3-beam and default ids with their text;
//! - images that need resampling (`other_*.png`): pixels within a few
//!   grey levels of PIL's (vl resizes with the `image` crate), greedy ids
//!   equal;
//! - Donut's prompt: a task token that replaces the start token; the
//!   output's text and JSON as `DonutProcessor` reads them.
#![allow(missing_docs)]

mod parity;

use candle_core::{DType, Device};
use vl::captioner::{Captioner, ImageInput, Request};
use vl::vl_vision::preprocess::{load_image, preprocess};
use vl::vl_vision::{DocumentFit, Resample, VisionConfig};
use vl::{LoadOptions, ModelFormat};

use parity::{check_forward, check_generation, load, max_abs_diff, Fixture, GeneratedIds};

const FAMILY: &str = "document";

/// The pixels of a resampled image may differ from PIL's by a rounding of
/// its resize: 4 grey levels, over the std.
const RESAMPLED_PIXEL_TOL: f32 = 4.0 / 255.0 / 0.224;

#[derive(serde::Deserialize)]
struct Expected {
    others: std::collections::BTreeMap<String, Vec<u32>>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    prompted: Option<Vec<u32>>,
    #[serde(default)]
    prompted_text: Option<String>,
    #[serde(default)]
    prompted_json: Option<serde_json::Value>,
    #[serde(default)]
    defaults_markdown: Option<String>,
}

/// The fixture's captioner, f32 on the CPU.
fn captioner(f: &Fixture<Expected>) -> anyhow::Result<Captioner> {
    Ok(Captioner::load(
        f.dir.as_path(),
        &LoadOptions::new(DType::F32, &Device::Cpu),
    )?)
}

/// The caption of one image file, or its error.
fn caption(
    captioner: &Captioner,
    path: &std::path::Path,
    request: &Request,
) -> anyhow::Result<vl::captioner::Caption> {
    let mut out = captioner.caption(&[ImageInput::Path(path)], request)?;
    Ok(out.remove(0)?)
}

fn run_parity(kind: &str) -> anyhow::Result<Fixture<Expected>> {
    let ids: Fixture<GeneratedIds> = load(FAMILY, kind)?;
    assert_eq!(ids.model.format, ModelFormat::VisionEncoderDecoder);
    let ctx = check_forward(&ids, kind, "encoder_last_hidden_state", "decoder_input_ids")?;
    check_generation(&ids, &ctx, kind)?;

    // Images the processor resamples: their pixels near PIL's, their ids
    // transformers'.
    let f: Fixture<Expected> = load(FAMILY, kind)?;
    let spec = *f.model.pixel_spec()?;
    let captioner = captioner(&f)?;
    for (file, want) in &f.expected.others {
        let img = load_image(&f.dir.join(file))?;
        let pixels = preprocess(&img, &spec, &Device::Cpu)?.unsqueeze(0)?;
        let stem = file.trim_end_matches(".png");
        let d = max_abs_diff(&pixels, &f.tensors[&format!("pixel_values_{stem}")])?;
        eprintln!("{kind}: {file} pixels max abs diff {d:e}");
        assert!(
            d <= RESAMPLED_PIXEL_TOL,
            "{kind}: {file}: pixels differ by {d}"
        );
        let request = Request::new(vl::vl_decoder::GenerationConfig {
            bad_words_ids: Vec::new(),
            ..captioner.greedy_config(20)
        });
        let got = caption(&captioner, &f.dir.join(file), &request)?;
        assert_eq!(&got.token_ids, want, "{kind}: {file}: greedy ids");
    }
    Ok(f)
}

fn document_fit(f: &Fixture<Expected>) -> (VisionConfig, Option<DocumentFit>) {
    let cfg = f.model.config.vision.clone().expect("a vision config");
    let fit = f.model.pixel_spec().expect("a pixel spec").document;
    (cfg, fit)
}

/// Donut: `DonutImageProcessor` with `do_align_long_axis`, its size read
/// as `[width, height]`; a Swin as wide as the decoder; a task token as the
/// prompt.
#[test]
fn donut_matches_transformers() -> anyhow::Result<()> {
    let f = run_parity("donut")?;
    let (cfg, fit) = document_fit(&f);
    assert!(matches!(cfg, VisionConfig::Swin(_)));
    assert_eq!(f.model.pixel_spec()?.size(), (64, 48));
    assert_eq!(
        fit,
        Some(DocumentFit {
            crop_margin: false,
            align_long_axis: true,
            thumbnail: Some(Resample::Bilinear),
            pad: true,
        })
    );

    // The prompt replaces the start token, as transformers' generate does
    // for a donut encoder.
    let captioner = captioner(&f)?;
    let mut request = Request::new(captioner.greedy_config(20));
    request.prompt = f.expected.prompt.as_deref();
    let got = caption(&captioner, &f.dir.join("image.png"), &request)?;
    assert_eq!(
        Some(&got.token_ids),
        f.expected.prompted.as_ref(),
        "prompted ids"
    );
    // Read as DonutProcessor reads it: the text, then token2json.
    assert_eq!(Some(&got.text), f.expected.prompted_text.as_ref());
    assert_eq!(
        got.document
            .as_ref()
            .map(serde_json::to_value)
            .transpose()?,
        f.expected.prompted_json
    );
    assert_eq!(
        got.to_json(None)["document"],
        f.expected.prompted_json.clone().unwrap_or_default()
    );
    Ok(())
}

/// Nougat: `NougatImageProcessor` named only by `processor_class`, its
/// defaults (margins cropped, bicubic thumbnail, ImageNet's mean and std);
/// a narrower Swin through `enc_to_dec_proj`.
#[test]
fn nougat_matches_transformers() -> anyhow::Result<()> {
    let f = run_parity("nougat")?;
    let (_, fit) = document_fit(&f);
    assert_eq!(
        fit,
        Some(DocumentFit {
            crop_margin: true,
            align_long_axis: false,
            thumbnail: Some(Resample::Bicubic),
            pad: true,
        })
    );
    assert_eq!(f.model.pixel_spec()?.mean, [0.485, 0.456, 0.406]);
    // The caption is the page's Markdown, as NougatProcessor's
    // post_process_generation gives it.
    let captioner = captioner(&f)?;
    let got = caption(
        &captioner,
        &f.dir.join("image.png"),
        &Request::new(captioner.model().generation.clone()),
    )?;
    assert_eq!(Some(&got.text), f.expected.defaults_markdown.as_ref());
    Ok(())
}

/// A checkpoint directory without `preprocessor_config.json` takes
/// `DonutImageProcessor`'s defaults under a Swin.
#[test]
fn a_swin_without_preprocessor_takes_donuts_defaults() -> anyhow::Result<()> {
    let dir = parity::copy_fixture(FAMILY, "nougat")?;
    std::fs::remove_file(dir.path().join("preprocessor_config.json"))?;
    let model = vl::load(dir.path(), &LoadOptions::default())?;
    let spec = model.pixel_spec()?;
    assert_eq!(spec.mean, [0.5; 3]);
    assert_eq!(
        spec.document,
        Some(DocumentFit {
            crop_margin: false,
            align_long_axis: false,
            thumbnail: Some(Resample::Bilinear),
            pad: true,
        })
    );
    Ok(())
}
