//! Fetching a checkpoint from the Hugging Face Hub (cargo feature `hub`),
//! through the hf-hub crate into its usual cache (`$HF_HOME/hub`, by
//! default `~/.cache/huggingface/hub`), so files shared with Python's
//! `huggingface_hub` are not downloaded twice.
//!
//! Only the files the loader reads are fetched: the configs, the tokenizer
//! and the safetensors weights. A repository with only pickled weights is
//! refused before anything large is downloaded. With no network, a model
//! already in the cache is used as it is.

use std::path::PathBuf;

use anyhow::{bail, Context};
use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo, RepoType};

/// Files fetched when the repository has them.
const WANTED: &[&str] = &[
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "model.safetensors",
    "model.safetensors.index.json",
];

/// Checks that `id` is `NAME` or `ORG/NAME` of letters, digits, `-`, `_`
/// and `.` (and no `..`).
pub fn check_model_id(id: &str) -> anyhow::Result<()> {
    let parts: Vec<&str> = id.split('/').collect();
    let ok_part = |p: &str| {
        !p.is_empty()
            && !p.contains("..")
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    if parts.len() > 2 || !parts.iter().all(|p| ok_part(p)) {
        bail!("--model-id {id:?}: expected ORG/NAME of letters, digits, '-', '_' and '.'");
    }
    Ok(())
}

/// Checks a revision: a branch, tag or commit (`main`, `refs/pr/12`, a
/// hash) of letters, digits, `-`, `_`, `.` and `/`, with no `..`.
pub fn check_revision(rev: &str) -> anyhow::Result<()> {
    let ok = !rev.is_empty()
        && !rev.contains("..")
        && !rev.starts_with('/')
        && rev
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c));
    if !ok {
        bail!("--revision {rev:?}: expected a branch, tag or commit such as main or refs/pr/12");
    }
    Ok(())
}

/// Downloads (or finds in the cache) the files of `model_id` at
/// `revision` (a branch, tag or commit; `None` = `main`) and returns the
/// local snapshot directory. Some repositories keep their safetensors on a
/// pull-request branch (`refs/pr/N`): pass that as the revision.
pub fn fetch(model_id: &str, revision: Option<&str>) -> anyhow::Result<PathBuf> {
    check_model_id(model_id)?;
    if let Some(rev) = revision {
        check_revision(rev)?;
    }
    let repo_at = || match revision {
        Some(rev) => Repo::with_revision(model_id.to_string(), RepoType::Model, rev.to_string()),
        None => Repo::model(model_id.to_string()),
    };
    let at = revision.map(|r| format!(" at {r}")).unwrap_or_default();
    let cache = Cache::from_env();
    let cached = || {
        cache
            .repo(repo_at())
            .get("config.json")
            .and_then(|p| p.parent().map(PathBuf::from))
    };
    let api = ApiBuilder::from_env()
        .with_progress(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .build()
        .context("cannot set up the Hugging Face Hub client")?;
    let repo = api.repo(repo_at());
    let info = match repo.info() {
        Ok(info) => info,
        Err(e) => {
            if let Some(dir) = cached() {
                tracing::warn!(
                    "cannot reach the Hub ({e}); using the cached {}",
                    dir.display()
                );
                return Ok(dir);
            }
            bail!(
                "cannot fetch {model_id}{at} from the Hugging Face Hub ({e}), and it is not in the cache {}; \
                 check the network (or HF_ENDPOINT), or download the directory and pass --model DIR",
                cache.path().display()
            );
        }
    };
    let files: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
    let has = |f: &str| files.contains(&f);
    if !has("model.safetensors") && !has("model.safetensors.index.json") {
        if has("pytorch_model.bin") {
            bail!(
                "{model_id}{at} has only pytorch_model.bin (pickle, never loaded); \
                 its safetensors may live on a pull-request branch (--revision refs/pr/N), \
                 or convert it once (see the README) and pass --model DIR"
            );
        }
        bail!("{model_id}{at} has no model.safetensors");
    }
    let mut dir = None;
    for f in WANTED.iter().copied().filter(|f| has(f)) {
        let path = repo
            .get(f)
            .with_context(|| format!("cannot fetch {f} of {model_id}"))?;
        dir = path.parent().map(PathBuf::from);
    }
    let dir = dir.context("nothing fetched")?;
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let shards = crate::checkpoint::hf::shard_names(&index)?;
        for shard in shards {
            if !has(&shard) {
                bail!(
                    "{}: lists {shard:?}, which {model_id} does not have",
                    index.display()
                );
            }
            repo.get(&shard)
                .with_context(|| format!("cannot fetch {shard} of {model_id}"))?;
        }
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_ids_are_checked() {
        assert!(check_model_id("nlpconnect/vit-gpt2-image-captioning").is_ok());
        assert!(check_model_id("gpt2").is_ok());
        for bad in ["../etc", "a/b/c", "", "org/", "org/na me", "org/.."] {
            assert!(check_model_id(bad).is_err(), "{bad}");
        }
        for good in ["main", "refs/pr/12", "v1.0", "0123abcd"] {
            assert!(check_revision(good).is_ok(), "{good}");
        }
        for bad in ["", "../x", "/abs", "a b", "refs/pr/1;rm"] {
            let err = check_revision(bad).map_err(|e| e.to_string());
            assert!(
                err.as_ref().is_err_and(|e| e.contains("--revision")),
                "{bad}: {err:?}"
            );
        }
    }

    #[test]
    fn no_network_is_a_clear_error() {
        // Nothing listens on this port: the fetch fails without hanging.
        std::env::set_var("HF_ENDPOINT", "http://127.0.0.1:9");
        std::env::set_var("HF_HOME", std::env::temp_dir().join("vl-hub-test-empty"));
        let err = format!("{:#}", fetch("org/absent-model", None).unwrap_err());
        assert!(
            err.contains("org/absent-model") && err.contains("cache"),
            "{err}"
        );
    }
}
