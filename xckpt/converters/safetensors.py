"""safetensors files and Hugging Face safetensors directories as a [`Source`][xckpt.source.Source].

A file is a little-endian u64 `N`, `N` bytes of JSON `{name: {"dtype", "shape",
"data_offsets": [begin, end)}, "__metadata__": {str: str}}`, then the data (C order,
little endian). The header is parsed here and checked before anything is allocated:
`N` within `HEADER_CAP` and the file; a JSON object without duplicate keys;
known dtypes; shapes that agree with their byte ranges; ranges inside the data and
disjoint. Bytes are read as byte ranges straight into the caller's buffer (a box of
whole rows is one range); a box of many short runs (a column slice) is copied from a
memory map of its span (a local file), or from its span read a window at a time
(elsewhere), each window released once copied.

Locations ([`open`][xckpt.open]), at any location (`Place`: a local path,
a kvstore URL or spec, `http(s)://`): one `.safetensors` file (any name, if its
header parses); a directory with `model.safetensors.index.json`, whose `weight_map`
is the truth (files it does not name are ignored; a name in two of its shards is an
error even where `safe_open` accepts it); a directory of `*.safetensors` without an
index (all of them; a name in two files is an error); or the index file itself. An
`http(s)://` directory cannot be listed: it is found by probing
`model.safetensors.index.json`, then `model.safetensors`. Where a file's size is
unknown until read (a kvstore), the header's claims are checked by reading the last
byte they claim.

Decisions where the design is silent:

* Every tensor is one chunk (none if empty). Its writer (`Chunk.rank`) is 0 for a file
  and the shard's position in sorted file-name order in a directory
  (`model-00001-of-00004` is writer 0), so `plot_layout` colours by shard and
  `world_size` is the number of shards. `Chunk.key` is `<file>[begin:end]`
  (absolute byte offsets). `names()` are sorted, as `safe_open(...).keys()`.
* Gaps between tensors and bytes after the last one are accepted (never read);
  overlaps are not.
* `metadata`: the `__metadata__` of the file, or of the shards merged (the first
  wins a clash) and then the index's `metadata` (non-strings as JSON text).
* `bytes_read` counts tensor bytes taken from files (pread ranges, or bytes copied
  from a mapping; the kernel fetches whole pages), not headers: what `plan_load`
  predicts for a load.
* No checksums: `SafetensorsSource.verify` checks file sizes against headers and
  reads every tensor.
"""

from __future__ import annotations

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
from xckpt.storage import Blob, Place, as_place, file_to_detect

__all__ = ["FORMAT", "INDEX_NAME", "HEADER_CAP", "SafetensorsSource", "detect", "open", "parse_header"]

FORMAT = "safetensors"
#: The index file transformers writes beside its shards.
INDEX_NAME = "model.safetensors.index.json"
#: What a Hugging Face directory is probed for over http, in order (it cannot be listed).
HTTP_PROBES = (INDEX_NAME, "model.safetensors")
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
    """One header entry: xckpt dtype name, shape, absolute byte range `[begin, end)` in the file."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class Header(NamedTuple):
    """A parsed header: tensors in header order, `__metadata__`, and where the data starts."""

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


def header_length(first: bytes, file_size: int | None, where: str) -> int:
    """The header length `N` from a file's first 8 bytes, checked against the cap and the file
    size (where it is known)."""
    if file_size is None:
        file_size = len(first) if len(first) < 8 else 1 << 62
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


def parse_header(body: bytes, file_size: int | None, where: str) -> Header:
    """Parse and check `body`, the `N` header bytes of a file of `file_size` bytes (None:
    unknown; the caller then checks the claimed extent against the file).

    Raises:
        ManifestError: anything wrong with the header, naming `where` and the tensor.
    """
    data_start = 8 + len(body)
    buffer = file_size - data_start if file_size is not None else 1 << 62
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
    """One safetensors file: its parsed header and its open `Blob`
    (until the source closes). `rel` is its name below the directory opened."""

    def __init__(self, place: Place, rel: str, rank: int) -> None:
        self.path = place.child(rel).name if rel else place.name
        self.rel = rel
        self.name = rel.rsplit("/", 1)[-1] if rel else place.base
        self.rank = rank
        self.blob: Blob | None = None
        where = f"safetensors file {self.path!r}"
        if not place.isfile(rel):
            raise CheckpointNotFoundError(f"{self.path!r}: no such safetensors file")
        blob = place.open(rel, where=where)
        try:
            n = header_length(blob.head(8), blob.size, where)
            try:
                body = blob.pread(8, n)
            except CorruptChunkError:
                raise ManifestError(
                    f"{where}: the header claims {n} bytes but the file ends inside it; the file is "
                    "truncated (re-download or re-save it) or not a safetensors file"
                ) from None
            self.header = parse_header(body, blob.size, where)
            end = max((t.end for t in self.header.tensors.values()), default=self.header.data_start)
            if blob.size is None and not blob.reaches(end):
                raise ManifestError(
                    f"{where}: the header's data_offsets reach byte {end}, past the end of the file; the "
                    "file is truncated: re-download or re-save it"
                )
        except BaseException:
            blob.close()
            raise
        self.blob = blob

    def reader(self, source: str, name: str) -> Blob:
        """The open file, for reading tensor `name`; XckptError once `source` is closed."""
        if self.blob is None:
            raise XckptError(f"checkpoint {source!r} is closed; open it again to read {name!r}")
        return self.blob

    def current_size(self) -> int | None:
        """The file's size now (a local file may have changed since it was opened)."""
        fd = self.blob.local_fd if self.blob is not None else None
        if fd is not None:
            return os.fstat(fd).st_size
        return self.blob.size if self.blob is not None else None


def _close_all(files: list[_File]) -> None:
    for f in files:
        if f.blob is not None:
            f.blob.close()
            f.blob = None


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
            self._tensors[name][0].reader(self.path, name)  # closed: an error before any read
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
            dst = req.target_view(out)
        buf = dst if dst.flags.c_contiguous else np.empty(box, dtype=out.dtype)
        self._fill(name, f, f.reader(self.path, name), t, start, box, buf)
        if buf is not dst:
            dst[...] = buf
        return buf.nbytes

    def _fill(
        self,
        name: str,
        f: _File,
        blob: Blob,
        t: TensorInfo,
        start: tuple[int, ...],
        box: tuple[int, ...],
        buf: np.ndarray,
    ) -> None:
        """Read box `start`/`box` of tensor `t` into the C-contiguous `buf`.

        The box is `R` runs of contiguous bytes (dims from the innermost partial
        one outwards). One run, or runs of at least `PREAD_RUN` bytes: one
        byte-range read each, straight into `buf`. Many small runs (a column slice):
        the byte span is taken in windows of at most `MAP_WINDOW` bytes (memory-
        mapped for a local file, so only the pages holding the runs are touched; read
        elsewhere) and copied with numpy strides; each window is released at once.
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
                self._readinto(name, f, blob, t, rows[r], off)
            return
        last = sum((b - 1) * st for b, st in zip(box[1:], strides[1:])) + 1  # elements of one dim-0 slab
        per = max(1, MAP_WINDOW // (strides[0] * isz))
        fd = blob.local_fd
        for i0 in range(0, box[0], per):
            n0 = min(per, box[0] - i0)
            first = t.begin + (base + i0 * strides[0]) * isz
            end = first + ((n0 - 1) * strides[0] + last) * isz
            at = first - first % mmap.ALLOCATIONGRANULARITY if fd is not None else first
            window: Any
            if fd is not None:
                try:
                    window = mmap.mmap(fd, end - at, prot=mmap.PROT_READ, offset=at)
                except (OSError, ValueError) as e:  # ValueError: the file is now shorter than the window
                    raise self._short(name, f, t, e) from None
            else:
                window = bytearray(end - at)
                self._readinto(name, f, blob, t, np.frombuffer(window, np.uint8), at)
            try:
                view = np.ndarray(
                    (n0, *box[1:]), dtype=buf.dtype, buffer=window, offset=first - at, strides=[s * isz for s in strides]
                )
                buf[i0 : i0 + n0] = view
                del view
            finally:
                if fd is not None:
                    window.close()
        if fd is not None:
            with self._lock:
                self.bytes_read += buf.nbytes

    def _short(self, name: str, f: _File, t: TensorInfo, why: object) -> CorruptChunkError:
        return CorruptChunkError(
            f"checkpoint {self.path!r}, tensor {name!r}: {f.name} now holds {f.current_size()} bytes, "
            f"but its header puts the tensor at bytes [{t.begin}, {t.end}) ({why}); the file is truncated or "
            "was changed after it was opened: re-download or re-save it"
        )

    def _readinto(self, name: str, f: _File, blob: Blob, t: TensorInfo, dst: np.ndarray, off: int) -> None:
        try:
            blob.readinto(off, memoryview(dst))
        except CorruptChunkError as e:
            raise self._short(name, f, t, e if blob.local_fd is None else f"nothing at byte {off}") from None
        except OSError as e:
            raise CorruptChunkError(
                f"checkpoint {self.path!r}, tensor {name!r}: reading {f.name} at byte {off} failed ({e})"
            ) from None
        with self._lock:
            self.bytes_read += dst.nbytes

    # -- verification and lifetime --------------------------------------------

    def verify(self, *, show_progress: bool | None = None) -> list[str]:
        """Check every file's size against its header, then read every tensor; the problems found."""
        problems = []
        for f in self.files:
            need = max((t.end for t in f.header.tensors.values()), default=f.header.data_start)
            try:
                size = f.current_size()
                if size is None:  # a kvstore file: probe the last byte the header claims
                    size = need if f.blob is not None and f.blob.reaches(need) else need - 1
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


def detect(path: str | Place) -> bool:
    """A `.safetensors` file (or one whose first bytes parse as a header), an index, or a
    directory holding an index or `*.safetensors` files (over http: the probed names)."""
    place = as_place(path, probes=HTTP_PROBES)
    try:
        kind = place.kind()
        if kind == "dir":
            if place.listable:
                return any(e.endswith((".safetensors", ".safetensors.index.json")) for e in place.entries())
            return any(place.isfile(p) for p in HTTP_PROBES)
        if kind != "file":
            return False
        if place.base.endswith((".safetensors", ".safetensors.index.json")):
            return True
    except XckptError:
        return False
    with file_to_detect(place) as blob:
        if blob is None:
            return False
        try:
            head = blob.head(9)
        except XckptError:
            return False
        size = blob.size if blob.size is not None else 1 << 62
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return 2 <= n <= min(HEADER_CAP, size - 8) and head[8:9] == b"{"


def _listing(place: Place) -> str:
    return _shown(place.entries()) or "nothing"


def _shown(entries: list[str]) -> str:
    return ", ".join(entries[:12]) + (f", ... ({len(entries)} entries)" if len(entries) > 12 else "")


def _open(path: str, place: Place, rels: list[str], fix: str) -> tuple[list[_File], dict[str, tuple[_File, TensorInfo]]]:
    """Open files `rels` below `place` (writer = position) and map every tensor name to its
    file; a name in two is an error."""
    files: list[_File] = []
    tensors: dict[str, tuple[_File, TensorInfo]] = {}
    try:
        for rank, rel in enumerate(rels):
            files.append(f := _File(place, rel, rank))
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


def _open_index(path: str, d: Place, rel: str) -> SafetensorsSource:
    """The Hugging Face directory `d` whose index is file `rel` in it."""
    index = d.child(rel).name
    raw = d.read(rel, limit=HEADER_CAP)
    if raw is None:
        raise XckptError(f"{index!r}: cannot read the index (it is gone)")
    if len(raw) > HEADER_CAP:
        raise ManifestError(f"{index!r}: an index of over {HEADER_CAP} bytes is over the {HEADER_CAP}-byte limit")
    obj = _json(raw, index, "index")
    wmap = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise ManifestError(f"{index!r}: the index needs a \"weight_map\" object from tensor names to file names")
    shards = sorted(set(wmap.values()))
    for shard in shards:
        parts = shard.replace("\\", "/").split("/")
        if not shard or shard.startswith("/") or os.path.isabs(shard) or any(p in ("", ".", "..") for p in parts):
            raise ManifestError(f"{index!r}: shard {shard!r} is not a file inside {d.name!r}; the index is unsafe")
        if not d.isfile(shard):
            example = next(n for n, s in wmap.items() if s == shard)
            raise IncompleteCheckpointError(
                f"{index!r} names shard {shard!r} (holding {example!r}), which is not in {d.name!r}; the "
                "download is incomplete: fetch the missing shard"
            )
    files, found = _open(path, d, shards, "Remove it from one shard (or re-save the model)")
    tensors = {}
    for name, shard in wmap.items():
        t = found.get(name)
        if t is None or t[0].rel != shard:
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


def open(path: str | Place, *, allow_pickle: bool = False) -> SafetensorsSource:  # noqa: A001
    """Open a safetensors file, a Hugging Face directory, or an index file (headers only), at any
    location (a local path, a kvstore URL or spec, an `http(s)://` URL).

    Args:
        path: a `.safetensors` file; a directory with `model.safetensors.index.json` (or one
            other `*.safetensors.index.json`) or with `*.safetensors` files; an index file.
            Over http, a directory is found by probing `model.safetensors.index.json`, then
            `model.safetensors` (it cannot be listed).
        allow_pickle: unused (safetensors holds no pickles).

    Raises:
        CheckpointNotFoundError: nothing safetensors at `path`.
        IncompleteCheckpointError: the index names a missing shard, or a tensor its shard lacks.
        ManifestError: a header or the index is damaged (each check names file and tensor).
    """
    place = as_place(path, probes=HTTP_PROBES)
    name = place.name
    kind = place.kind()
    if kind == "file":
        if place.base.endswith(".index.json"):
            return _open_index(name, place.parent(), place.base)
        files, tensors = _open(name, place, [""], "")
        return SafetensorsSource(name, files, tensors, _metadata(files))
    if kind != "dir":
        raise CheckpointNotFoundError(f"{name!r}: no such safetensors file or directory")
    if not place.listable:  # http(s): probe what a Hugging Face directory holds
        if place.isfile(INDEX_NAME):
            return _open_index(name, place, INDEX_NAME)
        if place.isfile(HTTP_PROBES[-1]):
            files, tensors = _open(name, place, [HTTP_PROBES[-1]], "")
            return SafetensorsSource(name, files, tensors, _metadata(files))
        raise CheckpointNotFoundError(
            f"{name!r} holds no safetensors checkpoint: an http(s) location cannot be listed, and neither "
            f"{INDEX_NAME} nor {HTTP_PROBES[-1]} is there. Open the file by its URL"
        )
    entries = place.entries()
    indexes = [e for e in entries if e.endswith(".safetensors.index.json")]
    if INDEX_NAME in indexes or len(indexes) == 1:
        return _open_index(name, place, INDEX_NAME if INDEX_NAME in indexes else indexes[0])
    if indexes:
        raise ManifestError(
            f"{name!r} holds several safetensors indexes ({', '.join(indexes)}) and no {INDEX_NAME}; "
            "open the one you mean by its path"
        )
    shards = [e for e in entries if e.endswith(".safetensors") and place.isfile(e)]
    if not shards:
        raise CheckpointNotFoundError(
            f"{name!r} holds no safetensors checkpoint: no {INDEX_NAME} and no *.safetensors file (found "
            f"{_listing(place)}). If it is another format, open it without format= to detect it"
        )
    fix = f"Move one of the files away (or write a {INDEX_NAME} that says which file holds what)"
    files, tensors = _open(name, place, shards, fix)
    return SafetensorsSource(name, files, tensors, _metadata(files))
