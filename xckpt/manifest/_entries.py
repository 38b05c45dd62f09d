"""Tensor and object entries of a manifest: frozen dataclasses <-> JSON, validated on read.

A [`TensorEntry`][xckpt.manifest._entries.TensorEntry] is one tensor's dtype, global shape and chunk boxes (each a
`Chunk`), with optional provenance (`PlacementInfo`) and value-range
annotation (`ValueRange`); an `ObjectEntry` is one non-tensor value.
Every claim is checked against the bounds of `_checks` while the JSON is
read, before anything is sized from it. The document that holds them is
[`Manifest`][xckpt.manifest.Manifest] (`_document`).

A tensor's chunks are a list of `Chunk` boxes (`_chunks`), or, for a grid
(format version 5, `_grids`), a lazy `GridChunks`
whose cells are built on demand; either way [`TensorEntry.chunk_index`][xckpt.manifest._entries.TensorEntry.chunk_index] finds the
chunks a box meets without a scan.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xckpt.errors import ManifestError
from xckpt.layout import Box, BoxIndex, ChunkIndex
from xckpt.manifest._checks import (
    DTYPES,
    MAX_CHUNKS,
    MAX_ELEMENTS,
    MAX_NDIM,
    MAX_TENSOR_BYTES,
    MAX_WORLD_SIZE,
    VERSION,
    _build,
    _check_key,
    _dims,
    _int,
    _ints,
    _shape,
    _str,
    itemsize_of,
    numpy_dtype,
    shared_shape,
)
from xckpt.manifest._chunks import Chunk, _chunks_fast
from xckpt.manifest._grids import GRID_MIN_CELLS, GridChunks
from xckpt.manifest._objects import decode_checked

__all__ = ["Chunk", "PlacementInfo", "ValueRange", "TensorEntry", "ObjectEntry", "paused_gc"]


def _json_object(required: dict[str, Any], **optional: Any) -> dict[str, Any]:
    """An entry's JSON object: `required`, then each `optional` member that is set (not None),
    in order; an unset member is left out, so a reader takes its default."""
    required.update((k, v) for k, v in optional.items() if v is not None)
    return required


def _check_named(d: Any, key: str, message: str) -> None:
    """Refuse `d` (with `message`) unless it is a JSON object whose member `key` is a string."""
    if not isinstance(d, dict) or not isinstance(d.get(key), str):
        raise ManifestError(message)


def _itemsize(dtype: Any, shape: tuple[int, ...], w: str) -> tuple[str, int]:
    """A tensor entry's dtype and item size, once `dtype` is known and `shape` of it within the bounds."""
    if type(dtype) is not str or dtype not in DTYPES:
        raise ManifestError(f"{w}: unknown dtype {dtype!r}"[:300])
    itemsize = numpy_dtype(dtype).itemsize
    elements = math.prod(shape)
    if elements > MAX_ELEMENTS or elements * itemsize > MAX_TENSOR_BYTES:
        raise ManifestError(
            f"{w}: shape {list(shape)} ({dtype}) claims {elements * itemsize} bytes, over the "
            f"limit of {MAX_TENSOR_BYTES}; the manifest is corrupt or hostile"
        )
    return dtype, itemsize


@dataclass(frozen=True, kw_only=True)
class PlacementInfo:
    """Provenance of a tensor's sharding; loading never depends on it."""

    framework: str  # "torch" or "jax"
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...] | None = None
    placements: tuple[str, ...] | None = None  # torch: "Shard(0)", "_StridedShard(0, sf=2)", ...
    partition_spec: tuple[Any, ...] | None = None  # jax: None | str | list[str] per dim
    layout: str | None = None  # "placements" or "fsdp2": which storage rule the boxes follow

    def to_json(self) -> dict[str, Any]:
        ps = self.partition_spec
        return _json_object(
            {"framework": self.framework, "mesh_shape": list(self.mesh_shape)},
            axis_names=None if self.axis_names is None else list(self.axis_names),
            placements=None if self.placements is None else list(self.placements),
            partition_spec=None if ps is None else [list(p) if isinstance(p, tuple) else p for p in ps],
            layout=self.layout,
        )

    @classmethod
    def from_json(cls, d: Any, where: str) -> PlacementInfo:
        _check_named(d, "framework", f"{where}: placement must be an object with a framework")
        names = d.get("axis_names")
        pl = d.get("placements")
        ps = d.get("partition_spec")
        layout = d.get("layout")
        w = f"{where}, placement"
        for what, v in (("axis_names", names), ("placements", pl), ("partition_spec", ps)):
            if v is not None and (type(v) is not list or len(v) > MAX_NDIM):
                raise ManifestError(f"{w}: {what} must be a list of at most {MAX_NDIM} entries, got {v!r}"[:300])
        if names is not None and not all(type(n) is str for n in names):
            raise ManifestError(f"{w}: axis_names must be strings, got {names!r}"[:300])
        if pl is not None and not all(type(p) is str for p in pl):
            raise ManifestError(f"{w}: placements must be strings, got {pl!r}"[:300])

        def spec_entry(p: Any) -> Any:
            if p is None or type(p) is str:
                return p
            if type(p) is list and all(type(x) is str for x in p):
                return tuple(p)
            raise ManifestError(f"{w}: a partition_spec entry must be null, a string or strings, got {p!r}"[:300])

        if layout is not None and type(layout) is not str:
            raise ManifestError(f"{w}: layout must be a string, got {layout!r}"[:300])
        mesh = _shape(d.get("mesh_shape", []), "mesh_shape", w)
        return cls(
            framework=d["framework"],
            mesh_shape=mesh,
            axis_names=None if names is None else tuple(names),
            placements=None if pl is None else tuple(pl),
            partition_spec=None if ps is None else tuple(spec_entry(p) for p in ps),
            layout=layout,
        )


@dataclass(frozen=True, kw_only=True)
class ValueRange:
    """A tensor's membership in a value group (DESIGN.md section 4).

    `group` names the group (e.g. the MCH module prefix), `role` the tensor's
    part in it ("key", "row_aligned", "weight", ...), `kind` the group kind
    ("managed_collision" or "generic"). `domain` is the key domain [lo, hi);
    each chunk's own [lo, hi) is in `Chunk.value_range`. `attrs` holds
    the kind-specific JSON fields.
    """

    group: str
    role: str
    kind: str = "generic"
    domain: tuple[int, int] | None = None
    empty_marker: int | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return _json_object(
            {"group": self.group, "role": self.role, "kind": self.kind},
            domain=None if self.domain is None else list(self.domain),
            empty_marker=self.empty_marker,
            attrs=dict(self.attrs) or None,
        )

    @classmethod
    def from_json(cls, d: Any, where: str) -> ValueRange:
        _check_named(d, "group", f"{where}: value_range must be an object with a group")
        w = f"{where}, value_range"
        dom = d.get("domain")
        em = d.get("empty_marker")
        attrs = d.get("attrs", {})
        if not isinstance(attrs, dict):
            raise ManifestError(f"{w}: attrs must be an object")
        role, kind = d.get("role", ""), d.get("kind", "generic")
        if type(role) is not str or type(kind) is not str:
            raise ManifestError(f"{w}: role and kind must be strings, got {role!r}, {kind!r}"[:300])
        if em is not None and (type(em) is not int or not -(1 << 63) <= em < (1 << 64)):
            raise ManifestError(f"{w}: empty_marker must be a 64-bit integer, got {em!r}"[:300])
        domain = None if dom is None else _ints(dom, "domain", w)
        if domain is not None and (len(domain) != 2 or domain[0] > domain[1]):
            raise ManifestError(f"{w}: domain must be [lo, hi) with lo <= hi, got {list(domain)[:4]}")
        return cls(
            group=d["group"],
            role=role,
            kind=kind,
            domain=domain,
            empty_marker=em,
            attrs=attrs,
        )


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    """A tensor: dtype, global shape and its global chunk layout.

    `chunks` is a tuple of `Chunk`, or a `GridChunks` (a lazy sequence:
    its cells are built when asked for). Hot paths look chunks up through
    `chunk_index` and `chunk`, never by walking `chunks`.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: Sequence[Chunk]
    placement: PlacementInfo | None = None
    value_range: ValueRange | None = None

    @property
    def np_dtype(self) -> np.dtype:
        return numpy_dtype(self.dtype)

    @functools.cached_property
    def box(self) -> Box:
        """The whole tensor as a box."""
        return Box.full(self.shape)

    @functools.cached_property
    def boxes(self) -> tuple[Box, ...]:
        """The chunks' boxes, in chunk order (every chunk: use `chunk_index` to look up)."""
        return tuple(c.box for c in self.chunks)

    @functools.cached_property
    def chunk_index(self) -> ChunkIndex:
        """The chunks' boxes, indexed: `find(box)` gives the ids of the chunks a box meets
        (grid arithmetic for a grid, sorted intervals otherwise); built once per entry."""
        chunks = self.chunks
        if isinstance(chunks, GridChunks):
            return chunks.grid_index
        return BoxIndex(self.boxes)

    def chunk_at(self, offset: tuple[int, ...]) -> tuple[int, Chunk]:
        """The chunk whose box starts at `offset`, with its id: found through
        `chunk_index` (a grid's cell is built alone), else by one walk (an empty chunk)."""
        if all(0 <= o < s for o, s in zip(offset, self.shape)) and len(offset) == len(self.shape):
            for i in self.chunk_index.find(Box(offset, (1,) * len(offset))):
                c = self.chunk(i)
                if c.offset == offset:
                    return i, c
        for i, c in enumerate(self.chunks):
            if c.offset == offset:
                return i, c
        raise KeyError(offset)

    def chunk(self, i: int) -> Chunk:
        """Chunk `i` (of a grid: built now)."""
        return self.chunks[i]

    @functools.cached_property
    def chunks_by_rank(self) -> Mapping[int, tuple[Chunk, ...]]:
        """Each writer's chunks, in chunk order: one pass over the chunks, kept (a caller
        taking every rank's chunks in turn, as a conversion does, walks them once, not once
        per rank)."""
        by: dict[int, list[Chunk]] = {}
        for c in self.chunks:
            by.setdefault(c.rank, []).append(c)
        return {r: tuple(cs) for r, cs in by.items()}

    @functools.cached_property
    def ranks_column(self) -> np.ndarray:
        """The writer rank of every chunk, in chunk order (int64; a grid's by arithmetic, no
        chunk built)."""
        chunks = self.chunks
        if isinstance(chunks, GridChunks):
            return chunks.ranks_column()
        return np.array([c.rank for c in chunks], np.int64)

    @functools.cached_property
    def chunk_ids_by_rank(self) -> Mapping[int, tuple[int, ...]]:
        """Each writer's chunk ids, in chunk order, from `ranks_column` (no chunk built:
        a caller taking every rank's chunks in turn builds each once, when it reads it)."""
        ranks = self.ranks_column
        if not len(ranks):
            return {}
        order = np.argsort(ranks, kind="stable")
        cuts = np.flatnonzero(np.diff(ranks[order])) + 1
        return {int(ranks[g[0]]): tuple(g.tolist()) for g in np.split(order, cuts)}

    def bytes_by_rank(self) -> dict[int, int]:
        """Bytes stored by each writer rank (a grid's from its columns: no chunk built)."""
        chunks = self.chunks
        if not isinstance(chunks, GridChunks):
            by: dict[int, int] = {}
            for c in chunks:
                by[c.rank] = by.get(c.rank, 0) + c.nbytes
            return by
        writers, inv = np.unique(self.ranks_column, return_inverse=True)
        sums = np.zeros(len(writers), np.int64)
        np.add.at(sums, inv.reshape(-1), chunks.nbytes_column())
        return dict(zip(writers.tolist(), sums.tolist()))

    @property
    def is_grid(self) -> bool:
        """Whether the chunks are stored as a grid (`GridChunks`)."""
        return isinstance(self.chunks, GridChunks)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.np_dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape)}
        chunks = self.chunks
        if isinstance(chunks, GridChunks) and len(chunks) >= GRID_MIN_CELLS:
            d["grid"] = chunks.to_json()
        else:
            d["chunks"] = [c.to_json() for c in chunks]
        if self.placement is not None:
            d["placement"] = self.placement.to_json()
        if self.value_range is not None:
            d["value_range"] = self.value_range.to_json()
        return d

    @classmethod
    def from_json(
        cls, name: str, d: Any, where: str, world_size: int, dirs: Mapping[int, str] | None = None,
        version: int = VERSION,
    ) -> TensorEntry:
        """Validate tensor `name`'s entry (ManifestError naming it and the field otherwise).

        `dirs` (the manifest's data directories) is given for manifests that may hold grid
        entries (version 5 on); a grid elsewhere is refused. `version`: the manifest's (what
        a grid may hold depends on it)."""
        if type(d) is dict:
            if "grid" in d:
                return cls._grid_from_json(name, d, where, world_size, dirs, version)
            e = cls._from_json_fast(name, d, where, world_size)
            if e is not None:
                return e
        return cls._from_json_checked(name, d, where, world_size)

    @classmethod
    def _grid_from_json(
        cls, name: str, d: dict[str, Any], where: str, world_size: int, dirs: Mapping[int, str] | None,
        version: int = VERSION,
    ) -> TensorEntry:
        w = f"{where}, tensor {name!r}"
        if dirs is None:
            raise ManifestError(f"{w}: a grid entry in a manifest older than version 5; the file was edited")
        if "chunks" in d:
            raise ManifestError(f"{w}: an entry has chunks or a grid, not both")
        shape = _shape(d.get("shape"), "shape", w)
        dtype, itemsize = _itemsize(d.get("dtype"), shape, w)
        grid = GridChunks.from_json(d["grid"], shape, itemsize, world_size, dirs, w, version)
        pl, vr = d.get("placement"), d.get("value_range")
        return cls(
            name=name,
            dtype=dtype,
            shape=shared_shape(shape),
            chunks=grid,
            placement=None if pl is None else PlacementInfo.from_json(pl, w),
            value_range=None if vr is None else ValueRange.from_json(vr, w),
        )

    @classmethod
    def _from_json_checked(cls, name: str, d: Any, where: str, world_size: int) -> TensorEntry:
        w = f"{where}, tensor {name!r}"
        if not isinstance(d, dict):
            raise ManifestError(f"{w}: entry must be an object")
        try:
            dtype = d["dtype"]
            shape = _shape(d["shape"], "shape", w)
            raw_chunks = d["chunks"]
        except KeyError as e:
            raise ManifestError(f"{w}: entry lacks field {e.args[0]!r}") from None
        dtype, itemsize = _itemsize(dtype, shape, w)
        if not isinstance(raw_chunks, list):
            raise ManifestError(f"{w}: chunks must be a list")
        if len(raw_chunks) > MAX_CHUNKS:
            raise ManifestError(f"{w}: {len(raw_chunks)} chunks, over the limit of {MAX_CHUNKS}")
        chunks = tuple(Chunk.from_json(c, w) for c in raw_chunks)
        for c in chunks:
            if len(c.shape) != len(shape):
                raise ManifestError(f"{w}: chunk {c.box} has rank {len(c.shape)}, shape {shape}")
            if c.nbytes != math.prod(c.shape) * itemsize:
                raise ManifestError(
                    f"{w}: chunk {c.box} claims {c.nbytes} bytes but holds "
                    f"{math.prod(c.shape) * itemsize} ({dtype})"
                )
            if c.rank >= world_size:
                raise ManifestError(f"{w}: chunk written by rank {c.rank} of {world_size}")
        pl = d.get("placement")
        vr = d.get("value_range")
        return cls(
            name=name,
            dtype=dtype,
            shape=shape,
            chunks=chunks,
            placement=None if pl is None else PlacementInfo.from_json(pl, w),
            value_range=None if vr is None else ValueRange.from_json(vr, w),
        )

    @classmethod
    def _from_json_fast(cls, name: str, d: dict[str, Any], where: str, world_size: int) -> TensorEntry | None:
        """`from_json` for an entry that passes every check at once (plain type and
        range tests, no error text built); None when any check might fail, and the
        checked path then raises its precise error. 20,000 entries: 0.08 s instead of 0.4."""
        dtype = d.get("dtype")
        shape = _dims(d.get("shape"))
        raw = d.get("chunks")
        if type(dtype) is not str or shape is None or type(raw) is not list or len(raw) > MAX_CHUNKS:
            return None
        shape = shared_shape(shape)
        itemsize = itemsize_of(dtype)
        if itemsize is None:
            return None
        elements = math.prod(shape)
        if elements > MAX_ELEMENTS or elements * itemsize > MAX_TENSOR_BYTES:
            return None
        chunks = _chunks_fast(raw, shape, itemsize, world_size)
        if chunks is None:
            return None
        pl = d.get("placement")
        vr = d.get("value_range")
        if pl is not None or vr is not None:
            w = f"{where}, tensor {name!r}"
            pl = None if pl is None else PlacementInfo.from_json(pl, w)
            vr = None if vr is None else ValueRange.from_json(vr, w)
        return _build(
            cls,
            {"name": name, "dtype": dtype, "shape": shape, "chunks": chunks, "placement": pl, "value_range": vr},
        )


# ---------------------------------------------------------------------------
# Objects (values encoded by xckpt.manifest._objects)


@dataclass(frozen=True, kw_only=True)
class ObjectEntry:
    """A non-tensor value: inline JSON, or bytes stored under `key`."""

    name: str
    kind: str  # "json" or "bytes"
    rank: int
    per_rank: bool = False
    value: Any = None  # encoded JSON value, kind == "json"
    key: str | None = None  # kind == "bytes"
    nbytes: int | None = None
    crc32: int | None = None

    def to_json(self) -> dict[str, Any]:
        d = _json_object({"name": self.name, "kind": self.kind, "rank": self.rank}, per_rank=self.per_rank or None)
        if self.kind == "json":
            d["value"] = self.value
        else:
            d.update(key=self.key, nbytes=self.nbytes, crc32=self.crc32)
        return d

    @classmethod
    def from_json(cls, d: Any, where: str) -> ObjectEntry:
        _check_named(d, "name", f"{where}: an object entry must have a name")
        w = f"{where}, object {_str(d['name'], 'an object name', where)!r}"
        kind = d.get("kind")
        per_rank = d.get("per_rank", False)
        if type(per_rank) is not bool:
            raise ManifestError(f"{w}: per_rank must be true or false, got {per_rank!r}"[:300])
        if kind == "json":
            value = d.get("value")
            decode_checked(value, w)  # malformed tags and deep nesting are refused at open
            return cls(
                name=d["name"],
                kind=kind,
                rank=_int(d.get("rank"), "rank", w, hi=MAX_WORLD_SIZE),
                per_rank=per_rank,
                value=value,
            )
        if kind == "bytes":
            return cls(
                name=d["name"],
                kind=kind,
                rank=_int(d.get("rank"), "rank", w, hi=MAX_WORLD_SIZE),
                per_rank=per_rank,
                key=_check_key(d.get("key"), w),
                nbytes=_int(d.get("nbytes"), "nbytes", w, hi=MAX_TENSOR_BYTES),
                crc32=_int(d.get("crc32"), "crc32", w, hi=1 << 32),
            )
        raise ManifestError(f"{w}: unknown object kind {kind!r}"[:300])


# ---------------------------------------------------------------------------
# Manifest


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (a context manager and a decorator).

    Reading or writing a manifest of N tensors builds about 10 N dataclasses,
    dicts and tuples, none of them in a reference cycle; with the collector
    running, each full collection walks every live object again. Measured on
    20,000 tensors of 256 floats: 3 full collections in a save and 6 in a load,
    about a third of their CPU time. The previous state is restored on exit.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
