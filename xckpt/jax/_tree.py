"""Pytree names, device boxes and placement provenance for the JAX adapter.

Names and device boxes are the framework-free `xckpt.targets` functions
(`plan_load` lays JAX targets out with the same code); provenance is here.

Names are key paths joined with `"."`: `{"params": {"layers": [{"kernel": x}]}}`
names `x` `params.layers.0.kernel`, the same string a torch FQN would be, so
checkpoints line up across frameworks.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import NamedSharding, Sharding

from xckpt.manifest import PlacementInfo
from xckpt.targets import device_boxes, key_name
from xckpt.targets import flatten_tree as flatten

__all__ = ["key_name", "flatten", "device_boxes", "placement_info", "spec_entries"]


def spec_entries(spec: Any, ndim: int) -> tuple[Any, ...]:
    """A PartitionSpec padded to `ndim` entries, each None, a str, or a tuple of str."""
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
