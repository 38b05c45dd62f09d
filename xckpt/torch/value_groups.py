"""Value groups in the PyTorch adapter: tensors to numpy, collectives, torchrec introspection.

The value-group logic is the core's (`xckpt.values.ranges`: the annotation
model and read plans; `xckpt.values.save`: save plans;
`xckpt.values.load`: the read driver). This module finds the groups of a
state dict (declared, or torchrec MCH buffers by name), turns their tensors
into numpy (local shard and row offset of plain tensors, ShardedTensors and
DTensors), reads the target's row split off the torch targets, shares the
outcome between ranks and fills the targets.

Call protocol (the adapter's `save` / `load` make these calls, on every rank):

1. `save`: `split_value_groups` (no I/O, no collectives) finds the groups
   and returns their resolved names (`MCNames` / [`ValueGroup`][xckpt.torch.value_groups.ValueGroup]) and
   the flat names they own; the adapter saves everything else. Then
   `save_value_groups` builds each group's annotation, has the core plan
   this rank's part and writes it through the rank's [`xckpt.Writer`][xckpt.Writer]
   (no collectives).
2. `load`: `load_value_groups` finds the groups of the checkpoint whose
   key tensor the caller asks for, has the core plan and read every group
   tensor of this rank, exchanges the outcome with the other ranks (one
   `all_gather_object`), and only when every rank succeeded fills the
   targets in place. It returns the names it handled and
   `{group prefix: entries this rank evicted}`.

Declaring groups (names as in the saved state dict):

    xckpt.torch.save(sd, path, value_groups=[
        ManagedCollision("mc", weight="emb.weight", input_size=2**20, row_aligned=["mom"]),
        ValueGroup("cache.keys", domain=10**6, columns=["cache.vals"], empty_marker=-1),
    ])
    xckpt.torch.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}, path,
                     value_groups=managed_collision_groups(dmp, dmp.fused_optimizer))

torchrec MCH buffers under `..._managed_collision_modules.<t>.` are found
without a declaration (input size 2**63-1, weight by torchrec's name rule, no
row-aligned tensors). Loading needs no declaration: the manifest has it all.
Moving a group held in memory is [`xckpt.torch.redistribute.redistribute_by_value`][xckpt.torch.redistribute.redistribute_by_value].

Group tensors may be plain per-rank tensors (each rank's own rows), row-wise
`ShardedTensor`s (`DistributedModelParallel` state dicts) or DTensors
sharded on dim 0; the local shard and its offset are used. The on-disk layout
and the decisions behind it are in `xckpt.values.ranges`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from xckpt.errors import ShapeMismatchError, UnsupportedPlacementError, ValueRangeError
from xckpt.source import Source
from xckpt.torch._dist import share_outcome
from xckpt.torch._dtypes import as_numpy
from xckpt.torch._placement import dtensor_local, is_dtensor, is_sharded_tensor
from xckpt.values import ranges as V
from xckpt.values import save as V_save
from xckpt.values.load import RankArrays, load_rank

__all__ = [
    "ManagedCollision",
    "ValueGroup",
    "managed_collision_groups",
    "MCNames",
    "resolve_managed_collision",
    "local_rows",
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
RANK_BY = ("_mch_counts", "_mch_last_access_iter")


@dataclass(frozen=True)
class ManagedCollision:
    """Declares a torchrec managed-collision module's state as a value group.

    Args:
        prefix: the module's buffers' prefix as saved (names `prefix._mch_...`),
            with or without the trailing "." state-dict keys show; stored without it.
        weight: the embedding weight's name (default: torchrec's name rule).
        input_size: the module's `input_hash_size` (torchrec's default 2**63-1).
        row_aligned: names of tensors row-aligned with the weight (row-wise
            optimizer state), moved with re-slotted rows.
        rank_by: eviction columns in priority order (default: `_mch_counts`
            then `_mch_last_access_iter`, those present).
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
    """A generic value group: rows go to the rank whose block of `domain` holds their key.

    Args:
        key: name of the key tensor (one dimension, integer).
        domain: `(lo, hi)` or `hi` of the key values.
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
class MCNames:
    decl: ManagedCollision
    key: str
    rows: str
    metadata: list[str]
    weight: str | None
    row_aligned: list[str]
    segments: str | None
    current_iter: str | None

    def members(self) -> V.Members:
        return V.Members(
            rows=self.rows, metadata=tuple(self.metadata), weight=self.weight, row_aligned=tuple(self.row_aligned),
            segments=self.segments, current_iter=self.current_iter,
        )

    def rank_by(self) -> tuple[str, ...]:
        """The declared eviction columns, else torchrec's LFU/LRU columns the state holds."""
        d = self.decl
        if d.rank_by is not None:
            return tuple(d.rank_by)
        pre = f"{d.prefix}." if d.prefix else ""
        return tuple(m for m in (pre + c for c in RANK_BY) if m in self.metadata)

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


def resolve_managed_collision(flat: Mapping[str, Any], d: ManagedCollision) -> MCNames:
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
    return MCNames(
        d, key, pre + _ROWS, meta, weight, list(d.row_aligned),
        pre + _SEG if pre + _SEG in flat else None, pre + _ITER if pre + _ITER in flat else None,
    )


def split_value_groups(flat: dict[str, Any], value_groups: Sequence[Any] | None) -> tuple[list[Any], set[str]]:
    """Plans of the declared groups plus torchrec MCH modules found by name.

    Returns:
        (plans, names of `flat` the groups own; the adapter does not save those).

    Raises:
        ValueRangeError: a declaration names tensors the state dict lacks.
    """
    plans: list[Any] = []
    seen: set[str] = set()
    for d in value_groups or ():
        if isinstance(d, ManagedCollision):
            plans.append(resolve_managed_collision(flat, d))
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
                plans.append(resolve_managed_collision(flat, ManagedCollision(prefix)))
                seen.add(prefix)
    owned: set[str] = set()
    for p in plans:
        new = p.owned() if isinstance(p, MCNames) else {p.key, *p.columns}
        if owned & new:
            raise ValueRangeError(f"tensors {sorted(owned & new)} belong to two value groups")
        owned |= new
    return plans, owned


# -- local views --------------------------------------------------------------


def local_tensor(v: Any, name: str) -> tuple[torch.Tensor, int | None, int | None]:
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


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return as_numpy(t.detach().cpu())


def local_rows(v: Any, name: str) -> V_save.LocalRows:
    """This rank's rows of a member as numpy, with their global offset and row count."""
    t, off, n = local_tensor(v, name)
    return V_save.LocalRows(to_numpy(t), off, n)


def segment_bounds(flat: Mapping[str, Any], p: MCNames) -> tuple[int, ...] | None:
    if p.segments is None:
        return None
    seg = to_numpy(local_tensor(flat[p.segments], p.segments)[0]).astype(np.int64)
    return tuple(int(x) for x in seg[seg >= 0])


def _row_bounds_save(flat: Mapping[str, Any], p: MCNames, world: int) -> tuple[int, ...]:
    v = flat[p.key]
    if is_sharded_tensor(v):
        offs = sorted({int(s.shard_offsets[0]) for s in v.metadata().shards_metadata if s.shard_sizes[0] > 0})
        n = int(v.metadata().size[0])
        b = tuple(sorted(set(offs) | {0, n}))
        return b
    seg = segment_bounds(flat, p)
    if seg is not None:
        return seg
    if world == 1:
        return (0, int(local_tensor(v, p.key)[0].shape[0]))
    raise ValueRangeError(
        f"value group {p.decl.prefix!r}: cannot tell the row split (no {_SEG} and plain tensors); "
        "save the module's _output_segments_tensor with it"
    )


def save_value_groups(writer: Any, flat: dict[str, Any], plans: list[Any], rank: int, world_size: int) -> None:
    """Check and write this rank's part of every group (no collectives).

    Each group's annotation and save plan come from the core
    (`xckpt.values.save`); this only turns the members into numpy.

    Raises:
        ValueRangeError: a used raw id or row lies outside this rank's ranges,
            or one appears twice; the message names the tensor.
    """
    for p in plans:
        if isinstance(p, MCNames):
            ann = _mc_annotation(flat, p, world_size)
            local = {n: local_rows(flat[n], n) for n in ann.names()}
            plan, arrays = V_save.plan_mc_save(ann, rank, local, p.decl.chunk_rows)
        else:
            lo, hi = (0, int(p.domain)) if isinstance(p.domain, int) else (int(p.domain[0]), int(p.domain[1]))
            ann = V.GroupAnnotation.generic(
                p.key, (lo, hi), list(p.columns), empty_marker=p.empty_marker, rank_by=list(p.rank_by)
            )
            local = {n: local_rows(flat[n], n) for n in ann.names()}
            plan, arrays = V_save.plan_generic_save(ann, rank, world_size, local, p.chunk_rows)
        V_save.write_group(writer, plan, arrays)


def _mc_annotation(flat: Mapping[str, Any], p: MCNames, world: int) -> V.GroupAnnotation:
    d = p.decl
    rb = _row_bounds_save(flat, p, world)
    if len(rb) - 1 != world:
        raise ValueRangeError(
            f"value group {d.prefix!r}: {p.segments or p.key} splits the rows over {len(rb) - 1} ranks, "
            f"but {world} ranks save; rebuild the modules for this world size"
        )
    return V.GroupAnnotation.managed_collision(
        d.prefix, p.key, p.members(), input_size=int(d.input_size), row_bounds=rb, rank_by=p.rank_by()
    )


# -- load -----------------------------------------------------------------------


def _row_bounds_load(flat: Mapping[str, Any], g: V.GroupAnnotation, world: int) -> tuple[int, ...]:
    """The target's row split: ShardedTensor metadata, DTensor chunks, segments, else ceil split."""
    n = g.saved.row_bounds[-1] if g.saved is not None else 0
    names = [x for x in [g.key, *g.members.of("weight")] if x in flat]
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
    seg_name = g.members.segments
    if seg_name is not None and seg_name in flat:
        seg = to_numpy(local_tensor(flat[seg_name], seg_name)[0]).astype(np.int64)
        valid = tuple(int(x) for x in seg[seg >= 0])
        if len(valid) == world + 1 and valid[-1] == n:
            return valid
    return V.ceil_bounds(n, world)


def _check_target(target: Any, arr: np.ndarray, name: str, where: str) -> torch.Tensor:
    t, _, _ = local_tensor(target, name)
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
    ckpt: Source, flat: dict[str, Any], rank: int, world_size: int, process_group: Any, strict_capacity: bool
) -> tuple[set[str], dict[str, int]]:
    """Fill the group tensors of `flat` in place; every rank calls it.

    For each group whose key the caller asks for: the annotation is checked
    once, the target's row split read off the torch targets, and the core
    plans (`xckpt.values.ranges.plan_rank_read`) and reads
    (`xckpt.values.load.load_rank`) this rank's arrays. Nothing is filled
    unless every rank computed its part: the outcome is exchanged first
    (`xckpt.torch._dist.share_outcome`), so a bad checkpoint or (with
    `strict_capacity`) an overflow raises [`ValueRangeError`][xckpt.torch.value_groups.ValueRangeError] on every rank.

    Returns:
        (names handled, {group prefix: entries this rank evicted}).
    """
    where = str(ckpt.path)
    tensors = {n: ckpt.info(n) for n in ckpt.names()}
    all_keys = V.group_keys(tensors)
    if not all_keys:  # a pure function of the manifest: every rank returns here alike
        return set(), {}
    keys = [k for k in all_keys if k in flat]
    handled: set[str] = set()
    results: list[tuple[V.GroupAnnotation, RankArrays]] = []
    err: Exception | None = None
    try:
        for key in keys:
            g = V.GroupAnnotation.from_manifest(tensors, key, where)
            names = [n for n in g.names() if n in flat]
            handled |= set(names)
            if g.kind == V.MC_KIND:
                rb = _row_bounds_load(flat, g, world_size)
                plan = V.plan_rank_read(g, tensors[key], rank, world_size, row_bounds=rb, names=names)
            else:
                cap = int(local_tensor(flat[key], key)[0].shape[0])
                plan = V.plan_rank_read(g, tensors[key], rank, world_size, capacity=cap, names=names)
            ra = load_rank(ckpt, plan, strict_capacity=strict_capacity)
            log.info("value group %r: rank %d of %d loaded by the %s path: %s", g.group, rank, world_size,
                     plan.path, plan.reason)
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
    """Declarations for every torchrec MCH module of `model` (plain or `DistributedModelParallel`).

    Names are as in `model.state_dict()`; with an `optimizer` (a fused
    optimizer whose `state_dict()["state"]` is keyed by weight FQN, as DMP's)
    they are as saved in `{"model": model_sd, "optim": optim_sd}`, and its
    per-row state of each weight is declared row-aligned.

    Args:
        model: a module holding `MCHManagedCollisionModule`s.
        optimizer: optional fused optimizer (e.g. `dmp.fused_optimizer`).
        model_key, optim_key: top-level keys (default "model" / "optim" with an
            optimizer, none without).

    Returns:
        One [`ManagedCollision`][xckpt.torch.value_groups.ManagedCollision] per module, with its input size, weight,
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
                shape: Sequence[int] = v.metadata().size if is_sharded_tensor(v) else getattr(v, "shape", ())
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
