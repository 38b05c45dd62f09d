"""Grid entries (format version 5): a tensor whose chunks form a rectilinear grid over its
writers is stored as the grid, not one chunk object per writer.

A grid entry is `{"dtype", "shape", "grid": {...}}` with, in `"grid"`:

* `"splits"`: per dimension, an integer step `s` (cells `[i s, min((i + 1) s, extent))`)
  or the split points `[0, ..., extent]`, strictly increasing;
* `"ranks"`: the writer of each cell, `{"base": b, "strides": [s0, s1, ...]}` (cell
  `(i0, i1, ...)` is rank `b + i0 s0 + i1 s1 + ...`) or a list, one rank per cell in
  row-major cell order;
* `"key"`: the array cells' key relative to their writer's data directory (`"t/<id>"`:
  the key is `data/<rank>/t/<id>`, or under `dirs[rank]` where the manifest's `"dirs"`
  names one), or `"keys"`: one full key per cell (every cell, packed ones too);
* `"inner"` (optional): `[[cell shape, zarr chunk shape], ...]`: the zarr chunk shape
  inside the array cells of each shape listed (a cell of a shape not listed has none: its
  whole box is one zarr chunk);
* `"packed"` (optional): cells that are packed chunks of their writer's packed byte array,
  `{"cells": [cell ids, increasing] (absent: every cell), "key": that array's key relative
  to the writer's data directory (with `"key"`), "byte_offset": int | column (one per packed
  cell), "crc32": column (one per packed cell; optional from version 6 on, absent as written)}`.
  (A split by `torch.chunk` leaves the last writers short: their cells may fall under the
  packing threshold while the others do not.)

From version 6 on, a packed chunk's bytes are followed in its packed array by their crc32
(4 bytes, little-endian), so a grid leaves its packed cells' crc32s out: 4,096 writers x
100 tensors of 256-byte packed cells are 409,600 crc32s, 2.2 MB as base64 of a 2.3 MB
manifest, which no text encoding brings under 2 MB. Such a cell's `Chunk.crc32` is None;
its reader takes the crc32 from the 4 bytes after the cell's.

A **column** (one integer per cell or per packed cell: `"ranks"`, `"byte_offset"`,
`"crc32"`) is a JSON list of integers (version 5) or, from version 6 on, a string: the
base64 (RFC 4648, padded) of the integers as little-endian `uint32` (`ranks`,
`crc32`) or `uint64` (`byte_offset`), back to back: a column decodes in one
`numpy.frombuffer`. A column's decoded length and range are checked before it is used.

`GridChunks` is the grid as a lazy `Sequence[Chunk]`: a cell's `Chunk`
is built when asked for, lookups go through its [`GridIndex`][xckpt.layout.GridIndex] (bisect
on the split points), and coverage is the split points' arithmetic. Every claim is
checked against fixed bounds before anything is sized from it: the cell count is the
product of the split counts, checked against `MAX_CHUNKS` as it is formed.
`grid_from_columns` recognises a grid in chunk columns (a merge of rank manifests).
"""

from __future__ import annotations

import base64
import binascii
import functools
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, overload

import numpy as np

from xckpt.errors import LayoutError, ManifestError
from xckpt.layout import GridAxis, GridIndex
from xckpt.manifest._checks import (
    COLUMNS_VERSION,
    MAX_CHUNKS,
    MAX_KEY_LEN,
    MAX_TENSOR_BYTES,
    MAX_WORLD_SIZE,
    TRAILER_VERSION,
    VERSION,
    _check_key,
    _new,
    _set,
)
from xckpt.manifest._chunks import Chunk

__all__ = ["GRID_MIN_CELLS", "GridChunks", "Packed", "check_dirs", "data_dir", "grid_from_columns", "split_key"]

#: Tensors of fewer chunks keep the chunk list (as small, and readable by eye).
GRID_MIN_CELLS = 8
#: Distinct cell shapes an `"inner"` map may list.
MAX_GRID_SHAPES = 4096
#: A data directory: `data/<rank>` or `data/<rank>.<token>` (an overwriting save's).
_DIR_RE = re.compile(r"^data/[0-9]{1,7}(\.[0-9a-f]{1,32})?$")
_SUFFIX_RE = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")
#: The longest data directory, so a key suffix leaves room for it within MAX_KEY_LEN.
_MAX_DIR_LEN = len("data/1048575.") + 32


def data_dir(rank: int, dirs: Mapping[int, str]) -> str:
    """Rank `rank`'s data directory: `dirs[rank]`, else `data/<rank>`."""
    d = dirs.get(rank)
    return d if d is not None else f"data/{rank}"


@functools.lru_cache(maxsize=1 << 12)
def _suffix_ok(s: str) -> bool:
    return (
        len(s) <= MAX_KEY_LEN - _MAX_DIR_LEN - 1
        and bool(_SUFFIX_RE.match(s))
        and not any(p in (".", "..") for p in s.split("/"))
    )


@functools.lru_cache(maxsize=1 << 16)
def _dir_ok(d: str) -> bool:
    return bool(_DIR_RE.match(d))


def split_key(key: Any) -> tuple[str, str] | None:
    """A chunk key as (its data directory, the rest), or None when it is not a valid key
    (what `_check_key` accepts, checked in two cached parts)."""
    if type(key) is not str or len(key) > MAX_KEY_LEN:
        return None
    i = key.find("/", 5)
    if i < 0:
        return None
    d, s = key[:i], key[i + 1 :]
    if not (_dir_ok(d) and _suffix_ok(s)):
        return None
    return d, s


def check_dirs(raw: Any, where: str, world_size: int) -> dict[int, str]:
    """The manifest's `"dirs"` member: `{"<rank>": "data/<rank>.<token>"}`."""
    if raw is None:
        return {}
    if type(raw) is not dict or len(raw) > world_size:
        raise ManifestError(f"{where}: dirs must be an object with at most one entry per rank")
    out = {}
    for r, d in raw.items():
        if not (r.isascii() and r.isdigit() and len(r) < 8 and int(r) < world_size):
            raise ManifestError(f"{where}: dirs names rank {r[:20]!r}, not a rank below {world_size}")
        if type(d) is not str or not _dir_ok(d):
            raise ManifestError(f"{where}: dirs[{r}] is {str(d)[:80]!r}, not a data directory data/<rank>[.<token>]")
        out[int(r)] = d
    return out


class Packed(NamedTuple):
    """A grid's packed cells: which (None: all), their array's key suffix (None with explicit
    keys), and each one's byte offset (one for all, or per packed cell) and crc32 (None:
    stored after each cell's bytes, version 6)."""

    cells: np.ndarray | None
    key: str | None
    byte_offset: int | np.ndarray
    crc32: np.ndarray | None



class GridChunks(Sequence[Chunk]):
    """A tensor's chunks as a grid: a lazy sequence whose cell `i` (row-major) is built on
    demand. `grid_index` finds the cells a box meets; nothing here is O(cells) but
    `to_json`, the columns, equality and iteration (which builds each cell as it goes
    and keeps none)."""

    def __init__(
        self,
        index: GridIndex,
        itemsize: int,
        *,
        dirs: Mapping[int, str],
        rank_rule: tuple[int, tuple[int, ...]] | None = None,
        rank_list: np.ndarray | None = None,
        key: str | None = None,
        keys: Sequence[str] | None = None,
        inner: Mapping[tuple[int, ...], tuple[int, ...]] | None = None,
        packed: Packed | None = None,
    ) -> None:
        self.grid_index = index
        self.itemsize = itemsize
        self.dirs = dirs
        self.rank_rule, self.rank_list = rank_rule, rank_list
        self.key, self.keys = key, keys
        self.inner = dict(inner) if inner else None
        self.packed = packed
        #: Packed cell -> its position among the packed cells (all cells: None).
        self._packed_at = None if packed is None or packed.cells is None else {
            c: j for j, c in enumerate(packed.cells.tolist())
        }

    def _position(self, i: int) -> int:
        """Cell `i`'s position among the packed cells, or -1 when it is an array cell."""
        if self.packed is None:
            return -1
        at = self._packed_at
        return i if at is None else at.get(i, -1)

    # -- the sequence -------------------------------------------------------------

    def __len__(self) -> int:
        return self.grid_index.n

    @overload
    def __getitem__(self, i: int) -> Chunk: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[Chunk, ...]: ...

    def __getitem__(self, i: int | slice) -> Chunk | tuple[Chunk, ...]:
        if isinstance(i, slice):
            return tuple(self.chunk(j) for j in range(self.grid_index.n)[i])
        if i < 0:
            i += self.grid_index.n
        return self.chunk(i)

    def __iter__(self) -> Iterator[Chunk]:
        # Built as walked, not kept: a walk over every chunk (verify, convert) holds what it
        # keeps of them, never every cell of every grid at once. Lookups never walk them.
        return map(self.chunk, range(self.grid_index.n))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, GridChunks):
            return self.itemsize == other.itemsize and self.dirs == other.dirs and self.to_json() == other.to_json()
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))  # equal to the tuple of its chunks, so hashed as one

    def __repr__(self) -> str:
        return f"GridChunks({len(self)} cells, splits {self.splits_json()})"

    def rank(self, i: int, idx: Sequence[int] | None = None) -> int:
        """The writer of cell `i` (`idx`: its per-dimension index, when known)."""
        if self.rank_list is not None:
            return int(self.rank_list[i])
        base, strides = self.rank_rule or (0, ())
        return base + sum(j * s for j, s in zip(self.grid_index.cell(i) if idx is None else idx, strides))

    def ranks_column(self) -> np.ndarray:
        """The writer of every cell (int64, row-major cell order), by arithmetic: no cell is built."""
        if self.rank_list is not None:
            return self.rank_list
        base, strides = self.rank_rule or (0, ())
        n = self.grid_index.n
        out = np.full(n, base, np.int64)
        ar = np.arange(n, dtype=np.int64)
        for s, c, st in zip(self.grid_index.strides, self.grid_index.counts, strides):
            if st:
                out += ((ar // s) % c) * st
        return out

    def nbytes_column(self, ids: np.ndarray | None = None) -> np.ndarray:
        """The bytes of every cell (or of cells `ids`), int64, by arithmetic: no cell is built."""
        ids = np.arange(self.grid_index.n, dtype=np.int64) if ids is None else ids
        nbytes = np.full(len(ids), self.itemsize, np.int64)
        index = self.grid_index
        for d, (s, c) in enumerate(zip(index.strides, index.counts)):
            nbytes *= np.diff(index.points(d))[(ids // s) % c]
        return nbytes

    def chunk(self, i: int) -> Chunk:
        """Cell `i` as a `Chunk` (built now)."""
        idx = self.grid_index.cell(i)
        off, shp = self.grid_index.cell_box(idx)
        rank = self.rank(i, idx)
        p = self.packed
        j = self._position(i)
        if self.keys is not None:
            key = self.keys[i]
        else:
            key = f"{data_dir(rank, self.dirs)}/{self.key if j < 0 or p is None else p.key}"
        bo = crc = grid = None
        if p is not None and j >= 0:
            bo = p.byte_offset if type(p.byte_offset) is int else int(p.byte_offset[j])  # type: ignore[index]
            crc = None if p.crc32 is None else int(p.crc32[j])
        elif self.inner:
            grid = self.inner.get(shp)
        c = _new(Chunk)
        _set(c, "__dict__", {
            "offset": off, "shape": shp, "key": key, "rank": rank, "nbytes": math.prod(shp) * self.itemsize,
            "form": "array" if j < 0 else "packed", "byte_offset": bo, "crc32": crc, "grid": grid,
            "value_range": None,
        })
        return c

    def packed_ends(self) -> dict[str, int]:
        """For packed cells: each packed array's key and the end of its last cell's bytes (and
        of the crc32 after them, where the grid does not list the crc32s)."""
        p = self.packed
        if p is None:
            return {}
        if self.keys is not None:
            ids, ends = self._packed_cell_ends()
            out: dict[str, int] = {}
            for i, e in zip(ids.tolist(), ends.tolist()):
                out[self.keys[i]] = max(out.get(self.keys[i], 0), e)
            return out
        writers, last = self.packed_end_columns()
        return {f"{data_dir(r, self.dirs)}/{p.key}": e for r, e in zip(writers.tolist(), last.tolist())}

    def _packed_cell_ends(self) -> tuple[np.ndarray, np.ndarray]:
        """The packed cells' ids and the end of each one's bytes (and crc32) in its packed array."""
        p = self.packed
        if p is None:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        ids = np.arange(self.grid_index.n, dtype=np.int64) if p.cells is None else p.cells
        return ids, np.asarray(p.byte_offset, np.int64) + self.nbytes_column(ids) + (4 if p.crc32 is None else 0)

    def packed_end_columns(self) -> tuple[np.ndarray, np.ndarray]:
        """`packed_ends` of a grid whose packed cells lie in one packed array per writer (`key`,
        not `keys`), as columns: the writers with packed cells, ascending, and the end of each
        one's last cell."""
        ids, ends = self._packed_cell_ends()
        # The largest end per rank, by numpy (409,600 cells: no loop).
        writers, inv = np.unique(self.ranks_column()[ids], return_inverse=True)
        last = np.zeros(len(writers), np.int64)
        np.maximum.at(last, inv.reshape(-1), ends)
        return writers, last

    # -- JSON ---------------------------------------------------------------------

    def splits_json(self) -> list[Any]:
        return [a.step if a.step else list(a.points) for a in self.grid_index.axes]

    def to_json(self) -> dict[str, Any]:
        """The `"grid"` member (keys relative to `self.dirs`, which the manifest writes)."""
        d: dict[str, Any] = {"splits": self.splits_json()}
        if self.rank_list is not None:
            d["ranks"] = column_json(self.rank_list, "<u4")
        else:
            base, strides = self.rank_rule or (0, ())
            d["ranks"] = {"base": base, "strides": list(strides)}
        if self.keys is not None:
            d["keys"] = list(self.keys)
        elif self.key is not None:
            d["key"] = self.key
        if self.inner:
            d["inner"] = [[list(s), list(g)] for s, g in sorted(self.inner.items())]
        p = self.packed
        if p is not None:
            pd: dict[str, Any] = {}
            if p.cells is not None:
                pd["cells"] = p.cells.tolist()
            if p.key is not None:
                pd["key"] = p.key
            bo = p.byte_offset
            pd["byte_offset"] = bo if isinstance(bo, int) else column_json(bo, "<u8")
            if p.crc32 is not None:
                pd["crc32"] = column_json(p.crc32, "<u4")
            d["packed"] = pd
        return d

    @classmethod
    def from_json(
        cls, raw: Any, shape: tuple[int, ...], itemsize: int, world_size: int, dirs: Mapping[int, str], where: str,
        version: int = VERSION,
    ) -> GridChunks:
        """Validate a `"grid"` member of a version `version` manifest; bounded work before
        anything is sized from a claim."""
        if type(raw) is not dict:
            raise ManifestError(f"{where}: grid must be an object")
        unknown = set(raw) - {"splits", "ranks", "key", "keys", "inner", "packed"}
        if unknown:
            raise ManifestError(f"{where}: grid has unknown members {sorted(unknown)[:5]}")
        index = _grid_index(raw.get("splits"), shape, where)
        n = index.n
        if version < COLUMNS_VERSION:
            p = raw.get("packed")
            p = p if isinstance(p, dict) else {}
            for col in (raw.get("ranks"), p.get("byte_offset"), p.get("crc32")):
                if type(col) is str:
                    raise ManifestError(
                        f"{where}: a base64 grid column in a version {version} manifest (they are written from "
                        f"version {COLUMNS_VERSION} on); the file was edited"
                    )
        rank_rule, rank_list = _ranks(raw.get("ranks"), index, world_size, where)
        key, keys = raw.get("key"), raw.get("keys")
        if key is not None and keys is not None:
            raise ManifestError(f"{where}: a grid has key (relative to the writer's data directory) or keys, not both")
        if key is not None and (type(key) is not str or not _suffix_ok(key)):
            raise ManifestError(f"{where}: grid key {str(key)[:80]!r} is not a relative key under a data directory")
        if keys is not None:
            if type(keys) is not list or len(keys) != n:
                raise ManifestError(f"{where}: grid keys must list one key per cell ({n})")
            keys = [_check_key(k, where) for k in keys]
        packed = _packed(raw.get("packed"), n, keys is not None, where, version)
        n_packed = 0 if packed is None else n if packed.cells is None else len(packed.cells)
        if keys is None and key is None and n_packed < n:
            raise ManifestError(f"{where}: a grid with array cells needs key (or keys)")
        if key is not None and n_packed == n:
            raise ManifestError(f"{where}: every cell is packed; key names array cells")
        inner = _inner(raw.get("inner"), index, where)
        return cls(index, itemsize, dirs=dirs, rank_rule=rank_rule, rank_list=rank_list, key=key, keys=keys,
                   inner=inner, packed=packed)


def _ranks(ranks: Any, index: GridIndex, world_size: int, where: str) -> tuple[Any, Any]:
    """The `"ranks"` member: a rule (every cell's rank in range, by arithmetic) or a list."""
    if type(ranks) is dict:
        base, strides = ranks.get("base"), ranks.get("strides")
        if (
            set(ranks) != {"base", "strides"} or type(base) is not int or type(strides) is not list
            or len(strides) != len(index.axes)
            or not all(type(s) is int and abs(s) <= MAX_WORLD_SIZE for s in strides)
        ):
            raise ManifestError(f"{where}: grid ranks must be {{'base': int, 'strides': [int per dim]}}, got {ranks!r}"[:300])
        lo = base + sum(min(0, s * (c - 1)) for s, c in zip(strides, index.counts))
        hi = base + sum(max(0, s * (c - 1)) for s, c in zip(strides, index.counts))
        if lo < 0 or hi >= world_size:
            raise ManifestError(f"{where}: grid ranks run from {lo} to {hi}, outside [0, {world_size})")
        return (base, tuple(strides)), None
    if type(ranks) in (list, str):
        return None, _column(ranks, index.n, 0, world_size, "grid ranks", where, "<u4")
    raise ManifestError(f"{where}: grid lacks ranks (a rule {{'base', 'strides'}} or one rank per cell)")


def _packed(raw: Any, n: int, explicit_keys: bool, where: str, version: int) -> Packed | None:
    """The `"packed"` member (`crc32` required before version 6, whose cells' bytes carry it)."""
    if raw is None:
        return None
    need = {"byte_offset"} if version >= TRAILER_VERSION else {"byte_offset", "crc32"}
    if type(raw) is not dict or not need <= set(raw) <= {"cells", "key", "byte_offset", "crc32"}:
        crc = "'crc32'?" if version >= TRAILER_VERSION else "'crc32'"
        raise ManifestError(f"{where}: grid packed must be {{'cells'?, 'key'?, 'byte_offset', {crc}}}")
    cells = raw.get("cells")
    if cells is not None:
        if type(cells) is not list or not 0 < len(cells) <= n:
            raise ManifestError(f"{where}: grid packed cells must list between 1 and {n} cells")
        cells = _int_list(cells, len(cells), 0, n, "grid packed cells", where)
        if len(cells) > 1 and not bool((cells[1:] > cells[:-1]).all()):
            raise ManifestError(f"{where}: grid packed cells must be strictly increasing")
    m = n if cells is None else len(cells)
    key = raw.get("key")
    if explicit_keys != (key is None) or (key is not None and (type(key) is not str or not _suffix_ok(key))):
        raise ManifestError(
            f"{where}: grid packed key {str(key)[:80]!r}: a packed array's key relative to the writer's data "
            "directory is needed, unless the grid lists keys (then none is given)"
        )
    b = raw["byte_offset"]
    if type(b) is int:
        if not 0 <= b < MAX_TENSOR_BYTES:
            raise ManifestError(f"{where}: grid byte_offset {b} is out of range")
        bo: int | np.ndarray = b
    else:
        bo = _column(b, m, 0, MAX_TENSOR_BYTES, "grid byte_offset", where, "<u8")
    c = raw.get("crc32")
    return Packed(cells, key, bo, None if c is None else _column(c, m, 0, 1 << 32, "grid crc32", where, "<u4"))


def column_json(v: np.ndarray | Sequence[int], dtype: str) -> str:
    """A column of integers as JSON: the base64 of their little-endian bytes (`dtype`
    `"<u4"` or `"<u8"`; the values fit it, as `_column` checked or the writer made them)."""
    return base64.b64encode(np.asarray(v, dtype=dtype).tobytes()).decode("ascii")


def b64_len(count: int, size: int) -> int:
    """Characters of the padded base64 of `count` integers of `size` bytes each."""
    return 4 * -(-count * size // 3)


def _column(v: Any, n: int, lo: int, hi: int, what: str, where: str, dtype: str) -> np.ndarray:
    """A column (a list of `n` integers, or the base64 of `n` little-endian `dtype`
    integers) as int64, each in `[lo, hi)`; the string's length is checked before it is decoded."""
    if type(v) is not str:
        return _int_list(v, n, lo, hi, what, where)
    size = np.dtype(dtype).itemsize
    if len(v) != b64_len(n, size):
        raise ManifestError(
            f"{where}: {what} is a base64 column of {len(v)} characters; {n} little-endian {8 * size}-bit "
            f"integers take {b64_len(n, size)}"
        )
    try:
        raw = base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise ManifestError(f"{where}: {what} is not valid base64 (RFC 4648, padded)") from None
    if len(raw) != n * size:
        raise ManifestError(f"{where}: {what} decodes to {len(raw)} bytes, not {n * size}")
    col = np.frombuffer(raw, dtype)
    if n and (int(col.min()) < lo or int(col.max()) >= hi):
        raise ManifestError(f"{where}: {what} must lie in [{lo}, {hi})")
    return col.astype(np.int64)


def _int_list(v: Any, n: int, lo: int, hi: int, what: str, where: str) -> np.ndarray:
    if type(v) is not list or len(v) != n or (v and set(map(type, v)) != {int}):
        raise ManifestError(f"{where}: {what} must be a list of {n} integers (one per cell)")
    if n and (min(v) < lo or max(v) >= hi):
        raise ManifestError(f"{where}: {what} must lie in [{lo}, {hi})")
    return np.array(v, dtype=np.int64)


def _grid_index(splits: Any, shape: tuple[int, ...], where: str) -> GridIndex:
    """The grid's axes from `"splits"`; the cell count is checked as it is formed."""
    if type(splits) is not list or len(splits) != len(shape) or not shape:
        raise ManifestError(f"{where}: grid splits must give one entry per dimension of the shape {list(shape)}")
    axes, n = [], 1
    for d, (s, extent) in enumerate(zip(splits, shape)):
        if extent == 0:
            raise ManifestError(f"{where}: a tensor of shape {list(shape)} holds no cells; store it with no chunks")
        if type(s) is int:
            axis = GridAxis(extent, step=s)
            if not 0 < s <= extent:
                raise ManifestError(f"{where}: grid splits[{d}] step {s} must lie in [1, {extent}]")
        elif type(s) is list and 2 <= len(s) <= MAX_CHUNKS + 1 and set(map(type, s)) == {int}:
            axis = GridAxis(extent, points=tuple(s))
        else:
            raise ManifestError(f"{where}: grid splits[{d}] must be a step or a list of split points, got {str(s)[:80]}")
        n *= axis.count
        if n > MAX_CHUNKS:
            raise ManifestError(f"{where}: the grid claims more than {MAX_CHUNKS} cells, over the limit")
        try:
            axis.check(f"{where}: grid splits[{d}]")
        except LayoutError as e:
            raise ManifestError(str(e)) from None
        axes.append(axis)
    return GridIndex(axes)


def _inner(raw: Any, index: GridIndex, where: str) -> dict[tuple[int, ...], tuple[int, ...]] | None:
    """The `"inner"` map: distinct cell shapes (each a combination of per-dim cell sizes)
    and the zarr chunk shape of the array cells of that shape."""
    if raw is None:
        return None
    ndim = len(index.axes)
    if type(raw) is not list or len(raw) > MAX_GRID_SHAPES:
        raise ManifestError(f"{where}: grid inner must be a list of at most {MAX_GRID_SHAPES} [cell shape, grid] pairs")
    sizes = [a.sizes() for a in index.axes] if raw else []
    out: dict[tuple[int, ...], tuple[int, ...]] = {}
    for pair in raw:
        ok = type(pair) is list and len(pair) == 2 and all(
            type(p) is list and len(p) == ndim and all(type(x) is int and x >= 1 for x in p) for p in pair
        )
        if not ok or not all(x in s for x, s in zip(pair[0], sizes)) or tuple(pair[0]) in out:
            raise ManifestError(f"{where}: grid inner entry {str(pair)[:80]} is not [cell shape, grid] of a cell shape")
        out[tuple(pair[0])] = tuple(pair[1])
    return out


# ---------------------------------------------------------------------------
# Recognising a grid in chunk columns (a merge of rank manifests)


def _grid_order(
    shape: tuple[int, ...], offs: np.ndarray, shps: np.ndarray
) -> tuple[GridIndex, np.ndarray] | None:
    """The grid the boxes form (per-dimension splits) and the chunk of each cell, in cell
    order; None when they are no rectilinear grid tiling `shape`, cell by cell."""
    n, k = offs.shape
    axes, idx = [], []
    for d in range(k):
        o = offs[:, d]
        e = o + shps[:, d]
        if not o.any():  # a dimension no chunk splits (every offset 0)
            starts, inv = np.zeros(1, np.int64), np.zeros(n, np.int64)
        else:
            starts, inv = np.unique(o, return_inverse=True)
        ends = np.empty(len(starts), np.int64)
        ends[inv] = e
        if (
            starts[0] != 0 or ends[-1] != shape[d] or not (ends[inv] == e).all()
            or not (ends > starts).all() or not (ends[:-1] == starts[1:]).all()
        ):
            return None
        step = int(ends[0])
        if len(starts) == 1 or (0 < shape[d] - int(starts[-1]) <= step and (starts == np.arange(len(starts)) * step).all()):
            axes.append(GridAxis(shape[d], step=step))  # a regular split
        else:
            axes.append(GridAxis(shape[d], points=(*starts.tolist(), shape[d])))
        idx.append(inv.reshape(-1))
    index = GridIndex(axes)
    if index.n != n:
        return None
    cell = np.ravel_multi_index(tuple(idx), index.counts)
    if (cell == np.arange(n)).all():  # (chunks in cell order already: writers in rank order)
        return index, np.arange(n)
    order = np.argsort(cell, kind="stable")
    if not (cell[order] == np.arange(n)).all():
        return None  # a cell held twice (and so another missing)
    return index, order


def _rank_rule(index: GridIndex, ranks: np.ndarray) -> tuple[int, tuple[int, ...]] | None:
    """`(base, strides)` when cell `(i0, i1, ...)`'s writer is `base + i0 s0 + i1 s1 + ...`
    for every cell (ranks in cell order), else None (the grid lists them)."""
    n = len(ranks)
    base = int(ranks[0])
    strides = tuple(int(ranks[s] - base) if c > 1 else 0 for s, c in zip(index.strides, index.counts))
    pred = np.full(n, base, np.int64)
    ar = np.arange(n)
    for s, c, st in zip(index.strides, index.counts, strides):
        if st:
            pred += ((ar // s) % c) * st
    return (base, strides) if (pred == ranks).all() else None


def _row_keys(rows: np.ndarray) -> np.ndarray | None:
    """One int64 per row of non-negative `rows`, equal exactly for equal rows (mixed radix),
    or None when the radices overflow 2^62."""
    key = np.zeros(len(rows), np.int64)
    span = 1
    for col in rows.T:
        m = int(col.max()) + 1 if len(col) else 1
        span *= m
        if span >= 1 << 62:
            return None
        key = key * m + col
    return key


def _inner_grids(
    shapes: np.ndarray, ids: np.ndarray, table: Sequence[tuple[int, ...] | None]
) -> dict[tuple[int, ...], tuple[int, ...] | None] | None:
    """The zarr chunk shape of the array cells of each cell shape, or None when cells of one
    shape differ (or there are too many shapes to list)."""
    key = _row_keys(shapes)
    if key is None:
        groups, g = np.unique(shapes, axis=0, return_inverse=True)
    else:  # (one int64 per shape: a plain sort, where axis=0 sorts rows as bytes, 10x slower)
        _, at, g = np.unique(key, return_index=True, return_inverse=True)
        groups = shapes[at]
    g = g.reshape(-1)
    first = np.full(len(groups), -1, np.int64)
    first[g] = ids
    if not (first[g] == ids).all():
        return None  # cells of one shape with different inner grids
    inner = {tuple(sh): table[int(i)] for sh, i in zip(groups.tolist(), first.tolist()) if table[int(i)] is not None}
    return None if len(inner) > MAX_GRID_SHAPES else inner


def grid_from_columns(
    shape: tuple[int, ...],
    itemsize: int,
    offs: np.ndarray,
    shps: np.ndarray,
    ranks: np.ndarray,
    same_dir: np.ndarray,
    sfx_ids: np.ndarray,
    sfx_table: Sequence[str],
    inner_ids: np.ndarray,
    inner_table: Sequence[tuple[int, ...] | None],
    byte_offset: np.ndarray,
    crc32: np.ndarray | None,
    dirs: Mapping[int, str],
    full_keys: Callable[[], list[str]],
) -> GridChunks | None:
    """The chunks given as columns (one row per chunk) as a `GridChunks`, or None
    when they do not form a rectilinear grid covering `shape` exactly, cell by cell.

    `same_dir[i]`: chunk i's key lies in its writer's data directory (`dirs`) with
    suffix `sfx_table[sfx_ids[i]]`; `full_keys()` gives every key otherwise.
    `byte_offset` and `crc32` are -1 for array chunks; `crc32` None: the packed cells' crc32s
    are stored after their bytes (version 6) and the grid leaves them out. O(n log n), in numpy.
    """
    n, k = offs.shape
    if k == 0 or n < GRID_MIN_CELLS or n > MAX_CHUNKS:
        return None
    found = _grid_order(shape, offs, shps)
    if found is None:
        return None
    index, order = found
    ranks = ranks[order]
    rule = _rank_rule(index, ranks)
    bo = byte_offset[order]
    packed = bo >= 0
    arrays = ~packed
    sfx, same = sfx_ids[order], same_dir[order]
    key = pkey = None
    keys = None
    ok = bool(same.all())
    if ok and arrays.any():
        a_sfx = sfx[arrays]
        ok = bool((a_sfx == a_sfx[0]).all())
        key = sfx_table[int(a_sfx[0])] if ok else None
    if ok and packed.any():
        p_sfx = sfx[packed]
        ok = bool((p_sfx == p_sfx[0]).all())
        pkey = sfx_table[int(p_sfx[0])] if ok else None
    if not ok:
        key = pkey = None
        keys = [full_keys()[i] for i in order.tolist()]
    inner = None
    if arrays.any():
        inner = _inner_grids(shps[order][arrays], inner_ids[order][arrays], inner_table)
        if inner is None:
            return None
    pk = None
    if packed.any():
        b = bo[packed]
        pk = Packed(
            None if packed.all() else np.flatnonzero(packed).astype(np.int64),
            pkey,
            int(b[0]) if (b == b[0]).all() else b.copy(),
            None if crc32 is None else crc32[order][packed].copy(),
        )
    return GridChunks(
        index, itemsize, dirs=dirs, rank_rule=rule, rank_list=None if rule is not None else ranks.copy(),
        key=key, keys=keys, inner=inner,  # type: ignore[arg-type]
        packed=pk,
    )
