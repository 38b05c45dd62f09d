"""Save/load benchmark: xckpt against torch DCP, orbax, safetensors, torch.save and ``dd``.

Workloads (data seeded, identical for every system; built in ``bench/_common.py``):

- **W1**: about ``--size-gib`` GiB of a small LLM's matrices, mixed float32 and
  bfloat16 (embedding and MLP in float32; attention and lm_head in bfloat16;
  norms are small float32 vectors).
- **W2**: 20,000 tensors of 256 float32 each.

Systems: ``xckpt`` (``xckpt.save`` / ``xckpt.load``, numpy), ``xckpt-torch``
(``xckpt.torch.save`` / ``xckpt.torch.load`` into preallocated torch tensors),
``dcp`` (``sync_files=True``; loads into preallocated tensors), ``orbax``
(StandardCheckpointer), ``safetensors`` and ``torch.save`` (each also ``+fsync``:
every file and directory fsync'd after the save, inside the timed region).

One run measures, for every system and every repeat, in this order:

1. **save** in a fresh process (``--child save``);
2. **warm load** in a fresh process right after the save (page cache kept: the
   checkpoint's pages are resident, as for an evaluation job reading what training
   just wrote, or a checkpoint on tmpfs);
3. **cold load** in a fresh process after ``sync`` and dropping the page cache
   (``/proc/sys/vm/drop_caches``; needs root, otherwise the table says the cold
   column is not cold).

Each load is checked element by element (bit-exact) against regenerated source
data, outside the timed region. Every system's modules are imported before its
timed region (``import torch.distributed.checkpoint`` alone takes about a
second). Loads that only map the file (safetensors,
``torch.load(mmap=True)``) have every page touched inside the timed region, so
all systems are timed to "data resident in memory". The peak-RSS mark is reset
just before each timed region (``/proc/self/clear_refs``), so **peak RSS
growth** = peak during the step minus the RSS at its start, shown as a multiple
of the bytes loaded; **resident after** is the RSS left after the load (the
returned data included) as the same multiple.

Besides, the xckpt baseline's save process loads the checkpoint once more right
after saving (``--same-process``, on by default): the "load in the process that
just saved" line beside the fresh-process warm load.

Tables: medians of ``--repeats`` runs; ratios are system time / xckpt time (above
1: xckpt is faster). Verdict lines check issue 16's targets (W1 warm load within
1.1x of safetensors, cold at least as fast; W1 durable save >= 0.8x the ``dd``
write ceiling, >= safetensors+fsync and >= 2x DCP; W2 save + load within 1.5x of
safetensors+fsync; peak load RSS growth <= 1.15x the bytes loaded for numpy and
torch targets).

Usage, from the repository root::

    .venv/bin/python bench/io.py                          # W1 + W2, all systems, 3 repeats
    .venv/bin/python bench/io.py --size-gib 0.1 --repeats 1          # a quick check
    .venv/bin/python bench/io.py --workload W2 --only xckpt,dcp --temps warm
    .venv/bin/python bench/io.py --only 'xckpt,xckpt[storage=plain,pack=1M]'
    .venv/bin/python bench/io.py --sweep                  # xckpt storage / packing / inner chunks
    .venv/bin/python bench/io.py --profile [--strace]     # where xckpt's time goes (save, warm, cold)

An xckpt variant is written ``xckpt[storage=files|ocdbt|plain,pack=BYTES,inner=BYTES]``
(sizes accept K/M suffixes); ``inner`` overrides ``xckpt.native._zarr.INNER_CHUNK_BYTES``.
Results: markdown tables on stdout and ``bench/out/io.json``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402,F401  (workload helpers re-exported: formats.py and jax_load.py use them)
    SEED,
    Spec,
    bits,
    cpu_seconds,
    current_rss_mib,
    dd_ceiling,
    disk_usage,
    drop_caches,
    emit,
    from_torch,
    fsync_tree,
    load_average,
    make_array,
    markdown_table,
    median,
    np_dtype,
    out_dir,
    parse_size,
    peak_rss_mib,
    remove,
    reset_peak_rss,
    run_child,
    spec_bytes,
    to_torch,
    workload_spec,
)
from _profile import profiled, strace_counts, strace_prefix  # noqa: E402

SYSTEMS = ("xckpt", "xckpt-torch", "dcp", "orbax", "safetensors", "safetensors+fsync", "torch.save",
           "torch.save+fsync")
DURABLE = {
    "xckpt": "yes (tensorstore file_io_sync)",
    "xckpt-torch": "yes (tensorstore file_io_sync)",
    "dcp": "yes (sync_files=True)",
    "orbax": "yes (tensorstore)",
    "safetensors": "no",
    "safetensors+fsync": "yes (fsync after save)",
    "torch.save": "no",
    "torch.save+fsync": "yes (fsync after save)",
}
TEMPS = ("cold", "warm")
SWEEP_PACKS = ("64K", "256K", "1M", "4M")
SWEEP_INNER = ("4M", "16M", "64M")

# ---------------------------------------------------------------------------
# Systems (used in the child processes; each imports its framework lazily)


def parse_system(label: str) -> tuple[str, dict[str, str]]:
    """``"xckpt[storage=plain,pack=1M]"`` -> ``("xckpt", {"storage": "plain", "pack": "1M"})``."""
    m = re.fullmatch(r"([\w.+-]+)(?:\[(.*)\])?", label.strip())
    if not m or m.group(1) not in SYSTEMS:
        raise SystemExit(f"unknown system {label!r}; known: {', '.join(SYSTEMS)}")
    opts = {}
    for kv in filter(None, (m.group(2) or "").split(",")):
        k, _, v = kv.partition("=")
        if m.group(1) != "xckpt" or k not in ("storage", "pack", "inner") or not v:
            raise SystemExit(f"bad option {kv!r} in {label!r} (xckpt takes storage=, pack=, inner=)")
        opts[k] = v
    return m.group(1), opts


def split_systems(s: str) -> list[str]:
    """Split a comma list whose items may contain ``[a,b]``."""
    return [x for x in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", s) if x.strip()]


class System:
    """One system's save and load; ``prepare``/``target``/``to_numpy`` are untimed."""

    lazy = False  # load returns memory-mapped data: touch every page inside the timed region

    def prepare(self, a: np.ndarray) -> Any:
        return a

    def save(self, path: Path, tree: dict[str, Any]) -> None:
        raise NotImplementedError

    def target(self, spec: Spec) -> Any:
        return None

    def load(self, path: Path, target: Any) -> dict[str, Any]:
        raise NotImplementedError

    def to_numpy(self, x: Any) -> np.ndarray:
        return x


class Xckpt(System):
    def __init__(self, opts: dict[str, str]) -> None:
        import tensorstore  # noqa: F401  (imported untimed, as torch and jax are for the others)

        import xckpt.native.writer

        self.options: dict[str, Any] = {}
        if "storage" in opts:
            self.options["storage"] = opts["storage"]
        if "pack" in opts:
            self.options["pack_threshold"] = parse_size(opts["pack"])
        if "inner" in opts:
            # Benchmark-only knob: the writer sizes zarr chunks with this function.
            import functools

            import xckpt.storage

            xckpt.native.writer.inner_chunk_shape = functools.partial(  # type: ignore[attr-defined]
                xckpt.native._zarr.inner_chunk_shape, target=parse_size(opts["inner"])
            )

    def save(self, path: Path, tree: dict[str, Any]) -> None:
        import xckpt

        xckpt.save(tree, path, **self.options)

    def load(self, path: Path, target: Any) -> dict[str, Any]:
        import xckpt

        return xckpt.load(path)


class TorchTarget(System):
    """Torch tensors: saved from, and loaded into preallocated ``torch.empty`` tensors."""

    def prepare(self, a: np.ndarray) -> Any:
        return to_torch(a)

    def target(self, spec: Spec) -> Any:
        import torch

        return {n: torch.empty(s, dtype=getattr(torch, d)) for n, s, d in spec}

    def to_numpy(self, x: Any) -> np.ndarray:
        return from_torch(x)


class XckptTorch(TorchTarget):
    def __init__(self) -> None:
        import tensorstore  # noqa: F401

        import xckpt.torch  # noqa: F401

    def save(self, path: Path, tree: dict[str, Any]) -> None:
        import xckpt.torch

        xckpt.torch.save(tree, path)

    def load(self, path: Path, target: Any) -> dict[str, Any]:
        import xckpt.torch

        xckpt.torch.load(path, target)
        return target


class Dcp(TorchTarget):
    def __init__(self) -> None:
        import torch.distributed.checkpoint  # noqa: F401  (about 1 s: imported untimed, as for every system)

    def save(self, path: Path, tree: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(tree, storage_writer=dcp.FileSystemWriter(path, sync_files=True))

    def load(self, path: Path, target: Any) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        dcp.load(target, storage_reader=dcp.FileSystemReader(path))
        return target


class Orbax(System):
    def __init__(self) -> None:
        import jax
        import orbax.checkpoint  # noqa: F401

        self.jax = jax
        self.device = jax.devices("cpu")[0]

    def prepare(self, a: np.ndarray) -> Any:
        return self.jax.device_put(a, self.device)

    def save(self, path: Path, tree: dict[str, Any]) -> None:
        import orbax.checkpoint as ocp

        ck = ocp.StandardCheckpointer()
        ck.save(path.resolve(), tree)
        ck.wait_until_finished()
        ck.close()

    def target(self, spec: Spec) -> Any:
        sharding = self.jax.sharding.SingleDeviceSharding(self.device)
        return {n: self.jax.ShapeDtypeStruct(s, np_dtype(d), sharding=sharding) for n, s, d in spec}

    def load(self, path: Path, target: Any) -> dict[str, Any]:
        import orbax.checkpoint as ocp

        ck = ocp.StandardCheckpointer()
        out = ck.restore(path.resolve(), target)
        self.jax.block_until_ready(out)
        ck.close()
        return out

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)


class Safetensors(System):
    lazy = True

    def __init__(self, fsync: bool) -> None:
        import ml_dtypes  # noqa: F401  (registers bfloat16 for safetensors.numpy)
        import safetensors.numpy  # noqa: F401

        self.fsync = fsync

    def save(self, path: Path, tree: dict[str, Any]) -> None:
        import safetensors.numpy

        path.mkdir()
        safetensors.numpy.save_file(tree, path / "model.safetensors")
        if self.fsync:
            fsync_tree(path)

    def load(self, path: Path, target: Any) -> dict[str, Any]:
        import safetensors.numpy

        return safetensors.numpy.load_file(path / "model.safetensors")


class TorchSave(TorchTarget):
    def __init__(self, fsync: bool, mmap: bool) -> None:
        import torch  # noqa: F401

        self.fsync = fsync
        self.mmap = self.lazy = mmap

    def target(self, spec: Spec) -> Any:
        return None

    def save(self, path: Path, tree: dict[str, Any]) -> None:
        import torch

        path.mkdir()
        torch.save(tree, path / "model.pt")
        if self.fsync:
            fsync_tree(path)

    def load(self, path: Path, target: Any) -> dict[str, Any]:
        import torch

        return torch.load(path / "model.pt", mmap=self.mmap, weights_only=True)


def make_system(label: str, torch_mmap: bool) -> System:
    name, opts = parse_system(label)
    if name == "xckpt":
        return Xckpt(opts)
    if name == "xckpt-torch":
        return XckptTorch()
    if name == "dcp":
        return Dcp()
    if name == "orbax":
        return Orbax()
    if name.startswith("safetensors"):
        return Safetensors(fsync=name.endswith("+fsync"))
    return TorchSave(fsync=name.endswith("+fsync"), mmap=torch_mmap)


def touch(system: System, out: dict[str, Any]) -> None:
    """Read one byte of every page of every loaded tensor (faults in mapped data)."""
    page = os.sysconf("SC_PAGE_SIZE")
    for x in out.values():
        a = system.to_numpy(x)
        if a.nbytes:
            int(a.reshape(-1).view(np.uint8)[::page].sum())


def verify(system: System, spec: Spec, out: dict[str, Any]) -> None:
    """Every tensor, bit-exact against the regenerated source (raises on a mismatch)."""
    if len(out) != len(spec):
        raise SystemExit(f"loaded {len(out)} tensors, saved {len(spec)}")
    for i, (n, s, d) in enumerate(spec):
        got = system.to_numpy(out[n])
        want = make_array(i, s, d)
        if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(bits(got), bits(want)):
            raise SystemExit(f"tensor {n!r} differs from the source ({got.dtype}{got.shape})")


def timed(fn: Any) -> tuple[Any, dict[str, float]]:
    """Run ``fn()``: its value, and wall s, CPU s, RSS before / peak during / after (MiB)."""
    gc.collect()
    reset_peak_rss()
    before = current_rss_mib()
    c0, t0 = cpu_seconds(), time.perf_counter()
    value = fn()
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    return value, {"seconds": seconds, "cpu_s": cpu, "rss_before_mib": before, "peak_rss_mib": peak_rss_mib(),
                   "rss_after_mib": current_rss_mib()}


def timed_load(system: System, spec: Spec, path: Path) -> dict[str, float]:
    """One load (pages touched for lazy loaders), measured, then verified untimed."""
    target = system.target(spec)

    def load() -> dict[str, Any]:
        out = system.load(path, target)
        if system.lazy:
            touch(system, out)
        return out

    out, result = timed(load)
    verify(system, spec, out)
    return result


def child_main(args: argparse.Namespace) -> None:
    """One save (and, with --then-load, a load in the same process) or one load; emits the result."""
    spec = workload_spec(args.workload, args.size_gib)
    system = make_system(args.system, args.torch_mmap)
    path = Path(args.path)
    if args.child == "load":
        emit(timed_load(system, spec, path))
        return
    tree = {n: system.prepare(make_array(i, s, d)) for i, (n, s, d) in enumerate(spec)}
    _, result = timed(lambda: system.save(path, tree))
    if args.then_load:
        del tree
        result["same_process_load"] = timed_load(system, spec, path)
    emit(result)


# ---------------------------------------------------------------------------
# Profiling (child side): cProfile of one save or one load (helpers in bench/_profile.py)

def profile_child(args: argparse.Namespace) -> None:
    """cProfile one save (``--profile-child save``) or one load, in this fresh process."""
    spec = workload_spec(args.workload, args.size_gib)
    system = make_system(args.system, args.torch_mmap)
    path = Path(args.path)
    op = args.profile_child
    if op == "save":
        tree = {n: system.prepare(make_array(i, s, d)) for i, (n, s, d) in enumerate(spec)}
        fn: Any = lambda: system.save(path, tree)  # noqa: E731
    else:
        target = system.target(spec)

        def fn() -> Any:
            out = system.load(path, target)
            if system.lazy:
                touch(system, out)
            return out

    out, m, stats_text = profiled(fn, timed, "save" if op == "save" else "load")
    if op != "save":
        verify(system, spec, out)
    title = (f"\n#### {args.workload} {args.system} {args.temp or op}: {m['seconds']:.3f} s wall, "
             f"{m['cpu_s']:.3f} s CPU (all threads), peak RSS growth "
             f"{m['peak_rss_mib'] - m['rss_before_mib']:.0f} MiB (under cProfile; main thread only below)\n\n")
    emit({"report": title + stats_text})


def profile_main(args: argparse.Namespace, root: Path) -> None:
    """Profile the first system's save, warm load and cold load, each in a fresh process."""
    script = Path(__file__).resolve()
    label = system_labels(args, "W1")[0]
    for wl in args.workload.split(","):
        path = root / f"profile-{wl}"
        remove(path)
        print(f"\n### profile of {label}, {wl}")
        for op, temp in (("save", None), ("load", "warm"), ("load", "cold")):
            if temp == "cold" and not drop_caches():
                temp = "cold requested, page cache NOT dropped (not root)"
            argv = [*child_args(args, "save", wl, label, path)[2:], "--profile-child", op,
                    *(["--temp", temp] if temp else [])]
            print(run_child(script, argv)["report"], flush=True)
        if args.strace:
            print(syscall_counts(args, wl, label, root))
        remove(path)


def syscall_counts(args: argparse.Namespace, wl: str, label: str, root: Path) -> str:
    """Count file syscalls on the checkpoint during one save and one load (strace -f -y)."""
    script = Path(__file__).resolve()
    path = root / f"strace-{wl}"
    remove(path)
    rows = []
    for op in ("save", "load"):
        log = root / f"strace-{wl}-{op}.log"
        run_child(script, child_args(args, op, wl, label, path), prefix=strace_prefix(log))
        counts = strace_counts(log, path)
        rows.append((op, ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))))
    remove(path)
    return f"\nsyscalls on {wl} checkpoint files (strace -f -y):\n\n" + markdown_table(
        ["op", "calls naming the checkpoint"], rows
    )


# ---------------------------------------------------------------------------
# Parent: orchestration, tables, verdicts


def child_args(args: argparse.Namespace, op: str, workload: str, system: str, path: Path) -> list[str]:
    return [
        "--child", op, "--workload", workload, "--system", system, "--path", str(path),
        "--size-gib", str(args.size_gib), *(["--torch-mmap"] if args.torch_mmap else ["--no-torch-mmap"]),
    ]


def system_labels(args: argparse.Namespace, workload: str) -> list[str]:
    base_opts = []
    if args.xckpt_storage:
        base_opts.append(f"storage={args.xckpt_storage}")
    if args.pack_threshold:
        base_opts.append(f"pack={args.pack_threshold}")
    base = "xckpt" + (f"[{','.join(base_opts)}]" if base_opts else "")
    if args.sweep:
        # The default on a local disk is storage=files (direct file I/O); plain is version 2's
        # layout (a directory per row of chunks), ocdbt goes through tensorstore.
        labels = [base, "xckpt[storage=plain]", "xckpt[storage=ocdbt]"]
        labels += [f"xckpt[pack={p}]" for p in SWEEP_PACKS if p != "256K"]
        labels += [f"xckpt[storage=ocdbt,pack={p}]" for p in ("64K", "4M")]
        labels += ["xckpt[pack=0]", "xckpt[storage=ocdbt,pack=0]"]  # files alone, OCDBT alone
        if workload == "W1":
            labels += [f"xckpt[inner={s}]" for s in SWEEP_INNER if s != "16M"]
        return labels
    if args.only:
        wanted = split_systems(args.only)
        for w in wanted:
            parse_system(w)
        return [base if w == "xckpt" else w for w in wanted]
    return [base, *SYSTEMS[1:]]


def _growth(r: dict[str, list[float]], temp: str, nbytes: int, key: str = "peak_rss_mib") -> float:
    """Median over runs of (``key`` - RSS before) in units of the bytes loaded."""
    pairs = zip(r.get(f"{temp}_{key}", []), r.get(f"{temp}_rss_before_mib", []))
    xs = [max(0.0, a - b) * (1 << 20) / nbytes for a, b in pairs]
    return median(xs)


def run_workload(args: argparse.Namespace, workload: str, root: Path, dropped: list[bool]) -> dict[str, Any]:
    spec = workload_spec(workload, args.size_gib)
    nbytes = spec_bytes(spec)
    labels = system_labels(args, workload)
    temps = [t for t in ("warm", "cold") if t in args.temps]  # warm right after the save, then cold
    runs: dict[str, dict[str, list[float]]] = {lb: {} for lb in labels}
    disk: dict[str, tuple[int, int]] = {}
    print(f"\n{workload}: {len(spec)} tensors, {nbytes / 1e9:.3f} GB; systems: {', '.join(labels)}",
          flush=True)
    script = Path(__file__).resolve()
    keys = ("seconds", "cpu_s", "rss_before_mib", "peak_rss_mib", "rss_after_mib")
    for rep in range(args.repeats):
        for label in labels:
            path = root / f"{workload}-{re.sub(r'[^A-Za-z0-9.=+-]', '_', label)}-{rep}"
            remove(path)
            same = args.same_process and label == labels[0]
            argv = child_args(args, "save", workload, label, path) + (["--then-load"] if same else [])
            s = run_child(script, argv)
            disk[label] = disk_usage(path)
            r = runs[label]
            for k in keys:
                r.setdefault(f"save_{k}", []).append(s[k])
            if same:
                r.setdefault("same_process_seconds", []).append(s["same_process_load"]["seconds"])
            line = f"  [{rep + 1}/{args.repeats}] {label:28s} save {s['seconds']:7.3f} s"
            for temp in temps:
                if temp == "cold":
                    dropped.append(drop_caches())
                ld = run_child(script, child_args(args, "load", workload, label, path))
                for k in keys:
                    r.setdefault(f"{temp}_{k}", []).append(ld[k])
                line += f"  {temp} load {ld['seconds']:7.3f} s"
            if same:
                line += f"  same-process load {s['same_process_load']['seconds']:7.3f} s"
            remove(path)
            print(line + f"  (load avg {load_average()})", flush=True)
    base = runs[labels[0]]
    rows = []
    for label in labels:
        r = runs[label]
        row: dict[str, Any] = {"system": label, "durable": DURABLE[parse_system(label)[0]],
                               "files": disk[label][0], "disk_bytes": disk[label][1]}
        for op in ("save", *temps):
            t = median(r[f"{op}_seconds"])
            row[f"{op}_s"] = t
            row[f"{op}_gbps"] = nbytes / t / 1e9
            row[f"{op}_ratio"] = t / median(base[f"{op}_seconds"])
            row[f"{op}_cpu_s"] = median(r[f"{op}_cpu_s"])
            row[f"{op}_peak_rss_mib"] = median(r[f"{op}_peak_rss_mib"])
            row[f"{op}_rss_growth_x"] = _growth(r, op, nbytes)
            row[f"{op}_resident_after_x"] = _growth(r, op, nbytes, "rss_after_mib")
            row[f"{op}_runs"] = r[f"{op}_seconds"]
        if "same_process_seconds" in r:
            row["same_process_load_s"] = median(r["same_process_seconds"])
            row["same_process_runs"] = r["same_process_seconds"]
        rows.append(row)
    return {"tensors": len(spec), "bytes": nbytes, "baseline": labels[0], "temps": temps, "rows": rows}


def render(workload: str, res: dict[str, Any], cold_note: str) -> str:
    temps = res["temps"]
    nan = float("nan")
    head = ["system", "fsync", "save s", *(f"{t} load s" for t in temps), "save GB/s",
            *(f"{t} GB/s" for t in temps), "save ratio", *(f"{t} ratio" for t in temps)]
    rows = [[r["system"], r["durable"], r["save_s"], *(r[f"{t}_s"] for t in temps), r["save_gbps"],
             *(r[f"{t}_gbps"] for t in temps), r["save_ratio"], *(r[f"{t}_ratio"] for t in temps)]
            for r in res["rows"]]
    title = (f"### {workload}: {res['tensors']} tensors, {res['bytes'] / 1e9:.3f} GB; time "
             f"(ratio = system time / {res['baseline']} time; above 1: xckpt is faster){cold_note}")
    out = title + "\n\n" + markdown_table(head, rows)
    head = ["system", "save CPU s", *(f"{t} CPU s" for t in temps), "peak RSS save MiB",
            *(f"peak RSS {t} MiB" for t in temps), *(f"{t} peak growth x" for t in temps),
            *(f"{t} resident after x" for t in temps), "files", "MB on disk"]
    rows = [[r["system"], r["save_cpu_s"], *(r[f"{t}_cpu_s"] for t in temps), r["save_peak_rss_mib"],
             *(r[f"{t}_peak_rss_mib"] for t in temps), *(r[f"{t}_rss_growth_x"] for t in temps),
             *(r[f"{t}_resident_after_x"] for t in temps), r["files"], r["disk_bytes"] / 1e6]
            for r in res["rows"]]
    out += (f"\n\n### {workload}: CPU and memory (peak growth = peak RSS during the step minus RSS at its "
            "start, resident after = RSS after the load minus RSS at its start, both in units of the "
            "bytes loaded)\n\n" + markdown_table(head, rows))
    same = res["rows"][0].get("same_process_load_s", nan)
    if same == same:
        warm = res["rows"][0].get("warm_s", nan)
        vs = f"against {warm:.3f} s warm in a fresh process ({same / warm:.2f}x)" if warm == warm else ""
        out += f"\n\n{res['baseline']} load in the process that just saved it: {same:.3f} s (median) {vs}"
    return out


def verdicts(results: dict[str, Any], dd: dict[str, float]) -> list[str]:
    """One line per issue 16 target; ``n/a`` where the run lacks a system or a load temperature."""
    out = []

    def row(wl: str, name: str) -> dict[str, Any] | None:
        for r in results.get(wl, {}).get("rows", []):
            if r["system"] == name:
                return r
        return None

    def line(text: str, ok: bool | None, detail: str) -> None:
        out.append(f"{text}: {'n/a' if ok is None else 'PASS' if ok else 'FAIL'} ({detail})")

    x1 = results["W1"]["rows"][0] if "W1" in results else None
    st, stf, dcp = row("W1", "safetensors"), row("W1", "safetensors+fsync"), row("W1", "dcp")
    for temp, want, cmp in (("warm", 1.1, "within 1.1x of"), ("cold", 1.0, "at least as fast as")):
        text = f"W1 {temp} load {cmp} safetensors"
        if x1 and st and f"{temp}_s" in x1:
            q = x1[f"{temp}_s"] / st[f"{temp}_s"]
            line(text, q <= want,
                 f"xckpt {x1[f'{temp}_s']:.3f} s / safetensors {st[f'{temp}_s']:.3f} s = {q:.2f}x")
        else:
            line(text, None, f"needs xckpt and safetensors with {temp} loads in the run")
    if x1:
        q = x1["save_gbps"] / dd["write_gbps"]
        line("W1 durable save >= 0.8x the dd write ceiling", q >= 0.8,
             f"{x1['save_gbps']:.2f} GB/s = {q:.2f}x of {dd['write_gbps']:.2f} GB/s")
    else:
        line("W1 durable save >= 0.8x the dd write ceiling", None, "needs xckpt on W1 in the run")
    for other, name, want in ((stf, "safetensors+fsync", 1.0), (dcp, "DCP", 2.0)):
        text = f"W1 durable save >= {f'{want:g}x ' if want != 1 else ''}{name}"
        if x1 and other:
            q = other["save_s"] / x1["save_s"]
            line(text, q >= want, f"{name} {other['save_s']:.3f} s / xckpt {x1['save_s']:.3f} s = {q:.2f}x")
        else:
            line(text, None, f"needs xckpt and {name} on W1 in the run")
    x2, stf2 = (results["W2"]["rows"][0] if "W2" in results else None), row("W2", "safetensors+fsync")
    if x2 and stf2:
        qs = {t: (x2["save_s"] + x2[f"{t}_s"]) / (stf2["save_s"] + stf2[f"{t}_s"])
              for t in results["W2"]["temps"]}
        line("W2 save + load within 1.5x of safetensors+fsync", all(q <= 1.5 for q in qs.values()),
             ", ".join(f"{t}: {q:.2f}x" for t, q in qs.items()))
    else:
        line("W2 save + load within 1.5x of safetensors+fsync", None,
             "needs xckpt and safetensors+fsync on W2")
    for name, kind in ((x1["system"] if x1 else "xckpt", "numpy"), ("xckpt-torch", "torch")):
        r = row("W1", name)
        text = f"W1 peak load RSS growth <= 1.15x bytes loaded, {kind} target ({name})"
        temps = results["W1"]["temps"] if r else []
        if r and temps:
            gs = {t: r[f"{t}_rss_growth_x"] for t in temps}
            line(text, all(g <= 1.15 for g in gs.values()),
                 ", ".join(f"{t}: {g:.2f}x" for t, g in gs.items()))
        else:
            line(text, None, f"needs {name} on W1 in the run")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="W1,W2", help="W1, W2 or W1,W2 (default)")
    p.add_argument("--size-gib", type=float, default=1.0, help="size of W1 in GiB (default 1.0)")
    p.add_argument("--repeats", type=int, default=3, help="runs per system (default 3); medians are reported")
    p.add_argument("--temps", default="cold,warm",
                   help="loads to measure after each save: cold, warm or cold,warm (default)")
    p.add_argument("--warm", action="store_true", help="same as --temps warm")
    p.add_argument("--dir", help="working directory (default: a fresh one under bench/out/)")
    p.add_argument("--only", help="comma list of systems: " + ", ".join(SYSTEMS) + ", xckpt[...] "
                   "(default: all; the first is the baseline of the ratios)")
    p.add_argument("--xckpt-storage", choices=("files", "ocdbt", "plain"), help="storage of the xckpt baseline")
    p.add_argument("--pack-threshold", help="pack threshold of the xckpt baseline (bytes, K/M)")
    p.add_argument("--torch-mmap", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.load(mmap=True) (default) or a full read")
    p.add_argument("--same-process", action=argparse.BooleanOptionalAction, default=True,
                   help="also time a load in the baseline's save process, right after the save (default on)")
    p.add_argument("--sweep", action="store_true", help="compare xckpt storage/pack/inner-chunk options")
    p.add_argument("--profile", action="store_true",
                   help="cProfile the first system's save, warm load and cold load (fresh processes)")
    p.add_argument("--strace", action="store_true", help="with --profile: count syscalls")
    p.add_argument("--json", help="where to write the results (default bench/out/io.json)")
    p.add_argument("--child", choices=("save", "load"), help=argparse.SUPPRESS)
    p.add_argument("--then-load", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile-child", choices=("save", "load"), help=argparse.SUPPRESS)
    p.add_argument("--temp", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.profile_child:
        profile_child(args)
        return
    if args.child:
        child_main(args)
        return
    args.temps = ["warm"] if args.warm else [t.strip() for t in args.temps.split(",") if t.strip()]
    if not args.temps or any(t not in TEMPS for t in args.temps):
        raise SystemExit(f"--temps takes cold, warm or cold,warm, not {','.join(args.temps)!r}")
    if args.pack_threshold:
        parse_size(args.pack_threshold)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="io-", dir=out_dir()))
    root.mkdir(parents=True, exist_ok=True)
    if args.profile:
        profile_main(args, root)
        if not args.dir:
            remove(root)
        return
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"# bench/io.py  {started:%Y-%m-%d %H:%M} UTC  cpus {os.cpu_count()}  "
          f"load avg {load_average()}  dir {root}")
    # dd writes as many bytes as W1 has (64 MiB to 4 GiB): the ceiling its save is compared with.
    dd_mib = min(4096, max(64, spec_bytes(workload_spec("W1", args.size_gib)) >> 20))
    dd = dd_ceiling(root, dd_mib)
    print(f"dd ceiling (16 MiB blocks, direct I/O, {dd['bytes'] / 1e9:.2f} GB): write "
          f"{dd['write_gbps']:.2f} GB/s, read {dd['read_gbps']:.2f} GB/s", flush=True)
    dropped: list[bool] = []
    results = {wl: run_workload(args, wl, root, dropped) for wl in args.workload.split(",")}
    cold_note = "" if all(dropped) else "; COLD LOADS ARE NOT COLD (page cache not dropped: not root)"
    print(f"\nloads: {' and '.join(args.temps)}, each in a fresh process, medians of {args.repeats}; "
          f"torch.load mmap={args.torch_mmap}; load avg now {load_average()}{cold_note}\n")
    for wl, res in results.items():
        print(render(wl, res, cold_note if "cold" in args.temps else "") + "\n")
    lines = verdicts(results, dd)
    for line in lines:
        print(line)
    doc = {
        "started": started.isoformat(),
        "load_avg_end": load_average(),
        "cpus": os.cpu_count(),
        "args": {k: v for k, v in vars(args).items()
                 if k not in ("child", "profile_child", "system", "path", "then_load", "temp")},
        "cold_loads_cold": all(dropped),
        "dd": dd,
        "workloads": results,
        "verdicts": lines,
    }
    dest = Path(args.json) if args.json else out_dir() / "io.json"
    dest.write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {dest}")
    if not args.dir:
        remove(root)


if __name__ == "__main__":
    main()
