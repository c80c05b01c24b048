//! The ViT encoder family (`encoder.model_type` `vit`, and `deit`): its
//! config and its tensors mapped onto vl's [`Vit`] through `from_parts` —
//! one implementation, whatever the checkpoint. The pooler, if saved, is
//! not read.
//!
//! DeiT is ViT with a distillation token: `embeddings.distillation_token`
//! follows the CLS token, the positions cover both, and both lead the
//! encoder's output, the memory the decoder reads. Its config has ViT's
//! keys; the rest (`encoder_stride`, the pooler's) is not read.

use candle_nn::{Linear, VarBuilder};
use serde::Deserialize;
use vl_attn::{FeedForward, SelfAttention, SelfAttentionConfig};
use vl_decoder::Activation;
use vl_vision::{Vit, VitBlock, VitConfig};

use super::tensors::{layer_norm, linear};
use crate::error::Result;

fn vit_eps() -> f64 {
    1e-12
}
fn default_true() -> bool {
    true
}
fn gelu() -> Activation {
    Activation::Gelu
}
fn size_224() -> usize {
    224
}
fn patch_16() -> usize {
    16
}
fn channels_3() -> usize {
    3
}

/// The encoder `model_type`s read by this family.
pub const ENCODERS: &[&str] = &["vit", "deit"];

/// `config.json`'s `encoder`: a transformers `ViTConfig` or `DeiTConfig`.
#[derive(Debug, Clone, Deserialize)]
pub struct HfVitConfig {
    /// One of [`ENCODERS`].
    pub model_type: String,
    /// Token width.
    pub hidden_size: usize,
    /// Encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// Feed-forward width.
    pub intermediate_size: usize,
    /// Feed-forward activation (default `gelu`).
    #[serde(default = "gelu")]
    pub hidden_act: Activation,
    /// Layer-norm epsilon (default 1e-12).
    #[serde(default = "vit_eps")]
    pub layer_norm_eps: f64,
    /// Input size (default 224).
    #[serde(default = "size_224")]
    pub image_size: usize,
    /// Patch size (default 16).
    #[serde(default = "patch_16")]
    pub patch_size: usize,
    /// Input channels (default 3).
    #[serde(default = "channels_3")]
    pub num_channels: usize,
    /// Whether query, key and value have biases (default true).
    #[serde(default = "default_true")]
    pub qkv_bias: bool,
    /// Dropout on the attention probabilities, in training (default 0, as
    /// transformers).
    #[serde(default)]
    pub attention_probs_dropout_prob: f64,
    /// Dropout on the embeddings and residual branches, in training
    /// (default 0, as transformers).
    #[serde(default)]
    pub hidden_dropout_prob: f64,
}

impl HfVitConfig {
    /// Whether the encoder has DeiT's distillation token.
    pub fn has_distillation_token(&self) -> bool {
        self.model_type == "deit"
    }
}

/// The ViT (or DeiT) under `encoder.` (and `enc_to_dec_proj.` when the widths
/// differ). The pooler, if saved, is not read.
pub fn load(vb: VarBuilder, e: &HfVitConfig, vit_cfg: &VitConfig) -> Result<Vit> {
    let d = e.hidden_size;
    let enc = vb.pp("encoder");
    let emb = enc.pp("embeddings");
    let (c, p) = (e.num_channels, e.patch_size);
    // Conv2d (hidden, channels, patch, patch) with stride = kernel = patch
    // is a linear layer over patches flattened channel-major.
    let conv = emb.pp("patch_embeddings").pp("projection");
    let patch_embed = Linear::new(
        conv.get((d, c, p, p), "weight")?.reshape((d, c * p * p))?,
        Some(conv.get(d, "bias")?),
    );
    let cls = emb.get((1, 1, d), "cls_token")?;
    // (1, 1, d) CLS then (1, 1, d) distillation -> (1, 2, d)
    let cls = if e.has_distillation_token() {
        candle_core::Tensor::cat(&[&cls, &emb.get((1, 1, d), "distillation_token")?], 1)?
    } else {
        cls
    };
    let prefix = vit_cfg.num_prefix_tokens();
    let positions = emb.get(
        (1, prefix + vit_cfg.num_patches(), d),
        "position_embeddings",
    )?;
    let attn_cfg = SelfAttentionConfig {
        bias: e.qkv_bias,
        ..SelfAttentionConfig::new(d, e.num_attention_heads)
    };
    let blocks = (0..e.num_hidden_layers)
        .map(|i| {
            let l = enc.pp("encoder").pp("layer").pp(i);
            let a = l.pp("attention");
            let qkv = a.pp("attention");
            let attn = SelfAttention::from_parts(
                linear(qkv.pp("query"), d, d, e.qkv_bias)?,
                linear(qkv.pp("key"), d, d, e.qkv_bias)?,
                linear(qkv.pp("value"), d, d, e.qkv_bias)?,
                linear(a.pp("output").pp("dense"), d, d, true)?,
                &attn_cfg,
            )?;
            Ok(VitBlock::from_parts(
                layer_norm(l.pp("layernorm_before"), d, e.layer_norm_eps)?,
                attn,
                layer_norm(l.pp("layernorm_after"), d, e.layer_norm_eps)?,
                FeedForward::from_parts(
                    linear(
                        l.pp("intermediate").pp("dense"),
                        d,
                        e.intermediate_size,
                        true,
                    )?,
                    linear(l.pp("output").pp("dense"), e.intermediate_size, d, true)?,
                    e.hidden_act,
                ),
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let final_norm = layer_norm(enc.pp("layernorm"), d, e.layer_norm_eps)?;
    let output_proj = match vit_cfg.output_size {
        Some(out) => Some(linear(vb.pp("enc_to_dec_proj"), d, out, true)?),
        None => None,
    };
    Ok(Vit::from_parts(
        patch_embed,
        cls,
        positions,
        blocks,
        final_norm,
        output_proj,
        vit_cfg,
    )?)
}
