"""vl.ray.Captioner on a local Ray cluster (loopback only, 2 CPUs):
examples/ray_caption.py over the shipped samples, every caption checked."""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest

import vl
from conftest import ROOT, SHAPES

if os.environ.get("VL_REQUIRE_RAY") != "1":
    pytest.importorskip("ray")
import ray  # noqa: E402

import vl.ray  # noqa: E402

sys.path.insert(0, str(ROOT / "examples"))
spec = importlib.util.spec_from_file_location("ray_caption", ROOT / "examples" / "ray_caption.py")
ray_caption = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ray_caption)


@pytest.fixture(scope="module")
def cluster():
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        # Small: the machine has little memory to spare for the store.
        object_store_memory=200 * 1024 * 1024,
    )
    yield
    ray.shutdown()


def test_folder_to_parquet(cluster, tmp_path, shapes, samples):
    import pandas as pd

    folder = tmp_path / "images"
    folder.mkdir()
    for p in samples:
        (folder / p.name).write_bytes(p.read_bytes())
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    out = tmp_path / "captions"
    n = ray_caption.caption_dataset(
        str(SHAPES),
        str(folder),
        str(out),
        concurrency=2,
        # Fractional: two actors and the read/write tasks fit in 2 CPUs.
        cpus_per_actor=0.5,
        batch_size=2,
    )
    assert n == len(samples) + 1
    table = ray.data.read_parquet(str(out)).to_pandas()
    assert sorted(table.columns) == ["caption", "error", "path"]
    expected = {p.name: r["caption"] for p, r in zip(samples, shapes.caption([str(p) for p in samples]))}
    got = {os.path.basename(row.path): row for row in table.itertuples()}
    assert set(got) == set(expected) | {"broken.png"}
    for name, caption in expected.items():
        assert got[name].caption == caption, name
        assert pd.isna(got[name].error)
    assert pd.isna(got["broken.png"].caption)
    assert "cannot decode" in got["broken.png"].error


def test_parquet_of_arrays(cluster, tmp_path, shapes, samples):
    """A table whose image column holds encoded bytes, and a dataset of
    uint8 arrays (as read_images makes), through the class directly."""
    import pandas as pd

    src = tmp_path / "in.parquet"
    pd.DataFrame({"id": range(len(samples)), "image": [p.read_bytes() for p in samples]}).to_parquet(src)
    out = tmp_path / "out"
    n = ray_caption.caption_dataset(str(SHAPES), str(src), str(out), concurrency=1, cpus_per_actor=0.5)
    assert n == len(samples)
    table = ray.data.read_parquet(str(out)).to_pandas().sort_values("id")
    expected = [r["caption"] for r in shapes.caption([str(p) for p in samples])]
    assert list(table.caption) == expected

    from PIL import Image

    arrays = [np.asarray(Image.open(p).convert("RGB")) for p in samples]
    ds = ray.data.from_items([{"id": i, "image": a} for i, a in enumerate(arrays)])
    # Ray Data hands batches back in the order they finish (not the
    # input's unless `preserve_order` is set): rows are matched by id,
    # which the captioner passes through.
    captioned = ds.map_batches(
        vl.ray.Captioner,
        fn_constructor_kwargs={"model": str(SHAPES), "result_column": "result"},
        concurrency=1,
        num_cpus=0.5,
        batch_size=4,
    ).take_all()
    captioned.sort(key=lambda row: row["id"])
    assert [row["id"] for row in captioned] == list(range(len(arrays)))
    assert [row["caption"] for row in captioned] == expected
    import json

    assert json.loads(captioned[0]["result"])["token_ids"] == shapes.caption(arrays[0])[0]["token_ids"]


def test_a_missing_column_is_named(shapes):
    import vl.ray

    c = vl.ray.Captioner(str(SHAPES), column="img")
    with pytest.raises(vl.ArgumentError, match="column='img'"):
        c({"image": np.array([b""], dtype=object)})
