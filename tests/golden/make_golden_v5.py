"""Writes tests/golden/v5 once: format version 5 (grid entries: a tensor whose boxes form a
rectilinear grid over its writers is stored as split points, writers by rule and keys relative
to each writer's data directory; "dirs" for data/<rank>.<token> directories). Grids of array cells
(w), packed cells (p) and both (m: the short last cell of a torch.chunk split is packed); a
chunk list (odd); a packed row (bf16). Two checkpoints of one save layout: ckpt/ (an overwriting save, finalized: grids in xckpt.json) and ranks-only/
(rank manifests only: the reader recognises the grids as it merges them).
Never re-run to "fix" a failing golden test: a change that breaks reading these files is a
format change and needs a new version."""

from __future__ import annotations

import functools
import itertools
import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

import xckpt
import xckpt.native.writer
import xckpt.storage
from xckpt.layout import Box

root = Path(__file__).parent / "v5"
if (root / "ckpt").exists() or (root / "ranks-only").exists():
    sys.exit(f"{root} holds checkpoints; golden checkpoints are never regenerated")
# Zarr chunks of 64 bytes, so a cell's shard holds several of them.
xckpt.native.writer.inner_chunk_shape = functools.partial(xckpt.native._zarr.inner_chunk_shape, target=64)
W = 8
tensors = {
    "w": np.arange(24 * 10, dtype=np.float32).reshape(24, 10),  # a 4 x 2 grid of array cells
    "p": np.arange(16, dtype=np.int16).reshape(8, 2) * 3,  # 8 packed cells, one per rank
    "odd": np.linspace(-1, 1, 144).reshape(12, 12),  # 8 boxes that are not a grid: a chunk list
    "bf16": (np.arange(6, dtype=np.float32) / 3).astype(ml_dtypes.bfloat16),  # a packed row
    "m": np.arange(72, dtype=np.float64).reshape(36, 2) / 7,  # torch.chunk rows: 7 array cells, the last packed
}
# w: cell (i, j) of rows [6 i, 6 i + 6) and columns [5 j, 5 j + 5) written by rank 2 i + j.
boxes: dict[str, list[list[Box]]] = {n: [[] for _ in range(W)] for n in tensors}
for i, j in itertools.product(range(4), range(2)):
    boxes["w"][2 * i + j].append(Box((6 * i, 5 * j), (6, 5)))
# p: row k written by rank ORDER[k] (writers by list: no rule fits).
ORDER = [5, 0, 7, 2, 6, 1, 4, 3]
for k, r in enumerate(ORDER):
    boxes["p"][r].append(Box((k, 0), (1, 2)))
odd = [Box((0, 0), (6, 12))] + [Box((6 + k, 0), (1, 5)) for k in range(6)] + [Box((6, 5), (6, 7))]
for r, b in enumerate(odd):
    boxes["odd"][r].append(b)
boxes["bf16"][3].append(Box((0,), (6,)))
for r, (lo, n) in enumerate(xckpt.layout.chunk_sizes(36, W)):
    boxes["m"][r].append(Box((lo, 0), (n, 2)))


def write(path: Path, save_id: str, overwrite: bool) -> None:
    for r in range(W):
        w = xckpt.Writer(path, rank=r, world_size=W, save_id=save_id, storage="files", pack_threshold=64,
                         overwrite=overwrite)
        for name, arr in tensors.items():
            w.declare(name, arr.dtype, arr.shape)
            for b in boxes[name][r]:
                w.write(name, arr[b.slices()], global_shape=arr.shape, offset=b.offset)
        w.write_object("step", 500)
        w.write_object("rank", r, per_rank=True)
        w.commit()


write(root / "ckpt", "golden-5a", overwrite=False)
write(root / "ckpt", "golden-5", overwrite=True)  # data/<rank>.<token>/: the "dirs" member
xckpt.finalize(root / "ckpt", world_size=W, save_id="golden-5")
write(root / "ranks-only", "golden-5", overwrite=False)
merged = json.loads((root / "ckpt" / "xckpt.json").read_text())
expected = {
    "tensors": {k: {"dtype": v.dtype.name, "shape": list(v.shape), "hex": v.tobytes().hex()} for k, v in tensors.items()},
    "objects": {"step": 500},
    "grids": {n: merged["tensors"][n]["grid"] for n in ("w", "p", "m")},
    "dirs": merged["dirs"],
}
(root / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
print("wrote", root)
