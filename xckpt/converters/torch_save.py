"""torch.save zip files as an xckpt source (format `torch`), read without torch.

The file's `data.pkl` is read with the restricted unpickler (tensor rebuild
functions, storages, plain containers and scalars; nothing else is called) and
flattened as `xckpt.torch` flattens a state dict (`xckpt/torch/_state_dict.py`): dicts,
lists and tuples that hold a tensor somewhere inside are walked and their keys
joined with "."; anything else (an int `step`, a list of floats, a tensor-free
`meta` dict) is one object under its parent's name, returned as it was saved. Each
tensor is one chunk (the whole tensor, written by rank 0); tensors sharing a storage
(tied weights) and views with a storage offset or non-row-major strides (`t.t()`,
`t[2:]`, channels_last) are read from their storage as `data.pkl` describes them.
Reads are byte ranges of only the span a box touches, from any location
(`Place`: a local path, a kvstore URL or spec, `http(s)://`).

Classes outside the allow-list (an `argparse.Namespace` of training arguments, numpy
scalars and RNG states, `torch.device`, a user's class; Lightning `.ckpt` files) do
not make the file unreadable: while `data.pkl` is read they become inert placeholders
(`_foreign`: nothing of theirs is imported or called). Every tensor still lists
and reads. An object holding a placeholder is listed by `pickled_objects`
and read only when the file was opened with `allow_pickle=True`: then it is rebuilt
from what the pickle recorded, with the real classes, exactly as `torch.load` would
build it (this runs the code the file names, for the objects asked for only; tensors
inside it come back as numpy arrays). Objects of allow-listed plain types read without
the flag, as before. A tensor inside a foreign object (`Namespace(w=tensor)`) is part
of that object, as the flattening rule has it.

Decisions where torch is silent: a file holding one bare tensor presents it as
the tensor `"tensor"`; one bare non-tensor value as the object `"value"`.
The legacy (pre-1.6, non-zip) format is refused with an error that says how to
re-save it; a compressed or otherwise non-torch zip is refused too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from xckpt.errors import ObjectError, XckptError
from xckpt.layout import check_coverage
from xckpt.manifest import MAX_OBJECT_DEPTH, Chunk, TensorEntry, numpy_dtype
from xckpt.source import ChunkRead, Source, group_bytes, slice_pairs
from xckpt.storage import Blob, Place, as_place, file_to_detect

from ._foreign import describe, find_foreign, holds_foreign, rebuild
from ._torchzip import LEGACY_MAGIC, ZIP_MAGIC, Archive, first_record_name, read_box, read_boxes
from ._unpickle import TensorRef

__all__ = ["FORMAT", "detect", "open", "TorchSaveSource", "flatten_refs", "entry_for", "run_jobs"]

FORMAT = "torch"



def detect(path: str | Place) -> bool:
    """A zip file with an `<archive>/data.pkl` record (torch writes it first), or a legacy
    torch.save pickle, at any location."""
    place = as_place(path)
    with file_to_detect(place) as f:
        if f is None:
            return False
        try:
            head = f.head(512)
            if head.startswith(LEGACY_MAGIC):
                return True
            name = first_record_name(head)
            if name is None:
                return False
            if name.endswith("/data.pkl") and name.count("/") == 1:
                return True  # torch writes data.pkl first
            # Another zip writer may order records differently: look in the central directory.
            Archive.of_file(f, place.name, unpickle=False)
            return True
        except XckptError:
            return False


def _holds_tensor(v: Any, depth: int = 0) -> bool:
    if depth > MAX_OBJECT_DEPTH:
        raise XckptError(f"the saved structure is nested deeper than {MAX_OBJECT_DEPTH} levels")
    if isinstance(v, TensorRef):
        return True
    if isinstance(v, Mapping):
        return any(_holds_tensor(x, depth + 1) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_holds_tensor(x, depth + 1) for x in v)
    return False


def flatten_refs(root: Any, where: str) -> tuple[dict[str, TensorRef], dict[str, Any]]:
    """Tensors and objects of an unpickled `data.pkl`, by flat name (xckpt's flatten rule)."""
    tensors: dict[str, TensorRef] = {}
    objects: dict[str, Any] = {}

    def walk(prefix: str, v: Any, depth: int) -> None:
        if depth > MAX_OBJECT_DEPTH:
            raise XckptError(f"{where}: the saved structure is nested deeper than {MAX_OBJECT_DEPTH} levels")
        if isinstance(v, Mapping) and _holds_tensor(v):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x, depth + 1)
            return
        if isinstance(v, (list, tuple)) and _holds_tensor(v):
            for i, x in enumerate(v):
                walk(f"{prefix}.{i}" if prefix else str(i), x, depth + 1)
            return
        if prefix in tensors or prefix in objects:
            raise XckptError(
                f"{where}: two entries flatten to the name {prefix!r} (a key containing '.' next to "
                "a nested dict); load the file with torch and rename one"
            )
        if isinstance(v, TensorRef):
            tensors[prefix] = v
        else:
            objects[prefix] = v

    if isinstance(root, TensorRef):
        tensors["tensor"] = root
    elif isinstance(root, (Mapping, list, tuple)) and _holds_tensor(root):
        walk("", root, 0)
    elif isinstance(root, Mapping):
        for k, v in root.items():
            walk(str(k), v, 1)
    else:
        objects["value"] = root
    return tensors, objects


def entry_for(name: str, t: TensorRef, key: str, rank: int, where: str) -> TensorEntry:
    """The one-chunk entry of a whole tensor `t` stored at `key`."""
    dtype = t.dtype.xckpt
    if dtype is None:
        raise XckptError(
            f"{where}, tensor {name!r}: dtype torch.{t.dtype.name} cannot be read by xckpt; convert "
            "it with torch (e.g. to float32) and re-save"
        )
    nbytes = math.prod(t.size) * (t.dtype.itemsize or 0)
    chunks: tuple[Chunk, ...] = ()
    if math.prod(t.size):
        chunks = (Chunk(offset=(0,) * len(t.size), shape=t.size, key=key, rank=rank, nbytes=nbytes),)
    return TensorEntry(name=name, dtype=dtype, shape=t.size, chunks=chunks)


def run_jobs(fn: Any, jobs: Sequence[Any], bar: Any, nbytes: Any, threads: int = 8) -> None:
    """`fn(job)` for every job, concurrently for several; `bar.update` in this thread."""
    if len(jobs) <= 1:
        for job in jobs:
            fn(job)
            bar.update(nbytes(job))
        return
    with ThreadPoolExecutor(max_workers=min(threads, len(jobs))) as pool:
        for job, fut in zip(jobs, [pool.submit(fn, j) for j in jobs]):
            fut.result()
            bar.update(nbytes(job))


class TorchSaveSource(Source):
    """A torch.save zip file opened for reading (`data.pkl` parsed; no tensor bytes read)."""

    format = FORMAT

    def __init__(self, path: str | Place, *, allow_pickle: bool = False) -> None:
        place = as_place(path)
        self.path = place.name
        self.allow_pickle = allow_pickle
        where = f"torch.save file {self.path!r}"
        self._where = where
        kind = place.kind()
        if kind != "file":
            raise XckptError(
                f"{self.path!r} is not a torch.save file: "
                + ("a directory" if kind == "dir" else "nothing is there")
                + "; format='torch' reads one file written by torch.save"
            )
        self._file: Blob = place.open(where=where)
        try:
            head = self._file.head(64)
            if head.startswith(LEGACY_MAGIC):
                raise XckptError(
                    f"{where} uses torch's legacy (pre-1.6) serialization, which is a plain pickle "
                    "xckpt will not read. Re-save it with torch>=1.6's default zip serialization: load it "
                    "with torch (weights_only=True) in a trusted environment and torch.save it again"
                )
            if not head.startswith(ZIP_MAGIC):
                raise XckptError(
                    f"{where} is not a torch.save zip archive (it starts with {head[:8]!r}); expected a file "
                    "written by torch.save (torch>=1.6)"
                )
            self._archive = Archive.of_file(self._file, where, foreign=True)
            self._tensors, self._objects = flatten_refs(self._archive.root, where)
            self._foreign = {n for n, v in self._objects.items() if holds_foreign(v)}
            self._entries: dict[str, TensorEntry] = {}
            self._starts: dict[str, int] = {}
            for name, t in self._tensors.items():
                e = entry_for(name, t, f"{self._archive.prefix}/data/{t.storage.key}", 0, where)
                self._starts[name] = self._archive.storage_range(t, name)[0]
                check_coverage(e.shape, e.boxes, name=name, where=self.path)
                self._entries[name] = e
        except BaseException:
            self._file.close()
            raise

    @property
    def bytes_read(self) -> int:
        """Bytes read from the file so far (headers and `data.pkl` included)."""
        return self._file.bytes_read

    def _read_chunks(self, jobs: Sequence[ChunkRead], bar: Any) -> None:
        groups: dict[str, list[ChunkRead]] = {}
        for job in jobs:
            groups.setdefault(job.name, []).append(job)

        def one(group: list[ChunkRead]) -> None:
            items = slice_pairs(group)
            name = group[0].name
            read_boxes(self._archive, self._tensors[name], self._starts[name], items)

        run_jobs(one, list(groups.values()), bar, group_bytes)

    def object_names(self) -> list[str]:
        return list(self._objects)

    def pickled_objects(self) -> set[str]:
        """Objects holding classes outside the allow-list: read only with `allow_pickle=True`."""
        return set(self._foreign)

    def _has_object(self, name: str) -> bool:
        return name in self._objects

    def _object_value(self, name: str, rank: int | None) -> Any:
        value = self._objects[name]
        if name not in self._foreign:
            return value
        # allow_pickle=True (checked by objects()): rebuild it with the real classes.
        return rebuild(value, f"{self._where}, object {name!r}", self._tensor_value)

    def _tensor_value(self, v: Any) -> Any:
        """A tensor inside a foreign object, as a numpy array (other leaves as they are)."""
        if not isinstance(v, TensorRef):
            return v
        dtype = v.dtype.xckpt
        if dtype is None:
            raise XckptError(f"{self._where}: a tensor of dtype torch.{v.dtype.name} cannot be read by xckpt")
        out = np.empty(v.size, dtype=numpy_dtype(dtype))
        start = self._archive.storage_range(v, "<object>")[0]
        read_box(self._archive, v, start, tuple(slice(0, n) for n in v.size), out)
        return out

    def _pickle_refused(self, names: Sequence[str]) -> ObjectError:
        first = names[0]
        return ObjectError(
            f"{self._where}: object {first!r}"
            + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")
            + f" holds {describe(find_foreign(self._objects[first]))}, which is not on xckpt's "
            "allow-list; rebuilding it runs code the file names. The file's tensors read without it: "
            "read the object only from a trusted file, by opening with allow_pickle=True"
        )

    def close(self) -> None:
        self._file.close()


def open(path: str | Place, *, allow_pickle: bool = False) -> TorchSaveSource:  # noqa: A001
    """Open a torch.save zip file at any location.

    `data.pkl` is always read restricted (classes outside the allow-list become inert
    placeholders); `allow_pickle=True` lets the objects holding them be rebuilt.
    """
    return TorchSaveSource(path, allow_pickle=allow_pickle)
