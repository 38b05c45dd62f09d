"""Conversion at scale: ``xckpt convert --workers N`` and under ``torchrun``, against a per-file script.

Workload: a Hugging Face directory of a few GB (``--size-gb``, default 4) written by
``safetensors.torch.save_file``: files of about 330 MB, each three bfloat16
[4096, 8192] matrices (64 MiB), one [8192, 8192] (128 MiB, the largest tensor) and a
few small vectors, on /dev/shm (``--dir``; the bench says when it must use another
place because /dev/shm is too small). Rows, each a fresh process timed from outside
(wall seconds; CPU seconds, user + system, of every process it started, steadier than
wall time on a shared machine; the peak RSS of the largest process it started, workers
included, from ``RUSAGE_CHILDREN``), medians of ``--repeat`` (3) runs:

- ``xckpt convert SRC DST --workers 1`` and ``--workers 2``, and ``torchrun
  --nproc_per_node=2 -m xckpt.cli convert``, to xckpt and to a Hugging Face directory
  (``--max-shard-size 1GB``; xckpt's parts are 1 GiB by default), with ``--no-verify``
  (the per-file script checks nothing either) and, for xckpt, with verify;
- what a user writes today: a per-file torch script (``safetensors.torch.load_file``,
  ``save_file``), one process per file, 1 or 2 at a time.

Targets (issue 32): 2 xckpt processes at least 1.5x the per-file script's throughput
with 2 processes; peak RSS per process at most 2x the largest tensor + 300 MB.

Dequantization rows (fp8 -> bf16; 2 workers at least 1.6x of 1) need a rule set that
dequantizes: ``--rules NAME --rules-source DIR`` adds, for that source, ``xckpt convert
--rules NAME`` rows (1 and 2 workers, torchrun) and the per-file script with
``--per-file-dequant MODULE:FUNCTION`` (a function from a state dict of torch tensors
to the dequantized one, DeepSeek's ``weight_dequant`` per tensor pair). HOOK: the lead
adds these rows once the fp8 rule set is merged.

Usage, from the repository root::

    python bench/convert_scale.py                       # 4 GB, all rows
    python bench/convert_scale.py --size-gb 0.5 --repeat 1

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
from _common import markdown_table, median, out_dir  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILE_TENSORS = [("q", (4096, 8192)), ("k", (4096, 8192)), ("v", (4096, 8192)), ("mlp", (8192, 8192))]
LARGEST = 8192 * 8192 * 2

_PER_FILE = r"""
import sys
from safetensors.torch import load_file, save_file
src, dst, dequant = sys.argv[1:4]
sd = load_file(src)
if dequant:
    import importlib
    mod, fn = dequant.split(":")
    sd = getattr(importlib.import_module(mod), fn)(sd)
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
            running.append(
                subprocess.Popen([sys.executable, "-c", _PER_FILE, os.path.join(src, f), os.path.join(dst, f), dequant])
            )
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


def rows(src: str, work: str, args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    cli = [sys.executable, "-m", "xckpt.cli", "--no-progress", "convert"]
    tr = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "xckpt.cli",
          "--no-progress", "convert"]
    out = []
    for to, extra in [("xckpt", ["--to", "xckpt"]), ("safetensors", ["--to", "safetensors", "--max-shard-size", "1GB"])]:
        for label, head, tail in [("--workers 1", cli, ["--workers", "1"]), ("--workers 2", cli, ["--workers", "2"]),
                                  ("torchrun x2", tr, [])]:
            out.append((f"HF -> {to}, {label}, no verify", [*head, src, f"{work}/out", *extra, *tail, "--no-verify"]))
        if to == "xckpt":
            for n in ("1", "2"):
                out.append((f"HF -> xckpt, --workers {n}, verify", [*cli, src, f"{work}/out", *extra, "--workers", n]))
    for p in ("1", "2"):
        out.append((f"per-file torch script, {p} process(es)", ["per-file", src, f"{work}/out", p, ""]))
    if args.rules:  # HOOK: the dequantization rows (fp8 -> bf16), once a rule set that dequantizes exists
        q = args.rules_source
        for label, head, tail in [("--workers 1", cli, ["--workers", "1"]), ("--workers 2", cli, ["--workers", "2"]),
                                  ("torchrun x2", tr, [])]:
            out.append((f"dequant {args.rules}, {label}", [*head, q, f"{work}/out", "--to", "safetensors",
                                                          "--max-shard-size", "1GB", "--rules", args.rules, *tail,
                                                          "--no-verify"]))
        for p in ("1", "2"):
            out.append((f"dequant, per-file torch script, {p} process(es)",
                        ["per-file", q, f"{work}/out", p, args.per_file_dequant or ""]))
    return out


def _place(want: str, size_gb: float) -> str:
    need = 3.2 * size_gb * 1e9
    base = os.path.dirname(want.rstrip("/")) or "/"
    if os.path.isdir(base) and shutil.disk_usage(base).free >= need:
        return want
    alt = os.path.join(out_dir(), "convert_scale_work")
    print(f"note: {base} has {shutil.disk_usage(base).free / 1e9:.1f} GB free, {need / 1e9:.1f} GB needed; "
          f"using {alt}", file=sys.stderr)
    return alt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", nargs=argparse.REMAINDER)
    p.add_argument("--size-gb", type=float, default=4.0)
    p.add_argument("--dir", default="/dev/shm/xckpt-convert-scale")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--only", default="", help="keep rows whose label holds this text")
    p.add_argument("--rules", help="HOOK: a rule set that dequantizes (adds the dequantization rows)")
    p.add_argument("--rules-source", help="the quantized checkpoint those rows convert")
    p.add_argument("--per-file-dequant", help="MODULE:FUNCTION the per-file script dequantizes with")
    args = p.parse_args()
    if args.child:
        child(args.child)
        return
    work = _place(args.dir, args.size_gb)
    shutil.rmtree(work, ignore_errors=True)
    src = os.path.join(work, "src")
    total = make_source(src, args.size_gb)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    results = []
    for label, argv in rows(src, work, args):
        if args.only and args.only not in label:
            continue
        runs = []
        for _ in range(args.repeat):
            shutil.rmtree(os.path.join(work, "out"), ignore_errors=True)
            runs.append(_run(argv, env))
        shutil.rmtree(os.path.join(work, "out"), ignore_errors=True)
        sec = median([r["seconds"] for r in runs])
        cpu = median([r["cpu_s"] for r in runs])
        rss = max(r["peak_rss_mib"] for r in runs)
        results.append({"row": label, "seconds": sec, "cpu_s": cpu, "gb_per_s": total / sec / 1e9,
                        "peak_rss_mib": rss, "runs": runs})
        print(f"{label}: {sec:.2f} s, {cpu:.2f} CPU s, {total / sec / 1e9:.2f} GB/s, peak RSS {rss:.0f} MiB",
              file=sys.stderr)
    base = {r["row"]: r for r in results}
    anchor = base.get("per-file torch script, 2 process(es)")
    table = [["row", "seconds", "GB/s", "vs per-file x2", "CPU s", "peak RSS MiB"]]
    for r in results:
        ratio = f"{anchor['seconds'] / r['seconds']:.2f}x" if anchor else "-"
        table.append([r["row"], f"{r['seconds']:.2f}", f"{r['gb_per_s']:.2f}", ratio, f"{r['cpu_s']:.1f}",
                      f"{r['peak_rss_mib']:.0f}"])
    print(f"source: {total / 1e9:.2f} GB in {len(os.listdir(src)) - 1} files, largest tensor {LARGEST >> 20} MiB "
          f"(RSS target {2 * (LARGEST >> 20) + 300} MiB), cores {os.cpu_count()}, at {work}")
    print(markdown_table(table[0], table[1:]))
    with open(os.path.join(out_dir(), "convert_scale.json"), "w") as f:
        json.dump({"bytes": total, "cores": os.cpu_count(), "dir": work, "results": results}, f, indent=1)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
