//! Florence-2's tasks: the prompt each task puts before the image's
//! caption, and the parsing of what the model generates into text, boxes,
//! quadrilaterals or polygons in the image's pixel coordinates —
//! transformers' `Florence2Processor` (`_construct_prompts`,
//! `post_process_generation`) and `Florence2PostProcessor`, ported with
//! their regular expressions as they are (quirks included: a label may
//! start inside a location token, as the processor's does).
//!
//! Locations are `<loc_N>` tokens, `N` in `0..1000`, one bin of the
//! image's width or height each; a bin maps back to the pixel at its
//! centre, truncated to an integer as the processor's `.int()` does.

use std::fmt;

use fancy_regex::Regex;
use serde::{Deserialize, Serialize};

use crate::error::{arg_err, Error, Result};

/// A Florence-2 task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Task {
    /// `<OCR>`: the text in the image.
    Ocr,
    /// `<OCR_WITH_REGION>`: the text in the image with quadrilaterals.
    OcrWithRegion,
    /// `<CAPTION>`.
    Caption,
    /// `<DETAILED_CAPTION>`.
    DetailedCaption,
    /// `<MORE_DETAILED_CAPTION>`.
    MoreDetailedCaption,
    /// `<OD>`: object detection, boxes with category names.
    Od,
    /// `<DENSE_REGION_CAPTION>`: boxes with descriptions.
    DenseRegionCaption,
    /// `<REGION_PROPOSAL>`: boxes without labels.
    RegionProposal,
    /// `<CAPTION_TO_PHRASE_GROUNDING>`: boxes of the phrases of a caption.
    PhraseGrounding,
    /// `<REFERRING_EXPRESSION_SEGMENTATION>`: polygons of an expression.
    ReferringExpressionSegmentation,
    /// `<REGION_TO_SEGMENTATION>`: polygons of a region.
    RegionToSegmentation,
    /// `<OPEN_VOCABULARY_DETECTION>`: boxes or polygons of a named object.
    OpenVocabularyDetection,
    /// `<REGION_TO_CATEGORY>`: the category of a region.
    RegionToCategory,
    /// `<REGION_TO_DESCRIPTION>`: a description of a region.
    RegionToDescription,
    /// `<REGION_TO_OCR>`: the text in a region.
    RegionToOcr,
}

/// How a task's output is parsed (the processor's post-processing types).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParseKind {
    /// Text, `<s>` and `</s>` removed.
    PureText,
    /// Quadrilaterals with their text.
    Ocr,
    /// Boxes with labels (a phrase before each run of boxes).
    DescriptionWithBboxes,
    /// Boxes, labels allowed to be empty.
    Bboxes,
    /// Boxes of grounded phrases.
    PhraseGrounding,
    /// Polygons, labels allowed to be empty.
    Polygons,
    /// Polygons when the text has `<poly>`, boxes otherwise.
    DescriptionWithBboxesOrPolygons,
}

impl Task {
    /// Every task, in the processor's order.
    pub const ALL: [Task; 15] = [
        Task::Ocr,
        Task::OcrWithRegion,
        Task::Caption,
        Task::DetailedCaption,
        Task::MoreDetailedCaption,
        Task::Od,
        Task::DenseRegionCaption,
        Task::RegionProposal,
        Task::PhraseGrounding,
        Task::ReferringExpressionSegmentation,
        Task::RegionToSegmentation,
        Task::OpenVocabularyDetection,
        Task::RegionToCategory,
        Task::RegionToDescription,
        Task::RegionToOcr,
    ];

    /// The task token (`<CAPTION>`), the processor's key.
    pub fn token(self) -> &'static str {
        self.spec().0
    }

    /// vl's name of the task (`caption`, `ocr-with-region`), as
    /// `vl caption --task` takes it.
    pub fn name(self) -> &'static str {
        self.spec().1
    }

    /// The prompt template; `{input}` stands for the task's text input.
    pub fn template(self) -> &'static str {
        self.spec().2
    }

    /// How its output is parsed.
    pub fn kind(self) -> ParseKind {
        self.spec().3
    }

    /// Whether the task takes a text input (`--text`).
    pub fn takes_input(self) -> bool {
        self.template().contains("{input}")
    }

    fn spec(self) -> (&'static str, &'static str, &'static str, ParseKind) {
        use ParseKind as K;
        match self {
            Task::Ocr => (
                "<OCR>",
                "ocr",
                "What is the text in the image?",
                K::PureText,
            ),
            Task::OcrWithRegion => (
                "<OCR_WITH_REGION>",
                "ocr-with-region",
                "What is the text in the image, with regions?",
                K::Ocr,
            ),
            Task::Caption => (
                "<CAPTION>",
                "caption",
                "What does the image describe?",
                K::PureText,
            ),
            Task::DetailedCaption => (
                "<DETAILED_CAPTION>",
                "detailed-caption",
                "Describe in detail what is shown in the image.",
                K::PureText,
            ),
            Task::MoreDetailedCaption => (
                "<MORE_DETAILED_CAPTION>",
                "more-detailed-caption",
                "Describe with a paragraph what is shown in the image.",
                K::PureText,
            ),
            Task::Od => (
                "<OD>",
                "od",
                "Locate the objects with category name in the image.",
                K::DescriptionWithBboxes,
            ),
            Task::DenseRegionCaption => (
                "<DENSE_REGION_CAPTION>",
                "dense-region-caption",
                "Locate the objects in the image, with their descriptions.",
                K::DescriptionWithBboxes,
            ),
            Task::RegionProposal => (
                "<REGION_PROPOSAL>",
                "region-proposal",
                "Locate the region proposals in the image.",
                K::Bboxes,
            ),
            Task::PhraseGrounding => (
                "<CAPTION_TO_PHRASE_GROUNDING>",
                "phrase-grounding",
                "Locate the phrases in the caption: {input}",
                K::PhraseGrounding,
            ),
            Task::ReferringExpressionSegmentation => (
                "<REFERRING_EXPRESSION_SEGMENTATION>",
                "referring-expression-segmentation",
                "Locate {input} in the image with mask",
                K::Polygons,
            ),
            Task::RegionToSegmentation => (
                "<REGION_TO_SEGMENTATION>",
                "region-to-segmentation",
                "What is the polygon mask of region {input}",
                K::Polygons,
            ),
            Task::OpenVocabularyDetection => (
                "<OPEN_VOCABULARY_DETECTION>",
                "open-vocabulary-detection",
                "Locate {input} in the image.",
                K::DescriptionWithBboxesOrPolygons,
            ),
            Task::RegionToCategory => (
                "<REGION_TO_CATEGORY>",
                "region-to-category",
                "What is the region {input}?",
                K::PureText,
            ),
            Task::RegionToDescription => (
                "<REGION_TO_DESCRIPTION>",
                "region-to-description",
                "What does the region {input} describe?",
                K::PureText,
            ),
            Task::RegionToOcr => (
                "<REGION_TO_OCR>",
                "region-to-ocr",
                "What text is in the region {input}?",
                K::PureText,
            ),
        }
    }

    /// The prompt the processor builds for this task: the template, with
    /// `input` (trimmed) in place of `{input}`.
    ///
    /// # Errors
    /// [`Error::Argument`] naming `text` when a task that takes an input
    /// gets none (or only spaces), or one that takes none gets one.
    pub fn prompt(self, input: Option<&str>) -> Result<String> {
        let input = input.map(str::trim);
        match (self.takes_input(), input) {
            (true, Some(t)) if !t.is_empty() => Ok(self.template().replace("{input}", t)),
            (true, _) => arg_err(
                "text",
                format!(
                    "task {} ({}) needs a text input, e.g. {}",
                    self.name(),
                    self.token(),
                    self.example_input()
                ),
            ),
            (false, Some(t)) if !t.is_empty() => arg_err(
                "text",
                format!(
                    "task {} ({}) takes no text input, got {t:?}",
                    self.name(),
                    self.token()
                ),
            ),
            (false, _) => Ok(self.template().to_string()),
        }
    }

    fn example_input(self) -> &'static str {
        match self {
            Task::PhraseGrounding => "\"a dog and a red ball\"",
            Task::ReferringExpressionSegmentation | Task::OpenVocabularyDetection => "\"the dog\"",
            _ => "\"<loc_100><loc_200><loc_500><loc_700>\" (a box as location tokens)",
        }
    }
}

impl fmt::Display for Task {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Task {
    type Err = Error;

    /// A task by vl's name (`od`) or its token (`<OD>`).
    fn from_str(s: &str) -> Result<Self> {
        Task::ALL
            .into_iter()
            .find(|t| t.name() == s || t.token() == s)
            .ok_or_else(|| Error::Argument {
                arg: "task",
                reason: format!(
                    "unknown task {s:?}; the tasks: {}",
                    Task::ALL.map(Task::name).join(", ")
                ),
            })
    }
}

/// The post-processor's settings, from the checkpoint's
/// `processor_config.json` (`post_processor_config`), read as the
/// processor reads them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskConfig {
    /// Phrases phrase grounding drops (`phrase_grounding.banned_grounding_tokens`).
    #[serde(default)]
    pub banned_grounding_tokens: Vec<String>,
    /// The OCR pattern (`ocr.PATTERN`; the processor reads the upper-case
    /// key only, so checkpoints whose key is `pattern` get the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ocr_pattern: Option<String>,
    /// Quadrilaterals smaller than this fraction of the image are dropped
    /// (`ocr.AREA_THRESHOLD`, upper case as the processor reads it;
    /// default 0).
    #[serde(default)]
    pub ocr_area_threshold: f64,
}

impl Default for TaskConfig {
    fn default() -> Self {
        Self {
            banned_grounding_tokens: Vec::new(),
            ocr_pattern: None,
            ocr_area_threshold: 0.0,
        }
    }
}

/// The OCR pattern the processor uses when the config names none.
pub const DEFAULT_OCR_PATTERN: &str = r"(.+?)<loc_(\d+)><loc_(\d+)><loc_(\d+)><loc_(\d+)><loc_(\d+)><loc_(\d+)><loc_(\d+)><loc_(\d+)>";

impl TaskConfig {
    /// From `post_processor_config` (a `processor_config.json` key).
    ///
    /// # Errors
    /// [`Error::Config`] naming the field of the wrong type.
    pub fn from_post_processor(value: &serde_json::Value) -> Result<Self> {
        let field = |path: &[&str]| -> Option<&serde_json::Value> {
            path.iter().try_fold(value, |v, k| v.get(*k))
        };
        let banned = match field(&["phrase_grounding", "banned_grounding_tokens"]) {
            None | Some(serde_json::Value::Null) => Vec::new(),
            Some(v) => serde_json::from_value(v.clone()).map_err(|e| Error::Config {
                field: "post_processor_config.phrase_grounding.banned_grounding_tokens",
                reason: e.to_string(),
            })?,
        };
        let pattern = match field(&["ocr", "PATTERN"]) {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(v) => {
                return Err(Error::Config {
                    field: "post_processor_config.ocr.PATTERN",
                    reason: format!("expected a string, got {v}"),
                })
            }
        };
        let threshold = match field(&["ocr", "AREA_THRESHOLD"]) {
            None | Some(serde_json::Value::Null) => 0.0,
            Some(v) => v.as_f64().ok_or_else(|| Error::Config {
                field: "post_processor_config.ocr.AREA_THRESHOLD",
                reason: format!("expected a number, got {v}"),
            })?,
        };
        let cfg = Self {
            banned_grounding_tokens: banned,
            ocr_pattern: pattern,
            ocr_area_threshold: threshold,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Rejects an OCR pattern that is not a regular expression.
    ///
    /// # Errors
    /// [`Error::Config`] naming `post_processor_config.ocr.PATTERN`.
    pub fn validate(&self) -> Result<()> {
        if let Some(p) = &self.ocr_pattern {
            Regex::new(p).map_err(|e| Error::Config {
                field: "post_processor_config.ocr.PATTERN",
                reason: format!("not a regular expression: {e}"),
            })?;
        }
        Ok(())
    }
}

/// A task's parsed output, as the processor's `post_process_generation`
/// returns it under the task's token (its keys when serialised).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum TaskOutput {
    /// Text (captions, OCR, region tasks).
    Text(String),
    /// Boxes `[x_min, y_min, x_max, y_max]` with a label each.
    Boxes {
        /// The boxes, in pixels.
        bboxes: Vec<[i32; 4]>,
        /// One label per box (empty for region proposals).
        labels: Vec<String>,
    },
    /// Quadrilaterals `[x1, y1, …, x4, y4]` with their text.
    Quads {
        /// The quadrilaterals, in pixels.
        quad_boxes: Vec<[i32; 8]>,
        /// One text per quadrilateral.
        labels: Vec<String>,
    },
    /// Polygons (each instance: its polygons, each `[x1, y1, x2, y2, …]`).
    Polygons {
        /// Per instance, its polygons, in pixels.
        polygons: Vec<Vec<Vec<i32>>>,
        /// One label per instance.
        labels: Vec<String>,
    },
    /// Open-vocabulary detection: boxes or polygons.
    BoxesOrPolygons {
        /// The boxes, in pixels.
        bboxes: Vec<[i32; 4]>,
        /// One label per box.
        bboxes_labels: Vec<String>,
        /// Per instance, its polygons, in pixels.
        polygons: Vec<Vec<Vec<i32>>>,
        /// One label per polygon instance.
        polygons_labels: Vec<String>,
    },
}

const BOX_PATTERN: &str = r"<loc_(\d+)><loc_(\d+)><loc_(\d+)><loc_(\d+)>";
const PHRASE_TEXT: &str = r"^\s*(.*?)(?=<od>|</od>|<box>|</box>|<bbox>|</bbox>|<loc_)";

fn re(p: &'static str) -> Regex {
    // Compiled once per process: a caption's parse would otherwise compile
    // up to seven patterns every time.
    static CACHE: std::sync::LazyLock<
        std::sync::Mutex<std::collections::HashMap<&'static str, Regex>>,
    > = std::sync::LazyLock::new(Default::default);
    let mut cache = CACHE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    cache
        .entry(p)
        // Only the processor's own patterns reach this; a config's pattern
        // is checked by TaskConfig::validate.
        .or_insert_with(|| Regex::new(p).unwrap_or_else(|e| panic!("pattern {p:?}: {e}")))
        .clone()
}

/// Every match of `pattern` in `text`: group 1 when the pattern has a
/// group, the whole match otherwise (Python's `re.findall`, one group).
fn findall(pattern: &Regex, text: &str) -> Vec<String> {
    pattern
        .captures_iter(text)
        .filter_map(|c| c.ok())
        .map(|c| {
            c.get(1)
                .or_else(|| c.get(0))
                .map_or(String::new(), |m| m.as_str().to_string())
        })
        .collect()
}

fn without_specials(text: &str) -> String {
    text.replace("<s>", "")
        .replace("</s>", "")
        .replace("<pad>", "")
}

/// Bins → pixels: `(bin + 0.5) · size / 1000`, in f32 and truncated, as
/// the processor's `dequantize` computes it.
fn dequantize(bin: i64, size: u32) -> i32 {
    let per_bin = (f64::from(size) / 1000.0) as f32;
    ((bin as f32 + 0.5) * per_bin) as i32
}

fn dequantize_points(bins: &[i64], (w, h): (u32, u32)) -> Vec<i32> {
    bins.iter()
        .enumerate()
        .map(|(i, &b)| dequantize(b, if i % 2 == 0 { w } else { h }))
        .collect()
}

fn ascii_only(s: &str) -> String {
    s.chars().filter(char::is_ascii).collect()
}

/// Python's `str.strip()`.
fn strip(s: &str) -> String {
    s.trim().to_string()
}

fn bins_of(caps: &fancy_regex::Captures, groups: std::ops::RangeInclusive<usize>) -> Vec<i64> {
    groups
        .filter_map(|g| caps.get(g).and_then(|m| m.as_str().parse::<i64>().ok()))
        .collect()
}

fn boxes_in(phrase_text: &str, size: (u32, u32)) -> Vec<[i32; 4]> {
    re(BOX_PATTERN)
        .captures_iter(phrase_text)
        .filter_map(|c| c.ok())
        .map(|c| {
            let p = dequantize_points(&bins_of(&c, 1..=4), size);
            [p[0], p[1], p[2], p[3]]
        })
        .collect()
}

/// Parses generated text (decoded with its special tokens, as
/// `batch_decode(…, skip_special_tokens=False)` gives it) for `task` on
/// an image of `size` = (width, height) pixels.
pub fn parse(text: &str, task: Task, size: (u32, u32), cfg: &TaskConfig) -> TaskOutput {
    match task.kind() {
        ParseKind::PureText => {
            TaskOutput::Text(strip(&text.replace("<s>", "").replace("</s>", "")))
        }
        ParseKind::Ocr => {
            let (quad_boxes, labels) = parse_ocr(text, size, cfg).into_iter().unzip();
            TaskOutput::Quads { quad_boxes, labels }
        }
        ParseKind::PhraseGrounding => {
            let mut bboxes = Vec::new();
            let mut labels = Vec::new();
            for (boxes, label) in parse_phrase_grounding(text, size, cfg) {
                for b in boxes {
                    bboxes.push(b);
                    labels.push(label.clone());
                }
            }
            TaskOutput::Boxes { bboxes, labels }
        }
        ParseKind::DescriptionWithBboxes | ParseKind::Bboxes => {
            let allow_empty = task.kind() == ParseKind::Bboxes;
            let (bboxes, labels) = parse_boxes(text, size, allow_empty).into_iter().unzip();
            TaskOutput::Boxes { bboxes, labels }
        }
        ParseKind::Polygons => {
            let (polygons, labels) = parse_polygons(text, size, true).into_iter().unzip();
            TaskOutput::Polygons { polygons, labels }
        }
        ParseKind::DescriptionWithBboxesOrPolygons => {
            let (mut bboxes, mut bboxes_labels) = (Vec::new(), Vec::new());
            let (mut polygons, mut polygons_labels) = (Vec::new(), Vec::new());
            if text.contains("<poly>") {
                for (p, label) in parse_polygons(text, size, false) {
                    polygons.push(p);
                    polygons_labels.push(label);
                }
            } else {
                for (b, label) in parse_boxes(text, size, false) {
                    bboxes.push(b);
                    bboxes_labels.push(label);
                }
            }
            TaskOutput::BoxesOrPolygons {
                bboxes,
                bboxes_labels,
                polygons,
                polygons_labels,
            }
        }
    }
}

fn parse_ocr(text: &str, size: (u32, u32), cfg: &TaskConfig) -> Vec<([i32; 8], String)> {
    let text = without_specials(text);
    let pattern = match &cfg.ocr_pattern {
        Some(p) => Regex::new(p).unwrap_or_else(|_| re(DEFAULT_OCR_PATTERN)),
        None => re(DEFAULT_OCR_PATTERN),
    };
    let (w, h) = size;
    let mut out = Vec::new();
    for caps in pattern.captures_iter(&text).filter_map(|c| c.ok()) {
        let content = caps.get(1).map_or("", |m| m.as_str());
        let bins = bins_of(&caps, 2..=9);
        if bins.len() != 8 {
            continue;
        }
        let q = dequantize_points(&bins, size);
        if cfg.ocr_area_threshold > 0.0 {
            // The processor's shoelace sum over three of the four edges.
            let (xs, ys): (Vec<f64>, Vec<f64>) = (
                q.iter().step_by(2).map(|&v| f64::from(v)).collect(),
                q.iter().skip(1).step_by(2).map(|&v| f64::from(v)).collect(),
            );
            let area = 0.5
                * (0..3)
                    .map(|i| xs[i] * ys[i + 1] - xs[i + 1] * ys[i])
                    .sum::<f64>()
                    .abs();
            if area < f64::from(w) * f64::from(h) * cfg.ocr_area_threshold {
                continue;
            }
        }
        let mut quad = [0; 8];
        quad.copy_from_slice(&q);
        out.push((quad, strip(content)));
    }
    out
}

fn parse_phrase_grounding(
    text: &str,
    size: (u32, u32),
    cfg: &TaskConfig,
) -> Vec<(Vec<[i32; 4]>, String)> {
    let text = without_specials(text);
    let phrase_text_re = re(PHRASE_TEXT);
    let mut out = Vec::new();
    for phrase_text in findall(&re(r"([^<]+(?:<loc_\d+>){4,})"), &text) {
        let phrase_text = phrase_text
            .replacen("<ground>", "", 1)
            .replacen("<obj>", "", 1);
        if phrase_text.is_empty() {
            continue;
        }
        let Ok(Some(m)) = phrase_text_re.find(&phrase_text) else {
            continue;
        };
        let phrase = strip(m.as_str());
        if cfg.banned_grounding_tokens.contains(&phrase) {
            continue;
        }
        let boxes = boxes_in(&phrase_text, size);
        if boxes.is_empty() {
            continue;
        }
        out.push((boxes, ascii_only(&phrase)));
    }
    out
}

fn parse_boxes(text: &str, size: (u32, u32), allow_empty: bool) -> Vec<([i32; 4], String)> {
    let text = without_specials(text);
    let pattern = if allow_empty {
        re(r"(?:(?:<loc_\d+>){4,})")
    } else {
        re(r"([^<]+(?:<loc_\d+>){4,})")
    };
    let phrase_text_re = re(PHRASE_TEXT);
    let mut out = Vec::new();
    for phrase_text in findall(&pattern, &text) {
        let phrase_text = phrase_text
            .replacen("<ground>", "", 1)
            .replacen("<obj>", "", 1);
        if phrase_text.is_empty() && !allow_empty {
            continue;
        }
        let Ok(Some(m)) = phrase_text_re.find(&phrase_text) else {
            continue;
        };
        let phrase = ascii_only(&strip(m.as_str()));
        for b in boxes_in(&phrase_text, size) {
            out.push((b, phrase.clone()));
        }
    }
    out
}

fn parse_polygons(text: &str, size: (u32, u32), allow_empty: bool) -> Vec<(Vec<Vec<i32>>, String)> {
    let text = without_specials(text);
    let pattern = if allow_empty {
        re(r"(?:(?:<loc_\d+>|<sep>|<poly>|</poly>){4,})")
    } else {
        re(r"([^<]+(?:<loc_\d+>|<sep>|<poly>|</poly>){4,})")
    };
    let phrase_re = re(r"^\s*(.*?)(?=<od>|</od>|<box>|</box>|<bbox>|</bbox>|<loc_|<poly>)");
    let instance_re = re(r"<poly>(.*?)</poly>");
    let box_re = re(r"((?:<loc_\d+>)+)(?:<sep>|$)");
    let loc_re = re(r"<loc_(\d+)>");
    let leading_loc = re(r"^<loc_\d+>");
    let mut out = Vec::new();
    for phrase_text in findall(&pattern, &text) {
        let stripped = leading_loc.replace(&phrase_text, "").into_owned();
        if stripped.is_empty() && !allow_empty {
            continue;
        }
        let Ok(Some(m)) = phrase_re.find(&stripped) else {
            continue;
        };
        let phrase = strip(m.as_str());
        let instances: Vec<String> =
            if phrase_text.contains("<poly>") && phrase_text.contains("</poly>") {
                findall(&instance_re, &phrase_text)
            } else {
                vec![phrase_text.clone()]
            };
        for inst in instances {
            let mut polygons = Vec::new();
            for caps in box_re.captures_iter(&inst).filter_map(|c| c.ok()) {
                let run = caps.get(1).map_or("", |m| m.as_str());
                let mut bins: Vec<i64> = loc_re
                    .captures_iter(run)
                    .filter_map(|c| c.ok())
                    .filter_map(|c| c.get(1).and_then(|m| m.as_str().parse().ok()))
                    .collect();
                if bins.len() % 2 == 1 {
                    bins.pop();
                }
                polygons.push(dequantize_points(&bins, size));
            }
            if polygons.is_empty() {
                continue;
            }
            out.push((polygons, phrase.clone()));
        }
    }
    out
}
