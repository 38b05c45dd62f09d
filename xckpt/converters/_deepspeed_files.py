"""The files of a DeepSpeed checkpoint and how a presented tensor is read from them (helpers of
`deepspeed`).

A `File` is one torch.save file, its `data.pkl` read by the restricted unpickler
(classes outside the allow-list as inert placeholders); a `Stored` tensor is read by byte
range as `data.pkl` describes it (`read_stored`, casting where the presented dtype
differs); a parameter whose pieces are not boxes of its shape is read by `assemble`, which
reads from each piece only the elements between the first and the last one a box needs.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from xckpt.errors import XckptError
from xckpt.layout import Box, c_strides
from xckpt.manifest import numpy_dtype
from xckpt.storage import Blob, Place

from ._torchzip import Archive, read_boxes
from ._unpickle import TensorRef, materialize, restricted_load

__all__ = ["File", "Stored", "Span", "Spec", "is_floating", "open_file", "stored", "read_stored", "assemble"]
__all__ += ["assembled_units", "read_object", "state_kind"]



@dataclass(frozen=True)
class File:
    """One torch.save file of the checkpoint: its archive and unpickled `data.pkl`."""

    rel: str
    bytes: Blob
    archive: Archive
    root: Any
    where: str


@dataclass(frozen=True)
class Stored:
    """A tensor of a file (or a row-major view of one), read as `data.pkl` describes it."""

    file: File
    ref: TensorRef
    start: int  # the storage's file offset


@dataclass(frozen=True)
class Span:
    """Elements `[at, at + length)` of a parameter are `flat[start : start + length]`."""

    rank: int
    flat: Stored
    start: int
    length: int
    at: int


@dataclass(frozen=True)
class Spec:
    """How one presented tensor is read: a whole stored tensor, or spans of flat partitions."""

    shape: tuple[int, ...]
    dtype: str  # presented
    stored: str  # stored (differs for buffers cast to float32)
    whole: Stored | None = None
    spans: tuple[Span, ...] = ()
    assembled: bool = False


def is_floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def state_kind(v: Any, numel: int, padding: int) -> str:
    """How one rank's value of a per-group optimizer state is presented.

    Returns:
        `"flat"`: a row-major 1-D tensor laid out like the rank's flat partition of the group
        (`numel` elements, or `numel + padding` when DeepSpeed saved the partition without its
        trailing alignment padding and the state with it: ZeRO 1/2's last rank), read per
        parameter; `"object"`: a number, a 0-d tensor or another plain value (Adam's `step`);
        `"absent"`: no value; otherwise why it cannot be presented per parameter.
    """
    if v is None:
        return "absent"
    if not isinstance(v, TensorRef):
        return "object"
    if v.size == ():
        return "object"
    if len(v.size) == 1 and v.size[0] in (numel, numel + padding) and v.stride == (1,):
        return "flat" if v.dtype.xckpt is not None else f"a tensor of dtype torch.{v.dtype.name}"
    held = f"{numel}" + (f" (or {numel + padding} with its padding)" if padding else "")
    return f"a tensor of shape {list(v.size)} where the rank's flat partition holds {held} elements"


def open_file(place: Place, rel: str, where: str, allowed: dict[tuple[str, str], Any]) -> File:
    """Open torch.save file `rel` of `place` and read its `data.pkl` restricted to `allowed`."""
    fb = place.open(rel, where)
    try:
        archive = Archive.of_file(fb, where, unpickle=False)
        pkl = archive.record_bytes(f"{archive.prefix}/data.pkl")
        root = restricted_load(pkl, allowed, where, storages=True, foreign=True)
    except BaseException:
        fb.close()
        raise
    return File(rel, fb, archive, root, where)


def stored(f: File, ref: Any, what: str) -> Stored:
    """`ref` (found at `what` in `f`'s pickle) as a stored tensor, checked against its storage."""
    if not isinstance(ref, TensorRef):
        raise XckptError(f"{f.where}: {what} is a {type(ref).__name__}, not a tensor")
    if ref.dtype.xckpt is None:
        raise XckptError(f"{f.where}: {what} has dtype torch.{ref.dtype.name}, which xckpt cannot hold")
    return Stored(f, ref, f.archive.storage_range(ref, what)[0])


def read_stored(spec: Spec, s: Stored, items: list[tuple[tuple[slice, ...], np.ndarray]]) -> None:
    """`out[...] = tensor[slices]` for each item, cast to the presented dtype."""
    if spec.stored == spec.dtype:
        read_boxes(s.file.archive, s.ref, s.start, items)
        return
    dtype = numpy_dtype(spec.stored)
    tmp = [(sl, np.empty(out.shape, dtype)) for sl, out in items]
    read_boxes(s.file.archive, s.ref, s.start, tmp)
    for (_, out), (_, t) in zip(items, tmp):
        np.copyto(out, t, casting="unsafe")


def _span_range(spec: Spec, slices: tuple[slice, ...]) -> tuple[int, int]:
    strides = c_strides(spec.shape)
    first = sum(s.start * st for s, st in zip(slices, strides))
    last = sum((s.stop - 1) * st for s, st in zip(slices, strides))
    return first, last + 1


def assemble(spec: Spec, slices: tuple[slice, ...], out: np.ndarray) -> None:
    """`out[...] = param[slices]` from the pieces holding its elements (only those read)."""
    if not out.size:
        return
    dtype = numpy_dtype(spec.stored)
    isz = dtype.itemsize
    first, end = _span_range(spec, slices)
    raw = np.empty((end - first) * isz, np.uint8)
    for s in spec.spans:
        a, b = max(first, s.at), min(end, s.at + s.length)
        if a >= b:
            continue
        at = s.flat.start + (s.flat.ref.offset + s.start + a - s.at) * isz
        s.flat.file.archive.readinto(at, memoryview(raw[(a - first) * isz : (b - first) * isz]))
        if s.flat.file.archive.big_endian and isz > 1:
            part = raw[(a - first) * isz : (b - first) * isz].view(f"<u{isz}")
            part[...] = part.byteswap()
    ints = raw.view(f"<u{isz}") if isz > 1 else raw  # float8 has no strided numpy view: go through ints
    sub = tuple(sl.stop - sl.start for sl in slices)
    view = np.lib.stride_tricks.as_strided(
        ints, shape=sub, strides=tuple(st * isz for st in c_strides(spec.shape)), writeable=False
    )
    np.copyto(out, view.view(dtype), casting="unsafe")


def assembled_units(name: str, spec: Spec, box: Box) -> dict[Hashable, int]:
    """The reads `assemble` makes for `box`: from each piece, the elements between the
    box's first and last (`plan_load`'s byte counts)."""
    first, end = _span_range(spec, box.slices())
    units: dict[Hashable, int] = {}
    isz = numpy_dtype(spec.stored).itemsize
    for i, s in enumerate(spec.spans):
        a, b = max(first, s.at), min(end, s.at + s.length)
        if a < b and box.volume:
            units[(name, i, a, b)] = (b - a) * isz
    return units


def read_object(v: Any, f: File | None) -> Any:
    """A pickled value as the user sees it: tensors as numpy arrays (read now from `f`),
    records as dicts (the shared walker, `materialize`)."""
    where = f.where if f is not None else "DeepSpeed checkpoint"
    return materialize(v, functools.partial(_read_tensor, f, where), where)


def _read_tensor(f: File | None, where: str, v: TensorRef) -> np.ndarray:
    if f is None:
        raise XckptError(f"{where}: a tensor inside an object has no file")
    s = stored(f, v, "a tensor inside an object")
    out = np.empty(v.size, numpy_dtype(v.dtype.xckpt or ""))
    read_boxes(f.archive, v, s.start, [(tuple(slice(0, n) for n in v.size), out)])
    return out
