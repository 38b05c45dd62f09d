"""`plan_load`: what a load would read, per rank or JAX device, before anything is read.

A dry run on any format the library reads. From the source's metadata and the
target layout alone (no chunk is read, no target buffer allocated) it computes,
for every rank (flattened mesh coordinate) or JAX device, the storage reads a
real load makes: which stored pieces its boxes touch, how many bytes that is,
and how that compares with what the rank keeps.

The unit of a read is the format's own ([`xckpt.source.Source.read_units`][xckpt.source.Source.read_units]):
an inner zarr chunk of an xckpt array chunk, a packed chunk, a byte range of a
safetensors or DCP chunk. A unit one rank needs for several boxes is counted
once, as a load reads it once. `peak_host_bytes` is the host memory the load
allocates for the rank: its distinct boxes (torch and numpy targets are filled in
place, so for them it is the targets' own memory; JAX reads into host buffers in
batches of at most `host_budget` bytes before building device arrays).
"""

from __future__ import annotations

import html
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from xckpt.formats import opened
from xckpt.inspect import human_bytes, plot_plan, plural
from xckpt.layout import Box, BoxIndex, ChunkIndex, MeshBoxes
from xckpt.manifest import Chunk, paused_gc
from xckpt.source import Source, UnitColumns
from xckpt.targets import target_boxes

__all__ = ["RankPlan", "LoadPlan", "plan_load"]

#: JAX host bytes per read batch (xckpt.jax.load's default `host_budget`).
JAX_HOST_BUDGET = 2 << 30


@dataclass(frozen=True)
class RankPlan:
    """What one rank (or JAX device) would read.

    Attributes:
        rank: the flattened mesh coordinate, or the JAX device id.
        bytes_to_read: stored bytes the rank's reads fetch.
        reads: storage reads (distinct read units).
        bytes_kept: bytes of the boxes the rank holds after the load.
        over_read: `bytes_to_read / bytes_kept` (1.0 when both are 0).
        peak_host_bytes: host memory the load allocates for the rank.
    """

    rank: int
    bytes_to_read: int
    reads: int
    bytes_kept: int
    over_read: float
    peak_host_bytes: int


@dataclass(frozen=True)
class LoadPlan:
    """The per-rank plan of a load; `ranks` is ordered by rank.

    Attributes:
        path: the checkpoint.
        format: its format.
        target: "torch" (ranks of a mesh) or "jax" (devices).
        ranks: one [`RankPlan`][xckpt.plan.RankPlan] per rank or device.
        tensors: the tensors the plan covers.
        skipped: saved tensors the target does not ask for (not read).
        stored_bytes: bytes of the covered tensors in the checkpoint.
    """

    path: str
    format: str
    target: str
    ranks: tuple[RankPlan, ...]
    tensors: tuple[str, ...]
    skipped: tuple[str, ...]
    stored_bytes: int

    @property
    def total_bytes_to_read(self) -> int:
        return sum(r.bytes_to_read for r in self.ranks)

    @property
    def max_rank(self) -> RankPlan:
        """The rank that reads the most."""
        return max(self.ranks, key=lambda r: (r.bytes_to_read, -r.rank))

    @property
    def over_read(self) -> float:
        kept = sum(r.bytes_kept for r in self.ranks)
        return self.total_bytes_to_read / kept if kept else 1.0

    def summary(self) -> str:
        """One line: total, the busiest rank, over-read."""
        m = self.max_rank if self.ranks else None
        who = "device" if self.target == "jax" else "rank"
        busiest = f"; max {who} {m.rank} reads {human_bytes(m.bytes_to_read)}" if m else ""
        return (
            f"{plural(len(self.ranks), 'device' if self.target == 'jax' else 'rank')} read "
            f"{human_bytes(self.total_bytes_to_read)} of {human_bytes(self.stored_bytes)} stored "
            f"({plural(len(self.tensors), 'tensor')}){busiest}; over-read {self.over_read:.2f}x"
        )

    def table(self) -> str:
        """A per-rank text table and the summary line."""
        head = ("device" if self.target == "jax" else "rank", "bytes to read", "reads", "kept", "over-read", "peak host")
        rows = [head] + [
            (
                str(r.rank),
                human_bytes(r.bytes_to_read),
                str(r.reads),
                human_bytes(r.bytes_kept),
                f"{r.over_read:.2f}x",
                human_bytes(r.peak_host_bytes),
            )
            for r in self.ranks
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
        return "\n".join(lines + ["", self.summary()])

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "target": self.target,
            "tensors": len(self.tensors),
            "skipped": list(self.skipped),
            "stored_bytes": self.stored_bytes,
            "total_bytes_to_read": self.total_bytes_to_read,
            "over_read": self.over_read,
            "ranks": [r.__dict__ for r in self.ranks],
        }

    def __str__(self) -> str:
        return self.table()

    def plot(self, ax: Any = None) -> Any:
        """Bytes per rank as bars, with what each keeps and the even share (matplotlib Axes)."""
        return plot_plan(self, ax)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self.table(), "text/html": f"<pre>{html.escape(self.table())}</pre>"}


def plan_load(
    path: Any,
    target: Any,
    *,
    format: str | None = None,  # noqa: A002
    rules: Any = None,
    host_budget: int = JAX_HOST_BUDGET,
) -> LoadPlan:
    """Dry-run a load of `path` into `target`: per rank or device, what it would read.

    Args:
        path: a checkpoint of any format (or an open [`Source`][xckpt.source.Source]).
        target: either a dict from tensor names or glob patterns to
            `(mesh_shape, placements)` (placements as `xckpt.layout`
            descriptors or a string like `"Shard(0), Replicate()"`; a shard of a dim
            the tensor lacks replicates it), planned per rank (flattened mesh
            coordinate); or a JAX pytree / flat dict of shardings or
            `ShapeDtypeStruct`s, planned per device.
        format, rules: as for [`xckpt.open`][xckpt.open].
        host_budget: JAX targets: host bytes read per batch (as `xckpt.jax.load`).

    Returns:
        A [`LoadPlan`][xckpt.plan.LoadPlan].
    """
    with opened(path, format=format, rules=rules) as src:
        return _plan(src, target, host_budget)


@paused_gc()  # (millions of small objects, no cycles: the collector would walk them again and again)
def _plan(src: Source, target: Any, host_budget: int, columns: bool = True) -> LoadPlan:
    """The plan; `columns=False` asks `read_units` per chunk for every tensor (the general
    path, which the column path must equal)."""
    kind, boxes = target_boxes(src, target)
    layouts = {id(per): per for per in boxes.values()}  # (tensors of one layout share their boxes)
    acc = _Totals(sorted({r for per in layouts.values() for r in per}))
    queries: dict[int, _Queries | None] = {}  # (tensors of one layout share their boxes: built once)
    for name, per in boxes.items():
        t = src.info(name)
        itemsize = t.np_dtype.itemsize
        qs = queries.get(id(per), ...) if columns else None
        if qs is ...:
            qs = queries[id(per)] = _Queries.of(per, acc.row, len(t.shape))
        got = None if qs is None else src.read_units_columns(name, qs.lo, qs.hi, itemsize)
        if qs is not None and got is not None:
            acc.add_columns(qs, got, itemsize)
        elif qs is not None and _by_pairs(t.chunk_index, len(qs.rows)):
            acc.add_pairs(src, name, t, qs, itemsize)
        else:
            acc.add_boxes(src, name, t, per, itemsize)
    plans = []
    for r, read, reads, kept, largest in acc.per_rank():
        peak = kept if kind == "torch" else min(kept, max(host_budget, largest))
        over = read / kept if kept else 1.0
        plans.append(RankPlan(r, read, reads, kept, over, peak))
    names = tuple(boxes)
    return LoadPlan(
        path=str(src.path),
        format=src.format,
        target=kind,
        ranks=tuple(plans),
        tensors=names,
        skipped=tuple(n for n in src.names() if n not in boxes),
        stored_bytes=sum(src.info(n).nbytes for n in names),
    )


#: Pair tests per block of `_Totals.add_pairs` (a bool each), and per tensor at most.
_PAIR_BLOCK = 1 << 22
_PAIRS_MAX = 1 << 27


def _by_pairs(index: ChunkIndex, boxes: int) -> bool:
    """Whether a tensor's boxes are looked up as pairs: its chunks form no grid (a grid's
    lookup is arithmetic), more than a scan's few, and not too many pairs to test."""
    return isinstance(index, BoxIndex) and index.grid is None and BoxIndex.SCAN < len(index) and boxes * len(index) <= _PAIRS_MAX


@dataclass(frozen=True)
class _Queries:
    """The boxes of one layout as columns: at most one box per rank, row `rows[q]` of the plan."""

    rows: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    volume: np.ndarray

    @classmethod
    def of(cls, per: Mapping[int, tuple[Box, ...]], row: _Rows, ndim: int) -> _Queries | None:
        """The columns of `per`, or None where a rank holds several boxes (their units may
        coincide: the general path dedups them)."""
        if isinstance(per, MeshBoxes):  # (every rank's box as arrays: no box built)
            ranks, lo, hi = per.columns()
            return cls(np.searchsorted(row.ranks, ranks), lo, hi, np.prod(hi - lo, axis=1, dtype=np.int64))
        rows: list[int] = []
        offs, shapes = [], []
        for rank, bs in per.items():
            if len(bs) > 1:
                return None
            if bs:
                rows.append(row.of[rank])
                offs.append(bs[0].offset)
                shapes.append(bs[0].shape)
        lo = np.array(offs, np.int64).reshape(len(offs), ndim)
        shape = np.array(shapes, np.int64).reshape(len(shapes), ndim)
        return cls(np.array(rows, np.int64), lo, lo + shape, np.prod(shape, axis=1, dtype=np.int64))


class _Rows(NamedTuple):
    """The plan's ranks, ascending (`ranks`), and each one's row (`of`)."""

    ranks: np.ndarray
    of: dict[int, int]


class _Totals:
    """Per rank: the units found by the general path (a dict each), the counts and bytes of
    the column path's own units and rows of its shared ones, and the bytes kept."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        self.row = _Rows(np.array(ranks, np.int64), {r: i for i, r in enumerate(ranks)})
        n = len(ranks)
        self.units: dict[int, dict[Hashable, int]] = {}
        self.kept = np.zeros(n, np.int64)
        self.largest = np.zeros(n, np.int64)
        self.own_reads = np.zeros(n, np.int64)
        self.own_bytes = np.zeros(n, np.int64)
        self.shared: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.unit: Callable[[int], Hashable] | None = None

    def add_boxes(self, src: Source, name: str, t: Any, per: Mapping[int, tuple[Box, ...]], itemsize: int) -> None:
        """A tensor by the general path: each box's chunks looked up, `read_units` per chunk."""
        # One index per tensor serves every rank: each lookup is O(log chunks), and only the
        # chunks a rank's boxes meet are built (once per tensor, whichever ranks share them).
        index, chunks = t.chunk_index, t.chunks
        built: dict[int, Chunk] = {}
        for rank, bs in per.items():
            share = 0
            got = self.units.setdefault(self.row.of[rank], {})
            for box in bs:
                share += box.volume * itemsize
                if box.empty:
                    continue
                for i, _b, common in index.overlaps(box):
                    c = built.get(i)
                    if c is None:
                        c = built[i] = chunks[i]
                    got.update(src.read_units(name, c, common, itemsize))
            j = self.row.of[rank]
            self.kept[j] += share
            self.largest[j] = max(int(self.largest[j]), share)

    def _keep(self, qs: _Queries, itemsize: int) -> None:
        share = qs.volume * itemsize
        self.kept[qs.rows] += share
        np.maximum(self.largest[qs.rows], share, out=share)
        self.largest[qs.rows] = share

    def add_pairs(self, src: Source, name: str, t: Any, qs: _Queries, itemsize: int) -> None:
        """A tensor of chunks that form no grid, at most one box per rank: the (box, chunk)
        pairs that meet found by comparing arrays, in blocks (a lookup per box would test
        hundreds of candidates of an irregular layout), then `read_units` per pair."""
        self._keep(qs, itemsize)
        boxes, chunks = t.boxes, t.chunks
        ndim = qs.lo.shape[1]
        blo = np.array([b.offset for b in boxes], np.int64).reshape(len(boxes), ndim)
        bhi = blo + np.array([b.shape for b in boxes], np.int64).reshape(len(boxes), ndim)
        rows = qs.rows.tolist()
        built: dict[int, Chunk] = {}
        step = max(1, _PAIR_BLOCK // max(1, len(boxes)))
        for s in range(0, len(rows), step):
            qlo, qhi = qs.lo[s : s + step], qs.hi[s : s + step]
            meet = np.ones((len(qlo), len(boxes)), bool)
            for d in range(ndim):
                meet &= (qlo[:, None, d] < bhi[None, :, d]) & (blo[None, :, d] < qhi[:, None, d])
            q, i = np.nonzero(meet)
            lo, hi = np.maximum(qlo[q], blo[i]).tolist(), np.minimum(qhi[q], bhi[i]).tolist()
            for k, c_id, a, b in zip((q + s).tolist(), i.tolist(), lo, hi):
                c = built.get(c_id)
                if c is None:
                    c = built[c_id] = chunks[c_id]
                common = Box.trusted(tuple(a), tuple(y - x for x, y in zip(a, b)))
                self.units.setdefault(rows[k], {}).update(src.read_units(name, c, common, itemsize))

    def add_columns(self, qs: _Queries, got: UnitColumns, itemsize: int) -> None:
        """A tensor by the column path."""
        self._keep(qs, itemsize)
        self.own_reads[qs.rows] += got.own_reads
        self.own_bytes[qs.rows] += got.own_bytes
        if len(got.code):
            self.shared.append((qs.rows[got.box], got.code, got.nbytes))
            self.unit = got.unit

    def per_rank(self) -> Iterator[tuple[int, int, int, int, int]]:
        """`(rank, bytes to read, reads, bytes kept, largest share)` of each rank, by rank."""
        reads, nbytes = self.own_reads.copy(), self.own_bytes.copy()
        if self.shared:  # each rank's distinct shared units, counted once
            row = np.concatenate([s[0] for s in self.shared])
            code = np.concatenate([s[1] for s in self.shared])
            size = np.concatenate([s[2] for s in self.shared])
            order = np.lexsort((code, row))
            row, code, size = row[order], code[order], size[order]
            first = np.ones(len(row), bool)
            first[1:] = (row[1:] != row[:-1]) | (code[1:] != code[:-1])
            row, code, size = row[first], code[first], size[first]
            mixed = np.isin(row, np.fromiter(self.units, np.int64, len(self.units)))
            unit = self.unit
            for j, c, b in zip(row[mixed].tolist(), code[mixed].tolist(), size[mixed].tolist()):
                self.units[j].setdefault(unit(c), b)  # type: ignore[misc]
            np.add.at(reads, row[~mixed], 1)
            np.add.at(nbytes, row[~mixed], size[~mixed])
        for j, got in self.units.items():
            reads[j] += len(got)
            nbytes[j] += sum(got.values())
        yield from zip(self.ranks, nbytes.tolist(), reads.tolist(), self.kept.tolist(), self.largest.tolist())
