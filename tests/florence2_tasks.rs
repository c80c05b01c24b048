//! Florence-2's prompts and post-processing against transformers'
//! `Florence2Processor` on `tests/fixtures/florence2/tasks.json`
//! (`scripts/florence2_fixtures.py`): every task's prompt and its ids,
//! and every crafted generation parsed as `post_process_generation(text=…)`
//! parses it — equal, not close: the outputs are integers and strings.

use std::path::Path;

use serde_json::Value;
use vl::tasks::{parse, Task, TaskConfig};

fn fixtures() -> &'static Path {
    Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/florence2"
    ))
}

fn tasks_json() -> anyhow::Result<Value> {
    Ok(serde_json::from_str(&std::fs::read_to_string(
        fixtures().join("tasks.json"),
    )?)?)
}

fn tiny_a_config() -> anyhow::Result<TaskConfig> {
    let p: Value = serde_json::from_str(&std::fs::read_to_string(
        fixtures().join("tiny-a/processor_config.json"),
    )?)?;
    Ok(TaskConfig::from_post_processor(
        &p["post_processor_config"],
    )?)
}

fn tokenizer() -> anyhow::Result<tokenizers::Tokenizer> {
    tokenizers::Tokenizer::from_file(fixtures().join("tiny-a/tokenizer.json"))
        .map_err(|e| anyhow::anyhow!("{e}"))
}

fn image_size(t: &Value) -> (u32, u32) {
    let s = &t["image_size"];
    (s[0].as_u64().unwrap() as u32, s[1].as_u64().unwrap() as u32)
}

/// Each of the 15 tasks builds the processor's prompt from the same
/// input, and `<s>` prompt `</s>` tokenizes to the processor's ids.
#[test]
fn prompts_and_ids_are_the_processors() -> anyhow::Result<()> {
    let t = tasks_json()?;
    let tok = tokenizer()?;
    let cases = t["tasks"].as_array().unwrap();
    assert_eq!(cases.len(), Task::ALL.len());
    for c in cases {
        let task: Task = c["task"].as_str().unwrap().parse()?;
        let prompt = task.prompt(c["text_input"].as_str())?;
        assert_eq!(prompt, c["prompt"].as_str().unwrap(), "{task}");
        let ids = tok
            .encode(format!("<s>{prompt}</s>"), false)
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .get_ids()
            .to_vec();
        let want: Vec<u32> = serde_json::from_value(c["input_ids"].clone())?;
        assert_eq!(ids, want, "{task}");
        assert_eq!(task.takes_input(), c["text_input"].is_string(), "{task}");
    }
    Ok(())
}

/// Every crafted generation parses to the processor's output for its
/// task, from the text decoded with special tokens as users pass it.
#[test]
fn post_processing_is_the_processors() -> anyhow::Result<()> {
    let t = tasks_json()?;
    let cfg = tiny_a_config()?;
    let size = image_size(&t);
    let tok = tokenizer()?;
    let mut checked = 0;
    for c in t["cases"].as_array().unwrap() {
        let name = c["name"].as_str().unwrap();
        let Ok(task) = c["task"].as_str().unwrap().parse::<Task>() else {
            // The processor parses an unknown task as plain text; vl's
            // tasks are an enum, so there is no unknown task to pass.
            continue;
        };
        let ids: Vec<u32> = serde_json::from_value(c["sequence"].clone())?;
        let text = tok
            .decode(&ids, false)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        assert_eq!(text, c["text"].as_str().unwrap(), "{name}: decoded text");
        let got = serde_json::to_value(parse(&text, task, size, &cfg))?;
        assert_eq!(got, c["from_text"], "{name} ({task})");
        checked += 1;
    }
    assert!(checked >= 25, "only {checked} cases checked");
    Ok(())
}

/// The OCR area threshold drops small quadrilaterals as the processor's
/// (three-edge) shoelace area does.
#[test]
fn ocr_area_threshold_is_the_processors() -> anyhow::Result<()> {
    let t = tasks_json()?;
    let a = &t["area_threshold"];
    let cfg = TaskConfig::from_post_processor(&a["config"])?;
    assert!(cfg.ocr_area_threshold > 0.0);
    let tok = tokenizer()?;
    for c in a["cases"].as_array().unwrap() {
        let ids: Vec<u32> = serde_json::from_value(c["sequence"].clone())?;
        let text = tok
            .decode(&ids, false)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let got = parse(&text, Task::OcrWithRegion, image_size(&t), &cfg);
        let want: Vec<(Vec<i32>, String)> = c["ocr"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| {
                (
                    serde_json::from_value(i["quad_box"].clone()).unwrap(),
                    i["text"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        let vl::tasks::TaskOutput::Quads { quad_boxes, labels } = got else {
            panic!("OCR with regions gives quadrilaterals");
        };
        let got: Vec<(Vec<i32>, String)> =
            quad_boxes.iter().map(|q| q.to_vec()).zip(labels).collect();
        assert_eq!(got, want, "{}", c["name"]);
    }
    Ok(())
}

/// Task names and inputs are checked, naming the culprit.
#[test]
fn bad_tasks_and_inputs_are_named() {
    let err = "segment".parse::<Task>().unwrap_err().to_string();
    assert!(
        err.contains("unknown task \"segment\"") && err.contains("phrase-grounding"),
        "{err}"
    );
    let err = Task::PhraseGrounding.prompt(None).unwrap_err().to_string();
    assert!(
        err.contains("text") && err.contains("needs a text input"),
        "{err}"
    );
    let err = Task::Od.prompt(Some("a dog")).unwrap_err().to_string();
    assert!(err.contains("takes no text input"), "{err}");
    assert_eq!("<OD>".parse::<Task>().unwrap(), Task::Od);
    assert_eq!("od".parse::<Task>().unwrap(), Task::Od);
    let bad = serde_json::json!({"ocr": {"PATTERN": "(unclosed"}});
    let err = TaskConfig::from_post_processor(&bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("ocr.PATTERN"), "{err}");
}
