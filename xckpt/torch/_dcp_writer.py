"""`XckptStorageWriter`: torch DCP's `dcp.save` / `dcp.async_save` writing an ordinary xckpt checkpoint.

A DCP user switches with one argument:

    dcp.save(state_dict, storage_writer=xckpt.torch.XckptStorageWriter(path))

What lands at `path` is what `xckpt.torch.save` writes (grids, checksums, signed rank
manifests, the conditional claim and atomic commit), each tensor under its DCP fully
qualified name (the flattened name DCP plans with, `optim.state.w.exp_avg`), so
`xckpt.open`, `xckpt.torch.load` and `xckpt.jax.load` read it like any other.

Call protocol (DCP's, numbered as in `torch.distributed.checkpoint.StorageWriter`):

0. (all ranks) `reset(checkpoint_id)` when `dcp.save(..., checkpoint_id=...)` names a
   location: the writer moves there (and refuses a location that holds a checkpoint,
   unless `overwrite`, with `CheckpointExistsError` straight out of `dcp.save`).
1. (all ranks) `set_up_storage_writer(is_coordinator, rank=..., use_collectives=...)`:
   records this rank and the mode.
2. (all ranks) `prepare_local_plan(plan)`: unchanged.
3. (coordinator) `prepare_global_plan(plans)`: draws the save id and hands every rank
   `(save id, its rank, world size)` in its plan's `storage_data`; that is the only
   thing ranks learn from each other, and DCP carries it.
4. (all ranks) `write_data(plan, planner)`: one `xckpt.Writer` per rank claims
   `ranks/<rank>.json`, writes the rank's boxes (DCP has already chosen one writer per
   replicated tensor and object) and objects, and commits its rank manifest.
5. (coordinator) `finish(metadata, results)`: once every rank has committed (DCP's own
   gather tells), writes the merged `xckpt.json` (`xckpt.finalize`).

The writer runs no collective of its own, so `dcp.async_save` on any process group, in
a thread or in DCP's checkpoint process, is safe. With `dcp.save(..., use_collectives=False)`
(rank-local) step 3 runs on every rank for itself, step 5 writes nothing, the ranks
agree on the save id by the location (or `save_id=`), and readers merge the rank
manifests; the world size is then the default group's, and a whole tensor (which every
rank holds: SPMD) is written by one rank, as `xckpt.torch.save` chooses it. Boxes that
several ranks hold in part (HSDP's replicated shards) are written by each of them and
such a rank-local checkpoint is refused on read (overlapping boxes): save those with
collectives.

Objects (DCP's `BYTE_IO` items: ints, floats, lr-scheduler and dataloader dicts) are
stored as JSON when the value is made of plain JSON types (tuples, bytes and int keys
included, as `xckpt.torch.save` stores them), so reading them needs no `allow_pickle`.
Any other value is stored as the `torch.save` bytes DCP itself would write, listed in
the manifest metadata under `torch_dcp.pickled/<rank>`;
[XckptStorageReader][xckpt.torch.XckptStorageReader] loads those only with
`allow_pickle=True` (to `xckpt.open` they are plain bytes).

With DCP's plan caching (`DefaultSavePlanner(enable_plan_caching=True)`) a cached plan
carries the save id of the save that made it: saving to a new location each time (the
usual one directory per step) is unaffected, overwriting one location is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from xckpt.errors import CheckpointExistsError, ObjectError, XckptError
from xckpt.layout import choose_writer
from xckpt.manifest import MAX_OBJECT_DEPTH, STORAGE_KINDS
from xckpt.native._zarr import NativeStorage
from xckpt.native.writer import ALL_HELD, INFLIGHT_BYTES, Writer, finalize
from xckpt.storage import Location
from xckpt.torch._dist import distributed
from xckpt.torch._dtypes import as_numpy

__all__ = ["XckptStorageWriter", "PICKLED_KEY"]

#: Manifest metadata key (followed by "/<rank>") listing the objects a rank stored as
#: `torch.save` bytes because their value is not plain JSON.
PICKLED_KEY = "torch_dcp.pickled"

_JSON_SCALARS = (type(None), bool, int, float, str, bytes)


@dataclasses.dataclass(frozen=True)
class _Place:
    """What one rank's plan carries from the coordinator: the save and the rank's place in it.

    `rank_local`: no global plan chose one writer per replicated item, so a whole tensor
    (which every rank holds, SPMD) is written by the rank `xckpt.layout.choose_writer` picks.
    """

    save_id: str | None
    rank: int
    world_size: int
    rank_local: bool = False


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether `value` is built of exactly the types `xckpt.torch.save` stores as JSON
    (subclasses such as namedtuples, enums or `torch.Size` are not: they would come back
    as their base type)."""
    if depth > MAX_OBJECT_DEPTH:
        return False
    t = type(value)
    if t in _JSON_SCALARS:
        return True  # (non-finite floats and big ints are tagged, as xckpt.torch.save stores them)
    if isinstance(value, np.generic):
        return value.dtype.kind in "biuf"  # numpy scalars come back as their numpy type
    if t in (list, tuple):
        return all(_plain(v, depth + 1) for v in value)
    if t is dict:
        return all(type(k) in (str, int, bool, type(None)) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _host(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor, or a host copy of a device tensor."""
    t = t.detach()
    if t.device.type == "meta":
        raise XckptError("a tensor on the meta device holds no data and cannot be saved")
    if t.device.type != "cpu":
        t = t.to("cpu")
    return as_numpy(t)


class Located:
    """What DCP asks of a storage layer about its location: the `checkpoint_id` it was given
    (a path, a URL or a kvstore spec dict), and which ids it takes."""

    path: Location

    @property
    def checkpoint_id(self) -> Location:
        """The location this storage layer saves to or loads from."""
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike, Mapping))


class XckptStorageWriter(Located, StorageWriter):
    """A torch DCP `StorageWriter` that writes an xckpt checkpoint (see the module docstring).

    Args:
        path: the checkpoint's location: a directory, a kvstore URL or a kvstore spec
            dict, as `xckpt.torch.save` takes (`dcp.save(..., checkpoint_id=...)` moves it).
        overwrite: replace a checkpoint already at the location (atomically, as
            `xckpt.torch.save(..., overwrite=True)` does); without it such a location is
            refused with `CheckpointExistsError`.
        storage: how each rank's data is organised (`"files"`, `"ocdbt"`, `"plain"`; the
            default suits the location), as for [Writer][xckpt.Writer].
        metadata: JSON metadata recorded in the manifest.
        save_id: the id every rank's manifest carries. Default: drawn by the coordinator;
            in a rank-local save (`use_collectives=False`), derived from the location. A
            rank-local save that overwrites needs one (e.g. the step).

    Raises:
        CheckpointExistsError: `path` holds an xckpt checkpoint and `overwrite` is False.
        XckptError: `storage` or `metadata` cannot be used.
    """

    def __init__(
        self,
        path: Location,
        *,
        overwrite: bool = False,
        storage: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        save_id: str | int | None = None,
    ) -> None:
        super().__init__()
        if storage is not None and storage not in STORAGE_KINDS:
            raise XckptError(f"storage must be one of {', '.join(map(repr, STORAGE_KINDS))}, got {storage!r}")
        meta = dict(metadata or {})
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise XckptError(f"XckptStorageWriter: metadata must be JSON (dicts, lists, str, numbers): {e}") from e
        self.overwrite = overwrite
        self.storage = storage
        self.metadata = meta
        self.save_id = None if save_id is None else str(save_id)
        self.path: Location = path
        self._rank = 0
        self._collective = True
        self._coordinator_id: str | None = None
        self._world = 1
        self.reset(path)

    # -- DCP protocol ---------------------------------------------------------------

    def reset(self, checkpoint_id: Location | None = None) -> None:
        """A new save begins, at `checkpoint_id` when given."""
        if checkpoint_id is not None:
            self.path = checkpoint_id if isinstance(checkpoint_id, Mapping) else os.fspath(checkpoint_id)
            if not self.overwrite:
                self._refuse_existing()
        self._coordinator_id = None

    def _refuse_existing(self) -> None:
        """Refuse a location holding a save: its merged manifest, or this rank's manifest.

        Only this rank's own manifest counts: in a rank-local save a faster rank may have
        committed its manifest before this one constructs its writer. (The claim in
        `write_data` refuses the rest, and races, in any case.)"""
        st = NativeStorage(self.path)
        dist = distributed()
        mine = f"ranks/{dist.get_rank() if dist is not None else 0}.json"
        if st.read_key("xckpt.json") is not None or st.read_key(mine) is not None:
            raise CheckpointExistsError(
                f"checkpoint {st.path!r} already holds an xckpt checkpoint; pass "
                "XckptStorageWriter(path, overwrite=True) to replace it, or save to a new path"
            )

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Record this rank (DCP's group rank) and whether the save is coordinated."""
        rank = kwargs.get("rank")
        self._rank = int(rank) if rank is not None else 0
        self._collective = bool(kwargs.get("use_collectives", True))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Give each rank its place in the save: (save id, rank, world size)."""
        if not self._collective:
            dist = distributed()
            world = dist.get_world_size() if dist is not None else 1
            place = _Place(self.save_id, self._rank, world, rank_local=True)
            return [dataclasses.replace(p, storage_data=place) for p in plans]
        save_id = self.save_id if self.save_id is not None else f"s-{secrets.token_hex(8)}"
        self._coordinator_id, self._world = save_id, len(plans)
        return [dataclasses.replace(p, storage_data=_Place(save_id, i, len(plans))) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items with one `xckpt.Writer` and commit its rank manifest."""
        place = plan.storage_data
        if not isinstance(place, _Place):
            raise XckptError(
                f"checkpoint {self.path!r}: the save plan carries no place from "
                "XckptStorageWriter.prepare_global_plan (a planner replaced storage_data); "
                "use DCP's default planners or keep storage_data"
            )
        # Host tensors are views of the caller's (or DCP's staged) tensors: held until the
        # commit and written in one go. Device tensors are copied: flushed as they go.
        on_host = all(it.type == WriteItemType.BYTE_IO or _on_cpu(planner, it) for it in plan.items)
        writer = Writer(
            self.path, rank=place.rank, world_size=place.world_size, save_id=place.save_id,
            overwrite=self.overwrite, storage=self.storage, metadata=self.metadata,
            inflight_bytes=ALL_HELD if on_host else INFLIGHT_BYTES,
        )
        results: list[WriteResult] = []
        pickled: list[str] = []
        try:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    n = self._write_object(writer, item, planner, pickled)
                else:
                    n = self._write_tensor(writer, item, planner, place)
                results.append(WriteResult(index=item.index, size_in_bytes=n, storage_data=place.rank))
            if pickled:
                writer.metadata[f"{PICKLED_KEY}/{place.rank}"] = pickled
            writer.commit()
        except BaseException as e:
            writer._failed(e)  # give this rank's claim of the location back
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    @staticmethod
    def _write_tensor(writer: Writer, item: WriteItem, planner: SavePlanner, place: _Place) -> int:
        td = item.tensor_data
        if td is None:
            raise XckptError(f"DCP write item {item.index.fqn!r} is a tensor without tensor_data")
        size = tuple(td.size)
        whole = tuple(td.chunk.sizes) == size
        if whole and place.rank_local and choose_writer(item.index.fqn, 0, range(place.world_size)) != place.rank:
            writer.declare(item.index.fqn, _np_dtype(td.properties.dtype), size)  # another rank writes it
            return 0
        data = planner.resolve_data(item)
        if not isinstance(data, torch.Tensor):
            raise XckptError(f"DCP write item {item.index.fqn!r}: the planner resolved a {type(data).__name__}, not a tensor")
        arr = _host(data)
        if whole:
            writer.write(item.index.fqn, arr)  # the whole tensor
        else:
            writer.write(item.index.fqn, arr, global_shape=size, offset=tuple(td.chunk.offsets))
        return int(arr.nbytes)

    @staticmethod
    def _write_object(writer: Writer, item: WriteItem, planner: SavePlanner, pickled: list[str]) -> int:
        name = item.index.fqn
        lookup = getattr(planner, "lookup_object", None)
        if lookup is not None:
            value = lookup(item.index)
            if _plain(value):
                try:
                    writer.write_object(name, value)
                    return 0
                except ObjectError:
                    pass  # (nested too deep for JSON) stored as DCP's bytes below
        data = planner.resolve_data(item)
        raw = data.getvalue() if hasattr(data, "getvalue") else bytes(data)
        writer.write_object(name, raw)
        pickled.append(name)
        return len(raw)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Every rank has committed: write the merged `xckpt.json` (coordinated saves)."""
        if not self._collective or self._coordinator_id is None or self._world == 1:
            return  # rank-local: readers merge; one rank: its commit wrote xckpt.json
        finalize(self.path, self._world, self._coordinator_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path if isinstance(self.path, (str, os.PathLike)) else None)



def _np_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    return as_numpy(torch.empty(0, dtype=dtype)).dtype


def _on_cpu(planner: SavePlanner, item: WriteItem) -> bool:
    """Whether `item`'s data already lives in host memory (DCP's default planner only)."""
    sd = getattr(planner, "state_dict", None)
    v = sd.get(item.index.fqn) if isinstance(sd, Mapping) else None
    return isinstance(v, torch.Tensor) and v.device.type == "cpu"
