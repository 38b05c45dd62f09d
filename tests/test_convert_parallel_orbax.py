"""A parallel conversion's orbax output is reproducible (DESIGN section 13).

OCDBT cannot be (tensorstore names its data files at random and stamps every version with
its commit time), so a parallel conversion writes orbax's non-OCDBT layout: a zarr
directory per leaf, `use_ocdbt: false`. `_CHECKPOINT_METADATA`'s timestamps come from
`SOURCE_DATE_EPOCH` when it is set, else are not recorded (null, which orbax reads as
such). The byte-identical comparison over 1, 2 and 3 workers and torchrun is in
`tests/test_convert_parallel.py`; here: twice the same bytes, the timestamps as orbax's
own step-metadata reader sees them, the error for a bad `SOURCE_DATE_EPOCH`, and that a
plain conversion still writes OCDBT.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

import xckpt
from xckpt.errors import XckptError

SRC = {"layers.0.w": np.arange(600, dtype=np.float32).reshape(20, 30), "layers.1.b": np.ones(7, np.float64)}


def _digest(path: str) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("src") / "ckpt")
    xckpt.save({**SRC, "step": 5}, path)
    return path


def _meta(path: str) -> dict:
    with open(os.path.join(path, "_CHECKPOINT_METADATA")) as f:
        return json.load(f)


def test_twice_the_same_bytes_timestamps_not_recorded(source, tmp_path, monkeypatch):
    from orbax.checkpoint._src.metadata.step_metadata_serialization import get_step_metadata

    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    xckpt.convert(source, a, to_format="orbax", workers=1)
    xckpt.convert(source, b, to_format="orbax", workers=2)
    assert _digest(a) == _digest(b)
    assert "manifest.ocdbt" not in _digest(a) and "layers.0.w/.zarray" in _digest(a)
    with open(os.path.join(a, "_METADATA")) as f:
        assert json.load(f)["use_ocdbt"] is False
    step = get_step_metadata(a)
    assert step.init_timestamp_nsecs is None and step.commit_timestamp_nsecs is None


def test_source_date_epoch(source, tmp_path, monkeypatch):
    from orbax.checkpoint._src.metadata.step_metadata_serialization import get_step_metadata

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1764288000")
    dst = str(tmp_path / "out")
    xckpt.convert(source, dst, to_format="orbax", workers=1)
    step = get_step_metadata(dst)
    assert step.init_timestamp_nsecs == step.commit_timestamp_nsecs == 1764288000 * 10**9
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(XckptError, match=r"SOURCE_DATE_EPOCH='yesterday' is not a number of seconds since 1970"):
        xckpt.convert(source, str(tmp_path / "bad"), to_format="orbax", workers=1)
    assert not os.path.exists(tmp_path / "bad")


def test_plain_convert_keeps_ocdbt(source, tmp_path):
    dst = str(tmp_path / "plain")
    xckpt.convert(source, dst, to_format="orbax")
    assert os.path.exists(os.path.join(dst, "manifest.ocdbt"))
    assert _meta(dst)["commit_timestamp_nsecs"] > 0
