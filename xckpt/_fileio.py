"""Direct reads and writes of zarr v3 chunk files on a local filesystem.

An array of a rank with ``"plain"`` storage is what tensorstore's zarr3 driver
writes: ``<key>/zarr.json`` and one file per inner chunk, ``<key>/c/<i>/<j>/...``
(``<key>/c`` for a 0-d array), holding the chunk's little-endian bytes in C order,
padded with zeros to the full grid at the array's edges, followed by the crc32c of
those bytes (4 bytes, little-endian). This module reads and writes exactly those
files, so tensorstore reads what it writes and the other way round (tests check
both), but without tensorstore's intermediate buffers:

- a read ``preadv``s each inner chunk straight into the destination array when
  the wanted part is contiguous there (the common case: whole chunks, or row
  ranges of C-contiguous tensors), else into a per-thread scratch buffer, and
  checks the crc32c in hardware (``google_crc32c``);
- a write ``pwritev``s each inner chunk straight from the caller's array (a copy
  only for chunks that are not contiguous in it), then fsyncs every file and
  every directory it created, so the data is durable before the rank manifest.

Chunk files are written in place, not through a temporary name: a save always
writes into a key space no committed manifest points to (a fresh location, or
``data/<rank>.<token>/`` when overwriting), and readers accept data only through
a manifest written after this returns. Measured on bench/io.py (see the README):
this is what lets a warm load run at page-cache speed and a durable save beat
one fsync'd stream.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import google_crc32c
import numpy as np

from xckpt.storage import key_encoding

__all__ = ["local_root", "ChunkFileError", "ArrayWrite", "ChunkRead", "write_arrays", "read_chunks"]

#: Threads for chunk reads and writes: enough to keep a fast disk busy and to
#: overlap page-cache copies on 2 cores (bench/io.py); the GIL is released in
#: preadv/pwritev/fsync and large numpy copies.
THREADS = max(4, min(16, 2 * (os.cpu_count() or 2)))

_POOL: cf.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_LOCAL = threading.local()
_CRC = google_crc32c.value
_EXTEND = google_crc32c.extend
#: Characters a file URL may encode differently from the path (tensorstore decodes
#: percent escapes): such locations are read and written through tensorstore only.
_UNSAFE = set("%?#\\")


_COUNT_LOCK = threading.Lock()
_BYTES_READ = [0]


def bytes_read() -> int:
    """Bytes this process has read from chunk files directly (tests and benchmarks count
    I/O with it, as with tensorstore's ``/tensorstore/kvstore/file/bytes_read`` metric)."""
    return _BYTES_READ[0]


def _count(n: int) -> None:
    with _COUNT_LOCK:
        _BYTES_READ[0] += n


class ChunkFileError(ValueError):
    """A chunk file is missing, has the wrong size or fails its crc32c (the data is damaged)."""


def local_root(url: Any) -> str | None:
    """The directory of a ``file://`` checkpoint URL, or None for other locations."""
    if not isinstance(url, str) or not url.startswith("file:///"):
        return None
    path = url[len("file://") :]
    if _UNSAFE & set(path):
        return None
    return path


def _forget_pool() -> None:
    """In a forked child the parent's I/O threads do not exist: start a new pool there."""
    global _POOL
    _POOL = None


os.register_at_fork(after_in_child=_forget_pool)


def _pool() -> cf.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = cf.ThreadPoolExecutor(THREADS, thread_name_prefix="xckpt-io")
        return _POOL


def _scratch(nbytes: int) -> np.ndarray:
    """A per-thread reusable byte buffer of at least ``nbytes``."""
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), np.uint8)
        _LOCAL.buf = buf
    return buf[:nbytes]


def _zeros(nbytes: int) -> np.ndarray:
    z = getattr(_LOCAL, "zeros", None)
    if z is None or z.size < nbytes:
        z = np.zeros(max(nbytes, 1 << 16), np.uint8)
        _LOCAL.zeros = z
    return z[:nbytes]


def chunk_file(key_dir: str, idx: Sequence[int], sep: str = "/") -> str:
    """The file of inner chunk ``idx`` of the array in ``key_dir`` (chunk key separator ``sep``)."""
    if not idx:
        return os.path.join(key_dir, "c")
    if sep == ".":
        return os.path.join(key_dir, "c." + ".".join(map(str, idx)))
    return os.path.join(key_dir, "c", *map(str, idx))


def _fill_value(dtype: str) -> Any:
    if dtype == "bool":
        return False
    if dtype.startswith("complex"):
        return [0.0, 0.0]
    if dtype.startswith(("int", "uint")):
        return 0
    return 0.0


#: The codecs of every array read directly: little-endian bytes, then crc32c.
CODECS = [{"configuration": {"endian": "little"}, "name": "bytes"}, {"name": "crc32c"}]
#: The same as tensorstore writes them for one-byte types (no byte order to state).
CODECS_1 = [{"name": "bytes"}, {"name": "crc32c"}]
_ONE_BYTE = ("bool", "int8", "uint8", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


def codecs_ok(codecs: Any) -> bool:
    """Whether stored ``codecs`` are the ones this module reads (either spelling)."""
    return codecs == CODECS or codecs == CODECS_1


def zarr_json(dtype: str, shape: Sequence[int], grid: Sequence[int], sep: str = "/") -> bytes:
    """The array metadata tensorstore writes for :func:`xckpt.storage.array_spec`."""
    meta = {
        "chunk_grid": {"configuration": {"chunk_shape": list(grid)}, "name": "regular"},
        "chunk_key_encoding": key_encoding(sep),
        "codecs": CODECS_1 if dtype in _ONE_BYTE else CODECS,
        "data_type": dtype,
        "fill_value": _fill_value(dtype),
        "node_type": "array",
        "shape": list(shape),
        "zarr_format": 3,
    }
    return json.dumps(meta, separators=(",", ":")).encode()


def stored_meta(root: str, key: str) -> dict[str, Any]:
    """The ``zarr.json`` of the array at ``key`` (ChunkFileError when missing or unreadable)."""
    path = os.path.join(root, key, "zarr.json")
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read(1 << 20))
    except FileNotFoundError:
        raise ChunkFileError(f"{path} is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ChunkFileError(f"{path} is not JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ChunkFileError(f"{path} is not a JSON object")
    return meta


def check_meta(
    root: str, key: str, dtype: str, shape: Sequence[int], grid: Sequence[int], sep: str = "/"
) -> None:
    """Raise ChunkFileError unless the stored metadata of ``key`` is the array the manifest claims."""
    meta = stored_meta(root, key)
    want = json.loads(zarr_json(dtype, shape, grid, sep))
    if not codecs_ok(meta.get("codecs")):
        raise ChunkFileError(
            f"{os.path.join(root, key, 'zarr.json')}: codecs are {meta.get('codecs')!r}, expected {CODECS!r}"
        )
    for field in ("data_type", "shape", "chunk_grid", "chunk_key_encoding"):
        if meta.get(field) != want[field]:
            raise ChunkFileError(
                f"{os.path.join(root, key, 'zarr.json')}: {field} is {meta.get(field)!r}, the manifest "
                f"claims {want[field]!r}"
            )


def _grid_ranges(shape: Sequence[int], grid: Sequence[int]) -> list[range]:
    return [range(-(-s // g)) for s, g in zip(shape, grid)]


# -- writes ------------------------------------------------------------------


class ArrayWrite(NamedTuple):
    """One array to write: ``key`` under the checkpoint root, its dtype name, data, grid and
    chunk key separator."""

    key: str
    dtype: str
    array: np.ndarray
    grid: Sequence[int]
    sep: str = "/"


def _write_file(path: str, parts: Sequence[Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        total = sum(memoryview(p).nbytes for p in parts)
        done = os.pwritev(fd, parts, 0)
        if done != total:  # a short write: finish byte by byte-range
            flat = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
            while done < total:
                done += os.pwrite(fd, flat[done:], done)
        os.fsync(fd)
    finally:
        os.close(fd)


def _chunk_parts(arr: np.ndarray, grid: Sequence[int], idx: tuple[int, ...]) -> list[Any]:
    """The bytes of inner chunk ``idx`` as buffers (views of ``arr`` where it can), with
    zero padding and the crc32c trailer."""
    shape = arr.shape
    starts = [i * g for i, g in zip(idx, grid)]
    stops = [min(s + g, n) for s, g, n in zip(starts, grid, shape)]
    full = math.prod(grid) * arr.itemsize
    # Contiguous in a C-order array when every dim after the first is whole.
    if all(st == 0 and sp == n for st, sp, n in zip(starts[1:], stops[1:], shape[1:])):
        lo = starts[0] * (full // grid[0]) if shape else 0
        valid = (stops[0] - starts[0]) * (full // grid[0]) if shape else full
        data = arr.reshape(-1).view(np.uint8)[lo : lo + valid]
        parts: list[Any] = [data]
        crc = _CRC(data)
        if valid < full:
            pad = np.zeros(full - valid, np.uint8)
            crc = _EXTEND(crc, pad)
            parts.append(pad)
    else:
        block = np.zeros(tuple(grid), arr.dtype)
        block[tuple(slice(0, sp - st) for st, sp in zip(starts, stops))] = arr[
            tuple(slice(st, sp) for st, sp in zip(starts, stops))
        ]
        data = block.reshape(-1).view(np.uint8)
        parts = [data]
        crc = _CRC(data)
    parts.append(crc.to_bytes(4, "little"))
    return parts


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs(path: str, made: set[str]) -> None:
    """``os.makedirs``, recording each directory created (and its parent) for fsync."""
    todo = []
    p = path
    while not os.path.isdir(p):
        todo.append(p)
        p = os.path.dirname(p)
    for d in reversed(todo):
        try:
            os.mkdir(d)
        except FileExistsError:
            pass
        made.add(d)
        made.add(os.path.dirname(d))


def write_arrays(root: str, arrays: Sequence[ArrayWrite], done: Callable[[int], None] | None = None) -> None:
    """Write ``arrays`` as zarr v3 arrays under ``root`` and make them durable.

    Every chunk file and ``zarr.json`` is written and fsynced by the I/O threads;
    then every directory created is fsynced. ``done(nbytes)`` is called per array
    (in this thread) as its chunks complete. Raises OSError on a storage failure.
    """
    made: set[str] = set()
    tasks: list[tuple[int, cf.Future[None]]] = []
    pool = _pool()
    for a in arrays:
        key_dir = os.path.join(root, a.key)
        shape = a.array.shape
        if shape and a.sep == "/":
            dirs = {os.path.dirname(chunk_file(key_dir, idx)) for idx in itertools.product(
                *_grid_ranges(shape, a.grid))}
        else:
            dirs = {key_dir}
        for d in dirs:
            _makedirs(d, made)
        meta = zarr_json(a.dtype, shape, a.grid, a.sep)
        futs = [pool.submit(_write_file, os.path.join(key_dir, "zarr.json"), [meta])]
        for idx in itertools.product(*_grid_ranges(shape, a.grid)):
            futs.append(pool.submit(_write_chunk, chunk_file(key_dir, idx, a.sep), a.array, a.grid, idx))
        tasks.append((a.array.nbytes, _all(futs)))
    first_err: BaseException | None = None
    for nbytes, fut in tasks:
        try:
            fut.result()
        except OSError as e:  # wait for the rest before raising: no thread writes after we return
            first_err = first_err or e
            continue
        if done is not None:
            done(nbytes)
    if first_err is not None:
        raise first_err
    # Concurrently: a journaling file system commits concurrent fsyncs together.
    for f in [pool.submit(_fsync_dir, d) for d in made]:
        f.result()


def _write_chunk(path: str, arr: np.ndarray, grid: Sequence[int], idx: tuple[int, ...]) -> None:
    _write_file(path, _chunk_parts(arr, grid, idx))


def _all(futs: list[cf.Future[None]], result: Any = None) -> cf.Future[Any]:
    """A future done when all of ``futs`` are (its result ``result``), failing with the first error."""
    out: cf.Future[Any] = cf.Future()
    left = [len(futs)]
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one(f: cf.Future[None]) -> None:
        with lock:
            e = f.exception()
            if e is not None:
                errors.append(e)
            left[0] -= 1
            last = left[0] == 0
        if last:
            if errors:
                out.set_exception(errors[0])
            else:
                out.set_result(result)

    if not futs:
        out.set_result(result)
    for f in futs:
        f.add_done_callback(one)
    return out


# -- reads -------------------------------------------------------------------


class ChunkRead(NamedTuple):
    """Read ``region`` (slices in the stored box's coordinates) of the array at ``key``
    (stored shape ``shape``, zarr grid ``grid``) into ``out`` (exactly the region's shape)."""

    key: str
    shape: tuple[int, ...]
    grid: tuple[int, ...]
    region: tuple[slice, ...]
    out: np.ndarray
    sep: str = "/"


def _inner_tasks(root: str, job: ChunkRead) -> Iterator[tuple[str, tuple[int, ...], tuple[slice, ...], tuple[slice, ...]]]:
    """(file, idx, slices inside the inner chunk, slices of ``job.out``) per inner chunk touched."""
    key_dir = os.path.join(root, job.key)
    lo = [r.start for r in job.region]
    hi = [r.stop for r in job.region]
    ranges = [range(a // g, (b - 1) // g + 1) if b > a else range(0) for a, b, g in zip(lo, hi, job.grid)]
    for idx in itertools.product(*ranges):
        starts = [i * g for i, g in zip(idx, job.grid)]
        inner = tuple(
            slice(max(a, s) - s, min(b, s + g) - s) for a, b, s, g in zip(lo, hi, starts, job.grid)
        )
        dest = tuple(
            slice(max(a, s) - a, min(b, s + g) - a) for a, b, s, g in zip(lo, hi, starts, job.grid)
        )
        yield chunk_file(key_dir, idx, job.sep), idx, inner, dest


def _read_file(path: str, grid: tuple[int, ...], inner: tuple[slice, ...], out: np.ndarray) -> None:
    """Read one inner chunk file, check its crc32c, and put ``inner`` of it into ``out``."""
    itemsize = out.itemsize
    full = math.prod(grid) * itemsize
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ChunkFileError(f"chunk file {path} is missing") from None
    try:
        size = os.fstat(fd).st_size
        if size != full + 4:
            raise ChunkFileError(f"chunk file {path} holds {size} bytes, expected {full + 4}")
        # The wanted part is a prefix of the file when only the first dim is cut short.
        prefix = (
            out.flags.c_contiguous
            and all(s.start == 0 for s in inner)
            and all(s.stop == g for s, g in zip(inner[1:], grid[1:]))
        )
        if prefix:
            head = out.reshape(-1).view(np.uint8)
            rest = full - head.size
            tail = _scratch(rest + 4)
            n = os.preadv(fd, [head, tail], 0)
            _count(n)
            if n != full + 4:
                raise ChunkFileError(f"chunk file {path}: read {n} of {full + 4} bytes")
            crc = _CRC(head)
            if rest:
                crc = _EXTEND(crc, tail[:rest])
            stored = int.from_bytes(tail[rest:].tobytes(), "little")
        else:
            buf = _scratch(full + 4)
            n = os.preadv(fd, [buf], 0)
            _count(n)
            if n != full + 4:
                raise ChunkFileError(f"chunk file {path}: read {n} of {full + 4} bytes")
            crc = _CRC(buf[:full])
            stored = int.from_bytes(buf[full:].tobytes(), "little")
            if crc == stored:
                out[...] = buf[:full].view(out.dtype).reshape(grid)[inner]
        if crc != stored:
            raise ChunkFileError(
                f"chunk file {path} fails its crc32c check (stored {stored:#010x}, computed {crc:#010x})"
            )
    finally:
        os.close(fd)


def submit_read(root: str, job: ChunkRead) -> cf.Future[np.ndarray]:
    """Start reading ``job`` on the I/O threads; the future's result is ``job.out``."""
    pool = _pool()
    futs = [] if job.out.size == 0 else [
        pool.submit(_read_file, path, job.grid, inner, job.out[dest] if dest else job.out)
        for path, _idx, inner, dest in _inner_tasks(root, job)
    ]
    return _all(futs, job.out)


def read_chunks(root: str, jobs: Sequence[ChunkRead], done: Callable[[int, int], None] | None = None) -> None:
    """Fill every ``job.out`` from its chunk files under ``root``, checking crc32c.

    Inner chunks are read concurrently by the I/O threads; ``done(job_index, nbytes)``
    is called in this thread as each job completes. Raises :class:`ChunkFileError`
    (damaged data, naming the file) or OSError (storage) after all reads stopped,
    with ``job_index`` set on it.
    """
    per_job = [submit_read(root, job) for job in jobs]
    first_err: BaseException | None = None
    for i, (job, fut) in enumerate(zip(jobs, per_job)):
        try:
            fut.result()
        except (OSError, ChunkFileError) as e:
            if first_err is None:
                e.job_index = i  # type: ignore[attr-defined]
                first_err = e
            continue
        if done is not None:
            done(i, job.out.nbytes)
    if first_err is not None:
        raise first_err
