"""Host buffers a manager owns and reuses across saves: its staging memory.

A `HostBuffers` is a pool of host arrays by key (a tensor's name and box).
The adapters' `save(..., staging=buffers)` (`xckpt.torch.save`,
`xckpt.jax.save`) and `stage_mapping` (numpy mappings) copy the state into
it instead of allocating host copies per save; the pool itself knows nothing of
frameworks: the adapter passes an `alloc` that makes the buffer (pinned memory for
a CUDA tensor), and the pool keeps it while the state keeps its shape and dtype.

Call protocol of one save (one thread; the manager runs at most one save at a time,
and every adapter waits for the previous background write before staging, so a
buffer is never refilled while a write still reads it):

1. `begin()`;
2. `take(key, shape, dtype, alloc)` once per box staged: the buffer of the last
   save when `shape` and `dtype` are unchanged, else a new one from `alloc()`
   (the old one released first);
3. `end()`: buffers of keys this save did not take are released, so the pool holds
   at most one copy of the state as it is now.

Row deltas (DESIGN.md section 12): with `rows_for` set (a predicate on a tensor's
name), the adapters call `HostBuffers.compare` just before they copy a 2-D box
into a buffer that holds the previous save's values: compare, then copy, so staging stays
one copy. The changed row indices are kept by buffer (`HostBuffers.changed`) for
the writer to store only those rows.

`device_copy` (optional) is the hook `xckpt.torch.save` calls to copy a tensor
into its host buffer, `device_copy(host, tensor) -> event or None`; the writer
waits for each event (`event.synchronize()`) before it reads the buffer. Default:
CUDA tensors are copied on a side stream (`xckpt.torch._staging`). Tests
inject a hook to check that logic on CPU.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import numpy as np

__all__ = ["HostBuffers", "stage_mapping", "changed_rows"]


class HostBuffers:
    """A pool of host buffers by key, reused while shape and dtype stay the same.

    Attributes:
        device_copy: the hook `xckpt.torch.save` copies tensors with (see the module).
        allocations: buffers allocated so far (a save that reuses every buffer adds none).
    """

    def __init__(self, device_copy: Callable[[Any, Any], Any] | None = None) -> None:
        self.device_copy = device_copy
        self.allocations = 0
        self._slots: dict[Hashable, tuple[tuple[int, ...], Hashable, Any]] = {}
        self._taken: set[Hashable] = set()
        #: Row deltas: which tensors (by name) to compare (None: none), and this save's
        #: changed rows by buffer (data address, shape).
        self.rows_for: Callable[[str], bool] | None = None
        self._reused: set[Hashable] = set()
        self._changed: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}
        #: Stagings begun so far: a manager compares rows against its buffers only when no
        #: other save (another tier's, say) has refilled them since its own.
        self.generation = 0
        #: Keys found wholly unchanged, by the generation that found it: not compared again
        #: for `probe_every` stagings (a frozen tensor costs no comparison in the stall;
        #: the writer's hashes still find it unchanged).
        self._frozen: dict[Hashable, int] = {}
        self.probe_every = 8

    def begin(self) -> None:
        """Start staging one save."""
        self.generation += 1
        self._taken = set()
        self._reused = set()
        self._changed = {}

    def take(self, key: Hashable, shape: tuple[int, ...], dtype: Hashable, alloc: Callable[[], Any]) -> Any:
        """The buffer for `key`: the previous save's if `shape` and `dtype` match, else new."""
        slot = self._slots.get(key)
        if slot is not None and slot[0] == shape and slot[1] == dtype:
            self._reused.add(key)
        if slot is None or slot[0] != shape or slot[1] != dtype:
            self._slots.pop(key, None)  # released before the new one is made: one copy at most
            slot = (shape, dtype, alloc())
            self._slots[key] = slot
            self.allocations += 1
        self._taken.add(key)
        return slot[2]

    def compare(self, key: Hashable, old: np.ndarray, new: Any) -> None:
        """Before `new` is copied into the buffer `old` of `key` (a numpy view of it):
        record which rows differ (bytes), when `key` is a 2-D box of a tensor `rows_for`
        accepts and `old` holds the previous save's values. Few rows changed is the case
        worth it: a first block of rows where half changed ends the comparison (a full save)."""
        name = key[0] if isinstance(key, tuple) else key
        if self.rows_for is None or key not in self._reused or old.ndim != 2 or not isinstance(name, str):
            return
        if not self.rows_for(name):
            return
        found = self._frozen.get(key)
        if found is not None and self.generation - found < self.probe_every:
            return
        new = np.asarray(new)
        if new.shape != old.shape or new.dtype != old.dtype or not (new.flags.c_contiguous and old.flags.c_contiguous):
            return
        rows = changed_rows(old, new)
        if rows is not None:
            self._changed[(old.__array_interface__["data"][0], old.shape)] = rows
        if rows is not None and not len(rows):
            self._frozen[key] = self.generation
        else:
            self._frozen.pop(key, None)

    def changed(self, buf: np.ndarray) -> np.ndarray | None:
        """The rows of buffer `buf` this save changed (None: not compared)."""
        if not self._changed or buf.ndim != 2:
            return None
        return self._changed.get((buf.__array_interface__["data"][0], buf.shape))

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


#: Bytes of rows compared at once: a block equal in both (a frozen tensor's) costs one
#: comparison, and a first blocks' rows of which half changed end the comparison.
_BLOCK_BYTES = 1 << 20
_SAMPLE_ROWS = 4096


def changed_rows(old: np.ndarray, new: np.ndarray) -> np.ndarray | None:
    """Indices of the rows of two C-contiguous 2-D arrays whose bytes differ (increasing,
    int64); None when half the rows of the first blocks differ (not worth a row delta)."""
    n = old.shape[0]
    width = old.nbytes // max(1, n)
    if n == 0 or width == 0:
        return None
    word = next(w for w in (8, 4, 2, 1) if width % w == 0)
    a = old.reshape(-1).view(np.uint8).view(f"<u{word}").reshape(n, -1)
    b = new.reshape(-1).view(np.uint8).view(f"<u{word}").reshape(n, -1)
    block = max(1, _BLOCK_BYTES // width)
    found: list[np.ndarray] = []
    count = 0
    for lo in range(0, n, block):
        x, y = a[lo : lo + block], b[lo : lo + block]
        if np.array_equal(x, y):
            continue
        rows = np.flatnonzero((x != y).any(axis=1))
        found.append(rows + lo)
        count += len(rows)
        seen = min(n, lo + block)
        if seen >= min(n, _SAMPLE_ROWS) and 2 * count >= seen:
            return None
    return np.concatenate(found).astype(np.int64) if found else np.zeros(0, np.int64)


def stage_mapping(buffers: HostBuffers, mapping: Mapping[str, Any]) -> dict[str, Any]:
    """A numpy mapping copied into `buffers` (arrays) and deep-copied (other values).

    The result is what `xckpt.save` writes while the caller goes on changing
    `mapping`: every array is a pool buffer filled with the caller's values.
    """
    buffers.begin()
    out: dict[str, Any] = {}
    for name, value in mapping.items():
        if isinstance(value, np.ndarray):
            arr = value
            buf = buffers.take(
                name, tuple(arr.shape), arr.dtype, functools.partial(np.empty, arr.shape, arr.dtype)
            )
            buffers.compare(name, buf, arr)  # row deltas: compare, then copy
            np.copyto(buf, arr, casting="no")
            out[name] = buf
        else:
            out[name] = copy.deepcopy(value)
    buffers.end()
    return out
