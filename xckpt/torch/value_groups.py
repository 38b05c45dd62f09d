"""Value groups in the PyTorch adapter: torchrec managed-collision state that reshards by value.

Call protocol (the adapter's ``save`` / ``load`` make these calls, on every rank):

1. ``save``: :func:`split_value_groups` (no I/O, no collectives) finds the groups
   (declared, or torchrec MCH buffers found by name) and returns their plans and
   the flat names they own; the adapter saves everything else. Then
   :func:`save_value_groups` checks and writes this rank's part of each group
   through the rank's :class:`xckpt.Writer` (no collectives).
2. ``load``: :func:`load_value_groups` finds the groups of the checkpoint whose
   key tensor the caller asks for, computes every group tensor of this rank
   with :func:`xckpt.value_ranges.read_group_rank`, exchanges the outcome with
   the other ranks (one ``all_gather_object``), and only when every rank
   succeeded fills the targets in place. It returns the names it handled and
   ``{group prefix: entries this rank evicted}``.

Declaring groups (names as in the saved state dict)::

    xckpt.torch.save(sd, path, value_groups=[
        ManagedCollision("mc", weight="emb.weight", input_size=2**20, row_aligned=["mom"]),
        ValueGroup("cache.keys", domain=10**6, columns=["cache.vals"], empty_marker=-1),
    ])
    xckpt.torch.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}, path,
                     value_groups=managed_collision_groups(dmp, dmp.fused_optimizer))

torchrec MCH buffers under ``..._managed_collision_modules.<t>.`` are found
without a declaration (input size 2**63-1, weight by torchrec's name rule, no
row-aligned tensors). Loading needs no declaration: the manifest has it all.

Group tensors may be plain per-rank tensors (each rank's own rows), row-wise
``ShardedTensor``s (``DistributedModelParallel`` state dicts) or DTensors
sharded on dim 0; the local shard and its offset are used. The on-disk layout
and the decisions behind it are in :mod:`xckpt.value_ranges`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from xckpt import value_ranges as V
from xckpt.errors import ShapeMismatchError, UnsupportedPlacementError, ValueRangeError
from xckpt.torch._dist import share_outcome
from xckpt.torch._dtypes import as_numpy
from xckpt.torch._placement import dtensor_local, is_dtensor, is_sharded_tensor

__all__ = [
    "ManagedCollision",
    "ValueGroup",
    "managed_collision_groups",
    "redistribute_by_value",
    "split_value_groups",
    "save_value_groups",
    "load_value_groups",
]

log = logging.getLogger("xckpt.torch.value_groups")

_RAW = "_mch_sorted_raw_ids"
_ROWS = "_mch_remapped_ids_mapping"
_SEG = "_output_segments_tensor"
_ITER = "_current_iter_tensor"
_MCM = "_managed_collision_modules."
_RANK_BY = ("_mch_counts", "_mch_last_access_iter")


@dataclass(frozen=True)
class ManagedCollision:
    """Declares a torchrec managed-collision module's state as a value group.

    Args:
        prefix: the module's buffers' prefix as saved (names ``prefix._mch_...``),
            with or without the trailing "." state-dict keys show; stored without it.
        weight: the embedding weight's name (default: torchrec's name rule).
        input_size: the module's ``input_hash_size`` (torchrec's default 2**63-1).
        row_aligned: names of tensors row-aligned with the weight (row-wise
            optimizer state), moved with re-slotted rows.
        rank_by: eviction columns in priority order (default: ``_mch_counts``
            then ``_mch_last_access_iter``, those present).
        chunk_rows: at most this many used entries per saved chunk.
    """

    prefix: str
    weight: str | None = None
    input_size: int = V.INT64_MAX
    row_aligned: Sequence[str] = ()
    rank_by: Sequence[str] | None = None
    chunk_rows: int = V.DEFAULT_CHUNK_ROWS

    def __post_init__(self) -> None:
        # "m.t1." (as printed in state-dict keys) and "m.t1" name the same module.
        object.__setattr__(self, "prefix", self.prefix.rstrip("."))


@dataclass(frozen=True)
class ValueGroup:
    """A generic value group: rows go to the rank whose block of ``domain`` holds their key.

    Args:
        key: name of the key tensor (one dimension, integer).
        domain: ``(lo, hi)`` or ``hi`` of the key values.
        columns: names of tensors row-aligned with the key.
        empty_marker: key value of unused rows (None: every row is used).
        rank_by: columns ranking rows when a rank overflows (highest kept).
        chunk_rows: at most this many used rows per saved chunk.
    """

    key: str
    domain: tuple[int, int] | int
    columns: Sequence[str] = ()
    empty_marker: int | None = V.INT64_MAX
    rank_by: Sequence[str] = ()
    chunk_rows: int = V.DEFAULT_CHUNK_ROWS


@dataclass
class _MCPlan:
    decl: ManagedCollision
    key: str
    rows: str
    metadata: list[str]
    weight: str | None
    row_aligned: list[str]
    segments: str | None
    current_iter: str | None

    def owned(self) -> set[str]:
        return {
            n
            for n in [self.key, self.rows, *self.metadata, self.weight, *self.row_aligned, self.segments, self.current_iter]
            if n is not None
        }


def _weight_by_rule(prefix: str, flat: Mapping[str, Any]) -> str | None:
    i = prefix.rfind("_managed_collision_collection." + _MCM)
    if i < 0:
        return None
    m, table = prefix[:i], prefix[i + len("_managed_collision_collection." + _MCM) :]
    for kind in ("embedding_bags", "embeddings"):
        cand = f"{m}_embedding_module.{kind}.{table}.weight"
        if cand in flat:
            return cand
    return None


def _mc_plan(flat: Mapping[str, Any], d: ManagedCollision) -> _MCPlan:
    key = f"{d.prefix}.{_RAW}" if d.prefix else _RAW
    pre = f"{d.prefix}." if d.prefix else ""
    if key not in flat or pre + _ROWS not in flat:
        raise ValueRangeError(
            f"value group {d.prefix!r}: the state dict lacks {key!r} or {pre + _ROWS!r}; give the "
            "prefix of the managed-collision module's buffers as they appear in the state dict"
        )
    meta = sorted(n for n in flat if n.startswith(pre + "_mch_") and "." not in n[len(pre) :] and n not in (key, pre + _ROWS))
    weight = d.weight if d.weight is not None else _weight_by_rule(d.prefix, flat)
    for n in [weight, *d.row_aligned]:
        if n is not None and n not in flat:
            raise ValueRangeError(f"value group {d.prefix!r}: declared tensor {n!r} is not in the state dict")
    if weight is None:
        log.warning("value group %r: no embedding weight found; rows re-slotted at load keep no weights", d.prefix)
    return _MCPlan(
        d, key, pre + _ROWS, meta, weight, list(d.row_aligned),
        pre + _SEG if pre + _SEG in flat else None, pre + _ITER if pre + _ITER in flat else None,
    )


def split_value_groups(flat: dict[str, Any], value_groups: Sequence[Any] | None) -> tuple[list[Any], set[str]]:
    """Plans of the declared groups plus torchrec MCH modules found by name.

    Returns:
        (plans, names of ``flat`` the groups own; the adapter does not save those).

    Raises:
        ValueRangeError: a declaration names tensors the state dict lacks.
    """
    plans: list[Any] = []
    seen: set[str] = set()
    for d in value_groups or ():
        if isinstance(d, ManagedCollision):
            plans.append(_mc_plan(flat, d))
            seen.add(d.prefix)
        elif isinstance(d, ValueGroup):
            for n in [d.key, *d.columns]:
                if n not in flat:
                    raise ValueRangeError(f"value group {d.key!r}: tensor {n!r} is not in the state dict")
            plans.append(d)
        else:
            raise ValueRangeError(f"value_groups holds {type(d).__name__}; use ManagedCollision or ValueGroup")
    for n in flat:
        if n.endswith("." + _RAW) and _MCM in n:
            prefix = n[: -len(_RAW) - 1]
            if prefix not in seen:
                plans.append(_mc_plan(flat, ManagedCollision(prefix)))
                seen.add(prefix)
    owned: set[str] = set()
    for p in plans:
        new = p.owned() if isinstance(p, _MCPlan) else {p.key, *p.columns}
        if owned & new:
            raise ValueRangeError(f"tensors {sorted(owned & new)} belong to two value groups")
        owned |= new
    return plans, owned


# -- local views --------------------------------------------------------------


def _local(v: Any, name: str) -> tuple[torch.Tensor, int | None, int | None]:
    """(local tensor, its row offset or None, global rows or None)."""
    if is_sharded_tensor(v):
        shards = v.local_shards()
        n = int(v.metadata().size[0])
        if not shards:
            return torch.empty((0, *v.metadata().size[1:]), dtype=v.metadata().tensor_properties.dtype), None, n
        if len(shards) > 1:
            raise UnsupportedPlacementError(f"value group tensor {name!r} has {len(shards)} local shards; expected one")
        md = shards[0].metadata
        if any(o != 0 for o in md.shard_offsets[1:]):
            raise UnsupportedPlacementError(f"value group tensor {name!r} must be sharded by rows only")
        return shards[0].tensor, int(md.shard_offsets[0]), n
    if is_dtensor(v):
        loc = dtensor_local(v, name, lambda g: g)
        if len(loc.pieces) > 1:
            raise UnsupportedPlacementError(f"value group tensor {name!r} must be sharded on dim 0 only")
        n = int(v.shape[0])
        if not loc.pieces:
            return torch.empty((0, *v.shape[1:]), dtype=v.dtype), None, n
        p = loc.pieces[0]
        if p.box.shape[1:] != tuple(v.shape[1:]):
            raise UnsupportedPlacementError(f"value group tensor {name!r} must be sharded on dim 0 only")
        return v.to_local(), p.box.offset[0], n
    if isinstance(v, np.ndarray):
        return torch.from_numpy(v), None, None
    return v, None, None


def _np(t: torch.Tensor) -> np.ndarray:
    return as_numpy(t.detach().cpu())


def _segments(flat: Mapping[str, Any], p: _MCPlan) -> tuple[int, ...] | None:
    if p.segments is None:
        return None
    seg = _np(_local(flat[p.segments], p.segments)[0]).astype(np.int64)
    return tuple(int(x) for x in seg[seg >= 0])


def _row_bounds_save(flat: Mapping[str, Any], p: _MCPlan, world: int) -> tuple[int, ...]:
    v = flat[p.key]
    if is_sharded_tensor(v):
        offs = sorted({int(s.shard_offsets[0]) for s in v.metadata().shards_metadata if s.shard_sizes[0] > 0})
        n = int(v.metadata().size[0])
        b = tuple(sorted(set(offs) | {0, n}))
        return b
    seg = _segments(flat, p)
    if seg is not None:
        return seg
    if world == 1:
        return (0, int(_local(v, p.key)[0].shape[0]))
    raise ValueRangeError(
        f"value group {p.decl.prefix!r}: cannot tell the row split (no {_SEG} and plain tensors); "
        "save the module's _output_segments_tensor with it"
    )


def _sorted_by_key(keys: np.ndarray, cols: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    if keys.size < 2 or bool(np.all(keys[1:] >= keys[:-1])):
        return keys, cols
    order = np.argsort(keys, kind="stable")
    return keys[order], {n: c[order] for n, c in cols.items()}


def save_value_groups(writer: Any, flat: dict[str, Any], plans: list[Any], rank: int, world_size: int) -> None:
    """Check and write this rank's part of every group (no collectives).

    Raises:
        ValueRangeError: a used raw id or row lies outside this rank's ranges,
            or one appears twice; the message names the tensor.
    """
    for p in plans:
        if isinstance(p, _MCPlan):
            _save_mc(writer, flat, p, rank, world_size)
        else:
            _save_generic(writer, flat, p, rank, world_size)


def _save_mc(writer: Any, flat: dict[str, Any], p: _MCPlan, rank: int, world: int) -> None:
    d = p.decl
    rb = _row_bounds_save(flat, p, world)
    if len(rb) - 1 != world:
        raise ValueRangeError(
            f"value group {d.prefix!r}: {p.segments or p.key} splits the rows over {len(rb) - 1} ranks, "
            f"but {world} ranks save; rebuild the modules for this world size"
        )
    lay = V.MCLayout(int(d.input_size), rb)
    off, hi = lay.rows(rank)
    ilo, ihi = lay.inputs(rank)
    n = rb[-1]
    cols: dict[str, np.ndarray] = {}
    for name in [p.key, p.rows, *p.metadata]:
        t, toff, _ = _local(flat[name], name)
        if t.shape[0] != hi - off or (toff is not None and t.shape[0] and toff != off):
            raise ValueRangeError(
                f"value group {d.prefix!r}: tensor {name!r} holds rows at {toff} of size {t.shape[0]} on "
                f"rank {rank}, but its range is [{off}, {hi})"
            )
        cols[name] = _np(t).astype(np.int64, copy=False)
    keys = cols.pop(p.key)
    keys, cols = _sorted_by_key(keys, cols)
    rows = cols[p.rows]
    used = keys != V.INT64_MAX
    bad = keys[used & ((keys < ilo) | (keys >= ihi))]
    if bad.size:
        raise ValueRangeError(
            f"value group {d.prefix!r}: tensor {p.key!r} on rank {rank} holds raw id {int(bad[0])} outside the "
            f"rank's input range [{ilo}, {ihi}) (input_size {d.input_size}); declare the module's input_size "
            "with xckpt.torch.ManagedCollision(..., input_size=...)"
        )
    badr = rows[(rows < off) | (rows >= hi)]
    if badr.size:
        raise ValueRangeError(
            f"value group {d.prefix!r}: tensor {p.rows!r} on rank {rank} maps to row {int(badr[0])} outside "
            f"the rank's rows [{off}, {hi})"
        )
    for what, arr, nm in (("raw id", keys[used], p.key), ("row", rows, p.rows)):
        s = np.sort(arr)
        dup = s[1:][s[1:] == s[:-1]]
        if dup.size:
            raise ValueRangeError(f"value group {d.prefix!r}: tensor {nm!r} on rank {rank} holds {what} {int(dup[0])} twice")
    rank_by = list(d.rank_by) if d.rank_by is not None else [m for m in (f"{d.prefix}.{c}" if d.prefix else c for c in _RANK_BY) if m in p.metadata]
    members: dict[str, Any] = {
        "rows": p.rows, "metadata": p.metadata, "weight": p.weight, "row_aligned": p.row_aligned,
        "segments": p.segments, "current_iter": p.current_iter,
    }
    attrs = {
        "input_size": int(d.input_size), "input_bounds": list(lay.input_bounds), "row_bounds": list(rb),
        "members": members, "rank_by": rank_by, "miss_row": "last", "version": 1,
    }
    kind = V.MC_KIND
    ann_key = V.annotation(d.prefix, "key", kind, domain=(0, int(d.input_size)), attrs=attrs, empty_marker=V.INT64_MAX)
    all_cols = {p.key: keys, **cols}
    for s, e, vr in V.value_chunks(keys, ilo, ihi, d.chunk_rows):
        for name, arr in all_cols.items():
            ann = ann_key if name == p.key else V.annotation(d.prefix, "rows" if name == p.rows else "metadata", kind)
            writer.write(name, arr[s:e], global_shape=(n,), offset=(off + s,), value_range=ann, chunk_value_range=vr)
    for name in all_cols:
        ann = ann_key if name == p.key else V.annotation(d.prefix, "rows" if name == p.rows else "metadata", kind)
        writer.declare(name, np.int64, (n,), value_range=ann)
    for role, name in [("weight", p.weight)] + [("row_aligned", r) for r in p.row_aligned]:
        if name is None:
            continue
        t, toff, gn = _local(flat[name], name)
        if t.shape[0] != hi - off or (toff is not None and t.shape[0] and toff != off) or (gn is not None and gn != n):
            raise ValueRangeError(
                f"value group {d.prefix!r}: {role} {name!r} holds {t.shape[0]} rows at {toff} on rank {rank}; "
                f"the group's rows there are [{off}, {hi}) of {n}"
            )
        a = _np(t)
        writer.write(
            name, a, global_shape=(n, *a.shape[1:]), offset=(off,) + (0,) * (a.ndim - 1),
            value_range=V.annotation(d.prefix, role, kind),
        )
    if p.current_iter is not None:
        it = _np(_local(flat[p.current_iter], p.current_iter)[0]).reshape(-1)[:1].astype(np.int64)
        writer.write(p.current_iter, it, global_shape=(world,), offset=(rank,), value_range=V.annotation(d.prefix, "current_iter", kind))
    if p.segments is not None:
        seg = _np(_local(flat[p.segments], p.segments)[0]).astype(np.int64)
        ann = V.annotation(d.prefix, "segments", kind)
        if rank == 0:
            writer.write(p.segments, seg, value_range=ann)
        else:
            writer.declare(p.segments, np.int64, seg.shape, value_range=ann)


def _domain(g: ValueGroup) -> tuple[int, int]:
    return (0, int(g.domain)) if isinstance(g.domain, int) else (int(g.domain[0]), int(g.domain[1]))


def _save_generic(writer: Any, flat: dict[str, Any], g: ValueGroup, rank: int, world: int) -> None:
    lo, hi = _domain(g)
    t, toff, gn = _local(flat[g.key], g.key)
    nloc = int(t.shape[0])
    off = toff if toff is not None else rank * nloc
    n = gn if gn is not None else world * nloc
    keys = _np(t)
    if keys.ndim != 1 or keys.dtype.kind not in "iu":
        raise ValueRangeError(f"value group {g.key!r}: the key must be a 1-D integer tensor, got {keys.dtype}{list(keys.shape)}")
    cols = {}
    for c in g.columns:
        ct, coff, _ = _local(flat[c], c)
        if ct.shape[0] != nloc or (coff is not None and nloc and coff != off):
            raise ValueRangeError(f"value group {g.key!r}: column {c!r} is not row-aligned with the key on rank {rank}")
        cols[c] = _np(ct)
    keys_s = keys.astype(np.int64)
    if g.empty_marker is not None:
        keys_s = np.where(keys_s == g.empty_marker, V.INT64_MAX, keys_s)
    order = np.argsort(keys_s, kind="stable")
    keys = keys[order]
    cols = {c: v[order] for c, v in cols.items()}
    used = keys if g.empty_marker is None else keys[keys != g.empty_marker]
    bad = used[(used < lo) | (used >= hi)]
    if bad.size:
        raise ValueRangeError(f"value group {g.key!r}: tensor {g.key!r} on rank {rank} holds key {int(bad[0])} outside the domain [{lo}, {hi})")
    s = np.sort(used)
    dup = s[1:][s[1:] == s[:-1]]
    if dup.size:
        raise ValueRangeError(f"value group {g.key!r}: tensor {g.key!r} on rank {rank} holds key {int(dup[0])} twice")
    attrs = {"input_bounds": [lo, hi], "members": {"columns": list(g.columns)}, "rank_by": list(g.rank_by), "version": 1}
    ann_key = V.annotation(g.key, "key", V.GENERIC_KIND, domain=(lo, hi), attrs=attrs, empty_marker=g.empty_marker)
    ann_col = V.annotation(g.key, "columns", V.GENERIC_KIND)
    all_cols = {g.key: keys, **cols}
    for s0, e0, vr in V.generic_chunks(keys, g.chunk_rows, g.empty_marker):
        for name, arr in all_cols.items():
            writer.write(
                name, arr[s0:e0], global_shape=(n, *arr.shape[1:]), offset=(off + s0,) + (0,) * (arr.ndim - 1),
                value_range=ann_key if name == g.key else ann_col, chunk_value_range=vr,
            )
    for name, arr in all_cols.items():
        writer.declare(name, arr.dtype, (n, *arr.shape[1:]), value_range=ann_key if name == g.key else ann_col)


# -- load -----------------------------------------------------------------------


def _row_bounds_load(flat: Mapping[str, Any], g: V.GroupInfo, rank: int, world: int) -> tuple[int, ...]:
    """The target's row split: ShardedTensor metadata, DTensor chunks, segments, else ceil split."""
    n = g.saved.row_bounds[-1] if g.saved is not None else 0
    names = [x for x in [g.key, g.members.get("weight")] if x is not None and x in flat]
    for name in names:
        v = flat[name]
        if is_sharded_tensor(v):
            b = [0]
            for s in sorted(v.metadata().shards_metadata, key=lambda s: int(s.shard_offsets[0])):
                if int(s.shard_offsets[0]) != b[-1]:
                    raise UnsupportedPlacementError(f"target {name!r}: shards must be row blocks in rank order")
                b.append(b[-1] + int(s.shard_sizes[0]))
            return tuple(b)
        if is_dtensor(v):
            if len(v.placements) != 1 or getattr(v.placements[0], "dim", None) != 0 or v.device_mesh.size() != world:
                raise UnsupportedPlacementError(
                    f"target {name!r}: a value group's DTensors must be Shard(0) on a 1-D mesh of the {world} "
                    f"loading ranks, got {list(v.placements)} on a mesh of {v.device_mesh.size()}"
                )
            return V.ceil_bounds(int(v.shape[0]), world)
    seg_name = g.members.get("segments")
    if seg_name is not None and seg_name in flat:
        seg = _np(_local(flat[seg_name], seg_name)[0]).astype(np.int64)
        valid = tuple(int(x) for x in seg[seg >= 0])
        if len(valid) == world + 1 and valid[-1] == n:
            return valid
    return V.ceil_bounds(n, world)


def _check_target(target: Any, arr: np.ndarray, name: str, where: str) -> torch.Tensor:
    t, _, _ = _local(target, name)
    if tuple(t.shape) != tuple(arr.shape):
        raise ShapeMismatchError(
            f"checkpoint {where!r}, tensor {name!r}: this rank's part has shape {tuple(arr.shape)} at the new "
            f"world size, the target's local tensor {tuple(t.shape)}; build the modules for the new world size "
            "(rebuild_with_output_id_range) before loading"
        )
    return t


def _fill(target: Any, arr: np.ndarray, name: str, where: str) -> None:
    t = _check_target(target, arr, name, where)
    if t.device.type == "cpu":
        dst = as_numpy(t.detach())
        if dst.dtype != arr.dtype:
            arr = arr.astype(dst.dtype)
        np.copyto(dst, arr)
        return
    host = torch.empty(tuple(t.shape), dtype=t.dtype)
    h = as_numpy(host)
    np.copyto(h, arr.astype(h.dtype, copy=False))
    with torch.no_grad():
        t.copy_(host)


def load_value_groups(
    ckpt: Any, flat: dict[str, Any], rank: int, world_size: int, process_group: Any, strict_capacity: bool
) -> tuple[set[str], dict[str, int]]:
    """Fill the group tensors of ``flat`` in place; every rank calls it.

    Nothing is filled unless every rank computed its part: the outcome is
    exchanged first, so a bad checkpoint or (with ``strict_capacity``) an
    overflow raises :class:`ValueRangeError` on every rank.

    Returns:
        (names handled, {group prefix: entries this rank evicted}).
    """
    where = str(ckpt.path)
    tensors = {n: ckpt.info(n) for n in ckpt.names()}
    all_keys = V.groups_in(tensors)
    if not all_keys:  # a pure function of the manifest: every rank returns here alike
        return set(), {}
    keys = [k for k in all_keys if k in flat]
    handled: set[str] = set()
    results: list[tuple[V.GroupInfo, V.RankArrays]] = []
    err: Exception | None = None
    try:
        for key in keys:
            g = V.group_info(tensors, key, where)
            names = [n for n in g.names() if n in flat]
            handled |= set(names)
            if g.kind == V.MC_KIND:
                rb = _row_bounds_load(flat, g, rank, world_size)
                ra = V.read_group_rank(ckpt, key, rank, world_size, row_bounds=rb, names=names, strict_capacity=strict_capacity)
                log.info("value group %r: rank %d of %d loaded by the %s path", g.group, rank, world_size, ra.path)
            else:
                cap = int(_local(flat[key], key)[0].shape[0])
                ra = V.read_group_rank(ckpt, key, rank, world_size, capacity=cap, names=names, strict_capacity=strict_capacity)
            for n, a in ra.arrays.items():
                _check_target(flat[n], a, n, where)
            results.append((g, ra))
    except Exception as e:  # any failure: shared with every rank below (none is left waiting), then re-raised
        err = e
    share_outcome(
        err, group=process_group, world=world_size, error=ValueRangeError,
        what=f"checkpoint {where!r}: loading value groups", fix="Nothing of the groups was loaded",
    )
    evicted: dict[str, int] = {}
    for g, ra in results:
        for n, a in ra.arrays.items():
            _fill(flat[n], a, n, where)
        evicted[g.group] = ra.evicted
        if ra.evicted:
            warnings.warn(
                f"checkpoint {where!r}: value group {g.group!r}: rank {rank} of {world_size} evicted "
                f"{ra.evicted} entries that did not fit (lowest ranked by {list(g.rank_by)}); give the "
                "table more rows or load with strict_capacity=True to make this an error",
                stacklevel=3,
            )
    return handled, evicted


# -- building declarations from torchrec modules ----------------------------------


def managed_collision_groups(
    model: torch.nn.Module,
    optimizer: Any = None,
    *,
    model_key: str | None = None,
    optim_key: str | None = None,
) -> list[ManagedCollision]:
    """Declarations for every torchrec MCH module of ``model`` (plain or ``DistributedModelParallel``).

    Names are as in ``model.state_dict()``; with an ``optimizer`` (a fused
    optimizer whose ``state_dict()["state"]`` is keyed by weight FQN, as DMP's)
    they are as saved in ``{"model": model_sd, "optim": optim_sd}``, and its
    per-row state of each weight is declared row-aligned.

    Args:
        model: a module holding ``MCHManagedCollisionModule``s.
        optimizer: optional fused optimizer (e.g. ``dmp.fused_optimizer``).
        model_key, optim_key: top-level keys (default "model" / "optim" with an
            optimizer, none without).

    Returns:
        One :class:`ManagedCollision` per module, with its input size, weight,
        row-aligned optimizer state and its eviction policy's metadata columns.
    """
    if optimizer is not None:
        model_key = "model" if model_key is None else model_key
        optim_key = "optim" if optim_key is None else optim_key
    sd = model.state_dict()
    prefixes = [k[: -len(_RAW) - 1] for k in sd if k.endswith("." + _RAW)]
    osd = optimizer.state_dict().get("state", {}) if optimizer is not None else {}
    out = []
    for path, mod in model.named_modules():
        if not (hasattr(mod, _RAW) and hasattr(mod, "_input_hash_size")):
            continue
        match = [q for q in prefixes if path == q or path.endswith("." + q) or q.endswith("." + path)]
        if len(match) != 1:
            raise ValueRangeError(f"cannot match MCH module {path!r} to its state dict entries (candidates {match})")
        q = match[0]
        size = mod._input_hash_size
        weight = _weight_by_rule(q, sd)
        n = int(sd[q + "." + _RAW].shape[0]) if hasattr(sd[q + "." + _RAW], "shape") else None
        aligned = []
        if weight is not None and weight in osd:
            for k, v in osd[weight].items():
                shape = v.metadata().size if is_sharded_tensor(v) else getattr(v, "shape", ())
                if len(shape) and int(shape[0]) == n:
                    aligned.append(f"{optim_key}.state.{weight}.{k}")
        mk = f"{model_key}." if model_key else ""
        # eviction metadata of the module's policy, in the policy's order (LFU: counts; LRU: last access)
        infos = getattr(getattr(mod, "_eviction_policy", None), "_metadata_info", None) or []
        rank_by = tuple(f"{mk}{q}._mch_{i.metadata_name}" for i in infos if getattr(i, "is_mch_metadata", False))
        out.append(
            ManagedCollision(
                mk + q,
                weight=None if weight is None else mk + weight,
                input_size=V.INT64_MAX if size is None else int(size),
                row_aligned=tuple(aligned),
                rank_by=rank_by or None,
            )
        )
    return out


# -- redistributing state already in memory ---------------------------------------


def _a2a(send: torch.Tensor, counts: list[int], group: Any) -> tuple[torch.Tensor, list[int]]:
    """all_to_all_single with the split sizes exchanged first."""
    import torch.distributed as dist

    sc = torch.tensor(counts, dtype=torch.int64, device=send.device)
    rc = torch.empty_like(sc)
    dist.all_to_all_single(rc, sc, group=group)
    recv_counts = [int(x) for x in rc.tolist()]
    out = torch.empty((sum(recv_counts), *send.shape[1:]), dtype=send.dtype, device=send.device)
    dist.all_to_all_single(out, send.contiguous(), recv_counts, counts, group=group)
    return out, recv_counts


def redistribute_by_value(
    state: Mapping[str, Any],
    group: ManagedCollision,
    *,
    row_bounds: Sequence[int] | None = None,
    held_row_bounds: Sequence[int] | None = None,
    process_group: Any = None,
    strict_capacity: bool = False,
) -> tuple[dict[str, torch.Tensor], int]:
    """Move a managed-collision group held in memory to a new layout, by value.

    Every rank of ``process_group`` calls it with its current tensors. Entries
    go to the input owner of their raw id and weight rows (and the declared
    row-aligned tensors) follow, with ``all_to_all_single`` (split sizes
    exchanged first); each rank then applies the same steps as the read path
    (:func:`xckpt.value_ranges.assemble_rank`), so the result equals
    ``xckpt.torch.load`` of a checkpoint of the same state.

    Args:
        state: this rank's tensors by name (names as in ``group``); the buffers
            may hold any entries, the weight holds rows ``held_row_bounds[r:r+2]``.
        group: the group declaration (prefix, weight, input size, row-aligned).
        row_bounds: the new row split (default: torchrec's ceil split over the group).
        held_row_bounds: which weight rows each rank holds now (default: the
            state's ``_output_segments_tensor``).
        process_group: gloo on CPU, NCCL on GPU (default: world).
        strict_capacity: raise on every rank instead of evicting.

    Returns:
        (new tensors by name on this rank, entries this rank evicted).

    Raises:
        ValueRangeError: duplicates, or an overflow with ``strict_capacity``.
    """
    import torch.distributed as dist

    p = _mc_plan(state, group)
    world = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    key_t = _local(state[p.key], p.key)[0]
    dev = key_t.device
    held = tuple(held_row_bounds) if held_row_bounds is not None else _segments(state, p)
    if held is None or len(held) != world + 1:
        raise ValueRangeError(f"value group {group.prefix!r}: give held_row_bounds, one range per rank of {world}")
    n = held[-1]
    new = V.MCLayout(int(group.input_size), tuple(row_bounds) if row_bounds is not None else V.ceil_bounds(n, world))
    if len(new.row_bounds) != world + 1 or new.row_bounds[-1] != n:
        raise ShapeMismatchError(f"value group {group.prefix!r}: row_bounds {list(new.row_bounds)} do not split {n} rows over {world} ranks")
    cols = [p.key, p.rows, *p.metadata]
    mat = torch.stack([_local(state[c], c)[0].to(torch.int64).reshape(-1) for c in cols], dim=1)
    mat = mat[mat[:, 0] != V.INT64_MAX]
    owner = torch.from_numpy(new.owner(_np(mat[:, 0]).copy())).to(dev)
    order = torch.argsort(owner, stable=True)
    counts = torch.bincount(owner, minlength=world).tolist()
    got, _ = _a2a(mat[order], counts, process_group)
    g = _np(got)
    err: Exception | None = None
    asm: V.Assembled | None = None
    try:
        asm = V.assemble_rank(
            g[:, 0], g[:, 1], {c: g[:, 2 + i] for i, c in enumerate(p.metadata)}, new, rank,
            list(group.rank_by) if group.rank_by is not None else [c for c in p.metadata if c.rsplit(".", 1)[-1] in _RANK_BY],
            name=p.key, strict_capacity=strict_capacity,
        )
    except Exception as e:  # any failure: shared with every rank, then raised on all
        err = e
    share_outcome(
        err, group=process_group, world=world, error=ValueRangeError,
        what=f"redistribute_by_value of {group.prefix!r}", fix="Nothing was moved",
    )
    if asm is None:  # share_outcome raised for any failure; this guards the type only
        raise ValueRangeError(f"redistribute_by_value of {group.prefix!r}: no assignment was computed")
    out: dict[str, torch.Tensor] = {
        p.key: torch.from_numpy(asm.raw).to(dev),
        p.rows: torch.from_numpy(asm.rows).to(dev),
    }
    out.update({c: torch.from_numpy(asm.meta[c]).to(dev) for c in p.metadata})
    # Weight rows: ask each holder for the rows this rank's new rows come from.
    src = asm.source_rows
    holder = np.searchsorted(np.asarray(held[1:], np.int64), src, side="right")
    r_order = np.argsort(holder, kind="stable")
    r_counts = np.bincount(holder, minlength=world).tolist()
    req, req_counts = _a2a(torch.from_numpy(src[r_order]).to(dev), r_counts, process_group)
    hlo = held[rank]
    for name in [x for x in [p.weight, *p.row_aligned] if x is not None]:
        w = _local(state[name], name)[0]
        reply, _ = _a2a(w[req - hlo], req_counts, process_group)
        res = torch.empty_like(reply)
        res[torch.from_numpy(r_order).to(dev)] = reply
        out[name] = res
    if p.current_iter is not None:
        it = _local(state[p.current_iter], p.current_iter)[0].reshape(-1)[:1].to(torch.int64).clone()
        dist.all_reduce(it, op=dist.ReduceOp.MAX, group=process_group)
        out[p.current_iter] = it
    if p.segments is not None:
        seg_t = _local(state[p.segments], p.segments)[0]
        seg = torch.full(tuple(seg_t.shape), -1, dtype=torch.int64, device=dev)
        seg[: world + 1] = torch.tensor(new.row_bounds, dtype=torch.int64, device=dev)
        out[p.segments] = seg
    return out, asm.evicted
