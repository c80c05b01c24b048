#!/usr/bin/env python3
"""Writes the document-model parity fixtures under tests/fixtures/document/.

Tiny VisionEncoderDecoder checkpoints shaped as Donut and Nougat: a
`donut-swin` encoder (transformers' `DonutSwinModel`) under an mBART
decoder (`MBartForCausalLM`), each with its own image processor's
`preprocessor_config.json`, the byte-level BPE of
`scripts/trocr_fixtures.py` plus Donut-style task tokens, and test images
whose processing needs no resampling (`image.png`: pixels compared
exactly) or does (`other_*.png`: pixels compared loosely, ids exactly).

- `donut/`: Swin 64x48 (height x width), patch 4, embed 16, depths 2/2,
  heads 2/4, window 3, 32 wide = d_model 32 (no projection), LM head
  untied, `scale_embedding`, relu (a tied head this small repeats its
  first token; `scripts/mbart_fixtures.py` covers tied heads).
  `DonutImageProcessor` with `do_align_long_axis`, thumbnail and padding,
  its size written as Donut's checkpoints do (`[width, height]`).
  `image.png` is 56x48 (width x height): rotated, then padded. Task tokens
  `<s_cord-v2>`, `<s_menu>`, `</s_menu>`, `<s_nm>`, `</s_nm>` added as
  special tokens; `expected.json` holds a prompted generation too (the
  prompt replaces the start token, as transformers' generate does for a
  `donut` encoder), with its text and JSON as `DonutProcessor` reads them
  (`batch_decode`, end and padding tokens and the first tag removed,
  `token2json`).
- `nougat/`: Swin 64x48, patch 4, embed 12, depths 2/2, heads 2/3, window
  3, 24 wide under d_model 32 (`enc_to_dec_proj`), LM head untied.
  `NougatImageProcessor` with its defaults (crop margin, thumbnail, pad;
  ImageNet's mean and std, left out of the file so that vl's defaults are
  what is tested; the class named by `processor_class` only, as some
  files do). `image.png` is 80x90 white with a 48x60 block of content:
  cropped, then padded.

Each directory: the checkpoint, `tokenizer.json`,
`preprocessor_config.json`, the images, `expected.safetensors` (pixels of
each image, the encoder's last hidden state before any projection,
teacher-forced ids and logits) and `expected.json` (greedy, 3-beam and
default ids after the start token, the defaults' text, each other image's
greedy ids; Nougat's default text after `post_process_generation`).

    /work/venv/bin/python scripts/document_fixtures.py
    /work/venv/bin/python scripts/document_fixtures.py --base DIR

`--base DIR` writes instead base-size random checkpoints for
`scripts/bench_vs_torch.py` (never committed): `DIR/donut-base` (Donut's
Swin: 128 wide, depths 2/2/14/2, heads 4/8/16/32, window 10, a 1280x960
input as Donut's fine-tunes; an mBART decoder of 4 layers, width 1024, 16
heads, Donut's 57,525-token vocabulary, 1,536 positions, tied head) and
`DIR/nougat-small` (the same Swin at 896x672 with window 7; 4 layers,
3,584 positions, 50,000 tokens, untied head), each with its processor's
config and a byte-level vocabulary of that size.
"""

import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from safetensors.torch import save_file
from tokenizers import AddedToken
from transformers import (
    DonutImageProcessor,
    DonutProcessor,
    DonutSwinConfig,
    GenerationConfig,
    MBartConfig,
    NougatImageProcessor,
    NougatTokenizer,
    PreTrainedTokenizerFast,
    VisionEncoderDecoderConfig,
    VisionEncoderDecoderModel,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trocr_fixtures import BOS, EOS, NEW_TOKENS, PAD, train_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "document"
HEIGHT, WIDTH = 64, 48
TASK_TOKENS = ["<s_cord-v2>", "<s_menu>", "</s_menu>", "<s_nm>", "</s_nm>"]


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    """Smooth colour fields plus noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    y, x = y / height, x / width
    base = np.stack([x, y, 1 - x * y], axis=-1) * 200
    noise = rng.integers(0, 56, size=(height, width, 3))
    return Image.fromarray((base + noise).clip(0, 255).astype(np.uint8), "RGB")


def page_image(width: int, height: int, box: tuple, seed: int) -> Image.Image:
    """A white page with a block of dark content at `box` (x, y, w, h), its
    four corners darkest so that the content's bounding box is the block."""
    rng = np.random.default_rng(seed)
    page = np.full((height, width, 3), 255, dtype=np.uint8)
    x, y, w, h = box
    block = rng.integers(0, 256, size=(h, w, 3)).astype(np.uint8)
    for cy, cx in [(0, 0), (0, w - 1), (h - 1, 0), (h - 1, w - 1)]:
        block[cy, cx] = rng.integers(0, 40, size=3)
    # The block's border rows and columns also light, so that only the
    # corners decide the box.
    page[y:y + h, x:x + w] = block
    return Image.fromarray(page, "RGB")


VARIANTS = {
    "donut": dict(
        seed=35,
        swin=dict(embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=3),
        decoder=dict(tie_word_embeddings=False, scale_embedding=True, activation_function="relu"),
        generation=dict(num_beams=1),
        images={
            "image.png": lambda s: noise_image(56, 48, s),
            "other_0.png": lambda s: noise_image(100, 70, s + 1),
            "other_1.png": lambda s: noise_image(30, 90, s + 2),
        },
    ),
    "nougat": dict(
        seed=32,
        swin=dict(embed_dim=12, depths=[2, 2], num_heads=[2, 3], window_size=3),
        decoder=dict(tie_word_embeddings=False, scale_embedding=False, activation_function="gelu"),
        generation=dict(num_beams=1, bad_words_ids=[[3]]),
        images={
            "image.png": lambda s: page_image(80, 90, (13, 17, 48, 60), s),
            "other_0.png": lambda s: page_image(200, 150, (30, 20, 120, 100), s + 1),
            "other_1.png": lambda s: noise_image(40, 40, s + 2),
        },
    ),
}


def processor_for(name: str, out: Path):
    """Writes the variant's preprocessor_config.json as its checkpoints
    have it; returns transformers' processor read back from it."""
    if name == "donut":
        p = DonutImageProcessor(size={"height": HEIGHT, "width": WIDTH}, do_align_long_axis=True,
                                resample=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
        p.save_pretrained(out)
        path = out / "preprocessor_config.json"
        cfg = json.loads(path.read_text())
        cfg["size"] = [WIDTH, HEIGHT]  # Donut's checkpoints: [width, height]
        path.write_text(json.dumps(cfg, indent=2) + "\n")
        back = DonutImageProcessor.from_pretrained(out)
    else:
        p = NougatImageProcessor(size={"height": HEIGHT, "width": WIDTH})
        p.save_pretrained(out)
        path = out / "preprocessor_config.json"
        cfg = json.loads(path.read_text())
        for key in ["image_mean", "image_std", "do_crop_margin", "do_thumbnail", "do_pad",
                    "image_processor_type"]:
            cfg.pop(key, None)  # vl's defaults for Nougat's processor are tested
        cfg["processor_class"] = "NougatProcessor"  # the class named as older files do
        path.write_text(json.dumps(cfg, indent=2) + "\n")
        back = NougatImageProcessor.from_pretrained(out)
    assert (back.size["height"], back.size["width"]) == (HEIGHT, WIDTH), back.size
    print(name, type(back).__name__, dict(back.size))
    return back


def write_variant(name: str, v: dict) -> None:
    out = OUT / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tok = train_tokenizer(300)
    tok.add_special_tokens([AddedToken(t, special=True) for t in TASK_TOKENS])
    vocab = tok.get_vocab_size()
    torch.manual_seed(v["seed"])
    enc = DonutSwinConfig(image_size=[HEIGHT, WIDTH], patch_size=4, num_channels=3, mlp_ratio=2.0,
                          use_absolute_embeddings=False, drop_path_rate=0.0, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, **v["swin"])
    dec = MBartConfig(
        vocab_size=vocab,
        d_model=32,
        decoder_layers=2,
        decoder_attention_heads=4,
        decoder_ffn_dim=64,
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
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.startswith("encoder."):
                # Swin's tables and biases start at zero: draw them all.
                if "norm" in pname and pname.endswith("weight"):
                    p.copy_(1.0 + 0.3 * torch.randn_like(p))
                else:
                    p.normal_(0, 0.3 if p.dim() < 2 else (1.0 / p.shape[-1]) ** 0.5)
            elif "norm" in pname:
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
    processor = processor_for(name, out)
    for file, make in v["images"].items():
        make(v["seed"]).save(out / file)

    model = VisionEncoderDecoderModel.from_pretrained(out).eval()
    assert type(model.encoder).__name__ == "DonutSwinModel", type(model.encoder)
    assert hasattr(model, "enc_to_dec_proj") == (name == "nougat"), name

    def pixels_of(file: str) -> torch.Tensor:
        return processor(images=Image.open(out / file), return_tensors="pt").pixel_values

    pixels = pixels_of("image.png")
    assert pixels.shape[-2:] == (HEIGHT, WIDTH), pixels.shape
    g = torch.Generator().manual_seed(v["seed"])
    forced = torch.cat([torch.tensor([[BOS]]), torch.randint(3, vocab, (1, 11), generator=g)], dim=1)

    def after(ids: torch.Tensor, skip: int = 1) -> list:
        ids = ids[0].tolist()[skip:]
        return ids[: ids.index(EOS) + 1] if EOS in ids else ids

    tensors = {"decoder_input_ids": forced.to(torch.int64)}
    expected = {"others": {}}
    with torch.no_grad():
        tensors["pixel_values"] = pixels
        tensors["encoder_last_hidden_state"] = model.encoder(pixel_values=pixels).last_hidden_state
        tensors["logits"] = model(pixel_values=pixels, decoder_input_ids=forced).logits
        greedy = model.generate(pixels, max_new_tokens=NEW_TOKENS, num_beams=1, do_sample=False,
                                no_repeat_ngram_size=0, min_length=0, bad_words_ids=None)
        beam = model.generate(pixels, max_new_tokens=NEW_TOKENS, num_beams=3, do_sample=False,
                              length_penalty=1.0, early_stopping=False, no_repeat_ngram_size=0,
                              bad_words_ids=None)
        defaults = model.generate(pixels)
        for file in v["images"]:
            if file == "image.png":
                continue
            px = pixels_of(file)
            stem = file.removesuffix(".png")
            tensors[f"pixel_values_{stem}"] = px
            out_ids = model.generate(px, max_new_tokens=NEW_TOKENS, num_beams=1, do_sample=False,
                                     no_repeat_ngram_size=0, min_length=0, bad_words_ids=None)
            expected["others"][file] = after(out_ids)
        if name == "donut":
            prompt = tok.encode("<s_cord-v2>", add_special_tokens=False).ids
            assert len(prompt) == 1, prompt
            prompted = model.generate(pixels, decoder_input_ids=torch.tensor([prompt]),
                                      max_new_tokens=NEW_TOKENS, num_beams=1, do_sample=False)
            assert prompted[0, 0].item() == prompt[0], "a donut encoder's prompt replaces the start"
            expected["prompt"] = "<s_cord-v2>"
            expected["prompted"] = after(prompted, len(prompt))
            # As Donut's model cards read the output.
            fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>",
                                           bos_token="<s>", unk_token="<unk>")
            donut = DonutProcessor(image_processor=processor, tokenizer=fast)
            seq = donut.batch_decode(prompted)[0]
            seq = seq.replace(fast.eos_token, "").replace(fast.pad_token, "")
            seq = re.sub(r"<.*?>", "", seq, count=1).strip()
            expected["prompted_text"] = seq
            expected["prompted_json"] = donut.token2json(seq)
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(out / "expected.safetensors"))
    expected.update({
        "greedy": after(greedy),
        "beam3": after(beam),
        "defaults": after(defaults),
        "defaults_text": tok.decode(after(defaults), skip_special_tokens=True),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    })
    if name == "nougat":
        # As NougatProcessor reads a page (the nltk words corpus absent:
        # transformers' fallback branch, see scripts/nougat_fixtures.py).
        expected["defaults_markdown"] = NougatTokenizer().post_process_generation(
            expected["defaults_text"], fix_markdown=True)
    (out / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")
    print(name, json.dumps(expected))


BASES = {
    "donut-base": dict(size=(1280, 960), window=10, vocab=57525, positions=1536, tied=True,
                       processor="donut"),
    "nougat-small": dict(size=(896, 672), window=7, vocab=50000, positions=3584, tied=False,
                         processor="nougat"),
}


def base_tokenizer(vocab: int):
    """A byte-level BPE of `vocab` tokens without merges: the specials, the
    256 byte symbols, then filler tokens (generation needs the size, not
    the words)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    names = ["<s>", "<pad>", "</s>", "<unk>"] + sorted(alphabet)
    names += [f"tok{i}" for i in range(vocab - len(names))]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(names)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    assert tok.get_vocab_size() == vocab
    return tok


def write_base(root: Path) -> None:
    for name, b in BASES.items():
        out = root / name
        out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(7)
        height, width = b["size"]
        enc = DonutSwinConfig(image_size=[height, width], patch_size=4, num_channels=3, embed_dim=128,
                              depths=[2, 2, 14, 2], num_heads=[4, 8, 16, 32], window_size=b["window"],
                              mlp_ratio=4.0, use_absolute_embeddings=False, drop_path_rate=0.0)
        dec = MBartConfig(vocab_size=b["vocab"], d_model=1024, decoder_layers=4, decoder_attention_heads=16,
                          decoder_ffn_dim=4096, encoder_layers=4, encoder_attention_heads=16,
                          encoder_ffn_dim=4096, max_position_embeddings=b["positions"], scale_embedding=True,
                          tie_word_embeddings=b["tied"], pad_token_id=PAD, bos_token_id=BOS,
                          eos_token_id=EOS, decoder_start_token_id=BOS)
        cfg = VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
        cfg.decoder_start_token_id, cfg.pad_token_id, cfg.eos_token_id = BOS, PAD, EOS
        cfg.tie_word_embeddings = b["tied"]
        model = VisionEncoderDecoderModel(cfg).eval()
        model.generation_config = GenerationConfig(decoder_start_token_id=BOS, bos_token_id=BOS,
                                                   eos_token_id=EOS, pad_token_id=PAD,
                                                   max_length=b["positions"])
        model.save_pretrained(out)
        base_tokenizer(b["vocab"]).save(str(out / "tokenizer.json"))
        size = {"height": height, "width": width}
        if b["processor"] == "donut":
            DonutImageProcessor(size=size).save_pretrained(out)
        else:
            NougatImageProcessor(size=size).save_pretrained(out)
        print(name, "in", out)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--base":
        write_base(Path(sys.argv[2]))
        return
    for name, v in VARIANTS.items():
        write_variant(name, v)


if __name__ == "__main__":
    main()
