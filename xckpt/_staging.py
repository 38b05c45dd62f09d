"""The staging-pool protocol the save verbs take as `staging=` (one definition for all adapters).

A pool of host buffers by key (a tensor's name and box) that a caller owns and passes
to every save: `xckpt.torch.save` and `xckpt.jax.save` copy each box they write into
the pool's buffer for it instead of a fresh host copy per save. The checkpoint
manager's `HostBuffers` is the pool; any object with these methods will do.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Protocol

__all__ = ["StagingPool"]


class StagingPool(Protocol):
    """What a staging pool offers.

    Call protocol of one save: `begin()`; `take(key, shape, dtype, alloc)` per box staged
    (the previous save's buffer when shape and dtype match, else `alloc()`); optionally
    `compare(key, old, new)` before a box is copied into its buffer (which rows changed
    since the last save, for row deltas); `end()`.

    Attributes:
        device_copy: a hook `device_copy(host, tensor) -> event or None` that replaces
            `xckpt.torch.save`'s device-to-host copy (tests check that logic on CPU); None
            for the default (CUDA tensors copied on a side stream).
    """

    device_copy: Callable[[Any, Any], Any] | None

    def begin(self) -> None: ...

    def take(
        self, key: Hashable, shape: tuple[int, ...], dtype: Hashable, alloc: Callable[[], Any]
    ) -> Any: ...

    def compare(self, key: Hashable, old: Any, new: Any) -> None: ...

    def end(self) -> None: ...
