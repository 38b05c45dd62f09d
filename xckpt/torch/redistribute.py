"""Moving a managed-collision group held in memory to a new layout, by value.

[`redistribute_by_value`][xckpt.torch.redistribute.redistribute_by_value] is the in-memory twin of loading a value group:
every rank of the process group calls it with its current tensors; entries go
to the input owner of their raw id and the weight rows follow, with
`all_to_all_single`; each rank then applies the core's steps
(`xckpt.values.ranges.assemble_rank`), so the result equals
`xckpt.torch.load` of a checkpoint of the same state. Collectives, in order,
on every rank: split sizes and entries (two `all_to_all_single`), one outcome
exchange (`xckpt.torch._dist.share_outcome`; all ranks raise together),
row requests and replies (two `all_to_all_single` per row tensor), and an
`all_reduce` (max) of the current iteration.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from xckpt.errors import ShapeMismatchError, ValueRangeError
from xckpt.torch._dist import share_outcome
from xckpt.torch.value_groups import (
    RANK_BY,
    ManagedCollision,
    local_tensor,
    resolve_managed_collision,
    segment_bounds,
    to_numpy,
)
from xckpt.values import ranges as V

__all__ = ["redistribute_by_value"]


def _a2a(send: torch.Tensor, counts: list[int], group: Any) -> tuple[torch.Tensor, list[int]]:
    """all_to_all_single with the split sizes exchanged first."""
    import torch.distributed as dist

    sc = torch.tensor(counts, dtype=torch.int64, device=send.device)
    rc = torch.empty_like(sc)
    dist.all_to_all_single(rc, sc, group=group)
    recv_counts = [int(x) for x in rc.tolist()]
    out = torch.empty((sum(recv_counts), *send.shape[1:]), dtype=send.dtype, device=send.device)
    dist.all_to_all_single(out, send.contiguous(), recv_counts, counts, group=group)
    return out, recv_counts


def redistribute_by_value(
    state: Mapping[str, Any],
    group: ManagedCollision,
    *,
    row_bounds: Sequence[int] | None = None,
    held_row_bounds: Sequence[int] | None = None,
    process_group: Any = None,
    strict_capacity: bool = False,
) -> tuple[dict[str, torch.Tensor], int]:
    """Move a managed-collision group held in memory to a new layout, by value.

    Every rank of `process_group` calls it with its current tensors. Entries
    go to the input owner of their raw id and weight rows (and the declared
    row-aligned tensors) follow, with `all_to_all_single` (split sizes
    exchanged first); each rank then applies the same steps as the read path
    (`xckpt.values.ranges.assemble_rank`), so the result equals
    `xckpt.torch.load` of a checkpoint of the same state.

    Args:
        state: this rank's tensors by name (names as in `group`); the buffers
            may hold any entries, the weight holds rows `held_row_bounds[r:r+2]`.
        group: the group declaration (prefix, weight, input size, row-aligned).
        row_bounds: the new row split (default: torchrec's ceil split over the group).
        held_row_bounds: which weight rows each rank holds now (default: the
            state's `_output_segments_tensor`).
        process_group: gloo on CPU, NCCL on GPU (default: world).
        strict_capacity: raise on every rank instead of evicting.

    Returns:
        (new tensors by name on this rank, entries this rank evicted).

    Raises:
        ValueRangeError: duplicates, or an overflow with `strict_capacity`.
    """
    import torch.distributed as dist

    p = resolve_managed_collision(state, group)
    world = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    key_t = local_tensor(state[p.key], p.key)[0]
    dev = key_t.device
    held = tuple(held_row_bounds) if held_row_bounds is not None else segment_bounds(state, p)
    if held is None or len(held) != world + 1:
        raise ValueRangeError(f"value group {group.prefix!r}: give held_row_bounds, one range per rank of {world}")
    n = held[-1]
    new = V.MCLayout(int(group.input_size), tuple(row_bounds) if row_bounds is not None else V.ceil_bounds(n, world))
    if len(new.row_bounds) != world + 1 or new.row_bounds[-1] != n:
        raise ShapeMismatchError(f"value group {group.prefix!r}: row_bounds {list(new.row_bounds)} do not split {n} rows over {world} ranks")
    cols = [p.key, p.rows, *p.metadata]
    mat = torch.stack([local_tensor(state[c], c)[0].to(torch.int64).reshape(-1) for c in cols], dim=1)
    mat = mat[mat[:, 0] != V.INT64_MAX]
    owner = torch.from_numpy(new.owner(to_numpy(mat[:, 0]).copy())).to(dev)
    order = torch.argsort(owner, stable=True)
    counts = torch.bincount(owner, minlength=world).tolist()
    got, _ = _a2a(mat[order], counts, process_group)
    g = to_numpy(got)
    err: Exception | None = None
    asm: V.Assembled | None = None
    try:
        asm = V.assemble_rank(
            g[:, 0], g[:, 1], {c: g[:, 2 + i] for i, c in enumerate(p.metadata)}, new, rank,
            list(group.rank_by) if group.rank_by is not None else [c for c in p.metadata if c.rsplit(".", 1)[-1] in RANK_BY],
            name=p.key, strict_capacity=strict_capacity,
        )
    except Exception as e:  # any failure: shared with every rank, then raised on all
        err = e
    share_outcome(
        err, group=process_group, world=world, error=ValueRangeError,
        what=f"redistribute_by_value of {group.prefix!r}", fix="Nothing was moved",
    )
    if asm is None:  # share_outcome raised for any failure; this guards the type only
        raise ValueRangeError(f"redistribute_by_value of {group.prefix!r}: no assignment was computed")
    out: dict[str, torch.Tensor] = {
        p.key: torch.from_numpy(asm.raw).to(dev),
        p.rows: torch.from_numpy(asm.rows).to(dev),
    }
    out.update({c: torch.from_numpy(asm.meta[c]).to(dev) for c in p.metadata})
    # Weight rows: ask each holder for the rows this rank's new rows come from.
    src = asm.source_rows
    holder = np.searchsorted(np.asarray(held[1:], np.int64), src, side="right")
    r_order = np.argsort(holder, kind="stable")
    r_counts = np.bincount(holder, minlength=world).tolist()
    req, req_counts = _a2a(torch.from_numpy(src[r_order]).to(dev), r_counts, process_group)
    hlo = held[rank]
    for name in [x for x in [p.weight, *p.row_aligned] if x is not None]:
        w = local_tensor(state[name], name)[0]
        reply, _ = _a2a(w[req - hlo], req_counts, process_group)
        res = torch.empty_like(reply)
        res[torch.from_numpy(r_order).to(dev)] = reply
        out[name] = res
    if p.current_iter is not None:
        it = local_tensor(state[p.current_iter], p.current_iter)[0].reshape(-1)[:1].to(torch.int64).clone()
        dist.all_reduce(it, op=dist.ReduceOp.MAX, group=process_group)
        out[p.current_iter] = it
    if p.segments is not None:
        seg_t = local_tensor(state[p.segments], p.segments)[0]
        seg = torch.full(tuple(seg_t.shape), -1, dtype=torch.int64, device=dev)
        seg[: world + 1] = torch.tensor(new.row_bounds, dtype=torch.int64, device=dev)
        out[p.segments] = seg
    return out, asm.evicted
