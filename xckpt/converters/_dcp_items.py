"""Reading DCP items: tensor chunks (torch.save or safetensors bytes) and pickled objects.

Helpers of `torch_dcp` (see its docstring for the layout). A
`ChunkReader` parses each chunk's archive once (central directory and
`data.pkl`; a chunk of at most 64 KiB is read whole in one call and served
from memory until its reads are done) and keeps only the parsed description.
"""

from __future__ import annotations

import functools
import json
import math
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from xckpt.errors import CorruptChunkError, ObjectError, XckptError
from xckpt.layout import c_strides
from xckpt.manifest import Chunk, numpy_dtype
from xckpt.storage import Blob

from ._nesting import group_by_prefix, nest
from ._torchzip import ZIP_MAGIC, Archive, StoredBytes, read_box, read_boxes
from ._unpickle import StorageRef, TensorRef, TorchDtype, materialize, unrestricted_load
from .safetensors import DTYPES as SAFETENSORS_DTYPES

if TYPE_CHECKING:
    from .torch_dcp import DcpSource, _Item

__all__ = ["ChunkReader", "group_objects", "path_of", "transform_error"]

#: safetensors dtype name -> xckpt dtype name (the safetensors reader's table: C64, float8 included).
_ST_DTYPES = {k: v[0] for k, v in SAFETENSORS_DTYPES.items()}
_ST_MAX_HEADER = 100 << 20

Member = tuple[tuple[Any, ...], str, list["_Item"]]  # (path below the object's name, DCP fqn, items)


def transform_error(where: str, transforms: tuple[str, ...]) -> XckptError:
    """The error for an item written through DCP stream transforms."""
    variant = "zstd-compressed" if any("zstd" in t for t in transforms) else "stream-transformed"
    return XckptError(
        f"{where}: this is a {variant} DCP checkpoint (transform descriptors {list(transforms)}, "
        "written with FileSystemWriter(_extensions=[...])), which xckpt does not read. Load it with "
        "torch (dcp.load) and re-save it without _extensions, or convert it with torch's "
        "dcp_to_torch_save"
    )


class _Raw:
    """Plain bytes of a file (the safetensors variant): what `read_box` reads from."""

    big_endian = False

    def __init__(self, f: Blob) -> None:
        self.pread = f.pread
        self.readinto = f.readinto


class ChunkReader:
    """Parses and reads DCP items for one `DcpSource`."""

    def __init__(self, src: DcpSource) -> None:
        self.src = src
        self._parsed: dict[tuple[str, tuple[int, ...]], tuple[StoredBytes, TensorRef, int]] = {}
        self._st: dict[tuple[str, int], tuple[dict[str, Any], int]] = {}
        self._differs: dict[str, bool] = {}
        self._lock = threading.Lock()

    def _where(self, name: str, chunk: Chunk) -> str:
        return f"torch DCP checkpoint {self.src.path!r}, tensor {name!r}, chunk {chunk.box} ({chunk.key})"

    # -- tensors --------------------------------------------------------------

    def read(self, name: str, chunk: Chunk, items: list[tuple[tuple[slice, ...], np.ndarray]]) -> None:
        """`out[...] = chunk[slices]` for each item, reading only the bytes needed."""
        key = (name, chunk.offset)  # not the byte offset: safetensors items share one
        got = self._parsed.get(key)
        if got is None:
            got = self._parse(name, chunk, self.src.item(name, chunk))
            with self._lock:
                self._parsed[key] = got
        reader, t, start = got
        read_boxes(reader, t, start, items)

    def release(self, name: str, chunk: Chunk) -> None:
        """The reads of this chunk are done: drop its in-memory copy, keep its description."""
        got = self._parsed.get((name, chunk.offset))
        if got is not None and isinstance(got[0], Archive):
            got[0].drop_blob()

    def _parse(self, name: str, chunk: Chunk, it: _Item) -> tuple[StoredBytes, TensorRef, int]:
        where = self._where(name, chunk)
        if it.transforms:
            raise transform_error(where, it.transforms)
        f = self.src.file(it.rel)
        entry = self.src.info(name)
        if f.pread(it.offset, min(4, it.length)) == ZIP_MAGIC:
            archive = Archive(f, it.offset, it.length, where)
            t = archive.root
            if not isinstance(t, TensorRef):
                raise CorruptChunkError(f"{where}: the item holds a {type(t).__name__}, not a tensor")
            if t.size != chunk.shape or t.dtype.xckpt != entry.dtype:
                raise CorruptChunkError(
                    f"{where}: the stored tensor is {t.dtype!r} {t.size}, the metadata says "
                    f"{entry.dtype} {chunk.shape}; the checkpoint is damaged or mixes two saves"
                )
            return archive, t, archive.storage_range(t, name)[0]
        return self._safetensors(name, chunk, it, f, where)

    def _safetensors(
        self, name: str, chunk: Chunk, it: _Item, f: Blob, where: str
    ) -> tuple[StoredBytes, TensorRef, int]:
        # serialization_format=SAFETENSORS: the item's offset is the start of one safetensors blob.
        key = (it.rel, it.offset)
        got = self._st.get(key)
        if got is None:
            n = int.from_bytes(f.pread(it.offset, 8), "little") if f.reaches(it.offset + 8) else -1
            if n < 2 or n > _ST_MAX_HEADER or not f.reaches(it.offset + 8 + n):
                raise CorruptChunkError(
                    f"{where}: the bytes at offset {it.offset} of {it.rel} are neither a torch.save "
                    "archive nor a safetensors blob; the checkpoint is damaged"
                )
            try:
                header = json.loads(f.pread(it.offset + 8, n))
            except (UnicodeDecodeError, ValueError):
                raise CorruptChunkError(f"{where}: the safetensors header in {it.rel} is not JSON") from None
            if not isinstance(header, dict):
                raise CorruptChunkError(f"{where}: the safetensors header in {it.rel} is not an object")
            got = (header, it.offset + 8 + n)
            with self._lock:
                self._st[key] = got
        header, base = got
        e = header.get(name)
        entry = self.src.info(name)
        if not (isinstance(e, dict) and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2):
            raise CorruptChunkError(f"{where}: the safetensors blob in {it.rel} has no tensor {name!r}")
        b, end = e["data_offsets"]
        shape = tuple(e.get("shape") or ())
        st_dtype = e.get("dtype")
        dtype = _ST_DTYPES.get(st_dtype) if isinstance(st_dtype, str) else None
        itemsize = numpy_dtype(entry.dtype).itemsize
        if (
            dtype != entry.dtype
            or shape != chunk.shape
            or type(b) is not int
            or type(end) is not int
            or not 0 <= b <= end
            or end - b != math.prod(shape) * itemsize
            or not f.reaches(base + end)
        ):
            raise CorruptChunkError(
                f"{where}: the safetensors entry {e!r} in {it.rel} does not match the metadata "
                f"({entry.dtype} {chunk.shape}) or lies past the file's end"
            )
        t = TensorRef(StorageRef(name, None, end - b, "cpu"), 0, shape, c_strides(shape), TorchDtype(dtype))
        return _Raw(f), t, base + b

    # -- objects --------------------------------------------------------------

    def _archive(self, name: str, it: _Item) -> Archive:
        where = f"torch DCP checkpoint {self.src.path!r}, object {name!r} ({it.rel}[{it.offset}:{it.offset + it.length}])"
        if it.transforms:
            raise transform_error(where, it.transforms)
        return Archive(self.src.file(it.rel), it.offset, it.length, where, unpickle=False)

    def _records(self, name: str, it: _Item) -> list[bytes]:
        a = self._archive(name, it)
        names = [n for n in a.records if n.startswith(f"{a.prefix}/data")]
        return [a.record_bytes(f"{a.prefix}/data.pkl")] + [a.record_bytes(n) for n in sorted(names)]

    @staticmethod
    def ranks_of(group: list[Member]) -> list[int]:
        return sorted({it.rank for _, _, its in group for it in its})

    def differs(self, group: list[Member]) -> bool:
        """Whether ranks saved different values for this object (rank-local layout)."""
        key = group[0][1]
        if key not in self._differs:
            d = False
            for _, fqn, its in group:
                if len(its) > 1:
                    first = self._records(fqn, its[0])
                    d = d or any(self._records(fqn, it) != first for it in its[1:])
            self._differs[key] = d
        return self._differs[key]

    def object_value(self, name: str, group: list[Member], rank: int | None) -> Any:
        """The object rebuilt from its DCP pickles (rank's copies, or the lowest rank's)."""
        values = []
        for sub, fqn, its in group:
            chosen = [it for it in its if it.rank == rank] if rank is not None else sorted(its, key=lambda i: i.rank)
            if not chosen:
                raise ObjectError(
                    f"torch DCP checkpoint {self.src.path!r}: per-rank object {name!r} has no value for rank {rank}"
                )
            values.append((sub, self._unpickle(fqn, chosen[0])))
        return nest(values, name, f"torch DCP checkpoint {self.src.path!r}")

    def _unpickle(self, fqn: str, it: _Item) -> Any:
        a = self._archive(fqn, it)
        value = unrestricted_load(a.record_bytes(f"{a.prefix}/data.pkl"), a.where)
        return read_value(value, a)

    def verify_objects(self, groups: Mapping[str, list[Member]]) -> list[str]:
        problems = []
        for group in groups.values():
            for _, fqn, its in group:
                for it in its:
                    try:
                        self._archive(fqn, it)
                    except XckptError as e:
                        problems.append(str(e))
        return problems


def read_value(value: Any, a: Archive) -> Any:
    """A pickled DCP value with its tensors read from archive `a` (see `materialize`)."""
    return materialize(value, functools.partial(_read_tensor, a), a.where)


def _read_tensor(a: Archive, v: TensorRef) -> np.ndarray:
    dtype = v.dtype.xckpt
    if dtype is None:
        raise XckptError(f"{a.where}: a tensor of dtype torch.{v.dtype.name} cannot be read by xckpt")
    out = np.empty(v.size, dtype=numpy_dtype(dtype))
    start = a.storage_range(v, "<object>")[0]
    read_box(a, v, start, tuple(slice(0, n) for n in v.size), out)
    return out


def path_of(fqn: str, paths: Mapping[str, tuple[Any, ...]]) -> tuple[Any, ...]:
    """The key path of DCP key `fqn` in the state dict that was saved (from `planner_data`;
    a key without one, or whose path does not join to it, is its own one-element path)."""
    p = paths.get(fqn)
    return p if p is not None and ".".join(map(str, p)) == fqn else (fqn,)


def group_objects(
    objects: Mapping[str, list[_Item]],
    paths: Mapping[str, tuple[Any, ...]],
    tensors: set[str],
    where: str,
) -> dict[str, list[Member]]:
    """Objects by the name `xckpt.torch` gives them: the shortest key path holding no tensor."""
    leaves = {fqn: path_of(fqn, paths) for fqn in objects}
    grouped = group_by_prefix(leaves, [path_of(t, paths) for t in tensors], f"torch DCP checkpoint {where!r}")
    return {
        name: [(sub, fqn, sorted(objects[fqn], key=lambda x: x.rank)) for sub, fqn in members]
        for name, members in grouped.items()
    }
