"""Demo: reshard a managed-collision (ZCH) embedding table from 2 to 3 ranks, by value.

Two gloo ranks hold a trained torchrec-style MCH table (sorted raw ids spread
over torchrec's default input domain 2**63-1, each mapped to a row of the
row-wise sharded weight, Adagrad momentum beside it) and save it with
``xckpt.torch.save``. Three fresh ranks load it with ``xckpt.torch.load``.
Every id is then looked up the way torchrec does at 3 ranks (sent to the rank
owning its block of the input domain, searched in that rank's sorted ids) and
its weight and momentum rows are compared bit for bit with what it had before.
For contrast, a position-sliced load of the same checkpoint is checked too.

Run: ``python examples/demo_value_groups.py`` (about 15 s on 2 cores).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time

import numpy as np

INT64_MAX = 2**63 - 1
N, DIM, IDS_PER_RANK = 3000, 8, 1200
P = "model._managed_collision_collection._managed_collision_modules.t1"
NAMES = {
    "raw": P + "._mch_sorted_raw_ids", "rows": P + "._mch_remapped_ids_mapping", "counts": P + "._mch_counts",
    "seg": P + "._output_segments_tensor", "iter": P + "._current_iter_tensor",
    "weight": "model._embedding_module.embedding_bags.t1.weight", "mom": "optim.momentum1",
}


def bounds(n: int, w: int) -> list[int]:
    b = -(-n // w)
    return [min(r * b, n) for r in range(w + 1)]


def trained_state(rank: int, world: int) -> dict[str, np.ndarray]:
    """What a trained MCH module and its weight shard hold on rank ``rank`` of ``world``."""
    rb, ib = bounds(N, world), bounds(INT64_MAX, world)
    lo, hi = rb[rank], rb[rank + 1]
    rng = np.random.default_rng(rank)
    raw = np.unique(rng.integers(ib[rank], ib[rank + 1], size=IDS_PER_RANK, dtype=np.int64))
    perm = lo + rng.permutation(hi - lo - 1)
    seg = np.full(1025, -1, np.int64)
    seg[: world + 1] = rb
    return {
        NAMES["raw"]: np.concatenate([raw, np.full(hi - lo - raw.size, INT64_MAX, np.int64)]),
        NAMES["rows"]: np.concatenate([perm[: raw.size], np.sort(perm[raw.size :]), [hi - 1]]).astype(np.int64),
        NAMES["counts"]: np.concatenate([rng.integers(1, 100, raw.size), np.zeros(hi - lo - raw.size, np.int64)]),
        NAMES["seg"]: seg,
        NAMES["iter"]: np.array([42], np.int64),
        NAMES["weight"]: rng.standard_normal((hi - lo, DIM), dtype=np.float32),
        NAMES["mom"]: rng.random((hi - lo, DIM), dtype=np.float32),
    }


def fresh_state(rank: int, world: int) -> dict[str, np.ndarray]:
    """A freshly built rank at the new world size (rebuild_with_output_id_range)."""
    rb = bounds(N, world)
    lo, hi = rb[rank], rb[rank + 1]
    seg = np.full(1025, -1, np.int64)
    seg[: world + 1] = rb
    return {
        NAMES["raw"]: np.full(hi - lo, INT64_MAX, np.int64), NAMES["rows"]: np.arange(lo, hi, dtype=np.int64),
        NAMES["counts"]: np.zeros(hi - lo, np.int64), NAMES["seg"]: seg, NAMES["iter"]: np.zeros(1, np.int64),
        NAMES["weight"]: np.zeros((hi - lo, DIM), np.float32), NAMES["mom"]: np.zeros((hi - lo, DIM), np.float32),
    }


def _rank(rank: int, world: int, port: int, path: str, mode: str, queue: object) -> None:
    import torch
    import torch.distributed as dist

    import xckpt.torch as xt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        if mode == "save":
            sd = {k: torch.from_numpy(v) for k, v in trained_state(rank, world).items()}
            decl = xt.ManagedCollision(P, row_aligned=[NAMES["mom"]])  # weight found by torchrec's name rule
            xt.save(sd, path, value_groups=[decl])
            queue.put((rank, None))  # type: ignore[attr-defined]
        else:
            tgt = {k: torch.from_numpy(v) for k, v in fresh_state(rank, world).items()}
            res = xt.load(path, tgt)
            queue.put((rank, ({k: v.numpy() for k, v in tgt.items()}, res.evicted[P])))  # type: ignore[attr-defined]
    finally:
        dist.destroy_process_group()


def run(world: int, path: str, mode: str) -> list:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, world, port, path, mode, q)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode:
            sys.exit(f"rank exited with {p.exitcode}")
    return [out[r] for r in range(world)]


def check(loaded: list[dict[str, np.ndarray]], before: dict[int, tuple]) -> tuple[int, int]:
    """(ids found with their own rows, ids lost) when looked up the torchrec way."""
    world = len(loaded)
    rb, ib = bounds(N, world), bounds(INT64_MAX, world)
    ok = lost = 0
    for x, (w, m) in before.items():
        r = int(np.searchsorted(ib[1:], x, side="right"))
        st, lo, hi = loaded[r], rb[r], rb[r + 1]
        raw = st[NAMES["raw"]]
        i = int(np.searchsorted(raw[:-1], x))
        row = int(st[NAMES["rows"]][i]) if i < raw.size - 1 and raw[i] == x else hi - 1  # miss row otherwise
        if lo <= row < hi - 1 and np.array_equal(st[NAMES["weight"]][row - lo].view(np.uint32), w.view(np.uint32)) \
                and np.array_equal(st[NAMES["mom"]][row - lo].view(np.uint32), m.view(np.uint32)):
            ok += 1
        else:
            lost += 1
    return ok, lost


def main() -> None:
    import xckpt

    t0 = time.perf_counter()
    before: dict[int, tuple] = {}
    for r in range(2):
        st = trained_state(r, 2)
        lo = bounds(N, 2)[r]
        for x, row in zip(st[NAMES["raw"]], st[NAMES["rows"]]):
            if x != INT64_MAX:
                before[int(x)] = (st[NAMES["weight"]][row - lo], st[NAMES["mom"]][row - lo])
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt")
        run(2, path, "save")
        print(f"saved at 2 ranks: {len(before)} ids in a table of {N} rows -> {path}")
        ck = xckpt.open(path)
        print(f"  key annotation: {ck.info(NAMES['raw']).value_range.kind}, "
              f"{sum(c.value_range is not None for c in ck.info(NAMES['raw']).chunks)} chunks with value ranges")
        results = run(3, path, "load")
        loaded = [res[0] for res in results]
        evicted = sum(res[1] for res in results)
        ok, lost = check(loaded, before)
        print(f"value load at 3 ranks: {ok}/{len(before)} ids found with their own weight and momentum rows, "
              f"{lost} lost, {evicted} evicted for capacity")
        # contrast: slicing every saved tensor by position and re-sorting, as a positional loader would
        pos = []
        for r in range(3):
            lo, hi = bounds(N, 3)[r], bounds(N, 3)[r + 1]
            st = {n: ck.read(n, slice(lo, hi)) for n in NAMES.values() if n not in (NAMES["seg"], NAMES["iter"])}
            order = np.argsort(st[NAMES["raw"]], kind="stable")
            for n in (NAMES["raw"], NAMES["rows"], NAMES["counts"]):
                st[n] = st[n][order]
            pos.append(st)
        ok_p, lost_p = check(pos, before)
        print(f"position-sliced load at 3 ranks: {ok_p}/{len(before)} found, {lost_p} lost")
        if lost != evicted or ok + lost != len(before):
            sys.exit("FAILED: the value load lost lookups")
    print(f"every lookup checked in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
