"""Staging for ``xckpt.jax.save(..., staging=buffers)``: shards copied into reusable host buffers.

``staging`` is a pool of host buffers the caller owns and passes to every save
(:class:`xckpt.manager.HostBuffers`, the checkpoint manager's staging memory; any
object with the :class:`HostBuffers` protocol). ``save`` calls ``begin()``, then
:func:`stage_host` for each box this process writes (after every device-to-host
transfer was started with ``copy_to_host_async``), then ``end()``. Each box is copied
into the pool's buffer for it, allocated once and reused while the box keeps its
shape and dtype, instead of a fresh ``np.array(..., copy=True)`` per save. The copy
is complete when ``save`` returns, so a later donation or deletion of the arrays
cannot change the checkpoint. (On a GPU, jax first fetches each shard into a host
array of its own, as JAX has no copy into a caller's buffer; that array belongs to the
``jax.Array`` and goes with it.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import numpy as np

__all__ = ["HostBuffers", "stage_host"]


class HostBuffers(Protocol):
    """What a staging pool offers (see :mod:`xckpt.manager._staging` for the pool)."""

    def begin(self) -> None: ...

    def take(
        self, key: Hashable, shape: tuple[int, ...], dtype: Hashable, alloc: Callable[[], Any]
    ) -> Any: ...

    def compare(self, key: Hashable, old: Any, new: Any) -> None: ...

    def end(self) -> None: ...


def stage_host(buffers: HostBuffers, key: Hashable, data: Any) -> np.ndarray:
    """``data`` (a shard's jax.Array or a numpy array) copied into its buffer in ``buffers``."""
    src = np.asarray(data)  # a CPU device buffer is viewed, not copied; a GPU one was fetched
    buf = buffers.take(key, tuple(src.shape), src.dtype, functools.partial(np.empty, src.shape, src.dtype))
    buffers.compare(key, buf, src)  # row deltas: compare, then copy
    np.copyto(buf, src, casting="no")
    return buf
