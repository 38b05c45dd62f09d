"""Writes tests/golden/v3 once: format version 3 (storage "files": each stored box one
zarr v3 array of one shard file, c.0.0, holding its zarr chunks behind an index). Never re-run to "fix" a failing golden test:
a change that breaks reading these files is a format change and needs a new version."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

import xckpt
import xckpt.native.writer
import xckpt.storage

root = Path(__file__).parent / "v3"
if (root / "ckpt").exists():
    sys.exit(f"{root / 'ckpt'} exists; golden checkpoints are never regenerated")
# Zarr chunks of 64 bytes, so each box of "w" holds several in its shard.
xckpt.native.writer.inner_chunk_shape = functools.partial(xckpt.native._zarr.inner_chunk_shape, target=64)
tensors = {
    "w": np.arange(96, dtype=np.float32).reshape(12, 8),
    "bf16": (np.arange(6, dtype=np.float32) / 3).astype(ml_dtypes.bfloat16),
    "fp8": np.linspace(-2, 2, 8).astype(ml_dtypes.float8_e4m3fn),
    "scalar": np.array(7, dtype=np.int64),
}
for r, rows in enumerate([(0, 7), (7, 12)]):
    w = xckpt.Writer(root / "ckpt", rank=r, world_size=2, save_id="golden-3", storage="files", pack_threshold=32)
    w.write("w", tensors["w"][rows[0] : rows[1]], global_shape=(12, 8), offset=(rows[0], 0))
    if r == 0:
        for k in ("bf16", "fp8", "scalar"):
            w.write(k, tensors[k])
    w.write_object("step", 100)
    w.write_object("cfg", {"lr": 0.5, "betas": [0.9, 0.95]})
    w.commit()
xckpt.finalize(root / "ckpt", world_size=2, save_id="golden-3")
expected = {
    "tensors": {k: {"dtype": v.dtype.name, "shape": list(v.shape), "hex": v.tobytes().hex()} for k, v in tensors.items()},
    "objects": {"step": 100, "cfg": {"lr": 0.5, "betas": [0.9, 0.95]}},
}
(root / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
print("wrote", root)
