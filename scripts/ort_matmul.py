#!/usr/bin/env python3
"""ONNX Runtime's f32 MatMul alone on a ViT-B/16's four product shapes (197
rows; the q/k/v — as one product of 2,304 columns and as one of 768 — the
output, and the two feed-forward products), beside `bench_gemm`'s vl f32
products: the kernel (MLAS) without the rest of a model.

    /work/venv-ort/bin/python scripts/ort_matmul.py --threads 2
    /work/venv-ort/bin/python scripts/ort_matmul.py --threads 2 --copies 48

Each graph multiplies one input by `--copies` weights (initializers: MLAS
packs them when the session is made, as in a model) and the time per
product is the run's over the copies: with one copy the weight stays in the
caches from run to run (`bench_gemm` without `--cold`); with 48 (~340 MB
for the feed-forward's shapes, past the L3) each is read from memory, as a
model's encode reads its weights (`bench_gemm --cold`). The least and the
median of `--repeats` runs after three warm-ups, two intra-op threads and
one inter-op thread unless told otherwise; GFLOP/s is `2 m n k` per
product.
"""

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def session(m: int, k: int, n: int, copies: int, threads: int) -> ort.InferenceSession:
    rng = np.random.default_rng(0)
    inits, nodes, outs = [], [], []
    for c in range(copies):
        w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{c}"))
        nodes.append(helper.make_node("MatMul", ["x", f"w{c}"], [f"y{c}"]))
        outs.append(helper.make_tensor_value_info(f"y{c}", TensorProto.FLOAT, [m, n]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])
    graph = helper.make_graph(nodes, "products", [x], outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads")
    ap.add_argument("--copies", type=int, default=1, help="weights per graph, taken in turn")
    ap.add_argument("--rows", type=int, default=197)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    if args.copies < 1 or args.repeats < 1 or args.rows < 1 or args.threads < 1:
        ap.error("--copies, --repeats, --rows and --threads must be at least 1")
    m = args.rows
    for k, n in [(768, 2304), (768, 768), (768, 3072), (3072, 768)]:
        s = session(m, k, n, args.copies, args.threads)
        x = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
        for _ in range(3):
            s.run(None, {"x": x})
        ms = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            s.run(None, {"x": x})
            ms.append((time.perf_counter() - t) * 1e3 / args.copies)
        ms.sort()
        least, median = ms[0], ms[len(ms) // 2]
        print(
            f"({m}, {k}) x ({n}, {k})ᵀ ORT f32 (copies {args.copies}) "
            f"{least:8.3f} ms {median:8.3f} ms  {2 * m * n * k / least / 1e6:7.1f} GFLOP/s"
        )


if __name__ == "__main__":
    main()
