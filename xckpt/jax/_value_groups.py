"""Value groups in JAX: each device gets its rows by value, as a torch rank would.

A target leaf naming a row tensor of a value group (the key, its row-aligned
columns, the weight and row-aligned optimizer state) is not sliced by
position. Its sharding's distinct dim-0 ranges are the new ranks' row ranges
(they must tile the rows: W' = their number), and device d holding rows
`[lo, hi)` gets exactly what torch rank r' (the index of that range) loads:
`xckpt.values.ranges.plan_rank_read` plans and
`xckpt.values.load.load_rank` reads both. Trailing dims may be sharded
too; they are sliced after the rows are assembled.

The group's other tensors (`_output_segments_tensor`, `_current_iter_tensor`)
are ordinary saved tensors and load by position.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from xckpt.errors import UnsupportedPlacementError
from xckpt.layout import Box, box_from_index
from xckpt.source import Source
from xckpt.values import ranges as V
from xckpt.values.load import RankArrays, load_rank

from ._tree import device_boxes

__all__ = ["row_members", "load_group_arrays"]

log = logging.getLogger("xckpt.jax")

def row_members(ck: Source) -> dict[str, V.GroupAnnotation]:
    """{tensor name: its group} for every row tensor of every value group (each checked once)."""
    out: dict[str, V.GroupAnnotation] = {}
    for ann in V.group_annotations(ck).values():
        for n in ann.row_members():
            out[n] = ann
    return out


def _row_ranges(ck: Source, name: str, boxes: dict[Any, Box], n_rows: int) -> tuple[int, ...]:
    ranges = sorted({(b.offset[0], b.end[0]) for b in boxes.values()})
    bounds = [0]
    for lo, hi in ranges:
        if lo != bounds[-1]:
            raise UnsupportedPlacementError(
                f"checkpoint {ck.path!r}, tensor {name!r}: a value-group tensor loads by rank, so "
                f"its sharding's dim-0 ranges must tile the rows; got {ranges}. Shard dim 0 over "
                "the mesh axes of the new ranks (e.g. P('x', None)) or replicate it"
            )
        bounds.append(hi)
    if bounds[-1] != n_rows:
        raise UnsupportedPlacementError(
            f"checkpoint {ck.path!r}, tensor {name!r}: dim-0 ranges {ranges} do not cover its "
            f"{n_rows} rows"
        )
    return tuple(bounds)


def load_group_arrays(
    ck: Source,
    jobs: list[tuple[int, str, Sharding]],
    members: dict[str, V.GroupAnnotation],
    out: list[Any],
    *,
    strict_capacity: bool = False,
) -> dict[str, int]:
    """Build the jax.Arrays of value-group row tensors; returns {group: entries evicted}.

    `jobs` are (output index, tensor name, sharding). Each (group, new rank) is
    read once, whichever of its tensors and devices need it.
    """
    cache: dict[tuple[str, tuple[int, ...], int], RankArrays] = {}
    evicted: dict[str, int] = {}
    for index, name, sharding in jobs:
        entry = ck.info(name)
        ann = members[name]
        key = ann.key
        shape = tuple(entry.shape)
        boxes = device_boxes(sharding, shape, name, addressable=True)
        bounds = _row_ranges(ck, name, device_boxes(sharding, shape, name, addressable=False), shape[0])
        world = len(bounds) - 1
        starts = list(bounds[:-1])
        group = ann.group
        per_box: dict[Box, np.ndarray] = {}
        for box in set(boxes.values()):
            r = starts.index(box.offset[0])
            got = cache.get((key, bounds, r))
            if got is None:
                plan = V.plan_rank_read(ann, ck.info(key), r, world, row_bounds=bounds)
                got = load_rank(ck, plan, strict_capacity=strict_capacity)
                cache[(key, bounds, r)] = got
                evicted[group] = evicted.get(group, 0) + got.evicted
                log.info("value group %r: device rows %s loaded by the %s path: %s", group, box, plan.path, plan.reason)
            rows = got.arrays[name]
            per_box[box] = np.ascontiguousarray(rows[(slice(None),) + box.slices()[1:]])

        def fetch(idx: Any, per_box: dict[Box, np.ndarray] = per_box, shape: tuple[int, ...] = shape) -> np.ndarray:
            return per_box[box_from_index(shape, idx)]

        out[index] = jax.make_array_from_callback(shape, sharding, fetch, dtype=entry.np_dtype)
    for group, n in evicted.items():
        if n:
            warnings.warn(
                f"checkpoint {ck.path!r}: value group {group!r} evicted {n} entries that did not fit "
                "the new ranks' capacity (the lowest ranked by its eviction metadata)",
                stacklevel=3,
            )
    return evicted
