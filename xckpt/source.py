"""The read protocol: what every checkpoint format presents to the rest of xckpt.

A [`Source`][xckpt.source.Source] is one opened checkpoint of any format (xckpt, torch DCP,
orbax, safetensors, torch.save). The torch and JAX loaders, `plan_load`, the
CLI, the notebook view and `convert` use only this protocol, so none of them
special-cases a format.

Call contract (who calls what, what an implementation may assume):

1. `open` builds the source from the format's own metadata only: no tensor
   bytes are read and nothing is allocated in proportion to a claimed size
   before the claim is checked against what storage holds. Every tensor is
   described as a [`TensorEntry`][xckpt.manifest.TensorEntry]: dtype (a name from
   `xckpt.manifest.DTYPES`), global shape, and `chunks` whose boxes are
   disjoint and tile the shape exactly (checked once, at open). A chunk's
   `rank` is its writer (a DCP rank, an orbax process, 0 for one file) and its
   `key` is a human-readable location (for messages, tables, `xckpt show`).
2. Callers read through [`Source.read_into`][xckpt.source.Source.read_into] (or `read` /
   `read_all`, which call it). The base class checks dtypes and shapes,
   plans which chunks each target box touches ([`xckpt.layout.plan_reads`][xckpt.layout.plan_reads] over
   the entry's `chunk_index`: a lookup, not a scan)
   and calls `Source._read_chunks` once per `read_into` with every
   [`ChunkRead`][xckpt.source.ChunkRead]. An implementation fills `out[req.target_slices]` from
   `chunk[req.chunk_slices]` for each, reading only those bytes where its
   format allows; `req is None` means the chunk is the whole tensor and
   `out` is the whole tensor. It calls `bar.update(nbytes)` as data lands.
   Bytes that fail a checksum or cannot be decoded raise
   [`CorruptChunkError`][xckpt.errors.CorruptChunkError] naming the checkpoint and tensor.
3. Objects (non-tensor values) are listed by `object_names` and read by
   `objects`, whose policy lives here once: unknown names raise
   [`MissingEntryError`][xckpt.errors.MissingEntryError]; objects listed by
   `pickled_objects` are read only when the source was opened with
   `allow_pickle=True` and otherwise raise [`ObjectError`][xckpt.errors.ObjectError]
   naming the object and the flag; objects listed by `per_rank_objects`
   come back by rank, or as every rank's list. An implementation provides only
   `_object_value(name, rank)` and, with per-rank objects,
   `_per_rank_values(name)`; `objects` calls them after those checks.
4. `verify` reads every chunk and object and returns the problems found.
5. `read_units` tells `plan_load` which storage reads a box costs, so a
   plan's byte counts match what `_read_chunks` really reads.

Sources are used from one thread at a time; an implementation may run its own
reads concurrently inside `_read_chunks`. `close` releases file handles and
mappings; sources are context managers.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from xckpt import inspect
from xckpt._progress import progress
from xckpt.errors import (
    CorruptChunkError,
    DtypeMismatchError,
    MissingEntryError,
    ObjectError,
    ShapeMismatchError,
    XckptError,
)
from xckpt.layout import Box, ReadRequest, box_from_index, plan_reads
from xckpt.manifest import Chunk, TensorEntry, paused_gc

__all__ = ["Source", "ChunkRead", "ObjectQuery", "whole_request", "local_path", "readable_objects", "UnitColumns"]


class ChunkRead(NamedTuple):
    """Read `req.chunk_slices` of `chunk` into `out[req.target_slices]`.

    `req is None`: the chunk is the whole tensor and `out` the whole tensor.
    """

    name: str
    chunk: Chunk
    req: ReadRequest | None
    out: np.ndarray

    @property
    def nbytes(self) -> int:
        """The bytes this read moves (for progress bars and work splitting)."""
        return self.chunk.nbytes if self.req is None else self.req.box.volume * self.out.itemsize


def slice_pairs(group: Sequence[ChunkRead]) -> list[tuple[tuple[slice, ...], np.ndarray]]:
    """Each read of a group as (slices of its chunk, the output view they fill)."""
    out = []
    for job in group:
        req = job.req if job.req is not None else whole_request(job.chunk)
        view = req.target_view(job.out)
        out.append((req.chunk_slices, view))
    return out


def group_bytes(group: Sequence[ChunkRead]) -> int:
    """The bytes a group of reads moves."""
    return sum(j.nbytes for j in group)


def whole_request(chunk: Chunk) -> ReadRequest:
    """The request that reads all of `chunk` into an output of its shape."""
    full = tuple(slice(0, s) for s in chunk.shape)
    return ReadRequest(0, chunk.box, full, full)


class ObjectQuery(NamedTuple):
    """What `Source.objects` was asked besides the names: its `rank`, `world_size` and
    `per_rank` arguments, passed on whole to `Source._get_objects`."""

    rank: int = 0
    world_size: int | None = None
    per_rank: str = "error"



class UnitColumns(NamedTuple):
    """The storage reads of many boxes of one tensor ([`Source.read_units_columns`][xckpt.source.Source.read_units_columns]).

    Units are of two kinds. *Own* units no other tensor reads: only their number and bytes
    per box are given (two boxes of one request that meet one unit each count it, so a
    plan asks with at most one box per rank). *Shared* units (a packed span several tensors' cells lie in) come one row per
    (box, unit) with an int `code`: equal codes are the same unit, across every tensor of
    the source, and `unit(code)` is the key [`read_units`][xckpt.source.Source.read_units]
    names it by (so a plan counts a unit once per rank, whichever path found it).

    Attributes:
        own_reads, own_bytes: per box, its own units and their stored bytes.
        box, code, nbytes: per shared unit row, the box, the unit and its stored bytes.
        unit: the `read_units` key of a code.
    """

    own_reads: np.ndarray
    own_bytes: np.ndarray
    box: np.ndarray
    code: np.ndarray
    nbytes: np.ndarray
    unit: Callable[[int], Hashable]


class Source:
    """One opened checkpoint of any format; see the module docstring for the contract.

    Subclasses set `format`, `path` and `_entries` (or override
    `names`, `info` and `in`) and implement `_read_chunks`;
    a format with objects lists them (`object_names`, and
    `pickled_objects` / `per_rank_objects` where they apply) and
    implements `_object_value` (and `_per_rank_values`), leaving
    `objects` to the base. Metadata and `verify` have defaults that fit
    formats without objects.
    """

    #: The format's name: `xckpt`, `megatron`, `torch-dcp`, `deepspeed`, `orbax`, `safetensors`, `torch`.
    format: str = ""
    #: The location as given (a string; a kvstore spec is shown as JSON).
    path: str = ""

    # -- metadata -------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """How many writers produced the checkpoint (1 for a single file)."""
        return 1

    @property
    def save_id(self) -> str | None:
        """An identifier of the save, when the format records one."""
        return None

    @property
    def metadata(self) -> Mapping[str, Any]:
        """Free-form metadata the format records (safetensors' `__metadata__`, ...).

        A source that leaves part of a checkpoint unread (optimizer state it cannot map to
        parameters, files it does not know) says so under `notes`: a list of sentences, each
        also warned (`UserWarning`) when it is opened (`deepspeed`, `megatron`). Nothing is
        left out silently.
        """
        return {}

    #: Every tensor's entry by name, for formats that build them all at open (most
    #: do); the default `names`, `info` and `in` read it. A source
    #: that computes entries otherwise overrides those three instead.
    _entries: Mapping[str, TensorEntry] = {}

    def names(self) -> list[str]:
        """Tensor names, in the format's order."""
        return list(self._entries)

    def info(self, name: str) -> TensorEntry:
        """dtype, global shape and chunk boxes of tensor `name` (MissingEntryError if absent)."""
        e = self._entries.get(name)
        if e is None:
            raise self._missing(name)
        return e

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def _missing(self, name: str) -> MissingEntryError:
        names = self.names()
        hint = " (it is an object: see objects())" if name in self.object_names() else ""
        return MissingEntryError(
            f"checkpoint {self.path!r} has no tensor {name!r}{hint}; this {self.format} checkpoint "
            f"holds {inspect.plural(len(names), 'tensor')}, e.g. {names[:5]}"
        )

    # -- tensors --------------------------------------------------------------

    def read(self, name: str, index: Any = None) -> np.ndarray:
        """The whole tensor, or the box selected by `index` (ints and unit-step slices)."""
        t = self.info(name)
        box = box_from_index(t.shape, index)
        out = np.empty(box.shape, dtype=t.np_dtype)
        self.read_into([(name, box, out)])
        return out

    @paused_gc()
    def read_into(
        self,
        items: Iterable[tuple[str, Box, np.ndarray]],
        *,
        show_progress: bool | None = None,
    ) -> None:
        """Fill each `out` with box `box` of tensor `name`; reads may run concurrently.

        Only chunks that overlap a box are read. `out` must have the box's shape
        and the saved dtype.

        Raises:
            MissingEntryError: a name is not a tensor of the checkpoint.
            DtypeMismatchError, ShapeMismatchError: `out` does not fit.
            CorruptChunkError: stored bytes fail their checksum or cannot be decoded.
        """
        jobs: list[ChunkRead] = []
        total = 0
        for name, box, out in items:
            total += self._plan(name, self.info(name), box, out, jobs)
        self._run(jobs, total, show_progress)

    def _plan(self, name: str, t: TensorEntry, box: Box, out: np.ndarray, jobs: list[ChunkRead]) -> int:
        """Check `out` against tensor `t` and append the reads of `box` to `jobs`;
        the bytes they fill."""
        if out.dtype != t.np_dtype:
            raise DtypeMismatchError(
                f"checkpoint {self.path!r}, tensor {name!r}: saved as {t.dtype}, target is "
                f"{out.dtype}; load into a {t.dtype} tensor and cast after loading"
            )
        whole = box.shape == t.shape
        if out.shape != box.shape or not (whole or t.box.contains(box)):
            raise ShapeMismatchError(
                f"checkpoint {self.path!r}, tensor {name!r}: target box {box} (out shape "
                f"{tuple(out.shape)}) does not fit the saved shape {t.shape}"
            )
        chunks = t.chunks
        if whole and len(chunks) == 1 and out.flags.c_contiguous:
            # A whole tensor stored as one chunk (the many-small-tensors case): no planning.
            jobs.append(ChunkRead(name, chunks[0], None, out))
            return chunks[0].nbytes
        total = 0
        # The chunks the box meets, found by lookup (grid arithmetic or sorted intervals);
        # only those are built (a grid's cells are made on demand).
        for req in plan_reads(t.chunk_index, box):
            jobs.append(ChunkRead(name, chunks[req.chunk], req, out))
            total += req.box.volume * out.itemsize
        return total

    def _run(self, jobs: Sequence[ChunkRead], total: int, show_progress: bool | None) -> None:
        with progress(total, f"{self.format or 'xckpt'} load", show_progress) as bar:
            self._read_chunks(jobs, bar)

    def _read_chunks(self, jobs: Sequence[ChunkRead], bar: Any) -> None:
        """Fill every job's target slice (see the module docstring, step 2)."""
        raise NotImplementedError

    def read_units(self, name: str, chunk: Chunk, box: Box, itemsize: int) -> dict[Hashable, int]:
        """The storage reads that loading `box` (inside `chunk`) makes: unit -> stored bytes.

        Used by [`xckpt.plan_load`][xckpt.plan_load], which counts each distinct unit once per
        rank. The default is one read of exactly the box's bytes; a format that
        reads whole pieces (zarr chunks, packed byte runs) says so by overriding.
        """
        return {(name, chunk.key, chunk.offset, box.offset, box.shape): box.volume * itemsize}

    def read_units_columns(self, name: str, lo: np.ndarray, hi: np.ndarray, itemsize: int) -> UnitColumns | None:
        """[`read_units`][xckpt.source.Source.read_units] of many boxes of tensor `name` at once, as columns.

        `plan_load`'s fast path: box `q` is `[lo[q], hi[q])` (`(boxes, ndim)` int64 arrays);
        the answer counts the same units with the same bytes as `read_units` over every
        chunk each box meets, without a Python object per unit. None (the default): the
        source has no such path for `name`, and `plan_load` asks `read_units` per chunk.
        """
        return None

    @paused_gc()
    def read_all(
        self, names: Sequence[str] | None = None, *, show_progress: bool | None = None
    ) -> dict[str, np.ndarray]:
        """Whole tensors by name, read concurrently."""
        names = self.names() if names is None else list(names)
        outs: dict[str, np.ndarray] = {}
        jobs: list[ChunkRead] = []
        total = 0
        # Per tensor, the many-small-tensors case costs about 2 us: entries looked up
        # directly (unless a subclass has its own info()), dtypes resolved once, jobs
        # built as plain tuples.
        get = self._entries.get if type(self).info is Source.info else None
        empty, new = np.empty, tuple.__new__
        dtypes: dict[str, np.dtype] = {}
        for n in names:
            t = get(n) if get is not None else self.info(n)
            if t is None:
                raise self._missing(n)
            dt = dtypes.get(t.dtype)
            if dt is None:
                dt = dtypes[t.dtype] = t.np_dtype
            out = outs[n] = empty(t.shape, dt)
            chunks = t.chunks
            if len(chunks) == 1 and chunks[0].shape == t.shape:
                # A whole tensor stored as one chunk into a fresh array: no box, no checks
                # of `out`, no planning.
                c = chunks[0]
                jobs.append(new(ChunkRead, (n, c, None, out)))
                total += c.nbytes
            else:
                total += self._plan(n, t, t.box, out, jobs)
        self._run(jobs, total, show_progress)
        return outs

    # -- objects --------------------------------------------------------------

    #: Whether pickled objects may be read (the `allow_pickle=` the source was opened with).
    allow_pickle: bool = False

    def object_names(self) -> list[str]:
        """Names of non-tensor values."""
        return []

    def objects(
        self,
        names: Sequence[str] | None = None,
        *,
        rank: int = 0,
        world_size: int | None = None,
        per_rank: str = "error",
    ) -> dict[str, Any]:
        """Non-tensor values by name (all, or `names`).

        Replicated objects come back as saved. A per-rank object comes back as
        `rank`'s value when `world_size` (default: the saved one) equals the
        saved world size; otherwise `per_rank="list"` returns every rank's
        value in rank order and the default raises [`ObjectError`][xckpt.errors.ObjectError].

        This policy is the same for every format; a format implements only
        `_object_value` (and `_per_rank_values` where it has per-rank
        objects), and lists its objects with `object_names`,
        `pickled_objects` and `per_rank_objects`.

        Raises:
            ValueError: `per_rank` is neither `"error"` nor `"list"`.
            MissingEntryError: a name is not an object of the checkpoint (checked
                for every name before anything is read).
            ObjectError: a pickled object asked for without `allow_pickle=True`
                (checked before anything is read), a per-rank object at another
                world size, or a rank that saved no value.
        """
        if per_rank not in ("error", "list"):
            raise ValueError("per_rank must be 'error' or 'list'")
        wanted = self.object_names() if names is None else list(names)
        for n in wanted:
            if not self._has_object(n):
                raise self._missing_object(n)
        if not wanted:
            return {}
        return self._get_objects(wanted, ObjectQuery(rank, world_size, per_rank))

    def _get_objects(self, names: list[str], query: ObjectQuery) -> dict[str, Any]:
        """The values of `names` (checked to be objects, at least one) as `query` asks.

        Called by `objects` only, after its checks. A view overrides this (not `objects`)
        to ask its source's `objects` under the source's names; the default refuses
        pickles without `allow_pickle`, then reads through `_object_value` and
        `_per_rank_values`.
        """
        if not self.allow_pickle:
            pickled = self.pickled_objects()
            refused = [n for n in names if n in pickled]
            if refused:
                raise self._pickle_refused(refused)
        world = self.world_size if query.world_size is None else query.world_size
        per = self.per_rank_objects()
        out: dict[str, Any] = {}
        for n in names:
            if n not in per:
                out[n] = self._object_value(n, None)
            elif query.per_rank == "list":
                out[n] = self._per_rank_values(n)
            elif world == self.world_size:
                out[n] = self._object_value(n, query.rank)
            else:
                raise self._per_rank_mismatch(n, world)
        return out

    def pickled_objects(self) -> set[str]:
        """Names of objects stored as pickles: read only with `allow_pickle=True`."""
        return set()

    def per_rank_objects(self) -> set[str]:
        """Names of objects saved per rank (each rank its own value)."""
        return set()

    def nesting(self) -> Mapping[str, tuple[Any, ...]] | None:
        """Where each tensor and object sits in the nested state dict the format's own loader
        rebuilds (a key path of dict keys and list positions), or None when names are the
        whole story. torch DCP says (its `planner_data`: what `dcp_to_torch_save` nests
        by); `xckpt.convert` to torch.save writes that nested dict."""
        return None

    def _has_object(self, name: str) -> bool:
        """Whether `name` is an object; a format holding its objects by name looks it up."""
        return name in self.object_names()

    def _object_value(self, name: str, rank: int | None) -> Any:
        """The value of object `name`, known to exist and allowed to be read.

        `rank` is None for a replicated object, else the rank whose value of a
        per-rank object is wanted (an [`ObjectError`][xckpt.errors.ObjectError] if that
        rank saved none). Called by `objects` only.
        """
        raise NotImplementedError

    def _per_rank_values(self, name: str) -> list[Any]:
        """Every saved rank's value of per-rank object `name`, in rank order."""
        raise NotImplementedError

    def _missing_object(self, name: str) -> MissingEntryError:
        return MissingEntryError(
            f"checkpoint {self.path!r} has no object {name!r}; this {self.format} checkpoint's objects are "
            f"{self.object_names()[:10]}"
        )

    #: How a format's messages name a checkpoint ("torch DCP checkpoint").
    _kind_name: str = "checkpoint"
    #: Why this format's objects are pickles, said when one is refused.
    _pickle_why: str = ""
    #: How a per-rank object came to be, said when one is asked for at another world size
    #: (`{n}`: the saving world size).
    _per_rank_how: str = "was saved per rank by {n} ranks"

    def _pickle_refused(self, names: Sequence[str]) -> ObjectError:
        """The error for asking without `allow_pickle` for pickled objects `names`."""
        return ObjectError(
            f"{self._kind_name} {self.path!r}: object {names[0]!r}"
            + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")
            + f" is a pickle{self._pickle_why} and pickles can run code; read it only from a trusted "
            "checkpoint, by opening with allow_pickle=True"
        )

    def _per_rank_mismatch(self, name: str, world: int) -> ObjectError:
        """The error for per-rank object `name` asked for at world size `world`."""
        return ObjectError(
            f"{self._kind_name} {self.path!r}: object {name!r} {self._per_rank_how.format(n=self.world_size)} "
            f"and is loaded at world size {world}; there is no rank-for-rank match. Ask for every "
            "rank's value with per_rank='list' and choose"
        )

    # -- verification ---------------------------------------------------------

    def verify(self, *, show_progress: bool | None = None) -> list[str]:
        """Read every chunk and object; a list of problems, empty when the checkpoint is sound."""
        problems: list[str] = []
        names = self.names()
        total = sum(self.info(n).nbytes for n in names)
        with progress(total, f"{self.format or 'xckpt'} verify", show_progress) as bar:
            for name in names:
                t = self.info(name)
                for c in t.chunks:
                    out = np.empty(c.shape, dtype=t.np_dtype)
                    try:
                        self.read_into([(name, c.box, out)], show_progress=False)
                    except CorruptChunkError as e:
                        problems.append(str(e))
                    bar.update(c.nbytes)
        problems.extend(self._verify_objects())
        return problems

    def _verify_objects(self) -> list[str]:
        """Problems reading the objects `verify` can read (pickled ones only with `allow_pickle`)."""
        problems = []
        for name in self.object_names():
            if name in self.pickled_objects() and not self.allow_pickle:
                continue
            try:
                self._object_value(name, None)
            except XckptError as e:
                problems.append(str(e))
        return problems

    # -- lifetime ---------------------------------------------------------------

    def close(self) -> None:
        """Release file handles and mappings (idempotent)."""

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- notebook view --------------------------------------------------------

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": inspect.text_table(self), "text/html": inspect.html_table(self)}

    def plot_layout(self, name: str, ax: Any = None, **kwargs: Any) -> Any:
        """Chunk boxes of `name` coloured by writer (matplotlib Axes)."""
        return inspect.plot_layout(self, name, ax, **kwargs)

    def plot_value_ranges(self, name: str, ax: Any = None, **kwargs: Any) -> Any:
        """Key value ranges of `name`'s chunks, for value-group tensors (matplotlib Axes)."""
        return inspect.plot_value_ranges(self, name, ax, **kwargs)

    def __repr__(self) -> str:
        return (
            f"<xckpt source {self.path!r} ({self.format}): {inspect.plural(len(self.names()), 'tensor')}, "
            f"{inspect.plural(len(self.object_names()), 'object')}, world_size {self.world_size}>"
        )


def readable_objects(src: Source, allow_pickle: bool) -> list[str]:
    """`src`'s object names, less its pickled ones (with a warning naming them) unless
    `allow_pickle`: what a load of "everything" reads without running a pickle."""
    names = src.object_names()
    if allow_pickle:
        return names
    pickled = src.pickled_objects()
    skipped = [n for n in names if n in pickled]
    if skipped:
        warnings.warn(
            f"checkpoint {src.path!r}: {len(skipped)} pickled objects not read ({skipped[:5]}"
            f"{' ...' if len(skipped) > 5 else ''}); pickles can run code: open with "
            "allow_pickle=True to read them from a trusted checkpoint",
            stacklevel=3,
        )
    return [n for n in names if n not in pickled]


def local_path(path: Any) -> str | None:
    """`path` as a local filesystem path, or None for URLs other than file:// and specs."""
    if isinstance(path, os.PathLike):
        return os.fspath(path)
    if isinstance(path, str):
        if path.startswith("file://"):
            return path[len("file://") :]
        if "://" in path:
            return None
        return path
    return None
