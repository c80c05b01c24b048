//! The mBART decoder family (`decoder.model_type` `mbart`, transformers'
//! `MBartForCausalLM`: Donut's and Nougat's text decoder) onto vl's
//! [`VisionLanguageDecoder`] as pre-LN blocks.
//!
//! mBART is BART's decoder with the layer norms moved before each sublayer
//! (`self_attn_layer_norm`, `encoder_attn_layer_norm`, `final_layer_norm`),
//! a `layernorm_embedding` after the embeddings and a `layer_norm` after
//! the last layer; token embeddings times `sqrt(d_model)` with
//! `scale_embedding`; learned positions read from row 2 on; cross-attention
//! keys and values from `d_model`-wide encoder tokens (a wider or narrower
//! encoder goes through `enc_to_dec_proj`); an LM head without bias, tied
//! to the token embedding (Donut) or not (Nougat). Every projection has a
//! bias. `activation_dropout` and `decoder_layerdrop` act only in
//! training: read and ignored.

use std::collections::BTreeMap;

use candle_nn::{Linear, VarBuilder};
use serde::Deserialize;
use serde_json::Value;
use vl_decoder::{
    Activation, DecoderConfig, GenerationConfig, NormPlacement, PositionEmbedding,
    VisionLanguageDecoder,
};

use super::tensors::linear;
use super::trocr::bart_decoder;
use crate::error::{check_dropouts, Result};

/// mBART's layer norms are `torch.nn.LayerNorm` with its default epsilon.
pub const MBART_LAYER_NORM_EPS: f64 = 1e-5;
/// The row of position 0 in mBART's learned position table
/// (`MBartLearnedPositionalEmbedding.offset`).
pub const MBART_POSITION_OFFSET: usize = 2;

fn default_true() -> bool {
    true
}
fn gelu() -> Activation {
    Activation::Gelu
}
fn positions_1024() -> usize {
    1024
}
fn dropout_01() -> f64 {
    0.1
}

/// `config.json`'s `decoder`: a transformers `MBartConfig`, with its
/// defaults (only the decoder's fields are read).
#[derive(Debug, Clone, Deserialize)]
pub struct HfMbartConfig {
    /// Must be `"mbart"`.
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
    /// Positions (default 1024).
    #[serde(default = "positions_1024")]
    pub max_position_embeddings: usize,
    /// Token embeddings times `sqrt(d_model)` (default false).
    #[serde(default)]
    pub scale_embedding: bool,
    /// Whether the LM head is the token embedding (default true).
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
    /// older checkpoints, the encoder's sizes of a full mBART config.
    #[serde(flatten)]
    pub rest: BTreeMap<String, Value>,
}

impl HfMbartConfig {
    /// Rejects what vl cannot run, naming the field.
    pub fn validate(&self) -> Result<()> {
        check_dropouts(&[
            ("decoder.dropout", self.dropout),
            ("decoder.attention_dropout", self.attention_dropout),
        ])
    }

    /// Whether the encoder's tokens go through `enc_to_dec_proj`
    /// (transformers: the widths differ; mBART has no
    /// `cross_attention_hidden_size`).
    pub fn projects_encoder(&self, encoder_width: usize) -> bool {
        encoder_width != self.d_model
    }

    /// The decoder as a vl [`DecoderConfig`], with the special tokens of
    /// `generation`.
    pub fn decoder_config(&self, generation: &GenerationConfig) -> DecoderConfig {
        let eos = generation
            .eos_token_ids
            .first()
            .copied()
            .unwrap_or(generation.start_token_id);
        DecoderConfig {
            vocab_size: self.vocab_size,
            hidden_size: self.d_model,
            num_attention_heads: self.decoder_attention_heads,
            num_key_value_heads: None,
            num_hidden_layers: self.decoder_layers,
            intermediate_size: self.decoder_ffn_dim,
            max_position_embeddings: self.max_position_embeddings,
            memory_dim: self.d_model,
            hidden_act: self.activation_function,
            layer_norm_eps: MBART_LAYER_NORM_EPS,
            tie_word_embeddings: self.tie_word_embeddings,
            cross_attention_every: 1,
            gated_cross_attention: false,
            gated_cross_ffn: false,
            attention_bias: true,
            // Inference ignores them; a decoder switched to training uses them.
            attention_dropout: self.attention_dropout,
            residual_dropout: self.dropout,
            embedding_dropout: self.dropout,
            norm_placement: NormPlacement::Pre,
            final_norm: true,
            scale_embedding: self.scale_embedding,
            layernorm_embedding: true,
            output_transform: false,
            lm_head_bias: false,
            position_embedding: PositionEmbedding::Learned,
            position_offset: MBART_POSITION_OFFSET,
            position_padding_idx: None,
            bos_token_id: generation.start_token_id,
            eos_token_id: eos,
            pad_token_id: generation.pad_token_id,
        }
    }
}

/// mBART under `decoder.` onto vl's decoder: `decoder.model.decoder.*`
/// (BART's layout, with `layer_norm` after the last layer) and
/// `decoder.lm_head.weight` (untied only).
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
        linear(top.pp("lm_head"), cfg.hidden_size, cfg.vocab_size, false)?
    };
    bart_decoder(dec, embed_tokens, lm_head, cfg, block_built)
}
