"""Read driver of value groups: new rank r' of W' gets its arrays of a group from any Source.

Call protocol (every loading rank, no collective; the torch and JAX adapters
both call it, so both load the same arrays):

1. `xckpt.values.ranges.group_annotations` (or `GroupAnnotation.from_manifest`)
   parses and checks each group once;
2. `xckpt.values.ranges.plan_rank_read` plans the rank's read: the path
   (value or position) and why, and the key chunks to read;
3. `load_rank` carries the plan out: reads those chunks of the key and its
   columns (checking every key against its chunk's range), assembles the rank's
   slots (`assemble_rank` or
   `position_rank`), reads the weight rows the new
   rows come from in runs (`row_runs`), rebuilds the
   segments and takes the max current iteration.

`read_group_rank` does all three for one group. Nothing here mutates
shared state: the bytes read come back in `ReadStats`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from xckpt.errors import ValueRangeError
from xckpt.layout import Box
from xckpt.manifest import Chunk, TensorEntry
from xckpt.source import Source
from xckpt.values.ranges import (
    BOX_COST,
    GENERIC_KIND,
    MC_KIND,
    GroupAnnotation,
    RankReadPlan,
    annotation_error,
    assemble_rank,
    check_keys,
    evict_order,
    first_duplicate,
    plan_rank_read,
    position_rank,
    row_runs,
)

__all__ = ["ReadStats", "RankArrays", "load_rank", "read_group_rank"]

log = logging.getLogger("xckpt.values")


@dataclass(frozen=True)
class ReadStats:
    """Bytes a rank read of a group: in all, of the key and its columns, of row tensors."""

    bytes: int = 0
    key_bytes: int = 0
    row_bytes: int = 0


@dataclass(frozen=True)
class RankArrays:
    """What one new rank loads of a group: arrays by tensor name, evictions, the path taken.

    `source_rows` (managed collision): the saved global row each new row's
    weight comes from. `read`: the bytes read.
    """

    arrays: dict[str, np.ndarray]
    evicted: int
    path: str
    source_rows: np.ndarray | None = None
    read: ReadStats = ReadStats()


def _read_rows(src: Source, name: str, box: Box) -> np.ndarray:
    out = np.empty(box.shape, dtype=src.info(name).np_dtype)
    if not box.empty:
        src.read_into([(name, box, out)])
    return out


def _rows_box(t: TensorEntry, start: int, stop: int) -> Box:
    return Box((start,) + (0,) * (len(t.shape) - 1), (stop - start,) + tuple(t.shape[1:]))


def _read_key_chunks(src: Source, g: GroupAnnotation, chunks: Sequence[Chunk]) -> tuple[dict[str, np.ndarray], int]:
    """Read `chunks` (boxes of the key) of the key and every column, checking keys; -> (arrays, bytes)."""
    where = str(src.path)
    names = [g.key, *g.columns()]
    items = []
    outs: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for c in chunks:
        for n in names:
            out = np.empty(c.shape, dtype=src.info(n).np_dtype)
            items.append((n, c.box, out))
            outs[n].append(out)
    if items:
        src.read_into(items)
    saved = g.saved
    for i, (c, keys) in enumerate(zip(chunks, outs[g.key])):
        check_keys(keys, c.value_range, g.key, f"checkpoint {where!r}, chunk at row {c.offset[0]}", g.empty_marker)
        if g.kind == MC_KIND and saved is not None and g.members.rows is not None:
            rows = outs[g.members.rows][i]
            r = int(np.searchsorted(saved.row_bounds[1:], c.offset[0], side="right"))
            lo, hi = saved.rows(r)
            if rows.size and (rows.min() < lo or rows.max() >= hi):
                bad = rows[(rows < lo) | (rows >= hi)]
                raise ValueRangeError(
                    f"checkpoint {where!r}: tensor {g.members.rows!r} maps to row {int(bad[0])} outside "
                    f"saved rank {r}'s rows [{lo}, {hi}); the data does not match its annotation"
                )
    empty = np.zeros(0, np.int64)
    nbytes = sum(o.nbytes for _, _, o in items)
    return {n: (np.concatenate(v) if v else empty) for n, v in outs.items()}, nbytes


def load_rank(
    src: Source, plan: RankReadPlan, *, strict_capacity: bool = False, box_cost: int = BOX_COST
) -> RankArrays:
    """Carry out `plan`: every planned tensor of the group as the new rank holds it.

    Managed collision: key, rows, metadata (zch' each), weight and row-aligned
    tensors (zch' rows), segments (rebuilt, padded with -1 as saved), current
    iter (1,). Generic: the key and its columns, `capacity` rows.

    Args:
        src: the open checkpoint the plan was made from.
        strict_capacity: raise instead of evicting.
        box_cost: estimated bytes one more read box costs; scattered weight
            rows moved in are read in runs that merge gaps cheaper than that
            (0: exactly the rows needed).

    Raises:
        ValueRangeError: bad keys, duplicates, a disagreeing annotation, or a
            capacity overflow with `strict_capacity`.
    """
    if plan.annotation.kind == GENERIC_KIND:
        return _generic_rank(src, plan, strict_capacity)
    g, rank, world, new = plan.annotation, plan.rank, plan.world, plan.layout
    saved = g.saved
    if new is None or saved is None or g.members.rows is None:
        raise ValueRangeError(f"group {g.group!r}: a managed-collision plan without layouts")
    where = str(src.path)
    want = set(plan.names)
    ilo, ihi = plan.input_range
    data, key_bytes = _read_key_chunks(src, g, plan.key_chunks)
    raw, rows = data[g.key], data[g.members.rows]
    meta = {m: data[m] for m in g.members.metadata}
    if plan.path == "position":
        got = position_rank(raw, rows, meta, new, rank, name=g.key)
    else:
        mine = (raw >= ilo) & (raw < ihi)
        got = assemble_rank(
            raw[mine], rows[mine], {m: v[mine] for m, v in meta.items()}, new, rank, g.rank_by,
            name=g.key, strict_capacity=strict_capacity,
        )
    log.debug("value group %r: rank %d of %d loads by the %s path (%s)", g.group, rank, world, plan.path, plan.reason)
    arrays: dict[str, np.ndarray] = {g.key: got.raw, g.members.rows: got.rows}
    arrays.update(got.meta)
    src_rows = got.source_rows
    row_bytes_read = other = 0
    for n in g.row_tensors():
        if n not in want:
            continue
        t = src.info(n)
        row_bytes = int(np.prod(t.shape[1:], dtype=np.int64)) * t.np_dtype.itemsize
        # Every saved row this rank needs (its own rows in place, the rows moved in),
        # read in runs chosen by the cost model, then gathered in new-row order.
        runs = row_runs(src_rows, row_bytes=row_bytes, box_cost=box_cost)
        lens = np.array([b - a for a, b in runs], np.int64)
        base = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        buf = np.empty((int(base[-1]), *t.shape[1:]), dtype=t.np_dtype)  # the runs, back to back
        items = [(n, _rows_box(t, a, b), buf[base[i] : base[i + 1]]) for i, (a, b) in enumerate(runs)]
        src.read_into(items)  # one call: all boxes read concurrently
        row_bytes_read += buf.nbytes
        if runs:
            starts = np.array([a for a, _ in runs], np.int64)
            which = np.searchsorted(starts, src_rows, side="right") - 1
            arrays[n] = buf[base[which] + (src_rows - starts[which])]
        else:
            arrays[n] = buf[:0]
    seg = g.members.segments
    if seg is not None and seg in want:
        st = src.info(seg)
        saved_seg = _read_rows(src, seg, Box((0,), st.shape))
        other += saved_seg.nbytes
        valid = saved_seg[saved_seg >= 0] if saved_seg.size else saved_seg
        if tuple(int(x) for x in valid) != saved.row_bounds:
            raise annotation_error(where, seg, f"it holds {valid.tolist()[:8]} but row_bounds are {list(saved.row_bounds)[:8]}")
        new_seg = np.full(st.shape, -1, np.int64)
        new_seg[: new.world + 1] = new.row_bounds
        arrays[seg] = new_seg
    cur = g.members.current_iter
    if cur is not None and cur in want:
        it = _read_rows(src, cur, Box((0,), src.info(cur).shape))
        other += it.nbytes
        arrays[cur] = it.max(initial=0).reshape(1)
    stats = ReadStats(bytes=key_bytes + row_bytes_read + other, key_bytes=key_bytes, row_bytes=row_bytes_read)
    return RankArrays({n: v for n, v in arrays.items() if n in want}, got.evicted, plan.path, got.source_rows, stats)


def _generic_rank(src: Source, plan: RankReadPlan, strict: bool) -> RankArrays:
    g, rank, world = plan.annotation, plan.rank, plan.world
    capacity = plan.capacity
    if capacity is None:
        raise ValueRangeError(f"group {g.group!r}: a generic group needs the rank's capacity (rows)")
    ilo, ihi = plan.input_range
    data, key_bytes = _read_key_chunks(src, g, plan.key_chunks)
    keys = data[g.key]
    mine = (keys >= ilo) & (keys < ihi)
    if g.empty_marker is not None:
        mine &= keys != g.empty_marker
    keys = keys[mine]
    cols = {n: data[n][mine] for n in g.columns()}
    d = first_duplicate(keys)
    if d is not None:
        raise ValueRangeError(f"checkpoint {str(src.path)!r}: tensor {g.key!r}: key {d} appears twice")
    evicted = 0
    if keys.size > capacity:
        if strict:
            raise ValueRangeError(
                f"{g.key}: rank {rank} of {world} owns {keys.size} keys but has room for {capacity}; "
                "give it more rows or load with strict_capacity=False"
            )
        keep = np.sort(evict_order(keys, cols, g.rank_by)[:capacity])
        evicted = int(keys.size - capacity)
        keys = keys[keep]
        cols = {n: v[keep] for n, v in cols.items()}
    order = np.argsort(keys, kind="stable")
    n_e = capacity - keys.size
    fill = g.empty_marker if g.empty_marker is not None else 0
    arrays = {g.key: np.concatenate([keys[order], np.full(n_e, fill, keys.dtype)])}
    for n, v in cols.items():
        t = src.info(n)
        arrays[n] = np.concatenate([v[order], np.zeros((n_e,) + tuple(t.shape[1:]), t.np_dtype)])
    return RankArrays(arrays, evicted, "value", read=ReadStats(bytes=key_bytes, key_bytes=key_bytes))


def read_group_rank(
    src: Source,
    key: str,
    rank: int,
    world: int,
    *,
    row_bounds: Sequence[int] | None = None,
    capacity: int | None = None,
    names: Sequence[str] | None = None,
    strict_capacity: bool = False,
    force_path: str | None = None,
    box_cost: int = BOX_COST,
) -> RankArrays:
    """Every tensor of the group keyed by `key` as new rank `rank` of `world` holds it.

    Parses and checks the group, plans the read (`plan_rank_read`:
    the arguments are its) and carries it out (`load_rank`).
    """
    tensors = {n: src.info(n) for n in src.names()}
    ann = GroupAnnotation.from_manifest(tensors, key, str(src.path))
    plan = plan_rank_read(
        ann, tensors[key], rank, world, row_bounds=row_bounds, capacity=capacity, names=names, force_path=force_path
    )
    return load_rank(src, plan, strict_capacity=strict_capacity, box_cost=box_cost)
