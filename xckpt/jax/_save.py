"""Save a pytree of jax.Arrays (any sharding), numpy arrays and scalars.

Call protocol (every process of a multi-process JAX job calls [`save`][xckpt.jax._save.save]
with the same tree structure):

    1. agree on a save_id (the caller's, or process 0's random id broadcast
       with jax.experimental.multihost_utils);
    2. each process opens one xckpt.Writer (rank = jax.process_index(),
       world_size = jax.process_count()); a barrier follows, so an overwritten
       save is withdrawn everywhere before anyone writes;
    3. each process writes the boxes it is the writer of: for every distinct
       box of an array, `xckpt.layout.choose_writer` picks one process among
       those whose devices hold it (spread by a hash, not all on process 0),
       and within a process each distinct box is written once;
    4. each process commits (data durable, then ranks/<rank>.json);
    5. after a barrier, process 0 writes xckpt.json (`xckpt.finalize`), and a
       last barrier makes every process return only once the save is complete.

With `async_save=True` steps 1-2 and the device-to-host copies of step 3
run before `save` returns (the host copies are owned by the save: a later
donation or deletion of the arrays cannot change the checkpoint); the writes,
the commit and step 5 run on the save thread (`xckpt._async`), and the
returned future resolves once the checkpoint is complete. The save thread's
barriers go through the JAX distributed client's key-value barrier (as orbax's
async checkpointer does), not a device collective that could interleave with
the training step's; a process that fails there makes the others raise after
`BARRIER_TIMEOUT_S`.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import os
import secrets
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from xckpt._async import submit, wait_pending
from xckpt._staging import StagingPool
from xckpt.errors import ObjectError, UnsupportedPlacementError, XckptError
from xckpt.layout import Box, choose_writer
from xckpt.manifest import DTYPES, Manifest
from xckpt.native.writer import ALL_HELD, Dedup, Writer, finalize
from xckpt.storage import Location

from ._staging import stage_host
from ._tree import device_boxes, flatten, placement_info

__all__ = ["save"]

_OBJECT_TYPES = (bool, int, float, str, bytes)
#: How long the save thread of an async multi-process save waits at a barrier.
BARRIER_TIMEOUT_S = 600
# Saves of this process, numbered: every process saves in the same order, so the
# number makes each save's key-value barrier ids unique even when a save_id repeats.
_seq = itertools.count()


def _agree_save_id(save_id: str | int | None) -> str | None:
    if jax.process_count() == 1:
        return None if save_id is None else str(save_id)
    if save_id is not None:
        return str(save_id)
    from jax.experimental import multihost_utils

    # uint32 words survive jax's default 32-bit mode unchanged.
    mine = np.frombuffer(secrets.token_bytes(16), dtype=np.uint32).copy()
    agreed = multihost_utils.broadcast_one_to_all(mine)
    return "jax-" + np.asarray(agreed, dtype=np.uint32).tobytes().hex()


def _barrier(tag: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(tag)


def _thread_barrier(tag: str) -> None:
    """A barrier the save thread may call: the distributed client's, no device work."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise XckptError(
            "an async multi-process save needs jax.distributed.initialize() (its key-value barrier); "
            "initialise it, or save with async_save=False"
        )
    client.wait_at_barrier(tag, BARRIER_TIMEOUT_S * 1000)


def _check_dtype(name: str, dtype: Any) -> None:
    if np.dtype(dtype).name not in DTYPES:
        raise ObjectError(
            f"tensor {name!r} has dtype {np.dtype(dtype)}, which xckpt cannot store; supported: "
            f"{', '.join(DTYPES)}. Cast it (e.g. x.astype(jnp.float32)) before saving"
        )


def _plan_jax_array(w: Writer, name: str, arr: jax.Array, me: int) -> list[tuple[Box, Any]]:
    """Declare `name` and return the (box, shard) pairs this process writes."""
    shape = tuple(int(s) for s in arr.shape)
    _check_dtype(name, arr.dtype)
    w.declare(name, np.dtype(arr.dtype), shape, placement=placement_info(arr.sharding, len(shape)))
    holders: dict[Box, set[int]] = {}
    for dev, box in device_boxes(arr.sharding, shape, name, addressable=False).items():
        holders.setdefault(box, set()).add(dev.process_index)
    mine = device_boxes(arr.sharding, shape, name, addressable=True)
    local: dict[Box, Any] = {}
    for shard in arr.addressable_shards:
        local.setdefault(mine[shard.device], shard)
    out = []
    for i, box in enumerate(sorted(holders, key=lambda b: (b.offset, b.shape))):
        if box.empty or choose_writer(name, i, sorted(holders[box])) != me:
            continue
        shard = local.get(box)
        if shard is None:  # cannot happen for a consistent sharding; fail loudly if it does
            raise UnsupportedPlacementError(
                f"tensor {name!r}: process {me} was chosen to write box {box} but holds no "
                "device with it; the array's sharding disagrees with its addressable shards"
            )
        out.append((box, shard))
    return out


def _named_leaves(tree: Any) -> list[tuple[str, Any]]:
    """The tree's leaves by name, each of a type `save` stores.

    Raises:
        ObjectError: a bare array (no name), or a leaf of another type.
    """
    named, _ = flatten(tree)
    for name, leaf in named:
        if name == "":
            raise ObjectError(
                "save() got a bare array, not a tree: wrap it in a dict, e.g. {'x': array}, so "
                "it has a name"
            )
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic) + _OBJECT_TYPES):
            raise ObjectError(
                f"leaf {name!r} is a {type(leaf).__name__}; xckpt.jax.save stores jax.Arrays, "
                "numpy arrays and bool/int/float/str/bytes. Convert it, or leave it out"
            )
    return named


def _shards_to_host(
    plans: list[tuple[str, tuple[int, ...], list[tuple[Box, Any]]]], staging: StagingPool | None, async_save: bool
) -> list[tuple[str, np.ndarray, tuple[int, ...] | None, tuple[int, ...] | None]]:
    """Host copies of the shards this process writes: every device-to-host copy is started
    before the first is waited for."""
    for _, _, parts in plans:
        for _, shard in parts:
            shard.data.copy_to_host_async()
    host: list[tuple[str, np.ndarray, tuple[int, ...] | None, tuple[int, ...] | None]] = []
    for name, shape, parts in plans:
        for box, shard in parts:
            # An async save owns its copy: np.asarray may alias a CPU device buffer
            # that a later donation reuses.
            if staging is not None:
                data = stage_host(staging, (name, box.offset), shard.data)
            else:
                data = np.array(shard.data, copy=True) if async_save else np.asarray(shard.data)
            host.append((name, data, shape, box.offset))
    return host


def save(
    tree: Any,
    path: Location,
    *,
    save_id: str | int | None = None,
    overwrite: bool = False,
    storage: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    show_progress: bool | None = None,
    async_save: bool = False,
    staging: StagingPool | None = None,
    compression: str | None = None,
    dedup: Dedup | None = None,
) -> Manifest | cf.Future[Manifest]:
    """Save a pytree of jax.Arrays, numpy arrays and scalars to `path`.

    Every process of a multi-process job must call this with the same tree
    structure. Each process writes only its addressable shards, and of a box
    held by several devices only the copy the layout rule assigns to it.

    Args:
        tree: nested dicts, lists and tuples whose leaves are jax.Arrays (any
            sharding), numpy arrays or numpy scalars (stored as tensors), or
            Python `bool`/`int`/`float`/`str`/`bytes` (stored as
            objects). Names are key paths joined with `"."`.
        path: directory or kvstore URL.
        save_id: shared id of this save; default: process 0's random id,
            broadcast (one process: derived from the location).
        overwrite: replace an existing checkpoint at `path`.
        storage: `"files"`, `"ocdbt"` or `"plain"`; default files for a local directory,
            else ocdbt (see [`xckpt.Writer`][xckpt.Writer]).
        metadata: JSON-able user metadata stored in the manifest.
        show_progress: progress bar (default: when stderr is a TTY).
        async_save: return a future once every shard this process writes is
            copied to host; the write runs on the save thread.
        staging: host buffers reused across saves (`xckpt.manager.HostBuffers`,
            what [`xckpt.CheckpointManager`][xckpt.CheckpointManager] passes): each box is copied into
            its buffer instead of a fresh host copy (see `xckpt.jax._staging`).
        compression, dedup: as for [Writer][xckpt.Writer] (array chunks' codec: None,
            `"zstd"` or `"shuffle-zstd"`; a manager's previous step to reference).

    Returns:
        This process's manifest (the whole checkpoint's when single-process),
        or with `async_save` a `concurrent.futures.Future` that
        resolves to it once the checkpoint is complete.

    Raises:
        ObjectError: a leaf has an unsupported type or dtype.
        CheckpointExistsError: `path` holds a save and `overwrite` is False.
    """
    named = _named_leaves(tree)
    wait_pending()
    me, world = jax.process_index(), jax.process_count()
    sid = _agree_save_id(save_id)
    if overwrite and world == 1 and sid is None:
        sid = "s-" + secrets.token_hex(8)
    w = Writer(path, rank=me, world_size=world, save_id=sid, overwrite=overwrite, storage=storage,
               metadata=metadata, progress=show_progress, inflight_bytes=ALL_HELD, compression=compression,
               dedup=dedup)  # all host arrays are held
    _barrier(f"xckpt-open-{w.save_id}")
    try:
        if staging is not None:
            staging.begin()
        plans: list[tuple[str, tuple[int, ...], list[tuple[Box, Any]]]] = []
        host: list[tuple[str, np.ndarray, tuple[int, ...] | None, tuple[int, ...] | None]] = []
        for name, leaf in named:  # declared in tree order, so the manifest lists names that way
            if isinstance(leaf, jax.Array):
                plans.append((name, tuple(leaf.shape), _plan_jax_array(w, name, leaf, me)))
            elif isinstance(leaf, (np.ndarray, np.generic)):
                arr = np.asarray(leaf)
                _check_dtype(name, arr.dtype)
                w.declare(name, arr.dtype, arr.shape)
                if choose_writer(name, 0, range(world)) == me:
                    if staging is not None:
                        arr = stage_host(staging, (name, None), arr)
                    elif async_save:
                        arr = arr.copy()
                    host.append((name, arr, None, None))
            else:
                w.write_object(name, leaf)
        host += _shards_to_host(plans, staging, async_save)
        if staging is not None:
            staging.end()
    except BaseException as e:
        w._failed(e)  # give this process's claim of the location back
        raise
    path_s = path if isinstance(path, Mapping) else os.fspath(path)  # a kvstore spec dict stays one
    n = next(_seq)

    def write() -> Manifest:
        try:
            for name, arr, shape, offset in host:
                w.write(name, arr, global_shape=shape, offset=offset)
            manifest = w.commit()
        except BaseException as e:
            w._failed(e)  # give this process's claim of the location back
            raise
        if world > 1:
            barrier = _thread_barrier if async_save else _barrier
            barrier(f"xckpt-commit-{w.save_id}-{n}")
            if me == 0:
                finalize(path_s, world, w.save_id)
            barrier(f"xckpt-final-{w.save_id}-{n}")
        return manifest

    return submit(write) if async_save else write()
