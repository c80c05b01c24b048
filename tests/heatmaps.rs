//! Heatmaps come from the captioning pass: the weights recorded while
//! generating equal those of replaying the caption through a fresh decode
//! state, for greedy decoding, sampling and beam search (along each
//! hypothesis' own path).
#![allow(missing_docs)]

use candle_core::{DType, Device, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use image::DynamicImage;
use vl::captioner::Captioner;
use vl::captioner::{ImageInput, Request};
use vl::checkpoint::ModelFormat;
use vl::shapes;
use vl::vl_attn::Quantization;
use vl::vl_decoder::init::seeded_init;
use vl::vl_decoder::{GenerationConfig, StepOptions, Strategy, VisionLanguageDecoder};
use vl::vl_vision::VisionEncoder;
use vl::vl_vision::VisionPipeline;
use vl::VlModel;

/// Recorded vs replayed weights: the same arithmetic on rows of another
/// batch, so within float rounding.
const TOLERANCE: f32 = 1e-5;

fn tiny_captioner() -> anyhow::Result<Captioner> {
    let cfg = shapes::captioner_config(16, 1, 8);
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let decoder = VisionLanguageDecoder::load(vb.pp("decoder"), &cfg.decoder)?;
    let vision = VisionEncoder::load(vb.pp("vision"), cfg.vision.as_ref().expect("vision"))?;
    seeded_init(&vars, 3)?;
    Ok(Captioner::new(VlModel {
        path: "tiny".into(),
        generation: GenerationConfig::greedy(&cfg.decoder, 6),
        decoder,
        text_encoder: None,
        vision: Some(VisionPipeline::new(vision, None, &Device::Cpu)?),
        tokenizer: shapes::tokenizer()?,
        format: ModelFormat::Vl,
        config: cfg,
        quantization: Quantization::None,
        fallbacks: Vec::new(),
    }))
}

/// The weights of `layer` at every position of `[start] + tokens[..n-1]`,
/// heads averaged, class token dropped: the replay the CLI used to do.
fn replay(c: &Captioner, image: &DynamicImage, tokens: &[u32]) -> anyhow::Result<Vec<Vec<f32>>> {
    let dec = &c.model().decoder;
    let memory = c.model().vision()?.encode_images(&[image])?;
    let ctx = dec.image_context(&memory, None)?;
    let mut state = dec.start(&ctx, 1)?;
    let mut input = vec![c.model().config.decoder.bos_token_id];
    input.extend_from_slice(&tokens[..tokens.len() - 1]);
    let n = input.len();
    let ids = Tensor::from_vec(input, (1, n), dec.device())?;
    let (_, w) = dec
        .step(
            &mut state,
            &ids,
            StepOptions {
                weights_of: c.heatmap_layer(),
                ..StepOptions::all().hidden()
            },
        )
        .map(|o| (o.values, o.weights))?;
    let w = w.expect("weights"); // (1, h, n, image_len)
    let len = w.dim(D::Minus1)?;
    Ok(w.mean(1)?
        .squeeze(0)?
        .narrow(1, 1, len - 1)?
        .to_vec2::<f32>()?)
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

#[test]
fn recorded_heatmaps_equal_the_replay() -> anyhow::Result<()> {
    let c = tiny_captioner()?;
    let images: Vec<DynamicImage> = (0..3)
        .map(|i| DynamicImage::ImageRgb8(vl::vl_shapes::dataset_scene(5, i).render()))
        .collect();
    let inputs: Vec<ImageInput> = images.iter().map(ImageInput::from).collect();
    let base = GenerationConfig {
        eos_token_ids: Vec::new(), // every caption runs its full length
        ..c.model().generation.clone()
    };
    for strategy in [
        Strategy::Greedy,
        Strategy::Sample {
            temperature: 1.0,
            top_k: None,
            top_p: None,
            seed: 4,
        },
        Strategy::beam(3),
    ] {
        let gen = c.with_heatmaps(&base.clone().with_strategy(strategy.clone()))?;
        let captions = c.caption(
            &inputs,
            &Request {
                generation: gen,
                prompt: None,
                task: None,
            },
        )?;
        for (cap, img) in captions.into_iter().zip(&images) {
            let cap = cap?;
            assert_eq!(cap.heatmaps.len(), cap.token_ids.len(), "{strategy:?}");
            let want = replay(&c, img, &cap.token_ids)?;
            let d = max_diff(&cap.heatmaps, &want);
            assert!(d <= TOLERANCE, "{strategy:?}: max diff {d}");
            for row in &cap.heatmaps {
                // Over the patches only: a little less than 1 (the class
                // token took the rest).
                let sum: f32 = row.iter().sum();
                assert!(sum > 0.0 && sum <= 1.0 + 1e-5, "{sum}");
            }
        }
        // Not asked for: nothing recorded.
        let plain = c.caption(
            &inputs,
            &Request {
                generation: base.clone().with_strategy(strategy),
                prompt: None,
                task: None,
            },
        )?;
        for p in plain {
            assert!(p?.heatmaps.is_empty());
        }
    }
    Ok(())
}
