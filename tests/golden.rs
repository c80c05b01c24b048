//! The shipped captioner's greedy captions of its sample images, which were
//! drawn by `examples/render_shapes.rs` (seed 7) and are listed with their
//! true captions in `models/shapes-captioner/samples/captions.tsv`.
#![allow(missing_docs)]

use std::path::Path;

use candle_core::{DType, Device};
use vl::captioner::Captioner;
use vl::vl_vision::preprocess::load_image;

const MODEL: &str = "models/shapes-captioner";

#[test]
fn shipped_model_captions_its_samples() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let captioner = Captioner::load(&root.join(MODEL), DType::F32, &Device::Cpu)?;
    let listing = std::fs::read_to_string(root.join(MODEL).join("samples/captions.tsv"))?;
    let gen = captioner.greedy_config(15);
    let mut n = 0;
    for line in listing.lines() {
        let (file, want) = line.split_once('\t').expect("file<TAB>caption");
        let img = load_image(&root.join(MODEL).join("samples").join(file))?;
        let got = captioner.caption(&[&img], &gen, &mut |_| {})?;
        assert_eq!(got[0].text, want, "{file}");
        // The ids end with the end token.
        assert_eq!(
            got[0].token_ids.last(),
            Some(&captioner.model.config.decoder.eos_token_id)
        );
        n += 1;
    }
    assert!(n >= 4, "only {n} samples listed");
    Ok(())
}
