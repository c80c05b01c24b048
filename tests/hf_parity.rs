//! Parity with transformers on the committed vision-encoder-decoder
//! fixtures (`scripts/hf_fixtures.py` writes them): preprocessing, the
//! encoder's last hidden state, teacher-forced logits, and the ids of
//! greedy, 3-beam and checkpoint-default generation.
#![allow(missing_docs)]

mod parity;

use candle_core::{DType, Device};
use vl::vl_decoder::{EarlyStopping, ForwardMasks, Strategy};
use vl::{ModelFormat, VlModel};

use parity::{
    check_forward, check_generation, copy_fixture, fixture, load, load_err, max_abs_diff, Fixture,
    GeneratedIds,
};

/// The fixtures' folder under `tests/fixtures`.
const FAMILY: &str = "hf";

type Expected = GeneratedIds;

fn run_parity(kind: &str) -> anyhow::Result<()> {
    let f: Fixture<Expected> = load(FAMILY, kind)?;
    assert_eq!(f.model.format, ModelFormat::VisionEncoderDecoder);
    // Pixels of the PNG as transformers' ViTImageProcessor, the encoder's
    // last hidden state (before enc_to_dec_proj), teacher-forced logits in
    // one pass and step by step.
    let ctx = check_forward(&f, kind, "encoder_last_hidden_state", "decoder_input_ids")?;

    // Generation: greedy and 3 beams for 20 new tokens, and the
    // checkpoint's own defaults, with their text.
    check_generation(&f, &ctx, kind)
}

#[test]
fn equal_widths_match_transformers() -> anyhow::Result<()> {
    run_parity("equal")
}

#[test]
fn narrower_encoder_matches_transformers() -> anyhow::Result<()> {
    run_parity("narrow")
}

#[test]
fn generation_defaults_come_from_the_checkpoint() -> anyhow::Result<()> {
    // generation_config.json: 3 beams, early stopping, max_length 21.
    let equal = vl::load(&fixture(FAMILY, "equal"), &vl::LoadOptions::default())?;
    assert_eq!(equal.generation.max_new_tokens, 20);
    assert_eq!(
        equal.generation.strategy,
        Strategy::Beam {
            num_beams: 3,
            length_penalty: 1.0,
            early_stopping: EarlyStopping::True
        }
    );
    // config.json only (older layout): greedy, no_repeat_ngram_size 3.
    let narrow = vl::load(&fixture(FAMILY, "narrow"), &vl::LoadOptions::default())?;
    assert_eq!(narrow.generation.strategy, Strategy::Greedy);
    assert_eq!(narrow.generation.no_repeat_ngram_size, 3);
    assert_eq!(narrow.generation.max_new_tokens, 20);
    assert_eq!(narrow.generation.eos_token_ids, vec![0]);
    Ok(())
}

/// GPT-2's `attn_pdrop`, `resid_pdrop`, `embd_pdrop` (transformers' 0.1
/// when absent) and ViT's `attention_probs_dropout_prob`,
/// `hidden_dropout_prob` are read on load and checked; they act only in
/// training.
#[test]
fn dropout_is_read_on_load() -> anyhow::Result<()> {
    let dropouts = |m: &VlModel| {
        let c = m.decoder.config();
        (c.attention_dropout, c.residual_dropout, c.embedding_dropout)
    };
    let f: Fixture<Expected> = load(FAMILY, "equal")?;
    assert_eq!(dropouts(&f.model), (0.1, 0.1, 0.1));
    let edit = |f: &dyn Fn(&mut serde_json::Value)| -> anyhow::Result<tempfile::TempDir> {
        let tmp = copy_fixture(FAMILY, "equal")?;
        let path = tmp.path().join("config.json");
        let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
        cfg["encoder"]["attention_probs_dropout_prob"] = 0.05.into();
        cfg["encoder"]["hidden_dropout_prob"] = 0.15.into();
        f(&mut cfg["decoder"]);
        std::fs::write(&path, cfg.to_string())?;
        Ok(tmp)
    };
    let tmp = edit(&|d| {
        d["attn_pdrop"] = 0.25.into();
        d["resid_pdrop"] = 0.0.into();
        d.as_object_mut().map(|o| o.remove("embd_pdrop"));
    })?;
    let model = vl::load(tmp.path(), &vl::LoadOptions::new(DType::F32, &Device::Cpu))?;
    assert_eq!(dropouts(&model), (0.25, 0.0, 0.1));
    match &model.config.vision {
        Some(vl::vl_vision::VisionConfig::Vit(v)) => {
            assert_eq!((v.attention_dropout, v.hidden_dropout), (0.05, 0.15));
        }
        other => panic!("expected a ViT config, got {other:?}"),
    }
    let tmp = edit(&|d| d["resid_pdrop"] = 1.0.into())?;
    let err = load_err(tmp.path());
    assert!(
        err.contains("decoder.resid_pdrop") && err.contains('1'),
        "{err}"
    );

    // Inference ignores them (the parity tests above run with them); a
    // decoder switched to training drops.
    let memory = f.model.vision()?.encode_batch(&f.tensors["pixel_values"])?;
    let ids = f.tensors["decoder_input_ids"].to_dtype(DType::U32)?;
    let mut decoder = f.model.decoder.clone();
    let inference = decoder.forward(&ids, Some(&memory), ForwardMasks::default())?;
    decoder.set_mode(vl::vl_decoder::Mode::training(0));
    let training = decoder.forward(&ids, Some(&memory), ForwardMasks::default())?;
    assert!(max_abs_diff(&inference, &training)? > 0.0);
    Ok(())
}

/// Copies a fixture into a temporary directory to break it.
#[test]
fn pickle_only_checkpoints_are_refused() -> anyhow::Result<()> {
    let tmp = copy_fixture(FAMILY, "equal")?;
    std::fs::rename(
        tmp.path().join("model.safetensors"),
        tmp.path().join("pytorch_model.bin"),
    )?;
    let err = load_err(tmp.path());
    assert!(
        err.contains("pytorch_model.bin") && err.contains("safetensors"),
        "{err}"
    );
    Ok(())
}

#[test]
fn shards_outside_the_directory_are_refused() -> anyhow::Result<()> {
    let tmp = copy_fixture(FAMILY, "narrow")?;
    let index_path = tmp.path().join("model.safetensors.index.json");
    let index = std::fs::read_to_string(&index_path)?;
    let bad = index.replacen(
        "\"model-00001-of-00011.safetensors\"",
        "\"../model-00001-of-00011.safetensors\"",
        1,
    );
    std::fs::write(&index_path, bad)?;
    let err = load_err(tmp.path());
    assert!(
        err.contains("model.safetensors.index.json") && err.contains("plain file name"),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_missing_tensor_is_named() -> anyhow::Result<()> {
    let tmp = copy_fixture(FAMILY, "equal")?;
    let path = tmp.path().join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu)?;
    tensors.remove("decoder.transformer.h.1.crossattention.q_attn.weight");
    candle_core::safetensors::save(&tensors, &path)?;
    let err = load_err(tmp.path());
    assert!(
        err.contains("model.safetensors")
            && err.contains("decoder.transformer.h.1.crossattention.q_attn.weight"),
        "{err}"
    );
    Ok(())
}

#[test]
fn config_errors_name_the_field_and_file() -> anyhow::Result<()> {
    let tmp = copy_fixture(FAMILY, "equal")?;
    let path = tmp.path().join("config.json");
    let cfg = std::fs::read_to_string(&path)?;
    std::fs::write(
        &path,
        cfg.replace(
            "\"add_cross_attention\": true",
            "\"add_cross_attention\": false",
        ),
    )?;
    let err = load_err(tmp.path());
    assert!(
        err.contains("decoder.add_cross_attention") && err.contains("config.json"),
        "{err}"
    );
    std::fs::write(
        &path,
        cfg.replace("\"model_type\": \"vit\"", "\"model_type\": \"swin\""),
    )?;
    let err = load_err(tmp.path());
    assert!(
        err.contains("encoder.model_type") && err.contains("swin"),
        "{err}"
    );
    Ok(())
}

/// A request that joins a running batch: stepped together with one three
/// tokens ahead over another image, each one's logits equal those of its
/// own step alone within the parity tolerance — and transformers' greedy
/// ids come out of the joined steps.
#[test]
fn requests_joined_mid_decode_keep_their_logits() -> anyhow::Result<()> {
    let f: Fixture<Expected> = load(FAMILY, "equal")?;
    let pixels = &f.tensors["pixel_values"];
    // A second image: the first, mirrored.
    let batch = candle_core::Tensor::cat(&[pixels.clone(), pixels.flip(&[3])?], 0)?;
    let decoder = &f.model.decoder;
    let images = decoder
        .image_context(&f.model.encode_pixels(&batch)?, None)?
        .split()?;
    let start = f.model.generation.start_token_id;
    let greedy = &f.expected.greedy;
    let ids = |t: &[u32]| candle_core::Tensor::new(t, &Device::Cpu)?.unsqueeze(0);
    let mut ahead = decoder.start(&images[0], 1)?;
    let mut ahead_alone = decoder.start(&images[0], 1)?;
    let prefix: Vec<u32> = std::iter::once(start)
        .chain(greedy[..3].iter().copied())
        .collect();
    for s in [&mut ahead, &mut ahead_alone] {
        decoder.step(s, &ids(&prefix)?, vl::vl_decoder::StepOptions::last())?;
    }
    let mut joined = decoder.start(&images[1], 1)?;
    let mut joined_alone = decoder.start(&images[1], 1)?;
    let mut worst = 0f32;
    let (mut a_next, mut b_next) = (greedy[3], start);
    for _ in 0..6 {
        let (ta, tb) = (ids(&[a_next])?, ids(&[b_next])?);
        let opts = vl::vl_decoder::StepOptions::last();
        let together = decoder.step_many(
            &mut [&mut ahead, &mut joined],
            &[ta.clone(), tb.clone()],
            opts,
        )?;
        let alone = [
            decoder.step(&mut ahead_alone, &ta, opts)?,
            decoder.step(&mut joined_alone, &tb, opts)?,
        ];
        for (t, a) in together.iter().zip(&alone) {
            worst = worst.max(max_abs_diff(&t.values, &a.values)?);
        }
        let next = |t: &vl::vl_decoder::StepOutput| -> anyhow::Result<u32> {
            Ok(t.values.argmax(candle_core::D::Minus1)?.to_vec1::<u32>()?[0])
        };
        a_next = next(&together[0])?;
        b_next = next(&together[1])?;
        let a_pos = ahead.position() - 1; // tokens after the start token
        assert_eq!(
            a_next, greedy[a_pos],
            "the request ahead left transformers' ids"
        );
    }
    eprintln!("joined mid-decode: logits max abs diff {worst:e}");
    assert!(worst <= parity::TOL, "logits differ by {worst}");
    Ok(())
}
