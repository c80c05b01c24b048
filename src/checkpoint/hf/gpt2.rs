//! The GPT-2 decoder family (`decoder.model_type` `gpt2` with
//! `add_cross_attention`): its config and its tensors mapped onto vl's
//! [`DecoderBlock`]s through `from_parts`.
//!
//! GPT-2 stores its projections as `Conv1D`, whose weight is `(in, out)`:
//! each is transposed to a `Linear`'s `(out, in)`. Its fused `c_attn`
//! `(hidden, 3 * hidden)` splits into query | key | value; the
//! cross-attention's `q_attn` is the query and its `c_attn`
//! `(hidden, 2 * hidden)` splits into key | value. The buffers `attn.bias`
//! and `attn.masked_bias` of older checkpoints are never read.

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

use super::tensors::layer_norm;
use crate::error::{check_dropouts, config_err, Result};

fn gpt2_eps() -> f64 {
    1e-5
}
fn default_true() -> bool {
    true
}
fn gelu_new() -> Activation {
    Activation::GeluTanh
}
/// transformers' `GPT2Config` default of `attn_pdrop`, `resid_pdrop` and
/// `embd_pdrop`, for a `config.json` that leaves one out.
pub const GPT2_DEFAULT_PDROP: f64 = 0.1;
fn gpt2_pdrop() -> f64 {
    GPT2_DEFAULT_PDROP
}

/// `config.json`'s `decoder`: a transformers `GPT2Config` with
/// cross-attention.
#[derive(Debug, Clone, Deserialize)]
pub struct HfGpt2Config {
    /// Must be `"gpt2"`.
    pub model_type: String,
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Width.
    pub n_embd: usize,
    /// Blocks.
    pub n_layer: usize,
    /// Heads.
    pub n_head: usize,
    /// Positions.
    pub n_positions: usize,
    /// Feed-forward width; `null` means `4 * n_embd`.
    #[serde(default)]
    pub n_inner: Option<usize>,
    /// Feed-forward activation (default `gelu_new`).
    #[serde(default = "gelu_new")]
    pub activation_function: Activation,
    /// Layer-norm epsilon (default 1e-5).
    #[serde(default = "gpt2_eps")]
    pub layer_norm_epsilon: f64,
    /// Must be true: the blocks must have cross-attention.
    #[serde(default)]
    pub add_cross_attention: bool,
    /// Scores divided by `sqrt(head_dim)`; must be true (default).
    #[serde(default = "default_true")]
    pub scale_attn_weights: bool,
    /// Scores also divided by the layer number; must be false (default).
    #[serde(default)]
    pub scale_attn_by_inverse_layer_idx: bool,
    /// Width of the encoder states the cross-attention reads; GPT-2 reads
    /// `n_embd`, so this must be unset or equal.
    #[serde(default)]
    pub cross_attention_hidden_size: Option<usize>,
    /// Whether `lm_head` is `wte` (default true).
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    /// Dropout on the attention probabilities, in training (default
    /// [`GPT2_DEFAULT_PDROP`], as transformers).
    #[serde(default = "gpt2_pdrop")]
    pub attn_pdrop: f64,
    /// Dropout on the residual branches, in training (default
    /// [`GPT2_DEFAULT_PDROP`]).
    #[serde(default = "gpt2_pdrop")]
    pub resid_pdrop: f64,
    /// Dropout on the embeddings, in training (default
    /// [`GPT2_DEFAULT_PDROP`]).
    #[serde(default = "gpt2_pdrop")]
    pub embd_pdrop: f64,
    /// Every other key: generation settings of older checkpoints.
    #[serde(flatten)]
    pub rest: BTreeMap<String, Value>,
}

impl HfGpt2Config {
    /// Rejects what vl cannot run, naming the field.
    pub fn validate(&self) -> Result<()> {
        if !self.add_cross_attention {
            return config_err(
                "decoder.add_cross_attention",
                "must be true: the decoder has no cross-attention to read the image with",
            );
        }
        if !self.scale_attn_weights || self.scale_attn_by_inverse_layer_idx {
            return config_err(
                "decoder.scale_attn_weights",
                "only scores scaled by 1/sqrt(head_dim) are supported \
                 (scale_attn_weights true, scale_attn_by_inverse_layer_idx false)",
            );
        }
        check_dropouts(&[
            ("decoder.attn_pdrop", self.attn_pdrop),
            ("decoder.resid_pdrop", self.resid_pdrop),
            ("decoder.embd_pdrop", self.embd_pdrop),
        ])?;
        if let Some(w) = self
            .cross_attention_hidden_size
            .filter(|&w| w != self.n_embd)
        {
            return config_err(
                "decoder.cross_attention_hidden_size",
                format!(
                    "GPT-2 cross-attention reads width n_embd {}, got {w}",
                    self.n_embd
                ),
            );
        }
        Ok(())
    }

    /// The decoder as a vl [`DecoderConfig`] (pre-LN, learned positions,
    /// final norm: the defaults), with the special tokens of `generation`.
    pub fn decoder_config(&self, generation: &GenerationConfig) -> DecoderConfig {
        let eos = generation
            .eos_token_ids
            .first()
            .copied()
            .unwrap_or(generation.start_token_id);
        DecoderConfig {
            vocab_size: self.vocab_size,
            hidden_size: self.n_embd,
            num_attention_heads: self.n_head,
            num_key_value_heads: None,
            num_hidden_layers: self.n_layer,
            intermediate_size: self.n_inner.unwrap_or(4 * self.n_embd),
            max_position_embeddings: self.n_positions,
            memory_dim: self.n_embd,
            hidden_act: self.activation_function,
            layer_norm_eps: self.layer_norm_epsilon,
            tie_word_embeddings: self.tie_word_embeddings,
            cross_attention_every: 1,
            gated_cross_attention: false,
            gated_cross_ffn: false,
            attention_bias: true,
            // Inference ignores them; a decoder switched to training uses them.
            attention_dropout: self.attn_pdrop,
            residual_dropout: self.resid_pdrop,
            embedding_dropout: self.embd_pdrop,
            bos_token_id: generation.start_token_id,
            eos_token_id: eos,
            pad_token_id: generation.pad_token_id,
            norm_placement: NormPlacement::Pre,
            final_norm: true,
            scale_embedding: false,
            layernorm_embedding: false,
            output_transform: false,
            lm_head_bias: false,
            position_embedding: PositionEmbedding::Learned,
            position_offset: 0,
            position_padding_idx: None,
        }
    }
}

/// A GPT-2 `Conv1D(out, in)`: `weight (in, out)`, `bias (out)`, split
/// along `out` into `parts` equal linear layers.
fn conv1d_split<const N: usize>(vb: VarBuilder, inp: usize, out: usize) -> Result<[Linear; N]> {
    // (in, out) -> (out, in), the layout of a Linear.
    let w = super::tensors::transposed(&vb.get((inp, out), "weight")?)?;
    let b = vb.get(out, "bias")?;
    let each = out / N;
    let split = |i: usize| -> Result<Linear> {
        Ok(Linear::new(
            w.narrow(0, i * each, each)?.contiguous()?,
            Some(b.narrow(0, i * each, each)?.contiguous()?),
        ))
    };
    let mut parts = Vec::with_capacity(N);
    for i in 0..N {
        parts.push(split(i)?);
    }
    parts.try_into().map_err(|_: Vec<Linear>| {
        candle_core::Error::Msg(format!("{}: cannot split into {N} parts", vb.prefix())).into()
    })
}

fn conv1d(vb: VarBuilder, inp: usize, out: usize) -> Result<Linear> {
    let [l] = conv1d_split::<1>(vb, inp, out)?;
    Ok(l)
}

/// GPT-2 under `decoder.` onto vl's decoder; `lm_head` is `wte` unless the
/// decoder is untied (then `decoder.lm_head.weight` is read).
pub fn load(
    vb: VarBuilder,
    cfg: &DecoderConfig,
    block_built: &mut crate::checkpoint::BlockHook,
) -> Result<VisionLanguageDecoder> {
    let dec = vb.pp("decoder");
    let t = dec.pp("transformer");
    let h = cfg.hidden_size;
    let eps = cfg.layer_norm_eps;
    let wte = t.pp("wte").get((cfg.vocab_size, h), "weight")?;
    let wpe = t
        .pp("wpe")
        .get((cfg.max_position_embeddings, h), "weight")?;
    let self_cfg = SelfAttentionConfig::new(h, cfg.num_attention_heads);
    let cross_cfg = CrossAttentionConfig::new(h, h, cfg.num_attention_heads);
    let blocks = (0..cfg.num_hidden_layers)
        .map(|i| {
            let b = t.pp("h").pp(i);
            let [q, k, v] = conv1d_split::<3>(b.pp("attn").pp("c_attn"), h, 3 * h)?;
            let self_attn = CausalSelfAttention::from_parts(
                q,
                k,
                v,
                conv1d(b.pp("attn").pp("c_proj"), h, h)?,
                &self_cfg,
            )?;
            let x = b.pp("crossattention");
            let [k, v] = conv1d_split::<2>(x.pp("c_attn"), h, 2 * h)?;
            let cross = CrossBranch {
                ffn: None,
                cross_attn_norm: layer_norm(b.pp("ln_cross_attn"), h, eps)?,
                cross_attn: CrossAttention::from_parts(
                    conv1d(x.pp("q_attn"), h, h)?,
                    k,
                    v,
                    conv1d(x.pp("c_proj"), h, h)?,
                    &cross_cfg,
                )?,
                gate: None,
            };
            let mlp = b.pp("mlp");
            let block = DecoderBlock::from_parts(
                layer_norm(b.pp("ln_1"), h, eps)?,
                self_attn,
                Some(cross),
                layer_norm(b.pp("ln_2"), h, eps)?,
                FeedForward::from_parts(
                    conv1d(mlp.pp("c_fc"), h, cfg.intermediate_size)?,
                    conv1d(mlp.pp("c_proj"), cfg.intermediate_size, h)?,
                    cfg.hidden_act,
                ),
            );
            block_built(i, block)
        })
        .collect::<Result<Vec<_>>>()?;
    let final_norm = layer_norm(t.pp("ln_f"), h, eps)?;
    let lm_head = if cfg.tie_word_embeddings {
        Linear::new(wte.clone(), None)
    } else {
        Linear::new(dec.pp("lm_head").get((cfg.vocab_size, h), "weight")?, None)
    };
    Ok(VisionLanguageDecoder::from_parts(
        DecoderParts {
            embed_tokens: Embedding::new(wte, h),
            embed_positions: Some(Embedding::new(wpe, h)),
            embedding_norm: None,
            blocks,
            final_norm: Some(final_norm),
            output_transform: None,
            lm_head,
        },
        cfg,
    )?)
}
