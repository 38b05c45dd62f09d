"""Target layouts as boxes: what each rank or JAX device of a target would hold.

A load target is either a torch-style description, a dict from tensor names (or
glob patterns) to `(mesh_shape, placements)`, planned per rank (the flattened
mesh coordinate), or a JAX pytree (or flat dict) of shardings or
`ShapeDtypeStruct`s, planned per device. This module turns either into boxes,
from the saved shapes alone; [`xckpt.plan_load`][xckpt.plan_load] and the notebook's
`plot_layout(..., target=...)` are built on it.

JAX pytrees are flattened with `jax.tree_util` (imported when one is given);
nothing here imports a framework at module level.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from xckpt.errors import UnsupportedPlacementError, XckptError
from xckpt.layout import (
    Box,
    MeshBoxes,
    Placement,
    Replicate,
    Shard,
    StridedShard,
    box_from_index,
    mesh_boxes,
    parse_placements,
)
from xckpt.manifest import TensorEntry

__all__ = [
    "Entries",
    "RankBoxes",
    "is_torch_target",
    "fit_placements",
    "torch_target_boxes",
    "jax_target_boxes",
    "target_boxes",
    "key_name",
    "flatten_tree",
    "device_boxes",
]

#: name -> rank (or device id) -> the boxes it holds.
RankBoxes = dict[str, Mapping[int, tuple[Box, ...]]]


class Entries(Protocol):
    """What a target is laid over: tensor names and their entries (any Source)."""

    def names(self) -> list[str]: ...

    def info(self, name: str) -> TensorEntry: ...


def is_torch_target(target: Any) -> bool:
    """A non-empty dict whose values are `(mesh_shape, placements)` pairs."""
    return isinstance(target, Mapping) and bool(target) and all(isinstance(v, (tuple, list)) for v in target.values())


def fit_placements(placements: Sequence[Placement], ndim: int) -> tuple[Placement, ...]:
    """Placements that shard a dim the tensor lacks replicate it instead (0-d tensors, biases)."""
    out: list[Placement] = []
    for p in placements:
        if isinstance(p, (Shard, StridedShard)) and p.dim >= ndim:
            out.append(Replicate())
        else:
            out.append(p)
    return tuple(out)


def torch_target_boxes(src: Entries, target: Mapping[str, Any]) -> RankBoxes:
    """name -> rank -> boxes, for targets given as names/globs -> (mesh_shape, placements)."""
    out: RankBoxes = {}
    # Tensors of one shape and target share their boxes (a model's layers): computed once.
    by_layout: dict[tuple[Any, ...], Mapping[int, tuple[Box, ...]]] = {}
    for name in src.names():
        spec = target.get(name)
        if spec is None:
            spec = next((v for k, v in target.items() if fnmatch.fnmatchcase(name, k)), None)
        if spec is None:
            continue
        try:
            mesh_shape, placements = spec
        except (TypeError, ValueError):
            raise XckptError(
                f"plan target for {name!r} must be (mesh_shape, placements), got {spec!r}"
            ) from None
        mesh_shape = tuple(int(n) for n in mesh_shape)
        if isinstance(placements, str):
            placements = parse_placements(placements)
        if len(placements) != len(mesh_shape):
            raise UnsupportedPlacementError(
                f"plan target for {name!r}: {len(placements)} placements for a mesh of {len(mesh_shape)} axes"
            )
        shape = src.info(name).shape
        fitted = fit_placements(placements, len(shape))
        layout = (tuple(shape), mesh_shape, fitted)
        per = by_layout.get(layout)
        if per is None and MeshBoxes.fits(shape, mesh_shape, fitted):
            per = by_layout[layout] = MeshBoxes(shape, mesh_shape, fitted)  # (boxes built when asked for)
        if per is None:
            by_coord = mesh_boxes(shape, mesh_shape, fitted)
            strides = [math.prod(mesh_shape[i + 1 :]) for i in range(len(mesh_shape))]
            per = by_layout[layout] = {
                sum(c * s for c, s in zip(coord, strides)): boxes for coord, boxes in by_coord.items()
            }
        out[name] = per
    return out


def key_name(path: Sequence[Any]) -> str:
    """A jax key path as a dotted name (`params.layers.0.kernel`)."""
    import jax

    tu = jax.tree_util
    parts = []
    for k in path:
        if isinstance(k, tu.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, tu.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, tu.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, tu.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return ".".join(parts)


def flatten_tree(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """`[(name, leaf)]` of a JAX pytree in tree order, and the treedef to rebuild it.

    Shardings and ShapeDtypeStructs are leaves. A bare leaf (not a container)
    gets the name `""`.

    Raises:
        UnsupportedPlacementError: two leaves have the same dotted name.
    """
    import jax

    def is_leaf(x: Any) -> bool:
        return isinstance(x, (jax.sharding.Sharding, jax.ShapeDtypeStruct))

    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    named = [(key_name(path), leaf) for path, leaf in leaves]
    seen: dict[str, int] = {}
    for n, _ in named:
        seen[n] = seen.get(n, 0) + 1
    dup = sorted(n for n, c in seen.items() if c > 1)
    if dup:
        raise UnsupportedPlacementError(
            f"pytree leaves {dup[:5]} have the same dotted name (a key contains '.'?); "
            "rename the keys so every leaf has its own name"
        )
    return named, treedef


def device_boxes(sharding: Any, shape: tuple[int, ...], name: str, *, addressable: bool) -> dict[Any, Box]:
    """The box each device (all, or this process's) of a JAX `sharding` holds of `shape`.

    Raises:
        UnsupportedPlacementError: the sharding cannot hold `shape` (e.g. a dim
            not divisible by the mesh axes that split it).
    """
    try:
        if addressable:
            m = sharding.addressable_devices_indices_map(shape)
        else:
            m = sharding.devices_indices_map(shape)
    except ValueError as e:
        raise UnsupportedPlacementError(
            f"tensor {name!r}: sharding {sharding} cannot lay out shape {tuple(shape)}: {e}. "
            "JAX has no uneven or empty shards; choose a sharding whose mesh axes divide the "
            "dims they split (or a replicated one)"
        ) from None
    return {d: box_from_index(shape, idx) for d, idx in m.items()}


def jax_target_boxes(src: Entries, target: Any) -> RankBoxes:
    """name -> device id -> boxes, for a JAX pytree of shardings or `ShapeDtypeStruct`s."""
    import jax

    named, _ = flatten_tree(target)
    out: RankBoxes = {}
    for name, leaf in named:
        if isinstance(leaf, jax.sharding.Sharding):
            sharding = leaf
        elif getattr(leaf, "sharding", None) is not None:
            sharding = leaf.sharding
        else:
            continue  # objects and host leaves are not device loads
        shape = src.info(name).shape
        per: dict[int, set[Box]] = {}
        for dev, box in device_boxes(sharding, tuple(shape), name, addressable=False).items():
            per.setdefault(dev.id, set()).add(box)
        out[name] = {d: tuple(sorted(b, key=lambda x: x.offset)) for d, b in per.items()}
    return out


def target_boxes(src: Entries, target: Any) -> tuple[str, RankBoxes]:
    """`("torch", boxes by rank)` or `("jax", boxes by device)` for any target."""
    if is_torch_target(target):
        return "torch", torch_target_boxes(src, target)
    return "jax", jax_target_boxes(src, target)
