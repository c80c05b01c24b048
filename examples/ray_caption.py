#!/usr/bin/env python3
"""Caption a folder of images, or a Parquet table of them, with Ray Data
and vl; write the captions as Parquet.

    pip install ./python "ray[data]"
    python examples/ray_caption.py --model models/shapes-captioner \\
        --input models/shapes-captioner/samples --output /tmp/captions --concurrency 2

On one machine this starts a local Ray instance; on a cluster, start Ray
first (`ray start --head` on one node, `ray start --address HEAD:6379` on
the others) and pass `--address auto`: the actors spread over the nodes,
each loading the model from the same path (a shared file system, or the
same directory on every node) or Hub id.

Output: Parquet files with the columns `path` (folder input) or the
table's own columns, `caption`, `error` (null unless that image failed).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".tif", ".tiff", ".webp")


def caption_dataset(
    model: str,
    input: str,
    output: str,
    *,
    concurrency: int = 2,
    cpus_per_actor: float = 1.0,
    batch_size: int = 8,
    column: Optional[str] = None,
    quantize: Optional[str] = None,
    address: Optional[str] = None,
    max_tokens: Optional[int] = None,
) -> int:
    """Captions `input` into Parquet under `output`; returns the number of
    images. Starts (or joins, with `address`) Ray if it is not running."""
    import ray

    import vl.ray

    if not ray.is_initialized():
        if address:
            ray.init(address=address)
        else:
            # Only this machine, on loopback, no dashboard.
            ray.init(
                num_cpus=os.cpu_count() or 2,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
            )
    if os.path.isdir(input) and not any(f.endswith(".parquet") for f in os.listdir(input)):
        files = sorted(
            os.path.join(input, f) for f in os.listdir(input) if f.lower().endswith(IMAGE_SUFFIXES)
        )
        if not files:
            raise SystemExit(f"{input}: no image files ({', '.join(IMAGE_SUFFIXES)})")
        ds = ray.data.read_binary_files(files, include_paths=True)
        column = column or "bytes"
    else:
        ds = ray.data.read_parquet(input)
        column = column or "image"
    kwargs = {"max_tokens": max_tokens} if max_tokens else {}
    captioned = ds.map_batches(
        vl.ray.Captioner,
        fn_constructor_kwargs={"model": model, "column": column, "quantize": quantize, **kwargs},
        concurrency=concurrency,
        # A fraction leaves room for the read and write tasks.
        num_cpus=cpus_per_actor,
        batch_size=batch_size,
    )
    captioned.drop_columns([column]).write_parquet(output)
    # Counted from the files' metadata: counting the dataset would run it
    # (and caption every image) again.
    return ray.data.read_parquet(output).count()


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory or Hub id")
    p.add_argument("--input", required=True, help="a folder of images, or Parquet file(s)")
    p.add_argument("--output", required=True, help="folder for the Parquet output")
    p.add_argument("--column", help="the Parquet column of image bytes (default: image)")
    p.add_argument("--concurrency", type=int, default=2, help="actors (models loaded)")
    p.add_argument("--cpus-per-actor", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--quantize", choices=["bf16", "f16", "q8_0", "q4k"])
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--address", help="a running Ray cluster (`auto`)")
    a = p.parse_args(argv)
    n = caption_dataset(
        a.model,
        a.input,
        a.output,
        concurrency=a.concurrency,
        cpus_per_actor=a.cpus_per_actor,
        batch_size=a.batch_size,
        column=a.column,
        quantize=a.quantize,
        address=a.address,
        max_tokens=a.max_tokens,
    )
    print(f"{n} images captioned into {a.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
