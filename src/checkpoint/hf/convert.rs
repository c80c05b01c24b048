//! transformers' tensors mapped onto vl's own modules, through their
//! `from_parts` constructors: the ViT onto [`Vit`], GPT-2 onto
//! [`DecoderBlock`]s — one implementation of each, whatever the checkpoint.
//!
//! GPT-2 stores its projections as `Conv1D`, whose weight is `(in, out)`:
//! each is transposed to a `Linear`'s `(out, in)`. Its fused `c_attn`
//! `(hidden, 3 * hidden)` splits into query | key | value; the
//! cross-attention's `q_attn` is the query and its `c_attn`
//! `(hidden, 2 * hidden)` splits into key | value. The buffers `attn.bias`
//! and `attn.masked_bias` of older checkpoints are never read.

use candle_nn::{Embedding, Linear, VarBuilder};
use vl_attn::{
    CausalSelfAttention, CrossAttention, CrossAttentionConfig, SelfAttention, SelfAttentionConfig,
};

use vl_decoder::block::{CrossBranch, DecoderBlock};
use vl_decoder::{DecoderConfig, VisionLanguageDecoder};
use vl_vision::{Vit, VitBlock, VitConfig};

use crate::error::Result;
use vl_attn::FeedForward;
use vl_attn::LayerNorm;

use super::config::HfConfig;

/// A `torch.nn.Linear` `weight (out, in)`, `bias (out)`.
fn linear(vb: VarBuilder, inp: usize, out: usize, bias: bool) -> Result<Linear> {
    let w = vb.get((out, inp), "weight")?;
    let b = if bias {
        Some(vb.get(out, "bias")?)
    } else {
        None
    };
    Ok(Linear::new(w, b))
}

/// A GPT-2 `Conv1D(out, in)`: `weight (in, out)`, `bias (out)`, split
/// along `out` into `parts` equal linear layers.
fn conv1d_split<const N: usize>(vb: VarBuilder, inp: usize, out: usize) -> Result<[Linear; N]> {
    // (in, out) -> (out, in), the layout of a Linear.
    let w = vb.get((inp, out), "weight")?.t()?.contiguous()?;
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

fn layer_norm(vb: VarBuilder, width: usize, eps: f64) -> Result<LayerNorm> {
    Ok(LayerNorm::load(width, eps, vb)?)
}

/// The ViT under `encoder.` (and `enc_to_dec_proj.` when the widths
/// differ). The pooler, if saved, is not read.
pub fn vit(vb: VarBuilder, cfg: &HfConfig, vit_cfg: &VitConfig) -> Result<Vit> {
    let e = &cfg.encoder;
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
    let positions = emb.get((1, 1 + vit_cfg.num_patches(), d), "position_embeddings")?;
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

/// GPT-2 under `decoder.` onto vl's decoder; `lm_head` is `wte` unless the
/// decoder is untied (then `decoder.lm_head.weight` is read).
pub fn gpt2(vb: VarBuilder, cfg: &DecoderConfig) -> Result<VisionLanguageDecoder> {
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
            Ok(DecoderBlock::from_parts(
                layer_norm(b.pp("ln_1"), h, eps)?,
                self_attn,
                Some(cross),
                layer_norm(b.pp("ln_2"), h, eps)?,
                FeedForward::from_parts(
                    conv1d(mlp.pp("c_fc"), h, cfg.intermediate_size)?,
                    conv1d(mlp.pp("c_proj"), cfg.intermediate_size, h)?,
                    cfg.hidden_act,
                ),
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let final_norm = layer_norm(t.pp("ln_f"), h, eps)?;
    let lm_head = if cfg.tie_word_embeddings {
        Linear::new(wte.clone(), None)
    } else {
        Linear::new(dec.pp("lm_head").get((cfg.vocab_size, h), "weight")?, None)
    };
    Ok(VisionLanguageDecoder::from_parts(
        Embedding::new(wte, h),
        Embedding::new(wpe, h),
        blocks,
        final_norm,
        lm_head,
        cfg,
    )?)
}
