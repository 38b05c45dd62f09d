"""Metadata at scale (issue 25), at a size the test suite affords: 1,024 writers x 20 tensors
split by rows (bench/scale.py measures 4,096 x 100 against the targets).

What must hold whatever the writer count: the merged manifest does not grow with the
writers; each rank manifest holds only its own boxes; a rank-local open recognises every
grid while merging, without a chunk object per chunk; a load's planning builds only the
chunks its boxes meet; ``plan_load`` looks each rank's boxes up once per tensor and builds
each chunk at most once per tensor (no work per rank that grows with the ranks).
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import xckpt
from xckpt.layout import Box, GridIndex, chunk_sizes
from xckpt.manifest import Chunk, GridChunks, Manifest, TensorEntry
from xckpt.native._zarr import inner_chunk_shape
from xckpt.native.writer import tensor_key_id

TENSORS = 20


def _shape(i: int, writers: int) -> tuple[int, int]:
    return (80 * writers + 13 * i, 1024)  # uneven: the last writers hold fewer rows (or none)


def _write_ranks(root: Path, writers: int) -> list[int]:
    """Rank manifests as ``Writer.commit`` writes them (array chunks), without data."""
    (root / "ranks").mkdir(parents=True)
    sizes = []
    for r in range(writers):
        tensors = {}
        for i in range(TENSORS):
            name = f"layers.{i}.weight"
            shape = _shape(i, writers)
            lo, n = chunk_sizes(shape[0], writers)[r]
            chunks: tuple[Chunk, ...] = ()
            if n:
                box = (n, shape[1])
                chunks = (Chunk(offset=(lo, 0), shape=box, key=f"data/{r}/t/{tensor_key_id(name)}", rank=r,
                                nbytes=n * shape[1] * 4, grid=tuple(inner_chunk_shape(box, 4))),)
            tensors[name] = TensorEntry(name=name, dtype="float32", shape=shape, chunks=chunks)
        data = Manifest(save_id="s", world_size=writers, rank=r, tensors=tensors, storage={r: "files"}).dumps()
        (root / "ranks" / f"{r}.json").write_bytes(data)
        sizes.append(len(data))
    return sizes


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, list[int]]]:
    out = {}
    for writers in (256, 1024):
        root = tmp_path_factory.mktemp(f"w{writers}") / "c"
        out[writers] = (root, _write_ranks(root, writers))
    return out


def test_merged_manifest_does_not_grow_with_the_writers(saves: dict[int, tuple[Path, list[int]]], tmp_path: Path) -> None:
    merged = {}
    for writers, (root, rank_sizes) in saves.items():
        assert max(rank_sizes) < 8 << 10  # a rank manifest holds its own 20 boxes only
        dst = tmp_path / f"m{writers}"
        dst.mkdir()
        (dst / "ranks").symlink_to(root / "ranks")
        xckpt.finalize(dst, world_size=writers, save_id="s")
        doc = json.loads((dst / "xckpt.json").read_text())
        assert all("grid" in t for t in doc["tensors"].values())
        assert doc["tensors"]["layers.0.weight"]["grid"]["splits"] == [80, 1024]
        merged[writers] = len((dst / "xckpt.json").read_bytes()) - len(json.dumps(doc["storage"]))
    assert merged[1024] < 1.1 * merged[256] and merged[1024] < 16 << 10, merged


def test_rank_local_open_builds_no_chunk_per_writer(saves: dict[int, tuple[Path, list[int]]]) -> None:
    root, _ = saves[1024]
    xckpt.open(root)  # warm (imports, caches)
    tracemalloc.start()
    ck = xckpt.open(root)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert all(ck.info(n).is_grid for n in ck.names())
    # 20,480 chunks: a chunk object each (about 1 KB with its boxes) would be 20 MB held at once.
    assert peak < 12 << 20, peak
    g = ck.info("layers.0.weight").chunks
    assert isinstance(g, GridChunks) and len(g) == 1024 and g.rank_rule == (0, (1, 0))
    c = g[1000]
    assert (c.offset, c.shape, c.key, c.rank) == ((80 * 1000, 0), (80, 1024), f"data/1000/t/{tensor_key_id('layers.0.weight')}", 1000)


def _count(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"chunk": 0, "overlaps": 0}
    chunk, overlaps = GridChunks.chunk, GridIndex.overlaps

    def counted_chunk(self: GridChunks, i: int) -> Chunk:
        calls["chunk"] += 1
        return chunk(self, i)

    def counted_overlaps(self: GridIndex, target: Box) -> Any:
        calls["overlaps"] += 1
        return overlaps(self, target)

    monkeypatch.setattr(GridChunks, "chunk", counted_chunk)
    monkeypatch.setattr(GridIndex, "overlaps", counted_overlaps)
    return calls


def test_one_ranks_plan_builds_only_the_chunks_it_reads(saves: dict[int, tuple[Path, list[int]]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = saves[1024]
    ck = xckpt.open(root)
    calls = _count(monkeypatch)
    jobs: list[Any] = []
    for i, name in enumerate(ck.names()):
        lo, n = chunk_sizes(_shape(i, 1024)[0], 700)[300]
        ck._plan(name, ck.info(name), Box((lo, 0), (n, 1024)), np.empty((n, 1024), np.float32), jobs)
    assert calls["overlaps"] == TENSORS and calls["chunk"] == len(jobs) <= 3 * TENSORS


def test_plan_load_work_is_linear_in_the_ranks(saves: dict[int, tuple[Path, list[int]]],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = saves[1024]
    ck = xckpt.open(root)
    calls = _count(monkeypatch)
    for ranks in (300, 1500):
        calls.update(chunk=0, overlaps=0)
        plan = xckpt.plan_load(ck, {"*": ((ranks,), "Shard(0)")})
        assert len(plan.ranks) == ranks and calls["overlaps"] <= ranks * TENSORS
        assert calls["chunk"] <= 1024 * TENSORS  # each chunk built once per tensor, whatever the ranks
    assert sum(r.bytes_kept for r in plan.ranks) == sum(ck.info(n).nbytes for n in ck.names())
