//! Parity with transformers on the committed mBART-decoder fixtures
//! (`scripts/mbart_fixtures.py`): a ViT under `MBartForCausalLM`, Donut's
//! and Nougat's text decoder — pre-LN layers, `layernorm_embedding`, the
//! final `layer_norm`, learned positions from row 2, the LM head tied or
//! not, the encoder projected or not. Preprocessing, the encoder's state,
//! teacher-forced logits in one pass and cached (≤ 1e-4), and the ids of
//! greedy, 3-beam and checkpoint-default generation with their text.
#![allow(missing_docs)]

mod parity;

use vl::vl_decoder::{NormPlacement, PositionEmbedding};
use vl::ModelFormat;

use parity::{check_forward, check_generation, load, Fixture, GeneratedIds};

const FAMILY: &str = "mbart";

fn run_parity(kind: &str) -> anyhow::Result<()> {
    let f: Fixture<GeneratedIds> = load(FAMILY, kind)?;
    assert_eq!(f.model.format, ModelFormat::VisionEncoderDecoder);
    assert_eq!(f.model.generation.start_token_id, 0, "{kind}: <s> starts");
    let c = f.model.decoder.config();
    assert_eq!(c.norm_placement, NormPlacement::Pre);
    assert!(c.final_norm && c.layernorm_embedding);
    assert_eq!(c.position_embedding, PositionEmbedding::Learned);
    assert_eq!((c.position_offset, c.position_padding_idx), (2, None));
    let ctx = check_forward(&f, kind, "encoder_last_hidden_state", "decoder_input_ids")?;
    check_generation(&f, &ctx, kind)
}

/// ViT as wide as the decoder, tied head, `scale_embedding`, gelu;
/// 3-beam early-stopping defaults.
#[test]
fn tied_head_matches_transformers() -> anyhow::Result<()> {
    run_parity("vit_tied")?;
    let f: Fixture<GeneratedIds> = load(FAMILY, "vit_tied")?;
    assert!(f.model.decoder.config().tie_word_embeddings);
    Ok(())
}

/// A narrower ViT through `enc_to_dec_proj`, an untied `lm_head` (as
/// Nougat's), relu; greedy defaults with `no_repeat_ngram_size` 3 and
/// `bad_words_ids` (`<unk>`, and a pair the unbanned output starts with:
/// every generation here is the banned one's).
#[test]
fn untied_head_and_projected_encoder_match_transformers() -> anyhow::Result<()> {
    run_parity("vit_untied")?;
    let f: Fixture<GeneratedIds> = load(FAMILY, "vit_untied")?;
    assert!(!f.model.decoder.config().tie_word_embeddings);
    assert_eq!(f.model.generation.bad_words_ids, [vec![3], vec![284, 199]]);
    assert!(!f.expected.greedy.windows(2).any(|w| w == [284, 199]));
    Ok(())
}
