//! Parity with transformers on the committed TrOCR fixtures
//! (`scripts/trocr_fixtures.py` writes them): preprocessing, the encoder's
//! last hidden state (ViT, and DeiT with its distillation token),
//! teacher-forced logits of the post-LN decoder in one pass and cached,
//! the ids of greedy, 3-beam and checkpoint-default generation, and their
//! text; and the refusal of what vl does not load.
#![allow(missing_docs)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, D};
use serde::Deserialize;
use vl::vl_decoder::{
    generate, EarlyStopping, ForwardMasks, GenerationConfig, NormPlacement, PositionEmbedding,
    Strategy,
};
use vl::vl_vision::preprocess::{load_image, preprocess};
use vl::vl_vision::VisionEncoder;
use vl::{ModelFormat, VlModel};

/// f32 parity bound of the issue: max abs diff of hidden states and logits.
const TOL: f32 = 1e-4;
/// Pixels: one rounding of `(x / 255 - mean) / std` apart at most.
const PIXEL_TOL: f32 = 1e-5;
/// The start token of TrOCR checkpoints (`decoder_start_token_id`, `</s>`).
const TROCR_START: u32 = 2;

#[derive(Deserialize)]
struct Expected {
    greedy: Vec<u32>,
    beam3: Vec<u32>,
    defaults: Vec<u32>,
    defaults_text: String,
}

fn fixture(kind: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/trocr")
        .join(kind)
}

struct Fixture {
    model: VlModel,
    tensors: HashMap<String, Tensor>,
    expected: Expected,
    dir: PathBuf,
}

fn load(kind: &str) -> anyhow::Result<Fixture> {
    let dir = fixture(kind);
    let model = VlModel::load(&dir, DType::F32, &Device::Cpu)?;
    let tensors = candle_core::safetensors::load(dir.join("expected.safetensors"), &Device::Cpu)?;
    let expected = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json"))?)?;
    Ok(Fixture {
        model,
        tensors,
        expected,
        dir,
    })
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> anyhow::Result<f32> {
    assert_eq!(a.dims(), b.dims());
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

fn run_parity(kind: &str) -> anyhow::Result<()> {
    let f = load(kind)?;
    assert_eq!(f.model.format, ModelFormat::VisionEncoderDecoder);
    assert_eq!(f.model.generation.start_token_id, TROCR_START);
    let want_pixels = &f.tensors["pixel_values"];

    // Preprocessing of the PNG (already at the input size) as transformers'
    // ViTImageProcessor, TrOCR's.
    let img = load_image(&f.dir.join("image.png"))?;
    let spec = f.model.pixels.expect("pixel spec");
    let pixels = preprocess(&img, &spec, &Device::Cpu)?.unsqueeze(0)?;
    let d = max_abs_diff(&pixels, want_pixels)?;
    eprintln!("{kind}: pixels max abs diff {d:e}");
    assert!(d <= PIXEL_TOL, "{kind}: pixel values differ by {d}");

    // The encoder's last hidden state (before enc_to_dec_proj); DeiT's
    // holds the distillation token after CLS.
    let Some(VisionEncoder::Vit(vit)) = &f.model.vision else {
        panic!("{kind}: expected a ViT encoder");
    };
    let hidden = vit.last_hidden_state(want_pixels)?;
    let d = max_abs_diff(&hidden, &f.tensors["encoder_last_hidden_state"])?;
    eprintln!("{kind}: encoder hidden state max abs diff {d:e}");
    assert!(d <= TOL, "{kind}: encoder hidden state differs by {d}");

    // Teacher-forced logits (a padding token among the ids), in one pass
    // and through the cache.
    let memory = f.model.encode_pixels(want_pixels)?;
    let ids = f.tensors["decoder_input_ids"].to_dtype(DType::U32)?;
    let decoder = &f.model.decoder;
    let logits = decoder.forward(&ids, Some(&memory), ForwardMasks::default())?;
    let want = &f.tensors["logits"];
    let d = max_abs_diff(&logits, want)?;
    eprintln!("{kind}: teacher-forced logits max abs diff {d:e}");
    assert!(d <= TOL, "{kind}: teacher-forced logits differ by {d}");
    let ctx = decoder.image_context(&memory, None)?;
    let mut state = decoder.start(&ctx, 1)?;
    let stepped = decoder.step(&mut state, &ids)?;
    let d = max_abs_diff(&stepped, want)?;
    eprintln!("{kind}: cached logits max abs diff {d:e}");
    assert!(d <= TOL, "{kind}: cached logits differ by {d}");
    assert_eq!(
        logits.argmax(D::Minus1)?.to_vec2::<u32>()?,
        want.argmax(D::Minus1)?.to_vec2::<u32>()?
    );

    // Generation: greedy and 3 beams for 20 new tokens, and the
    // checkpoint's own defaults, with their text.
    let plain = GenerationConfig {
        max_new_tokens: 20,
        min_new_tokens: 0,
        no_repeat_ngram_size: 0,
        repetition_penalty: 1.0,
        ..f.model.generation.clone()
    };
    let run = |cfg: &GenerationConfig| -> anyhow::Result<Vec<u32>> {
        let out = generate(decoder, &ctx, cfg, &mut |_| {})?;
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

/// ViT encoder, learned positions from row 2, tied head,
/// `layernorm_embedding`; `tokenizer.json`; 3-beam defaults.
#[test]
fn vit_learned_positions_tied_head_match_transformers() -> anyhow::Result<()> {
    run_parity("vit_learned")
}

/// DeiT encoder (CLS + distillation token in the memory), sinusoidal
/// positions with padding skipped, untied `output_projection`,
/// `layernorm_embedding`, `scale_embedding`, ReLU; `vocab.json` +
/// `merges.txt`; greedy defaults with `no_repeat_ngram_size` 3.
#[test]
fn deit_sinusoidal_untied_head_match_transformers() -> anyhow::Result<()> {
    run_parity("deit_sinusoidal")
}

/// A narrower ViT under the decoder without `cross_attention_hidden_size`:
/// `enc_to_dec_proj`; no `layernorm_embedding`, `scale_embedding`,
/// `gelu_new`.
#[test]
fn vit_projected_matches_transformers() -> anyhow::Result<()> {
    run_parity("vit_projected")
}

/// The layout read from each config: post-LN without a final norm, the
/// position kind, the memory width and the DeiT prefix.
#[test]
fn trocr_configs_map_onto_the_decoder_layout() -> anyhow::Result<()> {
    let f = load("deit_sinusoidal")?;
    let c = f.model.decoder.config();
    assert_eq!(c.norm_placement, NormPlacement::Post);
    assert!(!c.final_norm && c.scale_embedding && c.layernorm_embedding);
    assert!(!c.tie_word_embeddings);
    assert_eq!(c.position_embedding, PositionEmbedding::Sinusoidal);
    assert_eq!((c.position_offset, c.position_padding_idx), (0, Some(1)));
    assert_eq!(c.memory_dim, 24);
    let memory = f.model.encode_pixels(&f.tensors["pixel_values"])?;
    // CLS + distillation + 4 x 4 patches, 24 wide.
    assert_eq!(memory.dims(), &[1, 18, 24]);
    let f = load("vit_learned")?;
    let c = f.model.decoder.config();
    assert_eq!(c.position_embedding, PositionEmbedding::Learned);
    assert_eq!((c.position_offset, c.position_padding_idx), (2, None));
    assert_eq!(
        f.model.generation.strategy,
        Strategy::Beam {
            num_beams: 3,
            length_penalty: 1.0,
            early_stopping: EarlyStopping::True
        }
    );
    Ok(())
}

/// Copies a fixture into a temporary directory to break it.
fn copy_fixture(kind: &str) -> anyhow::Result<tempfile::TempDir> {
    let tmp = tempfile::tempdir()?;
    for entry in std::fs::read_dir(fixture(kind))? {
        let entry = entry?;
        std::fs::copy(entry.path(), tmp.path().join(entry.file_name()))?;
    }
    Ok(tmp)
}

fn load_err(dir: &Path) -> String {
    format!(
        "{:#}",
        VlModel::load(dir, DType::F32, &Device::Cpu).expect_err("must fail")
    )
}

/// Edits `config.json` of a copy of fixture `kind`.
fn edited(kind: &str, edit: impl Fn(&mut serde_json::Value)) -> anyhow::Result<tempfile::TempDir> {
    let tmp = copy_fixture(kind)?;
    let path = tmp.path().join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    edit(&mut cfg);
    std::fs::write(&path, cfg.to_string())?;
    Ok(tmp)
}

#[test]
fn an_unsupported_encoder_is_refused_by_name() -> anyhow::Result<()> {
    let tmp = edited("vit_learned", |c| {
        c["encoder"]["model_type"] = "swin".into()
    })?;
    let err = load_err(tmp.path());
    assert!(
        err.contains("encoder.model_type") && err.contains("swin") && err.contains("deit"),
        "{err}"
    );
    let tmp = edited("vit_learned", |c| {
        c["decoder"]["model_type"] = "bart".into()
    })?;
    let err = load_err(tmp.path());
    assert!(
        err.contains("decoder.model_type") && err.contains("bart") && err.contains("trocr"),
        "{err}"
    );
    Ok(())
}

#[test]
fn trocr_config_errors_name_the_field_and_file() -> anyhow::Result<()> {
    let tmp = edited("deit_sinusoidal", |c| {
        c["decoder"]["cross_attention_hidden_size"] = 32.into();
    })?;
    let err = load_err(tmp.path());
    assert!(
        err.contains("decoder.cross_attention_hidden_size")
            && err.contains("config.json")
            && err.contains("24"),
        "{err}"
    );
    let tmp = edited("deit_sinusoidal", |c| {
        c["decoder"]["pad_token_id"] = serde_json::Value::Null;
    })?;
    let err = load_err(tmp.path());
    assert!(err.contains("decoder.pad_token_id"), "{err}");
    let tmp = edited("vit_learned", |c| {
        c["decoder"]["activation_function"] = "quick_gelu".into();
    })?;
    let err = load_err(tmp.path());
    assert!(
        err.contains("quick_gelu") && err.contains("config.json"),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_missing_trocr_tensor_is_named() -> anyhow::Result<()> {
    for (kind, name) in [
        (
            "vit_learned",
            "decoder.model.decoder.layers.1.encoder_attn.k_proj.bias",
        ),
        ("deit_sinusoidal", "decoder.output_projection.weight"),
        ("deit_sinusoidal", "encoder.embeddings.distillation_token"),
    ] {
        let tmp = copy_fixture(kind)?;
        let path = tmp.path().join("model.safetensors");
        let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu)?;
        assert!(tensors.remove(name).is_some(), "{kind}: no {name}");
        candle_core::safetensors::save(&tensors, &path)?;
        let err = load_err(tmp.path());
        assert!(
            err.contains("model.safetensors") && err.contains(name),
            "{kind}: {err}"
        );
    }
    Ok(())
}
