//! A model's tensors under the names its modules' `load` reads them by:
//! how any model, however it was loaded or converted, is written back.
//!
//! Each module's `named_tensors(prefix, out)` adds its tensors to `out`
//! as `prefix.name`. Dense tensors are the module's own (written back bit
//! for bit); a converted projection (16-bit, `q8_0`, `q4k`) gives its
//! weights as the f32 values it computes with, which convert back to the
//! same blocks.

use std::collections::BTreeMap;

use candle_core::Tensor;

/// Tensors by name.
pub type Named = BTreeMap<String, Tensor>;

/// The name a weight `weight` (e.g. `"decoder.lm_head.weight"`) held as
/// `format`'s blocks is written under: `weight.q8_0`, `weight.q4k` — a
/// `u8` tensor `(rows, bytes per row)` in candle's (ggml's) block layout.
pub fn blocks_name(weight: &str, format: crate::Quantization) -> String {
    format!("{weight}.{}", format.name())
}

/// `prefix.name`, or `name` under an empty prefix.
pub fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}
