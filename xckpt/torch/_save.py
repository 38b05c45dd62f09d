"""`xckpt.torch.save`: every rank writes its own boxes; replicas are written once.

Call protocol (every rank of the process group calls `save` with its own
state dict, in the same order as its other collectives):

Coordinated mode (`rank_local=False` and a process group is initialised):

1. rank 0 draws a random save_id and broadcasts it (skipped when `save_id=`
   is given);
2. each rank plans locally (no collective), opens `xckpt.Writer` with that
   save_id, writes the boxes it owns and its objects, and commits
   (`ranks/<rank>.json`);
3. all ranks exchange success or failure (one `all_gather_object`);
4. rank 0 calls [`xckpt.finalize`][xckpt.finalize] (writes `xckpt.json`) and broadcasts
   its outcome, which doubles as the final barrier.

A failure on any rank makes every rank raise (the failing rank its own error,
the others [`XckptError`][xckpt.errors.XckptError] naming it), so no rank is left
waiting in a collective.

Rank-local mode (`rank_local=True`, or no process group): steps 1, 3 and 4
are skipped; nothing is sent between ranks. The save_id is the caller's
`save_id=` or derived from the location, and readers merge the rank
manifests themselves.

Dedup: a box held by several ranks (`Replicate()` axes, or a plain tensor
that every rank holds) is written by the one rank
[`xckpt.layout.choose_writer`][xckpt.layout.choose_writer] picks; every rank computes the same answer.
A plan is reused while the state dict's layout (names, shapes, dtypes, meshes,
placements, local shapes) is unchanged (`xckpt.torch._save_plan`); any change plans
again, so a state dict whose structure changed is always saved whole.

With `async_save` and `staging` (the checkpoint manager's saves) the foreground is the
staging copy alone: the writer is opened, and the location claimed, on the write thread.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import functools
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from xckpt import layout as L
from xckpt._async import submit, wait_pending
from xckpt._staging import StagingPool
from xckpt.errors import XckptError
from xckpt.manifest import Manifest, numpy_dtype, paused_gc
from xckpt.native.writer import ALL_HELD, Dedup, Writer, finalize
from xckpt.storage import Location
from xckpt.torch._dist import distributed, rank_world, share_outcome
from xckpt.torch._dtypes import as_numpy
from xckpt.torch._save_plan import Plans
from xckpt.torch._staging import Stager, wait_events
from xckpt.torch._state_dict import KEYS_META, PerRank, flatten  # noqa: F401 (PerRank: the docstring links it here)
from xckpt.torch.value_groups import save_value_groups, split_value_groups

__all__ = ["save"]

_side_groups: dict[Any, Any] = {}
#: Each group's last plan, reused while the state's layout is unchanged.
_plans = Plans()


def _host(part: Any, copy: bool) -> tuple[np.ndarray, Any]:
    """numpy data of a box part; a copy when `copy` (async) or the tensor is on a device.

    Returns (array, event to wait on before the array is read, or None).
    """
    if isinstance(part, np.ndarray):
        return (part.copy() if copy else part), None
    t = part.detach()
    if t.device.type == "cpu":
        return as_numpy(t.clone() if copy else t), None
    if t.device.type == "meta":
        raise XckptError("a tensor on the meta device holds no data and cannot be saved")
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    host.copy_(t, non_blocking=True)
    event = None
    if t.device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(t.device))
    return as_numpy(host), event


class _CopyingWriter:
    """Writer proxy for async saves: arrays handed to `write` are copied first."""

    def __init__(self, writer: Any) -> None:
        self._w = writer

    def write(self, name: str, array: Any, **kw: Any) -> None:
        self._w.write(name, np.array(array, copy=True), **kw)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._w, attr)


def _side_group(dist: Any, pg: Any) -> Any:
    """A gloo group over `pg`'s ranks for the background thread's collectives."""
    key = id(pg) if pg is not None else None
    grp = _side_groups.get(key)
    if grp is None:
        ranks = sorted(dist.get_process_group_ranks(pg if pg is not None else dist.group.WORLD))
        grp = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
        _side_groups[key] = grp
    return grp


@paused_gc()  # tens of thousands of small objects, none in a cycle (see paused_gc)
def save(
    state_dict: Mapping[str, Any],
    path: Location,
    *,
    process_group: Any = None,
    rank_local: bool = False,
    async_save: bool = False,
    value_groups: Sequence[Any] | None = None,
    save_id: str | int | None = None,
    overwrite: bool = False,
    show_progress: bool | None = None,
    storage: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    staging: StagingPool | None = None,
    compression: str | None = None,
    dedup: Dedup | None = None,
) -> Manifest | cf.Future[Manifest]:
    """Save this rank's state dict; every rank of the group calls it.

    Args:
        state_dict: nested dicts of tensors (plain: replicated, written once),
            DTensors (any mesh and placements except `Partial`), legacy
            `ShardedTensor`s, numpy arrays, and objects (JSON values, bytes;
            [`PerRank`][xckpt.torch._save.PerRank] for per-rank values). Nested names join with ".".
        path: a directory, kvstore URL or kvstore spec dict (as [`xckpt.save`][xckpt.save]).
        process_group: the group whose ranks save together (default: world).
        rank_local: no rank talks to another; each writes its data and its manifest.
        async_save: return a future once device tensors are copied to host;
            the write runs in a background thread.
        value_groups: value-partitioned groups to declare (see
            `xckpt.torch.value_groups`).
        save_id: id shared by all ranks (default: random in coordinated mode,
            derived from the location in rank-local mode).
        overwrite: replace an existing checkpoint at `path`.
        show_progress: progress bar (default: when stderr is a TTY).
        storage, metadata: as for [`xckpt.Writer`][xckpt.Writer] (how `data/<rank>/` is
            organised; JSON metadata recorded in the manifest). The key
            `"torch_keys"` is the save's own: the key types of containers whose
            keys are not plain strings (an optimizer's int parameter ids), so a
            load can rebuild them in a fresh job's empty mappings.
        staging: host buffers reused across saves (`xckpt.manager.HostBuffers`,
            what [`xckpt.CheckpointManager`][xckpt.CheckpointManager] passes): each box is copied into
            its buffer instead of a fresh host copy; CUDA tensors on a side stream,
            without waiting for the GPU (the write thread waits; see
            `xckpt.torch._staging`). The pool must not be passed to another
            save before this one's write has finished (`save` itself waits for
            the previous async save first).
        compression, dedup: as for [Writer][xckpt.Writer] (array chunks' codec: None,
            `"zstd"` or `"shuffle-zstd"`; a manager's previous step to reference).

    Returns:
        This rank's manifest, or with `async_save` a
        `concurrent.futures.Future` that resolves to it once the
        checkpoint is complete (on every rank).

    Raises:
        UnsupportedPlacementError: a DTensor has a `Partial` placement.
        LayoutError: a local shard does not match its placements.
        ObjectError: a value cannot be stored.
        CheckpointExistsError: `path` holds a checkpoint and `overwrite` is False.
    """
    wait_pending()
    rank, world, group_rank = rank_world(process_group)
    dist = distributed()
    coordinated = dist is not None and not rank_local and world > 1
    pg = process_group
    loc_path = path if isinstance(path, Mapping) else os.fspath(path)  # a kvstore spec dict stays one

    if coordinated and save_id is None:
        token = [secrets.token_hex(8) if rank == 0 else None]
        dist.broadcast_object_list(token, group=pg, group_src=0)
        save_id = f"s-{token[0]}"
    side = _side_group(dist, pg) if coordinated and async_save else pg
    fail_all = functools.partial(_fail_all, side=side, world=world if coordinated else 1, where=loc_path)

    # Foreground: plan, open the writer (unless deferred), take host copies (async).
    writer = None
    try:
        keys: dict[str, Any] = {}
        flat, _ = flatten(state_dict, keys)
        if keys:  # what a load into a fresh job's empty mappings needs (_state_dict.expand)
            metadata = {**(metadata or {}), KEYS_META: keys}
        plans, owned = split_value_groups(flat, value_groups)
        jobs, objects = _plans.plan(flat, set(owned), rank, world, group_rank, pg)
        open_writer = functools.partial(
            Writer, loc_path, rank=rank, world_size=world, save_id=save_id, overwrite=overwrite,
            progress=show_progress, storage=storage, metadata=metadata, compression=compression, dedup=dedup,
            inflight_bytes=ALL_HELD,  # every host array below is held until the save ends
        )
        # the manager's saves (staged, no value groups) claim the location on the write thread
        writer = None if async_save and staging is not None and not plans else open_writer()
        arrays, staged_events = _host_copies(jobs, staging, async_save)
        if async_save:  # the caller may change its objects once we return
            objects = [(name, copy.deepcopy(value), per_rank) for name, value, per_rank in objects]
        if writer is not None:
            vg_writer = _CopyingWriter(writer) if async_save else writer
            save_value_groups(vg_writer, flat, plans, rank, world)
    except BaseException as e:
        if writer is not None:
            writer._failed(e)  # give this rank's claim of the location back
        # Peers learn of it through the same exchange they make after writing.
        fail_all(e)
        raise

    def write() -> Manifest:
        err: BaseException | None = None
        manifest: Manifest | None = None
        w = writer
        try:
            w = w if w is not None else open_writer()
            wait_events(staged_events)  # staging copies still in flight (CUDA side streams)
            manifest = _write_rank(w, jobs, arrays, objects)
        except Exception as e:  # exchanged with the other ranks, then re-raised
            err = e
            if w is not None:
                w._failed(e)  # give this rank's claim of the location back
        fail_all(err)
        if coordinated:
            _finalize_all(dist, side, rank, world, loc_path, str(save_id))
        if manifest is None:  # fail_all raised for any failure; this guards the type only
            raise XckptError(f"save to {loc_path!r}: the writer committed no manifest")
        return manifest

    return submit(write) if async_save else write()


def _fail_all(err: BaseException | None, *, side: Any, world: int, where: Any) -> None:
    """Exchange outcomes; every rank raises when any failed."""
    share_outcome(
        err,
        group=side,
        world=world,
        error=XckptError,
        what=f"save to {where!r}",
        fix="The location is not a complete checkpoint; fix the error and save again",
    )


def _finalize_all(dist: Any, side: Any, rank: int, world: int, where: Any, save_id: str) -> None:
    """Rank 0 merges the rank manifests; every rank learns whether it could."""
    outcome: list[Any] = [None]
    if rank == 0:
        try:
            finalize(where, world, save_id)
        except Exception as e:  # reported to every rank below, then re-raised here
            outcome[0] = f"{type(e).__name__}: {e}"
            dist.broadcast_object_list(outcome, group=side, group_src=0)
            raise
    dist.broadcast_object_list(outcome, group=side, group_src=0)
    if outcome[0] is not None:
        raise XckptError(f"save to {where!r}: rank 0 could not finalize it: {outcome[0]}")


def _host_copies(
    jobs: Sequence[Any], staging: StagingPool | None, async_save: bool
) -> tuple[list[tuple[Any, L.Box | None, np.ndarray]], list[Any]]:
    """Every box's host copy (staged into the pool, or fresh), and the staging's events."""
    arrays: list[tuple[Any, L.Box | None, np.ndarray]] = []
    events = []
    stager = Stager(staging) if staging is not None else None
    for job in jobs:
        for box, part in job.boxes:
            if stager is not None:
                arr = stager.stage((job.name, None if box is None else box.offset), part)
            else:
                arr, ev = _host(part, copy=async_save)
                if ev is not None:
                    events.append(ev)
            arrays.append((job, box, arr))
    for ev in events:
        ev.synchronize()
    return arrays, stager.finish() if stager is not None else []


def _write_rank(
    writer: Writer, jobs: Sequence[Any], arrays: Sequence[tuple[Any, L.Box | None, np.ndarray]], objects: Any
) -> Manifest:
    """This rank's tensors and objects written in the state dict's order, then committed."""
    whole = {job.name: arr for job, box, arr in arrays if box is None}
    for job in jobs:  # in the state dict's order, so the manifest keeps it
        arr = whole.get(job.name)
        if arr is not None:
            writer.write(job.name, arr)  # a whole tensor: declared as it is written
        else:
            writer.declare(job.name, _np_dtype(job.dtype), job.shape, placement=job.placement)
    for job, box, arr in arrays:
        if box is not None:
            writer.write(job.name, arr, global_shape=job.shape, offset=box.offset, placement=job.placement)
    for name, value, per_rank in objects:
        writer.write_object(name, value, per_rank=per_rank)
    return writer.commit()


def _np_dtype(name: str) -> Any:
    return numpy_dtype(name)
