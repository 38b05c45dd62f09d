"""Value groups: state partitioned by the *values* it holds (DESIGN.md section 4).

Framework-free core of value-aware resharding, pure (no I/O, no collectives):

* the model: `GroupAnnotation` (with `Members`), the one typed
  form of the on-disk annotation, built to save or parsed and checked against
  the chunks once (`GroupAnnotation.from_manifest`);
* the arithmetic: input owners and row ranges (`MCLayout`), the
  five-step redistribution of torchrec's managed-collision (MCH/ZCH) state
  (`assemble_rank`), the position path where it is equivalent
  (`position_rank`), chunking and key checks, row runs;
* the read plan: `plan_rank_read` says, for a rank at W', which chunks
  it reads, by which path (value or position) and why (a frozen value).

Beside it, by job: `xckpt.values.save` plans what a saving rank writes
under which annotation, `xckpt.values.load` is the read driver. The adapters only turn tensors
into numpy, run collectives and introspect torchrec
(`xckpt.torch.value_groups`, `xckpt.torch.redistribute`,
`xckpt.jax._value_groups`).

Saved layout (decided here; the design leaves it open):

* A managed-collision group saves each MCH buffer (`_mch_sorted_raw_ids`,
  `_mch_remapped_ids_mapping` and every `_mch_<metadata>` column) as one
  global int64 tensor of N = sum(zch) rows; rank r's slots sit at its row
  offset `off_r` (row r of `row_bounds`), so a slot's position is in its
  rank's row range and positions stay meaningful. Each rank's slots are cut
  into chunks of at most `chunk_rows` used entries; a chunk's
  `value_range` is the sub-range `[lo, hi)` of the rank's input block that
  it covers (the used chunks of a rank tile its block), and the tail of empty
  slots is one chunk with no value range (it holds only the empty marker).
  Every column has the same chunk boxes and ranges as the key.
* The weight and the declared row-aligned tensors (row-wise optimizer state)
  are global tensors of N rows, one chunk per rank (rows `[off_r, off_r +
  zch_r)`), role "weight" / "row_aligned".
* `_current_iter_tensor` is saved as a (W,) tensor (rank r's value at r; the
  loader takes the max), `_output_segments_tensor` once as saved (it must
  agree with `row_bounds`).
* The key tensor's `ValueRange` (kind
  "managed_collision", role "key", domain `[0, I)`, empty marker int64 max)
  carries in `attrs`: `input_size`, `input_bounds` and `row_bounds` of
  the saved ranks, `members` (names by role), `rank_by` (metadata columns
  used for eviction, in priority order) and `miss_row` = "last". Only
  globally known facts go in attrs (manifests of ranks are merged by taking
  the first), per-rank facts are the chunks'.

Decisions where the design is silent:

* Input split: torchrec's `block = ceil(I / B)` with B = W buckets, one per
  rank (ZCH buckets finer than ranks are not modelled).
* Eviction (step 3) keeps the entries ranked highest by the `rank_by`
  columns, lexicographically (LFU: counts, then last access), ties to the
  smaller raw id. Re-slotted entries take, in ascending raw id order, the free
  usable rows of the owner in ascending order.
* Rows that no kept entry takes (free rows and the miss row) get the saved
  weight row at the same global index, so the weight is a position load with
  the moved rows overlaid; in the divisible case this is exactly position
  slicing. A rank reads exactly the saved rows its new rows come from (its
  own rows kept in place and the rows moved in); those are scattered
  (torchrec assigns rows in random order), so they are read in runs chosen by
  a cost model (`row_runs`: one more box costs about as much as 512 KiB
  more bytes), not one box per row.
* The position path is taken iff every new row boundary and every new input
  boundary is a saved one (each new rank's ranges are unions of whole saved
  ranks' ranges); it reads the rows `[lo', hi')` by position, concatenates
  and re-sorts (free slots: empty marker, metadata 0, rows ascending, the miss
  row last) and provably equals the value path (tests check it).
* Generic groups: a key tensor with a domain `[lo, hi)`, row-aligned
  columns, an empty marker. Saved rows need not be partitioned by key: each
  rank's rows are sorted by key and cut into chunks with tight ranges
  `[first, last + 1)`. At W' rank r' takes the keys in its ceil block of the
  domain, sorted, empty rows after them (columns 0); overflow keeps the
  highest by `rank_by` (else the smallest keys). Plain per-rank tensors must
  have the same length on every rank (rank r's rows sit at `r * n`).
* Checks that need every rank's data (a row or id duplicated between two
  chunks that different new ranks read) are not made; each rank checks what
  it reads, and the torch adapter shares the outcome so all ranks fail together.
* The annotation is validated strictly: `members` may name only the roles
  above (a string or null for rows, weight, segments, current_iter; a list for
  metadata, columns, row_aligned).
* Group tensors given as DTensors must be `Shard(0)` on a 1-D mesh of the
  loading ranks (torch.chunk split = torchrec's ceil split).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from xckpt.errors import ShapeMismatchError, ValueRangeError
from xckpt.manifest import Chunk, TensorEntry, ValueRange
from xckpt.source import Source

__all__ = [
    "INT64_MAX",
    "MC_KIND",
    "GENERIC_KIND",
    "DEFAULT_CHUNK_ROWS",
    "BOX_COST",
    "ROLES",
    "ROW_ROLES",
    "ceil_bounds",
    "MCLayout",
    "Assembled",
    "assemble_rank",
    "position_rank",
    "position_equivalent",
    "evict_order",
    "value_chunks",
    "generic_chunks",
    "check_keys",
    "first_duplicate",
    "row_runs",
    "Members",
    "GroupAnnotation",
    "group_keys",
    "group_annotations",
    "annotation_error",
    "RankReadPlan",
    "plan_rank_read",
    "target_layout",
]

INT64_MAX = 2**63 - 1
MC_KIND = "managed_collision"
GENERIC_KIND = "generic"
DEFAULT_CHUNK_ROWS = 1 << 19
#: Estimated cost of one more read box, in bytes (measured: ~0.8 ms per box on tensorstore).
BOX_COST = 512 << 10


def ceil_bounds(n: int, world: int) -> tuple[int, ...]:
    """torchrec's ceil split of `n` over `world`: boundaries `[0, ..., n]`."""
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

    `source_rows[i]`: the saved global row whose weight new row `lo + i` takes.
    """

    raw: np.ndarray
    rows: np.ndarray
    meta: dict[str, np.ndarray]
    source_rows: np.ndarray
    evicted: int


def evict_order(raw: np.ndarray, meta: Mapping[str, np.ndarray], rank_by: Sequence[str]) -> np.ndarray:
    """Entry order, best first: highest `rank_by` columns (in priority), then smaller raw id."""
    keys: list[np.ndarray] = [raw]
    for name in reversed(list(rank_by)):
        keys.append(-meta[name].astype(np.int64))
    return np.lexsort(tuple(keys))


def first_duplicate(values: np.ndarray) -> Any:
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
    """Steps 2-4 of DESIGN section 4 for new rank `rank`, given the used entries it owns.

    Args:
        raw: used raw ids routed to this rank (step 1 done by the caller).
        rows: their saved global rows; `meta`: their metadata columns.
        layout: the new layout; `rank_by`: eviction columns, priority order.
        name: the key tensor, for messages.
        strict_capacity: raise instead of evicting.

    Raises:
        ValueRangeError: a raw id or row appears twice, an id is not owned by
            `rank`, or (strict) the entries exceed the rank's capacity.
    """
    lo, hi = layout.rows(rank)
    zch = hi - lo
    raw = np.asarray(raw, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    ilo, ihi = layout.inputs(rank)
    if raw.size and (raw.min() < ilo or raw.max() >= ihi):
        raise ValueRangeError(f"{name}: raw ids outside [{ilo}, {ihi}) were routed to rank {rank}")
    d = first_duplicate(raw)
    if d is not None:
        raise ValueRangeError(f"{name}: raw id {d} appears twice; the saved group is corrupt")
    d = first_duplicate(rows)
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
    """The position path: rank's saved slots `[lo, hi)` concatenated, then re-sorted.

    Free slots get metadata 0 and their rows in ascending order (the miss row,
    the largest, last), then everything is stable-sorted by raw id. Valid only
    where `position_equivalent` holds.
    """
    lo, hi = layout.rows(rank)
    raw = np.asarray(raw, np.int64)
    rows = np.asarray(rows, np.int64)
    used = raw != INT64_MAX
    d = first_duplicate(raw[used])
    if d is not None:
        raise ValueRangeError(f"{name}: raw id {d} appears twice; the saved group is corrupt")
    d = first_duplicate(rows)
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
    """Cut one rank's sorted keys into chunks: `(start, stop, (vlo, vhi) | None)`.

    Used entries (`key != empty`) come first and are cut every `chunk_rows`;
    their ranges tile `[lo, hi)`. The empty tail is one chunk with no range.
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
    """Like `value_chunks` for a generic group: tight ranges `[first, last + 1)`."""
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
    """Every used key in `[lo, hi)`, ascending and unique; a range-less chunk holds only empties.

    Raises:
        ValueRangeError: naming `name` and `where` (the checkpoint / chunk).
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
    d = first_duplicate(used)
    if d is not None:
        raise ValueRangeError(f"{where}: tensor {name!r} holds key {d} twice; keys must be unique")


def row_runs(
    rows: np.ndarray, *, row_bytes: int = 1, box_cost: int = BOX_COST, max_runs: int = 4096
) -> list[tuple[int, int]]:
    """Rows -> (start, stop) runs covering them at the least estimated cost.

    Reading k runs costs `rows read * row_bytes + k * box_cost`; for k runs the
    fewest rows are read by merging the smallest gaps between needed rows, so
    the cost of every k is known from the sorted gaps and the cheapest k (at most
    `max_runs`) is taken. `box_cost=0` reads exactly the needed rows.
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


# -- the annotation model --------------------------------------------------------------

#: Member roles, in the order a group lists its tensors (the key first).
ROLES = ("rows", "metadata", "columns", "weight", "row_aligned", "segments", "current_iter")
#: Roles holding one tensor name (the others hold a list).
_ONE = ("rows", "weight", "segments", "current_iter")
#: Roles whose tensors are row-aligned with the key and chunked like it.
_COLUMN_ROLES = ("rows", "metadata", "columns")
#: Roles whose rows follow the key's rows by value (loaded per new rank).
ROW_ROLES = ("rows", "metadata", "columns", "weight", "row_aligned")


@dataclass(frozen=True, kw_only=True)
class Members:
    """The tensors of a group by role (names as saved); the key is the group's own field."""

    rows: str | None = None
    metadata: tuple[str, ...] = ()
    columns: tuple[str, ...] = ()
    weight: str | None = None
    row_aligned: tuple[str, ...] = ()
    segments: str | None = None
    current_iter: str | None = None

    def of(self, role: str) -> tuple[str, ...]:
        """The names holding `role` (none, one or several)."""
        v = getattr(self, role)
        return tuple(v) if isinstance(v, tuple) else (() if v is None else (v,))

    def to_json(self, kind: str) -> dict[str, Any]:
        if kind == GENERIC_KIND:
            return {"columns": list(self.columns)}
        return {
            "rows": self.rows, "metadata": list(self.metadata), "weight": self.weight,
            "row_aligned": list(self.row_aligned), "segments": self.segments, "current_iter": self.current_iter,
        }


@dataclass(frozen=True, kw_only=True)
class GroupAnnotation:
    """A value group as the manifest records it, checked against its chunks once.

    The key tensor's `ValueRange` carries it (`attrs`:
    `members`, `input_bounds`, `rank_by`, and for managed collision
    `input_size`, `row_bounds`, `miss_row`); every member's own
    `ValueRange` names the group and its role. Build one with
    `managed_collision` / `generic` to save, or read it with
    `from_manifest`, which is the only parser and validator.
    """

    group: str
    kind: str
    key: str
    members: Members
    domain: tuple[int, int]
    empty_marker: int | None
    input_bounds: tuple[int, ...]
    rank_by: tuple[str, ...] = ()
    input_size: int | None = None  # managed collision only
    row_bounds: tuple[int, ...] | None = None  # managed collision only

    @classmethod
    def managed_collision(
        cls, group: str, key: str, members: Members, *, input_size: int, row_bounds: Sequence[int],
        rank_by: Sequence[str] = (),
    ) -> GroupAnnotation:
        """A managed-collision group saved with rows split at `row_bounds`."""
        lay = MCLayout(int(input_size), tuple(int(b) for b in row_bounds))
        return cls(
            group=group, kind=MC_KIND, key=key, members=members, domain=(0, lay.input_size),
            empty_marker=INT64_MAX, input_bounds=lay.input_bounds, rank_by=tuple(rank_by),
            input_size=lay.input_size, row_bounds=lay.row_bounds,
        )

    @classmethod
    def generic(
        cls, key: str, domain: tuple[int, int], columns: Sequence[str], *, empty_marker: int | None,
        rank_by: Sequence[str] = (),
    ) -> GroupAnnotation:
        """A generic group named after its key tensor."""
        lo, hi = int(domain[0]), int(domain[1])
        return cls(
            group=key, kind=GENERIC_KIND, key=key, members=Members(columns=tuple(columns)), domain=(lo, hi),
            empty_marker=empty_marker, input_bounds=(lo, hi), rank_by=tuple(rank_by),
        )

    @property
    def saved(self) -> MCLayout | None:
        """The saved managed-collision layout (None for a generic group)."""
        if self.input_size is None or self.row_bounds is None:
            return None
        return MCLayout(self.input_size, self.row_bounds)

    def names(self) -> list[str]:
        """Every tensor of the group, key first."""
        return [self.key, *(n for role in ROLES for n in self.members.of(role))]

    def columns(self) -> list[str]:
        """Row-aligned columns chunked like the key (rows, metadata / generic columns)."""
        return [n for role in _COLUMN_ROLES for n in self.members.of(role)]

    def row_tensors(self) -> list[str]:
        """The weight and the row-aligned tensors (rows moved with re-slotted entries)."""
        return [*self.members.of("weight"), *self.members.of("row_aligned")]

    def row_members(self) -> list[str]:
        """Tensors whose rows a new rank gets by value: the key and the row roles."""
        return [self.key, *(n for role in ROW_ROLES for n in self.members.of(role))]

    def role_of(self, name: str) -> str:
        if name == self.key:
            return "key"
        for role in ROLES:
            if name in self.members.of(role):
                return role
        raise ValueRangeError(f"tensor {name!r} is not a member of value group {self.group!r}")

    def value_range(self, name: str) -> ValueRange:
        """The `ValueRange` to save `name` under (attrs on the key only)."""
        role = self.role_of(name)
        if role != "key":
            return ValueRange(group=self.group, role=role, kind=self.kind)
        attrs: dict[str, Any] = {}
        if self.kind == MC_KIND:
            attrs = {
                "input_size": self.input_size, "input_bounds": list(self.input_bounds),
                "row_bounds": list(self.row_bounds or ()), "members": self.members.to_json(self.kind),
                "rank_by": list(self.rank_by), "miss_row": "last", "version": 1,
            }
        else:
            attrs = {
                "input_bounds": list(self.input_bounds), "members": self.members.to_json(self.kind),
                "rank_by": list(self.rank_by), "version": 1,
            }
        return ValueRange(
            group=self.group, role="key", kind=self.kind, domain=self.domain, empty_marker=self.empty_marker,
            attrs=attrs,
        )

    @classmethod
    def from_manifest(cls, tensors: Mapping[str, TensorEntry], key: str, where: str) -> GroupAnnotation:
        """Parse the group whose key tensor is `key` and check it against every member's chunks.

        Raises:
            ValueRangeError: the annotation is inconsistent with itself or the chunks.
        """
        ann = _parse(tensors[key], key, where)
        _check_chunks(tensors, ann, where)
        return ann


def group_keys(tensors: Mapping[str, TensorEntry]) -> list[str]:
    """Key tensor names of every value group in a manifest."""
    return [n for n, t in tensors.items() if t.value_range is not None and t.value_range.role == "key"]


def group_annotations(src: Source) -> dict[str, GroupAnnotation]:
    """Every value group of `src`, by key name, each validated.

    (Not named `annotations`: that name is the module's `from __future__` import.)
    """
    tensors = {n: src.info(n) for n in src.names()}
    return {k: GroupAnnotation.from_manifest(tensors, k, str(src.path)) for k in group_keys(tensors)}


def annotation_error(where: str, name: str, what: str) -> ValueRangeError:
    return ValueRangeError(
        f"checkpoint {where!r}: tensor {name!r}: {what}; the value-range annotation disagrees with "
        "the chunks, so the checkpoint cannot be resharded by value (re-save it)"
    )


def _members(raw: Any, kind: str, key: str, where: str) -> Members:
    bad = not isinstance(raw, dict) or any(r not in ROLES for r in raw)
    fields: dict[str, Any] = {}
    for role, v in (raw.items() if isinstance(raw, dict) else ()):
        if role in _ONE and (v is None or isinstance(v, str)):
            fields[role] = v
        elif role not in _ONE and isinstance(v, list) and all(isinstance(x, str) for x in v):
            fields[role] = tuple(v)
        else:
            bad = True
    if bad or (kind == MC_KIND and not isinstance(fields.get("rows"), str)):
        raise annotation_error(where, key, f"attrs 'members' must name tensors, got {raw!r}"[:300])
    return Members(**fields)


def _parse(t: TensorEntry, key: str, where: str) -> GroupAnnotation:
    vr = t.value_range
    if vr is None or vr.role != "key":
        raise annotation_error(where, key, "it is not the key of a value group")
    a = dict(vr.attrs)
    if not isinstance(a.get("members"), dict):
        raise annotation_error(where, key, "attrs lack 'members'")
    if vr.domain is None:
        raise annotation_error(where, key, "the annotation has no domain")
    if vr.kind not in (MC_KIND, GENERIC_KIND):
        raise annotation_error(where, key, f"unknown group kind {vr.kind!r}")
    try:
        ib = tuple(int(x) for x in a.get("input_bounds", ()))
        rb = tuple(int(x) for x in a.get("row_bounds", ()))
        size = int(a.get("input_size", -1))
        rank_by = tuple(str(x) for x in a.get("rank_by", ()))
    except (TypeError, ValueError):
        raise annotation_error(where, key, "attrs input_bounds / row_bounds / input_size are not integers") from None
    members = _members(a["members"], vr.kind, key, where)
    domain = (int(vr.domain[0]), int(vr.domain[1]))
    if vr.kind == MC_KIND:
        if len(rb) < 2 or rb[0] != 0 or rb[-1] != t.shape[0] or any(b > c for b, c in zip(rb, rb[1:])):
            raise annotation_error(where, key, f"row_bounds {list(rb)[:8]} do not split its {t.shape[0]} rows")
        if ib != MCLayout(size, rb).input_bounds or domain != (0, size):
            raise annotation_error(where, key, f"input_bounds / domain disagree with input_size {size}")
        return GroupAnnotation(
            group=vr.group, kind=MC_KIND, key=key, members=members, domain=domain, empty_marker=vr.empty_marker,
            input_bounds=ib, rank_by=rank_by, input_size=size, row_bounds=rb,
        )
    if len(ib) < 2 or ib[0] != domain[0] or ib[-1] != domain[1]:
        raise annotation_error(where, key, "input_bounds do not split the domain")
    return GroupAnnotation(
        group=vr.group, kind=GENERIC_KIND, key=key, members=members, domain=domain, empty_marker=vr.empty_marker,
        input_bounds=ib, rank_by=rank_by,
    )


def _check_chunks(tensors: Mapping[str, TensorEntry], g: GroupAnnotation, where: str) -> None:
    t = tensors[g.key]
    boxes = sorted((c.offset, c.shape, c.value_range) for c in t.chunks)
    for name in g.names():
        if name not in tensors:
            raise annotation_error(where, name, f"group {g.group!r} names it but it is not saved")
        vr = tensors[name].value_range
        if vr is None or vr.group != g.group:
            raise annotation_error(where, name, f"it is not annotated as a member of group {g.group!r}")
    for name in g.columns():
        col = tensors[name]
        if col.shape[0] != t.shape[0] or sorted((x.offset, x.shape, x.value_range) for x in col.chunks) != boxes:
            raise annotation_error(where, name, f"its chunks differ from those of the key {g.key!r}")
    n_ranks = len(g.input_bounds) - 1
    bounds = g.row_bounds
    for c in t.chunks:
        if c.value_range is None:
            continue
        lo, hi = c.value_range
        if bounds is not None:
            r = int(np.searchsorted(bounds[1:], c.offset[0], side="right"))
            if r >= n_ranks or c.offset[0] + c.shape[0] > bounds[r + 1]:
                raise annotation_error(where, g.key, f"chunk at row {c.offset[0]} spans saved ranks")
            rlo, rhi = g.input_bounds[r], g.input_bounds[r + 1]
        else:
            rlo, rhi = g.domain
        if not (rlo <= lo <= hi <= rhi):
            raise annotation_error(where, g.key, f"chunk range [{lo}, {hi}) lies outside its rank's input range [{rlo}, {rhi})")
    if g.kind == MC_KIND:
        for name in g.row_tensors():
            if tensors[name].shape[0] != t.shape[0]:
                raise annotation_error(where, name, f"it has {tensors[name].shape[0]} rows, the group {t.shape[0]}")


# -- read plans ---------------------------------------------------------------------------


def target_layout(g: GroupAnnotation, world: int, row_bounds: Sequence[int] | None = None) -> MCLayout:
    """The managed-collision layout at `world` ranks (default rows: torchrec's ceil split).

    Raises:
        ShapeMismatchError: `row_bounds` does not split the saved rows.
    """
    saved = g.saved
    if saved is None:
        raise ValueRangeError(f"group {g.group!r} is not a managed-collision group")
    n = saved.row_bounds[-1]
    rb = ceil_bounds(n, world) if row_bounds is None else tuple(int(x) for x in row_bounds)
    if len(rb) != world + 1 or rb[0] != 0 or rb[-1] != n or any(b > c for b, c in zip(rb, rb[1:])):
        raise ShapeMismatchError(
            f"group {g.group!r}: row bounds {list(rb)[:8]} do not split the saved {n} rows over "
            f"{world} ranks; the table must keep its size"
        )
    return MCLayout(saved.input_size, rb)


@dataclass(frozen=True)
class RankReadPlan:
    """What new rank `rank` of `world` reads of a group, by which path, and why.

    `key_chunks`: the chunks of the key (the same boxes of every column) it
    reads. The weight rows follow from the key chunks' contents: after
    `assemble_rank` they are `source_rows`, read in `row_runs`.
    `layout`: the new managed-collision layout; `capacity`: a generic
    group's rows per rank.
    """

    annotation: GroupAnnotation
    rank: int
    world: int
    path: str
    reason: str
    input_range: tuple[int, int]
    key_chunks: tuple[Chunk, ...]
    names: tuple[str, ...]
    layout: MCLayout | None = None
    capacity: int | None = None


def plan_rank_read(
    ann: GroupAnnotation,
    key_entry: TensorEntry,
    rank: int,
    world: int,
    *,
    row_bounds: Sequence[int] | None = None,
    capacity: int | None = None,
    names: Sequence[str] | None = None,
    force_path: str | None = None,
) -> RankReadPlan:
    """Plan new rank `rank` of `world`'s read of a group (a pure function of the manifest).

    Args:
        ann: the group; `key_entry`: its key tensor's manifest entry.
        row_bounds: managed collision: the new row boundaries (default ceil split).
        capacity: generic: rows of the rank's key tensor.
        names: restrict to these tensors (default: all of the group).
        force_path: "value" to take the value path even where position slicing
            is equivalent (tests, benchmarks); "position" only where it is.

    Raises:
        ValueRangeError: "position" forced where it is not equivalent; a generic
            group without `capacity`.
        ShapeMismatchError: `row_bounds` do not split the saved rows.
    """
    want = tuple(ann.names() if names is None else [n for n in ann.names() if n in set(names)])

    def meets(c: Chunk, lo: int, hi: int) -> bool:
        return c.value_range is not None and c.value_range[0] < hi and lo < c.value_range[1]

    def by_row(cs: Any) -> tuple[Chunk, ...]:
        return tuple(sorted(cs, key=lambda c: c.offset[0]))

    if ann.kind == GENERIC_KIND:
        if capacity is None:
            raise ValueRangeError(f"group {ann.group!r}: a generic group needs the rank's capacity (rows)")
        b = ceil_bounds(ann.domain[1] - ann.domain[0], world)
        ilo, ihi = ann.domain[0] + b[rank], ann.domain[0] + b[rank + 1]
        chunks = by_row(c for c in key_entry.chunks if meets(c, ilo, ihi))
        return RankReadPlan(
            ann, rank, world, "value", "a generic group loads by value: its saved rows need not be "
            "partitioned by key", (ilo, ihi), chunks, want, capacity=int(capacity),
        )
    saved = ann.saved
    if saved is None:
        raise ValueRangeError(f"group {ann.group!r} has no saved layout")
    new = target_layout(ann, world, row_bounds)
    lo, hi = new.rows(rank)
    ilo, ihi = new.inputs(rank)
    equiv = position_equivalent(saved, new)
    if force_path == "position" and not equiv:
        raise ValueRangeError(
            f"group {ann.group!r}: position slicing is not equivalent from {saved.world} to {world} ranks "
            "(the new ranges are not unions of saved ones); load by value"
        )
    if equiv and force_path != "value":
        path = "position"
        reason = (
            f"every new row and input boundary at {world} ranks is one of the {saved.world} saved ranks': "
            "position slicing equals the value path"
        )
        chunks = by_row(c for c in key_entry.chunks if lo <= c.offset[0] and c.offset[0] + c.shape[0] <= hi)
    else:
        path = "value"
        reason = (
            "forced (force_path='value')" if equiv else
            f"the ranges at {world} ranks are not unions of the {saved.world} saved ranks': entries go to the "
            "input owner of their raw id"
        )
        chunks = by_row(c for c in key_entry.chunks if meets(c, ilo, ihi))
    return RankReadPlan(ann, rank, world, path, reason, (ilo, ihi), chunks, want, layout=new)
