"""plan_load and `xckpt plan`: a dry run whose byte counts match what a real load reads."""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import xckpt
import xckpt.jax as xj
import xckpt.native.writer
import xckpt.storage
from xckpt.cli import main
from xckpt.errors import UnsupportedPlacementError, XckptError
from xckpt.layout import Replicate, Shard


def file_bytes_read() -> int:
    """Chunk-file bytes read: by tensorstore (OCDBT, metadata) and directly (plain files)."""
    from xckpt.native import _fileio

    for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read"):
        if m["name"] == "/tensorstore/kvstore/file/bytes_read":
            return int(m["values"][0]["value"]) + _fileio.bytes_read()
    return _fileio.bytes_read()


@pytest.fixture
def ckpt(tmp_path, monkeypatch):
    """Two writers of a 1024 x 512 f32 tensor (uneven rows), small inner zarr chunks, a packed bias."""
    monkeypatch.setattr(
        xckpt.native.writer, "inner_chunk_shape", functools.partial(xckpt.native._zarr.inner_chunk_shape, target=1 << 18)
    )
    rng = np.random.default_rng(1)
    w = rng.standard_normal((1024, 512)).astype(np.float32)
    b = rng.standard_normal(512).astype(np.float32)
    path = str(tmp_path / "c")
    for rank, (lo, hi) in enumerate([(0, 600), (600, 1024)]):
        wr = xckpt.Writer(path, rank=rank, world_size=2, save_id="s", storage="plain")
        wr.write("w", w[lo:hi], global_shape=w.shape, offset=(lo, 0))
        if rank == 0:
            wr.write("b", b)
        else:
            wr.declare("b", b.dtype, b.shape)
        wr.write_object("step", 5) if rank == 0 else None
        wr.commit()
    return path, w, b


def test_plan_counts_per_rank_and_matches_a_real_read(ckpt):
    path, w, b = ckpt
    plan = xckpt.plan_load(path, {"*": ((4,), (Shard(0),))})
    assert [r.rank for r in plan.ranks] == [0, 1, 2, 3]
    assert plan.tensors == ("w", "b") and plan.skipped == ()
    # Rank 1 keeps rows 256..512 of w and a quarter of b.
    r1 = plan.ranks[1]
    assert r1.bytes_kept == 256 * 512 * 4 + 128 * 4
    assert r1.peak_host_bytes == r1.bytes_kept
    assert 1.0 <= r1.over_read < 1.5  # whole inner zarr chunks, the whole packed bias
    # A real read of rank 1's boxes reads what the plan says (file bytes, zarr.json aside).
    ck = xckpt.open(path)
    outs = [np.empty((256, 512), np.float32), np.empty(128, np.float32)]
    before = file_bytes_read()
    ck.read_into([
        ("w", xckpt.Box((256, 0), (256, 512)), outs[0]),
        ("b", xckpt.Box((128,), (128,)), outs[1]),
    ])
    got = file_bytes_read() - before
    assert np.array_equal(outs[0], w[256:512]) and np.array_equal(outs[1], b[128:256])
    metadata = 2 * 1024  # each array chunk's zarr.json, read on open
    assert r1.bytes_to_read <= got <= r1.bytes_to_read + metadata
    assert plan.total_bytes_to_read == sum(r.bytes_to_read for r in plan.ranks)
    assert "4 ranks read" in plan.summary() and "over-read" in plan.summary()


def test_plan_replicated_reads_everything_per_rank(ckpt):
    path, w, b = ckpt
    plan = xckpt.plan_load(path, {"w": ((2,), (Replicate(),))})
    assert plan.tensors == ("w",) and plan.skipped == ("b",)
    assert all(r.bytes_kept == w.nbytes for r in plan.ranks)
    assert all(r.bytes_to_read >= w.nbytes for r in plan.ranks)


def test_plan_jax_devices(ckpt):
    path, w, _ = ckpt
    mesh = jax.make_mesh((8,), ("x",))
    plan = xckpt.plan_load(path, {"w": NamedSharding(mesh, P("x", None))})
    assert plan.target == "jax" and len(plan.ranks) == 8
    assert all(r.bytes_kept == w.nbytes // 8 for r in plan.ranks)
    # Device 4 holds rows 512..640, which straddle the writers' split at 600: two chunks.
    assert plan.ranks[4].reads >= 2
    got = xj.load(path, {"w": NamedSharding(mesh, P("x", None))})
    assert np.array_equal(np.asarray(got["w"]), w)


def test_plan_errors(ckpt):
    path, _, _ = ckpt
    with pytest.raises(UnsupportedPlacementError, match="2 placements for a mesh of 1 axes"):
        xckpt.plan_load(path, {"w": ((4,), (Shard(0), Shard(1)))})
    with pytest.raises(UnsupportedPlacementError, match="cannot parse placement 'Shard'"):
        xckpt.plan_load(path, {"w": ((4,), "Shard")})


def test_cli_plan_table_and_json(ckpt, capsys):
    path, _, _ = ckpt
    assert main(["plan", path, "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["rank", "bytes", "to", "read", "reads", "kept", "over-read", "peak", "host"]
    assert "4 ranks read" in out
    assert main(["plan", path, "--mesh", "2,2", "--placement", "Shard(0), Shard(1)", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["ranks"]) == 4 and doc["tensors"] == 2
    assert doc["total_bytes_to_read"] == sum(r["bytes_to_read"] for r in doc["ranks"])
    assert main(["plan", path]) == 2
    assert "give --world-size N or --mesh A,B" in capsys.readouterr().err


def test_plan_reads_no_chunk(ckpt, monkeypatch):
    path, _, _ = ckpt
    ck = xckpt.open(path)

    def refuse(*a, **k):
        raise AssertionError("plan_load read data")

    monkeypatch.setattr(type(ck), "_read_chunks", refuse)
    assert xckpt.plan_load(ck, {"*": ((3,), (Shard(0),))}).ranks[2].bytes_kept > 0
    with pytest.raises(XckptError, match="must be \\(mesh_shape, placements\\)"):
        xckpt.plan_load(ck, {"w": ((3,), (Shard(0),)), "b": (1, 2, 3)})
