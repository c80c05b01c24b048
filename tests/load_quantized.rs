//! `VlModel::load_quantized` (quantization during the load, part by part)
//! against loading first and quantizing after: the same model, bit for
//! bit, for every family and format; and the same named error when a
//! layer does not fit the format.
#![allow(missing_docs)]

mod parity;

use candle_core::{DType, Device, Tensor};
use parity::fixture;
use vl::vl_decoder::Quantization;
use vl::VlModel;

/// The model's logits for a fixed token sequence over its own encoding of
/// a fixed image.
fn logits(model: &VlModel) -> anyhow::Result<Tensor> {
    let side = model.pixel_spec()?.image_size;
    let n = 3 * side * side;
    let pixels = Tensor::arange(0f32, n as f32, &Device::Cpu)?
        .affine(1.0 / n as f64, -0.5)?
        .reshape((1, 3, side, side))?;
    let memory = model.encode_pixels(&pixels)?;
    let vocab = model.decoder.config().vocab_size as u32;
    let ids: Vec<u32> = (0..6u32).map(|i| (i * 7 + 3) % vocab).collect();
    let tokens = Tensor::from_vec(ids, (1, 6), &Device::Cpu)?;
    Ok(model
        .decoder
        .forward(&tokens, Some(&memory), Default::default())?)
}

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
        let during = VlModel::load_quantized(&dir, DType::F32, &Device::Cpu, q)?;
        let mut after = VlModel::load(&dir, DType::F32, &Device::Cpu)?;
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

/// q4k needs widths in multiples of 256: the same error either way, naming
/// the layer.
#[test]
fn a_layer_that_does_not_fit_is_named_either_way() -> anyhow::Result<()> {
    let dir = fixture("hf", "equal");
    let during = VlModel::load_quantized(&dir, DType::F32, &Device::Cpu, Quantization::Q4K)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    let mut model = VlModel::load(&dir, DType::F32, &Device::Cpu)?;
    let after = model
        .quantize(Quantization::Q4K)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(during.contains("256"), "{during}");
    assert_eq!(during, after);
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
        let packed = VlModel::load(&dir, DType::BF16, &Device::Cpu)?;
        let want = vl::vl_attn::kernels::gemm_bf16::accelerated().then_some(Quantization::Bf16);
        assert_eq!(
            packed.decoder.quantization(),
            want.and_then(|q| q.ggml_dtype()),
            "{family}"
        );
        let f32_model = VlModel::load(&dir, DType::F32, &Device::Cpu)?;
        let (got, reference) = (logits(&packed)?.to_dtype(DType::F32)?, logits(&f32_model)?);
        let rel = ((&got - &reference)?.sqr()?.sum_all()?.sqrt()?
            / reference.sqr()?.sum_all()?.sqrt()?)?
        .to_scalar::<f32>()?;
        assert!(rel < 0.03, "{family}: relative L2 {rel} from f32");
    }
    Ok(())
}
