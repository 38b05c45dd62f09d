"""Shared helpers for the benchmarks in ``bench/``.

Small on purpose; every benchmark may import these (run scripts from the repo
root as ``python bench/<name>.py``, which puts ``bench/`` on ``sys.path``):

- :func:`out_dir` -- ``bench/out/`` (git-ignored), created on demand.
- :func:`drop_caches` -- ``sync`` and drop the page cache; False when not allowed.
- :func:`dd_ceiling` -- direct-I/O ``dd`` write and read bandwidth of a directory's disk.
- :func:`run_child` -- run ``python script args...`` in a fresh process, return the
  JSON object it printed last on stdout (a child prints one with :func:`emit`).
- :func:`peak_rss_mib` / :func:`current_rss_mib` -- this process's peak and current RSS;
  :func:`reset_peak_rss` -- restart the peak at the current RSS (Linux ``clear_refs``), so
  one long-lived process can measure the peak of each step;
  :func:`cpu_seconds` -- its user + system CPU time (steadier than wall time on a busy machine).
- The workloads every benchmark shares: :func:`workload_spec` (W1: an LLM's matrices,
  mixed float32 / bfloat16; W2: 20,000 small tensors), :func:`make_array` (seeded data),
  :func:`spec_bytes`, :func:`np_dtype`, :func:`bits` (bit-exact comparison),
  :func:`to_torch` / :func:`from_torch` (zero-copy, bfloat16 included).
- :func:`fsync_tree` -- fsync every file and directory under a path.
- :func:`median`, :func:`markdown_table`, :func:`load_average`, :func:`remove`,
  :func:`parse_size` (``256K``, ``4M``), :func:`disk_usage` (files and bytes under a path).
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "BENCH_DIR",
    "out_dir",
    "drop_caches",
    "dd_ceiling",
    "run_child",
    "emit",
    "peak_rss_mib",
    "reset_peak_rss",
    "cpu_seconds",
    "current_rss_mib",
    "fsync_tree",
    "median",
    "markdown_table",
    "load_average",
    "remove",
    "parse_size",
    "disk_usage",
    "SEED",
    "Spec",
    "workload_spec",
    "np_dtype",
    "make_array",
    "spec_bytes",
    "bits",
    "to_torch",
    "from_torch",
]

BENCH_DIR = Path(__file__).resolve().parent


def out_dir() -> Path:
    """``bench/out/``: on the repo's disk and git-ignored."""
    d = BENCH_DIR / "out"
    d.mkdir(parents=True, exist_ok=True)
    return d


def drop_caches() -> bool:
    """``sync`` and drop the page cache (needs root). Returns whether it worked."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def dd_ceiling(directory: str | os.PathLike[str], size_mib: int = 1024) -> dict[str, float]:
    """Write then read ``size_mib`` MiB with ``dd`` and direct I/O in ``directory``.

    The write uses ``oflag=direct conv=fsync``, the read ``iflag=direct``, both
    with 16 MiB blocks, so neither the page cache nor dirty-page writeback is
    measured. Returns ``{"bytes", "write_s", "read_s", "write_gbps", "read_gbps"}``
    (GB = 1e9 bytes).
    """
    path = Path(directory) / "dd_ceiling.bin"
    count = max(1, size_mib // 16)
    nbytes = count * (16 << 20)
    try:
        t0 = time.perf_counter()
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", "oflag=direct",
             "conv=fsync", "status=none"],
            check=True,
        )
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        subprocess.run(
            ["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct", "status=none"], check=True
        )
        read_s = time.perf_counter() - t0
    finally:
        path.unlink(missing_ok=True)
    return {
        "bytes": nbytes,
        "write_s": write_s,
        "read_s": read_s,
        "write_gbps": nbytes / write_s / 1e9,
        "read_gbps": nbytes / read_s / 1e9,
    }


def emit(result: dict[str, Any]) -> None:
    """Print a child's result as the last line of stdout (read by :func:`run_child`)."""
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()


def run_child(
    script: str | os.PathLike[str],
    args: Sequence[str],
    *,
    timeout: float = 1800,
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
) -> dict[str, Any]:
    """Run ``prefix... python script args...`` in a fresh process; its :func:`emit` result.

    Raises RuntimeError with the child's output tail when it fails or emits nothing.
    """
    cmd = [*prefix, sys.executable, os.fspath(script), *args]
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    last = None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            last = line
            break
    if proc.returncode != 0 or last is None:
        tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-3000:]).strip()
        raise RuntimeError(f"child {' '.join(cmd)} failed (rc {proc.returncode}):\n{tail}")
    return json.loads(last)


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (``ru_maxrss``), MiB."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024 if sys.platform != "darwin" else kib / (1 << 20)


def reset_peak_rss() -> bool:
    """Make the peak RSS (``VmHWM``, ``ru_maxrss``) restart from the current RSS.

    Writes 5 to ``/proc/self/clear_refs`` (Linux 4.0+). Returns False where that is
    not possible; the peak then stays the process's lifetime peak.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
    except OSError:
        return False
    return True


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, all threads."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def current_rss_mib() -> float:
    """Current resident set size of this process, MiB (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def fsync_tree(path: str | os.PathLike[str]) -> int:
    """fsync every file and directory under ``path`` (or the file and its directory).

    Returns the number of fsync calls made.
    """
    p = Path(path)
    n = 0

    def sync(q: Path, flags: int) -> None:
        nonlocal n
        fd = os.open(q, flags)
        try:
            os.fsync(fd)
            n += 1
        finally:
            os.close(fd)

    if p.is_dir():
        for root, _dirs, files in os.walk(p):
            for name in files:
                sync(Path(root) / name, os.O_RDONLY)
            sync(Path(root), os.O_RDONLY | os.O_DIRECTORY)
    else:
        sync(p, os.O_RDONLY)
    sync(p.parent, os.O_RDONLY | os.O_DIRECTORY)
    return n


def parse_size(s: str | int) -> int:
    """Bytes of ``"262144"``, ``"256K"``, ``"4M"``, ``"1GiB"``."""
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"(\d+)([KMG]?)(i?B)?", s.strip(), re.IGNORECASE)
    if not m:
        raise SystemExit(f"cannot read size {s!r} (e.g. 262144, 256K, 4M)")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def disk_usage(path: Path) -> tuple[int, int]:
    """(files, bytes) under ``path``."""
    files = nbytes = 0
    for root, _dirs, names in os.walk(path):
        for n in names:
            files += 1
            nbytes += os.path.getsize(os.path.join(root, n))
    return files, nbytes


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats are printed with 3 significant digits."""

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            if v != v:
                return "-"
            if abs(v) >= 100:
                return f"{v:.0f}"
            return f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def load_average() -> str:
    """``uptime``'s load averages, e.g. ``"0.52 0.61 0.70"``."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def remove(path: str | os.PathLike[str]) -> None:
    """Remove a file or directory tree if it exists."""
    p = Path(path)
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()


# ---------------------------------------------------------------------------
# Workloads (data seeded, identical for every system and every benchmark)

SEED = 20261123
Spec = list[tuple[str, tuple[int, ...], str]]


def workload_spec(name: str, size_gib: float, dims: tuple[int, int, int] = (1024, 2816, 32000)) -> Spec:
    """``(name, shape, dtype)`` of every tensor of a workload, in save order.

    W1: a small LLM's matrices (embedding and MLP float32; attention and lm_head
    bfloat16; norms small float32 vectors), hidden size, MLP width and vocabulary
    ``dims``, as many layers as make ``size_gib``. W2: 20,000 tensors of 256 float32.
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


def np_dtype(name: str) -> Any:
    """numpy dtype of a dtype name (``bfloat16`` from ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def make_array(index: int, shape: tuple[int, ...], dtype: str) -> Any:
    """Tensor ``index`` of a workload: seeded normals, cast to ``dtype``."""
    rng = np.random.default_rng((SEED, index))
    x = rng.standard_normal(math.prod(shape), dtype=np.float32)
    if dtype != "float32":
        x = x.astype(np_dtype(dtype))
    return x.reshape(shape)


def spec_bytes(spec: Spec) -> int:
    return sum(math.prod(s) * np_dtype(d).itemsize for _, s, d in spec)


def bits(a: Any) -> Any:
    """``a`` viewed as unsigned integers of its item size (bit-exact comparison)."""
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def to_torch(a: Any) -> Any:
    """A numpy array as a torch tensor sharing its memory (bfloat16 included)."""
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def from_torch(t: Any) -> Any:
    """A CPU torch tensor as a numpy array sharing its memory (bfloat16 via ml_dtypes)."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np_dtype("bfloat16"))
    return t.numpy()


def run_ranks(target: Any, world: int, cfg: dict[str, Any], timeout: float) -> list[Any]:
    """Spawn `world` processes running `target(rank, world, port, cfg, queue)` on a free
    127.0.0.1 port; each puts `(rank, ok, value)` on the queue. Returns the values by rank;
    exits with the failing rank's traceback, or when they do not finish in `timeout` s."""
    import multiprocessing as mp
    import queue
    import socket

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(r, world, port, cfg, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world:
            try:
                rank, ok, value = q.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                raise SystemExit(f"ranks did not finish in {timeout} s; finished: {sorted(got)}") from None
            if not ok:
                raise SystemExit(f"rank {rank} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(world)]
