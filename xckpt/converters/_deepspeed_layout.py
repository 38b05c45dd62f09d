"""Where each parameter of a DeepSpeed ZeRO checkpoint lies in the ranks' flat partitions.

Pure arithmetic over element counts (no I/O), following DeepSpeed's own recovery script
`zero_to_fp32.py` (DeepSpeed 0.19) exactly, so the weights presented are the ones it
recovers and every check it makes is made here too:

* stages 1 and 2: group `g`'s flat fp32 buffer is the ranks' partitions
  `single_partition_of_fp32_groups[g]` concatenated in rank order; its parameters lie
  one after another in `param_shapes[g]` order (plus `param_alignment_paddings`
  after each, when recorded), the rest is padding: after rounding both up to a multiple
  of `2 * world_size`, the elements used must equal the elements held;
* stage 3: each parameter is partitioned on its own, `ceil(numel / world)` elements
  per rank (the last rank padded), at the same offset of every rank's flat groups
  (`fp32_flat_groups`, concatenated over groups; a piece may cross a group boundary);
  `offset * world` must equal the elements held.

A `FlatRange` is one contiguous run of a parameter's flattened elements inside one
rank's flat tensor of one group. `range_box` says whether a run is a box of the
parameter's shape (rows of a matrix, a part of one row), which decides whether a
parameter is presented as one chunk per piece or as one chunk assembled from its pieces.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from xckpt.errors import LayoutError
from xckpt.layout import Box, c_strides

__all__ = ["FlatRange", "range_box", "zero12_pieces", "zero3_pieces", "run_pieces"]


class FlatRange(NamedTuple):
    """Elements `[at, at + length)` of a parameter, flattened, are elements
    `[start, start + length)` of rank `rank`'s flat tensor of group `group`."""

    rank: int
    group: int
    start: int
    length: int
    at: int


def range_box(shape: tuple[int, ...], a: int, b: int) -> Box | None:
    """The box of `shape` whose elements are the flattened range `[a, b)`, or None when
    the range is not a box (it starts or ends inside a row and spans more than that row)."""
    if not 0 <= a < b <= math.prod(shape):
        return None
    if not shape:
        return Box((), ())
    strides = c_strides(shape)
    for d, inner in enumerate(strides):
        outer = inner * shape[d]
        if a % inner or b % inner or a // outer != (b - 1) // outer:
            continue
        idx = []
        rem = a
        for s in strides[: d + 1]:
            idx.append(rem // s)
            rem %= s
        offset = tuple(idx) + (0,) * (len(shape) - d - 1)
        extent = (1,) * d + ((b - a) // inner,) + tuple(shape[d + 1 :])
        return Box(offset, extent)
    return None


def run_pieces(runs: Sequence[tuple[int, int, int]], begin: int, numel: int, rank: int) -> list[FlatRange]:
    """Rank `rank`'s pieces of `[begin, begin + numel)` of a flat space made of consecutive
    tensors `runs` (`(space_start, space_end, group)`), cut where it crosses from one to the
    next; `at` counts from `begin`."""
    out = []
    for lo, hi, group in runs:
        a, b = max(lo, begin), min(hi, begin + numel)
        if a < b:
            out.append(FlatRange(rank, group, a - lo, b - a, a - begin))
    return out


def zero12_pieces(
    param_shapes: Sequence[Mapping[str, tuple[int, ...]]],
    partition_numels: Sequence[Sequence[int]],
    paddings: Sequence[Sequence[int]] | None,
    where: str,
) -> dict[str, list[FlatRange]]:
    """Stages 1/2: each parameter's pieces, by name (see the module docstring).

    `partition_numels[r][g]` is the element count of rank `r`'s partition of group `g`.

    Raises:
        LayoutError: the parameters do not fit the partitions as zero_to_fp32 checks it.
    """
    world = len(partition_numels)
    groups = len(param_shapes)
    if any(len(p) != groups for p in partition_numels):
        raise LayoutError(
            f"{where}: the model has {groups} parameter groups but the optimizer files hold "
            f"{[len(p) for p in partition_numels]} flat partitions per rank; the files come from different saves"
        )
    out: dict[str, list[FlatRange]] = {}
    for g, shapes in enumerate(param_shapes):
        bounds = []  # (start, end, rank) of each rank's partition in the group's concatenation
        pos = 0
        for r in range(world):
            bounds.append((pos, pos + partition_numels[r][g], r))
            pos += partition_numels[r][g]
        avail = pos
        pads = paddings[g] if paddings is not None else None
        if pads is not None and len(pads) != len(shapes):
            raise LayoutError(
                f"{where}: expected {len(shapes)} parameter alignment paddings for group {g}, found {len(pads)}"
            )
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            if offset + numel > avail:
                raise LayoutError(
                    f"{where}: parameter {name!r} {shape} of group {g} needs elements [{offset}, "
                    f"{offset + numel}) but the ranks' partitions hold {avail}; the checkpoint is damaged"
                )
            pieces = []
            for lo, hi, r in bounds:
                a, b = max(lo, offset), min(hi, offset + numel)
                if a < b:
                    pieces.append(FlatRange(r, g, a - lo, b - a, a - offset))
            out[name] = pieces
            offset += numel
            if pads is not None:
                offset += pads[i]
        align = 2 * world
        if align * math.ceil(offset / align) != align * math.ceil(avail / align):
            raise LayoutError(
                f"{where}: the parameters of group {g} use {offset} elements of the {avail} the ranks' "
                "partitions hold; zero_to_fp32 refuses this too (a damaged checkpoint, or files of "
                "different saves)"
            )
    return out


def zero3_pieces(
    param_shapes: Mapping[str, tuple[int, ...]], group_numels: Sequence[Sequence[int]], where: str
) -> dict[str, list[FlatRange]]:
    """Stage 3: each parameter's pieces, by name (see the module docstring).

    `group_numels[r][g]` is the element count of rank `r`'s flat tensor of group `g`;
    the ranks' flat groups must have the same sizes.

    Raises:
        LayoutError: the parameters do not fit the partitions as zero_to_fp32 checks it.
    """
    world = len(group_numels)
    first = list(group_numels[0])
    if any(list(g) != first for g in group_numels):
        raise LayoutError(
            f"{where}: the ranks' flat groups differ in size ({[list(g) for g in group_numels][:4]}); "
            "ZeRO-3 partitions every parameter evenly: the files come from different saves"
        )
    runs = []
    pos = 0
    for g, n in enumerate(first):
        runs.append((pos, pos + n, g))
        pos += n
    avail = pos
    out: dict[str, list[FlatRange]] = {}
    offset = 0
    for name, shape in param_shapes.items():
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        if offset + part > avail:
            raise LayoutError(
                f"{where}: parameter {name!r} {shape} needs {part} elements per rank at offset {offset} "
                f"but each rank holds {avail}; the checkpoint is damaged"
            )
        pieces = []
        for r in range(world):
            n = min(part, numel - r * part)
            if n > 0:
                pieces += [p._replace(rank=r, at=p.at + r * part) for p in run_pieces(runs, offset, n, r)]
        out[name] = pieces
        offset += part
    if offset != avail:
        raise LayoutError(
            f"{where}: the parameters use {offset} elements of each rank's {avail}; zero_to_fp32 "
            "refuses this too (a damaged checkpoint, or files of different saves)"
        )
    return out
