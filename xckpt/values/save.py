"""Saving a value group: what each rank writes, under which annotation (pure plans).

Call protocol (every saving rank, no collective): the adapter builds the
group's `GroupAnnotation` (the same on every rank),
turns the members this rank holds into `LocalRows` (numpy), calls
`plan_mc_save` or `plan_generic_save` (checks, sorting, chunking:
a frozen `GroupSavePlan` and the arrays it writes), then
`write_group` on the rank's `xckpt.native.writer.Writer`. The on-disk
layout this produces is described in `xckpt.values.ranges`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from xckpt.errors import ValueRangeError
from xckpt.manifest import dtype_name, numpy_dtype
from xckpt.values.ranges import (
    DEFAULT_CHUNK_ROWS,
    INT64_MAX,
    GroupAnnotation,
    first_duplicate,
    generic_chunks,
    value_chunks,
)

__all__ = ["LocalRows", "ChunkWrite", "GroupSavePlan", "plan_mc_save", "plan_generic_save", "write_group"]


@dataclass(frozen=True)
class LocalRows:
    """What a saving rank holds of one member: its rows, their global row offset and count.

    `offset` / `global_rows` are None for a plain per-rank tensor (no
    sharding metadata says where its rows sit).
    """

    array: np.ndarray
    offset: int | None = None
    global_rows: int | None = None


@dataclass(frozen=True)
class ChunkWrite:
    """Rows `[start, stop)` of a member's planned local array, stored at global `offset`."""

    name: str
    start: int
    stop: int
    offset: tuple[int, ...]
    global_shape: tuple[int, ...]
    chunk_range: tuple[int, int] | None = None


@dataclass(frozen=True)
class GroupSavePlan:
    """One rank's part of a group: what to declare and write, under `annotation`.

    `declares` lists (name, dtype name, global shape) of every member this
    rank declares, `writes` the boxes it stores. The arrays come beside the
    plan (`plan_mc_save` returns them sorted by key); `write_group`
    carries it out.
    """

    annotation: GroupAnnotation
    rank: int
    declares: tuple[tuple[str, str, tuple[int, ...]], ...]
    writes: tuple[ChunkWrite, ...]


def _sort_by_key(keys: np.ndarray, cols: dict[str, np.ndarray], empty: int | None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    sk = keys.astype(np.int64) if empty is None else np.where(keys == empty, INT64_MAX, keys.astype(np.int64))
    if sk.size < 2 or bool(np.all(sk[1:] >= sk[:-1])):
        return keys, cols
    order = np.argsort(sk, kind="stable")
    return keys[order], {n: c[order] for n, c in cols.items()}


def plan_mc_save(
    ann: GroupAnnotation, rank: int, local: Mapping[str, LocalRows], chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> tuple[GroupSavePlan, dict[str, np.ndarray]]:
    """Check rank `rank`'s managed-collision state and plan its part (layout: module docstring).

    Args:
        ann: the group (its `row_bounds` split the rows over the saving ranks).
        local: every member this rank holds, by name.
        chunk_rows: at most this many used entries per chunk.

    Returns:
        (the plan, the arrays it writes by name: the key and its columns sorted by key).

    Raises:
        ValueRangeError: a member's rows are not the rank's rows, a used raw id or
            row lies outside the rank's ranges, or one appears twice.
    """
    lay, g, m = ann.saved, ann.group, ann.members
    if lay is None or m.rows is None:
        raise ValueRangeError(f"value group {g!r} is not a managed-collision group")
    off, hi = lay.rows(rank)
    ilo, ihi = lay.inputs(rank)
    n = lay.row_bounds[-1]
    cols: dict[str, np.ndarray] = {}
    for name in [ann.key, *ann.columns()]:
        lr = local[name]
        t, toff = lr.array, lr.offset
        if t.shape[0] != hi - off or (toff is not None and t.shape[0] and toff != off):
            raise ValueRangeError(
                f"value group {g!r}: tensor {name!r} holds rows at {toff} of size {t.shape[0]} on "
                f"rank {rank}, but its range is [{off}, {hi})"
            )
        cols[name] = t.astype(np.int64, copy=False)
    keys, cols = _sort_by_key(cols.pop(ann.key), cols, None)
    rows = cols[m.rows]
    used = keys != INT64_MAX
    bad = keys[used & ((keys < ilo) | (keys >= ihi))]
    if bad.size:
        raise ValueRangeError(
            f"value group {g!r}: tensor {ann.key!r} on rank {rank} holds raw id {int(bad[0])} outside the "
            f"rank's input range [{ilo}, {ihi}) (input_size {lay.input_size}); declare the module's input_size "
            "with xckpt.torch.ManagedCollision(..., input_size=...)"
        )
    badr = rows[(rows < off) | (rows >= hi)]
    if badr.size:
        raise ValueRangeError(
            f"value group {g!r}: tensor {m.rows!r} on rank {rank} maps to row {int(badr[0])} outside "
            f"the rank's rows [{off}, {hi})"
        )
    for what, arr, nm in (("raw id", keys[used], ann.key), ("row", rows, m.rows)):
        d = first_duplicate(arr)
        if d is not None:
            raise ValueRangeError(f"value group {g!r}: tensor {nm!r} on rank {rank} holds {what} {d} twice")
    arrays = {ann.key: keys, **cols}
    declares = [(name, "int64", (n,)) for name in arrays]
    writes = [
        ChunkWrite(name, s, e, (off + s,), (n,), vr)
        for s, e, vr in value_chunks(keys, ilo, ihi, chunk_rows)
        for name in arrays
    ]
    for role, name in [("weight", x) for x in m.of("weight")] + [("row_aligned", x) for x in m.row_aligned]:
        lr = local[name]
        t, toff, gn = lr.array, lr.offset, lr.global_rows
        if t.shape[0] != hi - off or (toff is not None and t.shape[0] and toff != off) or (gn is not None and gn != n):
            raise ValueRangeError(
                f"value group {g!r}: {role} {name!r} holds {t.shape[0]} rows at {toff} on rank {rank}; "
                f"the group's rows there are [{off}, {hi}) of {n}"
            )
        shape = (n, *t.shape[1:])
        arrays[name] = t
        declares.append((name, dtype_name(t.dtype), shape))
        writes.append(ChunkWrite(name, 0, int(t.shape[0]), (off,) + (0,) * (t.ndim - 1), shape))
    if m.current_iter is not None:
        world = lay.world
        arrays[m.current_iter] = local[m.current_iter].array.reshape(-1)[:1].astype(np.int64)
        declares.append((m.current_iter, "int64", (world,)))
        writes.append(ChunkWrite(m.current_iter, 0, 1, (rank,), (world,)))
    if m.segments is not None:
        seg = local[m.segments].array.astype(np.int64)
        arrays[m.segments] = seg
        declares.append((m.segments, "int64", tuple(seg.shape)))
        if rank == 0:  # the same on every rank: stored once
            writes.append(ChunkWrite(m.segments, 0, int(seg.shape[0]), (0,) * seg.ndim, tuple(seg.shape)))
    return GroupSavePlan(ann, rank, tuple(declares), tuple(writes)), arrays


def plan_generic_save(
    ann: GroupAnnotation, rank: int, world: int, local: Mapping[str, LocalRows], chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> tuple[GroupSavePlan, dict[str, np.ndarray]]:
    """Check rank `rank`'s rows of a generic group and plan its part.

    A plain per-rank key (no offset) puts rank r's rows at `r * n_local`.

    Raises:
        ValueRangeError: the key is not a 1-D integer tensor, a column is not
            row-aligned with it, or a key lies outside the domain or appears twice.
    """
    g, (lo, hi) = ann.key, ann.domain
    kl = local[g]
    nloc = int(kl.array.shape[0])
    off = kl.offset if kl.offset is not None else rank * nloc
    n = kl.global_rows if kl.global_rows is not None else world * nloc
    keys = kl.array
    if keys.ndim != 1 or keys.dtype.kind not in "iu":
        raise ValueRangeError(f"value group {g!r}: the key must be a 1-D integer tensor, got {keys.dtype}{list(keys.shape)}")
    cols: dict[str, np.ndarray] = {}
    for c in ann.members.columns:
        cl = local[c]
        if cl.array.shape[0] != nloc or (cl.offset is not None and nloc and cl.offset != off):
            raise ValueRangeError(f"value group {g!r}: column {c!r} is not row-aligned with the key on rank {rank}")
        cols[c] = cl.array
    keys, cols = _sort_by_key(keys, cols, ann.empty_marker)
    used = keys if ann.empty_marker is None else keys[keys != ann.empty_marker]
    bad = used[(used < lo) | (used >= hi)]
    if bad.size:
        raise ValueRangeError(f"value group {g!r}: tensor {g!r} on rank {rank} holds key {int(bad[0])} outside the domain [{lo}, {hi})")
    d = first_duplicate(used)
    if d is not None:
        raise ValueRangeError(f"value group {g!r}: tensor {g!r} on rank {rank} holds key {d} twice")
    arrays = {g: keys, **cols}
    declares = tuple((name, dtype_name(a.dtype), (n, *a.shape[1:])) for name, a in arrays.items())
    writes = tuple(
        ChunkWrite(name, s, e, (off + s,) + (0,) * (a.ndim - 1), (n, *a.shape[1:]), vr)
        for s, e, vr in generic_chunks(keys, chunk_rows, ann.empty_marker)
        for name, a in arrays.items()
    )
    return GroupSavePlan(ann, rank, declares, writes), arrays


def write_group(writer: Any, plan: GroupSavePlan, arrays: Mapping[str, np.ndarray]) -> None:
    """Carry out `plan` on a rank's `xckpt.native.writer.Writer` (no collectives)."""
    ann = plan.annotation
    for name, dtype, shape in plan.declares:
        writer.declare(name, numpy_dtype(dtype), shape, value_range=ann.value_range(name))
    for w in plan.writes:
        writer.write(
            w.name, arrays[w.name][w.start : w.stop], global_shape=w.global_shape, offset=w.offset,
            chunk_value_range=w.chunk_range,
        )
