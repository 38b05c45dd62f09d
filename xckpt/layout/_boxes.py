"""Boxes and placements: DTensor boxes of every mesh coordinate, coverage, writer choice.

Pure integer arithmetic, no framework imports, no I/O; re-exported by `xckpt.layout`.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from xckpt.errors import LayoutError, UnsupportedPlacementError


@dataclass(frozen=True)
class Box:
    """An axis-aligned box: `offset[d] <= i < offset[d] + shape[d]` in every dim."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        # Normalise to tuples of Python ints (numpy ints, lists, torch.Size come in too).
        off = tuple(map(int, self.offset))
        shp = tuple(map(int, self.shape))
        object.__setattr__(self, "offset", off)
        object.__setattr__(self, "shape", shp)
        if len(off) != len(shp):
            raise LayoutError(f"box offset {off} and shape {shp} have different ranks")
        if (off and min(off) < 0) or (shp and min(shp) < 0):
            raise LayoutError(f"box offset {off} / shape {shp} has a negative entry")

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        if type(shape) is tuple and all(type(s) is int and s >= 0 for s in shape):
            # Already a shape (a manifest's, a tensor's): built without normalising it
            # again (a load of 20,000 small tensors builds one box per tensor).
            b = object.__new__(cls)
            object.__setattr__(b, "__dict__", {"offset": (0,) * len(shape), "shape": shape})
            return b
        return cls((0,) * len(shape), tuple(shape))

    @classmethod
    def trusted(cls, offset: tuple[int, ...], shape: tuple[int, ...]) -> Box:
        """A box from tuples of non-negative ints already known good (index arithmetic):
        no normalising, no checks (a plan of 3,000 ranks builds a million boxes)."""
        b = object.__new__(cls)
        object.__setattr__(b, "__dict__", {"offset": offset, "shape": shape})
        return b

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.shape))

    @property
    def volume(self) -> int:
        v = 1
        for s in self.shape:
            v *= s
        return v

    @property
    def empty(self) -> bool:
        return 0 in self.shape

    def intersect(self, other: Box) -> Box | None:
        """The common region, or None when the boxes share no element."""
        if self.ndim != other.ndim:
            raise LayoutError(f"cannot intersect boxes of rank {self.ndim} and {other.ndim}")
        off, shp = [], []
        for a0, a1, b0, b1 in zip(self.offset, self.end, other.offset, other.end):
            lo, hi = max(a0, b0), min(a1, b1)
            if hi <= lo:
                return None
            off.append(lo)
            shp.append(hi - lo)
        return Box(tuple(off), tuple(shp))

    def contains(self, other: Box) -> bool:
        return all(
            a0 <= b0 and b1 <= a1 for a0, a1, b0, b1 in zip(self.offset, self.end, other.offset, other.end)
        )

    def slices(self, relative_to: Box | None = None) -> tuple[slice, ...]:
        """Index this box as slices, in global coordinates or relative to `relative_to`."""
        base = relative_to.offset if relative_to is not None else (0,) * self.ndim
        return tuple(slice(o - b, o - b + s) for o, b, s in zip(self.offset, base, self.shape))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{e}" for o, e in zip(self.offset, self.end)) + "]"


# ---------------------------------------------------------------------------
# Placements


@dataclass(frozen=True)
class Shard:
    """Split tensor dim `dim` over a mesh axis like `torch.chunk`."""

    dim: int


@dataclass(frozen=True)
class StridedShard:
    """torch's `_StridedShard(dim, split_factor)`: chunk into `split_factor`
    parts, chunk each part over the mesh axis, and give coordinate i the i-th
    sub-part of every part (possibly several disjoint runs)."""

    dim: int
    split_factor: int


@dataclass(frozen=True)
class Replicate:
    """Every coordinate on the mesh axis holds the same data."""


@dataclass(frozen=True)
class Partial:
    """Each coordinate holds a summand; cannot be saved."""

    reduce_op: str = "sum"


Placement = Shard | StridedShard | Replicate | Partial


def format_placement(p: Placement) -> str:
    """The provenance string recorded in manifests, e.g. `Shard(0)`."""
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, StridedShard):
        return f"_StridedShard({p.dim}, sf={p.split_factor})"
    if isinstance(p, Replicate):
        return "Replicate()"
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op})"
    raise UnsupportedPlacementError(f"unknown placement {p!r}")


def parse_placement(text: str) -> Placement:
    """Inverse of [`format_placement`][xckpt.layout._boxes.format_placement]."""
    t = text.replace(" ", "")
    try:
        if t == "Replicate()":
            return Replicate()
        if t.startswith("Shard(") and t.endswith(")"):
            return Shard(int(t[6:-1]))
        if t.startswith("_StridedShard(") and t.endswith(")"):
            d, sf = t[len("_StridedShard(") : -1].split(",")
            return StridedShard(int(d), int(sf.split("=")[-1]))
        if t.startswith("Partial(") and t.endswith(")"):
            return Partial(t[8:-1] or "sum")
    except ValueError:
        pass
    raise UnsupportedPlacementError(
        f"cannot parse placement {text!r}; expected Shard(d), _StridedShard(d, sf=k), "
        "Replicate() or Partial(op)"
    )


def parse_placements(text: str) -> tuple[Placement, ...]:
    """`"Shard(0), Replicate()"` -> placements (also `_StridedShard(0, sf=2)`)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    out = tuple(parse_placement(p.strip()) for p in parts if p.strip())
    if not out:
        raise UnsupportedPlacementError(
            f"no placement in {text!r}; e.g. 'Shard(0)' or 'Shard(0), Replicate()'"
        )
    return out


# ---------------------------------------------------------------------------
# Index arithmetic


def c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major (C order) element strides of `shape`."""
    out = []
    acc = 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def chunk_sizes(length: int, n: int) -> list[tuple[int, int]]:
    """`torch.chunk` split of `length` into `n` pieces: (start, size) each.

    Chunk size is `ceil(length / n)`; trailing pieces may be empty (their start
    is clamped to `length`).
    """
    if n <= 0:
        raise LayoutError(f"cannot split into {n} pieces")
    cs = -(-length // n) if length else 0
    out = []
    for i in range(n):
        start = min(length, cs * i)
        out.append((start, max(0, min(length, cs * (i + 1)) - cs * i)))
    return out


def _piece(length: int, n: int, i: int) -> tuple[int, int]:
    """`chunk_sizes(length, n)[i]` in O(1): a 3,000-rank mesh needs no 3,000-piece list per rank."""
    cs = -(-length // n) if length else 0
    return min(length, cs * i), max(0, min(length, cs * (i + 1)) - cs * i)


def _split_shard(idx: Sequence[int], n: int, i: int) -> list[int]:
    start, size = _piece(len(idx), n, i)
    return list(idx[start : start + size])


def _split_strided(idx: Sequence[int], sf: int, n: int, i: int) -> list[int]:
    out: list[int] = []
    for ps, psz in chunk_sizes(len(idx), sf):
        out.extend(_split_shard(idx[ps : ps + psz], n, i))
    return out


def dim_indices(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coord: Sequence[int],
    placements: Sequence[Placement],
    order: Sequence[int] | None = None,
    name: str = "<tensor>",
) -> list[list[int]]:
    """For one mesh coordinate, the sorted global indices held along every dim.

    Placements are applied in mesh-dim order (or `order`), each re-splitting
    the current local piece, exactly as torch's DTensor does.
    """
    if len(mesh_shape) != len(placements) or len(coord) != len(mesh_shape):
        raise UnsupportedPlacementError(
            f"tensor {name!r}: mesh shape {tuple(mesh_shape)}, coordinate {tuple(coord)} and "
            f"{len(placements)} placements do not match"
        )
    idx = [list(range(s)) for s in global_shape]
    for m in order if order is not None else range(len(placements)):
        p = placements[m]
        n, c = mesh_shape[m], coord[m]
        if isinstance(p, Replicate):
            continue
        if isinstance(p, Partial):
            raise UnsupportedPlacementError(
                f"tensor {name!r} has a Partial placement on mesh dim {m}: a partial value is "
                "a summand, not a region. Reduce it first (e.g. dtensor.redistribute(mesh, "
                "[Replicate()])) and save the result"
            )
        if not isinstance(p, (Shard, StridedShard)):
            raise UnsupportedPlacementError(f"tensor {name!r}: unknown placement {p!r}")
        if not 0 <= p.dim < len(global_shape):
            raise UnsupportedPlacementError(
                f"tensor {name!r}: {format_placement(p)} names dim {p.dim} but the tensor has "
                f"{len(global_shape)} dims"
            )
        if isinstance(p, Shard):
            idx[p.dim] = _split_shard(idx[p.dim], n, c)
        else:
            if p.split_factor < 1:
                raise UnsupportedPlacementError(
                    f"tensor {name!r}: split factor {p.split_factor} must be >= 1"
                )
            idx[p.dim] = _split_strided(idx[p.dim], p.split_factor, n, c)
    return [sorted(i) for i in idx]


def indices_to_runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted distinct indices -> maximal runs as (start, length)."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _take(runs: list[range], start: int, size: int) -> list[range]:
    """Elements `[start, start + size)` of the concatenated ranges `runs` (as ranges)."""
    out, pos, stop = [], 0, start + size
    for r in runs:
        n = len(r)
        lo, hi = max(start - pos, 0), min(stop - pos, n)
        if lo < hi:
            out.append(r[lo:hi])
        pos += n
        if pos >= stop:
            break
    return out


def dim_runs(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coord: Sequence[int],
    placements: Sequence[Placement],
    order: Sequence[int] | None = None,
    name: str = "<tensor>",
) -> list[list[tuple[int, int]]]:
    """[`dim_indices`][xckpt.layout._boxes.dim_indices] as sorted maximal runs `(start, length)` per dim.

    The same splits on ranges instead of index lists: the cost is per run, not
    per row (`dim_indices` + `indices_to_runs` over a 32000-row embedding
    and 180 tensors took ~0.1-0.3 s of a 2-rank W1 load on 2 cores).
    """
    # dim_indices' checks (and their errors) on empty index sets: no per-row work.
    dim_indices([0] * len(global_shape), mesh_shape, coord, placements, order=order, name=name)
    idx: list[list[range]] = [[range(s)] for s in global_shape]
    for m in order if order is not None else range(len(placements)):
        p = placements[m]
        if not isinstance(p, (Shard, StridedShard)):
            continue  # Replicate (Partial was refused by dim_indices above)
        n, c = mesh_shape[m], coord[m]
        cur = idx[p.dim]
        length = sum(len(r) for r in cur)
        if isinstance(p, StridedShard):
            parts = [_take(cur, ps, psz) for ps, psz in chunk_sizes(length, p.split_factor)]
        else:
            parts = [cur]
        new: list[range] = []
        for part in parts:
            start, size = _piece(sum(len(r) for r in part), n, c)
            new += _take(part, start, size)
        idx[p.dim] = new
    out = []
    for ranges in idx:
        merged: list[tuple[int, int]] = []
        for r in sorted((r for r in ranges if len(r)), key=lambda r: r.start):
            if merged and merged[-1][0] + merged[-1][1] == r.start:
                merged[-1] = (merged[-1][0], merged[-1][1] + len(r))
            else:
                merged.append((r.start, len(r)))
        out.append(merged)
    return out


def _boxes_from_indices(per_dim: Sequence[Sequence[int]]) -> tuple[Box, ...]:
    return _boxes_from_runs([indices_to_runs(ix) for ix in per_dim])


def _boxes_from_runs(runs: Sequence[Sequence[tuple[int, int]]]) -> tuple[Box, ...]:
    if any(len(r) == 0 for r in runs):
        return ()
    return tuple(
        Box(tuple(r[0] for r in combo), tuple(r[1] for r in combo)) for combo in itertools.product(*runs)
    )


def index_sets(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
) -> dict[tuple[int, ...], list[list[int]]]:
    """Per-dim index lists for every mesh coordinate."""
    return {
        c: dim_indices(global_shape, mesh_shape, c, placements)
        for c in itertools.product(*(range(n) for n in mesh_shape))
    }


def boxes_for_coordinate(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coord: Sequence[int],
    placements: Sequence[Placement],
    name: str = "<tensor>",
) -> tuple[Box, ...]:
    """The boxes one mesh coordinate holds (empty tuple for an empty shard).

    A strided shard can give several disjoint boxes; they are returned in
    row-major order of the local tensor, so concatenating local slices in that
    order reproduces the local shard. Costs O(mesh dims) for plain `Shard` and
    `Replicate` placements and O(runs) otherwise, never O(rows).
    """
    if (
        len(mesh_shape) == len(placements) == len(coord)
        and min(mesh_shape, default=1) > 0
        and all(
            type(p) is Replicate or (type(p) is Shard and 0 <= p.dim < len(global_shape)) for p in placements
        )
    ):
        off, shp = [0] * len(global_shape), list(global_shape)
        for p, n, c in zip(placements, mesh_shape, coord):
            if type(p) is Shard:
                start, shp[p.dim] = _piece(shp[p.dim], n, c)
                off[p.dim] += start
        return () if 0 in shp else (Box(tuple(off), tuple(shp)),)
    return _boxes_from_runs(dim_runs(global_shape, mesh_shape, coord, placements, name=name))


def shards_distinct_dims(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]) -> bool:
    """Whether the placements are one per mesh axis, each `Replicate` or a `Shard` of a dim of
    `shape` no other axis shards (a coordinate's box is then one piece per axis)."""
    dims = [p.dim for p in placements if type(p) is Shard]
    return (
        len(mesh_shape) == len(placements)
        and min(mesh_shape, default=1) > 0
        and all(type(p) is Replicate or (type(p) is Shard and 0 <= p.dim < len(shape)) for p in placements)
        and len(set(dims)) == len(dims)
    )


def mesh_boxes(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
) -> dict[tuple[int, ...], tuple[Box, ...]]:
    """Boxes for every mesh coordinate (row-major coordinate order)."""
    shape = tuple(int(s) for s in global_shape)
    if shards_distinct_dims(shape, mesh_shape, placements):
        # Each tensor dim split by one mesh axis at most: a coordinate's box is one piece per
        # axis, each axis's pieces computed once (3,000 ranks: 3,000 pieces, not 3,000 splits).
        pieces = [
            _pieces(shape[p.dim], n) if type(p) is Shard else [(0, 0)] * n for p, n in zip(placements, mesh_shape)
        ]
        out: dict[tuple[int, ...], tuple[Box, ...]] = {}
        for c in itertools.product(*(range(n) for n in mesh_shape)):
            off, shp = [0] * len(shape), list(shape)
            for p, ps, i in zip(placements, pieces, c):
                if type(p) is Shard:
                    off[p.dim], shp[p.dim] = ps[i]
            out[c] = () if 0 in shp else (Box.trusted(tuple(off), tuple(shp)),)
        return out
    return {
        c: boxes_for_coordinate(global_shape, mesh_shape, c, placements)
        for c in itertools.product(*(range(n) for n in mesh_shape))
    }


def _pieces(length: int, n: int) -> list[tuple[int, int]]:
    return [_piece(length, n, i) for i in range(n)]


def fsdp_order(placements: Sequence[Placement]) -> list[int] | None:
    """Application order of FSDP2 + TP's real storage, or None when not that pattern.

    FSDP2 labels its dp shard of an already TP-sharded dim `_StridedShard(d, sf)`
    but stores `chunk(chunk(rows, tp)[t], dp)[d]`: the later `Shard(d)` axes are
    applied first, then the strided one as a plain shard (REFERENCE.md section 7).
    """
    strided = [m for m, p in enumerate(placements) if isinstance(p, StridedShard)]
    if not strided:
        return None
    for m, p in enumerate(placements):
        if isinstance(p, StridedShard):
            later = [
                k
                for k in range(m + 1, len(placements))
                if isinstance(pk := placements[k], Shard) and pk.dim == p.dim
            ]
            if not later:
                return None
    # Non-strided placements keep mesh order; each strided one moves after them.
    order = [m for m in range(len(placements)) if m not in strided] + strided
    return order


def fsdp_boxes_for_coordinate(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coord: Sequence[int],
    placements: Sequence[Placement],
    name: str = "<tensor>",
) -> tuple[Box, ...] | None:
    """Boxes under FSDP2's storage rule (see [`fsdp_order`][xckpt.layout._boxes.fsdp_order]), or None if not FSDP2-like."""
    order = fsdp_order(placements)
    if order is None:
        return None
    plain = [Shard(p.dim) if isinstance(p, StridedShard) else p for p in placements]
    return _boxes_from_runs(dim_runs(global_shape, mesh_shape, coord, plain, order=order, name=name))


def box_from_index(shape: Sequence[int], index: object) -> Box:
    """A box from an index expression: None, an int, a slice, or a tuple of them.

    Only unit-step slices are supported; ints keep their dim (length 1).
    """
    if index is None:
        return Box.full(shape)
    items = index if isinstance(index, tuple) else (index,)
    if any(it is Ellipsis for it in items):
        k = items.index(Ellipsis)
        fill = len(shape) - (len(items) - 1)
        items = items[:k] + (slice(None),) * fill + items[k + 1 :]
    if len(items) > len(shape):
        raise LayoutError(f"index {index!r} has {len(items)} entries for a {len(shape)}-d tensor")
    items = tuple(items) + (slice(None),) * (len(shape) - len(items))
    off, shp = [], []
    for it, n in zip(items, shape):
        if isinstance(it, slice):
            start, stop, step = it.indices(n)
            if step != 1:
                raise LayoutError(f"index {index!r}: only unit-step slices are supported")
            off.append(start)
            shp.append(max(0, stop - start))
        elif isinstance(it, int) or hasattr(it, "__index__"):
            i = int(it)
            if i < 0:
                i += n
            if not 0 <= i < n:
                raise LayoutError(f"index {it} is out of bounds for a dim of size {n}")
            off.append(i)
            shp.append(1)
        else:
            raise LayoutError(f"unsupported index entry {it!r}")
    return Box(tuple(off), tuple(shp))


# ---------------------------------------------------------------------------
# Coverage, writer choice, read planning


def check_coverage(
    shape: Sequence[int], boxes: Sequence[Box], name: str = "<tensor>", where: str | None = None
) -> None:
    """Raise [`LayoutError`][xckpt.errors.LayoutError] unless `boxes` tile `shape` exactly.

    Checks rank, bounds and empty boxes, then exactness by signed corner counting
    (`_tiles_exactly`): O(n 2^k) for n boxes split along k dimensions, so a
    [1, 4000] tensor in 4,000 column chunks checks in milliseconds. Only a layout
    that fails is searched for a pair of overlapping chunks to name (a bounded
    search). `where` names the checkpoint in messages.
    """
    try:
        _check_coverage(shape, boxes, name)
    except LayoutError as e:
        if where is None:
            raise
        raise LayoutError(f"checkpoint {where!r}, {e}") from None


#: Dimensions split by the boxes beyond which corner counting (2^k corners per box)
#: gives way to a bounded sweep. Real layouts split 1-3 dimensions.
_MAX_CORNER_DIMS = 12
#: Box pairs the overlap search compares before it gives up naming a pair.
_OVERLAP_BUDGET = 1_000_000


def _tiles_exactly(full: Box, boxes: Sequence[Box]) -> bool | None:
    """Whether in-bounds, non-empty `boxes` tile `full` exactly (None: too many split dims).

    The mixed difference of a box's indicator function is +-1 at its 2^d corners
    (sign: parity of the upper coordinates taken). Summed over the boxes, it equals
    that of `full` if and only if every element is covered exactly once, since a
    function of bounded support is the running sum of its mixed difference.
    Dimensions that no box splits are left out (each contributes the same factor).
    """
    dims = [d for d in range(full.ndim) if any(b.shape[d] != full.shape[d] for b in boxes)]
    if not dims:
        return len(boxes) == 1
    if len(dims) > _MAX_CORNER_DIMS:
        return None
    counts: dict[tuple[int, ...], int] = {}
    get = counts.get
    for b in [*boxes, None]:
        off = full.offset if b is None else b.offset
        end = full.end if b is None else b.end
        pairs = [(off[d], end[d]) for d in dims]
        corners: list[tuple[tuple[int, ...], int]] = [((), 1 if b is not None else -1)]
        for lo, hi in pairs:
            corners = [(c + (lo,), s) for c, s in corners] + [(c + (hi,), -s) for c, s in corners]
        for c, sign in corners:
            v = get(c, 0) + sign
            if v:
                counts[c] = v
            else:
                del counts[c]
    return not counts


def _find_overlap(boxes: Sequence[Box]) -> tuple[Box, Box, Box] | None:
    """Two overlapping boxes and their intersection, or None (none found in the budget).

    Sweeps the dimension with the most distinct offsets, comparing a box only with
    the boxes still open along it.
    """
    ndim = boxes[0].ndim
    d = max(range(ndim), key=lambda k: len({b.offset[k] for b in boxes}))
    ordered = sorted(boxes, key=lambda b: b.offset[d])
    active: list[Box] = []
    budget = _OVERLAP_BUDGET
    for b in ordered:
        active = [a for a in active if a.end[d] > b.offset[d]]
        budget -= len(active) + 1
        if budget < 0:
            return None
        for a in active:
            common = a.intersect(b)
            if common is not None:
                return a, b, common
        active.append(b)
    return None


def _check_coverage(shape: Sequence[int], boxes: Sequence[Box], name: str) -> None:
    full = Box.full(shape)
    total = 0
    for b in boxes:
        if b.ndim != full.ndim:
            raise LayoutError(
                f"tensor {name!r}: chunk {b} has rank {b.ndim}, tensor shape {tuple(shape)} "
                f"has rank {full.ndim}"
            )
        if not full.contains(b):
            raise LayoutError(f"tensor {name!r}: chunk {b} lies outside the shape {tuple(shape)}")
        if b.empty:
            raise LayoutError(f"tensor {name!r}: chunk {b} is empty; empty chunks are not stored")
        total += b.volume
    if full.ndim == 0:
        if len(boxes) > 1:
            raise LayoutError(f"tensor {name!r}: a 0-d tensor has {len(boxes)} chunks (overlap)")
    elif boxes and total == full.volume and _tiles_exactly(full, boxes):
        return
    if total < full.volume:
        raise LayoutError(
            f"tensor {name!r}: chunks cover {total} of {full.volume} elements of shape "
            f"{tuple(shape)}; the layout has gaps (a rank's chunk is missing)"
        )
    if full.ndim == 0 or total == 0:
        return
    found = _find_overlap(boxes)
    if found is not None:
        a, b, common = found
        raise LayoutError(
            f"tensor {name!r}: chunks {a} and {b} overlap in {common}; every element "
            "must be stored exactly once"
        )
    raise LayoutError(
        f"tensor {name!r}: {len(boxes)} chunks of {total} elements do not tile the shape "
        f"{tuple(shape)} ({full.volume} elements): some overlap and leave gaps; every element "
        "must be stored exactly once"
    )


def choose_writer(name: str, box_index: int, holders: Sequence[int]) -> int:
    """The one rank among `holders` that writes a replicated box.

    Deterministic and local (every rank computes the same answer), and spread
    over holders by a stable hash of the tensor name and box index, so not all
    replicated data lands on rank 0.
    """
    if not holders:
        raise LayoutError(f"tensor {name!r}: box {box_index} has no holder")
    ordered = sorted(set(holders))
    h = zlib.crc32(f"{name}\0{box_index}".encode())
    return ordered[h % len(ordered)]


def holders_by_box(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    ranks: Mapping[tuple[int, ...], int],
) -> dict[Box, list[int]]:
    """Every distinct box and the ranks (via `ranks[coord]`) that hold it."""
    out: dict[Box, list[int]] = {}
    for coord, boxes in mesh_boxes(global_shape, mesh_shape, placements).items():
        for b in boxes:
            out.setdefault(b, []).append(ranks[coord])
    return out
