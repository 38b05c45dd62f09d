"""Lossless codecs of array chunks (format version 6): ``compression=None | "zstd" | "shuffle-zstd"``.

Every dtype round-trips bit-exact through both storages; tensorstore reads each compressed
array from its zarr.json alone and zarr-python those of its dtypes; arrays tensorstore
compresses are read by xckpt's direct file reads; damage is a CorruptChunkError; bad
arguments are typed errors naming the fix. Every save verb takes ``compression=``.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

import xckpt
from xckpt.errors import CorruptChunkError, XckptError
from xckpt.native import _fileio
from xckpt.native._zarr import array_metadata

CODECS = ("zstd", "shuffle-zstd")
DTYPES = ("bool", "int8", "uint16", "int32", "int64", "float16", "float32", "float64", "complex64", "bfloat16",
          "float8_e4m3fn", "float8_e5m2")
#: dtypes zarr-python 3 has (no bfloat16, no float8).
ZARR_PYTHON = ("bool", "int8", "uint16", "int32", "int64", "float16", "float32", "float64", "complex64")


def _np(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def _array(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = _np(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dt.kind in "iu":
        return rng.integers(0, 100, shape).astype(dt)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    return (rng.standard_normal(shape) * 0.02).astype(dt)


def _state() -> dict:
    # Shapes that make array chunks (pack_threshold=0) with edge zarr chunks.
    return {f"t.{d}": _array(d, (37, 29), i) for i, d in enumerate(DTYPES)}


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("storage", ["files", "ocdbt"])
def test_every_dtype_round_trips(tmp_path, codec, storage, reads):
    st = _state()
    p = tmp_path / "c"
    xckpt.save(st, p, compression=codec, storage=storage, pack_threshold=0)
    doc = json.loads((p / "xckpt.json").read_bytes())
    assert doc["version"] == 6 and doc["codecs"] == {"0": codec}
    with xckpt.open(p) as ck:
        for k, v in st.items():
            assert ck.read(k).tobytes() == v.tobytes(), k
        assert ck.read("t.float32", (slice(30, 37), slice(2, 5))).tobytes() == st["t.float32"][30:, 2:5].tobytes()
        assert ck.verify() == []


@pytest.mark.parametrize("codec", CODECS)
def test_read_by_tensorstore_and_zarr_python(tmp_path, codec):
    """No xckpt needed: each chunk's zarr.json names its codecs."""
    import zarr

    st = _state()
    p = tmp_path / "c"
    xckpt.save(st, p, compression=codec, pack_threshold=0)
    doc = json.loads((p / "xckpt.json").read_bytes())
    for name, t in doc["tensors"].items():
        (chunk,) = t["chunks"]
        path = os.path.join(p, chunk["key"])
        arr = ts.open({"driver": "zarr3", "kvstore": f"file://{path}/"}).result()
        assert arr.read().result().tobytes() == st[name].tobytes(), name
        dtype = name.split(".", 1)[-1]
        if dtype in ZARR_PYTHON:
            z = zarr.open_array(path, mode="r")
            assert np.asarray(z[...]).tobytes() == st[name].tobytes(), name


@pytest.mark.parametrize("codec", CODECS)
def test_direct_files_match_tensorstore(tmp_path, codec):
    """xckpt's own "files" writes and tensorstore's: the same zarr.json, each reads the other."""
    a = _array("bfloat16", (50, 40))
    grid = [16, 40]
    _fileio.write_arrays(str(tmp_path / "ours"), [_fileio.ArrayWrite("k", "bfloat16", a, grid, "files", codec)])
    spec = {"driver": "zarr3", "kvstore": f"file://{tmp_path}/theirs/k/",
            "metadata": array_metadata("files", "bfloat16", a.shape, grid, codec)}
    ts.open(spec, create=True).result().write(a).result()
    ours = json.loads((tmp_path / "ours/k/zarr.json").read_bytes())
    theirs = json.loads((tmp_path / "theirs/k/zarr.json").read_bytes())
    assert ours == theirs
    got = ts.open({"driver": "zarr3", "kvstore": f"file://{tmp_path}/ours/k/"}).result().read().result()
    assert got.tobytes() == a.tobytes()
    for region in [(slice(0, 50), slice(0, 40)), (slice(13, 35), slice(5, 9))]:
        out = np.empty((region[0].stop - region[0].start, region[1].stop - region[1].start), a.dtype)
        job = _fileio.ChunkRead("k", a.shape, tuple(grid), region, out, "files", codec)
        _fileio.submit_read(str(tmp_path / "theirs"), job).result()
        assert out.tobytes() == a[region].tobytes()
        _fileio.check_meta(str(tmp_path / "theirs"), "k", "files", "bfloat16", a.shape, grid, codec)


def test_damage_is_corrupt_chunk(tmp_path, reads):
    a = _array("float32", (300, 300))
    p = tmp_path / "c"
    xckpt.save({"w": a}, p, compression="shuffle-zstd")
    key = json.loads((p / "xckpt.json").read_bytes())["tensors"]["w"]["chunks"][0]["key"]
    shard = p / key / "c.0.0"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with xckpt.open(p) as ck:
        with pytest.raises(CorruptChunkError, match="crc32c"):
            ck.read("w")
        assert any("w" in msg for msg in ck.verify())


def test_bad_arguments(tmp_path):
    with pytest.raises(XckptError, match="compression='lz4' is not a codec.*'shuffle-zstd'"):
        xckpt.save({"w": np.ones(3)}, tmp_path / "a", compression="lz4")
    with pytest.raises(XckptError, match="needs storage 'files' or 'ocdbt'"):
        xckpt.save({"w": np.ones(3)}, tmp_path / "b", compression="zstd", storage="plain")
    xckpt.save({"w": np.ones(3)}, tmp_path / "src")
    with pytest.raises(XckptError, match="is for xckpt output"):
        xckpt.convert(tmp_path / "src", str(tmp_path / "x.safetensors"), compression="zstd")
    with pytest.raises(XckptError, match="not a codec"):
        xckpt.CheckpointManager(tmp_path / "m", compression="gzip", handle_preemption=False)


def test_every_save_verb(tmp_path):
    """torch, JAX, convert and the manager take compression= and write version 6 codecs."""
    import jax.numpy as jnp
    import torch

    import xckpt.jax as xj
    import xckpt.torch as xt

    w = torch.randn(200, 400, dtype=torch.bfloat16)
    xt.save({"w": w}, tmp_path / "t", compression="shuffle-zstd")
    out = {"w": torch.empty_like(w)}
    xt.load(tmp_path / "t", out)
    assert torch.equal(out["w"].view(torch.int16), w.view(torch.int16))
    j = jnp.asarray(_array("bfloat16", (300, 400)))
    xj.save({"j": j}, tmp_path / "j", compression="zstd")
    got = xj.load(tmp_path / "j")
    assert np.asarray(got["j"]).tobytes() == np.asarray(j).tobytes()
    xckpt.convert(tmp_path / "t", str(tmp_path / "cv"), compression="zstd")
    with xckpt.CheckpointManager(tmp_path / "m", compression="zstd", handle_preemption=False) as m:
        m.save(1, {"a": _array("float32", (300, 300))})
    for d, codec in [("t", "shuffle-zstd"), ("j", "zstd"), ("cv", "zstd"), ("m/1", "zstd")]:
        assert json.loads((tmp_path / d / "xckpt.json").read_bytes())["codecs"] == {"0": codec}, d
