#!/usr/bin/env python3
"""Writes the TrOCR parity fixtures under tests/fixtures/trocr/.

Tiny VisionEncoderDecoder checkpoints with a TrOCR decoder (post-LN,
BART-style), random weights from fixed seeds, saved the way transformers
saves them, each with a RoBERTa-style byte-level BPE tokenizer (`<s>` 0,
`<pad>` 1, `</s>` 2, `<unk>` 3; start token `</s>` as TrOCR's
`decoder_start_token_id` 2), a test image already at the model's input
size, and transformers' outputs on it:

- `vit_learned/`: ViT encoder, learned positions (offset 2), tied head,
  `layernorm_embedding`, no embedding scale, `cross_attention_hidden_size`
  equal to the encoder width; `tokenizer.json`; generation defaults in
  `generation_config.json` (3 beams, early stopping).
- `deit_sinusoidal/`: DeiT encoder (CLS and distillation tokens), 24 wide
  under a 32-wide decoder that reads it through
  `cross_attention_hidden_size` 24; sinusoidal positions (fairseq's, padding
  index 1), untied `output_projection`, `layernorm_embedding`,
  `scale_embedding`, ReLU; tokenizer as `vocab.json` + `merges.txt`; greedy
  defaults with `no_repeat_ngram_size` 3.
- `vit_projected/`: a 24-wide ViT under a 32-wide decoder without
  `cross_attention_hidden_size`, hence `enc_to_dec_proj`; learned positions,
  no `layernorm_embedding`, `scale_embedding`, `gelu_new`; greedy defaults.

Each directory gets `expected.safetensors` (pixel values, the encoder's
last hidden state, teacher-forced input ids — a padding token among them —
and logits) and `expected.json` (greedy and 3-beam ids for 20 new tokens,
the ids `generate()` gives with the checkpoint's own defaults, and their
text).

transformers 5.x loads sinusoidal TrOCR positions as a meta tensor (the
table is a plain attribute built in `__init__`, which `from_pretrained` runs
on the meta device), so the reloaded model cannot run; the table is rebuilt
after loading with transformers' own `get_embedding`, exactly what a freshly
constructed model holds.

With `--base DIR`, it writes instead (the fixtures untouched) a
TrOCR-base-shaped checkpoint to DIR for the benchmarks (random weights,
~1.3 GB, never committed): ViT-B/16 at 384 (no qkv bias, as TrOCR-base's
BEiT-initialised encoder) under a 1024-wide, 12-layer, 16-head TrOCR
decoder (learned positions, `layernorm_embedding`, no embedding scale,
GELU, tied head, `cross_attention_hidden_size` 768), vocab 50265 as
RoBERTa's; transformers' own init (std 0.02) from seed 0; a byte-level
BPE `tokenizer.json` padded with filler tokens to the full 50265 ids (vl
wants the tokenizer to cover `vocab_size`); TrOCR's preprocessor (bilinear,
mean and std 0.5, 384); a 384x384 `image.png`.

Needs torch, transformers, tokenizers, pillow (a venv; CI never runs this):

    /work/venv/bin/python scripts/trocr_fixtures.py
    /work/venv/bin/python scripts/trocr_fixtures.py --base /tmp/trocr-base
"""

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    DeiTConfig,
    GenerationConfig,
    TrOCRConfig,
    ViTConfig,
    ViTImageProcessor,
    VisionEncoderDecoderConfig,
    VisionEncoderDecoderModel,
)
from transformers.models.trocr.modeling_trocr import TrOCRSinusoidalPositionalEmbedding

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "trocr"
NEW_TOKENS = 20
IMAGE_SIZE = 32
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
BOS, PAD, EOS = 0, 1, 2
CORPUS = [
    "INVOICE No. 2024-117 TOTAL DUE $1,250.00",
    "the quick brown fox jumps over the lazy dog",
    "Dear Sir, please find enclosed the receipt",
    "42 Main Street, Springfield, IL 62704",
    "handwritten notes: meeting moved to Thursday",
    "Page 3 of 12 -- CONFIDENTIAL",
]


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE laid out as RoBERTa's: <s> <pad> </s> <unk> first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", EOS), ("<s>", BOS))
    assert [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2, 3]
    return tok


def test_image(size: int, seed: int) -> Image.Image:
    """Smooth colour fields plus noise, at the model's input size."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    base = np.stack([x, y, 1 - x * y], axis=-1) * 200
    noise = rng.integers(0, 56, size=(size, size, 3))
    return Image.fromarray((base + noise).clip(0, 255).astype(np.uint8), "RGB")


def encoder_config(kind: str, width: int):
    common = dict(
        hidden_size=width,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=width * 2,
        image_size=IMAGE_SIZE,
        patch_size=8,
        initializer_range=0.2,
    )
    return DeiTConfig(**common) if kind == "deit" else ViTConfig(**common)


def decoder_config(vocab: int, **kw) -> TrOCRConfig:
    return TrOCRConfig(
        vocab_size=vocab,
        d_model=32,
        decoder_layers=2,
        decoder_attention_heads=4,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        init_std=0.2,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        decoder_start_token_id=EOS,
        **kw,
    )


VARIANTS = {
    "vit_learned": dict(
        seed=11,
        encoder="vit",
        enc_width=32,
        decoder=dict(
            cross_attention_hidden_size=32,
            use_learned_position_embeddings=True,
            tie_word_embeddings=True,
            layernorm_embedding=True,
            scale_embedding=False,
            activation_function="gelu",
        ),
        generation=dict(num_beams=3, early_stopping=True, length_penalty=1.0),
        tokenizer="json",
    ),
    "deit_sinusoidal": dict(
        seed=12,
        encoder="deit",
        enc_width=24,
        decoder=dict(
            cross_attention_hidden_size=24,
            use_learned_position_embeddings=False,
            tie_word_embeddings=False,
            layernorm_embedding=True,
            scale_embedding=True,
            activation_function="relu",
        ),
        generation=dict(no_repeat_ngram_size=3),
        tokenizer="vocab_merges",
    ),
    "vit_projected": dict(
        seed=13,
        encoder="vit",
        enc_width=24,
        decoder=dict(
            use_learned_position_embeddings=True,
            tie_word_embeddings=True,
            layernorm_embedding=False,
            scale_embedding=True,
            activation_function="gelu_new",
        ),
        generation=dict(),
        tokenizer="json",
    ),
}


def fix_sinusoids(model: VisionEncoderDecoderModel) -> None:
    """Rebuilds a sinusoidal table left on the meta device by from_pretrained."""
    dec = model.decoder.model.decoder
    pos = dec.embed_positions
    if isinstance(pos, TrOCRSinusoidalPositionalEmbedding):
        cfg = model.decoder.config
        pos.weights = TrOCRSinusoidalPositionalEmbedding.get_embedding(
            cfg.max_position_embeddings + PAD + 1, cfg.hidden_size, PAD
        )


def write_variant(name: str, v: dict) -> None:
    out = OUT / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tok = train_tokenizer(300)
    vocab = tok.get_vocab_size()
    torch.manual_seed(v["seed"])
    enc = encoder_config(v["encoder"], v["enc_width"])
    dec = decoder_config(vocab, **v["decoder"])
    cfg = VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id = EOS
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
        decoder_start_token_id=EOS,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        max_length=NEW_TOKENS + 1,
        **v["generation"],
    )
    model.save_pretrained(out)
    if v["tokenizer"] == "json":
        tok.save(str(out / "tokenizer.json"))
    else:
        tok.model.save(str(out))
        special = {
            "bos_token": "<s>",
            "pad_token": "<pad>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
        }
        (out / "special_tokens_map.json").write_text(json.dumps(special) + "\n")
    # TrOCR's processor is a ViTImageProcessor: bilinear resize, rescale,
    # normalise.
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
    fix_sinusoids(model)
    tied = model.decoder.output_projection.weight is model.decoder.model.decoder.embed_tokens.weight
    assert tied == v["decoder"]["tie_word_embeddings"], (name, tied)
    assert hasattr(model, "enc_to_dec_proj") == (name == "vit_projected"), name
    pixels = processor(images=Image.open(out / "image.png"), return_tensors="pt").pixel_values
    g = torch.Generator().manual_seed(v["seed"])
    forced = torch.cat([torch.tensor([[EOS]]), torch.randint(3, vocab, (1, 11), generator=g)], dim=1)
    forced[0, 5] = PAD  # fairseq's sinusoids skip padding; learned ones do not
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


BASE_VOCAB = 50265  # RoBERTa's, TrOCR-base's
BASE_SIZE = 384


def base_tokenizer(vocab_size: int) -> Tokenizer:
    """The fixtures' RoBERTa-style byte-level BPE, its vocabulary padded with
    filler tokens no merge reaches (`Ġw<i>`, decoding as ` w<i>`) to
    `vocab_size` ids, `<mask>` last as in RoBERTa."""
    spec = json.loads(train_tokenizer(300).to_str())
    vocab = spec["model"]["vocab"]
    i = 0
    while len(vocab) < vocab_size - 1:
        vocab.setdefault(f"\u0120w{i}", len(vocab))
        i += 1
    vocab["<mask>"] = vocab_size - 1
    assert sorted(vocab.values()) == list(range(vocab_size))
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens(["<mask>"])
    assert [tok.token_to_id(s) for s in SPECIALS + ["<mask>"]] == [0, 1, 2, 3, vocab_size - 1]
    assert tok.get_vocab_size(True) == vocab_size, tok.get_vocab_size(True)
    return tok


def write_base(out: Path) -> None:
    """A TrOCR-base-shaped checkpoint (random weights) for the benchmarks."""
    out.mkdir(parents=True, exist_ok=True)
    tok = base_tokenizer(BASE_VOCAB)
    torch.manual_seed(0)
    enc = ViTConfig(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        image_size=BASE_SIZE,
        patch_size=16,
        qkv_bias=False,
        initializer_range=0.02,
    )
    dec = TrOCRConfig(
        vocab_size=BASE_VOCAB,
        d_model=1024,
        decoder_layers=12,
        decoder_attention_heads=16,
        decoder_ffn_dim=4096,
        max_position_embeddings=512,
        activation_function="gelu",
        use_learned_position_embeddings=True,
        layernorm_embedding=True,
        scale_embedding=False,
        tie_word_embeddings=True,
        cross_attention_hidden_size=768,
        init_std=0.02,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        decoder_start_token_id=EOS,
    )
    cfg = VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id = EOS
    cfg.pad_token_id = PAD
    cfg.eos_token_id = EOS
    model = VisionEncoderDecoderModel(cfg).eval()
    model.generation_config = GenerationConfig(
        decoder_start_token_id=EOS,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        max_new_tokens=16,
    )
    model.save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    ViTImageProcessor(
        size={"height": BASE_SIZE, "width": BASE_SIZE},
        resample=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    ).save_pretrained(out)
    test_image(BASE_SIZE, 0).save(out / "image.png")
    print("TrOCR base checkpoint in", out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=Path,
                    help="write only the TrOCR-base-shaped benchmark checkpoint, here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.base:
        torch.set_num_threads(2)
        write_base(args.base)
        return
    for name, v in VARIANTS.items():
        write_variant(name, v)


if __name__ == "__main__":
    main()
