"""Convert a checkpoint of any format into any other, streaming with bounded memory.

``xckpt.convert(src, dst)`` opens ``src`` as a :class:`~xckpt.source.Source`
(any format, rules applied as a view), decides what to write (names after
``include``/``exclude``, objects), and hands a :class:`WriteJob` to the writer
of the output format. The writer reads chunk by chunk through the job and lays
bytes out under a fresh temporary path; the driver then re-reads every written
box through ``xckpt.open(tmp, format=<out>)`` (``verify``: crc32c of each source
box, taken as it was read, against the re-read bytes; for xckpt output the reader's
own crc32c check of every stored chunk) and renames the result into place. Nothing
at ``dst`` is touched before that rename.

Speed: source chunks are read into two recycled buffers (the next one in the
background while a writer writes the current one), so no page is faulted in and
zeroed per chunk; only the xckpt writer, which holds chunks until it flushes them,
gets fresh ones. No allocator setting is changed (an earlier fixed glibc mmap
threshold cost CPU on every fresh buffer, process-wide).

Decisions where the design is silent (also in the report):

* ``include``/``exclude`` filter the source's own (un-ruled) names, objects
  included, through a filtering view; the rules are applied to that view, so a
  ``stack`` rule sees only the selected pieces.
* The temporary output is a hidden sibling ``.<dst name>.xckpt-tmp-<hex>``; a
  killed process may leave one behind (never at ``dst``; delete it freely).
  ``overwrite`` moves the old output to ``.<dst name>.xckpt-old-<hex>`` for the
  instant of the swap and removes it after the new one is in place.
* ``dst`` is a local path. A non-empty directory that holds no checkpoint is
  never replaced, even with ``overwrite`` (it may be someone's data); ``dst``
  equal to ``src``, or holding ``src`` inside it, is refused.
* ``max_shard_size`` is only for Hugging Face directories (safetensors output
  whose ``dst`` does not end in ``.safetensors``); default 5 GB as
  ``huggingface_hub`` splits. Such a directory always gets an index, even for
  one shard.
* Per-rank objects (saved with a value per rank) travel as the list of every
  rank's value, except into xckpt, which keeps them per rank.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any, TypeVar

import google_crc32c
import numpy as np

from xckpt._progress import progress
from xckpt.errors import CheckpointExistsError, CorruptChunkError, XckptError
from xckpt.layout import Box
from xckpt.manifest import Chunk, TensorEntry
from xckpt.source import Source, local_path
from xckpt.views import Selected

__all__ = ["convert", "WriteJob", "VerifyMismatchError", "WRITERS", "guess_format", "parse_size", "CONVERT_INFLIGHT_BYTES"]

T = TypeVar("T")

#: Output format -> "module:function" of its writer (imported when used).
WRITERS: dict[str, str] = {
    "xckpt": "xckpt.converters.xckpt_write:write",
    "safetensors": "xckpt.converters.safetensors_write:write",
    "torch": "xckpt.converters.torch_save_write:write",
    "torch-dcp": "xckpt.converters.torch_dcp_write:write",
    "orbax": "xckpt.converters.orbax_write:write",
}

#: Bytes the xckpt writer may hold in flight during a conversion.
CONVERT_INFLIGHT_BYTES = 32 << 20
#: huggingface_hub's default shard size.
DEFAULT_SHARD_SIZE = 5 * 10**9

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_size(size: int | str) -> int:
    """Bytes from an int or a size string as ``huggingface_hub`` reads it.

    ``"100KB"`` is 100,000 bytes, ``"5GB"`` 5 * 10**9; binary units as
    transformers reads them (``"5GiB"`` is 5 * 2**30); a bare number is bytes.
    """
    if isinstance(size, bool):
        raise XckptError(f"max_shard_size must be bytes or a size string like '5GB', got {size!r}")
    if isinstance(size, int):
        if size <= 0:
            raise XckptError(f"max_shard_size must be positive, got {size}")
        return size
    m = _SIZE.match(str(size))
    if m is None or m.group(2).upper() not in _UNITS:
        raise XckptError(
            f"max_shard_size {size!r} is not a size: write bytes or a number with a unit "
            "(KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024), e.g. '5GB'"
        )
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise XckptError(f"max_shard_size {size!r} is not positive")
    return n


class VerifyMismatchError(CorruptChunkError):
    """A converted output does not read back as its source (``verify=True``); nothing is at ``dst``."""


def guess_format(dst: str) -> str:
    """The output format ``dst``'s name suggests: safetensors, torch, or xckpt."""
    low = dst.rstrip("/").lower()
    if low.endswith(".safetensors"):
        return "safetensors"
    if low.endswith((".pt", ".pth", ".bin")):
        return "torch"
    return "xckpt"


def _crc(arr: np.ndarray, crc: int = 0) -> int:
    """crc32c of ``arr``'s row-major bytes (hardware crc32c, several GB/s), continuing ``crc``."""
    if not arr.size:
        return crc
    a = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
    raw = a.reshape(-1).view(np.uint8)
    raw.flags.writeable = False  # google_crc32c takes read-only buffers (a view: arr stays writable)
    return google_crc32c.extend(crc, raw)


@dataclass(frozen=True)
class WriteJob:
    """What a format writer receives: everything is decided; it only lays bytes out.

    Attributes:
        src: the opened source (rules applied, names filtered).
        dst: a fresh local path (file or directory) that does not exist yet; the
            driver created its parent and renames it into place afterwards.
        names: tensors to write, in source order.
        objects: objects to write (pickled ones already resolved or dropped).
        max_shard_size: bytes per shard of a safetensors Hugging Face directory (set by
            the driver only for one; None: the safetensors writer writes one file).
        bar: progress bar; writers call ``bar.update(nbytes)`` as tensor bytes land.
        per_rank_objects: names in ``objects`` saved per rank; their value is the
            list of every rank's value, in rank order.
        record: record a crc32c per source box as it is read, for verify (the driver
            turns it off without verify, and for xckpt output, which checks its own).
    """

    src: Source
    dst: str
    names: tuple[str, ...]
    objects: Mapping[str, Any]
    max_shard_size: int | None
    bar: Any
    per_rank_objects: frozenset[str] = frozenset()
    record: bool = True
    _buffers: _Buffers = field(default_factory=lambda: _Buffers(), repr=False, compare=False)
    _crcs: dict[tuple[str, tuple[int, ...], tuple[int, ...]], int] = field(
        default_factory=dict, repr=False, compare=False
    )
    _partial: dict[tuple[str, tuple[int, ...], tuple[int, ...]], int] = field(
        default_factory=dict, repr=False, compare=False
    )

    def info(self, name: str) -> TensorEntry:
        """dtype, shape and chunk boxes of ``name`` in the source."""
        return self.src.info(name)

    def _record(self, name: str, box: Box, arr: np.ndarray) -> None:
        if self.record:
            self._crcs[(name, tuple(box.offset), tuple(box.shape))] = _crc(arr)

    def read_chunk(self, name: str, chunk: Chunk, *, reuse: bool = False) -> np.ndarray:
        """One stored chunk of ``name``; records its crc32c for verify.

        The buffer is fresh, or with ``reuse`` one of two recycled ones (see :meth:`chunks`).
        """
        t = self.src.info(name)
        out = self._buffers.take(chunk.shape, t.np_dtype) if reuse else np.empty(chunk.shape, dtype=t.np_dtype)
        if out.size:
            self.src.read_into([(name, chunk.box, out)], show_progress=False)
        self._record(name, chunk.box, out)
        return out

    def chunks(
        self, name: str, *, rank: int | None = None, reuse: bool = False
    ) -> Iterator[tuple[Chunk, np.ndarray]]:
        """Each stored chunk of ``name`` (of writer ``rank``, or all), in order.

        ``chunk.box`` is where it lies in the tensor, ``chunk.rank`` its source
        writer. Each buffer is fresh (a writer may keep it until it is written), or
        with ``reuse`` valid only until the next chunk is asked for: a writer that is
        done with each chunk by then (it wrote it synchronously) saves the kernel
        zeroing fresh pages for every chunk. The next chunk is read in the background
        meanwhile (two in memory).
        """
        chunks = [c for c in self.src.info(name).chunks if rank is None or c.rank == rank]
        yield from _ahead([functools.partial(self._chunk_pair, name, c, reuse) for c in chunks])
        if reuse:
            self._buffers.trim()

    def bands(
        self, name: str, *, max_bytes: int, multiple: int = 1
    ) -> Iterator[tuple[Chunk, tuple[int, ...], np.ndarray]]:
        """Each stored chunk of ``name`` in bands of whole rows: ``(chunk, band offset, band)``.

        A band holds a multiple of ``multiple`` rows (at least that many) and about
        ``max_bytes``; a chunk no larger than that comes whole. Bands are read one at a
        time into recycled buffers, each valid only until the next is asked for, the
        next read in the background meanwhile: memory stays near two bands whatever
        the source's chunks. The crc32c recorded for verify is the whole chunk's.
        """
        t = self.src.info(name)
        reads = []
        for c in t.chunks:
            if not c.box.volume:
                continue
            nbytes = c.box.volume * t.np_dtype.itemsize
            if len(c.shape) == 0 or nbytes <= max_bytes:
                reads.append(functools.partial(self._band, name, c, c.box, True))
                continue
            row = nbytes // c.shape[0]
            rows = max(multiple, (max_bytes // row) // multiple * multiple)
            for a in range(0, c.shape[0], rows):
                b = min(c.shape[0], a + rows)
                box = Box((c.offset[0] + a, *c.offset[1:]), (b - a, *c.shape[1:]))
                reads.append(functools.partial(self._band, name, c, box, b == c.shape[0]))
        yield from _ahead(reads)
        self._buffers.trim()

    def _band(self, name: str, chunk: Chunk, box: Box, last: bool) -> tuple[Chunk, tuple[int, ...], np.ndarray]:
        out = self._buffers.take(box.shape, self.src.info(name).np_dtype)
        if out.size:
            self.src.read_into([(name, box, out)], show_progress=False)
        if self.record:  # bands of a chunk are read in order: its crc32c continues band by band
            key = (name, tuple(chunk.offset), tuple(chunk.shape))
            crc = _crc(out, self._partial.pop(key, 0))
            if last:
                self._crcs[key] = crc
            else:
                self._partial[key] = crc
        return chunk, tuple(box.offset), out

    def _chunk_pair(self, name: str, chunk: Chunk, reuse: bool) -> tuple[Chunk, np.ndarray]:
        return chunk, self.read_chunk(name, chunk, reuse=reuse)

    def tensor(self, name: str, *, reuse: bool = False) -> np.ndarray:
        """The whole tensor (for outputs that cannot hold chunks); crc32c per source box.

        Fresh, or with ``reuse`` valid only until the next read through this job.
        """
        t = self.src.info(name)
        out = self._buffers.take(t.shape, t.np_dtype) if reuse else np.empty(t.shape, dtype=t.np_dtype)
        if out.size:
            self.src.read_into([(name, t.box, out)], show_progress=False)
        for c in t.chunks:
            self._record(name, c.box, out[c.box.slices()])
        return out

    def rows(self, name: str) -> Iterator[np.ndarray]:
        """The tensor's row-major bytes as C-contiguous pieces, in order.

        Pieces are bands of whole rows (dimension 0) that no source chunk
        crosses: a row-sharded tensor streams one chunk at a time, a
        column-sharded one comes as one piece. Records a crc32c per source box;
        the next piece is read in the background while the caller writes one.
        A piece is valid only until the next is asked for (its buffer is reused).
        """
        t = self.src.info(name)
        chunks = [c for c in t.chunks if c.box.volume]
        if t.nbytes == 0:
            return
        if len(t.shape) == 0 or len(chunks) == 1:
            yield self.tensor(name, reuse=True)
            self._buffers.trim()
            return
        bands: list[list[Any]] = []  # [start, end, chunks]
        for c in sorted(chunks, key=lambda c: c.offset[0]):
            lo, hi = c.offset[0], c.offset[0] + c.shape[0]
            if bands and lo < bands[-1][1]:
                bands[-1][1] = max(bands[-1][1], hi)
                bands[-1][2].append(c)
            else:
                bands.append([lo, hi, [c]])
        reads: list[Callable[[], np.ndarray]] = []
        for lo, hi, members in bands:
            if len(members) == 1 and members[0].shape[1:] == t.shape[1:]:
                reads.append(functools.partial(self.read_chunk, name, members[0], reuse=True))
            else:
                box = Box((lo,) + (0,) * (len(t.shape) - 1), (hi - lo,) + tuple(t.shape[1:]))
                reads.append(functools.partial(self._read_band, name, box, members))
        yield from _ahead(reads)
        self._buffers.trim()

    def _read_band(self, name: str, box: Box, members: list[Chunk]) -> np.ndarray:
        buf = self._buffers.take(box.shape, self.src.info(name).np_dtype)
        self.src.read_into([(name, box, buf)], show_progress=False)
        for c in members:
            self._record(name, c.box, buf[c.box.slices(box)])
        return buf


#: An arena larger than this is not kept for pieces under a quarter of its size, nor between tensors.
_KEEP = 32 << 20


class _Buffers:
    """Two byte arenas used in turn, each grown to the largest piece read into it.

    Reading piece k+1 (in the background) while the caller writes piece k needs two
    buffers; piece k+2 goes where piece k was, which the caller is done with by then.
    Recycling them spares the page faults and kernel zeroing of a fresh buffer per
    piece (a quarter of a conversion's CPU time, measured with perf).
    """

    def __init__(self) -> None:
        self._arenas: list[np.ndarray | None] = [None, None]
        self._turn = 0

    def take(self, shape: Sequence[int], dtype: np.dtype[Any]) -> np.ndarray:
        """A C-contiguous array of ``shape`` and ``dtype`` in the next arena."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        i, self._turn = self._turn, 1 - self._turn
        arena = self._arenas[i]
        if arena is None or arena.nbytes < nbytes or (arena.nbytes > _KEEP and arena.nbytes > 4 * nbytes):
            # Too small, or a rare large piece's arena that would stay resident for small ones.
            self._arenas[i] = None  # freed before the new one is allocated
            arena = self._arenas[i] = np.empty(max(nbytes, 64), dtype=np.uint8)
        return arena[:nbytes].view(dtype).reshape(shape)

    def trim(self) -> None:
        """Drop arenas larger than ``_KEEP`` (the caller is done with every piece)."""
        self._arenas = [a if a is not None and a.nbytes <= _KEEP else None for a in self._arenas]


_POOL: ThreadPoolExecutor | None = None


def _ahead(reads: Sequence[Callable[[], T]]) -> Iterator[T]:
    """The results of ``reads`` in order, the next one read in the background while the
    caller writes the current one: reading and writing overlap, one piece ahead."""
    global _POOL
    if not reads:
        return
    if len(reads) == 1:
        yield reads[0]()
        return
    if _POOL is None:
        _POOL = ThreadPoolExecutor(1, thread_name_prefix="xckpt-convert-read")
    fut = _POOL.submit(reads[0])
    try:
        for nxt in reads[1:]:
            res = fut.result()
            fut = _POOL.submit(nxt)
            yield res
            del res
        yield fut.result()
    finally:
        if not fut.done():
            fut.cancel()
            futures_wait([fut])  # never leave a read running on a source being closed


# -- the source side ---------------------------------------------------------------


def _globs(v: str | Sequence[str] | None, what: str) -> list[str] | None:
    if v is None:
        return None
    if isinstance(v, str):
        return [v]
    out = list(v)
    if not all(isinstance(g, str) for g in out):
        raise XckptError(f"{what} must be a glob or a list of globs, got {v!r}")
    return out


def _selected(name: str, include: list[str] | None, exclude: list[str] | None) -> bool:
    if include is not None and not any(fnmatch.fnmatchcase(name, g) for g in include):
        return False
    return not (exclude and any(fnmatch.fnmatchcase(name, g) for g in exclude))


def _check_from_format(src: Any, from_format: str) -> None:
    from xckpt import formats

    if from_format not in formats.FORMATS:
        raise XckptError(f"unknown source format {from_format!r}; known formats: {', '.join(formats.FORMATS)}")
    local = local_path(src)
    if local is None:
        if from_format != "xckpt":
            raise XckptError(f"{src!r}: {from_format} checkpoints are read from local paths")
        return
    if from_format == "xckpt":
        fits = os.path.isdir(local) and formats._has_xckpt(local)
    else:
        fits = bool(formats._module(from_format).detect(local))
    if not fits:
        try:
            found = f"it was detected as {formats.detect(local)}"
        except XckptError:
            found = f"it holds {formats._listing(local)}"
        raise XckptError(
            f"{src!r} is not a {from_format} checkpoint ({found}); drop --from/from_format to detect "
            "the format, or point at the right location. Nothing was written"
        )


def _open(
    src: Any, from_format: str | None, rules: Any, include: Any, exclude: Any, allow_pickle: bool
) -> Source:
    import xckpt

    inc, exc = _globs(include, "include"), _globs(exclude, "exclude")
    if inc is None and exc is None:
        return xckpt.open(src, format=from_format, allow_pickle=allow_pickle, rules=rules)
    raw = xckpt.open(src, format=from_format, allow_pickle=allow_pickle)
    names = [n for n in raw.names() if _selected(n, inc, exc)]
    objs = [n for n in raw.object_names() if _selected(n, inc, exc)]
    view: Source = Selected(raw, names, objs)
    if rules is not None:
        from xckpt.rules import apply_rules

        try:
            view = apply_rules(view, rules)
        except BaseException:
            raw.close()
            raise
    return view


# -- the output side -----------------------------------------------------------------


def _is_checkpoint(path: str) -> bool:
    from xckpt import formats

    try:
        formats.detect(path)
    except XckptError:
        return False
    return True


def _check_dst(dst: str, src: Any, overwrite: bool) -> bool:
    """Whether something at ``dst`` is to be replaced; raises when it must not be."""
    src_local = local_path(src)
    if src_local is not None:
        a, b = os.path.realpath(src_local), os.path.realpath(dst)
        if a == b or (overwrite and a.startswith(b.rstrip(os.sep) + os.sep)):
            raise XckptError(
                f"converting {src!r} to {dst!r} would replace the source; write to another path"
            )
    if not os.path.lexists(dst):
        return False
    if os.path.isdir(dst) and not os.path.islink(dst):
        if not os.listdir(dst):
            return True  # an empty directory is not a checkpoint
        if not _is_checkpoint(dst):
            raise CheckpointExistsError(
                f"{dst!r} is a directory holding files that are not a checkpoint; convert will not "
                "replace it (even with overwrite). Choose another dst, or empty it first"
            )
    if not overwrite:
        raise CheckpointExistsError(
            f"{dst!r} already exists; pass overwrite=True (--overwrite) to replace it, or convert "
            "to a new path"
        )
    return True


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def _commit(tmp: str, dst: str, replace: bool) -> None:
    """Move the verified output into place; the old one is removed only afterwards."""
    if not replace:
        os.rename(tmp, dst)
        return
    parent, base = os.path.split(dst)
    old = os.path.join(parent, f".{base}.xckpt-old-{secrets.token_hex(4)}")
    os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    _remove(old)


def _writer(fmt: str) -> Callable[[WriteJob], None]:
    mod, fn = WRITERS[fmt].split(":")
    try:
        module = importlib.import_module(mod)
    except ModuleNotFoundError as e:
        raise XckptError(f"the {fmt} writer is not available ({e}); convert to another format") from None
    return getattr(module, fn)


#: Bytes of boxes verify reads back in one ``read_into`` (the reader runs them concurrently).
_VERIFY_BATCH = 16 << 20


_Key = tuple[str, tuple[int, ...], tuple[int, ...]]  # (name, box offset, box shape)


def _verify(job: WriteJob, out_format: str) -> None:
    """Check the output at ``job.dst`` reads back as the source.

    Other formats than xckpt: every box recorded while converting is re-read through
    the format's reader and its crc32c compared with the source's. xckpt output: every
    stored chunk is re-read through the xckpt reader, which checks each one's crc32c
    (and a packed chunk's crc32), and the names, dtypes, shapes and boxes must be the
    source's. Reads go in batches of about ``_VERIFY_BATCH`` bytes (a larger box of a
    format other than xckpt in bands of rows, its crc32c continued band by band) into the
    job's two recycled buffers, the next batch read in the background while one is checked.
    """
    import xckpt

    with xckpt.open(job.dst, format=out_format) as out:
        if out_format == "xckpt":
            _check_structure(job, out)
            keys: list[_Key] = [
                (n, tuple(c.offset), tuple(c.shape)) for n in job.names for c in out.info(n).chunks if c.box.volume
            ]
        else:
            keys = list(job._crcs)
        try:
            crc = 0
            for key, buf, last in _read_back(job, out, keys, split=out_format != "xckpt"):
                want = job._crcs.get(key)
                if want is None:
                    continue
                crc = _crc(buf, crc)
                if not last:
                    continue
                crc, got = 0, crc
                if got != want:
                    name, offset, shape = key
                    raise VerifyMismatchError(
                        f"conversion of {job.src.path!r} to {out_format}: tensor {name!r}, box "
                        f"{Box(offset, shape)} reads back with crc32c {got:08x}, the source's is "
                        f"{want:08x}; nothing was written to the destination. Check the disk "
                        "and convert again"
                    )
            problems = out._verify_objects() if job.objects else []
        except VerifyMismatchError:
            raise
        except CorruptChunkError as e:
            problems = [str(e)]
        if problems:
            raise VerifyMismatchError(
                f"conversion of {job.src.path!r} to {out_format} does not read back as written: "
                f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                + "; nothing was written to the destination. Check the disk and convert again"
            )


def _read_back(
    job: WriteJob, out: Source, keys: Sequence[_Key], *, split: bool
) -> Iterator[tuple[_Key, np.ndarray, bool]]:
    """Each box of ``keys`` read from ``out`` in batches (see :func:`_verify`): ``(key, piece,
    last)``. With ``split``, a box larger than a batch comes as bands of whole rows, in order
    (``last`` on its final band), so a reader that decodes every stored chunk a read touches at
    once (tensorstore, for orbax) holds about a batch, not the largest box."""
    dtypes = {name: out.info(name).np_dtype for name in {key[0] for key in keys}}
    pieces: list[tuple[_Key, Box, int, bool]] = []  # (key, box read, bytes, last)
    for key in keys:
        name, offset, shape = key
        nbytes = dtypes[name].itemsize * int(np.prod(shape, dtype=np.int64))
        if not split or len(shape) == 0 or nbytes <= _VERIFY_BATCH or shape[0] <= 1:
            pieces.append((key, Box(offset, shape), nbytes, True))
            continue
        row = nbytes // shape[0]
        step = max(1, _VERIFY_BATCH // max(1, row))
        for lo in range(0, shape[0], step):
            hi = min(shape[0], lo + step)
            box = Box((offset[0] + lo, *offset[1:]), (hi - lo, *shape[1:]))
            pieces.append((key, box, (hi - lo) * row, hi == shape[0]))

    def read(batch: list[tuple[_Key, Box, int, bool]]) -> list[tuple[_Key, np.ndarray, bool]]:
        arena = job._buffers.take((sum(_aligned(n) for *_, n, _ in batch),), np.dtype(np.uint8))
        items, at = [], 0
        for key, box, n, last in batch:
            items.append((key, arena[at : at + n].view(dtypes[key[0]]).reshape(box.shape), last))
            at += _aligned(n)
        reads = [(key[0], box, buf) for (key, box, _, _), (_, buf, _) in zip(batch, items) if buf.size]
        if reads:
            out.read_into(reads, show_progress=False)
        return items

    batches: list[list[tuple[_Key, Box, int, bool]]] = [[]]
    size = 0
    for piece in pieces:
        nbytes = _aligned(piece[2])
        if batches[-1] and size + nbytes > _VERIFY_BATCH:
            batches.append([])
            size = 0
        batches[-1].append(piece)
        size += nbytes
    for items in _ahead([functools.partial(read, batch) for batch in batches if batch]):
        yield from items
        del items
    job._buffers.trim()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def _boxes(t: TensorEntry) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return sorted((tuple(c.offset), tuple(c.shape)) for c in t.chunks if c.box.volume)


def _check_structure(job: WriteJob, out: Source) -> None:
    """The xckpt output holds the source's tensors, dtypes, shapes and boxes."""
    problems = []
    for name in job.names:
        want = job.src.info(name)
        if name not in out:
            problems.append(f"tensor {name!r} is missing")
            continue
        got = out.info(name)
        if (got.dtype, tuple(got.shape)) != (want.dtype, tuple(want.shape)):
            problems.append(
                f"tensor {name!r} is {got.dtype} {list(got.shape)}, the source's {want.dtype} "
                f"{list(want.shape)}"
            )
        elif _boxes(got) != _boxes(want):
            problems.append(f"tensor {name!r} is stored in other boxes than the source's")
    if problems:
        raise VerifyMismatchError(
            f"conversion of {job.src.path!r} to xckpt does not read back as written: "
            f"{'; '.join(problems[:5])}" + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
            + "; nothing was written to the destination. Check the disk and convert again"
        )


def convert(
    src: Any,
    dst: str | os.PathLike[str],
    *,
    from_format: str | None = None,
    to_format: str | None = None,
    rules: Any = None,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    overwrite: bool = False,
    verify: bool = True,
    max_shard_size: int | str | None = None,
    allow_pickle: bool = False,
    show_progress: bool | None = None,
) -> str:
    """Convert the checkpoint at ``src`` (any format) into ``dst``, chunk by chunk.

    Args:
        src: checkpoint location (local path, or a kvstore URL for xckpt).
        dst: local output path. Format from ``to_format``, else from the name:
            ``*.safetensors`` one safetensors file, ``*.pt|*.pth|*.bin`` torch.save,
            anything else xckpt (``to_format="safetensors"`` with another name
            writes a Hugging Face directory: index and shards).
        from_format: force the source format; one that does not fit is an error.
        to_format: ``xckpt``, ``safetensors``, ``torch``, ``torch-dcp`` or ``orbax``.
        rules: rename/transpose/stack rules (list of dicts, or a JSON/TOML file).
        include, exclude: shell globs (``fnmatch``: ``*`` crosses dots) on the
            source's names, tensors and objects, applied before rules.
        overwrite: replace an existing checkpoint at ``dst`` (whole, after the new
            one is written and verified).
        verify: re-read every written box and compare crc32s with the source's.
        max_shard_size: bytes or a size string (``"5GB"``, ``"500MiB"``) per shard
            of a Hugging Face directory; default 5 GB.
        allow_pickle: convert pickled objects (DCP's non-tensor values); without
            it they are skipped with a warning naming them.
        show_progress: progress bar (default: when stderr is a TTY).

    Returns:
        The output path.

    Raises:
        CheckpointExistsError: ``dst`` exists and ``overwrite`` is not set.
        CorruptChunkError: ``verify`` read back bytes that differ from the source's.
        XckptError: the source cannot be read as asked, or the output cannot hold it.
    """
    out = local_path(dst)
    if out is None:
        raise XckptError(
            f"convert writes to local paths; {dst!r} is a URL. Convert locally, then copy, or save "
            "xckpt checkpoints to remote storage with xckpt.save"
        )
    out = out.rstrip(os.sep) or out
    fmt = to_format if to_format is not None else guess_format(out)
    if fmt not in WRITERS:
        raise XckptError(f"unknown output format {fmt!r}; known: {', '.join(WRITERS)}")
    hf_dir = fmt == "safetensors" and not out.lower().endswith(".safetensors")
    shard: int | None = None
    if max_shard_size is not None:
        if not hf_dir:
            raise XckptError(
                "max_shard_size applies to Hugging Face directories (to_format='safetensors' with a "
                f"dst not ending in .safetensors); {out!r} is written as {fmt}"
            )
        shard = parse_size(max_shard_size)
    elif hf_dir:
        shard = DEFAULT_SHARD_SIZE
    if from_format is not None:
        _check_from_format(src, from_format)
    replace = _check_dst(out, src, overwrite)
    writer = _writer(fmt)
    source = _open(src, from_format, rules, include, exclude, allow_pickle)
    try:
        names = tuple(source.names())
        obj_names = source.object_names()
        skipped = [] if allow_pickle else sorted(source.pickled_objects() & set(obj_names))
        if skipped:
            warnings.warn(
                f"convert {source.path!r}: skipping pickled objects {skipped}; pass allow_pickle=True "
                "(--allow-pickle) to convert them (unpickling runs code stored in the checkpoint)",
                stacklevel=2,
            )
        wanted = [n for n in obj_names if n not in set(skipped)]
        objects = source.objects(wanted, per_rank="list") if wanted else {}
        per_rank = frozenset(source.per_rank_objects() & set(wanted))
        parent, base = os.path.split(os.path.abspath(out))
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{base}.xckpt-tmp-{secrets.token_hex(4)}")
        total = sum(source.info(n).nbytes for n in names)
        try:
            with progress(total, f"convert to {fmt}", show_progress) as bar:
                job = WriteJob(source, tmp, names, objects, shard, bar, per_rank, record=verify and fmt != "xckpt")
                writer(job)
            if not os.path.lexists(tmp):
                raise XckptError(f"the {fmt} writer wrote nothing at {tmp!r}")
            if verify:
                _verify(job, fmt)
            _commit(tmp, os.path.abspath(out), replace)
        except BaseException:
            _remove(tmp)
            raise
    finally:
        source.close()
    return out
