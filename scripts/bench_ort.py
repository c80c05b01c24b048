#!/usr/bin/env python3
"""ONNX Runtime on the checkpoint that bench_vs_torch.py measures (ViT + GPT-2,
as `scripts/hf_fixtures.py` writes it), f32 and dynamic int8, timed as
bench_vs_torch.py times torch: prints a table and writes the raw figures as
JSON under the same key names.

optimum-onnx 0.1 pins transformers < 4.58, so it gets its own venv (about 1.5
minutes to install; torch from plain PyPI is fine, only its CPU side is
used):

    python3 -m venv ../venv-ort
    ../venv-ort/bin/pip install optimum-onnx onnxruntime accelerate torch pillow
    # ViT-B/16 224 + GPT-2 small, as for bench_vs_torch.py (~1 GB; also
    # rewrites tests/fixtures/hf: `git checkout tests/fixtures`)
    .venv/bin/python scripts/hf_fixtures.py --base /tmp/vit-gpt2-base
    ../venv-ort/bin/python scripts/bench_ort.py /tmp/vit-gpt2-base --threads 2
    # the parity check alone, on the tiny fixture (seconds)
    ../venv-ort/bin/python scripts/bench_ort.py tests/fixtures/hf/equal --check

The graphs: optimum's `image-to-text-with-past` export (what
`optimum-cli export onnx --task image-to-text-with-past` writes; accelerate
lets it keep GPT-2's tied embedding once): `encoder_model.onnx` and
`decoder_with_past_model.onnx`, the decoder's first step on an empty past
(the same logits as `decoder_model.onnx`). Not the merged decoder that
optimum's ORTModelForVision2Seq loads by default: quantize_dynamic leaves
the MatMuls inside its If branches in f32. The int8 variant is
`onnxruntime.quantization.quantize_dynamic` on the two graphs: int8 weights
per output channel (`--per-tensor` for quantize_dynamic's default),
activations quantized to uint8 at run time, executed by MLAS's integer GEMM
(VNNI where the CPU has it). Exports and quantized graphs are kept under
`--onnx-dir` and redone when the checkpoint is newer.

Sessions: CPU execution provider, `intra_op_num_threads` = `--threads`,
`inter_op_num_threads` = 1, sequential execution, all graph optimizations.

What is timed, from the fixed synthetic image bench_vs_torch.py uses, at the
model's input size, with 16 new tokens (median of `--repeats`; the least is
recorded beside it as `*_least`):
- encode ms: the encoder session alone.
- decode ms/token: (greedy k=17 tokens - greedy k=1 token) / 16, both from
  the same encoder output. The greedy loop is this script's own, not
  optimum's generate: IO binding, each step's present key/values bound as
  the next step's past as they are (no copy through numpy), only the logits
  read back. It never stops at the end token. optimum's GPT-2 export carries
  only the self-attention past, so every step recomputes the cross-attention
  keys and values from the encoder output (at ViT-B/16 224: 197 rows through
  12 layers' 768 x 1536 projections, ~5.6 GFLOP a step): part of this figure
  is the export's, not ONNX Runtime's.
- caption ms: encode + 16 tokens from pixel values.
- images/s: the same for a batch of `--batch` copies of the image.
Every measurement runs in its own process (a fresh peak-RSS counter).

Before timing (skip with `--skip-check`), a check in its own process: the
f32 graphs' greedy ids must equal transformers' greedy ids on the same
pixels (and, for a fixture directory, transformers' committed
`expected.json` ids on its committed pixels); the int8 ids' agreement with
f32 is reported, not required.
"""

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from statistics import median

from bench_vs_torch import NEW_TOKENS, machine, run_json, timings, write_results

ROOT = Path(__file__).resolve().parent.parent
ENCODER = "encoder_model.onnx"
DECODER = "decoder_with_past_model.onnx"
VARIANTS = {"ort-f32": "ort f32", "ort-int8": "ort int8"}
PAST, PRESENT = "past_key_values.", "present."


def checkpoint(model_dir: Path) -> dict:
    """What the graphs do not say: input size, start token, weights size."""
    cfg = json.loads((model_dir / "config.json").read_text())
    side = cfg["encoder"]["image_size"]
    start = cfg.get("decoder_start_token_id")
    if start is None:
        start = cfg["decoder"]["bos_token_id"]
    weights = sum(p.stat().st_size for p in model_dir.glob("model*.safetensors")) / 2**20
    return dict(side=side, start=start, weights_mb=weights)


def synthetic_pixels(side: int, batch: int = 1):
    """bench_vs_torch.py's image: a ramp over (1, 3, side, side), repeated."""
    import numpy as np

    n = 3 * side * side
    px = (np.arange(n, dtype=np.float32) / n - 0.5).reshape(1, 3, side, side)
    return np.ascontiguousarray(np.repeat(px, batch, axis=0))


def graph_dirs(onnx_dir: Path, per_channel: bool) -> dict:
    int8 = onnx_dir / ("int8-per-channel" if per_channel else "int8-per-tensor")
    return {"ort-f32": onnx_dir / "f32", "ort-int8": int8}


def stale(out: Path, source: Path) -> bool:
    """Whether `out` is missing or older than any file of `source`."""
    if not out.exists():
        return True
    return out.stat().st_mtime < max(p.stat().st_mtime for p in source.iterdir() if p.is_file())


def prepare(model_dir: Path, dirs: dict, per_channel: bool) -> dict:
    """Exports the f32 graphs and quantizes them, where stale; returns the
    seconds each step took this run."""
    took = {}
    f32, int8 = dirs["ort-f32"], dirs["ort-int8"]
    if stale(f32 / DECODER, model_dir):
        from optimum.exporters.onnx import main_export

        print(f"exporting {model_dir} to {f32}", file=sys.stderr)
        t = time.perf_counter()
        main_export(str(model_dir), output=f32, task="image-to-text-with-past")
        took["export_s"] = time.perf_counter() - t
    if stale(int8 / DECODER, f32):
        from onnxruntime.quantization import QuantType, quantize_dynamic

        print(f"quantizing to {int8}", file=sys.stderr)
        int8.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        for name in (ENCODER, DECODER):
            quantize_dynamic(f32 / name, int8 / name, per_channel=per_channel,
                             weight_type=QuantType.QInt8)
        took["quantize_s"] = time.perf_counter() - t
    return took


class Greedy:
    """optimum's decoder-with-past graph, greedy, step by step through IO
    binding.

    The encoder output and each step's present key/values stay OrtValues:
    the presents of one step are bound as the next step's past, and only the
    logits come back to numpy for the argmax. Step 0 runs on an empty past
    (past length 0).
    """

    def __init__(self, encoder, decoder):
        import numpy as np

        self.np = np
        self.encoder, self.decoder = encoder, decoder
        pasts = [i for i in decoder.get_inputs() if i.name.startswith(PAST)]
        self.past_names = [i.name for i in pasts]
        self.present_names = [PRESENT + n[len(PAST):] for n in self.past_names]
        # (batch, heads, past_len, head_dim): heads and head_dim are fixed.
        _, self.heads, _, self.head_dim = pasts[0].shape

    def encode(self, pixels):
        """pixels: (batch, 3, side, side) -> memory: (batch, image_len, hidden) OrtValue."""
        binding = self.encoder.io_binding()
        binding.bind_cpu_input("pixel_values", pixels)
        binding.bind_output("last_hidden_state")
        self.encoder.run_with_iobinding(binding)
        return binding.get_outputs()[0]

    def generate(self, memory, start: int, k: int):
        """memory: (batch, image_len, hidden) -> ids: (batch, k), k new tokens."""
        import onnxruntime as ort

        np = self.np
        batch = memory.shape()[0]
        empty = np.zeros((batch, self.heads, 0, self.head_dim), dtype=np.float32)
        past = [ort.OrtValue.ortvalue_from_numpy(empty)] * len(self.past_names)
        ids = np.full((batch, 1), start, dtype=np.int64)
        out = []
        for _ in range(k):
            binding = self.decoder.io_binding()
            binding.bind_cpu_input("input_ids", ids)
            binding.bind_ortvalue_input("encoder_hidden_states", memory)
            for name, value in zip(self.past_names, past):
                binding.bind_ortvalue_input(name, value)
            binding.bind_output("logits")
            for name in self.present_names:
                binding.bind_output(name)
            self.decoder.run_with_iobinding(binding)
            logits, *past = binding.get_outputs()  # in binding order
            ids = logits.numpy()[:, -1].argmax(-1).astype(np.int64)[:, None]  # (b, 1)
            out.append(ids)
        return np.concatenate(out, axis=1)


def sessions(graphs: Path, threads: int) -> Greedy:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    cpu = ["CPUExecutionProvider"]
    return Greedy(ort.InferenceSession(str(graphs / ENCODER), opts, providers=cpu),
                  ort.InferenceSession(str(graphs / DECODER), opts, providers=cpu))


def ort_worker(model_dir: Path, graphs: Path, threads: int, repeats: int, batch: int) -> dict:
    import resource

    import onnxruntime as ort

    ck = checkpoint(model_dir)
    t0 = time.perf_counter()
    model = sessions(graphs, threads)
    load_ms = (time.perf_counter() - t0) * 1e3
    pixels = synthetic_pixels(ck["side"])
    batch_px = synthetic_pixels(ck["side"], batch)
    start = ck["start"]

    def timed(f, reps=repeats):
        """(median, least) ms of `reps` calls after one warm-up."""
        out = timings(f, reps)
        return median(out), min(out)

    encode_ms, encode_least = timed(lambda: model.encode(pixels))
    memory = model.encode(pixels)
    for k, px in [(1, None), (NEW_TOKENS + 1, None), (2, synthetic_pixels(ck["side"], 2))]:
        mem = memory if px is None else model.encode(px)
        shape = model.generate(mem, start, k).shape
        want = (mem.shape()[0], k)
        assert shape == want, f"generate gave {shape}, want {want}"
    one, one_least = timed(lambda: model.generate(memory, start, 1))
    many, many_least = timed(lambda: model.generate(memory, start, NEW_TOKENS + 1))
    e2e_ms, e2e_least = timed(lambda: model.generate(model.encode(pixels), start, NEW_TOKENS))
    batch_ms, batch_least = timed(lambda: model.generate(model.encode(batch_px), start, NEW_TOKENS),
                                  reps=max(1, repeats // 2))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    onnx_mb = sum(p.stat().st_size for p in graphs.iterdir()
                  if p.name.startswith((ENCODER, DECODER))) / 2**20
    return dict(
        side="ort", family="vision-encoder-decoder", graphs=str(graphs), load_ms=load_ms,
        encode_ms=encode_ms, encode_ms_least=encode_least,
        ms_per_token=(many - one) / NEW_TOKENS,
        ms_per_token_least=(many_least - one_least) / NEW_TOKENS,
        e2e_ms=e2e_ms, e2e_ms_least=e2e_least,
        images_per_s=batch * 1e3 / batch_ms, images_per_s_best=batch * 1e3 / batch_least,
        peak_rss_mb=rss, weights_mb=ck["weights_mb"], rss_over_weights=rss / ck["weights_mb"],
        onnx_mb=onnx_mb, onnxruntime=ort.__version__, threads=threads,
    )


def check_worker(model_dir: Path, dirs: dict, threads: int) -> dict:
    """Greedy ids, NEW_TOKENS of them: transformers f32 against the f32
    graphs (must be equal) and the int8 graphs (reported)."""
    import numpy as np
    import torch
    from transformers import VisionEncoderDecoderModel

    torch.set_num_threads(threads)
    ck = checkpoint(model_dir)
    model = VisionEncoderDecoderModel.from_pretrained(model_dir).eval()
    pad = model.config.pad_token_id
    pixels = synthetic_pixels(ck["side"])
    with torch.inference_mode():
        want = model.generate(torch.from_numpy(pixels), max_new_tokens=NEW_TOKENS,
                              do_sample=False, num_beams=1, no_repeat_ngram_size=0,
                              eos_token_id=None, pad_token_id=0 if pad is None else pad)
    want = want[0, 1:].tolist()
    f32 = sessions(dirs["ort-f32"], threads)
    got = f32.generate(f32.encode(pixels), ck["start"], NEW_TOKENS)[0].tolist()
    int8 = sessions(dirs["ort-int8"], threads)
    got8 = int8.generate(int8.encode(pixels), ck["start"], NEW_TOKENS)[0].tolist()
    out = dict(transformers_ids=want, ort_f32_ids=got, ort_int8_ids=got8,
               f32_equal=got == want,
               int8_agreement=sum(a == b for a, b in zip(got8, got)) / NEW_TOKENS)
    # A fixture directory: its committed pixels and transformers' greedy ids
    # (those stop at the end token, hence the prefix).
    expected = model_dir / "expected.json"
    if expected.exists() and (model_dir / "expected.safetensors").exists():
        from safetensors.numpy import load_file

        px = np.ascontiguousarray(load_file(model_dir / "expected.safetensors")["pixel_values"])
        ref = json.loads(expected.read_text())["greedy"][:NEW_TOKENS]
        fixture = f32.generate(f32.encode(px), ck["start"], len(ref))[0].tolist()
        out.update(fixture_expected_ids=ref, fixture_ort_f32_ids=fixture,
                   fixture_equal=fixture == ref)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="checkpoint directory (ViT + GPT-2)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", type=Path, default=ROOT / "scripts" / "out" / "bench_ort.json")
    ap.add_argument("--onnx-dir", type=Path,
                    help="where the exported and quantized graphs live "
                         "(default: a folder per checkpoint under the temp dir)")
    ap.add_argument("--per-tensor", action="store_true",
                    help="int8 weights with one scale per tensor (quantize_dynamic's default) "
                         "instead of one per output channel")
    ap.add_argument("--configs", default=",".join(VARIANTS),
                    help=f"comma list among {','.join(VARIANTS)} (default: all)")
    ap.add_argument("--check", action="store_true", help="run the parity check only")
    ap.add_argument("--skip-check", action="store_true", help="time without the parity check")
    ap.add_argument("--worker", choices=["prepare", "ort", "check"])
    ap.add_argument("--variant", choices=list(VARIANTS))
    args = ap.parse_args()

    model_dir = args.model.resolve()
    onnx_dir = args.onnx_dir or Path(tempfile.gettempdir()) / "vl-ort" / (
        f"{model_dir.name}-{hashlib.sha1(str(model_dir).encode()).hexdigest()[:8]}")
    per_channel = not args.per_tensor
    dirs = graph_dirs(onnx_dir, per_channel)
    if args.worker == "prepare":
        print(json.dumps(prepare(model_dir, dirs, per_channel)))
        return
    if args.worker == "ort":
        print(json.dumps(ort_worker(model_dir, dirs[args.variant], args.threads,
                                    args.repeats, args.batch)))
        return
    if args.worker == "check":
        print(json.dumps(check_worker(model_dir, dirs, args.threads)))
        return

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in VARIANTS]
    if unknown:
        ap.error(f"--configs: unknown {','.join(unknown)} (known: {','.join(VARIANTS)})")

    from importlib.metadata import version

    results = {"machine": machine()}
    print(f"machine: {results['machine']}", file=sys.stderr)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    py = [sys.executable, __file__, str(model_dir), "--threads", str(args.threads),
          "--repeats", str(args.repeats), "--batch", str(args.batch), "--onnx-dir", str(onnx_dir)]
    if args.per_tensor:
        py.append("--per-tensor")
    # Exporting imports torch: in a worker of its own, since a child's peak
    # RSS counter starts from its parent's at the fork.
    results["ort setup"] = dict(
        export="optimum image-to-text-with-past", encoder=ENCODER, decoder=DECODER,
        intra_op_threads=args.threads, inter_op_threads=1,
        int8="quantize_dynamic: QInt8 weights " + ("per channel" if per_channel else "per tensor")
             + ", uint8 activations quantized at run time",
        onnx_dir=str(onnx_dir), onnxruntime=version("onnxruntime"),
        optimum_onnx=version("optimum-onnx"), transformers=version("transformers"),
        torch=version("torch"),
        **run_json(py + ["--worker", "prepare"], env))
    if not args.skip_check:
        check = results["check"] = run_json(py + ["--worker", "check"], env)
        print(f"transformers greedy ids: {check['transformers_ids']}\n"
              f"ORT f32 greedy ids:      {check['ort_f32_ids']}  equal: {check['f32_equal']}\n"
              f"ORT int8 greedy ids:     {check['ort_int8_ids']}  "
              f"agreement with f32: {check['int8_agreement']:.2f}")
        if "fixture_equal" in check:
            print(f"fixture expected.json greedy ids == ORT f32 on its pixels: "
                  f"{check['fixture_equal']}")
        if not check["f32_equal"] or not check.get("fixture_equal", True):
            sys.exit("ORT f32 greedy ids differ from transformers'")
    if args.check:
        return

    columns = []
    for cid, name in VARIANTS.items():
        if cid in configs:
            results[name] = run_json(py + ["--worker", "ort", "--variant", cid], env)
            columns.append(name)
            print(f"{name}: {results[name]}", file=sys.stderr)

    def fmt(v, spec):
        return f"{v:{spec}}" if isinstance(v, (int, float)) else f"{'-':>{spec.split('.')[0]}}"

    rows = [("encode ms", "encode_ms"), ("encode ms, least", "encode_ms_least"),
            ("decode ms/token", "ms_per_token"), ("decode ms/token, least", "ms_per_token_least"),
            (f"caption ms (encode + {NEW_TOKENS})", "e2e_ms"),
            (f"images/s, batch {args.batch}", "images_per_s"),
            ("load ms", "load_ms"), ("peak RSS MB", "peak_rss_mb"),
            ("peak RSS / weights file", "rss_over_weights"), ("ONNX graphs MB", "onnx_mb")]
    width = max([12] + [len(c) + 2 for c in columns])
    print(f"\n{'':28}" + "".join(f"{c:>{width}}" for c in columns))
    for label, key in rows:
        spec = f"{width}.2f" if key == "rss_over_weights" else f"{width}.1f"
        print(f"{label:28}" + "".join(fmt(results[c].get(key), spec) for c in columns))

    write_results(results, args.out)


if __name__ == "__main__":
    main()
