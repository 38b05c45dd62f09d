"""Loading onto a GPU: xckpt's device pipeline against the pinned-copy peak, safetensors and DCP.

One process, one CUDA device. The state dict is W1 (``bench/_common.py``: a small
LLM's matrices, float32 and bfloat16) of about ``--size-gib`` GiB, saved three ways
into ``--dir`` (default ``bench/out/gpu``): xckpt (``xckpt.torch.save``), one
safetensors file (``safetensors.torch.save_file``) and torch DCP (``dcp.save``,
no process group). Measured, each a median over ``--repeats``, every load onto
the device and checked bit for bit afterwards:

- pinned peak      one pinned host tensor of the checkpoint's size,
                   ``.to("cuda", non_blocking=True)`` then synchronize: what PCIe gives
- pageable copy    the same from ordinary (pageable) host memory
- xckpt            ``xckpt.torch.load`` into CUDA tensors through one ``DeviceRing``
                   (``--ring-buffers`` x ``--buffer-mib``) reused across the repeats
- xckpt per-load ring  the same with a ring made per load (the default)
- xckpt load_full  ``xckpt.torch.load_full(path, device="cuda")``
- safetensors      ``safetensors.torch.load_file(path, device="cuda")``
- DCP              ``torch.distributed.checkpoint.load`` into CUDA tensors

GB/s is the checkpoint's bytes (1e9) over the seconds from the call to the device
holding every byte (a synchronize). ``--cold`` drops the page cache before every
load (root only); otherwise the files are in the page cache after the first
repeat and the loads measure the copy path, not the disk.

Without a CUDA device it exits with status 2 and says so; ``--plan`` prints what
would be measured and exits 0; ``--device cpu`` runs every step on the CPU (a
check of the benchmark itself, not a measurement).

Usage, from the repository root, on a machine with a GPU::

    .venv/bin/python bench/gpu.py                       # 2 GiB, 3 repeats, warm
    .venv/bin/python bench/gpu.py --size-gib 8 --cold
    .venv/bin/python bench/gpu.py --ring-buffers 4 --buffer-mib 256

Results: a markdown table on stdout and ``bench/out/gpu.json`` (not with ``--device cpu``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _common import (
    drop_caches,
    make_array,
    markdown_table,
    median,
    out_dir,
    remove,
    spec_bytes,
    to_torch,
    workload_spec,
)

#: W1 dims below 1 GiB: the default dims' embedding alone is 128 MiB.
SMALL_DIMS = (256, 704, 8000)

METHODS = (
    "pinned peak",
    "pageable copy",
    "xckpt",
    "xckpt per-load ring",
    "xckpt load_full",
    "safetensors",
    "DCP",
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=2.0, help="checkpoint size (default 2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ring-buffers", type=int, default=3, help="host buffers of the DeviceRing (default 3)")
    ap.add_argument("--buffer-mib", type=int, default=64, help="size of each ring buffer (default 64)")
    ap.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (default bench/out/gpu)")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every load (root)")
    ap.add_argument(
        "--methods", default=",".join(METHODS), help="comma-separated subset of: " + ", ".join(METHODS)
    )
    ap.add_argument(
        "--device", default="cuda", help="cuda (default), cuda:N, or cpu to check the script itself"
    )
    ap.add_argument("--plan", action="store_true", help="print what would be measured, then exit")
    args = ap.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"unknown methods {unknown}; choose from {list(METHODS)}")
    if args.repeats < 1 or args.ring_buffers < 1 or args.buffer_mib < 1 or args.size_gib <= 0:
        ap.error("--repeats, --ring-buffers, --buffer-mib and --size-gib must be positive")
    args.methods = methods
    return args


def spec_for(size_gib: float) -> Any:
    """W1 of about ``size_gib`` GiB (smaller dims under 1 GiB, so small runs stay small)."""
    if size_gib >= 1:
        return workload_spec("W1", size_gib)
    return workload_spec("W1", size_gib, SMALL_DIMS)


def plan_text(args: argparse.Namespace, spec: Any) -> str:
    total = spec_bytes(spec)
    return (
        f"device {args.device}; W1 {total / 2**30:.2f} GiB in {len(spec)} tensors; {args.repeats} repeats, "
        f"{'cold' if args.cold else 'warm'} page cache; DeviceRing({args.ring_buffers}, {args.buffer_mib} MiB); "
        f"methods: {', '.join(args.methods)}"
    )


def _timed(fn: Callable[[], Any], sync: Callable[[], None], cold: bool) -> tuple[float, Any]:
    if cold:
        drop_caches()
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def _same(a: Any, b: Any) -> bool:
    import torch

    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def run(args: argparse.Namespace) -> list[list[Any]]:
    import safetensors.torch
    import torch
    import torch.distributed.checkpoint as dcp

    # DCP warns that it runs in one process, which is what is measured here
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    import xckpt.torch as xt

    dev = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    spec = spec_for(args.size_gib)
    total = spec_bytes(spec)
    root = args.dir or out_dir() / "gpu"
    remove(root)
    root.mkdir(parents=True)
    host = {n: to_torch(make_array(i, s, d)) for i, (n, s, d) in enumerate(spec)}
    want = {n: t.to(dev) for n, t in host.items()}
    paths = {
        "xckpt": str(root / "xckpt"),
        "safetensors": str(root / "model.safetensors"),
        "dcp": str(root / "dcp"),
    }
    xt.save(host, paths["xckpt"])
    safetensors.torch.save_file(host, paths["safetensors"])
    dcp.save(host, checkpoint_id=paths["dcp"], no_dist=True)
    del host

    def empty() -> dict[str, Any]:
        return {n: torch.empty_like(t) for n, t in want.items()}

    ring = xt.DeviceRing(args.ring_buffers, args.buffer_mib << 20)
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    pageable = torch.empty(total, dtype=torch.uint8)
    gpu_buf = torch.empty(total, dtype=torch.uint8, device=dev)

    def xckpt_load(own: bool) -> dict[str, Any]:
        target = empty()
        xt.load(paths["xckpt"], target, ring=None if own else ring)
        return target

    def dcp_load() -> dict[str, Any]:
        target = empty()
        dcp.load(target, checkpoint_id=paths["dcp"], no_dist=True)
        return target

    steps: dict[str, Callable[[], Any]] = {
        "pinned peak": lambda: gpu_buf.copy_(pinned, non_blocking=True),
        "pageable copy": lambda: gpu_buf.copy_(pageable, non_blocking=True),
        "xckpt": lambda: xckpt_load(False),
        "xckpt per-load ring": lambda: xckpt_load(True),
        "xckpt load_full": lambda: xt.load_full(paths["xckpt"], device=dev),
        "safetensors": lambda: safetensors.torch.load_file(paths["safetensors"], device=str(dev)),
        "DCP": dcp_load,
    }
    times: dict[str, list[float]] = {m: [] for m in args.methods}
    exact: dict[str, bool] = {}
    for _rep in range(args.repeats):
        for m in args.methods:
            seconds, out = _timed(steps[m], sync, args.cold and m not in ("pinned peak", "pageable copy"))
            times[m].append(seconds)
            if isinstance(out, dict):
                exact[m] = exact.get(m, True) and all(_same(out[n], w) for n, w in want.items())
            del out
    peak = median(times["pinned peak"]) if "pinned peak" in times else float("nan")
    rows = []
    for m in args.methods:
        s = median(times[m])
        rows.append(
            [
                m,
                s,
                total / s / 1e9,
                peak / s * 100 if peak == peak else float("nan"),
                {True: "yes", False: "NO"}.get(exact.get(m), "-"),
            ]
        )
    remove(root)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    spec = spec_for(args.size_gib)
    if args.plan:
        print(plan_text(args, spec))
        return 0
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "bench/gpu.py measures loads onto a CUDA device and this machine has none "
            "(torch.cuda.is_available() is False). Run it on a machine with a GPU, or pass "
            "--plan to see what it would measure (--device cpu checks the script itself).",
            file=sys.stderr,
        )
        return 2
    if args.cold and not drop_caches():
        print("--cold needs root (to drop the page cache); run without --cold", file=sys.stderr)
        return 2
    print(plan_text(args, spec) + "\n")
    rows = run(args)
    headers = ["method", "seconds (median)", "GB/s", "% of pinned peak", "bit-exact"]
    print(markdown_table(headers, rows))
    if args.device.startswith("cuda"):
        device = torch.cuda.get_device_name(torch.device(args.device))
        path = out_dir() / "gpu.json"
        path.write_text(
            json.dumps(
                {"device": device, "config": plan_text(args, spec), "headers": headers, "rows": rows},
                indent=1,
            )
        )
        print(f"\n{device}; written: {path}")
    return 1 if any(r[-1] == "NO" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
