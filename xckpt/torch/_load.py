"""`xckpt.torch.load` and `load_full`: fill tensors in place, whatever their layout.

By default loading never talks to other ranks (value groups aside, see
`xckpt.torch.value_groups`): each rank opens the checkpoint (manifests
only), computes the boxes its targets hold, and reads only the saved chunks
that overlap them, straight into the targets' CPU memory. Targets elsewhere
(CUDA) are read through a bounded ring of pinned host buffers whose copies to
the device overlap the next reads (`xckpt.torch._pipeline`). With
`read_once=True` the ranks read each stored range once between them and send
it to the others over the process group (`xckpt.torch._read_once`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from xckpt import layout as L
from xckpt.errors import (
    DtypeMismatchError,
    MissingEntryError,
    ObjectError,
    ShapeMismatchError,
    UnsupportedPlacementError,
    XckptError,
)
from xckpt.formats import opened
from xckpt.manifest import paused_gc
from xckpt.rules import Rules
from xckpt.source import Source
from xckpt.storage import Location
from xckpt.torch._dist import rank_world
from xckpt.torch._dtypes import as_numpy, dtype_name, known_dtype_name, torch_dtype
from xckpt.torch._pipeline import DeviceRing
from xckpt.torch._placement import PLAIN_TENSORS, LocalBox, global_info, local_pieces
from xckpt.torch._read_once import load_once
from xckpt.torch._state_dict import KEYS_META, PerRank, Slot, expand, flatten
from xckpt.torch.value_groups import load_value_groups

__all__ = ["LoadResult", "DeviceRing", "load", "load_full"]


@dataclass
class LoadResult:
    """What [`load`][xckpt.torch._load.load] did.

    Attributes:
        missing: names the caller asked for that the checkpoint lacks.
        unexpected: names the checkpoint holds that the caller did not ask for.
        evicted: per value group (prefix), entries this rank dropped for capacity.
        skipped: pickled objects left unread (their placeholders untouched)
            because the load did not pass `allow_pickle=True`.
    """

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    evicted: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def _check(ckpt: Any, name: str, target: Any) -> None:
    """Global shape and dtype of `target` against the saved tensor."""
    t = ckpt.info(name)
    shape, tdtype = global_info(target, name)
    if tuple(shape) != tuple(t.shape):
        raise ShapeMismatchError(
            f"checkpoint {ckpt.path!r}, tensor {name!r}: saved with global shape {t.shape}, the "
            f"target has global shape {tuple(shape)}; build the target with the saved shape (or "
            "load it with xckpt.torch.load_full and adapt it yourself)"
        )
    got = dtype_name(tdtype, name)
    if got != t.dtype:
        raise DtypeMismatchError(
            f"checkpoint {ckpt.path!r}, tensor {name!r}: saved as {t.dtype}, the target is "
            f"{got}; load into a {t.dtype} tensor and cast after loading"
        )


def _object_value(ckpt: Source, name: str, placeholder: Any, world: int, rank: int) -> Any:
    if name not in ckpt.per_rank_objects():
        value = ckpt.objects([name])[name]
        return PerRank(value) if isinstance(placeholder, PerRank) else value
    if isinstance(placeholder, PerRank) and placeholder.all_ranks:
        return PerRank(ckpt.objects([name], per_rank="list")[name], all_ranks=True)
    if world != ckpt.world_size:
        raise ObjectError(
            f"checkpoint {ckpt.path!r}: object {name!r} was saved per rank by {ckpt.world_size} "
            f"ranks and is loaded at world size {world}; there is no rank-for-rank match. Put "
            "xckpt.torch.PerRank(all_ranks=True) in its place to receive every rank's value"
        )
    value = ckpt.objects([name], rank=rank)[name]
    return PerRank(value) if isinstance(placeholder, PerRank) else value


def _set(slot: Slot, name: str, value: Any) -> None:
    if isinstance(slot.container, tuple):
        raise ObjectError(
            f"object {name!r} sits in a tuple of the state dict, which cannot be filled in "
            "place; use a list or a dict there"
        )
    slot.container[slot.key] = value


class _Reads:
    """Read requests into targets' CPU memory (`items`), and target parts read through
    the device ring (`staged`: not in CPU memory, or every tensor when the ring has a
    copy hook)."""

    def __init__(self, ring: DeviceRing) -> None:
        self.ring = ring
        self.items: list[tuple[str, L.Box, np.ndarray]] = []
        self.staged: list[tuple[str, L.Box, torch.Tensor]] = []

    def add(self, name: str, piece: LocalBox) -> None:
        dst = piece.tensor
        if isinstance(dst, np.ndarray):
            view = dst[piece.slices] if piece.slices else dst[...]
            if not view.flags.writeable:
                raise XckptError(f"target {name!r} is a read-only numpy array")
            self.items.append((name, piece.box, view))
            return
        dst = dst.detach()
        part = dst[piece.slices] if piece.slices else dst
        if dst.device.type == "meta":
            raise XckptError(
                f"target {name!r} is on the meta device and has no memory to load into; "
                "materialise it first (e.g. module.to_empty(device=...))"
            )
        if dst.device.type == "cpu" and self.ring.copy is None:
            self.items.append((name, piece.box, as_numpy(part)))
            return
        self.staged.append((name, piece.box, part))

    def targets(self) -> list[tuple[str, L.Box, Any]]:
        return [*self.items, *self.staged]

    def run(self, ckpt: Source, show_progress: bool | None = None) -> None:
        if self.items:
            ckpt.read_into(self.items, show_progress=show_progress)
        if self.staged:
            self.ring.run(ckpt, self.staged, show_progress)


def _fill_fresh(ckpt: Source, flat: dict[str, Any], slots: dict[str, Slot], saved_tensors: set[str]) -> None:
    """A fresh job's empty mappings (a never-stepped optimizer's `state: {}`) receive
    the stored entries under their names (`xckpt.torch._state_dict.expand`)."""
    if not any(isinstance(v, (Mapping, list, tuple)) for v in flat.values()):
        return

    def leaf(name: str, device: Any) -> Any:
        if name not in saved_tensors:
            return None  # an object: read in its place like any placeholder
        t = ckpt.info(name)
        return torch.empty(t.shape, dtype=torch_dtype(t.dtype), device=device or "cpu")

    stored = ckpt.names() + [n for n in ckpt.object_names() if n not in saved_tensors]
    expand(flat, slots, stored, ckpt.metadata.get(KEYS_META), leaf, str(ckpt.path))


class _Request(NamedTuple):
    """One `load` call's arguments that its steps (`_load`, `_prepare`) use, as given."""

    state_dict: Mapping[str, Any]
    process_group: Any
    strict: bool
    strict_capacity: bool
    allow_pickle: bool
    show_progress: bool | None
    read_once: bool


@dataclass
class _Prepared:
    """One rank's load, worked out and not yet read."""

    reads: _Reads
    later: list[tuple[str, Any]]
    slots: dict[str, Slot]
    missing: list[str]
    unexpected: list[str]
    evicted: dict[str, int]
    skipped: list[str]


@paused_gc()  # tens of thousands of small objects, none in a cycle (see paused_gc)
def load(
    path: Location | Source,
    state_dict: Mapping[str, Any],
    *,
    process_group: Any = None,
    strict: bool = True,
    strict_capacity: bool = False,
    format: str | None = None,  # noqa: A002
    allow_pickle: bool = False,
    rules: Rules = None,
    show_progress: bool | None = None,
    context: Any = None,
    read_once: bool = False,
    ring: DeviceRing | None = None,
) -> LoadResult:
    """Fill `state_dict`'s tensors in place from a checkpoint; put objects in place.

    Each target may have any layout: a plain tensor (gets the whole tensor), a
    DTensor on any mesh and placements, a legacy `ShardedTensor`, a numpy
    array; on CPU or a CUDA device. Saved objects replace the caller's
    placeholders (a tensor saved where the caller has a non-tensor placeholder
    comes back as a whole CPU tensor).

    Args:
        path: the checkpoint location (any format [`xckpt.open`][xckpt.open] reads), or an
            open [`xckpt.source.Source`][xckpt.source.Source].
        state_dict: the caller's (nested) state dict, flattened with "." as on save.
        process_group: the group whose ranks load together (default: world);
            only used for ranks and value groups.
        strict: raise when the checkpoint lacks a name the caller asks for.
        strict_capacity: value groups: raise instead of evicting when a rank's
            capacity is exceeded.
        format, allow_pickle, rules, context: as for [`xckpt.open`][xckpt.open]. Without
            `allow_pickle` a pickled object (DCP's non-tensor values) is not
            read: its placeholder is left untouched and its name is reported in
            `LoadResult.skipped`. A source opened here is closed before
            `load` returns; an open source passed in stays open.
        show_progress: progress bar (default: when stderr is a TTY).
        read_once: every rank of `process_group` calls `load` with it, and the
            ranks read each stored range once between them: a range several ranks
            need (replicated tensors, data-parallel replicas) is read by one of them
            and sent to the others over the group (gloo or NCCL), so storage serves
            about one copy of what the group needs instead of one per replica. A
            failure on any rank (a corrupt chunk it reads, a target that does not
            fit) raises on every rank; a rank that stops answering makes the others
            raise after `xckpt.torch._read_once.TIMEOUT_S` seconds. Off by default,
            for non-local storage too: it makes `load` a collective every rank must
            join (a default must not make a load on some ranks wait for the others),
            and it trades storage reads for transfers, which pays only where storage
            is the bottleneck. Measured (`bench/read_once.py`, 4 gloo ranks, 63 MiB,
            replicated and dp x tp targets): storage serves 1.00x the checkpoint
            instead of 4x and 3.6x; from an S3 server 3.4-3.9x faster, from a local
            disk 1.8-2.4x slower (docs/guide/loading-at-scale.md).
        ring: the [`DeviceRing`][xckpt.torch._load.DeviceRing] (host buffers) through which target parts that
            are not in CPU memory are read; pass one to reuse its buffers across
            loads. Default: one made for this load, its buffers no larger than needed.

    Returns:
        [`LoadResult`][xckpt.torch._load.LoadResult] with missing, unexpected, evicted and skipped.

    Raises:
        MissingEntryError: `strict` and names are missing (nothing is read then).
        ShapeMismatchError, DtypeMismatchError: a target differs from the saved tensor.
        UnsupportedPlacementError: a target DTensor has a `Partial` placement.
        XckptError: with `read_once`, on every rank when any rank failed.
    """
    with opened(path, format=format, allow_pickle=allow_pickle, rules=rules, context=context) as ckpt:
        req = _Request(state_dict, process_group, strict, strict_capacity, allow_pickle, show_progress, read_once)
        return _load(ckpt, req, ring)


def _load(ckpt: Source, req: _Request, ring: DeviceRing | None) -> LoadResult:
    process_group, show_progress = req.process_group, req.show_progress
    rank, world, group_rank = rank_world(process_group)
    ring = ring if ring is not None else DeviceRing.for_load()
    if not (req.read_once and world > 1):
        prep = _prepare(ckpt, req, ring)
        prep.reads.run(ckpt, show_progress)
    else:
        # Every rank reaches the first exchange, its failure so far in hand, so a rank
        # that cannot load makes the others raise instead of waiting for it.
        err: Exception | None = None
        try:
            prep = _prepare(ckpt, req, ring)
            targets = prep.reads.targets()
        except Exception as e:
            err, targets = e, []
        load_once(
            ckpt,
            targets,
            err,
            group=process_group,
            rank=rank,
            world=world,
            ring=ring,
            show_progress=show_progress,
        )
    later = prep.later
    whole = [n for n, v in later if v is None and n in ckpt]
    if whole:
        full = _load_full(ckpt, whole, torch.device("cpu"), show_progress, ring)
        later = [(n, full[n] if n in full else v) for n, v in later]
    for name, value in later:
        _set(prep.slots[name], name, value)
    return LoadResult(
        missing=prep.missing, unexpected=prep.unexpected, evicted=dict(prep.evicted), skipped=prep.skipped
    )


def _prepare(ckpt: Source, req: _Request, ring: DeviceRing) -> _Prepared:
    """Check the targets and work out every read; objects read here, tensors not yet."""
    rank, world, group_rank = rank_world(req.process_group)
    flat, slots = flatten(req.state_dict)
    handled: set[str] = set()
    evicted: dict[str, int] = {}
    saved_tensors = set(ckpt.names())
    _fill_fresh(ckpt, flat, slots, saved_tensors)
    # Only a checkpoint with value groups needs them (their load may exchange
    # outcomes between ranks); the test is on the manifest, so all ranks agree.
    if any(ckpt.info(n).value_range is not None for n in saved_tensors):
        names, evicted = load_value_groups(ckpt, flat, rank, world, req.process_group, req.strict_capacity)
        handled = set(names)
    saved_objects = set(ckpt.object_names())
    pickled = ckpt.pickled_objects() if not req.allow_pickle else set()
    skipped: list[str] = []
    missing = [n for n in flat if n not in handled and n not in saved_tensors and n not in saved_objects]
    missing_set = set(missing)
    unexpected = [n for n in ckpt.names() + sorted(saved_objects) if n not in flat and n not in handled]
    if req.strict and missing:
        raise MissingEntryError(
            f"checkpoint {str(ckpt.path)!r} lacks {len(missing)} requested entries: {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}. Load with strict=False to skip them, or "
            "remove them from the state dict"
        )
    reads = _Reads(ring)
    direct = ring.copy is None
    later: list[tuple[str, Any]] = []
    cache: dict[Any, Any] = {}  # mesh and layout facts (dtensor_local)
    for name, target in flat.items():
        if name in handled or name in missing_set:
            continue
        if type(target) in PLAIN_TENSORS and name in saved_tensors and target.device.type == "cpu" and direct:
            # A whole CPU tensor (the many-small-tensors case): no placement to work out.
            t = ckpt.info(name)
            if tuple(target.shape) == t.shape and known_dtype_name(target.dtype) == t.dtype:
                if target.numel():
                    reads.items.append((name, t.box, as_numpy(target)))
                continue
        is_tensor = isinstance(target, (torch.Tensor, np.ndarray))
        if name in saved_tensors:
            if not is_tensor:
                later.append((name, None))
                continue
            _check(ckpt, name, target)
            loc = local_pieces(target, name, group_rank, cache)
            for piece in loc.pieces:
                reads.add(name, piece)
        else:
            if is_tensor:
                raise ObjectError(
                    f"checkpoint {str(ckpt.path)!r}: {name!r} is saved as an object, but the "
                    f"target is a tensor; put a placeholder (e.g. None) there to receive it"
                )
            if name in pickled:
                skipped.append(name)
                continue
            later.append((name, _object_value(ckpt, name, target, world, rank)))
    return _Prepared(reads, later, slots, missing, unexpected, evicted, skipped)


@paused_gc()
def load_full(
    path: Location | Source,
    names: Sequence[str] | None = None,
    device: str | torch.device = "cpu",
    *,
    format: str | None = None,  # noqa: A002
    allow_pickle: bool = False,
    rules: Rules = None,
    show_progress: bool | None = None,
    context: Any = None,
    ring: DeviceRing | None = None,
) -> dict[str, Any]:
    """Whole tensors (and objects) for one process, by flat name.

    Args:
        path: the checkpoint location, any format (or an open [`xckpt.source.Source`][xckpt.source.Source]).
        names: which entries (default: every tensor and object).
        device: where the tensors go (CUDA: read into pinned memory, then copied).
        format, allow_pickle, rules, context: as for [`xckpt.open`][xckpt.open] (a source
            opened here is closed before `load_full` returns).
        show_progress: progress bar (default: when stderr is a TTY).
        ring: the [`DeviceRing`][xckpt.torch._load.DeviceRing] through which tensors for a device other than
            the CPU are read (default: one made for this call); see [`load`][xckpt.torch._load.load].

    Returns:
        `{name: torch.Tensor or object}`; a per-rank object comes back as the
        list of every rank's value.
    """
    dev = torch.device(device)
    if dev.type == "meta":
        raise UnsupportedPlacementError("load_full cannot load into the meta device")
    with opened(path, format=format, allow_pickle=allow_pickle, rules=rules, context=context) as ckpt:
        return _load_full(ckpt, names, dev, show_progress, ring)


def _load_full(
    ckpt: Source,
    names: Sequence[str] | None,
    dev: torch.device,
    show_progress: bool | None,
    ring: DeviceRing | None = None,
) -> dict[str, Any]:
    saved_objects = ckpt.object_names()
    if names is None:
        names = ckpt.names() + saved_objects
    out: dict[str, Any] = {}
    reads = _Reads(ring if ring is not None else DeviceRing.for_load())
    objects = []
    for name in names:
        if name in ckpt:
            t = ckpt.info(name)
            dst = torch.empty(t.shape, dtype=torch_dtype(t.dtype), device=dev)
            if dst.numel():
                if dev.type == "cpu":
                    reads.items.append((name, L.Box.full(t.shape), as_numpy(dst)))
                else:
                    reads.staged.append((name, L.Box.full(t.shape), dst))
            out[name] = dst
        elif name in saved_objects:
            objects.append(name)
            out[name] = None
        else:
            raise MissingEntryError(
                f"checkpoint {str(ckpt.path)!r} has no tensor or object {name!r}; it holds "
                f"{ckpt.names()[:5] + saved_objects[:5]} ..."
            )
    if objects:
        out.update(ckpt.objects(objects, per_rank="list"))
    reads.run(ckpt, show_progress)
    return out
