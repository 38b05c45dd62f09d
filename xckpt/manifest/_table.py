"""A rank manifest's chunk table (format version 6): its single-chunk tensors as columns.

A rank of a save split over W writers lists one box per tensor. As JSON objects (an entry
with a chunk object each), 4,096 writers x 100 tensors are 409,600 dicts to parse and
check when a reader merges the rank manifests. A rank manifest of a save of more than one
rank therefore lists such tensors in its `"table"` member instead, one column per field
(names, dtypes and key suffixes as lists of strings; the integers as base64 of
little-endian binary, as grids store theirs), so parsing a rank makes a handful of Python
objects and the merge concatenates numpy arrays over many ranks at once (`TableRun`).

`table_json` writes the member, `expand_table` turns it back into entry JSON (every
column's length checked before it is decoded, so each entry then takes the checks of
`TensorEntry.from_json`), and `TableRun` merges consecutive ranks whose tables list the
same tensors in bulk, handing any rank whose columns fail a bulk check back to the
entry-by-entry path, whose errors name the field.
"""

from __future__ import annotations

import binascii
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from xckpt.errors import ManifestError
from xckpt.manifest._checks import (
    DTYPES,
    MAX_CHUNKS,
    MAX_EXTENT,
    MAX_NAME_LEN,
    MAX_NDIM,
    MAX_TENSOR_BYTES,
    itemsize_of,
)
from xckpt.manifest._entries import TensorEntry
from xckpt.manifest._grids import _column, b64_len, column_json

__all__ = ["TableRun", "expand_table", "table_json"]

#: A table's byte offset of an array chunk (it has none): 2^64 - 1, -1 once read as int64.
NO_OFFSET = (1 << 64) - 1
#: The table's members; ranks held before they go to the columns.
_MEMBERS = ("names", "dtypes", "keys", "ndim", "shape", "offset", "extent", "grid", "byte_offset", "crc32")
_ROWS = 128


def table_json(tensors: Mapping[str, TensorEntry], rank: int, data_dir: str) -> tuple[dict[str, Any] | None, set[str]]:
    """The `"table"` member of rank `rank`'s manifest and the names it lists: the tensors
    from the first on while each has one chunk, written by this rank under `data_dir`, with
    no placement or value range (array chunks with their inner grid, packed chunks with
    byte offset and crc32), and is not a whole tensor packed (a packed row). A reader
    lists the table's tensors first, so the writer's order is kept."""
    names: list[str] = []
    dtypes: list[str] = []
    keys: list[str] = []
    ndim: list[int] = []
    shape: list[int] = []
    off: list[int] = []
    ext: list[int] = []
    grid: list[int] = []
    bo: list[int] = []
    crc: list[int] = []
    cut = len(data_dir) + 1
    for n, t in tensors.items():
        if t.placement is not None or t.value_range is not None or len(t.chunks) != 1:
            break
        c = t.chunks[0]
        if c.rank != rank or c.value_range is not None or not c.key.startswith(data_dir + "/"):
            break
        if c.form == "packed":
            if c.byte_offset is None or c.crc32 is None or (c.shape == t.shape and not any(c.offset)):
                break  # (a whole tensor packed is a packed row, as compact)
            g, b, k = (0,) * len(c.shape), c.byte_offset, c.crc32
        else:
            if c.grid is None:
                break
            g, b, k = c.grid, NO_OFFSET, 0
        names.append(n)
        dtypes.append(t.dtype)
        keys.append(c.key[cut:])
        ndim.append(len(t.shape))
        shape += t.shape
        off += c.offset
        ext += c.shape
        grid += g
        bo.append(b)
        crc.append(k)
    if not names:
        return None, set()
    table = {"names": names, "dtypes": dtypes, "keys": keys, "ndim": column_json(ndim, "u1")}
    for m, v, dt in (("shape", shape, "<u8"), ("offset", off, "<u8"), ("extent", ext, "<u8"), ("grid", grid, "<u8"),
                     ("byte_offset", bo, "<u8"), ("crc32", crc, "<u4")):
        table[m] = column_json(v, dt)
    return table, set(names)


def _strings(v: Any, n: int | None, what: str, where: str, limit: int) -> list[str]:
    if type(v) is not list or (n is not None and len(v) != n) or len(v) > MAX_CHUNKS:
        raise ManifestError(f"{where}: the table's {what} must be a list of {n if n is not None else 'its'} strings")
    if v and (set(map(type, v)) != {str} or max(map(len, v)) > limit):
        raise ManifestError(f"{where}: the table's {what} must be strings of at most {limit} characters")
    return v


def expand_table(raw: Any, where: str, rank: int | None, data_dir: str) -> dict[str, Any]:
    """The table's tensors as entry JSON (`{"dtype", "shape", "chunks": [chunk]}`), in its
    order; each column's length and range checked before anything is sized from it."""
    if rank is None:
        raise ManifestError(f"{where}: a merged manifest (rank null) has no table; the file was edited")
    if type(raw) is not dict or set(raw) != set(_MEMBERS):
        raise ManifestError(f"{where}: the table must be an object with exactly the members {', '.join(_MEMBERS)}")
    names = _strings(raw["names"], None, "names", where, MAX_NAME_LEN)
    n = len(names)
    dtypes = _strings(raw["dtypes"], n, "dtypes", where, 32)
    keys = _strings(raw["keys"], n, "keys", where, 1024)
    if len(set(names)) != n:
        raise ManifestError(f"{where}: the table lists a tensor twice")
    nds = _column(raw["ndim"], n, 0, MAX_NDIM + 1, "table ndim", where, "u1").tolist()
    d = sum(nds)
    shape, off, ext, grid = (_column(raw[m], d, 0, MAX_EXTENT + 1, f"table {m}", where, "<u8").tolist()
                             for m in ("shape", "offset", "extent", "grid"))
    bos = _column(raw["byte_offset"], n, 0, 1 << 64, "table byte_offset", where, "<u8").tolist()
    crcs = _column(raw["crc32"], n, 0, 1 << 32, "table crc32", where, "<u4").tolist()
    out: dict[str, Any] = {}
    p = 0
    for name, dtype, key, nd, bo, crc in zip(names, dtypes, keys, nds, bos, crcs):
        w = f"{where}, tensor {name!r} (table)"
        if dtype not in DTYPES:
            raise ManifestError(f"{w}: unknown dtype {dtype!r}"[:300])
        q = p + nd
        e = ext[p:q]
        nbytes = math.prod(e) * (itemsize_of(dtype) or 0)
        if nbytes >= MAX_TENSOR_BYTES:
            raise ManifestError(f"{w}: extent {e} claims {nbytes} bytes, over the limit of {MAX_TENSOR_BYTES}")
        c: dict[str, Any] = {"offset": off[p:q], "shape": e, "key": f"{data_dir}/{key}", "rank": rank, "nbytes": nbytes}
        if bo == -1:  # an array chunk
            if crc:
                raise ManifestError(f"{w}: an array chunk's crc32 in the table must be 0")
            c["grid"] = grid[p:q]
        else:
            if any(grid[p:q]) or bo >= MAX_TENSOR_BYTES:
                raise ManifestError(f"{w}: a packed chunk's grid must be 0s and its byte_offset below {MAX_TENSOR_BYTES}")
            c.update(form="packed", byte_offset=bo, crc32=crc)
        out[name] = {"dtype": dtype, "shape": shape[p:q], "chunks": [c]}
        p = q
    return out


_MEMBER_SET = set(_MEMBERS)


class TableRun:
    """Consecutive ranks whose tables list the same tensors (names, dtypes, key suffixes,
    dimensions and shapes, compared as the strings they are), held until `flush` hands
    their columns to the tensors' columns in bulk.

    `table`: the first rank's raw table; `accs`: the tensors' column holders
    (`xckpt.manifest._merge._Tensor`, columns started), in the table's order; `nds`,
    `shape`: their dimensions and flattened global shapes; `sfx`: their key suffixes' ids."""

    def __init__(self, table: dict[str, Any], accs: list[Any], nds: list[int], shape: list[int], sfx: list[int]) -> None:
        self.table, self.accs, self.nds, self.sfx = table, accs, nds, sfx
        self.shape = np.array(shape, np.int64)
        self.stops = np.cumsum([0, *nds]).tolist()
        #: The ranks held: (header, its file, rank, its data directory's id).
        self.pending: list[tuple[Any, str, int, int]] = []

    def fits(self, t: dict[str, Any]) -> bool:
        f = self.table
        return (t["names"] == f["names"] and t["dtypes"] == f["dtypes"] and t["keys"] == f["keys"]
                and t["ndim"] == f["ndim"] and t["shape"] == f["shape"])

    def full(self) -> bool:
        return len(self.pending) >= _ROWS

    def flush(self, inner: Any) -> list[tuple[Any, str]]:
        """Hand the held ranks to the columns (in rank order); the ranks (header, file) to be
        merged entry by entry instead when any bulk check fails (then none is taken).
        `inner`: the interning table of inner grids (`id(value) -> int`)."""
        pend, self.pending = self.pending, []
        if not pend:
            return []
        try:
            cols = self._columns(pend)
        except (ValueError, TypeError, binascii.Error):
            cols = None
        if cols is None:
            return [(p[0], p[1]) for p in pend]
        off, ext, grid, bo, crc, packed = cols
        ranks, dirs = [p[2] for p in pend], [p[3] for p in pend]
        if len(pend) == 1:
            self._push_one(off[0].tolist(), ext[0].tolist(), grid[0].tolist(), bo[0].tolist(), crc[0].tolist(),
                           ranks[0], dirs[0], inner)
            return []
        r = len(pend)
        rank_b, dir_b = np.array(ranks, np.int64).tobytes(), np.array(dirs, np.int64).tobytes()
        ids = _inner_ids(grid, packed, self.stops, inner).T.copy()
        sfx, bo_t, crc_t = np.repeat(np.array(self.sfx, np.int64)[:, None], r, 1), bo.T.copy(), crc.T.copy()
        for j, acc in enumerate(self.accs):
            s, e = self.stops[j], self.stops[j + 1]
            acc.offs.frombytes(off[:, s:e].tobytes())
            acc.shps.frombytes(ext[:, s:e].tobytes())
            acc.ranks.frombytes(rank_b)
            acc.dirs.frombytes(dir_b)
            acc.sfx.frombytes(sfx[j].tobytes())
            acc.inner.frombytes(ids[j].tobytes())
            acc.bo.frombytes(bo_t[j].tobytes())
            acc.crc.frombytes(crc_t[j].tobytes())
            acc.n += r
        return []

    def _push_one(self, off: list[int], ext: list[int], grid: list[int], bo: list[int], crc: list[int],
                  rank: int, d: int, inner: Any) -> None:
        """One held rank's chunks into the columns (quicker in Python than numpy per tensor)."""
        none = inner.id(None)
        for j, acc in enumerate(self.accs):
            s, e = self.stops[j], self.stops[j + 1]
            acc.offs.extend(off[s:e])
            acc.shps.extend(ext[s:e])
            acc.ranks.append(rank)
            acc.dirs.append(d)
            acc.sfx.append(self.sfx[j])
            acc.inner.append(none if bo[j] != -1 else inner.id(tuple(grid[s:e])))
            acc.bo.append(bo[j])
            acc.crc.append(crc[j])
            acc.n += 1

    def _columns(self, pend: list[tuple[Any, str, int, int]]) -> tuple[np.ndarray, ...] | None:
        """The held ranks' integer columns, each `(ranks, values)` int64, checked in bulk
        (the checks of `expand_table` and `TensorEntry.from_json`, and each box inside its
        tensor); None when any fails."""
        r, n, d = len(pend), len(self.nds), int(self.stops[-1])

        def col(m: str, count: int, size: int) -> np.ndarray:
            s = [p[0].table[m] for p in pend]
            if set(map(type, s)) != {str} or set(map(len, s)) != {b64_len(count, size)}:
                raise ValueError(m)
            raw = b"".join([binascii.a2b_base64(x, strict_mode=True) for x in s])
            if len(raw) != r * count * size:
                raise ValueError(m)
            return np.frombuffer(raw, "<u8" if size == 8 else "<u4").reshape(r, count)

        off, ext, grid = col("offset", d, 8), col("extent", d, 8), col("grid", d, 8)
        bo, crc = col("byte_offset", n, 8).view(np.int64), col("crc32", n, 4).astype(np.int64)
        if d and max(int(off.max()), int(ext.max()), int(grid.max())) > MAX_EXTENT:
            return None
        off, ext, grid = off.view(np.int64), ext.view(np.int64), grid.view(np.int64)
        if d and not (off + ext <= self.shape).all():
            return None
        packed = bo != -1  # (an array chunk's byte offset, 2^64 - 1, is -1 as int64)
        if n and (int(bo.min()) < -1 or int(bo.max()) >= MAX_TENSOR_BYTES or (crc[~packed] != 0).any()):
            return None
        per_dim = np.repeat(packed, self.nds, axis=1)
        if d and ((grid[per_dim] != 0).any() or (grid[~per_dim] < 1).any()):
            return None
        crc[~packed] = -1
        return off, ext, grid, bo, crc, packed


def _inner_ids(grid: np.ndarray, packed: np.ndarray, stops: list[int], inner: Any) -> np.ndarray:
    """Each chunk's inner grid id (a packed chunk's: None's), `(ranks, tensors)`: one
    lookup per tensor whose rows are alike, one per row of the others."""
    r, n = packed.shape
    same_dim = (grid == grid[:1]).all(axis=0)
    same = [bool(same_dim[s:e].all()) for s, e in zip(stops[:-1], stops[1:])]
    any_p: list[bool] = np.any(packed, axis=0).tolist()
    all_p: list[bool] = np.all(packed, axis=0).tolist()
    first = grid[0].tolist()
    row = [inner.id(None) if all_p[j] else inner.id(tuple(first[stops[j]:stops[j + 1]])) if same[j] and not any_p[j]
           else -1 for j in range(n)]
    out = np.repeat(np.array(row, np.int64)[None, :], r, 0)
    for j in [j for j in range(n) if row[j] == -1]:
        g, p = grid[:, stops[j]:stops[j + 1]].tolist(), packed[:, j].tolist()
        out[:, j] = [inner.id(None if pk else tuple(gr)) for pk, gr in zip(p, g)]
    return out
