"""torch DCP output of `xckpt.convert`: per-rank `.distcp` files and a `.metadata`, chunk by chunk.

What `torch.distributed.checkpoint.save` writes with its defaults
(`FileSystemWriter`, `single_file_per_rank=True`, one thread, TORCH_SAVE
serialization; REFERENCE.md sections 2 and 9), from one process:

* `__<r>_0.distcp` for every source writer `r` holding a chunk
  (`chunk.rank`): each chunk is a complete `torch.save` archive of that box,
  appended to its rank's file as DCP's `_write_item` does, so
  `torch.distributed.checkpoint.load` at any world size reads exactly the
  boxes the source stored (a DCP or xckpt checkpoint saved by 4 ranks comes out
  with the same 4 ranks' files and boxes);
* `.metadata`: a pickled `Metadata` built from torch's own classes:
  `TensorStorageMetadata(TensorProperties(dtype), size, [ChunkStorageMetadata(offsets, sizes)])`
  per tensor, `BytesStorageMetadata()` per object,
  `storage_data = {MetadataIndex(fqn, offset, index): _StorageInfo(file, offset, length)}`,
  `planner_data` (the flatten mapping), a `StorageMeta` with a fresh
  `save_id`, `version` = torch's `CURRENT_DCP_VERSION`. It is written last
  (through `.metadata.tmp` and a rename, as torch does), after every data file
  is fsynced: until then no DCP reader takes the directory for a checkpoint.

Decisions (where the design is silent):

* Tensor names are DCP keys as they are (flat, dotted); `planner_data` maps
  each to a one-element path, so `dcp.load` into a nested state dict (which
  DCP flattens to the same dotted keys) and `dcp_to_torch_save` (a flat dict)
  both work.
* Objects are flattened exactly as `dcp.save` flattens a state dict (torch's
  own `flatten_state_dict`: a dict `cfg` becomes items `cfg.lr` ...), so
  `dcp.load` fills the caller's nested structure; each item is
  `torch.save`'d into bytes (a `BYTE_IO` item, as DCP does) in rank 0's file.
  A flattened object key that is also a tensor name, or a value that cannot be
  pickled, is an error naming it; nothing is left complete.
* Memory: one chunk at a time (the `torch.save` archive is streamed into the
  open rank file; the numpy buffer is shared with the tensor, not copied).

Needs torch (imported when writing). Nothing here unpickles.
"""

from __future__ import annotations

import io
import os
import pickle
import secrets
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from xckpt.errors import ObjectError, XckptError
from xckpt.sink import Sink, WriteJob

__all__ = ["DcpSink", "torch_tensor", "append_tensor", "write_metadata", "flat_objects_of", "pickled", "StoredChunk"]

FORMAT = "torch-dcp"

# numpy buffers of these dtypes go to torch through a same-width integer view.
_VIA = {"bfloat16": np.int16, "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8,
        "float8_e4m3fnuz": np.uint8, "float8_e5m2fnuz": np.uint8}


def torch_tensor(arr: np.ndarray, dtype: str) -> Any:
    """A torch tensor sharing `arr`'s memory, of xckpt dtype `dtype` (bf16/float8 by view)."""
    import torch

    tdt = getattr(torch, dtype)
    a = arr if arr.flags.c_contiguous else arr.copy()  # ascontiguousarray would make 0-d 1-d
    if dtype in _VIA:
        return torch.from_numpy(a.view(_VIA[dtype])).view(tdt)
    return torch.from_numpy(a)


def _fsync_close(f: Any) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()


def flat_objects_of(job: WriteJob) -> tuple[dict[str, Any], dict[str, Any]]:
    """Objects flattened as `dcp.save` flattens a state dict, and their paths; a flattened
    key that is also a tensor name is an error."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat_objects, object_paths = flatten_state_dict(dict(job.objects)) if job.objects else ({}, {})
    tensors = set(job.names)
    clash = sorted(k for k in flat_objects if k in tensors)
    if clash:
        raise XckptError(
            f"torch DCP output of {job.src.path!r}: object keys {clash} (objects flattened as dcp.save "
            "flattens a state dict) are also tensor names; rename or exclude one of them"
        )
    return flat_objects, object_paths


def pickled(job: WriteJob, key: str, value: Any) -> io.BytesIO:
    """`value` as DCP stores a `BYTE_IO` item: `torch.save`'d bytes."""
    import torch

    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise ObjectError(
            f"torch DCP output of {job.src.path!r}: object {key!r} cannot be pickled "
            f"({type(e).__name__}: {e}); exclude it (exclude=[...]) or convert to xckpt"
        ) from None
    return buf


class DcpSink(Sink):
    """A torch DCP checkpoint: one `__<r>_0.distcp` per source writer, `.metadata` last."""

    format = FORMAT

    def check(self, job: WriteJob) -> None:
        """Every dtype is a torch dtype; no flattened object key is a tensor name; every
        object pickles with `torch.save`.

        Raises:
            XckptError: a dtype torch lacks, or an object's flattened key is also a tensor name.
            ObjectError: an object cannot be pickled by `torch.save`.
        """
        import torch

        for name in job.names:
            dtype = job.src.info(name).dtype
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise XckptError(
                    f"torch DCP output of {job.src.path!r}: tensor {name!r} is {dtype}, which this torch "
                    f"({torch.__version__}) has no dtype for; cast it with a rule "
                    f'{{"match": "{name}", "dtype": "float32"}}, exclude it, or convert to xckpt'
                )
        for key, value in flat_objects_of(job)[0].items():
            pickled(job, key, value)

    def write(self, job: WriteJob) -> None:
        """Every chunk appended to its source writer's file as a `torch.save` archive,
        then objects into rank 0's file; files fsynced, `.metadata` written last.

        Raises:
            XckptError: an object's flattened key is also a tensor name.
            ObjectError: an object cannot be pickled by `torch.save`.
        """
        flat_objects, object_paths = flat_objects_of(job)
        dst = os.path.abspath(job.dst)
        os.makedirs(dst)
        files: dict[int, Any] = {}

        def rank_file(r: int) -> tuple[str, Any]:
            rel = f"__{r}_0.distcp"
            if r not in files:
                files[r] = open(os.path.join(dst, rel), "wb")  # noqa: SIM115 - closed below
            return rel, files[r]

        tensors: dict[str, list[StoredChunk]] = {}
        stored_objects: list[tuple[str, str, int, int]] = []
        try:
            for name in job.names:
                t = job.info(name)
                chunks = tensors[name] = []
                # A tensor with no stored chunk (empty) still gets one, as DCP writes empty shards.
                pieces = job.chunks(name, reuse=True) if t.chunks else iter([(None, np.empty(t.shape, dtype=t.np_dtype))])
                for chunk, data in pieces:
                    offset, rank = (chunk.offset, chunk.rank) if chunk is not None else ((0,) * len(t.shape), 0)
                    rel, f = rank_file(rank)
                    start, length = append_tensor(f, data, t.dtype)
                    chunks.append((tuple(offset), tuple(data.shape), rel, start, length))
                    job.bar.update(data.nbytes)
                    del data  # before the next chunk is read: one chunk in memory at a time
            for key, value in flat_objects.items():
                rel, f = rank_file(0)
                start = f.tell()
                f.write(pickled(job, key, value).getbuffer())
                stored_objects.append((key, rel, start, f.tell() - start))
            for f in files.values():
                _fsync_close(f)
        finally:
            for f in files.values():
                if not f.closed:
                    f.close()
        write_metadata(dst, job, tensors, stored_objects, object_paths, job.save_id or secrets.token_hex(16))


#: One stored chunk of a DCP output: (offsets, sizes, file, byte offset, byte length).
StoredChunk = tuple[tuple[int, ...], tuple[int, ...], str, int, int]


def append_tensor(f: Any, data: np.ndarray, dtype: str) -> tuple[int, int]:
    """`data` (xckpt dtype `dtype`) appended to the open file `f` as DCP's `_write_item`
    writes a chunk (a `torch.save` archive): its (byte offset, byte length)."""
    import torch

    start = f.tell()
    torch.save(torch_tensor(data, dtype), f)
    return start, f.tell() - start


def write_metadata(
    dst: str,
    job: WriteJob,
    tensors: Mapping[str, Sequence[StoredChunk]],
    objects: Sequence[tuple[str, str, int, int]],
    object_paths: Mapping[str, Any],
    save_id: str,
) -> None:
    """`.metadata` (through `.metadata.tmp` and a rename, fsynced) for `tensors` (in
    `job.names` order, each its stored chunks in order) and `objects` ((key, file,
    offset, length), flattened as `flat_objects_of` flattens them)."""
    import torch
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    # Every string interned: pickle writes an object once and refers back to it after, so
    # equal strings must be one object for the bytes to depend on values alone (not on which
    # process made each string).
    intern = sys.intern
    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, tuple[Any, ...]] = {}
    for name in map(intern, job.names):
        chunks = []
        for i, (offset, sizes, rel, start, length) in enumerate(tensors[name]):
            storage[MetadataIndex(name, torch.Size(offset), i)] = _StorageInfo(intern(rel), start, length)
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(sizes)))
        t = job.info(name)
        state[name] = TensorStorageMetadata(
            properties=TensorProperties(dtype=getattr(torch, t.dtype)), size=torch.Size(t.shape), chunks=chunks
        )
        planner[name] = (name,)
    for key, rel, start, length in objects:
        key = intern(key)
        storage[MetadataIndex(key)] = _StorageInfo(intern(rel), start, length)
        state[key] = BytesStorageMetadata()
        planner[key] = tuple(intern(k) if isinstance(k, str) else k for k in object_paths[key])
    meta = Metadata(
        state_dict_metadata=state,
        planner_data=planner,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=None, save_id=save_id),
        version=CURRENT_DCP_VERSION,
    )
    tmp = os.path.join(dst, ".metadata.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, os.path.join(dst, ".metadata"))
