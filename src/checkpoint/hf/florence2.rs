//! Florence-2 (`model_type` `florence2`): DaViT and its projector
//! ([`vl_vision::Florence2Vision`]), BART's encoder over the image tokens
//! and the task prompt ([`vl_decoder::TextEncoder`]), BART's decoder on
//! vl's [`VisionLanguageDecoder`] (its cross-attention reads the encoder's
//! output), and the tasks' post-processing settings ([`crate::tasks`]).
//!
//! Two layouts, told apart by the sub-configs' `model_type`s:
//!
//! - transformers' (`florence_vision` + `bart`, the
//!   `florence-community/Florence-2-*` checkpoints,
//!   `Florence2ForConditionalGeneration`): tensors under
//!   `model.vision_tower.`, `model.multi_modal_projector.`,
//!   `model.language_model.{shared,encoder,decoder}.`, `lm_head.` (untied
//!   only); the vocabulary holds `<image>` and is padded (51,328 rows for
//!   51,290 tokens);
//! - microsoft's original remote-code one (`davit` +
//!   `florence2_language`): `vision_tower.` with its own names inside
//!   (`convs.i.proj`, `conv1.fn.dw`, `window_attn.fn.qkv`, `ffn.fn.net.fc1`,
//!   the norms inside their branches), `image_projection` stored
//!   transposed, `image_pos_embed.`, `language_model.model.`; the tokenizer
//!   is BART's, and the processor adds Florence-2's 1,024 tokens
//!   (`<od>` … `<and>`) after it, as vl does here. Both give the same ids.
//!
//! The image tokens are placed before `<s>` prompt `</s>` as the
//! processor's `<image>` placeholders put them; vl concatenates them
//! instead of scattering them into placeholder embeddings, which is the
//! same encoder input. Generation defaults come from
//! `generation_config.json` (microsoft's layout: `text_config`), forced
//! first and last tokens included; preprocessing from
//! `preprocessor_config.json` (or `processor_config.json`'s
//! `image_processor`); the tasks' settings from `processor_config.json`'s
//! `post_processor_config`.

use std::collections::BTreeMap;
use std::path::Path;

use candle_nn::{Linear, VarBuilder};
use serde::Deserialize;
use serde_json::Value;
use tokenizers::{AddedToken, Tokenizer};
use vl_attn::{Activation, FeedForward, Resampler, SelfAttention, SelfAttentionConfig};
use vl_decoder::{
    DecoderConfig, EncoderLayer, NormPlacement, PositionEmbedding, TextEncoder, TextEncoderConfig,
    TextEncoderParts, VisionLanguageDecoder,
};
use vl_vision::{DavitConfig, Florence2Projector, Florence2Vision, VisionConfig, VisionEncoder};

use super::config::{HfGeneration, HfPreprocessorConfig};
use super::tensors::{layer_norm, linear};
use super::trocr::{bart_attention, bart_decoder};
use super::PREPROCESSOR_FILE;
use crate::checkpoint::tokenizer::{check_tokenizer, load_tokenizer};
use crate::checkpoint::{
    from_value, read_json, BlockHook, Family, ModelFormat, Plan, Source, VlConfig, CONFIG_FILE,
    TOKENIZER_FILE,
};
use crate::error::{check_dropouts, config_err, in_file, Error, Result};
use crate::tasks::TaskConfig;

/// The `model_type` of a Florence-2 checkpoint (both layouts).
pub const MODEL_TYPE: &str = "florence2";
/// The processor's settings file (post-processing, and the image
/// processor in newer checkpoints).
pub const PROCESSOR_FILE: &str = "processor_config.json";
/// BART's LayerNorms: `torch.nn.LayerNorm`'s default epsilon.
pub const BART_LAYER_NORM_EPS: f64 = 1e-5;
/// The row of position 0 in BART's learned position tables.
pub const BART_POSITION_OFFSET: usize = 2;
/// The tokens microsoft's processor adds after BART's vocabulary, in
/// order: `<od>`, `</od>`, `<ocr>`, `</ocr>`, the 1,000 `<loc_N>`, then
/// these.
const FLORENCE_TOKENS_AFTER_LOC: [&str; 20] = [
    "<cap>",
    "</cap>",
    "<ncap>",
    "</ncap>",
    "<dcap>",
    "</dcap>",
    "<grounding>",
    "</grounding>",
    "<seg>",
    "</seg>",
    "<sep>",
    "<region_cap>",
    "</region_cap>",
    "<region_to_desciption>",
    "</region_to_desciption>",
    "<proposal>",
    "</proposal>",
    "<poly>",
    "</poly>",
    "<and>",
];

fn default_true() -> bool {
    true
}
fn gelu() -> Activation {
    Activation::Gelu
}
fn default_mlp_ratio() -> f64 {
    4.0
}
fn default_positions() -> usize {
    50
}
fn default_temporal() -> usize {
    100
}
fn default_three() -> usize {
    3
}

/// `text_config`: a transformers `BartConfig` (or microsoft's
/// `Florence2LanguageConfig`, the same keys), with its defaults where
/// Florence-2 relies on them.
#[derive(Debug, Clone, Deserialize)]
pub struct HfBartConfig {
    /// Tokens in the vocabulary (the embedding rows).
    pub vocab_size: usize,
    /// Width.
    pub d_model: usize,
    /// Encoder layers.
    pub encoder_layers: usize,
    /// Decoder layers.
    pub decoder_layers: usize,
    /// Encoder heads.
    pub encoder_attention_heads: usize,
    /// Decoder heads.
    pub decoder_attention_heads: usize,
    /// Encoder feed-forward width.
    pub encoder_ffn_dim: usize,
    /// Decoder feed-forward width.
    pub decoder_ffn_dim: usize,
    /// Feed-forward activation (default `gelu`).
    #[serde(default = "gelu")]
    pub activation_function: Activation,
    /// Positions of each side.
    pub max_position_embeddings: usize,
    /// Token embeddings times `sqrt(d_model)` (default false).
    #[serde(default)]
    pub scale_embedding: bool,
    /// Pre-LN layers (mBART); BART's are post-LN (default false).
    #[serde(default)]
    pub normalize_before: bool,
    /// A norm after the last layer (mBART; default false).
    #[serde(default)]
    pub add_final_layer_norm: bool,
    /// Dropout, in training only.
    #[serde(default)]
    pub dropout: f64,
    /// Attention dropout, in training only.
    #[serde(default)]
    pub attention_dropout: f64,
    /// Every other key (special tokens, generation settings of microsoft's
    /// layout, training settings).
    #[serde(flatten)]
    pub rest: BTreeMap<String, Value>,
}

/// `vision_config` of transformers' layout (`florence_vision`).
#[derive(Debug, Clone, Deserialize)]
struct NativeVision {
    model_type: String,
    #[serde(default = "default_three")]
    in_channels: usize,
    depths: Vec<usize>,
    patch_size: Vec<usize>,
    patch_stride: Vec<usize>,
    patch_padding: Vec<usize>,
    patch_prenorm: Vec<bool>,
    embed_dim: Vec<usize>,
    num_heads: Vec<usize>,
    num_groups: Vec<usize>,
    window_size: usize,
    #[serde(default = "default_mlp_ratio")]
    mlp_ratio: f64,
    #[serde(default = "default_true")]
    qkv_bias: bool,
    #[serde(default = "gelu")]
    activation_function: Activation,
    projection_dim: usize,
    #[serde(default = "default_positions")]
    max_position_embeddings: usize,
    #[serde(default = "default_temporal")]
    max_temporal_embeddings: usize,
}

#[derive(Debug, Clone, Deserialize)]
struct TypedSize {
    #[serde(rename = "type")]
    kind: String,
    #[serde(alias = "max_pos_embeddings", alias = "max_temporal_embeddings")]
    max: usize,
}

/// `vision_config` of microsoft's layout (`davit`).
#[derive(Debug, Clone, Deserialize)]
struct OriginalVision {
    model_type: String,
    depths: Vec<usize>,
    patch_size: Vec<usize>,
    patch_stride: Vec<usize>,
    patch_padding: Vec<usize>,
    patch_prenorm: Vec<bool>,
    dim_embed: Vec<usize>,
    num_heads: Vec<usize>,
    num_groups: Vec<usize>,
    window_size: usize,
    #[serde(default)]
    projection_dim: Option<usize>,
    visual_temporal_embedding: TypedSize,
    image_pos_embed: TypedSize,
    #[serde(default)]
    image_feature_source: Vec<String>,
}

/// Which layout the directory holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// transformers' (`florence_vision` + `bart`).
    Transformers,
    /// microsoft's original remote-code one (`davit` + `florence2_language`).
    Original,
}

/// A Florence-2 checkpoint's config, in vl's terms.
#[derive(Debug, Clone)]
pub struct HfFlorence2 {
    /// The layout.
    pub layout: Layout,
    /// The language model's config.
    pub text: HfBartConfig,
    /// Whether the LM head is the shared token table.
    pub tie_word_embeddings: bool,
}

fn sub_type<'v>(config: &'v Value, key: &str) -> Option<&'v str> {
    config.get(key)?.get("model_type")?.as_str()
}

impl HfFlorence2 {
    /// The layout `config.json` declares by its sub-configs' types.
    fn layout(config: &Value, path: &Path) -> Result<Layout> {
        match (
            sub_type(config, "vision_config"),
            sub_type(config, "text_config"),
        ) {
            (Some("florence_vision") | None, Some("bart") | None)
                if config.get("vision_config").is_some() && config.get("text_config").is_some() =>
            {
                Ok(Layout::Transformers)
            }
            (Some("davit"), Some("florence2_language")) => Ok(Layout::Original),
            (v, t) => Err(Error::UnsupportedModel {
                path: path.to_path_buf(),
                what: "vision_config.model_type / text_config.model_type",
                model_type: format!("{} / {}", v.unwrap_or("(none)"), t.unwrap_or("(none)")),
                supported: vec![
                    "`florence_vision` / `bart` (transformers)",
                    "`davit` / `florence2_language` (microsoft's original)",
                ],
            }),
        }
    }

    /// DaViT's config, its pixels from `pixels`.
    fn davit(config: &Value, layout: Layout, pixels: &vl_vision::PixelSpec) -> Result<DavitConfig> {
        let v = config.get("vision_config").cloned().unwrap_or(Value::Null);
        let mut cfg = match layout {
            Layout::Transformers => {
                let n: NativeVision =
                    serde_path_to_error::deserialize(v).map_err(|e| Error::Config {
                        field: "vision_config",
                        reason: format!("{}: {}", e.path(), e.inner()),
                    })?;
                if n.model_type != "florence_vision" {
                    return config_err(
                        "vision_config.model_type",
                        format!("expected \"florence_vision\", got {:?}", n.model_type),
                    );
                }
                DavitConfig {
                    image_size: 0,
                    in_channels: n.in_channels,
                    depths: n.depths,
                    patch_size: n.patch_size,
                    patch_stride: n.patch_stride,
                    patch_padding: n.patch_padding,
                    patch_prenorm: n.patch_prenorm,
                    embed_dim: n.embed_dim,
                    num_heads: n.num_heads,
                    num_groups: n.num_groups,
                    window_size: n.window_size,
                    mlp_ratio: n.mlp_ratio,
                    qkv_bias: n.qkv_bias,
                    activation_function: n.activation_function,
                    projection_dim: n.projection_dim,
                    max_position_embeddings: n.max_position_embeddings,
                    max_temporal_embeddings: n.max_temporal_embeddings,
                    image_mean: pixels.mean,
                    image_std: pixels.std,
                    rescale_factor: pixels.rescale_factor,
                    resample: pixels.resample,
                    do_resize: pixels.resize,
                }
            }
            Layout::Original => {
                let o: OriginalVision =
                    serde_path_to_error::deserialize(v).map_err(|e| Error::Config {
                        field: "vision_config",
                        reason: format!("{}: {}", e.path(), e.inner()),
                    })?;
                if o.image_pos_embed.kind != "learned_abs_2d" {
                    return config_err(
                        "vision_config.image_pos_embed.type",
                        format!(
                            "only learned_abs_2d is supported, got {:?}",
                            o.image_pos_embed.kind
                        ),
                    );
                }
                if o.visual_temporal_embedding.kind != "COSINE" {
                    return config_err(
                        "vision_config.visual_temporal_embedding.type",
                        format!(
                            "only COSINE is supported, got {:?}",
                            o.visual_temporal_embedding.kind
                        ),
                    );
                }
                if !o.image_feature_source.is_empty()
                    && o.image_feature_source != ["spatial_avg_pool", "temporal_avg_pool"]
                {
                    return config_err(
                        "vision_config.image_feature_source",
                        format!(
                            "only [\"spatial_avg_pool\", \"temporal_avg_pool\"] is supported, got {:?}",
                            o.image_feature_source
                        ),
                    );
                }
                let projection_dim = match o.projection_dim.or_else(|| {
                    config
                        .get("projection_dim")
                        .and_then(Value::as_u64)
                        .map(|p| p as usize)
                }) {
                    Some(p) => p,
                    None => return config_err("projection_dim", "missing"),
                };
                let _ = &o.model_type;
                DavitConfig {
                    image_size: 0,
                    in_channels: 3,
                    depths: o.depths,
                    patch_size: o.patch_size,
                    patch_stride: o.patch_stride,
                    patch_padding: o.patch_padding,
                    patch_prenorm: o.patch_prenorm,
                    embed_dim: o.dim_embed,
                    num_heads: o.num_heads,
                    num_groups: o.num_groups,
                    window_size: o.window_size,
                    mlp_ratio: 4.0,
                    qkv_bias: true,
                    activation_function: Activation::Gelu,
                    projection_dim,
                    max_position_embeddings: o.image_pos_embed.max,
                    max_temporal_embeddings: o.visual_temporal_embedding.max,
                    image_mean: pixels.mean,
                    image_std: pixels.std,
                    rescale_factor: pixels.rescale_factor,
                    resample: pixels.resample,
                    do_resize: pixels.resize,
                }
            }
        };
        cfg.image_size = pixels.width;
        if layout == Layout::Original && cfg.patch_prenorm.first() == Some(&true) {
            // microsoft's DaViT skips the pre-norm of the first stage;
            // transformers' applies it: the layouts would disagree.
            return config_err(
                "vision_config.patch_prenorm",
                "a pre-norm before the first stage: microsoft's DaViT skips it where transformers' applies it",
            );
        }
        cfg.validate()?;
        Ok(cfg)
    }

    fn text_encoder_config(&self) -> TextEncoderConfig {
        let t = &self.text;
        TextEncoderConfig {
            vocab_size: t.vocab_size,
            hidden_size: t.d_model,
            num_attention_heads: t.encoder_attention_heads,
            num_hidden_layers: t.encoder_layers,
            intermediate_size: t.encoder_ffn_dim,
            max_position_embeddings: t.max_position_embeddings,
            position_offset: BART_POSITION_OFFSET,
            hidden_act: t.activation_function,
            layer_norm_eps: BART_LAYER_NORM_EPS,
            scale_embedding: t.scale_embedding,
            layernorm_embedding: true,
            norm_placement: NormPlacement::Post,
            final_norm: false,
            shares_decoder_embeddings: true,
        }
    }

    fn decoder_config(&self, generation: &vl_decoder::GenerationConfig) -> DecoderConfig {
        let t = &self.text;
        DecoderConfig {
            vocab_size: t.vocab_size,
            hidden_size: t.d_model,
            num_attention_heads: t.decoder_attention_heads,
            num_key_value_heads: None,
            num_hidden_layers: t.decoder_layers,
            intermediate_size: t.decoder_ffn_dim,
            max_position_embeddings: t.max_position_embeddings,
            memory_dim: t.d_model,
            hidden_act: t.activation_function,
            layer_norm_eps: BART_LAYER_NORM_EPS,
            tie_word_embeddings: self.tie_word_embeddings,
            cross_attention_every: 1,
            gated_cross_attention: false,
            gated_cross_ffn: false,
            attention_bias: true,
            attention_dropout: t.attention_dropout,
            residual_dropout: t.dropout,
            embedding_dropout: t.dropout,
            norm_placement: NormPlacement::Post,
            final_norm: false,
            scale_embedding: t.scale_embedding,
            layernorm_embedding: true,
            output_transform: false,
            lm_head_bias: false,
            position_embedding: PositionEmbedding::Learned,
            position_offset: BART_POSITION_OFFSET,
            position_padding_idx: None,
            bos_token_id: generation.start_token_id,
            eos_token_id: generation
                .eos_token_ids
                .first()
                .copied()
                .unwrap_or(generation.start_token_id),
            pad_token_id: generation.pad_token_id,
        }
    }

    /// The builder reading transformers' names from this checkpoint.
    fn builder<'a>(&self, vb: &VarBuilder<'a>) -> VarBuilder<'a> {
        let vb = vb.clone();
        match self.layout {
            Layout::Transformers => vb,
            Layout::Original => vb.rename_f(original_name),
        }
    }

    fn shared(&self, vb: &VarBuilder) -> Result<candle_core::Tensor> {
        let lm = vb.pp("model").pp("language_model");
        let shape = (self.text.vocab_size, self.text.d_model);
        for name in ["shared", "encoder.embed_tokens", "decoder.embed_tokens"] {
            if lm.contains_tensor(&format!("{name}.weight")) {
                return Ok(lm.pp(name).get(shape, "weight")?);
            }
        }
        Ok(lm.pp("shared").get(shape, "weight")?)
    }
}

/// A transformers tensor name → microsoft's.
fn original_name(native: &str) -> String {
    if let Some(rest) = native.strip_prefix("model.language_model.") {
        return format!("language_model.model.{rest}");
    }
    if native == "lm_head.weight" {
        return "language_model.lm_head.weight".into();
    }
    if let Some(rest) = native.strip_prefix("model.multi_modal_projector.") {
        return rest.replacen("image_position_embed.", "image_pos_embed.", 1);
    }
    let Some(rest) = native.strip_prefix("model.vision_tower.") else {
        return native.to_string();
    };
    let mut parts: Vec<&str> = rest.split('.').collect();
    match parts.as_slice() {
        ["convs", _, "conv", _] => parts[2] = "proj",
        ["blocks", _, _, half, layer, ..] => {
            let attn = if *half == "spatial_block" {
                "window_attn"
            } else {
                "channel_attn"
            };
            let tail = parts[5..].join(".");
            let head = parts[..4].join(".");
            let mapped = match *layer {
                "conv1" | "conv2" => format!("{layer}.fn.dw.{tail}"),
                "norm1" => format!("{attn}.norm.{tail}"),
                "norm2" => format!("ffn.norm.{tail}"),
                "window_attn" | "channel_attn" => format!("{layer}.fn.{tail}"),
                "ffn" => format!("ffn.fn.net.{tail}"),
                other => format!("{other}.{tail}"),
            };
            return format!("vision_tower.{head}.{mapped}");
        }
        _ => {}
    }
    format!("vision_tower.{}", parts.join("."))
}

/// The image processor's settings: `preprocessor_config.json`, or
/// `processor_config.json`'s `image_processor` (newer saves).
fn preprocessor(
    dir: &Path,
    processor: Option<&Value>,
) -> Result<(HfPreprocessorConfig, Value, std::path::PathBuf)> {
    let pre_path = dir.join(PREPROCESSOR_FILE);
    let raw: Value = if pre_path.is_file() {
        read_json(&pre_path)?
    } else if let Some(p) = processor.and_then(|p| p.get("image_processor")) {
        p.clone()
    } else {
        return Err(Error::Io {
            path: pre_path,
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no such file, and processor_config.json has no image_processor: the input size is unknown",
            ),
        });
    };
    let path = if pre_path.is_file() {
        pre_path
    } else {
        dir.join(PROCESSOR_FILE)
    };
    let pre: HfPreprocessorConfig = from_value(&raw, &path)?;
    if raw.get("do_center_crop").and_then(Value::as_bool) == Some(true) {
        return Err(Error::Config {
            field: "do_center_crop",
            reason: format!(
                "{}: center cropping is not supported (Florence-2's processor resizes only)",
                path.display()
            ),
        });
    }
    Ok((pre, raw, path))
}

fn image_side(pre: &HfPreprocessorConfig, path: &Path) -> Result<usize> {
    use super::config::HfSize;
    match &pre.size {
        Some(HfSize::Side(s)) => Ok(*s),
        Some(HfSize::HeightWidth { height, width }) if height == width => Ok(*height),
        other => Err(Error::Config {
            field: "size",
            reason: format!(
                "{}: Florence-2 takes a square input ({{\"height\": N, \"width\": N}}), got {other:?}",
                path.display()
            ),
        }),
    }
}

/// microsoft's tokenizer is BART's; its processor adds Florence-2's tokens
/// after it, in order.
fn with_florence_tokens(mut tok: Tokenizer, path: &Path) -> Result<Tokenizer> {
    let mut tokens: Vec<String> = ["<od>", "</od>", "<ocr>", "</ocr>"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    tokens.extend((0..1000).map(|i| format!("<loc_{i}>")));
    tokens.extend(FLORENCE_TOKENS_AFTER_LOC.iter().map(|s| s.to_string()));
    let missing: Vec<AddedToken> = tokens
        .iter()
        .filter(|t| tok.token_to_id(t).is_none())
        .map(|t| AddedToken::from(t.clone(), true))
        .collect();
    if !missing.is_empty() && missing.len() != tokens.len() {
        return Err(Error::Tokenizer {
            path: path.to_path_buf(),
            reason: format!(
                "has {} of Florence-2's {} added tokens; expected all or none",
                tokens.len() - missing.len(),
                tokens.len()
            ),
        });
    }
    tok.add_special_tokens(missing)
        .map_err(|e| Error::Tokenizer {
            path: path.to_path_buf(),
            reason: format!("cannot add Florence-2's tokens: {e}"),
        })?;
    Ok(tok)
}

impl Family for HfFlorence2 {
    const FORMAT: ModelFormat = ModelFormat::Florence2;

    fn plan(source: &Source, config: &Value) -> Result<Plan<Self>> {
        let dir = source.dir(Self::FORMAT)?;
        let config_path = dir.join(CONFIG_FILE);
        let layout = Self::layout(config, &config_path)?;
        let text: HfBartConfig = from_value(
            config.get("text_config").unwrap_or(&Value::Null),
            &config_path,
        )?;
        check_dropouts(&[
            ("text_config.dropout", text.dropout),
            ("text_config.attention_dropout", text.attention_dropout),
        ])
        .map_err(in_file(&config_path))?;
        if text.normalize_before || text.add_final_layer_norm {
            return Err(Error::Config {
                field: "text_config.normalize_before",
                reason: format!(
                    "{}: pre-LN language models (normalize_before, add_final_layer_norm) are not Florence-2's BART",
                    config_path.display()
                ),
            });
        }
        let tie_word_embeddings = match layout {
            Layout::Transformers => config
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(true),
            // microsoft's stores no head: it is the shared table.
            Layout::Original => true,
        };
        let family = Self {
            layout,
            text,
            tie_word_embeddings,
        };

        let processor_path = dir.join(PROCESSOR_FILE);
        let processor: Option<Value> = if processor_path.is_file() {
            Some(read_json(&processor_path)?)
        } else {
            None
        };
        let (pre, raw_pre, pre_path) = preprocessor(dir, processor.as_ref())?;
        let side = image_side(&pre, &pre_path)?;
        let pixels = pre.pixel_spec(side).map_err(in_file(&pre_path))?;
        let davit = Self::davit(config, layout, &pixels).map_err(in_file(&config_path))?;
        if let Some(n) = raw_pre.get("image_seq_length").and_then(Value::as_u64) {
            if n as usize != davit.num_tokens() {
                return Err(Error::Config {
                    field: "image_seq_length",
                    reason: format!(
                        "{}: {n} image tokens, but DaViT makes {} from a {side}×{side} image",
                        pre_path.display(),
                        davit.num_tokens()
                    ),
                });
            }
        }
        let tasks = match processor
            .as_ref()
            .and_then(|p| p.get("post_processor_config"))
        {
            Some(p) => TaskConfig::from_post_processor(p).map_err(in_file(&processor_path))?,
            None => TaskConfig::default(),
        };

        // Generation: generation_config.json, else the text config's keys
        // (microsoft's layout keeps beams and bans there).
        let (generation, generation_source) = super::read_generation(dir, &config_path, || {
            let values: BTreeMap<String, Value> = family
                .text
                .rest
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            HfGeneration::from_values(values)
        })?;
        let mut gen_cfg = generation
            .to_generation_config()
            .map_err(in_file(&generation_source))?;
        generation.cap_default_length(&mut gen_cfg, family.text.max_position_embeddings);
        let dec_cfg = family.decoder_config(&gen_cfg);
        dec_cfg.validate().map_err(in_file(&config_path))?;
        gen_cfg
            .check_ids(dec_cfg.vocab_size)
            .map_err(in_file(&generation_source))?;
        let te_cfg = family.text_encoder_config();

        // The tokenizer: all of its tokens must be rows of the table (the
        // table may have more: padding rows).
        let tok_path = dir.join(TOKENIZER_FILE);
        let tokenizer = load_tokenizer(&tok_path, 0)?;
        let tokenizer = match layout {
            Layout::Transformers => tokenizer,
            Layout::Original => with_florence_tokens(tokenizer, &tok_path)?,
        };
        let n = tokenizer.get_vocab_size(true);
        if n > dec_cfg.vocab_size {
            return Err(Error::Tokenizer {
                path: tok_path,
                reason: format!(
                    "has {n} tokens, more than the model's vocab_size {}",
                    dec_cfg.vocab_size
                ),
            });
        }
        let tokenizer = check_tokenizer(tokenizer, &tok_path, n)?;
        for t in ["<s>", "</s>", "<loc_0>", "<loc_999>"] {
            if tokenizer.token_to_id(t).is_none() {
                return Err(Error::Tokenizer {
                    path: tok_path,
                    reason: format!("has no {t} token: not a Florence-2 tokenizer"),
                });
            }
        }

        let config = VlConfig {
            model_type: super::super::native::MODEL_TYPE.into(),
            decoder: dec_cfg,
            vision: Some(VisionConfig::Davit(davit)),
            resampler: None,
            quantization: vl_attn::Quantization::None,
            generation: None,
            text_encoder: Some(te_cfg),
            tasks: Some(tasks),
            reader: None,
        };
        config.validate().map_err(in_file(&config_path))?;
        Ok(Plan {
            family,
            config,
            generation: gen_cfg,
            tokenizer,
        })
    }

    fn vision(
        &self,
        vb: &VarBuilder,
        config: &VlConfig,
    ) -> Result<Option<(VisionEncoder, Option<Resampler>)>> {
        let Some(VisionConfig::Davit(cfg)) = &config.vision else {
            return Ok(None);
        };
        let vb = self.builder(vb);
        let model = vb.pp("model");
        let proj = model.pp("multi_modal_projector");
        let width = *cfg.embed_dim.last().unwrap_or(&0);
        let projection = match self.layout {
            Layout::Transformers => proj
                .pp("image_projection")
                .get((cfg.projection_dim, width), "weight")?,
            // Stored as the parameter `x @ W` multiplies by: (width, dim).
            Layout::Original => vb
                .get((width, cfg.projection_dim), "image_projection")?
                .t()?
                .contiguous()?,
        };
        let projector = Florence2Projector::from_parts(
            projection,
            Florence2Projector::load_norm(proj.pp("image_proj_norm"), cfg.projection_dim)?,
            &proj.pp("image_position_embed"),
            cfg,
        )?;
        let backbone = vl_vision::Davit::load(model.pp("vision_tower"), cfg)?;
        Ok(Some((
            VisionEncoder::Florence2(Florence2Vision {
                backbone,
                projector,
            }),
            None,
        )))
    }

    fn decoder(
        &self,
        vb: &VarBuilder,
        config: &VlConfig,
        block: &mut BlockHook,
    ) -> Result<VisionLanguageDecoder> {
        let vb = self.builder(vb);
        let cfg = &config.decoder;
        let shared = self.shared(&vb)?;
        let lm_head = if cfg.tie_word_embeddings {
            Linear::new(shared.clone(), None)
        } else {
            linear(vb.pp("lm_head"), cfg.hidden_size, cfg.vocab_size, false)?
        };
        bart_decoder(
            vb.pp("model").pp("language_model").pp("decoder"),
            shared,
            lm_head,
            cfg,
            block,
        )
    }

    fn text_encoder(
        &self,
        vb: &VarBuilder,
        config: &VlConfig,
        decoder: &VisionLanguageDecoder,
    ) -> Result<Option<TextEncoder>> {
        let Some(cfg) = &config.text_encoder else {
            return Ok(None);
        };
        let vb = self.builder(vb);
        let enc = vb.pp("model").pp("language_model").pp("encoder");
        let h = cfg.hidden_size;
        let eps = cfg.layer_norm_eps;
        let attn_cfg = SelfAttentionConfig::new(h, cfg.num_attention_heads);
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let l = enc.pp("layers").pp(i);
                let [q, k, v, o] = bart_attention(l.pp("self_attn"), h, h)?;
                Ok(EncoderLayer::from_parts(
                    SelfAttention::from_parts(q, k, v, o, &attn_cfg)?,
                    layer_norm(l.pp("self_attn_layer_norm"), h, eps)?,
                    FeedForward::from_parts(
                        linear(l.pp("fc1"), h, cfg.intermediate_size, true)?,
                        linear(l.pp("fc2"), cfg.intermediate_size, h, true)?,
                        cfg.hidden_act,
                    ),
                    layer_norm(l.pp("final_layer_norm"), h, eps)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let parts = TextEncoderParts {
            embed_tokens: decoder.token_table().clone(),
            embed_positions: enc.pp("embed_positions").get(
                (cfg.max_position_embeddings + cfg.position_offset, h),
                "weight",
            )?,
            embedding_norm: Some(layer_norm(enc.pp("layernorm_embedding"), h, eps)?),
            layers,
            final_norm: None,
        };
        Ok(Some(TextEncoder::from_parts(parts, cfg)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// transformers' names map onto microsoft's as the conversion script
    /// maps them back.
    #[test]
    fn original_names() {
        for (native, original) in [
            (
                "model.vision_tower.convs.0.conv.weight",
                "vision_tower.convs.0.proj.weight",
            ),
            (
                "model.vision_tower.convs.2.norm.bias",
                "vision_tower.convs.2.norm.bias",
            ),
            (
                "model.vision_tower.blocks.1.0.spatial_block.conv1.weight",
                "vision_tower.blocks.1.0.spatial_block.conv1.fn.dw.weight",
            ),
            (
                "model.vision_tower.blocks.1.0.spatial_block.norm1.weight",
                "vision_tower.blocks.1.0.spatial_block.window_attn.norm.weight",
            ),
            (
                "model.vision_tower.blocks.1.0.channel_block.norm1.bias",
                "vision_tower.blocks.1.0.channel_block.channel_attn.norm.bias",
            ),
            (
                "model.vision_tower.blocks.3.2.channel_block.channel_attn.qkv.weight",
                "vision_tower.blocks.3.2.channel_block.channel_attn.fn.qkv.weight",
            ),
            (
                "model.vision_tower.blocks.0.0.spatial_block.norm2.weight",
                "vision_tower.blocks.0.0.spatial_block.ffn.norm.weight",
            ),
            (
                "model.vision_tower.blocks.0.0.channel_block.ffn.fc2.bias",
                "vision_tower.blocks.0.0.channel_block.ffn.fn.net.fc2.bias",
            ),
            (
                "model.multi_modal_projector.image_position_embed.row_embeddings.weight",
                "image_pos_embed.row_embeddings.weight",
            ),
            (
                "model.multi_modal_projector.image_proj_norm.weight",
                "image_proj_norm.weight",
            ),
            (
                "model.language_model.encoder.layers.0.fc1.weight",
                "language_model.model.encoder.layers.0.fc1.weight",
            ),
            ("lm_head.weight", "language_model.lm_head.weight"),
        ] {
            assert_eq!(original_name(native), original, "{native}");
        }
    }
}
