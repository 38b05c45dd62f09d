"""redistribute_by_value: entries and weight rows moved with all_to_all_single, gloo on CPU, NCCL on GPU.

The result is checked against the pure steps (route by input owner, assemble,
weight rows from their source rows) computed here from the same state.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from dist_utils import run_ranks
from test_value_helpers import (
    COUNTS,
    ITER,
    MOM,
    PREFIX,
    RAW,
    ROWS,
    SEG,
    WEIGHT,
    make_rank_state,
    named,
)

from xckpt.values.ranges import MCLayout, assemble_rank, ceil_bounds

N, I_SIZE = 48, 5000


def _new_bounds(world: int) -> tuple[int, ...]:
    return (0, 20, N) if world == 2 else ceil_bounds(N, world)  # a different split: rows re-slot


def _body(rank: int, world: int, backend: str) -> Any:
    import datetime
    import os

    import torch
    import torch.distributed as dist

    import xckpt.torch as xt

    dev = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        st = {k: torch.from_numpy(v).to(dev) for k, v in named(make_rank_state(N, world, rank, I_SIZE, seed=4)).items()}
        decl = xt.ManagedCollision(PREFIX, weight=WEIGHT, input_size=I_SIZE, row_aligned=[MOM])
        new, ev = xt.redistribute_by_value(st, decl, row_bounds=_new_bounds(world))
        return {k: v.cpu().numpy() for k, v in new.items()}, ev, str(next(iter(new.values())).device)
    finally:
        if backend == "nccl":
            dist.destroy_process_group()


def _expected(world: int) -> list[dict[str, np.ndarray]]:
    states = [make_rank_state(N, world, r, I_SIZE, seed=4) for r in range(world)]
    raw = np.concatenate([s["raw"] for s in states])
    rows = np.concatenate([s["rows"] for s in states])
    cnt = np.concatenate([s["counts"] for s in states])
    weight = np.concatenate([s["weight"] for s in states])
    mom = np.concatenate([s["mom"] for s in states])
    used = raw != np.iinfo(np.int64).max
    lay = MCLayout(I_SIZE, _new_bounds(world))
    own = lay.owner(raw[used])
    out = []
    for r in range(world):
        m = own == r
        a = assemble_rank(raw[used][m], rows[used][m], {COUNTS: cnt[used][m]}, lay, r, [COUNTS])
        seg = np.full(1025, -1, np.int64)
        seg[: world + 1] = lay.row_bounds
        out.append({RAW: a.raw, ROWS: a.rows, COUNTS: a.meta[COUNTS], WEIGHT: weight[a.source_rows],
                    MOM: mom[a.source_rows], SEG: seg, ITER: np.array([7 + world - 1])})
    return out


@pytest.mark.parametrize(
    ("backend", "world"),
    [("gloo", 2), pytest.param("nccl", 1, marks=pytest.mark.gpu)],
    ids=["gloo-cpu", "nccl-gpu"],
)
def test_redistribute_matches_the_pure_steps(backend: str, world: int) -> None:
    res = run_ranks(_body, world, backend, init=backend == "gloo", timeout=120)
    exp = _expected(world)
    moved = 0
    for r in range(world):
        got, ev, device = res[r]
        assert ev == 0 and device.startswith("cuda" if backend == "nccl" else "cpu")
        assert set(got) == set(exp[r])
        for k in got:
            assert np.array_equal(got[k], exp[r][k]), (r, k)
        lo = _new_bounds(world)[r]
        moved += int(np.count_nonzero(got[ROWS] != np.arange(lo, lo + got[ROWS].size)))
    assert moved > 0
