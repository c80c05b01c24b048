//! `vl::load` with a quantization (conversion during the load, part by part)
//! against loading first and quantizing after: the same model, bit for
//! bit, for every family and format; and the same named error when a
//! layer does not fit the format.
#![allow(missing_docs)]

mod parity;

use candle_core::{DType, Device};
use parity::{fixture, logits};
use vl::vl_attn::Quantization;
use vl::{LoadOptions, VlModel};

#[test]
fn quantizing_during_the_load_equals_quantizing_after() -> anyhow::Result<()> {
    let cases = [
        ("hf", "equal", Quantization::Q8_0),
        ("hf", "equal", Quantization::Bf16),
        ("trocr", "vit_learned", Quantization::Q8_0),
        ("blip", "vision32", Quantization::Q8_0),
        ("blip", "vision24", Quantization::F16),
    ];
    for (family, kind, q) in cases {
        let dir = fixture(family, kind);
        let during = vl::load(&dir, &LoadOptions::default().quantized(q))?;
        let mut after = vl::load(&dir, &vl::LoadOptions::new(DType::F32, &Device::Cpu))?;
        after.quantize(q)?;
        assert_eq!(during.decoder.quantization(), q.ggml_dtype(), "{kind} {q}");
        let diff = (logits(&during)? - logits(&after)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert_eq!(diff, 0.0, "{family}/{kind} {q}: {diff}");
    }
    Ok(())
}

/// q4k needs widths in multiples of 256, q8_0 in multiples of 32: a layer
/// that cannot hold q4k gets the next format that fits, the same layers
/// during the load and after it, each named with its width, and the rest
/// stay q4k.
#[test]
fn a_layer_that_does_not_fit_falls_back_either_way() -> anyhow::Result<()> {
    for (family, kind) in [("hf", "equal"), ("blip", "vision24")] {
        let dir = fixture(family, kind);
        let options = LoadOptions::default().quantized(Quantization::Q4K);
        let during = vl::load(&dir, &options)?;
        let mut after = vl::load(&dir, &LoadOptions::default())?;
        after.quantize(Quantization::Q4K)?;
        assert!(!during.fallbacks.is_empty(), "{family}/{kind}");
        assert_eq!(during.fallbacks, after.fallbacks, "{family}/{kind}");
        for f in &during.fallbacks {
            assert_ne!(f.in_dim % 256, 0, "{}", f.layer);
            let want = (f.in_dim % 32 == 0).then_some(candle_core::quantized::GgmlDType::Q8_0);
            assert_eq!(f.got, want, "{}", f.layer);
        }
        let diff = (logits(&during)? - logits(&after)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert_eq!(diff, 0.0, "{family}/{kind}: {diff}");
        let summary = vl::checkpoint::fallback_summary(Quantization::Q4K, &during.fallbacks)
            .unwrap_or_default();
        let first = &during.fallbacks[0];
        assert!(
            summary.contains(&first.layer) && summary.contains("256"),
            "{summary}"
        );
    }
    Ok(())
}

/// The shipped captioner (width 64: no layer holds q4k, every one q8_0)
/// loads with q4k asked, from its directory as from memory, and still
/// captions its first sample.
#[test]
fn the_shipped_captioner_loads_with_q4k_asked() -> anyhow::Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = root.join("models/shapes-captioner");
    let options = LoadOptions::default().quantized(Quantization::Q4K);
    let model = vl::load(&dir, &options)?;
    let read = |f: &str| std::fs::read(dir.join(f));
    let (config, weights, tokenizer) = (
        read("config.json")?,
        read("model.safetensors")?,
        read("tokenizer.json")?,
    );
    let in_memory = vl::load(
        vl::Source::Memory {
            name: std::path::Path::new("shapes"),
            files: vl::checkpoint::ModelBytes {
                config: &config,
                weights: &weights,
                tokenizer: &tokenizer,
            },
        },
        &options,
    )?;
    for m in [&model, &in_memory] {
        assert!(!m.fallbacks.is_empty());
        assert!(m
            .fallbacks
            .iter()
            .all(|f| f.got == Some(candle_core::quantized::GgmlDType::Q8_0)));
    }
    let layers = |m: &VlModel| {
        m.fallbacks
            .iter()
            .map(|f| f.layer.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(layers(&model), layers(&in_memory));
    Ok(())
}

/// On CPUs with AVX512_BF16 a bf16 load packs its linear layers for vl's
/// bf16 kernels (as `Quantization::Bf16` does), elsewhere it stays dense;
/// either way its logits are within bf16's error of the f32 model's
/// (relative L2 under 3%), for every family.
#[test]
fn a_bf16_load_packs_its_weights_where_the_kernels_run() -> anyhow::Result<()> {
    for (family, kind) in [
        ("hf", "equal"),
        ("trocr", "vit_learned"),
        ("blip", "vision32"),
    ] {
        let dir = fixture(family, kind);
        let packed = vl::load(&dir, &vl::LoadOptions::new(DType::BF16, &Device::Cpu))?;
        let want = vl::vl_attn::kernels::gemm_bf16::accelerated().then_some(Quantization::Bf16);
        assert_eq!(
            packed.decoder.quantization(),
            want.and_then(|q| q.ggml_dtype()),
            "{family}"
        );
        let f32_model = vl::load(&dir, &vl::LoadOptions::new(DType::F32, &Device::Cpu))?;
        let (got, reference) = (logits(&packed)?.to_dtype(DType::F32)?, logits(&f32_model)?);
        let rel = ((&got - &reference)?.sqr()?.sum_all()?.sqrt()?
            / reference.sqr()?.sum_all()?.sqrt()?)?
        .to_scalar::<f32>()?;
        assert!(rel < 0.03, "{family}: relative L2 {rel} from f32");
    }
    Ok(())
}
