//! Rounds every tensor of a safetensors file through one of candle's ggml
//! formats along its last dimension (quantize, then dequantize to f32),
//! the way `Proj::quantize` rounds a layer's weight (rows of its input
//! width). `scripts/agreement_bound.py` uses it to run transformers'
//! model on exactly the weights vl's `--quantize q4k` multiplies by.
//!
//! ```bash
//! cargo run --release --example ggml_roundtrip -- IN.safetensors OUT.safetensors q4k
//! ```

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, output, format] = args.as_slice() else {
        bail!("usage: ggml_roundtrip IN.safetensors OUT.safetensors q8_0|q4k");
    };
    let format = match format.as_str() {
        "q8_0" => GgmlDType::Q8_0,
        "q4k" => GgmlDType::Q4K,
        other => bail!("format: expected q8_0 or q4k, got {other:?}"),
    };
    let tensors = candle_core::safetensors::load(input, &Device::Cpu)
        .with_context(|| format!("{input}: cannot read"))?;
    let mut out = HashMap::new();
    for (name, t) in tensors {
        let width = t.dims().last().copied().unwrap_or(0);
        if width % format.block_size() != 0 {
            bail!(
                "{input}: tensor `{name}` has shape {:?}, whose last dimension is not a multiple of {}",
                t.dims(),
                format.block_size()
            );
        }
        let q = QTensor::quantize(&t.to_dtype(DType::F32)?.contiguous()?, format)?;
        out.insert(name, q.dequantize(&Device::Cpu)?);
    }
    candle_core::safetensors::save(&out, output)
        .with_context(|| format!("{output}: cannot write"))?;
    Ok(())
}
