//! Hugging Face checkpoints: a transformers `VisionEncoderDecoderModel`
//! directory, loaded onto vl's own [`Vit`](vl_vision::Vit) and
//! [`VisionLanguageDecoder`]. The
//! families, each an encoder or a decoder that pairs with any of the
//! other side:
//!
//! | side | `model_type` | file | checkpoints |
//! |---|---|---|---|
//! | encoder | `vit` | [`vit`] | `nlpconnect/vit-gpt2-image-captioning`, TrOCR base/large |
//! | encoder | `deit` | [`vit`] (a distillation token more) | TrOCR small |
//! | encoder | `donut-swin` | [`swin`] | Donut, Nougat |
//! | decoder | `gpt2` with `add_cross_attention` | [`gpt2`] | vit-gpt2 captioners |
//! | decoder | `trocr` | [`trocr`] (post-LN, BART-style) | `microsoft/trocr-*` |
//! | decoder | `mbart` | [`mbart`] (pre-LN, final norm) | Donut's and Nougat's decoders |
//!
//! BLIP captioners (`model_type` `blip`, not a vision-encoder-decoder
//! directory) are read by [`blip`], with the same weights, tokenizer and
//! preprocessor helpers.
//!
//! The directory holds:
//!
//! - `config.json`: `model_type` `vision-encoder-decoder`, an `encoder`
//!   and a `decoder` of the families above (any other is refused, naming
//!   `encoder.model_type` or `decoder.model_type`);
//! - `generation_config.json` (optional): the generation defaults; older
//!   checkpoints keep them in `config.json` instead (top level first, then
//!   `decoder`);
//! - `preprocessor_config.json` (optional; ViT's defaults otherwise, Donut's
//!   processor's under a Swin);
//! - `tokenizer.json` (GPT-2's or RoBERTa's byte-level BPE, XLM-R's
//!   sentencepiece), or a byte-level BPE as `vocab.json` + `merges.txt`
//!   (GPT-2, RoBERTa), with `special_tokens_map.json` naming the special
//!   tokens;
//! - `model.safetensors`, or shards listed by `model.safetensors.index.json`.
//!
//! A directory with only `pytorch_model.bin` is refused: pickle is never
//! parsed. Shard names must be plain file names inside the directory.
//!
//! One file per model family: its config and its tensors onto vl's
//! modules; a new family is a new file beside them.

pub mod blip;
pub mod config;
pub mod florence2;
pub mod gpt2;
pub mod mbart;
pub mod swin;
mod tensors;
pub mod trocr;
pub mod vit;

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use candle_nn::VarBuilder;
use serde::Deserialize;
use vl_attn::Resampler;
use vl_decoder::VisionLanguageDecoder;
use vl_vision::{VisionConfig, VisionEncoder};

use super::tokenizer::load_hf_tokenizer;
use super::{
    from_value, read_json, BlockHook, Family, ModelFormat, Plan, Source, VlConfig, CONFIG_FILE,
    SUPPORTED, WEIGHTS_FILE,
};
use crate::error::{in_file, Error, Result};

pub use config::{
    HfConfig, HfDecoderConfig, HfEncoderConfig, HfGeneration, HfPreprocessorConfig, MODEL_TYPE,
};

/// A transformers checkpoint in vl's terms: a ViT (`vit`) and a decoder,
/// no resampler, weights as stored.
pub(crate) fn vit_model(decoder: vl_decoder::DecoderConfig, vit: vl_vision::VitConfig) -> VlConfig {
    encoder_model(decoder, VisionConfig::Vit(vit))
}

/// A transformers checkpoint in vl's terms: an encoder and a decoder, no
/// resampler, weights as stored.
pub(crate) fn encoder_model(decoder: vl_decoder::DecoderConfig, vision: VisionConfig) -> VlConfig {
    VlConfig {
        model_type: super::native::MODEL_TYPE.into(),
        decoder,
        vision: Some(vision),
        resampler: None,
        quantization: vl_attn::Quantization::None,
        generation: None,
        text_encoder: None,
        tasks: None,
        reader: None,
    }
}

/// The vision side of a transformers checkpoint: its ViT, read by `load`
/// with the config's [`vl_vision::VitConfig`], and no resampler.
pub(crate) fn vit_vision(
    config: &VlConfig,
    load: impl FnOnce(&vl_vision::VitConfig) -> Result<vl_vision::Vit>,
) -> Result<Option<(VisionEncoder, Option<Resampler>)>> {
    match &config.vision {
        Some(VisionConfig::Vit(cfg)) => Ok(Some((VisionEncoder::Vit(load(cfg)?), None))),
        _ => Ok(None),
    }
}

/// A checkpoint's generation settings: `generation_config.json`, else
/// `fallback` (read from `config_path`), and the file they came from;
/// the settings vl ignores and beam sampling are said once in the log.
pub(crate) fn read_generation(
    dir: &Path,
    config_path: &Path,
    fallback: impl FnOnce() -> Result<HfGeneration>,
) -> Result<(HfGeneration, PathBuf)> {
    let generation_path = dir.join(GENERATION_FILE);
    let (generation, source) = if generation_path.is_file() {
        (
            HfGeneration::from_values(read_json(&generation_path)?)
                .map_err(in_file(&generation_path))?,
            generation_path,
        )
    } else {
        (
            fallback().map_err(in_file(config_path))?,
            config_path.to_path_buf(),
        )
    };
    let unsupported = generation.unsupported();
    if !unsupported.is_empty() {
        tracing::warn!(
            "{}: generation settings not implemented, ignored: {}",
            source.display(),
            unsupported.join(", ")
        );
    }
    if generation.beam_sampling() {
        tracing::warn!(
            "{}: do_sample with num_beams > 1 (beam sampling) runs as plain beam search",
            source.display()
        );
    }
    Ok((generation, source))
}

/// The generation defaults of newer checkpoints.
pub const GENERATION_FILE: &str = "generation_config.json";
/// The image processor's settings.
pub const PREPROCESSOR_FILE: &str = "preprocessor_config.json";
/// The index of sharded weights.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Pickled weights, never loaded.
pub const PICKLE_FILE: &str = "pytorch_model.bin";

/// The encoder `model_type`s vl loads.
const ENCODERS: [&str; 3] = ["vit", "deit", "donut-swin"];

/// The decoder `model_type`s vl loads.
pub const DECODERS: &[&str] = &["gpt2", "trocr", "mbart"];

/// The encoder and decoder families vl loads from a vision-encoder-decoder
/// checkpoint, checked before the rest of `config.json` is read so that a
/// checkpoint of another family is named for what it is.
fn check_families(config: &serde_json::Value, path: &Path) -> Result<()> {
    for (what, part, families) in [
        ("encoder.model_type", "encoder", &ENCODERS[..]),
        ("decoder.model_type", "decoder", DECODERS),
    ] {
        let found = config
            .get(part)
            .and_then(|p| p.get("model_type"))
            .and_then(|t| t.as_str())
            .map(String::from);
        if !found.as_deref().is_some_and(|f| families.contains(&f)) {
            return Err(Error::UnsupportedModel {
                path: path.to_path_buf(),
                what,
                model_type: found.unwrap_or_else(|| "(none)".into()),
                supported: SUPPORTED.to_vec(),
            });
        }
    }
    Ok(())
}

#[derive(Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

/// The shard files a `model.safetensors.index.json` lists, sorted, each
/// once.
pub fn shard_names(index_path: &Path) -> Result<Vec<String>> {
    let index: Index = read_json(index_path)?;
    let mut files: Vec<String> = index.weight_map.into_values().collect();
    files.sort();
    files.dedup();
    Ok(files)
}

/// The safetensors files of `dir`, and the path that names them in errors
/// (the file itself, or the shard index).
pub fn weight_files(dir: &Path) -> Result<(PathBuf, Vec<PathBuf>)> {
    let single = dir.join(WEIGHTS_FILE);
    if single.is_file() {
        return Ok((single.clone(), vec![single]));
    }
    if single.is_dir() {
        return Err(Error::Weights {
            path: single,
            reason: "is a directory, not a safetensors file".into(),
        });
    }
    let index_path = dir.join(INDEX_FILE);
    if index_path.is_file() {
        let files = shard_names(&index_path)?;
        if files.is_empty() {
            return Err(Error::Weights {
                path: index_path,
                reason: "weight_map lists no file".into(),
            });
        }
        let mut paths = Vec::with_capacity(files.len());
        for f in files {
            let mut parts = Path::new(&f).components();
            let plain = matches!(
                (parts.next(), parts.next()),
                (Some(Component::Normal(_)), None)
            );
            if !plain {
                return Err(Error::Weights {
                    path: index_path,
                    reason: format!("shard {f:?} is not a plain file name in the model directory"),
                });
            }
            let p = dir.join(&f);
            if !p.is_file() {
                return Err(Error::Weights {
                    path: index_path,
                    reason: format!("lists shard {f:?}, which is not in the directory"),
                });
            }
            paths.push(p);
        }
        return Ok((index_path, paths));
    }
    let pickle = dir.join(PICKLE_FILE);
    if pickle.is_file() {
        return Err(Error::Weights {
            path: pickle,
            reason: "pickled PyTorch weights are never loaded (pickle can run code); \
                     convert the checkpoint to safetensors first, e.g. in Python: \
                     VisionEncoderDecoderModel.from_pretrained(DIR).save_pretrained(DIR, safe_serialization=True)"
                .into(),
        });
    }
    Err(Error::Weights {
        path: single,
        reason: format!("no such file (nor {INDEX_FILE})"),
    })
}

impl Family for HfConfig {
    const FORMAT: ModelFormat = ModelFormat::VisionEncoderDecoder;

    fn plan(source: &Source, config: &serde_json::Value) -> Result<Plan<Self>> {
        let dir = source.dir(Self::FORMAT)?;
        let config_path = dir.join(CONFIG_FILE);
        check_families(config, &config_path)?;
        let cfg: HfConfig = from_value(config, &config_path)?;
        cfg.validate().map_err(in_file(&config_path))?;

        let (generation, generation_source) =
            read_generation(dir, &config_path, || HfGeneration::from_model_config(&cfg))?;
        let mut gen_cfg = generation
            .to_generation_config()
            .map_err(in_file(&generation_source))?;

        let pre_path = dir.join(PREPROCESSOR_FILE);
        let pre: Option<HfPreprocessorConfig> = if pre_path.is_file() {
            Some(read_json(&pre_path)?)
        } else {
            tracing::warn!(
                "{}: no such file; using {}",
                pre_path.display(),
                match cfg.encoder {
                    HfEncoderConfig::Vit(_) => "ViT's defaults (resize, mean and std 0.5)",
                    HfEncoderConfig::Swin(_) => "DonutImageProcessor's defaults",
                }
            );
            None
        };
        let vision_cfg = cfg
            .vision_config(pre.as_ref())
            .map_err(in_file(&pre_path))?;
        let dec_cfg = cfg
            .decoder_config(&gen_cfg)
            .map_err(in_file(&config_path))?;
        dec_cfg.validate().map_err(in_file(&generation_source))?;
        generation.cap_default_length(&mut gen_cfg, dec_cfg.max_position_embeddings);
        gen_cfg
            .check_ids(dec_cfg.vocab_size)
            .map_err(in_file(&generation_source))?;
        let tokenizer = load_hf_tokenizer(dir, dec_cfg.vocab_size)?;
        let reader = match cfg.encoder {
            HfEncoderConfig::Vit(_) => None,
            HfEncoderConfig::Swin(_) => Some(if pre.as_ref().is_some_and(|p| p.is_nougat()) {
                crate::donut::Reader::Nougat
            } else {
                crate::donut::Reader::Donut
            }),
        };
        Ok(Plan {
            family: cfg,
            config: VlConfig {
                reader,
                ..encoder_model(dec_cfg, vision_cfg)
            },
            generation: gen_cfg,
            tokenizer,
        })
    }

    fn vision(
        &self,
        vb: &VarBuilder,
        config: &VlConfig,
    ) -> Result<Option<(VisionEncoder, Option<Resampler>)>> {
        match (&self.encoder, &config.vision) {
            (HfEncoderConfig::Vit(e), _) => vit_vision(config, |cfg| vit::load(vb.clone(), e, cfg)),
            (HfEncoderConfig::Swin(_), Some(VisionConfig::Swin(cfg))) => Ok(Some((
                VisionEncoder::Swin(swin::load(vb.clone(), self, cfg)?),
                None,
            ))),
            (HfEncoderConfig::Swin(_), _) => Ok(None),
        }
    }

    fn decoder(
        &self,
        vb: &VarBuilder,
        config: &VlConfig,
        block: &mut BlockHook,
    ) -> Result<VisionLanguageDecoder> {
        match &self.decoder {
            HfDecoderConfig::Gpt2(_) => gpt2::load(vb.clone(), &config.decoder, block),
            HfDecoderConfig::Trocr(_) => trocr::load(vb.clone(), &config.decoder, block),
            HfDecoderConfig::Mbart(_) => mbart::load(vb.clone(), &config.decoder, block),
        }
    }
}
