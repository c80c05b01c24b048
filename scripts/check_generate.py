#!/usr/bin/env python3
"""Checks that the vl CLI generates the same token ids as transformers'
`generate()` on checkpoints made independently of the committed fixtures.

For each checkpoint directory given, the family is read from
`config.json` (`model_type` "blip": `BlipForConditionalGeneration`;
anything else: `VisionEncoderDecoderModel`, e.g. ViT + GPT-2 or ViT + TrOCR).
The model is loaded in f32 with transformers, each image (DIR/image.png, or
the `--images` given) preprocessed with the directory's own processor
(`AutoImageProcessor`; `BlipProcessor` for BLIP, so a prompt is tokenized
as transformers does), and `generate()` run in these modes, each for
`--max-new-tokens` (default 12) new tokens:

- `greedy`:       num_beams=1, do_sample=False
- `beam3`:        num_beams=3, do_sample=False, length_penalty=1.0, and the
                  checkpoint's `early_stopping` (what vl uses: it has no flag
                  for it; False when the checkpoint sets none, as in the
                  parity fixtures' 3-beam runs)
- `greedy_nr2`, `beam3_nr2`: the same with no_repeat_ngram_size=2 (random
                  checkpoints tend to repeat one token, which hides most of
                  the search; this forces it to move on)
- BLIP only: each of the above again with the prompt "a picture of"
  (`prompt_greedy`, ...): transformers gets `BlipProcessor(images,
  text=PROMPT)`'s ids (its generate replaces [CLS] with [DEC] and drops the
  trailing [SEP]); vl gets `--prompt PROMPT`.

The other generation settings are pinned on both sides (min length 0,
repetition penalty 1, no_repeat_ngram_size 0 unless the mode sets it), so
neither side's checkpoint defaults leak in. Each run is compared with

    target/release/vl caption --model DIR IMAGE --json --max-tokens N \\
        --beams B --temperature 0 --length-penalty 1 --min-tokens 0 --repetition-penalty 1 \\
        --no-repeat-ngram-size K [--prompt PROMPT]

whose `token_ids` are the generated ids only. transformers' ids are cut the
way `scripts/*_fixtures.py` cut them for the parity tests: the start token
(for a prompt, [DEC] and the prompt's words: `len(prompt ids) - 1`) is
removed, and the rest is kept up to and including the first end token
(`eos_token_id`; BLIP's `sep_token_id`).

One line per (directory, image, mode): `OK ...` or `MISMATCH ...` with both
id lists. Exit status 1 if any mismatch (or a vl run failed), else 0.

Checkpoints (random weights, ~1 GB each, never committed):

    /work/venv/bin/python scripts/hf_fixtures.py --base /tmp/vit-gpt2-base
    /work/venv/bin/python scripts/trocr_fixtures.py --base /tmp/trocr-base
    /work/venv/bin/python scripts/blip_fixtures.py --base /tmp/blip-base

(`hf_fixtures.py --base` also rewrites tests/fixtures/hf; the other two
write only DIR.) Then, with vl built (`cargo build --release`):

    /work/venv/bin/python scripts/check_generate.py /tmp/vit-gpt2-base /tmp/trocr-base /tmp/blip-base

Options: `--vl PATH` (default target/release/vl), `--max-new-tokens N`,
`--images IMG ...` (instead of DIR/image.png; an image not at the model's
input size is resized by both sides with slightly different filters, so its
pixels, and possibly its ids, may differ), `--threads T` (torch and vl,
default 1), `--prompt TEXT`.

Needs torch, transformers, pillow (e.g. /work/venv).
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from PIL import Image
from transformers import (
    AutoImageProcessor,
    BlipForConditionalGeneration,
    BlipProcessor,
    VisionEncoderDecoderModel,
)

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "a picture of"


def fix_sinusoids(model: VisionEncoderDecoderModel) -> None:
    """TrOCR's fairseq sinusoids are a plain attribute that transformers 5
    leaves on the meta device when loading; rebuild it as a fresh model holds
    it (as scripts/trocr_fixtures.py does)."""
    try:
        from transformers.models.trocr.modeling_trocr import TrOCRSinusoidalPositionalEmbedding
    except ImportError:
        return
    if model.decoder.config.model_type != "trocr":
        return
    pos = model.decoder.model.decoder.embed_positions
    if isinstance(pos, TrOCRSinusoidalPositionalEmbedding):
        cfg = model.decoder.config
        pad = cfg.pad_token_id
        pos.weights = TrOCRSinusoidalPositionalEmbedding.get_embedding(
            cfg.max_position_embeddings + pad + 1, cfg.hidden_size, pad
        )


def load_model(d: Path):
    """The f32 model of a checkpoint directory, its processor and whether it
    is BLIP (`model_type` "blip") rather than a VisionEncoderDecoderModel."""
    cfg = json.loads((d / "config.json").read_text())
    if cfg.get("model_type") == "blip":
        model = BlipForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
        return model, BlipProcessor.from_pretrained(d), True
    model = VisionEncoderDecoderModel.from_pretrained(d, dtype=torch.float32).eval()
    fix_sinusoids(model)
    return model, AutoImageProcessor.from_pretrained(d), False


def checkpoint_early_stopping(d: Path) -> bool | str:
    """The `early_stopping` vl takes for a VisionEncoderDecoder checkpoint:
    generation_config.json's, else config.json's, else False."""
    for name in ["generation_config.json", "config.json"]:
        p = d / name
        if p.exists():
            v = json.loads(p.read_text())
            if "early_stopping" in v:
                return v["early_stopping"]
            if name == "generation_config.json":
                break
    return False


def cut(ids: list, prefix: int, eos: set) -> list:
    """Drops the first `prefix` ids; keeps up to and including the first end
    token."""
    ids = ids[prefix:]
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


def as_set(x) -> set:
    if x is None:
        return set()
    return set(x) if isinstance(x, (list, tuple)) else {x}


def run_vl(vl: str, d: Path, image: Path, n: int, beams: int, nr: int, threads: int,
           prompt: str | None) -> tuple[list | None, str]:
    cmd = [vl, "caption", "--model", str(d), str(image), "--json", "--threads", str(threads),
           "--batch-size", "1", "--max-tokens", str(n), "--beams", str(beams),
           "--temperature", "0", "--length-penalty", "1", "--min-tokens", "0", "--repetition-penalty", "1",
           "--no-repeat-ngram-size", str(nr)]
    if prompt is not None:
        cmd += ["--prompt", prompt]
    r = subprocess.run(cmd, capture_output=True, text=True)
    lines = [l for l in r.stdout.splitlines() if l.strip()]
    if r.returncode != 0 or not lines:
        return None, f"vl exit {r.returncode}: {r.stderr.strip()[-400:]}"
    out = json.loads(lines[-1])
    if "token_ids" not in out:
        return None, f"vl error: {out.get('error')}"
    return out["token_ids"], ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--images", nargs="+", type=Path, help="default: DIR/image.png")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--vl", default=str(ROOT / "target" / "release" / "vl"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", default=PROMPT)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n = args.max_new_tokens
    bad = 0

    modes = [("greedy", 1, 0), ("beam3", 3, 0), ("greedy_nr2", 1, 2), ("beam3_nr2", 3, 2)]
    for d in args.dirs:
        model, processor, blip = load_model(d)
        if blip:
            eos = as_set(model.config.text_config.sep_token_id)
            early = False  # vl reads no generation_config.json for BLIP
        else:
            eos = as_set(model.generation_config.eos_token_id) or as_set(model.config.eos_token_id)
            early = checkpoint_early_stopping(d)
        images = args.images or [d / "image.png"]
        for image in images:
            img = Image.open(image).convert("RGB")
            prompts = [None, args.prompt] if blip else [None]
            for prompt in prompts:
                if blip and prompt is not None:
                    inputs = processor(images=img, text=prompt, return_tensors="pt")
                    # BLIP's generate feeds [DEC] + the words ([SEP] dropped).
                    prefix = inputs["input_ids"].shape[1] - 1
                elif blip:
                    inputs = processor(images=img, return_tensors="pt")
                    prefix = 1
                else:
                    inputs = processor(images=img, return_tensors="pt")
                    prefix = 1
                pixels = inputs["pixel_values"]
                for mode, beams, nr in modes:
                    kw = dict(max_new_tokens=n, num_beams=beams, do_sample=False,
                              no_repeat_ngram_size=nr, min_length=0, repetition_penalty=1.0)
                    if beams > 1:
                        kw.update(length_penalty=1.0, early_stopping=early)
                    with torch.no_grad():
                        if blip and prompt is not None:
                            out = model.generate(pixel_values=pixels,
                                                 input_ids=inputs["input_ids"].clone(),
                                                 attention_mask=inputs["attention_mask"].clone(),
                                                 **kw)
                        else:
                            out = model.generate(pixels, **kw)
                    want = cut(out[0].tolist(), prefix, eos)
                    got, err = run_vl(args.vl, d, image, n, beams, nr, args.threads, prompt)
                    name = ("prompt_" if prompt is not None else "") + mode
                    if got == want:
                        print(f"OK        {d} {image.name} {name}: {got}", flush=True)
                    else:
                        bad += 1
                        print(f"MISMATCH  {d} {image.name} {name}: vl {got} transformers {want}"
                              + (f" ({err})" if err else ""), flush=True)
        del model
    print(f"{bad} mismatch(es)" if bad else "all OK", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
