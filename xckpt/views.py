"""Views over another source: one base that delegates everything.

A view presents a wrapped [`Source`][xckpt.source.Source] differently (renamed,
reshaped, filtered) without copying a byte. `SourceView` forwards every
call of the read protocol to `SourceView.source` and maps object names
through one table, so a view overrides only what it changes (as zarr's
`WrapperStore` does for stores): the rules view (`xckpt.rules`) its
tensors, `Selected` the names it keeps. Closing a view closes the source
it wraps.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

from xckpt.layout import Box
from xckpt.manifest import Chunk, TensorEntry
from xckpt.source import ChunkRead, ObjectQuery, Source

__all__ = ["SourceView", "Selected"]


class SourceView(Source):
    """`source` unchanged; subclasses override what their view changes.

    `_objects` maps each object name of the view to the wrapped source's name for
    it; a subclass that renames or drops objects rewrites that table.
    """

    def __init__(self, source: Source) -> None:
        self.source = source
        self.format = source.format
        self.path = source.path
        self._objects: dict[str, str] = {n: n for n in source.object_names()}

    #: The view's tensor names, when it changes them (`_show`); None: the source's.
    _names: list[str] | None = None
    _name_set: frozenset[str] = frozenset()

    def _show(self, names: Iterable[str]) -> None:
        """Make `names`, in this order, the view's tensor names instead of its source's."""
        self._names = list(names)
        self._name_set = frozenset(self._names)

    # -- metadata -----------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.source.world_size

    @property
    def save_id(self) -> str | None:
        return self.source.save_id

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self.source.metadata

    def names(self) -> list[str]:
        return self.source.names() if self._names is None else list(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self.source if self._names is None else name in self._name_set

    def info(self, name: str) -> TensorEntry:
        return self.source.info(name)

    # -- tensors ------------------------------------------------------------------

    def _read_chunks(self, jobs: Sequence[ChunkRead], bar: Any) -> None:
        self.source._read_chunks(jobs, bar)

    def read_units(self, name: str, chunk: Chunk, box: Box, itemsize: int) -> dict[Hashable, int]:
        return self.source.read_units(name, chunk, box, itemsize)

    # -- objects ------------------------------------------------------------------

    def object_names(self) -> list[str]:
        return list(self._objects)

    def _has_object(self, name: str) -> bool:
        return name in self._objects

    def _get_objects(self, names: list[str], query: ObjectQuery) -> dict[str, Any]:
        got = self.source.objects([self._objects[n] for n in names], **query._asdict())
        return {n: got[self._objects[n]] for n in names}

    def pickled_objects(self) -> set[str]:
        inner = self.source.pickled_objects()
        return {n for n, s in self._objects.items() if s in inner}

    def per_rank_objects(self) -> set[str]:
        inner = self.source.per_rank_objects()
        return {n for n, s in self._objects.items() if s in inner}

    def nesting(self) -> Mapping[str, tuple[Any, ...]] | None:
        """The wrapped source's key paths of the names this view keeps unchanged (a renamed
        name has none, and a consumer then falls back to flat names)."""
        inner = self.source.nesting()
        if inner is None:
            return None
        kept = {n: inner[n] for n in self.names() if n in inner}
        kept.update({n: inner[s] for n, s in self._objects.items() if n == s and s in inner})
        return kept

    # -- verification and lifetime --------------------------------------------------

    def verify(self, *, show_progress: bool | None = None) -> list[str]:
        """Verify the wrapped source (its stored bytes carry the checksums)."""
        return self.source.verify(show_progress=show_progress)

    def close(self) -> None:
        self.source.close()


class Selected(SourceView):
    """`source` holding only the tensors `names` and the objects `objects`."""

    def __init__(self, source: Source, names: Sequence[str], objects: Sequence[str]) -> None:
        super().__init__(source)
        self._show(names)
        self._objects = {n: n for n in objects}

    def info(self, name: str) -> TensorEntry:
        if name not in self._name_set:
            raise self._missing(name)
        return self.source.info(name)
