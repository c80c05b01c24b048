//! Hugging Face checkpoints: a transformers `VisionEncoderDecoderModel`
//! directory with a ViT encoder and a GPT-2 decoder with cross-attention
//! (the layout of `nlpconnect/vit-gpt2-image-captioning` and its
//! fine-tunes), loaded onto vl's own [`Vit`](crate::Vit) and
//! [`VisionLanguageDecoder`](crate::VisionLanguageDecoder).
//!
//! The directory holds:
//!
//! - `config.json`: `model_type` `vision-encoder-decoder`, an `encoder` of
//!   `model_type` `vit` and a `decoder` of `model_type` `gpt2` with
//!   `add_cross_attention`;
//! - `generation_config.json` (optional): the generation defaults; older
//!   checkpoints keep them in `config.json` instead (top level first, then
//!   `decoder`);
//! - `preprocessor_config.json` (optional; ViT's defaults otherwise);
//! - `tokenizer.json`, or GPT-2's `vocab.json` + `merges.txt` (with
//!   `special_tokens_map.json` naming the special tokens);
//! - `model.safetensors`, or shards listed by `model.safetensors.index.json`.
//!
//! A directory with only `pytorch_model.bin` is refused: pickle is never
//! parsed. Shard names must be plain file names inside the directory.

pub mod config;
mod convert;

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use candle_core::{DType, Device};
use serde::Deserialize;
use tokenizers::models::bpe::BPE;
use tokenizers::{AddedToken, Tokenizer};

use crate::dir::{
    check_tokenizer, in_file, open_weights, read_json, weights_error, CONFIG_FILE, TOKENIZER_FILE,
    WEIGHTS_FILE,
};
use crate::error::{DecoderError, Result};
use crate::pretrained::{ModelFormat, VisionConfig, VisionEncoder, VlConfig, VlModel};

pub use config::{HfConfig, HfGeneration, HfPreprocessorConfig, MODEL_TYPE};

/// The generation defaults of newer checkpoints.
pub const GENERATION_FILE: &str = "generation_config.json";
/// The image processor's settings.
pub const PREPROCESSOR_FILE: &str = "preprocessor_config.json";
/// The index of sharded weights.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Pickled weights, never loaded.
pub const PICKLE_FILE: &str = "pytorch_model.bin";

/// Whether `dir`'s `config.json` declares a vision-encoder-decoder model.
pub fn is_hf_checkpoint(dir: &Path) -> bool {
    #[derive(Deserialize)]
    struct Probe {
        model_type: Option<String>,
    }
    read_json::<Probe>(&dir.join(CONFIG_FILE))
        .ok()
        .and_then(|p| p.model_type)
        .is_some_and(|t| t == MODEL_TYPE)
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
    let index_path = dir.join(INDEX_FILE);
    if index_path.is_file() {
        let files = shard_names(&index_path)?;
        if files.is_empty() {
            return Err(DecoderError::Weights {
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
                return Err(DecoderError::Weights {
                    path: index_path,
                    reason: format!("shard {f:?} is not a plain file name in the model directory"),
                });
            }
            let p = dir.join(&f);
            if !p.is_file() {
                return Err(DecoderError::Weights {
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
        return Err(DecoderError::Weights {
            path: pickle,
            reason: "pickled PyTorch weights are never loaded (pickle can run code); \
                     convert the checkpoint to safetensors first, e.g. in Python: \
                     VisionEncoderDecoderModel.from_pretrained(DIR).save_pretrained(DIR, safe_serialization=True)"
                .into(),
        });
    }
    Err(DecoderError::Weights {
        path: single,
        reason: format!("no such file (nor {INDEX_FILE})"),
    })
}

/// A special token in `special_tokens_map.json`: a string, or an object
/// with its `content`.
#[derive(Deserialize)]
#[serde(untagged)]
enum SpecialToken {
    Plain(String),
    Object { content: String },
    Other(#[allow(dead_code)] serde_json::Value),
}

/// `tokenizer.json`, or GPT-2's byte-level BPE from `vocab.json` +
/// `merges.txt`, checked to cover `vocab_size` ids.
pub fn load_hf_tokenizer(dir: &Path, vocab_size: usize) -> Result<Tokenizer> {
    let json = dir.join(TOKENIZER_FILE);
    if json.is_file() {
        return crate::dir::load_tokenizer(&json, vocab_size);
    }
    let (vocab, merges) = (dir.join("vocab.json"), dir.join("merges.txt"));
    if !(vocab.is_file() && merges.is_file()) {
        return Err(DecoderError::Tokenizer {
            path: json,
            reason: "no such file, nor vocab.json + merges.txt".into(),
        });
    }
    let (Some(v), Some(m)) = (vocab.to_str(), merges.to_str()) else {
        return Err(DecoderError::Tokenizer {
            path: vocab,
            reason: "the path is not valid UTF-8".into(),
        });
    };
    let bpe = BPE::from_file(v, m)
        .build()
        .map_err(|e| DecoderError::Tokenizer {
            path: vocab.clone(),
            reason: format!("with merges.txt, not a valid BPE vocabulary: {e}"),
        })?;
    let mut tok = Tokenizer::new(bpe);
    let byte_level = tokenizers::pre_tokenizers::byte_level::ByteLevel::new(false, true, true);
    tok.with_pre_tokenizer(Some(byte_level));
    tok.with_decoder(Some(byte_level));
    tok.with_post_processor(Some(byte_level));
    let map_path = dir.join("special_tokens_map.json");
    let mut specials: Vec<String> = Vec::new();
    if map_path.is_file() {
        let map: BTreeMap<String, SpecialToken> = read_json(&map_path)?;
        for t in map.into_values() {
            match t {
                SpecialToken::Plain(s) | SpecialToken::Object { content: s } => specials.push(s),
                SpecialToken::Other(_) => {}
            }
        }
    }
    specials.push("<|endoftext|>".into());
    specials.sort();
    specials.dedup();
    let added: Vec<AddedToken> = specials
        .into_iter()
        .filter(|s| tok.token_to_id(s).is_some())
        .map(|s| AddedToken::from(s, true))
        .collect();
    tok.add_special_tokens(added)
        .map_err(|e| DecoderError::Tokenizer {
            path: map_path.clone(),
            reason: format!("cannot add the special tokens: {e}"),
        })?;
    check_tokenizer(tok, &vocab, vocab_size)
}

/// Loads a vision-encoder-decoder checkpoint directory onto `device` in
/// `dtype`. Errors name the file, and the field or tensor.
pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<VlModel> {
    let config_path = dir.join(CONFIG_FILE);
    let cfg: HfConfig = read_json(&config_path)?;
    cfg.validate().map_err(in_file(&config_path))?;

    let generation_path = dir.join(GENERATION_FILE);
    let (generation, generation_source) = if generation_path.is_file() {
        (
            HfGeneration::from_file(read_json(&generation_path)?),
            generation_path,
        )
    } else {
        (HfGeneration::from_model_config(&cfg), config_path.clone())
    };
    let unsupported = generation.unsupported();
    if !unsupported.is_empty() {
        tracing::warn!(
            "{}: generation settings not implemented, ignored: {}",
            generation_source.display(),
            unsupported.join(", ")
        );
    }
    if generation.beam_sampling() {
        tracing::warn!(
            "{}: do_sample with num_beams > 1 (beam sampling) runs as plain beam search",
            generation_source.display()
        );
    }
    let gen_cfg = generation
        .to_generation_config()
        .map_err(in_file(&generation_source))?;

    let pre_path = dir.join(PREPROCESSOR_FILE);
    let pre: HfPreprocessorConfig = if pre_path.is_file() {
        read_json(&pre_path)?
    } else {
        tracing::warn!(
            "{}: no such file; using ViT's defaults (resize, mean and std 0.5)",
            pre_path.display()
        );
        HfPreprocessorConfig::default()
    };
    let pixels = pre
        .pixel_spec(cfg.encoder.image_size)
        .map_err(in_file(&pre_path))?;

    let vit_cfg = cfg.vit_config(&pixels);
    let dec_cfg = cfg.decoder_config(&gen_cfg);
    dec_cfg.validate().map_err(in_file(&generation_source))?;
    gen_cfg
        .check_ids(dec_cfg.vocab_size)
        .map_err(in_file(&generation_source))?;

    let tokenizer = load_hf_tokenizer(dir, dec_cfg.vocab_size)?;
    let (label, files) = weight_files(dir)?;
    let vb = open_weights(&files, Some(&label), dtype, device)?;
    let vit = convert::vit(vb.clone(), &cfg, &vit_cfg).map_err(|e| weights_error(&label, e))?;
    let decoder = convert::gpt2(vb, &dec_cfg).map_err(|e| weights_error(&label, e))?;
    Ok(VlModel {
        path: dir.to_path_buf(),
        config: VlConfig {
            model_type: crate::pretrained::MODEL_TYPE.into(),
            decoder: dec_cfg,
            vision: Some(VisionConfig::Vit(vit_cfg)),
        },
        decoder,
        vision: Some(VisionEncoder::Vit(vit)),
        tokenizer,
        pixels: Some(pixels),
        generation: gen_cfg,
        format: ModelFormat::VisionEncoderDecoder,
    })
}
