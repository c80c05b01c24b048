//! The shapes captioner, built into the binary so that `vl caption` works
//! from any directory with no model on disk (`models/shapes-captioner` in
//! the repository; its README says how it was trained and how well it does).

use vl::checkpoint::ModelBytes;

/// How the embedded model is named in messages and in `--json` output.
pub const NAME: &str = "embedded:shapes-captioner";

/// Its three files.
pub const SHAPES_CAPTIONER: ModelBytes<'static> = ModelBytes {
    config: include_bytes!("../models/shapes-captioner/config.json"),
    weights: include_bytes!("../models/shapes-captioner/model.safetensors"),
    tokenizer: include_bytes!("../models/shapes-captioner/tokenizer.json"),
};
