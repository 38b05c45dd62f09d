"""Background saves shared by `xckpt.save`, `xckpt.torch.save` and `xckpt.jax.save`.

Call protocol: a save first calls `wait_pending` (the previous async save
of this process, from any of the three verbs, finishes before a new one
starts; its error stays with its own future), does its foreground part
(plan, open the writer, take host copies of everything the caller may change
afterwards), then either runs the write itself or hands it to `submit`,
which returns a `concurrent.futures.Future` resolving to what the write
returns (this process's manifest). One worker thread runs the writes in order,
as torch DCP's `async_save` and orbax's async checkpointer do.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["submit", "wait_pending"]

T = TypeVar("T")

_lock = threading.Lock()
_pending: cf.Future[Any] | None = None
_executor: cf.ThreadPoolExecutor | None = None


def wait_pending() -> None:
    """Wait for the previous async save of this process (its error stays with its future)."""
    global _pending
    with _lock:
        fut, _pending = _pending, None
    if fut is not None:
        cf.wait([fut])


def submit(write: Callable[[], T]) -> cf.Future[T]:
    """Run `write` on the save thread; the returned future resolves to its result."""
    global _pending, _executor
    with _lock:
        if _executor is None:
            _executor = cf.ThreadPoolExecutor(1, thread_name_prefix="xckpt-async-save")
        fut = _executor.submit(write)
        _pending = fut
    return fut
