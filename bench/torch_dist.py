"""xckpt.torch against torch DCP on real gloo ranks: save, load, and resharding loads.

The state dict is W1 (``bench/_common.py``: a small LLM's matrices, mixed float32
and bfloat16, about ``--size-gib`` GiB) as DTensors ``Shard(0)`` on a 2-rank mesh.
Measured, each a median over ``--repeats``:

- save 2 ranks     xckpt.torch.save vs dcp.save of the same DTensor state dict
- load 2 -> 2      into DTensors of the same layout
- save 1 rank      the whole state dict as plain tensors, one process
- load 2 -> 1      a 2-rank checkpoint into whole tensors, one process, no process group
- load 1 -> 2      a 1-rank checkpoint into Shard(0) DTensors on 2 ranks

Every load is measured twice (``--temps``): **cold**, after ``sync`` and dropping
the page cache (``/proc/sys/vm/drop_caches``, root only; otherwise the table says
the loads are not cold), then **warm**, the same load again with the page cache
kept. The ranks are long-lived processes (one group for 2 -> 2, one process for
2 -> 1, one group for 1 -> 2) that save and load both systems in turn; DCP and
xckpt are imported before any timed region. Both libraries run with their
defaults (DCP: FileSystemWriter/Reader, one file per rank, one thread). A timed
region is barrier to barrier, timed on rank 0. Every load is checked bit for bit
outside the timed region.

CPU: every rank's user + system seconds (all its threads, ``getrusage``) over the
timed region, summed over the ranks: on a shared machine wall times are noisy, CPU
seconds much less so.

Memory: the peak-RSS mark of every rank is reset just before each timed region
(``/proc/self/clear_refs``); the table shows the largest rank's peak RSS during the
step, and its growth over the RSS at the step's start as a multiple of the bytes
that rank saves or loads. Load targets are zero-filled (resident, as a model's
parameters are) before the load, so a load's growth is memory beyond its
destination: 0 is ideal, issue 16's "peak at most 1.15x the bytes loaded" is a
growth of at most 0.15x here.

Ratios are DCP time / xckpt time (above 1: xckpt is faster). Verdict lines check
issue 16's targets: save at 2 ranks, load 2 -> 1 and load 1 -> 2 at least 2x DCP
(each load cold and warm).

Usage, from the repository root::

    .venv/bin/python bench/torch_dist.py                  # W1 (~1 GiB), 3 repeats, cold + warm
    .venv/bin/python bench/torch_dist.py --size-gib 0.1 --repeats 1   # a quick run
    .venv/bin/python bench/torch_dist.py --temps warm

Results: a markdown table on stdout and ``bench/out/torch_dist.json``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import queue
import resource
import shutil
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    current_rss_mib,
    drop_caches,
    load_average,
    markdown_table,
    median,
    out_dir,
    peak_rss_mib,
    reset_peak_rss,
    spec_bytes,
    workload_spec,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SYSTEMS = ("xckpt", "dcp")
OPS = ("save 2 ranks", "load 2 -> 2", "save 1 rank", "load 2 -> 1", "load 1 -> 2")
TARGETS = ("save 2 ranks", "load 2 -> 1", "load 1 -> 2")  # issue 16: at least 2x DCP


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
        sd[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                      stride=stride)
    return sd


def _check_sharded(spec: list, sd: dict[str, Any], rank: int, what: str) -> None:
    for i, (name, shape, dtype) in enumerate(spec):
        if not bit_equal(sd[name].to_local(), shard_data(i, shape, dtype, rank, 2)):
            raise SystemExit(f"{what}: {name} differs on rank {rank}")


class Recorder:
    """Times steps (rank 0's clock) and every rank's peak RSS; collects them by key."""

    def __init__(self, rank: int, group: bool) -> None:
        self.rank, self.group = rank, group
        self.times: dict[str, list[float]] = {}
        self.mem: dict[str, list[tuple[float, float]]] = {}  # key -> [(peak MiB, growth MiB)]
        self.cpu: dict[str, list[float]] = {}  # key -> [user + system seconds of this rank]
        self.cold = True

    def temp(self, temp: str) -> None:
        """Before a load: drop the page cache for a cold one (rank 0), then line up."""
        if temp == "cold":
            ok = drop_caches() if self.rank == 0 else True
            self.cold &= ok
        if self.group:
            dist.barrier()

    def run(self, key: str, fn: Any) -> None:
        gc.collect()
        if self.group:
            dist.barrier()
        reset_peak_rss()
        before = current_rss_mib()
        c0 = _cpu_seconds()
        t0 = time.perf_counter()
        fn()
        if self.group:
            dist.barrier()
        seconds = time.perf_counter() - t0
        self.cpu.setdefault(key, []).append(_cpu_seconds() - c0)
        peak = peak_rss_mib()
        self.times.setdefault(key, []).append(seconds)
        self.mem.setdefault(key, []).append((peak, peak - before))

    def result(self) -> dict[str, Any]:
        return {"rank": self.rank, "times": self.times, "mem": self.mem, "cpu": self.cpu, "cold": self.cold}


def _cpu_seconds() -> float:
    """User + system seconds of this process, all threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _saver(sys_: str, sd: Any, path: str, no_dist: bool = False) -> Any:
    import torch.distributed.checkpoint as dcp

    import xckpt.torch as xt

    if sys_ == "xckpt":
        return lambda: xt.save(sd, path)
    return lambda: dcp.save(sd, checkpoint_id=path, no_dist=no_dist)


def _loader(sys_: str, target: Any, path: str, no_dist: bool = False) -> Any:
    import torch.distributed.checkpoint as dcp

    import xckpt.torch as xt

    if sys_ == "xckpt":
        return lambda: xt.load(path, target)
    return lambda: dcp.load(target, checkpoint_id=path, no_dist=no_dist)


def two_ranks(rank: int, port: int, root: str, spec: list, repeats: int, temps: list[str], phase: str,
              out: Any) -> None:
    """2 -> 2 (saves at 2 ranks, loads into the same layout) or 1 -> 2 on a 2-rank gloo group."""
    import torch.distributed.checkpoint  # noqa: F401  (imported before any timed region)
    from torch.distributed.device_mesh import init_device_mesh

    import xckpt.torch  # noqa: F401

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(minutes=30),
    )
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,))
    rec = Recorder(rank, group=True)
    op = "load 2 -> 2" if phase == "2to2" else "load 1 -> 2"
    for r in range(repeats):
        if phase == "2to2":
            sd = _sharded(spec, mesh, rank, fill=False)
            for sys_ in SYSTEMS:
                path = os.path.join(root, f"{sys_}2_{r}")
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
                rec.run(f"save 2 ranks/{sys_}", _saver(sys_, sd, path))
            del sd
        for sys_ in SYSTEMS:
            path = os.path.join(root, f"{sys_}2_{r}" if phase == "2to2" else f"{sys_}1")
            for temp in temps:
                tgt = _sharded(spec, mesh, rank, fill=True)
                rec.temp(temp)
                rec.run(f"{op}/{sys_}/{temp}", _loader(sys_, tgt, path))
                _check_sharded(spec, tgt, rank, f"{sys_} {op} ({temp})")
                del tgt
        dist.barrier()
        if phase == "2to2" and rank == 0 and r < repeats - 1:
            for sys_ in SYSTEMS:
                shutil.rmtree(os.path.join(root, f"{sys_}2_{r}"))
    out.put(rec.result())
    dist.destroy_process_group()


def one_rank(root: str, spec: list, repeats: int, temps: list[str], last: int, out: Any) -> None:
    """No process group: save whole tensors at 1 rank; load 2 -> 1."""
    import torch.distributed.checkpoint  # noqa: F401

    import xckpt.torch  # noqa: F401

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist=True is meant
    full = {name: full_data(i, shape, dtype) for i, (name, shape, dtype) in enumerate(spec)}
    rec = Recorder(0, group=False)
    for _ in range(repeats):
        for sys_ in SYSTEMS:
            path = os.path.join(root, f"{sys_}1")
            shutil.rmtree(path, ignore_errors=True)
            rec.run(f"save 1 rank/{sys_}", _saver(sys_, full, path, no_dist=True))
        for sys_ in SYSTEMS:
            path = os.path.join(root, f"{sys_}2_{last}")
            for temp in temps:
                tgt = {n: torch.zeros_like(t) for n, t in full.items()}
                rec.temp(temp)
                rec.run(f"load 2 -> 1/{sys_}/{temp}", _loader(sys_, tgt, path, no_dist=True))
                for n in full:
                    if not bit_equal(tgt[n], full[n]):
                        raise SystemExit(f"{sys_} load 2 -> 1 ({temp}): {n} differs")
                del tgt
    out.put(rec.result())


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collect(q: Any, n: int, failed: Any, times: dict[str, list[float]],
             mem: dict[str, list[tuple[float, float]]], cpu: dict[str, list[float]], cold: list[bool]) -> None:
    """Merge ``n`` ranks' results: rank 0's times, every rank's memory (largest rank per run),
    CPU seconds summed over the ranks per run.

    ``failed()`` is polled while waiting: it raises (or returns True) once a rank has died.
    """
    parts = []
    while len(parts) < n:
        try:
            parts.append(q.get(timeout=2))
        except queue.Empty:
            if failed():
                raise SystemExit("a benchmark rank died (its traceback is above)") from None
    parts.sort(key=lambda x: x["rank"])
    times.update(parts[0]["times"])
    for key in parts[0]["mem"]:
        per_run = zip(*(p["mem"][key] for p in parts))
        mem[key] = [(max(x[0] for x in run), max(x[1] for x in run)) for run in per_run]
        cpu[key] = [sum(run) for run in zip(*(p["cpu"][key] for p in parts))]
    cold.extend(p["cold"] for p in parts)


def _group(fn_args: tuple, q: Any, times: dict, mem: dict, cpu: dict, cold: list[bool]) -> None:
    """Run ``two_ranks`` on 2 spawned processes, collect their results, join them."""
    pc = mp.start_processes(two_ranks, args=fn_args, nprocs=2, start_method="spawn", join=False)
    _collect(q, 2, lambda: pc.join(timeout=0), times, mem, cpu, cold)
    while not pc.join():
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0, help="W1 size in GiB (default 1.0)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each step (default 3); medians reported")
    ap.add_argument("--temps", default="cold,warm", help="loads: cold, warm or cold,warm (default)")
    ap.add_argument("--root", default=None, help="where checkpoints go (default bench/out/torch_dist)")
    ap.add_argument("--json", help="where to write the results (default bench/out/torch_dist.json)")
    args = ap.parse_args()
    temps = [t for t in ("cold", "warm") if t in args.temps.split(",")]
    if not temps or set(args.temps.split(",")) - {"cold", "warm"}:
        raise SystemExit(f"--temps takes cold, warm or cold,warm, not {args.temps!r}")
    spec = workload_spec("W1", args.size_gib)
    nbytes = spec_bytes(spec)
    root = Path(args.root) if args.root else out_dir() / "torch_dist"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"# bench/torch_dist.py  {started:%Y-%m-%d %H:%M} UTC  cpus {os.cpu_count()}  W1: {len(spec)} "
          f"tensors, {nbytes / 1e9:.3f} GB; {args.repeats} repeats; loads {','.join(temps)}; "
          f"load avg {load_average()}", flush=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    times: dict[str, list[float]] = {}
    mem: dict[str, list[tuple[float, float]]] = {}
    cpu: dict[str, list[float]] = {}
    cold: list[bool] = []
    _group((_port(), str(root), spec, args.repeats, temps, "2to2", q), q, times, mem, cpu, cold)
    print(f"  2 -> 2 done (load avg {load_average()})", flush=True)
    p = ctx.Process(target=one_rank, args=(str(root), spec, args.repeats, temps, args.repeats - 1, q))
    p.start()
    _collect(q, 1, lambda: p.exitcode is not None, times, mem, cpu, cold)
    p.join()
    print(f"  1 rank, 2 -> 1 done (load avg {load_average()})", flush=True)
    _group((_port(), str(root), spec, args.repeats, temps, "1to2", q), q, times, mem, cpu, cold)
    print(f"  1 -> 2 done (load avg {load_average()})", flush=True)

    rows, summary = [], {}
    for op in OPS:
        per_rank = nbytes if op in ("save 1 rank", "load 2 -> 1") else nbytes / 2
        for temp in ([None] if op.startswith("save") else temps):
            key = {s: f"{op}/{s}" + (f"/{temp}" if temp else "") for s in SYSTEMS}
            x, d = median(times[key["xckpt"]]), median(times[key["dcp"]])
            m = {s: (median([a for a, _ in mem[key[s]]]),
                     max(0.0, median([g for _, g in mem[key[s]]])) * (1 << 20) / per_rank) for s in SYSTEMS}
            name = op + (f", {temp}" if temp else "")
            c = {s: median(cpu[key[s]]) for s in SYSTEMS}
            summary[name] = {"xckpt_s": x, "dcp_s": d, "ratio": d / x,
                             "runs": {s: times[key[s]] for s in SYSTEMS},
                             "cpu_s": c, "cpu_runs": {s: cpu[key[s]] for s in SYSTEMS},
                             "peak_rss_mib": {s: m[s][0] for s in SYSTEMS},
                             "peak_growth_x": {s: m[s][1] for s in SYSTEMS}}
            rows.append([name, x, d, nbytes / x / 1e9, nbytes / d / 1e9, f"{d / x:.2f}x", c["xckpt"], c["dcp"],
                         m["xckpt"][0], m["dcp"][0], m["xckpt"][1], m["dcp"][1]])
    all_cold = all(cold)
    note = "" if all_cold or "cold" not in temps else "; COLD LOADS ARE NOT COLD (page cache not dropped)"
    print(f"\n### W1 ({nbytes / 1e9:.3f} GB) as Shard(0) DTensors, 2 gloo ranks: xckpt.torch against DCP, "
          f"medians of {args.repeats}; peak RSS of the largest rank, growth as a multiple of the bytes that "
          f"rank saves or loads (targets resident: 0 is ideal); CPU s: user + system, summed over the "
          f"ranks{note}\n")
    print(markdown_table(["op", "xckpt s", "DCP s", "xckpt GB/s", "DCP GB/s", "DCP/xckpt", "xckpt CPU s",
                          "DCP CPU s", "xckpt peak RSS MiB", "DCP peak RSS MiB", "xckpt peak growth x",
                          "DCP peak growth x"], rows))
    verdicts = []
    for op in TARGETS:
        names = [n for n in summary if n == op or n.startswith(op + ",")]
        ratios = {(n.split(", ")[1] if ", " in n else "time"): summary[n]["ratio"] for n in names}
        ok = all(r >= 2 for r in ratios.values())
        detail = ", ".join(f"{k} {r:.2f}x" for k, r in ratios.items())
        verdicts.append(f"{op} >= 2x DCP: {'PASS' if ok else 'FAIL'} ({detail})")
    print()
    for line in verdicts:
        print(line)
    dest = Path(args.json) if args.json else out_dir() / "torch_dist.json"
    dest.write_text(json.dumps({
        "started": started.isoformat(), "load_avg_end": load_average(), "cpus": os.cpu_count(),
        "bytes": nbytes, "size_gib": args.size_gib, "repeats": args.repeats, "temps": temps,
        "cold_loads_cold": all_cold, "results": summary, "verdicts": verdicts,
    }, indent=1))
    print(f"\nwrote {dest}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
