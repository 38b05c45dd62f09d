"""Row deltas of 2-D array chunks (format version 6): reading the patches and applying them.

A manager save that finds few rows of a 2-D box changed since the previous step (compared
with its staged copy, `xckpt.manager.HostBuffers.compare`) writes only those rows: a
patch of two arrays, `<key>-idx` (the row indices inside the box, increasing, int64)
and `<key>-rows` (the rows), and names the base (the last full copy) in `refs` and
the chain of patches since in `deltas` (`Patch`). A read of the
box reads the base, then applies each patch in order: its rows inside the region read
replace those rows, so the result is the saved bytes, bit for bit, on every read path
(each goes through `xckpt.native.reader.Checkpoint._read_chunks`).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from xckpt.errors import CorruptChunkError
from xckpt.manifest import Patch, numpy_dtype
from xckpt.native import _fileio
from xckpt.native._refs import sibling
from xckpt.native._zarr import NativeStorage
from xckpt.storage import corrupt

__all__ = ["Patches"]


class Patches:
    """Loads the patches a checkpoint at `storage` names (each once) and applies them."""

    def __init__(self, storage: NativeStorage, context: Any = None) -> None:
        self._storage, self._context = storage, context
        self._loaded: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def load(self, p: Patch, rows: int, cols: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """Patch `p` of a box of `rows` x `cols` items of `dtype`: (row indices, rows).

        Raises:
            CorruptChunkError: its arrays are missing, damaged, or their indices are not
                increasing rows of the box.
        """
        self.load_all([(p, rows, cols, dtype)])
        return self._loaded[(p.step, p.key)]

    def load_all(self, items: list[tuple[Patch, int, int, str]]) -> None:
        """[`load`][xckpt.load] of every item, their reads in flight together."""
        started = []
        for p, rows, cols, dtype in items:
            with self._lock:
                if (p.step, p.key) in self._loaded:
                    continue
            started.append((p, rows, *self._start(p, cols, dtype)))
        for p, rows, where, futs, i, v in started:
            try:
                for f in futs:
                    f.result() if hasattr(f, "result") else f()
            except (ValueError, OSError) as e:
                raise corrupt(where, e) from None
            if len(i) and (i[0] < 0 or i[-1] >= rows or (len(i) > 1 and not bool((np.diff(i) > 0).all()))):
                raise CorruptChunkError(f"{where}: its row indices are not increasing rows of a {rows}-row box")
            with self._lock:
                self._loaded[(p.step, p.key)] = (i, v)

    def _start(self, p: Patch, cols: int, dtype: str) -> tuple[str, list[Any], np.ndarray, np.ndarray]:
        """Start reading patch `p`: what to name it, what to wait for, and its arrays."""
        where = f"checkpoint {self._storage.path!r}: row patch {p.key} of step {p.step}"
        st = NativeStorage(sibling(self._storage.url, p.step), self._context)
        root = _fileio.local_root(st.url)
        i, v = np.empty(p.rows, np.int64), np.empty((p.rows, cols), numpy_dtype(dtype))
        parts = [(f"{p.key}-idx", "int64", (p.grid,), i), (f"{p.key}-rows", dtype, (p.grid, cols), v)]
        futs: list[Any] = []
        try:
            for k, dt, g, out in parts:
                if root is not None and p.storage != "ocdbt":  # a local directory: read directly
                    region = tuple(slice(0, s) for s in out.shape)
                    futs.append(_fileio.submit_read(root, _fileio.ChunkRead(k, out.shape, g, region, out, p.storage,
                                                                            p.codec)))
                else:
                    arr = st.open_array(k, p.storage, dt, out.shape, g, p.codec)
                    futs.append(lambda arr=arr, out=out: out.__setitem__(..., arr.result().read().result()))
        except (ValueError, OSError) as e:
            raise corrupt(where, e) from None
        return where, futs, i, v

    def apply(self, chain: tuple[Patch, ...], box: tuple[int, ...], dtype: str, chunk_slices: tuple[slice, ...],
              out: np.ndarray) -> None:
        """Apply `chain` to `out`, the region `chunk_slices` of a box of shape `box`."""
        r, c = chunk_slices
        r0, r1 = r.start or 0, box[0] if r.stop is None else r.stop
        for p in chain:
            idx, vals = self.load(p, box[0], box[1], dtype)
            lo, hi = np.searchsorted(idx, [r0, r1])
            if hi > lo:
                out[idx[lo:hi] - r0] = vals[lo:hi, c]
