#!/usr/bin/env python3
"""Writes the mBART-decoder parity fixtures under tests/fixtures/mbart/.

Tiny VisionEncoderDecoder checkpoints whose decoder is transformers'
`MBartForCausalLM` (Donut's and Nougat's text decoder: pre-LN layers,
`layernorm_embedding`, a final `layer_norm`, learned positions from row 2,
a bias-free LM head) under a ViT encoder, with the byte-level BPE, test
image and image processor of `scripts/trocr_fixtures.py` (whose helpers
this script imports). Start token `<s>` 0, as Nougat's (Donut's prompt
starts with its task token).

- `vit_tied/`: ViT 32 wide = d_model 32 (no projection), LM head tied,
  `scale_embedding`, gelu; 3-beam early-stopping defaults.
- `vit_untied/`: ViT 24 wide under d_model 32 (`enc_to_dec_proj`), an
  untied `lm_head` (as Nougat's), no embedding scale, relu; greedy
  defaults with `no_repeat_ngram_size` 3 and `bad_words_ids` (`<unk>`, as
  Donut's and Nougat's model cards ban it, and a two-token sequence the
  output would otherwise start with).

Each directory: the checkpoint, `tokenizer.json`,
`preprocessor_config.json`, `image.png`, `expected.safetensors` (pixels,
the encoder's last hidden state, teacher-forced ids and logits) and
`expected.json` (greedy, 3-beam and default-settings ids after the start
token, the default ids' text).

    .venv/bin/python scripts/mbart_fixtures.py
"""

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers
from PIL import Image
from safetensors.torch import save_file
from transformers import (
    GenerationConfig,
    MBartConfig,
    ViTImageProcessor,
    VisionEncoderDecoderConfig,
    VisionEncoderDecoderModel,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trocr_fixtures import BOS, EOS, IMAGE_SIZE, NEW_TOKENS, PAD, encoder_config, test_image, train_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "mbart"

VARIANTS = {
    "vit_tied": dict(
        seed=21,
        enc_width=32,
        decoder=dict(tie_word_embeddings=True, scale_embedding=True, activation_function="gelu"),
        generation=dict(num_beams=3, early_stopping=True, length_penalty=1.0),
    ),
    "vit_untied": dict(
        seed=22,
        enc_width=24,
        decoder=dict(tie_word_embeddings=False, scale_embedding=False, activation_function="relu"),
        # <unk> banned as the model cards do, and a two-token sequence
        # that the unbanned greedy output starts with.
        generation=dict(no_repeat_ngram_size=3, bad_words_ids=[[3], [284, 199]]),
    ),
}


def write_variant(name: str, v: dict) -> None:
    out = OUT / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tok = train_tokenizer(300)
    vocab = tok.get_vocab_size()
    torch.manual_seed(v["seed"])
    enc = encoder_config("vit", v["enc_width"])
    dec = MBartConfig(
        vocab_size=vocab,
        d_model=32,
        decoder_layers=2,
        decoder_attention_heads=4,
        decoder_ffn_dim=64,
        # generate() sizes its cache by `num_hidden_layers`, which MBartConfig
        # maps to `encoder_layers`: equal to the decoder's.
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=64,
        max_position_embeddings=64,
        init_std=0.2,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        decoder_start_token_id=BOS,
        **v["decoder"],
    )
    cfg = VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id = BOS
    cfg.pad_token_id = PAD
    cfg.eos_token_id = EOS
    cfg.tie_word_embeddings = v["decoder"]["tie_word_embeddings"]
    model = VisionEncoderDecoderModel(cfg).eval()
    # Layer norms start at (1, 0); perturb them so the parity test sees them.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(torch.randn_like(p) * 0.1)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=BOS,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        max_length=NEW_TOKENS + 1,
        **v["generation"],
    )
    model.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    processor = ViTImageProcessor(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        resample=2,
        image_mean=[0.5, 0.4, 0.3],
        image_std=[0.2, 0.25, 0.3],
    )
    processor.save_pretrained(out)
    img = test_image(IMAGE_SIZE, v["seed"])
    img.save(out / "image.png")

    # What the Rust side reads back: reload from disk, as a user would.
    model = VisionEncoderDecoderModel.from_pretrained(out).eval()
    assert type(model.decoder).__name__ == "MBartForCausalLM", type(model.decoder)
    tied = model.decoder.lm_head.weight is model.decoder.model.decoder.embed_tokens.weight
    assert tied == v["decoder"]["tie_word_embeddings"], (name, tied)
    assert hasattr(model, "enc_to_dec_proj") == (v["enc_width"] != 32), name
    pixels = processor(images=Image.open(out / "image.png"), return_tensors="pt").pixel_values
    g = torch.Generator().manual_seed(v["seed"])
    forced = torch.cat([torch.tensor([[BOS]]), torch.randint(3, vocab, (1, 11), generator=g)], dim=1)
    with torch.no_grad():
        enc_out = model.encoder(pixel_values=pixels).last_hidden_state
        logits = model(pixel_values=pixels, decoder_input_ids=forced).logits
        greedy = model.generate(pixels, max_new_tokens=NEW_TOKENS, num_beams=1, do_sample=False,
                                no_repeat_ngram_size=0, min_length=0)
        beam = model.generate(pixels, max_new_tokens=NEW_TOKENS, num_beams=3, do_sample=False,
                              length_penalty=1.0, early_stopping=False, no_repeat_ngram_size=0)
        defaults = model.generate(pixels)
    save_file(
        {
            "pixel_values": pixels.contiguous(),
            "encoder_last_hidden_state": enc_out.contiguous(),
            "decoder_input_ids": forced.to(torch.int64).contiguous(),
            "logits": logits.contiguous(),
        },
        str(out / "expected.safetensors"),
    )

    def after_start(ids: torch.Tensor) -> list:
        ids = ids[0].tolist()[1:]
        return ids[: ids.index(EOS) + 1] if EOS in ids else ids

    expected = {
        "greedy": after_start(greedy),
        "beam3": after_start(beam),
        "defaults": after_start(defaults),
        "defaults_text": tok.decode(after_start(defaults), skip_special_tokens=True),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")
    print(name, expected)


def main() -> None:
    for name, v in VARIANTS.items():
        write_variant(name, v)


if __name__ == "__main__":
    main()
