//! Nougat's post-processing against transformers'
//! `NougatTokenizer.post_process_generation` on crafted generations
//! (`scripts/nougat_fixtures.py`: every rule, with and without
//! `fix_markdown`, Unicode text, transformers' branch for the missing nltk
//! words corpus). Outputs must be equal, character for character.
#![allow(missing_docs)]

use vl::nougat::post_process;

#[derive(serde::Deserialize)]
struct Case {
    name: String,
    input: String,
    fix_markdown: String,
    no_fix_markdown: String,
}

#[derive(serde::Deserialize)]
struct Cases {
    nltk_words_corpus: bool,
    cases: Vec<Case>,
}

#[test]
fn post_processing_equals_transformers() -> anyhow::Result<()> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/nougat_post/cases.json");
    let cases: Cases = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    assert!(!cases.nltk_words_corpus, "fixtures of the no-corpus branch");
    assert!(cases.cases.len() >= 40);
    let mut failed = Vec::new();
    for c in &cases.cases {
        for (fix, want) in [(true, &c.fix_markdown), (false, &c.no_fix_markdown)] {
            let got = post_process(&c.input, fix);
            if &got != want {
                failed.push(format!(
                    "{} (fix_markdown {fix}):\n  input {:?}\n  want  {want:?}\n  got   {got:?}",
                    c.name, c.input
                ));
            }
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} differ:\n{}",
        failed.len(),
        2 * cases.cases.len(),
        failed.join("\n")
    );
    Ok(())
}
