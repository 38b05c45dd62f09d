"""Where an array chunk's bytes are (format version 6), and unchanged chunks found for a new save.

A step of a manager root may name, in its manifest's ``refs``, arrays it did not write
itself: array ``K`` of step ``M`` of the same root (:class:`~xckpt.manifest.Ref`). A
step is read alone (``xckpt.open(<root>/<step>)``): its location's parent is the root,
so step ``M`` is the sibling ``<root>/<M>/``, a location built from the step number
(an integer) and the referenced key (checked as strictly as every key): a reference
never leaves the root.

- :class:`Resolver`: for a reader, each array chunk's storage, local directory, key,
  storage kind and codec, following ``refs``;
- :class:`Dedup`: for a writer, the previous retained step's array chunks by tensor,
  box and dtype with their BLAKE2b-128 hashes: a chunk whose hash equals its
  counterpart's is recorded as a reference to where that one's bytes are, not written.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from xckpt.errors import XckptError
from xckpt.manifest import Chunk, Manifest, Ref
from xckpt.native._zarr import NativeStorage
from xckpt.storage import Location, local_root, location_spec

__all__ = ["Where", "Resolver", "Dedup", "sibling", "chunk_hash", "referenced_steps"]


def sibling(location: Location, step: int) -> Location:
    """Step ``step`` of the manager root holding checkpoint ``location`` (its parent).

    Raises:
        XckptError: ``location`` has no parent directory to hold steps.
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
    """Each array chunk's :class:`Where` for a reader of ``manifest`` at ``storage``."""

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
        """`` (stored in step M as K)`` for a referenced chunk, else nothing (for messages)."""
        ref = self._m.refs.get(c.key) if self._m.refs else None
        return "" if ref is None else f" (stored in step {ref.step} as {ref.key})"


class Dedup:
    """The previous retained step ``step`` of a manager root, for a save that references
    the chunks it shares with it (see the module).

    Args:
        step: the previous step's number (None: there is none; the save only records hashes).
        manifest: its (merged) manifest.
    """

    def __init__(self, step: int | None = None, manifest: Manifest | None = None) -> None:
        self.step, self._m = step, manifest
        self._by_name: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[str, Ref]]] = {}

    def _index(self, name: str) -> dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[str, Ref]]:
        got = self._by_name.get(name)
        if got is None:
            got = {}
            if self._m is None or self.step is None:
                return got
            t = self._m.tensors.get(name)
            hashes, refs = self._m.hashes, self._m.refs
            for c in t.chunks if t is not None else ():
                h = hashes.get(c.key) if c.form == "array" else None
                if h is None:
                    continue
                target = refs.get(c.key) or Ref(
                    self.step, c.key, self._m.storage.get(c.rank, "ocdbt"), self._m.codecs.get(c.rank)
                )
                got[(c.offset, c.shape)] = (h, target)
            self._by_name[name] = got
        return got

    def match(
        self, name: str, dtype: str, gshape: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...],
        digest: str,
    ) -> Ref | None:
        """Where the bytes of ``name``'s box ``(offset, shape)`` are stored when the previous
        step holds the same box of the same tensor (dtype, global shape) with hash ``digest``;
        else None."""
        t = self._m.tensors.get(name) if self._m is not None else None
        if t is None or t.dtype != dtype or tuple(t.shape) != tuple(gshape):
            return None
        got = self._index(name).get((tuple(offset), tuple(shape)))
        return got[1] if got is not None and got[0] == digest else None


def referenced_steps(manifests: Mapping[int, Manifest]) -> set[int]:
    """Every step whose data the given steps' manifests reference."""
    return {r.step for m in manifests.values() for r in m.refs.values()}
