"""Which boxes a rank's `xckpt.torch.save` writes, planned once per state layout.

A training loop saves the same state dict structure every few steps: the same names,
shapes, dtypes and placements, with new values. Planning a save (each DTensor's
placements to its boxes, each replicated box's writer) costs about half of a save's
foreground for a few hundred sharded tensors, so the last plan of each process group
is kept and reused while the state's layout is unchanged (`Plans.plan`): a layout key
of every entry's name and kind, global shape, dtype, device mesh, placements and local
shape is compared with the kept plan's, and on a match only the boxes' tensor parts
are taken from the new values. Any difference plans again; states with legacy
`ShardedTensor`s, other tensor subclasses or value groups are always planned afresh.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from xckpt import layout as L
from xckpt.torch._dtypes import dtype_name
from xckpt.torch._placement import PLAIN_TENSORS, global_info, local_pieces, placement_info
from xckpt.torch._state_dict import PerRank

__all__ = ["Job", "Plans", "plan", "layout_key"]


class Job:
    """One tensor: its declaration and the boxes this rank writes."""

    __slots__ = ("name", "dtype", "shape", "placement", "boxes", "local", "slices")

    def __init__(self, name: str, dtype: Any, shape: tuple[int, ...], placement: Any) -> None:
        self.name, self.dtype, self.shape, self.placement = name, dtype, shape, placement
        self.boxes: list[tuple[L.Box | None, Any]] = []  # (box or None: whole, tensor part or numpy array)
        #: How the parts were taken, for `Plans` to take them again from new values: from the
        #: DTensor's local tensor (else the value itself), each box's slices of it (None: all).
        self.local = False
        self.slices: list[tuple[slice, ...] | None] = []


Objects = list[tuple[str, Any, bool]]


def _whole(slices: tuple[slice, ...], shape: Sequence[int]) -> bool:
    return len(slices) == len(shape) and all(s.start == 0 and s.stop == n and s.step in (None, 1)
                                             for s, n in zip(slices, shape))


def plan(
    flat: Mapping[str, Any], skip: set[str], rank: int, world: int, group_rank: Any
) -> tuple[list[Job], Objects]:
    """Which boxes this rank writes, and its objects. Local; no collective."""
    jobs: list[Job] = []
    objects: Objects = []
    cache: dict[Any, Any] = {}  # mesh and layout facts (dtensor_local)
    for name, v in flat.items():
        if name in skip:
            continue
        if type(v) in PLAIN_TENSORS:
            # A whole tensor (the many-small-tensors case): every rank holds it, one writes it.
            shape = tuple(v.shape)
            job = Job(name, dtype_name(v.dtype, name), shape, None)
            if v.numel() and (world == 1 or L.choose_writer(name, 0, range(world)) == rank):
                job.boxes.append((None, v))  # None: the whole tensor
                job.slices.append(None)
            jobs.append(job)
            continue
        if isinstance(v, (torch.Tensor, np.ndarray)):
            shape, tdtype = global_info(v, name)
            loc = local_pieces(v, name, group_rank, cache)
            job = Job(name, dtype_name(tdtype, name), shape, placement_info(loc))
            if loc.layout == "replicated":
                holders: Sequence[int] | None = range(world)
            else:
                holders = loc.holders
            for i, piece in enumerate(loc.pieces):
                if holders is not None and L.choose_writer(name, i, holders) != rank:
                    continue
                part = piece.tensor[piece.slices] if piece.slices else piece.tensor
                job.boxes.append((piece.box, part))
                job.local = piece.tensor is not v
                job.slices.append(None if not piece.slices or _whole(piece.slices, piece.tensor.shape)
                                  else piece.slices)
            jobs.append(job)
        elif isinstance(v, PerRank):
            objects.append((name, v.value, True))
        else:
            objects.append((name, v, False))
    return jobs, objects


def layout_key(flat: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """What a plan depends on, per entry; None when the state holds a value planned
    afresh every time (a legacy `ShardedTensor`, another tensor subclass)."""
    mod = sys.modules.get("torch.distributed.tensor")
    dtensor = mod.DTensor if mod is not None else None
    key: list[Any] = []
    with torch.no_grad():  # to_local without an autograd node
        for name, v in flat.items():
            t = type(v)
            if t in PLAIN_TENSORS:
                key.append((name, 0, v.shape, v.dtype))
            elif dtensor is not None and t is dtensor:
                key.append((name, 1, v.shape, v.dtype, v.device_mesh, v.placements, v.to_local().shape))
            elif t is np.ndarray:
                key.append((name, 2, v.shape, v.dtype))
            elif isinstance(v, (torch.Tensor, np.ndarray)):
                return None
            else:
                key.append((name, 3, isinstance(v, PerRank)))
    return tuple(key)


class Plans:
    """The last plan per process group, reused while the state's layout is unchanged (see the module)."""

    def __init__(self) -> None:
        self._kept: dict[Any, tuple[tuple[Any, ...], list[Job], list[tuple[str, bool]]]] = {}
        #: Plans made and plans reused (tests read them).
        self.made = self.reused = 0

    def plan(
        self, flat: Mapping[str, Any], skip: set[str], rank: int, world: int, group_rank: Any, group: Any
    ) -> tuple[list[Job], Objects]:
        """`plan(flat, ...)`, from the kept plan when `flat`'s layout matches it."""
        key = layout_key(flat) if not skip else None
        slot = (group, rank, world)
        kept = self._kept.get(slot) if key is not None else None
        if kept is not None and kept[0] == key:
            self.reused += 1
            return _again(kept[1], kept[2], flat)
        jobs, objects = plan(flat, skip, rank, world, group_rank)
        self.made += 1
        if key is not None:
            self._kept[slot] = (key, [_bare(j) for j in jobs], [(n, per_rank) for n, _v, per_rank in objects])
        else:
            self._kept.pop(slot, None)
        return jobs, objects


def _bare(job: Job) -> Job:
    """`job` without its tensor parts (a kept plan must not keep the state's tensors alive)."""
    out = Job(job.name, job.dtype, job.shape, job.placement)
    out.boxes = [(box, None) for box, _part in job.boxes]
    out.local, out.slices = job.local, job.slices
    return out


def _again(template: list[Job], objects: list[tuple[str, bool]], flat: Mapping[str, Any]) -> tuple[list[Job], Objects]:
    """`template`'s jobs with their parts taken from `flat`'s values."""
    jobs = []
    with torch.no_grad():
        for t in template:
            job = Job(t.name, t.dtype, t.shape, t.placement)
            v = flat[t.name]
            src = v.to_local() if t.local else v
            job.local, job.slices = t.local, t.slices
            job.boxes = [(box, src if sl is None else src[sl]) for (box, _p), sl in zip(t.boxes, t.slices)]
            jobs.append(job)
    return jobs, [(n, flat[n].value if per_rank else flat[n], per_rank) for n, per_rank in objects]
