"""Benchmark: value-aware load of a managed-collision table vs a position-sliced load.

A table of ``--ids`` used ids (default 10M) in ``--rows`` rows (default 1.2x),
trained state synthesised like torchrec's MCH buffers (sorted raw ids spread over
the default input domain 2**63-1, rows a permutation of each rank's range, LFU
counts), an fp32 weight of ``--dim`` columns. Saved at W = 2 and W = 4 (one
Writer per simulated rank), then loaded at W' = 3 rank by rank:

* value path: :func:`xckpt.values.load.read_group_rank` (what ``xckpt.torch.load``
  and the JAX adapter run), the correct result;
* position-sliced: each rank reads rows ``[lo', hi')`` of every group tensor, the
  I/O a positional loader does (its result loses lookups; it is the baseline).

Reports bytes read and seconds per rank (page cache dropped before each rank
when allowed), the share of the rank's rows that take a weight row from
elsewhere, the least bytes a value load must read (its key chunks and one saved
weight row per new row), and checks a sample of lookups on the value path.
Run: ``python bench/value_groups.py`` (``--quick`` for a small run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from _common import drop_caches, markdown_table, out_dir, remove  # noqa: E402

import xckpt  # noqa: E402
from xckpt.values.load import read_group_rank  # noqa: E402
from xckpt.values.ranges import INT64_MAX, MCLayout, ceil_bounds  # noqa: E402

P = "m._managed_collision_collection._managed_collision_modules.t"
RAW, ROWS, CNT, W_NAME = P + "._mch_sorted_raw_ids", P + "._mch_remapped_ids_mapping", P + "._mch_counts", "w"


def rank_state(n_rows: int, world: int, rank: int, n_ids: int, dim: int, seed: int) -> dict[str, np.ndarray]:
    lay = MCLayout(INT64_MAX, ceil_bounds(n_rows, world))
    lo, hi = lay.rows(rank)
    ilo, ihi = lay.inputs(rank)
    zch = hi - lo
    used = min(n_ids // world, zch - 1)
    rng = np.random.default_rng(seed + rank)
    raw = np.unique(rng.integers(ilo, ihi, size=used + used // 100 + 10, dtype=np.int64))[:used]
    raw = np.sort(rng.permutation(raw)[:used])
    perm = lo + rng.permutation(zch - 1).astype(np.int64)
    seg = np.full(1025, -1, np.int64)
    seg[: world + 1] = lay.row_bounds
    return {
        RAW: np.concatenate([raw, np.full(zch - raw.size, INT64_MAX, np.int64)]),
        ROWS: np.concatenate([perm[: raw.size], np.sort(perm[raw.size :]), [hi - 1]]).astype(np.int64),
        CNT: np.concatenate([rng.integers(1, 1 << 20, raw.size), np.zeros(zch - raw.size, np.int64)]),
        P + "._output_segments_tensor": seg,
        P + "._current_iter_tensor": np.array([100], np.int64),
        W_NAME: rng.standard_normal((zch, dim), dtype=np.float32),
    }


def save(path: str, world: int, args: Any) -> dict[int, Any]:
    import torch

    from xckpt.torch.value_groups import ManagedCollision, save_value_groups, split_value_groups

    sample: dict[int, Any] = {}
    for r in range(world):
        st = rank_state(args.rows, world, r, args.ids, args.dim, seed=world)
        lo = ceil_bounds(args.rows, world)[r]
        pick = np.random.default_rng(r).choice(np.flatnonzero(st[RAW] != INT64_MAX), 200, replace=False)
        sample.update({int(st[RAW][i]): st[W_NAME][st[ROWS][i] - lo].copy() for i in pick})
        flat = {k: torch.from_numpy(v) for k, v in st.items()}
        w = xckpt.Writer(path, rank=r, world_size=world, save_id=f"b{world}")
        plans, _ = split_value_groups(flat, [ManagedCollision(P, weight=W_NAME, chunk_rows=args.chunk_rows)])
        save_value_groups(w, flat, plans, r, world)
        w.commit()
        del st, flat
    xckpt.finalize(path, world, f"b{world}")
    return sample


def position_load(ckpt: Any, rank: int, world: int) -> int:
    n = ckpt.info(RAW).shape[0]
    lo, hi = ceil_bounds(n, world)[rank], ceil_bounds(n, world)[rank + 1]
    items = []
    for name in (RAW, ROWS, CNT, W_NAME):
        t = ckpt.info(name)
        box = xckpt.Box((lo,) + (0,) * (len(t.shape) - 1), (hi - lo,) + tuple(t.shape[1:]))
        items.append((name, box, np.empty(box.shape, t.np_dtype)))
    ckpt.read_into(items)
    return sum(o.nbytes for _, _, o in items)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ids", type=int, default=10_000_000)
    ap.add_argument("--rows", type=int, default=0, help="table rows (default 1.2 x ids)")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--chunk-rows", type=int, default=1 << 19)
    ap.add_argument("--quick", action="store_true", help="200k ids")
    args = ap.parse_args()
    if args.quick:
        args.ids, args.chunk_rows = 200_000, 1 << 14
    args.rows = args.rows or int(args.ids * 1.2)
    w2 = 3
    rows_out = []
    result: dict[str, Any] = {"ids": args.ids, "rows": args.rows, "dim": args.dim, "chunk_rows": args.chunk_rows}
    for world in (2, 4):
        path = str(out_dir() / f"value_groups_w{world}")
        remove(path)
        t0 = time.perf_counter()
        sample = save(path, world, args)
        t_save = time.perf_counter() - t0
        ckpt = xckpt.open(path)
        table_bytes = sum(ckpt.info(n).chunks[0].nbytes * 0 + int(np.prod(ckpt.info(n).shape)) * ckpt.info(n).np_dtype.itemsize
                          for n in (RAW, ROWS, CNT, W_NAME))
        lay = MCLayout(INT64_MAX, ceil_bounds(args.rows, w2))
        for r in range(w2):
            cold = drop_caches()
            t0 = time.perf_counter()
            got = read_group_rank(ckpt, RAW, r, w2)
            t_val = time.perf_counter() - t0
            stats = {"bytes": got.read.bytes, "key_bytes": got.read.key_bytes}
            lo, hi = lay.rows(r)
            moved = int(np.count_nonzero(got.source_rows != np.arange(lo, hi)))
            needed = stats["key_bytes"] + (hi - lo) * args.dim * 4  # the least a value load can read
            raw = got.arrays[RAW]
            for x, wrow in sample.items():  # every sampled id this rank owns is found with its row
                if lay.owner(np.array([x]))[0] != r:
                    continue
                i = int(np.searchsorted(raw[:-1], x))
                if raw[i] != x or not np.array_equal(got.arrays[W_NAME][got.arrays[ROWS][i] - lo], wrow):
                    raise SystemExit(f"lookup of {x} failed on rank {r}")
            drop_caches()
            t0 = time.perf_counter()
            pos_bytes = position_load(ckpt, r, w2)
            t_pos = time.perf_counter() - t0
            rows_out.append([
                f"{world} -> {w2}", r, got.path, f"{moved / (hi - lo):.2f}", f"{needed / 2**20:.0f}",
                f"{stats['bytes'] / 2**20:.0f}",
                f"{stats['bytes'] / table_bytes:.2f}", f"{t_val:.2f}", f"{pos_bytes / 2**20:.0f}",
                f"{pos_bytes / table_bytes:.2f}", f"{t_pos:.2f}", got.evicted,
            ])
            result[f"w{world}_r{r}"] = {
                "value_bytes": stats["bytes"], "value_s": t_val, "moved_rows": moved, "needed_bytes": needed, "position_bytes": pos_bytes,
                "position_s": t_pos, "evicted": got.evicted, "cold": cold,
            }
        result[f"w{world}"] = {"table_bytes": table_bytes, "save_s": t_save}
        remove(path)
    head = ["W -> W'", "rank", "path", "rows moved in", "needed MiB", "value MiB", "of table", "value s", "position MiB", "of table",
            "position s", "evicted"]
    print(f"table: {args.ids:,} ids in {args.rows:,} rows, fp32 weight x{args.dim}; "
          f"table bytes {result['w2']['table_bytes'] / 2**20:.0f} MiB")
    print(markdown_table(head, rows_out))
    (out_dir() / "value_groups.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
