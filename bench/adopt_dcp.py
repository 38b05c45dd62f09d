"""torch DCP through xckpt's storage layer against DCP's own FileSystemWriter / FileSystemReader.

The same FSDP2 state at 4 gloo ranks: an MLP of ``--layers`` Linear(``--width``, ``--width``)
layers (float32) and its Adam state after one real step (``get_state_dict``: weights,
``exp_avg``, ``exp_avg_sq``, ``step``, param groups), about ``3 * layers * width**2 * 4`` bytes.
Each side (``dcp``: ``FileSystemWriter`` / ``FileSystemReader`` with their defaults;
``xckpt``: ``XckptStorageWriter`` / ``XckptStorageReader``) runs in a fresh process that
starts its own 4 ranks, and measures, barrier to barrier on rank 0:

- save        ``dcp.save(state, storage_writer=...)``
- load        ``dcp.load(fresh, storage_reader=...)`` into a fresh model's ``get_state_dict``
              (targets resident, as a model's parameters are); warm page cache
- async stall how long ``dcp.async_save(state, storage_writer=...)`` blocks the caller
              (DCP's default stager copies the state to host memory); the slowest rank
- CPU         user + system seconds of the save and of the load (all threads), summed
              over the ranks: steadier than wall time on a busy machine
- load peak   the largest rank's peak RSS during the load (``/proc/self/clear_refs`` reset
              before it), and its growth over the RSS at the load's start

Every load is checked bit for bit against the saved state outside the timed region.
Medians of ``--repeats`` runs, each side in a fresh process per run, sides alternating.
Ratios are xckpt / DCP (at most 1.0 meets issue 29's targets for time and stall;
peak RSS at most 1.1).

Usage, from the repository root::

    .venv/bin/python bench/adopt_dcp.py                 # 3 repeats, 16 x 1024^2 layers (~200 MiB)
    .venv/bin/python bench/adopt_dcp.py --repeats 1 --layers 4

Results: a markdown table on stdout and ``bench/out/adopt_dcp.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    cpu_seconds,
    current_rss_mib,
    emit,
    load_average,
    markdown_table,
    median,
    out_dir,
    peak_rss_mib,
    remove,
    reset_peak_rss,
    run_child,
)

WORLD = 4
SIDES = ("dcp", "xckpt")


def _model(width: int, layers: int, seed: int) -> Any:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    m = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in m:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _state(width: int, layers: int, seed: int, step: bool) -> tuple[Any, dict[str, Any]]:
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m = _model(width, layers, seed)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    if step:
        g = torch.Generator().manual_seed(seed)
        m(torch.randn(4, width, generator=g)).square().mean().backward()
        opt.step()
    msd, osd = get_state_dict(m, opt)
    return (m, opt), {"model": msd, "optim": osd}


def _locals(sd: Any, prefix: str = "") -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(_locals(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v.to_local() if isinstance(v, DTensor) else v
    return out


def _writer(side: str, path: str) -> Any:
    import torch.distributed.checkpoint as dcp

    import xckpt.torch as xt

    return xt.XckptStorageWriter(path) if side == "xckpt" else dcp.FileSystemWriter(path)


def _reader(side: str, path: str) -> Any:
    import torch.distributed.checkpoint as dcp

    import xckpt.torch as xt

    return xt.XckptStorageReader(path) if side == "xckpt" else dcp.FileSystemReader(path)


def _rank(rank: int, port: int, side: str, root: str, width: int, layers: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import xckpt.torch  # noqa: F401  (imported before any timed region, as DCP is)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        _, state = _state(width, layers, 0, step=True)
        res: dict[str, float] = {}

        dist.barrier()
        t0, c0 = time.perf_counter(), cpu_seconds()
        dcp.save(state, storage_writer=_writer(side, f"{root}/save"))
        res["save_cpu_s"] = cpu_seconds() - c0
        dist.barrier()
        res["save_s"] = time.perf_counter() - t0

        _, fresh = _state(width, layers, 1, step=False)
        for t in _locals(fresh).values():
            t.zero_()  # resident, as a model's parameters are
        dist.barrier()
        rss0 = current_rss_mib()
        reset_peak_rss()
        t0, c0 = time.perf_counter(), cpu_seconds()
        reader = _reader(side, f"{root}/save")  # (xckpt opens the checkpoint here: timed)
        dcp.load(fresh, storage_reader=reader)
        res["load_cpu_s"] = cpu_seconds() - c0
        dist.barrier()
        res["load_s"] = time.perf_counter() - t0
        res["load_peak_mib"] = peak_rss_mib()
        res["load_growth_mib"] = res["load_peak_mib"] - rss0
        want, got = _locals(state), _locals(fresh)
        bad = [k for k in want if not torch.equal(want[k], got[k])]
        if bad or set(want) != set(got):
            raise SystemExit(f"rank {rank}: {side} loaded other values for {bad[:5]}")

        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=_writer(side, f"{root}/async"))
        res["stall_s"] = time.perf_counter() - t0
        fut.result()
        dist.barrier()
        out.put((rank, res))
    finally:
        dist.destroy_process_group()


def child(side: str, root: str, width: int, layers: int) -> None:
    """One side's measurement in this fresh process: 4 spawned ranks."""
    remove(root)
    os.makedirs(root)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, side, root, width, layers, q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    remove(root)
    emit({
        "save_s": results[0]["save_s"],
        "load_s": results[0]["load_s"],
        "stall_s": max(r["stall_s"] for r in results.values()),
        "load_peak_mib": max(r["load_peak_mib"] for r in results.values()),
        "load_growth_mib": max(r["load_growth_mib"] for r in results.values()),
        "save_cpu_s": sum(r["save_cpu_s"] for r in results.values()),
        "load_cpu_s": sum(r["load_cpu_s"] for r in results.values()),
    })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--child", choices=SIDES)
    ap.add_argument("--root")
    a = ap.parse_args()
    if a.child:
        child(a.child, a.root, a.width, a.layers)
        return
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in SIDES}
    for i in range(a.repeats):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            root = str(out_dir() / f"adopt_dcp_{side}")
            args = ["--child", side, "--root", root, "--width", str(a.width), "--layers", str(a.layers)]
            r = run_child(__file__, args)
            print(f"run {i + 1} {side}: {json.dumps(r)}", file=sys.stderr)
            runs[side].append(r)
    med = {s: {k: median([r[k] for r in runs[s]]) for k in runs[s][0]} for s in SIDES}
    state_mib = 3 * a.layers * (a.width * a.width + a.width) * 4 / (1 << 20)
    rows = []
    for key, label, target in (
        ("save_s", "dcp.save (s)", 1.0),
        ("load_s", "dcp.load, warm (s)", 1.0),
        ("stall_s", "dcp.async_save stall (s)", 1.0),
        ("load_peak_mib", "load peak RSS, largest rank (MiB)", 1.1),
    ):
        d, x = med["dcp"][key], med["xckpt"][key]
        rows.append([label, d, x, x / d, f"<= {target}", "met" if x / d <= target else "MISSED"])
    for key, label in (("save_cpu_s", "save CPU, 4 ranks (s)"), ("load_cpu_s", "load CPU, 4 ranks (s)")):
        d, x = med["dcp"][key], med["xckpt"][key]
        rows.append([label, d, x, x / d, "", ""])
    rows.append(["load RSS growth, largest rank (MiB)", med["dcp"]["load_growth_mib"],
                 med["xckpt"]["load_growth_mib"], float("nan"), "", ""])
    table = markdown_table(["measure", "DCP FileSystem", "xckpt storage layer", "xckpt / DCP", "target", ""], rows)
    print(f"FSDP2 + Adam state of {state_mib:.0f} MiB at {WORLD} gloo ranks; medians of {a.repeats}; "
          f"load average {load_average()}\n")
    print(table)
    with open(out_dir() / "adopt_dcp.json", "w") as f:
        json.dump({"runs": runs, "medians": med, "state_mib": state_mib, "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
