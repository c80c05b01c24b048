//! Image decoding and preprocessing: any bytes through
//! `preprocess::decode_image` (the decoder behind `load_image`, with its
//! size and memory limits), then `preprocess` to the shipped model's pixel
//! spec. Any error is fine; a panic, an abort or a huge allocation is a bug.
#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use candle_core::Device;
use libfuzzer_sys::fuzz_target;
use vl_vision::preprocess::{decode_image, preprocess, PixelSpec};

fn spec() -> &'static PixelSpec {
    static SPEC: OnceLock<PixelSpec> = OnceLock::new();
    SPEC.get_or_init(vl_fuzz::shapes_pixel_spec)
}

fuzz_target!(|data: &[u8]| {
    let Ok(img) = decode_image(data, Path::new("fuzz-input")) else {
        return;
    };
    let spec = spec();
    let pixels = preprocess(&img, spec, &Device::Cpu).expect("a decoded image preprocesses");
    assert_eq!(pixels.dims(), &[3, spec.image_size, spec.image_size]);
});
