"""Value groups: state partitioned by the *values* it holds (DESIGN.md section 4).

Framework-free core of value-aware resharding: annotations, checks, the
input-owner / row-range arithmetic, the five-step redistribution of torchrec's
managed-collision (MCH/ZCH) state as pure numpy functions, the position path
where it is equivalent, read planning, and :func:`read_group_rank`, which gives
new rank r' of W' the numpy arrays of every tensor of a group (the torch and
JAX adapters both call it, so both load the same arrays).

Saved layout (decided here; the design leaves it open):

* A managed-collision group saves each MCH buffer (``_mch_sorted_raw_ids``,
  ``_mch_remapped_ids_mapping`` and every ``_mch_<metadata>`` column) as one
  global int64 tensor of N = sum(zch) rows; rank r's slots sit at its row
  offset ``off_r`` (row r of ``row_bounds``), so a slot's position is in its
  rank's row range and positions stay meaningful. Each rank's slots are cut
  into chunks of at most ``chunk_rows`` used entries; a chunk's
  ``value_range`` is the sub-range ``[lo, hi)`` of the rank's input block that
  it covers (the used chunks of a rank tile its block), and the tail of empty
  slots is one chunk with no value range (it holds only the empty marker).
  Every column has the same chunk boxes and ranges as the key.
* The weight and the declared row-aligned tensors (row-wise optimizer state)
  are global tensors of N rows, one chunk per rank (rows ``[off_r, off_r +
  zch_r)``), role "weight" / "row_aligned".
* ``_current_iter_tensor`` is saved as a (W,) tensor (rank r's value at r; the
  loader takes the max), ``_output_segments_tensor`` once as saved (it must
  agree with ``row_bounds``).
* The key tensor's :class:`~xckpt.manifest.ValueRange` (kind
  "managed_collision", role "key", domain ``[0, I)``, empty marker int64 max)
  carries in ``attrs``: ``input_size``, ``input_bounds`` and ``row_bounds`` of
  the saved ranks, ``members`` (names by role), ``rank_by`` (metadata columns
  used for eviction, in priority order) and ``miss_row`` = "last". Only
  globally known facts go in attrs (manifests of ranks are merged by taking
  the first), per-rank facts are the chunks'.

Decisions where the design is silent:

* Input split: torchrec's ``block = ceil(I / B)`` with B = W buckets, one per
  rank (ZCH buckets finer than ranks are not modelled).
* Eviction (step 3) keeps the entries ranked highest by the ``rank_by``
  columns, lexicographically (LFU: counts, then last access), ties to the
  smaller raw id. Re-slotted entries take, in ascending raw id order, the free
  usable rows of the owner in ascending order.
* Rows that no kept entry takes (free rows and the miss row) get the saved
  weight row at the same global index, so the weight is a position load with
  the moved rows overlaid; in the divisible case this is exactly position
  slicing. A rank reads exactly the saved rows its new rows come from (its
  own rows kept in place and the rows moved in); those are scattered
  (torchrec assigns rows in random order), so they are read in runs chosen by
  a cost model (:func:`row_runs`: one more box costs about as much as 512 KiB
  more bytes), not one box per row.
* The position path is taken iff every new row boundary and every new input
  boundary is a saved one (each new rank's ranges are unions of whole saved
  ranks' ranges); it reads the rows ``[lo', hi')`` by position, concatenates
  and re-sorts (free slots: empty marker, metadata 0, rows ascending, the miss
  row last) and provably equals the value path (tests check it).
* Generic groups: a key tensor with a domain ``[lo, hi)``, row-aligned
  columns, an empty marker. Saved rows need not be partitioned by key: each
  rank's rows are sorted by key and cut into chunks with tight ranges
  ``[first, last + 1)``. At W' rank r' takes the keys in its ceil block of the
  domain, sorted, empty rows after them (columns 0); overflow keeps the
  highest by ``rank_by`` (else the smallest keys). Plain per-rank tensors must
  have the same length on every rank (rank r's rows sit at ``r * n``).
* Checks that need every rank's data (a row or id duplicated between two
  chunks that different new ranks read) are not made; each rank checks what
  it reads, and the torch adapter shares the outcome so all ranks fail together.
* Group tensors given as DTensors must be ``Shard(0)`` on a 1-D mesh of the
  loading ranks (torch.chunk split = torchrec's ceil split).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xckpt.errors import ShapeMismatchError, ValueRangeError
from xckpt.layout import Box
from xckpt.manifest import Chunk, TensorEntry, ValueRange

__all__ = [
    "INT64_MAX",
    "MC_KIND",
    "GENERIC_KIND",
    "DEFAULT_CHUNK_ROWS",
    "ceil_bounds",
    "MCLayout",
    "Assembled",
    "assemble_rank",
    "position_rank",
    "evict_order",
    "value_chunks",
    "generic_chunks",
    "check_keys",
    "row_runs",
    "GroupInfo",
    "group_info",
    "groups_in",
    "position_equivalent",
    "RankArrays",
    "read_group_rank",
    "target_layout",
]

log = logging.getLogger("xckpt.value_ranges")

INT64_MAX = 2**63 - 1
MC_KIND = "managed_collision"
GENERIC_KIND = "generic"
DEFAULT_CHUNK_ROWS = 1 << 19
#: Estimated cost of one more read box, in bytes (measured: ~0.8 ms per box on tensorstore).
BOX_COST = 512 << 10


def ceil_bounds(n: int, world: int) -> tuple[int, ...]:
    """torchrec's ceil split of ``n`` over ``world``: boundaries ``[0, ..., n]``."""
    if world < 1:
        raise ValueRangeError(f"cannot split a domain over {world} ranks")
    block = -(-n // world)
    return tuple(min(r * block, n) for r in range(world + 1))


@dataclass(frozen=True)
class MCLayout:
    """Where a managed-collision group's rows and raw ids live at one world size."""

    input_size: int
    row_bounds: tuple[int, ...]

    @property
    def world(self) -> int:
        return len(self.row_bounds) - 1

    @property
    def input_bounds(self) -> tuple[int, ...]:
        return ceil_bounds(self.input_size, self.world)

    def rows(self, r: int) -> tuple[int, int]:
        return self.row_bounds[r], self.row_bounds[r + 1]

    def inputs(self, r: int) -> tuple[int, int]:
        b = self.input_bounds
        return b[r], b[r + 1]

    def owner(self, raw: np.ndarray) -> np.ndarray:
        """Input owner (rank) of each raw id: the rank whose block holds it."""
        return np.searchsorted(np.asarray(self.input_bounds[1:], dtype=np.int64), raw, side="right")


@dataclass
class Assembled:
    """One new rank's managed-collision slots (steps 2-4) and where its rows come from.

    ``source_rows[i]``: the saved global row whose weight new row ``lo + i`` takes.
    """

    raw: np.ndarray
    rows: np.ndarray
    meta: dict[str, np.ndarray]
    source_rows: np.ndarray
    evicted: int


def evict_order(raw: np.ndarray, meta: Mapping[str, np.ndarray], rank_by: Sequence[str]) -> np.ndarray:
    """Entry order, best first: highest ``rank_by`` columns (in priority), then smaller raw id."""
    keys: list[np.ndarray] = [raw]
    for name in reversed(list(rank_by)):
        keys.append(-meta[name].astype(np.int64))
    return np.lexsort(tuple(keys))


def _dup(values: np.ndarray) -> Any:
    s = np.sort(values)
    d = s[1:][s[1:] == s[:-1]]
    return int(d[0]) if d.size else None


def assemble_rank(
    raw: np.ndarray,
    rows: np.ndarray,
    meta: Mapping[str, np.ndarray],
    layout: MCLayout,
    rank: int,
    rank_by: Sequence[str] = (),
    *,
    name: str = "<group>",
    strict_capacity: bool = False,
) -> Assembled:
    """Steps 2-4 of DESIGN section 4 for new rank ``rank``, given the used entries it owns.

    Args:
        raw: used raw ids routed to this rank (step 1 done by the caller).
        rows: their saved global rows; ``meta``: their metadata columns.
        layout: the new layout; ``rank_by``: eviction columns, priority order.
        name: the key tensor, for messages.
        strict_capacity: raise instead of evicting.

    Raises:
        ValueRangeError: a raw id or row appears twice, an id is not owned by
            ``rank``, or (strict) the entries exceed the rank's capacity.
    """
    lo, hi = layout.rows(rank)
    zch = hi - lo
    raw = np.asarray(raw, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    ilo, ihi = layout.inputs(rank)
    if raw.size and (raw.min() < ilo or raw.max() >= ihi):
        raise ValueRangeError(f"{name}: raw ids outside [{ilo}, {ihi}) were routed to rank {rank}")
    d = _dup(raw)
    if d is not None:
        raise ValueRangeError(f"{name}: raw id {d} appears twice; the saved group is corrupt")
    d = _dup(rows)
    if d is not None:
        raise ValueRangeError(f"{name}: row {d} is mapped by two raw ids; the saved group is corrupt")
    cap = max(zch - 1, 0)
    evicted = 0
    meta = {k: np.asarray(v, dtype=np.int64) for k, v in meta.items()}
    if raw.size > cap:
        if strict_capacity:
            raise ValueRangeError(
                f"{name}: rank {rank} of {layout.world} owns {raw.size} ids but has room for {cap} "
                f"(zch {zch} minus the miss row); give it more rows or load with strict_capacity=False "
                "to evict the lowest-ranked entries"
            )
        keep = np.sort(evict_order(raw, meta, rank_by)[:cap])
        evicted = int(raw.size - cap)
        raw, rows = raw[keep], rows[keep]
        meta = {k: v[keep] for k, v in meta.items()}
    order = np.argsort(raw, kind="stable")
    raw, rows = raw[order], rows[order]
    meta = {k: v[order] for k, v in meta.items()}
    miss = hi - 1
    in_place = (rows >= lo) & (rows < miss)
    usable = np.arange(lo, max(miss, lo), dtype=np.int64)
    free = np.setdiff1d(usable, rows[in_place], assume_unique=True)
    movers = np.flatnonzero(~in_place)
    new_rows = rows.copy()
    new_rows[movers] = free[: movers.size]
    source = np.arange(lo, hi, dtype=np.int64)
    source[new_rows[movers] - lo] = rows[movers]
    empties = np.setdiff1d(np.arange(lo, hi, dtype=np.int64), new_rows, assume_unique=True)
    n_empty = empties.size
    out_meta = {k: np.concatenate([v, np.zeros(n_empty, np.int64)]) for k, v in meta.items()}
    return Assembled(
        raw=np.concatenate([raw, np.full(n_empty, INT64_MAX, np.int64)]),
        rows=np.concatenate([new_rows, empties]),
        meta=out_meta,
        source_rows=source,
        evicted=evicted,
    )


def position_rank(
    raw: np.ndarray,
    rows: np.ndarray,
    meta: Mapping[str, np.ndarray],
    layout: MCLayout,
    rank: int,
    *,
    name: str = "<group>",
) -> Assembled:
    """The position path: rank's saved slots ``[lo, hi)`` concatenated, then re-sorted.

    Free slots get metadata 0 and their rows in ascending order (the miss row,
    the largest, last), then everything is stable-sorted by raw id. Valid only
    where :func:`position_equivalent` holds.
    """
    lo, hi = layout.rows(rank)
    raw = np.asarray(raw, np.int64)
    rows = np.asarray(rows, np.int64)
    used = raw != INT64_MAX
    d = _dup(raw[used])
    if d is not None:
        raise ValueRangeError(f"{name}: raw id {d} appears twice; the saved group is corrupt")
    d = _dup(rows)
    if d is not None:
        raise ValueRangeError(f"{name}: row {d} appears twice; the saved group is corrupt")
    er = np.sort(rows[~used])
    meta_used = {k: np.asarray(v, np.int64)[used] for k, v in meta.items()}
    order = np.argsort(raw[used], kind="stable")
    n_e = er.size
    return Assembled(
        raw=np.concatenate([raw[used][order], np.full(n_e, INT64_MAX, np.int64)]),
        rows=np.concatenate([rows[used][order], er]),
        meta={k: np.concatenate([v[order], np.zeros(n_e, np.int64)]) for k, v in meta_used.items()},
        source_rows=np.arange(lo, hi, dtype=np.int64),
        evicted=0,
    )


def position_equivalent(saved: MCLayout, new: MCLayout) -> bool:
    """True iff each new rank's row and input ranges are unions of whole saved ranks' ranges."""
    if saved.input_size != new.input_size or saved.row_bounds[-1] != new.row_bounds[-1]:
        return False
    return set(new.row_bounds) <= set(saved.row_bounds) and set(new.input_bounds) <= set(saved.input_bounds)


def value_chunks(keys: np.ndarray, lo: int, hi: int, chunk_rows: int, empty: int = INT64_MAX) -> list[Any]:
    """Cut one rank's sorted keys into chunks: ``(start, stop, (vlo, vhi) | None)``.

    Used entries (``key != empty``) come first and are cut every ``chunk_rows``;
    their ranges tile ``[lo, hi)``. The empty tail is one chunk with no range.
    """
    used = int(np.count_nonzero(keys != empty))
    out: list[Any] = []
    starts = list(range(0, used, max(1, chunk_rows))) or []
    for i, s in enumerate(starts):
        e = min(s + chunk_rows, used)
        vlo = lo if i == 0 else int(keys[s])
        vhi = hi if e == used else int(keys[e])
        out.append((s, e, (vlo, vhi)))
    if used < keys.size:
        out.append((used, int(keys.size), None))
    return out


def generic_chunks(keys: np.ndarray, chunk_rows: int, empty: int | None) -> list[Any]:
    """Like :func:`value_chunks` for a generic group: tight ranges ``[first, last + 1)``."""
    used = int(keys.size if empty is None else np.count_nonzero(keys != empty))
    out: list[Any] = []
    for s in range(0, used, max(1, chunk_rows)):
        e = min(s + chunk_rows, used)
        out.append((s, e, (int(keys[s]), int(keys[e - 1]) + 1)))
    if used < keys.size:
        out.append((used, int(keys.size), None))
    return out


def check_keys(
    keys: np.ndarray, vrange: tuple[int, int] | None, name: str, where: str, empty: int | None = INT64_MAX
) -> None:
    """Every used key in ``[lo, hi)``, ascending and unique; a range-less chunk holds only empties.

    Raises:
        ValueRangeError: naming ``name`` and ``where`` (the checkpoint / chunk).
    """
    used_mask = keys != empty if empty is not None else np.ones(keys.shape, bool)
    used = keys[used_mask]
    if vrange is None:
        if used.size:
            raise ValueRangeError(
                f"{where}: tensor {name!r} has a chunk with no value range holding {used.size} "
                f"used keys (e.g. {int(used[0])}); the annotation disagrees with the chunks"
            )
        return
    lo, hi = vrange
    bad = used[(used < lo) | (used >= hi)]
    if bad.size:
        raise ValueRangeError(
            f"{where}: tensor {name!r} holds key {int(bad[0])} outside its chunk's range [{lo}, {hi}) "
            f"({bad.size} such keys); the data does not match its annotation"
        )
    d = _dup(used)
    if d is not None:
        raise ValueRangeError(f"{where}: tensor {name!r} holds key {d} twice; keys must be unique")


def row_runs(
    rows: np.ndarray, *, row_bytes: int = 1, box_cost: int = BOX_COST, max_runs: int = 4096
) -> list[tuple[int, int]]:
    """Rows -> (start, stop) runs covering them at the least estimated cost.

    Reading k runs costs ``rows read * row_bytes + k * box_cost``; for k runs the
    fewest rows are read by merging the smallest gaps between needed rows, so
    the cost of every k is known from the sorted gaps and the cheapest k (at most
    ``max_runs``) is taken. ``box_cost=0`` reads exactly the needed rows.
    """
    if rows.size == 0:
        return []
    r = np.sort(np.asarray(rows, np.int64))
    r = r[np.concatenate([[True], r[1:] != r[:-1]])]
    gaps = np.diff(r) - 1
    desc = -np.sort(-gaps[gaps > 0])  # only real gaps can split runs
    kmax = min(desc.size + 1, max(1, max_runs))
    cum = np.concatenate([[0], np.cumsum(desc[: kmax - 1])])  # gap rows saved by k-1 splits
    cost = (int(gaps.sum()) - cum) * row_bytes + np.arange(1, kmax + 1) * box_cost
    k = int(np.argmin(cost)) + 1
    g = 0 if k - 1 >= desc.size else int(desc[k - 1])
    cut = np.flatnonzero(gaps > g) if k > 1 else np.zeros(0, np.int64)
    starts = r[np.concatenate([[0], cut + 1])]
    stops = r[np.concatenate([cut, [r.size - 1]])] + 1
    return list(zip(starts.tolist(), stops.tolist()))


# -- the manifest side ---------------------------------------------------------


@dataclass(frozen=True)
class GroupInfo:
    """A value group as recorded in a manifest."""

    group: str
    kind: str
    key: str
    members: Mapping[str, Any]
    attrs: Mapping[str, Any]
    domain: tuple[int, int]
    empty_marker: int | None
    saved: MCLayout | None  # managed collision only
    input_bounds: tuple[int, ...]
    rank_by: tuple[str, ...] = field(default=())

    def names(self) -> list[str]:
        """Every tensor of the group, key first."""
        out = [self.key]
        for role in ("rows", "metadata", "columns", "weight", "row_aligned", "segments", "current_iter"):
            v = self.members.get(role)
            if isinstance(v, str):
                out.append(v)
            elif isinstance(v, list):
                out.extend(v)
        return out

    def columns(self) -> list[str]:
        """Row-aligned columns chunked like the key (rows, metadata / generic columns)."""
        out = [self.members["rows"]] if self.kind == MC_KIND else []
        return out + list(self.members.get("metadata", [])) + list(self.members.get("columns", []))


def _bad(where: str, name: str, what: str) -> ValueRangeError:
    return ValueRangeError(
        f"checkpoint {where!r}: tensor {name!r}: {what}; the value-range annotation disagrees with "
        "the chunks, so the checkpoint cannot be resharded by value (re-save it)"
    )


def group_info(tensors: Mapping[str, TensorEntry], key: str, where: str) -> GroupInfo:
    """Parse and check the annotation of the group whose key tensor is ``key``.

    Raises:
        ValueRangeError: the annotation is inconsistent with itself or the chunks.
    """
    t = tensors[key]
    vr = t.value_range
    if vr is None or vr.role != "key":
        raise _bad(where, key, "it is not the key of a value group")
    a = dict(vr.attrs)
    members = a.get("members")
    if not isinstance(members, dict):
        raise _bad(where, key, "attrs lack 'members'")
    if vr.domain is None:
        raise _bad(where, key, "the annotation has no domain")
    try:
        ib = tuple(int(x) for x in a.get("input_bounds", ()))
        rb = tuple(int(x) for x in a.get("row_bounds", ()))
        size = int(a.get("input_size", -1))
    except (TypeError, ValueError):
        raise _bad(where, key, "attrs input_bounds / row_bounds / input_size are not integers") from None
    bad_member = [
        v for v in members.values()
        if v is not None and not isinstance(v, str) and not (isinstance(v, list) and all(isinstance(x, str) for x in v))
    ]
    if bad_member or (vr.kind == MC_KIND and not isinstance(members.get("rows"), str)):
        raise _bad(where, key, f"attrs 'members' must name tensors, got {members!r}"[:300])
    saved = None
    if vr.kind == MC_KIND:
        if len(rb) < 2 or rb[0] != 0 or rb[-1] != t.shape[0] or any(b > c for b, c in zip(rb, rb[1:])):
            raise _bad(where, key, f"row_bounds {list(rb)[:8]} do not split its {t.shape[0]} rows")
        saved = MCLayout(size, rb)
        if ib != saved.input_bounds or tuple(vr.domain) != (0, size):
            raise _bad(where, key, f"input_bounds / domain disagree with input_size {size}")
    elif vr.kind == GENERIC_KIND:
        if len(ib) < 2 or ib[0] != vr.domain[0] or ib[-1] != vr.domain[1]:
            raise _bad(where, key, "input_bounds do not split the domain")
    else:
        raise _bad(where, key, f"unknown group kind {vr.kind!r}")
    info = GroupInfo(
        group=vr.group, kind=vr.kind, key=key, members=members, attrs=a, domain=tuple(vr.domain),  # type: ignore[arg-type]
        empty_marker=vr.empty_marker, saved=saved, input_bounds=ib, rank_by=tuple(a.get("rank_by", ())),
    )
    _check_chunks(tensors, info, where)
    return info


def _check_chunks(tensors: Mapping[str, TensorEntry], g: GroupInfo, where: str) -> None:
    t = tensors[g.key]
    boxes = sorted((c.offset, c.shape, c.value_range) for c in t.chunks)
    for name in g.names():
        if name not in tensors:
            raise _bad(where, name, f"group {g.group!r} names it but it is not saved")
        vr = tensors[name].value_range
        if vr is None or vr.group != g.group:
            raise _bad(where, name, f"it is not annotated as a member of group {g.group!r}")
    for name in g.columns():
        c = tensors[name]
        if c.shape[0] != t.shape[0] or sorted((x.offset, x.shape, x.value_range) for x in c.chunks) != boxes:
            raise _bad(where, name, f"its chunks differ from those of the key {g.key!r}")
    n_ranks = len(g.input_bounds) - 1
    bounds = g.saved.row_bounds if g.saved is not None else None
    for c in t.chunks:
        if c.value_range is None:
            continue
        lo, hi = c.value_range
        if bounds is not None:
            r = int(np.searchsorted(bounds[1:], c.offset[0], side="right"))
            if r >= n_ranks or c.offset[0] + c.shape[0] > bounds[r + 1]:
                raise _bad(where, g.key, f"chunk at row {c.offset[0]} spans saved ranks")
            rlo, rhi = g.input_bounds[r], g.input_bounds[r + 1]
        else:
            rlo, rhi = g.domain
        if not (rlo <= lo <= hi <= rhi):
            raise _bad(where, g.key, f"chunk range [{lo}, {hi}) lies outside its rank's input range [{rlo}, {rhi})")
    if g.kind == MC_KIND:
        for role in ("weight",):
            wname = g.members.get(role)
            if wname is not None and tensors[wname].shape[0] != t.shape[0]:
                raise _bad(where, wname, f"it has {tensors[wname].shape[0]} rows, the group {t.shape[0]}")
        for name in g.members.get("row_aligned", []):
            if tensors[name].shape[0] != t.shape[0]:
                raise _bad(where, name, f"it has {tensors[name].shape[0]} rows, the group {t.shape[0]}")


def groups_in(tensors: Mapping[str, TensorEntry]) -> list[str]:
    """Key tensor names of every value group in a manifest."""
    return [n for n, t in tensors.items() if t.value_range is not None and t.value_range.role == "key"]


def target_layout(g: GroupInfo, world: int, row_bounds: Sequence[int] | None = None) -> MCLayout:
    """The managed-collision layout at ``world`` ranks (default rows: torchrec's ceil split).

    Raises:
        ShapeMismatchError: ``row_bounds`` does not split the saved rows.
    """
    if g.saved is None:
        raise ValueRangeError(f"group {g.group!r} is not a managed-collision group")
    n = g.saved.row_bounds[-1]
    rb = ceil_bounds(n, world) if row_bounds is None else tuple(int(x) for x in row_bounds)
    if len(rb) != world + 1 or rb[0] != 0 or rb[-1] != n or any(b > c for b, c in zip(rb, rb[1:])):
        raise ShapeMismatchError(
            f"group {g.group!r}: row bounds {list(rb)[:8]} do not split the saved {n} rows over "
            f"{world} ranks; the table must keep its size"
        )
    return MCLayout(g.saved.input_size, rb)


@dataclass
class RankArrays:
    """What one new rank loads of a group: arrays by tensor name, evictions, path taken."""

    arrays: dict[str, np.ndarray]
    evicted: int
    path: str
    source_rows: np.ndarray | None = None


def _read_rows(ckpt: Any, name: str, box: Box, stats: dict[str, int] | None) -> np.ndarray:
    t = ckpt.info(name)
    out = np.empty(box.shape, dtype=t.np_dtype)
    if not box.empty:
        ckpt.read_into([(name, box, out)])
    if stats is not None:
        stats["bytes"] = stats.get("bytes", 0) + out.nbytes
    return out


def _rows_box(t: TensorEntry, start: int, stop: int) -> Box:
    return Box((start,) + (0,) * (len(t.shape) - 1), (stop - start,) + tuple(t.shape[1:]))


def _read_chunks(ckpt: Any, g: GroupInfo, chunks: list[Chunk], stats: Any) -> dict[str, np.ndarray]:
    """Read ``chunks`` (boxes of the key) of the key and every column, checking keys."""
    where = str(ckpt.path)
    names = [g.key, *g.columns()]
    items = []
    outs: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for c in chunks:
        for n in names:
            t = ckpt.info(n)
            out = np.empty(c.shape, dtype=t.np_dtype)
            items.append((n, c.box, out))
            outs[n].append(out)
    if items:
        ckpt.read_into(items)
    if stats is not None:
        nb = sum(o.nbytes for _, _, o in items)
        stats["bytes"] = stats.get("bytes", 0) + nb
        stats["key_bytes"] = stats.get("key_bytes", 0) + nb
    for c, keys in zip(chunks, outs[g.key]):
        check_keys(keys, c.value_range, g.key, f"checkpoint {where!r}, chunk at row {c.offset[0]}", g.empty_marker)
        if g.kind == MC_KIND and g.saved is not None:
            rows = outs[g.members["rows"]][chunks.index(c)]
            r = int(np.searchsorted(g.saved.row_bounds[1:], c.offset[0], side="right"))
            lo, hi = g.saved.rows(r)
            if rows.size and (rows.min() < lo or rows.max() >= hi):
                bad = rows[(rows < lo) | (rows >= hi)]
                raise ValueRangeError(
                    f"checkpoint {where!r}: tensor {g.members['rows']!r} maps to row {int(bad[0])} outside "
                    f"saved rank {r}'s rows [{lo}, {hi}); the data does not match its annotation"
                )
    empty = np.zeros(0, np.int64)
    return {n: (np.concatenate(v) if v else empty) for n, v in outs.items()}


def read_group_rank(
    ckpt: Any,
    key: str,
    rank: int,
    world: int,
    *,
    row_bounds: Sequence[int] | None = None,
    capacity: int | None = None,
    names: Sequence[str] | None = None,
    strict_capacity: bool = False,
    stats: dict[str, int] | None = None,
    force_path: str | None = None,
    box_cost: int = BOX_COST,
) -> RankArrays:
    """Every tensor of a value group as new rank ``rank`` of ``world`` holds it.

    Managed collision: the five steps of DESIGN section 4, reading only the
    key chunks whose range meets the rank's input range, the rank's weight
    rows and the rows moved in (or the position path where equivalent). The
    arrays: key, rows, metadata (zch' each), weight and row-aligned tensors
    (zch' rows), segments (rebuilt, padded with -1 as saved), current iter (1,).
    Generic: the key and its columns, ``capacity`` rows.

    Args:
        ckpt: an open :class:`xckpt.source.Source`.
        key: the group's key tensor name.
        rank, world: the new rank and world size.
        row_bounds: managed collision: the new row boundaries (default ceil split).
        capacity: generic: rows of the rank's key tensor.
        names: restrict to these tensors (default: all of the group).
        strict_capacity: raise instead of evicting.
        stats: if given, accumulates the bytes read: ``bytes`` in all,
            ``key_bytes`` of the key and its columns, ``row_bytes`` of the
            weight and row-aligned tensors.
        force_path: "value" to take the value path even where position slicing
            is equivalent (tests, benchmarks); "position" only where it is.
        box_cost: estimated bytes one more read box costs; scattered weight
            rows moved in are read in runs that merge gaps cheaper than that
            (0: exactly the rows needed).

    Raises:
        ValueRangeError: bad keys, duplicates, a disagreeing annotation, or a
            capacity overflow with ``strict_capacity``.
    """
    where = str(ckpt.path)
    g = group_info({n: ckpt.info(n) for n in ckpt.names()}, key, where)
    want = set(g.names() if names is None else names)
    if g.kind == GENERIC_KIND:
        return _generic_rank(ckpt, g, rank, world, capacity, strict_capacity, stats)
    new = target_layout(g, world, row_bounds)
    saved = g.saved if g.saved is not None else new
    lo, hi = new.rows(rank)
    ilo, ihi = new.inputs(rank)
    kt = ckpt.info(key)
    meta_names = list(g.members.get("metadata", []))
    equiv = position_equivalent(saved, new)
    if force_path == "position" and not equiv:
        raise ValueRangeError(
            f"group {g.group!r}: position slicing is not equivalent from {saved.world} to {world} ranks "
            "(the new ranges are not unions of saved ones); load by value"
        )
    if equiv and force_path != "value":
        path = "position"
        chunks = [c for c in kt.chunks if lo <= c.offset[0] and c.offset[0] + c.shape[0] <= hi]
    else:
        path = "value"
        chunks = [c for c in kt.chunks if c.value_range is not None and c.value_range[0] < ihi and ilo < c.value_range[1]]
    chunks.sort(key=lambda c: c.offset[0])
    data = _read_chunks(ckpt, g, chunks, stats)
    raw, rows = data[key], data[g.members["rows"]]
    meta = {m: data[m] for m in meta_names}
    if path == "position":
        got = position_rank(raw, rows, meta, new, rank, name=key)
    else:
        mine = (raw >= ilo) & (raw < ihi)
        got = assemble_rank(
            raw[mine], rows[mine], {m: v[mine] for m, v in meta.items()}, new, rank, g.rank_by,
            name=key, strict_capacity=strict_capacity,
        )
    log.debug("value group %r: rank %d of %d loads by %s path", g.group, rank, world, path)
    arrays: dict[str, np.ndarray] = {key: got.raw, g.members["rows"]: got.rows}
    arrays.update(got.meta)
    row_tensors = [n for n in [g.members.get("weight"), *g.members.get("row_aligned", [])] if n is not None]
    src = got.source_rows
    for n in row_tensors:
        if n not in want:
            continue
        t = ckpt.info(n)
        row_bytes = int(np.prod(t.shape[1:], dtype=np.int64)) * t.np_dtype.itemsize
        # Every saved row this rank needs (its own rows in place, the rows moved in),
        # read in runs chosen by the cost model, then gathered in new-row order.
        runs = row_runs(src, row_bytes=row_bytes, box_cost=box_cost)
        lens = np.array([b - a for a, b in runs], np.int64)
        base = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        buf = np.empty((int(base[-1]), *t.shape[1:]), dtype=t.np_dtype)  # the runs, back to back
        items = [(n, _rows_box(t, a, b), buf[base[i] : base[i + 1]]) for i, (a, b) in enumerate(runs)]
        ckpt.read_into(items)  # one call: all boxes read concurrently
        if stats is not None:
            stats["bytes"] = stats.get("bytes", 0) + buf.nbytes
            stats["row_bytes"] = stats.get("row_bytes", 0) + buf.nbytes
        if runs:
            starts = np.array([a for a, _ in runs], np.int64)
            which = np.searchsorted(starts, src, side="right") - 1
            arrays[n] = buf[base[which] + (src - starts[which])]
        else:
            arrays[n] = buf[:0]
    seg = g.members.get("segments")
    if seg is not None and seg in want:
        st = ckpt.info(seg)
        saved_seg = _read_rows(ckpt, seg, Box((0,), st.shape), stats)
        valid = saved_seg[saved_seg >= 0] if saved_seg.size else saved_seg
        if tuple(int(x) for x in valid) != saved.row_bounds:
            raise _bad(where, seg, f"it holds {valid.tolist()[:8]} but row_bounds are {list(saved.row_bounds)[:8]}")
        new_seg = np.full(st.shape, -1, np.int64)
        new_seg[: new.world + 1] = new.row_bounds
        arrays[seg] = new_seg
    cur = g.members.get("current_iter")
    if cur is not None and cur in want:
        ct = ckpt.info(cur)
        arrays[cur] = _read_rows(ckpt, cur, Box((0,), ct.shape), stats).max(initial=0).reshape(1)
    return RankArrays({n: v for n, v in arrays.items() if n in want}, got.evicted, path, got.source_rows)


def _generic_rank(
    ckpt: Any, g: GroupInfo, rank: int, world: int, capacity: int | None, strict: bool, stats: Any
) -> RankArrays:
    if capacity is None:
        raise ValueRangeError(f"group {g.group!r}: a generic group needs the rank's capacity (rows)")
    bounds = ceil_bounds(g.domain[1] - g.domain[0], world)
    ilo, ihi = g.domain[0] + bounds[rank], g.domain[0] + bounds[rank + 1]
    kt = ckpt.info(g.key)
    chunks = sorted(
        (c for c in kt.chunks if c.value_range is not None and c.value_range[0] < ihi and ilo < c.value_range[1]),
        key=lambda c: c.offset[0],
    )
    data = _read_chunks(ckpt, g, chunks, stats)
    keys = data[g.key]
    mine = (keys >= ilo) & (keys < ihi)
    if g.empty_marker is not None:
        mine &= keys != g.empty_marker
    keys = keys[mine]
    cols = {n: data[n][mine] for n in g.columns()}
    d = _dup(keys)
    if d is not None:
        raise ValueRangeError(f"checkpoint {str(ckpt.path)!r}: tensor {g.key!r}: key {d} appears twice")
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
        t = ckpt.info(n)
        arrays[n] = np.concatenate([v[order], np.zeros((n_e,) + tuple(t.shape[1:]), t.np_dtype)])
    return RankArrays(arrays, evicted, "value")


def annotation(
    group: str, role: str, kind: str, *, domain: tuple[int, int] | None = None, attrs: Mapping[str, Any] | None = None,
    empty_marker: int | None = None,
) -> ValueRange:
    """The :class:`ValueRange` of one member tensor (attrs only on the key)."""
    return ValueRange(group=group, role=role, kind=kind, domain=domain, empty_marker=empty_marker, attrs=dict(attrs or {}))
