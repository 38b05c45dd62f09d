"""Staging for `xckpt.torch.save(..., staging=buffers)`: copies into reusable host buffers.

`staging` is a pool of host buffers the caller owns and passes to every save
(`xckpt.manager.HostBuffers`, the checkpoint manager's staging memory; any
object with the `xckpt._staging.StagingPool` protocol). Instead of a fresh host copy of each
box per save, a save copies each box into the pool's buffer for it, allocated once
(pinned when the tensor is on CUDA) and reused while the box keeps its shape and dtype.

Call protocol (`xckpt.torch.save` on the calling thread, then its write thread):

1. `Stager(buffers)` calls `buffers.begin()`;
2. `stage(key, part)` per box this rank writes, returning the numpy view the
   writer reads: numpy arrays and CPU tensors are copied at once; CUDA tensors are
   copied with `non_blocking=True` on a side stream of their device (one per device,
   made once per process), which first waits for the caller's current stream, so the
   copies see the state as it was when `save` was called; each source tensor is
   `record_stream`-ed so the caching allocator keeps its memory until its copy ran;
3. `finish()` records one event per side stream and makes the caller's current
   stream wait for it, so kernels queued after `save` returns (an optimizer step
   updating parameters in place) run after the copies: `save` returns without
   waiting for the GPU. It calls `buffers.end()` and returns the events;
4. the write thread calls `wait_events` before it reads any buffer.

`buffers.device_copy`, when set, replaces steps 2-3's copy for every tensor:
`device_copy(host, tensor)` returns an event (anything with `synchronize()`) or
None, and the writer waits for each event. Tests use it to check this logic on CPU.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from xckpt._staging import StagingPool
from xckpt.errors import XckptError
from xckpt.torch._dtypes import as_numpy

__all__ = ["Stager", "side_copy", "side_stream", "wait_events"]

#: One side stream per CUDA device for this process's staging and load copies.
_side_streams: dict[Any, Any] = {}


def side_stream(device: Any) -> Any:
    """This process's side stream on CUDA `device` (made once; saves' staging copies and
    loads' device copies, `xckpt.torch._pipeline`, run on it)."""
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


def side_copy(streams: dict[Any, Any], device: Any, dst: torch.Tensor, src: torch.Tensor) -> Any:
    """Copy `src` into `dst` without blocking, on `device`'s side stream; returns the stream.

    `streams` holds the side streams one job (a save's staging, a load's copies) has used,
    by device: a stream's first use in the job waits for the device's current stream, so
    the copy sees the caller's work on `src` before it.
    """
    stream = streams.get(device)
    if stream is None:
        stream = side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        streams[device] = stream
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    return stream


class Stager:
    """One save's staging into `buffers` (see the module for the protocol)."""

    def __init__(self, buffers: StagingPool) -> None:
        self.buffers = buffers
        self.events: list[Any] = []
        self._streams: dict[Any, Any] = {}
        # row deltas: a pool that compares no tensor (`rows_for` None) is not asked per box
        self._compare = getattr(buffers, "rows_for", True) is not None
        buffers.begin()

    def stage(self, key: Hashable, part: Any) -> np.ndarray:
        """Copy `part` (a tensor or numpy array) into its buffer; the numpy view to write."""
        if isinstance(part, np.ndarray):
            buf = self.buffers.take(
                key, tuple(part.shape), part.dtype, lambda: np.empty(part.shape, part.dtype)
            )
            if self._compare:
                self.buffers.compare(key, buf, part)  # row deltas: compare, then copy
            np.copyto(buf, part, casting="no")
            return buf
        t = part.detach()
        if t.device.type == "meta":
            raise XckptError("a tensor on the meta device holds no data and cannot be saved")
        shape = tuple(int(s) for s in t.shape)
        pin = t.device.type == "cuda"
        host = self.buffers.take(
            key, shape, t.dtype, lambda: torch.empty(shape, dtype=t.dtype, pin_memory=pin)
        )
        hook = self.buffers.device_copy
        if hook is not None:
            event = hook(host, t)
            if event is not None:
                self.events.append(event)
        elif t.device.type == "cuda":
            self._cuda_copy(host, t)
        else:
            if self._compare and t.device.type == "cpu" and t.is_contiguous() and t.dim() == 2:
                self.buffers.compare(key, as_numpy(host), as_numpy(t))  # row deltas: compare, then copy
            host.copy_(t)  # a CPU tensor (or another device: a blocking copy)
        return as_numpy(host)

    def _cuda_copy(self, host: torch.Tensor, t: torch.Tensor) -> None:
        stream = side_copy(self._streams, t.device, host, t)
        t.record_stream(stream)

    def finish(self) -> list[Any]:
        """Events for the writer; the caller's streams wait on them (see the module)."""
        for device, stream in self._streams.items():
            event = torch.cuda.Event()
            event.record(stream)
            torch.cuda.current_stream(device).wait_event(event)
            self.events.append(event)
        self._streams = {}
        self.buffers.end()
        return self.events


def wait_events(events: Sequence[Any]) -> None:
    """Wait until every staging copy has landed in its host buffer (the write thread)."""
    for event in events:
        event.synchronize()
