//! Parity with transformers on the committed BLIP fixtures
//! (`scripts/blip_fixtures.py` writes them): preprocessing (bicubic, CLIP
//! mean and std), the vision tower's last hidden state, teacher-forced
//! logits of the BERT text decoder in one pass and cached, the ids of
//! greedy, 3-beam and checkpoint-default generation and their text.
#![allow(missing_docs)]

mod parity;

use std::path::Path;

use candle_core::{DType, Device};
use serde::Deserialize;
use vl::captioner::{Captioner, Request};
use vl::vl_decoder::{generate_from, EarlyStopping, GenerationConfig, NormPlacement, Strategy};
use vl::ModelFormat;

use parity::{check_forward, copy_fixture, load, Fixture};

/// The fixtures' folder under `tests/fixtures`.
const FAMILY: &str = "blip";

/// `[DEC]` in the fixtures' tokenizer, `text_config.bos_token_id`.
const DEC: u32 = 5;
/// `[SEP]`, `text_config.sep_token_id`.
const SEP: u32 = 3;
/// New tokens of the fixtures' greedy and 3-beam runs.
const NEW_TOKENS: usize = 12;

#[derive(Deserialize)]
struct Expected {
    greedy: Vec<u32>,
    greedy_text: String,
    beam3: Vec<u32>,
    beam3_text: String,
    defaults: Vec<u32>,
    defaults_text: String,
    prompt: String,
    /// `[DEC]` then the prompt's words, as transformers feeds them.
    prompt_ids: Vec<u32>,
    prompt_greedy: Vec<u32>,
    prompt_greedy_text: String,
    prompt_beam3: Vec<u32>,
    prompt_beam3_text: String,
    prompt_defaults: Vec<u32>,
    prompt_defaults_text: String,
}

fn run_parity(kind: &str) -> anyhow::Result<()> {
    let f: Fixture<Expected> = load(FAMILY, kind)?;
    assert_eq!(f.model.format, ModelFormat::Blip);
    assert_eq!(f.model.generation.start_token_id, DEC);
    assert_eq!(f.model.generation.eos_token_ids, vec![SEP]);
    // Pixels of the PNG (already at the input size) as
    // BlipImageProcessor (bicubic, CLIP mean and std), the vision tower's
    // last hidden state, teacher-forced logits in one pass and through the
    // cache.
    let ctx = check_forward(&f, kind, "vision_last_hidden_state", "input_ids")?;
    let decoder = &f.model.decoder;

    // Generation, with the text decode (special tokens skipped) of each.
    let plain = GenerationConfig {
        max_new_tokens: NEW_TOKENS,
        ..f.model.generation.clone()
    };
    // The text is the whole sequence decoded: prompt words, then the
    // generated ids (the start token is special).
    let run = |cfg: &GenerationConfig, prompt: &[u32]| -> anyhow::Result<(Vec<u32>, String)> {
        let out = generate_from(decoder, &ctx, cfg, prompt, &mut |_| {})?;
        let ids = out[0].tokens.clone();
        let all: Vec<u32> = prompt.iter().chain(&ids).copied().collect();
        let text = f.model.tokenizer.decode(&all, true).expect("decode");
        Ok((ids, text))
    };
    let e = &f.expected;
    let prompt = f.model.prompt_ids(&e.prompt)?;
    assert_eq!(e.prompt_ids[0], DEC);
    assert_eq!(prompt, e.prompt_ids[1..], "{kind}: prompt ids");
    let beam3 = plain.clone().with_strategy(Strategy::Beam {
        num_beams: 3,
        length_penalty: 1.0,
        early_stopping: EarlyStopping::False,
    });
    let greedy = plain.clone().with_strategy(Strategy::Greedy);
    for (what, cfg, want, want_prompted) in [
        (
            "greedy",
            &greedy,
            (&e.greedy, &e.greedy_text),
            (&e.prompt_greedy, &e.prompt_greedy_text),
        ),
        (
            "3-beam",
            &beam3,
            (&e.beam3, &e.beam3_text),
            (&e.prompt_beam3, &e.prompt_beam3_text),
        ),
        (
            "checkpoint defaults",
            &f.model.generation,
            (&e.defaults, &e.defaults_text),
            (&e.prompt_defaults, &e.prompt_defaults_text),
        ),
    ] {
        let got = run(cfg, &[])?;
        assert_eq!((&got.0, &got.1), want, "{kind}: {what}");
        let got = run(cfg, &prompt)?;
        assert_eq!((&got.0, &got.1), want_prompted, "{kind}: {what}, prompted");
    }

    // The library entry point gives the same caption.
    let pixels = f.tensors["pixel_values"].squeeze(0)?;
    let captioner = Captioner::new(f.model);
    let request = Request {
        generation: captioner.generation().clone(),
        prompt: Some(&e.prompt),
        task: None,
    };
    let caps = captioner.caption_pixels(&[pixels], &request, &mut |_| {})?;
    assert_eq!(
        caps[0].token_ids, *e.prompt_defaults,
        "{kind}: captioner ids"
    );
    assert_eq!(
        caps[0].text, e.prompt_defaults_text,
        "{kind}: captioner text"
    );
    Ok(())
}

/// A 24-wide vision tower under the 32-wide text decoder
/// (`encoder_hidden_size` 24), GELU.
#[test]
fn blip_vision24_matches_transformers() -> anyhow::Result<()> {
    run_parity("vision24")
}

/// Both 32 wide, ReLU in the text decoder.
#[test]
fn blip_vision32_matches_transformers() -> anyhow::Result<()> {
    run_parity("vision32")
}

/// The layout read from the config: post-LN, no final norm, an embedding
/// norm without scale, learned positions from 0, the output transform,
/// and the generation defaults of BLIP's generate.
#[test]
fn blip_config_maps_onto_the_decoder_layout() -> anyhow::Result<()> {
    let f: Fixture<Expected> = load(FAMILY, "vision24")?;
    let c = f.model.decoder.config();
    assert_eq!(c.norm_placement, NormPlacement::Post);
    assert!(!c.final_norm && !c.scale_embedding && c.layernorm_embedding);
    assert!(c.output_transform && c.tie_word_embeddings);
    assert_eq!((c.position_offset, c.memory_dim), (0, 24));
    assert_eq!(f.model.generation.strategy, Strategy::Greedy);
    assert_eq!(f.model.generation.max_new_tokens, 20);
    let memory = f.model.encode_pixels(&f.tensors["pixel_values"])?;
    // CLS + 4 x 4 patches, 24 wide.
    assert_eq!(memory.dims(), &[1, 17, 24]);
    Ok(())
}

/// Copies a fixture into a temporary directory to break it.
fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) -> anyhow::Result<()> {
    let path = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    edit(&mut v);
    std::fs::write(&path, serde_json::to_string(&v)?)?;
    Ok(())
}

/// Bad configs and tensors are errors naming the field or the tensor.
#[test]
fn blip_errors_name_the_culprit() -> anyhow::Result<()> {
    let tmp = copy_fixture(FAMILY, "vision24")?;
    edit_config(tmp.path(), |v| {
        v["text_config"]["encoder_hidden_size"] = 32.into();
    })?;
    let err = vl::load(tmp.path(), &vl::LoadOptions::new(DType::F32, &Device::Cpu))
        .unwrap_err()
        .to_string();
    assert!(err.contains("text_config.encoder_hidden_size"), "{err}");

    let tmp = copy_fixture(FAMILY, "vision24")?;
    edit_config(tmp.path(), |v| {
        v["text_config"]["max_position_embeddings"] = 65.into();
    })?;
    let err = vl::load(tmp.path(), &vl::LoadOptions::new(DType::F32, &Device::Cpu))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("text_decoder.bert.embeddings.position_embeddings.weight"),
        "{err}"
    );

    let tmp = copy_fixture(FAMILY, "vision24")?;
    edit_config(tmp.path(), |v| {
        v["vision_config"]["patch_size"] = 6.into();
    })?;
    let err = vl::load(tmp.path(), &vl::LoadOptions::new(DType::F32, &Device::Cpu))
        .unwrap_err()
        .to_string();
    assert!(err.contains("patch_size"), "{err}");
    Ok(())
}

/// Only BLIP defines prompts: a TrOCR checkpoint refuses one, naming
/// `prompt`.
#[test]
fn prompts_are_refused_by_families_without_them() -> anyhow::Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trocr/vit_learned");
    let model = vl::load(&dir, &vl::LoadOptions::new(DType::F32, &Device::Cpu))?;
    let err = model.prompt_ids("a picture of").unwrap_err();
    assert!(
        matches!(&err, vl::Error::Argument { arg: "prompt", .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("only BLIP"), "{err}");
    Ok(())
}
