"""safetensors files and Hugging Face safetensors directories as a :class:`~xckpt.source.Source`.

A safetensors file is 8 bytes (little-endian u64 ``N``), ``N`` bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end)}, "__metadata__": {str: str}}``
and then the data buffer, each tensor C-order and little-endian at its offsets.
The header is parsed here, never by the safetensors library, and checked before
anything is allocated: ``N`` at most :data:`HEADER_CAP` and within the file, a
JSON object without duplicate keys, known dtypes, shapes that agree with the
byte ranges, ranges inside the buffer and disjoint. Tensor bytes are read with
``os.pread`` straight into the caller's buffer: a box of whole rows is one
range, any other box is read run by run (runs closer than
:data:`COALESCE_GAP` bytes on average are read together and scattered).

Locations (see :func:`open`): one ``.safetensors`` file; a directory holding
``model.safetensors.index.json`` (the index is the truth: only its
``weight_map`` names are tensors, shards it does not name are ignored, a name
found in two named shards is an error even where ``safe_open`` accepts it); a
directory of ``*.safetensors`` without an index (all of them; a name in two
files is an error); or the index file itself.

Decisions where the design is silent:

* Every tensor is one chunk. Its writer (``Chunk.rank``) is 0 for one file and
  the shard's position in sorted file-name order in a directory
  (``model-00001-of-00004`` is writer 0), so ``plot_layout`` colours by shard
  and ``world_size`` is the number of shards. ``Chunk.key`` is
  ``<file>[begin:end]`` (absolute byte offsets in the file).
* ``names()`` are sorted, as ``safe_open(...).keys()`` gives them.
* Empty tensors have no chunks (as in xckpt); 0-d tensors are one chunk.
* Gaps between tensors' byte ranges and bytes after the last one are accepted
  (aligned writers leave them; nothing is read from them); overlaps are not.
* ``metadata``: the file's ``__metadata__``; for a directory the shards'
  ``__metadata__`` merged (the first shard wins a clash) and then the index's
  ``metadata`` entries (strings as they are, other values as JSON text).
* ``bytes_read`` counts tensor bytes read from files (gap bytes read by
  coalescing included; headers not), for tests and benchmarks.
* There are no checksums: :meth:`SafetensorsSource.verify` re-checks file sizes
  and reads every tensor, reporting files that are shorter than their header
  says or that fail to read.
"""

from __future__ import annotations

import builtins
import json
import math
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from xckpt.errors import (
    CheckpointNotFoundError,
    CorruptChunkError,
    IncompleteCheckpointError,
    ManifestError,
    XckptError,
)
from xckpt.layout import check_coverage
from xckpt.manifest import Chunk, TensorEntry
from xckpt.source import ChunkRead, Source

__all__ = ["FORMAT", "INDEX_NAME", "HEADER_CAP", "SafetensorsSource", "detect", "open", "parse_header"]

FORMAT = "safetensors"
#: The index file transformers writes beside its shards.
INDEX_NAME = "model.safetensors.index.json"
#: Largest header (and index) accepted: the reference implementation's cap (100 MB).
HEADER_CAP = 100_000_000
MAX_NDIM = 64
#: Runs of a box closer than this on average (bytes) are read with one pread.
COALESCE_GAP = 4096
_SCRATCH = 32 << 20  # bytes of scratch for one coalesced read batch
_PARALLEL_BYTES = 16 << 20  # reads larger than this in total use a thread pool

#: safetensors dtype -> xckpt dtype name (every safetensors dtype xckpt can hold).
DTYPES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "C64": "complex64",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
}
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4,
             "F32": 4, "F64": 8, "I64": 8, "U64": 8, "C64": 8, "F8_E5M2": 1, "F8_E4M3": 1,
             "F8_E5M2FNUZ": 1, "F8_E4M3FNUZ": 1}  # fmt: skip


class TensorInfo(NamedTuple):
    """One header entry: xckpt dtype name, shape, absolute byte range ``[begin, end)`` in the file."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class Header(NamedTuple):
    """A parsed header: tensors in header order, ``__metadata__``, and where the data starts."""

    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int


class _Duplicate(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for k, v in pairs:
        if k in d:
            raise _Duplicate(k)
        d[k] = v
    return d


def _json(raw: bytes, where: str, what: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except _Duplicate as e:
        raise ManifestError(
            f"{where}: the {what} lists {e.args[0]!r} twice; every name must appear once. The file is "
            "damaged or was written by a faulty tool: re-save it"
        ) from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ManifestError(f"{where}: the {what} is not valid UTF-8 JSON ({e}); the file is damaged") from None


def header_length(first: bytes, file_size: int, where: str) -> int:
    """The header length ``N`` from a file's first 8 bytes, checked against the cap and the file size."""
    if file_size < 8 or len(first) < 8:
        raise ManifestError(
            f"{where}: a file of {file_size} bytes is too short for a safetensors header (8-byte length "
            "first); it is truncated or not a safetensors file"
        )
    n = int.from_bytes(first[:8], "little")
    if n > HEADER_CAP:
        raise ManifestError(
            f"{where}: the header claims {n} bytes, more than the {HEADER_CAP}-byte limit safetensors "
            "sets; the file is damaged or not a safetensors file"
        )
    if n > file_size - 8:
        raise ManifestError(
            f"{where}: the header claims {n} bytes but the file holds only {file_size - 8} after the "
            "8-byte length; the file is truncated (re-download or re-save it) or not a safetensors file"
        )
    return n


def _is_int(x: Any) -> bool:
    return type(x) is int  # bool is an int subclass; JSON true is not a size


def parse_header(body: bytes, file_size: int, where: str) -> Header:
    """Parse and check ``body``, the ``N`` header bytes of a file of ``file_size`` bytes.

    Raises:
        ManifestError: anything wrong with the header, naming ``where`` and the tensor.
    """
    data_start = 8 + len(body)
    buffer = file_size - data_start
    obj = _json(body, where, "header")
    if not isinstance(obj, dict):
        raise ManifestError(f"{where}: the header must be a JSON object, got {type(obj).__name__}")
    meta = obj.pop("__metadata__", None)
    if meta is None:
        meta = {}
    elif not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ManifestError(f"{where}: __metadata__ must map strings to strings, got {str(meta)[:200]}")
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, e in obj.items():
        w = f"{where}, tensor {name!r}"
        if not isinstance(e, dict):
            raise ManifestError(f"{w}: the header entry must be an object, got {str(e)[:100]}")
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in e]
        if missing:
            raise ManifestError(f"{w}: the header entry lacks {', '.join(missing)}")
        st_dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if st_dtype not in DTYPES:
            raise ManifestError(
                f"{w}: dtype {str(st_dtype)[:40]!r} is not supported by xckpt (supported: "
                f"{', '.join(DTYPES)}); cast the tensor to one of them and re-save"
            )
        if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_int(s) and s >= 0 for s in shape):
            raise ManifestError(
                f"{w}: shape must be a list of at most {MAX_NDIM} non-negative ints, got {str(shape)[:100]}"
            )
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) and o >= 0 for o in offs)):
            raise ManifestError(f"{w}: data_offsets must be [begin, end] ints >= 0, got {str(offs)[:100]}")
        begin, end = offs
        if begin > end:
            raise ManifestError(f"{w}: data_offsets [{begin}, {end}) end before they begin")
        if end > buffer:
            raise ManifestError(
                f"{w}: data_offsets [{begin}, {end}) lie past the end of the data buffer ({buffer} bytes "
                "after the header); the file is truncated: re-download or re-save it"
            )
        nbytes = math.prod(shape) * _ITEMSIZE[st_dtype]
        if nbytes != end - begin:
            raise ManifestError(
                f"{w}: shape {shape} of {st_dtype} needs {nbytes} bytes but data_offsets [{begin}, {end}) "
                f"hold {end - begin}; the header is damaged"
            )
        tensors[name] = TensorInfo(DTYPES[st_dtype], tuple(shape), data_start + begin, data_start + end)
        if end > begin:
            spans.append((begin, end, name))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise ManifestError(
                f"{where}: tensors {n0!r} (bytes [{b0}, {e0})) and {n1!r} (bytes [{b1}, {e1})) overlap; "
                "every tensor needs its own bytes. The header is damaged: re-save the file"
            )
    return Header(tensors, dict(meta), data_start)


class _File:
    """One safetensors file: its parsed header and a lazily opened descriptor."""

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        self.name = os.path.basename(path)
        self.rank = rank
        self.fd: int | None = None
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path!r}: no such safetensors file") from None
        except OSError as e:
            raise XckptError(f"{path!r}: cannot open the safetensors file ({e.strerror})") from None
        try:
            self.size = os.fstat(fd).st_size
            n = header_length(os.pread(fd, 8, 0), self.size, path)
            body = os.pread(fd, n, 8)
            if len(body) != n:
                raise ManifestError(f"{path!r}: the file ended inside its {n}-byte header (read {len(body)})")
            self.header = parse_header(body, self.size, path)
        except OSError as e:
            os.close(fd)
            raise XckptError(f"{path!r}: cannot read the safetensors header ({e.strerror})") from None
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd


def _close_all(files: list[_File]) -> None:
    for f in files:
        if f.fd is not None:
            os.close(f.fd)
            f.fd = None


class SafetensorsSource(Source):
    """A safetensors file or Hugging Face directory opened for reading (see the module docstring).

    Attributes:
        files: the safetensors files read, in writer order.
        bytes_read: tensor bytes read from files so far (coalesced gaps included).
    """

    format = FORMAT

    def __init__(
        self, path: str, files: list[_File], tensors: dict[str, tuple[_File, TensorInfo]], metadata: dict[str, str]
    ) -> None:
        self.path = path
        self.files = files
        self._meta = metadata
        self._tensors = tensors
        self._entries: dict[str, TensorEntry] = {}
        self.bytes_read = 0
        self._lock = threading.Lock()
        for name, (f, t) in sorted(tensors.items()):
            nbytes = t.end - t.begin
            chunks = () if math.prod(t.shape) == 0 else (
                Chunk(offset=(0,) * len(t.shape), shape=t.shape, key=f"{f.name}[{t.begin}:{t.end}]", rank=f.rank,
                      nbytes=nbytes),
            )
            entry = TensorEntry(name=name, dtype=t.dtype, shape=t.shape, chunks=chunks)
            check_coverage(t.shape, entry.boxes, name, where=path)
            self._entries[name] = entry
        self._finalizer = weakref.finalize(self, _close_all, files)

    @property
    def world_size(self) -> int:
        return len(self.files)

    @property
    def metadata(self) -> Mapping[str, str]:
        return self._meta

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def info(self, name: str) -> TensorEntry:
        t = self._entries.get(name)
        if t is None:
            raise self._missing(name)
        return t

    # -- reads ----------------------------------------------------------------

    def _read_chunks(self, jobs: Sequence[ChunkRead], bar: Any) -> None:
        for name, _c, _r, _o in jobs:
            f = self._tensors[name][0]
            if f.fd is None:
                raise XckptError(f"checkpoint {self.path!r} is closed; open it again to read {name!r}")
        total = sum(j.chunk.nbytes if j.req is None else j.req.box.volume * j.out.itemsize for j in jobs)
        if len(jobs) > 1 and total > _PARALLEL_BYTES:
            with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
                for done in pool.map(self._read_job, jobs):
                    bar.update(done)
        else:
            for job in jobs:
                bar.update(self._read_job(job))

    def _read_job(self, job: ChunkRead) -> int:
        """Fill one job; returns the bytes it delivered."""
        name, _chunk, req, out = job
        f, t = self._tensors[name]
        shape = t.shape
        if req is None:
            start: tuple[int, ...] = (0,) * len(shape)
            box: tuple[int, ...] = shape
            dst = out
        else:
            start = tuple(s.indices(n)[0] for s, n in zip(req.chunk_slices, shape))
            box = req.box.shape
            dst = out[req.target_slices]
        buf = dst if dst.flags.c_contiguous else np.empty(box, dtype=out.dtype)
        self._fill(name, f, t, start, box, buf)
        if buf is not dst:
            dst[...] = buf
        return buf.nbytes

    def _fill(
        self, name: str, f: _File, t: TensorInfo, start: tuple[int, ...], box: tuple[int, ...], buf: np.ndarray
    ) -> None:
        """Read box ``start``/``box`` of tensor ``t`` into the C-contiguous ``buf``.

        Dims ``j..`` of the box are read as one byte range per index of dims
        ``..j`` (a "super-run"); ``j`` is pushed outwards while the bytes read
        in between stay below :data:`COALESCE_GAP` per avoided read.
        """
        nd = len(shape := t.shape)
        isz = buf.itemsize
        strides = [math.prod(shape[i + 1 :]) for i in range(nd)]  # C strides, in elements
        partial = [i for i in range(nd) if box[i] != shape[i]]
        k = partial[-1] if partial else 0

        def span(j: int) -> int:  # elements from the first to the last needed one, dims j.. inclusive
            return sum((box[i] - 1) * strides[i] for i in range(j, nd)) + 1

        j = k
        while j > 0:
            sp, need, runs = span(j - 1), math.prod(box[j - 1 :]), math.prod(box[j - 1 : k])
            if sp != need and ((sp - need) * isz > COALESCE_GAP * max(runs - 1, 1) or sp * isz > _SCRATCH):
                break
            j -= 1
        length, need = span(j), math.prod(box[j:])
        offs = np.zeros(1, dtype=np.int64)
        for i in range(j):
            offs = (offs[:, None] + np.arange(box[i], dtype=np.int64) * strides[i]).reshape(-1)
        base = sum(s * st for s, st in zip(start, strides))
        offs = t.begin + (offs + base) * isz
        rows = buf.reshape(len(offs), -1).view(np.uint8)
        if length == need:  # each super-run is exactly the bytes wanted: read in place
            for r, off in enumerate(offs.tolist()):
                self._pread(name, f, t, rows[r], off)
            return
        per = max(1, _SCRATCH // (length * isz))
        scratch = np.empty((min(per, len(offs)), length * isz), dtype=np.uint8)
        shaped = buf.reshape(len(offs), *box[j:])
        inner = tuple(s * isz for s in strides[j:])
        for r0 in range(0, len(offs), per):
            part = offs[r0 : r0 + per].tolist()
            for r, off in enumerate(part):
                self._pread(name, f, t, scratch[r], off)
            # np.ndarray over the scratch, not as_strided: that goes through __array_interface__,
            # which does not know ml_dtypes' float8 types.
            shaped[r0 : r0 + len(part)] = np.ndarray(
                (len(part), *box[j:]), dtype=buf.dtype, buffer=scratch, strides=(length * isz, *inner)
            )

    def _pread(self, name: str, f: _File, t: TensorInfo, dst: np.ndarray, off: int) -> None:
        view = memoryview(dst)
        got = 0
        while got < len(view):
            try:
                n = os.preadv(f.fd, [view[got:]], off + got)  # type: ignore[arg-type]
            except OSError as e:
                raise CorruptChunkError(
                    f"checkpoint {self.path!r}, tensor {name!r}: reading {f.name} at byte {off + got} "
                    f"failed ({e.strerror})"
                ) from None
            if n == 0:
                raise CorruptChunkError(
                    f"checkpoint {self.path!r}, tensor {name!r}: {f.name} now holds {os.fstat(f.fd).st_size} "
                    f"bytes, but its header puts the tensor at bytes [{t.begin}, {t.end}); the file is "
                    "truncated or was changed after it was opened: re-download or re-save it"
                )
            got += n
        with self._lock:
            self.bytes_read += got

    # -- verification and lifetime --------------------------------------------

    def verify(self, *, show_progress: bool | None = None) -> list[str]:
        """Check every file's size against its header, then read every tensor; the problems found."""
        problems = []
        for f in self.files:
            need = max((t.end for t in f.header.tensors.values()), default=f.header.data_start)
            try:
                size = os.stat(f.path).st_size
            except OSError as e:
                problems.append(f"checkpoint {self.path!r}: {f.name} cannot be read ({e.strerror})")
                continue
            if size < need:
                problems.append(
                    f"checkpoint {self.path!r}: {f.name} holds {size} bytes but its header needs {need}; the "
                    "file is truncated: re-download or re-save it"
                )
        return problems + super().verify(show_progress=show_progress)

    def close(self) -> None:
        self._finalizer()


# -- locations ----------------------------------------------------------------


def detect(path: str) -> bool:
    """A ``.safetensors`` file (or one whose first bytes parse as a header), an index, or a
    directory holding an index or ``*.safetensors`` files."""
    if os.path.isdir(path):
        try:
            return any(e.endswith((".safetensors", ".safetensors.index.json")) for e in os.listdir(path))
        except OSError:
            return False
    if not os.path.isfile(path):
        return False
    if path.endswith((".safetensors", ".safetensors.index.json")):
        return True
    try:
        with builtins.open(path, "rb") as fh:
            head = fh.read(9)
            size = os.fstat(fh.fileno()).st_size
    except OSError:
        return False
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return 2 <= n <= min(HEADER_CAP, size - 8) and head[8:9] == b"{"


def _listing(path: str) -> str:
    try:
        entries = sorted(os.listdir(path))
    except OSError as e:
        return f"an unreadable directory ({e.strerror})"
    return ", ".join(entries[:12]) + (f", ... ({len(entries)} entries)" if len(entries) > 12 else "") or "nothing"


def _open_index(path: str, index: str) -> SafetensorsSource:
    d = os.path.dirname(index)
    try:
        size = os.path.getsize(index)
        if size > HEADER_CAP:
            raise ManifestError(f"{index!r}: an index of {size} bytes is over the {HEADER_CAP}-byte limit")
        with builtins.open(index, "rb") as fh:
            raw = fh.read(HEADER_CAP + 1)
    except OSError as e:
        raise XckptError(f"{index!r}: cannot read the index ({e.strerror})") from None
    obj = _json(raw, index, "index")
    wmap = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise ManifestError(f"{index!r}: the index needs a \"weight_map\" object from tensor names to file names")
    shards = sorted(set(wmap.values()))
    files: list[_File] = []
    try:
        for rank, shard in enumerate(shards):
            parts = shard.replace("\\", "/").split("/")
            if os.path.isabs(shard) or ".." in parts or not shard:
                raise ManifestError(f"{index!r}: shard {shard!r} is not a file inside {d!r}; the index is unsafe")
            if not os.path.isfile(os.path.join(d, shard)):
                example = next(n for n, s in wmap.items() if s == shard)
                raise IncompleteCheckpointError(
                    f"{index!r} names shard {shard!r} (holding {example!r}), which is not in {d!r}; the "
                    "download is incomplete: fetch the missing shard"
                )
            files.append(_File(os.path.join(d, shard), rank))
        seen: dict[str, str] = {}
        for f in files:
            for name in f.header.tensors:
                if name in seen:
                    raise ManifestError(
                        f"checkpoint {path!r}: tensor {name!r} is stored in both {seen[name]} and {f.name}; "
                        "which one is meant is ambiguous. Remove it from one shard (or re-save the model)"
                    )
                seen[name] = f.name
        by_shard = dict(zip(shards, files))
        tensors = {}
        for name, shard in wmap.items():
            t = by_shard[shard].header.tensors.get(name)
            if t is None:
                raise IncompleteCheckpointError(
                    f"{index!r} puts tensor {name!r} in {shard!r}, whose header does not hold it; the index "
                    "and the shards come from different saves: re-download them together"
                )
            tensors[name] = (by_shard[shard], t)
    except BaseException:
        _close_all(files)
        raise
    meta: dict[str, str] = {}
    for f in files:
        for k, v in f.header.metadata.items():
            meta.setdefault(k, v)
    imeta = obj.get("metadata")
    if isinstance(imeta, dict):
        meta.update({str(k): v if isinstance(v, str) else json.dumps(v) for k, v in imeta.items()})
    return SafetensorsSource(path, files, tensors, meta)


def _open_files(path: str, paths: list[str]) -> SafetensorsSource:
    files: list[_File] = []
    tensors: dict[str, tuple[_File, TensorInfo]] = {}
    try:
        for rank, p in enumerate(paths):
            f = _File(p, rank)
            files.append(f)
            for name, t in f.header.tensors.items():
                if name in tensors:
                    raise ManifestError(
                        f"checkpoint {path!r}: tensor {name!r} is stored in both {tensors[name][0].name} and "
                        f"{f.name}; which one is meant is ambiguous. Move one of the files away (or write "
                        f"a {INDEX_NAME} that says which file holds what)"
                    )
                tensors[name] = (f, t)
    except BaseException:
        _close_all(files)
        raise
    meta: dict[str, str] = {}
    for f in files:
        for k, v in f.header.metadata.items():
            meta.setdefault(k, v)
    return SafetensorsSource(path, files, tensors, meta)


def open(path: str, *, allow_pickle: bool = False) -> SafetensorsSource:  # noqa: A001
    """Open a safetensors file, a Hugging Face directory, or an index file (headers only).

    Args:
        path: a ``.safetensors`` file; a directory with ``model.safetensors.index.json`` (or one
            other ``*.safetensors.index.json``) or with ``*.safetensors`` files; an index file.
        allow_pickle: unused (safetensors holds no pickles).

    Raises:
        CheckpointNotFoundError: nothing safetensors at ``path``.
        IncompleteCheckpointError: the index names a missing shard, or a tensor its shard lacks.
        ManifestError: a header or the index is damaged (each check names file and tensor).
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        if path.endswith(".index.json"):
            return _open_index(path, path)
        return _open_files(path, [path])
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"{path!r}: no such safetensors file or directory")
    try:
        entries = sorted(os.listdir(path))
    except OSError as e:
        raise XckptError(f"{path!r}: cannot list the directory ({e.strerror})") from None
    indexes = [e for e in entries if e.endswith(".safetensors.index.json")]
    if INDEX_NAME in indexes or len(indexes) == 1:
        return _open_index(path, os.path.join(path, INDEX_NAME if INDEX_NAME in indexes else indexes[0]))
    if indexes:
        raise ManifestError(
            f"{path!r} holds several safetensors indexes ({', '.join(indexes)}) and no {INDEX_NAME}; "
            "open the one you mean by its path"
        )
    shards = [e for e in entries if e.endswith(".safetensors") and os.path.isfile(os.path.join(path, e))]
    if not shards:
        raise CheckpointNotFoundError(
            f"{path!r} holds no safetensors checkpoint: no {INDEX_NAME} and no *.safetensors file (found "
            f"{_listing(path)}). If it is another format, open it without format= to detect it"
        )
    return _open_files(path, [os.path.join(path, e) for e in shards])
