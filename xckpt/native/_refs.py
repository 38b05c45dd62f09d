"""Where an array chunk's bytes are (format version 6), and unchanged chunks found for a new save.

A step of a manager root may name, in its manifest's `refs`, arrays it did not write
itself: array `K` of step `M` of the same root (`Ref`). A
step is read alone (`xckpt.open(<root>/<step>)`): its location's parent is the root,
so step `M` is the sibling `<root>/<M>/`, a location built from the step number
(an integer) and the referenced key (checked as strictly as every key): a reference
never leaves the root.

- `Resolver`: for a reader, each array chunk's storage, local directory, key,
  storage kind and codec, following `refs`;
- `Dedup`: for a writer, the previous retained step's array chunks by tensor,
  box and dtype with their BLAKE2b-128 hashes: a chunk whose hash equals its
  counterpart's is recorded as a reference to where that one's bytes are, not written.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from xckpt.errors import XckptError
from xckpt.manifest import Chunk, Manifest, Patch, Ref
from xckpt.native._zarr import NativeStorage
from xckpt.storage import Location, local_root, location_spec

__all__ = ["Where", "Resolver", "Dedup", "sibling", "chunk_hash", "referenced_steps"]


def sibling(location: Location, step: int) -> Location:
    """Step `step` of the manager root holding checkpoint `location` (its parent).

    Raises:
        XckptError: `location` has no parent directory to hold steps.
    """
    spec = location_spec(location)
    if isinstance(spec, dict):
        path = spec.get("path", "").rstrip("/")
        parent = path[: path.rindex("/") + 1] if "/" in path else ""
        if not path:
            raise XckptError(f"checkpoint {spec!r} is at the root of its kvstore: it is no step of a manager root")
        return {**spec, "path": f"{parent}{int(step)}/"}
    scheme, rest = spec.split("://", 1)
    rest = rest.rstrip("/")
    if "/" not in rest:
        raise XckptError(f"checkpoint {spec!r} has no parent directory: it is no step of a manager root")
    return f"{scheme}://{rest[: rest.rindex('/') + 1]}{int(step)}/"


def chunk_hash(arr: np.ndarray) -> str:
    """BLAKE2b-128 of a C-contiguous array's bytes, as 32 hex digits."""
    return hashlib.blake2b(memoryview(arr.reshape(-1).view(np.uint8)), digest_size=16).hexdigest()


class Where(NamedTuple):
    """Where an array chunk's bytes are: the checkpoint holding them, its local directory
    (None: not a local directory), the array's key there, its storage kind and codec."""

    storage: NativeStorage
    root: str | None
    key: str
    kind: str
    codec: str | None


class Resolver:
    """Each array chunk's `Where` for a reader of `manifest` at `storage`."""

    def __init__(self, storage: NativeStorage, manifest: Manifest, context: Any = None) -> None:
        self._storage, self._m, self._context = storage, manifest, context
        self._root = local_root(storage.url)
        self._steps: dict[int, tuple[NativeStorage, str | None]] = {}
        self._lock = threading.Lock()

    def where(self, c: Chunk) -> Where:
        ref = self._m.refs.get(c.key) if self._m.refs else None
        if ref is None:
            return Where(
                self._storage, self._root, c.key, self._m.storage.get(c.rank, "ocdbt"), self._m.codecs.get(c.rank)
            )
        with self._lock:
            got = self._steps.get(ref.step)
            if got is None:
                st = NativeStorage(sibling(self._storage.url, ref.step), self._context)
                got = self._steps[ref.step] = (st, local_root(st.url))
        return Where(got[0], got[1], ref.key, ref.storage, ref.codec)

    def describe(self, c: Chunk) -> str:
        """` (stored in step M as K)` for a referenced chunk, else nothing (for messages)."""
        ref = self._m.refs.get(c.key) if self._m.refs else None
        return "" if ref is None else f" (stored in step {ref.step} as {ref.key})"


class _Prev(NamedTuple):
    """A previous step's array chunk: its hash (None: not hashed), where its base bytes are,
    and the row patches over them."""

    digest: str | None
    target: Ref
    chain: tuple[Patch, ...]


class Dedup:
    """The previous complete step `base` of a manager root, for a save of step `step`
    that references the chunks it shares with it and stores only the changed rows of
    others (see the module, and `xckpt.native._deltas` for row deltas).

    Args:
        base: the previous step's number (None: there is none; the save only records hashes).
        manifest: its (merged) manifest.
        step: the step being saved (named by its own row patches).
        changed: the rows of a staged buffer changed since `base` (None: not compared),
            `xckpt.manager.HostBuffers.changed`.
        full_every: a chunk's chain of patches stays shorter than this.
    """

    def __init__(
        self, base: int | None = None, manifest: Manifest | None = None, *, step: int = 0,
        changed: Callable[[np.ndarray], np.ndarray | None] | None = None, full_every: int = 8,
    ) -> None:
        self.base, self._m, self.step = base, manifest, step
        self._changed, self.full_every = changed, full_every
        self._by_name: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], _Prev]] = {}

    def _index(self, name: str) -> dict[tuple[tuple[int, ...], tuple[int, ...]], _Prev]:
        got = self._by_name.get(name)
        if got is None:
            got = self._by_name[name] = {}
            m, base = self._m, self.base
            if m is None or base is None:
                return got
            t = m.tensors.get(name)
            for c in t.chunks if t is not None else ():
                if c.form != "array":
                    continue
                target = m.refs.get(c.key) or Ref(base, c.key, m.storage.get(c.rank, "ocdbt"), m.codecs.get(c.rank))
                got[(c.offset, c.shape)] = _Prev(m.hashes.get(c.key), target, tuple(m.deltas.get(c.key, ())))
        return got

    def _prev(self, name: str, dtype: str, gshape: tuple[int, ...], offset: tuple[int, ...],
              shape: tuple[int, ...]) -> _Prev | None:
        t = self._m.tensors.get(name) if self._m is not None else None
        if t is None or t.dtype != dtype or tuple(t.shape) != tuple(gshape):
            return None
        return self._index(name).get((tuple(offset), tuple(shape)))

    def match(
        self, name: str, dtype: str, gshape: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...],
        digest: str,
    ) -> Ref | None:
        """Where the bytes of `name`'s box `(offset, shape)` are stored when the previous
        step holds the same box of the same tensor (dtype, global shape) with hash `digest`;
        else None."""
        prev = self._prev(name, dtype, gshape, offset, shape)
        return prev.target if prev is not None and not prev.chain and prev.digest == digest else None

    def delta(
        self, name: str, dtype: str, gshape: tuple[int, ...], offset: tuple[int, ...], arr: np.ndarray,
    ) -> tuple[Ref, tuple[Patch, ...], np.ndarray] | None:
        """The base, its patches so far and the rows changed since, when the 2-D box `arr`
        (a staged buffer) is worth a row delta: its changed rows are known, fewer than half,
        and the chain stays shorter than `full_every`; else None (write it whole)."""
        rows = self._changed(arr) if self._changed is not None and arr.ndim == 2 else None
        if rows is None or 2 * len(rows) >= arr.shape[0]:
            return None
        prev = self._prev(name, dtype, gshape, offset, tuple(arr.shape))
        if prev is None or (len(rows) and len(prev.chain) + 1 >= self.full_every):
            return None
        return prev.target, prev.chain, rows


def referenced_steps(manifests: Mapping[int, Manifest]) -> set[int]:
    """Every step whose data the given steps' manifests reference."""
    return {r.step for m in manifests.values() for r in m.refs.values()}
