"""Propose a NamedSharding equivalent to a saved placement (torch or JAX).

The mapping follows REFERENCE.md section 4: a mesh axis a placement does not
shard is replicated; `Shard(d)` on several mesh dims nests left to right, so
it becomes a tuple of axes in mesh order on dim `d`; FSDP2's
`(_StridedShard(d, sf), ..., Shard(d))` (TP first, then FSDP) becomes the
reversed tuple. There is no equivalent for uneven splits (JAX has no uneven
or empty shards), for strided shards outside the FSDP2 pattern (a device would
hold several disjoint boxes) and for `Partial`. Then
[`UnsupportedPlacementError`][xckpt.errors.UnsupportedPlacementError] says why; loading with a
replicated or any other sharding still works, because loading follows the
saved chunks, never the placement.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from xckpt.errors import UnsupportedPlacementError
from xckpt.layout import Partial, Replicate, Shard, StridedShard, format_placement, parse_placement
from xckpt.manifest import PlacementInfo, TensorEntry

__all__ = ["sharding_for"]

_FIX = (
    "Load it with a replicated sharding (NamedSharding(mesh, PartitionSpec())) or a sharding of "
    "your own whose mesh axes divide the dims they split; xckpt reassembles any target layout "
    "from the saved chunks"
)


def _what(name: str | None, placement: PlacementInfo) -> str:
    pl = placement.placements if placement.framework == "torch" else placement.partition_spec
    t = f"tensor {name!r}" if name else "a tensor"
    return f"{t} saved by {placement.framework} as {list(pl or ())} on mesh {placement.mesh_shape}"


def _resolve_axes(
    placement: PlacementInfo,
    mesh: Mesh,
    axis_names: Sequence[str | None] | Mapping[Any, str | None] | None,
    what: str,
) -> list[str | None]:
    """For every saved mesh dim, the target mesh axis (None: not sharded there)."""
    n = len(placement.mesh_shape)
    saved = list(placement.axis_names) if placement.axis_names else [None] * n
    target = [str(a) for a in mesh.axis_names]
    if axis_names is None:
        if saved and all(s is not None and s in target for s in saved):
            out: list[str | None] = list(saved)
        elif len(target) == n:
            out = list(target)
        else:
            raise UnsupportedPlacementError(
                f"{what}: its mesh dims {saved} do not match the target mesh axes {target}; pass "
                "axis_names=[target axis or None for each saved mesh dim]"
            )
    elif isinstance(axis_names, Mapping):
        out = []
        for k in range(n):
            key = saved[k] if saved[k] in axis_names else k
            if key not in axis_names:
                raise UnsupportedPlacementError(
                    f"{what}: axis_names={dict(axis_names)} does not say where saved mesh dim {k} "
                    f"({saved[k]!r}) goes; map it to a target axis or None"
                )
            out.append(axis_names[key])
    else:
        out = list(axis_names)
        if len(out) != n:
            raise UnsupportedPlacementError(
                f"{what}: axis_names has {len(out)} entries for {n} saved mesh dims"
            )
    used = [a for a in out if a is not None]
    bad = [a for a in used if a not in target]
    if bad or len(set(used)) != len(used):
        raise UnsupportedPlacementError(
            f"{what}: axis_names {out} must name distinct axes of the target mesh {target}"
        )
    return out


def _torch_dims(placement: PlacementInfo, ndim: int, what: str) -> list[list[int]]:
    """For each tensor dim, the saved mesh dims splitting it, outermost first."""
    pls = [parse_placement(p) for p in placement.placements or ()]
    if len(pls) != len(placement.mesh_shape):
        raise UnsupportedPlacementError(
            f"{what}: {len(pls)} placements for a {len(placement.mesh_shape)}-d mesh"
        )
    plain: list[list[int]] = [[] for _ in range(ndim)]
    strided: list[list[int]] = [[] for _ in range(ndim)]
    for m, p in enumerate(pls):
        if isinstance(p, Replicate):
            continue
        if isinstance(p, Partial):
            raise UnsupportedPlacementError(
                f"{what}: Partial on mesh dim {m} has no sharding equivalent. " + _FIX
            )
        if not 0 <= p.dim < ndim:
            raise UnsupportedPlacementError(f"{what}: {format_placement(p)} names a dim the tensor lacks")
        if isinstance(p, Shard):
            plain[p.dim].append(m)
            continue
        if not isinstance(p, StridedShard):
            raise UnsupportedPlacementError(f"{what}: unknown placement {p!r}")
        later = [
            k for k in range(m + 1, len(pls)) if isinstance(pk := pls[k], Shard) and pk.dim == p.dim
        ]
        sf = math.prod(placement.mesh_shape[k] for k in later)
        if not later or sf != p.split_factor:
            raise UnsupportedPlacementError(
                f"{what}: _StridedShard({p.dim}, sf={p.split_factor}) on mesh dim {m} is not "
                "FSDP2's TP-then-FSDP pattern (a later Shard of the same dim whose mesh sizes "
                "multiply to sf), so a device would hold several disjoint boxes, which a "
                "NamedSharding cannot express. " + _FIX
            )
        strided[p.dim].append(m)
    # FSDP2 stores TP's split first, then its own: strided axes are the inner ones.
    return [plain[d] + strided[d] for d in range(ndim)]


def _jax_dims(placement: PlacementInfo, ndim: int, what: str) -> list[list[int]]:
    names = list(placement.axis_names or ())
    spec = list(placement.partition_spec or ())
    if len(spec) > ndim:
        raise UnsupportedPlacementError(f"{what}: partition spec has {len(spec)} entries for {ndim} dims")
    out: list[list[int]] = [[] for _ in range(ndim)]
    for d, e in enumerate(spec):
        axes = [] if e is None else [e] if isinstance(e, str) else list(e)
        for a in axes:
            if a not in names:
                raise UnsupportedPlacementError(f"{what}: spec names axis {a!r} not in {names}")
            out[d].append(names.index(a))
    return out


def sharding_for(
    info: TensorEntry | PlacementInfo | None,
    mesh: Mesh,
    *,
    axis_names: Sequence[str | None] | Mapping[Any, str | None] | None = None,
    shape: Sequence[int] | None = None,
) -> NamedSharding:
    """A NamedSharding on `mesh` equivalent to a tensor's saved placement.

    Args:
        info: `checkpoint.info(name)` (a TensorEntry), or its PlacementInfo.
            A tensor saved without placement (a plain tensor or numpy array)
            maps to a replicated sharding.
        mesh: the target mesh.
        axis_names: where each saved mesh dim goes on `mesh`: a list with a
            target axis name (or None: not sharded) per saved mesh dim, or a
            mapping from saved axis name (or index) to target axis. Default:
            the saved axis names when `mesh` has them all, else position
            when `mesh` has as many axes as the saved mesh.
        shape: the global shape, to check divisibility (taken from a TensorEntry).

    Returns:
        `NamedSharding(mesh, PartitionSpec(...))` with one entry per dim, e.g.
        `Shard(0)` on mesh dim "tp" -> `P("tp", None)`; `(Shard(0),
        Shard(0))` on ("dp", "tp") -> `P(("dp", "tp"), None)`.

    Raises:
        UnsupportedPlacementError: no NamedSharding holds the same layout
            (uneven split on the target mesh, a strided shard that is not
            FSDP2's, Partial) or the axes cannot be mapped. The message says
            why; load with a replicated or own sharding instead.
    """
    name = None
    if isinstance(info, TensorEntry):
        name, shape, placement = info.name, info.shape, info.placement
    else:
        placement = info
    if placement is None:
        return NamedSharding(mesh, P())
    if shape is None:
        if placement.framework == "jax" and placement.partition_spec is not None:
            ndim = len(placement.partition_spec)
        else:
            pls = [parse_placement(p) for p in placement.placements or ()]
            ndim = 1 + max((p.dim for p in pls if isinstance(p, (Shard, StridedShard))), default=-1)
    else:
        ndim = len(shape)
    what = _what(name, placement)
    if placement.framework == "torch" and placement.placements is None:
        raise UnsupportedPlacementError(
            f"{what}: it was saved as a {placement.layout or 'torch'} tensor without DTensor "
            "placements, so there is no placement to translate. " + _FIX
        )
    if placement.framework == "torch":
        dims = _torch_dims(placement, ndim, what)
    elif placement.framework == "jax":
        dims = _jax_dims(placement, ndim, what)
    else:
        raise UnsupportedPlacementError(f"{what}: unknown framework {placement.framework!r}. " + _FIX)
    axes = _resolve_axes(placement, mesh, axis_names, what)
    sizes = dict(zip((str(a) for a in mesh.axis_names), mesh.devices.shape))
    entries: list[Any] = []
    for d, ms in enumerate(dims):
        names = [a for m in ms if (a := axes[m]) is not None]
        if shape is not None and names:
            n = math.prod(sizes[a] for a in names)
            if shape[d] % n:
                raise UnsupportedPlacementError(
                    f"{what}: dim {d} of size {shape[d]} does not split evenly over mesh axes "
                    f"{tuple(names)} ({n} ways) of the target mesh, and JAX has no uneven or "
                    "empty shards, so no NamedSharding is equivalent. " + _FIX
                )
        entries.append(None if not names else names[0] if len(names) == 1 else tuple(names))
    return NamedSharding(mesh, P(*entries))
