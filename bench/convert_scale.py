"""Conversion at scale: ``xckpt convert --workers N`` and under ``torchrun``, against a per-file script.

Workload: a Hugging Face directory of a few GB (``--size-gb``, default 4) written by
``safetensors.torch.save_file``: files of about 330 MB, each three bfloat16
[4096, 8192] matrices (64 MiB), one [8192, 8192] (128 MiB, the largest tensor) and a
few small vectors, on /dev/shm (``--dir``; the bench says when it must use another
place because /dev/shm is too small). Rows, each a fresh process timed from outside
(wall seconds; CPU seconds, user + system, of every process it started, steadier than
wall time on a shared machine; the peak RSS of the largest process it started, workers
included, from ``RUSAGE_CHILDREN``), medians of ``--repeat`` (3) runs, with bytecode
cached as an installed package has it (``PYTHONDONTWRITEBYTECODE`` dropped, the cache in
``bench/out/pycache``, warmed before the first row):

- ``xckpt convert SRC DST --workers 1`` and ``--workers 2``, and ``torchrun
  --nproc_per_node=2 -m xckpt.cli convert``, to xckpt and to a Hugging Face directory
  (``--max-shard-size 1GB``; xckpt's parts are 1 GiB by default), with ``--no-verify``
  (the per-file script checks nothing either) and, for xckpt, with verify;
- what a user writes today: a per-file torch script (``safetensors.torch.load_file``,
  ``save_file``), one process per file, 1 or 2 at a time.

Targets (issue 32): 2 xckpt processes at least 1.5x the per-file script's throughput
with 2 processes; peak RSS per process at most 2x the largest tensor + 300 MB.

Dequantization rows (``--suite dequant``): a DeepSeek-V3 style block-scaled fp8 Hugging
Face directory (``--fp8-size-gb``, default 2, of float8_e4m3fn matrices with float32
``*.weight_scale_inv`` per 128 x 128 block, shapes of 8200 and 576 rows that are not
multiples of 128, bfloat16 norms and an embedding; written by ``bench/_convert_fp8.py``)
converted to bfloat16 safetensors (``--rules fp8_block_dequant --max-shard-size 500MB``)
by ``--workers 1``, ``--workers 2`` and ``torchrun --nproc_per_node=2``, and by the
per-file torch script that loads each file, runs DeepSeek's ``weight_dequant`` math in
torch on the CPU and saves it, one process per file, 2 at a time (the same number of
processes; one at a time would take a minute a GB on 2 cores). After the rows the
bench checks that xckpt's output and the script's hold the same tensors, bit for bit.
One more row runs ``--workers 1`` pinned to one core (``taskset -c 0``): a worker overlaps
its reads and writes on two threads, so unpinned on 2 cores ``--workers 1`` already uses more
than one; the pinned row is the base for the throughput per core (N workers on N cores).
Targets (issue 32): ``--workers 2`` at least 1.6x the throughput of ``--workers 1``; at least
1.5x the per-file script with 2 processes; peak RSS per process at most 2x the largest
(bfloat16) tensor + 300 MB.

Usage, from the repository root::

    python bench/convert_scale.py                       # all rows: 4 GB plain, 2 GB fp8
    python bench/convert_scale.py --suite dequant       # the fp8 -> bf16 rows only (3-4 min on 2 idle cores)
    python bench/convert_scale.py --suite plain --size-gb 0.5 --repeat 1

Results: a markdown table on stdout and ``bench/out/convert_scale.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import load_average, markdown_table, median, out_dir  # noqa: E402
from _convert_fp8 import LARGEST_OUT, make_fp8_source  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILE_TENSORS = [("q", (4096, 8192)), ("k", (4096, 8192)), ("v", (4096, 8192)), ("mlp", (8192, 8192))]
LARGEST = 8192 * 8192 * 2

_PER_FILE = r"""
import sys
from safetensors.torch import load_file, save_file
src, dst, dequant = sys.argv[1:4]
sd = load_file(src)
if dequant:
    sys.path.insert(0, sys.argv[4])
    from _convert_fp8 import dequant
    sd = dequant(sd)
save_file(sd, dst, metadata={"format": "pt"})
"""


def make_source(path: str, size_gb: float) -> int:
    """The Hugging Face directory, written by safetensors' own save_file; its tensor bytes."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    per_file = sum(2 * a * b for _, (a, b) in FILE_TENSORS)
    files = max(2, round(size_gb * 1e9 / per_file))
    os.makedirs(path)
    weight_map, total = {}, 0
    for i in range(files):
        rng = np.random.default_rng(i)
        sd = {}
        for name, shape in FILE_TENSORS:
            bits = rng.integers(0, 0x3F80, shape, dtype=np.uint16)  # finite bf16 values in [0, 1)
            sd[f"layers.{i}.{name}.weight"] = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
        for j in range(4):
            sd[f"layers.{i}.norm{j}.weight"] = torch.ones(8192, dtype=torch.bfloat16)
        fname = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        save_file(sd, os.path.join(path, fname), metadata={"format": "pt"})
        for k, t in sd.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def child(argv: list[str]) -> None:
    """Run one command (or the per-file script over a directory) and print its time and peak RSS."""
    t = time.perf_counter()
    if argv[0] == "per-file":
        _, src, dst, procs, dequant = argv
        os.makedirs(dst)
        files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
        running: list[subprocess.Popen[bytes]] = []
        for f in files:
            while len(running) >= int(procs):
                running.pop(0).wait()
            running.append(subprocess.Popen([sys.executable, "-c", _PER_FILE, os.path.join(src, f),
                                             os.path.join(dst, f), dequant, os.path.dirname(os.path.abspath(__file__))]))
        codes = [p.wait() for p in running]
        if any(codes):
            raise SystemExit(f"per-file script failed: {codes}")
    else:
        subprocess.run(argv, check=True)
    seconds = time.perf_counter() - t
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    rss = ru.ru_maxrss / 1024  # KiB -> MiB (Linux)
    print(json.dumps({"seconds": seconds, "cpu_s": ru.ru_utime + ru.ru_stime, "peak_rss_mib": rss}))


def _run(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *argv], capture_output=True, text=True,
                       env=env)
    if r.returncode != 0:
        raise SystemExit(f"{argv} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


PLAIN_ANCHOR = "per-file torch script, 2 process(es)"
DEQUANT_ANCHOR = "fp8 -> bf16, per-file torch script, 2 process(es)"
ONE_CORE = "fp8 -> bf16, --workers 1 on 1 core"


def rows(src: str, fp8: str, work: str, suite: str) -> list[tuple[str, list[str]]]:
    """(label, argv) of every row of `suite`."""
    cli = [sys.executable, "-m", "xckpt.cli", "--no-progress", "convert"]
    tr = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "xckpt.cli",
          "--no-progress", "convert"]
    how = [("--workers 1", cli, ["--workers", "1"]), ("--workers 2", cli, ["--workers", "2"]), ("torchrun x2", tr, [])]
    out = []
    if suite in ("plain", "all"):
        for to, extra in [("xckpt", ["--to", "xckpt"]), ("safetensors", ["--to", "safetensors", "--max-shard-size", "1GB"])]:
            for label, head, tail in how:
                out.append((f"HF -> {to}, {label}, no verify", [*head, src, f"{work}/out", *extra, *tail, "--no-verify"]))
            if to == "xckpt":
                for n in ("1", "2"):
                    out.append((f"HF -> xckpt, --workers {n}, verify", [*cli, src, f"{work}/out", *extra, "--workers", n]))
        for p in ("1", "2"):
            out.append((f"per-file torch script, {p} process(es)", ["per-file", src, f"{work}/out", p, ""]))
    if suite in ("dequant", "all"):
        deq = ["--to", "safetensors", "--max-shard-size", "500MB", "--rules", "fp8_block_dequant", "--no-verify"]
        for label, head, tail in how:
            out.append((f"fp8 -> bf16, {label}", [*head, fp8, f"{work}/out", *deq, *tail]))
        # one worker overlaps its reads and writes on two threads: this row is one worker's
        # throughput on one core, the base of the scaling per core (N workers on N cores)
        out.append((ONE_CORE, ["taskset", "-c", "0", *cli, fp8, f"{work}/out", *deq, "--workers", "1"]))
        out.append((DEQUANT_ANCHOR, ["per-file", fp8, f"{work}/out", "2", "1"]))
    return out


def check_same(a: str, b: str) -> int:
    """Compare the tensors of two safetensors directories bit for bit; the number compared."""
    import torch
    from safetensors import safe_open

    def where(d: str) -> dict[str, str]:
        m: dict[str, str] = {}
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(d, f), "pt") as h:
                    m.update(dict.fromkeys(h.keys(), os.path.join(d, f)))
        return m

    wa, wb = where(a), where(b)
    if set(wa) != set(wb):
        raise SystemExit(f"different tensors: {sorted(set(wa) ^ set(wb))[:5]}")
    for k in sorted(wa):
        with safe_open(wa[k], "pt") as ha, safe_open(wb[k], "pt") as hb:
            x, y = ha.get_tensor(k), hb.get_tensor(k)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            raise SystemExit(f"{k}: xckpt's output differs from the per-file script's")
    return len(wa)


def _place(want: str, need: float) -> str:
    """`want`, or a place on the repository's disk when `want`'s has less than `need` bytes free."""
    base = os.path.dirname(want.rstrip("/")) or "/"
    if os.path.isdir(base) and shutil.disk_usage(base).free >= need:
        return want
    alt = os.path.join(out_dir(), "convert_scale_work")
    print(f"note: {base} has {shutil.disk_usage(base).free / 1e9:.1f} GB free, {need / 1e9:.1f} GB needed; "
          f"using {alt}", file=sys.stderr)
    return alt


def _env() -> dict[str, str]:
    """The rows' environment: one BLAS thread, gloo on loopback, this checkout first, and
    bytecode cached (in ``bench/out/pycache``) as an installed package has it: where
    ``PYTHONDONTWRITEBYTECODE`` is set (as in some sandboxes) every run would compile
    xckpt's modules again (0.4 CPU s on the 2-core machine), which no installed copy does."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONPYCACHEPREFIX": str(out_dir() / "pycache")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def warm_bytecode() -> None:
    """Import what the rows import once, so that no row pays for compiling it."""
    subprocess.run([sys.executable, "-c", "import xckpt.cli, safetensors, torch, torch.distributed.run"],
                   env=_env(), check=True)


def _measure(label: str, argv: list[str], work: str, nbytes: int, repeat: int, keep: str | None) -> dict[str, Any]:
    """Run one row `repeat` times (each into a fresh `work/out`); its medians. `keep`: move the last output there."""
    env = _env()
    runs = []
    for _ in range(repeat):
        shutil.rmtree(os.path.join(work, "out"), ignore_errors=True)
        runs.append(_run(argv, env))
    if keep:
        os.replace(os.path.join(work, "out"), keep)
    shutil.rmtree(os.path.join(work, "out"), ignore_errors=True)
    sec = median([r["seconds"] for r in runs])
    cpu = median([r["cpu_s"] for r in runs])
    rss = max(r["peak_rss_mib"] for r in runs)
    print(f"{label}: {sec:.2f} s, {cpu:.2f} CPU s, {nbytes / sec / 1e9:.2f} GB/s, peak RSS {rss:.0f} MiB",
          file=sys.stderr)
    return {"row": label, "seconds": sec, "cpu_s": cpu, "gb_per_s": nbytes / sec / 1e9, "peak_rss_mib": rss,
            "runs": runs}


def _table(results: list[dict[str, Any]]) -> list[list[str]]:
    """The rows as text, each against its suite's per-file script with 2 processes and its `--workers 1`."""
    base = {r["row"]: r for r in results}
    table = [["row", "seconds", "GB/s", "vs per-file x2", "vs --workers 1", "vs 1 worker on 1 core", "CPU s",
              "peak RSS MiB"]]
    for r in results:
        fp8 = r["row"].startswith("fp8")
        anchor = base.get(DEQUANT_ANCHOR if fp8 else PLAIN_ANCHOR)
        one = base.get(r["row"].split(", ")[0] + ", --workers 1" + ("" if fp8 else ", " + r["row"].split(", ")[-1]))
        core = base.get(ONE_CORE) if fp8 else None
        ratio = f"{anchor['seconds'] / r['seconds']:.2f}x" if anchor else "-"
        vs1 = f"{one['seconds'] / r['seconds']:.2f}x" if one and "per-file" not in r["row"] else "-"
        vs_core = f"{core['seconds'] / r['seconds']:.2f}x" if core and "per-file" not in r["row"] else "-"
        table.append([r["row"], f"{r['seconds']:.2f}", f"{r['gb_per_s']:.2f}", ratio, vs1, vs_core,
                      f"{r['cpu_s']:.1f}", f"{r['peak_rss_mib']:.0f}"])
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", nargs=argparse.REMAINDER)
    p.add_argument("--suite", choices=("all", "plain", "dequant"), default="all",
                   help="plain: the re-shard rows; dequant: the fp8 -> bf16 rows; all: both (default)")
    p.add_argument("--size-gb", type=float, default=4.0, help="the plain rows' bfloat16 source (default 4)")
    p.add_argument("--fp8-size-gb", type=float, default=2.0, help="the dequant rows' fp8 source (default 2)")
    p.add_argument("--dir", default="/dev/shm/xckpt-convert-scale")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--only", default="", help="keep rows whose label holds this text")
    args = p.parse_args()
    if args.child:
        child(args.child)
        return
    plain, deq = args.suite in ("all", "plain"), args.suite in ("all", "dequant")
    # plain: the source, an output, slack; dequant: the source and three bf16 outputs (twice its size)
    need = (3.2 * args.size_gb if plain else 0) + (7.5 * args.fp8_size_gb if deq else 0)
    work = _place(args.dir, need * 1e9)
    shutil.rmtree(work, ignore_errors=True)
    src, fp8 = os.path.join(work, "src"), os.path.join(work, "fp8")
    total = make_source(src, args.size_gb) if plain else 0
    fp8_total, fp8_out = make_fp8_source(fp8, args.fp8_size_gb) if deq else (0, 0)
    warm_bytecode()
    load = load_average()
    results = []
    kept = {"fp8 -> bf16, --workers 2": os.path.join(work, "keep-xckpt"), DEQUANT_ANCHOR: os.path.join(work, "keep-script")}
    for label, argv in rows(src, fp8, work, args.suite):
        if not args.only or args.only in label:
            nbytes = fp8_total if label.startswith("fp8") else total
            results.append(_measure(label, argv, work, nbytes, args.repeat, kept.get(label)))
    same = None
    if all(os.path.isdir(d) for d in kept.values()):
        same = check_same(*kept.values())
        print(f"checked: xckpt's bf16 output and the per-file script's hold the same {same} tensors, bit for bit",
              file=sys.stderr)
    table = _table(results)
    if plain:
        print(f"plain source: {total / 1e9:.2f} GB in {len(os.listdir(src)) - 1} files, largest tensor "
              f"{LARGEST >> 20} MiB (RSS target {2 * (LARGEST >> 20) + 300} MiB)")
    if deq:
        print(f"fp8 source: {fp8_total / 1e9:.2f} GB in {len(os.listdir(fp8)) - 1} files ({fp8_out / 1e9:.2f} GB of "
              f"bfloat16 out), largest output tensor {LARGEST_OUT >> 20} MiB (RSS target "
              f"{2 * (LARGEST_OUT >> 20) + 300} MiB)")
    print(f"cores {os.cpu_count()}, load average before {load}, after {load_average()}, at {work}")
    print(markdown_table(table[0], table[1:]))
    with open(os.path.join(out_dir(), "convert_scale.json"), "w") as f:
        json.dump({"bytes": total, "fp8_bytes": fp8_total, "cores": os.cpu_count(), "dir": work, "checked": same,
                   "load_before": load, "load_after": load_average(), "results": results}, f, indent=1)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
