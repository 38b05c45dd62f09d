"""Peak memory of converting a DeepSpeed ZeRO-2 checkpoint: growth of the resident set against its size.

Workload: a ZeRO-2 checkpoint of 2 data-parallel ranks with ~200 MB flat fp32 partitions per rank
(``--partition-mb``), written with ``torch.save`` in DeepSpeed's file layout by
``tests/ds_synth.py`` (no DeepSpeed needed): a small parameter first, then 8 MB matrices, so one
matrix straddles the ranks' partition boundary mid-row (read as one chunk assembled from both
ranks' pieces) and the others are one chunk each; Adam's ``exp_avg`` / ``exp_avg_sq`` beside the
masters, the bf16 module copy in the model states.

Each conversion runs in a fresh process (``bench/_common.run_child``), which opens the source
(imports and metadata in the baseline), restarts its peak RSS (``clear_refs``) and converts; it
reports ``VmHWM`` growth (mapped file pages included) and wall time. Outputs: xckpt (the default,
chunk by chunk) and one safetensors file (a whole tensor at a time).

Usage, from the repository root::

    .venv/bin/python bench/deepspeed_memory.py                  # 2 x 200 MB partitions
    .venv/bin/python bench/deepspeed_memory.py --partition-mb 50 --keep

Results: a markdown table on stdout and ``bench/out/deepspeed_memory.json``; the figure is
recorded in ``docs/sources-training.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BENCH_DIR, current_rss_mib, disk_usage, emit, markdown_table, out_dir, remove, run_child  # noqa: E402

ROWS, COLS = 1000, 2000  # 8 MB float32 matrices


def build(root: str, partition_mb: float) -> dict[str, Any]:
    """Write the checkpoint; return its sizes."""
    import numpy as np

    sys.path.insert(0, str(BENCH_DIR.parent / "tests"))
    from ds_synth import write_zero

    per_rank = int(partition_mb * 1e6 / 4)
    n = max(2, (2 * per_rank) // (ROWS * COLS))
    rng = np.random.default_rng(0)
    params = {"embed.bias": rng.standard_normal(7).astype(np.float32)}  # shifts the rank boundary mid-row
    params.update(
        {f"layers.{i}.weight": rng.standard_normal((ROWS, COLS), dtype=np.float32) for i in range(n)}
    )
    moments = {
        k: {m: rng.standard_normal(a.shape, dtype=np.float32) for m in ("exp_avg", "exp_avg_sq")}
        for k, a in params.items()
    }
    write_zero(root, [params], world=2, moments=moments, bf16=True)
    files, nbytes = disk_usage(root)
    return {
        "params": len(params),
        "checkpoint_bytes": nbytes,
        "files": files,
        "largest_tensor_bytes": ROWS * COLS * 4,
    }


def child(src: str, dst: str, fmt: str) -> None:
    import xckpt

    with xckpt.open(src) as s:  # imports and metadata parsing belong to the baseline
        s.names()
    base = current_rss_mib()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    t = time.perf_counter()
    xckpt.convert(src, dst, to_format=fmt, show_progress=False)
    seconds = time.perf_counter() - t
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))
    emit({"growth_mib": hwm - base, "seconds": seconds})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--partition-mb", type=float, default=200.0, help="fp32 partition per rank, MB (default 200)"
    )
    p.add_argument("--keep", action="store_true", help="keep the checkpoint and outputs")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(*a.child)
        return
    root = out_dir() / "deepspeed_memory"
    remove(str(root))
    src = str(root / "zero2")
    t = time.perf_counter()
    info = build(src, a.partition_mb)
    print(
        f"built {info['checkpoint_bytes'] / 1e6:.0f} MB in {time.perf_counter() - t:.0f} s", file=sys.stderr
    )
    rows = []
    results: dict[str, Any] = {"workload": info, "partition_mb": a.partition_mb, "runs": {}}
    for fmt, dst in (("xckpt", "out-xckpt"), ("safetensors", "out.safetensors")):
        r = run_child(__file__, ["--child", src, str(root / dst), fmt])
        ratio = r["growth_mib"] * 2**20 / info["checkpoint_bytes"]
        results["runs"][fmt] = {**r, "growth_over_checkpoint": ratio}
        rows.append(
            [
                f"deepspeed -> {fmt}",
                f"{info['checkpoint_bytes'] / 1e6:.0f} MB",
                f"{r['growth_mib']:.0f} MiB",
                f"{ratio:.3f}",
                f"{r['seconds']:.1f} s",
            ]
        )
        remove(str(root / dst))
    print(
        markdown_table(["conversion", "checkpoint", "peak RSS growth", "growth / checkpoint", "time"], rows)
    )
    (out_dir() / "deepspeed_memory.json").write_text(json.dumps(results, indent=1))
    if not a.keep:
        remove(str(root))


if __name__ == "__main__":
    main()
