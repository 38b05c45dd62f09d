"""xckpt.torch against torch DCP on real gloo ranks: save, load, and resharding loads.

The state dict is W1 (bench/io.py: a small LLM's matrices, mixed float32 and
bfloat16, about ``--size-gib`` GiB) as DTensors ``Shard(0)`` on a 2-rank mesh.
Measured, each a median over ``--repeats``:

- save 2 ranks     xckpt.torch.save vs dcp.save of the same DTensor state dict
- load 2 -> 2      into DTensors of the same layout
- save 1 rank      the whole state dict as plain tensors, one process
- load 2 -> 1      a 2-rank checkpoint into whole tensors, one process, no process group
- load 1 -> 2      a 1-rank checkpoint into Shard(0) DTensors on 2 ranks

Both libraries run with their defaults (DCP: FileSystemWriter/Reader, one file
per rank, one thread). A timed region is barrier to barrier on rank 0. Before
every load the page cache is dropped when allowed (root), so loads are cold;
otherwise they are warm and the table says so. Every load is checked bit for
bit outside the timed region. Ratios are DCP time / xckpt time (> 1: xckpt is
faster).

Usage, from the repository root::

    .venv/bin/python bench/torch_dist.py                  # W1 (~1 GiB), 3 repeats
    .venv/bin/python bench/torch_dist.py --size-gib 0.1 --repeats 1   # a quick run
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import drop_caches, load_average, markdown_table, median, out_dir  # noqa: E402


def _bench_io() -> Any:
    spec = importlib.util.spec_from_file_location("bench_io", Path(__file__).resolve().parent / "io.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def shard_data(i: int, shape: tuple[int, ...], dtype: str, part: int, parts: int) -> torch.Tensor:
    """Rows [chunk ``part`` of ``parts``] of tensor ``i`` (seeded; same for every system)."""
    rows = shape[0]
    cs = -(-rows // parts)
    lo, hi = min(rows, cs * part), min(rows, cs * (part + 1))
    g = torch.Generator().manual_seed(1000 * i + part)
    return torch.randn((hi - lo, *shape[1:]), generator=g).to(DTYPES[dtype])


def full_data(i: int, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    return torch.cat([shard_data(i, shape, dtype, p, 2) for p in range(2)])


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    v = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return a.shape == b.shape and torch.equal(a.view(v), b.view(v))


def _sharded(spec: list, mesh: Any, rank: int, fill: bool) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard

    sd = {}
    for i, (name, shape, dtype) in enumerate(spec):
        local = shard_data(i, shape, dtype, rank, 2)
        if fill:
            local = torch.zeros_like(local)
        stride = torch.empty(shape, device="meta").stride()
        sd[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)
    return sd


def _check_sharded(spec: list, sd: dict[str, Any], rank: int, what: str) -> None:
    for i, (name, shape, dtype) in enumerate(spec):
        if not bit_equal(sd[name].to_local(), shard_data(i, shape, dtype, rank, 2)):
            raise SystemExit(f"{what}: {name} differs on rank {rank}")


def _timed(fn: Any, group: bool = True) -> float:
    if group:
        dist.barrier()
    t0 = time.perf_counter()
    fn()
    if group:
        dist.barrier()
    return time.perf_counter() - t0


def _cold(rank: int, group: bool = True) -> bool:
    ok = drop_caches() if rank == 0 else True
    if group:
        dist.barrier()
    return ok


def two_ranks(rank: int, port: int, root: str, spec: list, repeats: int, phase: str, out: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import xckpt.torch as xt

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(minutes=30),
    )
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,))
    res: dict[str, list[float]] = {}
    cold = True
    if phase == "2to2":
        sd = _sharded(spec, mesh, rank, fill=False)
        for r in range(repeats):
            for sys_ in ("xckpt", "dcp"):
                path = os.path.join(root, f"{sys_}2_{r}")
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
                save = (lambda p=path: xt.save(sd, p)) if sys_ == "xckpt" else (lambda p=path: dcp.save(sd, checkpoint_id=p))
                res.setdefault(f"save 2 ranks/{sys_}", []).append(_timed(save))
            for sys_ in ("xckpt", "dcp"):
                path = os.path.join(root, f"{sys_}2_{r}")
                tgt = _sharded(spec, mesh, rank, fill=True)
                cold &= _cold(rank)
                load = (lambda p=path, t=tgt: xt.load(p, t)) if sys_ == "xckpt" else (lambda p=path, t=tgt: dcp.load(t, checkpoint_id=p))
                res.setdefault(f"load 2 -> 2/{sys_}", []).append(_timed(load))
                _check_sharded(spec, tgt, rank, f"{sys_} load 2 -> 2")
                del tgt
            dist.barrier()
            if rank == 0 and r < repeats - 1:
                for sys_ in ("xckpt", "dcp"):
                    shutil.rmtree(os.path.join(root, f"{sys_}2_{r}"))
    else:  # 1to2: load the 1-rank checkpoints into Shard(0) DTensors
        for _ in range(repeats):
            for sys_ in ("xckpt", "dcp"):
                path = os.path.join(root, f"{sys_}1")
                tgt = _sharded(spec, mesh, rank, fill=True)
                cold &= _cold(rank)
                load = (lambda p=path, t=tgt: xt.load(p, t)) if sys_ == "xckpt" else (lambda p=path, t=tgt: dcp.load(t, checkpoint_id=p))
                res.setdefault(f"load 1 -> 2/{sys_}", []).append(_timed(load))
                _check_sharded(spec, tgt, rank, f"{sys_} load 1 -> 2")
                del tgt
    if rank == 0:
        out.put((res, cold))
    dist.destroy_process_group()


def one_rank(root: str, spec: list, repeats: int, last: int, out: Any) -> None:
    """No process group: save whole tensors at 1 rank; load 2 -> 1."""
    import torch.distributed.checkpoint as dcp

    import xckpt.torch as xt

    torch.set_num_threads(1)
    full = {name: full_data(i, shape, dtype) for i, (name, shape, dtype) in enumerate(spec)}
    res: dict[str, list[float]] = {}
    cold = True
    for _ in range(repeats):
        for sys_ in ("xckpt", "dcp"):
            path = os.path.join(root, f"{sys_}1")
            shutil.rmtree(path, ignore_errors=True)
            save = (lambda p=path: xt.save(full, p)) if sys_ == "xckpt" else (lambda p=path: dcp.save(full, checkpoint_id=p, no_dist=True))
            res.setdefault(f"save 1 rank/{sys_}", []).append(_timed(save, group=False))
        for sys_ in ("xckpt", "dcp"):
            path = os.path.join(root, f"{sys_}2_{last}")
            tgt = {n: torch.zeros_like(t) for n, t in full.items()}
            cold &= _cold(0, group=False)
            load = (lambda p=path, t=tgt: xt.load(p, t)) if sys_ == "xckpt" else (lambda p=path, t=tgt: dcp.load(t, checkpoint_id=p, no_dist=True))
            res.setdefault(f"load 2 -> 1/{sys_}", []).append(_timed(load, group=False))
            for n in full:
                if not bit_equal(tgt[n], full[n]):
                    raise SystemExit(f"{sys_} load 2 -> 1: {n} differs")
            del tgt
    out.put((res, cold))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0, help="W1 size (default 1.0)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--root", default=None, help="where checkpoints go (default bench/out/torch_dist)")
    args = ap.parse_args()
    spec = _bench_io().workload_spec("W1", args.size_gib)
    nbytes = sum(torch.Size(s).numel() * (2 if d == "bfloat16" else 4) for _, s, d in spec)
    root = Path(args.root) if args.root else out_dir() / "torch_dist"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    results: dict[str, list[float]] = {}
    cold = True
    print(f"W1: {len(spec)} tensors, {nbytes / 2**30:.2f} GiB; {args.repeats} repeats; load {load_average()}")
    mp.start_processes(two_ranks, args=(_port(), str(root), spec, args.repeats, "2to2", q), nprocs=2, start_method="spawn")
    r, c = q.get()
    results.update(r)
    cold &= c
    p = ctx.Process(target=one_rank, args=(str(root), spec, args.repeats, args.repeats - 1, q))
    p.start()
    r, c = q.get()
    p.join()
    results.update(r)
    cold &= c
    mp.start_processes(two_ranks, args=(_port(), str(root), spec, args.repeats, "1to2", q), nprocs=2, start_method="spawn")
    r, c = q.get()
    results.update(r)
    cold &= c
    rows = []
    summary = {}
    for op in ("save 2 ranks", "load 2 -> 2", "save 1 rank", "load 2 -> 1", "load 1 -> 2"):
        x, d = median(results[f"{op}/xckpt"]), median(results[f"{op}/dcp"])
        summary[op] = {"xckpt_s": x, "dcp_s": d, "ratio": d / x, "all": {k: results[f"{op}/{k}"] for k in ("xckpt", "dcp")}}
        rows.append([op, f"{x:.2f}", f"{d:.2f}", f"{nbytes / x / 1e9:.2f}", f"{nbytes / d / 1e9:.2f}", f"{d / x:.2f}x"])
    print(f"loads: {'cold (page cache dropped)' if cold else 'WARM (could not drop the page cache)'}")
    print(markdown_table(["op", "xckpt s", "DCP s", "xckpt GB/s", "DCP GB/s", "DCP/xckpt"], rows))
    (out_dir() / "torch_dist.json").write_text(
        json.dumps({"size_gib": nbytes / 2**30, "repeats": args.repeats, "cold_loads": cold, "results": summary}, indent=1)
    )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
