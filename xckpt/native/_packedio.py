"""Direct reads of a rank's packed byte array (small tensors) on a local filesystem.

A packed array is a 1-d uint8 zarr v3 array (`xckpt.native._zarr.packed_grid` bytes
per zarr chunk, each stored at full length with its crc32c), "files" (one shard file
with an index, format version 3 on) or "plain" (one file per zarr chunk). A read of
packed tensors is split in **spans** (`plan_spans`): runs of the zarr chunks it
needs, inside fixed blocks of the array, so each zarr chunk is read once and a span
holds at most a block. A tensor that crosses a block boundary is in two spans (or more),
each copying its part. A span is one task on the read threads:

1. one `preadv` per contiguous stretch of its zarr chunks into a buffer (the chunks'
   bytes back to back, their crc32c trailers aside), reused by the read's next span;
2. every zarr chunk's crc32c checked;
3. `unpack(data)` called in that thread: it checks each tensor's own crc32 from the
   manifest and copies it out (see `xckpt.native.reader.Checkpoint._unpack`).

So packed tensors are read while the array chunks are, every byte read once, and the
per-tensor checks and copies run on the read threads, not in the caller's thread.
(Before this, byte-range spans re-read the zarr chunks at their edges and the caller
checked and copied every tensor after the array reads: on bench/jax_load.py's 168 MB
of packed shards that took 0.22 s at the end of a 1 s restore, warm or cold.)
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import queue
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from xckpt.native._fileio import (
    ChunkFileError,
    _check_crc,
    _count,
    _open_existing,
    _pool,
    _preadv,
    _read_index,
    chunk_file,
    data_file,
    index_entry,
)

__all__ = ["PackedArray", "open_packed", "plan_spans", "submit_span"]

_NO_INDEX = np.empty((0, 2), np.uint64)  # the index of an array that is not "files"


def plan_spans(ranges: Sequence[tuple[int, int]], grid: int, span_bytes: int) -> list[tuple[int, int, list[int]]]:
    """Spans of zarr chunks (`grid` bytes each) that read the byte `ranges` (sorted by
    start, non-empty): `(first, stop, indices of the ranges it holds part of)`. Spans
    stay inside blocks of `span_bytes // grid` chunks (at least one); a range crossing
    a block boundary is in each span it touches."""
    per = max(1, span_bytes // grid)
    spans: list[list[Any]] = []  # [first, stop, held]
    last: list[Any] = [-1, -1, []]
    for i, (start, end) in enumerate(ranges):
        c, hi = start // grid, (end - 1) // grid + 1
        if last[0] <= c and hi <= last[1]:  # inside the current span (most small tensors)
            last[2].append(i)
            continue
        while c < hi:
            seg = min(hi, (c // per + 1) * per)
            if last[0] // per == c // per and last[0] <= c <= last[1]:
                last[1] = max(last[1], seg)
                if last[2][-1] != i:
                    last[2].append(i)
            else:
                last = [c, seg, [i]]
                spans.append(last)
            c = seg
    return [(first, stop, held) for first, stop, held in spans]


class PackedArray:
    """A packed array's location and layout: `size` bytes in zarr chunks of `grid`
    bytes, stored as `kind`; for "files", its shard's index and file size (an empty
    index otherwise). Its span buffers live as long as it does (one read)."""

    __slots__ = ("root", "key", "size", "grid", "kind", "index", "file_size", "buffers")

    def __init__(self, root: str, key: str, size: int, grid: int, kind: str) -> None:
        self.root, self.key, self.size, self.grid, self.kind = root, key, size, grid, kind
        self.index: np.ndarray = _NO_INDEX
        self.file_size = 0
        self.buffers: queue.SimpleQueue[tuple[np.ndarray, np.ndarray]] = queue.SimpleQueue()

    @property
    def chunks(self) -> int:
        return -(-self.size // self.grid)


def open_packed(root: str, key: str, size: int, grid: int, kind: str) -> PackedArray:
    """The packed array at `key`; for "files", its index is read and checked now.
    Raises ChunkFileError (damaged or missing) or OSError."""
    arr = PackedArray(root, key, size, grid, kind)
    if kind == "files":
        arr.index, arr.file_size = _read_index(data_file(os.path.join(root, key), 1), arr.chunks)
    return arr


def _take(arr: PackedArray, nbytes: int, ncrc: int) -> tuple[np.ndarray, np.ndarray]:
    """A free pair of data and crc buffers of the read, at least `nbytes` and `4 * ncrc` long."""
    try:
        data, crcs = arr.buffers.get_nowait()
    except queue.Empty:
        data, crcs = np.empty(0, np.uint8), np.empty(0, np.uint8)
    if data.size < nbytes:
        data = np.empty(nbytes, np.uint8)
    if crcs.size < 4 * ncrc:
        crcs = np.empty(4 * ncrc, np.uint8)
    return data, crcs


def _stretches(arr: PackedArray, first: int, stop: int) -> list[tuple[str, int, list[int]]]:
    """(file, offset, zarr chunks) per contiguous stretch of chunks `first..stop-1`."""
    full = arr.grid + 4
    key_dir = os.path.join(arr.root, arr.key)
    if arr.kind != "files":
        return [(chunk_file(key_dir, (i,)), 0, [i]) for i in range(first, stop)]
    path = data_file(key_dir, 1)
    out: list[tuple[str, int, list[int]]] = []
    for i in range(first, stop):
        off, _nb = index_entry(path, f" (zarr chunk [{i}])", arr.index, i, full, arr.file_size)
        if out and out[-1][1] + full * len(out[-1][2]) == off:
            out[-1][2].append(i)
        else:
            out.append((path, off, [i]))
    return out


def _read_span(arr: PackedArray, first: int, stop: int, unpack: Callable[[np.ndarray], int]) -> int:
    g = arr.grid
    bufs = _take(arr, (stop - first) * g, stop - first)
    try:
        return _fill(arr, first, stop, *bufs, unpack)
    finally:
        arr.buffers.put(bufs)


def _fill(arr: PackedArray, first: int, stop: int, data: np.ndarray, crcs: np.ndarray,
          unpack: Callable[[np.ndarray], int]) -> int:
    g = arr.grid
    for path, off, idxs in _stretches(arr, first, stop):
        iov: list[Any] = []
        for i in idxs:
            k = i - first
            iov += [data[k * g : (k + 1) * g], crcs[4 * k : 4 * k + 4]]
        fd = _open_existing(path, "shard file" if arr.kind == "files" else "chunk file")
        try:
            if arr.kind != "files" and (size := os.fstat(fd).st_size) != g + 4:
                raise ChunkFileError(f"chunk file {path} holds {size} bytes, expected {g + 4}")
            n = _preadv(fd, path, iov, off)
        finally:
            os.close(fd)
        _count(n)
        if n != (g + 4) * len(idxs):
            raise ChunkFileError(f"{path}: read {n} of {(g + 4) * len(idxs)} bytes at offset {off}")
        for i in idxs:
            k = i - first
            what = f" (zarr chunk [{i}])" if arr.kind == "files" else ""
            _check_crc(path, what, data[k * g : (k + 1) * g], data[:0], crcs[4 * k : 4 * k + 4])
    return unpack(data[: (stop - first) * g])


def submit_span(arr: PackedArray, first: int, stop: int, unpack: Callable[[np.ndarray], int]) -> cf.Future[int]:
    """Read zarr chunks `first..stop-1` of `arr` on the read threads, check them, and
    call `unpack(bytes [first * grid, stop * grid) of the array)` there (the buffer is
    reused by another span once it returns). The future's result is `unpack`'s; its error a
    ChunkFileError (damaged data), an OSError (storage) or what `unpack` raised."""
    return _pool().submit(_read_span, arr, first, stop, unpack)
