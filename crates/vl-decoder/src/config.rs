//! The decoder's configuration, read from `config.json`.

use serde::{Deserialize, Serialize};

use crate::error::{config_err, Result};
pub use crate::positions::PositionEmbedding;

pub use vl_attn::Activation;
use vl_attn::Dropout;

/// The decoder's dropouts, from [`DecoderConfig::dropouts`]; they act only
/// in training (see [`crate::VisionLanguageDecoder::set_mode`]).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Dropouts {
    /// On the attention probabilities (`attention_dropout`).
    pub attention: Dropout,
    /// On the residual branches (`residual_dropout`).
    pub residual: Dropout,
    /// On the embeddings (`embedding_dropout`).
    pub embedding: Dropout,
}

fn default_kv_heads() -> Option<usize> {
    None
}
fn default_act() -> Activation {
    Activation::Gelu
}
fn default_eps() -> f64 {
    1e-5
}
fn default_true() -> bool {
    true
}
fn default_every() -> usize {
    1
}
fn is_false(b: &bool) -> bool {
    !*b
}
fn is_true(b: &bool) -> bool {
    *b
}
fn is_zero(n: &usize) -> bool {
    *n == 0
}
fn is_default<T: Default + PartialEq>(t: &T) -> bool {
    *t == T::default()
}

/// Where each block's norms sit relative to its residual branches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NormPlacement {
    /// `x = x + f(norm(x))` per branch (GPT-2, vl's own; the default).
    #[default]
    Pre,
    /// `x = norm(x + f(x))` per branch (the original Transformer, BART,
    /// TrOCR, BERT).
    Post,
}

/// The decoder's sizes and special tokens. Field names follow the Hugging
/// Face `config.json` keys, with GPT-2's spellings accepted as aliases.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecoderConfig {
    /// Tokens in the vocabulary.
    #[serde(alias = "n_vocab")]
    pub vocab_size: usize,
    /// Width of the text stream.
    #[serde(alias = "n_embd", alias = "d_model")]
    pub hidden_size: usize,
    /// Self- and cross-attention heads.
    #[serde(alias = "n_head")]
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention); defaults to
    /// `num_attention_heads`.
    #[serde(default = "default_kv_heads")]
    pub num_key_value_heads: Option<usize>,
    /// Decoder blocks.
    #[serde(alias = "n_layer")]
    pub num_hidden_layers: usize,
    /// Width of the feed-forward layer.
    #[serde(alias = "n_inner")]
    pub intermediate_size: usize,
    /// Learned positions; the longest sequence the decoder can read.
    #[serde(alias = "n_positions", alias = "n_ctx")]
    pub max_position_embeddings: usize,
    /// Width of the image tokens (the memory) that cross-attention reads.
    #[serde(alias = "cross_attention_hidden_size", alias = "encoder_hidden_size")]
    pub memory_dim: usize,
    /// Feed-forward activation (default `gelu`, the erf form).
    #[serde(default = "default_act", alias = "activation_function")]
    pub hidden_act: Activation,
    /// Layer-norm epsilon (default 1e-5).
    #[serde(default = "default_eps", alias = "layer_norm_epsilon")]
    pub layer_norm_eps: f64,
    /// Whether the LM head shares the token embedding (default true).
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    /// Cross-attention in every k-th block, starting with the first
    /// (1 = every block; Flamingo uses k > 1). Default 1.
    #[serde(default = "default_every")]
    pub cross_attention_every: usize,
    /// Flamingo's tanh gate on the cross-attention branch (default false).
    #[serde(default)]
    pub gated_cross_attention: bool,
    /// Flamingo's gated dense layer: a feed-forward of the cross-attention
    /// branch's own after it, behind a zero-initialised tanh gate (default
    /// false).
    #[serde(default)]
    pub gated_cross_ffn: bool,
    /// Whether the attention projections have biases (default true).
    #[serde(default = "default_true")]
    pub attention_bias: bool,
    /// Dropout on the attention probabilities of every self- and
    /// cross-attention, in training only (default 0; GPT-2's `attn_pdrop`).
    #[serde(default, alias = "attn_pdrop")]
    pub attention_dropout: f64,
    /// Dropout on every residual branch (attention, feed-forward) before it
    /// is added back, in training only (default 0; GPT-2's `resid_pdrop`,
    /// BART's `dropout`).
    #[serde(default, alias = "resid_pdrop", alias = "dropout")]
    pub residual_dropout: f64,
    /// Dropout on the token plus position embeddings, in training only
    /// (default 0; GPT-2's `embd_pdrop`).
    #[serde(default, alias = "embd_pdrop")]
    pub embedding_dropout: f64,
    /// Where each block's norms sit (default `pre`).
    #[serde(default, skip_serializing_if = "is_default")]
    pub norm_placement: NormPlacement,
    /// Whether the last block is followed by `final_norm` (default true;
    /// post-LN families such as TrOCR have none).
    #[serde(default = "default_true", skip_serializing_if = "is_true")]
    pub final_norm: bool,
    /// Token embeddings multiplied by `sqrt(hidden_size)` (default false;
    /// BART's and TrOCR's `scale_embedding`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub scale_embedding: bool,
    /// A layer norm `embedding_norm` on the token plus position embeddings
    /// (default false; BART's and TrOCR's `layernorm_embedding`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub layernorm_embedding: bool,
    /// A transform `norm(act(dense(x)))` before the LM head (default
    /// false; BERT's `cls.predictions.transform`, BLIP's text decoder),
    /// see [`crate::head::OutputTransform`].
    #[serde(default, skip_serializing_if = "is_false")]
    pub output_transform: bool,
    /// Whether the LM head adds a bias (`lm_head.bias`, also when the head
    /// is tied to the token embedding; default false; BLIP's has one).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lm_head_bias: bool,
    /// Learned (default) or sinusoidal positions, see [`crate::positions`].
    #[serde(default, skip_serializing_if = "is_default")]
    pub position_embedding: PositionEmbedding,
    /// The row of position 0 in the position table (default 0; BART and
    /// TrOCR 2); the table has `max_position_embeddings + position_offset`
    /// rows. Must be 0 with a `position_padding_idx`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub position_offset: usize,
    /// Sinusoidal positions only: fairseq's padding index, whose row is
    /// zero and read by padding tokens, other tokens counting from the row
    /// after it (see [`crate::positions`]; TrOCR's `pad_token_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position_padding_idx: Option<u32>,
    /// The start token.
    pub bos_token_id: u32,
    /// The end token.
    pub eos_token_id: u32,
    /// The padding token.
    pub pad_token_id: u32,
}

impl DecoderConfig {
    /// Key/value heads, resolved.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Whether block `layer` has cross-attention.
    pub fn has_cross_attention(&self, layer: usize) -> bool {
        layer.is_multiple_of(self.cross_attention_every)
    }

    /// The attention, residual and embedding dropouts, checked.
    ///
    /// # Errors
    /// [`crate::DecoderError::Config`] naming the field that is not in
    /// `[0, 1)`.
    pub fn dropouts(&self) -> Result<Dropouts> {
        let check = |field, p| {
            Dropout::new(field, p).map_err(|_| crate::DecoderError::Config {
                field,
                reason: format!("expected a dropout probability in [0, 1), got {p}"),
            })
        };
        Ok(Dropouts {
            attention: check("attention_dropout", self.attention_dropout)?,
            residual: check("residual_dropout", self.residual_dropout)?,
            embedding: check("embedding_dropout", self.embedding_dropout)?,
        })
    }

    /// Rejects impossible values before any tensor is built.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_hidden_layers", self.num_hidden_layers),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("memory_dim", self.memory_dim),
            ("cross_attention_every", self.cross_attention_every),
            ("num_key_value_heads", self.kv_heads()),
        ];
        for (field, v) in positive {
            if v == 0 {
                return config_err(field, "must be positive, got 0");
            }
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return config_err(
                "hidden_size",
                format!(
                    "{} is not divisible by num_attention_heads {}",
                    self.hidden_size, self.num_attention_heads
                ),
            );
        }
        if !self.num_attention_heads.is_multiple_of(self.kv_heads()) {
            return config_err(
                "num_key_value_heads",
                format!(
                    "num_attention_heads {} is not divisible by {}",
                    self.num_attention_heads,
                    self.kv_heads()
                ),
            );
        }
        if !(self.layer_norm_eps > 0.0 && self.layer_norm_eps.is_finite()) {
            return config_err(
                "layer_norm_eps",
                format!("must be positive, got {}", self.layer_norm_eps),
            );
        }
        self.dropouts()?;
        self.validate_positions()?;
        for (field, id) in [
            ("bos_token_id", self.bos_token_id),
            ("eos_token_id", self.eos_token_id),
            ("pad_token_id", self.pad_token_id),
        ] {
            if id as usize >= self.vocab_size {
                return config_err(
                    field,
                    format!("{id} is not below vocab_size {}", self.vocab_size),
                );
            }
        }
        Ok(())
    }

    fn validate_positions(&self) -> Result<()> {
        if let Some(p) = self.position_padding_idx {
            if self.position_embedding != PositionEmbedding::Sinusoidal {
                return config_err(
                    "position_padding_idx",
                    format!("{p} is set, but only sinusoidal positions skip padding tokens"),
                );
            }
            if self.position_offset != 0 {
                return config_err(
                    "position_offset",
                    format!(
                        "must be 0 with position_padding_idx {p} (positions start after it), got {}",
                        self.position_offset
                    ),
                );
            }
        }
        if self.position_embedding == PositionEmbedding::Sinusoidal && self.hidden_size < 4 {
            return config_err(
                "hidden_size",
                format!(
                    "sinusoidal positions need a width of at least 4, got {}",
                    self.hidden_size
                ),
            );
        }
        if crate::positions::table_rows(self).is_none() {
            return config_err(
                "max_position_embeddings",
                format!(
                    "{} positions past the offset or padding row pass u32::MAX rows",
                    self.max_position_embeddings
                ),
            );
        }
        Ok(())
    }

    /// A tiny configuration for tests and examples.
    pub fn tiny(vocab_size: usize, memory_dim: usize) -> Self {
        Self {
            vocab_size,
            hidden_size: 32,
            num_attention_heads: 4,
            num_key_value_heads: None,
            num_hidden_layers: 2,
            intermediate_size: 64,
            max_position_embeddings: 64,
            memory_dim,
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
            norm_placement: NormPlacement::Pre,
            final_norm: true,
            scale_embedding: false,
            layernorm_embedding: false,
            output_transform: false,
            lm_head_bias: false,
            position_embedding: PositionEmbedding::Learned,
            position_offset: 0,
            position_padding_idx: None,
            bos_token_id: 1,
            eos_token_id: 2,
            pad_token_id: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_spellings_and_defaults() {
        let cfg: DecoderConfig = serde_json::from_str(
            r#"{"n_vocab": 50, "n_embd": 16, "n_head": 4, "n_layer": 2, "n_inner": 64,
                "n_positions": 32, "encoder_hidden_size": 24, "activation_function": "gelu_new",
                "layer_norm_epsilon": 1e-5, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}"#,
        )
        .expect("parse");
        assert_eq!(cfg.hidden_act, Activation::GeluTanh);
        assert_eq!(cfg.kv_heads(), 4);
        assert!(cfg.tie_word_embeddings);
        assert_eq!(
            (
                cfg.attention_dropout,
                cfg.residual_dropout,
                cfg.embedding_dropout
            ),
            (0.0, 0.0, 0.0)
        );
        cfg.validate().expect("valid");
    }

    /// GPT-2's and BART's dropout keys land in the right fields.
    #[test]
    fn dropout_spellings() {
        let base = r#""vocab_size": 10, "hidden_size": 16, "num_attention_heads": 4,
            "num_hidden_layers": 1, "intermediate_size": 32, "max_position_embeddings": 8,
            "memory_dim": 8, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1"#;
        let gpt2: DecoderConfig = serde_json::from_str(&format!(
            r#"{{{base}, "attn_pdrop": 0.1, "resid_pdrop": 0.2, "embd_pdrop": 0.3}}"#
        ))
        .expect("parse");
        assert_eq!(
            (
                gpt2.attention_dropout,
                gpt2.residual_dropout,
                gpt2.embedding_dropout
            ),
            (0.1, 0.2, 0.3)
        );
        let bart: DecoderConfig = serde_json::from_str(&format!(
            r#"{{{base}, "attention_dropout": 0.1, "dropout": 0.2}}"#
        ))
        .expect("parse");
        assert_eq!(
            (
                bart.attention_dropout,
                bart.residual_dropout,
                bart.embedding_dropout
            ),
            (0.1, 0.2, 0.0)
        );
    }

    #[test]
    fn validate_names_the_field() {
        let mut cfg = DecoderConfig::tiny(10, 8);
        cfg.num_attention_heads = 3;
        let err = cfg.validate().unwrap_err().to_string();
        assert!(
            err.contains("hidden_size") && err.contains("32") && err.contains('3'),
            "{err}"
        );
        let mut cfg = DecoderConfig::tiny(10, 8);
        cfg.num_hidden_layers = 0;
        assert!(cfg
            .validate()
            .unwrap_err()
            .to_string()
            .contains("num_hidden_layers"));
        let mut cfg = DecoderConfig::tiny(10, 8);
        cfg.eos_token_id = 10;
        assert!(cfg
            .validate()
            .unwrap_err()
            .to_string()
            .contains("eos_token_id"));
        for (field, p) in [
            ("attention_dropout", 1.0),
            ("residual_dropout", -0.1),
            ("embedding_dropout", f64::NAN),
        ] {
            let mut cfg = DecoderConfig::tiny(10, 8);
            match field {
                "attention_dropout" => cfg.attention_dropout = p,
                "residual_dropout" => cfg.residual_dropout = p,
                _ => cfg.embedding_dropout = p,
            }
            let err = cfg.validate().unwrap_err().to_string();
            assert!(
                err.contains(field) && err.contains(&p.to_string()),
                "{field}: {err}"
            );
        }
        let bad =
            serde_json::from_str::<DecoderConfig>(r#"{"vocab_size": 10, "hidden_act": "tanhh"}"#);
        assert!(bad.is_err());
    }
}
