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
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from xckpt.formats import opened
from xckpt.inspect import human_bytes, plot_plan, plural
from xckpt.manifest import Chunk, paused_gc
from xckpt.source import Source
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
def _plan(src: Source, target: Any, host_budget: int) -> LoadPlan:
    kind, boxes = target_boxes(src, target)
    ranks = sorted({r for per in boxes.values() for r in per})
    units: dict[int, dict[Hashable, int]] = {r: {} for r in ranks}
    kept = dict.fromkeys(ranks, 0)
    largest = dict.fromkeys(ranks, 0)
    for name, per in boxes.items():
        t = src.info(name)
        itemsize = t.np_dtype.itemsize
        # One index per tensor serves every rank: each lookup is O(log chunks), and only the
        # chunks a rank's boxes meet are built (once per tensor, whichever ranks share them).
        index, chunks = t.chunk_index, t.chunks
        built: dict[int, Chunk] = {}
        for rank, bs in per.items():
            share = 0
            got = units[rank]
            for box in bs:
                share += box.volume * itemsize
                if box.empty:
                    continue
                for i, _b, common in index.overlaps(box):
                    c = built.get(i)
                    if c is None:
                        c = built[i] = chunks[i]
                    got.update(src.read_units(name, c, common, itemsize))
            kept[rank] += share
            largest[rank] = max(largest[rank], share)
    plans = []
    for r in ranks:
        read = sum(units[r].values())
        peak = kept[r] if kind == "torch" else min(kept[r], max(host_budget, largest[r]))
        over = read / kept[r] if kept[r] else 1.0
        plans.append(RankPlan(r, read, len(units[r]), kept[r], over, peak))
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
