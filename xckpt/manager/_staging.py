"""Host buffers a manager owns and reuses across saves: its staging memory.

A :class:`HostBuffers` is a pool of host arrays by key (a tensor's name and box).
The adapters' ``save(..., staging=buffers)`` (``xckpt.torch.save``,
``xckpt.jax.save``) and :func:`stage_mapping` (numpy mappings) copy the state into
it instead of allocating host copies per save; the pool itself knows nothing of
frameworks: the adapter passes an ``alloc`` that makes the buffer (pinned memory for
a CUDA tensor), and the pool keeps it while the state keeps its shape and dtype.

Call protocol of one save (one thread; the manager runs at most one save at a time,
and every adapter waits for the previous background write before staging, so a
buffer is never refilled while a write still reads it):

1. ``begin()``;
2. ``take(key, shape, dtype, alloc)`` once per box staged: the buffer of the last
   save when ``shape`` and ``dtype`` are unchanged, else a new one from ``alloc()``
   (the old one released first);
3. ``end()``: buffers of keys this save did not take are released, so the pool holds
   at most one copy of the state as it is now.

``device_copy`` (optional) is the hook ``xckpt.torch.save`` calls to copy a tensor
into its host buffer, ``device_copy(host, tensor) -> event or None``; the writer
waits for each event (``event.synchronize()``) before it reads the buffer. Default:
CUDA tensors are copied on a side stream (:mod:`xckpt.torch._staging`). Tests
inject a hook to check that logic on CPU.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import numpy as np

__all__ = ["HostBuffers", "stage_mapping"]


class HostBuffers:
    """A pool of host buffers by key, reused while shape and dtype stay the same.

    Attributes:
        device_copy: the hook ``xckpt.torch.save`` copies tensors with (see the module).
        allocations: buffers allocated so far (a save that reuses every buffer adds none).
    """

    def __init__(self, device_copy: Callable[[Any, Any], Any] | None = None) -> None:
        self.device_copy = device_copy
        self.allocations = 0
        self._slots: dict[Hashable, tuple[tuple[int, ...], Hashable, Any]] = {}
        self._taken: set[Hashable] = set()

    def begin(self) -> None:
        """Start staging one save."""
        self._taken = set()

    def take(self, key: Hashable, shape: tuple[int, ...], dtype: Hashable, alloc: Callable[[], Any]) -> Any:
        """The buffer for ``key``: the previous save's if ``shape`` and ``dtype`` match, else new."""
        slot = self._slots.get(key)
        if slot is None or slot[0] != shape or slot[1] != dtype:
            self._slots.pop(key, None)  # released before the new one is made: one copy at most
            slot = (shape, dtype, alloc())
            self._slots[key] = slot
            self.allocations += 1
        self._taken.add(key)
        return slot[2]

    def end(self) -> None:
        """Release the buffers this save did not take (names that left the state)."""
        for key in [k for k in self._slots if k not in self._taken]:
            del self._slots[key]

    def clear(self) -> None:
        """Release every buffer."""
        self._slots.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(int(getattr(b, "nbytes", 0)) for _, _, b in self._slots.values())

    def __len__(self) -> int:
        return len(self._slots)


def stage_mapping(buffers: HostBuffers, mapping: Mapping[str, Any]) -> dict[str, Any]:
    """A numpy mapping copied into ``buffers`` (arrays) and deep-copied (other values).

    The result is what ``xckpt.save`` writes while the caller goes on changing
    ``mapping``: every array is a pool buffer filled with the caller's values.
    """
    buffers.begin()
    out: dict[str, Any] = {}
    for name, value in mapping.items():
        if isinstance(value, np.ndarray):
            arr = value
            buf = buffers.take(
                name, tuple(arr.shape), arr.dtype, functools.partial(np.empty, arr.shape, arr.dtype)
            )
            np.copyto(buf, arr, casting="no")
            out[name] = buf
        else:
            out[name] = copy.deepcopy(value)
    buffers.end()
    return out
