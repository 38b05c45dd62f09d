"""Grid entries (format version 5) and chunk indexes.

Properties (hypothesis): any grid (1-3 dims, regular or irregular splits, rank by rule
or by list, keys by rule or by list, inner grids or packed cells) round-trips through the
manifest's JSON bytes; a chunk index (grid arithmetic, or sorted intervals for arbitrary
box sets) finds exactly what a scan of every box finds; hostile grid claims end in a
ManifestError in bounded time. Then end to end: rank-local and coordinated saves whose
boxes form grids are stored and read back as grids, layouts that are not grids keep the
chunk list, gaps and overlaps are still LayoutErrors, and the checked-in v5 golden loads.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import itertools
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xckpt
from xckpt.errors import LayoutError, ManifestError
from xckpt.layout import (
    Box,
    BoxIndex,
    GridAxis,
    GridIndex,
    Replicate,
    Shard,
    boxes_for_coordinate,
    dim_indices,
    plan_reads,
)
from xckpt.layout._boxes import _boxes_from_indices
from xckpt.manifest import GridChunks, Manifest, TensorEntry, manifest_bytes
from xckpt.manifest._document import with_table
from xckpt.manifest._grids import Packed

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- strategies ----------------------------------------------------------------------------


@st.composite
def axes(draw: Any, max_dims: int = 3) -> list[GridAxis]:
    out = []
    for _ in range(draw(st.integers(1, max_dims))):
        extent = draw(st.integers(1, 40))
        if draw(st.booleans()):
            out.append(GridAxis(extent, step=draw(st.integers(1, extent))))
        else:
            inner = draw(st.sets(st.integers(1, extent - 1), max_size=6)) if extent > 1 else set()
            out.append(GridAxis.of(extent, [0, *sorted(inner), extent]))
    return out


@st.composite
def grids(draw: Any) -> tuple[GridChunks, tuple[int, ...], int]:
    ax = draw(axes())
    index = GridIndex(ax)
    n = index.n
    shape = tuple(a.extent for a in ax)
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    if draw(st.booleans()):
        strides = tuple(draw(st.integers(0, 3)) for _ in ax)
        base = draw(st.integers(0, 5))
        world = base + sum(s * (c - 1) for s, c in zip(strides, index.counts)) + 1 + draw(st.integers(0, 3))
        ranks: dict[str, Any] = {"rank_rule": (base, strides)}
    else:
        world = draw(st.integers(1, 9))
        ranks = {"rank_list": np.array(draw(st.lists(st.integers(0, world - 1), min_size=n, max_size=n)), np.int64)}
    dirs = {r: f"data/{r}.{r:x}a" for r in range(world) if draw(st.booleans())}
    explicit = draw(st.booleans())
    cells = draw(st.sampled_from(["none", "all", "some"]))
    packed = None
    if cells != "none":
        ids = None if cells == "all" else np.array(sorted(draw(st.sets(st.integers(0, n - 1), min_size=1))), np.int64)
        m = n if ids is None else len(ids)
        bo = draw(st.integers(0, 1 << 40)) if draw(st.booleans()) else np.arange(m, dtype=np.int64) * 7
        crc = np.array([(i * 2654435761) % (1 << 32) for i in range(m)], np.int64)
        packed = Packed(ids, None if explicit else draw(st.sampled_from(["packed", "p/4"])), bo, crc)
    if explicit:
        keys: dict[str, Any] = {"keys": [f"data/{draw(st.integers(0, world - 1))}/t/{i}" for i in range(n)]}
    elif packed is not None and (packed.cells is None or len(packed.cells) == n):
        keys = {}
    else:
        keys = {"key": draw(st.sampled_from(["t/0", "t/9f86d081884c", "p/3"]))}
    inner = None
    if draw(st.booleans()):
        shapes = list(itertools.product(*(sorted(a.sizes()) for a in ax)))
        inner = {s: tuple(max(1, x // 2) for x in s) for s in shapes if draw(st.booleans())}
    g = GridChunks(index, itemsize, dirs=dirs, **ranks, **keys, inner=inner, packed=packed)
    return g, shape, world


def _dtype(itemsize: int) -> str:
    return {1: "uint8", 2: "float16", 4: "float32", 8: "float64"}[itemsize]


# -- JSON round trips --------------------------------------------------------------------


@PROPS
@given(grids())
def test_any_grid_round_trips_through_the_manifest_bytes(case: tuple[GridChunks, tuple[int, ...], int]) -> None:
    g, shape, world = case
    e = TensorEntry(name="w", dtype=_dtype(g.itemsize), shape=shape, chunks=g)
    m = Manifest(save_id="s", world_size=world, rank=None, tensors={"w": e}, storage={0: "files"})
    data = m.dumps()
    back = Manifest.loads(data, "x.json")
    t = back.tensors["w"]
    expect_grid = len(g) >= xckpt.manifest.GRID_MIN_CELLS
    assert isinstance(t.chunks, GridChunks) == expect_grid
    assert tuple(t.chunks) == tuple(g)  # every cell, key, rank, byte range and inner grid
    assert back.dumps() == data
    for c in g:  # the cells are real chunks: in bounds, nbytes from the box
        assert Box.full(shape).contains(c.box) and c.nbytes == c.box.volume * g.itemsize
    xckpt.layout.check_coverage(shape, [c.box for c in g])


def test_grid_json_is_the_documented_form() -> None:
    ax = [GridAxis(10, step=4), GridAxis.of(6, [0, 1, 6])]
    g = GridChunks(GridIndex(ax), 4, dirs={1: "data/1.ab"}, rank_rule=(0, (2, 1)), key="t/5",
                   inner={(4, 1): (2, 1), (4, 5): (4, 5), (2, 1): (2, 1)},
                   packed=Packed(np.array([5]), "packed", 64, np.array([77])))
    assert g.to_json() == {
        "splits": [4, [0, 1, 6]],
        "ranks": {"base": 0, "strides": [2, 1]},
        "key": "t/5",
        "inner": [[[2, 1], [2, 1]], [[4, 1], [2, 1]], [[4, 5], [4, 5]]],
        # (crc32 column: base64 of little-endian uint32 77 = 4d 00 00 00)
        "packed": {"cells": [5], "key": "packed", "byte_offset": 64, "crc32": "TQAAAA=="},
    }
    assert [(c.offset, c.shape, c.rank, c.key, c.grid, c.form, c.byte_offset, c.crc32) for c in g] == [
        ((0, 0), (4, 1), 0, "data/0/t/5", (2, 1), "array", None, None),
        ((0, 1), (4, 5), 1, "data/1.ab/t/5", (4, 5), "array", None, None),
        ((4, 0), (4, 1), 2, "data/2/t/5", (2, 1), "array", None, None),
        ((4, 1), (4, 5), 3, "data/3/t/5", (4, 5), "array", None, None),
        ((8, 0), (2, 1), 4, "data/4/t/5", (2, 1), "array", None, None),
        ((8, 1), (2, 5), 5, "data/5/packed", None, "packed", 64, 77),
    ]
    assert g.packed_ends() == {"data/5/packed": 64 + 40}
    assert g[-1] == g[5] and g[1:3] == (g[1], g[2]) and len(g) == 6


# -- lookup equals the scan it replaces ------------------------------------------------------


@st.composite
def targets(draw: Any, shape: tuple[int, ...]) -> Box:
    off, shp = [], []
    for n in shape:
        lo = draw(st.integers(0, n))
        off.append(lo)
        shp.append(draw(st.integers(0, n - lo)))
    return Box(tuple(off), tuple(shp))


def _scan(boxes: list[Box], target: Box) -> list[int]:
    return [i for i, b in enumerate(boxes) if b.intersect(target) is not None]


@PROPS
@given(st.data())
def test_grid_lookup_equals_the_scan(data: Any) -> None:
    index = GridIndex(data.draw(axes()))
    boxes = [index.box(i) for i in range(len(index))]
    shape = tuple(a.extent for a in index.axes)
    for _ in range(5):
        target = data.draw(targets(shape))
        assert index.find(target) == _scan(boxes, target)
        assert plan_reads(index, target) == plan_reads(boxes, target)
        assert [(i, b, c) for i, b, c in index.overlaps(target)] == [
            (i, boxes[i], boxes[i].intersect(target)) for i in _scan(boxes, target)
        ]


@st.composite
def tilings(draw: Any) -> tuple[tuple[int, ...], list[Box]]:
    """Arbitrary tilings: boxes cut in two again and again along random dims (guillotine)."""
    shape = tuple(draw(st.lists(st.integers(1, 30), min_size=1, max_size=3)))
    boxes = [Box.full(shape)]
    for _ in range(draw(st.integers(0, 40))):
        i = draw(st.integers(0, len(boxes) - 1))
        b = boxes[i]
        d = draw(st.integers(0, len(shape) - 1))
        if b.shape[d] < 2:
            continue
        cut = draw(st.integers(1, b.shape[d] - 1))
        lo = Box(b.offset, b.shape[:d] + (cut,) + b.shape[d + 1 :])
        hi = Box(b.offset[:d] + (b.offset[d] + cut,) + b.offset[d + 1 :], b.shape[:d] + (b.shape[d] - cut,) + b.shape[d + 1 :])
        boxes[i : i + 1] = [lo, hi]
    perm = draw(st.permutations(range(len(boxes))))
    return shape, [boxes[p] for p in perm]


@PROPS
@given(tilings(), st.data())
def test_box_index_lookup_equals_the_scan(tiling: tuple[tuple[int, ...], list[Box]], data: Any) -> None:
    shape, boxes = tiling
    index = BoxIndex(boxes)
    for _ in range(6):
        target = data.draw(targets(shape))
        assert index.find(target) == _scan(boxes, target)
        assert plan_reads(index, target) == plan_reads(boxes, target)


@PROPS
@given(st.data())
def test_box_index_recognises_shuffled_grids(data: Any) -> None:
    index = GridIndex(data.draw(axes()))
    boxes = [index.box(i) for i in range(len(index))]
    boxes = [boxes[p] for p in data.draw(st.permutations(range(len(boxes))))]
    bi = BoxIndex(boxes)
    assert (bi._grid is not None) == (len(boxes) > BoxIndex.SCAN)
    shape = tuple(a.extent for a in index.axes)
    for _ in range(4):
        target = data.draw(targets(shape))
        assert bi.find(target) == _scan(boxes, target)


def test_a_lookup_tests_few_boxes() -> None:
    """4,096 row chunks and one in four columns split: a lookup visits the neighbours only."""
    boxes = [Box((r, 0), (1, 8)) for r in range(0, 4096, 4)]
    boxes += [Box((r, c), (1, 4)) for r in range(4096) if r % 4 for c in (0, 4)]
    index = BoxIndex(boxes)
    target = Box((1001, 2), (2, 3))
    want = _scan(boxes, target)
    calls = 0
    orig = Box.intersect

    def counting(self: Box, other: Box) -> Box | None:
        nonlocal calls
        calls += 1
        return orig(self, other)

    Box.intersect = counting  # type: ignore[method-assign]
    try:
        got = index.find(target)
    finally:
        Box.intersect = orig  # type: ignore[method-assign]
    assert got == want and calls < 40


@PROPS
@given(st.data())
def test_mesh_boxes_fast_path_equals_the_index_sets(data: Any) -> None:
    shape = tuple(data.draw(st.lists(st.integers(0, 50), min_size=1, max_size=3)))
    mesh = tuple(data.draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    pl = [data.draw(st.sampled_from([Replicate(), *[Shard(d) for d in range(len(shape))]])) for _ in mesh]
    every = xckpt.layout.mesh_boxes(shape, mesh, pl)
    for coord in itertools.product(*(range(n) for n in mesh)):
        want = _boxes_from_indices(dim_indices(shape, mesh, coord, pl))
        assert boxes_for_coordinate(shape, mesh, coord, pl) == want and every[coord] == want


# -- hostile claims ----------------------------------------------------------------------------


def _doc(grid: Any, shape: list[int], world: int = 4, dirs: Any = None) -> bytes:
    doc: dict[str, Any] = {"format": "xckpt", "version": 5, "save_id": "s", "world_size": world, "rank": None,
                           "storage": {"0": "files"}, "tensors": {"w": {"dtype": "float32", "shape": shape, "grid": grid}},
                           "objects": []}
    if dirs is not None:
        doc["dirs"] = dirs
    return _signed(doc)


def _signed(doc: dict[str, Any]) -> bytes:
    """A manifest's bytes with a valid checksum, as a hostile writer would make them."""
    body = json.dumps(doc, separators=(",", ":")).encode()  # (orjson refuses ints over 64 bits)
    return body[:-1] + b',"checksum":"sha256:' + hashlib.sha256(body).hexdigest().encode() + b'"}'


GOOD = {"splits": [2, 4], "ranks": {"base": 0, "strides": [1, 0]}, "key": "t/0"}


@pytest.mark.parametrize(
    ("grid", "shape", "message"),
    [
        ({**GOOD, "splits": [1, 1]}, [2**20, 2**20], r"more than 16777216 cells"),
        ({**GOOD, "splits": [1, [0, *range(1, 2**12), 2**12]]}, [2**20, 2**12], r"more than 16777216 cells"),
        ({**GOOD, "splits": [[0, 3, 3, 8], 4]}, [8, 4], r"split points 3 and 3 are not strictly increasing"),
        ({**GOOD, "splits": [[0, 5, 2, 8], 4]}, [8, 4], r"not strictly increasing"),
        ({**GOOD, "splits": [[1, 8], 4]}, [8, 4], r"must run from 0 to the extent 8"),
        ({**GOOD, "splits": [[0, 9], 4]}, [8, 4], r"must run from 0 to the extent 8"),
        ({**GOOD, "splits": [0, 4]}, [8, 4], r"step 0 must lie in \[1, 8\]"),
        ({**GOOD, "splits": [9, 4]}, [8, 4], r"step 9 must lie in \[1, 8\]"),
        ({**GOOD, "splits": [2]}, [8, 4], r"one entry per dimension"),
        ({**GOOD, "splits": [2.0, 4]}, [8, 4], r"a step or a list of split points"),
        ({**GOOD, "splits": [[0, 2**64], 4]}, [8, 4], r"split points|not valid JSON|a step or a list"),
        ({**GOOD, "ranks": {"base": 0, "strides": [2, 0]}}, [8, 4], r"ranks run from 0 to 6, outside \[0, 4\)"),
        ({**GOOD, "ranks": {"base": -1, "strides": [1, 0]}}, [8, 4], r"outside \[0, 4\)"),
        ({**GOOD, "ranks": {"base": 0, "strides": [2**62, 0]}}, [8, 4], r"grid ranks must be"),
        ({**GOOD, "ranks": [0, 1, 2]}, [8, 4], r"grid ranks must be a list of 4 integers"),
        ({**GOOD, "ranks": [0, 1, 2, 9]}, [8, 4], r"grid ranks must lie in \[0, 4\)"),
        ({**GOOD, "ranks": None}, [8, 4], r"grid lacks ranks"),
        ({**GOOD, "key": "../../etc/passwd"}, [8, 4], r"not a relative key"),
        ({**GOOD, "key": "t/" + "a" * 5000}, [8, 4], r"not a relative key"),
        ({**GOOD, "keys": ["data/0/t/0"] * 4}, [8, 4], r"key .* or keys, not both"),
        ({"splits": [2, 4], "ranks": [0, 1, 2, 3]}, [8, 4], r"array cells needs key"),
        ({"splits": [2, 4], "ranks": [0, 1, 2, 3], "keys": ["/etc/x"] * 4}, [8, 4], r"could leave the checkpoint"),
        ({**GOOD, "packed": {"key": "packed", "byte_offset": 0, "crc32": [0, 1, 2]}}, [8, 4], r"crc32 must be a list of 4"),
        ({**GOOD, "packed": {"key": "packed", "byte_offset": 0, "crc32": [0, 1, 2, 2**32]}}, [8, 4], r"crc32 must lie in"),
        ({**GOOD, "packed": {"key": "packed", "byte_offset": -1, "crc32": [0] * 4}}, [8, 4], r"byte_offset -1 is out of range"),
        ({**GOOD, "packed": {"key": "p", "byte_offset": 0, "crc32": [0] * 4}}, [8, 4], r"every cell is packed; key names array cells"),
        ({"splits": [2, 4], "ranks": [0, 1, 2, 3], "packed": {"byte_offset": 0, "crc32": [0] * 4}}, [8, 4], r"packed key 'None': a packed array's key"),
        ({**GOOD, "packed": {"key": "../x", "byte_offset": 0, "crc32": [0] * 4}}, [8, 4], r"packed key '\.\./x': a packed"),
        ({**GOOD, "keys": None, "key": None, "packed": {"cells": [1], "key": "p", "byte_offset": 0, "crc32": [0]}}, [8, 4], r"array cells needs key"),
        ({**GOOD, "packed": {"cells": [2, 1], "key": "p", "byte_offset": 0, "crc32": [0] * 2}}, [8, 4], r"strictly increasing"),
        ({**GOOD, "packed": {"cells": [1, 4], "key": "p", "byte_offset": 0, "crc32": [0] * 2}}, [8, 4], r"cells must lie in \[0, 4\)"),
        ({**GOOD, "packed": {"cells": [], "key": "p", "byte_offset": 0, "crc32": []}}, [8, 4], r"between 1 and 4 cells"),
        ({**GOOD, "packed": {"cells": [1], "key": "p", "byte_offset": [0, 1], "crc32": [0]}}, [8, 4], r"byte_offset must be a list of 1"),
        ({**GOOD, "packed": {"cells": [1], "key": "p", "byte_offset": 0, "crc32": [0], "x": 1}}, [8, 4], r"grid packed must be"),
        ({**GOOD, "inner": [[[3, 4], [1, 4]]]}, [8, 4], r"not \[cell shape, grid\]"),
        ({**GOOD, "inner": [[[2, 4], [0, 4]]]}, [8, 4], r"not \[cell shape, grid\]"),
        ({**GOOD, "inner": [[[2, 4], [1, 4]]] * 2}, [8, 4], r"not \[cell shape, grid\]"),
        ({**GOOD, "inner": [[[2, 4], [1, 4]]] * 5000}, [8, 4], r"at most 4096"),
        ({**GOOD, "extra": 1}, [8, 4], r"unknown members"),
        ({**GOOD, "splits": [1, 4]}, [0, 4], r"holds no cells"),
        ("grid", [8, 4], r"grid must be an object"),
    ],
)
def test_hostile_grid_claims_are_manifest_errors_quickly(grid: Any, shape: list[int], message: str) -> None:
    data = _doc(grid, shape)
    t = time.perf_counter()
    with pytest.raises(ManifestError, match=message):
        Manifest.loads(data, "x.json")
    assert time.perf_counter() - t < 1


def test_grid_members_need_version_5_and_valid_dirs() -> None:
    doc = orjson.loads(_doc(GOOD, [8, 4]))
    doc["version"] = 4
    with pytest.raises(ManifestError, match=r"a grid entry in a manifest older than version 5"):
        Manifest.loads(manifest_bytes(doc), "x.json")
    with pytest.raises(ManifestError, match=r"dirs\[1\] is '\.\./x', not a data directory"):
        Manifest.loads(_doc(GOOD, [8, 4], dirs={"1": "../x"}), "x.json")
    with pytest.raises(ManifestError, match=r"dirs names rank '7', not a rank below 4"):
        Manifest.loads(_doc(GOOD, [8, 4], dirs={"7": "data/7"}), "x.json")
    m = Manifest.loads(_doc(GOOD, [8, 4], dirs={"1": "data/1.ff"}), "x.json")
    assert [c.key for c in m.tensors["w"].chunks] == ["data/0/t/0", "data/1.ff/t/0", "data/2/t/0", "data/3/t/0"]


# -- end to end ----------------------------------------------------------------------------


def _save(root: Path, full: np.ndarray, boxes_by_rank: list[list[Box]], **kw: Any) -> None:
    w_count = len(boxes_by_rank)
    for r, boxes in enumerate(boxes_by_rank):
        w = xckpt.Writer(root, rank=r, world_size=w_count, save_id=kw.get("save_id", "s"), overwrite=kw.get("overwrite", False))
        w.declare("w", full.dtype, full.shape)
        for b in boxes:
            w.write("w", full[b.slices()], global_shape=full.shape, offset=b.offset)
        w.write_object("step", 1)
        w.commit()


def _rows(n: int, w: int) -> list[list[Box]]:
    return [[b] for b in (Box((lo, 0), (s, 6)) for lo, s in xckpt.layout.chunk_sizes(n, w)) if b.volume] + [
        [] for _ in range(w - sum(1 for _lo, s in xckpt.layout.chunk_sizes(n, w) if s))
    ]


@pytest.mark.parametrize("pack", [0, 1 << 20], ids=["arrays", "packed"])
def test_rank_local_grid_is_recognised_and_read(tmp_path: Path, pack: int) -> None:
    full = np.arange(100 * 6, dtype=np.float32).reshape(100, 6)
    for r, boxes in enumerate(_rows(100, 12)):
        w = xckpt.Writer(tmp_path / "c", rank=r, world_size=12, save_id="s", pack_threshold=pack)
        w.declare("w", np.float32, full.shape)
        for b in boxes:
            w.write("w", full[b.slices()], global_shape=full.shape, offset=b.offset)
        w.commit()
    ck = xckpt.open(tmp_path / "c")
    t = ck.info("w")
    assert t.is_grid and len(t.chunks) == 12
    assert [c.form for c in t.chunks] == ["packed" if pack else "array"] * 12
    assert ck.read("w").tobytes() == full.tobytes()
    assert ck.read("w", (slice(7, 60), slice(2, 5))).tobytes() == full[7:60, 2:5].tobytes()
    assert ck.verify() == []
    xckpt.finalize(tmp_path / "c", world_size=12, save_id="s")
    m = json.loads((tmp_path / "c" / "xckpt.json").read_text())
    assert m["version"] == xckpt.manifest.VERSION and m["tensors"]["w"]["grid"]["splits"] == [9, 6]
    assert m["tensors"]["w"]["grid"]["ranks"] == {"base": 0, "strides": [1, 0]}
    ck = xckpt.open(tmp_path / "c")
    assert ck.info("w").is_grid and ck.read("w").tobytes() == full.tobytes()


def test_uneven_and_2d_layouts_are_grids(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    full = rng.standard_normal((40, 30)).astype(np.float32)
    rows = [0, *sorted(rng.choice(np.arange(1, 40), 3, replace=False).tolist()), 40]
    cols = [0, 7, 8, 30]
    # cell (i, j) written by rank 4 j + i (column-major over a 4 x 3 mesh)
    boxes: list[list[Box]] = [[] for _ in range(12)]
    for i, j in itertools.product(range(4), range(3)):
        boxes[4 * j + i].append(Box((rows[i], cols[j]), (rows[i + 1] - rows[i], cols[j + 1] - cols[j])))
    _save(tmp_path / "c", full, boxes)
    ck = xckpt.open(tmp_path / "c")
    g = ck.info("w").chunks
    assert isinstance(g, GridChunks) and g.to_json()["ranks"] == {"base": 0, "strides": [1, 4]}
    assert g.to_json()["splits"] == [rows, cols]
    assert ck.read("w").tobytes() == full.tobytes()
    by_rank = ck.info("w").chunks_by_rank
    assert sorted(by_rank) == list(range(12)) and by_rank[5][0].offset == (rows[1], cols[1])
    for box in (Box((5, 6), (20, 3)), Box((39, 29), (1, 1))):
        assert ck.read("w", box.slices()).tobytes() == full[box.slices()].tobytes()


def test_replicated_writers_and_overwrite_tokens_keep_rules(tmp_path: Path) -> None:
    """Writers by list (no rule fits) and data directories data/<r>.<token> (dirs)."""
    full = np.arange(16 * 3, dtype=np.int64).reshape(16, 3)
    order = [5, 0, 7, 2, 6, 1, 4, 3]
    boxes = [[Box((2 * order.index(r), 0), (2, 3))] for r in range(8)]
    _save(tmp_path / "c", full, boxes)
    _save(tmp_path / "c", full, boxes, overwrite=True, save_id="s2")
    ck = xckpt.open(tmp_path / "c")
    g = ck.info("w").chunks
    assert isinstance(g, GridChunks) and g.rank_list is not None and g.rank_list.tolist() == order
    assert np.frombuffer(base64.b64decode(g.to_json()["ranks"]), "<u4").tolist() == order  # a base64 column
    assert ck.manifest.dirs.keys() == set(range(8)) and g.keys is None
    assert ck.read("w").tobytes() == full.tobytes()
    xckpt.finalize(tmp_path / "c", world_size=8, save_id="s2")
    m = json.loads((tmp_path / "c" / "xckpt.json").read_text())
    assert set(m["dirs"]) == {str(r) for r in range(8)} and "keys" not in m["tensors"]["w"]["grid"]
    assert xckpt.open(tmp_path / "c").read("w").tobytes() == full.tobytes()


def test_a_layout_that_is_not_a_grid_keeps_its_chunks(tmp_path: Path) -> None:
    full = np.arange(12 * 12, dtype=np.float32).reshape(12, 12)
    cuts = [Box((0, 0), (6, 12))] + [Box((6 + r, 0), (1, 5)) for r in range(6)] + [Box((6, 5), (6, 7))]
    _save(tmp_path / "c", full, [[b] for b in cuts])
    ck = xckpt.open(tmp_path / "c")
    assert not ck.info("w").is_grid and len(ck.info("w").chunks) == 8
    assert ck.read("w", (slice(5, 9), slice(3, 7))).tobytes() == full[5:9, 3:7].tobytes()


@pytest.mark.parametrize(
    ("boxes", "message"),
    [
        ([Box((r, 0), (1, 6)) for r in range(9)] + [Box((10, 0), (2, 6))], r"cover 66 of 72 elements.*gaps"),
        ([Box((r, 0), (1, 6)) for r in range(10)] + [Box((9, 0), (3, 6))], r"chunks \[9:10, 0:6\] and \[9:12, 0:6\] overlap"),
    ],
    ids=["gap", "overlap"],
)
def test_gaps_and_overlaps_of_many_writers_are_layout_errors(tmp_path: Path, boxes: list[Box], message: str) -> None:
    full = np.zeros((12, 6), np.float32)
    _save(tmp_path / "c", full, [[b] for b in boxes])
    with pytest.raises(LayoutError, match=message):
        xckpt.open(tmp_path / "c")


def test_plan_load_through_the_index_equals_a_scan(tmp_path: Path) -> None:
    full = np.zeros((96, 4), np.float32)
    _save(tmp_path / "c", full, [[Box((8 * r, 0), (8, 4))] for r in range(12)])
    ck = xckpt.open(tmp_path / "c")
    plan = xckpt.plan_load(ck, {"w": ((7,), "Shard(0)")})
    t = ck.info("w")
    for rp, (lo, n) in zip(plan.ranks, xckpt.layout.chunk_sizes(96, 7)):
        units: dict[Any, int] = {}
        for req in plan_reads(list(t.boxes), Box((lo, 0), (n, 4))):
            units.update(ck.read_units("w", t.chunks[req.chunk], req.box, 4))
        assert (rp.reads, rp.bytes_to_read) == (len(units), sum(units.values()))


def test_golden_v5_checkpoint_loads_unchanged() -> None:
    root = Path(__file__).parent / "golden" / "v5"
    expect = json.loads((root / "expected.json").read_text())
    for sub in ("ckpt", "ranks-only"):
        ck = xckpt.open(root / sub)
        got = ck.read_all()
        for name, spec in expect["tensors"].items():
            arr = got[name]
            assert arr.dtype == xckpt.manifest.numpy_dtype(spec["dtype"]) and list(arr.shape) == spec["shape"]
            assert arr.tobytes().hex() == spec["hex"]
        assert ck.objects(list(expect["objects"])) == expect["objects"]
        assert ck.objects(["rank"], per_rank="list") == {"rank": list(range(8))}
        w = np.frombuffer(bytes.fromhex(expect["tensors"]["w"]["hex"]), np.float32).reshape(24, 10)
        assert ck.read("w", (slice(5, 13), slice(4, 6))).tobytes() == w[5:13, 4:6].tobytes()
        assert ck.verify() == []
        assert ck.info("w").is_grid and ck.info("p").is_grid and ck.info("m").is_grid and not ck.info("odd").is_grid
        assert [c.form for c in ck.info("m").chunks] == ["array"] * 7 + ["packed"]
    m = json.loads((root / "ckpt" / "xckpt.json").read_text())
    assert m["version"] == 5 and m["tensors"]["w"]["grid"] == expect["grids"]["w"]
    assert all(m["tensors"][n]["grid"] == g for n, g in expect["grids"].items()) and m["dirs"] == expect["dirs"]
    assert m["tensors"]["m"]["grid"]["packed"]["cells"] == [7]


# -- the columnar merge agrees with the object merge -----------------------------------------


@pytest.fixture(scope="module", params=[1024, 1 << 20], ids=["mixed", "all-packed"])
def ten_ranks(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> list[bytes]:
    """Ten rank manifests of two tensors split by rows: one packed, one array chunk each
    ("mixed"), or both packed (the all-packed case of the rank-at-a-time merge)."""
    root = tmp_path_factory.mktemp("ten") / "c"
    full = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
    big = np.arange(40 * 3000, dtype=np.float32).reshape(40 * 10, 300)
    for r in range(10):
        w = xckpt.Writer(root, rank=r, world_size=10, save_id="s", pack_threshold=request.param)
        w.write("small", full[4 * r : 4 * r + 4], global_shape=full.shape, offset=(4 * r, 0))
        w.write("big", big[40 * r : 40 * r + 40], global_shape=big.shape, offset=(40 * r, 0))
        w.commit()
    return [(root / "ranks" / f"{r}.json").read_bytes() for r in range(10)]


HOSTILE = [None, True, 1.0, -1, 2**63, 10**30, "x", [], [0], [0, 0, 0], [True, 0], [-1, 0], [2**62, 0], {},
           "data/1/t/../x", "data/1", "data/1/packed", "data/12/t/x", "data/1.zz/t/x", "array", "packed", "other",
           [40.0, 3], [400, 300.0], [True, 3], [None, 0], ["a", 1], [[1], 0], "float16", {"framework": "torch", "mesh_shape": [2.0]},
           {"framework": "torch", "mesh_shape": [10], "placements": ["Shard(0)"]}, {"framework": 3}]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    st.integers(1, 9), st.sampled_from(["small", "big"]),
    st.sampled_from(["offset", "shape", "key", "rank", "nbytes", "grid", "form", "byte_offset", "crc32", "value_range",
                     "dtype", "placement", "tensor shape"]),
    st.sampled_from(HOSTILE),
)
def test_columnar_merge_equals_the_object_merge(ten_ranks: list[bytes], tmp_path_factory: pytest.TempPathFactory,
                                                rank: int, name: str, field: str, value: Any) -> None:
    docs = [orjson.loads(d) for d in ten_ranks]
    for d in docs:  # (the chunk table's tensors as entries: the merge of entry objects)
        d["tensors"] = with_table(d["tensors"], d.pop("table"), "x", d["rank"], {})
    if field in ("dtype", "placement", "value_range", "tensor shape"):  # the entry's own members
        docs[rank]["tensors"][name][field.replace("tensor ", "")] = value
    else:
        docs[rank]["tensors"][name]["chunks"][0][field] = value
    _merges_agree(docs, tmp_path_factory)


TABLE_INTS = [0, 1, 3, 40, 299, 2**31, 2**32 - 1, 2**56, 2**62, 2**62 + 1, 2**63, 2**64 - 1]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    st.integers(0, 9), st.integers(0, 3),
    st.sampled_from(["names", "dtypes", "keys", "ndim", "shape", "offset", "extent", "grid", "byte_offset", "crc32"]),
    st.one_of(st.sampled_from(HOSTILE), st.sampled_from(TABLE_INTS).map(lambda v: ("int", v))),
)
def test_chunk_table_merge_equals_the_object_merge(ten_ranks: list[bytes], tmp_path_factory: pytest.TempPathFactory,
                                                   rank: int, j: int, member: str, value: Any) -> None:
    """A rank manifest's chunk table (columns) merged in bulk gives what its tensors merged
    as entry objects give, for hostile values of every member (a whole member replaced,
    or one value of a list or column), or the same type of error."""
    docs = [orjson.loads(d) for d in ten_ranks]
    t = docs[rank]["table"]
    if isinstance(value, tuple):  # one value of a list or a column
        if isinstance(t[member], list):
            t[member][j % len(t[member])] = value[1] if j % 2 else str(value[1])
        else:
            dt = {"ndim": "u1", "crc32": "<u4"}.get(member, "<u8")
            col = np.frombuffer(base64.b64decode(t[member]), dt).copy()
            col[j % len(col)] = value[1] % (1 << (8 * col.itemsize))
            t[member] = base64.b64encode(col.tobytes()).decode()
    else:
        t[member] = value
    _merges_agree(docs, tmp_path_factory)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d["table"].update(offset="AAAA"), r"ranks/3\.json: table offset is a base64 column of 4 characters"),
        (lambda d: d["table"].update(names="small"), r"ranks/3\.json: the table's names must be a list"),
        (lambda d: d["table"]["dtypes"].__setitem__(1, "int4"), r"ranks/3\.json, tensor 'big' \(table\): unknown dtype"),
        (lambda d: d["table"].pop("crc32"), r"ranks/3\.json: the table must be an object with exactly the members"),
        (lambda d: d["tensors"].update(small={"dtype": "float32", "shape": [40, 3], "chunks": []}),
         r"ranks/3\.json: tensor 'small' is listed both in tensors and in the table"),
        (lambda d: d.update(rank=None),
         r"ranks/3\.json(: a merged manifest \(rank null\) has no table| says it is rank None)"),
        (lambda d: d.update(version=5), r"ranks/3\.json: a version 5 manifest has no table member"),
    ],
)
def test_chunk_table_errors_name_the_file_and_the_member(ten_ranks: list[bytes], tmp_path: Path, edit: Any,
                                                         match: str) -> None:
    """A bad chunk table is a ManifestError naming the checkpoint's rank manifest and the
    member, from the merge of an open as from `Manifest.loads`."""
    docs = [orjson.loads(d) for d in ten_ranks]
    edit(docs[3])
    (tmp_path / "ranks").mkdir()
    for r, d in enumerate(docs):
        (tmp_path / "ranks" / f"{r}.json").write_bytes(_signed(d))
    with pytest.raises(ManifestError, match=match):
        xckpt.open(str(tmp_path))
    with pytest.raises(ManifestError, match=match):
        Manifest.loads((tmp_path / "ranks" / "3.json").read_bytes(), f"{tmp_path}/ranks/3.json")


def _merges_agree(docs: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> None:
    """Rank manifests merged as columns (`read_rank_manifests`) and as entry objects
    (`Manifest.loads`, `merge_manifests`) agree: the same chunks, or the same type of error."""
    from xckpt.errors import XckptError
    from xckpt.manifest import merge_manifests
    from xckpt.native._zarr import NativeStorage as Storage
    from xckpt.native.commit import read_rank_manifests, validate

    datas = [_signed(d) for d in docs]
    root = tmp_path_factory.mktemp("m")
    (root / "ranks").mkdir()
    for r, d in enumerate(datas):
        (root / "ranks" / f"{r}.json").write_bytes(d)
    try:
        parts = [Manifest.loads(d, f"{root}/ranks/{r}.json") for r, d in enumerate(datas)]
        want = merge_manifests(parts, str(root))
        validate(want, str(root))
    except XckptError as e:
        with pytest.raises(XckptError) as got:
            read_rank_manifests(Storage(str(root)))
        assert type(got.value) is type(e)
        return
    got_m = read_rank_manifests(Storage(str(root)))
    for n, t in want.tensors.items():
        g = got_m.tensors[n]
        assert (g.dtype, g.shape, g.placement, g.value_range) == (t.dtype, t.shape, t.placement, t.value_range)
        # a grid leaves its packed cells' crc32s out (version 6: they follow the cells' bytes)
        want_chunks = [dataclasses.replace(c, crc32=None) if g.is_grid else c for c in t.chunks]
        assert sorted(g.chunks, key=lambda c: c.offset) == sorted(want_chunks, key=lambda c: c.offset)


# -- binary columns (format version 6) --------------------------------------------------------


def _packed_grid_doc(version: int, crc: Any, bo: Any = 0, ranks: Any = None) -> bytes:
    grid = {"splits": [2, 4], "ranks": {"base": 0, "strides": [1, 0]} if ranks is None else ranks,
            "packed": {"key": "packed", "byte_offset": bo, **({} if crc is None else {"crc32": crc})}}
    doc: dict[str, Any] = {"format": "xckpt", "version": version, "save_id": "s", "world_size": 8, "rank": None,
                           "storage": {"0": "files"}, "tensors": {"w": {"dtype": "float32", "shape": [16, 4], "grid": grid}},
                           "objects": []}
    return _signed(doc)  # 8 cells of 2 x 4, written by ranks 0..7 (world 8)


def _b64(values: list[int], dtype: str) -> str:
    return base64.b64encode(np.asarray(values, dtype).tobytes()).decode()


def test_binary_columns_are_read_and_lists_still_are() -> None:
    crcs, offs, ranks = [7, 2**32 - 1, 0, 12345] * 2, [0, 32, 64, 2**40, 96, 128, 160, 192], [3, 2, 1, 0, 4, 5, 7, 6]
    for version, crc, bo, rk in [(6, _b64(crcs, "<u4"), _b64(offs, "<u8"), _b64(ranks, "<u4")),
                                 (5, crcs, offs, ranks), (6, crcs, offs, ranks)]:
        m = Manifest.loads(_packed_grid_doc(version, crc, bo, rk), "x.json")
        g = m.tensors["w"].chunks
        assert [(c.crc32, c.byte_offset, c.rank) for c in g] == list(zip(crcs, offs, ranks))
        out = orjson.loads(m.dumps())["tensors"]["w"]["grid"]  # written back as base64, whatever it was read as
        assert out["packed"]["crc32"] == _b64(crcs, "<u4") and out["packed"]["byte_offset"] == _b64(offs, "<u8")
        assert out["ranks"] == _b64(ranks, "<u4") and orjson.loads(m.dumps())["version"] == xckpt.manifest.VERSION


def test_grid_without_crc32s_takes_them_from_the_data() -> None:
    """Version 6: a grid's packed cells may leave their crc32s out (they follow the cells'
    bytes); the cells' `crc32` is None and the grid is written back without them."""
    m = Manifest.loads(_packed_grid_doc(6, None, _b64(list(range(0, 288, 36)), "<u8")), "x.json")
    assert [(c.crc32, c.byte_offset) for c in m.tensors["w"].chunks] == [(None, b) for b in range(0, 288, 36)]
    assert "crc32" not in orjson.loads(m.dumps())["tensors"]["w"]["grid"]["packed"]
    assert m.tensors["w"].chunks.packed_ends() == {f"data/{r}/packed": 36 * r + 36 for r in range(8)}  # (+ 4: the crc32)


@pytest.mark.parametrize(
    ("version", "crc", "bo", "message"),
    [
        (5, _b64([1] * 8, "<u4"), 0, r"a base64 grid column in a version 5 manifest"),
        (6, _b64([1] * 7, "<u4"), 0, r"grid crc32 is a base64 column of 40 characters; 8 little-endian 32-bit"),
        (6, "A" * 42 + "=!", 0, r"grid crc32 is not valid base64"),
        (6, "AAAA " + "A" * 39, 0, r"not valid base64"),
        (6, _b64([1] * 8, "<u4"), _b64([0] * 7 + [2**56], "<u8"), r"grid byte_offset must lie in \[0, 72057594037927936\)"),
        (6, _b64([1] * 8, "<u4"), _b64([0] * 7, "<u8"), r"grid byte_offset is a base64 column"),
        (6, 7, 0, r"grid crc32 must be a list of 8 integers"),
        (5, None, 0, r"grid packed must be \{'cells'\?, 'key'\?, 'byte_offset', 'crc32'\}"),  # (required before 6)
    ],
)
def test_hostile_binary_columns_are_manifest_errors(version: int, crc: Any, bo: Any, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        Manifest.loads(_packed_grid_doc(version, crc, bo), "x.json")


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["crc32", "byte_offset", "ranks"]), st.one_of(st.text(max_size=40), st.binary(max_size=40)))
def test_any_column_string_is_read_or_refused_with_a_manifest_error(which: str, text: Any) -> None:
    """A hostile column (any text, or the base64 of any bytes) is read, in range, or is a ManifestError."""
    col = text if isinstance(text, str) else base64.b64encode(text).decode()
    args: dict[str, Any] = {"crc": _b64([1] * 8, "<u4"), "bo": 0, "ranks": None}
    args["crc" if which == "crc32" else "bo" if which == "byte_offset" else "ranks"] = col
    t0 = time.perf_counter()
    try:
        g = Manifest.loads(_packed_grid_doc(6, args["crc"], args["bo"], args["ranks"]), "x.json").tensors["w"].chunks
    except ManifestError:
        return
    finally:
        assert time.perf_counter() - t0 < 5
    cells = list(g)
    assert len(cells) == 8 and all(0 <= c.rank < 8 and 0 <= (c.crc32 or 0) < 2**32 for c in cells)


# -- grids walked lazily: a conversion's per-rank lookups, rules, inspect, show --------------------


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """64 writers, rank-local, two tensors split by rows (array cells and packed cells)."""
    root = tmp_path_factory.mktemp("wide") / "c"
    a = np.arange(128 * 4, dtype=np.float32).reshape(128, 4)
    b = np.arange(64 * 300, dtype=np.int32).reshape(64, 300)
    for r in range(64):
        w = xckpt.Writer(root, rank=r, world_size=64, save_id="s", pack_threshold=64)
        w.write("a", a[2 * r : 2 * r + 2], global_shape=a.shape, offset=(2 * r, 0))
        w.write("b", b[r : r + 1], global_shape=b.shape, offset=(r, 0))
        w.commit()
    return root


def _cells_built(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"chunk": 0}
    chunk = GridChunks.chunk

    def counted(self: GridChunks, i: int) -> Any:
        calls["chunk"] += 1
        return chunk(self, i)

    monkeypatch.setattr(GridChunks, "chunk", counted)
    return calls


def test_write_job_finds_a_ranks_chunks_without_a_scan(wide: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from xckpt.sink import WriteJob

    class _Bar:
        def update(self, n: int) -> None: ...

    ck = xckpt.open(wide)
    t = ck.info("b")
    assert t.is_grid and {c.form for c in t.chunks} == {"array"} and ck.info("a").chunks[0].form == "packed"
    job = WriteJob(ck, str(wide.parent / "out"), ("a", "b"), {}, None, _Bar())  # type: ignore[arg-type]
    calls = _cells_built(monkeypatch)
    for r in (0, 17, 63):
        got = list(job.chunks("b", rank=r))
        assert [c.rank for c, _ in got] == [r] and calls["chunk"] <= 2 * len({0, 17, 63})
        assert got[0][1].tobytes() == np.arange(r * 300, r * 300 + 300, dtype=np.int32).tobytes()
    assert list(job.chunks("b", rank=64)) == []
    assert t.chunk_ids_by_rank[17] == (17,) and t.bytes_by_rank()[5] == 1200 and t.ranks_column.tolist() == list(range(64))


def test_rules_inspect_and_show_build_no_cell_per_writer(wide: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from xckpt import cli, inspect

    calls = _cells_built(monkeypatch)
    ck = xckpt.open(wide, rules=[{"match": "^a$", "rename": "x"}])
    assert ck.info("x").is_grid and calls["chunk"] == 0  # a rename keeps the grid
    assert ck.read("x", (slice(5, 9),)).tobytes() == np.arange(128 * 4, dtype=np.float32).reshape(128, 4)[5:9].tobytes()
    assert calls["chunk"] <= 6  # the 3 cells the box meets (looked up by the view and the source), of 64
    calls["chunk"] = 0
    text = inspect.text_table(ck)
    assert "r0 32 B" in text and "+60 more" in text and calls["chunk"] == 0
    assert cli.main(["show", str(wide), "b", "--limit", "3"]) == 0
    assert "61 more chunks" in capsys.readouterr().out and calls["chunk"] <= 3
