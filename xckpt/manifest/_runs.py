"""Rank manifests of one regular save merged a rank at a time, not a chunk at a time.

The rank manifests of a save whose tensors are split over every writer look alike: the
same tensors in the same order, one chunk each, with the members the writer writes. For
4,096 writers x 100 tensors that is 409,600 chunks, and a Python loop that checks and
appends them one at a time (`xckpt.manifest._merge.RankMerge._fast`) costs seconds.
A `Run` takes such ranks whole: each field of all of a rank's chunks is pulled out
in one comprehension, checked in bulk (`set(map(type, ...))`, `min`, `max`, one
comparison of lists), and kept as one row; consecutive ranks with the same tensors in the
same order form a run, which `Run.flush` hands to the tensors' columns as numpy
slices (one per tensor and column, not one per chunk). A rank that does not fit in every
respect is left to the chunk-at-a-time path (nothing of it is taken), whose checks name
the field.
"""

from __future__ import annotations

import math
from itertools import chain
from operator import itemgetter, methodcaller, mul
from typing import Any

import numpy as np

from xckpt.manifest._checks import MAX_EXTENT, MAX_TENSOR_BYTES
from xckpt.manifest._grids import split_key

__all__ = ["Run"]

#: Ranks held as rows before they go to the columns (their Python integers are let go then).
_ROWS = 128
_INT, _DICT, _LIST, _STR, _ONE = {int}, {dict}, {list}, {str}, {1}
#: An entry's members; a chunk's (an array chunk adds "grid", a packed one the last three).
_ENTRY = itemgetter("dtype", "shape", "chunks")
_CHUNK = itemgetter("offset", "shape", "key", "rank", "nbytes")
_PACKED = itemgetter("form", "byte_offset", "crc32")
_GRID = itemgetter("grid")
_GRID_OR_NONE = methodcaller("get", "grid")


def _ids(table: Any, values: list[Any]) -> list[int]:
    """The interned ids of `values` (`table`: a `_Table` of `_merge`), new ones added."""
    got = list(map(table.ids.get, values))
    if None in got:
        got = list(map(table.id, values))
    return got


def _where(values: list[int], v: int) -> list[int]:
    """The indices of `v` in `values` (found by `list.index`: quick when they are few)."""
    out, j = [], -1
    try:
        while True:
            j = values.index(v, j + 1)
            out.append(j)
    except ValueError:
        return out


def _ints_ok(flat: list[Any], lo: int, hi: int) -> bool:
    """Every value an int (not a bool, not a float) in `[lo, hi]`."""
    return not flat or (set(map(type, flat)) == _INT and min(flat) >= lo and max(flat) <= hi)


class Run:
    """Consecutive ranks whose manifests list the same tensors, in the same order, each one
    plain chunk: their chunks as rows, one per rank, until `flush`.

    `accs`: the tensors' column holders (`xckpt.manifest._merge._Tensor`, columns
    started), in the ranks' order; `ids`: interning of directories, key suffixes and inner
    grids (`id(value) -> int`)."""

    def __init__(self, names: tuple[str, ...], accs: list[Any]) -> None:
        self.names, self.accs = names, accs
        self.dtypes = [a.entry.dtype for a in accs]
        self.shapes = [a.raw_shape for a in accs]
        self.nds = [len(s) for s in self.shapes]
        self.itemsizes = [a.itemsize for a in accs]
        self.stops = list(np.cumsum(self.nds))
        self.rows: list[tuple[Any, ...]] = []
        #: Key suffixes already found valid (every rank names the same ones, in its own directory).
        self.suffixes: set[str] = set()

    def take(self, tensors: dict[str, Any], world: int, tables: tuple[Any, Any, Any],
             rank_dirs: dict[int, str]) -> bool:
        """Add a rank's `tensors` (raw JSON, in this run's order) when every chunk passes every
        check of `xckpt.manifest.Chunk.from_json`; False (nothing taken) otherwise.
        `tables`: the interning tables of directories, key suffixes and inner grids.

        A dict of `len` 3 from which `dtype`, `shape` and `chunks` are all taken has
        exactly those members (and a chunk of 8 or 6 likewise those the writer writes); a
        member missing raises KeyError, which the caller takes as "not this path"."""
        ents = list(tensors.values())
        if set(map(type, ents)) != _DICT or set(map(len, ents)) != {3}:
            return False
        dtypes, shapes, chs = zip(*map(_ENTRY, ents))
        if list(dtypes) != self.dtypes or list(shapes) != self.shapes:
            return False
        if set(map(type, chain.from_iterable(shapes))) != _INT:  # (equal to the run's checked shapes: 40.0 == 40)
            return False
        if set(map(type, chs)) != _LIST or set(map(len, chs)) != _ONE:
            return False
        cs = list(map(itemgetter(0), chs))
        if set(map(type, cs)) != _DICT:
            return False
        lens = set(map(len, cs))
        if not lens <= {6, 8}:
            return False
        offs, shps, keys, ranks, nbytes = map(list, zip(*map(_CHUNK, cs)))
        if set(map(type, offs)) != _LIST or set(map(type, shps)) != _LIST:
            return False
        if list(map(len, offs)) != self.nds or list(map(len, shps)) != self.nds:
            return False
        flat_off, flat_shp = list(chain.from_iterable(offs)), list(chain.from_iterable(shps))
        if not (_ints_ok(flat_off, 0, MAX_EXTENT) and _ints_ok(flat_shp, 0, MAX_EXTENT)):
            return False
        if nbytes != list(map(mul, map(math.prod, shps), self.itemsizes)) or set(map(type, nbytes)) != _INT:
            return False
        rset = set(ranks)
        rank = ranks[0]
        if len(rset) != 1 or type(rank) is not int or not 0 <= rank < world:
            return False
        parts = split_key(keys[0])
        if parts is None or set(map(type, keys)) != _STR:
            return False
        d = parts[0]
        cut = len(d) + 1
        if set(map(itemgetter(slice(0, cut)), keys)) != {d + "/"}:
            return False
        sfx = list(map(itemgetter(slice(cut, None)), keys))
        new = set(sfx) - self.suffixes  # (each suffix checked once per run, not once per rank)
        if not all(split_key(f"{d}/{s}") is not None for s in new):
            return False
        self.suffixes |= new
        row = self._fields(cs, lens, tables[2])
        if row is None:
            return False
        rank_dirs.setdefault(rank, d)
        self.rows.append((flat_off, flat_shp, rank, tables[0].id(d), _ids(tables[1], sfx), *row))
        if len(self.rows) >= _ROWS:
            self.flush()
        return True

    def _fields(self, cs: list[Any], lens: set[int], inner_table: Any) -> tuple[list[int], ...] | None:
        """Each chunk's inner grid id, byte offset and crc32 (-1 where it has none), checked:
        a chunk of 8 members is packed (form, byte_offset, crc32), of 6 an array (grid).
        Field by field over all chunks (no Python step per chunk but per packed one)."""
        n = len(cs)
        none = [-1] * n
        if lens == {8}:
            p_idx, grids, nds = list(range(n)), [], []
        else:
            p_idx = _where(list(map(len, cs)), 8) if 8 in lens else []
            grids = list(map(_GRID, cs)) if not p_idx else list(filter(None, map(_GRID_OR_NONE, cs)))
            nds = self.nds
            if p_idx:
                nds = nds.copy()
                for j in reversed(p_idx):
                    del nds[j]
        if len(grids) != n - len(p_idx):
            return None  # (an array chunk with no grid: the chunk-at-a-time path takes it)
        if grids and (set(map(type, grids)) != _LIST or list(map(len, grids)) != nds):
            return None  # (a grid member in a packed chunk, or an empty one, fails the count)
        if not _ints_ok(list(chain.from_iterable(grids)), 1, MAX_EXTENT):
            return None
        inner = _ids(inner_table, list(map(tuple, grids)))
        if not p_idx:
            return inner, none, none
        forms, pbo, pcrc = map(list, zip(*map(_PACKED, map(cs.__getitem__, p_idx))))
        if set(forms) != {"packed"} or not (_ints_ok(pbo, 0, MAX_TENSOR_BYTES - 1) and _ints_ok(pcrc, 0, (1 << 32) - 1)):
            return None
        if not grids:
            return [0] * n, pbo, pcrc
        bo, crc = list(none), list(none)
        no_grid = _ids(inner_table, [None])[0]
        for j, b, c in zip(p_idx, pbo, pcrc):  # (packed chunks: few in a rank that has array chunks)
            bo[j], crc[j] = b, c
            inner.insert(j, no_grid)  # (j increasing: each lands at its own place)
        return inner, bo, crc

    def flush(self) -> None:
        """Hand the rows to the tensors' columns (in rank order) and start empty."""
        if not self.rows:
            return
        r = len(self.rows)

        def col(k: int) -> np.ndarray:  # (rows of one length: numpy from the nested lists, 2x array('q'))
            return np.array([row[k] for row in self.rows], np.int64).reshape(r, -1)

        offs, shps = col(0), col(1)
        ranks = np.array([row[2] for row in self.rows], np.int64)
        dirs = np.array([row[3] for row in self.rows], np.int64)
        cols = [col(k) for k in range(4, 8)]
        start = 0
        for j, (acc, stop) in enumerate(zip(self.accs, self.stops)):
            acc.offs.frombytes(offs[:, start:stop].tobytes())
            acc.shps.frombytes(shps[:, start:stop].tobytes())
            start = stop
            acc.ranks.frombytes(ranks.tobytes())
            acc.dirs.frombytes(dirs.tobytes())
            for c, name in zip(cols, ("sfx", "inner", "bo", "crc")):
                getattr(acc, name).frombytes(c[:, j].tobytes())
            acc.n += r
        self.rows = []
