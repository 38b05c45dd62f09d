"""safetensors files and Hugging Face safetensors directories as a :class:`~xckpt.source.Source`.

A file is a little-endian u64 ``N``, ``N`` bytes of JSON ``{name: {"dtype", "shape",
"data_offsets": [begin, end)}, "__metadata__": {str: str}}``, then the data (C order,
little endian). The header is parsed here and checked before anything is allocated:
``N`` within :data:`HEADER_CAP` and the file; a JSON object without duplicate keys;
known dtypes; shapes that agree with their byte ranges; ranges inside the data and
disjoint. Bytes are read with ``os.pread`` straight into the caller's buffer (a box of
whole rows is one range); a box of many short runs (a column slice) is copied from a
memory map of its span, a window at a time, each unmapped once copied.

Locations (:func:`open`): one ``.safetensors`` file (any name, if its header parses);
a directory with ``model.safetensors.index.json``, whose ``weight_map`` is the truth
(files it does not name are ignored; a name in two of its shards is an error even where
``safe_open`` accepts it); a directory of ``*.safetensors`` without an index (all of
them; a name in two files is an error); or the index file itself.

Decisions where the design is silent:

* Every tensor is one chunk (none if empty). Its writer (``Chunk.rank``) is 0 for a file
  and the shard's position in sorted file-name order in a directory
  (``model-00001-of-00004`` is writer 0), so ``plot_layout`` colours by shard and
  ``world_size`` is the number of shards. ``Chunk.key`` is ``<file>[begin:end]``
  (absolute byte offsets). ``names()`` are sorted, as ``safe_open(...).keys()``.
* Gaps between tensors and bytes after the last one are accepted (never read);
  overlaps are not.
* ``metadata``: the ``__metadata__`` of the file, or of the shards merged (the first
  wins a clash) and then the index's ``metadata`` (non-strings as JSON text).
* ``bytes_read`` counts tensor bytes taken from files (pread ranges, or bytes copied
  from a mapping; the kernel fetches whole pages), not headers: what ``plan_load``
  predicts for a load.
* No checksums: :meth:`SafetensorsSource.verify` checks file sizes against headers and
  reads every tensor.
"""

from __future__ import annotations

import builtins
import json
import math
import mmap
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
#: Runs of a box at least this long (bytes) are read with one pread each; shorter ones through a mapping.
PREAD_RUN = 64 << 10
#: Largest file window mapped at once for a box of short runs.
MAP_WINDOW = 64 << 20
_PARALLEL_BYTES = 16 << 20  # reads larger than this in total use a thread pool

#: safetensors dtype -> (xckpt dtype name, itemsize): every safetensors dtype xckpt can hold.
DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 1), "U8": ("uint8", 1), "I8": ("int8", 1), "I16": ("int16", 2), "U16": ("uint16", 2),
    "F16": ("float16", 2), "BF16": ("bfloat16", 2), "I32": ("int32", 4), "U32": ("uint32", 4),
    "F32": ("float32", 4), "F64": ("float64", 8), "I64": ("int64", 8), "U64": ("uint64", 8),
    "C64": ("complex64", 8), "F8_E5M2": ("float8_e5m2", 1), "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1), "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1),
}  # fmt: skip


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
        if not isinstance(st_dtype, str) or st_dtype not in DTYPES:
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
        if math.prod(s for s in shape if s) * DTYPES[st_dtype][1] >= 1 << 62:
            raise ManifestError(f"{w}: shape {shape} is too large for any array (even an empty one)")
        begin, end = offs
        if begin > end:
            raise ManifestError(f"{w}: data_offsets [{begin}, {end}) end before they begin")
        if end > buffer:
            raise ManifestError(
                f"{w}: data_offsets [{begin}, {end}) lie past the end of the data buffer ({buffer} bytes "
                "after the header); the file is truncated: re-download or re-save it"
            )
        nbytes = math.prod(shape) * DTYPES[st_dtype][1]
        if nbytes != end - begin:
            raise ManifestError(
                f"{w}: shape {shape} of {st_dtype} needs {nbytes} bytes but data_offsets [{begin}, {end}) "
                f"hold {end - begin}; the header is damaged"
            )
        tensors[name] = TensorInfo(DTYPES[st_dtype][0], tuple(shape), data_start + begin, data_start + end)
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
    """One safetensors file: its parsed header and an open descriptor (until the source closes)."""

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
            where = f"safetensors file {path!r}"
            n = header_length(os.pread(fd, 8, 0), self.size, where)
            body = os.pread(fd, n, 8)
            if len(body) != n:
                raise ManifestError(f"{where}: the file ended inside its {n}-byte header (read {len(body)})")
            self.header = parse_header(body, self.size, where)
        except OSError as e:
            os.close(fd)
            raise XckptError(f"{path!r}: cannot read the safetensors header ({e.strerror})") from None
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def descriptor(self, source: str, name: str) -> int:
        """The open descriptor, for reading tensor ``name``; XckptError once ``source`` is closed."""
        if self.fd is None:
            raise XckptError(f"checkpoint {source!r} is closed; open it again to read {name!r}")
        return self.fd


def _close_all(files: list[_File]) -> None:
    for f in files:
        if f.fd is not None:
            os.close(f.fd)
            f.fd = None


class SafetensorsSource(Source):
    """A safetensors file or Hugging Face directory opened for reading (see the module docstring).

    Attributes:
        files: the safetensors files read, in writer order.
        bytes_read: tensor bytes taken from files so far (see the module docstring).
    """

    format = FORMAT

    def __init__(
        self, path: str, files: list[_File], tensors: dict[str, tuple[_File, TensorInfo]], metadata: dict[str, str]
    ) -> None:
        self.path = path
        self.files = files
        self._finalizer = weakref.finalize(self, _close_all, files)
        self._meta = metadata
        self._tensors = tensors
        self._entries: dict[str, TensorEntry] = {}
        self.bytes_read = 0
        self._lock = threading.Lock()
        for name, (f, t) in sorted(tensors.items()):
            key = f"{f.name}[{t.begin}:{t.end}]"
            chunk = Chunk(offset=(0,) * len(t.shape), shape=t.shape, key=key, rank=f.rank, nbytes=t.end - t.begin)
            entry = TensorEntry(name=name, dtype=t.dtype, shape=t.shape, chunks=(chunk,) if math.prod(t.shape) else ())
            check_coverage(t.shape, entry.boxes, name, where=path)
            self._entries[name] = entry

    @property
    def world_size(self) -> int:
        return max(1, len(self.files))

    @property
    def metadata(self) -> Mapping[str, str]:
        return self._meta

    # -- reads ----------------------------------------------------------------

    def _read_chunks(self, jobs: Sequence[ChunkRead], bar: Any) -> None:
        for name, _c, _r, _o in jobs:
            self._tensors[name][0].descriptor(self.path, name)  # closed: an error before any read
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
        self._fill(name, f, f.descriptor(self.path, name), t, start, box, buf)
        if buf is not dst:
            dst[...] = buf
        return buf.nbytes

    def _fill(
        self,
        name: str,
        f: _File,
        fd: int,
        t: TensorInfo,
        start: tuple[int, ...],
        box: tuple[int, ...],
        buf: np.ndarray,
    ) -> None:
        """Read box ``start``/``box`` of tensor ``t`` into the C-contiguous ``buf``.

        The box is ``R`` runs of contiguous bytes (dims from the innermost partial
        one outwards). One run, or runs of at least :data:`PREAD_RUN` bytes: one
        pread each, straight into ``buf``. Many small runs (a column slice): the
        byte span is memory-mapped in windows of at most :data:`MAP_WINDOW` bytes
        and copied with numpy strides, so only the pages holding the runs are
        touched and no syscall is made per run; each window is unmapped at once.
        """
        nd = len(shape := t.shape)
        isz = buf.itemsize
        strides = [math.prod(shape[i + 1 :]) for i in range(nd)]  # C strides, in elements
        partial = [i for i in range(nd) if box[i] != shape[i]]
        k = partial[-1] if partial else 0
        runs, run = math.prod(box[:k]), math.prod(box[k:])
        base = sum(s * st for s, st in zip(start, strides))
        if runs == 1 or run * isz >= PREAD_RUN:
            offs = np.zeros(1, dtype=np.int64)
            for i in range(k):
                offs = (offs[:, None] + np.arange(box[i], dtype=np.int64) * strides[i]).reshape(-1)
            rows = buf.reshape(runs, -1).view(np.uint8)
            for r, off in enumerate((t.begin + (offs + base) * isz).tolist()):
                self._pread(name, f, fd, t, rows[r], off)
            return
        last = sum((b - 1) * st for b, st in zip(box[1:], strides[1:])) + 1  # elements of one dim-0 slab
        per = max(1, MAP_WINDOW // (strides[0] * isz))
        for i0 in range(0, box[0], per):
            n0 = min(per, box[0] - i0)
            first = t.begin + (base + i0 * strides[0]) * isz
            end = first + ((n0 - 1) * strides[0] + last) * isz
            at = first - first % mmap.ALLOCATIONGRANULARITY
            try:
                m = mmap.mmap(fd, end - at, prot=mmap.PROT_READ, offset=at)
            except (OSError, ValueError) as e:  # ValueError: the file is now shorter than the window
                raise self._short(name, f, fd, t, e) from None
            try:
                view = np.ndarray(
                    (n0, *box[1:]), dtype=buf.dtype, buffer=m, offset=first - at, strides=[s * isz for s in strides]
                )
                buf[i0 : i0 + n0] = view
                del view
            finally:
                m.close()
        with self._lock:
            self.bytes_read += buf.nbytes

    def _short(self, name: str, f: _File, fd: int, t: TensorInfo, why: object) -> CorruptChunkError:
        return CorruptChunkError(
            f"checkpoint {self.path!r}, tensor {name!r}: {f.name} now holds {os.fstat(fd).st_size} bytes, "
            f"but its header puts the tensor at bytes [{t.begin}, {t.end}) ({why}); the file is truncated or "
            "was changed after it was opened: re-download or re-save it"
        )

    def _pread(self, name: str, f: _File, fd: int, t: TensorInfo, dst: np.ndarray, off: int) -> None:
        view = memoryview(dst)
        got = 0
        while got < len(view):
            try:
                n = os.preadv(fd, [view[got:]], off + got)
            except OSError as e:
                raise CorruptChunkError(
                    f"checkpoint {self.path!r}, tensor {name!r}: reading {f.name} at byte {off + got} "
                    f"failed ({e.strerror})"
                ) from None
            if n == 0:
                raise self._short(name, f, fd, t, f"nothing at byte {off + got}")
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


def _open(path: str, paths: list[str], fix: str) -> tuple[list[_File], dict[str, tuple[_File, TensorInfo]]]:
    """Open ``paths`` (writer = position) and map every tensor name to its file; a name in two is an error."""
    files: list[_File] = []
    tensors: dict[str, tuple[_File, TensorInfo]] = {}
    try:
        for rank, p in enumerate(paths):
            files.append(f := _File(p, rank))
            for name, t in f.header.tensors.items():
                if name in tensors:
                    raise ManifestError(
                        f"checkpoint {path!r}: tensor {name!r} is stored in both {tensors[name][0].name} and "
                        f"{f.name}; which one is meant is ambiguous. {fix}"
                    )
                tensors[name] = (f, t)
    except BaseException:
        _close_all(files)
        raise
    return files, tensors


def _metadata(files: list[_File]) -> dict[str, str]:
    meta: dict[str, str] = {}
    for f in files:
        for k, v in f.header.metadata.items():
            meta.setdefault(k, v)
    return meta


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
    for shard in shards:
        if not shard or os.path.isabs(shard) or ".." in shard.replace("\\", "/").split("/"):
            raise ManifestError(f"{index!r}: shard {shard!r} is not a file inside {d!r}; the index is unsafe")
        if not os.path.isfile(os.path.join(d, shard)):
            example = next(n for n, s in wmap.items() if s == shard)
            raise IncompleteCheckpointError(
                f"{index!r} names shard {shard!r} (holding {example!r}), which is not in {d!r}; the "
                "download is incomplete: fetch the missing shard"
            )
    paths = [os.path.join(d, s) for s in shards]
    files, found = _open(path, paths, "Remove it from one shard (or re-save the model)")
    tensors = {}
    for name, shard in wmap.items():
        t = found.get(name)
        if t is None or t[0].path != os.path.join(d, shard):
            _close_all(files)
            raise IncompleteCheckpointError(
                f"{index!r} puts tensor {name!r} in {shard!r}, whose header does not hold it; the index "
                "and the shards come from different saves: re-download them together"
            )
        tensors[name] = t
    meta = _metadata(files)
    imeta = obj.get("metadata")
    if isinstance(imeta, dict):
        meta.update({str(k): v if isinstance(v, str) else json.dumps(v) for k, v in imeta.items()})
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
        files, tensors = _open(path, [path], "")
        return SafetensorsSource(path, files, tensors, _metadata(files))
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
    fix = f"Move one of the files away (or write a {INDEX_NAME} that says which file holds what)"
    files, tensors = _open(path, [os.path.join(path, e) for e in shards], fix)
    return SafetensorsSource(path, files, tensors, _metadata(files))
