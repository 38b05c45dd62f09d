"""State dicts as flat names: nested dicts, lists and tuples joined with ".".

The torch counterpart of :mod:`xckpt.jax._tree`: :func:`flatten` names every
leaf and remembers where it sits (:class:`Slot`) so a load can put objects back;
:class:`PerRank` marks a value that differs between ranks. No collectives, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from xckpt.errors import XckptError

__all__ = ["PerRank", "Slot", "flatten", "iter_tensor_names"]


@dataclass
class PerRank:
    """Wrap a non-tensor value that differs between ranks (e.g. a data-loader state).

    On save each rank's own ``value`` is stored. On load, a ``PerRank`` placeholder
    receives ``PerRank(<this rank's saved value>)``; at another world size that is
    an error unless the placeholder is ``PerRank(all_ranks=True)``, which receives
    ``PerRank([value of rank 0, value of rank 1, ...], all_ranks=True)``.
    """

    value: Any = None
    all_ranks: bool = False


@dataclass
class Slot:
    """Where a flattened leaf lives in the caller's structure (to put objects back)."""

    container: Any
    key: Any


def _holds_tensor(v: Any) -> bool:
    if isinstance(v, (torch.Tensor, np.ndarray)):
        return True
    if isinstance(v, Mapping):
        return any(_holds_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_holds_tensor(x) for x in v)
    return False


def flatten(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Slot]]:
    """Flatten nested dicts to "."-joined names (keys via ``str``).

    Dicts, lists and tuples are flattened (lists by index) only when they hold a
    tensor somewhere inside; otherwise they are one leaf (an object), like every
    other non-tensor value. The same rule applied to the caller's structure on
    load gives the same names.

    Returns:
        ``(leaves by name, slot by name)``.

    Raises:
        XckptError: two paths flatten to the same name.
    """
    leaves: dict[str, Any] = {}
    slots: dict[str, Slot] = {}

    def walk(prefix: str, container: Any, key: Any, v: Any) -> None:
        if isinstance(v, Mapping) and _holds_tensor(v):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v, k, x)
            return
        if isinstance(v, (list, tuple)) and _holds_tensor(v):
            for i, x in enumerate(v):
                walk(f"{prefix}.{i}" if prefix else str(i), v, i, x)
            return
        if prefix in leaves:
            raise XckptError(
                f"two entries of the state dict flatten to the name {prefix!r} (a key that "
                "contains '.' next to a nested dict); rename one of them"
            )
        leaves[prefix] = v
        slots[prefix] = Slot(container, key)

    if not isinstance(state, Mapping):
        raise XckptError(f"state_dict must be a dict, got {type(state).__name__}")
    for k, v in state.items():
        walk(str(k), state, k, v)
    return leaves, slots


def iter_tensor_names(leaves: Mapping[str, Any]) -> Iterator[str]:
    for n, v in leaves.items():
        if isinstance(v, (torch.Tensor, np.ndarray)):
            yield n
