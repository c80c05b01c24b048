//! Parity of vl's Swin with transformers' `DonutSwinModel` (Donut's and
//! Nougat's encoder) on the committed fixtures (`scripts/swin_fixtures.py`):
//! the last hidden state of a batch of two at the configured size, and of
//! an input of another size (padded to whole patches, odd maps padded by
//! the patch merging), ≤ 1e-4. The fixtures cover window padding, shifted
//! windows with their −100 mask, a last stage that is one window, biases
//! on and off, two activations.
#![allow(missing_docs)]

mod parity;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use vl::vl_vision::swin::{Swin, SwinConfig};

use parity::{fixture, max_abs_diff, TOL};

/// The fixture's encoder, loaded from its config and weights.
fn load_swin(kind: &str) -> anyhow::Result<Swin> {
    let dir = fixture("swin", kind);
    let cfg: SwinConfig = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    // SAFETY: the fixture is not modified while mapped.
    let vb = unsafe {
        VarBuilder::from_mmaped_safetensors(
            &[dir.join("model.safetensors")],
            DType::F32,
            &Device::Cpu,
        )?
    };
    Ok(Swin::load(vb, &cfg)?)
}

fn check(kind: &str) -> anyhow::Result<()> {
    let swin = load_swin(kind)?;
    let expected = candle_core::safetensors::load(
        fixture("swin", kind).join("expected.safetensors"),
        &Device::Cpu,
    )?;
    for (input, output) in [
        ("pixel_values", "last_hidden_state"),
        ("pixel_values_other", "last_hidden_state_other"),
    ] {
        let Some(px) = expected.get(input) else {
            continue;
        };
        let want: &Tensor = &expected[output];
        let got = swin.forward(px)?;
        assert_eq!(got.dims(), want.dims(), "{kind}: {output} shape");
        let diff = max_abs_diff(&got, want)?;
        assert!(diff <= TOL, "{kind}: {output} differs by {diff} (> {TOL})");
    }
    Ok(())
}

#[test]
fn padded_windows_and_shifts_match_transformers() -> anyhow::Result<()> {
    check("a")
}

#[test]
fn no_qkv_bias_and_gelu_tanh_match_transformers() -> anyhow::Result<()> {
    check("b")
}

#[test]
fn a_last_stage_of_one_window_matches_transformers() -> anyhow::Result<()> {
    check("c")
}

#[test]
fn an_input_too_small_for_the_window_is_named() -> anyhow::Result<()> {
    let swin = load_swin("a")?;
    let px = Tensor::zeros((1, 3, 16, 16), DType::F32, &Device::Cpu)?;
    let e = swin.forward(&px).unwrap_err().to_string();
    assert!(
        e.contains("pixels") && e.contains("16x16") && e.contains("window"),
        "{e}"
    );
    Ok(())
}
