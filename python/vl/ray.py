"""Captioning a Ray Data dataset with vl, on one machine or many.

    import ray, vl.ray
    ds = ray.data.read_binary_files("images/", include_paths=True)
    ds = ds.map_batches(
        vl.ray.Captioner,
        fn_constructor_kwargs={"model": "/models/blip-base", "column": "bytes"},
        concurrency=4,   # actors, each with its own model
        num_cpus=1,      # CPUs per actor (vl uses that many threads)
        batch_size=16,
    )
    ds.drop_columns(["bytes"]).write_parquet("captions/")

Each actor loads the model once and captions every batch it is given; a
bad image gets its message in the ``error`` column, the others their
captions. ``examples/ray_caption.py`` is the whole program (a folder or a
Parquet table in, Parquet out).
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, Optional

import numpy as np

import vl

__all__ = ["Captioner"]


def _actor_cpus() -> Optional[int]:
    """The CPUs Ray gave this actor (rounded up), if it runs in Ray."""
    try:
        import ray

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    except Exception:  # not in a Ray worker
        return None
    return max(1, math.ceil(cpus)) if cpus else None


class Captioner:
    """A callable class for ``Dataset.map_batches``: loads the model once
    per actor, then adds caption columns to each batch.

    Args:
        model: what :func:`vl.load` takes (a directory every node can
            read, or a Hub id).
        column: the column of images: encoded bytes (``read_binary_files``'
            ``bytes``), ``uint8`` arrays ``(H, W, 3)`` (``read_images``'
            ``image``) or paths.
        caption_column: where the captions go.
        error_column: where a failed image's message goes (``None`` for
            the others; empty string columns are avoided so that Parquet
            keeps a null).
        result_column: if set, each image's whole result (token ids, a
            Florence-2 task's boxes and labels) as a JSON string.
        quantize, dtype: as :func:`vl.load`.
        threads: vl's CPU threads in the actor (default: the CPUs Ray
            assigned it, rounded up; else one per core).
        caption_kwargs: :meth:`vl.Model.caption`'s settings (``max_tokens``,
            ``beams``, ``task``, ``prompt``, ``batch_size`` …).
    """

    def __init__(
        self,
        model: str,
        *,
        column: str = "image",
        caption_column: str = "caption",
        error_column: str = "error",
        result_column: Optional[str] = None,
        quantize: Optional[str] = None,
        dtype: str = "f32",
        threads: Optional[int] = None,
        **caption_kwargs: Any,
    ) -> None:
        if "errors" in caption_kwargs:
            raise vl.ArgumentError(
                "errors: vl.ray.Captioner always reports a failed image in error_column"
            )
        self.column = column
        self.caption_column = caption_column
        self.error_column = error_column
        self.result_column = result_column
        self.caption_kwargs = caption_kwargs
        self.model = vl.load(
            model, quantize=quantize, dtype=dtype, threads=threads or _actor_cpus()
        )

    def __call__(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        if self.column not in batch:
            raise vl.ArgumentError(
                f"column={self.column!r}: the batch has the columns {sorted(batch)}"
            )
        images = [_image(x) for x in batch[self.column]]
        results = self.model.caption(images, errors="return", **self.caption_kwargs)
        batch[self.caption_column] = np.array([r.get("caption") for r in results], dtype=object)
        batch[self.error_column] = np.array([r.get("error") for r in results], dtype=object)
        if self.result_column is not None:
            batch[self.result_column] = np.array(
                [json.dumps(r) for r in results], dtype=object
            )
        return batch


def _image(x: Any) -> Any:
    """A batch cell as vl takes it: Arrow/NumPy wrappers unwrapped."""
    if isinstance(x, np.ndarray) and x.dtype == object and x.ndim == 0:
        return x.item()
    if isinstance(x, np.bytes_):
        return bytes(x)
    if isinstance(x, np.str_):
        return str(x)
    return x
