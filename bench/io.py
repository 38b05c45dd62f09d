"""Save/load benchmark: xckpt against torch DCP, orbax, safetensors and torch.save.

Workloads (data seeded, identical for every system):

- **W1**: about ``--size-gib`` GiB of a small LLM's matrices, mixed float32 and
  bfloat16 (embedding and MLP in float32; attention and lm_head in bfloat16;
  norms are small float32 vectors).
- **W2**: 20,000 tensors of 256 float32 each.

Every save and every load runs in a fresh subprocess (``--child``), so peak RSS
(``ru_maxrss`` of that child) and the page cache are per system. Before each
load the page cache is dropped when this process may (root): loads are cold.
Each load is checked element by element (bit-exact) against regenerated source
data, outside the timed region. Loads that only map the file (safetensors,
``torch.load(mmap=True)``) have every page touched inside the timed region, so
all systems are timed to "data resident in memory".

Usage, from the repository root::

    .venv/bin/python bench/io.py                          # W1 + W2, all systems, 3 repeats
    .venv/bin/python bench/io.py --workload W2 --only xckpt,dcp --repeats 1
    .venv/bin/python bench/io.py --only 'xckpt,xckpt[storage=plain,pack=1M]'
    .venv/bin/python bench/io.py --sweep                  # xckpt storage / packing / inner chunks
    .venv/bin/python bench/io.py --profile [--strace]     # where xckpt's time goes

An xckpt variant is written ``xckpt[storage=ocdbt|plain,pack=BYTES,inner=BYTES]``
(sizes accept K/M suffixes); ``inner`` overrides ``xckpt.storage.INNER_CHUNK_BYTES``.
Results: markdown tables on stdout and ``bench/out/io.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import math
import os
import pstats
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    cpu_seconds,
    current_rss_mib,
    dd_ceiling,
    drop_caches,
    emit,
    fsync_tree,
    load_average,
    markdown_table,
    median,
    out_dir,
    peak_rss_mib,
    remove,
    run_child,
)

SEED = 20261123
SYSTEMS = ("xckpt", "dcp", "orbax", "safetensors", "safetensors+fsync", "torch.save", "torch.save+fsync")
DURABLE = {
    "xckpt": "yes (tensorstore file_io_sync)",
    "dcp": "yes (sync_files=True)",
    "orbax": "yes (tensorstore)",
    "safetensors": "no",
    "safetensors+fsync": "yes (fsync after save)",
    "torch.save": "no",
    "torch.save+fsync": "yes (fsync after save)",
}
SWEEP_PACKS = ("64K", "256K", "1M", "4M")
SWEEP_INNER = ("4M", "16M", "64M")

# ---------------------------------------------------------------------------
# Workloads


def workload_spec(
    name: str, size_gib: float, dims: tuple[int, int, int] = (1024, 2816, 32000)
) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, dtype)`` of every tensor of a workload, in save order.

    W1's layers have hidden size, MLP width and vocabulary ``dims``; as many layers
    as make ``size_gib``.
    """
    if name == "W2":
        return [(f"blocks.{i // 10}.p{i % 10}", (256,), "float32") for i in range(20_000)]
    if name != "W1":
        raise SystemExit(f"unknown workload {name!r}; use W1 or W2")
    h, ffn, vocab = dims
    layer = [
        ("self_attn.q_proj.weight", (h, h), "bfloat16"),
        ("self_attn.k_proj.weight", (h, h), "bfloat16"),
        ("self_attn.v_proj.weight", (h, h), "bfloat16"),
        ("self_attn.o_proj.weight", (h, h), "bfloat16"),
        ("mlp.gate_proj.weight", (ffn, h), "float32"),
        ("mlp.up_proj.weight", (ffn, h), "float32"),
        ("mlp.down_proj.weight", (h, ffn), "float32"),
        ("input_layernorm.weight", (h,), "float32"),
        ("post_attention_layernorm.weight", (h,), "float32"),
    ]
    fixed_bytes = vocab * h * 4 + h * 4 + vocab * h * 2
    layer_bytes = sum(math.prod(s) * (2 if d == "bfloat16" else 4) for _, s, d in layer)
    layers = max(1, round((size_gib * (1 << 30) - fixed_bytes) / layer_bytes))
    spec = [("model.embed_tokens.weight", (vocab, h), "float32")]
    for i in range(layers):
        spec += [(f"model.layers.{i}.{n}", s, d) for n, s, d in layer]
    spec += [("model.norm.weight", (h,), "float32"), ("lm_head.weight", (vocab, h), "bfloat16")]
    return spec


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def make_array(index: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Tensor ``index`` of a workload: seeded normals, cast to ``dtype``."""
    rng = np.random.default_rng((SEED, index))
    x = rng.standard_normal(math.prod(shape), dtype=np.float32)
    if dtype != "float32":
        x = x.astype(np_dtype(dtype))
    return x.reshape(shape)


def spec_bytes(spec: list[tuple[str, tuple[int, ...], str]]) -> int:
    return sum(math.prod(s) * np_dtype(d).itemsize for _, s, d in spec)


def bits(a: np.ndarray) -> np.ndarray:
    """``a`` viewed as unsigned integers of its item size (bit-exact comparison)."""
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


# ---------------------------------------------------------------------------
# Systems (used in the child processes; each imports its framework lazily)


def parse_size(s: str | int) -> int:
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"(\d+)([KMG]?)(i?B)?", s.strip(), re.IGNORECASE)
    if not m:
        raise SystemExit(f"cannot read size {s!r} (e.g. 262144, 256K, 4M)")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def parse_system(label: str) -> tuple[str, dict[str, str]]:
    """``"xckpt[storage=plain,pack=1M]"`` -> ``("xckpt", {"storage": "plain", "pack": "1M"})``."""
    m = re.fullmatch(r"([\w.+]+)(?:\[(.*)\])?", label.strip())
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


def to_torch(a: np.ndarray) -> Any:
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def from_torch(t: Any) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np_dtype("bfloat16"))
    return t.numpy()


class System:
    """One system's save and load; ``prepare``/``target``/``to_numpy`` are untimed."""

    lazy = False  # load returns memory-mapped data: touch every page inside the timed region

    def prepare(self, a: np.ndarray) -> Any:
        return a

    def save(self, path: Path, tree: dict[str, Any]) -> None:
        raise NotImplementedError

    def target(self, spec: list[tuple[str, tuple[int, ...], str]]) -> Any:
        return None

    def load(self, path: Path, target: Any) -> dict[str, Any]:
        raise NotImplementedError

    def to_numpy(self, x: Any) -> np.ndarray:
        return x


class Xckpt(System):
    def __init__(self, opts: dict[str, str]) -> None:
        import tensorstore  # noqa: F401  (imported untimed, as torch and jax are for the others)

        import xckpt.writer

        self.options: dict[str, Any] = {}
        if "storage" in opts:
            self.options["storage"] = opts["storage"]
        if "pack" in opts:
            self.options["pack_threshold"] = parse_size(opts["pack"])
        if "inner" in opts:
            # Benchmark-only knob: the writer sizes zarr chunks with this function.
            import functools

            import xckpt.storage

            xckpt.writer.inner_chunk_shape = functools.partial(  # type: ignore[attr-defined]
                xckpt.storage.inner_chunk_shape, target=parse_size(opts["inner"])
            )

    def save(self, path: Path, tree: dict[str, Any]) -> None:
        import xckpt

        xckpt.save(tree, path, **self.options)

    def load(self, path: Path, target: Any) -> dict[str, Any]:
        import xckpt

        return xckpt.load(path)


class Dcp(System):
    def prepare(self, a: np.ndarray) -> Any:
        return to_torch(a)

    def save(self, path: Path, tree: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(tree, storage_writer=dcp.FileSystemWriter(path, sync_files=True))

    def target(self, spec: list[tuple[str, tuple[int, ...], str]]) -> Any:
        import torch

        return {n: torch.empty(s, dtype=getattr(torch, d)) for n, s, d in spec}

    def load(self, path: Path, target: Any) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        dcp.load(target, storage_reader=dcp.FileSystemReader(path))
        return target

    def to_numpy(self, x: Any) -> np.ndarray:
        return from_torch(x)


class Orbax(System):
    def __init__(self) -> None:
        import jax

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

    def target(self, spec: list[tuple[str, tuple[int, ...], str]]) -> Any:
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


class TorchSave(System):
    def __init__(self, fsync: bool, mmap: bool) -> None:
        self.fsync = fsync
        self.mmap = self.lazy = mmap

    def prepare(self, a: np.ndarray) -> Any:
        return to_torch(a)

    def save(self, path: Path, tree: dict[str, Any]) -> None:
        import torch

        path.mkdir()
        torch.save(tree, path / "model.pt")
        if self.fsync:
            fsync_tree(path)

    def load(self, path: Path, target: Any) -> dict[str, Any]:
        import torch

        return torch.load(path / "model.pt", mmap=self.mmap, weights_only=True)

    def to_numpy(self, x: Any) -> np.ndarray:
        return from_torch(x)


def make_system(label: str, torch_mmap: bool) -> System:
    name, opts = parse_system(label)
    if name == "xckpt":
        return Xckpt(opts)
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


def verify(system: System, spec: list[tuple[str, tuple[int, ...], str]], out: dict[str, Any]) -> None:
    """Every tensor, bit-exact against the regenerated source (raises on a mismatch)."""
    if len(out) != len(spec):
        raise SystemExit(f"loaded {len(out)} tensors, saved {len(spec)}")
    for i, (n, s, d) in enumerate(spec):
        got = system.to_numpy(out[n])
        want = make_array(i, s, d)
        if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(bits(got), bits(want)):
            raise SystemExit(f"tensor {n!r} differs from the source ({got.dtype}{got.shape})")


def child_main(args: argparse.Namespace) -> None:
    """One save or one load of one system, in this fresh process; emits the result."""
    spec = workload_spec(args.workload, args.size_gib)
    system = make_system(args.system, args.torch_mmap)
    path = Path(args.path)
    if args.child == "save":
        tree = {n: system.prepare(make_array(i, s, d)) for i, (n, s, d) in enumerate(spec)}
        before = current_rss_mib()
        c0, t0 = cpu_seconds(), time.perf_counter()
        system.save(path, tree)
        seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    else:
        target = system.target(spec)
        before = current_rss_mib()
        c0, t0 = cpu_seconds(), time.perf_counter()
        out = system.load(path, target)
        if system.lazy:
            touch(system, out)
        seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    result = {"seconds": seconds, "cpu_s": cpu, "rss_before_mib": before, "peak_rss_mib": peak_rss_mib()}
    if args.child == "load":
        verify(system, spec, out)
        result["verified"] = True
    emit(result)


# ---------------------------------------------------------------------------
# Profiling xckpt (child side)

_PHASES = {
    "save": [
        ("xckpt.save (total)", "xckpt.writer.save"),
        ("Writer.__init__ (claim the location)", "xckpt.writer.Writer.__init__"),
        ("Writer.write (per tensor: checks, crc32, pack)", "xckpt.writer.Writer.write"),
        ("Writer._flush (open + write + commit arrays)", "xckpt.writer.Writer._flush"),
        ("Writer.commit (packed array, manifests)", "xckpt.writer.Writer.commit"),
        ("Writer.manifest (build dataclasses)", "xckpt.writer.Writer.manifest"),
        ("Manifest.to_json", "xckpt.manifest.Manifest.to_json"),
        ("Storage.create_array (spec + open)", "xckpt.storage.Storage.create_array"),
        ("Storage.write_key (manifest files)", "xckpt.storage.Storage.write_key"),
    ],
    "load": [
        ("xckpt.load (total)", "xckpt.reader.load"),
        ("Checkpoint.__init__ (read + validate manifest)", "xckpt.reader.Checkpoint.__init__"),
        ("Manifest.loads (parse + validate)", "xckpt.manifest.Manifest.loads"),
        ("reader.validate (coverage)", "xckpt.reader.validate"),
        ("Checkpoint.read_all (allocate + read)", "xckpt.reader.Checkpoint.read_all"),
        ("Checkpoint.read_into (plan + read)", "xckpt.reader.Checkpoint.read_into"),
        ("layout.plan_reads", "xckpt.layout.plan_reads"),
        ("Checkpoint._read_arrays", "xckpt.reader.Checkpoint._read_arrays"),
        ("Checkpoint._read_packed", "xckpt.reader.Checkpoint._read_packed"),
        ("Checkpoint.objects", "xckpt.reader.Checkpoint.objects"),
    ],
}


def _code_key(dotted: str) -> tuple[str, int, str] | None:
    """cProfile's key (file, first line, name) of a function given by dotted path."""
    import importlib
    import inspect

    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
        if obj is None:
            return None
        code = inspect.unwrap(obj).__code__
        return code.co_filename, code.co_firstlineno, code.co_name
    return None


def phase_table(stats: pstats.Stats, op: str) -> str:
    """Cumulative seconds and call counts of xckpt's main functions."""
    rows = []
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    for label, dotted in _PHASES[op]:
        hit = raw.get(_code_key(dotted))
        rows.append((label, hit[1] if hit else 0, hit[3] if hit else 0.0))
    return markdown_table(["phase", "calls", "cumulative s"], rows)


def profile_child(args: argparse.Namespace) -> None:
    """cProfile one xckpt save and one load (cold when allowed) of a workload."""
    import xckpt

    spec = workload_spec(args.workload, args.size_gib)
    system = make_system(args.system, False)
    tree = {n: make_array(i, s, d) for i, (n, s, d) in enumerate(spec)}
    path = Path(args.path)
    report = io.StringIO()
    result: dict[str, Any] = {}
    for op in ("save", "load"):
        if op == "load":
            del tree
            result["cold"] = drop_caches()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        if op == "save":
            system.save(path, tree)
        else:
            out = xckpt.load(path)
        prof.disable()
        result[f"{op}_s"] = time.perf_counter() - t0
        stats = pstats.Stats(prof, stream=report)
        report.write(f"\n#### {args.workload} {op}: {result[op + '_s']:.3f} s wall (under cProfile)\n\n")
        report.write(phase_table(stats, op) + "\n\n```\n")
        stats.sort_stats("tottime").print_stats(12)
        report.write("```\n")
    verify(system, spec, out)
    result["report"] = report.getvalue()
    emit(result)


# ---------------------------------------------------------------------------
# Parent: orchestration, tables, verdicts


def child_args(args: argparse.Namespace, op: str, workload: str, system: str, path: Path) -> list[str]:
    return [
        "--child", op, "--workload", workload, "--system", system, "--path", str(path),
        "--size-gib", str(args.size_gib), *(["--torch-mmap"] if args.torch_mmap else []),
    ]


def disk_usage(path: Path) -> tuple[int, int]:
    """(files, bytes) under ``path``."""
    files = nbytes = 0
    for root, _dirs, names in os.walk(path):
        for n in names:
            files += 1
            nbytes += os.path.getsize(os.path.join(root, n))
    return files, nbytes


def system_labels(args: argparse.Namespace, workload: str) -> list[str]:
    base_opts = []
    if args.xckpt_storage:
        base_opts.append(f"storage={args.xckpt_storage}")
    if args.pack_threshold:
        base_opts.append(f"pack={args.pack_threshold}")
    base = "xckpt" + (f"[{','.join(base_opts)}]" if base_opts else "")
    if args.sweep:
        labels = [base, "xckpt[storage=plain]"]
        labels += [f"xckpt[pack={p}]" for p in SWEEP_PACKS if p != "256K"]
        labels += [f"xckpt[storage=plain,pack={p}]" for p in ("64K", "4M")]
        labels += ["xckpt[pack=0]", "xckpt[storage=plain,pack=0]"]  # OCDBT alone, neither
        if workload == "W1":
            labels += [f"xckpt[inner={s}]" for s in SWEEP_INNER if s != "16M"]
        return labels
    if args.only:
        wanted = split_systems(args.only)
        for w in wanted:
            parse_system(w)
        return [base if w == "xckpt" else w for w in wanted]
    return [base, *SYSTEMS[1:]]


def run_workload(args: argparse.Namespace, workload: str, root: Path, cold: list[bool]) -> dict[str, Any]:
    spec = workload_spec(workload, args.size_gib)
    nbytes = spec_bytes(spec)
    labels = system_labels(args, workload)
    runs: dict[str, dict[str, list[float]]] = {lb: {} for lb in labels}
    disk: dict[str, tuple[int, int]] = {}
    print(f"\n{workload}: {len(spec)} tensors, {nbytes / 1e9:.3f} GB; systems: {', '.join(labels)}",
          flush=True)
    script = Path(__file__).resolve()
    for rep in range(args.repeats):
        for label in labels:
            path = root / f"{workload}-{re.sub(r'[^A-Za-z0-9.=+-]', '_', label)}-{rep}"
            remove(path)
            s = run_child(script, child_args(args, "save", workload, label, path))
            disk[label] = disk_usage(path)
            if not args.warm:
                cold.append(drop_caches())
            ld = run_child(script, child_args(args, "load", workload, label, path))
            remove(path)
            r = runs[label]
            for k, v in (("save_s", s["seconds"]), ("load_s", ld["seconds"]),
                         ("save_cpu", s["cpu_s"]), ("load_cpu", ld["cpu_s"]),
                         ("save_rss", s["peak_rss_mib"]), ("load_rss", ld["peak_rss_mib"]),
                         ("save_rss_before", s["rss_before_mib"]), ("load_rss_before", ld["rss_before_mib"])):
                r.setdefault(k, []).append(v)
            print(f"  [{rep + 1}/{args.repeats}] {label:34s} save {s['seconds']:8.3f} s  "
                  f"load {ld['seconds']:8.3f} s  (load avg {load_average()})", flush=True)
    base = labels[0]
    bs, bl = median(runs[base]["save_s"]), median(runs[base]["load_s"])
    rows = []
    for label in labels:
        r = runs[label]
        save_s, load_s = median(r["save_s"]), median(r["load_s"])
        rows.append({
            "system": label,
            "durable": DURABLE[parse_system(label)[0]],
            "save_s": save_s,
            "load_s": load_s,
            "save_gbps": nbytes / save_s / 1e9,
            "load_gbps": nbytes / load_s / 1e9,
            "save_cpu_s": median(r["save_cpu"]),
            "load_cpu_s": median(r["load_cpu"]),
            "save_rss_mib": median(r["save_rss"]),
            "load_rss_mib": median(r["load_rss"]),
            "save_rss_before_mib": median(r["save_rss_before"]),
            "load_rss_before_mib": median(r["load_rss_before"]),
            "files": disk[label][0],
            "disk_bytes": disk[label][1],
            "save_ratio": save_s / bs,
            "load_ratio": load_s / bl,
            "save_runs": r["save_s"],
            "load_runs": r["load_s"],
        })
    return {"tensors": len(spec), "bytes": nbytes, "baseline": base, "rows": rows}


def render(workload: str, res: dict[str, Any]) -> str:
    headers = ["system", "fsync", "save s", "load s", "save GB/s", "load GB/s", "save CPU s",
               "load CPU s", "peak RSS save MiB", "peak RSS load MiB", "files", "save ratio",
               "load ratio"]
    rows = [
        [r["system"], r["durable"], r["save_s"], r["load_s"], r["save_gbps"], r["load_gbps"],
         r["save_cpu_s"], r["load_cpu_s"], r["save_rss_mib"], r["load_rss_mib"], r["files"],
         r["save_ratio"], r["load_ratio"]]
        for r in res["rows"]
    ]
    title = (f"### {workload}: {res['tensors']} tensors, {res['bytes'] / 1e9:.3f} GB "
             f"(ratio = system time / {res['baseline']} time; > 1 means xckpt is faster)")
    return title + "\n\n" + markdown_table(headers, rows)


def verdicts(results: dict[str, Any]) -> list[str]:
    """One line per target of the issue (needs xckpt, dcp and orbax in the run)."""
    out = []

    def row(wl: str, name: str) -> dict[str, Any] | None:
        for r in results.get(wl, {}).get("rows", []):
            if r["system"] == name:
                return r
        return None

    for wl in ("W1", "W2"):
        if wl not in results:
            continue
        base = results[wl]["rows"][0]
        dcp, orbax = row(wl, "dcp"), row(wl, "orbax")
        if wl == "W1" and dcp:
            s, ld = dcp["save_ratio"], dcp["load_ratio"]
            out.append(f"W1 save >= 1.5x faster than DCP: {'PASS' if s >= 1.5 else 'FAIL'} ({s:.2f}x)")
            out.append(f"W1 load >= 2x faster than DCP: {'PASS' if ld >= 2 else 'FAIL'} ({ld:.2f}x)")
        if wl == "W1" and orbax:
            s, ld = orbax["save_ratio"], orbax["load_ratio"]
            ok = s > 1 and ld > 1
            out.append(f"W1 faster than orbax on save and load: {'PASS' if ok else 'FAIL'} "
                       f"(save {s:.2f}x, load {ld:.2f}x)")
        if wl == "W2" and dcp:
            ratio = (dcp["save_s"] + dcp["load_s"]) / (base["save_s"] + base["load_s"])
            out.append(f"W2 save+load >= 10x faster than DCP: {'PASS' if ratio >= 10 else 'FAIL'} "
                       f"({ratio:.1f}x)")
    return out


def profile_main(args: argparse.Namespace, root: Path) -> None:
    script = Path(__file__).resolve()
    label = system_labels(args, "W1")[0]
    for wl in args.workload.split(","):
        path = root / f"profile-{wl}"
        remove(path)
        argv = ["--profile-child", "--workload", wl, "--system", label, "--path", str(path),
                "--size-gib", str(args.size_gib)]
        res = run_child(script, argv)
        remove(path)
        print(f"\n### xckpt profile, {wl} ({label}; load {'cold' if res['cold'] else 'warm'})")
        print(res["report"])
        if args.strace:
            print(syscall_counts(args, wl, label, root))


def syscall_counts(args: argparse.Namespace, wl: str, label: str, root: Path) -> str:
    """Count file syscalls on the checkpoint during one save and one load (strace -f -y)."""
    script = Path(__file__).resolve()
    path = root / f"strace-{wl}"
    remove(path)
    rows = []
    for op in ("save", "load"):
        log = root / f"strace-{wl}-{op}.log"
        prefix = ["strace", "-f", "-y", "-o", str(log), "-e",
                  "trace=openat,fsync,fdatasync,rename,renameat,renameat2,pwrite64,pwritev,pwritev2,write,writev,"
                  "pread64,preadv,preadv2,read,readv,mmap"]
        run_child(script, child_args(args, op, wl, label, path), prefix=prefix)
        counts: dict[str, int] = {}
        for line in log.read_text().splitlines():
            if str(path) not in line:
                continue
            m = re.match(r"\d+\s+(\w+)\(", line)
            if m:
                counts[m.group(1)] = counts.get(m.group(1), 0) + 1
        log.unlink()
        rows.append((op, ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))))
    remove(path)
    return f"\nsyscalls on {wl} checkpoint files (strace -f -y):\n\n" + markdown_table(
        ["op", "calls naming the checkpoint"], rows
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="W1,W2", help="W1, W2 or W1,W2 (default)")
    p.add_argument("--size-gib", type=float, default=1.0, help="size of W1 in GiB (default 1.0)")
    p.add_argument("--repeats", type=int, default=3, help="runs per system; medians are reported")
    p.add_argument("--dir", help="working directory (default: a fresh one under bench/out/)")
    p.add_argument("--only", help="comma list of systems: " + ", ".join(SYSTEMS) + ", xckpt[...]")
    p.add_argument("--xckpt-storage", choices=("ocdbt", "plain"), help="storage of the xckpt baseline")
    p.add_argument("--pack-threshold", help="pack threshold of the xckpt baseline (bytes, K/M)")
    p.add_argument("--torch-mmap", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.load(mmap=True) (default) or a full read")
    p.add_argument("--warm", action="store_true", help="do not drop the page cache before loads")
    p.add_argument("--sweep", action="store_true", help="compare xckpt storage/pack/inner-chunk options")
    p.add_argument("--profile", action="store_true", help="cProfile xckpt save and load")
    p.add_argument("--strace", action="store_true", help="with --profile: count syscalls")
    p.add_argument("--json", help="where to write the results (default bench/out/io.json)")
    p.add_argument("--child", choices=("save", "load"), help=argparse.SUPPRESS)
    p.add_argument("--profile-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.child:
        child_main(args)
        return
    if args.profile_child:
        profile_child(args)
        return
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
    dd = dd_ceiling(root, int(min(args.size_gib, 1.0) * 1024))
    print(f"dd ceiling (16 MiB blocks, direct I/O, {dd['bytes'] / 1e9:.2f} GB): write "
          f"{dd['write_gbps']:.2f} GB/s, read {dd['read_gbps']:.2f} GB/s", flush=True)
    cold: list[bool] = []
    results = {wl: run_workload(args, wl, root, cold) for wl in args.workload.split(",")}
    temp = "warm (page cache kept)" if args.warm or not all(cold) else "cold (page cache dropped)"
    print(f"\nloads: {temp}; torch.load mmap={args.torch_mmap}; load avg now {load_average()}\n")
    for wl, res in results.items():
        print(render(wl, res) + "\n")
    lines = verdicts(results)
    for line in lines:
        print(line)
    doc = {
        "started": started.isoformat(),
        "load_avg_end": load_average(),
        "cpus": os.cpu_count(),
        "args": {k: v for k, v in vars(args).items() if k not in ("child", "profile_child", "system", "path")},
        "loads": temp,
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
