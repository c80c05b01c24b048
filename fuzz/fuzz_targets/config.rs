//! `config.json` parsing and validation: any bytes, as a model directory's
//! [`VlConfig`] and as a bare [`DecoderConfig`]. Neither may panic; a config
//! that validates must also yield its derived sizes without overflow and
//! survive the round trip that `vl::checkpoint::native::save` and `vl::load` make.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vl::VlConfig;
use vl_decoder::DecoderConfig;
use vl_vision::VisionConfig;

fn derived_sizes(cfg: &DecoderConfig) {
    let _ = cfg.kv_heads();
    for layer in 0..cfg.num_hidden_layers.min(64) {
        let _ = cfg.has_cross_attention(layer);
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(cfg) = serde_json::from_slice::<VlConfig>(data) {
        if cfg.validate().is_ok() {
            derived_sizes(&cfg.decoder);
            if let Some(vision) = &cfg.vision {
                let _ = vision.hidden_size();
                let _ = vision.pixel_spec();
                let _ = match vision {
                    VisionConfig::MockVit(c) => c.num_patches(),
                    VisionConfig::Vit(c) => c.num_patches(),
                };
            }
            let json = serde_json::to_vec(&cfg).expect("a valid config serialises");
            let back: VlConfig = serde_json::from_slice(&json).expect("a saved config parses");
            back.validate().expect("a saved config validates");
        }
    }
    if let Ok(cfg) = serde_json::from_slice::<DecoderConfig>(data) {
        if cfg.validate().is_ok() {
            derived_sizes(&cfg);
        }
    }
});
