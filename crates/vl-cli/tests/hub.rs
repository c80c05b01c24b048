//! `vl caption --model-id ... --revision ...` against a Hub on loopback
//! (the repository's `tests/hub_fixture`), pointed at it as a user would:
//! `HF_ENDPOINT` and `HF_HOME`.
#![cfg(feature = "hub")]
#![allow(missing_docs)]

mod common;
#[path = "../../../tests/hub_fixture/mod.rs"]
mod hub_fixture;

use std::path::Path;
use std::process::Output;

use common::{caption_cmd, ok, repo_root, s};
use hub_fixture::{within, FixtureHub, Revision};

const REPO: &str = "vl-test/captioner";

/// `vl caption ARGS`, with the Hub at `endpoint` and its cache in `home`.
fn caption(endpoint: &str, home: &Path, args: &[&str]) -> Output {
    caption_cmd()
        .args(args)
        .env("HF_ENDPOINT", endpoint)
        .env("HF_HOME", home)
        .output()
        .expect("run vl")
}

/// The `caption` and `token_ids` of each JSON line of `stdout`.
fn captions(stdout: &str) -> Vec<(serde_json::Value, serde_json::Value)> {
    stdout
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json line"))
        .map(|v| (v["caption"].clone(), v["token_ids"].clone()))
        .collect()
}

#[test]
fn caption_fetches_a_revision_from_the_hub() {
    within(|| {
        let narrow = repo_root().join("tests/fixtures/hf/narrow");
        let mut names: Vec<String> = std::fs::read_dir(&narrow)
            .expect("narrow fixture")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with("expected") && n != "image.png")
            .collect();
        names.sort();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let pr = Revision::new(REPO, "refs/pr/1").with_files_of(&narrow, &names);
        let main = Revision::new(REPO, "main")
            .with_files_of(&narrow, &["config.json"])
            .with_file("pytorch_model.bin", "not loaded");
        let server = FixtureHub::start(vec![main, pr.clone()]);
        let home = tempfile::tempdir().expect("tmp");
        let image = narrow.join("image.png");
        let flags = ["--json", "--max-tokens", "4", s(&image)];

        // The pull request's safetensors, as --revision names them: the
        // same captions as the directory itself.
        let mut args = vec!["--model-id", REPO, "--revision", "refs/pr/1"];
        args.extend(flags);
        let fetched = ok(&caption(server.url(), home.path(), &args));
        let mut args = vec!["--model", s(&narrow)];
        args.extend(flags);
        let local = ok(&caption_cmd().args(&args).output().expect("run vl"));
        assert_eq!(captions(&fetched), captions(&local));
        assert_eq!(captions(&fetched).len(), 1);
        let snapshot = home
            .path()
            .join("hub/models--vl-test--captioner/snapshots")
            .join(pr.commit());
        assert!(snapshot.join("model.safetensors.index.json").is_file());

        // main has only pickled weights, and an unknown repository is
        // named: exit 2, one line on stderr.
        for (args, words) in [
            (
                vec!["--model-id", REPO],
                ["vl-test/captioner at main", "pytorch_model.bin"],
            ),
            (
                vec!["--model-id", "vl-test/absent"],
                ["vl-test/absent", "no such repository"],
            ),
        ] {
            let mut args = args;
            args.push(s(&image));
            let out = caption(server.url(), home.path(), &args);
            assert_eq!(out.status.code(), Some(2));
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.lines().count() == 1, "{err}");
            for word in words {
                assert!(err.contains(word), "{word:?} not in: {err}");
            }
        }
    })
}
