#!/usr/bin/env python3
"""Where ONNX Runtime's time goes in an exported encoder: its own profiler's
per-node kernel times, summed per encode by operator and by node (the layer
index folded away), beside the encode's wall time.

The encoder graph is the one `scripts/bench_ort.py` exports (optimum's
`encoder_model.onnx`, f32 or dynamic int8), e.g.

    /work/venv-ort/bin/python scripts/ort_profile.py \\
        /tmp/vl-ort/vit-gpt2-base-*/f32/encoder_model.onnx --threads 2

Two intra-op threads and one inter-op thread, as `bench_ort.py` times it.
The input is one random image at the encoder's input size (the export's
`config.json`, beside the graph, where the graph leaves it open); the first
`--warmup` runs are left out of the sums. The profiler's JSON is written
under the system's temp directory and its path printed.
"""

import argparse
import collections
import json
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort


def input_shape(encoder: Path, dims: list) -> list:
    """The pixel input's shape: the graph's own sizes where it fixes them,
    else one image at the size the export's `config.json` (beside the
    graph) gives its encoder."""
    if all(isinstance(d, int) for d in dims):
        return dims
    cfg = json.loads((encoder.parent / "config.json").read_text())
    enc = cfg.get("encoder", cfg)
    size = enc.get("image_size", 224)
    return [1, enc.get("num_channels", 3), size, size]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("encoder", type=Path, help="an exported encoder_model.onnx")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads")
    ap.add_argument("--repeats", type=int, default=10, help="timed encodes")
    ap.add_argument("--warmup", type=int, default=3, help="encodes left out first")
    ap.add_argument("--top", type=int, default=12, help="nodes listed")
    args = ap.parse_args()

    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    so.inter_op_num_threads = 1
    so.enable_profiling = True
    so.profile_file_prefix = str(Path(tempfile.gettempdir()) / "ort_profile")
    session = ort.InferenceSession(str(args.encoder), so, providers=["CPUExecutionProvider"])
    inp = session.get_inputs()[0]
    x = np.random.RandomState(0).randn(*input_shape(args.encoder, inp.shape)).astype(np.float32)
    for _ in range(args.warmup):
        session.run(None, {inp.name: x})
    start = time.perf_counter()
    for _ in range(args.repeats):
        session.run(None, {inp.name: x})
    wall = (time.perf_counter() - start) / args.repeats * 1e3
    path = session.end_profiling()
    events = [
        e
        for e in json.loads(Path(path).read_text())
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
    ]
    # Each node runs once per encode: drop every node's first `warmup` runs.
    seen = collections.Counter()
    by_op, by_node = collections.Counter(), collections.Counter()
    count = collections.Counter()
    for e in events:
        name = e["name"][: -len("_kernel_time")]
        seen[name] += 1
        if seen[name] <= args.warmup:
            continue
        op = e["args"].get("op_name", "?")
        by_op[op] += e["dur"]
        count[op] += 1
        shapes = e["args"].get("input_type_shape", [])
        by_node[(op, re.sub(r"layer\.\d+", "layer.N", name), str(shapes)[:80])] += e["dur"]

    def per_encode(us: float) -> float:
        return us / args.repeats / 1e3

    print(f"profile: {path}")
    print(f"encode wall {wall:.1f} ms, node kernels {per_encode(sum(by_op.values())):.1f} ms")
    print("by operator, ms per encode (nodes per encode):")
    for op, us in by_op.most_common():
        print(f"  {op:24s} {per_encode(us):8.2f}  ({count[op] // args.repeats})")
    print(f"the {args.top} heaviest nodes, ms per encode (all layers):")
    for (op, name, shapes), us in by_node.most_common(args.top):
        print(f"  {per_encode(us):8.2f}  {op:14s} {name[-58:]:58s} {shapes}")


if __name__ == "__main__":
    main()
