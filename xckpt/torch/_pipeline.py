"""Device loads as a pipeline: storage reads into a bounded ring of host buffers,
host-to-device copies on a side stream, the two overlapped.

`xckpt.torch.load` and `load_full` read every part of a target that does not
live in CPU memory (a CUDA tensor, a DTensor's CUDA shard) through a
[`DeviceRing`][xckpt.torch._pipeline.DeviceRing]: `buffers` host buffers of `buffer_bytes` each (pinned when
CUDA is available), allocated on first use and reused by every later load that is
given the same ring. Host memory is `buffers x buffer_bytes` whatever the
checkpoint's size (a load without a ring of its own makes one for itself, whose
buffers are no larger than the load needs).

Call protocol (all on the loading thread; one load at a time per ring, a lock
keeps it so):

1. `plan_batches` cuts the parts into pieces of at most `buffer_bytes`
   (splitting a large box along its leading dims) and packs them, in order, into
   batches that each fill one buffer (offsets aligned to 64 bytes);
2. per batch, the ring takes its next buffer, first waiting for the events of the
   copies last made out of that buffer, so no buffer is refilled before its
   copies completed; it reads the batch from storage into views of that buffer
   (`Source.read_into`, concurrent inside), then issues each piece's copy and
   records the batch's events on the buffer: `dst.copy_(src, non_blocking=True)`
   on one side stream per CUDA device, which first waits for the caller's current
   stream (so the copies land after work already queued on the targets); copies
   to other devices are blocking. Reading batch k+1 runs while batch k's copies
   run on the device;
3. at the end (also when a read raised), the caller's current streams wait for
   the side streams, and the ring waits for every copy, so when `load` returns
   the targets hold the data and every buffer is free.

`copy`, when set, replaces step 2's copy for every piece: `copy(dst, src)`
gets the target part and the host view (a CPU tensor) and returns an event
(anything with `synchronize()`) or None. Tests use it to check this logic on
CPU: with a hook, CPU tensor targets go through the ring too.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from xckpt import layout as L
from xckpt._progress import progress
from xckpt.errors import XckptError
from xckpt.source import Source
from xckpt.torch._dtypes import as_numpy
from xckpt.torch._staging import side_copy

__all__ = ["DeviceRing", "StagedSlice", "plan_batches", "split_box", "Copier"]

#: Byte alignment of each piece inside a buffer (any dtype's itemsize divides it).
ALIGN = 64
#: A load's own ring (none given): buffers no larger than this, rounded up to it.
_MIN_BUFFER = 1 << 20


@dataclass(frozen=True)
class StagedSlice:
    """Slice `box` (global coordinates) of item `item`, at `slices` of the item's
    target, staged at `offset` (`nbytes` long) of its batch's buffer."""

    item: int
    box: L.Box
    slices: tuple[slice, ...]
    offset: int
    nbytes: int


def split_box(box: L.Box, itemsize: int, limit: int) -> list[L.Box]:
    """`box` cut into row-major pieces of at most `limit` bytes (`limit >= itemsize`).

    A box that fits is returned whole. Otherwise the first dim `d` whose trailing
    block (dims after `d`) fits is cut into runs of as many indices as fit, and
    every earlier dim into single indices.
    """
    if box.volume * itemsize <= limit:
        return [box]
    d = 0
    while math.prod(box.shape[d + 1 :]) * itemsize > limit:
        d += 1
    block = math.prod(box.shape[d + 1 :]) * itemsize
    run = max(1, limit // block)
    heads = [range(o, o + s) for o, s in zip(box.offset[:d], box.shape[:d])]
    out = []
    for head in _product(heads):
        for start in range(box.offset[d], box.offset[d] + box.shape[d], run):
            n = min(run, box.offset[d] + box.shape[d] - start)
            out.append(L.Box(head + (start,) + box.offset[d + 1 :], (1,) * d + (n,) + box.shape[d + 1 :]))
    return out


def _product(ranges: Sequence[range]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for r in ranges:
        out = [p + (i,) for p in out for i in r]
    return out


def plan_batches(items: Sequence[tuple[L.Box, int]], buffer_bytes: int) -> list[list[StagedSlice]]:
    """Items `(box, itemsize)` as batches of `StagedSlice`, each batch fitting one buffer.

    Pure arithmetic: pieces keep the items' order; empty boxes are skipped.
    """
    if buffer_bytes < ALIGN:
        raise XckptError(f"a device ring's buffers must hold at least {ALIGN} bytes, got {buffer_bytes}")
    batches: list[list[StagedSlice]] = []
    cur: list[StagedSlice] = []
    pos = 0
    for i, (box, itemsize) in enumerate(items):
        if box.empty:
            continue
        if itemsize > buffer_bytes:
            raise XckptError(f"a device ring's buffers ({buffer_bytes} bytes) cannot hold one element")
        for piece in split_box(box, itemsize, buffer_bytes):
            nbytes = piece.volume * itemsize
            at = -(-pos // ALIGN) * ALIGN
            if cur and at + nbytes > buffer_bytes:
                batches.append(cur)
                cur, at = [], 0
            cur.append(StagedSlice(i, piece, piece.slices(box), at, nbytes))
            pos = at + nbytes
    if cur:
        batches.append(cur)
    return batches


class Copier:
    """Host-to-target copies: the `copy` hook, or CUDA side streams, or blocking copies.

    `copy` issues one; `mark` returns the events of the copies issued
    since the last mark (one per side stream, or the hook's); `finish` makes
    the caller's current streams wait for the side streams.
    """

    def __init__(self, hook: Callable[[Any, Any], Any] | None) -> None:
        self.hook = hook
        self._streams: dict[Any, Any] = {}
        self._dirty: set[Any] = set()
        self._events: list[Any] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.hook is not None:
            event = self.hook(dst, src)
            if event is not None:
                self._events.append(event)
            return
        if dst.device.type != "cuda":
            dst.copy_(src)  # CPU memory or another device: a blocking copy
            return
        side_copy(self._streams, dst.device, dst, src)
        self._dirty.add(dst.device)

    def mark(self) -> list[Any]:
        events, self._events = self._events, []
        for device in sorted(self._dirty, key=str):
            event = torch.cuda.Event()
            event.record(self._streams[device])
            events.append(event)
        self._dirty.clear()
        return events

    def finish(self) -> None:
        for device, stream in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)


def wait_all(events: Sequence[Any]) -> None:
    for event in events:
        event.synchronize()


class DeviceRing:
    """A bounded ring of host buffers through which loads copy to a device (see the module).

    Pass one ring to every load that should reuse its buffers
    (`xckpt.torch.load(path, sd, ring=ring)`); a load given none makes its own.

    Args:
        buffers: how many host buffers (2 or more overlap reads with copies).
        buffer_bytes: each buffer's size; a larger piece is read in parts.
        copy: replaces the device copy (see the module): `copy(dst, src) -> event | None`.

    Attributes:
        allocations: host buffers allocated so far (a reused ring stops counting up).
    """

    def __init__(
        self, buffers: int = 3, buffer_bytes: int = 64 << 20, *, copy: Callable[[Any, Any], Any] | None = None
    ) -> None:
        if buffers < 1 or buffer_bytes < ALIGN:
            raise XckptError(
                f"DeviceRing(buffers={buffers}, buffer_bytes={buffer_bytes}): needs at least one "
                f"buffer of at least {ALIGN} bytes (e.g. DeviceRing(3, 64 << 20))"
            )
        self.buffers = buffers
        self.buffer_bytes = buffer_bytes
        self.copy = copy
        self.allocations = 0
        self._host: list[torch.Tensor | None] = [None] * buffers
        self._pending: list[list[Any]] = [[] for _ in range(buffers)]
        self._next = 0
        self._lock = threading.Lock()
        self._fit = False  # a load's own ring: buffers sized to what it needs

    @classmethod
    def for_load(cls) -> DeviceRing:
        """The ring of a load that was given none: default shape, buffers sized to the load."""
        ring = cls()
        ring._fit = True
        return ring

    @property
    def pinned(self) -> bool:
        """Whether the buffers are pinned (CUDA available and no copy hook)."""
        return self.copy is None and torch.cuda.is_available()

    def _take(self, need: int) -> tuple[int, torch.Tensor]:
        """The next buffer, its earlier copies waited for, holding at least `need` bytes."""
        i = self._next
        self._next = (i + 1) % self.buffers
        wait_all(self._pending[i])
        self._pending[i] = []
        host = self._host[i]
        if host is None or host.numel() < need:
            size = self.buffer_bytes
            if self._fit:
                size = min(size, -(-need // _MIN_BUFFER) * _MIN_BUFFER)
            host = self._host[i] = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
            self.allocations += 1
        return i, host

    def drain(self) -> None:
        """Wait for every copy still running out of the ring's buffers."""
        for i, events in enumerate(self._pending):
            wait_all(events)
            self._pending[i] = []

    def release(self) -> None:
        """Wait for every copy, then free the buffers (the ring stays usable)."""
        with self._lock:
            self.drain()
            self._host = [None] * self.buffers

    def run(
        self,
        ckpt: Source,
        items: Sequence[tuple[str, L.Box, torch.Tensor]],
        show_progress: bool | None = None,
    ) -> None:
        """Fill each `dst` (of box `box`'s shape) with box `box` of tensor `name`."""
        sizes = [(box, dst.element_size()) for _name, box, dst in items]
        batches = plan_batches(sizes, self.buffer_bytes)
        total = sum(p.nbytes for batch in batches for p in batch)
        copier = Copier(self.copy)
        with self._lock, progress(total, f"{ckpt.format or 'xckpt'} load", show_progress) as bar:
            try:
                for batch in batches:
                    i, host = self._take(batch[-1].offset + batch[-1].nbytes)
                    reads, copies = [], []
                    for p in batch:
                        name, _box, dst = items[p.item]
                        src = host[p.offset : p.offset + p.nbytes].view(dst.dtype).view(p.box.shape)
                        reads.append((name, p.box, as_numpy(src)))
                        copies.append((dst[p.slices], src))
                    ckpt.read_into(reads, show_progress=False)
                    for dst, src in copies:
                        copier.copy(dst, src)
                    self._pending[i] = copier.mark()
                    bar.update(sum(p.nbytes for p in batch))
            finally:
                copier.finish()
                self.drain()
