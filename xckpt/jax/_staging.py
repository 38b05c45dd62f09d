"""Staging for `xckpt.jax.save(..., staging=buffers)`: shards copied into reusable host buffers.

`staging` is a pool of host buffers the caller owns and passes to every save
(`xckpt.manager.HostBuffers`, the checkpoint manager's staging memory; any
object with the `xckpt._staging.StagingPool` protocol). `save` calls `begin()`, then
`stage_host` for each box this process writes (after every device-to-host
transfer was started with `copy_to_host_async`), then `end()`. Each box is copied
into the pool's buffer for it, allocated once and reused while the box keeps its
shape and dtype, instead of a fresh `np.array(..., copy=True)` per save. The copy
is complete when `save` returns, so a later donation or deletion of the arrays
cannot change the checkpoint. (On a GPU, jax first fetches each shard into a host
array of its own, as JAX has no copy into a caller's buffer; that array belongs to the
`jax.Array` and goes with it.)
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any

import numpy as np

from xckpt._staging import StagingPool

__all__ = ["stage_host"]


def stage_host(buffers: StagingPool, key: Hashable, data: Any) -> np.ndarray:
    """`data` (a shard's jax.Array or a numpy array) copied into its buffer in `buffers`."""
    src = np.asarray(data)  # a CPU device buffer is viewed, not copied; a GPU one was fetched
    buf = buffers.take(key, tuple(src.shape), src.dtype, functools.partial(np.empty, src.shape, src.dtype))
    buffers.compare(key, buf, src)  # row deltas: compare, then copy
    np.copyto(buf, src, casting="no")
    return buf
