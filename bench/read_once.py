"""``xckpt.torch.load(..., read_once=True)`` against plain loads on gloo ranks: bytes storage
serves, and time.

The checkpoint is W1 (``bench/_common.py``: a small LLM's matrices, float32 and
bfloat16, its norms small float32 vectors) of about ``--size-mib`` MiB, saved by one
process. ``--ranks`` long-lived gloo ranks (4 by default) load it into two targets:

- replicated   every rank the whole state dict as plain tensors (4 copies without read_once)
- dp x tp      DTensors on a (dp=2, tp=ranks/2) mesh, replicated over dp and split over
               tp as Megatron splits a model: q/k/v, gate/up, embedding and lm_head by
               rows (Shard(0)), o_proj and down_proj by columns (Shard(1)), norms
               replicated. The column splits cut across every stored zarr chunk, so
               without read_once the tp ranks read them whole too (about 4x in all,
               not 2x)

each with ``read_once=False`` and ``True``, alternating within every repeat. A timed
load runs barrier to barrier, timed on rank 0; the table shows the median over
``--repeats``. Storage bytes are what every rank read from storage, summed over the
ranks (chunk files: ``xckpt.native._fileio.bytes_read``; S3: tensorstore's
``/tensorstore/kvstore/*/bytes_read`` metrics), as a multiple of the checkpoint's
bytes. Every load is checked bit for bit (outside the timed region).

``--storage``: ``local`` (a directory on this disk), ``s3`` (a local S3 server,
moto's, on 127.0.0.1: a store whose every read is a request), or ``both``.
``--temps``: ``warm`` (page cache kept), ``cold`` (``sync`` and the page cache
dropped before every load; root only, local storage only), or both.

Usage, from the repository root::

    .venv/bin/python bench/read_once.py                        # local, 64 MiB, 4 ranks, 3 repeats
    .venv/bin/python bench/read_once.py --storage both --temps warm,cold

Results: a markdown table on stdout and ``bench/out/read_once.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from _common import (
    drop_caches,
    make_array,
    markdown_table,
    median,
    out_dir,
    remove,
    run_ranks,
    spec_bytes,
    to_torch,
    workload_spec,
)

TARGET_RATIO = 1.15
#: W1 dims giving about 2.7 MB a layer: 64 MiB is 19 layers.
DIMS = (256, 704, 8000)


def _tp_placement(name: str, ndim: int) -> str:
    if ndim < 2:
        return "R"
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return "S1"
    return "S0"


def _storage_bytes(storage: str) -> int:
    if storage == "local":
        from xckpt.native import _fileio

        return _fileio.bytes_read()
    import tensorstore as ts

    return sum(
        int(v.get("value", 0))
        for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/")
        if m["name"].endswith("/bytes_read")
        for v in m.get("values", [])
    )


def _rank(rank: int, world: int, port: int, cfg: dict[str, Any], out: Any) -> None:
    os.environ.update(OMP_NUM_THREADS="1", **cfg.get("env", {}))
    try:
        import datetime

        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        import xckpt.torch as xt

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=300),
        )
        spec = [tuple(x) for x in cfg["spec"]]
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        full = {n: to_torch(make_array(i, tuple(s), d)) for i, (n, s, d) in enumerate(spec)}

        def placements(name: str) -> list[Any]:
            p = _tp_placement(name, full[name].dim())
            return [Replicate(), Replicate() if p == "R" else Shard(int(p[1]))]

        want = {
            "replicated": full,
            "dp x tp": {n: distribute_tensor(t, mesh, placements(n)) for n, t in full.items()},
        }

        def fresh(kind: str) -> dict[str, Any]:
            if kind == "replicated":
                return {n: torch.zeros_like(t) for n, t in full.items()}
            return {n: distribute_tensor(torch.zeros_like(t), mesh, placements(n)) for n, t in full.items()}

        def local(t: Any) -> Any:
            return t.to_local() if hasattr(t, "to_local") else t

        results: list[dict[str, Any]] = []
        for temp in cfg["temps"]:
            for rep in range(cfg["repeats"]):
                for kind in ("replicated", "dp x tp"):
                    for once in (False, True) if rep % 2 == 0 else (True, False):
                        target = fresh(kind)
                        dist.barrier()
                        if temp == "cold" and rank == 0:
                            drop_caches()
                        dist.barrier()
                        before = _storage_bytes(cfg["storage"])
                        t0 = time.perf_counter()
                        xt.load(cfg["location"], target, read_once=once)
                        dist.barrier()
                        seconds = time.perf_counter() - t0
                        nbytes = _storage_bytes(cfg["storage"]) - before
                        exact = all(
                            torch.equal(
                                local(target[n]).view(-1).view(torch.uint8),
                                local(w).view(-1).view(torch.uint8),
                            )
                            for n, w in want[kind].items()
                        )
                        results.append(
                            {
                                "temp": temp,
                                "rep": rep,
                                "target": kind,
                                "read_once": once,
                                "seconds": seconds,
                                "bytes": nbytes,
                                "exact": exact,
                            }
                        )
        dist.barrier()
        dist.destroy_process_group()
        out.put((rank, True, results))
    except BaseException:  # noqa: B036 - reported to the parent
        import traceback

        out.put((rank, False, traceback.format_exc()))


def _save(spec: Any, location: Any) -> None:
    import xckpt.torch as xt

    xt.save({n: to_torch(make_array(i, s, d)) for i, (n, s, d) in enumerate(spec)}, location)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=float, default=64)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--storage", default="local", choices=("local", "s3", "both"))
    ap.add_argument("--temps", default="warm", help="warm, cold or warm,cold")
    args = ap.parse_args()
    if args.ranks < 2 or args.ranks % 2:
        raise SystemExit("--ranks must be even (a dp=2 x tp=ranks/2 mesh)")
    temps = [t for t in args.temps.split(",") if t]
    if "cold" in temps and not drop_caches():
        raise SystemExit("--temps cold needs root (to drop the page cache); use --temps warm")
    spec = workload_spec("W1", args.size_mib / 1024, DIMS)
    total = spec_bytes(spec)
    rows, runs = [], []
    storages = ("local", "s3") if args.storage == "both" else (args.storage,)
    for storage in storages:
        env: dict[str, str] = {}
        server = None
        if storage == "local":
            location: Any = str(out_dir() / "read_once_ckpt")
            remove(location)
        else:
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
            import logging

            import s3_server

            logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

            gen = s3_server.serve()
            server = next(gen)
            location = server.fresh("read-once")
            env = {
                k: os.environ[k]
                for k in (
                    "AWS_ACCESS_KEY_ID",
                    "AWS_SECRET_ACCESS_KEY",
                    "AWS_SESSION_TOKEN",
                    "AWS_DEFAULT_REGION",
                    "AWS_REGION",
                )
            }
        try:
            _save(spec, location)
            cfg = {
                "spec": spec,
                "location": location,
                "storage": storage,
                "repeats": args.repeats,
                "temps": [t for t in temps if storage == "local" or t == "warm"],
                "env": env,
            }
            per_rank = run_ranks(_rank, args.ranks, cfg, timeout=3600)
        finally:
            if server is not None:
                gen.close()
            elif storage == "local":
                remove(location)
        for i, r0 in enumerate(per_rank[0]):
            runs.append(
                {
                    **r0,
                    "storage": storage,
                    "bytes": sum(p[i]["bytes"] for p in per_rank),
                    "exact": all(p[i]["exact"] for p in per_rank),
                }
            )
        for temp in cfg["temps"]:
            for kind in ("replicated", "dp x tp"):
                for once in (False, True):
                    sel = [
                        r
                        for r in runs
                        if (r["storage"], r["temp"], r["target"], r["read_once"])
                        == (storage, temp, kind, once)
                    ]
                    ratio = median([r["bytes"] / total for r in sel])
                    rows.append(
                        [
                            storage,
                            temp,
                            kind,
                            "yes" if once else "no",
                            ratio,
                            median([r["seconds"] for r in sel]),
                            ("yes" if ratio <= TARGET_RATIO else "NO") if once else "-",
                            "yes" if all(r["exact"] for r in sel) else "NO",
                        ]
                    )
    headers = [
        "storage",
        "cache",
        "target",
        "read_once",
        "storage bytes (x ckpt)",
        "load s (median)",
        f"<= {TARGET_RATIO}x",
        "bit-exact",
    ]
    print(
        f"{args.ranks} gloo ranks, checkpoint {total / 2**20:.1f} MiB ({len(spec)} tensors), "
        f"median of {args.repeats}\n"
    )
    print(markdown_table(headers, rows))
    path = out_dir() / "read_once.json"
    path.write_text(
        json.dumps(
            {
                "ranks": args.ranks,
                "checkpoint_bytes": total,
                "tensors": len(spec),
                "headers": headers,
                "rows": rows,
                "runs": runs,
            },
            indent=1,
        )
    )
    print(f"\nwritten: {path}")
    if any(r[-1] != "yes" or r[-2] == "NO" for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
