"""plan_load's column path (every rank's box of a grid tensor at once) equals the general path.

Properties (hypothesis): `GridIndex.overlap_columns` finds what `overlaps` finds box by box;
`MeshBoxes` is `mesh_boxes` rank for rank, and its columns are its boxes; and a whole plan
by columns equals the plan by `read_units` per chunk, on any grid (regular or uneven splits,
ranks by rule or by list, keys by rule or by list, inner grids, packed cells, shared keys)
beside chunk-list tensors packed in the same arrays (two rows; a tensor cut at random, whose
boxes are paired with every rank's box by arrays), for any mesh of Shard/Replicate
placements (uneven and empty shards), a nested shard, and a JAX-style target of several
boxes per rank.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_grids import _dtype, axes, grids, tilings

import xckpt
from xckpt.layout import Box, GridAxis, GridIndex, MeshBoxes, Replicate, Shard, StridedShard, mesh_boxes
from xckpt.manifest import Chunk, GridChunks, Manifest, TensorEntry
from xckpt.manifest._grids import Packed
from xckpt.native.reader import Checkpoint
from xckpt.plan import JAX_HOST_BUDGET, _plan, _Queries, _Rows

PROPS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def boxes_in(draw: Any, shape: tuple[int, ...]) -> Box:
    lo = [draw(st.integers(0, n)) for n in shape]
    return Box(tuple(lo), tuple(draw(st.integers(0, n - o)) for n, o in zip(shape, lo)))


@PROPS
@given(axes(), st.data())
def test_overlap_columns_equal_the_overlaps_of_each_box(ax: Any, data: Any) -> None:
    index = GridIndex(ax)
    shape = tuple(a.extent for a in ax)
    boxes = data.draw(st.lists(boxes_in(shape), max_size=12))
    lo = np.array([b.offset for b in boxes], np.int64).reshape(len(boxes), len(shape))
    hi = lo + np.array([b.shape for b in boxes], np.int64).reshape(len(boxes), len(shape))
    q, cell, clo, chi = index.overlap_columns(lo, hi)
    want = [(k, i, c.offset, tuple(o + s for o, s in zip(c.offset, c.shape)))
            for k, b in enumerate(boxes) for i, _b, c in index.overlaps(b)]
    got = [(k, i, tuple(a), tuple(b)) for k, i, a, b in zip(q.tolist(), cell.tolist(), clo.tolist(), chi.tolist())]
    assert got == want


@st.composite
def meshes(draw: Any, ndim: int) -> tuple[tuple[int, ...], tuple[Any, ...]]:
    mesh = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    dims = draw(st.permutations(range(max(ndim, len(mesh)))))
    placements = tuple(Shard(d) if d < ndim and draw(st.booleans()) else Replicate() for d in dims[: len(mesh)])
    return mesh, placements


@PROPS
@given(st.data())
def test_mesh_boxes_by_rank_and_as_columns(data: Any) -> None:
    shape = tuple(data.draw(st.lists(st.integers(0, 30), max_size=3)))
    mesh, placements = data.draw(meshes(len(shape)))
    assert MeshBoxes.fits(shape, mesh, placements)
    mb = MeshBoxes(shape, mesh, placements)
    want = {k: v for k, v in zip(range(math.prod(mesh)), mesh_boxes(shape, mesh, placements).values())}
    assert dict(mb) == want and len(mb) == len(want) and mb.get(len(want)) is None
    ranks, lo, hi = mb.columns()
    got = {r: (Box(tuple(a), tuple(b - a for a, b in zip(a, b))),) for r, a, b in zip(ranks.tolist(), lo.tolist(), hi.tolist())}
    assert got == {k: v for k, v in want.items() if v}


@st.composite
def writer_grids(draw: Any) -> tuple[GridChunks, tuple[int, ...], int]:
    """Grids as writers save them (`grids` of test_grids draws any grid, mostly ones the
    column path declines): one writer per cell, by rule or shuffled, some cells packed."""
    ax = draw(axes())
    index = GridIndex(ax)
    n = index.n
    world = n + draw(st.integers(0, 3))
    if draw(st.booleans()):
        ranks: dict[str, Any] = {"rank_rule": (0, tuple(index.strides))}
    else:
        ranks = {"rank_list": np.array(draw(st.permutations(range(world)))[:n], np.int64)}
    dirs = {r: f"data/{r}.{r:x}a" for r in range(world) if draw(st.booleans())}
    cells = draw(st.sampled_from(["none", "all", "some"]))
    packed = None
    if cells != "none":
        ids = None if cells == "all" else np.array(sorted(draw(st.sets(st.integers(0, n - 1), min_size=1))), np.int64)
        m = n if ids is None else len(ids)
        bo = draw(st.integers(0, 1 << 23)) if draw(st.booleans()) else np.array(
            draw(st.lists(st.integers(0, 9 << 20), min_size=m, max_size=m)), np.int64)
        packed = Packed(ids, "packed", bo, None)
    key = {} if packed is not None and packed.cells is None else {"key": draw(st.sampled_from(["t/0", "t/1"]))}
    inner = None
    if draw(st.booleans()):
        shapes = list(itertools.product(*(sorted(a.sizes()) for a in ax)))
        inner = {s: tuple(max(1, x // draw(st.integers(1, 3))) for x in s) for s in shapes if draw(st.booleans())}
    g = GridChunks(index, draw(st.sampled_from([1, 2, 4])), dirs=dirs, **ranks, **key, inner=inner, packed=packed)
    return g, tuple(a.extent for a in ax), world


def _checkpoint(tmp: Path, tensors: dict[str, TensorEntry], world: int, dirs: dict[int, str]) -> Checkpoint:
    m = Manifest(save_id="s", world_size=world, rank=None, tensors=tensors, storage={0: "files"}, dirs=dirs)
    return Checkpoint(tmp, manifest=m)


def _small(world: int, dirs: dict[int, str], itemsize: int, draw: Any) -> TensorEntry:
    """A chunk-list tensor (two rows), packed into its writers' packed arrays beside the grids' cells."""
    chunks = []
    for row in range(2):
        r = draw(st.integers(0, world - 1))
        d = dirs.get(r, f"data/{r}")
        chunks.append(Chunk(offset=(row, 0), shape=(1, 5), key=f"{d}/packed", rank=r, nbytes=5 * itemsize,
                            form="packed", byte_offset=draw(st.integers(0, 1 << 23)), crc32=0))
    return TensorEntry(name="small", dtype=_dtype(itemsize), shape=(2, 5), chunks=tuple(chunks))


def _cuts(world: int, dirs: dict[int, str], draw: Any) -> TensorEntry:
    """A tensor cut at random (no grid): array chunks and chunks packed beside the grids' cells."""
    shape, boxes = draw(tilings())
    chunks = []
    for i, b in enumerate(boxes):
        r = draw(st.integers(0, world - 1))
        d = dirs.get(r, f"data/{r}")
        if draw(st.booleans()):
            chunks.append(Chunk(offset=b.offset, shape=b.shape, key=f"{d}/packed", rank=r, nbytes=b.volume * 2,
                                form="packed", byte_offset=draw(st.integers(0, 1 << 23)), crc32=0))
        else:
            chunks.append(Chunk(offset=b.offset, shape=b.shape, key=f"{d}/t/cut.{i}", rank=r, nbytes=b.volume * 2,
                                grid=tuple(max(1, n // 2) for n in b.shape)))
    return TensorEntry(name="cuts", dtype="float16", shape=shape, chunks=tuple(chunks))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.data())
def test_the_plan_by_columns_equals_the_plan_by_chunks(tmp_path: Path, data: Any) -> None:
    g, shape, world = data.draw(st.one_of(writer_grids(), grids()))
    tensors = {"a": TensorEntry(name="a", dtype=_dtype(g.itemsize), shape=shape, chunks=g)}
    # A second grid of writers among the first's: the same packed arrays (their spans shared),
    # maybe the same key.
    g2, shape2, world2 = data.draw(writer_grids())
    if world2 <= world:
        g2.dirs = g.dirs
        tensors["b"] = TensorEntry(name="b", dtype=_dtype(g2.itemsize), shape=shape2, chunks=g2)
    if data.draw(st.booleans()):
        tensors["small"] = _small(world, dict(g.dirs), g.itemsize, data.draw)
    if data.draw(st.booleans()):
        tensors["cuts"] = _cuts(world, dict(g.dirs), data.draw)
    ck = _checkpoint(tmp_path, tensors, world, dict(g.dirs))
    for _ in range(3):
        kind = data.draw(st.sampled_from(["mesh", "nested", "boxes"]))
        if kind == "mesh":
            mesh, placements = data.draw(meshes(len(shape)))
            target: Any = {"*": (mesh, placements)}
        elif kind == "nested":  # two mesh axes on one dim: boxes by mesh_boxes, one per rank
            target = {"*": ((data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))), (Shard(0), Shard(0)))}
        else:  # several boxes per rank: the general path
            target = {"*": ((data.draw(st.integers(1, 4)),), (StridedShard(0, data.draw(st.integers(1, 3))),))}
        columns = _plan(ck, target, JAX_HOST_BUDGET)
        assert columns == _plan(ck, target, JAX_HOST_BUDGET, columns=False)
    ck.close()


def test_a_plan_by_columns_builds_no_chunk(tmp_path: Path, monkeypatch: Any) -> None:
    """4,096 writers' packed cells and 3,000 ranks: no `Chunk` is built, and the plan is the general one."""
    writers, rows = 4096, 4
    index = GridIndex([GridAxis(rows * writers, step=rows), GridAxis(16, step=16)])
    g = GridChunks(index, 4, dirs={}, rank_rule=(0, (1, 0)),
                   packed=Packed(None, "packed", np.zeros(writers, np.int64) + 300, None))
    ck = _checkpoint(tmp_path, {f"t{i}": TensorEntry(name=f"t{i}", dtype="float32", shape=(rows * writers, 16), chunks=g)
                                for i in range(3)}, writers, {})
    target = {"*": ((3000,), "Shard(0)")}
    want = _plan(ck, target, JAX_HOST_BUDGET, columns=False)
    built = []
    monkeypatch.setattr(GridChunks, "chunk", lambda self, i: built.append(i))
    got = xckpt.plan_load(ck, target)
    assert got == want and built == []
    assert got.ranks[0].reads == 2 and got.ranks[-1].reads == 0  # (ranks past the rows hold nothing)


def test_boxes_many_to_a_rank_take_the_general_path(tmp_path: Path) -> None:
    """A target of several boxes per rank (as a JAX sharding may give) is planned per chunk."""
    g = GridChunks(GridIndex([GridAxis(64, step=8)]), 4, dirs={}, rank_rule=(0, (1,)), key="t/0")
    ck = _checkpoint(tmp_path, {"w": TensorEntry(name="w", dtype="float32", shape=(64,), chunks=g)}, 8, {})
    per = {0: (Box((0,), (4,)), Box((4,), (4,))), 1: (Box((8,), (8,)),)}
    assert _Queries.of(per, _Rows(np.array([0, 1]), {0: 0, 1: 1}), 1) is None
    # (asked per box, the two boxes of rank 0 each count the one zarr chunk they share)
    units = ck.read_units_columns("w", np.array([[0], [4]]), np.array([[4], [8]]), 4)
    assert units is not None and units.own_reads.tolist() == [1, 1]
    plan = xckpt.plan_load(ck, {"w": ((3,), (StridedShard(0, 2),))})
    assert plan == _plan(ck, {"w": ((3,), (StridedShard(0, 2),))}, JAX_HOST_BUDGET, columns=False)


def test_a_packed_cell_across_spans(tmp_path: Path) -> None:
    """A packed cell whose bytes cross a span boundary of its array costs both spans."""
    span = xckpt.native._zarr.packed_grid((9 << 20) - 32)  # (the array's end: the last cell's, with its crc32)
    offsets = np.array([span - 8 + 64 * i for i in range(8)] + [(9 << 20) - 68], np.int64)
    g = GridChunks(GridIndex([GridAxis(72, step=8)]), 4, dirs={}, rank_rule=(0, (0,)),
                   packed=Packed(None, "packed", offsets, None))
    ck = _checkpoint(tmp_path, {"w": TensorEntry(name="w", dtype="float32", shape=(72,), chunks=g)}, 1, {})
    target = {"w": ((5,), "Shard(0)")}
    plan = xckpt.plan_load(ck, target)
    assert plan == _plan(ck, target, JAX_HOST_BUDGET, columns=False)
    assert plan.ranks[0].reads == 2 and plan.ranks[0].bytes_to_read == 2 * (span + 4)  # (cell 0 crosses)
    assert plan.ranks[1].reads == 1
