"""Streaming helpers of a conversion: two recycled buffers, reads one ahead, crc32c of arrays.

A conversion reads the source piece by piece ([`xckpt.sink.WriteJob`][xckpt.sink.WriteJob]) and
re-reads its output piece by piece (`convert`'s verify pass); both read the next
piece in the background while the current one is used (`read_ahead`), into
two arenas used in turn (`Buffers`), and take a crc32c of each piece
(`crc32c`). No framework, no I/O of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, TypeVar

import google_crc32c
import numpy as np

__all__ = ["Buffers", "read_ahead", "crc32c", "aligned"]

T = TypeVar("T")

#: An arena larger than this is not kept for pieces under a quarter of its size, nor between tensors.
KEEP_BYTES = 32 << 20


def crc32c(arr: np.ndarray, crc: int = 0) -> int:
    """crc32c of `arr`'s row-major bytes (hardware crc32c, several GB/s), continuing `crc`."""
    if not arr.size:
        return crc
    a = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
    raw = a.reshape(-1).view(np.uint8)
    raw.flags.writeable = False  # google_crc32c takes read-only buffers (a view: arr stays writable)
    return int(google_crc32c.extend(crc, raw))


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of 64 (pieces packed into one arena stay aligned)."""
    return -(-nbytes // 64) * 64


class Buffers:
    """Two byte arenas used in turn, each grown to the largest piece read into it.

    Reading piece k+1 (in the background) while the caller writes piece k needs two
    buffers; piece k+2 goes where piece k was, which the caller is done with by then.
    Recycling them spares the page faults and kernel zeroing of a fresh buffer per
    piece (a quarter of a conversion's CPU time, measured with perf).
    """

    def __init__(self) -> None:
        self._arenas: list[np.ndarray | None] = [None, None]
        self._turn = 0

    def take(self, shape: Sequence[int], dtype: np.dtype[Any]) -> np.ndarray:
        """A C-contiguous array of `shape` and `dtype` in the next arena."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        i, self._turn = self._turn, 1 - self._turn
        arena = self._arenas[i]
        if arena is None or arena.nbytes < nbytes or (arena.nbytes > KEEP_BYTES and arena.nbytes > 4 * nbytes):
            # Too small, or a rare large piece's arena that would stay resident for small ones.
            self._arenas[i] = None  # freed before the new one is allocated
            arena = self._arenas[i] = np.empty(max(nbytes, 64), dtype=np.uint8)
        return arena[:nbytes].view(dtype).reshape(shape)

    def trim(self) -> None:
        """Drop arenas larger than `KEEP_BYTES` (the caller is done with every piece)."""
        self._arenas = [a if a is not None and a.nbytes <= KEEP_BYTES else None for a in self._arenas]


_POOL: ThreadPoolExecutor | None = None


def read_ahead(reads: Sequence[Callable[[], T]]) -> Iterator[T]:
    """The results of `reads` in order, the next one read in the background while the
    caller uses the current one: reading and writing overlap, one piece ahead.

    A caller that stops early (an error, an interrupt) waits for the read in flight,
    so no read runs on a source that is being closed.
    """
    global _POOL
    if not reads:
        return
    if len(reads) == 1:
        yield reads[0]()
        return
    if _POOL is None:
        _POOL = ThreadPoolExecutor(1, thread_name_prefix="xckpt-convert-read")
    fut = _POOL.submit(reads[0])
    try:
        for nxt in reads[1:]:
            res = fut.result()
            fut = _POOL.submit(nxt)
            yield res
            del res
        yield fut.result()
    finally:
        if not fut.done():
            fut.cancel()
            futures_wait([fut])
