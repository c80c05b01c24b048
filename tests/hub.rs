//! `vl::hub` against a Hub on loopback (`hub_fixture`) that serves two of
//! the parity fixtures as a repository: `main` is `tests/fixtures/hf/equal`
//! (one `model.safetensors`), `refs/pr/1` is `tests/fixtures/hf/narrow`
//! (eleven shards and their index). Download then load, the cache on the
//! second fetch, revisions, refusals naming what is missing, and a download
//! broken off halfway; the checks of model ids and revisions.
#![cfg(feature = "hub")]
#![allow(missing_docs)]

mod hub_fixture;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use hub_fixture::{etag, within, FixtureHub, Logged, Revision};
use vl::hub::{check_model_id, check_revision, Hub};
use vl::ModelFormat;

const REPO: &str = "vl-test/captioner";
/// What `hub::fetch` reads of `equal` (the fixture's expected outputs and
/// image are not part of the repository).
const EQUAL: &[&str] = &[
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "tokenizer.json",
    "model.safetensors",
];

fn fixture(kind: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(kind)
}

/// The checkpoint files of `narrow`: configs, tokenizer, index, shards.
fn narrow_files() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(fixture("narrow"))
        .expect("narrow fixture")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with("expected") && n != "image.png")
        .collect();
    names.sort();
    names
}

fn main_revision() -> Revision {
    Revision::new(REPO, "main")
        .with_files_of(&fixture("equal"), EQUAL)
        .with_file("README.md", "A repository that only vl's tests serve.")
}

fn pr_revision() -> Revision {
    let names = narrow_files();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    Revision::new(REPO, "refs/pr/1").with_files_of(&fixture("narrow"), &names)
}

/// The cache's folder for `REPO`.
fn repo_cache(cache: &Path) -> PathBuf {
    cache.join("models--vl-test--captioner")
}

/// Asserts that `dir` holds each of `names` with the bytes of `from`'s.
fn assert_same_files(dir: &Path, from: &Path, names: &[&str]) {
    for name in names {
        let got = std::fs::read(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let want = std::fs::read(from.join(name)).expect("fixture file");
        assert!(
            got == want,
            "{name}: the cached bytes differ from the fixture's"
        );
    }
}

fn paths(requests: &[Logged]) -> Vec<&str> {
    requests.iter().map(|r| r.path.as_str()).collect()
}

#[test]
fn downloads_once_then_serves_from_the_cache() -> anyhow::Result<()> {
    within(|| {
        let cache = tempfile::tempdir()?;
        let mut server = FixtureHub::start(vec![main_revision()]);
        let hub = Hub::new(server.url(), cache.path());

        // First fetch: the listing, then every file the loader reads (the
        // weights through the CDN redirect); not the README.
        let dir = hub.fetch(REPO, None)?;
        let commit = main_revision().commit();
        assert_eq!(
            dir,
            repo_cache(cache.path()).join("snapshots").join(&commit)
        );
        assert_same_files(&dir, &fixture("equal"), EQUAL);
        assert!(!dir.join("README.md").exists());
        let model = vl::load(&dir, &vl::LoadOptions::new(DType::F32, &Device::Cpu))?;
        assert_eq!(model.format, ModelFormat::VisionEncoderDecoder);
        let first = server.take_requests();
        for name in EQUAL {
            let resolve = format!("/{REPO}/resolve/main/{name}");
            assert!(paths(&first).contains(&resolve.as_str()), "{first:?}");
        }
        assert!(first.iter().any(|r| r.path.starts_with("/blobs/")));
        assert!(!first.iter().any(|r| r.path.ends_with("README.md")));

        // Second fetch: one small request (which commit is main?), no file.
        assert_eq!(hub.fetch(REPO, None)?, dir);
        let second = server.take_requests();
        assert_eq!(
            paths(&second),
            [format!("/api/models/{REPO}/revision/main").as_str()]
        );
        let recorded = std::fs::read_to_string(repo_cache(cache.path()).join("refs/main"))?;
        assert_eq!(recorded, commit);

        // The Hub gone: the cached snapshot as it is, and a clear error for
        // a repository that was never fetched.
        server.stop();
        assert_eq!(hub.fetch(REPO, None)?, dir);
        vl::load(&dir, &vl::LoadOptions::new(DType::F32, &Device::Cpu))?;
        let err = format!("{:#}", hub.fetch("vl-test/other", None).unwrap_err());
        assert!(
            err.contains("vl-test/other at main") && err.contains("not in the cache"),
            "{err}"
        );
        Ok(())
    })
}

#[test]
fn a_revision_is_fetched_as_its_own_commit() -> anyhow::Result<()> {
    within(|| {
        let cache = tempfile::tempdir()?;
        let server = FixtureHub::start(vec![main_revision(), pr_revision()]);
        let hub = Hub::new(server.url(), cache.path());

        let main = hub.fetch(REPO, None)?;
        let pr = hub.fetch(REPO, Some("refs/pr/1"))?;
        let pr_commit = pr_revision().commit();
        assert_eq!(
            pr,
            repo_cache(cache.path()).join("snapshots").join(&pr_commit)
        );
        assert_ne!(main, pr);
        let names = narrow_files();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        assert_same_files(&pr, &fixture("narrow"), &names);
        assert!(!pr.join("model.safetensors").exists());
        // The branch's `/` travels escaped, as on the Hub.
        let requests = server.take_requests();
        assert!(
            paths(&requests)
                .contains(&format!("/{REPO}/resolve/refs%2Fpr%2F1/config.json").as_str()),
            "{requests:?}"
        );

        // Two different checkpoints: the GPT-2 is 32 wide on main, 48 on
        // the pull request.
        let on_main = vl::load(&main, &vl::LoadOptions::new(DType::F32, &Device::Cpu))?;
        let on_pr = vl::load(&pr, &vl::LoadOptions::new(DType::F32, &Device::Cpu))?;
        assert_eq!(on_main.config.decoder.hidden_size, 32);
        assert_eq!(on_pr.config.decoder.hidden_size, 48);
        let refs = repo_cache(cache.path()).join("refs");
        assert_eq!(std::fs::read_to_string(refs.join("refs/pr/1"))?, pr_commit);

        // The commit itself as the revision: the same snapshot, nothing
        // downloaded again.
        assert_eq!(hub.fetch(REPO, Some(&pr_commit))?, pr);
        let again = server.take_requests();
        assert!(
            again.iter().all(|r| r.path.starts_with("/api/")),
            "{again:?}"
        );
        Ok(())
    })
}

#[test]
fn what_is_missing_is_named() -> anyhow::Result<()> {
    within(|| {
        let cache = tempfile::tempdir()?;
        let lost_shard = "model-00003-of-00011.safetensors";
        let mut shards = narrow_files();
        shards.retain(|n| n != lost_shard);
        let shards: Vec<&str> = shards.iter().map(String::as_str).collect();
        let no_tokenizer: Vec<&str> = EQUAL
            .iter()
            .copied()
            .filter(|n| *n != "tokenizer.json")
            .collect();
        let server = FixtureHub::start(vec![
            main_revision(),
            Revision::new("vl-test/pickle-only", "main")
                .with_files_of(&fixture("equal"), &["config.json"])
                .with_file("pytorch_model.bin", "not loaded"),
            Revision::new("vl-test/lost-shard", "main").with_files_of(&fixture("narrow"), &shards),
            Revision::new("vl-test/lost-file", "main")
                .with_files_of(&fixture("equal"), &no_tokenizer)
                .with_listed_only("tokenizer.json"),
        ]);
        let hub = Hub::new(server.url(), cache.path());
        let cases: &[(&str, Option<&str>, &[&str])] = &[
            (
                "vl-test/absent",
                None,
                &["vl-test/absent", "no such repository"],
            ),
            (REPO, Some("v9"), &[REPO, "no revision \"v9\""]),
            (
                "vl-test/pickle-only",
                None,
                &["vl-test/pickle-only at main", "only pytorch_model.bin"],
            ),
            (
                "vl-test/lost-shard",
                None,
                &["vl-test/lost-shard at main", lost_shard],
            ),
            (
                "vl-test/lost-file",
                None,
                &["vl-test/lost-file at main", "no file tokenizer.json"],
            ),
        ];
        for (repo, revision, words) in cases {
            let err = match hub.fetch(repo, *revision) {
                Ok(dir) => panic!("{repo}: fetched {}", dir.display()),
                Err(e) => format!("{e:#}"),
            };
            for word in *words {
                assert!(err.contains(word), "{repo}: {word:?} not in: {err}");
            }
        }
        Ok(())
    })
}

#[test]
fn an_interrupted_download_resumes_where_it_stopped() -> anyhow::Result<()> {
    within(|| {
        let cache = tempfile::tempdir()?;
        let server = FixtureHub::start(vec![main_revision()]);
        let weights = std::fs::read(fixture("equal").join("model.safetensors"))?;
        let half = weights.len() / 2;
        let snapshot = repo_cache(cache.path())
            .join("snapshots")
            .join(main_revision().commit());

        // No retries: the fetch fails, naming the file, and the half that
        // arrived stays out of the snapshot.
        let once = Hub::new(server.url(), cache.path()).with_retries(0);
        server.interrupt_once(&weights);
        let err = format!("{:#}", once.fetch(REPO, None).unwrap_err());
        assert!(
            err.contains("model.safetensors of vl-test/captioner at main")
                && err.contains("resumes"),
            "{err}"
        );
        assert!(!snapshot.join("model.safetensors").exists());
        let part = repo_cache(cache.path())
            .join("blobs")
            .join(format!("{}.part", etag(&weights)));
        assert_eq!(std::fs::metadata(&part)?.len(), half as u64);

        // Offline, the half-fetched snapshot is not handed out.
        let offline = Hub::new("http://127.0.0.1:9", cache.path());
        let err = format!("{:#}", offline.fetch(REPO, None).unwrap_err());
        assert!(err.contains("only part of it"), "{err}");

        // The next fetch asks for the rest only.
        server.take_requests();
        let dir = once.fetch(REPO, None)?;
        assert_same_files(&dir, &fixture("equal"), EQUAL);
        vl::load(&dir, &vl::LoadOptions::new(DType::F32, &Device::Cpu))?;
        let resumed = server.take_requests();
        let rest = format!("bytes={half}-");
        assert!(
            resumed
                .iter()
                .any(|r| r.path.starts_with("/blobs/") && r.range.as_deref() == Some(&rest)),
            "{resumed:?}"
        );

        // With retries (the default), one fetch gets through on its own.
        let fresh = tempfile::tempdir()?;
        server.interrupt_once(&weights);
        let dir = Hub::new(server.url(), fresh.path()).fetch(REPO, None)?;
        assert_same_files(&dir, &fixture("equal"), EQUAL);
        let retried = server.take_requests();
        assert!(
            retried.iter().any(|r| r.range.as_deref() == Some(&rest)),
            "{retried:?}"
        );
        Ok(())
    })
}

#[test]
fn model_ids_and_revisions_are_checked() {
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
