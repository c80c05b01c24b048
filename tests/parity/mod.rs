//! What the transformers parity tests share (`hf_parity`, `trocr_parity`,
//! `blip_parity`): the committed fixtures under `tests/fixtures/FAMILY/KIND`,
//! the tolerances, and the forward-pass checks every family runs.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, D};
use serde::de::DeserializeOwned;
use vl::vl_decoder::{ForwardMasks, ImageContext, StepOptions};
use vl::vl_vision::preprocess::{load_image, preprocess};
use vl::vl_vision::VisionEncoder;
use vl::VlModel;

/// f32 parity bound of the issue: max abs diff of hidden states and logits.
pub const TOL: f32 = 1e-4;
/// Pixels: one rounding of `(x / 255 - mean) / std` apart at most.
pub const PIXEL_TOL: f32 = 1e-5;

/// `tests/fixtures/{family}/{kind}`.
pub fn fixture(family: &str, kind: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(family)
        .join(kind)
}

/// A loaded fixture: the model, transformers' tensors
/// (`expected.safetensors`) and its other outputs (`expected.json`).
pub struct Fixture<E> {
    pub model: VlModel,
    pub tensors: HashMap<String, Tensor>,
    pub expected: E,
    pub dir: PathBuf,
}

pub fn load<E: DeserializeOwned>(family: &str, kind: &str) -> anyhow::Result<Fixture<E>> {
    let dir = fixture(family, kind);
    let model = vl::load(&dir, &vl::LoadOptions::new(DType::F32, &Device::Cpu))?;
    let tensors = candle_core::safetensors::load(dir.join("expected.safetensors"), &Device::Cpu)?;
    let expected = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json"))?)?;
    Ok(Fixture {
        model,
        tensors,
        expected,
        dir,
    })
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> anyhow::Result<f32> {
    assert_eq!(a.dims(), b.dims());
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

/// A copy of the fixture's files in a temporary directory, to edit.
pub fn copy_fixture(family: &str, kind: &str) -> anyhow::Result<tempfile::TempDir> {
    let tmp = tempfile::tempdir()?;
    for entry in std::fs::read_dir(fixture(family, kind))? {
        let entry = entry?;
        std::fs::copy(entry.path(), tmp.path().join(entry.file_name()))?;
    }
    Ok(tmp)
}

/// The one-line error of loading `dir`, which must fail.
pub fn load_err(dir: &Path) -> String {
    format!(
        "{:#}",
        vl::load(dir, &vl::LoadOptions::new(DType::F32, &Device::Cpu)).expect_err("must fail")
    )
}

/// The checks of one forward pass against transformers: the PNG's pixels
/// (≤ [`PIXEL_TOL`]), the encoder's last hidden state (tensor `hidden`),
/// teacher-forced logits of the ids in tensor `ids` in one pass and
/// through the cache (≤ [`TOL`]) with the same argmax. Returns the image
/// context for generation.
pub fn check_forward<E>(
    f: &Fixture<E>,
    kind: &str,
    hidden: &str,
    ids: &str,
) -> anyhow::Result<ImageContext> {
    let want_pixels = &f.tensors["pixel_values"];
    let img = load_image(&f.dir.join("image.png"))?;
    let spec = *f.model.pixel_spec()?;
    let pixels = preprocess(&img, &spec, &Device::Cpu)?.unsqueeze(0)?;
    let d = max_abs_diff(&pixels, want_pixels)?;
    eprintln!("{kind}: pixels max abs diff {d:e}");
    assert!(d <= PIXEL_TOL, "{kind}: pixel values differ by {d}");

    // Before any projection into the decoder's width.
    let state = match f.model.vision.as_ref().map(|v| v.encoder()) {
        Some(VisionEncoder::Vit(vit)) => vit.last_hidden_state(want_pixels)?,
        Some(VisionEncoder::Swin(swin)) => swin.last_hidden_state(want_pixels)?,
        _ => panic!("{kind}: expected a ViT or Swin encoder"),
    };
    let d = max_abs_diff(&state, &f.tensors[hidden])?;
    eprintln!("{kind}: encoder hidden state max abs diff {d:e}");
    assert!(d <= TOL, "{kind}: encoder hidden state differs by {d}");

    let memory = f.model.encode_pixels(want_pixels)?;
    let ids = f.tensors[ids].to_dtype(DType::U32)?;
    let decoder = &f.model.decoder;
    let logits = decoder.forward(&ids, Some(&memory), ForwardMasks::default())?;
    let want = &f.tensors["logits"];
    let d = max_abs_diff(&logits, want)?;
    eprintln!("{kind}: teacher-forced logits max abs diff {d:e}");
    assert!(d <= TOL, "{kind}: teacher-forced logits differ by {d}");
    let ctx = decoder.image_context(&memory, None)?;
    let mut state = decoder.start(&ctx, 1)?;
    let stepped = decoder.step(&mut state, &ids, StepOptions::all())?.values;
    let d = max_abs_diff(&stepped, want)?;
    eprintln!("{kind}: cached logits max abs diff {d:e}");
    assert!(d <= TOL, "{kind}: cached logits differ by {d}");
    assert_eq!(
        logits.argmax(D::Minus1)?.to_vec2::<u32>()?,
        want.argmax(D::Minus1)?.to_vec2::<u32>()?
    );
    Ok(ctx)
}

/// The model's logits for a fixed token sequence over its own encoding of
/// a fixed image.
pub fn logits(model: &VlModel) -> anyhow::Result<Tensor> {
    let (h, w) = model.pixel_spec()?.size();
    let n = 3 * h * w;
    let pixels = Tensor::arange(0f32, n as f32, &Device::Cpu)?
        .affine(1.0 / n as f64, -0.5)?
        .reshape((1, 3, h, w))?;
    let memory = model.encode_pixels(&pixels)?;
    let vocab = model.decoder.config().vocab_size as u32;
    let ids: Vec<u32> = (0..6u32).map(|i| (i * 7 + 3) % vocab).collect();
    let tokens = Tensor::from_vec(ids, (1, 6), &Device::Cpu)?;
    Ok(model
        .decoder
        .forward(&tokens, Some(&memory), Default::default())?)
}

/// transformers' generated ids of a vision-encoder-decoder fixture
/// (`expected.json`): greedy and 3 beams for 20 new tokens without the
/// checkpoint's n-gram ban or minimum, the checkpoint's own defaults, and
/// the defaults' text; each after the start token.
#[derive(serde::Deserialize)]
pub struct GeneratedIds {
    pub greedy: Vec<u32>,
    pub beam3: Vec<u32>,
    pub defaults: Vec<u32>,
    pub defaults_text: String,
}

/// Checks vl's greedy, 3-beam and default-settings generation from `ctx`
/// against [`GeneratedIds`], and the defaults' decoded text.
pub fn check_generation(
    f: &Fixture<GeneratedIds>,
    ctx: &ImageContext,
    kind: &str,
) -> anyhow::Result<()> {
    use vl::vl_decoder::{generate, EarlyStopping, GenerationConfig, Strategy};
    let plain = GenerationConfig {
        max_new_tokens: 20,
        min_new_tokens: 0,
        no_repeat_ngram_size: 0,
        repetition_penalty: 1.0,
        ..f.model.generation.clone()
    };
    let run = |cfg: &GenerationConfig| -> anyhow::Result<Vec<u32>> {
        let out = generate(&f.model.decoder, ctx, cfg, &mut |_| {})?;
        Ok(out[0].tokens.clone())
    };
    let greedy = run(&plain.clone().with_strategy(Strategy::Greedy))?;
    assert_eq!(greedy, f.expected.greedy, "{kind}: greedy ids");
    let beam = run(&plain.clone().with_strategy(Strategy::Beam {
        num_beams: 3,
        length_penalty: 1.0,
        early_stopping: EarlyStopping::False,
    }))?;
    assert_eq!(beam, f.expected.beam3, "{kind}: 3-beam ids");
    let defaults = run(&f.model.generation)?;
    assert_eq!(
        defaults, f.expected.defaults,
        "{kind}: default-settings ids"
    );
    let text = f.model.tokenizer.decode(&defaults, true).expect("decode");
    assert_eq!(text, f.expected.defaults_text, "{kind}: decoded text");
    Ok(())
}
