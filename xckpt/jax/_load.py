"""Load a checkpoint into jax.Arrays of any sharding, or into numpy on the host.

Tensors of a value group (DESIGN.md section 4) are loaded by value instead,
each device getting the rows a torch rank would (see `_value_groups`).

For every target array, each addressable device's box is computed from its
sharding; identical boxes (replicas) are read once; all boxes of a batch are
read concurrently with [`xckpt.source.Source.read_into`][xckpt.source.Source.read_into], which opens only the
saved chunks that overlap a box and, inside a chunk, only the zarr chunks the
box touches. The arrays are then built with `jax.make_array_from_callback`
from those host buffers. Host memory is bounded by `host_budget` per batch
(a single array larger than the budget is read alone).

Host buffers are what the devices keep: on the CPU backend jax adopts a 64-byte
aligned numpy buffer without a copy, so the bytes read are the bytes restored
(peak memory about 1x the arrays). The boxes of one array share one anonymous
mapping (page-aligned, the system's default huge-page policy: an explicit
`MADV_HUGEPAGE`, as numpy asks for large arrays, made first-touch faults dearer
on the benchmark VM), freed once all of that array's shards are. While the reads
run, a helper thread pre-faults those mappings in read order
(`MADV_POPULATE_WRITE`, Linux 5.14+; elsewhere the reads fault pages in
themselves): one call per 2 MiB instead of a page fault per 4 KiB page in the
read threads. On bench/jax_load.py's W1 (1.06 GB, 8 devices, busy 2-core VM) that
took 0.17-0.21 s of CPU off a ~1.3-1.7 s restore, cold and warm.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from xckpt.errors import DtypeMismatchError, MissingEntryError, ShapeMismatchError, XckptError
from xckpt.formats import opened
from xckpt.layout import Box, box_from_index
from xckpt.manifest import TensorEntry, paused_gc
from xckpt.rules import Rules
from xckpt.source import Source, readable_objects
from xckpt.storage import Location

from ._tree import device_boxes, flatten
from ._value_groups import load_group_arrays, row_members

__all__ = ["load"]

#: Host bytes read per batch before arrays are built and buffers released.
HOST_BUDGET = 2 << 30
_ALIGN = 64


class _ArrayJob:
    __slots__ = ("index", "name", "entry", "sharding", "shape", "dtype", "boxes", "nbytes")

    def __init__(
        self, ck: Source, index: int, name: str, entry: TensorEntry, sharding: Sharding
    ) -> None:
        self.index, self.name, self.entry, self.sharding = index, name, entry, sharding
        _check_representable(ck, name, entry)
        self.shape = tuple(entry.shape)
        self.dtype = entry.np_dtype
        self.boxes = sorted(
            set(device_boxes(sharding, self.shape, name, addressable=True).values()),
            key=lambda b: (b.offset, b.shape),
        )
        self.nbytes = sum(b.volume for b in self.boxes) * self.dtype.itemsize


def _check_representable(ck: Source, name: str, entry: TensorEntry) -> None:
    # Without jax_enable_x64, jax would silently turn int64/float64 into 32 bits.
    if jax.dtypes.canonicalize_dtype(entry.np_dtype) != entry.np_dtype:
        raise DtypeMismatchError(
            f"checkpoint {ck.path!r}, tensor {name!r}: saved as {entry.dtype}, which JAX holds "
            f"only with 64-bit types enabled (it would become "
            f"{jax.dtypes.canonicalize_dtype(entry.np_dtype)}); call "
            "jax.config.update('jax_enable_x64', True) before loading, or load this tensor to the "
            "host with a numpy leaf in the target"
        )


def _check(ck: Source, name: str, entry: TensorEntry, shape: Any, dtype: Any) -> None:
    if tuple(int(s) for s in shape) != tuple(entry.shape):
        raise ShapeMismatchError(
            f"checkpoint {ck.path!r}, tensor {name!r}: saved with shape {tuple(entry.shape)}, the "
            f"target asks for {tuple(shape)}; give the saved shape (or a sharding alone, which "
            "takes shape and dtype from the checkpoint)"
        )
    if np.dtype(dtype) != entry.np_dtype:
        raise DtypeMismatchError(
            f"checkpoint {ck.path!r}, tensor {name!r}: saved as {entry.dtype}, the target asks "
            f"for {np.dtype(dtype)}; load as {entry.dtype} and cast after loading (x.astype(...))"
        )


def _sharding_of(ck: Source, name: str, leaf: Any) -> Sharding:
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, Sharding):
        raise XckptError(
            f"checkpoint {ck.path!r}, tensor {name!r}: the target ShapeDtypeStruct has no "
            "sharding; give one (jax.ShapeDtypeStruct(shape, dtype, sharding=...)) or pass the "
            "sharding alone"
        )
    return sharding


def _host_read(ck: Source, name: str, leaf: Any) -> np.ndarray:
    entry = ck.info(name)
    if isinstance(leaf, np.ndarray):
        _check(ck, name, entry, leaf.shape, leaf.dtype)
    return ck.read(name)


def _build(job: _ArrayJob, bufs: dict[Box, np.ndarray]) -> jax.Array:
    shape = job.shape

    def fetch(index: Any) -> np.ndarray:
        return bufs[box_from_index(shape, index)]

    return jax.make_array_from_callback(shape, job.sharding, fetch, dtype=job.dtype)


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data is 64-byte aligned.

    jax's CPU client adopts such a buffer without copying (`device_put` is
    zero-copy); numpy's own large allocations are only 16-byte aligned, which
    costs a second copy of every byte loaded.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


#: An array whose boxes take at least this many bytes gets its own mapping (smaller
#: ones come from numpy's allocator: no mapping per tiny array).
_MAP_MIN = 1 << 20
#: Bytes pre-faulted per madvise call (the helper checks for cancellation in between).
_POPULATE_STEP = 2 << 20
_MADV_POPULATE_WRITE = 23
_madvise: Any = None


def _box_buffers(job: _ArrayJob) -> tuple[dict[Box, np.ndarray], np.ndarray | None]:
    """One uninitialised, 64-byte aligned buffer per box of `job`, and the mapping
    that holds them all (None when numpy allocated them)."""
    itemsize = job.dtype.itemsize
    sizes = [-(-b.volume * itemsize // _ALIGN) * _ALIGN for b in job.boxes]
    total = sum(sizes)
    if total == 0 or total < _MAP_MIN or not hasattr(mmap, "MAP_PRIVATE"):
        return {b: _aligned_empty(b.shape, job.dtype) for b in job.boxes}, None
    arena = np.frombuffer(mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), np.uint8)
    bufs, pos = {}, 0
    for b, n in zip(job.boxes, sizes):
        bufs[b] = arena[pos : pos + b.volume * itemsize].view(job.dtype).reshape(b.shape)
        pos += n
    return bufs, arena


def _libc_madvise() -> Any:
    global _madvise
    if _madvise is None:
        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _madvise = fn
    return _madvise


def _populate(arenas: list[np.ndarray], stop: threading.Event) -> None:
    """Pre-fault `arenas` in order (an optimisation only: on a kernel without
    MADV_POPULATE_WRITE the first failure ends it and the reads fault pages in)."""
    madvise = _libc_madvise()  # ctypes releases the GIL for the call
    for a in arenas:
        addr, end = a.ctypes.data, a.ctypes.data + a.nbytes
        for p in range(addr, end, _POPULATE_STEP):
            if stop.is_set() or madvise(p, min(_POPULATE_STEP, end - p), _MADV_POPULATE_WRITE) != 0:
                return


def _run_batch(ck: Source, batch: list[_ArrayJob], out: list[Any], show_progress: bool | None) -> None:
    bufs: dict[str, dict[Box, np.ndarray]] = {}
    items: list[tuple[str, Box, np.ndarray]] = []
    arenas = []
    for job in batch:
        per, arena = _box_buffers(job)
        bufs[job.name] = per
        if arena is not None:
            arenas.append(arena)
        items.extend((job.name, box, per[box]) for box in job.boxes)
    stop = threading.Event()
    helper = threading.Thread(target=_populate, args=(arenas, stop), name="xckpt-populate", daemon=True)
    if arenas:
        helper.start()
    try:
        ck.read_into(items, show_progress=show_progress)
    finally:
        stop.set()
        if arenas:
            helper.join()
    for job in batch:
        out[job.index] = _build(job, bufs.pop(job.name))


@paused_gc()  # thousands of boxes, buffers and jobs, none in a cycle (see paused_gc)
def load(
    path: Location | Source,
    target: Any = None,
    *,
    per_rank: str = "error",
    host_budget: int = HOST_BUDGET,
    show_progress: bool | None = None,
    strict_capacity: bool = False,
    context: Any = None,
    format: str | None = None,  # noqa: A002
    allow_pickle: bool = False,
    rules: Rules = None,
) -> Any:
    """Load a checkpoint into jax.Arrays laid out as `target` says.

    Args:
        path: the checkpoint: a directory, kvstore URL or spec dict of any format
            [`xckpt.open`][xckpt.open] reads, or an open [`xckpt.source.Source`][xckpt.source.Source]
            (which stays open; a source opened here is closed on return).
        target: a pytree, or a flat dict by name, whose leaves are
            `jax.ShapeDtypeStruct` with a sharding (shape and dtype are
            checked against the checkpoint), a `jax.sharding.Sharding` alone
            (shape and dtype from the checkpoint), or a `jax.Array` (its
            sharding, shape and dtype). A numpy array leaf is filled on the host
            (shape and dtype checked); any other leaf (e.g. a scalar placeholder)
            gets the saved object of that name, or the tensor as numpy. With no
            target, every tensor comes back as numpy and every object as saved,
            in a flat dict by name.
        per_rank: with no target, how per-rank objects come back (see
            [`xckpt.source.Source.objects`][xckpt.source.Source.objects]).
        host_budget: host bytes read per batch before arrays are built.
        show_progress: progress bar (default: when stderr is a TTY).
        strict_capacity: for value groups (DESIGN.md section 4), raise
            ValueRangeError instead of evicting entries that do not fit.
        context: tensorstore context (default: xckpt's process-wide one).
        format, allow_pickle, rules: as for [`xckpt.open`][xckpt.open].

    Returns:
        The same structure as `target` filled with jax.Arrays (numpy or
        objects for non-jax leaves), or a flat dict when `target` is None.

    Raises:
        MissingEntryError: `target` names something the checkpoint lacks.
        ShapeMismatchError, DtypeMismatchError: a target disagrees with the
            saved shape or dtype.
        UnsupportedPlacementError: a sharding cannot lay out the saved shape.
    """
    with opened(path, format=format, allow_pickle=allow_pickle, rules=rules, context=context) as ck:
        return _load(ck, target, per_rank, host_budget, show_progress, strict_capacity, allow_pickle)


def _load(
    ck: Source,
    target: Any,
    per_rank: str,
    host_budget: int,
    show_progress: bool | None,
    strict_capacity: bool,
    allow_pickle: bool,
) -> Any:
    if target is None:
        result: dict[str, Any] = dict(ck.read_all(show_progress=show_progress))
        result.update(
            ck.objects(
                readable_objects(ck, allow_pickle),
                rank=jax.process_index(),
                world_size=jax.process_count(),
                per_rank=per_rank,
            )
        )
        return result
    named, treedef = flatten(target)
    out: list[Any] = [None] * len(named)
    jobs: list[_ArrayJob] = []
    members = row_members(ck) if any(ck.info(n).value_range for n in ck.names()) else {}
    group_jobs: list[tuple[int, str, Sharding]] = []
    object_names: set[str] | None = None
    for i, (name, leaf) in enumerate(named):
        if isinstance(leaf, (Sharding, jax.ShapeDtypeStruct, jax.Array)):
            entry = ck.info(name)
            if isinstance(leaf, Sharding):
                sharding = leaf
            else:
                _check(ck, name, entry, leaf.shape, leaf.dtype)
                sharding = _sharding_of(ck, name, leaf)
            if name in members:
                _check_representable(ck, name, entry)
                group_jobs.append((i, name, sharding))
            else:
                jobs.append(_ArrayJob(ck, i, name, entry, sharding))
        elif isinstance(leaf, np.ndarray) or name in ck:
            out[i] = _host_read(ck, name, leaf)
        else:
            if object_names is None:
                object_names = set(ck.object_names())
            if name not in object_names:
                raise MissingEntryError(
                    f"checkpoint {ck.path!r} has no tensor or object {name!r}; it holds "
                    f"{len(ck.names())} tensors (e.g. {ck.names()[:5]}) and objects "
                    f"{ck.object_names()[:5]}. Check the target's key paths"
                )
            out[i] = _object_for(ck, name)
    _read_jobs(ck, jobs, out, host_budget, show_progress)
    if group_jobs:
        load_group_arrays(ck, group_jobs, members, out, strict_capacity=strict_capacity)
    return jax.tree_util.tree_unflatten(treedef, out)


def _object_for(ck: Source, name: str) -> Any:
    if name not in ck.per_rank_objects():
        return ck.objects([name])[name]
    return ck.objects([name], rank=jax.process_index(), world_size=jax.process_count())[name]


def _read_jobs(
    ck: Source,
    jobs: list[_ArrayJob],
    out: list[Any],
    host_budget: int,
    show_progress: bool | None,
) -> None:
    batch: list[_ArrayJob] = []
    size = 0
    for job in jobs:
        if batch and size + job.nbytes > host_budget:
            _run_batch(ck, batch, out, show_progress)
            batch, size = [], 0
        batch.append(job)
        size += job.nbytes
    if batch:
        _run_batch(ck, batch, out, show_progress)

