//! Interleaved images (Flamingo-style) in cached decoding, on the shapes
//! world: two scenes and one text sequence
//! `<bos> | image A | caption of A | image B | caption of B <eos>`.
//!
//! Prints, for each text position, the image(s) it may attend to with
//! `MostRecent` and `AllPrevious` media attention, then checks that cached
//! step-by-step decoding over an interleaved image context equals the full
//! forward with `mask::interleaved` (random decoder weights: the check
//! holds for any weights; the max diff varies from run to run).
//!
//! `cargo run --example interleaved`
//!
//! Exit codes: 0 success, 1 error (including cached != full).

use std::process::ExitCode;

use anyhow::{ensure, Context};
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use vl::shapes::{batch, caption_ids, tokenizer, vocab_size};
use vl::vl_attn::mask::{self, MediaAttention, MediaSpan};
use vl::vl_decoder::{DecoderConfig, ForwardMasks, StepOptions, VisionLanguageDecoder};
use vl::vl_shapes::IMAGE_SIZE;
use vl::vl_vision::{MockVit, MockVitConfig, PixelSpec};

/// The shapes dataset the two scenes come from, and the first scene.
const DATASET_SEED: u64 = 7;
const FIRST_SCENE: u64 = 0;
const SCENES: usize = 2;
const MEMORY_DIM: usize = 32;
const PATCH_SIZE: usize = 16;
const VIT_SEED: u64 = 0;
/// Cached against full forward (f32).
const TOLERANCE: f32 = 1e-5;
const MODES: [MediaAttention; 2] = [MediaAttention::MostRecent, MediaAttention::AllPrevious];
const IMAGE_NAMES: [&str; SCENES] = ["A", "B"];

fn run() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let side = IMAGE_SIZE as usize;
    let spec = PixelSpec::new(side, [0.5; 3], [0.5; 3]);
    let scenes = batch(DATASET_SEED, FIRST_SCENE, SCENES, &spec, &dev).context("scenes")?;
    let vit_cfg = MockVitConfig {
        image_size: side,
        patch_size: PATCH_SIZE,
        ..MockVitConfig::base(MEMORY_DIM, VIT_SEED)
    };
    let vit = MockVit::new(&vit_cfg, DType::F32, &dev)?;
    // (2, 17, 32): one row per scene.
    let per_scene = vit.forward(&scenes.pixels)?;
    let (_, image_tokens, _) = per_scene.dims3()?;
    // One sample holding both images in order: (1, 34, 32).
    let memory = per_scene.reshape((1, SCENES * image_tokens, MEMORY_DIM))?;

    // <bos> | A | caption A | B | caption B <eos>
    let tok = tokenizer()?;
    let (bos, eos) = (1, 2);
    let captions: Vec<String> = scenes.scenes.iter().map(|s| s.caption()).collect();
    let first = caption_ids(&tok, &captions[0], bos, eos)?;
    let second = caption_ids(&tok, &captions[1], bos, eos)?;
    let mut ids = vec![bos];
    ids.extend_from_slice(&first[1..first.len() - 1]);
    let second_start = ids.len();
    ids.extend_from_slice(&second[1..]);
    let spans = vec![vec![
        MediaSpan {
            text_start: 1,
            tokens: image_tokens,
        },
        MediaSpan {
            text_start: second_start,
            tokens: image_tokens,
        },
    ]];
    let text_len = ids.len();
    let memory_len = SCENES * image_tokens;
    println!("image A: {}", captions[0]);
    println!("image B: {}", captions[1]);
    println!(
        "memory {:?}: {image_tokens} tokens per image; {text_len} text positions",
        memory.dims()
    );

    // Which image each position sees, read off the mask the forward uses.
    let masks = MODES
        .iter()
        .map(|&mode| {
            let m = mask::interleaved(&spans, text_len, memory_len, mode, &dev)?;
            Ok(m.tensor().squeeze(0)?.to_vec2::<u8>()?) // (text_len, memory_len)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let seen = |row: &[u8]| {
        let names: Vec<&str> = IMAGE_NAMES
            .iter()
            .enumerate()
            .filter(|(i, _)| row[i * image_tokens..(i + 1) * image_tokens].contains(&1))
            .map(|(_, n)| *n)
            .collect();
        if names.is_empty() {
            "-".to_string()
        } else {
            names.join("+")
        }
    };
    println!(
        "{:>3}  {:<8}  {:<10}  AllPrevious",
        "pos", "token", "MostRecent"
    );
    for (p, &id) in ids.iter().enumerate() {
        let word = tok.id_to_token(id).unwrap_or_else(|| "?".into());
        println!(
            "{p:>3}  {word:<8}  {:<10}  {}",
            seen(&masks[0][p]),
            seen(&masks[1][p])
        );
    }

    let cfg = DecoderConfig {
        max_position_embeddings: 64,
        ..DecoderConfig::tiny(vocab_size(), MEMORY_DIM)
    };
    let vars = VarMap::new();
    let decoder =
        VisionLanguageDecoder::load(VarBuilder::from_varmap(&vars, DType::F32, &dev), &cfg)?;
    let tokens = Tensor::from_vec(ids.clone(), (1, text_len), &dev)?;
    for mode in MODES {
        let image = mask::interleaved(&spans, text_len, memory_len, mode, &dev)?;
        let full = decoder.forward(
            &tokens,
            Some(&memory),
            ForwardMasks {
                text: None,
                image: Some(&image),
            },
        )?;
        let ctx = decoder.interleaved_context(&memory, &spans, mode)?;
        let mut state = decoder.start(&ctx, 1)?;
        let steps = (0..text_len)
            .map(|t| {
                decoder
                    .step(&mut state, &tokens.narrow(1, t, 1)?, StepOptions::all())
                    .map(|o| o.values)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let cached = Tensor::cat(&steps, 1)?;
        let diff = (cached - &full)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        println!("{mode:?}: cached vs full forward, max abs diff {diff:.2e}");
        ensure!(
            diff <= TOLERANCE,
            "{mode:?}: cached and full logits differ by {diff}"
        );
    }
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
