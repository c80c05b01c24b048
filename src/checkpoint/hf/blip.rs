//! BLIP captioning checkpoints (`model_type` `blip`, transformers'
//! `BlipForConditionalGeneration`): their config and tensors mapped onto
//! vl's [`Vit`] and [`VisionLanguageDecoder`] — configs and names, no
//! second implementation.
//!
//! - Vision (`vision_model.`): a pre-LN ViT — patch conv with bias,
//!   `class_embedding`, `position_embedding`, layers `layer_norm1`,
//!   `self_attn.qkv` (fused, split into query, key and value here) and
//!   `self_attn.projection`, `layer_norm2`, `mlp.fc1`/`fc2`, then
//!   `post_layernorm` (the ViT's final norm). No pre-norm, no pooler read.
//! - Text (`text_decoder.`): a BERT decoder — word plus absolute position
//!   embeddings under a LayerNorm (`layernorm_embedding`, no scale),
//!   post-LN layers (self-attention, cross-attention onto the
//!   `encoder_hidden_size`-wide image tokens, feed-forward), no final norm,
//!   then `cls.predictions.transform` (dense, act, LayerNorm: the decoder's
//!   `output_transform`) and the head tied to the word embeddings plus
//!   `cls.predictions.bias`.
//!
//! Generation follows `BlipForConditionalGeneration.generate`, which runs
//! the text decoder's own settings (from `text_config`), not
//! `generation_config.json`: the start token is `text_config.bos_token_id`
//! (`[DEC]`), captions end at `sep_token_id` (`[SEP]`), padding is
//! `pad_token_id`, greedy, [`BLIP_DEFAULT_NEW_TOKENS`] new tokens.

use std::collections::BTreeMap;

use candle_core::Tensor;
use candle_nn::{Embedding, Linear, VarBuilder};
use serde::Deserialize;
use serde_json::Value;
use vl_attn::{
    CausalSelfAttention, CrossAttention, CrossAttentionConfig, FeedForward, Resampler,
    SelfAttention, SelfAttentionConfig,
};
use vl_decoder::block::{CrossBranch, DecoderBlock};
use vl_decoder::{
    Activation, DecoderConfig, DecoderParts, GenerationConfig, NormPlacement, OutputTransform,
    PositionEmbedding, VisionLanguageDecoder,
};
use vl_vision::{PixelSpec, VisionEncoder, Vit, VitBlock, VitConfig};

use super::config::HfPreprocessorConfig;
use super::tensors::{layer_norm, linear};
use super::PREPROCESSOR_FILE;
use crate::checkpoint::tokenizer::load_hf_tokenizer;
use crate::checkpoint::{
    from_value, read_json, BlockHook, Family, ModelFormat, Plan, Source, VlConfig, CONFIG_FILE,
};
use crate::error::{check_dropouts, config_err, in_file, Result};

/// The `model_type` of a BLIP checkpoint.
pub const MODEL_TYPE: &str = "blip";
/// New tokens when nothing says otherwise: transformers' model-agnostic
/// default (`max_length` 20 past the input), which BLIP's generate uses.
pub const BLIP_DEFAULT_NEW_TOKENS: usize = 20;
/// OpenAI CLIP's per-channel mean, `BlipImageProcessor`'s default.
pub const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
/// OpenAI CLIP's per-channel std, `BlipImageProcessor`'s default.
pub const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_6, 0.275_777_1];
/// PIL's bicubic filter, `BlipImageProcessor`'s default `resample`.
pub const PIL_BICUBIC: u32 = 3;

fn gelu() -> Activation {
    Activation::Gelu
}
fn default_true() -> bool {
    true
}
fn eps_1e5() -> f64 {
    1e-5
}
fn eps_1e12() -> f64 {
    1e-12
}
fn size_384() -> usize {
    384
}
fn patch_16() -> usize {
    16
}
fn width_768() -> usize {
    768
}
fn ffn_3072() -> usize {
    3072
}
fn layers_12() -> usize {
    12
}
fn heads_12() -> usize {
    12
}
fn heads_8() -> usize {
    8
}
fn vocab_30524() -> usize {
    30524
}
fn positions_512() -> usize {
    512
}
fn bos_30522() -> u32 {
    30522
}
fn sep_102() -> u32 {
    102
}

/// `config.json`'s `vision_config`: a transformers `BlipVisionConfig`.
#[derive(Debug, Clone, Deserialize)]
pub struct HfBlipVisionConfig {
    /// Token width (default 768).
    #[serde(default = "width_768")]
    pub hidden_size: usize,
    /// Feed-forward width (default 3072).
    #[serde(default = "ffn_3072")]
    pub intermediate_size: usize,
    /// Layers (default 12).
    #[serde(default = "layers_12")]
    pub num_hidden_layers: usize,
    /// Heads (default 12).
    #[serde(default = "heads_12")]
    pub num_attention_heads: usize,
    /// Input side (default 384).
    #[serde(default = "size_384")]
    pub image_size: usize,
    /// Patch side (default 16).
    #[serde(default = "patch_16")]
    pub patch_size: usize,
    /// Feed-forward activation (default `gelu`).
    #[serde(default = "gelu")]
    pub hidden_act: Activation,
    /// Layer-norm epsilon (default 1e-5).
    #[serde(default = "eps_1e5")]
    pub layer_norm_eps: f64,
    /// Dropout on the attention probabilities, in training (default 0).
    #[serde(default)]
    pub attention_dropout: f64,
}

/// `config.json`'s `text_config`: a transformers `BlipTextConfig`.
#[derive(Debug, Clone, Deserialize)]
pub struct HfBlipTextConfig {
    /// Tokens in the vocabulary (default 30524).
    #[serde(default = "vocab_30524")]
    pub vocab_size: usize,
    /// Width (default 768).
    #[serde(default = "width_768")]
    pub hidden_size: usize,
    /// Width of the image tokens cross-attention reads (default 768);
    /// must be the vision tower's `hidden_size`.
    #[serde(default = "width_768")]
    pub encoder_hidden_size: usize,
    /// Feed-forward width (default 3072).
    #[serde(default = "ffn_3072")]
    pub intermediate_size: usize,
    /// Layers (default 12).
    #[serde(default = "layers_12")]
    pub num_hidden_layers: usize,
    /// Heads (default 8).
    #[serde(default = "heads_8")]
    pub num_attention_heads: usize,
    /// Positions (default 512).
    #[serde(default = "positions_512")]
    pub max_position_embeddings: usize,
    /// Activation of the feed-forward and of the head's transform
    /// (default `gelu`).
    #[serde(default = "gelu")]
    pub hidden_act: Activation,
    /// Layer-norm epsilon of every text norm (default 1e-12).
    #[serde(default = "eps_1e12")]
    pub layer_norm_eps: f64,
    /// Dropout on residual branches and embeddings, in training (default 0).
    #[serde(default)]
    pub hidden_dropout_prob: f64,
    /// Dropout on attention probabilities, in training (default 0).
    #[serde(default)]
    pub attention_probs_dropout_prob: f64,
    /// The start token, `[DEC]` (default 30522).
    #[serde(default = "bos_30522")]
    pub bos_token_id: u32,
    /// The end token of captions, `[SEP]` (default 102).
    #[serde(default = "sep_102")]
    pub sep_token_id: u32,
    /// Padding (default 0).
    #[serde(default)]
    pub pad_token_id: u32,
    /// Whether the head is the word embedding (default true).
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
}

/// A BLIP `config.json`.
#[derive(Debug, Clone, Deserialize)]
pub struct HfBlipConfig {
    /// Must be `"blip"`.
    pub model_type: String,
    /// The text decoder.
    pub text_config: HfBlipTextConfig,
    /// The vision tower.
    pub vision_config: HfBlipVisionConfig,
    /// Every other key (projection sizes of the retrieval heads, unused).
    #[serde(flatten)]
    pub rest: BTreeMap<String, Value>,
}

impl HfBlipConfig {
    /// Rejects what vl cannot run, naming the field.
    pub fn validate(&self) -> Result<()> {
        let (t, v) = (&self.text_config, &self.vision_config);
        if t.encoder_hidden_size != v.hidden_size {
            return config_err(
                "text_config.encoder_hidden_size",
                format!(
                    "{} is not vision_config.hidden_size {}",
                    t.encoder_hidden_size, v.hidden_size
                ),
            );
        }
        check_dropouts(&[
            ("text_config.hidden_dropout_prob", t.hidden_dropout_prob),
            (
                "text_config.attention_probs_dropout_prob",
                t.attention_probs_dropout_prob,
            ),
            ("vision_config.attention_dropout", v.attention_dropout),
        ])?;
        Ok(())
    }

    /// The vision tower as a vl [`VitConfig`], its normalisation from
    /// `pixels`.
    pub fn vit_config(&self, pixels: &PixelSpec) -> VitConfig {
        let v = &self.vision_config;
        VitConfig {
            image_size: v.image_size,
            patch_size: v.patch_size,
            num_channels: 3,
            hidden_size: v.hidden_size,
            num_hidden_layers: v.num_hidden_layers,
            num_attention_heads: v.num_attention_heads,
            intermediate_size: v.intermediate_size,
            layer_norm_eps: v.layer_norm_eps,
            image_mean: pixels.mean,
            image_std: pixels.std,
            rescale_factor: pixels.rescale_factor,
            resample: pixels.resample,
            do_resize: pixels.resize,
            hidden_act: v.hidden_act,
            output_size: None,
            attention_dropout: v.attention_dropout,
            hidden_dropout: 0.0,
            distillation_token: false,
        }
    }

    /// The text decoder as a vl [`DecoderConfig`]: post-LN, no final norm,
    /// an embedding norm, learned positions from 0, an output transform.
    pub fn decoder_config(&self) -> DecoderConfig {
        let t = &self.text_config;
        DecoderConfig {
            vocab_size: t.vocab_size,
            hidden_size: t.hidden_size,
            num_attention_heads: t.num_attention_heads,
            num_key_value_heads: None,
            num_hidden_layers: t.num_hidden_layers,
            intermediate_size: t.intermediate_size,
            max_position_embeddings: t.max_position_embeddings,
            memory_dim: t.encoder_hidden_size,
            hidden_act: t.hidden_act,
            layer_norm_eps: t.layer_norm_eps,
            tie_word_embeddings: t.tie_word_embeddings,
            cross_attention_every: 1,
            gated_cross_attention: false,
            gated_cross_ffn: false,
            attention_bias: true,
            attention_dropout: t.attention_probs_dropout_prob,
            residual_dropout: t.hidden_dropout_prob,
            embedding_dropout: t.hidden_dropout_prob,
            norm_placement: NormPlacement::Post,
            final_norm: false,
            scale_embedding: false,
            layernorm_embedding: true,
            output_transform: true,
            lm_head_bias: true,
            position_embedding: PositionEmbedding::Learned,
            position_offset: 0,
            position_padding_idx: None,
            bos_token_id: t.bos_token_id,
            eos_token_id: t.sep_token_id,
            pad_token_id: t.pad_token_id,
        }
    }

    /// `BlipForConditionalGeneration.generate`'s defaults: greedy from
    /// `[DEC]`, ending at `[SEP]`, [`BLIP_DEFAULT_NEW_TOKENS`] tokens.
    pub fn generation_config(&self) -> GenerationConfig {
        GenerationConfig::greedy(&self.decoder_config(), BLIP_DEFAULT_NEW_TOKENS)
    }
}

/// `BlipImageProcessor`'s defaults: bicubic, CLIP's mean and std.
pub fn default_preprocessor() -> HfPreprocessorConfig {
    HfPreprocessorConfig {
        resample: PIL_BICUBIC,
        image_mean: Some(CLIP_MEAN),
        image_std: Some(CLIP_STD),
        ..HfPreprocessorConfig::default()
    }
}

/// The vision tower under `vision_model.`.
pub fn load_vision(vb: VarBuilder, cfg: &VitConfig) -> Result<Vit> {
    let d = cfg.hidden_size;
    let (c, p) = (cfg.num_channels, cfg.patch_size);
    let emb = vb.pp("embeddings");
    // Conv2d (hidden, channels, patch, patch), stride = kernel = patch: a
    // linear layer over patches flattened channel-major.
    let conv = emb.pp("patch_embedding");
    let patch_embed = Linear::new(
        conv.get((d, c, p, p), "weight")?.reshape((d, c * p * p))?,
        Some(conv.get(d, "bias")?),
    );
    let cls = emb.get((1, 1, d), "class_embedding")?;
    let positions = emb.get((1, 1 + cfg.num_patches(), d), "position_embedding")?;
    let attn_cfg = SelfAttentionConfig::new(d, cfg.num_attention_heads);
    let eps = cfg.layer_norm_eps;
    let blocks = (0..cfg.num_hidden_layers)
        .map(|i| {
            let l = vb.pp("encoder").pp("layers").pp(i);
            let a = l.pp("self_attn");
            // (3 * d, d) rows: query, key, value.
            let qkv = a.pp("qkv");
            let (w, b) = (qkv.get((3 * d, d), "weight")?, qkv.get(3 * d, "bias")?);
            let part = |k: usize| -> Result<Linear> {
                Ok(Linear::new(
                    w.narrow(0, k * d, d)?,
                    Some(b.narrow(0, k * d, d)?),
                ))
            };
            let attn = SelfAttention::from_parts(
                part(0)?,
                part(1)?,
                part(2)?,
                linear(a.pp("projection"), d, d, true)?,
                &attn_cfg,
            )?;
            Ok(VitBlock::from_parts(
                layer_norm(l.pp("layer_norm1"), d, eps)?,
                attn,
                layer_norm(l.pp("layer_norm2"), d, eps)?,
                FeedForward::from_parts(
                    linear(l.pp("mlp").pp("fc1"), d, cfg.intermediate_size, true)?,
                    linear(l.pp("mlp").pp("fc2"), cfg.intermediate_size, d, true)?,
                    cfg.hidden_act,
                ),
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let final_norm = layer_norm(vb.pp("post_layernorm"), d, eps)?;
    Ok(Vit::from_parts(
        patch_embed,
        cls,
        positions,
        blocks,
        final_norm,
        None,
        cfg,
    )?)
}

/// The BERT text decoder under `text_decoder.`.
pub fn load_text(
    vb: VarBuilder,
    cfg: &DecoderConfig,
    block_built: &mut crate::checkpoint::BlockHook,
) -> Result<VisionLanguageDecoder> {
    let bert = vb.pp("bert");
    let (h, eps) = (cfg.hidden_size, cfg.layer_norm_eps);
    let emb = bert.pp("embeddings");
    let words = emb
        .pp("word_embeddings")
        .get((cfg.vocab_size, h), "weight")?;
    let positions = emb
        .pp("position_embeddings")
        .get((cfg.max_position_embeddings, h), "weight")?;
    let self_cfg = SelfAttentionConfig::new(h, cfg.num_attention_heads);
    let cross_cfg = CrossAttentionConfig::new(h, cfg.memory_dim, cfg.num_attention_heads);
    let attention = |a: VarBuilder, kv_width: usize| -> Result<[Linear; 4]> {
        let s = a.pp("self");
        Ok([
            linear(s.pp("query"), h, h, true)?,
            linear(s.pp("key"), kv_width, h, true)?,
            linear(s.pp("value"), kv_width, h, true)?,
            linear(a.pp("output").pp("dense"), h, h, true)?,
        ])
    };
    let blocks = (0..cfg.num_hidden_layers)
        .map(|i| {
            let l = bert.pp("encoder").pp("layer").pp(i);
            let [q, k, v, o] = attention(l.pp("attention"), h)?;
            let self_attn = CausalSelfAttention::from_parts(q, k, v, o, &self_cfg)?;
            let [q, k, v, o] = attention(l.pp("crossattention"), cfg.memory_dim)?;
            let cross = CrossBranch {
                cross_attn_norm: layer_norm(
                    l.pp("crossattention").pp("output").pp("LayerNorm"),
                    h,
                    eps,
                )?,
                cross_attn: CrossAttention::from_parts(q, k, v, o, &cross_cfg)?,
                gate: None,
                ffn: None,
            };
            let block = DecoderBlock::from_parts(
                layer_norm(l.pp("attention").pp("output").pp("LayerNorm"), h, eps)?,
                self_attn,
                Some(cross),
                layer_norm(l.pp("output").pp("LayerNorm"), h, eps)?,
                FeedForward::from_parts(
                    linear(
                        l.pp("intermediate").pp("dense"),
                        h,
                        cfg.intermediate_size,
                        true,
                    )?,
                    linear(l.pp("output").pp("dense"), cfg.intermediate_size, h, true)?,
                    cfg.hidden_act,
                ),
            );
            block_built(i, block)
        })
        .collect::<Result<Vec<_>>>()?;
    let pred = vb.pp("cls").pp("predictions");
    let transform = pred.pp("transform");
    let output_transform = OutputTransform::from_parts(
        linear(transform.pp("dense"), h, h, true)?,
        layer_norm(transform.pp("LayerNorm"), h, eps)?,
        cfg,
    )?;
    // transformers saves the head's bias as `cls.predictions.bias`, older
    // checkpoints (also) as `cls.predictions.decoder.bias`.
    let bias: Tensor = if pred.contains_tensor("bias") {
        pred.get(cfg.vocab_size, "bias")?
    } else {
        pred.pp("decoder").get(cfg.vocab_size, "bias")?
    };
    let head = if cfg.tie_word_embeddings {
        words.clone()
    } else {
        pred.pp("decoder").get((cfg.vocab_size, h), "weight")?
    };
    Ok(VisionLanguageDecoder::from_parts(
        DecoderParts {
            embed_tokens: Embedding::new(words, h),
            embed_positions: Some(Embedding::new(positions, h)),
            embedding_norm: Some(layer_norm(emb.pp("LayerNorm"), h, eps)?),
            blocks,
            final_norm: None,
            output_transform: Some(output_transform),
            lm_head: Linear::new(head, Some(bias)),
        },
        cfg,
    )?)
}

impl Family for HfBlipConfig {
    const FORMAT: ModelFormat = ModelFormat::Blip;

    fn plan(source: &Source, config: &serde_json::Value) -> Result<Plan<Self>> {
        let dir = source.dir(Self::FORMAT)?;
        let config_path = dir.join(CONFIG_FILE);
        let cfg: HfBlipConfig = from_value(config, &config_path)?;
        cfg.validate().map_err(in_file(&config_path))?;
        let pre_path = dir.join(PREPROCESSOR_FILE);
        let pre = if pre_path.is_file() {
            read_json(&pre_path)?
        } else {
            tracing::warn!(
                "{}: no such file; using BlipImageProcessor's defaults (bicubic, CLIP mean and std)",
                pre_path.display()
            );
            default_preprocessor()
        };
        let pixels = pre
            .pixel_spec(cfg.vision_config.image_size)
            .map_err(in_file(&pre_path))?;
        let vit_cfg = cfg.vit_config(&pixels);
        vit_cfg.validate().map_err(in_file(&config_path))?;
        let dec_cfg = cfg.decoder_config();
        dec_cfg.validate().map_err(in_file(&config_path))?;
        let generation = cfg.generation_config();
        generation
            .check_ids(dec_cfg.vocab_size)
            .map_err(in_file(&config_path))?;
        let tokenizer = load_hf_tokenizer(dir, dec_cfg.vocab_size)?;
        Ok(Plan {
            family: cfg,
            config: super::vit_model(dec_cfg, vit_cfg),
            generation,
            tokenizer,
        })
    }

    fn vision(
        &self,
        vb: &VarBuilder,
        config: &VlConfig,
    ) -> Result<Option<(VisionEncoder, Option<Resampler>)>> {
        super::vit_vision(config, |cfg| load_vision(vb.pp("vision_model"), cfg))
    }

    fn decoder(
        &self,
        vb: &VarBuilder,
        config: &VlConfig,
        block: &mut BlockHook,
    ) -> Result<VisionLanguageDecoder> {
        load_text(vb.pp("text_decoder"), &config.decoder, block)
    }
}
