"""Direct reads and writes of zarr v3 chunk files on a local filesystem.

xckpt reads and writes the arrays of `"files"` and `"plain"` ranks itself when
the checkpoint is a local directory, byte for byte as tensorstore's zarr3 driver
would (`xckpt.native._zarr.array_metadata`; tests check both directions):

- `"files"` (format version 3): `<key>/zarr.json` and one shard file
  `<key>/c.0.0` (`c` for a 0-d array): an index of `(offset, nbytes)` uint64
  pairs, one per zarr chunk in C order, and its crc32c, then every zarr chunk;
- `"plain"` (versions 1 and 2): one file per zarr chunk, `<key>/c/<i>/<j>`.

A zarr chunk is its little-endian bytes in C order (padded with zeros to the full
grid at the array's edges) followed by their crc32c, 4 bytes little-endian.

Without tensorstore's intermediate buffers:

- a read `preadv`s the chunks straight into the destination when the wanted part
  is contiguous there (whole chunks, or row ranges of C-contiguous tensors: a whole
  box of a "files" array is one request per 32 MiB), else into a per-thread scratch
  buffer, and checks every crc32c in hardware (`google_crc32c`);
- a write `pwritev`s straight from the caller's arrays (a copy only for chunks
  that are not contiguous there), then fsyncs every file and every directory it
  created, so the data is durable before the rank manifest is written.

Files are written in place, not through a temporary name: a save always writes into
a key space no committed manifest points to (a fresh location, or
`data/<rank>.<token>/` when overwriting), and readers accept data only through a
manifest written after this returns.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import math
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import google_crc32c
import numpy as np
from isal import isal_zlib

from xckpt.native import _codecs
from xckpt.native._filemeta import (
    ChunkFileError,
    check_meta,
    check_shard,
    chunk_file,
    data_file,
    parse_layout,
    parse_meta,
    stored_meta,
    zarr_json,
)
from xckpt.native._filemeta import grid_ranges as _grid_ranges
from xckpt.storage import fsync_dir, local_root

__all__ = [
    "local_root", "ChunkFileError", "ArrayWrite", "ChunkRead", "write_arrays", "submit_read",
    "bytes_read", "check_meta", "check_shard", "parse_meta", "parse_layout", "stored_meta", "chunk_file", "data_file",
    "zarr_json", "recycle_under", "read_mapped_under", "crc32",
]

#: Threads for reads: twice the cores overlaps page-cache copies with crc32c (the GIL is
#: released in preadv and large numpy copies); more contend for page faults and were
#: slower on bench/io.py (2 cores: 4 threads 0.23 s, 8 threads 0.37 s warm).
READ_THREADS = max(4, min(16, 2 * (os.cpu_count() or 2)))
#: Threads for writes, which mostly wait in fsync: 8 on 2 cores saved W1 in 0.38 s
#: against 0.47 s with 4 (bench/io.py).
WRITE_THREADS = max(8, min(32, 4 * (os.cpu_count() or 2)))
#: Threads that encode compressed chunks (CPU-bound; numcodecs releases the GIL).
CODEC_THREADS = max(1, os.cpu_count() or 1)
#: Bytes one request reads or writes at most (a box of a "files" array is split in
#: runs of this size, read or written by several threads at once).
RUN_BYTES = 32 << 20
#: Files a write keeps open at once.
_OPEN_FILES = 128
#: Directories whose shard files may be written over a file put in place (`recycle_under`).
_RECYCLERS: dict[str, Callable[[str], bool]] = {}
#: Directories whose files are read through mappings (`read_mapped_under`), with how many
#: registrations each has.
_MAPPED: dict[str, int] = {}
_IOV_MAX = 900
_MISSING = (1 << 64) - 1

_POOLS: dict[str, cf.ThreadPoolExecutor] = {}
_POOL_LOCK = threading.Lock()
_LOCAL = threading.local()
_CRC = google_crc32c.value
_EXTEND = google_crc32c.extend
#: zlib's crc32 (packed chunks' and objects' checksums), from ISA-L: the same values at
#: 12 GB/s against zlib's 3.6 here; like zlib's it releases the GIL.
crc32: Callable[[Any], int] = isal_zlib.crc32
_COUNT_LOCK = threading.Lock()
_BYTES_READ = [0]


def bytes_read() -> int:
    """Bytes this process has read from chunk files directly (tests and benchmarks count
    I/O with it, as with tensorstore's `/tensorstore/kvstore/file/bytes_read` metric)."""
    return _BYTES_READ[0]


def _count(n: int) -> None:
    with _COUNT_LOCK:
        _BYTES_READ[0] += n


def _forget_pool() -> None:
    """In a forked child the parent's I/O threads do not exist: start new pools there."""
    _POOLS.clear()


os.register_at_fork(after_in_child=_forget_pool)


def _pool(purpose: str = "read") -> cf.ThreadPoolExecutor:
    """The I/O threads for `purpose` ("read" or "write"), started on first use."""
    with _POOL_LOCK:
        pool = _POOLS.get(purpose)
        if pool is None:
            n = {"read": READ_THREADS, "write": WRITE_THREADS}.get(purpose, CODEC_THREADS)
            pool = _POOLS[purpose] = cf.ThreadPoolExecutor(n, thread_name_prefix=f"xckpt-{purpose}")
        return pool


def _scratch(nbytes: int) -> np.ndarray:
    """A per-thread reusable byte buffer of at least `nbytes`."""
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), np.uint8)
        _LOCAL.buf = buf
    return buf[:nbytes]


# -- writes ------------------------------------------------------------------


class ArrayWrite(NamedTuple):
    """One array to write: `key` under the checkpoint root, its dtype name, data, zarr
    chunk shape and storage kind (`"files"` or `"plain"`)."""

    key: str
    dtype: str
    array: np.ndarray
    grid: Sequence[int]
    kind: str = "files"
    codec: str | None = None  # version 6: each zarr chunk compressed (xckpt.native._codecs)


def _chunk_parts(arr: np.ndarray, grid: Sequence[int], idx: tuple[int, ...]) -> list[Any]:
    """The stored bytes of zarr chunk `idx` as buffers (views of `arr` where it can),
    zero padding and the crc32c trailer."""
    shape = arr.shape
    starts = [i * g for i, g in zip(idx, grid)]
    stops = [min(s + g, n) for s, g, n in zip(starts, grid, shape)]
    full = math.prod(grid) * arr.itemsize
    # Contiguous in a C-order array when every dim after the first is whole.
    if all(st == 0 and sp == n for st, sp, n in zip(starts[1:], stops[1:], shape[1:])):
        row = full // grid[0] if shape else full
        lo = starts[0] * row if shape else 0
        valid = (stops[0] - starts[0]) * row if shape else full
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


def _pwrite_all(fd: int, parts: Sequence[Any], offset: int) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    total = sum(v.nbytes for v in views)
    done = os.pwritev(fd, views, offset)
    while done < total:  # a short write: go on from where it stopped
        skip, rest = done, []
        for v in views:
            if skip >= v.nbytes:
                skip -= v.nbytes
                continue
            rest.append(v[skip:])
            skip = 0
        done += os.pwritev(fd, rest, offset + done)


def _write_file(path: str, parts: Sequence[Any], sync: bool = True) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        _pwrite_all(fd, parts, 0)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_chunk(path: str, arr: np.ndarray, grid: Sequence[int], idx: tuple[int, ...]) -> None:
    _write_file(path, _chunk_parts(arr, grid, idx), sync=False)


def _libc_sync_file_range() -> Any:
    """libc's `sync_file_range` (Linux), or None."""
    try:
        import ctypes
        import ctypes.util

        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def _write_run(fd: int, offset: int, head: bytes, arr: np.ndarray, grid: Sequence[int],
               idxs: Sequence[tuple[int, ...]]) -> None:
    parts: list[Any] = [head] if head else []
    for idx in idxs:
        parts += _chunk_parts(arr, grid, idx)
    _pwrite_all(fd, parts, offset)
    if _SYNC_FILE_RANGE is not None:
        # Start writing this run back now (the file's fsync then waits for less): a large
        # box's runs stream to disk while the next ones are copied into the page cache.
        _SYNC_FILE_RANGE(fd, offset, sum(memoryview(p).nbytes for p in parts), _SYNC_FILE_RANGE_WRITE)


def _shard_runs(a: ArrayWrite) -> tuple[bytes, int, list[list[tuple[int, ...]]]]:
    """The index of a "files" array's shard, each chunk's stored size, and its chunks in
    runs of about `RUN_BYTES`."""
    idxs = list(itertools.product(*_grid_ranges(a.array.shape, a.grid)))
    size = math.prod(a.grid) * a.array.itemsize + 4
    start = 16 * len(idxs) + 4
    index = np.empty((len(idxs), 2), "<u8")
    index[:, 0] = start + size * np.arange(len(idxs), dtype=np.uint64)
    index[:, 1] = size
    raw = index.tobytes()
    per_run = max(1, min(RUN_BYTES // size, _IOV_MAX // 3))
    return raw + _CRC(raw).to_bytes(4, "little"), size, [idxs[i : i + per_run] for i in range(0, len(idxs), per_run)]


def _makedirs(path: str, made: set[str], known: set[str]) -> None:
    """`os.makedirs`, recording each directory created (and its parent) in `made` for
    fsync; `known` holds directories already seen to exist (no stat for them again)."""
    todo = []
    p = path
    while p not in known and not os.path.isdir(p):
        todo.append(p)
        p = os.path.dirname(p)
    known.add(p)
    for d in reversed(todo):
        try:
            os.mkdir(d)
        except FileExistsError:
            pass
        made.add(d)
        made.add(os.path.dirname(d))
        known.add(d)


def _wait(futs: Sequence[cf.Future[Any]]) -> BaseException | None:
    """Wait for every future (no thread still writes after this); the first error."""
    first: BaseException | None = None
    for f in futs:
        try:
            f.result()
        except (OSError, ValueError) as e:
            first = first or e
    return first


def _encoded_chunk(a: ArrayWrite, idx: tuple[int, ...]) -> tuple[bytes, bytes]:
    """Zarr chunk `idx` of `a` encoded by its codec, and the crc32c of the encoded bytes."""
    parts = _chunk_parts(a.array, a.grid, idx)[:-1]  # the raw bytes (and padding), not their crc
    raw = parts[0] if len(parts) == 1 else np.concatenate([np.asarray(p).reshape(-1).view(np.uint8) for p in parts])
    enc = _codecs.encode(a.codec or "", raw, a.array.itemsize)
    return enc, _CRC(enc).to_bytes(4, "little")


def _write_encoded(path: str, a: ArrayWrite) -> None:
    """A compressed "files" array's shard (index at the start, then each chunk's encoded bytes
    and their crc32c), its chunks encoded on the codec threads; called on a write thread."""
    idxs = list(itertools.product(*_grid_ranges(a.array.shape, a.grid)))
    pool = _pool("codec")
    enc = [f.result() for f in [pool.submit(_encoded_chunk, a, idx) for idx in idxs]]
    index = np.empty((len(idxs), 2), "<u8")
    sizes = np.array([len(e) + 4 for e, _ in enc], np.uint64)
    index[:, 1] = sizes
    index[:, 0] = 16 * len(idxs) + 4 + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64)
    raw = index.tobytes()
    parts: list[Any] = [raw, _CRC(raw).to_bytes(4, "little")]
    for e, crc in enc:
        parts += [e, crc]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        offset = 0
        for i in range(0, len(parts), _IOV_MAX):
            run = parts[i : i + _IOV_MAX]
            _pwrite_all(fd, run, offset)
            offset += sum(len(p) for p in run)
    finally:
        os.close(fd)


def recycle_under(root: str, place: Callable[[str], bool] | None) -> None:
    """Register `place` for the shard files written under directory `root` (None: drop it).

    Before such a file is opened, `place(path)` may put a file at `path` and return True;
    the file is then written over in place and cut to its size instead of truncated, so
    the filesystem reuses its pages (a manager's local tier on tmpfs,
    `xckpt.manager._spares`). `place` runs on the writing thread.
    """
    key = os.path.join(os.path.abspath(root), "")
    if place is None:
        _RECYCLERS.pop(key, None)
    else:
        _RECYCLERS[key] = place


def read_mapped_under(root: str, on: bool) -> None:
    """Read the chunk files under directory `root` by copying out of a mapping of each
    instead of with `preadv` (`on`; False drops one earlier registration).

    On tmpfs this VM copies a mapped file at 3.3 GB/s and `preadv`s it at 1.05 GB/s
    (the kernel's per-page copy to user memory), and a manager's local tier is read
    that way on every restore. The cost of a mapping: a file cut shorter while it is
    mapped kills the reading process (SIGBUS) where `preadv` reads short and raises a
    `ChunkFileError`. So only a directory whose files nobody shortens while they are
    read is registered: a manager's local tier, whose files are written over only
    after retention released their step, never while its restore runs
    (`xckpt.manager._tiers`).
    """
    key = os.path.join(os.path.abspath(root), "")
    with _POOL_LOCK:
        if on:
            _MAPPED[key] = _MAPPED.get(key, 0) + 1
        elif _MAPPED.get(key, 0) > 1:
            _MAPPED[key] -= 1
        else:
            _MAPPED.pop(key, None)


def _preadv(fd: int, path: str, iov: Sequence[np.ndarray], offset: int) -> int:
    """`os.preadv(fd, iov, offset)`, or the same copied out of a mapping when `path` lies
    under a directory of `read_mapped_under` (numpy uint8 buffers; bytes read, short
    at the end of the file)."""
    if not _MAPPED or not any(path.startswith(root) for root in list(_MAPPED)):
        return os.preadv(fd, iov, offset)
    end = min(os.fstat(fd).st_size, offset + sum(b.nbytes for b in iov))
    if end <= offset:
        return 0
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(fd, end - start, prot=mmap.PROT_READ, offset=start) as m:
        src = np.frombuffer(m, np.uint8)
        pos = offset - start
        for b in iov:
            k = min(b.nbytes, src.size - pos)
            if k <= 0:
                if b.nbytes:
                    break
                continue
            b.reshape(-1).view(np.uint8)[:k] = src[pos : pos + k]
            pos += k
        del src  # the mapping closes only once no view of it is left
    return end - offset


def _recycled(path: str) -> bool:
    """Whether a registered `place` put a file at `path` to write over (`recycle_under`)."""
    for root, place in list(_RECYCLERS.items()):
        if path.startswith(root):
            return place(path)
    return False


def write_arrays(root: str, arrays: Sequence[ArrayWrite], done: Callable[[int], None] | None = None) -> None:
    """Write `arrays` as zarr v3 arrays under `root` and make them durable.

    Every file (chunks and `zarr.json`) is written by the I/O threads (each run's
    writeback started at once with `sync_file_range`), then every file and every
    directory created is fsynced, all at once, before this returns. `done(nbytes)`
    is called per array (in this thread) once it is written. Raises OSError on a
    storage failure, after every write has stopped.
    """
    made: set[str] = set()
    known: set[str] = set()
    written: list[str] = []
    for i in range(0, len(arrays), _OPEN_FILES):
        batch = arrays[i : i + _OPEN_FILES]
        _write_batch(root, batch, made, known, written)
        if done is not None:  # progress counts bytes written; durability comes below, for all
            for a in batch:
                done(a.array.nbytes)
    # Every file and directory is made durable at the end, all at once: each fsync is an
    # inode write and a disk cache flush, and issued together they overlap each other
    # instead of stalling the writes (2-rank W1 save 1.40 -> 1.09 s, 1 rank 1.02 -> 0.85 s
    # in alternated runs; fsync as each file finished was the slower layout).
    pool = _pool("write")
    err = _wait([pool.submit(_fsync_path, p) for p in written] + [pool.submit(fsync_dir, d) for d in made])
    if err is not None:
        raise err


def _write_batch(root: str, arrays: Sequence[ArrayWrite], made: set[str], known: set[str],
                 written: list[str]) -> None:
    """Write `arrays` (not yet durable); the files written are appended to `written`."""
    pool = _pool("write")
    futs: list[cf.Future[Any]] = []

    def then_close(fd: int, runs: cf.Future[Any]) -> cf.Future[Any]:
        """Close `fd` once its writes are done (even when they failed)."""
        out: cf.Future[Any] = cf.Future()

        def go(f: cf.Future[Any]) -> None:
            try:
                os.close(fd)
            except OSError as e:
                out.set_exception(f.exception() or e)
                return
            err = f.exception()
            if err is not None:
                out.set_exception(err)
            else:
                out.set_result(None)

        runs.add_done_callback(go)
        return out

    try:
        for a in arrays:
            key_dir = os.path.join(root, a.key)
            shape = a.array.shape
            if a.codec is not None:
                _makedirs(key_dir, made, known)
                written.append(data_file(key_dir, len(shape)))
                futs.append(pool.submit(_write_encoded, written[-1], a))
            elif a.kind == "files":
                _makedirs(key_dir, made, known)
                path = data_file(key_dir, len(shape))
                reused = bool(_RECYCLERS) and _recycled(path)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (0 if reused else os.O_TRUNC), 0o644)
                written.append(path)
                head, size, runs = _shard_runs(a)
                if reused:  # written over in place: cut to its size (its pages up to there are kept)
                    try:
                        os.ftruncate(fd, len(head) + size * sum(len(r) for r in runs))
                    except OSError:
                        os.close(fd)
                        raise
                offset, run_futs = 0, []
                for n, run in enumerate(runs):
                    first = head if n == 0 else b""
                    run_futs.append(pool.submit(_write_run, fd, offset, first, a.array, a.grid, run))
                    offset += len(first) + size * len(run)
                futs.append(then_close(fd, _all(run_futs)))
            else:
                idxs = list(itertools.product(*_grid_ranges(shape, a.grid)))
                for d in {os.path.dirname(chunk_file(key_dir, idx)) for idx in idxs} if shape else {key_dir}:
                    _makedirs(d, made, known)
                paths = [chunk_file(key_dir, idx) for idx in idxs]
                written.extend(paths)
                futs += [pool.submit(_write_chunk, p, a.array, a.grid, idx) for p, idx in zip(paths, idxs)]
            meta = zarr_json(a.kind, a.dtype, shape, a.grid, a.codec)
            written.append(os.path.join(key_dir, "zarr.json"))
            futs.append(pool.submit(_write_file, written[-1], [meta], False))
    except OSError:
        _wait(futs)
        raise
    err = _wait(futs)
    if err is not None:
        raise err


def _all(futs: Sequence[cf.Future[Any]], result: Any = None) -> cf.Future[Any]:
    """A future done when all of `futs` are (its result `result`), failing with the first error."""
    out: cf.Future[Any] = cf.Future()
    left = [len(futs)]
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one(f: cf.Future[Any]) -> None:
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
    """Read `region` (slices in the stored box's coordinates) of the array at `key`
    (stored shape `shape`, zarr grid `grid`, storage `kind`) into `out` (exactly
    the region's shape)."""

    key: str
    shape: tuple[int, ...]
    grid: tuple[int, ...]
    region: tuple[slice, ...]
    out: np.ndarray
    kind: str = "files"
    codec: str | None = None  # version 6: each zarr chunk compressed (xckpt.native._codecs)


def _touched(job: ChunkRead) -> Iterator[tuple[tuple[int, ...], tuple[slice, ...], tuple[slice, ...]]]:
    """(idx, slices inside the zarr chunk, slices of `job.out`) per zarr chunk the region touches."""
    lo = [r.start for r in job.region]
    hi = [r.stop for r in job.region]
    ranges = [range(a // g, (b - 1) // g + 1) if b > a else range(0) for a, b, g in zip(lo, hi, job.grid)]
    for idx in itertools.product(*ranges):
        starts = [i * g for i, g in zip(idx, job.grid)]
        inner = tuple(slice(max(a, s) - s, min(b, s + g) - s) for a, b, s, g in zip(lo, hi, starts, job.grid))
        dest = tuple(slice(max(a, s) - a, min(b, s + g) - a) for a, b, s, g in zip(lo, hi, starts, job.grid))
        yield idx, inner, dest


def _is_prefix(out: np.ndarray, grid: Sequence[int], inner: tuple[slice, ...]) -> bool:
    """Whether `inner` of a zarr chunk is a prefix of its bytes that `out` holds contiguously."""
    return (
        out.flags.c_contiguous
        and all(s.start == 0 for s in inner)
        and all(s.stop == g for s, g in zip(inner[1:], grid[1:]))
    )


def _check_crc(path: str, what: str, head: np.ndarray, tail: np.ndarray, stored: np.ndarray) -> None:
    crc = _CRC(head)
    if tail.size:
        crc = _EXTEND(crc, tail)
    want = int.from_bytes(bytes(stored), "little")
    if crc != want:
        raise ChunkFileError(f"{path}{what} fails its crc32c check (stored {want:#010x}, computed {crc:#010x})")


def _read_scratch(fd: int, path: str, what: str, offset: int, full: int, grid: Sequence[int],
                  inner: tuple[slice, ...], out: np.ndarray) -> None:
    """One zarr chunk into scratch, checked, then its `inner` part copied into `out`."""
    buf = _scratch(full + 4)
    n = _preadv(fd, path, [buf], offset)
    _count(n)
    if n != full + 4:
        raise ChunkFileError(f"{path}{what}: read {n} of {full + 4} bytes")
    _check_crc(path, what, buf[:full], buf[:0], buf[full:])
    out[...] = buf[:full].view(out.dtype).reshape(grid)[inner]


def _open_existing(path: str, what: str) -> int:
    """A read-only fd of `path`; ChunkFileError naming it (as `what`) when it is missing."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ChunkFileError(f"{what} {path} is missing") from None


def _read_file(path: str, grid: tuple[int, ...], inner: tuple[slice, ...], out: np.ndarray) -> None:
    """One "plain" chunk file: checked, `inner` of it into `out`."""
    full = math.prod(grid) * out.itemsize
    fd = _open_existing(path, "chunk file")
    try:
        size = os.fstat(fd).st_size
        if size != full + 4:
            raise ChunkFileError(f"chunk file {path} holds {size} bytes, expected {full + 4}")
        if _is_prefix(out, grid, inner):
            _read_run(fd, path, 0, [(out, full, "")])
        else:
            _read_scratch(fd, path, "", 0, full, grid, inner, out)
    finally:
        os.close(fd)


def _read_run(fd: int, path: str, offset: int, items: Sequence[tuple[np.ndarray, int, str]]) -> None:
    """Adjacent stored chunks from `offset` in one `preadv`: each `(out, full, what)`
    fills `out` with the chunk's first bytes (the rest and the crc go to scratch)."""
    heads = [out.reshape(-1).view(np.uint8) for out, _full, _what in items]
    rests = [full - h.size for h, (_out, full, _what) in zip(heads, items)]
    tail = _scratch(sum(rests) + 4 * len(items))
    iov: list[Any] = []
    pos = 0
    spans = []
    for h, r in zip(heads, rests):
        iov.append(h)
        iov.append(tail[pos : pos + r + 4])
        spans.append((pos, r))
        pos += r + 4
    total = sum(h.size for h in heads) + pos
    n = _preadv(fd, path, iov, offset)
    _count(n)
    if n != total:
        raise ChunkFileError(f"{path}: read {n} of {total} bytes at offset {offset}")
    for h, (p, r), (_out, _full, what) in zip(heads, spans, items):
        _check_crc(path, what, h, tail[p : p + r], tail[p + r : p + r + 4])


def _read_index(path: str, count: int) -> tuple[np.ndarray, int]:
    """A "files" shard's index (`count` x (offset, nbytes)), checked, and the file size."""
    fd = _open_existing(path, "shard file")
    try:
        size = os.fstat(fd).st_size
        want = 16 * count + 4
        if size < want:
            raise ChunkFileError(f"shard file {path} holds {size} bytes, less than its index ({want})")
        buf = os.pread(fd, want, 0)
        _count(len(buf))
    finally:
        os.close(fd)
    raw = np.frombuffer(buf, np.uint8)
    _check_crc(path, " (index)", raw[: want - 4], raw[:0], raw[want - 4 :])
    return np.frombuffer(buf, "<u8", count * 2).reshape(count, 2), size


def index_entry(path: str, what: str, index: np.ndarray, flat: int, stored: int, size: int) -> tuple[int, int]:
    """Entry `flat` of a shard's index, checked: present, `stored` bytes long (chunk and
    crc32c; `stored` -1: a compressed chunk, at least its crc32c) and inside the `size`-byte
    file; ChunkFileError naming the chunk (`what`)."""
    off, nb = int(index[flat, 0]), int(index[flat, 1])
    if off == _MISSING and nb == _MISSING:
        raise ChunkFileError(f"shard file {path}{what} is missing")
    if (nb != stored if stored >= 0 else nb < 4) or off + nb > size:
        raise ChunkFileError(
            f"shard file {path}{what}: index gives bytes [{off}, {off + nb}) of a {size}-byte file, "
            f"expected {stored} bytes"
        )
    return off, nb


def _shard_tasks(path: str, job: ChunkRead, index: np.ndarray, size: int) -> list[tuple[Any, tuple[Any, ...]]]:
    """Reads of the chunks `job` needs from a shard: runs of adjacent whole chunks in one
    `preadv` each, other chunks one by one through scratch."""
    counts = [len(r) for r in _grid_ranges(job.shape, job.grid)]
    full = math.prod(job.grid) * job.out.itemsize
    tasks: list[tuple[Any, tuple[Any, ...]]] = []
    run: list[tuple[np.ndarray, int, str]] = []
    run_start = run_end = -1
    for idx, inner, dest in _touched(job):
        flat = int(np.ravel_multi_index(idx, counts)) if idx else 0
        what = f" (zarr chunk {list(idx)})"
        off, nb = index_entry(path, what, index, flat, full + 4, size)
        out = job.out[dest] if dest else job.out
        if not _is_prefix(out, job.grid, inner):
            tasks.append((_shard_scratch, (path, what, off, full, job.grid, inner, out)))
            continue
        if run and (off != run_end or len(run) >= _IOV_MAX // 2 or run_end - run_start >= RUN_BYTES):
            tasks.append((_shard_run, (path, run_start, run)))
            run = []
        if not run:
            run_start = off
        run.append((out, full, what))
        run_end = off + nb
    if run:
        tasks.append((_shard_run, (path, run_start, run)))
    return tasks


def _encoded_tasks(path: str, job: ChunkRead, index: np.ndarray, size: int) -> list[tuple[Any, tuple[Any, ...]]]:
    """Reads of the compressed chunks `job` needs from a shard: one task per zarr chunk."""
    counts = [len(r) for r in _grid_ranges(job.shape, job.grid)]
    tasks: list[tuple[Any, tuple[Any, ...]]] = []
    for idx, inner, dest in _touched(job):
        flat = int(np.ravel_multi_index(idx, counts)) if idx else 0
        what = f" (zarr chunk {list(idx)})"
        off, nb = index_entry(path, what, index, flat, -1, size)
        out = job.out[dest] if dest else job.out
        tasks.append((_read_encoded, (path, what, off, nb, job.codec, job.grid, inner, out)))
    return tasks


def _read_encoded(path: str, what: str, offset: int, nb: int, codec: str, grid: Sequence[int],
                  inner: tuple[slice, ...], out: np.ndarray) -> None:
    """One compressed zarr chunk: read, crc32c checked, decoded (straight into `out` when it is
    the whole chunk, contiguous), `inner` of it into `out`."""
    stored = np.empty(nb, np.uint8)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        n = _preadv(fd, path, [stored], offset)
    finally:
        os.close(fd)
    _count(n)
    if n != nb:
        raise ChunkFileError(f"{path}{what}: read {n} of {nb} bytes")
    _check_crc(path, what, stored[: nb - 4], stored[:0], stored[nb - 4 :])
    whole = out.flags.c_contiguous and tuple(out.shape) == tuple(grid)
    full = out if whole else _scratch(math.prod(grid) * out.itemsize).view(out.dtype).reshape(grid)
    try:
        _codecs.decode(codec, stored[: nb - 4], full, out.itemsize)
    except ValueError as e:
        raise ChunkFileError(f"{path}{what}: {e}") from None
    if not whole:
        out[...] = full[inner]


def _shard_run(path: str, offset: int, items: Sequence[tuple[np.ndarray, int, str]]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _read_run(fd, path, offset, items)
    finally:
        os.close(fd)


def _shard_scratch(path: str, what: str, offset: int, full: int, grid: Sequence[int], inner: tuple[slice, ...],
                   out: np.ndarray) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _read_scratch(fd, path, what, offset, full, grid, inner, out)
    finally:
        os.close(fd)


def run_all(fn: Callable[[Any], Any], items: Sequence[Any]) -> None:
    """`fn(item)` for every item on the read threads (small file reads that each wait on
    the disk, e.g. every array's zarr.json); the first error is raised."""
    for _ in _pool().map(fn, items):
        pass


def submit_read(root: str, job: ChunkRead) -> cf.Future[np.ndarray]:
    """Start reading `job` on the I/O threads; the future's result is `job.out`."""
    pool = _pool()
    key_dir = os.path.join(root, job.key)
    if job.out.size == 0:
        return _all([], job.out)
    if job.kind != "files":
        return _all([
            pool.submit(_read_file, chunk_file(key_dir, idx), job.grid, inner, job.out[dest] if dest else job.out)
            for idx, inner, dest in _touched(job)
        ], job.out)
    path = data_file(key_dir, len(job.shape))
    count = math.prod(len(r) for r in _grid_ranges(job.shape, job.grid))
    result: cf.Future[np.ndarray] = cf.Future()

    def relay(f: cf.Future[Any]) -> None:
        e = f.exception()
        if e is not None:
            result.set_exception(e)
        else:
            result.set_result(job.out)

    def indexed(f: cf.Future[tuple[np.ndarray, int]]) -> None:
        try:
            index, size = f.result()
            tasks = (_encoded_tasks if job.codec else _shard_tasks)(path, job, index, size)
        except (OSError, ChunkFileError) as e:
            result.set_exception(e)
            return
        _all([pool.submit(fn, *args) for fn, args in tasks]).add_done_callback(relay)

    pool.submit(_read_index, path, count).add_done_callback(indexed)
    return result
