"""Shared helpers of the value-group tests: synthetic trained MCH state and lookup checks.

No tests here. The state mimics what a trained torchrec ``MCHManagedCollisionModule``
holds on rank r of W (checked against real modules in test_value_torchrec.py):
sorted raw ids with int64-max empties last, rows a permutation of the rank's row
range with the miss row in the last slot, LFU counts (int64 max on the last slot).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from xckpt.values.ranges import INT64_MAX, MCLayout, ceil_bounds

PREFIX = "emb._managed_collision_collection._managed_collision_modules.t1"
WEIGHT = "emb._embedding_module.embedding_bags.t1.weight"
MOM = "optim.state.t1.momentum1"
RAW = PREFIX + "._mch_sorted_raw_ids"
ROWS = PREFIX + "._mch_remapped_ids_mapping"
COUNTS = PREFIX + "._mch_counts"
SEG = PREFIX + "._output_segments_tensor"
ITER = PREFIX + "._current_iter_tensor"


def make_rank_state(
    n_rows: int, world: int, rank: int, input_size: int, dim: int = 4, fill: float = 0.5, seed: int = 0
) -> dict[str, np.ndarray]:
    """Rank ``rank`` of ``world``'s trained state, as numpy arrays by state-dict name."""
    lay = MCLayout(input_size, ceil_bounds(n_rows, world))
    lo, hi = lay.rows(rank)
    ilo, ihi = lay.inputs(rank)
    zch = hi - lo
    rng = np.random.default_rng(seed * 1000 + rank)
    n_used = min(int(fill * max(zch - 1, 0)), ihi - ilo)
    raw_used: np.ndarray = np.zeros(0, np.int64)
    while raw_used.size < n_used:
        extra = rng.integers(ilo, ihi, size=n_used, dtype=np.int64)
        raw_used = np.unique(np.concatenate([raw_used, extra]))
    raw_used = np.sort(rng.permutation(raw_used)[:n_used])
    perm = lo + rng.permutation(max(zch - 1, 0)).astype(np.int64)
    rows_used = perm[:n_used]
    free = np.sort(perm[n_used:])
    raw = np.concatenate([raw_used, np.full(zch - n_used, INT64_MAX, np.int64)])
    rows = np.concatenate([rows_used, free, [hi - 1] if zch else []]).astype(np.int64)
    counts = np.concatenate([rng.integers(1, 1000, n_used), np.zeros(zch - n_used, np.int64)]).astype(np.int64)
    if zch > n_used:
        counts[-1] = INT64_MAX
    seg = np.full(1025, -1, np.int64)
    seg[: world + 1] = lay.row_bounds
    weight = rng.standard_normal((zch, dim)).astype(np.float32)
    mom = rng.random((zch, dim)).astype(np.float32)
    return {
        "raw": raw, "rows": rows, "counts": counts, "seg": seg,
        "iter": np.array([7 + rank], np.int64), "weight": weight, "mom": mom,
    }


def named(st: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """State-dict names of a :func:`make_rank_state` dict."""
    return {RAW: st["raw"], ROWS: st["rows"], COUNTS: st["counts"], SEG: st["seg"], ITER: st["iter"],
            WEIGHT: st["weight"], MOM: st["mom"]}


def id_table(states: list[dict[str, np.ndarray]], row_bounds: tuple[int, ...]) -> dict[int, tuple[Any, ...]]:
    """raw id -> (weight row, momentum row, count) over all ranks, before saving."""
    out: dict[int, tuple[Any, ...]] = {}
    for r, st in enumerate(states):
        lo = row_bounds[r]
        for x, row, c in zip(st["raw"], st["rows"], st["counts"]):
            if x != INT64_MAX:
                out[int(x)] = (st["weight"][row - lo].copy(), st["mom"][row - lo].copy(), int(c))
    return out


def empty_target(n_rows: int, world: int, rank: int, dim: int = 4) -> dict[str, np.ndarray]:
    """A freshly built rank's state (what rebuild_with_output_id_range gives), as targets."""
    b = ceil_bounds(n_rows, world)
    lo, hi = b[rank], b[rank + 1]
    seg = np.full(1025, -1, np.int64)
    seg[: world + 1] = b
    return {
        RAW: np.full(hi - lo, INT64_MAX, np.int64), ROWS: np.arange(lo, hi, dtype=np.int64),
        COUNTS: np.zeros(hi - lo, np.int64), SEG: seg, ITER: np.zeros(1, np.int64),
        WEIGHT: np.zeros((hi - lo, dim), np.float32), MOM: np.zeros((hi - lo, dim), np.float32),
    }


def check_lookups(
    table: dict[int, tuple[Any, ...]], loaded: list[dict[str, np.ndarray]], input_size: int, n_rows: int
) -> int:
    """Every id routed the torchrec way at W' is found with its own rows; returns ids not found.

    Raises AssertionError (test helper) on a wrong row or weight.
    """
    world = len(loaded)
    lay = MCLayout(input_size, ceil_bounds(n_rows, world))
    missing = 0
    for x, (w, m, _c) in table.items():
        r = int(lay.owner(np.array([x], np.int64))[0])
        st = loaded[r]
        lo, hi = lay.rows(r)
        raw = st[RAW]
        pos = int(np.searchsorted(raw[:-1], x))
        if pos >= raw.size - 1 or raw[pos] != x:
            missing += 1
            continue
        row = int(st[ROWS][pos])
        assert lo <= row < hi - 1, (x, row, lo, hi)
        assert np.array_equal(st[WEIGHT][row - lo].view(np.uint32), w.view(np.uint32)), x
        assert np.array_equal(st[MOM][row - lo].view(np.uint32), m.view(np.uint32)), x
    for r, st in enumerate(loaded):
        lo, hi = lay.rows(r)
        assert np.array_equal(np.sort(st[ROWS]), np.arange(lo, hi)), f"rank {r}: rows are not a permutation"
        assert st[ROWS][-1] == hi - 1 if hi > lo else True
        assert np.all(np.diff(st[RAW]) >= 0)
        assert list(st[SEG][: world + 1]) == list(lay.row_bounds)
    return missing
