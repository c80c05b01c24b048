//! Tokenizers: a `tokenizer.json` (file or bytes), or GPT-2's byte-level
//! BPE from `vocab.json` + `merges.txt`, each checked to cover the model's
//! vocabulary.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use tokenizers::models::bpe::BPE;
use tokenizers::{AddedToken, Tokenizer};

use super::{read_json, TOKENIZER_FILE};
use crate::error::{Error, Result};

/// Loads `tokenizer.json` and checks that it covers `vocab_size` ids.
pub fn load_tokenizer(path: &Path, vocab_size: usize) -> Result<Tokenizer> {
    if !path.is_file() {
        return Err(Error::Tokenizer {
            path: path.to_path_buf(),
            reason: if path.is_dir() {
                "is a directory, expected a tokenizer file".into()
            } else {
                "no such file".into()
            },
        });
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::Tokenizer {
        path: path.to_path_buf(),
        reason: format!("cannot read: {e}"),
    })?;
    parse_tokenizer(&text, path, vocab_size)
}

/// Parses the text of a `tokenizer.json` (named `path` in errors) and
/// checks that it covers `vocab_size` ids.
pub fn parse_tokenizer(text: &str, path: &Path, vocab_size: usize) -> Result<Tokenizer> {
    let err = |reason: String| Error::Tokenizer {
        path: path.to_path_buf(),
        reason,
    };
    // JSON first: tokenizers 0.23 panics, rather than failing, on some
    // invalid JSON inside a tokenizer (its `decoder` field).
    serde_json::from_str::<serde_json::Value>(text)
        .map_err(|e| err(format!("not a valid tokenizer: not JSON: {e}")))?;
    let tok = text
        .parse::<Tokenizer>()
        .map_err(|e| err(format!("not a valid tokenizer: {e}")))?;
    check_tokenizer(tok, path, vocab_size)
}

/// Checks that a tokenizer read from `path` covers `vocab_size` ids.
pub fn check_tokenizer(tok: Tokenizer, path: &Path, vocab_size: usize) -> Result<Tokenizer> {
    let n = tok.get_vocab_size(true);
    if n < vocab_size {
        return Err(Error::Tokenizer {
            path: path.to_path_buf(),
            reason: format!("has {n} tokens, fewer than the model's vocab_size {vocab_size}"),
        });
    }
    Ok(tok)
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
        return load_tokenizer(&json, vocab_size);
    }
    let (vocab, merges) = (dir.join("vocab.json"), dir.join("merges.txt"));
    if !(vocab.is_file() && merges.is_file()) {
        return Err(Error::Tokenizer {
            path: json,
            reason: "no such file, nor vocab.json + merges.txt".into(),
        });
    }
    let (Some(v), Some(m)) = (vocab.to_str(), merges.to_str()) else {
        return Err(Error::Tokenizer {
            path: vocab,
            reason: "the path is not valid UTF-8".into(),
        });
    };
    let bpe = BPE::from_file(v, m).build().map_err(|e| Error::Tokenizer {
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
        .map_err(|e| Error::Tokenizer {
            path: map_path.clone(),
            reason: format!("cannot add the special tokens: {e}"),
        })?;
    check_tokenizer(tok, &vocab, vocab_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `model_dir` fuzz target: invalid JSON in a tokenizer's
    /// `decoder` field made tokenizers panic instead of failing.
    #[test]
    fn invalid_json_in_a_tokenizer_is_an_error() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join(TOKENIZER_FILE);
        std::fs::write(&path, r#"{"version":"1.0","decoder":Wull}"#)?;
        let err = load_tokenizer(&path, 1).unwrap_err().to_string();
        assert!(err.contains("not JSON"), "{err}");
        Ok(())
    }
}
