//! Donut's tag sequences as JSON equal transformers'
//! `DonutProcessor.token2json` on crafted outputs (nesting, lists,
//! categorical tokens, unclosed and case-mixed tags, text without tags,
//! repeated keys, regex metacharacters in keys), key order included
//! (`scripts/donut_fixtures.py` writes the fixture).
#![allow(missing_docs)]

use std::collections::HashSet;

use vl::donut::{token2json, DonutValue};

#[derive(serde::Deserialize)]
struct Fixture {
    added_vocab: Vec<String>,
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    tokens: String,
    text: String,
}

#[test]
fn token2json_equals_transformers() -> anyhow::Result<()> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/donut/token2json.json");
    let f: Fixture = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    let added: HashSet<String> = f.added_vocab.into_iter().collect();
    assert!(f.cases.len() >= 15);
    for case in &f.cases {
        let got = serde_json::to_string(&token2json(&case.tokens, &added))?;
        assert_eq!(got, case.text, "tokens {:?}", case.tokens);
    }
    Ok(())
}

#[test]
fn objects_keep_their_order_and_nest() {
    let added = HashSet::new();
    let v = token2json(
        "<s_b>1</s_b><s_a><s_x>2</s_x><sep/><s_x>3</s_x></s_a>",
        &added,
    );
    let want = DonutValue::Object(vec![
        ("b".into(), DonutValue::Text("1".into())),
        (
            "a".into(),
            DonutValue::List(vec![
                DonutValue::Object(vec![("x".into(), DonutValue::Text("2".into()))]),
                DonutValue::Object(vec![("x".into(), DonutValue::Text("3".into()))]),
            ]),
        ),
    ]);
    assert_eq!(v, want);
}
