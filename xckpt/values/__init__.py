"""Value groups: state partitioned by the values it holds (DESIGN.md section 4).

The framework-free core of value-aware resharding, one module a job:

* `ranges`: the annotation model and the pure arithmetic (owners, row
  ranges, the managed-collision redistribution, read plans);
* [`save`][xckpt.save]: what a saving rank writes under which annotation;
* [`load`][xckpt.load]: the read driver that gives a rank at W' its rows by value.

The torch and JAX adapters (`xckpt.torch.value_groups`,
`xckpt.jax`) add only tensors, collectives and torchrec introspection.
"""

from __future__ import annotations

from xckpt.values import load, ranges, save
from xckpt.values.ranges import GroupAnnotation, MCLayout, Members

__all__ = ["GroupAnnotation", "MCLayout", "Members", "load", "ranges", "save"]
