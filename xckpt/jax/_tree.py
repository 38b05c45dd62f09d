"""Pytree names, device boxes and placement provenance for the JAX adapter.

Names are key paths joined with ``"."``: ``{"params": {"layers": [{"kernel": x}]}}``
names ``x`` ``params.layers.0.kernel``, the same string a torch FQN would be, so
checkpoints line up across frameworks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, Sharding

from xckpt.errors import UnsupportedPlacementError
from xckpt.layout import Box, box_from_index
from xckpt.manifest import PlacementInfo

__all__ = ["key_name", "flatten", "device_boxes", "placement_info", "spec_entries"]


def key_name(path: Sequence[Any]) -> str:
    """A jax key path as a dotted name (``params.layers.0.kernel``)."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return ".".join(parts)


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (Sharding, jax.ShapeDtypeStruct))


def flatten(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """``[(name, leaf)]`` in tree order, and the treedef to rebuild the tree.

    Shardings and ShapeDtypeStructs are leaves. A bare leaf (not a container)
    gets the name ``""``.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
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


def device_boxes(
    sharding: Sharding, shape: tuple[int, ...], name: str, *, addressable: bool
) -> dict[Any, Box]:
    """The box each device (all, or this process's) holds of an array of ``shape``.

    Raises:
        UnsupportedPlacementError: the sharding cannot hold ``shape`` (e.g. a dim
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


def spec_entries(spec: Any, ndim: int) -> tuple[Any, ...]:
    """A PartitionSpec padded to ``ndim`` entries, each None, a str, or a tuple of str."""
    out: list[Any] = []
    for e in tuple(spec):
        if e is None or isinstance(e, str):
            out.append(e)
        else:
            axes = tuple(e)
            out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    out.extend([None] * (ndim - len(out)))
    return tuple(out)


def placement_info(sharding: Sharding, ndim: int) -> PlacementInfo | None:
    """Provenance for a NamedSharding (mesh shape, axis names, partition spec)."""
    if not isinstance(sharding, NamedSharding):
        return None
    mesh = sharding.mesh
    return PlacementInfo(
        framework="jax",
        mesh_shape=tuple(int(s) for s in mesh.devices.shape),
        axis_names=tuple(str(a) for a in mesh.axis_names),
        partition_spec=spec_entries(sharding.spec, ndim),
    )
