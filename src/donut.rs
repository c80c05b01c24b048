//! Donut's output as JSON: the tag sequence a Donut checkpoint generates
//! (`<s_menu><s_nm>Latte</s_nm><sep/><s_nm>Tea</s_nm></s_menu>`) turned
//! into nested objects and lists exactly as transformers'
//! `DonutProcessor.token2json` turns it (read in
//! `models/donut/processing_donut.py`, transformers 5.x), key order
//! included:
//!
//! - the first `<s_KEY>` (case-insensitive) opens a field, closed by the
//!   first `</s_KEY>` anywhere in the text; an opening tag with no closing
//!   one is deleted (every exact copy of it) and the search starts over;
//! - a field whose content holds both `<s_` and `</s_` is parsed again as
//!   a list of objects (a one-element list becomes its element; an empty
//!   one leaves the key out); otherwise its content splits at `<sep/>` into
//!   stripped leaves, a leaf that is an added token `<NAME/>` becoming
//!   `NAME`, a single leaf becoming a string;
//! - after a field, text starting with `<sep/>` continues a list of
//!   objects;
//! - text with no field at all is `{"text_sequence": text}`.
//!
//! Tested against transformers' own outputs (`tests/donut_token2json.rs`,
//! fixtures written by `scripts/donut_fixtures.py`).

use std::collections::HashSet;

use fancy_regex::Regex;
use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Serialize, Serializer};

/// Which document processor a Swin + mBART checkpoint's output goes
/// through (its `preprocessor_config.json`'s class).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reader {
    /// `DonutProcessor`: a task prompt replaces the start token; the
    /// output's tag sequence is read as JSON ([`token2json`]).
    Donut,
    /// `NougatProcessor`: no prompt; the output is Markdown.
    Nougat,
}

/// `DonutProcessor`'s text of a generated sequence (`batch_decode` with
/// the special tokens, as its model cards do): `eos` and `pad` removed, the
/// first tag (the task's start token) removed, stripped.
pub fn donut_text(decoded: &str, eos: &str, pad: &str) -> String {
    let mut text = decoded.replace(eos, "");
    if !pad.is_empty() {
        text = text.replace(pad, "");
    }
    // re.sub(r"<.*?>", "", sequence, count=1)
    if let Some(open) = text.find('<') {
        if let Some(len) = text[open..].find('>') {
            text.replace_range(open..open + len + 1, "");
        }
    }
    text.trim_matches(py_space).to_string()
}

/// A parsed value: objects keep their keys in the order they were found.
#[derive(Debug, Clone, PartialEq)]
pub enum DonutValue {
    /// A leaf's text.
    Text(String),
    /// A list of leaves or of objects.
    List(Vec<DonutValue>),
    /// An object, keys in order of appearance.
    Object(Vec<(String, DonutValue)>),
}

impl Serialize for DonutValue {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Text(t) => s.serialize_str(t),
            Self::List(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            Self::Object(fields) => {
                let mut map = s.serialize_map(Some(fields.len()))?;
                for (k, v) in fields {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

/// Python's `str.strip()` whitespace: Rust's, and the four separator
/// controls U+001C–U+001F that Python also strips.
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Case-insensitive search of a literal (regex-escaped), as Python's
/// `re.search(..., re.IGNORECASE)`; `None` when absent (or when the regex
/// engine gives up, which a literal never makes it do).
fn find_ci(haystack: &str, pattern: &str) -> Option<(usize, usize)> {
    let re = Regex::new(&format!("(?i){pattern}")).ok()?;
    re.find(haystack)
        .ok()
        .flatten()
        .map(|m| (m.start(), m.end()))
}

/// `tokens` (a generated sequence decoded with its special tokens) as
/// transformers' `DonutProcessor.token2json(tokens, added_vocab=…)` gives
/// it; `added_vocab` holds the tokenizer's added tokens (the categorical
/// ones look like `<NAME/>`).
pub fn token2json(tokens: &str, added_vocab: &HashSet<String>) -> DonutValue {
    match parse(tokens, false, added_vocab) {
        Parsed::Object(fields) => DonutValue::Object(fields),
        Parsed::List(items) => DonutValue::List(items),
    }
}

enum Parsed {
    Object(Vec<(String, DonutValue)>),
    List(Vec<DonutValue>),
}

/// Sets `key` as a Python dict does: in place when present, else last.
fn set(fields: &mut Vec<(String, DonutValue)>, key: &str, value: DonutValue) {
    match fields.iter_mut().find(|(k, _)| k == key) {
        Some((_, v)) => *v = value,
        None => fields.push((key.to_string(), value)),
    }
}

fn parse(tokens: &str, inner: bool, added_vocab: &HashSet<String>) -> Parsed {
    let mut tokens = tokens.to_string();
    let mut output: Vec<(String, DonutValue)> = Vec::new();
    loop {
        if tokens.is_empty() {
            break;
        }
        let Some((start, _)) = find_ci(&tokens, "<s_") else {
            break;
        };
        let rest = &tokens[start..];
        let Some(close) = rest.find('>') else {
            break;
        };
        let start_token = rest[..=close].to_string();
        let key = start_token[3..start_token.len() - 1].to_string();
        let key_escaped = fancy_regex::escape(&key);
        let Some((e0, e1)) = find_ci(&tokens, &format!("</s_{key_escaped}>")) else {
            tokens = tokens.replace(&start_token, "");
            continue;
        };
        let end_token = tokens[e0..e1].to_string();
        let content = Regex::new(&format!(
            "(?is){}(.*?){}",
            fancy_regex::escape(&start_token),
            fancy_regex::escape(&end_token)
        ))
        .ok()
        .and_then(|re| re.captures(&tokens).ok().flatten())
        .and_then(|c| {
            c.get(1)
                .map(|m| m.as_str().trim_matches(py_space).to_string())
        });
        if let Some(content) = content {
            if content.contains("<s_") && content.contains("</s_") {
                // A field of objects.
                if let Parsed::List(mut items) = parse(&content, true, added_vocab) {
                    match items.len() {
                        0 => {}
                        1 => set(&mut output, &key, items.remove(0)),
                        _ => set(&mut output, &key, DonutValue::List(items)),
                    }
                }
            } else {
                let mut leaves: Vec<DonutValue> = content
                    .split("<sep/>")
                    .map(|leaf| {
                        let leaf = leaf.trim_matches(py_space);
                        let categorical = added_vocab.contains(leaf)
                            && leaf.starts_with('<')
                            && leaf.ends_with("/>");
                        DonutValue::Text(if categorical {
                            leaf[1..leaf.len() - 2].to_string()
                        } else {
                            leaf.to_string()
                        })
                    })
                    .collect();
                let value = if leaves.len() == 1 {
                    leaves.remove(0)
                } else {
                    DonutValue::List(leaves)
                };
                set(&mut output, &key, value);
            }
        }
        let after = tokens.find(&end_token).map_or(0, |i| i + end_token.len());
        tokens = tokens[after..].trim_matches(py_space).to_string();
        if let Some(rest) = tokens.strip_prefix("<sep/>") {
            let mut items = vec![DonutValue::Object(output)];
            if let Parsed::List(more) = parse(rest, true, added_vocab) {
                items.extend(more);
            }
            return Parsed::List(items);
        }
    }
    match (output.is_empty(), inner) {
        (false, true) => Parsed::List(vec![DonutValue::Object(output)]),
        (false, false) => Parsed::Object(output),
        (true, true) => Parsed::List(Vec::new()),
        (true, false) => Parsed::Object(vec![(
            "text_sequence".to_string(),
            DonutValue::Text(tokens),
        )]),
    }
}
