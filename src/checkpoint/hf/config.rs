//! The JSON files of a transformers `VisionEncoderDecoderModel` directory
//! that are not one family's: `config.json`'s frame around the encoder and
//! decoder configs (which [`super::vit`], [`super::gpt2`] and
//! [`super::trocr`] define),
//! `preprocessor_config.json` and the generation settings; and their
//! translation into vl's configurations.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

use vl_decoder::{DecoderConfig, EarlyStopping, GenerationConfig, Strategy};
use vl_vision::swin::ImageSize;
use vl_vision::{DocumentFit, PixelSpec, Resample, SwinConfig, VisionConfig, VitConfig};

use super::gpt2::HfGpt2Config;
use super::mbart::HfMbartConfig;
use super::swin::HfSwinConfig;
use super::trocr::HfTrocrConfig;
use super::vit::HfVitConfig;

use crate::error::{config_err, Error, Result};

/// The `model_type` of a transformers vision-encoder-decoder checkpoint.
pub const MODEL_TYPE: &str = "vision-encoder-decoder";

fn default_true() -> bool {
    true
}

/// `config.json`'s `decoder`, by its `model_type`.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "Value")]
pub enum HfDecoderConfig {
    /// `gpt2` with `add_cross_attention`.
    Gpt2(HfGpt2Config),
    /// `trocr`.
    Trocr(HfTrocrConfig),
    /// `mbart` (Donut's and Nougat's decoder).
    Mbart(HfMbartConfig),
}

/// `config.json`'s `side` (`encoder` or `decoder`) read by `parse`, which
/// picks the family by its `model_type` (`None`: not one vl reads). Errors
/// name the field's path (`decoder.activation_function: unknown variant
/// ...`), not only serde's line and column.
fn by_family<T>(
    v: Value,
    side: &str,
    parse: impl FnOnce(
        &str,
        Value,
    )
        -> Option<std::result::Result<T, serde_path_to_error::Error<serde_json::Error>>>,
) -> std::result::Result<T, String> {
    let family = v
        .get("model_type")
        .and_then(Value::as_str)
        .map(str::to_owned);
    let Some(parsed) = family.as_deref().and_then(|f| parse(f, v)) else {
        return Err(format!(
            "{side}.model_type: unsupported {:?}",
            family.as_deref()
        ));
    };
    parsed.map_err(|e| {
        format!(
            "{side}.{} ({}): {}",
            e.path(),
            family.unwrap_or_default(),
            e.inner()
        )
    })
}

impl TryFrom<Value> for HfDecoderConfig {
    type Error = String;

    fn try_from(v: Value) -> std::result::Result<Self, String> {
        by_family(v, "decoder", |family, v| {
            Some(match family {
                "gpt2" => serde_path_to_error::deserialize(v).map(Self::Gpt2),
                "trocr" => serde_path_to_error::deserialize(v).map(Self::Trocr),
                "mbart" => serde_path_to_error::deserialize(v).map(Self::Mbart),
                _ => return None,
            })
        })
    }
}

impl HfDecoderConfig {
    /// The family's `model_type`.
    pub fn model_type(&self) -> &str {
        match self {
            Self::Gpt2(d) => &d.model_type,
            Self::Trocr(d) => &d.model_type,
            Self::Mbart(d) => &d.model_type,
        }
    }

    /// The decoder's width.
    pub fn hidden_size(&self) -> usize {
        match self {
            Self::Gpt2(d) => d.n_embd,
            Self::Trocr(d) => d.d_model,
            Self::Mbart(d) => d.d_model,
        }
    }

    /// The keys the family does not read: generation settings of older
    /// checkpoints.
    pub fn rest(&self) -> &BTreeMap<String, Value> {
        match self {
            Self::Gpt2(d) => &d.rest,
            Self::Trocr(d) => &d.rest,
            Self::Mbart(d) => &d.rest,
        }
    }
}

/// `config.json`'s `encoder`, by its `model_type`.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "Value")]
pub enum HfEncoderConfig {
    /// `vit` or `deit`.
    Vit(HfVitConfig),
    /// `donut-swin` (Donut's and Nougat's encoder).
    Swin(HfSwinConfig),
}

impl TryFrom<Value> for HfEncoderConfig {
    type Error = String;

    fn try_from(v: Value) -> std::result::Result<Self, String> {
        by_family(v, "encoder", |family, v| {
            if super::vit::ENCODERS.contains(&family) {
                Some(serde_path_to_error::deserialize(v).map(Self::Vit))
            } else if super::swin::ENCODERS.contains(&family) {
                Some(serde_path_to_error::deserialize(v).map(Self::Swin))
            } else {
                None
            }
        })
    }
}

impl HfEncoderConfig {
    /// The family's `model_type`.
    pub fn model_type(&self) -> &str {
        match self {
            Self::Vit(e) => &e.model_type,
            Self::Swin(e) => &e.model_type,
        }
    }

    /// The width of the encoder's tokens, before any `enc_to_dec_proj`.
    pub fn hidden_size(&self) -> usize {
        match self {
            Self::Vit(e) => e.hidden_size,
            Self::Swin(e) => e.swin.hidden_size(),
        }
    }

    /// The configured input `(height, width)`.
    pub fn image_size(&self) -> (usize, usize) {
        match self {
            Self::Vit(e) => (e.image_size, e.image_size),
            Self::Swin(e) => e.swin.image_size.height_width(),
        }
    }
}

/// `config.json` of a vision-encoder-decoder checkpoint.
#[derive(Debug, Clone, Deserialize)]
pub struct HfConfig {
    /// Must be `"vision-encoder-decoder"`.
    pub model_type: String,
    /// The image encoder.
    pub encoder: HfEncoderConfig,
    /// The text decoder.
    pub decoder: HfDecoderConfig,
    /// Every other key: generation settings of older checkpoints.
    #[serde(flatten)]
    pub rest: BTreeMap<String, Value>,
}

impl HfConfig {
    /// Rejects what vl cannot run, naming the field.
    pub fn validate(&self) -> Result<()> {
        if self.model_type != MODEL_TYPE {
            return config_err(
                "model_type",
                format!("expected {MODEL_TYPE:?}, got {:?}", self.model_type),
            );
        }
        match &self.decoder {
            HfDecoderConfig::Gpt2(d) => d.validate()?,
            HfDecoderConfig::Trocr(d) => d.validate(self.encoder.hidden_size())?,
            HfDecoderConfig::Mbart(d) => d.validate()?,
        }
        match &self.encoder {
            HfEncoderConfig::Vit(e) => self
                .vit_config(e, &PixelSpec::new(e.image_size, [0.5; 3], [0.5; 3]))
                .validate()?,
            HfEncoderConfig::Swin(e) => e.validate()?,
        }
        Ok(())
    }

    /// Whether the encoder's tokens go through `enc_to_dec_proj`.
    pub fn projects_encoder(&self) -> bool {
        match &self.decoder {
            HfDecoderConfig::Gpt2(d) => self.encoder.hidden_size() != d.n_embd,
            HfDecoderConfig::Trocr(d) => d.projects_encoder(self.encoder.hidden_size()),
            HfDecoderConfig::Mbart(d) => d.projects_encoder(self.encoder.hidden_size()),
        }
    }

    /// The encoder as vl's [`VisionConfig`], its preprocessing from `pre`
    /// (`preprocessor_config.json`, `None` when the directory has none).
    ///
    /// # Errors
    /// A preprocessor the encoder cannot take, naming the field.
    pub fn vision_config(&self, pre: Option<&HfPreprocessorConfig>) -> Result<VisionConfig> {
        match &self.encoder {
            HfEncoderConfig::Vit(e) => {
                let default = HfPreprocessorConfig::default();
                let pixels = pre.unwrap_or(&default).pixel_spec(e.image_size)?;
                Ok(VisionConfig::Vit(self.vit_config(e, &pixels)))
            }
            HfEncoderConfig::Swin(e) => {
                let mut swin = match pre {
                    Some(pre) => pre.swin_pixels(&e.swin)?,
                    None => HfPreprocessorConfig::donut_default(&e.swin)?,
                };
                swin.output_size = self
                    .projects_encoder()
                    .then_some(self.decoder.hidden_size());
                swin.validate()?;
                Ok(VisionConfig::Swin(swin))
            }
        }
    }

    /// The ViT encoder `e` as a vl [`VitConfig`], its normalisation from
    /// `pixels`.
    pub fn vit_config(&self, e: &HfVitConfig, pixels: &PixelSpec) -> VitConfig {
        VitConfig {
            image_size: e.image_size,
            patch_size: e.patch_size,
            num_channels: e.num_channels,
            hidden_size: e.hidden_size,
            num_hidden_layers: e.num_hidden_layers,
            num_attention_heads: e.num_attention_heads,
            intermediate_size: e.intermediate_size,
            layer_norm_eps: e.layer_norm_eps,
            image_mean: pixels.mean,
            image_std: pixels.std,
            rescale_factor: pixels.rescale_factor,
            resample: pixels.resample,
            do_resize: pixels.resize,
            hidden_act: e.hidden_act,
            output_size: self
                .projects_encoder()
                .then_some(self.decoder.hidden_size()),
            attention_dropout: e.attention_probs_dropout_prob,
            hidden_dropout: e.hidden_dropout_prob,
            distillation_token: e.has_distillation_token(),
        }
    }

    /// The decoder as a vl [`DecoderConfig`], with the special tokens of
    /// `generation`.
    ///
    /// # Errors
    /// A TrOCR decoder with sinusoidal positions and no usable
    /// `pad_token_id`, named.
    pub fn decoder_config(&self, generation: &GenerationConfig) -> Result<DecoderConfig> {
        match &self.decoder {
            HfDecoderConfig::Gpt2(d) => Ok(d.decoder_config(generation)),
            HfDecoderConfig::Trocr(d) => d.decoder_config(generation),
            HfDecoderConfig::Mbart(d) => Ok(d.decoder_config(generation)),
        }
    }
}

/// `size` of an image processor: `{"height", "width"}`,
/// `{"shortest_edge"}` or a bare number.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum HfSize {
    /// A square side.
    Side(usize),
    /// Height and width.
    HeightWidth {
        /// Height.
        height: usize,
        /// Width.
        width: usize,
    },
    /// Resize so the shorter side is this (then crop), not what ViT does.
    ShortestEdge {
        /// The shorter side.
        shortest_edge: usize,
    },
    /// Two numbers: Donut's and Nougat's processors read them as
    /// `[width, height]`.
    Pair([usize; 2]),
}

fn resample_bilinear() -> u32 {
    2
}
fn rescale_255() -> f64 {
    1.0 / 255.0
}
fn half3() -> [f32; 3] {
    [0.5; 3]
}

fn imagenet_mean() -> [f32; 3] {
    [0.485, 0.456, 0.406]
}
fn imagenet_std() -> [f32; 3] {
    [0.229, 0.224, 0.225]
}

/// `preprocessor_config.json`: a transformers `ViTImageProcessor` (or the
/// older `ViTFeatureExtractor`), or for a Swin encoder Donut's or Nougat's
/// processor, with their defaults.
#[derive(Debug, Clone, Deserialize)]
pub struct HfPreprocessorConfig {
    /// The processor's class (`DonutImageProcessor`, …).
    #[serde(default)]
    pub image_processor_type: Option<String>,
    /// The older name of the class (`DonutFeatureExtractor`, …).
    #[serde(default)]
    pub feature_extractor_type: Option<String>,
    /// The processor around it (`DonutProcessor`, `NougatProcessor`), the
    /// only class some files name.
    #[serde(default)]
    pub processor_class: Option<String>,
    /// Donut's and Nougat's `do_thumbnail` (default true).
    #[serde(default)]
    pub do_thumbnail: Option<bool>,
    /// Donut's and Nougat's `do_align_long_axis` (default false).
    #[serde(default)]
    pub do_align_long_axis: Option<bool>,
    /// Donut's and Nougat's `do_pad` (default true).
    #[serde(default)]
    pub do_pad: Option<bool>,
    /// Nougat's `do_crop_margin` (default true).
    #[serde(default)]
    pub do_crop_margin: Option<bool>,
    /// Resize to `size` (default true).
    #[serde(default = "default_true")]
    pub do_resize: bool,
    /// The size to resize to (default the encoder's `image_size`).
    #[serde(default)]
    pub size: Option<HfSize>,
    /// PIL's filter number (default 2, bilinear).
    #[serde(default = "resample_bilinear")]
    pub resample: u32,
    /// Multiply pixels by `rescale_factor` (default true).
    #[serde(default = "default_true")]
    pub do_rescale: bool,
    /// Default 1/255.
    #[serde(default = "rescale_255")]
    pub rescale_factor: f64,
    /// Normalise by mean and std (default true).
    #[serde(default = "default_true")]
    pub do_normalize: bool,
    /// Default 0.5 per channel (Nougat's: ImageNet's).
    #[serde(default)]
    pub image_mean: Option<[f32; 3]>,
    /// Default 0.5 per channel (Nougat's: ImageNet's).
    #[serde(default)]
    pub image_std: Option<[f32; 3]>,
}

impl Default for HfPreprocessorConfig {
    fn default() -> Self {
        Self {
            image_processor_type: None,
            feature_extractor_type: None,
            processor_class: None,
            do_thumbnail: None,
            do_align_long_axis: None,
            do_pad: None,
            do_crop_margin: None,
            do_resize: true,
            size: None,
            resample: resample_bilinear(),
            do_rescale: true,
            rescale_factor: rescale_255(),
            do_normalize: true,
            image_mean: None,
            image_std: None,
        }
    }
}

impl HfPreprocessorConfig {
    /// The pixel spec for an encoder of input size `image_size`.
    pub fn pixel_spec(&self, image_size: usize) -> Result<PixelSpec> {
        if self.do_resize {
            let side = match &self.size {
                None => image_size,
                Some(HfSize::Side(s)) => *s,
                Some(HfSize::HeightWidth { height, width }) if height == width => *height,
                Some(HfSize::HeightWidth { height, width }) => {
                    return config_err(
                        "size",
                        format!("{height}x{width} is not square; the ViT takes {image_size}x{image_size}"),
                    )
                }
                Some(HfSize::ShortestEdge { shortest_edge }) => {
                    return config_err(
                        "size",
                        format!("shortest_edge {shortest_edge} resizing is not supported; the ViT takes {image_size}x{image_size}"),
                    )
                }
                Some(HfSize::Pair([a, b])) if a == b => *a,
                Some(HfSize::Pair([a, b])) => {
                    return config_err(
                        "size",
                        format!("[{a}, {b}] is not square; the ViT takes {image_size}x{image_size}"),
                    )
                }
            };
            if side != image_size {
                return config_err(
                    "size",
                    format!("resizes to {side}, but the encoder's image_size is {image_size}"),
                );
            }
        }
        let resample = self.filter()?;
        let (mean, std) = self.normalisation(half3(), half3())?;
        Ok(PixelSpec {
            height: image_size,
            width: image_size,
            document: None,
            mean,
            std,
            rescale_factor: self.rescale(),
            resample,
            resize: self.do_resize,
        })
    }

    /// The resize filter of PIL's number `resample`.
    fn filter(&self) -> Result<Resample> {
        match Resample::from_pil(self.resample) {
            Some(r) => Ok(r),
            None => config_err(
                "resample",
                format!(
                    "PIL filter {} is not supported (0 nearest, 1 lanczos, 2 bilinear, 3 bicubic)",
                    self.resample
                ),
            ),
        }
    }

    /// What pixel values (0..=255) are multiplied by: `rescale_factor`, or
    /// 1 with `do_rescale` off.
    fn rescale(&self) -> f32 {
        if self.do_rescale {
            self.rescale_factor as f32
        } else {
            1.0
        }
    }

    /// The mean and std to normalise by (`default_*` where the file gives
    /// none; no normalisation when `do_normalize` is off).
    fn normalisation(
        &self,
        default_mean: [f32; 3],
        default_std: [f32; 3],
    ) -> Result<([f32; 3], [f32; 3])> {
        let (mean, std) = if self.do_normalize {
            (
                self.image_mean.unwrap_or(default_mean),
                self.image_std.unwrap_or(default_std),
            )
        } else {
            ([0.0; 3], [1.0; 3])
        };
        if let Some(s) = std.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
            return config_err("image_std", format!("must be positive, got {s}"));
        }
        Ok((mean, std))
    }

    /// The processor's class name: `image_processor_type`, the older
    /// `feature_extractor_type`, else `processor_class`.
    pub fn processor_type(&self) -> Option<&str> {
        self.image_processor_type
            .as_deref()
            .or(self.feature_extractor_type.as_deref())
            .or(self.processor_class.as_deref())
    }

    /// Whether this is Nougat's processor (else Donut's, for a Swin).
    pub fn is_nougat(&self) -> bool {
        self.processor_type()
            .is_some_and(|t| t.starts_with("Nougat"))
    }

    /// `swin` with this processor's preprocessing: Donut's or Nougat's
    /// steps ([`DocumentFit`]) with their defaults, at the processor's
    /// `size` (what transformers feeds the encoder), or stretched to the
    /// size as a ViT processor does when the file names another class.
    ///
    /// # Errors
    /// A `size` that is not a height and a width, an unknown filter, a
    /// non-positive std; each named.
    pub fn swin_pixels(&self, swin: &SwinConfig) -> Result<SwinConfig> {
        let kind = self.processor_type().unwrap_or("DonutImageProcessor");
        let document = kind.starts_with("Donut") || kind.starts_with("Nougat");
        let nougat = self.is_nougat();
        let (height, width) = match &self.size {
            None => swin.image_size.height_width(),
            Some(HfSize::HeightWidth { height, width }) => (*height, *width),
            // transformers' Donut and Nougat processors reverse a list
            // (`size[::-1]`) before reading it as height, width.
            Some(HfSize::Pair([w, h])) if document => (*h, *w),
            Some(HfSize::Pair([h, w])) => (*h, *w),
            Some(HfSize::Side(s)) => (*s, *s),
            Some(HfSize::ShortestEdge { shortest_edge }) => {
                let reason =
                    format!("shortest_edge {shortest_edge}: a Swin needs a height and a width");
                return config_err("size", reason);
            }
        };
        if (height, width) != swin.image_size.height_width() {
            tracing::info!(
                "preprocessor size {height}x{width} (height x width) differs from the encoder's \
                 image_size {:?}; images are fed at the preprocessor's, as transformers does",
                swin.image_size
            );
        }
        let resample = self.filter()?;
        let (mean, std) = if nougat {
            self.normalisation(imagenet_mean(), imagenet_std())?
        } else {
            self.normalisation(half3(), half3())?
        };
        let fit = document.then(|| DocumentFit {
            crop_margin: nougat && self.do_crop_margin.unwrap_or(true),
            align_long_axis: self.do_align_long_axis.unwrap_or(false),
            // Donut's thumbnail resizes with the processor's filter,
            // Nougat's always with bicubic.
            thumbnail: self.do_thumbnail.unwrap_or(true).then_some(if nougat {
                Resample::Bicubic
            } else {
                resample
            }),
            pad: self.do_pad.unwrap_or(true),
        });
        Ok(SwinConfig {
            image_size: ImageSize::HeightWidth([height, width]),
            image_mean: mean,
            image_std: std,
            rescale_factor: self.rescale(),
            resample,
            do_resize: self.do_resize,
            document: fit,
            ..swin.clone()
        })
    }

    /// `swin` with `DonutImageProcessor`'s defaults, for a directory with
    /// no `preprocessor_config.json`.
    ///
    /// # Errors
    /// As [`HfPreprocessorConfig::swin_pixels`].
    pub fn donut_default(swin: &SwinConfig) -> Result<SwinConfig> {
        Self {
            image_processor_type: Some("DonutImageProcessor".into()),
            ..Self::default()
        }
        .swin_pixels(swin)
    }
}

/// Generation settings that vl does not implement; a checkpoint that sets
/// one is still loaded, with a warning.
pub const UNSUPPORTED_GENERATION: &[&str] = &[
    "num_beam_groups",
    "diversity_penalty",
    "bad_words_ids",
    "force_words_ids",
    "encoder_no_repeat_ngram_size",
    "suppress_tokens",
    "begin_suppress_tokens",
    "exponential_decay_length_penalty",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "min_p",
];

/// `eos_token_id`: one id or a list.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    /// One id.
    One(u32),
    /// Several ids.
    Many(Vec<u32>),
}

/// `early_stopping`: `true`, `false` or `"never"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum HfEarlyStopping {
    /// `true` or `false`.
    Flag(bool),
    /// `"never"`.
    Word(Never),
}

/// The word `"never"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Never {
    /// `"never"`.
    Never,
}

impl From<HfEarlyStopping> for EarlyStopping {
    fn from(e: HfEarlyStopping) -> Self {
        match e {
            HfEarlyStopping::Flag(true) => Self::True,
            HfEarlyStopping::Flag(false) => Self::False,
            HfEarlyStopping::Word(Never::Never) => Self::Never,
        }
    }
}

/// Generation settings read from `generation_config.json`, or from
/// `config.json` (top level first, then `decoder`) in older checkpoints —
/// the precedence of transformers' `GenerationConfig.from_model_config`.
/// Field names are transformers'; `null` is the same as absent.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct HfGeneration {
    /// The start token of the decoder.
    pub decoder_start_token_id: Option<u32>,
    /// The start token when `decoder_start_token_id` is unset.
    pub bos_token_id: Option<u32>,
    /// The end token(s).
    pub eos_token_id: Option<TokenIds>,
    /// Padding; the first end token when unset.
    pub pad_token_id: Option<u32>,
    /// Most new tokens; wins over `max_length`.
    pub max_new_tokens: Option<usize>,
    /// Most tokens, the start token included.
    pub max_length: Option<usize>,
    /// Fewest new tokens; wins over `min_length`.
    pub min_new_tokens: Option<usize>,
    /// Fewest tokens, the start token included.
    pub min_length: Option<usize>,
    /// Beams; 1 = no beam search.
    pub num_beams: Option<usize>,
    /// Sample instead of choosing the most likely token.
    pub do_sample: Option<bool>,
    /// When a beam search ends.
    pub early_stopping: Option<HfEarlyStopping>,
    /// Beam scores are `sum_logprobs / len ^ length_penalty`.
    pub length_penalty: Option<f64>,
    /// Sampling temperature.
    pub temperature: Option<f64>,
    /// Sample from the k most likely tokens (0 = all).
    pub top_k: Option<usize>,
    /// Nucleus sampling.
    pub top_p: Option<f64>,
    /// Penalty of tokens already generated.
    pub repetition_penalty: Option<f64>,
    /// Never repeat an n-gram of this size.
    pub no_repeat_ngram_size: Option<usize>,
    /// The first generated token.
    pub forced_bos_token_id: Option<u32>,
    /// The last token `max_length` allows.
    pub forced_eos_token_id: Option<u32>,
    /// Token sequences never generated.
    pub bad_words_ids: Option<Vec<Vec<u32>>>,
    /// Every other key (model settings in `config.json`, settings vl does
    /// not implement).
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

impl HfGeneration {
    /// Parses the settings of `values` (a `generation_config.json`, or
    /// the merged keys of a `config.json`), naming the field that has the
    /// wrong type.
    pub fn from_values(values: BTreeMap<String, Value>) -> Result<Self> {
        let values: serde_json::Map<String, Value> =
            values.into_iter().filter(|(_, v)| !v.is_null()).collect();
        serde_path_to_error::deserialize(Value::Object(values)).map_err(|e| Error::Config {
            field: "generation",
            reason: format!("{}: {}", e.path(), e.inner()),
        })
    }

    /// From `config.json`: its top-level keys, then the decoder's for keys
    /// the top level lacks or leaves `null`.
    pub fn from_model_config(cfg: &HfConfig) -> Result<Self> {
        let mut values: BTreeMap<String, Value> = cfg
            .rest
            .iter()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (k, v) in cfg.decoder.rest() {
            if !v.is_null() && !values.contains_key(k) {
                values.insert(k.clone(), v.clone());
            }
        }
        Self::from_values(values)
    }

    /// The settings that vl ignores, with their values, for a warning.
    pub fn unsupported(&self) -> Vec<String> {
        UNSUPPORTED_GENERATION
            .iter()
            .filter_map(|k| {
                let v = self.other.get(*k).filter(|v| !v.is_null())?;
                let inert = matches!(v, Value::Array(a) if a.is_empty())
                    || v.as_f64() == Some(0.0) && *k != "typical_p"
                    || (*k == "num_beam_groups" && v.as_u64() == Some(1))
                    || (*k == "typical_p" && v.as_f64() == Some(1.0));
                (!inert).then(|| format!("{k}={v}"))
            })
            .collect()
    }

    /// The generation defaults, as transformers' `generate()` resolves
    /// them for an encoder-decoder model: the start token is
    /// `decoder_start_token_id`, else `bos_token_id`; `max_length` counts
    /// the start token; padding falls back to the first EOS id; sampling
    /// defaults to `top_k` 50.
    pub fn to_generation_config(&self) -> Result<GenerationConfig> {
        let Some(start) = self.decoder_start_token_id.or(self.bos_token_id) else {
            return config_err(
                "decoder_start_token_id",
                "missing, and no bos_token_id to fall back on",
            );
        };
        let eos_token_ids = match &self.eos_token_id {
            None => Vec::new(),
            Some(TokenIds::One(id)) => vec![*id],
            Some(TokenIds::Many(ids)) => ids.clone(),
        };
        let pad = self
            .pad_token_id
            .or(eos_token_ids.first().copied())
            .unwrap_or(start);
        let max_new_tokens = match (self.max_new_tokens, self.max_length) {
            (Some(n), _) => n,
            (None, Some(l)) => l.saturating_sub(1),
            // transformers 5: "by default let's always generate 20 new
            // tokens" (see HfGeneration::cap_default_length).
            (None, None) => 20,
        };
        if max_new_tokens == 0 {
            return config_err(
                "max_length",
                "leaves no room for a token after the start token",
            );
        }
        let min_new_tokens = match (self.min_new_tokens, self.min_length) {
            (Some(n), _) => n,
            (None, Some(l)) => l.saturating_sub(1),
            (None, None) => 0,
        }
        .min(max_new_tokens);
        let num_beams = self.num_beams.unwrap_or(1);
        let strategy = if num_beams > 1 {
            Strategy::Beam {
                num_beams,
                length_penalty: self.length_penalty.unwrap_or(1.0) as f32,
                early_stopping: self
                    .early_stopping
                    .map_or(EarlyStopping::False, EarlyStopping::from),
            }
        } else if self.do_sample.unwrap_or(false) {
            Strategy::Sample {
                temperature: self.temperature.unwrap_or(1.0),
                top_k: match self.top_k {
                    Some(0) => None,
                    Some(k) => Some(k),
                    None => Some(50),
                },
                top_p: self.top_p,
                seed: 0,
            }
        } else {
            Strategy::Greedy
        };
        let cfg = GenerationConfig {
            max_new_tokens,
            min_new_tokens,
            start_token_id: start,
            eos_token_ids,
            pad_token_id: pad,
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0) as f32,
            no_repeat_ngram_size: self.no_repeat_ngram_size.unwrap_or(0),
            strategy,
            forced_bos_token_id: self.forced_bos_token_id,
            forced_eos_token_id: self.forced_eos_token_id,
            bad_words_ids: self.bad_words_ids.clone().unwrap_or_default(),
            cross_attention_of: None,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// With no length set, transformers caps its 20 new tokens so that
    /// the start token and them fit in the decoder's positions; this does
    /// the same to `cfg` (made by [`HfGeneration::to_generation_config`]).
    pub fn cap_default_length(&self, cfg: &mut GenerationConfig, max_positions: usize) {
        if self.max_new_tokens.is_none() && self.max_length.is_none() {
            cfg.max_new_tokens = cfg
                .max_new_tokens
                .min(max_positions.saturating_sub(1))
                .max(1);
            cfg.min_new_tokens = cfg.min_new_tokens.min(cfg.max_new_tokens);
        }
    }

    /// Whether the settings ask for sampling with beams (transformers'
    /// beam sampling), which vl runs as plain beam search.
    pub fn beam_sampling(&self) -> bool {
        self.do_sample == Some(true) && self.num_beams.unwrap_or(1) > 1
    }
}
