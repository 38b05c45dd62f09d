"""Demo 1: the framework-free core. Four writers save one tensor in uneven row
blocks (as four ranks would, without talking); a reader opens the checkpoint
and reads it back in another layout, touching only the chunks it needs."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

import xckpt
from xckpt.layout import Box, Shard, mesh_boxes

root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/xckpt-demo") / "core"
shutil.rmtree(root, ignore_errors=True)

weight = np.arange(10 * 6, dtype=np.float32).reshape(10, 6)
emb = (np.arange(8 * 4, dtype=np.float32) / 7).astype(ml_dtypes.bfloat16).reshape(8, 4)

# Rows split over 4 ranks like torch.chunk: 3, 3, 3, 1.
layout = mesh_boxes(weight.shape, (4,), (Shard(0),))
print("save: 4 writers, weight rows split", [b.shape[0] for (bs) in layout.values() for b in bs])
for rank in range(4):
    w = xckpt.Writer(root, rank=rank, world_size=4, save_id="step-100")
    for box in layout[(rank,)]:
        w.write("weight", weight[box.slices()], global_shape=weight.shape, offset=box.offset)
    if rank == 0:
        w.write("emb", emb)
    w.write_object("step", 100)
    w.commit()
    print(f"  rank {rank} committed ranks/{rank}.json")

ck = xckpt.open(root)  # rank-local save: the reader merges ranks/0..3.json itself
print("open:", ck)
t = ck.info("weight")
print("  weight", t.dtype, t.shape, "chunks:", [str(c.box) for c in t.chunks])

# Read back as 3 ranks would (4, 3, 3 rows): each reads only overlapping chunks.
for r, box in enumerate(b for bs in mesh_boxes(weight.shape, (3,), (Shard(0),)).values() for b in bs):
    part = ck.read("weight", box.slices())
    needed = [str(c.box) for c in t.chunks if c.box.intersect(box)]
    assert np.array_equal(part, weight[box.slices()])
    print(f"  new rank {r} reads rows {box.offset[0]}:{box.end[0]} from chunks {needed}: equal")

got = xckpt.load(root)
assert got["emb"].tobytes() == emb.tobytes() and got["step"] == 100
print("load: every element equal (bf16 bit-exact), step =", got["step"])
xckpt.finalize(root, world_size=4, save_id="step-100")
print("finalize: wrote xckpt.json with", len(json.loads((root / "xckpt.json").read_text())["tensors"]), "tensors")
print("verify:", ck.verify() or "no problems")
print("box arithmetic:", Box((0, 0), (4, 6)).intersect(Box((3, 2), (4, 4))))
