"""Rank manifests merged as they are parsed, their chunks kept as columns, grids recognised.

A rank-local checkpoint of W writers has W rank manifests, each listing only its own
boxes; a tensor split over all W writers has W chunks. Built as W `Chunk`
objects per tensor and checked box by box, 4,096 writers x 100 tensors cost seconds and
most of a gigabyte. `RankMerge` reads each rank's document (already checked by
`parse_header`) straight into per-tensor columns (offsets,
shapes, ranks and interned key parts in `array('q')`), with the checks of
`Chunk.from_json` done inline; an entry the columns cannot take as it is (a first
sighting, a grid, anything unusual) goes through [`TensorEntry.from_json`][xckpt.TensorEntry.from_json], whose
errors name the file and the field. At the end each tensor of at least
`GRID_MIN_CELLS` chunks that forms a grid becomes a
`GridChunks` (tiling checked arithmetically on the way);
the rest become chunk tuples, checked by the caller as before.
"""

from __future__ import annotations

import math
from array import array
from typing import Any

import numpy as np
import orjson

from xckpt.errors import ManifestError, XckptError
from xckpt.manifest._checks import (
    GRID_VERSION,
    MAX_EXTENT,
    MAX_KEY_LEN,
    MAX_NDIM,
    MAX_TENSOR_BYTES,
    TRAILER_VERSION,
    VERSION,
    ZEROS,
    _build,
    numpy_dtype,
)
from xckpt.manifest._chunks import Chunk, raw_chunk_fields
from xckpt.manifest._document import Header, Manifest, with_table
from xckpt.manifest._entries import ObjectEntry, TensorEntry
from xckpt.manifest._grids import GRID_MIN_CELLS, _column, grid_from_columns, split_key
from xckpt.manifest._rows import _tensor_entries
from xckpt.manifest._runs import Run
from xckpt.manifest._table import _MEMBER_SET as _TABLE
from xckpt.manifest._table import TableRun

__all__ = ["RankMerge"]

_Row = tuple[Any, Any, int, str, str, Any, int, int, Any]


#: An entry's members with nothing but chunks; an entry's members; a plain array chunk's and
#: a packed chunk's members (as the writer writes them).
_PLAIN = {"dtype", "shape", "chunks"}
_ENTRY = {"dtype", "shape", "chunks", "placement", "value_range"}
_ARRAY = {"offset", "shape", "key", "rank", "nbytes", "grid"}
_PACKED = {"offset", "shape", "key", "rank", "nbytes", "form", "byte_offset", "crc32"}
_INT = {int}


def _json(v: Any) -> bytes | None:
    try:
        return orjson.dumps(v)
    except (TypeError, orjson.JSONEncodeError):
        return None


def _raw(entry: Any, member: str) -> bytes | None:
    """An entry's raw `member` as JSON bytes (compared exactly: types, not values)."""
    v = entry.get(member) if type(entry) is dict else None
    return None if v is None else _json(v)


class _Table:
    """Interned values by id (key parts, inner grids): each distinct value stored once."""

    __slots__ = ("ids", "values")

    def __init__(self, first: Any = None) -> None:
        self.values: list[Any] = [first]
        self.ids: dict[Any, int] = {first: 0}

    def id(self, v: Any) -> int:
        i = self.ids.get(v)
        if i is None:
            i = self.ids[v] = len(self.values)
            self.values.append(v)
        return i


class _Tensor:
    """One tensor across rank manifests: its first entry, then (from a second rank's chunks
    on) its chunks as columns."""

    __slots__ = ("entry", "raw_shape", "raw_pl", "raw_vr", "itemsize", "n", "offs", "shps", "ranks",
                 "dirs", "sfx", "inner", "bo", "crc", "vrs", "last_sfx", "last_sfx_id", "last_grid", "epoch", "n0",
                 "last_grid_id")

    def __init__(self, e: TensorEntry, raw: Any) -> None:
        self.entry = e
        self.raw_shape = list(e.shape)
        self.raw_pl = _raw(raw, "placement")
        self.raw_vr = _raw(raw, "value_range")
        self.itemsize = numpy_dtype(e.dtype).itemsize
        self.n = -1  # columns not started
        # The last key suffix and raw inner grid seen, with their ids (the next chunk reuses them).
        self.last_sfx: str | None = None
        self.last_grid: Any = None
        self.last_sfx_id = self.last_grid_id = 0
        self.epoch, self.n0 = -1, -1  # the rank being merged when first touched, and n then

    def start(self, m: RankMerge) -> None:
        m.touch(self)
        self.n = 0
        self.offs, self.shps, self.ranks = array("q"), array("q"), array("q")
        self.dirs, self.sfx, self.inner = array("q"), array("q"), array("q")
        self.bo, self.crc = array("q"), array("q")  # byte offset and crc32 of packed chunks (else -1)
        self.vrs: dict[int, tuple[int, int]] = {}
        for c in self.entry.chunks:
            self.push_chunk(m, c)

    def push(self, m: RankMerge, row: _Row) -> None:
        m.touch(self)
        off, shp, rank, d, s, grid, bo, crc, vr = row
        self.offs.extend(off)
        self.shps.extend(shp)
        self.ranks.append(rank)
        self.dirs.append(m.dir_ids.id(d))
        self.sfx.append(m.sfx_ids.id(s))
        m.rank_dirs.setdefault(rank, d)
        self.inner.append(m.inner_ids.id(grid))
        self.bo.append(bo)
        self.crc.append(crc)
        if vr is not None:
            self.vrs[self.n] = vr
        self.n += 1

    def push_chunk(self, m: RankMerge, c: Chunk) -> None:
        parts = split_key(c.key)
        if parts is None:
            raise ManifestError(f"{m.where}: chunk key {c.key[:80]!r} is not under a data directory")
        packed = c.form == "packed"
        self.push(m, (c.offset, c.shape, c.rank, parts[0], parts[1], c.grid,
                      c.byte_offset if packed and c.byte_offset is not None else -1,
                      c.crc32 if packed and c.crc32 is not None else -1, c.value_range))

    def chunks(self, m: RankMerge) -> tuple[Chunk, ...]:
        """The columns as chunk objects (a tensor that is not a grid)."""
        e, nd, out = self.entry, len(self.entry.shape), []
        shape, zeros = e.shape, ZEROS[nd]
        offs, shps = self.offs, self.shps
        dirs, sfx, inner = m.dir_ids.values, m.sfx_ids.values, m.inner_ids.values
        for i in range(self.n):
            off, shp = tuple(offs[i * nd : i * nd + nd]), tuple(shps[i * nd : i * nd + nd])
            packed = self.bo[i] >= 0
            out.append(_build(Chunk, {
                "offset": zeros if off == zeros else off, "shape": shape if shp == shape else shp,
                "key": f"{dirs[self.dirs[i]]}/{sfx[self.sfx[i]]}", "rank": self.ranks[i],
                "nbytes": math.prod(shp) * self.itemsize, "form": "packed" if packed else "array",
                "byte_offset": self.bo[i] if packed else None, "crc32": self.crc[i] if packed else None,
                "grid": None if packed else inner[self.inner[i]], "value_range": self.vrs.get(i),
            }))
        return tuple(out)


class RankMerge:
    """Rank manifests 0..W-1 merged into one [`Manifest`][xckpt.manifest._merge.Manifest] as each is parsed.

    Call protocol: `add` once per rank, in rank order, with the rank's checked
    `Header` (of the save being read); then `result`.
    Tensors must agree on dtype and shape across ranks; the first placement and value range
    seen are kept; replicated objects must agree in value (they are then stored once).
    """

    def __init__(self, where: str, world_size: int) -> None:
        self.where, self.world = where, world_size
        self.tensors: dict[str, _Tensor] = {}
        self.objects: dict[tuple[str, int | None], ObjectEntry] = {}
        self.storage: dict[int, str] = {}
        self.metadata: dict[str, Any] = {}
        self.declared_dirs: dict[int, str] = {}
        self.codecs: dict[int, str] = {}
        self.refs: dict[str, Any] = {}
        self.hashes: dict[str, str] = {}
        self.deltas: dict[str, Any] = {}
        #: Each writer rank's data directory: the first its chunks' keys name.
        self.rank_dirs: dict[int, str] = {}
        self.dir_ids, self.sfx_ids, self.inner_ids = _Table(""), _Table(""), _Table(None)
        self.save_id = ""
        # The data directory of the chunk keys last seen (a rank manifest's chunks share one).
        self._dir, self._dir_id, self._dir_rank = "", 0, -1
        # This rank's merge so far, to undo it: its number, the tensors it touched and created,
        # and the integers whose checks wait for its end (offsets and shapes; zarr chunk shapes).
        self._epoch = 0
        self._touched: list[_Tensor] = []
        self._created: list[str] = []
        self._ints: list[Any] = []
        self._gints: list[Any] = []
        self._checked = False
        #: Ranks taken whole (`xckpt.manifest._runs`), not yet in the columns.
        self._run: Run | None = None
        #: Ranks whose chunk tables are held (`xckpt.manifest._table`), not yet in the columns.
        self._table_run: TableRun | None = None
        #: The lowest version merged: from version 6 on, packed chunks carry their crc32 in the data.
        self.min_version = VERSION

    # -- adding a rank -------------------------------------------------------------

    def add(self, h: Header, where: str) -> None:
        """Merge the manifest of rank `h.rank` (`where` names its file)."""
        self.save_id = self.save_id or h.save_id
        self.storage.update(h.storage)
        self.metadata.update(h.metadata)
        self.declared_dirs.update(h.dirs)
        self.codecs.update(h.codecs)
        self.refs.update(h.refs)
        self.hashes.update(h.hashes)
        self.deltas.update(h.deltas)
        dirs = h.dirs if h.version >= GRID_VERSION else None
        self.min_version = min(self.min_version, h.version)
        if h.table is not None:
            self._add_table(h, where, dirs)
            return self._objects(h, where)
        if self._table_run is not None and self._table_run.pending:
            self._flush_runs()
        if not self._take_run(h):
            self._flush_runs()  # (earlier ranks' chunks go first: chunks stay in rank order)
            self._entries(h, where, dirs)
        return self._objects(h, where)

    def _objects(self, h: Header, where: str) -> None:
        for o in h.objects:
            self._add_object(ObjectEntry.from_json(o, where))

    def _flush_runs(self) -> None:
        """Hand the ranks held by either kind of run to the columns."""
        if self._run is not None:
            self._run.flush()
        run = self._table_run
        if run is not None:
            for h, wh in run.flush(self.inner_ids):  # (ranks a bulk check refused: their fields named)
                self._entries(h._replace(tensors=with_table({}, h.table, wh, h.rank, h.dirs), table=None),
                              wh, h.dirs if h.version >= GRID_VERSION else None)

    def _add_table(self, h: Header, where: str, dirs: dict[int, str] | None) -> None:
        """A rank manifest with a chunk table: its table held by a `TableRun` when it lists
        the tensors of the run's ranks, else merged entry by entry; then its entries."""
        t = h.table
        if self._run is not None:
            self._run.flush()
        rank = h.rank
        if (rank is None or type(t) is not dict or t.keys() != _TABLE
                or (h.tensors and not h.tensors.keys().isdisjoint(t["names"]))):
            self._flush_runs()
            return self._entries(h._replace(tensors=with_table(h.tensors, t, where, h.rank, h.dirs), table=None),
                                 where, dirs)
        run = self._table_run
        try:
            fits = run is not None and run.fits(t)
        except (TypeError, ValueError):
            fits = False
        if run is None or not fits:
            self._flush_runs()
            run = self._table_run = self._start_table(h, where)
        if run is None:
            self._entries(h._replace(tensors=with_table({}, t, where, rank, h.dirs), table=None), where, dirs)
        else:
            d = h.dirs.get(rank, f"data/{rank}")
            self.rank_dirs.setdefault(rank, d)
            run.pending.append((h, where, rank, self.dir_ids.id(d)))
            if run.full():
                self._flush_runs()
        if h.tensors:  # (after the table, as a manifest's tensors are read)
            # (entries with no chunks, a rank's empty shards, add none: the held ranks may wait)
            if not all(type(e) is dict and e.get("chunks") == [] for e in h.tensors.values()):
                self._flush_runs()
            self._entries(h, where, dirs)

    def _start_table(self, h: Header, where: str) -> TableRun | None:
        """A run started by this rank's table, when every tensor it lists was seen before
        with its dtype and shape, and its keys are valid; else None."""
        t, rank = h.table, h.rank
        names, keys = t["names"], t["keys"]
        if rank is None or type(names) is not list or type(keys) is not list or not names or len(keys) != len(names):
            return None
        if set(map(type, names)) != {str} or set(map(type, keys)) != {str} or len(set(names)) != len(names):
            return None
        accs = [a for a in map(self.tensors.get, names) if a is not None]
        if len(accs) != len(names):
            return None
        d = h.dirs.get(rank, f"data/{rank}")
        if any(split_key(f"{d}/{k}") is None for k in keys):
            return None
        try:
            nds = _column(t["ndim"], len(accs), 0, MAX_NDIM + 1, "table ndim", where, "u1").tolist()
            shape = _column(t["shape"], sum(nds), 0, MAX_EXTENT + 1, "table shape", where, "<u8").tolist()
        except ManifestError:
            return None
        if t["dtypes"] != [a.entry.dtype for a in accs] or shape != [x for a in accs for x in a.raw_shape]:
            return None
        for a in accs:
            if a.n < 0:
                a.start(self)
        return TableRun(t, accs, nds, shape, [self.sfx_ids.id(k) for k in keys])

    def _take_run(self, h: Header) -> bool:
        """The rank's entries taken whole by a `Run`, when it
        lists the tensors of the ranks before it, in their order, each one plain chunk."""
        names = tuple(h.tensors)
        run = self._run
        if run is None or run.names != names:
            self._flush_runs()
            accs = [self.tensors.get(n) for n in names]
            if not names or any(a is None or a.n < 0 for a in accs):
                self._run = None
                return False
            run = self._run = Run(names, accs)
        try:
            return run.take(h.tensors, self.world, (self.dir_ids, self.sfx_ids, self.inner_ids), self.rank_dirs)
        except (TypeError, ValueError, OverflowError, KeyError, AttributeError):
            return False  # (a shape of JSON no check foresaw: the chunk-at-a-time path names it)

    def touch(self, acc: _Tensor) -> None:
        """Record `acc` as changed by this rank (once), with its chunk count before."""
        if acc.epoch != self._epoch:
            acc.epoch, acc.n0 = self._epoch, acc.n
            self._touched.append(acc)

    def _entries(self, h: Header, where: str, dirs: dict[int, str] | None) -> None:
        """The rank's entries one by one: straight into the columns where they allow it,
        else through [`TensorEntry.from_json`][xckpt.TensorEntry.from_json] (whose errors name the field).

        The integer checks of the fast path wait for the rank's end, made over all of its
        integers at once (`set(map(type, ...))`, `min`, `max`); when they fail, the
        rank's merge is undone and redone the checked way, which names the bad field."""
        self._epoch += 1
        self._touched, self._created, self._ints, self._gints = [], [], [], []
        try:
            self._merge_entries(h, where, dirs)
            ints, gints = self._ints, self._gints
            ok = not (ints and (set(map(type, ints)) != _INT or min(ints) < 0 or max(ints) > MAX_EXTENT)) and not (
                gints and (set(map(type, gints)) != _INT or min(gints) < 1 or max(gints) > MAX_EXTENT)
            )
        except XckptError:
            raise
        except (TypeError, ValueError, OverflowError, KeyError, AttributeError):
            ok = False  # (a shape of JSON the fast path did not foresee: the checked way names it)
        if not ok:
            self._undo()
            self._checked = True
            try:
                self._merge_entries(h, where, dirs)
            finally:
                self._checked = False

    def _undo(self) -> None:
        """Take this rank's chunks out of the columns again."""
        for name in self._created:
            del self.tensors[name]
        for acc in self._touched:
            if acc.n0 < 0:
                acc.n = -1  # columns not started: the first entry holds the chunks
                continue
            nd = len(acc.raw_shape)
            for col in (acc.offs, acc.shps):
                del col[acc.n0 * nd :]
            for col in (acc.ranks, acc.dirs, acc.sfx, acc.inner, acc.bo, acc.crc):
                del col[acc.n0 :]
            for i in [i for i in acc.vrs if i >= acc.n0]:
                del acc.vrs[i]
            acc.n = acc.n0
            acc.last_sfx = acc.last_grid = None
            acc.last_sfx_id = acc.last_grid_id = 0
        self._dir, self._dir_id, self._dir_rank = "", 0, -1

    def _merge_entries(self, h: Header, where: str, dirs: dict[int, str] | None) -> None:
        for name, t in h.tensors.items():
            acc = self.tensors.get(name)
            if acc is not None and type(t) is dict and not self._checked and self._fast(acc, t):
                continue
            if type(t) is list:
                e = _tensor_entries({name: t}, h.packed, where, self.world)[name]
            else:
                e = TensorEntry.from_json(name, t, where, self.world, dirs, h.version)
            self._add_entry(acc, e, t, h.rank)

    def _fast(self, acc: _Tensor, t: dict[str, Any]) -> bool:
        """Add entry `t` of a tensor seen before straight into its columns; False (nothing
        added) when any check fails or the entry is not a plain chunk list."""
        keys = t.keys()
        if keys == _PLAIN:  # dtype, shape, chunks: nothing else to compare
            pl = vr = None
        elif keys <= _ENTRY and "chunks" in t:
            pl, vr = t.get("placement"), t.get("value_range")
        else:
            return False
        shape = t["shape"]
        if t["dtype"] != acc.entry.dtype or shape != acc.raw_shape:
            return False
        self._ints.extend(shape)  # (equal as numbers is not enough: 40.0 == 40; checked at the rank's end)
        # A placement or value range is checked once; another rank's equal one (as JSON) is not
        # checked again, any other one goes the checked way.
        if (pl is not None and (acc.raw_pl is None or _json(pl) != acc.raw_pl)) or (
            vr is not None and (acc.raw_vr is None or _json(vr) != acc.raw_vr)
        ):
            return False
        raw = t["chunks"]
        if type(raw) is not list:
            return False
        if len(raw) == 1 and acc.n >= 0 and type(raw[0]) is dict:
            return self._push_one(acc, raw[0])
        rows = []
        for c in raw:
            row = self._row(c, len(acc.raw_shape), acc.itemsize)
            if row is None:
                return False
            rows.append(row)
        if acc.n < 0:
            acc.start(self)
        for row in rows:
            acc.push(self, row)
        return True

    def _push_one(self, acc: _Tensor, c: dict[str, Any]) -> bool:
        """`_row` and `_Tensor.push` in one for a plain array or packed chunk
        (exactly the members the writer writes): the checks of `Chunk.from_json`
        inline, interned parts reused from this tensor's previous chunk. Anything else
        takes the general path."""
        keys = c.keys()
        if keys == _ARRAY:
            packed = False
        elif keys == _PACKED and c["form"] == "packed":
            packed = True
        else:
            return False
        off, shp, rank, nbytes, key = c["offset"], c["shape"], c["rank"], c["nbytes"], c["key"]
        nd = len(acc.raw_shape)
        if (
            type(off) is not list or type(shp) is not list or len(off) != nd or len(shp) != nd
            or type(rank) is not int or not 0 <= rank < self.world or type(nbytes) is not int
            or type(key) is not str or len(key) > MAX_KEY_LEN
        ):
            return False
        if nbytes != math.prod(shp) * acc.itemsize:
            return False
        i = key.find("/", 5)
        if i < 0:
            return False
        d, sfx = key[:i], key[i + 1 :]
        if d != self._dir:  # a rank's chunks share its directory: checked once per rank
            if split_key(key) is None:
                return False
            self._dir, self._dir_id = d, self.dir_ids.id(d)
            self.rank_dirs.setdefault(rank, d)
            self._dir_rank = rank
        elif rank != self._dir_rank:
            return False
        if sfx != acc.last_sfx:
            if split_key(key) is None:
                return False
            acc.last_sfx, acc.last_sfx_id = sfx, self.sfx_ids.id(sfx)
        if packed:
            bo, crc, gid = c["byte_offset"], c["crc32"], 0
            if type(bo) is not int or not 0 <= bo < MAX_TENSOR_BYTES or type(crc) is not int or not 0 <= crc < 1 << 32:
                return False
        else:
            bo = crc = -1
            g = c["grid"]
            if g is not None:
                if type(g) is not list or len(g) != nd:
                    return False
                self._gints.extend(g)
            if g != acc.last_grid:
                acc.last_grid, acc.last_grid_id = g, self.inner_ids.id(None if g is None else tuple(g))
            gid = acc.last_grid_id
        if acc.epoch != self._epoch:
            self.touch(acc)
        ints = self._ints
        ints.extend(off)
        ints.extend(shp)
        try:
            acc.offs.extend(off)
            acc.shps.extend(shp)
        except (TypeError, OverflowError):  # not integers: the rank's end check undoes it all
            acc.offs.extend([0] * nd)
            acc.shps.extend([0] * nd)
        acc.ranks.append(rank)
        acc.dirs.append(self._dir_id)
        acc.sfx.append(acc.last_sfx_id)
        acc.inner.append(gid)
        acc.bo.append(bo)
        acc.crc.append(crc)
        acc.n += 1
        return True

    def _row(self, c: Any, nd: int, itemsize: int) -> _Row | None:
        """A chunk's fields when it passes every check of `Chunk.from_json`, else None."""
        fields = raw_chunk_fields(c, nd, itemsize, self.world)
        if fields is None:
            return None
        off, shp, rank, _nbytes, form, grid, bo, crc, vr = fields
        parts = split_key(c.get("key"))
        if parts is None:
            return None
        # an array chunk's byte offset and crc32 are -1 in the columns
        return off, shp, rank, parts[0], parts[1], grid, -1 if bo is None else bo, -1 if crc is None else crc, vr

    def _add_entry(self, acc: _Tensor | None, e: TensorEntry, raw: Any, rank: int | None) -> None:
        if acc is None:
            self.tensors[e.name] = _Tensor(e, raw)
            self._created.append(e.name)
            return
        prev = acc.entry
        if prev.dtype != e.dtype or prev.shape != e.shape:
            raise ManifestError(
                f"{self.where}: tensor {e.name!r} is {prev.dtype}{list(prev.shape)} on one rank and "
                f"{e.dtype}{list(e.shape)} on rank {rank}; every rank must save the same global tensor"
            )
        if prev.placement is None and e.placement is not None:
            acc.entry = _build(TensorEntry, {**prev.__dict__, "placement": e.placement})
            acc.raw_pl = _raw(raw, "placement")
        if acc.entry.value_range is None and e.value_range is not None:
            acc.entry = _build(TensorEntry, {**acc.entry.__dict__, "value_range": e.value_range})
            acc.raw_vr = _raw(raw, "value_range")
        if acc.n < 0:
            acc.start(self)
        for c in e.chunks:
            acc.push_chunk(self, c)

    def _add_object(self, o: ObjectEntry) -> None:
        k = (o.name, o.rank if o.per_rank else None)
        prev = self.objects.get(k)
        if prev is None:
            self.objects[k] = o
        elif o.kind == "json" and prev.kind == "json" and o.value != prev.value:
            raise ManifestError(
                f"{self.where}: replicated object {o.name!r} differs between rank {prev.rank} "
                f"and rank {o.rank}; save it with per_rank=True if each rank has its own value"
            )

    # -- the result ----------------------------------------------------------------

    def result(self) -> Manifest:
        """The merged manifest (`rank` None). Tensors that form grids are
        `GridChunks`; the others' coverage is the caller's to check."""
        self._flush_runs()
        dirs = dict(self.declared_dirs)
        for r, d in self.rank_dirs.items():  # where the keys are, whatever a document declared
            if d != f"data/{r}":
                dirs[r] = d
            else:
                dirs.pop(r, None)
        # Each writer's data directory (the first its keys named) by id, for every tensor's check.
        rank_dir = np.full(self.world, -1, np.int64)
        for r, d in self.rank_dirs.items():
            rank_dir[r] = self.dir_ids.ids[d]
        tensors: dict[str, TensorEntry] = {}
        for name, acc in self.tensors.items():
            e = acc.entry
            if acc.n < 0:
                tensors[name] = e
                continue
            chunks = self._grid(acc, dirs, rank_dir) if acc.n >= GRID_MIN_CELLS and not acc.vrs else None
            tensors[name] = _build(TensorEntry, {**e.__dict__, "chunks": chunks if chunks is not None else acc.chunks(self)})
        return Manifest(
            save_id=self.save_id,
            world_size=self.world,
            rank=None,
            tensors=tensors,
            objects=tuple(self.objects.values()),
            storage=self.storage,
            metadata=self.metadata,
            dirs=dirs,
            codecs=self.codecs,
            refs=self.refs,
            hashes=self.hashes,
            deltas=self.deltas,
        )

    def _grid(self, acc: _Tensor, dirs: dict[int, str], rank_dir: np.ndarray) -> Any:
        n, nd = acc.n, len(acc.entry.shape)
        ranks = np.frombuffer(acc.ranks, np.int64)
        same = rank_dir[ranks] == np.frombuffer(acc.dirs, np.int64)  # each key in its writer's directory?
        bo = np.frombuffer(acc.bo, np.int64)
        # Version 6 data holds each packed chunk's crc32 after its bytes: the grid leaves them
        # out (4,096 writers x 100 tensors of 256-byte cells: 2.2 MB of a 2.3 MB xckpt.json).
        crc = None if self.min_version >= TRAILER_VERSION else np.frombuffer(acc.crc, np.int64)

        def full_keys() -> list[str]:
            d, s = self.dir_ids.values, self.sfx_ids.values
            return [f"{d[i]}/{s[j]}" for i, j in zip(acc.dirs, acc.sfx)]

        return grid_from_columns(
            acc.entry.shape, acc.itemsize,
            np.frombuffer(acc.offs, np.int64).reshape(n, nd), np.frombuffer(acc.shps, np.int64).reshape(n, nd),
            ranks, same, np.frombuffer(acc.sfx, np.int64), self.sfx_ids.values,
            np.frombuffer(acc.inner, np.int64), self.inner_ids.values, bo, crc, dirs, full_keys,
        )
