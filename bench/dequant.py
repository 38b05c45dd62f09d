"""Dequantization per core: xckpt's fp8 and MXFP4 rules against the torch code people run today.

One CPU core, every measurement in a fresh process (``torch.set_num_threads(1)``,
``OMP_NUM_THREADS=1``), timed in CPU seconds of the process (steadier than wall time on a
shared machine), median of ``--repeats``. Throughput is MB of quantized input per CPU second
(fp8: 1 byte an element; MXFP4: the ``*_blocks`` bytes, 2 values a byte).

fp8 (DeepSeek-V3 block-scaled, 128 x 128 blocks, ``--rows`` x 7168 float8_e4m3fn -> bfloat16):

- ``fp8 kernel``      `xckpt._dequant.dequant_fp8_block` on arrays in memory
- ``fp8 torch``       the anchor: DeepSeek's `weight_dequant` math in torch on the CPU,
                      `(w.float().view(m, 128, n, 128) * s[:, None, :, None]).to(bfloat16)`
                      (the fastest form a per-file script can write; shapes are multiples of 128)
- ``fp8 open+read``   a safetensors file on /dev/shm read through
                      `xckpt.open(path, rules="fp8_block_dequant").read(name)`: file to bf16 array
- ``fp8 script``      its anchor: `safetensors.torch.load_file` and the torch math above

MXFP4 (gpt-oss experts, ``--experts`` x 5760 x 90 x 16 blocks -> bfloat16, transformers' layout):

- ``mxfp4 kernel``        `xckpt._dequant.dequant_mxfp4` on arrays in memory (before the transpose)
- ``mxfp4 transformers``  the anchor: `transformers.integrations.mxfp4.convert_moe_packed_tensors`
                          on the CPU (its output is transposed and contiguous)
- ``mxfp4 open+read``     `xckpt.open(path, rules="mxfp4_dequant").read(name)`: file to the
                          transposed bf16 array, as transformers lays it out

Every result is checked bit for bit against its anchor (outside the timed region).

Usage, from the repository root::

    .venv/bin/python bench/dequant.py                 # 3 repeats, 8192 rows, 2 experts
    .venv/bin/python bench/dequant.py --rows 16384 --experts 4 --repeats 5

Results: a markdown table on stdout and ``bench/out/dequant.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from _common import cpu_seconds, emit, load_average, markdown_table, median, out_dir, run_child

CASES = ("fp8 kernel", "fp8 torch", "fp8 open+read", "fp8 script", "mxfp4 kernel", "mxfp4 transformers", "mxfp4 open+read")
ANCHOR = {"fp8 kernel": "fp8 torch", "fp8 open+read": "fp8 script", "mxfp4 kernel": "mxfp4 transformers",
          "mxfp4 open+read": "mxfp4 transformers"}
COLS = 7168


def _data(case: str, rows: int, experts: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(20261128)
    if case.startswith("fp8"):
        raw = torch.randint(0, 256, (rows, COLS), dtype=torch.uint8, generator=g)
        raw[(raw & 0x7F) == 0x7F] = 0x7E  # no NaN
        return {"w": raw.view(torch.float8_e4m3fn), "w_scale_inv": torch.rand(rows // 128, COLS // 128, generator=g) * 1e-3}
    return {
        "x_blocks": torch.randint(0, 256, (experts, 5760, 90, 16), dtype=torch.uint8, generator=g),
        "x_scales": torch.randint(112, 136, (experts, 5760, 90), dtype=torch.uint8, generator=g),
    }


def _torch_fp8(w: Any, s: Any) -> Any:
    import torch

    m, n = w.shape
    return (w.float().view(m // 128, 128, n // 128, 128) * s[:, None, :, None]).view(m, n).to(torch.bfloat16)


def _torch_mxfp4(blocks: Any, scales: Any) -> Any:
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # imported before the timing

    return convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)


def child(case: str, rows: int, experts: int) -> None:
    """One timed run of ``case`` in this fresh process; emits its throughput."""
    import ml_dtypes
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    import xckpt
    from xckpt._dequant import dequant_fp8_block, dequant_mxfp4

    torch.set_num_threads(1)
    if case.startswith("mxfp4"):
        import transformers.integrations.mxfp4  # noqa: F401  (imports are not what is timed)
    data = _data(case, rows, experts)
    path = f"/dev/shm/xckpt-bench-dequant-{os.getpid()}.safetensors"
    fp8 = case.startswith("fp8")
    in_bytes = (data["w"] if fp8 else data["x_blocks"]).numel()
    if "open" in case or "script" in case:
        save_file(data, path)
    try:
        c0, t0 = cpu_seconds(), time.perf_counter()
        if case == "fp8 kernel":
            out = np.empty((rows, COLS), ml_dtypes.bfloat16)
            w = data["w"].view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
            dequant_fp8_block(w, data["w_scale_inv"].numpy(), (0, 0), (128, 128), out)
        elif case == "fp8 torch":
            out = _torch_fp8(data["w"], data["w_scale_inv"])
        elif case == "fp8 script":
            loaded = load_file(path)
            out = _torch_fp8(loaded["w"], loaded["w_scale_inv"])
        elif case == "mxfp4 kernel":
            b = data["x_blocks"]
            out = np.empty((*b.shape[:2], b.shape[2] * 32), ml_dtypes.bfloat16)
            dequant_mxfp4(b.numpy(), data["x_scales"].numpy(), out)
        elif case == "mxfp4 transformers":
            out = _torch_mxfp4(data["x_blocks"], data["x_scales"])
        else:
            with xckpt.open(path, rules="fp8_block_dequant" if fp8 else "mxfp4_dequant") as src:
                out = src.read("w" if fp8 else "x")
        cpu, wall = cpu_seconds() - c0, time.perf_counter() - t0
        want = _torch_fp8(data["w"], data["w_scale_inv"]) if fp8 else _torch_mxfp4(data["x_blocks"], data["x_scales"])
        want = want.transpose(1, 2) if case == "mxfp4 kernel" else want  # the kernel's layout: before the transpose
        got = torch.from_numpy(out.view(np.int16)) if isinstance(out, np.ndarray) else out.view(torch.int16)
        if not torch.equal(got, want.contiguous().view(torch.int16)):
            raise SystemExit(f"{case}: the result differs from the anchor")
    finally:
        if os.path.exists(path):
            os.remove(path)
    emit({"case": case, "cpu_s": cpu, "wall_s": wall, "in_bytes": in_bytes})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8192, help="rows of the fp8 weight (a multiple of 128)")
    p.add_argument("--experts", type=int, default=2, help="experts of the MXFP4 tensor (5760 x 90 x 16 each)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child, a.rows, a.experts)
        return
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CASES}
    for _ in range(a.repeats):
        for case in CASES:  # interleaved, so load changes hit every case alike
            runs[case].append(run_child(__file__, ["--child", case, "--rows", str(a.rows), "--experts", str(a.experts)], env=env))
    speed = {c: median([r["in_bytes"] / r["cpu_s"] / 1e6 for r in rs]) for c, rs in runs.items()}
    rows = [[c, runs[c][0]["in_bytes"] / 1e6, median([r["cpu_s"] for r in runs[c]]), speed[c],
             speed[c] / speed[ANCHOR[c]] if c in ANCHOR else "anchor"] for c in CASES]
    table = markdown_table(["case", "input MB", "CPU s", "MB/s per core", "x anchor"], rows)
    print(table)
    print(f"\nload average {load_average()}, {a.repeats} repeats, python {sys.version.split()[0]}")
    (out_dir() / "dequant.json").write_text(json.dumps({"args": vars(a), "runs": runs, "mb_s": speed}, indent=1))


if __name__ == "__main__":
    main()
