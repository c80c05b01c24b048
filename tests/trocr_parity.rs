//! Parity with transformers on the committed TrOCR fixtures
//! (`scripts/trocr_fixtures.py` writes them): preprocessing, the encoder's
//! last hidden state (ViT, and DeiT with its distillation token),
//! teacher-forced logits of the post-LN decoder in one pass and cached,
//! the ids of greedy, 3-beam and checkpoint-default generation, and their
//! text; and the refusal of what vl does not load.
#![allow(missing_docs)]

mod parity;

use candle_core::Device;
use vl::vl_decoder::{EarlyStopping, NormPlacement, PositionEmbedding, Strategy};
use vl::ModelFormat;

use parity::{
    check_forward, check_generation, copy_fixture, load, load_err, Fixture, GeneratedIds,
};

/// The fixtures' folder under `tests/fixtures`.
const FAMILY: &str = "trocr";

/// The start token of TrOCR checkpoints (`decoder_start_token_id`, `</s>`).
const TROCR_START: u32 = 2;

type Expected = GeneratedIds;

fn run_parity(kind: &str) -> anyhow::Result<()> {
    let f: Fixture<Expected> = load(FAMILY, kind)?;
    assert_eq!(f.model.format, ModelFormat::VisionEncoderDecoder);
    assert_eq!(f.model.generation.start_token_id, TROCR_START);
    // Pixels of the PNG (already at the input size) as transformers'
    // ViTImageProcessor, TrOCR's; the encoder's last hidden state (before
    // enc_to_dec_proj; DeiT's holds the distillation token after CLS);
    // teacher-forced logits (a padding token among the ids), in one pass
    // and through the cache.
    let ctx = check_forward(&f, kind, "encoder_last_hidden_state", "decoder_input_ids")?;
    // Generation: greedy and 3 beams for 20 new tokens, and the
    // checkpoint's own defaults, with their text.
    check_generation(&f, &ctx, kind)
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
    let f: Fixture<Expected> = load(FAMILY, "deit_sinusoidal")?;
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
    let f: Fixture<Expected> = load(FAMILY, "vit_learned")?;
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
/// Edits `config.json` of a copy of fixture `kind`.
fn edited(kind: &str, edit: impl Fn(&mut serde_json::Value)) -> anyhow::Result<tempfile::TempDir> {
    let tmp = copy_fixture(FAMILY, kind)?;
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
        let tmp = copy_fixture(FAMILY, kind)?;
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
