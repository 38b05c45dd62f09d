"""torch DCP checkpoints as an xckpt source (format `torch-dcp`), read without torch.

Layouts (REFERENCE.md sections 2 and 9):

* coordinated: one `.metadata` pickle for the whole save;
* rank-local (`dcp.save(..., use_collectives=False)`): one `__<r>.metadata`
  per rank listing only its own chunks. They are merged here: identical boxes
  (replicated tensors, written by every rank) are treated as one, the union must
  tile each tensor. torch's own loader cannot reshard these; xckpt can.

The directory is read at any location (`Place`: a local path,
a kvstore URL or spec; it is listed to find the metadata files), by byte ranges.

Every metadata file goes through the restricted unpickler (DCP's metadata
classes, sizes, dtypes, layouts, paths; nothing else is called). A tensor
chunk is a complete torch.save archive at `[offset, offset + length)` of a
`__<r>_<n>.distcp` file: its central directory and `data.pkl` are parsed
and only the byte span of the rows (or box) asked is read, honouring the
stored sizes, strides and storage offset. Zero-size chunks (empty shards) hold
nothing and are dropped. Every range is checked against its file's size at
open, so a truncated `.distcp` is an error before anything is read.

Variants: `serialization_format=SAFETENSORS` files (a safetensors blob at the
item's offset, tensors named by fqn) are read by byte range too; stream
transforms (the zstd extension) are refused on read with an error naming them.

Objects (`BYTE_IO` items: `step`, `param_groups` entries) are pickles.
`object_names()` lists them, grouped back the way `xckpt.torch` flattens
a state dict: DCP splits a list of dicts such as `optim.param_groups` into one
pickle per leaf; here the subtree under the shortest key path that holds no
tensor is one object (`optim.param_groups`), rebuilt from DCP's
`planner_data` key paths. Values are read only when the checkpoint was opened
with `allow_pickle=True` (`_unpickle.unrestricted_load`); otherwise
`objects` raises [`ObjectError`][xckpt.errors.ObjectError] naming the object and the
flag. In the rank-local layout an object written by several ranks with
identical bytes is one value; differing values are per-rank objects.

`bytes_read` counts bytes read from `.distcp` files (metadata excluded).
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from xckpt.errors import (
    CorruptChunkError,
    IncompleteCheckpointError,
    XckptError,
)
from xckpt.layout import check_coverage
from xckpt.manifest import Chunk, TensorEntry
from xckpt.source import ChunkRead, Source, group_bytes, slice_pairs
from xckpt.storage import Blob, Place, as_place

from . import _dcp_items as items
from ._unpickle import METADATA_GLOBALS, Record, TorchDtype, field, restricted_load
from .torch_save import run_jobs

__all__ = ["FORMAT", "detect", "open", "DcpSource"]

FORMAT = "torch-dcp"

_RANK_MD = re.compile(r"^__(\d+)\.metadata$")
_DATA = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_MAX_METADATA = 1 << 31


def detect(path: str | Place) -> bool:
    """A directory holding `.metadata` or `__<r>.metadata` beside `*.distcp` files."""
    place = as_place(path)
    try:
        if not place.listable or place.kind() != "dir":
            return False
        entries = place.entries()
    except XckptError:
        return False
    has_md = any(e == ".metadata" or _RANK_MD.match(e) for e in entries)
    return has_md and any(e.endswith(".distcp") for e in entries)


class _Item(NamedTuple):
    """Where one DCP item's bytes are."""

    rel: str
    offset: int
    length: int
    transforms: tuple[str, ...]
    rank: int


def _what(where: str) -> str:
    return (
        f"{where} is not a torch DCP checkpoint: a DCP checkpoint is a directory holding .metadata "
        "(or __<r>.metadata per rank) beside __<r>_<n>.distcp files"
    )


class _Parsed:
    """What the metadata files say, merged over ranks."""

    def __init__(self) -> None:
        self.tensors: dict[str, tuple[TorchDtype, tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...], _Item]]]] = {}
        self.objects: dict[str, list[_Item]] = {}
        self.paths: dict[str, tuple[Any, ...]] = {}
        self.save_ids: list[str | None] = []
        self.version: str | None = None
        self.checkpoint_id: str | None = None


def _ints(v: Any, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)) or any(type(x) is not int or x < 0 for x in v):
        raise XckptError(f"{where}: {what} is {v!r}, expected non-negative integers")
    return tuple(v)


def _parse_one(md: Any, md_rank: int | None, where: str, out: _Parsed) -> None:
    if type(md).__name__ != "Metadata" or not isinstance(md, Record):
        raise XckptError(f"{where}: the pickle holds a {type(md).__name__}, not DCP Metadata")
    sdm = field(md, "state_dict_metadata")
    sdata = field(md, "storage_data")
    if not isinstance(sdm, dict) or not isinstance(sdata, dict):
        raise XckptError(f"{where}: Metadata lacks state_dict_metadata or storage_data")
    storage: dict[tuple[str, tuple[int, ...] | None], _Item] = {}
    for idx, info in sdata.items():
        if type(idx).__name__ != "MetadataIndex" or type(info).__name__ != "_StorageInfo":
            raise XckptError(f"{where}: storage_data holds {type(idx).__name__} -> {type(info).__name__}")
        fqn, off = field(idx, "fqn"), field(idx, "offset")
        if type(fqn) is not str:
            raise XckptError(f"{where}: a storage entry's fqn is {fqn!r}")
        key = (fqn, None if off is None else _ints(off, f"offset of {fqn!r}", where))
        if key in storage:
            raise XckptError(f"{where}: storage_data lists {fqn!r} at offset {key[1]} twice")
        storage[key] = _item(info, md_rank, fqn, where)
    for fqn, tmd in sdm.items():
        if type(fqn) is not str:
            raise XckptError(f"{where}: state_dict_metadata key {fqn!r} is not a string")
        kind = type(tmd).__name__
        if kind == "BytesStorageMetadata":
            it = storage.get((fqn, None))
            if it is None:
                raise XckptError(f"{where}: object {fqn!r} has no storage entry")
            out.objects.setdefault(fqn, []).append(it)
            continue
        if kind != "TensorStorageMetadata":
            raise XckptError(f"{where}: entry {fqn!r} is a {kind}")
        w = f"{where}, tensor {fqn!r}"
        props = field(tmd, "properties")
        dtype = field(props, "dtype") if isinstance(props, Record) else None
        if not isinstance(dtype, TorchDtype):
            raise XckptError(f"{w}: no dtype in its properties")
        size = _ints(field(tmd, "size"), "size", w)
        raw_chunks = field(tmd, "chunks")
        if not isinstance(raw_chunks, list):
            raise XckptError(f"{w}: chunks is not a list")
        prev = out.tensors.get(fqn)
        if prev is not None and (prev[0] != dtype or prev[1] != size):
            raise XckptError(
                f"{w}: the rank metadata files disagree on it ({prev[0]!r} {prev[1]} vs {dtype!r} {size}); "
                "they come from different saves: re-save the checkpoint"
            )
        chunks = prev[2] if prev is not None else []
        for c in raw_chunks:
            if not isinstance(c, Record):
                raise XckptError(f"{w}: a chunk is a {type(c).__name__}")
            off = _ints(field(c, "offsets"), "chunk offsets", w)
            shape = _ints(field(c, "sizes"), "chunk sizes", w)
            if len(off) != len(size) or len(shape) != len(size):
                raise XckptError(f"{w}: chunk offsets {off} / sizes {shape} do not fit the shape {size}")
            it = storage.get((fqn, off))
            if it is None:
                raise XckptError(f"{w}: the chunk at {off} has no storage entry")
            chunks.append((off, shape, it))
        out.tensors[fqn] = (dtype, size, chunks)
    planner = field(md, "planner_data")
    if isinstance(planner, dict):
        for k, v in planner.items():
            if type(k) is str and isinstance(v, (tuple, list)) and all(type(x) in (str, int) for x in v) and v:
                out.paths.setdefault(k, tuple(v))
    meta = field(md, "storage_meta")
    if isinstance(meta, Record):
        sid = field(meta, "save_id")
        out.save_ids.append(sid if isinstance(sid, str) else None)
        if out.checkpoint_id is None and field(meta, "checkpoint_id") is not None:
            out.checkpoint_id = str(field(meta, "checkpoint_id"))
    version = field(md, "version")
    if isinstance(version, str):
        out.version = version


def _item(info: Any, md_rank: int | None, fqn: str, where: str) -> _Item:
    rel, off, length = field(info, "relative_path"), field(info, "offset"), field(info, "length")
    tr = field(info, "transform_descriptors") or ()
    if type(rel) is not str or type(off) is not int or type(length) is not int or off < 0 or length < 0:
        raise XckptError(f"{where}: storage entry of {fqn!r} is {info!r}")
    parts = rel.replace("\\", "/").split("/")
    if not rel or "\0" in rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise XckptError(
            f"{where}: storage entry of {fqn!r} names the file {rel!r}, which is not inside the "
            "checkpoint; refusing it"
        )
    if not isinstance(tr, (list, tuple)) or any(type(t) is not str for t in tr):
        raise XckptError(f"{where}: transform descriptors of {fqn!r} are {tr!r}")
    m = _DATA.match(parts[-1])
    rank = int(m.group(1)) if m else (md_rank or 0)
    return _Item(rel, off, length, tuple(tr), rank)


class DcpSource(Source):
    """A torch DCP checkpoint directory opened for reading (metadata only)."""

    format = FORMAT
    _kind_name = "torch DCP checkpoint"
    _pickle_why = " (DCP saves non-tensor values with torch.save)"
    # DCP records no "per rank": an object is per rank when the ranks' values differ.
    _per_rank_how = "differs between the ranks that saved it ({n})"

    def __init__(self, path: str | Place, *, allow_pickle: bool = False) -> None:
        place = as_place(path)
        self._place = place
        self.path = path = place.name
        self.allow_pickle = allow_pickle
        kind = place.kind()
        if kind != "dir" or not place.listable:
            why = f" ({path!r} is a file)" if kind == "file" else " (an http(s) location cannot be listed)" if kind else ""
            raise XckptError(_what(f"{path!r}") + why)
        entries = place.entries()
        rank_files = sorted((int(m.group(1)), e) for e in entries if (m := _RANK_MD.match(e)))
        if ".metadata" in entries:
            self.layout = "coordinated"
            mds: list[tuple[int | None, str]] = [(None, ".metadata")]
        elif rank_files:
            self.layout = "rank-local"
            ranks = [r for r, _ in rank_files]
            if ranks != list(range(len(ranks))):
                missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
                raise IncompleteCheckpointError(
                    f"torch DCP checkpoint {path!r} (rank-local layout) lacks the metadata of ranks "
                    f"{missing}: found {[e for _, e in rank_files]}. The save did not finish on every rank"
                )
            mds = [(r, e) for r, e in rank_files]
        else:
            shown = ", ".join(sorted(entries)[:10]) or "nothing"
            raise XckptError(_what(f"{path!r}") + f"; found {shown}")
        parsed = _Parsed()
        for r, name in mds:
            where = f"torch DCP checkpoint {path!r} ({name})"
            data = place.read(name, limit=_MAX_METADATA)
            if data is None:
                raise IncompleteCheckpointError(f"{where}: the file is gone; open the checkpoint again")
            if len(data) > _MAX_METADATA:
                raise XckptError(f"{where}: over {_MAX_METADATA} bytes is too large for DCP metadata")
            _parse_one(restricted_load(data, METADATA_GLOBALS, where), r, where, parsed)
        self._parsed = parsed
        self._world = len(mds) if self.layout == "rank-local" else self._coordinated_world(entries)
        self._files: dict[str, Blob] = {}
        self._files_lock = threading.Lock()
        self._check_ranges()
        self._entries: dict[str, TensorEntry] = {}
        self._items: dict[tuple[str, tuple[int, ...]], _Item] = {}
        for fqn, (dtype, shape, chunks) in parsed.tensors.items():
            self._entries[fqn] = self._entry(fqn, dtype, shape, chunks)
        self._groups = items.group_objects(parsed.objects, parsed.paths, set(self._entries), path)
        self._reader = items.ChunkReader(self)

    # -- open-time checks -----------------------------------------------------

    def _coordinated_world(self, entries: list[str]) -> int:
        ranks = {it.rank for _, _, cs in self._parsed.tensors.values() for _, _, it in cs}
        ranks |= {it.rank for its in self._parsed.objects.values() for it in its}
        ranks |= {int(m.group(1)) for e in entries if (m := _DATA.match(e))}
        return max(ranks, default=0) + 1

    def _check_ranges(self) -> None:
        """Every item's file exists and holds its bytes (checked before anything is read)."""
        ends: dict[str, tuple[int, str, _Item]] = {}  # file -> the item reaching furthest
        all_items = [(fqn, it) for fqn, (_, _, cs) in self._parsed.tensors.items() for _, _, it in cs]
        all_items += [(fqn, it) for fqn, its in self._parsed.objects.items() for it in its]
        for fqn, it in all_items:
            if it.rel not in ends:
                if not self._place.isfile(it.rel):
                    raise IncompleteCheckpointError(
                        f"torch DCP checkpoint {self.path!r}: {fqn!r} is stored in {it.rel}, which is "
                        "missing; the save did not finish (or the file was removed): re-save or restore it"
                    )
                ends[it.rel] = (-1, fqn, it)
            if it.offset + it.length > ends[it.rel][0]:
                ends[it.rel] = (it.offset + it.length, fqn, it)
        for rel, (end, fqn, it) in ends.items():
            local = self._place.local
            size = os.path.getsize(os.path.join(local, rel)) if local is not None else self.file(rel).size
            if size is None:
                if self.file(rel).reaches(end):
                    continue
            elif end <= size:
                continue
            held = f"{size} bytes" if size is not None else "a shorter file"
            raise CorruptChunkError(
                f"torch DCP checkpoint {self.path!r}, {fqn!r}: its bytes [{it.offset}, "
                f"{it.offset + it.length}) lie past the end of {it.rel} ({held}); "
                "the file is truncated: restore it from a copy or re-save the checkpoint"
            )

    def _entry(self, fqn: str, dtype: TorchDtype, size: tuple[int, ...], chunks: list[Any]) -> TensorEntry:
        name = dtype.xckpt
        if name is None:
            raise XckptError(
                f"torch DCP checkpoint {self.path!r}, tensor {fqn!r}: dtype torch.{dtype.name} cannot "
                "be read by xckpt; convert it with torch and re-save"
            )
        itemsize = dtype.itemsize or 0
        out: list[Chunk] = []
        seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        for off, shape, it in chunks:
            if (off, shape) in seen or not math.prod(shape):
                continue  # a replica of a box already listed, or an empty shard
            seen.add((off, shape))
            nbytes = math.prod(shape) * itemsize
            if it.length < nbytes and not it.transforms:
                raise CorruptChunkError(
                    f"torch DCP checkpoint {self.path!r}, tensor {fqn!r}: the chunk at {off} holds "
                    f"{nbytes} bytes but its item {it.rel}[{it.offset}:{it.offset + it.length}] has only "
                    f"{it.length}; the metadata is damaged"
                )
            key = f"{it.rel}[{it.offset}:{it.offset + it.length}]"
            out.append(Chunk(offset=off, shape=shape, key=key, rank=it.rank, nbytes=nbytes))
            self._items[(fqn, off)] = it
        check_coverage(size, [c.box for c in out], name=fqn, where=self.path)
        return TensorEntry(name=fqn, dtype=name, shape=size, chunks=tuple(out))

    # -- metadata ---------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of writer ranks."""
        return self._world

    @property
    def save_id(self) -> str | None:
        ids = self._parsed.save_ids
        return ids[0] if ids else None

    @property
    def metadata(self) -> Mapping[str, Any]:
        return {"layout": self.layout, "dcp_version": self._parsed.version, "checkpoint_id": self._parsed.checkpoint_id}

    @property
    def bytes_read(self) -> int:
        """Bytes read from `.distcp` files so far."""
        return sum(f.bytes_read for f in list(self._files.values()))

    # -- reading ----------------------------------------------------------------

    def file(self, rel: str) -> Blob:
        """The open data file `rel` (opened once)."""
        f = self._files.get(rel)
        if f is None:
            with self._files_lock:
                f = self._files.get(rel)
                if f is None:
                    f = self._place.open(rel, where=f"torch DCP checkpoint {self.path!r} ({rel})")
                    self._files[rel] = f
        return f

    def item(self, name: str, chunk: Chunk) -> _Item:
        return self._items[(name, chunk.offset)]

    def _read_chunks(self, jobs: Sequence[ChunkRead], bar: Any) -> None:
        groups: dict[tuple[str, tuple[int, ...]], list[ChunkRead]] = {}
        for job in jobs:
            groups.setdefault((job.name, job.chunk.offset), []).append(job)

        def one(group: list[ChunkRead]) -> None:
            items = slice_pairs(group)
            try:
                self._reader.read(group[0].name, group[0].chunk, items)
            finally:
                self._reader.release(group[0].name, group[0].chunk)

        run_jobs(one, list(groups.values()), bar, group_bytes)

    # -- objects ------------------------------------------------------------------

    def object_names(self) -> list[str]:
        return list(self._groups)

    def pickled_objects(self) -> set[str]:
        return set(self._groups)

    def nesting(self) -> Mapping[str, tuple[Any, ...]]:
        """Key paths from DCP's `planner_data` (what `dcp_to_torch_save` nests by): each
        tensor's, and each object's (the tensor-free subtree it is)."""
        paths = self._parsed.paths
        out = {n: items.path_of(n, paths) for n in self._entries}
        for name, group in self._groups.items():
            sub, fqn, _ = group[0]
            leaf = items.path_of(fqn, paths)
            out[name] = leaf[: len(leaf) - len(sub)]
        return out

    def per_rank_objects(self) -> set[str]:
        if self.layout != "rank-local":
            return set()
        return {n for n in self._groups if self._reader.differs(self._groups[n])}

    def _has_object(self, name: str) -> bool:
        return name in self._groups

    def _object_value(self, name: str, rank: int | None) -> Any:
        return self._reader.object_value(name, self._groups[name], rank)

    def _per_rank_values(self, name: str) -> list[Any]:
        group = self._groups[name]
        return [self._reader.object_value(name, group, r) for r in self._reader.ranks_of(group)]

    def _verify_objects(self) -> list[str]:
        return self._reader.verify_objects(self._groups)

    def close(self) -> None:
        with self._files_lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


def open(path: str | Place, *, allow_pickle: bool = False) -> DcpSource:  # noqa: A001
    """Open a torch DCP checkpoint directory (coordinated or rank-local layout) at any location."""
    return DcpSource(path, allow_pickle=allow_pickle)
