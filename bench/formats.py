"""Foreign-format load benchmark: xckpt's readers against the routes people use today.

Three cases, one table (issue 11):

- **(a) DCP -> JAX**: a torch DCP checkpoint saved by 2 gloo ranks (the W1
  matrices of ``bench/io.py``, float32 and bfloat16, each a DTensor with
  ``Shard(0)`` on a 2-rank mesh) loaded onto 8 CPU devices (dim 0 split 8 ways,
  ``P("x")``): ``xckpt.jax.load(dcp_dir, {name: NamedSharding})`` against today's
  route, ``dcp_to_torch_save`` to a file, ``torch.load`` of it, then
  ``jax.device_put`` of every tensor onto the same sharding (the converted file
  is written next to the checkpoint and its write is timed: it is part of the route).
- **(b) DCP -> torch, 1 rank**: the same checkpoint into plain preallocated
  tensors: ``xckpt.torch.load`` against ``torch.distributed.checkpoint.load``
  with ``no_dist=True``. The targets are zero-filled (resident) before timing, so
  the RSS growth is what the loader needs beyond its destination.
- **(c) Hugging Face directory -> JAX**: the same tensors written as a sharded
  safetensors directory (``safetensors.torch.save_file`` shards of about a
  quarter of the data each, plus ``model.safetensors.index.json``) loaded onto 8
  CPU devices with ``P("x")``: ``xckpt.jax.load`` against orbax's safetensors
  loader (orbax-checkpoint's v1 API, ``ocp.load`` in a ``Context`` with
  ``checkpoint_layout=SAFETENSORS``, given the same abstract tree).

Every load runs in a fresh subprocess. **cold**: the page cache is dropped first
(``/proc/sys/vm/drop_caches`` when root, else ``posix_fadvise(DONTNEED)`` on every
file of the checkpoint); **warm**: every file of the checkpoint is read once
first. Measured in the child, around the load call only (imports and targets
are prepared before it; ``block_until_ready`` is inside):

- time: wall seconds; the table shows the median of ``--repeats`` runs;
- peak RSS growth: the kernel's peak-RSS mark (``VmHWM``) is reset just before
  the load (``/proc/self/clear_refs`` 5), so growth = peak during the load minus
  the RSS at its start (``ru_maxrss`` minus that RSS where the reset is refused);
  the table shows the largest of the runs;
- bytes read: xckpt's own counter (``Source.bytes_read``: tensor bytes read
  from the checkpoint's files); for the other loaders ``/proc/self/io`` ``rchar``
  (bytes through read syscalls, all files: today's route also reads back the file
  it converted to); "disk" is ``read_bytes`` (what the block layer fetched; near
  zero when warm).

Each load is checked outside the timed region: every tensor's CRC-32 against
the one recorded when the data was generated, and every JAX array's sharding.

Usage, from the repository root::

    .venv/bin/python bench/formats.py                 # ~1 GiB, 3 cold + 3 warm runs per loader
    .venv/bin/python bench/formats.py --quick         # 64 MiB, 1 run each (checks the script)
    .venv/bin/python bench/formats.py --size 0.25 --cases a --temps cold
    .venv/bin/python bench/formats.py --profile a:xckpt   # cProfile of one load (warm)

Results: a markdown table on stdout, target verdicts, and ``bench/out/formats.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import importlib.util
import io as _stdio
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    current_rss_mib,
    dd_ceiling,
    drop_caches,
    emit,
    load_average,
    markdown_table,
    median,
    out_dir,
    peak_rss_mib,
    remove,
    run_child,
)

GIB = 1 << 30
CASES = {
    "a": ("DCP (2 ranks) -> JAX, 8 devices", ("xckpt", "today")),
    "b": ("DCP (2 ranks) -> torch, 1 rank", ("xckpt", "dcp.load")),
    "c": ("HF safetensors dir -> JAX, 8 devices", ("xckpt", "orbax")),
}
LABELS = {
    ("a", "xckpt"): "xckpt.jax.load",
    ("a", "today"): "dcp_to_torch_save + torch.load + device_put",
    ("b", "xckpt"): "xckpt.torch.load",
    ("b", "dcp.load"): "dcp.load(no_dist=True)",
    ("c", "xckpt"): "xckpt.jax.load",
    ("c", "orbax"): "orbax v1 ocp.load (SAFETENSORS layout)",
}
HF_SHARDS = 4


def _io_module() -> Any:
    """bench/io.py (its name shadows the stdlib ``io``, so load it by path): the W1 workload."""
    spec = importlib.util.spec_from_file_location("bench_io", Path(__file__).with_name("io.py"))
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def workload(bio: Any, size: float) -> list[tuple[str, tuple[int, ...], str]]:
    """W1 of ``bench/io.py`` from 0.5 GiB up; below, the same layer structure at hidden size
    512 (vocab 8000), so ``--quick`` stays small. Dim 0 of every tensor splits 16 ways."""
    if size >= 0.5:
        return bio.workload_spec("W1", size)
    return bio.workload_spec("W1", size, dims=(512, 1408, 8000))


def crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


# ---------------------------------------------------------------------------
# Setup children: write the checkpoints


def child_save_dcp(rank: int, world: int, port: int, path: str, size: float) -> dict[str, Any]:
    """One rank of the DCP save (gloo, 2 ranks): every W1 tensor a DTensor with Shard(0)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import datetime as dt

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    bio = _io_module()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=dt.timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    spec = workload(bio, size)
    sd, crcs = {}, {}
    for i, (name, shape, dtype) in enumerate(spec):
        full = bio.make_array(i, shape, dtype)
        if rank == 0:
            crcs[name] = crc(full)
        rows = shape[0] // world
        if rows * world != shape[0]:
            raise SystemExit(f"{name}: dim 0 ({shape[0]}) does not split over {world} ranks")
        local = bio.to_torch(np.ascontiguousarray(full[rank * rows : (rank + 1) * rows]))
        sd[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        del full
    t0 = time.perf_counter()
    dcp.save(sd, checkpoint_id=path)
    dist.barrier()
    dist.destroy_process_group()
    del torch
    return {"save_s": time.perf_counter() - t0, "crcs": crcs, "bytes": bio.spec_bytes(spec)}


def save_dcp(path: Path, size: float) -> dict[str, Any]:
    """Run the 2-rank DCP save as two fresh processes; rank 0's result."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", "save-dcp", "--rank", str(r), "--port", str(port),
             "--path", str(path), "--size", str(size)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"DCP save rank failed (rc {p.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def child_save_hf(path: str, size: float) -> dict[str, Any]:
    """A Hugging Face style directory: HF_SHARDS safetensors shards and the index."""
    import safetensors.torch

    bio = _io_module()
    spec = workload(bio, size)
    total = bio.spec_bytes(spec)
    per = total / HF_SHARDS
    groups: list[list[int]] = [[]]
    acc = 0
    for i, (_, shape, dtype) in enumerate(spec):
        nb = int(np.prod(shape)) * bio.np_dtype(dtype).itemsize
        if groups[-1] and acc + nb > per and len(groups) < HF_SHARDS:
            groups.append([])
            acc = 0
        groups[-1].append(i)
        acc += nb
    os.makedirs(path)
    weight_map, crcs = {}, {}
    t0 = time.perf_counter()
    for g, idx in enumerate(groups):
        fname = f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for i in idx:
            name, shape, dtype = spec[i]
            a = bio.make_array(i, shape, dtype)
            crcs[name] = crc(a)
            tensors[name] = bio.to_torch(a)
            weight_map[name] = fname
        safetensors.torch.save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return {"save_s": time.perf_counter() - t0, "crcs": crcs, "bytes": total, "shards": len(groups)}


# ---------------------------------------------------------------------------
# Load children


def _proc_io() -> dict[str, int]:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k.strip()] = int(v)
    return out


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _vm_hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return peak_rss_mib()


def _setup_jax() -> Any:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if len(jax.devices()) != 8:
        raise SystemExit(f"expected 8 CPU devices, got {len(jax.devices())}")
    return jax


def _torch_to_numpy(t: Any) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


class Load:
    """One loader: ``prepare`` (untimed), ``run`` (timed), ``check`` (untimed)."""

    bytes_counter: Any = None  # a callable giving the loader's own bytes-read counter

    def __init__(self, case: str, system: str, path: str, work: str, size: float) -> None:
        self.case, self.system, self.path, self.work = case, system, path, work
        self.bio = _io_module()
        self.spec = workload(self.bio, size)
        self.jax = _setup_jax() if case in ("a", "c") else None
        if self.jax is not None:
            from jax.sharding import NamedSharding
            from jax.sharding import PartitionSpec as P

            mesh = self.jax.make_mesh((8,), ("x",))
            self.sharding = NamedSharding(mesh, P("x"))
        import xckpt
        import xckpt.converters.safetensors
        import xckpt.converters.torch_dcp  # noqa: F401  (imported untimed, like every framework here)

        self.xckpt = xckpt
        fn = getattr(self, f"_prepare_{case}_{system.replace('.', '_')}")
        self.run = fn()

    # (a) DCP -> JAX
    def _xckpt_jax_load(self, target: Any) -> Any:
        """The timed step of an xckpt.jax.load of the checkpoint into ``target`` (bytes counted)."""
        import xckpt.jax

        def run() -> Any:
            src = self.xckpt.open(self.path)
            self.bytes_counter = lambda: src.bytes_read
            out = xckpt.jax.load(src, target)
            self.jax.block_until_ready(out)
            return out

        return run

    def _prepare_a_xckpt(self) -> Any:
        return self._xckpt_jax_load({n: self.sharding for n, _, _ in self.spec})

    def _prepare_a_today(self) -> Any:
        import torch
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        converted = os.path.join(self.work, f"converted-{os.getpid()}.pt")
        self.cleanup = converted
        jax = self.jax

        def run() -> Any:
            dcp_to_torch_save(self.path, converted)
            sd = torch.load(converted, weights_only=True)
            out = {k: jax.device_put(_torch_to_numpy(v), self.sharding) for k, v in sd.items()}
            jax.block_until_ready(out)
            return out

        return run

    # (b) DCP -> torch at 1 rank
    def _torch_targets(self) -> dict[str, Any]:
        import torch

        return {n: torch.zeros(s, dtype=getattr(torch, d)) for n, s, d in self.spec}

    def _prepare_b_xckpt(self) -> Any:
        import torch.distributed.tensor  # noqa: F401  (xckpt imports it on first use; dcp.load's import has it)

        import xckpt.torch

        sd = self._torch_targets()

        def run() -> Any:
            src = self.xckpt.open(self.path)
            self.bytes_counter = lambda: src.bytes_read
            xckpt.torch.load(src, sd)
            return sd

        return run

    def _prepare_b_dcp_load(self) -> Any:
        import torch.distributed.checkpoint as dcp

        sd = self._torch_targets()

        def run() -> Any:
            dcp.load(sd, checkpoint_id=self.path, no_dist=True)
            return sd

        return run

    # (c) HF directory -> JAX
    def _abstract(self) -> dict[str, Any]:
        return {
            n: self.jax.ShapeDtypeStruct(s, self.bio.np_dtype(d), sharding=self.sharding) for n, s, d in self.spec
        }

    def _prepare_c_xckpt(self) -> Any:
        return self._xckpt_jax_load(self._abstract())

    def _prepare_c_orbax(self) -> Any:
        import logging

        import orbax.checkpoint.experimental.v1 as ocp

        logging.getLogger("absl").setLevel(logging.ERROR)  # Context(...) keyword deprecation notice
        target = self._abstract()
        ctx = ocp.Context(checkpoint_layout=ocp.options.CheckpointLayout.SAFETENSORS)

        def run() -> Any:
            with ctx:
                out = ocp.load(self.path, target)
            self.jax.block_until_ready(out)
            return out

        return run

    def check(self, out: dict[str, Any], crcs: dict[str, int]) -> None:
        """Every tensor's CRC-32 (and JAX sharding) against the saved data."""
        if sorted(out) != sorted(crcs):
            raise SystemExit(f"{self.case}/{self.system}: loaded {len(out)} tensors, saved {len(crcs)}")
        for n, want in crcs.items():
            x = out[n]
            if self.jax is not None:
                if x.sharding != self.sharding:
                    raise SystemExit(f"{self.case}/{self.system}: {n} has sharding {x.sharding}")
                a = np.asarray(x)
            else:
                a = _torch_to_numpy(x)
            if crc(a) != want:
                raise SystemExit(f"{self.case}/{self.system}: tensor {n!r} differs from the saved data")


def child_load(args: argparse.Namespace) -> dict[str, Any]:
    load = Load(args.case, args.system, args.path, args.work, args.size)
    crcs = json.loads(Path(args.crcs).read_text())
    gc.collect()
    rss0 = current_rss_mib()
    reset = _reset_peak()
    maxrss0 = peak_rss_mib()
    io0 = _proc_io()
    t0 = time.perf_counter()
    out = load.run()
    seconds = time.perf_counter() - t0
    io1 = _proc_io()
    peak = _vm_hwm_mib() if reset else peak_rss_mib()
    counter = load.bytes_counter() if load.bytes_counter is not None else None
    cleanup = getattr(load, "cleanup", None)
    if cleanup:
        os.unlink(cleanup)
    load.check(out, crcs)
    return {
        "seconds": seconds,
        "rss_before_mib": rss0,
        "peak_growth_mib": peak - rss0,
        "peak_reset": reset,
        "maxrss_before_mib": maxrss0,
        "bytes_counter": counter,
        "rchar": io1["rchar"] - io0["rchar"],
        "read_bytes": io1["read_bytes"] - io0["read_bytes"],
        "verified": True,
    }


def child_profile(args: argparse.Namespace) -> dict[str, Any]:
    load = Load(args.case, args.system, args.path, args.work, args.size)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    load.run()
    prof.disable()
    seconds = time.perf_counter() - t0
    cleanup = getattr(load, "cleanup", None)
    if cleanup:
        os.unlink(cleanup)
    buf = _stdio.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("cumulative").print_stats(35)
    st.sort_stats("tottime").print_stats(20)
    return {"seconds": seconds, "report": buf.getvalue()}


# ---------------------------------------------------------------------------
# Parent


def files_of(path: Path) -> list[Path]:
    return [Path(r) / f for r, _, fs in os.walk(path) for f in fs]


def make_cold(path: Path) -> str:
    """Drop the page cache (root) or advise the kernel to drop every file of ``path``."""
    if drop_caches():
        return "drop_caches"
    for p in files_of(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def make_warm(path: Path) -> None:
    """Read every file of ``path`` once, so it is in the page cache."""
    for p in files_of(path):
        with open(p, "rb") as f:
            while f.read(16 << 20):
                pass


def setup(root: Path, size: float, cases: list[str], reuse: bool = False) -> dict[str, Any]:
    """Write the checkpoints the cases need (or, with ``reuse``, keep those of an earlier run
    of the same size in ``root``); what was written, by checkpoint."""
    info: dict[str, Any] = {}
    script = Path(__file__).resolve()
    saved = root / "checkpoints.json"
    if reuse and saved.exists():
        old = json.loads(saved.read_text())
        if old.get("size") == size:
            info = {k: v for k, v in old["info"].items() if (root / k).is_dir()}
            for k in info:
                print(f"reusing {root / k} ({info[k]['bytes'] / GIB:.3f} GiB)")
    if ("a" in cases or "b" in cases) and "dcp" not in info:
        path = root / "dcp"
        remove(path)
        t0 = time.perf_counter()
        res = save_dcp(path, size)
        (root / "dcp.crc.json").write_text(json.dumps(res["crcs"]))
        info["dcp"] = {"bytes": res["bytes"], "save_s": res["save_s"], "files": len(files_of(path)),
                       "disk_bytes": sum(p.stat().st_size for p in files_of(path))}
        print(f"DCP checkpoint (2 gloo ranks): {res['bytes'] / GIB:.3f} GiB of tensors, "
              f"{info['dcp']['disk_bytes'] / GIB:.3f} GiB in {info['dcp']['files']} files, "
              f"written in {time.perf_counter() - t0:.1f} s", flush=True)
    if "c" in cases and "hf" not in info:
        path = root / "hf"
        remove(path)
        res = run_child(script, ["--child", "save-hf", "--path", str(path), "--size", str(size)])
        (root / "hf.crc.json").write_text(json.dumps(res["crcs"]))
        info["hf"] = {"bytes": res["bytes"], "save_s": res["save_s"], "shards": res["shards"],
                      "disk_bytes": sum(p.stat().st_size for p in files_of(path))}
        print(f"HF directory: {res['bytes'] / GIB:.3f} GiB in {res['shards']} safetensors shards + index, "
              f"written in {res['save_s']:.1f} s", flush=True)
    saved.write_text(json.dumps({"size": size, "info": info}))
    return info


def ckpt_of(case: str) -> str:
    return "hf" if case == "c" else "dcp"


def child_argv(case: str, system: str, root: Path, size: float) -> list[str]:
    ck = ckpt_of(case)
    return ["--case", case, "--system", system, "--path", str(root / ck), "--work", str(root),
            "--crcs", str(root / f"{ck}.crc.json"), "--size", str(size)]


def run_loads(args: argparse.Namespace, root: Path, cases: list[str], temps: list[str]) -> dict[str, Any]:
    script = Path(__file__).resolve()
    results: dict[str, Any] = {}
    cold_how = set()
    # Interleave the systems (x, y, x, y, ...) so a change in machine load hits both alike.
    for temp in temps:
        for case in cases:
            path = root / ckpt_of(case)
            for rep in range(args.repeats):
                for system in CASES[case][1]:
                    if temp == "cold":
                        cold_how.add(make_cold(path))
                    else:
                        make_warm(path)
                    t0 = time.perf_counter()
                    r = run_child(script, ["--child", "load", *child_argv(case, system, root, args.size)])
                    results.setdefault(f"{case}/{system}/{temp}", []).append(r)
                    print(f"  {case} {system:9s} {temp} run {rep + 1}: {r['seconds']:.2f} s, "
                          f"peak +{r['peak_growth_mib']:.0f} MiB (child {time.perf_counter() - t0:.0f} s), "
                          f"load avg {load_average()}", flush=True)
    results["_cold_how"] = sorted(cold_how)
    return results


def render(results: dict[str, Any], info: dict[str, Any], cases: list[str], temps: list[str]) -> tuple[str, list[str]]:
    headers = ["case", "loader", "cache", "time s (median)", "GB/s", "vs baseline", "peak RSS growth MiB",
               "RSS / GiB loaded", "bytes read GiB", "disk reads GiB"]
    rows, verdicts = [], []
    for case in cases:
        loaded = info[ckpt_of(case)]["bytes"]
        xs, base = CASES[case][1]
        for temp in temps:
            med = {s: median([r["seconds"] for r in results[f"{case}/{s}/{temp}"]]) for s in (xs, base)}
            for s in (xs, base):
                runs = results[f"{case}/{s}/{temp}"]
                peak = max(r["peak_growth_mib"] for r in runs)
                counter = runs[0]["bytes_counter"]
                read = counter if counter is not None else median([r["rchar"] for r in runs])
                rows.append([
                    f"({case}) {CASES[case][0]}",
                    LABELS[(case, s)] + ("" if counter is None else " (counter)"),
                    temp,
                    med[s],
                    loaded / med[s] / 1e9,
                    f"{med[base] / med[s]:.2f}x" if s == xs else "1x",
                    peak,
                    peak * (1 << 20) / loaded,
                    read / GIB,
                    median([r["read_bytes"] for r in runs]) / GIB,
                ])
            speed = med[base] / med[xs]
            xpeak = max(r["peak_growth_mib"] for r in results[f"{case}/{xs}/{temp}"]) * (1 << 20) / loaded
            if case == "a":
                ok = speed >= 3 and xpeak <= 1.3
                verdicts.append(f"(a) {temp}: DCP -> JAX >= 3x today's route ({speed:.2f}x) and peak RSS <= 1.3x "
                                f"bytes loaded ({xpeak:.2f}x): {'PASS' if ok else 'FAIL'}")
            elif case == "b":
                verdicts.append(f"(b) {temp}: DCP -> torch at least as fast as dcp.load ({speed:.2f}x): "
                                f"{'PASS' if speed >= 1 else 'FAIL'}")
            else:
                verdicts.append(f"(c) {temp}: HF -> JAX no slower than orbax ({speed:.2f}x): "
                                f"{'PASS' if speed >= 1 else 'FAIL'}")
    return markdown_table(headers, rows), verdicts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=1.0, help="GiB of tensors (default 1.0)")
    p.add_argument("--repeats", type=int, default=3, help="runs per loader and cache state; medians reported")
    p.add_argument("--quick", action="store_true", help="64 MiB, 1 run each: checks the script")
    p.add_argument("--cases", default="a,b,c", help="comma list of a, b, c (default all)")
    p.add_argument("--temps", default="cold,warm", help="cold, warm or both (default)")
    p.add_argument("--dir", help="working directory (default: a fresh one under bench/out/, removed after)")
    p.add_argument("--reuse", action="store_true",
                   help="with --dir: keep checkpoints of the same --size written there by an earlier run")
    p.add_argument("--profile", metavar="CASE:SYSTEM", help="cProfile one warm load, e.g. a:xckpt, c:orbax")
    p.add_argument("--json", help="where to write results (default bench/out/formats.json)")
    p.add_argument("--child", choices=("save-dcp", "save-hf", "load", "profile"), help=argparse.SUPPRESS)
    for a in ("--case", "--system", "--path", "--work", "--crcs"):
        p.add_argument(a, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child == "save-dcp":
        emit(child_save_dcp(args.rank, 2, args.port, args.path, args.size))
        return
    if args.child == "save-hf":
        emit(child_save_hf(args.path, args.size))
        return
    if args.child == "load":
        emit(child_load(args))
        return
    if args.child == "profile":
        emit(child_profile(args))
        return
    if args.quick:
        args.size, args.repeats = 1 / 16, 1
    cases = [c for c in args.cases.split(",") if c]
    temps = [t for t in args.temps.split(",") if t]
    if any(c not in CASES for c in cases) or any(t not in ("cold", "warm") for t in temps):
        raise SystemExit("--cases takes a,b,c; --temps takes cold,warm")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="formats-", dir=out_dir()))
    root.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"# bench/formats.py  {started:%Y-%m-%d %H:%M} UTC  cpus {os.cpu_count()}  load avg {load_average()}  "
          f"size {args.size} GiB  dir {root}", flush=True)
    try:
        if args.profile:
            case, _, system = args.profile.partition(":")
            if case not in CASES or system not in CASES[case][1]:
                raise SystemExit(f"--profile takes CASE:SYSTEM, one of "
                                 f"{', '.join(f'{c}:{s}' for c in CASES for s in CASES[c][1])}")
            setup(root, args.size, [case], reuse=args.reuse and bool(args.dir))
            make_warm(root / ckpt_of(case))
            res = run_child(Path(__file__).resolve(), ["--child", "profile", *child_argv(case, system, root, args.size)])
            print(f"\n### cProfile of {LABELS[(case, system)]} ({case}, warm): {res['seconds']:.2f} s\n")
            print(res["report"])
            return
        info = setup(root, args.size, cases, reuse=args.reuse and bool(args.dir))
        dd = dd_ceiling(root, max(64, int(min(args.size, 1.0) * 1024)))
        print(f"dd ceiling of this disk (16 MiB blocks, direct I/O): read {dd['read_gbps']:.2f} GB/s, "
              f"write {dd['write_gbps']:.2f} GB/s", flush=True)
        results = run_loads(args, root, cases, temps)
    finally:
        if not args.dir:
            remove(root)
    table, verdicts = render(results, info, cases, temps)
    how = ", ".join(results["_cold_how"]) or "-"
    print(f"\n{args.size:g} GiB of W1 tensors (float32 + bfloat16); medians of {args.repeats} runs, each a fresh "
          f"process; cold = page cache dropped ({how}); peak RSS growth = largest of the runs; GB/s = tensor "
          f"bytes / median time (disk's direct-I/O read ceiling {dd['read_gbps']:.2f} GB/s); "
          f"load avg at the end {load_average()} on {os.cpu_count()} cpus\n")
    print(table + "\n")
    for v in verdicts:
        print(v)
    doc = {
        "started": started.isoformat(),
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "load_avg_end": load_average(),
        "cpus": os.cpu_count(),
        "args": {k: v for k, v in vars(args).items() if v is not None and k not in ("child",)},
        "checkpoints": info,
        "dd": dd,
        "results": results,
        "table": table,
        "verdicts": verdicts,
    }
    dest = Path(args.json) if args.json else out_dir() / "formats.json"
    dest.write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {dest}")


if __name__ == "__main__":
    main()
