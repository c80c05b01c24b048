//! Model directory loading: the input unpacks (see the crate docs) into
//! `config.json`, `tokenizer.json` and `model.safetensors`, written into a
//! temporary directory and loaded with `vl::load` in f32 on the CPU.
//! Any error is fine; a panic, an abort or a huge allocation is a bug. A
//! model that loads then runs one decoder step over its BOS token and a
//! two-token zero image.
#![no_main]

use std::sync::OnceLock;

use candle_core::{DType, Device, Tensor};
use libfuzzer_sys::fuzz_target;
use vl_decoder::ForwardMasks;
use vl_fuzz::{unpack, write_dir};

/// One directory per fuzzing process, rewritten for every input.
fn scratch() -> &'static tempfile::TempDir {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("a temporary directory"))
}

fuzz_target!(|data: &[u8]| {
    let dir = scratch().path();
    write_dir(dir, unpack(data)).expect("the scratch directory is writable");
    let Ok(model) = vl::load(dir, &vl::LoadOptions::new(DType::F32, &Device::Cpu)) else {
        return;
    };
    let dev = Device::Cpu;
    let cfg = &model.config.decoder;
    let (Ok(tokens), Ok(image)) = (
        Tensor::new(&[[cfg.bos_token_id]], &dev),
        Tensor::zeros((1, 2, cfg.memory_dim), DType::F32, &dev),
    ) else {
        return;
    };
    let _ = model
        .decoder
        .forward(&tokens, Some(&image), ForwardMasks::default());
});
