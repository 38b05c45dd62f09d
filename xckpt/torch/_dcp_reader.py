"""`XckptStorageReader`: torch DCP's `dcp.load` reading any checkpoint `xckpt.open` reads.



    dcp.load(state_dict, storage_reader=xckpt.torch.XckptStorageReader(path))

fills `state_dict` (tensors and DTensors at any placement and world size, objects) from
an xckpt checkpoint or any other format `xckpt.open` reads (torch DCP, DeepSpeed,
Megatron-Core, orbax, safetensors / Hugging Face, torch.save), seen through `rules`.
DCP's default planners (and `get_state_dict` / `set_state_dict`) plan the load from the
metadata this reader builds; no custom planner is needed.

Call protocol (DCP's, numbered as in `torch.distributed.checkpoint.StorageReader`):

0. construction, or `reset(checkpoint_id)`: the checkpoint is opened (metadata only),
   so a missing or unreadable checkpoint raises its typed error (`CheckpointNotFoundError`,
   `ManifestError`, ...) straight out of the constructor or `dcp.load`, not wrapped in
   DCP's `CheckpointException`.
1. (all ranks) `read_metadata()`: DCP's `Metadata` from the source's own: a
   `TensorStorageMetadata` per tensor whose chunks are the source's stored boxes, and a
   `BytesStorageMetadata` per object, and per value inside a dict or list object the way
   DCP flattens one (`optim.param_groups.0.lr` inside the object `optim.param_groups` of
   a torch DCP checkpoint), so DCP's planner matches the names it flattens.
2. (all ranks) `set_up_storage_reader(metadata, is_coordinator, rank=...)`: records the rank
   (per-rank objects are read by it).
3. / 4. `prepare_local_plan` / `prepare_global_plan`: unchanged.
5. (all ranks) `read_data(plan, planner)`: every tensor read item is served by one
   `Source.read_into` of the box it names (only those bytes are read, concurrently),
   straight into the tensor `planner.resolve_tensor` returns (a view of the caller's
   tensor or DTensor shard) when that lives in host memory, through a bounded host buffer
   otherwise; then `planner.commit_tensor`. Objects go to `planner.load_bytes` as
   `torch.save` bytes of their value; a value stored as `torch.save` bytes goes as stored
   (xckpt never unpickles it: DCP's planner does, as for its own checkpoints).

Errors inside steps 1-5 reach the caller as DCP wraps them: a `CheckpointException` whose
`failures[rank][0]` is the typed xckpt error. A target whose dtype differs from the stored
one is a `DtypeMismatchError` (DCP would cast silently); a `dtype` rule casts on read.
Objects that are pickles (a torch DCP checkpoint's non-tensor values, values an
[XckptStorageWriter][xckpt.torch.XckptStorageWriter] stored as `torch.save` bytes) are
read only with `allow_pickle=True`.
"""

from __future__ import annotations

import io
import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint._traverse import traverse_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from xckpt.errors import DtypeMismatchError, ManifestError, ShapeMismatchError, XckptError
from xckpt.formats import open as open_source
from xckpt.layout import Box
from xckpt.rules import Rules
from xckpt.source import ObjectQuery, Source
from xckpt.storage import Location
from xckpt.torch._dcp_writer import PICKLED_KEY, Located
from xckpt.torch._dist import distributed
from xckpt.torch._dtypes import as_numpy, known_dtype_name, torch_dtype
from xckpt.views import SourceView

__all__ = ["XckptStorageReader"]

#: Host bytes of buffers for targets outside host memory (device tensors) held per batch.
STAGING_BYTES = 256 << 20


class _SavedBytes(bytes):
    """A value's `torch.save` bytes as stored: handed to DCP's planner as they are (DCP
    unpickles them, as it does its own checkpoints' `BYTE_IO` items); xckpt never does."""


class _DcpPickles(SourceView):
    """An xckpt checkpoint whose objects listed under `torch_dcp.pickled/<rank>` in its
    metadata are `torch.save` bytes (what [XckptStorageWriter][xckpt.torch.XckptStorageWriter]
    stores for values that are not JSON): they count as pickles, and only with
    `allow_pickle=True` are their bytes passed on (as `_SavedBytes`) for DCP to load."""

    def __init__(self, source: Source, pickled: set[str], allow_pickle: bool) -> None:
        super().__init__(source)
        self._pickles = pickled
        self.allow_pickle = allow_pickle

    def pickled_objects(self) -> set[str]:
        return super().pickled_objects() | self._pickles

    def _get_objects(self, names: list[str], query: ObjectQuery) -> dict[str, Any]:
        refused = [n for n in names if n in self._pickles]
        if refused and not self.allow_pickle:
            raise self._pickle_refused(refused)
        got = super()._get_objects(names, query)
        for n in refused:
            got[n] = _SavedBytes(got[n])
        return got


def _pickled_names(metadata: Mapping[str, Any], where: str) -> set[str]:
    out: set[str] = set()
    for key, names in metadata.items():
        if not (isinstance(key, str) and key.startswith(PICKLED_KEY + "/")):
            continue
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise ManifestError(f"{where}: metadata {key!r} must be a list of object names; the manifest is corrupt")
        out.update(names)
    return out


def _world() -> int:
    dist = distributed()
    return dist.get_world_size() if dist is not None else 1


class XckptStorageReader(Located, StorageReader):
    """A torch DCP `StorageReader` over any checkpoint `xckpt.open` reads (see the module docstring).

    Args:
        path: the checkpoint: a directory or file, a kvstore URL or spec dict, an
            `http(s)://` URL, as `xckpt.open` takes (`dcp.load(..., checkpoint_id=...)` moves it).
        format: force a format (`xckpt`, `torch-dcp`, `orbax`, `safetensors`, `torch`,
            `deepspeed`, `megatron`) instead of detecting it.
        allow_pickle: let pickled objects be read (they can run code: trusted
            checkpoints only).
        rules: rename/transpose/cast/stack rules applied as a view (a list of dicts or a
            JSON/TOML file), as `xckpt.open` takes them.

    Raises:
        CheckpointNotFoundError: nothing recognised at `path`.
        XckptError: the checkpoint or the rules cannot be read.
    """

    def __init__(
        self,
        path: Location,
        *,
        format: str | None = None,  # noqa: A002
        allow_pickle: bool = False,
        rules: Rules = None,
    ) -> None:
        super().__init__()
        self.path: Location = path
        self.format = format
        self.allow_pickle = allow_pickle
        self.rules = rules
        self._source: Source | None = None
        self._used = False  # whether a load has read the open source's metadata
        self._rank = 0
        self._objects: dict[str, tuple[str, tuple[Any, ...]]] = {}  # DCP name -> (object, path inside)
        self._values: dict[str, Any] = {}
        self._open()

    # -- the source -----------------------------------------------------------------

    def _open(self) -> None:
        self.close()
        self._used = False
        raw = open_source(self.path, format=self.format, allow_pickle=self.allow_pickle)
        try:
            src: Source = raw
            if raw.format == "xckpt":
                pickled = _pickled_names(raw.metadata, f"checkpoint {raw.path!r}")
                if pickled:
                    src = _DcpPickles(raw, pickled, self.allow_pickle)
            self._source = src if self.rules is None else open_source(src, rules=self.rules)
        except BaseException:
            raw.close()
            raise

    @property
    def source(self) -> Source:
        """The opened checkpoint (as `xckpt.open` presents it, rules applied)."""
        src = self._source
        if src is None:
            self._open()
            src = self._source
        if src is None:
            raise XckptError(f"checkpoint {self.path!r}: could not be opened")
        return src

    def close(self) -> None:
        """Release the checkpoint's file handles (a later load reopens it)."""
        if self._source is not None:
            self._source.close()
            self._source = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_source=None, _values={})  # reopened where it is unpickled
        return state

    # -- DCP protocol ---------------------------------------------------------------

    def reset(self, checkpoint_id: Location | None = None) -> None:
        """A new load begins: (re)open the checkpoint, at `checkpoint_id` when given."""
        path = self.path
        if checkpoint_id is not None:
            path = checkpoint_id if isinstance(checkpoint_id, Mapping) else os.fspath(checkpoint_id)
        if self._source is not None and not self._used and path == self.path:
            return  # opened by the constructor and not read from yet: still the current state
        self.path = path
        self._open()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata of the checkpoint, from the source's own (no data is read)."""
        src = self.source
        self._used = True
        md: dict[str, Any] = {}
        for name in src.names():
            t = src.info(name)
            chunks = [ChunkStorageMetadata(offsets=torch.Size(c.offset), sizes=torch.Size(c.shape)) for c in t.chunks]
            md[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch_dtype(t.dtype)), size=torch.Size(t.shape), chunks=chunks
            )
        self._objects = self._object_leaves(src)
        for name in self._objects:
            md.setdefault(name, BytesStorageMetadata())
        meta = StorageMeta(checkpoint_id=self.path if isinstance(self.path, (str, os.PathLike)) else None,
                           load_id=uuid.uuid4().hex)
        return Metadata(state_dict_metadata=md, planner_data=src.nesting(), storage_meta=meta)

    def _object_leaves(self, src: Source) -> dict[str, tuple[str, tuple[Any, ...]]]:
        """Each object under its name, and each value inside a dict or list object under the
        name DCP flattens it to. Only replicated objects that can be read now are looked into
        (pickles only with `allow_pickle`); their values are kept for `read_data`."""
        names = src.object_names()
        out: dict[str, tuple[str, tuple[Any, ...]]] = {n: (n, ()) for n in names}
        skip = src.per_rank_objects() | (set() if self.allow_pickle else src.pickled_objects())
        readable = [n for n in names if n not in skip]
        self._values = src.objects(readable) if readable else {}
        for name, value in self._values.items():
            if isinstance(value, (Mapping, list, tuple)):

                def leaf(path: tuple[Any, ...], _v: Any, name: str = name) -> None:
                    out.setdefault(".".join(map(str, path)), (name, path[1:]))

                traverse_state_dict({name: value}, leaf)
        return out

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        rank = kwargs.get("rank")
        self._rank = int(rank) if rank is not None else 0

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fill every read item of this rank's plan (see the module docstring, step 5)."""
        tensors = [it for it in plan.items if it.type != LoadItemType.BYTE_IO]
        objects = [it for it in plan.items if it.type == LoadItemType.BYTE_IO]
        self._read_tensors(tensors, planner)
        if objects:
            self._read_objects(objects, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_tensors(self, items: Sequence[ReadItem], planner: LoadPlanner) -> None:
        src = self.source
        batch: list[tuple[str, Box, np.ndarray]] = []
        done: list[tuple[ReadItem, torch.Tensor, torch.Tensor | None]] = []
        staged = 0
        for item in items:
            target = planner.resolve_tensor(item).detach()
            name = item.storage_index.fqn
            lengths = tuple(int(n) for n in item.lengths)
            start = item.storage_index.offset or ()
            offset = tuple(int(a) + int(b) for a, b in zip(start, item.storage_offsets))
            self._check_target(name, target, lengths)
            if target.device.type == "cpu" and not (target.is_conj() or target.is_neg()):
                tmp = None
                out = as_numpy(target)
            else:
                tmp = torch.empty(lengths, dtype=target.dtype)
                out = as_numpy(tmp)
                staged += tmp.nbytes
            batch.append((name, Box(offset, lengths), out))
            done.append((item, target, tmp))
            if staged >= STAGING_BYTES:
                self._fill(src, batch, done, planner)
                batch, done, staged = [], [], 0
        self._fill(src, batch, done, planner)

    @staticmethod
    def _fill(
        src: Source,
        batch: list[tuple[str, Box, np.ndarray]],
        done: list[tuple[ReadItem, torch.Tensor, torch.Tensor | None]],
        planner: LoadPlanner,
    ) -> None:
        if not batch:
            return
        src.read_into(batch, show_progress=False)
        for item, target, tmp in done:
            if tmp is not None:
                target.copy_(tmp)
            planner.commit_tensor(item, target)

    def _check_target(self, name: str, target: torch.Tensor, lengths: tuple[int, ...]) -> None:
        t = self.source.info(name)
        stored, want = t.dtype, known_dtype_name(target.dtype)
        if want != stored:
            cast = (
                f", or cast on read with XckptStorageReader(..., rules=[{{'match': {name!r}, 'dtype': {want!r}}}])"
                if want is not None
                else ""
            )
            raise DtypeMismatchError(
                f"checkpoint {self.source.path!r}, tensor {name!r}: stored as {stored}, the target is "
                f"{target.dtype}. Load into a {stored} tensor{cast}"
            )
        if tuple(target.shape) != lengths:
            raise ShapeMismatchError(
                f"checkpoint {self.source.path!r}, tensor {name!r}: the planner resolved a target of shape "
                f"{tuple(target.shape)} for a read of {lengths}"
            )

    def _read_objects(self, items: Sequence[ReadItem], planner: LoadPlanner) -> None:
        src = self.source
        wanted = {self._objects.get(it.storage_index.fqn, (it.storage_index.fqn, ()))[0] for it in items}
        missing = [n for n in wanted if n not in self._values]
        values = dict(self._values)
        if missing:
            values.update(src.objects(missing, rank=self._rank, world_size=_world()))
        for it in items:
            obj, path = self._objects.get(it.storage_index.fqn, (it.storage_index.fqn, ()))
            value = _at(values[obj], path)
            if type(value) is _SavedBytes:  # already torch.save bytes (a pickle, allowed by the caller)
                planner.load_bytes(it, io.BytesIO(value))
                continue
            buf = io.BytesIO()
            torch.save(value, buf)
            buf.seek(0)
            planner.load_bytes(it, buf)



def _at(value: Any, path: Sequence[Any]) -> Any:
    """The value at DCP's flattened `path` inside `value` (DCP names dict keys by `str`)."""
    for p in path:
        if isinstance(value, Mapping):
            if p not in value:
                p = next(k for k in value if str(k) == p)
            value = value[p]
        else:
            value = value[int(p)]
    return value
