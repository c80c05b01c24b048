#!/usr/bin/env python3
"""Images/s of the Python package next to the `vl` command and to
transformers' `model.generate`, on one checkpoint, in one run, with the
same images, threads, batch size and token count.

    cargo build --release -p vl-cli
    pip install ./python            # into the venv that has torch + transformers
    .venv/bin/python scripts/hf_fixtures.py --base /tmp/vit-gpt2-base && git checkout tests/fixtures
    .venv/bin/python scripts/bench_python.py /tmp/vit-gpt2-base --threads 2

What is timed (each side in its own process; the least of `--repeats`):
- vl (command): `vl caption --model DIR --batch-size B --max-tokens T
  --min-tokens T` over B and over B + N images, each a whole process; the
  difference cancels the process start, the model load and the first
  batch's warm-up.
- vl (Python): the same, measured the same way: a process that imports
  vl, `vl.load`s the model and calls `Model.caption(paths, batch_size=B,
  max_tokens=T, min_tokens=T)` over B and over B + N images. The two vl
  sides run interleaved, each the least of `--repeats`.
- transformers: per batch of B images, the checkpoint's image processor on
  the decoded images, then `model.generate(pixel_values,
  max_new_tokens=T, min_new_tokens=T, do_sample=False, num_beams=1)`;
  decoding the files is not timed on this side (it is on vl's).
Every caption has exactly T tokens (random weights never end early then).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make_images(folder: Path, n: int) -> list:
    """`n` deterministic 640x480 PNGs: gradients with a few rectangles."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        y, x = np.mgrid[0:480, 0:640]
        img = np.stack([(x * (i + 1)) % 256, (y * 3 + i * 17) % 256, (x + y) % 256], -1)
        img = img.astype(np.uint8)
        for _ in range(4):
            x0, y0 = rng.integers(0, 560), rng.integers(0, 400)
            img[y0 : y0 + 80, x0 : x0 + 80] = rng.integers(0, 256, 3)
        p = folder / f"img_{i:03d}.png"
        Image.fromarray(img).save(p)
        paths.append(str(p))
    return paths


def python_worker(a) -> dict:
    """One whole process, as `vl caption` is: load, caption the paths."""
    import vl

    paths = json.loads(Path(a.paths).read_text())
    model = vl.load(a.model, quantize=a.quantize, threads=a.threads)
    out = model.caption(paths, batch_size=a.batch, max_tokens=a.tokens, min_tokens=a.tokens)
    assert all(len(r["token_ids"]) == a.tokens for r in out), "a caption ended early"
    return {"images": len(out)}


def python_seconds(a, paths: list, quantize, env) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(paths, f)
        f.flush()
        cmd = [sys.executable, __file__, a.model, "--worker", "python", "--paths", f.name,
               "--threads", str(a.threads), "--batch", str(a.batch), "--tokens", str(a.tokens)]
        if quantize:
            cmd += ["--quantize", quantize]
        t = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        elapsed = time.perf_counter() - t
    if out.returncode != 0:
        sys.exit(f"python worker failed:\n{out.stderr}")
    return elapsed


def torch_worker(a) -> dict:
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, VisionEncoderDecoderModel

    torch.set_num_threads(a.threads)
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    paths = json.loads(Path(a.paths).read_text())
    images = [Image.open(p).convert("RGB") for p in paths]
    proc = AutoImageProcessor.from_pretrained(a.model)
    model = VisionEncoderDecoderModel.from_pretrained(a.model, dtype=dt).eval()
    gen = dict(max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False, num_beams=1,
               pad_token_id=0)

    def run(batch):
        px = proc(images=batch, return_tensors="pt").pixel_values.to(dt)
        return model.generate(px, **gen)

    with torch.inference_mode():
        run(images[: a.batch])
        best = float("inf")
        for _ in range(a.repeats):
            t = time.perf_counter()
            for i in range(0, len(images), a.batch):
                out = run(images[i : i + a.batch])
            best = min(best, time.perf_counter() - t)
    assert out.shape[1] == a.tokens + 1, out.shape
    return {"images_per_s": len(images) / best, "seconds": best, "torch": torch.__version__}


def cli_seconds(vl_bin: str, a, paths: list, quantize) -> float:
    cmd = [vl_bin, "caption", "--model", a.model, "--threads", str(a.threads),
           "--batch-size", str(a.batch), "--max-tokens", str(a.tokens),
           "--min-tokens", str(a.tokens), "--json"]
    if quantize:
        cmd += ["--quantize", quantize]
    t = time.perf_counter()
    out = subprocess.run(cmd + paths, capture_output=True, text=True)
    elapsed = time.perf_counter() - t
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} … failed:\n{out.stderr}")
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert all(len(r["token_ids"]) == a.tokens for r in lines), "a caption ended early"
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vl-bin", default=str(ROOT / "target" / "release" / "vl"))
    ap.add_argument("--quantize", action="append", default=None,
                    help="vl formats besides f32 (default: q8_0)")
    ap.add_argument("--worker", choices=["python", "torch"])
    ap.add_argument("--paths")
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    a = ap.parse_args()
    if a.worker == "python":
        a.quantize = a.quantize[0] if a.quantize else None
        print(json.dumps(python_worker(a)))
        return
    if a.worker == "torch":
        print(json.dumps(torch_worker(a)))
        return

    env = dict(os.environ, RAYON_NUM_THREADS=str(a.threads), OMP_NUM_THREADS=str(a.threads))
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((l.split(":", 1)[1].strip() for l in lscpu.splitlines() if l.startswith("Model name")), "?")
    load_before = os.getloadavg()[0]
    formats = [None] + (a.quantize or ["q8_0"])
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_images(Path(tmp), a.images + a.batch)
        warm, timed = paths[: a.batch], paths[a.batch :]
        listed = Path(tmp) / "paths.json"
        listed.write_text(json.dumps(timed))
        base = [sys.executable, __file__, a.model, "--threads", str(a.threads), "--batch", str(a.batch),
                "--tokens", str(a.tokens), "--repeats", str(a.repeats), "--paths", str(listed)]

        def worker(args):
            out = subprocess.run(base + args, capture_output=True, text=True, env=env)
            if out.returncode != 0:
                sys.exit(f"worker {args} failed:\n{out.stderr}")
            return json.loads(out.stdout.strip().splitlines()[-1])

        for q in formats:
            name = f"vl {q or 'f32'}"
            best = {k: float("inf") for k in ("cs", "cl", "ps", "pl")}
            for _ in range(a.repeats):
                best["cs"] = min(best["cs"], cli_seconds(a.vl_bin, a, warm, q))
                best["ps"] = min(best["ps"], python_seconds(a, warm, q, env))
                best["cl"] = min(best["cl"], cli_seconds(a.vl_bin, a, warm + timed, q))
                best["pl"] = min(best["pl"], python_seconds(a, warm + timed, q, env))
            results[f"{name} (command)"] = {"images_per_s": len(timed) / (best["cl"] - best["cs"]),
                                            "seconds": best}
            results[f"{name} (Python)"] = {"images_per_s": len(timed) / (best["pl"] - best["ps"])}
        for dt in ("f32", "bf16"):
            results[f"transformers {dt}"] = worker(["--worker", "torch", "--dtype", dt])
    load_after = os.getloadavg()[0]
    print(f"{cpu}; {a.threads} threads; batch {a.batch}; {a.images} images; {a.tokens} tokens each; "
          f"load average {load_before:.2f} -> {load_after:.2f}")
    print(f"{'':28} {'images/s':>9}")
    for k, v in results.items():
        print(f"{k:28} {v['images_per_s']:9.2f}")
    for q in formats:
        name = f"vl {q or 'f32'}"
        ratio = results[f"{name} (Python)"]["images_per_s"] / results[f"{name} (command)"]["images_per_s"]
        print(f"{name}: Python / command = {ratio:.3f} (target >= 0.95)")
    for q in formats:
        name = f"vl {q or 'f32'}"
        for dt in ("f32", "bf16"):
            r = results[f"{name} (Python)"]["images_per_s"] / results[f"transformers {dt}"]["images_per_s"]
            print(f"{name} (Python) / transformers {dt} = {r:.2f}")
    if a.json:
        a.json.write_text(json.dumps({"cpu": cpu, "load": [load_before, load_after], **results}, indent=1))


if __name__ == "__main__":
    main()
