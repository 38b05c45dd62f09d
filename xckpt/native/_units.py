"""The storage reads of many boxes of a grid tensor at once (`Checkpoint.read_units_columns`).

`plan_load` over thousands of ranks asks, per rank and tensor, which stored units a box
costs. For a grid tensor (`GridChunks`) the same answer comes from a few array operations
over every rank's box at once: the cells each box meets by searchsorted on the split points
(`GridIndex.overlap_columns`), then per cell the units `Checkpoint.read_units` names:

* an array cell: the inner zarr chunks the common region touches, each stored whole with a
  4-byte crc32c. Its key is the writer's data directory and the grid's `key`, so when no
  other tensor uses that key and the grid's array cells have distinct writers, its units
  are the box's own (counted, not listed);
* a packed cell: the spans of its writer's packed array it lies in, each `span + 4`
  bytes. Several tensors' cells share a span, so these come as codes
  (`key id << 32 | span index`) a plan dedups per rank.

Anything else (explicit keys, a shared key, directories that could coincide) answers
None, and the plan asks `read_units` per chunk.

Also here: `packed_sizes`, every packed array's size (its last cell's end), which sets the
array's span and so the units of its cells.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping

import numpy as np

from xckpt.manifest import Chunk, GridChunks, Manifest, TensorEntry
from xckpt.manifest._grids import data_dir, split_key
from xckpt.native._zarr import packed_grid
from xckpt.source import UnitColumns

__all__ = ["PlanColumns", "packed_sizes"]

#: A packed unit's code: its packed array's id above these bits, its span index below.
_SPAN_BITS = 32


class PlanColumns:
    """A checkpoint's column path, with what it needs computed once per checkpoint."""

    def __init__(self, manifest: Manifest, packed_sizes: Mapping[str, int]) -> None:
        self.world_size = manifest.world_size
        self.keys = list(packed_sizes)
        self._ids = {k: i for i, k in enumerate(self.keys)}
        self._spans = [packed_grid(packed_sizes[k]) for k in self.keys]
        self._per_rank: dict[tuple[str, int], tuple[np.ndarray, np.ndarray, Mapping[int, str]]] = {}
        self._dirs_ok: dict[int, tuple[bool, Mapping[int, str]]] = {}
        self.shared_keys = _shared_keys(manifest)
        self._own: dict[int, tuple[bool, GridChunks]] = {}

    def unit(self, code: int) -> Hashable:
        """The `read_units` key of a packed unit's code: (packed array key, span index)."""
        return (self.keys[code >> _SPAN_BITS], code & ((1 << _SPAN_BITS) - 1))

    def _packed_of(self, key: str, dirs: Mapping[int, str]) -> tuple[np.ndarray, np.ndarray]:
        """Per writer rank: the id of its packed array `key` (-1: none) and that array's span."""
        got = self._per_rank.get((key, id(dirs)))
        if got is None:
            ids = np.full(self.world_size, -1, np.int64)
            spans = np.ones(self.world_size, np.int64)
            for r in range(self.world_size):
                i = self._ids.get(f"{data_dir(r, dirs)}/{key}")
                if i is not None:
                    ids[r], spans[r] = i, self._spans[i]
            got = self._per_rank[(key, id(dirs))] = (ids, spans, dirs)  # (dirs kept: its id stays valid)
        return got[0], got[1]

    def _distinct_dirs(self, dirs: Mapping[int, str]) -> bool:
        """Whether every rank's data directory differs from every other's."""
        got = self._dirs_ok.get(id(dirs))
        if got is None:
            values = list(dirs.values())
            ok = len(set(values)) == len(values) and not any(
                v == f"data/{v[5:]}" and v[5:].isdigit() and int(v[5:]) not in dirs for v in values
            )
            got = self._dirs_ok[id(dirs)] = (ok, dirs)
        return got[0]

    def columns(self, t: TensorEntry, lo: np.ndarray, hi: np.ndarray, itemsize: int) -> UnitColumns | None:
        """`UnitColumns` of boxes `[lo, hi)` of grid tensor `t`, or None when not a grid this path takes."""
        g = t.chunks
        if (
            not isinstance(g, GridChunks) or not g.grid_index.axes or g.keys is not None
            or not self._distinct_dirs(g.dirs)
        ):
            return None
        index = g.grid_index
        q, cell, clo, chi = index.overlap_columns(lo, hi)
        p = g.packed
        if p is None:
            packed = np.zeros(len(cell), bool)
        elif p.cells is None:
            packed = np.ones(len(cell), bool)
        else:
            at = np.minimum(np.searchsorted(p.cells, cell), max(len(p.cells) - 1, 0))
            packed = p.cells[at] == cell if len(p.cells) else np.zeros(len(cell), bool)
        if not packed.all() and not self._own_arrays(g):
            return None
        ranks = g.ranks_column()
        # Per row and dimension: the cell's index, start and size.
        j = [(cell // s) % c for s, c in zip(index.strides, index.counts)]
        start = np.stack([index.points(d)[jd] for d, jd in enumerate(j)], 1) if j else clo
        size = np.stack([np.diff(index.points(d))[jd] for d, jd in enumerate(j)], 1) if j else clo
        n = len(lo)
        own_reads = np.zeros(n, np.int64)
        own_bytes = np.zeros(n, np.int64)
        arr = ~packed
        if arr.any():
            reads, nbytes = _array_units(g, size[arr], clo[arr] - start[arr], chi[arr] - start[arr], itemsize)
            np.add.at(own_reads, q[arr], reads)
            np.add.at(own_bytes, q[arr], nbytes)
        if not packed.any() or p is None:
            empty = np.zeros(0, np.int64)
            return UnitColumns(own_reads, own_bytes, empty, empty, empty, self.unit)
        key_ids, spans = self._packed_of(p.key or "", g.dirs)
        writer = ranks[cell[packed]]
        kid, span = key_ids[writer], spans[writer]
        if (kid < 0).any():
            return None
        if p.cells is None:
            pos = cell[packed]
        else:
            pos = np.searchsorted(p.cells, cell[packed])
        bo = np.asarray(p.byte_offset, np.int64)
        at = bo[pos] if bo.ndim else np.full(len(pos), int(bo), np.int64)
        cell_bytes = np.prod(size[packed], axis=1, dtype=np.int64) * g.itemsize + (4 if p.crc32 is None else 0)
        first, last = at // span, (at + cell_bytes - 1) // span
        if len(last) and last.max() >> _SPAN_BITS:
            return None
        many = last - first + 1
        rows = np.repeat(np.arange(len(first), dtype=np.int64), many)
        sub = first[rows] + np.arange(len(rows), dtype=np.int64) - np.repeat(np.cumsum(many) - many, many)
        code = (kid[rows] << _SPAN_BITS) | sub
        return UnitColumns(own_reads, own_bytes, q[packed][rows], code, span[rows] + 4, self.unit)

    def _own_arrays(self, g: GridChunks) -> bool:
        """Whether the grid's array cells' units are their box's own: a key no other tensor
        uses and, per array cell, a writer of its own."""
        got = self._own.get(id(g))
        if got is None:
            ranks = g.ranks_column()
            p = g.packed
            if p is not None and p.cells is not None:
                ranks = np.delete(ranks, p.cells)
            own = g.key is not None and g.key not in self.shared_keys and len(np.unique(ranks)) == len(ranks)
            got = self._own[id(g)] = (own, g)
        return got[0]


def _array_units(g: GridChunks, size: np.ndarray, lo: np.ndarray, hi: np.ndarray, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    """Per array cell row (its `size`, the common region `[lo, hi)` relative to the cell):
    the inner zarr chunks touched and their stored bytes (each padded whole, plus a crc32c)."""
    inner = size
    if g.inner:  # each distinct cell shape looked up once (numbered by its sizes' ranks per dim)
        shape_id = np.zeros(len(size), np.int64)
        for d in range(size.shape[1]):
            values, at = np.unique(size[:, d], return_inverse=True)
            shape_id = shape_id * len(values) + at.reshape(-1)
        _, first, inv = np.unique(shape_id, return_index=True, return_inverse=True)
        shapes = size[first].tolist()
        inner = np.array([g.inner.get(tuple(s), tuple(s)) for s in shapes], np.int64).reshape(len(shapes), -1)
        inner = inner[inv.reshape(-1)]
    reads = np.prod((hi - 1) // inner - lo // inner + 1, axis=1, dtype=np.int64)
    return reads, reads * (np.prod(inner, axis=1, dtype=np.int64) * itemsize + 4)


def _shared_keys(manifest: Manifest) -> set[str]:
    """Array keys (relative to the data directory) that more than one tensor uses."""
    seen: set[str] = set()
    shared: set[str] = set()
    for t in manifest.tensors.values():
        c = t.chunks
        if isinstance(c, GridChunks):
            mine = {c.key} if c.key is not None else {s[1] for k in c.keys or () if (s := split_key(k))}
        else:
            mine = {s[1] for ch in c if ch.form != "packed" and (s := split_key(ch.key))}
        shared |= seen & mine
        seen |= mine
    return shared


def packed_sizes(manifest: Manifest, end: Callable[[Chunk], int]) -> dict[str, int]:
    """Bytes of each packed array: the largest `end` of its chunks. A grid's cells are not
    built: grids of one packed key per writer are taken together, by rank, and each array's
    key is spelled once (4,096 writers x 100 tensors: 4,096 keys, not 409,600)."""
    sizes: dict[str, int] = {}
    by_rank: dict[tuple[str, int], tuple[np.ndarray, Mapping[int, str]]] = {}
    for t in manifest.tensors.values():
        g = t.chunks
        if not isinstance(g, GridChunks):
            for c in g:
                if c.form == "packed":
                    sizes[c.key] = max(sizes.get(c.key, 0), end(c))
        elif g.packed is not None and g.keys is None:
            got = by_rank.get((g.packed.key or "", id(g.dirs)))
            if got is None:
                got = by_rank[(g.packed.key or "", id(g.dirs))] = (np.full(manifest.world_size, -1, np.int64), g.dirs)
            writers, last = g.packed_end_columns()
            np.maximum.at(got[0], writers, last)
        else:
            for k, e in g.packed_ends().items():
                sizes[k] = max(sizes.get(k, 0), e)
    for (key, _), (last, dirs) in by_rank.items():
        for r in np.flatnonzero(last >= 0).tolist():
            k = f"{data_dir(r, dirs)}/{key}"
            sizes[k] = max(sizes.get(k, 0), int(last[r]))
    return sizes
