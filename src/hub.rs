//! Fetching a checkpoint from the Hugging Face Hub (cargo feature `hub`),
//! through the hf-hub crate into its usual cache (`$HF_HOME/hub`, by
//! default `~/.cache/huggingface/hub`), so files shared with Python's
//! `huggingface_hub` are not downloaded twice.
//!
//! Only the files the loader reads are fetched: the configs, the tokenizer
//! and the safetensors weights. A repository with only pickled weights is
//! refused before anything large is downloaded.
//!
//! Each fetch asks the Hub once which commit the revision names and which
//! files it has; files of that commit already in the cache are not asked
//! for again. An interrupted download is resumed where it stopped, up to
//! [`RETRIES`] times, and otherwise by the next fetch: a file enters the
//! snapshot only once complete. When the Hub cannot be reached, the
//! snapshot the revision named last is used as it is.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context};
use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Cache, Repo, RepoType};

/// The Hub's address when `HF_ENDPOINT` does not name another.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// How many times a download that breaks off is resumed before the fetch
/// gives up (the next fetch resumes it again).
pub const RETRIES: usize = 3;

/// The revision fetched when none is named.
const DEFAULT_REVISION: &str = "main";

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

const CONFIG: &str = "config.json";
const WEIGHTS: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

/// Where checkpoints come from and where they are kept.
#[derive(Clone, Debug)]
pub struct Hub {
    endpoint: String,
    cache_dir: PathBuf,
    retries: usize,
    progress: bool,
}

impl Hub {
    /// The Hub at `endpoint` (e.g. `https://huggingface.co`), caching into
    /// `cache_dir` (the `hub` folder: `$HF_HOME/hub`); [`RETRIES`]
    /// resumptions, no progress bars.
    pub fn new(endpoint: impl Into<String>, cache_dir: impl Into<PathBuf>) -> Self {
        let endpoint: String = endpoint.into();
        Self {
            endpoint: endpoint.trim_end_matches('/').to_string(),
            cache_dir: cache_dir.into(),
            retries: RETRIES,
            progress: false,
        }
    }

    /// What Python's `huggingface_hub` reads: the endpoint `HF_ENDPOINT`
    /// (default [`DEFAULT_ENDPOINT`]) and the cache `$HF_HOME/hub` (default
    /// `~/.cache/huggingface/hub`); progress bars when stderr is a terminal.
    pub fn from_env() -> anyhow::Result<Self> {
        let endpoint = std::env::var("HF_ENDPOINT")
            .ok()
            .filter(|e| !e.is_empty())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        let home = match std::env::var_os("HF_HOME").filter(|h| !h.is_empty()) {
            Some(home) => PathBuf::from(home),
            None => std::env::home_dir()
                .context("no home directory for the Hugging Face cache: set HF_HOME")?
                .join(".cache/huggingface"),
        };
        let progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
        Ok(Self::new(endpoint, home.join("hub")).with_progress(progress))
    }

    /// How many times a broken-off download is resumed within one fetch.
    pub fn with_retries(mut self, retries: usize) -> Self {
        self.retries = retries;
        self
    }

    /// Whether downloads draw progress bars on stderr.
    pub fn with_progress(mut self, progress: bool) -> Self {
        self.progress = progress;
        self
    }

    /// The Hub's address.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The cache (`$HF_HOME/hub`).
    pub fn cache_dir(&self) -> &Path {
        &self.cache_dir
    }

    /// Downloads (or finds in the cache) the files of `model_id` at
    /// `revision` (a branch, tag or commit; `None` = `main`) and returns the
    /// local snapshot directory. Some repositories keep their safetensors
    /// on a pull-request branch (`refs/pr/N`): pass that as the revision.
    pub fn fetch(&self, model_id: &str, revision: Option<&str>) -> anyhow::Result<PathBuf> {
        check_model_id(model_id)?;
        let revision = revision.unwrap_or(DEFAULT_REVISION);
        check_revision(revision)?;
        let repo = Repo::with_revision(model_id.into(), RepoType::Model, revision.into());
        let what = format!("{model_id} at {revision}");
        let cache = Cache::new(self.cache_dir.clone());
        let api = ApiBuilder::from_cache(cache.clone())
            .with_endpoint(self.endpoint.clone())
            .with_retries(self.retries)
            .with_progress(self.progress)
            .build()
            .context("cannot set up the Hugging Face Hub client")?;
        let remote = api.repo(repo.clone());
        let info = match remote.info() {
            Ok(info) => info,
            Err(e) => return self.unavailable(&e, model_id, revision, &repo),
        };
        let has = |f: &str| info.siblings.iter().any(|s| s.rfilename == f);
        if !has(CONFIG) {
            bail!("{what} has no {CONFIG}: not a transformers or vl checkpoint");
        }
        if !has(WEIGHTS) && !has(INDEX) {
            if has("pytorch_model.bin") {
                bail!(
                    "{what} has only pytorch_model.bin (pickle, never loaded); \
                     its safetensors may live on a pull-request branch (--revision refs/pr/N), \
                     or convert it once (see the README) and pass --model DIR"
                );
            }
            bail!("{what} has no {WEIGHTS}");
        }
        let snapshot = self
            .cache_dir
            .join(repo.folder_name())
            .join("snapshots")
            .join(&info.sha);
        for f in WANTED.iter().copied().filter(|f| has(f)) {
            fetch_file(&remote, &snapshot, f, &what)?;
        }
        let index = snapshot.join(INDEX);
        if index.is_file() {
            for shard in crate::checkpoint::hf::shard_names(&index)? {
                if !has(&shard) {
                    bail!("{INDEX} of {what} lists {shard:?}, which the repository does not have");
                }
                fetch_file(&remote, &snapshot, &shard, &what)?;
            }
        }
        // The revision names this commit now, also when every file was
        // already here: the offline fallback finds the newest snapshot.
        cache
            .repo(repo)
            .create_ref(&info.sha)
            .with_context(|| format!("cannot record {what} in {}", self.cache_dir.display()))?;
        Ok(snapshot)
    }

    /// The answer when the Hub does not list the revision: its refusal, or
    /// (the Hub unreachable) the snapshot the revision named last.
    fn unavailable(
        &self,
        e: &ApiError,
        model_id: &str,
        revision: &str,
        repo: &Repo,
    ) -> anyhow::Result<PathBuf> {
        let endpoint = &self.endpoint;
        match refusal(e) {
            Some(Refusal::Repository) => bail!(
                "{model_id}: no such repository on {endpoint}, or it is private or gated \
                 (vl sends the token of `huggingface-cli login`) ({e})"
            ),
            Some(Refusal::Revision) => {
                bail!("{model_id} has no revision {revision:?} on {endpoint} ({e})")
            }
            None => {}
        }
        let cached = Cache::new(self.cache_dir.clone())
            .repo(repo.clone())
            .get(CONFIG)
            .and_then(|p| p.parent().map(PathBuf::from));
        match cached {
            Some(dir) if complete(&dir) => {
                tracing::warn!(
                    "cannot reach {endpoint} ({e}); using the cached {}",
                    dir.display()
                );
                Ok(dir)
            }
            Some(dir) => bail!(
                "cannot fetch {model_id} at {revision} from {endpoint} ({e}), and the cache holds \
                 only part of it ({}): run again with the network to finish the download",
                dir.display()
            ),
            None => bail!(
                "cannot fetch {model_id} at {revision} from {endpoint} ({e}), and it is not in the \
                 cache {}; check the network (or HF_ENDPOINT), or download the directory and pass \
                 --model DIR",
                self.cache_dir.display()
            ),
        }
    }
}

/// Downloads (or finds in the cache) the files of `model_id` at `revision`
/// with [`Hub::from_env`]: see [`Hub::fetch`].
pub fn fetch(model_id: &str, revision: Option<&str>) -> anyhow::Result<PathBuf> {
    Hub::from_env()?.fetch(model_id, revision)
}

/// Puts `file` of `remote` into `snapshot` unless it is there already.
fn fetch_file(remote: &ApiRepo, snapshot: &Path, file: &str, what: &str) -> anyhow::Result<()> {
    let want = snapshot.join(file);
    // A snapshot's entries link to complete blobs only (a download grows
    // in `blobs/<etag>.part` and is renamed when done).
    if want.is_file() {
        return Ok(());
    }
    let got = remote.download(file).map_err(|e| {
        let hint = match &e {
            ApiError::IoError(_) | ApiError::TooManyRetries(_) => {
                "; what arrived is kept, and the next fetch resumes it"
            }
            _ => "",
        };
        match status(&e) {
            Some((404, _)) => anyhow!("{what} has no file {file} ({e})"),
            _ => anyhow!("cannot fetch {file} of {what}: {e}{hint}"),
        }
    })?;
    if got != want {
        bail!(
            "{what} moved to another commit while {file} was fetched ({}); run again",
            got.display()
        );
    }
    Ok(())
}

/// Why the Hub refused to list a revision.
enum Refusal {
    /// No such repository (or one this client may not see).
    Repository,
    /// The repository has no such branch, tag or commit.
    Revision,
}

/// The HTTP status of a request the Hub answered, and its `x-error-code`.
fn status(e: &ApiError) -> Option<(u16, Option<String>)> {
    match e {
        ApiError::RequestError(e) => match e.as_ref() {
            ureq::Error::Status(code, response) => {
                Some((*code, response.header("x-error-code").map(str::to_string)))
            }
            ureq::Error::Transport(_) => None,
        },
        _ => None,
    }
}

/// The refusal `e` carries, if the Hub answered one (as
/// `huggingface_hub` reads it: anonymous clients get 401 for a repository
/// that does not exist).
fn refusal(e: &ApiError) -> Option<Refusal> {
    let (code, error_code) = status(e)?;
    match (code, error_code.as_deref()) {
        (_, Some("RevisionNotFound")) => Some(Refusal::Revision),
        (_, Some("RepositoryNotFound" | "GatedRepo")) | (401 | 403 | 404, _) => {
            Some(Refusal::Repository)
        }
        _ => None,
    }
}

/// Whether `dir` holds a config and all its weights.
fn complete(dir: &Path) -> bool {
    if !dir.join(CONFIG).is_file() {
        return false;
    }
    if dir.join(WEIGHTS).is_file() {
        return true;
    }
    crate::checkpoint::hf::shard_names(&dir.join(INDEX))
        .is_ok_and(|shards| shards.iter().all(|s| dir.join(s).is_file()))
}

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
