//! The TrOCR decoder family (`decoder.model_type` `trocr`, transformers'
//! `TrOCRForCausalLM`): its config and its tensors mapped onto vl's
//! [`DecoderBlock`]s through `from_parts`, as post-LN blocks.
//!
//! TrOCR is BART's decoder: post-LN layers (`self_attn_layer_norm`,
//! `encoder_attn_layer_norm`, `final_layer_norm` after each residual add,
//! no norm after the last layer), token embeddings scaled by
//! `sqrt(d_model)` with `scale_embedding`, learned positions read from row
//! 2 on, or fairseq's sinusoids (`use_learned_position_embeddings: false`,
//! padding index `pad_token_id`), an optional `layernorm_embedding`,
//! cross-attention keys and values from `cross_attention_hidden_size`-wide
//! encoder tokens, and `output_projection` tied to the token embedding or
//! not (`tie_word_embeddings` of the decoder, as transformers decides).
//! Every projection has a bias except `output_projection`.
//!
//! `activation_dropout` and `decoder_layerdrop` act only in training, which
//! vl does not run on these checkpoints: they are read and ignored.

use std::collections::BTreeMap;

use candle_nn::{Embedding, Linear, VarBuilder};
use serde::Deserialize;
use serde_json::Value;
use vl_attn::{
    CausalSelfAttention, CrossAttention, CrossAttentionConfig, FeedForward, SelfAttentionConfig,
};
use vl_decoder::block::{CrossBranch, DecoderBlock};
use vl_decoder::{
    Activation, DecoderConfig, DecoderParts, GenerationConfig, NormPlacement, PositionEmbedding,
    VisionLanguageDecoder,
};

use super::tensors::{layer_norm, linear};
use crate::error::{check_dropouts, config_err, Result};

/// TrOCR's layer norms are `torch.nn.LayerNorm` with its default epsilon.
pub const TROCR_LAYER_NORM_EPS: f64 = 1e-5;
/// The row of position 0 in TrOCR's learned position table
/// (`TrOCRLearnedPositionalEmbedding.offset`).
pub const TROCR_POSITION_OFFSET: usize = 2;
/// `TrOCRConfig`'s default `pad_token_id`, fairseq's padding index.
pub const TROCR_DEFAULT_PAD: u32 = 1;

fn default_true() -> bool {
    true
}
fn gelu() -> Activation {
    Activation::Gelu
}
fn positions_512() -> usize {
    512
}
fn dropout_01() -> f64 {
    0.1
}

/// `config.json`'s `decoder`: a transformers `TrOCRConfig`, with its
/// defaults.
#[derive(Debug, Clone, Deserialize)]
pub struct HfTrocrConfig {
    /// Must be `"trocr"`.
    pub model_type: String,
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Width.
    pub d_model: usize,
    /// Layers.
    pub decoder_layers: usize,
    /// Heads.
    pub decoder_attention_heads: usize,
    /// Feed-forward width.
    pub decoder_ffn_dim: usize,
    /// Feed-forward activation (default `gelu`).
    #[serde(default = "gelu")]
    pub activation_function: Activation,
    /// Positions (default 512).
    #[serde(default = "positions_512")]
    pub max_position_embeddings: usize,
    /// Token embeddings times `sqrt(d_model)` (default false).
    #[serde(default)]
    pub scale_embedding: bool,
    /// Learned positions (default) or fairseq's sinusoids.
    #[serde(default = "default_true")]
    pub use_learned_position_embeddings: bool,
    /// A layer norm on the embeddings (default true).
    #[serde(default = "default_true")]
    pub layernorm_embedding: bool,
    /// Width of the encoder tokens the cross-attention reads; `null` means
    /// `d_model` (the encoder's tokens then go through `enc_to_dec_proj`
    /// when it is narrower or wider).
    #[serde(default)]
    pub cross_attention_hidden_size: Option<usize>,
    /// Whether `output_projection` is the token embedding (default true).
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    /// Dropout on the residual branches and embeddings, in training
    /// (default 0.1).
    #[serde(default = "dropout_01")]
    pub dropout: f64,
    /// Dropout on the attention probabilities, in training (default 0).
    #[serde(default)]
    pub attention_dropout: f64,
    /// Every other key: the special tokens and generation settings of
    /// older checkpoints (`pad_token_id` among them: see
    /// [`HfTrocrConfig::padding_idx`]).
    #[serde(flatten)]
    pub rest: BTreeMap<String, Value>,
}

impl HfTrocrConfig {
    /// fairseq's padding index of sinusoidal positions: the decoder's
    /// `pad_token_id` (default [`TROCR_DEFAULT_PAD`]).
    ///
    /// # Errors
    /// `decoder.pad_token_id` when it is `null` or not a `u32`.
    pub fn padding_idx(&self) -> Result<u32> {
        match self.rest.get("pad_token_id") {
            None => Ok(TROCR_DEFAULT_PAD),
            Some(v) => match v.as_u64().and_then(|n| u32::try_from(n).ok()) {
                Some(p) => Ok(p),
                None => config_err(
                    "decoder.pad_token_id",
                    format!("sinusoidal positions need a padding index, got {v}"),
                ),
            },
        }
    }

    /// Rejects what vl cannot run, naming the field; `encoder_width` is
    /// the encoder's `hidden_size`.
    pub fn validate(&self, encoder_width: usize) -> Result<()> {
        check_dropouts(&[
            ("decoder.dropout", self.dropout),
            ("decoder.attention_dropout", self.attention_dropout),
        ])?;
        if let Some(w) = self
            .cross_attention_hidden_size
            .filter(|&w| w != encoder_width)
        {
            return config_err(
                "decoder.cross_attention_hidden_size",
                format!("{w} is not the encoder's hidden_size {encoder_width}"),
            );
        }
        if !self.use_learned_position_embeddings {
            let p = self.padding_idx()?;
            if p as usize >= self.vocab_size {
                return config_err(
                    "decoder.pad_token_id",
                    format!("{p} is not below vocab_size {}", self.vocab_size),
                );
            }
        }
        Ok(())
    }

    /// Whether the encoder's tokens go through `enc_to_dec_proj`
    /// (transformers: widths differ and no `cross_attention_hidden_size`).
    pub fn projects_encoder(&self, encoder_width: usize) -> bool {
        self.cross_attention_hidden_size.is_none() && encoder_width != self.d_model
    }

    /// The decoder as a vl [`DecoderConfig`], with the special tokens of
    /// `generation`.
    ///
    /// # Errors
    /// As [`HfTrocrConfig::padding_idx`], for sinusoidal positions.
    pub fn decoder_config(&self, generation: &GenerationConfig) -> Result<DecoderConfig> {
        let eos = generation
            .eos_token_ids
            .first()
            .copied()
            .unwrap_or(generation.start_token_id);
        let (position_embedding, position_offset, position_padding_idx) =
            if self.use_learned_position_embeddings {
                (PositionEmbedding::Learned, TROCR_POSITION_OFFSET, None)
            } else {
                (PositionEmbedding::Sinusoidal, 0, Some(self.padding_idx()?))
            };
        Ok(DecoderConfig {
            vocab_size: self.vocab_size,
            hidden_size: self.d_model,
            num_attention_heads: self.decoder_attention_heads,
            num_key_value_heads: None,
            num_hidden_layers: self.decoder_layers,
            intermediate_size: self.decoder_ffn_dim,
            max_position_embeddings: self.max_position_embeddings,
            memory_dim: self.cross_attention_hidden_size.unwrap_or(self.d_model),
            hidden_act: self.activation_function,
            layer_norm_eps: TROCR_LAYER_NORM_EPS,
            tie_word_embeddings: self.tie_word_embeddings,
            cross_attention_every: 1,
            gated_cross_attention: false,
            gated_cross_ffn: false,
            attention_bias: true,
            // Inference ignores them; a decoder switched to training uses them.
            attention_dropout: self.attention_dropout,
            residual_dropout: self.dropout,
            embedding_dropout: self.dropout,
            norm_placement: NormPlacement::Post,
            final_norm: false,
            scale_embedding: self.scale_embedding,
            layernorm_embedding: self.layernorm_embedding,
            output_transform: false,
            lm_head_bias: false,
            position_embedding,
            position_offset,
            position_padding_idx,
            bos_token_id: generation.start_token_id,
            eos_token_id: eos,
            pad_token_id: generation.pad_token_id,
        })
    }
}

/// TrOCR under `decoder.` onto vl's decoder: `decoder.model.decoder.*`
/// and `decoder.output_projection.weight` (untied only).
pub fn load(
    vb: VarBuilder,
    cfg: &DecoderConfig,
    block_built: &mut crate::checkpoint::BlockHook,
) -> Result<VisionLanguageDecoder> {
    let top = vb.pp("decoder");
    let dec = top.pp("model").pp("decoder");
    let embed_tokens = dec
        .pp("embed_tokens")
        .get((cfg.vocab_size, cfg.hidden_size), "weight")?;
    let lm_head = if cfg.tie_word_embeddings {
        Linear::new(embed_tokens.clone(), None)
    } else {
        linear(
            top.pp("output_projection"),
            cfg.hidden_size,
            cfg.vocab_size,
            false,
        )?
    };
    bart_decoder(dec, embed_tokens, lm_head, cfg, block_built)
}

/// BART's decoder layout under `dec` (`embed_positions`,
/// `layernorm_embedding`, `layers.{i}.{self_attn,encoder_attn}.*`,
/// `fc1`, `fc2`, the three norms of each layer — after its sublayers or,
/// with [`NormPlacement::Pre`], before them — and with `cfg.final_norm`
/// mBART's `layer_norm` after the last layer) onto vl's decoder, with the
/// token table and the LM head the family found (TrOCR's and mBART's own,
/// Florence-2's shared ones).
pub(super) fn bart_decoder(
    dec: VarBuilder,
    embed_tokens: candle_core::Tensor,
    lm_head: Linear,
    cfg: &DecoderConfig,
    block_built: &mut crate::checkpoint::BlockHook,
) -> Result<VisionLanguageDecoder> {
    let h = cfg.hidden_size;
    let eps = cfg.layer_norm_eps;
    let embed_positions = match cfg.position_embedding {
        PositionEmbedding::Learned => Some(Embedding::new(
            dec.pp("embed_positions").get(
                (cfg.max_position_embeddings + cfg.position_offset, h),
                "weight",
            )?,
            h,
        )),
        PositionEmbedding::Sinusoidal => None,
    };
    let embedding_norm = if cfg.layernorm_embedding {
        Some(layer_norm(dec.pp("layernorm_embedding"), h, eps)?)
    } else {
        None
    };
    let self_cfg = SelfAttentionConfig::new(h, cfg.num_attention_heads);
    let cross_cfg = CrossAttentionConfig::new(h, cfg.memory_dim, cfg.num_attention_heads);
    let blocks = (0..cfg.num_hidden_layers)
        .map(|i| {
            let l = dec.pp("layers").pp(i);
            let [q, k, v, o] = bart_attention(l.pp("self_attn"), h, h)?;
            let self_attn = CausalSelfAttention::from_parts(q, k, v, o, &self_cfg)?;
            let [q, k, v, o] = bart_attention(l.pp("encoder_attn"), h, cfg.memory_dim)?;
            let cross = CrossBranch {
                cross_attn_norm: layer_norm(l.pp("encoder_attn_layer_norm"), h, eps)?,
                cross_attn: CrossAttention::from_parts(q, k, v, o, &cross_cfg)?,
                gate: None,
                ffn: None,
            };
            let block = DecoderBlock::from_parts(
                layer_norm(l.pp("self_attn_layer_norm"), h, eps)?,
                self_attn,
                Some(cross),
                layer_norm(l.pp("final_layer_norm"), h, eps)?,
                FeedForward::from_parts(
                    linear(l.pp("fc1"), h, cfg.intermediate_size, true)?,
                    linear(l.pp("fc2"), cfg.intermediate_size, h, true)?,
                    cfg.hidden_act,
                ),
            );
            block_built(i, block)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(VisionLanguageDecoder::from_parts(
        DecoderParts {
            embed_tokens: Embedding::new(embed_tokens, h),
            embed_positions,
            embedding_norm,
            blocks,
            // mBART's `layer_norm` after the last layer (BART has none).
            final_norm: if cfg.final_norm {
                Some(layer_norm(dec.pp("layer_norm"), h, eps)?)
            } else {
                None
            },
            output_transform: None,
            lm_head,
        },
        cfg,
    )?)
}

/// BART's `q_proj`, `k_proj`, `v_proj`, `out_proj` under `a`, with biases;
/// keys and values read `kv_width`-wide tokens.
pub(super) fn bart_attention(a: VarBuilder, h: usize, kv_width: usize) -> Result<[Linear; 4]> {
    Ok([
        linear(a.pp("q_proj"), h, h, true)?,
        linear(a.pp("k_proj"), kv_width, h, true)?,
        linear(a.pp("v_proj"), kv_width, h, true)?,
        linear(a.pp("out_proj"), h, h, true)?,
    ])
}
