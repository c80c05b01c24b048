"""Shared fixtures of the package's tests: the repository's models and
samples, the `vl` command to compare with, a model loaded once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import List

import pytest

import vl

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ROOT / "models" / "shapes-captioner"
SAMPLES = sorted((SHAPES / "samples").glob("*.png"))
FIXTURES = ROOT / "tests" / "fixtures"


def vl_bin() -> str:
    """The `vl` command: $VL_BIN, else the workspace's build, else PATH."""
    env = os.environ.get("VL_BIN")
    if env:
        return env
    for profile in ("release", "debug"):
        p = ROOT / "target" / profile / "vl"
        if p.exists():
            return str(p)
    found = shutil.which("vl")
    if found is None:
        pytest.fail("no `vl` command: build it (cargo build -p vl-cli) or set VL_BIN")
    return found


def cli_json(*args: str) -> List[dict]:
    """`vl caption --json ARGS`'s objects, one per image."""
    out = subprocess.run(
        [vl_bin(), "caption", "--json", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode in (0, 1), out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="session")
def shapes() -> vl.Model:
    return vl.load(SHAPES)


@pytest.fixture(scope="session")
def samples() -> List[Path]:
    assert len(SAMPLES) >= 4, f"{SHAPES}/samples: expected the shipped sample images"
    return SAMPLES
