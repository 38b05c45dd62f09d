"""Streaming conversion keeps memory bounded: peak RSS growth well under the checkpoint's size.

A ~512 MiB torch DCP checkpoint is saved by 2 gloo ranks (8 tensors, rows sharded
over the ranks) and converted in a fresh subprocess, which
reports its peak resident set (mapped file pages included) beyond what it held
after importing and opening the source. ``dcp_to_torch_save``, which loads
everything first, is measured beside it for comparison.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from dist_utils import run_ranks

N_TENSORS, ROWS, COLS = 8, 4096, 4096  # 8 x 64 MiB float32
SIZE = N_TENSORS * ROWS * COLS * 4
LIMIT = 0.4

pytestmark = pytest.mark.slow


def _save_rank(rank: int, world: int, root: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    sd = {
        f"layers.{i}.w": DTensor.from_local(
            torch.randn(ROWS // world, COLS, generator=g), mesh, [Shard(0)], shape=(ROWS, COLS), stride=(COLS, 1)
        )
        for i in range(N_TENSORS)
    }
    sd["step"] = 5
    dcp.save(sd, checkpoint_id=os.path.join(root, "dcp"))


_CHILD = r"""
import json, os, sys, time

def rss(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024

src, dst, how = sys.argv[1:4]
import numpy, xckpt, xckpt.convert, xckpt.converters.safetensors_write
if how == "dcp_to_torch_save":
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
else:
    with xckpt.open(src) as s:  # metadata parsed once: imports and caches are in the baseline
        s.names()
base = rss("VmRSS:")
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
except OSError:
    pass
t = time.perf_counter()
if how == "dcp_to_torch_save":
    dcp_to_torch_save(src, dst)
else:
    xckpt.convert(src, dst, to_format=how)
print(json.dumps({"growth": rss("VmHWM:") - base, "seconds": time.perf_counter() - t}))
"""


def _measure(src: str, dst: str, how: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, src, dst, how],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("big")
    run_ranks(_save_rank, 2, str(root), timeout=300)
    return str(root)


def test_convert_memory_stays_bounded(saved, tmp_path):
    src = os.path.join(saved, "dcp")
    rows = []
    for how, dst in (("safetensors", "out.safetensors"), ("xckpt", "out_xckpt")):
        m = _measure(src, str(tmp_path / dst), how)
        rows.append((how, m))
        assert m["growth"] < LIMIT * SIZE, (how, m)
    rows.append(("dcp_to_torch_save", _measure(src, str(tmp_path / "ref.pt"), "dcp_to_torch_save")))
    print(f"\nDCP checkpoint of {SIZE / 2**20:.0f} MiB (2 ranks), peak RSS growth:")
    for how, m in rows:
        print(f"  -> {how:18s} {m['growth'] / 2**20:7.0f} MiB ({m['growth'] / SIZE:.2f}x)  {m['seconds']:.1f} s")
