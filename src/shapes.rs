//! The shapes captioner's data: its word-level tokenizer and batches of
//! freshly drawn scenes from the shapes world (see [`vl_shapes`]).

use std::collections::HashMap;

use anyhow::{anyhow, Context};
use candle_core::{Device, Tensor};
use image::DynamicImage;
use tokenizers::models::wordlevel::WordLevel;
use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
use tokenizers::{AddedToken, Tokenizer};
use vl_decoder::{Activation, DecoderConfig};
use vl_vision::preprocess::{preprocess_batch, PixelSpec};
use vl_vision::{VisionConfig, VitConfig};

use crate::checkpoint::VlConfig;
use vl_shapes::{dataset_scene, Scene, IMAGE_SIZE, VOCAB};

/// The padding token.
pub const PAD: &str = "<pad>";
/// The start token.
pub const BOS: &str = "<bos>";
/// The end token.
pub const EOS: &str = "<eos>";
/// The unknown-word token.
pub const UNK: &str = "<unk>";
/// Special tokens, ids 0..4 in this order; the words of [`VOCAB`] follow.
pub const SPECIALS: [&str; 4] = [PAD, BOS, EOS, UNK];

/// The word-level tokenizer: ids 0..4 are [`SPECIALS`], then [`VOCAB`] in
/// order; words split on whitespace; decoding joins words with spaces.
pub fn tokenizer() -> anyhow::Result<Tokenizer> {
    let vocab: HashMap<String, u32> = SPECIALS
        .iter()
        .chain(VOCAB.iter())
        .enumerate()
        .map(|(i, w)| (w.to_string(), i as u32))
        .collect();
    let model = WordLevel::builder()
        .vocab(vocab.into_iter().collect())
        .unk_token(UNK.into())
        .build()
        .map_err(|e| anyhow!("word-level model: {e}"))?;
    let mut tok = Tokenizer::new(model);
    tok.with_pre_tokenizer(Some(WhitespaceSplit));
    let specials: Vec<AddedToken> = SPECIALS
        .iter()
        .map(|s| AddedToken::from(*s, true))
        .collect();
    tok.add_special_tokens(specials)
        .map_err(|e| anyhow!("special tokens: {e}"))?;
    Ok(tok)
}

/// The number of ids of [`tokenizer`].
pub fn vocab_size() -> usize {
    SPECIALS.len() + VOCAB.len()
}

/// The shapes captioner's configuration: a ViT over square patches of the
/// 64×64 image and a decoder, both `hidden` wide with `layers` blocks and 4
/// heads; ids as [`tokenizer`]; 16 positions (the longest caption is 12
/// words, plus start and end).
pub fn captioner_config(hidden: usize, layers: usize, patch_size: usize) -> VlConfig {
    VlConfig {
        model_type: "vl".into(),
        decoder: DecoderConfig {
            vocab_size: vocab_size(),
            hidden_size: hidden,
            num_attention_heads: 4,
            num_key_value_heads: None,
            num_hidden_layers: layers,
            intermediate_size: hidden * 4,
            max_position_embeddings: 16,
            memory_dim: hidden,
            hidden_act: Activation::Gelu,
            layer_norm_eps: 1e-5,
            tie_word_embeddings: true,
            cross_attention_every: 1,
            gated_cross_attention: false,
            gated_cross_ffn: false,
            attention_bias: true,
            attention_dropout: 0.0,
            residual_dropout: 0.0,
            embedding_dropout: 0.0,
            bos_token_id: 1,
            eos_token_id: 2,
            pad_token_id: 0,
            ..DecoderConfig::tiny(vocab_size(), hidden)
        },
        vision: Some(VisionConfig::Vit(VitConfig {
            image_size: IMAGE_SIZE as usize,
            patch_size,
            num_channels: 3,
            hidden_size: hidden,
            num_hidden_layers: layers,
            num_attention_heads: 4,
            intermediate_size: hidden * 4,
            layer_norm_eps: 1e-5,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
            rescale_factor: 1.0 / 255.0,
            resample: vl_vision::Resample::Bilinear,
            do_resize: true,
            hidden_act: Activation::Gelu,
            output_size: None,
            attention_dropout: 0.0,
            hidden_dropout: 0.0,
            distillation_token: false,
        })),
        resampler: None,
        quantization: vl_attn::Quantization::None,
        generation: None,
        text_encoder: None,
        tasks: None,
        reader: None,
    }
}

/// `[bos] caption [eos]` as ids.
pub fn caption_ids(tok: &Tokenizer, caption: &str, bos: u32, eos: u32) -> anyhow::Result<Vec<u32>> {
    let enc = tok
        .encode(caption, false)
        .map_err(|e| anyhow!("tokenize {caption:?}: {e}"))?;
    let mut ids = vec![bos];
    ids.extend_from_slice(enc.get_ids());
    ids.push(eos);
    Ok(ids)
}

/// A batch of scenes `start..start + n` of the dataset `seed`.
pub struct Batch {
    /// The scenes.
    pub scenes: Vec<Scene>,
    /// Normalised pixels `(n, 3, size, size)`.
    pub pixels: Tensor,
}

/// Draws and renders scenes `start..start + n` of dataset `seed`.
pub fn batch(
    seed: u64,
    start: u64,
    n: usize,
    spec: &PixelSpec,
    device: &Device,
) -> anyhow::Result<Batch> {
    let scenes: Vec<Scene> = (0..n as u64)
        .map(|i| dataset_scene(seed, start + i))
        .collect();
    let images: Vec<DynamicImage> = scenes
        .iter()
        .map(|s| DynamicImage::ImageRgb8(s.render()))
        .collect();
    let refs: Vec<&DynamicImage> = images.iter().collect();
    let pixels = preprocess_batch(&refs, spec, device).context("preprocess")?;
    Ok(Batch { scenes, pixels })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_round_trips_every_caption_word() -> anyhow::Result<()> {
        let tok = tokenizer()?;
        assert_eq!(tok.get_vocab_size(true), vocab_size());
        let caption = "a small red circle to the left of a large blue square";
        let ids = caption_ids(&tok, caption, 1, 2)?;
        assert_eq!(ids.len(), 14);
        assert_eq!((ids[0], ids[13]), (1, 2));
        assert!(ids[1..13].iter().all(|&i| i >= SPECIALS.len() as u32));
        let text = tok.decode(&ids, true).map_err(|e| anyhow!("{e}"))?;
        assert_eq!(text, caption);
        Ok(())
    }
}
